/* kvbank-request — send generate requests to a running model server and stream the tokens. */
#include <getopt.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/ipc/client.h"
#include "common/ipc/wire.h"
#include "common/util/prog.h"

static void usage(FILE *f) {
    fprintf(f, "usage: kvbank-request --endpoint EP --prompt-ids IDS --max-tokens N [options]\n"
               "\n"
               "Sends one request to a kvbank model server (kvbank-serve) and prints each token as it arrives:\n"
               "`INDEX TOKEN MS` (MS: milliseconds since the request was sent), then a summary line with the ids.\n"
               "\n"
               "  --endpoint EP          the server's ZeroMQ endpoint (ipc://... or tcp://...)\n"
               "  --prompt-ids IDS       comma-separated token ids; repeat it to send several requests at once\n"
               "                         over one connection (no per-token lines then: one summary line per\n"
               "                         request, in the order given)\n"
               "  --max-tokens N         tokens to generate\n"
               "  --stop-ids IDS         stop after one of these ids\n"
               "  --temperature T, --top-k K, --top-p P, --seed S   sampling (default greedy)\n"
               "  --timeout-ms N         give up when the server is silent this long (default 30000)\n"
               "  --resume-s S           when the server dies mid-stream, wait up to S seconds for it to come\n"
               "                         back (kvbankd restarts it) and continue the request there, no token\n"
               "                         lost or repeated (default 30; 0: fail at once)\n"
               "  --wait S               wait up to S seconds for the server to answer a ping first (default 0)\n"
               "  --quiet                print only the generated ids\n"
               "\n"
               "Exit status 1 when the request fails; the ids delivered before the failure are still printed.\n");
}

typedef struct req_state {
    uint64_t t0;
    int quiet;
    int32_t *ids;
    int n;
    int cap;
} req_state;

/* One of several requests sent at once (--prompt-ids repeated). */
typedef struct batch_req {
    int32_t *prompt;
    int n_prompt;
    uint64_t rid;
    int32_t *ids; /* [max_tokens] */
    int n;
    kvb_finish fin;
    kvb_status st;
    char err[256];
    int done;
} batch_req;

typedef struct batch {
    batch_req *r;
    int n, max_tokens, left;
} batch;

static void on_event(void *ud, uint64_t rid, const int32_t *tokens, const uint64_t *t_ns, int n, int first_index,
                     kvb_finish finish, kvb_status st, const char *err,
                     const kvb_client_logprobs *lp) {
    (void)lp;
    (void)t_ns;
    batch *b = ud;
    batch_req *q = NULL;
    for (int i = 0; i < b->n && !q; i++)
        if (b->r[i].rid == rid && !b->r[i].done) q = &b->r[i];
    if (!q) return;
    for (int k = 0; k < n; k++)
        if (first_index + k < b->max_tokens) q->ids[first_index + k] = tokens[k];
    if (n > 0 && first_index + n > q->n) q->n = KVB_MIN(first_index + n, b->max_tokens);
    if (finish != KVB_FINISH_NONE) {
        q->fin = finish;
        q->st = st;
        snprintf(q->err, sizeof q->err, "%s", err ? err : "");
        q->done = 1;
        b->left--;
    }
}

/* Submits every request of `b` at once and dispatches until all finished; 0 if each finished without
 * an error (a server silent for timeout_ms fails the rest). */
