/* kvbank-worker — a model of the node that lends the free tail of its KV cache to the master
 * (SwiftCache §3.4-3.5, Alg. 1; docs/lending.md "The coordinator protocol", flows 3-6).
 *
 * The engine's own blocks are [0, n_own) of the region; everything above, [n_own, capacity), is
 * described by `ranges`, lowest first, which tile it exactly:
 *   OFFER     shrunk away and offered (LendOffer sent, LendResult awaited)
 *   LOAN      lent (the coordinator accepted; the master may be reading it)
 *   LIMBO     offered to a coordinator that went away before answering: it may or may not be lent,
 *             so it is used by nobody here until a StatusReply of the ledger (or a Reclaimed) says
 *   RETURNED  ours again but not yet contiguous with [0, n_own) (a higher loan came back first)
 * The lowest range always starts at n_own; a RETURNED range at the bottom is grown back at once.
 * New loans stack downward (the newest is the lowest), and the coordinator reclaims lowest first, so
 * the worker gets a contiguous tail back every time.
 *
 * How much to lend and to reclaim is the pool planner's decision (plan_pool: SwiftCache Alg. 1 in the
 * swiftcache planner, common/policy/swiftcache_planner.c); this file runs the protocol around it.
 * Everything here runs in the server's thread between engine steps (server hooks). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "node/node_proc.h"
#include "common/util/prog.h"
#include "kernels/backend.h"

#define SHUTDOWN_WAIT_MS 5000      /* most time spent getting lent blocks back at exit */
#define RECLAIM_RESEND_PERIODS 10  /* heartbeat periods before a ReclaimRequest is repeated */

typedef enum range_kind { R_OFFER, R_LOAN, R_LIMBO, R_RETURNED } range_kind;

static const char *range_kind_str(range_kind k) {
    switch (k) {
    case R_OFFER: return "offered";
    case R_LOAN: return "lent";
    case R_LIMBO: return "unresolved";
    case R_RETURNED: return "returned";
    }
    return "?";
}

typedef struct range {
    uint32_t first, n;  /* worker blocks [first, first + n) */
    range_kind kind;
    kvb_node_loan loan; /* R_LOAN: as the coordinator granted it (lender points to worker.name) */
} range;

typedef struct worker {
    kvb_node_proc *p;          /* borrowed from main */
    kvb_engine *eng;
    kvb_node_client *nc;
    const kvb_node_proc_args *a;
    int block_size;
    uint32_t capacity;
    range *r;                  /* [n_r] lowest first, tiling [n_own, capacity) */
    int n_r, cap_r;
    kvb_node_loan *view;       /* [cap_r] the R_LOAN loans for a Register */
    uint64_t next_lend_ns;     /* next SCALEDOWN check */
    int draining;              /* the coordinator drains this worker: lend nothing */
    int stopping;              /* shutting down: reclaim everything, lend nothing */
    uint32_t reclaim_n;        /* blocks asked back and not yet returned (0: no reclaim outstanding) */
    uint64_t reclaim_sent_ns;
    uint64_t status_sent_ns;   /* last StatusRequest (meu unknown / limbo) */
    uint64_t n_lends, n_refused, n_reclaims;
} worker;

static uint64_t ms_ns(double ms) { return ms > 0 ? (uint64_t)(ms * 1e6) : 0; }

/* ------------------------------------------------------------------------------------------ ranges */

static uint32_t n_own(const worker *w) { return (uint32_t)kvb_engine_n_own(w->eng); }

static uint32_t blocks_of(const worker *w, range_kind k) {
    uint32_t n = 0;
    for (int i = 0; i < w->n_r; i++)
        if (w->r[i].kind == k) n += w->r[i].n;
    return n;
}

