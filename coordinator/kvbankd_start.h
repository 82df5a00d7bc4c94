/* kvbank — kvbankd's start-up rules (docs/node.md): one kvbankd per run_dir and one node of a name per
 * machine, what a kvbankd killed with SIGKILL left running, and socket files that are not stale.
 *
 * The node's lock is run_dir/kvbankd.lock (run_dir is 0700 and ours: no other user can take it first).
 * kvbankd's children inherit the locked descriptor, so the lock stays held while any process of the node
 * lives, with or without its kvbankd: a new kvbankd that finds it held by processes whose kvbankd is
 * gone stops them (SIGTERM, SIGKILL after the grace) before it starts the node again. */
#ifndef KVB_COORDINATOR_KVBANKD_START_H
#define KVB_COORDINATOR_KVBANKD_START_H

#include "common/util/node_config.h"
#include "common/util/status.h"

/* Another node of this name runs on this machine with another run_dir: a live process created
 * shared-memory objects of one of the node's tags (tags[n_tags], "<node>_<model>") and is not one of
 * this run_dir's processes (which hold its lock). KVB_ERR_STATE (logged, naming that node's kvbankd,
 * its run_dir and the process) when one runs; nothing is created. */
kvb_status kvb__node_check_others(const kvb_node_config *cfg, char tags[][48], int n_tags);

/* Takes run_dir/kvbankd.lock (run_dir must exist). When a live kvbankd holds it: KVB_ERR_STATE, naming
 * its pid, node and run_dir. When only the processes a dead kvbankd left hold it (orphans): stops them
 * (SIGTERM; SIGKILL after grace_ms; through pidfds, so that a reused pid is never signalled) and takes
 * the lock; KVB_ERR_STATE with the pids and what to do when they do not stop. *fd is the locked
 * descriptor, not close-on-exec: the children inherit it. *path is owned by the caller. */
kvb_status kvb__node_lock(const kvb_node_config *cfg, int grace_ms, int *fd, char **path);

/* Writes "pid\nnode\nrun_dir\n" into the locked file (what a refused kvbankd reports). */
kvb_status kvb__node_lock_write(int fd, const char *path, const kvb_node_config *cfg);

/* Removes the socket file of the ipc:// endpoint `ep` when it is stale (nobody accepts connections on
 * it). A socket somebody listens on is left alone: KVB_ERR_STATE (logged, naming the path). */
kvb_status kvb__node_clear_socket(const char *ep);

#endif
