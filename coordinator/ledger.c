/* kvbank — the coordinator's ledger (see ledger.h for the loan life cycle and the rules).
 *
 * Models and loans live in plain arrays (a node has a handful of models and a few hundred loans at
 * most); loans keep creation order. Every operation first reserves room for the actions it may queue
 * and for the loan it may create, so that once it starts changing the ledger nothing can fail halfway. */
#include "coordinator/ledger.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv/block_pool.h"

struct kvb_ledger {
    kvb_ledger_opts opts;
    kvb_ledger_model *models;  /* [n_models] registration order */
    int n_models, cap_models;
    kvb_loan *loans;           /* [n_loans] creation order */
    int n_loans, cap_loans;
    kvb_ledger_action *acts;   /* [n_acts] queued, [head_act, n_acts) not yet popped */
    int head_act, n_acts, cap_acts;
    uint64_t epoch;
    uint64_t next_loan_id;     /* > every loan id seen */
};

/* ------------------------------------------------------------------------------------------ helpers */

static void set_why(char *why, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void set_why(char *why, size_t len, const char *fmt, ...) {
    if (!why || !len) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, len, fmt, ap);
    va_end(ap);
}

const char *kvb_loan_state_str(kvb_loan_state s) {
    switch (s) {
    case KVB_LOAN_GRANTING: return "granting";
    case KVB_LOAN_ACTIVE: return "active";
    case KVB_LOAN_REVOKING: return "revoking";
    case KVB_LOAN_UNCONFIRMED: return "unconfirmed";
    }
    return "?";
}

static int name_ok(const char *s) {
    if (!s) return 0;
    size_t n = strlen(s);
    if (n == 0 || n > KVB_LEDGER_NAME_MAX) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
              c == '.'))
            return 0;
    }
    return 1;
}

static uint64_t silence_ms(const kvb_ledger *l) { return (uint64_t)l->opts.heartbeat_ms * l->opts.heartbeat_misses; }
/* A loan only the master reported waits for its lender as long as a registered model may stay silent
 * before it is declared dead (the silence limit): a live lender slow to register again (a loaded
 * machine) keeps its loan, a dead one loses it no later than it would have been found dead. Waiting
 * costs nothing: a lender that registers without the loan, or a new process of its name, settles it at
 * once. (Two heartbeat periods were too short: a lender 0.4 s late under load had the master's data on
 * its blocks dropped and its loan revoked although it lived.) */
static uint64_t lender_grace_ms(const kvb_ledger *l) { return silence_ms(l); }
/* A loan only its worker reported may still be attached in a master that has not reconnected yet:
 * returning it early would let two processes use the blocks, so it waits for the master to register
 * (which settles it at once) far longer than a live master needs to reconnect. */
static uint64_t master_grace_ms(const kvb_ledger *l) { return KVB_MAX(30000, 15 * silence_ms(l)); }

static kvb_ledger_model *find_model(const kvb_ledger *l, const char *name) {
    if (!name) return NULL;
    for (int i = 0; i < l->n_models; i++)
        if (!strcmp(l->models[i].name, name)) return &l->models[i];
    return NULL;
}

static kvb_ledger_model *live_model(const kvb_ledger *l, const char *name) {
    kvb_ledger_model *m = find_model(l, name);
    return m && m->alive ? m : NULL;
}

static kvb_ledger_model *live_master(const kvb_ledger *l) {
    for (int i = 0; i < l->n_models; i++)
        if (l->models[i].alive && l->models[i].role == KVB_ROLE_MASTER) return &l->models[i];
    return NULL;
}

static int loan_index(const kvb_ledger *l, uint64_t id) {
    for (int i = 0; i < l->n_loans; i++)
        if (l->loans[i].id == id) return i;
    return -1;
}

static kvb_loan *find_loan(const kvb_ledger *l, uint64_t id) {
    int i = loan_index(l, id);
    return i < 0 ? NULL : &l->loans[i];
}

static uint64_t bump(kvb_ledger *l) { return ++l->epoch; }

static int pid_alive(const kvb_ledger *l, uint32_t pid) {
    if (!l->opts.pid_alive || pid == 0) return 1;
    return l->opts.pid_alive(l->opts.pid_ud, pid);
}

/* Room for `n_acts` more actions and `n_new` more loans, so that the caller cannot fail once it
 * changes things. */
static kvb_status reserve(kvb_ledger *l, int n_acts, int n_new) {
    if (l->head_act == l->n_acts) l->head_act = l->n_acts = 0;
    if (l->n_acts + n_acts > l->cap_acts) {
        int cap = KVB_MAX(l->cap_acts * 2, l->n_acts + n_acts + 16);
        KVB_TRY(kvb_realloc_array((void **)&l->acts, (size_t)cap, sizeof *l->acts));
        l->cap_acts = cap;
    }
    if (l->n_loans + n_new > l->cap_loans) {
        int cap = KVB_MAX(KVB_MAX(l->cap_loans * 2, 16), l->n_loans + n_new);
        KVB_TRY(kvb_realloc_array((void **)&l->loans, (size_t)cap, sizeof *l->loans));
        l->cap_loans = cap;
    }
    return KVB_OK;
}

/* Actions that one operation may queue at most: one per loan, a few more. */
static int max_actions(const kvb_ledger *l, int extra) { return l->n_loans + extra + 4; }

static kvb_ledger_action *push(kvb_ledger *l, kvb_ledger_action_kind kind, const char *to) {
    /* reserve() made room */
    kvb_ledger_action *a = &l->acts[l->n_acts++];
    memset(a, 0, sizeof *a);
    a->kind = kind;
    snprintf(a->to, sizeof a->to, "%s", to);
    return a;
}

static void push_grant(kvb_ledger *l, const kvb_ledger_model *master, const kvb_loan *ln) {
    kvb_ledger_action *a = push(l, KVB_ACT_GRANT, master->name);
    a->loan = *ln;
}

static void push_revoke(kvb_ledger *l, kvb_loan *ln, uint64_t now_ms) {
    kvb_ledger_model *master = live_master(l);
    ln->t_sent_ms = now_ms;
    if (!master) return; /* nobody holds it: the caller deletes such loans */
    kvb_ledger_action *a = push(l, KVB_ACT_REVOKE, master->name);
    a->loan = *ln;
    a->epoch = ln->revoke_epoch;
    a->lender_dead = ln->lender_dead;
}

/* The lender of `ln` gets Reclaimed if the process the loan belongs to is still registered, alive and
 * has not disowned the loan. */
static void push_reclaimed(kvb_ledger *l, const kvb_loan *ln) {
    kvb_ledger_model *w = live_model(l, ln->lender);
    if (!w || ln->orphan || ln->lender_pid == 0 || w->pid != ln->lender_pid) return;
    kvb_ledger_action *a = push(l, KVB_ACT_RECLAIMED, w->name);
    a->loan = *ln;
    a->epoch = l->epoch;
}

static void delete_loan(kvb_ledger *l, uint64_t id) {
    int i = loan_index(l, id);
    if (i < 0) return;
    memmove(&l->loans[i], &l->loans[i + 1], (size_t)(l->n_loans - i - 1) * sizeof *l->loans);
    l->n_loans--;
}

/* Deletes a loan whose master side is done with it (acked, failed grant, master gone, or never
 * held by a master) and gives the blocks back to its lender. */
static void finish_loan(kvb_ledger *l, uint64_t id) {
    kvb_loan *ln = find_loan(l, id);
    if (!ln) return;
    kvb_loan copy = *ln;
    delete_loan(l, id);
    bump(l);
    push_reclaimed(l, &copy);
}

static int revoke_partial(const kvb_loan *ln) { return ln->revoke_blocks && ln->revoke_blocks < ln->n_blocks; }

/* Lender blocks of `ln` on their way back. */
static uint32_t revoking_blocks(const kvb_loan *ln) {
    return ln->state != KVB_LOAN_REVOKING ? 0 : revoke_partial(ln) ? ln->revoke_blocks : ln->n_blocks;
}

/* Starts (or, for lender_dead, sharpens; for a partial revoke, widens to the whole loan) the revocation
 * of a loan; a loan no master holds is finished at once. */