static void check_tiling(const worker *w) {
    uint32_t at = n_own(w);
    for (int i = 0; i < w->n_r; i++) {
        if (w->r[i].first != at) {
            KVB_LOG_E("block ranges out of order: range %d starts at %u, expected %u", i, w->r[i].first, at);
            return;
        }
        at += w->r[i].n;
    }
    if (at != w->capacity) KVB_LOG_E("block ranges end at %u, capacity is %u", at, w->capacity);
}

static kvb_status reserve(worker *w) {
    if (w->n_r < w->cap_r) return KVB_OK;
    int cap = w->cap_r ? 2 * w->cap_r : 8;
    KVB_TRY(kvb_realloc_array((void **)&w->r, (size_t)cap, sizeof *w->r));
    KVB_TRY(kvb_realloc_array((void **)&w->view, (size_t)cap, sizeof *w->view));
    w->cap_r = cap;
    return KVB_OK;
}

static void remove_at(worker *w, int i) {
    memmove(&w->r[i], &w->r[i + 1], (size_t)(w->n_r - i - 1) * sizeof *w->r);
    w->n_r--;
}

/* Grows the engine back over RETURNED ranges at the bottom. */
static void grow_returned(worker *w) {
    while (w->n_r > 0 && w->r[0].kind == R_RETURNED) {
        uint32_t to = w->r[0].first + w->r[0].n;
        kvb_status st = kvb_engine_grow(w->eng, (int)to);
        if (st != KVB_OK) {
            KVB_LOG_E("cannot grow the KV pool to %u blocks: %s", to, kvb_status_str(st));
            return;
        }
        remove_at(w, 0);
    }
    check_tiling(w);
}

static int find_loan(const worker *w, uint64_t loan_id) {
    for (int i = 0; i < w->n_r; i++)
        if (w->r[i].kind == R_LOAN && w->r[i].loan.loan_id == loan_id) return i;
    return -1;
}

static int find_range(const worker *w, uint32_t first, uint32_t n) {
    for (int i = 0; i < w->n_r; i++)
        if (w->r[i].first == first && w->r[i].n == n) return i;
    return -1;
}

static void set_loan(worker *w, range *rg, const Kvbank__Loan *l) {
    rg->kind = R_LOAN;
    rg->loan = (kvb_node_loan){.loan_id = l->loan_id, .lender = w->a->name, .first_block = rg->first,
                               .n_blocks = rg->n, .n_master_blocks = l->n_master_blocks, .offset = l->offset,
                               .bytes = l->bytes, .epoch = l->epoch};
}

/* A reclaim is outstanding until what was asked for came back. */
static void reclaim_progress(worker *w, uint32_t n) {
    if (!w->reclaim_n) return;
    w->reclaim_n = n >= w->reclaim_n ? 0 : w->reclaim_n - n;
}

/* --------------------------------------------------------------------------------- Alg. 1, lending */

static void meu(const worker *w, uint32_t *mw, uint32_t *mm) { kvb_node_client_meu(w->nc, mw, mm); }

/* Offers the top `n` own blocks (a multiple of the worker MEU). */
static void lend(worker *w, uint32_t n, const char *why) {
    uint32_t own = n_own(w), room, mw;
    if (kvb_node_client_lend_room(w->nc, &room) && n > room) {
        /* issue 10: the master's layer stream cache lies within its budget and streams no more than
         * this (the coordinator refuses a larger offer, so that the master never refuses a Grant) */
        meu(w, &mw, NULL);
        uint32_t cap = mw ? room - room % mw : 0;
        KVB_LOG_D("%u block(s) to lend, the master can attach %u more: offering %u", n, room, cap);
        n = cap;
    }
    if (n == 0 || n > own) return;
    if (reserve(w) != KVB_OK) return;
    uint32_t first = own - n;
    kvb_status st = kvb_engine_shrink(w->eng, (int)first);
    if (st != KVB_OK) {
        KVB_LOG_D("cannot shrink to %u blocks now: %s", first, kvb_status_str(st));
        return;
    }
    memmove(&w->r[1], &w->r[0], (size_t)w->n_r * sizeof *w->r);
    w->r[0] = (range){.first = first, .n = n, .kind = R_OFFER};
    w->n_r++;
    st = kvb_node_client_send_lend_offer(w->nc, first, n);
    if (st != KVB_OK) {
        KVB_LOG_D("LendOffer not sent (%s); growing back", kvb_status_str(st));
        w->r[0].kind = R_RETURNED;
        grow_returned(w);
        return;
    }
    KVB_LOG_I("offering blocks [%u, %u) to the master (%s)", first, first + n, why);
}

