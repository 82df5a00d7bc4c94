/* Tests of the engine (common/sched): lossless scheduling (prefix-cache hits, preemption by
 * recompute, chunked prefill and batching give exactly the tokens of a plain run), cancellation,
 * rejection of bad requests, stop ids, seeded sampling, and no leaked blocks. The model is a real
 * safetensors directory written by kvbank-mkmodel in a temporary directory. */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/kv/block_pool.h"
#include "common/model/model.h"
#include "common/policy/fcfs.h"
#include "common/policy/policy.h"
#include "common/sched/engine.h"
#include "common/sched/sampling.h"
#include "tests/harness.h"
#include "tests/testmodel.h"

#define MAXR 8
#define MAXT 256

typedef struct rec {
    int32_t toks[MAXR][MAXT];
    int n[MAXR];
    kvb_finish fin[MAXR];
    int finished;
} rec;

static void on_token(void *ud, uint64_t id, int index, int32_t tok, uint64_t t_ns) {
    rec *r = ud;
    ck_assert_int_lt(id, MAXR);
    ck_assert_int_eq(index, r->n[id]); /* tokens arrive in order, once */
    r->toks[id][r->n[id]++] = tok;
}
static void on_finish(void *ud, uint64_t id, kvb_finish why, kvb_status err) {
    rec *r = ud;
    ck_assert_int_eq(r->fin[id], KVB_FINISH_NONE);
    r->fin[id] = why;
    r->finished++;
}

static kvb_t_model tm;
static kvb_model *model;

static void setup_model(const char *arch) {
    char args[256];
    snprintf(args, sizeof args, "--arch %s --layers 2 --hidden 64 --heads 4 --kv-heads 2 --vocab 200 --seed 7", arch);
    kvb_t_model_make(&tm, args);
    model = tm.m;
}

static void teardown_model(void) { kvb_t_model_free(&tm); }

static kvb_engine *make_engine(rec *r, int block_size, int n_blocks, int budget, int prefix) {
    kvb_engine_opts o;
    kvb_engine_opts_default(&o);
    o.block_size = block_size;
    o.n_blocks = n_blocks;
    o.max_batch_tokens = budget;
    o.enable_prefix_cache = prefix;
    kvb_engine_events ev = {.ud = r, .on_token = on_token, .on_finish = on_finish};
    kvb_planner pl = kvb_policy_recompute();
    kvb_engine *e = NULL;
    ck_assert_int_eq(kvb_engine_create(model, &o, &pl, &ev, &e), KVB_OK);
    return e;
}

static void run(kvb_engine *e) {
    for (int i = 0; i < 10000 && kvb_engine_n_live(e) > 0; i++) ck_assert_int_eq(kvb_engine_step(e), KVB_OK);
    ck_assert_int_eq(kvb_engine_n_live(e), 0);
}

static void add(kvb_engine *e, uint64_t id, const int32_t *p, int n, int max_tokens) {
    kvb_request q = {.id = id, .prompt = p, .n_prompt = n, .max_tokens = max_tokens};
    ck_assert_int_eq(kvb_engine_add(e, &q), KVB_OK);
}

/* every block is free or an evictable prefix-cache entry once nothing runs */
static void assert_no_leak(kvb_engine *e) {
    kvb_engine_stats s;
    kvb_engine_get_stats(e, &s);
    ck_assert_int_eq(s.blocks_free, s.blocks_total);
}

static int32_t P[3][64];
static const int PL[3] = {37, 5, 23};
static void make_prompts(void) {
    for (int r = 0; r < 3; r++)
        for (int i = 0; i < PL[r]; i++) P[r][i] = (i * 13 + r * 29 + 1) % 200;
}

/* The reference: each prompt alone, ample pool, no prefix cache. */
static void solo(rec *ref, int max_tokens) {
    memset(ref, 0, sizeof *ref);
    for (int r = 0; r < 3; r++) {
        kvb_engine *e = make_engine(ref, 16, 64, 512, 0);
        add(e, (uint64_t)r, P[r], PL[r], max_tokens);
        run(e);
        kvb_engine_destroy(e);
    }
}

static void assert_same(const rec *a, const rec *b, int n_req) {
    for (int r = 0; r < n_req; r++) {
        ck_assert_int_eq(a->n[r], b->n[r]);
        for (int i = 0; i < a->n[r]; i++) ck_assert_msg(a->toks[r][i] == b->toks[r][i], "request %d token %d: %d vs %d", r,
                                                         i, a->toks[r][i], b->toks[r][i]);
    }
}

