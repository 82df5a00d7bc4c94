/* kvbank — a model process of the node (kvbank-master, kvbank-worker): setup, loop, teardown. */
#include "node/node_proc.h"

#include <errno.h>
#include <inttypes.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/ipc/auth.h"
#include "common/kv/block_pool.h"
#include "common/mem/region.h" /* stale-segment cleanup of the host backend's names */
#include "common/model/model.h"
#include "common/policy/policy.h"

#define DEFAULT_KV_MB 16.0
#define DEFAULT_HEARTBEAT_MS 500
#define DEFAULT_LEND_INTERVAL_S 2.0
#define DEFAULT_WINDOW_S 60.0

static volatile sig_atomic_t g_signals; /* SIGINT/SIGTERM received */

static void on_signal(int sig) {
    (void)sig;
    if (g_signals < 100) g_signals++;
}

int kvb_node_proc_signals(void) { return (int)g_signals; }

struct kvb_node_proc {
    kvb_node_proc_args args;  /* a copy (cfg borrowed from the caller's) */
    kvb_node_role role;
    kvb_backend *be;
    kvb_model *model;
    kvb_kv_geom geom;
    kvb_mem_region *region;   /* own KV memory: one exportable region of be->mem */
    kvb_server *srv;
    kvb_engine *eng;
    kvb_node_client *nc;
    kvb_planner pool_planner; /* worker: the lending decisions (swiftcache's plan_pool) */
    zmq_pollitem_t items[1];  /* the coordinator socket, polled by the server loop */
};

/* ------------------------------------------------------------------------------------ command line */

static void usage(FILE *f, kvb_role role) {
    int w = role == KVB_ROLE_WORKER;
    const char *prog = w ? "kvbank-worker" : "kvbank-master";
    fprintf(f,
            "usage: %s --config NODE.json --name NAME [options]\n"
            "       %s --model DIR --endpoint EP --coordinator EP [options]\n"
            "\n",
            prog, prog);
    if (w)
        fprintf(f,
                "Serves one model of a kvbank node as a worker: requests on its own ZeroMQ endpoint, KV cache in\n"
                "one exportable region the master may borrow blocks of: a POSIX shared-memory object\n"
                "(/kvb-TAG-PID-N, mode 0600) on the cpu backend, device memory with an IPC handle on a GPU.\n"
                "Every lend interval it lends the free tail of its cache (SwiftCache Alg. 1 SCALEDOWN over the\n"
                "window, in multiples of the minimum elastic unit) through kvbank-coordinator, and reclaims\n"
                "blocks (SCALEUP) when its own requests need them.\n");
    else
        fprintf(f,
                "Serves the master model of a kvbank node: requests on its own ZeroMQ endpoint, KV cache in one\n"
                "exportable region (POSIX shm /kvb-TAG-PID-N, mode 0600, on the cpu backend; device memory on a\n"
                "GPU), plus the blocks workers lend it through kvbank-coordinator, which it imports by handle\n"
                "and attends to in place (or streams through the layer stream cache with --lsc stream, also\n"
                "from another GPU). Logs the SwiftCache LSC/RC plan (Eq. 1-5) of the node.\n");
    fprintf(f,
            "It keeps serving its own requests while the coordinator is away and registers again when it\n"
            "is back. SIGINT or SIGTERM: stop accepting, cancel live requests (FINISH_CANCELLED),\n"
            "%s if the coordinator answers within a few seconds, unmap, remove the\n"
            "region; exit status 0 (a second signal skips the wait).\n"
            "\n"
            "options:\n"
            "  --config FILE          node config (JSON, common/util/node_config.h); with --name, takes the\n"
            "                         model's entry and the coordinator settings from it (flags below win)\n"
            "  --name NAME            the model's name in the node (routing id, logs); letters, digits, '-'\n"
            "                         and '_', at most %d characters (default: the model directory's name)\n"
            "  --model DIR            Hugging Face model directory (config.json + *.safetensors)\n"
            "  --endpoint EP          where to serve requests (ipc://... or tcp://...)\n"
            "  --coordinator EP       the coordinator's endpoint\n"
            "  --kv-mb N              KV memory in MiB, fractions allowed (default %g)\n"
            "  --block-size N         tokens per KV block (default 16)\n"
            "  --threads N            CPU threads (default 1)\n"
            "  --backend NAME         compute backend (built in: %s; default cpu); with a device\n"
            "                         backend the KV region is device memory lent through its IPC handle\n"
            "  --device N             the GPU of a device backend (default 0)\n"
            "  --policy NAME          planner (default recompute; kvbank-generate --policy list names them)\n"
            "  --policy-param K=V     a parameter of the planner (repeat for more; after the config's\n"
            "                         \"policy_params\")\n"
            "  --max-batch-tokens N   token budget per engine step (default 512)\n"
            "  --max-seqs N           most running sequences (default 64)\n"
            "  --max-live N           requests live at once before new ones are rejected (default 1024)\n"
            "  --max-live-per-client N  of them, one client's (DEALER socket's) at most (default max-live / 4)\n"
            "  --no-prefix-cache      do not reuse KV blocks across requests\n"
            "  --no-lend              worker: never lend blocks (as \"lend\": false in the node config)\n"
            "  --heartbeat-ms N       heartbeat period until the coordinator sets one (default %d)\n",
            w ? "give back lent blocks" : "give back borrowed blocks", KVB_NODE_NAME_MAX, DEFAULT_KV_MB,
            kvb_backend_list(), DEFAULT_HEARTBEAT_MS);
    if (w)
        fprintf(f,
                "  --lend-interval S      seconds between Alg. 1 SCALEDOWN checks, fractions allowed (default %g)\n"
                "  --window S             Alg. 1 window t: the longest request of the last S seconds is kept\n"
                "                         room for (default %g)\n",
                DEFAULT_LEND_INTERVAL_S, DEFAULT_WINDOW_S);
    else
        fprintf(f, "  --lsc MODE             inplace (default) or stream: how lent blocks reach attention\n");
    fprintf(f,
            "  -h, --help             this text\n"
            "\n"
            "With --config the region tag is <node>_<name>, otherwise the name. Log level:\n"
            "KVB_LOG_LEVEL=error|warn|info|debug. Exit status 1 on an error, 2 on a usage error.\n");
}

