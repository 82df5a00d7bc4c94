/* kvbank — who may talk to the coordinator, and how they prove it (docs/lending.md "Threat model of the
 * node").
 *
 * The coordinator listens on two ipc:// endpoints (nothing else): the models' EP and the control
 * clients' EP.ctl, two ROUTERs, so that a control connection can never take a model's route (its
 * routing id is only known after the handshake). Both are ZeroMQ PLAIN servers with a ZAP handler:
 * every connection is judged once, at its handshake, before its routing id can take a route.
 *  - The node has a secret: 32 random bytes that kvbankd draws at every start (or, for a coordinator
 *    run by hand, that the coordinator keeps in a key file next to its socket, mode 0600).
 *  - A model's credentials are PLAIN user = its name, password = its token,
 *    hex(HMAC-SHA-256(secret, "kvbank-model:" + name)). kvbankd hands each model only its own token,
 *    and the coordinator the secret, through an inherited pipe named by KVB_AUTH_FD (read once, then
 *    closed): a model cannot speak for another one.
 *  - A control client (kvbankctl, kvbankd's readiness probe) logs in on EP.ctl as user
 *    KVB_AUTH_CTL_USER with any password: it may ask for the status and send Controls, nothing a model
 *    sends. The socket file's mode (0600, run_dir 0700) and the uid check keep other users out.
 *  - For ipc:// the kernel tells the handler the peer's uid, gid and pid (SO_PEERCRED, which libzmq
 *    puts into the ZAP request's address): peers of another user are refused, and the pid a model
 *    registers with must be the pid of its connection. */
#ifndef KVB_IPC_AUTH_H
#define KVB_IPC_AUTH_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "common/util/util.h"

#define KVB_AUTH_SECRET_BYTES 32
#define KVB_AUTH_TOKEN_LEN 64           /* hex characters of a model's token */
#define KVB_AUTH_ZAP_MODELS "kvbank-models" /* ZAP domain of the models' endpoint */
#define KVB_AUTH_ZAP_CTL "kvbank-ctl"       /* ZAP domain of the control endpoint */
#define KVB_AUTH_CTL_USER "kvbankctl"   /* PLAIN user of control clients */
#define KVB_AUTH_FD_ENV "KVB_AUTH_FD"   /* the inherited fd kvbankd passes the credentials on */

/* Credentials of one process. */
typedef struct kvb_auth {
    int has_secret;                          /* the node secret is known (coordinator; a model by hand) */
    uint8_t secret[KVB_AUTH_SECRET_BYTES];
    char token[KVB_AUTH_TOKEN_LEN + 1];      /* a model's own token, "" when none */
    int from_supervisor;                     /* came from kvbankd through KVB_AUTH_FD */
} kvb_auth;

/* out = the token of model `name` under `secret` (64 hex characters and a NUL). */
void kvb_auth_token(const uint8_t secret[KVB_AUTH_SECRET_BYTES], const char *name, char out[KVB_AUTH_TOKEN_LEN + 1]);
/* A fresh random secret (getrandom). */
kvb_status kvb_auth_new_secret(kvb_auth *a);

/* The text that carries `a` ("secret HEX\n" when it has the secret, else "token HEX\n") into
 * out[out_len]; kvb_auth_parse reads it back (KVB_ERR_INVALID for anything else). */
kvb_status kvb_auth_format(const kvb_auth *a, char *out, size_t out_len);
kvb_status kvb_auth_parse(const char *text, kvb_auth *a);

/* Reads the credentials kvbankd passed on the fd named by $KVB_AUTH_FD, closes the fd and unsets the
 * variable (so that the process's own children do not inherit either). KVB_ERR_NOT_FOUND when the
 * variable is not set; KVB_ERR_INVALID / KVB_ERR_IO when it is set but nothing valid can be read. */
kvb_status kvb_auth_from_env(kvb_auth *a);

/* The key file of a coordinator run by hand: "<socket file>.key" of an ipc:// endpoint with a file
 * (KVB_ERR_INVALID for other endpoints). */
kvb_status kvb_auth_key_path(const char *endpoint, char *out, size_t out_len);
/* Reads a key file: it must be a regular file of this user that no one else may read (KVB_ERR_STATE
 * otherwise), KVB_ERR_NOT_FOUND when missing. */
kvb_status kvb_auth_read_file(const char *path, kvb_auth *a);
/* Writes `a` to `path` (mode 0600, through a temporary file renamed into place). */
kvb_status kvb_auth_write_file(const char *path, const kvb_auth *a);

/* The control endpoint of the coordinator at `endpoint`: "<endpoint>.ctl". */
kvb_status kvb_auth_ctl_endpoint(const char *endpoint, char *out, size_t out_len);

/* Sets a socket's PLAIN client credentials: a model's name and token, or the control client's. */
kvb_status kvb_auth_set_plain(void *sock, const char *user, const char *password);
kvb_status kvb_auth_set_ctl(void *sock);

/* ------------------------------------------------------------------------------- ZAP (RFC 27) */

/* One ZAP request, as the ZAP handler socket (a REP on inproc://zeromq.zap.01) receives it. */
typedef struct kvb_zap_req {
    char request_id[64];
    char domain[64];
    char address[128];   /* for ipc://, "...:uid:gid:pid" */
    char mechanism[16];
    char user[256];      /* PLAIN */
    char password[256];  /* PLAIN */
    long uid, gid, pid;  /* from the address; -1 when it carries none */
} kvb_zap_req;

/* Receives one ZAP request from `rep` (never blocks: KVB_ERR_NOT_FOUND when none is waiting).
 * KVB_ERR_PROTOCOL for a malformed one (it was answered with status 500 already). */
kvb_status kvb_zap_recv(void *rep, kvb_zap_req *req);
/* Answers `req`: 200 with `user_id` (the "User-Id" property of the connection's messages), or 400
 * with `why`. */
kvb_status kvb_zap_reply(void *rep, const kvb_zap_req *req, int ok, const char *user_id, const char *why);

#endif
