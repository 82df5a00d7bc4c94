/* kvbank — OrbitFlow as a planner (../shared/papers/orbitflow.txt §3-4) and its five baselines (§5.1):
 * `orbitflow`, `deepspeed`, `flexgen`, `flexgen-plus`, `slo-aware-offload`, `dynamic-heuristic`.
 *
 * Each step (plan_step, never blocking): new tokens update the Token-Deposit bookkeeping; the adaptive
 * controller decides whether to re-plan; OrbitFlow hands a snapshot to its solver thread, which runs
 * the branch and bound one step ahead (block counts of every request plus one token) with Pause-Resume
 * around it, and installs the latest finished decision; requests the decision does not cover (new
 * ones, a late solver) get the most offloaded placement. The baselines place by their rules at once.
 * The plan is the scheduler's FCFS (running requests, then admissions in arrival order up to the batch
 * limit, none while a request is paused), request-level placements (kvb_plan_place) for every running
 * request, pauses and resumes; it is checked with kvb_sched_cost and trimmed (admissions first, then
 * the most offloaded placement for all, then the decision's resumes, then a pause (OrbitFlow) or a
 * preemption (baselines)) until it fits. The pure model, solver, controller and rules are in orbitflow_{model,solver,rules}.c. */
#include <math.h>
#include <pthread.h>
#include <string.h>

#include "common/kv/block_pool.h"
#include "common/policy/orbitflow_planner.h"
#include "common/policy/policy.h"
#include "common/policy/fcfs.h"
#include "common/sched/stager.h"
#include "common/util/token_deposit.h"

#define OF_MAX KVB_OF_MAX_REQS
#define OF_SAMPLES 64 /* decode steps kept for the compute profile's least-squares fit */

static const char *const kind_names[] = {"orbitflow", "deepspeed", "flexgen", "flexgen-plus", "slo-aware-offload",
                                         "dynamic-heuristic", NULL};

/* ---------------------------------------------------------------- per request */

typedef struct of_req {
    uint64_t id;
    int live;
    int cand;             /* placement installed (index into cands), -1 none yet */
    int n_gen_seen;       /* n_generated at the last view */
    uint64_t slo_ns;      /* its SLO (the request's, else the model default) */
    uint64_t g_last;      /* generation time of its newest token (wall ns) */
    uint64_t d_last;      /* its scheduled delivery (Token-Deposit) */
    uint64_t *due;        /* [n_due] deliveries still ahead (non-decreasing) */
    int n_due, cap_due;
    int paused;
    uint64_t pause_seq;   /* order of pausing */
} of_req;

/* ---------------------------------------------------------------- the solver's input and output */

typedef struct of_snap {
    uint64_t gen;         /* sequence number */
    int n;
    uint64_t id[OF_MAX];
    kvb_of_req req[OF_MAX];
    uint8_t paused[OF_MAX];
    uint64_t pause_seq[OF_MAX];
    int resume_ok;        /* a request finished since the last pause */
    kvb_of_segment segs[OF_MAX];
    int n_segs;
    kvb_of_profile prof;
    int64_t budget;
} of_snap;

typedef struct of_dec {
    uint64_t gen;
    int n;
    uint64_t id[OF_MAX];
    int cand[OF_MAX];     /* -1: paused */
    uint8_t pause[OF_MAX], resume[OF_MAX];
    kvb_of_solution sol;
    int64_t eq1_buffer;   /* Eq. 1's prefetch buffer for the same placement (max over layers) */
    int best_effort;
    double solve_s;
} of_dec;

struct kvb_of_planner {
    kvb_of_params p;
    int kind;
    int L, bs;
    size_t layer_bytes;
    int link_known;        /* the link's bandwidth comes from the stager's model or a parameter */
    kvb_of_cand cands[KVB_OF_MAX_CANDS];
    int n_cands;
    int most_off;          /* index of the most offloaded candidate */
    kvb_of_profile prof;   /* the planner thread's copy (observe updates it) */
    int have_profile;
    /* profile samples: context tokens and per-layer compute of decode steps */
    double s_tok[OF_SAMPLES];
    double *s_lay;         /* [OF_SAMPLES][L] */
    int n_samples, next_sample, since_fit;
    double pending_tokens; /* context tokens of the step being planned (for observe) */
    int pending_prefill;
    double pending_pred;   /* predicted latency of that step (0: none) */
    uint64_t t_step_end;   /* wall ns when the last step ended */
    int64_t step;
    /* requests */
    of_req *reqs;
    int n_reqs, cap_reqs;
    uint64_t pause_seq;
    uint64_t finished;     /* requests seen finishing */
    uint64_t finished_at_pause;
    uint64_t batch_key;    /* hash of the running set the installed decision covers */
    int batch_changed;
    /* controller */
    kvb_of_ctl ctl;
    unsigned trig;         /* triggers waiting for a solve */
    int64_t static_cand;   /* flexgen */
    int pending_first;     /* flexgen-plus, slo-aware: decide once the profile exists */
    kvb_of_slo_table table;/* slo-aware-offload */
    int64_t *final_len;    /* [OF_MAX] scratch */
    /* solver thread */
    pthread_t th;
    int started, quit;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    of_snap in;            /* the snapshot waiting for the thread (in_ready) */
    of_snap solver_in;     /* the solver thread's own copy of the snapshot it solves */
    of_dec solver_out;     /* the decision the solver thread is making */
    of_snap snap;          /* the snapshot the planner's thread takes (handed to solve_post) */
    int in_ready, busy;
    of_dec out;            /* the latest decision (out_ready: not yet taken) */
    int out_ready;
    int64_t out_step;      /* inline with solver_lag: the step from which `out` may be taken */
    uint64_t gen;
    kvb_of_planner_stats st;
    uint64_t rng;
};

/* ---------------------------------------------------------------- parameters */

void kvb_of_params_default(kvb_of_params *p) {
    memset(p, 0, sizeof *p);
    p->delta_min = 2;
    p->delta_max = 64;
    p->ewma = 0.25;
    p->threshold = 0.20;
    p->alpha = 1;
    p->slo_ms = 50;
    p->deposit = 1;
    p->pause = 1;
    p->mode = KVB_OF_REQUEST_WISE;
    p->victim = KVB_OF_VICTIM_SCORE;
    p->threaded = 1;
    p->max_nodes = 2000000;
}

