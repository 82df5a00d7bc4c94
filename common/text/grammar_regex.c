/* kvbank — regexes and code point sets as grammar expressions.
 *
 * The subset (what guided_regex and JSON Schema's pattern use in practice): literals (UTF-8), '.',
 * classes [a-z] [^...] with escapes inside, \d \w \s \D \W \S (ASCII: a subset of Python's and ECMA's
 * Unicode-aware meaning, so what is generated still matches there), \n \t \r \f \v \0 \xHH \uHHHH
 * \u{H..}, escaped metacharacters, groups ( ) (?: ) (?<name> ) (?P<name> ), alternation, ? * + {m}
 * {m,} {m,n} (lazy forms too: same language), ^ at the start and $ at the end. Refused by name:
 * backreferences, lookaround, \b, flags, possessive quantifiers, anchors elsewhere. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/text/grammar_impl.h"
#include "common/text/unicode.h"
#include "common/util/util.h"

#define MAX_CP 0x10FFFF
#define RX_MAX_DEPTH 64
#define RX_MAX_REPEAT 10000

/* ------------------------------------------------------------------------------------- code point sets */

typedef struct cpset {
    uint32_t (*r)[2];
    int n, cap;
} cpset;

static int cps_add(cpset *s, uint32_t lo, uint32_t hi) {
    if (s->n == s->cap) {
        int c = s->cap ? s->cap * 2 : 8;
        if (kvb_realloc_array((void **)&s->r, (size_t)c, sizeof *s->r) != KVB_OK) return 0;
        s->cap = c;
    }
    s->r[s->n][0] = lo, s->r[s->n][1] = hi, s->n++;
    return 1;
}

static int cmp_range(const void *a, const void *b) {
    const uint32_t *x = a, *y = b;
    return (x[0] > y[0]) - (x[0] < y[0]);
}

static void cps_norm(cpset *s) {
    if (!s->n) return;
    qsort(s->r, (size_t)s->n, sizeof *s->r, cmp_range);
    int k = 0;
    for (int i = 1; i < s->n; i++) {
        if (s->r[i][0] <= s->r[k][1] + 1) {
            if (s->r[i][1] > s->r[k][1]) s->r[k][1] = s->r[i][1];
        } else {
            k++;
            s->r[k][0] = s->r[i][0], s->r[k][1] = s->r[i][1];
        }
    }
    s->n = k + 1;
}

/* The complement within [0, top]. */
static int cps_negate(cpset *s, uint32_t top) {
    cps_norm(s);
    cpset o = {0};
    uint32_t next = 0;
    for (int i = 0; i < s->n && next <= top; i++) {
        if (s->r[i][0] > next && !cps_add(&o, next, KVB_MIN(s->r[i][0] - 1, top))) return free(o.r), 0;
        next = s->r[i][1] + 1;
    }
    if (next <= top && !cps_add(&o, next, top)) return free(o.r), 0;
    free(s->r);
    *s = o;
    return 1;
}

/* lo..hi (one UTF-8 length, no surrogates) as byte ranges: split until every continuation position
 * spans a full 0x80..0xBF or the prefix is shared. */
static int32_t utf8_range(kvb__gb *b, uint32_t lo, uint32_t hi) {
    for (int i = 1; i < 4; i++) {
        uint32_t m = (1u << (6 * i)) - 1;
        if ((lo & ~m) != (hi & ~m)) {
            if ((lo & m) != 0) return kvb__gx_alt2(b, utf8_range(b, lo, lo | m), utf8_range(b, (lo | m) + 1, hi));
            if ((hi & m) != m) return kvb__gx_alt2(b, utf8_range(b, lo, (hi & ~m) - 1), utf8_range(b, hi & ~m, hi));
        }
    }
    uint8_t a[4], z[4];
    int n = kvb__utf8_encode(lo, a);
    kvb__utf8_encode(hi, z);
    int32_t k[4];
    for (int i = 0; i < n; i++) k[i] = kvb__gx_range(b, a[i], z[i]);
    return kvb__gx_seq(b, k, n);
}

