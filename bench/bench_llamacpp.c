/* kvbank-bench engine --llama-cpp DIR: the same model through llama.cpp's prebuilt CPU library, timed in
 * the same run as kvbank.
 *
 * Nothing of llama.cpp is built or shipped with kvbank: DIR is a directory holding a prebuilt
 * libllama and its ggml libraries (for example the `bins/linux-x64` folder of the npm package
 * @node-llama-cpp/linux-x64, whose build metadata names the llama.cpp release). The library is opened
 * with dlopen, and the model directory is written out as a GGUF v3 file (the format published with ggml:
 * header, key/value metadata, tensor infos, 32-byte aligned data) whose matrices keep the checkpoint's
 * dtype (f32, f16 or bf16: llama.cpp then runs the bytes kvbank runs) and whose norms are f32. Llama's q and k
 * projections are stored for llama.cpp's interleaved RoPE: within a head, row i of the first half and
 * row i of the second half become rows 2i and 2i+1, the reordering every Llama conversion applies.
 *
 * The C interface is reached through a handful of functions whose parameter structs are passed by
 * value. Only the first four fields of the context parameters are set (n_ctx, n_batch, n_ubatch,
 * n_seq_max: unchanged at the head of the struct across releases); the defaults read back at those
 * offsets are checked first, so a library whose layout differs is refused instead of misread. Both
 * parameter structs are larger than 16 bytes, so the x86-64 System V ABI returns them through a hidden
 * pointer and passes them on the stack: the buffers below are larger than any release's struct, and
 * the library reads and writes only its own size. Everything else is left at llama.cpp's defaults
 * (f16 KV cache, flash attention chosen by the library, mmapped weights). */
#include <dlfcn.h>
#include <glob.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench/bench_llamacpp.h"
#include "common/model/config.h"
#include "common/model/safetensors.h"

#if defined(__x86_64__)
#define LLAMACPP_ABI_OK 1
#else
#define LLAMACPP_ABI_OK 0
#endif

/* llama.cpp's batch (llama.h: llama_batch), unchanged since its introduction. */
typedef struct lc_batch {
    int32_t n_tokens;
    int32_t *token;
    float *embd;
    int32_t *pos;
    int32_t *n_seq_id;
    int32_t **seq_id;
    int8_t *logits;
} lc_batch;

/* Opaque parameter structs, larger than any release's (see the header comment). */
typedef struct lc_params {
    unsigned char bytes[1024];
} lc_params;

typedef void (*lc_log_fn)(int level, const char *text, void *ud);

struct kvb_llamacpp {
    void *h_ggml, *h_llama;
    char gguf[512];
    void *model, *ctx;
    int threads, vocab, max_ctx, max_seqs;
    lc_batch batch;
    int batch_cap;
    /* the library's functions */
    void (*backend_init)(void);
    void (*log_set)(lc_log_fn, void *);
    lc_params (*model_default_params)(void);
    lc_params (*context_default_params)(void);
    void *(*model_load)(const char *, lc_params);
    void (*model_free)(void *);
    void *(*init_from_model)(void *, lc_params);
    void (*free_ctx)(void *);
    void (*set_n_threads)(void *, int32_t, int32_t);
    lc_batch (*batch_init)(int32_t, int32_t, int32_t);
    void (*batch_free)(lc_batch);
    int32_t (*decode)(void *, lc_batch);
    float *(*logits_ith)(void *, int32_t);
    void *(*get_memory)(void *);
    void (*memory_clear)(void *, bool);
};

static void quiet_log(int level, const char *text, void *ud) {
    (void)level, (void)text, (void)ud;
}

/* ------------------------------------------------------------------------------------ GGUF writer */

enum { GGUF_U32 = 4, GGUF_I32 = 5, GGUF_F32 = 6, GGUF_STRING = 8, GGUF_ARRAY = 9 };
#define GGUF_ALIGN 32

