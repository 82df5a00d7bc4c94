/* FP8 weights on the CUDA backend (kernels/cuda/fp8.h) against the CPU backend, its twin: the per-token
 * quantization of activations gives the CPU's bytes and scales exactly, and the products (weight-only and
 * W8A8, a scale per row or per tensor, decode rows on the GEMV kernel, more on the tiled kernel or cuBLASLt's
 * tensor cores, beta 0 and 1) agree within the backend consistency test's normalized errors (f32 1e-5,
 * f16 5e-3, bf16 2e-2), on inputs already representable in the backend's dtype.
 *
 * Without a GPU (or CUDA in the build) it prints "SKIP: ..." and exits 77. It runs under the host
 * emulation too (kernels/cuda/emu/build.sh), where the W8A8 products above 8 rows take the widening
 * kernels instead of cuBLASLt. */
#include "config.h"

#include <math.h>
#include <string.h>

#include "common/mem/mem.h"
#include "kernels/backend.h"
#include "tests/harness.h"

#ifdef KVB_WITH_CUDA
#include "kernels/cpu/ops.h"
#include "kernels/cuda/backend_cuda.h"
#include "kernels/cuda/fp8.h"

static uint64_t rng_state;
static float frand(void) { /* uniform in [-1, 1) */
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng_state >> 40) / (double)(1ull << 24)) * 2.0f - 1.0f;
}

static float round_dt(float x, kvb_dtype dt) {
    return dt == KVB_DTYPE_F16 ? kvb_f16_to_f32(kvb_f32_to_f16(x))
           : dt == KVB_DTYPE_BF16 ? kvb_bf16_to_f32(kvb_f32_to_bf16(x)) : x;
}

/* x[n] as dt elements into host bytes b. */
static void encode(const float *x, size_t n, kvb_dtype dt, void *b) {
    for (size_t i = 0; i < n; i++) {
        if (dt == KVB_DTYPE_F32) memcpy((char *)b + 4 * i, &x[i], 4);
        else ((uint16_t *)b)[i] = dt == KVB_DTYPE_BF16 ? kvb_f32_to_bf16(x[i]) : kvb_f32_to_f16(x[i]);
    }
}

static kvb_backend *make(const char *name) {
    kvb_backend *be = NULL;
    ck_assert_int_eq(kvb_backend_create(name, 2, &be), KVB_OK);
    return be;
}

/* Device memory of `bytes`, holding `src` when not NULL. */
static void *dev(kvb_backend *be, const void *src, size_t bytes) {
    void *p = NULL;
    ck_assert_int_eq(kvb_mem_alloc(be->mem, bytes, &p), KVB_OK);
    if (src) ck_assert_int_eq(be->iface->to_device(be->ctx, p, src, bytes), KVB_OK);
    return p;
}

static const struct {
    const char *name;
    kvb_dtype dt;
    double tol;
} VARIANTS[] = {{"cuda:f32", KVB_DTYPE_F32, 1e-5}, {"cuda:f16", KVB_DTYPE_F16, 5e-3}, {"cuda", KVB_DTYPE_BF16, 2e-2}};

