/* kvbank — a causal LM on a backend and its layer-stepped forward pass.
 *
 * The forward pass runs one step of a flattened token batch (prefill chunks and decode tokens of
 * many sequences together, no padding) one layer at a time:
 *
 *     kvb_forward_begin(fw, &batch);            embed the batch's tokens
 *     for (l = 0; l < n_layers; l++) {
 *         ... caller fills batch.attn.layer_blocks for layer l (where each block lives) ...
 *         kvb_forward_layer(fw, l);             norm, QKV, RoPE, KV write, attention, FFN
 *         ... caller may store / stream / drop KV of layer l here ...
 *     }
 *     kvb_forward_end(fw, logits);              final norm + LM head for the rows that want logits
 *
 * so that policies can prefetch, stream or recompute KV between layers (SwiftCache §3.3 layer-wise
 * load/store; OrbitFlow per-layer placement; eLLM layer-level overlap). */
#ifndef KVB_MODEL_MODEL_H
#define KVB_MODEL_MODEL_H

#include <stdint.h>

#include "common/mem/mem.h"
#include "common/model/check.h"
#include "common/model/config.h"
#include "kernels/backend.h"

typedef struct kvb_model kvb_model;

/* Loads the model directory `dir` (config.json + safetensors) onto `be` (borrowed for the model's
 * lifetime). Weights are checked by name and shape; errors name the tensor. Caller owns the result. */
kvb_status kvb_model_load(const char *dir, kvb_backend *be, kvb_model **out);
void kvb_model_destroy(kvb_model *m);

const kvb_model_config *kvb_model_cfg(const kvb_model *m);
kvb_backend *kvb_model_backend(const kvb_model *m);
/* The KV geometry of this model on its backend for a given block size. */
kvb_kv_geom kvb_model_kv_geom(const kvb_model *m, int block_size);
/* Parameter count and bytes of weights read per decode step (everything but the embedding table;
 * the LM head counts even when tied). */
int64_t kvb_model_n_params(const kvb_model *m);
int64_t kvb_model_weight_bytes_per_token(const kvb_model *m);
/* Bytes of all the model's weights as the backend holds them (the embedding table included, once when
 * tied): on the CPU backend the checkpoint's own bytes for matrices used in place. */
int64_t kvb_model_weight_bytes(const kvb_model *m);

/* One step's batch. Host arrays, borrowed for the duration of the step. */
typedef struct kvb_batch {
    int n_tokens;
    const int32_t *tokens; /* [n_tokens] token ids (< vocab) */
    const int32_t *pos;    /* [n_tokens] positions within their sequence */
    kvb_attn_batch attn;   /* sequences; layer_blocks is filled per layer by the caller */
    int n_logits;
    const int32_t *logit_rows; /* [n_logits] rows whose logits kvb_forward_end returns, in this order */
} kvb_batch;

typedef struct kvb_forward kvb_forward;

/* Creates a forward context for steps of up to `max_tokens` rows. Each step's buffers (activations,
 * logit rows) come from `alloc` (borrowed for the context's lifetime), asked for at kvb_forward_begin
 * sized by that step's n_tokens and n_logits, and given back at kvb_forward_end (or at the next begin
 * or destroy, after a sync, when a step was abandoned). kvb_forward_create uses a step arena of the
 * model backend's memory (kvb_mem_arena). Caller owns the result. */
kvb_status kvb_forward_create_with(kvb_model *m, int max_tokens, const kvb_mem_allocator *alloc, kvb_forward **out);
kvb_status kvb_forward_create(kvb_model *m, int max_tokens, kvb_forward **out);
void kvb_forward_destroy(kvb_forward *fw);

/* `b` is borrowed until kvb_forward_end; its attn.layer_blocks may change between layers. Takes the
 * step's buffers from the allocator (KVB_ERR_NOMEM and nothing kept when it cannot give them). */
kvb_status kvb_forward_begin(kvb_forward *fw, const kvb_batch *b);
kvb_status kvb_forward_layer(kvb_forward *fw, int layer);
/* Between layers of the step in flight: the next layers compute only the batch's first n_rows rows
 * and attention sequences [0, n_seqs) (fewer than before; the dropped sequences' rows must lie past
 * n_rows, every logit row before it). eLLM token-wise: recomputed prefix rows laid out last leave
 * the step above the highest recomputed layer. KVB_ERR_INVALID otherwise, nothing changed. */
kvb_status kvb_forward_rows(kvb_forward *fw, int n_rows, int n_seqs);
/* Between layers of the step in flight: 0 < rows < the rows computed: the next layers' projections
 * and MLP run as two GEMMs each, rows [0, rows) and the rest (eLLM §6.3's "without fusion" ablation;
 * the same results per row); 0: one GEMM. */
kvb_status kvb_forward_split(kvb_forward *fw, int rows);
/* Rows a layer runs at once by default: it runs a step's rows in chunks of about this many, one after
 * the other, so activations other than the residual stream are bounded by the chunk, not the step. A
 * backend may ask for another (kvb_backend_i.chunk_rows: the CUDA backend's 2048). */
#define KVB_FORWARD_CHUNK_ROWS 512
int kvb_forward_default_chunk(const kvb_backend *be);
/* Between steps: the rows of a layer's chunks (rows < 64 count as 64; 0: the whole step at once).
 * The results are the same bits whatever the chunk (the cuts are chosen so that the backend takes the
 * same path for every row). KVB_ERR_INVALID while a step is in flight or for rows < 0. */
kvb_status kvb_forward_chunk(kvb_forward *fw, int rows);
/* Writes logits [n_logits][vocab] (f32, host) for the batch's logit_rows. */
kvb_status kvb_forward_end(kvb_forward *fw, float *logits);
/* After the last layer, before kvb_forward_end: logits [n][vocab] (f32, host) of any rows[n] of the step
 * (below the rows computed), n at most the batch's n_logits (its buffers are used; prompt logprobs
 * take every prompt row this way, a batch's worth at a time). KVB_ERR_INVALID otherwise. */
kvb_status kvb_forward_logits(kvb_forward *fw, const int32_t *rows, int n, float *logits);
/* As kvb_forward_end, but the backend samples the logit rows on the device (kvb_backend_i.sample): row r
 * under p[r] into tokens[r] (host arrays of n_logits); no logits cross to the host.
 * KVB_ERR_UNSUPPORTED (the step stays open) when the backend cannot. */
kvb_status kvb_forward_end_sample(kvb_forward *fw, const kvb_sample_row *p, int32_t *tokens);

/* The residual stream [n_tokens][hidden] (backend memory, act dtype) of the step in flight: between
 * kvb_forward_begin / kvb_forward_layer(l - 1) and kvb_forward_layer(l) it holds every row's hidden
 * state entering layer l (what HCache saves). Borrowed; the next layer overwrites it. */
const void *kvb_forward_hidden(const kvb_forward *fw);

/* HCache's restoration (Gao et al., EuroSys '25): layer `layer`'s K and V of a->n_tokens rows rebuilt
 * from their saved hidden states x ([n_tokens][hidden], backend memory, act dtype) at positions pos:
 * the layer's norm, K/V projections (and Qwen3's k norm), RoPE, written through the backend's kv_write
 * into a->layer_blocks (the layer's slices; a->seqs places the rows as in a step). Uses the forward's
 * buffers: never while a step is in flight (KVB_ERR_INVALID), n_tokens <= the forward's max_tokens. */
kvb_status kvb_forward_kv_from_hidden(kvb_forward *fw, int layer, const void *x, const int32_t *pos,
                                      const kvb_attn_batch *a);

#endif