static int w_bytes(FILE *f, const void *p, size_t n) { return fwrite(p, 1, n, f) == n ? 0 : -1; }
static int w_u32(FILE *f, uint32_t v) { return w_bytes(f, &v, 4); }
static int w_u64(FILE *f, uint64_t v) { return w_bytes(f, &v, 8); }
static int w_str(FILE *f, const char *s) { return w_u64(f, strlen(s)) || w_bytes(f, s, strlen(s)); }
static int kv_u32(FILE *f, const char *k, uint32_t v) { return w_str(f, k) || w_u32(f, GGUF_U32) || w_u32(f, v); }
static int kv_f32(FILE *f, const char *k, float v) { return w_str(f, k) || w_u32(f, GGUF_F32) || w_bytes(f, &v, 4); }
static int kv_str(FILE *f, const char *k, const char *v) { return w_str(f, k) || w_u32(f, GGUF_STRING) || w_str(f, v); }
static int kv_array(FILE *f, const char *k, uint32_t type, uint64_t n) {
    return w_str(f, k) || w_u32(f, GGUF_ARRAY) || w_u32(f, type) || w_u64(f, n);
}

/* One tensor of the GGUF file: its GGUF name, the safetensors tensor, and whether its rows are
 * reordered for interleaved RoPE (heads of head_dim rows). */
typedef struct gg_tensor {
    char name[64];
    const kvb_st_tensor *src;
    int rope_heads; /* > 0: q or k projection with this many heads */
} gg_tensor;

/* GGUF tensor types (ggml.h: GGML_TYPE_F32, _F16, _BF16) and the matching general.file_type
 * (LLAMA_FTYPE_ALL_F32, _MOSTLY_F16, _MOSTLY_BF16). */
enum { GG_F32 = 0, GG_F16 = 1, GG_BF16 = 30 };

/* A tensor keeps the checkpoint's dtype when it is a matrix (llama.cpp then runs the same bytes as
 * kvbank does); vectors (norms) are f32, as llama.cpp's converters write them. */
static int gg_type(const kvb_st_tensor *t) {
    if (t->n_dims < 2) return GG_F32;
    return t->dtype == KVB_DTYPE_BF16 ? GG_BF16 : t->dtype == KVB_DTYPE_F16 ? GG_F16 : GG_F32;
}

static size_t gg_size(int type) { return type == GG_F32 ? 4 : 2; }

/* Writes the tensor's data in its GGUF type, rows reordered for interleaved RoPE where asked. */
static int write_tensor_data(FILE *f, const gg_tensor *g, int head_dim, float *row) {
    const kvb_st_tensor *t = g->src;
    int64_t rows = t->shape[0], cols = t->n_dims > 1 ? t->shape[1] : 1;
    int type = gg_type(t);
    size_t es = kvb_dtype_size(t->dtype);
    for (int64_t r = 0; r < rows; r++) {
        int64_t src = r;
        if (g->rope_heads) { /* destination row r = head h, pair i, half p */
            int64_t h = r / head_dim, j = r % head_dim, i = j / 2, p = j % 2;
            src = h * head_dim + p * (head_dim / 2) + i;
        }
        const char *in = (const char *)t->data + (size_t)(src * cols) * es;
        if (type != GG_F32 || t->dtype == KVB_DTYPE_F32) { /* the stored bytes as they are */
            if (w_bytes(f, in, (size_t)cols * es)) return -1;
            continue;
        }
        for (int64_t c = 0; c < cols; c++) {
            uint16_t h;
            memcpy(&h, in + 2 * c, 2);
            row[c] = t->dtype == KVB_DTYPE_BF16 ? kvb_bf16_to_f32(h) : kvb_f16_to_f32(h);
        }
        if (w_bytes(f, row, (size_t)cols * 4)) return -1;
    }
    return 0;
}

