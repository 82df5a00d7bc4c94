/* kvbank — Jinja subset: the evaluator. Values live in a per-render arena released at the end; errors
 * (and raise_exception) longjmp out of the walk with the message in the caller's buffer.
 * Semantics follow Python's Jinja2 as transformers configures it (ImmutableSandboxedEnvironment):
 * printing uses Python's str() (True, None, 1.0, ['a']), `tojson` is json.dumps(ensure_ascii=False),
 * a missing key or index is undefined, an attribute of undefined is an error, lists are immutable. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/text/jinja_impl.h"
#include "common/util/util.h"

#define MAX_RANGE 1000000       /* items range() may make */
/* Helpers with large frames stay out of eval_node and exec_body, which recurse (limits.h's stack bound). */
#define NOINLINE __attribute__((noinline))

/* A string builder in the arena: an error may longjmp past it without leaking. */
typedef struct sbuf {
    char *p;
    size_t len, cap;
} sbuf;

typedef struct scope {
    jdict *vars;
    struct scope *parent;
} scope;

typedef struct rstate {
    jarena a;
    jmp_buf jb;
    kvb_status st;
    char *err;
    size_t err_len;
    sbuf *out;    /* where output goes (a macro call or {% set %} block redirects it) */
    scope *globals;  /* the render's variables */
    int ctl;         /* 1: break, 2: continue pending */
    int depth;       /* recursion: evaluations, statements, macro calls and nested values in progress */
    uint64_t steps;  /* work done (see kvb_text_limits.render_steps) */
    kvb_text_limits lim;
} rstate;

/* Ends the render with status st and the message in r->err ("chat template line L, column C: ..."). */
static void fail_v(rstate *r, kvb_status st, const jnode *at, const char *fmt, va_list ap)
    __attribute__((format(printf, 4, 0), noreturn, noinline, cold));
static void fail_v(rstate *r, kvb_status st, const jnode *at, const char *fmt, va_list ap) {
    char msg[384];
    vsnprintf(msg, sizeof msg, fmt, ap);
    if (at) snprintf(r->err, r->err_len, "chat template line %d, column %d: %s", at->line, at->col, msg);
    else snprintf(r->err, r->err_len, "chat template: %s", msg);
    r->st = st;
    longjmp(r->jb, 1);
}

/* A run-time error of the template (a type error, an undefined attribute): KVB_ERR_INVALID. */
static void fail(rstate *r, const jnode *at, const char *fmt, ...) __attribute__((format(printf, 3, 4), noreturn, cold));
static void fail(rstate *r, const jnode *at, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fail_v(r, KVB_ERR_INVALID, at, fmt, ap);
}

/* A budget of kvb_text_limits is spent: KVB_ERR_EXHAUSTED (the template is not wrong, the input or the
 * template's loops are too large for this server). */
static void fail_budget(rstate *r, const jnode *at, const char *fmt, ...) __attribute__((format(printf, 3, 4), noreturn, cold));
static void fail_budget(rstate *r, const jnode *at, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fail_v(r, KVB_ERR_EXHAUSTED, at, fmt, ap);
}

/* Counts k units of work against the step budget. */
static void charge(rstate *r, const jnode *at, uint64_t k) {
    r->steps += k;
    if (r->steps > r->lim.render_steps)
        fail_budget(r, at, "the render ran over its budget of %llu steps", (unsigned long long)r->lim.render_steps);
}

/* One more level of recursion (an evaluation, a statement list, a macro call, a nested value). */
static void enter(rstate *r, const jnode *at) {
    if (++r->depth > KVB_JINJA_MAX_CALL_DEPTH)
        fail_budget(r, at, "the render nests deeper than %d levels (expressions, macro calls or values)",
                    KVB_JINJA_MAX_CALL_DEPTH);
}

static void oom(rstate *r) {
    snprintf(r->err, r->err_len, "out of memory rendering the chat template");
    r->st = KVB_ERR_NOMEM;
    longjmp(r->jb, 1);
}

static void bput(rstate *r, sbuf *b, const void *p, size_t n) {
    if (b->len + n > r->lim.render_output)
        fail_budget(r, NULL, "a string would exceed the output budget of %zu bytes", r->lim.render_output);
    if (b->len + n + 1 > b->cap) { /* grow in the arena: the old copy is released with it */
        size_t cap = b->cap ? 2 * b->cap : 64;
        while (cap < b->len + n + 1) cap *= 2;
        char *np = kvb__ja_alloc(&r->a, cap);
        if (b->len) memcpy(np, b->p, b->len);
        b->p = np;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->len, p, n);
    b->len += n;
    b->p[b->len] = 0;
}

static void bputs(rstate *r, sbuf *b, const char *s) { bput(r, b, s, strlen(s)); }

/* ---------------------------------------------------------------------------------- values */

static const jv UNDEF = {.kind = JV_UNDEF};
static const jv NONE = {.kind = JV_NONE};

static jv mk_bool(int b) { return (jv){.kind = JV_BOOL, .u.b = !!b}; }
static jv mk_int(int64_t i) { return (jv){.kind = JV_INT, .u.i = i}; }

/* a + b, saturated at the int64 range: loop indices step with it without overflowing */
static int64_t sat_add(int64_t a, int64_t b) {
    int64_t c;
    if (!__builtin_add_overflow(a, b, &c)) return c;
    return b > 0 ? INT64_MAX : INT64_MIN;
}
static jv mk_float(double f) { return (jv){.kind = JV_FLOAT, .u.f = f}; }

static jv mk_str(rstate *r, const char *p, size_t n) {
    return (jv){.kind = JV_STR, .u.s = {kvb__ja_strdup(&r->a, p, n), n}};
}

/* The string a builder holds (it lives in the arena already). */
static jv mk_buf_str(rstate *r, sbuf *b) { return (jv){.kind = JV_STR, .u.s = {b->p ? b->p : "", b->len}}; }

static jv mk_list(rstate *r) { return (jv){.kind = JV_LIST, .u.l = kvb__ja_alloc(&r->a, sizeof(jlist))}; }
static jv mk_dict(rstate *r, jv_kind kind) { return (jv){.kind = kind, .u.d = kvb__ja_alloc(&r->a, sizeof(jdict))}; }

static void list_push(rstate *r, jlist *l, jv v) {
    charge(r, NULL, 1);
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 8;
        jv *nv = kvb__ja_alloc(&r->a, cap * sizeof *nv);
        if (l->n) memcpy(nv, l->v, l->n * sizeof *nv);
        l->v = nv;
        l->cap = cap;
    }
    l->v[l->n++] = v;
}

static int str_eq(jv a, const char *s) { return a.kind == JV_STR && a.u.s.n == strlen(s) && !memcmp(a.u.s.p, s, a.u.s.n); }

static int val_eq(rstate *r, jv a, jv b);

static jv *dict_find(rstate *r, jdict *d, jv key) {
    charge(r, NULL, 1 + d->n / 16);
    for (size_t i = 0; i < d->n; i++)
        if (val_eq(r, d->keys[i], key)) return &d->vals[i];
    return NULL;
}

static jv *dict_find_s(rstate *r, jdict *d, const char *key) {
    charge(r, NULL, 1 + d->n / 16);
    for (size_t i = 0; i < d->n; i++)
        if (str_eq(d->keys[i], key)) return &d->vals[i];
    return NULL;
}

static void dict_set(rstate *r, jdict *d, jv key, jv val) {
    jv *slot = dict_find(r, d, key);
    if (slot) {
        *slot = val;
        return;
    }
    if (d->n == d->cap) {
        size_t cap = d->cap ? 2 * d->cap : 8;
        jv *nk = kvb__ja_alloc(&r->a, cap * sizeof *nk), *nv = kvb__ja_alloc(&r->a, cap * sizeof *nv);
        if (d->n) {
            memcpy(nk, d->keys, d->n * sizeof *nk);
            memcpy(nv, d->vals, d->n * sizeof *nv);
        }
        d->keys = nk;
        d->vals = nv;
        d->cap = cap;
    }
    d->keys[d->n] = key;
    d->vals[d->n++] = val;
}

static void dict_set_s(rstate *r, jdict *d, const char *key, jv val) {
    jv *slot = dict_find_s(r, d, key); /* an existing key is not copied again (loop variables) */
    if (slot) *slot = val;
    else dict_set(r, d, mk_str(r, key, strlen(key)), val);
}

static jv from_json(rstate *r, const json_t *j) {
    switch (json_typeof(j)) {
    case JSON_OBJECT: {
        jv d = mk_dict(r, JV_DICT);
        const char *k;
        json_t *v;
        enter(r, NULL);
        json_object_foreach((json_t *)j, k, v) dict_set_s(r, d.u.d, k, from_json(r, v));
        r->depth--;
        return d;
    }
    case JSON_ARRAY: {
        jv l = mk_list(r);
        size_t i;
        json_t *v;
        enter(r, NULL);
        json_array_foreach(j, i, v) list_push(r, l.u.l, from_json(r, v));
        r->depth--;
        return l;
    }
    case JSON_STRING: return mk_str(r, json_string_value(j), json_string_length(j));
    case JSON_INTEGER: return mk_int(json_integer_value(j));
    case JSON_REAL: return mk_float(json_real_value(j));
    case JSON_TRUE: return mk_bool(1);
    case JSON_FALSE: return mk_bool(0);
    default: return NONE;
    }
}

static const char *kind_name(jv v) {
    static const char *const names[] = {"undefined", "none", "bool", "int", "float", "string", "list", "dict",
                                        "namespace", "function", "method", "macro"};
    return names[v.kind];
}

static int truthy(jv v) {
    switch (v.kind) {
    case JV_UNDEF:
    case JV_NONE: return 0;
    case JV_BOOL: return v.u.b;
    case JV_INT: return v.u.i != 0;
    case JV_FLOAT: return v.u.f != 0;
    case JV_STR: return v.u.s.n != 0;
    case JV_LIST: return v.u.l->n != 0;
    case JV_DICT:
    case JV_NS: return v.u.d->n != 0;
    default: return 1;
    }
}

