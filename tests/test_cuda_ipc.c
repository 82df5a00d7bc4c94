/* CUDA IPC between two real processes: a worker exports a device region of KV blocks by its handle, the
 * master imports it and runs paged attention over the lent blocks in place.
 *
 *  lent_equals_local   attention over lent blocks, over local copies of them, and over a mix (every
 *                      other block lent) gives the same bits, in bf16 and in f32;
 *  no_touch_after_ack  the reclaim fence: the master synchronises its stream, acks, and keeps
 *                      computing on its own blocks only; the worker then poisons the whole region
 *                      (every byte 0xFF: NaN in both dtypes). The master's results after the ack
 *                      stay equal to the local ones (any read of a lent block would give NaN), and a
 *                      probe read shows the poison is really visible through the import;
 *  bad_handles         a malformed handle, and a well-formed one that names nothing, are refused.
 * Both sides get their memory through the memory interface (common/mem/mem.h) as the node does.
 *
 * The worker is this program re-executed with --worker (a fresh process: CUDA state does not survive
 * fork). Without a GPU, or in a build without CUDA, the program prints "SKIP: ..." and exits 77. */
#include "config.h"

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/mem/mem.h"
#include "kernels/backend.h"
#include "tests/harness.h"

#ifdef KVB_WITH_CUDA
#include "kernels/cuda/backend_cuda.h"

/* The geometry both sides agree on. */
enum { N_LAYERS = 2, LAYER = 1, N_KV = 2, HEAD_DIM = 64, N_HEADS = 8, BS = 16, N_BLOCKS = 64 };

static size_t block_elems(void) { return (size_t)N_LAYERS * 2 * BS * N_KV * HEAD_DIM; }
static size_t layer_off_elems(void) { return (size_t)LAYER * 2 * BS * N_KV * HEAD_DIM; }

/* Block contents both processes derive from the seed: N_BLOCKS blocks of f32 values in [-1, 1),
 * encoded in `dt`. Caller frees. */
static void *make_blocks(uint64_t seed, kvb_dtype dt) {
    size_t n = block_elems() * N_BLOCKS, es = kvb_dtype_size(dt);
    char *b = malloc(n * es);
    if (!b) return NULL;
    uint64_t s = seed;
    for (size_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        float x = (float)((s >> 40) / (double)(1ull << 24)) * 2.0f - 1.0f;
        if (dt == KVB_DTYPE_F32) memcpy(b + 4 * i, &x, 4);
        else {
            uint16_t h = dt == KVB_DTYPE_BF16 ? kvb_f32_to_bf16(x) : kvb_f32_to_f16(x);
            memcpy(b + 2 * i, &h, 2);
        }
    }
    return b;
}

/* ---------------------------------------------------------------- the worker process */

static int read_line(int fd, char *buf, size_t len) {
    size_t n = 0;
    while (n + 1 < len) {
        ssize_t r = read(fd, buf + n, 1);
        if (r <= 0) return -1;
        if (buf[n] == '\n') break;
        n++;
    }
    buf[n] = 0;
    return (int)n;
}

static int write_str(int fd, const char *s) { return write(fd, s, strlen(s)) == (ssize_t)strlen(s) ? 0 : -1; }

