/* Tests of the layer-sliced KV manager (common/sched/slices.c): request-level placements on a sliced
 * pool are lossless when they change every few steps, with pauses, resumes, chunked prefill, prefix
 * hits and a device that cannot hold every layer; placements are refused without a sliced pool or when
 * malformed, changing nothing. The model is a real safetensors directory written by kvbank-mkmodel. */
#include <stdio.h>
#include <string.h>

#include "common/kv/block_pool.h"
#include "common/model/model.h"
#include "common/policy/policy.h"
#include "common/sched/engine.h"
#include "common/policy/fcfs.h"
#include "common/sched/stager.h"
#include "tests/harness.h"
#include "tests/testmodel.h"

enum { NR = 6, MAXTOK = 48, LAYERS = 6 };

typedef struct tokens {
    int32_t t[NR][MAXTOK];
    int n[NR];
    int finished;
} tokens;

static void on_token(void *ud, uint64_t id, int index, int32_t tok, uint64_t t_ns) {
    tokens *r = ud;
    ck_assert_int_eq(index, r->n[id]);
    r->t[id][r->n[id]++] = tok;
}

static void on_finish(void *ud, uint64_t id, kvb_finish why, kvb_status err) {
    tokens *r = ud;
    ck_assert_msg(why == KVB_FINISH_LENGTH, "request %llu finished %s (%s)", (unsigned long long)id, kvb_finish_str(why),
                  kvb_status_str(err));
    r->finished++;
}

/* Ragged prompts; 3 shares 28 tokens with 0 and 5 repeats 1 (prefix hits). */
static int32_t prompt[NR][60];
static const int plen[NR] = {45, 9, 30, 50, 17, 9};
static const int maxt[NR] = {30, 40, 20, 25, 33, 12};

static void make_prompts(void) {
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < plen[r]; i++) prompt[r][i] = (i * 17 + r * 31 + 3) % 200;
    memcpy(prompt[3], prompt[0], 28 * sizeof(int32_t));
    memcpy(prompt[5], prompt[1], 9 * sizeof(int32_t));
}

/* ---------------------------------------------------------------- a planner that moves layers around */

typedef struct placer {
    int step;
    int period;           /* a new random placement per request every `period` steps */
    int64_t paused;       /* request paused now, -1 none */
    int pause_until;
    int pauses, trims;
    uint64_t salt;
} placer;

static uint64_t mix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

/* Request id's host layers in epoch `ep`: each layer with probability 1/2 (never all of them, so a
 * block always keeps one layer on the device); depth 2 one time in four. */
static kvb_status place(placer *p, uint64_t id, kvb_plan *out) {
    uint64_t h = mix(id * 7919 + (uint64_t)(p->step / p->period) * 104729 + p->salt);
    int depth = (h >> 60) == 0 ? 2 : 1, l = 0;
    while (l < LAYERS) {
        if (!(h >> l & 1) || l == LAYERS - 1) {
            l++;
            continue;
        }
        int l1 = l;
        while (l1 < LAYERS - 1 && (h >> l1 & 1)) l1++;
        KVB_TRY(kvb_plan_push_place(out, (kvb_plan_place){.id = id, .layer0 = l, .layer1 = l1, .where = KVB_RES_HOST,
                                                          .depth = depth}));
        l = l1;
    }
    return KVB_OK;
}

/* One candidate plan: pause / resume, `n_preempt` newest running requests preempted, FCFS with at most
 * `n_admit` admissions, then every request left running gets its placement. */
