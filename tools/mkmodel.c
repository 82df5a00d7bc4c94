/* kvbank-mkmodel — writes a random-weight Llama, Mistral, Qwen2 or Qwen3 model in the Hugging Face layout
 * (config.json as transformers writes it, model.safetensors or shards + model.safetensors.index.json).
 * Weights are deterministic from --seed: splitmix64 uniforms, Box-Muller normals. With --fp8 the linear
 * layers are then quantized to FP8 E4M3 as llm-compressor's FP8 schemes store them (compressed-tensors
 * float-quantized: X.weight F8_E4M3, X.weight_scale, a quantization_config in config.json). */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "common/model/config.h"
#include "common/model/safetensors.h"
#include "common/text/tokenizer.h"
#include "common/util/util.h"
#include "common/util/progress.h"
#include "common/util/prog.h"

typedef enum rope_kind { ROPE_NONE, ROPE_LLAMA3, ROPE_LINEAR, ROPE_YARN } rope_kind;

typedef struct opts {
    kvb_arch arch;
    int qwen3;              /* arch == KVB_ARCH_QWEN3 (q/k norms) */
    int attention_bias;     /* --attention-bias (llama, qwen3): q/k/v/o biases */
    int mlp_bias;           /* --mlp-bias (llama) */
    int sliding_window;     /* --sliding-window N (0: none) */
    int max_window_layers;  /* --max-window-layers (qwen2/qwen3; -1: half the layers) */
    int layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, max_pos;
    kvb_dtype dtype;
    uint64_t seed;
    int tie;
    rope_kind rope;
    double rope_theta; /* 0: the architecture's default */
    int shards;
    const char *outdir;
    const char *tokenizer;  /* --tokenizer DIR, or NULL */
    int vocab_given;        /* --vocab was on the command line */
    int32_t bos_id;         /* config.json's bos_token_id (-1: null) */
    int32_t *eos;           /* [n_eos] config.json / generation_config.json eos_token_id */
    int n_eos;
    int fp8;                /* --fp8: 0 none, FP8_W8A16 or FP8_W8A8 */
    int fp8_tensor;         /* --fp8-scale tensor: one scale per weight (else one per output channel) */
    const char *fp8_ignore[8]; /* --fp8-ignore ENTRY: more `ignore` entries after "lm_head" */
    int n_fp8_ignore;
    int threads;            /* --threads: weight generation in parallel (the values do not depend on it) */
} opts;

enum { FP8_W8A16 = 1, FP8_W8A8 = 2 };

static void usage(FILE *f, const char *prog) {
    fprintf(f,
            "usage: %s --arch llama|mistral|qwen2|qwen3 [options] OUTDIR\n"
            "\n"
            "Writes a random-weight model in the Hugging Face layout into OUTDIR (created if missing):\n"
            "config.json and model.safetensors, or with --shards N > 1 the files\n"
            "model-0000i-of-0000N.safetensors and model.safetensors.index.json.\n"
            "\n"
            "  --arch A            llama (LlamaForCausalLM), mistral (MistralForCausalLM), qwen2\n"
            "                      (Qwen2ForCausalLM: q/k/v biases) or qwen3 (Qwen3ForCausalLM: q/k norms)\n"
            "  --layers N          decoder layers (default 2)\n"
            "  --hidden N          hidden size (default 64)\n"
            "  --heads N           attention heads (default 4)\n"
            "  --kv-heads N        key/value heads, must divide --heads (default 2)\n"
            "  --head-dim N        per-head dimension, even (default hidden/heads = 16)\n"
            "  --intermediate N    MLP intermediate size (default 128)\n"
            "  --vocab N           vocabulary size, at least 3 (default 256; bos id 1, eos id 2)\n"
            "  --max-pos N         max_position_embeddings (default 2048)\n"
            "  --dtype D           f32, f16 or bf16 weights (default f32)\n"
            "  --seed N            RNG seed (default 0); same flags and seed give identical files\n"
            "  --tie               tie_word_embeddings: no lm_head.weight, the LM head is the embedding\n"
            "  --rope-scaling T    T = llama3: factor 8, low_freq_factor 1, high_freq_factor 4,\n"
            "                      original_max_position_embeddings = max-pos / 8; linear: factor 2;\n"
            "                      yarn: factor 4, original_max_position_embeddings = max-pos / 4\n"
            "  --rope-theta X      RoPE base (default 10000 for llama, 1000000 for the others)\n"
            "  --sliding-window N  sliding-window attention over the last N keys: every layer (mistral;\n"
            "                      without it mistral writes \"sliding_window\": null), or with\n"
            "                      use_sliding_window the layers from --max-window-layers on (qwen2, qwen3)\n"
            "  --max-window-layers K  qwen2/qwen3: the first layer that slides (default: half the layers)\n"
            "  --attention-bias    llama, qwen3: biases on q/k/v/o_proj (qwen2 always has q/k/v biases)\n"
            "  --mlp-bias          llama: biases on gate/up/down_proj\n"
            "  --shards N          split the tensors, in checkpoint order, over N files of about equal\n"
            "                      tensor count (default 1: a single model.safetensors)\n"
            "  --tokenizer DIR     carry the Hugging Face tokenizer of DIR: copies tokenizer.json,\n"
            "                      tokenizer_config.json and chat_template.jinja (if present), sets\n"
            "                      vocab_size to the tokenizer's size (unless --vocab is larger), bos/eos\n"
            "                      ids from it, and writes generation_config.json with the EOS ids\n"
            "  --eos-ids IDS       EOS ids for config.json and generation_config.json (default: 2, or with\n"
            "                      --tokenizer its EOS ids plus the end-of-turn tokens it has:\n"
            "                      <|eot_id|>, <|eom_id|>, <|end_of_text|>, <|im_end|>, <|endoftext|>)\n"
            "  --fp8 S             quantize the linear layers to FP8 E4M3 as llm-compressor stores them\n"
            "                      (compressed-tensors, float-quantized): S = w8a16 (weights only) or\n"
            "                      w8a8 (inputs quantized dynamically per token); lm_head is ignored\n"
            "  --fp8-scale K       channel (a scale per output row, default) or tensor (one per weight)\n"
            "  --fp8-ignore ENTRY  another `ignore` entry: a module name (model.layers.0.mlp.down_proj) or\n"
            "                      re:REGEX; repeatable, up to 7\n"
            "  --threads N         threads making the weights (default: the online CPUs, at most 64);\n"
            "                      the files do not depend on it\n"
            "  --help              this text\n"
            "\n"
            "Weights: linear layers N(0, 1/sqrt(in_features)), embeddings N(0, 1) (with --tie\n"
            "N(0, 1/sqrt(hidden)), the LM head's scale), norm weights 1 + N(0, 0.1). rms_norm_eps is\n"
            "1e-5 (llama, mistral) or 1e-6 (qwen2, qwen3); biases N(0, 0.5). Exit status 2 on a usage error.\n",
            prog);
}

