/* kvbank — the plan check (check.h): the generic accounting of a plan's operations over the view; the
 * engine's mechanisms check what they own through the view's functions. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/sched/check.h"

kvb_status kvb_plan_refuse(char *err, size_t len, const char *fmt, ...) {
    if (err && len) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, len, fmt, ap);
        va_end(ap);
    }
    return KVB_ERR_INVALID;
}

kvb_status kvb_plan_refuse_op(char *err, size_t len, int k, const kvb_plan_op *op, const char *fmt, ...) {
    if (err && len) {
        int n = snprintf(err, len, "plan op %d (%s request %llu): ", k, kvb_op_kind_str(op->kind),
                         (unsigned long long)op->id);
        if (n >= 0 && (size_t)n < len) {
            va_list ap;
            va_start(ap, fmt);
            vsnprintf(err + n, len - (size_t)n, fmt, ap);
            va_end(ap);
        }
    }
    return KVB_ERR_INVALID;
}

/* ---------------------------------------------------------------- references the plan changes */

static uint32_t adj_slot(int32_t id, int cap) { return ((uint32_t)id * 0x9E3779B1u) & (uint32_t)(cap - 1); }

static int adj_get(const kvb_acct *a, int32_t id) {
    for (uint32_t h = adj_slot(id, a->adj_cap);; h = (h + 1) & (uint32_t)(a->adj_cap - 1)) {
        if (a->adj[h].id == id) return a->adj[h].d;
        if (a->adj[h].id < 0) return 0;
    }
}

static kvb_status adj_grow(kvb_acct *a) {
    struct kvb__adj *old = a->adj;
    int cap = a->adj_cap * 2;
    KVB_TRY(kvb_malloc((size_t)cap * sizeof *a->adj, (void **)&a->adj));
    for (int i = 0; i < cap; i++) a->adj[i] = (struct kvb__adj){-1, 0};
    for (int i = 0; i < a->adj_cap; i++) {
        if (old[i].id < 0) continue;
        uint32_t h = adj_slot(old[i].id, cap);
        while (a->adj[h].id >= 0) h = (h + 1) & (uint32_t)(cap - 1);
        a->adj[h] = old[i];
    }
    free(old);
    a->adj_cap = cap;
    return KVB_OK;
}

kvb_status kvb_acct_adj(kvb_acct *a, int32_t id, int d) {
    if (2 * (a->adj_n + 1) > a->adj_cap) KVB_TRY(adj_grow(a));
    uint32_t h = adj_slot(id, a->adj_cap);
    while (a->adj[h].id >= 0 && a->adj[h].id != id) h = (h + 1) & (uint32_t)(a->adj_cap - 1);
    if (a->adj[h].id < 0) {
        a->adj[h].id = id;
        a->adj_n++;
    }
    a->adj[h].d += d;
    return KVB_OK;
}

int kvb_acct_ref(const kvb_acct *a, int32_t id) {
    return a->v->ops->block_ref(a->v->ops_ctx, id) + adj_get(a, id);
}

/* ---------------------------------------------------------------- the accounting */

kvb_status kvb_acct_begin(const kvb_view *v, kvb_acct *a) {
    memset(a, 0, sizeof *a);
    if (!v->ops) return KVB_ERR_STATE;
    size_t n = (size_t)KVB_MAX(v->n_reqs, 1);
    unsigned char *mem = NULL;
    /* one allocation: state, n_new, dropped, sched, then the reference changes */
    size_t per_req = sizeof *a->state + sizeof *a->n_new + sizeof *a->dropped + sizeof *a->sched;
    KVB_TRY(kvb_malloc(n * per_req, (void **)&mem));
    a->n_new = (int64_t *)mem;
    a->state = (kvb_req_state *)(a->n_new + n);
    a->dropped = (int32_t *)(a->state + n);
    a->sched = (uint8_t *)(a->dropped + n);
    a->adj_cap = 64;
    kvb_status st = kvb_malloc((size_t)a->adj_cap * sizeof *a->adj, (void **)&a->adj);
    if (st != KVB_OK) {
        free(mem);
        memset(a, 0, sizeof *a);
        return st;
    }
    for (int i = 0; i < a->adj_cap; i++) a->adj[i] = (struct kvb__adj){-1, 0};
    for (int i = 0; i < v->n_reqs; i++) {
        a->state[i] = v->reqs[i].state;
        a->sched[i] = 0;
        a->dropped[i] = v->reqs[i].n_dropped;
        a->n_new[i] = 0;
    }
    /* a sliced pool counts ids here (its slices are checked by its mechanism) */
    int64_t free_blocks = v->pool.n_slices ? v->pool.n_free_ids : v->pool.n_free;
    a->v = v;
    a->avail = free_blocks + v->pool.n_evictable;
    a->n_running = v->n_running;
    a->host_left = v->pool.host_free + v->pool.host_evictable;
    a->budget = v->max_batch_tokens;
    a->batch_limit = v->max_seqs;
    return KVB_OK;
}

