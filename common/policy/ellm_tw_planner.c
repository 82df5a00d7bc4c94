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
 *   hcache          HCache (Gao et al., EuroSys '25) as eLLM's §6.1 uses it: preemption-based, full KV
 *                   while running; the hidden states entering the first n_h layers of every token are
 *                   saved to host memory as they are computed, and a preempted request leaves those
 *                   layers as hidden states and the others as KV in the host tier; restoring rebuilds
 *                   the first n_h layers' KV from the hidden states (norm, K/V projections, RoPE) and
 *                   copies the rest back. n_h by HCache's state partition: the split that balances the
 *                   host-link transfer of a token (n_h hidden states + L - n_h layers of KV) against
 *                   the K/V projections of n_h layers, whichever takes longer being the restore time.
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
#include "common/policy/fcfs.h"

typedef enum etw_kind { ETW_ELLM = 0, ETW_RECOMPUTE = 1, ETW_SWAP = 2, ETW_HCACHE = 3 } etw_kind;

static const char *const kind_names[] = {"ellm-tokenwise", "vllm-recompute", "vllm-swap", "hcache"};

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
    int64_t req_host;  /* host-tier blocks of the view */
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
    double perturb_flops, perturb_bw; /* §6.6: the optimizer sees FLOPS and bandwidth times these */
    double wt_share;      /* the share of the SLO a step's prefill chunk may take (WT_max) */
    int chunk_now;        /* this step's prefill tokens (prefill_tokens) */
    int64_t b_bound, F, chunk, rows, host_blocks, threads;
    int async, swap_layers;
    int64_t n_swap_fixed; /* swap=1: prefix layers read from the host tier (parameter n_swap), -1: the layer level */
    int serial;           /* kvb_plan.prefix_serial: the §6.3 ablations (overlap=0, fuse=0) */
    int n_hidden;         /* hcache: layers restored from hidden states (the state partition) */
    int64_t hidden_fixed; /* hcache: n_hidden given (parameter hidden_layers), -1: the partition decides */
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
    uint64_t runq0;        /* this thread's CPU wait when the plan was handed over (kvb_thread_runq_ns) */
    /* statistics */
    kvb_etw_planner_stats st;
    double err_abs_rel_sum; /* Σ |predicted − measured| / measured */
    double cached_sum;      /* Σ over steps of (1 − Σu / Σs) of the decoding requests */
    uint64_t cached_steps;
    double peak_flops;      /* the machine's matmul rate (view.model->flops) */
} etw;

/* The layer level (§4.3) for the running set, or the fixed count of swapped layers (parameter n_swap). */
static void layer_level(const etw *p, const kvb_etw_dims *d, const kvb_etw_rates *rates, const int *s, const int *u,
                        int n_run, kvb_etw_layer_plan *lp) {
    kvb_etw_batch bt = {.b = n_run, .s = s, .u = u};
    kvb_etw_layer_optimize(d, rates, &p->link, &bt, (int)p->threads, KVB_ETW_DEVICE_CPU, lp);
    if (p->n_swap_fixed >= 0) {
        lp->n_swap = (int)KVB_MIN(p->n_swap_fixed, (int64_t)d->n_layers);
        lp->n_rec = d->n_layers - lp->n_swap;
    }
}

/* The layer level's answer as the request level sees it in kvbank's fused step: one layer of scratch
 * per recomputed block (units of one layer, depth 1), two with swapped layers (the loads of layer l+1
 * land in one parity while layer l reads the other); the host copies are whole host-tier blocks
 * (block-major: a released block keeps one whatever its layers) while the solver counts n_swap / L of
 * a block per released block, so its host budget is scaled by L / n_swap to make the two agree. */