/* ------------------------------------------------------------------------------------- randomness */

/* One stream of N(0, 1) values per seed: value 2p and 2p + 1 are the Box-Muller pair of uniforms
 * 2p + 1 and 2p + 2 of splitmix64, a counter (its k-th output is a function of seed + k * gamma), so
 * any stretch of the stream can be made on its own and threads give the single-threaded file. */
static double uniform_at(uint64_t seed, uint64_t k) { /* the k-th output (from 1), in (0, 1]: 53 bits */
    uint64_t z = seed + k * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return ((double)((z ^ (z >> 31)) >> 11) + 1.0) * 0x1.0p-53;
}

static void normal_pair(uint64_t seed, uint64_t p, double *even, double *odd) {
    double u1 = uniform_at(seed, 2 * p + 1), u2 = uniform_at(seed, 2 * p + 2);
    double rad = sqrt(-2.0 * log(u1)), th = 2.0 * M_PI * u2;
    *even = rad * cos(th);
    *odd = rad * sin(th);
}

/* ---------------------------------------------------------------------------------- the tensors */

typedef struct wtensor {
    char name[96];
    kvb_dtype dtype;  /* --dtype; F8_E4M3 for a quantized weight */
    int n_dims;
    int64_t shape[2];
    double mean, std; /* N(mean, std) */
    void *data;       /* [elems] of the output dtype; owned */
} wtensor;

typedef struct tensor_list {
    wtensor *t;
    int n, cap;
} tensor_list;

static kvb_status add(tensor_list *l, const char *name, int n_dims, int64_t rows, int64_t cols, double mean,
                      double std) {
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 32;
        KVB_TRY(kvb_realloc_array((void **)&l->t, (size_t)cap, sizeof *l->t));
        l->cap = cap;
    }
    wtensor *t = &l->t[l->n++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->n_dims = n_dims;
    t->shape[0] = rows;
    t->shape[1] = cols;
    t->mean = mean;
    t->std = std;
    return KVB_OK;
}

static void list_free(tensor_list *l) {
    for (int i = 0; i < l->n; i++) free(l->t[i].data);
    free(l->t);
}

static int64_t elems(const wtensor *t) { return t->n_dims == 1 ? t->shape[0] : t->shape[0] * t->shape[1]; }

static int qkv_bias(const opts *o) { return o->arch == KVB_ARCH_QWEN2 || o->attention_bias; }

/* Tensors per decoder layer. */
static int layer_tensor_count(const opts *o) {
    return 9 + (o->qwen3 ? 2 : 0) + (qkv_bias(o) ? 3 : 0) + (o->attention_bias ? 1 : 0) + (o->mlp_bias ? 3 : 0);
}

/* The checkpoint's tensors in the order transformers lists them. */
static kvb_status build_list(const opts *o, tensor_list *l) {
    const int64_t h = o->hidden, q = (int64_t)o->heads * o->head_dim, kv = (int64_t)o->kv_heads * o->head_dim;
    const int64_t ff = o->intermediate;
    char n[96];
    /* Tied, the table is also the LM head: draw it at the LM head's scale, or the residual stream would
     * be dominated by the input token's own row and every step would predict its input again. */
    KVB_TRY(add(l, "model.embed_tokens.weight", 2, o->vocab, h, 0.0, o->tie ? 1.0 / sqrt((double)h) : 1.0));
    for (int i = 0; i < o->layers; i++) {
#define LAYER(suffix, nd, r, c, mean, std)                                                             \
    do {                                                                                               \
        snprintf(n, sizeof n, "model.layers.%d.%s", i, suffix);                                        \
        KVB_TRY(add(l, n, nd, r, c, mean, std));                                                       \
    } while (0)
        LAYER("input_layernorm.weight", 1, h, 0, 1.0, 0.1);
        LAYER("self_attn.q_proj.weight", 2, q, h, 0.0, 1.0 / sqrt((double)h));
        LAYER("self_attn.k_proj.weight", 2, kv, h, 0.0, 1.0 / sqrt((double)h));
        LAYER("self_attn.v_proj.weight", 2, kv, h, 0.0, 1.0 / sqrt((double)h));
        LAYER("self_attn.o_proj.weight", 2, h, q, 0.0, 1.0 / sqrt((double)q));
        if (qkv_bias(o)) {
            LAYER("self_attn.q_proj.bias", 1, q, 0, 0.0, 0.5);
            LAYER("self_attn.k_proj.bias", 1, kv, 0, 0.0, 0.5);
            LAYER("self_attn.v_proj.bias", 1, kv, 0, 0.0, 0.5);
        }
        if (o->attention_bias) LAYER("self_attn.o_proj.bias", 1, h, 0, 0.0, 0.5);
        if (o->qwen3) {
            LAYER("self_attn.q_norm.weight", 1, o->head_dim, 0, 1.0, 0.1);
            LAYER("self_attn.k_norm.weight", 1, o->head_dim, 0, 1.0, 0.1);
        }
        LAYER("post_attention_layernorm.weight", 1, h, 0, 1.0, 0.1);
        LAYER("mlp.gate_proj.weight", 2, ff, h, 0.0, 1.0 / sqrt((double)h));
        LAYER("mlp.up_proj.weight", 2, ff, h, 0.0, 1.0 / sqrt((double)h));
        LAYER("mlp.down_proj.weight", 2, h, ff, 0.0, 1.0 / sqrt((double)ff));
        if (o->mlp_bias) {
            LAYER("mlp.gate_proj.bias", 1, ff, 0, 0.0, 0.5);
            LAYER("mlp.up_proj.bias", 1, ff, 0, 0.0, 0.5);
            LAYER("mlp.down_proj.bias", 1, h, 0, 0.0, 0.5);
        }
#undef LAYER
    }
    KVB_TRY(add(l, "model.norm.weight", 1, h, 0, 1.0, 0.1));
    if (!o->tie) KVB_TRY(add(l, "lm_head.weight", 2, o->vocab, h, 0.0, 1.0 / sqrt((double)h)));
    return KVB_OK;
}

/* Values [from, to) of tensor t, whose first value is value `base` of the stream. */
typedef struct fill_job {
    const wtensor *t;
    uint64_t seed, base;
    int64_t from, to;
    pthread_t th;
} fill_job;