KVB_TEST(batch_chunk_preempt_lossless) {
    setup_model("llama");
    make_prompts();
    static rec ref, got;
    solo(&ref, 40);
    struct { int bs, blocks, budget; int expect_preempt; } cfgs[] = {
        {16, 64, 512, 0}, /* one continuous batch */
        {16, 64, 7, 0},   /* chunked prefill with a 7-token budget */
        {1, 400, 512, 0}, /* block size 1 */
        {8, 13, 512, 1},  /* a pool too small for all three at once: preemption by recompute */
        {4, 23, 9, 1},    /* both */
    };
    for (size_t c = 0; c < KVB_ARRAY_LEN(cfgs); c++) {
        memset(&got, 0, sizeof got);
        kvb_engine *e = make_engine(&got, cfgs[c].bs, cfgs[c].blocks, cfgs[c].budget, 1);
        for (int r = 0; r < 3; r++) add(e, (uint64_t)r, P[r], PL[r], 40);
        run(e);
        kvb_engine_stats s;
        kvb_engine_get_stats(e, &s);
        if (cfgs[c].expect_preempt) ck_assert_msg(s.preemptions > 0, "config %zu did not preempt", c);
        else ck_assert_int_eq(s.preemptions, 0);
        assert_same(&ref, &got, 3);
        for (int r = 0; r < 3; r++) ck_assert_int_eq(got.fin[r], KVB_FINISH_LENGTH);
        assert_no_leak(e);
        kvb_engine_destroy(e);
    }
    teardown_model();
}
KVB_TEST_END

KVB_TEST(prefix_hit_lossless) {
    setup_model("qwen3");
    make_prompts();
    /* turn 2 = turn 1 prompt + its answer + new tokens; run after turn 1 in the same engine */
    static rec r1, plain;
    memset(&r1, 0, sizeof r1);
    kvb_engine *e = make_engine(&r1, 8, 64, 512, 1);
    add(e, 0, P[0], PL[0], 20);
    run(e);
    int32_t turn2[128];
    int n2 = 0;
    memcpy(turn2, P[0], sizeof(int32_t) * PL[0]);
    n2 = PL[0];
    memcpy(turn2 + n2, r1.toks[0], sizeof(int32_t) * 20);
    n2 += 20;
    turn2[n2++] = 11;
    turn2[n2++] = 12;
    add(e, 1, turn2, n2, 30);
    run(e);
    kvb_engine_stats s;
    kvb_engine_get_stats(e, &s);
    /* turn 1 computed 37 + 19 tokens of KV: 7 full blocks of 8 are reusable */
    ck_assert_int_eq(s.prefix_hit_tokens, 56);
    assert_no_leak(e);
    kvb_engine_destroy(e);

    memset(&plain, 0, sizeof plain);
    e = make_engine(&plain, 8, 64, 512, 0);
    add(e, 1, turn2, n2, 30);
    run(e);
    kvb_engine_get_stats(e, &s);
    ck_assert_int_eq(s.prefix_hit_tokens, 0);
    kvb_engine_destroy(e);
    ck_assert_int_eq(r1.n[1], 30);
    for (int i = 0; i < 30; i++) ck_assert_int_eq(r1.toks[1][i], plain.toks[1][i]);

    /* the same prompt twice: the second hits every full block but the one holding the last token */
    memset(&r1, 0, sizeof r1);
    e = make_engine(&r1, 8, 64, 512, 1);
    add(e, 0, P[0], 32, 5);
    run(e);
    add(e, 1, P[0], 32, 5);
    run(e);
    kvb_engine_get_stats(e, &s);
    ck_assert_int_eq(s.prefix_hit_tokens, 24);
    for (int i = 0; i < 5; i++) ck_assert_int_eq(r1.toks[0][i], r1.toks[1][i]);
    kvb_engine_destroy(e);
    teardown_model();
}
KVB_TEST_END

