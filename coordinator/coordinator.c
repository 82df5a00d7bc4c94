/* kvbank — kvbank-coordinator's loop: a ROUTER socket in front of the ledger (coordinator/ledger.h).
 *
 * Each received message is decoded, checked against its sender and applied to the ledger; the reply
 * (if the message has one) goes out first, then every action the ledger queued, in order. Sends
 * never block: a peer that is not connected (EHOSTUNREACH under ROUTER_MANDATORY) or does not read
 * (EAGAIN at the high-water mark) misses that message, and the protocol's timers recover: a Grant
 * that cannot be delivered cancels its loan, a Revoke is re-sent until acknowledged, and a Reclaimed
 * is kept and re-sent when its worker next heartbeats. */
#include "coordinator/coordinator.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/pidfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <zmq.h>

#include "common/ipc/auth.h"
#include "common/ipc/wire.h"
#include "common/mem/region.h"
#include "common/util/sha256.h"
#include "coordinator/ledger.h"

#define IDENT_MAX 255                     /* ZeroMQ routing ids are 1..255 bytes */
#define SEND_HWM 10000                    /* messages queued to one peer before it counts as not reading */
#define RECV_HARD_MAX ((int64_t)64 << 20) /* libzmq drops a peer that sends more in one message */
#define BATCH_MAX 256                     /* messages handled between two timer checks */
#define PENDING_MAX 1024                  /* Reclaimed messages kept for re-sending */
#define ZAP_EP "inproc://zeromq.zap.01"   /* where libzmq sends ZAP requests */
#define MONITOR_EP "inproc://kvb-coord-monitor"
#define CTL_MONITOR_EP "inproc://kvb-coord-monitor-ctl"

typedef struct pending_reclaimed {
    char to[KVB_LEDGER_NAME_MAX + 1];
    uint32_t pid;                         /* the worker process it is for */
    Kvbank__Reclaimed msg;
} pending_reclaimed;

/* A model process verified at its registration: fencing and liveness go through its pidfd. */
typedef struct verified_proc {
    char name[KVB_LEDGER_NAME_MAX + 1];   /* "" for a free entry */
    long pid;
    int pidfd;                            /* -1 when it could not be opened (the process was gone) */
} verified_proc;

/* One process of kvbankd's last NodeReport, as it sent it (strings cut to fit). */
typedef struct child_state {
    char name[KVB_LEDGER_NAME_MAX + 1];
    char state[16];
    char role[16];
    char last_exit[96];
    uint32_t restarts, attempts, pid;
    uint64_t age_ms;
} child_state;

struct kvb_coord {
    void *zctx;
    void *sock;                           /* ROUTER */
    void *ctl;                            /* ROUTER of control clients (EP.ctl) */
    char *ctl_path;                       /* its socket file, or NULL */
    dev_t ctl_dev;
    ino_t ctl_ino;
    void *zap;                            /* REP answering both ROUTERs' ZAP requests */
    void *mon, *ctl_mon;                  /* PAIRs receiving each ROUTER's failed handshakes */
    kvb_auth auth;                        /* the node secret */
    long supervisor;                      /* kvbankd's pid when it started us (models must be its children), else 0 */
    verified_proc procs[KVB_LEDGER_MAX_MODELS];
    uint64_t zap_refused;                 /* ZAP refusals logged so far (rate limit) */
    char *endpoint;                       /* as bound */
    char *ipc_path;                       /* socket file of an ipc:// endpoint, or NULL */
    dev_t ipc_dev;                        /* and its identity, to remove only our own file */
    ino_t ipc_ino;
    char id[40];                          /* instance id */
    uint32_t heartbeat_ms, heartbeat_misses;
    kvb_ledger *ledger;
    uint64_t t0_ms;                       /* start (monotonic) */
    uint64_t next_tick_ms;
    uint32_t tick_ms;
    pending_reclaimed *pending;           /* [n_pending] undelivered Reclaimed, oldest first */
    int n_pending;
    kvb_coord_stats stats;
    child_state children[KVB_LEDGER_MAX_MODELS + 2]; /* kvbankd's last NodeReport (models, coordinator, gateway) */
    int n_children;
    uint64_t children_at_ms;              /* when it came (monotonic) */
};

/* ------------------------------------------------------------------------------------------ helpers */

static uint64_t now_ms(void) { return kvb_now_ns() / 1000000u; }

const char *kvb_drop_reason_str(kvb_drop_reason r) {
    static const char *const names[KVB_DROP_N] = {"frames", "oversized", "malformed", "version", "body",
                                                  "unregistered", "role", "sender", "auth"};
    return (unsigned)r < KVB_DROP_N ? names[r] : "?";
}

/* Printable form of a routing id for logs. */
static const char *ident_str(const uint8_t *ident, size_t len, char buf[72]) {
    size_t n = 0;
    int printable = len > 0 && len <= 64;
    for (size_t i = 0; printable && i < len; i++) printable = ident[i] >= 0x21 && ident[i] < 0x7f;
    if (printable) {
        memcpy(buf, ident, len);
        buf[len] = '\0';
        return buf;
    }
    buf[n++] = '#';
    for (size_t i = 0; i < len && i < 16; i++) n += (size_t)snprintf(buf + n, 3, "%02x", ident[i]);
    buf[n] = '\0';
    return buf;
}

/* The sender's routing id as a model name ("" when it cannot be one). */
static void sender_name(const uint8_t *ident, size_t len, char out[KVB_LEDGER_NAME_MAX + 1]) {
    out[0] = '\0';
    if (len == 0 || len > KVB_LEDGER_NAME_MAX || memchr(ident, 0, len)) return;
    memcpy(out, ident, len);
    out[len] = '\0';
}

static const char *str_or_empty(const char *s) { return s ? s : ""; }

static void count_drop(kvb_coord *c, kvb_drop_reason r, const char *from, const char *why) {
    c->stats.dropped[r]++;
    c->stats.dropped_total++;
    uint64_t n = c->stats.dropped[r];
    if (n <= 8 || (n & (n - 1)) == 0) /* the first few of each reason, then at powers of two */
        KVB_LOG_W("dropped a message from %s: %s: %s (dropped so far: %" PRIu64 " frames, %" PRIu64 " oversized, "
                  "%" PRIu64 " malformed, %" PRIu64 " version, %" PRIu64 " body, %" PRIu64 " unregistered, %" PRIu64
                  " role, %" PRIu64 " sender, %" PRIu64 " auth)", from, kvb_drop_reason_str(r), why,
                  c->stats.dropped[0], c->stats.dropped[1], c->stats.dropped[2], c->stats.dropped[3],
                  c->stats.dropped[4], c->stats.dropped[5], c->stats.dropped[6], c->stats.dropped[7],
                  c->stats.dropped[8]);
    if (r == KVB_DROP_AUTH) c->stats.auth_refused++;
}

kvb_status kvb_coord_decode(const uint8_t *buf, size_t len, Kvbank__Envelope **out, kvb_drop_reason *reason) {
    kvb_wire_fault f = KVB_WIRE_OK;
    kvb_status st = kvb_wire_decode(buf, len, out, &f);
    if (st == KVB_OK || !reason) return st;
    *reason = f == KVB_WIRE_OVERSIZED ? KVB_DROP_OVERSIZED
              : f == KVB_WIRE_VERSION ? KVB_DROP_VERSION
              : f == KVB_WIRE_NO_BODY ? KVB_DROP_BODY
                                      : KVB_DROP_MALFORMED;
    return st;
}

/* Sends `env` to the peer `to` (a routing id). Returns KVB_ERR_IO with errno set when the peer is not
 * connected or does not read. */
static kvb_status send_to(kvb_coord *c, void *sock, const void *to, size_t to_len, Kvbank__Envelope *env) {
    kvb_status st = kvb_wire_send(sock, to, to_len, env, 1);
    if (st == KVB_OK) {
        c->stats.sent++;
        return KVB_OK;
    }
    int e = errno;
    c->stats.send_failed++;
    char b[72];
    KVB_LOG_W("cannot send message type %d to %s: %s", (int)env->body_case, ident_str(to, to_len, b),
              e == EHOSTUNREACH ? "not connected" : e == EAGAIN ? "not reading" : zmq_strerror(e));
    errno = e;
    return st;
}

