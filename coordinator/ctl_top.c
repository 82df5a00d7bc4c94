/* kvbankctl top — a live terminal view of the node (ncurses), refreshed from the coordinator's
 * StatusReply: per model a bar of its KV memory split into own used, own free, lent and borrowed
 * blocks, its requests running and waiting and its tokens/s; then the loans, with the lends and
 * reclaims that completed since the last refresh. */
#include <curses.h>
#include <fcntl.h>
#include <inttypes.h>
#include <locale.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/util/util.h"
#include "coordinator/ctl.h"

#define NAME_W 16
#define MAX_TRACKED 512 /* models whose counters are remembered between refreshes */

/* What the previous refresh saw of one model (tokens/s, lends and reclaims since then). */
typedef struct seen {
    char name[65];
    uint64_t tokens, lends, reclaims;
} seen;

typedef struct top {
    seen prev[MAX_TRACKED];
    int n_prev;
    double prev_s;         /* monotonic time of the previous refresh, 0 before the first */
    int colors;
} top;

enum { C_USED = 1, C_FREE, C_LENT, C_BORROWED, C_BAD, C_TITLE };

static volatile sig_atomic_t g_top_stop;
static void on_stop(int sig) {
    (void)sig;
    g_top_stop = 1;
}

static seen *find_seen(top *t, const char *name) {
    for (int i = 0; i < t->n_prev; i++)
        if (!strcmp(t->prev[i].name, name)) return &t->prev[i];
    return NULL;
}

/* `n` cells of `ch` in colour pair `pair`. */
static void cells(top *t, int pair, chtype ch, int n) {
    if (n <= 0) return;
    if (t->colors) attron(COLOR_PAIR(pair));
    for (int i = 0; i < n; i++) addch(ch);
    if (t->colors) attroff(COLOR_PAIR(pair));
}

/* Splits `width` cells over the parts in proportion (largest remainders; a non-zero part gets at
 * least one cell when there is room). */
static void split_cells(const uint64_t *part, int n, int width, int *out) {
    uint64_t total = 0;
    for (int i = 0; i < n; i++) total += part[i];
    int used = 0;
    for (int i = 0; i < n; i++) {
        out[i] = total ? (int)(part[i] * (uint64_t)width / total) : 0;
        if (part[i] && !out[i]) out[i] = 1;
        used += out[i];
    }
    while (used > width) { /* the minimums overflowed: take from the largest */
        int big = 0;
        for (int i = 1; i < n; i++)
            if (out[i] > out[big]) big = i;
        out[big]--, used--;
    }
    for (int i = 0; used < width && total && i < n; i = (i + 1) % n) /* the rest to the parts in order */
        if (part[i]) out[i]++, used++;
}

/* One model's line: name, role, status, the bar, numbers, requests and tokens/s. */
static void draw_model(top *t, const Kvbank__StatusReply *s, const Kvbank__ModelStatus *m, int row, int bar_w,
                       double dt) {
    const Kvbank__ChildState *k = kvb__ctl_child_of(s, m->name ? m->name : "");
    const char *state = kvb__ctl_model_state(m, k);
    int worker = m->role == KVBANK__ROLE__ROLE_WORKER;
    uint32_t used = m->n_used <= m->n_own ? m->n_used : m->n_own;
    uint64_t part[4] = {used, m->n_own - used, worker ? m->n_lent : 0, worker ? 0 : m->n_borrowed};
    int w[4];
    split_cells(part, 4, bar_w, w);
    mvprintw(row, 0, "%-*.*s %-6s ", NAME_W, NAME_W, m->name ? m->name : "", worker ? "worker" : "master");
    int good = !strcmp(state, "running") || !strcmp(state, "draining");
    if (!good && t->colors) attron(COLOR_PAIR(C_BAD));
    printw("%-13s", state);
    if (!good && t->colors) attroff(COLOR_PAIR(C_BAD));
    addch('[');
    cells(t, C_USED, '#', w[0]);
    cells(t, C_FREE, '.', w[1]);
    cells(t, C_LENT, 'L', w[2]);
    cells(t, C_BORROWED, 'B', w[3]);
    int drawn = w[0] + w[1] + w[2] + w[3];
    for (int i = drawn; i < bar_w; i++) addch(' ');
    addch(']');
    char tps[24] = "-";
    seen *p = find_seen(t, m->name ? m->name : "");
    if (p && dt > 0 && m->tokens_generated >= p->tokens)
        snprintf(tps, sizeof tps, "%.1f", (double)(m->tokens_generated - p->tokens) / dt);
    printw(" %5" PRIu32 " %5" PRIu32 " %5" PRIu32 " %5" PRIu32 " %5" PRIu32 " %5" PRIu32 " %8s", used, m->n_own - used,
           worker ? m->n_lent : 0, worker ? 0 : m->n_borrowed, m->live_requests, m->waiting_requests, tps);
}