static void give_back(kvb_ledger *l, kvb_loan *ln, int lender_dead, uint64_t now_ms) {
    if ((ln->state == KVB_LOAN_UNCONFIRMED && !ln->by_master) || !live_master(l)) {
        finish_loan(l, ln->id);
        return;
    }
    if (ln->state == KVB_LOAN_REVOKING) {
        if ((lender_dead && !ln->lender_dead) || revoke_partial(ln)) { /* sharpened, or widened to all */
            ln->lender_dead |= lender_dead;
            ln->revoke_blocks = 0;
            ln->revoke_epoch = bump(l);
            if (!ln->lender_dead) ln->min_ack_epoch = ln->revoke_epoch; /* the part's ack finishes nothing */
            push_revoke(l, ln, now_ms);
        }
        return;
    }
    ln->state = KVB_LOAN_REVOKING;
    ln->t_revoke_ms = now_ms;
    ln->lender_dead = lender_dead;
    ln->revoke_blocks = 0;
    ln->min_ack_epoch = 0;
    ln->revoke_epoch = bump(l);
    push_revoke(l, ln, now_ms);
}

/* Partial reclaim: revokes the first k lender blocks of an ACTIVE loan (0 < k < n_blocks, whole MEUs). */
static void give_back_part(kvb_ledger *l, kvb_loan *ln, uint32_t k, uint64_t now_ms) {
    ln->state = KVB_LOAN_REVOKING;
    ln->t_revoke_ms = now_ms;
    ln->lender_dead = 0;
    ln->revoke_blocks = k;
    ln->min_ack_epoch = 0;
    ln->revoke_epoch = bump(l);
    push_revoke(l, ln, now_ms);
}

static const char *mem_kind(const kvb_ledger_model *m) { return m->memory[0] ? m->memory : "host"; }

/* Why worker w's region cannot serve master's plan, into why[len]; 0 when it can. A region of another
 * memory kind cannot be imported at all (a host shm name means nothing to a device, and the other way
 * round); a device region on another device is not addressable in place, only streamable (peer copies
 * into the master's LSC, "lsc": "stream"). */
static int plan_mismatch(const kvb_ledger_model *master, const kvb_ledger_model *w, char *why, size_t len) {
    if (strcmp(mem_kind(master), mem_kind(w)) != 0) {
        snprintf(why, len, "worker %s has %s memory and master %s has %s memory: models of different memory kinds "
                 "cannot lend to each other", w->name, mem_kind(w), master->name, mem_kind(master));
        return 1;
    }
    if (strcmp(mem_kind(w), "host") != 0 && w->device != master->device && !master->stream) {
        snprintf(why, len, "worker %s's region is on %s device %" PRIu32 " and master %s reads lent blocks in place on "
                 "device %" PRIu32 ": lending across devices needs the master's \"lsc\": \"stream\"",
                 w->name, mem_kind(w), w->device, master->name, master->device);
        return 1;
    }
    return 0;
}

static void recompute_meus(kvb_ledger *l) {
    kvb_ledger_model *master = live_master(l);
    for (int i = 0; i < l->n_models; i++) {
        kvb_ledger_model *w = &l->models[i];
        if (w->role != KVB_ROLE_WORKER) continue;
        w->has_meu = 0;
        char blocked[sizeof w->lend_blocked] = "";
        if (master && w->alive && plan_mismatch(master, w, blocked, sizeof blocked)) {
            if (strcmp(blocked, w->lend_blocked)) KVB_LOG_W("%s", blocked);
        } else if (master && w->alive) {
            /* A unit larger than the worker's whole region could never be lent. */
            if (kvb_swift_meu(&master->geom, &w->geom, w->region_bytes, &w->meu) == KVB_OK) w->has_meu = 1;
            else KVB_LOG_W("no minimum elastic unit between master %s and worker %s: the worker cannot lend",
                           master->name, w->name);
        }
        snprintf(w->lend_blocked, sizeof w->lend_blocked, "%s", blocked);
    }
}

static void model_clear(kvb_ledger_model *m) {
    free(m->region);
    free(m->endpoint);
    free(m->model);
    memset(m, 0, sizeof *m);
}

/* Sums for the status. */
static uint32_t lent_by(const kvb_ledger *l, const kvb_ledger_model *w) {
    uint64_t n = 0;
    for (int i = 0; i < l->n_loans; i++) {
        const kvb_loan *ln = &l->loans[i];
        if (!ln->orphan && ln->lender_pid == w->pid && !strcmp(ln->lender, w->name)) n += ln->n_blocks;
    }
    return n > UINT32_MAX ? UINT32_MAX : (uint32_t)n;
}

/* ------------------------------------------------------------------------------------------ lifecycle */

kvb_status kvb_ledger_create(const kvb_ledger_opts *opts, kvb_ledger **out) {
    if (!opts || !out || opts->heartbeat_ms == 0 || opts->heartbeat_misses == 0) return KVB_ERR_INVALID;
    kvb_ledger *l = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *l, (void **)&l));
    l->opts = *opts;
    l->next_loan_id = 1;
    *out = l;
    return KVB_OK;
}

void kvb_ledger_destroy(kvb_ledger *l) {
    if (!l) return;
    for (int i = 0; i < l->n_models; i++) model_clear(&l->models[i]);
    free(l->models);
    free(l->loans);
    free(l->acts);
    free(l);
}

/* ------------------------------------------------------------------------------------- registration */

