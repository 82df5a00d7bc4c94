/* kvbank — a blocking client for a model server (one DEALER socket). */
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

#define MONITOR_EP "inproc://kvb-client-monitor" /* one per client: each client has its own context */
#define RECONNECT_IVL_MS 100                          /* ZeroMQ reconnect period, constant */

struct kvb_client {
    void *zctx;
    void *sock;          /* DEALER connected to the server */
    void *mon;           /* PAIR receiving the DEALER's connection events */
    kvb_client_opts o;
    int connected;       /* a handshake completed and its connection has not been lost since */
    uint64_t last_id;    /* request_id of the last generate (ids start at 1; 0 is reserved) */
    uint64_t last_nonce; /* nonce of the last ping */
    kvb_client_stats stats;
};

void kvb_client_opts_default(kvb_client_opts *o) {
    if (!o) return;
    o->heartbeat_ms = 200;
    o->dead_ms = 800;
    o->resume_ms = 30000;
}

kvb_status kvb_client_connect(const char *endpoint, kvb_client **out) {
    return kvb_client_connect_opts(endpoint, NULL, out);
}

kvb_status kvb_client_connect_opts(const char *endpoint, const kvb_client_opts *o, kvb_client **out) {
    if (!endpoint || !out) return KVB_ERR_INVALID;
    kvb_client_opts d;
    kvb_client_opts_default(&d);
    if (o) d = *o;
    if (d.heartbeat_ms < 0 || d.dead_ms < 0 || d.resume_ms < 0 || (d.heartbeat_ms > 0 && d.dead_ms == 0))
        return KVB_ERR_INVALID;
    kvb_status st = KVB_OK;
    kvb_client *c = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *c, (void **)&c));
    c->o = d;
    c->zctx = zmq_ctx_new();
    if (!c->zctx) {
        KVB_LOG_E("zmq_ctx_new: %s", zmq_strerror(errno));
        st = KVB_ERR_IO;
        goto fail;
    }
    c->sock = zmq_socket(c->zctx, ZMQ_DEALER);
    int zero = 0, ivl = RECONNECT_IVL_MS, ttl = 4 * (d.heartbeat_ms + d.dead_ms);
    if (!c->sock || zmq_setsockopt(c->sock, ZMQ_LINGER, &zero, sizeof zero) != 0 ||
        zmq_setsockopt(c->sock, ZMQ_RECONNECT_IVL, &ivl, sizeof ivl) != 0 ||
        zmq_setsockopt(c->sock, ZMQ_RECONNECT_IVL_MAX, &zero, sizeof zero) != 0 ||
        (d.heartbeat_ms > 0 &&
         /* PINGs every heartbeat_ms; no traffic for dead_ms after one closes the connection (the
          * server's I/O thread answers even in the middle of a long engine step). TTL asks the
          * server to drop this connection when the client goes silent (hung) for a while. */
         (zmq_setsockopt(c->sock, ZMQ_HEARTBEAT_IVL, &d.heartbeat_ms, sizeof(int)) != 0 ||
          zmq_setsockopt(c->sock, ZMQ_HEARTBEAT_TIMEOUT, &d.dead_ms, sizeof(int)) != 0 ||
          zmq_setsockopt(c->sock, ZMQ_HEARTBEAT_TTL, &ttl, sizeof ttl) != 0))) {
        KVB_LOG_E("zmq_socket: %s", zmq_strerror(errno));
        st = KVB_ERR_IO;
        goto fail;
    }
    /* Connection events: a completed handshake and a lost connection (the request on it is gone). */
    if (zmq_socket_monitor(c->sock, MONITOR_EP, ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_DISCONNECTED) != 0 ||
        !(c->mon = zmq_socket(c->zctx, ZMQ_PAIR)) || zmq_setsockopt(c->mon, ZMQ_LINGER, &zero, sizeof zero) != 0 ||
        zmq_connect(c->mon, MONITOR_EP) != 0) {
        KVB_LOG_E("zmq_socket_monitor: %s", zmq_strerror(errno));
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
    if (c->sock && c->mon) zmq_socket_monitor(c->sock, NULL, 0);
    if (c->mon) zmq_close(c->mon);
    if (c->sock) zmq_close(c->sock);
    if (c->zctx) zmq_ctx_term(c->zctx);
    free(c);
}

