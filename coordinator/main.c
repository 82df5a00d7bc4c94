/* kvbank-coordinator — the node's coordinator daemon (coordinator/coordinator.h). */
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "common/ipc/auth.h"
#include "common/util/node_config.h"
#include "coordinator/coordinator.h"
#include "common/util/prog.h"

static volatile sig_atomic_t g_stop;

static void on_signal(int sig) {
    (void)sig;
    g_stop = 1;
}

static void usage(FILE *f) {
    fprintf(f,
            "usage: kvbank-coordinator --endpoint EP [--heartbeat-ms N] [--heartbeat-misses N]\n"
            "       kvbank-coordinator --config NODE.json [--heartbeat-ms N] [--heartbeat-misses N]\n"
            "\n"
            "Keeps the node's ledger of KV blocks that workers lend to the master (SwiftCache) and runs\n"
            "the coordinator protocol of docs/lending.md on one ZeroMQ ROUTER socket: models register,\n"
            "heartbeat, offer and reclaim blocks; kvbankctl asks for the status and sends controls.\n"
            "Malformed, oversized, wrong-version and unregistered messages are dropped and counted.\n"
            "A model is dead when its pid is gone or it misses N heartbeats in a row; its loans are\n"
            "revoked (worker) or returned to their lenders (master). After a restart the coordinator\n"
            "rebuilds the ledger from the loans the models report when they register again.\n"
            "\n"
            "options:\n"
            "  --endpoint EP          where to listen, e.g. ipc:///run/kvbank/node/coordinator.sock or\n"
            "                         tcp://127.0.0.1:5700. An ipc socket file is made mode 0600 and a\n"
            "                         missing directory for it mode 0700; it is refused while another\n"
            "                         process listens on it.\n"
            "  --config NODE.json     take the endpoint, heartbeat_ms and heartbeat_misses from the\n"
            "                         node config's \"coordinator\" section (instead of --endpoint)\n"
            "  --heartbeat-ms N       models heartbeat every N ms (default 500, or the config's)\n"
            "  --heartbeat-misses N   a model silent for N heartbeat periods is dead (default 4, or the\n"
            "                         config's)\n"
            "  -h, --help             this text\n"
            "\n"
            "Only ipc:// endpoints: models log in with a token derived from the node secret (see\n"
            "docs/lending.md, threat model). Under kvbankd the secret comes on the fd named by $KVB_AUTH_FD;\n"
            "run by hand, the coordinator keeps it in the key file SOCKET.key next to its socket (mode\n"
            "0600, made at the first start and reused), where models run by hand find it.\n"
            "\n"
            "SIGINT or SIGTERM stops it (exit status 0). Log level: KVB_LOG_LEVEL=error|warn|info|debug.\n"
            "Exit status 1 on an error (bad config, endpoint in use), 2 on a usage error.\n");
}

static int parse_u32(const char *flag, const char *v, int64_t min, int64_t max, uint32_t *out) {
    int64_t x;
    if (kvb_parse_i64(v, min, max, &x) != KVB_OK) {
        fprintf(stderr, "kvbank-coordinator: %s needs an integer in [%lld, %lld], got '%s'\n", flag, (long long)min,
                (long long)max, v);
        return -1;
    }
    *out = (uint32_t)x;
    return 0;
}

