/* kvbank — parsing and validating a Hugging Face config.json (LlamaConfig, MistralConfig, Qwen2Config,
 * Qwen3Config fields).
 *
 * Defaults follow transformers where a field is absent (save_pretrained writes only the fields that
 * differ from the class's defaults, so a default can carry meaning): num_key_value_heads =
 * num_attention_heads, head_dim = hidden_size / num_attention_heads (Qwen3Config: 128), rope_theta
 * 10000, rms_norm_eps 1e-6, max_position_embeddings 2048 (Mistral 131072, Qwen2/Qwen3 32768),
 * tie_word_embeddings false, MistralConfig's sliding_window 4096, Qwen2/Qwen3's use_sliding_window false,
 * sliding_window 4096 and max_window_layers 28. Both the classic `rope_theta` + `rope_scaling` fields
 * and the newer `rope_parameters` object are understood.
 *
 * Every field the transformers classes of these architectures read that changes the computation is
 * either implemented or refused by name (KVB_ERR_UNSUPPORTED): hidden_act other than silu,
 * partial_rotary_factor below 1, rope types dynamic / longrope / others, layer types other than full and
 * sliding attention, quantized checkpoints other than compressed-tensors FP8 (quant.h). Fields these classes do not read (e.g. a sliding_window on
 * a Llama config) are ignored, as transformers ignores them. */
#include "common/model/config.h"
#include "common/util/backend_name.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common/util/json.h"

#define WHAT "config.json"

/* Sanity bounds: far above any real model, low enough that products of two fit an int64 easily. */
#define MAX_LAYERS KVB_MODEL_MAX_LAYERS
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

static const struct {
    const char *hf_class, *model_type;
    kvb_arch arch;
} ARCHS[] = {
    {"LlamaForCausalLM", "llama", KVB_ARCH_LLAMA},
    {"Qwen3ForCausalLM", "qwen3", KVB_ARCH_QWEN3},
    {"MistralForCausalLM", "mistral", KVB_ARCH_MISTRAL},
    {"Qwen2ForCausalLM", "qwen2", KVB_ARCH_QWEN2},
};

const char *kvb_arch_name(kvb_arch a) {
    switch (a) {
    case KVB_ARCH_LLAMA: return "Llama";
    case KVB_ARCH_QWEN3: return "Qwen3";
    case KVB_ARCH_MISTRAL: return "Mistral";
    case KVB_ARCH_QWEN2: return "Qwen2";
    }
    return "?";
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
            for (size_t i = 0; i < KVB_ARRAY_LEN(ARCHS); i++)
                if (!strcmp(name, ARCHS[i].hf_class)) {
                    *out = ARCHS[i].arch;
                    return KVB_OK;
                }
            KVB_LOG_E(WHAT ": architecture \"%s\" is not supported (LlamaForCausalLM, MistralForCausalLM, "
                      "Qwen2ForCausalLM, Qwen3ForCausalLM)", name);
            return KVB_ERR_UNSUPPORTED;
        }
    }
    const char *mt = NULL;
    KVB_TRY(kvb_json_get_str(j, "model_type", 0, WHAT, &mt));
    if (!mt) {
        KVB_LOG_E(WHAT ": neither \"architectures\" nor \"model_type\" names the architecture");
        return KVB_ERR_INVALID;
    }
    for (size_t i = 0; i < KVB_ARRAY_LEN(ARCHS); i++)
        if (!strcmp(mt, ARCHS[i].model_type)) {
            *out = ARCHS[i].arch;
            return KVB_OK;
        }
    KVB_LOG_E(WHAT ": model_type \"%s\" is not supported (llama, mistral, qwen2, qwen3)", mt);
    return KVB_ERR_UNSUPPORTED;
}

/* rope_scaling (or rope_parameters): null/absent/"default" -> none; "linear", "llama3" and "yarn" with
 * their fields (transformers' modeling_rope_utils); anything else is refused by name. */
