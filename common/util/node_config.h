/* kvbank — the node config (JSON): the coordinator endpoint and every model of one node.
 *
 * {
 *   "node": "cpu_demo",                       node name: [A-Za-z0-9_]{1,16} (used in shm tags)
 *   "run_dir": "/tmp/kvbank-cpu-demo",        sockets, pid files (created 0700); default /run/kvbank/<node>
 *   "bin_dir": "/usr/local/bin",              where the kvbank programs are (default: kvbankd's own dir)
 *   "coordinator": {
 *     "endpoint": "ipc:///tmp/kvbank-cpu-demo/coordinator.sock",   default ipc://<run_dir>/coordinator.sock
 *     "heartbeat_ms": 500,                    models heartbeat this often
 *     "heartbeat_misses": 4,                  a model silent for misses * heartbeat_ms is dead
 *     "lend_interval_s": 2.0,                 SwiftCache Alg. 1 SCALEDOWN check interval
 *     "window_s": 60.0                        Alg. 1 window t
 *   },
 *   "models": [
 *     { "name": "chat", "role": "master" | "worker",
 *       "model_dir": "models/chat",           relative paths are relative to the config file
 *       "mkmodel": "--arch llama --layers 4", optional: kvbankd creates model_dir with kvbank-mkmodel
 *       "backend": "cpu", "device": 0, "threads": 1,   with a device backend (kvb_backend_list) the
 *                                             KV region is memory of GPU `device`
 *       "kv_mb": 16,                          KV memory budget in MiB (the region's size)
 *       "block_size": 16,
 *       "endpoint": "ipc://...",              default ipc://<run_dir>/<name>.sock
 *       "policy": "recompute",                `--policy list` names them
 *       "policy_params": {"lsc": "stream"},   the planner's parameters (strings, numbers, booleans)
 *       "max_batch_tokens": 512, "max_seqs": 64,
 *       "max_live": 1024,                     requests live at once; more are refused
 *       "max_live_per_client": 256,           of them, one client's at most (default max_live / 4)
 *       "lsc": "inplace" | "stream"           master only: how lent blocks reach attention
 *       "lend": true                          worker only: false keeps all its blocks (a baseline)
 *       "tbt_slo_ms": 0                       the gateway's Token-Deposit target for this model (0: off)
 *       "stall_wait_s": 60,                   a request within the context that does not fit the KV pool
 *                                             now (blocks lent or reclaimed, a master not borrowing yet)
 *                                             waits this long, then fails: 503 (0: waits forever)
 *       "stall_overtake": 64                  later requests served past such a request meanwhile
 *       "link_preset": "h100-pcie5-scaled"    the stager's link model of its engine (kvb_link_preset;
 *                                             default: off, copies at memory speed; benchmarks set it)
 *     }, ...
 *   ],
 *   "gateway": {                              optional: kvbankd runs kvbank-gateway (HTTP, OpenAI API)
 *     "listen": "127.0.0.1:8000",             HOST:PORT ("[::1]:8000" for IPv6); port 0: any free port
 *     "max_body_kb": 1024,                    larger request bodies get 413
 *     "max_streams": 256,                     requests in flight at once; more get 429
 *     "tbt_slo_ms": 0,                        Token-Deposit default of every model (0: off)
 *     "drain_timeout_s": 30,                  on SIGTERM: requests in flight may finish for this long
 *     "max_text_kb": 1024,                    text one request may have tokenized (prompt or rendered chat)
 *     "text_workers": 2,                      threads that tokenize / render / detokenize off the loop
 *     "api_keys": ["KEY", ...],               clients send "Authorization: Bearer KEY" (401 otherwise)
 *     "api_keys_file": "keys.txt",            more keys, one a line ('#' comments), relative to the config
 *     "health_open": true, "metrics_open": true   /health, /metrics without a key
 *     "tls_cert": "cert.pem", "tls_key": "key.pem"  HTTPS (HTTP/2 by ALPN) with this PEM chain and key
 *     "retry_after_s": 5,                     Retry-After of a 503 when a model lacks the KV memory for
 *                                             a request now (it waited the model's stall_wait_s)
 *     "encode_kb": 8192, "decode_ids": 4194304,   the text layer's budgets per request (413 / 400 naming
 *     "render_steps": 20000000,               the field when spent; defaults: the text layer's,
 *     "render_output_kb": 8192, "render_memory_mb": 256   common/text/limits.h, docs/text.md)
 *   }
 * }
 * Exactly one master; names unique. The master and every worker that lends need backends of one family
 * (the part before ':'): their KV regions must be of one memory kind. Keys starting with '_' ("_comment") are ignored; other unknown
 * keys are warned about. Errors name the field and the model. */
#ifndef KVB_UTIL_NODE_CONFIG_H
#define KVB_UTIL_NODE_CONFIG_H

