/* kvbank — the model side of the coordinator protocol (docs/lending.md "The coordinator
 * protocol"), shared by kvbank-master and kvbank-worker.
 *
 * One DEALER socket whose routing id is the model's name, connected to kvbank-coordinator. The client
 * registers (with the loans the process holds now), heartbeats every heartbeat_ms (the period
 * RegisterReply gives), and registers again when the coordinator says it does not know the name
 * (HeartbeatReply.known = false), when its instance id changes (a restart), or when it stops
 * answering. ZeroMQ reconnects by itself; the client never gives up and never makes the process exit:
 * a model keeps serving its own requests without a coordinator. The socket logs in as the model
 * (PLAIN: its name and token). When the coordinator stops answering while the connection stands (its
 * route taken over by another connection of the same name, say), the client closes its socket, makes
 * a new one and registers again, so the model recovers without a restart.
 *
 * Everything else the coordinator sends is validated and handed to the role's callbacks. The client
 * is not thread-safe (one owner thread; busy_begin is the one hand-over) and never blocks: the role polls its socket together with the model server's
 * (kvb_node_client_pollitem + kvb_server_set_hooks) and calls kvb_node_client_on_ready and
 * kvb_node_client_tick from the server's loop, between engine steps. */
#ifndef KVB_IPC_NODE_CLIENT_H
#define KVB_IPC_NODE_CLIENT_H

#include <stdint.h>
#include <zmq.h>

#include "common/util/node_config.h"
#include "common/util/util.h"
#include "kernels/backend.h"
#include "proto/kvbank.pb-c.h"

typedef struct kvb_node_client kvb_node_client;

/* What a model says about itself in Register and does not change while it runs. Strings are copied. */
typedef struct kvb_node_identity {
    const char *name;      /* 1..255 bytes: the routing id and the model's name in the node */
    kvb_role role;
    kvb_kv_geom geom;      /* of its own blocks */
    const char *region;    /* handle of its KV region (kvb_mem_region_handle) */
    uint64_t region_bytes;
    const char *memory;    /* memory kind of the region (kvb_mem_kind: "host", a device kind) */
    uint32_t device;       /* device of the region */
    int stream;            /* master: lent blocks are streamed into its LSC (1) or read in place (0) */
    int borrow_limited;    /* master: it attaches at most max_borrow master blocks (its LSC within its
                            * budget, issue 10); 0: no limit */
    uint32_t max_borrow;
    uint32_t capacity;     /* blocks the region holds */
    const char *endpoint;  /* its request endpoint */
    const char *model;     /* model directory, informational (may be NULL) */
    const char *token;     /* its token for the coordinator (common/ipc/auth.h; kvbankd passes it), or
                            * NULL: derived from the node key file next to the coordinator's socket (a
                            * node run by hand), read again until it is there and at every reconnection */
} kvb_node_identity;

/* The numbers of a Heartbeat (and n_own of a Register). */
typedef struct kvb_node_load {
    uint32_t n_own;            /* blocks the model uses itself now */
    uint32_t n_used;           /* own blocks referenced by live requests */
    uint32_t live_requests;
    uint32_t waiting_requests;
    uint32_t max_need;         /* Alg. 1: most blocks one request needed in the window (worker) */
    uint64_t tokens_generated;
} kvb_node_load;

/* A loan as the process holds it (for Register after a coordinator restart). */
typedef struct kvb_node_loan {
    uint64_t loan_id;
    const char *lender;        /* the worker's name */
    uint32_t first_block;      /* worker blocks [first_block, first_block + n_blocks) */
    uint32_t n_blocks;
    uint32_t n_master_blocks;
    uint64_t offset;           /* byte offset of the range in the lender's region */
    uint64_t bytes;
    uint64_t epoch;            /* at which it was granted */
} kvb_node_loan;

/* The role's side. Every member but `load` may be NULL (the message is then logged and ignored).
 * Messages passed to a callback are validated (required parts present, counts in range) and valid
 * during the call only. Callbacks may call the kvb_node_client_send_* functions. */
typedef struct kvb_node_callbacks {
    void *ud;
    void (*load)(void *ud, kvb_node_load *out);
    /* The loans to report in Register: *out[0..n) stays valid until the Register is sent (at once). */
    int (*loans)(void *ud, const kvb_node_loan **out);
    /* Registration succeeded. `same_coordinator`: the instance that knew us before (0 on the first
     * registration and after a coordinator restart: messages to the old one got no answer). */
    void (*on_registered)(void *ud, int same_coordinator);
    void (*on_lend_result)(void *ud, const Kvbank__LendResult *m);   /* worker */
    void (*on_grant)(void *ud, const Kvbank__Grant *m);              /* master */
    void (*on_revoke)(void *ud, const Kvbank__Revoke *m);            /* master */
    void (*on_reclaimed)(void *ud, const Kvbank__Reclaimed *m);      /* worker */
    void (*on_lend_request)(void *ud, const Kvbank__LendRequest *m); /* worker */
    void (*on_status)(void *ud, const Kvbank__StatusReply *m);
    void (*on_control_reply)(void *ud, const Kvbank__ControlReply *m);
} kvb_node_callbacks;

