/* kvbank-bench cuda — the CUDA backend against the GPU's own ceilings, measured in the same run.
 *
 *   copy bandwidth  B = 2 * bytes / time of a device-to-device copy of 2 GiB (read + written), CUDA events
 *   GEMM rate       F = 2 * n^3 / time of an n x n x n bf16 product through the backend's cuBLAS (n = 8192,
 *                       random data)
 * Model: a Llama-3-8B-shaped network (32 layers, hidden 4096, 32 heads over 8 KV heads of 128,
 * intermediate 14336, vocabulary 128256), bf16 weights filled on the device by a random kernel (no
 * files) into a kvb_model laid out as model.c loads one onto this backend (q/k/v and gate/up stacked
 * where the backend fuses them), KV blocks of 16 tokens in the block-major layout, also filled at
 * random. Each step is what the engine runs: common/model/forward.c's kvb_forward_begin / _layer / _end
 * (layers in chunks of the backend's chunk: 2048 rows on CUDA, the fused operators, the logits copied to the host).
 *   decode ratio     = (weight bytes + KV bytes read) / B / step time        (1.0 = at the HBM roofline)
 *   prefill ratio    = model FLOPs / F / prefill time, with model FLOPs = 2 * tokens * matrix params +
 *                      causal attention (4 * heads * head_dim * tokens(tokens+1)/2 per layer) + LM head
 *   product ratio    = weight bytes / B / time of one weight product of the decode step at each batch of
 *                      9-64 rows, with each of the two 9-64-row kernels (KVB_CUDA_SKINNY v1, v2); the
 *                      decode step at those batches is timed with both too
 *   attention ratio  = KV bytes read / B / time of the attention operator alone (decode)
 *   IPC ratio        = time of attention over blocks lent by another process through a CUDA IPC
 *                      handle / time over local blocks (1.0 = no cost for reading in place)
 * Step and operator times are medians of several repetitions timed with CUDA events on the backend's
 * stream (the step's events enclose the logits' copy to the host, which kvb_forward_end waits for), with
 * the spread (min-max) and a wall-clock column. --peer SCRIPT then runs bench/compiled_peer.py (a
 * compiled transformers Llama at the same shape) after this process has given the device back, and
 * prints each decode / prefill row's time against the peer's. The prefill attention is timed with each of
 * the tensor-core prefill's tiles (128 and 64 rows); --sdpa-peer SCRIPT then runs bench/sdpa_peer.py's
 * causal prefill at the same tokens and layers and prints both against PyTorch SDPA's time. Without a
 * GPU: "no CUDA device", exit status 77. */
#include "config.h"

#include <getopt.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench/bench.h"
#include "common/model/model_impl.h" /* the model is built here as model.c would load it */
#include "kernels/backend.h"

#ifdef KVB_WITH_CUDA
#include "kernels/cuda/backend_cuda.h"
#include "kernels/cuda/convert.h"
#include "kernels/cuda/gemv.h"

#define MAX_LIST 16
#define REPS 7

typedef struct shape {
    int n_layers, hidden, n_heads, n_kv, head_dim, inter, vocab, block_size;
} shape;

typedef struct model {
    shape s;
    kvb_model m;             /* as model.c lays it out on this backend; tensors from kvb_mem_alloc */
    int64_t matrix_params;   /* every layer's matrices (the LM head runs for one row a sequence) */
    int64_t weight_bytes;    /* read by one decode step: every matrix and norm, the LM head */
} model;

/* Device buffers of the attention-alone rows. */
typedef struct acts {
    void *q, *att; /* [cap][n_heads][head_dim] */
} acts;

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
/* Whether batch sequences of ctx tokens fit the pool; says so when they do not (the row is skipped). */
static int config_fits(int64_t pool_blocks, int block_size, int batch, int ctx) {
    int64_t need = (int64_t)batch * KVB_DIV_CEIL(ctx, block_size);
    if (need <= pool_blocks) return 1;
    printf("  batch %3d ctx %5d     skipped: needs %lld KV blocks, the device memory holds %lld\n", batch, ctx,
           (long long)need, (long long)pool_blocks);
    return 0;
}

/* Median, min and max of a timed series (seconds). */
typedef struct timing {
    double med, min, max;
} timing;

static timing summarize(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    timing t = {n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]), v[0], v[n - 1]};
    return t;
}

/* Times `fn(ud)` on the backend's stream with CUDA events: `reps` after one warm-up, in s (med < 0:
 * a call failed). */
typedef kvb_status (*timed_fn)(void *ud);
static timing time_events(kvb_backend *be, timed_fn fn, void *ud, int reps) {
    kvb_cuda_stream_t s = kvb_cuda_backend_stream(be);
    kvb_cuda_event *e0 = NULL, *e1 = NULL;
    double t[REPS * 2];
    timing res = {-1, -1, -1};
    if (reps > REPS * 2) reps = REPS * 2;
    if (kvb_cuda_event_create(1, &e0) != KVB_OK || kvb_cuda_event_create(1, &e1) != KVB_OK) goto out;
    if (fn(ud) != KVB_OK || be->iface->sync(be->ctx) != KVB_OK) goto out;
    for (int r = 0; r < reps; r++) {
        float ms = 0;
        if (kvb_cuda_event_record(e0, s) != KVB_OK || fn(ud) != KVB_OK || kvb_cuda_event_record(e1, s) != KVB_OK ||
            kvb_cuda_event_sync(e1) != KVB_OK || kvb_cuda_event_elapsed_ms(e0, e1, &ms) != KVB_OK)
            goto out;
        t[r] = ms * 1e-3;
    }
    res = summarize(t, reps);
out:
    kvb_cuda_event_destroy(e0);
    kvb_cuda_event_destroy(e1);
    return res;
}

/* ---------------------------------------------------------------- ceilings */

typedef struct copy_ud {
    void *a, *b;
    size_t bytes;
    kvb_cuda_stream_t s;
} copy_ud;
static kvb_status do_copy(void *ud) {
    copy_ud *c = ud;
    return kvb_cuda_copy_async(c->b, c->a, c->bytes, c->s);
}

static double measure_copy_bw(kvb_backend *be, size_t bytes) {
    copy_ud c = {.bytes = bytes, .s = kvb_cuda_backend_stream(be)};
    double bw = 0;
    if (kvb_mem_alloc(be->mem, bytes, &c.a) != KVB_OK) return 0;
    if (kvb_mem_alloc(be->mem, bytes, &c.b) == KVB_OK &&
        kvb_cuda_fill_uniform(c.a, KVB_DTYPE_BF16, bytes / 2, 1, -1, 1, c.s) == 0) {
        timing t = time_events(be, do_copy, &c, REPS);
        if (t.med > 0) bw = 2.0 * (double)bytes / t.med;
    }
    kvb_mem_free(be->mem, c.a);
    kvb_mem_free(be->mem, c.b);
    return bw;
}

typedef struct gemm_ud {
    kvb_backend *be;
    void *x, *y;
    kvb_tensor w;
    int n;
} gemm_ud;
static kvb_status do_gemm(void *ud) {
    gemm_ud *g = ud;
    return g->be->iface->matmul(g->be->ctx, g->x, g->n, &g->w, 0.0f, g->y);
}

static double measure_gemm(kvb_backend *be, int n) {
    gemm_ud g = {.be = be, .n = n};
    size_t bytes = (size_t)n * n * 2;
    kvb_cuda_stream_t s = kvb_cuda_backend_stream(be);
    double rate = 0;
    if (kvb_mem_alloc(be->mem, bytes, &g.x) != KVB_OK) return 0;
    if (kvb_mem_alloc(be->mem, bytes, &g.y) == KVB_OK && kvb_mem_alloc(be->mem, bytes, &g.w.data) == KVB_OK) {
        g.w.dtype = KVB_DTYPE_BF16;
        g.w.ne[0] = g.w.ne[1] = n;
        if (kvb_cuda_fill_uniform(g.x, KVB_DTYPE_BF16, (size_t)n * n, 2, -1, 1, s) == 0 &&
            kvb_cuda_fill_uniform(g.w.data, KVB_DTYPE_BF16, (size_t)n * n, 3, -1, 1, s) == 0) {
            timing t = time_events(be, do_gemm, &g, REPS);
            if (t.med > 0) rate = 2.0 * n * (double)n * n / t.med;
        }
    }
    kvb_mem_free(be->mem, g.x);
    kvb_mem_free(be->mem, g.y);
    kvb_mem_free(be->mem, g.w.data);
    return rate;
}

/* ---------------------------------------------------------------- the model */