static int is_num(jv v) { return v.kind == JV_INT || v.kind == JV_FLOAT || v.kind == JV_BOOL; }
static double num(jv v) { return v.kind == JV_FLOAT ? v.u.f : v.kind == JV_INT ? (double)v.u.i : v.u.b; }
static int is_intlike(jv v) { return v.kind == JV_INT || v.kind == JV_BOOL; }
static int64_t ival(jv v) { return v.kind == JV_INT ? v.u.i : v.u.b; }

static int val_eq(rstate *r, jv a, jv b) {
    if (is_num(a) && is_num(b)) return is_intlike(a) && is_intlike(b) ? ival(a) == ival(b) : num(a) == num(b);
    if (a.kind != b.kind) return 0;
    switch (a.kind) {
    case JV_UNDEF:
    case JV_NONE: return 1;
    case JV_STR:
        charge(r, NULL, 1 + a.u.s.n / 64);
        return a.u.s.n == b.u.s.n && !memcmp(a.u.s.p, b.u.s.p, a.u.s.n);
    case JV_LIST:
        if (a.u.l->n != b.u.l->n) return 0;
        enter(r, NULL);
        for (size_t i = 0; i < a.u.l->n; i++)
            if (!val_eq(r, a.u.l->v[i], b.u.l->v[i])) return r->depth--, 0;
        r->depth--;
        return 1;
    case JV_DICT:
    case JV_NS:
        if (a.u.d->n != b.u.d->n) return 0;
        enter(r, NULL);
        for (size_t i = 0; i < a.u.d->n; i++) {
            jv *o = dict_find(r, b.u.d, a.u.d->keys[i]);
            if (!o || !val_eq(r, a.u.d->vals[i], *o)) return r->depth--, 0;
        }
        r->depth--;
        return 1;
    default: return a.u.fn == b.u.fn;
    }
}

/* <0, 0, >0; an error for values Python cannot order. */
static NOINLINE int val_cmp(rstate *r, const jnode *at, jv a, jv b) {
    charge(r, at, 1);
    if (is_num(a) && is_num(b)) {
        if (is_intlike(a) && is_intlike(b)) return (ival(a) > ival(b)) - (ival(a) < ival(b));
        return (num(a) > num(b)) - (num(a) < num(b));
    }
    if (a.kind == JV_STR && b.kind == JV_STR) { /* UTF-8 byte order is code point order */
        charge(r, at, KVB_MIN(a.u.s.n, b.u.s.n) / 64);
        int c = memcmp(a.u.s.p, b.u.s.p, KVB_MIN(a.u.s.n, b.u.s.n));
        return c ? c : (a.u.s.n > b.u.s.n) - (a.u.s.n < b.u.s.n);
    }
    if (a.kind == JV_LIST && b.kind == JV_LIST) {
        enter(r, at);
        for (size_t i = 0; i < a.u.l->n && i < b.u.l->n; i++) {
            int c = val_cmp(r, at, a.u.l->v[i], b.u.l->v[i]);
            if (c) return r->depth--, c;
        }
        r->depth--;
        return (a.u.l->n > b.u.l->n) - (a.u.l->n < b.u.l->n);
    }
    fail(r, at, "cannot compare %s with %s", kind_name(a), kind_name(b));
}

/* ---------------------------------------------------------------------------------- printing */

static void to_str(rstate *r, sbuf *b, jv v);

/* Python's repr() of a string: single quotes unless the text has ' and no ". */
static void py_repr_str(rstate *r, sbuf *b, const char *s, size_t n) {
    char q = memchr(s, '\'', n) && !memchr(s, '"', n) ? '"' : '\'';
    bput(r, b, &q, 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        char esc[8];
        if (c == '\\' || c == (unsigned char)q) {
            esc[0] = '\\';
            esc[1] = (char)c;
            bput(r, b, esc, 2);
        } else if (c == '\n') bputs(r, b, "\\n");
        else if (c == '\r') bputs(r, b, "\\r");
        else if (c == '\t') bputs(r, b, "\\t");
        else if (c < 0x20 || c == 0x7f) {
            snprintf(esc, sizeof esc, "\\x%02x", c);
            bputs(r, b, esc);
        } else bput(r, b, &s[i], 1);
    }
    bput(r, b, &q, 1);
}

static void repr(rstate *r, sbuf *b, jv v) {
    if (v.kind == JV_STR) py_repr_str(r, b, v.u.s.p, v.u.s.n);
    else to_str(r, b, v);
}

/* Python's str(). */
static NOINLINE void to_str(rstate *r, sbuf *b, jv v) {
    char tmp[64];
    switch (v.kind) {
    case JV_UNDEF: return;
    case JV_NONE: bputs(r, b, "None"); return;
    case JV_BOOL: bputs(r, b, v.u.b ? "True" : "False"); return;
    case JV_INT: snprintf(tmp, sizeof tmp, "%lld", (long long)v.u.i); bputs(r, b, tmp); return;
    case JV_FLOAT: kvb_fmt_py_float(v.u.f, tmp, sizeof tmp); bputs(r, b, tmp); return;
    case JV_STR: bput(r, b, v.u.s.p, v.u.s.n); return;
    case JV_LIST:
        enter(r, NULL);
        bputs(r, b, "[");
        for (size_t i = 0; i < v.u.l->n; i++) {
            if (i) bputs(r, b, ", ");
            repr(r, b, v.u.l->v[i]);
        }
        bputs(r, b, "]");
        r->depth--;
        return;
    case JV_DICT:
    case JV_NS:
        enter(r, NULL);
        bputs(r, b, v.kind == JV_NS ? "<Namespace {" : "{");
        for (size_t i = 0; i < v.u.d->n; i++) {
            if (i) bputs(r, b, ", ");
            repr(r, b, v.u.d->keys[i]);
            bputs(r, b, ": ");
            repr(r, b, v.u.d->vals[i]);
        }
        bputs(r, b, v.kind == JV_NS ? "}>" : "}");
        r->depth--;
        return;
    default: bputs(r, b, "<"); bputs(r, b, kind_name(v)); bputs(r, b, ">"); return;
    }
}

static jv str_of(rstate *r, jv v) {
    if (v.kind == JV_STR) return v;
    sbuf b = {0};
    to_str(r, &b, v);
    jv s = mk_buf_str(r, &b);
    return s;
}

/* json.dumps(v, ensure_ascii=False, indent=indent, sort_keys=sort_keys) (indent < 0: None). */
static NOINLINE void to_json(rstate *r, const jnode *at, sbuf *b, jv v, int indent, int sort_keys, int level) {
    char tmp[64];
    switch (v.kind) {
    case JV_NONE: bputs(r, b, "null"); return;
    case JV_BOOL: bputs(r, b, v.u.b ? "true" : "false"); return;
    case JV_INT: snprintf(tmp, sizeof tmp, "%lld", (long long)v.u.i); bputs(r, b, tmp); return;
    case JV_FLOAT:
        if (isnan(v.u.f)) bputs(r, b, "NaN");
        else if (isinf(v.u.f)) bputs(r, b, v.u.f > 0 ? "Infinity" : "-Infinity");
        else {
            kvb_fmt_py_float(v.u.f, tmp, sizeof tmp);
            bputs(r, b, tmp);
        }
        return;
    case JV_STR:
        bputs(r, b, "\"");
        for (size_t i = 0; i < v.u.s.n; i++) {
            unsigned char c = (unsigned char)v.u.s.p[i];
            if (c == '"') bputs(r, b, "\\\"");
            else if (c == '\\') bputs(r, b, "\\\\");
            else if (c == '\n') bputs(r, b, "\\n");
            else if (c == '\r') bputs(r, b, "\\r");
            else if (c == '\t') bputs(r, b, "\\t");
            else if (c == '\b') bputs(r, b, "\\b");
            else if (c == '\f') bputs(r, b, "\\f");
            else if (c < 0x20) {
                snprintf(tmp, sizeof tmp, "\\u%04x", c);
                bputs(r, b, tmp);
            } else bput(r, b, &v.u.s.p[i], 1);
        }
        bputs(r, b, "\"");
        return;
    case JV_LIST:
    case JV_DICT:
    case JV_NS: {
        int is_list = v.kind == JV_LIST;
        size_t n = is_list ? v.u.l->n : v.u.d->n;
        bputs(r, b, is_list ? "[" : "{");
        if (!n) {
            bputs(r, b, is_list ? "]" : "}");
            return;
        }
        enter(r, at);
        size_t *order = kvb__ja_alloc(&r->a, n * sizeof *order);
        for (size_t i = 0; i < n; i++) order[i] = i;
        if (!is_list && sort_keys) /* insertion sort by key: chat data are small */
            for (size_t i = 1; i < n; i++)
                for (size_t k = i; k > 0 && val_cmp(r, at, v.u.d->keys[order[k - 1]], v.u.d->keys[order[k]]) > 0; k--) {
                    size_t t = order[k];
                    order[k] = order[k - 1];
                    order[k - 1] = t;
                }
        for (size_t i = 0; i < n; i++) {
            if (i) bputs(r, b, indent >= 0 ? "," : ", ");
            if (indent >= 0) {
                bputs(r, b, "\n");
                charge(r, at, 1 + (uint64_t)indent * (level + 1) / 64);
                for (int k = 0; k < indent * (level + 1); k++) bputs(r, b, " ");
            }
            if (is_list) to_json(r, at, b, v.u.l->v[i], indent, sort_keys, level + 1);
            else {
                jv key = v.u.d->keys[order[i]];
                if (key.kind == JV_STR) to_json(r, at, b, key, indent, sort_keys, level + 1);
                else { /* json.dumps turns int, float, bool and None keys into strings */
                    sbuf kb = {0};
                    to_json(r, at, &kb, key, -1, 0, 0);
                    jv ks = key.kind == JV_NONE || key.kind == JV_BOOL ? mk_buf_str(r, &kb) : str_of(r, key);
                    to_json(r, at, b, ks, indent, sort_keys, level + 1);
                }
                bputs(r, b, ": ");
                to_json(r, at, b, v.u.d->vals[order[i]], indent, sort_keys, level + 1);
            }
        }
        if (indent >= 0) {
            bputs(r, b, "\n");
            for (int k = 0; k < indent * level; k++) bputs(r, b, " ");
        }
        bputs(r, b, is_list ? "]" : "}");
        r->depth--;
        return;
    }
    default: fail(r, at, "tojson: a %s is not JSON serializable", kind_name(v));
    }
}