static int valid_name(const char *s, size_t max) {
    size_t n = strlen(s);
    if (n == 0 || n > max) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_'))
            return 0;
    }
    return 1;
}


void kvb_node_proc_args_free(kvb_node_proc_args *a) {
    if (!a) return;
    kvb_node_config_free(a->cfg);
    a->cfg = NULL;
    kvb_policy_params_free(&a->policy_params);
}

int kvb_node_proc_parse(kvb_role role, int argc, char **argv, kvb_node_proc_args *a) {
    memset(a, 0, sizeof *a);
    a->role = role;
    a->prog = role == KVB_ROLE_WORKER ? "kvbank-worker" : "kvbank-master";
    const char *config = NULL, *name = NULL, *lsc = NULL;
    /* flags; unset: 0 / NULL / negative */
    const char *f_model = NULL, *f_ep = NULL, *f_coord = NULL, *f_backend = NULL, *f_policy = NULL;
    int f_threads = 0, f_bs = 0, f_mbt = 0, f_seqs = 0, f_live = 0, f_hb = 0, no_pc = 0, no_lend = 0, f_per_client = 0,
        f_device = -1;
    double f_kv_mb = -1, f_lend = -1, f_window = -1;
    const char *f_pparams[64]; /* --policy-param KEY=VALUE, in argv */
    int n_pparams = 0;

    enum { O_CONFIG = 256, O_NAME, O_MODEL, O_EP, O_COORD, O_KVMB, O_BS, O_THREADS, O_BACKEND, O_POLICY, O_MBT,
           O_SEQS, O_LIVE, O_NOPC, O_HB, O_LEND, O_WINDOW, O_LSC, O_NOLEND, O_PER_CLIENT, O_DEVICE, O_PPARAM };
    struct option opts[32] = {
        {"config", 1, 0, O_CONFIG},   {"name", 1, 0, O_NAME},         {"model", 1, 0, O_MODEL},
        {"endpoint", 1, 0, O_EP},     {"coordinator", 1, 0, O_COORD}, {"kv-mb", 1, 0, O_KVMB},
        {"block-size", 1, 0, O_BS},   {"threads", 1, 0, O_THREADS},   {"backend", 1, 0, O_BACKEND},
        {"policy", 1, 0, O_POLICY},   {"max-batch-tokens", 1, 0, O_MBT}, {"max-seqs", 1, 0, O_SEQS},
        {"max-live", 1, 0, O_LIVE},   {"no-prefix-cache", 0, 0, O_NOPC}, {"heartbeat-ms", 1, 0, O_HB},
        {"max-live-per-client", 1, 0, O_PER_CLIENT}, {"device", 1, 0, O_DEVICE}, {"policy-param", 1, 0, O_PPARAM},
        {"help", 0, 0, 'h'}};
    int n_opts = 0;
    while (opts[n_opts].name) n_opts++;
    if (role == KVB_ROLE_WORKER) {
        opts[n_opts++] = (struct option){"no-lend", 0, 0, O_NOLEND};
        opts[n_opts++] = (struct option){"lend-interval", 1, 0, O_LEND};
        opts[n_opts++] = (struct option){"window", 1, 0, O_WINDOW};
    } else {
        opts[n_opts++] = (struct option){"lsc", 1, 0, O_LSC};
    }
    opts[n_opts] = (struct option){0, 0, 0, 0};

    int c, li = -1;
    opterr = 1;
    while ((li = -1, c = getopt_long(argc, argv, "h", opts, &li)) != -1) {
        int64_t v = 0;
        double d = 0;
        kvb_status st = KVB_OK;
        switch (c) {
        case O_CONFIG: config = optarg; break;
        case O_NAME: name = optarg; break;
        case O_MODEL: f_model = optarg; break;
        case O_EP: f_ep = optarg; break;
        case O_COORD: f_coord = optarg; break;
        case O_BACKEND: f_backend = optarg; break;
        case O_POLICY: f_policy = optarg; break;
        case O_PPARAM:
            if (!strchr(optarg, '=') || optarg[0] == '=' || n_pparams == (int)KVB_ARRAY_LEN(f_pparams)) {
                fprintf(stderr, "%s: --policy-param needs KEY=VALUE (at most %d), got '%s'\n", a->prog,
                        (int)KVB_ARRAY_LEN(f_pparams), optarg);
                return 2;
            }
            f_pparams[n_pparams++] = optarg;
            break;
        case O_LSC: lsc = optarg; break;
        case O_NOPC: no_pc = 1; break;
        case O_NOLEND: no_lend = 1; break;
        case O_THREADS: st = kvb_parse_i64(optarg, 1, 1024, &v); f_threads = (int)v; break;
        case O_BS: st = kvb_parse_i64(optarg, 1, 1 << 16, &v); f_bs = (int)v; break;
        case O_MBT: st = kvb_parse_i64(optarg, 1, 1 << 30, &v); f_mbt = (int)v; break;
        case O_SEQS: st = kvb_parse_i64(optarg, 1, 1 << 20, &v); f_seqs = (int)v; break;
        case O_LIVE: st = kvb_parse_i64(optarg, 1, 1 << 20, &v); f_live = (int)v; break;
        case O_PER_CLIENT: st = kvb_parse_i64(optarg, 1, 1 << 20, &v); f_per_client = (int)v; break;
        case O_HB: st = kvb_parse_i64(optarg, 10, 60000, &v); f_hb = (int)v; break;
        case O_DEVICE: st = kvb_parse_i64(optarg, 0, 1023, &v); f_device = (int)v; break;
        case O_KVMB:
            st = kvb_parse_f64(optarg, &d);
            if (st == KVB_OK && !(d > 0 && d <= 1 << 24)) st = KVB_ERR_INVALID;
            f_kv_mb = d;
            break;
        case O_LEND:
            st = kvb_parse_f64(optarg, &d);
            if (st == KVB_OK && !(d >= 0.01 && d <= 86400)) st = KVB_ERR_INVALID;
            f_lend = d;
            break;
        case O_WINDOW:
            st = kvb_parse_f64(optarg, &d);
            if (st == KVB_OK && !(d > 0 && d <= 86400 * 7)) st = KVB_ERR_INVALID;
            f_window = d;
            break;
        case 'h': usage(stdout, role); return 0;
        default: usage(stderr, role); return 2;
        }
        if (st != KVB_OK) {
            fprintf(stderr, "%s: bad value '%s' for --%s\n", a->prog, optarg, li >= 0 ? opts[li].name : "?");
            return 2;
        }
    }
    if (optind != argc) {
        fprintf(stderr, "%s: unexpected argument '%s'\n", a->prog, argv[optind]);
        usage(stderr, role);
        return 2;
    }
    if (lsc && strcmp(lsc, "inplace") != 0 && strcmp(lsc, "stream") != 0) {
        fprintf(stderr, "%s: --lsc is inplace or stream, got '%s'\n", a->prog, lsc);
        return 2;
    }
    if (name && !valid_name(name, KVB_NODE_NAME_MAX)) {
        fprintf(stderr, "%s: --name must be 1..%d letters, digits, '-' or '_', got '%s'\n", a->prog,
                KVB_NODE_NAME_MAX, name);
        return 2;
    }

    /* defaults, then the config entry, then the flags */
    a->backend = "cpu";
    a->policy = "recompute";
    a->threads = 1;
    a->block_size = 16;
    a->kv_bytes = (int64_t)(DEFAULT_KV_MB * 1048576.0);
    a->max_batch_tokens = 512;
    a->max_seqs = 64;
    a->max_live = 1024;
    a->prefix_cache = 1;
    a->heartbeat_ms = DEFAULT_HEARTBEAT_MS;
    a->lend_interval_s = DEFAULT_LEND_INTERVAL_S;
    a->lend = 1;
    a->window_s = DEFAULT_WINDOW_S;
    a->stall_wait_s = 60;
    a->stall_overtake = 64;
    if (config) {
        if (!name) {
            fprintf(stderr, "%s: --config needs --name (the model's entry)\n", a->prog);
            return 2;
        }
        kvb_status st = kvb_node_config_load(config, &a->cfg);
        if (st != KVB_OK) {
            fprintf(stderr, "%s: cannot read the node config %s: %s\n", a->prog, config, kvb_status_str(st));
            return 1;
        }
        const kvb_node_model *m = kvb_node_config_model(a->cfg, name);
        if (!m) {
            fprintf(stderr, "%s: the node config %s has no model named '%s'\n", a->prog, config, name);
            kvb_node_proc_args_free(a);
            return 2;
        }
        if (m->role != role) {
            fprintf(stderr, "%s: model '%s' is a %s in %s, not a %s\n", a->prog, name, kvb_role_str(m->role), config,
                    kvb_role_str(role));
            kvb_node_proc_args_free(a);
            return 2;
        }
        kvb_node_region_tag(a->cfg, name, a->tag, sizeof a->tag);
        if (!valid_name(a->tag, KVB_NODE_NAME_MAX)) {
            fprintf(stderr, "%s: region tag '%s' (node_model) is not 1..%d letters, digits, '-' or '_'\n", a->prog,
                    a->tag, KVB_NODE_NAME_MAX);
            kvb_node_proc_args_free(a);
            return 1;
        }
        a->model_dir = m->model_dir;
        a->endpoint = m->endpoint;
        a->coordinator = a->cfg->coordinator;
        if (m->backend) a->backend = m->backend;
        a->device = m->device;
        if (m->policy) a->policy = m->policy;
        if (m->threads > 0) a->threads = m->threads;
        if (m->block_size > 0) a->block_size = m->block_size;
        if (m->kv_bytes > 0) a->kv_bytes = m->kv_bytes;
        if (m->max_batch_tokens > 0) a->max_batch_tokens = m->max_batch_tokens;
        if (m->max_seqs > 0) a->max_seqs = m->max_seqs;
        if (m->max_live > 0) a->max_live = m->max_live;
        a->max_live_per_client = m->max_live_per_client;
        a->lsc_stream = m->lsc_stream;
        a->lend = m->lend;
        a->stall_wait_s = m->stall_wait_s;
        a->stall_overtake = m->stall_overtake;
        a->link_preset = m->link_preset;
        if (a->cfg->heartbeat_ms > 0) a->heartbeat_ms = a->cfg->heartbeat_ms;
        if (a->cfg->lend_interval_s > 0) a->lend_interval_s = a->cfg->lend_interval_s;
        if (a->cfg->window_s > 0) a->window_s = a->cfg->window_s;
    }
    if (f_model) a->model_dir = f_model;
    if (f_ep) a->endpoint = f_ep;
    if (f_coord) a->coordinator = f_coord;
    if (f_backend) a->backend = f_backend;
    if (f_device >= 0) a->device = f_device;
    if (f_policy) a->policy = f_policy;
    if (f_threads) a->threads = f_threads;
    if (f_bs) a->block_size = f_bs;
    if (f_mbt) a->max_batch_tokens = f_mbt;
    if (f_seqs) a->max_seqs = f_seqs;
    if (f_live) a->max_live = f_live;
    if (f_per_client) a->max_live_per_client = f_per_client;
    if (f_hb) a->heartbeat_ms = f_hb;
    if (no_pc) a->prefix_cache = 0;
    if (no_lend) a->lend = 0;
    if (f_kv_mb > 0) a->kv_bytes = (int64_t)(f_kv_mb * 1048576.0);
    if (f_lend > 0) a->lend_interval_s = f_lend;
    if (f_window > 0) a->window_s = f_window;
    if (lsc) a->lsc_stream = !strcmp(lsc, "stream");
    /* the config's policy parameters, then the flags (a later value of a key wins) */
    const kvb_node_model *cm = a->cfg ? kvb_node_config_model(a->cfg, name) : NULL;
    kvb_status pst = KVB_OK;
    for (int i = 0; cm && i < cm->n_policy_params && pst == KVB_OK; i++)
        pst = kvb_policy_params_set(&a->policy_params, cm->policy_keys[i], cm->policy_values[i]);
    for (int i = 0; i < n_pparams && pst == KVB_OK; i++) pst = kvb_policy_params_add(&a->policy_params, f_pparams[i]);
    if (pst != KVB_OK) {
        fprintf(stderr, "%s: out of memory\n", a->prog);
        kvb_node_proc_args_free(a);
        return 1;
    }

    if (!a->model_dir || !a->endpoint || !a->coordinator) {
        fprintf(stderr, "%s: %s%s%s required (or --config with --name)\n", a->prog, a->model_dir ? "" : "--model ",
                a->endpoint ? "" : "--endpoint ", a->coordinator ? "" : "--coordinator ");
        usage(stderr, role);
        kvb_node_proc_args_free(a);
        return 2;
    }
    if (name) snprintf(a->name, sizeof a->name, "%s", name);
    else kvb_name_from_path(a->model_dir, a->name, KVB_NODE_NAME_MAX);
    if (!a->cfg) snprintf(a->tag, sizeof a->tag, "%s", a->name);
    return -1;
}

