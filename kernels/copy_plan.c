/* kvbank — the pieces of one copy_async as a device backend issues them (copy_plan.h). */
#include "kernels/copy_plan.h"

#include <string.h>

int kvb_copy_coalesce(const kvb_copy_piece *x, int n, kvb_copy_piece *out) {
    int m = 0;
    for (int i = 0; i < n; i++) {
        if (!x[i].bytes) continue;
        if (m) {
            kvb_copy_piece *p = &out[m - 1];
            uintptr_t d = (uintptr_t)p->dst, s = (uintptr_t)p->src;
            size_t nb = p->bytes + x[i].bytes;
            if ((uintptr_t)x[i].dst == d + p->bytes && (uintptr_t)x[i].src == s + p->bytes &&
                (d + nb <= s || s + nb <= d)) {
                p->bytes = nb;
                continue;
            }
        }
        out[m++] = x[i];
    }
    return m;
}

/* Sorts s[0..n) by start through tmp[0..n): one pass when they come in address order, as pieces
 * usually do, else a radix sort of the starts' offsets from the lowest, 11 bits a pass (three passes
 * over a GiB; a comparison sort took 2.4 ms for 16K pieces on the 2-core VM, before the batch's
 * first copy can start). */
static void sort_spans(kvb_copy_span *s, int n, kvb_copy_span *tmp) {
    enum { BITS = 11, BUCKETS = 1 << BITS };
    int sorted = 1;
    uintptr_t lo = UINTPTR_MAX, hi = 0;
    for (int i = 0; i < n; i++) {
        if (i && s[i].a < s[i - 1].a) sorted = 0;
        if (s[i].a < lo) lo = s[i].a;
        if (s[i].a > hi) hi = s[i].a;
    }
    if (sorted) return;
    kvb_copy_span *from = s, *to = tmp;
    for (int shift = 0; shift < (int)(8 * sizeof(uintptr_t)) && ((hi - lo) >> shift); shift += BITS) {
        size_t at[BUCKETS + 1] = {0};
        for (int i = 0; i < n; i++) at[((from[i].a - lo) >> shift & (BUCKETS - 1)) + 1]++;
        for (int k = 0; k < BUCKETS; k++) at[k + 1] += at[k];
        for (int i = 0; i < n; i++) to[at[(from[i].a - lo) >> shift & (BUCKETS - 1)]++] = from[i];
        kvb_copy_span *t = from;
        from = to;
        to = t;
    }
    if (from != s) memcpy(s, from, (size_t)n * sizeof *s);
}

int kvb_copy_independent(const kvb_copy_piece *x, int n, kvb_copy_span *scratch) {
    kvb_copy_span *d = scratch, *s = scratch + n, *tmp = scratch + 2 * n;
    int m = 0;
    for (int i = 0; i < n; i++) {
        if (!x[i].bytes) continue;
        d[m] = (kvb_copy_span){(uintptr_t)x[i].dst, (uintptr_t)x[i].dst + x[i].bytes};
        s[m] = (kvb_copy_span){(uintptr_t)x[i].src, (uintptr_t)x[i].src + x[i].bytes};
        m++;
    }
    sort_spans(d, m, tmp);
    for (int i = 1; i < m; i++)
        if (d[i].a < d[i - 1].b) return 0;
    /* sources may overlap each other (both only read); against the destinations, which are now disjoint
     * and in order (their ends rise too), only the first destination ending after a source's start can
     * overlap that source */
    sort_spans(s, m, tmp);
    for (int i = 0, j = 0; i < m; i++) {
        while (j < m && d[j].b <= s[i].a) j++;
        if (j == m) break;
        if (d[j].a < s[i].b) return 0;
    }
    return 1;
}