/* ---------------------------------------------------------------------------------- strings */

/* Python's str.isspace() characters (what strip() and split() remove by default). */
static int py_space(uint32_t c) {
    return (c >= 9 && c <= 13) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

static uint32_t cp_at(const char *s, size_t n, size_t i, int *len) {
    uint32_t cp;
    *len = kvb__utf8_decode((const uint8_t *)s + i, n - i, &cp);
    if (!*len) {
        *len = 1;
        return 0xFFFD;
    }
    return cp;
}

static int in_chars(rstate *r, uint32_t c, jv chars) {
    if (chars.kind != JV_STR) return py_space(c);
    charge(r, NULL, 1 + chars.u.s.n / 64);
    for (size_t i = 0; i < chars.u.s.n;) {
        int l;
        if (cp_at(chars.u.s.p, chars.u.s.n, i, &l) == c) return 1;
        i += (size_t)l;
    }
    return 0;
}

/* str.strip / lstrip / rstrip (which: 1 left, 2 right, 3 both) with a set of characters or whitespace. */
static jv py_strip(rstate *r, jv s, jv chars, int which) {
    size_t a = 0, e = s.u.s.n;
    while ((which & 1) && a < e) {
        int l;
        if (!in_chars(r, cp_at(s.u.s.p, e, a, &l), chars)) break;
        a += (size_t)l;
    }
    while ((which & 2) && e > a) {
        size_t k = e - 1;
        while (k > a && ((unsigned char)s.u.s.p[k] & 0xC0) == 0x80) k--;
        int l;
        if (!in_chars(r, cp_at(s.u.s.p, e, k, &l), chars)) break;
        e = k;
    }
    return (jv){.kind = JV_STR, .u.s = {s.u.s.p + a, e - a}};
}

/* memmem, counted against the step budget by the bytes it may scan. */
static const char *memmem_s(rstate *r, const char *h, size_t hn, const char *n, size_t nn) {
    if (!nn) return h;
    const char *f = memmem(h, hn, n, nn);
    charge(r, NULL, 1 + (f ? (size_t)(f - h) + nn : hn) / 64);
    return f;
}

/* str.split(sep=None, maxsplit=-1). */
static jv py_split(rstate *r, jv s, jv sep, int64_t maxsplit) {
    jv out = mk_list(r);
    const char *p = s.u.s.p, *e = p + s.u.s.n;
    if (sep.kind != JV_STR) { /* runs of whitespace; no empty strings */
        size_t i = 0, n = s.u.s.n;
        for (;;) {
            int l;
            while (i < n && py_space(cp_at(p, n, i, &l))) i += (size_t)l;
            if (i >= n) break;
            size_t st = i;
            if (maxsplit >= 0 && (int64_t)out.u.l->n == maxsplit) {
                size_t en = n;
                while (en > st) { /* the rest, without trailing whitespace */
                    size_t k = en - 1;
                    while (k > st && ((unsigned char)p[k] & 0xC0) == 0x80) k--;
                    if (!py_space(cp_at(p, n, k, &l))) break;
                    en = k;
                }
                list_push(r, out.u.l, (jv){.kind = JV_STR, .u.s = {p + st, en - st}});
                break;
            }
            while (i < n && !py_space(cp_at(p, n, i, &l))) i += (size_t)l;
            list_push(r, out.u.l, (jv){.kind = JV_STR, .u.s = {p + st, i - st}});
        }
        return out;
    }
    if (!sep.u.s.n) fail(r, NULL, "split: empty separator");
    for (;;) {
        const char *f = maxsplit >= 0 && (int64_t)out.u.l->n == maxsplit ? NULL
                                                                          : memmem_s(r, p, (size_t)(e - p), sep.u.s.p, sep.u.s.n);
        if (!f) {
            list_push(r, out.u.l, (jv){.kind = JV_STR, .u.s = {p, (size_t)(e - p)}});
            return out;
        }
        list_push(r, out.u.l, (jv){.kind = JV_STR, .u.s = {p, (size_t)(f - p)}});
        p = f + sep.u.s.n;
    }
}

static jv py_replace(rstate *r, jv s, jv old, jv new, int64_t count) {
    if (old.kind != JV_STR || new.kind != JV_STR) fail(r, NULL, "replace: arguments must be strings");
    sbuf b = {0};
    const char *p = s.u.s.p, *e = p + s.u.s.n;
    int64_t done = 0;
    if (!old.u.s.n) { /* Python inserts `new` around every character */
        for (size_t i = 0; i <= s.u.s.n && (count < 0 || done < count);) {
            bput(r, &b, new.u.s.p, new.u.s.n);
            done++;
            if (i == s.u.s.n) {
                i++;
                break;
            }
            int l;
            cp_at(s.u.s.p, s.u.s.n, i, &l);
            bput(r, &b, s.u.s.p + i, (size_t)l);
            i += (size_t)l;
            p = s.u.s.p + i;
        }
        if (p < e) bput(r, &b, p, (size_t)(e - p));
    } else {
        for (;;) {
            const char *f = count >= 0 && done == count ? NULL : memmem_s(r, p, (size_t)(e - p), old.u.s.p, old.u.s.n);
            if (!f) break;
            bput(r, &b, p, (size_t)(f - p));
            bput(r, &b, new.u.s.p, new.u.s.n);
            p = f + old.u.s.n;
            done++;
        }
        bput(r, &b, p, (size_t)(e - p));
    }
    jv out = mk_buf_str(r, &b);
    return out;
}

/* upper / lower / title / capitalize on ASCII letters (non-ASCII text passes unchanged). */
static jv py_case(rstate *r, jv s, char how) {
    jv o = mk_str(r, s.u.s.p, s.u.s.n);
    char *p = (char *)o.u.s.p;
    int start = 1;
    for (size_t i = 0; i < o.u.s.n; i++) {
        char c = p[i];
        int alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
        if (how == 'u' && c >= 'a' && c <= 'z') p[i] = (char)(c - 32);
        else if (how == 'l' && c >= 'A' && c <= 'Z') p[i] = (char)(c + 32);
        else if (how == 't' || how == 'c') {
            int up = how == 't' ? start : i == 0;
            if (up && c >= 'a' && c <= 'z') p[i] = (char)(c - 32);
            else if (!up && c >= 'A' && c <= 'Z') p[i] = (char)(c + 32);
        }
        start = !alpha && !((unsigned char)c >= 0x80);
    }
    return o;
}

static size_t cp_count(rstate *r, const char *s, size_t n) {
    charge(r, NULL, 1 + n / 64);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) k += ((unsigned char)s[i] & 0xC0) != 0x80;
    return k;
}

/* Byte offset of code point index `idx` (clamped to the end). */
static size_t cp_offset(rstate *r, const char *s, size_t n, int64_t idx) {
    charge(r, NULL, 1 + (idx > 0 ? (uint64_t)idx : 0) / 64);
    size_t i = 0;
    for (int64_t k = 0; k < idx && i < n; k++) {
        i++;
        while (i < n && ((unsigned char)s[i] & 0xC0) == 0x80) i++;
    }
    return i;
}

/* ---------------------------------------------------------------------------------- scopes */

static jv *lookup(rstate *r, scope *sc, const char *name) {
    for (; sc; sc = sc->parent) {
        jv *v = dict_find_s(r, sc->vars, name);
        if (v) return v;
    }
    return NULL;
}

static scope *push_scope(rstate *r, scope *parent) {
    scope *s = kvb__ja_alloc(&r->a, sizeof *s);
    s->vars = kvb__ja_alloc(&r->a, sizeof(jdict));
    s->parent = parent;
    return s;
}

static const char *const GLOBAL_FUNCS[] = {"raise_exception", "namespace", "range", "strftime_now", "dict"};

static jv eval(rstate *r, scope *sc, const jnode *n);
static void exec_body(rstate *r, scope *sc, jnode *const *body, int n);

/* ---------------------------------------------------------------------------------- access */

static jv mk_method(rstate *r, jv self, const char *name) {
    struct jmethod *m = kvb__ja_alloc(&r->a, sizeof *m);
    m->self = self;
    m->name = name;
    return (jv){.kind = JV_METHOD, .u.m = m};
}

static int is_one_of(const char *name, const char *const *list, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!strcmp(name, list[i])) return 1;
    return 0;
}

static NOINLINE jv get_attr(rstate *r, const jnode *at, jv obj, const char *name) {
    static const char *const str_methods[] = {"startswith", "endswith", "split", "strip", "lstrip", "rstrip", "upper",
                                               "lower", "title", "capitalize", "replace", "find", "count", "join",
                                               "splitlines", "format", "isdigit", "isalpha", "isspace"};
    static const char *const dict_methods[] = {"items", "keys", "values", "get"};
    switch (obj.kind) {
    case JV_UNDEF:
        fail(r, at, "'%s' is undefined (reading its attribute '%s')", obj.undef_name ? obj.undef_name : "value", name);
    case JV_STR:
        if (is_one_of(name, str_methods, KVB_ARRAY_LEN(str_methods))) return mk_method(r, obj, name);
        break;
    case JV_DICT:
        if (is_one_of(name, dict_methods, KVB_ARRAY_LEN(dict_methods))) return mk_method(r, obj, name);
        /* fall through */
    case JV_NS: {
        jv *v = dict_find_s(r, obj.u.d, name);
        if (v) return *v;
        break;
    }
    case JV_LIST:
        if (!strcmp(name, "append") || !strcmp(name, "pop") || !strcmp(name, "insert") || !strcmp(name, "extend"))
            fail(r, at, "lists are immutable in chat templates ('%s')", name);
        break;
    default: break;
    }
    return (jv){.kind = JV_UNDEF, .undef_name = name};
}