/* argv: --worker IN_FD OUT_FD SEED DTYPE */
static int worker_main(int argc, char **argv) {
    if (argc != 6) return 2;
    int in = atoi(argv[2]), out = atoi(argv[3]);
    uint64_t seed = strtoull(argv[4], NULL, 10);
    kvb_dtype dt;
    if (kvb_dtype_parse(argv[5], &dt) != KVB_OK) return 2;
    size_t bytes = block_elems() * N_BLOCKS * kvb_dtype_size(dt);
    kvb_mem *m = NULL;
    kvb_mem_region *r = NULL;
    void *host = make_blocks(seed, dt);
    if (!host || kvb_mem_create("cuda", -1, &m) != KVB_OK || kvb_mem_region_create(m, "ipc", bytes, &r) != KVB_OK)
        return 3;
    if (kvb_mem_copy(m, kvb_mem_region_base(r), host, bytes) != KVB_OK) return 3;
    char line[256];
    snprintf(line, sizeof line, "HANDLE %s %zu\n", kvb_mem_region_handle(r), bytes);
    if (write_str(out, line)) return 4;
    /* the master uses the blocks until it acks (or hangs up) */
    if (read_line(in, line, sizeof line) < 0) return 5;
    if (!strcmp(line, "ACK")) {
        /* reclaimed: reuse the memory at once, as a busy worker would */
        memset(host, 0xff, bytes);
        if (kvb_mem_copy(m, kvb_mem_region_base(r), host, bytes) != KVB_OK) return 3;
        if (write_str(out, "POISONED\n")) return 4;
        if (read_line(in, line, sizeof line) < 0) return 5;
    }
    kvb_mem_region_destroy(r);
    kvb_mem_destroy(m);
    free(host);
    return strcmp(line, "DONE") ? 6 : 0;
}

/* ---------------------------------------------------------------- the master side */

typedef struct worker {
    pid_t pid;
    int to, from; /* pipe ends: to the worker, from the worker */
    char handle[KVB_CUDA_HANDLE_MAX];
    size_t bytes;
} worker;

static void worker_start(worker *w, uint64_t seed, kvb_dtype dt) {
    int a[2], b[2]; /* a: master -> worker, b: worker -> master */
    ck_assert_int_eq(pipe(a), 0);
    ck_assert_int_eq(pipe(b), 0);
    w->pid = fork();
    ck_assert_int_ge(w->pid, 0);
    if (w->pid == 0) {
        close(a[1]);
        close(b[0]);
        char in[16], out[16], sd[32];
        snprintf(in, sizeof in, "%d", a[0]);
        snprintf(out, sizeof out, "%d", b[1]);
        snprintf(sd, sizeof sd, "%llu", (unsigned long long)seed);
        execl("/proc/self/exe", "test_cuda_ipc", "--worker", in, out, sd, kvb_dtype_name(dt), (char *)NULL);
        _exit(127);
    }
    close(a[0]);
    close(b[1]);
    w->to = a[1];
    w->from = b[0];
    char line[256];
    ck_assert_int_gt(read_line(w->from, line, sizeof line), 0);
    ck_assert_int_eq(sscanf(line, "HANDLE %128s %zu", w->handle, &w->bytes), 2);
    ck_assert(kvb_cuda_handle_valid(w->handle));
}

static void worker_finish(worker *w) {
    ck_assert_int_eq(write_str(w->to, "DONE\n"), 0);
    int st = 0;
    ck_assert_int_eq(waitpid(w->pid, &st, 0), w->pid);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "worker exit status %d", st);
    close(w->to);
    close(w->from);
}

/* Three sequences whose blocks are chosen from the pool in a scrambled order; q_len 1, 1 and 40. */
typedef struct step {
    kvb_kv_geom g;
    kvb_attn_seq seqs[3];
    int blk_ids[64]; /* pool block of each entry */
    int n_entries, n_tok;
} step;

static void make_step(step *st, kvb_dtype dt) {
    st->g = (kvb_kv_geom){.n_layers = N_LAYERS, .n_kv_heads = N_KV, .head_dim = HEAD_DIM, .block_size = BS,
                          .elem_size = (int)kvb_dtype_size(dt)};
    int ctx[3] = {300, 200, 17}, ql[3] = {1, 40, 1}, tok = 0, ent = 0;
    for (int s = 0; s < 3; s++) {
        int nb = KVB_DIV_CEIL(ctx[s], BS);
        st->seqs[s] = (kvb_attn_seq){.q_start = tok, .q_len = ql[s], .ctx_len = ctx[s], .n_blocks = nb, .blk_first = ent};
        tok += ql[s];
        ent += nb;
    }
    for (int j = 0; j < ent; j++) st->blk_ids[j] = (j * 37 + 11) % N_BLOCKS;
    st->n_entries = ent;
    st->n_tok = tok;
}

/* Attention of the step with entry j's block taken from `lent` when lent_mask(j), else from `local`.
 * Returns the output as f32 (caller frees). */
