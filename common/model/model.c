/* kvbank — loading a Hugging Face model directory onto a backend (the forward pass is forward.c). */
#include "common/model/model_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/model/check.h"
#include "common/model/safetensors.h"
#include "common/util/progress.h"

/* Frees one weight if it was loaded. */
static void weight_free(kvb_backend *be, kvb_tensor *t) {
    if (t->data) be->iface->weight_free(be->ctx, t);
    memset(t, 0, sizeof *t);
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
    KVB_TRY(kvb_model_find_fp8(set, name, t, q->per_channel, &sc));
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
    KVB_TRY(kvb_model_find_weight(set, name, rows, cols, &t));
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

/* Loads the spec entries `idx` (same cols) of layer l stacked into one weight `dst` (weight_load_stacked). */
static kvb_status load_stacked(kvb_model *m, const kvb_st_set *set, int l, const kvb_layer_tensor_spec *spec,
                               const int *idx, int n, kvb_tensor *dst, kvb_progress *pg) {
    const kvb_st_tensor *t[3];
    const void *src[3];
    kvb_dtype dt[3];
    int64_t rows[3];
    for (int i = 0; i < n; i++) {
        char name[128];
        snprintf(name, sizeof name, "model.layers.%d.%s", l, spec[idx[i]].suffix);
        KVB_TRY(kvb_model_find_weight(set, name, spec[idx[i]].rows, spec[idx[i]].cols, &t[i]));
        kvb_progress_update(pg, pg->done + t[i]->nbytes);
        src[i] = t[i]->data;
        dt[i] = t[i]->dtype;
        rows[i] = spec[idx[i]].rows;
    }
    int64_t cols = spec[idx[0]].cols ? spec[idx[0]].cols : 1;
    kvb_status st = m->be->iface->weight_load_stacked(m->be->ctx, src, dt, rows, n, cols, dst);
    for (int i = 0; i < n; i++) kvb_st_release(t[i]);
    if (st != KVB_OK) {
        KVB_LOG_E("model: backend %s could not load layer %d's %s and the %d after it stacked (%s)", m->be->iface->name,
                  l, spec[idx[0]].suffix, n - 1, kvb_status_str(st));
        memset(dst, 0, sizeof *dst);
    }
    return st;
}

static kvb_status load_layer(kvb_model *m, const kvb_st_set *set, int l, kvb_progress *pg) {
    kvb_layer_tensor_spec spec[KVB_LT_COUNT];
    kvb_layer_weights *w = &m->layers[l];
    kvb_tensor *dst[] = KVB_LAYER_TENSORS(w); /* indexed by kvb_layer_tensor_id */
    _Static_assert(KVB_ARRAY_LEN(dst) == KVB_LT_COUNT, "KVB_LAYER_TENSORS and kvb_layer_tensor_id differ");
    int n = kvb_model_layer_spec(&m->cfg, spec);
    /* a backend that runs the projections sharing an input as one product gets them stacked: q/k/v,
     * their biases, and gate/up (unless they have biases, which the fused SiLU-mul does not add) */
    struct {
        kvb_layer_tensor_id part[3];
        kvb_tensor *dst;
        int n;
    } stacks[] = {{{KVB_LT_WQ, KVB_LT_WK, KVB_LT_WV}, &w->wqkv, 3},
                  {{KVB_LT_BQ, KVB_LT_BK, KVB_LT_BV}, &w->bqkv, 3},
                  {{KVB_LT_W_GATE, KVB_LT_W_UP}, &w->w_gu, m->cfg.mlp_bias ? 0 : 2}};
    int fused = m->be->iface->weight_load_stacked != NULL;
    /* FP8 weights load one by one (weight_fp8): a stack with an FP8 part stays separate, and the q/k/v
     * biases with their products */
    for (int s = 0; fused && s < 3; s++)
        for (int j = 0; j < stacks[s].n; j++) {
            int p = kvb_model_layer_proj(stacks[s].part[j]);
            if (p >= 0 && kvb_quant_is_quantized(&m->cfg.quant, l, p)) stacks[s].n = 0;
        }
    if (!stacks[0].n) stacks[1].n = 0;
    int idx[3][3], found[3] = {0, 0, 0};
    for (int i = 0; i < n; i++) {
        int in_stack = 0;
        for (int s = 0; fused && s < 3; s++)
            for (int j = 0; j < stacks[s].n; j++)
                if (spec[i].id == stacks[s].part[j]) {
                    idx[s][j] = i;
                    found[s]++;
                    in_stack = 1;
                }
        if (in_stack) continue;
        char name[128];
        snprintf(name, sizeof name, "model.layers.%d.%s", l, spec[i].suffix);
        int p = kvb_model_layer_proj(spec[i].id);
        int fp8 = p >= 0 && kvb_quant_is_quantized(&m->cfg.quant, l, p);
        KVB_TRY(load_weight(m->be, set, name, spec[i].rows, spec[i].cols, fp8, &m->cfg.quant, dst[spec[i].id],
                            &m->weights_mapped, pg));
    }
    for (int s = 0; fused && s < 3; s++)
        if (stacks[s].n && found[s] == stacks[s].n)
            KVB_TRY(load_stacked(m, set, l, spec, idx[s], stacks[s].n, stacks[s].dst, pg));
    return KVB_OK;
}

/* The tensors a checkpoint of this architecture holds (for the "unused tensor" warning): the weights and
 * the scales of the FP8 ones. */
static int64_t expected_tensor_count(const kvb_model_config *c) {
    kvb_layer_tensor_spec spec[KVB_LT_COUNT];
    int64_t n = 2 + (c->tie_embeddings ? 0 : 1) + kvb_quant_is_quantized(&c->quant, 0, KVB_PROJ_COUNT);
    for (int l = 0; l < c->n_layers; l++) {
        int k = kvb_model_layer_spec(c, spec);
        n += k;
        for (int i = 0; i < k; i++) {
            int p = kvb_model_layer_proj(spec[i].id);
            n += p >= 0 && kvb_quant_is_quantized(&c->quant, l, p);
        }
    }
    return n;
}

static void free_weights(kvb_model *m) {
    kvb_backend *be = m->be;
    if (m->layers) {
        for (int l = 0; l < m->cfg.n_layers; l++) {
            kvb_layer_weights *w = &m->layers[l];
            kvb_tensor *all[] = KVB_LAYER_TENSORS(w), *stacked[] = KVB_LAYER_STACKED(w);
            for (size_t i = 0; i < KVB_ARRAY_LEN(all); i++) weight_free(be, all[i]);
            for (size_t i = 0; i < KVB_ARRAY_LEN(stacked); i++) weight_free(be, stacked[i]);
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
    kvb_layer_tensor_spec spec[KVB_LT_COUNT];
    int n = kvb_model_layer_spec(c, spec);
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
        const kvb_tensor *all[] = KVB_LAYER_TENSORS(w), *stacked[] = KVB_LAYER_STACKED(w);
        for (size_t i = 0; i < KVB_ARRAY_LEN(all); i++) b += tensor_bytes(all[i]);
        for (size_t i = 0; i < KVB_ARRAY_LEN(stacked); i++) b += tensor_bytes(stacked[i]);
    }
    return b;
}
