/* kvbank — the model side of the coordinator protocol: registration, heartbeats, dispatch.
 *
 * States: unregistered (a Register goes out now and then, every other outgoing message is refused
 * here because the coordinator would drop it) and registered (a Heartbeat every heartbeat_ms). A
 * registered client falls back to unregistered when a HeartbeatReply says known = false, when a reply
 * names another coordinator instance, or when nothing has answered for RECONNECT_PERIODS heartbeat
 * periods (then it also replaces its socket: the route of its name may belong to another connection).
 * The socket is a DEALER with ZMQ_IMMEDIATE: while the coordinator is gone a send fails at once instead
 * of queueing, so a restarted coordinator never receives a backlog of stale messages. It logs in with
 * PLAIN (the model's name and token, common/ipc/auth.h).
 *
 * Keepalive. Heartbeats normally go out from the owner's loop, between engine steps. One step can
 * take longer than the coordinator's silence limit (a long prefill on a loaded CPU), and a master
 * declared dead while it still reads borrowed blocks would see them handed back to their lenders. So
 * the owner hands the socket to a small keepalive thread for the duration of each step
 * (kvb_node_client_busy_begin/end); the thread only sends Heartbeats with the numbers of the step's
 * start, never reads, and never touches the engine. The socket is used by one thread at a time: the
 * hand-over goes through a mutex, the full memory barrier ZeroMQ asks for when a socket changes
 * threads. */
#include "common/ipc/node_client.h"

#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "common/ipc/auth.h"
#include "common/ipc/wire.h"

#define COORD_ID_MAX 128          /* longest coordinator instance id kept (longer ones are cut) */
#define REGISTER_RETRY_MIN_MS 250 /* Register resend period while unanswered */
#define REFUSED_RETRY_MS 1000     /* after a refused Register */
#define HEARTBEAT_MIN_MS 10       /* bounds on the period a coordinator may ask for */
#define HEARTBEAT_MAX_MS 60000
#define RECONNECT_IVL_MS 50       /* ZeroMQ reconnect period, constant (no backoff): a restarted
                                   * coordinator waits only so long for the other side of a loan
                                   * (for a lender: the silence limit) */
#define UNREACHABLE_RETRY_MS 50   /* Register resend period while no connection exists */
#define RECV_MAX_BYTES ((int64_t)KVB_WIRE_MAX_FRAME + 4096) /* larger frames are cut by libzmq */
#define RECONNECT_PERIODS 2       /* no answer for this many heartbeat periods: a new socket */
#define RECONNECT_MIN_MS 500      /* ... but never sooner than this */
#define KEY_RETRY_MS 1000         /* key file not there yet (or refused): read it again this often */

struct kvb_node_client {
    void *zctx;
    void *sock;                       /* DEALER, routing id = id.name, PLAIN user id.name */
    char *coord_ep;                   /* the coordinator's endpoint */
    char token[KVB_AUTH_TOKEN_LEN + 1]; /* the password of the socket ("" while unknown) */
    int token_fixed;                  /* given at creation; else from the key file */
    uint64_t next_key_ns;             /* key file: when to read it again while not connected */
    uint64_t reconnects;              /* new sockets after silence */
    kvb_node_identity id;             /* its strings point to the copies below */
    char *name, *region, *endpoint, *model, *memory; /* owned copies */
    kvb_node_callbacks cb;
    int heartbeat_ms;                 /* current period */
    int registered;
    char coord_id[COORD_ID_MAX];      /* instance that last registered us; "" before the first */
    uint64_t epoch;
    uint32_t meu_worker, meu_master;  /* 0: unknown */
    int room_limited;                 /* the coordinator's last reply: the master attaches at most */
    uint32_t lend_room;               /* lend_room more of this worker's blocks (issue 10) */
    uint64_t next_register_ns;        /* unregistered: when the next Register goes out */
    uint64_t next_heartbeat_ns;       /* registered: when the next Heartbeat goes out */
    uint64_t waiting_since_ns;        /* first request still without any reply since (0: none) */
    int forgotten;                    /* the coordinator said it does not know us: it dropped what we
                                       * sent it before, even if its instance id is the same */
    char last_refusal[256];           /* reason of the last refused Register (logged once) */
    uint64_t dropped;                 /* messages that failed validation */

    /* keepalive thread; every ka_ field below ka_cv is guarded by ka_mu */
    pthread_t ka_thread;
    int ka_started;                   /* the thread runs */
    int ka_init;                      /* ka_mu and ka_cv exist */
    pthread_mutex_t ka_mu;
    pthread_cond_t ka_cv;             /* signalled when ka_sending drops or ka_quit is set */
    int ka_busy;                      /* the owner is in a step: the thread may use the socket */
    int ka_sending;                   /* the thread is using the socket now */
    int ka_quit;
    kvb_node_load ka_load;            /* the numbers at the start of the step */
    uint64_t ka_last_hb_ns;           /* last Heartbeat sent, by either thread */
    int ka_period_ms;                 /* heartbeat period at the start of the step */
    int ka_registered;
    uint64_t ka_sent;                 /* Heartbeats the thread sent */
};