static kvb_status check_reg(const kvb_ledger_reg *r, char *why, size_t why_len) {
    if (!name_ok(r->name)) {
        set_why(why, why_len, "name must be 1..%d of [A-Za-z0-9._-]", KVB_LEDGER_NAME_MAX);
        return KVB_ERR_INVALID;
    }
    if (r->role != KVB_ROLE_MASTER && r->role != KVB_ROLE_WORKER) {
        set_why(why, why_len, "role must be master or worker");
        return KVB_ERR_INVALID;
    }
    if (r->pid == 0) {
        set_why(why, why_len, "pid 0");
        return KVB_ERR_INVALID;
    }
    const kvb_kv_geom *g = &r->geom;
    if (g->n_layers <= 0 || g->n_kv_heads <= 0 || g->head_dim <= 0 || g->block_size <= 0 || g->elem_size <= 0 ||
        kvb_kv_block_bytes(g) == 0) {
        set_why(why, why_len, "bad geometry (layers %d, kv heads %d, head dim %d, block size %d, elem size %d)",
                g->n_layers, g->n_kv_heads, g->head_dim, g->block_size, g->elem_size);
        return KVB_ERR_INVALID;
    }
    if (r->memory) {
        size_t n = strlen(r->memory);
        int ok = n <= KVB_LEDGER_MEMORY_MAX;
        for (size_t i = 0; ok && i < n; i++) {
            char ch = r->memory[i];
            ok = (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9');
        }
        if (!ok) {
            set_why(why, why_len, "memory kind must be 0..%d of [a-z0-9]", KVB_LEDGER_MEMORY_MAX);
            return KVB_ERR_INVALID;
        }
    }
    if (!r->region || !r->region[0] || strlen(r->region) > KVB_LEDGER_REGION_MAX) {
        set_why(why, why_len, "region handle must be 1..%d characters", KVB_LEDGER_REGION_MAX);
        return KVB_ERR_INVALID;
    }
    if ((r->endpoint && strlen(r->endpoint) > KVB_LEDGER_TEXT_MAX) ||
        (r->model && strlen(r->model) > KVB_LEDGER_TEXT_MAX)) {
        set_why(why, why_len, "endpoint or model longer than %d characters", KVB_LEDGER_TEXT_MAX);
        return KVB_ERR_INVALID;
    }
    uint64_t bb = kvb_kv_block_bytes(g);
    if (r->capacity == 0 || r->capacity > r->region_bytes / bb) {
        set_why(why, why_len, "capacity %" PRIu32 " blocks of %" PRIu64 " bytes does not fit the region of %" PRIu64
                " bytes", r->capacity, bb, r->region_bytes);
        return KVB_ERR_INVALID;
    }
    if (r->n_own > r->capacity) {
        set_why(why, why_len, "n_own %" PRIu32 " exceeds capacity %" PRIu32, r->n_own, r->capacity);
        return KVB_ERR_INVALID;
    }
    if (r->n_loans < 0 || r->n_loans > KVB_LEDGER_MAX_LOANS || (r->n_loans && !r->loans)) {
        set_why(why, why_len, "bad loan list");
        return KVB_ERR_INVALID;
    }
    for (int i = 0; i < r->n_loans; i++) {
        const kvb_loan *ln = &r->loans[i];
        if (ln->id == 0 || ln->id == UINT64_MAX || !name_ok(ln->lender) || ln->n_blocks == 0) {
            set_why(why, why_len, "loan %d is malformed (id %" PRIu64 ", %" PRIu32 " blocks)", i, ln->id, ln->n_blocks);
            return KVB_ERR_INVALID;
        }
        if (r->role == KVB_ROLE_WORKER &&
            (strcmp(ln->lender, r->name) || (uint64_t)ln->first_block + ln->n_blocks > r->capacity)) {
            set_why(why, why_len, "loan %" PRIu64 " is not a range of this worker's %" PRIu32 " blocks", ln->id,
                    r->capacity);
            return KVB_ERR_INVALID;
        }
        for (int k = 0; k < i; k++)
            if (r->loans[k].id == ln->id) {
                set_why(why, why_len, "loan %" PRIu64 " reported twice", ln->id);
                return KVB_ERR_INVALID;
            }
    }
    if (r->borrow_limited || r->max_borrow) { /* issue 10: the master's LSC within its budget */
        uint64_t held = 0;
        for (int i = 0; i < r->n_loans; i++) held += r->loans[i].n_master_blocks;
        if (r->role != KVB_ROLE_MASTER || !r->borrow_limited) {
            set_why(why, why_len, "max_borrow %" PRIu32 " from %s: only a master limits its borrowing "
                    "(borrow_limited with max_borrow)", r->max_borrow,
                    r->role == KVB_ROLE_MASTER ? "a master without borrow_limited" : "a worker");
            return KVB_ERR_INVALID;
        }
        if (r->max_borrow > (1u << 30) || held > r->max_borrow) {
            set_why(why, why_len, "max_borrow %" PRIu32 " master blocks is above 2^30 or below the %" PRIu64
                    " its reported loans hold", r->max_borrow, held);
            return KVB_ERR_INVALID;
        }
    }
    return KVB_OK;
}

static int same_range(const kvb_loan *a, const kvb_loan *b) {
    return !strcmp(a->lender, b->lender) && a->first_block == b->first_block && a->n_blocks == b->n_blocks;
}

static int overlaps(uint32_t a0, uint32_t an, uint32_t b0, uint32_t bn) {
    return (uint64_t)a0 < (uint64_t)b0 + bn && (uint64_t)b0 < (uint64_t)a0 + an;
}

/* A loan of the lender process (name, pid) overlapping [first, first + n), or NULL. */
static kvb_loan *overlapping(const kvb_ledger *l, const char *lender, uint32_t pid, uint32_t first, uint32_t n) {
    for (int i = 0; i < l->n_loans; i++) {
        kvb_loan *ln = &l->loans[i];
        if (ln->lender_pid == pid && !strcmp(ln->lender, lender) && overlaps(first, n, ln->first_block, ln->n_blocks))
            return ln;
    }
    return NULL;
}

/* A reported loan the ledger lacks: copies the parts a report carries. */
static kvb_loan *add_reported(kvb_ledger *l, const kvb_loan *r, uint32_t lender_pid, uint64_t block_bytes) {
    kvb_loan *ln = &l->loans[l->n_loans++];
    memset(ln, 0, sizeof *ln);
    ln->id = r->id;
    snprintf(ln->lender, sizeof ln->lender, "%s", r->lender);
    ln->lender_pid = lender_pid;
    ln->first_block = r->first_block;
    ln->n_blocks = r->n_blocks;
    ln->n_master_blocks = r->n_master_blocks;
    ln->offset = block_bytes ? (uint64_t)r->first_block * block_bytes : r->offset;
    ln->bytes = block_bytes ? (uint64_t)r->n_blocks * block_bytes : r->bytes;
    ln->epoch = r->epoch;
    if (r->id >= l->next_loan_id) l->next_loan_id = r->id + 1;
    if (r->epoch > l->epoch) l->epoch = r->epoch;
    return ln;
}

/* A coordinator restart in the middle of a partial revoke (issue 10): the master had given back the
 * front of loan `wide` (the worker's view, which never got Reclaimed for it) and keeps `narrow` (its
 * view), acking to a coordinator that died. 1 when `narrow` is such a suffix of `wide`. */
static int front_given_back(const kvb_loan *wide, const kvb_loan *narrow) {
    return wide->id == narrow->id && !strcmp(wide->lender, narrow->lender) && narrow->first_block > wide->first_block &&
           (uint64_t)narrow->first_block + narrow->n_blocks == (uint64_t)wide->first_block + wide->n_blocks;
}

/* Finishes that partial revoke: the ledger's loan `ln` becomes `keep`'s range (ACTIVE, both sides), the
 * lender gets Reclaimed for the front [from, keep->first_block) of the loan it reported. */
static void finish_front(kvb_ledger *l, kvb_loan *ln, uint32_t from, const kvb_loan *keep, uint32_t n_master_blocks,
                         uint64_t bb) {
    uint32_t k = keep->first_block - from;
    KVB_LOG_W("loan %" PRIu64 " of %s: the master holds [%" PRIu32 ", %" PRIu64 "), the worker [%" PRIu32 ", %" PRIu64
              "): a partial revoke's ack was lost with the previous coordinator; the front goes back to the worker",
              ln->id, ln->lender, keep->first_block, (uint64_t)keep->first_block + keep->n_blocks, from,
              (uint64_t)keep->first_block + keep->n_blocks);
    kvb_ledger_action *a = push(l, KVB_ACT_RECLAIMED, ln->lender);
    a->loan = *ln;
    a->loan.first_block = from;
    a->loan.n_blocks = k;
    a->epoch = bump(l);
    ln->first_block = keep->first_block;
    ln->n_blocks = keep->n_blocks;
    ln->n_master_blocks = n_master_blocks;
    ln->offset = (uint64_t)ln->first_block * bb;
    ln->bytes = (uint64_t)ln->n_blocks * bb;
    ln->state = KVB_LOAN_ACTIVE;
    ln->by_master = ln->by_worker = 1;
}

static int in_ids(const uint64_t *ids, int n, uint64_t id) {
    for (int i = 0; i < n; i++)
        if (ids[i] == id) return 1;
    return 0;
}

/* `matched` has room for every reported loan plus every ledger loan (the caller allocated it before
 * changing anything). */
static void reconcile_worker(kvb_ledger *l, kvb_ledger_model *w, const kvb_ledger_reg *r, uint64_t now_ms,
                             uint64_t *matched) {
    uint64_t bb = kvb_kv_block_bytes(&w->geom);
    kvb_ledger_model *master = live_master(l);
    int n_matched = 0;
    for (int k = 0; k < r->n_loans; k++) {
        const kvb_loan *rep = &r->loans[k];
        kvb_loan *ln = find_loan(l, rep->id);
        if (ln && same_range(ln, rep) && (ln->lender_pid == w->pid || ln->lender_pid == 0)) {
            matched[n_matched++] = ln->id;
            ln->lender_pid = w->pid;
            ln->orphan = 0;
            ln->offset = (uint64_t)ln->first_block * bb; /* the master's report may not have said */
            ln->bytes = (uint64_t)ln->n_blocks * bb;
            if (ln->state == KVB_LOAN_UNCONFIRMED && ln->by_master) { /* both sides now */
                ln->state = KVB_LOAN_ACTIVE;
                ln->by_worker = 1;
                bump(l);
                KVB_LOG_I("loan %" PRIu64 " of %s confirmed by both sides", ln->id, w->name);
            }
            continue;
        }
        if (ln && ln->state == KVB_LOAN_UNCONFIRMED && ln->by_master && (ln->lender_pid == w->pid || ln->lender_pid == 0) &&
            front_given_back(rep, ln)) { /* the master gave the front back; the worker never heard */
            matched[n_matched++] = ln->id;
            ln->lender_pid = w->pid;
            ln->orphan = 0;
            finish_front(l, ln, rep->first_block, ln, ln->n_master_blocks, bb);
            continue;
        }
        if (ln) { /* the id means another range: keep the ledger's view, give the worker its blocks */
            KVB_LOG_W("worker %s reports loan %" PRIu64 " as blocks [%" PRIu32 ", %" PRIu64 "), the ledger has "
                      "%s [%" PRIu32 ", %" PRIu64 ") under that id: returning the reported range", w->name, rep->id,
                      rep->first_block, (uint64_t)rep->first_block + rep->n_blocks, ln->lender, ln->first_block,
                      (uint64_t)ln->first_block + ln->n_blocks);
        }
        kvb_loan *ov = overlapping(l, w->name, w->pid, rep->first_block, rep->n_blocks);
        if (!ov) ov = overlapping(l, w->name, 0, rep->first_block, rep->n_blocks);
        if (ov) { /* a master may hold those blocks: they come back only through its RevokeAck (the ledger's
                   * loan, not reported here, is revoked below) */
            KVB_LOG_W("worker %s reports loan %" PRIu64 " overlapping loan %" PRIu64 ": ignored", w->name, rep->id,
                      ov->id);
            continue;
        }
        if (master || ln) { /* the master registered without it: the worker alone has it */
            kvb_ledger_action *a = push(l, KVB_ACT_RECLAIMED, w->name);
            a->loan = *rep;
            snprintf(a->loan.lender, sizeof a->loan.lender, "%s", w->name);
            a->epoch = l->epoch;
            KVB_LOG_I("loan %" PRIu64 " reported by worker %s alone: returned to it", rep->id, w->name);
            continue;
        }
        kvb_loan *nl = add_reported(l, rep, w->pid, bb);
        nl->state = KVB_LOAN_UNCONFIRMED;
        nl->by_worker = 1;
        nl->deadline_ms = now_ms + master_grace_ms(l);
        matched[n_matched++] = nl->id;
        bump(l);
        KVB_LOG_I("loan %" PRIu64 " reported by worker %s: waiting up to %" PRIu64 " ms for the master", rep->id,
                  w->name, master_grace_ms(l));
    }
    /* Loans of this worker's process (or of no process yet) that it did not report: it uses those
     * blocks as its own, so the master must drop them without reading. */
    uint64_t *todo = matched + n_matched;
    int n_todo = 0;
    for (int i = 0; i < l->n_loans; i++) {
        const kvb_loan *ln = &l->loans[i];
        if (strcmp(ln->lender, w->name) || (ln->lender_pid != w->pid && ln->lender_pid != 0)) continue;
        if (in_ids(matched, n_matched, ln->id) || ln->orphan) continue;
        todo[n_todo++] = ln->id;
    }
    for (int k = 0; k < n_todo; k++) {
        kvb_loan *ln = find_loan(l, todo[k]);
        if (!ln) continue;
        KVB_LOG_W("worker %s did not report loan %" PRIu64 " [%" PRIu32 ", %" PRIu64 "): revoking it (lender_dead)",
                  w->name, ln->id, ln->first_block, (uint64_t)ln->first_block + ln->n_blocks);
        ln->orphan = 1;
        ln->lender_pid = w->pid; /* its range is in this process's region: no offer may overlap it */
        give_back(l, ln, 1, now_ms);
    }
}

static void reconcile_master(kvb_ledger *l, kvb_ledger_model *m, const kvb_ledger_reg *r, uint64_t now_ms,
                             uint64_t *matched) {
    int n_matched = 0;
    for (int k = 0; k < r->n_loans; k++) {
        const kvb_loan *rep = &r->loans[k];
        int revoking = rep->state == KVB_LOAN_REVOKING;
        kvb_loan *ln = find_loan(l, rep->id);
        if (ln && same_range(ln, rep)) {
            matched[n_matched++] = ln->id;
            if (ln->state == KVB_LOAN_UNCONFIRMED) { /* reported by the worker before: both sides now */
                ln->state = KVB_LOAN_ACTIVE;
                ln->by_master = 1;
                ln->n_master_blocks = rep->n_master_blocks;
                bump(l);
                KVB_LOG_I("loan %" PRIu64 " of %s confirmed by both sides", ln->id, ln->lender);
                if (revoking) give_back(l, ln, 0, now_ms);
            } else if (ln->state == KVB_LOAN_GRANTING) {
                ln->state = KVB_LOAN_ACTIVE;
                bump(l);
                if (revoking) give_back(l, ln, 0, now_ms);
            } else if (ln->state == KVB_LOAN_REVOKING) {
                push_revoke(l, ln, now_ms); /* it may have missed the Revoke: say it again */
            } else if (revoking) {
                give_back(l, ln, 0, now_ms);
            }
            continue;
        }
        kvb_ledger_model *lw = ln ? live_model(l, ln->lender) : NULL;
        if (ln && ln->state == KVB_LOAN_UNCONFIRMED && ln->by_worker && !ln->by_master && lw &&
            lw->role == KVB_ROLE_WORKER && lw->pid == ln->lender_pid && front_given_back(ln, rep)) {
            /* the master gave the front back; the worker never heard */
            matched[n_matched++] = ln->id;
            finish_front(l, ln, ln->first_block, rep, rep->n_master_blocks, kvb_kv_block_bytes(&lw->geom));
            continue;
        }
        if (ln) { /* the id means another range here: make the master drop its copy, reading nothing */
            KVB_LOG_W("master %s reports loan %" PRIu64 " of %s [%" PRIu32 ", %" PRIu64 "), the ledger has another "
                      "range under that id: revoking the master's (lender_dead)", m->name, rep->id, rep->lender,
                      rep->first_block, (uint64_t)rep->first_block + rep->n_blocks);
            kvb_ledger_action *a = push(l, KVB_ACT_REVOKE, m->name);
            a->loan = *rep;
            a->epoch = l->epoch;
            a->lender_dead = 1;
            continue;
        }
        kvb_ledger_model *w = find_model(l, rep->lender);
        if (w && w->role != KVB_ROLE_WORKER) w = NULL;
        kvb_loan *nl = add_reported(l, rep, w ? w->pid : 0, w ? kvb_kv_block_bytes(&w->geom) : 0);
        matched[n_matched++] = nl->id;
        bump(l);
        if (w) {
            /* Its lender registered without it (or is dead): the lender uses those blocks again. */
            nl->orphan = 1;
            nl->state = KVB_LOAN_REVOKING;
            nl->lender_dead = 1;
            nl->revoke_epoch = l->epoch;
            push_revoke(l, nl, now_ms);
            KVB_LOG_W("loan %" PRIu64 " reported by master %s alone, its lender %s %s: revoking it (lender_dead)",
                      rep->id, m->name, w->name, w->alive ? "registered without it" : "is dead");
        } else if (revoking) {
            nl->state = KVB_LOAN_REVOKING;
            nl->revoke_epoch = l->epoch;
            nl->deadline_ms = now_ms + lender_grace_ms(l);
            push_revoke(l, nl, now_ms);
        } else {
            nl->state = KVB_LOAN_UNCONFIRMED;
            nl->by_master = 1;
            nl->deadline_ms = now_ms + lender_grace_ms(l);
            KVB_LOG_I("loan %" PRIu64 " of %s reported by master %s: waiting up to %" PRIu64 " ms for the lender",
                      rep->id, rep->lender, m->name, lender_grace_ms(l));
        }
    }
    /* Loans the master did not report: it does not hold them. A Grant may still be on its way to this
     * very process (its GrantAck decides), and a loan being revoked got its Revoke again above or will
     * by the ack timer (a master acks a Revoke of a loan it does not hold). */
    uint64_t *todo = matched + n_matched;
    int n_todo = 0;
    for (int i = 0; i < l->n_loans; i++) {
        const kvb_loan *ln = &l->loans[i];
        if (in_ids(matched, n_matched, ln->id)) continue;
        if (ln->state == KVB_LOAN_GRANTING) continue;
        if (ln->state == KVB_LOAN_REVOKING) {
            push_revoke(l, &l->loans[i], now_ms);
            continue;
        }
        todo[n_todo++] = ln->id;
    }
    for (int k = 0; k < n_todo; k++) {
        kvb_loan *ln = find_loan(l, todo[k]);
        if (!ln) continue;
        if (ln->state == KVB_LOAN_UNCONFIRMED && !ln->by_master) {
            KVB_LOG_I("loan %" PRIu64 " reported by worker %s alone: returned to it", ln->id, ln->lender);
            finish_loan(l, ln->id);
        } else {
            KVB_LOG_W("master %s did not report loan %" PRIu64 " of %s: revoking it", m->name, ln->id, ln->lender);
            give_back(l, ln, 0, now_ms);
        }
    }
}

kvb_status kvb_ledger_register(kvb_ledger *l, const kvb_ledger_reg *r, uint64_t now_ms, char *why, size_t why_len) {
    if (!l || !r) return KVB_ERR_INVALID;
    KVB_TRY(check_reg(r, why, why_len));
    kvb_ledger_model *old = find_model(l, r->name);
    if (old && old->alive && old->pid != r->pid) {
        if (pid_alive(l, old->pid)) {
            set_why(why, why_len, "the name %s is held by live pid %" PRIu32, r->name, old->pid);
            return KVB_ERR_STATE;
        }
    }
    if (old && old->alive && old->pid == r->pid && old->role != r->role) {
        set_why(why, why_len, "%s is registered as the %s", r->name, old->role == KVB_ROLE_MASTER ? "master" : "a worker");
        return KVB_ERR_STATE;
    }
    kvb_ledger_model *master = live_master(l);
    if (r->role == KVB_ROLE_MASTER && master && strcmp(master->name, r->name) && pid_alive(l, master->pid)) {
        set_why(why, why_len, "a master is registered already: %s (pid %" PRIu32 ")", master->name, master->pid);
        return KVB_ERR_STATE;
    }
    if (!old && l->n_models == KVB_LEDGER_MAX_MODELS) {
        /* Forget the oldest dead model that nothing refers to any more. */
        int victim = -1;
        for (int i = 0; i < l->n_models && victim < 0; i++) {
            if (l->models[i].alive) continue;
            int used = 0;
            for (int k = 0; k < l->n_loans && !used; k++) used = !strcmp(l->loans[k].lender, l->models[i].name);
            if (!used) victim = i;
        }
        if (victim < 0) {
            set_why(why, why_len, "the node has %d models, the most a coordinator keeps", KVB_LEDGER_MAX_MODELS);
            return KVB_ERR_EXHAUSTED;
        }
        model_clear(&l->models[victim]);
        memmove(&l->models[victim], &l->models[victim + 1],
                (size_t)(l->n_models - victim - 1) * sizeof *l->models);
        l->n_models--;
        old = NULL;
    }
    /* Everything that can fail, first. */
    char *region = NULL, *endpoint = NULL, *model = NULL;
    uint64_t *matched = NULL; /* reconcile_*: [reported + ledger loans] */
    kvb_status st = KVB_OK;
    if (l->n_loans + r->n_loans > KVB_LEDGER_MAX_LOANS) {
        set_why(why, why_len, "too many loans");
        return KVB_ERR_EXHAUSTED;
    }
    KVB_TRY_GOTO(kvb_strdup(r->region, &region), fail);
    KVB_TRY_GOTO(kvb_strdup(r->endpoint ? r->endpoint : "", &endpoint), fail);
    KVB_TRY_GOTO(kvb_strdup(r->model ? r->model : "", &model), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)(l->n_loans + 2 * r->n_loans + 1), sizeof *matched, (void **)&matched), fail);
    /* deaths below (old process, old master) and the reconciliation: a few actions per loan */
    KVB_TRY_GOTO(reserve(l, 3 * l->n_loans + 3 * r->n_loans + 8, r->n_loans), fail);
    if (!old && l->n_models == l->cap_models) {
        int cap = KVB_MAX(8, 2 * l->cap_models);
        KVB_TRY_GOTO(kvb_realloc_array((void **)&l->models, (size_t)cap, sizeof *l->models), fail);
        l->cap_models = cap;
    }

    /* A previous process under this name (or the previous master) that is gone: handle its death. */
    if (old && old->alive && old->pid != r->pid) kvb_ledger_model_dead(l, old->name, "replaced by a new process", now_ms);
    master = live_master(l);
    if (r->role == KVB_ROLE_MASTER && master && strcmp(master->name, r->name))
        kvb_ledger_model_dead(l, master->name, "its pid is gone; a new master registered", now_ms);

    kvb_ledger_model *m = old;
    int same_process = old && old->pid == r->pid;
    int draining = same_process ? old->draining : 0;
    if (m) model_clear(m); /* zeroes it */
    else memset(m = &l->models[l->n_models++], 0, sizeof *m);
    snprintf(m->name, sizeof m->name, "%s", r->name);
    m->role = r->role;
    m->pid = r->pid;
    m->alive = 1;
    m->draining = draining;
    m->geom = r->geom;
    m->region = region;
    m->region_bytes = r->region_bytes;
    m->capacity = r->capacity;
    m->n_own = r->n_own;
    m->endpoint = endpoint;
    m->model = model;
    snprintf(m->memory, sizeof m->memory, "%s", r->memory && r->memory[0] ? r->memory : "host");
    m->device = r->device;
    m->stream = r->stream != 0;
    m->borrow_limited = r->role == KVB_ROLE_MASTER && r->borrow_limited;
    m->max_borrow = m->borrow_limited ? r->max_borrow : 0;
    m->registered_ms = now_ms;
    m->last_heartbeat_ms = now_ms;
    recompute_meus(l);
    KVB_LOG_I("%s %s registered (pid %" PRIu32 ", %" PRIu32 " blocks of %zu bytes, %" PRIu32 " own, %d loan(s) "
              "reported)", r->role == KVB_ROLE_MASTER ? "master" : "worker", m->name, m->pid, m->capacity,
              kvb_kv_block_bytes(&m->geom), m->n_own, r->n_loans);
    if (r->role == KVB_ROLE_WORKER) reconcile_worker(l, m, r, now_ms, matched);
    else reconcile_master(l, m, r, now_ms, matched);
    free(matched);
    return KVB_OK;