void kvb_client_get_stats(const kvb_client *c, kvb_client_stats *out) {
    if (!out) return;
    memset(out, 0, sizeof *out);
    if (c) *out = c->stats;
}

/* Reads the connection events queued on the monitor socket (never blocks). */
static void pump_monitor(kvb_client *c) {
    for (;;) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, c->mon, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            return;
        }
        uint16_t ev = 0; /* frame 1: event (16 bits) and value (32 bits); frame 2: the endpoint */
        if (zmq_msg_size(&m) >= sizeof ev) memcpy(&ev, zmq_msg_data(&m), sizeof ev);
        int more = zmq_msg_more(&m);
        zmq_msg_close(&m);
        while (more) {
            zmq_msg_init(&m);
            more = zmq_msg_recv(&m, c->mon, ZMQ_DONTWAIT) >= 0 && zmq_msg_more(&m);
            zmq_msg_close(&m);
        }
        if (ev == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
            c->connected = 1;
            c->stats.connects++;
        } else if (ev == ZMQ_EVENT_DISCONNECTED && c->connected) {
            /* A connection that never completed its handshake carried nothing: not a loss. */
            c->connected = 0;
            c->stats.disconnects++;
        }
    }
}

static void set_err(char *err, size_t err_len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void set_err(char *err, size_t err_len, const char *fmt, ...) {
    if (!err || !err_len) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_len, fmt, ap);
    va_end(ap);
}

/* Sends `env`, waiting at most timeout_ms for room in the queue. */
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

/* Receives the next valid envelope, waiting until `deadline_ns` (kvb_now_ns clock; 0: forever; in
 * the past: only what is there now). Malformed or multi-frame messages are logged and skipped. Returns
 * KVB_ERR_TIMEOUT when the deadline passed, and also early when a connection event arrived (the
 * caller looks at the connection state and calls again). Caller frees *out. */
static kvb_status recv_env(kvb_client *c, uint64_t deadline_ns, Kvbank__Envelope **out) {
    for (;;) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, c->sock, ZMQ_DONTWAIT) < 0) {
            int e = errno;
            zmq_msg_close(&m);
            if (e != EAGAIN && e != EINTR) {
                KVB_LOG_E("zmq_msg_recv: %s", zmq_strerror(e));
                return KVB_ERR_IO;
            }
            long wait_ms = -1;
            if (deadline_ns) {
                uint64_t now = kvb_now_ns();
                if (now >= deadline_ns) return KVB_ERR_TIMEOUT;
                wait_ms = (long)((deadline_ns - now + 999999) / 1000000);
            }
            zmq_pollitem_t it[2] = {{.socket = c->sock, .events = ZMQ_POLLIN}, {.socket = c->mon, .events = ZMQ_POLLIN}};
            int rc = zmq_poll(it, 2, wait_ms);
            if (rc < 0 && errno != EINTR) {
                KVB_LOG_E("zmq_poll: %s", zmq_strerror(errno));
                return KVB_ERR_IO;
            }
            if (rc > 0 && (it[1].revents & ZMQ_POLLIN)) {
                uint64_t lost = c->stats.disconnects, up = c->stats.connects;
                pump_monitor(c);
                if (c->stats.disconnects != lost || c->stats.connects != up) return KVB_ERR_TIMEOUT;
            }
            continue;
        }
        int more = zmq_msg_more(&m);
        if (more) {
            int n = 1;
            while (more) {
                zmq_msg_t extra;
                zmq_msg_init(&extra);
                if (zmq_msg_recv(&extra, c->sock, ZMQ_DONTWAIT) < 0) more = 0;
                else n++, more = zmq_msg_more(&extra);
                zmq_msg_close(&extra);
            }
            KVB_LOG_W("dropping a %d-frame message from the server", n);
            zmq_msg_close(&m);
            continue;
        }
        Kvbank__Envelope *env = NULL;
        kvb_status st = kvb_wire_unpack(zmq_msg_data(&m), zmq_msg_size(&m), &env, NULL, 0);
        zmq_msg_close(&m);
        if (st != KVB_OK) continue; /* logged by kvb_wire_unpack */
        *out = env;
        return KVB_OK;
    }
}

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

