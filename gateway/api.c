/* kvbank-gateway — reading and validating OpenAI request bodies (see api.h). */
#include "gateway/api.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_IDS (1 << 20) /* token ids in one prompt (the wire's frame limit is reached before) */

/* Length of the longest prefix of s[0..n) that ends on a UTF-8 character boundary. */
static size_t utf8_cut(const char *s, size_t n) {
    size_t k = n;
    while (k > 0 && ((unsigned char)s[k - 1] & 0xC0) == 0x80) k--; /* continuation bytes of the last char */
    if (k == 0) return 0;
    unsigned char lead = (unsigned char)s[k - 1];
    size_t need = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
    return n - (k - 1) >= need ? n : k - 1;
}

const char *gw_clip(const char *s, char *buf, size_t n) {
    size_t len = strlen(s);
    if (len < n) {
        memcpy(buf, s, len + 1);
        return buf;
    }
    size_t k = utf8_cut(s, n - 4);
    memcpy(buf, s, k);
    memcpy(buf + k, "...", 4);
    return buf;
}

void gw_error_set(gw_error *e, int status, const char *type, const char *param, const char *fmt, ...) {
    if (!e) return;
    e->status = status;
    e->type = type;
    e->code = NULL;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    /* a message cut short must not end inside a character (the error body is JSON, UTF-8) */
    if (n >= (int)sizeof e->message) e->message[utf8_cut(e->message, sizeof e->message - 1)] = '\0';
}

char *gw_error_body(const gw_error *e, size_t *len) {
    json_t *o = json_pack("{s:{s:s, s:s, s:o, s:o}}", "error", "message", e->message, "type",
                          e->type ? e->type : "invalid_request_error", "param",
                          e->param[0] ? json_string(e->param) : json_null(), "code",
                          e->code ? json_string(e->code) : json_null());
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (len) *len = s ? strlen(s) : 0;
    return s;
}

static kvb_status bad(gw_error *err, const char *param, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static kvb_status bad(gw_error *err, const char *param, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    gw_error_set(err, 400, "invalid_request_error", param, "%s", msg);
    return KVB_ERR_INVALID;
}

/* ------------------------------------------------------------------------------- field readers */

static kvb_status get_bool(json_t *v, const char *name, int *out, gw_error *err) {
    if (json_is_null(v)) return KVB_OK;
    if (!json_is_boolean(v)) return bad(err, name, "'%s' must be a boolean", name);
    *out = json_is_true(v);
    return KVB_OK;
}

/* A finite number in [lo, hi]; null keeps the default. */
static kvb_status get_number(json_t *v, const char *name, double lo, double hi, double *out, gw_error *err) {
    if (json_is_null(v)) return KVB_OK;
    if (!json_is_number(v)) return bad(err, name, "'%s' must be a number", name);
    double x = json_number_value(v);
    if (!isfinite(x) || x < lo || x > hi) return bad(err, name, "'%s' is %g, must be in [%g, %g]", name, x, lo, hi);
    *out = x;
    return KVB_OK;
}

/* An integer in [lo, hi]; null keeps the default. A number with no fractional part counts (4.0). */
static kvb_status get_int(json_t *v, const char *name, int64_t lo, int64_t hi, int64_t *out, gw_error *err) {
    if (json_is_null(v)) return KVB_OK;
    int64_t x;
    if (json_is_integer(v)) {
        x = json_integer_value(v);
    } else if (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)) && fabs(json_real_value(v)) < 9e15) {
        x = (int64_t)json_real_value(v);
    } else {
        return bad(err, name, "'%s' must be an integer", name);
    }
    if (x < lo || x > hi)
        return bad(err, name, "'%s' is %lld, must be in [%lld, %lld]", name, (long long)x, (long long)lo, (long long)hi);
    *out = x;
    return KVB_OK;
}

