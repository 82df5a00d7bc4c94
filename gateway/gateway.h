/* kvbank-gateway — the node's HTTP front door: an OpenAI-compatible API over the node's models.
 *
 * One libuv loop runs everything: h2o (HTTP/1.1 and HTTP/2 on libuv) accepts connections and parses
 * requests; every model's ZeroMQ client (common/ipc/client.h, one DEALER per model carrying all of
 * that model's requests) is watched through its file descriptor; a DEALER to the coordinator asks for
 * the node's status every second (which models exist, where their endpoints are, loans, epoch).
 * Nothing here runs inside a model's step loop: the gateway only sends requests and reads token
 * events, so a slow or vanished HTTP client costs its model nothing but a cancellation.
 *
 * Per request: the body is validated (gateway/api.h), the prompt tokenized or rendered (when the
 * model has a tokenizer), the request sent; each token event goes through the incremental
 * detokenizer, the stop-string matcher (gateway/stop.h) and the Token-Deposit
 * (common/util/token_deposit.h), and leaves as a server-sent event (stream) or in one JSON body. */
#ifndef KVB_GATEWAY_GATEWAY_H
#define KVB_GATEWAY_GATEWAY_H

#include <signal.h>
#include <stdint.h>

#include "common/text/limits.h"
#include "common/util/node_config.h"
#include "common/util/util.h"

typedef struct gw_model_opts {
    const char *name;
    const char *model_dir; /* NULL: taken from the coordinator's status (Register.model) */
    double tbt_slo_ms;     /* Token-Deposit default for this model (0: off) */
} gw_model_opts;

typedef struct gw_opts {
    const char *coordinator;  /* the coordinator's endpoint */
    const char *host;         /* listen address ("127.0.0.1", "0.0.0.0", "::") */
    int port;                 /* 0: any free port (the bound one is printed) */
    size_t max_body;          /* request bodies above this get 413 (bytes) */
    int max_streams;          /* requests in flight at once; more get 429 */
    double tbt_slo_ms;        /* default Token-Deposit target of every model (0: off) */
    int status_ms;            /* how often the coordinator and the models are asked (default 1000) */
    const gw_model_opts *models; /* per-model settings from the node config (may be NULL) */
    int n_models;
    const char *port_file;    /* when set, the bound port is written there once listening */
    int drain_timeout_ms;     /* on stop: how long requests in flight may finish (default 30000) */
    size_t max_text;          /* bytes of text one request may have tokenized (0: max_body) */
    int text_workers;         /* threads that tokenize, render and detokenize (default 2) */
    const char *const *api_keys; /* [n_api_keys] accepted "Authorization: Bearer" keys; none: no auth */
    int n_api_keys;
    int health_open;          /* /health without a key (default 1) */
    int metrics_open;         /* /metrics without a key (default 1) */
    const char *tls_cert;     /* PEM files: serve HTTPS (HTTP/2 by ALPN); NULL: plain HTTP */
    const char *tls_key;
    int retry_after_s;        /* the Retry-After of a 503 for capacity a model lacks now (default 5) */
    kvb_text_limits text_limits; /* what one request's tokenizing, detokenizing and rendering may cost
                              * (default: the text layer's, kvb_text_limits_default) */
} gw_opts;

void gw_opts_default(gw_opts *o);
/* Fills `o` from a node config's "gateway" section and models (strings borrowed from `c`). */
kvb_status gw_opts_from_node(const kvb_node_config *c, gw_opts *o, gw_model_opts *models, int max_models);

/* Serves until *stop becomes nonzero (set from a signal handler). KVB_ERR_IO when the address cannot
 * be bound. */
kvb_status gw_run(const gw_opts *o, volatile sig_atomic_t *stop);

#endif