/* ------------------------------------------------------------------------------------------ hooks */

static void hook_ready(void *ud) {
    kvb_node_proc *p = ud;
    if (p->items[0].revents & ZMQ_POLLIN) kvb_node_client_on_ready(p->nc);
}

static int hook_tick(void *ud) {
    kvb_node_proc *p = ud;
    int w1 = p->role.on_tick ? p->role.on_tick(p->role.ud) : -1;
    int w2 = kvb_node_client_tick(p->nc);
    p->items[0].socket = kvb_node_client_pollitem(p->nc).socket; /* a reconnection replaces it */
    if (w1 < 0) return w2;
    if (w2 < 0) return w1;
    return KVB_MIN(w1, w2);
}

static void hook_step_begin(void *ud) { kvb_node_client_busy_begin(((kvb_node_proc *)ud)->nc); }

static void hook_step_end(void *ud) { kvb_node_client_busy_end(((kvb_node_proc *)ud)->nc); }

static void hook_request(void *ud, const kvb_request *r) {
    kvb_node_proc *p = ud;
    if (p->role.on_request) p->role.on_request(p->role.ud, r);
}

void kvb_node_proc_load(const kvb_node_proc *p, kvb_node_load *out) {
    memset(out, 0, sizeof *out);
    if (!p || !p->eng) return;
    kvb_engine_stats es;
    kvb_engine_get_stats(p->eng, &es);
    int own = kvb_engine_n_own(p->eng);
    int used = es.blocks_total - es.blocks_free;
    if (kvb_engine_planner_owns_kv(p->eng)) {
        /* the region is the model's registered capacity; its KV lives elsewhere and nothing is lent */
        int cap = (int)(kvb_mem_region_size(p->region) / kvb_kv_block_bytes(&p->geom));
        used = (int)((int64_t)used * cap / KVB_MAX(own, 1));
        own = cap;
    }
    out->n_own = (uint32_t)(own > 0 ? own : 0);
    out->n_used = (uint32_t)KVB_MAX(0, KVB_MIN(used, own));
    out->live_requests = (uint32_t)kvb_engine_n_live(p->eng);
    out->waiting_requests = (uint32_t)KVB_MAX(es.n_waiting, 0);
    out->tokens_generated = es.generated_tokens;
}