static kvb_status attempt(placer *p, const kvb_view *v, kvb_plan *out, int n_preempt, int n_admit) {
    kvb_plan_reset(out);
    int ip = p->paused >= 0 ? kvb_view_find(v, (uint64_t)p->paused) : -1;
    if (ip >= 0 && v->reqs[ip].state == KVB_REQ_PAUSED && p->step >= p->pause_until)
        KVB_TRY(kvb_plan_push_op(out, (kvb_plan_op){.kind = KVB_OP_RESUME, .id = (uint64_t)p->paused}));
    int running = 0;
    for (int i = 0; i < v->n_running; i++) running += v->reqs[i].state == KVB_REQ_RUNNING;
    if (p->step % 11 == 5 && running >= 2 && (ip < 0 || v->reqs[ip].state != KVB_REQ_PAUSED))
        for (int i = 0; i < v->n_running; i++)
            if (v->reqs[i].state == KVB_REQ_RUNNING && v->reqs[i].n_computed > 0) {
                KVB_TRY(kvb_plan_push_op(out, (kvb_plan_op){.kind = KVB_OP_PAUSE, .id = v->reqs[i].id}));
                break;
            }
    for (int i = v->n_running - 1; i >= 0 && n_preempt > 0; i--) {
        if (v->reqs[i].state != KVB_REQ_RUNNING) continue;
        int mine = 0;
        for (int k = 0; k < out->n_ops; k++) mine |= out->ops[k].id == v->reqs[i].id;
        if (mine) continue;
        KVB_TRY(kvb_plan_push_op(out, (kvb_plan_op){.kind = KVB_OP_PREEMPT, .id = v->reqs[i].id}));
        n_preempt--;
    }
    kvb_fcfs_opts o = {0};
    KVB_TRY(kvb_fcfs_running(v, &o, out));
    int n_run = 0;
    for (int k = 0; k < out->n_ops; k++) n_run += out->ops[k].kind == KVB_OP_RUN;
    o.batch_limit = KVB_MIN(n_run + n_admit, v->max_seqs);
    if (o.batch_limit > 0) KVB_TRY(kvb_fcfs_admit(v, &o, out));
    int n_ops = out->n_ops;
    for (int i = 0; i < v->n_reqs; i++) {
        int state = v->reqs[i].state, paused_now = 0, gone = 0, admitted = 0;
        for (int k = 0; k < n_ops; k++) {
            if (out->ops[k].id != v->reqs[i].id) continue;
            paused_now |= out->ops[k].kind == KVB_OP_PAUSE;
            gone |= out->ops[k].kind == KVB_OP_PREEMPT;
            admitted |= out->ops[k].kind == KVB_OP_ADMIT;
            if (out->ops[k].kind == KVB_OP_RESUME) state = KVB_REQ_RUNNING;
        }
        if ((state == KVB_REQ_RUNNING && !paused_now && !gone) || admitted) KVB_TRY(place(p, v->reqs[i].id, out));
    }
    return KVB_OK;
}

static kvb_status placer_plan(void *ctx, const kvb_view *v, kvb_plan *out) {
    placer *p = ctx;
    for (int np = 0; np <= v->n_running; np++)
        for (int na = v->max_seqs; na >= 0; na--) {
            KVB_TRY(attempt(p, v, out, np, na));
            if (kvb_sched_cost(v, out, NULL, NULL, 0) == KVB_OK) {
                for (int k = 0; k < out->n_ops; k++)
                    if (out->ops[k].kind == KVB_OP_PAUSE) {
                        p->paused = (int64_t)out->ops[k].id;
                        p->pause_until = p->step + 4;
                        p->pauses++;
                    }
                p->trims += np + (na < v->max_seqs);
                p->step++;
                return KVB_OK;
            }
        }
    return KVB_ERR_EXHAUSTED;
}

static kvb_status placer_pool(void *ctx, const kvb_pool_event *ev, const kvb_view *v, kvb_pool_plan *out) {
    if (ev->kind == KVB_POOL_SETUP) {
        out->sliced_ids = 256;
        out->sliced_min_layers = 2; /* one layer kept, one prefetch slot (depth 2 needs 3: tight but possible) */
    }
    return KVB_OK;
}

static const kvb_planner_i placer_iface = {.name = "placer", .plan_step = placer_plan, .plan_pool = placer_pool};

/* ---------------------------------------------------------------- running */

static kvb_t_model tm;

static const kvb_link_model *g_links; /* the link model of the engines made next (NULL: off) */

static kvb_engine *engine(tokens *t, kvb_planner *pl, int bs, int n_blocks, int budget, int max_seqs) {
    kvb_engine_opts o;
    kvb_engine_opts_default(&o);
    if (g_links) o.links = *g_links;
    o.block_size = bs;
    o.n_blocks = n_blocks;
    o.max_batch_tokens = budget;
    o.max_seqs = max_seqs;
    kvb_engine_events ev = {.ud = t, .on_token = on_token, .on_finish = on_finish};
    kvb_engine *e = NULL;
    kvb_planner fcfs = kvb_policy_recompute(); /* NULL: vLLM scheduling */
    if (!pl) pl = &fcfs;
    ck_assert_int_eq(kvb_engine_create(tm.m, &o, pl, &ev, &e), KVB_OK);
    return e;
}

