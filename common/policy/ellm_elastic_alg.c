/* kvbank — eLLM elastic memory: Algorithm 1 (scheduling with elastic memory) and Algorithm 2
 * (SLO-aware logical buffer scaling), ellm-elastic-memory.txt §4.4. */
#include "common/policy/ellm_elastic_alg.h"

#include <string.h>

/* Whether the batch so far plus (kv, act) fits: line 5 / 8 / 18 with P_T read as p_kv + p_act. */
static int fits(const kvb_ee_alg1_in *in, int64_t m_kv, int64_t m_act) {
    if (in->intra) return (int64_t)in->p_kv + in->p_act - (m_kv + m_act) >= in->theta;
    return (int64_t)in->p_kv - m_kv >= in->theta && (int64_t)in->p_act - m_act >= 0;
}

kvb_status kvb_ee_alg1(const kvb_ee_alg1_in *in, const kvb_ee_cand *c, int n, uint8_t *offload,
                       kvb_ee_alg1_out *out) {
    if (!in || !out || (n > 0 && (!c || !offload)) || n < 0 || !in->act || in->p_kv < 0 || in->p_act < 0 ||
        in->theta < 0 || in->buf_avail < 0 || in->free_slots < 0 || in->max_tokens < 1 || in->max_seqs < 1)
        return KVB_ERR_INVALID;
    memset(out, 0, sizeof *out);
    if (n > 0) memset(offload, 0, (size_t)n);
    int64_t m_kv = 0, tokens = 0, stage = 0;
    int seqs = 0, slots = in->free_slots, buf = in->buf_avail;
    int64_t m_act = 0; /* the empty step takes none */
    for (int i = 0; i < n; i++) {
        const kvb_ee_cand *r = &c[i];
        if (r->kv_chunks < 0 || r->q_len < 1 || r->stage_bytes < 0) return KVB_ERR_INVALID;
        if (seqs + 1 > in->max_seqs || tokens + r->q_len > in->max_tokens) break;
        /* ACT_r: what the step's activations grow by with r in it */
        int64_t act_with = in->act(in->act_ud, tokens + r->q_len, seqs + 1, stage);
        if (fits(in, m_kv + r->kv_chunks, act_with) && (!r->needs_slot || slots > 0)) {
            m_kv += r->kv_chunks; /* lines 5-7 / 18-20 */
            m_act = act_with;
            slots -= r->needs_slot;
        } else if (in->phase == KVB_EE_PREFILL && r->kv_chunks <= buf) {
            /* lines 8-11: it fits without its KV, which streams to the CPU buffer through a staging
             * area that the step's activations hold */
            int64_t act_off = in->act(in->act_ud, tokens + r->q_len, seqs + 1, stage + r->stage_bytes);
            if (!fits(in, m_kv, act_off)) break;
            m_act = act_off;
            stage += r->stage_bytes;
            buf -= r->kv_chunks;
            offload[i] = 1;
            out->n_offload++;
        } else {
            break; /* lines 13 / 22: FCFS stops at the first that does not fit */
        }
        tokens += r->q_len;
        seqs++;
        out->n_batch = i + 1;
    }
    out->m_kv = (int)m_kv;
    out->m_act = (int)m_act;
    out->buf_used = in->buf_avail - buf;
    out->inflate = in->intra ? kvb_ee_balloon(in->p_kv, in->p_act, out->m_kv, out->m_act) : 0;
    return KVB_OK;
}

int kvb_ee_balloon(int p_kv, int p_act, int m_kv, int m_act) {
    if (p_kv < m_kv && p_act > m_act) return m_kv - p_kv;  /* line 25: inflation */
    if (p_act < m_act && p_kv > m_kv) return p_act - m_act; /* line 27: deflation (negative) */
    return 0;
}

int64_t kvb_ee_buffer_avail(int64_t b_logic, int64_t offloaded) { return KVB_MAX(0, b_logic - offloaded); }

int64_t kvb_ee_buffer_scale(int64_t b_logic, int e_ttft, int e_tpot, int64_t b_max, int alpha) {
    int64_t hi = KVB_MAX(b_max, 1);
    if (alpha < 2) alpha = 2;
    if (e_tpot) b_logic = KVB_MAX(b_logic / alpha, 1);                                   /* line 2 */
    else if (e_ttft) b_logic = b_logic > hi / alpha ? hi : KVB_MIN(b_logic * alpha, hi); /* line 4, bound B_max */
    return KVB_MAX(1, KVB_MIN(b_logic, hi));
}

kvb_status kvb_ee_window_init(kvb_ee_window *w, int iters, int misses) {
    if (iters < 1 || iters > KVB_EE_WINDOW_MAX || misses < 1) return KVB_ERR_INVALID;
    memset(w, 0, sizeof *w);
    w->iters = iters;
    w->misses = misses;
    return KVB_OK;
}

static int ring_sum(const int *r, int n) {
    int s = 0;
    for (int i = 0; i < n; i++) s += r[i];
    return s;
}

void kvb_ee_window_push(kvb_ee_window *w, int ttft_misses, int tpot_misses, int *e_ttft, int *e_tpot) {
    w->ttft[w->pos] = KVB_MAX(0, ttft_misses);
    w->tpot[w->pos] = KVB_MAX(0, tpot_misses);
    w->pos = (w->pos + 1) % w->iters;
    *e_ttft = ring_sum(w->ttft, w->iters) >= w->misses;
    *e_tpot = ring_sum(w->tpot, w->iters) >= w->misses;
    if (*e_ttft) memset(w->ttft, 0, sizeof w->ttft);
    if (*e_tpot) memset(w->tpot, 0, sizeof w->tpot);
}
