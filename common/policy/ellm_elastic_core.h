/* kvbank — the state of eLLM elastic memory (ellm-elastic-memory.txt §4-5) for one model, apart from
 * the engine: the unified chunk pool with its KV slots and activation pool, where every request's KV
 * is (a slot, the CPU buffer, nowhere yet), the logical CPU buffer and its SLO-driven size, and the
 * iteration planning of Alg. 1 with its memory applied all at once. The planner
 * (policy/ellm_elastic.c) turns the engine's view into calls here and the result into a plan; the
 * simulation tests drive it without a model.
 *
 * One iteration:
 *     kvb_ee_core_sync(core, reqs, n, now)   what the engine says is live; measures TTFT/TPOT misses
 *     kvb_ee_core_plan(core, &step)          Alg. 1: prefill-only or decode-only batch, preemptions
 *     kvb_ee_core_apply(core, &step)         balloon, slots, maps: all of the iteration's KV memory
 *     kvb_ee_core_premap(core, &step)        next decode chunks, mapped while the step runs (§5.1)
 *     ... the step runs; its activations come from kvb_ee_core_act_alloc/free ...
 *     kvb_ee_core_done(core, &step)          KV progress
 *
 * Modes (kvb_ee_config.mode): ELASTIC is eLLM (intra/inter switch its two elasticities: both off is
 * vLLM's static split, §6.5's ablations in between); CHUNKED is vLLM with chunked prefill (Sarathi):
 * mixed batches of decodes and prefill chunks within a small token budget, static split.
 *
 * Not thread-safe: one planner thread calls it. */
#ifndef KVB_POLICY_ELLM_ELASTIC_CORE_H
#define KVB_POLICY_ELLM_ELASTIC_CORE_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv/slot_pool.h"
#include "common/mem/act_pool.h"
#include "common/mem/elastic_pool.h"
#include "common/policy/ellm_elastic_alg.h"

typedef enum kvb_ee_mode {
    KVB_EE_MODE_ELASTIC = 0, /* Alg. 1: prefill-only or decode-only iterations, whole prompts */
    KVB_EE_MODE_CHUNKED = 1, /* decodes + prefill chunks in one iteration (vLLM chunked prefill) */
} kvb_ee_mode;

typedef struct kvb_ee_config {
    kvb_ee_mode mode;
    /* memory */
    size_t chunk_bytes;      /* bytes of one physical chunk */
    int chunk_tokens;        /* tokens of KV one chunk holds (a slot is block-major, one block per chunk) */
    int n_chunks;            /* P_T: all chunks of the budget */
    int n_slots;             /* KV slots: the most requests whose KV is on the device at once */
    int slot_chunks;         /* chunks per slot: the model length in chunks */
    int act_chunks_start;    /* chunks the activations own at start (the static split's reserve) */
    int act_seg_chunks;      /* address space of the activation pool's first segment, in chunks */
    size_t act_align;        /* alignment of activation blocks */
    kvb_ee_act_fn act;       /* chunks a step's activations take (the forward pass's buffers) */
    void *act_ud;
    int64_t stage_bytes_per_token; /* staging bytes per token of an offloaded prefill */
    int stage_round_tokens;  /* > 0: an offloaded prefill's tokens are rounded up to a multiple of this
                              * for its staging (whole blocks); 0: not rounded */
    /* scheduling */
    int max_tokens;          /* token budget of an iteration */
    int max_seqs;            /* most requests in an iteration */
    int theta;               /* θ of Alg. 1 for admissions (prefill); decode uses 0 */
    int intra;               /* inflation/deflation between KV and activations */
    int inter;               /* the CPU buffer */
    int64_t buf_max;         /* B_max: chunks the CPU buffer can hold */
    int64_t buf_start;       /* B_logic at start (paper: 1); with no SLO B_logic stays B_max */
    int alpha;               /* Alg. 2 tuning factor (2) */
    int win_iters;           /* violation window (5) */
    int win_misses;          /* misses in the window that make an event (3) */
    double slo_ttft_s;       /* TTFT SLO; 0: none */
    double slo_tpot_s;       /* TPOT SLO; 0: none */
    int premap;              /* speculative pre-mapping of next decode chunks (§5.1) */
    int premap_max;          /* most chunks pre-mapped ahead at once */
} kvb_ee_config;