void kvb_acct_end(kvb_acct *a) {
    if (!a) return;
    free(a->n_new); /* the block of the per-request arrays */
    free(a->adj);
    memset(a, 0, sizeof *a);
}

kvb_status kvb_acct_hits(const kvb_acct *a, int i, kvb_view_hits *out) {
    return a->v->ops->probe(a->v->ops_ctx, i, out);
}

/* Blocks releasing request i (preempt, swap out) gives back, and the release itself. */
static kvb_status acct_release(kvb_acct *a, int i, int *freed) {
    const kvb_req_view *r = &a->v->reqs[i];
    *freed = 0;
    for (int j = 0; j < r->n_blocks; j++) {
        *freed += kvb_acct_ref(a, r->blocks[j]) == 1;
        KVB_TRY(kvb_acct_adj(a, r->blocks[j], -1));
    }
    return KVB_OK;
}

int64_t kvb_acct_run_need(const kvb_acct *a, int i, int q) {
    const kvb_req_view *r = &a->v->reqs[i];
    int64_t need = KVB_DIV_CEIL((int64_t)r->n_computed + q, a->v->geom->block_size) - r->n_blocks - r->n_dropped;
    return need > 0 ? need : 0;
}

kvb_status kvb_acct_admit_cost(kvb_acct *a, int i, int q, int take, int *q_eff, int64_t *blocks, int64_t *n_new) {
    kvb_view_hits m;
    KVB_TRY(kvb_acct_hits(a, i, &m));
    const kvb_req_view *r = &a->v->reqs[i];
    int bs = a->v->geom->block_size;
    int64_t cost = m.n_host_hit;
    for (int j = 0; j < m.n_hit; j++) {
        if (kvb_acct_ref(a, m.ids[j]) == 0) cost++;
        if (take) KVB_TRY(kvb_acct_adj(a, m.ids[j], 1));
    }
    int have = m.n_hit + m.n_host_hit, computed = have * bs;
    *q_eff = KVB_MIN(q, r->n_tokens - computed);
    int64_t need = KVB_DIV_CEIL((int64_t)computed + *q_eff, bs) - have;
    if (need < 0) need = 0;
    *blocks = cost + need;
    if (n_new) *n_new = need;
    return KVB_OK;
}

/* Idle hits of request i that admitting it would take out of the available count (no change). */
static kvb_status idle_hits(const kvb_acct *a, int i, int *out) {
    kvb_view_hits m;
    KVB_TRY(kvb_acct_hits(a, i, &m));
    *out = 0;
    for (int j = 0; j < m.n_hit; j++) *out += kvb_acct_ref(a, m.ids[j]) == 0;
    return KVB_OK;
}

/* A placed RUN, ADMIT or SWAP_IN (op->placed): the request's blocks are block0 + j. Its existing blocks
 * must be laid out so, and the `more` blocks after them must be free now and not taken by an earlier
 * operation of the plan (they are counted as taken from here on). */
static kvb_status acct_place(kvb_acct *a, int i, const kvb_plan_op *op, int64_t more, int k, char *err, size_t len) {
    const kvb_view *v = a->v;
    const kvb_req_view *r = &v->reqs[i];
    if (v->prefix_cache)
        return kvb_plan_refuse_op(err, len, k, op, "placed blocks need the prefix cache off");
    int have = op->kind == KVB_OP_RUN ? r->n_blocks : 0;
    if (op->block0 < 0 || (int64_t)op->block0 + have + more > v->pool.n_own)
        return kvb_plan_refuse_op(err, len, k, op, "blocks from %d on are outside the own pool of %d",
                                                   (int)op->block0, v->pool.n_own);
    for (int j = 0; j < have; j++) {
        /* swapped in earlier in this plan: its view lists host blocks, its pool blocks are the ones taken */
        int ok = a->sched[i] & KVB_ACCT_SWAPPED_IN ? kvb_acct_ref(a, op->block0 + j) == 1
                                                   : r->blocks[j] == op->block0 + j;
        if (!ok)
            return kvb_plan_refuse_op(err, len, k, op, "its block %d is not block %d", j, (int)(op->block0 + j));
    }
    for (int64_t j = have; j < have + more; j++) {
        int32_t b = (int32_t)(op->block0 + j);
        /* free now, or released by an earlier operation of this plan (a PREEMPT before a fetch into its slot) */
        if (kvb_acct_ref(a, b) != 0 || (adj_get(a, b) == 0 && !v->ops->block_free(v->ops_ctx, b)))
            return kvb_plan_refuse_op(err, len, k, op, "block %d is not free", (int)b);
        KVB_TRY(kvb_acct_adj(a, b, 1));
    }
    return KVB_OK;
}