static void submit(kvb_engine *e, int r) {
    kvb_request q = {.id = (uint64_t)r, .prompt = prompt[r], .n_prompt = plen[r], .max_tokens = maxt[r]};
    ck_assert_msg(kvb_engine_add(e, &q) == KVB_OK, "add %d: %s", r, kvb_engine_last_error(e));
}

static void drain(kvb_engine *e) {
    for (int i = 0; i < 50000 && kvb_engine_n_live(e) > 0; i++)
        ck_assert_msg(kvb_engine_step(e) == KVB_OK, "step: %s", kvb_engine_last_error(e));
    ck_assert_int_eq(kvb_engine_n_live(e), 0);
}

static void reference(tokens *ref) {
    memset(ref, 0, sizeof *ref);
    for (int r = 0; r < NR; r++) {
        kvb_engine *e = engine(ref, NULL, 16, 64, 512, 8);
        submit(e, r);
        drain(e);
        kvb_engine_destroy(e);
    }
}

static void same(const tokens *a, const tokens *b, const char *what) {
    for (int r = 0; r < NR; r++) {
        ck_assert_msg(a->n[r] == b->n[r], "%s: request %d has %d tokens, reference %d", what, r, b->n[r], a->n[r]);
        for (int i = 0; i < a->n[r]; i++)
            ck_assert_msg(a->t[r][i] == b->t[r][i], "%s: request %d token %d: %d, reference %d", what, r, i, b->t[r][i],
                          a->t[r][i]);
    }
}

KVB_TEST(placements_lossless) {
    kvb_t_model_make(&tm, "--arch llama --layers 6 --hidden 64 --heads 4 --kv-heads 2 --vocab 200 --seed 17");
    make_prompts();
    static tokens ref, got;
    reference(&ref);
    /* block size, physical blocks (x 6 layers of slices), step budget, most running */
    /* the last two under link models: one after the other, and shared (slow enough that transfers
     * overlap the layers and each other) */
    const struct { int bs, blocks, budget, seqs, period, link; } cfg[] = {
        {4, 40, 12, 4, 3, 0}, {8, 14, 64, 3, 2, 0}, {1, 300, 7, 4, 5, 0}, {16, 8, 512, 6, 1, 0},
        {4, 40, 12, 4, 2, 1}, {8, 14, 64, 3, 1, 2}};
    kvb_link_model lm = {.name = "test", .scale = 1, .target_flops = 1};
    lm.links[KVB_LINK_HOST] = (kvb_link){50e6, 100e-6};
    for (size_t c = 0; c < KVB_ARRAY_LEN(cfg); c++) {
        lm.share = cfg[c].link == 2;
        g_links = cfg[c].link ? &lm : NULL;
        placer p = {.period = cfg[c].period, .paused = -1, .salt = c};
        kvb_planner pl = {&placer_iface, &p};
        memset(&got, 0, sizeof got);
        kvb_engine *e = engine(&got, &pl, cfg[c].bs, cfg[c].blocks, cfg[c].budget, cfg[c].seqs);
        ck_assert(kvb_block_pool_is_sliced(kvb_engine_pool(e)));
        for (int r = 0; r < 4; r++) submit(e, r);
        for (int i = 0; i < 7; i++) ck_assert_msg(kvb_engine_step(e) == KVB_OK, "%s", kvb_engine_last_error(e));
        submit(e, 4);
        submit(e, 5);
        drain(e);
        char what[64];
        snprintf(what, sizeof what, "config %zu", c);
        same(&ref, &got, what);
        kvb_slices_stats ss;
        kvb_engine_slices_stats(e, &ss);
        kvb_engine_stats st;
        kvb_engine_get_stats(e, &st);
        printf("config %zu: %llu steps, %d pauses, %d trims, %llu preemptions, %llu prefix-hit tokens; slices: %llu "
               "offloaded, %llu onloaded, %llu prefetched, %llu paused layers moved, %llu cached dropped, peak %d of %d\n",
               c, (unsigned long long)st.steps, p.pauses, p.trims, (unsigned long long)st.preemptions,
               (unsigned long long)st.prefix_hit_tokens, (unsigned long long)ss.slices_offloaded,
               (unsigned long long)ss.slices_onloaded, (unsigned long long)ss.slices_prefetched,
               (unsigned long long)ss.paused_layers_moved, (unsigned long long)ss.cached_dropped, ss.peak_used,
               cfg[c].blocks * LAYERS);
        ck_assert_int_gt(ss.slices_offloaded, 0);
        ck_assert_int_gt(ss.slices_onloaded, 0);
        ck_assert_int_gt(ss.slices_prefetched, 0);
        ck_assert_int_gt(p.pauses, 0);
        ck_assert_int_le(ss.peak_used, cfg[c].blocks * LAYERS);
        ck_assert_int_eq(st.blocks_free, st.blocks_total); /* nothing held at the end */
        g_links = NULL;
        if (c == 0) {
            ck_assert_int_gt(st.prefix_hit_tokens, 0);
            ck_assert_int_gt(p.trims, 0); /* the device could not hold everyone at some step */
        }
        kvb_engine_destroy(e);
    }
    kvb_t_model_free(&tm);
}
KVB_TEST_END