fail:
    free(matched);
    free(region);
    free(endpoint);
    free(model);
    if (st == KVB_ERR_NOMEM) set_why(why, why_len, "out of memory");
    return st;
}

int kvb_ledger_heartbeat(kvb_ledger *l, const char *name, const kvb_ledger_hb *hb, uint64_t now_ms) {
    kvb_ledger_model *m = l ? live_model(l, name) : NULL;
    if (!m) return 0;
    m->last_heartbeat_ms = now_ms;
    if (hb) {
        m->n_own = KVB_MIN(hb->n_own, m->capacity);
        m->n_used = hb->n_used;
        m->live_requests = hb->live_requests;
        m->waiting_requests = hb->waiting_requests;
        m->max_need = hb->max_need;
        m->tokens_generated = hb->tokens_generated;
    }
    return 1;
}

/* ------------------------------------------------------------------------------------------ lending */

/* The sender must be a live model of `role`. */
static kvb_status sender(kvb_ledger *l, const char *name, kvb_role role, kvb_ledger_model **out, char *why,
                         size_t why_len) {
    kvb_ledger_model *m = live_model(l, name);
    if (!m) {
        set_why(why, why_len, "%s is not a registered live model", name ? name : "(null)");
        return KVB_ERR_NOT_FOUND;
    }
    if (m->role != role) {
        set_why(why, why_len, "%s is not %s", m->name, role == KVB_ROLE_MASTER ? "the master" : "a worker");
        return KVB_ERR_PROTOCOL;
    }
    *out = m;
    return KVB_OK;
}

