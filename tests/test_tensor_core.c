/* Tensor-core primitives (kernels/cuda/mma.cuh) through the kernels of kernels/cuda/mma_check.cu.
 *
 * On a GPU this pins the fragment layouts mma.cuh states from the PTX ISA: mma.m16n8k16 with fragments
 * loaded by hand (integer inputs: the product is exact, so every element must be equal), every ldmatrix
 * variant against the element each lane must receive, and a cp.async double-buffered GEMM (ldmatrix
 * for A, plain and .trans for B) against a scalar GEMM in double with a tolerance (the tensor core's
 * accumulation order is not IEEE round-per-add). In the host emulation (kernels/cuda/emu) the same
 * tests check the emulation, and `missing_wait_poisons` checks that a GEMM whose cp.async is never
 * waited for reads poison (NaN) instead of data, so a kernel that forgets a wait fails its tests there.
 *
 * Without a GPU (or without CUDA in the build) the program prints "SKIP: ..." and exits 77. */
#include "config.h"

#include <math.h>
#include <string.h>

#include "common/mem/mem.h"
#include "kernels/backend.h"
#include "tests/harness.h"

#ifdef KVB_WITH_CUDA
#include "kernels/cuda/backend_cuda.h"
#include "kernels/cuda/mma_check.h"

static uint64_t rng_state;
static uint32_t urand(void) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng_state >> 33);
}

static uint16_t to_bits(float x, kvb_dtype dt) { return dt == KVB_DTYPE_F16 ? kvb_f32_to_f16(x) : kvb_f32_to_bf16(x); }
static float from_bits(uint16_t h, kvb_dtype dt) { return dt == KVB_DTYPE_F16 ? kvb_f16_to_f32(h) : kvb_bf16_to_f32(h); }

static kvb_backend *make(void) {
    kvb_backend *be = NULL;
    ck_assert_int_eq(kvb_backend_create("cuda", 1, &be), KVB_OK);
    return be;
}

static void *dev_copy(kvb_backend *be, const void *h, size_t bytes) {
    void *d = NULL;
    ck_assert_int_eq(kvb_mem_alloc(be->mem, bytes, &d), KVB_OK);
    ck_assert_int_eq(be->iface->to_device(be->ctx, d, h, bytes), KVB_OK);
    return d;
}

static const kvb_dtype DTS[] = {KVB_DTYPE_BF16, KVB_DTYPE_F16};

KVB_TEST(mma_fragments) {
    rng_state = 31;
    kvb_backend *be = make();
    kvb_cuda_stream_t s = kvb_cuda_backend_stream(be);
    for (int di = 0; di < 2; di++) {
        kvb_dtype dt = DTS[di];
        for (int rep = 0; rep < 4; rep++) {
            /* small integers: every product and sum is exact in f32, so D must equal A B + C exactly */
            uint16_t a[16 * 16], b[16 * 8];
            float fa[16 * 16], fb[16 * 8], c[16 * 8], d[16 * 8];
            for (int i = 0; i < 16 * 16; i++) a[i] = to_bits(fa[i] = (float)((int)(urand() % 17) - 8), dt);
            for (int i = 0; i < 16 * 8; i++) b[i] = to_bits(fb[i] = (float)((int)(urand() % 17) - 8), dt);
            for (int i = 0; i < 16 * 8; i++) c[i] = (float)((int)(urand() % 201) - 100);
            void *da = dev_copy(be, a, sizeof a), *db = dev_copy(be, b, sizeof b), *dc = dev_copy(be, c, sizeof c);
            void *dd = dev_copy(be, c, sizeof c);
            ck_assert_int_eq(KVB_CUDA_CHECK(kvb_cuda_mma_check_fragments(dt, da, db, dc, dd, s)), KVB_OK);
            ck_assert_int_eq(be->iface->to_host(be->ctx, d, dd, sizeof d), KVB_OK);
            for (int r = 0; r < 16; r++)
                for (int n = 0; n < 8; n++) {
                    float want = c[r * 8 + n];
                    for (int k = 0; k < 16; k++) want += fa[r * 16 + k] * fb[k * 8 + n];
                    ck_assert_msg(d[r * 8 + n] == want, "%s mma.m16n8k16: D[%d][%d] = %g, A B + C = %g",
                                  kvb_dtype_name(dt), r, n, d[r * 8 + n], want);
                }
            void *bufs[] = {da, db, dc, dd};
            for (int i = 0; i < 4; i++) kvb_mem_free(be->mem, bufs[i]);
        }
    }
    kvb_backend_destroy(be);
}
KVB_TEST_END

KVB_TEST(ldmatrix_layouts) {
    kvb_backend *be = make();
    kvb_cuda_stream_t s = kvb_cuda_backend_stream(be);
    uint16_t m[32][8];
    for (int r = 0; r < 32; r++)
        for (int c = 0; c < 8; c++) m[r][c] = (uint16_t)(0x100 * r + c + 1); /* every element distinct */
    uint32_t out[6][32][4];
    void *dm = dev_copy(be, m, sizeof m), *dout = NULL;
    ck_assert_int_eq(kvb_mem_alloc(be->mem, sizeof out, &dout), KVB_OK);
    ck_assert_int_eq(KVB_CUDA_CHECK(kvb_cuda_mma_check_ldmatrix(dm, dout, s)), KVB_OK);
    ck_assert_int_eq(be->iface->to_host(be->ctx, out, dout, sizeof out), KVB_OK);
    static const char *names[6] = {"x1", "x2", "x4", "x1.trans", "x2.trans", "x4.trans"};
    static const int regs[6] = {1, 2, 4, 1, 2, 4};
    for (int v = 0; v < 6; v++) {
        int trans = v >= 3;
        for (int l = 0; l < 32; l++)
            for (int i = 0; i < 4; i++) {
                uint32_t want = 0;
                if (i < regs[v]) {
                    /* register i: matrix i (rows 8i..8i+7); non-trans row l/4, elements 2(l%4), +1;
                     * trans column l/4, rows 2(l%4), +1 */
                    uint16_t lo, hi;
                    if (!trans) {
                        lo = m[8 * i + l / 4][2 * (l % 4)];
                        hi = m[8 * i + l / 4][2 * (l % 4) + 1];
                    } else {
                        lo = m[8 * i + 2 * (l % 4)][l / 4];
                        hi = m[8 * i + 2 * (l % 4) + 1][l / 4];
                    }
                    want = (uint32_t)lo | ((uint32_t)hi << 16);
                }
                ck_assert_msg(out[v][l][i] == want, "ldmatrix %s: lane %d register %d = 0x%08x, expected 0x%08x",
                              names[v], l, i, out[v][l][i], want);
            }
    }
    kvb_mem_free(be->mem, dm);
    kvb_mem_free(be->mem, dout);
    kvb_backend_destroy(be);
}
KVB_TEST_END

