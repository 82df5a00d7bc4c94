/* kvbank-gateway — the HTTP server, the models it serves and the requests in flight (see gateway.h).
 *
 * Lifetimes. An HTTP request (h2o_req_t) belongs to h2o: it can be disposed at any time once its
 * connection closes (HTTP/1 write error, HTTP/2 stream reset). Each request in flight is a gw_stream,
 * malloc'd here, which h2o knows through a small object allocated in the request's pool whose dispose
 * callback tells the stream that its HTTP side is gone (stream->req = NULL, upstream cancelled). The
 * upstream side ends with the request's final event or kvb_client_abandon. The stream is freed when
 * both sides are done (its deposit timer is closed first, libuv frees nothing before the close
 * callback).
 *
 * Disconnects. h2o stops reading an HTTP/1 connection once the request is in, so a client that goes
 * away while nothing is being written would go unnoticed until the next write. The housekeeping timer
 * therefore peeks at the socket of every HTTP/1 stream that is not writing (recv MSG_PEEK: 0 means
 * the peer closed); HTTP/2 resets arrive through h2o's own reading. Either way the model process gets
 * a CancelRequest.
 *
 * Back-pressure. h2o takes one buffer at a time per response and calls `proceed` when the socket took
 * it; tokens that arrive meanwhile are coalesced into the next server-sent-events write, so a slow
 * reader never blocks the loop and its model never waits for it (the server's per-client queue is
 * bounded by ZeroMQ's high-water mark at the model side). */
#include "gateway/gateway.h"

#include <arpa/inet.h>
#include <errno.h>
#include <h2o.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <strings.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>
#include <zmq.h>

#include "common/ipc/auth.h"
#include "common/ipc/client.h"
#include "common/ipc/wire.h"
#include "common/model/config.h"
#include "common/text/chat.h"
#include "common/text/tokenizer.h"
#include "common/util/sha256.h"
#include "common/util/prog.h"
#include "common/util/token_deposit.h"
#include "gateway/api.h"
#include "gateway/metrics.h"
#include "gateway/stop.h"
#include "gateway/tools.h"

_Static_assert(GW_GRAMMAR_LAX == KVB_GRAMMAR_REQ_LAX && GW_GRAMMAR_COMPACT == KVB_GRAMMAR_REQ_COMPACT,
               "gw_params.grammar_flags are kvb_request.grammar_flags");

#define GW_MAX_MODELS 64
#define KVB_NAME_MAX_GW 65        /* model names: up to 64 bytes */
#define HOUSEKEEP_MS 100          /* disconnect peeks and the dispatch safety net */
#define STALE_FACTOR 3            /* a coordinator / model silent for 3 status periods does not "answer" */
#define SILENT_FACTOR 10          /* a request whose model is silent for 10 status periods fails (503) */
#define DEFAULT_MAX_TOKENS 16     /* completions without max_tokens (OpenAI's default) */
#define SUBMIT_TIMEOUT_MS 1000    /* how long a send to a model may wait for queue room */
#define SHUTDOWN_MS 2000          /* after the drain: how long the gateway waits for its connections to close */
#define NAME_ECHO 64              /* bytes of a client-given name that an error message repeats */
/* Resets: an HTTP/2 client that cancels its requests faster than this bucket refills is closed
 * (GOAWAY ENHANCE_YOUR_CALM): CVE-2023-44487, which Debian's h2o 2.2.5 does not handle itself. */
#define RESET_BURST 200.0         /* cancelled requests a connection may have in a burst */
#define RESET_RATE 20.0           /* ... and per second after it */

typedef struct gw gw;
typedef struct gw_stream gw_stream;

/* The endpoints (the label of kvbank_gateway_http_requests_total). */
enum {
    EP_COMPLETIONS, EP_CHAT, EP_MODELS, EP_MODEL, EP_HEALTH, EP_PING, EP_METRICS, EP_VERSION, EP_TOKENIZE,
    EP_DETOKENIZE, EP_OTHER, EP_COUNT
};
static const char *const EP_NAMES[EP_COUNT] = {"/v1/completions", "/v1/chat/completions", "/v1/models",
                                               "/v1/models/{model}", "/health", "/ping", "/metrics", "/version",
                                               "/tokenize", "/detokenize", "other"};

/* ------------------------------------------------------------------------------------- connections */

/* An accepted TCP connection. h2o owns the socket; the gateway keeps this record until h2o's close
 * callback (on_conn_closed) so that a drain can end idle keep-alive connections (h2o 2.2 has no call
 * for that) and a connection that resets too much can be closed. */
typedef struct gw_conn {
    uv_tcp_t tcp;                 /* first: h2o's close callback gets &tcp */
    gw *g;
    struct gw_conn *prev, *next;
    int fd;
    h2o_socket_t *sock;           /* h2o's socket (valid until on_conn_closed) */
    int http2;                    /* a request came over HTTP/2 */
    int n_streams;                /* gw_streams of this connection in flight */
    int closing;                  /* shut down by the gateway (drain or abuse) */
    double reset_tokens;          /* RESET_BURST bucket */
    uint64_t reset_ns;            /* when the bucket was last refilled (kvb_now_ns) */
    uint64_t resets;              /* requests the client cancelled */
} gw_conn;

/* ------------------------------------------------------------------------------------------ models */

typedef struct gw_model {
    gw *g;
    char name[KVB_NAME_MAX_GW];
    char endpoint[512];
    char model_dir[1024];
    int configured;               /* named in the node config */
    double tbt_slo_ms;            /* Token-Deposit default (< 0: the gateway's) */
    int alive;                    /* per the coordinator's last status */
    uint32_t pid;
    int role;                     /* kvb_role */
    kvb_client *client;           /* NULL until the endpoint is known */
    uv_poll_t poll;               /* on kvb_client_fd */
    int poll_open;
    int have_cfg;                 /* config.json was read */
    kvb_model_config cfg;         /* vocab, max_pos, eos ids */
    kvb_tokenizer *tok;           /* tokenizer.json, or NULL (the model then takes token ids only) */
    kvb_chat_template *tmpl;      /* its chat template, or NULL */
    char tmpl_why[320];           /* why a template it has cannot be used (chat requests are told), or "" */
    gw_tool_format tool_fmt;      /* the format its template writes tool calls in (tools.h) */
    int32_t tool_marker;          /* the token starting a call when it is a special token (a decode that skips
                                   * special tokens drops it, so the parser is given its text), else -1 */
    /* the model's numbers: last Pong and last coordinator status */
    kvb_client_pong pong;
    uint64_t pong_ns;             /* when the last Pong arrived (kvb_now_ns), 0: never */
    int verified;                 /* a Pong came from the registered process (nothing is routed before) */
    int impostor;                 /* the last Pong came from another process than the one the coordinator
                                   * registered under this name (its pid, checked by the kernel) */
    uint32_t n_own, n_lent, n_borrowed, capacity;
    int block_size;               /* tokens per KV block (its registered geometry; 0: not known yet) */
    uint64_t lends, reclaims, lend_ms_total, reclaim_ms_total;
    /* what the gateway measured (delivery side) */
    gw_hist ttft, tpot, itl, gen_itl, e2e;
    gw_hist decode;               /* first to last token, as the model sampled them */
    gw_hist req_prompt, req_gen, req_max_tokens; /* per request: prompt and generated tokens, max_tokens */
    uint64_t finished[5];         /* by kvb_finish */
    uint64_t prompt_tokens, completion_tokens, deposit_held;
    int n_streams;
} gw_model;

struct gw {
    const gw_opts *o;
    uv_loop_t *loop;
    volatile sig_atomic_t *stop;  /* polled by the housekeeping timer */
    int draining;                 /* the stop was asked: /health fails, no new connection is accepted */
    int stopping;                 /* the drain ended: what is left is cancelled */
    uint64_t drain_deadline_ns, stop_deadline_ns;
    gw_conn *conns;               /* open connections (doubly linked) */
    int n_conns;
    gw_conn **conn_by_fd;         /* [n_conn_by_fd] */
    int n_conn_by_fd;
    uint64_t resets_closed;       /* connections closed for resetting too much */
    uint8_t (*key_digest)[KVB_SHA256_BYTES]; /* [o->n_api_keys] SHA-256 of each API key */
    uint64_t unauthorized;        /* requests refused with 401 */
    SSL_CTX *ssl;                 /* TLS (tls_cert / tls_key), or NULL */
    struct gw_job *jobs;          /* text jobs on the thread pool (doubly linked) */
    int n_jobs;
    uv_timer_t housekeep, status_timer;
    /* HTTP */
    h2o_globalconf_t h2o_conf;
    h2o_context_t h2o_ctx;
    h2o_accept_ctx_t accept_ctx;
    uv_tcp_t listener;
    int port;
    /* coordinator */
    void *zctx, *coord;           /* DEALER to the coordinator */
    uv_poll_t coord_poll;
    uint64_t coord_ns;            /* last StatusReply, kvb_now_ns; 0: never */
    uint64_t epoch, dropped;
    char coord_id[64];
    /* models */
    gw_model *models[GW_MAX_MODELS];
    int n_models;
    /* streams in flight (doubly linked) */
    gw_stream *streams;
    int n_streams;
    uint64_t next_id;
    /* HTTP counters: by endpoint and status class */
    uint64_t http[EP_COUNT][6];   /* [endpoint][status / 100] */
    uint64_t disconnects;         /* requests cancelled because their HTTP client went away */
    uint64_t rejected_busy;
    uint64_t *ignored;            /* [n_fields] requests that carried each ignored field (gw_fields) */
    int n_fields;
};



/* ----------------------------------------------------------------------------------------- streams */

/* The link h2o holds in the request's pool: its dispose callback runs when h2o frees the request. */
typedef struct req_link {
    gw_stream *s;
} req_link;

struct gw_stream {
    h2o_generator_t gen;
    gw *g;
    gw_model *m;
    gw_stream *prev, *next;
    h2o_req_t *req;               /* NULL once h2o is done with it */
    req_link *link;
    int ep;                       /* EP_COMPLETIONS / EP_CHAT */
    gw_conn *conn;                /* its connection (NULL once closed) */
    int http1;
    int h2o_done;                 /* final response sent, or the request was disposed */
    int upstream_live;
    uint64_t rid;
    uv_timer_t timer;             /* Token-Deposit releases */
    int timer_armed;
    /* request */
    char id[48];
    int64_t created;
    int stream, include_usage, return_token_ids, timings;
    int n_prompt;
    int max_tokens;               /* what the model was asked for (the request's, or the default) */
    uint64_t slo_ns;              /* Token-Deposit target; 0: off */
    uint64_t t_arrival;           /* kvb_wall_ns when the HTTP request was handled */
    uint64_t submit_ns;           /* kvb_now_ns of the submit */
    /* tokens: [n_tok] of [cap_tok] */
    int32_t *tok;
    uint64_t *t_gen;              /* the model's sampling time (wall ns) */
    uint64_t *t_recv;             /* when the gateway received it (wall ns) */
    uint64_t *t_deliv;            /* its delivery time d_i (Token-Deposit) */
    size_t *text_end;             /* released text after this token */
    int n_tok, cap_tok;
    int n_released;               /* tokens whose delivery time has come */
    gw_stop *stopper;
    kvb_detok *detok;             /* incremental detokenizer (models with a tokenizer) */
    char *text;                   /* released text (after stop strings) [text_len] */
    size_t text_len, text_cap;
    size_t sent_text;             /* bytes of text sent */
    int sent_tok;                 /* tokens sent */
    int finished;                 /* the upstream request ended (or a stop string ended it) */
    const char *finish_reason;    /* "stop" / "length" / NULL (error or cancel) */
    kvb_finish fin;               /* how it ended, for the metrics */
    int recorded;                 /* the metrics have it */
    int failed;                   /* error: err holds it */
    gw_error err;
    /* output */
    char *out;                    /* the buffer h2o is writing [out_len] */
    size_t out_len, out_cap;
    int sending;                  /* h2o has `out`, proceed not yet called */
    int head_sent;                /* h2o_start_response was called */
    int role_sent;                /* chat: the first delta with the role went out */
    /* structured output and tools */
    char grammar_field[32];       /* the request field its grammar came from (a 400 names it), or "": a copy,
                                   * since gw_params' name lives in the request's JSON, freed after the submit */
    gw_tool_parser *tp;           /* chat with tools: the model's text -> content and tool_calls */
    gw_tool_format tool_fmt;
    int32_t tool_marker;          /* as gw_model.tool_marker when the detokenizer skips special tokens, else -1 */
    char *d_content;              /* what the parser emitted since the last event: content [d_len] */
    size_t d_len, d_cap;
    json_t *d_calls;              /* ... and tool_calls deltas (stream) or the whole calls (not streamed) */
    int n_calls;                  /* calls begun */
    /* Several sequences (n, best_of, several prompts): each is a gw_stream; the head (seqs[0]) holds the
     * HTTP request, the deposit timer and the prompts, and answers for all of them. */
    gw_stream *head;              /* itself for the head */
    gw_stream **seqs;             /* head: [n_seqs], prompt by prompt, `per` each */
    int n_seqs, per, n_choices;   /* head: sequences per prompt (max(n, best_of)), choices per prompt (n) */
    gw_prompt *prompts;           /* head: [n_prompts] (taken from gw_params) */
    int n_prompts;
    kvb_logit_bias *logit_bias;   /* head: the requests' logit_bias (taken from gw_params) */
    int prompt_i;                 /* its prompt */
    int index;                    /* its choice index (prompt x n + k; best_of: by rank) */
    int fin_sent;                 /* stream: its last chunk (finish_reason) went out */
    /* logprobs (gw_params.logprobs; best_of ranks by them too) */
    int logprobs, top_logprobs, tokens_as_ids, echo_lp;
    float *lp;                    /* [cap_tok] each token's logprob */
    int32_t *top_ids;             /* [cap_tok][top_logprobs] */
    float *top_lp;
    size_t *off;                  /* [cap_tok] completions' text_offset: characters of the text before it */
    size_t n_chars;               /* characters of text the detokenizer gave so far (echo included) */
    double cum_lp;                /* the sum of its tokens' logprobs */
    /* echo: the text starts with the prompt (completions) or the last message (chat) */
    size_t echo_len;
    float *plp;                   /* the first sequence of a prompt with echo and logprobs: [n_prompt] the
                                   * prompt's logprobs (plp[0] unused: the first token has none) */
    int32_t *ptop_ids;            /* [n_prompt][top_logprobs] */
    float *ptop_lp;
    int n_plp;                    /* positions 1 .. n_plp received */
    int plp_done;                 /* the prompt's logprobs are all in (its first token or its end came) */
    int echo_only;                /* max_tokens 0 with echo: the model's one token is dropped */
};

static void stream_pump(gw_stream *s);
static void stream_maybe_free(gw_stream *s);
static void record_metrics(gw_stream *s, kvb_finish f);

static void count_http(gw *g, int ep, int status) {
    int cls = status / 100;
    if (cls < 0 || cls > 5) cls = 0;
    g->http[ep][cls]++;
}

/* The connection a request came on, or NULL. */
static gw_conn *conn_of(gw *g, h2o_req_t *req) {
    if (!req || !req->conn->callbacks->get_socket) return NULL;
    h2o_socket_t *sock = req->conn->callbacks->get_socket(req->conn);
    int fd = sock ? h2o_socket_get_fd(sock) : -1;
    return fd >= 0 && fd < g->n_conn_by_fd ? g->conn_by_fd[fd] : NULL;
}

/* Ends a connection: its reading side is shut, so h2o reads EOF, finishes what it is writing and
 * closes it (and disposes its requests) the way it does when a client leaves. */
static void conn_shut(gw_conn *c) {
    if (c->closing) return;
    c->closing = 1;
    shutdown(c->fd, SHUT_RD);
}

/* A request of `c` was cancelled by its client: an HTTP/2 connection that does this faster than the
 * bucket allows gets GOAWAY (ENHANCE_YOUR_CALM) and is closed. */
static void conn_count_reset(gw *g, gw_conn *c) {
    if (!c) return;
    c->resets++;
    uint64_t now = kvb_now_ns();
    if (!c->reset_ns) c->reset_tokens = RESET_BURST;
    else c->reset_tokens = KVB_MIN(RESET_BURST, c->reset_tokens + (double)(now - c->reset_ns) / 1e9 * RESET_RATE);
    c->reset_ns = now;
    c->reset_tokens -= 1.0;
    if (c->reset_tokens >= 0 || c->closing || !c->http2) return;
    g->resets_closed++;
    KVB_LOG_W("gateway: a client cancelled %" PRIu64 " requests on one HTTP/2 connection, faster than %.0f a second: "
              "closing it (GOAWAY ENHANCE_YOUR_CALM)", c->resets, RESET_RATE);
    /* h2o 2.2 has no call to send a GOAWAY on one connection: the frame is written here, between h2o's
     * writes (which are whole frames), when none is under way; the connection ends either way */
    static const uint8_t goaway[17] = {0, 0, 8, 7 /* GOAWAY */, 0, 0, 0, 0, 0, /* last stream: */ 0x7f, 0xff, 0xff, 0xff,
                                       0, 0, 0, 11 /* ENHANCE_YOUR_CALM */};
    if (!h2o_socket_is_writing(c->sock) && send(c->fd, goaway, sizeof goaway, MSG_DONTWAIT | MSG_NOSIGNAL) < 0)
        KVB_LOG_D("gateway: GOAWAY not sent: %s", strerror(errno));
    conn_shut(c);
}

/* Sends a complete response (status, JSON or text body). The request is done afterwards. */
static void send_body(gw *g, h2o_req_t *req, int ep, int status, const char *ctype, const char *body, size_t len) {
    static const char *const reasons[] = {[200] = "OK", [400] = "Bad Request", [401] = "Unauthorized", [404] = "Not Found",
                                          [405] = "Method Not Allowed", [413] = "Payload Too Large",
                                          [429] = "Too Many Requests", [500] = "Internal Server Error",
                                          [503] = "Service Unavailable"};
    req->res.status = status;
    req->res.reason = status < (int)KVB_ARRAY_LEN(reasons) && reasons[status] ? reasons[status] : "Error";
    h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_CONTENT_TYPE, NULL, ctype, strlen(ctype));
    if (req->method.len == 4 && !memcmp(req->method.base, "HEAD", 4)) {
        /* h2o sends no body for HEAD and no length either: the length GET would have (RFC 9110 §9.3.2) */
        char *cl = h2o_mem_alloc_pool(&req->pool, 24);
        int n = snprintf(cl, 24, "%zu", len);
        h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_CONTENT_LENGTH, NULL, cl, (size_t)n);
    }
    count_http(g, ep, status);
    h2o_send_inline(req, body, len);
}