static void *fill_range(void *arg) {
    const fill_job *j = arg;
    const wtensor *t = j->t;
    double pair[2];
    for (int64_t k = j->from; k < j->to; k++) {
        uint64_t g = j->base + (uint64_t)k;
        if (k == j->from || (g & 1) == 0) normal_pair(j->seed, g >> 1, &pair[0], &pair[1]);
        float v = (float)(t->mean + t->std * pair[g & 1]);
        switch (t->dtype) {
        case KVB_DTYPE_F32: ((float *)t->data)[k] = v; break;
        case KVB_DTYPE_F16: ((uint16_t *)t->data)[k] = kvb_f32_to_f16(v); break;
        case KVB_DTYPE_BF16: ((uint16_t *)t->data)[k] = kvb_f32_to_bf16(v); break;
        default: break; /* F8_E4M3 is not a --dtype */
        }
    }
    return NULL;
}

/* Draws every tensor's values from one stream, in list order, and stores them in the output dtype;
 * each tensor's range split over --threads threads. */
static kvb_status fill(const opts *o, tensor_list *l) {
    fill_job jobs[64];
    int nth = KVB_MAX(1, KVB_MIN(o->threads, (int)KVB_ARRAY_LEN(jobs)));
    uint64_t base = 0;
    /* a progress line on a terminal (common/util/progress.h): a big model takes a while */
    kvb_progress pg;
    uint64_t total = 0, done = 0;
    for (int i = 0; i < l->n; i++) total += (uint64_t)elems(&l->t[i]) * kvb_dtype_size(o->dtype);
    char what[PATH_MAX + 32];
    snprintf(what, sizeof what, "generating the weights of %s", o->outdir);
    kvb_progress_begin(&pg, what, total, KVB_PROGRESS_BYTES);
    for (int i = 0; i < l->n; i++) {
        wtensor *t = &l->t[i];
        int64_t n = elems(t);
        t->dtype = o->dtype;
        kvb_status st = kvb_malloc((size_t)n * kvb_dtype_size(o->dtype), &t->data);
        if (st != KVB_OK) {
            kvb_progress_cancel(&pg);
            return st;
        }
        /* threads for big tensors only (1 M values each at least): a norm weight is not worth one */
        int use = (int)KVB_MAX(1, KVB_MIN((int64_t)nth, n >> 20));
        for (int i = 0; i < use; i++) jobs[i] = (fill_job){t, o->seed, base, n * i / use, n * (i + 1) / use, 0};
        int started = 1;
        while (started < use && pthread_create(&jobs[started].th, NULL, fill_range, &jobs[started]) == 0) started++;
        for (int i = started; i < use; i++) fill_range(&jobs[i]); /* threads that could not start: here */
        fill_range(&jobs[0]);
        for (int i = 1; i < started; i++) pthread_join(jobs[i].th, NULL);
        base += (uint64_t)n;
        done += (uint64_t)n * kvb_dtype_size(o->dtype);
        kvb_progress_update(&pg, done);
    }
    kvb_progress_end(&pg);
    return KVB_OK;
}

/* ------------------------------------------------------------------------------------- FP8 */

/* config.json's quantization_config (without the leading key), as compressed-tensors writes it for
 * llm-compressor's FP8_DYNAMIC / FP8 weight-only schemes: json.dumps(indent=2, sort_keys=True), nested
 * one level. */
static void fp8_config_json(const opts *o, char *buf, size_t cap) {
    const char *act = o->fp8 == FP8_W8A8
                          ? "{\n          \"actorder\": null,\n          \"block_structure\": null,\n"
                            "          \"dynamic\": true,\n          \"group_size\": null,\n          \"num_bits\": 8,\n"
                            "          \"observer\": null,\n          \"observer_kwargs\": {},\n"
                            "          \"strategy\": \"token\",\n          \"symmetric\": true,\n"
                            "          \"type\": \"float\"\n        }"
                          : "null";
    char ignore[1024];
    size_t k = (size_t)snprintf(ignore, sizeof ignore, "\n      \"lm_head\"");
    for (int i = 0; i < o->n_fp8_ignore && k < sizeof ignore; i++)
        k += (size_t)snprintf(ignore + k, sizeof ignore - k, ",\n      \"%s\"", o->fp8_ignore[i]);
    snprintf(buf, cap,
             "{\n    \"config_groups\": {\n      \"group_0\": {\n        \"format\": \"float-quantized\",\n"
             "        \"input_activations\": %s,\n        \"output_activations\": null,\n"
             "        \"targets\": [\n          \"Linear\"\n        ],\n        \"weights\": {\n"
             "          \"actorder\": null,\n          \"block_structure\": null,\n          \"dynamic\": false,\n"
             "          \"group_size\": null,\n          \"num_bits\": 8,\n          \"observer\": \"minmax\",\n"
             "          \"observer_kwargs\": {},\n          \"strategy\": \"%s\",\n          \"symmetric\": true,\n"
             "          \"type\": \"float\"\n        }\n      }\n    },\n    \"format\": \"float-quantized\",\n"
             "    \"global_compression_ratio\": null,\n    \"ignore\": [%s\n    ],\n    \"kv_cache_scheme\": null,\n"
             "    \"quant_method\": \"compressed-tensors\",\n    \"quantization_status\": \"compressed\"\n  }",
             act, o->fp8_tensor ? "tensor" : "channel", ignore);
}

/* The weight quantization of llm-compressor's minmax observer: scale = max|w| / 448 over the output row
 * (channel) or the weight (tensor), stored in the model's dtype, and each element w / scale clamped to
 * [-448, 448] and rounded to E4M3, ties to even (compressed-tensors' quantize). Returns the scale as
 * stored. */
static float fp8_scale(const opts *o, float amax) {
    float s = amax / 448.0f;
    if (s == 0.0f) s = 1.1920929e-07f; /* float32 epsilon, as compressed-tensors replaces a zero scale */
    return o->dtype == KVB_DTYPE_BF16 ? kvb_bf16_to_f32(kvb_f32_to_bf16(s))
           : o->dtype == KVB_DTYPE_F16 ? kvb_f16_to_f32(kvb_f32_to_f16(s)) : s;
}

static float elem(const wtensor *t, int64_t k) {
    switch (t->dtype) {
    case KVB_DTYPE_F16: return kvb_f16_to_f32(((const uint16_t *)t->data)[k]);
    case KVB_DTYPE_BF16: return kvb_bf16_to_f32(((const uint16_t *)t->data)[k]);
    default: return ((const float *)t->data)[k];
    }
}

