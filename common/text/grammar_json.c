/* kvbank — JSON as grammar expressions: any value, any object, and a JSON Schema compiled to the values
 * it admits. Whitespace between tokens is bounded (kvb_grammar_opts.ws_indent). Subschemas are inlined
 * into their parent's automaton (masks of inlined states are decided without the stack); only a $ref
 * that recurses, any-JSON containers and large repeated items become rules of their own.
 *
 * The schema subset: type (one or a list), properties, required, additionalProperties (false, true or a
 * schema; absent = false in strict mode), items, prefixItems, minItems, maxItems, enum, const, anyOf,
 * oneOf (as anyOf: exclusivity is not enforced), allOf of one schema, $ref into the document ("#",
 * #/$defs/x, #/definitions/x, any JSON pointer), string minLength / maxLength / pattern / format (date,
 * time, date-time, uuid, email, ipv4, hostname, uri), integer minimum / maximum (exclusive too),
 * number minimum 0, nullable. Keywords that would restrict values and are not implemented are refused
 * by name; annotations (title, description, default, examples, ...) and unknown keywords are ignored. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/text/grammar_impl.h"
#include "common/text/unicode.h"
#include "common/util/util.h"

#define ITEM_INLINE_LIMIT 20000 /* automaton nodes an array may spend on copies of its item before the
                                 * item becomes a rule */

/* ------------------------------------------------------------------------------------- lexemes */

static int32_t ws(kvb__gb *b) {
    if (b->opts.ws_indent < 0) return kvb__gx_empty(b);
    int32_t nl = kvb__gx_seq2(b, kvb__gx_lit(b, "\n", 1), kvb__gx_repeat(b, kvb__gx_lit(b, " ", 1), 0, b->opts.ws_indent));
    return kvb__gx_opt(b, kvb__gx_alt2(b, kvb__gx_lit(b, " ", 1), nl));
}

static int32_t hex(kvb__gb *b) {
    return kvb__gx_alt(b, (int32_t[]){kvb__gx_range(b, '0', '9'), kvb__gx_range(b, 'a', 'f'), kvb__gx_range(b, 'A', 'F')}, 3);
}

/* \uXXXX that decodes to a scalar value other than U+0000 (jansson refuses \u0000 and lone surrogates);
 * a surrogate pair as two escapes. */
static int32_t u_escape(kvb__gb *b) {
    int32_t u = kvb__gx_lit(b, "\\u", 2);
    int32_t nz0 = kvb__gx_alt(b, (int32_t[]){kvb__gx_range(b, '1', '9'), kvb__gx_range(b, 'a', 'f'), kvb__gx_range(b, 'A', 'F')}, 3);
    int32_t zero = kvb__gx_lit(b, "0", 1);
    /* 0XXX but not 0000 */
    int32_t lead0 = kvb__gx_seq2(b, zero, kvb__gx_alt(b, (int32_t[]){
        kvb__gx_seq(b, (int32_t[]){nz0, hex(b), hex(b)}, 3),
        kvb__gx_seq(b, (int32_t[]){kvb__gx_lit(b, "0", 1), kvb__gx_alt(b, (int32_t[]){kvb__gx_range(b, '1', '9'), kvb__gx_range(b, 'a', 'f'), kvb__gx_range(b, 'A', 'F')}, 3), hex(b)}, 3),
        kvb__gx_seq(b, (int32_t[]){kvb__gx_lit(b, "00", 2), kvb__gx_alt(b, (int32_t[]){kvb__gx_range(b, '1', '9'), kvb__gx_range(b, 'a', 'f'), kvb__gx_range(b, 'A', 'F')}, 3)}, 2)}, 3));
    int32_t mid = kvb__gx_seq(b, (int32_t[]){kvb__gx_alt(b, (int32_t[]){kvb__gx_range(b, '1', '9'), kvb__gx_range(b, 'a', 'c'), kvb__gx_range(b, 'A', 'C')}, 3), hex(b), hex(b), hex(b)}, 4);
    int32_t d = kvb__gx_alt2(b, kvb__gx_lit(b, "d", 1), kvb__gx_lit(b, "D", 1));
    int32_t dlow = kvb__gx_seq(b, (int32_t[]){d, kvb__gx_range(b, '0', '7'), hex(b), hex(b)}, 4);
    int32_t ef = kvb__gx_seq(b, (int32_t[]){kvb__gx_alt(b, (int32_t[]){kvb__gx_range(b, 'e', 'f'), kvb__gx_range(b, 'E', 'F')}, 2), hex(b), hex(b), hex(b)}, 4);
    int32_t hi_s = kvb__gx_seq(b, (int32_t[]){kvb__gx_alt2(b, kvb__gx_lit(b, "d", 1), kvb__gx_lit(b, "D", 1)),
        kvb__gx_alt(b, (int32_t[]){kvb__gx_range(b, '8', '9'), kvb__gx_range(b, 'a', 'b'), kvb__gx_range(b, 'A', 'B')}, 3), hex(b), hex(b)}, 4);
    int32_t lo_s = kvb__gx_seq(b, (int32_t[]){kvb__gx_alt2(b, kvb__gx_lit(b, "d", 1), kvb__gx_lit(b, "D", 1)),
        kvb__gx_alt(b, (int32_t[]){kvb__gx_range(b, 'c', 'f'), kvb__gx_range(b, 'C', 'F')}, 2), hex(b), hex(b)}, 4);
    int32_t pair = kvb__gx_seq(b, (int32_t[]){hi_s, kvb__gx_lit(b, "\\u", 2), lo_s}, 3);
    return kvb__gx_seq2(b, u, kvb__gx_alt(b, (int32_t[]){lead0, mid, dlow, ef, pair}, 5));
}