static void send_json(gw *g, h2o_req_t *req, int ep, int status, json_t *j) {
    char *s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    if (!s) {
        send_body(g, req, ep, 500, "text/plain", "out of memory\n", 14);
        return;
    }
    send_body(g, req, ep, status, "application/json", s, strlen(s));
    free(s);
}

static void send_error(gw *g, h2o_req_t *req, int ep, const gw_error *e) {
    size_t n = 0;
    char *b = gw_error_body(e, &n);
    if (!b) {
        send_body(g, req, ep, 500, "text/plain", "out of memory\n", 14);
        return;
    }
    if (e->retry_after_s > 0) {
        char *v = h2o_mem_alloc_pool(&req->pool, 16);
        int len = snprintf(v, 16, "%d", e->retry_after_s);
        h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_RETRY_AFTER, NULL, v, (size_t)len);
    }
    send_body(g, req, ep, e->status, "application/json", b, n);
    free(b);
}

/* What one sequence holds (not the gw_stream itself). */
static void seq_free_data(gw_stream *s) {
    gw_stop_destroy(s->stopper);
    kvb_detok_destroy(s->detok);
    free(s->tok);
    free(s->t_gen);
    free(s->t_recv);
    free(s->t_deliv);
    free(s->text_end);
    free(s->text);
    free(s->out);
    free(s->lp);
    free(s->top_ids);
    free(s->top_lp);
    free(s->off);
    free(s->plp);
    free(s->ptop_ids);
    free(s->ptop_lp);
    gw_tool_parser_destroy(s->tp);
    free(s->d_content);
    json_decref(s->d_calls);
}

static void on_stream_timer_closed(uv_handle_t *h) {
    gw_stream *s = h->data;
    for (int k = 1; k < s->n_seqs; k++) {
        seq_free_data(s->seqs[k]);
        free(s->seqs[k]);
    }
    seq_free_data(s);
    free(s->seqs);
    for (int i = 0; i < s->n_prompts; i++) free(s->prompts[i].ids);
    free(s->prompts);
    free(s->logit_bias);
    free(s);
}

static void stream_unlink(gw_stream *s) {
    gw *g = s->g;
    if (s->conn) s->conn->n_streams--;
    s->conn = NULL;
    if (s->prev) s->prev->next = s->next;
    else if (g->streams == s) g->streams = s->next;
    if (s->next) s->next->prev = s->prev;
    s->prev = s->next = NULL;
    g->n_streams--;
    if (s->m) s->m->n_streams--;
}

static int upstream_any(const gw_stream *s) {
    for (int k = 0; k < s->n_seqs; k++)
        if (s->seqs[k]->upstream_live) return 1;
    return 0;
}

/* Frees the stream once neither h2o nor the model will call back for any of its sequences. */
static void stream_maybe_free(gw_stream *s) {
    if (!s->h2o_done || upstream_any(s)) return;
    if (s->link) s->link->s = NULL;
    s->link = NULL;
    stream_unlink(s);
    uv_timer_stop(&s->timer);
    uv_close((uv_handle_t *)&s->timer, on_stream_timer_closed);
}

/* One sequence's model side is no longer wanted: cancelled in the model process (safe inside dispatch). */
static void seq_abandon(gw_stream *q) {
    if (!q->upstream_live) return;
    q->upstream_live = 0;
    if (q->m && q->m->client) kvb_client_abandon(q->m->client, q->rid);
}

/* The model side of every sequence is no longer wanted (client gone). Not from inside a dispatch. */
static void stream_abandon_upstream(gw_stream *s) {
    int any = upstream_any(s);
    for (int k = 0; k < s->n_seqs; k++) seq_abandon(s->seqs[k]);
    if (any && s->m && s->m->client) kvb_client_dispatch(s->m->client); /* the send may have consumed the fd's edge */
}

/* h2o let go of the request (connection closed, stream reset, or after our final send). */
static void on_req_dispose(void *p) {
    req_link *l = p;
    gw_stream *s = l->s;
    if (!s) return;
    l->s = NULL;
    s->link = NULL;
    s->req = NULL;
    if (!s->h2o_done) {
        s->g->disconnects++;
        KVB_LOG_I("gateway: %s: the client went away; cancelling its request", s->id);
        for (int k = 0; k < s->n_seqs; k++) record_metrics(s->seqs[k], KVB_FINISH_CANCELLED);
        conn_count_reset(s->g, s->conn);
    }
    s->h2o_done = 1;
    stream_abandon_upstream(s);
    stream_maybe_free(s);
}

static void on_gen_stop(h2o_generator_t *gen, h2o_req_t *req) {
    gw_stream *s = (gw_stream *)gen;
    (void)req;
    if (s->link) on_req_dispose(s->link);
}

static void on_gen_proceed(h2o_generator_t *gen, h2o_req_t *req) {
    gw_stream *s = (gw_stream *)gen;
    (void)req;
    s->sending = 0;
    stream_pump(s);
}

/* ---------------------------------------------------------------------------------- response JSON */

static const char *object_name(const gw_stream *s) {
    if (s->ep == EP_CHAT) return s->stream ? "chat.completion.chunk" : "chat.completion";
    return "text_completion";
}

static json_t *ids_json(const int32_t *ids, int n) {
    json_t *a = json_array();
    for (int i = 0; i < n && a; i++) json_array_append_new(a, json_integer(ids[i]));
    return a;
}

/* Every prompt once, the tokens of every choice returned (best_of: not those it dropped). */
static json_t *usage_json(const gw_stream *s) {
    int prompt = 0, gen = 0;
    for (int i = 0; i < s->n_prompts; i++) prompt += s->prompts[i].n_ids;
    for (int k = 0; k < s->n_seqs; k++)
        if (s->seqs[k]->index >= 0) gen += s->seqs[k]->n_tok;
    return json_pack("{s:i, s:i, s:i}", "prompt_tokens", prompt, "completion_tokens", gen, "total_tokens", prompt + gen);
}

/* kvbank_timings: the generation and delivery time of every token (ns since the epoch). */
static json_t *timings_json(const gw_stream *s) {
    json_t *g = json_array(), *r = json_array(), *d = json_array();
    for (int i = 0; i < s->n_tok; i++) {
        json_array_append_new(g, json_integer((json_int_t)s->t_gen[i]));
        json_array_append_new(r, json_integer((json_int_t)s->t_recv[i]));
        json_array_append_new(d, json_integer((json_int_t)s->t_deliv[i]));
    }
    return json_pack("{s:o, s:o, s:o, s:f}", "generated_ns", g, "received_ns", r, "delivered_ns", d, "tbt_slo_ms",
                     (double)s->slo_ns / 1e6);
}

/* The first sequence of the prompt of `q` (it counts the prompt's tokens and asks for its logprobs). */
static gw_stream *seq_lead(const gw_stream *q) { return q->head->seqs[q->prompt_i * q->head->per]; }

/* ------------------------------------------------------------------------------------- logprobs */

/* Length of the valid UTF-8 character at s[0..n), or 0 (overlong forms and surrogates are invalid). */
static int utf8_char(const unsigned char *s, size_t n) {
    int len = s[0] < 0x80 ? 1 : s[0] >= 0xC2 && s[0] < 0xE0 ? 2 : s[0] >= 0xE0 && s[0] < 0xF0 ? 3 : s[0] >= 0xF0 && s[0] < 0xF5 ? 4 : 0;
    if (!len || (size_t)len > n) return 0;
    for (int i = 1; i < len; i++)
        if ((s[i] & 0xC0) != 0x80) return 0;
    if ((s[0] == 0xE0 && s[1] < 0xA0) || (s[0] == 0xED && s[1] >= 0xA0) || (s[0] == 0xF0 && s[1] < 0x90) ||
        (s[0] == 0xF4 && s[1] >= 0x90))
        return 0;
    return len;
}

static size_t utf8_chars(const char *s, size_t n) {
    size_t c = 0;
    for (size_t i = 0; i < n; i++) c += ((unsigned char)s[i] & 0xC0) != 0x80;
    return c;
}

/* A token as logprobs name it (a new JSON string): its bytes, each invalid byte as U+FFFD (a byte-level
 * token may hold part of a character: chat's `bytes` carries its raw bytes); "token_id:N" when the
 * request asked for ids (vLLM's return_tokens_as_token_ids) or the model has no tokenizer. */
static json_t *token_json(const gw_stream *q, int32_t id, json_t **bytes) {
    size_t n = 0;
    const char *b = q->m->tok && !q->tokens_as_ids ? kvb_tokenizer_token_bytes(q->m->tok, id, &n) : NULL;
    if (bytes) {
        *bytes = json_array();
        for (size_t i = 0; i < n; i++) json_array_append_new(*bytes, json_integer((unsigned char)b[i]));
    }
    char tmp[32];
    if (!b) {
        snprintf(tmp, sizeof tmp, "token_id:%d", (int)id);
        if (bytes)
            for (const char *c = tmp; *c; c++) json_array_append_new(*bytes, json_integer((unsigned char)*c));
        return json_string(tmp);
    }
    char *out = malloc(n * 3 + 1);
    if (!out) return json_string("");
    size_t k = 0;
    for (size_t i = 0; i < n;) {
        int c = utf8_char((const unsigned char *)b + i, n - i);
        if (c) memcpy(out + k, b + i, (size_t)c), k += (size_t)c, i += (size_t)c;
        else memcpy(out + k, "\xEF\xBF\xBD", 3), k += 3, i++;
    }
    json_t *j = json_stringn(out, k);
    free(out);
    return j ? j : json_string("");
}

/* A logprob as JSON: -inf (a token masked out) as vLLM writes it, -9999. */
static json_t *lp_json(float lp) { return json_real(isfinite(lp) ? lp : -9999.0); }

/* The completions format (OpenAI's legacy one): tokens, token_logprobs, top_logprobs (each position's
 * alternatives and the chosen token, as a map from token to logprob), text_offset; for the sequence's
 * tokens [a, b), after its prompt's tokens when `prompt` (echo: the first has no logprob). */
static json_t *cmpl_logprobs_json(const gw_stream *q, int prompt, int a, int b) {
    json_t *toks = json_array(), *lps = json_array(), *tops = json_array(), *offs = json_array();
    const gw_stream *lead = seq_lead(q);
    const gw_prompt *pr = &q->head->prompts[q->prompt_i];
    int t = q->top_logprobs;
    size_t poff = 0, echo_chars = prompt ? utf8_chars(q->text, q->echo_len) : 0;
    for (int i = 0; prompt && i < pr->n_ids; i++) {
        json_array_append_new(toks, token_json(q, pr->ids[i], NULL));
        json_array_append_new(offs, json_integer((json_int_t)KVB_MIN(poff, echo_chars)));
        size_t n = 0;
        const char *bb = q->m->tok ? kvb_tokenizer_token_bytes(q->m->tok, pr->ids[i], &n) : NULL;
        poff += bb ? utf8_chars(bb, n) : 0;
        if (i == 0 || i > lead->n_plp || !lead->plp) {
            json_array_append_new(lps, json_null());
            json_array_append_new(tops, json_null());
            continue;
        }
        json_array_append_new(lps, lp_json(lead->plp[i]));
        json_t *m = json_object();
        for (int k = 0; k < t; k++) {
            json_t *name = token_json(q, lead->ptop_ids[(size_t)i * t + k], NULL);
            json_object_set_new(m, json_string_value(name), lp_json(lead->ptop_lp[(size_t)i * t + k]));
            json_decref(name);
        }
        json_t *name = token_json(q, pr->ids[i], NULL);
        json_object_set_new(m, json_string_value(name), lp_json(lead->plp[i]));
        json_decref(name);
        json_array_append_new(tops, m);
    }
    for (int i = a; i < b; i++) {
        json_t *name = token_json(q, q->tok[i], NULL);
        json_array_append_new(lps, lp_json(q->lp[i]));
        json_array_append_new(offs, json_integer((json_int_t)q->off[i]));
        json_t *m = json_object();
        for (int k = 0; k < t; k++) {
            json_t *alt = token_json(q, q->top_ids[(size_t)i * t + k], NULL);
            json_object_set_new(m, json_string_value(alt), lp_json(q->top_lp[(size_t)i * t + k]));
            json_decref(alt);
        }
        json_object_set_new(m, json_string_value(name), lp_json(q->lp[i])); /* the chosen one, always */
        json_array_append_new(tops, m);
        json_array_append_new(toks, name);
    }
    return json_pack("{s:o, s:o, s:o, s:o}", "tokens", toks, "token_logprobs", lps, "top_logprobs", tops, "text_offset", offs);
}

/* The chat format: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]} for
 * the sequence's tokens [a, b). */
static json_t *chat_logprobs_json(const gw_stream *q, int a, int b) {
    json_t *content = json_array();
    int t = q->top_logprobs;
    for (int i = a; i < b; i++) {
        json_t *bytes = NULL, *name = token_json(q, q->tok[i], &bytes), *top = json_array();
        for (int k = 0; k < t; k++) {
            json_t *ab = NULL, *alt = token_json(q, q->top_ids[(size_t)i * t + k], &ab);
            json_array_append_new(top, json_pack("{s:o, s:o, s:o}", "token", alt, "logprob",
                                                 lp_json(q->top_lp[(size_t)i * t + k]), "bytes", ab));
        }
        json_array_append_new(content, json_pack("{s:o, s:o, s:o, s:o}", "token", name, "logprob", lp_json(q->lp[i]),
                                                 "bytes", bytes, "top_logprobs", top));
    }
    return json_pack("{s:o}", "content", content);
}

/* The logprobs of a choice's tokens [a, b) (with its echoed prompt's when `prompt`), or null. */
static json_t *logprobs_json(const gw_stream *q, int prompt, int a, int b) {
    if (!q->logprobs) return json_null();
    if (q->ep == EP_CHAT) return b > a ? chat_logprobs_json(q, a, b) : json_null();
    return cmpl_logprobs_json(q, prompt && q->echo_lp, a, b);
}

/* ------------------------------------------------------------------------- tool calls in responses */

/* A tool call's id: "call_" and 24 letters and digits, or the 9 Mistral's template insists on. */
static void tool_call_id(const gw_stream *s, int index, char *out, size_t n) {
    static const char an[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    uint64_t x = kvb_wall_ns() ^ ((uint64_t)(uintptr_t)s * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)index << 32);
    int len = s->tool_fmt == GW_TOOLS_MISTRAL ? 9 : 24, k = 0;
    if (len != 9) k = snprintf(out, n, "call_");
    for (int i = 0; i < len && k + 1 < (int)n; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        out[k++] = an[x % (sizeof an - 1)];
    }
    out[k] = '\0';
}

/* What the tool parser decided: content goes to d_content; a call's start and its arguments become
 * tool_calls entries (a stream: deltas since the last event; otherwise the whole calls). */
static void on_tool_event(void *ud, gw_tool_ev_kind kind, int index, const char *text, size_t len) {
    gw_stream *s = ud;
    if (kind == GW_TOOL_EV_CONTENT) {
        gw_buf_append(&s->d_content, &s->d_len, &s->d_cap, text, len);
        return;
    }
    if (!s->d_calls) s->d_calls = json_array();
    json_t *last = json_array_get(s->d_calls, json_array_size(s->d_calls) - 1);
    if (kind == GW_TOOL_EV_CALL) {
        char id[40];
        tool_call_id(s, index, id, sizeof id);
        json_array_append_new(s->d_calls, json_pack("{s:i, s:s, s:s, s:{s:s%, s:s}}", "index", index, "id", id, "type",
                                                    "function", "function", "name", text, len, "arguments", ""));
        s->n_calls = index + 1;
        return;
    }
    json_t *fn = last && json_integer_value(json_object_get(last, "index")) == index ? json_object_get(last, "function") : NULL;
    if (!fn) { /* a stream's later piece of a call already announced */
        json_array_append_new(s->d_calls, json_pack("{s:i, s:{s:s%}}", "index", index, "function", "arguments", text, len));
        return;
    }
    json_t *a = json_object_get(fn, "arguments");
    size_t have = json_string_length(a);
    char *cat = malloc(have + len + 1);
    if (!cat) return;
    memcpy(cat, json_string_value(a), have);
    memcpy(cat + have, text, len);
    json_object_set_new(fn, "arguments", json_stringn(cat, have + len));
    free(cat);
}

/* finish_reason: "tool_calls" when the model called a tool and stopped on its own. */
static const char *finish_word(const gw_stream *s) {
    if (s->n_calls > 0 && s->finish_reason && !strcmp(s->finish_reason, "stop")) return "tool_calls";
    return s->finish_reason;
}

/* A chat choice of a request with tools: the parsed content (null when there is none but calls) and
 * the calls; the whole message, or a delta (role only on the first). Takes what d_content / d_calls
 * hold; `logprobs` consumed (NULL: null). */
static json_t *tool_choice_json(gw_stream *s, const int32_t *ids, int n_ids, const char *finish, json_t *logprobs) {
    json_t *c = json_pack("{s:i}", "index", s->index), *msg = json_object();
    if (!s->stream || !s->role_sent) json_object_set_new(msg, "role", json_string("assistant"));
    if (s->d_len || !s->stream)
        json_object_set_new(msg, "content", s->d_len || !s->n_calls ? json_stringn(s->d_content ? s->d_content : "", s->d_len)
                                                                    : json_null());
    if (s->d_calls && json_array_size(s->d_calls)) json_object_set(msg, "tool_calls", s->d_calls);
    json_object_set_new(c, s->stream ? "delta" : "message", msg);
    json_object_set_new(c, "logprobs", logprobs ? logprobs : json_null());
    json_object_set_new(c, "finish_reason", finish ? json_string(finish) : json_null());
    if (s->return_token_ids && (n_ids || !s->stream)) json_object_set_new(c, "token_ids", ids_json(ids, n_ids));
    s->d_len = 0;
    json_decref(s->d_calls);
    s->d_calls = NULL;
    return c;
}

/* One choice: text (completions) or message / delta (chat), with `logprobs` (consumed; NULL: null). */
static json_t *choice_json(const gw_stream *s, const char *text, size_t len, const int32_t *ids, int n_ids,
                           const char *finish, json_t *logprobs) {
    if (!text) text = "", len = 0;
    json_t *c = json_pack("{s:i}", "index", s->index);
    if (s->ep == EP_CHAT) {
        json_t *msg = json_object();
        if (!s->stream || !s->role_sent) json_object_set_new(msg, "role", json_string("assistant"));
        if (len || !s->stream || !s->role_sent) json_object_set_new(msg, "content", json_stringn(text, len));
        json_object_set_new(c, s->stream ? "delta" : "message", msg);
    } else {
        json_object_set_new(c, "text", json_stringn(text, len));
    }
    json_object_set_new(c, "logprobs", logprobs ? logprobs : json_null());
    json_object_set_new(c, "finish_reason", finish ? json_string(finish) : json_null());
    if (s->return_token_ids && (n_ids || !s->stream)) json_object_set_new(c, "token_ids", ids_json(ids, n_ids));
    return c;
}

