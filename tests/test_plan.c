/* Tests of the planner seam (common/sched/plan.h): every registered planner gives recompute's greedy
 * tokens on ragged batches under memory pressure with chunked prefill and prefix hits; the executor
 * refuses a plan that violates the pool or the step and changes nothing; pause and resume are
 * lossless; the view says what the engine holds; the engine destroys its planner exactly once
 * whether or not kvb_engine_create succeeds. The model is a real safetensors directory written by
 * kvbank-mkmodel. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/kv/block_pool.h"
#include "common/model/model.h"
#include "common/policy/orbitflow_planner.h"
#include "common/policy/policy.h"
#include "common/sched/engine.h"
#include "common/policy/fcfs.h"
#include "common/sched/link_calib.h"
#include "tests/harness.h"
#include "tests/testmodel.h"

#define MAXR 8
#define MAXT 64

typedef struct rec {
    int32_t toks[MAXR][MAXT];
    int n[MAXR];
    kvb_finish fin[MAXR];
    int events; /* tokens and finishes seen */
} rec;

static void on_token(void *ud, uint64_t id, int index, int32_t tok, uint64_t t_ns) {
    rec *r = ud;
    ck_assert_int_lt(id, MAXR);
    ck_assert_int_eq(index, r->n[id]);
    r->toks[id][r->n[id]++] = tok;
    r->events++;
}

static void on_finish(void *ud, uint64_t id, kvb_finish why, kvb_status err) {
    rec *r = ud;
    ck_assert_int_eq(r->fin[id], KVB_FINISH_NONE);
    r->fin[id] = why;
    r->events++;
}

static kvb_t_model tm;
static kvb_model *model;

static void setup_model(void) {
    kvb_t_model_make(&tm, "--arch llama --layers 3 --hidden 64 --heads 4 --kv-heads 2 --vocab 200 --seed 11");
    model = tm.m;
}

static void teardown_model(void) { kvb_t_model_free(&tm); }

/* Ragged prompts: 0 and 3 share a 24-token prefix, 4 repeats 1 (prefix hits once 1 published). */
#define NREQ 5
static int32_t P[NREQ][48];
static const int PL[NREQ] = {37, 5, 23, 41, 5};
static const int MT[NREQ] = {20, 31, 9, 14, 12};
static void make_prompts(void) {
    for (int r = 0; r < NREQ; r++)
        for (int i = 0; i < PL[r]; i++) P[r][i] = (i * 13 + r * 29 + 1) % 200;
    for (int i = 0; i < 24; i++) P[3][i] = P[0][i];
    memcpy(P[4], P[1], sizeof(int32_t) * 5);
}

static kvb_engine *make_engine(rec *r, kvb_planner *pl, int bs, int n_blocks, int budget) {
    kvb_engine_opts o;
    kvb_engine_opts_default(&o);
    o.block_size = bs;
    o.n_blocks = n_blocks;
    o.max_batch_tokens = budget;
    kvb_engine_events ev = {.ud = r, .on_token = on_token, .on_finish = on_finish};
    kvb_engine *e = NULL;
    kvb_planner fcfs = kvb_policy_recompute(); /* NULL: vLLM scheduling */
    if (!pl) pl = &fcfs;
    ck_assert_int_eq(kvb_engine_create(model, &o, pl, &ev, &e), KVB_OK);
    return e;
}

static void add(kvb_engine *e, uint64_t id) {
    kvb_request q = {.id = id, .prompt = P[id], .n_prompt = PL[id], .max_tokens = MT[id]};
    ck_assert_msg(kvb_engine_add(e, &q) == KVB_OK, "add %llu: %s", (unsigned long long)id, kvb_engine_last_error(e));
}

static void run(kvb_engine *e) {
    for (int i = 0; i < 20000 && kvb_engine_n_live(e) > 0; i++)
        ck_assert_msg(kvb_engine_step(e) == KVB_OK, "step: %s", kvb_engine_last_error(e));
    ck_assert_int_eq(kvb_engine_n_live(e), 0);
}

static void assert_same(const rec *a, const rec *b) {
    for (int r = 0; r < NREQ; r++) {
        ck_assert_int_eq(a->n[r], b->n[r]);
        for (int i = 0; i < a->n[r]; i++)
            ck_assert_msg(a->toks[r][i] == b->toks[r][i], "request %d token %d: %d vs %d", r, i, a->toks[r][i],
                          b->toks[r][i]);
    }
}

/* Each request alone in an ample pool, no chunking. */
static void reference(rec *ref) {
    memset(ref, 0, sizeof *ref);
    for (int r = 0; r < NREQ; r++) {
        kvb_engine *e = make_engine(ref, NULL, 16, 64, 512);
        add(e, (uint64_t)r);
        run(e);
        kvb_engine_destroy(e);
    }
}

/* The pressure scenario: small blocks, a pool that cannot hold everyone, a budget that chunks the
 * prompts; requests 3 and 4 arrive after a few steps (prefix hits on 0 and 1). `of`: an OrbitFlow
 * planner's statistics at the end (NULL: none wanted). */
static void pressure_of(rec *got, kvb_planner *pl, int bs, int blocks, int budget, kvb_engine_stats *st,
                        kvb_of_planner_stats *of) {
    memset(got, 0, sizeof *got);
    kvb_of_planner *P = NULL;
    if (of) ck_assert(kvb_of_planner_of(pl, &P));
    kvb_engine *e = make_engine(got, pl, bs, blocks, budget);
    for (int r = 0; r < 3; r++) add(e, (uint64_t)r);
    for (int i = 0; i < 6; i++) ck_assert_msg(kvb_engine_step(e) == KVB_OK, "step: %s", kvb_engine_last_error(e));
    add(e, 3);
    add(e, 4);
    run(e);
    kvb_engine_get_stats(e, st);
    ck_assert_int_eq(st->blocks_free, st->blocks_total); /* nothing leaked */
    if (P) kvb_of_planner_get_stats(P, of);
    kvb_engine_destroy(e);
}

static void pressure(rec *got, kvb_planner *pl, int bs, int blocks, int budget, kvb_engine_stats *st) {
    pressure_of(got, pl, bs, blocks, budget, st, NULL);
}

typedef struct pressure_cfg {
    int bs, blocks, budget;
} pressure_cfg;
static const pressure_cfg cfgs[] = {{4, 18, 9}, {8, 9, 7}, {16, 8, 512}, {1, 60, 5}};

KVB_TEST(every_planner_lossless) {
    setup_model();
    make_prompts();
    static rec ref, base, got;
    reference(&ref);
    for (size_t c = 0; c < KVB_ARRAY_LEN(cfgs); c++) {
        kvb_engine_stats s0, s;
        kvb_planner rc = kvb_policy_recompute();
        pressure(&base, &rc, cfgs[c].bs, cfgs[c].blocks, cfgs[c].budget, &s0);
        assert_same(&ref, &base);
        ck_assert_msg(s0.preemptions > 0, "config %zu: no memory pressure", c);
        ck_assert_msg(s0.prefix_hit_tokens > 0 || cfgs[c].bs > 8, "config %zu: no prefix hit", c);
        for (int k = 0; k < kvb_policy_count(); k++) {
            const kvb_policy_info *pi = kvb_policy_info_at(k);
            kvb_planner pl;
            ck_assert_int_eq(kvb_policy_create(pi->name, NULL, &pl), KVB_OK);
            pressure(&got, &pl, cfgs[c].bs, cfgs[c].blocks, cfgs[c].budget, &s);
            printf("config %zu %-12s: %llu steps, %llu preemptions, %llu prefix-hit tokens\n", c, pi->name,
                   (unsigned long long)s.steps, (unsigned long long)s.preemptions,
                   (unsigned long long)s.prefix_hit_tokens);
            assert_same(&base, &got);
        }
    }
    teardown_model();
}
KVB_TEST_END

/* OrbitFlow's decisions come from a solver thread a step or more behind the engine (on a loaded
 * machine, several): by the time one is installed the running requests have grown, and a resume it
 * makes may no longer fit beside them — with one request running there is no victim to pause, and
 * the plan must still fit (the resume waits). The inline solver with solver_lag installs every
 * decision that many steps late, deterministically; the tokens must not change. */
KVB_TEST(orbitflow_late_decisions) {
    setup_model();
    make_prompts();
    static rec ref, base, got;
    reference(&ref);
    uint64_t deferred = 0, resumes = 0;
    for (size_t c = 0; c < KVB_ARRAY_LEN(cfgs); c++) {
        kvb_engine_stats s;
        kvb_planner rc = kvb_policy_recompute();
        pressure(&base, &rc, cfgs[c].bs, cfgs[c].blocks, cfgs[c].budget, &s);
        assert_same(&ref, &base);
        for (int lag = 0; lag <= 6; lag++) {
            kvb_policy_params pp = {0};
            char lag_s[16];
            snprintf(lag_s, sizeof lag_s, "%d", lag);
            ck_assert_int_eq(kvb_policy_params_set(&pp, "solver", "inline"), KVB_OK);
            ck_assert_int_eq(kvb_policy_params_set(&pp, "solver_lag", lag_s), KVB_OK);
            kvb_planner pl;
            ck_assert_int_eq(kvb_policy_create("orbitflow", &pp, &pl), KVB_OK);
            kvb_policy_params_free(&pp);
            kvb_of_planner_stats of;
            pressure_of(&got, &pl, cfgs[c].bs, cfgs[c].blocks, cfgs[c].budget, &s, &of);
            printf("config %zu lag %d: %llu steps, %llu pauses, %llu resumes, %llu deferred\n", c, lag,
                   (unsigned long long)s.steps, (unsigned long long)of.pauses, (unsigned long long)of.resumes,
                   (unsigned long long)of.resumes_deferred);
            assert_same(&base, &got);
            deferred += of.resumes_deferred;
            resumes += of.resumes;
        }
    }
    ck_assert_uint_gt(resumes, 0);
    ck_assert_uint_gt(deferred, 0); /* the case above happened */
    /* a lag needs the inline solver */
    kvb_policy_params pp = {0};
    ck_assert_int_eq(kvb_policy_params_set(&pp, "solver_lag", "1"), KVB_OK);
    kvb_planner pl;
    ck_assert_int_eq(kvb_policy_create("orbitflow", &pp, &pl), KVB_ERR_INVALID);
    kvb_policy_params_free(&pp);
    teardown_model();
}
KVB_TEST_END

/* ---------------------------------------------------------------- the destroy contract */

typedef struct counting {
    int destroyed;
    int steps;
} counting;

static kvb_status counting_plan(void *ctx, const kvb_view *v, kvb_plan *out) {
    ((counting *)ctx)->steps++;
    return kvb_fcfs(v, NULL, out);
}

static void counting_destroy(void *ctx) { ((counting *)ctx)->destroyed++; }

static const kvb_planner_i counting_iface = {.name = "counting", .plan_step = counting_plan,
                                             .destroy = counting_destroy};