kvb_status kvb_of_params_parse(const kvb_policy_params *pp, const char *name, kvb_of_params *p) {
    static const char *const known[] = {"slo_ms", "delta_min", "delta_max", "ewma", "threshold", "alpha", "deposit",
                                        "pause", "mode", "victim", "host_blocks", "batch", "batch_tokens",
                                        "solver", "solver_lag", "max_nodes", "link_gbps", "link_us", NULL};
    static const char *const onoff[] = {"off", "on", NULL};
    static const char *const modes[] = {"request-wise", "uniform", NULL};
    static const char *const victims[] = {"score", "longest", "shortest", "random", NULL};
    static const char *const solvers[] = {"inline", "thread", NULL};
    KVB_TRY(kvb_policy_params_check(pp, name, known));
    int64_t i64;
    KVB_TRY(kvb_policy_param_f64(pp, name, "slo_ms", 0.001, 3.6e6, &p->slo_ms));
    i64 = p->delta_min;
    KVB_TRY(kvb_policy_param_i64(pp, name, "delta_min", 1, KVB_OF_MAX_WINDOW, &i64));
    p->delta_min = (int)i64;
    i64 = p->delta_max;
    KVB_TRY(kvb_policy_param_i64(pp, name, "delta_max", 1, KVB_OF_MAX_WINDOW, &i64));
    p->delta_max = (int)i64;
    if (p->delta_max < p->delta_min) {
        KVB_LOG_E("policy %s: delta_max %d is below delta_min %d", name, p->delta_max, p->delta_min);
        return KVB_ERR_INVALID;
    }
    KVB_TRY(kvb_policy_param_f64(pp, name, "ewma", 0, 1, &p->ewma));
    KVB_TRY(kvb_policy_param_f64(pp, name, "threshold", 0, 100, &p->threshold));
    KVB_TRY(kvb_policy_param_f64(pp, name, "alpha", 0, KVB_OF_MAX_REQS, &p->alpha));
    KVB_TRY(kvb_policy_param_choice(pp, name, "deposit", onoff, &p->deposit));
    KVB_TRY(kvb_policy_param_choice(pp, name, "pause", onoff, &p->pause));
    int mode = (int)p->mode, victim = (int)p->victim;
    KVB_TRY(kvb_policy_param_choice(pp, name, "mode", modes, &mode));
    KVB_TRY(kvb_policy_param_choice(pp, name, "victim", victims, &victim));
    p->mode = (kvb_of_mode)mode;
    p->victim = (kvb_of_victim)victim;
    i64 = p->host_blocks;
    KVB_TRY(kvb_policy_param_i64(pp, name, "host_blocks", 0, INT32_MAX, &i64));
    p->host_blocks = (int)i64;
    i64 = p->batch;
    KVB_TRY(kvb_policy_param_i64(pp, name, "batch", 0, KVB_OF_MAX_REQS, &i64));
    p->batch = (int)i64;
    KVB_TRY(kvb_policy_param_i64(pp, name, "batch_tokens", 0, INT64_MAX / 2, &p->batch_tokens));
    KVB_TRY(kvb_policy_param_choice(pp, name, "solver", solvers, &p->threaded));
    i64 = p->solver_lag;
    KVB_TRY(kvb_policy_param_i64(pp, name, "solver_lag", 0, 1000, &i64));
    p->solver_lag = (int)i64;
    if (p->solver_lag > 0 && p->threaded) {
        KVB_LOG_E("policy %s: solver_lag=%d needs solver=inline (a solver thread lags as it runs)", name,
                  p->solver_lag);
        return KVB_ERR_INVALID;
    }
    KVB_TRY(kvb_policy_param_i64(pp, name, "max_nodes", 0, INT64_MAX / 2, &p->max_nodes));
    KVB_TRY(kvb_policy_param_f64(pp, name, "link_gbps", 0, 1e6, &p->link_gbps));
    KVB_TRY(kvb_policy_param_f64(pp, name, "link_us", 0, 1e9, &p->link_us));
    return KVB_OK;
}

/* ---------------------------------------------------------------- requests and Token-Deposit */

static of_req *req_find(kvb_of_planner *P, uint64_t id) {
    for (int i = 0; i < P->n_reqs; i++)
        if (P->reqs[i].id == id) return &P->reqs[i];
    return NULL;
}

static kvb_status req_get(kvb_of_planner *P, const kvb_req_view *r, of_req **out) {
    of_req *q = req_find(P, r->id);
    if (!q) {
        if (P->n_reqs == P->cap_reqs) {
            int cap = P->cap_reqs ? 2 * P->cap_reqs : 16;
            KVB_TRY(kvb_realloc_array((void **)&P->reqs, (size_t)cap, sizeof *P->reqs));
            P->cap_reqs = cap;
        }
        q = &P->reqs[P->n_reqs++];
        memset(q, 0, sizeof *q);
        q->id = r->id;
        q->cand = -1;
        q->n_gen_seen = r->n_generated;
    }
    q->slo_ns = r->tbt_slo_ns ? r->tbt_slo_ns : (uint64_t)(P->p.slo_ms * 1e6 + 0.5);
    q->live = 1;
    *out = q;
    return KVB_OK;
}

/* Tokens generated since the last view were generated when the last step ended; each is scheduled
 * for delivery with the same rule the gateway paces with (§3.2). */
static kvb_status deposit_tokens(kvb_of_planner *P, of_req *q, int n_generated) {
    for (; q->n_gen_seen < n_generated; q->n_gen_seen++) {
        uint64_t g = P->t_step_end;
        uint64_t d = kvb_deposit_next(q->n_gen_seen == 0, q->d_last, g, q->slo_ns);
        q->g_last = g;
        q->d_last = d;
        if (d > g) {
            if (q->n_due == q->cap_due) {
                int cap = q->cap_due ? 2 * q->cap_due : 16;
                KVB_TRY(kvb_realloc_array((void **)&q->due, (size_t)cap, sizeof *q->due));
                q->cap_due = cap;
            }
            q->due[q->n_due++] = d;
        }
    }
    return KVB_OK;
}

/* Tokens of q held in the deposit at `now`. */
static int64_t deposit_level(of_req *q, uint64_t now) {
    int k = 0;
    while (k < q->n_due && q->due[k] <= now) k++;
    if (k) {
        memmove(q->due, q->due + k, (size_t)(q->n_due - k) * sizeof *q->due);
        q->n_due -= k;
    }
    return q->n_due;
}

/* ---------------------------------------------------------------- placements */

