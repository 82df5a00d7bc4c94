/* kvbank-gateway — tool calling: formats, forced-call grammars, parsers (see tools.h). */
#include "gateway/tools.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *gw_tool_format_name(gw_tool_format f) {
    switch (f) {
    case GW_TOOLS_LLAMA3: return "llama3";
    case GW_TOOLS_HERMES: return "hermes";
    case GW_TOOLS_MISTRAL: return "mistral";
    default: return "none";
    }
}

const char *gw_tool_format_marker(gw_tool_format f) {
    switch (f) {
    case GW_TOOLS_LLAMA3: return "<|python_tag|>";
    case GW_TOOLS_HERMES: return "<tool_call>";
    case GW_TOOLS_MISTRAL: return "[TOOL_CALLS]";
    default: return "";
    }
}

/* ------------------------------------------------------------------------------------- detection */

/* A conversation in which the assistant called a tool (the id has the 9 characters Mistral's template
 * insists on) and the tool answered. */
static const char PROBE_MESSAGES[] =
    "[{\"role\": \"user\", \"content\": \"kvb\"},"
    " {\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"id\": \"kvbprobe1\", \"type\": \"function\","
    " \"function\": {\"name\": \"kvb_probe\", \"arguments\": {\"kvb_arg\": 1}}}]},"
    " {\"role\": \"tool\", \"tool_call_id\": \"kvbprobe1\", \"content\": \"ok\"}]";
static const char PROBE_EXTRA[] =
    "{\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"kvb_probe\", \"description\": \"probe\","
    " \"parameters\": {\"type\": \"object\", \"properties\": {\"kvb_arg\": {\"type\": \"integer\"}}}}}]}";

gw_tool_format gw_tool_format_detect(const kvb_chat_template *t, const kvb_tokenizer *tok) {
    gw_tool_format f = GW_TOOLS_NONE;
    if (t) {
        json_t *msgs = json_loads(PROBE_MESSAGES, 0, NULL), *extra = json_loads(PROBE_EXTRA, 0, NULL);
        char *out = NULL, err[256];
        if (msgs && extra && kvb_chat_render(t, msgs, 1, extra, &out, err, sizeof err) == KVB_OK) {
            if (strstr(out, "[TOOL_CALLS]") && strstr(out, "\"kvb_probe\"")) f = GW_TOOLS_MISTRAL;
            else if (strstr(out, "<tool_call>\n{\"name\": \"kvb_probe\"")) f = GW_TOOLS_HERMES;
            else if (strstr(out, "\"name\": \"kvb_probe\", \"parameters\"")) f = GW_TOOLS_LLAMA3;
        }
        free(out);
        json_decref(msgs);
        json_decref(extra);
    }
    if (f == GW_TOOLS_NONE && tok) {
        if (kvb_tokenizer_token_id(tok, "[TOOL_CALLS]") >= 0) f = GW_TOOLS_MISTRAL;
        else if (kvb_tokenizer_token_id(tok, "<tool_call>") >= 0) f = GW_TOOLS_HERMES;
        else if (kvb_tokenizer_token_id(tok, "<|python_tag|>") >= 0) f = GW_TOOLS_LLAMA3;
    }
    return f;
}

/* ------------------------------------------------------------------------------------- grammars */

static kvb_status gerr(char *err, size_t n, const char *fmt, const char *a, const char *b) {
    snprintf(err, n, fmt, a, b);
    return KVB_ERR_INVALID;
}

/* A $ref inside a function's parameters resolves against the document it is in: the grammar nests the
 * parameters inside a call's schema, so only references into $defs / definitions (hoisted to the
 * root) keep their meaning. */
static kvb_status check_refs(const json_t *v, const char *fn, char *err, size_t n) {
    if (json_is_object(v)) {
        const char *k;
        json_t *x;
        json_object_foreach((json_t *)v, k, x) {
            if (!strcmp(k, "$ref") && json_is_string(x)) {
                const char *r = json_string_value(x);
                if (strncmp(r, "#/$defs/", 8) && strncmp(r, "#/definitions/", 14))
                    return gerr(err, n, "function '%s': a $ref to '%s' cannot be used in a tool call's grammar "
                                "(only #/$defs/... and #/definitions/...)", fn, r);
            }
            KVB_TRY(check_refs(x, fn, err, n));
        }
    } else if (json_is_array(v)) {
        for (size_t i = 0; i < json_array_size(v); i++) KVB_TRY(check_refs(json_array_get(v, i), fn, err, n));
    }
    return KVB_OK;
}