static void problem_layer(const kvb_etw_layer_plan *lp, int64_t host_capacity, kvb_etw_problem *prob) {
    prob->layer = *lp;
    prob->unit_layers = 1;
    prob->layer.depth = lp->n_swap > 0 ? 2 : 1;
    prob->host_blocks = lp->n_swap > 0 ? host_capacity * prob->d->n_layers / lp->n_swap : 0;
}

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
        int64_t host = sv->req_host;
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
        if (p->swap_layers) layer_level(p, p->d.n_layers ? &p->d : prob.d, &prob.rates, s, u, n_run, &lp);
        problem_layer(&lp, host, &prob);
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
static kvb_status solver_exchange(etw *p, const kvb_etw_problem *prob, const int *u, int n_run, int64_t host,
                                  kvb_etw_solution *sol, kvb_etw_layer_plan *lp, int *have) {
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
        sv->req_host = host;
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

/* HCache's state partition: per token, n_h layers restored from hidden states move n_h·h·act bytes
 * plus (L - n_h) layers of KV over the host link, and compute n_h layers' K/V projections (2·2·h·kv_dim
 * FLOPs each); the restore takes the longer of the two (transfer and compute pipelined), and n_h
 * minimises it (ties: fewer hidden layers). */
static int hcache_partition(const etw *p, const kvb_view *v) {
    const kvb_etw_dims *d = &p->d;
    double bw = 0;
    if (v->links) bw = v->links->links[KVB_LINK_HOST].bytes_per_s;
    if (!(bw > 0)) bw = 1 / p->rates.s_byte;
    double hid = (double)d->hidden * d->act_elem, kv = kvb_etw_kv_bytes(d);
    double kv_flops = 4.0 * d->hidden * d->kv_dim + 4.0 * d->hidden; /* projections + norm */
    int best = 0;
    double best_t = INFINITY;
    for (int k = 0; k <= d->n_layers; k++) {
        double io = (k * hid + (d->n_layers - k) * kv) / bw, comp = k * kv_flops * p->rates.s_flop;
        double t = fmax(io, comp);
        if (t < best_t * (1 - 1e-12)) {
            best_t = t;
            best = k;
        }
    }
    return best;
}

/* The prior of the cost model from what the view says about the machine: the matmul rate the stager
 * measured, attention at a quarter of it, a bandwidth of 10 bytes per 30 FLOPs and 0.2 ms per step;
 * observe re-fits all four from measured steps. */
static void init_model(etw *p, const kvb_view *v) {
    const kvb_model_info *mi = v->model;
    kvb_etw_dims_from_config(mi->cfg, v->geom->elem_size, mi->act_elem, (double)mi->weight_bytes, &p->d);
    double flops = mi->flops > 0 ? mi->flops : 50e9;
    kvb_etw_rates prior = {.t_fixed = 2e-4, .s_flop = 1.0 / flops, .s_attn = 4.0 / flops, .s_byte = 3.0 / flops};
    kvb_etw_fit_init(&p->fit, &prior, 0.2, 0.99);
    p->rates = prior;
    p->link = (kvb_etw_link){0};
    if (p->swap_layers && v->links) {
        p->link.bytes_per_s = v->links->links[KVB_LINK_HOST].bytes_per_s;
        p->link.latency_s = v->links->links[KVB_LINK_HOST].latency_s;
        if (!(p->link.bytes_per_s > 0)) p->link.bytes_per_s = 1e12; /* link model off: memory speed */
    }
    p->layer = kvb_etw_layer_initial(&p->d, p->swap_layers ? &p->link : NULL);
    p->peak_flops = mi->flops;
    if (p->kind == ETW_HCACHE) p->n_hidden = p->hidden_fixed >= 0 ? (int)KVB_MIN(p->hidden_fixed, (int64_t)p->d.n_layers)
                                                                   : hcache_partition(p, v);
    p->ready = 1;
}

/* The prefill tokens a step may carry for waiting requests, and WT_max, the time they add to every
 * running request's step (the planner's definition; the paper leaves WT_max undefined). The chunk is
 * the `chunk` parameter, at most the queue's head's prompt and half the step's budget, and, with an
 * SLO, cut to what the cost model says takes at most wt_share of it (at least one block of tokens, so
 * that admissions always progress). */
static int prefill_tokens(const etw *p, const kvb_view *v, double *wt) {
    *wt = 0;
    if (!v->n_waiting || p->chunk <= 0) return 0;
    const kvb_req_view *h = &v->reqs[v->n_running + v->n_swapped];
    int c = (int)KVB_MIN(KVB_MIN(p->chunk, (int64_t)h->n_tokens), (int64_t)KVB_MAX(1, v->max_batch_tokens / 2));
    if (p->slo_ms > 0) {
        double cap = p->wt_share * p->slo_ms * 1e-3;
        int lo = KVB_MIN(c, v->geom->block_size);
        while (c > lo && kvb_etw_time(&p->rates, kvb_etw_work_prefill(&p->d, 0, c)) > cap) c = KVB_MAX(lo, c * 3 / 4);
    }
    *wt = kvb_etw_time(&p->rates, kvb_etw_work_prefill(&p->d, 0, c));
    return c;
}

/* The problem of this view: candidates in FCFS order, s_i their tokens. */
static void make_problem(etw *p, const kvb_view *v, kvb_etw_problem *prob) {
    for (int i = 0; i < v->n_reqs; i++) p->s[i] = v->reqs[i].n_tokens;
    int64_t host = 0;
    if (p->swap_layers) host = v->pool.host_capacity;
    kvb_etw_rates seen = p->rates;
    seen.s_flop /= p->perturb_flops;
    seen.s_attn /= p->perturb_flops;
    seen.s_byte /= p->perturb_bw;
    *prob = (kvb_etw_problem){
        .d = &p->d,
        .rates = seen,
        .layer = p->layer,
        .s = p->s,
        .n = v->n_reqs,
        .b_bound = (int)KVB_MIN(p->b_bound, (int64_t)v->max_seqs),
        .r_max = p->kind == ETW_ELLM ? p->r_max : 0,
        .slo_s = p->slo_ms > 0 ? p->slo_ms * 1e-3 : 1e9,
        .wt_max_s = 0, /* below */
        .block_size = v->geom->block_size,
        .unit_layers = (int)p->F,
        .mem_blocks = v->pool.n_blocks,
        .host_blocks = host,
        .max_rows = 1, /* below */
        .act_row_bytes = 0, /* the forward pass's extra rows are allocated once (plan_pool) */
    };
    double wt;
    p->chunk_now = prefill_tokens(p, v, &wt);
    if (p->slo_ms > 0) prob->wt_max_s = wt;
    prob->max_rows = KVB_MAX(1, v->max_rows - p->chunk_now);
    /* kvbank's fused step: the recomputed rows run in the decode's forward pass */
    problem_layer(&p->layer, host, prob);
}

/* ---------------------------------------------------------------- plan_step */
static int decoding(const kvb_req_view *r) { return r->n_computed >= r->n_prompt && r->n_computed == r->n_tokens - 1; }

/* Preempts (or swaps out) the newest running requests so that at most `keep` remain. */
static kvb_status trim_running(const etw *p, const kvb_view *v, int keep, kvb_plan *out) {
    for (int i = v->n_running - 1; i >= keep; i--) {
        kvb_op_kind k = KVB_OP_PREEMPT;
        int hid = 0;
        if ((p->kind == ETW_SWAP || p->kind == ETW_HCACHE) && v->pool.host_free >= v->reqs[i].n_blocks) {
            k = KVB_OP_SWAP_OUT;
            if (p->kind == ETW_HCACHE) hid = KVB_MIN(p->n_hidden, v->reqs[i].hidden_layers);
        }
        KVB_TRY(kvb_plan_push_op(out, (kvb_plan_op){.kind = k, .id = v->reqs[i].id, .n_hidden = hid}));
    }
    return KVB_OK;
}

/* The work of the planned step by the cost model (observe fits it to the measured time), and the
 * cached ratio of its decoding requests. */
static void plan_work(etw *p, const kvb_view *v, const kvb_plan *out) {
    kvb_etw_work w = kvb_etw_work_step(&p->d);
    double sum_s = 0, sum_u = 0;
    for (int k = 0; k < out->n_ops; k++) {
        const kvb_plan_op *op = &out->ops[k];
        if (op->kind != KVB_OP_RUN && op->kind != KVB_OP_ADMIT) continue;
        int j = kvb_view_find(v, op->id);
        if (j < 0) continue;
        const kvb_req_view *rq = &v->reqs[j];
        int start = op->kind == KVB_OP_RUN ? rq->n_computed : 0;
        if (op->kind == KVB_OP_RUN && op->q_len == 1 && decoding(rq)) {
            kvb_etw_work_add(&w, kvb_etw_work_decode(&p->d, rq->n_computed));
            sum_s += rq->n_computed;
            sum_u += op->n_absent;
        } else {
            kvb_etw_work_add(&w, kvb_etw_work_prefill(&p->d, start, op->q_len));
        }
        if (op->n_absent > 0) {
            /* the rows leave above the recomputed layers when the request's released blocks have copies */
            int swapl = KVB_MIN(op->n_host, rq->host_layers > 0 ? rq->host_layers : op->n_host);
            kvb_etw_work_add(&w, kvb_etw_work_recompute(&p->d, op->n_absent, p->d.n_layers - swapl));
        }
    }
    p->last_work = w;
    p->last_valid = 1;
    if (sum_s > 0) {
        p->cached_sum += 1 - sum_u / sum_s;
        p->cached_steps++;
    }
}

/* ellm-tokenwise's own part of the plan: DROP and RUN entries for the running requests at ratio r
 * (prefilling ones run their next chunk with nothing absent), then FCFS admission up to b. The step's
 * token budget is the baselines' (chunk + b): the same prefill room under the same batch bound. */
static kvb_status ellm_plan(etw *p, const kvb_view *v, int n_keep, double r, int b, kvb_plan *out) {
    const int bs = v->geom->block_size;
    int budget = (int)KVB_MIN((int64_t)v->max_batch_tokens, (int64_t)p->chunk_now + b);
    int used = 0;
    /* swapped layers (§4.3): the released blocks keep host copies of layers [n_rec, L), read each step */
    int n_host = p->swap_layers ? p->layer.n_swap : 0;
    int host_left = v->pool.host_free + v->pool.host_evictable;
    out->prefix_serial = p->serial;
    for (int i = 0; i < n_keep; i++) {
        const kvb_req_view *rq = &v->reqs[i];
        if (rq->state != KVB_REQ_RUNNING) continue;
        if (decoding(rq)) {
            int64_t u = kvb_etw_absent(r, rq->n_computed);
            int drop = (int)(u / bs), copies = 0;
            if (drop > rq->n_dropped && ((rq->n_dropped == 0 && n_host > 0) || rq->host_layers > 0)) {
                copies = drop - rq->n_dropped; /* host blocks the DROP stores into */
                if (copies > host_left) {
                    /* the host tier is full: a request with copies keeps what it holds (recomputing
                     * more rows than it released), one without starts none */
                    if (rq->host_layers > 0) drop = rq->n_dropped;
                    copies = 0;
                }
            }
            host_left -= copies;
            if (drop != rq->n_dropped)
                KVB_TRY(kvb_plan_push_op(out, (kvb_plan_op){.kind = KVB_OP_DROP, .id = rq->id, .n_dropped = drop,
                                                            .n_host = copies > 0 ? n_host : 0}));
            /* a restore (fewer dropped blocks) recomputes the restored blocks into them this step */
            int absent = (int)KVB_MAX(u, (int64_t)rq->n_dropped * bs);
            KVB_TRY(kvb_plan_push_op(out, (kvb_plan_op){.kind = KVB_OP_RUN, .id = rq->id, .q_len = 1, .n_absent = absent,
                                                        .n_host = n_host}));
            used++;
        } else {
            int q = KVB_MIN(rq->n_tokens - rq->n_computed, budget - used);
            if (q < 1) continue;
            KVB_TRY(kvb_plan_push_op(out, (kvb_plan_op){.kind = KVB_OP_RUN, .id = rq->id, .q_len = q,
                                                        .n_absent = rq->n_dropped * bs}));
            used += q;
        }
    }
    /* the running part must fit before admissions are added (else the caller preempts and retries) */
    kvb_plan_cost cost;
    kvb_status cst = kvb_sched_cost(v, out, &cost, NULL, 0);
    if (cst == KVB_ERR_INVALID) return KVB_ERR_EXHAUSTED;
    KVB_TRY(cst);
    kvb_fcfs_opts o = {.budget = budget, .batch_limit = b};
    return kvb_fcfs_admit(v, &o, out);
}

static kvb_status plan_step_inner(etw *p, const kvb_view *v, kvb_plan *out);

static kvb_status etw_plan_step(void *ctx, const kvb_view *v, kvb_plan *out) {
    etw *p = ctx;
    kvb_status st = plan_step_inner(p, v, out);
    p->runq0 = kvb_thread_runq_ns();
    return st;
}

static kvb_status plan_step_inner(etw *p, const kvb_view *v, kvb_plan *out) {
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
        KVB_TRY(solver_exchange(p, &prob, p->u, v->n_running, p->swap_layers ? v->pool.host_capacity : 0, &sol, &lp,
                                &have));
    } else {
        double t0 = kvb_now_s();
        if (p->swap_layers) {
            layer_level(p, &p->d, &prob.rates, p->s, p->u, v->n_running, &lp);
            problem_layer(&lp, v->pool.host_capacity, &prob);
        }
        KVB_TRY(kvb_etw_solve(&prob, &sol));
        double dt = kvb_now_s() - t0;
        p->sv.t_sum += dt;
        p->sv.t_max = fmax(p->sv.t_max, dt);
        p->sv.solves++;
        have = 1;
    }
    if (have) p->layer = lp;

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
        /* the running set that stays must fit at r: raise r where the step stays within the SLO (10%
         * slack) and Eq. 5 does not prefer fewer requests, else keep fewer (the newest are preempted) */
        double best_obj = INFINITY;
        int best_keep = 0;
        double best_r = r;
        for (int k2 = keep; k2 > 0; k2--) {
            double rk = kvb_etw_min_ratio(&prob, k2);
            if (rk < 0) continue;
            if (rk <= r && best_keep == 0) { /* fits at r as it is: keep it, as the baselines would */
                best_keep = k2;
                best_r = r;
                break;
            }
            rk = fmax(r, rk);
            double t = kvb_etw_exact_time(&prob, k2, rk);
            if (t + prob.wt_max_s > 1.1 * prob.slo_s) continue;
            if (t / k2 < best_obj) {
                best_obj = t / k2;
                best_keep = k2;
                best_r = rk;
            }
            if (rk <= r) break; /* fewer requests only lower r further: no better objective below */
        }
        if (best_keep > 0) {
            keep = best_keep;
            r = best_r;
        } else {
            for (; keep > 0 && kvb_etw_min_ratio(&prob, keep) < 0; keep--) {}
            if (keep > 0) r = fmax(r, kvb_etw_min_ratio(&prob, keep));
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
            if ((st != KVB_ERR_INVALID && st != KVB_ERR_EXHAUSTED) || keep == 0) {
                if (st == KVB_OK) plan_work(p, v, out);
                return st;
            }
            KVB_LOG_D("%s: plan refused (%s); preempting request %llu", kind_names[p->kind], err,
                      (unsigned long long)v->reqs[keep - 1].id);
            kvb_plan_reset(out);
            keep--;
            p->st.trims++;
            KVB_TRY(trim_running(p, v, keep, out));
        }
    }

    kvb_fcfs_opts o = {.batch_limit = b, .preempt_op = p->kind == ETW_RECOMPUTE ? KVB_OP_PREEMPT : KVB_OP_SWAP_OUT,
                       .budget = (int)KVB_MIN((int64_t)v->max_batch_tokens, (int64_t)p->chunk_now + b)};
    KVB_TRY(kvb_fcfs(v, &o, out));
    if (p->kind == ETW_HCACHE)
        for (int k = 0; k < out->n_ops; k++) {
            kvb_plan_op *op = &out->ops[k];
            if (op->kind == KVB_OP_RUN || op->kind == KVB_OP_ADMIT) op->n_hidden = p->n_hidden;
            if (op->kind == KVB_OP_SWAP_OUT) {
                int j = kvb_view_find(v, op->id);
                op->n_hidden = j >= 0 ? KVB_MIN(p->n_hidden, v->reqs[j].hidden_layers) : 0;
            }
        }
    plan_work(p, v, out);
    return KVB_OK;
}

