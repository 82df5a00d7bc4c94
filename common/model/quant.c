/* kvbank — compressed-tensors' quantization_config (quant.h). Field names and meanings are those of
 * compressed-tensors' QuantizationConfig / QuantizationScheme / QuantizationArgs (quant_config.py,
 * quant_scheme.py, quant_args.py): config_groups of {targets, weights, input_activations,
 * output_activations}, ignore, format, kv_cache_scheme. */
#include "common/model/quant.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdio.h>
#include <string.h>

#include "common/util/json.h"

#define WHAT "config.json: quantization_config"

static const char *const PROJ_NAMES[KVB_PROJ_COUNT] = {
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj",    "mlp.up_proj",      "mlp.down_proj",
};

const char *kvb_proj_name(kvb_proj p) { return p >= 0 && p < KVB_PROJ_COUNT ? PROJ_NAMES[p] : "?"; }

int kvb_quant_is_quantized(const kvb_quant_config *q, int layer, int p) {
    if (!q->fp8) return 0;
    if (p == KVB_PROJ_COUNT) return q->lm_head;
    return layer >= 0 && layer < KVB_QUANT_MAX_LAYERS && (q->layers[layer] >> p) & 1;
}

/* A string field that must be absent, null (*out NULL) or one of the values in `ok` (NULL-terminated).
 * Logs the field and the value it refuses. */
static kvb_status str_field(const json_t *o, const char *where, const char *key, const char *const *ok, const char **out) {
    const json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) {
        *out = NULL;
        return KVB_OK;
    }
    if (!json_is_string(v)) {
        KVB_LOG_E(WHAT ": %s\"%s\" must be a string", where, key);
        return KVB_ERR_INVALID;
    }
    *out = json_string_value(v);
    for (int i = 0; ok[i]; i++)
        if (!strcmp(*out, ok[i])) return KVB_OK;
    KVB_LOG_E(WHAT ": %s\"%s\": \"%s\" is not supported (kvbank runs FP8 E4M3, compressed-tensors float-quantized: "
              "weights per tensor or channel, activations none or dynamic per token)",
              where, key, *out);
    return KVB_ERR_UNSUPPORTED;
}

/* A field that must be absent or null (a feature kvbank does not run). */
static kvb_status null_field(const json_t *o, const char *where, const char *key, const char *what) {
    const json_t *v = json_object_get(o, key);
    if (v && !json_is_null(v)) {
        KVB_LOG_E(WHAT ": %s\"%s\" is set: %s is not supported", where, key, what);
        return KVB_ERR_UNSUPPORTED;
    }
    return KVB_OK;
}

/* The QuantizationArgs common to weights and activations: float, 8 bits, symmetric, no groups or blocks. */
static kvb_status fp8_args(const json_t *a, const char *where) {
    const char *type = NULL;
    static const char *const float_ok[] = {"float", NULL};
    KVB_TRY(str_field(a, where, "type", float_ok, &type));
    if (!type) {
        KVB_LOG_E(WHAT ": %s\"type\" missing (kvbank runs \"float\": FP8 E4M3)", where);
        return KVB_ERR_UNSUPPORTED;
    }
    int64_t bits = 8;
    KVB_TRY(kvb_json_get_int(a, "num_bits", 0, 0, 64, WHAT, &bits));
    if (bits != 8) {
        KVB_LOG_E(WHAT ": %s\"num_bits\": %lld is not supported (8: FP8 E4M3)", where, (long long)bits);
        return KVB_ERR_UNSUPPORTED;
    }
    int sym = 1;
    KVB_TRY(kvb_json_get_bool(a, "symmetric", 0, WHAT, &sym));
    if (!sym) {
        KVB_LOG_E(WHAT ": %s\"symmetric\": false (zero points) is not supported", where);
        return KVB_ERR_UNSUPPORTED;
    }
    KVB_TRY(null_field(a, where, "group_size", "group quantization"));
    KVB_TRY(null_field(a, where, "block_structure", "block quantization"));
    KVB_TRY(null_field(a, where, "actorder", "activation ordering"));
    return KVB_OK;
}

/* One config group's scheme, as the three numbers kvb_quant_config keeps. */
typedef struct scheme {
    int per_channel, act_token;
} scheme;