/* Token ids: a non-empty array of integers in [0, 2^31). Caller frees *ids. */
static kvb_status get_ids(json_t *v, const char *name, int32_t **ids, int *n, gw_error *err) {
    size_t cnt = json_array_size(v);
    if (!json_is_array(v) || cnt == 0) return bad(err, name, "'%s' must be a non-empty array of token ids", name);
    if (cnt > MAX_IDS) {
        gw_error_set(err, 413, "invalid_request_error", name, "'%s' has %zu token ids, more than %d", name, cnt, MAX_IDS);
        return KVB_ERR_INVALID;
    }
    int32_t *a = NULL;
    if (kvb_calloc(cnt, sizeof *a, (void **)&a) != KVB_OK) {
        gw_error_set(err, 500, "server_error", name, "out of memory");
        return KVB_ERR_NOMEM;
    }
    for (size_t i = 0; i < cnt; i++) {
        json_t *x = json_array_get(v, i);
        if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) > INT32_MAX) {
            free(a);
            return bad(err, name, "'%s'[%zu] must be a token id (an integer >= 0)", name, i);
        }
        a[i] = (int32_t)json_integer_value(x);
    }
    *ids = a;
    *n = (int)cnt;
    return KVB_OK;
}

/* Accepts only a neutral value of a field the node does not implement. */
static int neutral(json_t *v, const char *name) {
    if (json_is_null(v)) return 1;
    if (!strcmp(name, "n") || !strcmp(name, "best_of")) return json_is_integer(v) && json_integer_value(v) == 1;
    if (!strcmp(name, "logprobs") || !strcmp(name, "echo")) return json_is_false(v);
    if (!strcmp(name, "top_logprobs") || !strcmp(name, "min_tokens")) return json_is_integer(v) && json_integer_value(v) == 0;
    if (!strcmp(name, "presence_penalty") || !strcmp(name, "frequency_penalty"))
        return json_is_number(v) && json_number_value(v) == 0;
    if (!strcmp(name, "repetition_penalty")) return json_is_number(v) && json_number_value(v) == 1;
    if (!strcmp(name, "logit_bias")) return json_is_object(v) && json_object_size(v) == 0;
    if (!strcmp(name, "parallel_tool_calls")) return json_is_boolean(v);
    if (!strcmp(name, "tools")) return json_is_array(v) && json_array_size(v) == 0;
    if (!strcmp(name, "tool_choice")) return json_is_string(v) && !strcmp(json_string_value(v), "none");
    if (!strcmp(name, "response_format")) {
        json_t *t = json_object_get(v, "type");
        return json_is_object(v) && json_is_string(t) && !strcmp(json_string_value(t), "text");
    }
    return 0; /* suffix and anything else: only null */
}

static const char *const UNSUPPORTED[] = {"n", "best_of", "logprobs", "top_logprobs", "echo", "min_tokens",
                                          "presence_penalty", "frequency_penalty", "repetition_penalty",
                                          "logit_bias", "suffix", "tools", "tool_choice", "parallel_tool_calls",
                                          "response_format", "functions", "function_call", "audio", "modalities",
                                          "prediction", "guided_json", "guided_regex", "guided_choice"};

static int is_unsupported(const char *k) {
    for (size_t i = 0; i < KVB_ARRAY_LEN(UNSUPPORTED); i++)
        if (!strcmp(k, UNSUPPORTED[i])) return 1;
    return 0;
}

static kvb_status get_stop(json_t *v, gw_params *p, gw_error *err) {
    if (json_is_null(v)) return KVB_OK;
    json_t *one = json_is_string(v) ? v : NULL;
    size_t cnt = one ? 1 : json_array_size(v);
    if (!one && !json_is_array(v)) return bad(err, "stop", "'stop' must be a string or an array of strings");
    if (cnt > GW_MAX_STOP) return bad(err, "stop", "'stop' has %zu strings, at most %d are allowed", cnt, GW_MAX_STOP);
    for (size_t i = 0; i < cnt; i++) {
        json_t *s = one ? one : json_array_get(v, i);
        if (!json_is_string(s)) return bad(err, "stop", "'stop'[%zu] must be a string", i);
        size_t n = json_string_length(s);
        if (n == 0) return bad(err, "stop", "'stop'[%zu] is empty", i);
        if (n > GW_MAX_STOP_LEN) return bad(err, "stop", "'stop'[%zu] is longer than %d bytes", i, GW_MAX_STOP_LEN);
        p->stop[p->n_stop] = json_string_value(s);
        p->stop_len[p->n_stop] = n;
        p->n_stop++;
    }
    return KVB_OK;
}