static int offer_pending(const worker *w) {
    for (int i = 0; i < w->n_r; i++)
        if (w->r[i].kind == R_OFFER) return 1;
    return 0;
}

/* Asks the pool planner (SwiftCache Alg. 1) about `kind`; `out` gets its amounts. */
static kvb_status pool_decide(worker *w, kvb_pool_event_kind kind, int64_t tokens, int n_blocks, int starved,
                              kvb_pool_plan *out) {
    uint32_t mw, mm;
    meu(w, &mw, &mm);
    kvb_pool_event ev = {.kind = kind, .now_s = kvb_now_s(), .tokens = tokens, .n_blocks = n_blocks,
                         .meu_worker = mw, .meu_master = mm,
                         .own_soon = (int64_t)n_own(w) + blocks_of(w, R_RETURNED), /* returned: grown once contiguous */
                         .lent = blocks_of(w, R_LOAN), .free_tail = kvb_engine_free_tail(w->eng),
                         .live_max_tokens = kvb_engine_max_request_tokens(w->eng), .starved = starved};
    kvb_status st = kvb_node_proc_plan_pool(w->p, &ev, out);
    if (st != KVB_OK) KVB_LOG_W("the pool planner failed: %s", kvb_status_str(st));
    return st;
}

/* Alg. 1 SCALEDOWN (the planner's amount, capped by the free tail and rounded down to the MEU). */
static void scale_down(worker *w) {
    uint32_t mw, mm;
    meu(w, &mw, &mm);
    if (!mw || !mm || w->draining || w->stopping || offer_pending(w) || w->reclaim_n ||
        !kvb_node_client_registered(w->nc) || kvb_engine_starved(w->eng))
        return;
    kvb_pool_plan pp;
    if (pool_decide(w, KVB_POOL_TICK, 0, 0, 0, &pp) != KVB_OK || pp.lend <= 0) return;
    lend(w, (uint32_t)KVB_MIN(pp.lend, (int64_t)UINT32_MAX), pp.why);
}

/* Whether a ReclaimRequest may go out now: one at a time, repeated only when unanswered for long. */
static int may_reclaim(const worker *w) {
    if (!blocks_of(w, R_LOAN) || !kvb_node_client_registered(w->nc)) return 0;
    uint64_t quiet = ms_ns(RECLAIM_RESEND_PERIODS * (double)kvb_node_client_heartbeat_ms(w->nc));
    return !w->reclaim_n || kvb_now_ns() - w->reclaim_sent_ns >= quiet;
}

/* Asks the coordinator for `n` lent blocks back (it revokes loans lowest first, the last one only in
 * part when less than all of it is needed). */
static void reclaim(worker *w, uint32_t n, const char *why) {
    uint32_t lent = blocks_of(w, R_LOAN);
    if (n > lent) n = lent;
    if (!n || kvb_node_client_send_reclaim(w->nc, n) != KVB_OK) return;
    w->reclaim_n = n;
    w->reclaim_sent_ns = kvb_now_ns();
    w->n_reclaims++;
    KVB_LOG_I("reclaiming %u block(s) (%s; %u own)", n, why, n_own(w));
}

/* What the pool planner asks back (Alg. 1 SCALEUP), sent if a reclaim may go out now. */
static void scale_up(worker *w, const kvb_pool_plan *pp) {
    if (pp->reclaim <= 0 || !may_reclaim(w)) return;
    reclaim(w, (uint32_t)KVB_MIN(pp->reclaim, (int64_t)UINT32_MAX), pp->why);
}

