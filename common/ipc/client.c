/* kvbank — a client for a model server (one DEALER socket, many requests).
 *
 * Live requests sit in a chained hash table keyed by their id (a counter of this client, so ids never
 * repeat). On the wire a request is sent as attempt 0 with request_id = id, and each resumption after a
 * lost connection as the next attempt, request_id = id | attempt << ATTEMPT_SHIFT, so that events of an
 * earlier attempt (a copy that reached the new server, a late event) are told apart and dropped.
 * kvb_client_dispatch reads every waiting message and routes it: a TokenEvent or an ErrorReply to its
 * request's callback, a Pong to the pong callback; a message for an id that is not live (a late event
 * of an abandoned request) is dropped. A monitor socket reports completed handshakes and lost
 * connections; the requests a lost connection carried wait (resume_ms at most) for the next handshake
 * and are then resubmitted with the tokens they delivered. The blocking calls are the asynchronous ones
 * followed by a wait on both sockets. */
#include "common/ipc/client.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zmq.h>

#include "common/ipc/wire.h"

#define BUCKETS0 64          /* initial hash buckets (a power of two); doubled when there are more requests */
#define ATTEMPT_SHIFT 48     /* wire request_id = id | attempt << ATTEMPT_SHIFT */
#define ID_MASK ((UINT64_C(1) << ATTEMPT_SHIFT) - 1)
#define ATTEMPT_MAX 0xffff   /* resumptions of one request */
#define MONITOR_EP "inproc://kvb-client-monitor" /* one per client: each client has its own context */
#define RECONNECT_IVL_MS 100 /* ZeroMQ reconnect period, constant */

/* A request's grammar as the wire carries it, copied: a resumption sends it again. */
typedef struct req_grammar {
    Kvbank__Grammar g;
    Kvbank__GrammarPart *parts;   /* [g.n_parts] */
    Kvbank__GrammarPart **pp;     /* [g.n_parts] g.parts */
    ProtobufCBinaryData *choices; /* every part's choices, back to back */
    uint8_t *bytes;               /* every text and choice, back to back */
} req_grammar;

typedef struct live_req {
    uint64_t rid;          /* the id the caller knows */
    uint32_t attempt;      /* resumptions so far: the wire id is rid | attempt << ATTEMPT_SHIFT */
    kvb_client_event_fn fn;
    void *ud;
    uint32_t next_index;   /* output index the next token must have (across attempts) */
    uint32_t base;         /* output index of the current attempt's token 0 */
    /* what a resumption resubmits */
    int32_t *seq;          /* [cap_seq] the prompt, then the tokens delivered so far ([n_prompt + next_index]) */
    int n_prompt, cap_seq;
    int32_t *stop;         /* [n_stop] */
    int n_stop;
    int max_tokens;
    kvb_sampling sampling; /* sampling.logit_bias points to `bias` */
    kvb_logit_bias *bias;  /* [sampling.n_logit_bias] */
    Kvbank__LogitBias *bias_msgs;  /* [sampling.n_logit_bias] the same as wire messages */
    Kvbank__LogitBias **bias_ptrs; /* [sampling.n_logit_bias] pointing to them */
    uint32_t plp_next;     /* prompt logprobs: the next prompt position to deliver (earlier ones came) */
    double tbt_slo_ms;
    req_grammar *grammar;  /* structured output, or NULL */
    uint64_t conn;         /* the connection its current attempt goes out on (kvb_client.conn numbering) */
    int lost;              /* that connection is gone: waiting for the next one */
    uint64_t lost_ns;      /* since when (kvb_now_ns) */
    int cancelling;        /* kvb_client_cancel was called: a loss ends it (CANCELLED), no resumption */
    struct live_req *next; /* hash chain */
} live_req;

struct kvb_client {
    void *zctx;
    void *sock;              /* DEALER connected to the server */
    void *mon;               /* PAIR receiving the DEALER's connection events */
    int epfd;                /* epoll set of the two sockets' ZMQ_FDs (kvb_client_fd) */
    kvb_client_opts o;
    int connected;           /* a handshake completed and its connection has not been lost since */
    uint64_t conn;           /* connections completed so far; the current one is number `conn` */
    uint64_t lost_conn;      /* the number of the last connection lost */
    uint64_t last_id;        /* id of the last request (ids start at 1; 0 is reserved) */
    uint64_t last_nonce;     /* nonce of the last ping */
    live_req **buckets;      /* [n_buckets] */
    int n_buckets;
    int n_live;
    int n_lost;              /* live requests waiting for a server to come back */
    int in_dispatch;         /* dispatch is running (a callback's own dispatch call returns at once) */
    kvb_client_pong_fn pong_fn;
    void *pong_ud;
    /* the blocking ping waiting for its answer */
    uint64_t want_nonce;     /* 0: none */
    int got_pong;            /* 1: answered; < 0: rejected with ErrorReply code got_pong */
    uint32_t pong_live;
    kvb_client_stats stats;
};