/* ---------------------------------------------------------------------------------------- helpers */

static int period_ms(const kvb_node_client *nc) { return nc->heartbeat_ms; }

static uint64_t ms_ns(int ms) { return (uint64_t)(ms > 0 ? ms : 0) * 1000000u; }

static int register_retry_ms(const kvb_node_client *nc) {
    int r = period_ms(nc);
    return r < REGISTER_RETRY_MIN_MS ? REGISTER_RETRY_MIN_MS : r;
}

static Kvbank__Role role_to_wire(kvb_role r) {
    switch (r) {
    case KVB_ROLE_MASTER: return KVBANK__ROLE__ROLE_MASTER;
    case KVB_ROLE_WORKER: return KVBANK__ROLE__ROLE_WORKER;
    default: return KVBANK__ROLE__ROLE_NONE;
    }
}

/* A string field of a received message: protobuf-c gives "" for an absent one, never NULL, but a
 * hand-made message may. */
static const char *str_or_empty(const char *s) { return s ? s : ""; }

static kvb_status send_env(kvb_node_client *nc, Kvbank__Envelope *env) {
    kvb_status st = kvb_wire_send(nc->sock, NULL, 0, env, 1);
    if (st == KVB_ERR_IO) KVB_LOG_D("coordinator: cannot send message type %d now: %s", (int)env->body_case, strerror(errno));
    return st;
}

static void mark_waiting(kvb_node_client *nc) {
    if (!nc->waiting_since_ns) nc->waiting_since_ns = kvb_now_ns();
}

static int load_token(kvb_node_client *nc);
static kvb_status open_socket(kvb_node_client *nc);

/* ------------------------------------------------------------------------------- register, heartbeat */

static void send_register(kvb_node_client *nc) {
    kvb_node_load ld = {0};
    nc->cb.load(nc->cb.ud, &ld);
    const kvb_node_loan *loans = NULL;
    int n_loans = nc->cb.loans ? nc->cb.loans(nc->cb.ud, &loans) : 0;
    if (n_loans < 0 || (n_loans && !loans)) n_loans = 0;

    Kvbank__KvGeometry g = KVBANK__KV_GEOMETRY__INIT;
    g.n_layers = (uint32_t)nc->id.geom.n_layers;
    g.n_kv_heads = (uint32_t)nc->id.geom.n_kv_heads;
    g.head_dim = (uint32_t)nc->id.geom.head_dim;
    g.block_size = (uint32_t)nc->id.geom.block_size;
    g.elem_size = (uint32_t)nc->id.geom.elem_size;

    Kvbank__Loan *lw = NULL;
    Kvbank__Loan **lp = NULL;
    if (n_loans > 0 && (kvb_calloc((size_t)n_loans, sizeof *lw, (void **)&lw) != KVB_OK ||
                        kvb_calloc((size_t)n_loans, sizeof *lp, (void **)&lp) != KVB_OK)) {
        free(lw);
        nc->next_register_ns = kvb_now_ns() + ms_ns(register_retry_ms(nc)); /* try again later */
        return;
    }
    for (int i = 0; i < n_loans; i++) {
        kvbank__loan__init(&lw[i]);
        lw[i].loan_id = loans[i].loan_id;
        lw[i].lender = (char *)str_or_empty(loans[i].lender);
        lw[i].first_block = loans[i].first_block;
        lw[i].n_blocks = loans[i].n_blocks;
        lw[i].n_master_blocks = loans[i].n_master_blocks;
        lw[i].offset = loans[i].offset;
        lw[i].bytes = loans[i].bytes;
        lw[i].epoch = loans[i].epoch;
        lp[i] = &lw[i];
    }
    Kvbank__Register r = KVBANK__REGISTER__INIT;
    r.name = nc->name;
    r.role = role_to_wire(nc->id.role);
    r.pid = (uint32_t)getpid();
    r.geom = &g;
    r.region = nc->region;
    r.region_bytes = nc->id.region_bytes;
    r.capacity = nc->id.capacity;
    r.n_own = ld.n_own;
    r.endpoint = nc->endpoint;
    r.n_loans = (size_t)n_loans;
    r.loans = lp;
    r.model = nc->model;
    r.memory = nc->memory;
    r.device = nc->id.device;
    r.stream = nc->id.stream != 0;
    r.borrow_limited = nc->id.role == KVB_ROLE_MASTER && nc->id.borrow_limited;
    r.max_borrow = r.borrow_limited ? nc->id.max_borrow : 0;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_REGISTER;
    env.register_ = &r;
    int sent = send_env(nc, &env) == KVB_OK;
    if (sent) {
        mark_waiting(nc);
        KVB_LOG_D("coordinator: Register sent (%d loan(s), %u own blocks)", n_loans, ld.n_own);
    }
    free(lp);
    free(lw);
    /* Not connected (ZMQ_IMMEDIATE): try again soon, the coordinator is registering everyone now. A
     * model of a node run by hand may have come before the coordinator's key file (or read an old
     * one): read it again now and then. */
    uint64_t now = kvb_now_ns();
    if (!sent && !nc->token_fixed && now >= nc->next_key_ns) {
        nc->next_key_ns = now + ms_ns(KEY_RETRY_MS);
        if (load_token(nc) && open_socket(nc) != KVB_OK) KVB_LOG_E("coordinator: cannot make a new socket");
    }
    nc->next_register_ns = now + ms_ns(sent ? register_retry_ms(nc) : UNREACHABLE_RETRY_MS);
}