static kvb_status push_place(kvb_of_planner *P, kvb_plan *out, uint64_t id, int cand) {
    const kvb_of_cand *c = &P->cands[cand];
    for (int l = 0; l < P->L;) {
        if (!kvb_of_layer_in(&c->off, l)) {
            l++;
            continue;
        }
        int l1 = l;
        while (l1 < P->L && kvb_of_layer_in(&c->off, l1)) l1++;
        KVB_TRY(kvb_plan_push_place(out, (kvb_plan_place){.id = id, .layer0 = l, .layer1 = l1, .where = KVB_RES_HOST,
                                                          .depth = c->n_slots}));
        l = l1;
    }
    return KVB_OK;
}

/* The model of the running set: requests r with `on[r]`, placement cand[r], lengths from the view. */
typedef struct of_batch {
    int n;
    int vidx[OF_MAX];
    kvb_of_req req[OF_MAX];
    int cand[OF_MAX];
    kvb_of_segment segs[OF_MAX];
    int n_segs;
} of_batch;

/* Full blocks several requests of the batch share (prefix cache), as segments of equal owner sets. */
static void find_segments(const kvb_view *v, of_batch *b) {
    b->n_segs = 0;
    for (int x = 0; x < b->n; x++) {
        const kvb_req_view *r = &v->reqs[b->vidx[x]];
        for (int j = 0; j < r->n_blocks; j++) {
            uint64_t owners = 0;
            for (int y = 0; y < b->n; y++) {
                const kvb_req_view *o = &v->reqs[b->vidx[y]];
                if (j < o->n_blocks && o->blocks[j] == r->blocks[j]) owners |= (uint64_t)1 << y;
            }
            if (__builtin_popcountll(owners) < 2 || __builtin_ctzll(owners) != x) continue; /* counted once */
            int g = 0;
            while (g < b->n_segs && b->segs[g].owners != owners) g++;
            if (g == b->n_segs) {
                if (b->n_segs == OF_MAX) continue;
                b->segs[b->n_segs++] = (kvb_of_segment){.n_blocks = 0, .owners = owners};
            }
            b->segs[g].n_blocks++;
        }
    }
}

static void problem_of(const kvb_of_planner *P, const of_batch *b, const kvb_of_profile *prof, int64_t budget,
                       kvb_of_problem *q) {
    *q = (kvb_of_problem){.prof = prof, .block_size = P->bs, .budget = budget, .reqs = b->req, .n_reqs = b->n,
                          .segs = b->segs, .n_segs = b->n_segs, .cands = P->cands, .n_cands = P->n_cands,
                          .ahead = 1, .delta_min = P->p.delta_min, .delta_max = P->p.delta_max, .alpha = P->p.alpha,
                          .enforce_slo = 1, .mode = P->p.mode, .max_nodes = P->p.max_nodes};
}

/* ---------------------------------------------------------------- the solver (its own thread) */

/* OrbitFlow's decision for a snapshot: paused requests come back first when one finished since the
 * last pause and a feasible plan holds them (§3.4), in the order they were paused; then the solver
 * with Pause-Resume around it. */
static void decide(const kvb_of_planner *P, const of_snap *s, of_dec *d) {
    double t0 = kvb_now_s();
    memset(d, 0, sizeof *d);
    d->gen = s->gen;
    d->n = s->n;
    memcpy(d->id, s->id, sizeof d->id);
    uint8_t excl[OF_MAX];
    memcpy(excl, s->paused, sizeof excl);
    kvb_of_problem q = {.prof = &s->prof, .block_size = P->bs, .budget = s->budget, .reqs = s->req, .n_reqs = s->n,
                        .excluded = excl, .segs = s->segs, .n_segs = s->n_segs, .cands = P->cands,
                        .n_cands = P->n_cands, .ahead = 1, .delta_min = P->p.delta_min,
                        .delta_max = P->p.delta_max, .alpha = P->p.alpha, .enforce_slo = 1, .mode = P->p.mode,
                        .max_nodes = P->p.max_nodes};
    kvb_of_solution sol;
    if (s->resume_ok) {
        for (;;) { /* the earliest paused one that fits */
            int best = -1;
            for (int r = 0; r < s->n; r++)
                if (excl[r] && (best < 0 || s->pause_seq[r] < s->pause_seq[best])) best = r;
            if (best < 0) break;
            excl[best] = 0;
            if (kvb_of_solve(&q, &sol) != KVB_OK || !sol.feasible) {
                excl[best] = 1;
                break;
            }
            d->resume[best] = 1;
        }
    }
    kvb_of_plan_out po;
    memset(&po, 0, sizeof po);
    uint64_t rng = s->gen * 0x9e3779b97f4a7c15ull + 1;
    if (!P->p.pause) { /* without Pause-Resume nobody is paused: the fastest plan that fits, if any */
        q.enforce_slo = 0;
        if (kvb_of_solve(&q, &po.sol) != KVB_OK) po.sol.feasible = 0;
    } else if (kvb_of_plan(&q, P->p.victim, &rng, &po) != KVB_OK) {
        po.sol.feasible = 0;
    }
    d->sol = po.sol;
    d->best_effort = po.best_effort;
    if (po.sol.feasible) { /* what Eq. 1 would reserve for the same placement (kvbank reserves sol.buffer) */
        for (int r = 0; r < s->n; r++) excl[r] |= po.paused[r];
        d->eq1_buffer = kvb_of_eq1_buffer(&q, po.sol.cand, 0);
    }
    for (int r = 0; r < s->n; r++) { /* infeasible: nothing changes (the plan's check trims) */
        d->pause[r] = po.paused[r];
        d->cand[r] = excl[r] || po.paused[r] || !po.sol.feasible ? -1 : po.sol.cand[r];
    }
    d->solve_s = kvb_now_s() - t0;
}

static void *solver_thread(void *arg) {
    kvb_of_planner *P = arg;
    of_snap *in = &P->solver_in;
    of_dec *out = &P->solver_out;
    pthread_mutex_lock(&P->mu);
    for (;;) {
        while (!P->quit && !P->in_ready) pthread_cond_wait(&P->cv, &P->mu);
        if (P->quit) break;
        *in = P->in;
        P->in_ready = 0;
        P->busy = 1;
        pthread_mutex_unlock(&P->mu);
        decide(P, in, out);
        pthread_mutex_lock(&P->mu);
        P->out = *out;
        P->out_ready = 1;
        P->busy = 0;
    }
    pthread_mutex_unlock(&P->mu);
    return NULL;
}

/* Hands a snapshot to the solver (inline: solves it now; its decision is taken `solver_lag` steps
 * later). */