/* The schema of one call of `fn` ({name: const, <args_key>: parameters}); its $defs and definitions
 * move into root's. */
static kvb_status call_schema(const json_t *fn, const char *args_key, json_t *root, json_t **out, char *err, size_t n) {
    const char *name = json_string_value(json_object_get(fn, "name"));
    json_t *params = json_object_get(fn, "parameters");
    KVB_TRY(check_refs(params, name, err, n));
    json_t *p = params ? json_deep_copy(params) : json_pack("{s:s, s:{}}", "type", "object", "properties");
    if (!p) return KVB_ERR_NOMEM;
    static const char *const defs[] = {"$defs", "definitions"};
    for (int d = 0; d < 2; d++) {
        json_t *src = json_object_get(p, defs[d]);
        if (!json_is_object(src)) continue;
        json_t *dst = json_object_get(root, defs[d]);
        if (!dst) json_object_set_new(root, defs[d], dst = json_object());
        const char *k;
        json_t *x;
        json_object_foreach(src, k, x) {
            json_t *had = json_object_get(dst, k);
            if (had && !json_equal(had, x)) {
                json_decref(p);
                return gerr(err, n, "two functions define '%s' differently in their %s", k, defs[d]);
            }
            json_object_set(dst, k, x);
        }
        json_object_del(p, defs[d]);
    }
    *out = json_pack("{s:s, s:{s:{s:s}, s:o}, s:[s, s]}", "type", "object", "properties", "name", "const", name, args_key,
                     p, "required", "name", args_key);
    return *out ? KVB_OK : KVB_ERR_NOMEM;
}

static kvb_status add_part(gw_tool_grammar *g, kvb_grammar_kind kind, char *text) {
    if (!text) return KVB_ERR_NOMEM;
    g->owned[g->n_parts] = text;
    g->parts[g->n_parts++] = (kvb_grammar_part){.kind = kind, .text = text, .len = strlen(text)};
    return KVB_OK;
}

static char *dup_str(const char *s) {
    char *d = malloc(strlen(s) + 1);
    if (d) strcpy(d, s);
    return d;
}

kvb_status gw_tool_grammar_build(gw_tool_format f, const json_t *tools, const char *name, int parallel,
                                 gw_tool_grammar *out, char *err, size_t err_len) {
    memset(out, 0, sizeof *out);
    if (f == GW_TOOLS_NONE) return gerr(err, err_len, "%s%s", "the model's chat template has no tool-call format", "");
    const char *args_key = f == GW_TOOLS_LLAMA3 ? "parameters" : "arguments";
    json_t *root = json_object(), *calls = json_array();
    kvb_status st = root && calls ? KVB_OK : KVB_ERR_NOMEM;
    for (size_t i = 0; st == KVB_OK && i < json_array_size(tools); i++) {
        const json_t *fn = json_object_get(json_array_get(tools, i), "function");
        if (name && strcmp(json_string_value(json_object_get(fn, "name")), name)) continue;
        json_t *c = NULL;
        st = call_schema(fn, args_key, root, &c, err, err_len);
        if (st == KVB_OK) json_array_append_new(calls, c);
    }
    if (st == KVB_OK && json_array_size(calls) == 0) st = gerr(err, err_len, "no function '%s' among the tools%s", name ? name : "", "");
    if (st == KVB_OK) {
        json_t *call = json_array_size(calls) == 1 ? json_incref(json_array_get(calls, 0)) : json_pack("{s:O}", "anyOf", calls);
        json_t *schema = call;
        if (f == GW_TOOLS_MISTRAL) {
            schema = json_pack("{s:s, s:o, s:i}", "type", "array", "items", call, "minItems", 1);
            if (schema && !parallel) json_object_set_new(schema, "maxItems", json_integer(1));
        }
        if (!schema) {
            st = KVB_ERR_NOMEM;
        } else {
            /* the call's own keys first, then the hoisted definitions */
            const char *k;
            json_t *x;
            json_object_foreach(root, k, x) json_object_set(schema, k, x);
            if (f == GW_TOOLS_HERMES) st = add_part(out, KVB_GRAMMAR_LITERAL, dup_str("<tool_call>\n"));
            if (f == GW_TOOLS_MISTRAL) st = add_part(out, KVB_GRAMMAR_LITERAL, dup_str("[TOOL_CALLS]"));
            if (st == KVB_OK) st = add_part(out, KVB_GRAMMAR_JSON_SCHEMA, json_dumps(schema, JSON_COMPACT));
            if (st == KVB_OK && f == GW_TOOLS_HERMES) st = add_part(out, KVB_GRAMMAR_LITERAL, dup_str("\n</tool_call>"));
            json_decref(schema);
        }
    }
    json_decref(root);
    json_decref(calls);
    if (st != KVB_OK) gw_tool_grammar_free(out);
    if (st == KVB_ERR_NOMEM) snprintf(err, err_len, "out of memory");
    return st;
}

