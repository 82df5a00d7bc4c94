/* Backend consistency: every kernel of every compiled backend other than cpu against its CPU twin, on
 * fresh random inputs, with a normalized error ||got - cpu||_2 / ||cpu||_2 per dtype (f32 1e-5,
 * f16 5e-3, bf16 2e-2). Inputs are rounded to the backend's dtype first, so both sides compute on the
 * same values and the tolerance covers only arithmetic and output rounding.
 *
 * The CUDA backend is checked in its three variants (cuda:f32, cuda:f16, cuda = bf16): embedding and
 * row gather, matmul (beta 0 and 1, weights uploaded from f32/f16/bf16), RMSNorm (rows and per-head),
 * RoPE, SiLU.mul, residual add, bias add, KV write (exact), paged attention (decode with and without
 * context splits, prefill tiles on tensor cores (bf16, f16) and CUDA cores (f32, odd head sizes),
 * chunked prefill after a past with key splits, GQA/MHA/MQA, head sizes 6..256, block sizes 1..32,
 * contexts up to 9000, sliding windows), block copy/gather/scatter (exact), the backend's device-to-device copy
 * from a second thread while operators run (the LSC copy thread), greedy/top-k/top-p sampling against
 * kvb_sample, and the memory pieces (device region handle, pinned buffers, events, VMM chunks).
 *
 * Without a GPU (or without CUDA in the build) the program prints "SKIP: ..." and exits 77, which
 * automake counts as skipped: this test never passes on a machine that cannot run it. The device
 * probe runs in a child process, so the runner itself never initialises CUDA before it forks the
 * tests (CUDA does not survive fork). */
#include "config.h"

#include <math.h>
#include <pthread.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/sched/sampling.h"
#include "common/mem/mem.h"
#include "kernels/backend.h"
#include "tests/harness.h"

#ifdef KVB_WITH_CUDA
#include "kernels/cuda/attention.h"
#include "kernels/cuda/backend_cuda.h"
#include "kernels/cuda/blocks.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/gemv.h"
#include "kernels/cuda/sampling.h"

/* ---------------------------------------------------------------- helpers */

typedef struct variant {
    const char *name;
    kvb_dtype dt;
    double tol;
} variant;

static const variant VARIANTS[] = {
    {"cuda:f32", KVB_DTYPE_F32, 1e-5},
    {"cuda:f16", KVB_DTYPE_F16, 5e-3},
    {"cuda", KVB_DTYPE_BF16, 2e-2},
};
#define N_VARIANTS ((int)KVB_ARRAY_LEN(VARIANTS))

static uint64_t rng_state;
static float frand(void) { /* uniform in [-1, 1) */
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng_state >> 40) / (double)(1ull << 24)) * 2.0f - 1.0f;
}

static float round_dt(float x, kvb_dtype dt) {
    switch (dt) {
    case KVB_DTYPE_F16: return kvb_f16_to_f32(kvb_f32_to_f16(x));
    case KVB_DTYPE_BF16: return kvb_bf16_to_f32(kvb_f32_to_bf16(x));
    default: return x;
    }
}

/* n random values in [-scale, scale), already representable in dt. Caller frees. */
static float *rand_vec(size_t n, float scale, kvb_dtype dt) {
    float *x = malloc(n * sizeof(float) + 1);
    ck_assert_ptr_nonnull(x);
    for (size_t i = 0; i < n; i++) x[i] = round_dt(frand() * scale, dt);
    return x;
}

/* x as dt elements (host bytes). Caller frees. */
static void *encode(const float *x, size_t n, kvb_dtype dt) {
    size_t es = kvb_dtype_size(dt);
    char *b = malloc(n * es + 1);
    ck_assert_ptr_nonnull(b);
    for (size_t i = 0; i < n; i++) {
        if (dt == KVB_DTYPE_F32) memcpy(b + 4 * i, &x[i], 4);
        else {
            uint16_t h = dt == KVB_DTYPE_F16 ? kvb_f32_to_f16(x[i]) : kvb_f32_to_bf16(x[i]);
            memcpy(b + 2 * i, &h, 2);
        }
    }
    return b;
}

static void decode_dt(const void *b, size_t n, kvb_dtype dt, float *out) {
    for (size_t i = 0; i < n; i++) {
        if (dt == KVB_DTYPE_F32) memcpy(&out[i], (const char *)b + 4 * i, 4);
        else {
            uint16_t h;
            memcpy(&h, (const char *)b + 2 * i, 2);
            out[i] = dt == KVB_DTYPE_F16 ? kvb_f16_to_f32(h) : kvb_bf16_to_f32(h);
        }
    }
}

/* A backend buffer holding x (n values) in the backend's activation dtype. */
static void *upload(kvb_backend *be, const float *x, size_t n) {
    kvb_dtype dt = be->iface->act_dtype;
    void *d = NULL;
    ck_assert_int_eq(kvb_mem_alloc(be->mem, n * kvb_dtype_size(dt), &d), KVB_OK);
    void *h = encode(x, n, dt);
    ck_assert_int_eq(be->iface->to_device(be->ctx, d, h, n * kvb_dtype_size(dt)), KVB_OK);
    free(h);
    return d;
}

static float *download(kvb_backend *be, const void *d, size_t n) {
    float *x = malloc(n * sizeof(float) + 1);
    ck_assert_ptr_nonnull(x);
    ck_assert_int_eq(be->iface->to_host_f32(be->ctx, x, d, n), KVB_OK);
    return x;
}

/* A product's output buffer of n values and OUT_GUARD more: y0 when the product adds to it (keep),
 * else NaN, which an element the product skips leaves for nerr to find (a row in thousands is under
 * the normalised error's tolerance); the guard holds OUT_GUARD_VAL, which a write past the end changes
 * (CHECK_GUARD). */
#define OUT_GUARD 8
#define OUT_GUARD_VAL 7.0f
static void *upload_out(kvb_backend *be, const float *y0, size_t n, int keep) {
    float *v = malloc(sizeof(float) * (n + OUT_GUARD));
    ck_assert_ptr_nonnull(v);
    for (size_t i = 0; i < n; i++) v[i] = keep ? y0[i] : NAN;
    for (size_t i = n; i < n + OUT_GUARD; i++) v[i] = OUT_GUARD_VAL;
    void *d = upload(be, v, n + OUT_GUARD);
    free(v);
    return d;
}

/* got: a download of n + OUT_GUARD values of an upload_out buffer. */
#define CHECK_GUARD(got, n, what, ...)                                                                \
    for (size_t k_ = (n); k_ < (n) + OUT_GUARD; k_++)                                                   \
        ck_assert_msg((got)[k_] == OUT_GUARD_VAL, what ": wrote %g past the end of y", __VA_ARGS__, (double)(got)[k_])

/* ||a - ref||_2 / ||ref||_2 (a NaN anywhere gives +inf). */
static double nerr(const float *a, const float *ref, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(a[i])) return INFINITY;
        double d = (double)a[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

#define CHECK_CLOSE(got, ref, n, v, what, ...)                                                          \
    do {                                                                                               \
        double e_ = nerr((got), (ref), (n));                                                           \
        ck_assert_msg(e_ <= (v)->tol, "%s: " what ": normalized error %.3g > %.3g", (v)->name, __VA_ARGS__, e_, \
                      (v)->tol);                                                                       \
    } while (0)

static kvb_backend *make(const char *name) {
    kvb_backend *be = NULL;
    ck_assert_int_eq(kvb_backend_create(name, 2, &be), KVB_OK);
    return be;
}

/* A weight on both backends from the same values (rounded to dt), uploaded from src_dt bytes. */
static void load_both(kvb_backend *cpu, kvb_backend *gpu, const float *w, int64_t rows, int64_t cols, kvb_dtype src_dt,
                      kvb_tensor *tc, kvb_tensor *tg) {
    void *src = encode(w, (size_t)rows * cols, src_dt);
    ck_assert_int_eq(cpu->iface->weight_load(cpu->ctx, src, src_dt, rows, cols, tc), KVB_OK);
    ck_assert_int_eq(gpu->iface->weight_load(gpu->ctx, src, src_dt, rows, cols, tg), KVB_OK);
    free(src);
}

/* ---------------------------------------------------------------- tests */

KVB_TEST(variants_and_errors) {
    kvb_backend *be = NULL;
    ck_assert_int_eq(kvb_backend_create("cuda:f8", 1, &be), KVB_ERR_INVALID);
    ck_assert_ptr_null(be);
    ck_assert_int_eq(kvb_backend_create("cudax", 1, &be), KVB_ERR_UNSUPPORTED);
    for (int v = 0; v < N_VARIANTS; v++) {
        be = make(VARIANTS[v].name);
        ck_assert_int_eq(be->iface->act_dtype, VARIANTS[v].dt);
        kvb_dtype named; /* what kvbankd sizes KV blocks by, without a backend */
        ck_assert_int_eq(kvb_backend_act_dtype(VARIANTS[v].name, &named), KVB_OK);
        ck_assert_int_eq(named, be->iface->act_dtype);
        ck_assert(kvb_cuda_backend_is(be));
        ck_assert_ptr_nonnull(kvb_cuda_backend_stream(be));
        kvb_cuda_device_info info;
        ck_assert_int_eq(kvb_cuda_backend_info(be, &info), KVB_OK);
        ck_assert_int_gt(info.n_sm, 0);
        /* a launcher refuses the legacy default stream */
        ck_assert_int_ne(kvb_cuda_add(NULL, NULL, NULL, VARIANTS[v].dt, 16, NULL), 0);
        kvb_backend_destroy(be);
    }
    kvb_backend *cpu = make("cpu");
    ck_assert(!kvb_cuda_backend_is(cpu));
    ck_assert_ptr_null(kvb_cuda_backend_stream(cpu));
    kvb_backend_destroy(cpu);
}
KVB_TEST_END

KVB_TEST(embed_gather_rows) {
    rng_state = 11;
    kvb_backend *cpu = make("cpu");
    for (int v = 0; v < N_VARIANTS; v++) {
        const variant *V = &VARIANTS[v];
        kvb_backend *gpu = make(V->name);
        int dims[] = {200, 4096, 37};
        for (size_t di = 0; di < KVB_ARRAY_LEN(dims); di++) {
            int vocab = 1000, dim = dims[di], n = 77;
            float *table = rand_vec((size_t)vocab * dim, 1.0f, V->dt);
            kvb_tensor tc, tg;
            load_both(cpu, gpu, table, vocab, dim, KVB_DTYPE_F32, &tc, &tg);
            int32_t ids[77];
            for (int i = 0; i < n; i++) ids[i] = (int32_t)((frand() + 1) * 0.5f * (vocab - 1));
            ids[0] = 0;
            ids[1] = vocab - 1;
            float *oc = malloc(sizeof(float) * n * dim);
            void *og = NULL;
            ck_assert_int_eq(kvb_mem_alloc(gpu->mem, (size_t)n * dim * kvb_dtype_size(V->dt), &og), KVB_OK);
            ck_assert_int_eq(cpu->iface->embed(cpu->ctx, &tc, ids, n, oc), KVB_OK);
            ck_assert_int_eq(gpu->iface->embed(gpu->ctx, &tg, ids, n, og), KVB_OK);
            float *got = download(gpu, og, (size_t)n * dim);
            ck_assert_int_eq(memcmp(got, oc, sizeof(float) * n * dim), 0); /* a copy: exact */
            /* gather_rows out of an activation buffer */
            int32_t rows[5] = {76, 0, 3, 3, 40};
            float *gc = malloc(sizeof(float) * 5 * dim);
            void *gg = NULL;
            ck_assert_int_eq(kvb_mem_alloc(gpu->mem, (size_t)5 * dim * kvb_dtype_size(V->dt), &gg), KVB_OK);
            ck_assert_int_eq(cpu->iface->gather_rows(cpu->ctx, oc, rows, 5, dim, gc), KVB_OK);
            ck_assert_int_eq(gpu->iface->gather_rows(gpu->ctx, og, rows, 5, dim, gg), KVB_OK);
            float *got2 = download(gpu, gg, (size_t)5 * dim);
            ck_assert_int_eq(memcmp(got2, gc, sizeof(float) * 5 * dim), 0);
            kvb_mem_free(gpu->mem, og);
            kvb_mem_free(gpu->mem, gg);
            cpu->iface->weight_free(cpu->ctx, &tc);
            gpu->iface->weight_free(gpu->ctx, &tg);
            free(table);
            free(oc);
            free(got);
            free(gc);
            free(got2);
        }
        kvb_backend_destroy(gpu);
    }
    kvb_backend_destroy(cpu);
}
KVB_TEST_END

KVB_TEST(matmul) {
    rng_state = 12;
    kvb_backend *cpu = make("cpu");
    /* n <= 8 with 16-byte rows take the gemv kernel (from 4096 weight rows with 2 rows a warp, from 8192
     * with 4 when n <= 4: gemv.cu's pick_r; the rows here leave the last warp part empty and the last
     * block part past the rows); 9..64 rows of bf16/f16 with 32-column chunks the tensor-core kernel
     * (rows not a multiple of its 16 included); the others cuBLAS */
    int shapes[][3] = {{1, 300, 200},  {5, 257, 64},  {33, 512, 128}, {2, 17, 9},    {64, 1024, 4096}, {1, 4096, 1024},
                       {8, 96, 136},   {3, 40, 2056}, {9, 200, 96},   {16, 77, 64},  {40, 48, 320},    {65, 64, 128},
                       {1, 8197, 584}, {4, 8195, 32}, {3, 8194, 40},  {2, 4101, 1096}, {5, 4099, 32},  {6, 4097, 40},
                       {7, 4103, 32},  {8, 4099, 64}};
    kvb_dtype srcs[] = {KVB_DTYPE_F32, KVB_DTYPE_F16, KVB_DTYPE_BF16};
    for (int v = 0; v < N_VARIANTS; v++) {
        const variant *V = &VARIANTS[v];
        kvb_backend *gpu = make(V->name);
        for (size_t si = 0; si < KVB_ARRAY_LEN(shapes); si++) {
            int n = shapes[si][0], rows = shapes[si][1], cols = shapes[si][2];
            kvb_dtype src_dt = srcs[si % 3];
            /* values representable in both the source dtype and the backend's */
            float *w = rand_vec((size_t)rows * cols, 0.1f, V->dt);
            for (size_t i = 0; i < (size_t)rows * cols; i++) w[i] = round_dt(round_dt(w[i], src_dt), V->dt);
            float *x = rand_vec((size_t)n * cols, 1.0f, V->dt), *y0 = rand_vec((size_t)n * rows, 1.0f, V->dt);
            kvb_tensor tc, tg;
            load_both(cpu, gpu, w, rows, cols, src_dt, &tc, &tg);
            void *xg = upload(gpu, x, (size_t)n * cols);
            for (int beta = 0; beta <= 1; beta++) {
                float *yc = malloc(sizeof(float) * n * rows);
                memcpy(yc, y0, sizeof(float) * n * rows);
                void *yg = upload_out(gpu, y0, (size_t)n * rows, beta);
                ck_assert_int_eq(cpu->iface->matmul(cpu->ctx, x, n, &tc, (float)beta, yc), KVB_OK);
                ck_assert_int_eq(gpu->iface->matmul(gpu->ctx, xg, n, &tg, (float)beta, yg), KVB_OK);
                float *got = download(gpu, yg, (size_t)n * rows + OUT_GUARD);
                CHECK_CLOSE(got, yc, (size_t)n * rows, V, "matmul n=%d %dx%d beta=%d from %s", n, rows, cols, beta,
                            kvb_dtype_name(src_dt));
                CHECK_GUARD(got, (size_t)n * rows, "%s: matmul n=%d %dx%d", V->name, n, rows, cols);
                kvb_mem_free(gpu->mem, yg);
                free(yc);
                free(got);
            }
            kvb_mem_free(gpu->mem, xg);
            cpu->iface->weight_free(cpu->ctx, &tc);
            gpu->iface->weight_free(gpu->ctx, &tg);
            free(w);
            free(x);
            free(y0);
        }
        kvb_backend_destroy(gpu);
    }
    kvb_backend_destroy(cpu);
}
KVB_TEST_END

/* Weights loaded stacked are the separate loads one after another, bit for bit. */
static void check_stacked_load(kvb_backend *gpu, const variant *V, const float *w, const int64_t *rows, int n,
                               int64_t cols) {
    size_t es = kvb_dtype_size(cols == 1 ? KVB_DTYPE_F32 : V->dt);
    const void *src[3];
    kvb_dtype sdt[3] = {KVB_DTYPE_F32, KVB_DTYPE_BF16, KVB_DTYPE_F16};
    void *enc[3];
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        enc[i] = encode(w + total * cols, (size_t)(rows[i] * cols), sdt[i]);
        src[i] = enc[i];
        total += rows[i];
    }
    kvb_tensor st;
    ck_assert_int_eq(gpu->iface->weight_load_stacked(gpu->ctx, src, sdt, rows, n, cols, &st), KVB_OK);
    ck_assert_int_eq(st.ne[0], total);
    ck_assert_int_eq(st.ne[1], cols);
    char *all = malloc((size_t)(total * cols) * es), *one = malloc((size_t)(total * cols) * es);
    ck_assert_int_eq(gpu->iface->to_host(gpu->ctx, all, st.data, (size_t)(total * cols) * es), KVB_OK);
    int64_t off = 0;
    for (int i = 0; i < n; i++) {
        kvb_tensor t;
        ck_assert_int_eq(gpu->iface->weight_load(gpu->ctx, src[i], sdt[i], rows[i], cols, &t), KVB_OK);
        ck_assert_int_eq(gpu->iface->to_host(gpu->ctx, one, t.data, (size_t)(rows[i] * cols) * es), KVB_OK);
        ck_assert_msg(!memcmp(all + (size_t)(off * cols) * es, one, (size_t)(rows[i] * cols) * es),
                      "%s: stacked part %d differs from its own load", V->name, i);
        gpu->iface->weight_free(gpu->ctx, &t);
        off += rows[i];
        free(enc[i]);
    }
    gpu->iface->weight_free(gpu->ctx, &st);
    free(all);
    free(one);
}