void kvb_client_opts_default(kvb_client_opts *o) {
    if (!o) return;
    o->heartbeat_ms = 250;
    o->dead_ms = 1000;
    o->resume_ms = 30000;
}

/* Adds the ZMQ_FD of `sock` to the epoll set. */
static int watch_fd(int epfd, void *sock) {
    int fd = -1;
    size_t sz = sizeof fd;
    if (zmq_getsockopt(sock, ZMQ_FD, &fd, &sz) != 0) return -1;
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = fd};
    return epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev);
}

kvb_status kvb_client_connect(const char *endpoint, kvb_client **out) {
    return kvb_client_connect_opts(endpoint, NULL, out);
}

kvb_status kvb_client_connect_opts(const char *endpoint, const kvb_client_opts *o, kvb_client **out) {
    if (!endpoint || !out) return KVB_ERR_INVALID;
    kvb_client_opts d;
    kvb_client_opts_default(&d);
    if (o) d = *o;
    if (d.heartbeat_ms < 0 || d.dead_ms < 0 || d.resume_ms < 0 || (d.heartbeat_ms > 0 && d.dead_ms == 0) ||
        d.heartbeat_ms > 3600000 || d.dead_ms > 3600000)
        return KVB_ERR_INVALID;
    kvb_status st = KVB_OK;
    kvb_client *c = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *c, (void **)&c));
    c->epfd = -1;
    c->o = d;
    KVB_TRY_GOTO(kvb_calloc(BUCKETS0, sizeof *c->buckets, (void **)&c->buckets), fail);
    c->n_buckets = BUCKETS0;
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
    /* Connection events: a completed handshake, a lost connection (the requests on it are gone), and
     * the reconnect attempts while the server is away (they wake an event loop that waits on the fd). */
    if (zmq_socket_monitor(c->sock, MONITOR_EP, ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_DISCONNECTED |
                                                    ZMQ_EVENT_CONNECT_RETRIED) != 0 ||
        !(c->mon = zmq_socket(c->zctx, ZMQ_PAIR)) || zmq_setsockopt(c->mon, ZMQ_LINGER, &zero, sizeof zero) != 0 ||
        zmq_connect(c->mon, MONITOR_EP) != 0) {
        KVB_LOG_E("zmq_socket_monitor: %s", zmq_strerror(errno));
        st = KVB_ERR_IO;
        goto fail;
    }
    c->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (c->epfd < 0 || watch_fd(c->epfd, c->sock) != 0 || watch_fd(c->epfd, c->mon) != 0) {
        KVB_LOG_E("epoll: %s", strerror(errno));
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

static void set_err(char *err, size_t err_len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static void grammar_free(req_grammar *q) {
    if (!q) return;
    free(q->parts);
    free(q->pp);
    free(q->choices);
    free(q->bytes);
    free(q);
}

/* The wire form of r's grammar (r->n_grammar > 0). */
static kvb_status grammar_copy(const kvb_request *r, req_grammar **out, char *err, size_t err_len) {
    if (r->n_grammar > KVB_WIRE_MAX_GRAMMAR_PARTS || !r->grammar) {
        set_err(err, err_len, "a grammar has 1 to %d parts, not %d", KVB_WIRE_MAX_GRAMMAR_PARTS, r->n_grammar);
        return KVB_ERR_INVALID;
    }
    size_t bytes = 0, n_choices = 0;
    for (int k = 0; k < r->n_grammar; k++) {
        const kvb_grammar_part *p = &r->grammar[k];
        if (p->kind < KVB_GRAMMAR_LITERAL || p->kind > KVB_GRAMMAR_CHOICE || (p->len && !p->text) ||
            (p->kind == KVB_GRAMMAR_CHOICE && (p->n_choices < 1 || !p->choices))) {
            set_err(err, err_len, "grammar part %d is malformed", k);
            return KVB_ERR_INVALID;
        }
        bytes += p->len;
        for (int c = 0; p->kind == KVB_GRAMMAR_CHOICE && c < p->n_choices; c++) bytes += strlen(p->choices[c]);
        if (p->kind == KVB_GRAMMAR_CHOICE) n_choices += (size_t)p->n_choices;
    }
    static const Kvbank__GrammarPart__Kind kinds[] = {
        [KVB_GRAMMAR_LITERAL] = KVBANK__GRAMMAR_PART__KIND__LITERAL, [KVB_GRAMMAR_JSON] = KVBANK__GRAMMAR_PART__KIND__JSON,
        [KVB_GRAMMAR_JSON_OBJECT] = KVBANK__GRAMMAR_PART__KIND__JSON_OBJECT,
        [KVB_GRAMMAR_JSON_SCHEMA] = KVBANK__GRAMMAR_PART__KIND__JSON_SCHEMA,
        [KVB_GRAMMAR_REGEX] = KVBANK__GRAMMAR_PART__KIND__REGEX, [KVB_GRAMMAR_CHOICE] = KVBANK__GRAMMAR_PART__KIND__CHOICE};
    req_grammar *q = NULL;
    kvb_status st = kvb_calloc(1, sizeof *q, (void **)&q);
    if (st == KVB_OK) st = kvb_calloc((size_t)r->n_grammar, sizeof *q->parts, (void **)&q->parts);
    if (st == KVB_OK) st = kvb_calloc((size_t)r->n_grammar, sizeof *q->pp, (void **)&q->pp);
    if (st == KVB_OK) st = kvb_calloc(KVB_MAX(n_choices, 1), sizeof *q->choices, (void **)&q->choices);
    if (st == KVB_OK) st = kvb_malloc(KVB_MAX(bytes, 1), (void **)&q->bytes);
    if (st != KVB_OK) {
        grammar_free(q);
        set_err(err, err_len, "out of memory");
        return st;
    }
    kvbank__grammar__init(&q->g);
    q->g.n_parts = (size_t)r->n_grammar;
    q->g.parts = q->pp;
    q->g.lax = (r->grammar_flags & KVB_GRAMMAR_REQ_LAX) != 0;
    q->g.compact = (r->grammar_flags & KVB_GRAMMAR_REQ_COMPACT) != 0;
    uint8_t *b = q->bytes;
    ProtobufCBinaryData *ch = q->choices;
    for (int k = 0; k < r->n_grammar; k++) {
        const kvb_grammar_part *p = &r->grammar[k];
        Kvbank__GrammarPart *w = &q->parts[k];
        kvbank__grammar_part__init(w);
        q->pp[k] = w;
        w->kind = kinds[p->kind];
        w->text = (ProtobufCBinaryData){.len = p->len, .data = b};
        if (p->len) memcpy(b, p->text, p->len);
        b += p->len;
        if (p->kind != KVB_GRAMMAR_CHOICE) continue;
        w->n_choices = (size_t)p->n_choices;
        w->choices = ch;
        for (int c = 0; c < p->n_choices; c++) {
            size_t n = strlen(p->choices[c]);
            *ch++ = (ProtobufCBinaryData){.len = n, .data = b};
            if (n) memcpy(b, p->choices[c], n);
            b += n;
        }
    }
    *out = q;
    return KVB_OK;
}

static void req_free(live_req *e) {
    if (!e) return;
    grammar_free(e->grammar);
    free(e->seq);
    free(e->stop);
    free(e->bias);
    free(e->bias_msgs);
    free(e->bias_ptrs);
    free(e);
}

void kvb_client_destroy(kvb_client *c) {
    if (!c) return;
    if (c->epfd >= 0) close(c->epfd);
    if (c->sock && c->mon) zmq_socket_monitor(c->sock, NULL, 0);
    if (c->mon) zmq_close(c->mon);
    if (c->sock) zmq_close(c->sock);
    if (c->zctx) zmq_ctx_term(c->zctx);
    for (int b = 0; c->buckets && b < c->n_buckets; b++) {
        for (live_req *e = c->buckets[b]; e;) {
            live_req *nx = e->next;
            req_free(e);
            e = nx;
        }
    }
    free(c->buckets);
    free(c);
}

void kvb_client_get_stats(const kvb_client *c, kvb_client_stats *out) {
    if (!out) return;
    memset(out, 0, sizeof *out);
    if (c) *out = c->stats;
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
        if (e->lost) c->n_lost--;
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

static uint64_t wire_id(const live_req *e) { return e->rid | (uint64_t)e->attempt << ATTEMPT_SHIFT; }

/* The GenerateRequest of `e`'s current attempt: the prompt and the tokens delivered so far, for the
 * tokens still missing; `env` points into `g`, which points into `e`. */
static void build_request(const live_req *e, Kvbank__GenerateRequest *g, Kvbank__Envelope *env) {
    kvbank__generate_request__init(g);
    g->request_id = wire_id(e);
    g->n_prompt_ids = (size_t)e->n_prompt + e->next_index;
    g->prompt_ids = e->seq;
    g->n_stop_ids = (size_t)e->n_stop;
    g->stop_ids = e->stop;
    g->max_tokens = (uint32_t)e->max_tokens - e->next_index;
    g->temperature = e->sampling.temperature;
    g->top_k = (uint32_t)e->sampling.top_k;
    g->top_p = e->sampling.top_p;
    g->seed = e->sampling.seed;
    g->resume_index = e->next_index;
    g->tbt_slo_ms = (float)e->tbt_slo_ms;
    g->grammar = e->grammar ? &e->grammar->g : NULL;
    const kvb_sampling *sp = &e->sampling;
    g->min_p = sp->min_p;
    g->presence_penalty = sp->presence_penalty;
    g->frequency_penalty = sp->frequency_penalty;
    g->repetition_penalty = sp->repetition_penalty;
    g->min_tokens = (uint32_t)sp->min_tokens;
    g->n_logit_bias = (size_t)sp->n_logit_bias;
    g->logit_bias = e->bias_ptrs;
    g->logprobs = sp->logprobs;
    g->top_logprobs = (uint32_t)sp->top_logprobs;
    /* a resumption asks again only for prompt positions not delivered yet */
    g->prompt_logprobs = sp->prompt_logprobs && e->plp_next < (uint32_t)e->n_prompt;
    kvbank__envelope__init(env);
    env->body_case = KVBANK__ENVELOPE__BODY_GENERATE;
    env->generate = g;
    env->version = KVB_PROTO_VERSION;
}

/* The connection a message sent now goes out on: the current one, or the next when none is up (the
 * message waits in the socket's queue for it). */
static uint64_t send_conn(const kvb_client *c) { return c->connected ? c->conn : c->conn + 1; }

kvb_status kvb_client_submit(kvb_client *c, const kvb_request *r, kvb_client_event_fn fn, void *ud, int timeout_ms,
                             uint64_t *rid_out, char *err, size_t err_len) {
    set_err(err, err_len, "%s", "");
    if (!c || !r || !fn) return KVB_ERR_INVALID;
    if (r->n_prompt < 0 || r->n_stop < 0 || (r->n_prompt && !r->prompt) || (r->n_stop && !r->stop_ids) ||
        r->max_tokens < 0 || r->sampling.top_k < 0) {
        set_err(err, err_len, "malformed request (negative count or missing array)");
        return KVB_ERR_INVALID;
    }
    if (c->last_id + 1 > ID_MASK) {
        set_err(err, err_len, "request ids of this client are used up");
        return KVB_ERR_EXHAUSTED;
    }
    live_req *e = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *e, (void **)&e));
    e->rid = c->last_id + 1;
    e->fn = fn;
    e->ud = ud;
    e->n_prompt = r->n_prompt;
    e->n_stop = r->n_stop;
    e->max_tokens = r->max_tokens;
    e->sampling = r->sampling;
    e->tbt_slo_ms = r->tbt_slo_ms;
    e->plp_next = 1;
    /* The copies a resumption needs; the delivered tokens are appended as they arrive. */
    e->cap_seq = r->n_prompt + KVB_MIN(r->max_tokens, 64);
    kvb_status st = kvb_malloc((size_t)KVB_MAX(e->cap_seq, 1) * sizeof *e->seq, (void **)&e->seq);
    if (st == KVB_OK && r->n_stop) st = kvb_malloc((size_t)r->n_stop * sizeof *e->stop, (void **)&e->stop);
    size_t nb = r->sampling.n_logit_bias > 0 && r->sampling.logit_bias ? (size_t)r->sampling.n_logit_bias : 0;
    if (st == KVB_OK && nb && (st = kvb_malloc(nb * sizeof *e->bias, (void **)&e->bias)) == KVB_OK &&
        (st = kvb_calloc(nb, sizeof *e->bias_msgs, (void **)&e->bias_msgs)) == KVB_OK)
        st = kvb_calloc(nb, sizeof *e->bias_ptrs, (void **)&e->bias_ptrs);
    if (st != KVB_OK) {
        req_free(e);
        set_err(err, err_len, "out of memory");
        return st;
    }
    if (st == KVB_OK && r->n_grammar > 0 && (st = grammar_copy(r, &e->grammar, err, err_len)) != KVB_OK) {
        req_free(e);
        return st;
    }
    if (r->n_prompt) memcpy(e->seq, r->prompt, (size_t)r->n_prompt * sizeof *e->seq);
    if (r->n_stop) memcpy(e->stop, r->stop_ids, (size_t)r->n_stop * sizeof *e->stop);
    for (size_t k = 0; k < nb; k++) {
        e->bias[k] = r->sampling.logit_bias[k];
        kvbank__logit_bias__init(&e->bias_msgs[k]);
        e->bias_msgs[k].id = e->bias[k].id;
        e->bias_msgs[k].bias = e->bias[k].bias;
        e->bias_ptrs[k] = &e->bias_msgs[k];
    }
    e->sampling.logit_bias = e->bias;
    e->sampling.n_logit_bias = (int)nb;
    Kvbank__GenerateRequest g;
    Kvbank__Envelope env;
    build_request(e, &g, &env);
    size_t bytes = kvbank__envelope__get_packed_size(&env);
    if (bytes > KVB_WIRE_MAX_FRAME) {
        set_err(err, err_len, "the request (%d prompt tokens) needs %zu bytes on the wire, above the %u-byte limit",
                r->n_prompt, bytes, KVB_WIRE_MAX_FRAME);
        req_free(e);
        return KVB_ERR_INVALID;
    }
    e->conn = send_conn(c);
    st = send_env(c, &env, timeout_ms);
    if (st != KVB_OK) {
        req_free(e);
        set_err(err, err_len, "could not send the request: %s", kvb_status_str(st));
        return st;
    }
    c->last_id = e->rid;
    live_req **h = &c->buckets[e->rid & (uint64_t)(c->n_buckets - 1)];
    e->next = *h;
    *h = e;
    c->n_live++;
    req_grow(c);
    if (rid_out) *rid_out = e->rid;
    return KVB_OK;
}

kvb_status kvb_client_cancel(kvb_client *c, uint64_t rid) {
    if (!c) return KVB_ERR_INVALID;
    live_req *e = req_find(c, rid);
    if (!e) return KVB_ERR_NOT_FOUND;
    e->cancelling = 1;
    if (!e->lost) send_cancel(c, wire_id(e));
    return KVB_OK;
}

kvb_status kvb_client_abandon(kvb_client *c, uint64_t rid) {
    if (!c) return KVB_ERR_INVALID;
    live_req *e = req_take(c, rid);
    if (!e) return KVB_ERR_NOT_FOUND;
    if (!e->lost) send_cancel(c, wire_id(e));
    req_free(e);
    return KVB_OK;
}

int kvb_client_n_live(const kvb_client *c) { return c ? c->n_live : 0; }

int kvb_client_fd(const kvb_client *c) { return c ? c->epfd : -1; }

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
    e->fn(e->ud, e->rid, NULL, NULL, 0, (int)e->next_index, f, st, err ? err : "", NULL);
    req_free(e);
}

