/* kvbank — `ellm-tokenwise` (eLLM adaptive KV caching, ../shared/papers/ellm-adaptive-kv-caching.txt
 * §3-5) and its three baselines of §6.1 as planners over the seam (common/sched/plan.h):
 *
 *   ellm-tokenwise  every running request keeps device KV only for its newest tokens: the blocks of its
 *                   oldest floor(r·s_i) tokens are dropped (KVB_OP_DROP) and those tokens are
 *                   recomputed from their ids in every step (RUN n_absent), layer by layer with the
 *                   decode; (b, r) from the request-level optimizer (Eq. 5 under Eq. 1), solved on a
 *                   thread of its own, re-checked against memory before use.
 *   vllm-recompute  vLLM under Eq. 5 with r = 0: FCFS with the batch bounded by the optimizer; when
 *                   blocks run out, the newest request is preempted and recomputed later.
 *   vllm-swap       the same, preempted requests swapped out to the host tier and back.
 *   hcache          preemption-based (ellm_tw_hcache.c).
 *
 * Running requests beyond the optimizer's b (b fell below their count): ellm-tokenwise first raises r
 * for the running set if that fits memory and the SLO (with 10% slack, so that b does not flap);
 * otherwise, and always for the baselines, the newest running requests are preempted (recomputed
 * later, or swapped out for vllm-swap) until b remain. */
#include <math.h>
#include <pthread.h>
#include <string.h>

#include "common/policy/ellm_tw_planner.h"
#include "common/policy/policy.h"
#include "common/sched/scheduler.h"

typedef enum etw_kind { ETW_ELLM = 0, ETW_RECOMPUTE = 1, ETW_SWAP = 2 } etw_kind;

static const char *const kind_names[] = {"ellm-tokenwise", "vllm-recompute", "vllm-swap"};

/* The solver thread's mailbox: plan_step posts the newest problem and takes the newest answer. */
typedef struct solver {
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int started, quit;
    /* request (under mu) */
    kvb_etw_problem req;
    int *req_s;        /* [req_cap] */
    int *req_u;        /* [req_cap] u_i of the running set at the last (b, r), for the layer level */
    int req_cap;
    int req_n_run;
    uint64_t req_seq;  /* bumped per post */
    /* answer (under mu) */
    kvb_etw_solution sol;
    kvb_etw_layer_plan layer;
    uint64_t res_seq;  /* req_seq it answers; 0: none yet */
    /* solve times */
    double t_sum, t_max;
    uint64_t solves;
} solver;

typedef struct etw {
    etw_kind kind;
    /* parameters */
    double slo_ms, r_max, r_fixed;
    int64_t b_bound, F, chunk, rows, host_blocks, threads;
    int async, swap_layers;
    /* model, once known */
    int ready;
    kvb_etw_dims d;
    kvb_etw_link link;
    kvb_etw_fit fit;
    kvb_etw_rates rates;   /* the fit's current estimate */
    kvb_etw_layer_plan layer;
    solver sv;
    /* scratch for plan_step */
    int *s, *u;
    int cap;
    /* the last plan's work, for observe */
    kvb_etw_work last_work;
    int last_valid;
    uint64_t last_step;
    /* statistics */
    kvb_etw_planner_stats st;
    double err_abs_rel_sum; /* Σ |predicted − measured| / measured */
    double cached_sum;      /* Σ over steps of (1 − Σu / Σs) of the decoding requests */
    uint64_t cached_steps;
} etw;

