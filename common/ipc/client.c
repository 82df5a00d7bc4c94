/* kvbank — a client for a model server (one DEALER socket, many requests).
 *
 * Live requests sit in a chained hash table keyed by their wire request_id (a counter of this client,
 * so ids never repeat). kvb_client_dispatch reads every waiting message and routes it: a TokenEvent or
 * an ErrorReply to its request's callback, a Pong to the pong callback; a message for an id that is
 * not live (a late event of an abandoned request) is dropped. The blocking calls are the asynchronous
 * ones followed by a wait on the socket. */
#include "common/ipc/client.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/ipc/wire.h"

#define BUCKETS0 64 /* initial hash buckets (a power of two); doubled when there are more requests */

typedef struct live_req {
    uint64_t rid;
    kvb_client_event_fn fn;
    void *ud;
    uint32_t next_index;   /* index the next token must have */
    struct live_req *next; /* hash chain */
} live_req;

struct kvb_client {
    void *zctx;
    void *sock;              /* DEALER connected to the server */
    uint64_t last_id;        /* request_id of the last request (ids start at 1; 0 is reserved) */
    uint64_t last_nonce;     /* nonce of the last ping */
    live_req **buckets;      /* [n_buckets] */
    int n_buckets;
    int n_live;
    int in_dispatch;         /* dispatch is running (a callback's own dispatch call returns at once) */
    kvb_client_pong_fn pong_fn;
    void *pong_ud;
    /* the blocking ping waiting for its answer */
    uint64_t want_nonce;     /* 0: none */
    int got_pong;            /* 1: answered; < 0: rejected with ErrorReply code got_pong */
    uint32_t pong_live;
};

kvb_status kvb_client_connect(const char *endpoint, kvb_client **out) {
    if (!endpoint || !out) return KVB_ERR_INVALID;
    kvb_status st = KVB_OK;
    kvb_client *c = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *c, (void **)&c));
    KVB_TRY_GOTO(kvb_calloc(BUCKETS0, sizeof *c->buckets, (void **)&c->buckets), fail);
    c->n_buckets = BUCKETS0;
    c->zctx = zmq_ctx_new();
    if (!c->zctx) {
        KVB_LOG_E("zmq_ctx_new: %s", zmq_strerror(errno));
        st = KVB_ERR_IO;
        goto fail;
    }
    c->sock = zmq_socket(c->zctx, ZMQ_DEALER);
    int zero = 0;
    if (!c->sock || zmq_setsockopt(c->sock, ZMQ_LINGER, &zero, sizeof zero) != 0) {
        KVB_LOG_E("zmq_socket: %s", zmq_strerror(errno));
        st = KVB_ERR_IO;
        goto fail;
    }
    /* Connecting is asynchronous: messages queue until the server is there. */
    if (zmq_connect(c->sock, endpoint) != 0) {
        KVB_LOG_E("cannot connect to %s: %s", endpoint, zmq_strerror(errno));
        st = KVB_ERR_INVALID;
        goto fail;
    }
    *out = c;
    return KVB_OK;
fail:
    kvb_client_destroy(c);
    return st;
}

void kvb_client_destroy(kvb_client *c) {
    if (!c) return;
    if (c->sock) zmq_close(c->sock);
    if (c->zctx) zmq_ctx_term(c->zctx);
    for (int b = 0; c->buckets && b < c->n_buckets; b++) {
        for (live_req *e = c->buckets[b]; e;) {
            live_req *nx = e->next;
            free(e);
            e = nx;
        }
    }
    free(c->buckets);
    free(c);
}

static void set_err(char *err, size_t err_len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void set_err(char *err, size_t err_len, const char *fmt, ...) {
    if (!err || !err_len) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_len, fmt, ap);
    va_end(ap);
}

/* ------------------------------------------------------------------------------ the request table */

static live_req **req_slot(kvb_client *c, uint64_t rid) {
    live_req **p = &c->buckets[rid & (uint64_t)(c->n_buckets - 1)];
    while (*p && (*p)->rid != rid) p = &(*p)->next;
    return p;
}

static live_req *req_find(kvb_client *c, uint64_t rid) { return *req_slot(c, rid); }

/* Unlinks and returns the request `rid` (NULL if not live); the caller frees it. */
static live_req *req_take(kvb_client *c, uint64_t rid) {
    live_req **p = req_slot(c, rid);
    live_req *e = *p;
    if (e) {
        *p = e->next;
        c->n_live--;
    }
    return e;
}