static json_t *envelope_json(const gw_stream *s, json_t *choices) {
    return json_pack("{s:s, s:s, s:I, s:s, s:o}", "id", s->id, "object", object_name(s), "created",
                     (json_int_t)s->created, "model", s->m->name, "choices", choices);
}

/* Appends "data: <json>\n\n" to the outgoing buffer (consumes j). */
static void out_event(gw_stream *s, json_t *j) {
    char *t = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    if (!t) return;
    gw_buf_append(&s->out, &s->out_len, &s->out_cap, "data: ", 6);
    gw_buf_append(&s->out, &s->out_len, &s->out_cap, t, strlen(t));
    gw_buf_append(&s->out, &s->out_len, &s->out_cap, "\n\n", 2);
    free(t);
}

/* ------------------------------------------------------------------------------------------- pump */

/* The text due: up to the last released token's, or the echo alone before any. */
static size_t released_text(const gw_stream *s) { return s->n_released ? s->text_end[s->n_released - 1] : s->echo_len; }

static int seq_done(const gw_stream *q) { return q->finished && q->n_released == q->n_tok; }

/* The sequence of `s` that failed (the request fails with its error), or NULL. */
static gw_stream *seq_failed(const gw_stream *s) {
    for (int k = 0; k < s->n_seqs; k++)
        if (s->seqs[k]->failed) return s->seqs[k];
    return NULL;
}

/* best_of: each prompt's n sequences of highest cumulative logprob are its choices, by rank (vLLM's
 * order; ties: the earlier sequence); the others get index -1 and are not returned. */
static void pick_best(gw_stream *s) {
    if (s->per == s->n_choices) return;
    for (int i = 0; i < s->n_prompts; i++) {
        gw_stream **q = s->seqs + (size_t)i * s->per;
        for (int a = 0; a < s->per; a++) {
            int rank = 0;
            for (int b = 0; b < s->per; b++) rank += q[b]->cum_lp > q[a]->cum_lp || (q[b]->cum_lp == q[a]->cum_lp && b < a);
            q[a]->index = rank < s->n_choices ? i * s->n_choices + rank : -1;
        }
    }
}


/* Records what the gateway measured for a finished sequence (delivery side: what the user saw); a
 * prompt's tokens count once however many sequences it has. */
static void record_metrics(gw_stream *s, kvb_finish f) {
    gw_model *m = s->m;
    if (s->recorded) return;
    s->recorded = 1;
    if (f >= 0 && f < 5) m->finished[f]++;
    if (seq_lead(s) == s) m->prompt_tokens += (uint64_t)s->n_prompt;
    m->completion_tokens += (uint64_t)s->n_tok;
    gw_hist_observe(&m->req_prompt, s->n_prompt);
    gw_hist_observe(&m->req_gen, s->n_tok);
    gw_hist_observe(&m->req_max_tokens, s->max_tokens);
    double now = (double)kvb_wall_ns();
    gw_hist_observe(&m->e2e, (now - (double)s->t_arrival) / 1e9);
    if (s->n_tok == 0) return;
    gw_hist_observe(&m->decode, (double)(int64_t)(s->t_gen[s->n_tok - 1] - s->t_gen[0]) / 1e9);
    gw_hist_observe(&m->ttft, (double)(int64_t)(s->t_deliv[0] - s->t_arrival) / 1e9);
    if (s->n_tok > 1)
        gw_hist_observe(&m->tpot, (double)(s->t_deliv[s->n_tok - 1] - s->t_deliv[0]) / 1e9 / (s->n_tok - 1));
    for (int i = 1; i < s->n_tok; i++) {
        gw_hist_observe(&m->itl, (double)(s->t_deliv[i] - s->t_deliv[i - 1]) / 1e9);
        gw_hist_observe(&m->gen_itl, (double)(s->t_recv[i] - s->t_recv[i - 1]) / 1e9);
    }
}

/* Records every sequence of a request that ends: how each finished, cancelled if it had not (another
 * failed). */
static void record_all(gw_stream *s) {
    for (int k = 0; k < s->n_seqs; k++) {
        gw_stream *q = s->seqs[k];
        record_metrics(q, q->finished ? q->fin : KVB_FINISH_CANCELLED);
    }
}

/* Starts the streamed response (status and headers go out with the first write). */
static void stream_start_response(gw_stream *s) {
    h2o_req_t *req = s->req;
    req->res.status = 200;
    req->res.reason = "OK";
    h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_CONTENT_TYPE, NULL, H2O_STRLIT("text/event-stream"));
    h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_CACHE_CONTROL, NULL, H2O_STRLIT("no-cache"));
    s->gen.proceed = on_gen_proceed;
    s->gen.stop = on_gen_stop;
    h2o_start_response(req, &s->gen);
    s->head_sent = 1;
    count_http(s->g, s->ep, 200);
}

/* Hands `out` to h2o (the last thing a pump does: h2o may call back at once). h2o keeps the buffer
 * until it calls proceed; HTTP/2 copies it into a frame only when the connection next flushes and
 * HTTP/1 hands it to uv_write. A final send gets no proceed, and the stream is freed right after it,
 * so its buffer is a copy in the request's pool, which h2o frees once it is done with the request. */
static void stream_write(gw_stream *s, int final) {
    h2o_req_t *req = s->req;
    h2o_iovec_t iov = final ? h2o_strdup(&req->pool, s->out ? s->out : "", s->out_len) : h2o_iovec_init(s->out, s->out_len);
    s->sending = 1;
    if (final) {
        s->h2o_done = 1; /* h2o calls neither proceed nor stop after a final send */
        if (s->link) s->link->s = NULL;
        s->link = NULL;
        s->req = NULL;
    }
    h2o_send(req, &iov, s->out_len ? 1 : 0, final ? H2O_SEND_STATE_FINAL : H2O_SEND_STATE_IN_PROGRESS);
    if (final) stream_maybe_free(s);
}

/* A whole response's choices, in index order. */
static json_t *choices_json(gw_stream *s) {
    json_t *choices = json_array();
    for (int idx = 0; idx < s->n_prompts * s->n_choices; idx++)
        for (int k = 0; k < s->n_seqs; k++) {
            gw_stream *q = s->seqs[k];
            if (q->index != idx) continue;
            json_t *c;
            if (q->tp) { /* the whole text through the tool parser: calls only where they parse */
                gw_tool_parser_push(q->tp, q->text ? q->text : "", q->text_len, on_tool_event, q);
                gw_tool_parser_finish(q->tp, on_tool_event, q);
                c = tool_choice_json(q, q->tok, q->n_tok, finish_word(q), logprobs_json(q, 1, 0, q->n_tok));
            } else {
                c = choice_json(q, q->text, q->text_len, q->tok, q->n_tok, q->finish_reason, logprobs_json(q, 1, 0, q->n_tok));
            }
            if (q->return_token_ids && s->n_prompts > 1)
                json_object_set_new(c, "prompt_token_ids", ids_json(s->prompts[q->prompt_i].ids, q->n_prompt));
            json_array_append_new(choices, c);
        }
    return choices;
}

/* Streamed: what sequence `q` has due (its first chunk carries the echo and waits for the prompt's
 * logprobs), then its last chunk once it ended. */
static void stream_seq_events(gw_stream *s, gw_stream *q) {
    if (q->echo_lp && !seq_lead(q)->plp_done && !q->finished) return;
    size_t upto = released_text(q);
    int new_tok = q->n_released - q->sent_tok, first = !q->role_sent;
    if (q->tp) { /* the new text through the tool parser: content and tool_calls deltas */
        gw_tool_parser_push(q->tp, q->text + q->sent_text, upto - q->sent_text, on_tool_event, q);
        if (seq_done(q) && !q->failed) gw_tool_parser_finish(q->tp, on_tool_event, q); /* once: its last chunk follows */
        q->sent_text = upto;
        if (q->d_len || json_array_size(q->d_calls) || new_tok > 0 || first) {
            json_t *choices = json_array();
            json_array_append_new(choices, tool_choice_json(q, q->tok + q->sent_tok, new_tok, NULL,
                                                            logprobs_json(q, first, q->sent_tok, q->n_released)));
            out_event(s, envelope_json(s, choices));
            q->role_sent = 1;
            q->sent_tok = q->n_released;
        }
    } else if (upto > q->sent_text || new_tok > 0 || (first && s->ep == EP_CHAT)) {
        json_t *choices = json_array();
        json_array_append_new(choices, choice_json(q, q->text + q->sent_text, upto - q->sent_text, q->tok + q->sent_tok,
                                                   new_tok, NULL, logprobs_json(q, first, q->sent_tok, q->n_released)));
        out_event(s, envelope_json(s, choices));
        q->role_sent = 1;
        q->sent_text = upto;
        q->sent_tok = q->n_released;
    }
    if (!seq_done(q) || q->failed) return;
    json_t *choices = json_array();
    json_array_append_new(choices, choice_json(q, "", 0, NULL, 0, finish_word(q), NULL));
    json_t *last = envelope_json(s, choices);
    if (q->timings) json_object_set_new(last, "kvbank_timings", timings_json(q));
    out_event(s, last);
    q->fin_sent = 1;
}

/* Sends whatever is due: new text and tokens of every sequence, the end of the response. A sequence
 * that fails fails the request (the others are cancelled). */
static void stream_pump(gw_stream *s) {
    if (s->sending || s->h2o_done || !s->req) return;
    gw_stream *bad = seq_failed(s);
    int all_done = 1, any_tok = 0;
    for (int k = 0; k < s->n_seqs; k++) {
        all_done &= seq_done(s->seqs[k]);
        any_tok |= s->seqs[k]->n_tok > 0;
    }
    if (bad)
        for (int k = 0; k < s->n_seqs; k++) seq_abandon(s->seqs[k]);
    if (!s->stream) {
        if (!all_done && !bad) return;
        h2o_req_t *req = s->req;
        if (s->link) s->link->s = NULL;
        s->link = NULL;
        s->req = NULL;
        s->h2o_done = 1;
        record_all(s);
        if (bad) {
            send_error(s->g, req, s->ep, &bad->err);
        } else {
            pick_best(s);
            json_t *r = envelope_json(s, choices_json(s));
            json_object_set_new(r, "usage", usage_json(s));
            if (s->return_token_ids && s->n_prompts == 1)
                json_object_set_new(r, "prompt_token_ids", ids_json(s->prompts[0].ids, s->n_prompt));
            if (s->timings) json_object_set_new(r, "kvbank_timings", timings_json(s));
            send_json(s->g, req, s->ep, 200, r);
        }
        stream_maybe_free(s);
        return;
    }
    if (!s->head_sent) {
        if (bad && !any_tok) {
            /* nothing streamed yet: a plain error response */
            h2o_req_t *req = s->req;
            if (s->link) s->link->s = NULL;
            s->link = NULL;
            s->req = NULL;
            s->h2o_done = 1;
            record_all(s);
            send_error(s->g, req, s->ep, &bad->err);
            stream_maybe_free(s);
            return;
        }
        stream_start_response(s);
    }
    s->out_len = 0;
    int final = 0;
    if (!bad) {
        all_done = 1;
        for (int k = 0; k < s->n_seqs; k++) {
            if (!s->seqs[k]->fin_sent) stream_seq_events(s, s->seqs[k]);
            all_done &= s->seqs[k]->fin_sent;
        }
    }
    if (bad || all_done) {
        if (bad) {
            size_t n = 0;
            char *b = gw_error_body(&bad->err, &n);
            if (b) {
                gw_buf_append(&s->out, &s->out_len, &s->out_cap, "data: ", 6);
                gw_buf_append(&s->out, &s->out_len, &s->out_cap, b, n);
                gw_buf_append(&s->out, &s->out_len, &s->out_cap, "\n\n", 2);
                free(b);
            }
        } else if (s->include_usage) {
            json_t *u = envelope_json(s, json_array());
            json_object_set_new(u, "usage", usage_json(s));
            out_event(s, u);
        }
        gw_buf_append(&s->out, &s->out_len, &s->out_cap, "data: [DONE]\n\n", 14);
        final = 1;
        record_all(s);
    }
    if (s->out_len || final) stream_write(s, final);
}

static void arm_deposit_timer(gw_stream *s);

/* Releases every token of every sequence whose delivery time has come and arms the timer for the
 * next one. */
static void stream_release(gw_stream *s) {
    uint64_t now = kvb_wall_ns();
    for (int k = 0; k < s->n_seqs; k++) {
        gw_stream *q = s->seqs[k];
        while (q->n_released < q->n_tok && (q->finished || q->t_deliv[q->n_released] <= now)) {
            if (q->finished && q->t_deliv[q->n_released] > now) {
                q->t_deliv[q->n_released] = now; /* the rest at once on finish (OrbitFlow §3.2) */
                q->m->deposit_held++;
            }
            q->n_released++;
        }
    }
    arm_deposit_timer(s);
    stream_pump(s);
}

static void on_deposit_timer(uv_timer_t *t) { stream_release(t->data); }

static void arm_deposit_timer(gw_stream *s) {
    uint64_t now = kvb_wall_ns(), due = UINT64_MAX;
    for (int k = 0; k < s->n_seqs; k++) {
        gw_stream *q = s->seqs[k];
        if (q->n_released < q->n_tok && !q->finished) due = KVB_MIN(due, q->t_deliv[q->n_released]);
    }
    if (due == UINT64_MAX) return;
    uint64_t ms = due > now ? (due - now + 999999) / 1000000 : 0;
    uv_timer_start(&s->timer, on_deposit_timer, ms, 0);
}

/* ------------------------------------------------------------------------------ upstream events */

static kvb_status grow_tokens(gw_stream *s, int need) {
    if (need <= s->cap_tok) return KVB_OK;
    int cap = s->cap_tok ? s->cap_tok : 16;
    while (cap < need) cap *= 2;
    KVB_TRY(kvb_realloc_array((void **)&s->tok, (size_t)cap, sizeof *s->tok));
    KVB_TRY(kvb_realloc_array((void **)&s->t_gen, (size_t)cap, sizeof *s->t_gen));
    KVB_TRY(kvb_realloc_array((void **)&s->t_recv, (size_t)cap, sizeof *s->t_recv));
    KVB_TRY(kvb_realloc_array((void **)&s->t_deliv, (size_t)cap, sizeof *s->t_deliv));
    KVB_TRY(kvb_realloc_array((void **)&s->text_end, (size_t)cap, sizeof *s->text_end));
    KVB_TRY(kvb_realloc_array((void **)&s->lp, (size_t)cap, sizeof *s->lp));
    KVB_TRY(kvb_realloc_array((void **)&s->off, (size_t)cap, sizeof *s->off));
    if (s->logprobs && s->top_logprobs) {
        KVB_TRY(kvb_realloc_array((void **)&s->top_ids, (size_t)cap * s->top_logprobs, sizeof *s->top_ids));
        KVB_TRY(kvb_realloc_array((void **)&s->top_lp, (size_t)cap * s->top_logprobs, sizeof *s->top_lp));
    }
    s->cap_tok = cap;
    return KVB_OK;
}

static void stream_fail(gw_stream *s, int status, const char *type, const char *fmt, const char *detail) {
    s->failed = 1;
    s->fin = KVB_FINISH_ERROR;
    s->finished = 1;
    gw_error_set(&s->err, status, type, NULL, fmt, detail);
}

static int status_for(kvb_status st) {
    switch (st) {
    case KVB_ERR_INVALID: return 400;
    case KVB_ERR_EXHAUSTED: return 429;
    case KVB_ERR_TIMEOUT: return 503;
    case KVB_ERR_BUSY: return 503;
    default: return 500;
    }
}

/* A model's failure as the stream's error: the status the code maps to; capacity the model lacks now
 * (KVB_ERR_BUSY: KV blocks lent, not borrowed yet) is a 503 the client may retry after a while. */
static void stream_fail_upstream(gw_stream *s, kvb_status st, const char *err) {
    stream_fail(s, status_for(st), st == KVB_ERR_INVALID ? "invalid_request_error" : "server_error", "%s",
                err && *err ? err : kvb_status_str(st));
    if (st == KVB_ERR_BUSY) {
        s->err.retry_after_s = s->g->o->retry_after_s;
        char more[KVB_NAME_MAX_GW + 96];
        snprintf(more, sizeof more, " (model '%s' lacks the KV memory for this request now; retry after %d s)",
                 s->m->name, s->err.retry_after_s);
        size_t n = strlen(s->err.message);
        snprintf(s->err.message + n, sizeof s->err.message - n, "%s", more);
    }
}

/* The prompt's logprobs an event of the prompt's first sequence carries (echo with logprobs). */
static void take_prompt_logprobs(gw_stream *s, const kvb_client_logprobs *lp) {
    int t = s->top_logprobs;
    if (!s->plp || !lp || !lp->n_prompt || lp->top_n != t) return;
    for (int j = 0; j < lp->n_prompt; j++) {
        int pos = lp->prompt_first + j;
        if (pos < 1 || pos >= s->n_prompt) continue;
        s->plp[pos] = lp->prompt_lp[j];
        if (t) {
            memcpy(s->ptop_ids + (size_t)pos * t, lp->prompt_top_ids + (size_t)j * t, (size_t)t * sizeof *s->ptop_ids);
            memcpy(s->ptop_lp + (size_t)pos * t, lp->prompt_top_lp + (size_t)j * t, (size_t)t * sizeof *s->ptop_lp);
        }
        s->n_plp = KVB_MAX(s->n_plp, pos);
    }
}

