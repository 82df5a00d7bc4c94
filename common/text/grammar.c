/* kvbank — grammars: the expression builder, expressions -> one deterministic automaton per rule
 * (Thompson construction, then subset construction with rule calls as symbols), trimming, the checks
 * that keep a matcher from looping or dead-ending, compilation of a request's parts, and the cache of
 * compiled grammars. Matching and masks are in grammar_match.c; docs/grammar.md has the design. */
#include "common/text/grammar.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/text/grammar_impl.h"
#include "common/text/unicode.h"
#include "common/util/util.h"

#define NFA_MAX_NODES (1 << 22) /* a bound on Thompson nodes before determinization */

void kvb_grammar_opts_default(kvb_grammar_opts *o) {
    o->ws_indent = 16;
    o->max_depth = 64;
    o->max_states = 200000;
    o->max_schema_depth = 64;
    o->strict = 1;
    o->max_table_bytes = (size_t)256 << 20;
}

/* ------------------------------------------------------------------------------------- builder */

int32_t kvb__gb_fail(kvb__gb *b, kvb_status st, const char *fmt, ...) {
    if (b->st == KVB_OK) {
        b->st = st;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(b->err, sizeof b->err, fmt, ap);
        va_end(ap);
    }
    return -1;
}

static int grow(kvb__gb *b, void **p, int32_t *cap, int32_t need, size_t elem) {
    if (need <= *cap) return 1;
    int32_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    if (kvb_realloc_array(p, (size_t)c, elem) != KVB_OK) {
        kvb__gb_fail(b, KVB_ERR_NOMEM, "out of memory compiling the grammar");
        return 0;
    }
    *cap = c;
    return 1;
}

static int64_t cap_size(int64_t s) { return s > ((int64_t)1 << 40) ? ((int64_t)1 << 40) : s; }

static int32_t gx_new(kvb__gb *b, kvb__gx x) {
    if (b->st != KVB_OK) return -1;
    if (x.size > NFA_MAX_NODES)
        return kvb__gb_fail(b, KVB_ERR_EXHAUSTED, "the grammar is too large (over %d automaton nodes before "
                            "determinization): a bound (maxLength, maxItems, {m,n}) or an enum is too big", NFA_MAX_NODES);
    if (!grow(b, (void **)&b->x, &b->capx, b->nx + 1, sizeof *b->x)) return -1;
    b->x[b->nx] = x;
    return b->nx++;
}

int32_t kvb__gx_empty(kvb__gb *b) { return gx_new(b, (kvb__gx){.kind = KVB__GX_EMPTY, .size = 0}); }

int32_t kvb__gx_range(kvb__gb *b, int lo, int hi) {
    if (lo < 0 || hi > 255 || lo > hi) return kvb__gb_fail(b, KVB_ERR_INVALID, "empty byte range");
    return gx_new(b, (kvb__gx){.kind = KVB__GX_BYTES, .lo = (uint8_t)lo, .hi = (uint8_t)hi, .size = 1});
}

static int32_t gx_list(kvb__gb *b, int kind, const int32_t *kids, int n) {
    if (b->st != KVB_OK) return -1;
    int64_t size = kind == KVB__GX_ALT ? 2 : 0;
    for (int i = 0; i < n; i++) {
        if (kids[i] < 0) return -1;
        size = cap_size(size + b->x[kids[i]].size + (kind == KVB__GX_ALT));
    }
    if (n == 1) return kids[0];
    if (n == 0 && kind == KVB__GX_SEQ) return kvb__gx_empty(b);
    if (n == 0) return kvb__gb_fail(b, KVB_ERR_INVALID, "an alternation of nothing");
    if (!grow(b, (void **)&b->kids, &b->capk, b->nk + n, sizeof *b->kids)) return -1;
    memcpy(b->kids + b->nk, kids, (size_t)n * sizeof *kids);
    int32_t id = gx_new(b, (kvb__gx){.kind = (uint8_t)kind, .a = b->nk, .n = n, .size = size});
    if (id >= 0) b->nk += n;
    return id;
}

int32_t kvb__gx_seq(kvb__gb *b, const int32_t *kids, int n) { return gx_list(b, KVB__GX_SEQ, kids, n); }

int32_t kvb__gx_list(kvb__gb *b, int32_t sep, const int32_t *elems, int n) {
    if (b->st != KVB_OK || sep < 0) return -1;
    int64_t size = 2;
    for (int i = 0; i < n; i++) {
        if (elems[i] < 0) return -1;
        size = cap_size(size + 2 * (b->x[elems[i]].size + b->x[sep].size + 2));
    }
    if (!grow(b, (void **)&b->kids, &b->capk, b->nk + n + 1, sizeof *b->kids)) return -1;
    b->kids[b->nk] = sep;
    memcpy(b->kids + b->nk + 1, elems, (size_t)n * sizeof *elems);
    int32_t id = gx_new(b, (kvb__gx){.kind = KVB__GX_LIST, .a = b->nk, .n = n + 1, .size = size});
    if (id >= 0) b->nk += n + 1;
    return id;
}
int32_t kvb__gx_alt(kvb__gb *b, const int32_t *kids, int n) { return gx_list(b, KVB__GX_ALT, kids, n); }
int32_t kvb__gx_seq2(kvb__gb *b, int32_t x, int32_t y) { return kvb__gx_seq(b, (int32_t[]){x, y}, 2); }
int32_t kvb__gx_alt2(kvb__gb *b, int32_t x, int32_t y) { return kvb__gx_alt(b, (int32_t[]){x, y}, 2); }