/* Doubles the table when it holds more requests than buckets (a failed allocation keeps it as is). */
static void req_grow(kvb_client *c) {
    if (c->n_live < c->n_buckets || c->n_buckets > INT_MAX / 2) return;
    int nb = 2 * c->n_buckets;
    live_req **b = NULL;
    if (kvb_calloc((size_t)nb, sizeof *b, (void **)&b) != KVB_OK) return;
    for (int i = 0; i < c->n_buckets; i++) {
        for (live_req *e = c->buckets[i]; e;) {
            live_req *nx = e->next;
            live_req **h = &b[e->rid & (uint64_t)(nb - 1)];
            e->next = *h;
            *h = e;
            e = nx;
        }
    }
    free(c->buckets);
    c->buckets = b;
    c->n_buckets = nb;
}

/* ---------------------------------------------------------------------------------------- sending */

/* Sends `env`, waiting at most timeout_ms for room in the queue (negative: no bound). */
static kvb_status send_env(kvb_client *c, Kvbank__Envelope *env, int timeout_ms) {
    int t = timeout_ms < 0 ? -1 : timeout_ms;
    zmq_setsockopt(c->sock, ZMQ_SNDTIMEO, &t, sizeof t);
    kvb_status st = kvb_wire_send(c->sock, NULL, 0, env, 0);
    if (st == KVB_ERR_IO && errno == EAGAIN) return KVB_ERR_TIMEOUT;
    return st;
}

/* Best-effort CancelRequest (never blocks). */
static void send_cancel(kvb_client *c, uint64_t rid) {
    Kvbank__CancelRequest cr = KVBANK__CANCEL_REQUEST__INIT;
    cr.request_id = rid;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_CANCEL;
    env.cancel = &cr;
    if (kvb_wire_send(c->sock, NULL, 0, &env, 1) != KVB_OK) KVB_LOG_W("could not send the cancel of request %" PRIu64, rid);
}

kvb_status kvb_client_submit(kvb_client *c, const kvb_request *r, kvb_client_event_fn fn, void *ud, int timeout_ms,
                             uint64_t *rid_out, char *err, size_t err_len) {
    set_err(err, err_len, "%s", "");
    if (!c || !r || !fn) return KVB_ERR_INVALID;
    if (r->n_prompt < 0 || r->n_stop < 0 || (r->n_prompt && !r->prompt) || (r->n_stop && !r->stop_ids) ||
        r->max_tokens < 0 || r->sampling.top_k < 0) {
        set_err(err, err_len, "malformed request (negative count or missing array)");
        return KVB_ERR_INVALID;
    }
    uint64_t rid = c->last_id + 1;
    Kvbank__GenerateRequest g = KVBANK__GENERATE_REQUEST__INIT;
    g.request_id = rid;
    /* protobuf-c's message structs are not const-correct; packing only reads these arrays. */
    g.n_prompt_ids = (size_t)r->n_prompt;
    g.prompt_ids = (int32_t *)r->prompt;
    g.n_stop_ids = (size_t)r->n_stop;
    g.stop_ids = (int32_t *)r->stop_ids;
    g.max_tokens = (uint32_t)r->max_tokens;
    g.temperature = r->sampling.temperature;
    g.top_k = (uint32_t)r->sampling.top_k;
    g.top_p = r->sampling.top_p;
    g.seed = r->sampling.seed;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_GENERATE;
    env.generate = &g;
    env.version = KVB_PROTO_VERSION;
    size_t bytes = kvbank__envelope__get_packed_size(&env);
    if (bytes > KVB_WIRE_MAX_FRAME) {
        set_err(err, err_len, "the request (%d prompt tokens) needs %zu bytes on the wire, above the %u-byte limit",
                r->n_prompt, bytes, KVB_WIRE_MAX_FRAME);
        return KVB_ERR_INVALID;
    }
    live_req *e = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *e, (void **)&e));
    kvb_status st = send_env(c, &env, timeout_ms);
    if (st != KVB_OK) {
        free(e);
        set_err(err, err_len, "could not send the request: %s", kvb_status_str(st));
        return st;
    }
    c->last_id = rid;
    e->rid = rid;
    e->fn = fn;
    e->ud = ud;
    live_req **h = &c->buckets[rid & (uint64_t)(c->n_buckets - 1)];
    e->next = *h;
    *h = e;
    c->n_live++;
    req_grow(c);
    if (rid_out) *rid_out = rid;
    return KVB_OK;
}

kvb_status kvb_client_cancel(kvb_client *c, uint64_t rid) {
    if (!c) return KVB_ERR_INVALID;
    if (!req_find(c, rid)) return KVB_ERR_NOT_FOUND;
    send_cancel(c, rid);
    return KVB_OK;
}