int32_t kvb__gx_codepoints(kvb__gb *b, const uint32_t (*ranges)[2], int n) {
    static const uint32_t bounds[][2] = {{0, 0x7F}, {0x80, 0x7FF}, {0x800, 0xD7FF}, {0xE000, 0xFFFF}, {0x10000, MAX_CP}};
    int32_t *alts;
    int na = 0;
    if (b->st != KVB_OK) return -1;
    if (kvb_malloc(((size_t)n * KVB_ARRAY_LEN(bounds) + 1) * sizeof *alts, (void **)&alts) != KVB_OK)
        return kvb__gb_fail(b, KVB_ERR_NOMEM, "out of memory compiling the grammar");
    for (int i = 0; i < n; i++)
        for (size_t k = 0; k < KVB_ARRAY_LEN(bounds); k++) {
            uint32_t lo = KVB_MAX(ranges[i][0], bounds[k][0]), hi = KVB_MIN(ranges[i][1], bounds[k][1]);
            if (lo <= hi) alts[na++] = utf8_range(b, lo, hi);
        }
    int32_t r = na ? kvb__gx_alt(b, alts, na) : kvb__gb_fail(b, KVB_ERR_INVALID, "a character class that matches nothing");
    free(alts);
    return r;
}

/* A set as characters inside a JSON string: raw UTF-8 where JSON allows it, escaped where it must be. */
static int32_t json_chars(kvb__gb *b, const cpset *s) {
    cpset raw = {0};
    int32_t alts[40];
    int na = 0;
    static const char short_esc[][2] = {{'"', '"'}, {'\\', '\\'}, {'\b', 'b'}, {'\f', 'f'}, {'\n', 'n'}, {'\r', 'r'}, {'\t', 't'}};
    for (int i = 0; i < s->n; i++) {
        uint32_t lo = s->r[i][0], hi = s->r[i][1];
        /* raw: everything but '"', '\' and C0 controls */
        uint32_t cuts[][2] = {{0x20, 0x21}, {0x23, 0x5B}, {0x5D, MAX_CP}};
        for (size_t k = 0; k < KVB_ARRAY_LEN(cuts); k++) {
            uint32_t a = KVB_MAX(lo, cuts[k][0]), z = KVB_MIN(hi, cuts[k][1]);
            if (a <= z && !cps_add(&raw, a, z)) {
                free(raw.r);
                return kvb__gb_fail(b, KVB_ERR_NOMEM, "out of memory compiling the grammar");
            }
        }
    }
    if (raw.n) alts[na++] = kvb__gx_codepoints(b, (const uint32_t(*)[2])raw.r, raw.n);
    free(raw.r);
    for (uint32_t c = 0; c <= '\\'; c++) { /* the C0 controls, '"' and '\\' */
        if (c >= 0x20 && c != '"' && c != '\\') continue;
        int in = 0;
        for (int i = 0; i < s->n && !in; i++) in = c >= s->r[i][0] && c <= s->r[i][1];
        if (!in) continue;
        char e[8];
        int el = 0;
        for (size_t k = 0; k < KVB_ARRAY_LEN(short_esc); k++)
            if ((uint8_t)short_esc[k][0] == c) el = snprintf(e, sizeof e, "\\%c", short_esc[k][1]);
        if (!el) el = snprintf(e, sizeof e, "\\u%04x", c);
        alts[na++] = kvb__gx_lit(b, e, (size_t)el);
    }
    if (!na) return kvb__gb_fail(b, KVB_ERR_INVALID, "a character class that matches nothing");
    return kvb__gx_alt(b, alts, na);
}

/* ------------------------------------------------------------------------------------- regex parser */

typedef struct rx {
    kvb__gb *b;
    const uint8_t *s;
    size_t n, i;
    int mode;
    int depth;
} rx;

static int32_t rx_fail(rx *r, kvb_status st, const char *what) {
    return kvb__gb_fail(r->b, st, "regex: %s at offset %zu", what, r->i);
}

