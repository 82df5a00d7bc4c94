/* kvbank — the sliced pool's manager as its two files share it: slices.c carries placements out,
 * slices_check.c reads and checks them (the plan check). */
#ifndef KVB_SCHED_SLICED_H
#define KVB_SCHED_SLICED_H

#include "common/sched/state.h"

#define SL_WORDS (KVB_MAX_LAYERS / 64)

typedef struct sl_mask {
    uint64_t w[SL_WORDS];
} sl_mask;

static inline int mask_has(const sl_mask *m, int l) { return (int)((m->w[l >> 6] >> (l & 63)) & 1u); }
static inline int mask_any(const sl_mask *m) {
    for (int i = 0; i < SL_WORDS; i++)
        if (m->w[i]) return 1;
    return 0;
}

/* Transfer pieces the stager borrows (see px_reserve). */
typedef struct px_list {
    kvb_xfer *x;
    int n, cap;
    int posted; /* pieces of it were posted and not yet waited for */
} px_list;

#define LAUNCHED (1ull << 63) /* s_ticket: the layer's load was posted (the rest is its ticket, 0: none) */

struct kvb__slices {
    int L, bs;
    int n_ids;
    int min_layers;
    size_t layer_bytes, row_bytes, half_bytes, block_bytes;
    unsigned char *host;  /* [n_ids][L][layer_bytes] */
    uint16_t *fill;       /* [n_ids] */
    uint16_t *host_rows;  /* [n_ids * L] */
    uint8_t *want;        /* [n_ids * L] during a step (0 outside the touched ids) */
    uint8_t *touched;     /* [n_ids] */
    int32_t *tlist;       /* [n_ids] the touched ids */
    int n_touched;
    /* the plan's placements by view index */
    sl_mask *vmask;       /* [vcap] host layers */
    int *vdepth;          /* [vcap] */
    int vcap;
    /* the step's prefetch slices, by position in e->step.sched */
    int32_t *scratch;     /* slices */
    int n_scratch, cap_scratch;
    int *s_first;         /* [max_seqs] first scratch index of sched[i] */
    int *s_per;           /* [max_seqs] slices per slot (0: no host layer read) */
    int32_t *entry_scratch; /* [blk_cap] the scratch slice a layer_blocks entry reads, -1: in place */
    int entry_cap;
    uint64_t *s_ticket;   /* [max_seqs][L] per sequence and host layer: LAUNCHED | its load's ticket */
    uint64_t *onload_t;   /* [L] the install's loads due before each layer (0: none) */
    px_list ev, on, step; /* pieces: moves off the device, moves onto it, the step's prefetches and stores */
    int32_t *mv_id;       /* [mv_cap] (block, layer) pairs of one move */
    int *mv_layer;
    int mv_cap;
    kvb_slices_stats st;
    pthread_mutex_t mu;   /* the plan check's scratch (want, vmask, vdepth): a planner's thread may check */
};

/* slices_check.c: reads p->places into vmask / vdepth by view index, refusing bad ones. */
kvb_status kvb__slices_read_places(kvb__slices *sl, const kvb_view *v, const kvb_plan *p, char *err, size_t len);
/* Forgets the wanted layers. */
void kvb__slices_want_clear(kvb__slices *sl);
/* Marks the layers a holder of ids[0..n) with host layers `m` keeps. */
void kvb__slices_want_mark(kvb__slices *sl, const int32_t *ids, int n, const sl_mask *m);
/* Prefetch slices a request with host layers `m` and `depth` slots needs for blocks ids[0..n) plus n_new
 * new blocks: on the device as wanted, or (installed) as resident now. */
int64_t kvb__slices_scratch_need(const kvb__slices *sl, const kvb_block_pool *pool, const int32_t *ids, int n,
                                 int64_t n_new, const sl_mask *m, int depth, int installed);
/* The mechanism's check hooks (mech.h). */
kvb_status kvb__slices_check_op(void *ctx, const kvb_engine *e, kvb_acct *a, const kvb_plan_op *op, int k, char *err,
                                size_t len);
kvb_status kvb__slices_check_plan(void *ctx, const kvb_engine *e, kvb_acct *a, const kvb_plan *p, char *err,
                                  size_t len);

#endif