kvb_status kvb_client_abandon(kvb_client *c, uint64_t rid) {
    if (!c) return KVB_ERR_INVALID;
    live_req *e = req_take(c, rid);
    if (!e) return KVB_ERR_NOT_FOUND;
    free(e);
    send_cancel(c, rid);
    return KVB_OK;
}

int kvb_client_n_live(const kvb_client *c) { return c ? c->n_live : 0; }

int kvb_client_fd(const kvb_client *c) {
    if (!c) return -1;
    int fd = -1;
    size_t sz = sizeof fd;
    if (zmq_getsockopt(c->sock, ZMQ_FD, &fd, &sz) != 0) return -1;
    return fd;
}

void kvb_client_set_pong_fn(kvb_client *c, kvb_client_pong_fn fn, void *ud) {
    if (!c) return;
    c->pong_fn = fn;
    c->pong_ud = ud;
}

/* Sends a Ping, waiting at most timeout_ms for room in the queue. */
static kvb_status ping_send(kvb_client *c, int timeout_ms, uint64_t *nonce) {
    Kvbank__Ping p = KVBANK__PING__INIT;
    p.nonce = ++c->last_nonce;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_PING;
    env.ping = &p;
    KVB_TRY(send_env(c, &env, timeout_ms));
    if (nonce) *nonce = p.nonce;
    return KVB_OK;
}

kvb_status kvb_client_ping_send(kvb_client *c, uint64_t *nonce) {
    if (!c) return KVB_ERR_INVALID;
    return ping_send(c, 0, nonce);
}

/* -------------------------------------------------------------------------------------- receiving */

static kvb_finish finish_from_wire(Kvbank__FinishReason f) {
    switch (f) {
    case KVBANK__FINISH_REASON__FINISH_NONE: return KVB_FINISH_NONE;
    case KVBANK__FINISH_REASON__FINISH_LENGTH: return KVB_FINISH_LENGTH;
    case KVBANK__FINISH_REASON__FINISH_STOP: return KVB_FINISH_STOP;
    case KVBANK__FINISH_REASON__FINISH_CANCELLED: return KVB_FINISH_CANCELLED;
    case KVBANK__FINISH_REASON__FINISH_ERROR: return KVB_FINISH_ERROR;
    default: return KVB_FINISH_ERROR; /* an unknown reason still ends the request */
    }
}

/* The status an ErrorReply carries (a kvb_status is negative; anything else is a protocol error). */
static kvb_status status_from_wire(int32_t code) { return code < 0 ? (kvb_status)code : KVB_ERR_PROTOCOL; }

/* Ends request `e` (already unlinked) with a final callback and frees it. */
static void finish_req(live_req *e, kvb_finish f, kvb_status st, const char *err) {
    e->fn(e->ud, e->rid, NULL, NULL, 0, (int)e->next_index, f, st, err ? err : "");
    free(e);
}

static void on_tokens(kvb_client *c, const Kvbank__TokenEvent *te) {
    live_req *e = req_find(c, te->request_id);
    if (!e) {
        KVB_LOG_D("client: event of request %" PRIu64 " that is not live (dropped)", te->request_id);
        return;
    }
    if (te->first_index != e->next_index || te->n_t_ns != te->n_tokens || te->n_tokens > INT_MAX) {
        char msg[160];
        snprintf(msg, sizeof msg, "token stream out of order: got index %" PRIu32 " (%zu tokens, %zu times), expected %" PRIu32,
                 te->first_index, te->n_tokens, te->n_t_ns, e->next_index);
        KVB_LOG_E("request %" PRIu64 ": %s", e->rid, msg);
        send_cancel(c, e->rid);
        finish_req(req_take(c, e->rid), KVB_FINISH_ERROR, KVB_ERR_PROTOCOL, msg);
        return;
    }
    kvb_finish f = finish_from_wire(te->finish);
    uint64_t rid = e->rid;
    e->next_index += (uint32_t)te->n_tokens;
    if (f == KVB_FINISH_NONE) {
        /* `e` may be abandoned (freed) inside the callback: it is not touched afterwards. */
        if (te->n_tokens) e->fn(e->ud, rid, te->tokens, te->t_ns, (int)te->n_tokens, (int)te->first_index, f, KVB_OK, "");
        return;
    }
    req_take(c, rid);
    kvb_status st = f == KVB_FINISH_ERROR ? KVB_ERR_BACKEND : KVB_OK;
    e->fn(e->ud, rid, te->tokens, te->t_ns, (int)te->n_tokens, (int)te->first_index, f, st,
          f == KVB_FINISH_ERROR ? "the model failed the request" : "");
    free(e);
}