/* Sends a Heartbeat with the numbers `ld`; 1 when it went out. */
static int put_heartbeat(kvb_node_client *nc, const kvb_node_load *ld_) {
    kvb_node_load ld = *ld_;
    Kvbank__Heartbeat hb = KVBANK__HEARTBEAT__INIT;
    hb.name = nc->name;
    hb.n_own = ld.n_own;
    hb.n_used = ld.n_used;
    hb.live_requests = ld.live_requests;
    hb.waiting_requests = ld.waiting_requests;
    hb.max_need = ld.max_need;
    hb.tokens_generated = ld.tokens_generated;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_HEARTBEAT;
    env.heartbeat = &hb;
    return send_env(nc, &env) == KVB_OK;
}

static void lose_registration(kvb_node_client *nc, const char *why);

static void send_heartbeat(kvb_node_client *nc) {
    kvb_node_load ld = {0};
    nc->cb.load(nc->cb.ud, &ld);
    if (put_heartbeat(nc, &ld)) {
        mark_waiting(nc);
    } else {
        /* No connection: the coordinator is gone (or stuck). Register at once when it is back,
         * rather than a heartbeat and a `known = false` later. */
        lose_registration(nc, "the coordinator is not connected");
        return;
    }
    uint64_t now = kvb_now_ns();
    nc->next_heartbeat_ns = now + ms_ns(period_ms(nc));
    pthread_mutex_lock(&nc->ka_mu);
    nc->ka_last_hb_ns = now;
    pthread_mutex_unlock(&nc->ka_mu);
}

/* ---------------------------------------------------------------------------------------- keepalive */

static void *keepalive_main(void *arg) {
    kvb_node_client *nc = arg;
    pthread_mutex_lock(&nc->ka_mu);
    while (!nc->ka_quit) {
        uint64_t now = kvb_now_ns();
        uint64_t period = ms_ns(nc->ka_period_ms);
        if (nc->ka_busy && nc->ka_registered && now - nc->ka_last_hb_ns >= period) {
            kvb_node_load ld = nc->ka_load;
            nc->ka_sending = 1;
            pthread_mutex_unlock(&nc->ka_mu);
            /* The owner waits in busy_end until ka_sending drops: the socket is ours meanwhile. */
            int sent = put_heartbeat(nc, &ld);
            pthread_mutex_lock(&nc->ka_mu);
            nc->ka_sending = 0;
            nc->ka_last_hb_ns = kvb_now_ns();
            if (sent) nc->ka_sent++;
            pthread_cond_broadcast(&nc->ka_cv);
            continue;
        }
        /* Look again a quarter period from now, or at the due time if that is sooner. */
        uint64_t wait = period ? period / 4 : 50000000u;
        if (nc->ka_busy && nc->ka_registered && nc->ka_last_hb_ns + period > now &&
            nc->ka_last_hb_ns + period - now < wait)
            wait = nc->ka_last_hb_ns + period - now;
        if (wait < 1000000u) wait = 1000000u;
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t t = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec + wait;
        ts.tv_sec = (time_t)(t / 1000000000u);
        ts.tv_nsec = (long)(t % 1000000000u);
        pthread_cond_timedwait(&nc->ka_cv, &nc->ka_mu, &ts);
    }
    pthread_mutex_unlock(&nc->ka_mu);
    return NULL;
}

void kvb_node_client_busy_begin(kvb_node_client *nc) {
    if (!nc || !nc->ka_started) return;
    kvb_node_load ld = {0};
    if (nc->registered) nc->cb.load(nc->cb.ud, &ld);
    pthread_mutex_lock(&nc->ka_mu);
    nc->ka_load = ld;
    nc->ka_period_ms = period_ms(nc);
    nc->ka_registered = nc->registered;
    nc->ka_busy = 1;
    pthread_mutex_unlock(&nc->ka_mu);
}

void kvb_node_client_busy_end(kvb_node_client *nc) {
    if (!nc || !nc->ka_started) return;
    pthread_mutex_lock(&nc->ka_mu);
    nc->ka_busy = 0;
    while (nc->ka_sending) pthread_cond_wait(&nc->ka_cv, &nc->ka_mu);
    uint64_t last = nc->ka_last_hb_ns;
    pthread_mutex_unlock(&nc->ka_mu);
    /* A heartbeat the thread sent counts: the next one is due a period after it. */
    if (nc->registered) {
        uint64_t due = last + ms_ns(period_ms(nc));
        if (due > nc->next_heartbeat_ns) {
            nc->next_heartbeat_ns = due;
            mark_waiting(nc);
        }
    }
}

/* Back to unregistered; the next tick sends a Register. */
static void lose_registration(kvb_node_client *nc, const char *why) {
    if (nc->registered) KVB_LOG_W("coordinator: %s; registering again", why);
    nc->registered = 0;
    nc->next_register_ns = 0;
    nc->waiting_since_ns = 0;
}