static kvb_status get_prompt(json_t *v, gw_params *p, gw_error *err) {
    /* a string, token ids, or a list holding exactly one of those */
    if (json_is_array(v) && json_array_size(v) == 1 &&
        (json_is_string(json_array_get(v, 0)) || json_is_array(json_array_get(v, 0))))
        v = json_array_get(v, 0);
    else if (json_is_array(v) && json_array_size(v) > 1 &&
             (json_is_string(json_array_get(v, 0)) || json_is_array(json_array_get(v, 0))))
        return bad(err, "prompt", "'prompt' holds %zu prompts; this server takes one prompt per request",
                   json_array_size(v));
    if (json_is_string(v)) {
        if (json_string_length(v) == 0) return bad(err, "prompt", "'prompt' is empty");
        p->prompt_text = json_string_value(v);
        p->prompt_len = json_string_length(v);
        return KVB_OK;
    }
    if (json_is_array(v)) return get_ids(v, "prompt", &p->prompt_ids, &p->n_prompt_ids, err);
    return bad(err, "prompt", "'prompt' must be a string or an array of token ids");
}

static kvb_status check_messages(json_t *v, gw_error *err) {
    if (!json_is_array(v) || json_array_size(v) == 0) return bad(err, "messages", "'messages' must be a non-empty array");
    for (size_t i = 0; i < json_array_size(v); i++) {
        json_t *m = json_array_get(v, i);
        if (!json_is_object(m)) return bad(err, "messages", "'messages'[%zu] must be an object", i);
        json_t *role = json_object_get(m, "role");
        if (!json_is_string(role)) return bad(err, "messages", "'messages'[%zu].role must be a string", i);
        json_t *c = json_object_get(m, "content");
        if (json_is_null(c) || json_is_string(c)) continue;
        /* content parts: only text parts */
        if (!json_is_array(c)) return bad(err, "messages", "'messages'[%zu].content must be a string or an array of parts", i);
        for (size_t k = 0; k < json_array_size(c); k++) {
            json_t *part = json_array_get(c, k);
            json_t *ty = json_object_get(part, "type");
            if (!json_is_object(part) || !json_is_string(ty) || strcmp(json_string_value(ty), "text") ||
                !json_is_string(json_object_get(part, "text")))
                return bad(err, "messages", "'messages'[%zu].content[%zu]: only {\"type\": \"text\", \"text\": ...} parts are supported",
                           i, k);
        }
    }
    return KVB_OK;
}

/* Loads `body` as a JSON object. */
static kvb_status load_object(const char *body, size_t len, json_t **doc, gw_error *err) {
    json_error_t je;
    json_t *j = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!j) return bad(err, NULL, "the body is not valid JSON: %s (line %d, column %d)", je.text, je.line, je.column);
    if (!json_is_object(j)) {
        json_decref(j);
        return bad(err, NULL, "the body must be a JSON object");
    }
    *doc = j;
    return KVB_OK;
}

static kvb_status get_model(json_t *o, const char **model, gw_error *err) {
    json_t *m = json_object_get(o, "model");
    if (!m) return bad(err, "model", "'model' is required");
    if (!json_is_string(m) || json_string_length(m) == 0) return bad(err, "model", "'model' must be a non-empty string");
    *model = json_string_value(m);
    return KVB_OK;
}

