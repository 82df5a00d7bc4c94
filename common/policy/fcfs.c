/* kvbank — vLLM's FCFS scheduling (fcfs.h) on the plan check's accounting. */
#include "common/policy/fcfs.h"

#include <limits.h>

/* Appends `op` to the plan, accounting it (the routines only build plans the check accepts). */
static kvb_status push(kvb_acct *a, kvb_plan *p, kvb_plan_op op) {
    char err[256];
    kvb_status st = kvb_acct_op(a, &op, p->n_ops, err, sizeof err);
    if (st == KVB_ERR_INVALID) {
        KVB_LOG_E("scheduler: internal accounting error: %s", err);
        return st;
    }
    KVB_TRY(st);
    return kvb_plan_push_op(p, op);
}

static kvb_status fcfs_running(kvb_acct *a, const kvb_fcfs_opts *o, kvb_plan *p) {
    const kvb_view *v = a->v;
    int *cand = NULL;
    kvb_status st = KVB_OK;
    if (v->n_running > 0) KVB_TRY(kvb_malloc((size_t)v->n_running * sizeof *cand, (void **)&cand));
    for (int i = 0; i < v->n_running && a->budget - a->tokens > 0 && a->n_sched < a->batch_limit; i++) {
        if (a->state[i] != KVB_REQ_RUNNING || (a->sched[i] & KVB_ACCT_SCHEDULED)) continue;
        const kvb_req_view *r = &v->reqs[i];
        int q = KVB_MIN(r->n_tokens - r->n_computed, a->budget - a->tokens);
        for (;;) {
            if (kvb_acct_run_need(a, i, q) <= a->avail) {
                int absent = a->dropped[i] * v->geom->block_size; /* dropped blocks are recomputed */
                st = push(a, p, (kvb_plan_op){.kind = KVB_OP_RUN, .id = r->id, .q_len = q, .n_absent = absent});
                break;
            }
            /* candidates: this request and the running ones after it that are not scheduled */
            int n = 0;
            for (int j = i; j < v->n_running; j++)
                if ((a->state[j] == KVB_REQ_RUNNING || a->state[j] == KVB_REQ_PAUSED) && !a->sched[j]) cand[n++] = j;
            int vi = n - 1;
            if (o && o->pick_victim) {
                vi = o->pick_victim(o->ud, v, cand, n);
                if (vi < 0 || vi >= n) vi = n - 1;
            }
            int victim = cand[vi];
            kvb_op_kind kind = KVB_OP_PREEMPT;
            if (o && o->preempt_op == KVB_OP_SWAP_OUT && a->host_left >= v->reqs[victim].n_blocks) kind = KVB_OP_SWAP_OUT;
            st = push(a, p, (kvb_plan_op){.kind = kind, .id = v->reqs[victim].id});
            if (st != KVB_OK || victim == i) break;
        }
        if (st != KVB_OK) break;
    }
    free(cand);
    return st;
}

/* First index in [k, end) whose request is waiting after the plan's operations so far, or end. */
static int next_waiting(const kvb_acct *a, int k, int end) {
    while (k < end && a->state[k] != KVB_REQ_WAITING) k++;
    return k;
}

/* Waiting requests (after the plan's operations so far) in arrival order: the requests the plan
 * preempted (among the view's running ones) merged with the view's queue; both runs are sorted. */
static kvb_status waiting_order(const kvb_acct *a, int **out, int *n_out) {
    const kvb_view *v = a->v;
    int *w = NULL, n = 0;
    *out = NULL;
    *n_out = 0;
    if (v->n_reqs == 0) return KVB_OK;
    KVB_TRY(kvb_malloc((size_t)v->n_reqs * sizeof *w, (void **)&w));
    int i = next_waiting(a, 0, v->n_running), j = next_waiting(a, v->n_running, v->n_reqs);
    while (i < v->n_running || j < v->n_reqs) {
        if (j >= v->n_reqs || (i < v->n_running && v->reqs[i].arrival < v->reqs[j].arrival)) {
            w[n++] = i;
            i = next_waiting(a, i + 1, v->n_running);
        } else {
            w[n++] = j;
            j = next_waiting(a, j + 1, v->n_reqs);
        }
    }
    *out = w;
    *n_out = n;
    return KVB_OK;
}

/* Swapped requests come back first, oldest first, each with its next tokens (vLLM: no new request is
 * admitted while one waits swapped out). Returns 1 in *blocked when one could not come back. */