static uint64_t deadline_after(int timeout_ms) {
    return timeout_ms < 0 ? 0 : kvb_now_ns() + (uint64_t)timeout_ms * 1000000u;
}

/* One request across the server processes it runs on. */
typedef struct gen {
    const kvb_request *r;
    int32_t *seq;       /* [n_prompt + max_tokens] the prompt, then the tokens delivered so far */
    int n_out;          /* tokens delivered to on_token (or dropped after a cancel) */
    int base;           /* output index of the current attempt's token 0 */
    uint64_t rid;       /* wire request_id of the current attempt */
    int cancelling;
} gen;

/* Sends the current attempt: the prompt and the delivered tokens, for the tokens still missing. */
static kvb_status submit(kvb_client *c, gen *g, int timeout_ms) {
    const kvb_request *r = g->r;
    g->rid = ++c->last_id;
    g->base = g->n_out;
    Kvbank__GenerateRequest q = KVBANK__GENERATE_REQUEST__INIT;
    q.request_id = g->rid;
    q.n_prompt_ids = (size_t)(r->n_prompt + g->n_out);
    q.prompt_ids = g->seq;
    /* protobuf-c's message structs are not const-correct; packing only reads this array. */
    q.n_stop_ids = (size_t)r->n_stop;
    q.stop_ids = (int32_t *)r->stop_ids;
    q.max_tokens = (uint32_t)(r->max_tokens - g->n_out);
    q.temperature = r->sampling.temperature;
    q.top_k = (uint32_t)r->sampling.top_k;
    q.top_p = r->sampling.top_p;
    q.seed = r->sampling.seed;
    q.resume_index = (uint32_t)g->n_out;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_GENERATE;
    env.generate = &q;
    return send_env(c, &env, timeout_ms);
}

/* The finish of a request whose server went away after it had delivered every token it could have
 * (max_tokens, or a stop token last: the finish was lost with the server), else NONE. */
static kvb_finish finish_by_tokens(const gen *g) {
    const kvb_request *r = g->r;
    if (g->n_out >= r->max_tokens) return KVB_FINISH_LENGTH;
    if (g->n_out > 0) {
        int32_t last = g->seq[r->n_prompt + g->n_out - 1];
        for (int k = 0; k < r->n_stop; k++)
            if (r->stop_ids[k] == last) return KVB_FINISH_STOP;
    }
    return KVB_FINISH_NONE;
}