KVB_TEST(cancel_and_reject) {
    setup_model("llama");
    make_prompts();
    static rec ref, got;
    solo(&ref, 30);
    memset(&got, 0, sizeof got);
    kvb_engine *e = make_engine(&got, 16, 64, 512, 1);
    add(e, 0, P[0], PL[0], 30);
    add(e, 1, P[1], PL[1], 30);
    add(e, 2, P[2], PL[2], 30);
    for (int i = 0; i < 5; i++) ck_assert_int_eq(kvb_engine_step(e), KVB_OK);
    ck_assert_int_eq(kvb_engine_cancel(e, 1), KVB_OK);
    ck_assert_int_eq(got.fin[1], KVB_FINISH_CANCELLED);
    ck_assert_int_eq(kvb_engine_cancel(e, 1), KVB_ERR_NOT_FOUND);
    ck_assert_int_eq(kvb_engine_cancel(e, 99), KVB_ERR_NOT_FOUND);

    /* bad requests are rejected and change nothing */
    int32_t bad_tok[2] = {5, 200};
    kvb_request q = {.id = 5, .prompt = P[0], .n_prompt = 0, .max_tokens = 3};
    ck_assert_int_eq(kvb_engine_add(e, &q), KVB_ERR_INVALID); /* empty */
    q.prompt = bad_tok;
    q.n_prompt = 2;
    ck_assert_int_eq(kvb_engine_add(e, &q), KVB_ERR_INVALID); /* id >= vocab */
    q.prompt = P[0];
    q.n_prompt = 3;
    q.max_tokens = 0;
    ck_assert_int_eq(kvb_engine_add(e, &q), KVB_ERR_INVALID); /* max_tokens 0 */
    q.max_tokens = 64 * 16; /* can never fit the pool */
    ck_assert_int_eq(kvb_engine_add(e, &q), KVB_ERR_INVALID);
    q.max_tokens = 3;
    q.id = 0; /* duplicate of a live request */
    ck_assert_int_eq(kvb_engine_add(e, &q), KVB_ERR_INVALID);
    q.id = 6;
    q.sampling.top_p = 1.5f;
    ck_assert_int_eq(kvb_engine_add(e, &q), KVB_ERR_INVALID);
    run(e);
    ck_assert_int_eq(got.fin[0], KVB_FINISH_LENGTH);
    ck_assert_int_eq(got.fin[2], KVB_FINISH_LENGTH);
    ck_assert_int_eq(got.finished, 3);
    for (int r = 0; r < 3; r += 2)
        for (int i = 0; i < 30; i++) ck_assert_int_eq(got.toks[r][i], ref.toks[r][i]);
    for (int i = 0; i < got.n[1]; i++) ck_assert_int_eq(got.toks[1][i], ref.toks[1][i]);
    assert_no_leak(e);
    kvb_engine_destroy(e);
    teardown_model();
}
KVB_TEST_END

KVB_TEST(stop_ids_and_sampling) {
    setup_model("llama");
    make_prompts();
    static rec ref, got;
    solo(&ref, 30);
    /* stop at the 6th greedy token: it is emitted, then FINISH_STOP */
    memset(&got, 0, sizeof got);
    kvb_engine *e = make_engine(&got, 16, 64, 512, 1);
    int32_t stop = ref.toks[0][5];
    int first = 0;
    while (ref.toks[0][first] != stop) first++;
    kvb_request q = {.id = 0, .prompt = P[0], .n_prompt = PL[0], .max_tokens = 30, .stop_ids = &stop, .n_stop = 1};
    ck_assert_int_eq(kvb_engine_add(e, &q), KVB_OK);
    run(e);
    ck_assert_int_eq(got.fin[0], KVB_FINISH_STOP);
    ck_assert_int_eq(got.n[0], first + 1);

    /* seeded sampling is reproducible; top_k = 1 is greedy; different seeds differ somewhere */
    rec *s3 = calloc(3, sizeof(rec));
    for (int k = 0; k < 3; k++) {
        kvb_engine *e2 = make_engine(&s3[k], 16, 64, 512, 1);
        kvb_request sq = {.id = 0, .prompt = P[0], .n_prompt = PL[0], .max_tokens = 30,
                          .sampling = {.temperature = 1.5f, .top_p = 0.95f, .seed = k == 2 ? 99 : 42}};
        ck_assert_int_eq(kvb_engine_add(e2, &sq), KVB_OK);
        sq.id = 1;
        sq.sampling = (kvb_sampling){.temperature = 0.7f, .top_k = 1, .seed = 5};
        ck_assert_int_eq(kvb_engine_add(e2, &sq), KVB_OK);
        run(e2);
        kvb_engine_destroy(e2);
    }
    ck_assert_int_eq(memcmp(s3[0].toks[0], s3[1].toks[0], sizeof(int32_t) * 30), 0);
    ck_assert_int_ne(memcmp(s3[0].toks[0], s3[2].toks[0], sizeof(int32_t) * 30), 0);
    for (int i = 0; i < 30; i++) ck_assert_int_eq(s3[0].toks[1][i], ref.toks[0][i]);
    free(s3);
    kvb_engine_destroy(e);
    teardown_model();
}
KVB_TEST_END

/* The host_tier_lossless scenario with the host-tier planner's `layered` and `writeback`; the stats and the
 * host link's transfers during turn 2 in *s and *turn2_copies, turn 2's prompt in turn2[*n2]. */
