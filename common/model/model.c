/* kvbank — loading a Hugging Face model directory onto a backend (the forward pass is forward.c). */
#include "common/model/model_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/model/safetensors.h"
#include "common/util/progress.h"

/* Frees one weight if it was loaded. */
static void weight_free(kvb_backend *be, kvb_tensor *t) {
    if (t->data) be->iface->weight_free(be->ctx, t);
    memset(t, 0, sizeof *t);
}

static void format_shape(char *buf, size_t cap, int n_dims, const int64_t *shape) {
    int o = snprintf(buf, cap, "[");
    for (int i = 0; i < n_dims && o > 0 && (size_t)o < cap; i++)
        o += snprintf(buf + o, cap - (size_t)o, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (o > 0 && (size_t)o < cap) snprintf(buf + o, cap - (size_t)o, "]");
}

/* Finds `name`, checks it is exactly [rows] (cols == 0: a vector) or [rows][cols], and loads it onto the
 * backend as a [rows][cols or 1] weight, in place where the backend can (*viewed = 1: `set` must stay
 * open while the weight lives). Errors name the tensor and both shapes. */
/* Finds `name` and checks it is exactly [rows] (cols == 0: a vector) or [rows][cols]; errors name the
 * tensor and both shapes. Reads only the header (nothing of the tensor's data). */
static kvb_status find_weight(const kvb_st_set *set, const char *name, int64_t rows, int64_t cols,
                              const kvb_st_tensor **out) {
    const kvb_st_tensor *t = kvb_st_find(set, name);
    if (!t) {
        KVB_LOG_E("model: tensor \"%s\" is missing", name);
        return KVB_ERR_NOT_FOUND;
    }
    const int want_dims = cols ? 2 : 1;
    const int64_t want[2] = {rows, cols};
    int ok = t->n_dims == want_dims && t->shape[0] == rows && (!cols || t->shape[1] == cols);
    if (!ok) {
        char e[64], a[128];
        format_shape(e, sizeof e, want_dims, want);
        format_shape(a, sizeof a, t->n_dims, t->shape);
        KVB_LOG_E("model: tensor \"%s\" has shape %s, expected %s", name, a, e);
        return KVB_ERR_INVALID;
    }
    *out = t;
    return KVB_OK;
}

/* The checks of an FP8 weight `t` called `wname` ("X.weight") without reading its data: F8_E4M3, and its
 * scale "X.weight_scale" there with one value ([], [1], [1, 1]) or one per output row ([rows], [rows, 1])
 * as `per_channel` says, in f32, bf16 or f16 (*scale_out). Errors name the tensor. */
static kvb_status find_fp8(const kvb_st_set *set, const char *wname, const kvb_st_tensor *t, int per_channel,
                           const kvb_st_tensor **scale_out) {
    if (t->dtype != KVB_DTYPE_F8_E4M3) {
        KVB_LOG_E("model: tensor \"%s\" is %s, but quantization_config makes it an FP8 (F8_E4M3) weight", wname,
                  kvb_dtype_name(t->dtype));
        return KVB_ERR_INVALID;
    }
    char name[160];
    snprintf(name, sizeof name, "%s_scale", wname);
    const kvb_st_tensor *sc = kvb_st_find(set, name);
    if (!sc) {
        KVB_LOG_E("model: tensor \"%s\" is missing (the scale of FP8 weight \"%s\")", name, wname);
        return KVB_ERR_NOT_FOUND;
    }
    int64_t n = 1, want = per_channel ? t->shape[0] : 1;
    for (int i = 0; i < sc->n_dims; i++) n *= sc->shape[i];
    int ok = n == want && sc->n_dims <= 2 && (sc->n_dims < 1 || sc->shape[0] == want) && sc->dtype != KVB_DTYPE_F8_E4M3;
    if (!ok) {
        char a[128];
        format_shape(a, sizeof a, sc->n_dims, sc->shape);
        KVB_LOG_E("model: tensor \"%s\" is %s %s, expected %lld f32/bf16/f16 values (a scale per %s)", name,
                  kvb_dtype_name(sc->dtype), a, (long long)want, per_channel ? "output channel" : "tensor");
        return KVB_ERR_INVALID;
    }
    *scale_out = sc;
    return KVB_OK;
}

/* Tensor `t`'s n values widened to f32 into *out (caller frees): positive and finite, else an error
 * naming `name`. */
static kvb_status read_scales(const kvb_st_tensor *t, const char *name, int64_t n, float **out) {
    KVB_TRY(kvb_malloc((size_t)n * sizeof(float), (void **)out));
    for (int64_t i = 0; i < n; i++) {
        float v;
        if (t->dtype == KVB_DTYPE_F32) {
            memcpy(&v, (const char *)t->data + 4 * i, 4);
        } else {
            uint16_t h;
            memcpy(&h, (const char *)t->data + 2 * i, 2);
            v = t->dtype == KVB_DTYPE_BF16 ? kvb_bf16_to_f32(h) : kvb_f16_to_f32(h);
        }
        if (!(v > 0.0f) || !isfinite(v)) {
            KVB_LOG_E("model: %s_scale[%lld] = %g is not a positive finite scale", name, (long long)i, v);
            free(*out);
            *out = NULL;
            return KVB_ERR_INVALID;
        }
        (*out)[i] = v;
    }
    return KVB_OK;
}

/* Loads the FP8 weight `t` (named `name`) with its scale onto the backend (quant.h's scheme `q`). */
static kvb_status load_fp8(kvb_backend *be, const kvb_st_set *set, const kvb_quant_config *q, const char *name,
                           const kvb_st_tensor *t, kvb_tensor *dst) {
    const kvb_st_tensor *sc = NULL;
    KVB_TRY(find_fp8(set, name, t, q->per_channel, &sc));
    if (!be->iface->weight_fp8) {
        KVB_LOG_E("model: backend %s does not run FP8 checkpoints (tensor \"%s\")", be->iface->name, name);
        return KVB_ERR_UNSUPPORTED;
    }
    float *scale = NULL;
    int64_t n_scale = q->per_channel ? t->shape[0] : 1;
    KVB_TRY(read_scales(sc, name, n_scale, &scale));
    kvb_fp8_weight src = {.data = t->data, .rows = t->shape[0], .cols = t->shape[1], .scale = scale,
                          .n_scale = n_scale, .act = q->act_token ? KVB_ACT_FP8_TOKEN : KVB_ACT_NONE};
    kvb_status st = be->iface->weight_fp8(be->ctx, &src, dst);
    free(scale);
    return st;
}

/* Loads one weight (`fp8`: a linear layer quantization_config quantizes); adds its file bytes to the
 * load's progress line. */
static kvb_status load_weight(kvb_backend *be, const kvb_st_set *set, const char *name, int64_t rows, int64_t cols,
                              int fp8, const kvb_quant_config *q, kvb_tensor *dst, int *viewed, kvb_progress *pg) {
    const kvb_st_tensor *t = NULL;
    KVB_TRY(find_weight(set, name, rows, cols, &t));
    kvb_progress_update(pg, pg->done + t->nbytes);
    if (!fp8 && t->dtype == KVB_DTYPE_F8_E4M3) {
        KVB_LOG_E("model: tensor \"%s\" is F8_E4M3, but quantization_config does not quantize it", name);
        return KVB_ERR_INVALID;
    }
    if (fp8) {
        kvb_status st = load_fp8(be, set, q, name, t, dst);
        if (st != KVB_OK) {
            KVB_LOG_E("model: FP8 tensor \"%s\" not loaded (%s)", name, kvb_status_str(st));
            memset(dst, 0, sizeof *dst);
            return st;
        }
        if (dst->view) {
            kvb_st_prefault(t);
            *viewed = 1;
        } else {
            kvb_st_release(t);
        }
        return KVB_OK;
    }
    /* Where the backend can compute on the mapped bytes as they are, they are the weight (one copy in
     * memory: the file's page cache); otherwise the backend copies and converts them, and the mapped
     * pages are dropped at once so the mapping does not stay resident beside the copy. */
    kvb_status st = KVB_ERR_UNSUPPORTED;
    if (be->iface->weight_view) st = be->iface->weight_view(be->ctx, t->data, t->dtype, rows, cols ? cols : 1, dst);
    if (st == KVB_OK) {
        kvb_st_prefault(t);
        *viewed = 1;
        return KVB_OK;
    }
    if (st == KVB_ERR_UNSUPPORTED) {
        st = be->iface->weight_load(be->ctx, t->data, t->dtype, rows, cols ? cols : 1, dst);
        kvb_st_release(t);
    }
    if (st != KVB_OK) {
        KVB_LOG_E("model: backend %s could not load tensor \"%s\" (%s)", be->iface->name, name, kvb_status_str(st));
        memset(dst, 0, sizeof *dst);
        return st;
    }
    return KVB_OK;
}

/* The tensors of layer l that this architecture has: suffix under model.layers.l., destination and
 * shape (cols 0: a vector). Returns the count written to spec. */
typedef struct layer_tensor {
    const char *suffix;
    kvb_tensor *dst;
    int64_t rows, cols;
    int proj; /* kvb_proj of a linear layer's weight, -1 for the rest */
} layer_tensor;

static int layer_spec(const kvb_model_config *c, kvb_layer_weights *w, layer_tensor spec[18]) {
    const int64_t h = c->hidden, q = (int64_t)c->n_heads * c->head_dim, kv = (int64_t)c->n_kv_heads * c->head_dim;
    const int64_t ff = c->intermediate;
    int n = 0;
#define T(s, d, r, cl) (spec[n++] = (layer_tensor){(s), (d), (r), (cl), -1})
#define P(s, d, r, cl, p) (spec[n++] = (layer_tensor){(s), (d), (r), (cl), (p)})
    T("input_layernorm.weight", &w->attn_norm, h, 0);
    P("self_attn.q_proj.weight", &w->wq, q, h, KVB_PROJ_Q);
    P("self_attn.k_proj.weight", &w->wk, kv, h, KVB_PROJ_K);
    P("self_attn.v_proj.weight", &w->wv, kv, h, KVB_PROJ_V);
    P("self_attn.o_proj.weight", &w->wo, h, q, KVB_PROJ_O);
    if (c->qkv_bias) {
        T("self_attn.q_proj.bias", &w->bq, q, 0);
        T("self_attn.k_proj.bias", &w->bk, kv, 0);
        T("self_attn.v_proj.bias", &w->bv, kv, 0);
    }
    if (c->o_bias) T("self_attn.o_proj.bias", &w->bo, h, 0);
    if (c->arch == KVB_ARCH_QWEN3) {
        T("self_attn.q_norm.weight", &w->q_norm, c->head_dim, 0);
        T("self_attn.k_norm.weight", &w->k_norm, c->head_dim, 0);
    }
    T("post_attention_layernorm.weight", &w->ffn_norm, h, 0);
    P("mlp.gate_proj.weight", &w->w_gate, ff, h, KVB_PROJ_GATE);
    P("mlp.up_proj.weight", &w->w_up, ff, h, KVB_PROJ_UP);
    P("mlp.down_proj.weight", &w->w_down, h, ff, KVB_PROJ_DOWN);
    if (c->mlp_bias) {
        T("mlp.gate_proj.bias", &w->b_gate, ff, 0);
        T("mlp.up_proj.bias", &w->b_up, ff, 0);
        T("mlp.down_proj.bias", &w->b_down, h, 0);
    }
#undef T
#undef P
    return n;
}

static kvb_status load_layer(kvb_model *m, const kvb_st_set *set, int l, kvb_progress *pg) {
    layer_tensor spec[18];
    int n = layer_spec(&m->cfg, &m->layers[l], spec);
    for (int i = 0; i < n; i++) {
        char name[128];
        snprintf(name, sizeof name, "model.layers.%d.%s", l, spec[i].suffix);
        int fp8 = spec[i].proj >= 0 && kvb_quant_is_quantized(&m->cfg.quant, l, spec[i].proj);
        KVB_TRY(load_weight(m->be, set, name, spec[i].rows, spec[i].cols, fp8, &m->cfg.quant, spec[i].dst,
                            &m->weights_mapped, pg));
    }
    return KVB_OK;
}

/* The tensors a checkpoint of this architecture holds (for the "unused tensor" warning): the weights and
 * the scales of the FP8 ones. */
static int64_t expected_tensor_count(const kvb_model_config *c) {
    kvb_layer_weights w;
    layer_tensor spec[18];
    int64_t n = 2 + (c->tie_embeddings ? 0 : 1) + kvb_quant_is_quantized(&c->quant, 0, KVB_PROJ_COUNT);
    for (int l = 0; l < c->n_layers; l++) {
        int k = layer_spec(c, &w, spec);
        n += k;
        for (int i = 0; i < k; i++) n += spec[i].proj >= 0 && kvb_quant_is_quantized(&c->quant, l, spec[i].proj);
    }
    return n;
}

static void free_weights(kvb_model *m) {
    kvb_backend *be = m->be;
    if (m->layers) {
        for (int l = 0; l < m->cfg.n_layers; l++) {
            kvb_layer_weights *w = &m->layers[l];
            kvb_tensor *all[] = KVB_LAYER_TENSORS(w);
            for (size_t i = 0; i < KVB_ARRAY_LEN(all); i++) weight_free(be, all[i]);
        }
    }
    if (!m->lm_head_tied) weight_free(be, &m->lm_head);
    memset(&m->lm_head, 0, sizeof m->lm_head);
    weight_free(be, &m->final_norm);
    weight_free(be, &m->embed);
}

kvb_status kvb_model_load(const char *dir, kvb_backend *be, kvb_model **out) {
    kvb_status st;
    if (!dir || !be || !out) return KVB_ERR_INVALID;
    kvb_model *m = NULL;
    kvb_st_set *set = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *m, (void **)&m));
    m->be = be;
    KVB_TRY_GOTO(kvb_model_config_load(dir, &m->cfg), fail_model);
    const kvb_model_config *c = &m->cfg;
    KVB_TRY_GOTO(kvb_st_open_dir(dir, &set), fail_model);
    KVB_TRY_GOTO(kvb_calloc((size_t)c->n_layers, sizeof *m->layers, (void **)&m->layers), fail_set);
    KVB_TRY_GOTO(kvb_calloc((size_t)(c->head_dim / 2), sizeof *m->inv_freq, (void **)&m->inv_freq), fail_layers);

    /* a progress line on a terminal (common/util/progress.h): large checkpoints take a while */
    kvb_progress pg;
    uint64_t total = 0;
    for (int i = 0; i < kvb_st_count(set); i++) total += kvb_st_at(set, i)->nbytes;
    char what[128];
    snprintf(what, sizeof what, "loading %s", dir);
    kvb_progress_begin(&pg, what, total, KVB_PROGRESS_BYTES);
    KVB_TRY_GOTO(load_weight(be, set, "model.embed_tokens.weight", c->vocab, c->hidden, 0, &c->quant, &m->embed,
                             &m->weights_mapped, &pg), fail_weights);
    for (int l = 0; l < c->n_layers; l++) KVB_TRY_GOTO(load_layer(m, set, l, &pg), fail_weights);
    KVB_TRY_GOTO(load_weight(be, set, "model.norm.weight", c->hidden, 0, 0, &c->quant, &m->final_norm,
                             &m->weights_mapped, &pg), fail_weights);
    if (c->tie_embeddings) {
        if (kvb_st_find(set, "lm_head.weight"))
            KVB_LOG_W("%s: tie_word_embeddings is true; lm_head.weight is ignored (the embedding is used)", dir);
        m->lm_head = m->embed;
        m->lm_head_tied = 1;
    } else {
        KVB_TRY_GOTO(load_weight(be, set, "lm_head.weight", c->vocab, c->hidden,
                                 kvb_quant_is_quantized(&c->quant, 0, KVB_PROJ_COUNT), &c->quant, &m->lm_head,
                                 &m->weights_mapped, &pg), fail_weights);
    }
    kvb_progress_end(&pg);
    int64_t expected = expected_tensor_count(c) + (c->tie_embeddings && kvb_st_find(set, "lm_head.weight"));
    if (kvb_st_count(set) > expected)
        KVB_LOG_W("%s: %lld tensors in the checkpoint are not used", dir, (long long)(kvb_st_count(set) - expected));

    kvb_model_config_rope_inv_freq(c, m->inv_freq);
    m->rope.head_dim = c->head_dim;
    m->rope.inv_freq = m->inv_freq;
    if (m->weights_mapped) m->weights_file = set; /* weights in place: the mapping lives with the model */
    else kvb_st_close(set);                        /* the backend holds its own copies */
    KVB_LOG_I("%s: loaded %s, %d layers, hidden %d, %d/%d heads of %d, vocab %d, %lld parameters on %s%s", dir,
              kvb_arch_name(c->arch), c->n_layers, c->hidden, c->n_heads, c->n_kv_heads,
              c->head_dim, c->vocab, (long long)kvb_model_n_params(m), be->iface->name,
              m->weights_mapped ? " (weights used in place from the mapped files)" : "");
    *out = m;
    return KVB_OK;