KVB_TEST(destroy_contract) {
    setup_model();
    make_prompts();
    kvb_engine_opts o;
    kvb_engine_opts_default(&o);
    kvb_engine *e = NULL;
    counting c = {0};
    kvb_planner pl = {&counting_iface, &c};
    /* refused options: destroyed before kvb_engine_create returns */
    o.block_size = 0;
    ck_assert_int_eq(kvb_engine_create(model, &o, &pl, NULL, &e), KVB_ERR_INVALID);
    ck_assert_int_eq(c.destroyed, 1);
    /* a failure after the engine took it (KV memory too small for the pool) */
    c = (counting){0};
    kvb_engine_opts_default(&o);
    static char small[64];
    o.kv_mem = small;
    o.kv_mem_bytes = sizeof small;
    ck_assert_int_eq(kvb_engine_create(model, &o, &pl, NULL, &e), KVB_ERR_INVALID);
    ck_assert_int_eq(c.destroyed, 1);
    /* a planner without plan_step is refused, and destroyed too */
    static const kvb_planner_i no_step = {.name = "no-step", .destroy = counting_destroy};
    c = (counting){0};
    kvb_planner bad = {&no_step, &c};
    kvb_engine_opts_default(&o);
    ck_assert_int_eq(kvb_engine_create(model, &o, &bad, NULL, &e), KVB_ERR_INVALID);
    ck_assert_int_eq(c.destroyed, 1);
    /* success: the engine uses it and destroys it once, with itself */
    c = (counting){0};
    static rec r;
    memset(&r, 0, sizeof r);
    e = make_engine(&r, &pl, 16, 64, 512);
    add(e, 0);
    run(e);
    ck_assert_int_gt(c.steps, 0);
    ck_assert_int_eq(c.destroyed, 0);
    kvb_engine_destroy(e);
    ck_assert_int_eq(c.destroyed, 1);
    teardown_model();
}
KVB_TEST_END

/* ---------------------------------------------------------------- violating plans */

typedef enum bad_kind {
    BAD_NONE = 0,
    BAD_UNKNOWN_ID,
    BAD_RUN_WAITING,
    BAD_OVER_BUDGET,
    BAD_TOO_MANY_BLOCKS,
    BAD_PREEMPT_SCHEDULED,
    BAD_Q_BEYOND_TOKENS,
    BAD_DOUBLE_RUN,
    BAD_RESUME_RUNNING,
    BAD_BATCH_LIMIT,
    BAD_DROP_PARTIAL,
    BAD_DROP_NO_ABSENT,
    BAD_DROP_AFTER_RUN,
    BAD_RES_NOT_IN_POOL,
    BAD_STREAM_OWN,
    BAD_RES_OVERLAP,
    BAD_ABSENT_READ,
    BAD_SWAP_NO_HOST,
    BAD_COPY_NO_HOST,
    BAD_HOST_NO_COPY,
    BAD_LOAD_NO_COPY,
    BAD_STORE_EARLY,
    BAD_STAGE,
    BAD_OFFLOAD_NO_HOST,
} bad_kind;

typedef struct scripted {
    bad_kind bad;
    int host; /* plan_pool: a host tier of 16 blocks */
} scripted;

static const kvb_plan_op *find_op(const kvb_plan *p, kvb_op_kind k) {
    for (int i = 0; i < p->n_ops; i++)
        if (p->ops[i].kind == k) return &p->ops[i];
    return NULL;
}

/* The residency and copy cases, on request 0's blocks (its first block is full and not written in the
 * step; its block 4 receives its next token once its prompt is done). */
static kvb_status scripted_residency(const scripted *s, const kvb_view *v, kvb_plan *out) {
    const kvb_req_view *r0 = &v->reqs[kvb_view_find(v, 0)];
    int L = v->geom->n_layers;
    int32_t b0 = r0->blocks[0];
    switch (s->bad) {
    case BAD_RES_NOT_IN_POOL: return kvb_plan_push_res(out, (kvb_plan_res){9999, 0, 1, KVB_RES_LOCAL});
    case BAD_STREAM_OWN: return kvb_plan_push_res(out, (kvb_plan_res){b0, 0, L, KVB_RES_STREAM});
    case BAD_RES_OVERLAP:
        KVB_TRY(kvb_plan_push_res(out, (kvb_plan_res){b0, 0, 2, KVB_RES_LOCAL}));
        return kvb_plan_push_res(out, (kvb_plan_res){b0, 1, 3, KVB_RES_LOCAL});
    case BAD_ABSENT_READ: return kvb_plan_push_res(out, (kvb_plan_res){b0, 0, L, KVB_RES_ABSENT});
    case BAD_SWAP_NO_HOST:
        kvb_plan_reset(out);
        return kvb_plan_push_op(out, (kvb_plan_op){.kind = KVB_OP_SWAP_OUT, .id = 0});
    case BAD_COPY_NO_HOST: return kvb_plan_push_copy(out, (kvb_plan_copy){KVB_COPY_STORE, b0, 0, L, -1});
    case BAD_HOST_NO_COPY: return kvb_plan_push_res(out, (kvb_plan_res){b0, 1, L, KVB_RES_HOST});
    case BAD_LOAD_NO_COPY: return kvb_plan_push_copy(out, (kvb_plan_copy){KVB_COPY_LOAD, b0, 0, L, 0});
    case BAD_STORE_EARLY:
        ck_assert_int_ge(r0->n_blocks, 5);
        return kvb_plan_push_copy(out, (kvb_plan_copy){KVB_COPY_STORE, r0->blocks[4], 0, L, 0});
    case BAD_STAGE:
        KVB_TRY(kvb_plan_push_copy(out, (kvb_plan_copy){KVB_COPY_STORE, b0, 0, L, -1}));
        return kvb_plan_push_res(out, (kvb_plan_res){b0, 0, L, KVB_RES_HOST});
    default: return KVB_ERR_INVALID;
    }
}

/* A valid FCFS plan, then broken as asked. */
static kvb_status scripted_plan(void *ctx, const kvb_view *v, kvb_plan *out) {
    scripted *s = ctx;
    KVB_TRY(kvb_fcfs(v, NULL, out));
    const kvb_plan_op *run = find_op(out, KVB_OP_RUN);
    int waiting = -1;
    for (int i = 0; i < v->n_reqs; i++)
        if (v->reqs[i].state == KVB_REQ_WAITING) waiting = i;
    switch (s->bad) {
    case BAD_NONE: break;
    case BAD_UNKNOWN_ID: return kvb_plan_push_op(out, (kvb_plan_op){.kind = KVB_OP_RUN, .id = 999, .q_len = 1});
    case BAD_RUN_WAITING:
        ck_assert_int_ge(waiting, 0);
        return kvb_plan_push_op(out, (kvb_plan_op){.kind = KVB_OP_RUN, .id = v->reqs[waiting].id, .q_len = 1});
    case BAD_OVER_BUDGET:
        ck_assert_ptr_nonnull(run);
        out->ops[run - out->ops].q_len = v->max_batch_tokens + 5;
        break;
    case BAD_TOO_MANY_BLOCKS:
        ck_assert_int_ge(waiting, 0);
        return kvb_plan_push_op(out, (kvb_plan_op){.kind = KVB_OP_ADMIT, .id = v->reqs[waiting].id, .q_len = 64});
    case BAD_PREEMPT_SCHEDULED:
        ck_assert_ptr_nonnull(run);
        return kvb_plan_push_op(out, (kvb_plan_op){.kind = KVB_OP_PREEMPT, .id = run->id});
    case BAD_Q_BEYOND_TOKENS: {
        ck_assert_ptr_nonnull(run);
        const kvb_req_view *r = &v->reqs[kvb_view_find(v, run->id)];
        out->ops[run - out->ops].q_len = r->n_tokens - r->n_computed + 1;
        break;
    }
    case BAD_DOUBLE_RUN:
        ck_assert_ptr_nonnull(run);
        return kvb_plan_push_op(out, *run);
    case BAD_RESUME_RUNNING:
        ck_assert_ptr_nonnull(run);
        return kvb_plan_push_op(out, (kvb_plan_op){.kind = KVB_OP_RESUME, .id = run->id});
    case BAD_BATCH_LIMIT: out->batch_limit = v->max_seqs + 1; break;
    case BAD_DROP_PARTIAL:
    case BAD_DROP_NO_ABSENT: {
        /* request 0 has computed 16 tokens (2 full blocks of 8): dropping 3 goes past them; dropping 1
         * before its RUN leaves the RUN reading tokens without KV */
        kvb_plan_op drop = {.kind = KVB_OP_DROP, .id = 0, .n_dropped = s->bad == BAD_DROP_PARTIAL ? 3 : 1};
        KVB_TRY(kvb_plan_push_op(out, drop));
        memmove(out->ops + 1, out->ops, (size_t)(out->n_ops - 1) * sizeof *out->ops);
        out->ops[0] = drop;
        break;
    }
    case BAD_DROP_AFTER_RUN:
        ck_assert_ptr_nonnull(run);
        return kvb_plan_push_op(out, (kvb_plan_op){.kind = KVB_OP_DROP, .id = run->id, .n_dropped = 1});
    case BAD_OFFLOAD_NO_HOST: {
        ck_assert_int_ge(waiting, 0);
        const kvb_req_view *w = &v->reqs[waiting];
        return kvb_plan_push_op(out, (kvb_plan_op){.kind = KVB_OP_ADMIT, .id = w->id, .q_len = w->n_tokens, .offload = 1});
    }
    default: return scripted_residency(s, v, out);
    }
    return KVB_OK;
}

static kvb_status scripted_pool(void *ctx, const kvb_pool_event *ev, const kvb_view *v, kvb_pool_plan *out) {
    if (ev->kind == KVB_POOL_SETUP && ((scripted *)ctx)->host) out->host_tier_blocks = 16;
    return KVB_OK;
}

static const kvb_planner_i scripted_iface = {.name = "scripted", .plan_step = scripted_plan,
                                             .plan_pool = scripted_pool};

/* Requests 0, 2 and 3 on 8 blocks of 8 tokens with a step budget of `budget`, planned by `pl`. */
static kvb_engine *violating_setup(rec *r, kvb_planner *pl, int budget) {
    memset(r, 0, sizeof *r);
    kvb_engine *e = make_engine(r, pl, 8, 8, budget);
    for (int k = 0; k < 4; k += k ? 1 : 2) add(e, (uint64_t)k);
    return e;
}