static kvb_status send_name(kvb_coord *c, const char *name, Kvbank__Envelope *env) {
    return send_to(c, c->sock, name, strlen(name), env);
}

static Kvbank__Role role_to_wire(kvb_role r) {
    return r == KVB_ROLE_MASTER ? KVBANK__ROLE__ROLE_MASTER : r == KVB_ROLE_WORKER ? KVBANK__ROLE__ROLE_WORKER
                                                                                   : KVBANK__ROLE__ROLE_NONE;
}

static void loan_to_wire(const kvb_loan *ln, Kvbank__Loan *w) {
    kvbank__loan__init(w);
    w->loan_id = ln->id;
    w->lender = (char *)ln->lender;
    w->first_block = ln->first_block;
    w->n_blocks = ln->n_blocks;
    w->n_master_blocks = ln->n_master_blocks;
    w->offset = ln->offset;
    w->bytes = ln->bytes;
    w->epoch = ln->epoch;
    w->revoking = ln->state == KVB_LOAN_REVOKING;
}

static void geom_to_wire(const kvb_kv_geom *g, Kvbank__KvGeometry *w) {
    kvbank__kv_geometry__init(w);
    w->n_layers = (uint32_t)g->n_layers;
    w->n_kv_heads = (uint32_t)g->n_kv_heads;
    w->head_dim = (uint32_t)g->head_dim;
    w->block_size = (uint32_t)g->block_size;
    w->elem_size = (uint32_t)g->elem_size;
}

static int wire_int(uint32_t v) { return v > INT_MAX ? -1 : (int)v; }

/* The MEUs a worker's replies carry (0 when unknown or for the master), and its lend room (issue 10:
 * *limited when the master's LSC caps what it can attach). */
static void meus_of(const kvb_coord *c, const char *name, uint32_t *w, uint32_t *m, protobuf_c_boolean *limited,
                    uint32_t *room) {
    const kvb_ledger_model *md = kvb_ledger_find(c->ledger, name);
    *w = *m = 0;
    if (md && md->alive && md->role == KVB_ROLE_WORKER && md->has_meu) {
        *w = md->meu.meu_worker;
        *m = md->meu.meu_master;
    }
    *limited = md && md->alive && kvb_ledger_lend_room(c->ledger, name, room);
}

/* ---------------------------------------------------------------------------------- pending Reclaimed */

static void pending_add(kvb_coord *c, const char *to, uint32_t pid, const Kvbank__Reclaimed *msg) {
    if (c->n_pending == PENDING_MAX) { /* forget the oldest; the worker re-registers to resync */
        KVB_LOG_E("too many undelivered Reclaimed messages; forgetting the one of loan %" PRIu64 " to %s",
                  c->pending[0].msg.loan_id, c->pending[0].to);
        memmove(&c->pending[0], &c->pending[1], (size_t)(PENDING_MAX - 1) * sizeof *c->pending);
        c->n_pending--;
    }
    if (!c->pending && kvb_calloc(PENDING_MAX, sizeof *c->pending, (void **)&c->pending) != KVB_OK) {
        KVB_LOG_E("out of memory: the Reclaimed of loan %" PRIu64 " to %s is lost", msg->loan_id, to);
        return;
    }
    pending_reclaimed *p = &c->pending[c->n_pending++];
    snprintf(p->to, sizeof p->to, "%s", to);
    p->pid = pid;
    p->msg = *msg;
}

/* Re-sends the Reclaimed messages kept for `name`, or forgets them when that process is gone. */
static void pending_flush(kvb_coord *c, const char *name, int forget) {
    const kvb_ledger_model *m = kvb_ledger_find(c->ledger, name);
    int k = 0;
    for (int i = 0; i < c->n_pending; i++) {
        pending_reclaimed *p = &c->pending[i];
        int keep = 1;
        if (!strcmp(p->to, name)) {
            if (forget || !m || !m->alive || m->pid != p->pid) {
                keep = 0;
            } else {
                Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
                env.body_case = KVBANK__ENVELOPE__BODY_RECLAIMED;
                env.reclaimed = &p->msg;
                keep = send_name(c, p->to, &env) != KVB_OK;
                if (!keep) KVB_LOG_I("Reclaimed of loan %" PRIu64 " delivered to %s late", p->msg.loan_id, p->to);
            }
        }
        if (keep) c->pending[k++] = *p;
    }
    c->n_pending = k;
}

/* ------------------------------------------------------------------------------------------ actions */

static void send_action(kvb_coord *c, const kvb_ledger_action *a) {
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    Kvbank__Loan wl;
    loan_to_wire(&a->loan, &wl);
    switch (a->kind) {
    case KVB_ACT_GRANT: {
        const kvb_loan *ln = kvb_ledger_loan(c->ledger, a->loan.id);
        const kvb_ledger_model *w = kvb_ledger_find(c->ledger, a->loan.lender);
        if (!ln || ln->state != KVB_LOAN_GRANTING || !w) return; /* cancelled before it went out */
        Kvbank__KvGeometry g;
        geom_to_wire(&w->geom, &g);
        Kvbank__Grant m = KVBANK__GRANT__INIT;
        m.loan = &wl;
        m.region = w->region;
        m.region_bytes = w->region_bytes;
        m.lender_geom = &g;
        env.body_case = KVBANK__ENVELOPE__BODY_GRANT;
        env.grant = &m;
        if (send_name(c, a->to, &env) != KVB_OK)
            kvb_ledger_grant_undeliverable(c->ledger, a->loan.id, now_ms()); /* queues the Reclaimed */
        return;
    }
    case KVB_ACT_REVOKE: {
        Kvbank__Revoke m = KVBANK__REVOKE__INIT;
        m.loan_id = a->loan.id;
        m.epoch = a->epoch;
        m.lender_dead = a->lender_dead != 0;
        if (!m.lender_dead && a->loan.revoke_blocks && a->loan.revoke_blocks < a->loan.n_blocks) {
            m.first_block = a->loan.first_block; /* partial reclaim: only the loan's first blocks */
            m.n_blocks = a->loan.revoke_blocks;
        }
        env.body_case = KVBANK__ENVELOPE__BODY_REVOKE;
        env.revoke = &m;
        KVB_LOG_D("Revoke loan %" PRIu64 " (epoch %" PRIu64 "%s) -> %s", m.loan_id, m.epoch,
                  m.lender_dead ? ", lender dead" : "", a->to);
        send_name(c, a->to, &env); /* not delivered: re-sent by the ledger's ack timer */
        return;
    }
    case KVB_ACT_RECLAIMED: {
        Kvbank__Reclaimed m = KVBANK__RECLAIMED__INIT;
        m.loan_id = a->loan.id;
        m.first_block = a->loan.first_block;
        m.n_blocks = a->loan.n_blocks;
        m.epoch = a->epoch;
        env.body_case = KVBANK__ENVELOPE__BODY_RECLAIMED;
        env.reclaimed = &m;
        KVB_LOG_I("Reclaimed loan %" PRIu64 " [%" PRIu32 ", %" PRIu64 ") -> %s", m.loan_id, m.first_block,
                  (uint64_t)m.first_block + m.n_blocks, a->to);
        if (send_name(c, a->to, &env) != KVB_OK) {
            const kvb_ledger_model *w = kvb_ledger_find(c->ledger, a->to);
            if (w && w->alive) pending_add(c, a->to, w->pid, &m);
        }
        return;
    }
    case KVB_ACT_LEND_REQUEST: {
        Kvbank__LendRequest m = KVBANK__LEND_REQUEST__INIT;
        m.n_blocks = a->n_blocks;
        m.drain = a->drain != 0;
        env.body_case = KVBANK__ENVELOPE__BODY_LEND_REQUEST;
        env.lend_request = &m;
        send_name(c, a->to, &env);
        return;
    }
    }
}

static void flush_actions(kvb_coord *c) {
    kvb_ledger_action a;
    while (kvb_ledger_pop_action(c->ledger, &a)) send_action(c, &a);
}

/* ------------------------------------------------------------------------------------------ handlers */

typedef enum auth_kind { AUTH_NONE = 0, AUTH_MODEL = 1, AUTH_CTL = 2 } auth_kind;

