/* kvbank-bench — trace loading (see trace.h). */
#include "bench/trace.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#define TRACE_BLOCK 512 /* tokens per Mooncake hash block */

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int32_t token_of(uint64_t key, int i, int vocab) {
    return (int32_t)(3 + mix64(key * 0x9e3779b97f4a7c15ull + (uint64_t)i + 1) % (uint64_t)(vocab - 3));
}

static kvb_status push(kvb_trace *t, int *cap, const kvb_trace_req *r) {
    if (t->n == *cap) {
        *cap = *cap ? *cap * 2 : 1024;
        KVB_TRY(kvb_realloc_array((void **)&t->reqs, (size_t)*cap, sizeof *t->reqs));
    }
    t->reqs[t->n++] = *r;
    return KVB_OK;
}

/* Scaled lengths: prompt p, output g, with p + g <= max_len. */
static void scale_lengths(const kvb_trace_opts *o, double in, double outl, int *p, int *g) {
    int gg = (int)lround(outl * (o->out_scale > 0 ? o->out_scale : 1.0));
    gg = KVB_MAX(gg, KVB_MAX(o->min_output, 1));
    if (o->max_output > 0) gg = KVB_MIN(gg, o->max_output);
    int pp = KVB_MAX(1, (int)lround(in * o->len_scale));
    if (pp + gg > o->max_len) pp = KVB_MAX(1, o->max_len - gg);
    if (pp + gg > o->max_len) gg = KVB_MAX(1, o->max_len - pp);
    *p = pp;
    *g = gg;
}

/* A tiny open-addressing set of seen hash ids and a map prefix chain -> session. */
typedef struct idmap {
    uint64_t *keys;
    int *vals;
    size_t cap, n;
} idmap;

static int idmap_get(idmap *m, uint64_t k, int *v) {
    if (!m->cap) return 0;
    for (size_t i = mix64(k) & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
        if (m->vals[i] < 0) return 0;
        if (m->keys[i] == k) {
            if (v) *v = m->vals[i];
            return 1;
        }
    }
}

static kvb_status idmap_put(idmap *m, uint64_t k, int v) {
    if ((m->n + 1) * 2 > m->cap) {
        idmap n = {.cap = m->cap ? m->cap * 2 : 1024};
        KVB_TRY(kvb_malloc(n.cap * sizeof *n.keys, (void **)&n.keys));
        if (kvb_malloc(n.cap * sizeof *n.vals, (void **)&n.vals) != KVB_OK) {
            free(n.keys);
            return KVB_ERR_NOMEM;
        }
        for (size_t i = 0; i < n.cap; i++) n.vals[i] = -1;
        for (size_t i = 0; i < m->cap; i++)
            if (m->vals[i] >= 0) idmap_put(&n, m->keys[i], m->vals[i]);
        free(m->keys);
        free(m->vals);
        *m = n;
    }
    size_t i = mix64(k) & (m->cap - 1);
    while (m->vals[i] >= 0 && m->keys[i] != k) i = (i + 1) & (m->cap - 1);
    if (m->vals[i] < 0) m->n++;
    m->keys[i] = k;
    m->vals[i] = v;
    return KVB_OK;
}

static void idmap_free(idmap *m) {
    free(m->keys);
    free(m->vals);
}

