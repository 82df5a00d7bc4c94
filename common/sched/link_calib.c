/* kvbank — the link model's time scale measured (link_calib.h). */
#include "common/sched/link_calib.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv/block_pool.h"
#include "common/sched/engine.h"

enum { CAL_BS = 16 };

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Token `i` of request `r`'s prompt: the first ctx are its history, the rest differ per repetition. */
static int32_t tok_of(int r, int rep, int i, int ctx, int vocab) {
    uint64_t z = (uint64_t)r * 1000003u + (uint64_t)i * 7919u + (i >= ctx ? (uint64_t)(rep + 1) * 104729u : 0);
    z ^= z >> 17;
    z *= 0xed5ad4bbu;
    z ^= z >> 11;
    return (int32_t)(3 + z % (uint64_t)(vocab - 3));
}

/* Runs the engine until it has no live request; the steps' time less run-queue waits, seconds. */
static kvb_status run_out(kvb_engine *e, double *t_s) {
    double t = 0;
    while (kvb_engine_n_live(e) > 0) {
        uint64_t t0 = kvb_now_ns(), q0 = kvb_thread_runq_ns();
        KVB_TRY(kvb_engine_step(e));
        uint64_t dt = kvb_now_ns() - t0, dq = kvb_thread_runq_ns() - q0;
        t += (double)(dq < dt ? dt - dq : dt) * 1e-9;
    }
    if (t_s) *t_s = t;
    return KVB_OK;
}

kvb_status kvb_link_measure_step(kvb_model *m, const kvb_link_point *p, int reps, double *step_s) {
    const kvb_model_config *c = kvb_model_cfg(m);
    int ctx = KVB_MAX(CAL_BS, (int)lround(p->ctx / CAL_BS) * CAL_BS);
    if (p->batch < 1 || p->q < 1 || reps < 1 || ctx + p->q + 1 > c->max_pos || c->vocab < 4) {
        KVB_LOG_E("link calibration: a step of %d x %d tokens over %d does not fit the model (context %d)", p->batch,
                  p->q, ctx, c->max_pos);
        return KVB_ERR_INVALID;
    }
    int len = ctx + p->q, per_req = (len + CAL_BS - 1) / CAL_BS + 1;
    kvb_engine_opts o;
    kvb_engine_opts_default(&o);
    o.block_size = CAL_BS;
    o.n_blocks = 2 * p->batch * per_req + 4; /* the histories stay cached while a repetition runs */
    o.max_seqs = p->batch;
    o.max_batch_tokens = KVB_MAX(p->batch * p->q, 256);
    o.enable_prefix_cache = 1;
    kvb_engine *e = NULL;
    int32_t *prompt = NULL;
    double *t = NULL;
    kvb_status st;
    KVB_TRY_GOTO(kvb_malloc((size_t)len * sizeof *prompt, (void **)&prompt), out);
    KVB_TRY_GOTO(kvb_calloc((size_t)reps + 1, sizeof *t, (void **)&t), out);
    KVB_TRY_GOTO(kvb_engine_create(m, &o, NULL, NULL, &e), out);
    uint64_t id = 1;
    /* the histories, prefilled once and left in the prefix cache */
    for (int r = 0; r < p->batch; r++) {
        for (int i = 0; i < ctx; i++) prompt[i] = tok_of(r, 0, i, ctx, c->vocab);
        kvb_request rq = {.id = id++, .prompt = prompt, .n_prompt = ctx, .max_tokens = 1};
        KVB_TRY_GOTO(kvb_engine_add(e, &rq), out);
    }
    KVB_TRY_GOTO(run_out(e, NULL), out);
    /* each repetition: every request's q new tokens over its cached history, in one step (the budget
     * holds them all), and its first token sampled there */
    for (int rep = 0; rep <= reps; rep++) {
        for (int r = 0; r < p->batch; r++) {
            for (int i = 0; i < len; i++) prompt[i] = tok_of(r, rep, i, ctx, c->vocab);
            kvb_request rq = {.id = id++, .prompt = prompt, .n_prompt = len, .max_tokens = 1};
            KVB_TRY_GOTO(kvb_engine_add(e, &rq), out);
        }
        KVB_TRY_GOTO(run_out(e, &t[rep]), out);
    }
    qsort(t + 1, (size_t)reps, sizeof *t, cmp_d); /* the first repetition warms the caches */
    *step_s = reps % 2 ? t[1 + reps / 2] : 0.5 * (t[reps / 2] + t[1 + reps / 2]);
    st = KVB_OK;
out:
    kvb_engine_destroy(e);
    free(prompt);
    free(t);
    return st;
}

kvb_status kvb_link_calibrate(kvb_model *m, const kvb_link_point *p, kvb_link_model *lm) {
    if (!lm->calibrate) return KVB_OK;
    const kvb_model_config *c = kvb_model_cfg(m);
    kvb_link_point def = {.batch = 4, .q = 1, .ctx = KVB_MIN(512, (c->max_pos - 2) / CAL_BS * CAL_BS)};
    if (!p) p = &def;
    kvb_link_point pt = *p;
    pt.ctx = KVB_MAX(CAL_BS, (int)lround(pt.ctx / CAL_BS) * CAL_BS); /* what kvb_link_measure_step runs */
    double step;
    KVB_TRY(kvb_link_measure_step(m, &pt, 7, &step));
    kvb_kv_geom g = kvb_model_kv_geom(m, 1);
    double kv_bytes = (double)kvb_kv_layer_bytes(&g); /* one token, one layer: K and V */
    if (p->target_ctx > 0 && p->ctx > 0) pt.target_ctx = p->target_ctx * pt.ctx / p->ctx; /* the rounding, on both sides */
    return kvb_link_scale(lm, &pt, step, c->n_layers, kv_bytes);
}
