/* kvbank — progress lines for long operations, on a terminal only.
 *
 *     kvb_progress p;
 *     kvb_progress_begin(&p, "loading models/big", total_bytes, KVB_PROGRESS_BYTES);
 *     for (...) kvb_progress_update(&p, done_bytes);
 *     kvb_progress_end(&p);
 *
 * draws one line on stderr, redrawn in place at most every 100 ms once the operation has run 0.5 s:
 * `loading models/big: 45% (1.2 of 2.7 GiB), 3 s left`, and ends it with `... done: 2.7 GiB in 6.1 s`.
 * Quiet when stderr is not a terminal (logs and pipes get nothing), unless KVB_PROGRESS=always (then
 * from the start, a line per whole percent, which is what tests read); KVB_PROGRESS=never silences it. */
#ifndef KVB_UTIL_PROGRESS_H
#define KVB_UTIL_PROGRESS_H

#include <stdint.h>

typedef enum kvb_progress_unit {
    KVB_PROGRESS_COUNT = 0, /* plain counts: "12 of 40" */
    KVB_PROGRESS_BYTES = 1, /* "1.2 of 2.7 GiB" */
} kvb_progress_unit;

/* Caller-allocated (on the stack); plain data. */
typedef struct kvb_progress {
    char what[160];
    uint64_t total, done;
    kvb_progress_unit unit;
    double t0_s, last_s;  /* monotonic: begin, last redraw */
    int mode;             /* 0 off, 1 terminal (redraw in place), 2 always (a line per percent) */
    int drawn;            /* something is on the line */
    int last_pct;         /* the percentage last drawn */
} kvb_progress;

void kvb_progress_begin(kvb_progress *p, const char *what, uint64_t total, kvb_progress_unit unit);
void kvb_progress_update(kvb_progress *p, uint64_t done);
void kvb_progress_end(kvb_progress *p);
/* Takes the line off a terminal so that stdout can print a line of its own; the next update draws it
 * again (KVB_PROGRESS=always writes whole lines: nothing to take off). */
void kvb_progress_clear(kvb_progress *p);
/* The operation failed: the line is cleared (its error says the rest). */
void kvb_progress_cancel(kvb_progress *p);

#endif