kvb_status kvb_ledger_offer(kvb_ledger *l, const char *worker, uint32_t first_block, uint32_t n_blocks,
                            uint64_t now_ms, kvb_loan *loan, char *why, size_t why_len) {
    if (!l) return KVB_ERR_INVALID;
    kvb_ledger_model *w = NULL;
    KVB_TRY(sender(l, worker, KVB_ROLE_WORKER, &w, why, why_len));
    kvb_ledger_model *master = live_master(l);
    if (w->draining) {
        set_why(why, why_len, "worker %s is draining", w->name);
        return KVB_ERR_STATE;
    }
    if (!master) {
        set_why(why, why_len, "no live master is registered");
        return KVB_ERR_STATE;
    }
    if (master->draining) {
        set_why(why, why_len, "master %s is draining", master->name);
        return KVB_ERR_STATE;
    }
    if (w->lend_blocked[0]) {
        set_why(why, why_len, "%s", w->lend_blocked);
        return KVB_ERR_STATE;
    }
    if (!w->has_meu) {
        set_why(why, why_len, "no minimum elastic unit between master %s and worker %s", master->name, w->name);
        return KVB_ERR_STATE;
    }
    if (n_blocks == 0 || n_blocks % w->meu.meu_worker) {
        set_why(why, why_len, "%" PRIu32 " blocks is not a positive multiple of the MEU (%" PRIu32 " blocks)",
                n_blocks, w->meu.meu_worker);
        return KVB_ERR_INVALID;
    }
    uint32_t room = 0;
    if (kvb_ledger_lend_room(l, w->name, &room) && n_blocks > room) {
        /* issue 10: the master's LSC streams at most max_borrow blocks (Eq. 4 within its budget): a Grant
         * beyond it would be refused, so the offer is */
        set_why(why, why_len, "master %s can attach %" PRIu32 " more of %s's blocks (its layer stream cache streams "
                "at most %" PRIu32 " master blocks, %" PRIu32 " borrowed or being granted), not %" PRIu32,
                master->name, room, w->name, master->max_borrow, kvb_ledger_n_borrowed(l), n_blocks);
        return KVB_ERR_STATE;
    }
    uint64_t bb = kvb_kv_block_bytes(&w->geom);
    if ((uint64_t)first_block + n_blocks > w->capacity ||
        ((uint64_t)first_block + n_blocks) * bb > w->region_bytes) {
        set_why(why, why_len, "blocks [%" PRIu32 ", %" PRIu64 ") are outside the region's %" PRIu32 " blocks",
                first_block, (uint64_t)first_block + n_blocks, w->capacity);
        return KVB_ERR_INVALID;
    }
    kvb_loan *ov = overlapping(l, w->name, w->pid, first_block, n_blocks);
    if (ov) {
        set_why(why, why_len, "blocks [%" PRIu32 ", %" PRIu64 ") overlap loan %" PRIu64 " [%" PRIu32 ", %" PRIu64 ")",
                first_block, (uint64_t)first_block + n_blocks, ov->id, ov->first_block,
                (uint64_t)ov->first_block + ov->n_blocks);
        return KVB_ERR_INVALID;
    }
    if (l->n_loans >= KVB_LEDGER_MAX_LOANS) {
        set_why(why, why_len, "the ledger holds %d loans, its limit", KVB_LEDGER_MAX_LOANS);
        return KVB_ERR_EXHAUSTED;
    }
    kvb_status st = reserve(l, 2, 1);
    if (st != KVB_OK) {
        set_why(why, why_len, "out of memory");
        return st;
    }
    kvb_loan *ln = &l->loans[l->n_loans++];
    memset(ln, 0, sizeof *ln);
    ln->id = l->next_loan_id++;
    snprintf(ln->lender, sizeof ln->lender, "%s", w->name);
    ln->lender_pid = w->pid;
    ln->first_block = first_block;
    ln->n_blocks = n_blocks;
    ln->n_master_blocks = n_blocks / w->meu.meu_worker * w->meu.meu_master;
    ln->offset = (uint64_t)first_block * bb;
    ln->bytes = (uint64_t)n_blocks * bb;
    ln->epoch = bump(l);
    ln->state = KVB_LOAN_GRANTING;
    ln->t_sent_ms = ln->t_offer_ms = now_ms;
    push_grant(l, master, ln);
    KVB_LOG_I("loan %" PRIu64 ": worker %s lends blocks [%" PRIu32 ", %" PRIu64 ") = %" PRIu32 " master blocks "
              "(epoch %" PRIu64 ")", ln->id, w->name, first_block, (uint64_t)first_block + n_blocks,
              ln->n_master_blocks, ln->epoch);
    if (loan) *loan = *ln;
    return KVB_OK;
}

