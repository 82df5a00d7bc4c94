/* kvbank — a client for a model server: one DEALER socket that carries any number of requests at once.
 *
 * Two ways to use it. Blocking (kvbankctl, tests, benchmark threads): kvb_client_generate sends one
 * request and returns when it finished. Asynchronous (the HTTP gateway): kvb_client_submit starts a
 * request and returns at once; the caller's event loop watches kvb_client_fd and calls
 * kvb_client_dispatch, which hands every arriving TokenEvent to the request's callback. Both share one
 * core (a table of live requests keyed by the request id), so the blocking call is the asynchronous
 * one plus a wait. A client is used from one thread at a time.
 *
 * Dead servers and resumed requests. The DEALER runs ZeroMQ heartbeats: a server that dies is noticed
 * at once on ipc:// (its socket closes) and one that hangs, or a dead one over tcp://, within
 * heartbeat_ms + dead_ms (1.25 s by default). A request in flight when that happens is RESUMED when a server comes back on the same
 * endpoint (kvbankd restarts a dead model): the client resubmits the prompt followed by the tokens it
 * already delivered, for the remaining max_tokens, and the stream goes on with the next index — no
 * gap, no repeat. Greedy output equals an uninterrupted run's (the lossless invariant: a prefill of
 * prompt + generated tokens yields what decoding them did). With sampling, the resumed request
 * continues the same random stream (the server skips the draws of the delivered tokens; seed 0 is a
 * seed like any other), so it gives the same tokens unless the prefill's logits differ from the
 * decode's in the last bits exactly where a draw falls on the boundary between two candidates. Not
 * kept: the per-token timestamps restart on the new process. A server that does not come back within
 * resume_ms ends the request with KVB_ERR_UNAVAILABLE, naming how many tokens were delivered. */
#ifndef KVB_IPC_CLIENT_H
#define KVB_IPC_CLIENT_H

#include <stdint.h>

#include "common/sched/engine.h"

typedef struct kvb_client kvb_client;

typedef struct kvb_client_opts {
    int heartbeat_ms; /* ZeroMQ PING period on the connection (default 250; 0: no heartbeats) */
    int dead_ms;      /* no traffic this long after a PING: the connection is dead (default 1000) */
    int resume_ms;    /* a request whose server went away waits this long for a server to come back
                       * on the endpoint and resumes on it (default 30000, enough for kvbankd to
                       * restart a model); 0: such a request fails at once with KVB_ERR_UNAVAILABLE */
} kvb_client_opts;

/* The defaults above. */
void kvb_client_opts_default(kvb_client_opts *o);

/* Connects a DEALER socket to `endpoint` (asynchronously: requests queue until the server is there).
 * `o` may be NULL (the defaults). Caller owns the result. */
kvb_status kvb_client_connect_opts(const char *endpoint, const kvb_client_opts *o, kvb_client **out);
kvb_status kvb_client_connect(const char *endpoint, kvb_client **out);
/* Closes the socket; live requests are dropped without callbacks (the server cancels them when it
 * next fails to reach this client). NULL-safe. */
void kvb_client_destroy(kvb_client *c);

/* Called for every token as it arrives; return nonzero to cancel the request. `index` counts the
 * request's output from 0, across resumptions. */
typedef int (*kvb_client_token_fn)(void *ud, int index, int32_t token, uint64_t t_ns);

/* Sends `r` (r->id and r->resume_index are not used: the request id comes from a counter of this
 * client) and blocks until it finishes, calling on_token for each token; after on_token returns
 * nonzero it is not called again, a CancelRequest goes out and the call waits for the finish
 * (FINISH_CANCELLED, or the natural one if that came first). `timeout_ms` bounds the wait for each
 * message from a connected server (KVB_ERR_TIMEOUT, after sending a CancelRequest; negative: no
 * bound); a lost connection is resumed as the header says (KVB_ERR_UNAVAILABLE when no server comes
 * back within resume_ms). *finish gets the reason (FINISH_ERROR returns
 * KVB_ERR_BACKEND); an ErrorReply from the server returns its code and copies its message into `err`
 * (may be NULL). Must not be called while asynchronous requests of this client are live. */
kvb_status kvb_client_generate(kvb_client *c, const kvb_request *r, kvb_client_token_fn on_token, void *ud,
                               int timeout_ms, kvb_finish *finish, char *err, size_t err_len);
/* Round trip to the server within timeout_ms; fills the number of live requests when not NULL.
 * Must not be called while asynchronous requests of this client are live. */
kvb_status kvb_client_ping(kvb_client *c, int timeout_ms, uint32_t *live);

/* ------------------------------------------------------------------------------- asynchronous use */

/* The logprobs an event carries (sampling.logprobs, sampling.prompt_logprobs; proto TokenEvent). */
typedef struct kvb_client_logprobs {
    const float *lp;              /* [n] the event's tokens' logprobs, or NULL when not asked for */
    const int32_t *top_ids;       /* [n][top_n] the most likely tokens at each, most likely first */
    const float *top_lp;          /* [n][top_n] */
    int top_n;
    int prompt_first;             /* prompt positions prompt_first .. prompt_first + n_prompt - 1 */
    int n_prompt;                 /* 0: none in this event */
    const float *prompt_lp;       /* [n_prompt] */
    const int32_t *prompt_top_ids;/* [n_prompt][top_n] */
    const float *prompt_top_lp;   /* [n_prompt][top_n] */
} kvb_client_logprobs;