/* Connects to the coordinator at `endpoint` (nothing is sent before the first tick). `heartbeat_ms`
 * (> 0) is the period until a RegisterReply says otherwise. `id` and `cb` are copied. Caller owns the
 * result. */
kvb_status kvb_node_client_create(const char *endpoint, const kvb_node_identity *id, const kvb_node_callbacks *cb,
                                  int heartbeat_ms, kvb_node_client **out);
/* Closes the socket (queued messages are dropped). NULL-safe. */
void kvb_node_client_destroy(kvb_node_client *nc);

/* A poll item for the client's socket (ZMQ_POLLIN). The socket changes when the client reconnects
 * (kvb_node_client_tick): take the item again after every tick. */
zmq_pollitem_t kvb_node_client_pollitem(const kvb_node_client *nc);
/* Receives and dispatches every message waiting on the socket. Never blocks. */
void kvb_node_client_on_ready(kvb_node_client *nc);
/* Timers: (re-)registration, heartbeats, the coordinator's silence. Returns the ms until it needs to
 * run again. */
int kvb_node_client_tick(kvb_node_client *nc);
/* Waits up to timeout_ms for messages, dispatching them and running the timers (for the role's own
 * waits outside the server loop, e.g. at shutdown). */
void kvb_node_client_pump(kvb_node_client *nc, int timeout_ms);

/* The owner is about to run something long that does not use the client (an engine step): until
 * busy_end, a keepalive thread sends Heartbeats (with the numbers of now, from cb.load, called here)
 * whenever one is due, so that a long step is not taken for a dead process. busy_end takes the socket
 * back (waiting for a send in progress). Call both from the owner's thread; nothing else of the
 * client may be called between them. */
void kvb_node_client_busy_begin(kvb_node_client *nc);
void kvb_node_client_busy_end(kvb_node_client *nc);

/* Registered with the coordinator that answers now. */
int kvb_node_client_registered(const kvb_node_client *nc);
/* Period of heartbeats now (ms). */
int kvb_node_client_heartbeat_ms(const kvb_node_client *nc);
/* MEUs of this worker with the master as the coordinator last reported them (0: not known). */
void kvb_node_client_meu(const kvb_node_client *nc, uint32_t *meu_worker, uint32_t *meu_master);
/* Sets the MEUs (the role learned them from a StatusReply). */
void kvb_node_client_set_meu(kvb_node_client *nc, uint32_t meu_worker, uint32_t meu_master);
/* Worker: 1 when the master's borrowing is limited (its LSC within its budget, issue 10), with *room its
 * blocks the master can still attach as of the coordinator's last reply; 0 when there is no limit. */
int kvb_node_client_lend_room(const kvb_node_client *nc, uint32_t *room);
/* The ledger epoch of the last reply. */
uint64_t kvb_node_client_epoch(const kvb_node_client *nc);

/* Sending. Each returns KVB_ERR_STATE when not registered (the coordinator would drop the message;
 * the StatusRequest and Control are allowed anyway) and KVB_ERR_IO when the coordinator cannot be
 * reached now (nothing was queued). Never blocks. */
kvb_status kvb_node_client_send_lend_offer(kvb_node_client *nc, uint32_t first_block, uint32_t n_blocks);
kvb_status kvb_node_client_send_reclaim(kvb_node_client *nc, uint32_t n_blocks);
kvb_status kvb_node_client_send_grant_ack(kvb_node_client *nc, uint64_t loan_id, int ok, const char *error);
/* RevokeAck: what the detach did (moved live blocks, dropped / kept / demoted cached blocks, preempted
 * sequences). */
kvb_status kvb_node_client_send_revoke_ack(kvb_node_client *nc, uint64_t loan_id, uint64_t epoch, uint32_t moved,
                                           uint32_t dropped, uint32_t preempted, uint32_t kept, uint32_t demoted);
kvb_status kvb_node_client_send_status_request(kvb_node_client *nc, int ledger);
/* Control(op, model, n_blocks); op is a KVBANK__CONTROL__OP__* value. */
kvb_status kvb_node_client_send_control(kvb_node_client *nc, int op, const char *model, uint32_t n_blocks);

#endif
