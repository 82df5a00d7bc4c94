/* kvbank-bench --plot: figures drawn by gnuplot (Debian's gnuplot-nox) as SVG.
 *
 * A figure is a few series of (x, y) points; kvb_plot_svg writes them as gnuplot's inline data blocks
 * into a script, runs `gnuplot` on it and leaves FILE.svg (and the script beside it as FILE.svg.gp, so
 * that a figure can be restyled and redrawn by hand). */
#ifndef KVB_BENCH_PLOT_H
#define KVB_BENCH_PLOT_H

#include <stddef.h>

typedef struct kvb_plot_series {
    const char *name;      /* the legend */
    const double *x, *y;   /* [n] points, drawn in order */
    size_t n;
    int steps;             /* 1: a step line (CDFs, counts over time), 0: lines with points */
    int bars;              /* 1: a bar at each x (a bar chart; takes precedence over steps) */
} kvb_plot_series;

typedef struct kvb_plot {
    const char *title;
    const char *xlabel, *ylabel;
    int logx, logy;        /* logarithmic axes */
    const kvb_plot_series *series;
    int n_series;
    const char *const *xtics; /* NULL, or a bar chart's [n_xtics] labels, at x = 0, 1, ... */
    int n_xtics;
} kvb_plot;

/* Draws `p` into `svg_path` with gnuplot. Returns 0, or -1 with a message on stderr (gnuplot missing,
 * or it failed: its own message is on stderr too). */
int kvb_plot_svg(const char *svg_path, const kvb_plot *p);

/* The empirical CDF of v[n] (sorted in place) as a series' x (values) and y (fractions 0..1): fills
 * x[n], y[n]. */
void kvb_plot_cdf(double *v, size_t n, double *x, double *y);

#endif