KVB_TEST(quant_tokens_bits) {
    rng_state = 41;
    enum { N = 9, C = 4096 + 48 };
    static float x[N * C], q[N * C], qs[N];
    static uint8_t gq[N * C];
    static char xb[N * C * 4];
    float gqs[N];
    for (size_t v = 0; v < KVB_ARRAY_LEN(VARIANTS); v++) {
        kvb_dtype dt = VARIANTS[v].dt;
        for (int i = 0; i < N * C; i++) x[i] = round_dt(frand() * (i % 97 == 0 ? 60.0f : 0.7f), dt);
        memset(x + 4 * C, 0, C * sizeof(float)); /* a zero row: the epsilon scale */
        kvb_backend *be = make(VARIANTS[v].name), *cpu = make("cpu");
        encode(x, (size_t)N * C, dt, xb);
        void *dx = dev(be, xb, (size_t)N * C * kvb_dtype_size(dt)), *dq = dev(be, NULL, (size_t)N * C);
        void *ds = dev(be, NULL, N * sizeof(float));
        ck_assert_int_eq(kvb_cuda_fp8_quant_tokens(dx, dt, N, C, dq, ds, kvb_cuda_backend_stream(be)), 0);
        ck_assert_int_eq(be->iface->to_host(be->ctx, gq, dq, (size_t)N * C), KVB_OK);
        ck_assert_int_eq(be->iface->to_host(be->ctx, gqs, ds, sizeof gqs), KVB_OK);
        kvb__cpu_quant_fp8_rows(x, N, C, q, qs);
        for (int i = 0; i < N; i++) ck_assert_msg(gqs[i] == qs[i], "%s row %d scale %g, cpu %g", VARIANTS[v].name, i, gqs[i], qs[i]);
        for (int i = 0; i < N * C; i++)
            ck_assert_msg(gq[i] == kvb_f32_to_e4m3(q[i]), "%s element %d: byte 0x%02x, cpu %g", VARIANTS[v].name, i, gq[i], q[i]);
        kvb_mem_free(be->mem, dx);
        kvb_mem_free(be->mem, dq);
        kvb_mem_free(be->mem, ds);
        kvb_backend_destroy(be);
        kvb_backend_destroy(cpu);
    }
}
KVB_TEST_END

/* One product on `be` against the CPU backend's. */
static void check_product(kvb_backend *be, kvb_backend *cpu, kvb_dtype dt, double tol, int n, int rows, int cols,
                          int per_row, kvb_act_quant act, float beta) {
    uint8_t *w = malloc((size_t)rows * cols);
    float *sc = malloc(sizeof(float) * rows), *x = malloc(sizeof(float) * n * cols);
    float *y0 = malloc(sizeof(float) * n * rows), *ycpu = malloc(sizeof(float) * n * rows);
    float *ygpu = malloc(sizeof(float) * n * rows);
    char *b = malloc((size_t)n * (cols > rows ? cols : rows) * 4);
    for (int i = 0; i < rows * cols; i++) {
        w[i] = (uint8_t)((rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull) >> 56);
        if ((w[i] & 0x7f) == 0x7f) w[i] ^= 1;
    }
    for (int r = 0; r < rows; r++) sc[r] = (0.5f + 0.25f * frand()) / 128.0f;
    for (int i = 0; i < n * cols; i++) x[i] = round_dt(frand(), dt);
    for (int i = 0; i < n * rows; i++) y0[i] = round_dt(frand(), dt);
    kvb_fp8_weight src = {w, rows, cols, sc, per_row ? rows : 1, act};
    kvb_tensor tc, tg;
    ck_assert_int_eq(cpu->iface->weight_fp8(cpu->ctx, &src, &tc), KVB_OK);
    ck_assert_int_eq(be->iface->weight_fp8(be->ctx, &src, &tg), KVB_OK);
    memcpy(ycpu, y0, sizeof(float) * n * rows);
    ck_assert_int_eq(cpu->iface->matmul(cpu->ctx, x, n, &tc, beta, ycpu), KVB_OK);
    size_t es = kvb_dtype_size(dt);
    encode(x, (size_t)n * cols, dt, b);
    void *dx = dev(be, b, (size_t)n * cols * es);
    encode(y0, (size_t)n * rows, dt, b);
    void *dy = dev(be, b, (size_t)n * rows * es);
    ck_assert_int_eq(be->iface->matmul(be->ctx, dx, n, &tg, beta, dy), KVB_OK);
    ck_assert_int_eq(be->iface->to_host_f32(be->ctx, ygpu, dy, (size_t)n * rows), KVB_OK);
    double num = 0, den = 0;
    for (int i = 0; i < n * rows; i++) {
        num += ((double)ygpu[i] - ycpu[i]) * ((double)ygpu[i] - ycpu[i]);
        den += (double)ycpu[i] * ycpu[i];
    }
    double e = sqrt(num / (den > 0 ? den : 1));
    if (!(e < tol)) { /* where the difference lies: one token row (its quantization) or spread (the sums) */
        int worst = 0, bad_rows = 0;
        for (int i = 0; i < n * rows; i++)
            if (fabs((double)ygpu[i] - ycpu[i]) > fabs((double)ygpu[worst] - ycpu[worst])) worst = i;
        for (int t = 0; t < n; t++) {
            int bad = 0;
            for (int r = 0; r < rows; r++)
                bad += fabs((double)ygpu[t * rows + r] - ycpu[t * rows + r]) > tol * sqrt(den / (n * rows));
            if (bad) fprintf(stderr, "  token %d: %d of %d outputs off by more than tol x rms\n", t, bad, rows);
            bad_rows += bad > 0;
        }
        fprintf(stderr, "  worst: token %d row %d: gpu %.9g cpu %.9g; %d of %d token rows off\n", worst / rows,
                worst % rows, ygpu[worst], ycpu[worst], bad_rows, n);
    }
    ck_assert_msg(e < tol, "%s n=%d %dx%d per_row %d act %d beta %g: normalized error %g (tol %g)", kvb_dtype_name(dt), n,
                  rows, cols, per_row, act, beta, e, tol);
    kvb_mem_free(be->mem, dx);
    kvb_mem_free(be->mem, dy);
    be->iface->weight_free(be->ctx, &tg);
    cpu->iface->weight_free(cpu->ctx, &tc);
    free(w);
    free(sc);
    free(x);
    free(y0);
    free(ycpu);
    free(ygpu);
    free(b);
}

