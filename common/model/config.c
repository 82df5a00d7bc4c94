/* kvbank — parsing and validating a Hugging Face config.json (LlamaConfig / Qwen3Config fields).
 *
 * Defaults follow transformers where a field is absent: num_key_value_heads = num_attention_heads,
 * head_dim = hidden_size / num_attention_heads (Qwen3Config: 128), rope_theta 10000, rms_norm_eps 1e-6,
 * max_position_embeddings 2048 (Qwen3Config: 32768), tie_word_embeddings false. Both the classic
 * `rope_theta` + `rope_scaling` fields and the newer `rope_parameters` object are understood. */
#include "common/model/config.h"
#include "kernels/backend.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common/util/json.h"

#define WHAT "config.json"

/* Sanity bounds: far above any real model, low enough that products of two fit an int64 easily. */
#define MAX_LAYERS 4096
#define MAX_HIDDEN (1 << 20)
#define MAX_HEADS 4096
#define MAX_HEAD_DIM 4096
#define MAX_INTERMEDIATE (1 << 22)
#define MAX_VOCAB (1 << 24)
#define MAX_POS (1 << 30)

static kvb_status get_int(const json_t *j, const char *key, int required, int64_t min, int64_t max, int *out) {
    int64_t v = *out;
    KVB_TRY(kvb_json_get_int(j, key, required, min, max, WHAT, &v));
    *out = (int)v;
    return KVB_OK;
}

static kvb_status parse_arch(const json_t *j, kvb_arch *out) {
    const json_t *archs = json_object_get(j, "architectures");
    const char *name = NULL;
    if (archs && !json_is_null(archs)) {
        if (!json_is_array(archs)) {
            KVB_LOG_E(WHAT ": field \"architectures\" must be a list of strings");
            return KVB_ERR_INVALID;
        }
        if (json_array_size(archs) > 0) {
            const json_t *a0 = json_array_get(archs, 0);
            if (!json_is_string(a0)) {
                KVB_LOG_E(WHAT ": field \"architectures\"[0] must be a string");
                return KVB_ERR_INVALID;
            }
            name = json_string_value(a0);
            if (!strcmp(name, "LlamaForCausalLM")) *out = KVB_ARCH_LLAMA;
            else if (!strcmp(name, "Qwen3ForCausalLM")) *out = KVB_ARCH_QWEN3;
            else {
                KVB_LOG_E(WHAT ": architecture \"%s\" is not supported (LlamaForCausalLM, Qwen3ForCausalLM)", name);
                return KVB_ERR_UNSUPPORTED;
            }
            return KVB_OK;
        }
    }
    const char *mt = NULL;
    KVB_TRY(kvb_json_get_str(j, "model_type", 0, WHAT, &mt));
    if (!mt) {
        KVB_LOG_E(WHAT ": neither \"architectures\" nor \"model_type\" names the architecture");
        return KVB_ERR_INVALID;
    }
    if (!strcmp(mt, "llama")) *out = KVB_ARCH_LLAMA;
    else if (!strcmp(mt, "qwen3")) *out = KVB_ARCH_QWEN3;
    else {
        KVB_LOG_E(WHAT ": model_type \"%s\" is not supported (llama, qwen3)", mt);
        return KVB_ERR_UNSUPPORTED;
    }
    return KVB_OK;
}