static int run_batch(kvb_client *cl, batch *b, const kvb_request *proto, int timeout_ms, int quiet) {
    for (int i = 0; i < b->n; i++) {
        kvb_request r = *proto;
        r.prompt = b->r[i].prompt;
        r.n_prompt = b->r[i].n_prompt;
        char err[256] = "";
        kvb_status st = kvb_client_submit(cl, &r, on_event, b, timeout_ms, &b->r[i].rid, err, sizeof err);
        if (st != KVB_OK) {
            fprintf(stderr, "kvbank-request: request %d: %s%s%s\n", i, kvb_status_str(st), err[0] ? ": " : "", err);
            return 1;
        }
    }
    uint64_t quiet_since = kvb_now_ns();
    while (b->left > 0) {
        int before = b->left;
        uint64_t tokens_before = 0;
        for (int i = 0; i < b->n; i++) tokens_before += (uint64_t)b->r[i].n;
        if (kvb_client_dispatch(cl) != KVB_OK) {
            fprintf(stderr, "kvbank-request: the connection failed\n");
            return 1;
        }
        uint64_t tokens_after = 0;
        for (int i = 0; i < b->n; i++) tokens_after += (uint64_t)b->r[i].n;
        if (b->left != before || tokens_after != tokens_before) quiet_since = kvb_now_ns();
        if (b->left == 0) break;
        if (kvb_now_ns() - quiet_since > (uint64_t)timeout_ms * 1000000u) {
            fprintf(stderr, "kvbank-request: the server was silent for %d ms\n", timeout_ms);
            return 1;
        }
        int wait = kvb_client_timeout_ms(cl);
        struct pollfd pf = {.fd = kvb_client_fd(cl), .events = POLLIN};
        poll(&pf, 1, wait < 0 || wait > 100 ? 100 : wait);
    }
    int rc = 0;
    for (int i = 0; i < b->n; i++) {
        batch_req *q = &b->r[i];
        if (q->st != KVB_OK || q->fin == KVB_FINISH_ERROR) {
            fprintf(stderr, "kvbank-request: request %d: %s%s%s\n", i, kvb_status_str(q->st), q->err[0] ? ": " : "",
                    q->err);
            rc = 1;
        }
        if (!quiet) printf("finish: %s, %d tokens: ", kvb_finish_str(q->fin), q->n);
        for (int k = 0; k < q->n; k++) printf(k ? ",%d" : "%d", q->ids[k]);
        printf("\n");
    }
    return rc;
}

static int on_token(void *ud, int index, int32_t token, uint64_t t_ns) {
    req_state *s = ud;
    if (!s->quiet) printf("%d %d %.3f\n", index, token, (double)(int64_t)(t_ns - s->t0) / 1e6);
    fflush(stdout);
    if (s->n < s->cap) s->ids[s->n++] = token;
    return 0;
}

