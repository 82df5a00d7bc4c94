/* kvbank — the model server: a ROUTER socket in front of one engine, single-threaded.
 *
 * Every live request has a slot. The engine knows a request by a server-assigned id that encodes its
 * slot, eid = (seq << SLOT_BITS) | slot, so engine events find their slot in O(1) and ids stay unique
 * (seq only grows). Clients know a request by (their ROUTER identity, their request_id); a small
 * chained hash table maps that pair to the slot.
 *
 * Engine events only buffer: tokens go into the slot, a finish is recorded, and the slot is put on the
 * dirty list. flush() runs outside kvb_engine_step (after each step and after each batch of input) and
 * turns every dirty slot into one TokenEvent. A send that fails because the client is gone (or stuck)
 * mutes all of that client's slots and queues their cancellation, which flush() performs after its
 * pass: the engine is never re-entered from inside its own callbacks.
 *
 * Fair admission. A request is not handed to the engine when it arrives: it waits in its client's
 * queue (a client is a routing id) and feed() passes queued requests to the engine while the engine
 * has fewer than FEED_WAITING requests waiting, each time from the client with the fewest requests in
 * the engine (ties go round-robin). One client with a thousand requests therefore delays another's
 * single request by at most one admission, not by its whole backlog. Each client may hold at most
 * max_per_client live requests (default a quarter of max_live: at least four clients always find
 * room); more are refused with KVB_ERR_EXHAUSTED naming that limit.
 *
 * A role (master, worker) adds its own sockets to the same zmq_poll and runs its hooks between steps
 * (kvb_server_set_hooks), so the process stays single-threaded and nothing the hooks do to the engine
 * (attach, detach, shrink, grow) can overlap a step. */
#include "common/ipc/server.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "common/ipc/wire.h"
#include "common/text/grammar.h"

#define IDENT_MAX 255                        /* ZeroMQ routing ids are 1..255 bytes */
#define SLOT_BITS 24                         /* low bits of an engine id: the slot */
#define SLOT_MASK ((UINT64_C(1) << SLOT_BITS) - 1)
#define POLL_IDLE_MS 100                     /* poll timeout while no request is live */
#define POLL_STUCK_MS 10                     /* ... while the live ones ran nothing in the last step (they
                                              * wait for KV blocks: new input or a loan wakes the poll) */
#define SEND_HWM 100000                      /* messages queued to one client before it counts as stuck */
#define RECV_HARD_MAX ((int64_t)64 << 20)    /* bytes: libzmq drops a peer that sends more in one message */
#define TOK_CAP0 4                           /* initial per-slot token buffer (tokens) */
#define CLOSE_LINGER_MS 250                  /* how long destroy waits for queued replies */
#define HOOK_ITEMS_MAX 15                    /* extra poll items a role may add */
#define FEED_WAITING 8                       /* feed the engine while fewer requests than this wait in it */
#define REQ_KEEP_IDS 4096                    /* a slot keeps a request buffer up to this many ids for reuse */
#define GRAMMAR_CACHE 64                     /* compiled grammars kept (least recently used dropped) */

typedef struct slot {
    int in_use;
    uint64_t eid;                 /* engine request id */
    uint64_t rid;                 /* the client's request_id */
    uint8_t ident[IDENT_MAX];     /* [ident_len] the client's routing id */
    size_t ident_len;
    uint64_t hash;                /* of (ident, rid) */
    int next;                     /* next slot in the same hash bucket, -1 ends the chain */
    int32_t *tok;                 /* [cap_tok] tokens produced since the last flush ([n_tok] valid) */
    uint64_t *t_ns;               /* [cap_tok] their wall-clock times, ns since the epoch */
    int n_tok, cap_tok;
    uint32_t first_index;         /* index of tok[0] in the request's output */
    uint32_t next_index;          /* index the next token should have */
    kvb_finish finish;            /* NONE while the engine runs the request */
    kvb_status err;               /* with finish == ERROR */
    int dirty;                    /* listed in kvb_server.dirty (at most once) */
    int mute;                     /* send nothing more: the client is gone or got its final event */
    int broken;                   /* a token could not be buffered: end the request with ERROR */
    int cancel_queued;            /* listed in kvb_server.cancels */
    int client;                   /* its client (index into kvb_server.clients) */
    int queued;                   /* waiting in its client's queue, not yet in the engine */
    int in_engine;                /* handed to the engine (engine events and cancels go there) */
    int q_prev, q_next;           /* the client's queue, oldest first (-1 ends it) */
    /* the request while queued: prompt then stop ids */
    int32_t *req;                 /* [cap_req] (n_prompt + n_stop valid) */
    int cap_req, n_prompt, n_stop, max_tokens, resume_index;
    double tbt_slo_ms;
    kvb_grammar_matcher *matcher; /* structured output, compiled at arrival; the engine's once added */
    kvb_sampling sampling;        /* sampling.logit_bias points to `bias` */
    kvb_logit_bias *bias;         /* [cap_bias] */
    size_t cap_bias;
    /* logprobs (sampling.logprobs) of the buffered tokens, parallel to tok */
    float *lp;                    /* [cap_lp] (n_tok valid) */
    int32_t *top_ids;             /* [cap_top] ([n_tok][sampling.top_logprobs] valid) */
    float *top_lp;                /* [cap_top] */
    size_t cap_lp, cap_top;
    /* prompt logprobs computed since the last flush: positions plp_first .. plp_first + n_plp - 1 */
    float *plp;                   /* [cap_plp] */
    int32_t *ptop_ids;            /* [cap_ptop] ([n_plp][sampling.top_logprobs] valid) */
    float *ptop_lp;               /* [cap_ptop] */
    size_t cap_plp, cap_ptop;
    int n_plp;
    uint32_t plp_first;
} slot;

/* A client: one routing id with at least one live request. */
typedef struct client {
    int in_use;
    uint8_t ident[IDENT_MAX];     /* [ident_len] */
    size_t ident_len;
    uint64_t hash;                /* of the identity */
    int next;                     /* next client in the same hash bucket, -1 ends the chain */
    int n_live;                   /* its slots, queued or in the engine */
    int n_engine;                 /* of which in the engine */
    int q_head, q_tail;           /* its queued slots, oldest first (-1: none) */
} client;

struct kvb_server {
    void *zctx;
    void *sock;                   /* ROUTER */
    char *endpoint;               /* as bound */
    char *ipc_path;               /* the socket file of an ipc:// endpoint, or NULL */
    dev_t ipc_dev;                /* and its identity, to remove only our own file */
    ino_t ipc_ino;
    char *model_name;
    int max_live;
    int max_per_client;           /* live requests one client may hold */
    int vocab;
    kvb_engine *engine;           /* borrowed */
    slot *slots;                  /* [max_live] */
    int *free_idx;                /* [max_live] stack of free slot indices, n_free valid */
    int n_free;
    int *buckets;                 /* [n_buckets] first slot of each hash chain, -1 when empty */
    int n_buckets;                /* power of two */
    int *dirty;                   /* [max_live] slots with events to send, n_dirty valid */
    int n_dirty;
    int *cancels;                 /* [max_live] slots to cancel in the engine, n_cancels valid */
    int n_cancels;
    int n_live;                   /* slots in use */
    client *clients;              /* [max_live] (a client holds at least one slot) */
    int *cl_free;                 /* [max_live] stack of free client indices, n_cl_free valid */
    int n_cl_free;
    int *cl_buckets;              /* [n_buckets] first client of each hash chain, -1 when empty */
    int n_queued;                 /* slots waiting in client queues */
    int rr;                       /* the client fed last (round-robin among equals) */
    uint64_t seq;                 /* last sequence number given to an engine id */
    kvb_server_stats stats;
    kvb_server_hooks hooks;       /* the role's sockets and callbacks (all zero: none) */
    /* structured output: the tokenizer's vocabulary and one cache of compiled grammars, loaded at the
     * first request that carries a grammar */
    char *model_dir;              /* NULL: grammars are refused */
    int gr_state;                 /* 0: not loaded yet, 1: loaded, -1: cannot be (gr_why says why) */
    char gr_why[384];
    kvb_grammar_vocab *gvocab;
    kvb_grammar_cache *gcache;
};

