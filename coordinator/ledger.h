/* kvbank — the coordinator's ledger: which models are registered, which blocks of which worker are lent
 * to the master, and what must be said to whom when that changes (docs/lending.md, "The
 * coordinator protocol"; SwiftCache §3.4-3.5).
 *
 * Pure logic: no sockets, no clocks, no signals. Every call takes the time (`now_ms`, any monotonic
 * millisecond clock) and the liveness of a pid comes from a callback, so that unit tests drive it
 * deterministically. Messages to send are queued as actions (kvb_ledger_pop_action) in the order in
 * which they must go out; the daemon (coordinator.c) turns them into Envelopes.
 *
 * Loans. A loan is a contiguous range [first_block, first_block + n_blocks) of a worker's own blocks,
 * n_blocks a multiple of the pair's worker MEU, holding n_master_blocks = n_blocks / MEU_w * MEU_m master
 * blocks from byte first_block * worker_block_bytes of the worker's region. Its life:
 *
 *   offer accepted ──► GRANTING ──GrantAck(ok)──► ACTIVE ──reclaim/drain/lender death──► REVOKING
 *        (Grant to the master)  │                                  (Revoke to the master)   │
 *                               └─GrantAck(!ok) / undeliverable─► deleted, Reclaimed        └─RevokeAck─► deleted,
 *                                                                   to the lender                  Reclaimed to the lender
 *
 * A lender never gets Reclaimed for a loan the master may still touch: only after the master's
 * RevokeAck, a failed grant, or the master's death. After a coordinator restart, loans come back with
 * the models' Register messages; a loan reported by one side only is UNCONFIRMED until the other side
 * registers (or its grace period ends), see kvb_ledger_register.
 *
 * The epoch counts ledger changes: it grows by one whenever a loan is created, changes state or is
 * deleted (and never goes back below an epoch reported by a re-registering model). */
#ifndef KVB_COORD_LEDGER_H
#define KVB_COORD_LEDGER_H

#include <stddef.h>
#include <stdint.h>

#include "common/policy/swiftcache.h"
#include "common/util/node_config.h"
#include "common/util/util.h"
#include "kernels/backend.h"

#define KVB_LEDGER_NAME_MAX 64      /* model names: 1..64 of [A-Za-z0-9._-] */
#define KVB_LEDGER_REGION_MAX 512   /* region handle (shm name, or a device IPC handle in hex) */
#define KVB_LEDGER_TEXT_MAX 1024    /* endpoint and model strings */
#define KVB_LEDGER_MEMORY_MAX 15    /* memory kind ("host", a device kind) */
#define KVB_LEDGER_MAX_MODELS 256   /* registered models (dead ones included) */
#define KVB_LEDGER_MAX_LOANS 65536

typedef struct kvb_ledger kvb_ledger;

typedef enum kvb_loan_state {
    KVB_LOAN_GRANTING = 0,    /* accepted; Grant sent, GrantAck awaited */
    KVB_LOAN_ACTIVE = 1,      /* mapped by the master */
    KVB_LOAN_REVOKING = 2,    /* Revoke sent, RevokeAck awaited; the lender gets Reclaimed after it */
    KVB_LOAN_UNCONFIRMED = 3, /* re-registration: reported by one side only, the other has not registered */
} kvb_loan_state;

const char *kvb_loan_state_str(kvb_loan_state s);

/* One loan (plain data; the ledger hands out copies or const pointers valid until its next change). */
typedef struct kvb_loan {
    uint64_t id;
    char lender[KVB_LEDGER_NAME_MAX + 1];
    uint32_t lender_pid;      /* the lender process the loan belongs to */
    int orphan;               /* that process is gone or disowned the loan: its lender gets no Reclaimed */
    uint32_t first_block;     /* lender blocks [first_block, first_block + n_blocks) */
    uint32_t n_blocks;
    uint32_t n_master_blocks; /* master blocks the range holds */
    uint64_t offset;          /* bytes: first_block * lender block bytes */
    uint64_t bytes;           /* bytes: n_blocks * lender block bytes */
    uint64_t epoch;           /* epoch at which it was granted */
    kvb_loan_state state;
    int lender_dead;          /* REVOKING: the master must read nothing from it */
    uint64_t revoke_epoch;    /* REVOKING: epoch of the Revoke */
    uint64_t t_sent_ms;       /* when the last Grant / Revoke for it went out (ack timeouts) */
    uint64_t t_offer_ms;      /* when the offer was accepted (lend latency: until the GrantAck) */
    uint64_t t_revoke_ms;     /* REVOKING: when the revocation began (reclaim latency: until the RevokeAck) */
    uint32_t revoke_blocks;   /* REVOKING: lender blocks given back from first_block on (a partial reclaim,
                               * whole MEUs); 0 or n_blocks: the whole loan */
    uint64_t min_ack_epoch;   /* REVOKING: a RevokeAck older than this answers a narrower Revoke: ignored */
    int by_master, by_worker; /* UNCONFIRMED: which side reported it */
    uint64_t deadline_ms;     /* UNCONFIRMED: end of the grace period */
} kvb_loan;