static void solve_post(kvb_of_planner *P, const of_snap *s) {
    P->st.solver_calls++;
    if (!P->p.threaded) {
        decide(P, s, &P->out);
        P->out_ready = 1;
        P->out_step = P->step + P->p.solver_lag;
        return;
    }
    pthread_mutex_lock(&P->mu);
    P->in = *s;
    P->in_ready = 1;
    pthread_cond_signal(&P->cv);
    pthread_mutex_unlock(&P->mu);
}

/* The latest finished decision, if one is waiting. 1 when *d was filled. */
static int solve_take(kvb_of_planner *P, of_dec *d) {
    int got = 0;
    if (P->p.threaded) pthread_mutex_lock(&P->mu);
    if (P->out_ready && (P->p.threaded || P->step >= P->out_step)) {
        *d = P->out;
        P->out_ready = 0;
        got = 1;
    }
    if (P->p.threaded) pthread_mutex_unlock(&P->mu);
    return got;
}

static int solve_busy(kvb_of_planner *P) {
    if (!P->p.threaded) return P->out_ready; /* a lagging inline decision not yet taken */
    pthread_mutex_lock(&P->mu);
    int b = P->busy || P->in_ready;
    pthread_mutex_unlock(&P->mu);
    return b;
}

/* ---------------------------------------------------------------- the step's plan */

typedef struct of_attempt {
    uint64_t pause[OF_MAX], resume[OF_MAX], victim[OF_MAX];
    int n_pause, n_resume, n_victim;
    int min_resume;    /* resumes build_fitting keeps: 1 when nothing else would run, else 0 */
    int all_most_off;  /* every request at the most offloaded placement */
    int n_admit;       /* most admissions */
} of_attempt;

static int in_list(const uint64_t *l, int n, uint64_t id) {
    for (int i = 0; i < n; i++)
        if (l[i] == id) return 1;
    return 0;
}

/* The candidate request q runs with under the planner's kind (-1: the most offloaded). */
static int cand_for(const kvb_of_planner *P, const of_req *q) { return q && q->cand >= 0 ? q->cand : P->most_off; }

static kvb_status build(kvb_of_planner *P, const kvb_view *v, const of_attempt *a, kvb_plan *out) {
    kvb_plan_reset(out);
    int victim_op = P->kind == KVB_OF_KIND_ORBITFLOW && P->p.pause ? KVB_OP_PAUSE : KVB_OP_PREEMPT;
    for (int k = 0; k < a->n_resume; k++)
        KVB_TRY(kvb_plan_push_op(out, (kvb_plan_op){.kind = KVB_OP_RESUME, .id = a->resume[k]}));
    for (int k = 0; k < a->n_pause; k++)
        KVB_TRY(kvb_plan_push_op(out, (kvb_plan_op){.kind = KVB_OP_PAUSE, .id = a->pause[k]}));
    for (int k = 0; k < a->n_victim; k++)
        KVB_TRY(kvb_plan_push_op(out, (kvb_plan_op){.kind = (kvb_op_kind)victim_op, .id = a->victim[k]}));
    kvb_fcfs_opts o = {0};
    KVB_TRY(kvb_fcfs_running(v, &o, out));
    int n_run = 0, any_paused = 0;
    for (int k = 0; k < out->n_ops; k++) n_run += out->ops[k].kind == KVB_OP_RUN;
    for (int i = 0; i < v->n_running; i++) {
        uint64_t id = v->reqs[i].id;
        int paused = (v->reqs[i].state == KVB_REQ_PAUSED && !in_list(a->resume, a->n_resume, id)) ||
                     in_list(a->pause, a->n_pause, id) || (victim_op == KVB_OP_PAUSE && in_list(a->victim, a->n_victim, id));
        any_paused |= paused;
    }
    int limit = P->p.batch > 0 ? P->p.batch : v->max_seqs;
    /* no admission while a request is paused: it comes back first (§3.4, no starvation) */
    if (!any_paused && a->n_admit > 0) {
        int running = 0;
        for (int i = 0; i < v->n_running; i++) running += v->reqs[i].state == KVB_REQ_RUNNING;
        running -= a->n_victim;
        int room = KVB_MIN(a->n_admit, limit - running);
        if (room > 0) {
            o.batch_limit = KVB_MIN(n_run + room, v->max_seqs);
            KVB_TRY(kvb_fcfs_admit(v, &o, out));
        }
    }
    /* placements of every request running after the plan */
    int n_ops = out->n_ops;
    for (int i = 0; i < v->n_reqs; i++) {
        const kvb_req_view *r = &v->reqs[i];
        int run = r->state == KVB_REQ_RUNNING || in_list(a->resume, a->n_resume, r->id);
        if (in_list(a->pause, a->n_pause, r->id) || in_list(a->victim, a->n_victim, r->id)) run = 0;
        for (int k = 0; k < n_ops; k++)
            if (out->ops[k].id == r->id && out->ops[k].kind == KVB_OP_ADMIT) run = 1;
        if (!run) continue;
        int c = a->all_most_off ? P->most_off : cand_for(P, req_find(P, r->id));
        if (P->cands[c].n_off > 0) KVB_TRY(push_place(P, out, r->id, c));
    }
    return KVB_OK;
}

/* The most recently admitted running request not already chosen (baselines' preemption victim), or
 * OrbitFlow's pause victim; 0 when there is none. */
static int next_victim(kvb_of_planner *P, const kvb_view *v, const of_attempt *a, uint64_t *id) {
    int cand[OF_MAX], n = 0;
    for (int i = 0; i < v->n_running && n < OF_MAX; i++) {
        const kvb_req_view *r = &v->reqs[i];
        if (r->state != KVB_REQ_RUNNING || in_list(a->victim, a->n_victim, r->id) ||
            in_list(a->pause, a->n_pause, r->id))
            continue;
        cand[n++] = i;
    }
    if (n < 2) return 0; /* a lone request is never paused or preempted for others */
    if (P->kind == KVB_OF_KIND_ORBITFLOW && P->p.pause) {
        kvb_of_req rq[OF_MAX];
        for (int k = 0; k < n; k++) {
            of_req *q = req_find(P, v->reqs[cand[k]].id);
            rq[k] = (kvb_of_req){.len = v->reqs[cand[k]].n_tokens, .deposit = q ? q->n_due : 0};
        }
        int k = kvb_of_pick_victim(rq, n, NULL, P->p.victim, &P->rng);
        *id = v->reqs[cand[k]].id;
    } else {
        int k = 0;
        for (int j = 1; j < n; j++)
            if (v->reqs[cand[j]].arrival > v->reqs[cand[k]].arrival) k = j;
        *id = v->reqs[cand[k]].id;
    }
    return 1;
}