/* The fused operators of the bf16/f16 variants (the model's stacked layer) against the CPU backend's
 * unfused sequence: RMSNorm then matmul; SiLU-mul of the two halves then matmul (beta 0 and 1), over
 * the gemv (1-8 rows), tensor-core (9-64) and cuBLAS (65+) paths; and stacked weight loads. */
KVB_TEST(matmul_fused) {
    rng_state = 24;
    kvb_backend *cpu = make("cpu");
    /* the last rows as in matmul: the gemv kernel's 4 and 2 rows a warp */
    int shapes[][3] = {{1, 300, 256},  {6, 64, 512},  {8, 96, 64},   {9, 200, 96},  {33, 128, 256},
                       {64, 48, 128},  {70, 64, 192}, {1, 8197, 584}, {4, 8195, 32}, {3, 8194, 40},
                       {2, 4101, 1096}, {5, 4099, 32}, {7, 4103, 40}, {8, 4099, 32}};
    for (int v = 0; v < N_VARIANTS; v++) {
        const variant *V = &VARIANTS[v];
        kvb_backend *gpu = make(V->name);
        if (!gpu->iface->weight_load_stacked) { /* f32 keeps the CPU backend's order of operations */
            ck_assert_ptr_null(gpu->iface->matmul_norm);
            kvb_backend_destroy(gpu);
            continue;
        }
        float *wst = rand_vec(3 * 40 * 64, 1.0f, V->dt);
        int64_t rows3[] = {40, 16, 16}, vrows[] = {40, 16, 16};
        check_stacked_load(gpu, V, wst, rows3, 3, 64);
        check_stacked_load(gpu, V, wst, vrows, 3, 1);
        free(wst);
        for (size_t si = 0; si < KVB_ARRAY_LEN(shapes); si++) {
            int n = shapes[si][0], rows = shapes[si][1], cols = shapes[si][2];
            float *w = rand_vec((size_t)rows * cols, 0.1f, V->dt), *g = rand_vec((size_t)cols, 1.0f, KVB_DTYPE_F32);
            float *x = rand_vec((size_t)n * cols, 2.0f, V->dt), *gu = rand_vec((size_t)n * 2 * cols, 2.0f, V->dt);
            float *y0 = rand_vec((size_t)n * rows, 1.0f, V->dt);
            kvb_tensor wc, wg, gc, gg;
            load_both(cpu, gpu, w, rows, cols, KVB_DTYPE_F32, &wc, &wg);
            load_both(cpu, gpu, g, cols, 1, KVB_DTYPE_F32, &gc, &gg);
            void *xg = upload(gpu, x, (size_t)n * cols), *gug = upload(gpu, gu, (size_t)n * 2 * cols);
            /* RMSNorm folded into the product */
            float *h = malloc(sizeof(float) * n * cols), *yc = malloc(sizeof(float) * n * rows);
            ck_assert_int_eq(cpu->iface->rmsnorm(cpu->ctx, x, n, cols, &gc, 1e-5f, h), KVB_OK);
            ck_assert_int_eq(cpu->iface->matmul(cpu->ctx, h, n, &wc, 0.0f, yc), KVB_OK);
            void *yg = upload_out(gpu, y0, (size_t)n * rows, 0);
            ck_assert_int_eq(gpu->iface->matmul_norm(gpu->ctx, xg, n, &gg, 1e-5f, &wg, yg), KVB_OK);
            float *got = download(gpu, yg, (size_t)n * rows + OUT_GUARD);
            CHECK_CLOSE(got, yc, (size_t)n * rows, V, "matmul_norm n=%d %dx%d", n, rows, cols);
            CHECK_GUARD(got, (size_t)n * rows, "%s: matmul_norm n=%d %dx%d", V->name, n, rows, cols);
            free(got);
            float *x2 = download(gpu, xg, (size_t)n * cols); /* x is not changed */
            ck_assert_int_eq(memcmp(x2, x, sizeof(float) * n * cols), 0);
            free(x2);
            /* SiLU-mul of the stacked gate/up product folded into the product */
            for (int beta = 0; beta <= 1; beta++) {
                float *act = malloc(sizeof(float) * n * cols);
                for (int t = 0; t < n; t++)
                    ck_assert_int_eq(cpu->iface->silu_mul(cpu->ctx, gu + (size_t)t * 2 * cols, gu + (size_t)t * 2 * cols + cols,
                                                          (size_t)cols, act + (size_t)t * cols),
                                     KVB_OK);
                memcpy(yc, y0, sizeof(float) * n * rows);
                ck_assert_int_eq(cpu->iface->matmul(cpu->ctx, act, n, &wc, (float)beta, yc), KVB_OK);
                void *yg2 = upload_out(gpu, y0, (size_t)n * rows, beta);
                ck_assert_int_eq(gpu->iface->matmul_swiglu(gpu->ctx, gug, n, &wg, (float)beta, yg2), KVB_OK);
                float *got2 = download(gpu, yg2, (size_t)n * rows + OUT_GUARD);
                CHECK_CLOSE(got2, yc, (size_t)n * rows, V, "matmul_swiglu n=%d %dx%d beta %d", n, rows, cols, beta);
                CHECK_GUARD(got2, (size_t)n * rows, "%s: matmul_swiglu n=%d %dx%d beta %d", V->name, n, rows, cols, beta);
                kvb_mem_free(gpu->mem, yg2);
                free(got2);
                free(act);
            }
            kvb_mem_free(gpu->mem, xg);
            kvb_mem_free(gpu->mem, gug);
            kvb_mem_free(gpu->mem, yg);
            cpu->iface->weight_free(cpu->ctx, &wc);
            gpu->iface->weight_free(gpu->ctx, &wg);
            cpu->iface->weight_free(cpu->ctx, &gc);
            gpu->iface->weight_free(gpu->ctx, &gg);
            free(w);
            free(g);
            free(x);
            free(gu);
            free(y0);
            free(h);
            free(yc);
        }
        kvb_backend_destroy(gpu);
    }
    kvb_backend_destroy(cpu);
}
KVB_TEST_END

/* The 9-64-row tensor-core product (gemv.cu's skinny2_kernel, v2; and v1 where it applies) through
 * its launchers against the CPU's unfused sequence: every input form (plain, RMSNorm folded, SwiGLU folded) with beta 0 and 1,
 * 9..64 input rows (not multiples of 8 or 16 included), weight rows not multiples of 16, columns
 * multiples of 8 but not of 32 (v1 refuses those), and plans with one split and several, one
 * activation tile a block and several (the SM count the plan assumes, 1 or 132, makes both; the
 * test fails if a case goes missing). A split product runs twice: same bits. Then the switch:
 * KVB_CUDA_SKINNY=v1 selects the kernel before (launch counts), anything but v1/v2 fails the
 * backend's creation. */
enum { SK_PLAIN, SK_NORM, SK_SWIGLU };

static void skinny_case(kvb_backend *cpu, kvb_backend *gpu, const variant *V, int skinny, int n, int rows, int cols,
                        int n_sm, int seen[2][2]) {
    kvb_cuda_gemv_ctx g = {.skinny = skinny, .n_sm = n_sm};
    kvb_cuda_gemv_plan plan;
    kvb_cuda_gemv_plan_of(&g, rows, cols, n, &plan);
    ck_assert_int_eq(plan.blocks, plan.splits * ((rows + plan.block_rows - 1) / plan.block_rows));
    if (skinny == KVB_CUDA_SKINNY_V1) plan.splits = 1; /* v1 splits in the block, with no workspace */
    seen[plan.splits > 1][plan.tiles > 1] = 1;
    size_t n_counters = 0, floats = kvb_cuda_gemv_workspace(&g, V->dt, rows, cols, n, &n_counters);
    ck_assert(plan.splits > 1 ? floats > 0 && n_counters > 0 : floats == 0);
    if (floats) { /* the counters start zero, and every launch leaves them so */
        ck_assert_int_eq(kvb_mem_alloc(gpu->mem, floats * sizeof(float), (void **)&g.part), KVB_OK);
        ck_assert_int_eq(kvb_mem_alloc(gpu->mem, n_counters * sizeof(int32_t), (void **)&g.counters), KVB_OK);
        int32_t *zero = calloc(n_counters, sizeof(int32_t));
        ck_assert_int_eq(gpu->iface->to_device(gpu->ctx, g.counters, zero, n_counters * sizeof(int32_t)), KVB_OK);
        free(zero);
    }
    kvb_cuda_stream_t s = kvb_cuda_backend_stream(gpu);
    float *w = rand_vec((size_t)rows * cols, 0.1f, V->dt), *gn = rand_vec((size_t)cols, 1.0f, KVB_DTYPE_F32);
    float *x = rand_vec((size_t)n * 2 * cols, 2.0f, V->dt), *y0 = rand_vec((size_t)n * rows, 1.0f, V->dt);
    kvb_tensor wc, wg, gc, gg;
    load_both(cpu, gpu, w, rows, cols, KVB_DTYPE_F32, &wc, &wg);
    load_both(cpu, gpu, gn, cols, 1, KVB_DTYPE_F32, &gc, &gg);
    void *xg = upload(gpu, x, (size_t)n * 2 * cols);
    float *in = malloc(sizeof(float) * n * cols), *yc = malloc(sizeof(float) * n * rows);
    for (int mode = SK_PLAIN; mode <= SK_SWIGLU; mode++) {
        /* the CPU's input: x [n][cols] (the first n * cols values), its RMSNorm, or SiLU-mul of x [n][2 cols] */
        if (mode == SK_PLAIN) memcpy(in, x, sizeof(float) * n * cols);
        if (mode == SK_NORM) ck_assert_int_eq(cpu->iface->rmsnorm(cpu->ctx, x, n, cols, &gc, 1e-5f, in), KVB_OK);
        if (mode == SK_SWIGLU)
            for (int t = 0; t < n; t++)
                ck_assert_int_eq(cpu->iface->silu_mul(cpu->ctx, x + (size_t)t * 2 * cols, x + (size_t)t * 2 * cols + cols,
                                                      (size_t)cols, in + (size_t)t * cols),
                                 KVB_OK);
        for (int beta = 0; beta <= 1; beta++) {
            memcpy(yc, y0, sizeof(float) * n * rows);
            ck_assert_int_eq(cpu->iface->matmul(cpu->ctx, in, n, &wc, (float)beta, yc), KVB_OK);
            float *got[2] = {NULL, NULL};
            for (int rep = 0; rep < (plan.splits > 1 ? 2 : 1); rep++) {
                void *yg = upload_out(gpu, y0, (size_t)n * rows, beta);
                int rc = mode == SK_PLAIN  ? kvb_cuda_gemv(&g, wg.data, xg, yg, V->dt, rows, cols, n, (float)beta, s)
                         : mode == SK_NORM ? kvb_cuda_gemv_norm(&g, wg.data, xg, gg.data, 1e-5f, yg, V->dt, rows, cols, n,
                                                                (float)beta, s)
                                           : kvb_cuda_gemv_swiglu(&g, wg.data, xg, yg, V->dt, rows, cols, n, (float)beta, s);
                ck_assert_int_eq(rc, 0);
                got[rep] = download(gpu, yg, (size_t)n * rows + OUT_GUARD);
                kvb_mem_free(gpu->mem, yg);
                CHECK_CLOSE(got[rep], yc, (size_t)n * rows, V, "skinny %s mode %d n=%d %dx%d beta %d (%d splits, %d tiles)",
                            kvb_cuda_skinny_name(skinny), mode, n, rows, cols, beta, plan.splits, plan.tiles);
                CHECK_GUARD(got[rep], (size_t)n * rows, "%s: skinny %s mode %d n=%d %dx%d", V->name,
                            kvb_cuda_skinny_name(skinny), mode, n, rows, cols);
            }
            if (got[1])
                ck_assert_msg(!memcmp(got[0], got[1], sizeof(float) * n * rows), "%s: skinny v2 n=%d %dx%d: two runs differ",
                              V->name, n, rows, cols);
            free(got[0]);
            free(got[1]);
        }
    }
    int k = skinny == KVB_CUDA_SKINNY_V1 ? KVB_CUDA_GEMV_K_SKINNY_V1 : KVB_CUDA_GEMV_K_SKINNY_V2;
    ck_assert_uint_eq(g.launched[k], (uint64_t)(plan.splits > 1 ? 12 : 6));
    ck_assert_uint_eq(g.launched[0] + g.launched[1] + g.launched[2], g.launched[k]);
    if (floats) {
        kvb_mem_free(gpu->mem, g.part);
        kvb_mem_free(gpu->mem, g.counters);
    }
    kvb_mem_free(gpu->mem, xg);
    cpu->iface->weight_free(cpu->ctx, &wc);
    gpu->iface->weight_free(gpu->ctx, &wg);
    cpu->iface->weight_free(cpu->ctx, &gc);
    gpu->iface->weight_free(gpu->ctx, &gg);
    free(w);
    free(gn);
    free(x);
    free(y0);
    free(in);
    free(yc);
}