/* ---------------------------------------------------------------- solver thread */
static void *solver_main(void *arg) {
    etw *p = arg;
    solver *sv = &p->sv;
    uint64_t done = 0;
    int *s = NULL, *u = NULL, cap = 0;
    pthread_mutex_lock(&sv->mu);
    for (;;) {
        while (!sv->quit && sv->req_seq == done) pthread_cond_wait(&sv->cv, &sv->mu);
        if (sv->quit) break;
        /* copy the request out, solve without the lock */
        uint64_t seq = sv->req_seq;
        kvb_etw_problem prob = sv->req;
        int n = prob.n, n_run = sv->req_n_run;
        if (n > cap) {
            int nc = n * 2;
            int *ns = realloc(s, (size_t)nc * sizeof *s), *nu = ns ? realloc(u, (size_t)nc * sizeof *u) : NULL;
            if (ns) s = ns;
            if (nu) u = nu;
            if (!ns || !nu) {
                done = seq; /* out of memory: skip this one, keep the last answer */
                continue;
            }
            cap = nc;
        }
        memcpy(s, sv->req_s, (size_t)n * sizeof *s);
        memcpy(u, sv->req_u, (size_t)n_run * sizeof *u);
        pthread_mutex_unlock(&sv->mu);

        double t0 = kvb_now_s();
        /* layer level on the running set at the last (b, r) (§4.3), then the request level with its
         * M_o and n_rec (the closed loop) */
        kvb_etw_layer_plan lp = prob.layer;
        if (p->swap_layers) {
            kvb_etw_batch bt = {.b = n_run, .s = s, .u = u};
            kvb_etw_layer_optimize(p->d.n_layers ? &p->d : prob.d, &prob.rates, &p->link, &bt, (int)p->threads, 0, &lp);
        }
        prob.layer = lp;
        prob.s = s;
        kvb_etw_solution sol;
        kvb_status st = kvb_etw_solve(&prob, &sol);
        double dt = kvb_now_s() - t0;

        pthread_mutex_lock(&sv->mu);
        done = seq;
        if (st == KVB_OK) {
            sv->sol = sol;
            sv->layer = lp;
            sv->res_seq = seq;
        }
        sv->t_sum += dt;
        if (dt > sv->t_max) sv->t_max = dt;
        sv->solves++;
    }
    pthread_mutex_unlock(&sv->mu);
    free(s);
    free(u);
    return NULL;
}

static kvb_status solver_start(etw *p) {
    solver *sv = &p->sv;
    if (sv->started) return KVB_OK;
    if (pthread_mutex_init(&sv->mu, NULL)) return KVB_ERR_NOMEM;
    if (pthread_cond_init(&sv->cv, NULL)) {
        pthread_mutex_destroy(&sv->mu);
        return KVB_ERR_NOMEM;
    }
    if (pthread_create(&sv->th, NULL, solver_main, p)) {
        pthread_cond_destroy(&sv->cv);
        pthread_mutex_destroy(&sv->mu);
        KVB_LOG_E("policy %s: cannot start the solver thread", kind_names[p->kind]);
        return KVB_ERR_NOMEM;
    }
    sv->started = 1;
    return KVB_OK;
}

static void solver_stop(etw *p) {
    solver *sv = &p->sv;
    if (!sv->started) return;
    pthread_mutex_lock(&sv->mu);
    sv->quit = 1;
    pthread_cond_signal(&sv->cv);
    pthread_mutex_unlock(&sv->mu);
    pthread_join(sv->th, NULL);
    pthread_cond_destroy(&sv->cv);
    pthread_mutex_destroy(&sv->mu);
    free(sv->req_s);
    free(sv->req_u);
    sv->started = 0;
}

/* Posts `prob` (its s copied, with the running set's u) and takes the newest answer, if any. */
static kvb_status solver_exchange(etw *p, const kvb_etw_problem *prob, const int *u, int n_run, kvb_etw_solution *sol,
                                  kvb_etw_layer_plan *lp, int *have) {
    solver *sv = &p->sv;
    pthread_mutex_lock(&sv->mu);
    kvb_status st = KVB_OK;
    if (prob->n > sv->req_cap) {
        int nc = prob->n * 2;
        int *ns = sv->req_s, *nu = sv->req_u;
        st = kvb_realloc_array((void **)&ns, (size_t)nc, sizeof *ns);
        if (st == KVB_OK) sv->req_s = ns;
        if (st == KVB_OK) st = kvb_realloc_array((void **)&nu, (size_t)nc, sizeof *nu);
        if (st == KVB_OK) {
            sv->req_u = nu;
            sv->req_cap = nc;
        }
    }
    if (st == KVB_OK) {
        sv->req = *prob;
        memcpy(sv->req_s, prob->s, (size_t)prob->n * sizeof *prob->s);
        memcpy(sv->req_u, u, (size_t)n_run * sizeof *u);
        sv->req_n_run = n_run;
        sv->req_seq++;
        pthread_cond_signal(&sv->cv);
    }
    *have = sv->res_seq != 0;
    if (*have) {
        *sol = sv->sol;
        *lp = sv->layer;
    }
    pthread_mutex_unlock(&sv->mu);
    return st;
}