static kvb_status rand_tensor(kvb_backend *be, int64_t rows, int64_t cols, uint64_t seed, kvb_tensor *t) {
    kvb_dtype dt = cols == 1 ? KVB_DTYPE_F32 : be->iface->act_dtype;
    size_t n = (size_t)rows * (size_t)cols;
    KVB_TRY(kvb_mem_alloc(be->mem, n * kvb_dtype_size(dt), &t->data));
    t->dtype = dt;
    t->ne[0] = rows;
    t->ne[1] = cols;
    /* matrices: uniform with the variance of N(0, 1/in); norm weights: 1 */
    float a = cols == 1 ? 1.0f : (float)sqrt(3.0 / (double)cols);
    return KVB_CUDA_CHECK(kvb_cuda_fill_uniform(t->data, dt, n, seed, cols == 1 ? 1.0f : -a, a,
                                                kvb_cuda_backend_stream(be)));
}

static void model_free(kvb_backend *be, model *md) {
    kvb_model *m = &md->m;
    if (m->layers) {
        for (int l = 0; l < m->cfg.n_layers; l++) {
            kvb_tensor *all[] = KVB_LAYER_TENSORS(&m->layers[l]), *stacked[] = KVB_LAYER_STACKED(&m->layers[l]);
            for (size_t i = 0; i < KVB_ARRAY_LEN(all); i++) kvb_mem_free(be->mem, all[i]->data);
            for (size_t i = 0; i < KVB_ARRAY_LEN(stacked); i++) kvb_mem_free(be->mem, stacked[i]->data);
        }
    }
    kvb_mem_free(be->mem, m->embed.data);
    kvb_mem_free(be->mem, m->lm_head.data);
    kvb_mem_free(be->mem, m->final_norm.data);
    free(m->layers);
    free(m->inv_freq);
    memset(md, 0, sizeof *md);
}

/* The shape as a Llama config.json (rope_theta 500000, rms_norm_eps 1e-5, as Llama 3). */
static kvb_status model_config(const shape *s, kvb_model_config *c) {
    char json[512];
    int n = snprintf(json, sizeof json,
                     "{\"architectures\": [\"LlamaForCausalLM\"], \"num_hidden_layers\": %d, \"hidden_size\": %d, "
                     "\"num_attention_heads\": %d, \"num_key_value_heads\": %d, \"head_dim\": %d, "
                     "\"intermediate_size\": %d, \"vocab_size\": %d, \"max_position_embeddings\": 131072, "
                     "\"rope_theta\": 500000.0, \"rms_norm_eps\": 1e-5, \"hidden_act\": \"silu\"}",
                     s->n_layers, s->hidden, s->n_heads, s->n_kv, s->head_dim, s->inter, s->vocab);
    return kvb_model_config_parse(json, (size_t)n, c);
}

static kvb_status model_build(kvb_backend *be, const shape *s, model *md) {
    memset(md, 0, sizeof *md);
    md->s = *s;
    kvb_model *m = &md->m;
    m->be = be;
    KVB_TRY(model_config(s, &m->cfg));
    int q = s->n_heads * s->head_dim, kv = s->n_kv * s->head_dim;
    KVB_TRY(kvb_calloc((size_t)s->n_layers, sizeof *m->layers, (void **)&m->layers));
    KVB_TRY(kvb_calloc((size_t)s->head_dim / 2, sizeof(float), (void **)&m->inv_freq));
    kvb_model_config_rope_inv_freq(&m->cfg, m->inv_freq);
    m->rope = (kvb_rope){.head_dim = s->head_dim, .inv_freq = m->inv_freq};
    uint64_t seed = 100;
    KVB_TRY(rand_tensor(be, s->vocab, s->hidden, seed++, &m->embed));
    KVB_TRY(rand_tensor(be, s->vocab, s->hidden, seed++, &m->lm_head));
    KVB_TRY(rand_tensor(be, s->hidden, 1, seed++, &m->final_norm));
    /* as model.c loads the layers onto this backend: stacked where it fuses (random either way) */
    int fused = be->iface->weight_load_stacked != NULL;
    for (int l = 0; l < s->n_layers; l++) {
        kvb_layer_weights *w = &m->layers[l];
        KVB_TRY(rand_tensor(be, s->hidden, 1, seed++, &w->attn_norm));
        KVB_TRY(rand_tensor(be, s->hidden, 1, seed++, &w->ffn_norm));
        KVB_TRY(rand_tensor(be, s->hidden, q, seed++, &w->wo));
        KVB_TRY(rand_tensor(be, s->hidden, s->inter, seed++, &w->w_down));
        if (fused) {
            KVB_TRY(rand_tensor(be, q + 2 * kv, s->hidden, seed++, &w->wqkv));
            KVB_TRY(rand_tensor(be, 2 * (int64_t)s->inter, s->hidden, seed++, &w->w_gu));
        } else {
            KVB_TRY(rand_tensor(be, q, s->hidden, seed++, &w->wq));
            KVB_TRY(rand_tensor(be, kv, s->hidden, seed++, &w->wk));
            KVB_TRY(rand_tensor(be, kv, s->hidden, seed++, &w->wv));
            KVB_TRY(rand_tensor(be, s->inter, s->hidden, seed++, &w->w_gate));
            KVB_TRY(rand_tensor(be, s->inter, s->hidden, seed++, &w->w_up));
        }
    }
    md->weight_bytes = kvb_model_weight_bytes_per_token(m);
    md->matrix_params = (int64_t)s->n_layers * ((int64_t)(2 * q + 2 * kv) * s->hidden + 3 * (int64_t)s->inter * s->hidden);
    return be->iface->sync(be->ctx);
}

static void acts_free(kvb_backend *be, acts *a) {
    kvb_mem_free(be->mem, a->q);
    kvb_mem_free(be->mem, a->att);
    memset(a, 0, sizeof *a);
}

static kvb_status acts_alloc(kvb_backend *be, const shape *s, int cap, acts *a) {
    memset(a, 0, sizeof *a);
    size_t bytes = (size_t)cap * s->n_heads * s->head_dim * kvb_dtype_size(be->iface->act_dtype);
    KVB_TRY(kvb_mem_alloc(be->mem, bytes, &a->q));
    return kvb_mem_alloc(be->mem, bytes, &a->att);
}

/* One step of a batch whose KV lives in `pool` (block-major), through the engine's forward pass. */
typedef struct step {
    kvb_backend *be;
    model *md;
    kvb_forward *fw;
    acts *a;
    kvb_batch batch;     /* attn.layer_blocks set per layer from `blocks` */
    void ***blocks;      /* [n_layers][entries] */
    float *logits;       /* [n_logits][vocab] host */
    int only_attention;  /* time the attention operator alone, every layer */
} step;

static kvb_status run_step(void *ud) {
    step *st = ud;
    int n_layers = st->md->s.n_layers;
    if (st->only_attention) {
        kvb_attn_batch attn = st->batch.attn;
        attn.n_heads = st->md->s.n_heads;
        attn.scale = (float)(1.0 / sqrt((double)st->md->s.head_dim));
        for (int l = 0; l < n_layers; l++) {
            attn.layer_blocks = st->blocks[l];
            KVB_TRY(st->be->iface->attention(st->be->ctx, &attn, st->a->q, st->a->att));
        }
        return KVB_OK;
    }
    KVB_TRY(kvb_forward_begin(st->fw, &st->batch));
    for (int l = 0; l < n_layers; l++) {
        st->batch.attn.layer_blocks = st->blocks[l];
        KVB_TRY(kvb_forward_layer(st->fw, l));
    }
    return kvb_forward_end(st->fw, st->logits); /* waits for the step's kernels and the logits' copy */
}

/* A batch of `batch` sequences, each with `ctx` tokens of context of which the last `q_len` are new,
 * over blocks [seq * blocks_per_seq, ...) of `pool`. */
typedef struct batch_view {
    kvb_attn_seq *seqs;
    void ***blocks;
    int32_t *tokens, *pos, *logit_rows;
    int n_tok, n_entries;
} batch_view;

static void view_free(batch_view *v, int n_layers) {
    if (v->blocks)
        for (int l = 0; l < n_layers; l++) free(v->blocks[l]);
    free(v->blocks);
    free(v->seqs);
    free(v->tokens);
    free(v->pos);
    free(v->logit_rows);
    memset(v, 0, sizeof *v);
}

