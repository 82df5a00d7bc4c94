/* kvbank — the CPU backend: host memory, f32 activations, OpenBLAS + OpenMP kernels. */
#include <cblas.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/cpu/ops.h"

/* OpenBLAS' own thread count (declared in its cblas.h on Debian, but not by every provider). */
void openblas_set_num_threads(int n);


static kvb_status cpu_copy(void *ctx, void *dst, const void *src, size_t bytes) {
    memcpy(dst, src, bytes);
    return KVB_OK;
}

static kvb_status cpu_to_host_f32(void *ctx, float *dst, const void *src, size_t n) {
    memcpy(dst, src, n * sizeof(float));
    return KVB_OK;
}

static kvb_status cpu_sync(void *ctx) { return KVB_OK; }

/* The ticket contract on the host: operators are done when they return, so a copy is done when
 * copy_async returns and every ticket it handed out has landed. */
static kvb_status cpu_copy_async(void *ctx, kvb_copy_engine dir, const kvb_copy_piece *x, int n, uint64_t *ticket) {
    kvb_cpu_ctx *c = ctx;
    (void)dir;
    for (int i = 0; i < n; i++)
        if (x[i].bytes) memmove(x[i].dst, x[i].src, x[i].bytes);
    *ticket = __atomic_add_fetch(&c->tickets, 1, __ATOMIC_RELAXED);
    return KVB_OK;
}

static kvb_status cpu_wait_ticket(void *ctx, uint64_t ticket) {
    (void)ctx, (void)ticket;
    return KVB_OK;
}

static int cpu_ticket_done(void *ctx, uint64_t ticket) {
    (void)ctx, (void)ticket;
    return 1;
}

static kvb_status cpu_weight_load(void *ctx, const void *src, kvb_dtype src_dtype, int64_t rows, int64_t cols,
                                  kvb_tensor *dst) {
    if (rows <= 0 || cols <= 0) return KVB_ERR_INVALID;
    if (src_dtype == KVB_DTYPE_F8_E4M3) return KVB_ERR_UNSUPPORTED; /* needs its scales: weight_fp8 */
    size_t n = (size_t)rows * (size_t)cols;
    float *w = NULL;
    KVB_TRY(kvb_aligned_alloc(n * sizeof(float), (void **)&w));
    /* safetensors data is little-endian and may be unaligned inside the mmapped file */
    kvb__cpu_widen(src, src_dtype, (int64_t)n, w);
    *dst = (kvb_tensor){.data = w, .dtype = KVB_DTYPE_F32, .ne = {rows, cols}};
    return KVB_OK;
}

/* Weights are used where they lie (the safetensors mapping): the file's page cache is the only copy, so
 * the process holds the weights once, in the bytes they are stored in. Matrices of bf16 and f16 too: the
 * products widen them as they read them (matmul.c), the embedding row by row. Vectors of half types (norms,
 * biases: a few KB) are converted by weight_load, the kernels that read them taking f32. */
static kvb_status cpu_weight_view(void *ctx, const void *src, kvb_dtype src_dtype, int64_t rows, int64_t cols,
                                  kvb_tensor *dst) {
    if (rows <= 0 || cols <= 0) return KVB_ERR_INVALID;
    int half = src_dtype == KVB_DTYPE_BF16 || src_dtype == KVB_DTYPE_F16;
    if (src_dtype == KVB_DTYPE_F32 ? (uintptr_t)src % sizeof(float) != 0 : !half || cols == 1 || (uintptr_t)src % 2)
        return KVB_ERR_UNSUPPORTED;
    *dst = (kvb_tensor){.data = (void *)src, .dtype = src_dtype, .ne = {rows, cols}, .view = 1};
    return KVB_OK;
}

/* E4M3 bytes in place; the scales copied, one per row (a per-tensor scale repeated), so that the
 * products read scale[r] whatever the scheme. */
static kvb_status cpu_weight_fp8(void *ctx, const kvb_fp8_weight *src, kvb_tensor *dst) {
    if (src->rows <= 0 || src->cols <= 1 || (src->n_scale != 1 && src->n_scale != src->rows)) return KVB_ERR_INVALID;
    const uint8_t *b = src->data;
    for (size_t i = 0; i < (size_t)src->rows * (size_t)src->cols; i++)
        if ((b[i] & 0x7f) == 0x7f) {
            KVB_LOG_E("cpu backend: FP8 weight [%lld][%lld] holds a NaN (byte 0x%02x at element %zu)",
                      (long long)src->rows, (long long)src->cols, b[i], i);
            return KVB_ERR_INVALID;
        }
    float *scale = NULL;
    KVB_TRY(kvb_aligned_alloc((size_t)src->rows * sizeof(float), (void **)&scale));
    for (int64_t r = 0; r < src->rows; r++) scale[r] = src->scale[src->n_scale == 1 ? 0 : r];
    *dst = (kvb_tensor){.data = (void *)src->data, .dtype = KVB_DTYPE_F8_E4M3, .ne = {src->rows, src->cols},
                        .view = 1, .scale = scale, .n_scale = src->rows, .act = src->act};
    return KVB_OK;
}

