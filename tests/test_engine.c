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


/* ------------------------------------------------------------------------------ structured output */

/* A vocabulary for the 200-token test model: ids 0-2 special (2 is the EOS), 3-97 the printable ASCII
 * bytes, 98-199 two-byte pieces. */
static kvb_grammar_vocab *test_vocab(void) {
    static char text[200][3];
    const char *bytes[200];
    size_t lens[200];
    uint8_t special[200] = {1, 1, 1};
    const char *pieces = "{\"}:\",ab12 -xyz[]09";
    for (int i = 0; i < 200; i++) {
        if (i < 3) {
            snprintf(text[i], sizeof text[i], "%c", 'A' + i);
        } else if (i < 98) {
            text[i][0] = (char)(32 + i - 3);
            text[i][1] = '\0';
        } else {
            int k = i - 98, n = (int)strlen(pieces);
            text[i][0] = pieces[k % n];
            text[i][1] = pieces[(k / n + k) % n];
            text[i][2] = '\0';
        }
        bytes[i] = text[i];
        lens[i] = strlen(text[i]);
    }
    int32_t eos = 2;
    kvb_grammar_vocab *v = NULL;
    ck_assert_int_eq(kvb_grammar_vocab_create(200, bytes, lens, special, &eos, 1, &v), KVB_OK);
    return v;
}

static kvb_grammar_matcher *test_matcher(const kvb_grammar_vocab *v, const kvb_grammar_part *parts, int n) {
    kvb_grammar *g = NULL;
    char err[256];
    kvb_grammar_opts o;
    kvb_grammar_opts_default(&o);
    o.ws_indent = -1;
    ck_assert_msg(kvb_grammar_compile(v, parts, n, &o, &g, err, sizeof err) == KVB_OK, "%s", err);
    kvb_grammar_matcher *m = NULL;
    ck_assert_int_eq(kvb_grammar_matcher_create(g, &m), KVB_OK);
    kvb_grammar_release(g);
    return m;
}

/* A request's output under a grammar: every token is one the grammar allowed, the output is a complete
 * match when the request stopped (STOP, no EOS needed once nothing can follow), and the tokens are the
 * same whether the pool preempts the requests (recompute keeps the matcher where the output is), with
 * greedy and with seeded sampling. Without the mask the same model writes other tokens. */