/* The logprobs of TokenEvent `te` for `e` into *out (pointers into te): checked for shape, prompt
 * positions already delivered (by an earlier attempt) left out. KVB_ERR_PROTOCOL when malformed. */
static kvb_status event_logprobs(live_req *e, const Kvbank__TokenEvent *te, kvb_client_logprobs *out) {
    memset(out, 0, sizeof *out);
    size_t t = te->top_n, n = te->n_tokens, np = te->n_prompt_logprobs;
    if (t > KVB_MAX_TOP_LOGPROBS) return KVB_ERR_PROTOCOL;
    if (te->n_logprobs) {
        if (te->n_logprobs != n || te->n_top_ids != n * t || te->n_top_logprobs != n * t) return KVB_ERR_PROTOCOL;
        *out = (kvb_client_logprobs){.lp = te->logprobs, .top_ids = te->top_ids, .top_lp = te->top_logprobs,
                                     .top_n = (int)t};
    }
    if (!np) return KVB_OK;
    if (te->n_prompt_top_ids != np * t || te->n_prompt_top_logprobs != np * t || te->prompt_first < 1 ||
        np > (size_t)e->n_prompt || te->prompt_first + np > (size_t)e->n_prompt)
        return KVB_ERR_PROTOCOL;
    /* positions delivered before a resumption are left out */
    size_t skip = te->prompt_first < e->plp_next ? e->plp_next - te->prompt_first : 0;
    if (skip >= np) return KVB_OK;
    out->top_n = (int)t;
    out->prompt_first = (int)(te->prompt_first + skip);
    out->n_prompt = (int)(np - skip);
    out->prompt_lp = te->prompt_logprobs + skip;
    out->prompt_top_ids = te->prompt_top_ids + skip * t;
    out->prompt_top_lp = te->prompt_top_logprobs + skip * t;
    e->plp_next = te->prompt_first + (uint32_t)np;
    return KVB_OK;
}