fail_weights:
    kvb_progress_cancel(&pg);
    free_weights(m);
    free(m->inv_freq);
fail_layers:
    free(m->layers);
fail_set:
    kvb_st_close(set);
fail_model:
    KVB_LOG_E("%s: model not loaded (%s)", dir, kvb_status_str(st));
    free(m);
    return st;
}

/* Tensor `t` is FP8 (with its scale) exactly when quantization_config quantizes it (`fp8`). */
static kvb_status check_dtype(const kvb_st_set *set, const kvb_model_config *c, const char *name,
                              const kvb_st_tensor *t, int fp8) {
    const kvb_st_tensor *sc;
    if (fp8) return find_fp8(set, name, t, c->quant.per_channel, &sc);
    if (t->dtype == KVB_DTYPE_F8_E4M3) {
        KVB_LOG_E("model: tensor \"%s\" is F8_E4M3, but quantization_config does not quantize it", name);
        return KVB_ERR_INVALID;
    }
    return KVB_OK;
}

kvb_status kvb_model_check(const char *dir, kvb_model_config *cfg_out) {
    if (!dir) return KVB_ERR_INVALID;
    kvb_model_config c;
    kvb_st_set *set = NULL;
    const kvb_st_tensor *t = NULL;
    kvb_status st;
    KVB_TRY_GOTO(kvb_model_config_load(dir, &c), fail);
    KVB_TRY_GOTO(kvb_st_open_dir(dir, &set), fail);
    KVB_TRY_GOTO(find_weight(set, "model.embed_tokens.weight", c.vocab, c.hidden, &t), fail_set);
    for (int l = 0; l < c.n_layers; l++) {
        kvb_layer_weights w;
        layer_tensor spec[18];
        int n = layer_spec(&c, &w, spec);
        for (int i = 0; i < n; i++) {
            char name[128];
            snprintf(name, sizeof name, "model.layers.%d.%s", l, spec[i].suffix);
            KVB_TRY_GOTO(find_weight(set, name, spec[i].rows, spec[i].cols, &t), fail_set);
            KVB_TRY_GOTO(check_dtype(set, &c, name, t, spec[i].proj >= 0 && kvb_quant_is_quantized(&c.quant, l, spec[i].proj)), fail_set);
        }
    }
    KVB_TRY_GOTO(find_weight(set, "model.norm.weight", c.hidden, 0, &t), fail_set);
    if (!c.tie_embeddings) {
        KVB_TRY_GOTO(find_weight(set, "lm_head.weight", c.vocab, c.hidden, &t), fail_set);
        KVB_TRY_GOTO(check_dtype(set, &c, "lm_head.weight", t, kvb_quant_is_quantized(&c.quant, 0, KVB_PROJ_COUNT)), fail_set);
    }
    kvb_st_close(set);
    if (cfg_out) *cfg_out = c;
    return KVB_OK;

fail_set:
    kvb_st_close(set);
fail:
    KVB_LOG_E("%s: not a loadable model (%s)", dir, kvb_status_str(st));
    return st;
}