void gw_tool_grammar_free(gw_tool_grammar *g) {
    if (!g) return;
    for (int i = 0; i < GW_TOOL_GRAMMAR_PARTS; i++) free(g->owned[i]);
    memset(g, 0, sizeof *g);
}

/* ------------------------------------------------------------------------------------- parsers
 *
 * The text not yet decided is `buf` (from `pos` on). In the content states text is emitted as content
 * except for a tail that could begin the format's marker. A call is a JSON object scanned one byte at a
 * time (strings, escapes, depth), which finds the value of "name" and where the arguments' value
 * starts and ends; the object's text stays in `buf` from `call0` until the call is decided. */

enum {
    S_START,      /* llama3: nothing yet but whitespace */
    S_CONTENT,    /* content, looking for the marker */
    S_TEXT,       /* llama3 after a start that is not a call: content to the end */
    S_OPEN,       /* after the marker (or between calls): whitespace, then '{' (mistral: '[' first) */
    S_CALL,       /* inside a call object */
    S_AFTER,      /* after a call: its end marker / separator */
};

enum { K_KEY, K_COLON, K_VALUE, K_COMMA }; /* where the scan is inside a call object, at depth 1 */

struct gw_tool_parser {
    gw_tool_format f;
    int whole, parallel;
    char *buf;
    size_t len, cap, pos;
    int state;
    int in_list;       /* mistral: inside the [ ... ] of calls; hermes: after a call's end marker */
    size_t region0;    /* start of the text a failed call gives back as content (its marker) */
    /* the call being scanned */
    size_t call0;      /* its '{' */
    int depth, in_str, esc, expect;
    size_t key0, key1; /* the last key at depth 1 (without quotes) */
    int cur_key;       /* the value being scanned belongs to: 0 other, 1 name, 2 arguments */
    size_t val0;       /* start of the current depth-1 value */
    size_t name0, name1;
    int have_name;
    size_t args0, args1;
    int args_open, args_done;
    int begun;         /* streaming: its CALL event went out */
    size_t args_sent;  /* streaming: arguments bytes emitted */
    int n_calls;
    int dropped;       /* parallel 0: a call after the first is being skipped */
};

kvb_status gw_tool_parser_create(gw_tool_format f, int whole, int parallel, gw_tool_parser **out) {
    gw_tool_parser *p = calloc(1, sizeof *p);
    if (!p) return KVB_ERR_NOMEM;
    p->f = f;
    p->whole = whole;
    p->parallel = parallel;
    p->state = f == GW_TOOLS_LLAMA3 ? S_START : f == GW_TOOLS_NONE ? S_TEXT : S_CONTENT;
    *out = p;
    return KVB_OK;
}

void gw_tool_parser_destroy(gw_tool_parser *p) {
    if (!p) return;
    free(p->buf);
    free(p);
}

int gw_tool_parser_n_calls(const gw_tool_parser *p) { return p->n_calls; }

static int is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* Emits buf[a, b) as content. */
static void content(gw_tool_parser *p, size_t a, size_t b, gw_tool_emit_fn emit, void *ud) {
    if (b > a) emit(ud, GW_TOOL_EV_CONTENT, 0, p->buf + a, b - a);
}

/* Drops buf[0, pos) (decided), keeping what is still open. */
static void compact(gw_tool_parser *p) {
    size_t keep = p->pos;
    if (p->state == S_CALL || p->state == S_OPEN || p->state == S_AFTER) keep = KVB_MIN(keep, p->region0);
    if (keep == 0) return;
    memmove(p->buf, p->buf + keep, p->len - keep);
    p->len -= keep;
    p->pos -= keep;
    p->region0 -= KVB_MIN(p->region0, keep);
#define SHIFT(x) (x) = (x) >= keep ? (x) - keep : 0
    SHIFT(p->call0);
    SHIFT(p->key0);
    SHIFT(p->key1);
    SHIFT(p->val0);
    SHIFT(p->name0);
    SHIFT(p->name1);
    SHIFT(p->args0);
    SHIFT(p->args1);
#undef SHIFT
}

