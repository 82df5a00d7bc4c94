/* kvbank — a model process of the node: what kvbank-master and kvbank-worker share.
 *
 * The command line (node config entry or standalone flags), the model, its KV memory (one exportable
 * region of the backend's memory, common/mem/mem.h: host shm tagged for the node, or device memory
 * with an IPC handle), the engine over that memory, the model server on the request endpoint,
 * the coordinator client, signals, and the loop that runs them all in one thread: the role's code runs
 * as server hooks, between engine steps. The roles (master/master.c, worker/worker.c) add only what
 * differs: borrowing and lending. */
#ifndef KVB_NODE_NODE_PROC_H
#define KVB_NODE_NODE_PROC_H

#include <signal.h>
#include <stdint.h>

#include "common/ipc/node_client.h"
#include "common/ipc/server.h"
#include "common/mem/mem.h"
#include "common/policy/policy.h"
#include "common/sched/engine.h"
#include "common/util/node_config.h"

#define KVB_NODE_NAME_MAX 40 /* longest model name and region tag */

/* Settings of one model process, from --config/--name and the flags (flags win). Strings point into
 * argv or into `cfg`. */
typedef struct kvb_node_proc_args {
    kvb_role role;
    const char *prog;            /* "kvbank-worker" / "kvbank-master" */
    char name[KVB_NODE_NAME_MAX + 1];
    char tag[KVB_NODE_NAME_MAX + 1]; /* region tag */
    const char *model_dir;
    const char *endpoint;        /* request endpoint */
    const char *coordinator;     /* coordinator endpoint */
    const char *backend;
    int device;                  /* device of a device backend (0 for cpu) */
    const char *policy;
    kvb_policy_params policy_params; /* the config's "policy_params", then --policy-param flags (owned) */
    int threads;
    int block_size;
    int64_t kv_bytes;            /* KV memory of the process */
    int max_batch_tokens;
    int max_seqs;
    int max_live;
    int max_live_per_client;     /* 0: the server's default (max_live / 4) */
    int prefix_cache;
    int heartbeat_ms;            /* until the coordinator says otherwise */
    double lend_interval_s;      /* worker: Alg. 1 SCALEDOWN period */
    double window_s;             /* worker: Alg. 1 window t */
    double stall_wait_s;         /* kvb_engine_opts.stall_wait_s (issue 10) */
    int stall_overtake;          /* kvb_engine_opts.stall_overtake */
    int lsc_stream;              /* master: stream lent blocks through the LSC */
    const char *link_preset;     /* the engine's link model by name (kvb_link_preset), NULL: off */
    int lend;                    /* worker: offer idle blocks (1, default) or never (0: --no-lend) */
    kvb_node_config *cfg;        /* the node config when --config was given (owned; else NULL) */
} kvb_node_proc_args;

/* Parses the command line of `role`. Returns -1 when the program should go on, else the exit status
 * (0 after --help, 2 for a usage error, 1 when the config cannot be read), having printed why.
 * On -1 the caller frees a->cfg with kvb_node_proc_args_free. */
int kvb_node_proc_parse(kvb_role role, int argc, char **argv, kvb_node_proc_args *a);
void kvb_node_proc_args_free(kvb_node_proc_args *a);

typedef struct kvb_node_proc kvb_node_proc;

/* What the role plugs in. `cb` goes to the coordinator client (cb.load is required;
 * kvb_node_proc_load gives the engine's numbers). on_tick runs between engine steps at least every 100 ms and returns
 * the ms until it wants to run again (< 0: no wish); on_request sees every accepted request. */
typedef struct kvb_node_role {
    void *ud;
    kvb_node_callbacks cb;
    int (*on_tick)(void *ud);
    void (*on_request)(void *ud, const kvb_request *r);
} kvb_node_role;

/* Installs SIGINT/SIGTERM handlers, creates the backend on its device (a missing device fails here,
 * "no CUDA device", before anything is created), loads the model, removes stale regions of the tag,
 * creates the KV region, the server, the engine and the coordinator client (which registers on the first tick).
 * `role` is copied; its callbacks may run from kvb_node_proc_run and kvb_node_proc_pump only. Caller
 * owns the result; on failure the error was printed to stderr. */
kvb_status kvb_node_proc_create(const kvb_node_proc_args *a, const kvb_node_role *role, kvb_node_proc **out);
/* Serves until SIGINT/SIGTERM; live requests are then cancelled (FINISH_CANCELLED). KVB_ERR_BACKEND
 * when an engine step failed. */
kvb_status kvb_node_proc_run(kvb_node_proc *p);
/* Coordinator traffic outside the server loop (shutdown): dispatches messages and runs the client's
 * timers until `done(ud)` is true, timeout_ms passed, or a second signal arrived. Returns done(). */
int kvb_node_proc_pump(kvb_node_proc *p, int timeout_ms, int (*done)(void *ud), void *ud);
/* Destroys everything in reverse order; the region's name is unlinked. NULL-safe. */
void kvb_node_proc_destroy(kvb_node_proc *p);

kvb_engine *kvb_node_proc_engine(const kvb_node_proc *p);
/* The memory the process's backend computes on: where lent regions are imported (owned by p). */
kvb_mem *kvb_node_proc_mem(const kvb_node_proc *p);
kvb_node_client *kvb_node_proc_client(const kvb_node_proc *p);
const kvb_node_proc_args *kvb_node_proc_args_of(const kvb_node_proc *p);
const kvb_kv_geom *kvb_node_proc_geom(const kvb_node_proc *p);
/* The pool planner's decision for `ev` (kvb_engine_plan_pool): a worker's lending (SwiftCache Alg. 1:
 * a swiftcache planner of its own, with the node's window_s and, when the model's policy is swiftcache,
 * the model's policy parameters). KVB_ERR_UNSUPPORTED for a master. */
kvb_status kvb_node_proc_plan_pool(kvb_node_proc *p, const kvb_pool_event *ev, kvb_pool_plan *out);
/* Heartbeat numbers from the engine: own and used blocks, live and waiting requests, tokens. */
void kvb_node_proc_load(const kvb_node_proc *p, kvb_node_load *out);
/* Signals received so far (0 while serving). */
int kvb_node_proc_signals(void);

#endif