/* Quantizes tensor *t in place (its data becomes E4M3 bytes) into `scale` ([rows] or [1] floats). */
static kvb_status quantize_tensor(const opts *o, wtensor *t, float *scale) {
    int64_t rows = t->shape[0], cols = t->shape[1];
    uint8_t *q = NULL;
    KVB_TRY(kvb_malloc((size_t)(rows * cols), (void **)&q));
    float amax = 0.0f;
    for (int64_t k = 0; k < rows * cols && o->fp8_tensor; k++) amax = fmaxf(amax, fabsf(elem(t, k)));
    if (o->fp8_tensor) scale[0] = fp8_scale(o, amax);
    for (int64_t r = 0; r < rows; r++) {
        if (!o->fp8_tensor) {
            amax = 0.0f;
            for (int64_t c = 0; c < cols; c++) amax = fmaxf(amax, fabsf(elem(t, r * cols + c)));
            scale[r] = fp8_scale(o, amax);
        }
        float s = scale[o->fp8_tensor ? 0 : r];
        for (int64_t c = 0; c < cols; c++)
            q[r * cols + c] = kvb_f32_to_e4m3(fminf(fmaxf(elem(t, r * cols + c) / s, -448.0f), 448.0f));
    }
    free(t->data);
    t->data = q;
    t->dtype = KVB_DTYPE_F8_E4M3;
    return KVB_OK;
}

/* Which projection (kvb_proj; KVB_PROJ_COUNT for lm_head) the weight called `name` is, and of which layer;
 * -1 for a tensor that is no linear layer's weight. */
static int linear_of(const char *name, int *layer) {
    *layer = 0;
    if (!strcmp(name, "lm_head.weight")) return KVB_PROJ_COUNT;
    int l, end = 0;
    if (sscanf(name, "model.layers.%d.%n", &l, &end) != 1 || !end) return -1;
    for (int p = 0; p < KVB_PROJ_COUNT; p++) {
        size_t n = strlen(kvb_proj_name(p));
        if (!strncmp(name + end, kvb_proj_name(p), n) && !strcmp(name + end + n, ".weight")) {
            *layer = l;
            return p;
        }
    }
    return -1;
}

/* Quantizes the linear layers the quantization_config of `o` covers (kvbank's own reading of it, so the
 * file and the config agree), each followed in the list by its X.weight_scale. */
static kvb_status quantize_fp8(const opts *o, tensor_list *l) {
    char text[4096];
    fp8_config_json(o, text, sizeof text);
    json_error_t jerr;
    json_t *j = json_loads(text, 0, &jerr);
    if (!j) {
        KVB_LOG_E("quantization_config: %s", jerr.text);
        return KVB_ERR_INVALID;
    }
    kvb_quant_config q;
    kvb_status st = kvb_quant_config_parse(j, o->layers, o->tie, &q);
    json_decref(j);
    KVB_TRY(st);
    for (int i = 0; i < l->n; i++) {
        int layer, p = linear_of(l->t[i].name, &layer);
        if (p < 0 || !kvb_quant_is_quantized(&q, layer, p)) continue;
        int64_t n = o->fp8_tensor ? 1 : l->t[i].shape[0];
        char sname[128];
        snprintf(sname, sizeof sname, "%s_scale", l->t[i].name);
        KVB_TRY(add(l, sname, o->fp8_tensor ? 1 : 2, n, o->fp8_tensor ? 0 : 1, 0.0, 0.0));
        wtensor sc = l->t[--l->n]; /* the new entry goes right after its weight */
        memmove(&l->t[i + 2], &l->t[i + 1], (size_t)(l->n - i - 1) * sizeof *l->t);
        l->n++;
        sc.dtype = o->dtype;
        sc.data = NULL;
        l->t[i + 1] = sc;
        float *scale = NULL;
        KVB_TRY(kvb_malloc((size_t)n * sizeof(float), (void **)&scale));
        st = quantize_tensor(o, &l->t[i], scale);
        if (st == KVB_OK) st = kvb_malloc((size_t)n * kvb_dtype_size(o->dtype), &l->t[i + 1].data);
        for (int64_t k = 0; st == KVB_OK && k < n; k++) {
            void *d = l->t[i + 1].data;
            if (o->dtype == KVB_DTYPE_F32) ((float *)d)[k] = scale[k];
            else ((uint16_t *)d)[k] = o->dtype == KVB_DTYPE_BF16 ? kvb_f32_to_bf16(scale[k]) : kvb_f32_to_f16(scale[k]);
        }
        free(scale);
        KVB_TRY(st);
        i++;
    }
    return KVB_OK;
}

/* ------------------------------------------------------------------------------------- writing */

static kvb_status write_file(const opts *o, const char *fname, wtensor *ts, int n) {
    char path[PATH_MAX];
    if (snprintf(path, sizeof path, "%s/%s", o->outdir, fname) >= (int)sizeof path) return KVB_ERR_INVALID;
    kvb_st_write_tensor *w = NULL;
    KVB_TRY(kvb_calloc((size_t)n, sizeof *w, (void **)&w));
    for (int i = 0; i < n; i++) {
        w[i].name = ts[i].name;
        w[i].dtype = ts[i].dtype;
        w[i].n_dims = ts[i].n_dims;
        w[i].shape[0] = ts[i].shape[0];
        w[i].shape[1] = ts[i].shape[1];
        w[i].data = ts[i].data;
    }
    uint64_t bytes = 0;
    for (int i = 0; i < n; i++) bytes += (uint64_t)elems(&ts[i]) * kvb_dtype_size(ts[i].dtype);
    kvb_progress pg; /* one line for the file (kvb_st_write writes it in one go) */
    char what[PATH_MAX + 16];
    snprintf(what, sizeof what, "writing %s", path);
    kvb_progress_begin(&pg, what, bytes, KVB_PROGRESS_BYTES);
    kvb_status st = kvb_st_write(path, w, n, "{\"format\": \"pt\"}");
    if (st == KVB_OK) kvb_progress_end(&pg);
    else kvb_progress_cancel(&pg);
    free(w);
    return st;
}

typedef struct name_shard {
    const char *name;
    int shard; /* 1-based */
} name_shard;

static int cmp_name_shard(const void *a, const void *b) {
    return strcmp(((const name_shard *)a)->name, ((const name_shard *)b)->name);
}

/* model.safetensors.index.json as transformers writes it: json.dumps(indent=2, sort_keys=True) + "\n". */
static kvb_status write_index(const opts *o, name_shard *map, int n, int64_t total_size) {
    char path[PATH_MAX];
    if (snprintf(path, sizeof path, "%s/model.safetensors.index.json", o->outdir) >= (int)sizeof path)
        return KVB_ERR_INVALID;
    qsort(map, (size_t)n, sizeof *map, cmp_name_shard);
    FILE *f = fopen(path, "w");
    if (!f) {
        KVB_LOG_E("%s: cannot create: %s", path, strerror(errno));
        return KVB_ERR_IO;
    }
    fprintf(f, "{\n  \"metadata\": {\n    \"total_size\": %lld\n  },\n  \"weight_map\": {\n", (long long)total_size);
    for (int i = 0; i < n; i++)
        fprintf(f, "    \"%s\": \"model-%05d-of-%05d.safetensors\"%s\n", map[i].name, map[i].shard, o->shards,
                i + 1 < n ? "," : "");
    fprintf(f, "  }\n}\n");
    if (ferror(f) | (fclose(f) != 0)) {
        KVB_LOG_E("%s: write failed", path);
        return KVB_ERR_IO;
    }
    return KVB_OK;
}