/* Builds the plan, trimming until the executor's check accepts it: fewer admissions, then every
 * request at the most offloaded placement, then resumes, latest first, then victims one by one. A
 * resume comes from a decision made on a snapshot up to a step old (the solver runs beside the
 * engine): by now the running requests may have grown past what the pool can hold beside it, and a
 * lone running request is never a victim, so the resume waits instead (the request stays paused and
 * the next decision or a finish brings it back); the one resume that is all that would run is kept. */
static kvb_status build_fitting(kvb_of_planner *P, const kvb_view *v, of_attempt *a, kvb_plan *out) {
    int max_admit = v->max_seqs;
    for (int level = 0;; level++) {
        if (level == 1) a->all_most_off = 1;
        if (level >= 2 && a->n_resume > a->min_resume) {
            a->n_resume--;
            P->st.resumes_deferred++;
        } else if (level >= 2) {
            uint64_t id;
            if (!next_victim(P, v, a, &id)) break;
            a->victim[a->n_victim++] = id;
            if (P->kind == KVB_OF_KIND_ORBITFLOW && P->p.pause) P->st.emergency_pauses++;
            else P->st.preemptions++;
        }
        for (int na = max_admit; na >= 0; na--) {
            a->n_admit = na;
            KVB_TRY(build(P, v, a, out));
            if (kvb_sched_cost(v, out, NULL, NULL, 0) == KVB_OK) {
                if (level >= 1) P->st.trimmed++;
                return KVB_OK;
            }
        }
    }
    char err[256];
    kvb_status st = kvb_sched_cost(v, out, NULL, err, sizeof err);
    KVB_LOG_E("policy %s: no plan fits (%s)", kind_names[P->kind], err);
    return st == KVB_OK ? KVB_ERR_EXHAUSTED : st;
}

/* ---------------------------------------------------------------- plan_step */

static uint64_t batch_key(const kvb_view *v) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < v->n_running; i++)
        if (v->reqs[i].state == KVB_REQ_RUNNING) h = (h ^ v->reqs[i].id) * 1099511628211ull;
    return h;
}

/* The running (not paused) requests as the model sees them, placements as installed. */
static void batch_of(const kvb_of_planner *P, const kvb_view *v, of_batch *b, int with_paused) {
    b->n = 0;
    for (int i = 0; i < v->n_running && b->n < OF_MAX; i++) {
        const kvb_req_view *r = &v->reqs[i];
        if (r->state != KVB_REQ_RUNNING && !(with_paused && r->state == KVB_REQ_PAUSED)) continue;
        of_req *q = req_find((kvb_of_planner *)P, r->id);
        b->vidx[b->n] = i;
        b->req[b->n] = (kvb_of_req){.len = r->n_tokens, .slo = (q ? (double)q->slo_ns : P->p.slo_ms * 1e6) * 1e-9};
        b->cand[b->n] = cand_for(P, q);
        b->n++;
    }
    find_segments(v, b);
}

static kvb_status snapshot(kvb_of_planner *P, const kvb_view *v, of_snap *s) {
    of_batch b;
    batch_of(P, v, &b, 1);
    memset(s, 0, sizeof *s);
    s->gen = ++P->gen;
    s->n = b.n;
    s->n_segs = b.n_segs;
    memcpy(s->segs, b.segs, sizeof s->segs);
    s->prof = P->prof;
    s->budget = v->pool.n_slices;
    s->resume_ok = P->finished > P->finished_at_pause;
    /* one step ahead: the step now being planned will generate a token at about now + its predicted
     * latency; the solver's slack is measured from that token */
    uint64_t t_next = v->now_ns + (uint64_t)(P->pending_pred > 0 ? P->pending_pred * 1e9 : 0);
    for (int x = 0; x < b.n; x++) {
        const kvb_req_view *r = &v->reqs[b.vidx[x]];
        of_req *q = req_find(P, r->id);
        s->id[x] = r->id;
        s->req[x] = b.req[x];
        s->paused[x] = r->state == KVB_REQ_PAUSED;
        s->pause_seq[x] = q ? q->pause_seq : 0;
        if (q) {
            s->req[x].deposit = deposit_level(q, v->now_ns);
            if (P->p.deposit && q->n_gen_seen > 0) {
                uint64_t d = kvb_deposit_next(0, q->d_last, t_next, q->slo_ns);
                s->req[x].slack = kvb_of_slack(t_next, d);
            }
        }
    }
    return KVB_OK;
}

/* Takes a finished decision: placements for the requests it covers, its pauses and resumes for this
 * step, its window and predictions for the controller. */
static void install(kvb_of_planner *P, const kvb_view *v, const of_dec *d, of_attempt *a) {
    int running = 0;
    for (int i = 0; i < v->n_running; i++) running += v->reqs[i].state == KVB_REQ_RUNNING;
    for (int x = 0; x < d->n; x++) {
        int i = kvb_view_find(v, d->id[x]);
        if (i < 0) continue; /* finished meanwhile */
        of_req *q = req_find(P, d->id[x]);
        if (!q) continue;
        if (d->cand[x] >= 0) q->cand = d->cand[x];
        /* the decision may be a step old: a pause that would leave nobody running is dropped */
        if (d->pause[x] && v->reqs[i].state == KVB_REQ_RUNNING && running - a->n_pause > 1)
            a->pause[a->n_pause++] = d->id[x];
        if (d->resume[x] && v->reqs[i].state == KVB_REQ_PAUSED) a->resume[a->n_resume++] = d->id[x];
    }
    if (d->sol.feasible) {
        kvb_of_ctl_install(&P->ctl, P->step, &d->sol);
        P->st.feasible_decisions++;
        P->st.mem_slices_sum += (double)d->sol.mem;
        P->st.buffer_slices_sum += (double)d->sol.buffer;
        P->st.eq1_buffer_slices_sum += (double)d->eq1_buffer;
        P->st.budget_slices_sum += (double)v->pool.n_slices;
    }
    P->st.solve_us_total += d->solve_s * 1e6;
    if (d->solve_s * 1e6 > P->st.solve_us_max) P->st.solve_us_max = d->solve_s * 1e6;
    P->st.decisions++;
    P->st.infeasible += !d->sol.feasible;
    P->st.best_effort += d->best_effort;
    P->st.last_solve_us = d->solve_s * 1e6;
    P->st.last_window = d->sol.delta;
    P->st.nodes += d->sol.nodes;
}

