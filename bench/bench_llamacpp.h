/* kvbank-bench — llama.cpp's prebuilt CPU library as the side-by-side reference of `engine` (see
 * bench_llamacpp.c for how it is reached without building or shipping any of it). */
#ifndef KVB_BENCH_LLAMACPP_H
#define KVB_BENCH_LLAMACPP_H

#include <stdint.h>

#include "common/util/util.h"

typedef struct kvb_llamacpp kvb_llamacpp;

/* Opens libllama (and ggml) in `libdir`, writes the model directory as a temporary GGUF file and
 * loads it with `threads` threads. Caller owns the result (kvb_llamacpp_close, NULL-safe, removes the
 * file). KVB_ERR_UNSUPPORTED for a model the comparison does not cover (only plain Llama). */
kvb_status kvb_llamacpp_open(const char *libdir, const char *model_dir, int threads, kvb_llamacpp **out);
void kvb_llamacpp_close(kvb_llamacpp *l);

/* Greedy generation of `n_out` tokens after `prompt` (for the agreement check). 0 on success. */
int kvb_llamacpp_greedy(kvb_llamacpp *l, const int32_t *prompt, int n_prompt, int n_out, int32_t *out);
/* Seconds to prefill `n` tokens (one sequence, fresh cache), or < 0 on error. */
double kvb_llamacpp_prefill(kvb_llamacpp *l, const int32_t *prompt, int n);
/* Prefills `batch` sequences of `ctx` tokens (prompts[s]), then times `n_win` windows of `steps`
 * decode steps (one token per sequence, greedy): win[w] = seconds per step; `before(w)` (may be NULL) is
 * called before each window, outside its time. 0 on success. */
double kvb_llamacpp_decode(kvb_llamacpp *l, int batch, const int32_t *const *prompts, int ctx, int steps, double *win,
                           int n_win, void (*before)(int w));

#endif
