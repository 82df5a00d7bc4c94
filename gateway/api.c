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
    e->retry_after_s = 0;
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

/* One prompt: a non-empty string or a non-empty array of token ids. */
static kvb_status get_one_prompt(json_t *v, const char *name, gw_prompt *out, gw_error *err) {
    if (json_is_string(v)) {
        if (json_string_length(v) == 0) return bad(err, "prompt", "'%s' is empty", name);
        out->text = json_string_value(v);
        out->len = json_string_length(v);
        return KVB_OK;
    }
    if (json_is_array(v)) {
        kvb_status st = get_ids(v, name, &out->ids, &out->n_ids, err);
        if (st != KVB_OK) snprintf(err->param, sizeof err->param, "prompt");
        return st;
    }
    return bad(err, "prompt", "'%s' must be a string or an array of token ids", name);
}

static kvb_status get_prompt(json_t *v, gw_params *p, gw_error *err) {
    /* a string, token ids, or a list of strings or of token id lists: one prompt each */
    json_t *first = json_array_get(v, 0);
    int many = json_is_array(v) && (json_is_string(first) || json_is_array(first));
    size_t n = many ? json_array_size(v) : 1, total = 0;
    if (n > GW_MAX_CHOICES) return bad(err, "prompt", "'prompt' holds %zu prompts, at most %d", n, GW_MAX_CHOICES);
    if (kvb_calloc(n, sizeof *p->prompts, (void **)&p->prompts) != KVB_OK) {
        gw_error_set(err, 500, "server_error", "prompt", "out of memory");
        return KVB_ERR_NOMEM;
    }
    p->n_prompts = (int)n;
    for (size_t i = 0; i < n; i++) {
        char name[32];
        if (many) snprintf(name, sizeof name, "prompt[%zu]", i);
        else snprintf(name, sizeof name, "prompt");
        KVB_TRY(get_one_prompt(many ? json_array_get(v, i) : v, name, &p->prompts[i], err));
        total += (size_t)p->prompts[i].n_ids;
        if (total > MAX_IDS) {
            gw_error_set(err, 413, "invalid_request_error", "prompt", "'prompt' has more than %d token ids", MAX_IDS);
            return KVB_ERR_INVALID;
        }
    }
    return KVB_OK;
}

/* An assistant message's tool_calls: [{id, type: "function", function: {name, arguments}}]. */
static kvb_status check_tool_calls(json_t *tc, size_t i, gw_error *err) {
    if (!json_is_array(tc)) return bad(err, "messages", "'messages'[%zu].tool_calls must be an array", i);
    for (size_t k = 0; k < json_array_size(tc); k++) {
        json_t *c = json_array_get(tc, k), *fn = json_object_get(c, "function"), *ty = json_object_get(c, "type");
        json_t *args = json_object_get(fn, "arguments");
        if (!json_is_object(c) || !json_is_string(json_object_get(c, "id")) ||
            (ty && !(json_is_string(ty) && !strcmp(json_string_value(ty), "function"))) || !json_is_object(fn) ||
            !json_is_string(json_object_get(fn, "name")) || !(json_is_string(args) || json_is_object(args)))
            return bad(err, "messages",
                       "'messages'[%zu].tool_calls[%zu] must be {\"id\": ..., \"type\": \"function\", \"function\": "
                       "{\"name\": ..., \"arguments\": ...}}", i, k);
        if (json_is_string(args)) { /* the template gets the object: it must be JSON */
            json_t *a = json_loads(json_string_value(args), JSON_DECODE_ANY, NULL);
            int ok = a != NULL;
            json_decref(a);
            if (!ok) return bad(err, "messages", "'messages'[%zu].tool_calls[%zu].function.arguments is not JSON", i, k);
        }
    }
    return KVB_OK;
}