typedef struct msg_ctx {
    void *sock;                         /* the ROUTER it came on (models' or control) */
    const uint8_t *ident;
    size_t ident_len;
    char name[KVB_LEDGER_NAME_MAX + 1]; /* the routing id as a name, "" if it cannot be one */
    char printable[72];
    auth_kind auth;                     /* how its connection logged in (the ZAP handler's User-Id) */
    char auth_name[KVB_LEDGER_NAME_MAX + 1]; /* AUTH_MODEL: the model it logged in as */
    long auth_pid;                      /* the connection's process (SO_PEERCRED), -1 when unknown */
} msg_ctx;

/* The identity the ZAP handler gave the connection: "m:<pid>:<name>" or "c:<pid>". */
static void parse_user_id(const char *uid, msg_ctx *mc) {
    mc->auth = AUTH_NONE;
    mc->auth_name[0] = '\0';
    mc->auth_pid = -1;
    if (!uid || (uid[0] != 'm' && uid[0] != 'c') || uid[1] != ':') return;
    char *end = NULL;
    long pid = strtol(uid + 2, &end, 10);
    if (!end || end == uid + 2 || pid <= 0) return;
    if (uid[0] == 'c' && *end == '\0') {
        mc->auth = AUTH_CTL;
    } else if (uid[0] == 'm' && *end == ':' && strlen(end + 1) <= KVB_LEDGER_NAME_MAX && end[1]) {
        mc->auth = AUTH_MODEL;
        snprintf(mc->auth_name, sizeof mc->auth_name, "%s", end + 1);
    } else {
        return;
    }
    mc->auth_pid = pid;
}

/* --------------------------------------------------------------------------- verified processes */

static verified_proc *proc_by_name(kvb_coord *c, const char *name) {
    for (int i = 0; i < KVB_LEDGER_MAX_MODELS; i++)
        if (!strcmp(c->procs[i].name, name)) return &c->procs[i];
    return NULL;
}

static verified_proc *proc_by_pid(kvb_coord *c, long pid) {
    for (int i = 0; i < KVB_LEDGER_MAX_MODELS; i++)
        if (c->procs[i].name[0] && c->procs[i].pid == pid) return &c->procs[i];
    return NULL;
}

/* The process that logged in as model `name` with pid `pid` registered: hold a pidfd on it, so that its
 * liveness and its fencing never hit another process that reused the pid. The pid came from the kernel
 * at the handshake; a pidfd opened now could only miss if that process died since and its pid was
 * taken again, by a process of this user (and, in a supervised node, a child of kvbankd): then it is
 * treated as gone. */
static void proc_verified(kvb_coord *c, const char *name, long pid) {
    verified_proc *v = proc_by_name(c, name);
    if (!v) v = proc_by_name(c, "");
    if (!v) return; /* the ledger holds at most as many models */
    if (v->name[0] && v->pid == pid && v->pidfd >= 0) return;
    if (v->name[0] && v->pidfd >= 0) close(v->pidfd);
    snprintf(v->name, sizeof v->name, "%s", name);
    v->pid = pid;
    v->pidfd = pidfd_open((pid_t)pid, 0);
    if (v->pidfd < 0) {
        KVB_LOG_W("%s: pidfd_open(%ld): %s; it counts as gone", name, pid, strerror(errno));
        return;
    }
    struct stat sb;
    char path[32];
    snprintf(path, sizeof path, "/proc/%ld", pid);
    long ppid = 0;
    if (stat(path, &sb) != 0 || sb.st_uid != geteuid() ||
        (c->supervisor && (kvb_proc_stat(pid, NULL, &ppid) != KVB_OK || ppid != c->supervisor))) {
        KVB_LOG_W("%s: pid %ld is no longer the process that logged in; it counts as gone", name, pid);
        close(v->pidfd);
        v->pidfd = -1;
    }
}

static void reply(kvb_coord *c, const msg_ctx *m, Kvbank__Envelope *env) { send_to(c, m->sock, m->ident, m->ident_len, env); }

static void handle_register(kvb_coord *c, const msg_ctx *mc, const Kvbank__Register *r) {
    char why[256] = "";
    kvb_status st = KVB_OK;
    kvb_loan *loans = NULL;
    const char *name = str_or_empty(r->name);
    if (strcmp(name, mc->name) != 0 || !mc->name[0]) {
        snprintf(why, sizeof why, "the routing id must be the model's name (\"%s\")", name);
        st = KVB_ERR_INVALID;
    } else if (!r->geom) {
        snprintf(why, sizeof why, "no geometry");
        st = KVB_ERR_INVALID;
    } else if (r->role != KVBANK__ROLE__ROLE_MASTER && r->role != KVBANK__ROLE__ROLE_WORKER) {
        snprintf(why, sizeof why, "role must be master or worker");
        st = KVB_ERR_INVALID;
    } else if ((long)r->pid != mc->auth_pid) {
        snprintf(why, sizeof why, "the registration names pid %" PRIu32 ", its connection belongs to pid %ld", r->pid,
                 mc->auth_pid);
        st = KVB_ERR_INVALID;
        count_drop(c, KVB_DROP_AUTH, mc->printable, why);
    } else if ((!r->memory || !r->memory[0] || !strcmp(r->memory, "host")) &&
               kvb_region_check(str_or_empty(r->region), mc->auth_pid, r->region_bytes, why, sizeof why) != KVB_OK) {
        /* host memory: the region must be the registering process's own (a device handle is the memory
         * backend's to check: the coordinator has no device context) */
        st = KVB_ERR_INVALID;
        count_drop(c, KVB_DROP_AUTH, mc->printable, why);
    } else if (r->n_loans > KVB_LEDGER_MAX_LOANS) {
        snprintf(why, sizeof why, "%zu loans reported, at most %d", r->n_loans, KVB_LEDGER_MAX_LOANS);
        st = KVB_ERR_INVALID;
    } else if (r->n_loans && kvb_calloc(r->n_loans, sizeof *loans, (void **)&loans) != KVB_OK) {
        snprintf(why, sizeof why, "out of memory");
        st = KVB_ERR_NOMEM;
    }
    if (st == KVB_OK) {
        for (size_t i = 0; i < r->n_loans && st == KVB_OK; i++) {
            const Kvbank__Loan *w = r->loans[i];
            if (!w || strlen(str_or_empty(w->lender)) > KVB_LEDGER_NAME_MAX) {
                snprintf(why, sizeof why, "loan %zu is malformed", i);
                st = KVB_ERR_INVALID;
                break;
            }
            loans[i].id = w->loan_id;
            snprintf(loans[i].lender, sizeof loans[i].lender, "%s", str_or_empty(w->lender));
            loans[i].first_block = w->first_block;
            loans[i].n_blocks = w->n_blocks;
            loans[i].n_master_blocks = w->n_master_blocks;
            loans[i].offset = w->offset;
            loans[i].bytes = w->bytes;
            loans[i].epoch = w->epoch;
            loans[i].state = w->revoking ? KVB_LOAN_REVOKING : KVB_LOAN_ACTIVE;
        }
    }
    if (st == KVB_OK) {
        kvb_ledger_reg reg = {
            .name = name,
            .role = r->role == KVBANK__ROLE__ROLE_MASTER ? KVB_ROLE_MASTER : KVB_ROLE_WORKER,
            .pid = r->pid,
            .geom = {.n_layers = wire_int(r->geom->n_layers), .n_kv_heads = wire_int(r->geom->n_kv_heads),
                     .head_dim = wire_int(r->geom->head_dim), .block_size = wire_int(r->geom->block_size),
                     .elem_size = wire_int(r->geom->elem_size)},
            .region = str_or_empty(r->region),
            .region_bytes = r->region_bytes,
            .capacity = r->capacity,
            .n_own = r->n_own,
            .endpoint = str_or_empty(r->endpoint),
            .model = str_or_empty(r->model),
            .memory = str_or_empty(r->memory),
            .device = r->device,
            .stream = r->stream,
            .borrow_limited = r->borrow_limited,
            .max_borrow = r->max_borrow,
            .loans = loans,
            .n_loans = (int)r->n_loans,
        };
        pending_flush(c, name, 1); /* a registration reconciles everything: older Reclaimed are moot */
        st = kvb_ledger_register(c->ledger, &reg, now_ms(), why, sizeof why);
        if (st == KVB_OK) proc_verified(c, name, mc->auth_pid);
    }
    free(loans);
    if (st != KVB_OK) KVB_LOG_W("refused the registration of %s: %s", mc->printable, why);
    Kvbank__RegisterReply rr = KVBANK__REGISTER_REPLY__INIT;
    rr.ok = st == KVB_OK;
    rr.error = st == KVB_OK ? "" : why;
    rr.epoch = kvb_ledger_epoch(c->ledger);
    rr.heartbeat_ms = c->heartbeat_ms;
    rr.coordinator_id = c->id;
    if (st == KVB_OK) meus_of(c, name, &rr.meu_worker, &rr.meu_master, &rr.room_limited, &rr.lend_room);
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_REGISTER_REPLY;
    env.register_reply = &rr;
    reply(c, mc, &env);
}