static float *run_step(kvb_backend *be, const step *st, const void *q, void *out, char *local, char *lent,
                       int mode /* 0 local, 1 lent, 2 every other entry lent */) {
    size_t es = kvb_dtype_size(be->iface->act_dtype);
    void *ptrs[64];
    for (int j = 0; j < st->n_entries; j++) {
        int use_lent = mode == 1 || (mode == 2 && j % 2);
        char *base = use_lent ? lent : local;
        ptrs[j] = base + ((size_t)st->blk_ids[j] * block_elems() + layer_off_elems()) * es;
    }
    kvb_attn_batch b = {.geom = &st->g, .n_heads = N_HEADS, .n_tokens = st->n_tok, .n_seqs = 3, .seqs = st->seqs,
                        .layer_blocks = ptrs, .scale = (float)(1 / sqrt(HEAD_DIM))};
    ck_assert_int_eq(be->iface->attention(be->ctx, &b, q, out), KVB_OK);
    size_t n = (size_t)st->n_tok * N_HEADS * HEAD_DIM;
    float *res = malloc(sizeof(float) * n);
    ck_assert_int_eq(be->iface->to_host_f32(be->ctx, res, out, n), KVB_OK);
    return res;
}

static int all_finite(const float *x, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return 0;
    return 1;
}

static void lent_vs_local(const char *backend, int poison_after_ack) {
    kvb_backend *be = NULL;
    ck_assert_int_eq(kvb_backend_create(backend, 1, &be), KVB_OK);
    kvb_dtype dt = be->iface->act_dtype;
    size_t es = kvb_dtype_size(dt), pool_bytes = block_elems() * N_BLOCKS * es;
    uint64_t seed = 4242;
    worker w;
    worker_start(&w, seed, dt);
    ck_assert_int_eq(w.bytes, pool_bytes);
    kvb_mem_region *lent = NULL;
    ck_assert_int_eq(kvb_mem_region_import(be->mem, w.handle, w.bytes, &lent), KVB_OK);
    ck_assert(!kvb_mem_region_is_owner(lent));
    /* local copies of the same blocks */
    void *host = make_blocks(seed, dt), *local = NULL;
    ck_assert_ptr_nonnull(host);
    ck_assert_int_eq(kvb_mem_alloc(be->mem, pool_bytes, &local), KVB_OK);
    ck_assert_int_eq(be->iface->to_device(be->ctx, local, host, pool_bytes), KVB_OK);
    step st;
    make_step(&st, dt);
    size_t nq = (size_t)st.n_tok * N_HEADS * HEAD_DIM;
    float *qf = malloc(sizeof(float) * nq);
    uint64_t s = 99;
    for (size_t i = 0; i < nq; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        qf[i] = (float)((s >> 40) / (double)(1ull << 24)) * 2.0f - 1.0f;
    }
    char *qh = malloc(nq * es);
    for (size_t i = 0; i < nq; i++) {
        if (dt == KVB_DTYPE_F32) memcpy(qh + 4 * i, &qf[i], 4);
        else {
            uint16_t h = dt == KVB_DTYPE_BF16 ? kvb_f32_to_bf16(qf[i]) : kvb_f32_to_f16(qf[i]);
            memcpy(qh + 2 * i, &h, 2);
        }
    }
    void *q = NULL, *out = NULL;
    ck_assert_int_eq(kvb_mem_alloc(be->mem, nq * es, &q), KVB_OK);
    ck_assert_int_eq(kvb_mem_alloc(be->mem, nq * es, &out), KVB_OK);
    ck_assert_int_eq(be->iface->to_device(be->ctx, q, qh, nq * es), KVB_OK);

    char *lb = kvb_mem_region_base(lent);
    float *r_local = run_step(be, &st, q, out, local, lb, 0);
    float *r_lent = run_step(be, &st, q, out, local, lb, 1);
    float *r_mix = run_step(be, &st, q, out, local, lb, 2);
    ck_assert(all_finite(r_local, nq));
    ck_assert_msg(!memcmp(r_local, r_lent, sizeof(float) * nq), "%s: attention over lent blocks differs", backend);
    ck_assert_msg(!memcmp(r_local, r_mix, sizeof(float) * nq), "%s: attention over mixed blocks differs", backend);

    if (poison_after_ack) {
        /* the fence: everything enqueued on lent blocks has finished before the ack */
        float *r_fenced = run_step(be, &st, q, out, local, lb, 1); /* enqueue on lent blocks ... */
        ck_assert_int_eq(be->iface->sync(be->ctx), KVB_OK);        /* ... let it finish ... */
        ck_assert_int_eq(write_str(w.to, "ACK\n"), 0);             /* ... then give them back */
        char line[64];
        ck_assert_int_gt(read_line(w.from, line, sizeof line), 0);
        ck_assert_str_eq(line, "POISONED");
        ck_assert(!memcmp(r_fenced, r_local, sizeof(float) * nq));
        /* after the ack the master computes on its own blocks only: still the same, no NaN */
        for (int rep = 0; rep < 3; rep++) {
            float *r_after = run_step(be, &st, q, out, local, lb, 0);
            ck_assert_msg(!memcmp(r_after, r_local, sizeof(float) * nq), "%s: result changed after the ack", backend);
            free(r_after);
        }
        /* the poison is visible through the mapping: a use of a lent block now would give NaN */
        unsigned char *probe = malloc(pool_bytes);
        ck_assert_int_eq(be->iface->to_host(be->ctx, probe, lb, pool_bytes), KVB_OK);
        for (size_t i = 0; i < pool_bytes; i++) ck_assert_int_eq(probe[i], 0xff);
        float *r_poisoned = run_step(be, &st, q, out, local, lb, 1);
        ck_assert(!all_finite(r_poisoned, nq));
        free(probe);
        free(r_poisoned);
        free(r_fenced);
    }
    kvb_mem_region_destroy(lent);
    worker_finish(&w);
    kvb_mem_free(be->mem, local);
    kvb_mem_free(be->mem, q);
    kvb_mem_free(be->mem, out);
    kvb_backend_destroy(be);
    free(host);
    free(qf);
    free(qh);
    free(r_local);
    free(r_lent);
    free(r_mix);
}