static void call_reset(gw_tool_parser *p) {
    p->depth = p->in_str = p->esc = 0;
    p->expect = K_KEY;
    p->cur_key = 0;
    p->have_name = p->args_open = p->args_done = p->begun = 0;
    p->args_sent = 0;
    p->dropped = !p->parallel && p->n_calls > 0;
}

/* The call's name as text (JSON-unescaped when it has escapes) into out[n]; 0 when it is not a string. */
static int call_name(const gw_tool_parser *p, char *out, size_t n) {
    json_t *s = json_loadb(p->buf + p->name0 - 1, p->name1 - p->name0 + 2, JSON_DECODE_ANY, NULL);
    int ok = json_is_string(s) && json_string_length(s) > 0 && json_string_length(s) < n;
    if (ok) memcpy(out, json_string_value(s), json_string_length(s) + 1);
    json_decref(s);
    return ok;
}

/* Streaming: the CALL event once the name is known, then the arguments scanned so far. */
static void stream_call(gw_tool_parser *p, gw_tool_emit_fn emit, void *ud) {
    if (p->whole || p->dropped || !p->have_name) return;
    if (!p->begun) {
        char name[256];
        if (!call_name(p, name, sizeof name)) return;
        p->begun = 1;
        emit(ud, GW_TOOL_EV_CALL, p->n_calls, name, strlen(name));
    }
    if (!p->args_open && !p->args_done) return;
    size_t end = p->args_done ? p->args1 : p->pos;
    size_t from = p->args0 + p->args_sent;
    if (end > from) {
        emit(ud, GW_TOOL_EV_ARGS, p->n_calls, p->buf + from, end - from);
        p->args_sent = end - p->args0;
    }
}

/* The call object closed at buf[pos - 1]: emit it (whole: only when it parses), or give its text back. */
static void call_done(gw_tool_parser *p, gw_tool_emit_fn emit, void *ud) {
    if (p->dropped) return;
    if (!p->whole) {
        stream_call(p, emit, ud);
        if (p->begun) {
            if (!p->args_sent && !p->args_done) emit(ud, GW_TOOL_EV_ARGS, p->n_calls, "{}", 2);
            p->n_calls++;
        } else {
            content(p, p->region0, p->pos, emit, ud); /* no name: not a call */
        }
        return;
    }
    json_t *o = json_loadb(p->buf + p->call0, p->pos - p->call0, 0, NULL);
    json_t *name = json_object_get(o, "name");
    json_t *args = json_object_get(o, p->f == GW_TOOLS_LLAMA3 && json_object_get(o, "parameters") ? "parameters" : "arguments");
    char *args_text = NULL;
    if (json_is_string(args)) { /* arguments written as a JSON string holding the object */
        json_t *inner = json_loads(json_string_value(args), 0, NULL);
        if (json_is_object(inner)) args_text = json_dumps(inner, JSON_COMPACT);
        json_decref(inner);
    } else if (json_is_object(args) && p->args_done) {
        size_t n = p->args1 - p->args0;
        args_text = malloc(n + 1);
        if (args_text) memcpy(args_text, p->buf + p->args0, n), args_text[n] = '\0';
    } else if (!args) {
        args_text = dup_str("{}");
    }
    if (json_is_object(o) && json_is_string(name) && json_string_length(name) > 0 && args_text) {
        emit(ud, GW_TOOL_EV_CALL, p->n_calls, json_string_value(name), json_string_length(name));
        emit(ud, GW_TOOL_EV_ARGS, p->n_calls, args_text, strlen(args_text));
        p->n_calls++;
    } else {
        content(p, p->region0, p->pos, emit, ud);
    }
    free(args_text);
    json_decref(o);
}

/* One byte of a call object at buf[pos]. Returns 1 when the object closed with it, -1 when the text is
 * not a JSON object after all. */