static void update_room(kvb_node_client *nc, int limited, uint32_t room) {
    if (nc->id.role != KVB_ROLE_WORKER) return;
    if (limited && (!nc->room_limited || room != nc->lend_room))
        KVB_LOG_D("coordinator: the master can attach %u more of this worker's blocks", room);
    nc->room_limited = limited != 0;
    nc->lend_room = limited ? room : 0;
}

static void update_meu(kvb_node_client *nc, uint32_t w, uint32_t m) {
    if (nc->id.role != KVB_ROLE_WORKER) return;
    if (w != nc->meu_worker || m != nc->meu_master) {
        if (w && m) KVB_LOG_I("coordinator: minimum elastic unit %u worker block(s) = %u master block(s)", w, m);
        nc->meu_worker = w;
        nc->meu_master = m;
    }
}

static void on_register_reply(kvb_node_client *nc, const Kvbank__RegisterReply *rr) {
    const char *cid = str_or_empty(rr->coordinator_id);
    if (!rr->ok) {
        const char *e = str_or_empty(rr->error);
        if (strcmp(e, nc->last_refusal) != 0) {
            KVB_LOG_E("coordinator refused the registration of %s: %s (retrying every %d ms)", nc->id.name, e,
                      REFUSED_RETRY_MS);
            snprintf(nc->last_refusal, sizeof nc->last_refusal, "%s", e);
        }
        nc->registered = 0;
        nc->next_register_ns = kvb_now_ns() + ms_ns(REFUSED_RETRY_MS);
        return;
    }
    nc->last_refusal[0] = '\0';
    if (rr->heartbeat_ms) {
        int hb = (int)KVB_MIN(KVB_MAX(rr->heartbeat_ms, (uint32_t)HEARTBEAT_MIN_MS), (uint32_t)HEARTBEAT_MAX_MS);
        if (hb != nc->heartbeat_ms) KVB_LOG_D("coordinator: heartbeat every %d ms", hb);
        nc->heartbeat_ms = hb;
    }
    nc->epoch = rr->epoch;
    update_meu(nc, rr->meu_worker, rr->meu_master);
    update_room(nc, rr->room_limited, rr->lend_room);
    int same = nc->coord_id[0] && !strncmp(nc->coord_id, cid, sizeof nc->coord_id - 1) && !nc->forgotten;
    if (nc->registered && same) return; /* the answer to a repeated Register */
    nc->forgotten = 0;
    snprintf(nc->coord_id, sizeof nc->coord_id, "%s", cid);
    nc->registered = 1;
    nc->next_heartbeat_ns = kvb_now_ns() + ms_ns(period_ms(nc));
    KVB_LOG_I("registered with coordinator %s as %s (epoch %" PRIu64 ", heartbeat %d ms)", nc->coord_id,
              nc->id.role == KVB_ROLE_MASTER ? "master" : "worker", nc->epoch, nc->heartbeat_ms);
    if (nc->cb.on_registered) nc->cb.on_registered(nc->cb.ud, same);
}

static void on_heartbeat_reply(kvb_node_client *nc, const Kvbank__HeartbeatReply *hr) {
    if (!nc->registered) return; /* a late reply; the Register's answer decides */
    if (!hr->known) {
        nc->forgotten = 1;
        lose_registration(nc, "the coordinator does not know this model (restarted?)");
        return;
    }
    const char *cid = str_or_empty(hr->coordinator_id);
    if (cid[0] && strncmp(cid, nc->coord_id, sizeof nc->coord_id - 1) != 0) {
        lose_registration(nc, "another coordinator instance answers");
        return;
    }
    nc->epoch = hr->epoch;
    update_meu(nc, hr->meu_worker, hr->meu_master);
    update_room(nc, hr->room_limited, hr->lend_room);
}

/* --------------------------------------------------------------------------------------- dispatch */

static void drop(kvb_node_client *nc, const char *what) {
    nc->dropped++;
    KVB_LOG_W("coordinator: dropping a malformed message: %s", what);
}


/* Decodes one frame from the coordinator: size limit, protobuf, version, a body present (which body
 * is judged by dispatch). kvb_wire_unpack accepts only the model-server messages, hence this. On
 * success the caller frees *out with kvbank__envelope__free_unpacked. */
static kvb_status decode(const uint8_t *buf, size_t len, Kvbank__Envelope **out, char *why, size_t why_len) {
    *out = NULL;
    if (len > KVB_WIRE_MAX_FRAME) {
        snprintf(why, why_len, "frame of %zu bytes exceeds the %u-byte limit", len, KVB_WIRE_MAX_FRAME);
        return KVB_ERR_PROTOCOL;
    }
    static const uint8_t empty[1] = {0};
    Kvbank__Envelope *env = kvbank__envelope__unpack(NULL, len, len ? buf : empty);
    if (!env) {
        snprintf(why, why_len, "frame of %zu bytes is not a valid kvbank.Envelope", len);
        return KVB_ERR_PROTOCOL;
    }
    if (env->version != KVB_PROTO_VERSION) {
        snprintf(why, why_len, "unsupported protocol version %u (expected %u)", env->version, KVB_PROTO_VERSION);
        kvbank__envelope__free_unpacked(env, NULL);
        return KVB_ERR_PROTOCOL;
    }
    /* A oneof member that is a message is never NULL when its case is set by the unpacker, but a
     * body case must be set at all. */
    if (env->body_case == KVBANK__ENVELOPE__BODY__NOT_SET) {
        snprintf(why, why_len, "envelope has no body");
        kvbank__envelope__free_unpacked(env, NULL);
        return KVB_ERR_PROTOCOL;
    }
    *out = env;
    return KVB_OK;
}