/* rope_scaling (or rope_parameters): null/absent/"default" -> none, "llama3" -> its four fields. */
static kvb_status parse_rope_scaling(const json_t *rs, const char *field, kvb_model_config *c) {
    c->rope_llama3 = 0;
    if (!rs || json_is_null(rs)) return KVB_OK;
    if (!json_is_object(rs)) {
        KVB_LOG_E(WHAT ": field \"%s\" must be an object or null", field);
        return KVB_ERR_INVALID;
    }
    char what[64];
    snprintf(what, sizeof what, WHAT ": %s", field);
    const char *type = NULL;
    KVB_TRY(kvb_json_get_str(rs, "rope_type", 0, what, &type));
    if (!type) KVB_TRY(kvb_json_get_str(rs, "type", 0, what, &type));
    if (!type) {
        KVB_LOG_E(WHAT ": field \"%s\" has neither \"rope_type\" nor \"type\"", field);
        return KVB_ERR_INVALID;
    }
    if (!strcmp(type, "default")) return KVB_OK;
    if (strcmp(type, "llama3") != 0) {
        KVB_LOG_E(WHAT ": %s type \"%s\" is not supported (default, llama3)", field, type);
        return KVB_ERR_UNSUPPORTED;
    }
    int64_t orig = 0;
    KVB_TRY(kvb_json_get_real(rs, "factor", 1, 1e-9, 1e9, what, &c->rope_factor));
    KVB_TRY(kvb_json_get_real(rs, "low_freq_factor", 1, 1e-9, 1e9, what, &c->rope_low_freq_factor));
    KVB_TRY(kvb_json_get_real(rs, "high_freq_factor", 1, 1e-9, 1e9, what, &c->rope_high_freq_factor));
    KVB_TRY(kvb_json_get_int(rs, "original_max_position_embeddings", 1, 1, MAX_POS, what, &orig));
    if (!(c->rope_high_freq_factor > c->rope_low_freq_factor)) {
        KVB_LOG_E(WHAT ": %s \"high_freq_factor\" (%g) must exceed \"low_freq_factor\" (%g)", field,
                  c->rope_high_freq_factor, c->rope_low_freq_factor);
        return KVB_ERR_INVALID;
    }
    c->rope_orig_max_pos = (int)orig;
    c->rope_llama3 = 1;
    return KVB_OK;
}

static kvb_status parse_token_ids(const json_t *j, kvb_model_config *c) {
    const json_t *b = json_object_get(j, "bos_token_id");
    c->bos_id = -1;
    if (b && !json_is_null(b)) {
        int v = -1;
        KVB_TRY(get_int(j, "bos_token_id", 1, 0, c->vocab - 1, &v));
        c->bos_id = v;
    }
    const json_t *e = json_object_get(j, "eos_token_id");
    c->n_eos = 0;
    if (!e || json_is_null(e)) return KVB_OK;
    if (json_is_array(e)) {
        if (json_array_size(e) > KVB_MAX_EOS) {
            KVB_LOG_E(WHAT ": field \"eos_token_id\" lists %zu ids (at most %d)", json_array_size(e), KVB_MAX_EOS);
            return KVB_ERR_INVALID;
        }
        for (size_t i = 0; i < json_array_size(e); i++) {
            const json_t *x = json_array_get(e, i);
            if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) >= c->vocab) {
                KVB_LOG_E(WHAT ": field \"eos_token_id\"[%zu] must be an integer in [0, %d)", i, c->vocab);
                return KVB_ERR_INVALID;
            }
            c->eos_ids[c->n_eos++] = (int)json_integer_value(x);
        }
        return KVB_OK;
    }
    int v = -1;
    KVB_TRY(get_int(j, "eos_token_id", 1, 0, c->vocab - 1, &v));
    c->eos_ids[c->n_eos++] = v;
    return KVB_OK;
}

/* Features of these architectures that kvbank does not implement: refuse rather than compute wrong. */
static kvb_status check_unsupported(const json_t *j) {
    static const char *const flags[] = {"attention_bias", "mlp_bias", "use_sliding_window"};
    for (size_t i = 0; i < KVB_ARRAY_LEN(flags); i++) {
        int on = 0;
        KVB_TRY(kvb_json_get_bool(j, flags[i], 0, WHAT, &on));
        if (on) {
            KVB_LOG_E(WHAT ": \"%s\": true is not supported", flags[i]);
            return KVB_ERR_UNSUPPORTED;
        }
    }
    const char *act = NULL;
    KVB_TRY(kvb_json_get_str(j, "hidden_act", 0, WHAT, &act));
    if (act && strcmp(act, "silu") != 0) {
        KVB_LOG_E(WHAT ": hidden_act \"%s\" is not supported (silu)", act);
        return KVB_ERR_UNSUPPORTED;
    }
    double prf = 1.0;
    KVB_TRY(kvb_json_get_real(j, "partial_rotary_factor", 0, 0.0, 1.0, WHAT, &prf));
    if (prf != 1.0) {
        KVB_LOG_E(WHAT ": partial_rotary_factor %g is not supported (1.0)", prf);
        return KVB_ERR_UNSUPPORTED;
    }
    return KVB_OK;
}