/* -------------------------------------------------------------------------------------- lifecycle */

/* 1 when a worker may lend to this node's master: some worker of the config lends, or there is no
 * config (the master run by hand cannot know its lenders). */
static int node_lends(const kvb_node_proc_args *a) {
    for (int i = 0; a->cfg && i < a->cfg->n_models; i++)
        if (a->cfg->models[i].role == KVB_ROLE_WORKER && a->cfg->models[i].lend) return 1;
    return !a->cfg;
}

/* The model's planner: its policy with its parameters. "lsc": "stream" (--lsc stream) is the swiftcache
 * planner's parameter lsc=stream; with the default policy it picks that planner. With a node config the
 * master also passes lenders_bytes, the KV budgets of the workers that lend (Eq. 2's C_i): its layer
 * stream cache then comes out of its own budget, sized by Eq. 1-5 (SwiftCache §3.3; issue 10), and it
 * registers how many blocks that LSC streams (the coordinator caps the workers' offers at it). */
static kvb_status make_planner(const kvb_node_proc_args *a, kvb_planner *out) {
    kvb_policy_params pp = {0};
    const char *policy = a->policy;
    kvb_status st = KVB_OK;
    for (int i = 0; i < a->policy_params.n && st == KVB_OK; i++)
        st = kvb_policy_params_set(&pp, a->policy_params.items[i].key, a->policy_params.items[i].value);
    if (st == KVB_OK && a->role == KVB_ROLE_MASTER && a->lsc_stream) {
        if (!strcmp(policy, "recompute")) policy = "swiftcache"; /* the layer stream cache is SwiftCache's */
        st = kvb_policy_params_set(&pp, "lsc", "stream");
        int64_t lend = 0;
        for (int i = 0; a->cfg && i < a->cfg->n_models; i++)
            if (a->cfg->models[i].role == KVB_ROLE_WORKER && a->cfg->models[i].lend) lend += a->cfg->models[i].kv_bytes;
        if (st == KVB_OK && lend > 0 && !kvb_policy_params_get(&pp, "lenders_bytes")) {
            char v[32];
            snprintf(v, sizeof v, "%" PRId64, lend);
            st = kvb_policy_params_set(&pp, "lenders_bytes", v);
        }
    }
    if (st == KVB_OK) st = kvb_policy_create(policy, &pp, out);
    kvb_policy_params_free(&pp);
    return st;
}