static kvb_status parse_scheme(const json_t *g, const char *name, scheme *s) {
    char where[160];
    const json_t *w = json_object_get(g, "weights");
    snprintf(where, sizeof where, "config_groups.%s.weights.", name);
    if (!json_is_object(w)) {
        KVB_LOG_E(WHAT ": config_groups.%s: \"weights\" missing or not an object (activation-only quantization is "
                  "not supported)", name);
        return KVB_ERR_UNSUPPORTED;
    }
    KVB_TRY(fp8_args(w, where));
    static const char *const wstrat[] = {"tensor", "channel", NULL};
    const char *strat = NULL;
    KVB_TRY(str_field(w, where, "strategy", wstrat, &strat));
    s->per_channel = strat && !strcmp(strat, "channel");
    int dyn = 0;
    KVB_TRY(kvb_json_get_bool(w, "dynamic", 0, WHAT, &dyn));
    if (dyn) {
        KVB_LOG_E(WHAT ": %s\"dynamic\": true (weights quantized at run time) is not supported", where);
        return KVB_ERR_UNSUPPORTED;
    }

    const json_t *a = json_object_get(g, "input_activations");
    s->act_token = 0;
    if (a && !json_is_null(a)) {
        snprintf(where, sizeof where, "config_groups.%s.input_activations.", name);
        if (!json_is_object(a)) {
            KVB_LOG_E(WHAT ": %snot an object", where);
            return KVB_ERR_INVALID;
        }
        KVB_TRY(fp8_args(a, where));
        const json_t *d = json_object_get(a, "dynamic");
        if (!json_is_true(d)) {
            KVB_LOG_E(WHAT ": %s\"dynamic\": %s: only dynamic per-token activation quantization is supported (not "
                      "static input_scale tensors)",
                      where, json_is_string(d) ? json_string_value(d) : json_is_false(d) ? "false" : "(absent)");
            return KVB_ERR_UNSUPPORTED;
        }
        /* a dynamic per-tensor scale would make a sequence's results depend on the rest of its batch */
        static const char *const astrat[] = {"token", NULL};
        KVB_TRY(str_field(a, where, "strategy", astrat, &strat));
        if (!strat) {
            KVB_LOG_E(WHAT ": %s\"strategy\" missing (kvbank runs \"token\")", where);
            return KVB_ERR_UNSUPPORTED;
        }
        s->act_token = 1;
    }
    snprintf(where, sizeof where, "config_groups.%s.", name);
    KVB_TRY(null_field(g, where, "output_activations", "output activation quantization"));
    static const char *const fmt_ok[] = {"float-quantized", NULL};
    const char *fmt = NULL;
    KVB_TRY(str_field(g, where, "format", fmt_ok, &fmt));
    return KVB_OK;
}

/* A `targets` or `ignore` entry against a module name: "re:PATTERN" matches from the start of the name
 * (Python's re.match, which compressed-tensors uses; PCRE2 reads the same syntax), otherwise the exact
 * name, or "Linear" every linear layer. *hit is set; KVB_ERR_INVALID for a pattern that does not compile. */
static kvb_status match(const char *entry, const char *module, int *hit) {
    if (strncmp(entry, "re:", 3) != 0) {
        *hit = !strcmp(entry, "Linear") || !strcmp(entry, module);
        return KVB_OK;
    }
    int err;
    PCRE2_SIZE at;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)(entry + 3), PCRE2_ZERO_TERMINATED, PCRE2_ANCHORED, &err, &at, NULL);
    if (!re) {
        PCRE2_UCHAR msg[128];
        pcre2_get_error_message(err, msg, sizeof msg);
        KVB_LOG_E(WHAT ": pattern \"%s\": %s at offset %zu", entry, (const char *)msg, (size_t)at);
        return KVB_ERR_INVALID;
    }
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
    int rc = md ? pcre2_match(re, (PCRE2_SPTR)module, strlen(module), 0, 0, md, NULL) : PCRE2_ERROR_NOMEMORY;
    pcre2_match_data_free(md);
    pcre2_code_free(re);
    if (rc == PCRE2_ERROR_NOMEMORY) return KVB_ERR_NOMEM;
    *hit = rc >= 0;
    return KVB_OK;
}

/* Whether some string of the JSON list `l` matches `module`. */
static kvb_status match_list(const json_t *l, const char *module, int *hit) {
    *hit = 0;
    size_t i;
    const json_t *e;
    json_array_foreach(l, i, e) {
        KVB_TRY(match(json_string_value(e), module, hit));
        if (*hit) return KVB_OK;
    }
    return KVB_OK;
}

static kvb_status string_list(const json_t *qc, const char *where, const char *key, int required, const json_t **out) {
    const json_t *l = json_object_get(qc, key);
    *out = NULL;
    if ((!l || json_is_null(l)) && !required) return KVB_OK;
    size_t i;
    const json_t *e;
    int ok = json_is_array(l);
    json_array_foreach(l, i, e) ok = ok && json_is_string(e);
    if (!ok) {
        KVB_LOG_E(WHAT ": %s\"%s\" must be a list of strings", where, key);
        return KVB_ERR_INVALID;
    }
    *out = l;
    return KVB_OK;
}

