/* kvbank-bench — entry point: `kvbank-bench SUBCOMMAND [options]`. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench.h"
#include "common/util/util.h"
#include "common/util/prog.h"
#include "kernels/backend.h"

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double kvb_bench_pct(double *v, int n, double p) {
    if (n == 0) return NAN;
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    int k = (int)ceil(p / 100.0 * n) - 1;
    return v[KVB_MAX(0, KVB_MIN(n - 1, k))];
}

void kvb_bench_spread(const double *v, int n, double *med, double *lo, double *hi) {
    double t[64];
    n = KVB_MIN(n, 64);
    if (n <= 0) {
        *med = *lo = *hi = NAN;
        return;
    }
    memcpy(t, v, sizeof(double) * (size_t)n);
    qsort(t, (size_t)n, sizeof *t, cmp_d);
    *lo = t[0];
    *hi = t[n - 1];
    *med = n % 2 ? t[n / 2] : (t[n / 2 - 1] + t[n / 2]) / 2;
}

const char *kvb_bench_spread_str(const double *v, int n, int prec, char *buf, size_t len) {
    double m, lo, hi;
    kvb_bench_spread(v, n, &m, &lo, &hi);
    snprintf(buf, len, "%.*f [%.*f-%.*f]", prec, m, prec, lo, prec, hi);
    return buf;
}

static void usage(FILE *f) {
    fprintf(f, "usage: kvbank-bench SUBCOMMAND [options]   (SUBCOMMAND --help for its options)\n"
               "\n"
               "subcommands:\n"
               "  ellm-el  eLLM elastic memory against the static split and chunked prefill: online curves, goodput,\n"
               "           offline throughput, ablations, time breakdown (same model, budget and requests)\n"
               "  engine   prefill and decode throughput of one model at batch 1, 8, 32, against this machine's\n"
               "           memory-copy bandwidth and OpenBLAS sgemm rate measured in the same run\n"
               "  cuda     the CUDA backend on a Llama-3-8B-shaped model against the GPU's copy and GEMM ceilings\n"
               "  replay   drive a running node with real traces; TTFT / TPOT / TBT percentiles, SLO attainment\n"
               "  interference  each model's TTFT/TPOT with lending on against off (starts the node twice)\n"
               "  lend     lend and reclaim latency against the worker's pool size (block-major vs layer-major)\n"
               "  maxctx   the master's longest context with idle lenders against its own memory alone\n"
               "  multiturn  P99 TTFT of multi-turn replay on the master: lending against a host-tier prefix cache\n"
               "  serve    HTTP load against kvbank-gateway (trace arrivals, streaming): TTFT / TPOT / ITL, goodput, and\n"
               "           the gateway's overhead against the model's ZeroMQ endpoint in the same run\n"
               "  ellm-tw    eLLM token-wise KV caching against vllm-recompute / vllm-swap / hcache (paper §6)\n"
               "  orbitflow  OrbitFlow against DeepSpeed, FlexGen(+), SLO-aware offloading and the dynamic heuristic\n"
               "           under the stager's link model: SLO attainment, tails, throughput, ablations, solver (paper §5)\n");
}

int main(int argc, char **argv) {
    kvb_cpu_threads_wait(argv, KVB_CPU_CORES_OWN);
    kvb_prog_init(argc, argv, "kvbank-bench");
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "engine")) return kvb_bench_engine(argc - 1, argv + 1);
    if (!strcmp(argv[1], "ellm-el")) return kvb_bench_ellm(argc - 1, argv + 1);
    if (!strcmp(argv[1], "cuda")) return kvb_bench_cuda(argc - 1, argv + 1);
    if (!strcmp(argv[1], "replay")) return kvb_bench_replay(argc - 1, argv + 1);
    if (!strcmp(argv[1], "interference")) return kvb_bench_interference(argc - 1, argv + 1);
    if (!strcmp(argv[1], "lend")) return kvb_bench_lend(argc - 1, argv + 1);
    if (!strcmp(argv[1], "maxctx")) return kvb_bench_maxctx(argc - 1, argv + 1);
    if (!strcmp(argv[1], "multiturn")) return kvb_bench_multiturn(argc - 1, argv + 1);
    if (!strcmp(argv[1], "serve")) return kvb_bench_serve(argc - 1, argv + 1);
    if (!strcmp(argv[1], "ellm-tw")) return kvb_bench_ellm_tw(argc - 1, argv + 1);
    if (!strcmp(argv[1], "orbitflow")) return kvb_bench_orbitflow(argc - 1, argv + 1);
    fprintf(stderr, "kvbank-bench: unknown subcommand '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