static void dispatch(kvb_node_client *nc, const Kvbank__Envelope *env) {
    const kvb_node_callbacks *cb = &nc->cb;
    switch (env->body_case) {
    case KVBANK__ENVELOPE__BODY_REGISTER_REPLY: on_register_reply(nc, env->register_reply); return;
    case KVBANK__ENVELOPE__BODY_HEARTBEAT_REPLY: on_heartbeat_reply(nc, env->heartbeat_reply); return;
    case KVBANK__ENVELOPE__BODY_LEND_RESULT: {
        const Kvbank__LendResult *m = env->lend_result;
        if (m->accepted && (!m->loan || m->loan->n_blocks == 0)) { drop(nc, "LendResult accepted without a loan"); return; }
        if (cb->on_lend_result) cb->on_lend_result(cb->ud, m);
        else KVB_LOG_W("coordinator: unexpected LendResult ignored");
        return;
    }
    case KVBANK__ENVELOPE__BODY_GRANT: {
        const Kvbank__Grant *m = env->grant;
        if (!m->loan) { drop(nc, "Grant without a loan"); return; }
        if (!m->region || !m->region[0]) { drop(nc, "Grant without a region handle"); return; }
        if (m->loan->n_master_blocks == 0 || m->loan->bytes == 0) { drop(nc, "Grant of an empty loan"); return; }
        if (m->loan->offset > m->region_bytes || m->loan->bytes > m->region_bytes - m->loan->offset)
            { drop(nc, "Grant of a range outside the lender's region"); return; }
        if (cb->on_grant) cb->on_grant(cb->ud, m);
        else KVB_LOG_W("coordinator: a Grant sent to a worker ignored");
        return;
    }
    case KVBANK__ENVELOPE__BODY_REVOKE:
        if (cb->on_revoke) cb->on_revoke(cb->ud, env->revoke);
        else KVB_LOG_W("coordinator: a Revoke sent to a worker ignored");
        return;
    case KVBANK__ENVELOPE__BODY_RECLAIMED:
        if (env->reclaimed->n_blocks == 0) { drop(nc, "Reclaimed of 0 blocks"); return; }
        if (cb->on_reclaimed) cb->on_reclaimed(cb->ud, env->reclaimed);
        else KVB_LOG_W("coordinator: unexpected Reclaimed ignored");
        return;
    case KVBANK__ENVELOPE__BODY_LEND_REQUEST:
        if (cb->on_lend_request) cb->on_lend_request(cb->ud, env->lend_request);
        else KVB_LOG_W("coordinator: a LendRequest sent to the master ignored");
        return;
    case KVBANK__ENVELOPE__BODY_STATUS_REPLY:
        if (cb->on_status) cb->on_status(cb->ud, env->status_reply);
        return;
    case KVBANK__ENVELOPE__BODY_CONTROL_REPLY:
        if (cb->on_control_reply) cb->on_control_reply(cb->ud, env->control_reply);
        return;
    case KVBANK__ENVELOPE__BODY_ERROR:
        KVB_LOG_W("coordinator: error %d: %s", env->error->code, str_or_empty(env->error->message));
        return;
    default: {
        char what[64];
        snprintf(what, sizeof what, "message type %d is not for a model", (int)env->body_case);
        drop(nc, what);
        return;
    }
    }
}

void kvb_node_client_on_ready(kvb_node_client *nc) {
    if (!nc) return;
    for (;;) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, nc->sock, ZMQ_DONTWAIT) < 0) {
            int e = errno;
            zmq_msg_close(&m);
            if (e != EAGAIN && e != EINTR) KVB_LOG_E("coordinator: zmq_msg_recv: %s", zmq_strerror(e));
            return;
        }
        /* Any message shows the coordinator is there. */
        nc->waiting_since_ns = 0;
        int more = zmq_msg_more(&m);
        if (more) {
            int n = 1;
            while (more) {
                zmq_msg_t extra;
                zmq_msg_init(&extra);
                if (zmq_msg_recv(&extra, nc->sock, ZMQ_DONTWAIT) < 0) more = 0;
                else n++, more = zmq_msg_more(&extra);
                zmq_msg_close(&extra);
            }
            zmq_msg_close(&m);
            char what[64];
            snprintf(what, sizeof what, "%d frames", n);
            drop(nc, what);
            continue;
        }
        Kvbank__Envelope *env = NULL;
        char why[256];
        kvb_status st = decode(zmq_msg_data(&m), zmq_msg_size(&m), &env, why, sizeof why);
        zmq_msg_close(&m);
        if (st != KVB_OK) {
            drop(nc, why);
            continue;
        }
        dispatch(nc, env);
        kvbank__envelope__free_unpacked(env, NULL);
    }
}