/* ---------------------------------------------------------------------------- coordinator messages */

static void cb_load(void *ud, kvb_node_load *out) {
    worker *w = ud;
    kvb_node_proc_load(w->p, out);
    kvb_pool_plan pp;
    int64_t mx = pool_decide(w, KVB_POOL_TICK, 0, 0, 0, &pp) == KVB_OK ? pp.demand_tokens : 0;
    out->max_need = (uint32_t)KVB_MIN(KVB_DIV_CEIL(mx, (int64_t)w->block_size), (int64_t)UINT32_MAX);
}

static int cb_loans(void *ud, const kvb_node_loan **out) {
    worker *w = ud;
    int n = 0;
    for (int i = 0; i < w->n_r; i++)
        if (w->r[i].kind == R_LOAN) w->view[n++] = w->r[i].loan;
    *out = w->view;
    return n;
}

static void cb_registered(void *ud, int same) {
    worker *w = ud;
    /* A LendOffer the coordinator has not answered may have been applied or not; the Register we just
     * sent did not report it, so the ledger's answer (a StatusReply) decides. */
    int limbo = 0;
    for (int i = 0; i < w->n_r; i++)
        if (w->r[i].kind == R_OFFER) w->r[i].kind = R_LIMBO, limbo = 1;
    if (limbo) KVB_LOG_W("an offer is unanswered after registering again; asking the ledger");
    if (!same) w->draining = 0; /* a new coordinator instance knows nothing of a drain */
    w->reclaim_n = 0;           /* ask again if still short */
    w->status_sent_ns = 0;      /* a StatusRequest now if the MEU or a limbo range needs one */
}

static void cb_lend_result(void *ud, const Kvbank__LendResult *m) {
    worker *w = ud;
    int i = -1;
    for (int k = 0; k < w->n_r; k++)
        if (w->r[k].kind == R_OFFER || w->r[k].kind == R_LIMBO) {
            if (m->loan && (w->r[k].first != m->loan->first_block || w->r[k].n != m->loan->n_blocks)) continue;
            i = k;
            break;
        }
    if (i < 0) {
        KVB_LOG_W("LendResult (%s) for no pending offer ignored", m->accepted ? "accepted" : "refused");
        return;
    }
    range *rg = &w->r[i];
    if (!m->accepted) {
        w->n_refused++;
        KVB_LOG_I("offer of blocks [%u, %u) refused: %s; growing back", rg->first, rg->first + rg->n,
                  m->error && m->error[0] ? m->error : "no reason given");
        rg->kind = R_RETURNED;
        grow_returned(w);
        /* A refusal (no master, MEU changed) would repeat at once: wait a full interval. */
        w->next_lend_ns = kvb_now_ns() + ms_ns(w->a->lend_interval_s * 1000.0);
        return;
    }
    if (rg->kind == R_LIMBO) return; /* the ledger's StatusReply decides (it may have been dropped since) */
    set_loan(w, rg, m->loan);
    w->n_lends++;
    KVB_LOG_I("lent blocks [%u, %u) as loan %" PRIu64 " (%u master blocks, epoch %" PRIu64 ")", rg->first,
              rg->first + rg->n, m->loan->loan_id, m->loan->n_master_blocks, m->loan->epoch);
}

/* `n` blocks came back (a range now RETURNED): grow over them, and count unasked ones as demand. */
static void returned(worker *w, uint32_t n) {
    int asked = w->reclaim_n > 0 || w->stopping;
    reclaim_progress(w, n);
    grow_returned(w);
    if (!asked && !w->draining) {
        /* Not asked for (kvbankctl reclaim, a master that left, a ledger rebuilt without the loan):
         * someone wants this worker to hold its blocks. Counted as demand in Alg. 1's window, so that
         * SCALEDOWN does not lend them again before window_s has passed. */
        uint32_t hold = n_own(w);
        kvb_pool_plan pp;
        (void)pool_decide(w, KVB_POOL_RETURNED, 0, (int)hold, 0, &pp);
        KVB_LOG_I("keeping %u own blocks for the %.0f s window (the blocks came back unasked)", hold, w->a->window_s);
    }
}

