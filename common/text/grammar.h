/* kvbank — structured output: constrained decoding by a grammar over a tokenizer's vocabulary.
 *
 * A grammar is a sequence of parts (a literal, any JSON / a JSON object, a JSON Schema, a regex, one of
 * N strings) compiled into rules of deterministic automata over bytes that may call each other (a
 * pushdown automaton: recursive JSON and recursive $ref need a stack). A matcher follows one output
 * byte by byte; per decoding step it fills the mask of token ids whose whole byte string can come next
 * (EOS only when the output so far is complete). docs/grammar.md has the design and the numbers.
 *
 * Typical use in a model process:
 *   kvb_grammar_vocab_from_tokenizer(tok, &vocab);             once per model
 *   kvb_grammar_cache_create(vocab, 64, &cache);               once per model
 *   kvb_grammar_cache_get(cache, parts, n, NULL, &g, err, n);  per request (compiled once per schema text)
 *   kvb_grammar_matcher_create(g, &m); kvb_grammar_release(g); per sequence (the matcher holds g)
 *   per step: kvb_grammar_matcher_fill_mask(m, mask); kvb_grammar_mask_apply(vocab, mask, logits, n_logits);
 *             sample; kvb_grammar_matcher_accept_token(m, id); stop when kvb_grammar_matcher_done(m).
 *
 * Threads: a vocabulary, a compiled grammar and the cache may be used from several threads at once
 * (a grammar builds its mask tables lazily under its own lock); one matcher from one thread at a time. */
#ifndef KVB_TEXT_GRAMMAR_H
#define KVB_TEXT_GRAMMAR_H

#include <stddef.h>
#include <stdint.h>

#include "common/text/tokenizer.h"
#include "common/util/status.h"

typedef struct kvb_grammar_vocab kvb_grammar_vocab;
typedef struct kvb_grammar kvb_grammar;
typedef struct kvb_grammar_matcher kvb_grammar_matcher;
typedef struct kvb_grammar_cache kvb_grammar_cache;

/* ------------------------------------------------------------------------------------- vocabulary */

/* The vocabulary of `t` prepared for masks: every token's bytes in a trie. Special tokens are never
 * allowed by a grammar; the EOS ids are allowed exactly when the output is complete. Borrows nothing
 * from t (the bytes are copied). Caller owns *out (kvb_grammar_vocab_destroy, after every grammar and
 * cache made with it). */
kvb_status kvb_grammar_vocab_from_tokenizer(const kvb_tokenizer *t, kvb_grammar_vocab **out);
/* The same from plain data: token i is bytes[i][0..lens[i]) (NULL or length 0: never allowed);
 * special[i] (special may be NULL) marks tokens never allowed; eos[n_eos] the EOS ids. Copies all. */
kvb_status kvb_grammar_vocab_create(int n_vocab, const char *const *bytes, const size_t *lens,
                                    const uint8_t *special, const int32_t *eos, int n_eos, kvb_grammar_vocab **out);
void kvb_grammar_vocab_destroy(kvb_grammar_vocab *v);
int kvb_grammar_vocab_size(const kvb_grammar_vocab *v);
/* uint32 words of a mask: bit (id % 32) of word (id / 32) is token id. */
size_t kvb_grammar_mask_words(const kvb_grammar_vocab *v);

/* ------------------------------------------------------------------------------------- grammars */

typedef enum kvb_grammar_kind {
    KVB_GRAMMAR_LITERAL = 0,     /* text[0..len): exactly these bytes */
    KVB_GRAMMAR_JSON = 1,        /* any JSON value */
    KVB_GRAMMAR_JSON_OBJECT = 2, /* any JSON object (response_format json_object) */
    KVB_GRAMMAR_JSON_SCHEMA = 3, /* text[0..len): a JSON Schema (the subset docs/grammar.md lists) */
    KVB_GRAMMAR_REGEX = 4,       /* text[0..len): a regex the whole part must match (guided_regex) */
    KVB_GRAMMAR_CHOICE = 5,      /* choices[n_choices] (NUL-terminated): exactly one of them */
} kvb_grammar_kind;

/* One part of a grammar; a grammar is its parts one after the other (a tool call: a literal prefix,
 * the arguments' schema, a literal suffix). Borrowed only during the call that takes it. */
typedef struct kvb_grammar_part {
    kvb_grammar_kind kind;
    const char *text; /* LITERAL, JSON_SCHEMA, REGEX: the text (not NUL-terminated) */
    size_t len;
    const char *const *choices; /* CHOICE */
    int n_choices;
} kvb_grammar_part;

typedef struct kvb_grammar_opts {
    int ws_indent;        /* whitespace between JSON tokens: none, one space, or a newline and at most this many
                           * spaces; -1: none at all (compact JSON). Bounds how long a model can spin on spaces */
    int max_depth;        /* most nested rule calls in an output (recursive JSON, recursive $ref): the mask
                           * refuses tokens that would nest deeper */
    int max_states;       /* compile limit on automaton states (KVB_ERR_EXHAUSTED past it) */
    int max_schema_depth; /* compile limit on a schema's nesting (subschemas within subschemas) */
    int strict;           /* JSON Schema objects without additionalProperties allow no other keys (as
                           * OpenAI's strict mode and xgrammar do); 0: they allow any other key */
    size_t max_table_bytes; /* mask tables a grammar keeps (bytes); past it a state's table is built
                             * again at each use (slower masks, bounded memory) */
} kvb_grammar_opts;