int32_t kvb__gx_json_char(kvb__gb *b) {
    static const uint32_t raw[][2] = {{0x20, 0x21}, {0x23, 0x5B}, {0x5D, 0x10FFFF}};
    int32_t plain = kvb__gx_codepoints(b, raw, 3);
    int32_t esc = kvb__gx_seq2(b, kvb__gx_lit(b, "\\", 1), kvb__gx_alt(b, (int32_t[]){
        kvb__gx_lit(b, "\"", 1), kvb__gx_lit(b, "\\", 1), kvb__gx_lit(b, "/", 1), kvb__gx_lit(b, "b", 1),
        kvb__gx_lit(b, "f", 1), kvb__gx_lit(b, "n", 1), kvb__gx_lit(b, "r", 1), kvb__gx_lit(b, "t", 1)}, 8));
    return kvb__gx_alt(b, (int32_t[]){plain, esc, u_escape(b)}, 3);
}

static int32_t quoted(kvb__gb *b, int32_t inner) {
    return kvb__gx_seq(b, (int32_t[]){kvb__gx_lit(b, "\"", 1), inner, kvb__gx_lit(b, "\"", 1)}, 3);
}

static int32_t jstring(kvb__gb *b) { return quoted(b, kvb__gx_repeat(b, kvb__gx_json_char(b), 0, -1)); }

/* Digit runs are bounded as whitespace is: a model cannot spin on digits, and what it writes fits the
 * parsers at the other end (int64 integers, double exponents). */
#define MAX_INT_DIGITS 18 /* below 2^63 */
#define MAX_FRAC_DIGITS 16
#define MAX_EXP_DIGITS 2

static int32_t digits(kvb__gb *b, int min, int max) { return kvb__gx_repeat(b, kvb__gx_range(b, '0', '9'), min, max); }

/* 0 | [1-9][0-9]{0,17} */
static int32_t natural(kvb__gb *b) {
    return kvb__gx_alt2(b, kvb__gx_lit(b, "0", 1), kvb__gx_seq2(b, kvb__gx_range(b, '1', '9'), digits(b, 0, MAX_INT_DIGITS - 1)));
}

static int32_t jnumber(kvb__gb *b, int allow_minus) {
    int32_t frac = kvb__gx_opt(b, kvb__gx_seq2(b, kvb__gx_lit(b, ".", 1), digits(b, 1, MAX_FRAC_DIGITS)));
    int32_t exp = kvb__gx_opt(b, kvb__gx_seq(b, (int32_t[]){kvb__gx_alt2(b, kvb__gx_lit(b, "e", 1), kvb__gx_lit(b, "E", 1)),
        kvb__gx_opt(b, kvb__gx_alt2(b, kvb__gx_lit(b, "+", 1), kvb__gx_lit(b, "-", 1))), digits(b, 1, MAX_EXP_DIGITS)}, 3));
    int32_t sign = allow_minus ? kvb__gx_opt(b, kvb__gx_lit(b, "-", 1)) : kvb__gx_empty(b);
    return kvb__gx_seq(b, (int32_t[]){sign, natural(b), frac, exp}, 4);
}

static int32_t jinteger(kvb__gb *b) { return kvb__gx_seq2(b, kvb__gx_opt(b, kvb__gx_lit(b, "-", 1)), natural(b)); }

/* ------------------------------------------------------------------------------------- any JSON */

/* Scalars inline (a token that closes a string and goes on stays inside one automaton); the containers
 * are two rules, made once per grammar, that call back here (they nest). */
static int32_t any_value(kvb__gb *b) {
    if (!b->json_rules[0]) {
        int32_t obj = kvb__gb_rule_new(b), arr = kvb__gb_rule_new(b);
        if (obj < 0 || arr < 0) return -1;
        b->json_rules[0] = obj + 1, b->json_rules[1] = arr + 1; /* before the bodies, which come back here */
        int32_t member = kvb__gx_seq(b, (int32_t[]){jstring(b), ws(b), kvb__gx_lit(b, ":", 1), ws(b), any_value(b), ws(b)}, 6);
        int32_t more = kvb__gx_repeat(b, kvb__gx_seq(b, (int32_t[]){kvb__gx_lit(b, ",", 1), ws(b), member}, 3), 0, -1);
        kvb__gb_rule_set(b, obj, kvb__gx_seq(b, (int32_t[]){kvb__gx_lit(b, "{", 1), ws(b), kvb__gx_opt(b, kvb__gx_seq2(b, member, more)),
                                                            kvb__gx_lit(b, "}", 1)}, 4));
        int32_t elem = kvb__gx_seq2(b, any_value(b), ws(b));
        int32_t more2 = kvb__gx_repeat(b, kvb__gx_seq(b, (int32_t[]){kvb__gx_lit(b, ",", 1), ws(b), elem}, 3), 0, -1);
        kvb__gb_rule_set(b, arr, kvb__gx_seq(b, (int32_t[]){kvb__gx_lit(b, "[", 1), ws(b), kvb__gx_opt(b, kvb__gx_seq2(b, elem, more2)),
                                                            kvb__gx_lit(b, "]", 1)}, 4));
    }
    return kvb__gx_alt(b, (int32_t[]){jstring(b), jnumber(b, 1), kvb__gx_lit(b, "true", 4), kvb__gx_lit(b, "false", 5),
                                      kvb__gx_lit(b, "null", 4), kvb__gx_call(b, b->json_rules[0] - 1),
                                      kvb__gx_call(b, b->json_rules[1] - 1)}, 7);
}