/* ------------------------------------------------------------------------------------------ helpers */

static uint64_t key_hash(const uint8_t *ident, size_t len, uint64_t rid) {
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a over the identity, then mixed with the id */
    for (size_t i = 0; i < len; i++) h = (h ^ ident[i]) * 0x100000001b3ull;
    h ^= rid + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h ^= h >> 31;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 29;
    return h;
}

/* Printable form of a routing id for logs: hex of its first bytes. */
static const char *ident_str(const uint8_t *ident, size_t len, char buf[36]) {
    size_t n = KVB_MIN(len, (size_t)16);
    for (size_t i = 0; i < n; i++) snprintf(buf + 2 * i, 3, "%02x", ident[i]);
    if (len > n) snprintf(buf + 2 * n, 4, "..");
    if (!len) snprintf(buf, 3, "-");
    return buf;
}

static Kvbank__FinishReason finish_to_wire(kvb_finish f) {
    switch (f) {
    case KVB_FINISH_NONE: return KVBANK__FINISH_REASON__FINISH_NONE;
    case KVB_FINISH_LENGTH: return KVBANK__FINISH_REASON__FINISH_LENGTH;
    case KVB_FINISH_STOP: return KVBANK__FINISH_REASON__FINISH_STOP;
    case KVB_FINISH_CANCELLED: return KVBANK__FINISH_REASON__FINISH_CANCELLED;
    case KVB_FINISH_ERROR: return KVBANK__FINISH_REASON__FINISH_ERROR;
    }
    return KVBANK__FINISH_REASON__FINISH_ERROR;
}

static slot *slot_by_eid(kvb_server *s, uint64_t eid) {
    uint64_t i = eid & SLOT_MASK;
    if (i >= (uint64_t)s->max_live) return NULL;
    slot *sl = &s->slots[i];
    return sl->in_use && sl->eid == eid ? sl : NULL;
}

/* The slot of a running request of (ident, rid), or -1. Finished and muted slots do not count. */
static int slot_find(kvb_server *s, const uint8_t *ident, size_t len, uint64_t rid) {
    uint64_t h = key_hash(ident, len, rid);
    for (int i = s->buckets[h & (uint64_t)(s->n_buckets - 1)]; i >= 0; i = s->slots[i].next) {
        slot *sl = &s->slots[i];
        if (sl->hash == h && sl->rid == rid && sl->ident_len == len && !memcmp(sl->ident, ident, len) &&
            sl->finish == KVB_FINISH_NONE && !sl->mute)
            return i;
    }
    return -1;
}

static uint64_t ident_hash(const uint8_t *ident, size_t len) { return key_hash(ident, len, 0); }

/* The client of routing id `ident`, or -1 when it has no live request. */
static int client_find(const kvb_server *s, const uint8_t *ident, size_t len) {
    uint64_t h = ident_hash(ident, len);
    for (int i = s->cl_buckets[h & (uint64_t)(s->n_buckets - 1)]; i >= 0; i = s->clients[i].next) {
        const client *cl = &s->clients[i];
        if (cl->hash == h && cl->ident_len == len && !memcmp(cl->ident, ident, len)) return i;
    }
    return -1;
}

/* The client of `ident`, made when it has none (there is always room: a client holds a slot, and the
 * caller checked that a slot is free). */
static int client_get(kvb_server *s, const uint8_t *ident, size_t len) {
    int i = client_find(s, ident, len);
    if (i >= 0) return i;
    i = s->cl_free[--s->n_cl_free];
    client *cl = &s->clients[i];
    memset(cl, 0, sizeof *cl);
    cl->in_use = 1;
    memcpy(cl->ident, ident, len);
    cl->ident_len = len;
    cl->hash = ident_hash(ident, len);
    cl->q_head = cl->q_tail = -1;
    int *head = &s->cl_buckets[cl->hash & (uint64_t)(s->n_buckets - 1)];
    cl->next = *head;
    *head = i;
    return i;
}

/* Forgets client `i` once it holds no request. */
static void client_put(kvb_server *s, int i) {
    client *cl = &s->clients[i];
    if (!cl->in_use || cl->n_live > 0) return;
    int *p = &s->cl_buckets[cl->hash & (uint64_t)(s->n_buckets - 1)];
    while (*p >= 0 && *p != i) p = &s->clients[*p].next;
    if (*p == i) *p = cl->next;
    cl->in_use = 0;
    s->cl_free[s->n_cl_free++] = i;
}

/* Appends slot i to its client's queue. */
static void q_push(kvb_server *s, int i) {
    slot *sl = &s->slots[i];
    client *cl = &s->clients[sl->client];
    sl->queued = 1;
    sl->q_next = -1;
    sl->q_prev = cl->q_tail;
    if (cl->q_tail >= 0) s->slots[cl->q_tail].q_next = i;
    else cl->q_head = i;
    cl->q_tail = i;
    s->n_queued++;
}

/* Takes slot i out of its client's queue. */
static void q_unlink(kvb_server *s, int i) {
    slot *sl = &s->slots[i];
    if (!sl->queued) return;
    client *cl = &s->clients[sl->client];
    if (sl->q_prev >= 0) s->slots[sl->q_prev].q_next = sl->q_next;
    else cl->q_head = sl->q_next;
    if (sl->q_next >= 0) s->slots[sl->q_next].q_prev = sl->q_prev;
    else cl->q_tail = sl->q_prev;
    sl->queued = 0;
    sl->q_prev = sl->q_next = -1;
    s->n_queued--;
}

/* Takes a free slot for (ident, rid) of client `ci` and gives it a fresh engine id. The caller checked
 * n_free > 0. */
static int slot_alloc(kvb_server *s, const uint8_t *ident, size_t len, uint64_t rid, int ci) {
    int i = s->free_idx[--s->n_free];
    slot *sl = &s->slots[i];
    sl->in_use = 1;
    sl->eid = (++s->seq << SLOT_BITS) | (uint64_t)i;
    sl->rid = rid;
    memcpy(sl->ident, ident, len);
    sl->ident_len = len;
    sl->hash = key_hash(ident, len, rid);
    int *head = &s->buckets[sl->hash & (uint64_t)(s->n_buckets - 1)];
    sl->next = *head;
    *head = i;
    sl->n_tok = 0;
    sl->first_index = sl->next_index = 0;
    sl->finish = KVB_FINISH_NONE;
    sl->err = KVB_OK;
    sl->mute = sl->broken = sl->cancel_queued = 0;
    sl->client = ci;
    sl->queued = sl->in_engine = 0;
    sl->q_prev = sl->q_next = -1;
    s->clients[ci].n_live++;
    /* `dirty` is left alone: a stale entry of a previous user may still be listed; flush copes. */
    s->n_live++;
    return i;
}