static NOINLINE jv get_item(rstate *r, const jnode *at, jv obj, jv key) {
    switch (obj.kind) {
    case JV_UNDEF: fail(r, at, "'%s' is undefined (indexing it)", obj.undef_name ? obj.undef_name : "value");
    case JV_LIST:
    case JV_STR: {
        if (!is_intlike(key)) {
            if (obj.kind == JV_STR && key.kind == JV_STR) break;
            fail(r, at, "%s indices must be integers, not %s", kind_name(obj), kind_name(key));
        }
        int64_t i = ival(key);
        if (obj.kind == JV_LIST) {
            int64_t n = (int64_t)obj.u.l->n;
            if (i < 0) i += n;
            if (i < 0 || i >= n) return UNDEF;
            return obj.u.l->v[i];
        }
        int64_t n = (int64_t)cp_count(r, obj.u.s.p, obj.u.s.n);
        if (i < 0) i += n;
        if (i < 0 || i >= n) return UNDEF;
        size_t a = cp_offset(r, obj.u.s.p, obj.u.s.n, i), e = cp_offset(r, obj.u.s.p, obj.u.s.n, i + 1);
        return (jv){.kind = JV_STR, .u.s = {obj.u.s.p + a, e - a}};
    }
    case JV_DICT:
    case JV_NS: {
        jv *v = dict_find(r, obj.u.d, key);
        if (v) return *v;
        break;
    }
    default: break;
    }
    jv u = UNDEF;
    if (key.kind == JV_STR) u.undef_name = kvb__ja_strdup(&r->a, key.u.s.p, key.u.s.n);
    return u;
}

static int64_t slice_bound(rstate *r, const jnode *at, jv v, int64_t dflt, int64_t n, int64_t step) {
    if (v.kind == JV_UNDEF || v.kind == JV_NONE) return dflt;
    if (!is_intlike(v)) fail(r, at, "slice indices must be integers");
    int64_t i = ival(v);
    if (i < 0) i += n;
    if (step > 0) return i < 0 ? 0 : i > n ? n : i;
    return i < 0 ? -1 : i >= n ? n - 1 : i;
}

static NOINLINE jv do_slice(rstate *r, const jnode *at, jv obj, jv a, jv b, jv c) {
    int64_t step = c.kind == JV_UNDEF || c.kind == JV_NONE ? 1 : is_intlike(c) ? ival(c) : 0;
    if (!step) fail(r, at, "slice step must be a non-zero integer");
    if (obj.kind != JV_LIST && obj.kind != JV_STR) fail(r, at, "cannot slice a %s", kind_name(obj));
    int64_t n = obj.kind == JV_LIST ? (int64_t)obj.u.l->n : (int64_t)cp_count(r, obj.u.s.p, obj.u.s.n);
    int64_t lo = slice_bound(r, at, a, step > 0 ? 0 : n - 1, n, step);
    int64_t hi = slice_bound(r, at, b, step > 0 ? n : -1, n, step);
    if (obj.kind == JV_LIST) {
        jv out = mk_list(r);
        for (int64_t i = lo; step > 0 ? i < hi : i > hi; i = sat_add(i, step)) list_push(r, out.u.l, obj.u.l->v[i]);
        return out;
    }
    if (step == 1) {
        if (hi <= lo) return mk_str(r, "", 0);
        size_t x = cp_offset(r, obj.u.s.p, obj.u.s.n, lo), y = cp_offset(r, obj.u.s.p, obj.u.s.n, hi);
        return (jv){.kind = JV_STR, .u.s = {obj.u.s.p + x, y - x}};
    }
    /* other steps: every character's offset once ([n + 1]), then the picked characters */
    size_t *off = kvb__ja_alloc(&r->a, ((size_t)n + 1) * sizeof *off);
    charge(r, at, 1 + obj.u.s.n / 64);
    for (size_t i = 0, k = 0; i <= obj.u.s.n; i++)
        if (i == obj.u.s.n || ((unsigned char)obj.u.s.p[i] & 0xC0) != 0x80) off[k++] = i;
    sbuf b2 = {0};
    for (int64_t i = lo; step > 0 ? i < hi : i > hi; i = sat_add(i, step)) bput(r, &b2, obj.u.s.p + off[i], off[i + 1] - off[i]);
    jv out = mk_buf_str(r, &b2);
    return out;
}

/* The items a for loop or a filter walks: a list's items, a dict's keys, a string's characters. */
static jlist *iter_items(rstate *r, const jnode *at, jv v) {
    switch (v.kind) {
    case JV_LIST: return v.u.l;
    case JV_UNDEF: return mk_list(r).u.l;
    case JV_DICT: {
        jv l = mk_list(r);
        for (size_t i = 0; i < v.u.d->n; i++) list_push(r, l.u.l, v.u.d->keys[i]);
        return l.u.l;
    }
    case JV_STR: {
        jv l = mk_list(r);
        for (size_t i = 0; i < v.u.s.n;) {
            int len;
            cp_at(v.u.s.p, v.u.s.n, i, &len);
            list_push(r, l.u.l, (jv){.kind = JV_STR, .u.s = {v.u.s.p + i, (size_t)len}});
            i += (size_t)len;
        }
        return l.u.l;
    }
    default: fail(r, at, "a %s is not iterable", kind_name(v));
    }
}

static jv dict_items(rstate *r, jv d) {
    jv l = mk_list(r);
    for (size_t i = 0; i < d.u.d->n; i++) {
        jv pair = mk_list(r);
        list_push(r, pair.u.l, d.u.d->keys[i]);
        list_push(r, pair.u.l, d.u.d->vals[i]);
        list_push(r, l.u.l, pair);
    }
    return l;
}

/* ---------------------------------------------------------------------------------- calls */

typedef struct jargs {
    jv *pos;
    int n_pos;
    const char **kw_names;
    jv *kw;
    int n_kw;
} jargs;

static NOINLINE jargs eval_args(rstate *r, scope *sc, const jnode *n) {
    jargs a = {0};
    a.pos = kvb__ja_alloc(&r->a, (size_t)(n->n_args + 1) * sizeof *a.pos);
    a.kw = kvb__ja_alloc(&r->a, (size_t)(n->n_args + 1) * sizeof *a.kw);
    a.kw_names = kvb__ja_alloc(&r->a, (size_t)(n->n_args + 1) * sizeof *a.kw_names);
    for (int i = 0; i < n->n_args; i++) {
        jv v = eval(r, sc, n->args[i]);
        if (n->kw && n->kw[i]) {
            a.kw_names[a.n_kw] = n->kw[i];
            a.kw[a.n_kw++] = v;
        } else a.pos[a.n_pos++] = v;
    }
    return a;
}

/* Argument `idx` by position, or by keyword `name`, or UNDEF. */
static jv arg(const jargs *a, int idx, const char *name) {
    if (idx >= 0 && idx < a->n_pos) return a->pos[idx];
    for (int i = 0; name && i < a->n_kw; i++)
        if (!strcmp(a->kw_names[i], name)) return a->kw[i];
    return UNDEF;
}

static int64_t int_arg(rstate *r, const jnode *at, const jargs *a, int idx, const char *name, int64_t dflt) {
    jv v = arg(a, idx, name);
    if (v.kind == JV_UNDEF || v.kind == JV_NONE) return dflt;
    if (!is_intlike(v)) fail(r, at, "argument %s must be an integer", name ? name : "");
    return ival(v);
}

static jv need_str(rstate *r, const jnode *at, jv v, const char *what) {
    if (v.kind != JV_STR) fail(r, at, "%s needs a string, got %s", what, kind_name(v));
    return v;
}

static NOINLINE jv call_macro(rstate *r, const jnode *at, const jnode *m, const jargs *a) {
    enter(r, at);
    scope *sc = push_scope(r, r->globals);
    for (int i = 0; i < m->n_params; i++) {
        jv v = arg(a, i, m->params[i]);
        if (v.kind == JV_UNDEF && m->args[i]) v = eval(r, sc, m->args[i]);
        dict_set_s(r, sc->vars, m->params[i], v);
    }
    sbuf b = {0}, *saved = r->out;
    r->out = &b;
    exec_body(r, sc, m->body, m->n_body);
    r->out = saved;
    jv s = mk_buf_str(r, &b);
    r->depth--;
    return s;
}

static NOINLINE jv call_global(rstate *r, const jnode *at, const char *fn, const jargs *a) {
    if (!strcmp(fn, "raise_exception")) {
        jv msg = str_of(r, arg(a, 0, "message"));
        snprintf(r->err, r->err_len, "%.*s", (int)msg.u.s.n, msg.u.s.p);
        r->st = KVB_ERR_INVALID;
        longjmp(r->jb, 1);
    }
    if (!strcmp(fn, "namespace") || !strcmp(fn, "dict")) {
        jv ns = mk_dict(r, fn[0] == 'n' ? JV_NS : JV_DICT);
        if (a->n_pos && (a->pos[0].kind == JV_DICT || a->pos[0].kind == JV_NS))
            for (size_t i = 0; i < a->pos[0].u.d->n; i++) dict_set(r, ns.u.d, a->pos[0].u.d->keys[i], a->pos[0].u.d->vals[i]);
        for (int i = 0; i < a->n_kw; i++) dict_set_s(r, ns.u.d, a->kw_names[i], a->kw[i]);
        return ns;
    }
    if (!strcmp(fn, "range")) {
        int64_t lo = 0, hi, step = 1;
        if (a->n_pos == 1) hi = int_arg(r, at, a, 0, NULL, 0);
        else {
            lo = int_arg(r, at, a, 0, NULL, 0);
            hi = int_arg(r, at, a, 1, NULL, 0);
            step = int_arg(r, at, a, 2, NULL, 1);
        }
        if (!step) fail(r, at, "range() step must not be zero");
        jv l = mk_list(r);
        for (int64_t i = lo; step > 0 ? i < hi : i > hi; i = sat_add(i, step)) {
            if (l.u.l->n >= MAX_RANGE) fail(r, at, "range() larger than %d", MAX_RANGE);
            list_push(r, l.u.l, mk_int(i));
        }
        return l;
    }
    if (!strcmp(fn, "strftime_now")) {
        jv f = need_str(r, at, arg(a, 0, "format"), "strftime_now");
        char fmt[128], out[256];
        snprintf(fmt, sizeof fmt, "%.*s", (int)f.u.s.n, f.u.s.p);
        time_t now = time(NULL);
        struct tm tm;
        localtime_r(&now, &tm);
        size_t n = strftime(out, sizeof out, fmt, &tm);
        return mk_str(r, out, n);
    }
    fail(r, at, "unknown function %s", fn);
}

