/* kvbank — kvbank-coordinator: the node's ledger behind one ZeroMQ ROUTER (docs/lending.md, "The
 * coordinator protocol").
 *
 * Model processes (kvbank-master, kvbank-worker) connect DEALER sockets whose routing id is the
 * model's name, so the coordinator addresses a model by its name; kvbankctl connects with any id and
 * gets its answers back on it. ROUTER_HANDOVER lets a restarted model take its name back and
 * ROUTER_MANDATORY makes a send to a peer that is not connected fail instead of vanishing.
 *
 * Trust (common/ipc/auth.h). The endpoint is ipc:// only. The ROUTER is a PLAIN server whose
 * handshakes a ZAP handler in this loop judges before a connection can take a route: peers of another
 * uid are refused, a model must log in with its name and token (in a node run by kvbankd, also be a
 * child of kvbankd), a control client with the control user. Each message then carries its connection's
 * authenticated identity ("User-Id"): a model may only send as itself, must register with the pid of its
 * connection (the kernel's, SO_PEERCRED) and a region of that pid; fencing signals only such verified
 * processes, through a pidfd opened at their registration. Refused handshakes and forged claims are
 * counted (StatusReply.auth_refused).
 *
 * One thread, one zmq_poll loop: messages are validated (one frame, at most KVB_WIRE_MAX_FRAME bytes,
 * a protobuf Envelope of version KVB_PROTO_VERSION with a body the coordinator accepts, from a
 * registered live model of the right role where the message needs one) and applied to the ledger;
 * what fails is dropped and counted per reason (StatusReply.dropped_messages is the total) and the
 * coordinator goes on serving. Timers declare models dead (pid gone, or heartbeat silence of
 * heartbeat_misses * heartbeat_ms) and end the grace periods of a reconciliation. */
#ifndef KVB_COORD_COORDINATOR_H
#define KVB_COORD_COORDINATOR_H

#include <signal.h>
#include <stddef.h>
#include <stdint.h>

#include "common/ipc/auth.h"
#include "common/util/util.h"
#include "proto/kvbank.pb-c.h"

typedef struct kvb_coord kvb_coord;

typedef struct kvb_coord_opts {
    const char *endpoint;      /* e.g. "ipc:///run/kvbank/node/coordinator.sock" or "tcp://127.0.0.1:5700" */
    uint32_t heartbeat_ms;     /* models heartbeat this often (0: 500) */
    uint32_t heartbeat_misses; /* a model silent this many periods is dead (0: 4) */
    int check_pids;            /* nonzero: a model whose pid is gone is dead at once (kill(pid, 0)) */
    const kvb_auth *auth;      /* the node secret (required); from_supervisor: models must also be
                                * children of this process's parent (kvbankd) */
} kvb_coord_opts;

/* Binds the ROUTER (LINGER 0). Only ipc:// endpoints (KVB_ERR_INVALID for tcp:// and the rest: the
 * coordinator serves the processes of one node, and tcp would be open to every user of the machine).
 * The socket file is made mode 0600, its directory is created mode 0700 when missing, and binding fails
 * (KVB_ERR_STATE) when another process already listens on that file (a stale file of a dead process is
 * replaced). Caller owns the result. */
kvb_status kvb_coord_create(const kvb_coord_opts *opts, kvb_coord **out);
/* Creates the missing directories of an ipc:// endpoint's socket file, mode 0700 (KVB_OK for other
 * endpoints). */
kvb_status kvb_coord_endpoint_dir(const char *endpoint);
/* Serves until *stop becomes nonzero (set it from a signal handler). KVB_ERR_IO if the socket fails. */
kvb_status kvb_coord_run(kvb_coord *c, volatile sig_atomic_t *stop);
/* Closes the socket and removes the ipc socket file it created. NULL-safe. */
void kvb_coord_destroy(kvb_coord *c);
/* The endpoint as bound (wildcards resolved); owned by the coordinator. */
const char *kvb_coord_endpoint(const kvb_coord *c);
/* This instance's id (changes at every start); owned by the coordinator. */
const char *kvb_coord_id(const kvb_coord *c);

/* Why a message was dropped. */
typedef enum kvb_drop_reason {
    KVB_DROP_FRAMES = 0,       /* not exactly one frame after the routing id */
    KVB_DROP_OVERSIZED = 1,    /* frame larger than KVB_WIRE_MAX_FRAME */
    KVB_DROP_MALFORMED = 2,    /* not a protobuf Envelope */
    KVB_DROP_VERSION = 3,      /* Envelope.version != KVB_PROTO_VERSION */
    KVB_DROP_BODY = 4,         /* no body, or a body the coordinator never accepts */
    KVB_DROP_UNREGISTERED = 5, /* needs a registered live model, the sender is none */
    KVB_DROP_ROLE = 6,         /* the sender's role may not send it (e.g. GrantAck from a worker) */
    KVB_DROP_SENDER = 7,       /* the name inside is not the sender's routing id */
    KVB_DROP_AUTH = 8,         /* the sender's authenticated identity does not allow it (another model's
                                * message, a control client's model message, a forged pid or region) */
    KVB_DROP_N = 9,
} kvb_drop_reason;

const char *kvb_drop_reason_str(kvb_drop_reason r);

typedef struct kvb_coord_stats {
    uint64_t received;               /* messages read from the socket */
    uint64_t dropped[KVB_DROP_N];    /* per reason */
    uint64_t dropped_total;
    uint64_t sent;
    uint64_t send_failed;            /* peer not connected or not reading */
    uint64_t auth_refused;           /* handshakes refused (no or wrong credentials) + forged claims */
} kvb_coord_stats;

void kvb_coord_get_stats(const kvb_coord *c, kvb_coord_stats *out);

/* Decodes one frame of the node protocol: size limit, protobuf, version, a body present. Any body is
 * accepted here (kvbankctl reads replies with it). On success the caller frees *out with
 * kvbank__envelope__free_unpacked(*out, NULL); on failure *reason (may be NULL) says why. */
kvb_status kvb_coord_decode(const uint8_t *buf, size_t len, Kvbank__Envelope **out, kvb_drop_reason *reason);

#endif