/* A plain product of n rows on a fresh backend "cuda" with KVB_CUDA_SKINNY=env: the counts of each
 * kernel it launched; the result against the CPU's. */
static kvb_cuda_product_counts skinny_switch(kvb_backend *cpu, const char *env, int n, int rows, int cols) {
    if (env) setenv("KVB_CUDA_SKINNY", env, 1);
    else unsetenv("KVB_CUDA_SKINNY");
    kvb_backend *gpu = make("cuda");
    unsetenv("KVB_CUDA_SKINNY");
    const variant *V = &VARIANTS[N_VARIANTS - 1];
    float *w = rand_vec((size_t)rows * cols, 0.1f, V->dt), *x = rand_vec((size_t)n * cols, 1.0f, V->dt);
    float *yc = malloc(sizeof(float) * n * rows);
    kvb_tensor tc, tg;
    load_both(cpu, gpu, w, rows, cols, KVB_DTYPE_F32, &tc, &tg);
    void *xg = upload(gpu, x, (size_t)n * cols), *yg = upload_out(gpu, NULL, (size_t)n * rows, 0);
    ck_assert_int_eq(cpu->iface->matmul(cpu->ctx, x, n, &tc, 0.0f, yc), KVB_OK);
    ck_assert_int_eq(gpu->iface->matmul(gpu->ctx, xg, n, &tg, 0.0f, yg), KVB_OK);
    float *got = download(gpu, yg, (size_t)n * rows + OUT_GUARD);
    CHECK_CLOSE(got, yc, (size_t)n * rows, V, "KVB_CUDA_SKINNY=%s n=%d %dx%d", env ? env : "(unset)", n, rows, cols);
    kvb_cuda_product_counts k;
    kvb_cuda_backend_product_counts(gpu, &k);
    kvb_mem_free(gpu->mem, xg);
    kvb_mem_free(gpu->mem, yg);
    cpu->iface->weight_free(cpu->ctx, &tc);
    gpu->iface->weight_free(gpu->ctx, &tg);
    kvb_backend_destroy(gpu);
    free(w);
    free(x);
    free(yc);
    free(got);
    return k;
}

KVB_TEST(matmul_skinny) {
    rng_state = 26;
    kvb_backend *cpu = make("cpu");
    /* n, rows, cols, the SM count of the plan */
    static const int shapes[][4] = {{9, 77, 64, 132},   {13, 130, 40, 132},  {16, 200, 1024, 132}, {16, 300, 1032, 1},
                                    {20, 257, 584, 132}, {24, 129, 2056, 1}, {31, 64, 1096, 1},   {40, 300, 600, 1},
                                    {57, 33, 200, 132},  {64, 129, 520, 1},  {64, 70, 264, 132}, {33, 100, 512, 132},
                                    {48, 45, 96, 132}};
    for (int v = 1; v < N_VARIANTS; v++) { /* bf16 and f16 */
        const variant *V = &VARIANTS[v];
        kvb_backend *gpu = make(V->name);
        int seen[2][2] = {{0}}, seen_v1[2][2] = {{0}};
        for (size_t si = 0; si < KVB_ARRAY_LEN(shapes); si++) {
            skinny_case(cpu, gpu, V, KVB_CUDA_SKINNY_V2, shapes[si][0], shapes[si][1], shapes[si][2], shapes[si][3], seen);
            if (shapes[si][2] % 32 == 0) /* the kernel before, kept for the A/B on a GPU */
                skinny_case(cpu, gpu, V, KVB_CUDA_SKINNY_V1, shapes[si][0], shapes[si][1], shapes[si][2], shapes[si][3],
                            seen_v1);
        }
        for (int sp = 0; sp < 2; sp++)
            for (int ti = 0; ti < 2; ti++)
                ck_assert_msg(seen[sp][ti], "no case with %s split and %s tile", sp ? "more than one" : "one",
                              ti ? "more than one" : "one");
        kvb_backend_destroy(gpu);
    }
    /* the switch, read when the backend is created */
    kvb_cuda_product_counts k = skinny_switch(cpu, NULL, 16, 64, 96);
    ck_assert_uint_eq(k.skinny_v2, 1);
    ck_assert_uint_eq(k.skinny_v1 + k.cublas + k.gemv, 0);
    k = skinny_switch(cpu, "v2", 16, 64, 96);
    ck_assert_uint_eq(k.skinny_v2, 1);
    k = skinny_switch(cpu, "v1", 16, 64, 96);
    ck_assert_uint_eq(k.skinny_v1, 1);
    ck_assert_uint_eq(k.skinny_v2 + k.cublas + k.gemv, 0);
    k = skinny_switch(cpu, "v1", 16, 64, 40); /* v1 takes whole 32-column chunks: cuBLAS */
    ck_assert_uint_eq(k.cublas, 1);
    ck_assert_uint_eq(k.skinny_v1 + k.skinny_v2, 0);
    k = skinny_switch(cpu, "v1", 5, 64, 96); /* up to 8 rows: the gemv kernel either way */
    ck_assert_uint_eq(k.gemv, 1);
    setenv("KVB_CUDA_SKINNY", "v3", 1);
    kvb_backend *bad = NULL;
    ck_assert_int_eq(kvb_backend_create("cuda", 1, &bad), KVB_ERR_INVALID);
    ck_assert_ptr_null(bad);
    unsetenv("KVB_CUDA_SKINNY");
    kvb_backend *gpu = make("cuda");
    ck_assert_int_eq(kvb_cuda_backend_set_skinny(gpu, KVB_CUDA_SKINNY_V1), KVB_CUDA_SKINNY_V2);
    ck_assert_int_eq(kvb_cuda_backend_set_skinny(gpu, 7), -1);
    ck_assert_int_eq(kvb_cuda_backend_set_skinny(gpu, KVB_CUDA_SKINNY_V2), KVB_CUDA_SKINNY_V1);
    kvb_backend_destroy(gpu);
    kvb_backend_destroy(cpu);
}
KVB_TEST_END

KVB_TEST(rmsnorm) {
    rng_state = 13;
    kvb_backend *cpu = make("cpu");
    int shapes[][2] = {{1, 4096}, {7, 64}, {33 * 8, 128}, {5, 1000}, {3, 3}, {2, 5120}, {300, 16}};
    for (int v = 0; v < N_VARIANTS; v++) {
        const variant *V = &VARIANTS[v];
        kvb_backend *gpu = make(V->name);
        for (size_t si = 0; si < KVB_ARRAY_LEN(shapes); si++) {
            int rows = shapes[si][0], dim = shapes[si][1];
            float *x = rand_vec((size_t)rows * dim, 2.0f, V->dt), *w = rand_vec((size_t)dim, 1.0f, KVB_DTYPE_F32);
            kvb_tensor tc, tg;
            load_both(cpu, gpu, w, dim, 1, KVB_DTYPE_F32, &tc, &tg);
            ck_assert_int_eq(tg.dtype, KVB_DTYPE_F32); /* norm weights stay f32 */
            float *yc = malloc(sizeof(float) * rows * dim);
            void *xg = upload(gpu, x, (size_t)rows * dim), *yg = NULL;
            ck_assert_int_eq(kvb_mem_alloc(gpu->mem, (size_t)rows * dim * kvb_dtype_size(V->dt), &yg), KVB_OK);
            ck_assert_int_eq(cpu->iface->rmsnorm(cpu->ctx, x, rows, dim, &tc, 1e-5f, yc), KVB_OK);
            ck_assert_int_eq(gpu->iface->rmsnorm(gpu->ctx, xg, rows, dim, &tg, 1e-5f, yg), KVB_OK);
            float *got = download(gpu, yg, (size_t)rows * dim);
            CHECK_CLOSE(got, yc, (size_t)rows * dim, V, "rmsnorm %dx%d", rows, dim);
            /* in place */
            ck_assert_int_eq(gpu->iface->rmsnorm(gpu->ctx, xg, rows, dim, &tg, 1e-5f, xg), KVB_OK);
            float *got2 = download(gpu, xg, (size_t)rows * dim);
            ck_assert_int_eq(memcmp(got, got2, sizeof(float) * rows * dim), 0);
            kvb_mem_free(gpu->mem, xg);
            kvb_mem_free(gpu->mem, yg);
            cpu->iface->weight_free(cpu->ctx, &tc);
            gpu->iface->weight_free(gpu->ctx, &tg);
            free(x);
            free(w);
            free(yc);
            free(got);
            free(got2);
        }
        kvb_backend_destroy(gpu);
    }
    kvb_backend_destroy(cpu);
}
KVB_TEST_END

KVB_TEST(rope) {
    rng_state = 14;
    kvb_backend *cpu = make("cpu");
    int geo[][3] = {{8, 2, 64}, {32, 8, 128}, {4, 2, 16}, {3, 1, 6}}; /* heads, kv heads, head_dim */
    for (int v = 0; v < N_VARIANTS; v++) {
        const variant *V = &VARIANTS[v];
        kvb_backend *gpu = make(V->name);
        for (size_t gi = 0; gi < KVB_ARRAY_LEN(geo); gi++) {
            int H = geo[gi][0], KH = geo[gi][1], D = geo[gi][2], n = 37;
            float *inv = malloc(sizeof(float) * D / 2);
            for (int i = 0; i < D / 2; i++) inv[i] = (float)pow(500000.0, -2.0 * i / D);
            kvb_rope rope = {.head_dim = D, .inv_freq = inv};
            int32_t pos[37];
            for (int t = 0; t < n; t++) pos[t] = (int32_t)((frand() + 1) * 16384);
            pos[0] = 0;
            pos[1] = 131071;
            float *q = rand_vec((size_t)n * H * D, 1.0f, V->dt), *k = rand_vec((size_t)n * KH * D, 1.0f, V->dt);
            void *qg = upload(gpu, q, (size_t)n * H * D), *kg = upload(gpu, k, (size_t)n * KH * D);
            ck_assert_int_eq(cpu->iface->rope(cpu->ctx, q, H, k, KH, n, pos, &rope), KVB_OK);
            ck_assert_int_eq(gpu->iface->rope(gpu->ctx, qg, H, kg, KH, n, pos, &rope), KVB_OK);
            float *gq = download(gpu, qg, (size_t)n * H * D), *gk = download(gpu, kg, (size_t)n * KH * D);
            CHECK_CLOSE(gq, q, (size_t)n * H * D, V, "rope q %d/%d hd %d", H, KH, D);
            CHECK_CLOSE(gk, k, (size_t)n * KH * D, V, "rope k %d/%d hd %d", H, KH, D);
            kvb_mem_free(gpu->mem, qg);
            kvb_mem_free(gpu->mem, kg);
            free(inv);
            free(q);
            free(k);
            free(gq);
            free(gk);
        }
        kvb_backend_destroy(gpu);
    }
    kvb_backend_destroy(cpu);
}
KVB_TEST_END

KVB_TEST(silu_mul_add) {
    rng_state = 15;
    kvb_backend *cpu = make("cpu");
    size_t sizes[] = {1, 7, 4096, 14336 * 3 + 5, 1 << 20};
    for (int v = 0; v < N_VARIANTS; v++) {
        const variant *V = &VARIANTS[v];
        kvb_backend *gpu = make(V->name);
        kvb_cuda_stream_t s = kvb_cuda_backend_stream(gpu);
        for (size_t si = 0; si < KVB_ARRAY_LEN(sizes); si++) {
            size_t n = sizes[si];
            float *g = rand_vec(n, 4.0f, V->dt), *u = rand_vec(n, 1.0f, V->dt), *oc = malloc(sizeof(float) * n);
            void *gg = upload(gpu, g, n), *ug = upload(gpu, u, n);
            ck_assert_int_eq(cpu->iface->silu_mul(cpu->ctx, g, u, n, oc), KVB_OK);
            ck_assert_int_eq(gpu->iface->silu_mul(gpu->ctx, gg, ug, n, gg), KVB_OK); /* out aliases gate */
            float *got = download(gpu, gg, n);
            CHECK_CLOSE(got, oc, n, V, "silu_mul n=%zu", n);
            /* residual add, in place into b: b = a + b */
            float *a = rand_vec(n, 1.0f, V->dt), *ref = malloc(sizeof(float) * n);
            void *ag = upload(gpu, a, n);
            for (size_t i = 0; i < n; i++) ref[i] = a[i] + got[i];
            ck_assert_int_eq(KVB_CUDA_CHECK(kvb_cuda_add(ag, gg, gg, V->dt, n, s)), KVB_OK);
            float *got2 = download(gpu, gg, n);
            CHECK_CLOSE(got2, ref, n, V, "add n=%zu", n);
            /* an unaligned view takes the element-by-element path */
            if (n > 8) {
                size_t es = kvb_dtype_size(V->dt);
                ck_assert_int_eq(KVB_CUDA_CHECK(kvb_cuda_add((char *)ag + es, (char *)ag + es, (char *)ag + es, V->dt,
                                                             n - 1, s)),
                                 KVB_OK);
                float *got3 = download(gpu, ag, n);
                for (size_t i = 1; i < n; i++) ref[i] = round_dt(2 * a[i], V->dt);
                ref[0] = a[0];
                CHECK_CLOSE(got3, ref, n, V, "add unaligned n=%zu", n);
                free(got3);
            }
            kvb_mem_free(gpu->mem, gg);
            kvb_mem_free(gpu->mem, ug);
            kvb_mem_free(gpu->mem, ag);
            free(g);
            free(u);
            free(oc);
            free(got);
            free(a);
            free(ref);
            free(got2);
        }
        kvb_backend_destroy(gpu);
    }
    kvb_backend_destroy(cpu);
}
KVB_TEST_END

