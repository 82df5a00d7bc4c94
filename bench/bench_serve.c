/* kvbank-bench serve — an HTTP load generator against kvbank-gateway (like vLLM's `bench serve`), and
 * the gateway's overhead against talking to the model's ZeroMQ endpoint directly, in the same run.
 *
 * A trace (../shared/traces: arrival times and lengths) is replayed open loop, streaming, greedy with
 * ignore_eos (every request produces exactly its trace's output length), once through the gateway
 * (curl's multi interface on one thread; every server-sent event's tokens count at the moment the event
 * arrived) and once straight to the model's endpoint (kvb_client, one DEALER, all requests at once),
 * alternating which goes first over --reps repetitions. Per run: TTFT (from the scheduled arrival),
 * TPOT ((last - first) / (n - 1)), ITL (every gap) percentiles, goodput (requests per second meeting
 * both SLOs), failures. The table gives each number's median over the repetitions with its spread
 * [min, max], and the gateway's overhead at p50: TTFT added in ms, TPOT added in % (targets: < 1 ms and
 * < 2 %). Nothing here asserts a time. */
#include <curl/curl.h>
#include <getopt.h>
#include <math.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench.h"
#include "bench/trace.h"
#include "common/ipc/client.h"
#include "common/model/config.h"
#include "common/util/node_config.h"
#include "common/util/progress.h"

typedef struct rec {
    uint64_t arrival_ns;  /* scheduled */
    uint64_t *tok_ns;     /* [max_tokens] when the client saw each token */
    int n_tok;
    int failed;
    int done;
    /* HTTP */
    CURL *easy;
    char *body;
    char *sse;            /* unparsed SSE bytes [sse_len] */
    size_t sse_len, sse_cap;
    int saw_done;
    struct curl_slist *hdr;
} rec;

typedef struct run_stats {
    double ttft[3], tpot[3], itl[3]; /* p50, p90, p99 (ms) */
    double goodput;                  /* requests meeting both SLOs per second */
    double tok_s;
    int failed, n;
} run_stats;

typedef struct serve_opts {
    const char *url;
    const char *model;
    const char *endpoint;
    double slo_ttft_ms, slo_tpot_ms;
    int timeout_s;
} serve_opts;

/* --------------------------------------------------------------------------------------- records */

static void rec_reset(rec *r, int n) {
    for (int i = 0; i < n; i++) {
        r[i].n_tok = r[i].failed = r[i].done = r[i].saw_done = 0;
        r[i].sse_len = 0;
    }
}

static void rec_token(rec *r, int max, uint64_t t) {
    if (r->n_tok < max) r->tok_ns[r->n_tok] = t;
    r->n_tok++;
}

static void stats_of(const rec *r, const kvb_trace *tr, const serve_opts *o, uint64_t t0, run_stats *st) {
    int n = tr->n, n_gap = 0;
    for (int i = 0; i < n; i++) n_gap += r[i].n_tok > 1 ? r[i].n_tok - 1 : 0;
    double *a = calloc((size_t)n + 1, sizeof *a), *b = calloc((size_t)n + 1, sizeof *b);
    double *g = calloc((size_t)n_gap + 1, sizeof *g);
    int na = 0, nb = 0, ng = 0, good = 0;
    long toks = 0;
    uint64_t end = t0;
    memset(st, 0, sizeof *st);
    st->n = n;
    for (int i = 0; i < n; i++) {
        const rec *x = &r[i];
        int want = tr->reqs[i].max_tokens;
        if (x->failed || x->n_tok != want) {
            st->failed++;
            continue;
        }
        double ttft = (double)(int64_t)(x->tok_ns[0] - x->arrival_ns) / 1e6;
        a[na++] = ttft;
        double tpot = 0;
        if (x->n_tok > 1) {
            tpot = (double)(x->tok_ns[x->n_tok - 1] - x->tok_ns[0]) / 1e6 / (x->n_tok - 1);
            b[nb++] = tpot;
            for (int k = 1; k < x->n_tok; k++) g[ng++] = (double)(x->tok_ns[k] - x->tok_ns[k - 1]) / 1e6;
        }
        if (ttft <= o->slo_ttft_ms && tpot <= o->slo_tpot_ms) good++;
        toks += x->n_tok;
        if (x->tok_ns[x->n_tok - 1] > end) end = x->tok_ns[x->n_tok - 1];
    }
    const double ps[3] = {50, 90, 99};
    for (int q = 0; q < 3; q++) {
        st->ttft[q] = kvb_bench_pct(a, na, ps[q]);
        st->tpot[q] = kvb_bench_pct(b, nb, ps[q]);
        st->itl[q] = kvb_bench_pct(g, ng, ps[q]);
    }
    double dur = (double)(end - t0) / 1e9;
    st->goodput = dur > 0 ? good / dur : 0;
    st->tok_s = dur > 0 ? toks / dur : 0;
    free(a);
    free(b);
    free(g);
}