static kvb_status check_messages(json_t *v, int *has_tool_calls, gw_error *err) {
    if (!json_is_array(v) || json_array_size(v) == 0) return bad(err, "messages", "'messages' must be a non-empty array");
    for (size_t i = 0; i < json_array_size(v); i++) {
        json_t *m = json_array_get(v, i);
        if (!json_is_object(m)) return bad(err, "messages", "'messages'[%zu] must be an object", i);
        json_t *role = json_object_get(m, "role");
        if (!json_is_string(role)) return bad(err, "messages", "'messages'[%zu].role must be a string", i);
        json_t *tc = json_object_get(m, "tool_calls");
        if (tc && !json_is_null(tc)) {
            if (strcmp(json_string_value(role), "assistant"))
                return bad(err, "messages", "'messages'[%zu]: only an assistant message has tool_calls", i);
            KVB_TRY(check_tool_calls(tc, i, err));
            if (has_tool_calls) *has_tool_calls = 1;
        }
        if (!strcmp(json_string_value(role), "tool") && !json_is_string(json_object_get(m, "tool_call_id")))
            return bad(err, "messages", "'messages'[%zu]: a tool message needs its 'tool_call_id' (a string)", i);
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

/* ------------------------------------------------------------------------------------- readers
 * One per handled field: `v` is not null. */

static kvb_status rd_prompt(json_t *v, const char *name, gw_params *p, gw_error *err) {
    (void)name;
    return get_prompt(v, p, err);
}

static kvb_status rd_messages(json_t *v, const char *name, gw_params *p, gw_error *err) {
    (void)name;
    p->messages = v;
    return check_messages(v, &p->has_tool_messages, err);
}

static kvb_status rd_max_tokens(json_t *v, const char *name, gw_params *p, gw_error *err) {
    int64_t x = 0;
    /* 0: vLLM's echo without generation (checked with echo once every field is read) */
    KVB_TRY(get_int(v, name, p->ep == GW_COMPLETIONS ? 0 : 1, INT32_MAX, &x, err));
    p->max_tokens = (int)x;
    p->echo_only = x == 0;
    return KVB_OK;
}

static kvb_status rd_temperature(json_t *v, const char *name, gw_params *p, gw_error *err) {
    return get_number(v, name, 0, 2, &p->temperature, err);
}

static kvb_status rd_top_p(json_t *v, const char *name, gw_params *p, gw_error *err) {
    return get_number(v, name, 1e-9, 1, &p->top_p, err);
}

static kvb_status rd_top_k(json_t *v, const char *name, gw_params *p, gw_error *err) {
    int64_t x = 0;
    KVB_TRY(get_int(v, name, -1, INT32_MAX, &x, err));
    p->top_k = x < 0 ? 0 : (int)x;
    return KVB_OK;
}

static kvb_status rd_seed(json_t *v, const char *name, gw_params *p, gw_error *err) {
    int64_t x = 0;
    KVB_TRY(get_int(v, name, INT64_MIN, INT64_MAX, &x, err));
    p->has_seed = 1;
    p->seed = (uint64_t)x;
    return KVB_OK;
}

/* Number and integer members in [lo, hi], by field name. */
#define RD_NUM(fn, member, lo, hi)                                                                                     \
    static kvb_status fn(json_t *v, const char *name, gw_params *p, gw_error *err) {                                   \
        return get_number(v, name, lo, hi, &p->member, err);                                                           \
    }
#define RD_INT(fn, member, lo, hi)                                                                                     \
    static kvb_status fn(json_t *v, const char *name, gw_params *p, gw_error *err) {                                   \
        int64_t x = p->member;                                                                                         \
        KVB_TRY(get_int(v, name, lo, hi, &x, err));                                                                    \
        p->member = (int)x;                                                                                            \
        return KVB_OK;                                                                                                 \
    }
RD_NUM(rd_min_p, min_p, 0, 1)
RD_NUM(rd_presence, presence_penalty, -2, 2) /* OpenAI's ranges */
RD_NUM(rd_frequency, frequency_penalty, -2, 2)
RD_INT(rd_min_tokens, min_tokens, 0, INT32_MAX)
RD_INT(rd_n, n, 1, GW_MAX_CHOICES)
RD_INT(rd_best_of, best_of, 1, GW_MAX_CHOICES)
#undef RD_NUM
#undef RD_INT

static kvb_status rd_repetition(json_t *v, const char *name, gw_params *p, gw_error *err) {
    double x = 1;
    KVB_TRY(get_number(v, name, 0, 1e6, &x, err));
    if (x <= 0) return bad(err, name, "'%s' is %g, must be > 0 (1: off)", name, x);
    p->repetition_penalty = x;
    return KVB_OK;
}

/* {"token id": bias}: ids as decimal strings, biases in [-100, 100] (OpenAI's range). */
static kvb_status rd_logit_bias(json_t *v, const char *name, gw_params *p, gw_error *err) {
    if (!json_is_object(v)) return bad(err, name, "'%s' must be an object of token ids to biases", name);
    size_t n = json_object_size(v);
    if (n > KVB_MAX_LOGIT_BIAS) return bad(err, name, "'%s' has %zu entries, at most %d", name, n, KVB_MAX_LOGIT_BIAS);
    if (!n) return KVB_OK;
    if (kvb_calloc(n, sizeof *p->logit_bias, (void **)&p->logit_bias) != KVB_OK) {
        gw_error_set(err, 500, "server_error", name, "out of memory");
        return KVB_ERR_NOMEM;
    }
    const char *k;
    json_t *x;
    json_object_foreach(v, k, x) {
        char clip[40];
        int64_t id = -1;
        if (kvb_parse_i64(k, 0, INT32_MAX, &id) != KVB_OK)
            return bad(err, name, "'%s' key '%s' is not a token id", name, gw_clip(k, clip, sizeof clip));
        if (!json_is_number(x) || !(json_number_value(x) >= -100 && json_number_value(x) <= 100))
            return bad(err, name, "'%s' of token %lld must be a number in [-100, 100]", name, (long long)id);
        p->logit_bias[p->n_logit_bias++] = (kvb_logit_bias){.id = (int32_t)id, .bias = (float)json_number_value(x)};
    }
    return KVB_OK;
}

/* completions: the number of alternatives (0-20); false: none asked */
static kvb_status rd_logprobs_n(json_t *v, const char *name, gw_params *p, gw_error *err) {
    if (json_is_false(v)) return KVB_OK;
    int64_t x = 0;
    if (json_is_boolean(v) || get_int(v, name, 0, KVB_MAX_TOP_LOGPROBS, &x, err) != KVB_OK)
        return bad(err, name, "'%s' is the number of alternatives per token in /v1/completions: an integer in [0, %d]",
                   name, KVB_MAX_TOP_LOGPROBS);
    p->logprobs = 1;
    p->top_logprobs = (int)x;
    return KVB_OK;
}

static kvb_status rd_top_logprobs(json_t *v, const char *name, gw_params *p, gw_error *err) {
    int64_t x = 0;
    KVB_TRY(get_int(v, name, 0, KVB_MAX_TOP_LOGPROBS, &x, err));
    p->top_logprobs = (int)x;
    p->has_top_logprobs = 1;
    return KVB_OK;
}

static kvb_status rd_stop(json_t *v, const char *name, gw_params *p, gw_error *err) {
    (void)name;
    return get_stop(v, p, err);
}

static kvb_status rd_stop_ids(json_t *v, const char *name, gw_params *p, gw_error *err) {
    if (!json_is_array(v) || json_array_size(v) > GW_MAX_STOP_IDS)
        return bad(err, name, "'%s' must be an array of at most %d token ids", name, GW_MAX_STOP_IDS);
    for (size_t i = 0; i < json_array_size(v); i++) {
        json_t *t = json_array_get(v, i);
        if (!json_is_integer(t) || json_integer_value(t) < 0 || json_integer_value(t) > INT32_MAX)
            return bad(err, name, "'%s'[%zu] must be a token id", name, i);
        p->stop_ids[p->n_stop_ids++] = (int32_t)json_integer_value(t);
    }
    return KVB_OK;
}

static kvb_status rd_stream_options(json_t *v, const char *name, gw_params *p, gw_error *err) {
    if (!json_is_object(v)) return bad(err, name, "'%s' must be an object", name);
    const char *k;
    json_t *x;
    json_object_foreach(v, k, x) {
        if (!strcmp(k, "include_usage")) KVB_TRY(get_bool(x, "stream_options.include_usage", &p->include_usage, err));
        else if (!strcmp(k, "continuous_usage_stats") && (json_is_false(x) || json_is_null(x))) continue;
        else return bad(err, name, "unknown field 'stream_options.%s'", k);
    }
    return KVB_OK;
}

static kvb_status rd_template_kwargs(json_t *v, const char *name, gw_params *p, gw_error *err) {
    if (!json_is_object(v)) return bad(err, name, "'%s' must be an object", name);
    p->template_kwargs = v;
    return KVB_OK;
}

static kvb_status rd_tbt_slo(json_t *v, const char *name, gw_params *p, gw_error *err) {
    return get_number(v, name, 0, 60000, &p->tbt_slo_ms, err);
}


/* ---------------------------------------------------------------- structured output and tools */

/* `field` asks for a grammar; one field per request may. */
static kvb_status grammar_claim(gw_params *p, const char *field, gw_error *err) {
    if (p->grammar_field)
        return bad(err, field, "'%s' and '%s' both ask for structured output: give one of them", p->grammar_field, field);
    p->grammar_field = field;
    p->n_grammar = 1;
    return KVB_OK;
}

/* A JSON Schema (an object or a boolean), kept as compact text. */
static kvb_status grammar_schema(gw_params *p, const char *field, json_t *schema, gw_error *err) {
    if (!json_is_object(schema) && !json_is_boolean(schema))
        return bad(err, field, "the schema of '%s' must be a JSON object", field);
    KVB_TRY(grammar_claim(p, field, err));
    p->grammar_text = json_dumps(schema, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!p->grammar_text) {
        gw_error_set(err, 500, "server_error", field, "out of memory");
        return KVB_ERR_NOMEM;
    }
    p->grammar[0] = (kvb_grammar_part){.kind = KVB_GRAMMAR_JSON_SCHEMA, .text = p->grammar_text,
                                       .len = strlen(p->grammar_text)};
    return KVB_OK;
}

/* guided_json and structured_outputs.json: a schema, or its JSON text. */
static kvb_status grammar_json(gw_params *p, const char *field, json_t *v, gw_error *err) {
    if (!json_is_string(v) && !json_is_object(v))
        return bad(err, field, "'%s' must be a JSON Schema (an object, or its text)", field);
    if (!json_is_string(v)) return grammar_schema(p, field, v, err);
    json_error_t je;
    json_t *j = json_loadb(json_string_value(v), json_string_length(v), JSON_DECODE_ANY, &je);
    if (!j) return bad(err, field, "'%s' is not valid JSON: %s", field, je.text);
    kvb_status st = grammar_schema(p, field, j, err);
    json_decref(j);
    return st;
}

static kvb_status grammar_regex(gw_params *p, const char *field, json_t *v, gw_error *err) {
    if (!json_is_string(v) || json_string_length(v) == 0) return bad(err, field, "'%s' must be a non-empty string", field);
    KVB_TRY(grammar_claim(p, field, err));
    p->grammar[0] = (kvb_grammar_part){.kind = KVB_GRAMMAR_REGEX, .text = json_string_value(v), .len = json_string_length(v)};
    return KVB_OK;
}

static kvb_status grammar_choice(gw_params *p, const char *field, json_t *v, gw_error *err) {
    size_t n = json_array_size(v);
    if (!json_is_array(v) || n == 0 || n > 10000)
        return bad(err, field, "'%s' must be an array of 1 to 10000 strings", field);
    for (size_t i = 0; i < n; i++) {
        json_t *c = json_array_get(v, i);
        if (!json_is_string(c) || strlen(json_string_value(c)) != json_string_length(c))
            return bad(err, field, "'%s'[%zu] must be a string (without NUL characters)", field, i);
    }
    KVB_TRY(grammar_claim(p, field, err));
    if (kvb_calloc(n, sizeof *p->grammar_choices, (void **)&p->grammar_choices) != KVB_OK) {
        gw_error_set(err, 500, "server_error", field, "out of memory");
        return KVB_ERR_NOMEM;
    }
    for (size_t i = 0; i < n; i++) p->grammar_choices[i] = json_string_value(json_array_get(v, i));
    p->grammar[0] = (kvb_grammar_part){.kind = KVB_GRAMMAR_CHOICE, .choices = p->grammar_choices, .n_choices = (int)n};
    return KVB_OK;
}

static kvb_status grammar_object(gw_params *p, const char *field, gw_error *err) {
    KVB_TRY(grammar_claim(p, field, err));
    p->grammar[0] = (kvb_grammar_part){.kind = KVB_GRAMMAR_JSON_OBJECT};
    return KVB_OK;
}

/* 1..64 of [a-zA-Z0-9_-] (OpenAI's rule for function and json_schema names). */
static int valid_name(json_t *s) {
    size_t n = json_string_length(s);
    if (!json_is_string(s) || n == 0 || n > 64) return 0;
    for (const char *c = json_string_value(s); *c; c++)
        if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') || *c == '_' || *c == '-'))
            return 0;
    return 1;
}

static kvb_status rd_response_format(json_t *v, const char *name, gw_params *p, gw_error *err) {
    if (!json_is_object(v)) return bad(err, name, "'%s' must be an object", name);
    json_t *t = json_object_get(v, "type"), *js = json_object_get(v, "json_schema");
    const char *k;
    json_t *x;
    json_object_foreach(v, k, x) {
        if (strcmp(k, "type") && strcmp(k, "json_schema")) return bad(err, name, "unknown field 'response_format.%s'", k);
    }
    const char *ty = json_is_string(t) ? json_string_value(t) : "";
    if (!strcmp(ty, "structural_tag")) return bad(err, name, "'response_format' of type \"structural_tag\" is not supported by this server");
    if (strcmp(ty, "text") && strcmp(ty, "json_object") && strcmp(ty, "json_schema"))
        return bad(err, name, "'response_format.type' must be \"text\", \"json_object\" or \"json_schema\"");
    if (js && strcmp(ty, "json_schema")) return bad(err, name, "'response_format.json_schema' goes with \"type\": \"json_schema\"");
    if (!strcmp(ty, "text")) return KVB_OK;
    if (!strcmp(ty, "json_object")) return grammar_object(p, name, err);
    if (!json_is_object(js)) return bad(err, name, "'response_format.json_schema' must be an object with 'name' and 'schema'");
    json_object_foreach(js, k, x) {
        if (!strcmp(k, "name")) {
            if (!valid_name(x)) return bad(err, name, "'response_format.json_schema.name' must be 1 to 64 of a-z, A-Z, 0-9, _ and -");
        } else if (!strcmp(k, "description")) {
            if (!json_is_string(x)) return bad(err, name, "'response_format.json_schema.description' must be a string");
        } else if (!strcmp(k, "strict")) {
            if (!json_is_boolean(x) && !json_is_null(x)) return bad(err, name, "'response_format.json_schema.strict' must be a boolean");
            if (json_is_false(x)) p->grammar_flags |= GW_GRAMMAR_LAX;
        } else if (strcmp(k, "schema")) {
            return bad(err, name, "unknown field 'response_format.json_schema.%s'", k);
        }
    }
    if (!json_object_get(js, "name")) return bad(err, name, "'response_format.json_schema.name' is required");
    json_t *schema = json_object_get(js, "schema");
    if (!schema || json_is_null(schema)) return grammar_object(p, name, err); /* no schema: any object */
    return grammar_schema(p, name, schema, err);
}

static kvb_status rd_guided_json(json_t *v, const char *name, gw_params *p, gw_error *err) {
    return grammar_json(p, name, v, err);
}
static kvb_status rd_guided_regex(json_t *v, const char *name, gw_params *p, gw_error *err) {
    return grammar_regex(p, name, v, err);
}
static kvb_status rd_guided_choice(json_t *v, const char *name, gw_params *p, gw_error *err) {
    return grammar_choice(p, name, v, err);
}

/* vLLM's structured_outputs (the guided_* fields' successor): exactly one of json, regex, choice,
 * json_object, and its whitespace option. */
static kvb_status rd_structured_outputs(json_t *v, const char *name, gw_params *p, gw_error *err) {
    if (!json_is_object(v)) return bad(err, name, "'%s' must be an object", name);
    const char *k;
    json_t *x;
    json_object_foreach(v, k, x) {
        if (json_is_null(x)) continue;
        if (!strcmp(k, "json")) KVB_TRY(grammar_json(p, name, x, err));
        else if (!strcmp(k, "regex")) KVB_TRY(grammar_regex(p, name, x, err));
        else if (!strcmp(k, "choice")) KVB_TRY(grammar_choice(p, name, x, err));
        else if (!strcmp(k, "json_object")) {
            if (!json_is_boolean(x)) return bad(err, name, "'structured_outputs.json_object' must be a boolean");
            if (json_is_true(x)) KVB_TRY(grammar_object(p, name, err));
        } else if (!strcmp(k, "disable_any_whitespace")) {
            if (!json_is_boolean(x)) return bad(err, name, "'structured_outputs.disable_any_whitespace' must be a boolean");
            if (json_is_true(x)) p->grammar_flags |= GW_GRAMMAR_COMPACT;
        } else if (!strcmp(k, "disable_additional_properties") || !strcmp(k, "disable_fallback")) {
            /* additional properties are off already (strict); there is no other backend to fall back on */
            if (!json_is_boolean(x)) return bad(err, name, "'structured_outputs.%s' must be a boolean", k);
        } else if (!strcmp(k, "grammar") || !strcmp(k, "structural_tag") || !strcmp(k, "whitespace_pattern")) {
            return bad(err, name, "'structured_outputs.%s' is not supported by this server", k);
        } else {
            return bad(err, name, "unknown field 'structured_outputs.%s'", k);
        }
    }
    return KVB_OK;
}

static kvb_status rd_tools(json_t *v, const char *name, gw_params *p, gw_error *err) {
    size_t n = json_array_size(v);
    if (!json_is_array(v) || n > GW_MAX_TOOLS) return bad(err, name, "'tools' must be an array of at most %d tools", GW_MAX_TOOLS);
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(v, i), *ty = json_object_get(t, "type"), *fn = json_object_get(t, "function");
        const char *k;
        json_t *x;
        if (!json_is_object(t) || !json_is_string(ty) || strcmp(json_string_value(ty), "function") || !json_is_object(fn))
            return bad(err, name, "'tools'[%zu] must be {\"type\": \"function\", \"function\": {\"name\": ...}}", i);
        json_object_foreach(t, k, x) {
            if (strcmp(k, "type") && strcmp(k, "function")) return bad(err, name, "unknown field 'tools'[%zu].%s", i, k);
        }
        if (!valid_name(json_object_get(fn, "name")))
            return bad(err, name, "'tools'[%zu].function.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -", i);
        json_object_foreach(fn, k, x) {
            if (!strcmp(k, "name")) continue;
            if (!strcmp(k, "description") ? !json_is_string(x) && !json_is_null(x)
                : !strcmp(k, "parameters") ? !json_is_object(x) && !json_is_null(x)
                : !strcmp(k, "strict") ? !json_is_boolean(x) && !json_is_null(x) : 1)
                return bad(err, name, "'tools'[%zu].function.%s: %s", i, k,
                           !strcmp(k, "description") ? "must be a string" : !strcmp(k, "parameters") ? "must be a JSON Schema object"
                           : !strcmp(k, "strict") ? "must be a boolean" : "unknown field");
        }
        for (size_t j = 0; j < i; j++)
            if (!strcmp(json_string_value(json_object_get(json_object_get(json_array_get(v, j), "function"), "name")),
                        json_string_value(json_object_get(fn, "name"))))
                return bad(err, name, "'tools' has two functions named '%s'", json_string_value(json_object_get(fn, "name")));
    }
    p->tools = n ? v : NULL;
    return KVB_OK;
}

static kvb_status rd_tool_choice(json_t *v, const char *name, gw_params *p, gw_error *err) {
    if (json_is_string(v)) {
        const char *c = json_string_value(v);
        p->tool_choice = !strcmp(c, "none") ? GW_TOOL_NONE : !strcmp(c, "auto") ? GW_TOOL_AUTO : !strcmp(c, "required") ? GW_TOOL_REQUIRED : -2;
        if (p->tool_choice == -2) return bad(err, name, "'tool_choice' must be \"none\", \"auto\", \"required\" or a function");
        return KVB_OK;
    }
    json_t *ty = json_object_get(v, "type"), *fn = json_object_get(v, "function");
    if (!json_is_object(v) || !json_is_string(ty) || strcmp(json_string_value(ty), "function") ||
        !json_is_string(json_object_get(fn, "name")))
        return bad(err, name, "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}");
    p->tool_choice = GW_TOOL_NAMED;
    p->tool_name = json_string_value(json_object_get(fn, "name"));
    return KVB_OK;
}

/* What the tool fields ask for, together: a tool_choice needs tools, a named function must be one of
 * them, a forced call leaves no room for another grammar. */
static kvb_status tools_check(gw_params *p, gw_error *err) {
    if (!p->tools) {
        if (p->tool_choice > GW_TOOL_NONE) return bad(err, "tool_choice", "'tool_choice' needs 'tools'");
        p->tool_choice = GW_TOOL_NONE;
        return KVB_OK;
    }
    if (p->tool_choice < 0) p->tool_choice = GW_TOOL_AUTO;
    if (p->tool_choice == GW_TOOL_NAMED) {
        int found = 0;
        for (size_t i = 0; i < json_array_size(p->tools); i++)
            found |= !strcmp(json_string_value(json_object_get(json_object_get(json_array_get(p->tools, i), "function"), "name")),
                             p->tool_name);
        if (!found) {
            char clip[72];
            return bad(err, "tool_choice", "'tool_choice' names '%s', which is not among the tools", gw_clip(p->tool_name, clip, sizeof clip));
        }
    }
    if ((p->tool_choice == GW_TOOL_REQUIRED || p->tool_choice == GW_TOOL_NAMED) && p->grammar_field)
        return bad(err, p->grammar_field, "'%s' cannot be combined with a forced tool call (tool_choice)", p->grammar_field);
    return KVB_OK;
}

/* The boolean members, by field name. */
#define RD_BOOL(fn, member)                                                                                            \
    static kvb_status fn(json_t *v, const char *name, gw_params *p, gw_error *err) {                                   \
        return get_bool(v, name, &p->member, err);                                                                     \
    }
RD_BOOL(rd_ignore_eos, ignore_eos)
RD_BOOL(rd_stream, stream)
RD_BOOL(rd_return_token_ids, return_token_ids)
RD_BOOL(rd_skip_special, skip_special_tokens)
RD_BOOL(rd_add_special, add_special_tokens)
RD_BOOL(rd_add_gen_prompt, add_generation_prompt)
RD_BOOL(rd_timings, timings)
RD_BOOL(rd_include_stop_str, include_stop_str)
RD_BOOL(rd_parallel_tool_calls, parallel_tool_calls)
RD_BOOL(rd_logprobs_bool, logprobs)
RD_BOOL(rd_echo, echo)
RD_BOOL(rd_tokens_as_ids, return_tokens_as_ids)
#undef RD_BOOL

/* ---------------------------------------------------------------------------- neutral values
 * What an unsupported field may say: the value that asks for nothing beyond what the node does. */

static int nt_false(json_t *v) { return json_is_false(v); }
static int nt_true(json_t *v) { return json_is_true(v); }
static int nt_zero(json_t *v) { return json_number_value(v) == 0; }
static int nt_empty(json_t *v) { return json_is_object(v) ? json_object_size(v) == 0 : json_array_size(v) == 0; }
static int nt_none(json_t *v) { return json_is_string(v) && !strcmp(json_string_value(v), "none"); }


static int nt_text_modality(json_t *v) {
    json_t *m = json_array_get(v, 0);
    return json_array_size(v) == 1 && json_is_string(m) && !strcmp(json_string_value(m), "text");
}

/* ------------------------------------------------------------------------------------- the table
 * The fields of vLLM's CompletionRequest and ChatCompletionRequest (vllm/entrypoints/openai/
 * protocol.py) and OpenAI's, plus kvbank's own. vLLM accepts any field and ignores those it does not
 * know; kvbank keeps refusing a name no row has, so that a misspelt parameter ("temprature") is an
 * error rather than a silently different request. */

#define H(name, eps, types, fn) {name, eps, GW_FIELD_HANDLED, types, fn, NULL}
#define I(name, eps, types) {name, eps, GW_FIELD_IGNORED, types, NULL, NULL}
#define U(name, eps, types, fn) {name, eps, GW_FIELD_UNSUPPORTED, types, NULL, fn}
#define C GW_EP_COMPLETIONS
#define T GW_EP_CHAT
#define B GW_EP_BOTH
#define NUM (GW_J_INT | GW_J_NUM)
static const gw_field FIELDS[] = {
    /* handled */
    H("prompt", C, GW_J_STR | GW_J_ARR, rd_prompt),
    H("messages", T, GW_J_ARR, rd_messages),
    H("max_tokens", B, GW_J_INT, rd_max_tokens),
    H("max_completion_tokens", T, GW_J_INT, rd_max_tokens),
    H("temperature", B, NUM, rd_temperature),
    H("top_p", B, NUM, rd_top_p),
    H("top_k", B, GW_J_INT, rd_top_k),
    H("seed", B, GW_J_INT, rd_seed),
    H("stop", B, GW_J_STR | GW_J_ARR, rd_stop),
    H("stop_token_ids", B, GW_J_ARR, rd_stop_ids),
    H("ignore_eos", B, GW_J_BOOL, rd_ignore_eos),
    H("stream", B, GW_J_BOOL, rd_stream),
    H("stream_options", B, GW_J_OBJ, rd_stream_options),
    H("return_token_ids", B, GW_J_BOOL, rd_return_token_ids),
    H("skip_special_tokens", B, GW_J_BOOL, rd_skip_special),
    H("add_special_tokens", B, GW_J_BOOL, rd_add_special),
    H("add_generation_prompt", T, GW_J_BOOL, rd_add_gen_prompt),
    H("chat_template_kwargs", T, GW_J_OBJ, rd_template_kwargs),
    H("include_stop_str_in_output", B, GW_J_BOOL, rd_include_stop_str),
    H("kvbank_tbt_slo_ms", B, NUM, rd_tbt_slo),
    H("kvbank_timings", B, GW_J_BOOL, rd_timings),
    /* structured output and tools */
    H("response_format", B, GW_J_OBJ, rd_response_format),
    H("guided_json", B, GW_J_STR | GW_J_OBJ, rd_guided_json),
    H("guided_regex", B, GW_J_STR, rd_guided_regex),
    H("guided_choice", B, GW_J_ARR, rd_guided_choice),
    H("structured_outputs", B, GW_J_OBJ, rd_structured_outputs),
    H("tools", T, GW_J_ARR, rd_tools),
    H("tool_choice", T, GW_J_STR | GW_J_OBJ, rd_tool_choice),
    H("parallel_tool_calls", T, GW_J_BOOL, rd_parallel_tool_calls),
    /* sampling and outputs (common/sched/sampling.h; docs/gateway.md) */
    H("n", B, GW_J_INT, rd_n),
    H("best_of", B, GW_J_INT, rd_best_of),
    H("logprobs", T, GW_J_BOOL, rd_logprobs_bool),
    H("logprobs", C, GW_J_INT | GW_J_BOOL, rd_logprobs_n),
    H("top_logprobs", T, GW_J_INT, rd_top_logprobs),
    H("echo", B, GW_J_BOOL, rd_echo),
    H("min_tokens", B, GW_J_INT, rd_min_tokens),
    H("presence_penalty", B, NUM, rd_presence),
    H("frequency_penalty", B, NUM, rd_frequency),
    H("repetition_penalty", B, NUM, rd_repetition),
    H("min_p", B, NUM, rd_min_p),
    H("logit_bias", B, GW_J_OBJ, rd_logit_bias),
    H("return_tokens_as_token_ids", B, GW_J_BOOL, rd_tokens_as_ids),
    /* ignored: bookkeeping for OpenAI's platform, hints that change no token, options of features
     * that are off (beam search) or have one choice here (the structured-output backend) */
    I("user", B, GW_J_STR),
    I("store", B, GW_J_BOOL),
    I("metadata", B, GW_J_OBJ),
    I("service_tier", B, GW_J_STR),
    I("reasoning_effort", T, GW_J_STR),
    I("include_reasoning", T, GW_J_BOOL),
    I("prompt_cache_key", B, GW_J_STR),
    I("safety_identifier", B, GW_J_STR),
    I("verbosity", T, GW_J_STR),
    I("prediction", T, GW_J_OBJ),
    I("request_id", B, GW_J_STR),
    I("length_penalty", B, NUM),
    I("guided_decoding_backend", B, GW_J_STR),
    I("mm_processor_kwargs", B, GW_J_OBJ),
    I("vllm_xargs", B, GW_J_OBJ),
    /* unsupported: features the node does not have yet */
    U("use_beam_search", B, GW_J_BOOL, nt_false),
    U("prompt_logprobs", B, GW_J_INT, NULL),
    U("suffix", C, GW_J_STR, NULL),
    U("allowed_token_ids", B, GW_J_ARR, NULL),
    U("bad_words", B, GW_J_ARR, nt_empty),
    U("logits_processors", B, GW_J_ARR, nt_empty),
    U("truncate_prompt_tokens", B, GW_J_INT, NULL),
    U("spaces_between_special_tokens", B, GW_J_BOOL, nt_true),
    U("priority", B, GW_J_INT, nt_zero),
    U("cache_salt", B, GW_J_STR, NULL),
    U("kv_transfer_params", B, GW_J_OBJ, NULL),
    U("prompt_embeds", C, GW_J_STR | GW_J_ARR, NULL),
    U("functions", T, GW_J_ARR, nt_empty),
    U("function_call", T, GW_J_STR | GW_J_OBJ, nt_none),
    U("guided_grammar", B, GW_J_STR, NULL),
    U("guided_whitespace_pattern", B, GW_J_STR, NULL), /* whitespace is bounded by the engine (docs/grammar.md) */
    U("structural_tag", T, GW_J_STR, NULL),
    U("documents", T, GW_J_ARR, nt_empty),
    U("chat_template", T, GW_J_STR, NULL),
    U("continue_final_message", T, GW_J_BOOL, nt_false),
    U("modalities", T, GW_J_ARR, nt_text_modality),
    U("audio", T, GW_J_OBJ, NULL),
    U("web_search_options", T, GW_J_OBJ, NULL),
};
#undef H
#undef I
#undef U
#undef C
#undef T
#undef B
#undef NUM

const gw_field *gw_fields(int *n) {
    if (n) *n = (int)KVB_ARRAY_LEN(FIELDS);
    return FIELDS;
}

/* The row of `name` for endpoint `ep`; NULL when none. */
static const gw_field *field_find(const char *name, gw_endpoint ep) {
    for (size_t i = 0; i < KVB_ARRAY_LEN(FIELDS); i++)
        if ((FIELDS[i].eps & (1u << ep)) && !strcmp(FIELDS[i].name, name)) return &FIELDS[i];
    return NULL;
}

static int type_ok(json_t *v, unsigned types) {
    if ((types & GW_J_BOOL) && json_is_boolean(v)) return 1;
    if ((types & GW_J_NUM) && json_is_number(v) && isfinite(json_number_value(v))) return 1;
    if ((types & GW_J_INT) && (json_is_integer(v) || (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)) &&
                                                      fabs(json_real_value(v)) < 9e15)))
        return 1;
    if ((types & GW_J_STR) && json_is_string(v)) return 1;
    if ((types & GW_J_OBJ) && json_is_object(v)) return 1;
    if ((types & GW_J_ARR) && json_is_array(v)) return 1;
    return 0;
}