static void slot_free(kvb_server *s, int i) {
    slot *sl = &s->slots[i];
    if (!sl->in_use) return;
    int *p = &s->buckets[sl->hash & (uint64_t)(s->n_buckets - 1)];
    while (*p >= 0 && *p != i) p = &s->slots[*p].next;
    if (*p == i) *p = sl->next;
    q_unlink(s, i);
    client *cl = &s->clients[sl->client];
    if (sl->in_engine) cl->n_engine--;
    cl->n_live--;
    client_put(s, sl->client);
    sl->in_use = 0;
    sl->in_engine = 0;
    sl->eid = 0;
    sl->n_tok = 0;
    kvb_grammar_matcher_destroy(sl->matcher); /* still the slot's when the engine never took it */
    sl->matcher = NULL;
    if (sl->cap_req > REQ_KEEP_IDS) { /* a huge prompt's buffer is not kept around */
        free(sl->req);
        sl->req = NULL;
        sl->cap_req = 0;
    }
    s->free_idx[s->n_free++] = i;
    s->n_live--;
}

static void mark_dirty(kvb_server *s, int i) {
    if (s->slots[i].dirty) return;
    s->slots[i].dirty = 1;
    s->dirty[s->n_dirty++] = i;
}

static void queue_cancel(kvb_server *s, int i) {
    slot *sl = &s->slots[i];
    if (sl->cancel_queued || sl->finish != KVB_FINISH_NONE) return;
    sl->cancel_queued = 1;
    s->cancels[s->n_cancels++] = i;
}

/* Mutes every request of a client that cannot be reached any more and queues their cancellation. */
static void client_gone(kvb_server *s, const uint8_t *ident, size_t len, const char *why) {
    int n = 0;
    for (int i = 0; i < s->max_live; i++) {
        slot *sl = &s->slots[i];
        if (!sl->in_use || sl->mute || sl->ident_len != len || memcmp(sl->ident, ident, len)) continue;
        sl->mute = 1;
        n++;
        s->stats.disconnects++;
        if (sl->finish == KVB_FINISH_NONE) queue_cancel(s, i);
        else mark_dirty(s, i); /* finished but undelivered: flush frees it */
    }
    char b[36];
    if (n) KVB_LOG_I("client %s %s: cancelling %d request(s)", ident_str(ident, len, b), why, n);
    else KVB_LOG_D("client %s %s", ident_str(ident, len, b), why);
}

/* Sends `env` to a client. A client that is gone or does not read (its queue is full) is dropped. */
static kvb_status send_to(kvb_server *s, const uint8_t *ident, size_t len, Kvbank__Envelope *env) {
    kvb_status st = kvb_wire_send(s->sock, ident, len, env, 1);
    if (st == KVB_ERR_IO) {
        int e = errno;
        client_gone(s, ident, len,
                    e == EHOSTUNREACH ? "is gone" : e == EAGAIN ? "does not read its replies" : "cannot be sent to");
    }
    return st;
}

static void reply_error(kvb_server *s, const uint8_t *ident, size_t len, uint64_t rid, kvb_status code,
                        const char *fmt, ...) __attribute__((format(printf, 6, 7)));
static void reply_error(kvb_server *s, const uint8_t *ident, size_t len, uint64_t rid, kvb_status code,
                        const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    char b[36];
    KVB_LOG_W("rejecting request %" PRIu64 " of client %s: %s", rid, ident_str(ident, len, b), msg);
    Kvbank__ErrorReply er = KVBANK__ERROR_REPLY__INIT;
    er.request_id = rid;
    er.code = (int32_t)code;
    er.message = msg;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_ERROR;
    env.error = &er;
    s->stats.rejected++;
    send_to(s, ident, len, &env);
}

/* ------------------------------------------------------------------------------------ engine events */

static void ev_token(void *ud, uint64_t id, int index, int32_t token, uint64_t t_ns) {
    kvb_server *s = ud;
    slot *sl = slot_by_eid(s, id);
    if (!sl) {
        KVB_LOG_W("engine event for unknown request %" PRIu64 " ignored", id);
        return;
    }
    if (sl->mute || sl->broken) return;
    if (sl->finish != KVB_FINISH_NONE) {
        KVB_LOG_W("token after the finish of request %" PRIu64 " ignored", id);
        return;
    }
    uint32_t idx = index >= 0 ? (uint32_t)index : sl->next_index;
    if (idx != sl->next_index) KVB_LOG_W("request %" PRIu64 ": token index %d, expected %u", id, index, sl->next_index);
    if (sl->n_tok == sl->cap_tok) {
        int cap = sl->cap_tok ? 2 * sl->cap_tok : TOK_CAP0;
        if (kvb_realloc_array((void **)&sl->tok, (size_t)cap, sizeof *sl->tok) != KVB_OK ||
            kvb_realloc_array((void **)&sl->t_ns, (size_t)cap, sizeof *sl->t_ns) != KVB_OK) {
            sl->broken = 1; /* flush() ends it with ERROR */
            mark_dirty(s, (int)(sl - s->slots));
            return;
        }
        sl->cap_tok = cap;
    }
    if (sl->n_tok == 0) sl->first_index = idx;
    sl->tok[sl->n_tok] = token;
    sl->t_ns[sl->n_tok] = t_ns;
    sl->n_tok++;
    sl->next_index = idx + 1;
    mark_dirty(s, (int)(sl - s->slots));
}

/* Makes room for `need` elements of `size` bytes in *p (capacity *cap, doubling). */
static kvb_status reserve(void **p, size_t *cap, size_t need, size_t size) {
    if (need <= *cap) return KVB_OK;
    size_t c = KVB_MAX(need, 2 * *cap);
    KVB_TRY(kvb_realloc_array(p, c, size));
    *cap = c;
    return KVB_OK;
}

/* The same for two arrays of ids and floats that share a capacity. */
static kvb_status reserve_top(int32_t **ids, float **lp, size_t *cap, size_t need) {
    if (need <= *cap) return KVB_OK;
    size_t c = KVB_MAX(need, 2 * *cap);
    KVB_TRY(kvb_realloc_array((void **)ids, c, sizeof **ids));
    KVB_TRY(kvb_realloc_array((void **)lp, c, sizeof **lp));
    *cap = c;
    return KVB_OK;
}

/* The logprobs of the token ev_token buffers next (at n_tok). */
static void ev_logprobs(void *ud, uint64_t id, int index, float lp, const int32_t *top_ids, const float *top_lp,
                        int top_n) {
    kvb_server *s = ud;
    slot *sl = slot_by_eid(s, id);
    (void)index;
    if (!sl || sl->mute || sl->broken || sl->finish != KVB_FINISH_NONE) return;
    size_t k = (size_t)sl->n_tok, t = (size_t)sl->sampling.top_logprobs;
    if (top_n != (int)t || reserve((void **)&sl->lp, &sl->cap_lp, k + 1, sizeof *sl->lp) != KVB_OK ||
        reserve_top(&sl->top_ids, &sl->top_lp, &sl->cap_top, (k + 1) * t) != KVB_OK) {
        sl->broken = 1; /* flush() ends it with ERROR */
        mark_dirty(s, (int)(sl - s->slots));
        return;
    }
    sl->lp[k] = lp;
    if (t) {
        memcpy(sl->top_ids + k * t, top_ids, t * sizeof *top_ids);
        memcpy(sl->top_lp + k * t, top_lp, t * sizeof *top_lp);
    }
}