static int scan(gw_tool_parser *p) {
    char c = p->buf[p->pos];
    size_t at = p->pos;
    if (p->in_str) {
        if (p->esc) p->esc = 0;
        else if (c == '\\') p->esc = 1;
        else if (c == '"') {
            p->in_str = 0;
            if (p->depth == 1 && p->expect == K_KEY) { /* a key ended */
                p->key1 = at;
                p->expect = K_COLON;
            } else if (p->depth == 1 && p->cur_key == 1) {
                p->name1 = at;
                p->have_name = 1;
            }
            if (p->depth == 1 && p->expect == K_VALUE) p->expect = K_COMMA;
            if (p->depth == 1 && p->cur_key == 2 && p->expect == K_COMMA) p->args1 = at + 1, p->args_done = 1, p->args_open = 0;
        }
        return 0;
    }
    if (is_ws(c)) return 0;
    if (p->depth == 0) return c == '{' ? (p->depth = 1, p->expect = K_KEY, 0) : -1;
    if (p->depth == 1) {
        switch (p->expect) {
        case K_KEY:
            if (c == '}') return 1;
            if (c != '"') return -1;
            p->in_str = 1;
            p->key0 = at + 1;
            return 0;
        case K_COLON:
            if (c != ':') return -1;
            p->expect = K_VALUE;
            size_t kl = p->key1 - p->key0;
            const char *k = p->buf + p->key0;
            p->cur_key = kl == 4 && !memcmp(k, "name", 4) ? 1
                         : (kl == 9 && !memcmp(k, "arguments", 9)) || (kl == 10 && !memcmp(k, "parameters", 10)) ? 2 : 0;
            return 0;
        case K_VALUE:
            p->val0 = at;
            if (p->cur_key == 1) {
                if (c != '"') p->cur_key = 0; /* a name that is not a string: no call */
                else p->name0 = at + 1;
            }
            if (p->cur_key == 2) p->args0 = at, p->args_open = 1;
            if (c == '"') p->in_str = 1;
            else if (c == '{' || c == '[') p->depth++;
            else if (c == '}' || c == ']' || c == ',' || c == ':') return -1;
            else p->expect = K_COMMA; /* a literal: its end is found at the ',' or '}' after it */
            return 0;
        case K_COMMA:
            if (c != ',' && c != '}') {
                if (p->val0 + 1 <= at && !is_ws(p->buf[at - 1])) return 0; /* still inside a literal */
                return -1;
            }
            if (p->cur_key == 2 && p->args_open) { /* a literal's end */
                size_t e = at;
                while (e > p->args0 && is_ws(p->buf[e - 1])) e--;
                p->args1 = e, p->args_done = 1, p->args_open = 0;
            }
            p->cur_key = 0;
            if (c == '}') return 1;
            p->expect = K_KEY;
            return 0;
        }
        return -1;
    }
    /* inside a nested value */
    if (c == '"') p->in_str = 1;
    else if (c == '{' || c == '[') p->depth++;
    else if (c == '}' || c == ']') {
        p->depth--;
        if (p->depth == 1) {
            p->expect = K_COMMA;
            if (p->cur_key == 2) p->args1 = at + 1, p->args_done = 1, p->args_open = 0;
        }
    }
    return 0;
}

/* Length of the longest suffix of buf[a, len) that is a proper prefix of m. */
static size_t partial_marker(const gw_tool_parser *p, size_t a, const char *m) {
    size_t ml = strlen(m);
    for (size_t k = KVB_MIN(ml - 1, p->len - a); k > 0; k--)
        if (!memcmp(p->buf + p->len - k, m, k)) return k;
    return 0;
}

/* Gives the open region (a marker and what followed it) back as content and goes on after it. */
static void give_back(gw_tool_parser *p, gw_tool_emit_fn emit, void *ud) {
    content(p, p->region0, p->pos, emit, ud);
    p->state = p->f == GW_TOOLS_LLAMA3 ? S_TEXT : S_CONTENT;
    p->in_list = 0;
}