static int write_gguf(const char *path, const kvb_model_config *c, const kvb_st_set *set) {
    int n_t = 0, cap = 3 + 9 * c->n_layers;
    gg_tensor *ts = calloc((size_t)cap, sizeof *ts);
    float *row = NULL;
    FILE *f = NULL;
    int rc = -1;
    if (!ts) return -1;
    struct {
        const char *gg, *hf;
        int rope;
    } per_layer[] = {
        {"attn_norm", "input_layernorm", 0},    {"attn_q", "self_attn.q_proj", 1},   {"attn_k", "self_attn.k_proj", 2},
        {"attn_v", "self_attn.v_proj", 0},      {"attn_output", "self_attn.o_proj", 0},
        {"ffn_norm", "post_attention_layernorm", 0}, {"ffn_gate", "mlp.gate_proj", 0}, {"ffn_up", "mlp.up_proj", 0},
        {"ffn_down", "mlp.down_proj", 0},
    };
#define ADD(ggname, hfname, heads)                                                         \
    do {                                                                                   \
        const kvb_st_tensor *src_ = kvb_st_find(set, hfname);                              \
        if (!src_) {                                                                       \
            fprintf(stderr, "llama.cpp comparison: tensor %s missing\n", hfname);         \
            goto out;                                                                      \
        }                                                                                  \
        snprintf(ts[n_t].name, sizeof ts[n_t].name, "%s", ggname);                         \
        ts[n_t].src = src_;                                                                \
        ts[n_t].rope_heads = heads;                                                        \
        n_t++;                                                                             \
    } while (0)
    ADD("token_embd.weight", "model.embed_tokens.weight", 0);
    ADD("output_norm.weight", "model.norm.weight", 0);
    if (!c->tie_embeddings) ADD("output.weight", "lm_head.weight", 0);
    for (int l = 0; l < c->n_layers; l++)
        for (size_t i = 0; i < KVB_ARRAY_LEN(per_layer); i++) {
            char gg[64], hf[128];
            snprintf(gg, sizeof gg, "blk.%d.%s.weight", l, per_layer[i].gg);
            snprintf(hf, sizeof hf, "model.layers.%d.%s.weight", l, per_layer[i].hf);
            int heads = per_layer[i].rope == 1 ? c->n_heads : per_layer[i].rope == 2 ? c->n_kv_heads : 0;
            ADD(gg, hf, heads);
        }
#undef ADD
    size_t max_cols = (size_t)KVB_MAX(KVB_MAX(c->hidden, c->intermediate), c->n_heads * c->head_dim);
    if (!(row = malloc(max_cols * 4)) || !(f = fopen(path, "wb"))) goto out;

    const int n_kv = 16;
    kvb_dtype wdt = ts[0].src->dtype; /* the embedding's: the checkpoint's dtype */
    uint32_t ftype = wdt == KVB_DTYPE_BF16 ? 32 : wdt == KVB_DTYPE_F16 ? 1 : 0;
    int bad = w_u32(f, 0x46554747u) || w_u32(f, 3) || w_u64(f, (uint64_t)n_t) || w_u64(f, (uint64_t)n_kv);
    bad = bad || kv_str(f, "general.architecture", "llama") || kv_u32(f, "general.file_type", ftype) ||
          kv_u32(f, "llama.context_length", (uint32_t)c->max_pos) ||
          kv_u32(f, "llama.embedding_length", (uint32_t)c->hidden) ||
          kv_u32(f, "llama.block_count", (uint32_t)c->n_layers) ||
          kv_u32(f, "llama.feed_forward_length", (uint32_t)c->intermediate) ||
          kv_u32(f, "llama.attention.head_count", (uint32_t)c->n_heads) ||
          kv_u32(f, "llama.attention.head_count_kv", (uint32_t)c->n_kv_heads) ||
          kv_u32(f, "llama.attention.key_length", (uint32_t)c->head_dim) ||
          kv_u32(f, "llama.attention.value_length", (uint32_t)c->head_dim) ||
          kv_u32(f, "llama.rope.dimension_count", (uint32_t)c->head_dim) ||
          kv_f32(f, "llama.rope.freq_base", (float)c->rope_theta) ||
          kv_f32(f, "llama.attention.layer_norm_rms_epsilon", c->rms_eps) ||
          kv_str(f, "tokenizer.ggml.model", "llama");
    /* a placeholder vocabulary of the model's size: the benchmark feeds token ids */
    bad = bad || kv_array(f, "tokenizer.ggml.tokens", GGUF_STRING, (uint64_t)c->vocab);
    for (int i = 0; i < c->vocab && !bad; i++) {
        char tok[32];
        if (i < 3) snprintf(tok, sizeof tok, "%s", i == 0 ? "<unk>" : i == 1 ? "<s>" : "</s>");
        else snprintf(tok, sizeof tok, "<t%d>", i);
        bad = w_str(f, tok);
    }
    bad = bad || kv_array(f, "tokenizer.ggml.token_type", GGUF_I32, (uint64_t)c->vocab);
    for (int i = 0; i < c->vocab && !bad; i++) bad = w_u32(f, i == 0 ? 2 : i < 3 ? 3 : 1);
    /* tensor infos: dims innermost first, the type, offsets aligned */
    uint64_t off = 0;
    for (int i = 0; i < n_t && !bad; i++) {
        const kvb_st_tensor *t = ts[i].src;
        uint64_t rows = (uint64_t)t->shape[0], cols = t->n_dims > 1 ? (uint64_t)t->shape[1] : 1;
        bad = w_str(f, ts[i].name) || w_u32(f, (uint32_t)t->n_dims);
        if (t->n_dims > 1) bad = bad || w_u64(f, cols);
        bad = bad || w_u64(f, rows) || w_u32(f, (uint32_t)gg_type(t)) || w_u64(f, off);
        off += (rows * cols * gg_size(gg_type(t)) + GGUF_ALIGN - 1) / GGUF_ALIGN * GGUF_ALIGN;
    }
    static const char zeros[GGUF_ALIGN];
    long pos = ftell(f);
    bad = bad || pos < 0 || w_bytes(f, zeros, (size_t)((GGUF_ALIGN - pos % GGUF_ALIGN) % GGUF_ALIGN));
    for (int i = 0; i < n_t && !bad; i++) {
        const kvb_st_tensor *t = ts[i].src;
        size_t bytes = (size_t)t->shape[0] * (size_t)(t->n_dims > 1 ? t->shape[1] : 1) * gg_size(gg_type(t));
        bad = write_tensor_data(f, &ts[i], c->head_dim, row) || w_bytes(f, zeros, (GGUF_ALIGN - bytes % GGUF_ALIGN) % GGUF_ALIGN);
    }
    rc = bad ? -1 : 0;
out:
    if (f && fclose(f) != 0) rc = -1;
    free(row);
    free(ts);
    return rc;
}

