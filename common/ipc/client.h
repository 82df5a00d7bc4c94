/* kvbank — a blocking client for a model server (kvbankctl, kvbank-request, the HTTP gateway, tests).
 *
 * One DEALER socket with ZeroMQ heartbeats: a server that dies or hangs is noticed within about a
 * second (heartbeat_ms + dead_ms; on ipc:// a dead process closes its socket at once). A request in
 * flight when that happens is RESUMED when the server comes back on the same endpoint (kvbankd
 * restarts a dead model): the client resubmits the prompt followed by the tokens it already
 * delivered, asks for the remaining max_tokens, and continues the stream where it stopped — no gap,
 * no repeat. Greedy output equals an uninterrupted run's (the lossless invariant: a prefill of
 * prompt + generated tokens yields what decoding them did). With a seed, the resumed request continues
 * the same random stream (the server skips the draws of the delivered tokens; seed 0 is a seed like
 * any other), so it gives the same tokens unless the prefill's logits differ from the decode's in the
 * last bits exactly where a draw falls on the boundary between two candidates. What is not resumed: a request whose server does not come back within resume_ms (KVB_ERR_UNAVAILABLE,
 * naming how many tokens were delivered), and per-token timestamps, which restart on the new process. */
#ifndef KVB_IPC_CLIENT_H
#define KVB_IPC_CLIENT_H

#include <stdint.h>

#include "common/sched/engine.h"

typedef struct kvb_client kvb_client;

typedef struct kvb_client_opts {
    int heartbeat_ms; /* ZeroMQ PING period on the connection (default 200; 0: no heartbeats) */
    int dead_ms;      /* no traffic this long after a PING: the connection is dead (default 800) */
    int resume_ms;    /* a request whose server went away waits this long for it to come back and
                       * resumes on it (default 30000, enough for kvbankd's restart of a model);
                       * 0: fail at once with KVB_ERR_UNAVAILABLE */
} kvb_client_opts;

/* The defaults above. */
void kvb_client_opts_default(kvb_client_opts *o);

/* Connects a DEALER socket to `endpoint` (asynchronously: requests queue until the server is there).
 * `o` may be NULL (defaults). Caller owns the result. */
kvb_status kvb_client_connect_opts(const char *endpoint, const kvb_client_opts *o, kvb_client **out);
kvb_status kvb_client_connect(const char *endpoint, kvb_client **out);
void kvb_client_destroy(kvb_client *c);

/* Called for every token as it arrives; return nonzero to cancel the request. `index` counts the
 * request's output from 0 across resumptions. */
typedef int (*kvb_client_token_fn)(void *ud, int index, int32_t token, uint64_t t_ns);

/* Sends `r` (r->id and r->resume_index are not used: the wire request_id comes from a counter of this
 * client) and blocks until it finishes, calling on_token for each token; after on_token returns
 * nonzero it is not called again, a CancelRequest goes out and the call waits for the finish
 * (FINISH_CANCELLED, or the natural one if that came first). `timeout_ms` bounds the wait for each
 * message from a connected server (KVB_ERR_TIMEOUT, after sending a CancelRequest; negative: no
 * bound); a lost connection is handled as the header says (KVB_ERR_UNAVAILABLE when the server does
 * not come back). *finish gets the reason (FINISH_ERROR returns KVB_ERR_BACKEND); an ErrorReply from
 * the server returns its code and copies its message into `err` (may be NULL). Messages of other
 * requests (late events of an earlier call) are skipped. */
kvb_status kvb_client_generate(kvb_client *c, const kvb_request *r, kvb_client_token_fn on_token, void *ud,
                               int timeout_ms, kvb_finish *finish, char *err, size_t err_len);
/* Round trip to the server within timeout_ms; fills the number of live requests when not NULL. */
kvb_status kvb_client_ping(kvb_client *c, int timeout_ms, uint32_t *live);

typedef struct kvb_client_stats {
    uint64_t connects;    /* handshakes with a server completed */
    uint64_t disconnects; /* connections lost (server gone, or silent past dead_ms) */
    uint64_t resumes;     /* requests resubmitted to a server that came back */
} kvb_client_stats;
void kvb_client_get_stats(const kvb_client *c, kvb_client_stats *out);

#endif