/* ---------------------------------------------------------------- model and problem */
static kvb_status ensure_cap(etw *p, int n) {
    if (n <= p->cap) return KVB_OK;
    int nc = KVB_MAX(n, 2 * p->cap);
    KVB_TRY(kvb_realloc_array((void **)&p->s, (size_t)nc, sizeof *p->s));
    KVB_TRY(kvb_realloc_array((void **)&p->u, (size_t)nc, sizeof *p->u));
    p->cap = nc;
    return KVB_OK;
}

/* The prior of the cost model from what the view says about the machine: the matmul rate the stager
 * measured, attention at a quarter of it, a bandwidth of 10 bytes per 30 FLOPs and 0.2 ms per step;
 * observe re-fits all four from measured steps. */
static void init_model(etw *p, const kvb_view *v) {
    const kvb_model_info *mi = v->model;
    kvb_etw_dims_from_config(mi->cfg, v->geom->elem_size, mi->act_elem, (double)mi->weight_bytes, &p->d);
    double flops = mi->flops > 0 ? mi->flops : 50e9;
    kvb_etw_rates prior = {.t_fixed = 2e-4, .s_flop = 1.0 / flops, .s_attn = 4.0 / flops, .s_byte = 3.0 / flops};
    kvb_etw_fit_init(&p->fit, &prior, 1.0, 0.995);
    p->rates = prior;
    p->link = (kvb_etw_link){0};
    if (p->swap_layers && v->links) {
        p->link.bytes_per_s = v->links->links[KVB_LINK_HOST].bytes_per_s;
        p->link.latency_s = v->links->links[KVB_LINK_HOST].latency_s;
        if (!(p->link.bytes_per_s > 0)) p->link.bytes_per_s = 1e12; /* link model off: memory speed */
    }
    p->layer = kvb_etw_layer_initial(&p->d, p->swap_layers ? &p->link : NULL);
    p->ready = 1;
}

/* WT_max: the prefill chunk of the queue's head costed by the model (0 with an empty queue). */
static double wt_max(const etw *p, const kvb_view *v) {
    if (!v->n_waiting || p->chunk <= 0) return 0;
    const kvb_req_view *h = &v->reqs[v->n_running + v->n_swapped];
    double c = (double)KVB_MIN(p->chunk, (int64_t)h->n_tokens);
    return kvb_etw_time(&p->rates, kvb_etw_work_prefill(&p->d, 0, c));
}

/* Forward rows kept for prefill while requests wait: the chunk, at most half the step's budget. */
static int prefill_reserve(const etw *p, const kvb_view *v) {
    if (!v->n_waiting) return 0;
    return (int)KVB_MIN(p->chunk, (int64_t)v->max_batch_tokens / 2);
}

