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
#include "common/util/token_deposit.h"
#include "coordinator/coordinator.h"
#include "gateway/api.h"
#include "gateway/metrics.h"
#include "gateway/stop.h"

#define GW_MAX_MODELS 64
#define KVB_NAME_MAX_GW 65        /* model names: up to 64 bytes */
#define HOUSEKEEP_MS 100          /* disconnect peeks and the dispatch safety net */
#define STALE_FACTOR 3            /* a coordinator / model silent for 3 status periods does not "answer" */
#define DEFAULT_MAX_TOKENS 16     /* completions without max_tokens (OpenAI's default) */
#define SUBMIT_TIMEOUT_MS 1000    /* how long a send to a model may wait for queue room */
#define SHUTDOWN_MS 2000          /* how long a stopping gateway waits for its connections to close */

typedef struct gw gw;
typedef struct gw_stream gw_stream;

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
    /* the model's numbers: last Pong and last coordinator status */
    kvb_client_pong pong;
    uint64_t pong_ns;             /* when the last Pong arrived (kvb_now_ns), 0: never */
    uint32_t n_own, n_lent, n_borrowed, capacity;
    uint64_t lends, reclaims, lend_ms_total, reclaim_ms_total;
    /* what the gateway measured (delivery side) */
    gw_hist ttft, tpot, itl, gen_itl, e2e;
    uint64_t finished[5];         /* by kvb_finish */
    uint64_t prompt_tokens, completion_tokens, deposit_held;
    int n_streams;
} gw_model;

struct gw {
    const gw_opts *o;
    uv_loop_t *loop;
    volatile sig_atomic_t *stop;  /* polled by the housekeeping timer */
    int stopping;                 /* begin_shutdown ran */
    uint64_t stop_deadline_ns;
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
    uint64_t http[8][6];          /* [endpoint][status / 100] */
    uint64_t disconnects;         /* requests cancelled because their HTTP client went away */
    uint64_t rejected_busy;
};

enum { EP_COMPLETIONS, EP_CHAT, EP_MODELS, EP_HEALTH, EP_METRICS, EP_TOKENIZE, EP_DETOKENIZE, EP_OTHER };
static const char *const EP_NAMES[] = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                                       "/metrics", "/tokenize", "/detokenize", "other"};

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
    int32_t *prompt_ids;          /* [n_prompt] when return_token_ids */
    uint64_t slo_ns;              /* Token-Deposit target; 0: off */
    uint64_t t_arrival;           /* kvb_wall_ns when the HTTP request was handled */
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
};

static void stream_pump(gw_stream *s);
static void stream_maybe_free(gw_stream *s);
static void record_metrics(gw_stream *s, kvb_finish f);

static void count_http(gw *g, int ep, int status) {
    int cls = status / 100;
    if (cls < 0 || cls > 5) cls = 0;
    g->http[ep][cls]++;
}

/* Sends a complete response (status, JSON or text body). The request is done afterwards. */
static void send_body(gw *g, h2o_req_t *req, int ep, int status, const char *ctype, const char *body, size_t len) {
    static const char *const reasons[] = {[200] = "OK", [400] = "Bad Request", [404] = "Not Found",
                                          [405] = "Method Not Allowed", [413] = "Payload Too Large",
                                          [429] = "Too Many Requests", [500] = "Internal Server Error",
                                          [503] = "Service Unavailable"};
    req->res.status = status;
    req->res.reason = status < (int)KVB_ARRAY_LEN(reasons) && reasons[status] ? reasons[status] : "Error";
    h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_CONTENT_TYPE, NULL, ctype, strlen(ctype));
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
    send_body(g, req, ep, e->status, "application/json", b, n);
    free(b);
}

static void on_stream_timer_closed(uv_handle_t *h) {
    gw_stream *s = h->data;
    gw_stop_destroy(s->stopper);
    kvb_detok_destroy(s->detok);
    free(s->tok);
    free(s->t_gen);
    free(s->t_recv);
    free(s->t_deliv);
    free(s->text_end);
    free(s->text);
    free(s->out);
    free(s->prompt_ids);
    free(s);
}

static void stream_unlink(gw_stream *s) {
    gw *g = s->g;
    if (s->prev) s->prev->next = s->next;
    else if (g->streams == s) g->streams = s->next;
    if (s->next) s->next->prev = s->prev;
    s->prev = s->next = NULL;
    g->n_streams--;
    if (s->m) s->m->n_streams--;
}

/* Frees the stream once neither h2o nor the model will call back for it. */
static void stream_maybe_free(gw_stream *s) {
    if (!s->h2o_done || s->upstream_live) return;
    if (s->link) s->link->s = NULL;
    s->link = NULL;
    stream_unlink(s);
    uv_timer_stop(&s->timer);
    uv_close((uv_handle_t *)&s->timer, on_stream_timer_closed);
}