static kvb_status load_mooncake(const char *path, const kvb_trace_opts *o, kvb_trace *t) {
    FILE *f = fopen(path, "r");
    if (!f) {
        KVB_LOG_E("%s: cannot open", path);
        return KVB_ERR_NOT_FOUND;
    }
    kvb_status st = KVB_OK;
    char *line = NULL;
    size_t lcap = 0;
    int cap = 0, lineno = 0;
    idmap sessions = {0}, seen = {0};
    uint64_t *chain = NULL; /* [n hash ids] chain[k]: hash of the request's hash ids [0, k] */
    size_t chain_cap = 0;
    int *turns = NULL, turns_cap = 0;
    int bt = KVB_MAX(1, (int)lround(TRACE_BLOCK * o->len_scale)); /* tokens per scaled hash block */
    while (getline(&line, &lcap, f) > 0) {
        lineno++;
        json_error_t err;
        json_t *j = json_loads(line, 0, &err);
        json_t *ts = j ? json_object_get(j, "timestamp") : NULL, *il = j ? json_object_get(j, "input_length") : NULL;
        json_t *ol = j ? json_object_get(j, "output_length") : NULL, *h = j ? json_object_get(j, "hash_ids") : NULL;
        if (!j || !json_is_number(ts) || !json_is_integer(il) || !json_is_integer(ol) || !json_is_array(h) ||
            json_array_size(h) == 0) {
            KVB_LOG_E("%s:%d: not a Mooncake trace record", path, lineno);
            json_decref(j);
            st = KVB_ERR_FORMAT;
            break;
        }
        kvb_trace_req r = {.t_s = json_number_value(ts) / 1000.0 / o->rate_scale};
        if (o->max_time_s > 0 && r.t_s > o->max_time_s) {
            json_decref(j);
            break;
        }
        scale_lengths(o, (double)json_integer_value(il), (double)json_integer_value(ol), &r.n_prompt, &r.max_tokens);
        /* Sessions (issue 10): a turn extends its session's previous prompt, so a request joins the
         * session one of whose prompts is the longest prefix of its own hash ids; a request that extends
         * no earlier prompt opens a session. (Grouping by the first hash id made one session of every
         * request that starts with the same system-prompt block.) */
        size_t nh0 = json_array_size(h);
        if (nh0 > chain_cap) {
            chain_cap = KVB_MAX(nh0, 2 * chain_cap);
            if ((st = kvb_realloc_array((void **)&chain, chain_cap, sizeof *chain)) != KVB_OK) {
                json_decref(j);
                break;
            }
        }
        for (size_t k = 0; k < nh0; k++)
            chain[k] = mix64((k ? chain[k - 1] : 0x9e3779b97f4a7c15ull) ^ (uint64_t)json_integer_value(json_array_get(h, k)));
        int is_new = 1;
        for (size_t k = nh0; k-- > 0 && is_new;)
            if (idmap_get(&sessions, chain[k], &r.session)) is_new = 0;
        if (is_new) r.session = t->n_sessions++;
        if ((st = idmap_put(&sessions, chain[nh0 - 1], r.session)) != KVB_OK) {
            json_decref(j);
            break;
        }
        if (r.session >= turns_cap) {
            turns_cap = KVB_MAX(1024, turns_cap * 2);
            if ((st = kvb_realloc_array((void **)&turns, (size_t)turns_cap, sizeof *turns)) != KVB_OK) break;
        }
        if (is_new) turns[r.session] = 0;
        r.turn = turns[r.session]++;
        if ((st = kvb_malloc((size_t)r.n_prompt * sizeof(int32_t), (void **)&r.prompt)) != KVB_OK) break;
        size_t nh = json_array_size(h);
        int reuse_open = 1;
        for (int i = 0; i < r.n_prompt; i++) {
            size_t b = (size_t)(i / bt);
            uint64_t key;
            if (b < nh) {
                key = (uint64_t)json_integer_value(json_array_get(h, b));
                if (i % bt == 0) {
                    int dummy;
                    int hit = idmap_get(&seen, key, &dummy);
                    reuse_open = reuse_open && hit;
                    if (!hit && (st = idmap_put(&seen, key, 1)) != KVB_OK) break;
                }
                if (reuse_open) r.reused_tokens++;
            } else {
                key = ~(uint64_t)(t->n) * 0x100000001b3ull; /* tail beyond the hash blocks: unique */
            }
            r.prompt[i] = token_of(key, i % bt, o->vocab);
        }
        json_decref(j);
        if (st != KVB_OK || (st = push(t, &cap, &r)) != KVB_OK) {
            free(r.prompt);
            break;
        }
        if (o->max_requests && t->n >= o->max_requests) break;
    }
    free(line);
    free(turns);
    free(chain);
    idmap_free(&sessions);
    idmap_free(&seen);
    fclose(f);
    return st;
}