/* One frame from the StatusReply `r` (NULL: the coordinator did not answer). */
static void draw(top *t, ctl *c, const Kvbank__StatusReply *s, double interval_s) {
    erase();
    int rows, cols;
    getmaxyx(stdscr, rows, cols);
    (void)rows;
    double now = kvb_now_s(), dt = t->prev_s > 0 ? now - t->prev_s : 0;
    if (t->colors) attron(COLOR_PAIR(C_TITLE) | A_BOLD);
    if (s)
        mvprintw(0, 0, "kvbank top  coordinator %s  epoch %" PRIu64 "  up %.0f s  every %.1f s  (q quits)",
                 s->coordinator_id ? s->coordinator_id : "", s->epoch, (double)s->uptime_ms / 1000.0, interval_s);
    else
        mvprintw(0, 0, "kvbank top  no answer from the coordinator at %s  (q quits)", c->endpoint);
    if (t->colors) attroff(COLOR_PAIR(C_TITLE) | A_BOLD);
    if (!s) {
        refresh();
        return;
    }
    int fixed = NAME_W + 1 + 7 + 13 + 2 + 6 * 6 + 9;
    int bar_w = cols - fixed;
    if (bar_w < 10) bar_w = 10;
    if (bar_w > 60) bar_w = 60;
    mvprintw(1, 0, "KV blocks: ");
    cells(t, C_USED, '#', 1);
    printw(" own used  ");
    cells(t, C_FREE, '.', 1);
    printw(" own free  ");
    cells(t, C_LENT, 'L', 1);
    printw(" lent  ");
    cells(t, C_BORROWED, 'B', 1);
    printw(" borrowed (master blocks)");
    attron(A_BOLD);
    mvprintw(2, 0, "%-*s %-6s %-13s%-*s %5s %5s %5s %5s %5s %5s %8s", NAME_W, "MODEL", "ROLE", "STATUS", bar_w + 2,
             "KV MEMORY", "USED", "FREE", "LENT", "BORR", "RUN", "WAIT", "TOK/S");
    attroff(A_BOLD);
    int row = 3;
    uint64_t lends = 0, reclaims = 0, lend_ms = 0, reclaim_ms = 0;
    for (size_t i = 0; i < s->n_models; i++) {
        const Kvbank__ModelStatus *m = s->models[i];
        draw_model(t, s, m, row++, bar_w, dt);
        seen *p = find_seen(t, m->name ? m->name : "");
        if (p && m->lends >= p->lends && m->reclaims >= p->reclaims) {
            lends += m->lends - p->lends;
            reclaims += m->reclaims - p->reclaims;
        }
        lend_ms += m->lend_ms_total;
        reclaim_ms += m->reclaim_ms_total;
    }
    /* kvbankd's models that are not registered */
    for (size_t i = 0; i < s->n_children; i++) {
        const Kvbank__ChildState *k = s->children[i];
        const char *role = k->role ? k->role : "";
        if (strcmp(role, "master") && strcmp(role, "worker")) continue;
        int registered = 0;
        for (size_t j = 0; j < s->n_models; j++) registered |= s->models[j]->name && k->name && !strcmp(s->models[j]->name, k->name);
        if (registered) continue;
        mvprintw(row, 0, "%-*.*s %-6s ", NAME_W, NAME_W, k->name ? k->name : "", role);
        if (t->colors) attron(COLOR_PAIR(C_BAD));
        printw("%-13s", kvb__ctl_model_state(NULL, k));
        if (t->colors) attroff(COLOR_PAIR(C_BAD));
        printw("not registered%s%s", k->last_exit && k->last_exit[0] ? "; last exit: " : "", k->last_exit ? k->last_exit : "");
        row++;
    }
    row++;
    size_t revoking = 0;
    for (size_t i = 0; i < s->n_loans; i++) revoking += s->loans[i]->revoking;
    attron(A_BOLD);
    mvprintw(row++, 0, "LOANS %zu (%zu revoking)   since the last refresh: %" PRIu64 " lent, %" PRIu64 " reclaimed",
             s->n_loans, revoking, lends, reclaims);
    attroff(A_BOLD);
    for (size_t i = 0; i < s->n_loans && row < rows - 1; i++) {
        const Kvbank__Loan *l = s->loans[i];
        mvprintw(row++, 0, "  loan %-6" PRIu64 " %-*.*s blocks [%" PRIu32 ", %" PRIu64 ") = %" PRIu32 " master blocks  %s",
                 l->loan_id, NAME_W, NAME_W, l->lender ? l->lender : "", l->first_block,
                 (uint64_t)l->first_block + l->n_blocks, l->n_master_blocks, l->revoking ? "revoking" : "lent");
    }
    (void)lend_ms, (void)reclaim_ms;
    refresh();
    /* remember the counters for the next frame */
    t->n_prev = 0;
    for (size_t i = 0; i < s->n_models && t->n_prev < MAX_TRACKED; i++) {
        const Kvbank__ModelStatus *m = s->models[i];
        seen *p = &t->prev[t->n_prev++];
        snprintf(p->name, sizeof p->name, "%s", m->name ? m->name : "");
        p->tokens = m->tokens_generated;
        p->lends = m->lends;
        p->reclaims = m->reclaims;
    }
    t->prev_s = now;
}