static void on_upstream(void *ud, uint64_t rid, const int32_t *tokens, const uint64_t *t_ns, int n, int first_index,
                        kvb_finish finish, kvb_status st, const char *err,
                        const kvb_client_logprobs *lp) {
    gw_stream *s = ud;
    (void)rid;
    (void)first_index;
    uint64_t now = kvb_wall_ns();
    int stop_hit = 0;
    take_prompt_logprobs(s, lp);
    /* prompt logprobs come with the prefill, before the first token */
    if (n > 0 || finish != KVB_FINISH_NONE) s->plp_done = 1;
    if (s->echo_only) n = 0; /* max_tokens 0: the one token the model was asked for is not part of the answer */
    int lp_ok = lp && lp->lp && (!s->logprobs || lp->top_n == s->top_logprobs);
    if (!s->finished && n > 0 && grow_tokens(s, s->n_tok + n) != KVB_OK) {
        stream_fail(s, 500, "server_error", "%s", "out of memory");
        stop_hit = 1;
    }
    for (int k = 0; k < n && !s->finished && !stop_hit; k++) {
        int i = s->n_tok++;
        s->tok[i] = tokens[k];
        s->lp[i] = lp_ok ? lp->lp[k] : 0;
        s->cum_lp += s->lp[i];
        if (s->top_ids) {
            size_t t = (size_t)s->top_logprobs;
            if (lp_ok) {
                memcpy(s->top_ids + (size_t)i * t, lp->top_ids + (size_t)k * t, t * sizeof *s->top_ids);
                memcpy(s->top_lp + (size_t)i * t, lp->top_lp + (size_t)k * t, t * sizeof *s->top_lp);
            } else {
                memset(s->top_ids + (size_t)i * t, 0, t * sizeof *s->top_ids);
                memset(s->top_lp + (size_t)i * t, 0, t * sizeof *s->top_lp);
            }
        }
        s->off[i] = s->n_chars;
        s->t_gen[i] = t_ns[k];
        s->t_recv[i] = now;
        s->t_deliv[i] = kvb_deposit_next(i == 0, i ? s->t_deliv[i - 1] : 0, now, s->slo_ns);
        /* text: detokenize, then stop strings (a model without a tokenizer streams token ids only) */
        if (s->detok) {
            const char *piece = "";
            size_t plen = 0;
            if (kvb_detok_push(s->detok, tokens[k], &piece, &plen) != KVB_OK) plen = 0;
            if (tokens[k] == s->tool_marker) { /* a special token starting a call: the parser needs its text */
                piece = gw_tool_format_marker(s->tool_fmt);
                plen = strlen(piece);
            }
            s->n_chars += utf8_chars(piece, plen);
            int r = gw_stop_push(s->stopper, piece, plen, &s->text, &s->text_len, &s->text_cap, NULL);
            if (r > 0) stop_hit = 1;
        }
        s->text_end[i] = s->text_len;
    }
    if (stop_hit && !s->finished) {
        s->finished = 1;
        s->finish_reason = "stop";
        s->upstream_live = 0;
        kvb_client_abandon(s->m->client, s->rid); /* no more callbacks: safe inside dispatch */
        s->fin = KVB_FINISH_STOP;
    } else if (finish != KVB_FINISH_NONE && !s->finished) {
        s->upstream_live = 0;
        size_t gl = strlen(KVB_WIRE_GRAMMAR_ERROR);
        if (st != KVB_OK && s->grammar_field[0] && err && !strncmp(err, KVB_WIRE_GRAMMAR_ERROR, gl)) {
            /* the model could not compile the request's grammar: the request's fault, named */
            stream_fail(s, 400, "invalid_request_error", "%s", "");
            gw_error_set(&s->err, 400, "invalid_request_error", s->grammar_field, "'%s' cannot be used: %s",
                         s->grammar_field, err + gl);
        } else if (st != KVB_OK) {
            stream_fail_upstream(s, st, err);
        } else {
            s->finished = 1;
            int tail_stop = 0;
            if (s->detok) {
                const char *piece = "";
                size_t plen = 0;
                if (kvb_detok_flush(s->detok, &piece, &plen) == KVB_OK && plen)
                    tail_stop = gw_stop_push(s->stopper, piece, plen, &s->text, &s->text_len, &s->text_cap, NULL) > 0;
            }
            if (s->stopper && !tail_stop) gw_stop_flush(s->stopper, &s->text, &s->text_len, &s->text_cap);
            if (tail_stop) finish = KVB_FINISH_STOP;
            if (s->n_tok) s->text_end[s->n_tok - 1] = s->text_len;
            if (s->echo_only && finish == KVB_FINISH_STOP) finish = KVB_FINISH_LENGTH; /* as vLLM says of max_tokens 0 */
            s->finish_reason = finish == KVB_FINISH_LENGTH ? "length" : finish == KVB_FINISH_STOP ? "stop" : NULL;
            if (finish == KVB_FINISH_CANCELLED) stream_fail(s, 503, "server_error", "%s", "the model cancelled the request");
        }
        s->fin = s->failed ? KVB_FINISH_ERROR : finish;
    } else if (finish != KVB_FINISH_NONE) {
        s->upstream_live = 0;
    }
    gw_stream *h = s->head;
    if (h->h2o_done) {
        stream_maybe_free(h);
        return;
    }
    stream_release(h);
}

/* -------------------------------------------------------------------------------- model clients */

static void on_model_readable(uv_poll_t *p, int status, int events) {
    gw_model *m = p->data;
    (void)status;
    (void)events;
    if (m->client && kvb_client_dispatch(m->client) != KVB_OK) KVB_LOG_W("gateway: model %s: socket error", m->name);
}

/* A Pong counts only from the process the coordinator registered under the model's name: the
 * coordinator checked that pid at registration (SO_PEERCRED), the client reads the sender's pid from
 * the kernel too, so another process that took over the endpoint's path is not trusted. */
static void on_pong(void *ud, const kvb_client_pong *p) {
    gw_model *m = ud;
    int impostor = p->peer_pid > 0 && m->pid && (uint32_t)p->peer_pid != m->pid;
    if (impostor && !m->impostor)
        KVB_LOG_E("gateway: model %s: its endpoint %s is served by pid %d, but the coordinator registered pid %u: "
                  "not routing to it", m->name, m->endpoint, (int)p->peer_pid, m->pid);
    m->impostor = impostor;
    if (impostor) return;
    m->verified = 1;
    m->pong = *p;
    m->pong_ns = kvb_now_ns();
}

/* Ends every stream of `m` with an error (its endpoint changed or went away). */
static void fail_model_streams(gw *g, gw_model *m, const char *why) {
    for (gw_stream *s = g->streams, *nx; s; s = nx) {
        nx = s->next;
        if (s->m != m || !upstream_any(s)) continue;
        for (int k = 0; k < s->n_seqs; k++) {
            gw_stream *q = s->seqs[k];
            if (!q->upstream_live) continue;
            q->upstream_live = 0;
            if (!q->finished) stream_fail(q, 503, "server_error", "%s", why);
        }
        if (s->h2o_done) stream_maybe_free(s);
        else stream_release(s);
    }
}

static void on_poll_closed(uv_handle_t *h) {
    gw_model *m = h->data;
    kvb_client_destroy(m->client);
    m->client = NULL;
    m->poll_open = 0;
}

static void model_disconnect(gw_model *m) {
    m->verified = 0;
    if (!m->client) return;
    fail_model_streams(m->g, m, "the model's endpoint changed; the request was lost");
    if (m->poll_open) {
        uv_poll_stop(&m->poll);
        uv_close((uv_handle_t *)&m->poll, on_poll_closed);
    } else {
        kvb_client_destroy(m->client);
        m->client = NULL;
    }
}

static kvb_status model_connect(gw_model *m) {
    if (m->client || m->poll_open) return KVB_OK;
    KVB_TRY(kvb_client_connect(m->endpoint, &m->client));
    kvb_client_set_pong_fn(m->client, on_pong, m);
    int fd = kvb_client_fd(m->client);
    if (fd < 0 || uv_poll_init(m->g->loop, &m->poll, fd) != 0) {
        kvb_client_destroy(m->client);
        m->client = NULL;
        return KVB_ERR_IO;
    }
    m->poll.data = m;
    m->poll_open = 1;
    uv_poll_start(&m->poll, UV_READABLE, on_model_readable);
    KVB_LOG_I("gateway: model %s at %s", m->name, m->endpoint);
    return KVB_OK;
}

static gw_model *model_find(gw *g, const char *name) {
    for (int i = 0; i < g->n_models; i++)
        if (!strcmp(g->models[i]->name, name)) return g->models[i];
    return NULL;
}

static gw_model *model_add(gw *g, const char *name) {
    if (g->n_models == GW_MAX_MODELS || strlen(name) >= KVB_NAME_MAX_GW) return NULL;
    gw_model *m = NULL;
    if (kvb_calloc(1, sizeof *m, (void **)&m) != KVB_OK) return NULL;
    m->g = g;
    snprintf(m->name, sizeof m->name, "%s", name);
    m->tbt_slo_ms = -1;
    gw_hist_init(&m->ttft, &GW_HIST_TTFT);
    gw_hist_init(&m->tpot, &GW_HIST_TOKEN);
    gw_hist_init(&m->itl, &GW_HIST_TOKEN);
    gw_hist_init(&m->gen_itl, &GW_HIST_TOKEN);
    gw_hist_init(&m->e2e, &GW_HIST_REQUEST);
    gw_hist_init(&m->decode, &GW_HIST_REQUEST);
    gw_hist_init(&m->req_prompt, &GW_HIST_COUNT);
    gw_hist_init(&m->req_gen, &GW_HIST_COUNT);
    gw_hist_init(&m->req_max_tokens, &GW_HIST_COUNT);
    g->models[g->n_models++] = m;
    return m;
}

/* A chat request to a model without a usable chat template: why, when it has one that does not parse. */
static void no_chat_error(gw_error *err, const gw_model *m) {
    if (m->tmpl_why[0])
        gw_error_set(err, 400, "invalid_request_error", "messages",
                     "model '%s' is served without chat: its chat template cannot be used (%s)", m->name, m->tmpl_why);
    else gw_error_set(err, 400, "invalid_request_error", "messages", "model '%s' has no chat template", m->name);
}

/* Reads config.json of the model directory (vocabulary, context length, EOS ids) once it is known. */
static void model_load_dir(gw_model *m) {
    if (m->have_cfg || !m->model_dir[0]) return;
    if (kvb_model_config_load(m->model_dir, &m->cfg) == KVB_OK) {
        m->have_cfg = 1;
        /* a model without tokenizer.json is a normal case (it takes token ids): said at info below */
        char tj[sizeof m->model_dir + 16];
        snprintf(tj, sizeof tj, "%s/tokenizer.json", m->model_dir);
        kvb_status ts = access(tj, F_OK) == 0 ? kvb_tokenizer_load(m->model_dir, &m->tok) : KVB_ERR_NOT_FOUND;
        if (ts != KVB_OK && ts != KVB_ERR_NOT_FOUND)
            KVB_LOG_W("gateway: model %s: its tokenizer cannot be used (%s); it takes token ids only", m->name,
                      kvb_status_str(ts));
        if (m->tok) { /* the budgets are set before any worker thread uses them */
            kvb_tokenizer_set_limits(m->tok, &m->g->o->text_limits);
            ts = kvb_chat_template_load_why(m->model_dir, &m->tmpl, m->tmpl_why, sizeof m->tmpl_why);
            if (m->tmpl) kvb_chat_template_set_limits(m->tmpl, &m->g->o->text_limits);
            if (ts != KVB_OK && ts != KVB_ERR_NOT_FOUND)
                KVB_LOG_W("gateway: model %s: served without chat: its chat template cannot be used (%s)", m->name,
                          m->tmpl_why);
        }
        m->tool_marker = -1;
        m->tool_fmt = m->tmpl ? gw_tool_format_detect(m->tmpl, m->tok) : GW_TOOLS_NONE;
        if (m->tool_fmt != GW_TOOLS_NONE) {
            int32_t id = kvb_tokenizer_token_id(m->tok, gw_tool_format_marker(m->tool_fmt));
            if (id >= 0 && kvb_tokenizer_is_special(m->tok, id)) m->tool_marker = id;
        }
        KVB_LOG_I("gateway: model %s: %s, %s, tool calls: %s", m->name, m->tok ? "tokenizer" : "no tokenizer (token ids only)",
                  m->tmpl ? "chat template" : "no chat template", gw_tool_format_name(m->tool_fmt));
        KVB_LOG_I("gateway: model %s: %s (vocab %d, context %d, %d EOS ids)", m->name, m->model_dir, m->cfg.vocab,
                  m->cfg.max_pos, m->cfg.n_eos);
    } else {
        KVB_LOG_W("gateway: model %s: cannot read %s/config.json", m->name, m->model_dir);
    }
}

/* ---------------------------------------------------------------------------------- coordinator */

static void status_apply(gw *g, const Kvbank__StatusReply *r) {
    g->coord_ns = kvb_now_ns();
    g->epoch = r->epoch;
    g->dropped = r->dropped_messages;
    snprintf(g->coord_id, sizeof g->coord_id, "%s", r->coordinator_id ? r->coordinator_id : "");
    for (size_t i = 0; i < r->n_models; i++) {
        const Kvbank__ModelStatus *ms = r->models[i];
        if (!ms->name || !*ms->name) continue;
        gw_model *m = model_find(g, ms->name);
        if (!m && !(m = model_add(g, ms->name))) continue;
        m->alive = ms->alive;
        if (m->pid != ms->pid) m->verified = 0; /* a new process: trusted once it answers as itself */
        m->pid = ms->pid;
        m->role = (int)ms->role;
        m->n_own = ms->n_own;
        m->n_lent = ms->n_lent;
        m->n_borrowed = ms->n_borrowed;
        m->capacity = ms->capacity;
        if (ms->geom) m->block_size = (int)ms->geom->block_size;
        m->lends = ms->lends;
        m->reclaims = ms->reclaims;
        m->lend_ms_total = ms->lend_ms_total;
        m->reclaim_ms_total = ms->reclaim_ms_total;
        if (!m->model_dir[0] && ms->model && ms->model[0] == '/') snprintf(m->model_dir, sizeof m->model_dir, "%s", ms->model);
        model_load_dir(m);
        const char *ep = ms->endpoint ? ms->endpoint : "";
        if (ms->alive && *ep && strcmp(ep, m->endpoint)) {
            model_disconnect(m);
            snprintf(m->endpoint, sizeof m->endpoint, "%s", ep);
        }
        if (ms->alive && m->endpoint[0] && model_connect(m) != KVB_OK)
            KVB_LOG_W("gateway: cannot connect to model %s at %s", m->name, m->endpoint);
    }
}

static void on_coord_readable(uv_poll_t *p, int status, int events) {
    gw *g = p->data;
    (void)status;
    (void)events;
    for (;;) {
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        if (zmq_msg_recv(&msg, g->coord, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&msg);
            break;
        }
        Kvbank__Envelope *env = NULL;
        if (!zmq_msg_more(&msg) &&
            kvb_wire_decode(zmq_msg_data(&msg), zmq_msg_size(&msg), &env, NULL) == KVB_OK) {
            if (env->body_case == KVBANK__ENVELOPE__BODY_STATUS_REPLY) status_apply(g, env->status_reply);
            kvbank__envelope__free_unpacked(env, NULL);
        }
        zmq_msg_close(&msg);
    }
}

static void on_status_timer(uv_timer_t *t) {
    gw *g = t->data;
    Kvbank__StatusRequest sr = KVBANK__STATUS_REQUEST__INIT;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_STATUS_REQUEST;
    env.status_request = &sr;
    kvb_wire_send(g->coord, NULL, 0, &env, 1);
    on_coord_readable(&g->coord_poll, 0, 0); /* the send may have consumed the fd's edge */
    for (int i = 0; i < g->n_models; i++) {
        gw_model *m = g->models[i];
        if (!m->client) continue;
        kvb_client_ping_send(m->client, NULL);
        kvb_client_dispatch(m->client);
    }
}

/* --------------------------------------------------------------------------------- housekeeping */