static kvb_status view_make(const model *md, const kvb_kv_geom *g, char *pool, int blocks_per_seq, int batch, int ctx,
                            int q_len, batch_view *v) {
    const shape *s = &md->s;
    memset(v, 0, sizeof *v);
    int nb = KVB_DIV_CEIL(ctx, g->block_size);
    size_t block_bytes = (size_t)s->n_layers * 2 * g->block_size * s->n_kv * s->head_dim * 2;
    size_t layer_bytes = block_bytes / (size_t)s->n_layers;
    v->n_tok = batch * q_len;
    v->n_entries = batch * nb;
    KVB_TRY(kvb_calloc((size_t)batch, sizeof *v->seqs, (void **)&v->seqs));
    KVB_TRY(kvb_calloc((size_t)v->n_tok, sizeof(int32_t), (void **)&v->tokens));
    KVB_TRY(kvb_calloc((size_t)v->n_tok, sizeof(int32_t), (void **)&v->pos));
    KVB_TRY(kvb_calloc((size_t)batch, sizeof(int32_t), (void **)&v->logit_rows));
    KVB_TRY(kvb_calloc((size_t)s->n_layers, sizeof *v->blocks, (void **)&v->blocks));
    for (int l = 0; l < s->n_layers; l++)
        KVB_TRY(kvb_calloc((size_t)v->n_entries, sizeof(void *), (void **)&v->blocks[l]));
    for (int b = 0; b < batch; b++) {
        v->seqs[b] = (kvb_attn_seq){.q_start = b * q_len, .q_len = q_len, .ctx_len = ctx, .n_blocks = nb,
                                    .blk_first = b * nb};
        for (int t = 0; t < q_len; t++) {
            v->tokens[b * q_len + t] = (int32_t)((b * 7919 + t * 31 + 1) % s->vocab);
            v->pos[b * q_len + t] = ctx - q_len + t;
        }
        v->logit_rows[b] = b * q_len + q_len - 1;
        for (int j = 0; j < nb; j++)
            for (int l = 0; l < s->n_layers; l++)
                v->blocks[l][b * nb + j] = pool + ((size_t)b * blocks_per_seq + j) * block_bytes + l * layer_bytes;
    }
    return KVB_OK;
}

static void step_init(step *st, kvb_backend *be, model *md, kvb_forward *fw, acts *a, float *logits,
                      const kvb_kv_geom *g, batch_view *v, int batch) {
    memset(st, 0, sizeof *st);
    st->be = be;
    st->md = md;
    st->fw = fw;
    st->a = a;
    st->blocks = v->blocks;
    st->logits = logits;
    st->batch = (kvb_batch){
        .n_tokens = v->n_tok,
        .tokens = v->tokens,
        .pos = v->pos,
        .attn = {.geom = g, .n_heads = md->s.n_heads, .n_tokens = v->n_tok, .n_seqs = batch, .seqs = v->seqs,
                 .layer_blocks = v->blocks[0]},
        .n_logits = batch,
        .logit_rows = v->logit_rows,
    };
}

/* ---------------------------------------------------------------- IPC: a lending process */

/* kvbank-bench cuda --ipc-worker IN_FD OUT_FD BYTES: exports a random region, waits for "DONE". */
static int ipc_worker(int argc, char **argv) {
    if (argc != 5) return 2;
    int in = atoi(argv[2]), out = atoi(argv[3]);
    size_t bytes = (size_t)strtoull(argv[4], NULL, 10);
    kvb_mem *m = NULL;
    kvb_mem_region *r = NULL;
    kvb_cuda_stream_t s = NULL;
    if (kvb_mem_create("cuda", -1, &m) != KVB_OK || kvb_cuda_stream_create(&s) != KVB_OK ||
        kvb_mem_region_create(m, "bench", bytes, &r) != KVB_OK)
        return 3;
    if (kvb_cuda_fill_uniform(kvb_mem_region_base(r), KVB_DTYPE_BF16, bytes / 2, 7, -1, 1, s) != 0 ||
        kvb_cuda_stream_sync(s) != KVB_OK)
        return 3;
    char line[256];
    int n = snprintf(line, sizeof line, "%s\n", kvb_mem_region_handle(r));
    if (write(out, line, (size_t)n) != n) return 4;
    char ch;
    size_t got = 0;
    while (read(in, &ch, 1) == 1 && ch != '\n' && got < sizeof line - 1) line[got++] = ch;
    line[got] = 0;
    kvb_mem_region_destroy(r);
    kvb_cuda_stream_destroy(s);
    kvb_mem_destroy(m);
    return strcmp(line, "DONE") ? 5 : 0;
}

/* ---------------------------------------------------------------- main */

static int parse_list(const char *s, int32_t *out, int *n) {
    int32_t *ids = NULL;
    int k = 0;
    if (kvb_parse_id_list(s, &ids, &k) != KVB_OK || k < 1 || k > MAX_LIST) {
        free(ids);
        return -1;
    }
    for (int i = 0; i < k; i++) {
        if (ids[i] < 1) {
            free(ids);
            return -1;
        }
        out[i] = ids[i];
    }
    *n = k;
    free(ids);
    return 0;
}

static void usage(FILE *f) {
    fprintf(f, "usage: kvbank-bench cuda [--batches 1,16,64] [--contexts 1024,8192] [--prefill-tokens N]\n"
               "                         [--layers N] [--attn-batch N] [--ipc-batch N] [--no-prefill] [--no-ipc]\n"
               "                         [--shape llama3-8b|tiny] [--peer SCRIPT [--peer-decode LIST]]\n"
               "                         [--sdpa-peer SCRIPT]\n"
               "\n"
               "Decode steps (and their weight products at 9-64 rows, with each kernel), an 8K prefill, paged\n"
               "attention and reading lent blocks through CUDA IPC, on a\n"
               "Llama-3-8B-shaped bf16 model built on the device and run through the engine's forward pass, against\n"
               "the copy bandwidth and cuBLAS GEMM rate measured in the same run. Exit status 77 when there is no\n"
               "CUDA device.\n"
               "  --batches LIST       decode batch sizes (default 1,16,64)\n"
               "  --contexts LIST      decode context lengths (default 1024,8192)\n"
               "  --prefill-tokens N   prompt of the prefill measurement (default 8192)\n"
               "  --layers N           decoder layers (default 32; fewer for a quick run)\n"
               "  --attn-batch N       batch of the attention-alone measurement at the longest context (default 64)\n"
               "  --ipc-batch N        sequences of 4096 tokens read through the IPC region (default 16)\n"
               "  --shape S            llama3-8b (default) or tiny (hidden 256, 8 heads over 2 KV heads of 32,\n"
               "                       vocabulary 1000, small ceilings: a smoke run of the code paths, not a measurement)\n"
               "  --sdpa-peer SCRIPT   then run SCRIPT (bench/sdpa_peer.py) for the prefill attention and print both\n"
               "                       tensor-core tiles' times against PyTorch SDPA's\n"
               "  --peer SCRIPT        then run SCRIPT (bench/compiled_peer.py) with python3 at the same shape, once\n"
               "                       this process has let go of the device, and compare its rows with these\n"
               "  --peer-decode LIST   the peer's decode rows, BxC pairs (default 1x1024: the batch-1 target)\n");
}

/* ---------------------------------------------------------------- the decode products */

/* PROD_CALLS calls of one product between the events, each on the next layer's weight (a layer's
 * matrix alone may stay in L2 from one call to the next; the step reads each once). */
#define PROD_CALLS 16
typedef struct prod_ud {
    kvb_backend *be;
    const model *md;
    int which; /* index into PRODS */
    const void *x;
    void *y;
    int n;
} prod_ud;

typedef struct prod_kind {
    const char *name;
    int mode; /* 0 plain, 1 norm folded, 2 SwiGLU folded */
    float beta;
} prod_kind;
static const prod_kind PRODS[] = {
    {"qkv (norm)", 1, 0.0f}, {"o_proj (+=)", 0, 1.0f}, {"gate/up (norm)", 1, 0.0f}, {"down (swiglu, +=)", 2, 1.0f}, {"lm_head", 0, 0.0f},
};

static const kvb_tensor *prod_weight(const model *md, int which, int layer, const kvb_tensor **norm) {
    const kvb_layer_weights *w = &md->m.layers[layer];
    *norm = which == 0 ? &w->attn_norm : &w->ffn_norm;
    switch (which) {
    case 0: return &w->wqkv;
    case 1: return &w->wo;
    case 2: return &w->w_gu;
    case 3: return &w->w_down;
    default: return &md->m.lm_head;
    }
}

static kvb_status do_prod(void *ud) {
    prod_ud *p = ud;
    const kvb_backend_i *i = p->be->iface;
    for (int c = 0; c < PROD_CALLS; c++) {
        const kvb_tensor *norm, *w = prod_weight(p->md, p->which, c % p->md->s.n_layers, &norm);
        switch (PRODS[p->which].mode) {
        case 0: KVB_TRY(i->matmul(p->be->ctx, p->x, p->n, w, PRODS[p->which].beta, p->y)); break;
        case 1: KVB_TRY(i->matmul_norm(p->be->ctx, p->x, p->n, norm, 1e-5f, w, p->y)); break;
        default: KVB_TRY(i->matmul_swiglu(p->be->ctx, p->x, p->n, w, PRODS[p->which].beta, p->y)); break;
        }
    }
    return KVB_OK;
}