/* The live request an event with wire id `wid` is about, or NULL (not live, or an earlier attempt). */
static live_req *req_of_wire(kvb_client *c, uint64_t wid) {
    live_req *e = req_find(c, wid & ID_MASK);
    return e && wire_id(e) == wid ? e : NULL;
}

/* Appends delivered tokens to e->seq (for a resumption). KVB_ERR_NOMEM leaves it unchanged. */
static kvb_status keep_tokens(live_req *e, const int32_t *tok, size_t n) {
    size_t need = (size_t)e->n_prompt + e->next_index + n;
    if (need > (size_t)e->cap_seq) {
        size_t cap = KVB_MAX(need, 2 * (size_t)e->cap_seq);
        if (cap > (size_t)e->n_prompt + (size_t)e->max_tokens) cap = (size_t)e->n_prompt + (size_t)e->max_tokens;
        if (cap < need || cap > INT_MAX) return KVB_ERR_INVALID;
        KVB_TRY(kvb_realloc_array((void **)&e->seq, cap, sizeof *e->seq));
        e->cap_seq = (int)cap;
    }
    if (n) memcpy(e->seq + e->n_prompt + e->next_index, tok, n * sizeof *tok); /* tok is NULL when n is 0 */
    return KVB_OK;
}

static void on_tokens(kvb_client *c, const Kvbank__TokenEvent *te) {
    live_req *e = req_of_wire(c, te->request_id);
    if (!e) {
        KVB_LOG_D("client: event of request %" PRIu64 " that is not live (dropped)", te->request_id);
        return;
    }
    uint64_t at = (uint64_t)e->base + te->first_index;
    if (at != e->next_index || te->n_t_ns != te->n_tokens || te->n_tokens > (size_t)e->max_tokens - e->next_index ||
        keep_tokens(e, te->tokens, te->n_tokens) != KVB_OK) {
        char msg[160];
        snprintf(msg, sizeof msg, "token stream out of order: got index %" PRIu64 " (%zu tokens, %zu times), expected %" PRIu32,
                 at, te->n_tokens, te->n_t_ns, e->next_index);
        KVB_LOG_E("request %" PRIu64 ": %s", e->rid, msg);
        send_cancel(c, wire_id(e));
        finish_req(req_take(c, e->rid), KVB_FINISH_ERROR, KVB_ERR_PROTOCOL, msg);
        return;
    }
    kvb_client_logprobs lp;
    const kvb_client_logprobs *lpp = NULL;
    if (event_logprobs(e, te, &lp) != KVB_OK) {
        char msg[160];
        snprintf(msg, sizeof msg, "malformed logprobs: %zu for %zu tokens, %zu prompt positions, top %" PRIu32,
                 te->n_logprobs, te->n_tokens, te->n_prompt_logprobs, te->top_n);
        KVB_LOG_E("request %" PRIu64 ": %s", e->rid, msg);
        send_cancel(c, wire_id(e));
        finish_req(req_take(c, e->rid), KVB_FINISH_ERROR, KVB_ERR_PROTOCOL, msg);
        return;
    }
    if (lp.lp || lp.n_prompt) lpp = &lp;
    kvb_finish f = finish_from_wire(te->finish);
    uint64_t rid = e->rid;
    e->next_index += (uint32_t)te->n_tokens;
    if (f == KVB_FINISH_NONE) {
        /* `e` may be abandoned (freed) inside the callback: it is not touched afterwards. */
        if (te->n_tokens || lp.n_prompt)
            e->fn(e->ud, rid, te->tokens, te->t_ns, (int)te->n_tokens, (int)at, f, KVB_OK, "", lpp);
        return;
    }
    req_take(c, rid);
    kvb_status st = f != KVB_FINISH_ERROR ? KVB_OK : te->error_code < 0 ? status_from_wire(te->error_code) : KVB_ERR_BACKEND;
    char why[160] = "";
    if (f == KVB_FINISH_ERROR)
        snprintf(why, sizeof why, "the model failed the request%s%.100s", te->error && te->error[0] ? ": " : "",
                 te->error ? te->error : "");
    e->fn(e->ud, rid, te->tokens, te->t_ns, (int)te->n_tokens, (int)at, f, st, why, lpp);
    req_free(e);
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
                if (c->buckets[b]) rid = wire_id(c->buckets[b]);
        } else {
            KVB_LOG_W("server error about no request: %s", msg);
            return;
        }
    }
    live_req *e = req_of_wire(c, rid);
    if (e) e = req_take(c, e->rid);
    if (!e) {
        KVB_LOG_D("client: error for request %" PRIu64 " that is not live: %s", rid, msg);
        return;
    }
    finish_req(e, KVB_FINISH_ERROR, st, msg);
}