/* ----------------------------------------------------------------------------------- the library */

static void *sym(kvb_llamacpp *l, const char *name, int *missing) {
    void *p = dlsym(l->h_llama, name);
    if (!p) {
        fprintf(stderr, "llama.cpp comparison: %s not found in the library\n", name);
        *missing = 1;
    }
    return p;
}

/* Opens the first file in `dir` matching `pattern` (a release names its libraries with or without a
 * version, e.g. libllama.so or libllama.v0.5.0.so). */
static void *open_glob(const char *dir, const char *pattern) {
    char pat[1024];
    glob_t g;
    void *h = NULL;
    snprintf(pat, sizeof pat, "%s/%s", dir, pattern);
    if (glob(pat, 0, NULL, &g) == 0) {
        for (size_t i = 0; i < g.gl_pathc && !h; i++) h = dlopen(g.gl_pathv[i], RTLD_NOW | RTLD_GLOBAL);
        globfree(&g);
    }
    return h;
}

static int load_library(kvb_llamacpp *l, const char *dir) {
    /* ggml first: its dynamic CPU backends (one per instruction set) are loaded from the same folder */
    l->h_ggml = open_glob(dir, "libggml.so");
    if (!l->h_ggml) l->h_ggml = open_glob(dir, "libggml.v*.so");
    l->h_llama = open_glob(dir, "libllama.so");
    if (!l->h_llama) l->h_llama = open_glob(dir, "libllama.v*.so");
    if (!l->h_llama) {
        fprintf(stderr, "llama.cpp comparison: no loadable libllama in %s\n", dir);
        return -1;
    }
    if (l->h_ggml) {
        /* ggml's own log (backend loading) goes through ggml_log_set in its base library */
        void (*ggml_log)(lc_log_fn, void *) = (void (*)(lc_log_fn, void *))dlsym(RTLD_DEFAULT, "ggml_log_set");
        if (ggml_log) ggml_log(quiet_log, NULL);
        void (*load_all)(const char *) = (void (*)(const char *))dlsym(l->h_ggml, "ggml_backend_load_all_from_path");
        if (load_all) load_all(dir);
    }
    int missing = 0;
#define SYM(field, name) *(void **)&l->field = sym(l, name, &missing)
    SYM(backend_init, "llama_backend_init");
    SYM(log_set, "llama_log_set");
    SYM(model_default_params, "llama_model_default_params");
    SYM(context_default_params, "llama_context_default_params");
    SYM(model_load, "llama_model_load_from_file");
    SYM(model_free, "llama_model_free");
    SYM(init_from_model, "llama_init_from_model");
    SYM(free_ctx, "llama_free");
    SYM(set_n_threads, "llama_set_n_threads");
    SYM(batch_init, "llama_batch_init");
    SYM(batch_free, "llama_batch_free");
    SYM(decode, "llama_decode");
    SYM(logits_ith, "llama_get_logits_ith");
    SYM(get_memory, "llama_get_memory");
    SYM(memory_clear, "llama_memory_clear");
#undef SYM
    return missing ? -1 : 0;
}