KVB_TEST(grammar_masks_and_preemption) {
    setup_model("llama");
    make_prompts();
    kvb_grammar_vocab *v = test_vocab();
    static const char *const choices[] = {"alpha", "beta-12", "gamma"};
    const char *schema = "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":99},"
                         "\"b\":{\"enum\":[\"x\",\"yz\"]}},\"required\":[\"a\",\"b\"]}";
    const char *regex = "[a-z]{3}-[0-9]{2}";
    kvb_grammar_part g_schema = {.kind = KVB_GRAMMAR_JSON_SCHEMA, .text = schema, .len = strlen(schema)};
    kvb_grammar_part g_regex = {.kind = KVB_GRAMMAR_REGEX, .text = regex, .len = strlen(regex)};
    kvb_grammar_part g_choice = {.kind = KVB_GRAMMAR_CHOICE, .choices = choices, .n_choices = 3};
    const kvb_grammar_part *gs[3] = {&g_schema, &g_regex, &g_choice};
    static rec ref, got, free_run;
    for (int temp = 0; temp < 2; temp++) {
        struct { int bs, blocks; } cfgs[] = {{16, 64}, {4, 20}};
        for (size_t c = 0; c < KVB_ARRAY_LEN(cfgs); c++) {
            rec *r = c == 0 ? &ref : &got;
            memset(r, 0, sizeof *r);
            kvb_engine *e = make_engine(r, cfgs[c].bs, cfgs[c].blocks, 512, 1);
            for (int q = 0; q < 3; q++) {
                kvb_request rq = {.id = (uint64_t)q, .prompt = P[q], .n_prompt = PL[q], .max_tokens = 40,
                                  .sampling = {.temperature = temp ? 0.8f : 0, .seed = 5 + (uint64_t)q},
                                  .matcher = test_matcher(v, gs[q], 1)};
                ck_assert_int_eq(kvb_engine_add(e, &rq), KVB_OK);
            }
            run(e);
            kvb_engine_stats s;
            kvb_engine_get_stats(e, &s);
            if (c == 1) ck_assert_msg(s.preemptions > 0, "the small pool did not preempt");
            assert_no_leak(e);
            kvb_engine_destroy(e);
        }
        assert_same(&ref, &got, 3);
        for (int q = 0; q < 3; q++) {
            /* replay: each token allowed in turn; STOP means the output is complete */
            kvb_grammar_matcher *m = test_matcher(v, gs[q], 1);
            for (int i = 0; i < ref.n[q]; i++)
                ck_assert_msg(kvb_grammar_matcher_accept_token(m, ref.toks[q][i]) == KVB_OK,
                              "request %d token %d (%d) is not allowed", q, i, ref.toks[q][i]);
            ck_assert_int_eq(ref.fin[q], KVB_FINISH_STOP);
            ck_assert(kvb_grammar_matcher_accepting(m));
            kvb_grammar_matcher_destroy(m);
        }
        /* the regex's output is exactly 6 bytes of its language */
        char out[64] = "";
        for (int i = 0; i < ref.n[1]; i++) strcat(out, ref.toks[1][i] < 98 ? (char[2]){(char)(32 + ref.toks[1][i] - 3), 0} : "??");
        ck_assert_msg(strlen(out) == 6 && out[3] == '-', "regex output '%s'", out);
    }
    /* the same requests without a grammar: the model's own (garbage) tokens differ */
    memset(&free_run, 0, sizeof free_run);
    kvb_engine *e = make_engine(&free_run, 16, 64, 512, 1);
    add(e, 1, P[1], PL[1], 6);
    run(e);
    kvb_engine_destroy(e);
    int differs = free_run.n[1] != ref.n[1];
    for (int i = 0; i < free_run.n[1] && i < ref.n[1]; i++) differs |= free_run.toks[1][i] != ref.toks[1][i];
    ck_assert_msg(differs, "the grammar changed nothing");
    kvb_grammar_vocab_destroy(v);
    teardown_model();
}
KVB_TEST_END

/* A grammar whose next tokens all lie beyond the model's logits fails its request with an error
 * instead of sampling a forbidden token; a rejected request leaves its matcher to the caller. */
KVB_TEST(grammar_no_token_fails) {
    setup_model("llama");
    make_prompts();
    /* a vocabulary wider than the model's 200 logits, where only id 250 can start the output */
    static const char *bytes[300];
    size_t lens[300] = {0};
    for (int i = 0; i < 300; i++) bytes[i] = "";
    bytes[250] = "Q";
    lens[250] = 1;
    int32_t eos = 2;
    kvb_grammar_vocab *v = NULL;
    ck_assert_int_eq(kvb_grammar_vocab_create(300, bytes, lens, NULL, &eos, 1, &v), KVB_OK);
    kvb_grammar_part lit = {.kind = KVB_GRAMMAR_LITERAL, .text = "Q", .len = 1};
    static rec r;
    memset(&r, 0, sizeof r);
    kvb_engine *e = make_engine(&r, 16, 64, 512, 1);
    kvb_request rq = {.id = 0, .prompt = P[0], .n_prompt = PL[0], .max_tokens = 5, .matcher = test_matcher(v, &lit, 1)};
    ck_assert_int_eq(kvb_engine_add(e, &rq), KVB_OK);
    run(e);
    ck_assert_int_eq(r.fin[0], KVB_FINISH_ERROR);
    ck_assert_int_eq(r.n[0], 0);
    kvb_request bad = {.id = 1, .prompt = P[0], .n_prompt = 0, .max_tokens = 5, .matcher = test_matcher(v, &lit, 1)};
    ck_assert_int_eq(kvb_engine_add(e, &bad), KVB_ERR_INVALID);
    kvb_grammar_matcher_destroy(bad.matcher); /* still ours */
    assert_no_leak(e);
    kvb_engine_destroy(e);
    kvb_grammar_vocab_destroy(v);
    teardown_model();
}
KVB_TEST_END