/* A worker's lending planner: swiftcache (Alg. 1) over the node's window, with the model's parameters
 * when its policy is swiftcache. */
static kvb_status make_pool_planner(const kvb_node_proc_args *a, kvb_planner *out) {
    kvb_policy_params pp = {0};
    kvb_status st = KVB_OK;
    int own = !strcmp(a->policy, "swiftcache");
    for (int i = 0; own && i < a->policy_params.n && st == KVB_OK; i++)
        st = kvb_policy_params_set(&pp, a->policy_params.items[i].key, a->policy_params.items[i].value);
    if (st == KVB_OK && !kvb_policy_params_get(&pp, "window_s")) {
        char w[32];
        snprintf(w, sizeof w, "%.17g", a->window_s);
        st = kvb_policy_params_set(&pp, "window_s", w);
    }
    if (st == KVB_OK) st = kvb_policy_create("swiftcache", &pp, out);
    kvb_policy_params_free(&pp);
    return st;
}

kvb_status kvb_node_proc_plan_pool(kvb_node_proc *p, const kvb_pool_event *ev, kvb_pool_plan *out) {
    if (!p || !p->pool_planner.iface) return KVB_ERR_UNSUPPORTED;
    return kvb_engine_plan_pool(p->eng, &p->pool_planner, ev, out);
}

