/* kvbank — CUDA paged attention (causal, GQA), reading K/V through per-layer block addresses.
 *
 * Two kernels share one batch: a sequence whose query rows per KV head (q_len * n_heads/n_kv_heads) fit
 * in KVB_CUDA_ATTN_DECODE_ROWS takes the decode kernel, every other one the prefill kernel.
 *  - prefill: one CUDA block per tile of query rows (tokens x heads of one KV group; 64 or 128 rows,
 *    kvb_cuda_attn_prefill_rows), walking the visible keys with an online softmax. bf16 and f16 with head sizes that are
 *    multiples of 8 up to 256 run FlashAttention-2 style on tensor cores (attention_tc.cu: the tile's
 *    queries in registers, K/V tiles double-buffered in shared memory by cp.async, QK^T and PV as
 *    mma.m16n8k16 with f32 accumulators, the softmax in f32); f32 (the variant that must give the CPU
 *    backend's tokens) and other head sizes take the CUDA-core kernel, keys staged in shared memory as
 *    f32. A tile's keys may be cut into splits (a short chunk over a long past: too few tiles to fill
 *    the device), each split an item of its own;
 *  - decode: one CUDA block per (sequence, KV head, split of the context). A long context is cut into
 *    splits (kvb_cuda_attn_decode_splits) so that the grid fills every multiprocessor's resident
 *    blocks in whole waves. Where the head dimension is 32/64/128/256 and a row moves in 16-byte
 *    slots, each group of lanes that holds one key row walks its own keys with its own online softmax
 *    (no barrier in the key loop), K/V streaming through a cp.async ring several stages ahead, and the
 *    groups merge at the end; other shapes take a tiled kernel with shared-memory score tiles.
 * A split writes its normalised partial output and its log-sum-exp; the last split of a group to finish
 * (an atomic counter per group, reset by that block) merges the group's partials into `out`, reading
 * them in split order: one launch per kernel, no atomics on the results, and the same bits for a given
 * plan whichever block finishes last. Everything accumulates in f32 with exp2 of log2e-prescaled
 * scores. With a sliding window each row masks the keys before its window; prefill tiles start at
 * their first row's window, decode items cover only the keys some row sees (the host picks k_begin).
 * The CPU twin is kvb__cpu_attention. */
#ifndef KVB_KERNELS_CUDA_ATTENTION_H
#define KVB_KERNELS_CUDA_ATTENTION_H

#include "kernels/cuda/launch.h"

#ifdef __cplusplus
extern "C" {
#endif
#include "kernels/backend.h" /* kvb_attn_seq */
#ifdef __cplusplus
}
#endif

KVB_CUDA_EXTERN_C_BEGIN

#define KVB_CUDA_ATTN_MAX_HEAD_DIM 256
/* Query rows (q_len x heads of one KV group) one decode block handles. */
#define KVB_CUDA_ATTN_DECODE_ROWS 8
/* Query rows per prefill tile: the CUDA-core kernel's, and the smaller of the tensor-core kernel's two
 * tiles (kvb_cuda_attn_prefill_rows); the larger is KVB_CUDA_ATTN_PREFILL_ROWS_MAX. */
#define KVB_CUDA_ATTN_PREFILL_ROWS 64
#define KVB_CUDA_ATTN_PREFILL_ROWS_MAX 128
/* Keys per inner tile of the tiled decode kernel. */
#define KVB_CUDA_ATTN_KEY_TILE 128
/* Decode blocks resident on one multiprocessor: the kernels' launch bounds (at most 128 registers a
 * thread for up to 4 rows, 8 rows at half of it) and their ~33 KiB of shared memory allow this many. */
#define KVB_CUDA_ATTN_DECODE_RESIDENT 4
/* Decode splits are a multiple of this many keys (two 16-token KV blocks; a warp's ring stages
 * cover 4-16 of them). */
#define KVB_CUDA_ATTN_DECODE_MIN_SPLIT 32

/* The splits of one row set (a decode item's rows, a prefill tile): split p's partial rows are
 * [prow + p * stride, + stride) of part_o / part_lse, stride = KVB_CUDA_ATTN_DECODE_ROWS (decode) or
 * the launch's prefill_rows (prefill). */
typedef struct kvb_cuda_attn_group {
    int32_t prow, n_parts;
} kvb_cuda_attn_group;