static NOINLINE jv call_method(rstate *r, const jnode *at, struct jmethod *m, const jargs *a) {
    jv s = m->self;
    const char *name = m->name;
    if (s.kind == JV_DICT) {
        if (!strcmp(name, "items")) return dict_items(r, s);
        if (!strcmp(name, "keys") || !strcmp(name, "values")) {
            jv l = mk_list(r);
            for (size_t i = 0; i < s.u.d->n; i++) list_push(r, l.u.l, name[0] == 'k' ? s.u.d->keys[i] : s.u.d->vals[i]);
            return l;
        }
        jv *v = dict_find(r, s.u.d, arg(a, 0, "key")); /* get */
        if (v) return *v;
        jv d = arg(a, 1, "default");
        return d.kind == JV_UNDEF ? NONE : d;
    }
    /* string methods */
    if (!strcmp(name, "startswith") || !strcmp(name, "endswith")) {
        jv x = arg(a, 0, NULL);
        jlist one = {&x, 1, 1}, *cands = x.kind == JV_LIST ? x.u.l : &one;
        for (size_t i = 0; i < cands->n; i++) {
            jv p = need_str(r, at, cands->v[i], name);
            if (p.u.s.n > s.u.s.n) continue;
            const char *at_p = name[0] == 's' ? s.u.s.p : s.u.s.p + s.u.s.n - p.u.s.n;
            if (!memcmp(at_p, p.u.s.p, p.u.s.n)) return mk_bool(1);
        }
        return mk_bool(0);
    }
    if (!strcmp(name, "split")) return py_split(r, s, arg(a, 0, "sep"), int_arg(r, at, a, 1, "maxsplit", -1));
    if (!strcmp(name, "strip") || !strcmp(name, "lstrip") || !strcmp(name, "rstrip"))
        return py_strip(r, s, arg(a, 0, "chars"), name[0] == 's' ? 3 : name[0] == 'l' ? 1 : 2);
    if (!strcmp(name, "upper")) return py_case(r, s, 'u');
    if (!strcmp(name, "lower")) return py_case(r, s, 'l');
    if (!strcmp(name, "title")) return py_case(r, s, 't');
    if (!strcmp(name, "capitalize")) return py_case(r, s, 'c');
    if (!strcmp(name, "replace")) return py_replace(r, s, arg(a, 0, "old"), arg(a, 1, "new"), int_arg(r, at, a, 2, "count", -1));
    if (!strcmp(name, "find") || !strcmp(name, "count")) {
        jv sub = need_str(r, at, arg(a, 0, "sub"), name);
        if (name[0] == 'f') {
            const char *f = memmem_s(r, s.u.s.p, s.u.s.n, sub.u.s.p, sub.u.s.n);
            return mk_int(f ? (int64_t)cp_count(r, s.u.s.p, (size_t)(f - s.u.s.p)) : -1);
        }
        if (!sub.u.s.n) return mk_int((int64_t)cp_count(r, s.u.s.p, s.u.s.n) + 1);
        int64_t k = 0;
        for (const char *p = s.u.s.p, *e = p + s.u.s.n; (p = memmem_s(r, p, (size_t)(e - p), sub.u.s.p, sub.u.s.n)); p += sub.u.s.n) k++;
        return mk_int(k);
    }
    if (!strcmp(name, "join")) {
        jlist *items = iter_items(r, at, arg(a, 0, "iterable"));
        sbuf b = {0};
        for (size_t i = 0; i < items->n; i++) {
            if (i) bput(r, &b, s.u.s.p, s.u.s.n);
            jv it = need_str(r, at, items->v[i], "join");
            bput(r, &b, it.u.s.p, it.u.s.n);
        }
        jv o = mk_buf_str(r, &b);
        return o;
    }
    if (!strcmp(name, "splitlines")) {
        jv l = mk_list(r);
        const char *p = s.u.s.p, *e = p + s.u.s.n;
        while (p < e) {
            const char *q = p;
            while (q < e && *q != '\n' && *q != '\r') q++;
            list_push(r, l.u.l, (jv){.kind = JV_STR, .u.s = {p, (size_t)(q - p)}});
            if (q < e && *q == '\r' && q + 1 < e && q[1] == '\n') q++;
            p = q + 1;
        }
        return l;
    }
    if (!strcmp(name, "format")) { /* positional "{}" and "{0}" fields */
        sbuf b = {0};
        int next = 0;
        for (size_t i = 0; i < s.u.s.n; i++) {
            char c = s.u.s.p[i];
            if (c == '{' && i + 1 < s.u.s.n && s.u.s.p[i + 1] == '{') bput(r, &b, "{", 1), i++;
            else if (c == '}' && i + 1 < s.u.s.n && s.u.s.p[i + 1] == '}') bput(r, &b, "}", 1), i++;
            else if (c == '{') {
                size_t e = i + 1;
                while (e < s.u.s.n && s.u.s.p[e] >= '0' && s.u.s.p[e] <= '9') e++;
                if (e >= s.u.s.n || s.u.s.p[e] != '}') fail(r, at, "format: only {} and {N} fields are supported");
                int idx = e > i + 1 ? atoi(s.u.s.p + i + 1) : next++;
                to_str(r, &b, arg(a, idx, NULL));
                i = e;
            } else bput(r, &b, &c, 1);
        }
        jv o = mk_buf_str(r, &b);
        return o;
    }
    if (!strcmp(name, "isdigit") || !strcmp(name, "isalpha") || !strcmp(name, "isspace")) {
        if (!s.u.s.n) return mk_bool(0);
        for (size_t i = 0; i < s.u.s.n;) {
            int l;
            uint32_t c = cp_at(s.u.s.p, s.u.s.n, i, &l);
            int ok = name[2] == 'd' ? (c >= '0' && c <= '9')
                   : name[2] == 'a' ? ((c | 32) >= 'a' && (c | 32) <= 'z')
                                    : py_space(c);
            if (!ok) return mk_bool(0);
            i += (size_t)l;
        }
        return mk_bool(1);
    }
    fail(r, at, "unknown method %s", name);
}

static jv call_value(rstate *r, const jnode *at, jv f, const jargs *a) {
    switch (f.kind) {
    case JV_FUNC: return call_global(r, at, f.u.fn, a);
    case JV_METHOD: return call_method(r, at, f.u.m, a);
    case JV_MACRO: return call_macro(r, at, f.u.macro, a);
    case JV_UNDEF: fail(r, at, "'%s' is undefined (calling it)", f.undef_name ? f.undef_name : "value");
    default: fail(r, at, "a %s is not callable", kind_name(f));
    }
}

/* ---------------------------------------------------------------------------------- tests, filters */

static NOINLINE int apply_test(rstate *r, const jnode *at, const char *name, jv v, const jargs *a) {
    jv x = arg(a, 0, NULL);
    if (!strcmp(name, "defined")) return v.kind != JV_UNDEF;
    if (!strcmp(name, "undefined")) return v.kind == JV_UNDEF;
    if (!strcmp(name, "none")) return v.kind == JV_NONE;
    if (!strcmp(name, "boolean")) return v.kind == JV_BOOL;
    if (!strcmp(name, "true")) return v.kind == JV_BOOL && v.u.b;
    if (!strcmp(name, "false")) return v.kind == JV_BOOL && !v.u.b;
    if (!strcmp(name, "integer")) return v.kind == JV_INT;
    if (!strcmp(name, "float")) return v.kind == JV_FLOAT;
    if (!strcmp(name, "number")) return is_num(v);
    if (!strcmp(name, "string")) return v.kind == JV_STR;
    if (!strcmp(name, "mapping")) return v.kind == JV_DICT;
    if (!strcmp(name, "iterable")) return v.kind == JV_LIST || v.kind == JV_DICT || v.kind == JV_STR || v.kind == JV_UNDEF;
    if (!strcmp(name, "sequence")) return v.kind == JV_LIST || v.kind == JV_DICT || v.kind == JV_STR;
    if (!strcmp(name, "callable")) return v.kind == JV_FUNC || v.kind == JV_METHOD || v.kind == JV_MACRO;
    if (!strcmp(name, "sameas")) return v.kind == x.kind && (v.kind <= JV_NONE || val_eq(r, v, x));
    if (!strcmp(name, "equalto") || !strcmp(name, "eq") || !strcmp(name, "==")) return val_eq(r, v, x);
    if (!strcmp(name, "ne") || !strcmp(name, "!=")) return !val_eq(r, v, x);
    if (!strcmp(name, "lt") || !strcmp(name, "lessthan")) return val_cmp(r, at, v, x) < 0;
    if (!strcmp(name, "le")) return val_cmp(r, at, v, x) <= 0;
    if (!strcmp(name, "gt") || !strcmp(name, "greaterthan")) return val_cmp(r, at, v, x) > 0;
    if (!strcmp(name, "ge")) return val_cmp(r, at, v, x) >= 0;
    if (!strcmp(name, "odd") || !strcmp(name, "even")) {
        if (!is_intlike(v)) fail(r, at, "test %s needs an integer", name);
        return (ival(v) % 2 != 0) == (name[0] == 'o');
    }
    if (!strcmp(name, "divisibleby")) {
        if (!is_intlike(v) || !is_intlike(x) || !ival(x)) fail(r, at, "divisibleby needs integers");
        return ival(v) % ival(x) == 0;
    }
    if (!strcmp(name, "lower") || !strcmp(name, "upper")) {
        jv s = need_str(r, at, v, name);
        return val_eq(r, py_case(r, s, name[0]), s);
    }
    if (!strcmp(name, "in")) {
        if (x.kind == JV_STR && v.kind == JV_STR) return memmem_s(r, x.u.s.p, x.u.s.n, v.u.s.p, v.u.s.n) != NULL;
        jlist *items = iter_items(r, at, x);
        for (size_t i = 0; i < items->n; i++)
            if (val_eq(r, items->v[i], v)) return 1;
        return 0;
    }
    fail(r, at, "unknown test '%s'", name);
}