/* ---------------------------------------------------------------- KV write + attention */

typedef struct seq_spec {
    int q_len, ctx_len;
} seq_spec;

/* KV blocks for the same sequences on both backends: the sequences' blocks live in layer 1 of a 2-layer
 * block-major pool, handed out in a scrambled order. seqs[s] covers sequence s's last q_len tokens
 * (rows [q_start, q_start + q_len) of a batch), fill[s] its whole context. */
typedef struct kv_pools {
    kvb_kv_geom gc, gg;       /* geometry on the CPU (f32) and the GPU (its dtype) */
    kvb_attn_seq *seqs, *fill; /* [n_seqs] */
    int n_seqs, n_tok, n_fill, n_blk, bs;
    size_t row, blk_elems, es; /* K or V row elements, elements of a block, GPU element size */
    float *pool_c;
    void *pool_g;
    void **pc, **pg;           /* [n_blk] layer-1 slice of each block entry */
} kv_pools;

static void pools_make(kvb_backend *gpu, const variant *V, const seq_spec *specs, int n_seqs, int n_kv, int hd, int bs,
                       kv_pools *p) {
    memset(p, 0, sizeof *p);
    p->es = kvb_dtype_size(V->dt);
    p->bs = bs;
    p->n_seqs = n_seqs;
    p->gc = (kvb_kv_geom){.n_layers = 2, .n_kv_heads = n_kv, .head_dim = hd, .block_size = bs, .elem_size = 4};
    p->gg = p->gc;
    p->gg.elem_size = (int)p->es;
    p->fill = calloc((size_t)n_seqs, sizeof *p->fill);
    p->seqs = calloc((size_t)n_seqs, sizeof *p->seqs);
    for (int s = 0; s < n_seqs; s++) {
        int nb = KVB_DIV_CEIL(specs[s].ctx_len, bs);
        p->fill[s] = (kvb_attn_seq){.q_start = p->n_fill, .q_len = specs[s].ctx_len, .ctx_len = specs[s].ctx_len,
                                    .n_blocks = nb, .blk_first = p->n_blk};
        p->seqs[s] = (kvb_attn_seq){.q_start = p->n_tok, .q_len = specs[s].q_len, .ctx_len = specs[s].ctx_len,
                                    .n_blocks = nb, .blk_first = p->n_blk};
        p->n_fill += specs[s].ctx_len;
        p->n_tok += specs[s].q_len;
        p->n_blk += nb;
    }
    p->row = (size_t)n_kv * hd;
    size_t layer_elems = 2 * (size_t)bs * p->row;
    p->blk_elems = 2 * layer_elems;
    p->pool_c = calloc((size_t)p->n_blk * p->blk_elems, sizeof(float));
    ck_assert_int_eq(kvb_mem_alloc(gpu->mem, (size_t)p->n_blk * p->blk_elems * p->es, &p->pool_g), KVB_OK);
    p->pc = malloc(sizeof(void *) * p->n_blk);
    p->pg = malloc(sizeof(void *) * p->n_blk);
    int mul = kvb_test_scramble_mul(p->n_blk);
    for (int j = 0; j < p->n_blk; j++) {
        size_t at = (size_t)((j * (size_t)mul + 3) % (size_t)p->n_blk) * p->blk_elems + layer_elems; /* layer 1 */
        p->pc[j] = p->pool_c + at;
        p->pg[j] = (char *)p->pool_g + at * p->es;
    }
}

static void pools_free(kvb_backend *gpu, kv_pools *p) {
    kvb_mem_free(gpu->mem, p->pool_g);
    free(p->seqs);
    free(p->fill);
    free(p->pool_c);
    free(p->pc);
    free(p->pg);
}

/* The K and V rows of the positions [ctx_len - q_len, ctx_len) of every sequence, as written in each
 * pool, into want (CPU) and got (GPU, decoded), [rows][row]; returns the element count. */
static size_t pools_rows(kvb_backend *gpu, const kv_pools *p, const seq_spec *specs, const kvb_attn_seq *which,
                         float *want, float *got) {
    char *raw = malloc((size_t)p->n_blk * p->blk_elems * p->es);
    ck_assert_int_eq(gpu->iface->to_host(gpu->ctx, raw, p->pool_g, (size_t)p->n_blk * p->blk_elems * p->es), KVB_OK);
    size_t m = 0;
    for (int s = 0; s < p->n_seqs; s++)
        for (int pos = specs[s].ctx_len - which[s].q_len; pos < specs[s].ctx_len; pos++)
            for (int kv = 0; kv < 2; kv++) {
                size_t off = (size_t)kv * p->bs * p->row + (size_t)(pos % p->bs) * p->row;
                int j = which[s].blk_first + pos / p->bs;
                memcpy(want + m, (const float *)p->pc[j] + off, sizeof(float) * p->row);
                decode_dt(raw + ((char *)p->pg[j] - (char *)p->pool_g) + off * p->es, p->row, gpu->iface->act_dtype,
                          got + m);
                m += p->row;
            }
    free(raw);
    return m;
}

/* Fills every sequence's whole context with kv_write (one prefill-like batch), checks the blocks are
 * identical, then runs one attention step with the given q_len per sequence on both backends. The
 * blocks live in layer 1 of a 2-layer block-major pool, handed out in a scrambled order. */
static void check_attention_w(kvb_backend *cpu, kvb_backend *gpu, const variant *V, const seq_spec *specs,
                              int n_seqs, int n_heads, int n_kv, int hd, int bs, int window) {
    kvb_dtype dt = V->dt;
    size_t es = kvb_dtype_size(dt);
    kv_pools P;
    pools_make(gpu, V, specs, n_seqs, n_kv, hd, bs, &P);
    int n_fill = P.n_fill, n_tok = P.n_tok;
    size_t row = P.row;
    kvb_attn_seq *step = P.seqs;
    /* the whole context of every sequence through kv_write */
    float *kf = rand_vec((size_t)n_fill * row, 1.0f, dt), *vf = rand_vec((size_t)n_fill * row, 1.0f, dt);
    void *kfg = upload(gpu, kf, (size_t)n_fill * row), *vfg = upload(gpu, vf, (size_t)n_fill * row);
    float scale = (float)(1 / sqrt(hd));
    kvb_attn_batch bc = {.geom = &P.gc, .n_heads = n_heads, .n_tokens = n_fill, .n_seqs = n_seqs, .seqs = P.fill,
                         .layer_blocks = P.pc, .scale = scale};
    kvb_attn_batch bg = bc;
    bg.geom = &P.gg;
    bg.layer_blocks = P.pg;
    ck_assert_int_eq(cpu->iface->kv_write(cpu->ctx, &bc, kf, vf), KVB_OK);
    ck_assert_int_eq(gpu->iface->kv_write(gpu->ctx, &bg, kfg, vfg), KVB_OK);
    /* kv_write moves bytes: every written slot is identical */
    float *want = malloc(sizeof(float) * 2 * n_fill * row), *got_kv = malloc(sizeof(float) * 2 * n_fill * row);
    size_t m = pools_rows(gpu, &P, specs, P.fill, want, got_kv);
    for (size_t i = 0; i < m; i++)
        ck_assert_msg(want[i] == got_kv[i], "%s: kv_write: element %zu of K/V row %zu differs (%g, CPU %g)", V->name,
                      i % row, i / row, got_kv[i], want[i]);
    free(want);
    free(got_kv);
    /* one step */
    float *q = rand_vec((size_t)n_tok * n_heads * hd, 1.0f, dt), *oc = malloc(sizeof(float) * n_tok * n_heads * hd);
    void *qg = upload(gpu, q, (size_t)n_tok * n_heads * hd), *og = NULL;
    ck_assert_int_eq(kvb_mem_alloc(gpu->mem, (size_t)n_tok * n_heads * hd * es, &og), KVB_OK);
    bc.n_tokens = bg.n_tokens = n_tok;
    bc.seqs = bg.seqs = step;
    bc.window = bg.window = window;
    ck_assert_int_eq(cpu->iface->attention(cpu->ctx, &bc, q, oc), KVB_OK);
    ck_assert_int_eq(gpu->iface->attention(gpu->ctx, &bg, qg, og), KVB_OK);
    float *got = download(gpu, og, (size_t)n_tok * n_heads * hd);
    CHECK_CLOSE(got, oc, (size_t)n_tok * n_heads * hd, V,
                "attention heads %d/%d hd %d bs %d window %d seqs %d (first %d/%d)", n_heads, n_kv, hd, bs, window,
                n_seqs, specs[0].q_len, specs[0].ctx_len);
    /* the same plan again gives the same bits (no atomics) */
    ck_assert_int_eq(gpu->iface->attention(gpu->ctx, &bg, qg, og), KVB_OK);
    float *again = download(gpu, og, (size_t)n_tok * n_heads * hd);
    ck_assert_int_eq(memcmp(got, again, sizeof(float) * n_tok * n_heads * hd), 0);

    kvb_mem_free(gpu->mem, kfg);
    kvb_mem_free(gpu->mem, vfg);
    kvb_mem_free(gpu->mem, qg);
    kvb_mem_free(gpu->mem, og);
    pools_free(gpu, &P);
    free(kf);
    free(vf);
    free(q);
    free(oc);
    free(got);
    free(again);
}

static void check_attention(kvb_backend *cpu, kvb_backend *gpu, const variant *V, const seq_spec *specs, int n_seqs,
                            int n_heads, int n_kv, int hd, int bs) {
    check_attention_w(cpu, gpu, V, specs, n_seqs, n_heads, n_kv, hd, bs, 0);
}

/* qkv_finish (bf16/f16: bias, q/k norm, RoPE and KV write after the stacked q/k/v product) against
 * the CPU backend's bias_add, per-head rmsnorm, rope and kv_write on the split product. */
static void check_qkv_finish(kvb_backend *cpu, kvb_backend *gpu, const variant *V, const seq_spec *specs, int n_seqs,
                             int n_heads, int n_kv, int hd, int bs, int with_bias, int with_norm) {
    kvb_dtype dt = V->dt;
    size_t es = kvb_dtype_size(dt);
    kv_pools P;
    pools_make(gpu, V, specs, n_seqs, n_kv, hd, bs, &P);
    int n_tok = P.n_tok;
    size_t row = P.row;
    int heads = n_heads + 2 * n_kv;
    size_t width = (size_t)heads * hd;
    float *qkv = rand_vec((size_t)n_tok * width, 2.0f, dt), *bias = rand_vec(width, 0.5f, KVB_DTYPE_F32);
    float *qn = rand_vec((size_t)hd, 1.0f, KVB_DTYPE_F32), *kn = rand_vec((size_t)hd, 1.0f, KVB_DTYPE_F32);
    int32_t *pos = malloc(sizeof(int32_t) * n_tok);
    for (int t = 0; t < n_tok; t++) pos[t] = (int32_t)(t * 37 + 5);
    float *inv = malloc(sizeof(float) * hd / 2);
    for (int i = 0; i < hd / 2; i++) inv[i] = (float)pow(10000.0, -2.0 * i / hd);
    kvb_rope rope = {.head_dim = hd, .inv_freq = inv};
    float scale = (float)(1 / sqrt(hd));
    kvb_attn_batch bc = {.geom = &P.gc, .n_heads = n_heads, .n_tokens = n_tok, .n_seqs = n_seqs, .seqs = P.seqs,
                         .layer_blocks = P.pc, .scale = scale};
    kvb_attn_batch bg = bc;
    bg.geom = &P.gg;
    bg.layer_blocks = P.pg;
    /* the CPU: split, bias, norm, rope, kv_write */
    float *q = malloc(sizeof(float) * n_tok * n_heads * hd), *k = malloc(sizeof(float) * n_tok * row),
          *v = malloc(sizeof(float) * n_tok * row);
    for (int t = 0; t < n_tok; t++) {
        memcpy(q + (size_t)t * n_heads * hd, qkv + t * width, sizeof(float) * n_heads * hd);
        memcpy(k + (size_t)t * row, qkv + t * width + (size_t)n_heads * hd, sizeof(float) * row);
        memcpy(v + (size_t)t * row, qkv + t * width + (size_t)(n_heads + n_kv) * hd, sizeof(float) * row);
    }
    kvb_tensor tb[3], tqn, tkn, gb, gqn, gkn;
    if (with_bias) {
        int64_t off[3] = {0, (int64_t)n_heads * hd, (int64_t)(n_heads + n_kv) * hd}, len[3] = {off[1], (int64_t)row, (int64_t)row};
        float *dst[3] = {q, k, v};
        for (int i = 0; i < 3; i++) {
            ck_assert_int_eq(cpu->iface->weight_load(cpu->ctx, bias + off[i], KVB_DTYPE_F32, len[i], 1, &tb[i]), KVB_OK);
            ck_assert_int_eq(cpu->iface->bias_add(cpu->ctx, dst[i], n_tok, &tb[i]), KVB_OK);
            cpu->iface->weight_free(cpu->ctx, &tb[i]);
        }
        ck_assert_int_eq(gpu->iface->weight_load(gpu->ctx, bias, KVB_DTYPE_F32, (int64_t)width, 1, &gb), KVB_OK);
    }
    if (with_norm) {
        load_both(cpu, gpu, qn, hd, 1, KVB_DTYPE_F32, &tqn, &gqn);
        load_both(cpu, gpu, kn, hd, 1, KVB_DTYPE_F32, &tkn, &gkn);
        ck_assert_int_eq(cpu->iface->rmsnorm(cpu->ctx, q, n_tok * n_heads, hd, &tqn, 1e-6f, q), KVB_OK);
        ck_assert_int_eq(cpu->iface->rmsnorm(cpu->ctx, k, n_tok * n_kv, hd, &tkn, 1e-6f, k), KVB_OK);
    }
    ck_assert_int_eq(cpu->iface->rope(cpu->ctx, q, n_heads, k, n_kv, n_tok, pos, &rope), KVB_OK);
    ck_assert_int_eq(cpu->iface->kv_write(cpu->ctx, &bc, k, v), KVB_OK);
    /* the GPU in one call */
    void *qkvg = upload(gpu, qkv, (size_t)n_tok * width), *qo = NULL;
    ck_assert_int_eq(kvb_mem_alloc(gpu->mem, (size_t)n_tok * n_heads * hd * es, &qo), KVB_OK);
    ck_assert_int_eq(gpu->iface->qkv_finish(gpu->ctx, &bg, qkvg, with_bias ? &gb : NULL, with_norm ? &gqn : NULL,
                                            with_norm ? &gkn : NULL, 1e-6f, pos, &rope, qo),
                     KVB_OK);
    float *gq = download(gpu, qo, (size_t)n_tok * n_heads * hd);
    CHECK_CLOSE(gq, q, (size_t)n_tok * n_heads * hd, V, "qkv_finish q: heads %d/%d hd %d bias %d norm %d", n_heads, n_kv,
                hd, with_bias, with_norm);
    /* the K and V rows written, gathered from both pools */
    float *want = malloc(sizeof(float) * 2 * n_tok * row), *got = malloc(sizeof(float) * 2 * n_tok * row);
    size_t m = pools_rows(gpu, &P, specs, P.seqs, want, got);
    CHECK_CLOSE(got, want, m, V, "qkv_finish K/V rows: heads %d/%d hd %d bias %d norm %d", n_heads, n_kv, hd, with_bias,
                with_norm);
    if (with_bias) gpu->iface->weight_free(gpu->ctx, &gb);
    if (with_norm) {
        cpu->iface->weight_free(cpu->ctx, &tqn);
        cpu->iface->weight_free(cpu->ctx, &tkn);
        gpu->iface->weight_free(gpu->ctx, &gqn);
        gpu->iface->weight_free(gpu->ctx, &gkn);
    }
    kvb_mem_free(gpu->mem, qkvg);
    kvb_mem_free(gpu->mem, qo);
    pools_free(gpu, &P);
    free(qkv);
    free(bias);
    free(qn);
    free(kn);
    free(pos);
    free(inv);
    free(q);
    free(k);
    free(v);
    free(gq);
    free(want);
    free(got);
}