/* A registered model (plain data, owned by the ledger). */
typedef struct kvb_ledger_model {
    char name[KVB_LEDGER_NAME_MAX + 1];
    kvb_role role;
    uint32_t pid;             /* 0: unknown (not checked) */
    int alive;
    int draining;             /* worker: lends no more; master: borrows no more */
    kvb_kv_geom geom;
    char *region;             /* region handle */
    uint64_t region_bytes;
    uint32_t capacity;        /* blocks the region holds */
    uint32_t n_own;           /* blocks the model uses itself (last Register or Heartbeat) */
    char *endpoint;           /* request endpoint */
    char *model;              /* informational */
    uint64_t registered_ms;
    uint64_t last_heartbeat_ms;
    uint32_t n_used, live_requests, waiting_requests, max_need; /* from the last Heartbeat */
    uint64_t tokens_generated;
    /* worker: loans that became active (offer accepted -> master's GrantAck) and loans given back
     * after a revocation (Revoke -> RevokeAck), with the sums of those latencies in ms */
    uint64_t n_lends, n_reclaims, lend_ms_total, reclaim_ms_total;
    char memory[KVB_LEDGER_MEMORY_MAX + 1]; /* memory kind of its region ("host", or a device kind) */
    uint32_t device;          /* device of its region */
    int stream;               /* master: streams lent blocks into its LSC (1) or reads them in place (0) */
    int borrow_limited;       /* master: its LSC lies within its budget and streams at most max_borrow */
    uint32_t max_borrow;      /* master blocks (issue 10; SwiftCache §3.3 Eq. 4-5) */
    char lend_blocked[512];   /* worker: why it cannot lend to the live master ("" when it can) */
    int has_meu;              /* worker: an MEU with the live master exists */
    kvb_meu meu;              /* worker: the pair's MEU with the live master */
    char death[128];          /* why it was declared dead ("" while alive) */
} kvb_ledger_model;

/* What a Register says (borrowed strings; the ledger copies what it keeps). */
typedef struct kvb_ledger_reg {
    const char *name;
    kvb_role role;
    uint32_t pid;
    kvb_kv_geom geom;
    const char *region;
    uint64_t region_bytes;
    uint32_t capacity;
    uint32_t n_own;
    const char *endpoint;
    const char *model;
    const char *memory;       /* memory kind of the region (NULL or "": "host") */
    uint32_t device;
    int stream;               /* master: lent blocks are streamed into its LSC */
    int borrow_limited;       /* master: it can attach at most max_borrow master blocks (its LSC within its
                               * budget); refused from a worker, above 2^30 or below its reported loans */
    uint32_t max_borrow;
    /* Loans the process holds now: id, lender, first_block, n_blocks, n_master_blocks, epoch and
     * state == KVB_LOAN_REVOKING for `revoking` are read; the rest is ignored. */
    const kvb_loan *loans;
    int n_loans;
} kvb_ledger_reg;

typedef enum kvb_ledger_action_kind {
    KVB_ACT_GRANT = 0,        /* to the master: map `loan` (the lender's region: kvb_ledger_find(loan.lender)) */
    KVB_ACT_REVOKE = 1,       /* to the master: stop using `loan`; lender_dead: read nothing from it */
    KVB_ACT_RECLAIMED = 2,    /* to the lender: `loan`'s blocks are its own again */
    KVB_ACT_LEND_REQUEST = 3, /* to a worker: lend n_blocks if you can; drain: you are draining */
} kvb_ledger_action_kind;

typedef struct kvb_ledger_action {
    kvb_ledger_action_kind kind;
    char to[KVB_LEDGER_NAME_MAX + 1]; /* receiver: a model name (its routing id) */
    kvb_loan loan;            /* GRANT, REVOKE, RECLAIMED: a copy of the loan */
    uint64_t epoch;           /* REVOKE: the revoke's epoch; RECLAIMED: the epoch of the deletion */
    int lender_dead;          /* REVOKE */
    uint32_t n_blocks;        /* LEND_REQUEST */
    int drain;                /* LEND_REQUEST */
} kvb_ledger_action;

/* Returns nonzero when process `pid` exists (the daemon: kill(pid, 0) and not a zombie). */
typedef int (*kvb_pid_alive_fn)(void *ud, uint32_t pid);

