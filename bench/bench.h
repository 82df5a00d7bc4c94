/* kvbank-bench — benchmark subcommands. Each prints a table of ratios measured side by side in one
 * run; none asserts a time. */
#ifndef KVB_BENCH_BENCH_H
#define KVB_BENCH_BENCH_H

#include <stddef.h>

int kvb_bench_engine(int argc, char **argv);
int kvb_bench_ellm(int argc, char **argv);
int kvb_bench_cuda(int argc, char **argv);
int kvb_bench_replay(int argc, char **argv);
int kvb_bench_interference(int argc, char **argv);
int kvb_bench_lend(int argc, char **argv);
int kvb_bench_maxctx(int argc, char **argv);
int kvb_bench_multiturn(int argc, char **argv);
int kvb_bench_ellm_tw(int argc, char **argv);
int kvb_bench_serve(int argc, char **argv);
int kvb_bench_orbitflow(int argc, char **argv);

/* p-th percentile (nearest rank) of v[0..n) (sorted in place); NAN when n == 0. */
double kvb_bench_pct(double *v, int n, double p);
/* Median, min and max of v[0..n) (v is not changed; n <= 64); all NAN when n == 0. */
void kvb_bench_spread(const double *v, int n, double *med, double *lo, double *hi);
/* Writes "MED [LO-HI]" of v[0..n) with `prec` decimals into buf. Returns buf. */
const char *kvb_bench_spread_str(const double *v, int n, int prec, char *buf, size_t len);

#endif