static int64_t length_of(rstate *r, const jnode *at, jv v) {
    switch (v.kind) {
    case JV_STR: return (int64_t)cp_count(r, v.u.s.p, v.u.s.n);
    case JV_LIST: return (int64_t)v.u.l->n;
    case JV_DICT:
    case JV_NS: return (int64_t)v.u.d->n;
    case JV_UNDEF: return 0;
    default: fail(r, at, "a %s has no length", kind_name(v));
    }
}

/* attribute "a.b" of v, for map / selectattr / sort / join (dots walk into nested values) */
static jv attr_path(rstate *r, const jnode *at, jv v, jv path) {
    jv p = need_str(r, at, path, "attribute");
    const char *s = p.u.s.p, *e = s + p.u.s.n;
    while (s < e) {
        const char *dot = memchr(s, '.', (size_t)(e - s));
        const char *end = dot ? dot : e;
        char *name = kvb__ja_strdup(&r->a, s, (size_t)(end - s));
        if (v.kind == JV_LIST && name[0] >= '0' && name[0] <= '9') v = get_item(r, at, v, mk_int(atoll(name)));
        else v = v.kind == JV_UNDEF ? v : get_attr(r, at, v, name);
        s = end + 1;
    }
    return v;
}

static jv apply_filter(rstate *r, scope *sc, const jnode *at, const char *name, jv v, const jargs *a);

/* select / reject / selectattr / rejectattr: keep items whose test result equals `keep`. */
static NOINLINE jv filter_select(rstate *r, const jnode *at, jv v, const jargs *a, int by_attr, int keep) {
    jlist *items = iter_items(r, at, v);
    jv out = mk_list(r);
    int first = by_attr ? 1 : 0;
    jv test = arg(a, first, NULL);
    jargs rest = *a;
    rest.pos = a->pos + (a->n_pos > first + 1 ? first + 1 : a->n_pos);
    rest.n_pos = KVB_MAX(a->n_pos - first - 1, 0);
    for (size_t i = 0; i < items->n; i++) {
        jv x = by_attr ? attr_path(r, at, items->v[i], arg(a, 0, NULL)) : items->v[i];
        int ok = test.kind == JV_UNDEF ? truthy(x)
                                       : apply_test(r, at, need_str(r, at, test, "select").u.s.p, x, &rest);
        if (ok == keep) list_push(r, out.u.l, items->v[i]);
    }
    return out;
}

static void sort_list(rstate *r, const jnode *at, jv *keys, jv *vals, size_t n, int reverse) {
    /* insertion sort (stable): template data are small */
    for (size_t i = 1; i < n; i++)
        for (size_t k = i; k > 0; k--) {
            int c = val_cmp(r, at, keys[k - 1], keys[k]);
            if (reverse ? c >= 0 : c <= 0) break;
            jv t = keys[k];
            keys[k] = keys[k - 1];
            keys[k - 1] = t;
            t = vals[k];
            vals[k] = vals[k - 1];
            vals[k - 1] = t;
        }
}

static NOINLINE jv apply_filter(rstate *r, scope *sc, const jnode *at, const char *name, jv v, const jargs *a) {
    if (!strcmp(name, "trim")) return py_strip(r, need_str(r, at, v.kind == JV_STR ? v : str_of(r, v), "trim"), arg(a, 0, "chars"), 3);
    if (!strcmp(name, "tojson")) {
        sbuf b = {0};
        jv ind = arg(a, 0, "indent");
        to_json(r, at, &b, v, is_intlike(ind) ? (int)ival(ind) : -1, truthy(arg(a, -1, "sort_keys")), 0);
        jv o = mk_buf_str(r, &b);
        return o;
    }
    if (!strcmp(name, "length") || !strcmp(name, "count")) return mk_int(length_of(r, at, v));
    if (!strcmp(name, "string")) return str_of(r, v);
    if (!strcmp(name, "safe")) return v;
    if (!strcmp(name, "int")) {
        if (v.kind == JV_FLOAT && !(v.u.f > -9223372036854775808.0 && v.u.f < 9223372036854775808.0))
            fail(r, at, "int: %g does not fit in 64 bits", v.u.f);
        if (is_num(v)) return mk_int(v.kind == JV_FLOAT ? (int64_t)v.u.f : ival(v));
        if (v.kind == JV_STR) {
            char *end, *s = kvb__ja_strdup(&r->a, v.u.s.p, v.u.s.n);
            long long x = strtoll(s, &end, 10);
            if (end != s && !*py_strip(r, (jv){.kind = JV_STR, .u.s = {end, strlen(end)}}, UNDEF, 3).u.s.p) return mk_int(x);
        }
        return mk_int(int_arg(r, at, a, 0, "default", 0));
    }
    if (!strcmp(name, "float")) {
        if (is_num(v)) return mk_float(num(v));
        if (v.kind == JV_STR) {
            char *end, *s = kvb__ja_strdup(&r->a, v.u.s.p, v.u.s.n);
            double x = strtod(s, &end);
            if (end != s && !*end) return mk_float(x);
        }
        jv d = arg(a, 0, "default");
        return is_num(d) ? mk_float(num(d)) : mk_float(0);
    }
    if (!strcmp(name, "lower") || !strcmp(name, "upper") || !strcmp(name, "title") || !strcmp(name, "capitalize"))
        return py_case(r, str_of(r, v), name[0] == 'c' ? 'c' : name[0]);
    if (!strcmp(name, "join")) {
        jlist *items = iter_items(r, at, v);
        jv sep = arg(a, 0, "d"), attr = arg(a, 1, "attribute");
        sbuf b = {0};
        for (size_t i = 0; i < items->n; i++) {
            if (i && sep.kind == JV_STR) bput(r, &b, sep.u.s.p, sep.u.s.n);
            to_str(r, &b, attr.kind == JV_UNDEF ? items->v[i] : attr_path(r, at, items->v[i], attr));
        }
        jv o = mk_buf_str(r, &b);
        return o;
    }
    if (!strcmp(name, "first") || !strcmp(name, "last")) {
        jlist *items = iter_items(r, at, v);
        if (!items->n) return UNDEF;
        return items->v[name[0] == 'f' ? 0 : items->n - 1];
    }
    if (!strcmp(name, "default") || !strcmp(name, "d")) {
        int boolean = truthy(arg(a, 1, "boolean"));
        if (v.kind == JV_UNDEF || (boolean && !truthy(v))) {
            jv d = arg(a, 0, "default_value");
            return d.kind == JV_UNDEF ? mk_str(r, "", 0) : d;
        }
        return v;
    }
    if (!strcmp(name, "items")) {
        if (v.kind == JV_UNDEF) return mk_list(r);
        if (v.kind != JV_DICT && v.kind != JV_NS) fail(r, at, "items needs a mapping, got %s", kind_name(v));
        return dict_items(r, v);
    }
    if (!strcmp(name, "list")) {
        jv l = mk_list(r);
        jlist *items = iter_items(r, at, v);
        for (size_t i = 0; i < items->n; i++) list_push(r, l.u.l, items->v[i]);
        return l;
    }
    if (!strcmp(name, "reverse")) {
        if (v.kind == JV_STR) return do_slice(r, at, v, UNDEF, UNDEF, mk_int(-1));
        jlist *items = iter_items(r, at, v);
        jv l = mk_list(r);
        for (size_t i = items->n; i > 0; i--) list_push(r, l.u.l, items->v[i - 1]);
        return l;
    }
    if (!strcmp(name, "replace"))
        return py_replace(r, str_of(r, v), arg(a, 0, "old"), arg(a, 1, "new"), int_arg(r, at, a, 2, "count", -1));
    if (!strcmp(name, "select")) return filter_select(r, at, v, a, 0, 1);
    if (!strcmp(name, "reject")) return filter_select(r, at, v, a, 0, 0);
    if (!strcmp(name, "selectattr")) return filter_select(r, at, v, a, 1, 1);
    if (!strcmp(name, "rejectattr")) return filter_select(r, at, v, a, 1, 0);
    if (!strcmp(name, "map")) {
        jlist *items = iter_items(r, at, v);
        jv out = mk_list(r), attr = arg(a, -1, "attribute");
        jargs rest = *a;
        if (attr.kind == JV_UNDEF) {
            if (!a->n_pos) fail(r, at, "map needs a filter name or attribute=");
            rest.pos++;
            rest.n_pos--;
        }
        for (size_t i = 0; i < items->n; i++) {
            jv x;
            if (attr.kind != JV_UNDEF) {
                x = attr_path(r, at, items->v[i], attr);
                if (x.kind == JV_UNDEF) {
                    jv d = arg(a, -1, "default");
                    if (d.kind != JV_UNDEF) x = d;
                }
            } else x = apply_filter(r, sc, at, need_str(r, at, a->pos[0], "map").u.s.p, items->v[i], &rest);
            list_push(r, out.u.l, x);
        }
        return out;
    }
    if (!strcmp(name, "unique")) {
        jlist *items = iter_items(r, at, v);
        jv out = mk_list(r);
        for (size_t i = 0; i < items->n; i++) {
            size_t k;
            for (k = 0; k < out.u.l->n && !val_eq(r, out.u.l->v[k], items->v[i]); k++) {}
            if (k == out.u.l->n) list_push(r, out.u.l, items->v[i]);
        }
        return out;
    }
    if (!strcmp(name, "abs")) {
        if (v.kind == JV_FLOAT) return mk_float(fabs(v.u.f));
        if (is_intlike(v)) {
            if (ival(v) == INT64_MIN) fail(r, at, "integer overflow: abs(%lld)", (long long)ival(v));
            return mk_int(ival(v) < 0 ? -ival(v) : ival(v));
        }
        fail(r, at, "abs needs a number");
    }
    if (!strcmp(name, "round")) {
        if (!is_num(v)) fail(r, at, "round needs a number");
        int64_t prec = int_arg(r, at, a, 0, "precision", 0);
        double m = pow(10.0, (double)prec), x = num(v) * m;
        jv method = arg(a, 1, "method");
        x = str_eq(method, "floor") ? floor(x) : str_eq(method, "ceil") ? ceil(x) : round(x);
        return mk_float(x / m);
    }
    if (!strcmp(name, "sort") || !strcmp(name, "dictsort")) {
        int dict = name[0] == 'd';
        jlist *items = dict ? dict_items(r, v).u.l : iter_items(r, at, v);
        size_t n = items->n;
        jv *keys = kvb__ja_alloc(&r->a, (n + 1) * sizeof *keys), *vals = kvb__ja_alloc(&r->a, (n + 1) * sizeof *vals);
        jv attr = arg(a, dict ? -1 : 2, "attribute");
        int reverse = truthy(arg(a, dict ? 2 : 0, "reverse"));
        for (size_t i = 0; i < n; i++) {
            vals[i] = items->v[i];
            keys[i] = dict ? items->v[i].u.l->v[str_eq(arg(a, 1, "by"), "value") ? 1 : 0]
                     : attr.kind != JV_UNDEF ? attr_path(r, at, items->v[i], attr) : items->v[i];
        }
        sort_list(r, at, keys, vals, n, reverse);
        jv out = mk_list(r);
        for (size_t i = 0; i < n; i++) list_push(r, out.u.l, vals[i]);
        return out;
    }
    if (!strcmp(name, "sum") || !strcmp(name, "min") || !strcmp(name, "max")) {
        jlist *items = iter_items(r, at, v);
        if (name[1] == 'u') {
            jv acc = arg(a, 1, "start");
            if (acc.kind == JV_UNDEF) acc = mk_int(0);
            for (size_t i = 0; i < items->n; i++) {
                if (!is_num(items->v[i]) || !is_num(acc)) fail(r, at, "sum needs numbers");
                int64_t x;
                if (is_intlike(acc) && is_intlike(items->v[i]) && __builtin_add_overflow(ival(acc), ival(items->v[i]), &x))
                    fail(r, at, "integer overflow: sum exceeds 64 bits");
                acc = is_intlike(acc) && is_intlike(items->v[i]) ? mk_int(x) : mk_float(num(acc) + num(items->v[i]));
            }
            return acc;
        }
        if (!items->n) return UNDEF;
        jv best = items->v[0];
        for (size_t i = 1; i < items->n; i++) {
            int c = val_cmp(r, at, items->v[i], best);
            if (name[1] == 'i' ? c < 0 : c > 0) best = items->v[i];
        }
        return best;
    }
    if (!strcmp(name, "indent")) {
        jv s = str_of(r, v), w = arg(a, 0, "width");
        int first = truthy(arg(a, 1, "first")), blank = truthy(arg(a, 2, "blank"));
        sbuf pad = {0}, b = {0};
        if (w.kind == JV_STR) bput(r, &pad, w.u.s.p, w.u.s.n);
        else for (int64_t k = 0; k < (is_intlike(w) ? ival(w) : 4); k++) bput(r, &pad, " ", 1);
        const char *p = s.u.s.p, *e = p + s.u.s.n;
        for (int line = 0; p <= e; line++) {
            const char *q = memchr(p, '\n', (size_t)(e - p));
            const char *end = q ? q : e;
            if ((line > 0 || first) && (blank || end > p)) bput(r, &b, pad.p ? pad.p : "", pad.len);
            bput(r, &b, p, (size_t)(end - p));
            if (!q) break;
            bput(r, &b, "\n", 1);
            p = q + 1;
        }
        jv o = mk_buf_str(r, &b);
        return o;
    }
    fail(r, at, "unknown filter '%s'", name);
}