static void ev_prompt_logprobs(void *ud, uint64_t id, int pos0, int n, const float *lp, const int32_t *top_ids,
                               const float *top_lp, int top_n) {
    kvb_server *s = ud;
    slot *sl = slot_by_eid(s, id);
    if (!sl || sl->mute || sl->broken || sl->finish != KVB_FINISH_NONE || n <= 0) return;
    size_t k = (size_t)sl->n_plp, t = (size_t)sl->sampling.top_logprobs;
    if (sl->n_plp && (uint32_t)pos0 != sl->plp_first + (uint32_t)sl->n_plp)
        KVB_LOG_W("request %" PRIu64 ": prompt logprobs of position %d, expected %u", id, pos0,
                  sl->plp_first + (unsigned)sl->n_plp);
    if (top_n != (int)t || reserve((void **)&sl->plp, &sl->cap_plp, k + (size_t)n, sizeof *sl->plp) != KVB_OK ||
        reserve_top(&sl->ptop_ids, &sl->ptop_lp, &sl->cap_ptop, (k + (size_t)n) * t) != KVB_OK) {
        sl->broken = 1;
        mark_dirty(s, (int)(sl - s->slots));
        return;
    }
    if (!sl->n_plp) sl->plp_first = (uint32_t)pos0;
    memcpy(sl->plp + k, lp, (size_t)n * sizeof *lp);
    if (t) {
        memcpy(sl->ptop_ids + k * t, top_ids, (size_t)n * t * sizeof *top_ids);
        memcpy(sl->ptop_lp + k * t, top_lp, (size_t)n * t * sizeof *top_lp);
    }
    sl->n_plp += n;
    mark_dirty(s, (int)(sl - s->slots));
}

static void ev_finish(void *ud, uint64_t id, kvb_finish reason, kvb_status err) {
    kvb_server *s = ud;
    slot *sl = slot_by_eid(s, id);
    if (!sl) {
        KVB_LOG_W("finish of unknown request %" PRIu64 " ignored", id);
        return;
    }
    sl->finish = reason == KVB_FINISH_NONE ? KVB_FINISH_ERROR : reason;
    sl->err = err;
    if (reason == KVB_FINISH_ERROR)
        KVB_LOG_W("request %" PRIu64 " (client id %" PRIu64 ") failed: %s", id, sl->rid, kvb_status_str(err));
    mark_dirty(s, (int)(sl - s->slots));
}

kvb_engine_events kvb_server_engine_events(kvb_server *s) {
    kvb_engine_events ev = {.ud = s, .on_token = ev_token, .on_finish = ev_finish, .on_logits = NULL,
                            .on_logprobs = ev_logprobs, .on_prompt_logprobs = ev_prompt_logprobs};
    return ev;
}

void kvb_server_attach(kvb_server *s, kvb_engine *engine) {
    if (s) s->engine = engine;
}

/* ------------------------------------------------------------------------------------------- output */

/* Sends one TokenEvent for every dirty slot, frees finished ones, then cancels what client_gone (or a
 * broken buffer) queued; the cancellations' finish events make more slots dirty, hence the loop. */
static void flush(kvb_server *s) {
    while (s->n_dirty || s->n_cancels) {
        for (int k = 0; k < s->n_dirty; k++) {
            int i = s->dirty[k];
            slot *sl = &s->slots[i];
            sl->dirty = 0;
            if (!sl->in_use) continue;
            int final = sl->finish != KVB_FINISH_NONE;
            if (!sl->mute && (sl->n_tok > 0 || final || sl->broken || sl->n_plp > 0)) {
                kvb_finish f = sl->finish;
                if (sl->broken && !final) f = KVB_FINISH_ERROR;
                Kvbank__TokenEvent te = KVBANK__TOKEN_EVENT__INIT;
                te.request_id = sl->rid;
                te.first_index = sl->n_tok ? sl->first_index : sl->next_index;
                te.n_tokens = (size_t)sl->n_tok;
                te.tokens = sl->tok;
                te.n_t_ns = (size_t)sl->n_tok;
                te.t_ns = sl->t_ns;
                te.finish = finish_to_wire(f);
                if (sl->sampling.logprobs && sl->n_tok > 0) {
                    size_t t = (size_t)sl->sampling.top_logprobs;
                    te.n_logprobs = (size_t)sl->n_tok;
                    te.logprobs = sl->lp;
                    te.top_n = (uint32_t)t;
                    te.n_top_ids = te.n_top_logprobs = (size_t)sl->n_tok * t;
                    te.top_ids = sl->top_ids;
                    te.top_logprobs = sl->top_lp;
                }
                if (sl->n_plp > 0) {
                    size_t t = (size_t)sl->sampling.top_logprobs;
                    te.top_n = (uint32_t)t;
                    te.prompt_first = sl->plp_first;
                    te.n_prompt_logprobs = (size_t)sl->n_plp;
                    te.prompt_logprobs = sl->plp;
                    te.n_prompt_top_ids = te.n_prompt_top_logprobs = (size_t)sl->n_plp * t;
                    te.prompt_top_ids = sl->ptop_ids;
                    te.prompt_top_logprobs = sl->ptop_lp;
                }
                if (f == KVB_FINISH_ERROR && sl->err != KVB_OK) { /* say why (a stalled request: issue 10) */
                    te.error_code = (int32_t)sl->err;
                    te.error = (char *)kvb_status_str(sl->err);
                }
                Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
                env.body_case = KVBANK__ENVELOPE__BODY_TOKENS;
                env.tokens = &te;
                if (send_to(s, sl->ident, sl->ident_len, &env) == KVB_OK && f != KVB_FINISH_NONE) {
                    s->stats.completed++;
                    sl->mute = 1; /* its final event is out */
                }
            }
            sl->n_tok = 0;
            sl->n_plp = 0;
            if (final) slot_free(s, i);
            else if (sl->mute || sl->broken) queue_cancel(s, i);
        }
        s->n_dirty = 0;
        int n = s->n_cancels;
        s->n_cancels = 0;
        for (int k = 0; k < n; k++) {
            int i = s->cancels[k];
            slot *sl = &s->slots[i];
            sl->cancel_queued = 0;
            if (!sl->in_use || sl->finish != KVB_FINISH_NONE) continue;
            if (!sl->in_engine) { /* still queued: nothing to stop */
                q_unlink(s, i);
                sl->finish = KVB_FINISH_CANCELLED;
                mark_dirty(s, i);
                continue;
            }
            kvb_status st = s->engine ? kvb_engine_cancel(s->engine, sl->eid) : KVB_ERR_STATE;
            if (st != KVB_OK || sl->finish == KVB_FINISH_NONE) {
                /* The engine does not know it (or did not say it finished): end it here. */
                KVB_LOG_W("engine could not cancel request %" PRIu64 ": %s", sl->eid, kvb_status_str(st));
                sl->finish = KVB_FINISH_CANCELLED;
                mark_dirty(s, i);
            }
        }
    }
}

/* ------------------------------------------------------------------------------- structured output */

/* The vocabulary and the grammar cache, made at the first request with a grammar (a model that never
 * gets one never pays for its tokenizer here). The outcome is kept: a model without a tokenizer says
 * so to every such request. */
static kvb_status grammar_setup(kvb_server *s) {
    if (s->gr_state) return s->gr_state > 0 ? KVB_OK : KVB_ERR_UNSUPPORTED;
    s->gr_state = -1;
    if (!s->model_dir) {
        snprintf(s->gr_why, sizeof s->gr_why, "model '%s' has no tokenizer here: structured output needs one",
                 s->model_name);
        return KVB_ERR_UNSUPPORTED;
    }
    uint64_t t0 = kvb_now_ns();
    kvb_tokenizer *tok = NULL;
    kvb_status st = kvb_tokenizer_load(s->model_dir, &tok);
    if (st == KVB_ERR_NOT_FOUND) {
        snprintf(s->gr_why, sizeof s->gr_why, "model '%s' has no tokenizer (no tokenizer.json in %s): structured "
                 "output needs one", s->model_name, s->model_dir);
        return KVB_ERR_UNSUPPORTED;
    }
    if (st == KVB_OK) st = kvb_grammar_vocab_from_tokenizer(tok, &s->gvocab);
    kvb_tokenizer_destroy(tok);
    if (st == KVB_OK) st = kvb_grammar_cache_create(s->gvocab, GRAMMAR_CACHE, &s->gcache);
    if (st != KVB_OK) {
        snprintf(s->gr_why, sizeof s->gr_why, "the tokenizer of model '%s' cannot be used for structured output: %s",
                 s->model_name, kvb_status_str(st));
        KVB_LOG_E("%s", s->gr_why);
        return st;
    }
    s->gr_state = 1;
    KVB_LOG_I("structured output: %d tokens of %s's tokenizer ready in %.0f ms", kvb_grammar_vocab_size(s->gvocab),
              s->model_name, (double)(kvb_now_ns() - t0) / 1e6);
    return KVB_OK;
}