static void host_tier_turns(int layered, const char *writeback, rec *r, kvb_engine_stats *s, uint64_t *turn2_copies,
                            int32_t *turn2, int *n2) {
    memset(r, 0, sizeof *r);
    kvb_engine_opts o;
    kvb_engine_opts_default(&o);
    o.block_size = 8;
    o.n_blocks = 10;
    kvb_policy_params pp = {0};
    char lay[32], wb[32];
    snprintf(lay, sizeof lay, "layered=%d", layered);
    snprintf(wb, sizeof wb, "writeback=%s", writeback);
    ck_assert_int_eq(kvb_policy_params_add(&pp, "blocks=32"), KVB_OK); /* a host tier of 32 blocks */
    ck_assert_int_eq(kvb_policy_params_add(&pp, lay), KVB_OK);
    ck_assert_int_eq(kvb_policy_params_add(&pp, wb), KVB_OK);
    kvb_planner pl;
    ck_assert_int_eq(kvb_policy_create("host-tier", &pp, &pl), KVB_OK);
    kvb_policy_params_free(&pp);
    kvb_engine_events ev = {.ud = r, .on_token = on_token, .on_finish = on_finish};
    kvb_engine *e = NULL;
    ck_assert_int_eq(kvb_engine_create(model, &o, &pl, &ev, &e), KVB_OK);
    add(e, 0, P[0], PL[0], 20); /* 57 tokens: 7 full blocks published */
    run(e);
    int32_t other[64];
    for (int i = 0; i < 64; i++) other[i] = (i * 31 + 5) % 200;
    add(e, 1, other, 60, 10); /* needs 9 of the 10 blocks: evicts turn 1's cached blocks */
    run(e);
    kvb_engine_get_stats(e, s);
    ck_assert_uint_gt(s->host_tier_stores, 0);
    uint64_t c0 = s->links[KVB_LINK_HOST].copies;
    *n2 = PL[0];
    memcpy(turn2, P[0], sizeof(int32_t) * PL[0]);
    memcpy(turn2 + *n2, r->toks[0], sizeof(int32_t) * 20);
    *n2 += 20;
    turn2[(*n2)++] = 9;
    add(e, 2, turn2, *n2, 12);
    run(e);
    kvb_engine_get_stats(e, s);
    *turn2_copies = s->links[KVB_LINK_HOST].copies - c0;
    assert_no_leak(e);
    kvb_engine_destroy(e);
}

KVB_TEST(host_tier_lossless) {
    /* turn 1 fills the cache, an unrelated request evicts it from a small pool, turn 2 (turn 1's prompt +
     * answer + new ids) finds its prefix in the host tier, copies it back, and gives the plain tokens;
     * the hits whole before the step (layered=0) and layer by layer behind the compute (layered=1), the
     * evictions written back when evicted (sync) and ahead of them (async) */
    setup_model("llama");
    make_prompts();
    static rec r[2][2], plain;
    kvb_engine_stats s[2][2];
    uint64_t c[2][2];
    int32_t turn2[128];
    int n2 = 0;
    static const char *const wb[2] = {"sync", "async"};
    for (int w = 0; w < 2; w++)
        for (int layered = 0; layered < 2; layered++) {
            host_tier_turns(layered, wb[w], &r[w][layered], &s[w][layered], &c[w][layered], turn2, &n2);
            kvb_engine_stats *st = &s[w][layered];
            ck_assert_uint_gt(st->host_tier_loads, 1);
            ck_assert_uint_ge(st->prefix_hit_tokens, st->host_tier_loads * 8);
            ck_assert_uint_gt(st->host_tier_stores, 1);
            /* batched (issue 10): a step's demotions go out in one transfer, a request's hits come back in
             * one (layered: one per layer) */
            ck_assert_uint_lt(st->links[KVB_LINK_HOST].copies, st->host_tier_stores + (uint64_t)layered);
            if (w == 0) ck_assert_uint_eq(st->host_tier_stores_ahead, 0);
            else ck_assert_uint_gt(st->host_tier_stores_ahead, 0);
        }
    for (int w = 0; w < 2; w++) {
        /* the same work: what differs is how the loads' transfers go, one for the hits or one per layer */
        ck_assert_uint_eq(s[w][1].host_tier_loads, s[w][0].host_tier_loads);
        ck_assert_uint_eq(s[w][1].host_tier_stores, s[w][0].host_tier_stores);
        /* turn 2's transfers, layered: at least its hits' L = 2 loads and the step's demotions */
        ck_assert_uint_ge(c[w][1], 3);
        ck_assert_uint_ge(c[w][0], 2);
    }

    memset(&plain, 0, sizeof plain);
    kvb_engine *e = make_engine(&plain, 8, 64, 512, 0);
    add(e, 2, turn2, n2, 12);
    run(e);
    kvb_engine_destroy(e);
    for (int w = 0; w < 2; w++)
        for (int k = 0; k < 2; k++)
            for (int i = 0; i < 12; i++) ck_assert_int_eq(r[w][k].toks[2][i], plain.toks[2][i]);
    teardown_model();
}
KVB_TEST_END

