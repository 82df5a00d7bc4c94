/* kvbank — a blocking client for a model server (kvbankctl, tests, benchmarks). */
#ifndef KVB_IPC_CLIENT_H
#define KVB_IPC_CLIENT_H

#include <stdint.h>

#include "common/sched/engine.h"

typedef struct kvb_client kvb_client;

/* Connects a DEALER socket to `endpoint`. Caller owns the result. */
kvb_status kvb_client_connect(const char *endpoint, kvb_client **out);
void kvb_client_destroy(kvb_client *c);

/* Called for every token as it arrives; return nonzero to cancel the request. */
typedef int (*kvb_client_token_fn)(void *ud, int index, int32_t token, uint64_t t_ns);

/* Sends `r` (r->id is not used: the wire request_id comes from a counter of this client) and blocks
 * until it finishes, calling on_token for each token; after on_token returns nonzero it is not called
 * again, a CancelRequest goes out and the call waits for the finish (FINISH_CANCELLED, or the natural
 * one if that came first). `timeout_ms` bounds the wait for each message (KVB_ERR_TIMEOUT, after
 * sending a CancelRequest; negative: no bound). *finish gets the reason (FINISH_ERROR returns
 * KVB_ERR_BACKEND); an ErrorReply from the server returns its code and copies its message into `err`
 * (may be NULL). Messages of other requests (late events of an earlier call) are skipped. */
kvb_status kvb_client_generate(kvb_client *c, const kvb_request *r, kvb_client_token_fn on_token, void *ud,
                               int timeout_ms, kvb_finish *finish, char *err, size_t err_len);
/* Round trip to the server within timeout_ms; fills the number of live requests when not NULL. */
kvb_status kvb_client_ping(kvb_client *c, int timeout_ms, uint32_t *live);

#endif
