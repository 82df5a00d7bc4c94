/* kvbank-serve — serves one model's engine on a ZeroMQ endpoint (common/ipc/server.h). */
#include <getopt.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/ipc/server.h"
#include "common/kv/block_pool.h"
#include "common/mem/mem.h"
#include "common/mem/region.h" /* stale-segment cleanup */
#include "common/model/model.h"
#include "common/policy/policy.h"
#include "common/sched/engine.h"
#include "common/util/prog.h"
#include "kernels/backend.h"

#define TAG_MAX 24 /* the longest --name (the region tag) */

static volatile sig_atomic_t g_stop;

static void on_signal(int sig) {
    (void)sig;
    g_stop = 1;
}

static void usage(FILE *f) {
    fprintf(f,
            "usage: kvbank-serve --model DIR --endpoint EP [options]\n"
            "\n"
            "Loads a model and serves it on a ZeroMQ ROUTER endpoint: clients (DEALER sockets) send\n"
            "GenerateRequest, CancelRequest and Ping envelopes (proto/kvbank.proto) and receive streams of\n"
            "TokenEvents, ErrorReplies and Pongs. The KV cache lives in one exportable region of the\n"
            "backend's memory: with the cpu backend a POSIX shared-memory object named /kvb-NAME-PID-N\n"
            "(mode 0600), removed on exit; with a device backend device memory on --device (an IPC handle\n"
            "other processes could import). An ipc:// socket file is made mode 0600.\n"
            "SIGINT or SIGTERM stops the server (live requests end with FINISH_CANCELLED); exit status 0.\n"
            "\n"
            "options:\n"
            "  --model DIR            Hugging Face model directory (config.json + *.safetensors)\n"
            "  --endpoint EP          where to listen, e.g. ipc:///run/kvbank/m.sock or tcp://127.0.0.1:5555\n"
            "  --name NAME            model name in Pong replies, logs and the shared-memory name: letters,\n"
            "                         digits, '-' and '_', at most %d characters (default: the model\n"
            "                         directory's base name, other characters replaced by '_')\n"
            "  --backend NAME         compute backend (built in: %s; default cpu)\n"
            "  --device N             the GPU of a device backend (default 0)\n"
            "  --threads N            CPU threads (default 1)\n"
            "  --block-size N         tokens per KV block (default 16)\n"
            "  --kv-blocks N          KV blocks in the pool (default: enough for 4 x max_position_embeddings\n"
            "                         tokens)\n"
            "  --max-batch-tokens N   token budget per engine step (default 512)\n"
            "  --max-live N           requests live at once before new ones are rejected (default 1024)\n"
            "  --max-live-per-client N  requests one client (one DEALER socket) may have live at once\n"
            "                         (default max-live / 4); clients reach the engine fairly: the one with\n"
            "                         the fewest requests running goes first\n"
            "  --max-seqs N           most running sequences (default 64)\n"
            "  --policy NAME          planner (default recompute); --policy list prints them\n"
            "  --policy-param K=V     a parameter of the planner (repeat for more)\n"
            "  --link-preset NAME     the stager's link model (default off); --link-preset list prints them\n"
            "  --no-prefix-cache      do not reuse KV blocks across requests\n"
            "  -h, --help             this text\n"
            "\n"
            "Log level: KVB_LOG_LEVEL=error|warn|info|debug. Exit status 1 on an error, 2 on a usage error.\n",
            TAG_MAX, kvb_backend_list());
}

static int parse_int(const char *flag, const char *v, int min, int *out) {
    int64_t x;
    if (kvb_parse_i64(v, min, 1 << 30, &x) != KVB_OK) {
        fprintf(stderr, "kvbank-serve: %s needs an integer >= %d, got '%s'\n", flag, min, v);
        return -1;
    }
    *out = (int)x;
    return 0;
}

static int valid_tag(const char *s) {
    size_t n = strlen(s);
    if (n == 0 || n > TAG_MAX) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_'))
            return 0;
    }
    return 1;
}