/* ---------------------------------------------------------------- refused placements */

typedef struct fixed {
    kvb_plan_place pl[2];
    int n;
} fixed;

static kvb_status fixed_plan(void *ctx, const kvb_view *v, kvb_plan *out) {
    fixed *f = ctx;
    KVB_TRY(kvb_fcfs(v, NULL, out));
    for (int k = 0; k < f->n; k++) KVB_TRY(kvb_plan_push_place(out, f->pl[k]));
    return KVB_OK;
}

static const kvb_planner_i fixed_iface = {.name = "fixed", .plan_step = fixed_plan, .plan_pool = placer_pool};
static const kvb_planner_i fixed_flat_iface = {.name = "fixed-flat", .plan_step = fixed_plan};

KVB_TEST(placements_refused) {
    kvb_t_model_make(&tm, "--arch llama --layers 6 --hidden 64 --heads 4 --kv-heads 2 --vocab 200 --seed 17");
    make_prompts();
    static tokens got;
    const struct { kvb_plan_place a, b; int n; const char *says; } bad[] = {
        {{.id = 9, .layer0 = 1, .layer1 = 2, .where = KVB_RES_HOST, .depth = 1}, {0}, 1, "no live request"},
        {{.id = 0, .layer0 = 1, .layer1 = 7, .where = KVB_RES_HOST, .depth = 1}, {0}, 1, "outside"},
        {{.id = 0, .layer0 = 1, .layer1 = 2, .where = KVB_RES_ABSENT, .depth = 1}, {0}, 1, "only HOST"},
        {{.id = 0, .layer0 = 1, .layer1 = 2, .where = KVB_RES_HOST, .depth = 3}, {0}, 1, "depth"},
        {{.id = 0, .layer0 = 1, .layer1 = 3, .where = KVB_RES_HOST, .depth = 1},
         {.id = 0, .layer0 = 2, .layer1 = 4, .where = KVB_RES_HOST, .depth = 1}, 2, "placed twice"},
        {{.id = 0, .layer0 = 1, .layer1 = 3, .where = KVB_RES_HOST, .depth = 1},
         {.id = 0, .layer0 = 4, .layer1 = 5, .where = KVB_RES_HOST, .depth = 2}, 2, "depth"},
    };
    for (size_t k = 0; k <= KVB_ARRAY_LEN(bad); k++) {
        /* the last case: a well-formed placement on an engine whose pool is not sliced */
        int flat = k == KVB_ARRAY_LEN(bad);
        fixed f = {.n = flat ? 1 : bad[k].n};
        if (flat) f.pl[0] = (kvb_plan_place){.id = 0, .layer0 = 1, .layer1 = 2, .where = KVB_RES_HOST, .depth = 1};
        else f.pl[0] = bad[k].a, f.pl[1] = bad[k].b;
        kvb_planner pl = {flat ? &fixed_flat_iface : &fixed_iface, &f};
        memset(&got, 0, sizeof got);
        kvb_engine *e = engine(&got, &pl, 4, 40, 64, 4);
        submit(e, 0);
        ck_assert_int_eq(kvb_engine_step(e), KVB_ERR_INVALID);
        const char *says = flat ? "not sliced" : bad[k].says;
        ck_assert_msg(strstr(kvb_engine_last_error(e), says), "case %zu: '%s' lacks '%s'", k, kvb_engine_last_error(e),
                      says);
        kvb_engine_stats st;
        kvb_engine_get_stats(e, &st);
        ck_assert_int_eq(st.steps, 0);
        ck_assert_int_eq(st.n_waiting, 1); /* nothing changed */
        ck_assert_int_eq(got.n[0], 0);
        kvb_engine_destroy(e);
    }
    /* a device too small for a placement's kept layers and slots is refused by the slice check */
    fixed f = {.n = 1, .pl = {{.id = 0, .layer0 = 1, .layer1 = 2, .where = KVB_RES_HOST, .depth = 2}}};
    kvb_planner pl = {&fixed_iface, &f};
    memset(&got, 0, sizeof got);
    kvb_engine *e = engine(&got, &pl, 4, 12, 64, 4); /* 72 slices; 45 tokens + 1 = 12 blocks x (5 + 2) = 84 */
    submit(e, 0);
    ck_assert_int_eq(kvb_engine_step(e), KVB_ERR_INVALID);
    ck_assert_msg(strstr(kvb_engine_last_error(e), "slices"), "%s", kvb_engine_last_error(e));
    kvb_engine_destroy(e);
    kvb_t_model_free(&tm);
}
KVB_TEST_END