static int32_t set_expr(rx *r, const cpset *s) {
    return r->mode == KVB__RX_JSON ? json_chars(r->b, s) : kvb__gx_codepoints(r->b, (const uint32_t(*)[2])s->r, s->n);
}

static int hexval(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Adds a shorthand class (\d \w \s and their negations, negated within ASCII). */
static int add_shorthand(cpset *s, int c) {
    cpset t = {0};
    int ok = 1;
    switch (c | 0x20) {
    case 'd': ok = cps_add(&t, '0', '9'); break;
    case 'w': ok = cps_add(&t, '0', '9') && cps_add(&t, 'A', 'Z') && cps_add(&t, 'a', 'z') && cps_add(&t, '_', '_'); break;
    case 's': ok = cps_add(&t, '\t', '\r') && cps_add(&t, ' ', ' '); break;
    }
    if (ok && c >= 'A' && c <= 'Z') ok = cps_negate(&t, 0x7F);
    for (int i = 0; ok && i < t.n; i++) ok = cps_add(s, t.r[i][0], t.r[i][1]);
    free(t.r);
    return ok;
}

/* An escape after '\' (r->i at the letter): a code point in *cp, or a shorthand added to *set (returns 2),
 * or -1 (failed, reason recorded). */
static int rx_escape(rx *r, uint32_t *cp, cpset *set) {
    if (r->i >= r->n) return rx_fail(r, KVB_ERR_INVALID, "a trailing backslash"), -1;
    int c = r->s[r->i++];
    switch (c) {
    case 'd': case 'w': case 's': case 'D': case 'W': case 'S':
        if (!add_shorthand(set, c)) return kvb__gb_fail(r->b, KVB_ERR_NOMEM, "out of memory"), -1;
        return 2;
    case 'n': *cp = '\n'; return 1;
    case 't': *cp = '\t'; return 1;
    case 'r': *cp = '\r'; return 1;
    case 'f': *cp = '\f'; return 1;
    case 'v': *cp = '\v'; return 1;
    case '0': *cp = 0; return 1;
    case 'x': case 'u': {
        int braces = r->i < r->n && r->s[r->i] == '{';
        int want = c == 'x' ? 2 : 4;
        uint32_t v = 0;
        int got = 0;
        if (braces) r->i++;
        while (r->i < r->n && hexval(r->s[r->i]) >= 0 && (braces ? got < 6 : got < want)) {
            v = v * 16 + (uint32_t)hexval(r->s[r->i++]);
            got++;
        }
        if (braces && (r->i >= r->n || r->s[r->i++] != '}')) got = 0;
        if (!got || (!braces && got != want) || v > MAX_CP || (v >= 0xD800 && v <= 0xDFFF))
            return rx_fail(r, KVB_ERR_INVALID, "a bad \\x or \\u escape"), -1;
        *cp = v;
        return 1;
    }
    case 'b': case 'B': return rx_fail(r, KVB_ERR_UNSUPPORTED, "word boundaries (\\b, \\B) are not supported"), -1;
    case 'A': case 'Z': case 'z': case 'G':
        return rx_fail(r, KVB_ERR_UNSUPPORTED, "anchors other than ^ and $ at the ends are not supported"), -1;
    case 'p': case 'P': return rx_fail(r, KVB_ERR_UNSUPPORTED, "Unicode property classes (\\p) are not supported"), -1;
    case 'k': return rx_fail(r, KVB_ERR_UNSUPPORTED, "backreferences are not supported"), -1;
    default:
        if (c >= '1' && c <= '9') return rx_fail(r, KVB_ERR_UNSUPPORTED, "backreferences are not supported"), -1;
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))
            return rx_fail(r, KVB_ERR_UNSUPPORTED, "an unknown escape"), -1;
        if (c >= 0x80) { /* an escaped non-ASCII character stands for itself */
            r->i--;
            int len = kvb__utf8_decode(r->s + r->i, r->n - r->i, cp);
            if (!len) return rx_fail(r, KVB_ERR_INVALID, "invalid UTF-8"), -1;
            r->i += (size_t)len;
            return 1;
        }
        *cp = (uint32_t)c;
        return 1;
    }
}