KVB_TEST(qkv_finish) {
    rng_state = 25;
    kvb_backend *cpu = make("cpu");
    for (int v = 0; v < N_VARIANTS; v++) {
        kvb_backend *gpu = make(VARIANTS[v].name);
        if (!gpu->iface->qkv_finish) {
            kvb_backend_destroy(gpu);
            continue;
        }
        seq_spec mix[] = {{5, 5}, {1, 40}, {17, 50}, {3, 16}};
        check_qkv_finish(cpu, gpu, &VARIANTS[v], mix, 4, 8, 2, 64, 16, 0, 0);
        check_qkv_finish(cpu, gpu, &VARIANTS[v], mix, 4, 8, 2, 64, 7, 1, 0);  /* Qwen2: biases */
        check_qkv_finish(cpu, gpu, &VARIANTS[v], mix, 4, 4, 1, 128, 16, 0, 1); /* Qwen3: q/k norms */
        check_qkv_finish(cpu, gpu, &VARIANTS[v], mix, 4, 2, 2, 256, 1, 1, 1);
        check_qkv_finish(cpu, gpu, &VARIANTS[v], mix, 4, 3, 1, 6, 32, 1, 1); /* heads narrower than a warp */
        kvb_backend_destroy(gpu);
    }
    kvb_backend_destroy(cpu);
}
KVB_TEST_END

KVB_TEST(attention_decode) {
    rng_state = 16;
    kvb_backend *cpu = make("cpu");
    for (int v = 0; v < N_VARIANTS; v++) {
        kvb_backend *gpu = make(VARIANTS[v].name);
        /* one new token each; contexts below, at and above a key tile and a split */
        seq_spec dec[] = {{1, 1}, {1, 17}, {1, 128}, {1, 129}, {1, 300}, {1, 1000}, {1, 5000}};
        int bss[] = {1, 8, 16, 32};
        for (size_t i = 0; i < KVB_ARRAY_LEN(bss); i++) check_attention(cpu, gpu, &VARIANTS[v], dec, 7, 8, 2, 64, bss[i]);
        /* two new tokens per sequence (rows = 2 x group 4 = 8: the decode kernel's limit) */
        seq_spec two[] = {{2, 2}, {2, 700}, {2, 2049}};
        check_attention(cpu, gpu, &VARIANTS[v], two, 3, 8, 2, 128, 16);
        kvb_backend_destroy(gpu);
    }
    kvb_backend_destroy(cpu);
}
KVB_TEST_END

KVB_TEST(attention_long_context_split) {
    rng_state = 17;
    kvb_backend *cpu = make("cpu");
    for (int v = 0; v < N_VARIANTS; v++) {
        kvb_backend *gpu = make(VARIANTS[v].name);
        /* Llama-3-8B attention shape: 32 heads over 8 KV heads of 128; batch 1 at 9000 tokens splits
         * into many parts; a batch of 4 at 4K splits fewer */
        seq_spec one[] = {{1, 9000}};
        check_attention(cpu, gpu, &VARIANTS[v], one, 1, 32, 8, 128, 16);
        /* kvbank-bench cuda's batch-1 rows at 1K and 4K (attention_decode_plan: 8 splits of 128 keys,
         * 32 of 128), each sequence's blocks filling its pool exactly */
        seq_spec k1[] = {{1, 1024}}, k4[] = {{1, 4096}};
        check_attention(cpu, gpu, &VARIANTS[v], k1, 1, 32, 8, 128, 16);
        check_attention(cpu, gpu, &VARIANTS[v], k4, 1, 32, 8, 128, 16);
        seq_spec four[] = {{1, 4096}, {1, 4000}, {1, 3333}, {1, 10}};
        check_attention(cpu, gpu, &VARIANTS[v], four, 4, 32, 8, 128, 32);
        /* group of 8 (rows 8), and of 16 (decode through the prefill kernel) */
        check_attention(cpu, gpu, &VARIANTS[v], one, 1, 64, 8, 128, 16);
        check_attention(cpu, gpu, &VARIANTS[v], four, 4, 32, 2, 64, 16);
        kvb_backend_destroy(gpu);
    }
    kvb_backend_destroy(cpu);
}
KVB_TEST_END

/* The decode split plan for kvbank-bench cuda's rows on an H200 (132 multiprocessors, 4 resident
 * decode blocks each: 528 slots) at Llama-3-8B's attention (bf16, 32 heads over 8 KV heads of 128, 4
 * rows a pair). Issue 25's first GPU run had batch 16 at 4K in 640 blocks of 832 keys (1.2 waves: the
 * second wave's 112 blocks take as long as the first's 528): now whole waves. Its second run had batch 1
 * at 1K in 256 blocks of 32 keys, two stages of the key-group kernel's 4-stage ring each, and 32
 * partials a pair to merge: 32.9 us where 128 blocks of 64 keys took 22.5. Now no split is shorter than
 * two turns of the ring (128 keys here), so batch 1 at 1K runs 64 blocks of 128 keys. Then over a sweep
 * of batches and contexts: every split a multiple of the minimum covering its keys and at least the
 * ring's two turns, the grid at least the multiprocessors where there are keys for it, and never more
 * than 40% of the slot time of its waves idle where the keys could fill a wave (the rounding of splits
 * to 32 keys costs up to that). */
KVB_TEST(attention_decode_plan) {
    const int n_sm = 132, hd = 128, mn = KVB_CUDA_ATTN_DECODE_MIN_SPLIT;
    /* two turns of 4 stages of 2 keys a lane group: 16 lanes a key at 128 x bf16, 8 at 64, 32 at 256 */
    ck_assert_int_eq(kvb_cuda_attn_decode_min_split(KVB_DTYPE_BF16, 128), 128);
    ck_assert_int_eq(kvb_cuda_attn_decode_min_split(KVB_DTYPE_F16, 64), 256);
    ck_assert_int_eq(kvb_cuda_attn_decode_min_split(KVB_DTYPE_BF16, 256), 64);
    ck_assert_int_eq(kvb_cuda_attn_decode_min_split(KVB_DTYPE_F32, 128), 64);
    ck_assert_int_eq(kvb_cuda_attn_decode_min_split(KVB_DTYPE_BF16, 80), mn); /* the tiled kernel */
    const int ml = kvb_cuda_attn_decode_min_split(KVB_DTYPE_BF16, hd);
    struct {
        int batch, ctx, len;
    } rows[] = {{1, 1024, 128}, {1, 4096, 128}, {1, 8192, 128}, {16, 1024, 128}, {16, 4096, 512}, {16, 8192, 1024},
                {64, 1024, 512}, {64, 8192, 4096}};
    for (size_t i = 0; i < KVB_ARRAY_LEN(rows); i++) {
        size_t pairs = 8 * (size_t)rows[i].batch;
        int ns = kvb_cuda_attn_decode_splits(KVB_DTYPE_BF16, hd, 4, n_sm, pairs, rows[i].ctx);
        int len = kvb_cuda_attn_decode_split_len(rows[i].ctx, ns);
        ck_assert_msg(len == rows[i].len, "batch %d ctx %d: splits of %d keys, want %d", rows[i].batch, rows[i].ctx, len,
                      rows[i].len);
    }
    int batches[] = {1, 2, 3, 4, 5, 8, 12, 16, 24, 32, 48, 64, 100}, ctxs[] = {1, 32, 33, 100, 255, 256, 512, 1000, 1024,
                                                                                3000, 4096, 5000, 8192, 32768, 131072};
    for (int dr = 1; dr <= KVB_CUDA_ATTN_DECODE_ROWS; dr *= 2)
        for (size_t bi = 0; bi < KVB_ARRAY_LEN(batches); bi++)
            for (size_t ci = 0; ci < KVB_ARRAY_LEN(ctxs); ci++) {
                int ctx = ctxs[ci];
                size_t pairs = 8 * (size_t)batches[bi];
                size_t slots = (size_t)n_sm * (KVB_CUDA_ATTN_DECODE_RESIDENT / (dr > 4 ? 2 : 1));
                int ns = kvb_cuda_attn_decode_splits(KVB_DTYPE_BF16, hd, dr, n_sm, pairs, ctx);
                int len = kvb_cuda_attn_decode_split_len(ctx, ns), parts = KVB_DIV_CEIL(ctx, len);
                size_t blocks = pairs * (size_t)parts, most = pairs * (size_t)KVB_MAX(1, ctx / ml);
                ck_assert_msg(ns >= 1 && len % mn == 0 && (size_t)parts * len >= (size_t)ctx, "batch %d ctx %d: %d x %d",
                              batches[bi], ctx, parts, len);
                ck_assert_msg(parts == 1 || len >= ml, "batch %d ctx %d rows %d: splits of %d keys", batches[bi], ctx, dr,
                              len);
                ck_assert_msg(blocks >= KVB_MIN((size_t)n_sm, most), "batch %d ctx %d rows %d: %zu blocks on %d SMs",
                              batches[bi], ctx, dr, blocks, n_sm);
                size_t waves = KVB_DIV_CEIL(blocks, slots);
                if (most >= slots)
                    ck_assert_msg(blocks * 10 >= waves * slots * 6, "batch %d ctx %d rows %d: %zu blocks in %zu waves of %zu",
                                  batches[bi], ctx, dr, blocks, waves, slots);
            }
    /* nothing to split */
    ck_assert_int_eq(kvb_cuda_attn_decode_splits(KVB_DTYPE_BF16, hd, 4, n_sm, 0, 4096), 1);
    ck_assert_int_eq(kvb_cuda_attn_decode_splits(KVB_DTYPE_BF16, hd, 4, n_sm, 8, 2 * ml - 1), 1);
}
KVB_TEST_END

KVB_TEST(attention_prefill) {
    rng_state = 18;
    kvb_backend *cpu = make("cpu");
    for (int v = 0; v < N_VARIANTS; v++) {
        kvb_backend *gpu = make(VARIANTS[v].name);
        /* full prompts, a chunk after a past, decode rows mixed in */
        seq_spec mix[] = {{300, 300}, {70, 133}, {1, 40}, {3, 3}, {129, 1000}, {1, 1}};
        int bss[] = {1, 7, 16, 32};
        for (size_t i = 0; i < KVB_ARRAY_LEN(bss); i++) check_attention(cpu, gpu, &VARIANTS[v], mix, 6, 8, 2, 64, bss[i]);
        check_attention(cpu, gpu, &VARIANTS[v], mix, 6, 32, 8, 128, 16);
        kvb_backend_destroy(gpu);
    }
    kvb_backend_destroy(cpu);
}
KVB_TEST_END

/* A short chunk over a long past (chunked prefill of a long prompt, a turn after a long history): on
 * the tensor-core prefill too few tiles to fill the device, so each tile's keys are split and the
 * group's last split merges them; with and without a sliding window, and beside decode rows. */
KVB_TEST(attention_chunk_over_past) {
    rng_state = 23;
    kvb_backend *cpu = make("cpu");
    for (int v = 0; v < N_VARIANTS; v++) {
        kvb_backend *gpu = make(VARIANTS[v].name);
        seq_spec mix[] = {{48, 3000}, {1, 1500}, {20, 2100}};
        check_attention(cpu, gpu, &VARIANTS[v], mix, 3, 16, 4, 128, 16);
        check_attention_w(cpu, gpu, &VARIANTS[v], mix, 3, 8, 2, 64, 32, 700);
        kvb_backend_destroy(gpu);
    }
    kvb_backend_destroy(cpu);
}
KVB_TEST_END

/* The tensor-core prefill's two tiles (attention_tc.cu): 128 rows (the default; 4 warps x 32 rows, 8 x
 * 16 at head size 256) and 64 (4 x 16, KVB_CUDA_PREFILL_TILE=64), each against the CPU on what differs
 * between them: MHA tiles of 128 tokens whose warps skip the key tiles past their rows (the causal
 * diagonal) and GQA tiles of 32 tokens x 4 heads, head sizes 32 to 256, chunks over a past with key
 * splits, sliding windows, tiles spanning blocks of 1, 7 and 16 tokens. The items counted per tile show
 * which kernel ran; the environment variable is read when the backend is created. */