static void reconnect(kvb_node_client *nc, const char *why);

static int reconnect_ms(const kvb_node_client *nc) {
    int r = RECONNECT_PERIODS * period_ms(nc);
    return r < RECONNECT_MIN_MS ? RECONNECT_MIN_MS : r;
}

int kvb_node_client_tick(kvb_node_client *nc) {
    if (!nc) return -1;
    uint64_t now = kvb_now_ns();
    /* Messages went out on a standing connection and nothing came back: the coordinator may be gone
     * or stuck, or our name's route may belong to another connection now (ROUTER_HANDOVER). A new
     * socket takes the route back (well before the coordinator's silence limit) and registers again. */
    if (nc->waiting_since_ns && now - nc->waiting_since_ns > ms_ns(reconnect_ms(nc))) {
        char why[96];
        snprintf(why, sizeof why, "no answer from the coordinator for %d ms", reconnect_ms(nc));
        reconnect(nc, why);
        now = kvb_now_ns();
    }
    uint64_t next;
    if (!nc->registered) {
        if (now >= nc->next_register_ns) send_register(nc);
        next = nc->next_register_ns;
    } else {
        if (now >= nc->next_heartbeat_ns) send_heartbeat(nc);
        next = nc->next_heartbeat_ns;
        if (nc->waiting_since_ns) {
            uint64_t dead = nc->waiting_since_ns + ms_ns(reconnect_ms(nc)) + 1;
            if (dead < next) next = dead;
        }
    }
    now = kvb_now_ns();
    return next <= now ? 0 : (int)KVB_MIN((next - now + 999999) / 1000000, (uint64_t)HEARTBEAT_MAX_MS);
}

void kvb_node_client_pump(kvb_node_client *nc, int timeout_ms) {
    if (!nc) return;
    uint64_t end = kvb_now_ns() + ms_ns(timeout_ms);
    for (;;) {
        int wait = kvb_node_client_tick(nc);
        uint64_t now = kvb_now_ns();
        if (now >= end) break;
        long left = (long)((end - now + 999999) / 1000000);
        if (wait < 0 || wait > left) wait = (int)left;
        zmq_pollitem_t it = kvb_node_client_pollitem(nc);
        int rc = zmq_poll(&it, 1, wait);
        if (rc < 0 && errno != EINTR) {
            KVB_LOG_E("coordinator: zmq_poll: %s", zmq_strerror(errno));
            break;
        }
        if (rc < 0) break; /* a signal: let the caller look at its flags */
        if (it.revents & ZMQ_POLLIN) kvb_node_client_on_ready(nc);
    }
}

/* ---------------------------------------------------------------------------------------- sending */

static kvb_status need_registered(const kvb_node_client *nc) {
    if (!nc) return KVB_ERR_INVALID;
    return nc->registered ? KVB_OK : KVB_ERR_STATE;
}

kvb_status kvb_node_client_send_lend_offer(kvb_node_client *nc, uint32_t first_block, uint32_t n_blocks) {
    KVB_TRY(need_registered(nc));
    Kvbank__LendOffer m = KVBANK__LEND_OFFER__INIT;
    m.worker = nc->name;
    m.first_block = first_block;
    m.n_blocks = n_blocks;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_LEND_OFFER;
    env.lend_offer = &m;
    return send_env(nc, &env);
}

kvb_status kvb_node_client_send_reclaim(kvb_node_client *nc, uint32_t n_blocks) {
    KVB_TRY(need_registered(nc));
    Kvbank__ReclaimRequest m = KVBANK__RECLAIM_REQUEST__INIT;
    m.worker = nc->name;
    m.n_blocks = n_blocks;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_RECLAIM_REQUEST;
    env.reclaim_request = &m;
    return send_env(nc, &env);
}

kvb_status kvb_node_client_send_grant_ack(kvb_node_client *nc, uint64_t loan_id, int ok, const char *error) {
    KVB_TRY(need_registered(nc));
    Kvbank__GrantAck m = KVBANK__GRANT_ACK__INIT;
    m.loan_id = loan_id;
    m.ok = ok != 0;
    m.error = (char *)(error ? error : "");
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_GRANT_ACK;
    env.grant_ack = &m;
    return send_env(nc, &env);
}

kvb_status kvb_node_client_send_revoke_ack(kvb_node_client *nc, uint64_t loan_id, uint64_t epoch, uint32_t moved,
                                           uint32_t dropped, uint32_t preempted, uint32_t kept, uint32_t demoted) {
    KVB_TRY(need_registered(nc));
    Kvbank__RevokeAck m = KVBANK__REVOKE_ACK__INIT;
    m.loan_id = loan_id;
    m.epoch = epoch;
    m.moved_blocks = moved;
    m.dropped_blocks = dropped;
    m.preempted = preempted;
    m.kept_blocks = kept;
    m.demoted_blocks = demoted;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_REVOKE_ACK;
    env.revoke_ack = &m;
    return send_env(nc, &env);
}