kvb_status kvb_client_generate(kvb_client *c, const kvb_request *r, kvb_client_token_fn on_token, void *ud,
                               int timeout_ms, kvb_finish *finish, char *err, size_t err_len) {
    if (finish) *finish = KVB_FINISH_NONE;
    set_err(err, err_len, "%s", "");
    if (!c || !r) return KVB_ERR_INVALID;
    if (r->n_prompt < 0 || r->n_stop < 0 || (r->n_prompt && !r->prompt) || (r->n_stop && !r->stop_ids) ||
        r->max_tokens < 0 || r->sampling.top_k < 0 || (int64_t)r->n_prompt + r->max_tokens > INT_MAX) {
        set_err(err, err_len, "malformed request (negative count or missing array)");
        return KVB_ERR_INVALID;
    }
    gen g = {.r = r};
    kvb_status st = kvb_malloc(((size_t)r->n_prompt + (size_t)r->max_tokens + 1) * sizeof *g.seq, (void **)&g.seq);
    if (st != KVB_OK) {
        set_err(err, err_len, "out of memory");
        return st;
    }
    if (r->n_prompt) memcpy(g.seq, r->prompt, (size_t)r->n_prompt * sizeof *g.seq);
    pump_monitor(c); /* events of earlier calls: only losses from now on concern this request */
    uint64_t lost_seen = c->stats.disconnects;
    int lost = 0;          /* the connection that carried the current attempt is gone */
    uint64_t lost_at = 0;  /* kvb_now_ns when that was noticed */
    if ((st = submit(c, &g, timeout_ms)) != KVB_OK) {
        set_err(err, err_len, "could not send the request: %s", kvb_status_str(st));
        goto out;
    }
    uint64_t msg_deadline = deadline_after(timeout_ms);
    kvb_finish f = KVB_FINISH_NONE;
    int draining = 0; /* the connection went: read what it delivered before it did, then count it lost */
    for (;;) {
        if (c->stats.disconnects != lost_seen) {
            lost_seen = c->stats.disconnects;
            if (!lost) draining = 1;
        }
        if (lost && !draining) {
            if ((f = finish_by_tokens(&g)) != KVB_FINISH_NONE || g.cancelling) {
                if (f == KVB_FINISH_NONE) f = KVB_FINISH_CANCELLED; /* nobody is left to cancel */
                break;
            }
            if (c->o.resume_ms == 0 || kvb_now_ns() - lost_at >= (uint64_t)c->o.resume_ms * 1000000u) {
                set_err(err, err_len, "the model server went away after %d of at most %d tokens%s", g.n_out,
                        r->max_tokens, c->o.resume_ms ? " and did not come back in time" : "");
                KVB_LOG_W("request %" PRIu64 ": %s", g.rid, err && err_len ? err : "server gone");
                st = KVB_ERR_UNAVAILABLE;
                goto out;
            }
            if (c->connected) {
                /* The server is back (kvbankd restarted it): continue the request on it. A copy of
                 * the old attempt may still sit in the socket's queue and reach the new process:
                 * cancel it there. */
                send_cancel(c, g.rid);
                uint64_t old = g.rid;
                if ((st = submit(c, &g, timeout_ms)) != KVB_OK) {
                    set_err(err, err_len, "could not resubmit the request: %s", kvb_status_str(st));
                    goto out;
                }
                c->stats.resumes++;
                KVB_LOG_I("request %" PRIu64 " resumed as %" PRIu64 " after %d token(s) on a new server connection",
                          old, g.rid, g.n_out);
                lost = 0;
                msg_deadline = deadline_after(timeout_ms);
                continue;
            }
        }
        /* deadline 1 (long past): only what is already there */
        uint64_t deadline = draining ? 1 : lost ? lost_at + (uint64_t)c->o.resume_ms * 1000000u : msg_deadline;
        Kvbank__Envelope *in = NULL;
        st = recv_env(c, deadline, &in);
        if (st == KVB_ERR_TIMEOUT) {
            if (draining) {
                draining = 0;
                lost = 1;
                lost_at = kvb_now_ns();
                KVB_LOG_W("request %" PRIu64 ": the connection to the model server was lost after %d token(s)%s",
                          g.rid, g.n_out, c->o.resume_ms ? "; waiting for it to come back" : "");
                continue;
            }
            /* woken by a connection event, or waiting for the server to come back */
            if (lost || c->stats.disconnects != lost_seen || !deadline || kvb_now_ns() < deadline) continue;
            set_err(err, err_len, "no reply from the server within %d ms%s", timeout_ms,
                    c->stats.connects ? "" : " (never connected: is it running?)");
            send_cancel(c, g.rid); /* the server need not generate for nobody */
            goto out;
        }
        if (st != KVB_OK) goto out;
        msg_deadline = deadline_after(timeout_ms);
        if (in->body_case == KVBANK__ENVELOPE__BODY_TOKENS && in->tokens->request_id == g.rid) {
            const Kvbank__TokenEvent *te = in->tokens;
            if ((uint64_t)te->first_index + (uint64_t)g.base != (uint64_t)g.n_out ||
                te->n_tokens > (size_t)(r->max_tokens - g.n_out)) {
                set_err(err, err_len, "token stream out of order: got %zu token(s) at index %" PRIu32 ", expected "
                        "index %d", te->n_tokens, te->first_index, g.n_out - g.base);
                KVB_LOG_E("request %" PRIu64 ": %s", g.rid, err && err_len ? err : "token stream out of order");
                kvbank__envelope__free_unpacked(in, NULL);
                send_cancel(c, g.rid);
                st = KVB_ERR_PROTOCOL;
                goto out;
            }
            for (size_t k = 0; k < te->n_tokens; k++) {
                g.seq[r->n_prompt + g.n_out] = te->tokens[k];
                int index = g.n_out++;
                if (g.cancelling || !on_token) continue;
                uint64_t t = k < te->n_t_ns ? te->t_ns[k] : 0;
                if (on_token(ud, index, te->tokens[k], t)) {
                    /* Stop delivering; the server answers with FINISH_CANCELLED (or the request
                     * finishes on its own first). */
                    g.cancelling = 1;
                    send_cancel(c, g.rid);
                }
            }
            f = finish_from_wire(te->finish);
            kvbank__envelope__free_unpacked(in, NULL);
            if (f == KVB_FINISH_NONE) continue;
            break;
        }
        if (in->body_case == KVBANK__ENVELOPE__BODY_ERROR &&
            (in->error->request_id == g.rid || in->error->request_id == 0)) {
            st = status_from_wire(in->error->code);
            set_err(err, err_len, "%s", in->error->message ? in->error->message : "");
            kvbank__envelope__free_unpacked(in, NULL);
            goto out;
        }
        /* Anything else is left over from an earlier call or attempt (a late event, a pong): skip it. */
        KVB_LOG_D("client: skipping a message of type %d", (int)in->body_case);
        kvbank__envelope__free_unpacked(in, NULL);
    }
    if (finish) *finish = f;
    st = KVB_OK;
    if (f == KVB_FINISH_ERROR) {
        set_err(err, err_len, "the server failed the request");
        st = KVB_ERR_BACKEND;
    }
out:
    free(g.seq);
    return st;
}