KVB_TEST(attention_prefill_tiles) {
    rng_state = 26;
    kvb_backend *cpu = make("cpu");
    seq_spec mix[] = {{200, 200}, {40, 500}, {1, 40}};
    seq_spec past[] = {{24, 2000}, {1, 300}};
    for (int v = 0; v < N_VARIANTS; v++) {
        if (VARIANTS[v].dt == KVB_DTYPE_F32) continue; /* the CUDA-core kernel: 64 rows, no tiles to pick */
        kvb_backend *gpu = make(VARIANTS[v].name);
        const int tiles[] = {128, 64};
        for (size_t ti = 0; ti < KVB_ARRAY_LEN(tiles); ti++) {
            int tile = tiles[ti];
            ck_assert_int_eq(kvb_cuda_backend_set_prefill_tile(gpu, tile), 128); /* the default, then the first set */
            uint64_t before[2], after[2];
            kvb_cuda_backend_prefill_items(gpu, before);
            check_attention(cpu, gpu, &VARIANTS[v], mix, 3, 4, 4, 128, 16);          /* MHA */
            check_attention(cpu, gpu, &VARIANTS[v], mix, 3, 16, 4, 64, 7);           /* GQA */
            check_attention(cpu, gpu, &VARIANTS[v], mix, 3, 8, 1, 32, 1);            /* MQA, a block a token */
            check_attention(cpu, gpu, &VARIANTS[v], mix, 3, 2, 2, 256, 16);
            check_attention(cpu, gpu, &VARIANTS[v], past, 2, 8, 8, 128, 16);         /* MHA key splits */
            check_attention_w(cpu, gpu, &VARIANTS[v], mix, 3, 4, 4, 128, 16, 100);   /* windows inside a tile */
            check_attention_w(cpu, gpu, &VARIANTS[v], past, 2, 16, 4, 64, 16, 700); /* key splits in a window */
            kvb_cuda_backend_prefill_items(gpu, after);
            ck_assert_msg(after[tile == 64 ? 0 : 1] > before[tile == 64 ? 0 : 1] &&
                              after[tile == 64 ? 1 : 0] == before[tile == 64 ? 1 : 0],
                          "%s tile %d: items 64/128 %llu/%llu -> %llu/%llu", VARIANTS[v].name, tile,
                          (unsigned long long)before[0], (unsigned long long)before[1], (unsigned long long)after[0],
                          (unsigned long long)after[1]);
        }
        ck_assert_int_eq(kvb_cuda_backend_set_prefill_tile(gpu, 100), 0); /* refused, nothing changes */
        ck_assert_int_eq(kvb_cuda_backend_set_prefill_tile(gpu, 128), 64);
        kvb_backend_destroy(gpu);
    }
    /* the environment's choice, read at creation; another value fails the creation */
    kvb_backend *bad = NULL;
    setenv("KVB_CUDA_PREFILL_TILE", "96", 1);
    ck_assert_int_eq(kvb_backend_create("cuda", 2, &bad), KVB_ERR_INVALID);
    ck_assert_ptr_null(bad);
    const char *envs[] = {"64", "128", NULL};
    const int want[] = {64, 128, 128};
    seq_spec one[] = {{40, 100}};
    for (size_t i = 0; i < KVB_ARRAY_LEN(want); i++) {
        if (envs[i]) setenv("KVB_CUDA_PREFILL_TILE", envs[i], 1);
        else unsetenv("KVB_CUDA_PREFILL_TILE");
        kvb_backend *gpu = make("cuda");
        unsetenv("KVB_CUDA_PREFILL_TILE");
        uint64_t n[2];
        check_attention(cpu, gpu, &VARIANTS[N_VARIANTS - 1], one, 1, 8, 2, 64, 16);
        kvb_cuda_backend_prefill_items(gpu, n);
        ck_assert_msg(n[want[i] == 64 ? 0 : 1] > 0 && n[want[i] == 64 ? 1 : 0] == 0,
                      "KVB_CUDA_PREFILL_TILE=%s: items 64/128 %llu/%llu", envs[i] ? envs[i] : "(unset)",
                      (unsigned long long)n[0], (unsigned long long)n[1]);
        ck_assert_int_eq(kvb_cuda_backend_set_prefill_tile(gpu, 128), want[i]);
        kvb_backend_destroy(gpu);
    }
    kvb_backend_destroy(cpu);
}
KVB_TEST_END

/* Sliding windows (Mistral, Qwen2): decode splits that start at the window, prefill tiles whose rows
 * start their windows at different keys, windows below a block, a key tile and a split. */
KVB_TEST(attention_sliding_window) {
    rng_state = 21;
    kvb_backend *cpu = make("cpu");
    for (int v = 0; v < N_VARIANTS; v++) {
        kvb_backend *gpu = make(VARIANTS[v].name);
        seq_spec dec[] = {{1, 1}, {1, 17}, {1, 300}, {1, 5000}, {2, 700}};
        seq_spec mix[] = {{300, 300}, {70, 133}, {1, 40}, {3, 3}, {129, 1000}, {1, 1}};
        int windows[] = {1, 7, 100, 600, 4096};
        for (size_t w = 0; w < KVB_ARRAY_LEN(windows); w++) {
            check_attention_w(cpu, gpu, &VARIANTS[v], dec, 5, 8, 2, 64, 16, windows[w]);
            check_attention_w(cpu, gpu, &VARIANTS[v], mix, 6, 8, 2, 64, 7, windows[w]);
        }
        check_attention_w(cpu, gpu, &VARIANTS[v], mix, 6, 32, 8, 128, 16, 257);
        kvb_backend_destroy(gpu);
    }
    kvb_backend_destroy(cpu);
}
KVB_TEST_END

/* bias_add: y[i][:] += b[:] with an f32 bias on activations of each dtype. */
KVB_TEST(bias_add) {
    rng_state = 22;
    kvb_backend *cpu = make("cpu");
    int shapes[][2] = {{1, 7}, {37, 64}, {300, 4096}, {5, 18944}};
    for (int v = 0; v < N_VARIANTS; v++) {
        const variant *V = &VARIANTS[v];
        kvb_backend *gpu = make(V->name);
        for (size_t si = 0; si < KVB_ARRAY_LEN(shapes); si++) {
            int n = shapes[si][0], d = shapes[si][1];
            float *y = rand_vec((size_t)n * d, 1.0f, V->dt), *b = rand_vec((size_t)d, 0.5f, KVB_DTYPE_F32);
            void *yg = upload(gpu, y, (size_t)n * d);
            kvb_tensor bc, bgt;
            ck_assert_int_eq(cpu->iface->weight_load(cpu->ctx, b, KVB_DTYPE_F32, d, 1, &bc), KVB_OK);
            ck_assert_int_eq(gpu->iface->weight_load(gpu->ctx, b, KVB_DTYPE_F32, d, 1, &bgt), KVB_OK);
            ck_assert_int_eq(cpu->iface->bias_add(cpu->ctx, y, n, &bc), KVB_OK);
            ck_assert_int_eq(gpu->iface->bias_add(gpu->ctx, yg, n, &bgt), KVB_OK);
            float *got = download(gpu, yg, (size_t)n * d);
            CHECK_CLOSE(got, y, (size_t)n * d, V, "bias_add %d x %d", n, d);
            cpu->iface->weight_free(cpu->ctx, &bc);
            gpu->iface->weight_free(gpu->ctx, &bgt);
            kvb_mem_free(gpu->mem, yg);
            free(y);
            free(b);
            free(got);
        }
        kvb_backend_destroy(gpu);
    }
    kvb_backend_destroy(cpu);
}
KVB_TEST_END

KVB_TEST(attention_head_shapes) {
    rng_state = 19;
    kvb_backend *cpu = make("cpu");
    seq_spec mix[] = {{1, 65}, {64, 64}, {33, 90}, {1, 700}};
    /* heads, kv heads, head_dim: MHA, MQA, the tiny test models' 16, odd 80 and 6, the largest 256 */
    int geo[][3] = {{4, 4, 16}, {6, 1, 64}, {8, 2, 80}, {4, 2, 6}, {8, 4, 256}, {2, 2, 32}, {12, 4, 96}};
    for (int v = 0; v < N_VARIANTS; v++) {
        kvb_backend *gpu = make(VARIANTS[v].name);
        for (size_t gi = 0; gi < KVB_ARRAY_LEN(geo); gi++)
            check_attention(cpu, gpu, &VARIANTS[v], mix, 4, geo[gi][0], geo[gi][1], geo[gi][2], 16);
        kvb_backend_destroy(gpu);
    }
    kvb_backend_destroy(cpu);
}
KVB_TEST_END

/* ---------------------------------------------------------------- blocks */

KVB_TEST(blocks_copy_gather_scatter) {
    rng_state = 20;
    kvb_backend *gpu = make("cuda");
    kvb_cuda_stream_t s = kvb_cuda_backend_stream(gpu);
    size_t sizes[] = {65536, 16 * 2 * 8 * 128 * 2, 48, 1000}; /* 1000: not a multiple of 16 */
    for (size_t si = 0; si < KVB_ARRAY_LEN(sizes); si++) {
        size_t bytes = sizes[si];
        int n = 23, pool_n = 40;
        unsigned char *host = malloc(bytes * pool_n);
        for (size_t i = 0; i < bytes * pool_n; i++) host[i] = (unsigned char)(frand() * 127 + 128);
        void *pool = NULL, *packed = NULL, *dev_ptrs = NULL;
        ck_assert_int_eq(kvb_mem_alloc(gpu->mem, bytes * pool_n, &pool), KVB_OK);
        ck_assert_int_eq(kvb_mem_alloc(gpu->mem, bytes * n, &packed), KVB_OK);
        ck_assert_int_eq(kvb_mem_alloc(gpu->mem, sizeof(void *) * 2 * n, &dev_ptrs), KVB_OK);
        ck_assert_int_eq(gpu->iface->to_device(gpu->ctx, pool, host, bytes * pool_n), KVB_OK);
        /* sources: blocks 0..22 in a shuffled order; destinations: blocks 23..39 (never a source) */
        void *ptrs[46];
        int src_idx[23], dst_idx[23];
        for (int i = 0; i < n; i++) {
            src_idx[i] = (i * 5 + 2) % n;
            dst_idx[i] = n + i;
        }
        int nd = pool_n - n; /* 17 scattered destinations */
        for (int i = 0; i < n; i++) ptrs[i] = (char *)pool + (size_t)src_idx[i] * bytes;
        for (int i = 0; i < nd; i++) ptrs[n + i] = (char *)pool + (size_t)dst_idx[i] * bytes;
        ck_assert_int_eq(gpu->iface->to_device(gpu->ctx, dev_ptrs, ptrs, sizeof(void *) * (n + nd)), KVB_OK);
        void **d_src = dev_ptrs, **d_dst = (void **)dev_ptrs + n;
        /* gather all 23 into the packed buffer */
        ck_assert_int_eq(KVB_CUDA_CHECK(kvb_cuda_blocks_gather((const void *const *)d_src, packed, n, bytes, s)), KVB_OK);
        unsigned char *got = malloc(bytes * n);
        ck_assert_int_eq(gpu->iface->to_host(gpu->ctx, got, packed, bytes * n), KVB_OK);
        for (int i = 0; i < n; i++) ck_assert(!memcmp(got + (size_t)i * bytes, host + (size_t)src_idx[i] * bytes, bytes));
        /* scatter the first 17 packed chunks to blocks 23..39 */
        ck_assert_int_eq(KVB_CUDA_CHECK(kvb_cuda_blocks_scatter(packed, d_dst, nd, bytes, s)), KVB_OK);
        unsigned char *pool_back = malloc(bytes * pool_n);
        ck_assert_int_eq(gpu->iface->to_host(gpu->ctx, pool_back, pool, bytes * pool_n), KVB_OK);
        for (int i = 0; i < nd; i++)
            ck_assert(!memcmp(pool_back + (size_t)dst_idx[i] * bytes, host + (size_t)src_idx[i] * bytes, bytes));
        /* copy blocks 23..39 back over blocks src_idx[0..17) (they hold the same bytes: restores host) */
        ck_assert_int_eq(KVB_CUDA_CHECK(kvb_cuda_blocks_copy((const void *const *)d_dst, (void *const *)d_src, nd, bytes, s)),
                         KVB_OK);
        ck_assert_int_eq(gpu->iface->to_host(gpu->ctx, pool_back, pool, bytes * pool_n), KVB_OK);
        for (int i = 0; i < n; i++)
            ck_assert(!memcmp(pool_back + (size_t)i * bytes, host + (size_t)i * bytes, bytes));
        kvb_mem_free(gpu->mem, pool);
        kvb_mem_free(gpu->mem, packed);
        kvb_mem_free(gpu->mem, dev_ptrs);
        free(host);
        free(got);
        free(pool_back);
    }
    kvb_backend_destroy(gpu);
}
KVB_TEST_END

/* ---------------------------------------------------------------- copy (the LSC copy thread) */

typedef struct copier {
    kvb_backend *be;
    char *dst, *src; /* device buffers of `bytes` */
    size_t bytes;
    int reps;
    kvb_status st;
} copier;

static void *copier_main(void *arg) {
    copier *c = arg;
    for (int r = 0; r < c->reps && c->st == KVB_OK; r++) {
        /* in pieces, like a layer slice per block */
        for (size_t off = 0; off < c->bytes && c->st == KVB_OK; off += c->bytes / 8)
            c->st = c->be->iface->copy(c->be->ctx, c->dst + off, c->src + off, c->bytes / 8);
    }
    return NULL;
}

/* The ticket contract (backend.h): copies on the per-direction streams complete by events; an operator
 * issued after wait_ticket reads what the copy brought, the host reads a D2H copy after ticket_wait; the
 * CPU backend keeps the same contract. Under the emulation, an operator issued without wait_ticket reads
 * the copy's poison (NaN): the emulation models the wait it checks. */