int32_t kvb__gx_json_value(kvb__gb *b) { return any_value(b); }

int32_t kvb__gx_json_object(kvb__gb *b) {
    if (any_value(b) < 0) return -1; /* makes the rules */
    return kvb__gx_call(b, b->json_rules[0] - 1);
}

/* ------------------------------------------------------------------------------------- JSON Schema */

typedef struct ref_slot {
    const json_t *target;
    int32_t rule;  /* -1: none yet */
    int on_stack;  /* being compiled (a $ref to it now is recursion) */
} ref_slot;

typedef struct sctx {
    kvb__gb *b;
    json_t *root;
    int depth;
    ref_slot *refs;
    int n_refs, cap_refs;
    char path[256]; /* where in the schema, for messages */
} sctx;

static int32_t schema(sctx *c, const json_t *s);

static int32_t fail(sctx *c, kvb_status st, const char *fmt, const char *what) {
    char msg[200];
    snprintf(msg, sizeof msg, fmt, what);
    return kvb__gb_fail(c->b, st, "json_schema: %s (at #%s)", msg, c->path);
}

static size_t path_push(sctx *c, const char *seg) {
    size_t n = strlen(c->path);
    snprintf(c->path + n, sizeof c->path - n, "/%s", seg);
    return n;
}

/* The compact JSON text of a value, as a literal (const, enum). */
static int32_t literal_json(sctx *c, const json_t *v) {
    char *txt = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY | JSON_PRESERVE_ORDER);
    if (!txt) return kvb__gb_fail(c->b, KVB_ERR_NOMEM, "out of memory compiling the grammar");
    int32_t x = kvb__gx_lit(c->b, txt, strlen(txt));
    free(txt);
    return x;
}

static const json_t *resolve_ref(sctx *c, const char *ref) {
    if (ref[0] != '#') return NULL;
    const json_t *cur = c->root;
    const char *p = ref + 1;
    while (*p == '/') {
        p++;
        char seg[256];
        size_t n = 0;
        while (*p && *p != '/' && n + 1 < sizeof seg) {
            if (p[0] == '~' && p[1] == '0') seg[n++] = '~', p += 2;
            else if (p[0] == '~' && p[1] == '1') seg[n++] = '/', p += 2;
            else seg[n++] = *p++;
        }
        seg[n] = 0;
        if (json_is_object(cur)) cur = json_object_get(cur, seg);
        else if (json_is_array(cur)) {
            char *end;
            long i = strtol(seg, &end, 10);
            cur = *end || !n ? NULL : json_array_get(cur, (size_t)i);
        } else cur = NULL;
        if (!cur) return NULL;
    }
    return *p ? NULL : cur;
}

static int32_t ref_schema(sctx *c, const char *ref) {
    const json_t *t = resolve_ref(c, ref);
    if (!t) return fail(c, KVB_ERR_INVALID, "$ref '%s' does not resolve in this document", ref);
    ref_slot *slot = NULL;
    for (int i = 0; i < c->n_refs; i++)
        if (c->refs[i].target == t) slot = &c->refs[i];
    if (!slot) {
        if (c->n_refs == c->cap_refs) {
            int cap = c->cap_refs ? c->cap_refs * 2 : 8;
            if (kvb_realloc_array((void **)&c->refs, (size_t)cap, sizeof *c->refs) != KVB_OK)
                return kvb__gb_fail(c->b, KVB_ERR_NOMEM, "out of memory compiling the grammar");
            c->cap_refs = cap;
        }
        slot = &c->refs[c->n_refs++];
        *slot = (ref_slot){t, -1, 0};
    }
    int idx = (int)(slot - c->refs);
    if (c->refs[idx].rule >= 0 && !c->refs[idx].on_stack) return kvb__gx_call(c->b, c->refs[idx].rule);
    if (c->refs[idx].on_stack) { /* recursion: the target becomes a rule */
        if (c->refs[idx].rule < 0) c->refs[idx].rule = kvb__gb_rule_new(c->b);
        return kvb__gx_call(c->b, c->refs[idx].rule);
    }
    c->refs[idx].on_stack = 1;
    int32_t x = schema(c, t);
    c->refs[idx].on_stack = 0;
    if (c->refs[idx].rule >= 0) { /* it recursed: the body is the rule's, this use is a call too */
        kvb__gb_rule_set(c->b, c->refs[idx].rule, x);
        return x < 0 ? -1 : kvb__gx_call(c->b, c->refs[idx].rule);
    }
    return x;
}

static const char *const annotations[] = {
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
    "writeOnly", "$defs", "definitions", "discriminator", "example", "contentMediaType", "contentEncoding", "$anchor",
    "strict", "name", "markdownDescription", "unevaluatedProperties",
};

/* Keywords that restrict values and are not implemented: refused by name rather than ignored. */
static const char *const unsupported[] = {
    "patternProperties", "propertyNames", "minProperties", "maxProperties", "dependentRequired", "dependentSchemas",
    "dependencies", "if", "then", "else", "not", "contains", "minContains", "maxContains", "unevaluatedItems",
    "multipleOf", "additionalItems", "$dynamicRef", "$recursiveRef",
};

static int is_in(const char *k, const char *const *list, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!strcmp(k, list[i])) return 1;
    return 0;
}