/* One model.safetensors, or --shards files of consecutive tensors (about equal counts) plus the index. */
static kvb_status write_weights(const opts *o, tensor_list *l) {
    if (o->shards == 1) return write_file(o, "model.safetensors", l->t, l->n);
    kvb_status st;
    name_shard *map = NULL;
    KVB_TRY(kvb_calloc((size_t)l->n, sizeof *map, (void **)&map));
    int64_t total = 0;
    int first = 0;
    for (int s = 0; s < o->shards; s++) {
        int last = (int)((int64_t)l->n * (s + 1) / o->shards); /* this shard holds tensors [first, last) */
        char fname[64];
        snprintf(fname, sizeof fname, "model-%05d-of-%05d.safetensors", s + 1, o->shards);
        for (int i = first; i < last; i++) {
            map[i] = (name_shard){l->t[i].name, s + 1};
            total += elems(&l->t[i]) * (int64_t)kvb_dtype_size(l->t[i].dtype);
        }
        KVB_TRY_GOTO(write_file(o, fname, l->t + first, last - first), fail_map);
        first = last;
    }
    KVB_TRY_GOTO(write_index(o, map, l->n, total), fail_map);
    free(map);
    return KVB_OK;
fail_map:
    free(map);
    return st;
}

/* eos_token_id as transformers writes it: an int, or a list when there are several. */
static void eos_json(const opts *o, char *buf, size_t cap) {
    size_t k = (size_t)snprintf(buf, cap, o->n_eos == 1 ? "" : "[");
    for (int i = 0; i < o->n_eos && k < cap; i++) k += (size_t)snprintf(buf + k, cap - k, i ? ", %d" : "%d", o->eos[i]);
    if (o->n_eos != 1 && k < cap) snprintf(buf + k, cap - k, "]");
}

typedef struct kv_line {
    const char *key;
    char value[4096]; /* JSON text, already indented for a nested value */
} kv_line;

static int cmp_kv_line(const void *a, const void *b) {
    return strcmp(((const kv_line *)a)->key, ((const kv_line *)b)->key);
}

static const char *const ARCH_CLASS[] = {
    [KVB_ARCH_LLAMA] = "LlamaForCausalLM", [KVB_ARCH_QWEN3] = "Qwen3ForCausalLM",
    [KVB_ARCH_MISTRAL] = "MistralForCausalLM", [KVB_ARCH_QWEN2] = "Qwen2ForCausalLM"};
static const char *const ARCH_TYPE[] = {
    [KVB_ARCH_LLAMA] = "llama", [KVB_ARCH_QWEN3] = "qwen3", [KVB_ARCH_MISTRAL] = "mistral", [KVB_ARCH_QWEN2] = "qwen2"};

/* config.json as transformers' PretrainedConfig.to_json_file writes it: the fields a real checkpoint of
 * the architecture carries, json.dumps(indent=2, sort_keys=True) + "\n" (transformers_version is left
 * out: transformers did not write this file). */
static kvb_status write_config(const opts *o) {
    kv_line L[40];
    int n = 0;
    char f1[64], f2[64];
    const int llama = o->arch == KVB_ARCH_LLAMA, mistral = o->arch == KVB_ARCH_MISTRAL;
    const int qwen = o->arch == KVB_ARCH_QWEN2 || o->arch == KVB_ARCH_QWEN3;
#define SET(k, ...) (L[n].key = (k), snprintf(L[n].value, sizeof L[n].value, __VA_ARGS__), n++)
    SET("architectures", "[\n    \"%s\"\n  ]", ARCH_CLASS[o->arch]);
    if (llama || o->qwen3) SET("attention_bias", "%s", o->attention_bias ? "true" : "false");
    SET("attention_dropout", "0.0");
    if (o->bos_id >= 0) SET("bos_token_id", "%d", o->bos_id);
    else SET("bos_token_id", "null");
    char eos[200];
    eos_json(o, eos, sizeof eos);
    SET("eos_token_id", "%s", eos);
    /* Qwen2 and Mistral checkpoints carry head_dim only where it is not hidden / heads */
    if (llama || o->qwen3 || o->head_dim * o->heads != o->hidden) SET("head_dim", "%d", o->head_dim);
    SET("hidden_act", "\"silu\"");
    SET("hidden_size", "%d", o->hidden);
    SET("initializer_range", "0.02");
    SET("intermediate_size", "%d", o->intermediate);
    SET("max_position_embeddings", "%d", o->max_pos);
    SET("model_type", "\"%s\"", ARCH_TYPE[o->arch]);
    SET("num_attention_heads", "%d", o->heads);
    SET("num_hidden_layers", "%d", o->layers);
    SET("num_key_value_heads", "%d", o->kv_heads);
    kvb_fmt_py_float(qwen ? 1e-6 : 1e-5, f1, sizeof f1);
    SET("rms_norm_eps", "%s", f1);
    switch (o->rope) {
    case ROPE_LLAMA3:
        SET("rope_scaling",
            "{\n    \"factor\": 8.0,\n    \"high_freq_factor\": 4.0,\n    \"low_freq_factor\": 1.0,\n"
            "    \"original_max_position_embeddings\": %d,\n    \"rope_type\": \"llama3\"\n  }",
            KVB_MAX(o->max_pos / 8, 1));
        break;
    case ROPE_LINEAR: SET("rope_scaling", "{\n    \"factor\": 2.0,\n    \"rope_type\": \"linear\"\n  }"); break;
    case ROPE_YARN: /* as Qwen's model cards write it */
        SET("rope_scaling",
            "{\n    \"factor\": 4.0,\n    \"original_max_position_embeddings\": %d,\n    \"rope_type\": \"yarn\"\n  }",
            KVB_MAX(o->max_pos / 4, 1));
        break;
    case ROPE_NONE: SET("rope_scaling", "null"); break;
    }
    kvb_fmt_py_float(o->rope_theta, f2, sizeof f2);
    SET("rope_theta", "%s", f2);
    SET("tie_word_embeddings", "%s", o->tie ? "true" : "false");
    SET("torch_dtype", "\"%s\"", o->dtype == KVB_DTYPE_F32 ? "float32" : o->dtype == KVB_DTYPE_F16 ? "float16" : "bfloat16");
    SET("use_cache", "true");
    SET("vocab_size", "%d", o->vocab);
    if (qwen) {
        int first = o->max_window_layers >= 0 ? o->max_window_layers : o->layers / 2;
        SET("max_window_layers", "%d", o->sliding_window ? first : o->layers);
        if (o->sliding_window) SET("sliding_window", "%d", o->sliding_window);
        else SET("sliding_window", "null");
        SET("use_sliding_window", "%s", o->sliding_window ? "true" : "false");
    } else if (mistral) {
        if (o->sliding_window) SET("sliding_window", "%d", o->sliding_window);
        else SET("sliding_window", "null");
    } else {
        SET("mlp_bias", "%s", o->mlp_bias ? "true" : "false");
        SET("pretraining_tp", "1");
    }
    if (o->fp8) {
        L[n].key = "quantization_config";
        fp8_config_json(o, L[n].value, sizeof L[n].value);
        n++;
    }
#undef SET
    qsort(L, (size_t)n, sizeof *L, cmp_kv_line);
    char path[PATH_MAX];
    if (snprintf(path, sizeof path, "%s/config.json", o->outdir) >= (int)sizeof path) return KVB_ERR_INVALID;
    FILE *f = fopen(path, "w");
    if (!f) {
        KVB_LOG_E("%s: cannot create: %s", path, strerror(errno));
        return KVB_ERR_IO;
    }
    fprintf(f, "{\n");
    for (int i = 0; i < n; i++) fprintf(f, "  \"%s\": %s%s\n", L[i].key, L[i].value, i + 1 < n ? "," : "");
    fprintf(f, "}\n");
    if (ferror(f) | (fclose(f) != 0)) {
        KVB_LOG_E("%s: write failed", path);
        return KVB_ERR_IO;
    }
    return KVB_OK;
}