/* ------------------------------------------------------------------------------------------- HTTP */

typedef struct http_ctx {
    rec *r;
    int max;
} http_ctx;

static size_t on_body(char *p, size_t sz, size_t nm, void *ud) {
    rec *r = ud;
    size_t n = sz * nm;
    uint64_t now = kvb_wall_ns();
    if (r->sse_len + n + 1 > r->sse_cap) {
        size_t c = r->sse_cap ? r->sse_cap : 4096;
        while (c < r->sse_len + n + 1) c *= 2;
        char *b = realloc(r->sse, c);
        if (!b) return 0;
        r->sse = b;
        r->sse_cap = c;
    }
    memcpy(r->sse + r->sse_len, p, n);
    r->sse_len += n;
    r->sse[r->sse_len] = '\0';
    /* whole events only: "data: ...\n\n" */
    char *start = r->sse, *e;
    while ((e = strstr(start, "\n\n"))) {
        *e = '\0';
        if (!strncmp(start, "data: [DONE]", 12)) {
            r->saw_done = 1;
        } else {
            const char *ids = strstr(start, "\"token_ids\":[");
            if (ids && ids[13] != ']') {
                int cnt = 1;
                for (const char *q = ids + 13; *q && *q != ']'; q++) cnt += *q == ',';
                for (int k = 0; k < cnt; k++) rec_token(r, INT32_MAX, now);
            }
            if (strstr(start, "\"error\"")) r->failed = 1;
        }
        start = e + 2;
    }
    size_t rest = r->sse_len - (size_t)(start - r->sse);
    memmove(r->sse, start, rest);
    r->sse_len = rest;
    return n;
}

static int run_http(rec *r, const kvb_trace *tr, const serve_opts *o, uint64_t t0, kvb_progress *pg) {
    CURLM *multi = curl_multi_init();
    if (!multi) return -1;
    char url[512];
    snprintf(url, sizeof url, "%s/v1/completions", o->url);
    int next = 0, live = 0, n_done = 0;
    uint64_t deadline = t0 + (uint64_t)o->timeout_s * 1000000000ull;
    while ((next < tr->n || live) && kvb_wall_ns() < deadline) {
        uint64_t now = kvb_wall_ns();
        while (next < tr->n && r[next].arrival_ns <= now) {
            rec *x = &r[next];
            if (!x->easy) {
                x->easy = curl_easy_init();
                x->hdr = curl_slist_append(NULL, "Content-Type: application/json");
            } else {
                curl_easy_reset(x->easy);
            }
            curl_easy_setopt(x->easy, CURLOPT_URL, url);
            curl_easy_setopt(x->easy, CURLOPT_HTTPHEADER, x->hdr);
            curl_easy_setopt(x->easy, CURLOPT_POSTFIELDS, x->body);
            curl_easy_setopt(x->easy, CURLOPT_WRITEFUNCTION, on_body);
            curl_easy_setopt(x->easy, CURLOPT_WRITEDATA, x);
            curl_easy_setopt(x->easy, CURLOPT_PRIVATE, x);
            curl_easy_setopt(x->easy, CURLOPT_TCP_NODELAY, 1L);
            curl_multi_add_handle(multi, x->easy);
            live++;
            next++;
        }
        int running = 0;
        curl_multi_perform(multi, &running);
        CURLMsg *m;
        int q;
        while ((m = curl_multi_info_read(multi, &q))) {
            if (m->msg != CURLMSG_DONE) continue;
            rec *x = NULL;
            curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, (char **)&x);
            long code = 0;
            curl_easy_getinfo(m->easy_handle, CURLINFO_RESPONSE_CODE, &code);
            if (m->data.result != CURLE_OK || code != 200 || !x->saw_done) x->failed = 1;
            x->done = 1;
            curl_multi_remove_handle(multi, m->easy_handle);
            live--;
            n_done++;
        }
        kvb_progress_update(pg, (uint64_t)n_done);
        now = kvb_wall_ns();
        int wait_ms = 50;
        if (next < tr->n) {
            uint64_t due = r[next].arrival_ns;
            wait_ms = due > now ? (int)KVB_MIN((due - now) / 1000000u, 50u) : 0;
        }
        if (wait_ms > 0 || live) curl_multi_poll(multi, NULL, 0, wait_ms, NULL);
    }
    for (int i = 0; i < tr->n; i++) {
        if (!r[i].done) r[i].failed = 1;
        if (r[i].easy && !r[i].done) curl_multi_remove_handle(multi, r[i].easy);
    }
    curl_multi_cleanup(multi);
    return 0;
}