/* A live request as the engine reports it. */
typedef struct kvb_ee_req {
    uint64_t id;
    uint64_t t_arrival_ns;
    int n_tokens;            /* prompt + generated (the KV it will have after its next computation) */
    int n_computed;          /* tokens whose KV exists (slot or CPU buffer); 0 while waiting */
    int n_generated;
    int waiting;             /* 1: queued, holds no KV */
} kvb_ee_req;

typedef enum kvb_ee_action {
    KVB_EE_DO_PREEMPT = 0,   /* drop its KV (slot cached / buffer freed), back to the queue (recompute) */
    KVB_EE_DO_PREFILL = 1,   /* admit: compute q_len tokens into its slot */
    KVB_EE_DO_OFFLOAD = 2,   /* admit: compute its prompt, KV streamed to the CPU buffer (§4.3.2) */
    KVB_EE_DO_DECODE = 3,    /* compute q_len tokens (a decode token, or a prefill chunk) in its slot */
    KVB_EE_DO_FETCH = 4,     /* fetch its KV from the CPU buffer into a slot, then decode */
} kvb_ee_action;

typedef struct kvb_ee_item {
    uint64_t id;
    kvb_ee_action action;
    int q_len;               /* tokens computed (0 for PREEMPT) */
    int kv_before;           /* tokens whose KV exists before the step (FETCH: those in the buffer) */
    int slot;                /* its KV slot after apply (-1: none) */
} kvb_ee_item;

typedef struct kvb_ee_step {
    kvb_ee_phase phase;      /* ELASTIC: which kind of iteration; CHUNKED: DECODE */
    kvb_ee_item *items;      /* [n_items]: preemptions first, then the batch in queue order */
    int n_items, cap_items;
    int n_batch;             /* items that compute */
    int n_tokens;            /* sum of q_len */
    kvb_ee_alg1_out alg;     /* Alg. 1's numbers for the batch */
    int p_kv, p_act;         /* P_kv and P_act it planned with */
} kvb_ee_step;

typedef struct kvb_ee_stats {
    uint64_t iterations, prefill_iters, decode_iters;
    uint64_t preemptions;
    uint64_t offloads, fetches;       /* requests offloaded at prefill / fetched back */
    uint64_t offload_chunks, fetch_chunks;
    uint64_t inflated, deflated;      /* chunks moved act -> KV / KV -> act */
    uint64_t premapped;               /* chunks mapped speculatively */
    uint64_t decode_maps;             /* chunks mapped in apply for a decode token (not pre-mapped: a miss) */
    uint64_t act_rescues;             /* activation allocations that needed chunks Alg. 1 did not plan */
    uint64_t events_ttft, events_tpot;/* Alg. 2 events */
    uint64_t ttft_misses, tpot_misses;
    int64_t b_logic;                  /* now */
    int64_t buf_used;                 /* chunks offloaded now */
    int max_batch;                    /* largest decode batch seen */
    uint64_t plan_ns;                 /* time in sync + plan + apply + done */
} kvb_ee_stats;

typedef struct kvb_ee_core kvb_ee_core;

/* Validates `c` and builds the books over `ops` (borrowed ctx): the chunk pool, n_slots reservations
 * of slot_chunks, the activation pool. KVB_ERR_INVALID with a sentence for a config that cannot
 * serve a request of the model's full length (its KV, its prefill's activations and θ within P_T).
 * Caller owns the result. */
kvb_status kvb_ee_core_create(const kvb_ee_config *c, const kvb_vm_ops *ops, kvb_ee_core **out);
void kvb_ee_core_destroy(kvb_ee_core *core);