kvb_status gw_params_parse(gw_endpoint ep, const char *body, size_t len, gw_params *p, json_t **doc, gw_error *err) {
    memset(p, 0, sizeof *p);
    *doc = NULL;
    p->ep = ep;
    p->temperature = 1.0;
    p->top_p = 1.0;
    p->skip_special_tokens = 1;
    p->add_special_tokens = ep == GW_COMPLETIONS;
    p->add_generation_prompt = 1;
    p->tbt_slo_ms = -1;
    json_t *o = NULL;
    KVB_TRY(load_object(body, len, &o, err));
    kvb_status st = get_model(o, &p->model, err);
    const char *key;
    json_t *v;
    int64_t x = 0;
    json_object_foreach(o, key, v) {
        if (st != KVB_OK) break;
        if (!strcmp(key, "model")) continue;
        if (!strcmp(key, "prompt") && ep == GW_COMPLETIONS) {
            st = get_prompt(v, p, err);
        } else if (!strcmp(key, "messages") && ep == GW_CHAT) {
            st = check_messages(v, err);
            p->messages = v;
        } else if (!strcmp(key, "max_tokens") || (!strcmp(key, "max_completion_tokens") && ep == GW_CHAT)) {
            x = 0;
            st = get_int(v, key, 1, INT32_MAX, &x, err);
            if (st == KVB_OK && x) p->max_tokens = (int)x;
        } else if (!strcmp(key, "temperature")) {
            st = get_number(v, key, 0, 2, &p->temperature, err);
        } else if (!strcmp(key, "top_p")) {
            st = get_number(v, key, 1e-9, 1, &p->top_p, err);
        } else if (!strcmp(key, "top_k")) {
            x = 0;
            st = get_int(v, key, -1, INT32_MAX, &x, err);
            p->top_k = x < 0 ? 0 : (int)x;
        } else if (!strcmp(key, "seed")) {
            x = 0;
            st = get_int(v, key, INT64_MIN, INT64_MAX, &x, err);
            if (st == KVB_OK && !json_is_null(v)) {
                p->has_seed = 1;
                p->seed = (uint64_t)x;
            }
        } else if (!strcmp(key, "stop")) {
            st = get_stop(v, p, err);
        } else if (!strcmp(key, "stop_token_ids")) {
            if (json_is_null(v)) continue;
            if (!json_is_array(v) || json_array_size(v) > GW_MAX_STOP_IDS) {
                st = bad(err, key, "'stop_token_ids' must be an array of at most %d token ids", GW_MAX_STOP_IDS);
                continue;
            }
            for (size_t i = 0; i < json_array_size(v) && st == KVB_OK; i++) {
                json_t *t = json_array_get(v, i);
                if (!json_is_integer(t) || json_integer_value(t) < 0 || json_integer_value(t) > INT32_MAX)
                    st = bad(err, key, "'stop_token_ids'[%zu] must be a token id", i);
                else p->stop_ids[p->n_stop_ids++] = (int32_t)json_integer_value(t);
            }
        } else if (!strcmp(key, "ignore_eos")) {
            st = get_bool(v, key, &p->ignore_eos, err);
        } else if (!strcmp(key, "stream")) {
            st = get_bool(v, key, &p->stream, err);
        } else if (!strcmp(key, "stream_options")) {
            if (json_is_null(v)) continue;
            if (!json_is_object(v)) {
                st = bad(err, key, "'stream_options' must be an object");
                continue;
            }
            const char *k2;
            json_t *v2;
            json_object_foreach(v, k2, v2) {
                if (st != KVB_OK) break;
                if (!strcmp(k2, "include_usage")) st = get_bool(v2, "stream_options.include_usage", &p->include_usage, err);
                else if (!strcmp(k2, "continuous_usage_stats") && (json_is_false(v2) || json_is_null(v2))) continue;
                else st = bad(err, "stream_options", "unknown field 'stream_options.%s'", k2);
            }
        } else if (!strcmp(key, "return_token_ids")) {
            st = get_bool(v, key, &p->return_token_ids, err);
        } else if (!strcmp(key, "skip_special_tokens")) {
            st = get_bool(v, key, &p->skip_special_tokens, err);
        } else if (!strcmp(key, "add_special_tokens")) {
            st = get_bool(v, key, &p->add_special_tokens, err);
        } else if (!strcmp(key, "add_generation_prompt") && ep == GW_CHAT) {
            st = get_bool(v, key, &p->add_generation_prompt, err);
        } else if (!strcmp(key, "chat_template_kwargs") && ep == GW_CHAT) {
            if (json_is_null(v)) continue;
            if (!json_is_object(v)) st = bad(err, key, "'chat_template_kwargs' must be an object");
            else p->template_kwargs = v;
        } else if (!strcmp(key, "kvbank_tbt_slo_ms")) {
            st = get_number(v, key, 0, 60000, &p->tbt_slo_ms, err);
        } else if (!strcmp(key, "kvbank_timings")) {
            st = get_bool(v, key, &p->timings, err);
        } else if (!strcmp(key, "user")) {
            if (!json_is_string(v) && !json_is_null(v)) st = bad(err, key, "'user' must be a string");
        } else if (is_unsupported(key)) {
            if (!neutral(v, key)) st = bad(err, key, "'%s' is not supported by this server", key);
        } else {
            st = bad(err, key, "unknown field '%s'", key);
        }
    }
    if (st == KVB_OK && ep == GW_COMPLETIONS && !p->prompt_text && !p->prompt_ids)
        st = bad(err, "prompt", "'prompt' is required");
    if (st == KVB_OK && ep == GW_CHAT && !p->messages) st = bad(err, "messages", "'messages' is required");
    if (st == KVB_OK && p->include_usage && !p->stream)
        st = bad(err, "stream_options", "'stream_options' is only allowed with \"stream\": true");
    if (st != KVB_OK) {
        gw_params_free(p);
        json_decref(o);
        return st;
    }
    *doc = o;
    return KVB_OK;
}