/* ---------------------------------------------------------------------------------- expressions */

static NOINLINE jv binop(rstate *r, const jnode *at, jop op, jv x, jv y) {
    if (op == OP_CONCAT) {
        sbuf b = {0};
        to_str(r, &b, x);
        to_str(r, &b, y);
        jv o = mk_buf_str(r, &b);
        return o;
    }
    if (op == OP_ADD && x.kind == JV_STR && y.kind == JV_STR) {
        char *p = kvb__ja_alloc(&r->a, x.u.s.n + y.u.s.n + 1);
        memcpy(p, x.u.s.p, x.u.s.n);
        memcpy(p + x.u.s.n, y.u.s.p, y.u.s.n);
        return (jv){.kind = JV_STR, .u.s = {p, x.u.s.n + y.u.s.n}};
    }
    if (op == OP_ADD && x.kind == JV_LIST && y.kind == JV_LIST) {
        jv l = mk_list(r);
        for (size_t i = 0; i < x.u.l->n; i++) list_push(r, l.u.l, x.u.l->v[i]);
        for (size_t i = 0; i < y.u.l->n; i++) list_push(r, l.u.l, y.u.l->v[i]);
        return l;
    }
    if (op == OP_MUL && (x.kind == JV_STR || x.kind == JV_LIST) && is_intlike(y)) {
        sbuf b = {0};
        jv l = mk_list(r);
        for (int64_t k = 0; k < ival(y); k++) {
            if (x.kind == JV_STR) bput(r, &b, x.u.s.p, x.u.s.n);
            else
                for (size_t i = 0; i < x.u.l->n; i++) list_push(r, l.u.l, x.u.l->v[i]);
            charge(r, at, 1 + x.u.s.n / 64);
            if (l.u.l->n > MAX_RANGE) fail(r, at, "repetition too large");
        }
        if (x.kind == JV_LIST) return l;
        jv o = mk_buf_str(r, &b);
        return o;
    }
    if (!is_num(x) || !is_num(y)) {
        static const char *const ops[] = {"+", "-", "*", "/", "//", "%", "**"};
        fail(r, at, "unsupported operand types for %s: %s and %s", ops[op], kind_name(x), kind_name(y));
    }
    int ints = is_intlike(x) && is_intlike(y);
    int64_t a = ival(x), b = ival(y), c = 0;
    double fa = num(x), fb = num(y);
    static const char *const sym[] = {"+", "-", "*", "/", "//", "%", "**"};
    /* Python's ints have no bound; ours are 64 bits: a result beyond them is an error, not a wrap */
    int over = ints && ((op == OP_ADD && __builtin_add_overflow(a, b, &c)) ||
                        (op == OP_SUB && __builtin_sub_overflow(a, b, &c)) ||
                        (op == OP_MUL && __builtin_mul_overflow(a, b, &c)) ||
                        ((op == OP_FLOORDIV || op == OP_MOD) && a == INT64_MIN && b == -1));
    if (over) fail(r, at, "integer overflow: %lld %s %lld does not fit in 64 bits", (long long)a, sym[op], (long long)b);
    switch (op) {
    case OP_ADD: return ints ? mk_int(c) : mk_float(fa + fb);
    case OP_SUB: return ints ? mk_int(c) : mk_float(fa - fb);
    case OP_MUL: return ints ? mk_int(c) : mk_float(fa * fb);
    case OP_DIV:
        if (fb == 0) fail(r, at, "division by zero");
        return mk_float(fa / fb);
    case OP_FLOORDIV:
    case OP_MOD:
        if (fb == 0) fail(r, at, "division by zero");
        if (ints) {
            int64_t q = a / b, m = a % b;
            if (m && ((m < 0) != (b < 0))) {
                q--;
                m += b;
            }
            return op == OP_MOD ? mk_int(m) : mk_int(q);
        } else {
            double q = floor(fa / fb), m = fa - q * fb;
            return op == OP_MOD ? mk_float(m) : mk_float(q);
        }
    case OP_POW:
        if (ints && b >= 0) { /* by squaring: O(log b) */
            int64_t p = 1, base = a;
            /* the square is used later whenever a higher bit of e is left: its overflow is the result's */
            for (int64_t e = b; e; e >>= 1)
                if (((e & 1) && __builtin_mul_overflow(p, base, &p)) || ((e >> 1) && __builtin_mul_overflow(base, base, &base)))
                    fail(r, at, "integer overflow: %lld ** %lld does not fit in 64 bits", (long long)a, (long long)b);
            return mk_int(p);
        }
        return mk_float(pow(fa, fb));
    default: fail(r, at, "bad operator");
    }
}

static NOINLINE int contains(rstate *r, const jnode *at, jv hay, jv needle) {
    if (hay.kind == JV_STR) {
        if (needle.kind != JV_STR) fail(r, at, "'in <string>' needs a string on the left, not %s", kind_name(needle));
        return memmem_s(r, hay.u.s.p, hay.u.s.n, needle.u.s.p, needle.u.s.n) != NULL;
    }
    if (hay.kind == JV_DICT || hay.kind == JV_NS) return dict_find(r, hay.u.d, needle) != NULL;
    if (hay.kind == JV_LIST) {
        for (size_t i = 0; i < hay.u.l->n; i++)
            if (val_eq(r, hay.u.l->v[i], needle)) return 1;
        return 0;
    }
    if (hay.kind == JV_UNDEF) return 0;
    fail(r, at, "'in' needs a string, list or mapping on the right, not %s", kind_name(hay));
}

static jv eval_node(rstate *r, scope *sc, const jnode *n);

/* The cases of eval_node with larger frames, apart: eval_node recurses (limits.h's stack bound). */
static NOINLINE jv eval_call(rstate *r, scope *sc, const jnode *n) {
    if (n->kind == JN_SLICE)
        return do_slice(r, n, eval(r, sc, n->a), n->b ? eval(r, sc, n->b) : UNDEF, n->c ? eval(r, sc, n->c) : UNDEF,
                        n->d ? eval(r, sc, n->d) : UNDEF);
    jv v = eval(r, sc, n->a);
    jargs a = eval_args(r, sc, n);
    if (n->kind == JN_CALL) return call_value(r, n, v, &a);
    if (n->kind == JN_FILTER) return apply_filter(r, sc, n, n->name, v, &a);
    int t = apply_test(r, n, n->name, v, &a);
    return mk_bool(n->op == OP_NE ? !t : t);
}