static void on_pong(kvb_client *c, const Kvbank__Pong *p, int32_t peer_pid) {
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
        .peer_pid = peer_pid,
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
    /* who sent it: the kernel's credentials of the connection it came on (ipc://) */
    int32_t peer_pid = -1;
    int fd = zmq_msg_get(&m, ZMQ_SRCFD);
    struct ucred cred;
    socklen_t cl = sizeof cred;
    if (fd >= 0 && getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) == 0 && cred.pid > 0) peer_pid = cred.pid;
    Kvbank__Envelope *env = NULL;
    kvb_status st = kvb_wire_unpack(zmq_msg_data(&m), zmq_msg_size(&m), &env, NULL, 0);
    zmq_msg_close(&m);
    if (st != KVB_OK) return 1; /* logged by kvb_wire_unpack */
    switch (env->body_case) {
    case KVBANK__ENVELOPE__BODY_TOKENS: on_tokens(c, env->tokens); break;
    case KVBANK__ENVELOPE__BODY_ERROR: on_error(c, env->error); break;
    case KVBANK__ENVELOPE__BODY_PONG: on_pong(c, env->pong, peer_pid); break;
    default: KVB_LOG_D("client: skipping a message of type %d", (int)env->body_case); break;
    }
    kvbank__envelope__free_unpacked(env, NULL);
    return 1;
}