int kvb__ctl_top(ctl *c, double interval_s) {
    if (!isatty(STDOUT_FILENO) || !isatty(STDIN_FILENO)) {
        fprintf(stderr, "kvbankctl top: needs a terminal (use `kvbankctl status --watch` or `status --json` in scripts)\n");
        return 2;
    }
    top *t = NULL;
    if (kvb_calloc(1, sizeof *t, (void **)&t) != KVB_OK) {
        fprintf(stderr, "kvbankctl top: out of memory\n");
        return 1;
    }
    /* the connection's complaints would scribble over the screen: stderr goes to /dev/null meanwhile */
    int saved_err = dup(STDERR_FILENO), nul = open("/dev/null", O_WRONLY);
    if (nul >= 0) {
        dup2(nul, STDERR_FILENO);
        close(nul);
    }
    signal(SIGINT, on_stop);
    signal(SIGTERM, on_stop);
    setlocale(LC_ALL, "");
    initscr();
    cbreak();
    noecho();
    curs_set(0);
    keypad(stdscr, TRUE);
    if (has_colors()) {
        start_color();
        use_default_colors();
        init_pair(C_USED, COLOR_GREEN, -1);
        init_pair(C_FREE, COLOR_WHITE, -1);
        init_pair(C_LENT, COLOR_YELLOW, -1);
        init_pair(C_BORROWED, COLOR_CYAN, -1);
        init_pair(C_BAD, COLOR_RED, -1);
        init_pair(C_TITLE, COLOR_BLUE, -1);
        t->colors = 1;
    }
    timeout((int)(interval_s * 1000.0));
    while (!g_top_stop) {
        Kvbank__Envelope *r = kvb__ctl_get_status(c, 1);
        draw(t, c, r ? r->status_reply : NULL, interval_s);
        if (r) kvbank__envelope__free_unpacked(r, NULL);
        else kvb__ctl_close(c); /* a new socket for the next try */
        int ch = getch();
        if (ch == 'q' || ch == 'Q') break;
    }
    endwin();
    if (saved_err >= 0) {
        dup2(saved_err, STDERR_FILENO);
        close(saved_err);
    }
    free(t);
    return 0;
}