/* The baselines' placements for the running set (§5.1). */
static kvb_status baseline_place(kvb_of_planner *P, const kvb_view *v, int changed) {
    of_batch b;
    batch_of(P, v, &b, 0);
    kvb_of_problem q;
    problem_of(P, &b, &P->prof, v->pool.n_slices, &q);
    q.enforce_slo = 0;
    int uniform = -1;
    switch (P->kind) {
    case KVB_OF_KIND_DEEPSPEED: uniform = P->most_off; break;
    case KVB_OF_KIND_FLEXGEN:
        if (!P->have_profile) { /* the worst case needs the compute profile: until then the safest */
            uniform = P->most_off;
            break;
        }
        if (P->static_cand < 0) {
            int n = P->p.batch > 0 ? P->p.batch : v->max_seqs;
            int64_t worst = P->p.batch_tokens > 0 ? P->p.batch_tokens / n : v->max_model_len;
            P->static_cand = kvb_of_flexgen_static(&q, n, worst);
        }
        uniform = (int)P->static_cand;
        break;
    case KVB_OF_KIND_FLEXGEN_PLUS:
    case KVB_OF_KIND_SLO_AWARE: {
        if ((!changed && !P->pending_first) || b.n == 0) return KVB_OK;
        if (!P->have_profile) {
            uniform = P->most_off;
            P->pending_first = 1; /* decide again once the profile exists */
            break;
        }
        P->pending_first = 0;
        if (P->kind == KVB_OF_KIND_SLO_AWARE && !P->table.entry) {
            int n = P->p.batch > 0 ? P->p.batch : v->max_seqs;
            int64_t tok = P->p.batch_tokens > 0 ? P->p.batch_tokens : (int64_t)n * v->max_model_len;
            KVB_TRY(kvb_of_slo_table_build(&q, P->p.slo_ms * 1e-3, n, tok, KVB_MAX(tok / 32, 1), &P->table));
        }
        int64_t total = 0;
        for (int x = 0; x < b.n; x++) {
            const kvb_req_view *r = &v->reqs[b.vidx[x]];
            P->final_len[x] = r->n_prompt + r->max_tokens;
            total += P->final_len[x];
        }
        uniform = P->kind == KVB_OF_KIND_FLEXGEN_PLUS ? kvb_of_flexgen_batch(&q, P->final_len)
                                                      : kvb_of_slo_table_lookup(&P->table, b.n, total);
        if (uniform < 0) uniform = P->most_off;
        break;
    }
    case KVB_OF_KIND_DYNAMIC: {
        int cand[OF_MAX];
        kvb_of_dynamic_heuristic(&q, cand);
        for (int x = 0; x < b.n; x++) {
            of_req *r = req_find(P, v->reqs[b.vidx[x]].id);
            if (r) r->cand = cand[x];
        }
        return KVB_OK;
    }
    default: return KVB_OK;
    }
    for (int x = 0; x < b.n; x++) {
        of_req *r = req_find(P, v->reqs[b.vidx[x]].id);
        if (r) r->cand = uniform;
    }
    return KVB_OK;
}

static kvb_status plan_step(kvb_of_planner *P, const kvb_view *v, kvb_plan *out);

static kvb_status of_plan_step(void *ctx, const kvb_view *v, kvb_plan *out) {
    kvb_of_planner *P = ctx;
    double t0 = kvb_now_s();
    kvb_status st = plan_step(P, v, out);
    P->st.plan_s += kvb_now_s() - t0;
    return st;
}

static kvb_status plan_step(kvb_of_planner *P, const kvb_view *v, kvb_plan *out) {
    P->step = (int64_t)v->step;
    if (!P->t_step_end) P->t_step_end = v->now_ns;
    /* requests: new tokens, finished ones */
    for (int i = 0; i < P->n_reqs; i++) P->reqs[i].live = 0;
    for (int i = 0; i < v->n_reqs; i++) {
        const kvb_req_view *r = &v->reqs[i];
        if (r->state == KVB_REQ_WAITING && !req_find(P, r->id)) continue;
        of_req *q;
        KVB_TRY(req_get(P, r, &q));
        if (r->state == KVB_REQ_WAITING) q->cand = -1; /* preempted: placed again when admitted */
        KVB_TRY(deposit_tokens(P, q, r->n_generated));
    }
    for (int i = 0; i < P->n_reqs;) {
        if (P->reqs[i].live) {
            i++;
            continue;
        }
        free(P->reqs[i].due);
        P->reqs[i] = P->reqs[--P->n_reqs];
        P->finished++;
    }
    uint64_t key = batch_key(v);
    int changed = key != P->batch_key;
    P->batch_key = key;
    of_attempt a = {0};
    if (P->kind == KVB_OF_KIND_ORBITFLOW) {
        of_dec d;
        if (solve_take(P, &d)) install(P, v, &d, &a);
        /* the controller: batch change and memory at once, window at its end, mismatch rate-limited */
        of_batch b;
        batch_of(P, v, &b, 0);
        kvb_of_problem q;
        problem_of(P, &b, &P->prof, v->pool.n_slices, &q);
        int mem_short = b.n > 0 && kvb_of_memory(&q, b.cand, 0, NULL) > q.budget;
        /* the check is about the step that ran last; the window's end is anticipated by one step so that
         * the solver, one step ahead, has the next plan ready when it expires */
        unsigned t = kvb_of_ctl_check(&P->ctl, P->step - 1, changed, mem_short, P->pending_prefill, P->st.last_observed);
        if (P->ctl.plan_step >= 0 && P->step + 1 - P->ctl.plan_step >= P->ctl.delta) t |= KVB_OF_TRIG_WINDOW;
        P->trig |= t;
        if (P->trig && b.n + (v->n_running - b.n) > 0 && !solve_busy(P)) {
            of_snap *s = &P->snap;
            KVB_TRY(snapshot(P, v, s));
            if (P->trig & KVB_OF_TRIG_BATCH) P->st.trig_batch++;
            if (P->trig & KVB_OF_TRIG_WINDOW) P->st.trig_window++;
            if (P->trig & KVB_OF_TRIG_MEMORY) P->st.trig_memory++;
            if (P->trig & KVB_OF_TRIG_MISMATCH) P->st.trig_mismatch++;
            P->trig = 0;
            solve_post(P, s);
            if (!P->p.threaded && solve_take(P, &d)) install(P, v, &d, &a);
        } else if (P->trig && solve_busy(P)) {
            P->st.solver_late++;
        }
    } else {
        KVB_TRY(baseline_place(P, v, changed));
    }
    /* nobody running but paused requests: the earliest paused one runs (it is alone: never paused) */
    int running = 0;
    for (int i = 0; i < v->n_running; i++)
        running += v->reqs[i].state == KVB_REQ_RUNNING && !in_list(a.pause, a.n_pause, v->reqs[i].id);
    if (!running && !a.n_resume) {
        const of_req *first = NULL;
        for (int i = 0; i < v->n_running; i++) {
            const of_req *q = v->reqs[i].state == KVB_REQ_PAUSED ? req_find(P, v->reqs[i].id) : NULL;
            if (q && (!first || q->pause_seq < first->pause_seq)) first = q;
        }
        if (first) a.resume[a.n_resume++] = first->id;
    }
    a.min_resume = !running && a.n_resume > 0;
    KVB_TRY(build_fitting(P, v, &a, out));
    /* what the executed plan did: pauses, resumes, the step's context for observe */
    double tokens = 0;
    int prefill = 0;
    for (int k = 0; k < out->n_ops; k++) {
        const kvb_plan_op *op = &out->ops[k];
        int i = kvb_view_find(v, op->id);
        of_req *q = req_find(P, op->id);
        if (op->kind == KVB_OP_PAUSE && q) {
            q->paused = 1;
            q->pause_seq = ++P->pause_seq;
            P->finished_at_pause = P->finished;
            P->st.pauses++;
        } else if (op->kind == KVB_OP_RESUME && q) {
            q->paused = 0;
            P->st.resumes++;
        } else if (op->kind == KVB_OP_RUN || op->kind == KVB_OP_ADMIT) {
            tokens += v->reqs[i].n_computed + op->q_len;
            prefill |= op->q_len > 1;
        }
    }
    P->pending_tokens = tokens;
    P->pending_prefill = prefill;
    int64_t s = P->step - P->ctl.plan_step;
    P->pending_pred = s >= 0 && s < P->ctl.delta && s < KVB_OF_MAX_WINDOW ? P->ctl.pred[s] : 0;
    return KVB_OK;
}