/* ------------------------------------------------------------------------------------ connections */

/* Reads the connection events queued on the monitor socket (never blocks). Returns 1 when a
 * connection was lost. */
static int pump_monitor(kvb_client *c) {
    int lost = 0;
    uint16_t ev;
    while (kvb_wire_monitor_event(c->mon, &ev)) {
        if (ev == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
            c->connected = 1;
            c->conn++;
            c->stats.connects++;
        } else if (ev == ZMQ_EVENT_DISCONNECTED && c->connected) {
            /* A connection that never completed its handshake carried nothing: not a loss. */
            c->connected = 0;
            c->lost_conn = c->conn;
            c->stats.disconnects++;
            lost = 1;
        }
    }
    return lost;
}

/* The finish of a request whose server went away after it had delivered all it could (max_tokens, or a
 * stop token last: the finish was lost with the server), else NONE. */
static kvb_finish finish_by_tokens(const live_req *e) {
    if (e->next_index >= (uint32_t)e->max_tokens) return KVB_FINISH_LENGTH;
    if (e->next_index > 0) {
        int32_t last = e->seq[e->n_prompt + e->next_index - 1];
        for (int k = 0; k < e->n_stop; k++)
            if (e->stop[k] == last) return KVB_FINISH_STOP;
    }
    return KVB_FINISH_NONE;
}