int main(int argc, char **argv) {
    kvb_cpu_threads_wait(argv, KVB_CPU_CORES_OWN);
    kvb_prog_init(argc, argv, "kvbank-serve");
    const char *model_dir = NULL, *endpoint = NULL, *name_arg = NULL, *backend = "cpu", *policy = "recompute";
    const char *links = "off";
    int threads = 1, block_size = 16, kv_blocks = 0, max_batch_tokens = 0, max_live = 1024, prefix_cache = 1;
    int max_per_client = 0, max_seqs = 0, device = 0;
    kvb_policy_params pparams = {0};

    enum { O_MODEL = 256, O_EP, O_NAME, O_BACKEND, O_THREADS, O_BS, O_BLOCKS, O_MBT, O_LIVE, O_POLICY, O_NOPC, O_PPARAM,
           O_PER_CLIENT, O_SEQS, O_DEVICE, O_LINKS };
    static const struct option opts[] = {
        {"model", 1, 0, O_MODEL},       {"endpoint", 1, 0, O_EP},        {"name", 1, 0, O_NAME},
        {"backend", 1, 0, O_BACKEND},   {"threads", 1, 0, O_THREADS},    {"block-size", 1, 0, O_BS},
        {"kv-blocks", 1, 0, O_BLOCKS},  {"max-batch-tokens", 1, 0, O_MBT}, {"max-live", 1, 0, O_LIVE},
        {"policy", 1, 0, O_POLICY},     {"no-prefix-cache", 0, 0, O_NOPC}, {"policy-param", 1, 0, O_PPARAM},
        {"link-preset", 1, 0, O_LINKS}, {"help", 0, 0, 'h'},
        {"max-live-per-client", 1, 0, O_PER_CLIENT}, {"max-seqs", 1, 0, O_SEQS}, {"device", 1, 0, O_DEVICE},
        {0, 0, 0, 0}};
    int c, bad = 0;
    opterr = 1;
    while (!bad && (c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case O_MODEL: model_dir = optarg; break;
        case O_EP: endpoint = optarg; break;
        case O_NAME: name_arg = optarg; break;
        case O_BACKEND: backend = optarg; break;
        case O_THREADS: bad = parse_int("--threads", optarg, 1, &threads) != 0; break;
        case O_DEVICE: bad = parse_int("--device", optarg, 0, &device) != 0; break;
        case O_BS: bad = parse_int("--block-size", optarg, 1, &block_size) != 0; break;
        case O_BLOCKS: bad = parse_int("--kv-blocks", optarg, 1, &kv_blocks) != 0; break;
        case O_MBT: bad = parse_int("--max-batch-tokens", optarg, 1, &max_batch_tokens) != 0; break;
        case O_LIVE: bad = parse_int("--max-live", optarg, 1, &max_live) != 0; break;
        case O_PER_CLIENT: bad = parse_int("--max-live-per-client", optarg, 1, &max_per_client) != 0; break;
        case O_SEQS: bad = parse_int("--max-seqs", optarg, 1, &max_seqs) != 0; break;
        case O_POLICY: policy = optarg; break;
        case O_LINKS: links = optarg; break;
        case O_PPARAM:
            if (kvb_policy_params_add(&pparams, optarg) != KVB_OK) {
                fprintf(stderr, "kvbank-serve: --policy-param needs KEY=VALUE, got '%s'\n", optarg);
                bad = 1;
            }
            break;
        case O_NOPC: prefix_cache = 0; break;
        case 'h': usage(stdout); kvb_policy_params_free(&pparams); return 0;
        default: usage(stderr); bad = 1; break;
        }
    }
    if (bad) {
        kvb_policy_params_free(&pparams);
        return 2;
    }
    if (!strcmp(policy, "list") || !strcmp(links, "list")) {
        if (!strcmp(policy, "list")) kvb_policy_print_list(stdout);
        else kvb_link_preset_list(stdout);
        kvb_policy_params_free(&pparams);
        return 0;
    }
    if (optind != argc || !model_dir || !endpoint) {
        kvb_policy_params_free(&pparams);
        if (optind != argc) fprintf(stderr, "kvbank-serve: unexpected argument '%s'\n", argv[optind]);
        else fprintf(stderr, "kvbank-serve: --model and --endpoint are required\n");
        usage(stderr);
        return 2;
    }
    char name[TAG_MAX + 1];
    if (name_arg) {
        if (!valid_tag(name_arg)) {
            kvb_policy_params_free(&pparams);
            fprintf(stderr, "kvbank-serve: --name must be 1..%d letters, digits, '-' or '_', got '%s'\n", TAG_MAX,
                    name_arg);
            return 2;
        }
        snprintf(name, sizeof name, "%s", name_arg);
    } else {
        kvb_name_from_path(model_dir, name, TAG_MAX);
    }
    kvb_planner planner;
    kvb_status pst = kvb_policy_create(policy, &pparams, &planner);
    kvb_policy_params_free(&pparams);
    if (pst != KVB_OK) {
        fprintf(stderr, "kvbank-serve: cannot create policy '%s' (see the log above; --policy list names them)\n",
                policy);
        return 2;
    }
    kvb_log_set_tag(name);

    /* Handlers first, so that a signal during loading still leads through the cleanup below. Without
     * SA_RESTART, so that a blocking poll returns EINTR at once. */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    int rc = 1;
    kvb_backend *be = NULL;
    kvb_model *m = NULL;
    kvb_mem_region *region = NULL;
    kvb_server *srv = NULL;
    kvb_engine *eng = NULL;
    int planner_owned = 1; /* until kvb_engine_create, which takes it in every case */
    kvb_status st;

    if ((st = kvb_backend_create_on(backend, device, threads, &be)) != KVB_OK) {
        fprintf(stderr, "kvbank-serve: cannot create backend '%s' on device %d: %s\n", backend, device,
                kvb_status_str(st));
        goto out;
    }
    if ((st = kvb_model_load(model_dir, be, &m)) != KVB_OK) {
        fprintf(stderr, "kvbank-serve: cannot load model from %s: %s\n", model_dir, kvb_status_str(st));
        goto out;
    }
    const kvb_model_config *cfg = kvb_model_cfg(m);
    kvb_kv_geom geom = kvb_model_kv_geom(m, block_size);
    if (kvb_kv_geom_check(&geom) != KVB_OK) {
        fprintf(stderr, "kvbank-serve: invalid KV geometry for block size %d\n", block_size);
        goto out;
    }
    if (kv_blocks == 0) {
        int64_t blocks = KVB_DIV_CEIL((int64_t)4 * cfg->max_pos, (int64_t)block_size);
        kv_blocks = (int)KVB_MIN(blocks, (int64_t)1 << 30);
    }
    size_t block_bytes = kvb_kv_block_bytes(&geom);
    if (block_bytes == 0 || (size_t)kv_blocks > SIZE_MAX / block_bytes) {
        fprintf(stderr, "kvbank-serve: %d KV blocks of %zu bytes do not fit in memory\n", kv_blocks, block_bytes);
        goto out;
    }
    size_t kv_bytes = (size_t)kv_blocks * block_bytes;
    int n_stale = 0;
    kvb_region_unlink_stale(name, &n_stale); /* regions of crashed servers of this name */
    if (n_stale) KVB_LOG_I("removed %d shared-memory region(s) of crashed servers named %s", n_stale, name);
    if ((st = kvb_mem_region_create(be->mem, name, kv_bytes, &region)) != KVB_OK) {
        fprintf(stderr, "kvbank-serve: cannot create a %zu-byte KV region in %s memory: %s\n", kv_bytes,
                kvb_mem_kind(be->mem), kvb_status_str(st));
        goto out;
    }
    if (g_stop) goto stopped;

    kvb_server_opts so = {.endpoint = endpoint, .model_name = name, .max_live = max_live,
                          .max_per_client = max_per_client, .vocab = cfg->vocab, .model_dir = model_dir};
    if ((st = kvb_server_create(&so, &srv)) != KVB_OK) {
        fprintf(stderr, "kvbank-serve: cannot serve on %s: %s\n", endpoint, kvb_status_str(st));
        goto out;
    }
    kvb_engine_opts eo;
    kvb_engine_opts_default(&eo);
    eo.block_size = block_size;
    eo.n_blocks = kv_blocks;
    if (max_batch_tokens) eo.max_batch_tokens = max_batch_tokens;
    if (max_seqs) eo.max_seqs = max_seqs;
    eo.enable_prefix_cache = prefix_cache;
    eo.kv_mem = kvb_mem_region_base(region);
    eo.kv_mem_bytes = kvb_mem_region_size(region);
    if ((st = kvb_link_preset(links, be, &eo.links)) != KVB_OK) {
        fprintf(stderr, "kvbank-serve: unknown --link-preset '%s' (--link-preset list names them)\n", links);
        goto out;
    }
    kvb_engine_events ev = kvb_server_engine_events(srv);
    planner_owned = 0; /* kvb_engine_create takes the planner, also when it fails */
    if ((st = kvb_engine_create(m, &eo, &planner, &ev, &eng)) != KVB_OK) {
        fprintf(stderr, "kvbank-serve: cannot create the engine: %s\n", kvb_status_str(st));
        goto out;
    }
    kvb_server_attach(srv, eng);

    KVB_LOG_I("serving %s on %s (%d KV blocks of %d tokens, %zu bytes, in %s memory: %.40s)", name,
              kvb_server_endpoint(srv), kv_blocks, block_size, kv_bytes, kvb_mem_kind(be->mem),
              kvb_mem_region_handle(region));
    st = kvb_server_run(srv, &g_stop);
    kvb_server_stats ss;
    kvb_server_get_stats(srv, &ss);
    KVB_LOG_I("stopped: accepted=%llu completed=%llu rejected=%llu malformed=%llu disconnects=%llu",
              (unsigned long long)ss.accepted, (unsigned long long)ss.completed, (unsigned long long)ss.rejected,
              (unsigned long long)ss.malformed, (unsigned long long)ss.disconnects);
    char line[1024];
    kvb_engine_stats_format(eng, line, sizeof line);
    KVB_LOG_I("engine: %s", line);
    if (st != KVB_OK) {
        fprintf(stderr, "kvbank-serve: the server stopped on an error: %s\n", kvb_status_str(st));
        goto out;
    }
stopped:
    rc = 0;
out:
    kvb_engine_destroy(eng);
    kvb_server_destroy(srv);
    if (planner_owned) kvb_planner_destroy(&planner);
    kvb_mem_region_destroy(region);
    kvb_model_destroy(m);
    kvb_backend_destroy(be);
    return rc;
}