static void handle_heartbeat(kvb_coord *c, const msg_ctx *mc, const Kvbank__Heartbeat *h) {
    if (strcmp(str_or_empty(h->name), mc->name) != 0) {
        count_drop(c, KVB_DROP_SENDER, mc->printable, "Heartbeat names another model");
        return;
    }
    kvb_ledger_hb hb = {.n_own = h->n_own, .n_used = h->n_used, .live_requests = h->live_requests,
                        .waiting_requests = h->waiting_requests, .max_need = h->max_need,
                        .tokens_generated = h->tokens_generated};
    int known = kvb_ledger_heartbeat(c->ledger, mc->name, &hb, now_ms());
    Kvbank__HeartbeatReply hr = KVBANK__HEARTBEAT_REPLY__INIT;
    hr.known = known != 0;
    hr.epoch = kvb_ledger_epoch(c->ledger);
    hr.coordinator_id = c->id;
    if (known) meus_of(c, mc->name, &hr.meu_worker, &hr.meu_master, &hr.room_limited, &hr.lend_room);
    else KVB_LOG_D("heartbeat of unknown model %s: asking it to register", mc->printable);
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_HEARTBEAT_REPLY;
    env.heartbeat_reply = &hr;
    reply(c, mc, &env);
    if (known && c->n_pending) pending_flush(c, mc->name, 0);
}

/* Maps a ledger status of a message that needs a registered sender: 1 when it was dropped. */
static int dropped_for_sender(kvb_coord *c, const msg_ctx *mc, kvb_status st, const char *what, const char *why) {
    char msg[320];
    snprintf(msg, sizeof msg, "%s: %s", what, why);
    if (st == KVB_ERR_NOT_FOUND) count_drop(c, KVB_DROP_UNREGISTERED, mc->printable, msg);
    else if (st == KVB_ERR_PROTOCOL) count_drop(c, KVB_DROP_ROLE, mc->printable, msg);
    else return 0;
    return 1;
}

/* The sender of a message that names its sender must be a live model of `role`: 1 if it is not (the
 * message was dropped and counted). */
static int check_sender(kvb_coord *c, const msg_ctx *mc, kvb_role role, const char *named, const char *what) {
    const kvb_ledger_model *m = mc->name[0] ? kvb_ledger_find(c->ledger, mc->name) : NULL;
    if (!m || !m->alive) {
        count_drop(c, KVB_DROP_UNREGISTERED, mc->printable, what);
        return 1;
    }
    if (m->role != role) {
        count_drop(c, KVB_DROP_ROLE, mc->printable, what);
        return 1;
    }
    if (named && strcmp(named, mc->name) != 0) {
        count_drop(c, KVB_DROP_SENDER, mc->printable, what);
        return 1;
    }
    return 0;
}

static void handle_lend_offer(kvb_coord *c, const msg_ctx *mc, const Kvbank__LendOffer *o) {
    if (check_sender(c, mc, KVB_ROLE_WORKER, str_or_empty(o->worker), "LendOffer")) return;
    char why[256] = "";
    kvb_loan loan;
    kvb_status st = kvb_ledger_offer(c->ledger, mc->name, o->first_block, o->n_blocks, now_ms(), &loan, why,
                                     sizeof why);
    if (dropped_for_sender(c, mc, st, "LendOffer", why)) return;
    Kvbank__LendResult lr = KVBANK__LEND_RESULT__INIT;
    Kvbank__Loan wl;
    lr.accepted = st == KVB_OK;
    if (st == KVB_OK) {
        loan_to_wire(&loan, &wl);
        lr.loan = &wl;
        lr.error = "";
    } else {
        KVB_LOG_W("refused the offer of %s (blocks [%" PRIu32 ", %" PRIu64 ")): %s", mc->name, o->first_block,
                  (uint64_t)o->first_block + o->n_blocks, why);
        lr.error = why;
    }
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_LEND_RESULT;
    env.lend_result = &lr;
    if (send_to(c, mc->sock, mc->ident, mc->ident_len, &env) != KVB_OK && st == KVB_OK) {
        /* The worker will not learn that its offer was taken: cancel the loan before its Grant goes out
         * (the queued GRANT finds it gone). The Reclaimed this queues reaches the worker when it is
         * back, and names the range it offered. */
        kvb_ledger_grant_undeliverable(c->ledger, loan.id, now_ms());
    }
}

static void handle_grant_ack(kvb_coord *c, const msg_ctx *mc, const Kvbank__GrantAck *g) {
    if (check_sender(c, mc, KVB_ROLE_MASTER, NULL, "GrantAck")) return;
    char why[256] = "";
    kvb_status st = kvb_ledger_grant_ack(c->ledger, mc->name, g->loan_id, g->ok, now_ms(), why, sizeof why);
    if (dropped_for_sender(c, mc, st, "GrantAck", why)) return;
    if (!g->ok) KVB_LOG_W("master %s could not map loan %" PRIu64 ": %s", mc->name, g->loan_id, str_or_empty(g->error));
    if (st != KVB_OK) KVB_LOG_I("GrantAck of loan %" PRIu64 " ignored: %s", g->loan_id, why);
}

static void handle_reclaim(kvb_coord *c, const msg_ctx *mc, const Kvbank__ReclaimRequest *r) {
    if (check_sender(c, mc, KVB_ROLE_WORKER, str_or_empty(r->worker), "ReclaimRequest")) return;
    char why[256] = "";
    uint32_t n = 0;
    kvb_status st = kvb_ledger_reclaim(c->ledger, mc->name, r->n_blocks, now_ms(), &n, why, sizeof why);
    if (dropped_for_sender(c, mc, st, "ReclaimRequest", why)) return;
    if (st != KVB_OK) KVB_LOG_I("ReclaimRequest of %s for %" PRIu32 " blocks: %s", mc->name, r->n_blocks, why);
    else KVB_LOG_I("worker %s asks for %" PRIu32 " blocks back: %" PRIu32 " being reclaimed", mc->name, r->n_blocks, n);
}

static void handle_revoke_ack(kvb_coord *c, const msg_ctx *mc, const Kvbank__RevokeAck *a) {
    if (check_sender(c, mc, KVB_ROLE_MASTER, NULL, "RevokeAck")) return;
    char why[256] = "";
    kvb_status st = kvb_ledger_revoke_ack(c->ledger, mc->name, a->loan_id, a->epoch, now_ms(), why, sizeof why);
    if (dropped_for_sender(c, mc, st, "RevokeAck", why)) return;
    if (st != KVB_OK) KVB_LOG_I("RevokeAck of loan %" PRIu64 " ignored: %s", a->loan_id, why);
    else KVB_LOG_D("RevokeAck loan %" PRIu64 ": %" PRIu32 " moved, %" PRIu32 " cached kept, %" PRIu32 " demoted, %"
                   PRIu32 " dropped, %" PRIu32 " preempted", a->loan_id, a->moved_blocks, a->kept_blocks,
                   a->demoted_blocks, a->dropped_blocks, a->preempted);
}

