/* Tests of the planner seam (common/sched/plan.h): every registered planner gives recompute's greedy
 * tokens on ragged batches under memory pressure with chunked prefill and prefix hits; the executor
 * refuses a plan that violates the pool or the step and changes nothing; pause and resume are
 * lossless; the view says what the engine holds; the engine destroys its planner exactly once
 * whether or not kvb_engine_create succeeds. The model is a real safetensors directory written by
 * kvbank-mkmodel. */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/kv/block_pool.h"
#include "common/model/model.h"
#include "common/policy/policy.h"
#include "common/sched/engine.h"
#include "common/sched/scheduler.h"
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
 * prompts; requests 3 and 4 arrive after a few steps (prefix hits on 0 and 1). */
static void pressure(rec *got, kvb_planner *pl, int bs, int blocks, int budget, kvb_engine_stats *st) {
    memset(got, 0, sizeof *got);
    kvb_engine *e = make_engine(got, pl, bs, blocks, budget);
    for (int r = 0; r < 3; r++) add(e, (uint64_t)r);
    for (int i = 0; i < 6; i++) ck_assert_msg(kvb_engine_step(e) == KVB_OK, "step: %s", kvb_engine_last_error(e));
    add(e, 3);
    add(e, 4);
    run(e);
    kvb_engine_get_stats(e, st);
    ck_assert_int_eq(st->blocks_free, st->blocks_total); /* nothing leaked */
    kvb_engine_destroy(e);
}

KVB_TEST(every_planner_lossless) {
    setup_model();
    make_prompts();
    static rec ref, base, got;
    reference(&ref);
    const struct { int bs, blocks, budget; } cfgs[] = {{4, 18, 9}, {8, 9, 7}, {16, 8, 512}, {1, 60, 5}};
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

/* ---------------------------------------------------------------- the destroy contract */

typedef struct counting {
    int destroyed;
    int steps;
} counting;

static kvb_status counting_plan(void *ctx, const kvb_view *v, kvb_plan *out) {
    ((counting *)ctx)->steps++;
    return kvb_sched_fcfs(v, NULL, out);
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
} bad_kind;

typedef struct scripted {
    bad_kind bad;
} scripted;

static const kvb_plan_op *find_op(const kvb_plan *p, kvb_op_kind k) {
    for (int i = 0; i < p->n_ops; i++)
        if (p->ops[i].kind == k) return &p->ops[i];
    return NULL;
}

/* A valid FCFS plan, then broken as asked. */
static kvb_status scripted_plan(void *ctx, const kvb_view *v, kvb_plan *out) {
    scripted *s = ctx;
    KVB_TRY(kvb_sched_fcfs(v, NULL, out));
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
    }
    return KVB_OK;
}

static const kvb_planner_i scripted_iface = {.name = "scripted", .plan_step = scripted_plan};

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
    /* With a budget of 16, request 0 (57 tokens, 8 blocks) is admitted first and prefills in chunks
     * while 2 and 3 wait; with 64, 0 and 2 fill the pool at once and 3 waits. The broken plans come at
     * the second step; each is refused and leaves everything as it was, and the run then gives the
     * tokens of an unbroken one. */
    const struct { bad_kind bad; int budget; const char *says; } cases[] = {
        {BAD_UNKNOWN_ID, 16, "no live request has id 999"},
        {BAD_RUN_WAITING, 16, "RUN request 3): the request is waiting, not running"},
        {BAD_OVER_BUDGET, 16, "the plan computes 21 tokens, the step budget is 16"},
        {BAD_TOO_MANY_BLOCKS, 64, "ADMIT request 3): needs 3 block(s), the pool can give 0"},
        {BAD_PREEMPT_SCHEDULED, 16, "scheduled earlier in this step"},
        {BAD_Q_BEYOND_TOKENS, 16, "q_len 22, it has 21 token(s) left to compute"},
        {BAD_DOUBLE_RUN, 16, "already scheduled"},
        {BAD_RESUME_RUNNING, 16, "not paused"},
        {BAD_BATCH_LIMIT, 16, "batch_limit 65 is outside"},
    };
    scripted sc = {BAD_NONE};
    kvb_planner pl = {&scripted_iface, &sc};
    for (int budget = 16; budget <= 64; budget *= 4) {
        kvb_engine *e = violating_setup(&ref, &pl, budget);
        run(e);
        kvb_engine_destroy(e);
        e = violating_setup(&got, &pl, budget);
        ck_assert_int_eq(kvb_engine_step(e), KVB_OK);
        kvb_engine_stats before, after;
        kvb_engine_get_stats(e, &before);
        int events = got.events, free0 = kvb_block_pool_n_free(kvb_engine_pool(e)), live = kvb_engine_n_live(e);
        for (size_t c = 0; c < KVB_ARRAY_LEN(cases); c++) {
            if (cases[c].budget != budget) continue;
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
    return kvb_sched_fcfs(v, NULL, out);
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
    return kvb_sched_fcfs(v, NULL, out);
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

KVB_TEST_MAIN("plan", KVB_T(every_planner_lossless, 240), KVB_T(destroy_contract, 60),
              KVB_T(violating_plan_refused, 60), KVB_T(pause_resume_lossless, 60), KVB_T(view_is_the_engine, 60),
              KVB_T(registry_and_params, 10))