/* "a boolean", "a string or an object", ... */
static const char *type_words(unsigned types, char *buf, size_t n) {
    static const struct {
        unsigned t;
        const char *w;
    } words[] = {{GW_J_BOOL, "a boolean"}, {GW_J_NUM, "a number"}, {GW_J_INT, "an integer"},
                 {GW_J_STR, "a string"},   {GW_J_OBJ, "an object"}, {GW_J_ARR, "an array"}};
    size_t k = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < KVB_ARRAY_LEN(words); i++) {
        if (!(types & words[i].t) || (words[i].t == GW_J_INT && (types & GW_J_NUM))) continue;
        k += (size_t)snprintf(buf + k, k < n ? n - k : 0, "%s%s", k ? " or " : "", words[i].w);
    }
    return buf;
}

/* One field of a request body. */
static kvb_status field_apply(gw_endpoint ep, const char *key, json_t *v, gw_params *p, gw_error *err) {
    const gw_field *f = field_find(key, ep);
    if (!f) {
        char clip[72];
        if (field_find(key, ep == GW_CHAT ? GW_COMPLETIONS : GW_CHAT))
            return bad(err, key, "'%s' is a field of %s, not of this endpoint", key,
                       ep == GW_CHAT ? "/v1/completions" : "/v1/chat/completions");
        return bad(err, key, "unknown field '%s'", gw_clip(key, clip, sizeof clip));
    }
    if (json_is_null(v)) return KVB_OK; /* not given */
    if (f->kind == GW_FIELD_HANDLED) return f->read(v, key, p, err);
    if (!type_ok(v, f->types)) {
        char words[96];
        return bad(err, key, "'%s' must be %s", key, type_words(f->types, words, sizeof words));
    }
    if (f->kind == GW_FIELD_UNSUPPORTED) {
        if (f->neutral && f->neutral(v)) return KVB_OK;
        return bad(err, key, "'%s' is not supported by this server", key);
    }
    if (p->n_ignored < GW_MAX_IGNORED) p->ignored[p->n_ignored++] = (short)(f - FIELDS);
    return KVB_OK;
}