static void tickets_on(kvb_backend *be) {
    const kvb_backend_i *bi = be->iface;
    ck_assert_ptr_nonnull(bi->copy_async);
    const int rows = 64, dim = 96;
    size_t n = (size_t)rows * dim, es = kvb_dtype_size(bi->act_dtype), bytes = n * es;
    float *vals = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) vals[i] = (float)((int)(i % 251) - 125) * 0.25f; /* exact in every dtype */
    void *enc = encode(vals, n, bi->act_dtype);
    void *h = NULL, *h2 = NULL, *d = NULL, *d2 = NULL, *o = NULL;
    ck_assert_int_eq(kvb_mem_pinned_alloc(be->mem, bytes, &h), KVB_OK);
    ck_assert_int_eq(kvb_mem_pinned_alloc(be->mem, bytes, &h2), KVB_OK);
    ck_assert_int_eq(kvb_mem_alloc(be->mem, bytes, &d), KVB_OK);
    ck_assert_int_eq(kvb_mem_alloc(be->mem, bytes, &d2), KVB_OK);
    ck_assert_int_eq(kvb_mem_alloc(be->mem, bytes, &o), KVB_OK);
    memcpy(h, enc, bytes);
    int32_t ids[64];
    for (int i = 0; i < rows; i++) ids[i] = rows - 1 - i;
    /* host -> device in two pieces, then an operator on the compute stream after the ticket */
    kvb_copy_piece in[2] = {{d, h, bytes / 2}, {(char *)d + bytes / 2, (char *)h + bytes / 2, bytes - bytes / 2}};
    uint64_t t1 = 0, t2 = 0, t3 = 0;
    ck_assert_int_eq(bi->copy_async(be->ctx, KVB_ENGINE_H2D, in, 2, &t1), KVB_OK);
    ck_assert_uint_gt(t1, 0);
    ck_assert_int_eq(bi->wait_ticket(be->ctx, t1), KVB_OK);
    ck_assert_int_eq(bi->gather_rows(be->ctx, d, ids, rows, dim, o), KVB_OK);
    float *got = download(be, o, n);
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < dim; j++)
            ck_assert_msg(got[(size_t)i * dim + j] == vals[(size_t)ids[i] * dim + j], "%s: row %d col %d: %g, want %g",
                          bi->name, i, j, got[(size_t)i * dim + j], vals[(size_t)ids[i] * dim + j]);
    free(got);
    /* device -> host after the operator that wrote o; the host reads after ticket_wait */
    kvb_copy_piece out = {h2, o, bytes};
    ck_assert_int_eq(bi->copy_async(be->ctx, KVB_ENGINE_D2H, &out, 1, &t2), KVB_OK);
    ck_assert_uint_gt(t2, t1);
    ck_assert_int_eq(bi->ticket_wait(be->ctx, t2), KVB_OK);
    ck_assert_int_eq(bi->ticket_done(be->ctx, t2), 1);
    ck_assert_int_eq(bi->ticket_done(be->ctx, t1), 1);
    float *back = malloc(n * sizeof(float));
    decode_dt(h2, n, bi->act_dtype, back);
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < dim; j++) ck_assert(back[(size_t)i * dim + j] == vals[(size_t)ids[i] * dim + j]);
    free(back);
    /* device -> device on the peer engine */
    kvb_copy_piece peer = {d2, d, bytes};
    ck_assert_int_eq(bi->copy_async(be->ctx, KVB_ENGINE_PEER, &peer, 1, &t3), KVB_OK);
    ck_assert_int_eq(bi->wait_ticket(be->ctx, t3), KVB_OK);
    got = download(be, d2, n);
    for (size_t i = 0; i < n; i++) ck_assert(got[i] == vals[i]);
    free(got);
    if (kvb_cuda_backend_is(be)) { /* tickets never handed out */
        ck_assert_int_eq(bi->wait_ticket(be->ctx, 0), KVB_ERR_INVALID);
        ck_assert_int_eq(bi->ticket_wait(be->ctx, t3 + 1000), KVB_ERR_INVALID);
    }
#ifdef KVB_CUDA_EMU
    if (kvb_cuda_backend_is(be)) {
        /* no wait_ticket: the operator runs before the copy has landed and reads its poison */
        uint64_t t4 = 0;
        kvb_copy_piece again = {d2, h, bytes};
        ck_assert_int_eq(bi->copy_async(be->ctx, KVB_ENGINE_H2D, &again, 1, &t4), KVB_OK);
        ck_assert_int_eq(bi->gather_rows(be->ctx, d2, ids, rows, dim, o), KVB_OK);
        got = download(be, o, n);
        size_t nan = 0;
        for (size_t i = 0; i < n; i++) nan += isnan(got[i]) != 0;
        ck_assert_msg(nan == n, "%s: the operator issued without waiting read %zu NaN of %zu", bi->name, nan, n);
        free(got);
        ck_assert_int_eq(bi->ticket_wait(be->ctx, t4), KVB_OK);
        got = download(be, d2, n);
        for (size_t i = 0; i < n; i++) ck_assert(got[i] == vals[i]);
        free(got);
    }
#endif
    kvb_mem_pinned_free(be->mem, h);
    kvb_mem_pinned_free(be->mem, h2);
    kvb_mem_free(be->mem, d);
    kvb_mem_free(be->mem, d2);
    kvb_mem_free(be->mem, o);
    free(enc);
    free(vals);
}

KVB_TEST(copy_tickets) {
    kvb_backend *cpu = make("cpu");
    tickets_on(cpu);
    kvb_backend_destroy(cpu);
    for (int v = 0; v < N_VARIANTS; v++) {
        kvb_backend *gpu = make(VARIANTS[v].name);
        tickets_on(gpu);
        kvb_backend_destroy(gpu);
    }
}
KVB_TEST_END

/* copy_async with many scattered pieces (host slot i <-> device slot 37 i mod 97 <-> another device's
 * slot 11 i mod 97, as kvbank-bench cuda's data path posts them, so no two continue each other), some split in two halves that do (merged back),
 * some empty, in both directions and on the peer engine, the bytes checked; and a call whose pieces write
 * the same bytes (the later must win, so it cannot go as a batch, whose copies run in no order). On a
 * CUDA backend with the batch API (12.8+, and the emulation) the independent pieces go out batched, one
 * piece per slot; `batch` 0 expects one call each (the batch API off, or failing). */
enum { SCAT_SLOTS = 97, SCAT_HALVES = 8 };
/* The pieces of scattered_on's copy `dir`: 0 h -> d, 1 d -> d2, 2 d2 -> h2, each slot of `slot` bytes
 * scattered on the device side; returns their number (at most SCAT_SLOTS + SCAT_HALVES + 4). */
static int scatter(int dir, const unsigned char *h, void *d, void *d2, unsigned char *h2, size_t slot,
                   kvb_copy_piece *x) {
    int n = 0;
    for (int i = 0; i < SCAT_SLOTS; i++) {
        size_t a = (size_t)i * slot, b = (size_t)((i * 37) % SCAT_SLOTS) * slot;
        size_t c = (size_t)((i * 11) % SCAT_SLOTS) * slot;
        unsigned char *dd = d, *dd2 = d2;
        unsigned char *to = dir == 0 ? dd + b : dir == 1 ? dd2 + c : h2 + a;
        const unsigned char *from = dir == 0 ? h + a : dir == 1 ? dd + b : dd2 + c;
        if (i % 23 == 5) x[n++] = (kvb_copy_piece){to, from, 0};
        if (i < SCAT_HALVES) {
            x[n++] = (kvb_copy_piece){to, from, slot / 2};
            x[n++] = (kvb_copy_piece){to + slot / 2, from + slot / 2, slot - slot / 2};
        } else {
            x[n++] = (kvb_copy_piece){to, from, slot};
        }
    }
    return n;
}

static void scattered_on(kvb_backend *be, int batch) {
    const kvb_backend_i *bi = be->iface;
    enum { NS = SCAT_SLOTS };
    const size_t slot = 4160; /* not a power of two */
    size_t bytes = slot * NS;
    unsigned char *h = NULL, *h2 = NULL;
    void *d = NULL, *d2 = NULL;
    ck_assert_int_eq(kvb_mem_pinned_alloc(be->mem, bytes, (void **)&h), KVB_OK);
    ck_assert_int_eq(kvb_mem_pinned_alloc(be->mem, bytes, (void **)&h2), KVB_OK);
    ck_assert_int_eq(kvb_mem_alloc(be->mem, bytes, &d), KVB_OK);
    ck_assert_int_eq(kvb_mem_alloc(be->mem, bytes, &d2), KVB_OK);
    for (size_t i = 0; i < bytes; i++) h[i] = (unsigned char)(i * 131 + i / 4099 + 7);
    memset(h2, 0, bytes);
    kvb_copy_piece x[SCAT_SLOTS + SCAT_HALVES + 4];
    kvb_cuda_copy_counts c0, c1;
    kvb_cuda_backend_copy_counts(be, &c0);
    for (int dir = 0; dir < 3; dir++) {
        int n = scatter(dir, h, d, d2, h2, slot, x);
        kvb_copy_engine e = dir == 0 ? KVB_ENGINE_H2D : dir == 1 ? KVB_ENGINE_PEER : KVB_ENGINE_D2H;
        uint64_t t = 0;
        ck_assert_int_eq(bi->copy_async(be->ctx, e, x, n, &t), KVB_OK);
        if (dir < 2) ck_assert_int_eq(bi->wait_ticket(be->ctx, t), KVB_OK); /* the next copy reads it */
        else ck_assert_int_eq(bi->ticket_wait(be->ctx, t), KVB_OK);
    }
    for (size_t i = 0; i < bytes; i++)
        ck_assert_msg(h2[i] == h[i], "%s: byte %zu (slot %zu) came back %d, want %d", bi->name, i, i / slot, h2[i], h[i]);
    kvb_cuda_backend_copy_counts(be, &c1);
    if (kvb_cuda_backend_is(be)) {
        uint64_t want = 3 * NS; /* the halves merged, the empty pieces dropped */
        ck_assert_uint_eq(c1.batched - c0.batched, batch ? want : 0);
        ck_assert_uint_eq(c1.single - c0.single, batch ? 0 : want);
    }
    /* dependent pieces: slots 1 and then 2 of h into device slot 0, which must end as slot 2 */
    kvb_copy_piece dep[2] = {{d, h + slot, slot}, {d, h + 2 * slot, slot}};
    uint64_t t = 0;
    ck_assert_int_eq(bi->copy_async(be->ctx, KVB_ENGINE_H2D, dep, 2, &t), KVB_OK);
    ck_assert_int_eq(bi->wait_ticket(be->ctx, t), KVB_OK);
    kvb_copy_piece back = {h2, d, slot};
    ck_assert_int_eq(bi->copy_async(be->ctx, KVB_ENGINE_D2H, &back, 1, &t), KVB_OK);
    ck_assert_int_eq(bi->ticket_wait(be->ctx, t), KVB_OK);
    ck_assert_msg(!memcmp(h2, h + 2 * slot, slot), "%s: of two pieces writing the same bytes, the first won", bi->name);
    kvb_cuda_backend_copy_counts(be, &c0);
    if (kvb_cuda_backend_is(be)) ck_assert_uint_eq(c0.single - c1.single, 3);
#ifdef KVB_CUDA_EMU
    if (kvb_cuda_backend_is(be)) {
        /* a batch too lands only when something waits for it: read without its ticket, poison */
        unsigned char *got = malloc(bytes);
        ck_assert_int_eq(bi->copy_async(be->ctx, KVB_ENGINE_H2D, x, scatter(0, h, d, d2, h2, slot, x), &t), KVB_OK);
        ck_assert_int_eq(bi->to_host(be->ctx, got, d, bytes), KVB_OK);
        size_t poison = 0;
        for (size_t i = 0; i < bytes; i++) poison += got[i] == 0xFF;
        ck_assert_msg(poison == bytes, "%s: read without waiting, %zu of %zu bytes are poison", bi->name, poison, bytes);
        ck_assert_int_eq(bi->wait_ticket(be->ctx, t), KVB_OK);
        ck_assert_int_eq(bi->to_host(be->ctx, got, d, bytes), KVB_OK);
        for (int i = 0; i < NS; i++)
            ck_assert(!memcmp(got + (size_t)((i * 37) % NS) * slot, h + (size_t)i * slot, slot));
        free(got);
    }
#endif
    kvb_mem_pinned_free(be->mem, h);
    kvb_mem_pinned_free(be->mem, h2);
    kvb_mem_free(be->mem, d);
    kvb_mem_free(be->mem, d2);
}

KVB_TEST(copy_batch_scattered) {
    kvb_backend *cpu = make("cpu");
    scattered_on(cpu, 0);
    kvb_backend_destroy(cpu);
    for (int v = 0; v < N_VARIANTS; v++) {
        kvb_backend *gpu = make(VARIANTS[v].name);
        int has_batch = kvb_cuda_backend_set_copy_batch(gpu, 1);
#ifdef KVB_CUDA_EMU
        ck_assert_int_eq(has_batch, 1); /* this toolkit has the batch API, the emulation implements it */
#endif
        scattered_on(gpu, has_batch);
        kvb_cuda_copy_counts k;
        kvb_cuda_backend_copy_counts(gpu, &k);
        ck_assert_int_eq(k.batch_failed, 0);
        ck_assert_int_eq(kvb_cuda_backend_set_copy_batch(gpu, 0), has_batch); /* one call each, as asked */
        scattered_on(gpu, 0);
        kvb_backend_destroy(gpu);
    }
#ifdef KVB_CUDA_EMU
    /* a runtime whose batch API fails: each engine falls back once, the bytes are the same, and the
     * failure is not left as the thread's last error for the next launch to report */
    setenv("KVB_EMU_NO_BATCH", "1", 1);
    kvb_backend *gpu = make("cuda:f32");
    scattered_on(gpu, 0);
    kvb_cuda_copy_counts k;
    kvb_cuda_backend_copy_counts(gpu, &k);
    ck_assert_int_eq(k.batch_failed, 3);
    void *a = NULL, *o = NULL;
    ck_assert_int_eq(kvb_mem_alloc(gpu->mem, 64 * sizeof(float), &a), KVB_OK);
    ck_assert_int_eq(kvb_mem_alloc(gpu->mem, 64 * sizeof(float), &o), KVB_OK);
    int32_t ids[2] = {1, 0};
    ck_assert_int_eq(gpu->iface->gather_rows(gpu->ctx, a, ids, 2, 32, o), KVB_OK);
    kvb_mem_free(gpu->mem, a);
    kvb_mem_free(gpu->mem, o);
    kvb_backend_destroy(gpu);
    unsetenv("KVB_EMU_NO_BATCH");
#endif
}
KVB_TEST_END

KVB_TEST(copy_concurrent) {
    rng_state = 22;
    kvb_backend *cpu = make("cpu");
    for (int v = 0; v < N_VARIANTS; v++) {
        kvb_backend *gpu = make(VARIANTS[v].name);
        size_t bytes = (size_t)8 << 20;
        unsigned char *host = malloc(bytes), *back = malloc(bytes);
        for (size_t i = 0; i < bytes; i++) host[i] = (unsigned char)(frand() * 127 + 128);
        void *a = NULL, *b = NULL;
        ck_assert_int_eq(kvb_mem_alloc(gpu->mem, bytes, &a), KVB_OK);
        ck_assert_int_eq(kvb_mem_alloc(gpu->mem, bytes, &b), KVB_OK);
        ck_assert_int_eq(gpu->iface->to_device(gpu->ctx, a, host, bytes), KVB_OK);
        /* a plain copy, then one from a second thread while this one runs operators elsewhere */
        ck_assert_int_eq(gpu->iface->copy(gpu->ctx, b, a, bytes), KVB_OK);
        ck_assert_int_eq(gpu->iface->to_host(gpu->ctx, back, b, bytes), KVB_OK);
        ck_assert(!memcmp(back, host, bytes));
        ck_assert_int_eq(gpu->iface->to_device(gpu->ctx, b, host + 1, bytes - 1), KVB_OK); /* b differs now */
        copier c = {.be = gpu, .dst = b, .src = a, .bytes = bytes, .reps = 20, .st = KVB_OK};
        pthread_t th;
        ck_assert_int_eq(pthread_create(&th, NULL, copier_main, &c), 0);
        seq_spec mix[] = {{1, 700}, {40, 90}};
        check_attention(cpu, gpu, &VARIANTS[v], mix, 2, 8, 2, 64, 16);
        ck_assert_int_eq(pthread_join(th, NULL), 0);
        ck_assert_int_eq(c.st, KVB_OK);
        ck_assert_int_eq(gpu->iface->to_host(gpu->ctx, back, b, bytes), KVB_OK);
        ck_assert(!memcmp(back, host, bytes));
        kvb_mem_free(gpu->mem, a);
        kvb_mem_free(gpu->mem, b);
        free(host);
        free(back);
        kvb_backend_destroy(gpu);
    }
    kvb_backend_destroy(cpu);
}
KVB_TEST_END