kvb_status kvb_node_client_send_status_request(kvb_node_client *nc, int ledger) {
    if (!nc) return KVB_ERR_INVALID;
    Kvbank__StatusRequest m = KVBANK__STATUS_REQUEST__INIT;
    m.ledger = ledger != 0;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_STATUS_REQUEST;
    env.status_request = &m;
    return send_env(nc, &env);
}

kvb_status kvb_node_client_send_control(kvb_node_client *nc, int op, const char *model, uint32_t n_blocks) {
    if (!nc || !model) return KVB_ERR_INVALID;
    Kvbank__Control m = KVBANK__CONTROL__INIT;
    m.op = (Kvbank__Control__Op)op;
    m.model = (char *)model;
    m.n_blocks = n_blocks;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_CONTROL;
    env.control = &m;
    return send_env(nc, &env);
}

/* -------------------------------------------------------------------------------------- accessors */

zmq_pollitem_t kvb_node_client_pollitem(const kvb_node_client *nc) {
    zmq_pollitem_t it = {.socket = nc ? nc->sock : NULL, .fd = 0, .events = ZMQ_POLLIN, .revents = 0};
    return it;
}

int kvb_node_client_registered(const kvb_node_client *nc) { return nc && nc->registered; }

int kvb_node_client_heartbeat_ms(const kvb_node_client *nc) { return nc ? nc->heartbeat_ms : 0; }

void kvb_node_client_meu(const kvb_node_client *nc, uint32_t *meu_worker, uint32_t *meu_master) {
    if (meu_worker) *meu_worker = nc ? nc->meu_worker : 0;
    if (meu_master) *meu_master = nc ? nc->meu_master : 0;
}

int kvb_node_client_lend_room(const kvb_node_client *nc, uint32_t *room) {
    if (room) *room = nc && nc->room_limited ? nc->lend_room : 0;
    return nc && nc->room_limited;
}

void kvb_node_client_set_meu(kvb_node_client *nc, uint32_t meu_worker, uint32_t meu_master) {
    if (nc) update_meu(nc, meu_worker, meu_master);
}

uint64_t kvb_node_client_epoch(const kvb_node_client *nc) { return nc ? nc->epoch : 0; }

/* -------------------------------------------------------------------------------------- lifecycle */

static kvb_status dup_opt(const char *s, char **out) {
    *out = NULL;
    return kvb_strdup(s ? s : "", out);
}

/* The token of the socket: the one given, or the one the node key file gives (common/ipc/auth.h).
 * Returns 1 when it changed. */
static int load_token(kvb_node_client *nc) {
    if (nc->token_fixed) return 0;
    char path[4096];
    kvb_auth a;
    if (kvb_auth_key_path(nc->coord_ep, path, sizeof path) != KVB_OK || kvb_auth_read_file(path, &a) != KVB_OK ||
        !a.has_secret)
        return 0; /* not there yet: the coordinator writes it when it starts */
    char tok[KVB_AUTH_TOKEN_LEN + 1];
    kvb_auth_token(a.secret, nc->name, tok);
    explicit_bzero(&a, sizeof a);
    int changed = strcmp(tok, nc->token) != 0;
    memcpy(nc->token, tok, sizeof tok);
    explicit_bzero(tok, sizeof tok);
    return changed;
}

/* A new DEALER to the coordinator in place of the old one (closed, its queue dropped). */
static kvb_status open_socket(kvb_node_client *nc) {
    if (nc->sock) zmq_close(nc->sock);
    nc->sock = zmq_socket(nc->zctx, ZMQ_DEALER);
    if (!nc->sock) {
        KVB_LOG_E("zmq_socket: %s", zmq_strerror(errno));
        return KVB_ERR_IO;
    }
    int zero = 0, one = 1, ivl = RECONNECT_IVL_MS, ivl_max = 0;
    int64_t maxmsg = RECV_MAX_BYTES;
    if (zmq_setsockopt(nc->sock, ZMQ_ROUTING_ID, nc->name, strlen(nc->name)) ||
        zmq_setsockopt(nc->sock, ZMQ_LINGER, &zero, sizeof zero) ||
        zmq_setsockopt(nc->sock, ZMQ_IMMEDIATE, &one, sizeof one) ||
        zmq_setsockopt(nc->sock, ZMQ_RECONNECT_IVL, &ivl, sizeof ivl) ||
        zmq_setsockopt(nc->sock, ZMQ_RECONNECT_IVL_MAX, &ivl_max, sizeof ivl_max) ||
        zmq_setsockopt(nc->sock, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg)) {
        KVB_LOG_E("coordinator: zmq_setsockopt: %s", zmq_strerror(errno));
        return KVB_ERR_IO;
    }
    /* Without a token yet the socket speaks no PLAIN: the coordinator refuses it until the key file
     * is there (load_token is tried again meanwhile). */
    if (nc->token[0]) KVB_TRY(kvb_auth_set_plain(nc->sock, nc->name, nc->token));
    if (zmq_connect(nc->sock, nc->coord_ep) != 0) {
        KVB_LOG_E("cannot connect to the coordinator at %s: %s", nc->coord_ep, zmq_strerror(errno));
        return KVB_ERR_INVALID;
    }
    return KVB_OK;
}