/* The host-tier planner's pool (32 host blocks, a prefix cache there, layered loads, write-back ahead of
 * eviction) and FCFS, recording the host-tier blocks the last plan's view could read. */
typedef struct wb_probe {
    int host_cached; /* idle cached host-tier blocks: what a prefix match can load */
} wb_probe;

static kvb_status probe_plan(void *ctx, const kvb_view *v, kvb_plan *out) {
    ((wb_probe *)ctx)->host_cached = v->pool.host_evictable;
    return kvb_fcfs(v, NULL, out);
}

static kvb_status probe_pool(void *ctx, const kvb_pool_event *ev, const kvb_view *v, kvb_pool_plan *out) {
    (void)ctx;
    (void)v;
    if (ev->kind != KVB_POOL_SETUP) return KVB_OK;
    out->host_tier_blocks = 32;
    out->host_prefix = 1;
    out->host_layered = 1;
    out->host_async_writeback = 1;
    return KVB_OK;
}

static const kvb_planner_i probe_iface = {.name = "wb-probe", .plan_step = probe_plan, .plan_pool = probe_pool};

static kvb_engine_stats stats_of(const kvb_engine *e) {
    kvb_engine_stats s;
    kvb_engine_get_stats(e, &s);
    return s;
}

KVB_TEST(host_tier_async_writeback) {
    /* The host link takes 2 s a transfer (the link model), so a write-back is in flight for 2 s while a
     * step of this model takes milliseconds. A 10-block pool holds turn 1's 7 cached blocks; an unrelated
     * request's prefill evicts 5 of them (copied when evicted: the step waits for those) and the step
     * writes the 2 left back ahead, asynchronously. The decode steps after it need none of them and do
     * not wait; their plans cannot read those host copies yet. The step that evicts one of them for the
     * request's 9th block waits until the write-back has landed, and the copies become readable. A
     * synchronous write-back leaves nothing in flight after a step. Turn 2 then loads its prefix from the
     * host tier and gives the tokens of a plain run. */
    setup_model("llama");
    make_prompts();
    static rec got, plain;
    memset(&got, 0, sizeof got);
    kvb_engine_opts o;
    kvb_engine_opts_default(&o);
    o.block_size = 8;
    o.n_blocks = 10;
    ck_assert_int_eq(kvb_link_preset_find("off", &o.links), KVB_OK);
    o.links.links[KVB_LINK_HOST] = (kvb_link){.bytes_per_s = 0, .latency_s = 2.0};
    wb_probe probe = {0};
    kvb_planner pl = {.iface = &probe_iface, .ctx = &probe};
    kvb_engine_events ev = {.ud = &got, .on_token = on_token, .on_finish = on_finish};
    kvb_engine *e = NULL;
    ck_assert_int_eq(kvb_engine_create(model, &o, &pl, &ev, &e), KVB_OK);
    add(e, 0, P[0], PL[0], 20); /* 57 tokens: 7 full blocks cached, 1 partial freed */
    run(e);
    kvb_engine_stats s = stats_of(e);
    ck_assert_uint_eq(s.host_tier_stores, 0);
    int32_t other[64];
    for (int i = 0; i < 64; i++) other[i] = (i * 31 + 5) % 200;
    add(e, 1, other, 60, 10); /* 8 blocks for its prompt, a 9th at token 64 */

    ck_assert_int_eq(kvb_engine_step(e), KVB_OK); /* the prefill: 3 free blocks and 5 evicted */
    s = stats_of(e);
    ck_assert_uint_eq(s.host_tier_stores, 7);
    ck_assert_uint_eq(s.host_tier_stores_ahead, 2);
    ck_assert_int_eq(s.host_tier_wb_in_flight, 2); /* the step returned before its write-back landed */
    ck_assert_uint_eq(s.host_tier_wb_waits, 0);
    for (int k = 0; k < 4; k++) { /* decodes at positions 60..63: inside the 8 blocks */
        ck_assert_int_eq(kvb_engine_step(e), KVB_OK);
        s = stats_of(e);
        ck_assert_int_eq(s.host_tier_wb_in_flight, 2);
        ck_assert_uint_eq(s.host_tier_wb_waits, 0);
        ck_assert_int_eq(probe.host_cached, 5); /* the copies in flight are not readable */
    }
    ck_assert_int_eq(kvb_engine_step(e), KVB_OK); /* position 64: a 9th block, evicting one in flight */
    s = stats_of(e);
    ck_assert_uint_eq(s.host_tier_wb_waits, 1);
    ck_assert_int_eq(s.host_tier_wb_in_flight, 0); /* the reuse waited for the write-back */
    ck_assert_uint_eq(s.host_tier_stores, 7);      /* its block was not copied again */
    ck_assert_int_eq(kvb_engine_step(e), KVB_OK);
    ck_assert_int_eq(probe.host_cached, 7); /* landed: readable */
    run(e);

    int32_t turn2[128];
    int n2 = PL[0];
    memcpy(turn2, P[0], sizeof(int32_t) * PL[0]);
    memcpy(turn2 + n2, got.toks[0], sizeof(int32_t) * 20);
    n2 += 20;
    turn2[n2++] = 9;
    uint64_t loads0 = stats_of(e).host_tier_loads;
    add(e, 2, turn2, n2, 12);
    run(e);
    s = stats_of(e);
    ck_assert_uint_ge(s.host_tier_loads - loads0, 6); /* turn 1's blocks 1..6 from the host tier */
    assert_no_leak(e);
    kvb_engine_destroy(e);

    memset(&plain, 0, sizeof plain);
    e = make_engine(&plain, 8, 64, 512, 0);
    add(e, 2, turn2, n2, 12);
    run(e);
    kvb_engine_destroy(e);
    assert_same(&got, &plain, 0);
    for (int i = 0; i < 12; i++) ck_assert_int_eq(got.toks[2][i], plain.toks[2][i]);
    teardown_model();
}
KVB_TEST_END