/* One literal character of the pattern (UTF-8 decoded). */
static int rx_char(rx *r, uint32_t *cp) {
    int len = kvb__utf8_decode(r->s + r->i, r->n - r->i, cp);
    if (!len) return rx_fail(r, KVB_ERR_INVALID, "invalid UTF-8"), 0;
    r->i += (size_t)len;
    return 1;
}

static int32_t rx_class(rx *r) {
    cpset s = {0};
    int neg = 0, shorthand = 0, first = 1;
    r->i++; /* '[' */
    if (r->i < r->n && r->s[r->i] == '^') neg = 1, r->i++;
    for (;;) {
        if (r->i >= r->n) {
            free(s.r);
            return rx_fail(r, KVB_ERR_INVALID, "an unterminated character class");
        }
        if (r->s[r->i] == ']' && !first) {
            r->i++;
            break;
        }
        first = 0;
        uint32_t lo, hi;
        int k;
        if (r->s[r->i] == '[' && r->i + 1 < r->n && (r->s[r->i + 1] == ':' || r->s[r->i + 1] == '=')) {
            free(s.r);
            return rx_fail(r, KVB_ERR_UNSUPPORTED, "POSIX classes ([:alpha:]) are not supported");
        }
        if (r->s[r->i] == '\\') {
            r->i++;
            k = rx_escape(r, &lo, &s);
            if (k < 0) return free(s.r), -1;
            if (k == 2) {
                shorthand = 1;
                continue;
            }
        } else if (!rx_char(r, &lo)) {
            return free(s.r), -1;
        }
        hi = lo;
        if (r->i + 1 < r->n && r->s[r->i] == '-' && r->s[r->i + 1] != ']') {
            r->i++;
            if (r->s[r->i] == '\\') {
                r->i++;
                k = rx_escape(r, &hi, &s);
                if (k < 0) return free(s.r), -1;
                if (k == 2) {
                    free(s.r);
                    return rx_fail(r, KVB_ERR_INVALID, "a range that ends in a class shorthand");
                }
            } else if (!rx_char(r, &hi)) {
                return free(s.r), -1;
            }
            if (hi < lo) {
                free(s.r);
                return rx_fail(r, KVB_ERR_INVALID, "a character range out of order");
            }
        }
        if (!cps_add(&s, lo, hi)) return free(s.r), kvb__gb_fail(r->b, KVB_ERR_NOMEM, "out of memory");
    }
    /* a negated class holding a shorthand is negated within ASCII (see the file comment) */
    if (neg && !cps_negate(&s, shorthand ? 0x7F : MAX_CP)) return free(s.r), kvb__gb_fail(r->b, KVB_ERR_NOMEM, "out of memory");
    cps_norm(&s);
    int32_t x = s.n ? set_expr(r, &s) : rx_fail(r, KVB_ERR_INVALID, "a character class that matches nothing");
    free(s.r);
    return x;
}

static int32_t rx_alt(rx *r);

static int rx_int(rx *r, int *v) {
    if (r->i >= r->n || r->s[r->i] < '0' || r->s[r->i] > '9') return 0;
    long x = 0;
    while (r->i < r->n && r->s[r->i] >= '0' && r->s[r->i] <= '9') {
        x = x * 10 + (r->s[r->i++] - '0');
        if (x > RX_MAX_REPEAT) x = RX_MAX_REPEAT + 1;
    }
    *v = (int)x;
    return 1;
}