/* (Re)creates the context for `seqs` sequences of up to `ctx_len` tokens each. */
static int make_context(kvb_llamacpp *l, int seqs, int ctx_len) {
    if (l->ctx && seqs <= l->max_seqs && ctx_len <= l->max_ctx) {
        l->memory_clear(l->get_memory(l->ctx), true);
        return 0;
    }
    if (l->ctx) l->free_ctx(l->ctx);
    l->ctx = NULL;
    lc_params p = l->context_default_params();
    uint32_t head[4];
    memcpy(head, p.bytes, sizeof head);
    if (head[0] != 512 && head[0] != 4096 && head[0] != 0) {
        fprintf(stderr, "llama.cpp comparison: unexpected context parameter layout (n_ctx default %u)\n", head[0]);
        return -1;
    }
    if (head[3] != 1) {
        fprintf(stderr, "llama.cpp comparison: unexpected context parameter layout (n_seq_max default %u)\n", head[3]);
        return -1;
    }
    uint32_t n_ctx = (uint32_t)(seqs * KVB_DIV_CEIL(ctx_len, 256) * 256);
    head[0] = n_ctx;                                    /* n_ctx: all sequences together */
    head[1] = head[2] = (uint32_t)KVB_MAX(512, seqs);   /* n_batch, n_ubatch */
    head[3] = (uint32_t)seqs;                           /* n_seq_max */
    memcpy(p.bytes, head, sizeof head);
    l->ctx = l->init_from_model(l->model, p);
    if (!l->ctx) {
        fprintf(stderr, "llama.cpp comparison: context of %u tokens, %d sequences not created\n", n_ctx, seqs);
        return -1;
    }
    l->set_n_threads(l->ctx, l->threads, l->threads);
    l->max_seqs = seqs;
    l->max_ctx = ctx_len;
    return 0;
}

static int ensure_batch(kvb_llamacpp *l, int n) {
    if (n <= l->batch_cap) return 0;
    if (l->batch_cap) l->batch_free(l->batch);
    l->batch = l->batch_init(n, 0, 1);
    l->batch_cap = l->batch.token ? n : 0;
    return l->batch_cap ? 0 : -1;
}

static void batch_set(kvb_llamacpp *l, int i, int32_t tok, int32_t pos, int32_t seq, int want_logits) {
    l->batch.token[i] = tok;
    l->batch.pos[i] = pos;
    l->batch.n_seq_id[i] = 1;
    l->batch.seq_id[i][0] = seq;
    l->batch.logits[i] = (int8_t)want_logits;
}

static int32_t argmax(const float *v, int n) {
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[best]) best = i;
    return best;
}

/* Decodes `n` tokens of sequence `seq` starting at position `pos0`, in batches of up to 512; the last
 * token gets logits. Returns 0 on success. */
static int feed(kvb_llamacpp *l, const int32_t *toks, int n, int pos0, int seq) {
    for (int i0 = 0; i0 < n; i0 += 512) {
        int m = KVB_MIN(512, n - i0);
        if (ensure_batch(l, m)) return -1;
        for (int i = 0; i < m; i++) batch_set(l, i, toks[i0 + i], pos0 + i0 + i, seq, i0 + i == n - 1);
        l->batch.n_tokens = m;
        if (l->decode(l->ctx, l->batch) != 0) return -1;
    }
    return 0;
}