/* ------------------------------------------------------------------------------------- main */

static int parse_int_opt(const char *prog, const char *flag, const char *arg, int64_t min, int64_t max, int *out) {
    int64_t v;
    if (kvb_parse_i64(arg, min, max, &v) != KVB_OK) {
        fprintf(stderr, "%s: --%s wants an integer in [%lld, %lld], got \"%s\"\n", prog, flag, (long long)min,
                (long long)max, arg);
        return -1;
    }
    *out = (int)v;
    return 0;
}

/* Parses argv into `o`; returns 0, 1 for --help, or -1 for a usage error (message printed). */
static int parse_args(int argc, char **argv, opts *o) {
    enum { O_ARCH = 256, O_LAYERS, O_HIDDEN, O_HEADS, O_KV, O_HD, O_FF, O_VOCAB, O_MAXPOS, O_DTYPE, O_SEED,
           O_TIE, O_SCALING, O_THETA, O_SHARDS, O_TOKENIZER, O_EOS, O_WINDOW, O_WINDOW_LAYERS, O_ATTN_BIAS,
           O_MLP_BIAS, O_FP8, O_FP8_SCALE, O_FP8_IGNORE, O_THREADS, O_HELP };
    static const struct option lo[] = {
        {"arch", required_argument, 0, O_ARCH}, {"layers", required_argument, 0, O_LAYERS},
        {"hidden", required_argument, 0, O_HIDDEN}, {"heads", required_argument, 0, O_HEADS},
        {"kv-heads", required_argument, 0, O_KV}, {"head-dim", required_argument, 0, O_HD},
        {"intermediate", required_argument, 0, O_FF}, {"vocab", required_argument, 0, O_VOCAB},
        {"max-pos", required_argument, 0, O_MAXPOS}, {"dtype", required_argument, 0, O_DTYPE},
        {"seed", required_argument, 0, O_SEED}, {"tie", no_argument, 0, O_TIE},
        {"rope-scaling", required_argument, 0, O_SCALING}, {"rope-theta", required_argument, 0, O_THETA},
        {"shards", required_argument, 0, O_SHARDS}, {"tokenizer", required_argument, 0, O_TOKENIZER},
        {"eos-ids", required_argument, 0, O_EOS}, {"sliding-window", required_argument, 0, O_WINDOW},
        {"max-window-layers", required_argument, 0, O_WINDOW_LAYERS}, {"attention-bias", no_argument, 0, O_ATTN_BIAS},
        {"mlp-bias", no_argument, 0, O_MLP_BIAS}, {"fp8", required_argument, 0, O_FP8},
        {"fp8-scale", required_argument, 0, O_FP8_SCALE}, {"fp8-ignore", required_argument, 0, O_FP8_IGNORE},
        {"threads", required_argument, 0, O_THREADS}, {"help", no_argument, 0, O_HELP}, {0, 0, 0, 0}};
    const char *prog = argv[0];
    int have_arch = 0;
    *o = (opts){.layers = 2, .hidden = 64, .heads = 4, .kv_heads = 2, .head_dim = 0, .intermediate = 128,
                .vocab = 256, .max_pos = 2048, .dtype = KVB_DTYPE_F32, .seed = 0, .shards = 1, .bos_id = 1,
                .max_window_layers = -1, .threads = (int)KVB_MAX(1, KVB_MIN(64, sysconf(_SC_NPROCESSORS_ONLN)))};
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        int r = 0;
        switch (c) {
        case O_ARCH: {
            int found = 0;
            for (int a = 0; a < (int)KVB_ARRAY_LEN(ARCH_TYPE); a++)
                if (!strcmp(optarg, ARCH_TYPE[a])) {
                    o->arch = (kvb_arch)a;
                    found = 1;
                }
            if (!found) {
                fprintf(stderr, "%s: --arch must be llama, mistral, qwen2 or qwen3, got \"%s\"\n", prog, optarg);
                return -1;
            }
            o->qwen3 = o->arch == KVB_ARCH_QWEN3;
            have_arch = 1;
            break;
        }
        case O_WINDOW: r = parse_int_opt(prog, "sliding-window", optarg, 1, 1 << 24, &o->sliding_window); break;
        case O_WINDOW_LAYERS: r = parse_int_opt(prog, "max-window-layers", optarg, 0, 1024, &o->max_window_layers); break;
        case O_ATTN_BIAS: o->attention_bias = 1; break;
        case O_MLP_BIAS: o->mlp_bias = 1; break;
        case O_LAYERS: r = parse_int_opt(prog, "layers", optarg, 1, 1024, &o->layers); break;
        case O_HIDDEN: r = parse_int_opt(prog, "hidden", optarg, 1, 1 << 16, &o->hidden); break;
        case O_HEADS: r = parse_int_opt(prog, "heads", optarg, 1, 1024, &o->heads); break;
        case O_KV: r = parse_int_opt(prog, "kv-heads", optarg, 1, 1024, &o->kv_heads); break;
        case O_HD: r = parse_int_opt(prog, "head-dim", optarg, 2, 1024, &o->head_dim); break;
        case O_FF: r = parse_int_opt(prog, "intermediate", optarg, 1, 1 << 18, &o->intermediate); break;
        case O_VOCAB:
            r = parse_int_opt(prog, "vocab", optarg, 3, 1 << 20, &o->vocab);
            o->vocab_given = 1;
            break;
        case O_TOKENIZER: o->tokenizer = optarg; break;
        case O_EOS:
            free(o->eos);
            o->eos = NULL;
            if (kvb_parse_id_list(optarg, &o->eos, &o->n_eos) != KVB_OK || o->n_eos > 8) {
                fprintf(stderr, "%s: --eos-ids wants at most 8 comma-separated token ids, got \"%s\"\n", prog, optarg);
                return -1;
            }
            break;
        case O_MAXPOS: r = parse_int_opt(prog, "max-pos", optarg, 1, 1 << 24, &o->max_pos); break;
        case O_SHARDS: r = parse_int_opt(prog, "shards", optarg, 1, 99999, &o->shards); break;
        case O_DTYPE:
            if (strcmp(optarg, "f32") && strcmp(optarg, "f16") && strcmp(optarg, "bf16")) {
                fprintf(stderr, "%s: --dtype must be f32, f16 or bf16, got \"%s\"\n", prog, optarg);
                return -1;
            }
            kvb_dtype_parse(optarg, &o->dtype);
            break;
        case O_SEED: {
            int64_t v;
            if (kvb_parse_i64(optarg, 0, INT64_MAX, &v) != KVB_OK) {
                fprintf(stderr, "%s: --seed wants a non-negative integer, got \"%s\"\n", prog, optarg);
                return -1;
            }
            o->seed = (uint64_t)v;
            break;
        }
        case O_TIE: o->tie = 1; break;
        case O_THREADS:
            if (parse_int_opt(prog, "threads", optarg, 1, 64, &o->threads)) return -1;
            break;
        case O_FP8:
            if (strcmp(optarg, "w8a16") && strcmp(optarg, "w8a8")) {
                fprintf(stderr, "%s: --fp8 must be w8a16 or w8a8, got \"%s\"\n", prog, optarg);
                return -1;
            }
            o->fp8 = strcmp(optarg, "w8a8") ? FP8_W8A16 : FP8_W8A8;
            break;
        case O_FP8_SCALE:
            if (strcmp(optarg, "channel") && strcmp(optarg, "tensor")) {
                fprintf(stderr, "%s: --fp8-scale must be channel or tensor, got \"%s\"\n", prog, optarg);
                return -1;
            }
            o->fp8_tensor = !strcmp(optarg, "tensor");
            break;
        case O_FP8_IGNORE:
            if (o->n_fp8_ignore == (int)KVB_ARRAY_LEN(o->fp8_ignore) - 1 || strlen(optarg) > 100 || strchr(optarg, '"') ||
                strchr(optarg, '\\')) {
                fprintf(stderr, "%s: --fp8-ignore: at most 7 entries of 100 characters, no quotes or backslashes\n", prog);
                return -1;
            }
            o->fp8_ignore[o->n_fp8_ignore++] = optarg;
            break;
        case O_SCALING:
            if (!strcmp(optarg, "llama3")) o->rope = ROPE_LLAMA3;
            else if (!strcmp(optarg, "linear")) o->rope = ROPE_LINEAR;
            else if (!strcmp(optarg, "yarn")) o->rope = ROPE_YARN;
            else {
                fprintf(stderr, "%s: --rope-scaling must be llama3, linear or yarn, got \"%s\"\n", prog, optarg);
                return -1;
            }
            break;
        case O_THETA:
            if (kvb_parse_f64(optarg, &o->rope_theta) != KVB_OK || !(o->rope_theta > 1.0)) {
                fprintf(stderr, "%s: --rope-theta wants a number > 1, got \"%s\"\n", prog, optarg);
                return -1;
            }
            break;
        case O_HELP: return 1;
        default:
            if (optopt >= O_ARCH) fprintf(stderr, "%s: option %s needs a value\n", prog, argv[optind - 1]);
            else if (optopt) fprintf(stderr, "%s: unknown option -%c\n", prog, optopt);
            else fprintf(stderr, "%s: unknown option %s\n", prog, argv[optind - 1]);
            return -1;
        }
        if (r) return -1;
    }
    if (!have_arch) {
        fprintf(stderr, "%s: --arch is required\n", prog);
        return -1;
    }
    if (optind != argc - 1) {
        fprintf(stderr, "%s: expected exactly one OUTDIR\n", prog);
        return -1;
    }
    o->outdir = argv[optind];
    if (!o->head_dim) {
        if (o->hidden % o->heads != 0 || (o->hidden / o->heads) % 2 != 0 || o->hidden / o->heads < 2) {
            fprintf(stderr, "%s: hidden/heads = %d/%d is not an even integer; give --head-dim\n", prog, o->hidden,
                    o->heads);
            return -1;
        }
        o->head_dim = o->hidden / o->heads;
    }
    if (o->head_dim % 2 != 0) {
        fprintf(stderr, "%s: --head-dim must be even\n", prog);
        return -1;
    }
    if (o->heads % o->kv_heads != 0) {
        fprintf(stderr, "%s: --kv-heads %d does not divide --heads %d\n", prog, o->kv_heads, o->heads);
        return -1;
    }
    if (o->attention_bias && o->arch != KVB_ARCH_LLAMA && o->arch != KVB_ARCH_QWEN3) {
        fprintf(stderr, "%s: --attention-bias is a llama / qwen3 option (qwen2 always has q/k/v biases, mistral "
                        "none)\n", prog);
        return -1;
    }
    if (o->mlp_bias && o->arch != KVB_ARCH_LLAMA) {
        fprintf(stderr, "%s: --mlp-bias is a llama option\n", prog);
        return -1;
    }
    if (o->sliding_window && o->arch == KVB_ARCH_LLAMA) {
        fprintf(stderr, "%s: --sliding-window needs --arch mistral, qwen2 or qwen3 (Llama has none)\n", prog);
        return -1;
    }
    if (o->max_window_layers >= 0 && (!o->sliding_window || (o->arch != KVB_ARCH_QWEN2 && !o->qwen3))) {
        fprintf(stderr, "%s: --max-window-layers goes with --sliding-window on qwen2 / qwen3\n", prog);
        return -1;
    }
    if ((o->fp8_tensor || o->n_fp8_ignore) && !o->fp8) {
        fprintf(stderr, "%s: --fp8-scale and --fp8-ignore go with --fp8\n", prog);
        return -1;
    }
    if (!o->rope_theta) o->rope_theta = o->arch == KVB_ARCH_LLAMA ? 10000.0 : 1000000.0;
    if (!o->eos && !o->tokenizer) {
        static int32_t two = 2;
        o->eos = malloc(sizeof two);
        if (!o->eos) return -1;
        o->eos[0] = two;
        o->n_eos = 1;
    }
    int n_tensors = 1 + o->layers * layer_tensor_count(o) + 1 + !o->tie;
    if (o->shards > n_tensors) {
        fprintf(stderr, "%s: --shards %d exceeds the %d tensors of this model\n", prog, o->shards, n_tensors);
        return -1;
    }
    return 0;
}