int32_t kvb__gx_lit(kvb__gb *b, const void *s, size_t n) {
    const uint8_t *p = s;
    if (b->st != KVB_OK) return -1;
    if (n > NFA_MAX_NODES) return kvb__gb_fail(b, KVB_ERR_EXHAUSTED, "a literal of %zu bytes is too long", n);
    int32_t *ids;
    if (n == 0) return kvb__gx_empty(b);
    if (kvb_malloc(n * sizeof *ids, (void **)&ids) != KVB_OK)
        return kvb__gb_fail(b, KVB_ERR_NOMEM, "out of memory compiling the grammar");
    for (size_t i = 0; i < n; i++) ids[i] = kvb__gx_range(b, p[i], p[i]);
    int32_t r = kvb__gx_seq(b, ids, (int)n);
    free(ids);
    return r;
}

int32_t kvb__gx_repeat(kvb__gb *b, int32_t x, int min, int max) {
    if (x < 0) return -1;
    if (min < 0 || (max >= 0 && max < min))
        return kvb__gb_fail(b, KVB_ERR_INVALID, "a repetition {%d,%d} with min above max", min, max);
    if (max == 1 && min == 1) return x;
    if (max == 0) return kvb__gx_empty(b);
    int64_t copies = max < 0 ? (int64_t)min + 1 : max;
    int64_t size = cap_size(b->x[x].size * copies + copies + 2);
    return gx_new(b, (kvb__gx){.kind = KVB__GX_REPEAT, .a = x, .min = min, .max = max, .size = size});
}

int32_t kvb__gx_opt(kvb__gb *b, int32_t x) { return kvb__gx_repeat(b, x, 0, 1); }

int32_t kvb__gx_call(kvb__gb *b, int32_t rule) {
    if (rule < 0) return -1;
    return gx_new(b, (kvb__gx){.kind = KVB__GX_CALL, .a = rule, .size = 1});
}

int32_t kvb__gb_rule_new(kvb__gb *b) {
    if (b->st != KVB_OK) return -1;
    if (!grow(b, (void **)&b->rule_body, &b->cap_rules, b->n_rules + 1, sizeof *b->rule_body)) return -1;
    b->rule_body[b->n_rules] = -1;
    return b->n_rules++;
}

void kvb__gb_rule_set(kvb__gb *b, int32_t rule, int32_t x) {
    if (rule >= 0 && rule < b->n_rules) b->rule_body[rule] = x;
}

static void gb_free(kvb__gb *b) {
    free(b->x);
    free(b->kids);
    free(b->rule_body);
}

/* ------------------------------------------------------------------------------------- Thompson NFA */

enum { NE_BYTES = -1, NE_EPS = -2 };

typedef struct nedge {
    int32_t from, to;
    int32_t kind; /* NE_BYTES, NE_EPS, or a rule id (a call) */
    uint8_t lo, hi;
} nedge;

typedef struct nfa {
    int32_t n, cap;
    uint8_t *final;
    int32_t *rule; /* [n] the rule a node belongs to */
    nedge *e;
    int32_t ne, cape;
    int32_t *first; /* [n + 1] after indexing: edges of node i are e[first[i] .. first[i+1]) */
} nfa;

static int32_t nfa_node(kvb__gb *b, nfa *a, int32_t rule) {
    if (b->st != KVB_OK) return -1;
    if (a->n >= NFA_MAX_NODES)
        return kvb__gb_fail(b, KVB_ERR_EXHAUSTED, "the grammar is too large (over %d automaton nodes)", NFA_MAX_NODES);
    int32_t cap = a->cap;
    if (!grow(b, (void **)&a->final, &cap, a->n + 1, 1)) return -1;
    cap = a->cap;
    if (!grow(b, (void **)&a->rule, &cap, a->n + 1, sizeof *a->rule)) return -1;
    a->cap = cap;
    a->final[a->n] = 0;
    a->rule[a->n] = rule;
    return a->n++;
}

static void nfa_edge(kvb__gb *b, nfa *a, int32_t from, int32_t to, int32_t kind, int lo, int hi) {
    if (b->st != KVB_OK || from < 0 || to < 0) return;
    if (!grow(b, (void **)&a->e, &a->cape, a->ne + 1, sizeof *a->e)) return;
    a->e[a->ne++] = (nedge){from, to, kind, (uint8_t)lo, (uint8_t)hi};
}