/* The live requests, oldest first (any order is accepted: the core orders by arrival as given by the
 * array's order for requests it has not seen). New ids start waiting; ids it knew that are missing
 * finished: their slot becomes cached, their CPU-buffer chunks are freed. A request whose
 * n_generated grew since the last sync produced tokens at `now_ns`: TTFT and TPOT misses are counted
 * for Alg. 2 (which runs here, once per iteration). */
kvb_status kvb_ee_core_sync(kvb_ee_core *core, const kvb_ee_req *reqs, int n, uint64_t now_ns);
/* Plans the next iteration (Alg. 1; preempts the newest device-resident request by recompute when
 * nothing can progress). `st` is reset and filled. */
kvb_status kvb_ee_core_plan(kvb_ee_core *core, kvb_ee_step *st);
/* Allocates the iteration's memory together: ballooning (inflation moves I chunks from the
 * activations, deflation -I from the KV side), slots for admitted and fetched requests, chunks for
 * every KV the step writes. Sets each item's slot. */
kvb_status kvb_ee_core_apply(kvb_ee_core *core, kvb_ee_step *st);
/* Speculative pre-mapping (§5.1), after apply: every request the step computes on the device decodes
 * next, so the chunk its next token falls into is mapped now (the caller queues these maps to run
 * while the step computes: kvb_elastic_vm_async). From a free chunk, else a cached slot's; never
 * another request's pre-mapped chunk nor an idle activation chunk; at most premap_max chunks ahead.
 * Best effort: returns the chunks mapped. */
int kvb_ee_core_premap(kvb_ee_core *core, const kvb_ee_step *st);
/* The step ran: KV progress, CPU buffer bookkeeping. */
kvb_status kvb_ee_core_done(kvb_ee_core *core, const kvb_ee_step *st);
void kvb_ee_step_free(kvb_ee_step *st);

/* The activation allocator of the forward pass (mem.h kvb_mem_allocator semantics): blocks from the
 * activation pool. A block the plan did not account for (the act model was short) takes a chunk from
 * the KV side (counted in act_rescues) rather than failing the step when one is reclaimable. */
kvb_status kvb_ee_core_act_alloc(kvb_ee_core *core, size_t bytes, uintptr_t *addr);
void kvb_ee_core_act_free(kvb_ee_core *core, uintptr_t addr);

/* Where a request's KV is: its slot (-1 if none), chunks in the CPU buffer. -1 for an unknown id. */
int kvb_ee_core_slot_of(const kvb_ee_core *core, uint64_t id);
int kvb_ee_core_buffer_chunks(const kvb_ee_core *core, uint64_t id);
/* The CPU-buffer chunks (indices in [0, buf_max)) that hold a request's KV, chunk j of its KV in
 * (*ids)[j]: set from the apply that offloads it until the done of the step that fetches it back.
 * Returns how many (0 if none); *ids is valid until the next call into the core. */
int kvb_ee_core_host_chunks(const kvb_ee_core *core, uint64_t id, const int32_t **ids);

const kvb_ee_config *kvb_ee_core_config(const kvb_ee_core *core);
kvb_epool *kvb_ee_core_epool(kvb_ee_core *core);
kvb_slot_pool *kvb_ee_core_slots(kvb_ee_core *core);
kvb_act_pool *kvb_ee_core_act_pool(kvb_ee_core *core);
void kvb_ee_core_get_stats(const kvb_ee_core *core, kvb_ee_stats *out);

/* Chunks of KV for `tokens` tokens. */
int kvb_ee_core_kv_chunks(const kvb_ee_core *core, int64_t tokens);

/* Verifies every book: the chunk pool, the slot and activation pools, each device-resident request
 * holds a live slot whose need covers its KV, no two requests share a slot, the CPU buffer's total.
 * KVB_OK or KVB_ERR_STATE (logged). */
kvb_status kvb_ee_core_check(const kvb_ee_core *core);

#endif