static void on_error(kvb_client *c, const Kvbank__ErrorReply *er) {
    const char *msg = er->message ? er->message : "";
    kvb_status st = status_from_wire(er->code);
    uint64_t rid = er->request_id;
    if (rid == 0) {
        /* Not attributable by id (the server could not read a message of ours): a blocking ping or the
         * only live request must be the one it was about. */
        if (c->want_nonce) {
            KVB_LOG_W("server rejected a ping: %s", msg);
            c->got_pong = st;
            return;
        }
        if (c->n_live == 1) {
            for (int b = 0; b < c->n_buckets; b++)
                if (c->buckets[b]) rid = c->buckets[b]->rid;
        } else {
            KVB_LOG_W("server error about no request: %s", msg);
            return;
        }
    }
    live_req *e = req_take(c, rid);
    if (!e) {
        KVB_LOG_D("client: error for request %" PRIu64 " that is not live: %s", rid, msg);
        return;
    }
    finish_req(e, KVB_FINISH_ERROR, st, msg);
}

static void on_pong(kvb_client *c, const Kvbank__Pong *p) {
    if (c->want_nonce && p->nonce == c->want_nonce) {
        c->got_pong = 1;
        c->pong_live = p->live_requests;
    }
    if (!c->pong_fn) return;
    kvb_client_pong o = {
        .nonce = p->nonce,
        .live_requests = p->live_requests,
        .running = p->running,
        .waiting = p->waiting,
        .prompt_tokens = p->prompt_tokens,
        .generated_tokens = p->generated_tokens,
        .preemptions = p->preemptions,
        .prefix_hit_tokens = p->prefix_hit_tokens,
        .blocks_total = p->blocks_total,
        .blocks_free = p->blocks_free,
        .blocks_own = p->blocks_own,
        .blocks_borrowed = p->blocks_borrowed,
        .accepted = p->accepted,
        .rejected = p->rejected,
        .completed = p->completed,
        .disconnects = p->disconnects,
    };
    snprintf(o.model, sizeof o.model, "%s", p->model ? p->model : "");
    c->pong_fn(c->pong_ud, &o);
}

/* Receives one message without waiting: 1 handled (or skipped), 0 none waiting, < 0 socket error. */
static int recv_one(kvb_client *c) {
    zmq_msg_t m;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, c->sock, ZMQ_DONTWAIT) < 0) {
        int e = errno;
        zmq_msg_close(&m);
        if (e == EAGAIN) return 0;
        if (e == EINTR) return 1;
        KVB_LOG_E("zmq_msg_recv: %s", zmq_strerror(e));
        return -1;
    }
    if (zmq_msg_more(&m)) {
        int n = 1, more = 1;
        while (more) {
            zmq_msg_t extra;
            zmq_msg_init(&extra);
            if (zmq_msg_recv(&extra, c->sock, ZMQ_DONTWAIT) < 0) more = 0;
            else n++, more = zmq_msg_more(&extra);
            zmq_msg_close(&extra);
        }
        KVB_LOG_W("dropping a %d-frame message from the server", n);
        zmq_msg_close(&m);
        return 1;
    }
    Kvbank__Envelope *env = NULL;
    kvb_status st = kvb_wire_unpack(zmq_msg_data(&m), zmq_msg_size(&m), &env, NULL, 0);
    zmq_msg_close(&m);
    if (st != KVB_OK) return 1; /* logged by kvb_wire_unpack */
    switch (env->body_case) {
    case KVBANK__ENVELOPE__BODY_TOKENS: on_tokens(c, env->tokens); break;
    case KVBANK__ENVELOPE__BODY_ERROR: on_error(c, env->error); break;
    case KVBANK__ENVELOPE__BODY_PONG: on_pong(c, env->pong); break;
    default: KVB_LOG_D("client: skipping a message of type %d", (int)env->body_case); break;
    }
    kvbank__envelope__free_unpacked(env, NULL);
    return 1;
}

kvb_status kvb_client_dispatch(kvb_client *c) {
    if (!c) return KVB_ERR_INVALID;
    if (c->in_dispatch) return KVB_OK;
    c->in_dispatch = 1;
    int rc;
    while ((rc = recv_one(c)) > 0) {
    }
    c->in_dispatch = 0;
    return rc < 0 ? KVB_ERR_IO : KVB_OK;
}