/* Compiles g's grammar (through the cache) into a matcher at the start of the output, replayed over the
 * tokens a resumed request already delivered. Why it cannot, in why[n]. */
static kvb_status grammar_matcher(kvb_server *s, const Kvbank__GenerateRequest *g, kvb_grammar_matcher **out,
                                  char *why, size_t n) {
    const Kvbank__Grammar *gr = g->grammar;
    if (grammar_setup(s) != KVB_OK) {
        snprintf(why, n, "%s", s->gr_why);
        return KVB_ERR_UNSUPPORTED;
    }
    if (gr->n_parts == 0 || gr->n_parts > KVB_WIRE_MAX_GRAMMAR_PARTS) {
        snprintf(why, n, "a grammar has 1 to %d parts, not %zu", KVB_WIRE_MAX_GRAMMAR_PARTS, gr->n_parts);
        return KVB_ERR_INVALID;
    }
    kvb_grammar_part parts[KVB_WIRE_MAX_GRAMMAR_PARTS];
    char **choices[KVB_WIRE_MAX_GRAMMAR_PARTS] = {0};
    kvb_status st = KVB_OK;
    for (size_t k = 0; k < gr->n_parts && st == KVB_OK; k++) {
        const Kvbank__GrammarPart *p = gr->parts[k];
        parts[k] = (kvb_grammar_part){.text = (const char *)p->text.data, .len = p->text.len};
        switch (p->kind) {
        case KVBANK__GRAMMAR_PART__KIND__LITERAL: parts[k].kind = KVB_GRAMMAR_LITERAL; break;
        case KVBANK__GRAMMAR_PART__KIND__JSON: parts[k].kind = KVB_GRAMMAR_JSON; break;
        case KVBANK__GRAMMAR_PART__KIND__JSON_OBJECT: parts[k].kind = KVB_GRAMMAR_JSON_OBJECT; break;
        case KVBANK__GRAMMAR_PART__KIND__JSON_SCHEMA: parts[k].kind = KVB_GRAMMAR_JSON_SCHEMA; break;
        case KVBANK__GRAMMAR_PART__KIND__REGEX: parts[k].kind = KVB_GRAMMAR_REGEX; break;
        case KVBANK__GRAMMAR_PART__KIND__CHOICE: parts[k].kind = KVB_GRAMMAR_CHOICE; break;
        default:
            snprintf(why, n, "grammar part %zu has an unknown kind %d", k, (int)p->kind);
            st = KVB_ERR_INVALID;
            continue;
        }
        if (parts[k].kind != KVB_GRAMMAR_CHOICE) continue;
        /* choices travel as bytes; the compiler takes NUL-terminated strings */
        if (p->n_choices == 0 || p->n_choices > INT_MAX ||
            kvb_calloc(p->n_choices, sizeof *choices[k], (void **)&choices[k]) != KVB_OK) {
            snprintf(why, n, "grammar part %zu: a choice needs at least one string", k);
            st = p->n_choices ? KVB_ERR_NOMEM : KVB_ERR_INVALID;
            continue;
        }
        for (size_t c = 0; c < p->n_choices && st == KVB_OK; c++) {
            const ProtobufCBinaryData *b = &p->choices[c];
            if (memchr(b->data, 0, b->len)) {
                snprintf(why, n, "grammar part %zu: choice %zu holds a NUL byte", k, c);
                st = KVB_ERR_INVALID;
            } else if ((st = kvb_malloc(b->len + 1, (void **)&choices[k][c])) == KVB_OK) {
                if (b->len) memcpy(choices[k][c], b->data, b->len);
                choices[k][c][b->len] = '\0';
            }
        }
        parts[k].choices = (const char *const *)choices[k];
        parts[k].n_choices = (int)p->n_choices;
    }
    kvb_grammar *gm = NULL;
    if (st == KVB_OK) {
        kvb_grammar_opts o;
        kvb_grammar_opts_default(&o);
        o.strict = !gr->lax;
        if (gr->compact) o.ws_indent = -1;
        st = kvb_grammar_cache_get(s->gcache, parts, (int)gr->n_parts, &o, &gm, why, n);
    }
    for (size_t k = 0; k < gr->n_parts; k++) {
        for (size_t c = 0; choices[k] && c < gr->parts[k]->n_choices; c++) free(choices[k][c]);
        free(choices[k]);
    }
    if (st != KVB_OK) return st;
    st = kvb_grammar_matcher_create(gm, out);
    kvb_grammar_release(gm);
    if (st != KVB_OK) {
        snprintf(why, n, "out of memory");
        return st;
    }
    /* a resumed request: the tokens already delivered are the prompt's last resume_index */
    for (size_t k = g->n_prompt_ids - g->resume_index; k < g->n_prompt_ids; k++) {
        if (kvb_grammar_matcher_accept_token(*out, g->prompt_ids[k]) != KVB_OK) {
            snprintf(why, n, "resumed token %zu (%d) does not continue the grammar's output",
                     k - (g->n_prompt_ids - g->resume_index), (int)g->prompt_ids[k]);
            kvb_grammar_matcher_destroy(*out);
            *out = NULL;
            return KVB_ERR_INVALID;
        }
    }
    return KVB_OK;
}

/* -------------------------------------------------------------------------------------------- input */