kvb_status kvb_quant_config_parse(const json_t *qc, int n_layers, int tied, kvb_quant_config *out) {
    memset(out, 0, sizeof *out);
    if (!qc || json_is_null(qc)) return KVB_OK;
    if (!json_is_object(qc)) {
        KVB_LOG_E(WHAT " must be an object or null");
        return KVB_ERR_INVALID;
    }
    if (n_layers < 1 || n_layers > KVB_QUANT_MAX_LAYERS) return KVB_ERR_INVALID;
    const char *method = NULL;
    KVB_TRY(kvb_json_get_str(qc, "quant_method", 0, WHAT, &method));
    if (!method || strcmp(method, "compressed-tensors") != 0) {
        KVB_LOG_E(WHAT ": quant_method \"%s\" is not supported (compressed-tensors FP8, format float-quantized)",
                  method ? method : "(none)");
        return KVB_ERR_UNSUPPORTED;
    }
    static const char *const fmt_ok[] = {"float-quantized", NULL};
    const char *fmt = NULL;
    KVB_TRY(str_field(qc, "", "format", fmt_ok, &fmt));
    KVB_TRY(null_field(qc, "", "kv_cache_scheme", "an FP8 KV cache"));
    KVB_TRY(null_field(qc, "", "transform_config", "a transform (rotation) config"));
    const json_t *sp = json_object_get(qc, "sparsity_config");
    const json_t *spf = json_is_object(sp) ? json_object_get(sp, "format") : NULL;
    if (sp && !json_is_null(sp) && !(json_is_object(sp) && (!spf || (json_is_string(spf) && !strcmp(json_string_value(spf), "dense"))))) {
        KVB_LOG_E(WHAT ": sparsity_config (format \"%s\") is not supported", json_is_string(spf) ? json_string_value(spf) : "?");
        return KVB_ERR_UNSUPPORTED;
    }
    const json_t *groups = json_object_get(qc, "config_groups");
    if (!json_is_object(groups) || json_object_size(groups) == 0) {
        KVB_LOG_E(WHAT ": \"config_groups\" missing or empty");
        return KVB_ERR_INVALID;
    }
    const json_t *ignore = NULL;
    KVB_TRY(string_list(qc, "", "ignore", 0, &ignore));

    /* every group must be the same scheme: kvbank keeps one per model */
    scheme s0 = {0}, s;
    const char *gname;
    const json_t *g;
    int first = 1;
    json_object_foreach((json_t *)groups, gname, g) {
        if (!json_is_object(g)) {
            KVB_LOG_E(WHAT ": config_groups.%s is not an object", gname);
            return KVB_ERR_INVALID;
        }
        KVB_TRY(parse_scheme(g, gname, &s));
        if (!first && (s.per_channel != s0.per_channel || s.act_token != s0.act_token)) {
            KVB_LOG_E(WHAT ": config_groups.%s: a scheme other than the first group's (one scheme per model)", gname);
            return KVB_ERR_UNSUPPORTED;
        }
        s0 = s;
        first = 0;
    }
    out->fp8 = 1;
    out->per_channel = s0.per_channel;
    out->act_token = s0.act_token;

    /* which linear layers: a target of some group and not ignored */
    char module[96], where[160];
    for (int l = 0; l <= n_layers; l++) {
        for (int p = 0; p < KVB_PROJ_COUNT; p++) {
            int last = l == n_layers; /* the LM head, once */
            if (last && p > 0) break;
            if (last) snprintf(module, sizeof module, "lm_head");
            else snprintf(module, sizeof module, "model.layers.%d.%s", l, PROJ_NAMES[p]);
            int targeted = 0, ignored = 0;
            json_object_foreach((json_t *)groups, gname, g) {
                const json_t *targets = NULL;
                snprintf(where, sizeof where, "config_groups.%s.", gname);
                KVB_TRY(string_list(g, where, "targets", 1, &targets));
                int hit = 0;
                KVB_TRY(match_list(targets, module, &hit));
                targeted |= hit;
            }
            if (ignore) KVB_TRY(match_list(ignore, module, &ignored));
            int q = targeted && !ignored;
            if (last) out->lm_head = q;
            else out->layers[l] |= (uint8_t)(q << p);
        }
    }
    if (out->lm_head && tied) {
        KVB_LOG_E(WHAT ": lm_head is quantized but tied to the embedding (tie_word_embeddings): not supported");
        return KVB_ERR_UNSUPPORTED;
    }
    return KVB_OK;
}