/* Every live request whose attempt went out on a connection up to `gone` is lost. */
static void mark_lost(kvb_client *c, uint64_t gone) {
    uint64_t now = kvb_now_ns();
    for (int b = 0; b < c->n_buckets; b++) {
        for (live_req *e = c->buckets[b]; e; e = e->next) {
            if (e->lost || e->conn > gone) continue;
            e->lost = 1;
            e->lost_ns = now;
            c->n_lost++;
            KVB_LOG_W("request %" PRIu64 ": the connection to the model server was lost after %" PRIu32 " token(s)%s",
                      e->rid, e->next_index, c->o.resume_ms && !e->cancelling ? "; waiting for it to come back" : "");
        }
    }
}

/* Ends, resubmits or leaves waiting every lost request. Callbacks run here (they may submit, cancel or
 * abandon: the table is walked again from the start after each). */
static void handle_lost(kvb_client *c) {
    uint64_t now = kvb_now_ns();
    int again = 1;
    while (again && c->n_lost > 0) {
        again = 0;
        for (int b = 0; b < c->n_buckets && !again; b++) {
            for (live_req *e = c->buckets[b]; e && !again; e = e->next) {
                if (!e->lost) continue;
                kvb_finish f = finish_by_tokens(e);
                if (f != KVB_FINISH_NONE || e->cancelling) {
                    /* Nothing is missing, or nothing is wanted any more. */
                    finish_req(req_take(c, e->rid), f != KVB_FINISH_NONE ? f : KVB_FINISH_CANCELLED, KVB_OK, "");
                    again = 1;
                } else if (c->o.resume_ms == 0 || now - e->lost_ns >= (uint64_t)c->o.resume_ms * 1000000u ||
                           e->attempt == ATTEMPT_MAX) {
                    char msg[160];
                    snprintf(msg, sizeof msg, "the model server went away after %" PRIu32 " of at most %d tokens%s",
                             e->next_index, e->max_tokens, c->o.resume_ms ? " and did not come back in time" : "");
                    KVB_LOG_W("request %" PRIu64 ": %s", e->rid, msg);
                    finish_req(req_take(c, e->rid), KVB_FINISH_ERROR, KVB_ERR_UNAVAILABLE, msg);
                    again = 1;
                } else if (c->connected) {
                    /* A server is back (kvbankd restarted it): continue on it. A copy of the old attempt
                     * may still sit in the socket's queue and reach the new process: cancel it there. */
                    send_cancel(c, wire_id(e));
                    e->attempt++;
                    e->base = e->next_index;
                    Kvbank__GenerateRequest g;
                    Kvbank__Envelope env;
                    build_request(e, &g, &env);
                    e->conn = c->conn;
                    if (kvb_wire_send(c->sock, NULL, 0, &env, 1) != KVB_OK) {
                        /* queue full, or the connection went again: the next loss or handshake retries */
                        e->attempt--;
                        continue;
                    }
                    e->lost = 0;
                    c->n_lost--;
                    c->stats.resumes++;
                    KVB_LOG_I("request %" PRIu64 " resumed after %" PRIu32 " token(s) on a new server connection",
                              e->rid, e->next_index);
                }
            }
        }
    }
}