static void handle_generate(kvb_server *s, const uint8_t *ident, size_t len, const Kvbank__GenerateRequest *g) {
    uint64_t rid = g->request_id;
    if (rid == 0) {
        reply_error(s, ident, len, rid, KVB_ERR_INVALID, "request_id 0 is reserved");
        return;
    }
    if (g->n_prompt_ids == 0) {
        reply_error(s, ident, len, rid, KVB_ERR_INVALID, "empty prompt");
        return;
    }
    if (g->n_prompt_ids > INT_MAX || g->n_stop_ids > INT_MAX) {
        reply_error(s, ident, len, rid, KVB_ERR_INVALID, "too many token ids");
        return;
    }
    for (size_t k = 0; k < g->n_prompt_ids; k++) {
        int32_t t = g->prompt_ids[k];
        if (t < 0 || (s->vocab > 0 && t >= s->vocab)) {
            reply_error(s, ident, len, rid, KVB_ERR_INVALID, "prompt token %zu is %" PRId32 ", outside [0, %d)", k,
                        t, s->vocab);
            return;
        }
    }
    for (size_t k = 0; k < g->n_stop_ids; k++) {
        int32_t t = g->stop_ids[k];
        if (t < 0 || (s->vocab > 0 && t >= s->vocab)) {
            reply_error(s, ident, len, rid, KVB_ERR_INVALID, "stop id %zu is %" PRId32 ", outside [0, %d)", k, t,
                        s->vocab);
            return;
        }
    }
    if (g->max_tokens < 1 || g->max_tokens > INT_MAX) {
        reply_error(s, ident, len, rid, KVB_ERR_INVALID, "max_tokens is %" PRIu32 ", must be >= 1", g->max_tokens);
        return;
    }
    if (g->resume_index >= g->n_prompt_ids) {
        reply_error(s, ident, len, rid, KVB_ERR_INVALID, "resume_index %" PRIu32 " is not inside the prompt (%zu ids)",
                    g->resume_index, g->n_prompt_ids);
        return;
    }
    if (!(g->tbt_slo_ms >= 0 && g->tbt_slo_ms <= 3.6e6)) {
        reply_error(s, ident, len, rid, KVB_ERR_INVALID, "tbt_slo_ms %g must be in [0, 3600000] (0: the model's default)",
                    (double)g->tbt_slo_ms);
        return;
    }
    if (g->top_k > INT_MAX) {
        reply_error(s, ident, len, rid, KVB_ERR_INVALID, "top_k %" PRIu32 " is out of range", g->top_k);
        return;
    }
    if (g->min_tokens > INT_MAX || g->top_logprobs > INT_MAX || g->n_logit_bias > KVB_MAX_LOGIT_BIAS) {
        reply_error(s, ident, len, rid, KVB_ERR_INVALID, "min_tokens, top_logprobs or logit_bias out of range");
        return;
    }
    kvb_sampling sp = {.temperature = g->temperature, .top_k = (int)g->top_k, .top_p = g->top_p, .seed = g->seed,
                       .min_p = g->min_p, .presence_penalty = g->presence_penalty,
                       .frequency_penalty = g->frequency_penalty, .repetition_penalty = g->repetition_penalty,
                       .min_tokens = (int)g->min_tokens, .n_logit_bias = (int)g->n_logit_bias,
                       .logprobs = g->logprobs, .top_logprobs = (int)g->top_logprobs,
                       .prompt_logprobs = g->prompt_logprobs};
    kvb_logit_bias bias[KVB_MAX_LOGIT_BIAS];
    for (size_t k = 0; k < g->n_logit_bias; k++)
        bias[k] = (kvb_logit_bias){.id = g->logit_bias[k]->id, .bias = g->logit_bias[k]->bias};
    sp.logit_bias = bias;
    char why[160];
    if (kvb_sampling_check(&sp, s->vocab, why, sizeof why) != KVB_OK) {
        reply_error(s, ident, len, rid, KVB_ERR_INVALID, "bad sampling: %s", why);
        return;
    }
    if (slot_find(s, ident, len, rid) >= 0) {
        reply_error(s, ident, len, rid, KVB_ERR_INVALID, "request_id %" PRIu64 " is already live", rid);
        return;
    }
    int ci = client_find(s, ident, len);
    if (ci >= 0 && s->clients[ci].n_live >= s->max_per_client) {
        reply_error(s, ident, len, rid, KVB_ERR_EXHAUSTED,
                    "this client has %d live requests, the limit per client (max_live_per_client)",
                    s->clients[ci].n_live);
        return;
    }
    if (s->n_free == 0) {
        reply_error(s, ident, len, rid, KVB_ERR_EXHAUSTED, "the server has %d live requests, its limit", s->max_live);
        return;
    }
    kvb_grammar_matcher *matcher = NULL;
    if (g->grammar) {
        char gwhy[512];
        if (grammar_matcher(s, g, &matcher, gwhy, sizeof gwhy) != KVB_OK) {
            reply_error(s, ident, len, rid, KVB_ERR_INVALID, KVB_WIRE_GRAMMAR_ERROR "%s", gwhy);
            return;
        }
    }
    size_t n_ids = g->n_prompt_ids + g->n_stop_ids;
    ci = client_get(s, ident, len);
    int i = slot_alloc(s, ident, len, rid, ci);
    slot *sl = &s->slots[i];
    sl->matcher = matcher; /* slot_free destroys it from here on */
    if (sl->cap_tok == 0) {
        if (kvb_realloc_array((void **)&sl->tok, TOK_CAP0, sizeof *sl->tok) != KVB_OK ||
            kvb_realloc_array((void **)&sl->t_ns, TOK_CAP0, sizeof *sl->t_ns) != KVB_OK) {
            slot_free(s, i);
            reply_error(s, ident, len, rid, KVB_ERR_NOMEM, "out of memory");
            return;
        }
        sl->cap_tok = TOK_CAP0;
    }
    if (n_ids > (size_t)sl->cap_req) {
        if (n_ids > INT_MAX || kvb_realloc_array((void **)&sl->req, n_ids, sizeof *sl->req) != KVB_OK) {
            slot_free(s, i);
            reply_error(s, ident, len, rid, KVB_ERR_NOMEM, "out of memory");
            return;
        }
        sl->cap_req = (int)n_ids;
    }
    memcpy(sl->req, g->prompt_ids, g->n_prompt_ids * sizeof *sl->req);
    if (g->n_stop_ids) memcpy(sl->req + g->n_prompt_ids, g->stop_ids, g->n_stop_ids * sizeof *sl->req);
    sl->n_prompt = (int)g->n_prompt_ids;
    sl->n_stop = (int)g->n_stop_ids;
    sl->max_tokens = (int)g->max_tokens;
    sl->resume_index = (int)g->resume_index;
    sl->tbt_slo_ms = g->tbt_slo_ms;
    if (reserve((void **)&sl->bias, &sl->cap_bias, (size_t)sp.n_logit_bias, sizeof *sl->bias) != KVB_OK) {
        slot_free(s, i);
        reply_error(s, ident, len, rid, KVB_ERR_NOMEM, "out of memory");
        return;
    }
    if (sp.n_logit_bias) memcpy(sl->bias, bias, (size_t)sp.n_logit_bias * sizeof *bias);
    sp.logit_bias = sl->bias;
    sl->sampling = sp;
    sl->n_plp = 0;
    q_push(s, i);
    s->stats.accepted++;
    char b[36];
    KVB_LOG_D("request %" PRIu64 " of client %s: %zu prompt tokens, max %" PRIu32 ", queued (engine id %" PRIu64 ")",
              rid, ident_str(ident, len, b), g->n_prompt_ids, g->max_tokens, sl->eid);
}

/* Hands slot i (just taken out of its queue) to the engine; a refusal is the client's ErrorReply. */
static void engine_add(kvb_server *s, int i) {
    slot *sl = &s->slots[i];
    kvb_request r = {
        .id = sl->eid,
        .prompt = sl->req,
        .n_prompt = sl->n_prompt,
        .max_tokens = sl->max_tokens,
        .stop_ids = sl->n_stop ? sl->req + sl->n_prompt : NULL,
        .n_stop = sl->n_stop,
        .sampling = sl->sampling,
        .resume_index = sl->resume_index,
        .tbt_slo_ms = sl->tbt_slo_ms,
        .matcher = sl->matcher,
    };
    kvb_status st = kvb_engine_add(s->engine, &r);
    if (st == KVB_OK) sl->matcher = NULL; /* the engine's now */
    if (st != KVB_OK) {
        uint8_t ident[IDENT_MAX];
        size_t len = sl->ident_len;
        uint64_t rid = sl->rid;
        memcpy(ident, sl->ident, len);
        slot_free(s, i);
        s->stats.accepted--; /* counted as rejected instead */
        reply_error(s, ident, len, rid, st, "%s", st == KVB_ERR_INVALID ? kvb_engine_last_error(s->engine) : kvb_status_str(st));
        return;
    }
    sl->in_engine = 1;
    s->clients[sl->client].n_engine++;
    if (s->hooks.on_request) s->hooks.on_request(s->hooks.ud, &r);
}