kvb_status kvb_ledger_grant_ack(kvb_ledger *l, const char *master, uint64_t loan_id, int ok, uint64_t now_ms,
                                char *why, size_t why_len) {
    if (!l) return KVB_ERR_INVALID;
    kvb_ledger_model *m = NULL;
    KVB_TRY(sender(l, master, KVB_ROLE_MASTER, &m, why, why_len));
    kvb_loan *ln = find_loan(l, loan_id);
    if (!ln) {
        set_why(why, why_len, "no loan %" PRIu64, loan_id);
        return KVB_ERR_NOT_FOUND;
    }
    if (ok) {
        if (ln->state == KVB_LOAN_GRANTING) {
            ln->state = KVB_LOAN_ACTIVE;
            bump(l);
            kvb_ledger_model *w = find_model(l, ln->lender);
            if (w) {
                w->n_lends++;
                w->lend_ms_total += now_ms > ln->t_offer_ms ? now_ms - ln->t_offer_ms : 0;
            }
        }
        return KVB_OK;
    }
    if (ln->state != KVB_LOAN_GRANTING && ln->state != KVB_LOAN_REVOKING) {
        set_why(why, why_len, "loan %" PRIu64 " is %s, a failed GrantAck is ignored", loan_id,
                kvb_loan_state_str(ln->state));
        return KVB_ERR_STATE;
    }
    KVB_TRY(reserve(l, 1, 0));
    finish_loan(l, loan_id);
    return KVB_OK;
}

kvb_status kvb_ledger_grant_undeliverable(kvb_ledger *l, uint64_t loan_id, uint64_t now_ms) {
    (void)now_ms;
    kvb_loan *ln = l ? find_loan(l, loan_id) : NULL;
    if (!ln) return KVB_ERR_NOT_FOUND;
    if (ln->state != KVB_LOAN_GRANTING) return KVB_ERR_STATE;
    KVB_TRY(reserve(l, 1, 0));
    KVB_LOG_W("loan %" PRIu64 ": the Grant could not be delivered to the master; cancelled", loan_id);
    finish_loan(l, loan_id);
    return KVB_OK;
}

static int cmp_first_block(const void *a, const void *b) {
    const kvb_loan *x = a, *y = b;
    return x->first_block < y->first_block ? -1 : x->first_block > y->first_block;
}

/* How much of `ln` (ACTIVE or GRANTING) a reclaim that still needs `need` blocks takes: all of it, or its
 * first blocks rounded up to whole worker MEUs when that is less (and the loan is whole MEUs of the
 * pair's unit, held by a live master). */
static uint32_t part_of(const kvb_ledger *l, const kvb_ledger_model *w, const kvb_loan *ln, uint64_t need) {
    if (need >= ln->n_blocks || ln->state != KVB_LOAN_ACTIVE || !w->has_meu || !live_master(l)) return ln->n_blocks;
    uint32_t mw = w->meu.meu_worker, mm = w->meu.meu_master;
    if (!mw || !mm || ln->n_blocks % mw || (uint64_t)ln->n_blocks / mw * mm != ln->n_master_blocks)
        return ln->n_blocks;
    uint64_t k = (need + mw - 1) / mw * mw;
    return k < ln->n_blocks ? (uint32_t)k : ln->n_blocks;
}

kvb_status kvb_ledger_reclaim(kvb_ledger *l, const char *worker, uint32_t n_blocks, uint64_t now_ms,
                              uint32_t *n_revoking, char *why, size_t why_len) {
    if (!l) return KVB_ERR_INVALID;
    if (n_revoking) *n_revoking = 0;
    kvb_ledger_model *w = NULL;
    KVB_TRY(sender(l, worker, KVB_ROLE_WORKER, &w, why, why_len));
    uint64_t in_flight = 0;
    int n_cand = 0, n_all = 0;
    for (int i = 0; i < l->n_loans; i++) {
        const kvb_loan *ln = &l->loans[i];
        if (ln->orphan || ln->lender_pid != w->pid || strcmp(ln->lender, w->name)) continue;
        n_all++;
        if (ln->state == KVB_LOAN_REVOKING) in_flight += revoking_blocks(ln);
        else n_cand++;
    }
    if (!n_all) {
        set_why(why, why_len, "worker %s has nothing lent", w->name);
        return KVB_ERR_STATE;
    }
    kvb_loan *cand = NULL; /* copies, sorted by first_block */
    if (n_cand) KVB_TRY(kvb_calloc((size_t)n_cand, sizeof *cand, (void **)&cand));
    kvb_status st = reserve(l, max_actions(l, 0), 0);
    if (st != KVB_OK) {
        free(cand);
        return st;
    }
    int k = 0;
    for (int i = 0; i < l->n_loans; i++) {
        const kvb_loan *ln = &l->loans[i];
        if (ln->orphan || ln->lender_pid != w->pid || strcmp(ln->lender, w->name) || ln->state == KVB_LOAN_REVOKING)
            continue;
        cand[k++] = *ln;
    }
    if (n_cand) qsort(cand, (size_t)n_cand, sizeof *cand, cmp_first_block); /* cand is NULL when empty */
    uint64_t taken = 0;
    for (int i = 0; i < n_cand && in_flight + taken < n_blocks; i++) {
        kvb_loan *ln = find_loan(l, cand[i].id);
        if (!ln) continue;
        uint32_t k = part_of(l, w, ln, n_blocks - in_flight - taken);
        taken += k;
        KVB_LOG_I("reclaiming %s loan %" PRIu64 " of %s: blocks [%" PRIu32 ", %" PRIu64 ")",
                  k < ln->n_blocks ? "the front of" : "", ln->id, w->name, ln->first_block,
                  (uint64_t)ln->first_block + k);
        if (k < ln->n_blocks) give_back_part(l, ln, k, now_ms);
        else give_back(l, ln, 0, now_ms);
    }
    free(cand);
    uint64_t total = in_flight + taken;
    if (n_revoking) *n_revoking = total > UINT32_MAX ? UINT32_MAX : (uint32_t)total;
    return KVB_OK;
}