static kvb_status parse_obj(const json_t *j, kvb_model_config *c) {
    if (!json_is_object(j)) {
        KVB_LOG_E(WHAT ": top level must be a JSON object");
        return KVB_ERR_FORMAT;
    }
    memset(c, 0, sizeof *c);
    KVB_TRY(parse_arch(j, &c->arch));
    KVB_TRY(check_unsupported(j));

    KVB_TRY(get_int(j, "num_hidden_layers", 1, 1, MAX_LAYERS, &c->n_layers));
    KVB_TRY(get_int(j, "hidden_size", 1, 1, MAX_HIDDEN, &c->hidden));
    KVB_TRY(get_int(j, "num_attention_heads", 1, 1, MAX_HEADS, &c->n_heads));
    c->n_kv_heads = c->n_heads;
    KVB_TRY(get_int(j, "num_key_value_heads", 0, 1, MAX_HEADS, &c->n_kv_heads));
    if (c->n_heads % c->n_kv_heads != 0) {
        KVB_LOG_E(WHAT ": num_attention_heads (%d) is not a multiple of num_key_value_heads (%d)", c->n_heads,
                  c->n_kv_heads);
        return KVB_ERR_INVALID;
    }
    /* Qwen3Config's own default is 128; LlamaConfig derives it. */
    c->head_dim = c->arch == KVB_ARCH_QWEN3 ? 128 : c->hidden / c->n_heads;
    KVB_TRY(get_int(j, "head_dim", 0, 1, MAX_HEAD_DIM, &c->head_dim));
    if (c->head_dim < 2 || c->head_dim % 2 != 0) {
        KVB_LOG_E(WHAT ": head_dim (%d, from %s) must be even and at least 2", c->head_dim,
                  json_object_get(j, "head_dim") ? "head_dim" : "hidden_size / num_attention_heads");
        return KVB_ERR_INVALID;
    }
    KVB_TRY(get_int(j, "intermediate_size", 1, 1, MAX_INTERMEDIATE, &c->intermediate));
    KVB_TRY(get_int(j, "vocab_size", 1, 1, MAX_VOCAB, &c->vocab));
    c->max_pos = c->arch == KVB_ARCH_QWEN3 ? 32768 : 2048;
    KVB_TRY(get_int(j, "max_position_embeddings", 0, 1, MAX_POS, &c->max_pos));

    double eps = 1e-6;
    KVB_TRY(kvb_json_get_real(j, "rms_norm_eps", 0, 1e-30, 1.0, WHAT, &eps));
    if (!(eps > 0.0) || eps >= 1.0) {
        KVB_LOG_E(WHAT ": field \"rms_norm_eps\" = %g must lie in (0, 1)", eps);
        return KVB_ERR_INVALID;
    }
    c->rms_eps = (float)eps;

    c->tie_embeddings = 0;
    KVB_TRY(kvb_json_get_bool(j, "tie_word_embeddings", 0, WHAT, &c->tie_embeddings));

    /* RoPE: classic fields, or transformers >= 4.56 "rope_parameters" {rope_type, rope_theta, ...}. */
    c->rope_theta = 10000.0;
    const json_t *rp = json_object_get(j, "rope_parameters");
    const json_t *rs = json_object_get(j, "rope_scaling");
    if (rp && !json_is_null(rp) && (!rs || json_is_null(rs))) {
        if (!json_is_object(rp)) {
            KVB_LOG_E(WHAT ": field \"rope_parameters\" must be an object or null");
            return KVB_ERR_INVALID;
        }
        KVB_TRY(kvb_json_get_real(j, "rope_theta", 0, 1e-9, 1e15, WHAT, &c->rope_theta));
        KVB_TRY(kvb_json_get_real(rp, "rope_theta", 0, 1e-9, 1e15, WHAT ": rope_parameters", &c->rope_theta));
        KVB_TRY(parse_rope_scaling(rp, "rope_parameters", c));
    } else {
        KVB_TRY(kvb_json_get_real(j, "rope_theta", 0, 1e-9, 1e15, WHAT, &c->rope_theta));
        KVB_TRY(parse_rope_scaling(rs, "rope_scaling", c));
    }
    if (!(c->rope_theta > 1.0)) {
        KVB_LOG_E(WHAT ": field \"rope_theta\" = %g must exceed 1", c->rope_theta);
        return KVB_ERR_INVALID;
    }

    KVB_TRY(parse_token_ids(j, c));

    c->torch_dtype = KVB_DTYPE_F32;
    const char *dt = NULL;
    KVB_TRY(kvb_json_get_str(j, "torch_dtype", 0, WHAT, &dt));
    if (!dt) KVB_TRY(kvb_json_get_str(j, "dtype", 0, WHAT, &dt));
    if (dt && kvb_dtype_parse(dt, &c->torch_dtype) != KVB_OK) {
        KVB_LOG_W(WHAT ": torch_dtype \"%s\" is not f32/f16/bf16; weights keep the dtype of their files", dt);
        c->torch_dtype = KVB_DTYPE_F32;
    }
    return KVB_OK;
}