static void cpu_weight_free(void *ctx, kvb_tensor *t) {
    if (!t) return;
    if (!t->view) free(t->data);
    free(t->scale);
    t->data = NULL;
    t->scale = NULL;
}

static kvb_status cpu_embed(void *ctx, const kvb_tensor *table, const int32_t *ids, int n, void *out) {
    kvb__cpu_embed(table, ids, n, out);
    return KVB_OK;
}

static kvb_status cpu_matmul(void *ctx, const void *x, int n, const kvb_tensor *w, float beta, void *y) {
    return kvb__cpu_matmul(ctx, x, n, w, beta, y);
}

#define MATMUL_N_MAX 4

static kvb_status cpu_matmul_n(void *ctx, const void *x, int n, const kvb_tensor *const *w, int nw, void *const *y) {
    if (nw < 1 || nw > MATMUL_N_MAX) return KVB_ERR_INVALID;
    for (int i = 0; i < nw; i++)
        if (w[i]->ne[1] != w[0]->ne[1]) return KVB_ERR_INVALID;
    return kvb__cpu_matmul_n(ctx, x, n, w, nw, (float *const *)y);
}

static kvb_status cpu_rmsnorm(void *ctx, const void *x, int rows, int dim, const kvb_tensor *w, float eps, void *y) {
    kvb__cpu_rmsnorm(x, rows, dim, w->data, eps, y);
    return KVB_OK;
}

static kvb_status cpu_rope(void *ctx, void *q, int n_heads, void *k, int n_kv_heads, int n, const int32_t *pos,
                           const kvb_rope *rope) {
    return kvb__cpu_rope(ctx, q, n_heads, k, n_kv_heads, n, pos, rope);
}

static kvb_status cpu_bias_add(void *ctx, void *y, int n, const kvb_tensor *b) {
    if (b->ne[1] != 1 || b->ne[0] > INT32_MAX) return KVB_ERR_INVALID;
    kvb__cpu_bias_add(y, n, (int)b->ne[0], b->data);
    return KVB_OK;
}

static kvb_status cpu_silu_mul(void *ctx, const void *gate, const void *up, size_t n, void *out) {
    kvb__cpu_silu_mul(gate, up, n, out);
    return KVB_OK;
}

static kvb_status cpu_kv_write(void *ctx, const kvb_attn_batch *b, const void *k, const void *v) {
    kvb__cpu_kv_write(b, k, v);
    return KVB_OK;
}

static kvb_status cpu_attention(void *ctx, const kvb_attn_batch *b, const void *q, void *out) {
    return kvb__cpu_attention(ctx, b, q, out);
}

static kvb_status cpu_gather_rows(void *ctx, const void *x, const int32_t *rows, int n, int dim, void *out) {
    for (int i = 0; i < n; i++)
        memcpy((float *)out + (size_t)i * dim, (const float *)x + (size_t)rows[i] * dim, (size_t)dim * sizeof(float));
    return KVB_OK;
}

static void cpu_set_threads(void *ctx, int n_threads) {
    kvb_cpu_ctx *c = ctx;
    if (n_threads < 1) n_threads = 1;
    /* scratch and the products' buffers are per thread: drop them so the next reserve sizes them for the
     * new count */
    free(c->scratch);
    c->scratch = NULL;
    c->scratch_floats = 0;
    free(c->mm_buf);
    c->mm_buf = NULL;
    c->mm_buf_floats = 0;
    c->n_threads = n_threads;
    /* one pool: OpenMP splits the work, OpenBLAS runs inside it single-threaded */
    openblas_set_num_threads(1);
    kvb__cpu_threads = n_threads;
}

static void cpu_destroy(void *ctx) {
    kvb_cpu_ctx *c = ctx;
    if (!c) return;
    free(c->scratch);
    free(c->rope_cs);
    free(c->items);
    free(c->part);
    free(c->gath);
    free(c->mm_buf);
    free(c->xq);
    free(c->xs);
    free(c);
}