KVB_TEST(violating_plan_refused) {
    setup_model();
    make_prompts();
    static rec ref, got;
    /* Setup 0: a budget of 16: request 0 (57 tokens, 8 blocks) is admitted first and prefills in chunks
     * while 2 and 3 wait. Setup 1: a budget of 64: 0 and 2 fill the pool at once and 3 waits. Setup 2:
     * setup 0 with a host tier of 16 blocks, three steps in (0 decodes into its block 4). The broken plans
     * come after the warm-up steps; each is refused and leaves everything as it was, and the run then
     * gives the tokens of an unbroken one. */
    const struct { int budget, host, warm; } setups[] = {{16, 0, 1}, {64, 0, 1}, {16, 1, 3}};
    const struct { bad_kind bad; int setup; const char *says; } cases[] = {
        {BAD_UNKNOWN_ID, 0, "no live request has id 999"},
        {BAD_RUN_WAITING, 0, "RUN request 3): the request is waiting, not running"},
        {BAD_OVER_BUDGET, 0, "the plan computes 21 tokens, the step budget is 16"},
        {BAD_TOO_MANY_BLOCKS, 1, "ADMIT request 3): needs 3 block(s), the pool can give 0"},
        {BAD_PREEMPT_SCHEDULED, 0, "scheduled or swapped in earlier in this step"},
        {BAD_Q_BEYOND_TOKENS, 0, "q_len 22, it has 21 token(s) left to compute"},
        {BAD_DOUBLE_RUN, 0, "already scheduled"},
        {BAD_RESUME_RUNNING, 0, "not paused"},
        {BAD_BATCH_LIMIT, 0, "batch_limit 65 is outside"},
        {BAD_DROP_PARTIAL, 0, "DROP request 0): n_dropped 3, it has 2 full block(s)"},
        {BAD_DROP_NO_ABSENT, 0, "RUN request 0): n_absent 0, but its first 8 token(s) have no KV"},
        {BAD_DROP_AFTER_RUN, 0, "DROP request 0): the request is scheduled, swapped in or dropped earlier"},
        {BAD_RES_NOT_IN_POOL, 0, "block 9999 is not a block of the pool"},
        {BAD_STREAM_OWN, 0, "is not borrowed; STREAM is for borrowed blocks"},
        {BAD_RES_OVERLAP, 0, "residency 0 and 1 both give block"},
        {BAD_ABSENT_READ, 0, "is ABSENT but request 0 reads it (n_absent 0)"},
        {BAD_SWAP_NO_HOST, 0, "SWAP_OUT request 0): the engine has no host tier"},
        {BAD_COPY_NO_HOST, 0, "copy 0: the engine has no host tier"},
        {BAD_HOST_NO_COPY, 2, "has no host copy of layer 1 (STORE it first)"},
        {BAD_LOAD_NO_COPY, 2, "from the host tier, which does not hold it"},
        {BAD_STORE_EARLY, 2, "after layer 0, but the step writes the block until layer 2"},
        {BAD_STAGE, 2, "the plan may read 1 blocks through stage buffers, there are slots for 0"},
        {BAD_OFFLOAD_NO_HOST, 1, "ADMIT request 3): an offloaded admission needs a host tier"},
    };
    scripted sc = {BAD_NONE, 0};
    kvb_planner pl = {&scripted_iface, &sc};
    for (int k = 0; k < (int)KVB_ARRAY_LEN(setups); k++) {
        sc.host = setups[k].host;
        kvb_engine *e = violating_setup(&ref, &pl, setups[k].budget);
        run(e);
        kvb_engine_destroy(e);
        e = violating_setup(&got, &pl, setups[k].budget);
        for (int i = 0; i < setups[k].warm; i++) ck_assert_int_eq(kvb_engine_step(e), KVB_OK);
        kvb_engine_stats before, after;
        kvb_engine_get_stats(e, &before);
        int events = got.events, free0 = kvb_block_pool_n_free(kvb_engine_pool(e)), live = kvb_engine_n_live(e);
        for (size_t c = 0; c < KVB_ARRAY_LEN(cases); c++) {
            if (cases[c].setup != k) continue;
            sc.bad = cases[c].bad;
            ck_assert_int_eq(kvb_engine_step(e), KVB_ERR_INVALID);
            ck_assert_msg(strstr(kvb_engine_last_error(e), cases[c].says), "case %zu: '%s' does not say '%s'", c,
                          kvb_engine_last_error(e), cases[c].says);
            printf("refused: %s\n", kvb_engine_last_error(e));
            kvb_engine_get_stats(e, &after);
            ck_assert_int_eq(memcmp(&before, &after, sizeof before), 0);
            ck_assert_int_eq(got.events, events);
            ck_assert_int_eq(kvb_block_pool_n_free(kvb_engine_pool(e)), free0);
            ck_assert_int_eq(kvb_engine_n_live(e), live);
        }
        sc.bad = BAD_NONE;
        run(e);
        for (int r = 0; r < 4; r += r ? 1 : 2) {
            ck_assert_int_eq(got.n[r], ref.n[r]);
            for (int i = 0; i < got.n[r]; i++) ck_assert_int_eq(got.toks[r][i], ref.toks[r][i]);
        }
        kvb_engine_destroy(e);
    }
    teardown_model();
}
KVB_TEST_END

/* ---------------------------------------------------------------- the mechanisms under test planners */