kvb_status kvb_llamacpp_open(const char *libdir, const char *model_dir, int threads, kvb_llamacpp **out) {
    if (!LLAMACPP_ABI_OK) {
        fprintf(stderr, "llama.cpp comparison: only on x86-64\n");
        return KVB_ERR_UNSUPPORTED;
    }
    kvb_model_config c;
    KVB_TRY(kvb_model_config_load(model_dir, &c));
    if (c.arch != KVB_ARCH_LLAMA || c.rope_type != KVB_ROPE_DEFAULT || c.sliding_window > 0 || c.qkv_bias || c.o_bias || c.mlp_bias) {
        fprintf(stderr, "llama.cpp comparison: only plain Llama models (no rope scaling, window or biases)\n");
        return KVB_ERR_UNSUPPORTED;
    }
    if (c.quant.fp8) {
        fprintf(stderr, "llama.cpp comparison: FP8 checkpoints have no GGUF type to write them in (f32, f16, bf16 only)\n");
        return KVB_ERR_UNSUPPORTED;
    }
    kvb_llamacpp *l = calloc(1, sizeof *l);
    if (!l) return KVB_ERR_NOMEM;
    l->threads = threads;
    l->vocab = c.vocab;
    kvb_st_set *set = NULL;
    const char *tmp = getenv("TMPDIR");
    snprintf(l->gguf, sizeof l->gguf, "%s/kvb-bench-llamacpp-%d.gguf", tmp && *tmp ? tmp : "/tmp", (int)getpid());
    if (load_library(l, libdir)) goto fail;
    if (kvb_st_open_dir(model_dir, &set) != KVB_OK) goto fail;
    int w = write_gguf(l->gguf, &c, set);
    kvb_st_close(set);
    if (w) {
        fprintf(stderr, "llama.cpp comparison: cannot write %s\n", l->gguf);
        goto fail;
    }
    l->log_set(quiet_log, NULL);
    l->backend_init();
    l->model = l->model_load(l->gguf, l->model_default_params());
    if (!l->model) {
        fprintf(stderr, "llama.cpp comparison: the library did not load %s\n", l->gguf);
        goto fail;
    }
    *out = l;
    return KVB_OK;
fail:
    kvb_llamacpp_close(l);
    return KVB_ERR_INVALID;
}

void kvb_llamacpp_close(kvb_llamacpp *l) {
    if (!l) return;
    if (l->batch_cap) l->batch_free(l->batch);
    if (l->ctx) l->free_ctx(l->ctx);
    if (l->model) l->model_free(l->model);
    if (l->gguf[0]) unlink(l->gguf);
    /* the libraries stay loaded: ggml keeps process-wide state */
    free(l);
}

int kvb_llamacpp_greedy(kvb_llamacpp *l, const int32_t *prompt, int n_prompt, int n_out, int32_t *out) {
    if (make_context(l, 1, n_prompt + n_out) || feed(l, prompt, n_prompt, 0, 0)) return -1;
    for (int i = 0; i < n_out; i++) {
        out[i] = argmax(l->logits_ith(l->ctx, -1), l->vocab);
        if (i + 1 < n_out && feed(l, &out[i], 1, n_prompt + i, 0)) return -1;
    }
    return 0;
}

double kvb_llamacpp_prefill(kvb_llamacpp *l, const int32_t *prompt, int n) {
    if (make_context(l, 1, n + 1)) return -1;
    double t0 = kvb_now_s();
    if (feed(l, prompt, n, 0, 0)) return -1;
    return kvb_now_s() - t0;
}

double kvb_llamacpp_decode(kvb_llamacpp *l, int batch, const int32_t *const *prompts, int ctx, int steps, double *win,
                           int n_win, void (*before)(int w)) {
    if (make_context(l, batch, ctx + steps * n_win + 1)) return -1;
    int32_t *next = malloc((size_t)batch * sizeof *next);
    if (!next) return -1;
    int rc = 0;
    for (int s = 0; s < batch && !rc; s++) {
        rc = feed(l, prompts[s], ctx, 0, s);
        if (!rc) next[s] = argmax(l->logits_ith(l->ctx, -1), l->vocab);
    }
    rc = rc || ensure_batch(l, batch);
    for (int w = 0; w < n_win && !rc; w++) {
        if (before) before(w);
        double t0 = kvb_now_s();
        for (int st = 0; st < steps && !rc; st++) {
            int pos = ctx + w * steps + st;
            for (int s = 0; s < batch; s++) batch_set(l, s, next[s], pos, s, 1);
            l->batch.n_tokens = batch;
            rc = l->decode(l->ctx, l->batch) != 0;
            for (int s = 0; s < batch && !rc; s++) next[s] = argmax(l->logits_ith(l->ctx, s), l->vocab);
        }
        win[w] = (kvb_now_s() - t0) / steps;
    }
    free(next);
    return rc ? -1 : 0;
}