/* Waits until a message may be readable or `deadline_ns` (kvb_now_ns clock; 0: forever) passes. */
static kvb_status wait_readable(kvb_client *c, uint64_t deadline_ns) {
    for (;;) {
        long wait_ms = -1;
        if (deadline_ns) {
            uint64_t now = kvb_now_ns();
            wait_ms = now >= deadline_ns ? 0 : (long)((deadline_ns - now + 999999) / 1000000);
        }
        zmq_pollitem_t it = {.socket = c->sock, .fd = 0, .events = ZMQ_POLLIN, .revents = 0};
        int rc = zmq_poll(&it, 1, wait_ms);
        if (rc < 0) {
            if (errno == EINTR) continue;
            KVB_LOG_E("zmq_poll: %s", zmq_strerror(errno));
            return KVB_ERR_IO;
        }
        return rc == 0 ? KVB_ERR_TIMEOUT : KVB_OK;
    }
}

static uint64_t deadline_after(int timeout_ms) {
    return timeout_ms < 0 ? 0 : kvb_now_ns() + (uint64_t)timeout_ms * 1000000u;
}

/* ----------------------------------------------------------------------------------- blocking calls */

typedef struct gen_wait {
    kvb_client *c;
    kvb_client_token_fn on_token;
    void *ud;
    int cancelling; /* on_token asked to stop: it is not called again */
    int done;
    kvb_finish finish;
    kvb_status st;
    char *err;
    size_t err_len;
} gen_wait;

static void gen_event(void *ud, uint64_t rid, const int32_t *tokens, const uint64_t *t_ns, int n, int first_index,
                      kvb_finish finish, kvb_status st, const char *err) {
    gen_wait *g = ud;
    for (int k = 0; k < n; k++) {
        if (g->cancelling || !g->on_token) break;
        if (g->on_token(g->ud, first_index + k, tokens[k], t_ns[k])) {
            /* Stop delivering; the server answers with FINISH_CANCELLED (or the request finishes on its
             * own first). */
            g->cancelling = 1;
            kvb_client_cancel(g->c, rid);
        }
    }
    if (finish == KVB_FINISH_NONE) return;
    g->done = 1;
    g->finish = finish;
    g->st = st;
    if (st != KVB_OK) set_err(g->err, g->err_len, "%s", err);
}

kvb_status kvb_client_generate(kvb_client *c, const kvb_request *r, kvb_client_token_fn on_token, void *ud,
                               int timeout_ms, kvb_finish *finish, char *err, size_t err_len) {
    if (finish) *finish = KVB_FINISH_NONE;
    set_err(err, err_len, "%s", "");
    if (!c || !r) return KVB_ERR_INVALID;
    gen_wait g = {.c = c, .on_token = on_token, .ud = ud, .err = err, .err_len = err_len};
    uint64_t rid = 0;
    KVB_TRY(kvb_client_submit(c, r, gen_event, &g, timeout_ms, &rid, err, err_len));
    for (;;) {
        kvb_status st = kvb_client_dispatch(c);
        if (st != KVB_OK) {
            kvb_client_abandon(c, rid);
            return st;
        }
        if (g.done) break;
        st = wait_readable(c, deadline_after(timeout_ms));
        if (st != KVB_OK) {
            if (st == KVB_ERR_TIMEOUT) set_err(err, err_len, "no reply from the server within %d ms", timeout_ms);
            kvb_client_abandon(c, rid); /* the server need not generate for nobody */
            return st;
        }
    }
    /* Only a finish the model reached (or a failure while running) is a finish; a rejection is not. */
    if (finish && (g.st == KVB_OK || g.st == KVB_ERR_BACKEND)) *finish = g.finish;
    return g.st;
}

kvb_status kvb_client_ping(kvb_client *c, int timeout_ms, uint32_t *live) {
    if (!c) return KVB_ERR_INVALID;
    uint64_t nonce = 0;
    kvb_status st = ping_send(c, timeout_ms, &nonce);
    if (st != KVB_OK) return st;
    c->want_nonce = nonce;
    c->got_pong = 0;
    uint64_t deadline = deadline_after(timeout_ms);
    for (;;) {
        st = kvb_client_dispatch(c);
        if (st != KVB_OK || c->got_pong) break;
        st = wait_readable(c, deadline);
        if (st != KVB_OK) break;
    }
    c->want_nonce = 0;
    if (st != KVB_OK) return st;
    if (c->got_pong < 0) return (kvb_status)c->got_pong;
    if (live) *live = c->pong_live;
    return KVB_OK;
}
