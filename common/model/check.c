/* kvbank — checking a model directory without loading it (see check.h). */
#include "common/model/check.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/text/chat.h"
#include "common/text/tokenizer.h"

int kvb_model_layer_spec(const kvb_model_config *c, kvb_layer_tensor_spec spec[KVB_LT_COUNT]) {
    const int64_t h = c->hidden, q = (int64_t)c->n_heads * c->head_dim, kv = (int64_t)c->n_kv_heads * c->head_dim;
    const int64_t ff = c->intermediate;
    int n = 0;
#define T(s, id, r, cl) (spec[n++] = (kvb_layer_tensor_spec){(s), (id), (r), (cl)})
    T("input_layernorm.weight", KVB_LT_ATTN_NORM, h, 0);
    T("self_attn.q_proj.weight", KVB_LT_WQ, q, h);
    T("self_attn.k_proj.weight", KVB_LT_WK, kv, h);
    T("self_attn.v_proj.weight", KVB_LT_WV, kv, h);
    T("self_attn.o_proj.weight", KVB_LT_WO, h, q);
    if (c->qkv_bias) {
        T("self_attn.q_proj.bias", KVB_LT_BQ, q, 0);
        T("self_attn.k_proj.bias", KVB_LT_BK, kv, 0);
        T("self_attn.v_proj.bias", KVB_LT_BV, kv, 0);
    }
    if (c->o_bias) T("self_attn.o_proj.bias", KVB_LT_BO, h, 0);
    if (c->arch == KVB_ARCH_QWEN3) {
        T("self_attn.q_norm.weight", KVB_LT_Q_NORM, c->head_dim, 0);
        T("self_attn.k_norm.weight", KVB_LT_K_NORM, c->head_dim, 0);
    }
    T("post_attention_layernorm.weight", KVB_LT_FFN_NORM, h, 0);
    T("mlp.gate_proj.weight", KVB_LT_W_GATE, ff, h);
    T("mlp.up_proj.weight", KVB_LT_W_UP, ff, h);
    T("mlp.down_proj.weight", KVB_LT_W_DOWN, h, ff);
    if (c->mlp_bias) {
        T("mlp.gate_proj.bias", KVB_LT_B_GATE, ff, 0);
        T("mlp.up_proj.bias", KVB_LT_B_UP, ff, 0);
        T("mlp.down_proj.bias", KVB_LT_B_DOWN, h, 0);
    }
#undef T
    return n;
}

static void format_shape(char *buf, size_t cap, int n_dims, const int64_t *shape) {
    int o = snprintf(buf, cap, "[");
    for (int i = 0; i < n_dims && o > 0 && (size_t)o < cap; i++)
        o += snprintf(buf + o, cap - (size_t)o, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (o > 0 && (size_t)o < cap) snprintf(buf + o, cap - (size_t)o, "]");
}

kvb_status kvb_model_find_weight(const kvb_st_set *set, const char *name, int64_t rows, int64_t cols,
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

int kvb_model_layer_proj(kvb_layer_tensor_id id) {
    switch (id) {
    case KVB_LT_WQ: return KVB_PROJ_Q;
    case KVB_LT_WK: return KVB_PROJ_K;
    case KVB_LT_WV: return KVB_PROJ_V;
    case KVB_LT_WO: return KVB_PROJ_O;
    case KVB_LT_W_GATE: return KVB_PROJ_GATE;
    case KVB_LT_W_UP: return KVB_PROJ_UP;
    case KVB_LT_W_DOWN: return KVB_PROJ_DOWN;
    default: return -1;
    }
}

kvb_status kvb_model_find_fp8(const kvb_st_set *set, const char *wname, const kvb_st_tensor *t, int per_channel,
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

kvb_status kvb_model_check_dtype(const kvb_st_set *set, const kvb_model_config *c, const char *name,
                                 const kvb_st_tensor *t, int fp8) {
    const kvb_st_tensor *sc;
    if (fp8) return kvb_model_find_fp8(set, name, t, c->quant.per_channel, &sc);
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
    KVB_TRY_GOTO(kvb_model_find_weight(set, "model.embed_tokens.weight", c.vocab, c.hidden, &t), fail_set);
    for (int l = 0; l < c.n_layers; l++) {
        kvb_layer_tensor_spec spec[KVB_LT_COUNT];
        int n = kvb_model_layer_spec(&c, spec);
        for (int i = 0; i < n; i++) {
            char name[128];
            snprintf(name, sizeof name, "model.layers.%d.%s", l, spec[i].suffix);
            KVB_TRY_GOTO(kvb_model_find_weight(set, name, spec[i].rows, spec[i].cols, &t), fail_set);
            int p = kvb_model_layer_proj(spec[i].id);
            KVB_TRY_GOTO(kvb_model_check_dtype(set, &c, name, t, p >= 0 && kvb_quant_is_quantized(&c.quant, l, p)), fail_set);
        }
    }
    KVB_TRY_GOTO(kvb_model_find_weight(set, "model.norm.weight", c.hidden, 0, &t), fail_set);
    if (!c.tie_embeddings) {
        KVB_TRY_GOTO(kvb_model_find_weight(set, "lm_head.weight", c.vocab, c.hidden, &t), fail_set);
        KVB_TRY_GOTO(kvb_model_check_dtype(set, &c, "lm_head.weight", t,
                                           kvb_quant_is_quantized(&c.quant, 0, KVB_PROJ_COUNT)), fail_set);
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

kvb_status kvb_model_check_text(const char *dir, int *has_tokenizer, int *has_chat, char *why, size_t why_len) {
    kvb_tokenizer *tok = NULL;
    kvb_chat_template *ct = NULL;
    *has_tokenizer = *has_chat = 0;
    if (why_len) why[0] = '\0';
    char path[PATH_MAX];
    if (snprintf(path, sizeof path, "%s/tokenizer.json", dir) >= (int)sizeof path || access(path, F_OK) != 0)
        return KVB_OK; /* no tokenizer: token ids only, as intended */
    kvb_status st = kvb_tokenizer_load(dir, &tok);
    if (st != KVB_OK) {
        if (st != KVB_ERR_NOT_FOUND)
            snprintf(why, why_len, "tokenizer.json cannot be used (%s, see the log); the model takes token ids only",
                     kvb_status_str(st));
        return KVB_OK;
    }
    *has_tokenizer = 1;
    kvb_tokenizer_destroy(tok);
    char tmpl_why[384];
    st = kvb_chat_template_load_why(dir, &ct, tmpl_why, sizeof tmpl_why);
    if (st == KVB_OK) *has_chat = 1;
    else if (st != KVB_ERR_NOT_FOUND) snprintf(why, why_len, "%s; the model is served without chat", tmpl_why);
    kvb_chat_template_destroy(ct);
    return KVB_OK;
}

int kvb_model_policy_known(const char *name) {
#define KVB_POLICY(fn, pname, params, summary) pname,
    static const char *const names[] = {
#include "common/policy/policies.def"
    };
#undef KVB_POLICY
    for (size_t i = 0; name && i < KVB_ARRAY_LEN(names); i++)
        if (!strcmp(names[i], name)) return 1;
    return 0;
}