/* ----------------------------------------------------------------------------------------- direct */

static void on_event(void *ud, uint64_t rid, const int32_t *tokens, const uint64_t *t_ns, int n, int first_index,
                     kvb_finish finish, kvb_status st, const char *err,
                     const kvb_client_logprobs *lp) {
    (void)lp;
    rec *x = ud;
    uint64_t now = kvb_wall_ns();
    (void)rid, (void)tokens, (void)t_ns, (void)first_index, (void)err;
    for (int k = 0; k < n; k++) rec_token(x, INT32_MAX, now);
    if (finish != KVB_FINISH_NONE) {
        x->done = 1;
        if (st != KVB_OK || finish == KVB_FINISH_ERROR) x->failed = 1;
    }
}

static int run_direct(kvb_client *c, rec *r, const kvb_trace *tr, const serve_opts *o, uint64_t t0, kvb_progress *pg) {
    int next = 0, done = 0;
    uint64_t deadline = t0 + (uint64_t)o->timeout_s * 1000000000ull;
    int fd = kvb_client_fd(c);
    while (done < tr->n && kvb_wall_ns() < deadline) {
        uint64_t now = kvb_wall_ns();
        while (next < tr->n && r[next].arrival_ns <= now) {
            const kvb_trace_req *q = &tr->reqs[next];
            kvb_request rq = {.prompt = q->prompt, .n_prompt = q->n_prompt, .max_tokens = q->max_tokens};
            char err[256];
            if (kvb_client_submit(c, &rq, on_event, &r[next], 1000, NULL, err, sizeof err) != KVB_OK) {
                r[next].failed = r[next].done = 1;
            }
            next++;
        }
        kvb_client_dispatch(c);
        done = 0;
        for (int i = 0; i < next; i++) done += r[i].done;
        kvb_progress_update(pg, (uint64_t)done);
        now = kvb_wall_ns();
        int wait_ms = 50;
        if (next < tr->n) {
            uint64_t due = r[next].arrival_ns;
            wait_ms = due > now ? (int)KVB_MIN((due - now) / 1000000u, 50u) : 0;
        }
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        if (done < tr->n) poll(&pfd, 1, wait_ms);
    }
    for (int i = 0; i < tr->n; i++)
        if (!r[i].done) r[i].failed = 1;
    return 0;
}

/* ------------------------------------------------------------------------------------------ table */

/* "median [min, max]" of v[0..n) */
static void spread(const double *v, int n, char *out, size_t len, const char *fmt) {
    double s[64];
    n = KVB_MIN(n, 64);
    memcpy(s, v, (size_t)n * sizeof *s);
    kvb_bench_pct(s, n, 50); /* sorts */
    char a[32], b[32], c[32];
    snprintf(a, sizeof a, fmt, s[n / 2]);
    snprintf(b, sizeof b, fmt, s[0]);
    snprintf(c, sizeof c, fmt, s[n - 1]);
    snprintf(out, len, "%s [%s, %s]", a, b, c);
}