void kvb_model_destroy(kvb_model *m) {
    if (!m) return;
    free_weights(m);
    kvb_st_close(m->weights_file);
    free(m->layers);
    free(m->inv_freq);
    free(m);
}

const kvb_model_config *kvb_model_cfg(const kvb_model *m) { return &m->cfg; }

kvb_backend *kvb_model_backend(const kvb_model *m) { return m->be; }

kvb_kv_geom kvb_model_kv_geom(const kvb_model *m, int block_size) {
    int es = 0; /* a backend's own name is always known; 0 makes kvb_kv_geom_check refuse it otherwise */
    (void)kvb_model_kv_elem_size(m->be->iface->name, &es);
    kvb_kv_geom g = {
        .n_layers = m->cfg.n_layers,
        .n_kv_heads = m->cfg.n_kv_heads,
        .head_dim = m->cfg.head_dim,
        .block_size = block_size,
        .elem_size = es,
    };
    return g;
}

static int64_t layer_params(const kvb_model_config *c) {
    kvb_layer_weights w;
    layer_tensor spec[18];
    int n = layer_spec(c, &w, spec);
    int64_t p = 0;
    for (int i = 0; i < n; i++) p += spec[i].rows * (spec[i].cols ? spec[i].cols : 1);
    return p;
}