static void handle_status(kvb_coord *c, const msg_ctx *mc, const Kvbank__StatusRequest *s) {
    int nm = kvb_ledger_n_models(c->ledger), nl = s->ledger ? kvb_ledger_n_loans(c->ledger) : 0;
    Kvbank__ModelStatus *ms = NULL, **msp = NULL;
    Kvbank__KvGeometry *gs = NULL;
    Kvbank__Loan *ls = NULL, **lsp = NULL;
    Kvbank__StatusReply sr = KVBANK__STATUS_REPLY__INIT;
    if ((nm && (kvb_calloc((size_t)nm, sizeof *ms, (void **)&ms) != KVB_OK ||
                kvb_calloc((size_t)nm, sizeof *msp, (void **)&msp) != KVB_OK ||
                kvb_calloc((size_t)nm, sizeof *gs, (void **)&gs) != KVB_OK)) ||
        (nl && (kvb_calloc((size_t)nl, sizeof *ls, (void **)&ls) != KVB_OK ||
                kvb_calloc((size_t)nl, sizeof *lsp, (void **)&lsp) != KVB_OK))) {
        nm = nl = 0; /* out of memory: answer with the counters only */
    }
    uint64_t now = now_ms();
    for (int i = 0; i < nm; i++) {
        const kvb_ledger_model *m = kvb_ledger_model_at(c->ledger, i);
        Kvbank__ModelStatus *o = &ms[i];
        kvbank__model_status__init(o);
        geom_to_wire(&m->geom, &gs[i]);
        o->name = (char *)m->name;
        o->role = role_to_wire(m->role);
        o->pid = m->pid;
        o->alive = m->alive != 0;
        o->capacity = m->capacity;
        o->n_own = m->n_own;
        o->n_used = m->n_used;
        o->n_lent = m->role == KVB_ROLE_WORKER ? kvb_ledger_n_lent(c->ledger, m->name) : 0;
        o->n_borrowed = m->role == KVB_ROLE_MASTER && m->alive ? kvb_ledger_n_borrowed(c->ledger) : 0;
        o->live_requests = m->live_requests;
        o->waiting_requests = m->waiting_requests;
        o->last_heartbeat_ms = now > m->last_heartbeat_ms ? now - m->last_heartbeat_ms : 0;
        o->endpoint = m->endpoint;
        o->geom = &gs[i];
        if (m->role == KVB_ROLE_WORKER && m->has_meu) {
            o->meu = m->meu.meu_worker;
            o->meu_master = m->meu.meu_master;
        }
        o->draining = m->draining != 0;
        o->borrow_limited = m->borrow_limited != 0;
        o->max_borrow = m->max_borrow;
        o->tokens_generated = m->tokens_generated;
        o->model = m->model;
        o->memory = (char *)m->memory;
        o->device = m->device;
        o->lend_blocked = (char *)m->lend_blocked;
        o->lends = m->n_lends;
        o->reclaims = m->n_reclaims;
        o->lend_ms_total = m->lend_ms_total;
        o->reclaim_ms_total = m->reclaim_ms_total;
        msp[i] = o;
    }
    for (int i = 0; i < nl; i++) {
        loan_to_wire(kvb_ledger_loan_at(c->ledger, i), &ls[i]);
        lsp[i] = &ls[i];
    }
    sr.coordinator_id = c->id;
    sr.epoch = kvb_ledger_epoch(c->ledger);
    sr.n_models = (size_t)nm;
    sr.models = msp;
    sr.n_loans = (size_t)nl;
    sr.loans = lsp;
    sr.dropped_messages = c->stats.dropped_total;
    sr.auth_refused = c->stats.auth_refused;
    sr.uptime_ms = now - c->t0_ms;
    Kvbank__ChildState cs[KVB_LEDGER_MAX_MODELS + 2], *csp[KVB_LEDGER_MAX_MODELS + 2];
    for (int i = 0; i < c->n_children; i++) {
        const child_state *k = &c->children[i];
        kvbank__child_state__init(&cs[i]);
        cs[i].name = (char *)k->name;
        cs[i].state = (char *)k->state;
        cs[i].role = (char *)k->role;
        cs[i].last_exit = (char *)k->last_exit;
        cs[i].restarts = k->restarts;
        cs[i].attempts = k->attempts;
        cs[i].pid = k->pid;
        cs[i].age_ms = k->age_ms;
        csp[i] = &cs[i];
    }
    sr.n_children = (size_t)c->n_children;
    sr.children = csp;
    sr.children_report_ms = c->n_children && now > c->children_at_ms ? now - c->children_at_ms : 0;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_STATUS_REPLY;
    env.status_reply = &sr;
    reply(c, mc, &env);
    free(ms);
    free(msp);
    free(gs);
    free(ls);
    free(lsp);
}

/* kvbankd's NodeReport: kept (the last one only) for the status of models that did not register. Only
 * from the kvbankd that started this coordinator (a control connection of its pid). */
static void handle_node_report(kvb_coord *c, const msg_ctx *mc, const Kvbank__NodeReport *r) {
    if (mc->auth != AUTH_CTL || !c->supervisor || mc->auth_pid != c->supervisor) {
        count_drop(c, KVB_DROP_SENDER, mc->printable, "NodeReport not from this coordinator's kvbankd");
        return;
    }
    int n = 0;
    for (size_t i = 0; i < r->n_children && n < (int)KVB_ARRAY_LEN(c->children); i++) {
        const Kvbank__ChildState *k = r->children[i];
        child_state *o = &c->children[n++];
        snprintf(o->name, sizeof o->name, "%s", str_or_empty(k->name));
        snprintf(o->state, sizeof o->state, "%s", str_or_empty(k->state));
        snprintf(o->role, sizeof o->role, "%s", str_or_empty(k->role));
        snprintf(o->last_exit, sizeof o->last_exit, "%s", str_or_empty(k->last_exit));
        o->restarts = k->restarts;
        o->attempts = k->attempts;
        o->pid = k->pid;
        o->age_ms = k->age_ms;
    }
    c->n_children = n;
    c->children_at_ms = now_ms();
}

static void handle_control(kvb_coord *c, const msg_ctx *mc, const Kvbank__Control *ct) {
    char why[256] = "";
    kvb_status st = KVB_OK;
    const char *model = str_or_empty(ct->model);
    uint32_t n = 0;
    int n_loans = 0;
    uint64_t now = now_ms();
    switch (ct->op) {
    case KVBANK__CONTROL__OP__OP_LEND:
        st = kvb_ledger_lend_request(c->ledger, model, ct->n_blocks, why, sizeof why);
        if (st == KVB_OK) KVB_LOG_I("control from %s: asking %s to lend %" PRIu32 " blocks", mc->printable, model,
                                    ct->n_blocks);
        break;
    case KVBANK__CONTROL__OP__OP_RECLAIM: {
        const kvb_ledger_model *m = kvb_ledger_find(c->ledger, model);
        if (!m || !m->alive) {
            snprintf(why, sizeof why, "no live model %s", model);
            st = KVB_ERR_NOT_FOUND;
        } else if (m->role != KVB_ROLE_WORKER) {
            snprintf(why, sizeof why, "%s is not a worker", model);
            st = KVB_ERR_INVALID;
        } else if (ct->n_blocks == 0) {
            snprintf(why, sizeof why, "nothing to reclaim (0 blocks)");
            st = KVB_ERR_INVALID;
        } else {
            st = kvb_ledger_reclaim(c->ledger, model, ct->n_blocks, now, &n, why, sizeof why);
            if (st == KVB_OK) KVB_LOG_I("control from %s: reclaiming %" PRIu32 " blocks of %s (%" PRIu32 " in "
                                        "progress)", mc->printable, ct->n_blocks, model, n);
        }
        break;
    }
    case KVBANK__CONTROL__OP__OP_DRAIN:
        st = kvb_ledger_drain(c->ledger, model, now, &n_loans, why, sizeof why);
        if (st == KVB_OK) KVB_LOG_I("control from %s: draining %s (%d loan(s))", mc->printable, model, n_loans);
        break;
    case KVBANK__CONTROL__OP__OP_UNDRAIN:
        st = kvb_ledger_undrain(c->ledger, model, why, sizeof why);
        if (st == KVB_OK) KVB_LOG_I("control from %s: %s no longer drains", mc->printable, model);
        break;
    default:
        snprintf(why, sizeof why, "unknown control operation %d", (int)ct->op);
        st = KVB_ERR_INVALID;
        break;
    }
    if (st != KVB_OK) KVB_LOG_W("control from %s refused: %s", mc->printable, why);
    Kvbank__ControlReply cr = KVBANK__CONTROL_REPLY__INIT;
    cr.ok = st == KVB_OK;
    cr.error = st == KVB_OK ? "" : why;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_CONTROL_REPLY;
    env.control_reply = &cr;
    reply(c, mc, &env);
}