static int32_t rx_atom(rx *r) {
    uint8_t c = r->s[r->i];
    uint32_t cp;
    cpset s = {0};
    switch (c) {
    case '(': {
        r->i++;
        if (++r->depth > RX_MAX_DEPTH) return rx_fail(r, KVB_ERR_EXHAUSTED, "groups nested too deeply");
        if (r->i < r->n && r->s[r->i] == '?') {
            r->i++;
            if (r->i < r->n && r->s[r->i] == ':') r->i++;
            else if (r->i < r->n && (r->s[r->i] == '<' || r->s[r->i] == 'P') &&
                     !(r->s[r->i] == '<' && r->i + 1 < r->n && (r->s[r->i + 1] == '=' || r->s[r->i + 1] == '!'))) {
                if (r->s[r->i] == 'P') r->i++;
                if (r->i >= r->n || r->s[r->i] != '<') return rx_fail(r, KVB_ERR_UNSUPPORTED, "this group syntax is not supported");
                while (r->i < r->n && r->s[r->i] != '>') r->i++;
                if (r->i >= r->n) return rx_fail(r, KVB_ERR_INVALID, "an unterminated group name");
                r->i++;
            } else if (r->i < r->n && (r->s[r->i] == '=' || r->s[r->i] == '!' || r->s[r->i] == '<')) {
                return rx_fail(r, KVB_ERR_UNSUPPORTED, "lookaround is not supported");
            } else {
                return rx_fail(r, KVB_ERR_UNSUPPORTED, "inline flags and this group syntax are not supported");
            }
        }
        int32_t x = rx_alt(r);
        if (x < 0) return -1;
        if (r->i >= r->n || r->s[r->i] != ')') return rx_fail(r, KVB_ERR_INVALID, "a missing )");
        r->i++;
        r->depth--;
        return x;
    }
    case '[': return rx_class(r);
    case '.': {
        r->i++;
        int ok = cps_add(&s, 0, '\n' - 1) && cps_add(&s, '\n' + 1, MAX_CP);
        int32_t x = ok ? set_expr(r, &s) : kvb__gb_fail(r->b, KVB_ERR_NOMEM, "out of memory");
        free(s.r);
        return x;
    }
    case '\\': {
        r->i++;
        int k = rx_escape(r, &cp, &s);
        if (k < 0) return free(s.r), -1;
        if (k == 1 && !cps_add(&s, cp, cp)) return free(s.r), kvb__gb_fail(r->b, KVB_ERR_NOMEM, "out of memory");
        cps_norm(&s);
        int32_t x = set_expr(r, &s);
        free(s.r);
        return x;
    }
    case '^': case '$':
        return rx_fail(r, KVB_ERR_UNSUPPORTED, "anchors are supported only at the start (^) and end ($) of the pattern");
    case '*': case '+': case '?':
        return rx_fail(r, KVB_ERR_INVALID, "a quantifier with nothing to repeat");
    case ')': return rx_fail(r, KVB_ERR_INVALID, "an unmatched )");
    default: {
        if (!rx_char(r, &cp)) return -1;
        if (r->mode == KVB__RX_RAW) {
            uint8_t u[4];
            return kvb__gx_lit(r->b, u, (size_t)kvb__utf8_encode(cp, u));
        }
        if (!cps_add(&s, cp, cp)) return kvb__gb_fail(r->b, KVB_ERR_NOMEM, "out of memory");
        int32_t x = set_expr(r, &s);
        free(s.r);
        return x;
    }
    }
}

static int32_t rx_piece(rx *r) {
    int32_t x = rx_atom(r);
    while (x >= 0 && r->i < r->n) {
        uint8_t c = r->s[r->i];
        int min, max;
        if (c == '*') min = 0, max = -1, r->i++;
        else if (c == '+') min = 1, max = -1, r->i++;
        else if (c == '?') min = 0, max = 1, r->i++;
        else if (c == '{') {
            size_t save = r->i++;
            if (!rx_int(r, &min)) {
                if (r->i < r->n && r->s[r->i] == ',') min = 0; /* {,n}: Python's 0..n */
                else { /* not a quantifier: a literal '{' (Python, ECMA) */
                    r->i = save;
                    return x;
                }
            }
            max = min;
            if (r->i < r->n && r->s[r->i] == ',') {
                r->i++;
                if (!rx_int(r, &max)) max = -1;
            }
            if (r->i >= r->n || r->s[r->i] != '}') {
                r->i = save;
                return x;
            }
            r->i++;
            if (min > RX_MAX_REPEAT || max > RX_MAX_REPEAT)
                return rx_fail(r, KVB_ERR_EXHAUSTED, "a repetition count above 10000");
            if (max >= 0 && max < min) return rx_fail(r, KVB_ERR_INVALID, "a repetition {m,n} with m > n");
        } else {
            return x;
        }
        if (r->i < r->n && r->s[r->i] == '?') r->i++; /* lazy: the same language */
        else if (r->i < r->n && r->s[r->i] == '+') return rx_fail(r, KVB_ERR_UNSUPPORTED, "possessive quantifiers are not supported");
        x = kvb__gx_repeat(r->b, x, min, max);
    }
    return x;
}