/* 1 when the HTTP/1 peer of `s` closed its side (nothing to read but EOF). */
static int peer_closed(gw_stream *s) {
    if (!s->req || !s->http1 || !s->req->conn->callbacks->get_socket) return 0;
    h2o_socket_t *sock = s->req->conn->callbacks->get_socket(s->req->conn);
    int fd = sock ? h2o_socket_get_fd(sock) : -1;
    if (fd < 0) return 0;
    char c;
    ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

/* The drain (docs/gateway.md): /health fails at once (readiness), no new connection is accepted,
 * HTTP/2 clients get GOAWAY and HTTP/1 responses end their connections; requests in flight finish
 * until drain_timeout_ms; idle connections are closed as they become idle. */
static void begin_drain(gw *g) {
    g->draining = 1;
    g->drain_deadline_ns = kvb_now_ns() + (uint64_t)g->o->drain_timeout_ms * 1000000u;
    KVB_LOG_I("gateway: draining: %d requests in flight may finish within %d ms; no new connections", g->n_streams,
              g->o->drain_timeout_ms);
    uv_close((uv_handle_t *)&g->listener, NULL);
    h2o_context_request_shutdown(&g->h2o_ctx);
}

/* The drain is over: every request still in flight ends (its model request cancelled), every
 * connection is shut, and the loop runs until h2o has closed them (at most SHUTDOWN_MS) so that
 * everything is freed. */
static void begin_shutdown(gw *g) {
    g->stopping = 1;
    g->stop_deadline_ns = kvb_now_ns() + (uint64_t)SHUTDOWN_MS * 1000000u;
    if (g->n_streams) KVB_LOG_W("gateway: stopping: %d requests still in flight are cancelled", g->n_streams);
    else KVB_LOG_I("gateway: stopping: every request finished");
    uv_timer_stop(&g->status_timer);
    for (gw_stream *s = g->streams, *nx; s; s = nx) {
        nx = s->next;
        stream_abandon_upstream(s);
        for (int k = 0; k < s->n_seqs; k++) {
            gw_stream *q = s->seqs[k];
            if (!q->finished) stream_fail(q, 503, "server_error", "%s", "the gateway is stopping");
            q->n_released = q->n_tok;
        }
        if (s->h2o_done) stream_maybe_free(s);
        else if (!s->sending) stream_pump(s);
    }
}

static void on_housekeep(uv_timer_t *t) {
    gw *g = t->data;
    if (*g->stop && !g->draining) begin_drain(g);
    if (g->draining && !g->stopping && ((!g->streams && !g->jobs) || kvb_now_ns() > g->drain_deadline_ns))
        begin_shutdown(g);
    if (g->draining) /* idle connections end now, busy ones once their requests are answered */
        for (gw_conn *c = g->conns; c; c = c->next)
            if (!c->n_streams || g->stopping) conn_shut(c);
    if (g->stopping) {
        if ((!g->conns && !g->streams) || kvb_now_ns() > g->stop_deadline_ns) uv_stop(g->loop);
        return;
    }
    for (gw_stream *s = g->streams, *nx; s; s = nx) {
        nx = s->next;
        if (s->h2o_done || s->sending || !peer_closed(s)) continue;
        /* The client is gone: cancel upstream, then let h2o find the dead socket by writing to it. */
        g->disconnects++;
        KVB_LOG_I("gateway: %s: the client closed its connection; cancelling its request", s->id);
        stream_abandon_upstream(s);
        for (int k = 0; k < s->n_seqs; k++) record_metrics(s->seqs[k], KVB_FINISH_CANCELLED);
        h2o_req_t *req = s->req;
        s->req->http1_is_persistent = 0;
        if (s->link) s->link->s = NULL;
        s->link = NULL;
        s->req = NULL;
        s->h2o_done = 1;
        if (s->head_sent) h2o_send(req, NULL, 0, H2O_SEND_STATE_ERROR);
        else send_body(g, req, s->ep, 499, "text/plain", "", 0);
        stream_maybe_free(s);
    }
    /* A request's deadline: its model must keep answering pings. A model whose endpoint vanished (or
     * went to an impostor) would otherwise leave its requests waiting with no headers for good. */
    uint64_t now = kvb_now_ns(), silent = (uint64_t)SILENT_FACTOR * (uint64_t)g->o->status_ms * 1000000u;
    for (gw_stream *s = g->streams, *nx; s; s = nx) {
        nx = s->next;
        uint64_t heard = KVB_MAX(s->m->pong_ns, s->submit_ns);
        if (!upstream_any(s) || now - heard < silent) continue;
        KVB_LOG_W("gateway: %s: model %s has not answered for %.0f s; failing the request", s->id, s->m->name,
                  (double)(now - heard) / 1e9);
        stream_abandon_upstream(s);
        for (int k = 0; k < s->n_seqs; k++) {
            gw_stream *q = s->seqs[k];
            if (!q->finished) stream_fail(q, 503, "server_error", "%s", "the model stopped answering");
            q->n_released = q->n_tok;
        }
        if (s->h2o_done) stream_maybe_free(s);
        else if (!s->sending) stream_pump(s);
    }
    for (int i = 0; i < g->n_models; i++)
        if (g->models[i]->client) kvb_client_dispatch(g->models[i]->client);
}

/* ------------------------------------------------------------------------------------- handlers */

static int path_is(const h2o_req_t *req, const char *p) {
    size_t n = strlen(p);
    return req->path_normalized.len == n && !memcmp(req->path_normalized.base, p, n);
}

static int method_is(const h2o_req_t *req, const char *m) {
    size_t n = strlen(m);
    return req->method.len == n && !memcmp(req->method.base, m, n);
}

/* The value of query parameter `key` in req->path (copied into out[len]); 0 if absent. */
static int query_param(const h2o_req_t *req, const char *key, char *out, size_t len) {
    if (req->query_at == SIZE_MAX) return 0;
    const char *q = req->path.base + req->query_at + 1, *end = req->path.base + req->path.len;
    size_t kl = strlen(key);
    while (q < end) {
        const char *amp = memchr(q, '&', (size_t)(end - q));
        const char *e = amp ? amp : end;
        if ((size_t)(e - q) > kl && !memcmp(q, key, kl) && q[kl] == '=') {
            size_t n = KVB_MIN((size_t)(e - q - kl - 1), len - 1);
            memcpy(out, q + kl + 1, n);
            out[n] = '\0';
            return 1;
        }
        q = e + 1;
    }
    return 0;
}

static int coordinator_answers(const gw *g) {
    return g->coord_ns && kvb_now_ns() - g->coord_ns < (uint64_t)STALE_FACTOR * (uint64_t)g->o->status_ms * 1000000u;
}

static int model_answers(const gw *g, const gw_model *m) {
    return m->alive && m->pong_ns && !m->impostor &&
           kvb_now_ns() - m->pong_ns < (uint64_t)STALE_FACTOR * (uint64_t)g->o->status_ms * 1000000u;
}

/* Readiness. /health?model=NAME: that model answers (per-model readiness); /health: the node can
 * serve, i.e. the coordinator and at least one model answer, so that one model that crash-loops does
 * not take the others out of a load balancer. Both fail as soon as a drain starts. */
static void handle_health(gw *g, h2o_req_t *req, int ep) {
    char name[KVB_NAME_MAX_GW + 1];
    int ok = coordinator_answers(g);
    const char *why = ok ? NULL : "the coordinator does not answer\n";
    if (g->draining) ok = 0, why = "draining\n";
    if (query_param(req, "model", name, sizeof name)) {
        gw_model *m = model_find(g, name);
        if (!m) ok = 0, why = "no such model\n";
        else if (ok && !model_answers(g, m)) ok = 0, why = "the model does not answer\n";
    } else if (ok) {
        int any = 0;
        for (int i = 0; i < g->n_models; i++) any |= model_answers(g, g->models[i]);
        if (!any) ok = 0, why = "no model answers\n";
    }
    if (ok) send_body(g, req, ep, 200, "text/plain", "ok\n", 3);
    else send_body(g, req, ep, 503, "text/plain", why, strlen(why));
}

/* The longest request (prompt and completion) model m serves, what /v1/models advertises and the only
 * length the gateway refuses by (0: not known): its context (config.json), for a worker at most what
 * its KV memory holds (a worker never borrows). A master's own memory is no bound: it borrows, and a
 * request that does not fit what it holds now waits for loans (kvb_engine_opts.borrows). */
static int model_context(const gw_model *m) {
    int n = m->have_cfg ? m->cfg.max_pos : 0;
    if (m->role == KVB_ROLE_WORKER && m->capacity > 0 && m->block_size > 0) {
        int64_t mem = (int64_t)m->capacity * m->block_size;
        if (!n || mem < n) n = (int)KVB_MIN(mem, (int64_t)INT32_MAX);
    }
    return n;
}

/* 1 when a request of `tokens` (prompt and completion) needs more KV blocks than model m's pool held
 * at its last Pong: it will wait for blocks (or fail with 503 after the model's stall wait). */
static int model_short_of_blocks(const gw_model *m, int64_t tokens) {
    return m->block_size > 0 && m->pong_ns && KVB_DIV_CEIL(tokens, m->block_size) > (int64_t)m->pong.blocks_total;
}

/* A model's card (OpenAI's Model object, with vLLM's root and max_model_len). */
static json_t *model_card(const gw_model *m) {
    json_t *o = json_pack("{s:s, s:s, s:I, s:s, s:s}", "id", m->name, "object", "model", "created", (json_int_t)0,
                          "owned_by", "kvbank", "root", m->model_dir);
    if (o && model_context(m)) json_object_set_new(o, "max_model_len", json_integer(model_context(m)));
    return o;
}

static void handle_models(gw *g, h2o_req_t *req) {
    json_t *data = json_array();
    for (int i = 0; i < g->n_models; i++)
        if (g->models[i]->alive) json_array_append_new(data, model_card(g->models[i]));
    send_json(g, req, EP_MODELS, 200, json_pack("{s:s, s:o}", "object", "list", "data", data));
}

/* GET /v1/models/{model}: the card of a model that /v1/models lists, else 404. */
static void handle_model(gw *g, h2o_req_t *req, size_t prefix) {
    char name[KVB_NAME_MAX_GW + 1], clip[NAME_ECHO + 8];
    size_t n = req->path_normalized.len - prefix;
    snprintf(name, sizeof name, "%.*s", (int)KVB_MIN(n, sizeof name - 1), req->path_normalized.base + prefix);
    gw_model *m = n < sizeof name ? model_find(g, name) : NULL;
    if (m && m->alive) {
        send_json(g, req, EP_MODEL, 200, model_card(m));
        return;
    }
    gw_error err;
    gw_error_set(&err, 404, "not_found_error", "model", "The model '%s' does not exist on this node",
                 gw_clip(name, clip, sizeof clip));
    send_error(g, req, EP_MODEL, &err);
}

/* The model a request names, alive and connected; fills *err otherwise. */
static gw_model *model_for(gw *g, const char *name, gw_error *err) {
    gw_model *m = model_find(g, name);
    if (!m || (!m->alive && !m->client)) {
        char clip[NAME_ECHO + 8];
        gw_error_set(err, 404, "not_found_error", "model", "The model '%s' does not exist on this node",
                     gw_clip(name, clip, sizeof clip));
        return NULL;
    }
    if (!m->alive || !m->client) {
        gw_error_set(err, 503, "server_error", "model", "The model '%s' is not running now", name);
        return NULL;
    }
    if (m->impostor) {
        gw_error_set(err, 503, "server_error", "model",
                     "The endpoint of model '%s' is served by another process than the one registered", name);
        return NULL;
    }
    if (!m->verified) {
        gw_error_set(err, 503, "server_error", "model", "The model '%s' has not answered yet", name);
        return NULL;
    }
    return m;
}

/* ------------------------------------------------------------------------------- text off the loop
 *
 * Rendering a chat template and tokenizing a prompt cost what the client sends (a 320 KB prompt of
 * combining marks, a template loop): they run on libuv's thread pool (text_workers threads), never
 * on the loop, so no request can hold up another. A job holds the parsed body (which only its worker
 * touches while it runs) and the model's tokenizer and template (immutable while the gateway runs);
 * its result comes back on the loop in job_done. A client that leaves meanwhile disposes its request:
 * the job's link in the request's pool clears job->req and the result is dropped (a job not started
 * yet is cancelled). */

typedef enum gw_job_kind { JOB_GENERATE, JOB_TOKENIZE, JOB_DETOKENIZE } gw_job_kind;

typedef struct gw_job gw_job;
typedef struct job_link {
    gw_job *j;
} job_link;

struct gw_job {
    uv_work_t work;               /* work.data: the job */
    gw *g;
    gw_job *prev, *next;          /* gw.jobs */
    gw_job_kind kind;
    int ep;
    h2o_req_t *req;               /* NULL once h2o disposed it */
    job_link *link;               /* in req's pool */
    gw_conn *conn;                /* NULL once closed */
    gw_model *m;
    json_t *doc;                  /* the parsed body (owned) */
    gw_params p;                  /* JOB_GENERATE (borrows doc); the worker fills p.prompts[].ids */
    gw_tok_params tp;             /* JOB_TOKENIZE / JOB_DETOKENIZE (borrows doc) */
    int failed;
    gw_error err;
    char *body;                   /* JOB_TOKENIZE / JOB_DETOKENIZE: the response JSON (malloc'd) */
};

static void generate_submit(gw *g, h2o_req_t *req, int ep, gw_params *p, gw_model *m);

static void job_fail(gw_job *j, int status, const char *param, const char *fmt, const char *detail) {
    j->failed = 1;
    gw_error_set(&j->err, status, status >= 500 ? "server_error" : "invalid_request_error", param, fmt, detail);
}

/* The gateway setting of the render budget a failed render's message names (the text layer's words:
 * common/text/jinja_eval.c), or NULL for the nesting bound, which is the template language's. */
static const char *render_budget_field(const char *terr) {
    if (strstr(terr, "memory budget")) return "render_memory_mb";
    if (strstr(terr, "output budget")) return "render_output_kb";
    if (strstr(terr, "budget of") && strstr(terr, "steps")) return "render_steps";
    return NULL;
}

/* A render that failed: the template's own error (raise_exception, a bad expression) is 400 "the chat
 * template failed"; a budget spent is 413 for the output and memory budgets (the request asked for
 * more text than the gateway renders), 400 for the step budget and the nesting bound, naming the
 * gateway's setting. */
static void job_render_failed(gw_job *j, kvb_status st, const char *terr) {
    char msg[400];
    if (st == KVB_ERR_EXHAUSTED) {
        const char *field = render_budget_field(terr);
        if (field) snprintf(msg, sizeof msg, "%s (the gateway's \"%s\")", terr, field);
        else snprintf(msg, sizeof msg, "%s", terr);
        job_fail(j, field && strcmp(field, "render_steps") ? 413 : 400, "messages",
                 "rendering the chat template ran over a budget: %s", msg);
    } else if (st == KVB_ERR_NOMEM) {
        job_fail(j, 500, NULL, "%s", "out of memory");
    } else {
        job_fail(j, 400, "messages", "the chat template failed: %s", terr);
    }
}

/* A tokenization that failed: invalid UTF-8 is 400, the encode budget spent 413 naming it. */
static void job_encode_failed(gw_job *j, kvb_status st, const char *param, size_t len) {
    char msg[160];
    if (st == KVB_ERR_EXHAUSTED) {
        snprintf(msg, sizeof msg, "%zu bytes, more than the tokenizer's budget of %zu (the gateway's \"encode_kb\")", len,
                 j->g->o->text_limits.encode_bytes);
        job_fail(j, 413, param, "the text to tokenize is %s", msg);
    } else if (st == KVB_ERR_INVALID) {
        job_fail(j, 400, param, "%s", "the prompt is not valid UTF-8 text");
    } else {
        job_fail(j, 500, NULL, "tokenizing failed: %s", kvb_status_str(st));
    }
}

/* The text of a prompt: `text`, or the chat template rendered over `messages`; *owned is set when the
 * result is a new buffer. On the worker. */
static int job_text(gw_job *j, const char *text, size_t len, json_t *messages, int add_gen, json_t *kwargs,
                    const char **out, size_t *out_len, char **owned) {
    char terr[256] = "";
    *owned = NULL;
    if (messages) {
        kvb_status rs = kvb_chat_render(j->m->tmpl, messages, add_gen, kwargs, owned, terr, sizeof terr);
        if (rs != KVB_OK) {
            job_render_failed(j, rs, terr);
            return 0;
        }
        text = *owned;
        len = strlen(*owned);
    }
    size_t max = j->g->o->max_text ? j->g->o->max_text : j->g->o->max_body;
    if (len > max) {
        char what[96];
        snprintf(what, sizeof what, "%zu bytes, more than the %zu", len, max);
        job_fail(j, 413, messages ? "messages" : "prompt", "the text to tokenize is %s this gateway takes", what);
        return 0;
    }
    *out = text;
    *out_len = len;
    return 1;
}

/* The template's variables for a chat request: chat_template_kwargs with the request's `tools` added,
 * and messages whose assistant tool_calls carry their arguments as objects and whose null content is ""
 * (what vLLM's rendering passes: templates `tojson` the arguments and test `'x' in content`). New
 * references, NULL where nothing changes. */
static void chat_vars(const gw_params *p, json_t **msgs, json_t **extra) {
    *msgs = *extra = NULL;
    if (p->tools) {
        *extra = p->template_kwargs ? json_copy(p->template_kwargs) : json_object();
        if (*extra && !json_object_get(*extra, "tools")) json_object_set(*extra, "tools", p->tools);
    }
    if (!p->has_tool_messages || !(*msgs = json_deep_copy(p->messages))) return;
    for (size_t i = 0; i < json_array_size(*msgs); i++) {
        json_t *m = json_array_get(*msgs, i), *tc = json_object_get(m, "tool_calls");
        json_t *c = json_object_get(m, "content");
        if (!c || json_is_null(c)) json_object_set_new(m, "content", json_string("")); /* as vLLM renders a call's null content */
        for (size_t k = 0; k < json_array_size(tc); k++) {
            json_t *fn = json_object_get(json_array_get(tc, k), "function"), *a = json_object_get(fn, "arguments");
            json_t *o = json_is_string(a) ? json_loads(json_string_value(a), JSON_DECODE_ANY, NULL) : NULL;
            if (o) json_object_set_new(fn, "arguments", o);
        }
    }
}

static void job_run(uv_work_t *w) {
    gw_job *j = w->data;
    const char *text = NULL;
    size_t len = 0;
    char *owned = NULL;
    if (j->kind == JOB_GENERATE) {
        gw_params *p = &j->p;
        int chat = j->ep == EP_CHAT;
        json_t *msgs = NULL, *extra = NULL; /* chat: the template's view of tools and tool calls */
        if (chat) chat_vars(p, &msgs, &extra);
        for (int i = 0; i < p->n_prompts && !j->failed; i++) { /* chat: one, the messages */
            gw_prompt *pr = &p->prompts[i];
            if (!chat && !pr->text) continue;
            if (job_text(j, pr->text, pr->len, chat ? (msgs ? msgs : p->messages) : NULL, p->add_generation_prompt,
                         extra ? extra : p->template_kwargs, &text, &len, &owned)) {
                kvb_status es = kvb_tokenizer_encode(j->m->tok, text, len, p->add_special_tokens, &pr->ids, &pr->n_ids);
                if (es != KVB_OK) job_encode_failed(j, es, chat ? "messages" : "prompt", len);
                else if (pr->n_ids == 0) job_fail(j, 400, chat ? "messages" : "prompt", "%s", "the prompt is empty");
            }
            free(owned);
            owned = NULL;
        }
        json_decref(msgs);
        json_decref(extra);
    } else if (j->kind == JOB_DETOKENIZE) {
        char *out = NULL;
        size_t n = 0;
        kvb_status ds = kvb_tokenizer_decode(j->m->tok, j->tp.ids, j->tp.n_ids, 0, &out, &n);
        if (ds == KVB_ERR_EXHAUSTED) {
            char msg[160];
            snprintf(msg, sizeof msg, "%d token ids, more than the detokenizer's budget of %zu (the gateway's \"decode_ids\")",
                     j->tp.n_ids, j->g->o->text_limits.decode_ids);
            job_fail(j, 413, "tokens", "%s", msg);
        } else if (ds == KVB_ERR_INVALID) {
            job_fail(j, 400, "tokens", "a token id is outside the vocabulary of '%s'", j->m->name);
        } else if (ds != KVB_OK) {
            job_fail(j, 500, NULL, "detokenizing failed: %s", kvb_status_str(ds));
        } else {
            json_t *o = json_pack("{s:s%}", "prompt", out, n);
            j->body = o ? json_dumps(o, JSON_COMPACT) : NULL;
            json_decref(o);
        }
        free(out);
    } else {
        gw_tok_params *tp = &j->tp;
        if (job_text(j, tp->prompt, tp->prompt_len, tp->messages, tp->add_generation_prompt, NULL, &text, &len,
                     &owned)) {
            int32_t *ids = NULL;
            int n = 0;
            kvb_status es = kvb_tokenizer_encode(j->m->tok, text, len, tp->add_special_tokens, &ids, &n);
            if (es != KVB_OK) {
                job_encode_failed(j, es, tp->messages ? "messages" : "prompt", len);
            } else {
                json_t *o = json_pack("{s:i, s:i, s:o}", "count", n, "max_model_len",
                                      model_context(j->m), "tokens", ids_json(ids, n));
                j->body = o ? json_dumps(o, JSON_COMPACT) : NULL;
                json_decref(o);
            }
            free(ids);
        }
    }
    free(owned);
    if (!j->failed && j->kind != JOB_GENERATE && !j->body) job_fail(j, 500, NULL, "%s", "out of memory");
}

static void job_free(gw_job *j) {
    gw *g = j->g;
    if (j->prev) j->prev->next = j->next;
    else if (g->jobs == j) g->jobs = j->next;
    if (j->next) j->next->prev = j->prev;
    g->n_jobs--;
    if (j->conn) j->conn->n_streams--;
    if (j->link) j->link->j = NULL;
    gw_params_free(&j->p);
    gw_tok_params_free(&j->tp);
    json_decref(j->doc);
    free(j->body);
    free(j);
}

static void job_done(uv_work_t *w, int status) {
    gw_job *j = w->data;
    gw *g = j->g;
    h2o_req_t *req = j->req;
    if (status == 0 && req) {
        if (j->failed) send_error(g, req, j->ep, &j->err);
        else if (j->kind == JOB_GENERATE) generate_submit(g, req, j->ep, &j->p, j->m);
        else send_body(g, req, j->ep, 200, "application/json", j->body, strlen(j->body));
    }
    job_free(j);
}

/* The client of a job's request left (h2o disposes the request). */
static void on_job_req_dispose(void *p) {
    job_link *l = p;
    if (!l->j) return;
    l->j->req = NULL;
    l->j->link = NULL;
    l->j->g->disconnects++;
    conn_count_reset(l->j->g, l->j->conn);
    uv_cancel((uv_req_t *)&l->j->work); /* a job not started yet ends now (job_done with UV_ECANCELED) */
    l->j = NULL;
}

/* Queues a job for `req`; takes doc (and the params borrowing it). On failure answers 500. */
static void job_start(gw *g, h2o_req_t *req, int ep, gw_job_kind kind, gw_model *m, json_t *doc, const gw_params *p,
                      const gw_tok_params *tp) {
    gw_job *j = calloc(1, sizeof *j);
    if (!j) {
        json_decref(doc);
        if (p) gw_params_free((gw_params *)p);
        if (tp) gw_tok_params_free((gw_tok_params *)tp);
        send_body(g, req, ep, 500, "text/plain", "out of memory\n", 14);
        return;
    }
    j->g = g;
    j->kind = kind;
    j->ep = ep;
    j->req = req;
    j->m = m;
    j->doc = doc;
    if (p) j->p = *p;
    if (tp) j->tp = *tp;
    j->work.data = j;
    j->link = h2o_mem_alloc_shared(&req->pool, sizeof *j->link, on_job_req_dispose);
    j->link->j = j;
    j->conn = conn_of(g, req);
    if (j->conn) j->conn->n_streams++;
    j->next = g->jobs;
    if (g->jobs) g->jobs->prev = j;
    g->jobs = j;
    g->n_jobs++;
    if (uv_queue_work(g->loop, &j->work, job_run, job_done) != 0) {
        j->req = NULL;
        send_body(g, req, ep, 500, "text/plain", "cannot queue the request\n", 25);
        job_free(j);
    }
}

/* Counts the ignored fields of a request; the first request with a field logs its name, once per
 * field for the gateway's life (a client sending them on every request fills no log). */
static void note_ignored(gw *g, const gw_params *p) {
    const gw_field *fields = gw_fields(NULL);
    for (int i = 0; i < p->n_ignored; i++) {
        int k = p->ignored[i];
        if (k < 0 || k >= g->n_fields) continue;
        if (!g->ignored[k]++)
            KVB_LOG_I("gateway: requests carry '%s', which this server accepts and ignores (as vLLM does); "
                      "logged once", fields[k].name);
    }
}

static void handle_generate(gw *g, h2o_req_t *req, int ep) {
    gw_error err;
    gw_params p;
    json_t *doc = NULL;
    const char *body = req->entity.base ? req->entity.base : "";
    if (gw_params_parse(ep == EP_CHAT ? GW_CHAT : GW_COMPLETIONS, body, req->entity.len, &p, &doc, &err) != KVB_OK) {
        send_error(g, req, ep, &err);
        return;
    }
    note_ignored(g, &p);
    gw_model *m = model_for(g, p.model, &err);
    if (!m) goto reject;
    if (g->n_streams + g->n_jobs >= g->o->max_streams) {
        g->rejected_busy++;
        gw_error_set(&err, 429, "rate_limit_error", NULL, "the gateway has %d requests in flight, its limit",
                     g->n_streams + g->n_jobs);
        goto reject;
    }
    int text = ep == EP_CHAT;
    for (int i = 0; i < p.n_prompts; i++) text |= p.prompts[i].text != NULL;
    if ((text || p.n_stop) && !m->tok) {
        gw_error_set(&err, 400, "invalid_request_error", ep == EP_CHAT ? "messages" : p.n_stop ? "stop" : "prompt",
                     "model '%s' has no tokenizer (tokenizer.json): send the prompt as token ids, without stop strings",
                     m->name);
        goto reject;
    }
    if (ep == EP_CHAT && !m->tmpl) {
        no_chat_error(&err, m);
        goto reject;
    }
    if ((p.n_grammar || p.tool_choice >= GW_TOOL_REQUIRED) && !m->tok) {
        gw_error_set(&err, 400, "invalid_request_error", p.grammar_field ? p.grammar_field : "tool_choice",
                     "model '%s' has no tokenizer (tokenizer.json): structured output needs one", m->name);
        goto reject;
    }
    if (p.tools && p.tool_choice != GW_TOOL_NONE && m->tool_fmt == GW_TOOLS_NONE) {
        gw_error_set(&err, 400, "invalid_request_error", "tools",
                     "model '%s': its chat template writes tool calls in no format this server parses (Llama 3.x JSON, "
                     "<tool_call> as Qwen, [TOOL_CALLS] as Mistral)", m->name);
        goto reject;
    }
    if (text) { /* the prompts as token ids: on the thread pool */
        job_start(g, req, ep, JOB_GENERATE, m, doc, &p, NULL);
        return;
    }
    generate_submit(g, req, ep, &p, m);
    gw_params_free(&p);
    json_decref(doc);
    return;
reject:
    gw_params_free(&p);
    json_decref(doc);
    send_error(g, req, ep, &err);
}

/* The echo of a choice (gw_params.echo): completions, the prompt (its text, or its ids decoded); chat
 * (vLLM), the last message's content when it has the reply's role. Appended to q->text. */
static kvb_status seq_echo(gw_stream *q, const gw_params *p, const gw_prompt *pr) {
    char *dec = NULL;
    const char *t = NULL;
    size_t n = 0;
    if (q->ep == EP_CHAT) {
        json_t *last = json_array_get(p->messages, json_array_size(p->messages) - 1);
        json_t *role = json_object_get(last, "role"), *c = json_object_get(last, "content");
        if (json_is_string(role) && !strcmp(json_string_value(role), "assistant") && json_is_string(c))
            t = json_string_value(c), n = json_string_length(c);
    } else if (pr->text) {
        t = pr->text, n = pr->len;
    } else if (q->m->tok) {
        KVB_TRY(kvb_tokenizer_decode(q->m->tok, pr->ids, pr->n_ids, 0, &dec, &n));
        t = dec;
    }
    kvb_status st = n ? gw_buf_append(&q->text, &q->text_len, &q->text_cap, t, n) : KVB_OK;
    q->echo_len = q->text_len;
    q->n_chars = utf8_chars(q->text, q->text_len);
    free(dec);
    return st;
}

/* Sets up sequence `k` of stream `s` (its head, set up already): prompt, limits, outputs, echo. */
static kvb_status seq_init(gw_stream *s, gw_stream *q, int k, const gw_params *p, const int *max_tokens) {
    q->head = s;
    q->g = s->g;
    q->m = s->m;
    q->ep = s->ep;
    q->stream = s->stream;
    q->return_token_ids = s->return_token_ids;
    q->timings = s->timings;
    q->slo_ns = s->slo_ns;
    q->t_arrival = s->t_arrival;
    q->prompt_i = k / s->per;
    q->index = q->prompt_i * s->n_choices + k % s->per; /* best_of ranks them at the end */
    q->n_prompt = s->prompts[q->prompt_i].n_ids;
    q->max_tokens = max_tokens[q->prompt_i];
    q->echo_only = p->echo_only;
    q->logprobs = p->logprobs;
    q->top_logprobs = p->logprobs ? p->top_logprobs : 0;
    q->tokens_as_ids = p->return_tokens_as_ids;
    q->echo_lp = p->echo && p->logprobs && q->ep == EP_COMPLETIONS;
    if (q->echo_lp && k % s->per == 0) { /* the prompt's first sequence asks for its logprobs */
        size_t t = (size_t)q->top_logprobs;
        KVB_TRY(kvb_calloc((size_t)q->n_prompt, sizeof *q->plp, (void **)&q->plp));
        if (t) {
            KVB_TRY(kvb_calloc((size_t)q->n_prompt * t, sizeof *q->ptop_ids, (void **)&q->ptop_ids));
            KVB_TRY(kvb_calloc((size_t)q->n_prompt * t, sizeof *q->ptop_lp, (void **)&q->ptop_lp));
        }
    }
    if (s->m->tok) {
        KVB_TRY(kvb_detok_create(s->m->tok, p->skip_special_tokens, &q->detok));
        KVB_TRY(gw_stop_create(p->stop, p->stop_len, p->n_stop, p->include_stop_str, &q->stopper));
    }
    return p->echo ? seq_echo(q, p, &s->prompts[q->prompt_i]) : KVB_OK;
}

/* The rest of a completion once its prompts are token ids (on the loop): checks against the model,
 * the stream and its sequences (prompts x max(n, best_of), all submitted at once: the engine shares a
 * prompt's KV among them through its prefix cache), the submits. Borrows p (the caller frees it; the
 * stream takes its prompts and logit_bias). */
static void generate_submit(gw *g, h2o_req_t *req, int ep, gw_params *p, gw_model *m) {
    gw_error err;
    gw_stream *s = NULL;
    int max_tokens[GW_MAX_CHOICES];
    if (!m->alive || !m->client || m->impostor) {
        gw_error_set(&err, 503, "server_error", "model", "The model '%s' is not running now", m->name);
        goto reject;
    }
    int max_pos = model_context(m);
    for (int i = 0; i < p->n_prompts; i++) {
        const gw_prompt *pr = &p->prompts[i];
        char what[32] = "prompt";
        if (p->n_prompts > 1) snprintf(what, sizeof what, "prompt %d", i);
        if (m->have_cfg)
            for (int k = 0; k < pr->n_ids; k++)
                if (pr->ids[k] >= m->cfg.vocab) {
                    gw_error_set(&err, 400, "invalid_request_error", "prompt",
                                 "%s token %d is %d, outside the vocabulary of model '%s' [0, %d)", what, k, pr->ids[k],
                                 m->name, m->cfg.vocab);
                    goto reject;
                }
        if (max_pos && pr->n_ids >= max_pos) {
            gw_error_set(&err, 400, "invalid_request_error", "prompt",
                         "the %s has %d tokens; model '%s' takes at most %d (prompt and completion together)", what,
                         pr->n_ids, m->name, max_pos);
            goto reject;
        }
        int mt = p->max_tokens;
        if (!mt) mt = ep == EP_CHAT && max_pos ? max_pos - pr->n_ids : DEFAULT_MAX_TOKENS;
        if (max_pos && pr->n_ids + mt > max_pos) {
            if (p->max_tokens) {
                gw_error_set(&err, 400, "invalid_request_error", "max_tokens",
                             "max_tokens is %d, but the %s has %d tokens and model '%s' takes %d in all", p->max_tokens,
                             what, pr->n_ids, m->name, max_pos);
                goto reject;
            }
            mt = max_pos - pr->n_ids;
        }
        max_tokens[i] = p->echo_only ? 1 : mt;
    }
    for (int i = 0; i < p->n_logit_bias; i++)
        if (m->have_cfg && p->logit_bias[i].id >= m->cfg.vocab) {
            gw_error_set(&err, 400, "invalid_request_error", "logit_bias",
                         "'logit_bias' names token %d, outside the vocabulary of model '%s' [0, %d)",
                         (int)p->logit_bias[i].id, m->name, m->cfg.vocab);
            goto reject;
        }
    int32_t stop_ids[GW_MAX_STOP_IDS + 8];
    int n_stop_ids = 0;
    for (int i = 0; i < p->n_stop_ids; i++) stop_ids[n_stop_ids++] = p->stop_ids[i];
    if (!p->ignore_eos) {
        const int32_t *eos = NULL;
        int n_eos = m->tok ? kvb_tokenizer_eos_ids(m->tok, &eos) : 0;
        for (int i = 0; i < n_eos && n_stop_ids < (int)KVB_ARRAY_LEN(stop_ids); i++) stop_ids[n_stop_ids++] = eos[i];
        if (!n_eos && m->have_cfg)
            for (int i = 0; i < m->cfg.n_eos && n_stop_ids < (int)KVB_ARRAY_LEN(stop_ids); i++)
                stop_ids[n_stop_ids++] = m->cfg.eos_ids[i];
    }

    int per = KVB_MAX(p->n, p->best_of), n_seqs = per * p->n_prompts;
    if (kvb_calloc(1, sizeof *s, (void **)&s) != KVB_OK) {
        gw_error_set(&err, 500, "server_error", NULL, "out of memory");
        goto reject;
    }
    s->g = g;
    s->m = m;
    s->req = req;
    s->ep = ep;
    s->http1 = req->version < 0x200;
    s->created = (int64_t)time(NULL);
    snprintf(s->id, sizeof s->id, "%s-%016" PRIx64 "%08x", ep == EP_CHAT ? "chatcmpl" : "cmpl", ++g->next_id,
             (unsigned)(kvb_wall_ns() & 0xffffffffu));
    s->stream = p->stream;
    s->include_usage = p->include_usage;
    s->return_token_ids = p->return_token_ids;
    s->timings = p->timings;
    double slo = p->tbt_slo_ms >= 0 ? p->tbt_slo_ms : m->tbt_slo_ms >= 0 ? m->tbt_slo_ms : g->o->tbt_slo_ms;
    s->slo_ns = p->stream ? (uint64_t)(slo * 1e6) : 0; /* pacing is for what a user watches arrive */
    s->t_arrival = kvb_wall_ns();
    s->prompts = p->prompts;
    s->n_prompts = p->n_prompts;
    p->prompts = NULL;
    p->n_prompts = 0;
    s->logit_bias = p->logit_bias;
    p->logit_bias = NULL;
    s->per = per;
    s->n_choices = p->n;
    uv_timer_init(g->loop, &s->timer);
    s->timer.data = s;
    kvb_status st = kvb_calloc((size_t)n_seqs, sizeof *s->seqs, (void **)&s->seqs);
    if (st == KVB_OK) s->seqs[s->n_seqs++] = s;
    while (st == KVB_OK && s->n_seqs < n_seqs && (st = kvb_calloc(1, sizeof **s->seqs, (void **)&s->seqs[s->n_seqs])) == KVB_OK)
        s->n_seqs++;
    for (int k = 0; k < s->n_seqs && st == KVB_OK; k++) st = seq_init(s, s->seqs[k], k, p, max_tokens);
    if (st != KVB_OK) {
        uv_close((uv_handle_t *)&s->timer, on_stream_timer_closed);
        gw_error_set(&err, 500, "server_error", NULL, "out of memory");
        goto reject;
    }
    /* structured output: the request's own grammar, or a forced tool call in the model's format; chat
     * with tools: one parser per sequence turns its text into content and tool_calls */
    gw_tool_grammar tg = {0};
    if (p->tool_choice == GW_TOOL_REQUIRED || p->tool_choice == GW_TOOL_NAMED) {
        char why[384];
        if (gw_tool_grammar_build(m->tool_fmt, p->tools, p->tool_choice == GW_TOOL_NAMED ? p->tool_name : NULL,
                                  p->parallel_tool_calls, &tg, why, sizeof why) != KVB_OK) {
            uv_close((uv_handle_t *)&s->timer, on_stream_timer_closed);
            gw_error_set(&err, 400, "invalid_request_error", "tools", "%s", why);
            goto reject;
        }
    }
    const kvb_grammar_part *grammar = tg.n_parts ? tg.parts : p->grammar;
    int n_grammar = tg.n_parts ? tg.n_parts : p->n_grammar;
    for (int k = 0; k < s->n_seqs && st == KVB_OK; k++) {
        gw_stream *q = s->seqs[k];
        snprintf(q->grammar_field, sizeof q->grammar_field, "%s", tg.n_parts ? "tools" : p->grammar_field ? p->grammar_field : "");
        q->tool_marker = -1;
        if (!p->tools || p->tool_choice == GW_TOOL_NONE) continue;
        q->tool_fmt = m->tool_fmt;
        if (p->skip_special_tokens) q->tool_marker = m->tool_marker;
        st = gw_tool_parser_create(m->tool_fmt, !p->stream, p->parallel_tool_calls, &q->tp);
    }
    if (st != KVB_OK) {
        gw_tool_grammar_free(&tg);
        uv_close((uv_handle_t *)&s->timer, on_stream_timer_closed);
        gw_error_set(&err, 500, "server_error", NULL, "out of memory");
        goto reject;
    }
    /* Everything in place before the submits: the model's answer may come within the dispatch below. */
    s->link = h2o_mem_alloc_shared(&req->pool, sizeof *s->link, on_req_dispose);
    s->link->s = s;
    s->conn = conn_of(g, req);
    if (s->conn) s->conn->n_streams++;
    s->next = g->streams;
    if (g->streams) g->streams->prev = s;
    g->streams = s;
    g->n_streams++;
    m->n_streams++;
    uint64_t seed = p->has_seed ? p->seed : (kvb_wall_ns() ^ (g->next_id * 0x9e3779b97f4a7c15ull));
    char msg[256];
    for (int k = 0; k < s->n_seqs; k++) {
        gw_stream *q = s->seqs[k];
        const gw_prompt *pr = &s->prompts[q->prompt_i];
        kvb_request r = {
            .tbt_slo_ms = slo, /* the model's planner sees the target too (OrbitFlow) */
            .prompt = pr->ids,
            .n_prompt = pr->n_ids,
            .max_tokens = q->max_tokens,
            .stop_ids = stop_ids,
            .n_stop = n_stop_ids,
            .sampling = {.temperature = (float)p->temperature,
                         .top_k = p->top_k,
                         .top_p = (float)p->top_p,
                         .seed = seed + (uint64_t)(k % per), /* vLLM's n: the seed plus the choice's index */
                         .min_p = (float)p->min_p,
                         .presence_penalty = (float)p->presence_penalty,
                         .frequency_penalty = (float)p->frequency_penalty,
                         .repetition_penalty = (float)p->repetition_penalty,
                         .min_tokens = p->min_tokens,
                         .logit_bias = s->logit_bias,
                         .n_logit_bias = p->n_logit_bias,
                         /* best_of ranks by the logprobs: asked for then too */
                         .logprobs = p->logprobs || per > p->n,
                         .top_logprobs = q->top_logprobs,
                         .prompt_logprobs = q->plp != NULL},
            .grammar = grammar,
            .n_grammar = n_grammar,
            .grammar_flags = tg.n_parts ? 0 : p->grammar_flags,
        };
        st = kvb_client_submit(m->client, &r, on_upstream, q, SUBMIT_TIMEOUT_MS, &q->rid, msg, sizeof msg);
        if (st != KVB_OK) break;
        q->upstream_live = 1;
    }
    gw_tool_grammar_free(&tg); /* the client keeps its own copy */
    if (st != KVB_OK) {
        gw_error_set(&err, st == KVB_ERR_INVALID ? 400 : 503, st == KVB_ERR_INVALID ? "invalid_request_error" : "server_error",
                     "prompt", "%s", msg);
        for (int k = 0; k < s->n_seqs; k++) seq_abandon(s->seqs[k]);
        s->link->s = NULL;
        s->link = NULL;
        stream_unlink(s);
        uv_close((uv_handle_t *)&s->timer, on_stream_timer_closed);
        s = NULL;
        kvb_client_dispatch(m->client);
        goto reject;
    }
    s->submit_ns = kvb_now_ns();
    /* The response head goes out at once, unless the model may still refuse the grammar (a 400), or
     * the request waits for KV blocks the model lacks now: then it goes with the first token, so that
     * running out of time is still a 503 with Retry-After. */
    int short_of_blocks = 0;
    for (int i = 0; i < s->n_prompts; i++)
        short_of_blocks |= model_short_of_blocks(m, (int64_t)s->prompts[i].n_ids + max_tokens[i]);
    if (s->stream && !n_grammar && !short_of_blocks) stream_pump(s);
    kvb_client_dispatch(m->client); /* the send may have consumed the fd's edge */
    return;
reject:
    send_error(g, req, ep, &err);
}

/* vLLM's POST /tokenize (prompt or messages -> ids) and POST /detokenize (ids -> text): on the thread
 * pool. */
static void handle_tokens(gw *g, h2o_req_t *req, int ep) {
    gw_error err;
    gw_tok_params p;
    json_t *doc = NULL;
    const char *body = req->entity.base ? req->entity.base : "";
    if (gw_tok_params_parse(ep == EP_DETOKENIZE, body, req->entity.len, &p, &doc, &err) != KVB_OK) {
        send_error(g, req, ep, &err);
        return;
    }
    gw_model *m = model_find(g, p.model);
    if (!m) {
        char clip[NAME_ECHO + 8];
        gw_error_set(&err, 404, "not_found_error", "model", "The model '%s' does not exist on this node",
                     gw_clip(p.model, clip, sizeof clip));
    } else if (!m->tok) {
        gw_error_set(&err, 400, "invalid_request_error", "model", "model '%s' has no tokenizer", m->name);
    } else if (p.messages && !m->tmpl) {
        no_chat_error(&err, m);
    } else if (g->n_streams + g->n_jobs >= g->o->max_streams) {
        g->rejected_busy++;
        gw_error_set(&err, 429, "rate_limit_error", NULL, "the gateway has %d requests in flight, its limit",
                     g->n_streams + g->n_jobs);
    } else {
        job_start(g, req, ep, ep == EP_DETOKENIZE ? JOB_DETOKENIZE : JOB_TOKENIZE, m, doc, NULL, &p);
        return;
    }
    gw_tok_params_free(&p);
    json_decref(doc);
    send_error(g, req, ep, &err);
}

/* /metrics: the whole node in Prometheus' text format. */
static void handle_metrics(gw *g, h2o_req_t *req);

/* Whether the request may pass: no keys configured, an open /health or /metrics, or a Bearer key that
 * is one of the keys. Keys are compared by their SHA-256 in constant time (neither a key's bytes nor
 * its length shows in the time an answer takes). */
static int authorized(gw *g, h2o_req_t *req) {
    if (!g->o->n_api_keys) return 1;
    if ((g->o->health_open && (path_is(req, "/health") || path_is(req, "/ping"))) ||
        (g->o->metrics_open && path_is(req, "/metrics")))
        return 1;
    ssize_t i = h2o_find_header(&req->headers, H2O_TOKEN_AUTHORIZATION, -1);
    if (i < 0) return 0;
    h2o_iovec_t v = req->headers.entries[i].value;
    if (v.len < 7 || strncasecmp(v.base, "Bearer ", 7) != 0) return 0;
    uint8_t d[KVB_SHA256_BYTES];
    kvb_sha256_digest(v.base + 7, v.len - 7, d);
    int ok = 0;
    for (int k = 0; k < g->o->n_api_keys; k++) ok |= kvb_memcmp_ct(d, g->key_digest[k], sizeof d) == 0;
    return ok;
}

static int on_req(h2o_handler_t *self, h2o_req_t *req) {
    gw *g = *(gw **)(self + 1);
    gw_conn *c = conn_of(g, req);
    if (c && req->version >= 0x200) c->http2 = 1;
    if (g->draining) req->http1_is_persistent = 0; /* the connection ends with this response */
    if (c && c->closing) { /* closed for abuse: what it still had buffered gets no work done */
        req->http1_is_persistent = 0;
        send_body(g, req, EP_OTHER, 503, "text/plain", "closing\n", 8);
        return 0;
    }
    int ep = EP_OTHER;
    if (!authorized(g, req)) {
        gw_error e;
        gw_error_set(&e, 401, "invalid_request_error", NULL, "%s",
                     "a valid API key is required: send it as 'Authorization: Bearer KEY'");
        e.code = "invalid_api_key";
        g->unauthorized++;
        h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_WWW_AUTHENTICATE, NULL, H2O_STRLIT("Bearer"));
        send_error(g, req, EP_OTHER, &e);
        return 0;
    }
    static const size_t models_len = sizeof "/v1/models/" - 1;
    for (int e = 0; e < EP_OTHER; e++)
        if (e != EP_MODEL && path_is(req, EP_NAMES[e])) ep = e;
    if (req->path_normalized.len > models_len && !memcmp(req->path_normalized.base, "/v1/models/", models_len))
        ep = EP_MODEL;
    /* what each endpoint answers: POST for work, GET and HEAD for what is read, all three for /ping
     * (vLLM's, which load balancers probe with either) */
    int post = ep == EP_COMPLETIONS || ep == EP_CHAT || ep == EP_TOKENIZE || ep == EP_DETOKENIZE;
    int get = !post || ep == EP_PING;
    gw_error err;
    if (ep == EP_OTHER) {
        char clip[NAME_ECHO + 8], path[NAME_ECHO + 8];
        snprintf(path, sizeof path, "%.*s", (int)KVB_MIN(req->path.len, sizeof path - 1), req->path.base);
        gw_error_set(&err, 404, "not_found_error", NULL, "no endpoint %s", gw_clip(path, clip, NAME_ECHO));
        send_error(g, req, ep, &err);
        return 0;
    }
    if (!((post || ep == EP_PING) && method_is(req, "POST")) && !(get && (method_is(req, "GET") || method_is(req, "HEAD")))) {
        const char *allow = ep == EP_PING ? "GET, HEAD, POST" : post ? "POST" : "GET, HEAD";
        h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_ALLOW, NULL, allow, strlen(allow));
        gw_error_set(&err, 405, "invalid_request_error", NULL, "%s takes %s", EP_NAMES[ep], allow);
        send_error(g, req, ep, &err);
        return 0;
    }
    switch (ep) {
    case EP_COMPLETIONS:
    case EP_CHAT: handle_generate(g, req, ep); break;
    case EP_MODELS: handle_models(g, req); break;
    case EP_MODEL: handle_model(g, req, models_len); break;
    case EP_HEALTH:
    case EP_PING: handle_health(g, req, ep); break;
    case EP_METRICS: handle_metrics(g, req); break;
    case EP_VERSION:
        send_json(g, req, ep, 200, json_pack("{s:s}", "version", kvb_version()));
        break;
    default: handle_tokens(g, req, ep); break;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------- /metrics */

/* A histogram of every model: its name, help and where it is in gw_model. */
typedef struct hist_family {
    const char *name, *help;
    size_t off;
} hist_family;

/* The families `f[n]`, one series per model labelled `key`="<model name>". */
static void hist_families(gw_text *t, const gw *g, const hist_family *f, size_t n, const char *key) {
    char lab[256], esc[160];
    for (size_t h = 0; h < n; h++) {
        gw_metric_head(t, f[h].name, "histogram", f[h].help);
        for (int i = 0; i < g->n_models; i++) {
            const gw_model *m = g->models[i];
            gw_label_escape(m->name, esc, sizeof esc);
            snprintf(lab, sizeof lab, "%s=\"%s\"", key, esc);
            gw_metric_hist(t, f[h].name, lab, (const gw_hist *)((const char *)m + f[h].off));
        }
    }
}

static void handle_metrics(gw *g, h2o_req_t *req) {
    gw_text t = {0};
    char lab[256], esc[160];
    gw_metric_head(&t, "kvbank_coordinator_up", "gauge", "1 when the coordinator answered within three status periods");
    gw_metric_sample(&t, "kvbank_coordinator_up", "", coordinator_answers(g));
    gw_metric_head(&t, "kvbank_coordinator_epoch", "gauge", "The ledger's epoch (grows with every loan change)");
    gw_metric_sample(&t, "kvbank_coordinator_epoch", "", (double)g->epoch);
    gw_metric_head(&t, "kvbank_coordinator_dropped_messages_total", "counter",
                   "Messages the coordinator dropped (malformed, wrong version, unregistered sender)");
    gw_metric_sample(&t, "kvbank_coordinator_dropped_messages_total", "", (double)g->dropped);

    /* per model, one family at a time */
#define FOR_MODELS for (int i = 0; i < g->n_models; i++)
#define LAB(m) (gw_label_escape((m)->name, esc, sizeof esc), snprintf(lab, sizeof lab, "model=\"%s\"", esc), lab)
#define GAUGE(name, help, expr)                                                                                        \
    do {                                                                                                               \
        gw_metric_head(&t, name, "gauge", help);                                                                       \
        FOR_MODELS {                                                                                                   \
            gw_model *m = g->models[i];                                                                                \
            gw_metric_sample(&t, name, LAB(m), (double)(expr));                                                        \
        }                                                                                                              \
    } while (0)
#define COUNTER(name, help, expr)                                                                                      \
    do {                                                                                                               \
        gw_metric_head(&t, name, "counter", help);                                                                     \
        FOR_MODELS {                                                                                                   \
            gw_model *m = g->models[i];                                                                                \
            gw_metric_sample(&t, name, LAB(m), (double)(expr));                                                        \
        }                                                                                                              \
    } while (0)
    GAUGE("kvbank_model_up", "1 when the model is registered alive and answered the gateway's last ping",
          model_answers(g, m));
    GAUGE("kvbank_requests_running", "Sequences the model's engine is running", m->pong.running);
    GAUGE("kvbank_requests_waiting", "Sequences waiting in the model's queue", m->pong.waiting);
    COUNTER("kvbank_prompt_tokens_total", "Prompt tokens the model prefilled (recomputed ones included)",
            m->pong.prompt_tokens);
    COUNTER("kvbank_generation_tokens_total", "Tokens the model generated", m->pong.generated_tokens);
    COUNTER("kvbank_preemptions_total", "Sequences the model preempted (recompute)", m->pong.preemptions);
    COUNTER("kvbank_prefix_cache_hit_tokens_total", "Prompt tokens served from the prefix cache",
            m->pong.prefix_hit_tokens);
    GAUGE("kvbank_kv_blocks_capacity", "KV blocks in the model's pool (own and borrowed)", m->pong.blocks_total);
    GAUGE("kvbank_kv_blocks_free", "KV blocks free or evictable", m->pong.blocks_free);
    GAUGE("kvbank_kv_blocks_own", "KV blocks of the model's own memory in use by its pool", m->n_own);
    GAUGE("kvbank_kv_blocks_lent", "KV blocks this worker has lent to the master", m->n_lent);
    GAUGE("kvbank_kv_blocks_borrowed", "KV blocks (master blocks) the master has borrowed", m->n_borrowed);
    GAUGE("kvbank_kv_cache_usage_ratio", "Fraction of the pool's KV blocks in use (0..1)",
          m->pong.blocks_total ? 1.0 - (double)m->pong.blocks_free / m->pong.blocks_total : 0.0);
    COUNTER("kvbank_lends_total", "Loans of this worker that became active", m->lends);
    COUNTER("kvbank_reclaims_total", "Loans of this worker given back after a revocation", m->reclaims);
    gw_metric_head(&t, "kvbank_lend_latency_seconds", "summary", "Offer accepted to the master's GrantAck");
    FOR_MODELS {
        gw_model *m = g->models[i];
        LAB(m);
        gw_metric_sample(&t, "kvbank_lend_latency_seconds_sum", lab, (double)m->lend_ms_total / 1000.0);
        gw_metric_sample(&t, "kvbank_lend_latency_seconds_count", lab, (double)m->lends);
    }
    gw_metric_head(&t, "kvbank_reclaim_latency_seconds", "summary", "Revoke to the master's RevokeAck");
    FOR_MODELS {
        gw_model *m = g->models[i];
        LAB(m);
        gw_metric_sample(&t, "kvbank_reclaim_latency_seconds_sum", lab, (double)m->reclaim_ms_total / 1000.0);
        gw_metric_sample(&t, "kvbank_reclaim_latency_seconds_count", lab, (double)m->reclaims);
    }
    COUNTER("kvbank_server_disconnects_total", "Requests the model cancelled because their client went away",
            m->pong.disconnects);
    /* measured at the gateway, as delivered to the HTTP clients */
    static const hist_family hists[] = {
        {"kvbank_time_to_first_token_seconds", "Arrival at the gateway to the first token delivered", offsetof(gw_model, ttft)},
        {"kvbank_time_per_output_token_seconds", "(last - first delivery) / (tokens - 1) per request", offsetof(gw_model, tpot)},
        {"kvbank_inter_token_latency_seconds", "Gap between two tokens delivered (after Token-Deposit)", offsetof(gw_model, itl)},
        {"kvbank_generation_inter_token_latency_seconds", "Gap between two tokens as they arrived from the model",
         offsetof(gw_model, gen_itl)},
        {"kvbank_e2e_request_latency_seconds", "Arrival at the gateway to the request's end", offsetof(gw_model, e2e)},
    };
    hist_families(&t, g, hists, KVB_ARRAY_LEN(hists), "model");
    gw_metric_head(&t, "kvbank_gateway_requests_total", "counter", "Requests the gateway finished, by finish reason");
    static const char *const reasons[] = {"none", "length", "stop", "cancelled", "error"};
    FOR_MODELS {
        gw_model *m = g->models[i];
        gw_label_escape(m->name, esc, sizeof esc);
        for (int f = 1; f < 5; f++) {
            snprintf(lab, sizeof lab, "model=\"%s\",finish_reason=\"%s\"", esc, reasons[f]);
            gw_metric_sample(&t, "kvbank_gateway_requests_total", lab, (double)m->finished[f]);
        }
    }
    COUNTER("kvbank_gateway_prompt_tokens_total", "Prompt tokens of the requests the gateway finished", m->prompt_tokens);
    COUNTER("kvbank_gateway_completion_tokens_total", "Tokens the gateway delivered", m->completion_tokens);
    COUNTER("kvbank_gateway_deposit_burst_tokens_total",
            "Tokens still held by Token-Deposit when their request finished (delivered at once)", m->deposit_held);
    GAUGE("kvbank_gateway_streams", "Requests of this model in flight at the gateway", m->n_streams);
    /* vLLM's names (labelled model_name), for the dashboards written for vLLM and for the Gateway API
     * Inference Extension's endpoint picker (its vLLM model-server profile scrapes the gauges).
     * `?names=kvbank` leaves them out: a colon in a metric name is reserved for recording rules, and
     * `promtool check metrics` says so about each of them, as it does about vLLM's own. */
    char which[16];
    if (!query_param(req, "names", which, sizeof which) || strcmp(which, "kvbank")) {
#undef LAB
#define LAB(m) (gw_label_escape((m)->name, esc, sizeof esc), snprintf(lab, sizeof lab, "model_name=\"%s\"", esc), lab)
        GAUGE("vllm:num_requests_running", "Requests running on the model (vLLM profile)", m->pong.running);
        GAUGE("vllm:num_requests_waiting", "Requests waiting for the model (vLLM profile)", m->pong.waiting);
        GAUGE("vllm:kv_cache_usage_perc", "KV-cache usage, 0..1 (vLLM profile)",
              m->pong.blocks_total ? 1.0 - (double)m->pong.blocks_free / m->pong.blocks_total : 0.0);
        GAUGE("vllm:gpu_cache_usage_perc", "KV-cache usage, 0..1 (vLLM's older name)",
              m->pong.blocks_total ? 1.0 - (double)m->pong.blocks_free / m->pong.blocks_total : 0.0);
        COUNTER("vllm:num_preemptions_total", "Sequences the model preempted (recompute)", m->pong.preemptions);
        /* every prompt token the engine placed came from the prefix cache or was computed */
        COUNTER("vllm:prefix_cache_queries_total",
                "Prompt tokens the engine placed: served from the prefix cache or computed (recomputed ones included)",
                m->pong.prompt_tokens + m->pong.prefix_hit_tokens);
        COUNTER("vllm:prefix_cache_hits_total", "Prompt tokens served from the prefix cache", m->pong.prefix_hit_tokens);
        COUNTER("vllm:prompt_tokens_total", "Prompt tokens of the requests the gateway finished", m->prompt_tokens);
        COUNTER("vllm:generation_tokens_total", "Tokens the gateway delivered", m->completion_tokens);
        gw_metric_head(&t, "vllm:request_success_total", "counter",
                       "Requests the gateway finished, by finish reason (abort: cancelled or failed)");
        FOR_MODELS {
            gw_model *m = g->models[i];
            static const struct {
                const char *reason;
                int a, b; /* kvb_finish values counted under the reason */
            } vr[] = {{"stop", KVB_FINISH_STOP, -1}, {"length", KVB_FINISH_LENGTH, -1},
                      {"abort", KVB_FINISH_CANCELLED, KVB_FINISH_ERROR}};
            for (size_t r = 0; r < KVB_ARRAY_LEN(vr); r++) {
                gw_label_escape(m->name, esc, sizeof esc);
                snprintf(lab, sizeof lab, "model_name=\"%s\",finished_reason=\"%s\"", esc, vr[r].reason);
                gw_metric_sample(&t, "vllm:request_success_total", lab,
                                 (double)(m->finished[vr[r].a] + (vr[r].b >= 0 ? m->finished[vr[r].b] : 0)));
            }
        }
        static const hist_family vh[] = {
            {"vllm:time_to_first_token_seconds", "Arrival at the gateway to the first token delivered", offsetof(gw_model, ttft)},
            {"vllm:time_per_output_token_seconds", "(last - first delivery) / (tokens - 1) per request", offsetof(gw_model, tpot)},
            {"vllm:inter_token_latency_seconds", "Gap between two tokens delivered", offsetof(gw_model, itl)},
            {"vllm:e2e_request_latency_seconds", "Arrival at the gateway to the request's end", offsetof(gw_model, e2e)},
            {"vllm:request_decode_time_seconds", "First to last token of a request, as the model sampled them",
             offsetof(gw_model, decode)},
            {"vllm:request_prompt_tokens", "Prompt tokens per request", offsetof(gw_model, req_prompt)},
            {"vllm:request_generation_tokens", "Generated tokens per request", offsetof(gw_model, req_gen)},
            {"vllm:request_params_max_tokens", "max_tokens per request (the default where none was given)",
             offsetof(gw_model, req_max_tokens)},
        };
        hist_families(&t, g, vh, KVB_ARRAY_LEN(vh), "model_name");
    }
#undef LAB
#undef GAUGE
#undef COUNTER
#undef FOR_MODELS
    /* the gateway's own HTTP counters */
    gw_metric_head(&t, "kvbank_gateway_http_requests_total", "counter", "HTTP requests answered, by endpoint and status class");
    for (int e = 0; e < (int)KVB_ARRAY_LEN(EP_NAMES); e++)
        for (int c = 1; c < 6; c++) {
            if (!g->http[e][c] && e == EP_OTHER) continue;
            snprintf(lab, sizeof lab, "endpoint=\"%s\",code=\"%dxx\"", EP_NAMES[e], c);
            gw_metric_sample(&t, "kvbank_gateway_http_requests_total", lab, (double)g->http[e][c]);
        }
    gw_metric_head(&t, "kvbank_gateway_client_disconnects_total", "counter",
                   "Requests cancelled in their model because the HTTP client went away");
    gw_metric_sample(&t, "kvbank_gateway_client_disconnects_total", "", (double)g->disconnects);
    gw_metric_head(&t, "kvbank_gateway_reset_connections_closed_total", "counter",
                   "HTTP/2 connections closed because their client cancelled requests too fast (rapid reset)");
    gw_metric_sample(&t, "kvbank_gateway_reset_connections_closed_total", "", (double)g->resets_closed);
    gw_metric_head(&t, "kvbank_gateway_text_jobs", "gauge",
                   "Requests whose text is being rendered, tokenized or detokenized on the thread pool (or waiting for it)");
    gw_metric_sample(&t, "kvbank_gateway_text_jobs", "", g->n_jobs);
    gw_metric_head(&t, "kvbank_gateway_unauthorized_total", "counter", "Requests refused with 401 (no or a wrong API key)");
    gw_metric_sample(&t, "kvbank_gateway_unauthorized_total", "", (double)g->unauthorized);
    gw_metric_head(&t, "kvbank_gateway_connections", "gauge", "Open client connections");
    gw_metric_sample(&t, "kvbank_gateway_connections", "", g->n_conns);
    gw_metric_head(&t, "kvbank_gateway_rejected_busy_total", "counter", "Requests refused with 429 (max_streams)");
    gw_metric_sample(&t, "kvbank_gateway_rejected_busy_total", "", (double)g->rejected_busy);
    gw_metric_head(&t, "kvbank_gateway_ignored_fields_total", "counter",
                   "Requests that carried a field this server accepts and ignores (as vLLM does), by field");
    const gw_field *fields = gw_fields(NULL);
    for (int k = 0; k < g->n_fields; k++) {
        if (fields[k].kind != GW_FIELD_IGNORED || (k && !strcmp(fields[k].name, fields[k - 1].name))) continue;
        snprintf(lab, sizeof lab, "field=\"%s\"", fields[k].name);
        gw_metric_sample(&t, "kvbank_gateway_ignored_fields_total", lab, (double)g->ignored[k]);
    }
    gw_metric_head(&t, "kvbank_gateway_streams_active", "gauge", "Requests in flight at the gateway");
    gw_metric_sample(&t, "kvbank_gateway_streams_active", "", g->n_streams);
    if (t.failed) send_body(g, req, EP_METRICS, 500, "text/plain", "out of memory\n", 14);
    else send_body(g, req, EP_METRICS, 200, "text/plain; version=0.0.4; charset=utf-8", t.s, t.len);
    free(t.s);
}

/* --------------------------------------------------------------------------------------- server */

/* h2o closed the socket of a connection. */
static void on_conn_closed(uv_handle_t *h) {
    gw_conn *c = (gw_conn *)h;
    gw *g = c->g;
    if (c->prev) c->prev->next = c->next;
    else if (g->conns == c) g->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    g->n_conns--;
    if (c->fd >= 0 && c->fd < g->n_conn_by_fd && g->conn_by_fd[c->fd] == c) g->conn_by_fd[c->fd] = NULL;
    for (gw_stream *s = g->streams; s; s = s->next)
        if (s->conn == c) s->conn = NULL;
    for (struct gw_job *j = g->jobs; j; j = j->next)
        if (j->conn == c) j->conn = NULL;
    free(c);
}

static void on_accept(uv_stream_t *listener, int status) {
    gw *g = listener->data;
    if (status != 0) return;
    gw_conn *c = calloc(1, sizeof *c);
    if (!c) return;
    c->g = g;
    c->fd = -1;
    uv_tcp_init(g->loop, &c->tcp);
    uv_os_fd_t fd = -1;
    if (uv_accept(listener, (uv_stream_t *)&c->tcp) != 0 || uv_fileno((uv_handle_t *)&c->tcp, &fd) != 0) {
        uv_close((uv_handle_t *)&c->tcp, (uv_close_cb)free);
        return;
    }
    if (fd >= g->n_conn_by_fd) {
        int n = fd + 64;
        if (kvb_realloc_array((void **)&g->conn_by_fd, (size_t)n, sizeof *g->conn_by_fd) != KVB_OK) {
            uv_close((uv_handle_t *)&c->tcp, (uv_close_cb)free);
            return;
        }
        for (int i = g->n_conn_by_fd; i < n; i++) g->conn_by_fd[i] = NULL;
        g->n_conn_by_fd = n;
    }
    c->fd = fd;
    g->conn_by_fd[fd] = c;
    c->next = g->conns;
    if (g->conns) g->conns->prev = c;
    g->conns = c;
    g->n_conns++;
    uv_tcp_nodelay(&c->tcp, 1);
    c->sock = h2o_uv_socket_create((uv_stream_t *)&c->tcp, on_conn_closed);
    h2o_accept(&g->accept_ctx, c->sock);
}

/* HTTPS: OpenSSL with the PEM chain and key of the config; HTTP/2 by ALPN, else HTTP/1.1. */
static kvb_status tls_setup(gw *g) {
    g->ssl = SSL_CTX_new(TLS_server_method());
    if (!g->ssl) return KVB_ERR_NOMEM;
    SSL_CTX_set_min_proto_version(g->ssl, TLS1_2_VERSION);
    SSL_CTX_set_options(g->ssl, SSL_OP_NO_COMPRESSION | SSL_OP_NO_RENEGOTIATION);
    if (SSL_CTX_use_certificate_chain_file(g->ssl, g->o->tls_cert) != 1 ||
        SSL_CTX_use_PrivateKey_file(g->ssl, g->o->tls_key, SSL_FILETYPE_PEM) != 1 || SSL_CTX_check_private_key(g->ssl) != 1) {
        char why[256];
        ERR_error_string_n(ERR_get_error(), why, sizeof why);
        KVB_LOG_E("gateway: TLS certificate %s / key %s: %s", g->o->tls_cert, g->o->tls_key, why);
        return KVB_ERR_INVALID;
    }
    h2o_ssl_register_alpn_protocols(g->ssl, h2o_http2_alpn_protocols);
    g->accept_ctx.ssl_ctx = g->ssl;
    return KVB_OK;
}

static kvb_status listen_on(gw *g) {
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof ss);
    struct sockaddr_in *a4 = (struct sockaddr_in *)&ss;
    struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)&ss;
    if (uv_ip4_addr(g->o->host, g->o->port, a4) != 0 && uv_ip6_addr(g->o->host, g->o->port, a6) != 0) {
        KVB_LOG_E("gateway: cannot parse the listen address '%s'", g->o->host);
        return KVB_ERR_INVALID;
    }
    uv_tcp_init(g->loop, &g->listener);
    g->listener.data = g;
    int rc = uv_tcp_bind(&g->listener, (const struct sockaddr *)&ss, 0);
    if (rc == 0) rc = uv_listen((uv_stream_t *)&g->listener, 511, on_accept);
    if (rc != 0) {
        KVB_LOG_E("gateway: cannot listen on %s port %d: %s", g->o->host, g->o->port, uv_strerror(rc));
        return KVB_ERR_IO;
    }
    struct sockaddr_storage bound;
    int len = sizeof bound;
    uv_tcp_getsockname(&g->listener, (struct sockaddr *)&bound, &len);
    g->port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                                 : ((struct sockaddr_in *)&bound)->sin_port);
    return KVB_OK;
}