void gw_params_free(gw_params *p) {
    if (!p) return;
    free(p->prompt_ids);
    p->prompt_ids = NULL;
    p->n_prompt_ids = 0;
}

kvb_status gw_tok_params_parse(int detokenize, const char *body, size_t len, gw_tok_params *p, json_t **doc,
                               gw_error *err) {
    memset(p, 0, sizeof *p);
    *doc = NULL;
    p->add_special_tokens = -1;
    p->add_generation_prompt = 1;
    json_t *o = NULL;
    KVB_TRY(load_object(body, len, &o, err));
    kvb_status st = get_model(o, &p->model, err);
    const char *key;
    json_t *v;
    json_object_foreach(o, key, v) {
        if (st != KVB_OK) break;
        if (!strcmp(key, "model")) continue;
        if (detokenize && !strcmp(key, "tokens")) {
            st = get_ids(v, key, &p->ids, &p->n_ids, err);
        } else if (!detokenize && !strcmp(key, "prompt")) {
            if (!json_is_string(v)) st = bad(err, key, "'prompt' must be a string");
            p->prompt = json_string_value(v);
            p->prompt_len = json_string_length(v);
        } else if (!detokenize && !strcmp(key, "messages")) {
            st = check_messages(v, err);
            p->messages = v;
        } else if (!detokenize && !strcmp(key, "add_special_tokens")) {
            int b = 0;
            st = get_bool(v, key, &b, err);
            if (!json_is_null(v)) p->add_special_tokens = b;
        } else if (!detokenize && !strcmp(key, "add_generation_prompt")) {
            st = get_bool(v, key, &p->add_generation_prompt, err);
        } else {
            st = bad(err, key, "unknown field '%s'", key);
        }
    }
    if (st == KVB_OK && detokenize && !p->ids) st = bad(err, "tokens", "'tokens' is required");
    if (st == KVB_OK && !detokenize && !p->prompt == !p->messages)
        st = bad(err, "prompt", "exactly one of 'prompt' and 'messages' is required");
    if (p->add_special_tokens < 0) p->add_special_tokens = p->messages ? 0 : 1;
    if (st != KVB_OK) {
        gw_tok_params_free(p);
        json_decref(o);
        return st;
    }
    *doc = o;
    return KVB_OK;
}

void gw_tok_params_free(gw_tok_params *p) {
    if (!p) return;
    free(p->ids);
    p->ids = NULL;
}