/* The problem of this view: candidates in FCFS order, s_i their tokens. */
static void make_problem(etw *p, const kvb_view *v, kvb_etw_problem *prob) {
    for (int i = 0; i < v->n_reqs; i++) p->s[i] = v->reqs[i].n_tokens;
    int64_t host = 0;
    if (p->swap_layers) host = v->pool.host_capacity;
    *prob = (kvb_etw_problem){
        .d = &p->d,
        .rates = p->rates,
        .layer = p->layer,
        .s = p->s,
        .n = v->n_reqs,
        .b_bound = (int)KVB_MIN(p->b_bound, (int64_t)v->max_seqs),
        .r_max = p->kind == ETW_ELLM ? p->r_max : 0,
        .slo_s = p->slo_ms > 0 ? p->slo_ms * 1e-3 : 1e9,
        .wt_max_s = p->slo_ms > 0 ? wt_max(p, v) : 0,
        .block_size = v->geom->block_size,
        .unit_layers = (int)p->F,
        .mem_blocks = v->pool.n_blocks,
        .host_blocks = host,
        .max_rows = KVB_MAX(1, v->max_rows - prefill_reserve(p, v)),
        .act_row_bytes = 0, /* the forward pass's extra rows are allocated once (plan_pool) */
    };
    if (!p->swap_layers) {
        /* kvbank's fused step: the recomputed rows run in the decode's forward pass, each layer's
         * recompute writing single-layer scratch slices that the same layer's attention reads: one
         * layer of scratch per recomputed block (units of one layer, depth 1) */
        prob->unit_layers = 1;
        prob->layer.depth = 1;
    }
}

/* ---------------------------------------------------------------- plan_step */
static int decoding(const kvb_req_view *r) { return r->n_computed >= r->n_prompt && r->n_computed == r->n_tokens - 1; }

/* Preempts (or swaps out) the newest running requests so that at most `keep` remain. */
static kvb_status trim_running(const etw *p, const kvb_view *v, int keep, kvb_plan *out) {
    for (int i = v->n_running - 1; i >= keep; i--) {
        kvb_op_kind k = KVB_OP_PREEMPT;
        if (p->kind == ETW_SWAP && v->pool.host_free >= v->reqs[i].n_blocks) k = KVB_OP_SWAP_OUT;
        KVB_TRY(kvb_plan_push_op(out, (kvb_plan_op){.kind = k, .id = v->reqs[i].id}));
    }
    return KVB_OK;
}

/* ellm-tokenwise's own part of the plan: DROP and RUN entries for the running requests at ratio r
 * (prefilling ones run their next chunk with nothing absent), then FCFS admission up to b. */
static kvb_status ellm_plan(etw *p, const kvb_view *v, int n_keep, double r, int b, kvb_plan *out) {
    const int bs = v->geom->block_size;
    int budget = (int)KVB_MIN((int64_t)v->max_batch_tokens, p->chunk + n_keep);
    int used = 0;
    double sum_s = 0, sum_u = 0;
    kvb_etw_work w = kvb_etw_work_step(&p->d);
    for (int i = 0; i < n_keep; i++) {
        const kvb_req_view *rq = &v->reqs[i];
        if (rq->state != KVB_REQ_RUNNING) continue;
        if (decoding(rq)) {
            int64_t u = kvb_etw_absent(r, rq->n_computed);
            int drop = (int)(u / bs);
            if (drop != rq->n_dropped)
                KVB_TRY(kvb_plan_push_op(out, (kvb_plan_op){.kind = KVB_OP_DROP, .id = rq->id, .n_dropped = drop}));
            /* a restore (fewer dropped blocks) recomputes the restored blocks into them this step */
            int absent = (int)KVB_MAX(u, (int64_t)rq->n_dropped * bs);
            KVB_TRY(kvb_plan_push_op(out, (kvb_plan_op){.kind = KVB_OP_RUN, .id = rq->id, .q_len = 1, .n_absent = absent}));
            used++;
            kvb_etw_work_add(&w, kvb_etw_work_decode(&p->d, rq->n_computed));
            if (absent > 0) kvb_etw_work_add(&w, kvb_etw_work_recompute(&p->d, absent, p->d.n_layers));
            sum_s += rq->n_computed;
            sum_u += absent;
        } else {
            int q = KVB_MIN(rq->n_tokens - rq->n_computed, budget - used);
            if (q < 1) continue;
            KVB_TRY(kvb_plan_push_op(out, (kvb_plan_op){.kind = KVB_OP_RUN, .id = rq->id, .q_len = q,
                                                        .n_absent = rq->n_dropped * bs}));
            used += q;
            kvb_etw_work_add(&w, kvb_etw_work_prefill(&p->d, rq->n_computed, q));
        }
    }
    /* the running part must fit before admissions are added (else the caller preempts and retries) */
    kvb_plan_cost cost;
    kvb_status cst = kvb_sched_cost(v, out, &cost, NULL, 0);
    if (cst == KVB_ERR_INVALID) return KVB_ERR_EXHAUSTED;
    KVB_TRY(cst);
    kvb_fcfs_opts o = {.budget = budget, .batch_limit = b};
    int before = out->n_ops;
    KVB_TRY(kvb_sched_fcfs_admit(v, &o, out));
    for (int k = before; k < out->n_ops; k++)
        if (out->ops[k].kind == KVB_OP_ADMIT) {
            int j = kvb_view_find(v, out->ops[k].id);
            if (j >= 0) kvb_etw_work_add(&w, kvb_etw_work_prefill(&p->d, 0, out->ops[k].q_len));
        }
    p->last_work = w;
    p->last_valid = 1;
    if (sum_s > 0) {
        p->cached_sum += 1 - sum_u / sum_s;
        p->cached_steps++;
    }
    return KVB_OK;
}