/* ---------------------------------------------------------------- sampling */

static void check_sampling(kvb_backend *gpu, kvb_dtype dt, int rows, int vocab, float logit_scale) {
    kvb_cuda_stream_t s = kvb_cuda_backend_stream(gpu);
    float *logits = malloc(sizeof(float) * rows * vocab);
    for (size_t i = 0; i < (size_t)rows * vocab; i++) logits[i] = round_dt(frand() * logit_scale, dt);
    /* some exact ties, to check the lowest-id rule */
    logits[3] = logits[5] = 100.0f;
    kvb_cuda_sample_params *P = calloc((size_t)rows, sizeof *P);
    kvb_sampling *cs = calloc((size_t)rows, sizeof *cs);
    kvb_rng *rng = calloc((size_t)rows, sizeof *rng);
    for (int r = 0; r < rows; r++) {
        int kind = r % 6;
        kvb_sampling sp = {.temperature = kind == 0 ? 0.0f : 0.5f + (float)(r % 5) * 0.3f,
                           .top_k = kind == 2 || kind == 4 ? 1 + r % 50 : (kind == 5 ? vocab + 3 : 0),
                           .top_p = kind == 3 || kind == 4 ? 0.5f + 0.09f * (float)(r % 5) : 1.0f,
                           .seed = 1000 + (uint64_t)r};
        cs[r] = sp;
        kvb_rng_seed(&rng[r], sp.seed);
        kvb_rng peek = rng[r];
        P[r] = (kvb_cuda_sample_params){sp.temperature, sp.top_k, sp.top_p, kvb_rng_uniform(&peek)};
    }
    void *dl = NULL, *dp = NULL, *dout = NULL, *dgreedy = NULL;
    size_t es = kvb_dtype_size(dt);
    ck_assert_int_eq(kvb_mem_alloc(gpu->mem, (size_t)rows * vocab * es, &dl), KVB_OK);
    ck_assert_int_eq(kvb_mem_alloc(gpu->mem, sizeof *P * rows, &dp), KVB_OK);
    ck_assert_int_eq(kvb_mem_alloc(gpu->mem, sizeof(int32_t) * rows, &dout), KVB_OK);
    ck_assert_int_eq(kvb_mem_alloc(gpu->mem, sizeof(int32_t) * rows, &dgreedy), KVB_OK);
    void *enc = encode(logits, (size_t)rows * vocab, dt);
    ck_assert_int_eq(gpu->iface->to_device(gpu->ctx, dl, enc, (size_t)rows * vocab * es), KVB_OK);
    ck_assert_int_eq(gpu->iface->to_device(gpu->ctx, dp, P, sizeof *P * rows), KVB_OK);
    ck_assert_int_eq(KVB_CUDA_CHECK(kvb_cuda_sample(dl, dt, rows, vocab, dp, dout, s)), KVB_OK);
    ck_assert_int_eq(KVB_CUDA_CHECK(kvb_cuda_argmax(dl, dt, rows, vocab, dgreedy, s)), KVB_OK);
    int32_t *got = malloc(sizeof(int32_t) * rows), *greedy = malloc(sizeof(int32_t) * rows);
    ck_assert_int_eq(gpu->iface->to_host(gpu->ctx, got, dout, sizeof(int32_t) * rows), KVB_OK);
    ck_assert_int_eq(gpu->iface->to_host(gpu->ctx, greedy, dgreedy, sizeof(int32_t) * rows), KVB_OK);
    float *scratch = malloc(sizeof(float) * 2 * vocab);
    int agree = 0, n_sampled = 0;
    for (int r = 0; r < rows; r++) {
        kvb_sampling g0 = {.temperature = 0};
        int32_t am = kvb_sample(&g0, &rng[r], logits + (size_t)r * vocab, vocab, scratch);
        ck_assert_int_eq(greedy[r], am);
        /* kvb_sample draws the same u from the same rng state */
        int32_t want = kvb_sample(&cs[r], &rng[r], logits + (size_t)r * vocab, vocab, scratch);
        ck_assert_int_ge(got[r], 0);
        ck_assert_int_lt(got[r], vocab);
        if (cs[r].temperature <= 0) {
            ck_assert_int_eq(got[r], want);
            continue;
        }
        n_sampled++;
        agree += got[r] == want;
    }
    /* differences can come only from expf ulps and fixed-point masses when u sits on a boundary */
    ck_assert_msg(agree >= n_sampled - KVB_MAX(1, n_sampled / 50), "sampling %s vocab %d: %d of %d agree",
                  kvb_dtype_name(dt), vocab, agree, n_sampled);
    kvb_mem_free(gpu->mem, dl);
    kvb_mem_free(gpu->mem, dp);
    kvb_mem_free(gpu->mem, dout);
    kvb_mem_free(gpu->mem, dgreedy);
    free(enc);
    free(logits);
    free(P);
    free(cs);
    free(rng);
    free(got);
    free(greedy);
    free(scratch);
}

KVB_TEST(sampling) {
    rng_state = 21;
    kvb_backend *gpu = make("cuda:f32");
    check_sampling(gpu, KVB_DTYPE_F32, 120, 5000, 8.0f);
    check_sampling(gpu, KVB_DTYPE_F32, 60, 128256, 12.0f);
    check_sampling(gpu, KVB_DTYPE_BF16, 60, 32000, 8.0f);
    check_sampling(gpu, KVB_DTYPE_F16, 30, 3, 1.0f);
    kvb_backend_destroy(gpu);
}
KVB_TEST_END

/* The backend's `sample` (the engine's batch sampled on the device) against common/sched/sampling.c on
 * the same logits and the same uniform draws: greedy rows (a tie among them: the lowest id) and
 * seeded rows with temperature, top-k and top-p. */
KVB_TEST(backend_sample) {
    rng_state = 31;
    for (int v = 0; v < N_VARIANTS; v++) {
        const variant *V = &VARIANTS[v];
        kvb_backend *gpu = make(V->name);
        ck_assert_ptr_nonnull(gpu->iface->sample);
        enum { ROWS = 24, VOCAB = 3000 };
        float *lg = rand_vec((size_t)ROWS * VOCAB, 6.0f, V->dt);
        lg[(size_t)3 * VOCAB + 17] = lg[(size_t)3 * VOCAB + 900] = 50.0f; /* a tie at the top of row 3 */
        void *d = upload(gpu, lg, (size_t)ROWS * VOCAB);
        kvb_sample_row p[ROWS];
        kvb_sampling samp[ROWS];
        kvb_rng r_dev[ROWS], r_cpu[ROWS];
        for (int r = 0; r < ROWS; r++) {
            int mode = r % 4; /* greedy, temperature, top-k, top-p */
            samp[r] = (kvb_sampling){.temperature = mode ? 0.7f + 0.1f * (r % 3) : 0, .top_k = mode == 2 ? 40 : 0,
                                     .top_p = mode == 3 ? 0.9f : 0, .seed = 1000 + (uint64_t)r};
            kvb_rng_seed(&r_dev[r], samp[r].seed);
            kvb_rng_seed(&r_cpu[r], samp[r].seed);
            p[r] = (kvb_sample_row){samp[r].temperature, samp[r].top_k, samp[r].top_p,
                                    mode ? kvb_rng_uniform(&r_dev[r]) : 0};
        }
        int32_t got[ROWS];
        ck_assert_int_eq(gpu->iface->sample(gpu->ctx, d, ROWS, VOCAB, p, got), KVB_OK);
        float *scratch = malloc(2 * VOCAB * sizeof(float));
        float *host = download(gpu, d, (size_t)ROWS * VOCAB); /* the logits as the device holds them */
        for (int r = 0; r < ROWS; r++) {
            int32_t want = kvb_sample(&samp[r], &r_cpu[r], host + (size_t)r * VOCAB, VOCAB, scratch);
            ck_assert_msg(got[r] == want, "%s row %d (T %.1f, top_k %d, top_p %.1f): device %d, cpu %d", V->name, r,
                          samp[r].temperature, samp[r].top_k, samp[r].top_p, got[r], want);
        }
        ck_assert_int_eq(got[3], 17);
        free(host);
        free(scratch);
        free(lg);
        kvb_mem_free(gpu->mem, d);
        kvb_backend_destroy(gpu);
    }
}
KVB_TEST_END

/* ---------------------------------------------------------------- memory pieces */

KVB_TEST(cuda_memory) {
    kvb_backend *gpu = make("cuda"); /* makes the device current and its context live */
    kvb_cuda_stream_t s = kvb_cuda_backend_stream(gpu);
    /* a device region and its handle */
    kvb_cuda_region *r = NULL;
    ck_assert_int_eq(kvb_cuda_region_create((size_t)3 << 20, &r), KVB_OK);
    ck_assert(kvb_cuda_handle_valid(kvb_cuda_region_handle(r)));
    ck_assert_int_eq(strlen(kvb_cuda_region_handle(r)), KVB_CUDA_HANDLE_CHARS);
    ck_assert(kvb_cuda_region_is_owner(r));
    ck_assert_int_eq(kvb_cuda_region_size(r), (size_t)3 << 20);
    /* zero-filled */
    unsigned char probe[4096];
    ck_assert_int_eq(gpu->iface->to_host(gpu->ctx, probe, kvb_cuda_region_base(r), sizeof probe), KVB_OK);
    for (size_t i = 0; i < sizeof probe; i++) ck_assert_int_eq(probe[i], 0);
    /* opening our own handle is refused (CUDA IPC is between processes) */
    kvb_cuda_region *self = NULL;
    ck_assert_int_ne(kvb_cuda_region_import(kvb_cuda_region_handle(r), 4096, &self), KVB_OK);
    ck_assert_int_eq(kvb_cuda_region_import("xyz", 4096, &self), KVB_ERR_INVALID);
    /* pinned buffers and events: pinned -> device -> pinned, ordered by an event on a second stream */
    kvb_cuda_pinned *p = NULL;
    ck_assert_int_eq(kvb_cuda_pinned_create((size_t)1 << 20, &p), KVB_OK);
    unsigned char *ph = kvb_cuda_pinned_base(p);
    for (size_t i = 0; i < ((size_t)1 << 20); i++) ph[i] = (unsigned char)(i * 7);
    kvb_cuda_stream_t s2 = NULL;
    ck_assert_int_eq(kvb_cuda_stream_create(&s2), KVB_OK);
    kvb_cuda_event *e0 = NULL, *e1 = NULL;
    ck_assert_int_eq(kvb_cuda_event_create(1, &e0), KVB_OK);
    ck_assert_int_eq(kvb_cuda_event_create(1, &e1), KVB_OK);
    ck_assert_int_eq(kvb_cuda_event_record(e0, s), KVB_OK);
    ck_assert_int_eq(kvb_cuda_copy_async(kvb_cuda_region_base(r), ph, (size_t)1 << 20, s), KVB_OK);
    ck_assert_int_eq(kvb_cuda_event_record(e1, s), KVB_OK);
    ck_assert_int_eq(kvb_cuda_stream_wait(s2, e1), KVB_OK);
    ck_assert_int_eq(kvb_cuda_copy_async(ph + ((size_t)1 << 19), kvb_cuda_region_base(r), (size_t)1 << 19, s2), KVB_OK);
    ck_assert_int_eq(kvb_cuda_stream_sync(s2), KVB_OK);
    ck_assert_int_eq(kvb_cuda_event_done(e1), 1);
    float ms = -1;
    ck_assert_int_eq(kvb_cuda_event_elapsed_ms(e0, e1, &ms), KVB_OK);
    ck_assert(ms >= 0);
    for (size_t i = 0; i < ((size_t)1 << 19); i++) ck_assert_int_eq(ph[((size_t)1 << 19) + i], (unsigned char)(i * 7));
    /* virtual memory: tests/test_mem_cuda (the memory interface on this device) */
    kvb_cuda_event_destroy(e0);
    kvb_cuda_event_destroy(e1);
    kvb_cuda_stream_destroy(s2);
    kvb_cuda_pinned_destroy(p);
    kvb_cuda_region_destroy(r);
    kvb_backend_destroy(gpu);
}
KVB_TEST_END

/* Whether this machine has a CUDA device (kvb_test_need_device runs it in a child, so that this
 * process, which forks every test, never initialises CUDA itself). */
static int probe(char *why, size_t len) { return kvb_mem_probe("cuda", 0, why, len); }

int main(int argc, char **argv) {
    const kvb_test table[] = {
        KVB_T(variants_and_errors, 60),  KVB_T(embed_gather_rows, 60),
        KVB_T(matmul, 120),              KVB_T(matmul_fused, 120),
        KVB_T(matmul_skinny, 300),
        KVB_T(qkv_finish, 60),           KVB_T(rmsnorm, 60),
        KVB_T(rope, 60),                 KVB_T(silu_mul_add, 60),
        KVB_T(attention_decode, 300),    KVB_T(attention_long_context_split, 300),
        KVB_T(attention_decode_plan, 60),
        KVB_T(attention_prefill, 300),   KVB_T(attention_head_shapes, 300),
        KVB_T(attention_sliding_window, 300), KVB_T(attention_chunk_over_past, 300),
        KVB_T(attention_prefill_tiles, 300),
        KVB_T(bias_add, 60),
        KVB_T(blocks_copy_gather_scatter, 60), KVB_T(copy_concurrent, 120), KVB_T(copy_tickets, 60),
        KVB_T(copy_batch_scattered, 60),
        KVB_T(sampling, 120),              KVB_T(backend_sample, 60),
        KVB_T(cuda_memory, 60),
    };
    int skip = kvb_test_need_device(argc, argv, probe);
    if (skip >= 0) return skip;
    return kvb_test_main(argc, argv, "backend", table, (int)KVB_ARRAY_LEN(table));
}

#else /* !KVB_WITH_CUDA */

int main(void) {
    printf("SKIP: no backend other than cpu is compiled into this build (%s)\n", kvb_backend_list());
    return 77;
}

#endif