/* The checks of operation k that need no resource: the request's state allows it, its lengths fit. */
static kvb_status op_valid(const kvb_acct *a, const kvb_plan_op *op, int i, int k, char *err, size_t len) {
    const kvb_view *v = a->v;
    const kvb_req_view *r = &v->reqs[i];
    kvb_req_state st = a->state[i];
    switch (op->kind) {
    case KVB_OP_RUN: {
        if (st != KVB_REQ_RUNNING)
            return kvb_plan_refuse_op(err, len, k, op, "the request is %s, not running", kvb_req_state_str(st));
        if (a->sched[i] & KVB_ACCT_SCHEDULED)
            return kvb_plan_refuse_op(err, len, k, op, "the request is already scheduled in this step");
        int left = r->n_tokens - r->n_computed;
        if (op->q_len < 1 || op->q_len > left)
            return kvb_plan_refuse_op(err, len, k, op, "q_len %d, it has %d token(s) left to compute", op->q_len, left);
        if (op->n_absent < 0 || op->n_absent > r->n_computed)
            return kvb_plan_refuse_op(err, len, k, op, "n_absent %d, it has %d computed token(s)",
                                                       op->n_absent, r->n_computed);
        int absent_min = KVB_MAX(r->n_dropped, a->dropped[i]) * v->geom->block_size;
        if (op->n_absent < absent_min)
            return kvb_plan_refuse_op(err, len, k, op, "n_absent %d, but its first %d token(s) have no KV (dropped or "
                                                       "restored in this step)", op->n_absent, absent_min);
        return KVB_OK;
    }
    case KVB_OP_ADMIT:
        if (st != KVB_REQ_WAITING)
            return kvb_plan_refuse_op(err, len, k, op, "the request is %s, not waiting", kvb_req_state_str(st));
        if (op->q_len < 1 || op->n_absent != 0)
            return kvb_plan_refuse_op(err, len, k, op, "q_len %d must be >= 1 and n_absent %d 0",
                                                       op->q_len, op->n_absent);
        return KVB_OK;
    case KVB_OP_PREEMPT:
    case KVB_OP_PAUSE:
        if (st != KVB_REQ_RUNNING && (op->kind == KVB_OP_PAUSE || st != KVB_REQ_PAUSED))
            return kvb_plan_refuse_op(err, len, k, op, "the request is %s", kvb_req_state_str(st));
        if (a->sched[i])
            return kvb_plan_refuse_op(err, len, k, op, "the request is scheduled or swapped in earlier in this step");
        return KVB_OK;
    case KVB_OP_RESUME:
        if (st != KVB_REQ_PAUSED)
            return kvb_plan_refuse_op(err, len, k, op, "the request is %s, not paused", kvb_req_state_str(st));
        return KVB_OK;
    case KVB_OP_SWAP_OUT:
        if (!v->pool.host_capacity)
            return kvb_plan_refuse_op(err, len, k, op, "the engine has no host tier (plan_pool sets host_tier_blocks)");
        if (st != KVB_REQ_RUNNING && st != KVB_REQ_PAUSED)
            return kvb_plan_refuse_op(err, len, k, op, "the request is %s", kvb_req_state_str(st));
        if (a->sched[i])
            return kvb_plan_refuse_op(err, len, k, op, "the request is scheduled or swapped in earlier in this step");
        if (r->n_blocks > a->host_left)
            return kvb_plan_refuse_op(err, len, k, op, "needs %d host-tier block(s), the host tier can give %d at "
                                                       "this point of the plan", r->n_blocks, a->host_left);
        return KVB_OK;
    case KVB_OP_SWAP_IN:
        if (st != KVB_REQ_SWAPPED)
            return kvb_plan_refuse_op(err, len, k, op, "the request is %s, not swapped", kvb_req_state_str(st));
        if (r->n_blocks > a->avail)
            return kvb_plan_refuse_op(err, len, k, op, "needs %d block(s), the pool can give %lld at this point of "
                                                       "the plan", r->n_blocks, (long long)a->avail);
        if (a->sched[i])
            return kvb_plan_refuse_op(err, len, k, op, "the request is scheduled earlier in this step");
        return KVB_OK;
    case KVB_OP_DROP: {
        if (st != KVB_REQ_RUNNING && st != KVB_REQ_PAUSED)
            return kvb_plan_refuse_op(err, len, k, op, "the request is %s", kvb_req_state_str(st));
        if (a->sched[i])
            return kvb_plan_refuse_op(err, len, k, op, "the request is scheduled, swapped in or dropped earlier in "
                                                       "this step");
        int bs = v->geom->block_size, to = op->n_dropped;
        if (to < 0 || (int64_t)to * bs > r->n_computed)
            return kvb_plan_refuse_op(err, len, k, op, "n_dropped %d, it has %d full block(s)", to, r->n_computed / bs);
        return KVB_OK;
    }
    }
    return kvb_plan_refuse(err, len, "plan op %d: unknown operation %d", k, (int)op->kind);
}