static kvb_status etw_plan_step(void *ctx, const kvb_view *v, kvb_plan *out) {
    etw *p = ctx;
    if (!p->ready) init_model(p, v);
    KVB_TRY(ensure_cap(p, v->n_reqs + 1));
    p->last_valid = 0;
    p->st.steps++;
    if (v->n_reqs == 0) return KVB_OK;

    kvb_etw_problem prob;
    make_problem(p, v, &prob);
    /* u of the running set at the current ratio, for the layer level */
    for (int i = 0; i < v->n_running; i++) p->u[i] = v->reqs[i].n_dropped * v->geom->block_size;

    kvb_etw_solution sol = {0};
    kvb_etw_layer_plan lp = p->layer;
    int have = 0;
    if (p->async) {
        KVB_TRY(solver_exchange(p, &prob, p->u, v->n_running, &sol, &lp, &have));
    } else {
        double t0 = kvb_now_s();
        KVB_TRY(kvb_etw_solve(&prob, &sol));
        double dt = kvb_now_s() - t0;
        p->sv.t_sum += dt;
        p->sv.t_max = fmax(p->sv.t_max, dt);
        p->sv.solves++;
        have = 1;
    }
    if (have) p->layer = lp;
    prob.layer = p->layer;

    /* the answer may be for an older view: re-check it against this one */
    int n_run = v->n_running;
    int b = have ? sol.b : v->n_reqs; /* before the first answer: vLLM's behaviour, memory decides */
    double r = have ? sol.r : 0;
    if (p->r_fixed >= 0 && p->kind == ETW_ELLM) r = p->r_fixed;
    if (b < 1) b = 1;
    int keep = n_run;
    if (b < n_run) {
        /* keep the running set if it fits at some ratio (r = 0 for the baselines) within the SLO */
        double rk = kvb_etw_min_ratio(&prob, n_run);
        if (rk >= 0 && kvb_etw_exact_time(&prob, n_run, rk) + prob.wt_max_s <= 1.1 * prob.slo_s) {
            r = fmax(r, rk);
            b = n_run;
        } else {
            keep = b;
        }
    }
    if (p->kind == ETW_ELLM && p->r_fixed < 0) {
        /* the running set that stays must fit at r: raise r, or keep fewer (the newest are preempted) */
        for (; keep > 0; keep--) {
            double rk = kvb_etw_min_ratio(&prob, keep);
            if (rk >= 0) {
                r = fmax(r, rk);
                break;
            }
        }
        if (b > keep && keep < n_run) b = keep;
    }
    p->st.b_sum += b;
    p->st.r_sum += r;
    KVB_LOG_D("%s: step %llu: %d running, %d waiting; answer %s b %d r %.3f; using b %d r %.3f keep %d (T %.3g ms)",
              kind_names[p->kind], (unsigned long long)v->step, n_run, v->n_waiting, have ? "yes" : "none",
              have ? sol.b : -1, have ? sol.r : 0.0, b, r, keep, have ? sol.t_step * 1e3 : 0.0);
    if (keep < n_run) {
        KVB_TRY(trim_running(p, v, keep, out));
        p->st.trims += (uint64_t)(n_run - keep);
    }
    if (p->kind == ETW_ELLM) {
        /* a plan the executor would refuse (a request the pool cannot extend): preempt the newest
         * running request and plan again */
        for (;;) {
            char err[256] = "the running requests do not fit";
            kvb_status st = ellm_plan(p, v, keep, r, b, out);
            if (st == KVB_OK) st = kvb_sched_cost(v, out, NULL, err, sizeof err);
            if ((st != KVB_ERR_INVALID && st != KVB_ERR_EXHAUSTED) || keep == 0) return st;
            KVB_LOG_D("%s: plan refused (%s); preempting request %llu", kind_names[p->kind], err,
                      (unsigned long long)v->reqs[keep - 1].id);
            kvb_plan_reset(out);
            keep--;
            p->st.trims++;
            KVB_TRY(trim_running(p, v, keep, out));
        }
    }

    kvb_fcfs_opts o = {.batch_limit = b, .preempt_op = p->kind == ETW_SWAP ? KVB_OP_SWAP_OUT : KVB_OP_PREEMPT};
    return kvb_sched_fcfs(v, &o, out);
}

