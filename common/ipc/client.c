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

struct kvb_client {
    void *zctx;
    void *sock;          /* DEALER connected to the server */
    uint64_t last_id;    /* request_id of the last generate (ids start at 1; 0 is reserved) */
    uint64_t last_nonce; /* nonce of the last ping */
};

kvb_status kvb_client_connect(const char *endpoint, kvb_client **out) {
    if (!endpoint || !out) return KVB_ERR_INVALID;
    kvb_status st = KVB_OK;
    kvb_client *c = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *c, (void **)&c));
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

/* Receives the next valid envelope, waiting until `deadline_ns` (kvb_now_ns clock; 0: forever).
 * Malformed or multi-frame messages are logged and skipped. Caller frees *out. */
static kvb_status recv_env(kvb_client *c, uint64_t deadline_ns, Kvbank__Envelope **out) {
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
        if (rc == 0) return KVB_ERR_TIMEOUT;
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, c->sock, ZMQ_DONTWAIT) < 0) {
            int e = errno;
            zmq_msg_close(&m);
            if (e == EAGAIN || e == EINTR) continue;
            KVB_LOG_E("zmq_msg_recv: %s", zmq_strerror(e));
            return KVB_ERR_IO;
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

kvb_status kvb_client_generate(kvb_client *c, const kvb_request *r, kvb_client_token_fn on_token, void *ud,
                               int timeout_ms, kvb_finish *finish, char *err, size_t err_len) {
    if (finish) *finish = KVB_FINISH_NONE;
    set_err(err, err_len, "%s", "");
    if (!c || !r) return KVB_ERR_INVALID;
    if (r->n_prompt < 0 || r->n_stop < 0 || (r->n_prompt && !r->prompt) || (r->n_stop && !r->stop_ids) ||
        r->max_tokens < 0 || r->sampling.top_k < 0) {
        set_err(err, err_len, "malformed request (negative count or missing array)");
        return KVB_ERR_INVALID;
    }
    uint64_t rid = ++c->last_id;
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
    kvb_status st = send_env(c, &env, timeout_ms);
    if (st != KVB_OK) {
        set_err(err, err_len, "could not send the request: %s", kvb_status_str(st));
        return st;
    }

    uint32_t next_index = 0; /* index the next token must have */
    int cancelling = 0;
    for (;;) {
        Kvbank__Envelope *in = NULL;
        st = recv_env(c, deadline_after(timeout_ms), &in);
        if (st != KVB_OK) {
            if (st == KVB_ERR_TIMEOUT) {
                set_err(err, err_len, "no reply from the server within %d ms", timeout_ms);
                send_cancel(c, rid); /* the server need not generate for nobody */
            }
            return st;
        }
        if (in->body_case == KVBANK__ENVELOPE__BODY_TOKENS && in->tokens->request_id == rid) {
            const Kvbank__TokenEvent *te = in->tokens;
            if (te->first_index != next_index) {
                set_err(err, err_len, "token stream out of order: got index %" PRIu32 ", expected %" PRIu32,
                        te->first_index, next_index);
                KVB_LOG_E("request %" PRIu64 ": %s", rid, err && err_len ? err : "token stream out of order");
                kvbank__envelope__free_unpacked(in, NULL);
                send_cancel(c, rid);
                return KVB_ERR_PROTOCOL;
            }
            for (size_t k = 0; k < te->n_tokens; k++) {
                if (cancelling || !on_token) continue;
                uint64_t t = k < te->n_t_ns ? te->t_ns[k] : 0;
                if (on_token(ud, (int)(next_index + k), te->tokens[k], t)) {
                    /* Stop delivering; the server answers with FINISH_CANCELLED (or the request
                     * finishes on its own first). */
                    cancelling = 1;
                    send_cancel(c, rid);
                }
            }
            next_index += (uint32_t)te->n_tokens;
            kvb_finish f = finish_from_wire(te->finish);
            kvbank__envelope__free_unpacked(in, NULL);
            if (f == KVB_FINISH_NONE) continue;
            if (finish) *finish = f;
            if (f == KVB_FINISH_ERROR) {
                set_err(err, err_len, "the server failed the request");
                return KVB_ERR_BACKEND;
            }
            return KVB_OK;
        }
        if (in->body_case == KVBANK__ENVELOPE__BODY_ERROR &&
            (in->error->request_id == rid || in->error->request_id == 0)) {
            st = status_from_wire(in->error->code);
            set_err(err, err_len, "%s", in->error->message ? in->error->message : "");
            kvbank__envelope__free_unpacked(in, NULL);
            return st;
        }
        /* Anything else is left over from an earlier call (a late event, a pong): skip it. */
        KVB_LOG_D("client: skipping a message of type %d", (int)in->body_case);
        kvbank__envelope__free_unpacked(in, NULL);
    }
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
        KVB_TRY(recv_env(c, deadline, &in));
        if (in->body_case == KVBANK__ENVELOPE__BODY_PONG && in->pong->nonce == nonce) {
            if (live) *live = in->pong->live_requests;
            kvbank__envelope__free_unpacked(in, NULL);
            return KVB_OK;
        }
        if (in->body_case == KVBANK__ENVELOPE__BODY_ERROR && in->error->request_id == 0) {
            kvb_status st = status_from_wire(in->error->code);
            KVB_LOG_W("server rejected a ping: %s", in->error->message ? in->error->message : "");
            kvbank__envelope__free_unpacked(in, NULL);
            return st;
        }
        kvbank__envelope__free_unpacked(in, NULL); /* a pong to an earlier ping, a late event */
    }
}