/* Copies DIR/name into OUTDIR (a missing optional file is skipped). */
static kvb_status copy_file(const char *dir, const char *outdir, const char *name, int optional) {
    char src[PATH_MAX], dst[PATH_MAX];
    if (snprintf(src, sizeof src, "%s/%s", dir, name) >= (int)sizeof src ||
        snprintf(dst, sizeof dst, "%s/%s", outdir, name) >= (int)sizeof dst)
        return KVB_ERR_INVALID;
    FILE *in = fopen(src, "rb");
    if (!in) {
        if (optional && errno == ENOENT) return KVB_OK;
        KVB_LOG_E("%s: cannot read: %s", src, strerror(errno));
        return KVB_ERR_IO;
    }
    FILE *out = fopen(dst, "wb");
    if (!out) {
        fclose(in);
        KVB_LOG_E("%s: cannot create: %s", dst, strerror(errno));
        return KVB_ERR_IO;
    }
    char buf[1 << 16];
    size_t n;
    int bad = 0;
    while ((n = fread(buf, 1, sizeof buf, in)) > 0) bad |= fwrite(buf, 1, n, out) != n;
    bad |= ferror(in);
    fclose(in);
    bad |= fclose(out) != 0;
    if (bad) {
        KVB_LOG_E("%s: copy to %s failed", src, dst);
        return KVB_ERR_IO;
    }
    return KVB_OK;
}