/* Messages only a model sends, about itself. */
static int is_model_message(Kvbank__Envelope__BodyCase b) {
    return b == KVBANK__ENVELOPE__BODY_REGISTER || b == KVBANK__ENVELOPE__BODY_HEARTBEAT ||
           b == KVBANK__ENVELOPE__BODY_LEND_OFFER || b == KVBANK__ENVELOPE__BODY_GRANT_ACK ||
           b == KVBANK__ENVELOPE__BODY_RECLAIM_REQUEST || b == KVBANK__ENVELOPE__BODY_REVOKE_ACK;
}

static void dispatch(kvb_coord *c, const msg_ctx *mc, const Kvbank__Envelope *env) {
    if (mc->auth == AUTH_NONE) { /* every connection logs in: cannot happen, but never trust it */
        count_drop(c, KVB_DROP_AUTH, mc->printable, "no authenticated identity");
        return;
    }
    if (is_model_message(env->body_case) && (mc->auth != AUTH_MODEL || strcmp(mc->auth_name, mc->name) != 0)) {
        char why[160];
        snprintf(why, sizeof why, "message type %d of model %s from a connection that logged in as %s",
                 (int)env->body_case, mc->name[0] ? mc->name : "?",
                 mc->auth == AUTH_CTL ? "a control client" : mc->auth_name);
        count_drop(c, KVB_DROP_AUTH, mc->printable, why);
        return;
    }
    switch (env->body_case) {
    case KVBANK__ENVELOPE__BODY_REGISTER: handle_register(c, mc, env->register_); break;
    case KVBANK__ENVELOPE__BODY_HEARTBEAT: handle_heartbeat(c, mc, env->heartbeat); break;
    case KVBANK__ENVELOPE__BODY_LEND_OFFER: handle_lend_offer(c, mc, env->lend_offer); break;
    case KVBANK__ENVELOPE__BODY_GRANT_ACK: handle_grant_ack(c, mc, env->grant_ack); break;
    case KVBANK__ENVELOPE__BODY_RECLAIM_REQUEST: handle_reclaim(c, mc, env->reclaim_request); break;
    case KVBANK__ENVELOPE__BODY_REVOKE_ACK: handle_revoke_ack(c, mc, env->revoke_ack); break;
    case KVBANK__ENVELOPE__BODY_STATUS_REQUEST: handle_status(c, mc, env->status_request); break;
    case KVBANK__ENVELOPE__BODY_CONTROL: handle_control(c, mc, env->control); break;
    case KVBANK__ENVELOPE__BODY_NODE_REPORT: handle_node_report(c, mc, env->node_report); break;
    default: {
        char why[64];
        snprintf(why, sizeof why, "message type %d is not for the coordinator", (int)env->body_case);
        count_drop(c, KVB_DROP_BODY, mc->printable, why);
        return;
    }
    }
    flush_actions(c);
}

/* Receives and handles one message. Returns 1 if one was handled, 0 if none was pending, -1 on a
 * socket error. */
static int handle_one(kvb_coord *c, void *sock) {
    zmq_msg_t id_msg, body_msg;
    zmq_msg_init(&id_msg);
    if (zmq_msg_recv(&id_msg, sock, ZMQ_DONTWAIT) < 0) {
        int e = errno;
        zmq_msg_close(&id_msg);
        if (e == EAGAIN || e == EINTR) return 0;
        KVB_LOG_E("zmq_msg_recv: %s", zmq_strerror(e));
        return -1;
    }
    c->stats.received++;
    int n_frames = 1, more = zmq_msg_more(&id_msg);
    zmq_msg_init(&body_msg);
    if (more) {
        /* the parts of a message arrive together: none of these waits */
        if (zmq_msg_recv(&body_msg, sock, ZMQ_DONTWAIT) >= 0) n_frames++;
        more = zmq_msg_more(&body_msg);
        while (more) {
            zmq_msg_t extra;
            zmq_msg_init(&extra);
            if (zmq_msg_recv(&extra, sock, ZMQ_DONTWAIT) < 0) more = 0;
            else n_frames++, more = zmq_msg_more(&extra);
            zmq_msg_close(&extra);
        }
    }
    msg_ctx mc = {.sock = sock, .ident = zmq_msg_data(&id_msg),
                  .ident_len = KVB_MIN(zmq_msg_size(&id_msg), (size_t)IDENT_MAX)};
    sender_name(mc.ident, mc.ident_len, mc.name);
    ident_str(mc.ident, mc.ident_len, mc.printable);
    parse_user_id(n_frames >= 2 ? zmq_msg_gets(&body_msg, "User-Id") : NULL, &mc);
    if (n_frames != 2) {
        char why[64];
        snprintf(why, sizeof why, "%d frames, a message is one envelope", n_frames - 1);
        count_drop(c, KVB_DROP_FRAMES, mc.printable, why);
    } else {
        Kvbank__Envelope *env = NULL;
        kvb_drop_reason r;
        size_t len = zmq_msg_size(&body_msg);
        if (kvb_coord_decode(zmq_msg_data(&body_msg), len, &env, &r) != KVB_OK) {
            char why[96];
            snprintf(why, sizeof why, "frame of %zu bytes", len);
            count_drop(c, r, mc.printable, why);
        } else {
            dispatch(c, &mc, env);
            kvbank__envelope__free_unpacked(env, NULL);
        }
    }
    zmq_msg_close(&body_msg);
    zmq_msg_close(&id_msg);
    return 1;
}

/* ------------------------------------------------------------------------------------ handshakes */

/* 1 if `s` can be a model's name (the ledger's rule: 1..64 of [A-Za-z0-9._-]). */
static int model_name_ok(const char *s) {
    size_t n = strlen(s);
    if (n == 0 || n > KVB_LEDGER_NAME_MAX) return 0;
    for (size_t i = 0; i < n; i++) {
        char ch = s[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '.' ||
              ch == '_' || ch == '-'))
            return 0;
    }
    return 1;
}

/* The ZAP handler's judgement of one handshake: 1 (with the connection's User-Id) or 0 (with why). */
static int zap_judge(kvb_coord *c, const kvb_zap_req *q, char *user_id, size_t uid_len, char *why, size_t why_len) {
    int ctl = !strcmp(q->domain, KVB_AUTH_ZAP_CTL);
    if ((!ctl && strcmp(q->domain, KVB_AUTH_ZAP_MODELS) != 0) || strcmp(q->mechanism, "PLAIN") != 0) {
        snprintf(why, why_len, "domain '%s', mechanism '%s'", q->domain, q->mechanism);
        return 0;
    }
    if (q->pid <= 0) {
        snprintf(why, why_len, "no peer credentials in the address '%s' (not an ipc:// connection)", q->address);
        return 0;
    }
    if (q->uid != (long)geteuid()) {
        snprintf(why, why_len, "pid %ld runs as uid %ld, the node as uid %u", q->pid, q->uid, (unsigned)geteuid());
        return 0;
    }
    /* A control client on the control endpoint only: on the models' one its routing id could take a
     * model's route (the routing id comes after the handshake). */
    if (ctl || !strcmp(q->user, KVB_AUTH_CTL_USER)) {
        if (!ctl || strcmp(q->user, KVB_AUTH_CTL_USER) != 0) {
            snprintf(why, why_len, "pid %ld: user '%.64s' on the %s endpoint (models log in on the models' endpoint, "
                     "control clients on the .ctl one)", q->pid, q->user, ctl ? "control" : "models'");
            return 0;
        }
        snprintf(user_id, uid_len, "c:%ld", q->pid);
        return 1;
    }
    if (!model_name_ok(q->user)) {
        snprintf(why, why_len, "pid %ld: '%.64s' is neither a model name nor the control user", q->pid, q->user);
        return 0;
    }
    char token[KVB_AUTH_TOKEN_LEN + 1];
    kvb_auth_token(c->auth.secret, q->user, token);
    int good = strlen(q->password) == KVB_AUTH_TOKEN_LEN && !kvb_memcmp_ct(q->password, token, KVB_AUTH_TOKEN_LEN);
    explicit_bzero(token, sizeof token);
    if (!good) {
        snprintf(why, why_len, "pid %ld: wrong token for model %s", q->pid, q->user);
        return 0;
    }
    long ppid = 0;
    if (c->supervisor && (kvb_proc_stat(q->pid, NULL, &ppid) != KVB_OK || ppid != c->supervisor)) {
        snprintf(why, why_len, "pid %ld logs in as model %s but kvbankd (pid %ld) did not start it (its parent is %ld)",
                 q->pid, q->user, c->supervisor, ppid);
        return 0;
    }
    snprintf(user_id, uid_len, "m:%ld:%s", q->pid, q->user);
    return 1;
}