/* Both variants compute in f32; "cpu:bf16" keeps its KV cache in bf16 (the kernels go by the geometry's
 * elem_size, which kvb_model_kv_elem_size derives from the name). */
#define CPU_OPS \
    .to_device = cpu_copy, \
    .to_host = cpu_copy, \
    .to_host_f32 = cpu_to_host_f32, \
    .copy = cpu_copy, \
    .sync = cpu_sync, \
    .copy_async = cpu_copy_async, \
    .wait_ticket = cpu_wait_ticket, \
    .ticket_done = cpu_ticket_done, \
    .ticket_wait = cpu_wait_ticket, \
    .weight_load = cpu_weight_load, \
    .weight_view = cpu_weight_view, \
    .weight_fp8 = cpu_weight_fp8, \
    .weight_free = cpu_weight_free, \
    .embed = cpu_embed, \
    .matmul = cpu_matmul, \
    .matmul_n = cpu_matmul_n, \
    .rmsnorm = cpu_rmsnorm, \
    .rope = cpu_rope, \
    .bias_add = cpu_bias_add, \
    .silu_mul = cpu_silu_mul, \
    .kv_write = cpu_kv_write, \
    .attention = cpu_attention, \
    .gather_rows = cpu_gather_rows, \
    .set_threads = cpu_set_threads, \
    .destroy = cpu_destroy

static const kvb_backend_i cpu_iface = {.name = "cpu", .act_dtype = KVB_DTYPE_F32, CPU_OPS};
static const kvb_backend_i cpu_bf16_iface = {.name = "cpu:bf16", .act_dtype = KVB_DTYPE_F32, CPU_OPS};

kvb_status kvb__backend_cpu_create(int n_threads, int kv_bf16, kvb_backend *out) {
    kvb_cpu_ctx *c = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *c, (void **)&c));
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    kvb__cpu_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    kvb__cpu_avx512 = kvb__cpu_avx2 && __builtin_cpu_supports("avx512f");
    kvb__cpu_avx512bf16 = kvb__cpu_avx512 && __builtin_cpu_supports("avx512bf16") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    /* KVB_CPU_SIMD=0: the generic loops and OpenBLAS only (how a processor without AVX2 runs);
     * KVB_CPU_SIMD=avx2: no AVX-512 (how an AVX2-only processor runs); KVB_CPU_SIMD=avx512: AVX-512 without
     * the bf16 dot products (how an AVX-512 processor without AVX512_BF16 runs). Tests cover those paths with it. */
    const char *simd = getenv("KVB_CPU_SIMD");
    if (simd && strcmp(simd, "0") == 0) kvb__cpu_avx2 = kvb__cpu_avx512 = kvb__cpu_avx512bf16 = 0;
    if (simd && strcmp(simd, "avx2") == 0) kvb__cpu_avx512 = kvb__cpu_avx512bf16 = 0;
    if (simd && strcmp(simd, "avx512") == 0) kvb__cpu_avx512bf16 = 0;
#endif
    out->iface = kv_bf16 ? &cpu_bf16_iface : &cpu_iface;
    out->ctx = c;
    cpu_set_threads(c, n_threads);
    return KVB_OK;
}

/* Set in the re-executed program's environment: which of the two variables kvb_cpu_threads_wait added. */
#define WAIT_SET_ENV "KVB_CPU_WAIT_SET"

static void wait_env_clear(int spin) {
    unsetenv("OMP_WAIT_POLICY");
    if (spin) unsetenv("GOMP_SPINCOUNT");
    unsetenv(WAIT_SET_ENV);
}

void kvb_cpu_threads_wait(char **argv, kvb_cpu_cores cores) {
    const char *set = getenv(WAIT_SET_ENV);
    if (set) { /* re-executed: libgomp has read the variables; the programs this one starts choose their own */
        wait_env_clear(strcmp(set, "spin") == 0);
        return;
    }
    if (getenv("OMP_WAIT_POLICY")) return;
    int spin = cores == KVB_CPU_CORES_OWN && !getenv("GOMP_SPINCOUNT");
    if (setenv("OMP_WAIT_POLICY", "passive", 1) == 0 && (!spin || setenv("GOMP_SPINCOUNT", KVB_CPU_SPIN, 1) == 0) &&
        setenv(WAIT_SET_ENV, spin ? "spin" : "policy", 1) == 0) {
        fflush(NULL);
        execv("/proc/self/exe", argv);
    }
    wait_env_clear(spin); /* no /proc, exec refused or no memory: run on with libgomp's default */
}