/* --tokenizer: the vocabulary size, BOS and EOS ids from the tokenizer, and its files copied. */
static kvb_status take_tokenizer(opts *o) {
    kvb_tokenizer *t;
    KVB_TRY(kvb_tokenizer_load(o->tokenizer, &t));
    kvb_status st = KVB_OK;
    int n = kvb_tokenizer_vocab_size(t);
    if (o->vocab_given && o->vocab < n) {
        KVB_LOG_E("--vocab %d is smaller than the tokenizer's %d tokens", o->vocab, n);
        st = KVB_ERR_INVALID;
        goto done;
    }
    if (!o->vocab_given) o->vocab = n;
    o->bos_id = kvb_tokenizer_bos_id(t);
    if (!o->eos) { /* the tokenizer's EOS ids, then the end-of-turn tokens chat templates close turns with */
        static const char *const turn_ends[] = {"<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>"};
        const int32_t *ids;
        int k = kvb_tokenizer_eos_ids(t, &ids);
        KVB_TRY_GOTO(kvb_calloc((size_t)k + KVB_ARRAY_LEN(turn_ends), sizeof *o->eos, (void **)&o->eos), done);
        for (int i = 0; i < k; i++) o->eos[o->n_eos++] = ids[i];
        for (size_t i = 0; i < KVB_ARRAY_LEN(turn_ends); i++) {
            int32_t id = kvb_tokenizer_token_id(t, turn_ends[i]);
            int seen = id < 0 || !kvb_tokenizer_is_special(t, id);
            for (int j = 0; j < o->n_eos; j++) seen |= o->eos[j] == id;
            if (!seen) o->eos[o->n_eos++] = id;
        }
        if (!o->n_eos) {
            KVB_LOG_E("%s: the tokenizer names no EOS token; give --eos-ids", o->tokenizer);
            st = KVB_ERR_INVALID;
            goto done;
        }
    }
    KVB_TRY_GOTO(copy_file(o->tokenizer, o->outdir, "tokenizer.json", 0), done);
    KVB_TRY_GOTO(copy_file(o->tokenizer, o->outdir, "tokenizer_config.json", 1), done);
    KVB_TRY_GOTO(copy_file(o->tokenizer, o->outdir, "chat_template.jinja", 1), done);
    KVB_TRY_GOTO(copy_file(o->tokenizer, o->outdir, "special_tokens_map.json", 1), done);
done:
    kvb_tokenizer_destroy(t);
    return st;
}

/* generation_config.json as transformers writes it (sorted keys, indent 2). */
static kvb_status write_generation_config(const opts *o) {
    char path[PATH_MAX], eos[200];
    if (snprintf(path, sizeof path, "%s/generation_config.json", o->outdir) >= (int)sizeof path) return KVB_ERR_INVALID;
    FILE *f = fopen(path, "w");
    if (!f) {
        KVB_LOG_E("%s: cannot create: %s", path, strerror(errno));
        return KVB_ERR_IO;
    }
    eos_json(o, eos, sizeof eos);
    if (o->bos_id >= 0) fprintf(f, "{\n  \"bos_token_id\": %d,\n  \"eos_token_id\": %s\n}\n", o->bos_id, eos);
    else fprintf(f, "{\n  \"eos_token_id\": %s\n}\n", eos);
    if (ferror(f) | (fclose(f) != 0)) {
        KVB_LOG_E("%s: write failed", path);
        return KVB_ERR_IO;
    }
    return KVB_OK;
}

int main(int argc, char **argv) {
    kvb_prog_init(argc, argv, "kvbank-mkmodel");
    opts o;
    int r = parse_args(argc, argv, &o);
    if (r == 1) {
        usage(stdout, argv[0]);
        return 0;
    }
    if (r < 0) {
        usage(stderr, argv[0]);
        return 2;
    }
    if (mkdir(o.outdir, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "%s: cannot create %s: %s\n", argv[0], o.outdir, strerror(errno));
        return 1;
    }
    tensor_list l = {0};
    kvb_status st;
    if (o.tokenizer) {
        KVB_TRY_GOTO(take_tokenizer(&o), fail_list);
        KVB_TRY_GOTO(write_generation_config(&o), fail_list);
    }
    for (int i = 0; i < o.n_eos; i++)
        if (o.eos[i] >= o.vocab) {
            fprintf(stderr, "%s: EOS id %d is not below the vocabulary size %d\n", argv[0], o.eos[i], o.vocab);
            st = KVB_ERR_INVALID;
            goto fail_list;
        }
    KVB_TRY_GOTO(build_list(&o, &l), fail_list);
    KVB_TRY_GOTO(fill(&o, &l), fail_list);
    if (o.fp8) KVB_TRY_GOTO(quantize_fp8(&o, &l), fail_list);
    KVB_TRY_GOTO(write_weights(&o, &l), fail_list);
    KVB_TRY_GOTO(write_config(&o), fail_list);
    list_free(&l);
    free(o.eos);
    return 0;
fail_list:
    list_free(&l);
    free(o.eos);
    fprintf(stderr, "%s: failed to write the model to %s: %s\n", argv[0], o.outdir, kvb_status_str(st));
    return 1;
}