/* Answers every waiting ZAP request. */
static void handle_zap(kvb_coord *c) {
    for (;;) {
        kvb_zap_req q;
        kvb_status st = kvb_zap_recv(c->zap, &q);
        if (st == KVB_ERR_NOT_FOUND) return;
        if (st != KVB_OK) continue; /* answered with a refusal */
        char user_id[KVB_LEDGER_NAME_MAX + 32] = "", why[256] = "";
        int ok = zap_judge(c, &q, user_id, sizeof user_id, why, sizeof why);
        explicit_bzero(q.password, sizeof q.password);
        if (ok) {
            KVB_LOG_D("handshake of pid %ld accepted as %s", q.pid, user_id);
        } else {
            uint64_t n = ++c->zap_refused;
            if (n <= 8 || (n & (n - 1)) == 0) KVB_LOG_W("refused a connection: %s (%" PRIu64 " so far)", why, n);
        }
        kvb_zap_reply(c->zap, &q, ok, user_id, why);
    }
}

/* Counts the handshakes that failed: wrong or no credentials (the ZAP handler refused), or a peer
 * that does not speak PLAIN at all. */
static void handle_monitor(kvb_coord *c, void *mon) {
    uint16_t ev;
    while (kvb_wire_monitor_event(mon, &ev)) {
        if (ev & (ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                  ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)) {
            c->stats.auth_refused++;
            if (ev != ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) { /* the ZAP handler logged its refusals */
                uint64_t n = ++c->zap_refused;
                if (n <= 8 || (n & (n - 1)) == 0)
                    KVB_LOG_W("refused a connection that does not log in (no PLAIN handshake; %" PRIu64 " so far)", n);
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------- lifecycle */

/* Fences a silent master before its loans go back to the lenders (see kvb_ledger_opts.fence): a
 * process that stopped heartbeating but still runs could be reading or writing lent blocks. Only a
 * process verified at its registration is signalled, through its pidfd. */
static void fence_kill(void *ud, const char *name, uint32_t pid) {
    kvb_coord *c = ud;
    verified_proc *v = proc_by_name(c, name);
    if (!v || v->pid != (long)pid || v->pidfd < 0) {
        KVB_LOG_E("not fencing %s (pid %" PRIu32 "): not the verified process of its registration", name, pid);
        return;
    }
    KVB_LOG_W("fencing master %s (pid %" PRIu32 "): silent while holding loans; SIGKILL before its loans are "
              "returned", name, pid);
    if (pidfd_send_signal(v->pidfd, SIGKILL, NULL, 0) != 0 && errno != ESRCH)
        KVB_LOG_E("pidfd_send_signal(%s, pid %" PRIu32 "): %s", name, pid, strerror(errno));
}

/* The ledger's liveness check of a model's pid: its pidfd when it registered (readable once it
 * exited), else kvb_pid_alive. */
static int pid_alive(void *ud, uint32_t pid) {
    kvb_coord *c = ud;
    verified_proc *v = proc_by_pid(c, (long)pid);
    if (v) {
        if (v->pidfd < 0) return 0;
        struct pollfd pf = {.fd = v->pidfd, .events = POLLIN};
        return poll(&pf, 1, 0) == 0;
    }
    return kvb_pid_alive((long)pid);
}

static void make_id(char out[40]) {
    uint8_t r[8];
    if (getrandom(r, sizeof r, GRND_NONBLOCK) != (ssize_t)sizeof r) {
        uint64_t x = kvb_wall_ns() ^ ((uint64_t)getpid() << 32);
        memcpy(r, &x, sizeof r);
    }
    int n = snprintf(out, 40, "%d-", (int)getpid());
    for (size_t i = 0; i < sizeof r && n < 38; i++) n += snprintf(out + n, (size_t)(40 - n), "%02x", r[i]);
}

/* Creates the missing directories of `path`'s parent, mode 0700. */
static kvb_status make_parent_dirs(const char *path) {
    char dir[PATH_MAX];
    size_t n = strlen(path);
    if (n >= sizeof dir) return KVB_ERR_INVALID;
    memcpy(dir, path, n + 1);
    char *slash = strrchr(dir, '/');
    if (!slash || slash == dir) return KVB_OK;
    *slash = '\0';
    struct stat sb;
    if (stat(dir, &sb) == 0) return S_ISDIR(sb.st_mode) ? KVB_OK : KVB_ERR_INVALID;
    for (char *p = dir + 1; *p; p++) {
        if (*p != '/') continue;
        *p = '\0';
        if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
            KVB_LOG_E("mkdir %s: %s", dir, strerror(errno));
            return KVB_ERR_IO;
        }
        *p = '/';
    }
    if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
        KVB_LOG_E("mkdir %s: %s", dir, strerror(errno));
        return KVB_ERR_IO;
    }
    KVB_LOG_I("created %s (mode 0700)", dir);
    return KVB_OK;
}

kvb_status kvb_coord_endpoint_dir(const char *endpoint) {
    if (!endpoint || strncmp(endpoint, "ipc://", 6) != 0 || endpoint[6] == '@' || endpoint[6] == '\0' ||
        !strcmp(endpoint + 6, "*"))
        return KVB_OK;
    return make_parent_dirs(endpoint + 6);
}

kvb_status kvb_coord_create(const kvb_coord_opts *opts, kvb_coord **out) {
    if (!opts || !opts->endpoint || !opts->endpoint[0] || !out) return KVB_ERR_INVALID;
    if (!opts->auth || !opts->auth->has_secret) {
        KVB_LOG_E("the coordinator needs the node secret (common/ipc/auth.h)");
        return KVB_ERR_INVALID;
    }
    if (strncmp(opts->endpoint, "ipc://", 6) != 0) {
        KVB_LOG_E("%s: the coordinator serves the processes of one node on ipc:// only (its peers' credentials "
                  "come from the kernel there; tcp:// would be open to every user of the machine)", opts->endpoint);
        return KVB_ERR_INVALID;
    }
    kvb_status st = KVB_OK;
    kvb_coord *c = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *c, (void **)&c));
    c->auth = *opts->auth;
    c->supervisor = opts->auth->from_supervisor ? (long)getppid() : 0;
    for (int i = 0; i < KVB_LEDGER_MAX_MODELS; i++) c->procs[i].pidfd = -1;
    c->heartbeat_ms = opts->heartbeat_ms ? opts->heartbeat_ms : 500;
    c->heartbeat_misses = opts->heartbeat_misses ? opts->heartbeat_misses : 4;
    c->tick_ms = KVB_MAX(10u, KVB_MIN(100u, c->heartbeat_ms / 4));
    make_id(c->id);
    kvb_ledger_opts lo = {.heartbeat_ms = c->heartbeat_ms, .heartbeat_misses = c->heartbeat_misses,
                          .pid_alive = opts->check_pids ? pid_alive : NULL,
                          .fence = opts->check_pids ? fence_kill : NULL, .pid_ud = c};
    KVB_TRY_GOTO(kvb_ledger_create(&lo, &c->ledger), fail);

    const char *ep = opts->endpoint;
    int is_ipc_file = !strncmp(ep, "ipc://", 6) && ep[6] != '@' && ep[6] != '\0' && strcmp(ep + 6, "*");
    if (is_ipc_file) {
        KVB_TRY_GOTO(make_parent_dirs(ep + 6), fail);
        if (access(ep + 6, F_OK) == 0 && kvb_wire_unix_live(ep + 6)) {
            KVB_LOG_E("%s: another process is listening there (a coordinator already runs?)", ep);
            st = KVB_ERR_STATE;
            goto fail;
        }
    }
    c->zctx = zmq_ctx_new();
    if (!c->zctx) {
        KVB_LOG_E("zmq_ctx_new: %s", zmq_strerror(errno));
        st = KVB_ERR_IO;
        goto fail;
    }
    /* The ZAP handler and the monitors of failed handshakes exist before the first connection can come. */
    int zero = 0;
    c->zap = zmq_socket(c->zctx, ZMQ_REP);
    c->mon = zmq_socket(c->zctx, ZMQ_PAIR);
    c->ctl_mon = zmq_socket(c->zctx, ZMQ_PAIR);
    if (!c->zap || !c->mon || !c->ctl_mon || zmq_setsockopt(c->zap, ZMQ_LINGER, &zero, sizeof zero) ||
        zmq_setsockopt(c->mon, ZMQ_LINGER, &zero, sizeof zero) ||
        zmq_setsockopt(c->ctl_mon, ZMQ_LINGER, &zero, sizeof zero) || zmq_bind(c->zap, ZAP_EP) != 0) {
        KVB_LOG_E("ZAP handler: %s", zmq_strerror(errno));
        st = KVB_ERR_IO;
        goto fail;
    }
    char ctl_ep[PATH_MAX + 16];
    KVB_TRY_GOTO(kvb_auth_ctl_endpoint(ep, ctl_ep, sizeof ctl_ep), fail);
    if (is_ipc_file && access(ctl_ep + 6, F_OK) == 0 && kvb_wire_unix_live(ctl_ep + 6)) {
        KVB_LOG_E("%s: another process is listening there (a coordinator already runs?)", ctl_ep);
        st = KVB_ERR_STATE;
        goto fail;
    }
    const int failed = ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                       ZMQ_EVENT_HANDSHAKE_FAILED_AUTH;
    kvb_wire_router rt;
    KVB_TRY_GOTO(kvb_wire_router_bind(c->zctx, ep, 1, KVB_AUTH_ZAP_MODELS, SEND_HWM, RECV_HARD_MAX, &rt), fail);
    c->sock = rt.sock;
    c->endpoint = rt.endpoint;
    c->ipc_path = rt.ipc_path;
    c->ipc_dev = rt.ipc_dev;
    c->ipc_ino = rt.ipc_ino;
    KVB_TRY_GOTO(kvb_wire_router_bind(c->zctx, ctl_ep, 0, KVB_AUTH_ZAP_CTL, SEND_HWM, RECV_HARD_MAX, &rt), fail);
    c->ctl = rt.sock;
    free(rt.endpoint);
    c->ctl_path = rt.ipc_path;
    c->ctl_dev = rt.ipc_dev;
    c->ctl_ino = rt.ipc_ino;
    if (zmq_socket_monitor(c->sock, MONITOR_EP, failed) != 0 || zmq_connect(c->mon, MONITOR_EP) != 0 ||
        zmq_socket_monitor(c->ctl, CTL_MONITOR_EP, failed) != 0 || zmq_connect(c->ctl_mon, CTL_MONITOR_EP) != 0) {
        KVB_LOG_E("zmq_socket_monitor: %s", zmq_strerror(errno));
        st = KVB_ERR_IO;
        goto fail;
    }
    c->t0_ms = now_ms();
    c->next_tick_ms = c->t0_ms + c->tick_ms;
    KVB_LOG_I("coordinator %s listening on %s (heartbeat %" PRIu32 " ms, dead after %" PRIu32 " misses%s; models "
              "log in with their token%s)", c->id, c->endpoint, c->heartbeat_ms, c->heartbeat_misses,
              opts->check_pids ? " or when its pid is gone" : "",
              c->supervisor ? " and must be children of kvbankd" : "");
    *out = c;
    return KVB_OK;
fail:
    kvb_coord_destroy(c);
    return st;
}