/* What operation k takes and gives: blocks, host-tier blocks, tokens, rows, the request's new state. */
static kvb_status op_account(kvb_acct *a, const kvb_plan_op *op, int i, int k, char *err, size_t len) {
    const kvb_view *v = a->v;
    const kvb_req_view *r = &v->reqs[i];
    int bs = v->geom->block_size;
    switch (op->kind) {
    case KVB_OP_RUN: {
        int64_t need = kvb_acct_run_need(a, i, op->q_len);
        if (need > a->avail)
            return kvb_plan_refuse_op(err, len, k, op, "needs %lld new block(s), the pool can give %lld at this point "
                                                       "of the plan", (long long)need, (long long)a->avail);
        if (op->placed) KVB_TRY(acct_place(a, i, op, need, k, err, len));
        a->avail -= need;
        a->n_new[i] = need;
        a->touched += r->n_blocks + need;
        a->tokens += op->q_len;
        a->rows += op->q_len + op->n_absent;
        a->n_sched++;
        a->sched[i] |= KVB_ACCT_RUN;
        return KVB_OK;
    }
    case KVB_OP_ADMIT: {
        if (op->offload) { /* its KV goes to the host tier (its mechanism took the blocks): no pool block */
            a->n_new[i] = 0;
            a->tokens += r->n_tokens;
            a->rows += r->n_tokens;
            a->n_sched++;
            a->state[i] = KVB_REQ_SWAPPED;
            a->sched[i] = KVB_ACCT_ADMIT;
            return KVB_OK;
        }
        int q;
        int64_t blocks;
        KVB_TRY(kvb_acct_admit_cost(a, i, op->q_len, 1, &q, &blocks, &a->n_new[i]));
        if (blocks > a->avail)
            return kvb_plan_refuse_op(err, len, k, op, "needs %lld block(s), the pool can give %lld at this point of "
                                                       "the plan", (long long)blocks, (long long)a->avail);
        if (op->placed) KVB_TRY(acct_place(a, i, op, blocks, k, err, len));
        a->avail -= blocks;
        a->touched += KVB_DIV_CEIL(r->n_tokens, bs);
        a->tokens += q;
        a->rows += q;
        a->n_sched++;
        a->n_running++;
        a->state[i] = KVB_REQ_RUNNING;
        a->sched[i] = KVB_ACCT_ADMIT;
        return KVB_OK;
    }
    case KVB_OP_PREEMPT:
    case KVB_OP_SWAP_OUT: {
        int freed;
        KVB_TRY(acct_release(a, i, &freed));
        a->avail += freed;
        a->n_running--;
        if (op->kind == KVB_OP_SWAP_OUT) a->host_left -= r->n_blocks;
        a->state[i] = op->kind == KVB_OP_SWAP_OUT ? KVB_REQ_SWAPPED : KVB_REQ_WAITING;
        return KVB_OK;
    }
    case KVB_OP_PAUSE: a->state[i] = KVB_REQ_PAUSED; return KVB_OK;
    case KVB_OP_RESUME: a->state[i] = KVB_REQ_RUNNING; return KVB_OK;
    case KVB_OP_SWAP_IN:
        if (op->placed) KVB_TRY(acct_place(a, i, op, r->n_blocks, k, err, len));
        a->avail -= r->n_blocks;
        a->host_left += r->n_blocks;
        a->n_running++;
        a->state[i] = KVB_REQ_RUNNING;
        a->sched[i] |= KVB_ACCT_SWAPPED_IN;
        return KVB_OK;
    case KVB_OP_DROP: {
        int cur = r->n_dropped, to = op->n_dropped;
        if (to > cur) { /* the released blocks are the first (to - cur) of its table */
            for (int j = 0; j < to - cur; j++) {
                a->avail += kvb_acct_ref(a, r->blocks[j]) == 1;
                KVB_TRY(kvb_acct_adj(a, r->blocks[j], -1));
            }
        } else if (to < cur) {
            if (cur - to > a->avail)
                return kvb_plan_refuse_op(err, len, k, op, "restoring %d block(s), the pool can give %lld at this "
                                                           "point of the plan", cur - to, (long long)a->avail);
            a->avail -= cur - to;
        }
        a->dropped[i] = to;
        a->sched[i] |= KVB_ACCT_DROPPED;
        return KVB_OK;
    }
    }
    return KVB_OK;
}