/* ---------------------------------------------------------------- observe: the profile and the link */

static void profile_fit(kvb_of_planner *P) {
    int n = P->n_samples;
    double lo = P->s_tok[0], hi = P->s_tok[0];
    for (int i = 1; i < n; i++) {
        lo = KVB_MIN(lo, P->s_tok[i]);
        hi = KVB_MAX(hi, P->s_tok[i]);
    }
    double bw = P->prof.bw, lat = P->prof.lat;
    if (n >= 2 && hi > lo && kvb_of_profile_fit(&P->prof, P->L, P->s_tok, P->s_lay, n) == KVB_OK) {
        /* fitted: a_l, c_l; scale back to 1 */
    } else { /* one token count so far: a flat profile at the mean */
        for (int l = 0; l < P->L; l++) {
            double m = 0;
            for (int i = 0; i < n; i++) m += P->s_lay[i * P->L + l];
            P->prof.a[l] = m / n;
            P->prof.c[l] = 0;
            P->prof.scale[l] = 1;
        }
    }
    P->prof.n_layers = P->L;
    P->prof.bw = bw;
    P->prof.lat = lat;
    P->have_profile = 1;
    P->since_fit = 0;
    P->st.profile_fits++;
}

static void of_observe(void *ctx, const kvb_step_report *r) {
    kvb_of_planner *P = ctx;
    P->t_step_end = kvb_wall_ns();
    if (r->n_seqs == 0 || r->n_layers != P->L) return;
    double total = 0;
    double *lay = P->s_lay + (size_t)P->next_sample * P->L;
    for (int l = 0; l < P->L; l++) {
        total += (double)r->t_layer_ns[l] * 1e-9;
        lay[l] = (double)(r->t_layer_ns[l] - KVB_MIN(r->t_wait_ns[l], r->t_layer_ns[l])) * 1e-9;
    }
    P->st.last_observed = total;
    int decode = r->n_prefill_seqs == 0 && P->pending_tokens > 0;
    if (decode) {
        if (P->pending_pred > 0) { /* the model against the measurement */
            double e = fabs(total - P->pending_pred) / P->pending_pred;
            P->st.pred_steps++;
            P->st.pred_err_sum += e;
            if (e > P->st.pred_err_max) P->st.pred_err_max = e;
            P->st.pred_within[0] += e <= 0.10;
            P->st.pred_within[1] += e <= 0.25;
            P->st.pred_within[2] += e <= 0.50;
        }
        /* a decode step's compute: a sample for the fit, and the EWMA of measured / predicted */
        P->s_tok[P->next_sample] = P->pending_tokens;
        P->next_sample = (P->next_sample + 1) % OF_SAMPLES;
        if (P->n_samples < OF_SAMPLES) P->n_samples++;
        P->since_fit++;
        if (!P->have_profile || P->since_fit >= OF_SAMPLES / 2) profile_fit(P);
        else kvb_of_profile_observe(&P->prof, P->pending_tokens, lay, 0, P->p.ewma);
    }
    const kvb_link_report *h = &r->links[KVB_LINK_HOST];
    if (h->gbps > 0 && !P->link_known) { /* no model of the link: what it achieved */
        double slices_s = h->gbps * 1e9 / (double)P->layer_bytes;
        P->prof.bw = P->st.link_measured ? (1 - P->p.ewma) * P->prof.bw + P->p.ewma * slices_s : slices_s;
        P->st.link_measured = 1;
    }
}

/* ---------------------------------------------------------------- setup, destroy, create */