/* ---------------------------------------------------------------- logprobs and processors */

enum { LPV = 200, LPT = 64 };

/* What the logprob events carried and the raw logits each token was sampled from (rec first: the
 * token events take it). */
typedef struct lprec {
    rec r;
    float logits[MAXR][LPT][LPV];
    float lp[MAXR][LPT];
    int32_t top[MAXR][LPT][KVB_MAX_TOP_LOGPROBS];
    float top_lp[MAXR][LPT][KVB_MAX_TOP_LOGPROBS];
    int n_lp[MAXR], top_n[MAXR];
    float plp[MAXR][LPT];
    int32_t ptop[MAXR][LPT][KVB_MAX_TOP_LOGPROBS];
    int plp_seen[MAXR][LPT];
} lprec;

static void on_logits_rec(void *ud, uint64_t id, int index, const float *logits, int vocab) {
    lprec *l = ud;
    ck_assert_int_eq(vocab, LPV);
    if (index < LPT) memcpy(l->logits[id][index], logits, sizeof l->logits[id][index]);
}

static void on_logprobs_rec(void *ud, uint64_t id, int index, float lp, const int32_t *top_ids, const float *top_lp,
                            int top_n) {
    lprec *l = ud;
    ck_assert_int_eq(index, l->n_lp[id]); /* before its token, once */
    ck_assert_int_eq(index, l->r.n[id]);
    l->lp[id][index] = lp;
    l->top_n[id] = top_n;
    memcpy(l->top[id][index], top_ids, (size_t)top_n * sizeof *top_ids);
    memcpy(l->top_lp[id][index], top_lp, (size_t)top_n * sizeof *top_lp);
    l->n_lp[id]++;
}

static void on_prompt_lp_rec(void *ud, uint64_t id, int pos0, int n, const float *lp, const int32_t *top_ids,
                             const float *top_lp, int top_n) {
    lprec *l = ud;
    (void)top_lp;
    ck_assert_int_eq(l->r.n[id], 0); /* before the first token */
    for (int j = 0; j < n; j++) {
        ck_assert_int_ge(pos0 + j, 1);
        ck_assert_int_eq(l->plp_seen[id][pos0 + j]++, 0);
        l->plp[id][pos0 + j] = lp[j];
        memcpy(l->ptop[id][pos0 + j], top_ids + (size_t)j * top_n, (size_t)top_n * sizeof *top_ids);
    }
}

static kvb_engine *make_lp_engine(lprec *l, int budget, int prefix) {
    kvb_engine_opts o;
    kvb_engine_opts_default(&o);
    o.block_size = 8;
    o.n_blocks = 128;
    o.max_batch_tokens = budget;
    o.enable_prefix_cache = prefix;
    kvb_engine_events ev = {.ud = l, .on_token = on_token, .on_finish = on_finish, .on_logits = on_logits_rec,
                            .on_logprobs = on_logprobs_rec, .on_prompt_logprobs = on_prompt_lp_rec};
    kvb_planner pl = kvb_policy_recompute();
    kvb_engine *e = NULL;
    ck_assert_int_eq(kvb_engine_create(model, &o, &pl, &ev, &e), KVB_OK);
    return e;
}