static uint64_t rng_next(uint64_t *x) {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

/* A test planner over vLLM's scheduling that exercises one mechanism of the executor. */
typedef enum mech { MECH_ABSENT, MECH_SWAP, MECH_HOST, MECH_DROP, MECH_DROP_HOST } mech;

typedef struct mechanic {
    mech m;
    uint64_t rng;
    int drops, restores; /* MECH_DROP: DROP operations that released / restored blocks */
    int observed;       /* observe calls */
    int host_free, host_capacity; /* the host tier as the last view saw it (free + evictable) */
    int swapped_runs;   /* MECH_DROP_HOST: RUNs asking for host-tier prefix layers of a request that has copies */
    uint64_t host_bytes;/* what the host link carried, as observed */
    /* MECH_HOST: which (request, block index) has a host copy of which block id */
    uint64_t st_req[512];
    int st_idx[512];
    int32_t st_blk[512];
    int n_st;
} mechanic;

static int stored(const mechanic *m, uint64_t req, int idx, int32_t blk) {
    for (int k = 0; k < m->n_st; k++)
        if (m->st_req[k] == req && m->st_idx[k] == idx && m->st_blk[k] == blk) return 1;
    return 0;
}

/* Forgets the host copies recorded for request `id` (its blocks were released: preempted). */
static void forget(mechanic *m, uint64_t id) {
    for (int k = 0; k < m->n_st; k++)
        if (m->st_req[k] == id) {
            m->n_st--;
            m->st_req[k] = m->st_req[m->n_st];
            m->st_idx[k] = m->st_idx[m->n_st];
            m->st_blk[k--] = m->st_blk[m->n_st];
        }
}

static kvb_status mech_plan(void *ctx, const kvb_view *v, kvb_plan *out) {
    mechanic *m = ctx;
    kvb_fcfs_opts o = {.preempt_op = m->m == MECH_SWAP ? KVB_OP_SWAP_OUT : KVB_OP_PREEMPT};
    m->host_free = v->pool.host_free + v->pool.host_evictable;
    m->host_capacity = v->pool.host_capacity;
    KVB_TRY(kvb_fcfs(v, &o, out));
    if (m->m == MECH_DROP_HOST) out->prefix_serial = (int)(rng_next(&m->rng) % 4); /* the ablations' paths too */
    for (int i = 0; i < v->n_reqs; i++)
        if (v->reqs[i].state != KVB_REQ_RUNNING) forget(m, v->reqs[i].id);
    for (int k = 0; k < out->n_ops; k++)
        if (out->ops[k].kind == KVB_OP_PREEMPT) forget(m, out->ops[k].id);
    int L = v->geom->n_layers, n_ops = out->n_ops;
    for (int k = 0; k < n_ops; k++) {
        kvb_plan_op *op = &out->ops[k];
        if (op->kind != KVB_OP_RUN) continue;
        const kvb_req_view *r = &v->reqs[kvb_view_find(v, op->id)];
        if (m->m == MECH_ABSENT) {
            op->n_absent = (int)(rng_next(&m->rng) % (uint64_t)(r->n_computed + 1));
        } else if ((m->m == MECH_DROP || m->m == MECH_DROP_HOST) && r->state == KVB_REQ_RUNNING &&
                   rng_next(&m->rng) % 2) {
            /* a random count of released leading blocks (more, fewer: restored, or the same), put before
             * the RUN, whose n_absent then covers every block without KV; kept only if the pool allows */
            int bs = v->geom->block_size, full = r->n_computed / bs;
            int to = (int)(rng_next(&m->rng) % (uint64_t)(full + 1));
            int before = op->n_absent, lo = KVB_MAX(to, r->n_dropped) * bs;
            op->n_absent = lo + (int)(rng_next(&m->rng) % (uint64_t)(r->n_computed - lo + 1));
            kvb_plan_op drop = {.kind = KVB_OP_DROP, .id = r->id, .n_dropped = to};
            if (m->m == MECH_DROP_HOST) { /* random layer counts: stored at the DROP, read by the RUN */
                drop.n_host = (int)(rng_next(&m->rng) % (uint64_t)(L + 1));
                op->n_host = (int)(rng_next(&m->rng) % (uint64_t)(L + 1));
            }
            KVB_TRY(kvb_plan_push_op(out, drop));
            memmove(out->ops + k + 1, out->ops + k, (size_t)(out->n_ops - 1 - k) * sizeof *out->ops);
            out->ops[k] = drop;
            kvb_plan_cost cost;
            if (kvb_sched_cost(v, out, &cost, NULL, 0) == KVB_OK) {
                m->drops += to > r->n_dropped;
                m->restores += to < r->n_dropped;
                k++;
                n_ops++;
            } else { /* undo */
                memmove(out->ops + k, out->ops + k + 1, (size_t)(out->n_ops - 1 - k) * sizeof *out->ops);
                out->n_ops--;
                out->ops[k].n_absent = before;
                out->ops[k].n_host = 0;
            }
        } else if (m->m == MECH_DROP_HOST && r->state == KVB_REQ_RUNNING) {
            /* no DROP this step: the released blocks (if any) are read at a random number of upper layers */
            op->n_host = (int)(rng_next(&m->rng) % (uint64_t)(L + 1));
            m->swapped_runs += op->n_host > 0 && r->host_layers > 0;
        } else if (m->m == MECH_HOST && r->state == KVB_REQ_RUNNING) {
            /* blocks stored in an earlier step are read from the host tier at layers 1.. (the request's
             * tail block too: the rows this step writes there go through the host copy); every block
             * is stored again after the last layer */
            for (int j = 0; j < r->n_blocks; j++) {
                int given = 0; /* a prefix block shared with an earlier request of the plan is one entry */
                for (int c = 0; c < out->n_copies && !given; c++) given = out->copies[c].block == r->blocks[j];
                if (given) continue;
                if (stored(m, r->id, j, r->blocks[j]))
                    KVB_TRY(kvb_plan_push_res(out, (kvb_plan_res){r->blocks[j], 1, L, KVB_RES_HOST}));
                KVB_TRY(kvb_plan_push_copy(out, (kvb_plan_copy){KVB_COPY_STORE, r->blocks[j], 0, L, L - 1}));
                if (!stored(m, r->id, j, r->blocks[j]) && m->n_st < 512) {
                    m->st_req[m->n_st] = r->id;
                    m->st_idx[m->n_st] = j;
                    m->st_blk[m->n_st++] = r->blocks[j];
                }
            }

        }
    }
    return KVB_OK;
}

static kvb_status mech_pool(void *ctx, const kvb_pool_event *ev, const kvb_view *v, kvb_pool_plan *out) {
    const mechanic *m = ctx;
    if (ev->kind != KVB_POOL_SETUP) return KVB_OK;
    if (m->m == MECH_ABSENT || m->m == MECH_DROP || m->m == MECH_DROP_HOST) out->extra_rows = 1024;
    if (m->m == MECH_DROP_HOST) out->host_tier_blocks = 512;
    if (m->m == MECH_SWAP || m->m == MECH_HOST) out->host_tier_blocks = 512;
    if (m->m == MECH_HOST) out->stage_slots = 256;
    return KVB_OK;
}

static void mech_observe(void *ctx, const kvb_step_report *r) {
    mechanic *m = ctx;
    uint64_t layers = 0;
    for (int l = 0; l < r->n_layers; l++) {
        ck_assert_uint_le(r->t_wait_ns[l], r->t_layer_ns[l]);
        layers += r->t_layer_ns[l];
    }
    ck_assert_uint_le(layers, r->t_step_ns);
    ck_assert_int_ge(r->n_seqs, 1);
    m->observed++;
    m->host_bytes += r->links[KVB_LINK_HOST].bytes;
}

static const kvb_planner_i mech_iface = {.name = "mechanic", .plan_step = mech_plan, .plan_pool = mech_pool,
                                         .observe = mech_observe};

static void late_device(kvb_backend *be, int on);
static int mech_late; /* mechanism_lossless runs its engines on the late device (device_waits_lossless) */

/* The pressure scenario of every_planner_lossless under a test planner using mechanism `which`. */
static void mechanism_lossless(mech which, const kvb_link_model *links) {
    setup_model();
    make_prompts();
    static rec ref, got;
    reference(&ref);
    uint64_t preempted = 0;
    for (size_t c = 0; c < KVB_ARRAY_LEN(cfgs); c++) {
        static mechanic m;
        memset(&m, 0, sizeof m);
        m.m = which;
        m.rng = 0x9E3779B97F4A7C15ull + c;
        kvb_planner pl = {&mech_iface, &m};
        memset(&got, 0, sizeof got);
        kvb_engine_opts o;
        kvb_engine_opts_default(&o);
        o.block_size = cfgs[c].bs;
        o.n_blocks = cfgs[c].blocks;
        o.max_batch_tokens = cfgs[c].budget;
        if (links) o.links = *links;
        kvb_engine_events ev = {.ud = &got, .on_token = on_token, .on_finish = on_finish};
        kvb_engine *e = NULL;
        if (mech_late) late_device(tm.be, 1);
        ck_assert_int_eq(kvb_engine_create(model, &o, &pl, &ev, &e), KVB_OK);
        for (int r = 0; r < 3; r++) add(e, (uint64_t)r);
        for (int i = 0; i < 6; i++) ck_assert_msg(kvb_engine_step(e) == KVB_OK, "step: %s", kvb_engine_last_error(e));
        add(e, 3);
        add(e, 4);
        run(e);
        kvb_engine_stats s;
        kvb_engine_get_stats(e, &s);
        ck_assert_int_eq(s.blocks_free, s.blocks_total);
        ck_assert_int_eq(kvb_engine_step(e), KVB_OK); /* an empty step: the planner sees the host tier */
        ck_assert_int_eq(m.host_free, m.host_capacity); /* no host-tier block leaked */
        printf("config %zu: %llu steps, %llu recomputed tokens, %llu swap-outs, %llu swap-ins, %llu staged loads, "
               "%llu copy orders, host link %llu bytes\n", c, (unsigned long long)s.steps,
               (unsigned long long)s.recomputed_tokens, (unsigned long long)s.swap_outs, (unsigned long long)s.swap_ins,
               (unsigned long long)s.lsc_loads, (unsigned long long)s.copy_orders,
               (unsigned long long)s.links[KVB_LINK_HOST].bytes);
        fflush(stdout);
        assert_same(&ref, &got);
        ck_assert_int_eq(m.observed, (int)s.steps);
        if (which == MECH_ABSENT) ck_assert_uint_gt(s.recomputed_tokens, 0);
        if (which == MECH_DROP_HOST) {
            printf("config %zu: %d drops, %d restores, %llu released blocks stored to the host tier, %llu "
                   "(block, layer) slices loaded instead of recomputed, %d runs reading host layers\n", c, m.drops,
                   m.restores, (unsigned long long)s.prefix_host_stores, (unsigned long long)s.prefix_host_loads,
                   m.swapped_runs);
            ck_assert_int_gt(m.drops, 0);
            ck_assert_int_gt(m.restores, 0);
            ck_assert_uint_gt(s.prefix_host_stores, 0);
            ck_assert_uint_gt(s.prefix_host_loads, 0);
            /* the recomputed rows left the forward pass above their recomputed layers */
            ck_assert_uint_lt(s.recomputed_row_layers, s.recomputed_tokens * (uint64_t)kvb_model_cfg(model)->n_layers);
            preempted += s.preemptions; /* copies released with their request's KV (the host check above) */
        }
        if (which == MECH_DROP) {
            printf("config %zu: %d drops, %d restores, %llu blocks released, %llu restored\n", c, m.drops, m.restores,
                   (unsigned long long)s.dropped_blocks, (unsigned long long)s.restored_blocks);
            ck_assert_int_gt(m.drops, 0);
            ck_assert_int_gt(m.restores, 0);
            ck_assert_uint_gt(s.dropped_blocks, 0);
            ck_assert_uint_gt(s.restored_blocks, 0);
            ck_assert_uint_eq(s.recomputed_row_layers, s.recomputed_tokens * (uint64_t)kvb_model_cfg(model)->n_layers); /* every layer recomputed */
        }
        if (which == MECH_SWAP) {
            ck_assert_uint_gt(s.swap_outs, 0);
            ck_assert_uint_eq(s.swap_ins, s.swap_outs);
            ck_assert_uint_eq(s.preemptions, 0);
        }
        if (which == MECH_HOST) {
            ck_assert_uint_gt(s.lsc_loads, 0);
            ck_assert_uint_gt(s.copy_orders, 0);
            ck_assert_uint_eq(m.host_bytes, s.links[KVB_LINK_HOST].bytes);
        }
        kvb_engine_destroy(e);
        if (mech_late) { /* every layer_in wait on the device */
            printf("config %zu: layer_in waited %llu copies on the device, %llu on the host\n", c,
                   (unsigned long long)s.layer_in_device_waits, (unsigned long long)s.layer_in_host_waits);
            ck_assert_uint_gt(s.layer_in_device_waits, 0);
            ck_assert_uint_eq(s.layer_in_host_waits, 0);
            late_device(tm.be, 0);
        }
    }
    if (which == MECH_DROP_HOST) ck_assert_uint_gt(preempted, 0);
    teardown_model();
}

/* eLLM token-wise at fixed random ratios r in [0, 0.9] (and with its own optimizer, with and without a
 * TPOT SLO) on the pressure scenario: the reference's tokens, with blocks released and recomputed. */
KVB_TEST(ellm_tokenwise_lossless) {
    setup_model();
    make_prompts();
    static rec ref, got;
    reference(&ref);
    uint64_t rng = 0x1234567ull;
    {
        /* a count of swapped layers without swapped layers is refused */
        kvb_policy_params pp = {0};
        kvb_planner pl;
        ck_assert_int_eq(kvb_policy_params_set(&pp, "n_swap", "1"), KVB_OK);
        ck_assert_int_eq(kvb_policy_create("ellm-tokenwise", &pp, &pl), KVB_ERR_INVALID);
        kvb_policy_params_free(&pp);
    }
    uint64_t host_loads = 0;
    for (size_t c = 0; c < KVB_ARRAY_LEN(cfgs); c++) {
        for (int t = 0; t < 7; t++) {
            kvb_policy_params pp = {0};
            char r[32], ns[16];
            double ratio = (double)(rng_next(&rng) % 901) / 1000.0;
            snprintf(r, sizeof r, "%.3f", ratio);
            snprintf(ns, sizeof ns, "%d", (int)(rng_next(&rng) % 4));
            if (t < 2 || t >= 4) ck_assert_int_eq(kvb_policy_params_set(&pp, "r", r), KVB_OK);
            if (t == 3) ck_assert_int_eq(kvb_policy_params_set(&pp, "slo_ms", "50"), KVB_OK);
            /* swapped layers (§4.3): a random count, the layer level's, and the two ablations */
            if (t >= 4) ck_assert_int_eq(kvb_policy_params_set(&pp, "swap", "1"), KVB_OK);
            if (t == 4 || t == 6) ck_assert_int_eq(kvb_policy_params_set(&pp, "n_swap", ns), KVB_OK);
            if (t == 6) ck_assert_int_eq(kvb_policy_params_set(&pp, "overlap", "0"), KVB_OK);
            if (t == 6) ck_assert_int_eq(kvb_policy_params_set(&pp, "fuse", "0"), KVB_OK);
            ck_assert_int_eq(kvb_policy_params_set(&pp, "async", t == 1 || t == 5 ? "1" : "0"), KVB_OK);
            kvb_planner pl;
            ck_assert_int_eq(kvb_policy_create("ellm-tokenwise", &pp, &pl), KVB_OK);
            kvb_policy_params_free(&pp);
            kvb_engine_stats s;
            pressure(&got, &pl, cfgs[c].bs, cfgs[c].blocks, cfgs[c].budget, &s);
            static const char *const what[] = {"fixed", "fixed", "optimized", "optimized, SLO 50 ms",
                                               "fixed, swap n_swap", "fixed, swap by the layer level",
                                               "fixed, swap n_swap, overlap=0 fuse=0"};
            printf("config %zu %s r=%s n_swap=%s: %llu steps, %llu preemptions, %llu recomputed tokens, %llu blocks "
                   "released, %llu restored, %llu stored to the host tier, %llu (block, layer) loads\n", c, what[t],
                   t < 2 || t >= 4 ? r : "-", t == 4 || t == 6 ? ns : "-", (unsigned long long)s.steps,
                   (unsigned long long)s.preemptions, (unsigned long long)s.recomputed_tokens,
                   (unsigned long long)s.dropped_blocks, (unsigned long long)s.restored_blocks,
                   (unsigned long long)s.prefix_host_stores, (unsigned long long)s.prefix_host_loads);
            assert_same(&ref, &got);
            ck_assert_int_eq(s.blocks_free, s.blocks_total);
            if ((t < 2 || t >= 4) && ratio * 20 >= 2 * cfgs[c].bs) ck_assert_uint_gt(s.dropped_blocks, 0);
            host_loads += s.prefix_host_loads;
        }
    }
    ck_assert_uint_gt(host_loads, 0); /* some runs read prefix layers from the host tier */
    teardown_model();
}
KVB_TEST_END

/* eLLM's step has the baselines' token budget (chunk + b): with two requests decoding and a long prompt
 * queued, ellm-tokenwise at r = 0 prefills as many of the prompt's tokens in a step as vllm-recompute
 * (both under b_max = 4 and an SLO that does not bind). */
KVB_TEST(ellm_prefill_budget_as_baselines) {
    setup_model();
    uint64_t got[2] = {0, 0};
    static const char *const pols[2] = {"ellm-tokenwise", "vllm-recompute"};
    int32_t prompt[200];
    for (int i = 0; i < 200; i++) prompt[i] = 3 + (i * 37) % 190;
    for (int k = 0; k < 2; k++) {
        kvb_policy_params pp = {0};
        ck_assert_int_eq(kvb_policy_params_set(&pp, "slo_ms", "100000"), KVB_OK);
        ck_assert_int_eq(kvb_policy_params_set(&pp, "b_max", "4"), KVB_OK);
        ck_assert_int_eq(kvb_policy_params_set(&pp, "chunk", "64"), KVB_OK);
        ck_assert_int_eq(kvb_policy_params_set(&pp, "async", "0"), KVB_OK);
        if (k == 0) ck_assert_int_eq(kvb_policy_params_set(&pp, "r", "0"), KVB_OK);
        kvb_planner pl;
        ck_assert_int_eq(kvb_policy_create(pols[k], &pp, &pl), KVB_OK);
        kvb_policy_params_free(&pp);
        kvb_engine_opts o;
        kvb_engine_opts_default(&o);
        o.n_blocks = 128;
        o.max_batch_tokens = 512;
        o.max_seqs = 8;
        o.enable_prefix_cache = 0;
        kvb_engine *e;
        ck_assert_int_eq(kvb_engine_create(model, &o, &pl, NULL, &e), KVB_OK);
        for (int i = 0; i < 2; i++) {
            kvb_request r = {.id = (uint64_t)i + 1, .prompt = prompt + 100 + 8 * i, .n_prompt = 8, .max_tokens = 60};
            ck_assert_int_eq(kvb_engine_add(e, &r), KVB_OK);
        }
        kvb_engine_stats s0, s1;
        for (int t = 0; t < 4; t++) ck_assert_int_eq(kvb_engine_step(e), KVB_OK);
        kvb_engine_get_stats(e, &s0);
        ck_assert_int_eq(s0.n_running, 2);
        kvb_request r = {.id = 9, .prompt = prompt, .n_prompt = 200, .max_tokens = 2};
        ck_assert_int_eq(kvb_engine_add(e, &r), KVB_OK);
        ck_assert_int_eq(kvb_engine_step(e), KVB_OK);
        kvb_engine_get_stats(e, &s1);
        got[k] = s1.prompt_tokens - s0.prompt_tokens;
        printf("%s: %llu prompt tokens in the step with 2 decoding\n", pols[k], (unsigned long long)got[k]);
        kvb_engine_destroy(e);
    }
    ck_assert_uint_gt(got[1], 0);
    ck_assert_uint_eq(got[0], got[1]);
    teardown_model();
}
KVB_TEST_END

/* HCache: preempted requests leave their first layers as saved hidden states, rebuilt at swap-in by the
 * layer's norm, K/V projections and RoPE: the reference's tokens whatever the split. */
KVB_TEST(hcache_lossless) {
    setup_model();
    make_prompts();
    static rec ref, got;
    reference(&ref);
    uint64_t restores = 0, swaps = 0;
    for (size_t c = 0; c < KVB_ARRAY_LEN(cfgs); c++)
        for (int hl = 0; hl <= 3; hl += 1) {
            kvb_policy_params pp = {0};
            char v[16];
            snprintf(v, sizeof v, "%d", hl);
            ck_assert_int_eq(kvb_policy_params_set(&pp, "hidden_layers", v), KVB_OK);
            ck_assert_int_eq(kvb_policy_params_set(&pp, "async", "0"), KVB_OK);
            kvb_planner pl;
            ck_assert_int_eq(kvb_policy_create("hcache", &pp, &pl), KVB_OK);
            kvb_policy_params_free(&pp);
            kvb_engine_stats s;
            pressure(&got, &pl, cfgs[c].bs, cfgs[c].blocks, cfgs[c].budget, &s);
            printf("config %zu hidden_layers %d: %llu steps, %llu swap-outs, %llu rebuilt from hidden states, %llu "
                   "bytes of hidden states saved\n", c, hl, (unsigned long long)s.steps, (unsigned long long)s.swap_outs,
                   (unsigned long long)s.hidden_restores, (unsigned long long)s.hidden_saved_bytes);
            assert_same(&ref, &got);
            ck_assert_int_eq(s.blocks_free, s.blocks_total);
            if (hl > 0) restores += s.hidden_restores;
            swaps += s.swap_outs;
        }
    ck_assert_uint_gt(swaps, 0);
    ck_assert_uint_gt(restores, 0);
    teardown_model();
}
KVB_TEST_END

KVB_TEST(absent_tokens_lossless) { mechanism_lossless(MECH_ABSENT, NULL); }
KVB_TEST_END

KVB_TEST(swap_lossless) { mechanism_lossless(MECH_SWAP, NULL); }
KVB_TEST_END

/* Requests release and restore their leading blocks at random (KVB_OP_DROP), recomputing what has no
 * KV: the tokens stay the reference's and every block comes back to the pool. */
KVB_TEST(drop_blocks_lossless) { mechanism_lossless(MECH_DROP, NULL); }
KVB_TEST_END

/* eLLM §4.3 with swapped layers: released blocks keep host-tier copies of a random number of upper
 * layers (DROP n_host), each RUN reads a random number of them from the host tier instead of
 * recomputing them (RUN n_host, more than the copies hold included), restores, preemptions and both
 * ablation paths included, under a link model: the reference's tokens, nothing leaked. */
KVB_TEST(drop_blocks_swapped_layers_lossless) {
    kvb_link_model lm = {.name = "test", .target = "test links", .scale = 1, .target_flops = 1};
    lm.links[KVB_LINK_HOST] = (kvb_link){2e9, 20e-6};
    mechanism_lossless(MECH_DROP_HOST, &lm);
}
KVB_TEST_END

KVB_TEST(host_residency_lossless) {
    /* also under a link model: 2 GB/s and 20 us per transfer on the host link */
    kvb_link_model lm = {.name = "test", .target = "test links", .scale = 1, .target_flops = 1};
    lm.links[KVB_LINK_HOST] = (kvb_link){2e9, 20e-6};
    mechanism_lossless(MECH_HOST, &lm);
}
KVB_TEST_END

/* ---------------------------------------------------------------- device waits (issue 30)
 * A device on the CPU whose copies land late: copy_async (the CPU backend's other members as they are)
 * poisons the destinations (0xFF: NaN) and queues the copies per copy engine; they land, in issue order
 * on their engine, when wait_ticket (the compute stream waits: its next operators run after) or
 * ticket_wait (the host waits) reaches them, or when a later copy on the engine touches their memory.
 * ticket_done only asks. So an operator that reads a load nobody waited for reads NaN, and the counts
 * say who waited. The stager then waits on the device (its link model off). */

typedef struct late_copy {
    void *dst;
    const void *src;
    size_t n;
    uint64_t t;
    int eng;
} late_copy;

static struct {
    pthread_mutex_t mu;
    late_copy q[4096];
    int n;
    uint64_t last;            /* tickets handed out */
    uint8_t eng_of[1 << 16];  /* [ticket % 65536] its engine */
    uint64_t device_waits, host_waits, landed_by_device, landed_by_host;
    uint64_t fail_bytes;      /* copy_async of a piece of this size fails (0: none) */
    int log[16], n_log;       /* the first calls: 1 + engine for copy_async, -1 - engine for ticket_wait */
    const kvb_backend_i *cpu;
    kvb_backend_i iface;
} late = {.mu = PTHREAD_MUTEX_INITIALIZER};

static int late_overlap(const void *a, size_t na, const void *b, size_t nb) {
    return (uintptr_t)a < (uintptr_t)b + nb && (uintptr_t)b < (uintptr_t)a + na;
}

/* Lands (late.mu held) the queued copies of engine `eng` up to ticket t, in order; `by`: 1 device, 0 host. */
static void late_land(int eng, uint64_t t, int by) {
    int k = 0;
    for (int i = 0; i < late.n; i++) {
        late_copy *c = &late.q[i];
        if (c->eng == eng && c->t <= t) {
            memmove(c->dst, c->src, c->n);
            *(by ? &late.landed_by_device : &late.landed_by_host) += 1;
        } else {
            late.q[k++] = *c;
        }
    }
    late.n = k;
}

static kvb_status late_copy_async(void *ctx, kvb_copy_engine dir, const kvb_copy_piece *x, int n, uint64_t *ticket) {
    (void)ctx;
    pthread_mutex_lock(&late.mu);
    for (int i = 0; i < n; i++)
        if (late.fail_bytes && x[i].bytes == late.fail_bytes) {
            pthread_mutex_unlock(&late.mu);
            return KVB_ERR_BACKEND;
        }
    uint64_t t = ++late.last;
    late.eng_of[t % (1u << 16)] = (uint8_t)dir;
    if (late.n_log < 16) late.log[late.n_log++] = 1 + (int)dir;
    for (int i = 0; i < n; i++) {
        if (!x[i].bytes) continue;
        /* stream order: an earlier copy on the engine that reads or writes this destination runs first */
        uint64_t before = 0;
        for (int j = 0; j < late.n; j++) {
            const late_copy *c = &late.q[j];
            if (c->eng == (int)dir && (late_overlap(c->dst, c->n, x[i].dst, x[i].bytes) ||
                                        late_overlap(c->src, c->n, x[i].dst, x[i].bytes)))
                before = c->t;
        }
        if (before) late_land((int)dir, before, 0);
        ck_assert_int_lt(late.n, (int)KVB_ARRAY_LEN(late.q));
        late.q[late.n++] = (late_copy){x[i].dst, x[i].src, x[i].bytes, t, (int)dir};
        memset(x[i].dst, 0xFF, x[i].bytes);
    }
    *ticket = t;
    pthread_mutex_unlock(&late.mu);
    return KVB_OK;
}

static kvb_status late_wait(uint64_t t, int by) {
    pthread_mutex_lock(&late.mu);
    kvb_status st = t == 0 || t > late.last ? KVB_ERR_INVALID : KVB_OK;
    if (st == KVB_OK) {
        int eng = late.eng_of[t % (1u << 16)];
        *(by ? &late.device_waits : &late.host_waits) += 1;
        if (!by && late.n_log < 16) late.log[late.n_log++] = -1 - eng;
        late_land(eng, t, by);
    }
    pthread_mutex_unlock(&late.mu);
    return st;
}
static kvb_status late_wait_ticket(void *ctx, uint64_t t) { return (void)ctx, late_wait(t, 1); }
static kvb_status late_ticket_wait(void *ctx, uint64_t t) { return (void)ctx, late_wait(t, 0); }
static int late_ticket_done(void *ctx, uint64_t t) {
    (void)ctx;
    pthread_mutex_lock(&late.mu);
    int done = 1;
    for (int i = 0; i < late.n; i++)
        if (late.q[i].eng == late.eng_of[t % (1u << 16)] && late.q[i].t <= t) done = 0;
    pthread_mutex_unlock(&late.mu);
    return done;
}

/* Puts the late device in place of the CPU backend's tickets (on = 0: back), its counts cleared. */
static void late_device(kvb_backend *be, int on) {
    if (!late.cpu) late.cpu = be->iface;
    pthread_mutex_lock(&late.mu);
    ck_assert_int_eq(late.n, 0); /* every copy landed */
    late.iface = *late.cpu;
    late.iface.copy_async = late_copy_async;
    late.iface.wait_ticket = late_wait_ticket;
    late.iface.ticket_wait = late_ticket_wait;
    late.iface.ticket_done = late_ticket_done;
    late.device_waits = late.host_waits = late.landed_by_device = late.landed_by_host = 0;
    late.fail_bytes = 0;
    late.n_log = 0;
    pthread_mutex_unlock(&late.mu);
    be->iface = on ? &late.iface : late.cpu;
}

/* Every planner under pressure on the late device: recompute's tokens (the CPU's), no layer_in waits on
 * the host, the layers' loads ordered by the device waits. Without a wait before a layer, its
 * attention reads NaN; with host waits in layer_in (the stager before issue 30), layer_in_host_waits. */
KVB_TEST(device_waits_lossless) {
    setup_model();
    make_prompts();
    static rec ref, got;
    reference(&ref);
    int with_device_waits = 0;
    for (size_t c = 0; c < 2; c++)
        for (int k = 0; k < kvb_policy_count(); k++) {
            const kvb_policy_info *pi = kvb_policy_info_at(k);
            kvb_planner pl;
            ck_assert_int_eq(kvb_policy_create(pi->name, NULL, &pl), KVB_OK);
            late_device(tm.be, 1);
            kvb_engine_stats s;
            pressure(&got, &pl, cfgs[c].bs, cfgs[c].blocks, cfgs[c].budget, &s);
            printf("config %zu %-20s: layer_in waited %llu copies on the device, %llu on the host; late device: "
                   "%llu wait_ticket, %llu ticket_wait, copies landed %llu by wait_ticket, %llu by ticket_wait\n",
                   c, pi->name, (unsigned long long)s.layer_in_device_waits, (unsigned long long)s.layer_in_host_waits,
                   (unsigned long long)late.device_waits, (unsigned long long)late.host_waits,
                   (unsigned long long)late.landed_by_device, (unsigned long long)late.landed_by_host);
            fflush(stdout);
            uint64_t by_device = late.landed_by_device;
            late_device(tm.be, 0);
            assert_same(&ref, &got);
            ck_assert_uint_eq(s.layer_in_host_waits, 0);
            if (s.layer_in_device_waits) {
                with_device_waits++;
                ck_assert_uint_gt(by_device, 0);
            }
        }
    ck_assert_int_ge(with_device_waits, 8); /* orbitflow, deepspeed, flexgen, host-tier, ... in both configs */
    teardown_model();
    /* the test planner's mechanisms: stage buffers and copy orders (residency), prefix layers from the
     * host tier (prefix) */
    mech_late = 1;
    mechanism_lossless(MECH_HOST, NULL);
    mechanism_lossless(MECH_DROP_HOST, NULL);
    mech_late = 0;
}
KVB_TEST_END

/* The stager on the late device: wait_device returns once the copy is issued and leaves the waiting to
 * the backend's wait_ticket; post order per link across copy engines (a store lands before the load
 * after it is issued); a failed issue fails wait_device, settle and drain; a pacing link model waits on
 * the host as before. */
KVB_TEST(stager_device_waits) {
    setup_model();
    late_device(tm.be, 1);
    kvb_stager *s;
    ck_assert_int_eq(kvb_stager_create(tm.be, NULL, &s), KVB_OK);
    ck_assert_int_eq(kvb_stager_device_waits(s), 1);
    enum { N = 4096 };
    static unsigned char src[3][N], dst[3][N];
    for (int i = 0; i < 3; i++) memset(src[i], 10 + i, N);
    kvb_xfer x[3];
    uint64_t t[3], h, d;
    for (int i = 0; i < 3; i++) {
        x[i] = (kvb_xfer){dst[i], src[i], N};
        ck_assert_int_eq(kvb_stager_post(s, KVB_LINK_HOST, KVB_XFER_H2D, &x[i], 1, &t[i]), KVB_OK);
    }
    /* issued, not landed: done says no, the destinations are poison */
    for (int spin = 0; spin < 100000 && __atomic_load_n(&late.last, __ATOMIC_SEQ_CST) < 3; spin++) usleep(100);
    ck_assert_uint_eq(late.last, 3);
    ck_assert_int_eq(kvb_stager_done(s, t[0]), 0);
    ck_assert_int_eq(dst[0][0], 0xFF);
    /* the device waits for the second: the first two land by wait_ticket, the host waited for nothing */
    ck_assert_int_eq(kvb_stager_wait_device(s, t[1]), KVB_OK);
    ck_assert_uint_eq(late.device_waits, 1);
    ck_assert_uint_eq(late.host_waits, 0);
    ck_assert_uint_eq(late.landed_by_device, 2);
    ck_assert_int_eq(memcmp(dst[1], src[1], N), 0);
    ck_assert_int_eq(dst[2][0], 0xFF);
    kvb_stager_wait_counts(s, &h, &d);
    ck_assert_uint_eq(h, 0);
    ck_assert_uint_eq(d, 1);
    /* the host waits for the third */
    ck_assert_int_eq(kvb_stager_wait(s, t[2]), KVB_OK);
    ck_assert_uint_eq(late.host_waits, 1);
    ck_assert_int_eq(memcmp(dst[2], src[2], N), 0);
    ck_assert_int_eq(kvb_stager_done(s, t[2]), 1);
    /* post order across engines: a store (D2H) and then a load (H2D) into the memory it reads */
    late.n_log = 0;
    memset(src[0], 77, N);
    kvb_xfer st = {src[1], dst[0], N}, ld = {dst[0], src[0], N};
    uint64_t ts, tl;
    ck_assert_int_eq(kvb_stager_post(s, KVB_LINK_HOST, KVB_XFER_D2H, &st, 1, &ts), KVB_OK);
    ck_assert_int_eq(kvb_stager_post(s, KVB_LINK_HOST, KVB_XFER_H2D, &ld, 1, &tl), KVB_OK);
    ck_assert_int_eq(kvb_stager_wait_device(s, tl), KVB_OK);
    ck_assert_int_eq(late.n_log, 3);
    ck_assert_int_eq(late.log[0], 1 + KVB_ENGINE_D2H);  /* the store issued */
    ck_assert_int_eq(late.log[1], -1 - KVB_ENGINE_D2H); /* landed (the copy thread waited) */
    ck_assert_int_eq(late.log[2], 1 + KVB_ENGINE_H2D);  /* then the load */
    ck_assert_int_eq(src[1][0], 10);                     /* the store read the old bytes */
    ck_assert_int_eq(dst[0][0], 77);
    ck_assert_int_eq(kvb_stager_settle(s), KVB_OK);
    /* a copy that fails: wait_device says so, settle too, drain returns it and clears it */
    late.fail_bytes = 100;
    kvb_xfer bad = {dst[1], src[1], 100};
    uint64_t tb;
    ck_assert_int_eq(kvb_stager_post(s, KVB_LINK_PEER, KVB_XFER_D2D, &bad, 1, &tb), KVB_OK);
    ck_assert_int_eq(kvb_stager_wait_device(s, tb), KVB_ERR_BACKEND);
    ck_assert_int_eq(kvb_stager_settle(s), KVB_ERR_BACKEND);
    ck_assert_int_eq(kvb_stager_drain(s), KVB_ERR_BACKEND);
    ck_assert_int_eq(kvb_stager_drain(s), KVB_OK);
    late.fail_bytes = 0;
    kvb_stager_destroy(s);
    /* a link model that paces copies: the host waits, as before */
    kvb_link_model paced = {.name = "paced", .scale = 1, .target_flops = 1};
    paced.links[KVB_LINK_HOST] = (kvb_link){1e9, 1e-6};
    ck_assert_int_eq(kvb_stager_create(tm.be, &paced, &s), KVB_OK);
    ck_assert_int_eq(kvb_stager_device_waits(s), 0);
    ck_assert_int_eq(kvb_stager_post(s, KVB_LINK_HOST, KVB_XFER_H2D, &x[0], 1, &t[0]), KVB_OK);
    ck_assert_int_eq(kvb_stager_wait_device(s, t[0]), KVB_OK);
    kvb_stager_wait_counts(s, &h, &d);
    ck_assert_uint_eq(h, 1);
    ck_assert_uint_eq(d, 0);
    ck_assert_uint_eq(late.device_waits, 2); /* the two above: none here */
    kvb_stager_destroy(s);
    late_device(tm.be, 0);
    teardown_model();
}
KVB_TEST_END

/* ---------------------------------------------------------------- the stager and its link model */

/* The time scale from a fake measurement, against figures worked out by hand for Llama-3-8B bf16 on an
 * H100 SXM (989 TFLOP/s, 3.35 TB/s): a decode step of 4 requests over 512 tokens reads 15,009,316,864
 * bytes of weights (32 layers x 218,103,808 parameters + the 525,336,576 of the LM head, 2 bytes each)
 * and 4 x 514 x 32 x 4,096 bytes of KV, 61 GFLOP: memory-bound, 4.561 ms, 142.5 us a layer. A bench model
 * of 2 layers, 64 bytes of KV per token and layer, whose step took 10 ms (5 ms a layer), runs 35.08x
 * slower than the target: PCIe 5's 10 us become 350.8 us, and its 50 GB/s carry 64x fewer bytes in
 * 35.08x more time: 22.27 MB/s. One layer's KV of the batch then takes as many layers' compute here as
 * on the target. */
KVB_TEST(link_time_scale) {
    kvb_link_model lm;
    ck_assert_int_eq(kvb_link_preset_find("h100-pcie5-scaled", &lm), KVB_OK);
    ck_assert_int_eq(lm.calibrate, 1);
    const double weights = (32.0 * 218103808 + 525336576) * 2, kv = 4.0 * 514 * 32 * 4096;
    const double target_step = (weights + kv) / 3.35e12, per_layer = target_step / 32;
    ck_assert_double_eq_tol(kvb_target_weight_bytes(&lm.tm), weights, 1);
    ck_assert_double_eq_tol(kvb_target_step_s(&lm.gpu, &lm.tm, 4, 1, 512), target_step, 1e-12);
    kvb_link_point pt = {.batch = 4, .q = 1, .ctx = 512};
    ck_assert_int_eq(kvb_link_scale(&lm, &pt, 10e-3, 2, 64), KVB_OK);
    ck_assert_int_eq(lm.calibrate, 0);
    const double scale = 5e-3 / per_layer;
    ck_assert_double_eq_tol(scale, 35.08, 0.01);
    ck_assert_double_eq_tol(lm.scale, scale, 1e-9);
    ck_assert_double_eq_tol(lm.kv_ratio, 1.0 / 64, 1e-15);
    ck_assert_double_eq_tol(lm.links[KVB_LINK_HOST].latency_s, 10e-6 * scale, 1e-12);
    ck_assert_double_eq_tol(lm.links[KVB_LINK_HOST].bytes_per_s, 50e9 / 64 / scale, 1e-3);
    ck_assert_double_eq_tol(lm.links[KVB_LINK_HOST].bytes_per_s, 22.27e6, 0.01e6);
    ck_assert_double_eq_tol(lm.links[KVB_LINK_PEER].bytes_per_s, 1500e9 / 64 / scale, 1e-3);
    /* the regime: one layer's KV of the batch (4 x 512 x 4,096 bytes on the target) over PCIe, against
     * one layer's compute; the same here */
    double regime = (10e-6 + 4.0 * 512 * 4096 / 50e9) / per_layer;
    ck_assert_double_eq_tol(kvb_link_regime(&lm, KVB_LINK_HOST, 0), regime, 1e-9);
    ck_assert_double_eq_tol(kvb_link_regime(&lm, KVB_LINK_HOST, 1), regime, 1e-9);
    ck_assert_int_eq(kvb_link_regime_far(regime, regime * 2.5), 1);
    ck_assert_int_eq(kvb_link_regime_far(regime, regime * 1.5), 0);
    /* the bench's lengths scaled down 128x: the target's requests are 128x longer, the KV ratio with them */
    ck_assert_int_eq(kvb_link_preset_find("h100-pcie5-scaled", &lm), KVB_OK);
    kvb_link_point pl = {.batch = 1, .q = 2, .ctx = 40, .target_ctx = 5120, .target_q = 256};
    ck_assert_int_eq(kvb_link_scale(&lm, &pl, 1e-3, 2, 64), KVB_OK);
    ck_assert_double_eq_tol(lm.kv_ratio, 40.0 * 64 / (5120.0 * 4096), 1e-15);
    /* nothing to scale without a point or a measurement, and "off" has no target */
    ck_assert_int_eq(kvb_link_scale(&lm, &(kvb_link_point){0}, 1e-3, 2, 64), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_link_preset_find("off", &lm), KVB_OK);
    ck_assert_int_eq(kvb_link_scale(&lm, &pt, 1e-3, 2, 64), KVB_ERR_INVALID);
    ck_assert_double_eq(kvb_link_regime(&lm, KVB_LINK_HOST, 1), 0);
}
KVB_TEST_END

/* An engine given a scaled preset nobody calibrated measures its time scale itself (at the default
 * point) before any transfer: its stager charges the scaled figures. */
KVB_TEST(engine_calibrates_link_model) {
    setup_model();
    kvb_engine_opts o;
    kvb_engine_opts_default(&o);
    o.n_blocks = 64;
    ck_assert_int_eq(kvb_link_preset("pcie3-scaled", NULL, &o.links), KVB_OK);
    kvb_engine *e;
    kvb_planner pl = kvb_policy_recompute();
    ck_assert_int_eq(kvb_engine_create(model, &o, &pl, NULL, &e), KVB_OK);
    const kvb_link_model *lm = kvb_engine_links(e);
    ck_assert_int_eq(lm->calibrate, 0);
    ck_assert_double_gt(lm->measured_step_s, 0);
    ck_assert_int_eq(lm->point.batch, 4);
    ck_assert_double_eq_tol(lm->links[KVB_LINK_HOST].latency_s, 10e-6 * lm->scale, 1e-12);
    kvb_engine_destroy(e);
    teardown_model();
}
KVB_TEST_END


KVB_TEST(stager_link_model) {
    setup_model();
    kvb_link_model lm;
    ck_assert_int_eq(kvb_link_preset("h100-pcie5", NULL, &lm), KVB_OK);
    ck_assert_double_eq_tol(lm.links[KVB_LINK_HOST].bytes_per_s, 50e9, 1);
    ck_assert_double_eq_tol(kvb_link_seconds(&lm, KVB_LINK_HOST, 50000000), 1e-3 + 10e-6, 1e-9);
    ck_assert_int_eq(kvb_link_preset("no-such", NULL, &lm), KVB_ERR_NOT_FOUND);
    /* a scaled preset keeps the target's figures until its time scale is measured */
    ck_assert_int_eq(kvb_link_preset("h100-pcie5-scaled", tm.be, &lm), KVB_OK);
    ck_assert_int_eq(lm.calibrate, 1);
    ck_assert_double_gt(lm.measured_flops, 1e6);
    ck_assert_double_eq_tol(lm.links[KVB_LINK_HOST].latency_s, 10e-6, 1e-12);
    /* measured on this model: the regime here is the target's, on every link */
    kvb_link_point pt = {.batch = 2, .q = 1, .ctx = 64, .target_ctx = 4096};
    ck_assert_int_eq(kvb_link_calibrate(model, &pt, &lm), KVB_OK);
    ck_assert_int_eq(lm.calibrate, 0);
    ck_assert_double_gt(lm.measured_step_s, 0);
    ck_assert_double_eq_tol(lm.point.target_ctx, 4096, 1e-9);
    for (int k = 0; k < KVB_LINK_COUNT; k++) {
        double here = kvb_link_regime(&lm, (kvb_link_kind)k, 1), there = kvb_link_regime(&lm, (kvb_link_kind)k, 0);
        ck_assert_double_gt(there, 0);
        ck_assert_double_eq_tol(here / there, 1, 1e-9);
    }
    char line[1024];
    FILE *f = fmemopen(line, sizeof line, "w");
    kvb_link_model_print(f, &lm);
    fclose(f);
    ck_assert_msg(!strncmp(line, "link preset: h100-pcie5-scaled (H100", 36), "%s", line);
    ck_assert_msg(strstr(line, "Llama-3-8B") && strstr(line, "time x"), "%s", line);
    printf("%s", line);

    /* a slow link: every transfer takes at least latency + bytes / bandwidth, in post order */
    kvb_link_model slow = {.name = "slow", .scale = 1, .target_flops = 1};
    slow.links[KVB_LINK_HOST] = (kvb_link){100e6, 2e-3};
    kvb_stager *s;
    ck_assert_int_eq(kvb_stager_create(tm.be, &slow, &s), KVB_OK);
    enum { MB = 1 << 20 };
    unsigned char *src = malloc(3 * MB), *dst = calloc(3, MB);
    for (int i = 0; i < 3 * MB; i++) src[i] = (unsigned char)(i * 7);
    kvb_xfer x[3];
    uint64_t t[3];
    uint64_t t0 = kvb_now_ns();
    for (int i = 0; i < 3; i++) {
        x[i] = (kvb_xfer){dst + (size_t)i * MB, src + (size_t)i * MB, MB};
        ck_assert_int_eq(kvb_stager_post(s, KVB_LINK_HOST, KVB_XFER_H2D, &x[i], 1, &t[i]), KVB_OK);
    }
    ck_assert_int_eq(kvb_stager_wait(s, t[1]), KVB_OK);
    ck_assert_int_eq(memcmp(dst, src, 2 * MB), 0); /* the first two are in place */
    ck_assert_int_eq(kvb_stager_drain(s), KVB_OK);
    double took = (double)(kvb_now_ns() - t0) / 1e9, least = 3 * (2e-3 + MB / 100e6);
    ck_assert_int_eq(memcmp(dst, src, 3 * MB), 0);
    ck_assert_msg(took >= least, "3 transfers took %.4f s, the link model says at least %.4f s", took, least);
    kvb_link_report rep[KVB_LINK_COUNT];
    kvb_stager_take_report(s, rep);
    ck_assert_uint_eq(rep[KVB_LINK_HOST].bytes, 3 * MB);
    ck_assert_uint_eq(rep[KVB_LINK_HOST].copies, 3);
    ck_assert_uint_ge(rep[KVB_LINK_HOST].busy_ns, (uint64_t)(least * 1e9));
    ck_assert_double_le(rep[KVB_LINK_HOST].gbps, 0.1 + 1e-9); /* achieved: at most the modelled 100 MB/s */
    kvb_stager_take_report(s, rep);
    ck_assert_uint_eq(rep[KVB_LINK_HOST].bytes, 0); /* since the last report */

    /* the from-device queue: a 2 MB write-back (2 s at 1 MB/s) posted first does not hold up a 1 KB load
     * posted after it (on one queue the load would wait 2 s); write-backs land in their post order; all
     * count on the link */
    kvb_stager_destroy(s);
    slow.links[KVB_LINK_HOST] = (kvb_link){1e6, 1e-3};
    ck_assert_int_eq(kvb_stager_create(tm.be, &slow, &s), KVB_OK);
    static unsigned char small[1024];
    kvb_xfer wb[2] = {{dst, src, 2 * MB}, {dst + 2 * MB, src + 2 * MB, MB}}, ld = {small, src, sizeof small};
    uint64_t tw[2], tl;
    memset(dst, 0, 3 * MB);
    for (int i = 0; i < 2; i++) ck_assert_int_eq(kvb_stager_post_out(s, KVB_LINK_HOST, &wb[i], 1, &tw[i]), KVB_OK);
    ck_assert_int_eq(kvb_stager_post(s, KVB_LINK_HOST, KVB_XFER_H2D, &ld, 1, &tl), KVB_OK);
    ck_assert_int_eq(kvb_stager_wait(s, tl), KVB_OK);
    ck_assert_int_eq(kvb_stager_done(s, tw[0]), 0);
    ck_assert_int_eq(kvb_stager_wait(s, tw[1]), KVB_OK);
    ck_assert_int_eq(kvb_stager_done(s, tw[0]), 1);
    ck_assert_int_eq(memcmp(dst, src, 3 * MB), 0);
    ck_assert_int_eq(memcmp(small, src, sizeof small), 0);
    kvb_stager_take_report(s, rep);
    ck_assert_uint_eq(rep[KVB_LINK_HOST].bytes, 3 * MB + sizeof small);
    ck_assert_uint_eq(rep[KVB_LINK_HOST].copies, 3);
    ck_assert_int_eq(kvb_stager_post_out(s, KVB_LINK_COUNT, wb, 1, &tw[0]), KVB_ERR_INVALID);
    uint64_t none;
    ck_assert_int_eq(kvb_stager_post(s, KVB_LINK_PEER, KVB_XFER_D2D, x, 0, &none), KVB_OK);
    ck_assert_int_eq(kvb_stager_wait(s, none), KVB_OK);
    ck_assert_int_eq(kvb_stager_reserve(s, 4, 4096), KVB_OK);
    ck_assert_int_eq(kvb_stager_n_buffers(s), 4);
    ck_assert_ptr_nonnull(kvb_stager_buffer(s, 3));
    ck_assert_ptr_null(kvb_stager_buffer(s, 4));
    kvb_stager_destroy(s);
    free(src);
    free(dst);
    teardown_model();
}
KVB_TEST_END

/* ---------------------------------------------------------------- pause / resume */

/* Pauses request 0 on steps [3, 9) and schedules the rest with the FCFS routines. */
typedef struct pauser {
    int step;
    int saw_paused;
} pauser;

static kvb_status pauser_plan(void *ctx, const kvb_view *v, kvb_plan *out) {
    pauser *p = ctx;
    int i = kvb_view_find(v, 0);
    if (i >= 0 && p->step == 3 && v->reqs[i].state == KVB_REQ_RUNNING)
        KVB_TRY(kvb_plan_push_op(out, (kvb_plan_op){.kind = KVB_OP_PAUSE, .id = 0}));
    if (i >= 0 && v->reqs[i].state == KVB_REQ_PAUSED) {
        p->saw_paused++;
        ck_assert_int_gt(v->reqs[i].n_blocks, 0); /* it keeps its KV */
        if (p->step == 9) KVB_TRY(kvb_plan_push_op(out, (kvb_plan_op){.kind = KVB_OP_RESUME, .id = 0}));
    }
    p->step++;
    return kvb_fcfs(v, NULL, out);
}

static const kvb_planner_i pauser_iface = {.name = "pauser", .plan_step = pauser_plan};

KVB_TEST(pause_resume_lossless) {
    setup_model();
    make_prompts();
    static rec ref, got;
    reference(&ref);
    pauser ps = {0};
    kvb_planner pl = {&pauser_iface, &ps};
    memset(&got, 0, sizeof got);
    kvb_engine *e = make_engine(&got, &pl, 4, 64, 16);
    for (int r = 0; r < NREQ; r++) add(e, (uint64_t)r);
    for (int i = 0; i < 6; i++) ck_assert_int_eq(kvb_engine_step(e), KVB_OK);
    int n0 = got.n[0];
    for (int i = 0; i < 3; i++) ck_assert_int_eq(kvb_engine_step(e), KVB_OK);
    ck_assert_int_eq(got.n[0], n0); /* paused: no token */
    run(e);
    ck_assert_int_eq(ps.saw_paused, 6);
    assert_same(&ref, &got);
    kvb_engine_destroy(e);
    teardown_model();
}
KVB_TEST_END

/* ---------------------------------------------------------------- the view */

typedef struct viewer {
    int checked;
} viewer;

static kvb_status viewer_plan(void *ctx, const kvb_view *v, kvb_plan *out) {
    viewer *w = ctx;
    ck_assert_int_eq(v->n_reqs, v->n_running + v->n_waiting);
    int blocks = 0;
    for (int i = 0; i < v->n_reqs; i++) {
        const kvb_req_view *r = &v->reqs[i];
        ck_assert_int_eq(kvb_view_find(v, r->id), i);
        if (i > 0 && (i < v->n_running) == (i - 1 < v->n_running)) ck_assert_uint_gt(r->arrival, v->reqs[i - 1].arrival);
        if (r->state == KVB_REQ_WAITING) {
            ck_assert_int_eq(r->n_blocks, 0);
            ck_assert_int_ge(i, v->n_running);
            kvb_prefix_probe pr;
            ck_assert_int_eq(kvb_sched_probe(v, i, out, &pr), KVB_OK);
            ck_assert_int_le(pr.n_hit_idle, pr.n_hit);
            ck_assert_int_le(pr.n_hit * v->geom->block_size, r->n_tokens - 1);
        } else {
            ck_assert_int_eq(r->n_blocks, KVB_DIV_CEIL(r->n_computed, v->geom->block_size));
            ck_assert_int_le(r->n_exclusive, r->n_blocks);
            blocks += r->n_exclusive;
        }
    }
    ck_assert_int_eq(v->pool.n_blocks, v->pool.n_own + v->pool.n_borrowed);
    ck_assert_int_le(blocks + v->pool.n_free + v->pool.n_evictable, v->pool.n_blocks);
    ck_assert_int_eq(kvb_view_find(v, 12345), -1);
    w->checked++;
    return kvb_fcfs(v, NULL, out);
}

static const kvb_planner_i viewer_iface = {.name = "viewer", .plan_step = viewer_plan};

KVB_TEST(view_is_the_engine) {
    setup_model();
    make_prompts();
    static rec ref, got;
    reference(&ref);
    viewer w = {0};
    kvb_planner pl = {&viewer_iface, &w};
    kvb_engine_stats s;
    pressure(&got, &pl, 4, 18, 9, &s);
    ck_assert_int_gt(w.checked, 10);
    assert_same(&ref, &got);
    teardown_model();
}
KVB_TEST_END

/* Two threads check two plans of one view at once, while plan_step waits for them: the check owns its
 * memory and the view's probe is safe to call from any thread, so each sees the answer it got alone
 * (a solver thread may check its plans). */
typedef struct checker {
    const kvb_view *v;
    const kvb_plan *p;
    pthread_barrier_t *go;
    kvb_status want;
    kvb_plan_cost cost;
    int wrong;
} checker;

static void *check_loop(void *arg) {
    checker *c = arg;
    pthread_barrier_wait(c->go); /* both at once */
    for (int k = 0; k < 20000; k++) {
        kvb_plan_cost got;
        char err[256];
        kvb_status st = kvb_sched_cost(c->v, c->p, &got, err, sizeof err);
        const kvb_plan_cost *w = &c->cost; /* field by field: the struct has padding */
        if (st != c->want || (st == KVB_OK && (got.blocks_left != w->blocks_left || got.tokens != w->tokens ||
                                               got.rows != w->rows || got.n_sched != w->n_sched ||
                                               got.n_running != w->n_running || got.host_left != w->host_left)))
            c->wrong++;
    }
    return NULL;
}

typedef struct threaded {
    int rounds, wrong;
} threaded;

static kvb_status threaded_plan(void *ctx, const kvb_view *v, kvb_plan *out) {
    threaded *t = ctx;
    kvb_plan a = {0}, b = {0};
    kvb_plan_reset(&a);
    kvb_plan_reset(&b);
    /* a: vLLM's plan; b: its admissions alone, within a budget that leaves some behind */
    kvb_status st = kvb_fcfs(v, NULL, &a);
    kvb_fcfs_opts o = {.budget = 3};
    if (st == KVB_OK) st = kvb_fcfs_admit(v, &o, &b);
    pthread_barrier_t go;
    pthread_barrier_init(&go, NULL, 2);
    checker c[2] = {{.v = v, .p = &a, .go = &go}, {.v = v, .p = &b, .go = &go}};
    for (int i = 0; i < 2 && st == KVB_OK; i++) c[i].want = kvb_sched_cost(v, c[i].p, &c[i].cost, NULL, 0);
    pthread_t th[2];
    for (int i = 0; i < 2 && st == KVB_OK; i++) ck_assert_int_eq(pthread_create(&th[i], NULL, check_loop, &c[i]), 0);
    for (int i = 0; i < 2 && st == KVB_OK; i++) pthread_join(th[i], NULL);
    pthread_barrier_destroy(&go);
    t->wrong += c[0].wrong + c[1].wrong;
    t->rounds++;
    if (st == KVB_OK) st = kvb_plan_copy_from(out, &a);
    kvb_plan_free(&a);
    kvb_plan_free(&b);
    return st;
}

static const kvb_planner_i threaded_iface = {.name = "threaded", .plan_step = threaded_plan};

KVB_TEST(check_from_threads) {
    setup_model();
    make_prompts();
    static rec ref, got;
    reference(&ref);
    threaded t = {0};
    kvb_planner pl = {&threaded_iface, &t};
    kvb_engine_stats s;
    pressure(&got, &pl, 4, 18, 9, &s);
    ck_assert_int_gt(t.rounds, 10);
    ck_assert_msg(t.wrong == 0, "%d of %d concurrent checks disagreed with the same check alone", t.wrong, t.rounds * 40000);
    assert_same(&ref, &got);
    teardown_model();
}
KVB_TEST_END

/* A check in the middle of the scheduler's own accounting (its pick_victim callback) changes nothing of
 * the plan the scheduler makes: every accounting owns its memory. */
typedef struct nester {
    kvb_plan other;
    int nested, differ, failed;
} nester;

static int plain_victim(void *ud, const kvb_view *v, const int *cand, int n) {
    (void)ud, (void)v, (void)cand;
    return n - 1;
}

static int nest_victim(void *ud, const kvb_view *v, const int *cand, int n) {
    nester *t = ud;
    kvb_plan_cost c;
    (void)kvb_sched_cost(v, &t->other, &c, NULL, 0);
    t->nested++;
    return plain_victim(ud, v, cand, n);
}

static kvb_status nester_plan(void *ctx, const kvb_view *v, kvb_plan *out) {
    nester *t = ctx;
    kvb_plan a = {0};
    kvb_plan_reset(&a);
    kvb_plan_reset(&t->other);
    kvb_status st = KVB_OK; /* the other plan preempts every running request */
    for (int i = 0; i < v->n_running && st == KVB_OK; i++)
        if (v->reqs[i].state == KVB_REQ_RUNNING)
            st = kvb_plan_push_op(&t->other, (kvb_plan_op){.kind = KVB_OP_PREEMPT, .id = v->reqs[i].id});
    kvb_fcfs_opts plain = {.pick_victim = plain_victim}, nest = {.pick_victim = nest_victim, .ud = t};
    if (st == KVB_OK) st = kvb_fcfs(v, &plain, &a);
    if (st == KVB_OK) st = kvb_fcfs(v, &nest, out);
    t->failed += st != KVB_OK;
    if (st == KVB_OK && (a.n_ops != out->n_ops || memcmp(a.ops, out->ops, sizeof *a.ops * (size_t)a.n_ops)))
        t->differ++;
    kvb_plan_free(&a);
    return st;
}

static const kvb_planner_i nester_iface = {.name = "nester", .plan_step = nester_plan};

KVB_TEST(check_inside_check) {
    setup_model();
    make_prompts();
    static rec ref, got;
    reference(&ref);
    nester t = {0};
    kvb_planner pl = {&nester_iface, &t};
    kvb_engine_stats s;
    pressure(&got, &pl, 4, 18, 9, &s);
    kvb_plan_free(&t.other);
    ck_assert_int_gt(t.nested, 0);
    ck_assert_int_eq(t.failed, 0);
    ck_assert_msg(t.differ == 0, "%d plans changed by a check made while they were built", t.differ);
    assert_same(&ref, &got);
    teardown_model();
}
KVB_TEST_END

KVB_TEST(registry_and_params) {
    ck_assert_int_ge(kvb_policy_count(), 1);
    ck_assert_ptr_nonnull(kvb_policy_find("recompute"));
    ck_assert_ptr_null(kvb_policy_find("nope"));
    kvb_planner pl;
    ck_assert_int_eq(kvb_policy_create("nope", NULL, &pl), KVB_ERR_NOT_FOUND);
    kvb_policy_params pp = {0};
    ck_assert_int_eq(kvb_policy_params_add(&pp, "novalue"), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_policy_params_add(&pp, "=x"), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_policy_params_add(&pp, "a=1"), KVB_OK);
    ck_assert_int_eq(kvb_policy_params_add(&pp, "b=x=y"), KVB_OK);
    ck_assert_int_eq(kvb_policy_params_add(&pp, "a=2"), KVB_OK);
    ck_assert_int_eq(pp.n, 2);
    ck_assert_str_eq(kvb_policy_params_get(&pp, "a"), "2");
    ck_assert_str_eq(kvb_policy_params_get(&pp, "b"), "x=y");
    int64_t a = 0;
    ck_assert_int_eq(kvb_policy_param_i64(&pp, "t", "a", 0, 5, &a), KVB_OK);
    ck_assert_int_eq(a, 2);
    ck_assert_int_eq(kvb_policy_param_i64(&pp, "t", "a", 3, 5, &a), KVB_ERR_INVALID);
    int ch = 0;
    static const char *const choices[] = {"x", "x=y", NULL};
    ck_assert_int_eq(kvb_policy_param_choice(&pp, "t", "b", choices, &ch), KVB_OK);
    ck_assert_int_eq(ch, 1);
    static const char *const known[] = {"a", NULL};
    ck_assert_int_eq(kvb_policy_params_check(&pp, "t", known), KVB_ERR_INVALID); /* b is unknown */
    /* every registered planner refuses a parameter it does not know */
    for (int k = 0; k < kvb_policy_count(); k++)
        ck_assert_int_eq(kvb_policy_create(kvb_policy_info_at(k)->name, &pp, &pl), KVB_ERR_INVALID);
    kvb_policy_params_free(&pp);
}
KVB_TEST_END

KVB_TEST_MAIN("plan", KVB_T(every_planner_lossless, 600), KVB_T(orbitflow_late_decisions, 240), KVB_T(destroy_contract, 60),
              KVB_T(violating_plan_refused, 60), KVB_T(pause_resume_lossless, 60), KVB_T(view_is_the_engine, 60),
              KVB_T(check_from_threads, 120), KVB_T(check_inside_check, 120),
              KVB_T(registry_and_params, 10), KVB_T(absent_tokens_lossless, 240), KVB_T(swap_lossless, 240), KVB_T(drop_blocks_lossless, 240), KVB_T(drop_blocks_swapped_layers_lossless, 240),
              KVB_T(ellm_tokenwise_lossless, 240), KVB_T(hcache_lossless, 240), KVB_T(ellm_prefill_budget_as_baselines, 60),
              KVB_T(host_residency_lossless, 240), KVB_T(stager_link_model, 60), KVB_T(link_time_scale, 10),
              KVB_T(engine_calibrates_link_model, 60), KVB_T(device_waits_lossless, 600), KVB_T(stager_device_waits, 60))