int main(int argc, char **argv) {
    kvb_prog_init(argc, argv, "kvbank-coordinator");
    const char *endpoint = NULL, *config = NULL;
    uint32_t hb_ms = 0, misses = 0;
    enum { O_EP = 256, O_CONFIG, O_HB, O_MISSES };
    static const struct option opts[] = {{"endpoint", 1, 0, O_EP},     {"config", 1, 0, O_CONFIG},
                                         {"heartbeat-ms", 1, 0, O_HB}, {"heartbeat-misses", 1, 0, O_MISSES},
                                         {"help", 0, 0, 'h'},          {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case O_EP: endpoint = optarg; break;
        case O_CONFIG: config = optarg; break;
        case O_HB: if (parse_u32("--heartbeat-ms", optarg, 1, 3600000, &hb_ms)) return 2; break;
        case O_MISSES: if (parse_u32("--heartbeat-misses", optarg, 1, 1000, &misses)) return 2; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind != argc || (!endpoint == !config)) {
        if (optind != argc) fprintf(stderr, "kvbank-coordinator: unexpected argument '%s'\n", argv[optind]);
        else fprintf(stderr, "kvbank-coordinator: give exactly one of --endpoint and --config\n");
        usage(stderr);
        return 2;
    }
    kvb_log_set_tag("coordinator");

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal; /* no SA_RESTART: zmq_poll returns EINTR at once */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    kvb_node_config *nc = NULL;
    kvb_coord_opts co = {.endpoint = endpoint, .heartbeat_ms = hb_ms, .heartbeat_misses = misses, .check_pids = 1};
    if (config) {
        if (kvb_node_config_load(config, &nc) != KVB_OK) {
            fprintf(stderr, "kvbank-coordinator: cannot load the node config %s (see the log above)\n", config);
            return 1;
        }
        co.endpoint = nc->coordinator;
        if (!hb_ms) co.heartbeat_ms = (uint32_t)nc->heartbeat_ms;
        if (!misses) co.heartbeat_misses = (uint32_t)nc->heartbeat_misses;
    }
    if (strncmp(co.endpoint, "ipc://", 6) != 0) {
        fprintf(stderr, "kvbank-coordinator: %s: the coordinator listens on ipc:// only (it serves the processes of "
                        "one node; tcp:// would be open to every user of the machine)\n", co.endpoint);
        kvb_node_config_free(nc);
        return 1;
    }
    kvb_auth auth;
    kvb_status st = kvb_auth_from_env(&auth);
    if (st == KVB_OK && !auth.has_secret) {
        fprintf(stderr, "kvbank-coordinator: $%s carries a model's token, not the node secret\n", KVB_AUTH_FD_ENV);
        st = KVB_ERR_INVALID;
    } else if (st == KVB_ERR_NOT_FOUND) {
        /* run by hand: the key file next to the socket, made once and reused across restarts (models
         * run by hand read it) */
        char key[4096];
        st = kvb_auth_key_path(co.endpoint, key, sizeof key);
        if (st != KVB_OK) fprintf(stderr, "kvbank-coordinator: %s has no socket file to keep a key file next to; "
                                          "run it under kvbankd\n", co.endpoint);
        if (st == KVB_OK && (st = kvb_auth_read_file(key, &auth)) == KVB_ERR_NOT_FOUND &&
            (st = kvb_auth_new_secret(&auth)) == KVB_OK) {
            mode_t old = umask(0077);
            st = kvb_coord_endpoint_dir(co.endpoint); /* the key file lives where the socket will */
            if (st == KVB_OK) st = kvb_auth_write_file(key, &auth);
            umask(old);
            if (st == KVB_OK) KVB_LOG_I("node key written to %s (mode 0600)", key);
        }
        if (st == KVB_OK && !auth.has_secret) st = KVB_ERR_INVALID;
        if (st != KVB_OK) fprintf(stderr, "kvbank-coordinator: no usable key file %s\n", key);
    }
    if (st != KVB_OK) {
        kvb_node_config_free(nc);
        return 1;
    }
    co.auth = &auth;
    kvb_coord *coord = NULL;
    st = kvb_coord_create(&co, &coord);
    explicit_bzero(&auth, sizeof auth);
    kvb_node_config_free(nc);
    if (st != KVB_OK) {
        fprintf(stderr, "kvbank-coordinator: cannot start: %s\n", kvb_status_str(st));
        return 1;
    }
    st = kvb_coord_run(coord, &g_stop);
    kvb_coord_destroy(coord);
    if (st != KVB_OK) {
        fprintf(stderr, "kvbank-coordinator: %s\n", kvb_status_str(st));
        return 1;
    }
    return 0;
}
