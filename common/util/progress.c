/* kvbank — progress lines (progress.h). */
#include "common/util/progress.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/util/util.h"

#define SHOW_AFTER_S 0.5
#define REDRAW_S 0.1

static int progress_mode(void) {
    const char *e = getenv("KVB_PROGRESS");
    if (e && !strcmp(e, "always")) return 2;
    if (e && !strcmp(e, "never")) return 0;
    return isatty(STDERR_FILENO) ? 1 : 0;
}

static void amount(const kvb_progress *p, uint64_t v, char *buf, size_t len) {
    if (p->unit != KVB_PROGRESS_BYTES) snprintf(buf, len, "%llu", (unsigned long long)v);
    else if (p->total >= (1ull << 30)) snprintf(buf, len, "%.1f", (double)v / (double)(1ull << 30));
    else snprintf(buf, len, "%.1f", (double)v / (double)(1ull << 20));
}

static const char *unit_name(const kvb_progress *p) {
    if (p->unit != KVB_PROGRESS_BYTES) return "";
    return p->total >= (1ull << 30) ? " GiB" : " MiB";
}

static void draw(kvb_progress *p, double now) {
    char d[32], t[32], eta[48] = "";
    amount(p, p->done, d, sizeof d);
    amount(p, p->total, t, sizeof t);
    double el = now - p->t0_s;
    if (p->done > 0 && p->done < p->total && el > 0) {
        double left = el * (double)(p->total - p->done) / (double)p->done;
        snprintf(eta, sizeof eta, ", %.0f s left", left + 0.5);
    }
    int pct = p->total ? (int)(100.0 * (double)p->done / (double)p->total) : 100;
    if (p->mode == 1) fprintf(stderr, "\r\033[K%s: %d%% (%s of %s%s)%s", p->what, pct, d, t, unit_name(p), eta);
    else fprintf(stderr, "%s: %d%% (%s of %s%s)%s\n", p->what, pct, d, t, unit_name(p), eta);
    fflush(stderr);
    p->drawn = 1;
    p->last_s = now;
    p->last_pct = pct;
}

void kvb_progress_begin(kvb_progress *p, const char *what, uint64_t total, kvb_progress_unit unit) {
    memset(p, 0, sizeof *p);
    p->last_pct = -1;
    snprintf(p->what, sizeof p->what, "%s", what ? what : "");
    p->total = total;
    p->unit = unit;
    p->mode = progress_mode();
    p->t0_s = kvb_now_s();
    if (p->mode == 2) draw(p, p->t0_s);
}

void kvb_progress_update(kvb_progress *p, uint64_t done) {
    if (!p || !p->mode) return;
    p->done = done > p->total ? p->total : done;
    double now = kvb_now_s();
    if (p->mode == 1 && now - p->t0_s < SHOW_AFTER_S) return;
    if (now - p->last_s < REDRAW_S && p->drawn) return;
    /* KVB_PROGRESS=always writes lines, not redraws: one per whole percent (or every 10 s) */
    int pct = p->total ? (int)(100.0 * (double)p->done / (double)p->total) : 100;
    if (p->mode == 2 && pct == p->last_pct && now - p->last_s < 10.0) return;
    draw(p, now);
}

void kvb_progress_end(kvb_progress *p) {
    if (!p || !p->mode) return;
    /* an operation too short to have shown anything on a terminal stays silent */
    if (p->mode == 1 && !p->drawn && kvb_now_s() - p->t0_s < SHOW_AFTER_S) return;
    p->done = p->total;
    char t[32];
    amount(p, p->total, t, sizeof t);
    fprintf(stderr, "%s%s: done, %s%s in %.1f s\n", p->mode == 1 ? "\r\033[K" : "", p->what, t, unit_name(p),
            kvb_now_s() - p->t0_s);
    fflush(stderr);
    p->mode = 0;
}

void kvb_progress_clear(kvb_progress *p) {
    if (!p || p->mode != 1 || !p->drawn) return;
    fprintf(stderr, "\r\033[K");
    fflush(stderr);
    p->drawn = 0;
}

void kvb_progress_cancel(kvb_progress *p) {
    if (!p || !p->mode) return;
    if (p->mode == 1 && p->drawn) fprintf(stderr, "\r\033[K");
    else if (p->mode == 2) fprintf(stderr, "%s: stopped\n", p->what);
    fflush(stderr);
    p->mode = 0;
}