void gw_opts_default(gw_opts *o) {
    memset(o, 0, sizeof *o);
    o->host = "127.0.0.1";
    o->port = 8000;
    o->max_body = 1 << 20;
    o->max_streams = 256;
    o->status_ms = 1000;
    o->drain_timeout_ms = 30000;
    o->text_workers = 2;
    o->health_open = o->metrics_open = 1;
    o->retry_after_s = 5;
    kvb_text_limits_default(&o->text_limits);
}

kvb_status gw_opts_from_node(const kvb_node_config *c, gw_opts *o, gw_model_opts *models, int max_models) {
    o->coordinator = c->coordinator;
    if (c->gateway.enabled) {
        o->host = c->gateway.host;
        o->port = c->gateway.port;
        o->max_body = (size_t)c->gateway.max_body;
        o->max_streams = c->gateway.max_streams;
        o->tbt_slo_ms = c->gateway.tbt_slo_ms;
        o->drain_timeout_ms = (int)(c->gateway.drain_timeout_s * 1000.0 + 0.5);
        o->max_text = (size_t)c->gateway.max_text;
        o->text_workers = c->gateway.text_workers;
        o->api_keys = (const char *const *)c->gateway.api_keys;
        o->n_api_keys = c->gateway.n_api_keys;
        o->health_open = c->gateway.health_open;
        o->metrics_open = c->gateway.metrics_open;
        o->tls_cert = c->gateway.tls_cert;
        o->tls_key = c->gateway.tls_key;
        o->retry_after_s = c->gateway.retry_after_s;
        const kvb_node_gateway *cg = &c->gateway;
        kvb_text_limits *l = &o->text_limits;
        if (cg->encode_bytes > 0) l->encode_bytes = (size_t)cg->encode_bytes;
        if (cg->decode_ids > 0) l->decode_ids = (size_t)cg->decode_ids;
        if (cg->render_steps > 0) l->render_steps = (uint64_t)cg->render_steps;
        if (cg->render_output > 0) l->render_output = (size_t)cg->render_output;
        if (cg->render_memory > 0) l->render_memory = (size_t)cg->render_memory;
    }
    if (c->n_models > max_models) return KVB_ERR_INVALID;
    for (int i = 0; i < c->n_models; i++) {
        models[i].name = c->models[i].name;
        models[i].model_dir = c->models[i].model_dir;
        models[i].tbt_slo_ms = c->models[i].tbt_slo_ms;
    }
    o->models = models;
    o->n_models = c->n_models;
    return KVB_OK;
}