/* Adds expression x starting at node `from`; returns the node where it ends. */
static int32_t nfa_build(kvb__gb *b, nfa *a, int32_t x, int32_t from, int32_t rule) {
    if (b->st != KVB_OK || from < 0) return -1;
    const kvb__gx *g = &b->x[x];
    switch (g->kind) {
    case KVB__GX_EMPTY: return from;
    case KVB__GX_BYTES: {
        int32_t to = nfa_node(b, a, rule);
        nfa_edge(b, a, from, to, NE_BYTES, g->lo, g->hi);
        return to;
    }
    case KVB__GX_CALL: {
        int32_t to = nfa_node(b, a, rule);
        nfa_edge(b, a, from, to, g->a, 0, 0);
        return to;
    }
    case KVB__GX_SEQ: {
        int32_t cur = from, k0 = g->a, n = g->n;
        for (int32_t i = 0; i < n; i++) cur = nfa_build(b, a, b->kids[k0 + i], cur, rule);
        return cur;
    }
    case KVB__GX_ALT: {
        int32_t end = nfa_node(b, a, rule), k0 = g->a, n = g->n;
        for (int32_t i = 0; i < n; i++) {
            int32_t s = nfa_node(b, a, rule); /* a fresh start: an alternative that loops never loops into another */
            nfa_edge(b, a, from, s, NE_EPS, 0, 0);
            nfa_edge(b, a, nfa_build(b, a, b->kids[k0 + i], s, rule), end, NE_EPS, 0, 0);
        }
        return end;
    }
    case KVB__GX_LIST: {
        /* two tracks: a = nothing written yet, w = something written (the next element needs the separator) */
        int32_t sep = b->kids[g->a], n = g->n - 1, k0 = g->a + 1;
        int32_t a_i = from, w_i = nfa_node(b, a, rule);
        for (int32_t i = 0; i < n && b->st == KVB_OK; i++) {
            const kvb__gx *e = &b->x[b->kids[k0 + i]];
            int opt = e->kind == KVB__GX_REPEAT && e->min == 0 && (e->max == 1 || e->max < 0);
            int many = opt && e->max < 0;
            int32_t elem = opt ? e->a : b->kids[k0 + i];
            int32_t a_n = nfa_node(b, a, rule), w_n = nfa_node(b, a, rule);
            int32_t s1 = nfa_node(b, a, rule), s2 = nfa_node(b, a, rule);
            nfa_edge(b, a, a_i, s1, NE_EPS, 0, 0);
            nfa_edge(b, a, w_i, s2, NE_EPS, 0, 0);
            int32_t first_end = nfa_build(b, a, elem, s1, rule);
            int32_t next_end = nfa_build(b, a, elem, nfa_build(b, a, sep, s2, rule), rule);
            /* `many`: after an element, the same element may come again (separated): back to w_i */
            nfa_edge(b, a, first_end, many ? w_i : w_n, NE_EPS, 0, 0);
            nfa_edge(b, a, next_end, many ? w_i : w_n, NE_EPS, 0, 0);
            if (opt) {
                nfa_edge(b, a, a_i, a_n, NE_EPS, 0, 0);
                nfa_edge(b, a, w_i, w_n, NE_EPS, 0, 0);
            }
            a_i = a_n, w_i = w_n;
        }
        int32_t end = nfa_node(b, a, rule);
        nfa_edge(b, a, a_i, end, NE_EPS, 0, 0);
        nfa_edge(b, a, w_i, end, NE_EPS, 0, 0);
        return end;
    }
    case KVB__GX_REPEAT: {
        int32_t cur = from, kid = g->a, min = g->min, max = g->max;
        for (int32_t i = 0; i < min; i++) {
            int32_t s = nfa_node(b, a, rule);
            nfa_edge(b, a, cur, s, NE_EPS, 0, 0);
            cur = nfa_build(b, a, kid, s, rule);
        }
        if (max < 0) {
            int32_t head = nfa_node(b, a, rule), body = nfa_node(b, a, rule);
            nfa_edge(b, a, cur, head, NE_EPS, 0, 0);
            nfa_edge(b, a, head, body, NE_EPS, 0, 0);
            nfa_edge(b, a, nfa_build(b, a, kid, body, rule), head, NE_EPS, 0, 0);
            return head;
        }
        int32_t end = nfa_node(b, a, rule);
        nfa_edge(b, a, cur, end, NE_EPS, 0, 0);
        for (int32_t i = min; i < max; i++) {
            int32_t s = nfa_node(b, a, rule);
            nfa_edge(b, a, cur, s, NE_EPS, 0, 0);
            cur = nfa_build(b, a, kid, s, rule);
            nfa_edge(b, a, cur, end, NE_EPS, 0, 0);
        }
        return end;
    }
    }
    return kvb__gb_fail(b, KVB_ERR_INVALID, "bad expression kind %d", g->kind);
}

static int nfa_index(kvb__gb *b, nfa *a) {
    if (kvb_calloc((size_t)a->n + 1, sizeof *a->first, (void **)&a->first) != KVB_OK)
        return kvb__gb_fail(b, KVB_ERR_NOMEM, "out of memory compiling the grammar"), 0;
    nedge *sorted;
    if (kvb_malloc(((size_t)a->ne + 1) * sizeof *sorted, (void **)&sorted) != KVB_OK)
        return kvb__gb_fail(b, KVB_ERR_NOMEM, "out of memory compiling the grammar"), 0;
    for (int32_t i = 0; i < a->ne; i++) a->first[a->e[i].from + 1]++;
    for (int32_t i = 0; i < a->n; i++) a->first[i + 1] += a->first[i];
    int32_t *pos = NULL;
    if (kvb_malloc(((size_t)a->n + 1) * sizeof *pos, (void **)&pos) != KVB_OK) {
        free(sorted);
        return kvb__gb_fail(b, KVB_ERR_NOMEM, "out of memory compiling the grammar"), 0;
    }
    memcpy(pos, a->first, (size_t)a->n * sizeof *pos);
    for (int32_t i = 0; i < a->ne; i++) sorted[pos[a->e[i].from]++] = a->e[i];
    free(pos);
    free(a->e);
    a->e = sorted;
    return 1;
}

static void nfa_free(nfa *a) {
    free(a->final);
    free(a->rule);
    free(a->e);
    free(a->first);
}

/* ------------------------------------------------------------------------------------- subset construction */

typedef struct dfa_build {
    /* node sets of the states, back to back: state i is sets[set0[i] .. set0[i+1]) */
    int32_t *sets;
    int64_t nsets, capsets;
    int32_t *set0; /* [n + 1] */
    int32_t n, cap;
    uint32_t *slots; /* hash table of state ids + 1 (0: empty) */
    uint32_t mask;
    /* the automaton being built */
    kvb__gstate *st;
    kvb__gedge *edges;
    int32_t ne, cape;
    kvb__gcall *calls;
    int32_t nc, capc;
    /* scratch */
    uint32_t *mark; /* [nfa nodes] generation stamps */
    uint32_t gen;
    int32_t *stack, *tmp;
    int32_t ntmp, captmp;
} dfa_build;