/* ---- integers in a range: digit strings by the usual split into same-length ranges */

static int32_t digit_range(kvb__gb *b, int lo, int hi) { return kvb__gx_range(b, '0' + lo, '0' + hi); }

/* Numbers written with exactly n digits between a[0..n) and z[0..n) (equal lengths, a <= z). */
static int32_t same_len(kvb__gb *b, const char *a, const char *z, int n) {
    if (n == 1) return digit_range(b, a[0] - '0', z[0] - '0');
    if (a[0] == z[0]) return kvb__gx_seq2(b, kvb__gx_lit(b, a, 1), same_len(b, a + 1, z + 1, n - 1));
    char nines[24], zeros[24];
    memset(nines, '9', (size_t)n), memset(zeros, '0', (size_t)n);
    int32_t alts[3];
    int na = 0;
    alts[na++] = kvb__gx_seq2(b, kvb__gx_lit(b, a, 1), same_len(b, a + 1, nines, n - 1));
    if (a[0] + 1 <= z[0] - 1)
        alts[na++] = kvb__gx_seq2(b, digit_range(b, a[0] - '0' + 1, z[0] - '0' - 1), kvb__gx_repeat(b, kvb__gx_range(b, '0', '9'), n - 1, n - 1));
    alts[na++] = kvb__gx_seq2(b, kvb__gx_lit(b, z, 1), same_len(b, zeros, z + 1, n - 1));
    return kvb__gx_alt(b, alts, na);
}

/* Non-negative integers lo..hi (hi < 0: unbounded), canonical (no leading zeros). */
static int32_t nat_range(kvb__gb *b, long long lo, long long hi) {
    char a[24], z[24];
    int la = snprintf(a, sizeof a, "%lld", lo);
    if (hi < 0) {
        char nines[24];
        memset(nines, '9', (size_t)la);
        nines[la] = 0;
        /* lo .. 99..9 (la digits), then anything longer (up to MAX_INT_DIGITS) */
        if (la >= MAX_INT_DIGITS) return same_len(b, a, nines, la);
        return kvb__gx_alt2(b, same_len(b, a, nines, la), kvb__gx_seq2(b, kvb__gx_range(b, '1', '9'), digits(b, la, MAX_INT_DIGITS - 1)));
    }
    int lz = snprintf(z, sizeof z, "%lld", hi);
    if (la == lz) return same_len(b, a, z, la);
    int32_t alts[24];
    int na = 0;
    char nines[24], low[24];
    memset(nines, '9', (size_t)la);
    alts[na++] = same_len(b, a, nines, la);
    for (int len = la + 1; len < lz; len++)
        alts[na++] = kvb__gx_seq2(b, kvb__gx_range(b, '1', '9'), kvb__gx_repeat(b, kvb__gx_range(b, '0', '9'), len - 1, len - 1));
    memset(low, '0', (size_t)lz);
    low[0] = '1';
    alts[na++] = same_len(b, low, z, lz);
    return kvb__gx_alt(b, alts, na);
}

static int num_field(sctx *c, const json_t *s, const char *key, double *out) {
    const json_t *v = json_object_get(s, key);
    if (!v) return 0;
    if (!json_is_number(v)) return fail(c, KVB_ERR_INVALID, "'%s' must be a number", key), -1;
    *out = json_number_value(v);
    return 1;
}

#define INT_LIMIT 1e15 /* bounds beyond this are treated as absent (int64 digit strings stay exact) */

static int32_t integer_schema(sctx *c, const json_t *s) {
    kvb__gb *b = c->b;
    double v;
    int have_lo = 0, have_hi = 0, k;
    long long lo = 0, hi = 0;
    if ((k = num_field(c, s, "minimum", &v)) < 0) return -1;
    if (k && fabs(v) < INT_LIMIT) have_lo = 1, lo = (long long)ceil(v);
    if ((k = num_field(c, s, "exclusiveMinimum", &v)) < 0) return -1;
    if (k && fabs(v) < INT_LIMIT) {
        long long x = (long long)floor(v) + 1;
        if (!have_lo || x > lo) lo = x;
        have_lo = 1;
    }
    if ((k = num_field(c, s, "maximum", &v)) < 0) return -1;
    if (k && fabs(v) < INT_LIMIT) have_hi = 1, hi = (long long)floor(v);
    if ((k = num_field(c, s, "exclusiveMaximum", &v)) < 0) return -1;
    if (k && fabs(v) < INT_LIMIT) {
        long long x = (long long)ceil(v) - 1;
        if (!have_hi || x < hi) hi = x;
        have_hi = 1;
    }
    if (!have_lo && !have_hi) return jinteger(b);
    if (have_lo && have_hi && lo > hi) return fail(c, KVB_ERR_INVALID, "%s", "an integer range with minimum above maximum");
    int32_t alts[2];
    int na = 0;
    /* negatives: -x for x in [max(1, -hi), -lo] */
    if (!have_lo || lo < 0) {
        long long xlo = have_hi ? (hi < 0 ? -hi : 1) : 1;
        long long xhi = have_lo ? -lo : -1;
        if (xhi < 0 || xlo <= xhi) alts[na++] = kvb__gx_seq2(b, kvb__gx_lit(b, "-", 1), nat_range(b, xlo, xhi));
    }
    if (!have_hi || hi >= 0) alts[na++] = nat_range(b, have_lo && lo > 0 ? lo : 0, have_hi ? hi : -1);
    return kvb__gx_alt(b, alts, na);
}