/* Drops the connection and makes a new one (the old one's route may belong to another connection
 * now); the next tick registers again. */
static void reconnect(kvb_node_client *nc, const char *why) {
    kvb_node_client_on_ready(nc); /* what already arrived still counts */
    load_token(nc);
    KVB_LOG_W("coordinator: %s; reconnecting with a new socket", why);
    if (open_socket(nc) != KVB_OK) KVB_LOG_E("coordinator: cannot make a new socket; retrying later");
    nc->reconnects++;
    lose_registration(nc, why);
}

kvb_status kvb_node_client_create(const char *endpoint, const kvb_node_identity *id, const kvb_node_callbacks *cb,
                                  int heartbeat_ms, kvb_node_client **out) {
    if (!endpoint || !id || !cb || !cb->load || !out || !id->name || heartbeat_ms <= 0) return KVB_ERR_INVALID;
    size_t name_len = strlen(id->name);
    if (name_len == 0 || name_len > 255) {
        KVB_LOG_E("coordinator: model name of %zu bytes cannot be a routing id (1..255)", name_len);
        return KVB_ERR_INVALID;
    }
    kvb_status st = KVB_OK;
    kvb_node_client *nc = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *nc, (void **)&nc));
    pthread_mutex_init(&nc->ka_mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&nc->ka_cv, &ca);
    pthread_condattr_destroy(&ca);
    nc->ka_init = 1;
    KVB_TRY_GOTO(dup_opt(id->name, &nc->name), fail);
    KVB_TRY_GOTO(dup_opt(id->region, &nc->region), fail);
    KVB_TRY_GOTO(dup_opt(id->endpoint, &nc->endpoint), fail);
    KVB_TRY_GOTO(dup_opt(id->model, &nc->model), fail);
    KVB_TRY_GOTO(dup_opt(id->memory ? id->memory : "host", &nc->memory), fail);
    nc->id = *id;
    nc->id.name = nc->name;
    nc->id.region = nc->region;
    nc->id.endpoint = nc->endpoint;
    nc->id.model = nc->model;
    nc->id.memory = nc->memory;
    nc->cb = *cb;
    nc->heartbeat_ms = KVB_MIN(KVB_MAX(heartbeat_ms, HEARTBEAT_MIN_MS), HEARTBEAT_MAX_MS);

    KVB_TRY_GOTO(dup_opt(endpoint, &nc->coord_ep), fail);
    if (id->token) {
        if (strlen(id->token) != KVB_AUTH_TOKEN_LEN) {
            KVB_LOG_E("coordinator: a token has %d characters", KVB_AUTH_TOKEN_LEN);
            st = KVB_ERR_INVALID;
            goto fail;
        }
        memcpy(nc->token, id->token, sizeof nc->token);
        nc->token_fixed = 1;
    } else {
        load_token(nc);
    }
    nc->id.token = NULL; /* kept in nc->token only */
    nc->zctx = zmq_ctx_new();
    if (!nc->zctx) {
        KVB_LOG_E("zmq_ctx_new: %s", zmq_strerror(errno));
        st = KVB_ERR_IO;
        goto fail;
    }
    KVB_TRY_GOTO(open_socket(nc), fail);
    int e = pthread_create(&nc->ka_thread, NULL, keepalive_main, nc);
    if (e != 0) {
        KVB_LOG_E("coordinator: cannot start the keepalive thread: %s", strerror(e));
        st = KVB_ERR_NOMEM;
        goto fail;
    }
    nc->ka_started = 1;
    KVB_LOG_D("coordinator: connecting to %s as %s", endpoint, nc->id.name);
    *out = nc;
    return KVB_OK;
fail:
    kvb_node_client_destroy(nc);
    return st;
}

void kvb_node_client_destroy(kvb_node_client *nc) {
    if (!nc) return;
    if (nc->ka_started) {
        pthread_mutex_lock(&nc->ka_mu);
        nc->ka_quit = 1;
        nc->ka_busy = 0;
        pthread_cond_broadcast(&nc->ka_cv);
        pthread_mutex_unlock(&nc->ka_mu);
        pthread_join(nc->ka_thread, NULL);
        if (nc->ka_sent) KVB_LOG_D("coordinator: %" PRIu64 " heartbeat(s) sent during long steps", nc->ka_sent);
    }
    if (nc->ka_init) {
        pthread_cond_destroy(&nc->ka_cv);
        pthread_mutex_destroy(&nc->ka_mu);
    }
    if (nc->sock) zmq_close(nc->sock);
    if (nc->zctx) zmq_ctx_term(nc->zctx);
    if (nc->reconnects) KVB_LOG_D("coordinator: %" PRIu64 " reconnection(s) after silence", nc->reconnects);
    explicit_bzero(nc->token, sizeof nc->token);
    free(nc->coord_ep);
    free(nc->name);
    free(nc->region);
    free(nc->memory);
    free(nc->endpoint);
    free(nc->model);
    free(nc);
}