/* Prints the host tier's counters (the test's record when it fails). */
static void wb_line(const char *when, const kvb_engine_stats *s) {
    fprintf(stderr, "%-8s stores %llu (%llu ahead), waits %llu, in flight %d, loads %llu, host link %llu bytes\n", when,
            (unsigned long long)s->host_tier_stores, (unsigned long long)s->host_tier_stores_ahead,
            (unsigned long long)s->host_tier_wb_waits, s->host_tier_wb_in_flight, (unsigned long long)s->host_tier_loads,
            (unsigned long long)s->links[KVB_LINK_HOST].bytes);
}

KVB_TEST(host_tier_writeback_beside_loads) {
    /* The write-back runs on the host link's from-device queue, beside the loads (PCIe is full duplex: a
     * GPU's D2H and H2D copy engines run side by side, and HiCache / LMCache write back on a stream of
     * their own). The host link carries one block in 0.5 s; a 20-block pool; a request's blocks go back
     * to the LRU last block first. X (5 blocks) is written back ahead while Y runs; Z's prefill evicts X4
     * and X3 (waiting for that write-back) and writes Y's 7 blocks back ahead; E's prefill evicts X2..X0
     * and Y6 (waiting) and writes Z's 9 blocks back ahead (4.5 s in flight). D, X's first 17 tokens, finds
     * X0 and X1 in the host tier only: it loads them layer by layer (two transfers, 1 s together) and
     * evicts Y5 and Y4, whose copies have landed. D's step returns with Z's write-back still in flight: its
     * loads did not queue behind it
     * (on one queue per link they would have, and the write-back would have landed first). Every copy
     * counts on the host link, and every request gives the tokens of a plain run. */
    setup_model("llama");
    make_prompts();
    static rec got, plain;
    memset(&got, 0, sizeof got);
    kvb_kv_geom g = kvb_model_kv_geom(model, 8);
    const uint64_t bb = kvb_kv_block_bytes(&g);
    kvb_engine_opts o;
    kvb_engine_opts_default(&o);
    o.block_size = 8;
    o.n_blocks = 20;
    ck_assert_int_eq(kvb_link_preset_find("off", &o.links), KVB_OK);
    o.links.links[KVB_LINK_HOST] = (kvb_link){.bytes_per_s = (double)bb / 0.5, .latency_s = 0};
    wb_probe probe = {0};
    kvb_planner pl = {.iface = &probe_iface, .ctx = &probe};
    kvb_engine_events ev = {.ud = &got, .on_token = on_token, .on_finish = on_finish};
    kvb_engine *e = NULL;
    ck_assert_int_eq(kvb_engine_create(model, &o, &pl, &ev, &e), KVB_OK);
    enum { NR = 5 };
    int32_t pr[NR][80];
    const int pn[NR] = {PL[0], 60, 73, 33, 17}, mt[NR] = {4, 4, 1, 1, 1}; /* X, Y, Z, E, D */
    memcpy(pr[0], P[0], sizeof(int32_t) * PL[0]);
    memcpy(pr[4], P[0], sizeof(int32_t) * PL[0]);
    for (int r = 1; r < 4; r++)
        for (int i = 0; i < pn[r]; i++) pr[r][i] = (i * (29 + 2 * r) + 5 * r) % 200;
    kvb_engine_stats s;
    for (int r = 0; r < 4; r++) { /* X, Y, Z, E, each to its end */
        add(e, (uint64_t)r, pr[r], pn[r], mt[r]);
        run(e);
        s = stats_of(e);
        wb_line((const char *[]){"X", "Y", "Z", "E"}[r], &s);
    }
    ck_assert_uint_eq(s.host_tier_wb_waits, 2);   /* Z for X's write-back, E for Y's */
    ck_assert_int_eq(s.host_tier_wb_in_flight, 9); /* Z's blocks */
    ck_assert_uint_eq(s.links[KVB_LINK_HOST].bytes, (s.host_tier_stores - 9) * bb); /* what landed */

    add(e, 4, pr[4], pn[4], mt[4]);
    ck_assert_int_eq(kvb_engine_step(e), KVB_OK); /* D: X3 from the host tier, layer by layer */
    kvb_engine_stats d = stats_of(e);
    wb_line("D", &d);
    ck_assert_uint_eq(d.host_tier_loads - s.host_tier_loads, 2);
    ck_assert_uint_eq(d.prefix_hit_tokens - s.prefix_hit_tokens, 16);
    ck_assert_uint_eq(d.links[KVB_LINK_HOST].copies - s.links[KVB_LINK_HOST].copies, 2); /* one per layer, landed */
    ck_assert_uint_eq(d.host_tier_wb_waits, 2);    /* it evicted no block in flight */
    ck_assert_int_ge(d.host_tier_wb_in_flight, 9); /* Z's write-back did not land before D's loads */
    ck_assert_uint_eq(d.links[KVB_LINK_HOST].bytes, /* the load landed; what is in flight has not */
                      (d.host_tier_stores - (uint64_t)d.host_tier_wb_in_flight + d.host_tier_loads) * bb);
    ck_assert_int_eq(got.fin[4], KVB_FINISH_LENGTH);
    assert_no_leak(e);
    kvb_engine_destroy(e); /* waits for the write-back in flight */

    memset(&plain, 0, sizeof plain);
    for (int r = 0; r < NR; r++) {
        e = make_engine(&plain, 8, 64, 512, 0);
        add(e, (uint64_t)r, pr[r], pn[r], mt[r]);
        run(e);
        kvb_engine_destroy(e);
    }
    assert_same(&got, &plain, NR);
    teardown_model();
}
KVB_TEST_END

