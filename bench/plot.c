/* kvbank-bench --plot (plot.h). */
#include "bench/plot.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

void kvb_plot_cdf(double *v, size_t n, double *x, double *y) {
    qsort(v, n, sizeof *v, cmp_double);
    for (size_t i = 0; i < n; i++) {
        x[i] = v[i];
        y[i] = (double)(i + 1) / (double)n;
    }
}

/* A gnuplot string literal: single quotes, '' for a quote. */
static void put_str(FILE *f, const char *s) {
    fputc('\'', f);
    for (; s && *s; s++) {
        if (*s == '\'') fputc('\'', f);
        fputc(*s, f);
    }
    fputc('\'', f);
}

int kvb_plot_svg(const char *svg_path, const kvb_plot *p) {
    char gp[4096];
    if (snprintf(gp, sizeof gp, "%s.gp", svg_path) >= (int)sizeof gp) {
        fprintf(stderr, "kvbank-bench: --plot path too long\n");
        return -1;
    }
    FILE *f = fopen(gp, "w");
    if (!f) {
        fprintf(stderr, "kvbank-bench: cannot write %s: %s\n", gp, strerror(errno));
        return -1;
    }
    fprintf(f, "# kvbank-bench --plot: gnuplot %s\n", gp);
    fprintf(f, "set terminal svg size 900,560 dynamic enhanced font 'sans,12' background rgb 'white'\n");
    fprintf(f, "set output ");
    put_str(f, svg_path);
    fprintf(f, "\nset title noenhanced ");
    put_str(f, p->title);
    fprintf(f, "\nset xlabel noenhanced ");
    put_str(f, p->xlabel);
    fprintf(f, "\nset ylabel noenhanced ");
    put_str(f, p->ylabel);
    fprintf(f, "\nset grid\nset key outside right top noenhanced\n");
    if (p->logx) fprintf(f, "set logscale x\n");
    if (p->logy) fprintf(f, "set logscale y\n");
    if (p->xtics && p->n_xtics > 0) {
        fprintf(f, "set xtics noenhanced (");
        for (int i = 0; i < p->n_xtics; i++) {
            fprintf(f, "%s", i ? ", " : "");
            put_str(f, p->xtics[i]);
            fprintf(f, " %d", i);
        }
        fprintf(f, ")\nset xrange [-0.5:%g]\n", p->n_xtics - 0.5);
    }
    for (int s = 0; s < p->n_series; s++)
        if (p->series[s].bars) {
            fprintf(f, "set boxwidth 0.6\nset style fill solid 0.7 border -1\n");
            if (!p->logy) fprintf(f, "set yrange [0:*]\n");
            break;
        }
    int drawn = 0;
    for (int s = 0; s < p->n_series; s++) {
        const kvb_plot_series *ser = &p->series[s];
        fprintf(f, "$d%d << EOD\n", s);
        for (size_t i = 0; i < ser->n; i++) {
            /* a log axis cannot show 0 or less; NaN marks a missing point */
            if (!isfinite(ser->x[i]) || !isfinite(ser->y[i]) || (p->logx && ser->x[i] <= 0) || (p->logy && ser->y[i] <= 0))
                continue;
            fprintf(f, "%.9g %.9g\n", ser->x[i], ser->y[i]);
            drawn++;
        }
        fprintf(f, "EOD\n");
    }
    fprintf(f, "plot ");
    for (int s = 0; s < p->n_series; s++) {
        const kvb_plot_series *ser = &p->series[s];
        fprintf(f, "%s$d%d using 1:2 with %s title ", s ? ", " : "", s,
                ser->bars ? "boxes" : ser->steps ? "steps lw 2" : "linespoints lw 2 pt 7");
        put_str(f, p->series[s].name);
    }
    fprintf(f, "\n");
    if (fclose(f) != 0) {
        fprintf(stderr, "kvbank-bench: cannot write %s\n", gp);
        return -1;
    }
    if (!drawn) {
        fprintf(stderr, "kvbank-bench: nothing to plot into %s (no data points)\n", svg_path);
        return -1;
    }
    char cmd[8400];
    snprintf(cmd, sizeof cmd, "gnuplot '%s'", gp); /* the path has no quote: checked below */
    if (strchr(gp, '\'')) {
        fprintf(stderr, "kvbank-bench: --plot path must not contain a quote\n");
        return -1;
    }
    int rc = system(cmd);
    if (rc == -1 || !WIFEXITED(rc) || WEXITSTATUS(rc) != 0) {
        fprintf(stderr, "kvbank-bench: gnuplot failed on %s%s\n", gp,
                WIFEXITED(rc) && WEXITSTATUS(rc) == 127 ? " (is gnuplot installed? Debian: gnuplot-nox)" : "");
        return -1;
    }
    printf("plot: %s (gnuplot script %s)\n", svg_path, gp);
    return 0;
}