kvb_status kvb_node_proc_create(const kvb_node_proc_args *a, const kvb_node_role *role, kvb_node_proc **out) {
    if (!a || !role || !out) return KVB_ERR_INVALID;
    const char *prog = a->prog;
    kvb_log_set_tag(a->name);

    /* Handlers first, so that a signal during loading still leads through the cleanup. Without
     * SA_RESTART, so that a blocking poll returns EINTR at once. */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    kvb_status st = KVB_OK;
    kvb_node_proc *p = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *p, (void **)&p));
    p->args = *a;
    p->role = *role;
    kvb_planner planner = {0};
    int planner_owned = 0;

    if ((st = make_planner(a, &planner)) != KVB_OK) {
        fprintf(stderr, "%s: cannot create policy '%s' (see the log; kvbank-generate --policy list names them)\n", prog,
                a->policy);
        goto fail;
    }
    planner_owned = 1;
    if ((st = kvb_backend_create_on(a->backend, a->device, a->threads, &p->be)) != KVB_OK) {
        fprintf(stderr, "%s: cannot create backend '%s' on device %d: %s\n", prog, a->backend, a->device,
                kvb_status_str(st));
        goto fail;
    }
    if ((st = kvb_model_load(a->model_dir, p->be, &p->model)) != KVB_OK) {
        fprintf(stderr, "%s: cannot load model from %s: %s\n", prog, a->model_dir, kvb_status_str(st));
        goto fail;
    }
    p->geom = kvb_model_kv_geom(p->model, a->block_size);
    if (kvb_kv_geom_check(&p->geom) != KVB_OK) {
        fprintf(stderr, "%s: invalid KV geometry for block size %d\n", prog, a->block_size);
        st = KVB_ERR_INVALID;
        goto fail;
    }
    size_t block_bytes = kvb_kv_block_bytes(&p->geom);
    int64_t n_blocks = a->kv_bytes / (int64_t)block_bytes;
    if (n_blocks < 1 || n_blocks > (1 << 30)) {
        fprintf(stderr, "%s: %lld bytes of KV memory hold %lld blocks of %zu bytes (need 1 .. 2^30)\n", prog,
                (long long)a->kv_bytes, (long long)n_blocks, block_bytes);
        st = KVB_ERR_INVALID;
        goto fail;
    }
    size_t kv_bytes = (size_t)n_blocks * block_bytes; /* whole blocks: the region is block-aligned */

    int n_stale = 0;
    kvb_region_unlink_stale(a->tag, &n_stale);
    if ((st = kvb_mem_region_create(p->be->mem, a->tag, kv_bytes, &p->region)) != KVB_OK) {
        fprintf(stderr, "%s: cannot create a %zu-byte exportable KV region in %s memory: %s\n", prog, kv_bytes,
                kvb_mem_kind(p->be->mem), kvb_status_str(st));
        goto fail;
    }
    kvb_server_opts so = {.endpoint = a->endpoint, .model_name = a->name, .max_live = a->max_live,
                          .max_per_client = a->max_live_per_client, .vocab = kvb_model_cfg(p->model)->vocab,
                          .model_dir = a->model_dir};
    if ((st = kvb_server_create(&so, &p->srv)) != KVB_OK) {
        fprintf(stderr, "%s: cannot serve on %s: %s\n", prog, a->endpoint, kvb_status_str(st));
        goto fail;
    }
    kvb_engine_opts eo;
    kvb_engine_opts_default(&eo);
    eo.block_size = a->block_size;
    eo.n_blocks = (int)n_blocks;
    eo.max_batch_tokens = a->max_batch_tokens;
    eo.max_seqs = a->max_seqs;
    eo.enable_prefix_cache = a->prefix_cache;
    eo.stall_wait_s = a->stall_wait_s;
    eo.stall_overtake = a->stall_overtake;
    eo.borrows = a->role == KVB_ROLE_MASTER && node_lends(a);
    eo.kv_mem = kvb_mem_region_base(p->region);
    eo.kv_mem_bytes = kvb_mem_region_size(p->region);
    if (a->link_preset) { /* kvb_link_preset logs the known names for a bad one */
        if ((st = kvb_link_preset(a->link_preset, p->be, &eo.links)) != KVB_OK) {
            fprintf(stderr, "%s: unknown \"link_preset\" '%s' (kvbank-generate --link-preset list names them)\n", prog,
                    a->link_preset);
            goto fail;
        }
    }
    kvb_engine_events ev = kvb_server_engine_events(p->srv);
    planner_owned = 0; /* kvb_engine_create takes the planner, also when it fails */
    if ((st = kvb_engine_create(p->model, &eo, &planner, &ev, &p->eng)) != KVB_OK) {
        fprintf(stderr, "%s: cannot create the engine: %s\n", prog, kvb_status_str(st));
        goto fail;
    }
    if (a->link_preset) { /* as calibrated by the engine (a scaled preset) */
        fprintf(stderr, "%s: ", prog);
        kvb_link_model_print(stderr, kvb_engine_links(p->eng));
    }
    if (a->role == KVB_ROLE_WORKER && (st = make_pool_planner(a, &p->pool_planner)) != KVB_OK) {
        fprintf(stderr, "%s: cannot create the lending planner (swiftcache): %s\n", prog, kvb_status_str(st));
        goto fail;
    }
    kvb_server_attach(p->srv, p->eng);
    if (kvb_engine_planner_owns_kv(p->eng)) {
        /* eLLM's planners keep the KV in their own chunk pool, not in the exportable region */
        if (a->role == KVB_ROLE_MASTER) {
            fprintf(stderr, "%s: policy %s keeps its own KV memory, so this model cannot borrow blocks; run it as a "
                            "worker with \"lend\": false\n", prog, a->policy);
            st = KVB_ERR_INVALID;
            goto fail;
        }
        if (a->lend) KVB_LOG_I("policy %s keeps its own KV memory: this worker lends nothing", a->policy);
        p->args.lend = 0;
    } else if (a->role == KVB_ROLE_MASTER && kvb_block_pool_is_sliced(kvb_engine_pool(p->eng))) {
        /* OrbitFlow's planners: per-layer slices of the region (docs/papers/orbitflow.md, sliced pools) */
        KVB_LOG_W("policy %s places KV per (block, layer) slice and a sliced pool cannot attach borrowed memory: "
                  "this master serves from its own blocks and the host tier; loans offered to it go back to their "
                  "lenders", a->policy);
    }

    /* The coordinator's credentials: kvbankd passes this model's token (KVB_AUTH_FD); run by hand, the
     * node client derives it from the coordinator's key file. */
    kvb_auth auth;
    char token[KVB_AUTH_TOKEN_LEN + 1] = "";
    kvb_status ast = kvb_auth_from_env(&auth);
    if (ast == KVB_OK) {
        if (auth.has_secret) kvb_auth_token(auth.secret, a->name, token);
        else memcpy(token, auth.token, sizeof token);
        explicit_bzero(&auth, sizeof auth);
    } else if (ast != KVB_ERR_NOT_FOUND) {
        fprintf(stderr, "%s: unreadable credentials on $%s\n", prog, KVB_AUTH_FD_ENV);
        st = ast;
        goto fail;
    }
    kvb_node_identity id = {.name = a->name, .role = a->role, .geom = p->geom, .token = token[0] ? token : NULL,
                            .region = kvb_mem_region_handle(p->region),
                            .region_bytes = kvb_mem_region_size(p->region), .memory = kvb_mem_kind(p->be->mem),
                            .device = (uint32_t)kvb_mem_device(p->be->mem),
                            .stream = a->role == KVB_ROLE_MASTER && a->lsc_stream, .capacity = (uint32_t)n_blocks,
                            .borrow_limited = a->role == KVB_ROLE_MASTER && kvb_engine_max_borrowed(p->eng) >= 0,
                            .max_borrow = (uint32_t)KVB_MAX(kvb_engine_max_borrowed(p->eng), 0),
                            .endpoint = kvb_server_endpoint(p->srv), .model = a->model_dir};
    st = kvb_node_client_create(a->coordinator, &id, &role->cb, a->heartbeat_ms, &p->nc);
    explicit_bzero(token, sizeof token);
    if (st != KVB_OK) {
        fprintf(stderr, "%s: cannot connect to the coordinator at %s: %s\n", prog, a->coordinator,
                kvb_status_str(st));
        goto fail;
    }
    p->items[0] = kvb_node_client_pollitem(p->nc);
    kvb_server_hooks h = {.ud = p, .items = p->items, .n_items = 1, .on_ready = hook_ready, .on_tick = hook_tick,
                          .on_request = hook_request, .on_step_begin = hook_step_begin,
                          .on_step_end = hook_step_end};
    KVB_TRY_GOTO(kvb_server_set_hooks(p->srv, &h), fail);
    KVB_LOG_I("%s %s serving on %s (policy %s): %lld KV blocks of %d tokens (%zu bytes each) in %s memory (device "
              "%d, region %.24s%s)%s; coordinator %s",
              a->role == KVB_ROLE_MASTER ? "master" : "worker", a->name, kvb_server_endpoint(p->srv), a->policy,
              (long long)n_blocks, a->block_size, block_bytes, kvb_mem_kind(p->be->mem), kvb_mem_device(p->be->mem),
              kvb_mem_region_handle(p->region), strlen(kvb_mem_region_handle(p->region)) > 24 ? "..." : "",
              n_stale ? " (stale regions of the tag removed)" : "", a->coordinator);
    *out = p;
    return KVB_OK;
