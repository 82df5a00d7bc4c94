/* kvbank — the stager: copies of layer slices between tiers while the forward pass computes, and the
 * link model that makes a CPU run show a GPU's transfer / compute regime.
 *
 * Links (kvb_link_kind): device <-> host tier (PCIe), device <-> another device's memory (NVLink or
 * PCIe peer), device <-> device (same GPU). Each link has its own copy thread: transfers posted to a
 * link run in post order, links run side by side (and a link's from-device queue, kvb_stager_post_out,
 * beside its link), and every post returns a ticket to wait on (before
 * the layer that reads what it loads, before the step ends for stores): on the host, or where the
 * backend can, on the device (kvb_stager_wait_device: the layer's kernels wait for the copy, the host
 * does not). Stage buffers (single-layer
 * slices) are the stager's memory.
 *
 * The link model (link_model.h): a transfer on link k takes at least latency_s[k] + bytes /
 * bytes_per_s[k], and the copy thread sleeps out what the real copy did not take. Off (the default,
 * every test) means memory speed. */
#ifndef KVB_SCHED_STAGER_H
#define KVB_SCHED_STAGER_H

#include <stdio.h>

#include "common/sched/link_model.h"
#include "common/sched/plan.h"

/* ------------------------------------------------------------------------------------ link model */

/* kvb_link_preset_find (link_model.h), and for a scaled preset this machine's compute rate on `be` as
 * well (kvb_link_measure_flops, for the planners' cost models; be may be NULL). The time scale is set
 * by kvb_link_calibrate (link_calib.h) or, failing that, by kvb_engine_create. */
kvb_status kvb_link_preset(const char *name, kvb_backend *be, kvb_link_model *out);
/* This machine's compute rate on `be`: the best of a few [256 x 1024] x [1024 x 1024] matmuls, in
 * FLOP/s. Measured once per process and backend name, then remembered. */
kvb_status kvb_link_measure_flops(kvb_backend *be, double *flops);

/* --------------------------------------------------------------------------------------- stager */

typedef struct kvb_stager kvb_stager;

typedef enum kvb_xfer_dir {
    KVB_XFER_D2D = 0, /* backend memory -> backend memory (backend `copy`) */
    KVB_XFER_D2H = 1, /* backend memory -> host memory (backend `to_host`) */
    KVB_XFER_H2D = 2, /* host memory -> backend memory (backend `to_device`) */
} kvb_xfer_dir;

/* One piece of a transfer: the backend's copy piece (kernels/backend.h), handed to copy_async as it is. */
typedef kvb_copy_piece kvb_xfer;

/* Creates a stager for `be` (borrowed) under `links` (copied; NULL: off). Threads start on first use.
 * Caller owns the result. */
kvb_status kvb_stager_create(kvb_backend *be, const kvb_link_model *links, kvb_stager **out);
/* Waits for every transfer, stops the threads, frees the stage buffers. NULL-safe. */
void kvb_stager_destroy(kvb_stager *s);
const kvb_link_model *kvb_stager_links(const kvb_stager *s);

/* Posts pieces x[0..n) as one transfer on `link`. `x` is borrowed until the ticket has been waited
 * for, on the host or the device (or kvb_stager_drain returned). KVB_ERR_UNSUPPORTED when the backend lacks the copy `dir`
 * needs; KVB_ERR_NOMEM. n == 0 posts nothing and gives a ticket that is already done. */
kvb_status kvb_stager_post(kvb_stager *s, kvb_link_kind link, kvb_xfer_dir dir, const kvb_xfer *x, int n,
                           uint64_t *ticket);
/* Posts device -> host pieces x[0..n) as one transfer on `link`'s from-device queue: in post order with the
 * transfers posted this way on that link, beside the link's other transfers and ordered against none of
 * them (a GPU copies each direction of PCIe on a copy engine of its own). Under the link model it pays
 * the link's latency and bandwidth like any transfer; its bytes count in the link's reports. Tickets,
 * wait, done and drain as for kvb_stager_post. For write-backs nobody waits for until their memory is
 * needed, which must not hold up the loads a step waits for. */