/* Defaults: ws_indent 16, max_depth 64, max_states 200000, max_schema_depth 64, strict 1,
 * max_table_bytes 256 MiB. */
void kvb_grammar_opts_default(kvb_grammar_opts *o);

/* Compiles parts[n_parts] for vocabulary v (opts NULL: defaults). Caller owns one reference on *out
 * (kvb_grammar_release); the grammar borrows v for its lifetime. KVB_ERR_INVALID (malformed schema or
 * regex), KVB_ERR_UNSUPPORTED (a feature kvbank does not implement, named) or KVB_ERR_EXHAUSTED (over
 * a compile limit) with the reason in err[err_len] (may be NULL). */
kvb_status kvb_grammar_compile(const kvb_grammar_vocab *v, const kvb_grammar_part *parts, int n_parts,
                               const kvb_grammar_opts *opts, kvb_grammar **out, char *err, size_t err_len);
/* References: a grammar lives until its last holder (caller, cache, matchers) releases it. */
kvb_grammar *kvb_grammar_retain(kvb_grammar *g);
void kvb_grammar_release(kvb_grammar *g); /* NULL-safe */

/* Compiled grammars by their parts' text and options, least recently used dropped past `capacity`.
 * Borrows v. */
kvb_status kvb_grammar_cache_create(const kvb_grammar_vocab *v, int capacity, kvb_grammar_cache **out);
/* A compiled grammar for the parts: from the cache, else compiled and cached (errors as
 * kvb_grammar_compile; failures are not cached). Caller owns one reference on *out. */
kvb_status kvb_grammar_cache_get(kvb_grammar_cache *c, const kvb_grammar_part *parts, int n_parts,
                                 const kvb_grammar_opts *opts, kvb_grammar **out, char *err, size_t err_len);
/* Lookups answered from the cache and compilations, since creation. */
void kvb_grammar_cache_stats(kvb_grammar_cache *c, uint64_t *hits, uint64_t *misses);
void kvb_grammar_cache_destroy(kvb_grammar_cache *c); /* releases its references; NULL-safe */

/* ------------------------------------------------------------------------------------- matching */

/* A matcher at the start of g's output; holds a reference on g. Caller owns *out. */
kvb_status kvb_grammar_matcher_create(kvb_grammar *g, kvb_grammar_matcher **out);
void kvb_grammar_matcher_destroy(kvb_grammar_matcher *m); /* NULL-safe */
/* An independent copy of m in its current state (n > 1 choices, speculative checks). */
kvb_status kvb_grammar_matcher_fork(const kvb_grammar_matcher *m, kvb_grammar_matcher **out);

/* mask[kvb_grammar_mask_words(v)]: bit set for every token that may come next (its whole byte string
 * is a continuation of the output so far; an EOS id when the output is complete). After an EOS was
 * accepted, or when the depth limit leaves no way on, the mask is empty. */
kvb_status kvb_grammar_matcher_fill_mask(kvb_grammar_matcher *m, uint32_t *mask);
/* Advances by token `id`: KVB_ERR_INVALID (m unchanged) when the mask would not allow it. An EOS id
 * ends the output (nothing is allowed after it). */
kvb_status kvb_grammar_matcher_accept_token(kvb_grammar_matcher *m, int32_t id);
/* Advances by raw bytes (a forced literal); KVB_ERR_INVALID (m unchanged) when they do not continue the
 * output. Counts as one token for rollback. */
kvb_status kvb_grammar_matcher_accept_bytes(kvb_grammar_matcher *m, const void *bytes, size_t len);
/* Undoes the last n accepted tokens (KVB_ERR_INVALID when fewer were accepted; m unchanged). */
kvb_status kvb_grammar_matcher_rollback(kvb_grammar_matcher *m, int n);
/* 1 when the output so far is a complete match (EOS allowed). */
int kvb_grammar_matcher_accepting(const kvb_grammar_matcher *m);
/* 1 when decoding should stop: an EOS was accepted, or the output is complete and nothing can follow. */
int kvb_grammar_matcher_done(const kvb_grammar_matcher *m);
/* The vocabulary m's grammar was compiled for (what kvb_grammar_mask_apply takes with m's masks). */
const kvb_grammar_vocab *kvb_grammar_matcher_vocab(const kvb_grammar_matcher *m);

/* logits[i] = -INFINITY for every token whose bit in mask (a mask of v) is clear, and for every id at or
 * past v's size (a model's logits may be wider than its tokenizer: Qwen3 151936 > 151669). */
void kvb_grammar_mask_apply(const kvb_grammar_vocab *v, const uint32_t *mask, float *logits, int n_logits);

#endif