int main(int argc, char **argv) {
    kvb_prog_init(argc, argv, "kvbank-request");
    const char *ep = NULL;
    int32_t *prompt = NULL, *stop = NULL;
    batch bt = {0};
    int n_prompt = 0, n_stop = 0, max_tokens = 0, timeout_ms = 30000, wait_s = 0, quiet = 0;
    kvb_client_opts copts;
    kvb_client_opts_default(&copts);
    kvb_sampling samp = {0};
    static const struct option opts[] = {
        {"endpoint", 1, 0, 'e'}, {"prompt-ids", 1, 0, 'p'}, {"max-tokens", 1, 0, 'n'}, {"stop-ids", 1, 0, 's'},
        {"temperature", 1, 0, 'T'}, {"top-k", 1, 0, 'k'}, {"top-p", 1, 0, 'P'}, {"seed", 1, 0, 'S'},
        {"timeout-ms", 1, 0, 't'}, {"resume-s", 1, 0, 'r'}, {"wait", 1, 0, 'w'}, {"quiet", 0, 0, 'q'}, {"help", 0, 0, 'h'}, {0, 0, 0, 0}};
    int c;
    int64_t v;
    double d;
    int li = -1;
    while ((c = getopt_long(argc, argv, "hq", opts, &li)) != -1) {
        kvb_status st = KVB_OK;
        switch (c) {
        case 'e': ep = optarg; break;
        case 'p': {
            int32_t *ids = NULL;
            int n_ids = 0;
            st = kvb_parse_id_list(optarg, &ids, &n_ids);
            if (st == KVB_OK) st = kvb_realloc_array((void **)&bt.r, (size_t)bt.n + 1, sizeof *bt.r);
            if (st != KVB_OK) {
                free(ids);
                break;
            }
            bt.r[bt.n++] = (batch_req){.prompt = ids, .n_prompt = n_ids};
            prompt = bt.r[0].prompt;
            n_prompt = bt.r[0].n_prompt;
            break;
        }
        case 's': st = kvb_parse_id_list(optarg, &stop, &n_stop); break;
        case 'n': st = kvb_parse_i64(optarg, 1, 1 << 30, &v); max_tokens = (int)v; break;
        case 'k': st = kvb_parse_i64(optarg, 0, 1 << 30, &v); samp.top_k = (int)v; break;
        case 't': st = kvb_parse_i64(optarg, 1, 1 << 30, &v); timeout_ms = (int)v; break;
        case 'w': st = kvb_parse_i64(optarg, 0, 3600, &v); wait_s = (int)v; break;
        case 'r': st = kvb_parse_i64(optarg, 0, 3600, &v); copts.resume_ms = (int)v * 1000; break;
        case 'S': st = kvb_parse_i64(optarg, 0, INT64_MAX, &v); samp.seed = (uint64_t)v; break;
        case 'T': st = kvb_parse_f64(optarg, &d); samp.temperature = (float)d; break;
        case 'P': st = kvb_parse_f64(optarg, &d); samp.top_p = (float)d; break;
        case 'q': quiet = 1; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
        if (st != KVB_OK || (c == 'T' && samp.temperature < 0)) {
            fprintf(stderr, "kvbank-request: bad value '%s' for --%s\n", optarg, li >= 0 ? opts[li].name : "?");
            return 2;
        }
    }
    if (!ep || !prompt || !max_tokens || optind != argc) {
        fprintf(stderr, "kvbank-request: --endpoint, --prompt-ids and --max-tokens are required\n");
        usage(stderr);
        return 2;
    }
    int rc = 1;
    kvb_client *cl = NULL;
    req_state s = {.quiet = quiet, .cap = max_tokens};
    if (kvb_malloc((size_t)max_tokens * sizeof(int32_t), (void **)&s.ids) != KVB_OK) goto out;
    char why[4096 + 256];
    if (kvb_wire_ipc_check(ep, why, sizeof why) == KVB_ERR_IO) { /* permission denied: no wait helps */
        fprintf(stderr, "kvbank-request: cannot reach %s: %s\n", ep, why);
        goto out;
    }
    if (kvb_client_connect_opts(ep, &copts, &cl) != KVB_OK) {
        fprintf(stderr, "kvbank-request: cannot connect to %s\n", ep);
        goto out;
    }
    if (wait_s > 0) {
        uint64_t deadline = kvb_now_ns() + (uint64_t)wait_s * 1000000000ull;
        while (kvb_client_ping(cl, 200, NULL) != KVB_OK) {
            if (kvb_now_ns() > deadline) {
                fprintf(stderr, "kvbank-request: no answer from %s within %d s\n", ep, wait_s);
                goto out;
            }
        }
    }
    kvb_request r = {.prompt = prompt, .n_prompt = n_prompt, .max_tokens = max_tokens, .stop_ids = stop,
                     .n_stop = n_stop, .sampling = samp};
    if (bt.n > 1) {
        bt.max_tokens = max_tokens;
        bt.left = bt.n;
        for (int i = 0; i < bt.n; i++)
            if (kvb_malloc((size_t)max_tokens * sizeof(int32_t), (void **)&bt.r[i].ids) != KVB_OK) goto out;
        rc = run_batch(cl, &bt, &r, timeout_ms, quiet);
        goto out;
    }
    kvb_finish fin = KVB_FINISH_NONE;
    char err[256] = "";
    s.t0 = kvb_wall_ns();
    kvb_status st = kvb_client_generate(cl, &r, on_token, &s, timeout_ms, &fin, err, sizeof err);
    if (st != KVB_OK) {
        fprintf(stderr, "kvbank-request: %s%s%s\n", kvb_status_str(st), err[0] ? ": " : "", err);
        if (!s.n) goto out;
        fin = KVB_FINISH_ERROR; /* the tokens delivered before the error are shown, --quiet too */
    }
    if (!quiet) printf("finish: %s, %d tokens: ", kvb_finish_str(fin), s.n);
    for (int i = 0; i < s.n; i++) printf(i ? ",%d" : "%d", s.ids[i]);
    printf("\n");
    rc = fin == KVB_FINISH_ERROR ? 1 : 0;
out:
    kvb_client_destroy(cl);
    for (int i = 0; i < bt.n; i++) {
        free(bt.r[i].prompt);
        free(bt.r[i].ids);
    }
    free(bt.r);
    free(stop);
    free(s.ids);
    return rc;
}