static const char *const USAGE =
    "usage: kvbank-bench serve --config NODE.json --model NAME --trace FILE [options]\n"
    "\n"
    "Replays FILE (a Mooncake .jsonl or an Azure .csv from ../shared/traces) against kvbank-gateway and\n"
    "against the model's ZeroMQ endpoint directly, alternating, --reps times: TTFT / TPOT / ITL\n"
    "percentiles, goodput under the SLOs, failures, and the gateway's overhead at p50.\n"
    "\n"
    "  --url URL           the gateway (default: from the node config's \"gateway\" section or\n"
    "                      RUN_DIR/gateway.port)\n"
    "  --reps N            repetitions of each of the two runs (default 3)\n"
    "  --rate X            arrival rate multiplier (default 1)\n"
    "  --len-scale S       prompt tokens per trace token (default 1/64)\n"
    "  --out-scale S       output tokens per trace token (default 1)\n"
    "  --max-output N      cap on output tokens (default 64)\n"
    "  --max-requests N    at most N requests (default 100)\n"
    "  --slo-ttft-ms X     goodput's TTFT SLO (default 1000)\n"
    "  --slo-tpot-ms X     goodput's TPOT SLO (default 100)\n"
    "  --timeout-s N       give up on a run after N s (default 300)\n";

int kvb_bench_serve(int argc, char **argv) {
    const char *cfg_path = NULL, *trace_path = NULL;
    serve_opts o = {.slo_ttft_ms = 1000, .slo_tpot_ms = 100, .timeout_s = 300};
    kvb_trace_opts to = {.rate_scale = 1, .len_scale = 1.0 / 64, .min_output = 1, .max_output = 64, .max_requests = 100};
    int reps = 3;
    static const struct option opts[] = {{"config", 1, 0, 'c'},      {"model", 1, 0, 'm'},       {"trace", 1, 0, 't'},
                                         {"url", 1, 0, 'u'},         {"reps", 1, 0, 'R'},        {"rate", 1, 0, 'r'},
                                         {"len-scale", 1, 0, 's'},   {"out-scale", 1, 0, 'o'},   {"max-output", 1, 0, 'O'},
                                         {"max-requests", 1, 0, 'n'}, {"slo-ttft-ms", 1, 0, 'f'}, {"slo-tpot-ms", 1, 0, 'p'},
                                         {"timeout-s", 1, 0, 'T'},   {"help", 0, 0, 'h'},        {0, 0, 0, 0}};
    int ch;
    int64_t v;
    optind = 1;
    while ((ch = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        kvb_status st = KVB_OK;
        switch (ch) {
        case 'c': cfg_path = optarg; break;
        case 'm': o.model = optarg; break;
        case 't': trace_path = optarg; break;
        case 'u': o.url = optarg; break;
        case 'R': st = kvb_parse_i64(optarg, 1, 64, &v); reps = (int)v; break;
        case 'r': st = kvb_parse_f64(optarg, &to.rate_scale); break;
        case 's': st = kvb_parse_f64(optarg, &to.len_scale); break;
        case 'o': st = kvb_parse_f64(optarg, &to.out_scale); break;
        case 'O': st = kvb_parse_i64(optarg, 1, 1 << 20, &v); to.max_output = (int)v; break;
        case 'n': st = kvb_parse_i64(optarg, 1, 1 << 20, &v); to.max_requests = (int)v; break;
        case 'f': st = kvb_parse_f64(optarg, &o.slo_ttft_ms); break;
        case 'p': st = kvb_parse_f64(optarg, &o.slo_tpot_ms); break;
        case 'T': st = kvb_parse_i64(optarg, 1, 86400, &v); o.timeout_s = (int)v; break;
        case 'h': printf("%s", USAGE); return 0;
        default: fprintf(stderr, "%s", USAGE); return 2;
        }
        if (st != KVB_OK || to.rate_scale <= 0 || to.len_scale <= 0) {
            fprintf(stderr, "kvbank-bench serve: bad value '%s'\n", optarg);
            return 2;
        }
    }
    if (!cfg_path || !o.model || !trace_path) {
        fprintf(stderr, "%s", USAGE);
        return 2;
    }
    int rc = 1;
    kvb_node_config *cfg = NULL;
    kvb_trace *tr = NULL;
    kvb_client *client = NULL;
    rec *r = NULL;
    char url[300];
    if (kvb_node_config_load(cfg_path, &cfg) != KVB_OK) return 1;
    const kvb_node_model *nm = kvb_node_config_model(cfg, o.model);
    if (!nm) {
        fprintf(stderr, "kvbank-bench serve: no model '%s' in %s\n", o.model, cfg_path);
        goto out;
    }
    o.endpoint = nm->endpoint;
    if (!o.url) {
        int port = cfg->gateway.port;
        char pf[4096];
        snprintf(pf, sizeof pf, "%s/gateway.port", cfg->run_dir);
        FILE *f = fopen(pf, "r");
        if (f) {
            if (fscanf(f, "%d", &port) != 1) port = cfg->gateway.port;
            fclose(f);
        }
        snprintf(url, sizeof url, "http://%s:%d", cfg->gateway.host ? cfg->gateway.host : "127.0.0.1", port);
        o.url = url;
    }
    kvb_model_config mc;
    if (kvb_model_config_load(nm->model_dir, &mc) != KVB_OK) goto out;
    to.vocab = mc.vocab;
    to.max_len = mc.max_pos;
    if (kvb_trace_load(trace_path, &to, &tr) != KVB_OK) goto out;
    if (tr->n == 0) {
        fprintf(stderr, "kvbank-bench serve: the trace gave no request\n");
        goto out;
    }
    if (kvb_client_connect(o.endpoint, &client) != KVB_OK || kvb_client_ping(client, 5000, NULL) != KVB_OK) {
        fprintf(stderr, "kvbank-bench serve: model %s does not answer at %s\n", o.model, o.endpoint);
        goto out;
    }
    curl_global_init(CURL_GLOBAL_DEFAULT);
    if (kvb_calloc((size_t)tr->n, sizeof *r, (void **)&r) != KVB_OK) goto out;
    int max_out = 0;
    for (int i = 0; i < tr->n; i++) {
        const kvb_trace_req *q = &tr->reqs[i];
        max_out = KVB_MAX(max_out, q->max_tokens);
        size_t cap = (size_t)q->n_prompt * 12 + 256;
        r[i].body = malloc(cap);
        if (!r[i].body) goto out;
        size_t k = (size_t)snprintf(r[i].body, cap, "{\"model\":\"%s\",\"prompt\":[", o.model);
        for (int t = 0; t < q->n_prompt; t++) k += (size_t)snprintf(r[i].body + k, cap - k, "%s%d", t ? "," : "", q->prompt[t]);
        snprintf(r[i].body + k, cap - k,
                 "],\"max_tokens\":%d,\"temperature\":0,\"ignore_eos\":true,\"stream\":true,\"return_token_ids\":true}",
                 q->max_tokens);
    }
    for (int i = 0; i < tr->n; i++)
        if (kvb_calloc((size_t)max_out + 1, sizeof(uint64_t), (void **)&r[i].tok_ns) != KVB_OK) goto out;
    printf("serve: %d requests over %.1f s to %s, gateway %s against the endpoint %s, %d repetition(s)\n", tr->n,
           tr->reqs[tr->n - 1].t_s, o.model, o.url, o.endpoint, reps);
    printf("%-4s %-8s %5s %9s %9s %9s %9s %9s %9s %9s %9s\n", "rep", "path", "fail", "TTFT p50", "TTFT p99", "TPOT p50",
           "TPOT p99", "ITL p50", "ITL p99", "goodput", "tok/s");
    run_stats s[2][64];
    for (int rep = 0; rep < reps; rep++) {
        for (int k = 0; k < 2; k++) {
            int path = (rep + k) % 2; /* 0: gateway, 1: direct; alternate which goes first */
            rec_reset(r, tr->n);
            uint64_t t0 = kvb_wall_ns() + 100000000ull;
            for (int i = 0; i < tr->n; i++) r[i].arrival_ns = t0 + (uint64_t)(tr->reqs[i].t_s * 1e9);
            /* a progress line per replay on a terminal (common/util/progress.h) */
            kvb_progress pg;
            char what[96];
            snprintf(what, sizeof what, "rep %d, %s: replaying %d requests", rep, path ? "direct" : "gateway", tr->n);
            kvb_progress_begin(&pg, what, (uint64_t)tr->n, KVB_PROGRESS_COUNT);
            if (path == 0) run_http(r, tr, &o, t0, &pg);
            else run_direct(client, r, tr, &o, t0, &pg);
            kvb_progress_end(&pg);
            run_stats *x = &s[path][rep];
            stats_of(r, tr, &o, t0, x);
            printf("%-4d %-8s %5d %9.2f %9.2f %9.3f %9.3f %9.3f %9.3f %9.2f %9.1f\n", rep, path ? "direct" : "gateway",
                   x->failed, x->ttft[0], x->ttft[2], x->tpot[0], x->tpot[2], x->itl[0], x->itl[2], x->goodput, x->tok_s);
            fflush(stdout);
        }
    }
    printf("\nmedian [min, max] over %d repetitions (ms; goodput in requests/s meeting TTFT <= %.0f ms and TPOT <= %.0f ms)\n",
           reps, o.slo_ttft_ms, o.slo_tpot_ms);
    printf("%-20s %-28s %-28s\n", "", "gateway", "direct");
    struct {
        const char *name;
        size_t off;
        int q;
    } rows[] = {{"TTFT p50", offsetof(run_stats, ttft), 0}, {"TTFT p90", offsetof(run_stats, ttft), 1},
                {"TTFT p99", offsetof(run_stats, ttft), 2}, {"TPOT p50", offsetof(run_stats, tpot), 0},
                {"TPOT p99", offsetof(run_stats, tpot), 2}, {"ITL p50", offsetof(run_stats, itl), 0},
                {"ITL p99", offsetof(run_stats, itl), 2},   {"goodput", offsetof(run_stats, goodput), 0}};
    double ov_ttft[64], ov_tpot[64], fails[2][64];
    for (size_t k = 0; k < KVB_ARRAY_LEN(rows); k++) {
        double v2[2][64];
        char a[128], b[128];
        for (int p = 0; p < 2; p++)
            for (int i = 0; i < reps; i++) v2[p][i] = ((const double *)((const char *)&s[p][i] + rows[k].off))[rows[k].q];
        spread(v2[0], reps, a, sizeof a, "%.3f");
        spread(v2[1], reps, b, sizeof b, "%.3f");
        printf("%-20s %-28s %-28s\n", rows[k].name, a, b);
    }
    for (int i = 0; i < reps; i++) {
        ov_ttft[i] = s[0][i].ttft[0] - s[1][i].ttft[0];
        ov_tpot[i] = 100.0 * (s[0][i].tpot[0] / s[1][i].tpot[0] - 1.0);
        fails[0][i] = s[0][i].failed;
        fails[1][i] = s[1][i].failed;
    }
    char a[128], b[128];
    spread(fails[0], reps, a, sizeof a, "%.0f");
    spread(fails[1], reps, b, sizeof b, "%.0f");
    printf("%-20s %-28s %-28s\n", "failed requests", a, b);
    spread(ov_ttft, reps, a, sizeof a, "%+.3f");
    printf("\ngateway overhead, paired per repetition: TTFT p50 %s ms (target < 1 ms)\n", a);
    spread(ov_tpot, reps, a, sizeof a, "%+.2f");
    printf("gateway overhead, paired per repetition: TPOT p50 %s %% (target < 2 %%)\n", a);
    rc = 0;
out:
    if (r) {
        for (int i = 0; i < tr->n; i++) {
            if (r[i].easy) curl_easy_cleanup(r[i].easy);
            curl_slist_free_all(r[i].hdr);
            free(r[i].body);
            free(r[i].sse);
            free(r[i].tok_ns);
        }
        free(r);
        curl_global_cleanup();
    }
    kvb_client_destroy(client);
    kvb_trace_free(tr);
    kvb_node_config_free(cfg);
    return rc;
}