kvb_status kvb_acct_op(kvb_acct *a, const kvb_plan_op *op, int k, char *err, size_t len) {
    const kvb_view *v = a->v;
    const char *kind = kvb_op_kind_str(op->kind);
    unsigned long long id = (unsigned long long)op->id;
    int i = kvb_view_find(v, op->id);
    if (i < 0) return kvb_plan_refuse(err, len, "plan op %d (%s): no live request has id %llu", k, kind, id);
    KVB_TRY(op_valid(a, op, i, k, err, len));
    KVB_TRY(v->ops->check_op(v->ops_ctx, a, op, k, err, len));
    KVB_TRY(op_account(a, op, i, k, err, len));
    if (a->tokens > a->budget)
        return kvb_plan_refuse_op(err, len, k, op, "the plan computes %d tokens, the step budget is %d",
                                                   a->tokens, a->budget);
    if (a->rows > v->max_rows)
        return kvb_plan_refuse_op(err, len, k, op, "the plan needs %d forward rows, the step holds %d",
                                                   a->rows, v->max_rows);
    if (a->n_sched > a->batch_limit)
        return kvb_plan_refuse_op(err, len, k, op, "more than %d requests scheduled", a->batch_limit);
    return KVB_OK;
}

kvb_status kvb_sched_cost(const kvb_view *v, const kvb_plan *p, kvb_plan_cost *out, char *err, size_t err_len) {
    if (err && err_len) err[0] = 0;
    kvb_acct a;
    KVB_TRY(kvb_acct_begin(v, &a));
    kvb_status st = KVB_OK;
    if (p->batch_limit < 0 || p->batch_limit > v->max_seqs) {
        st = kvb_plan_refuse(err, err_len, "plan batch_limit %d is outside [0, max_seqs %d]",
                                           p->batch_limit, v->max_seqs);
        goto out;
    }
    if (p->batch_limit > 0) a.batch_limit = p->batch_limit;
    for (int k = 0; k < p->n_ops && st == KVB_OK; k++) st = kvb_acct_op(&a, &p->ops[k], k, err, err_len);
    if (st != KVB_OK) goto out;
    if (a.n_running > v->max_seqs) {
        st = kvb_plan_refuse(err, err_len, "the plan leaves %d requests running or paused, max_seqs is %d", a.n_running,
                             v->max_seqs);
        goto out;
    }
    for (int i = 0; i < v->n_reqs; i++)
        if (a.dropped[i] < v->reqs[i].n_dropped && !(a.sched[i] & KVB_ACCT_RUN)) {
            st = kvb_plan_refuse(err, err_len, "request %llu: a DROP restores its blocks %d..%d but no RUN of this "
                                               "plan "
                                 "fills them",
                                 (unsigned long long)v->reqs[i].id, a.dropped[i], v->reqs[i].n_dropped - 1);
            goto out;
        }
    if (p->n_places > 0 && !v->pool.n_slices) {
        st = kvb_plan_refuse(err, err_len, "%d request placement(s): the pool is not sliced (the planner asks for one "
                                           "at "
                             "setup)", p->n_places);
        goto out;
    }
    KVB_TRY_GOTO(v->ops->check_plan(v->ops_ctx, &a, p, err, err_len), out);
    if (out)
        *out = (kvb_plan_cost){.blocks_left = a.avail, .tokens = a.tokens, .rows = a.rows, .n_sched = a.n_sched,
                               .n_running = a.n_running, .host_left = a.host_left};
out:
    kvb_acct_end(&a);
    return st;
}