/* Feeds queued requests to the engine while few wait in it for their turn, each from the client with
 * the fewest requests in the engine (round-robin among equals). Requests that wait for KV blocks the
 * pool does not hold now (stalled) do not count: the engine serves later ones past them, so a client
 * whose requests need more memory than the model has now does not hold up the others. */
static void feed(kvb_server *s) {
    while (s->n_queued > 0 && s->engine) {
        kvb_engine_stats es;
        kvb_engine_get_stats(s->engine, &es);
        if (es.n_waiting - es.n_stalled >= FEED_WAITING) return;
        int best = -1;
        for (int k = 1; k <= s->max_live; k++) {
            int ci = (s->rr + k) % s->max_live;
            const client *cl = &s->clients[ci];
            if (!cl->in_use || cl->q_head < 0) continue;
            if (best < 0 || cl->n_engine < s->clients[best].n_engine) best = ci;
        }
        if (best < 0) return; /* n_queued says otherwise: cannot happen */
        s->rr = best;
        int i = s->clients[best].q_head;
        q_unlink(s, i);
        engine_add(s, i);
    }
}

static void handle_cancel(kvb_server *s, const uint8_t *ident, size_t len, const Kvbank__CancelRequest *c) {
    int i = slot_find(s, ident, len, c->request_id);
    if (i < 0) {
        reply_error(s, ident, len, c->request_id, KVB_ERR_NOT_FOUND, "no live request %" PRIu64, c->request_id);
        return;
    }
    /* on_finish(CANCELLED) comes at once; the final TokenEvent goes out with the next flush. */
    queue_cancel(s, i);
}

static void handle_ping(kvb_server *s, const uint8_t *ident, size_t len, const Kvbank__Ping *p) {
    Kvbank__Pong pong = KVBANK__PONG__INIT;
    pong.nonce = p->nonce;
    pong.model = s->model_name;
    pong.live_requests = (uint32_t)s->n_live;
    if (s->engine) {
        kvb_engine_stats es;
        kvb_engine_get_stats(s->engine, &es);
        pong.running = (uint32_t)es.n_running;
        pong.waiting = (uint32_t)es.n_waiting;
        pong.prompt_tokens = es.prompt_tokens;
        pong.generated_tokens = es.generated_tokens;
        pong.preemptions = es.preemptions;
        pong.prefix_hit_tokens = es.prefix_hit_tokens;
        pong.blocks_total = (uint32_t)es.blocks_total;
        pong.blocks_free = (uint32_t)es.blocks_free;
        pong.blocks_own = (uint32_t)es.blocks_own;
        pong.blocks_borrowed = (uint32_t)es.blocks_borrowed;
    }
    pong.accepted = s->stats.accepted;
    pong.rejected = s->stats.rejected;
    pong.completed = s->stats.completed;
    pong.disconnects = s->stats.disconnects;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_PONG;
    env.pong = &pong;
    send_to(s, ident, len, &env);
}

/* Receives and handles one message. Returns 1 if one was handled, 0 if none was pending, -1 on a
 * socket error. */
static int handle_one(kvb_server *s) {
    zmq_msg_t id_msg, body_msg;
    zmq_msg_init(&id_msg);
    if (zmq_msg_recv(&id_msg, s->sock, ZMQ_DONTWAIT) < 0) {
        int e = errno;
        zmq_msg_close(&id_msg);
        if (e == EAGAIN || e == EINTR) return 0;
        KVB_LOG_E("zmq_msg_recv: %s", zmq_strerror(e));
        return -1;
    }
    int n_frames = 1;
    int more = zmq_msg_more(&id_msg);
    zmq_msg_init(&body_msg);
    if (more) {
        /* The parts of a message arrive together, so none of these waits. */
        if (zmq_msg_recv(&body_msg, s->sock, ZMQ_DONTWAIT) >= 0) n_frames++;
        more = zmq_msg_more(&body_msg);
        while (more) {
            zmq_msg_t extra;
            zmq_msg_init(&extra);
            if (zmq_msg_recv(&extra, s->sock, ZMQ_DONTWAIT) < 0) more = 0;
            else n_frames++, more = zmq_msg_more(&extra);
            zmq_msg_close(&extra);
        }
    }
    const uint8_t *ident = zmq_msg_data(&id_msg);
    size_t ident_len = KVB_MIN(zmq_msg_size(&id_msg), (size_t)IDENT_MAX);
    if (n_frames != 2) {
        s->stats.malformed++;
        reply_error(s, ident, ident_len, 0, KVB_ERR_PROTOCOL,
                    "a message is one envelope frame; got %d frames (dropped)", n_frames - 1);
        goto done;
    }
    char why[256];
    Kvbank__Envelope *env = NULL;
    if (kvb_wire_unpack(zmq_msg_data(&body_msg), zmq_msg_size(&body_msg), &env, why, sizeof why) != KVB_OK) {
        s->stats.malformed++;
        reply_error(s, ident, ident_len, 0, KVB_ERR_PROTOCOL, "%s", why);
        goto done;
    }
    switch (env->body_case) {
    case KVBANK__ENVELOPE__BODY_GENERATE: handle_generate(s, ident, ident_len, env->generate); break;
    case KVBANK__ENVELOPE__BODY_CANCEL: handle_cancel(s, ident, ident_len, env->cancel); break;
    case KVBANK__ENVELOPE__BODY_PING: handle_ping(s, ident, ident_len, env->ping); break;
    default:
        s->stats.malformed++;
        reply_error(s, ident, ident_len, 0, KVB_ERR_PROTOCOL, "a server does not accept message type %d",
                    (int)env->body_case);
        break;
    }
    kvbank__envelope__free_unpacked(env, NULL);
done:
    zmq_msg_close(&body_msg);
    zmq_msg_close(&id_msg);
    return 1;
}

/* ---------------------------------------------------------------------------------------- lifecycle */

kvb_status kvb_server_create(const kvb_server_opts *opts, kvb_server **out) {
    if (!opts || !opts->endpoint || !out) return KVB_ERR_INVALID;
    int max_live = opts->max_live > 0 ? opts->max_live : 1024;
    if ((uint64_t)max_live > SLOT_MASK || max_live > INT_MAX / 4) {
        KVB_LOG_E("max_live %d is too large", max_live);
        return KVB_ERR_INVALID;
    }
    kvb_status st = KVB_OK;
    kvb_server *s = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *s, (void **)&s));
    s->max_live = max_live;
    s->max_per_client = opts->max_per_client > 0 ? KVB_MIN(opts->max_per_client, max_live) : KVB_MAX(1, max_live / 4);
    s->vocab = opts->vocab > 0 ? opts->vocab : 0;
    s->n_buckets = 1;
    while (s->n_buckets < 2 * max_live) s->n_buckets *= 2;
    KVB_TRY_GOTO(kvb_strdup(opts->model_name ? opts->model_name : "", &s->model_name), fail);
    if (opts->model_dir) KVB_TRY_GOTO(kvb_strdup(opts->model_dir, &s->model_dir), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)max_live, sizeof *s->slots, (void **)&s->slots), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)max_live, sizeof *s->free_idx, (void **)&s->free_idx), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)max_live, sizeof *s->dirty, (void **)&s->dirty), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)max_live, sizeof *s->cancels, (void **)&s->cancels), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)s->n_buckets, sizeof *s->buckets, (void **)&s->buckets), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)max_live, sizeof *s->clients, (void **)&s->clients), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)max_live, sizeof *s->cl_free, (void **)&s->cl_free), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)s->n_buckets, sizeof *s->cl_buckets, (void **)&s->cl_buckets), fail);
    for (int b = 0; b < s->n_buckets; b++) s->buckets[b] = s->cl_buckets[b] = -1;
    for (int i = 0; i < max_live; i++) s->cl_free[i] = max_live - 1 - i;
    s->n_cl_free = max_live;
    for (int i = 0; i < max_live; i++) s->free_idx[i] = max_live - 1 - i; /* slot 0 first */
    s->n_free = max_live;

    s->zctx = zmq_ctx_new();
    if (!s->zctx) {
        KVB_LOG_E("zmq_ctx_new: %s", zmq_strerror(errno));
        st = KVB_ERR_IO;
        goto fail;
    }
    kvb_wire_router rt;
    KVB_TRY_GOTO(kvb_wire_router_bind(s->zctx, opts->endpoint, 0, NULL, SEND_HWM, RECV_HARD_MAX, &rt), fail);
    s->sock = rt.sock;
    s->endpoint = rt.endpoint;
    s->ipc_path = rt.ipc_path;
    s->ipc_dev = rt.ipc_dev;
    s->ipc_ino = rt.ipc_ino;
    KVB_LOG_D("server bound to %s (max %d live requests, %d per client)", s->endpoint, max_live, s->max_per_client);
    *out = s;
    return KVB_OK;