static void close_walk(uv_handle_t *h, void *arg) {
    (void)arg;
    if (!uv_is_closing(h)) uv_close(h, NULL);
}

kvb_status gw_run(const gw_opts *o, volatile sig_atomic_t *stop) {
    if (!o || !o->coordinator || !stop) return KVB_ERR_INVALID;
    kvb_status st = KVB_OK;
    gw *g = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *g, (void **)&g));
    g->o = o;
    g->stop = stop;
    gw_fields(&g->n_fields);
    if (kvb_calloc((size_t)g->n_fields, sizeof *g->ignored, (void **)&g->ignored) != KVB_OK) {
        free(g);
        return KVB_ERR_NOMEM;
    }
    /* the text jobs' threads: libuv sizes its pool from this at the first uv_queue_work */
    char nthreads[16];
    snprintf(nthreads, sizeof nthreads, "%d", o->text_workers > 0 ? o->text_workers : 2);
    setenv("UV_THREADPOOL_SIZE", nthreads, 1);
    g->loop = uv_default_loop();
    for (int i = 0; i < o->n_models; i++) {
        gw_model *m = model_add(g, o->models[i].name);
        if (!m) continue;
        m->configured = 1;
        m->tbt_slo_ms = o->models[i].tbt_slo_ms;
        if (o->models[i].model_dir) snprintf(m->model_dir, sizeof m->model_dir, "%s", o->models[i].model_dir);
        model_load_dir(m);
    }
    h2o_config_init(&g->h2o_conf);
    g->h2o_conf.max_request_entity_size = o->max_body;
    g->h2o_conf.server_name = h2o_iovec_init(H2O_STRLIT("kvbank-gateway"));
    h2o_hostconf_t *host = h2o_config_register_host(&g->h2o_conf, h2o_iovec_init(H2O_STRLIT("default")), 65535);
    h2o_pathconf_t *path = h2o_config_register_path(host, "/", 0);
    h2o_handler_t *h = h2o_create_handler(path, sizeof *h + sizeof(gw *));
    *(gw **)(h + 1) = g;
    h->on_req = on_req;
    h2o_context_init(&g->h2o_ctx, g->loop, &g->h2o_conf);
    g->accept_ctx.ctx = &g->h2o_ctx;
    g->accept_ctx.hosts = g->h2o_conf.hosts;
    if (o->n_api_keys) {
        KVB_TRY_GOTO(kvb_calloc((size_t)o->n_api_keys, sizeof *g->key_digest, (void **)&g->key_digest), done);
        for (int k = 0; k < o->n_api_keys; k++) kvb_sha256_digest(o->api_keys[k], strlen(o->api_keys[k]), g->key_digest[k]);
    }
    if (o->tls_cert) KVB_TRY_GOTO(tls_setup(g), done);
    KVB_TRY_GOTO(listen_on(g), done);

    /* The gateway is a control client of the coordinator: it logs in on EP.ctl (common/ipc/auth.h) and
     * only asks for the status. */
    char ctl_ep[4096];
    g->zctx = zmq_ctx_new();
    g->coord = g->zctx ? zmq_socket(g->zctx, ZMQ_DEALER) : NULL;
    int zero = 0, fd = -1;
    size_t fdsz = sizeof fd;
    if (!g->coord || kvb_auth_ctl_endpoint(o->coordinator, ctl_ep, sizeof ctl_ep) != KVB_OK ||
        zmq_setsockopt(g->coord, ZMQ_LINGER, &zero, sizeof zero) != 0 || kvb_auth_set_ctl(g->coord) != KVB_OK ||
        zmq_connect(g->coord, ctl_ep) != 0 || zmq_getsockopt(g->coord, ZMQ_FD, &fd, &fdsz) != 0) {
        KVB_LOG_E("gateway: cannot connect to the coordinator at %s: %s", o->coordinator, zmq_strerror(errno));
        st = KVB_ERR_IO;
        goto done;
    }
    uv_poll_init(g->loop, &g->coord_poll, fd);
    g->coord_poll.data = g;
    uv_poll_start(&g->coord_poll, UV_READABLE, on_coord_readable);
    uv_timer_init(g->loop, &g->status_timer);
    g->status_timer.data = g;
    uv_timer_start(&g->status_timer, on_status_timer, 0, (uint64_t)o->status_ms);
    uv_timer_init(g->loop, &g->housekeep);
    g->housekeep.data = g;
    uv_timer_start(&g->housekeep, on_housekeep, HOUSEKEEP_MS, HOUSEKEEP_MS);

    KVB_LOG_I("gateway: listening on %s port %d (coordinator %s)", o->host, g->port, o->coordinator);
    printf("kvbank-gateway: listening on %s://%s%s%s:%d\n", g->ssl ? "https" : "http", strchr(o->host, ':') ? "[" : "", o->host,
           strchr(o->host, ':') ? "]" : "", g->port);
    fflush(stdout);
    if (o->port_file) {
        FILE *f = fopen(o->port_file, "w");
        if (f) {
            fprintf(f, "%d\n", g->port);
            fclose(f);
        }
    }
    uv_run(g->loop, UV_RUN_DEFAULT);