/* ---------------------------------------------------------------- lending a sliced pool's tail */

KVB_TEST(sliced_lending) {
    kvb_t_model_make(&tm, "--arch llama --layers 6 --hidden 64 --heads 4 --kv-heads 2 --vocab 200 --seed 17");
    make_prompts();
    static tokens ref, got;
    reference(&ref);
    placer p = {.period = 2, .paused = -1, .salt = 99};
    kvb_planner pl = {&placer_iface, &p};
    memset(&got, 0, sizeof got);
    kvb_engine *e = engine(&got, &pl, 4, 60, 16, 4);
    ck_assert_int_eq(kvb_engine_free_tail(e), 60);
    submit(e, 0);
    for (int i = 0; i < 4; i++) ck_assert_int_eq(kvb_engine_step(e), KVB_OK);
    /* slices are handed out lowest first: the tail is free while request 0 runs */
    int tail = kvb_engine_free_tail(e);
    ck_assert_int_gt(tail, 40);
    ck_assert_int_lt(tail, 60);
    ck_assert_int_eq(kvb_engine_shrink(e, 60 - tail - 1), KVB_ERR_STATE); /* a slice in use: nothing changes */
    ck_assert_int_eq(kvb_engine_n_own(e), 60);
    ck_assert_int_eq(kvb_engine_shrink(e, 60 - tail), KVB_OK); /* lent */
    ck_assert_int_eq(kvb_block_pool_n_slices(kvb_engine_pool(e)), (60 - tail) * LAYERS);
    for (int r = 1; r < NR; r++) submit(e, r);
    drain(e);
    same(&ref, &got, "lent tail");
    ck_assert_int_eq(kvb_engine_grow(e, 60), KVB_OK);
    ck_assert_int_eq(kvb_engine_free_tail(e), 60);
    kvb_engine_destroy(e);
    kvb_t_model_free(&tm);
}
KVB_TEST_END

/* ---------------------------------------------------------------- the stager's sharing links */

static double since(uint64_t t0) { return (double)(kvb_now_ns() - t0) * 1e-9; }

/* The link model paces copies with real sleeps, so its schedule is read off the wall clock. Hard lower
 * bounds are the link's physics: a copy cannot land before its bytes alone could, nor a set of copies
 * before all their bytes could. Which model ran (shared against post order, duplex against one link) is
 * told by bounds a loaded machine can miss (a descheduled test or copy thread) but never meet wrongly, so
 * they are checked on the best of up to TRIES runs. */
enum { TRIES = 3 };