static kvb_status parse_rope_scaling(const json_t *rs, const char *field, kvb_model_config *c) {
    c->rope_type = KVB_ROPE_DEFAULT;
    c->rope_attn_factor = 1.0;
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
    if (!strcmp(type, "linear")) {
        KVB_TRY(kvb_json_get_real(rs, "factor", 1, 1e-9, 1e9, what, &c->rope_factor));
        c->rope_type = KVB_ROPE_LINEAR;
        return KVB_OK;
    }
    if (!strcmp(type, "llama3")) {
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
        c->rope_type = KVB_ROPE_LLAMA3;
        return KVB_OK;
    }
    if (!strcmp(type, "yarn")) {
        /* _compute_yarn_parameters: factor; original_max_position_embeddings (default: the model's
         * max_position_embeddings); attention_factor, else from mscale / mscale_all_dim, else
         * 0.1 ln(factor) + 1; beta_fast 32, beta_slow 1 (null or 0 mean the default); truncate true */
        int64_t orig = c->max_pos;
        double attn = 0.0, mscale = 0.0, mscale_all = 0.0;
        KVB_TRY(kvb_json_get_real(rs, "factor", 1, 1e-9, 1e9, what, &c->rope_factor));
        KVB_TRY(kvb_json_get_int(rs, "original_max_position_embeddings", 0, 1, MAX_POS, what, &orig));
        KVB_TRY(kvb_json_get_real(rs, "attention_factor", 0, 1e-9, 1e9, what, &attn));
        KVB_TRY(kvb_json_get_real(rs, "mscale", 0, 0.0, 1e9, what, &mscale));
        KVB_TRY(kvb_json_get_real(rs, "mscale_all_dim", 0, 0.0, 1e9, what, &mscale_all));
        c->rope_beta_fast = 0.0;
        c->rope_beta_slow = 0.0;
        KVB_TRY(kvb_json_get_real(rs, "beta_fast", 0, 0.0, 1e9, what, &c->rope_beta_fast));
        KVB_TRY(kvb_json_get_real(rs, "beta_slow", 0, 0.0, 1e9, what, &c->rope_beta_slow));
        if (c->rope_beta_fast == 0.0) c->rope_beta_fast = 32.0;
        if (c->rope_beta_slow == 0.0) c->rope_beta_slow = 1.0;
        c->rope_truncate = 1;
        KVB_TRY(kvb_json_get_bool(rs, "truncate", 0, what, &c->rope_truncate));
        const double f = c->rope_factor;
#define YARN_MSCALE(m) (f <= 1.0 ? 1.0 : 0.1 * (m) * log(f) + 1.0)
        if (attn > 0.0) c->rope_attn_factor = attn;
        else if (mscale != 0.0 && mscale_all != 0.0) c->rope_attn_factor = YARN_MSCALE(mscale) / YARN_MSCALE(mscale_all);
        else c->rope_attn_factor = YARN_MSCALE(1.0);
#undef YARN_MSCALE
        c->rope_orig_max_pos = (int)orig;
        c->rope_type = KVB_ROPE_YARN;
        return KVB_OK;
    }
    KVB_LOG_E(WHAT ": %s type \"%s\" is not supported (default, linear, llama3, yarn)", field, type);
    return KVB_ERR_UNSUPPORTED;
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

/* Fields that change the computation in a way kvbank does not implement: refuse rather than compute
 * wrong. */
static kvb_status check_unsupported(const json_t *j) {
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

/* Biases: Qwen2 has q/k/v biases always; Llama and Qwen3 read attention_bias (q/k/v/o); Llama reads
 * mlp_bias. Mistral's linear layers have none (its classes read neither field). */
static kvb_status parse_biases(const json_t *j, kvb_model_config *c) {
    int attn = 0, mlp = 0;
    if (c->arch == KVB_ARCH_LLAMA || c->arch == KVB_ARCH_QWEN3)
        KVB_TRY(kvb_json_get_bool(j, "attention_bias", 0, WHAT, &attn));
    if (c->arch == KVB_ARCH_LLAMA) KVB_TRY(kvb_json_get_bool(j, "mlp_bias", 0, WHAT, &mlp));
    c->qkv_bias = attn || c->arch == KVB_ARCH_QWEN2;
    c->o_bias = attn;
    c->mlp_bias = mlp;
    return KVB_OK;
}

/* Sliding windows. Mistral: sliding_window (default 4096, null = none) on every layer; a layer_types
 * list is refused (transformers' Mistral ignores it with a warning: such a checkpoint wants another
 * class). Qwen2 / Qwen3: the window is sliding_window when use_sliding_window is true, else none; the
 * layers that use it are those whose layer_types entry is "sliding_attention", or without a
 * layer_types list the layers from max_window_layers on (Qwen2Config.__post_init__). */
static kvb_status parse_window(const json_t *j, kvb_model_config *c) {
    memset(c->window_layers, 0, sizeof c->window_layers);
    c->sliding_window = 0;
    if (c->arch == KVB_ARCH_LLAMA) return KVB_OK;
    const json_t *lt = json_object_get(j, "layer_types");
    int64_t w = 4096;
    if (c->arch == KVB_ARCH_MISTRAL) {
        if (lt && !json_is_null(lt)) {
            KVB_LOG_E(WHAT ": \"layer_types\" on MistralForCausalLM is not supported (transformers' Mistral "
                      "ignores it; per-layer attention types need another architecture)");
            return KVB_ERR_UNSUPPORTED;
        }
        const json_t *sw = json_object_get(j, "sliding_window");
        if (sw && json_is_null(sw)) return KVB_OK;
        KVB_TRY(kvb_json_get_int(j, "sliding_window", 0, 1, MAX_POS, WHAT, &w));
        c->sliding_window = (int)w;
        for (int l = 0; l < c->n_layers; l++) c->window_layers[l / 8] |= (uint8_t)(1u << (l % 8));
        return KVB_OK;
    }
    int use = 0;
    int64_t first = 28;
    KVB_TRY(kvb_json_get_bool(j, "use_sliding_window", 0, WHAT, &use));
    const json_t *sw = json_object_get(j, "sliding_window");
    int have_window = use && !(sw && json_is_null(sw));
    if (have_window) KVB_TRY(kvb_json_get_int(j, "sliding_window", 0, 1, MAX_POS, WHAT, &w));
    KVB_TRY(kvb_json_get_int(j, "max_window_layers", 0, 0, MAX_LAYERS, WHAT, &first));
    if (lt && !json_is_null(lt)) {
        if (!json_is_array(lt) || json_array_size(lt) != (size_t)c->n_layers) {
            KVB_LOG_E(WHAT ": field \"layer_types\" must be a list of %d strings (one per layer)", c->n_layers);
            return KVB_ERR_INVALID;
        }
        for (int l = 0; l < c->n_layers; l++) {
            const json_t *t = json_array_get(lt, (size_t)l);
            const char *ts = json_is_string(t) ? json_string_value(t) : NULL;
            if (ts && !strcmp(ts, "full_attention")) continue;
            if (ts && !strcmp(ts, "sliding_attention")) {
                if (have_window) c->window_layers[l / 8] |= (uint8_t)(1u << (l % 8));
                continue;
            }
            KVB_LOG_E(WHAT ": \"layer_types\"[%d] = %s%s%s is not supported (full_attention, sliding_attention)", l,
                      ts ? "\"" : "", ts ? ts : "a non-string", ts ? "\"" : "");
            return KVB_ERR_UNSUPPORTED;
        }
    } else if (have_window) {
        for (int l = (int)first; l < c->n_layers; l++) c->window_layers[l / 8] |= (uint8_t)(1u << (l % 8));
    }
    if (have_window) c->sliding_window = (int)w;
    return KVB_OK;
}

int kvb_model_config_window(const kvb_model_config *c, int layer) {
    if (c->sliding_window <= 0 || layer < 0 || layer >= c->n_layers) return 0;
    return (c->window_layers[layer / 8] >> (layer % 8)) & 1 ? c->sliding_window : 0;
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
    /* Qwen3Config's own default is 128; the other classes derive it. */
    c->head_dim = c->arch == KVB_ARCH_QWEN3 ? 128 : c->hidden / c->n_heads;
    KVB_TRY(get_int(j, "head_dim", 0, 1, MAX_HEAD_DIM, &c->head_dim));
    if (c->head_dim < 2 || c->head_dim % 2 != 0) {
        KVB_LOG_E(WHAT ": head_dim (%d, from %s) must be even and at least 2", c->head_dim,
                  json_object_get(j, "head_dim") ? "head_dim" : "hidden_size / num_attention_heads");
        return KVB_ERR_INVALID;
    }
    KVB_TRY(get_int(j, "intermediate_size", 1, 1, MAX_INTERMEDIATE, &c->intermediate));
    KVB_TRY(get_int(j, "vocab_size", 1, 1, MAX_VOCAB, &c->vocab));
    c->max_pos = c->arch == KVB_ARCH_LLAMA ? 2048 : c->arch == KVB_ARCH_MISTRAL ? 131072 : 32768;
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
    KVB_TRY(parse_biases(j, c));
    KVB_TRY(parse_window(j, c));

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
    _Static_assert(KVB_QUANT_MAX_LAYERS >= MAX_LAYERS, "a quantization bit field per layer");
    KVB_TRY(kvb_quant_config_parse(json_object_get(j, "quantization_config"), c->n_layers, c->tie_embeddings, &c->quant));

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

/* YaRN's inverse dimension formula: the dimension whose wavelength makes `rotations` turns over `ctx`. */
static double yarn_correction_dim(double rotations, double dim, double base, double ctx) {
    return dim * log(ctx / (rotations * 2.0 * M_PI)) / (2.0 * log(base));
}

/* transformers modeling_rope_utils: _compute_default_rope_parameters, then the scaling of
 * rope_type (_compute_linear_scaling_rope_parameters, _compute_llama3_parameters,
 * _compute_yarn_parameters). Computed in double, stored as float. YaRN's attention factor is not
 * here: it multiplies cos and sin, i.e. q and k, which the forward pass folds into the softmax scale. */
void kvb_model_config_rope_inv_freq(const kvb_model_config *c, float *inv_freq) {
    const int half = c->head_dim / 2;
    const double dim = (double)c->head_dim, factor = c->rope_factor;
    double ramp_lo = 0.0, ramp_hi = 0.0;
    if (c->rope_type == KVB_ROPE_YARN) {
        const double ctx = (double)c->rope_orig_max_pos;
        ramp_lo = yarn_correction_dim(c->rope_beta_fast, dim, c->rope_theta, ctx);
        ramp_hi = yarn_correction_dim(c->rope_beta_slow, dim, c->rope_theta, ctx);
        if (c->rope_truncate) {
            ramp_lo = floor(ramp_lo);
            ramp_hi = ceil(ramp_hi);
        }
        ramp_lo = KVB_MAX(ramp_lo, 0.0);
        ramp_hi = KVB_MIN(ramp_hi, dim - 1.0);
        if (ramp_lo == ramp_hi) ramp_hi += 0.001; /* as transformers: no division by zero */
    }
    for (int i = 0; i < half; i++) {
        double f = 1.0 / pow(c->rope_theta, (double)(2 * i) / dim);
        switch (c->rope_type) {
        case KVB_ROPE_DEFAULT: break;
        case KVB_ROPE_LINEAR: f /= factor; break;
        case KVB_ROPE_LLAMA3: {
            const double lo = c->rope_low_freq_factor, hi = c->rope_high_freq_factor;
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
            break;
        }
        case KVB_ROPE_YARN: {
            /* extrapolation (f) for the fast dimensions below the ramp, interpolation (f / factor) above */
            double ramp = ((double)i - ramp_lo) / (ramp_hi - ramp_lo);
            ramp = ramp < 0.0 ? 0.0 : ramp > 1.0 ? 1.0 : ramp;
            const double extrapolation = 1.0 - ramp;
            f = f / factor * (1.0 - extrapolation) + f * extrapolation;
            break;
        }
        }
        inv_freq[i] = (float)f;
    }
}

kvb_status kvb_model_kv_elem_size(const char *backend, int *out) {
    kvb_dtype dt;
    KVB_TRY(kvb_backend_kv_dtype(backend, &dt));
    *out = (int)kvb_dtype_size(dt);
    return KVB_OK;
}