static int32_t rx_seq(rx *r) {
    int32_t *xs = NULL;
    int n = 0, cap = 0;
    while (r->i < r->n && r->s[r->i] != '|' && r->s[r->i] != ')') {
        if (r->s[r->i] == '$' && r->depth == 0 && r->i + 1 == r->n) break; /* the end anchor, handled by the caller */
        int32_t x = rx_piece(r);
        if (x < 0) return free(xs), -1;
        if (n == cap) {
            cap = cap ? cap * 2 : 8;
            if (kvb_realloc_array((void **)&xs, (size_t)cap, sizeof *xs) != KVB_OK)
                return free(xs), kvb__gb_fail(r->b, KVB_ERR_NOMEM, "out of memory");
        }
        xs[n++] = x;
    }
    int32_t x = kvb__gx_seq(r->b, xs, n);
    free(xs);
    return x;
}

static int32_t rx_alt(rx *r) {
    int32_t *xs = NULL;
    int n = 0, cap = 0;
    for (;;) {
        int32_t x = rx_seq(r);
        if (x < 0) return free(xs), -1;
        if (n == cap) {
            cap = cap ? cap * 2 : 4;
            if (kvb_realloc_array((void **)&xs, (size_t)cap, sizeof *xs) != KVB_OK)
                return free(xs), kvb__gb_fail(r->b, KVB_ERR_NOMEM, "out of memory");
        }
        xs[n++] = x;
        if (r->i < r->n && r->s[r->i] == '|') {
            r->i++;
            continue;
        }
        break;
    }
    int32_t x = kvb__gx_alt(r->b, xs, n);
    free(xs);
    return x;
}

int32_t kvb__gx_regex(kvb__gb *b, const char *pattern, size_t len, int mode, int search) {
    rx r = {b, (const uint8_t *)pattern, len, 0, mode, 0};
    if (b->st != KVB_OK) return -1;
    if (!pattern) return kvb__gb_fail(b, KVB_ERR_INVALID, "regex: no pattern");
    int start_anchor = len && r.s[0] == '^';
    if (start_anchor) r.i = 1;
    int32_t x = rx_alt(&r);
    if (x < 0) return -1;
    int end_anchor = 0;
    if (r.i < r.n && r.s[r.i] == '$' && r.i + 1 == r.n) end_anchor = 1, r.i++;
    if (r.i < r.n) return rx_fail(&r, KVB_ERR_INVALID, r.s[r.i] == ')' ? "an unmatched )" : "unexpected input");
    if (!search) return x;
    /* search semantics: anything may come before / after an unanchored pattern */
    int32_t any = mode == KVB__RX_JSON ? kvb__gx_repeat(b, kvb__gx_json_char(b), 0, -1) : -1;
    if (mode != KVB__RX_JSON) {
        uint32_t all[][2] = {{0, MAX_CP}};
        any = kvb__gx_repeat(b, kvb__gx_codepoints(b, (const uint32_t(*)[2])all, 1), 0, -1);
    }
    if (!start_anchor) x = kvb__gx_seq2(b, any, x);
    if (!end_anchor) x = kvb__gx_seq2(b, x, any);
    return x;
}