/* log_softmax(x)[t] in double */
static double ref_logprob(const float *x, int n, int t) {
    double mx = -INFINITY, sum = 0;
    for (int i = 0; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    for (int i = 0; i < n; i++) sum += exp((double)x[i] - mx);
    return (double)x[t] - mx - log(sum);
}

/* The token ranked `k` (0: the largest logit; ties by lower id) of x[n]. */
static int ref_rank(const float *x, int n, int k) {
    int used[LPV] = {0}, best = -1;
    for (int r = 0; r <= k; r++) {
        best = -1;
        for (int i = 0; i < n; i++)
            if (!used[i] && (best < 0 || x[i] > x[best])) best = i;
        used[best] = 1;
    }
    return best;
}

/* logprobs are the raw log-softmax of the logits (the processors come after): greedy's token is the
 * first of its top list; with a logit_bias that changes the choice, the list stays the raw one. */
KVB_TEST(logprobs_raw_and_top) {
    setup_model("llama");
    make_prompts();
    static lprec l;
    memset(&l, 0, sizeof l);
    static rec ref;
    solo(&ref, 20);
    kvb_engine *e = make_lp_engine(&l, 512, 1);
    kvb_logit_bias bias = {.id = ref.toks[0][0] == 7 ? 8 : 7, .bias = 100};
    kvb_request q = {.id = 0, .prompt = P[0], .n_prompt = PL[0], .max_tokens = 20,
                     .sampling = {.logprobs = 1, .top_logprobs = 5}};
    ck_assert_int_eq(kvb_engine_add(e, &q), KVB_OK);
    q.id = 1;
    q.sampling = (kvb_sampling){.logprobs = 1, .top_logprobs = 3, .logit_bias = &bias, .n_logit_bias = 1};
    ck_assert_int_eq(kvb_engine_add(e, &q), KVB_OK);
    q.id = 2; /* top_logprobs 0: the sampled token's logprob only */
    q.sampling = (kvb_sampling){.temperature = 0.8f, .seed = 3, .logprobs = 1};
    ck_assert_int_eq(kvb_engine_add(e, &q), KVB_OK);
    run(e);
    for (int r = 0; r < 3; r++) {
        ck_assert_int_eq(l.n_lp[r], 20);
        ck_assert_int_eq(l.top_n[r], r == 0 ? 5 : r == 1 ? 3 : 0);
        for (int i = 0; i < 20; i++) {
            const float *x = l.logits[r][i];
            int32_t tok = l.r.toks[r][i];
            ck_assert_msg(fabs(l.lp[r][i] - ref_logprob(x, LPV, tok)) < 1e-5, "request %d token %d: logprob %g vs %g", r,
                          i, l.lp[r][i], ref_logprob(x, LPV, tok));
            for (int k = 0; k < l.top_n[r]; k++) {
                ck_assert_int_eq(l.top[r][i][k], ref_rank(x, LPV, k));
                ck_assert(fabs(l.top_lp[r][i][k] - ref_logprob(x, LPV, l.top[r][i][k])) < 1e-5);
            }
        }
    }
    for (int i = 0; i < 20; i++) {
        ck_assert_int_eq(l.r.toks[0][i], ref.toks[0][i]); /* logprobs change no token */
        ck_assert_int_eq(l.r.toks[0][i], l.top[0][i][0]);
        ck_assert_int_eq(l.r.toks[1][i], bias.id); /* +100 wins every time... */
    }
    ck_assert_int_ne(l.top[1][0][0], bias.id); /* ...and the list is the raw one */
    assert_no_leak(e);
    kvb_engine_destroy(e);
    teardown_model();
}
KVB_TEST_END

/* Prompt logprobs: every prompt position but the first, once, before the first token, equal to the
 * logprob of that token under the logits a request of the prompt up to it samples from, whether the
 * prefill runs in chunks and whether the prefix cache holds the prompt (its hits are not taken). */
KVB_TEST(prompt_logprobs) {
    setup_model("llama");
    make_prompts();
    static lprec l, one;
    int n = PL[0];
    static float row[64][LPV];
    for (int j = 1; j < n; j++) { /* the reference: prompt[0..j) alone, the logits of its first token */
        memset(&one, 0, sizeof one);
        kvb_engine *e = make_lp_engine(&one, 512, 0);
        add(e, 0, P[0], j, 1);
        run(e);
        memcpy(row[j], one.logits[0][0], sizeof row[j]);
        kvb_engine_destroy(e);
    }
    for (int budget = 7; budget <= 512; budget += 505) {
        memset(&l, 0, sizeof l);
        kvb_engine *e = make_lp_engine(&l, budget, 1);
        add(e, 0, P[0], n, 2); /* leaves the prompt's blocks in the prefix cache */
        run(e);
        kvb_engine_stats s0;
        kvb_engine_get_stats(e, &s0);
        kvb_request q = {.id = 1, .prompt = P[0], .n_prompt = n, .max_tokens = 2,
                         .sampling = {.prompt_logprobs = 1, .top_logprobs = 2}};
        ck_assert_int_eq(kvb_engine_add(e, &q), KVB_OK);
        q.id = 2; /* the same prompt without prompt logprobs takes the hits */
        q.sampling = (kvb_sampling){0};
        ck_assert_int_eq(kvb_engine_add(e, &q), KVB_OK);
        run(e);
        kvb_engine_stats s1;
        kvb_engine_get_stats(e, &s1);
        ck_assert_int_eq(s1.prefix_hit_tokens - s0.prefix_hit_tokens, (uint64_t)(n - 1) / 8 * 8);
        ck_assert_int_eq(l.plp_seen[1][0], 0);
        for (int j = 1; j < n; j++) {
            ck_assert_msg(l.plp_seen[1][j] == 1, "budget %d: position %d seen %d times", budget, j, l.plp_seen[1][j]);
            double want = ref_logprob(row[j], LPV, P[0][j]);
            ck_assert_msg(fabs(l.plp[1][j] - want) < 1e-5, "budget %d: position %d: %g vs %g", budget, j, l.plp[1][j],
                          want);
            ck_assert_int_eq(l.ptop[1][j][0], ref_rank(row[j], LPV, 0));
            ck_assert_int_eq(l.ptop[1][j][1], ref_rank(row[j], LPV, 1));
        }
        for (int i = 0; i < 2; i++) ck_assert_int_eq(l.r.toks[1][i], l.r.toks[0][i]);
        assert_no_leak(e);
        kvb_engine_destroy(e);
    }
    teardown_model();
}
KVB_TEST_END

/* min_tokens masks the stop ids until the output has that many tokens; a presence penalty changes
 * greedy's choice to the argmax of the penalised logits. */
KVB_TEST(min_tokens_and_penalty) {
    setup_model("llama");
    make_prompts();
    static rec ref;
    static lprec l;
    solo(&ref, 30);
    memset(&l, 0, sizeof l);
    kvb_engine *e = make_lp_engine(&l, 512, 1);
    int32_t stop = ref.toks[0][3];
    int first = 0;
    while (ref.toks[0][first] != stop) first++;
    kvb_request q = {.id = 0, .prompt = P[0], .n_prompt = PL[0], .max_tokens = 30, .stop_ids = &stop, .n_stop = 1,
                     .sampling = {.min_tokens = first + 5}};
    ck_assert_int_eq(kvb_engine_add(e, &q), KVB_OK);
    q = (kvb_request){.id = 1, .prompt = P[1], .n_prompt = PL[1], .max_tokens = 30,
                      .sampling = {.presence_penalty = 2.0f, .frequency_penalty = 0.5f}};
    ck_assert_int_eq(kvb_engine_add(e, &q), KVB_OK);
    run(e);
    for (int i = 0; i < first; i++) ck_assert_int_eq(l.r.toks[0][i], ref.toks[0][i]);
    for (int i = 0; i < first + 5 && i < l.r.n[0]; i++) ck_assert_int_ne(l.r.toks[0][i], stop);
    ck_assert_int_ge(l.r.n[0], first + 5);
    int pen_changed = 0;
    for (int i = 0; i < 30; i++) {
        float x[LPV];
        memcpy(x, l.logits[1][i], sizeof x);
        int cnt[LPV] = {0};
        for (int k = 0; k < i; k++) cnt[l.r.toks[1][k]]++;
        for (int t = 0; t < LPV; t++)
            if (cnt[t]) x[t] -= 0.5f * (float)cnt[t] + 2.0f;
        ck_assert_int_eq(l.r.toks[1][i], ref_rank(x, LPV, 0));
        pen_changed |= l.r.toks[1][i] != ref_rank(l.logits[1][i], LPV, 0);
    }
    ck_assert(pen_changed); /* the penalty did something */
    assert_no_leak(e);
    kvb_engine_destroy(e);
    teardown_model();
}
KVB_TEST_END

/* Sampling on the device (kvb_backend_i.sample) takes only plain rows: a batch with a logits processor
 * or logprobs brings its logits to the host, or the processors would be skipped. A CPU backend with a
 * greedy `sample` of its own stands in for a device; it counts the rows it samples. */
static int fake_rows;
static kvb_status fake_sample(void *ctx, const void *logits, int rows, int vocab, const kvb_sample_row *p,
                              int32_t *out) {
    (void)ctx;
    for (int r = 0; r < rows; r++) {
        ck_assert_float_eq(p[r].temperature, 0.0f);
        const float *x = (const float *)logits + (size_t)r * vocab;
        int best = 0;
        for (int t = 1; t < vocab; t++) best = x[t] > x[best] ? t : best;
        out[r] = best;
    }
    fake_rows += rows;
    return KVB_OK;
}

KVB_TEST(device_sampling_only_plain_rows) {
    setup_model("llama");
    make_prompts();
    static rec ref, dev, pen_host, pen_dev;
    solo(&ref, 20);
    static kvb_backend_i fake;
    const kvb_backend_i *cpu = tm.be->iface;
    fake = *cpu;
    fake.sample = fake_sample;
    kvb_request pen = {.id = 1, .prompt = P[1], .n_prompt = PL[1], .max_tokens = 20,
                       .sampling = {.presence_penalty = 2.0f, .frequency_penalty = 0.5f}};
    kvb_request lp = {.id = 2, .prompt = P[2], .n_prompt = PL[2], .max_tokens = 20, .sampling = {.logprobs = 1}};
    for (int with_fake = 0; with_fake <= 1; with_fake++) {
        tm.be->iface = with_fake ? &fake : cpu;
        rec *r = with_fake ? &pen_dev : &pen_host;
        memset(r, 0, sizeof *r);
        kvb_engine *e = make_engine(r, 16, 64, 512, 0);
        add(e, 0, P[0], PL[0], 20); /* plain, but in the batch of rows that are not */
        ck_assert_int_eq(kvb_engine_add(e, &pen), KVB_OK);
        ck_assert_int_eq(kvb_engine_add(e, &lp), KVB_OK);
        fake_rows = 0;
        run(e);
        ck_assert_int_eq(fake_rows, 0);
        kvb_engine_destroy(e);
    }
    assert_same(&pen_host, &pen_dev, 3);
    /* plain rows alone are sampled by the backend, with the host's greedy tokens */
    tm.be->iface = &fake;
    memset(&dev, 0, sizeof dev);
    kvb_engine *e = make_engine(&dev, 16, 64, 512, 0);
    add(e, 0, P[0], PL[0], 20);
    fake_rows = 0;
    run(e);
    ck_assert_int_eq(fake_rows, 20);
    kvb_engine_destroy(e);
    tm.be->iface = cpu;
    for (int i = 0; i < 20; i++) ck_assert_int_eq(dev.toks[0][i], ref.toks[0][i]);
    teardown_model();
}
KVB_TEST_END

/* A grammar under the logits processors and logprobs: the mask is the first stage, so a +100 bias on a
 * token the grammar forbids never wins, a repetition penalty changes nothing the grammar cares about,
 * and the logprobs are those of the masked row (every alternative with a finite logprob is one the
 * grammar allowed at that step; greedy's token is the first of its list). */
KVB_TEST(grammar_with_processors) {
    setup_model("llama");
    make_prompts();
    kvb_grammar_vocab *v = test_vocab();
    const char *regex = "[a-z]{3}-[0-9]{2}";
    kvb_grammar_part g = {.kind = KVB_GRAMMAR_REGEX, .text = regex, .len = strlen(regex)};
    static lprec l;
    memset(&l, 0, sizeof l);
    kvb_engine *e = make_lp_engine(&l, 512, 0);
    const kvb_logit_bias bias[] = {{.id = 94, .bias = 100}}; /* '{': never in the regex's language */
    for (int q = 0; q < 2; q++) {
        kvb_request rq = {.id = (uint64_t)q, .prompt = P[q], .n_prompt = PL[q], .max_tokens = 40,
                          .sampling = {.temperature = 0, .logprobs = 1, .top_logprobs = 5, .logit_bias = bias,
                                       .n_logit_bias = 1, .repetition_penalty = q ? 1.5f : 0},
                          .matcher = test_matcher(v, &g, 1)};
        ck_assert_int_eq(kvb_engine_add(e, &rq), KVB_OK);
    }
    run(e);
    assert_no_leak(e);
    kvb_engine_destroy(e);
    uint32_t mask[16];
    ck_assert_uint_le(kvb_grammar_mask_words(v), KVB_ARRAY_LEN(mask));
    for (int q = 0; q < 2; q++) {
        ck_assert_int_eq(l.r.fin[q], KVB_FINISH_STOP);
        ck_assert_int_eq(l.n_lp[q], l.r.n[q]);
        kvb_grammar_matcher *m = test_matcher(v, &g, 1);
        for (int i = 0; i < l.r.n[q]; i++) {
            int32_t tok = l.r.toks[q][i];
            ck_assert_int_eq(kvb_grammar_matcher_fill_mask(m, mask), KVB_OK);
            ck_assert_int_ne(tok, 94);
            ck_assert_msg(isfinite(l.lp[q][i]), "request %d token %d: logprob %g", q, i, (double)l.lp[q][i]);
            if (!q) ck_assert_int_eq(l.top[q][i][0], tok); /* greedy, no processor touching allowed tokens */
            for (int k = 0; k < l.top_n[q]; k++) {
                int32_t t = l.top[q][i][k];
                if (isfinite(l.top_lp[q][i][k]))
                    ck_assert_msg((mask[t >> 5] >> (t & 31)) & 1, "request %d step %d: alternative %d is forbidden", q, i, t);
            }
            ck_assert_int_eq(kvb_grammar_matcher_accept_token(m, tok), KVB_OK);
        }
        ck_assert(kvb_grammar_matcher_accepting(m));
        kvb_grammar_matcher_destroy(m);
    }
    kvb_grammar_vocab_destroy(v);
    teardown_model();
}
KVB_TEST_END

KVB_TEST_MAIN("engine", KVB_T(greedy_argmax, 30), KVB_T(logprobs_raw_and_top, 60), KVB_T(prompt_logprobs, 120),
              KVB_T(min_tokens_and_penalty, 60), KVB_T(batch_chunk_preempt_lossless, 120), KVB_T(prefix_hit_lossless, 60),
              KVB_T(cancel_and_reject, 60), KVB_T(stop_ids_and_sampling, 60), KVB_T(host_tier_lossless, 60),
              KVB_T(host_tier_async_writeback, 90), KVB_T(host_tier_writeback_beside_loads, 90), KVB_T(host_tier_async_lossless, 90),
              KVB_T(inflight_prefix_deferred, 60),
              KVB_T(grammar_masks_and_preemption, 120), KVB_T(grammar_no_token_fails, 60),
              KVB_T(grammar_with_processors, 60), KVB_T(device_sampling_only_plain_rows, 60))