kvb_status kvb_acct_replay(const kvb_view *v, const kvb_plan *p, int budget, int batch_limit, kvb_acct *a) {
    KVB_TRY(kvb_acct_begin(v, a));
    if (budget > 0) a->budget = KVB_MIN(budget, v->max_batch_tokens);
    if (p->batch_limit > 0) a->batch_limit = p->batch_limit;
    if (batch_limit > 0) a->batch_limit = KVB_MIN(a->batch_limit, batch_limit);
    char err[256];
    for (int k = 0; k < p->n_ops; k++) {
        kvb_status st = kvb_acct_op(a, &p->ops[k], k, err, sizeof err);
        if (st != KVB_OK) {
            if (st == KVB_ERR_INVALID) KVB_LOG_E("scheduler: the plan so far is invalid: %s", err);
            kvb_acct_end(a);
            return st;
        }
    }
    return KVB_OK;
}

/* ---------------------------------------------------------------- prefix probes */

/* Whether `s`'s next prompt block (after `hits` full blocks, chained hash `last`) is being computed now by
 * request r (its published blocks, their hash and its computed tokens as they will be when this step
 * starts). */
static int computes_block(const kvb_req_view *r, int r_cached, uint64_t r_last, int r_computed, const kvb_req_view *s,
                          int hits, uint64_t last, int bs) {
    if (r_cached != hits || r_last != last) return 0;
    if (r->n_tokens < (hits + 1) * bs || r_computed >= (hits + 1) * bs) return 0;
    return !memcmp(r->tokens + (size_t)hits * bs, s->tokens + (size_t)hits * bs, (size_t)bs * sizeof(int32_t));
}

kvb_status kvb_acct_in_flight(kvb_acct *a, int i, int *out) {
    const kvb_view *v = a->v;
    kvb_view_hits m;
    KVB_TRY(kvb_acct_hits(a, i, &m));
    const kvb_req_view *s = &v->reqs[i];
    int bs = v->geom->block_size, b = m.n_hit + m.n_host_hit;
    *out = 0;
    if ((int64_t)(b + 1) * bs > s->n_tokens - 1) return KVB_OK; /* no full block left to match */
    for (int j = 0; j < v->n_reqs; j++) {
        if (j == i || a->state[j] != KVB_REQ_RUNNING) continue;
        const kvb_req_view *r = &v->reqs[j];
        if ((a->sched[j] & KVB_ACCT_SCHEDULED) == KVB_ACCT_ADMIT) { /* admitted by this plan: as after its hits */
            kvb_view_hits mr;
            KVB_TRY(kvb_acct_hits(a, j, &mr));
            int h = mr.n_hit + mr.n_host_hit;
            if (computes_block(r, h, mr.last_hash, h * bs, s, b, m.last_hash, bs)) *out = 1;
        } else if (r->state == KVB_REQ_RUNNING || r->state == KVB_REQ_PAUSED) {
            if (computes_block(r, r->n_cached, r->cache_hash, r->n_computed, s, b, m.last_hash, bs)) *out = 1;
        }
        if (*out) break;
    }
    return KVB_OK;
}

kvb_status kvb_sched_probe(const kvb_view *v, int req, const kvb_plan *p, kvb_prefix_probe *out) {
    if (req < 0 || req >= v->n_reqs) return KVB_ERR_INVALID;
    kvb_acct a;
    KVB_TRY(kvb_acct_replay(v, p, 0, 0, &a));
    kvb_status st = KVB_OK;
    if (a.state[req] != KVB_REQ_WAITING) {
        st = KVB_ERR_INVALID;
        goto out;
    }
    kvb_view_hits m;
    KVB_TRY_GOTO(kvb_acct_hits(&a, req, &m), out);
    *out = (kvb_prefix_probe){.n_hit = m.n_hit, .n_host_hit = m.n_host_hit};
    KVB_TRY_GOTO(idle_hits(&a, req, &out->n_hit_idle), out);
    KVB_TRY_GOTO(kvb_acct_in_flight(&a, req, &out->deferred), out);
out:
    kvb_acct_end(&a);
    return st;
}
