/* kvbank — memory regions that another process can map: the unit a worker lends from.
 *
 * Host backend: a region is a POSIX shared-memory object (mode 0600) mapped MAP_SHARED; its handle is
 * the object's name ("/kvb-<tag>-<pid>-<seq>"), which another process of the same user opens with
 * kvb_region_import. The creator owns the name and unlinks it on destroy; an importer only unmaps.
 * This is the host backend's region under the memory interface (common/mem/mem.h, mem_host.c); code
 * above the mem layer uses kvb_mem_region_*, except a supervisor's stale-segment cleanup. */
#ifndef KVB_MEM_REGION_H
#define KVB_MEM_REGION_H

#include <stddef.h>

#include "common/util/util.h"

typedef struct kvb_region kvb_region;

/* Longest handle string, terminator included; longest tag. */
#define KVB_REGION_HANDLE_MAX 96
#define KVB_REGION_TAG_MAX 40

/* 1 if `tag` is 1..KVB_REGION_TAG_MAX of [A-Za-z0-9_-]. */
int kvb_region_tag_valid(const char *tag);

/* Creates a zero-filled shared region of `bytes` (> 0) bytes. `tag` (letters, digits, '-', '_'; at
 * most 40 chars) goes into the name so that a node supervisor can find its own stale segments.
 * KVB_ERR_INVALID for a bad tag or size; the pages are reserved up front (posix_fallocate) so that a
 * full /dev/shm fails here with KVB_ERR_NOMEM rather than with SIGBUS on first touch.
 * Caller owns the result. */
kvb_status kvb_region_create(const char *tag, size_t bytes, kvb_region **out);
/* Maps the region named `handle` created by another process (or this one). Caller owns the result;
 * destroying it unmaps but never unlinks. KVB_ERR_NOT_FOUND if no such object exists, KVB_ERR_INVALID
 * for a malformed handle, KVB_ERR_STATE if the object is still empty (its creator has not sized it). */
kvb_status kvb_region_import(const char *handle, kvb_region **out);
/* Unmaps; unlinks the name if this process created the region. NULL-safe. */
void kvb_region_destroy(kvb_region *r);

void *kvb_region_base(const kvb_region *r);
size_t kvb_region_size(const kvb_region *r);
/* The handle another process passes to kvb_region_import (owned by the region). */
const char *kvb_region_handle(const kvb_region *r);
int kvb_region_is_owner(const kvb_region *r);

/* Whether `handle` names a live region of process `pid` of this user holding at least `bytes` (what a
 * coordinator checks before it tells the master to map it): exactly "/kvb-<tag>-<pid>-<seq>", an
 * existing shared-memory object that is a regular file of this user no one else may open, at least
 * `bytes` long. KVB_ERR_INVALID with the reason in why[why_len] otherwise. */
kvb_status kvb_region_check(const char *handle, long pid, uint64_t bytes, char *why, size_t why_len);

/* Removes the shared-memory objects "/kvb-<tag>-<pid>-<seq>" whose creating process <pid> is dead
 * (kvb_pid_alive: gone, or a zombie), i.e. regions of crashed processes; the objects of live processes
 * are left alone, whoever runs them (a second node of the same name, a model that restarted). The one
 * stale-segment cleanup of kvbankd, the model processes and kvbank-serve. Only names of exactly that
 * form match, so the objects of a longer tag that starts with this one ("<tag>-x") are left alone.
 * KVB_ERR_INVALID for a bad tag. Returns the number removed in *n_removed (may be NULL). */
kvb_status kvb_region_unlink_stale(const char *tag, int *n_removed);
/* The live processes that created objects "/kvb-<tag>-<pid>-<seq>" (each once, at most `max` of them in
 * pids[], how many in *n): whoever runs a model of that tag now (kvbankd's check for another node of
 * its name). KVB_ERR_INVALID for a bad tag. */
kvb_status kvb_region_live_owners(const char *tag, long *pids, int max, int *n);

#endif