/* What arrived for request `rid`: `n` new tokens (indices first_index.., with their wall-clock times,
 * ns since the epoch; both arrays valid during the call only), and on the request's last call its
 * finish reason (NONE on every call before). On that last call `st` says how it ended: KVB_OK with
 * LENGTH / STOP / CANCELLED; with FINISH_ERROR, the server's ErrorReply code (its message in `err`),
 * KVB_ERR_BACKEND when the model failed the request, or KVB_ERR_PROTOCOL for a broken token stream
 * (then a CancelRequest has gone out). `err` is "" otherwise. `lp` (NULL when the event has none) holds
 * the tokens' logprobs and prompt logprobs; an event may carry prompt logprobs and no token (each
 * prompt position comes once, across resumptions too). The callback may call kvb_client_submit,
 * kvb_client_cancel and kvb_client_abandon on the same client. */
typedef void (*kvb_client_event_fn)(void *ud, uint64_t rid, const int32_t *tokens, const uint64_t *t_ns, int n,
                                    int first_index, kvb_finish finish, kvb_status st, const char *err,
                                    const kvb_client_logprobs *lp);

/* Sends `r` (r->id and r->resume_index unused) and returns at once with its id in *rid (it stays the
 * request's id across resumptions). `fn(ud, ...)` is called from
 * kvb_client_dispatch until the request's final event. Fails without sending (nothing tracked) when the
 * request is malformed or its message would exceed the wire's frame limit (KVB_ERR_INVALID, why in
 * `err`), or when the socket's queue stays full for timeout_ms (KVB_ERR_TIMEOUT). */
kvb_status kvb_client_submit(kvb_client *c, const kvb_request *r, kvb_client_event_fn fn, void *ud, int timeout_ms,
                             uint64_t *rid, char *err, size_t err_len);
/* Asks the server to stop `rid`; it stays live and its callback still gets the final event
 * (FINISH_CANCELLED, or the natural finish if that came first). KVB_ERR_NOT_FOUND if not live. */
kvb_status kvb_client_cancel(kvb_client *c, uint64_t rid);
/* Cancels `rid` and forgets it: its callback is never called again (a disconnected HTTP client whose
 * stream object is gone). KVB_ERR_NOT_FOUND if not live. */
kvb_status kvb_client_abandon(kvb_client *c, uint64_t rid);
/* Requests submitted and not yet finished or abandoned. */
int kvb_client_n_live(const kvb_client *c);

/* A file descriptor that becomes readable when messages or connection events may be waiting (an
 * epoll set of the ZMQ_FDs of the DEALER and of its monitor: they signal edges, so call
 * kvb_client_dispatch whenever it is readable and also after every submit, cancel or abandon, which
 * may have consumed the edge). */
int kvb_client_fd(const kvb_client *c);
/* Handles every message and connection event waiting, without blocking: token events go to their
 * callbacks, late events of abandoned requests (or of an attempt before a resumption) are dropped,
 * Pongs go to the pong callback; requests of a lost connection are resubmitted once a server is back,
 * or finish with KVB_ERR_UNAVAILABLE when resume_ms passed. KVB_ERR_IO on a socket error. */
kvb_status kvb_client_dispatch(kvb_client *c);
/* Milliseconds until kvb_client_dispatch must run even if the fd stays quiet (the end of a request's
 * resume window); -1 when nothing is waiting for a deadline. */
int kvb_client_timeout_ms(const kvb_client *c);

typedef struct kvb_client_stats {
    uint64_t connects;    /* handshakes with a server completed */
    uint64_t disconnects; /* connections lost (server gone, or silent past dead_ms) */
    uint64_t resumes;     /* requests resubmitted to a server that came back */
} kvb_client_stats;
void kvb_client_get_stats(const kvb_client *c, kvb_client_stats *out);

/* A model's numbers as its server reports them in a Pong (proto Pong; 0 from an older server). */
typedef struct kvb_client_pong {
    uint64_t nonce;
    char model[128];
    uint32_t live_requests;        /* requests the server holds (queued and running) */
    uint32_t running, waiting;     /* the engine's running and waiting sequences */
    uint64_t prompt_tokens;        /* tokens prefilled (recomputed ones included) */
    uint64_t generated_tokens;
    uint64_t preemptions;
    uint64_t prefix_hit_tokens;    /* prompt tokens served from the prefix cache */
    uint32_t blocks_total, blocks_free, blocks_own, blocks_borrowed;
    uint64_t accepted, rejected, completed, disconnects; /* the server's request counters */
    int32_t peer_pid;              /* the process that sent it, as the kernel says (SO_PEERCRED of its
                                    * ipc:// connection); -1 when unknown (tcp://) */
} kvb_client_pong;
/* Called from kvb_client_dispatch for every Pong (`p` valid during the call only). */
typedef void (*kvb_client_pong_fn)(void *ud, const kvb_client_pong *p);
void kvb_client_set_pong_fn(kvb_client *c, kvb_client_pong_fn fn, void *ud);
/* Sends a Ping without waiting; the answer comes to the pong callback with nonce *nonce. */
kvb_status kvb_client_ping_send(kvb_client *c, uint64_t *nonce);

#endif