kvb_status kvb_client_dispatch(kvb_client *c) {
    if (!c) return KVB_ERR_INVALID;
    if (c->in_dispatch) return KVB_OK;
    c->in_dispatch = 1;
    int rc;
    for (;;) {
        while ((rc = recv_one(c)) > 0) {
        }
        if (rc < 0) break;
        if (!pump_monitor(c)) break;
        /* A connection was lost. What it delivered before it went is in the socket already: read it
         * first (it may hold a finish), then count the requests it carried as lost. */
        while ((rc = recv_one(c)) > 0) {
        }
        if (rc < 0) break;
        mark_lost(c, c->lost_conn);
    }
    if (rc >= 0 && c->n_lost) handle_lost(c);
    c->in_dispatch = 0;
    return rc < 0 ? KVB_ERR_IO : KVB_OK;
}

int kvb_client_timeout_ms(const kvb_client *c) {
    if (!c || !c->n_lost || c->o.resume_ms == 0) return c && c->n_lost ? 0 : -1;
    uint64_t now = kvb_now_ns(), first = UINT64_MAX;
    for (int b = 0; b < c->n_buckets; b++)
        for (const live_req *e = c->buckets[b]; e; e = e->next)
            if (e->lost && e->lost_ns < first) first = e->lost_ns;
    uint64_t end = first + (uint64_t)c->o.resume_ms * 1000000u;
    return end <= now ? 0 : (int)KVB_MIN((end - now + 999999) / 1000000, (uint64_t)INT_MAX);
}

/* Waits until a message or a connection event may be readable or `deadline_ns` (kvb_now_ns clock; 0:
 * forever) passes. */
static kvb_status wait_readable(kvb_client *c, uint64_t deadline_ns) {
    for (;;) {
        long wait_ms = -1;
        if (deadline_ns) {
            uint64_t now = kvb_now_ns();
            wait_ms = now >= deadline_ns ? 0 : (long)((deadline_ns - now + 999999) / 1000000);
        }
        zmq_pollitem_t it[2] = {{.socket = c->sock, .events = ZMQ_POLLIN}, {.socket = c->mon, .events = ZMQ_POLLIN}};
        int rc = zmq_poll(it, 2, wait_ms);
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
    uint64_t n_events; /* callbacks so far */
    int done;
    kvb_finish finish;
    kvb_status st;
    char *err;
    size_t err_len;
} gen_wait;

static void gen_event(void *ud, uint64_t rid, const int32_t *tokens, const uint64_t *t_ns, int n, int first_index,
                      kvb_finish finish, kvb_status st, const char *err, const kvb_client_logprobs *lp) {
    gen_wait *g = ud;
    (void)lp;
    g->n_events++;
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
    uint64_t msg_deadline = deadline_after(timeout_ms);
    uint64_t seen = g.n_events;
    for (;;) {
        kvb_status st = kvb_client_dispatch(c);
        if (st != KVB_OK) {
            kvb_client_abandon(c, rid);
            return st;
        }
        if (g.done) break;
        const live_req *e = req_find(c, rid);
        if (g.n_events != seen || (e && e->lost)) {
            /* Each message restarts the bound; while the server is away the resume window rules. */
            seen = g.n_events;
            msg_deadline = deadline_after(timeout_ms);
        }
        uint64_t deadline = msg_deadline;
        int wait_ms = kvb_client_timeout_ms(c);
        if (e && e->lost && wait_ms >= 0) deadline = kvb_now_ns() + (uint64_t)wait_ms * 1000000u + 1;
        st = wait_readable(c, deadline);
        if (e && e->lost) {
            if (st == KVB_ERR_TIMEOUT) continue; /* dispatch ends the request */
        } else if (st == KVB_OK && msg_deadline && kvb_now_ns() >= msg_deadline) {
            st = KVB_ERR_TIMEOUT; /* only connection events (reconnect attempts) came */
        }
        if (st != KVB_OK) {
            if (st == KVB_ERR_TIMEOUT)
                set_err(err, err_len, "no reply from the server within %d ms%s", timeout_ms,
                        c->stats.connects ? "" : " (never connected: is it running?)");
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
        if (st == KVB_OK && deadline && kvb_now_ns() >= deadline) st = KVB_ERR_TIMEOUT;
        if (st != KVB_OK) break;
    }
    c->want_nonce = 0;
    if (st != KVB_OK) return st;
    if (c->got_pong < 0) return (kvb_status)c->got_pong;
    if (live) *live = c->pong_live;
    return KVB_OK;
}