KVB_TEST(host_tier_async_lossless) {
    /* Memory pressure: four two-turn sessions on a 12-block pool (preemptions, evictions, write-backs ahead
     * of them, host-tier hits) under the host-tier planner with asynchronous write-back and a host link
     * slower than a step (3 ms a transfer), against the same requests on an ample pool without a prefix
     * cache: the same greedy tokens. */
    setup_model("qwen3");
    static rec got, ref;
    int32_t prompts[8][MAXT];
    int lens[8];
    for (int pass = 0; pass < 2; pass++) {
        rec *r = pass ? &got : &ref;
        memset(r, 0, sizeof *r);
        kvb_engine *e = NULL;
        if (pass == 0) {
            e = make_engine(r, 8, 128, 512, 0);
        } else {
            kvb_engine_opts o;
            kvb_engine_opts_default(&o);
            o.block_size = 8;
            o.n_blocks = 12;
            o.max_batch_tokens = 48;
            ck_assert_int_eq(kvb_link_preset_find("off", &o.links), KVB_OK);
            o.links.links[KVB_LINK_HOST] = (kvb_link){.bytes_per_s = 0, .latency_s = 3e-3};
            kvb_policy_params pp = {0};
            ck_assert_int_eq(kvb_policy_params_add(&pp, "blocks=48"), KVB_OK);
            ck_assert_int_eq(kvb_policy_params_add(&pp, "writeback=async"), KVB_OK);
            kvb_planner pl;
            ck_assert_int_eq(kvb_policy_create("host-tier", &pp, &pl), KVB_OK);
            kvb_policy_params_free(&pp);
            kvb_engine_events ev = {.ud = r, .on_token = on_token, .on_finish = on_finish};
            ck_assert_int_eq(kvb_engine_create(model, &o, &pl, &ev, &e), KVB_OK);
        }
        for (int t = 0; t < 2; t++) {
            for (int k = 0; k < 4; k++) {
                int id = t * 4 + k;
                if (t == 0) { /* a shared head of 16 tokens, then the session's own */
                    lens[id] = 30 + 3 * k;
                    for (int i = 0; i < lens[id]; i++) prompts[id][i] = i < 16 ? (i * 7 + 3) % 200 : (i * 13 + k * 41 + 1) % 200;
                } else if (pass == 0) { /* turn 2: turn 1's prompt, its answer and 5 new ids */
                    int p = k;
                    lens[id] = lens[p];
                    memcpy(prompts[id], prompts[p], sizeof(int32_t) * (size_t)lens[p]);
                    memcpy(prompts[id] + lens[id], r->toks[p], sizeof(int32_t) * 12);
                    lens[id] += 12;
                    for (int i = 0; i < 5; i++) prompts[id][lens[id]++] = (i * 17 + k * 5 + 2) % 200;
                }
                add(e, (uint64_t)id, prompts[id], lens[id], 12);
            }
            run(e);
        }
        if (pass == 1) {
            kvb_engine_stats s = stats_of(e);
            printf("host-tier async: %llu preemptions, %llu host stores (%llu ahead), %llu waits, %llu host loads, "
                   "%llu prefix-hit tokens\n", (unsigned long long)s.preemptions, (unsigned long long)s.host_tier_stores,
                   (unsigned long long)s.host_tier_stores_ahead, (unsigned long long)s.host_tier_wb_waits,
                   (unsigned long long)s.host_tier_loads, (unsigned long long)s.prefix_hit_tokens);
            ck_assert_uint_gt(s.host_tier_stores_ahead, 0);
            ck_assert_uint_gt(s.host_tier_loads, 0);
            assert_no_leak(e);
        }
        kvb_engine_destroy(e);
    }
    assert_same(&got, &ref, 8);
    teardown_model();
}
KVB_TEST_END

