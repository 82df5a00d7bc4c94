/* kvbank — plans as plain data: growing their arrays, copying them, naming their enums. */
#include "common/sched/plan.h"

#include <string.h>

const char *kvb_req_state_str(kvb_req_state s) {
    switch (s) {
    case KVB_REQ_WAITING: return "waiting";
    case KVB_REQ_RUNNING: return "running";
    case KVB_REQ_PAUSED: return "paused";
    case KVB_REQ_SWAPPED: return "swapped";
    }
    return "?";
}

const char *kvb_op_kind_str(kvb_op_kind k) {
    switch (k) {
    case KVB_OP_RUN: return "RUN";
    case KVB_OP_ADMIT: return "ADMIT";
    case KVB_OP_PREEMPT: return "PREEMPT";
    case KVB_OP_SWAP_OUT: return "SWAP_OUT";
    case KVB_OP_SWAP_IN: return "SWAP_IN";
    case KVB_OP_PAUSE: return "PAUSE";
    case KVB_OP_RESUME: return "RESUME";
    case KVB_OP_DROP: return "DROP";
    }
    return "?";
}

const char *kvb_residency_str(kvb_residency r) {
    switch (r) {
    case KVB_RES_LOCAL: return "LOCAL";
    case KVB_RES_LENT: return "LENT";
    case KVB_RES_STREAM: return "STREAM";
    case KVB_RES_HOST: return "HOST";
    case KVB_RES_ABSENT: return "ABSENT";
    }
    return "?";
}

const char *kvb_link_kind_str(kvb_link_kind k) {
    switch (k) {
    case KVB_LINK_HOST: return "host";
    case KVB_LINK_PEER: return "peer";
    case KVB_LINK_LOCAL: return "local";
    case KVB_LINK_COUNT: break;
    }
    return "?";
}

void kvb_plan_reset(kvb_plan *p) {
    p->n_ops = p->n_res = p->n_copies = p->n_places = 0;
    p->batch_limit = 0;
    p->lent_default = KVB_RES_LENT;
    p->prefix_serial = 0;
    p->starved = 0;
    p->n_deferred = 0;
}

/* Makes room for one more element of `size` bytes in *arr (n used, *cap allocated). */
static kvb_status grow(void **arr, int n, int *cap, size_t size) {
    if (n < *cap) return KVB_OK;
    int c = *cap ? 2 * *cap : 16;
    KVB_TRY(kvb_realloc_array(arr, (size_t)c, size));
    *cap = c;
    return KVB_OK;
}

kvb_status kvb_plan_push_op(kvb_plan *p, kvb_plan_op op) {
    KVB_TRY(grow((void **)&p->ops, p->n_ops, &p->cap_ops, sizeof op));
    p->ops[p->n_ops++] = op;
    return KVB_OK;
}

kvb_status kvb_plan_push_res(kvb_plan *p, kvb_plan_res r) {
    KVB_TRY(grow((void **)&p->res, p->n_res, &p->cap_res, sizeof r));
    p->res[p->n_res++] = r;
    return KVB_OK;
}

kvb_status kvb_plan_push_copy(kvb_plan *p, kvb_plan_copy c) {
    KVB_TRY(grow((void **)&p->copies, p->n_copies, &p->cap_copies, sizeof c));
    p->copies[p->n_copies++] = c;
    return KVB_OK;
}

kvb_status kvb_plan_push_place(kvb_plan *p, kvb_plan_place pl) {
    KVB_TRY(grow((void **)&p->places, p->n_places, &p->cap_places, sizeof pl));
    p->places[p->n_places++] = pl;
    return KVB_OK;
}

kvb_status kvb_plan_copy_from(kvb_plan *dst, const kvb_plan *src) {
    kvb_plan_reset(dst);
    kvb_status st = KVB_OK;
    for (int i = 0; i < src->n_ops && st == KVB_OK; i++) st = kvb_plan_push_op(dst, src->ops[i]);
    for (int i = 0; i < src->n_res && st == KVB_OK; i++) st = kvb_plan_push_res(dst, src->res[i]);
    for (int i = 0; i < src->n_copies && st == KVB_OK; i++) st = kvb_plan_push_copy(dst, src->copies[i]);
    for (int i = 0; i < src->n_places && st == KVB_OK; i++) st = kvb_plan_push_place(dst, src->places[i]);
    if (st != KVB_OK) {
        kvb_plan_reset(dst);
        return st;
    }
    dst->batch_limit = src->batch_limit;
    dst->lent_default = src->lent_default;
    dst->prefix_serial = src->prefix_serial;
    dst->starved = src->starved;
    dst->n_deferred = src->n_deferred;
    return KVB_OK;
}

void kvb_plan_free(kvb_plan *p) {
    if (!p) return;
    free(p->ops);
    free(p->res);
    free(p->copies);
    free(p->places);
    memset(p, 0, sizeof *p);
}

void kvb_planner_destroy(kvb_planner *p) {
    if (!p) return;
    if (p->iface && p->iface->destroy) p->iface->destroy(p->ctx);
    p->iface = NULL;
    p->ctx = NULL;
}

uint32_t kvb_view_hash(uint64_t id) { return (uint32_t)((id * 0x9E3779B97F4A7C15ull) >> 32); }

int kvb_view_find(const kvb_view *v, uint64_t id) {
    if (!v->index) return -1;
    for (uint32_t h = kvb_view_hash(id) & v->index_mask;; h = (h + 1) & v->index_mask) {
        int i = v->index[h];
        if (i < 0) return -1;
        if (v->reqs[i].id == id) return i;
    }
}