fail:
    kvb_server_destroy(s);
    return st;
}

kvb_status kvb_server_run(kvb_server *s, volatile sig_atomic_t *stop) {
    if (!s || !stop) return KVB_ERR_INVALID;
    if (!s->engine) {
        KVB_LOG_E("kvb_server_run: no engine attached");
        return KVB_ERR_STATE;
    }
    kvb_status result = KVB_OK;
    zmq_pollitem_t items[1 + HOOK_ITEMS_MAX]; /* [0]: the server's socket, then the role's */
    int wish_ms = -1;                         /* what on_tick asked for last time */
    int stuck = 0;                            /* the last step ran no forward pass */
    while (!*stop) {
        int busy = kvb_engine_n_live(s->engine) > 0 || s->n_queued > 0;
        int n_items = 1 + s->hooks.n_items;
        items[0] = (zmq_pollitem_t){.socket = s->sock, .fd = 0, .events = ZMQ_POLLIN, .revents = 0};
        for (int k = 0; k < s->hooks.n_items; k++) {
            items[1 + k] = s->hooks.items[k];
            items[1 + k].revents = 0;
        }
        /* requests that wait for blocks must not spin the loop (a stall lasts up to stall_wait_s) */
        long timeout = !busy ? POLL_IDLE_MS : stuck ? POLL_STUCK_MS : 0;
        if (timeout && wish_ms >= 0 && wish_ms < timeout) timeout = wish_ms;
        int rc = zmq_poll(items, n_items, timeout);
        if (rc < 0) {
            if (errno == EINTR) continue;
            KVB_LOG_E("zmq_poll: %s", zmq_strerror(errno));
            result = KVB_ERR_IO;
            break;
        }
        zmq_pollitem_t it = items[0];
        int hook_ready = 0;
        for (int k = 0; k < s->hooks.n_items; k++) {
            s->hooks.items[k].revents = items[1 + k].revents;
            if (items[1 + k].revents) hook_ready = 1;
        }
        /* The role's input first: a Revoke or a Grant takes effect before the next step. */
        if (hook_ready && s->hooks.on_ready) s->hooks.on_ready(s->hooks.ud);
        if (it.revents & ZMQ_POLLIN) {
            int h;
            while ((h = handle_one(s)) > 0) {
            }
            if (h < 0) {
                result = KVB_ERR_IO;
                break;
            }
        }
        if (s->hooks.on_tick) wish_ms = s->hooks.on_tick(s->hooks.ud);
        flush(s); /* cancellations produce finish events outside of steps */
        feed(s);
        flush(s); /* a request the engine refused */
        stuck = 0;
        if (kvb_engine_n_live(s->engine) > 0) {
            kvb_engine_stats es;
            kvb_engine_get_stats(s->engine, &es);
            uint64_t steps = es.steps;
            if (s->hooks.on_step_begin) s->hooks.on_step_begin(s->hooks.ud);
            kvb_status st = kvb_engine_step(s->engine);
            kvb_engine_get_stats(s->engine, &es);
            stuck = es.steps == steps;
            if (s->hooks.on_step_end) s->hooks.on_step_end(s->hooks.ud);
            flush(s); /* after a failed step too: every live request finished with ERROR */
            if (st != KVB_OK) {
                KVB_LOG_E("engine step failed: %s", kvb_status_str(st));
                result = KVB_ERR_BACKEND;
                break;
            }
        }
    }
    /* Leaving: end whatever is still live so that clients hear a finish rather than silence. */
    for (int i = 0; i < s->max_live; i++)
        if (s->slots[i].in_use && s->slots[i].finish == KVB_FINISH_NONE) queue_cancel(s, i);
    flush(s);
    return result;
}

void kvb_server_destroy(kvb_server *s) {
    if (!s) return;
    if (s->sock) {
        /* LINGER is 0 while serving; on the way out, give the last events (the FINISH_CANCELLED of
         * requests that were live at the stop) a moment to reach clients that are still there. */
        int linger = CLOSE_LINGER_MS;
        zmq_setsockopt(s->sock, ZMQ_LINGER, &linger, sizeof linger);
        zmq_close(s->sock);
    }
    if (s->zctx) zmq_ctx_term(s->zctx);
    /* libzmq (4.3) leaves an ipc:// socket file behind; remove it unless another process has bound
     * the same path since (then it is a different inode). */
    struct stat sb;
    if (s->ipc_path && stat(s->ipc_path, &sb) == 0 && S_ISSOCK(sb.st_mode) && sb.st_dev == s->ipc_dev &&
        sb.st_ino == s->ipc_ino)
        unlink(s->ipc_path);
    free(s->ipc_path);
    if (s->slots) {
        for (int i = 0; i < s->max_live; i++) {
            kvb_grammar_matcher_destroy(s->slots[i].matcher);
            free(s->slots[i].tok);
            free(s->slots[i].t_ns);
            free(s->slots[i].req);
            free(s->slots[i].bias);
            free(s->slots[i].lp);
            free(s->slots[i].top_ids);
            free(s->slots[i].top_lp);
            free(s->slots[i].plp);
            free(s->slots[i].ptop_ids);
            free(s->slots[i].ptop_lp);
        }
    }
    free(s->slots);
    free(s->free_idx);
    free(s->dirty);
    free(s->cancels);
    free(s->buckets);
    free(s->clients);
    free(s->cl_free);
    free(s->cl_buckets);
    kvb_grammar_cache_destroy(s->gcache);
    kvb_grammar_vocab_destroy(s->gvocab);
    free(s->model_dir);
    free(s->model_name);
    free(s->endpoint);
    free(s);
}

const char *kvb_server_endpoint(const kvb_server *s) { return s ? s->endpoint : NULL; }

kvb_status kvb_server_set_hooks(kvb_server *s, const kvb_server_hooks *h) {
    if (!s) return KVB_ERR_INVALID;
    if (!h) {
        memset(&s->hooks, 0, sizeof s->hooks);
        return KVB_OK;
    }
    if (h->n_items < 0 || h->n_items > HOOK_ITEMS_MAX || (h->n_items && !h->items)) {
        KVB_LOG_E("kvb_server_set_hooks: %d extra poll items (at most %d)", h->n_items, HOOK_ITEMS_MAX);
        return KVB_ERR_INVALID;
    }
    s->hooks = *h;
    return KVB_OK;
}

void kvb_server_get_stats(const kvb_server *s, kvb_server_stats *out) {
    if (!out) return;
    memset(out, 0, sizeof *out);
    if (s) *out = s->stats;
}