static void cb_reclaimed(void *ud, const Kvbank__Reclaimed *m) {
    worker *w = ud;
    int i = m->loan_id ? find_loan(w, m->loan_id) : -1;
    if (i < 0) i = find_range(w, m->first_block, m->n_blocks);
    if (i < 0) {
        KVB_LOG_W("Reclaimed of loan %" PRIu64 " (blocks [%u, %u)) that is not lent here ignored", m->loan_id,
                  m->first_block, m->first_block + m->n_blocks);
        return;
    }
    range *rg = &w->r[i];
    if (rg->kind == R_RETURNED) return; /* a repeat */
    if (rg->kind == R_LOAN && m->loan_id == rg->loan.loan_id && m->first_block == rg->first && m->n_blocks < rg->n) {
        /* Partial reclaim (issue 10): the front of the loan is back, the loan keeps the rest. */
        if (reserve(w) != KVB_OK) {
            KVB_LOG_E("no memory to split loan %" PRIu64 "; blocks [%u, %u) stay unused", m->loan_id, m->first_block,
                      m->first_block + m->n_blocks);
            return;
        }
        rg = &w->r[i];
        uint32_t k = m->n_blocks;
        memmove(&w->r[i + 1], &w->r[i], (size_t)(w->n_r - i) * sizeof *w->r);
        w->n_r++;
        range *loan = &w->r[i + 1];
        uint32_t mk = (uint32_t)((uint64_t)k * loan->loan.n_master_blocks / loan->n);
        uint64_t kb = loan->loan.bytes / loan->n * k;
        loan->first += k;
        loan->n -= k;
        loan->loan.first_block = loan->first;
        loan->loan.n_blocks = loan->n;
        loan->loan.n_master_blocks -= mk;
        loan->loan.offset += kb;
        loan->loan.bytes -= kb;
        w->r[i] = (range){.first = m->first_block, .n = k, .kind = R_RETURNED};
        KVB_LOG_I("blocks [%u, %u) (the front of loan %" PRIu64 ") are back; it keeps [%u, %u)", m->first_block,
                  m->first_block + k, m->loan_id, loan->first, loan->first + loan->n);
        returned(w, k);
        return;
    }
    if (rg->first != m->first_block || rg->n != m->n_blocks)
        KVB_LOG_W("Reclaimed of loan %" PRIu64 " names blocks [%u, %u), the loan is [%u, %u); taking the loan's",
                  m->loan_id, m->first_block, m->first_block + m->n_blocks, rg->first, rg->first + rg->n);
    KVB_LOG_I("blocks [%u, %u) (%s, loan %" PRIu64 ") are back", rg->first, rg->first + rg->n, range_kind_str(rg->kind),
              m->loan_id);
    rg->kind = R_RETURNED;
    returned(w, rg->n);
}