/* Each weight product of the decode step at n activation rows with each 9-64-row kernel (gemv.h's
 * KVB_CUDA_SKINNY variants), side by side: weight bytes / time against the copy rate B. */
static int bench_products(kvb_backend *be, const model *md, int n, int n_sm, double B) {
    const shape *s = &md->s;
    size_t es = kvb_dtype_size(be->iface->act_dtype), in_elems = (size_t)n * 2 * s->inter,
           out_elems = (size_t)n * KVB_MAX(s->vocab, 2 * s->inter);
    void *x = NULL, *y = NULL;
    int rc = 1;
    if (kvb_mem_alloc(be->mem, in_elems * es, &x) != KVB_OK || kvb_mem_alloc(be->mem, out_elems * es, &y) != KVB_OK ||
        kvb_cuda_fill_uniform(x, be->iface->act_dtype, in_elems, 11, -1, 1, kvb_cuda_backend_stream(be)) != 0 ||
        kvb_cuda_fill_uniform(y, be->iface->act_dtype, out_elems, 12, -1, 1, kvb_cuda_backend_stream(be)) != 0)
        goto out;
    printf("\ndecode products, %d rows (%d calls a timing over the layers' weights; v1: 16 weight rows a block, the\n"
           "input re-read per warp; v2: 128 a block, the input transformed once a block, split-K planned)\n", n, PROD_CALLS);
    printf("  product            rows x cols     v1 us (min-max)       v2 us (min-max)     v1 GB/s  v2 GB/s  v1/copy  "
           "v2/copy  v1/v2   v2 blocks x splits\n");
    kvb_cuda_gemv_ctx g = {.skinny = KVB_CUDA_SKINNY_V2, .n_sm = n_sm};
    int was = kvb_cuda_backend_set_skinny(be, KVB_CUDA_SKINNY_V2);
    for (int k = 0; k < (int)KVB_ARRAY_LEN(PRODS); k++) {
        const kvb_tensor *norm, *w = prod_weight(md, k, 0, &norm);
        prod_ud u = {be, md, k, x, y, n};
        timing t[2];
        for (int v = 0; v < 2; v++) {
            kvb_cuda_backend_set_skinny(be, v == 0 ? KVB_CUDA_SKINNY_V1 : KVB_CUDA_SKINNY_V2);
            t[v] = time_events(be, do_prod, &u, REPS);
            t[v].med /= PROD_CALLS, t[v].min /= PROD_CALLS, t[v].max /= PROD_CALLS;
        }
        double bytes = (double)w->ne[0] * (double)w->ne[1] * (double)es;
        kvb_cuda_gemv_plan p;
        kvb_cuda_gemv_plan_of(&g, (int)w->ne[0], (int)w->ne[1], n, &p);
        if (t[0].med <= 0 || t[1].med <= 0) {
            printf("  prod %-18s failed\n", PRODS[k].name);
            goto restore;
        }
        printf("  prod %-17s %6lld x %-6lld %8.1f (%.1f-%.1f) %8.1f (%.1f-%.1f) %8.0f %8.0f %8.2f %8.2f %6.2f   %d x %d\n",
               PRODS[k].name, (long long)w->ne[0], (long long)w->ne[1], t[0].med * 1e6, t[0].min * 1e6, t[0].max * 1e6,
               t[1].med * 1e6, t[1].min * 1e6, t[1].max * 1e6, bytes / t[0].med / 1e9, bytes / t[1].med / 1e9,
               bytes / t[0].med / B, bytes / t[1].med / B, t[0].med / t[1].med, p.blocks / p.splits, p.splits);
    }
    rc = 0;
restore:
    kvb_cuda_backend_set_skinny(be, was);
out:
    kvb_mem_free(be->mem, x);
    kvb_mem_free(be->mem, y);
    return rc;
}

/* kvbank's time of a row the peer also runs, for the comparison at the end. */
typedef struct peer_row {
    int prefill, batch, ctx; /* prefill: ctx = tokens */
    double ms;
} peer_row;

/* Runs the peer script and prints each of its rows beside kvbank's time for the same shape. */
static int run_peer(const char *script, const char *decode, int prefill, const shape *s, const peer_row *rows,
                    int n_rows) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "python3 '%s' --layers %d --hidden %d --heads %d --kv-heads %d --head-dim %d --intermediate %d "
             "--vocab %d --decode '%s' --prefill %d 2>&1",
             script, s->n_layers, s->hidden, s->n_heads, s->n_kv, s->head_dim, s->inter, s->vocab, decode, prefill);
    printf("\n%s\n", cmd);
    fflush(stdout);
    FILE *p = popen(cmd, "r");
    if (!p) return 1;
    char line[512];
    peer_row got[2 * MAX_LIST];
    int n_got = 0;
    while (fgets(line, sizeof line, p)) {
        fputs(line, stdout);
        peer_row r = {0};
        if (sscanf(line, "  peer decode batch %d ctx %d %lf", &r.batch, &r.ctx, &r.ms) == 3 ||
            sscanf(line, "  peer decode  batch %d ctx %d %lf", &r.batch, &r.ctx, &r.ms) == 3) {
            if (n_got < 2 * MAX_LIST) got[n_got++] = r;
        } else if (sscanf(line, "  peer prefill %d tokens %lf", &r.ctx, &r.ms) == 2) {
            r.prefill = 1;
            if (n_got < 2 * MAX_LIST) got[n_got++] = r;
        }
    }
    int st = pclose(p);
    int rc = WIFEXITED(st) ? WEXITSTATUS(st) : 1;
    printf("\nkvbank against the compiled peer   kvbank ms   peer ms   peer / kvbank (> 1: kvbank faster)\n");
    for (int i = 0; i < n_got; i++)
        for (int j = 0; j < n_rows; j++)
            if (rows[j].prefill == got[i].prefill && rows[j].ctx == got[i].ctx &&
                (got[i].prefill || rows[j].batch == got[i].batch)) {
                if (got[i].prefill) printf("  prefill %5d tokens          ", got[i].ctx);
                else printf("  decode batch %3d ctx %5d    ", got[i].batch, got[i].ctx);
                printf("%9.3f %9.3f %9.2f\n", rows[j].ms, got[i].ms, got[i].ms / rows[j].ms);
            }
    if (rc) printf("  the peer exited with %d\n", rc);
    return rc == 77 ? 0 : rc; /* no torch there: said so above, not a failure of kvbank's rows */
}

/* The prefill attention rows (each tensor-core tile's time for all layers) for PyTorch SDPA's. */
typedef struct sdpa_rows {
    int tokens; /* 0: not measured */
    double ms[2]; /* the 128-row and the 64-row tile */
} sdpa_rows;

/* Runs bench/sdpa_peer.py's causal prefill at the same tokens and layers and prints both tiles' times
 * against it (the target: kvbank / SDPA <= 1.0). The peer's shape is Llama-3-8B's attention. */
static int run_sdpa_peer(const char *script, const shape *s, const sdpa_rows *r) {
    if (!r->tokens) return 0;
    printf("\nprefill attention against PyTorch SDPA (%d tokens causal, %d layers)\n", r->tokens, s->n_layers);
    if (s->n_heads != 32 || s->n_kv != 8 || s->head_dim != 128) {
        printf("  not compared: the peer runs 32 heads over 8 KV heads of 128 only\n");
        return 0;
    }
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "python3 '%s' --layers %d --decode '' --prefill %d --reps 5 2>&1", script, s->n_layers,
             r->tokens);
    fflush(stdout);
    FILE *p = popen(cmd, "r");
    if (!p) return 1;
    char line[512], be[64] = "";
    double sdpa = -1;
    int tok = 0;
    while (fgets(line, sizeof line, p)) {
        fputs(line, stdout);
        const char *b = strchr(line, '[');
        if (sscanf(line, "  sdpa prefill %d tokens causal %lf", &tok, &sdpa) == 2 && tok == r->tokens && b)
            sscanf(b, "[%63[^]]", be);
    }
    int st = pclose(p);
    int rc = WIFEXITED(st) ? WEXITSTATUS(st) : 1;
    if (sdpa > 0) {
        static const char *name[2] = {"128-row tile (4 warps x 32 rows)", "64-row tile (4 warps x 16 rows)"};
        printf("                                     time ms   kvbank / SDPA (<= 1.0: the target met)\n");
        printf("  sdpa [%s]%*s %9.3f\n", be, (int)(29 - strlen(be)), "", sdpa);
        for (int i = 0; i < 2; i++) printf("  kvbank %-32s %9.3f %9.2f\n", name[i], r->ms[i], r->ms[i] / sdpa);
    } else {
        printf("  not compared: the peer printed no prefill row (exit %d)\n", rc);
    }
    return rc == 77 ? 0 : rc; /* no torch there: said so above */
}

