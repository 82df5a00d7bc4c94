/* kvbank — the model server: one model's engine behind a ZeroMQ ROUTER endpoint.
 *
 * Clients (DEALER sockets) send GenerateRequest / CancelRequest / Ping envelopes and receive a stream
 * of TokenEvents ending with a finish reason, or an ErrorReply. A malformed, oversized or
 * wrong-version message gets an ErrorReply and changes nothing else; a client that goes away has its
 * requests cancelled (ROUTER_MANDATORY turns the next send to it into EHOSTUNREACH). The kvbank-master
 * and kvbank-worker processes build on this. */
#ifndef KVB_IPC_SERVER_H
#define KVB_IPC_SERVER_H

#include <signal.h>
#include <zmq.h>

#include "common/sched/engine.h"

typedef struct kvb_server kvb_server;

typedef struct kvb_server_opts {
    const char *endpoint;   /* e.g. "ipc:///run/kvbank/model.sock" or "tcp://127.0.0.1:5555" */
    const char *model_name; /* reported in Pong and logs */
    int max_live;           /* requests accepted at once before rejecting (default 1024) */
    int max_per_client;     /* requests one client (routing id) may have live at once (default
                             * max_live / 4, at least 1); clients are admitted to the engine fairly
                             * (the one with the fewest requests in it first) */
    int vocab;              /* > 0: prompt and stop ids must be < vocab (checked here so that the
                             * ErrorReply names the bad token; 0 leaves the check to the engine) */
    const char *model_dir;  /* structured output: the tokenizer a request's grammar is compiled against
                             * (its tokenizer.json, loaded at the first request with a grammar); NULL:
                             * such requests are refused */
} kvb_server_opts;

/* Creates a server that feeds `engine` (borrowed; the server installs its event callbacks, so the
 * engine must have been created with events from kvb_server_engine_events). Caller owns the result. */
kvb_status kvb_server_create(const kvb_server_opts *opts, kvb_server **out);
/* The events to create the engine with; they forward to `s`. */
kvb_engine_events kvb_server_engine_events(kvb_server *s);
void kvb_server_attach(kvb_server *s, kvb_engine *engine);
/* Serves until *stop becomes nonzero (set it from a signal handler); then cancels the requests still
 * live, so that their clients get FINISH_CANCELLED. KVB_ERR_BACKEND if an engine step failed (its
 * requests end with FINISH_ERROR first), KVB_ERR_STATE without an attached engine. */
kvb_status kvb_server_run(kvb_server *s, volatile sig_atomic_t *stop);
/* Closes the socket (waiting at most 250 ms for queued replies) and removes an ipc:// socket file.
 * NULL-safe. Destroy the engine first or after, the server never calls it here. */
void kvb_server_destroy(kvb_server *s);
/* The endpoint as bound (wildcards resolved, e.g. "tcp://127.0.0.1:41234"); owned by the server. */
const char *kvb_server_endpoint(const kvb_server *s);

/* Hooks let a role (kvbank-master, kvbank-worker) run its own code in the server's single thread:
 * its sockets are polled together with the server's, and every hook runs between engine steps, never
 * inside one. That is the fence of the reclaim protocol on the CPU backend: when a hook detaches
 * borrowed memory or shrinks the pool, no step is reading it. Every member may be NULL / 0. */
typedef struct kvb_server_hooks {
    void *ud;                /* passed to every hook */
    zmq_pollitem_t *items;   /* [n_items] extra sockets or fds, borrowed until the hooks are replaced;
                              * their revents are filled by each poll */
    int n_items;
    /* After a poll in which one of `items` has revents (read them in items[i].revents). */
    void (*on_ready)(void *ud);
    /* Once per loop iteration (at least every 100 ms while idle), after input was handled and before
     * the engine step. Returns how many ms may pass before it must run again (< 0: no wish); the
     * server's idle poll waits no longer than that. */
    int (*on_tick)(void *ud);
    /* A request was accepted and queued in the engine (r is valid during the call only). */
    void (*on_request)(void *ud, const kvb_request *r);
    /* Just before and just after each engine step (e.g. to keep a heartbeat going through a long
     * step); they must not call the engine. */
    void (*on_step_begin)(void *ud);
    void (*on_step_end)(void *ud);
} kvb_server_hooks;

/* Installs `h` (copied; NULL removes the hooks). At most 15 extra items. KVB_ERR_INVALID otherwise. */
kvb_status kvb_server_set_hooks(kvb_server *s, const kvb_server_hooks *h);

typedef struct kvb_server_stats {
    uint64_t accepted;
    uint64_t rejected;     /* ErrorReplies sent */
    uint64_t malformed;    /* frames that failed validation */
    uint64_t disconnects;  /* requests cancelled because their client went away */
    uint64_t completed;
} kvb_server_stats;
void kvb_server_get_stats(const kvb_server *s, kvb_server_stats *out);

#endif