/* The master gave back the first revoke_blocks of `ln`: the loan keeps the rest and is ACTIVE again;
 * the lender gets Reclaimed for the part. */
static void shrink_loan(kvb_ledger *l, kvb_loan *ln, uint64_t now_ms) {
    uint32_t k = ln->revoke_blocks;
    uint32_t mk = (uint32_t)((uint64_t)k * ln->n_master_blocks / ln->n_blocks); /* exact: whole MEUs (part_of) */
    uint64_t kb = ln->bytes / ln->n_blocks * k;
    kvb_loan part = *ln;
    part.n_blocks = k;
    part.n_master_blocks = mk;
    part.bytes = kb;
    part.state = KVB_LOAN_ACTIVE;
    part.revoke_blocks = 0;
    ln->first_block += k;
    ln->n_blocks -= k;
    ln->n_master_blocks -= mk;
    ln->offset += kb;
    ln->bytes -= kb;
    ln->state = KVB_LOAN_ACTIVE;
    ln->revoke_blocks = 0;
    ln->min_ack_epoch = 0;
    KVB_LOG_I("blocks [%" PRIu32 ", %" PRIu32 ") of loan %" PRIu64 " given back by the master; it keeps [%" PRIu32
              ", %" PRIu64 ")", part.first_block, ln->first_block, ln->id, ln->first_block,
              (uint64_t)ln->first_block + ln->n_blocks);
    kvb_ledger_model *w = find_model(l, ln->lender);
    if (w) {
        w->n_reclaims++;
        w->reclaim_ms_total += now_ms > ln->t_revoke_ms ? now_ms - ln->t_revoke_ms : 0;
    }
    bump(l);
    push_reclaimed(l, &part);
}

kvb_status kvb_ledger_revoke_ack(kvb_ledger *l, const char *master, uint64_t loan_id, uint64_t epoch,
                                 uint64_t now_ms, char *why, size_t why_len) {
    if (!l) return KVB_ERR_INVALID;
    (void)now_ms;
    kvb_ledger_model *m = NULL;
    KVB_TRY(sender(l, master, KVB_ROLE_MASTER, &m, why, why_len));
    kvb_loan *ln = find_loan(l, loan_id);
    if (!ln) {
        set_why(why, why_len, "no loan %" PRIu64, loan_id);
        return KVB_ERR_NOT_FOUND;
    }
    if (ln->state != KVB_LOAN_REVOKING) {
        set_why(why, why_len, "loan %" PRIu64 " is %s, not being revoked", loan_id, kvb_loan_state_str(ln->state));
        return KVB_ERR_STATE;
    }
    if (epoch < ln->min_ack_epoch) { /* answers the partial Revoke this loan's whole one widened */
        set_why(why, why_len, "loan %" PRIu64 ": the ack of epoch %" PRIu64 " answers an earlier, partial revoke",
                loan_id, epoch);
        return KVB_ERR_STATE;
    }
    if (epoch != ln->revoke_epoch)
        KVB_LOG_D("RevokeAck of loan %" PRIu64 " carries epoch %" PRIu64 ", the revoke's is %" PRIu64, loan_id, epoch,
                  ln->revoke_epoch);
    KVB_TRY(reserve(l, 1, 0));
    if (revoke_partial(ln)) {
        shrink_loan(l, ln, now_ms);
        return KVB_OK;
    }
    KVB_LOG_I("loan %" PRIu64 " of %s given back by the master%s", loan_id, ln->lender,
              ln->lender_dead ? " (lender dead)" : "");
    kvb_ledger_model *w = find_model(l, ln->lender);
    if (w) {
        w->n_reclaims++;
        w->reclaim_ms_total += now_ms > ln->t_revoke_ms ? now_ms - ln->t_revoke_ms : 0;
    }
    finish_loan(l, loan_id);
    return KVB_OK;
}

/* ----------------------------------------------------------------------------------------- control */

kvb_status kvb_ledger_lend_request(kvb_ledger *l, const char *worker, uint32_t n_blocks, char *why, size_t why_len) {
    if (!l) return KVB_ERR_INVALID;
    kvb_ledger_model *w = live_model(l, worker);
    if (!w) {
        set_why(why, why_len, "no live model %s", worker ? worker : "(null)");
        return KVB_ERR_NOT_FOUND;
    }
    if (w->role != KVB_ROLE_WORKER) {
        set_why(why, why_len, "%s is not a worker", w->name);
        return KVB_ERR_INVALID;
    }
    if (n_blocks == 0) {
        set_why(why, why_len, "nothing to lend (0 blocks)");
        return KVB_ERR_INVALID;
    }
    kvb_ledger_model *master = live_master(l);
    if (w->draining) {
        set_why(why, why_len, "worker %s is draining", w->name);
        return KVB_ERR_STATE;
    }
    if (!master) {
        set_why(why, why_len, "no live master is registered");
        return KVB_ERR_STATE;
    }
    if (master->draining) {
        set_why(why, why_len, "master %s is draining", master->name);
        return KVB_ERR_STATE;
    }
    if (w->lend_blocked[0]) {
        set_why(why, why_len, "%s", w->lend_blocked);
        return KVB_ERR_STATE;
    }
    if (!w->has_meu) {
        set_why(why, why_len, "no minimum elastic unit between master %s and worker %s", master->name, w->name);
        return KVB_ERR_STATE;
    }
    KVB_TRY(reserve(l, 1, 0));
    kvb_ledger_action *a = push(l, KVB_ACT_LEND_REQUEST, w->name);
    a->n_blocks = n_blocks;
    return KVB_OK;
}

kvb_status kvb_ledger_drain(kvb_ledger *l, const char *name, uint64_t now_ms, int *n_loans, char *why,
                            size_t why_len) {
    if (!l) return KVB_ERR_INVALID;
    if (n_loans) *n_loans = 0;
    kvb_ledger_model *m = live_model(l, name);
    if (!m) {
        set_why(why, why_len, "no live model %s", name ? name : "(null)");
        return KVB_ERR_NOT_FOUND;
    }
    /* Everything that can fail first: nothing changes when it does. */
    KVB_TRY(reserve(l, max_actions(l, 1), 0));
    uint64_t *ids = NULL; /* the ids first: give_back may delete */
    int n = 0;
    if (l->n_loans) KVB_TRY(kvb_calloc((size_t)l->n_loans, sizeof *ids, (void **)&ids));
    m->draining = 1;
    if (m->role == KVB_ROLE_WORKER) {
        kvb_ledger_action *a = push(l, KVB_ACT_LEND_REQUEST, m->name);
        a->drain = 1;
    }
    for (int i = 0; i < l->n_loans; i++) {
        const kvb_loan *ln = &l->loans[i];
        if (ln->state == KVB_LOAN_REVOKING && !revoke_partial(ln)) continue; /* a partial one is widened */
        if (m->role == KVB_ROLE_WORKER && (ln->orphan || ln->lender_pid != m->pid || strcmp(ln->lender, m->name)))
            continue;
        ids[n++] = ln->id;
    }
    for (int i = 0; i < n; i++) {
        kvb_loan *ln = find_loan(l, ids[i]);
        if (ln) give_back(l, ln, 0, now_ms);
    }
    free(ids);
    if (n_loans) *n_loans = n;
    KVB_LOG_I("%s %s drains: %d loan(s) being given back", m->role == KVB_ROLE_MASTER ? "master" : "worker", m->name, n);
    return KVB_OK;
}

kvb_status kvb_ledger_undrain(kvb_ledger *l, const char *name, char *why, size_t why_len) {
    if (!l) return KVB_ERR_INVALID;
    kvb_ledger_model *m = live_model(l, name);
    if (!m) {
        set_why(why, why_len, "no live model %s", name ? name : "(null)");
        return KVB_ERR_NOT_FOUND;
    }
    if (!m->draining) {
        set_why(why, why_len, "%s is not draining", m->name);
        return KVB_ERR_STATE;
    }
    if (m->role == KVB_ROLE_WORKER) {
        KVB_TRY(reserve(l, max_actions(l, 1), 0));
        kvb_ledger_action *a = push(l, KVB_ACT_LEND_REQUEST, m->name);
        a->n_blocks = 0; /* the worker's own SCALEDOWN check decides what to lend */
        a->drain = 0;
    }
    m->draining = 0;
    KVB_LOG_I("%s %s no longer drains", m->role == KVB_ROLE_MASTER ? "master" : "worker", m->name);
    return KVB_OK;
}