static NOINLINE jv eval_cmp(rstate *r, scope *sc, const jnode *n) {
    jv x = eval(r, sc, n->a), y = eval(r, sc, n->b);
    switch (n->op) {
    case OP_EQ: return mk_bool(val_eq(r, x, y));
    case OP_NE: return mk_bool(!val_eq(r, x, y));
    case OP_LT: return mk_bool(val_cmp(r, n, x, y) < 0);
    case OP_LE: return mk_bool(val_cmp(r, n, x, y) <= 0);
    case OP_GT: return mk_bool(val_cmp(r, n, x, y) > 0);
    default: return mk_bool(val_cmp(r, n, x, y) >= 0);
    }
}

static NOINLINE jv eval_literal(rstate *r, scope *sc, const jnode *n) {
    if (n->kind == JN_DICT) {
        jv d = mk_dict(r, JV_DICT);
        for (int i = 0; i + 1 < n->n_args; i += 2) {
            jv k = eval(r, sc, n->args[i]);
            dict_set(r, d.u.d, k, eval(r, sc, n->args[i + 1]));
        }
        return d;
    }
    jv l = mk_list(r);
    for (int i = 0; i < n->n_args; i++) list_push(r, l.u.l, eval(r, sc, n->args[i]));
    return l;
}

/* Every evaluation is a step and a level of recursion. */
static jv eval(rstate *r, scope *sc, const jnode *n) {
    charge(r, n, 1);
    enter(r, n);
    jv v = eval_node(r, sc, n);
    r->depth--;
    return v;
}

static jv eval_node(rstate *r, scope *sc, const jnode *n) {
    switch (n->kind) {
    case JN_LIT: return n->lit;
    case JN_NAME: {
        jv *v = lookup(r, sc, n->name);
        if (v) return *v;
        if (is_one_of(n->name, GLOBAL_FUNCS, KVB_ARRAY_LEN(GLOBAL_FUNCS))) return (jv){.kind = JV_FUNC, .u.fn = n->name};
        return (jv){.kind = JV_UNDEF, .undef_name = n->name};
    }
    case JN_ATTR: return get_attr(r, n, eval(r, sc, n->a), n->name);
    case JN_ITEM: return get_item(r, n, eval(r, sc, n->a), eval(r, sc, n->b));
    case JN_SLICE:
    case JN_CALL:
    case JN_FILTER:
    case JN_TEST: return eval_call(r, sc, n);
    case JN_NEG:
    case JN_POS: {
        jv v = eval(r, sc, n->a);
        if (!is_num(v)) fail(r, n, "bad operand type for unary %s: %s", n->kind == JN_NEG ? "-" : "+", kind_name(v));
        if (n->kind == JN_POS) return v;
        if (v.kind != JV_FLOAT && ival(v) == INT64_MIN) fail(r, n, "integer overflow: -(%lld)", (long long)ival(v));
        return v.kind == JV_FLOAT ? mk_float(-v.u.f) : mk_int(-ival(v));
    }
    case JN_NOT: return mk_bool(!truthy(eval(r, sc, n->a)));
    case JN_AND: {
        jv x = eval(r, sc, n->a);
        return truthy(x) ? eval(r, sc, n->b) : x;
    }
    case JN_OR: {
        jv x = eval(r, sc, n->a);
        return truthy(x) ? x : eval(r, sc, n->b);
    }
    case JN_BIN: return binop(r, n, n->op, eval(r, sc, n->a), eval(r, sc, n->b));
    case JN_CMP: return eval_cmp(r, sc, n);
    case JN_IN: return mk_bool(contains(r, n, eval(r, sc, n->b), eval(r, sc, n->a)));
    case JN_NOT_IN: return mk_bool(!contains(r, n, eval(r, sc, n->b), eval(r, sc, n->a)));
    case JN_COND:
        if (truthy(eval(r, sc, n->a))) return eval(r, sc, n->b);
        return n->c ? eval(r, sc, n->c) : UNDEF;
    case JN_LIST:
    case JN_TUPLE:
    case JN_DICT: return eval_literal(r, sc, n);
    default: fail(r, n, "not an expression");
    }
}

/* ---------------------------------------------------------------------------------- statements */

static NOINLINE void assign(rstate *r, scope *sc, const jnode *at, const char *name, const char *name2, jv v) {
    if (!name2) {
        dict_set_s(r, sc->vars, name, v);
        return;
    }
    if (v.kind != JV_LIST || v.u.l->n != 2) fail(r, at, "cannot unpack a %s into %s, %s", kind_name(v), name, name2);
    dict_set_s(r, sc->vars, name, v.u.l->v[0]);
    dict_set_s(r, sc->vars, name2, v.u.l->v[1]);
}

static NOINLINE void exec_for(rstate *r, scope *sc, const jnode *n) {
    jv it = eval(r, sc, n->a);
    if (it.kind == JV_NONE) fail(r, n, "cannot loop over none");
    jlist *all = iter_items(r, n, it);
    scope *ls = push_scope(r, sc);
    jlist *items = all;
    if (n->c) { /* `for x in xs if cond`: the loop (and loop.length) sees only the items that pass */
        items = mk_list(r).u.l;
        for (size_t i = 0; i < all->n; i++) {
            assign(r, ls, n, n->name, n->name2, all->v[i]);
            if (truthy(eval(r, ls, n->c))) list_push(r, items, all->v[i]);
        }
    }
    size_t len = items->n;
    jv loop = mk_dict(r, JV_DICT); /* one per loop, as Jinja's LoopContext: iterations update it in place */
    for (size_t i = 0; i < len; i++) {
        dict_set_s(r, loop.u.d, "index", mk_int((int64_t)i + 1));
        dict_set_s(r, loop.u.d, "index0", mk_int((int64_t)i));
        dict_set_s(r, loop.u.d, "revindex", mk_int((int64_t)(len - i)));
        dict_set_s(r, loop.u.d, "revindex0", mk_int((int64_t)(len - i - 1)));
        dict_set_s(r, loop.u.d, "first", mk_bool(i == 0));
        dict_set_s(r, loop.u.d, "last", mk_bool(i + 1 == len));
        dict_set_s(r, loop.u.d, "length", mk_int((int64_t)len));
        dict_set_s(r, loop.u.d, "depth", mk_int(1));
        dict_set_s(r, loop.u.d, "depth0", mk_int(0));
        dict_set_s(r, loop.u.d, "previtem", i ? items->v[i - 1] : UNDEF);
        dict_set_s(r, loop.u.d, "nextitem", i + 1 < len ? items->v[i + 1] : UNDEF);
        dict_set_s(r, ls->vars, "loop", loop);
        assign(r, ls, n, n->name, n->name2, items->v[i]);
        exec_body(r, ls, n->body, n->n_body);
        if (r->ctl == 1) {
            r->ctl = 0;
            break;
        }
        r->ctl = 0;
    }
    if (!len && n->n_orelse) exec_body(r, sc, n->orelse, n->n_orelse);
}

static void exec_body(rstate *r, scope *sc, jnode *const *body, int nb) {
    enter(r, nb ? body[0] : NULL);
    for (int i = 0; i < nb && !r->ctl; i++) {
        const jnode *n = body[i];
        charge(r, n, 1);
        switch (n->kind) {
        case JN_TEXT: bput(r, r->out, n->name, n->name_len); break;
        case JN_OUTPUT: to_str(r, r->out, eval(r, sc, n->a)); break;
        case JN_IF: {
            const jnode *c = n;
            if (truthy(eval(r, sc, c->a))) exec_body(r, sc, c->body, c->n_body);
            else exec_body(r, sc, c->orelse, c->n_orelse);
            break;
        }
        case JN_FOR: exec_for(r, sc, n); break;
        case JN_SET:
            if (n->op == OP_GT) { /* ns.attr = value */
                jv *ns = lookup(r, sc, n->name);
                if (!ns || ns->kind != JV_NS) fail(r, n, "cannot set an attribute of '%s': not a namespace", n->name);
                dict_set_s(r, ns->u.d, n->name2, eval(r, sc, n->a));
            } else assign(r, sc, n, n->name, n->name2, eval(r, sc, n->a));
            break;
        case JN_SET_BLOCK: {
            sbuf b = {0}, *saved = r->out;
            r->out = &b;
            exec_body(r, sc, n->body, n->n_body);
            r->out = saved;
            dict_set_s(r, sc->vars, n->name, mk_buf_str(r, &b));
            break;
        }
        case JN_MACRO: dict_set_s(r, sc->vars, n->name, (jv){.kind = JV_MACRO, .u.macro = n}); break;
        case JN_BREAK: r->ctl = 1; break;
        case JN_CONTINUE: r->ctl = 2; break;
        case JN_BLOCK: exec_body(r, sc, n->body, n->n_body); break;
        default: fail(r, n, "not a statement");
        }
    }
    r->depth--;
}

kvb_status kvb_jinja_render(const kvb_jinja *j, const json_t *vars, const kvb_text_limits *lim, char **out,
                            size_t *len, char *err, size_t err_len) {
    rstate r = {.err = err, .err_len = err_len, .st = KVB_OK};
    sbuf b = {0};
    jmp_buf oomjb;
    *out = NULL;
    *len = 0;
    if (err_len) err[0] = 0;
    if (lim) r.lim = *lim;
    else kvb_text_limits_default(&r.lim);
    r.a.oom = &oomjb;
    r.a.budget = r.lim.render_memory;
    r.out = &b;
    if (setjmp(oomjb)) {
        if (r.a.over) {
            snprintf(err, err_len, "chat template: the render ran over its memory budget of %zu bytes", r.lim.render_memory);
            r.st = KVB_ERR_EXHAUSTED;
        } else {
            snprintf(err, err_len, "out of memory rendering the chat template");
            r.st = KVB_ERR_NOMEM;
        }
        goto done;
    }
    if (setjmp(r.jb)) goto done;
    r.globals = push_scope(&r, NULL);
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)vars, k, v) dict_set_s(&r, r.globals->vars, k, from_json(&r, v));
    exec_body(&r, r.globals, j->body, j->n_body);
    if (kvb_malloc(b.len + 1, (void **)out) != KVB_OK) oom(&r);
    if (b.len) memcpy(*out, b.p, b.len);
    (*out)[b.len] = 0;
    *len = b.len;
done:
    kvb__ja_free(&r.a);
    return r.st;
}