kvb_status kvb_model_config_parse(const char *text, size_t len, kvb_model_config *out) {
    json_t *j = NULL;
    KVB_TRY(kvb_json_load_text(text, len, WHAT, &j));
    kvb_model_config c;
    kvb_status st = parse_obj(j, &c);
    json_decref(j);
    if (st == KVB_OK) *out = c;
    return st;
}

kvb_status kvb_model_config_load(const char *dir, kvb_model_config *out) {
    char path[PATH_MAX];
    if (snprintf(path, sizeof path, "%s/config.json", dir) >= (int)sizeof path) {
        KVB_LOG_E("%s: model directory path too long", dir);
        return KVB_ERR_INVALID;
    }
    json_t *j = NULL;
    KVB_TRY(kvb_json_load_file(path, &j));
    kvb_model_config c;
    kvb_status st = parse_obj(j, &c);
    json_decref(j);
    if (st != KVB_OK) {
        KVB_LOG_E("%s: rejected", path);
        return st;
    }
    *out = c;
    return KVB_OK;
}

/* transformers modeling_rope_utils: _compute_default_rope_parameters, then (rope_type "llama3")
 * _compute_llama3_parameters. Computed in double, stored as float. */
void kvb_model_config_rope_inv_freq(const kvb_model_config *c, float *inv_freq) {
    const int half = c->head_dim / 2;
    for (int i = 0; i < half; i++) {
        double f = 1.0 / pow(c->rope_theta, (double)(2 * i) / (double)c->head_dim);
        if (c->rope_llama3) {
            const double factor = c->rope_factor, lo = c->rope_low_freq_factor, hi = c->rope_high_freq_factor;
            const double old_ctx = (double)c->rope_orig_max_pos;
            const double low_freq_wavelen = old_ctx / lo;
            const double high_freq_wavelen = old_ctx / hi;
            const double wavelen = 2.0 * M_PI / f;
            if (wavelen > low_freq_wavelen) {
                f = f / factor;
            } else if (!(wavelen < high_freq_wavelen)) { /* medium frequency: interpolate */
                const double smooth = (old_ctx / wavelen - lo) / (hi - lo);
                f = (1.0 - smooth) * f / factor + smooth * f;
            }
        }
        inv_freq[i] = (float)f;
    }
}

kvb_status kvb_model_kv_elem_size(const char *backend, int *out) {
    kvb_dtype dt;
    KVB_TRY(kvb_backend_act_dtype(backend, &dt));
    *out = (int)kvb_dtype_size(dt);
    return KVB_OK;
}
