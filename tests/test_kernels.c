/* Tests of the CPU backend's kernels against naive double-precision loops, on fresh random inputs.
 * Attention is checked on ragged batches mixing decode-like and prefill-like sequences (both code
 * paths), with GQA and MHA, block sizes 1, 7, 16, and blocks scattered out of order in the pool. */
#include <float.h>
#include <math.h>
#include <string.h>

#include "kernels/backend.h"
#include "kernels/copy_plan.h"
#include "kernels/cpu/ops.h"
#include "tests/harness.h"

static uint64_t rng_state;
static float frand(void) { /* uniform in [-1, 1) */
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng_state >> 40) / (double)(1ull << 24)) * 2.0f - 1.0f;
}
static void fill(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = frand();
}
/* max |a-b| / max |b| */
static double rel_err(const float *a, const double *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num = fmax(num, fabs((double)a[i] - b[i]));
        den = fmax(den, fabs(b[i]));
    }
    return num / (den > 0 ? den : 1);
}

static kvb_backend *make_backend_named(const char *name, int threads) {
    kvb_backend *be = NULL;
    ck_assert_int_eq(kvb_backend_create(name, threads, &be), KVB_OK);
    return be;
}

static kvb_backend *make_backend(int threads) { return make_backend_named("cpu", threads); }

KVB_TEST(unknown_backend) {
    kvb_backend *be = NULL;
    ck_assert_int_eq(kvb_backend_create("tpu", 1, &be), KVB_ERR_UNSUPPORTED);
    ck_assert_ptr_null(be);
    kvb_dtype dt;
    ck_assert_int_eq(kvb_backend_act_dtype("tpu", &dt), KVB_ERR_UNSUPPORTED);
    /* the name's dtype (what kvbankd sizes KV blocks by) is the created backend's */
    be = make_backend(1);
    ck_assert_int_eq(kvb_backend_act_dtype("cpu", &dt), KVB_OK);
    ck_assert_int_eq(dt, be->iface->act_dtype);
    ck_assert_int_eq(kvb_backend_act_dtype(NULL, &dt), KVB_OK);
    ck_assert_int_eq(dt, be->iface->act_dtype);
    kvb_backend_destroy(be);
    /* "cpu:bf16": f32 activations, a bf16 KV cache */
    be = make_backend_named("cpu:bf16", 1);
    ck_assert_str_eq(be->iface->name, "cpu:bf16");
    ck_assert_int_eq(kvb_backend_act_dtype("cpu:bf16", &dt), KVB_OK);
    ck_assert_int_eq(dt, be->iface->act_dtype);
    ck_assert_int_eq(kvb_backend_kv_dtype("cpu:bf16", &dt), KVB_OK);
    ck_assert_int_eq(dt, KVB_DTYPE_BF16);
    ck_assert_int_eq(kvb_backend_kv_dtype("cpu", &dt), KVB_OK);
    ck_assert_int_eq(dt, KVB_DTYPE_F32);
    kvb_backend_destroy(be);
    ck_assert_int_eq(kvb_backend_create("cpu:f16", 1, &be), KVB_ERR_UNSUPPORTED);
}
KVB_TEST_END

static void check_matmul(int n, int rows, int cols, int threads) {
    kvb_backend *be = make_backend(threads);
    float *w = malloc(sizeof(float) * rows * cols), *x = malloc(sizeof(float) * n * cols);
    float *y = malloc(sizeof(float) * n * rows);
    double *ref = malloc(sizeof(double) * n * rows);
    fill(w, (size_t)rows * cols);
    fill(x, (size_t)n * cols);
    fill(y, (size_t)n * rows);
    kvb_tensor t;
    ck_assert_int_eq(be->iface->weight_load(be->ctx, w, KVB_DTYPE_F32, rows, cols, &t), KVB_OK);
    for (int i = 0; i < n; i++)
        for (int r = 0; r < rows; r++) {
            double s = y[(size_t)i * rows + r]; /* beta = 1: accumulate into y */
            for (int c = 0; c < cols; c++) s += (double)x[(size_t)i * cols + c] * w[(size_t)r * cols + c];
            ref[(size_t)i * rows + r] = s;
        }
    ck_assert_int_eq(be->iface->matmul(be->ctx, x, n, &t, 1.0f, y), KVB_OK);
    double e = rel_err(y, ref, (size_t)n * rows);
    ck_assert_msg(e < 1e-5, "matmul n=%d %dx%d threads=%d rel err %g", n, rows, cols, threads, e);
    be->iface->weight_free(be->ctx, &t);
    kvb_backend_destroy(be);
    free(w);
    free(x);
    free(y);
    free(ref);
}

/* The widths of the decode products' streaming kernel this processor has, widest first (KVB_CPU_SIMD
 * values: NULL is the default, the widest): each test of the products runs on every one, so an AVX-512
 * machine also checks the AVX2 kernel an older one takes. */
static const char *simd_levels[] = {NULL, "avx2"};
static void use_simd(const char *level) {
    if (level) setenv("KVB_CPU_SIMD", level, 1);
    else unsetenv("KVB_CPU_SIMD");
}

KVB_TEST(matmul_split_rows) {
    rng_state = 1;
    /* decode batches (n <= 32, cols % 8 == 0: the streaming kernel — 16 lanes and 6-row tiles on AVX-512
     * when cols % 16 == 0, else 8 lanes and 3-row tiles — rows not a multiple of its tiles, n not of its
     * 4-row groups, several hundred columns), sgemm beyond, odd column counts */
    int shapes[][3] = {{1, 300, 200}, {1, 1024, 96}, {5, 257, 64}, {8, 301, 64}, {32, 190, 96}, {13, 301, 392},
                       {32, 1000, 520}, {32, 1000, 512}, {8, 301, 784}, {1, 500, 1024}, {7, 100, 40}, {33, 512, 128},
                       {2, 17, 9}};
    for (size_t l = 0; l < KVB_ARRAY_LEN(simd_levels); l++) {
        use_simd(simd_levels[l]);
        for (size_t i = 0; i < KVB_ARRAY_LEN(shapes); i++)
            for (int th = 1; th <= 3; th++) check_matmul(shapes[i][0], shapes[i][1], shapes[i][2], th);
    }
    use_simd(NULL);
}
KVB_TEST_END