kvb_status kvb_stager_post_out(kvb_stager *s, kvb_link_kind link, const kvb_xfer *x, int n, uint64_t *ticket);
/* Waits until the transfer `ticket` (and every earlier one on its link, or on its link's from-device queue
 * for kvb_stager_post_out) is done; returns the link's
 * first copy error since the last drain. With a sharing link model (share = 1) "done" means that
 * transfer's share of the link has carried its bytes: every earlier transfer has landed in memory (the
 * copies themselves run in post order) but may still be charged by the model. */
kvb_status kvb_stager_wait(kvb_stager *s, uint64_t ticket);
/* Orders the backend's operators issued after this call after transfer `ticket` (and every earlier one
 * on its link) without the host waiting for it to land: the host waits only until the link's copy thread
 * has issued it, then the backend's wait_ticket has its compute wait for the copy (a layer_in before the
 * layer's kernels). On a stager whose copies the host must see land (a backend without tickets, or a link
 * model that paces them: kvb_stager_device_waits is 0) it is kvb_stager_wait. Returns the link's first
 * error so far (an issue that failed); an error of the landing itself surfaces at kvb_stager_settle or
 * drain. The transfer's memory is the caller's to reuse only after a host wait (wait, settle, drain). */
kvb_status kvb_stager_wait_device(kvb_stager *s, uint64_t ticket);
/* Waits on the host for every transfer kvb_stager_wait_device ordered compute after since the last
 * settle or drain; returns the first error of those links (not cleared: drain clears). The end of a
 * step, so that a copy that failed fails it. */
kvb_status kvb_stager_settle(kvb_stager *s);
/* 1 when kvb_stager_wait_device waits on the device: the backend has tickets (copy_async, wait_ticket,
 * ticket_done, ticket_wait) and the link model paces nothing (off). Fixed at creation. The copy threads
 * then only issue their transfers (each link's in post order: a transfer on another copy engine than the
 * one before it is issued once those have landed), and the reports' busy time is the time issuing. */
int kvb_stager_device_waits(const kvb_stager *s);
/* Calls so far of kvb_stager_wait (host waits, also those wait_device turned into) and of
 * kvb_stager_wait_device that waited on the device. */
void kvb_stager_wait_counts(kvb_stager *s, uint64_t *host, uint64_t *device);
/* 1 when kvb_stager_wait(ticket) would return at once (the transfer is done, as wait defines it), else 0;
 * never blocks. For a write-back nobody waits for until its memory is needed. */
int kvb_stager_done(kvb_stager *s, uint64_t ticket);
/* Waits for every posted transfer; returns the first error of any link and clears the errors. */
kvb_status kvb_stager_drain(kvb_stager *s);
/* What each link did since the last call (bytes, transfers, busy time, achieved bandwidth). */
void kvb_stager_take_report(kvb_stager *s, kvb_link_report out[KVB_LINK_COUNT]);
/* Totals since creation (bytes and transfers per link). */
void kvb_stager_totals(const kvb_stager *s, kvb_link_report out[KVB_LINK_COUNT]);

/* Stage buffers: `n` single-layer buffers of `bytes` each in backend memory (the only place the
 * stager allocates, so that the memory interface can take it over). Only between steps (no transfer
 * in flight). On failure the old buffers stay. */
kvb_status kvb_stager_reserve(kvb_stager *s, int n, size_t bytes);
/* From now on the stage buffers live in `mem` ([bytes], backend memory the caller keeps until the
 * stager is destroyed) and kvb_stager_reserve never allocates: more than `bytes` is KVB_ERR_EXHAUSTED.
 * SwiftCache's LSC inside the master's KV budget (issue 10). Before any buffer exists. */
kvb_status kvb_stager_use_memory(kvb_stager *s, void *mem, size_t bytes);
int kvb_stager_n_buffers(const kvb_stager *s);
void *kvb_stager_buffer(const kvb_stager *s, int i);

#endif