KVB_TEST(stager_sharing) {
    kvb_backend *be;
    ck_assert_int_eq(kvb_backend_create("cpu", 1, &be), KVB_OK);
    /* 20 MB/s and 2 ms per transfer, shared: a MiB alone takes 2 + 52.4 ms */
    kvb_link_model lm = {.name = "shared", .scale = 1, .target_flops = 1, .share = 1};
    lm.links[KVB_LINK_HOST] = (kvb_link){20e6, 2e-3};
    kvb_stager *s;
    ck_assert_int_eq(kvb_stager_create(be, &lm, &s), KVB_OK);
    enum { MB = 1 << 20, Q = MB / 4 };
    const double bw = 20e6, lat = 2e-3;
    unsigned char *src = malloc(4 * MB), *dst = calloc(4, MB), *back = calloc(1, MB);
    for (int i = 0; i < 4 * MB; i++) src[i] = (unsigned char)(i * 13 + 1);
    /* two equal transfers posted together share the link: both land at lat + 2 MiB / bw. Hard bounds:
     * neither lands before a MiB alone could, the second not before both MiB could. That they shared
     * (in post order the first lands at lat + 1 MiB / bw) is checked on the best of TRIES runs: the
     * copy thread may notice the second post late, and the first runs alone meanwhile. */
    kvb_xfer a = {dst, src, MB}, b = {dst + MB, src + MB, MB};
    double wa = 0, wb = 0;
    int copies = 0;
    for (int k = 0; k < TRIES && wa < lat + 1.5 * MB / bw; k++) {
        uint64_t ta, tb;
        memset(dst, 0, 2 * MB);
        uint64_t t0 = kvb_now_ns();
        ck_assert_int_eq(kvb_stager_post(s, KVB_LINK_HOST, KVB_XFER_H2D, &a, 1, &ta), KVB_OK);
        ck_assert_int_eq(kvb_stager_post(s, KVB_LINK_HOST, KVB_XFER_H2D, &b, 1, &tb), KVB_OK);
        ck_assert_int_eq(kvb_stager_wait(s, ta), KVB_OK);
        wa = since(t0);
        ck_assert_int_eq(kvb_stager_wait(s, tb), KVB_OK);
        wb = since(t0);
        copies += 2;
        ck_assert_double_ge(wa, lat + (double)MB / bw * 0.999);
        ck_assert_double_ge(wb, lat + 2.0 * MB / bw * 0.999);
        ck_assert_double_ge(wb, wa);
        ck_assert_int_eq(memcmp(dst, src, 2 * MB), 0);
        ck_assert_int_eq(kvb_stager_drain(s), KVB_OK);
    }
    ck_assert_msg(wa >= lat + 1.5 * MB / bw, "the first of two equal transfers took %.4f s in %d runs, alone %.4f s",
                  wa, TRIES, lat + MB / bw);
    /* a small transfer posted after a large one is not queued behind it: a quarter MiB shares the link
     * and lands at lat + 2 Q / bw = 28 ms; in post order it would wait for the MiB (69 ms) */
    double ws = 1e9, wl = 0;
    for (int k = 0; k < TRIES && ws >= 2 * lat + (double)(MB + Q) / bw; k++) {
        kvb_xfer big = {dst + 2 * MB, src + 2 * MB, MB}, small = {dst + 3 * MB, src + 3 * MB, Q};
        uint64_t tbig, tsmall;
        memset(dst + 2 * MB, 0, MB + Q);
        uint64_t t0 = kvb_now_ns();
        ck_assert_int_eq(kvb_stager_post(s, KVB_LINK_HOST, KVB_XFER_H2D, &big, 1, &tbig), KVB_OK);
        ck_assert_int_eq(kvb_stager_post(s, KVB_LINK_HOST, KVB_XFER_H2D, &small, 1, &tsmall), KVB_OK);
        ck_assert_int_eq(kvb_stager_wait(s, tsmall), KVB_OK);
        ws = since(t0);
        ck_assert_int_eq(kvb_stager_wait(s, tbig), KVB_OK);
        wl = since(t0);
        copies += 2;
        ck_assert_double_ge(ws, lat + 2.0 * Q / bw * 0.999);
        ck_assert_double_ge(wl, lat + (double)(MB + Q) / bw * 0.999);
        ck_assert_int_eq(memcmp(dst + 2 * MB, src + 2 * MB, MB + Q), 0);
    }
    printf("sharing: two equal MiB %.1f / %.1f ms (model %.1f); a quarter after a MiB %.1f ms (model %.1f, in post "
           "order %.1f); the MiB %.1f ms (model %.1f)\n",
           wa * 1e3, wb * 1e3, (lat + 2.0 * MB / bw) * 1e3, ws * 1e3, (lat + 2.0 * Q / bw) * 1e3,
           (2 * lat + (double)(MB + Q) / bw) * 1e3, wl * 1e3, (lat + (double)(MB + Q) / bw) * 1e3);
    ck_assert_msg(ws < 2 * lat + (double)(MB + Q) / bw, "the quarter MiB waited for the MiB in %d runs: %.4f s", TRIES,
                  ws);
    /* the two directions do not share: a load and a store together each take lat + MiB / bw */
    double wd = 1e9;
    for (int k = 0; k < TRIES && wd >= lat + 2.0 * MB / bw; k++) {
        kvb_xfer in = {dst, src + MB, MB}, out = {back, src + 2 * MB, MB};
        uint64_t tin, tout;
        memset(back, 0, MB);
        uint64_t t0 = kvb_now_ns();
        ck_assert_int_eq(kvb_stager_post(s, KVB_LINK_HOST, KVB_XFER_H2D, &in, 1, &tin), KVB_OK);
        ck_assert_int_eq(kvb_stager_post(s, KVB_LINK_HOST, KVB_XFER_D2H, &out, 1, &tout), KVB_OK);
        ck_assert_int_eq(kvb_stager_drain(s), KVB_OK);
        wd = since(t0);
        copies += 2;
        ck_assert_double_ge(wd, lat + (double)MB / bw * 0.999);
        ck_assert_int_eq(memcmp(back, src + 2 * MB, MB), 0);
    }
    ck_assert_msg(wd < lat + 2.0 * MB / bw, "full duplex: a load and a store took %.4f s together in %d runs", wd, TRIES);
    kvb_link_report rep[KVB_LINK_COUNT];
    kvb_stager_take_report(s, rep);
    ck_assert_uint_eq(rep[KVB_LINK_HOST].copies, (unsigned)copies);
    ck_assert_double_le(rep[KVB_LINK_HOST].gbps, 2 * bw * 1e-9 + 1e-9); /* at most both directions at full rate */
    ck_assert_double_ge(rep[KVB_LINK_HOST].gbps, 0.5 * bw * 1e-9);
    kvb_stager_destroy(s);
    kvb_backend_destroy(be);
    free(src);
    free(dst);
    free(back);
}
KVB_TEST_END