kvb_status kvb_client_ping(kvb_client *c, int timeout_ms, uint32_t *live) {
    if (!c) return KVB_ERR_INVALID;
    uint64_t nonce = ++c->last_nonce;
    Kvbank__Ping p = KVBANK__PING__INIT;
    p.nonce = nonce;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_PING;
    env.ping = &p;
    KVB_TRY(send_env(c, &env, timeout_ms));
    uint64_t deadline = deadline_after(timeout_ms);
    for (;;) {
        Kvbank__Envelope *in = NULL;
        kvb_status st = recv_env(c, deadline, &in);
        if (st == KVB_ERR_TIMEOUT && (!deadline || kvb_now_ns() < deadline)) continue; /* a connection event */
        if (st != KVB_OK) return st;
        if (in->body_case == KVBANK__ENVELOPE__BODY_PONG && in->pong->nonce == nonce) {
            if (live) *live = in->pong->live_requests;
            kvbank__envelope__free_unpacked(in, NULL);
            return KVB_OK;
        }
        if (in->body_case == KVBANK__ENVELOPE__BODY_ERROR && in->error->request_id == 0) {
            st = status_from_wire(in->error->code);
            KVB_LOG_W("server rejected a ping: %s", in->error->message ? in->error->message : "");
            kvbank__envelope__free_unpacked(in, NULL);
            return st;
        }
        kvbank__envelope__free_unpacked(in, NULL); /* a pong to an earlier ping, a late event */
    }
}
