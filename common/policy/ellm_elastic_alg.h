/* kvbank — eLLM elastic memory's two algorithms as pure functions (ellm-elastic-memory.txt §4.4).
 *
 * Every amount is in physical chunks of the unified pool (common/mem/elastic_pool.h); the logical CPU
 * buffer is counted in chunks too (kvbank's unit: a chunk of KV offloaded is a chunk fetched back).
 *
 * Algorithm 1 (scheduling with elastic memory) plans one iteration, prefill-only or decode-only, over
 * the candidates in queue order (FCFS), and stops at the first that does not fit (lines 13 and 22).
 * Line 5's P_T - (M_kv + M_act + KV_r + ACT_r) >= θ is read with P_T as what this iteration may use:
 * the chunks that hold no live KV and no live activation block (free, cached slots, excess of live
 * slots, idle activation chunks), i.e. p_kv + p_act. All memory of the iteration is allocated together
 * from the result (no hold-and-wait, §4.4.1). The ballooning (lines 24-27) gives the inflation amount
 * I = M_kv - P_kv (> 0, activations -> KV) or the deflation amount I = P_act - M_act (< 0, KV ->
 * activations); only the shortfall moves.
 *
 * Algorithm 2 (SLO-aware logical buffer scaling): TPOT first — B_logic <- max(B_logic / α, 1); else on
 * TTFT B_logic <- min(B_logic · α, B_max). The paper's line 4 prints min(B_logic · α, B_logic), which
 * could never grow the buffer; its text says the logical buffer adjusts "within its fixed capacity",
 * so the bound is B_max. A violation event is >= 3 misses within the last 5 iterations. */
#ifndef KVB_POLICY_ELLM_ELASTIC_ALG_H
#define KVB_POLICY_ELLM_ELASTIC_ALG_H

#include <stdint.h>

#include "common/util/util.h"

typedef enum kvb_ee_phase {
    KVB_EE_PREFILL = 0,
    KVB_EE_DECODE = 1,
} kvb_ee_phase;

/* One candidate request of an iteration, in queue order. */
typedef struct kvb_ee_cand {
    int kv_chunks;       /* KV_r: chunks its KV takes on the device this iteration if it stays there
                          * (prefill: its prompt's; decode: the next token's new chunk, 0 or 1, or all
                          * of its KV when it is fetched back from the CPU buffer) */
    int q_len;           /* tokens it adds to the step */
    int64_t stage_bytes; /* prefill: bytes of the staging area its KV streams through if offloaded
                          * (it joins the step's activations); ignored in decode */
    int needs_slot;      /* 1 if staying on the device takes a free KV slot (a new or fetched request) */
} kvb_ee_cand;

/* Chunks the activations of a step take: `n_tokens` rows from `n_seqs` sequences (one logits row
 * each) plus `stage_bytes` of offload staging. Must not decrease when any argument grows. */
typedef int64_t (*kvb_ee_act_fn)(void *ud, int64_t n_tokens, int n_seqs, int64_t stage_bytes);

typedef struct kvb_ee_alg1_in {
    kvb_ee_phase phase;
    int p_kv;               /* P_kv: KV-owned chunks holding no live KV */
    int p_act;              /* P_act: activation-owned chunks holding no live block */
    int theta;              /* θ: chunks an admission must leave unused */
    int buf_avail;          /* P_B = max(0, B_logic - chunks offloaded now); prefill only */
    int free_slots;         /* KV slots not live */
    int max_tokens;         /* token budget of the step */
    int max_seqs;           /* most sequences in the step */
    int intra;              /* 1: KV and activations share the chunks (inflation/deflation); 0: each
                             * side must fit in what it owns (static split; the "inter" ablation) */
    kvb_ee_act_fn act;
    void *act_ud;
} kvb_ee_alg1_in;

typedef struct kvb_ee_alg1_out {
    int n_batch;    /* the batch is candidates [0, n_batch) */
    int n_offload;  /* of those, how many have offload[i] = 1 */
    int m_kv;       /* M_kv: KV chunks the batch takes on the device */
    int m_act;      /* M_act: activation chunks the step takes */
    int buf_used;   /* chunks the batch's offloads take from P_B */
    int inflate;    /* I: > 0 chunks activations -> KV, < 0 KV -> activations, 0 none (intra = 0: 0) */
} kvb_ee_alg1_out;

/* Algorithm 1 over candidates c[0..n). offload[i] (array of n, written for the batch, 0 elsewhere)
 * says whether candidate i's KV goes to the CPU buffer (prefill only, lines 8-11). KVB_ERR_INVALID
 * for a bad input. */
kvb_status kvb_ee_alg1(const kvb_ee_alg1_in *in, const kvb_ee_cand *c, int n, uint8_t *offload,
                       kvb_ee_alg1_out *out);

/* Lines 24-27: the inflation (> 0) or deflation (< 0) amount for a batch that needs m_kv KV chunks
 * and m_act activation chunks when the KV side has p_kv and the activation side p_act to give. */
int kvb_ee_balloon(int p_kv, int p_act, int m_kv, int m_act);

/* P_B = max(0, B_logic - chunks already offloaded) (§4.3.2 with Alg. 2's logical buffer). */
int64_t kvb_ee_buffer_avail(int64_t b_logic, int64_t offloaded);

/* Algorithm 2: the new B_logic. alpha >= 2; the result lies in [1, max(b_max, 1)]. */
int64_t kvb_ee_buffer_scale(int64_t b_logic, int e_ttft, int e_tpot, int64_t b_max, int alpha);

/* The violation window of Alg. 2: misses of the last `iters` iterations; an event fires when they sum
 * to >= `misses`. After firing, that window restarts empty (one burst of misses is one event, not one
 * per iteration while the burst is in the window: kvbank's reading). */
#define KVB_EE_WINDOW_MAX 64
typedef struct kvb_ee_window {
    int iters;                        /* window length (paper: 5) */
    int misses;                       /* threshold (paper: 3) */
    int ttft[KVB_EE_WINDOW_MAX];      /* ring of per-iteration TTFT misses */
    int tpot[KVB_EE_WINDOW_MAX];
    int pos;
} kvb_ee_window;

/* iters in [1, KVB_EE_WINDOW_MAX], misses >= 1. */
kvb_status kvb_ee_window_init(kvb_ee_window *w, int iters, int misses);
/* Records one iteration's misses and says which events fire. */
void kvb_ee_window_push(kvb_ee_window *w, int ttft_misses, int tpot_misses, int *e_ttft, int *e_tpot);

#endif