static void cb_lend_request(void *ud, const Kvbank__LendRequest *m) {
    worker *w = ud;
    if (m->drain) {
        /* The coordinator reclaims the loans itself; lend nothing from now on. */
        if (!w->draining) KVB_LOG_I("draining: lending nothing more, %u block(s) on their way back", blocks_of(w, R_LOAN));
        w->draining = 1;
        return;
    }
    w->draining = 0;
    if (!w->a->lend) {
        KVB_LOG_I("asked to lend %u block(s): this worker does not lend", m->n_blocks);
        return;
    }
    if (m->n_blocks == 0) {
        scale_down(w);
        return;
    }
    uint32_t mw, mm;
    meu(w, &mw, &mm);
    if (!mw) {
        KVB_LOG_W("asked to lend %u block(s) but the minimum elastic unit is not known yet", m->n_blocks);
        return;
    }
    if (offer_pending(w) || w->stopping) {
        KVB_LOG_W("asked to lend %u block(s) while an offer is pending or stopping; ignored", m->n_blocks);
        return;
    }
    uint32_t tail = (uint32_t)KVB_MAX(kvb_engine_free_tail(w->eng), 0);
    uint32_t n = KVB_MIN(m->n_blocks, tail);
    n -= n % mw;
    if (!n) {
        KVB_LOG_W("asked to lend %u block(s): %u free at the tail, MEU %u: nothing to offer", m->n_blocks, tail, mw);
        return;
    }
    lend(w, n, "asked by the coordinator");
}

static void cb_status(void *ud, const Kvbank__StatusReply *m) {
    worker *w = ud;
    const Kvbank__ModelStatus *me = NULL, *master = NULL;
    for (size_t i = 0; i < m->n_models; i++) {
        const Kvbank__ModelStatus *ms = m->models[i];
        if (!ms || !ms->name) continue;
        if (!strcmp(ms->name, w->a->name)) me = ms;
        if (ms->role == KVBANK__ROLE__ROLE_MASTER && ms->alive) master = ms;
    }
    uint32_t mw, mm;
    meu(w, &mw, &mm);
    if (me && me->meu && me->meu_master && (!mw || !mm)) kvb_node_client_set_meu(w->nc, me->meu, me->meu_master);
    if (!master) return; /* until the master has registered, the ledger cannot tell what it holds */
    int changed = 0;
    for (int i = 0; i < w->n_r; i++) {
        range *rg = &w->r[i];
        if (rg->kind != R_LIMBO) continue;
        const Kvbank__Loan *hit = NULL;
        for (size_t k = 0; k < m->n_loans; k++) {
            const Kvbank__Loan *l = m->loans[k];
            if (l && l->lender && !strcmp(l->lender, w->a->name) && l->first_block < rg->first + rg->n &&
                rg->first < l->first_block + l->n_blocks)
                hit = l;
        }
        if (!hit) {
            KVB_LOG_I("blocks [%u, %u): the ledger has no loan of them; taking them back", rg->first, rg->first + rg->n);
            rg->kind = R_RETURNED;
            changed = 1;
        } else if (!hit->revoking && hit->first_block == rg->first && hit->n_blocks == rg->n) {
            set_loan(w, rg, hit);
            KVB_LOG_I("blocks [%u, %u) are lent as loan %" PRIu64 " (from the ledger)", rg->first, rg->first + rg->n,
                      hit->loan_id);
        }
        /* else: being revoked (or reshaped); ask again later */
    }
    if (changed) grow_returned(w);
}

/* ----------------------------------------------------------------------------------- server hooks */

static int on_tick(void *ud) {
    worker *w = ud;
    uint64_t now = kvb_now_ns();
    kvb_pool_plan pp;
    if (kvb_engine_starved(w->eng) && may_reclaim(w) && pool_decide(w, KVB_POOL_TICK, 0, 0, 1, &pp) == KVB_OK)
        scale_up(w, &pp);
    if (!w->stopping && now >= w->next_lend_ns) {
        w->next_lend_ns = now + ms_ns(w->a->lend_interval_s * 1000.0);
        if (w->a->lend) scale_down(w);
    }
    /* The ledger answers what the MEU is (a coordinator that does not put it in its replies) and
     * whether an unanswered offer became a loan. */
    uint32_t mw, mm;
    meu(w, &mw, &mm);
    int need_status = blocks_of(w, R_LIMBO) > 0 || ((!mw || !mm) && !w->stopping);
    uint64_t period = ms_ns(KVB_MAX(w->a->lend_interval_s * 1000.0, (double)kvb_node_client_heartbeat_ms(w->nc)));
    if (need_status && kvb_node_client_registered(w->nc) && now - w->status_sent_ns >= period) {
        w->status_sent_ns = now;
        kvb_node_client_send_status_request(w->nc, blocks_of(w, R_LIMBO) > 0);
    }
    if (w->stopping && may_reclaim(w)) reclaim(w, blocks_of(w, R_LOAN), "stopping");
    uint64_t next = w->next_lend_ns > now ? w->next_lend_ns - now : 0;
    return (int)KVB_MIN(next / 1000000u, (uint64_t)1000);
}