static kvb_status etw_plan_pool(void *ctx, const kvb_pool_event *ev, const kvb_view *v, kvb_pool_plan *out) {
    etw *p = ctx;
    if (ev->kind != KVB_POOL_SETUP) return KVB_OK;
    out->measure_flops = 1; /* the cost model's prior */
    if (p->kind == ETW_ELLM) out->extra_rows = (int)p->rows;
    if (p->kind == ETW_SWAP || p->swap_layers)
        out->host_tier_blocks = (int)(p->host_blocks > 0 ? p->host_blocks : v->pool.capacity);
    if (p->async) KVB_TRY(solver_start(p));
    return KVB_OK;
}

static void etw_observe(void *ctx, const kvb_step_report *r) {
    etw *p = ctx;
    if (!p->ready || !p->last_valid || r->t_step_ns <= r->t_plan_ns) return;
    double t = (double)(r->t_step_ns - r->t_plan_ns) * 1e-9;
    double pred = kvb_etw_step_time(&p->rates, p->last_work);
    p->err_abs_rel_sum += fabs(pred - t) / t;
    p->st.observed++;
    kvb_etw_fit_add(&p->fit, p->last_work, t);
    kvb_etw_fit_rates(&p->fit, &p->rates);
    p->last_valid = 0;
}

static void etw_destroy(void *ctx) {
    etw *p = ctx;
    if (!p) return;
    solver_stop(p);
    free(p->s);
    free(p->u);
    free(p);
}

static const kvb_planner_i etw_iface = {
    .name = "ellm-tokenwise",
    .plan_step = etw_plan_step,
    .plan_pool = etw_plan_pool,
    .observe = etw_observe,
    .destroy = etw_destroy,
};
static const kvb_planner_i recompute_iface = {
    .name = "vllm-recompute",
    .plan_step = etw_plan_step,
    .plan_pool = etw_plan_pool,
    .observe = etw_observe,
    .destroy = etw_destroy,
};
static const kvb_planner_i swap_iface = {
    .name = "vllm-swap",
    .plan_step = etw_plan_step,
    .plan_pool = etw_plan_pool,
    .observe = etw_observe,
    .destroy = etw_destroy,
};

static const kvb_planner_i *iface_of(etw_kind k) {
    return k == ETW_ELLM ? &etw_iface : k == ETW_RECOMPUTE ? &recompute_iface : &swap_iface;
}