/* c = a b^T (b [n][k]) or a b (b [k][n]) through the cp.async + ldmatrix + mma GEMM; returns the
 * normalized error against double (NaN when the result holds one). */
static double gemm_error(kvb_backend *be, kvb_dtype dt, int m, int n, int k, int b_kn, int skip_wait) {
    kvb_cuda_stream_t s = kvb_cuda_backend_stream(be);
    uint16_t *a = malloc(sizeof *a * m * k), *b = malloc(sizeof *b * n * k);
    float *c = malloc(sizeof *c * m * n);
    ck_assert(a && b && c);
    for (int i = 0; i < m * k; i++) a[i] = to_bits((float)(urand() % 2001) / 1000.0f - 1.0f, dt);
    for (int i = 0; i < n * k; i++) b[i] = to_bits((float)(urand() % 2001) / 1000.0f - 1.0f, dt);
    void *da = dev_copy(be, a, sizeof *a * m * k), *db = dev_copy(be, b, sizeof *b * n * k), *dc = NULL;
    ck_assert_int_eq(kvb_mem_alloc(be->mem, sizeof *c * m * n, &dc), KVB_OK);
    ck_assert_int_eq(KVB_CUDA_CHECK(kvb_cuda_mma_check_gemm(dt, da, db, dc, m, n, k, b_kn, skip_wait, s)), KVB_OK);
    ck_assert_int_eq(be->iface->to_host(be->ctx, c, dc, sizeof *c * m * n), KVB_OK);
    double num = 0, den = 0;
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double want = 0;
            for (int l = 0; l < k; l++) {
                uint16_t bv = b_kn ? b[(size_t)l * n + j] : b[(size_t)j * k + l];
                want += (double)from_bits(a[(size_t)i * k + l], dt) * from_bits(bv, dt);
            }
            double got = c[(size_t)i * n + j];
            if (isnan(got)) num = NAN;
            num += (got - want) * (got - want);
            den += want * want;
        }
    kvb_mem_free(be->mem, da);
    kvb_mem_free(be->mem, db);
    kvb_mem_free(be->mem, dc);
    free(a);
    free(b);
    free(c);
    return sqrt(num / den);
}

KVB_TEST(cp_async_gemm) {
    rng_state = 32;
    kvb_backend *be = make();
    int shapes[][3] = {{64, 64, 32}, {128, 192, 96}, {64, 128, 256}};
    for (int di = 0; di < 2; di++)
        for (size_t si = 0; si < KVB_ARRAY_LEN(shapes); si++)
            for (int b_kn = 0; b_kn <= 1; b_kn++) {
                int m = shapes[si][0], n = shapes[si][1], k = shapes[si][2];
                double e = gemm_error(be, DTS[di], m, n, k, b_kn, 0);
                /* bf16 operands are exact products in f32; a layout error gives an error of order 1 */
                ck_assert_msg(e <= 1e-4, "%s gemm %dx%dx%d (b %s): normalized error %.3g", kvb_dtype_name(DTS[di]), m, n,
                              k, b_kn ? "[k][n], ldmatrix.trans" : "[n][k]", e);
            }
    kvb_backend_destroy(be);
}
KVB_TEST_END

#ifdef KVB_CUDA_EMU
/* The emulation's cp.async: data reaches shared memory only at the wait that completes its group. */
KVB_TEST(missing_wait_poisons) {
    rng_state = 33;
    kvb_backend *be = make();
    for (int di = 0; di < 2; di++) {
        double e = gemm_error(be, DTS[di], 64, 64, 64, 0, 1);
        ck_assert_msg(isnan(e), "%s: a GEMM that never waits for its cp.async gave finite results (error %.3g)",
                      kvb_dtype_name(DTS[di]), e);
    }
    kvb_backend_destroy(be);
}
KVB_TEST_END
#endif

static int probe(char *why, size_t len) { return kvb_mem_probe("cuda", 0, why, len); }

int main(int argc, char **argv) {
    const kvb_test table[] = {
        KVB_T(mma_fragments, 60),
        KVB_T(ldmatrix_layouts, 60),
        KVB_T(cp_async_gemm, 120),
#ifdef KVB_CUDA_EMU
        KVB_T(missing_wait_poisons, 60),
#endif
    };
    int skip = kvb_test_need_device(argc, argv, probe);
    if (skip >= 0) return skip;
    return kvb_test_main(argc, argv, "tensor_core", table, (int)KVB_ARRAY_LEN(table));
}

#else /* !KVB_WITH_CUDA */

int main(void) {
    printf("SKIP: the CUDA backend is not compiled into this build (%s)\n", kvb_backend_list());
    return 77;
}

#endif
