/* kvbank — what the files of the grammar module share (internal): the expression builder the front ends
 * (grammar_json.c, grammar_regex.c) write into, and the compiled automaton grammar_match.c runs. */
#ifndef KVB_TEXT_GRAMMAR_IMPL_H
#define KVB_TEXT_GRAMMAR_IMPL_H

#include <pthread.h>
#include <stdint.h>

#include "common/text/grammar.h"

/* ------------------------------------------------------------------------ expressions (front ends) */

/* An expression over bytes: the front ends build a tree of these per rule; grammar.c turns each rule's
 * tree into a deterministic automaton. Ids index kvb__gb.x; -1 is "failed" (the builder holds why) and
 * every constructor passes a -1 argument through, so a front end checks once at the end. */
enum {
    KVB__GX_EMPTY,  /* the empty string */
    KVB__GX_BYTES,  /* one byte in [lo, hi] */
    KVB__GX_SEQ,    /* kids one after the other */
    KVB__GX_ALT,    /* one of the kids */
    KVB__GX_REPEAT, /* kid a, min..max times (max -1: unbounded) */
    KVB__GX_CALL,   /* rule a (its own automaton, entered with a push: recursion) */
    KVB__GX_LIST,   /* kids[a] is a separator, kids[a+1 ..] the elements in order; an element written as
                     * REPEAT{0,1} may be left out, one written as REPEAT{0,-1} may come any number of
                     * times; the separator goes between the elements present (a JSON object's
                     * properties: linear in the elements, where nested options would be exponential) */
};

typedef struct kvb__gx {
    uint8_t kind, lo, hi;
    int32_t a, n;     /* SEQ / ALT: kids[a .. a+n); REPEAT: kid a; CALL: rule a */
    int32_t min, max; /* REPEAT */
    int64_t size;     /* automaton nodes this expression expands to (capped), to refuse blow-ups early */
} kvb__gx;

typedef struct kvb__gb {
    kvb__gx *x;
    int32_t nx, capx;
    int32_t *kids; /* children lists of SEQ / ALT */
    int32_t nk, capk;
    int32_t *rule_body; /* [n_rules] expression of each rule, -1 until set */
    int32_t n_rules, cap_rules;
    kvb_grammar_opts opts;
    int32_t json_rules[2]; /* any JSON object / array as rules (id + 1; 0: not made yet) */
    kvb_status st; /* first failure */
    char err[256];
} kvb__gb;

/* Records the first failure (st, printf message) and returns -1. */
int32_t kvb__gb_fail(kvb__gb *b, kvb_status st, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
int32_t kvb__gx_empty(kvb__gb *b);
int32_t kvb__gx_range(kvb__gb *b, int lo, int hi);
int32_t kvb__gx_lit(kvb__gb *b, const void *s, size_t n);
int32_t kvb__gx_seq(kvb__gb *b, const int32_t *kids, int n);
int32_t kvb__gx_alt(kvb__gb *b, const int32_t *kids, int n);
int32_t kvb__gx_seq2(kvb__gb *b, int32_t x, int32_t y);
int32_t kvb__gx_alt2(kvb__gb *b, int32_t x, int32_t y);
int32_t kvb__gx_repeat(kvb__gb *b, int32_t x, int min, int max);
int32_t kvb__gx_opt(kvb__gb *b, int32_t x);
int32_t kvb__gx_call(kvb__gb *b, int32_t rule);
/* A KVB__GX_LIST (see above): elems[n] separated by sep. */
int32_t kvb__gx_list(kvb__gb *b, int32_t sep, const int32_t *elems, int n);
/* A new rule without a body yet (recursion refers to it before it is built); its id, or -1. */
int32_t kvb__gb_rule_new(kvb__gb *b);
void kvb__gb_rule_set(kvb__gb *b, int32_t rule, int32_t x);

/* One code point of the set ranges[n][2] (inclusive, within 0..0x10FFFF; surrogates are dropped),
 * as its UTF-8 bytes. */
int32_t kvb__gx_codepoints(kvb__gb *b, const uint32_t (*ranges)[2], int n);

/* How a regex's characters are written: as their UTF-8 bytes (guided_regex), or as they appear inside
 * a JSON string (a JSON Schema pattern: '"', '\' and control characters escaped). */
enum { KVB__RX_RAW, KVB__RX_JSON };
/* pattern[0..len) -> an expression matching exactly the strings the pattern matches in full. With
 * `search` (JSON Schema's pattern) the match may be anywhere unless the pattern is anchored. */
int32_t kvb__gx_regex(kvb__gb *b, const char *pattern, size_t len, int mode, int search);
/* One character inside a JSON string (unescaped UTF-8 or an escape), as JSON allows it. */
int32_t kvb__gx_json_char(kvb__gb *b);
/* Any JSON value / any JSON object. */
int32_t kvb__gx_json_value(kvb__gb *b);
int32_t kvb__gx_json_object(kvb__gb *b);
/* A JSON Schema's text -> the expression of the values it admits. */
int32_t kvb__gx_json_schema(kvb__gb *b, const char *text, size_t len);

/* ------------------------------------------------------------------------ the compiled automaton */

typedef struct kvb__gedge {
    uint8_t lo, hi; /* bytes lo..hi lead to `to`; a state's edges are sorted and disjoint */
    int32_t to;
} kvb__gedge;

typedef struct kvb__gcall {
    int32_t rule; /* push: run `rule` from its start, then continue at `to` */
    int32_t to;
} kvb__gcall;

typedef struct kvb__gstate {
    int32_t e0, ne; /* edges[e0 .. e0+ne) */
    int32_t c0, nc; /* calls[c0 .. c0+nc) */
    int32_t rule;
    uint8_t final; /* the rule may end here (pop) */
} kvb__gstate;

/* The context-independent part of a state's mask (grammar_match.c): tokens accepted without leaving
 * the state's rule, and the tokens that can only be decided with the stack under it. */
typedef struct kvb__gtable kvb__gtable;

struct kvb_grammar {
    int refs; /* atomic */
    const kvb_grammar_vocab *v;
    kvb_grammar_opts opts;
    kvb__gstate *states; /* [n_states] */
    int32_t n_states;
    kvb__gedge *edges;
    int32_t n_edges;
    kvb__gcall *calls;
    int32_t n_calls;
    int32_t *rule_start; /* [n_rules] */
    int32_t n_rules;
    int32_t root; /* the rule the output is */
    pthread_mutex_t lock; /* guards tables */
    kvb__gtable **tables; /* [n_states] built on first use */
    size_t table_bytes;
};

void kvb__grammar_tables_free(kvb_grammar *g);

#endif