/* ---------------------------------------------------------------- the per-request SLO */

static kvb_status slo_plan(void *ctx, const kvb_view *v, kvb_plan *out) {
    uint64_t *seen = ctx;
    for (int i = 0; i < v->n_reqs; i++) seen[v->reqs[i].id] = v->reqs[i].tbt_slo_ns;
    return kvb_fcfs(v, NULL, out);
}

static const kvb_planner_i slo_iface = {.name = "slo", .plan_step = slo_plan};

KVB_TEST(request_slo) {
    kvb_t_model_make(&tm, "--arch llama --layers 2 --hidden 32 --heads 2 --kv-heads 1 --vocab 200 --seed 3");
    make_prompts();
    static tokens got;
    uint64_t seen[NR] = {0};
    kvb_planner pl = {&slo_iface, seen};
    kvb_engine *e = engine(&got, &pl, 4, 64, 64, 4);
    kvb_request q = {.id = 1, .prompt = prompt[1], .n_prompt = plen[1], .max_tokens = 2, .tbt_slo_ms = 12.5};
    ck_assert_int_eq(kvb_engine_add(e, &q), KVB_OK);
    q.id = 2;
    q.tbt_slo_ms = 0;
    ck_assert_int_eq(kvb_engine_add(e, &q), KVB_OK);
    q.id = 3;
    q.tbt_slo_ms = -1;
    ck_assert_int_eq(kvb_engine_add(e, &q), KVB_ERR_INVALID);
    ck_assert_msg(strstr(kvb_engine_last_error(e), "tbt_slo_ms"), "%s", kvb_engine_last_error(e));
    q.tbt_slo_ms = 1.0 / 0.0;
    ck_assert_int_eq(kvb_engine_add(e, &q), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_engine_step(e), KVB_OK);
    ck_assert_uint_eq(seen[1], 12500000);
    ck_assert_uint_eq(seen[2], 0);
    drain(e);
    kvb_engine_destroy(e);
    kvb_t_model_free(&tm);
}
KVB_TEST_END

KVB_TEST_MAIN("slices", KVB_T(placements_lossless, 300), KVB_T(placements_refused, 60), KVB_T(request_slo, 30), KVB_T(sliced_lending, 120), KVB_T(stager_sharing, 60))