static void run(gw_tool_parser *p, gw_tool_emit_fn emit, void *ud) {
    const char *marker = gw_tool_format_marker(p->f);
    size_t ml = strlen(marker);
    while (p->pos < p->len) {
        switch (p->state) {
        case S_TEXT:
            content(p, p->pos, p->len, emit, ud);
            p->pos = p->len;
            break;
        case S_START: {
            while (p->pos < p->len && is_ws(p->buf[p->pos])) p->pos++;
            if (p->pos == p->len) return;
            size_t avail = p->len - p->pos;
            if (!memcmp(p->buf + p->pos, marker, KVB_MIN(avail, ml))) {
                if (avail < ml) return; /* maybe the marker */
                p->region0 = 0;
                p->pos += ml;
                p->state = S_OPEN;
            } else if (p->buf[p->pos] == '{') {
                p->region0 = 0;
                p->state = S_OPEN;
            } else {
                p->state = S_TEXT;
                p->pos = 0; /* the whitespace too */
            }
            break;
        }
        case S_CONTENT: {
            const char *hit = memmem(p->buf + p->pos, p->len - p->pos, marker, ml);
            if (!hit) {
                size_t hold = partial_marker(p, p->pos, marker);
                content(p, p->pos, p->len - hold, emit, ud);
                p->pos = p->len - hold;
                return;
            }
            size_t at = (size_t)(hit - p->buf);
            content(p, p->pos, at, emit, ud);
            p->region0 = at;
            p->pos = at + ml;
            p->state = S_OPEN;
            break;
        }
        case S_OPEN: {
            char c = p->buf[p->pos];
            if (is_ws(c)) {
                p->pos++;
            } else if (p->f == GW_TOOLS_MISTRAL && !p->in_list) {
                if (c != '[') give_back(p, emit, ud);
                else p->in_list = 1, p->pos++;
            } else if (c == '{') {
                if (p->f == GW_TOOLS_HERMES) p->in_list = 0;
                p->state = S_CALL;
                p->call0 = p->pos;
                call_reset(p);
            } else {
                give_back(p, emit, ud);
            }
            break;
        }
        case S_CALL: {
            int r = scan(p);
            p->pos++;
            if (r < 0) {
                if (p->begun) { /* streaming began it: it stays a call, cut short */
                    p->n_calls++;
                    p->state = S_TEXT;
                    p->pos--;
                } else {
                    give_back(p, emit, ud);
                }
            } else if (r > 0) {
                call_done(p, emit, ud);
                p->state = S_AFTER;
                p->region0 = p->pos;
            } else {
                stream_call(p, emit, ud);
            }
            break;
        }
        case S_AFTER: {
            char c = p->buf[p->pos];
            if (p->f == GW_TOOLS_HERMES) {
                static const char end[] = "</tool_call>";
                size_t avail = p->len - p->pos;
                if (is_ws(c)) {
                    p->pos++;
                } else if (!p->in_list && !memcmp(p->buf + p->pos, end, KVB_MIN(avail, sizeof end - 1))) {
                    if (avail < sizeof end - 1) return;
                    p->pos += sizeof end - 1;
                    p->in_list = 1; /* the end marker is behind: whitespace up to what follows is dropped */
                } else {
                    p->in_list = 0;
                    p->state = S_CONTENT; /* no end marker: what follows is content */
                }
            } else if (p->f == GW_TOOLS_MISTRAL) {
                if (is_ws(c)) p->pos++;
                else if (c == ',') p->pos++, p->state = S_OPEN, p->region0 = p->pos;
                else if (c == ']') p->pos++, p->state = S_CONTENT, p->in_list = 0;
                else p->state = S_CONTENT, p->in_list = 0;
            } else {
                if (is_ws(c) || c == ';') p->pos++;
                else if (c == '{') p->state = S_OPEN, p->region0 = p->pos;
                else p->state = S_TEXT;
            }
            break;
        }
        }
    }
}

kvb_status gw_tool_parser_push(gw_tool_parser *p, const char *text, size_t len, gw_tool_emit_fn emit, void *ud) {
    if (!len) return KVB_OK;
    if (p->len + len > p->cap) {
        size_t cap = KVB_MAX(p->cap * 2, p->len + len + 256);
        char *b = realloc(p->buf, cap);
        if (!b) return KVB_ERR_NOMEM;
        p->buf = b;
        p->cap = cap;
    }
    memcpy(p->buf + p->len, text, len);
    p->len += len;
    run(p, emit, ud);
    compact(p);
    return KVB_OK;
}

kvb_status gw_tool_parser_finish(gw_tool_parser *p, gw_tool_emit_fn emit, void *ud) {
    run(p, emit, ud);
    switch (p->state) {
    case S_START: break; /* whitespace only */
    case S_CALL:
        if (p->begun) {
            p->n_calls++; /* cut short (max_tokens): it stays the call it began as */
            break;
        }
        content(p, p->region0, p->len, emit, ud);
        break;
    case S_OPEN: content(p, p->region0, p->len, emit, ud); break;
    case S_AFTER: break; /* whitespace, or part of an end marker */
    default: content(p, p->pos, p->len, emit, ud); break;
    }
    p->pos = p->len;
    return KVB_OK;
}