static kvb_status etw_plan_pool(void *ctx, const kvb_pool_event *ev, const kvb_view *v, kvb_pool_plan *out) {
    etw *p = ctx;
    if (ev->kind != KVB_POOL_SETUP) return KVB_OK;
    out->measure_flops = 1; /* the cost model's prior */
    if (p->kind == ETW_ELLM) out->extra_rows = (int)p->rows;
    if (p->kind == ETW_SWAP || p->kind == ETW_HCACHE || p->swap_layers)
        out->host_tier_blocks = (int)(p->host_blocks > 0 ? p->host_blocks : v->pool.capacity);
    if (p->async) KVB_TRY(solver_start(p));
    return KVB_OK;
}

static void etw_observe(void *ctx, const kvb_step_report *r) {
    etw *p = ctx;
    if (!p->ready || !p->last_valid || r->t_step_ns <= r->t_plan_ns) return;
    /* the step's execution, less the time this thread waited for a CPU (others' load on a shared
     * machine is not what the cost model predicts) */
    uint64_t exec = r->t_step_ns - r->t_plan_ns, waited = kvb_thread_runq_ns() - p->runq0;
    double t = (double)(waited < exec ? exec - waited : exec) * 1e-9;
    double pred = kvb_etw_step_time(&p->rates, p->last_work);
    p->err_abs_rel_sum += fabs(pred - t) / t;
    p->st.observed++;
    p->st.work_flops += p->last_work.flops + p->last_work.attn;
    p->st.work_seconds += t;
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

static const kvb_planner_i hcache_iface = {
    .name = "hcache",
    .plan_step = etw_plan_step,
    .plan_pool = etw_plan_pool,
    .observe = etw_observe,
    .destroy = etw_destroy,
};

static const kvb_planner_i *iface_of(etw_kind k) {
    return k == ETW_ELLM ? &etw_iface : k == ETW_RECOMPUTE ? &recompute_iface : k == ETW_SWAP ? &swap_iface : &hcache_iface;
}

kvb_status kvb_etw_planner_get_stats(const kvb_planner *pl, kvb_etw_planner_stats *out) {
    if (!pl || (pl->iface != &etw_iface && pl->iface != &recompute_iface && pl->iface != &swap_iface &&
                pl->iface != &hcache_iface))
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
    out->peak_flops = p->peak_flops;
    out->n_hidden = p->n_hidden;
    return KVB_OK;
}

static kvb_status create(etw_kind kind, const kvb_policy_params *params, kvb_planner *out) {
    const char *name = kind_names[kind];
    static const char *const known_ellm[] = {"slo_ms", "r_max", "r", "b_max", "F", "chunk", "rows", "async",
                                             "swap", "host_blocks", "threads", "perturb_flops", "perturb_bw",
                                             "wt_share", "n_swap", "overlap", "fuse", NULL};
    static const char *const known_base[] = {"slo_ms", "b_max", "chunk", "async", "host_blocks", "perturb_flops",
                                             "perturb_bw", "wt_share", NULL};
    static const char *const known_hcache[] = {"slo_ms", "b_max", "chunk", "async", "host_blocks", "perturb_flops",
                                               "perturb_bw", "wt_share", "hidden_layers", NULL};
    KVB_TRY(kvb_policy_params_check(params, name, kind == ETW_ELLM     ? known_ellm
                                                   : kind == ETW_HCACHE ? known_hcache
                                                                        : known_base));
    etw *p = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *p, (void **)&p));
    *p = (etw){.kind = kind, .slo_ms = 0, .r_max = 0.9, .r_fixed = -1, .b_bound = 512, .F = 4, .chunk = 256,
               .rows = 1024, .async = 1, .threads = 1, .perturb_flops = 1, .perturb_bw = 1, .wt_share = 0.5, .hidden_fixed = -1,
               .n_swap_fixed = -1};
    int64_t async = 1, swap = 0, overlap = 1, fuse = 1;
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
    P(kvb_policy_param_f64(params, name, "perturb_flops", 0.1, 10, &p->perturb_flops));
    P(kvb_policy_param_f64(params, name, "perturb_bw", 0.1, 10, &p->perturb_bw));
    P(kvb_policy_param_f64(params, name, "wt_share", 0.05, 0.95, &p->wt_share));
    P(kvb_policy_param_i64(params, name, "hidden_layers", 0, 1 << 16, &p->hidden_fixed));
    P(kvb_policy_param_i64(params, name, "n_swap", 0, 1 << 16, &p->n_swap_fixed));
    P(kvb_policy_param_i64(params, name, "overlap", 0, 1, &overlap));
    P(kvb_policy_param_i64(params, name, "fuse", 0, 1, &fuse));
#undef P
    if (st == KVB_OK && p->n_swap_fixed >= 0 && !swap) {
        KVB_LOG_E("policy %s: n_swap=%lld needs swap=1 (swapped prefix layers)", name, (long long)p->n_swap_fixed);
        st = KVB_ERR_INVALID;
    }
    if (st != KVB_OK) {
        free(p);
        return st;
    }
    p->async = (int)async;
    p->swap_layers = (int)swap;
    p->serial = (overlap ? 0 : KVB_PLAN_SERIAL_LOADS) | (fuse ? 0 : KVB_PLAN_SERIAL_GEMMS);
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
kvb_status kvb_policy_hcache_create(const kvb_policy_params *params, kvb_planner *out) {
    return create(ETW_HCACHE, params, out);
}
