/* kvbank — eLLM elastic memory as a planner (ellm-elastic-memory.txt §4-6), and its baselines.
 *
 *   ellm-elastic          one physical chunk pool for KV and activations (inflation / deflation by
 *                         remapping), the CPU buffer (offload at prefill, fetch at decode), Alg. 1
 *                         prefill-only or decode-only iterations, Alg. 2 buffer scaling, speculative
 *                         pre-mapping and asynchronous unmapping. intra=0 / inter=0 are §6.5's ablations.
 *   static-split          vLLM: activations reserved for a step of the model's length, the rest KV;
 *                         prefill-only or decode-only iterations of whole prompts (vLLM v0.5 default).
 *   static-split-chunked  vLLM with chunked prefill: decodes and 512-token prompt chunks in one
 *                         iteration, activations reserved for such a step, the rest KV.
 * All three place each request's KV in a slot (a contiguous range of the model's length in one
 * reservation, chunks mapped on demand), so the baselines differ from eLLM only in what the papers
 * change. The budget (KV + activations, `budget_mb`) is the same for all three.
 *
 * Layout: a slot is block-major like the pool (SwiftCache §3.4): block j of slot s is pool block
 * s * blocks_per_slot + j, holding [n_layers][2][block_size][n_kv_heads][head_dim]; a chunk holds
 * chunk_tokens / block_size whole blocks (every layer of chunk_tokens tokens).
 *
 * Parameters (kvbank's values where the paper is silent; docs/papers/ellm-elastic-memory.md says why):
 *   budget_mb      memory for KV + activations (default: the engine's KV blocks plus a model-length
 *                  step's activations: what static-split needs to keep those blocks)
 *   chunk_tokens   tokens per physical chunk (16: Llama3-8B's 128 KiB of KV per token in a 2 MiB chunk)
 *   slots          KV slots, the most requests on the device at once (default max_seqs)
 *   theta          θ of Alg. 1 in chunks, for admissions (-1: 1% of the chunks, vLLM's watermark)
 *   intra, inter   the two elasticities (1, 1)
 *   buffer_mb      B_max, the CPU buffer (default: the budget)
 *   slo_ttft_ms, slo_tpot_ms   Alg. 2's SLOs (0: no SLO; B_logic stays B_max)
 *   alpha, window, misses      Alg. 2 (2, 5, 3)
 *   premap, premap_max         speculative pre-mapping (1; at most one chunk per slot ahead)
 *   mapper         the mapper thread for asynchronous unmapping and pre-mapping (1)
 *   prefill_chunk  static-split-chunked's chunk (512)
 * Lending: none. An ellm-elastic model neither lends nor borrows (its chunks come from cuMemCreate /
 * a memfd, not from an exportable region), and the prefix cache is off (a hit would have to alias
 * chunks of another request's slot; the paper's eLLM runs without it). */
#ifndef KVB_POLICY_ELLM_ELASTIC_H
#define KVB_POLICY_ELLM_ELASTIC_H

#include "common/policy/ellm_elastic_core.h"
#include "common/policy/policy.h"

/* What an ellm-elastic planner did (for benchmarks): the core's statistics and the VM layer's. */
typedef struct kvb_ee_report {
    kvb_ee_stats core;
    uint64_t sync_maps, async_maps, async_unmaps, drain_waits, fence_waits;
    uint64_t vm_ns;           /* wall time of every map/unmap (mem.h's timers) */
    uint64_t vm_sync_ns;      /* of which on the planner's thread, plus its waits for the mapper */
    int n_chunks;             /* P_T */
    size_t chunk_bytes;
    int act_owned, kv_owned;  /* chunks each side owns now */
    int act_start;            /* the activations' chunks at start (the static split's reserve) */
    int max_model_len;
} kvb_ee_report;

/* The report of a planner made by one of the three create functions (0 if it is not one). */
int kvb_ee_planner_report(const kvb_planner *p, kvb_ee_report *out);

#endif