kvb_status kvb_etw_planner_get_stats(const kvb_planner *pl, kvb_etw_planner_stats *out) {
    if (!pl || (pl->iface != &etw_iface && pl->iface != &recompute_iface && pl->iface != &swap_iface))
        return KVB_ERR_INVALID;
    etw *p = pl->ctx;
    *out = p->st;
    if (p->sv.started) pthread_mutex_lock(&p->sv.mu);
    out->solves = p->sv.solves;
    out->solve_mean_s = p->sv.solves ? p->sv.t_sum / (double)p->sv.solves : 0;
    out->solve_max_s = p->sv.t_max;
    if (p->sv.started) pthread_mutex_unlock(&p->sv.mu);
    out->cost_mape = p->st.observed ? p->err_abs_rel_sum / (double)p->st.observed : 0;
    out->cached_ratio = p->cached_steps ? p->cached_sum / (double)p->cached_steps : 1;
    out->rates = p->rates;
    out->layer = p->layer;
    return KVB_OK;
}

static kvb_status create(etw_kind kind, const kvb_policy_params *params, kvb_planner *out) {
    const char *name = kind_names[kind];
    static const char *const known_ellm[] = {"slo_ms", "r_max", "r", "b_max", "F", "chunk", "rows", "async",
                                             "swap", "host_blocks", "threads", NULL};
    static const char *const known_base[] = {"slo_ms", "b_max", "chunk", "async", "host_blocks", NULL};
    KVB_TRY(kvb_policy_params_check(params, name, kind == ETW_ELLM ? known_ellm : known_base));
    etw *p = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *p, (void **)&p));
    *p = (etw){.kind = kind, .slo_ms = 0, .r_max = 0.9, .r_fixed = -1, .b_bound = 512, .F = 4, .chunk = 256,
               .rows = 8192, .async = 1, .threads = 1};
    int64_t async = 1, swap = 0;
    kvb_status st = KVB_OK;
#define P(x) \
    if (st == KVB_OK) st = (x)
    P(kvb_policy_param_f64(params, name, "slo_ms", 0, 1e7, &p->slo_ms));
    P(kvb_policy_param_f64(params, name, "r_max", 0, 1, &p->r_max));
    P(kvb_policy_param_f64(params, name, "r", 0, 1, &p->r_fixed));
    P(kvb_policy_param_i64(params, name, "b_max", 1, 1 << 20, &p->b_bound));
    P(kvb_policy_param_i64(params, name, "F", 1, 256, &p->F));
    P(kvb_policy_param_i64(params, name, "chunk", 1, 1 << 20, &p->chunk));
    P(kvb_policy_param_i64(params, name, "rows", 0, 1 << 24, &p->rows));
    P(kvb_policy_param_i64(params, name, "async", 0, 1, &async));
    P(kvb_policy_param_i64(params, name, "swap", 0, 1, &swap));
    P(kvb_policy_param_i64(params, name, "host_blocks", 0, 1 << 30, &p->host_blocks));
    P(kvb_policy_param_i64(params, name, "threads", 1, 1 << 16, &p->threads));
#undef P
    if (st != KVB_OK) {
        free(p);
        return st;
    }
    p->async = (int)async;
    p->swap_layers = (int)swap;
    if (p->r_fixed >= 0 && p->r_fixed > p->r_max) p->r_max = p->r_fixed;
    *out = (kvb_planner){.iface = iface_of(kind), .ctx = p};
    return KVB_OK;
}

kvb_status kvb_policy_ellm_tokenwise_create(const kvb_policy_params *params, kvb_planner *out) {
    return create(ETW_ELLM, params, out);
}
kvb_status kvb_policy_vllm_recompute_create(const kvb_policy_params *params, kvb_planner *out) {
    return create(ETW_RECOMPUTE, params, out);
}
kvb_status kvb_policy_vllm_swap_create(const kvb_policy_params *params, kvb_planner *out) {
    return create(ETW_SWAP, params, out);
}