done:
    for (gw_stream *s = g->streams; s; s = s->next)
        for (int k = 0; k < s->n_seqs; k++) seq_abandon(s->seqs[k]);
    /* Connections still open (a client that would not let go): reset them, and let h2o close them and
     * run the deferred work on its zero timeout. h2o_context_dispose asserts that none of its timeouts
     * holds an entry: the graceful-shutdown one is ours to unlink (h2o 2.2 keeps it a second). */
    for (gw_conn *c = g->conns; c; c = c->next) shutdown(c->fd, SHUT_RDWR);
    for (int k = 0; k < 200 && (g->conns || k < 10); k++) uv_run(g->loop, UV_RUN_NOWAIT);
    h2o_timeout_unlink(&g->h2o_ctx.http2._graceful_shutdown_timeout);
    int disposed = !g->conns;
    if (disposed) h2o_context_dispose(&g->h2o_ctx);
    else KVB_LOG_W("gateway: %d connections did not close; exiting without freeing them", g->n_conns);
    uv_walk(g->loop, close_walk, NULL);
    uv_run(g->loop, UV_RUN_DEFAULT);
    if (disposed) h2o_config_dispose(&g->h2o_conf);
    free(g->conn_by_fd);
    free(g->key_digest);
    free(g->ignored);
    if (g->ssl) SSL_CTX_free(g->ssl);
    for (int i = 0; i < g->n_models; i++) {
        kvb_client_destroy(g->models[i]->client);
        kvb_tokenizer_destroy(g->models[i]->tok);
        kvb_chat_template_destroy(g->models[i]->tmpl);
        free(g->models[i]);
    }
    if (g->coord) zmq_close(g->coord);
    if (g->zctx) zmq_ctx_term(g->zctx);
    uv_loop_close(g->loop);
    free(g);
    return st;
}