KVB_TEST(inflight_prefix_deferred) {
    /* Two requests with the same 200-token prompt arrive together and both fit the step's budget. The
     * second waits one step for the first instead of computing the same blocks in parallel, then
     * reuses all 12 full blocks (192 tokens), and its tokens are those of a run alone. */
    setup_model("llama");
    static rec ref, got;
    int32_t p[200];
    for (int i = 0; i < 200; i++) p[i] = (i * 17 + 5) % 200;
    memset(&ref, 0, sizeof ref);
    kvb_engine *e = make_engine(&ref, 16, 64, 512, 0);
    add(e, 1, p, 200, 10);
    run(e);
    kvb_engine_destroy(e);

    memset(&got, 0, sizeof got);
    e = make_engine(&got, 16, 64, 512, 1);
    add(e, 0, p, 200, 10);
    add(e, 1, p, 200, 10);
    run(e);
    kvb_engine_stats s;
    kvb_engine_get_stats(e, &s);
    ck_assert_uint_gt(s.deferred, 0);
    ck_assert_uint_eq(s.prefix_hit_tokens, 192);
    for (int r = 0; r < 2; r++)
        for (int i = 0; i < 10; i++) ck_assert_int_eq(got.toks[r][i], ref.toks[1][i]);
    assert_no_leak(e);
    kvb_engine_destroy(e);
    teardown_model();
}
KVB_TEST_END

/* Greedy sampling is the first index of the largest logit, wherever it is (the vector body, the tail,
 * index 0), with ties, signed zeros and NaNs among the logits. */
KVB_TEST(greedy_argmax) {
    enum { V = 1003 };
    static float x[V];
    kvb_sampling g = {0};
    kvb_rng rng;
    kvb_rng_seed(&rng, 1);
    uint64_t st = 7;
    for (int trial = 0; trial < 400; trial++) {
        int n = 1 + trial % V;
        for (int i = 0; i < n; i++) {
            st = st * 6364136223846793005ull + 1442695040888963407ull;
            x[i] = (float)((st >> 40) % 9) - 4.0f; /* few distinct values: many ties */
        }
        if (trial % 5 == 1) x[trial % n] = NAN;
        if (trial % 7 == 2) x[n - 1] = 5.0f;
        if (trial % 11 == 3) x[0] = 6.0f;
        if (trial % 13 == 4) {
            for (int i = 0; i < n; i++) x[i] = x[i] > 0 ? -x[i] : x[i];
            x[n / 2] = -0.0f;
            x[n - 1] = 0.0f;
        }
        int32_t want = 0;
        for (int i = 1; i < n; i++)
            if (x[i] > x[want]) want = i;
        ck_assert_int_eq(kvb_sample(&g, &rng, x, n, NULL), want);
    }
}
KVB_TEST_END

KVB_TEST_MAIN("engine", KVB_T(greedy_argmax, 30), KVB_T(batch_chunk_preempt_lossless, 120), KVB_T(prefix_hit_lossless, 60),
              KVB_T(cancel_and_reject, 60), KVB_T(stop_ids_and_sampling, 60), KVB_T(host_tier_lossless, 60), KVB_T(host_tier_async_writeback, 90), KVB_T(host_tier_writeback_beside_loads, 90),
              KVB_T(host_tier_async_lossless, 90), KVB_T(inflight_prefix_deferred, 60))