static int have_avx2(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

/* What the CPU backend's kernels need (backend_cpu.c picks them so), for the tests that compare them. */
static const char *need_avx2(void) { return have_avx2() ? NULL : "the processor has no AVX2 and FMA"; }

static const char *need_avx512(void) {
    const char *simd = getenv("KVB_CPU_SIMD");
    if (simd && *simd) return "KVB_CPU_SIMD is set: the test's default run would not take the widest kernels";
#if defined(__x86_64__) && defined(__GNUC__)
    if (have_avx2() && __builtin_cpu_supports("avx512f")) return NULL;
#endif
    return "the processor has no AVX-512 (both runs would take the AVX2 kernels)";
}

/* A row's products do not depend on the batch it is in (decode batches and prefill chunks alike on
 * AVX2): greedy tokens then do not change when a policy batches, preempts or swaps other sequences, and a
 * token's KV is the same bits whether a prefill or a decode step computed it (recomputation). */
static void check_batch_invariant(int rows, int cols) {
    int nmax = 140;
    kvb_backend *be = make_backend(2);
    float *w = malloc(sizeof(float) * rows * cols), *x = malloc(sizeof(float) * nmax * cols);
    float *y = malloc(sizeof(float) * nmax * rows), *y1 = malloc(sizeof(float) * rows);
    fill(w, (size_t)rows * cols);
    fill(x, (size_t)nmax * cols);
    kvb_tensor t;
    ck_assert_int_eq(be->iface->weight_load(be->ctx, w, KVB_DTYPE_F32, rows, cols, &t), KVB_OK);
    for (int n = 2; n <= nmax; n += n < 40 ? 5 : 31)
        for (int i = 0; i < n; i += n < 40 ? 3 : 17) {
            ck_assert_int_eq(be->iface->matmul(be->ctx, x, n, &t, 0.0f, y), KVB_OK);
            ck_assert_int_eq(be->iface->matmul(be->ctx, x + (size_t)i * cols, 1, &t, 0.0f, y1), KVB_OK);
            ck_assert_msg(!memcmp(y + (size_t)i * rows, y1, sizeof(float) * rows),
                          "%d x %d: row %d of a batch of %d differs", rows, cols, i, n);
        }
    be->iface->weight_free(be->ctx, &t);
    kvb_backend_destroy(be);
    free(w);
    free(x);
    free(y);
    free(y1);
}

KVB_TEST(matmul_batch_invariant) {
    rng_state = 7;
    for (size_t l = 0; l < KVB_ARRAY_LEN(simd_levels); l++) {
        use_simd(simd_levels[l]);
        check_batch_invariant(200, 392); /* 8 lanes whatever the processor */
        check_batch_invariant(200, 512); /* 16 lanes on AVX-512 */
    }
    use_simd(NULL);
}
KVB_TEST_END

/* matmul_n over q/k/v-like weights gives each product as matmul does — bit for bit with AVX2 (the
 * streaming kernel, decode and prefill sizes), within rounding on OpenBLAS — on 1 to 3 threads (the
 * team's row split crosses the weights' boundaries), and refuses weights of different widths. */
KVB_TEST(matmul_n_matches_matmul) {
    rng_state = 11;
    int avx2 = have_avx2();
    int cols = 64, rows[3] = {96, 32, 40}, ns[] = {1, 3, 8, 40};
    float *w[3], *y[3], *y1 = malloc(sizeof(float) * 40 * 96), *x = malloc(sizeof(float) * 40 * cols);
    fill(x, (size_t)40 * cols);
    for (int run = 0; run < 3 * (int)KVB_ARRAY_LEN(simd_levels); run++) {
        int th = run % 3 + 1;
        use_simd(simd_levels[run / 3]);
        kvb_backend *be = make_backend(th);
        ck_assert_ptr_nonnull(be->iface->matmul_n);
        kvb_tensor t[3];
        const kvb_tensor *tp[3] = {&t[0], &t[1], &t[2]};
        for (int i = 0; i < 3; i++) {
            w[i] = malloc(sizeof(float) * rows[i] * cols);
            y[i] = malloc(sizeof(float) * 40 * rows[i]);
            fill(w[i], (size_t)rows[i] * cols);
            ck_assert_int_eq(be->iface->weight_load(be->ctx, w[i], KVB_DTYPE_F32, rows[i], cols, &t[i]), KVB_OK);
        }
        for (size_t k = 0; k < KVB_ARRAY_LEN(ns); k++) {
            ck_assert_int_eq(be->iface->matmul_n(be->ctx, x, ns[k], tp, 3, (void *const *)y), KVB_OK);
            for (int i = 0; i < 3; i++) {
                ck_assert_int_eq(be->iface->matmul(be->ctx, x, ns[k], &t[i], 0.0f, y1), KVB_OK);
                size_t m = (size_t)ns[k] * rows[i];
                if (avx2) {
                    ck_assert_msg(!memcmp(y[i], y1, sizeof(float) * m), "weight %d, n=%d, %d threads, simd %s", i, ns[k], th,
                                  simd_levels[run / 3] ? simd_levels[run / 3] : "widest");
                } else { /* OpenBLAS's results depend on the width of the slice it gets */
                    double e = 0;
                    for (size_t j = 0; j < m; j++) e = fmax(e, fabs((double)y[i][j] - y1[j]));
                    ck_assert_msg(e < 1e-5, "weight %d, n=%d, %d threads: %g", i, ns[k], th, e);
                }
            }
        }
        kvb_tensor bad;
        ck_assert_int_eq(be->iface->weight_load(be->ctx, w[0], KVB_DTYPE_F32, 2, 32, &bad), KVB_OK);
        const kvb_tensor *mixed[2] = {&t[0], &bad};
        ck_assert_int_eq(be->iface->matmul_n(be->ctx, x, 1, mixed, 2, (void *const *)y), KVB_ERR_INVALID);
        be->iface->weight_free(be->ctx, &bad);
        for (int i = 0; i < 3; i++) {
            be->iface->weight_free(be->ctx, &t[i]);
            free(w[i]);
            free(y[i]);
        }
        kvb_backend_destroy(be);
    }
    use_simd(NULL);
    free(x);
    free(y1);
}
KVB_TEST_END

KVB_TEST(weight_load_half) {
    kvb_backend *be = make_backend(1);
    uint16_t h[4] = {0x3c00, 0xc000, 0x3800, 0x0000}; /* f16: 1, -2, 0.5, 0 */
    uint16_t bf[4] = {0x3f80, 0xc000, 0x3f00, 0x8000};/* bf16: 1, -2, 0.5, -0 */
    kvb_tensor t1, t2;
    ck_assert_int_eq(be->iface->weight_load(be->ctx, h, KVB_DTYPE_F16, 2, 2, &t1), KVB_OK);
    ck_assert_int_eq(be->iface->weight_load(be->ctx, bf, KVB_DTYPE_BF16, 4, 1, &t2), KVB_OK);
    const float want[4] = {1, -2, 0.5f, 0};
    for (int i = 0; i < 4; i++) {
        ck_assert_float_eq(((float *)t1.data)[i], want[i]);
        ck_assert_float_eq(((float *)t2.data)[i], want[i]);
    }
    ck_assert_int_eq(t1.ne[0], 2);
    ck_assert_int_eq(t2.ne[1], 1);
    be->iface->weight_free(be->ctx, &t1);
    be->iface->weight_free(be->ctx, &t2);
    kvb_backend_destroy(be);
}
KVB_TEST_END

/* A weight of dtype dt ([rows][cols], random values rounded to dt) in place (weight_view) against the same
 * values widened to f32 (weight_load): with the SIMD kernels the products are the same bits, decode and
 * prefill sizes, beta 0 and 1; without them (OpenBLAS on widened panels) within rounding. */
static void check_half_matmul(kvb_backend *be, kvb_dtype dt, int n, int rows, int cols, int exact) {
    uint16_t *h = malloc(sizeof(uint16_t) * rows * cols);
    float *wide = malloc(sizeof(float) * rows * cols), *x = malloc(sizeof(float) * n * cols);
    float *y0 = malloc(sizeof(float) * n * rows), *y1 = malloc(sizeof(float) * n * rows);
    for (int i = 0; i < rows * cols; i++) {
        float v = frand() * 2.0f;
        h[i] = dt == KVB_DTYPE_BF16 ? kvb_f32_to_bf16(v) : kvb_f32_to_f16(v);
        wide[i] = dt == KVB_DTYPE_BF16 ? kvb_bf16_to_f32(h[i]) : kvb_f16_to_f32(h[i]);
    }
    fill(x, (size_t)n * cols);
    kvb_tensor tv, tw;
    ck_assert_int_eq(be->iface->weight_view(be->ctx, h, dt, rows, cols, &tv), KVB_OK);
    ck_assert_int_eq(tv.dtype, dt);
    ck_assert_int_eq(tv.view, 1);
    ck_assert_int_eq(be->iface->weight_load(be->ctx, wide, KVB_DTYPE_F32, rows, cols, &tw), KVB_OK);
    for (int beta = 0; beta <= 1; beta++) {
        fill(y0, (size_t)n * rows);
        memcpy(y1, y0, sizeof(float) * n * rows);
        ck_assert_int_eq(be->iface->matmul(be->ctx, x, n, &tv, (float)beta, y0), KVB_OK);
        ck_assert_int_eq(be->iface->matmul(be->ctx, x, n, &tw, (float)beta, y1), KVB_OK);
        if (exact) {
            ck_assert_msg(!memcmp(y0, y1, sizeof(float) * n * rows), "%s n=%d %dx%d beta %d: not the f32 bits",
                          kvb_dtype_name(dt), n, rows, cols, beta);
        } else {
            double e = 0, m = 0;
            for (int i = 0; i < n * rows; i++) e = fmax(e, fabs((double)y0[i] - y1[i])), m = fmax(m, fabs(y1[i]));
            ck_assert_msg(e <= 1e-5 * m, "%s n=%d %dx%d: %g", kvb_dtype_name(dt), n, rows, cols, e / m);
        }
    }
    be->iface->weight_free(be->ctx, &tv);
    be->iface->weight_free(be->ctx, &tw);
    free(h);
    free(wide);
    free(x);
    free(y0);
    free(y1);
}

KVB_TEST(matmul_half_weights_exact) {
    rng_state = 21;
    /* decode batches (widened in registers) and prefill chunks (blocks widened once, x in chunks of 64),
     * 16-lane and 8-lane column counts, rows not a multiple of the tiles */
    int shapes[][3] = {{1, 301, 512}, {5, 257, 64}, {32, 190, 96}, {33, 301, 128}, {100, 97, 520}, {200, 64, 256},
                       {7, 100, 40}, {40, 50, 8}};
    const char *levels[] = {NULL, "avx2", "0"};
    int avx2 = have_avx2();
    for (size_t l = 0; l < KVB_ARRAY_LEN(levels); l++) {
        use_simd(levels[l]);
        for (int th = 1; th <= 3; th += 2) {
            kvb_backend *be = make_backend(th);
            for (size_t i = 0; i < KVB_ARRAY_LEN(shapes); i++)
                for (int d = 0; d < 2; d++)
                    check_half_matmul(be, d ? KVB_DTYPE_F16 : KVB_DTYPE_BF16, shapes[i][0], shapes[i][1], shapes[i][2],
                                      avx2 && l < 2);
            kvb_backend_destroy(be);
        }
    }
    use_simd(NULL);
}
KVB_TEST_END

/* The embedding of a bf16 or f16 table in place gives the widened rows; vectors of half types and
 * misaligned data are not viewed (the caller converts a copy). */
KVB_TEST(weight_view_half) {
    kvb_backend *be = make_backend(1);
    enum { V = 5, D = 24 };
    uint16_t tab[V * D + 1];
    for (int i = 0; i < V * D + 1; i++) tab[i] = kvb_f32_to_bf16((float)i / 7.0f - 3.0f);
    kvb_tensor t;
    ck_assert_int_eq(be->iface->weight_view(be->ctx, tab, KVB_DTYPE_BF16, V, D, &t), KVB_OK);
    int32_t ids[3] = {4, 0, 2};
    float out[3 * D];
    ck_assert_int_eq(be->iface->embed(be->ctx, &t, ids, 3, out), KVB_OK);
    for (int i = 0; i < 3; i++)
        for (int c = 0; c < D; c++) ck_assert_float_eq(out[i * D + c], kvb_bf16_to_f32(tab[ids[i] * D + c]));
    be->iface->weight_free(be->ctx, &t);
    ck_assert_int_eq(be->iface->weight_view(be->ctx, tab, KVB_DTYPE_F16, D, 1, &t), KVB_ERR_UNSUPPORTED);
    ck_assert_int_eq(be->iface->weight_view(be->ctx, (char *)tab + 1, KVB_DTYPE_BF16, V, D, &t), KVB_ERR_UNSUPPORTED);
    kvb_backend_destroy(be);
}
KVB_TEST_END

/* E4M3 conversions: every byte's value (bias 7, subnormals m * 2^-9, 0x7f / 0xff NaN), the round trip,
 * and rounding to nearest with ties to even at every midpoint between neighbours. */
KVB_TEST(e4m3_conversions) {
    for (int b = 0; b < 256; b++) {
        int e = (b >> 3) & 15, m = b & 7;
        float v = kvb_e4m3_to_f32((uint8_t)b);
        if (e == 15 && m == 7) {
            ck_assert(isnan(v));
            continue;
        }
        double want = (e ? (1.0 + m / 8.0) * ldexp(1.0, e - 7) : m * ldexp(1.0, -9)) * (b & 0x80 ? -1 : 1);
        ck_assert_msg(v == (float)want, "byte 0x%02x: %g, expected %g", b, v, want);
        ck_assert_msg(kvb_f32_to_e4m3(v) == b || (v == 0.0f && (kvb_f32_to_e4m3(v) & 0x7f) == 0), "round trip 0x%02x", b);
        ck_assert_float_eq(kvb_e4m3_round(v), v);
    }
    /* midpoints between consecutive positive values: ties go to the even mantissa */
    for (int b = 0; b < 0x7e; b++) {
        float lo = kvb_e4m3_to_f32((uint8_t)b), hi = kvb_e4m3_to_f32((uint8_t)(b + 1));
        float mid = 0.5f * (lo + hi), even = b % 2 == 0 ? lo : hi;
        ck_assert_msg(kvb_e4m3_round(mid) == even, "tie between 0x%02x and 0x%02x: %g", b, b + 1, kvb_e4m3_round(mid));
        ck_assert_float_eq(kvb_e4m3_round(-mid), -even);
        ck_assert_float_eq(kvb_e4m3_round(nextafterf(mid, 0.0f)), lo);
        ck_assert_float_eq(kvb_e4m3_round(nextafterf(mid, 1e9f)), hi);
    }
    ck_assert_float_eq(kvb_e4m3_round(448.0f), 448.0f);
    ck_assert_float_eq(kvb_e4m3_round(1e-30f), 0.0f);
}
KVB_TEST_END

/* Per-token FP8 quantization: the AVX2 rows are the bits of the scalar rows (KVB_CPU_SIMD=0), every q an
 * E4M3 value, the scale max|x| / 448 and the epsilon for a zero row. */
KVB_TEST(fp8_quant_rows) {
    rng_state = 23;
    enum { N = 7, C = 72 };
    static float x[N * C], q0[N * C], q1[N * C], s0[N], s1[N];
    for (int i = 0; i < N * C; i++) x[i] = frand() * (i % 5 == 0 ? 30.0f : 0.5f);
    memset(x + 3 * C, 0, C * sizeof(float)); /* a zero row */
    x[5 * C + 7] = 1e-30f;                    /* a tiny one */
    kvb_backend *be = make_backend(1);        /* sets the SIMD flags */
    use_simd("0");
    kvb_backend *be0 = make_backend(1);
    kvb__cpu_quant_fp8_rows(x, N, C, q0, s0);
    kvb_backend_destroy(be0);
    use_simd(NULL);
    kvb_backend_destroy(be);
    be = make_backend(1);
    kvb__cpu_quant_fp8_rows(x, N, C, q1, s1);
    kvb_backend_destroy(be);
    ck_assert(!memcmp(q0, q1, sizeof q0));
    ck_assert(!memcmp(s0, s1, sizeof s0));
    for (int i = 0; i < N; i++) {
        float m = 0;
        for (int c = 0; c < C; c++) m = fmaxf(m, fabsf(x[i * C + c]));
        ck_assert_float_eq(s0[i], m == 0.0f ? FLT_EPSILON : m / 448.0f);
        for (int c = 0; c < C; c++) {
            float v = fminf(fmaxf(x[i * C + c] / s0[i], -448.0f), 448.0f);
            ck_assert_float_eq(q0[i * C + c], kvb_e4m3_round(v));
        }
    }
}
KVB_TEST_END

/* An FP8 weight (E4M3 bytes, a scale per row or one per tensor) against a double reference of the same
 * arithmetic: weight-only, y = x . (w * scale)^T; W8A8, x quantized per token (its E4M3 values computed
 * here with kvb_e4m3_round), y = (q . w^T) * scale * s_x. Decode and prefill sizes, both widths and the
 * OpenBLAS path, beta 0 and 1; and a row alone is the bits it has in a batch. NaN bytes are refused. */
static void check_fp8_matmul(kvb_backend *be, int n, int rows, int cols, int per_row, kvb_act_quant act, int exact) {
    uint8_t *w = malloc((size_t)rows * cols);
    float *sc = malloc(sizeof(float) * rows), *x = malloc(sizeof(float) * n * cols);
    float *y = malloc(sizeof(float) * n * rows), *y1 = malloc(sizeof(float) * rows);
    double *ref = malloc(sizeof(double) * n * rows);
    for (int i = 0; i < rows * cols; i++) {
        w[i] = (uint8_t)((rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull) >> 56);
        if ((w[i] & 0x7f) == 0x7f) w[i] ^= 1;
    }
    for (int r = 0; r < rows; r++) sc[r] = (0.5f + 0.25f * frand()) / 64.0f;
    fill(x, (size_t)n * cols);
    fill(y, (size_t)n * rows);
    kvb_fp8_weight src = {w, rows, cols, sc, per_row ? rows : 1, act};
    kvb_tensor t;
    ck_assert_int_eq(be->iface->weight_fp8(be->ctx, &src, &t), KVB_OK);
    ck_assert_int_eq(t.dtype, KVB_DTYPE_F8_E4M3);
    for (int i = 0; i < n; i++) {
        float m = 0, sx = 1;
        for (int c = 0; c < cols; c++) m = fmaxf(m, fabsf(x[i * cols + c]));
        if (act == KVB_ACT_FP8_TOKEN) sx = m / 448.0f;
        for (int r = 0; r < rows; r++) {
            double s = 0;
            for (int c = 0; c < cols; c++) {
                float xv = x[i * cols + c];
                if (act == KVB_ACT_FP8_TOKEN) xv = kvb_e4m3_round(fminf(fmaxf(xv / sx, -448.0f), 448.0f));
                s += (double)xv * kvb_e4m3_to_f32(w[r * cols + c]);
            }
            ref[i * rows + r] = s * sc[per_row ? r : 0] * sx + y[i * rows + r];
        }
    }
    ck_assert_int_eq(be->iface->matmul(be->ctx, x, n, &t, 1.0f, y), KVB_OK);
    double e = rel_err(y, ref, (size_t)n * rows);
    ck_assert_msg(e < 1e-5, "fp8 n=%d %dx%d per_row %d act %d: rel err %g", n, rows, cols, per_row, act, e);
    for (int i = 0; i < n; i += 5) {
        ck_assert_int_eq(be->iface->matmul(be->ctx, x, n, &t, 0.0f, y), KVB_OK);
        ck_assert_int_eq(be->iface->matmul(be->ctx, x + (size_t)i * cols, 1, &t, 0.0f, y1), KVB_OK);
        if (exact)
            ck_assert_msg(!memcmp(y + (size_t)i * rows, y1, sizeof(float) * rows), "fp8 row %d of %d alone differs", i, n);
    }
    be->iface->weight_free(be->ctx, &t);
    free(w);
    free(sc);
    free(x);
    free(y);
    free(y1);
    free(ref);
}

KVB_TEST(matmul_fp8) {
    rng_state = 31;
    int shapes[][3] = {{1, 301, 512}, {5, 97, 64}, {32, 190, 96}, {45, 301, 128}, {100, 64, 520}, {7, 50, 40}};
    const char *levels[] = {NULL, "avx2", "0"};
    for (size_t l = 0; l < KVB_ARRAY_LEN(levels); l++) {
        use_simd(levels[l]);
        kvb_backend *be = make_backend(l == 1 ? 3 : 2);
        for (size_t i = 0; i < KVB_ARRAY_LEN(shapes); i++)
            for (int k = 0; k < 4; k++) /* the OpenBLAS path (l == 2) makes no bit-for-bit claim */
                check_fp8_matmul(be, shapes[i][0], shapes[i][1], shapes[i][2], k & 1, k & 2 ? KVB_ACT_FP8_TOKEN : KVB_ACT_NONE,
                                 have_avx2() && l < 2);
        kvb_backend_destroy(be);
    }
    use_simd(NULL);
    /* a NaN byte is refused */
    kvb_backend *be = make_backend(1);
    uint8_t w[4 * 8] = {0};
    float sc = 1.0f;
    w[13] = 0xff;
    kvb_fp8_weight src = {w, 4, 8, &sc, 1, KVB_ACT_NONE};
    kvb_tensor t;
    ck_assert_int_eq(be->iface->weight_fp8(be->ctx, &src, &t), KVB_ERR_INVALID);
    kvb_backend_destroy(be);
}
KVB_TEST_END

KVB_TEST(rmsnorm_rope_silu) {
    rng_state = 2;
    kvb_backend *be = make_backend(2);
    enum { R = 300, D = 64, H = 3, N = 5 };
    static float x[R * D], y[R * D], w[D];
    static double ref[R * D];
    fill(x, R * D);
    fill(w, D);
    kvb_tensor tw;
    ck_assert_int_eq(be->iface->weight_load(be->ctx, w, KVB_DTYPE_F32, D, 1, &tw), KVB_OK);
    for (int r = 0; r < R; r++) {
        double ss = 0;
        for (int i = 0; i < D; i++) ss += (double)x[r * D + i] * x[r * D + i];
        for (int i = 0; i < D; i++) ref[r * D + i] = x[r * D + i] / sqrt(ss / D + 1e-6) * w[i];
    }
    ck_assert_int_eq(be->iface->rmsnorm(be->ctx, x, R, D, &tw, 1e-6f, y), KVB_OK);
    ck_assert_double_lt(rel_err(y, ref, R * D), 1e-6);
    /* a row alone gives the bits it has in the batch (rows go in groups of 8; 300 = 37 groups + 4) */
    for (int r = 0; r < R; r += 7) {
        float y1[D];
        ck_assert_int_eq(be->iface->rmsnorm(be->ctx, x + r * D, 1, D, &tw, 1e-6f, y1), KVB_OK);
        ck_assert_msg(!memcmp(y1, y + r * D, sizeof y1), "rmsnorm row %d alone differs from the batch", r);
    }
    /* in place gives the same */
    ck_assert_int_eq(be->iface->rmsnorm(be->ctx, x, R, D, &tw, 1e-6f, x), KVB_OK);
    ck_assert_int_eq(memcmp(x, y, sizeof x), 0);

    /* RoPE, rotate-half form, q [N][H][D] and k [N][1][D] at arbitrary positions */
    static float q[N * H * D], k[N * D], q0[N * H * D], k0[N * D];
    float inv_freq[D / 2];
    for (int i = 0; i < D / 2; i++) inv_freq[i] = (float)pow(10000.0, -2.0 * i / D);
    kvb_rope rope = {.head_dim = D, .inv_freq = inv_freq};
    int32_t pos[N] = {0, 1, 17, 1000, 4095};
    fill(q, N * H * D);
    fill(k, N * D);
    memcpy(q0, q, sizeof q);
    memcpy(k0, k, sizeof k);
    ck_assert_int_eq(be->iface->rope(be->ctx, q, H, k, 1, N, pos, &rope), KVB_OK);
    for (int t = 0; t < N; t++)
        for (int h = 0; h <= H; h++) {
            const float *src = h < H ? q0 + (t * H + h) * D : k0 + t * D;
            const float *got = h < H ? q + (t * H + h) * D : k + t * D;
            for (int i = 0; i < D / 2; i++) {
                double a = (double)pos[t] * inv_freq[i], c = cos(a), s = sin(a);
                double r1 = src[i] * c - src[i + D / 2] * s, r2 = src[i + D / 2] * c + src[i] * s;
                ck_assert_double_lt(fabs(got[i] - r1), 1e-5);
                ck_assert_double_lt(fabs(got[i + D / 2] - r2), 1e-5);
            }
        }
    /* SiLU * up */
    static float g[R * D], u[R * D], o[R * D];
    fill(g, R * D);
    fill(u, R * D);
    for (int i = 0; i < R * D; i++) ref[i] = g[i] / (1 + exp(-(double)g[i])) * u[i];
    ck_assert_int_eq(be->iface->silu_mul(be->ctx, g, u, R * D, o), KVB_OK);
    ck_assert_double_lt(rel_err(o, ref, R * D), 1e-6);
    /* each element alone against the double reference, over the whole range of gates (large negative
     * ones make e^-g overflow a naive form; large positive ones must give g * up). Below g = -88 the
     * exponential is clamped: the result is a few 1e-37 instead of a denormal, hence the absolute term. */
    for (int i = 0; i < R * D; i++) g[i] = (float)(i % 2001 - 1000) * 0.1f;
    for (int i = 0; i < R * D; i++) ref[i] = g[i] / (1 + exp(-(double)g[i])) * u[i];
    ck_assert_int_eq(be->iface->silu_mul(be->ctx, g, u, R * D, o), KVB_OK);
    for (int i = 0; i < R * D; i++) {
        ck_assert_msg(isfinite(o[i]), "silu(%g) is not finite", g[i]);
        ck_assert_msg(fabs(o[i] - ref[i]) <= 4e-7 * fabs(ref[i]) + 1e-35, "silu(%g) * %g = %g, want %g", g[i], u[i],
                      o[i], ref[i]);
    }
    /* an element's bits do not depend on the length of the call (a decode row alone or in a batch, the
     * team's split, the vector body or the tail) */
    static float o2[R * D];
    for (int len = 1; len <= 40; len += 13) {
        ck_assert_int_eq(be->iface->silu_mul(be->ctx, g + 8 * len, u + 8 * len, (size_t)len, o2), KVB_OK);
        ck_assert_int_eq(memcmp(o2, o + 8 * len, (size_t)len * sizeof(float)), 0);
    }
    be->iface->weight_free(be->ctx, &tw);
    kvb_backend_destroy(be);
}
KVB_TEST_END

/* Paged attention against a dense double-precision reference. */
typedef struct seq_spec {
    int q_len, ctx_len;
} seq_spec;

/* How check_attention_keep keeps K and V: 0, f32 values in an f32 cache; KV_ROUNDED, values a bf16 holds
 * exactly in an f32 cache; KV_BF16, the same values in the bf16 cache of "cpu:bf16". */
enum { KV_F32, KV_ROUNDED, KV_BF16 };
static int attn_kv = KV_F32;
/* 1: check_attention_keep's reference for the decode walk's rows (sequences with fewer than 32 query rows
 * per KV head, GEMM_MIN_ROWS) is the arithmetic of the bf16 dot products (attention.c: q rounded to bf16,
 * each chunk's softmax weights rounded to bf16, the sums exact), compared element by element. */
static int attn_ref_bf16dot = 0;
/* The error check_attention_keep measured last (its check is < 1e-5). */
static double attn_last_err;
/* The walk's chunk of keys (attention.c WALK_KEYS): its weights are rounded relative to the chunk's max. */
#define REF_WALK_KEYS 512

static double bf16_round(double x) { return kvb_bf16_to_f32(kvb_f32_to_bf16((float)x)); }

/* The reference of one walk row under the bf16 dot products: o[hd] and, per element, the change a weight
 * within 1% of a bf16 ulp of a rounding midpoint could make by rounding the other way (the kernel's f32
 * weight lies on either side of it; slack[hd]). sc: scratch for the row's keys. */
static void ref_row_bf16dot(const float *qh, const float *k, const float *v, size_t row, int hd, int lo, int vis,
                            double *sc, double *o, double *slack) {
    double qr[512];
    for (int i = 0; i < hd; i++) qr[i] = bf16_round(qh[i]);
    double scale = (float)(1 / sqrt(hd)), M = -1e300, L = 0;
    for (int kk = lo; kk < vis; kk++) {
        double d = 0;
        for (int i = 0; i < hd; i++) d += qr[i] * k[(size_t)kk * row + i];
        sc[kk] = d * scale;
        M = fmax(M, sc[kk]);
    }
    for (int i = 0; i < hd; i++) o[i] = slack[i] = 0;
    for (int c0 = lo / REF_WALK_KEYS * REF_WALK_KEYS; c0 < vis; c0 += REF_WALK_KEYS) {
        int a = c0 > lo ? c0 : lo, e = c0 + REF_WALK_KEYS < vis ? c0 + REF_WALK_KEYS : vis;
        double mc = -1e300;
        for (int kk = a; kk < e; kk++) mc = fmax(mc, sc[kk]);
        double w = exp(mc - M);
        for (int kk = a; kk < e; kk++) {
            double pe = exp(sc[kk] - mc), pr = bf16_round(pe);
            int ex;
            frexp(pr > 0 ? pr : pe, &ex);
            double ulp = ldexp(1.0, ex - 8), amb = 0.5 * ulp - fabs(pe - pr) < 0.01 * ulp ? ulp : 0;
            L += w * pe;
            for (int i = 0; i < hd; i++) {
                o[i] += w * pr * v[(size_t)kk * row + i];
                slack[i] += w * amb * fabs(v[(size_t)kk * row + i]);
            }
        }
    }
    for (int i = 0; i < hd; i++) {
        o[i] /= L;
        slack[i] /= L;
    }
}

static void fill_kv(float *x, size_t n) {
    fill(x, n);
    for (size_t i = 0; attn_kv != KV_F32 && i < n; i++) x[i] = kvb_bf16_to_f32(kvb_f32_to_bf16(x[i]));
}

/* Row p of a sequence's K (v = 0) or V (v = 1) in its block, from the dense f32 row. */
static void put_row(void *blk, int bs, size_t row, int p, int v, const float *src) {
    size_t at = ((size_t)v * bs + (size_t)(p % bs)) * row;
    if (attn_kv != KV_BF16) {
        memcpy((float *)blk + at, src, sizeof(float) * row);
        return;
    }
    for (size_t i = 0; i < row; i++) ((uint16_t *)blk)[at + i] = kvb_f32_to_bf16(src[i]);
}

/* window > 0: sliding-window attention (a row sees its last `window` keys). keep: where the output goes
 * too (n_tokens x n_heads x hd floats), or NULL. */
static void check_attention_keep(const seq_spec *specs, int n_seqs, int n_heads, int n_kv, int hd, int bs, int threads,
                                 int window, float *keep) {
    kvb_backend *be = make_backend_named(attn_kv == KV_BF16 ? "cpu:bf16" : "cpu", threads);
    kvb_kv_geom g = {.n_layers = 1, .n_kv_heads = n_kv, .head_dim = hd, .block_size = bs,
                     .elem_size = attn_kv == KV_BF16 ? 2 : 4};
    int n_tok = 0, n_blk = 0;
    kvb_attn_seq seqs[8];
    for (int s = 0; s < n_seqs; s++) {
        seqs[s] = (kvb_attn_seq){.q_start = n_tok, .q_len = specs[s].q_len, .ctx_len = specs[s].ctx_len,
                                 .n_blocks = KVB_DIV_CEIL(specs[s].ctx_len, bs), .blk_first = n_blk};
        n_tok += specs[s].q_len;
        n_blk += seqs[s].n_blocks;
    }
    size_t row = (size_t)n_kv * hd, blk_floats = 2 * (size_t)bs * row;
    /* pool with blocks handed out in a scrambled order */
    float *pool = calloc((size_t)n_blk * blk_floats, sizeof(float));
    void **ptrs = malloc(sizeof(void *) * n_blk);
    int mul = kvb_test_scramble_mul(n_blk);
    for (int j = 0; j < n_blk; j++) ptrs[j] = pool + (size_t)((j * mul + 3) % n_blk) * blk_floats;
    /* dense K/V per sequence [ctx][n_kv][hd]; past tokens written straight into the blocks, new ones
     * through kv_write */
    float *q = malloc(sizeof(float) * n_tok * n_heads * hd), *out = malloc(sizeof(float) * n_tok * n_heads * hd);
    float *knew = malloc(sizeof(float) * n_tok * row), *vnew = malloc(sizeof(float) * n_tok * row);
    double *ref = malloc(sizeof(double) * n_tok * n_heads * hd);
    fill(q, (size_t)n_tok * n_heads * hd);
    fill_kv(knew, (size_t)n_tok * row);
    fill_kv(vnew, (size_t)n_tok * row);
    float **kd = malloc(sizeof(float *) * n_seqs), **vd = malloc(sizeof(float *) * n_seqs);
    for (int s = 0; s < n_seqs; s++) {
        const kvb_attn_seq *sq = &seqs[s];
        kd[s] = malloc(sizeof(float) * sq->ctx_len * row);
        vd[s] = malloc(sizeof(float) * sq->ctx_len * row);
        int past = sq->ctx_len - sq->q_len;
        fill_kv(kd[s], (size_t)past * row);
        fill_kv(vd[s], (size_t)past * row);
        memcpy(kd[s] + (size_t)past * row, knew + (size_t)sq->q_start * row, sizeof(float) * sq->q_len * row);
        memcpy(vd[s] + (size_t)past * row, vnew + (size_t)sq->q_start * row, sizeof(float) * sq->q_len * row);
        for (int p = 0; p < past; p++) {
            put_row(ptrs[sq->blk_first + p / bs], bs, row, p, 0, kd[s] + (size_t)p * row);
            put_row(ptrs[sq->blk_first + p / bs], bs, row, p, 1, vd[s] + (size_t)p * row);
        }
    }
    kvb_attn_batch b = {.geom = &g, .n_heads = n_heads, .n_tokens = n_tok, .n_seqs = n_seqs, .seqs = seqs,
                        .layer_blocks = ptrs, .scale = (float)(1 / sqrt(hd)), .window = window};
    ck_assert_int_eq(be->iface->kv_write(be->ctx, &b, knew, vnew), KVB_OK);
    ck_assert_int_eq(be->iface->attention(be->ctx, &b, q, out), KVB_OK);
    int gq = n_heads / n_kv;
    double *sc = malloc(sizeof(double) * 4096), *slack = calloc((size_t)n_tok * n_heads * hd, sizeof(double));
    for (int s = 0; s < n_seqs; s++) {
        const kvb_attn_seq *sq = &seqs[s];
        for (int t = 0; t < sq->q_len; t++)
            for (int h = 0; h < n_heads; h++) {
                int vis = sq->ctx_len - sq->q_len + t + 1, kvh = h / gq;
                int lo = window > 0 && vis > window ? vis - window : 0;
                const float *qh = q + ((size_t)(sq->q_start + t) * n_heads + h) * hd;
                size_t at = ((size_t)(sq->q_start + t) * n_heads + h) * hd;
                if (attn_ref_bf16dot && sq->q_len * gq < 32) {
                    ref_row_bf16dot(qh, kd[s] + kvh * hd, vd[s] + kvh * hd, row, hd, lo, vis, sc, ref + at, slack + at);
                    continue;
                }
                double mx = -1e300, sum = 0;
                for (int k = lo; k < vis; k++) {
                    double d = 0;
                    for (int i = 0; i < hd; i++) d += (double)qh[i] * kd[s][(size_t)k * row + kvh * hd + i];
                    sc[k] = d / sqrt(hd);
                    mx = fmax(mx, sc[k]);
                }
                for (int k = lo; k < vis; k++) sum += (sc[k] = exp(sc[k] - mx));
                double *o = ref + ((size_t)(sq->q_start + t) * n_heads + h) * hd;
                for (int i = 0; i < hd; i++) {
                    double acc = 0;
                    for (int k = lo; k < vis; k++) acc += sc[k] / sum * vd[s][(size_t)k * row + kvh * hd + i];
                    o[i] = acc;
                }
            }
    }
    double e = rel_err(out, ref, (size_t)n_tok * n_heads * hd);
    if (attn_ref_bf16dot) { /* element by element: the error past the rounding's slack, over the largest output */
        double den = 0, worst = 0;
        for (size_t i = 0; i < (size_t)n_tok * n_heads * hd; i++) den = fmax(den, fabs(ref[i]));
        for (size_t i = 0; i < (size_t)n_tok * n_heads * hd; i++)
            worst = fmax(worst, (fabs(out[i] - ref[i]) - slack[i]) / den);
        e = worst;
    }
    ck_assert_msg(e < 1e-5, "attention heads %d/%d hd %d bs %d threads %d window %d: rel err %g", n_heads, n_kv, hd, bs,
                  threads, window, e);
    attn_last_err = e;
    if (keep) memcpy(keep, out, sizeof(float) * n_tok * n_heads * hd);
    for (int s = 0; s < n_seqs; s++) {
        free(kd[s]);
        free(vd[s]);
    }
    free(kd);
    free(vd);
    free(sc);
    free(slack);
    free(pool);
    free(ptrs);
    free(q);
    free(out);
    free(knew);
    free(vnew);
    free(ref);
    kvb_backend_destroy(be);
}

static void check_attention_w(const seq_spec *specs, int n_seqs, int n_heads, int n_kv, int hd, int bs, int threads,
                              int window) {
    check_attention_keep(specs, n_seqs, n_heads, n_kv, hd, bs, threads, window, NULL);
}

static void check_attention(const seq_spec *specs, int n_seqs, int n_heads, int n_kv, int hd, int bs, int threads) {
    check_attention_w(specs, n_seqs, n_heads, n_kv, hd, bs, threads, 0);
}

KVB_TEST(attention_paths_gqa) {
    rng_state = 3;
    /* decode (1 new token), short chunk, long prefill (sgemm path, several tiles), chunk after a past,
     * decode walks over several chunks of keys (merged) */
    seq_spec specs[] = {{1, 40}, {3, 3}, {300, 300}, {70, 133}, {1, 1}, {1, 1300}, {2, 1025}};
    int bss[] = {1, 7, 16};
    for (size_t i = 0; i < KVB_ARRAY_LEN(bss); i++) {
        check_attention(specs, 7, 8, 2, 32, bss[i], 1);
        check_attention(specs, 7, 8, 2, 32, bss[i], 3);
    }
}
KVB_TEST_END

/* A decode row's attention is the same bits whatever the block size: the walk's kernels take a block's
 * keys four at a time (scores) or all at once (values) and the rows left over one by one, each product
 * and sum in one order whichever. Block sizes 1 and 3 never make a group of four; 16 and 32 mostly do;
 * 5 and 7 mix them. Head dimensions: 64 and 128 (values in registers, 64 columns at a time), 24 and 32
 * (not a multiple of 64: values row by row; 24: not of 16 either). */
KVB_TEST(attention_decode_block_sizes) {
    seq_spec specs[] = {{1, 1}, {1, 7}, {1, 129}, {2, 61}, {1, 600}, {3, 1030}};
    int n_tok = 9, shapes[][3] = {{12, 4, 64}, {8, 2, 128}, {8, 2, 32}, {6, 3, 24}, {4, 1, 64}};
    int bss[] = {1, 3, 5, 7, 16, 32};
    for (size_t i = 0; i < KVB_ARRAY_LEN(shapes); i++) {
        int nh = shapes[i][0], nkv = shapes[i][1], hd = shapes[i][2];
        size_t floats = (size_t)n_tok * nh * hd;
        float *first = malloc(sizeof(float) * floats), *out = malloc(sizeof(float) * floats);
        for (size_t j = 0; j < KVB_ARRAY_LEN(bss); j++) {
            rng_state = 11; /* the same queries, keys and values for every block size */
            check_attention_keep(specs, 6, nh, nkv, hd, bss[j], 2, 0, j ? out : first);
            ck_assert_msg(!j || !memcmp(first, out, sizeof(float) * floats),
                          "heads %d/%d hd %d: block size %d gives other bits than block size 1", nh, nkv, hd, bss[j]);
        }
        free(first);
        free(out);
    }
}
KVB_TEST_END

/* The decode walk's AVX-512 kernels (a KV group's heads together, up to 6 of them, head sizes a multiple of
 * 16) give the same bits as the AVX2 ones (KVB_CPU_SIMD=avx2), across block sizes that leave rows after the
 * fours and groups of 1 to 7 heads (7: past the wide kernels, the AVX2 ones on both sides). Skipped on a
 * processor without AVX-512, where both runs would take the AVX2 kernels. */
KVB_TEST(attention_decode_widths) {
    seq_spec specs[] = {{1, 1}, {1, 7}, {1, 129}, {2, 61}, {1, 600}, {3, 1030}};
    int n_tok = 9, shapes[][3] = {{12, 4, 64}, {8, 2, 128}, {8, 2, 32}, {6, 3, 48}, {4, 1, 64}, {10, 2, 64},
                                  {12, 2, 64}, {14, 2, 64}, {4, 4, 64}};
    int bss[] = {5, 16};
    for (size_t i = 0; i < KVB_ARRAY_LEN(shapes); i++)
        for (size_t j = 0; j < KVB_ARRAY_LEN(bss); j++) {
            int nh = shapes[i][0], nkv = shapes[i][1], hd = shapes[i][2];
            size_t floats = (size_t)n_tok * nh * hd;
            float *wide = malloc(sizeof(float) * floats), *avx2 = malloc(sizeof(float) * floats);
            rng_state = 12;
            check_attention_keep(specs, 6, nh, nkv, hd, bss[j], 2, 0, wide);
            setenv("KVB_CPU_SIMD", "avx2", 1);
            rng_state = 12;
            check_attention_keep(specs, 6, nh, nkv, hd, bss[j], 2, 0, avx2);
            unsetenv("KVB_CPU_SIMD");
            ck_assert_msg(!memcmp(wide, avx2, sizeof(float) * floats),
                          "heads %d/%d hd %d block size %d: the AVX-512 walk gives other bits than the AVX2 one", nh,
                          nkv, hd, bss[j]);
            free(wide);
            free(avx2);
        }
}
KVB_TEST_END

/* The same attention and matrix-product checks on the paths a processor without AVX2 takes (the generic
 * loops, OpenBLAS for every product), chosen with KVB_CPU_SIMD=0 at backend creation. */
KVB_TEST(generic_paths) {
    setenv("KVB_CPU_SIMD", "0", 1);
    rng_state = 6;
    seq_spec specs[] = {{1, 40}, {3, 3}, {300, 300}, {70, 133}, {1, 1300}, {2, 1025}};
    check_attention(specs, 6, 8, 2, 32, 7, 2);
    check_attention(specs, 6, 6, 1, 64, 16, 1);
    check_attention_w(specs, 6, 8, 2, 32, 16, 2, 17);
    unsetenv("KVB_CPU_SIMD");
}
KVB_TEST_END

KVB_TEST(attention_paths_mha_mqa) {
    rng_state = 4;
    seq_spec specs[] = {{1, 65}, {64, 64}, {33, 90}};
    check_attention(specs, 3, 4, 4, 16, 16, 2); /* MHA */
    check_attention(specs, 3, 6, 1, 64, 32, 2); /* MQA */
}
KVB_TEST_END

/* Sliding windows (Mistral, Qwen2): smaller than one block, across blocks, wider than some contexts,
 * on both paths (decode walk and the sgemm tiles, whose rows start their windows at different keys). */
KVB_TEST(attention_sliding_window) {
    rng_state = 5;
    /* the last two: decode walks whose windows start inside a later chunk of keys or span two */
    seq_spec specs[] = {{1, 40}, {3, 3}, {300, 300}, {70, 133}, {1, 1}, {5, 90}, {1, 1300}, {2, 1030}};
    int windows[] = {1, 5, 17, 64, 200, 600};
    for (size_t w = 0; w < KVB_ARRAY_LEN(windows); w++) {
        check_attention_w(specs, 8, 8, 2, 32, 7, 3, windows[w]);
        check_attention_w(specs, 8, 8, 2, 32, 16, 1, windows[w]);
    }
    check_attention_w(specs, 6, 6, 1, 64, 32, 2, 33); /* MQA */
}
KVB_TEST_END

/* "cpu:bf16" without the bf16 dot products: attention on a bf16 cache gives the bits an f32 cache holding
 * the same (bf16) values gives, on every path that widens the cache to f32 (decode walk over one and
 * several chunks, the gemm tiles, sliding windows; AVX-512 without AVX512_BF16, AVX2 and the generic
 * loops), and both are within the f32 tolerance of the double reference on those values: there the
 * cache's rounding is the whole difference between "cpu" and "cpu:bf16". The walk on the bf16 dot
 * products also rounds q and the softmax weights (attention_bf16_dot). */
KVB_TEST(attention_bf16_cache) {
    seq_spec specs[] = {{1, 40}, {3, 3}, {300, 300}, {70, 133}, {1, 1}, {1, 1300}, {2, 1025}};
    int shapes[][3] = {{8, 2, 32}, {12, 4, 64}, {6, 1, 64}, {6, 3, 24}}, bss[] = {7, 16}, windows[] = {0, 17};
    const char *simd[] = {"avx512", "avx2", "0"};
    int n_tok = 378;
    for (size_t v = 0; v < KVB_ARRAY_LEN(simd); v++)
        for (size_t i = 0; i < KVB_ARRAY_LEN(shapes); i++)
            for (size_t j = 0; j < KVB_ARRAY_LEN(bss); j++) {
                int nh = shapes[i][0], nkv = shapes[i][1], hd = shapes[i][2], w = windows[(i + j) % 2];
                size_t floats = (size_t)n_tok * nh * hd;
                float *f32 = malloc(sizeof(float) * floats), *bf16 = malloc(sizeof(float) * floats);
                if (simd[v]) setenv("KVB_CPU_SIMD", simd[v], 1);
                attn_kv = KV_ROUNDED;
                rng_state = 21;
                check_attention_keep(specs, 7, nh, nkv, hd, bss[j], 1 + (int)j % 2, w, f32);
                attn_kv = KV_BF16;
                rng_state = 21;
                check_attention_keep(specs, 7, nh, nkv, hd, bss[j], 1 + (int)j % 2, w, bf16);
                attn_kv = KV_F32;
                unsetenv("KVB_CPU_SIMD");
                ck_assert_msg(!memcmp(f32, bf16, sizeof(float) * floats),
                              "simd %s heads %d/%d hd %d block size %d window %d: the bf16 cache gives other bits than "
                              "an f32 cache of the same values",
                              simd[v], nh, nkv, hd, bss[j], w);
                free(f32);
                free(bf16);
            }
}
KVB_TEST_END

static const char *need_avx512bf16(void) {
    const char *simd = getenv("KVB_CPU_SIMD");
    if (simd && *simd) return "KVB_CPU_SIMD is set: the walk does not take the bf16 dot products";
#if defined(__x86_64__) && defined(__GNUC__)
    if (need_avx512() == NULL && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
        return NULL;
#endif
    return "the processor has no AVX512_BF16 (the walk widens the bf16 cache, attention_bf16_cache)";
}

/* "cpu:bf16" on the bf16 dot products (AVX512_BF16; head sizes 64 and 128, groups of 1 to 6 heads): the
 * decode walk's rows match a float64 reference of the same arithmetic (q and each chunk's softmax weights
 * rounded to bf16, the bf16 K and V, exact products and sums) within 1e-5 of the largest output past the
 * slack of weights at a rounding midpoint; they are within 1e-2 of the widening walk (KVB_CPU_SIMD=avx512)
 * and not its bits; they are the same bits at every block size (keys pair by position, across blocks).
 * Decode rows over one and several chunks, chunked prefill rows after a past (under 32 rows a KV head:
 * the walk), contexts that are not multiples of 4 or of the block size, sliding windows; the rows of 40
 * tokens take the gemm tiles (unchanged: the exact reference). */
KVB_TEST(attention_bf16_dot) {
    seq_spec specs[] = {{1, 1}, {1, 7}, {2, 61}, {5, 90}, {1, 600}, {3, 1030}, {1, 1301}, {40, 75}};
    int n_tok = 54, shapes[][3] = {{12, 4, 64}, {8, 2, 128}, {6, 1, 64}, {4, 4, 64}, {10, 2, 64}, {4, 2, 128}, {2, 2, 128}};
    int bss[] = {16, 1, 5, 32}, windows[] = {0, 17, 600};
    for (size_t i = 0; i < KVB_ARRAY_LEN(shapes); i++) {
        int nh = shapes[i][0], nkv = shapes[i][1], hd = shapes[i][2], w = windows[i % 3];
        size_t floats = (size_t)n_tok * nh * hd;
        float *first = malloc(sizeof(float) * floats), *dot = malloc(sizeof(float) * floats);
        float *wide = malloc(sizeof(float) * floats);
        double *wd = malloc(sizeof(double) * floats);
        for (size_t j = 0; j < KVB_ARRAY_LEN(bss); j++) {
            attn_kv = KV_BF16;
            attn_ref_bf16dot = 1;
            rng_state = 31;
            check_attention_keep(specs, 8, nh, nkv, hd, bss[j], 1 + (int)j % 2, w, j ? dot : first);
            double e_dot = attn_last_err;
            attn_ref_bf16dot = 0;
            setenv("KVB_CPU_SIMD", "avx512", 1);
            rng_state = 31;
            check_attention_keep(specs, 8, nh, nkv, hd, bss[j], 1 + (int)j % 2, w, wide);
            unsetenv("KVB_CPU_SIMD");
            attn_kv = KV_F32;
            for (size_t x = 0; x < floats; x++) wd[x] = wide[x];
            double d = rel_err(j ? dot : first, wd, floats);
            if (!j) printf("bf16 dot: heads %d/%d hd %d window %d: %.2g from the reference, %.2g from the widening walk\n",
                           nh, nkv, hd, w, e_dot, d);
            ck_assert_msg(d < 1e-2 && d > 0, "heads %d/%d hd %d block size %d window %d: %g from the widening walk", nh,
                          nkv, hd, bss[j], w, d);
            ck_assert_msg(!j || !memcmp(first, dot, sizeof(float) * floats),
                          "heads %d/%d hd %d window %d: block size %d gives other bits than block size %d", nh, nkv, hd, w,
                          bss[j], bss[0]);
        }
        free(first);
        free(dot);
        free(wide);
        free(wd);
    }
}
KVB_TEST_END

/* kv_write into a bf16 cache rounds each K and V element to the nearest bf16 (ties to even), at its slot. */
KVB_TEST(kv_write_bf16_rounds) {
    kvb_backend *be = make_backend_named("cpu:bf16", 1);
    enum { NKV = 2, HD = 8, BS = 4, ROW = NKV * HD };
    kvb_kv_geom g = {.n_layers = 1, .n_kv_heads = NKV, .head_dim = HD, .block_size = BS, .elem_size = 2};
    static uint16_t blocks[2][2 * BS * ROW];
    void *ptrs[2] = {blocks[1], blocks[0]};
    float k[3 * ROW], v[3 * ROW];
    rng_state = 9;
    fill(k, 3 * ROW);
    fill(v, 3 * ROW);
    k[0] = 1.0f + 0x1p-8f; /* a tie: to even (1.0) */
    k[1] = 1.0f + 0x3p-8f; /* a tie: to even (1 + 2^-6) */
    kvb_attn_seq sq = {.q_start = 0, .q_len = 3, .ctx_len = 6, .n_blocks = 2, .blk_first = 0};
    kvb_attn_batch b = {.geom = &g, .n_heads = NKV, .n_tokens = 3, .n_seqs = 1, .seqs = &sq, .layer_blocks = ptrs};
    ck_assert_int_eq(be->iface->kv_write(be->ctx, &b, k, v), KVB_OK);
    for (int t = 0; t < 3; t++) {
        int p = 3 + t;
        const uint16_t *blk = ptrs[p / BS];
        for (int i = 0; i < ROW; i++) {
            ck_assert_uint_eq(blk[(size_t)(p % BS) * ROW + i], kvb_f32_to_bf16(k[t * ROW + i]));
            ck_assert_uint_eq(blk[(size_t)(BS + p % BS) * ROW + i], kvb_f32_to_bf16(v[t * ROW + i]));
        }
    }
    ck_assert_uint_eq(((uint16_t *)ptrs[0])[3 * ROW], 0x3f80);
    ck_assert_uint_eq(((uint16_t *)ptrs[0])[3 * ROW + 1], 0x3f82);
    kvb_backend_destroy(be);
}
KVB_TEST_END

/* bias_add: y[i][:] += b[:], row by row. */
KVB_TEST(bias_add_rows) {
    rng_state = 6;
    kvb_backend *be = make_backend(3);
    enum { N = 300, D = 257 };
    static float y[N * D], y0[N * D], bv[D];
    fill(y, N * D);
    fill(bv, D);
    memcpy(y0, y, sizeof y);
    kvb_tensor tb;
    ck_assert_int_eq(be->iface->weight_load(be->ctx, bv, KVB_DTYPE_F32, D, 1, &tb), KVB_OK);
    ck_assert_int_eq(be->iface->bias_add(be->ctx, y, N, &tb), KVB_OK);
    for (int i = 0; i < N; i++)
        for (int c = 0; c < D; c++) ck_assert_float_eq(y[i * D + c], y0[i * D + c] + bv[c]);
    be->iface->weight_free(be->ctx, &tb);
    kvb_backend_destroy(be);
}
KVB_TEST_END

/* ---------------------------------------------------------------- copy_async's piece plan (copy_plan.h) */

/* Applies pieces x[0..n) to memory in the order given (rev: the reverse order). */
static void apply_pieces(const kvb_copy_piece *x, int n, int rev) {
    for (int k = 0; k < n; k++) {
        const kvb_copy_piece *p = &x[rev ? n - 1 - k : k];
        memmove(p->dst, p->src, p->bytes);
    }
}

/* O(n^2): whether some piece writes bytes another piece writes or any piece reads. */
static int naive_independent(const kvb_copy_piece *x, int n) {
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            if (!x[i].bytes || !x[j].bytes) continue;
            uintptr_t d = (uintptr_t)x[i].dst, s = (uintptr_t)x[j].src, e = (uintptr_t)x[j].dst;
            if (d < s + x[j].bytes && s < d + x[i].bytes) return 0;
            if (i != j && d < e + x[j].bytes && e < d + x[i].bytes) return 0;
        }
    return 1;
}

KVB_TEST(copy_plan_pieces) {
    enum { MEM = 4096, N = 24 };
    static unsigned char mem[MEM], a[MEM], b[MEM];
    kvb_copy_piece x[N], m[N];
    kvb_copy_span scratch[3 * N];
    /* fixed cases: halves of a slot merge; a piece continuing only the destination does not; empty pieces go */
    kvb_copy_piece f[4] = {{mem + 1000, mem, 100}, {mem + 1100, mem + 100, 50}, {mem + 1150, mem + 500, 10},
                           {mem + 3000, mem + 600, 0}};
    ck_assert_int_eq(kvb_copy_coalesce(f, 4, m), 2);
    ck_assert_ptr_eq(m[0].dst, mem + 1000);
    ck_assert_uint_eq(m[0].bytes, 150);
    ck_assert_uint_eq(m[1].bytes, 10);
    /* a shift inside one buffer: merged, the second half would read what the first wrote */
    kvb_copy_piece sh[2] = {{mem + 64, mem, 64}, {mem + 128, mem + 64, 64}};
    ck_assert_int_eq(kvb_copy_coalesce(sh, 2, m), 2);
    ck_assert_int_eq(kvb_copy_independent(sh, 2, scratch), 0);
    /* two pieces reading the same bytes are independent; two writing the same are not */
    kvb_copy_piece rd[2] = {{mem + 2000, mem, 64}, {mem + 3000, mem + 32, 64}};
    ck_assert_int_eq(kvb_copy_independent(rd, 2, scratch), 1);
    kvb_copy_piece wr[2] = {{mem + 2000, mem, 64}, {mem + 2063, mem + 500, 64}};
    ck_assert_int_eq(kvb_copy_independent(wr, 2, scratch), 0);
    /* random pieces in one buffer: the coalesced pieces in order copy what the originals in order copy,
     * and kvb_copy_independent agrees with the pairwise check; independent pieces copy the same in
     * reverse order */
    rng_state = 31;
    int n_indep = 0;
    for (int trial = 0; trial < 4000; trial++) {
        int n = 1 + (int)((frand() + 1) * 0.5f * (N - 1));
        int spread = trial % 2 ? MEM : 600; /* dense: overlaps are common */
        for (int i = 0; i < n; i++) {
            size_t len = (size_t)((frand() + 1) * 0.5f * 48);
            size_t d = (size_t)((frand() + 1) * 0.5f * (spread - 64)), s = (size_t)((frand() + 1) * 0.5f * (spread - 64));
            if (i && frand() < -0.3f) { /* continue the previous piece on both sides */
                d = (size_t)((unsigned char *)x[i - 1].dst - mem) + x[i - 1].bytes;
                s = (size_t)((const unsigned char *)x[i - 1].src - mem) + x[i - 1].bytes;
                if (d + len > MEM || s + len > MEM) len = 0;
            }
            x[i] = (kvb_copy_piece){mem + d, mem + s, len};
        }
        for (int i = 0; i < MEM; i++) mem[i] = (unsigned char)(i * 7 + trial);
        memcpy(b, mem, MEM);
        apply_pieces(x, n, 0);
        memcpy(a, mem, MEM);
        memcpy(mem, b, MEM);
        int k = kvb_copy_coalesce(x, n, m);
        ck_assert_int_le(k, n);
        apply_pieces(m, k, 0);
        ck_assert_msg(!memcmp(mem, a, MEM), "trial %d: the %d coalesced pieces copy otherwise than the %d", trial, k, n);
        int ind = kvb_copy_independent(m, k, scratch);
        ck_assert_int_eq(ind, naive_independent(m, k));
        if (ind) {
            n_indep++;
            memcpy(mem, b, MEM);
            apply_pieces(m, k, 1);
            ck_assert_msg(!memcmp(mem, a, MEM), "trial %d: independent pieces copy otherwise in reverse", trial);
        }
    }
    ck_assert_int_gt(n_indep, 200); /* both answers were exercised */
    ck_assert_int_lt(n_indep, 3800);
}
KVB_TEST_END

KVB_TEST_MAIN("kernels", KVB_T(unknown_backend, 10), KVB_T(matmul_split_rows, 60), KVB_T_NEED(matmul_batch_invariant, 30, need_avx2), KVB_T(matmul_n_matches_matmul, 30), KVB_T(weight_load_half, 10),
              KVB_T(matmul_half_weights_exact, 120), KVB_T(weight_view_half, 10), KVB_T(e4m3_conversions, 10),
              KVB_T_NEED(fp8_quant_rows, 10, need_avx2), KVB_T(matmul_fp8, 120),
              KVB_T(rmsnorm_rope_silu, 30), KVB_T(attention_paths_gqa, 120), KVB_T(attention_decode_block_sizes, 60), KVB_T_NEED(attention_decode_widths, 60, need_avx512), KVB_T(attention_paths_mha_mqa, 60), KVB_T(generic_paths, 120),
              KVB_T(attention_sliding_window, 120), KVB_T(attention_bf16_cache, 300), KVB_T_NEED(attention_bf16_dot, 300, need_avx512bf16), KVB_T(kv_write_bf16_rounds, 10),
              KVB_T(bias_add_rows, 10), KVB_T(copy_plan_pieces, 30))
