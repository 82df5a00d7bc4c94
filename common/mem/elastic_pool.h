/* kvbank — eLLM's unified physical pool (ellm-elastic-memory.txt §4.2.2, §4.3.1): P_T physical chunks
 * created once, shared by the KV cache and the activations, each labelled with its owner.
 *
 * A chunk is a handle of its own that outlives any mapping: it can be mapped at any chunk index of any
 * reservation (a virtual address range of whole chunks), and moving it between a KV slot and an
 * activation segment is a remap, never a copy. The pool keeps, for every chunk, its owner (KV or
 * activations) and where it is mapped; for every reservation, which chunk sits at each index. It
 * makes the virtual-memory calls through `kvb_vm_ops` (a real backend over common/mem/mem.h, or a
 * recording one in tests) and counts them.
 *
 * Accounting (checked by kvb_epool_check): mapped(KV) + mapped(act) + free = P_T, where free chunks
 * are unmapped and sit on their owner's free list; owned(KV) + owned(act) = P_T; no chunk is mapped at
 * two places, and no place holds two chunks. Ownership changes only for free chunks (transfer) or as
 * part of a move (a mapped chunk remapped to a place of the other owner).
 *
 * Not thread-safe: the planner of one model calls it between steps. */
#ifndef KVB_MEM_ELASTIC_POOL_H
#define KVB_MEM_ELASTIC_POOL_H

#include <stddef.h>
#include <stdint.h>

#include "common/util/util.h"

typedef enum kvb_epool_owner {
    KVB_EPOOL_KV = 0,  /* the KV eTensor pool (slots) */
    KVB_EPOOL_ACT = 1, /* the activation eTensor pool (segments) */
} kvb_epool_owner;

/* The virtual-memory calls. `res` ids are the pool's (dense, reused after release); `idx` is a chunk
 * index inside the reservation. Every call may fail with a kvb_status; the pool then leaves its
 * books as they were before the call. */
typedef struct kvb_vm_ops {
    /* Reserves address space for `n_chunks` chunks under id `res`; *base is its start address. */
    kvb_status (*reserve)(void *ctx, int32_t res, int n_chunks, uintptr_t *base);
    /* Gives the address space of `res` back (every chunk of it is unmapped or its unmap is queued). */
    void (*release)(void *ctx, int32_t res);
    /* Maps physical chunk `chunk` at index `idx` of `res`. The place holds no chunk in the pool's
     * books; an unmap of it still pending behind a fence is the implementation's to complete first. */
    kvb_status (*map)(void *ctx, int32_t res, int idx, int32_t chunk);
    /* Unmaps the chunk at index `idx` of `res` (the range stays reserved). The implementation may
     * defer the call until no kernel can read the place any more (a fence ticket); the chunk itself
     * may be mapped elsewhere at once (one chunk at two addresses, §5.1 asynchronous unmapping). */
    kvb_status (*unmap)(void *ctx, int32_t res, int idx);
    void *ctx;
} kvb_vm_ops;

typedef struct kvb_epool kvb_epool;

/* Creates the books of `n_chunks` chunks (>= 1) of `chunk_bytes` (> 0) each: the first `n_act`
 * (0..n_chunks) owned by the activations, the rest by the KV cache, all free. `ops` is copied; its ctx
 * is borrowed for the pool's lifetime. Caller owns the result. */
kvb_status kvb_epool_create(int n_chunks, size_t chunk_bytes, int n_act, const kvb_vm_ops *ops, kvb_epool **out);
/* Unmaps every mapped chunk and releases every reservation still held. NULL-safe. */
void kvb_epool_destroy(kvb_epool *p);

int kvb_epool_n_chunks(const kvb_epool *p);                        /* P_T */
size_t kvb_epool_chunk_bytes(const kvb_epool *p);
int kvb_epool_n_owned(const kvb_epool *p, kvb_epool_owner o);      /* chunks labelled `o` */
int kvb_epool_n_free(const kvb_epool *p, kvb_epool_owner o);       /* of those, unmapped */
int kvb_epool_n_mapped(const kvb_epool *p, kvb_epool_owner o);     /* of those, mapped somewhere */

/* ---------------------------------------------------------------- reservations */

/* Reserves `n_chunks` (>= 1) chunks of address space. Caller releases it with kvb_epool_release. */
kvb_status kvb_epool_reserve(kvb_epool *p, int n_chunks, int32_t *res);
/* Unmaps what is still mapped there (chunks go back to their owners' free lists) and releases. */
void kvb_epool_release(kvb_epool *p, int32_t res);
uintptr_t kvb_epool_base(const kvb_epool *p, int32_t res);
int kvb_epool_res_chunks(const kvb_epool *p, int32_t res);
/* The chunk mapped at index `idx` of `res`, -1 if none. */
int32_t kvb_epool_chunk_at(const kvb_epool *p, int32_t res, int idx);

/* ---------------------------------------------------------------- mapping */

/* Maps a free chunk of owner `o` at (res, idx), which must hold none (KVB_ERR_STATE otherwise).
 * KVB_ERR_EXHAUSTED if `o` has no free chunk. *chunk (may be NULL) is the chunk mapped. */
kvb_status kvb_epool_map_free(kvb_epool *p, kvb_epool_owner o, int32_t res, int idx, int32_t *chunk);
/* Unmaps the chunk at (res, idx) (KVB_ERR_STATE if none); it returns to its owner's free list. */
kvb_status kvb_epool_unmap(kvb_epool *p, int32_t res, int idx);
/* Moves the chunk at (from_res, from_idx) to (to_res, to_idx), owned by `o` afterwards: it is mapped
 * at the new place first and the old place is unmapped after (asynchronous unmapping, §5.1: the
 * unmap is off the critical path when the ops defer it). Ownership changes when `o` differs (the
 * GC + ownership transfer + remap of inflation/deflation, §4.3.1 steps 2-4, in one move).
 * KVB_ERR_STATE if the source holds no chunk or the destination holds one. */
kvb_status kvb_epool_move(kvb_epool *p, int32_t from_res, int from_idx, int32_t to_res, int to_idx,
                          kvb_epool_owner o);

/* ---------------------------------------------------------------- ownership */

/* Relabels `n` free chunks of `from` as `to` (no VM call). KVB_ERR_EXHAUSTED, nothing changed, if
 * `from` has fewer than `n` free chunks. */
kvb_status kvb_epool_transfer(kvb_epool *p, kvb_epool_owner from, kvb_epool_owner to, int n);

/* ---------------------------------------------------------------- counters and checks */

typedef struct kvb_epool_stats {
    uint64_t maps;          /* map calls made */
    uint64_t unmaps;        /* unmap calls made */
    uint64_t moves;         /* of those, the pairs made by kvb_epool_move */
    uint64_t to_kv;         /* chunks whose owner became KV (transfer or move): inflation */
    uint64_t to_act;        /* chunks whose owner became act: deflation */
    uint64_t reserves;      /* reserve calls */
} kvb_epool_stats;
void kvb_epool_get_stats(const kvb_epool *p, kvb_epool_stats *out);

/* Verifies the books (see the header comment). KVB_OK, or KVB_ERR_STATE with the broken rule logged.
 * O(P_T + reserved chunks). */
kvb_status kvb_epool_check(const kvb_epool *p);

#endif
