/* kvbank — an executor mechanism (internal to common/sched): one way a step keeps or moves KV, as a module
 * that owns its state and its per-request tables, behind one table of hooks (shaped like kvb_backend_i).
 *
 * The executor carries a plan out in phases and calls the hooks of every mechanism the engine set up, in
 * the order of kvb__mech_id:
 *
 *   plan check  check_op (each operation, after the generic checks of its request's state), check_plan
 *   applying    apply_op (RUN, ADMIT once the request has its blocks; DROP before its table changes)
 *   the step    step_begin (the batch is laid out) -> per layer l: layer_in(l), the layer's kernels,
 *               layer_out(l) -> step_end (the layer loop is over, ok or not) -> step_done (it succeeded;
 *               requests advance next)
 *   requests    view_req (what the planner's view shows of a request), seq_release (a request's KV, or
 *               the request, goes), block_free (a pool block loses its last reference)
 *
 * Copies go through the stager and complete by ticket. A mechanism that loads what layer l reads posts
 * the load early (step_begin, or layer_out of an earlier layer) and waits for its ticket in layer_in(l);
 * one that stores what layer l wrote posts in layer_out(l). What the executor does around the hooks is
 * asked for by the flags step_begin returns, so a data path that completes copies by events (a layer's
 * kernels waiting on the events of the copies it reads) or a write-back that completes after the step
 * changes the mechanism, not the loop. */
#ifndef KVB_SCHED_MECH_H
#define KVB_SCHED_MECH_H

#include "common/sched/stager.h"

struct kvb_engine;
struct kvb__seq;
struct kvb_acct;

/* The mechanisms, in the order their hooks run. */
typedef enum kvb__mech_id {
    KVB__MECH_SLICES = 0,     /* the sliced pool: request-level placements, per-layer slices (slices.c) */
    KVB__MECH_HOST_TIER = 1,  /* the host tier's prefix hits loaded layer by layer, its write-back ahead of
                               * eviction (host_tier.c) */
    KVB__MECH_PREFIX = 2,     /* host copies of released prefix blocks, read instead of recomputed (prefix.c) */
    KVB__MECH_OFFLOAD = 3,    /* offloaded admissions: KV to the host tier as it is computed (offload.c) */
    KVB__MECH_RESIDENCY = 4,  /* residency exceptions through stage buffers, host copies, copy orders (residency.c) */
    KVB__MECH_HCACHE = 5,     /* HCache: saved hidden states that rebuild KV at swap-in (hcache.c) */
    KVB__MECH_COUNT = 6,
} kvb__mech_id;

/* What step_begin asks of the executor for this step. */
enum {
    KVB__STEP_ACTIVE = 1u << 0, /* call layer_in / layer_out in this step */
    KVB__STEP_SYNC = 1u << 1,   /* layer_out reads or reuses what layer l's kernels used: the backend is idle
                                 * before it runs */
    KVB__STEP_DRAIN = 1u << 2,  /* every transfer it posted has landed when the layer loop ends */
    KVB__STEP_LAYOUT = 1u << 3, /* its layer_in points every entry of the step at its slice for the layer
                                 * (the executor's pool-block pointers are not made) */
};

/* Why seq_release runs. */
typedef enum kvb__release {
    KVB__RELEASE_KV = 0,  /* the request keeps living without KV (preempted; recomputed from its tokens) */
    KVB__RELEASE_SEQ = 1, /* the request is freed */
} kvb__release;

/* Every member but name may be NULL. `ctx` is the mechanism's own state (kvb__mech.ctx). */
typedef struct kvb__mech_i {
    const char *name;
    /* Checks operation k's fields the mechanism owns against the accounting so far (a), after the generic
     * checks; may take what the operation costs it (host-tier blocks) from the accounting. Runs on the
     * planner's thread as well (kvb_sched_cost): reads the engine, writes nothing but `a`. KVB_ERR_INVALID
     * with a sentence in err. */
    kvb_status (*check_op)(void *ctx, const struct kvb_engine *e, struct kvb_acct *a, const kvb_plan_op *op, int k,
                           char *err, size_t len);
    /* Checks the plan's parts the mechanism owns once every operation was accounted (same rules). */
    kvb_status (*check_plan)(void *ctx, const struct kvb_engine *e, struct kvb_acct *a, const kvb_plan *p, char *err,
                             size_t len);
    /* Applies the fields of `op` it owns to request s. A failure fails the step. */
    kvb_status (*apply_op)(void *ctx, struct kvb_engine *e, struct kvb__seq *s, const kvb_plan_op *op);
    /* The step's batch is laid out (e->step): reserve, post the first transfers; *flags gets KVB__STEP_*. */
    kvb_status (*step_begin)(void *ctx, struct kvb_engine *e, unsigned *flags);
    /* Before layer l (ACTIVE): wait for what the layer reads (kvb_stager_wait_device: on the device where
     * the backend can; the executor settles those waits at the step's end), point entries at it, save its
     * inputs. */
    kvb_status (*layer_in)(void *ctx, struct kvb_engine *e, int l);
    /* After layer l's kernels (ACTIVE): post the stores of what it wrote and the loads of later layers. */
    kvb_status (*layer_out)(void *ctx, struct kvb_engine *e, int l);
    /* After the layer loop and the drain, whether the step succeeded (ok) or not; also after a step that
     * failed before its layer loop (step_begin may not have run): buffers back, the step's state reset. */
    void (*step_end)(void *ctx, struct kvb_engine *e, int ok);
    /* The step's logits are out: per-request bookkeeping before the requests advance (e->step.sched). */
    void (*step_done)(void *ctx, struct kvb_engine *e);
    /* The request's fields the mechanism owns in the planner's view. */
    void (*view_req)(void *ctx, const struct kvb_engine *e, const struct kvb__seq *s, kvb_req_view *r);
    /* Releases what the mechanism holds for request s (s->mx[its id]). */
    void (*seq_release)(void *ctx, struct kvb_engine *e, struct kvb__seq *s, kvb__release why);
    /* Pool block `id` loses its last reference (before the pool takes it back). */
    void (*block_free)(void *ctx, struct kvb_engine *e, int32_t id);
    /* Frees ctx (the engine's memory and stager are still there). */
    void (*destroy)(void *ctx, struct kvb_engine *e);
} kvb__mech_i;

typedef struct kvb__mech {
    const kvb__mech_i *iface; /* NULL: not set up in this engine */
    void *ctx;
    unsigned step;            /* this step's KVB__STEP_* flags */
} kvb__mech;

/* Transfer pieces a mechanism posts during a step: reserved once before anything is posted, since the
 * stager borrows the pieces until they are waited for. */
typedef struct kvb__xlist {
    kvb_xfer *x; /* [cap] */
    int n, cap;
} kvb__xlist;

/* Empties the list with room for n pieces. KVB_ERR_NOMEM. */
static inline kvb_status kvb__xlist_reserve(kvb__xlist *l, int n) {
    l->n = 0;
    if (n <= l->cap) return KVB_OK;
    KVB_TRY(kvb_realloc_array((void **)&l->x, (size_t)n, sizeof *l->x));
    l->cap = n;
    return KVB_OK;
}

static inline kvb_xfer *kvb__xlist_add(kvb__xlist *l) { return &l->x[l->n++]; }

#endif