static int32_t number_schema(sctx *c, const json_t *s) {
    static const char *const bounds[] = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"};
    int allow_minus = 1;
    for (size_t i = 0; i < KVB_ARRAY_LEN(bounds); i++) {
        const json_t *v = json_object_get(s, bounds[i]);
        if (!v) continue;
        if (i == 0 && json_is_number(v) && json_number_value(v) == 0) { /* non-negative: no sign */
            allow_minus = 0;
            continue;
        }
        return fail(c, KVB_ERR_UNSUPPORTED, "'%s' on a number is not supported (only minimum 0; integers take any bounds)",
                    bounds[i]);
    }
    return jnumber(c->b, allow_minus);
}

/* Formats as regexes over the string's characters (ASCII: no escaping needed). */
static const struct { const char *name, *re; } formats[] = {
    {"date", "[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"},
    {"time", "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,9})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"},
    {"date-time", "[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,9})?"
                  "(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"},
    {"uuid", "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"},
    {"email", "[a-zA-Z0-9_+-]+(\\.[a-zA-Z0-9_+-]+)*@[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?(\\.[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?)+"},
    {"ipv4", "((25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\\.){3}(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"},
    {"hostname", "[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?(\\.[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?)*"},
    {"uri", "[a-zA-Z][a-zA-Z0-9+.-]*:[!#$&-;=?-\\[\\]_a-z~]+"},
};

static int int_field(sctx *c, const json_t *s, const char *key, int max, int *out) {
    const json_t *v = json_object_get(s, key);
    if (!v) return 0;
    if (!json_is_integer(v) || json_integer_value(v) < 0) return fail(c, KVB_ERR_INVALID, "'%s' must be a non-negative integer", key), -1;
    if (json_integer_value(v) > max) return fail(c, KVB_ERR_EXHAUSTED, "'%s' is above what kvbank compiles (see docs/grammar.md)", key), -1;
    *out = (int)json_integer_value(v);
    return 1;
}

static int32_t string_schema(sctx *c, const json_t *s) {
    kvb__gb *b = c->b;
    int min = 0, max = -1, k1, k2;
    if ((k1 = int_field(c, s, "minLength", 10000, &min)) < 0 || (k2 = int_field(c, s, "maxLength", 10000, &max)) < 0) return -1;
    if (!k2) max = -1;
    const json_t *pat = json_object_get(s, "pattern"), *fmt = json_object_get(s, "format");
    if ((pat || fmt) && (k1 || k2))
        return fail(c, KVB_ERR_UNSUPPORTED, "%s", "minLength / maxLength together with pattern or format are not supported");
    if (pat && fmt) return fail(c, KVB_ERR_UNSUPPORTED, "%s", "pattern together with format is not supported");
    if (pat) {
        if (!json_is_string(pat)) return fail(c, KVB_ERR_INVALID, "%s", "'pattern' must be a string");
        return quoted(b, kvb__gx_regex(b, json_string_value(pat), json_string_length(pat), KVB__RX_JSON, 1));
    }
    if (fmt) {
        if (!json_is_string(fmt)) return fail(c, KVB_ERR_INVALID, "%s", "'format' must be a string");
        for (size_t i = 0; i < KVB_ARRAY_LEN(formats); i++)
            if (!strcmp(formats[i].name, json_string_value(fmt)))
                return quoted(b, kvb__gx_regex(b, formats[i].re, strlen(formats[i].re), KVB__RX_JSON, 0));
        return fail(c, KVB_ERR_UNSUPPORTED, "format '%s' is not supported", json_string_value(fmt));
    }
    if (max >= 0 && max < min) return fail(c, KVB_ERR_INVALID, "%s", "maxLength below minLength");
    return quoted(b, kvb__gx_repeat(b, kvb__gx_json_char(b), min, max));
}

/* A key of an additional property: a plain string (no escapes) that is none of the declared names, as
 * code points over the trie of the names. names[n] are sorted; depth: the code points matched so far. */