/* The model side is no longer wanted (client gone): cancel it in the model process. */
static void stream_abandon_upstream(gw_stream *s) {
    if (!s->upstream_live) return;
    s->upstream_live = 0;
    if (s->m && s->m->client) {
        kvb_client_abandon(s->m->client, s->rid);
        kvb_client_dispatch(s->m->client); /* the send may have consumed the fd's edge */
    }
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
        record_metrics(s, KVB_FINISH_CANCELLED);
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

static json_t *usage_json(const gw_stream *s) {
    return json_pack("{s:i, s:i, s:i}", "prompt_tokens", s->n_prompt, "completion_tokens", s->n_tok,
                     "total_tokens", s->n_prompt + s->n_tok);
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

/* One choice: text (completions) or message / delta (chat). */
static json_t *choice_json(const gw_stream *s, const char *text, size_t len, const int32_t *ids, int n_ids,
                           const char *finish, int final) {
    if (!text) text = "", len = 0;
    json_t *c = json_pack("{s:i}", "index", 0);
    if (s->ep == EP_CHAT) {
        json_t *msg = json_object();
        if (!s->stream || !s->role_sent) json_object_set_new(msg, "role", json_string("assistant"));
        if (len || !s->stream || !s->role_sent) json_object_set_new(msg, "content", json_stringn(text, len));
        json_object_set_new(c, s->stream ? "delta" : "message", msg);
    } else {
        json_object_set_new(c, "text", json_stringn(text, len));
    }
    json_object_set_new(c, "logprobs", json_null());
    json_object_set_new(c, "finish_reason", finish ? json_string(finish) : json_null());
    if (s->return_token_ids && (n_ids || !s->stream)) json_object_set_new(c, "token_ids", ids_json(ids, n_ids));
    (void)final;
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

static size_t released_text(const gw_stream *s) { return s->n_released ? s->text_end[s->n_released - 1] : 0; }

/* Records what the gateway measured for a finished request (delivery side: what the user saw). */
static void record_metrics(gw_stream *s, kvb_finish f) {
    gw_model *m = s->m;
    if (s->recorded) return;
    s->recorded = 1;
    if (f >= 0 && f < 5) m->finished[f]++;
    m->prompt_tokens += (uint64_t)s->n_prompt;
    m->completion_tokens += (uint64_t)s->n_tok;
    double now = (double)kvb_wall_ns();
    gw_hist_observe(&m->e2e, (now - (double)s->t_arrival) / 1e9);
    if (s->n_tok == 0) return;
    gw_hist_observe(&m->ttft, (double)(int64_t)(s->t_deliv[0] - s->t_arrival) / 1e9);
    if (s->n_tok > 1)
        gw_hist_observe(&m->tpot, (double)(s->t_deliv[s->n_tok - 1] - s->t_deliv[0]) / 1e9 / (s->n_tok - 1));
    for (int i = 1; i < s->n_tok; i++) {
        gw_hist_observe(&m->itl, (double)(s->t_deliv[i] - s->t_deliv[i - 1]) / 1e9);
        gw_hist_observe(&m->gen_itl, (double)(s->t_recv[i] - s->t_recv[i - 1]) / 1e9);
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

/* Hands `out` to h2o (the last thing a pump does: h2o may call back at once). */
static void stream_write(gw_stream *s, int final) {
    h2o_iovec_t iov = h2o_iovec_init(s->out, s->out_len);
    s->sending = 1;
    h2o_req_t *req = s->req;
    if (final) {
        s->h2o_done = 1; /* h2o calls neither proceed nor stop after a final send */
        if (s->link) s->link->s = NULL;
        s->link = NULL;
        s->req = NULL;
    }
    h2o_send(req, &iov, s->out_len ? 1 : 0, final ? H2O_SEND_STATE_FINAL : H2O_SEND_STATE_IN_PROGRESS);
    if (final) stream_maybe_free(s);
}

/* Sends whatever is due: new text and tokens, the end of the response. */
static void stream_pump(gw_stream *s) {
    if (s->sending || s->h2o_done || !s->req) return;
    int all_released = s->finished && s->n_released == s->n_tok;
    if (!s->stream) {
        if (!all_released) return;
        h2o_req_t *req = s->req;
        if (s->link) s->link->s = NULL;
        s->link = NULL;
        s->req = NULL;
        s->h2o_done = 1;
        record_metrics(s, s->fin);
        if (s->failed) {
            send_error(s->g, req, s->ep, &s->err);
        } else {
            json_t *choices = json_array();
            json_array_append_new(choices, choice_json(s, s->text, s->text_len, s->tok, s->n_tok, s->finish_reason, 1));
            json_t *r = envelope_json(s, choices);
            json_object_set_new(r, "usage", usage_json(s));
            if (s->return_token_ids) json_object_set_new(r, "prompt_token_ids", ids_json(s->prompt_ids, s->n_prompt));
            if (s->timings) json_object_set_new(r, "kvbank_timings", timings_json(s));
            send_json(s->g, req, s->ep, 200, r);
        }
        stream_maybe_free(s);
        return;
    }
    if (!s->head_sent) {
        if (s->failed && s->n_tok == 0) {
            /* nothing streamed yet: a plain error response */
            h2o_req_t *req = s->req;
            if (s->link) s->link->s = NULL;
            s->link = NULL;
            s->req = NULL;
            s->h2o_done = 1;
            record_metrics(s, s->fin);
            send_error(s->g, req, s->ep, &s->err);
            stream_maybe_free(s);
            return;
        }
        stream_start_response(s);
    }
    s->out_len = 0;
    size_t upto = released_text(s);
    int new_tok = s->n_released - s->sent_tok;
    if (upto > s->sent_text || new_tok > 0 || (s->ep == EP_CHAT && !s->role_sent)) {
        json_t *choices = json_array();
        json_array_append_new(choices, choice_json(s, s->text + s->sent_text, upto - s->sent_text, s->tok + s->sent_tok,
                                                   new_tok, NULL, 0));
        out_event(s, envelope_json(s, choices));
        s->role_sent = 1;
        s->sent_text = upto;
        s->sent_tok = s->n_released;
    }
    int final = 0;
    if (all_released) {
        if (s->failed) {
            size_t n = 0;
            char *b = gw_error_body(&s->err, &n);
            if (b) {
                gw_buf_append(&s->out, &s->out_len, &s->out_cap, "data: ", 6);
                gw_buf_append(&s->out, &s->out_len, &s->out_cap, b, n);
                gw_buf_append(&s->out, &s->out_len, &s->out_cap, "\n\n", 2);
                free(b);
            }
        } else {
            json_t *choices = json_array();
            json_array_append_new(choices, choice_json(s, "", 0, NULL, 0, s->finish_reason, 1));
            json_t *last = envelope_json(s, choices);
            if (s->timings) json_object_set_new(last, "kvbank_timings", timings_json(s));
            out_event(s, last);
            if (s->include_usage) {
                json_t *u = envelope_json(s, json_array());
                json_object_set_new(u, "usage", usage_json(s));
                out_event(s, u);
            }
        }
        gw_buf_append(&s->out, &s->out_len, &s->out_cap, "data: [DONE]\n\n", 14);
        final = 1;
        record_metrics(s, s->fin);
    }
    if (s->out_len || final) stream_write(s, final);
}

static void arm_deposit_timer(gw_stream *s);

/* Releases every token whose delivery time has come and arms the timer for the next one. */
static void stream_release(gw_stream *s) {
    uint64_t now = kvb_wall_ns();
    while (s->n_released < s->n_tok && (s->finished || s->t_deliv[s->n_released] <= now)) {
        if (s->finished && s->t_deliv[s->n_released] > now) {
            s->t_deliv[s->n_released] = now; /* the rest at once on finish (OrbitFlow §3.2) */
            s->m->deposit_held++;
        }
        s->n_released++;
    }
    arm_deposit_timer(s);
    stream_pump(s);
}

static void on_deposit_timer(uv_timer_t *t) { stream_release(t->data); }

static void arm_deposit_timer(gw_stream *s) {
    if (s->n_released >= s->n_tok || s->finished) return;
    uint64_t now = kvb_wall_ns(), due = s->t_deliv[s->n_released];
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
    default: return 500;
    }
}

static void on_upstream(void *ud, uint64_t rid, const int32_t *tokens, const uint64_t *t_ns, int n, int first_index,
                        kvb_finish finish, kvb_status st, const char *err) {
    gw_stream *s = ud;
    (void)rid;
    (void)first_index;
    uint64_t now = kvb_wall_ns();
    int stop_hit = 0;
    if (!s->finished && n > 0 && grow_tokens(s, s->n_tok + n) != KVB_OK) {
        stream_fail(s, 500, "server_error", "%s", "out of memory");
        stop_hit = 1;
    }
    for (int k = 0; k < n && !s->finished && !stop_hit; k++) {
        int i = s->n_tok++;
        s->tok[i] = tokens[k];
        s->t_gen[i] = t_ns[k];
        s->t_recv[i] = now;
        s->t_deliv[i] = kvb_deposit_next(i == 0, i ? s->t_deliv[i - 1] : 0, now, s->slo_ns);
        /* text: detokenize, then stop strings (a model without a tokenizer streams token ids only) */
        if (s->detok) {
            const char *piece = "";
            size_t plen = 0;
            if (kvb_detok_push(s->detok, tokens[k], &piece, &plen) != KVB_OK) plen = 0;
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
        if (st != KVB_OK) {
            stream_fail(s, status_for(st), st == KVB_ERR_INVALID ? "invalid_request_error" : "server_error", "%s",
                        err && *err ? err : kvb_status_str(st));
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
            s->finish_reason = finish == KVB_FINISH_LENGTH ? "length" : finish == KVB_FINISH_STOP ? "stop" : NULL;
            if (finish == KVB_FINISH_CANCELLED) stream_fail(s, 503, "server_error", "%s", "the model cancelled the request");
        }
        s->fin = s->failed ? KVB_FINISH_ERROR : finish;
    } else if (finish != KVB_FINISH_NONE) {
        s->upstream_live = 0;
    }
    if (!s->upstream_live && s->h2o_done) {
        stream_maybe_free(s);
        return;
    }
    if (s->h2o_done) return;
    stream_release(s);
}

/* -------------------------------------------------------------------------------- model clients */

static void on_model_readable(uv_poll_t *p, int status, int events) {
    gw_model *m = p->data;
    (void)status;
    (void)events;
    if (m->client && kvb_client_dispatch(m->client) != KVB_OK) KVB_LOG_W("gateway: model %s: socket error", m->name);
}

static void on_pong(void *ud, const kvb_client_pong *p) {
    gw_model *m = ud;
    m->pong = *p;
    m->pong_ns = kvb_now_ns();
}

/* Ends every stream of `m` with an error (its endpoint changed or went away). */
static void fail_model_streams(gw *g, gw_model *m, const char *why) {
    for (gw_stream *s = g->streams, *nx; s; s = nx) {
        nx = s->next;
        if (s->m != m || !s->upstream_live) continue;
        s->upstream_live = 0;
        if (!s->finished) stream_fail(s, 503, "server_error", "%s", why);
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
        kvb_status ts = kvb_tokenizer_load(m->model_dir, &m->tok);
        if (ts != KVB_OK && ts != KVB_ERR_NOT_FOUND)
            KVB_LOG_W("gateway: model %s: its tokenizer cannot be used (%s); it takes token ids only", m->name,
                      kvb_status_str(ts));
        if (m->tok) {
            ts = kvb_chat_template_load_why(m->model_dir, &m->tmpl, m->tmpl_why, sizeof m->tmpl_why);
            if (ts != KVB_OK && ts != KVB_ERR_NOT_FOUND)
                KVB_LOG_W("gateway: model %s: served without chat: its chat template cannot be used (%s)", m->name,
                          m->tmpl_why);
        }
        KVB_LOG_I("gateway: model %s: %s, %s", m->name, m->tok ? "tokenizer" : "no tokenizer (token ids only)",
                  m->tmpl ? "chat template" : "no chat template");
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
        m->pid = ms->pid;
        m->role = (int)ms->role;
        m->n_own = ms->n_own;
        m->n_lent = ms->n_lent;
        m->n_borrowed = ms->n_borrowed;
        m->capacity = ms->capacity;
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
            kvb_coord_decode(zmq_msg_data(&msg), zmq_msg_size(&msg), &env, NULL) == KVB_OK) {
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

/* Stop: no new connections, every request in flight ends (its model request cancelled), then the loop
 * runs until h2o has closed its connections (at most SHUTDOWN_MS) so that everything is freed. */
static void begin_shutdown(gw *g) {
    g->stopping = 1;
    g->stop_deadline_ns = kvb_now_ns() + (uint64_t)SHUTDOWN_MS * 1000000u;
    KVB_LOG_I("gateway: stopping (%d requests in flight are cancelled)", g->n_streams);
    uv_close((uv_handle_t *)&g->listener, NULL);
    uv_timer_stop(&g->status_timer);
    /* (not h2o_context_request_shutdown: in h2o 2.2 its HTTP/2 graceful-shutdown timer outlives the
     * connections and h2o_context_dispose then asserts; the requests are ended here instead) */
    for (gw_stream *s = g->streams, *nx; s; s = nx) {
        nx = s->next;
        stream_abandon_upstream(s);
        if (!s->finished) stream_fail(s, 503, "server_error", "%s", "the gateway is stopping");
        s->n_released = s->n_tok;
        if (s->h2o_done) stream_maybe_free(s);
        else if (!s->sending) stream_pump(s);
    }
}

static void on_housekeep(uv_timer_t *t) {
    gw *g = t->data;
    if (*g->stop && !g->stopping) begin_shutdown(g);
    if (g->stopping) {
        if ((h2o_linklist_is_empty(&g->h2o_ctx.http1._conns) && h2o_linklist_is_empty(&g->h2o_ctx.http2._conns) &&
             !g->streams) ||
            kvb_now_ns() > g->stop_deadline_ns)
            uv_stop(g->loop);
        return;
    }
    for (gw_stream *s = g->streams, *nx; s; s = nx) {
        nx = s->next;
        if (s->h2o_done || s->sending || !peer_closed(s)) continue;
        /* The client is gone: cancel upstream, then let h2o find the dead socket by writing to it. */
        g->disconnects++;
        KVB_LOG_I("gateway: %s: the client closed its connection; cancelling its request", s->id);
        stream_abandon_upstream(s);
        record_metrics(s, KVB_FINISH_CANCELLED);
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
    return m->alive && m->pong_ns &&
           kvb_now_ns() - m->pong_ns < (uint64_t)STALE_FACTOR * (uint64_t)g->o->status_ms * 1000000u;
}

static void handle_health(gw *g, h2o_req_t *req) {
    char name[128];
    int ok = coordinator_answers(g);
    const char *why = ok ? NULL : "the coordinator does not answer";
    if (query_param(req, "model", name, sizeof name)) {
        gw_model *m = model_find(g, name);
        if (!m) ok = 0, why = "no such model";
        else if (!model_answers(g, m)) ok = 0, why = "the model does not answer";
    } else {
        for (int i = 0; i < g->n_models && ok; i++)
            if (g->models[i]->alive && !model_answers(g, g->models[i])) ok = 0, why = "a model does not answer";
    }
    if (ok) send_body(g, req, EP_HEALTH, 200, "text/plain", "ok\n", 3);
    else send_body(g, req, EP_HEALTH, 503, "text/plain", why, strlen(why));
}

static void handle_models(gw *g, h2o_req_t *req) {
    json_t *data = json_array();
    for (int i = 0; i < g->n_models; i++) {
        gw_model *m = g->models[i];
        if (!m->alive) continue;
        json_t *o = json_pack("{s:s, s:s, s:I, s:s, s:s}", "id", m->name, "object", "model", "created", (json_int_t)0,
                              "owned_by", "kvbank", "root", m->model_dir);
        if (m->have_cfg) json_object_set_new(o, "max_model_len", json_integer(m->cfg.max_pos));
        json_array_append_new(data, o);
    }
    send_json(g, req, EP_MODELS, 200, json_pack("{s:s, s:o}", "object", "list", "data", data));
}

/* The model a request names, alive and connected; fills *err otherwise. */
static gw_model *model_for(gw *g, const char *name, gw_error *err) {
    gw_model *m = model_find(g, name);
    if (!m || (!m->alive && !m->client)) {
        gw_error_set(err, 404, "not_found_error", "model", "The model '%s' does not exist on this node", name);
        return NULL;
    }
    if (!m->alive || !m->client) {
        gw_error_set(err, 503, "server_error", "model", "The model '%s' is not running now", name);
        return NULL;
    }
    return m;
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
    gw_stream *s = NULL;
    gw_model *m = model_for(g, p.model, &err);
    if (!m) goto reject;
    if (g->n_streams >= g->o->max_streams) {
        g->rejected_busy++;
        gw_error_set(&err, 429, "rate_limit_error", NULL, "the gateway has %d requests in flight, its limit", g->n_streams);
        goto reject;
    }
    /* The prompt as token ids: given, or the text (a chat rendered with the model's template) encoded. */
    if ((ep == EP_CHAT || p.prompt_text || p.n_stop) && !m->tok) {
        gw_error_set(&err, 400, "invalid_request_error", ep == EP_CHAT ? "messages" : p.n_stop ? "stop" : "prompt",
                     "model '%s' has no tokenizer (tokenizer.json): send the prompt as token ids, without stop strings",
                     m->name);
        goto reject;
    }
    if (ep == EP_CHAT || p.prompt_text) {
        char *rendered = NULL, terr[256] = "";
        const char *text = p.prompt_text;
        size_t tlen = p.prompt_len;
        if (ep == EP_CHAT) {
            if (!m->tmpl) {
                no_chat_error(&err, m);
                goto reject;
            }
            if (kvb_chat_render(m->tmpl, p.messages, p.add_generation_prompt, p.template_kwargs, &rendered, terr,
                                sizeof terr) != KVB_OK) {
                gw_error_set(&err, 400, "invalid_request_error", "messages", "the chat template failed: %s", terr);
                goto reject;
            }
            text = rendered;
            tlen = strlen(rendered);
        }
        kvb_status es = kvb_tokenizer_encode(m->tok, text, tlen, p.add_special_tokens, &p.prompt_ids, &p.n_prompt_ids);
        free(rendered);
        if (es != KVB_OK || p.n_prompt_ids == 0) {
            gw_error_set(&err, 400, "invalid_request_error", ep == EP_CHAT ? "messages" : "prompt",
                         es != KVB_OK ? "the prompt is not valid UTF-8 text" : "the prompt is empty");
            goto reject;
        }
    }
    if (m->have_cfg)
        for (int i = 0; i < p.n_prompt_ids; i++)
            if (p.prompt_ids[i] >= m->cfg.vocab) {
                gw_error_set(&err, 400, "invalid_request_error", "prompt",
                             "prompt token %d is %d, outside the vocabulary of model '%s' [0, %d)", i, p.prompt_ids[i],
                             m->name, m->cfg.vocab);
                goto reject;
            }
    int max_pos = m->have_cfg ? m->cfg.max_pos : 0;
    if (max_pos && p.n_prompt_ids >= max_pos) {
        gw_error_set(&err, 400, "invalid_request_error", "prompt",
                     "the prompt has %d tokens; model '%s' takes at most %d (prompt and completion together)",
                     p.n_prompt_ids, m->name, max_pos);
        goto reject;
    }
    int max_tokens = p.max_tokens;
    if (!max_tokens) max_tokens = ep == EP_CHAT && max_pos ? max_pos - p.n_prompt_ids : DEFAULT_MAX_TOKENS;
    if (max_pos && p.n_prompt_ids + max_tokens > max_pos) {
        if (p.max_tokens) {
            gw_error_set(&err, 400, "invalid_request_error", "max_tokens",
                         "max_tokens is %d, but the prompt has %d tokens and model '%s' takes %d in all", p.max_tokens,
                         p.n_prompt_ids, m->name, max_pos);
            goto reject;
        }
        max_tokens = max_pos - p.n_prompt_ids;
    }
    int32_t stop_ids[GW_MAX_STOP_IDS + 8];
    int n_stop_ids = 0;
    for (int i = 0; i < p.n_stop_ids; i++) stop_ids[n_stop_ids++] = p.stop_ids[i];
    if (!p.ignore_eos) {
        const int32_t *eos = NULL;
        int n_eos = m->tok ? kvb_tokenizer_eos_ids(m->tok, &eos) : 0;
        for (int i = 0; i < n_eos && n_stop_ids < (int)KVB_ARRAY_LEN(stop_ids); i++) stop_ids[n_stop_ids++] = eos[i];
        if (!n_eos && m->have_cfg)
            for (int i = 0; i < m->cfg.n_eos && n_stop_ids < (int)KVB_ARRAY_LEN(stop_ids); i++)
                stop_ids[n_stop_ids++] = m->cfg.eos_ids[i];
    }

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
    s->stream = p.stream;
    s->include_usage = p.include_usage;
    s->return_token_ids = p.return_token_ids;
    s->timings = p.timings;
    s->n_prompt = p.n_prompt_ids;
    double slo = p.tbt_slo_ms >= 0 ? p.tbt_slo_ms : m->tbt_slo_ms >= 0 ? m->tbt_slo_ms : g->o->tbt_slo_ms;
    s->slo_ns = p.stream ? (uint64_t)(slo * 1e6) : 0; /* pacing is for what a user watches arrive */
    s->t_arrival = kvb_wall_ns();
    if (p.return_token_ids) {
        s->prompt_ids = p.prompt_ids;
        p.prompt_ids = NULL;
    }
    if (m->tok && (kvb_detok_create(m->tok, p.skip_special_tokens, &s->detok) != KVB_OK ||
                   gw_stop_create(p.stop, p.stop_len, p.n_stop, &s->stopper) != KVB_OK)) {
        kvb_detok_destroy(s->detok);
        gw_stop_destroy(s->stopper);
        free(s->prompt_ids);
        free(s);
        s = NULL;
        gw_error_set(&err, 500, "server_error", NULL, "out of memory");
        goto reject;
    }
    uv_timer_init(g->loop, &s->timer);
    s->timer.data = s;
    kvb_request r = {
        .tbt_slo_ms = slo, /* the model's planner sees the target too (OrbitFlow) */
        .prompt = s->prompt_ids ? s->prompt_ids : p.prompt_ids,
        .n_prompt = s->n_prompt,
        .max_tokens = max_tokens,
        .stop_ids = stop_ids,
        .n_stop = n_stop_ids,
        .sampling = {.temperature = (float)p.temperature,
                     .top_k = p.top_k,
                     .top_p = (float)p.top_p,
                     .seed = p.has_seed ? p.seed : (kvb_wall_ns() ^ (g->next_id * 0x9e3779b97f4a7c15ull))},
    };
    /* Everything in place before the submit: the model's answer may come within the dispatch below. */
    s->link = h2o_mem_alloc_shared(&req->pool, sizeof *s->link, on_req_dispose);
    s->link->s = s;
    s->next = g->streams;
    if (g->streams) g->streams->prev = s;
    g->streams = s;
    g->n_streams++;
    m->n_streams++;
    char msg[256];
    kvb_status st = kvb_client_submit(m->client, &r, on_upstream, s, SUBMIT_TIMEOUT_MS, &s->rid, msg, sizeof msg);
    if (st != KVB_OK) {
        gw_error_set(&err, st == KVB_ERR_INVALID ? 400 : 503, st == KVB_ERR_INVALID ? "invalid_request_error" : "server_error",
                     "prompt", "%s", msg);
        s->link->s = NULL;
        s->link = NULL;
        stream_unlink(s);
        uv_close((uv_handle_t *)&s->timer, on_stream_timer_closed);
        s = NULL;
        goto reject;
    }
    s->upstream_live = 1;
    gw_params_free(&p);
    json_decref(doc);
    if (s->stream) stream_pump(s); /* the response head goes out at once */
    kvb_client_dispatch(m->client); /* the send may have consumed the fd's edge */
    return;
reject:
    gw_params_free(&p);
    json_decref(doc);
    send_error(g, req, ep, &err);
}

/* vLLM's POST /tokenize (prompt or messages -> ids) and POST /detokenize (ids -> text). */
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
    json_t *out = NULL;
    if (!m) {
        gw_error_set(&err, 404, "not_found_error", "model", "The model '%s' does not exist on this node", p.model);
    } else if (!m->tok) {
        gw_error_set(&err, 400, "invalid_request_error", "model", "model '%s' has no tokenizer", m->name);
    } else if (ep == EP_DETOKENIZE) {
        char *text = NULL;
        size_t len = 0;
        if (kvb_tokenizer_decode(m->tok, p.ids, p.n_ids, 0, &text, &len) != KVB_OK)
            gw_error_set(&err, 400, "invalid_request_error", "tokens", "a token id is outside the vocabulary of '%s'",
                         m->name);
        else out = json_pack("{s:s%}", "prompt", text, len);
        free(text);
    } else {
        char *rendered = NULL, terr[256] = "";
        const char *text = p.prompt;
        size_t len = p.prompt_len;
        int ok = 1;
        if (p.messages) {
            if (!m->tmpl) {
                no_chat_error(&err, m);
                ok = 0;
            } else if (kvb_chat_render(m->tmpl, p.messages, p.add_generation_prompt, NULL, &rendered, terr, sizeof terr) !=
                       KVB_OK) {
                gw_error_set(&err, 400, "invalid_request_error", "messages", "the chat template failed: %s", terr);
                ok = 0;
            } else {
                text = rendered;
                len = strlen(rendered);
            }
        }
        int32_t *ids = NULL;
        int n = 0;
        if (ok && kvb_tokenizer_encode(m->tok, text, len, p.add_special_tokens, &ids, &n) != KVB_OK)
            gw_error_set(&err, 400, "invalid_request_error", "prompt", "the prompt is not valid UTF-8 text"), ok = 0;
        if (ok)
            out = json_pack("{s:i, s:i, s:o}", "count", n, "max_model_len", m->have_cfg ? m->cfg.max_pos : 0, "tokens",
                            ids_json(ids, n));
        free(ids);
        free(rendered);
    }
    gw_tok_params_free(&p);
    json_decref(doc);
    if (out) send_json(g, req, ep, 200, out);
    else send_error(g, req, ep, &err);
}

/* /metrics: the whole node in Prometheus' text format. */
static void handle_metrics(gw *g, h2o_req_t *req);

static int on_req(h2o_handler_t *self, h2o_req_t *req) {
    gw *g = *(gw **)(self + 1);
    int ep = EP_OTHER;
    if (path_is(req, "/v1/completions")) ep = EP_COMPLETIONS;
    else if (path_is(req, "/v1/chat/completions")) ep = EP_CHAT;
    else if (path_is(req, "/v1/models")) ep = EP_MODELS;
    else if (path_is(req, "/health")) ep = EP_HEALTH;
    else if (path_is(req, "/metrics")) ep = EP_METRICS;
    else if (path_is(req, "/tokenize")) ep = EP_TOKENIZE;
    else if (path_is(req, "/detokenize")) ep = EP_DETOKENIZE;
    int post = ep == EP_COMPLETIONS || ep == EP_CHAT || ep == EP_TOKENIZE || ep == EP_DETOKENIZE;
    gw_error err;
    if (ep == EP_OTHER) {
        gw_error_set(&err, 404, "not_found_error", NULL, "no endpoint %.*s", (int)KVB_MIN(req->path.len, (size_t)200),
                     req->path.base);
        send_error(g, req, ep, &err);
        return 0;
    }
    if (!method_is(req, post ? "POST" : "GET")) {
        gw_error_set(&err, 405, "invalid_request_error", NULL, "%s takes %s", EP_NAMES[ep], post ? "POST" : "GET");
        send_error(g, req, ep, &err);
        return 0;
    }
    switch (ep) {
    case EP_COMPLETIONS:
    case EP_CHAT: handle_generate(g, req, ep); break;
    case EP_MODELS: handle_models(g, req); break;
    case EP_HEALTH: handle_health(g, req); break;
    case EP_METRICS: handle_metrics(g, req); break;
    default: handle_tokens(g, req, ep); break;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------- /metrics */

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
    GAUGE("kvbank_kv_blocks_total", "KV blocks in the model's pool (own and borrowed)", m->pong.blocks_total);
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
    struct {
        const char *name, *help;
        size_t off;
    } hists[] = {
        {"kvbank_time_to_first_token_seconds", "Arrival at the gateway to the first token delivered", offsetof(gw_model, ttft)},
        {"kvbank_time_per_output_token_seconds", "(last - first delivery) / (tokens - 1) per request", offsetof(gw_model, tpot)},
        {"kvbank_inter_token_latency_seconds", "Gap between two tokens delivered (after Token-Deposit)", offsetof(gw_model, itl)},
        {"kvbank_generation_inter_token_latency_seconds", "Gap between two tokens as they arrived from the model",
         offsetof(gw_model, gen_itl)},
        {"kvbank_e2e_request_latency_seconds", "Arrival at the gateway to the request's end", offsetof(gw_model, e2e)},
    };
    for (size_t h = 0; h < KVB_ARRAY_LEN(hists); h++) {
        gw_metric_head(&t, hists[h].name, "histogram", hists[h].help);
        FOR_MODELS {
            gw_model *m = g->models[i];
            gw_metric_hist(&t, hists[h].name, LAB(m), (const gw_hist *)((const char *)m + hists[h].off));
        }
    }
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
    /* The Gateway API Inference Extension's model-server protocol, vLLM profile (its endpoint picker
     * scrapes these names). */
#undef LAB
#define LAB(m) (gw_label_escape((m)->name, esc, sizeof esc), snprintf(lab, sizeof lab, "model_name=\"%s\"", esc), lab)
    GAUGE("vllm:num_requests_running", "Requests running on the model (vLLM profile)", m->pong.running);
    GAUGE("vllm:num_requests_waiting", "Requests waiting for the model (vLLM profile)", m->pong.waiting);
    GAUGE("vllm:kv_cache_usage_perc", "KV-cache usage, 0..1 (vLLM profile)",
          m->pong.blocks_total ? 1.0 - (double)m->pong.blocks_free / m->pong.blocks_total : 0.0);
    GAUGE("vllm:gpu_cache_usage_perc", "KV-cache usage, 0..1 (vLLM's older name)",
          m->pong.blocks_total ? 1.0 - (double)m->pong.blocks_free / m->pong.blocks_total : 0.0);
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
    gw_metric_head(&t, "kvbank_gateway_rejected_busy_total", "counter", "Requests refused with 429 (max_streams)");
    gw_metric_sample(&t, "kvbank_gateway_rejected_busy_total", "", (double)g->rejected_busy);
    gw_metric_head(&t, "kvbank_gateway_streams_active", "gauge", "Requests in flight at the gateway");
    gw_metric_sample(&t, "kvbank_gateway_streams_active", "", g->n_streams);
    if (t.failed) send_body(g, req, EP_METRICS, 500, "text/plain", "out of memory\n", 14);
    else send_body(g, req, EP_METRICS, 200, "text/plain; version=0.0.4; charset=utf-8", t.s, t.len);
    free(t.s);
}

/* --------------------------------------------------------------------------------------- server */

static void on_accept(uv_stream_t *listener, int status) {
    gw *g = listener->data;
    if (status != 0) return;
    uv_tcp_t *conn = malloc(sizeof *conn);
    if (!conn) return;
    uv_tcp_init(g->loop, conn);
    if (uv_accept(listener, (uv_stream_t *)conn) != 0) {
        uv_close((uv_handle_t *)conn, (uv_close_cb)free);
        return;
    }
    uv_tcp_nodelay(conn, 1);
    h2o_socket_t *sock = h2o_uv_socket_create((uv_stream_t *)conn, (uv_close_cb)free);
    h2o_accept(&g->accept_ctx, sock);
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
}

kvb_status gw_opts_from_node(const kvb_node_config *c, gw_opts *o, gw_model_opts *models, int max_models) {
    o->coordinator = c->coordinator;
    if (c->gateway.enabled) {
        o->host = c->gateway.host;
        o->port = c->gateway.port;
        o->max_body = (size_t)c->gateway.max_body;
        o->max_streams = c->gateway.max_streams;
        o->tbt_slo_ms = c->gateway.tbt_slo_ms;
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
    printf("kvbank-gateway: listening on http://%s%s%s:%d\n", strchr(o->host, ':') ? "[" : "", o->host,
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
        if (s->upstream_live && s->m->client) kvb_client_abandon(s->m->client, s->rid), s->upstream_live = 0;
    /* h2o's closing connections leave deferred work on its zero timeout: let it run, then dispose */
    for (int k = 0; k < 10; k++) uv_run(g->loop, UV_RUN_NOWAIT);
    h2o_context_dispose(&g->h2o_ctx);
    uv_walk(g->loop, close_walk, NULL);
    uv_run(g->loop, UV_RUN_DEFAULT);
    h2o_config_dispose(&g->h2o_conf);
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