/* What every attention launch of one batch shares. All pointers are device memory. */
typedef struct kvb_cuda_attn_args {
    kvb_dtype dtype;          /* of q, out and the KV blocks */
    int n_heads;              /* query heads; a multiple of n_kv_heads */
    int n_kv_heads;
    int head_dim;             /* even, at most KVB_CUDA_ATTN_MAX_HEAD_DIM */
    int block_size;           /* tokens per KV block */
    float scale;              /* softmax scale, 1/sqrt(head_dim) (times YaRN's attention factor squared) */
    int window;               /* sliding window: a row with n_vis visible keys sees [n_vis - window, n_vis);
                                 0 = all of them (kvb_attn_batch.window) */
    const kvb_attn_seq *seqs; /* [n_seqs] the batch's sequences (kernels/backend.h) */
    const void *const *blocks;/* [sum of n_blocks] layer-slice address of each block entry,
                                 [2][block_size][n_kv_heads][head_dim], 16-byte aligned */
    const void *q;            /* [n_tokens][n_heads][head_dim] */
    void *out;                /* [n_tokens][n_heads][head_dim] */
    float *part_o;            /* [part rows][head_dim] normalised split outputs (kvb_cuda_attn_group) */
    float *part_lse;          /* [part rows] log2(sum exp2) of each split row */
    const kvb_cuda_attn_group *groups;       /* [groups] the split groups of the launch's items */
    int32_t *counters;        /* [groups] splits of each group finished so far; 0 between launches (the
                                 merging block resets its group's) */
    int prefill_rows;         /* query rows of a prefill item: kvb_cuda_attn_prefill_rows of the batch */
    int decode_rows;          /* most query rows (q_len x group) of any decode item of the launch: sizes
                                 the decode kernel's register tile (1..KVB_CUDA_ATTN_DECODE_ROWS) */
} kvb_cuda_attn_args;

/* A prefill tile: heads [h0, h0 + nh) of KV group kvh, nh = min(group size, rows), and the sequence's
 * query tokens [t0, t0 + rows / nh), rows = kvb_cuda_attn_args.prefill_rows, over keys [k_begin, k_end)
 * (k_end 0: every key the tile sees). part < 0: the tile's only split, writes `out`; else split `part` of `group`. */
typedef struct kvb_cuda_attn_prefill_item {
    int32_t seq, kvh, t0, h0, k_begin, k_end, part, group;
} kvb_cuda_attn_prefill_item;

/* A decode split: keys [k_begin, k_end) of sequence seq, KV group kvh, for all of its q_len x group
 * rows. part < 0: the only split, writes `out`; else split `part` of `group`. */
typedef struct kvb_cuda_attn_decode_item {
    int32_t seq, kvh, k_begin, k_end, part, group;
} kvb_cuda_attn_decode_item;

/* Whether the prefill kernel of this batch runs on tensor cores and may take key splits (bf16/f16,
 * head_dim a multiple of 8 up to 256). */
int kvb_cuda_attention_prefill_tc(kvb_dtype dt, int head_dim);
/* The query rows of a prefill item for a batch of this dtype and head size: `tile` (64 or 128) where
 * the tensor-core kernel runs, KVB_CUDA_ATTN_PREFILL_ROWS for the CUDA-core kernel; 0 for another tile. */
int kvb_cuda_attn_prefill_rows(kvb_dtype dt, int head_dim, int tile);

/* How many splits to cut the keys of each decode (sequence, KV head) pair into, for a launch of n_pairs
 * pairs whose longest key range is n_keys, decode_rows rows a pair at most, on n_sm multiprocessors:
 * at least enough for one wave of resident blocks (n_sm * KVB_CUDA_ATTN_DECODE_RESIDENT, fewer for 8
 * rows), then the count up to 4x that whose whole waves of blocks times keys a block is least (a
 * partial last wave costs as much as a full one: 640 blocks on 528 slots take two block times), the
 * smaller count on a tie (fewer partials to merge); never splits shorter than
 * kvb_cuda_attn_decode_min_split (a small context gets fewer blocks than the wave; where that caps the
 * count, counts down to half of it are tried too). A pair's split is
 * then kvb_cuda_attn_decode_split_len(its keys, splits). Host code; the same plan in the emulation. */
int kvb_cuda_attn_decode_splits(kvb_dtype dt, int head_dim, int decode_rows, int n_sm, size_t n_pairs, int n_keys);
/* The fewest keys a decode split gets: two turns of the key-group kernel's cp.async ring (its 4 stages
 * of 2 keys a lane group: 128 keys at head size 128 in bf16, 256 at 64), KVB_CUDA_ATTN_DECODE_MIN_SPLIT
 * for the tiled kernel. */
int kvb_cuda_attn_decode_min_split(kvb_dtype dt, int head_dim);
/* Keys per split of a range of n_keys cut into about `splits`: a multiple of
 * KVB_CUDA_ATTN_DECODE_MIN_SPLIT. */
int kvb_cuda_attn_decode_split_len(int n_keys, int splits);

/* Each launcher runs its items (device arrays of n_items) on stream s. */
int kvb_cuda_attention_prefill(const kvb_cuda_attn_args *a, const kvb_cuda_attn_prefill_item *items, int n_items,
                               kvb_cuda_stream_t s);
int kvb_cuda_attention_decode(const kvb_cuda_attn_args *a, const kvb_cuda_attn_decode_item *items, int n_items,
                              kvb_cuda_stream_t s);

KVB_CUDA_EXTERN_C_END

#endif