fail:
    if (planner_owned) kvb_planner_destroy(&planner);
    kvb_node_proc_destroy(p);
    return st == KVB_OK ? KVB_ERR_STATE : st;
}

kvb_status kvb_node_proc_run(kvb_node_proc *p) {
    if (!p) return KVB_ERR_INVALID;
    if (g_signals) return KVB_OK;
    kvb_status st = kvb_server_run(p->srv, &g_signals);
    kvb_server_stats ss;
    kvb_server_get_stats(p->srv, &ss);
    KVB_LOG_I("stopped serving: accepted=%llu completed=%llu rejected=%llu malformed=%llu disconnects=%llu",
              (unsigned long long)ss.accepted, (unsigned long long)ss.completed, (unsigned long long)ss.rejected,
              (unsigned long long)ss.malformed, (unsigned long long)ss.disconnects);
    char line[1024];
    kvb_engine_stats_format(p->eng, line, sizeof line);
    KVB_LOG_I("engine: %s", line);
    return st;
}

int kvb_node_proc_pump(kvb_node_proc *p, int timeout_ms, int (*done)(void *ud), void *ud) {
    if (!p) return 0;
    int sig0 = kvb_node_proc_signals();
    uint64_t end = kvb_now_ns() + (uint64_t)(timeout_ms > 0 ? timeout_ms : 0) * 1000000u;
    while (!(done && done(ud))) {
        uint64_t now = kvb_now_ns();
        if (now >= end || kvb_node_proc_signals() > sig0) break;
        int left = (int)((end - now + 999999) / 1000000);
        kvb_node_client_pump(p->nc, KVB_MIN(left, 50));
        if (p->role.on_tick) p->role.on_tick(p->role.ud);
    }
    return done ? done(ud) : 0;
}

void kvb_node_proc_destroy(kvb_node_proc *p) {
    if (!p) return;
    if (p->srv) kvb_server_set_hooks(p->srv, NULL);
    kvb_node_client_destroy(p->nc);
    kvb_engine_destroy(p->eng);
    kvb_planner_destroy(&p->pool_planner);
    kvb_server_destroy(p->srv);
    kvb_mem_region_destroy(p->region);
    kvb_model_destroy(p->model);
    kvb_backend_destroy(p->be);
    free(p);
}

kvb_engine *kvb_node_proc_engine(const kvb_node_proc *p) { return p ? p->eng : NULL; }
kvb_mem *kvb_node_proc_mem(const kvb_node_proc *p) { return p && p->be ? p->be->mem : NULL; }
kvb_node_client *kvb_node_proc_client(const kvb_node_proc *p) { return p ? p->nc : NULL; }
const kvb_node_proc_args *kvb_node_proc_args_of(const kvb_node_proc *p) { return p ? &p->args : NULL; }
const kvb_kv_geom *kvb_node_proc_geom(const kvb_node_proc *p) { return p ? &p->geom : NULL; }