static kvb_status of_plan_pool(void *ctx, const kvb_pool_event *ev, const kvb_view *v, kvb_pool_plan *out) {
    kvb_of_planner *P = ctx;
    if (ev->kind != KVB_POOL_SETUP) return KVB_OK;
    P->L = v->geom->n_layers;
    P->bs = v->geom->block_size;
    P->layer_bytes = kvb_kv_layer_bytes(v->geom);
    if (P->L > KVB_OF_MAX_LAYERS) {
        KVB_LOG_E("policy %s: %d layers, at most %d", kind_names[P->kind], P->L, KVB_OF_MAX_LAYERS);
        return KVB_ERR_UNSUPPORTED;
    }
    P->n_cands = kvb_of_candidates(P->L, P->cands, KVB_OF_MAX_CANDS - 1);
    P->most_off = P->n_cands - 1;
    if (P->kind == KVB_OF_KIND_DEEPSPEED) {
        kvb_of_cand_all_offloaded(P->L, &P->cands[P->n_cands]);
        P->most_off = P->n_cands++;
    }
    KVB_TRY(kvb_calloc((size_t)OF_SAMPLES * P->L, sizeof *P->s_lay, (void **)&P->s_lay));
    kvb_of_profile_uniform(&P->prof, P->L, 0, 0, 1e12, 0);
    /* the host link as the stager charges it (a parameter wins; an unlimited link: measured later) */
    const kvb_link *h = v->links ? &v->links->links[KVB_LINK_HOST] : NULL;
    if (h && h->bytes_per_s > 0) {
        P->prof.bw = h->bytes_per_s / (double)P->layer_bytes;
        P->link_known = 1;
    }
    if (h) P->prof.lat = h->latency_s;
    if (P->p.link_gbps > 0) {
        P->prof.bw = P->p.link_gbps * 1e9 / (double)P->layer_bytes;
        P->link_known = 1;
    }
    if (P->p.link_us > 0) P->prof.lat = P->p.link_us * 1e-6;
    const kvb_of_cand *mo = &P->cands[P->most_off];
    out->sliced_min_layers = P->L - mo->n_off + (mo->n_off > 0 ? mo->n_slots : 0);
    int64_t ids = P->p.host_blocks;
    if (ids <= 0) {
        int64_t per = KVB_DIV_CEIL((int64_t)v->max_model_len, P->bs);
        ids = KVB_MAX(8 * (int64_t)v->pool.capacity, (int64_t)v->max_seqs * per + v->pool.capacity);
    }
    out->sliced_ids = (int)KVB_MIN(ids, (int64_t)INT32_MAX / KVB_MAX(P->L, 1));
    return KVB_OK;
}

static void of_destroy(void *ctx) {
    kvb_of_planner *P = ctx;
    if (!P) return;
    if (P->started) {
        pthread_mutex_lock(&P->mu);
        P->quit = 1;
        pthread_cond_broadcast(&P->cv);
        pthread_mutex_unlock(&P->mu);
        pthread_join(P->th, NULL);
        pthread_cond_destroy(&P->cv);
        pthread_mutex_destroy(&P->mu);
    }
    for (int i = 0; i < P->n_reqs; i++) free(P->reqs[i].due);
    free(P->reqs);
    free(P->s_lay);
    free(P->final_len);
    kvb_of_slo_table_free(&P->table);
    free(P);
}

#define OF_IFACE(nm)                                                                                   \
    {.name = nm, .plan_step = of_plan_step, .plan_pool = of_plan_pool, .observe = of_observe, .destroy = of_destroy}
static const kvb_planner_i of_ifaces[KVB_OF_KIND_COUNT] = {
    OF_IFACE("orbitflow"), OF_IFACE("deepspeed"), OF_IFACE("flexgen"), OF_IFACE("flexgen-plus"),
    OF_IFACE("slo-aware-offload"), OF_IFACE("dynamic-heuristic"),
};
#undef OF_IFACE

kvb_status kvb_of_planner_create(kvb_of_kind kind, const kvb_of_params *p, kvb_planner *out) {
    *out = (kvb_planner){0};
    if (kind < 0 || kind >= KVB_OF_KIND_COUNT) return KVB_ERR_INVALID;
    kvb_of_planner *P = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *P, (void **)&P));
    P->p = *p;
    P->kind = kind;
    P->static_cand = -1;
    P->rng = 0x2545f4914f6cdd1dull;
    kvb_of_ctl_init(&P->ctl, p->delta_min, p->threshold);
    kvb_status st;
    KVB_TRY_GOTO(kvb_calloc(OF_MAX, sizeof *P->final_len, (void **)&P->final_len), fail);
    if (kind == KVB_OF_KIND_ORBITFLOW && p->threaded) {
        if (pthread_mutex_init(&P->mu, NULL)) {
            st = KVB_ERR_NOMEM;
            goto fail;
        }
        if (pthread_cond_init(&P->cv, NULL)) {
            pthread_mutex_destroy(&P->mu);
            st = KVB_ERR_NOMEM;
            goto fail;
        }
        if (pthread_create(&P->th, NULL, solver_thread, P)) {
            pthread_cond_destroy(&P->cv);
            pthread_mutex_destroy(&P->mu);
            KVB_LOG_E("policy orbitflow: cannot start the solver thread");
            st = KVB_ERR_NOMEM;
            goto fail;
        }
        P->started = 1;
    }
    *out = (kvb_planner){.iface = &of_ifaces[kind], .ctx = P};
    return KVB_OK;
fail:
    of_destroy(P);
    return st;
}

int kvb_of_planner_of(const kvb_planner *pl, kvb_of_planner **out) {
    for (int k = 0; pl && pl->iface && k < KVB_OF_KIND_COUNT; k++)
        if (pl->iface == &of_ifaces[k]) {
            if (out) *out = pl->ctx;
            return 1;
        }
    return 0;
}

void kvb_of_planner_get_stats(const kvb_of_planner *P, kvb_of_planner_stats *out) { *out = P->st; }

/* The registry's create functions (policies.def): the paper's defaults per kind. */
static kvb_status create_kind(kvb_of_kind kind, const kvb_policy_params *params, kvb_planner *out) {
    kvb_of_params p;
    kvb_of_params_default(&p);
    if (kind != KVB_OF_KIND_ORBITFLOW) { /* §5.1: no Token-Deposit (but in Fig. 14b), no Pause-Resume */
        p.deposit = 0;
        p.pause = 0;
    }
    KVB_TRY(kvb_of_params_parse(params, kind_names[kind], &p));
    return kvb_of_planner_create(kind, &p, out);
}

#define OF_CREATE(fn, kind)                                                                            \
    kvb_status fn(const kvb_policy_params *params, kvb_planner *out) { return create_kind(kind, params, out); }
OF_CREATE(kvb_policy_orbitflow_create, KVB_OF_KIND_ORBITFLOW)
OF_CREATE(kvb_policy_deepspeed_create, KVB_OF_KIND_DEEPSPEED)
OF_CREATE(kvb_policy_flexgen_create, KVB_OF_KIND_FLEXGEN)
OF_CREATE(kvb_policy_flexgen_plus_create, KVB_OF_KIND_FLEXGEN_PLUS)
OF_CREATE(kvb_policy_slo_aware_create, KVB_OF_KIND_SLO_AWARE)
OF_CREATE(kvb_policy_dynamic_heuristic_create, KVB_OF_KIND_DYNAMIC)
#undef OF_CREATE
