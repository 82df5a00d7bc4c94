/* kvbankctl's parts shared by its commands (ctl.c) and its live view (ctl_top.c). Internal to kvbankctl. */
#ifndef KVB_COORDINATOR_CTL_H
#define KVB_COORDINATOR_CTL_H

#include "proto/kvbank.pb-c.h"

/* A connection to the coordinator's control endpoint, opened on first use. */
typedef struct ctl {
    const char *endpoint;   /* the coordinator's endpoint (borrowed) */
    int timeout_ms;         /* how long a request waits for its reply */
    void *zctx, *sock;
} ctl;

/* One StatusRequest (with the loans when `ledger`). NULL, with a message on stderr, when the
 * coordinator does not answer in time; the caller frees with kvbank__envelope__free_unpacked. */
Kvbank__Envelope *kvb__ctl_get_status(ctl *c, int ledger);
/* Closes the socket (the next request opens a new one). */
void kvb__ctl_close(ctl *c);
/* kvbankd's state of `name` in a StatusReply, or NULL. */
const Kvbank__ChildState *kvb__ctl_child_of(const Kvbank__StatusReply *s, const char *name);
/* The STATUS of a model from the coordinator's view `m` and kvbankd's `k` (either may be NULL). */
const char *kvb__ctl_model_state(const Kvbank__ModelStatus *m, const Kvbank__ChildState *k);

/* kvbankctl top: the live view until q (or SIGINT); refreshes every interval_s. Returns the exit status. */
int kvb__ctl_top(ctl *c, double interval_s);

#endif