static uint64_t hash_set(const int32_t *s, int32_t n) {
    uint64_t h = 0x9e3779b97f4a7c15ull ^ (uint64_t)n;
    for (int32_t i = 0; i < n; i++) {
        h ^= (uint32_t)s[i];
        h *= 0xff51afd7ed558ccdull;
        h ^= h >> 32;
    }
    return h;
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Closes tmp[0..ntmp) under epsilon edges, sorts it and returns its state (new or existing), or -1. */
static int32_t dfa_intern(kvb__gb *b, const nfa *a, dfa_build *d, int32_t rule) {
    if (b->st != KVB_OK) return -1;
    d->gen++;
    int32_t sp = 0, n = 0;
    for (int32_t i = 0; i < d->ntmp; i++)
        if (d->mark[d->tmp[i]] != d->gen) {
            d->mark[d->tmp[i]] = d->gen;
            d->stack[sp++] = d->tmp[i];
        }
    while (sp) {
        int32_t u = d->stack[--sp];
        if (!grow(b, (void **)&d->tmp, &d->captmp, n + 1, sizeof *d->tmp)) return -1;
        d->tmp[n++] = u;
        for (int32_t e = a->first[u]; e < a->first[u + 1]; e++)
            if (a->e[e].kind == NE_EPS && d->mark[a->e[e].to] != d->gen) {
                d->mark[a->e[e].to] = d->gen;
                d->stack[sp++] = a->e[e].to;
            }
    }
    d->ntmp = n;
    qsort(d->tmp, (size_t)n, sizeof *d->tmp, cmp_i32);
    uint64_t h = hash_set(d->tmp, n);
    for (uint32_t i = (uint32_t)h & d->mask;; i = (i + 1) & d->mask) {
        uint32_t id = d->slots[i];
        if (!id) {
            if (d->n >= b->opts.max_states)
                return kvb__gb_fail(b, KVB_ERR_EXHAUSTED, "the grammar needs more than %d automaton states "
                                    "(max_states); simplify the schema or regex", b->opts.max_states);
            int32_t s = d->n;
            int32_t cap = d->cap;
            if (!grow(b, (void **)&d->set0, &cap, s + 2, sizeof *d->set0)) return -1;
            cap = d->cap;
            if (!grow(b, (void **)&d->st, &cap, s + 2, sizeof *d->st)) return -1;
            d->cap = cap;
            while (d->nsets + n > d->capsets) {
                int64_t c = d->capsets ? d->capsets * 2 : 1024;
                if (kvb_realloc_array((void **)&d->sets, (size_t)c, sizeof *d->sets) != KVB_OK)
                    return kvb__gb_fail(b, KVB_ERR_NOMEM, "out of memory compiling the grammar");
                d->capsets = c;
            }
            memcpy(d->sets + d->nsets, d->tmp, (size_t)n * sizeof *d->tmp);
            d->set0[s] = (int32_t)d->nsets;
            d->nsets += n;
            d->set0[s + 1] = (int32_t)d->nsets;
            uint8_t fin = 0;
            for (int32_t k = 0; k < n; k++) fin |= a->final[d->tmp[k]];
            d->st[s] = (kvb__gstate){.e0 = -1, .rule = rule, .final = fin};
            d->slots[i] = (uint32_t)s + 1;
            d->n++;
            if ((uint32_t)d->n * 2 > d->mask) { /* grow the table */
                uint32_t nm = d->mask * 2 + 1;
                uint32_t *ns;
                if (kvb_calloc((size_t)nm + 1, sizeof *ns, (void **)&ns) != KVB_OK)
                    return kvb__gb_fail(b, KVB_ERR_NOMEM, "out of memory compiling the grammar");
                for (int32_t t = 0; t < d->n; t++) {
                    uint64_t th = hash_set(d->sets + d->set0[t], d->set0[t + 1] - d->set0[t]);
                    uint32_t j = (uint32_t)th & nm;
                    while (ns[j]) j = (j + 1) & nm;
                    ns[j] = (uint32_t)t + 1;
                }
                free(d->slots);
                d->slots = ns;
                d->mask = nm;
            }
            return s;
        }
        int32_t s = (int32_t)id - 1;
        if (d->set0[s + 1] - d->set0[s] == n && !memcmp(d->sets + d->set0[s], d->tmp, (size_t)n * sizeof *d->tmp))
            return s;
    }
}

/* Builds the transitions of state s (byte intervals and calls). */
static void dfa_expand(kvb__gb *b, const nfa *a, dfa_build *d, int32_t s) {
    int32_t rule = d->st[s].rule;
    /* the members' byte edges split 0..255 at every range end */
    uint8_t cut[257] = {0};
    int32_t lo0 = d->set0[s], hi0 = d->set0[s + 1];
    for (int32_t k = lo0; k < hi0; k++) {
        int32_t u = d->sets[k];
        for (int32_t e = a->first[u]; e < a->first[u + 1]; e++)
            if (a->e[e].kind == NE_BYTES) {
                cut[a->e[e].lo] = 1;
                cut[a->e[e].hi + 1] = 1;
            }
    }
    int32_t e0 = d->ne;
    for (int lo = 0; lo < 256;) {
        int hi = lo;
        while (hi + 1 < 256 && !cut[hi + 1]) hi++;
        d->ntmp = 0;
        for (int32_t k = d->set0[s]; k < d->set0[s + 1]; k++) {
            int32_t u = d->sets[k];
            for (int32_t e = a->first[u]; e < a->first[u + 1]; e++)
                if (a->e[e].kind == NE_BYTES && a->e[e].lo <= lo && a->e[e].hi >= hi) {
                    if (!grow(b, (void **)&d->tmp, &d->captmp, d->ntmp + 1, sizeof *d->tmp)) return;
                    d->tmp[d->ntmp++] = a->e[e].to;
                }
        }
        if (d->ntmp) {
            int32_t t = dfa_intern(b, a, d, rule);
            if (t < 0) return;
            if (d->ne > e0 && d->edges[d->ne - 1].to == t && d->edges[d->ne - 1].hi + 1 == lo) {
                d->edges[d->ne - 1].hi = (uint8_t)hi;
            } else {
                if (!grow(b, (void **)&d->edges, &d->cape, d->ne + 1, sizeof *d->edges)) return;
                d->edges[d->ne++] = (kvb__gedge){(uint8_t)lo, (uint8_t)hi, t};
            }
        }
        lo = hi + 1;
    }
    /* calls, grouped by rule */
    int32_t c0 = d->nc;
    for (int32_t k = d->set0[s]; k < d->set0[s + 1]; k++) {
        int32_t u = d->sets[k];
        for (int32_t e = a->first[u]; e < a->first[u + 1]; e++) {
            int32_t r = a->e[e].kind;
            if (r < 0) continue;
            int seen = 0;
            for (int32_t c = c0; c < d->nc; c++) seen |= d->calls[c].rule == r;
            if (seen) continue;
            d->ntmp = 0;
            for (int32_t k2 = k; k2 < d->set0[s + 1]; k2++) {
                int32_t u2 = d->sets[k2];
                for (int32_t e2 = a->first[u2]; e2 < a->first[u2 + 1]; e2++)
                    if (a->e[e2].kind == r) {
                        if (!grow(b, (void **)&d->tmp, &d->captmp, d->ntmp + 1, sizeof *d->tmp)) return;
                        d->tmp[d->ntmp++] = a->e[e2].to;
                    }
            }
            int32_t t = dfa_intern(b, a, d, rule);
            if (t < 0) return;
            if (!grow(b, (void **)&d->calls, &d->capc, d->nc + 1, sizeof *d->calls)) return;
            d->calls[d->nc++] = (kvb__gcall){r, t};
        }
    }
    d->st[s].e0 = e0;
    d->st[s].ne = d->ne - e0;
    d->st[s].c0 = c0;
    d->st[s].nc = d->nc - c0;
}

static void dfa_free(dfa_build *d) {
    free(d->sets);
    free(d->set0);
    free(d->slots);
    free(d->st);
    free(d->edges);
    free(d->calls);
    free(d->mark);
    free(d->stack);
    free(d->tmp);
}

/* ------------------------------------------------------------------------------------- checks and trimming */

/* reach[s]: a final state of s's rule can be reached from s, calling only rules in prod[]. */
static void co_reach(const kvb_grammar *g, const uint8_t *prod, uint8_t *reach, int with_bytes) {
    memset(reach, 0, (size_t)g->n_states);
    for (int32_t s = 0; s < g->n_states; s++) reach[s] = g->states[s].final;
    for (int changed = 1; changed;) { /* a few passes: states are numbered roughly in reach order */
        changed = 0;
        for (int32_t s = g->n_states - 1; s >= 0; s--) {
            if (reach[s]) continue;
            const kvb__gstate *st = &g->states[s];
            int r = 0;
            for (int32_t e = 0; with_bytes && !r && e < st->ne; e++) r = reach[g->edges[st->e0 + e].to];
            for (int32_t c = 0; !r && c < st->nc; c++) {
                const kvb__gcall *k = &g->calls[st->c0 + c];
                r = prod[k->rule] && reach[k->to];
            }
            if (r) reach[s] = 1, changed = 1;
        }
    }
}

/* Drops what can never finish: calls of rules with no finite output and transitions into states from
 * which the rule cannot end, so that every state a matcher can reach has a way to complete. Refuses a
 * root with no finite output and left recursion (a rule that calls itself before any byte). */
static kvb_status trim(kvb_grammar *g, char *err, size_t err_len) {
    kvb_status st = KVB_OK;
    uint8_t *prod = NULL, *reach = NULL, *nullable = NULL, *color = NULL;
    int32_t *adj = NULL, *seen = NULL, *stack = NULL, *first = NULL, *path = NULL;
    int32_t n_adj = 0, cap_adj = 0;
    KVB_TRY_GOTO(kvb_calloc((size_t)g->n_rules, 1, (void **)&prod), done);
    KVB_TRY_GOTO(kvb_calloc((size_t)g->n_states + 1, 1, (void **)&reach), done);
    KVB_TRY_GOTO(kvb_calloc((size_t)g->n_rules, 1, (void **)&nullable), done);
    for (int changed = 1; changed;) {
        changed = 0;
        co_reach(g, prod, reach, 1);
        for (int32_t r = 0; r < g->n_rules; r++)
            if (!prod[r] && reach[g->rule_start[r]]) prod[r] = 1, changed = 1;
    }
    if (!prod[g->root]) {
        snprintf(err, err_len, "the grammar admits no finite output (a required recursion without a base case?)");
        st = KVB_ERR_INVALID;
        goto done;
    }
    /* prune: transitions keep only targets that can still finish */
    int32_t ne = 0, nc = 0;
    for (int32_t s = 0; s < g->n_states; s++) {
        kvb__gstate *x = &g->states[s];
        int32_t e0 = ne, c0 = nc;
        for (int32_t e = 0; e < x->ne; e++)
            if (reach[g->edges[x->e0 + e].to]) g->edges[ne++] = g->edges[x->e0 + e];
        for (int32_t c = 0; c < x->nc; c++) {
            kvb__gcall k = g->calls[x->c0 + c];
            if (prod[k.rule] && reach[k.to]) g->calls[nc++] = k;
        }
        x->e0 = e0, x->ne = ne - e0, x->c0 = c0, x->nc = nc - c0;
    }
    g->n_edges = ne, g->n_calls = nc;
    /* left recursion: rules reachable at a rule's start through calls of nullable rules only */
    for (int changed = 1; changed;) {
        changed = 0;
        co_reach(g, nullable, reach, 0);
        for (int32_t r = 0; r < g->n_rules; r++)
            if (!nullable[r] && reach[g->rule_start[r]]) nullable[r] = 1, changed = 1;
    }
    /* left-call edges r -> q as a CSR graph, then a depth-first search for a cycle */
    KVB_TRY_GOTO(kvb_calloc((size_t)g->n_states + 1, sizeof *seen, (void **)&seen), done);
    KVB_TRY_GOTO(kvb_malloc(((size_t)g->n_states + 1) * sizeof *stack, (void **)&stack), done);
    KVB_TRY_GOTO(kvb_calloc((size_t)g->n_rules + 1, sizeof *first, (void **)&first), done);
    for (int32_t r = 0; r < g->n_rules; r++) {
        int32_t sp = 0;
        stack[sp++] = g->rule_start[r];
        seen[g->rule_start[r]] = r + 1;
        while (sp) {
            const kvb__gstate *x = &g->states[stack[--sp]];
            for (int32_t c = 0; c < x->nc; c++) {
                kvb__gcall k = g->calls[x->c0 + c];
                if (n_adj == cap_adj) {
                    cap_adj = cap_adj ? cap_adj * 2 : 64;
                    KVB_TRY_GOTO(kvb_realloc_array((void **)&adj, (size_t)cap_adj, sizeof *adj), done);
                }
                adj[n_adj++] = k.rule;
                first[r + 1]++;
                if (nullable[k.rule] && seen[k.to] != r + 1) {
                    seen[k.to] = r + 1;
                    stack[sp++] = k.to;
                }
            }
        }
    }
    for (int32_t r = 0; r < g->n_rules; r++) first[r + 1] += first[r];
    /* colors: 0 unseen, 1 on the path, 2 done; stack holds (rule, next edge) pairs */
    KVB_TRY_GOTO(kvb_calloc((size_t)g->n_rules + 1, 1, (void **)&color), done);
    KVB_TRY_GOTO(kvb_malloc(((size_t)g->n_rules + 1) * 2 * sizeof *path, (void **)&path), done);
    for (int32_t r0 = 0; r0 < g->n_rules; r0++) {
        if (color[r0]) continue;
        int32_t sp = 0;
        path[0] = r0, path[1] = first[r0], sp = 1;
        color[r0] = 1;
        while (sp) {
            int32_t r = path[2 * (sp - 1)], *next = &path[2 * (sp - 1) + 1];
            if (*next == first[r + 1]) {
                color[r] = 2;
                sp--;
                continue;
            }
            int32_t q = adj[(*next)++];
            if (color[q] == 1) {
                snprintf(err, err_len, "the grammar is left-recursive (a rule or $ref that refers to itself before "
                                       "any output)");
                st = KVB_ERR_INVALID;
                goto done;
            }
            if (!color[q]) {
                color[q] = 1;
                path[2 * sp] = q, path[2 * sp + 1] = first[q], sp++;
            }
        }
    }
done:
    if (st == KVB_ERR_NOMEM) snprintf(err, err_len, "out of memory compiling the grammar");
    free(prod);
    free(reach);
    free(nullable);
    free(color);
    free(adj);
    free(seen);
    free(stack);
    free(first);
    free(path);
    return st;
}

/* ------------------------------------------------------------------------------------- compile */

static int32_t part_expr(kvb__gb *b, const kvb_grammar_part *p) {
    switch (p->kind) {
    case KVB_GRAMMAR_LITERAL: return kvb__gx_lit(b, p->text, p->len);
    case KVB_GRAMMAR_JSON: return kvb__gx_json_value(b);
    case KVB_GRAMMAR_JSON_OBJECT: return kvb__gx_json_object(b);
    case KVB_GRAMMAR_JSON_SCHEMA: return kvb__gx_json_schema(b, p->text, p->len);
    case KVB_GRAMMAR_REGEX: return kvb__gx_regex(b, p->text, p->len, KVB__RX_RAW, 0);
    case KVB_GRAMMAR_CHOICE: {
        if (p->n_choices <= 0 || !p->choices) return kvb__gb_fail(b, KVB_ERR_INVALID, "a choice of no strings");
        int32_t *alts;
        if (kvb_malloc((size_t)p->n_choices * sizeof *alts, (void **)&alts) != KVB_OK)
            return kvb__gb_fail(b, KVB_ERR_NOMEM, "out of memory compiling the grammar");
        for (int i = 0; i < p->n_choices; i++)
            alts[i] = p->choices[i] ? kvb__gx_lit(b, p->choices[i], strlen(p->choices[i]))
                                    : kvb__gb_fail(b, KVB_ERR_INVALID, "choice %d is null", i);
        int32_t r = kvb__gx_alt(b, alts, p->n_choices);
        free(alts);
        return r;
    }
    }
    return kvb__gb_fail(b, KVB_ERR_INVALID, "unknown grammar part kind %d", (int)p->kind);
}

static kvb_status build_automaton(kvb__gb *b, kvb_grammar *g) {
    nfa a = {0};
    dfa_build d = {0};
    int32_t *nstart = NULL;
    kvb_status st = KVB_OK;
    for (int32_t r = 0; r < b->n_rules; r++)
        if (b->rule_body[r] < 0) return kvb__gb_fail(b, KVB_ERR_INVALID, "rule %d has no body", r), b->st;
    if (kvb_malloc((size_t)b->n_rules * sizeof *nstart, (void **)&nstart) != KVB_OK) {
        kvb__gb_fail(b, KVB_ERR_NOMEM, "out of memory compiling the grammar");
        return b->st;
    }
    for (int32_t r = 0; r < b->n_rules && b->st == KVB_OK; r++) {
        nstart[r] = nfa_node(b, &a, r);
        int32_t end = nfa_build(b, &a, b->rule_body[r], nstart[r], r);
        if (end >= 0) a.final[end] = 1;
    }
    if (b->st != KVB_OK || !nfa_index(b, &a)) goto done;
    if (kvb_calloc((size_t)a.n, sizeof *d.mark, (void **)&d.mark) != KVB_OK ||
        kvb_malloc((size_t)a.n * sizeof *d.stack, (void **)&d.stack) != KVB_OK ||
        kvb_calloc(1024, sizeof *d.slots, (void **)&d.slots) != KVB_OK) {
        kvb__gb_fail(b, KVB_ERR_NOMEM, "out of memory compiling the grammar");
        goto done;
    }
    d.mask = 1023;
    KVB_TRY_GOTO(kvb_malloc((size_t)b->n_rules * sizeof *g->rule_start, (void **)&g->rule_start), nomem);
    g->n_rules = b->n_rules;
    for (int32_t r = 0; r < b->n_rules && b->st == KVB_OK; r++) {
        d.ntmp = 0;
        if (!grow(b, (void **)&d.tmp, &d.captmp, 1, sizeof *d.tmp)) break;
        d.tmp[d.ntmp++] = nstart[r];
        int32_t s0 = dfa_intern(b, &a, &d, r);
        g->rule_start[r] = s0;
        /* states are expanded in creation order: everything after s0 that is not expanded yet */
        for (int32_t s = s0; s >= 0 && s < d.n && b->st == KVB_OK; s++)
            if (d.st[s].e0 < 0) dfa_expand(b, &a, &d, s);
    }
    if (b->st != KVB_OK) goto done;
    g->states = d.st, g->n_states = d.n, d.st = NULL;
    g->edges = d.edges, g->n_edges = d.ne, d.edges = NULL;
    g->calls = d.calls, g->n_calls = d.nc, d.calls = NULL;
    goto done;
nomem:
    kvb__gb_fail(b, st, "out of memory compiling the grammar");
done:
    free(nstart);
    nfa_free(&a);
    dfa_free(&d);
    return b->st;
}

static void grammar_free(kvb_grammar *g) {
    if (!g) return;
    kvb__grammar_tables_free(g);
    pthread_mutex_destroy(&g->lock);
    free(g->states);
    free(g->edges);
    free(g->calls);
    free(g->rule_start);
    free(g);
}

kvb_status kvb_grammar_compile(const kvb_grammar_vocab *v, const kvb_grammar_part *parts, int n_parts,
                               const kvb_grammar_opts *opts, kvb_grammar **out, char *err, size_t err_len) {
    char dummy[8];
    if (!err || !err_len) err = dummy, err_len = sizeof dummy;
    err[0] = 0;
    *out = NULL;
    if (!v || (!parts && n_parts) || n_parts < 0) {
        snprintf(err, err_len, "no vocabulary or parts");
        return KVB_ERR_INVALID;
    }
    kvb__gb b = {0};
    if (opts) b.opts = *opts;
    else kvb_grammar_opts_default(&b.opts);
    if (b.opts.max_states <= 0 || b.opts.max_depth <= 0 || b.opts.max_schema_depth <= 0 || b.opts.ws_indent < -1) {
        snprintf(err, err_len, "bad grammar options");
        return KVB_ERR_INVALID;
    }
    kvb_grammar *g;
    kvb_status st = kvb_calloc(1, sizeof *g, (void **)&g);
    if (st != KVB_OK) {
        snprintf(err, err_len, "out of memory compiling the grammar");
        return st;
    }
    pthread_mutex_init(&g->lock, NULL);
    g->refs = 1;
    g->v = v;
    g->opts = b.opts;
    int32_t root = kvb__gb_rule_new(&b);
    int32_t *xs = NULL;
    if (kvb_malloc(((size_t)n_parts + 1) * sizeof *xs, (void **)&xs) != KVB_OK)
        kvb__gb_fail(&b, KVB_ERR_NOMEM, "out of memory compiling the grammar");
    for (int i = 0; i < n_parts && b.st == KVB_OK; i++) xs[i] = part_expr(&b, &parts[i]);
    if (b.st == KVB_OK) kvb__gb_rule_set(&b, root, kvb__gx_seq(&b, xs, n_parts));
    free(xs);
    g->root = root;
    if (b.st == KVB_OK) build_automaton(&b, g);
    st = b.st;
    if (st != KVB_OK) snprintf(err, err_len, "%s", b.err);
    else st = trim(g, err, err_len);
    gb_free(&b);
    if (st == KVB_OK) KVB_TRY_GOTO(kvb_calloc((size_t)g->n_states, sizeof *g->tables, (void **)&g->tables), fail);
    if (st != KVB_OK) goto fail;
    *out = g;
    return KVB_OK;
fail:
    if (st == KVB_ERR_NOMEM && !err[0]) snprintf(err, err_len, "out of memory compiling the grammar");
    grammar_free(g);
    return st;
}

kvb_grammar *kvb_grammar_retain(kvb_grammar *g) {
    if (g) __atomic_add_fetch(&g->refs, 1, __ATOMIC_RELAXED);
    return g;
}

void kvb_grammar_release(kvb_grammar *g) {
    if (g && __atomic_sub_fetch(&g->refs, 1, __ATOMIC_ACQ_REL) == 0) grammar_free(g);
}

/* ------------------------------------------------------------------------------------- cache */

typedef struct cache_entry {
    char *key; /* the parts and options, serialized */
    size_t key_len;
    kvb_grammar *g;
    uint64_t used; /* last use (the cache's clock) */
} cache_entry;

struct kvb_grammar_cache {
    const kvb_grammar_vocab *v;
    pthread_mutex_t lock;
    cache_entry *e; /* [cap], key NULL: free */
    int cap;
    uint64_t clock, hits, misses;
};

kvb_status kvb_grammar_cache_create(const kvb_grammar_vocab *v, int capacity, kvb_grammar_cache **out) {
    if (!v || capacity <= 0) return KVB_ERR_INVALID;
    kvb_grammar_cache *c;
    KVB_TRY(kvb_calloc(1, sizeof *c, (void **)&c));
    if (kvb_calloc((size_t)capacity, sizeof *c->e, (void **)&c->e) != KVB_OK) {
        free(c);
        return KVB_ERR_NOMEM;
    }
    pthread_mutex_init(&c->lock, NULL);
    c->v = v;
    c->cap = capacity;
    *out = c;
    return KVB_OK;
}

static kvb_status key_put(kvb_buf *k, const void *p, size_t n) {
    uint64_t len = n;
    KVB_TRY(kvb__buf_append(k, &len, sizeof len));
    return n ? kvb__buf_append(k, p, n) : KVB_OK;
}

/* Length-prefixed fields: two different part lists never serialize alike. */
static kvb_status cache_key(const kvb_grammar_part *parts, int n, const kvb_grammar_opts *o, kvb_buf *k) {
    int64_t f[] = {o->ws_indent, o->max_depth, o->max_states, o->max_schema_depth, o->strict, (int64_t)o->max_table_bytes};
    KVB_TRY(key_put(k, f, sizeof f)); /* field by field: the struct's padding is not part of the key */
    for (int i = 0; i < n; i++) {
        int32_t kind = parts[i].kind;
        KVB_TRY(key_put(k, &kind, sizeof kind));
        if (parts[i].kind == KVB_GRAMMAR_CHOICE) {
            KVB_TRY(key_put(k, &parts[i].n_choices, sizeof parts[i].n_choices));
            for (int j = 0; j < parts[i].n_choices && parts[i].choices; j++)
                KVB_TRY(key_put(k, parts[i].choices[j], parts[i].choices[j] ? strlen(parts[i].choices[j]) : 0));
        } else {
            KVB_TRY(key_put(k, parts[i].text, parts[i].text ? parts[i].len : 0));
        }
    }
    return KVB_OK;
}

kvb_status kvb_grammar_cache_get(kvb_grammar_cache *c, const kvb_grammar_part *parts, int n_parts,
                                 const kvb_grammar_opts *opts, kvb_grammar **out, char *err, size_t err_len) {
    kvb_grammar_opts o;
    if (opts) o = *opts;
    else kvb_grammar_opts_default(&o);
    *out = NULL;
    if (n_parts < 0 || (!parts && n_parts)) return KVB_ERR_INVALID;
    kvb_buf key = {0};
    kvb_status st = cache_key(parts, n_parts, &o, &key);
    if (st != KVB_OK) {
        kvb__buf_free(&key);
        if (err && err_len) snprintf(err, err_len, "out of memory");
        return st;
    }
    pthread_mutex_lock(&c->lock);
    for (int i = 0; i < c->cap; i++) {
        cache_entry *e = &c->e[i];
        if (e->key && e->key_len == key.len && !memcmp(e->key, key.p, key.len)) {
            e->used = ++c->clock;
            c->hits++;
            *out = kvb_grammar_retain(e->g);
            pthread_mutex_unlock(&c->lock);
            kvb__buf_free(&key);
            return KVB_OK;
        }
    }
    c->misses++;
    pthread_mutex_unlock(&c->lock);
    /* compiled outside the lock: a long compile never holds up other requests' lookups */
    kvb_grammar *g;
    st = kvb_grammar_compile(c->v, parts, n_parts, &o, &g, err, err_len);
    if (st != KVB_OK) {
        kvb__buf_free(&key);
        return st;
    }
    pthread_mutex_lock(&c->lock);
    int victim = 0;
    for (int i = 0; i < c->cap; i++) {
        if (!c->e[i].key) {
            victim = i;
            break;
        }
        if (c->e[i].used < c->e[victim].used) victim = i;
    }
    cache_entry *e = &c->e[victim];
    kvb_grammar *old = e->key ? e->g : NULL;
    free(e->key);
    e->key = key.p;
    e->key_len = key.len;
    e->g = kvb_grammar_retain(g);
    e->used = ++c->clock;
    pthread_mutex_unlock(&c->lock);
    kvb_grammar_release(old);
    *out = g;
    return KVB_OK;
}

void kvb_grammar_cache_stats(kvb_grammar_cache *c, uint64_t *hits, uint64_t *misses) {
    pthread_mutex_lock(&c->lock);
    if (hits) *hits = c->hits;
    if (misses) *misses = c->misses;
    pthread_mutex_unlock(&c->lock);
}

void kvb_grammar_cache_destroy(kvb_grammar_cache *c) {
    if (!c) return;
    for (int i = 0; i < c->cap; i++)
        if (c->e[i].key) {
            free(c->e[i].key);
            kvb_grammar_release(c->e[i].g);
        }
    pthread_mutex_destroy(&c->lock);
    free(c->e);
    free(c);
}