/* The rules between fields, once all are read. */
static kvb_status check_together(gw_params *p, gw_error *err) {
    if (p->echo_only && !p->echo) return bad(err, "max_tokens", "'max_tokens' is 0, which only 'echo' allows");
    if (p->has_top_logprobs && !p->logprobs && p->top_logprobs > 0)
        return bad(err, "top_logprobs", "'top_logprobs' needs 'logprobs' to be true");
    if (p->best_of && p->best_of < p->n)
        return bad(err, "best_of", "'best_of' is %d, must be >= n (%d)", p->best_of, p->n);
    if (p->best_of > p->n && p->stream)
        return bad(err, "best_of", "'best_of' above n cannot be streamed (the best are known at the end)");
    int per = KVB_MAX(p->n, p->best_of);
    if ((int64_t)per * p->n_prompts > GW_MAX_CHOICES)
        return bad(err, p->best_of > p->n ? "best_of" : "n", "%d prompts x %d sequences each is more than %d", p->n_prompts,
                   per, GW_MAX_CHOICES);
    if (p->max_tokens && p->min_tokens > p->max_tokens)
        return bad(err, "min_tokens", "'min_tokens' is %d, above max_tokens (%d)", p->min_tokens, p->max_tokens);
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
    p->tool_choice = -1;
    p->parallel_tool_calls = 1;
    p->repetition_penalty = 1;
    p->n = 1;
    json_t *o = NULL;
    KVB_TRY(load_object(body, len, &o, err));
    kvb_status st = get_model(o, &p->model, err);
    const char *key;
    json_t *v;
    json_object_foreach(o, key, v) {
        if (st != KVB_OK) break;
        if (strcmp(key, "model")) st = field_apply(ep, key, v, p, err);
    }
    if (st == KVB_OK && ep == GW_COMPLETIONS && !p->n_prompts) st = bad(err, "prompt", "'prompt' is required");
    if (st == KVB_OK && ep == GW_CHAT && !p->messages) st = bad(err, "messages", "'messages' is required");
    if (st == KVB_OK) st = tools_check(p, err);
    if (st == KVB_OK && ep == GW_CHAT && kvb_calloc(1, sizeof *p->prompts, (void **)&p->prompts) == KVB_OK)
        p->n_prompts = 1; /* the messages, rendered and tokenized */
    if (st == KVB_OK && !p->n_prompts) st = KVB_ERR_NOMEM, gw_error_set(err, 500, "server_error", NULL, "out of memory");
    if (st == KVB_OK && p->include_usage && !p->stream)
        st = bad(err, "stream_options", "'stream_options' is only allowed with \"stream\": true");
    if (st == KVB_OK) st = check_together(p, err);
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
    free(p->grammar_text);
    p->grammar_text = NULL;
    free(p->grammar_choices);
    p->grammar_choices = NULL;
    p->n_grammar = 0;
    for (int i = 0; i < p->n_prompts; i++) free(p->prompts[i].ids);
    free(p->prompts);
    p->prompts = NULL;
    p->n_prompts = 0;
    free(p->logit_bias);
    p->logit_bias = NULL;
    p->n_logit_bias = 0;
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
            st = check_messages(v, NULL, err);
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