/* ------------------------------------------------------------------------------------------ failures */

void kvb_ledger_model_dead(kvb_ledger *l, const char *name, const char *reason, uint64_t now_ms) {
    kvb_ledger_model *m = l ? live_model(l, name) : NULL;
    if (!m) return;
    /* Room for what follows; without it (out of memory) the actions of this death could be lost, so
     * the model stays alive and the next tick tries again. */
    if (reserve(l, max_actions(l, 0), 0) != KVB_OK) return;
    m->alive = 0;
    snprintf(m->death, sizeof m->death, "%s", reason ? reason : "dead");
    KVB_LOG_W("%s %s (pid %" PRIu32 ") is dead: %s", m->role == KVB_ROLE_MASTER ? "master" : "worker", m->name,
              m->pid, m->death);
    if (m->role == KVB_ROLE_MASTER) {
        /* Nothing of any loan is used any more: every lender gets its blocks back. */
        while (l->n_loans) finish_loan(l, l->loans[0].id);
        recompute_meus(l);
        return;
    }
    m->has_meu = 0;
    /* give_back may delete loans: walk ids. Without memory for them, one pass over the array in place
     * (a deletion shifts the rest down, so the index stays when one happened). */
    for (int i = 0; i < l->n_loans;) {
        kvb_loan *ln = &l->loans[i];
        int n_before = l->n_loans;
        if (ln->lender_pid == m->pid && !strcmp(ln->lender, m->name) &&
            !(ln->state == KVB_LOAN_REVOKING && ln->lender_dead)) {
            if (ln->state == KVB_LOAN_UNCONFIRMED && !ln->by_master) {
                delete_loan(l, ln->id); /* no master holds it, no lender to return it to */
                bump(l);
            } else {
                give_back(l, ln, 1, now_ms);
            }
        }
        if (l->n_loans == n_before) i++;
    }
}

static int master_holds_loans(const kvb_ledger *l) { return l->n_loans > 0; }

void kvb_ledger_tick(kvb_ledger *l, uint64_t now_ms) {
    if (!l) return;
    for (int i = 0; i < l->n_models; i++) {
        kvb_ledger_model *m = &l->models[i];
        if (!m->alive) continue;
        char reason[128];
        if (!pid_alive(l, m->pid)) {
            snprintf(reason, sizeof reason, "pid %" PRIu32 " is gone", m->pid);
            kvb_ledger_model_dead(l, m->name, reason, now_ms);
        } else if (now_ms > m->last_heartbeat_ms && now_ms - m->last_heartbeat_ms > silence_ms(l)) {
            if (l->opts.fence && l->opts.pid_alive && m->role == KVB_ROLE_MASTER && master_holds_loans(l)) {
                /* a silent master may still be reading lent blocks: stop it first, return its loans
                 * when the pid check sees it gone */
                l->opts.fence(l->opts.pid_ud, m->name, m->pid);
                continue;
            }
            snprintf(reason, sizeof reason, "no heartbeat for %" PRIu64 " ms", now_ms - m->last_heartbeat_ms);
            kvb_ledger_model_dead(l, m->name, reason, now_ms);
        }
    }
    if (reserve(l, max_actions(l, 0), 0) != KVB_OK) return;
    /* Loans: one change at most per loan and tick; deletions shift the array, so walk ids. */
    int n = l->n_loans;
    uint64_t *ids = NULL;
    if (!n || kvb_calloc((size_t)n, sizeof *ids, (void **)&ids) != KVB_OK) return;
    for (int i = 0; i < n; i++) ids[i] = l->loans[i].id;
    for (int i = 0; i < n; i++) {
        kvb_loan *ln = find_loan(l, ids[i]);
        if (!ln) continue;
        switch (ln->state) {
        case KVB_LOAN_UNCONFIRMED:
            if (now_ms < ln->deadline_ms) break;
            if (!ln->by_master) {
                KVB_LOG_W("loan %" PRIu64 " of %s: no master registered within %" PRIu64 " ms; returned to the lender",
                          ln->id, ln->lender, master_grace_ms(l));
                finish_loan(l, ln->id);
            } else {
                KVB_LOG_W("loan %" PRIu64 ": its lender %s did not register within %" PRIu64 " ms; revoking it "
                          "(lender_dead)", ln->id, ln->lender, lender_grace_ms(l));
                ln->orphan = 1;
                give_back(l, ln, 1, now_ms);
            }
            break;
        case KVB_LOAN_GRANTING:
            if (now_ms - ln->t_sent_ms < silence_ms(l)) break;
            KVB_LOG_W("loan %" PRIu64 ": no GrantAck within %" PRIu64 " ms; revoking it", ln->id, silence_ms(l));
            give_back(l, ln, 0, now_ms);
            break;
        case KVB_LOAN_REVOKING:
            if (ln->lender_pid == 0 && !ln->lender_dead && ln->deadline_ms && now_ms >= ln->deadline_ms) {
                KVB_LOG_W("loan %" PRIu64 ": its lender %s did not register; the revoke becomes lender_dead", ln->id,
                          ln->lender);
                ln->orphan = 1;
                give_back(l, ln, 1, now_ms);
            } else if (now_ms - ln->t_sent_ms >= silence_ms(l)) {
                KVB_LOG_W("loan %" PRIu64 ": no RevokeAck within %" PRIu64 " ms; sending the Revoke again", ln->id,
                          silence_ms(l));
                push_revoke(l, ln, now_ms);
            }
            break;
        case KVB_LOAN_ACTIVE: break;
        }
    }
    free(ids);
}

int kvb_ledger_pop_action(kvb_ledger *l, kvb_ledger_action *out) {
    if (!l || !out || l->head_act >= l->n_acts) return 0;
    *out = l->acts[l->head_act++];
    if (l->head_act == l->n_acts) l->head_act = l->n_acts = 0;
    return 1;
}

/* ------------------------------------------------------------------------------------------ inspection */

uint64_t kvb_ledger_epoch(const kvb_ledger *l) { return l ? l->epoch : 0; }
int kvb_ledger_n_models(const kvb_ledger *l) { return l ? l->n_models : 0; }
const kvb_ledger_model *kvb_ledger_model_at(const kvb_ledger *l, int i) {
    return l && i >= 0 && i < l->n_models ? &l->models[i] : NULL;
}
const kvb_ledger_model *kvb_ledger_find(const kvb_ledger *l, const char *name) { return l ? find_model(l, name) : NULL; }
const kvb_ledger_model *kvb_ledger_master(const kvb_ledger *l) { return l ? live_master(l) : NULL; }
int kvb_ledger_n_loans(const kvb_ledger *l) { return l ? l->n_loans : 0; }
const kvb_loan *kvb_ledger_loan_at(const kvb_ledger *l, int i) {
    return l && i >= 0 && i < l->n_loans ? &l->loans[i] : NULL;
}
const kvb_loan *kvb_ledger_loan(const kvb_ledger *l, uint64_t id) { return l ? find_loan(l, id) : NULL; }

uint32_t kvb_ledger_n_lent(const kvb_ledger *l, const char *worker) {
    const kvb_ledger_model *w = l ? find_model(l, worker) : NULL;
    return w && w->role == KVB_ROLE_WORKER ? lent_by(l, w) : 0;
}

int kvb_ledger_lend_room(const kvb_ledger *l, const char *worker, uint32_t *room) {
    *room = 0;
    const kvb_ledger_model *m = l ? live_master(l) : NULL;
    const kvb_ledger_model *w = l ? find_model(l, worker) : NULL;
    if (!m || !m->borrow_limited || !w || w->role != KVB_ROLE_WORKER || !w->has_meu || !w->meu.meu_master) return 0;
    uint32_t held = kvb_ledger_n_borrowed(l);
    uint64_t free_m = m->max_borrow > held ? m->max_borrow - held : 0;
    uint64_t r = free_m / w->meu.meu_master * w->meu.meu_worker;
    *room = r > UINT32_MAX ? UINT32_MAX : (uint32_t)r;
    return 1;
}

uint32_t kvb_ledger_n_borrowed(const kvb_ledger *l) {
    if (!l) return 0;
    uint64_t n = 0;
    for (int i = 0; i < l->n_loans; i++) {
        const kvb_loan *ln = &l->loans[i];
        if (ln->state == KVB_LOAN_UNCONFIRMED && !ln->by_master) continue;
        n += ln->n_master_blocks;
    }
    return n > UINT32_MAX ? UINT32_MAX : (uint32_t)n;
}