static int32_t key_not_in(sctx *c, const char **names, int n, size_t off) {
    kvb__gb *b = c->b;
    int32_t alts[3];
    int na = 0, is_name = 0;
    /* raw JSON characters, minus the ones that continue some name here */
    uint32_t (*other)[2] = NULL;
    int no = 0;
    static const uint32_t raw[][2] = {{0x20, 0x21}, {0x23, 0x5B}, {0x5D, 0x10FFFF}};
    uint32_t *next = NULL;
    int nn = 0;
    if (kvb_malloc(((size_t)n + 1) * sizeof *next, (void **)&next) != KVB_OK ||
        kvb_malloc(((size_t)n + 4) * sizeof *other, (void **)&other) != KVB_OK) {
        free(next);
        return kvb__gb_fail(b, KVB_ERR_NOMEM, "out of memory compiling the grammar");
    }
    for (int i = 0; i < n; i++) {
        size_t len = strlen(names[i]);
        if (len == off) {
            is_name = 1;
            continue;
        }
        uint32_t cp;
        kvb__utf8_decode((const uint8_t *)names[i] + off, len - off, &cp);
        if (!nn || next[nn - 1] != cp) next[nn++] = cp;
    }
    for (size_t k = 0; k < 3; k++) { /* raw minus next[] (sorted: names are sorted by bytes = by code point) */
        uint32_t lo = raw[k][0];
        for (int i = 0; i < nn; i++) {
            if (next[i] < lo || next[i] > raw[k][1]) continue;
            if (next[i] > lo) other[no][0] = lo, other[no][1] = next[i] - 1, no++;
            lo = next[i] + 1;
        }
        if (lo <= raw[k][1]) other[no][0] = lo, other[no][1] = raw[k][1], no++;
    }
    int32_t anyc = kvb__gx_codepoints(b, raw, 3);
    if (no) alts[na++] = kvb__gx_seq2(b, kvb__gx_codepoints(b, (const uint32_t(*)[2])other, no), kvb__gx_repeat(b, anyc, 0, -1));
    if (!is_name) alts[na++] = kvb__gx_empty(b);
    /* each continuing code point: its names recursively */
    int32_t *conts = NULL;
    int ncont = 0;
    if (nn && kvb_malloc((size_t)nn * sizeof *conts, (void **)&conts) != KVB_OK) {
        free(next), free(other);
        return kvb__gb_fail(b, KVB_ERR_NOMEM, "out of memory compiling the grammar");
    }
    for (int i = 0; i < n;) {
        size_t len = strlen(names[i]);
        if (len == off) {
            i++;
            continue;
        }
        uint32_t cp;
        int cl = kvb__utf8_decode((const uint8_t *)names[i] + off, len - off, &cp);
        int j = i;
        while (j < n && strlen(names[j]) > off && !memcmp(names[j] + off, names[i] + off, (size_t)cl)) j++;
        conts[ncont++] = kvb__gx_seq2(b, kvb__gx_lit(b, names[i] + off, (size_t)cl), key_not_in(c, names + i, j - i, off + (size_t)cl));
        i = j;
    }
    if (ncont) alts[na++] = kvb__gx_alt(b, conts, ncont);
    free(conts);
    free(next);
    free(other);
    return na ? kvb__gx_alt(b, alts, na) : kvb__gb_fail(b, KVB_ERR_INVALID, "json_schema: no key is possible");
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(const char *const *)a, *(const char *const *)b); }

static int32_t object_schema(sctx *c, const json_t *s) {
    kvb__gb *b = c->b;
    const json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required");
    const json_t *addl = json_object_get(s, "additionalProperties");
    if (props && !json_is_object(props)) return fail(c, KVB_ERR_INVALID, "%s", "'properties' must be an object");
    if (req && !json_is_array(req)) return fail(c, KVB_ERR_INVALID, "%s", "'required' must be an array");
    size_t i;
    const json_t *r;
    json_array_foreach(req, i, r) {
        if (!json_is_string(r)) return fail(c, KVB_ERR_INVALID, "%s", "'required' must hold strings");
        if (!json_object_get(props, json_string_value(r)))
            return fail(c, KVB_ERR_UNSUPPORTED, "required property '%s' has no schema in 'properties'", json_string_value(r));
    }
    size_t np = props ? json_object_size(props) : 0;
    int32_t *elems;
    const char **names;
    if (kvb_malloc((np + 2) * sizeof *elems, (void **)&elems) != KVB_OK) return kvb__gb_fail(b, KVB_ERR_NOMEM, "out of memory");
    if (kvb_malloc((np + 1) * sizeof *names, (void **)&names) != KVB_OK) {
        free(elems);
        return kvb__gb_fail(b, KVB_ERR_NOMEM, "out of memory");
    }
    int n = 0;
    const char *key;
    const json_t *sub;
    json_object_foreach((json_t *)props, key, sub) {
        int required = 0;
        json_array_foreach(req, i, r) required |= !strcmp(json_string_value(r), key);
        json_t *kj = json_string(key);
        int32_t klit = kj ? literal_json(c, kj) : kvb__gb_fail(b, KVB_ERR_NOMEM, "out of memory");
        json_decref(kj);
        size_t save = path_push(c, "properties");
        path_push(c, key);
        int32_t value = schema(c, sub);
        c->path[save] = 0;
        int32_t member = kvb__gx_seq(b, (int32_t[]){klit, ws(b), kvb__gx_lit(b, ":", 1), ws(b), value, ws(b)}, 6);
        names[n] = key;
        elems[n++] = required ? member : kvb__gx_opt(b, member);
    }
    int allow_extra = addl ? !json_is_false(addl) : !b->opts.strict;
    if (allow_extra) {
        int32_t value;
        if (!addl || json_is_true(addl)) value = any_value(b);
        else {
            size_t save = path_push(c, "additionalProperties");
            value = schema(c, addl);
            c->path[save] = 0;
        }
        qsort(names, (size_t)n, sizeof *names, cmp_str);
        int32_t k = quoted(b, key_not_in(c, names, n, 0));
        elems[n++] = kvb__gx_repeat(b, kvb__gx_seq(b, (int32_t[]){k, ws(b), kvb__gx_lit(b, ":", 1), ws(b), value, ws(b)}, 6), 0, -1);
    }
    int32_t sep = kvb__gx_seq2(b, kvb__gx_lit(b, ",", 1), ws(b));
    int32_t body = kvb__gx_list(b, sep, elems, n);
    free(elems);
    free(names);
    return kvb__gx_seq(b, (int32_t[]){kvb__gx_lit(b, "{", 1), ws(b), body, kvb__gx_lit(b, "}", 1)}, 4);
}

