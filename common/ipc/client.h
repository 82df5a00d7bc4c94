/* kvbank — a client for a model server: one DEALER socket that carries any number of requests at once.
 *
 * Two ways to use it. Blocking (kvbankctl, tests, benchmark threads): kvb_client_generate sends one
 * request and returns when it finished. Asynchronous (the HTTP gateway): kvb_client_submit starts a
 * request and returns at once; the caller's event loop watches kvb_client_fd and calls
 * kvb_client_dispatch, which hands every arriving TokenEvent to the request's callback. Both share one
 * core (a table of live requests keyed by the wire request_id), so the blocking call is the
 * asynchronous one plus a wait. A client is used from one thread at a time. */
#ifndef KVB_IPC_CLIENT_H
#define KVB_IPC_CLIENT_H

#include <stdint.h>

#include "common/sched/engine.h"

typedef struct kvb_client kvb_client;

/* Connects a DEALER socket to `endpoint`. Caller owns the result. */
kvb_status kvb_client_connect(const char *endpoint, kvb_client **out);
/* Closes the socket; live requests are dropped without callbacks (the server cancels them when it
 * next fails to reach this client). NULL-safe. */
void kvb_client_destroy(kvb_client *c);

/* Called for every token as it arrives; return nonzero to cancel the request. */
typedef int (*kvb_client_token_fn)(void *ud, int index, int32_t token, uint64_t t_ns);

/* Sends `r` (r->id is not used: the wire request_id comes from a counter of this client) and blocks
 * until it finishes, calling on_token for each token; after on_token returns nonzero it is not called
 * again, a CancelRequest goes out and the call waits for the finish (FINISH_CANCELLED, or the natural
 * one if that came first). `timeout_ms` bounds the wait for each message (KVB_ERR_TIMEOUT, after
 * sending a CancelRequest; negative: no bound). *finish gets the reason (FINISH_ERROR returns
 * KVB_ERR_BACKEND); an ErrorReply from the server returns its code and copies its message into `err`
 * (may be NULL). Must not be called while asynchronous requests of this client are live. */
kvb_status kvb_client_generate(kvb_client *c, const kvb_request *r, kvb_client_token_fn on_token, void *ud,
                               int timeout_ms, kvb_finish *finish, char *err, size_t err_len);
/* Round trip to the server within timeout_ms; fills the number of live requests when not NULL.
 * Must not be called while asynchronous requests of this client are live. */
kvb_status kvb_client_ping(kvb_client *c, int timeout_ms, uint32_t *live);

/* ------------------------------------------------------------------------------- asynchronous use */

/* What arrived for request `rid`: `n` new tokens (indices first_index.., with their wall-clock times,
 * ns since the epoch; both arrays valid during the call only), and on the request's last call its
 * finish reason (NONE on every call before). On that last call `st` says how it ended: KVB_OK with
 * LENGTH / STOP / CANCELLED; with FINISH_ERROR, the server's ErrorReply code (its message in `err`),
 * KVB_ERR_BACKEND when the model failed the request, or KVB_ERR_PROTOCOL for a broken token stream
 * (then a CancelRequest has gone out). `err` is "" otherwise. The callback may call
 * kvb_client_submit, kvb_client_cancel and kvb_client_abandon on the same client. */
typedef void (*kvb_client_event_fn)(void *ud, uint64_t rid, const int32_t *tokens, const uint64_t *t_ns, int n,
                                    int first_index, kvb_finish finish, kvb_status st, const char *err);

/* Sends `r` (r->id unused) and returns at once with its wire id in *rid. `fn(ud, ...)` is called from
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

/* A file descriptor that becomes readable when messages may be waiting (ZeroMQ's ZMQ_FD: it signals
 * edges, so call kvb_client_dispatch whenever it is readable and also after every submit, cancel or
 * abandon, which may have consumed the edge). */
int kvb_client_fd(const kvb_client *c);
/* Handles every message waiting, without blocking: token events go to their callbacks, late events of
 * abandoned requests are dropped, Pongs go to the pong callback. KVB_ERR_IO on a socket error. */
kvb_status kvb_client_dispatch(kvb_client *c);

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
} kvb_client_pong;
/* Called from kvb_client_dispatch for every Pong (`p` valid during the call only). */
typedef void (*kvb_client_pong_fn)(void *ud, const kvb_client_pong *p);
void kvb_client_set_pong_fn(kvb_client *c, kvb_client_pong_fn fn, void *ud);
/* Sends a Ping without waiting; the answer comes to the pong callback with nonce *nonce. */
kvb_status kvb_client_ping_send(kvb_client *c, uint64_t *nonce);

#endif
