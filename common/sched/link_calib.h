/* kvbank — the link model's time scale measured (link_model.h): the step of this machine's model at an
 * operating point, timed on an engine of its own, and kvb_link_scale applied (common/sched/engine.c). */
#ifndef KVB_SCHED_LINK_CALIB_H
#define KVB_SCHED_LINK_CALIB_H

#include "common/model/model.h"
#include "common/sched/link_model.h"

/* Seconds one step of `p` takes on `m` (borrowed): p->batch requests whose first p->ctx tokens (rounded
 * to whole 16-token blocks, at least one) are in the prefix cache compute p->q new tokens each;
 * the median over `reps` such steps after one not counted, each the wall time less what this thread
 * waited for a CPU (a machine shared with others). The engine is its own, without a link model. */
kvb_status kvb_link_measure_step(kvb_model *m, const kvb_link_point *p, int reps, double *step_s);

/* For a scaled preset still to calibrate (lm->calibrate), measures the step of `m` at `p` (NULL: 4
 * requests decoding over 512 tokens, fewer when the model's context is shorter, the same on the target)
 * and applies kvb_link_scale; otherwise does nothing. */
kvb_status kvb_link_calibrate(kvb_model *m, const kvb_link_point *p, kvb_link_model *lm);

#endif