static int32_t array_schema(sctx *c, const json_t *s) {
    kvb__gb *b = c->b;
    const json_t *items = json_object_get(s, "items"), *prefix = json_object_get(s, "prefixItems");
    const json_t *uniq = json_object_get(s, "uniqueItems");
    if (json_is_true(uniq)) return fail(c, KVB_ERR_UNSUPPORTED, "%s", "'uniqueItems' true is not supported");
    if (prefix && !json_is_array(prefix)) return fail(c, KVB_ERR_INVALID, "%s", "'prefixItems' must be an array");
    if (json_is_array(items)) return fail(c, KVB_ERR_UNSUPPORTED, "%s", "'items' as an array (draft 4 tuples) is not supported: use prefixItems");
    int min = 0, max = -1, k;
    if ((k = int_field(c, s, "minItems", 10000, &min)) < 0) return -1;
    if ((k = int_field(c, s, "maxItems", 10000, &max)) < 0) return -1;
    if (!k) max = -1;
    int np = prefix ? (int)json_array_size(prefix) : 0;
    int items_ok = !json_is_false(items);
    if (!items_ok && (max < 0 || max > np)) max = np;
    if (max >= 0 && max < min) return fail(c, KVB_ERR_INVALID, "%s", "maxItems below minItems (or below the prefixItems)");
    int32_t sep = kvb__gx_seq(b, (int32_t[]){ws(b), kvb__gx_lit(b, ",", 1), ws(b)}, 3);
    int32_t item = -1;
    if (items_ok && (max < 0 || max > np)) {
        size_t save = path_push(c, "items");
        item = items ? schema(c, items) : any_value(b);
        c->path[save] = 0;
        int64_t copies = max < 0 ? KVB_MAX(min - np, 1) : max - np;
        if (item >= 0 && b->x[item].size * copies > ITEM_INLINE_LIMIT) { /* many copies of a big item: call it */
            int32_t rule = kvb__gb_rule_new(b);
            kvb__gb_rule_set(b, rule, item);
            item = kvb__gx_call(b, rule);
        }
    }
    /* tail(i): what follows after i elements (i >= 1) */
    int32_t tail;
    int rest_min = KVB_MAX(min - KVB_MAX(np, 1), 0);
    if (item >= 0) {
        if (np == 0) tail = kvb__gx_repeat(b, kvb__gx_seq2(b, sep, item), rest_min, max < 0 ? -1 : max - 1);
        else tail = kvb__gx_repeat(b, kvb__gx_seq2(b, sep, item), rest_min, max < 0 ? -1 : max - np);
    } else tail = kvb__gx_empty(b);
    /* prefix elements from the last to the first: each may end the array once min is reached */
    int32_t elems = -1;
    if (np == 0) {
        elems = item >= 0 ? kvb__gx_seq2(b, item, tail) : -2;
    } else {
        int32_t after = tail;
        for (int i = np - 1; i >= 0; i--) {
            char seg[32];
            snprintf(seg, sizeof seg, "prefixItems/%d", i);
            size_t save = path_push(c, seg);
            int32_t e = schema(c, json_array_get(prefix, (size_t)i));
            c->path[save] = 0;
            int32_t here = i == 0 ? kvb__gx_seq2(b, e, after) : kvb__gx_seq(b, (int32_t[]){sep, e, after}, 3);
            /* after i elements (i >= 1) the array may end when i >= min */
            after = (i >= 1 && i >= min) ? kvb__gx_opt(b, here) : here;
            if (i >= 1 && max >= 0 && i >= max) after = kvb__gx_empty(b);
        }
        elems = after;
    }
    /* one whitespace run between "[" and "]" when empty: (elements ws)? */
    int32_t body;
    if (elems == -2 || max == 0) body = kvb__gx_empty(b); /* no element is possible */
    else body = kvb__gx_seq2(b, elems, ws(b));
    if (min == 0) body = kvb__gx_opt(b, body);
    return kvb__gx_seq(b, (int32_t[]){kvb__gx_lit(b, "[", 1), ws(b), body, kvb__gx_lit(b, "]", 1)}, 4);
}

static int32_t typed(sctx *c, const json_t *s, const char *type) {
    if (!strcmp(type, "object")) return object_schema(c, s);
    if (!strcmp(type, "array")) return array_schema(c, s);
    if (!strcmp(type, "string")) return string_schema(c, s);
    if (!strcmp(type, "integer")) return integer_schema(c, s);
    if (!strcmp(type, "number")) return number_schema(c, s);
    if (!strcmp(type, "boolean")) return kvb__gx_alt2(c->b, kvb__gx_lit(c->b, "true", 4), kvb__gx_lit(c->b, "false", 5));
    if (!strcmp(type, "null")) return kvb__gx_lit(c->b, "null", 4);
    return fail(c, KVB_ERR_INVALID, "unknown type '%s'", type);
}

static int32_t alternatives(sctx *c, const json_t *list, const char *kw) {
    if (!json_is_array(list) || !json_array_size(list)) return fail(c, KVB_ERR_INVALID, "'%s' must be a non-empty array", kw);
    size_t n = json_array_size(list);
    int32_t *alts;
    if (kvb_malloc(n * sizeof *alts, (void **)&alts) != KVB_OK) return kvb__gb_fail(c->b, KVB_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        char seg[48];
        snprintf(seg, sizeof seg, "%s/%zu", kw, i);
        size_t save = path_push(c, seg);
        alts[i] = schema(c, json_array_get(list, i));
        c->path[save] = 0;
    }
    int32_t x = kvb__gx_alt(c->b, alts, (int)n);
    free(alts);
    return x;
}