kvb_status kvb_coord_run(kvb_coord *c, volatile sig_atomic_t *stop) {
    if (!c || !stop) return KVB_ERR_INVALID;
    while (!*stop) {
        uint64_t now = now_ms();
        int timeout = now >= c->next_tick_ms ? 0 : (int)(c->next_tick_ms - now);
        zmq_pollitem_t its[5] = {{.socket = c->sock, .events = ZMQ_POLLIN},
                                 {.socket = c->ctl, .events = ZMQ_POLLIN},
                                 {.socket = c->zap, .events = ZMQ_POLLIN},
                                 {.socket = c->mon, .events = ZMQ_POLLIN},
                                 {.socket = c->ctl_mon, .events = ZMQ_POLLIN}};
        int rc = zmq_poll(its, 5, timeout);
        if (rc < 0) {
            if (errno == EINTR) continue;
            KVB_LOG_E("zmq_poll: %s", zmq_strerror(errno));
            return KVB_ERR_IO;
        }
        if (rc > 0 && (its[2].revents & ZMQ_POLLIN)) handle_zap(c);
        if (rc > 0 && (its[3].revents & ZMQ_POLLIN)) handle_monitor(c, c->mon);
        if (rc > 0 && (its[4].revents & ZMQ_POLLIN)) handle_monitor(c, c->ctl_mon);
        for (int k = 0; k < 2; k++) {
            if (rc <= 0 || !(its[k].revents & ZMQ_POLLIN)) continue;
            for (int i = 0; i < BATCH_MAX && !*stop; i++) {
                int r = handle_one(c, its[k].socket);
                if (r < 0) return KVB_ERR_IO;
                if (r == 0) break;
            }
        }
        now = now_ms();
        if (now >= c->next_tick_ms) {
            kvb_ledger_tick(c->ledger, now);
            flush_actions(c);
            /* forget Reclaimed kept for processes that are gone */
            for (int i = 0; i < c->n_pending; i++) {
                const kvb_ledger_model *m = kvb_ledger_find(c->ledger, c->pending[i].to);
                if (!m || !m->alive || m->pid != c->pending[i].pid) {
                    pending_flush(c, c->pending[i].to, 1);
                    i = -1; /* the array changed: look again from the start */
                }
            }
            c->next_tick_ms = now + c->tick_ms;
        }
    }
    return KVB_OK;
}

void kvb_coord_destroy(kvb_coord *c) {
    if (!c) return;
    if (c->sock && c->mon) zmq_socket_monitor(c->sock, NULL, 0);
    if (c->ctl && c->ctl_mon) zmq_socket_monitor(c->ctl, NULL, 0);
    if (c->mon) zmq_close(c->mon);
    if (c->ctl_mon) zmq_close(c->ctl_mon);
    if (c->zap) zmq_close(c->zap);
    if (c->sock) zmq_close(c->sock);
    if (c->ctl) zmq_close(c->ctl);
    for (int i = 0; i < KVB_LEDGER_MAX_MODELS; i++)
        if (c->procs[i].name[0] && c->procs[i].pidfd >= 0) close(c->procs[i].pidfd);
    explicit_bzero(&c->auth, sizeof c->auth);
    if (c->zctx) zmq_ctx_term(c->zctx);
    struct stat sb;
    if (c->ipc_path && stat(c->ipc_path, &sb) == 0 && sb.st_dev == c->ipc_dev && sb.st_ino == c->ipc_ino)
        unlink(c->ipc_path);
    if (c->ctl_path && stat(c->ctl_path, &sb) == 0 && sb.st_dev == c->ctl_dev && sb.st_ino == c->ctl_ino)
        unlink(c->ctl_path);
    if (c->t0_ms) { /* it ran */
        kvb_coord_stats *s = &c->stats;
        KVB_LOG_I("coordinator stopping: %" PRIu64 " messages in, %" PRIu64 " out (%" PRIu64 " not delivered), "
                  "%" PRIu64 " dropped (%" PRIu64 " frames, %" PRIu64 " oversized, %" PRIu64 " malformed, %" PRIu64
                  " version, %" PRIu64 " body, %" PRIu64 " unregistered, %" PRIu64 " role, %" PRIu64 " sender, %" PRIu64
                  " auth), %" PRIu64 " refused (handshakes and forged claims), %d loan(s) in the ledger", s->received,
                  s->sent, s->send_failed, s->dropped_total, s->dropped[0], s->dropped[1], s->dropped[2],
                  s->dropped[3], s->dropped[4], s->dropped[5], s->dropped[6], s->dropped[7], s->dropped[8],
                  s->auth_refused, kvb_ledger_n_loans(c->ledger));
    }
    kvb_ledger_destroy(c->ledger);
    free(c->pending);
    free(c->endpoint);
    free(c->ipc_path);
    free(c->ctl_path);
    free(c);
}

const char *kvb_coord_endpoint(const kvb_coord *c) { return c ? c->endpoint : NULL; }
const char *kvb_coord_id(const kvb_coord *c) { return c ? c->id : NULL; }

void kvb_coord_get_stats(const kvb_coord *c, kvb_coord_stats *out) {
    if (c && out) *out = c->stats;
}
