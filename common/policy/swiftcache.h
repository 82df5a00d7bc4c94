/* kvbank — SwiftCache's sizing and scaling rules (../shared/papers/swiftcache.txt §3.2, §3.4, §3.5).
 * Pure functions over geometries and counts; the coordinator, the worker and `kvbankctl plan` use them. */
#ifndef KVB_POLICY_SWIFTCACHE_H
#define KVB_POLICY_SWIFTCACHE_H

#include <stdint.h>

#include "common/util/util.h"
#include "kernels/backend.h"

/* Minimum elastic unit of a (master, worker) pair, §3.4 Eq. 6-9. The paper aligns on elements of a
 * block (BE = L * B * H_kv * D_kv); kvbank aligns on bytes of a block (2 * BE * elem_size), which is
 * the same unit when both models store KV in the same dtype and also right when they do not. */
typedef struct kvb_meu {
    uint64_t lcm_bytes;   /* Eq. 8: lcm of the two block sizes */
    uint32_t meu_master;  /* Eq. 9: master blocks per unit */
    uint32_t meu_worker;  /* Eq. 9: worker blocks per unit */
} kvb_meu;

/* KVB_ERR_INVALID for a bad geometry; KVB_ERR_UNSUPPORTED when the unit would exceed `max_bytes`
 * (geometries so unlike that the smallest aligned loan is larger than the worker's memory). */
kvb_status kvb_swift_meu(const kvb_kv_geom *master, const kvb_kv_geom *worker, uint64_t max_bytes, kvb_meu *out);

/* Alg. 1 SCALEUP: a worker holding n_i blocks of b_i tokens gets a request of request_len tokens.
 * Returns in *d_worker / *d_master the blocks the worker takes back / the master gives up (multiples of
 * the MEUs; 0 when the worker already has enough). */
void kvb_swift_scale_up(int64_t n_i, int b_i, uint32_t meu_i, uint32_t meu_m, int64_t request_len, int64_t *d_worker,
                        int64_t *d_master);
/* Alg. 1 SCALEDOWN: the longest request of the last window had max_len tokens. Returns the blocks the
 * worker can lend / the master gains. */
void kvb_swift_scale_down(int64_t n_i, int b_i, uint32_t meu_i, uint32_t meu_m, int64_t max_len, int64_t *d_worker,
                          int64_t *d_master);

/* The sliding window of Alg. 1 line 22: the longest request seen in the last `window_s` seconds. */
typedef struct kvb_swift_window {
    double window_s;
    double *t;      /* ring of (time, length) samples, kept as a monotonic deque: lengths decrease */
    int64_t *len;
    int cap, head, n;
} kvb_swift_window;

/* `cap` is the initial capacity; the window grows as needed (it holds at most the samples of one window). */
kvb_status kvb_swift_window_init(kvb_swift_window *w, double window_s, int cap);
void kvb_swift_window_free(kvb_swift_window *w);
/* Records a request of `len` tokens at time `now` (seconds, monotonic). */
void kvb_swift_window_add(kvb_swift_window *w, double now, int64_t len);
/* Longest request in (now - window_s, now]; 0 if none. */
int64_t kvb_swift_window_max(kvb_swift_window *w, double now);

/* §3.2 Eq. 1-5: layer stream cache and regular cache of the master. */
typedef struct kvb_swift_plan {
    uint64_t m_block;          /* Eq. 1: bytes of one master block of one layer */
    int64_t k_workers;         /* sum over workers of Eq. 2: master full-layer blocks their memory holds */
    int64_t k_master;          /* Eq. 3: single-layer master blocks in the master's own memory */
    int64_t n_lsc;             /* Eq. 4: LSC blocks */
    int64_t n_rc;              /* Eq. 5: RC full-layer blocks */
    int64_t max_ctx_tokens;    /* (N_LSC + N_RC) * B: the paper's longest context */
    int64_t no_lending_tokens; /* floor(K_master / L) * B: without lending */
    int64_t inplace_tokens;    /* kvbank when lent blocks are addressable in place: (floor(K_master / L) + K) * B */
    /* kvbank's LSC streams a lent block through two single-layer buffers (layer l+2 loads into layer l's
     * after its store), so within the same budget: */
    int64_t n_stream;          /* lent blocks streamed at once: min(K, floor((K_master - L) / 2)), >= 0 (one
                                * full-layer block stays the pool's); 0 when L <= 2 (streaming a block would
                                * cost the pool 2/L >= 1 of its own blocks: no gain) */
    int64_t lsc_own_blocks;    /* full-layer master blocks the LSC takes: ceil(2 * n_stream / L) */
    int64_t n_rc_stream;       /* the regular cache left: floor(K_master / L) - lsc_own_blocks */
    int64_t stream_tokens;     /* (n_stream + n_rc_stream) * B: the longest context in stream mode */
} kvb_swift_plan;

/* c_master: KV bytes of the master; c_workers[n]: KV bytes each worker can lend. */
kvb_status kvb_swift_plan_lsc(const kvb_kv_geom *master, uint64_t c_master, const uint64_t *c_workers, int n,
                              kvb_swift_plan *out);

#endif