KVB_TEST(fp8_products) {
    rng_state = 43;
    /* decode rows (GEMV), 9..130 rows (tiled kernel for weight-only; cuBLASLt for W8A8), ragged edges */
    int shapes[][3] = {{1, 320, 256}, {3, 96, 512}, {8, 200, 64}, {9, 64, 128}, {40, 256, 256}, {130, 192, 512}};
    for (size_t v = 0; v < KVB_ARRAY_LEN(VARIANTS); v++) {
        kvb_backend *be = make(VARIANTS[v].name), *cpu = make("cpu");
        for (size_t i = 0; i < KVB_ARRAY_LEN(shapes); i++)
            for (int k = 0; k < 8; k++)
                check_product(be, cpu, VARIANTS[v].dt, VARIANTS[v].tol, shapes[i][0], shapes[i][1], shapes[i][2], k & 1,
                              k & 2 ? KVB_ACT_FP8_TOKEN : KVB_ACT_NONE, k & 4 ? 1.0f : 0.0f);
        kvb_backend_destroy(be);
        kvb_backend_destroy(cpu);
    }
}
KVB_TEST_END

/* Bad FP8 weights are refused on upload: a NaN byte, a column count the products do not take. */
KVB_TEST(fp8_upload_errors) {
    kvb_backend *be = make("cuda");
    uint8_t w[4 * 24] = {0};
    float sc[4] = {1, 1, 1, 1};
    kvb_tensor t;
    kvb_fp8_weight odd = {w, 4, 24, sc, 4, KVB_ACT_NONE};
    ck_assert_int_eq(be->iface->weight_fp8(be->ctx, &odd, &t), KVB_ERR_UNSUPPORTED);
    w[5] = 0x7f;
    kvb_fp8_weight nan = {w, 4, 16, sc, 1, KVB_ACT_NONE};
    ck_assert_int_eq(be->iface->weight_fp8(be->ctx, &nan, &t), KVB_ERR_INVALID);
    kvb_backend_destroy(be);
}
KVB_TEST_END

static int probe(char *why, size_t len) { return kvb_mem_probe("cuda", 0, why, len); }

int main(int argc, char **argv) {
    const kvb_test table[] = {KVB_T(quant_tokens_bits, 120), KVB_T(fp8_products, 600), KVB_T(fp8_upload_errors, 60)};
    int skip = kvb_test_need_device(argc, argv, probe);
    if (skip >= 0) return skip;
    return kvb_test_main(argc, argv, "cuda_fp8", table, (int)KVB_ARRAY_LEN(table));
}

#else /* !KVB_WITH_CUDA */

int main(void) {
    printf("SKIP: the CUDA backend is not compiled into this build (%s)\n", kvb_backend_list());
    return 77;
}

#endif