/* ---------------------------------------------------------------- the data path */

/* Copies through the backend's tickets (backend.h): `n` pieces on engine `e`, the compute stream waiting
 * for them, so time_events (events on the compute stream) measures the copy; with `st`, a decode step's
 * kernels are issued while the copy runs, and the events measure both. */
typedef struct xfer_ud {
    kvb_backend *be;
    kvb_copy_engine e;
    kvb_copy_piece *x;
    int n;
    step *st;
} xfer_ud;
static kvb_status do_xfer(void *ud) {
    xfer_ud *u = ud;
    uint64_t t;
    KVB_TRY(u->be->iface->copy_async(u->be->ctx, u->e, u->x, u->n, &t));
    if (u->st) KVB_TRY(run_step(u->st));
    return u->be->iface->wait_ticket(u->be->ctx, t);
}

/* The engine's way (common/sched/stager.c): its thread posts a transfer and runs on into the layers'
 * kernels; a link's copy thread (issue_thread) calls copy_async meanwhile, and the layer that needs the
 * bytes waits for the ticket on the device. do_xfer_2t does the same with one copy thread: it hands
 * the copy over, issues the step, then waits until the copy is issued and orders the compute after it. */
typedef struct copier2 {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int go, issued, quit;
    xfer_ud *u;
    uint64_t t;
    kvb_status st;
} copier2;
static void *copier2_main(void *arg) {
    copier2 *c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (!c->go && !c->quit) pthread_cond_wait(&c->cv, &c->mu);
        if (!c->go) break;
        c->go = 0;
        pthread_mutex_unlock(&c->mu);
        uint64_t t = 0;
        kvb_status st = c->u->be->iface->copy_async(c->u->be->ctx, c->u->e, c->u->x, c->u->n, &t);
        pthread_mutex_lock(&c->mu);
        c->t = t;
        c->st = st;
        c->issued = 1;
        pthread_cond_broadcast(&c->cv);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}
static kvb_status do_xfer_2t(void *ud) {
    copier2 *c = ud;
    pthread_mutex_lock(&c->mu);
    c->go = 1;
    c->issued = 0;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    kvb_status st = run_step(c->u->st);
    pthread_mutex_lock(&c->mu);
    while (!c->issued) pthread_cond_wait(&c->cv, &c->mu);
    if (st == KVB_OK) st = c->st;
    uint64_t t = c->t;
    pthread_mutex_unlock(&c->mu);
    KVB_TRY(st);
    return c->u->be->iface->wait_ticket(c->u->be->ctx, t);
}
/* Times do_xfer_2t on `u` (u->st set) with a copy thread of its own; med < 0 when it could not run. */
static timing time_two_threads(kvb_backend *be, xfer_ud *u) {
    timing t = {-1, -1, -1};
    copier2 c = {.u = u, .st = KVB_OK};
    pthread_t th;
    if (pthread_mutex_init(&c.mu, NULL)) return t;
    if (pthread_cond_init(&c.cv, NULL) == 0) {
        if (pthread_create(&th, NULL, copier2_main, &c) == 0) {
            t = time_events(be, do_xfer_2t, &c, REPS);
            pthread_mutex_lock(&c.mu);
            c.quit = 1;
            pthread_cond_broadcast(&c.cv);
            pthread_mutex_unlock(&c.mu);
            pthread_join(th, NULL);
        }
        pthread_cond_destroy(&c.cv);
    }
    pthread_mutex_destroy(&c.mu);
    return t;
}

/* A stride coprime to n that scatters slot i to (i * stride) mod n with no two consecutive slots
 * adjacent (so that copy_async cannot merge the pieces); 1 when n is too small to scatter. */
static size_t scatter_stride(size_t n) {
    if (n < 4) return 1;
    for (size_t p = n * 5 / 8 | 1;; p += 2) {
        size_t a = p % n, b = n, t;
        while (b) t = a % b, a = b, b = t; /* gcd(p mod n, n) */
        if (a == 1 && p % n > 1 && p % n < n - 1) return p % n;
    }
}

/* Fills x[0..n) with slot i of `piece` bytes at host h and slot (i * stride) mod np at device d (np
 * slots there), in direction `dir` (0: to the device); returns n. */
static int scattered(kvb_copy_piece *x, size_t n, int dir, char *h, char *d, size_t piece, size_t np,
                     size_t stride) {
    for (size_t i = 0; i < n; i++) {
        char *hp = h + i * piece, *dp = d + (i * stride % np) * piece;
        x[i] = dir ? (kvb_copy_piece){hp, dp, piece} : (kvb_copy_piece){dp, hp, piece};
    }
    return (int)n;
}

/* Host <-> device bandwidth of pinned memory (one copy of `bytes`, the ceiling) against the same bytes
 * in KV layer-slice pieces of `piece` bytes through copy_async (what the stager posts), both directions,
 * the pieces scattered on the device as a pool's blocks are (so none merge), issued one cudaMemcpyAsync
 * each and as one cudaMemcpyBatchAsync (kvb_cuda_backend_set_copy_batch); then a decode step (`st`)
 * alone, the H2D of `xfer_bytes` alone (the KV of its offloaded layers, in pieces) and both issued
 * together, each way, against max(compute, transfer). Returns 0 when measured. */
static int bench_data_path(kvb_backend *be, step *st, size_t bytes, size_t piece, size_t xfer_bytes,
                           const char *what) {
    void *h = NULL, *d = NULL;
    kvb_copy_piece *x = NULL;
    int rc = 1, batch0 = kvb_cuda_backend_set_copy_batch(be, 1), has_batch = batch0;
    static const char *const how[2] = {"one call each", "one batch"};
    size_t np = bytes / piece;
    if (np == 0) goto out;
    bytes = np * piece;
    size_t stride = scatter_stride(np);
    if (kvb_mem_pinned_alloc(be->mem, bytes, &h) != KVB_OK || kvb_mem_alloc(be->mem, bytes, &d) != KVB_OK ||
        !(x = calloc(np, sizeof *x)))
        goto out;
    memset(h, 0x3c, bytes);
    printf("\ndata path: copies by ticket   time ms (min-max)     GB/s  ratio to one pinned copy\n");
    if (!has_batch) printf("  (this CUDA runtime has no cudaMemcpyBatchAsync: no batch rows)\n");
    for (int dir = 0; dir < 2; dir++) {
        kvb_copy_engine e = dir ? KVB_ENGINE_D2H : KVB_ENGINE_H2D;
        kvb_copy_piece one = dir ? (kvb_copy_piece){h, d, bytes} : (kvb_copy_piece){d, h, bytes};
        xfer_ud u1 = {be, e, &one, 1, NULL}, un = {be, e, x, scattered(x, np, dir, h, d, piece, np, stride), NULL};
        timing t1 = time_events(be, do_xfer, &u1, REPS);
        if (!(t1.med > 0)) goto out;
        printf("  %s one copy of %4.0f MiB      %8.3f (%.3f-%.3f) %7.1f\n", dir ? "d2h" : "h2d", bytes / 1048576.0,
               t1.med * 1e3, t1.min * 1e3, t1.max * 1e3, bytes / t1.med / 1e9);
        for (int b = 0; b <= has_batch; b++) {
            kvb_cuda_copy_counts c0, c1;
            kvb_cuda_backend_set_copy_batch(be, b);
            kvb_cuda_backend_copy_counts(be, &c0);
            timing tn = time_events(be, do_xfer, &un, REPS);
            kvb_cuda_backend_copy_counts(be, &c1);
            if (!(tn.med > 0)) goto out;
            printf("  %s %6zu pieces of %3.0f KiB %8.3f (%.3f-%.3f) %7.1f %8.2f  scattered, %s%s\n",
                   dir ? "d2h" : "h2d", np, piece / 1024.0, tn.med * 1e3, tn.min * 1e3, tn.max * 1e3,
                   bytes / tn.med / 1e9, t1.med / tn.med, how[b],
                   b && c1.batched == c0.batched ? " (the batch API failed: one call each)" : "");
        }
    }
    size_t nx = KVB_MIN(np, KVB_DIV_CEIL(xfer_bytes, piece));
    int n_x = scattered(x, nx, 0, h, d, piece, np, stride);
    timing tc = time_events(be, run_step, st, REPS), tx[2], tb[2], t2[2];
    if (!(tc.med > 0)) goto out;
    for (int b = 0; b <= has_batch; b++) {
        xfer_ud ux = {be, KVB_ENGINE_H2D, x, n_x, NULL}, ub = {be, KVB_ENGINE_H2D, x, n_x, st};
        kvb_cuda_backend_set_copy_batch(be, b);
        tx[b] = time_events(be, do_xfer, &ux, REPS);
        tb[b] = time_events(be, do_xfer, &ub, REPS);
        t2[b] = time_two_threads(be, &ub);
        if (!(tx[b].med > 0) || !(tb[b].med > 0) || !(t2[b].med > 0)) goto out;
    }
    printf("\ndata path: overlap (%s)\n", what);
    printf("                               time ms (min-max)\n");
    printf("  decode step alone           %8.3f (%.3f-%.3f)\n", tc.med * 1e3, tc.min * 1e3, tc.max * 1e3);
    for (int b = 0; b <= has_batch; b++) {
        printf("  h2d of %6.1f MiB alone     %8.3f (%.3f-%.3f)  %zu scattered pieces, %s\n",
               nx * (double)piece / 1048576.0, tx[b].med * 1e3, tx[b].min * 1e3, tx[b].max * 1e3, nx, how[b]);
        printf("  both, issued together       %8.3f (%.3f-%.3f)  %s; one thread: the copy, then the step\n",
               tb[b].med * 1e3, tb[b].min * 1e3, tb[b].max * 1e3, how[b]);
        printf("  both, from two threads      %8.3f (%.3f-%.3f)  %s; the copy by a copy thread while this one "
               "issues the step (the engine's way)\n",
               t2[b].med * 1e3, t2[b].min * 1e3, t2[b].max * 1e3, how[b]);
    }
    for (int b = 0; b <= has_batch; b++)
        printf("  overlap: both / max(step, h2d) %6.3f one thread, %6.3f two threads  %s (1.0: one hides under the "
               "other; 2.0 at equal times: none)\n",
               tb[b].med / KVB_MAX(tc.med, tx[b].med), t2[b].med / KVB_MAX(tc.med, tx[b].med), how[b]);
    rc = 0;
out:
    if (rc) printf("  data path: not measured (pinned %.0f MiB, or a copy failed)\n", bytes / 1048576.0);
    kvb_cuda_backend_set_copy_batch(be, batch0);
    free(x);
    kvb_mem_free(be->mem, d);
    kvb_mem_pinned_free(be->mem, h);
    return rc;
}