KVB_TEST(lent_equals_local) {
    lent_vs_local("cuda", 0);
    lent_vs_local("cuda:f32", 0);
}
KVB_TEST_END

KVB_TEST(no_touch_after_ack) {
    lent_vs_local("cuda", 1);
}
KVB_TEST_END

KVB_TEST(bad_handles) {
    kvb_backend *be = NULL;
    ck_assert_int_eq(kvb_backend_create("cuda", 1, &be), KVB_OK);
    kvb_cuda_region *r = NULL;
    ck_assert_int_eq(kvb_cuda_region_import("00", 4096, &r), KVB_ERR_INVALID);
    char h[KVB_CUDA_HANDLE_MAX];
    memset(h, 'g', KVB_CUDA_HANDLE_CHARS);
    h[KVB_CUDA_HANDLE_CHARS] = 0;
    ck_assert_int_eq(kvb_cuda_region_import(h, 4096, &r), KVB_ERR_INVALID);
    memset(h, '0', KVB_CUDA_HANDLE_CHARS); /* well-formed, names no allocation */
    ck_assert_int_ne(kvb_cuda_region_import(h, 4096, &r), KVB_OK);
    ck_assert_ptr_null(r);
    kvb_backend_destroy(be);
}
KVB_TEST_END

static int probe(char *why, size_t len) { return kvb_mem_probe("cuda", 0, why, len); }

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--worker")) return worker_main(argc, argv);
    const kvb_test table[] = {KVB_T(lent_equals_local, 120), KVB_T(no_touch_after_ack, 120),
                                     KVB_T(bad_handles, 60)};
    int skip = kvb_test_need_device(argc, argv, probe);
    if (skip >= 0) return skip;
    return kvb_test_main(argc, argv, "cuda_ipc", table, (int)KVB_ARRAY_LEN(table));
}

#else /* !KVB_WITH_CUDA */

int main(void) {
    printf("SKIP: this build has no CUDA backend\n");
    return 77;
}

#endif