static int parse_azure_time(const char *s, double *out) {
    struct tm tm = {0};
    double frac = 0;
    const char *rest = strptime(s, "%Y-%m-%d %H:%M:%S", &tm);
    if (!rest) return -1;
    if (*rest == '.') frac = strtod(rest, NULL);
    *out = (double)timegm(&tm) + frac;
    return 0;
}

static kvb_status load_azure(const char *path, const kvb_trace_opts *o, kvb_trace *t) {
    FILE *f = fopen(path, "r");
    if (!f) {
        KVB_LOG_E("%s: cannot open", path);
        return KVB_ERR_NOT_FOUND;
    }
    kvb_status st = KVB_OK;
    char line[256];
    int cap = 0, lineno = 0;
    double t0 = -1;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        if (lineno == 1) {
            if (strncmp(line, "TIMESTAMP,ContextTokens,GeneratedTokens", 39)) {
                KVB_LOG_E("%s:1: not an Azure LLM inference trace header", path);
                st = KVB_ERR_FORMAT;
                break;
            }
            continue;
        }
        char *c1 = strchr(line, ','), *c2 = c1 ? strchr(c1 + 1, ',') : NULL;
        double ts;
        if (!c2) {
            KVB_LOG_E("%s:%d: expected 3 fields", path, lineno);
            st = KVB_ERR_FORMAT;
            break;
        }
        *c1 = 0;
        long in = strtol(c1 + 1, NULL, 10), outl = strtol(c2 + 1, NULL, 10);
        if (parse_azure_time(line, &ts) || in <= 0 || outl < 0) {
            KVB_LOG_E("%s:%d: bad record", path, lineno);
            st = KVB_ERR_FORMAT;
            break;
        }
        if (t0 < 0) t0 = ts;
        kvb_trace_req r = {.t_s = (ts - t0) / o->rate_scale, .session = -1};
        if (o->max_time_s > 0 && r.t_s > o->max_time_s) break;
        scale_lengths(o, (double)in, (double)outl, &r.n_prompt, &r.max_tokens);
        if ((st = kvb_malloc((size_t)r.n_prompt * sizeof(int32_t), (void **)&r.prompt)) != KVB_OK) break;
        for (int i = 0; i < r.n_prompt; i++) r.prompt[i] = token_of(0xa2u + (uint64_t)lineno * 7919u, i, o->vocab);
        if ((st = push(t, &cap, &r)) != KVB_OK) {
            free(r.prompt);
            break;
        }
        if (o->max_requests && t->n >= o->max_requests) break;
    }
    fclose(f);
    return st;
}

static int by_time(const void *a, const void *b) {
    double x = ((const kvb_trace_req *)a)->t_s, y = ((const kvb_trace_req *)b)->t_s;
    return (x > y) - (x < y);
}

kvb_status kvb_trace_load(const char *path, const kvb_trace_opts *o, kvb_trace **out) {
    if (o->rate_scale <= 0 || o->len_scale <= 0 || o->vocab < 4 || o->max_len < 2) return KVB_ERR_INVALID;
    kvb_trace *t = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *t, (void **)&t));
    size_t n = strlen(path);
    kvb_status st;
    if (n > 6 && !strcmp(path + n - 6, ".jsonl")) st = load_mooncake(path, o, t);
    else if (n > 4 && !strcmp(path + n - 4, ".csv")) st = load_azure(path, o, t);
    else {
        KVB_LOG_E("%s: unknown trace format (expected .jsonl Mooncake or .csv Azure)", path);
        st = KVB_ERR_UNSUPPORTED;
    }
    if (st != KVB_OK || t->n == 0) {
        if (st == KVB_OK) {
            KVB_LOG_E("%s: no requests", path);
            st = KVB_ERR_FORMAT;
        }
        kvb_trace_free(t);
        return st;
    }
    qsort(t->reqs, (size_t)t->n, sizeof *t->reqs, by_time);
    *out = t;
    return KVB_OK;
}

void kvb_trace_free(kvb_trace *t) {
    if (!t) return;
    for (int i = 0; i < t->n; i++) free(t->reqs[i].prompt);
    free(t->reqs);
    free(t);
}
