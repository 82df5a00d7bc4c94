/* kvbank — CUDA token sampling on the device: greedy argmax, temperature, top-k and top-p, with the
 * same semantics as the CPU sampler (common/sched/sampling.c, its twin):
 *   temperature <= 0: argmax, lowest id on ties;
 *   else p_i = exp((l_i - max) / T); with top-k and/or top-p the candidates are ordered by descending
 *   p (ties by ascending id), top-k keeps the first k, top-p then keeps the shortest prefix whose mass
 *   reaches top_p times the kept mass; the token is the first candidate in that order (in id order
 *   when neither filter is on) whose running mass exceeds u times the kept mass.
 * The uniform draw u comes from the caller (the request's kvb_rng), so a seed reproduces a token on
 * either backend. Masses are summed in 64-bit fixed point (2^-44 units): integer sums make the result
 * independent of the summation order, hence deterministic; they differ from the CPU's double sums by
 * at most vocab * 2^-44, which can only matter when u falls within that distance of a boundary. */
#ifndef KVB_KERNELS_CUDA_SAMPLING_H
#define KVB_KERNELS_CUDA_SAMPLING_H

#include "kernels/cuda/launch.h"

KVB_CUDA_EXTERN_C_BEGIN

/* Per-row sampling parameters (a kvb_sampling plus the row's uniform draw). */
typedef struct kvb_cuda_sample_params {
    float temperature; /* <= 0: greedy */
    int32_t top_k;     /* 0 or >= vocab: off */
    float top_p;       /* <= 0 or >= 1: off */
    double u;          /* uniform in [0, 1), drawn by the caller (kvb_rng_uniform) */
} kvb_cuda_sample_params;

/* out[r] = argmax_i logits[r][i] for r < rows (lowest id on ties).
 *   logits: [rows][vocab] of `dt`;  out: [rows] int32, device memory */
int kvb_cuda_argmax(const void *logits, kvb_dtype dt, int rows, int vocab, int32_t *out, kvb_cuda_stream_t s);

/* out[r] = the token sampled from logits[r] with params[r] (device array of rows), as described
 * above. One CUDA block per row; the row is read about 20 times (from L2 for a 128K vocabulary). */
int kvb_cuda_sample(const void *logits, kvb_dtype dt, int rows, int vocab, const kvb_cuda_sample_params *params,
                    int32_t *out, kvb_cuda_stream_t s);

KVB_CUDA_EXTERN_C_END

#endif
