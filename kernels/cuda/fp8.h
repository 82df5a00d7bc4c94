/* kvbank — FP8 weights on the CUDA backend (compressed-tensors float-quantized checkpoints,
 * common/model/quant.h; docs/weights.md).
 *
 * A weight is E4M3 bytes [rows][cols] with f32 scales (one per output row, or one for the tensor) in
 * device memory. Its products y[n][rows] = x[n][cols] . (w * scale)^T (+ beta y), x and y of the
 * backend's activation dtype:
 *  - weight-only (KVB_ACT_NONE): the E4M3 bytes are widened to f32 inside the product (a GEMV kernel for
 *    decode rows, a tiled one above), x as it is;
 *  - W8A8 (KVB_ACT_FP8_TOKEN): x is first quantized per token on the device exactly as the CPU backend
 *    does it (s = max|x| / 448, the f32 epsilon when 0; x / s clamped to +-448 and rounded to E4M3, ties to
 *    even), then above KVB_CUDA_GEMV_MAX_ROWS rows the product runs on the tensor cores through cuBLASLt
 *    (E4M3 A and B, the weight's and the tokens' scales as outer-vector scale modes, output in the
 *    activation dtype; with scales = 1 and a scaling epilogue where that mode has no algorithm), and at
 *    decode sizes, or where cuBLASLt offers no FP8 algorithm, in the same kernels as weight-only.
 * CPU twin: kvb__cpu_matmul (kernels/cpu/matmul.c) with the same quantization. cuBLASLt is opened with
 * dlopen on first use, like cuBLAS (backend_cuda.c), so a process that never runs an FP8 product never
 * maps it. */
#ifndef KVB_KERNELS_CUDA_FP8_H
#define KVB_KERNELS_CUDA_FP8_H

#include "kernels/cuda/launch.h"

KVB_CUDA_EXTERN_C_BEGIN

#include "kernels/backend.h" /* kvb_tensor, kvb_fp8_weight */

/* One backend's FP8 state: the quantized activations' buffers, cuBLASLt's handle and workspace. */
typedef struct kvb_cuda_fp8 kvb_cuda_fp8;

/* Creates the state (nothing is allocated on the device yet). Caller owns it; destroy is NULL-safe and
 * waits for nothing: the caller synchronises its stream first. */
kvb_status kvb_cuda_fp8_create(kvb_cuda_fp8 **out);
void kvb_cuda_fp8_destroy(kvb_cuda_fp8 *f);

/* Copies the FP8 weight `src` (host bytes and scales) into device memory on stream `s` and waits for the
 * copies: dst->data [rows][cols] E4M3, dst->scale [n_scale] f32 (both freed with cudaFree), view 0. */
kvb_status kvb_cuda_fp8_upload(const kvb_fp8_weight *src, kvb_cuda_stream_t s, kvb_tensor *dst);

/* y[n][rows] = x[n][cols] . (w * scale)^T + beta * y (beta 0 or 1), x and y of `dt` (f32, f16, bf16),
 * w an FP8 tensor from kvb_cuda_fp8_upload, x quantized first when w->act says so; enqueued on `s`. */
kvb_status kvb_cuda_fp8_matmul(kvb_cuda_fp8 *f, kvb_cuda_stream_t s, kvb_dtype dt, const void *x, int n,
                               const kvb_tensor *w, float beta, void *y);

/* The launchers behind it (tests run them alone). q[n][cols] E4M3 bytes and qs[n] f32 from x[n][cols] of
 * `dt`, per token as above. */
int kvb_cuda_fp8_quant_tokens(const void *x, kvb_dtype dt, int n, int cols, uint8_t *q, float *qs,
                              kvb_cuda_stream_t s);
/* y = x . (w * wscale)^T [* xscale] + beta * y by widening in the product: x either of `dt` (xq NULL) or
 * E4M3 bytes xq with per-row scales xscale; wscale[r * scale_step] (step 0: one scale). cols a multiple
 * of 16 and w 16-byte aligned. */
int kvb_cuda_fp8_gemm(const uint8_t *w, const float *wscale, int scale_step, const void *x, const uint8_t *xq,
                      const float *xscale, void *y, kvb_dtype dt, int rows, int cols, int n, float beta,
                      kvb_cuda_stream_t s);

KVB_CUDA_EXTERN_C_END

#endif
