/* kvbank-gateway — the node's OpenAI-compatible HTTP gateway (see gateway/gateway.h). */
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/util/log.h"
#include "common/util/node_config.h"
#include "gateway/api.h"
#include "gateway/gateway.h"
#include "common/util/prog.h"

static volatile sig_atomic_t g_stop;
static void on_signal(int sig) {
    (void)sig;
    g_stop = 1;
}

static void usage(FILE *f) {
    fprintf(f,
            "usage: kvbank-gateway --config NODE.json [options]\n"
            "       kvbank-gateway --coordinator ENDPOINT [options]\n"
            "\n"
            "Serves the node's models over HTTP with OpenAI's API: POST /v1/completions, /v1/chat/completions\n"
            "(stream: true for server-sent events), /tokenize, /detokenize; GET /v1/models, /health, /metrics.\n"
            "\n"
            "  --config FILE         node config: coordinator endpoint, models, the \"gateway\" section\n"
            "  --coordinator EP      the coordinator's endpoint (without --config; models are found through it)\n"
            "  --listen HOST:PORT    address to listen on (default 127.0.0.1:8000; port 0: any free port)\n"
            "  --max-body-kb N       request bodies above N KiB get 413 (default 1024)\n"
            "  --max-streams N       requests in flight at once, more get 429 (default 256)\n"
            "  --tbt-slo-ms X        Token-Deposit target between tokens of a stream (default 0: off)\n"
            "  --status-ms N         how often the coordinator and the models are asked (default 1000)\n"
            "  --drain-timeout-ms N  on SIGTERM: /health fails, no new connection is accepted and the requests\n"
            "                        in flight may finish for N ms before they are cancelled (default 30000)\n"
            "  --port-file FILE      write the bound port there once listening (default with --config:\n"
            "                        RUN_DIR/gateway.port; removed at exit)\n"
            "  --fields              print every request field the gateway knows (endpoints, JSON types, and\n"
            "                        whether it is handled, accepted and ignored, or unsupported) and exit\n");
}

/* --fields: the request field table (gateway/api.c), one line each. */
static void print_fields(void) {
    int n = 0;
    const gw_field *f = gw_fields(&n);
    static const char *const kinds[] = {"handled", "ignored", "unsupported"};
    static const char *const types[] = {"boolean", "integer", "number", "string", "object", "array"};
    printf("%-30s %-17s %-12s %s\n", "FIELD", "ENDPOINTS", "KIND", "TYPES");
    for (int i = 0; i < n; i++) {
        char t[96] = "";
        size_t k = 0;
        for (int b = 0; b < 6; b++)
            if ((f[i].types & (1u << b)) && !((1u << b) == GW_J_INT && (f[i].types & GW_J_NUM))) k += (size_t)snprintf(t + k, sizeof t - k, "%s%s", k ? "|" : "", types[b]);
        const char *eps = f[i].eps == GW_EP_BOTH ? "chat,completions" : f[i].eps == GW_EP_CHAT ? "chat" : "completions";
        printf("%-30s %-17s %-12s %s\n", f[i].name, eps, kinds[f[i].kind], t);
    }
}

/* HOST:PORT or [V6]:PORT into host (copied into buf) and port. */
static int parse_listen(const char *s, char *buf, size_t len, const char **host, int *port) {
    const char *colon = strrchr(s, ':');
    if (!colon || colon == s) return -1;
    size_t hl = (size_t)(colon - s);
    if (s[0] == '[') {
        if (hl < 3 || s[hl - 1] != ']') return -1;
        s++, hl -= 2;
    }
    if (hl >= len) return -1;
    memcpy(buf, s, hl);
    buf[hl] = '\0';
    char *end = NULL;
    long p = strtol(colon + 1, &end, 10);
    if (!colon[1] || *end || p < 0 || p > 65535) return -1;
    *host = buf;
    *port = (int)p;
    return 0;
}

int main(int argc, char **argv) {
    kvb_prog_init(argc, argv, "kvbank-gateway");
    kvb_log_set_tag("gateway");
    gw_opts o;
    gw_opts_default(&o);
    const char *config = NULL, *listen = NULL;
    long max_body_kb = -1, max_streams = -1, status_ms = -1, drain_ms = -1;
    double slo = -1;
    static const struct option opts[] = {{"config", required_argument, 0, 'c'},      {"coordinator", required_argument, 0, 'C'},
                                         {"listen", required_argument, 0, 'l'},      {"max-body-kb", required_argument, 0, 'b'},
                                         {"max-streams", required_argument, 0, 's'}, {"tbt-slo-ms", required_argument, 0, 't'},
                                         {"status-ms", required_argument, 0, 'S'},   {"port-file", required_argument, 0, 'p'},
                                         {"drain-timeout-ms", required_argument, 0, 'D'},
                                         {"fields", no_argument, 0, 'F'},
                                         {"help", no_argument, 0, 'h'},              {0, 0, 0, 0}};
    int c;
    char *end;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'c': config = optarg; break;
        case 'C': o.coordinator = optarg; break;
        case 'l': listen = optarg; break;
        case 'b': max_body_kb = strtol(optarg, &end, 10); if (*end || max_body_kb < 1) goto bad; break;
        case 's': max_streams = strtol(optarg, &end, 10); if (*end || max_streams < 1) goto bad; break;
        case 'S': status_ms = strtol(optarg, &end, 10); if (*end || status_ms < 10) goto bad; break;
        case 't': slo = strtod(optarg, &end); if (*end || slo < 0) goto bad; break;
        case 'p': o.port_file = optarg; break;
        case 'D': drain_ms = strtol(optarg, &end, 10); if (*end || drain_ms < 0 || drain_ms > 3600000) goto bad; break;
        case 'h': usage(stdout); return 0;
        case 'F': print_fields(); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind < argc || (!config && !o.coordinator)) {
        usage(stderr);
        return 2;
    }
    kvb_node_config *nc = NULL;
    gw_model_opts models[256];
    if (config) {
        if (kvb_node_config_load(config, &nc) != KVB_OK) return 1; /* logged, naming the field */
        const char *coord = o.coordinator;
        if (gw_opts_from_node(nc, &o, models, 256) != KVB_OK) return 1;
        if (coord) o.coordinator = coord;
    }
    char port_path[4096];
    if (nc && !o.port_file) {
        /* kvbankd's children and tests find the bound port here (the config may say port 0) */
        snprintf(port_path, sizeof port_path, "%s/gateway.port", nc->run_dir);
        o.port_file = port_path;
    }
    char hostbuf[256];
    if (listen && parse_listen(listen, hostbuf, sizeof hostbuf, &o.host, &o.port) != 0) {
        fprintf(stderr, "kvbank-gateway: --listen must be HOST:PORT, got '%s'\n", listen);
        return 2;
    }
    if (max_body_kb > 0) o.max_body = (size_t)max_body_kb * 1024;
    if (max_streams > 0) o.max_streams = (int)max_streams;
    if (status_ms > 0) o.status_ms = (int)status_ms;
    if (slo >= 0) o.tbt_slo_ms = slo;
    if (drain_ms >= 0) o.drain_timeout_ms = (int)drain_ms;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    kvb_status st = gw_run(&o, &g_stop);
    if (o.port_file) unlink(o.port_file);
    kvb_node_config_free(nc);
    return st == KVB_OK ? 0 : 1;
bad:
    fprintf(stderr, "kvbank-gateway: bad value '%s'\n", optarg);
    usage(stderr);
    return 2;
}