static int32_t schema_body(sctx *c, const json_t *s) {
    kvb__gb *b = c->b;
    if (json_is_true(s)) return any_value(b);
    if (json_is_false(s)) return fail(c, KVB_ERR_INVALID, "%s", "the schema false admits no value");
    if (!json_is_object(s)) return fail(c, KVB_ERR_INVALID, "%s", "a schema must be an object or a boolean");
    const char *key;
    const json_t *v;
    json_object_foreach((json_t *)s, key, v) {
        if (is_in(key, unsupported, KVB_ARRAY_LEN(unsupported)))
            return fail(c, KVB_ERR_UNSUPPORTED, "'%s' is not supported", key);
    }
    const json_t *ref = json_object_get(s, "$ref");
    if (ref) {
        if (!json_is_string(ref)) return fail(c, KVB_ERR_INVALID, "%s", "'$ref' must be a string");
        json_object_foreach((json_t *)s, key, v)
            if (strcmp(key, "$ref") && !is_in(key, annotations, KVB_ARRAY_LEN(annotations)))
                return fail(c, KVB_ERR_UNSUPPORTED, "'%s' beside '$ref' is not supported", key);
        return ref_schema(c, json_string_value(ref));
    }
    const json_t *cst = json_object_get(s, "const"), *en = json_object_get(s, "enum");
    int32_t x;
    if (cst) x = literal_json(c, cst);
    else if (en) {
        if (!json_is_array(en) || !json_array_size(en)) return fail(c, KVB_ERR_INVALID, "%s", "'enum' must be a non-empty array");
        size_t n = json_array_size(en);
        int32_t *alts;
        if (kvb_malloc(n * sizeof *alts, (void **)&alts) != KVB_OK) return kvb__gb_fail(b, KVB_ERR_NOMEM, "out of memory");
        for (size_t i = 0; i < n; i++) alts[i] = literal_json(c, json_array_get(en, i));
        x = kvb__gx_alt(b, alts, (int)n);
        free(alts);
    } else if (json_object_get(s, "anyOf") || json_object_get(s, "oneOf") || json_object_get(s, "allOf")) {
        const char *kw = json_object_get(s, "anyOf") ? "anyOf" : json_object_get(s, "oneOf") ? "oneOf" : "allOf";
        json_object_foreach((json_t *)s, key, v)
            if (strcmp(key, kw) && strcmp(key, "nullable") && !is_in(key, annotations, KVB_ARRAY_LEN(annotations)))
                return fail(c, KVB_ERR_UNSUPPORTED, "'%s' beside anyOf / oneOf / allOf is not supported", key);
        const json_t *list = json_object_get(s, kw);
        if (!strcmp(kw, "allOf") && json_array_size(list) != 1)
            return fail(c, KVB_ERR_UNSUPPORTED, "%s", "'allOf' with more than one schema is not supported");
        x = alternatives(c, list, kw);
    } else {
        const json_t *type = json_object_get(s, "type");
        if (!type) {
            /* no type: what the keywords imply, else any value */
            if (json_object_get(s, "properties") || json_object_get(s, "required") || json_object_get(s, "additionalProperties"))
                x = object_schema(c, s);
            else if (json_object_get(s, "items") || json_object_get(s, "prefixItems")) x = array_schema(c, s);
            else if (json_object_get(s, "pattern") || json_object_get(s, "format") || json_object_get(s, "minLength") ||
                     json_object_get(s, "maxLength"))
                x = string_schema(c, s);
            else x = any_value(b);
        } else if (json_is_string(type)) {
            x = typed(c, s, json_string_value(type));
        } else if (json_is_array(type) && json_array_size(type)) {
            size_t n = json_array_size(type);
            int32_t *alts;
            if (kvb_malloc(n * sizeof *alts, (void **)&alts) != KVB_OK) return kvb__gb_fail(b, KVB_ERR_NOMEM, "out of memory");
            for (size_t i = 0; i < n; i++) {
                const json_t *t = json_array_get(type, i);
                alts[i] = json_is_string(t) ? typed(c, s, json_string_value(t)) : fail(c, KVB_ERR_INVALID, "%s", "'type' must hold strings");
            }
            x = kvb__gx_alt(b, alts, (int)n);
            free(alts);
        } else {
            return fail(c, KVB_ERR_INVALID, "%s", "'type' must be a string or an array of strings");
        }
    }
    if (json_is_true(json_object_get(s, "nullable"))) x = kvb__gx_alt2(b, x, kvb__gx_lit(b, "null", 4));
    return x;
}

static int32_t schema(sctx *c, const json_t *s) {
    if (c->b->st != KVB_OK) return -1;
    if (++c->depth > c->b->opts.max_schema_depth)
        return fail(c, KVB_ERR_EXHAUSTED, "subschemas nest deeper than %s", "max_schema_depth");
    int32_t x = schema_body(c, s);
    c->depth--;
    return x;
}

int32_t kvb__gx_json_schema(kvb__gb *b, const char *text, size_t len) {
    json_error_t je;
    if (!text) return kvb__gb_fail(b, KVB_ERR_INVALID, "json_schema: no schema");
    json_t *root = json_loadb(text, len, JSON_DECODE_ANY, &je);
    if (!root)
        return kvb__gb_fail(b, KVB_ERR_INVALID, "json_schema: not JSON: %s (line %d, column %d)", je.text, je.line, je.column);
    sctx c = {.b = b, .root = root};
    int32_t x = schema(&c, root);
    for (int i = 0; i < c.n_refs; i++)
        if (c.refs[i].rule >= 0 && b->rule_body[c.refs[i].rule] < 0 && b->st == KVB_OK)
            kvb__gb_fail(b, KVB_ERR_INVALID, "json_schema: a recursive $ref that never completes");
    free(c.refs);
    json_decref(root);
    return x;
}