int kvb_bench_cuda(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--ipc-worker")) return ipc_worker(argc, argv);
    shape s = {.n_layers = 32, .hidden = 4096, .n_heads = 32, .n_kv = 8, .head_dim = 128, .inter = 14336,
               .vocab = 128256, .block_size = 16};
    int32_t batches[MAX_LIST] = {1, 16, 64}, ctxs[MAX_LIST] = {1024, 8192};
    int n_batches = 3, n_ctxs = 2, prefill = 8192, attn_batch = 64, ipc_batch = 16, do_prefill = 1, do_ipc = 1;
    const char *peer = NULL, *peer_decode = "1x1024", *sdpa_peer = NULL;
    sdpa_rows sdpa_cmp = {0};
    static const struct option opts[] = {
        {"batches", 1, 0, 'b'},    {"contexts", 1, 0, 'c'},  {"prefill-tokens", 1, 0, 'p'}, {"layers", 1, 0, 'l'},
        {"attn-batch", 1, 0, 'a'}, {"ipc-batch", 1, 0, 'i'}, {"no-prefill", 0, 0, 'P'},     {"no-ipc", 0, 0, 'I'},
        {"shape", 1, 0, 's'},      {"peer", 1, 0, 'e'},      {"peer-decode", 1, 0, 'd'},    {"help", 0, 0, 'h'},
        {"sdpa-peer", 1, 0, 'S'},  {0, 0, 0, 0}};
    int tiny = 0;
    optind = 1;
    int o;
    while ((o = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        int64_t x = 0;
        switch (o) {
        case 'b':
            if (parse_list(optarg, batches, &n_batches)) goto bad;
            break;
        case 'c':
            if (parse_list(optarg, ctxs, &n_ctxs)) goto bad;
            break;
        case 'p':
        case 'l':
        case 'a':
        case 'i':
            if (kvb_parse_i64(optarg, 1, 1 << 20, &x) != KVB_OK) goto bad;
            if (o == 'p') prefill = (int)x;
            else if (o == 'l') s.n_layers = (int)x;
            else if (o == 'a') attn_batch = (int)x;
            else ipc_batch = (int)x;
            break;
        case 's':
            if (!strcmp(optarg, "tiny")) tiny = 1;
            else if (strcmp(optarg, "llama3-8b")) goto bad;
            break;
        case 'e': peer = optarg; break;
        case 'S': sdpa_peer = optarg; break;
        case 'd':
            if (strspn(optarg, "0123456789x,") != strlen(optarg)) goto bad; /* it goes into a shell command */
            peer_decode = optarg;
            break;
        case 'P': do_prefill = 0; break;
        case 'I': do_ipc = 0; break;
        case 'h': usage(stdout); return 0;
        default: goto bad;
        }
    }
    if (optind != argc) goto bad;
    if (peer && (strchr(peer, '\'') || access(peer, R_OK))) {
        fprintf(stderr, "kvbank-bench cuda: --peer %s: not a readable script\n", peer);
        return 2;
    }
    if (sdpa_peer && (strchr(sdpa_peer, '\'') || access(sdpa_peer, R_OK))) {
        fprintf(stderr, "kvbank-bench cuda: --sdpa-peer %s: not a readable script\n", sdpa_peer);
        return 2;
    }
    if (tiny) {
        int layers = s.n_layers == 32 ? 2 : s.n_layers;
        s = (shape){.n_layers = layers, .hidden = 256, .n_heads = 8, .n_kv = 2, .head_dim = 32, .inter = 512,
                    .vocab = 1000, .block_size = 16};
    }
    size_t copy_bytes = tiny ? (size_t)16 << 20 : (size_t)2 << 30;
    int gemm_n = tiny ? 256 : 8192, ipc_ctx = tiny ? 256 : 4096;

    int n_dev = 0;
    char why[200];
    kvb_cuda_device_count(&n_dev, why, sizeof why);
    if (n_dev == 0) {
        printf("kvbank-bench cuda: no CUDA device (%s)\n", why);
        return 77;
    }
    kvb_backend *be = NULL;
    if (kvb_backend_create("cuda", 1, &be) != KVB_OK) return 1;
    kvb_cuda_device_info info;
    if (kvb_cuda_backend_info(be, &info) != KVB_OK) return 1;
    printf("kvbank-bench cuda: %s (sm_%d%d, %d SMs, %.1f GiB, %.0f MiB L2), bf16, %s shape, %d layers, "
           "the engine's forward pass (%s layer)\n",
           info.name, info.cc_major, info.cc_minor, info.n_sm, info.mem_total / 1073741824.0,
           info.l2_bytes / 1048576.0, tiny ? "tiny" : "Llama-3-8B", s.n_layers,
           be->iface->weight_load_stacked ? "fused" : "unfused");
    fflush(stdout);

    int rc = 1, rc_ipc = 0, rc_dp = 0;
    model m = {0};
    acts a = {0};
    void *pool = NULL;
    kvb_forward *fw = NULL;
    float *logits = NULL;
    int64_t pool_blocks = 0;
    peer_row prow[2 * MAX_LIST];
    int n_prow = 0;
    double B = measure_copy_bw(be, copy_bytes);
    double F = measure_gemm(be, gemm_n);
    printf("ceilings: copy %.2f TB/s (read + written), cuBLAS bf16 GEMM %.1f TFLOP/s\n", B / 1e12, F / 1e12);
    fflush(stdout);
    if (B <= 0 || F <= 0) goto out;

    if (model_build(be, &s, &m) != KVB_OK) goto out;
    int max_batch = 1, max_ctx = 1;
    for (int i = 0; i < n_batches; i++) max_batch = KVB_MAX(max_batch, batches[i]);
    for (int i = 0; i < n_ctxs; i++) max_ctx = KVB_MAX(max_ctx, ctxs[i]);
    max_batch = KVB_MAX(max_batch, KVB_MAX(attn_batch, ipc_batch));
    kvb_kv_geom g = {.n_layers = s.n_layers, .n_kv_heads = s.n_kv, .head_dim = s.head_dim, .block_size = s.block_size,
                     .elem_size = 2};
    size_t block_bytes = (size_t)s.n_layers * 2 * s.block_size * s.n_kv * s.head_dim * 2;
    int act_cap = KVB_MAX(max_batch, do_prefill ? prefill : 1);
    if (acts_alloc(be, &s, act_cap, &a) != KVB_OK) goto out;
    if (kvb_forward_create(&m.m, act_cap, &fw) != KVB_OK) goto out;
    if (kvb_malloc((size_t)max_batch * s.vocab * sizeof(float), (void **)&logits) != KVB_OK) goto out;
    /* The pool holds the largest configuration that fits the device's free memory (after the weights
     * and activations, less a reserve for cuBLAS, a step's activations and the IPC import); each
     * configuration takes batch * ceil(ctx / block) blocks of it, and one that does not fit is skipped
     * and said so. On an H100 (80 GB) with Llama-3-8B that skips batch 64 at 8K. */
    int64_t want_blocks = 0;
    for (int ci = 0; ci < n_ctxs; ci++)
        for (int bi = 0; bi < n_batches; bi++)
            want_blocks = KVB_MAX(want_blocks, (int64_t)batches[bi] * KVB_DIV_CEIL(ctxs[ci], s.block_size));
    want_blocks = KVB_MAX(want_blocks, (int64_t)attn_batch * KVB_DIV_CEIL(max_ctx, s.block_size));
    if (do_prefill) want_blocks = KVB_MAX(want_blocks, (int64_t)KVB_DIV_CEIL(prefill, s.block_size));
    if (do_ipc) want_blocks = KVB_MAX(want_blocks, (int64_t)ipc_batch * KVB_DIV_CEIL(ipc_ctx, s.block_size));
    if (kvb_cuda_backend_info(be, &info) != KVB_OK) goto out;
    /* cuBLAS workspaces, a prefill step's residual stream and chunk buffers (of the 4x chunks of its last
     * row), fragmentation */
    size_t reserve = (tiny ? (size_t)64 << 20 : (size_t)2 << 30) + (size_t)act_cap * s.hidden * 2 +
                     (size_t)4 * kvb_forward_default_chunk(be) * (3 * (size_t)s.hidden + 4 * (size_t)s.inter) * 2 * 2;
    if (do_ipc) reserve += block_bytes * (size_t)ipc_batch * (size_t)KVB_DIV_CEIL(ipc_ctx, s.block_size);
    int64_t fit_blocks = info.mem_free > reserve ? (int64_t)((info.mem_free - reserve) / block_bytes) : 0;
    pool_blocks = KVB_MIN(want_blocks, fit_blocks);
    if (pool_blocks < 1) {
        fprintf(stderr, "kvbank-bench cuda: no room for KV blocks: %.1f GiB free after the weights\n",
                info.mem_free / 1073741824.0);
        goto out;
    }
    size_t pool_bytes = block_bytes * (size_t)pool_blocks;
    if (kvb_mem_alloc(be->mem, pool_bytes, &pool) != KVB_OK) {
        fprintf(stderr, "kvbank-bench cuda: cannot allocate %.1f GiB of KV blocks (fewer --layers or smaller lists)\n",
                pool_bytes / 1073741824.0);
        goto out;
    }
    if (kvb_cuda_fill_uniform(pool, KVB_DTYPE_BF16, pool_bytes / 2, 9, -1, 1, kvb_cuda_backend_stream(be)) != 0 ||
        kvb_cuda_fill_uniform(a.q, KVB_DTYPE_BF16, (size_t)act_cap * s.n_heads * s.head_dim, 10, -1, 1,
                              kvb_cuda_backend_stream(be)) != 0)
        goto out;
    printf("model: %.2f G matrix parameters, %.2f GB of weights read per decode step; KV pool %.1f GiB "
           "(%lld blocks of %d tokens%s)\n\n",
           m.matrix_params / 1e9, m.weight_bytes / 1e9, pool_bytes / 1073741824.0, (long long)pool_blocks, s.block_size,
           pool_blocks < want_blocks ? ", sized to the free device memory" : "");

    /* decode steps */
    printf("decode step (the engine's)  step ms (min-max)        wall ms  bytes GB  roofline ms   ratio  products\n");
    for (int ci = 0; ci < n_ctxs; ci++)
        for (int bi = 0; bi < n_batches; bi++) {
            int batch = batches[bi], ctx = ctxs[ci];
            batch_view v;
            step st;
            if (!config_fits(pool_blocks, s.block_size, batch, ctx)) continue;
            if (view_make(&m, &g, pool, KVB_DIV_CEIL(ctx, s.block_size), batch, ctx, 1, &v) != KVB_OK) goto out;
            step_init(&st, be, &m, fw, &a, logits, &g, &v, batch);
            timing t = time_events(be, run_step, &st, REPS);
            double walls[REPS];
            for (int r = 0; r < REPS; r++) {
                double t0 = kvb_now_s();
                if (run_step(&st) != KVB_OK) t0 = -1e30;
                walls[r] = kvb_now_s() - t0;
            }
            timing tw = summarize(walls, REPS);
            double kv_bytes = (double)batch * ctx * s.n_layers * 2.0 * s.n_kv * s.head_dim * 2;
            double bytes = (double)m.weight_bytes + kv_bytes, ideal = bytes / B;
            int skinny = batch > KVB_CUDA_GEMV_MAX_ROWS && batch <= KVB_CUDA_SKINNY_MAX_ROWS;
            printf("  batch %3d ctx %5d     %9.3f (%.3f-%.3f) %8.3f %9.2f %12.3f %7.2f  %s\n", batch, ctx, t.med * 1e3,
                   t.min * 1e3, t.max * 1e3, tw.med * 1e3, bytes / 1e9, ideal * 1e3, t.med > 0 ? ideal / t.med : 0,
                   skinny ? "skinny v2" : batch <= KVB_CUDA_GEMV_MAX_ROWS ? "gemv" : "cuBLAS");
            if (skinny) { /* the same step with the kernel before, for the A/B */
                int was = kvb_cuda_backend_set_skinny(be, KVB_CUDA_SKINNY_V1);
                timing t1 = time_events(be, run_step, &st, REPS);
                kvb_cuda_backend_set_skinny(be, was);
                printf("  batch %3d ctx %5d     %9.3f (%.3f-%.3f) %8s %9.2f %12.3f %7.2f  skinny v1\n", batch, ctx,
                       t1.med * 1e3, t1.min * 1e3, t1.max * 1e3, "", bytes / 1e9, ideal * 1e3,
                       t1.med > 0 ? ideal / t1.med : 0);
            }
            fflush(stdout);
            if (n_prow < 2 * MAX_LIST) prow[n_prow++] = (peer_row){0, batch, ctx, t.med * 1e3};
            view_free(&v, s.n_layers);
        }

    for (int bi = 0; bi < n_batches; bi++)
        if (batches[bi] > KVB_CUDA_GEMV_MAX_ROWS && batches[bi] <= KVB_CUDA_SKINNY_MAX_ROWS &&
            be->iface->matmul_norm && bench_products(be, &m, batches[bi], info.n_sm, B))
            goto out;

    /* attention alone at the longest context */
    printf("\npaged attention (decode)    time ms (min-max)      KV GB    GB/s   ratio to copy\n");
    int attn_batches[2] = {1, attn_batch};
    for (int i = 0; i < 2; i++) {
        batch_view v;
        step st;
        if (!config_fits(pool_blocks, s.block_size, attn_batches[i], max_ctx)) continue;
        if (view_make(&m, &g, pool, KVB_DIV_CEIL(max_ctx, s.block_size), attn_batches[i], max_ctx, 1, &v) != KVB_OK)
            goto out;
        step_init(&st, be, &m, fw, &a, logits, &g, &v, attn_batches[i]);
        st.only_attention = 1;
        timing t = time_events(be, run_step, &st, REPS);
        double kv = (double)attn_batches[i] * max_ctx * s.n_layers * 2.0 * s.n_kv * s.head_dim * 2;
        printf("  batch %3d ctx %5d     %8.3f (%.3f-%.3f) %6.2f %8.0f %10.2f\n", attn_batches[i], max_ctx, t.med * 1e3,
               t.min * 1e3, t.max * 1e3, kv / 1e9, t.med > 0 ? kv / t.med / 1e9 : 0, t.med > 0 ? kv / t.med / B : 0);
        view_free(&v, s.n_layers);
    }

    if (do_prefill && config_fits(pool_blocks, s.block_size, 1, prefill)) {
        batch_view v;
        step st;
        if (view_make(&m, &g, pool, KVB_DIV_CEIL(prefill, s.block_size), 1, prefill, prefill, &v) != KVB_OK) goto out;
        step_init(&st, be, &m, fw, &a, logits, &g, &v, 1);
        timing t = time_events(be, run_step, &st, 3);
        /* the attention operator alone with each of the tensor-core prefill's tiles (attention_tc.cu),
         * one after the other on the same data; the step above ran the backend's own */
        st.only_attention = 1;
        const int tiles[2] = {128, 64};
        timing tt[2];
        int own = kvb_cuda_backend_set_prefill_tile(be, tiles[0]);
        for (int i = 0; i < 2; i++) {
            kvb_cuda_backend_set_prefill_tile(be, tiles[i]);
            tt[i] = time_events(be, run_step, &st, REPS);
            sdpa_cmp.ms[i] = tt[i].med * 1e3;
        }
        kvb_cuda_backend_set_prefill_tile(be, own);
        timing ta = tt[own == tiles[1] ? 1 : 0];
        sdpa_cmp.tokens = prefill;
        double attn_flops = 4.0 * s.n_heads * s.head_dim * ((double)prefill * (prefill + 1) / 2) * s.n_layers;
        double gemm_flops = 2.0 * prefill * (double)m.matrix_params + 2.0 * s.vocab * (double)s.hidden;
        double flops = gemm_flops + attn_flops;
        printf("\nprefill %d tokens, one step  time ms (min-max)       TFLOP  TFLOP/s  ratio to GEMM   (the engine's "
               "chunks: %d rows)\n", prefill, kvb_forward_default_chunk(be));
        printf("  whole step (the engine's)  %8.1f (%.1f-%.1f) %6.1f %8.1f %10.2f\n", t.med * 1e3, t.min * 1e3,
               t.max * 1e3, flops / 1e12, t.med > 0 ? flops / t.med / 1e12 : 0, t.med > 0 ? flops / t.med / F : 0);
        for (int i = 0; i < 2; i++)
            printf("  attention alone, %3d-row tile %5.1f (%.1f-%.1f) %6.1f %8.1f %10.2f\n", tiles[i], tt[i].med * 1e3,
                   tt[i].min * 1e3, tt[i].max * 1e3, attn_flops / 1e12, tt[i].med > 0 ? attn_flops / tt[i].med / 1e12 : 0,
                   tt[i].med > 0 ? attn_flops / tt[i].med / F : 0);
        printf("  the rest (GEMMs, norms)    %8.1f %20.1f %8.1f %10.2f\n", (t.med - ta.med) * 1e3, gemm_flops / 1e12,
               t.med > ta.med ? gemm_flops / (t.med - ta.med) / 1e12 : 0,
               t.med > ta.med ? gemm_flops / (t.med - ta.med) / F : 0);
        /* the same step in chunks of 4x the rows: what the engine's chunk size costs the products */
        int eng = kvb_forward_default_chunk(be), big = 4 * eng;
        st.only_attention = 0;
        if (prefill > eng && kvb_forward_chunk(fw, big) == KVB_OK) {
            timing tb = time_events(be, run_step, &st, 3);
            printf("  whole step, %d-row chunks %7.1f (%.1f-%.1f) %6.1f %8.1f %10.2f\n", big, tb.med * 1e3,
                   tb.min * 1e3, tb.max * 1e3, flops / 1e12, tb.med > 0 ? flops / tb.med / 1e12 : 0,
                   tb.med > 0 ? flops / tb.med / F : 0);
            if (kvb_forward_chunk(fw, eng) != KVB_OK) goto out;
        }
        if (n_prow < 2 * MAX_LIST) prow[n_prow++] = (peer_row){1, 1, prefill, t.med * 1e3};
        view_free(&v, s.n_layers);
    }

    /* the data path: copies by ticket against pinned bandwidth; a decode step (the first batch at the
     * first context) with the KV of half its layers loaded over the host link meanwhile, as OrbitFlow's
     * offloaded layers are */
    if (config_fits(pool_blocks, s.block_size, batches[0], ctxs[0])) {
        batch_view v;
        step st;
        if (view_make(&m, &g, pool, KVB_DIV_CEIL(ctxs[0], s.block_size), batches[0], ctxs[0], 1, &v) != KVB_OK) goto out;
        step_init(&st, be, &m, fw, &a, logits, &g, &v, batches[0]);
        size_t slice = (size_t)2 * s.block_size * s.n_kv * s.head_dim * 2; /* a block's bf16 K and V at one layer */
        size_t off_bytes = slice * (size_t)batches[0] * KVB_DIV_CEIL(ctxs[0], s.block_size) * (s.n_layers / 2 + 1);
        char what[96];
        snprintf(what, sizeof what, "batch %d ctx %d, %d of %d layers' KV loaded", batches[0], ctxs[0],
                 s.n_layers / 2 + 1, s.n_layers);
        if (bench_data_path(be, &st, tiny ? (size_t)8 << 20 : (size_t)1 << 30, slice, off_bytes, what)) rc_dp = 1;
        view_free(&v, s.n_layers);
    }

    if (do_ipc && config_fits(pool_blocks, s.block_size, ipc_batch, ipc_ctx)) {
        /* a second process lends ipc_batch sequences of 4096 tokens; attention reads them in place */
        int ctx = ipc_ctx, nb = KVB_DIV_CEIL(ctx, s.block_size);
        size_t bytes = block_bytes * (size_t)nb * (size_t)ipc_batch;
        int to[2], from[2];
        if (pipe(to) || pipe(from)) goto out;
        pid_t pid = fork();
        if (pid == 0) {
            char a1[16], a2[16], a3[32];
            close(to[1]);
            close(from[0]);
            snprintf(a1, sizeof a1, "%d", to[0]);
            snprintf(a2, sizeof a2, "%d", from[1]);
            snprintf(a3, sizeof a3, "%zu", bytes);
            execl("/proc/self/exe", "kvbank-bench", "cuda", "--ipc-worker", a1, a2, a3, (char *)NULL);
            _exit(127);
        }
        close(to[0]);
        close(from[1]);
        char handle[KVB_CUDA_HANDLE_MAX + 2];
        size_t got = 0;
        char ch;
        while (got < sizeof handle - 1 && read(from[0], &ch, 1) == 1 && ch != '\n') handle[got++] = ch;
        handle[got] = 0;
        kvb_mem_region *lent = NULL;
        timing t_local = {-1, -1, -1}, t_lent = {-1, -1, -1};
        if (pid > 0 && kvb_mem_region_import(be->mem, handle, bytes, &lent) == KVB_OK) {
            batch_view vl, vr;
            step st;
            if (view_make(&m, &g, pool, nb, ipc_batch, ctx, 1, &vl) == KVB_OK &&
                view_make(&m, &g, kvb_mem_region_base(lent), nb, ipc_batch, ctx, 1, &vr) == KVB_OK) {
                step_init(&st, be, &m, fw, &a, logits, &g, &vl, ipc_batch);
                st.only_attention = 1;
                t_local = time_events(be, run_step, &st, REPS);
                step_init(&st, be, &m, fw, &a, logits, &g, &vr, ipc_batch);
                st.only_attention = 1;
                t_lent = time_events(be, run_step, &st, REPS);
            }
            view_free(&vl, s.n_layers);
            view_free(&vr, s.n_layers);
            kvb_mem_region_destroy(lent);
        }
        if (write(to[1], "DONE\n", 5) != 5) t_lent.med = -1;
        close(to[1]);
        close(from[0]);
        int wst = 0;
        if (pid > 0) waitpid(pid, &wst, 0);
        double kv = (double)ipc_batch * ctx * s.n_layers * 2.0 * s.n_kv * s.head_dim * 2;
        printf("\nattention over lent blocks  time ms  GB/s   (batch %d, ctx %d, %.1f GB of KV)\n", ipc_batch, ctx,
               kv / 1e9);
        int worker_ok = WIFEXITED(wst) && WEXITSTATUS(wst) == 0;
        if (t_local.med > 0 && t_lent.med > 0 && worker_ok) {
            printf("  local blocks              %8.3f %6.0f\n", t_local.med * 1e3, kv / t_local.med / 1e9);
            printf("  lent (CUDA IPC import)    %8.3f %6.0f\n", t_lent.med * 1e3, kv / t_lent.med / 1e9);
            printf("  ratio lent / local        %8.3f\n", t_lent.med / t_local.med);
        } else {
            printf("  not measured: %s\n", !worker_ok ? "the lending process failed" : "the import failed (see the log)");
            rc_ipc = 1;
        }
    }
    rc = rc_ipc || rc_dp;
out:
    if (pool) kvb_mem_free(be->mem, pool);
    kvb_forward_destroy(fw);
    free(logits);
    acts_free(be, &a);
    model_free(be, &m);
    kvb_backend_destroy(be);
    if (rc == 0 && sdpa_peer) rc = run_sdpa_peer(sdpa_peer, &s, &sdpa_cmp);
    if (rc == 0 && peer) {
        fflush(stdout);
        rc = run_peer(peer, peer_decode, do_prefill ? prefill : 0, &s, prow, n_prow);
    }
    return rc;
bad:
    usage(stderr);
    return 2;
}

#else /* !KVB_WITH_CUDA */

int kvb_bench_cuda(int argc, char **argv) {
    printf("kvbank-bench cuda: no CUDA device: this binary was built without the CUDA backend\n");
    return 77;
}

#endif