static kvb_status fcfs_swap_in(kvb_acct *a, kvb_plan *p, int *blocked) {
    const kvb_view *v = a->v;
    *blocked = 0;
    for (int i = v->n_running; i < v->n_running + v->n_swapped; i++) {
        if (a->state[i] != KVB_REQ_SWAPPED) continue;
        const kvb_req_view *r = &v->reqs[i];
        int q = KVB_MIN(r->n_tokens - r->n_computed, a->budget - a->tokens);
        if (q < 1 || a->n_running >= v->max_seqs || a->n_sched >= a->batch_limit ||
            r->n_blocks + kvb_acct_run_need(a, i, q) > a->avail) {
            *blocked = 1;
            return KVB_OK;
        }
        KVB_TRY(push(a, p, (kvb_plan_op){.kind = KVB_OP_SWAP_IN, .id = r->id}));
        KVB_TRY(push(a, p, (kvb_plan_op){.kind = KVB_OP_RUN, .id = r->id, .q_len = q}));
    }
    return KVB_OK;
}

static kvb_status fcfs_admit(kvb_acct *a, kvb_plan *p) {
    const kvb_view *v = a->v;
    int blocked;
    p->starved = 0;
    KVB_TRY(fcfs_swap_in(a, p, &blocked));
    if (blocked) {
        p->starved = 1;
        return KVB_OK;
    }
    int *w, n;
    KVB_TRY(waiting_order(a, &w, &n));
    kvb_status st = KVB_OK;
    int may_pass = INT_MAX; /* admissions still allowed past the stalled requests skipped so far */
    for (int k = 0; k < n && a->budget - a->tokens > 0 && a->n_running < v->max_seqs && a->n_sched < a->batch_limit;
         k++) {
        int i = w[k];
        const kvb_req_view *r = &v->reqs[i];
        /* one that needs more blocks than the pool holds now (lent out or detached) waits until grow /
         * attach: admitted, it could only preempt itself over and over. Requests behind it that fit are
         * served meanwhile, up to v->stall_overtake of them (bounded overtaking); the engine fails it
         * after its stall wait. */
        if (!v->pool.n_slices &&
            KVB_DIV_CEIL((int64_t)r->n_prompt + r->max_tokens, v->geom->block_size) > v->pool.n_blocks) {
            p->starved = 1;
            may_pass = KVB_MIN(may_pass, v->stall_overtake - r->n_overtaken);
            if (may_pass > 0) continue;
            break;
        }
        if (may_pass <= 0) break;
        if (v->prefix_cache) {
            int defer;
            KVB_TRY_GOTO(kvb_acct_in_flight(a, i, &defer), out);
            if (defer) { /* wait a step or two and hit the cache instead */
                p->n_deferred++;
                continue;
            }
        }
        int q;
        int64_t blocks;
        KVB_TRY_GOTO(kvb_acct_admit_cost(a, i, a->budget - a->tokens, 0, &q, &blocks, NULL), out);
        if (blocks > a->avail) {
            p->starved = 1;
            break;
        }
        KVB_TRY_GOTO(push(a, p, (kvb_plan_op){.kind = KVB_OP_ADMIT, .id = r->id, .q_len = q}), out);
        if (may_pass != INT_MAX) may_pass--; /* it passed a stalled request */
    }
out:
    free(w);
    return st;
}

/* Runs the chosen phases after what `out` already holds. */
static kvb_status fcfs_phases(const kvb_view *v, const kvb_fcfs_opts *o, kvb_plan *out, int running, int admit) {
    kvb_acct a;
    KVB_TRY(kvb_acct_replay(v, out, o ? o->budget : 0, o ? o->batch_limit : 0, &a));
    kvb_status st = running ? fcfs_running(&a, o, out) : KVB_OK;
    if (st == KVB_OK && admit) st = fcfs_admit(&a, out);
    kvb_acct_end(&a);
    return st;
}

kvb_status kvb_fcfs_running(const kvb_view *v, const kvb_fcfs_opts *o, kvb_plan *out) {
    return fcfs_phases(v, o, out, 1, 0);
}

kvb_status kvb_fcfs_admit(const kvb_view *v, const kvb_fcfs_opts *o, kvb_plan *out) {
    return fcfs_phases(v, o, out, 0, 1);
}

kvb_status kvb_fcfs(const kvb_view *v, const kvb_fcfs_opts *o, kvb_plan *out) { return fcfs_phases(v, o, out, 1, 1); }