#include <stdint.h>

#include "common/util/util.h"

typedef enum kvb_role {
    KVB_ROLE_NONE = 0,
    KVB_ROLE_MASTER = 1,
    KVB_ROLE_WORKER = 2,
} kvb_role;

const char *kvb_role_str(kvb_role r);

typedef struct kvb_node_model {
    char *name;
    kvb_role role;
    char *model_dir;        /* absolute */
    char *mkmodel;          /* NULL when absent */
    char *backend;          /* "cpu" default */
    int device;
    int threads;            /* default 1 */
    int64_t kv_bytes;       /* kv_mb * 2^20 */
    int block_size;         /* default 16 */
    char *endpoint;
    char *policy;           /* default "recompute" */
    char **policy_keys;     /* [n_policy_params] "policy_params": {KEY: value} as text (the planner parses) */
    char **policy_values;
    int n_policy_params;
    int max_batch_tokens;   /* default 512 */
    int max_seqs;           /* default 64 */
    int max_live;           /* default 1024 */
    int max_live_per_client;/* 0: the server's default (max_live / 4) */
    int lsc_stream;         /* master: 1 for "stream", 0 for "inplace" (default) */
    int lend;               /* worker: 1 (default) lends idle blocks; 0 ("lend": false) never does */
    double tbt_slo_ms;      /* Token-Deposit target at the gateway; < 0: the gateway's default */
    double stall_wait_s;    /* kvb_engine_opts.stall_wait_s (default 60; 0: never fail) */
    char *link_preset;      /* kvb_engine_opts.links by name (NULL: off); checked by the model process */
    int stall_overtake;     /* kvb_engine_opts.stall_overtake (default 64) */
} kvb_node_model;

typedef struct kvb_node_gateway {
    int enabled;            /* the config has a "gateway" section */
    char *host;             /* listen address, without brackets (default 127.0.0.1) */
    int port;               /* default 8000 */
    int64_t max_body;       /* bytes (max_body_kb * 1024, default 1 MiB) */
    int max_streams;        /* default 256 */
    double tbt_slo_ms;      /* default 0 */
    double drain_timeout_s; /* how long a stopping gateway lets requests in flight finish (default 30) */
    int64_t max_text;       /* bytes of text one request may have tokenized (max_text_kb * 1024, default
                             * the body limit) */
    int text_workers;       /* threads that tokenize, render and detokenize off the loop (default 2) */
    char **api_keys;        /* [n_api_keys] keys a client must send as "Authorization: Bearer KEY" (none:
                             * no authentication); from "api_keys" and the lines of "api_keys_file" */
    int n_api_keys;
    int health_open;        /* /health answers without a key (default 1) */
    int metrics_open;       /* /metrics answers without a key (default 1) */
    char *tls_cert;         /* PEM certificate chain and key: HTTPS (h2 by ALPN) instead of HTTP; NULL: none */
    char *tls_key;
    int retry_after_s;      /* Retry-After of a 503 for KV memory a model lacks now (default 5) */
    /* the text layer's budgets per request (common/text/limits.h); 0: the text layer's default */
    int64_t encode_bytes;   /* "encode_kb" * 1024: text one tokenization takes */
    int64_t decode_ids;     /* "decode_ids": ids one /detokenize takes */
    int64_t render_steps;   /* "render_steps": work one chat-template render may do */
    int64_t render_output;  /* "render_output_kb" * 1024: text one render may produce */
    int64_t render_memory;  /* "render_memory_mb" * 2^20: memory one render may allocate */
} kvb_node_gateway;

typedef struct kvb_node_config {
    char *path;             /* the file it was read from (absolute) */
    char *node;
    char *run_dir;
    char *bin_dir;          /* NULL: the caller decides */
    char *coordinator;      /* coordinator endpoint */
    int heartbeat_ms;       /* default 500 */
    int heartbeat_misses;   /* default 4 (a silent master holding loans is fenced, see coordinator/ledger.h) */
    double lend_interval_s; /* default 2 */
    double window_s;        /* default 60 */
    kvb_node_model *models;
    int n_models;
    kvb_node_gateway gateway;
} kvb_node_config;

/* Reads and validates `path`. Caller owns the result (kvb_node_config_free). */
kvb_status kvb_node_config_load(const char *path, kvb_node_config **out);
void kvb_node_config_free(kvb_node_config *c);
/* The model called `name`, or NULL. */
const kvb_node_model *kvb_node_config_model(const kvb_node_config *c, const char *name);
/* The master, or NULL. */
const kvb_node_model *kvb_node_config_master(const kvb_node_config *c);
/* The shm tag of a model's region: "<node>_<model>". Writes at most len bytes. */
void kvb_node_region_tag(const kvb_node_config *c, const char *model, char *tag, size_t len);

#endif