typedef struct kvb_ledger_opts {
    uint32_t heartbeat_ms;     /* models heartbeat this often (> 0) */
    uint32_t heartbeat_misses; /* silent for misses * heartbeat_ms: dead (> 0) */
    kvb_pid_alive_fn pid_alive; /* NULL: pids are not checked */
    void *pid_ud;
    /* Fencing: called for a silent master that holds loans while its pid is alive. Its lenders may only
     * get their blocks back once it cannot touch them, so instead of declaring it dead at once the
     * ledger asks for it to be stopped (the coordinator sends SIGKILL; kvbankd restarts it) and waits
     * for the pid check to see it gone. NULL: a silent master is declared dead like any model. */
    void (*fence)(void *ud, const char *name, uint32_t pid);
} kvb_ledger_opts;

/* Caller owns the result (kvb_ledger_destroy). KVB_ERR_INVALID for zero heartbeat settings. */
kvb_status kvb_ledger_create(const kvb_ledger_opts *opts, kvb_ledger **out);
void kvb_ledger_destroy(kvb_ledger *l);

/* ------------------------------------------------------------------------------------- messages
 * Each returns KVB_OK when the message was applied. On a refusal it returns an error, leaves the
 * ledger unchanged and writes the reason into why[why_len] (may be NULL). A message from a sender
 * that is not a live registered model returns KVB_ERR_NOT_FOUND; from a model of the wrong role,
 * KVB_ERR_PROTOCOL: the daemon drops and counts those. */

/* Register (flow 1, and re-registration after a restart, flow 5). Refused (KVB_ERR_INVALID) for a bad
 * name, geometry or size; (KVB_ERR_STATE) for a second live master or a name held by another live pid.
 * A model that registers again (same pid, e.g. after a coordinator restart or after being declared
 * dead while it was only slow) reconciles its loans:
 *   - reported by both sides: kept (a loan the master reports as revoking gets its Revoke again);
 *   - reported by the worker alone: returned to it (Reclaimed) once the master has registered without
 *     it, or when no master registers within the master's grace period (30 s at least);
 *   - reported by the master alone: revoked as lender_dead once the lender has registered without it,
 *     or when it does not register within the silence limit (heartbeat_ms * heartbeat_misses);
 *   - known to the ledger but not reported by the registering model: it does not hold it; if that
 *     model is the master the lender gets its blocks back, if it is the lender the master is told to
 *     drop them (lender_dead).
 * A model with a new pid replaces a dead one of the same name (its loans were handled at its death). */
kvb_status kvb_ledger_register(kvb_ledger *l, const kvb_ledger_reg *r, uint64_t now_ms, char *why, size_t why_len);

typedef struct kvb_ledger_hb {
    uint32_t n_own, n_used, live_requests, waiting_requests, max_need;
    uint64_t tokens_generated;
} kvb_ledger_hb;

/* Heartbeat. Returns 1 when `name` is a live registered model (and records the numbers), 0 when it
 * must register again. */
int kvb_ledger_heartbeat(kvb_ledger *l, const char *name, const kvb_ledger_hb *hb, uint64_t now_ms);

/* LendOffer of worker `worker` (flow 3). Refused (KVB_ERR_STATE / KVB_ERR_INVALID, reason in why) when
 * there is no live master, the worker or the master drains, the worker's region cannot serve the
 * master's plan (another memory kind; on a device, another device while the master reads lent blocks
 * in place), the pair has no MEU, n_blocks is not a
 * positive multiple of the worker's MEU, the range leaves the region, or it overlaps a loan. On
 * acceptance *loan (may be NULL) gets the new loan and a GRANT action is queued. */
kvb_status kvb_ledger_offer(kvb_ledger *l, const char *worker, uint32_t first_block, uint32_t n_blocks,
                            uint64_t now_ms, kvb_loan *loan, char *why, size_t why_len);

/* GrantAck from `master`. ok: the loan becomes ACTIVE (or stays REVOKING). !ok: the loan is cancelled
 * and its lender gets Reclaimed. KVB_ERR_NOT_FOUND for an unknown loan (ignored: e.g. already gone). */
kvb_status kvb_ledger_grant_ack(kvb_ledger *l, const char *master, uint64_t loan_id, int ok, uint64_t now_ms,
                                char *why, size_t why_len);

/* The Grant of `loan_id` could not be delivered (the master is not connected): the master never saw
 * it, so the loan is cancelled and its lender gets Reclaimed. */
kvb_status kvb_ledger_grant_undeliverable(kvb_ledger *l, uint64_t loan_id, uint64_t now_ms);