static void on_request(void *ud, const kvb_request *r) {
    worker *w = ud;
    kvb_pool_plan pp; /* the planner records the request in its window and says what to ask back */
    if (pool_decide(w, KVB_POOL_REQUEST, (int64_t)r->n_prompt + r->max_tokens, 0, 0, &pp) == KVB_OK) scale_up(w, &pp);
}

/* ------------------------------------------------------------------------------------------- main */

static int all_back(void *ud) {
    worker *w = ud;
    return blocks_of(w, R_LOAN) + blocks_of(w, R_OFFER) == 0;
}

int main(int argc, char **argv) {
    kvb_cpu_threads_wait(argv, KVB_CPU_CORES_SHARED);
    kvb_prog_init(argc, argv, "kvbank-worker");
    kvb_node_proc_args a;
    int rc = kvb_node_proc_parse(KVB_ROLE_WORKER, argc, argv, &a);
    if (rc >= 0) return rc;
    rc = 1;
    worker w;
    memset(&w, 0, sizeof w);
    w.a = &a;
    w.block_size = a.block_size;
    kvb_node_role role = {
        .ud = &w,
        .cb = {.ud = &w, .load = cb_load, .loans = cb_loans, .on_registered = cb_registered,
               .on_lend_result = cb_lend_result, .on_reclaimed = cb_reclaimed, .on_lend_request = cb_lend_request,
               .on_status = cb_status},
        .on_tick = on_tick,
        .on_request = on_request,
    };
    kvb_node_proc *p = NULL;
    if (kvb_node_proc_create(&a, &role, &p) != KVB_OK) goto out;
    w.p = p;
    w.a = kvb_node_proc_args_of(p); /* as the process settled them (a planner with its own KV lends nothing) */
    w.eng = kvb_node_proc_engine(p);
    w.nc = kvb_node_proc_client(p);
    w.capacity = (uint32_t)kvb_engine_capacity(w.eng);
    w.next_lend_ns = kvb_now_ns() + ms_ns(a.lend_interval_s * 1000.0);
    if (reserve(&w) != KVB_OK) goto out;

    kvb_status st = kvb_node_proc_run(p);
    /* Stopped: live requests are cancelled. Get the lent blocks back if the coordinator is there, so
     * that the master moves what lives on them instead of recomputing it after our death. */
    w.stopping = 1;
    if (!all_back(&w) && kvb_node_client_registered(w.nc)) {
        KVB_LOG_I("stopping: asking for %u lent block(s) back", blocks_of(&w, R_LOAN));
        if (!kvb_node_proc_pump(p, SHUTDOWN_WAIT_MS, all_back, &w))
            KVB_LOG_W("stopping with %u block(s) still lent (the coordinator will revoke them)",
                      blocks_of(&w, R_LOAN) + blocks_of(&w, R_OFFER));
    }
    KVB_LOG_I("lent %" PRIu64 " time(s), %" PRIu64 " offer(s) refused, %" PRIu64 " reclaim(s)", w.n_lends, w.n_refused,
              w.n_reclaims);
    if (st != KVB_OK) fprintf(stderr, "kvbank-worker: stopped on an error: %s\n", kvb_status_str(st));
    else rc = 0;
out:
    kvb_node_proc_destroy(p);
    free(w.r);
    free(w.view);
    kvb_node_proc_args_free(&a);
    return rc;
}