/* Counts a tied embedding once, as transformers' num_parameters() does. */
int64_t kvb_model_n_params(const kvb_model *m) {
    const kvb_model_config *c = &m->cfg;
    int64_t n = (int64_t)c->vocab * c->hidden + c->n_layers * layer_params(c) + c->hidden;
    if (!m->lm_head_tied) n += (int64_t)c->vocab * c->hidden;
    return n;
}

static int64_t tensor_bytes(const kvb_tensor *t) {
    return t->data ? t->ne[0] * t->ne[1] * (int64_t)kvb_dtype_size(t->dtype) + t->n_scale * (int64_t)sizeof(float) : 0;
}

int64_t kvb_model_weight_bytes(const kvb_model *m) {
    return kvb_model_weight_bytes_per_token(m) + (m->lm_head_tied ? 0 : tensor_bytes(&m->embed));
}

/* Everything one decode step reads: every layer's matrices and norms, the final norm and the LM head
 * (the whole embedding table when tied), in the dtype the backend stores them. */
int64_t kvb_model_weight_bytes_per_token(const kvb_model *m) {
    int64_t b = tensor_bytes(&m->final_norm) + tensor_bytes(&m->lm_head);
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const kvb_layer_weights *w = &m->layers[l];
        const kvb_tensor *all[] = KVB_LAYER_TENSORS(w);
        for (size_t i = 0; i < KVB_ARRAY_LEN(all); i++) b += tensor_bytes(all[i]);
    }
    return b;
}