/* ReclaimRequest of `worker` (flow 4), or Control(RECLAIM). `n_blocks` is what the worker wants back
 * in all: blocks of its loans already being reclaimed count toward it. The worker's other loans are
 * revoked lowest first_block first until n_blocks are on their way back (or none is left); the last
 * one only in part when less than all of it is needed: its first blocks, rounded up to whole worker
 * MEUs (issue 10: a small reclaim no longer takes back a large loan). After the master's RevokeAck
 * the loan keeps the rest (ACTIVE again) and the lender gets Reclaimed for the part. *n_revoking (may be NULL) gets the blocks now being reclaimed (old and new). KVB_ERR_STATE
 * when the worker has nothing lent. */
kvb_status kvb_ledger_reclaim(kvb_ledger *l, const char *worker, uint32_t n_blocks, uint64_t now_ms,
                              uint32_t *n_revoking, char *why, size_t why_len);

/* RevokeAck from `master`: the loan is deleted and its lender gets Reclaimed (unless the lender is
 * gone). KVB_ERR_NOT_FOUND for an unknown loan; KVB_ERR_STATE for a loan that is not being revoked
 * (the ack is ignored: the loan stays). */
kvb_status kvb_ledger_revoke_ack(kvb_ledger *l, const char *master, uint64_t loan_id, uint64_t epoch,
                                 uint64_t now_ms, char *why, size_t why_len);

/* Control(LEND): queues a LendRequest(n_blocks) to worker `worker` after checking that it could lend
 * (a live, non-draining worker with an MEU with a live master). */
kvb_status kvb_ledger_lend_request(kvb_ledger *l, const char *worker, uint32_t n_blocks, char *why, size_t why_len);

/* Control(DRAIN): a worker stops lending (LendRequest(drain) to it) and all its loans are reclaimed;
 * the master borrows no more and all loans are revoked. *n_loans (may be NULL) gets the loans now
 * being given back. */
kvb_status kvb_ledger_drain(kvb_ledger *l, const char *name, uint64_t now_ms, int *n_loans, char *why,
                            size_t why_len);

/* Control(UNDRAIN): undoes kvb_ledger_drain. A worker gets LendRequest(0 blocks, no drain): it lends
 * again when SwiftCache's Alg. 1 says so; the master borrows again. KVB_ERR_STATE (with `why`) when the
 * model does not drain. */
kvb_status kvb_ledger_undrain(kvb_ledger *l, const char *name, char *why, size_t why_len);

/* Declares a live model dead (flow 5): a worker's loans are revoked with lender_dead; a master's loans
 * are deleted and their lenders get Reclaimed. `reason` is kept for the status. No-op for an unknown or
 * already dead model. */
void kvb_ledger_model_dead(kvb_ledger *l, const char *name, const char *reason, uint64_t now_ms);

/* Timers: declares dead every live model whose pid is gone or that has been silent for
 * heartbeat_misses * heartbeat_ms; ends grace periods of unconfirmed loans; re-sends a Revoke not
 * acknowledged within the same silence limit, and revokes a loan whose GrantAck did not come within it.
 * Call it at least every heartbeat_ms / 2. */
void kvb_ledger_tick(kvb_ledger *l, uint64_t now_ms);

/* Pops the next action to send, in order. Returns 1 when *out was filled, 0 when none is queued. */
int kvb_ledger_pop_action(kvb_ledger *l, kvb_ledger_action *out);

/* ------------------------------------------------------------------------------------ inspection */

uint64_t kvb_ledger_epoch(const kvb_ledger *l);
/* Models in registration order (dead ones included until their name registers again). Pointers are
 * owned by the ledger and valid until the next kvb_ledger_register. */
int kvb_ledger_n_models(const kvb_ledger *l);
const kvb_ledger_model *kvb_ledger_model_at(const kvb_ledger *l, int i);
const kvb_ledger_model *kvb_ledger_find(const kvb_ledger *l, const char *name);
/* The live master, or NULL. */
const kvb_ledger_model *kvb_ledger_master(const kvb_ledger *l);
/* Loans in creation order. Pointers are valid until the next call that changes the ledger. */
int kvb_ledger_n_loans(const kvb_ledger *l);
const kvb_loan *kvb_ledger_loan_at(const kvb_ledger *l, int i);
const kvb_loan *kvb_ledger_loan(const kvb_ledger *l, uint64_t id);
/* Worker: blocks lent out (loans of its live process). Master: master blocks borrowed. */
uint32_t kvb_ledger_n_lent(const kvb_ledger *l, const char *worker);
uint32_t kvb_ledger_n_borrowed(const kvb_ledger *l);
/* Worker `worker`'s room: how many of its blocks (whole MEUs) the live master can still attach, when the
 * master's borrowing is limited (returns 1); 0 when it is not (or there is no such worker or MEU). */
int kvb_ledger_lend_room(const kvb_ledger *l, const char *worker, uint32_t *room);

#endif
