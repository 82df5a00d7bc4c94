/* kvbank — how a device backend issues the pieces of one copy_async (kernels/backend.h): merged where
 * they continue each other, and whether they may go out as one batch whose copies the device runs in no
 * particular order (cudaMemcpyBatchAsync). Plain host code, in every build, so that the CPU build's
 * tests check it too. */
#ifndef KVB_KERNELS_COPY_PLAN_H
#define KVB_KERNELS_COPY_PLAN_H
#include <stdint.h>

#include "kernels/backend.h"

/* One address range of a piece (kvb_copy_independent's scratch). */
typedef struct kvb_copy_span {
    uintptr_t a, b; /* [a, b) */
} kvb_copy_span;

/* Writes x[0..n) to out[0..) (room for n) as the same copies in order with fewer pieces: zero-byte
 * pieces dropped, and a piece whose source and destination both start where the previous piece's end
 * merged into it, unless the merged source and destination ranges would overlap (copied in order, the
 * second piece would read what the first wrote). Returns the number of pieces written. */
int kvb_copy_coalesce(const kvb_copy_piece *x, int n, kvb_copy_piece *out);

/* 1 when x[0..n) may be copied in any order with the same result: no destination overlaps another
 * piece's destination or any source (its own included); 0 otherwise. `scratch` has room for 3 n spans. */
int kvb_copy_independent(const kvb_copy_piece *x, int n, kvb_copy_span *scratch);

#endif
