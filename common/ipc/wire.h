/* kvbank — encoding and validating wire messages (proto/kvbank.proto) on ZeroMQ sockets. */
#ifndef KVB_IPC_WIRE_H
#define KVB_IPC_WIRE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "common/util/util.h"
#include "proto/kvbank.pb-c.h"

#define KVB_PROTO_VERSION 1u
/* Largest frame a kvbank endpoint accepts (larger ones get an ErrorReply and are discarded). */
#define KVB_WIRE_MAX_FRAME (4u << 20)

/* The start of an ErrorReply's message when a request's grammar cannot be used (it does not compile,
 * or the model has no tokenizer): the HTTP gateway answers 400 naming the field that carried it. */
#define KVB_WIRE_GRAMMAR_ERROR "grammar: "
#define KVB_WIRE_MAX_GRAMMAR_PARTS 16 /* parts of one request's grammar */

/* Packs `env` (version is set here) into a new buffer; caller frees *buf. */
kvb_status kvb_wire_pack(Kvbank__Envelope *env, uint8_t **buf, size_t *len);
/* Which check a frame failed (kvb_wire_decode). */
typedef enum kvb_wire_fault {
    KVB_WIRE_OK = 0,
    KVB_WIRE_OVERSIZED = 1,   /* larger than KVB_WIRE_MAX_FRAME */
    KVB_WIRE_MALFORMED = 2,   /* not a protobuf Envelope */
    KVB_WIRE_VERSION = 3,     /* Envelope.version != KVB_PROTO_VERSION */
    KVB_WIRE_NO_BODY = 4,     /* no body (or one of a field number this build does not know) */
} kvb_wire_fault;

/* Decodes a frame of any body (model server and coordinator messages alike): size limit, protobuf,
 * version, a body present. Logs nothing; *fault (may be NULL) says which check failed. On success the
 * caller frees *out with kvbank__envelope__free_unpacked(*out, NULL). */
kvb_status kvb_wire_decode(const uint8_t *buf, size_t len, Kvbank__Envelope **out, kvb_wire_fault *fault);

/* Unpacks and validates a frame: size limit, protobuf well-formed, version, a known body. On success
 * the caller frees *out with kvbank__envelope__free_unpacked(*out, NULL). On failure logs why and
 * writes a one-line reason into `why` (may be NULL). */
kvb_status kvb_wire_unpack(const uint8_t *buf, size_t len, Kvbank__Envelope **out, char *why, size_t why_len);

/* Sends a packed envelope on `sock`, preceded by an identity frame when `ident` is not NULL (ROUTER).
 * KVB_ERR_IO with errno EHOSTUNREACH when the ROUTER peer is gone. Non-blocking when `dontwait`. */
kvb_status kvb_wire_send(void *sock, const void *ident, size_t ident_len, Kvbank__Envelope *env, int dontwait);

/* A bound ROUTER socket of a kvbank daemon (model server, coordinator). */
typedef struct kvb_wire_router {
    void *sock;       /* the ROUTER socket (the caller closes it) */
    char *endpoint;   /* the endpoint as bound, wildcards resolved (caller frees) */
    char *ipc_path;   /* the socket file of an ipc:// endpoint, else NULL (caller frees) */
    dev_t ipc_dev;    /* identity of that file, so that only our own is ever removed */
    ino_t ipc_ino;
} kvb_wire_router;

/* 1 if a process accepts connections on the unix socket file `path`. */
int kvb_wire_unix_live(const char *path);

/* Creates a ROUTER on `zctx` with ROUTER_MANDATORY (a send to a departed peer fails with
 * EHOSTUNREACH), ROUTER_HANDOVER when `handover` (a reconnecting peer takes its routing id back), a
 * PLAIN server whose handshakes the ZAP handler of `zap_domain` judges when that is not NULL,
 * LINGER 0, send high-water mark `sndhwm` and receive cap `maxmsg`, and binds it to `endpoint`; the
 * socket file of an ipc:// endpoint is created under umask 0077 and made 0600 (only this user may
 * connect). An ipc:// socket file on which a process already listens is never taken over (ZeroMQ would
 * unlink it and bind anew, and that process's clients would talk to this one): KVB_ERR_STATE. Logs and
 * returns KVB_ERR_IO on other failures, leaving nothing open. */
kvb_status kvb_wire_router_bind(void *zctx, const char *endpoint, int handover, const char *zap_domain, int sndhwm,
                                int64_t maxmsg, kvb_wire_router *out);

/* Reads one event from a socket monitor (the PAIR connected to zmq_socket_monitor's endpoint) without
 * waiting: 1 with the event (a ZMQ_EVENT_* value) in *ev, 0 when none is queued. */
int kvb_wire_monitor_event(void *mon, uint16_t *ev);

/* For an ipc:// endpoint with a socket file: whether this process may connect to it, before ZeroMQ
 * tries (ZeroMQ retries a refused connection silently, so a caller would only see a timeout).
 * KVB_ERR_IO with "permission denied: ..." in why[why_len] when the file or a directory on its path is
 * not open to this user, KVB_ERR_NOT_FOUND when there is no such file, KVB_ERR_INVALID when it is not a
 * socket; KVB_OK otherwise, and for every other endpoint (tcp://, abstract ipc://@name). */
kvb_status kvb_wire_ipc_check(const char *endpoint, char *why, size_t why_len);

#endif
