/* kvbank-master — the node's model with the long contexts: it borrows KV blocks that idle workers lend
 * (SwiftCache §3.2-3.5; docs/lending.md "The coordinator protocol", flows 3-6).
 *
 * Grant: import the lender's region (once per region handle; unmapped when its last loan is gone),
 * attach the loan's range to the engine as extra blocks, GrantAck. Revoke: detach (live blocks move to
 * free blocks elsewhere, or their sequences are preempted and recomputed; with lender_dead nothing is
 * read from the range), RevokeAck with what that did. Both run between engine steps (server hooks),
 * which is the fence of the reclaim protocol: no step reads a range while it is detached.
 *
 * At start the master logs the Eq. 1-5 plan of the node (layer stream cache and regular cache sizes)
 * from the node config's KV budgets. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "node/node_proc.h"
#include "common/kv/block_pool.h"
#include "common/policy/swiftcache.h"
#include "common/util/prog.h"
#include "kernels/backend.h"

#define LENDER_MAX 64          /* longest lender name kept */
#define SHUTDOWN_REPLY_MS 1000 /* wait for the coordinator to answer the drain at exit */
#define SHUTDOWN_WAIT_MS 5000  /* most time spent giving borrowed blocks back at exit */

typedef struct mapped {
    char *handle;      /* the lender's region handle */
    kvb_mem_region *reg; /* imported into the backend's memory (never owned: destroying unmaps only) */
    int refs;          /* loans attached from it */
} mapped;

typedef struct loan {
    kvb_node_loan l;              /* l.lender points to `lender` */
    char lender[LENDER_MAX + 1];
    int region;                   /* index in master.regions */
} loan;

typedef struct master {
    kvb_node_proc *p;
    kvb_engine *eng;
    kvb_node_client *nc;
    const kvb_node_proc_args *a;
    size_t block_bytes;           /* of a master block */
    loan *loans;                  /* [n_loans] attached now */
    int n_loans, cap_loans;
    kvb_node_loan *view;          /* [cap_loans] for a Register */
    mapped *regions;              /* [n_regions] */
    int n_regions, cap_regions;
    int drain_answer;             /* shutdown: 0 none yet, 1 ok, -1 refused */
    uint64_t n_grants, n_revokes, n_moved, n_dropped, n_preempted, n_kept; /* n_kept: cached blocks kept or demoted */
} master;

/* ----------------------------------------------------------------------------------------- regions */

/* The lender region `handle` of `bytes`, imported once (a second loan from it reuses the import). */
static int region_get(master *m, const char *handle, uint64_t bytes, char *err, size_t err_len) {
    for (int i = 0; i < m->n_regions; i++)
        if (m->regions[i].reg && !strcmp(m->regions[i].handle, handle)) return i;
    int slot = -1;
    for (int i = 0; i < m->n_regions; i++)
        if (!m->regions[i].reg) slot = i;
    if (slot < 0) {
        if (m->n_regions == m->cap_regions) {
            int cap = m->cap_regions ? 2 * m->cap_regions : 4;
            if (kvb_realloc_array((void **)&m->regions, (size_t)cap, sizeof *m->regions) != KVB_OK) {
                snprintf(err, err_len, "out of memory");
                return -1;
            }
            m->cap_regions = cap;
        }
        slot = m->n_regions++;
        memset(&m->regions[slot], 0, sizeof m->regions[slot]);
    }
    mapped *r = &m->regions[slot];
    kvb_status st = bytes > SIZE_MAX ? KVB_ERR_INVALID
                                     : kvb_mem_region_import(kvb_node_proc_mem(m->p), handle, (size_t)bytes, &r->reg);
    if (st != KVB_OK) {
        r->reg = NULL;
        snprintf(err, err_len, "cannot import region %.40s%s of %" PRIu64 " bytes into %s memory: %s", handle,
                 strlen(handle) > 40 ? "..." : "", bytes, kvb_mem_kind(kvb_node_proc_mem(m->p)), kvb_status_str(st));
        return -1;
    }
    if (kvb_strdup(handle, &r->handle) != KVB_OK) {
        kvb_mem_region_destroy(r->reg);
        r->reg = NULL;
        snprintf(err, err_len, "out of memory");
        return -1;
    }
    r->refs = 0;
    KVB_LOG_I("imported lender region %.40s%s (%zu bytes)", handle, strlen(handle) > 40 ? "..." : "",
              kvb_mem_region_size(r->reg));
    return slot;
}

static void region_put(master *m, int i) {
    mapped *r = &m->regions[i];
    if (!r->reg || --r->refs > 0) return;
    KVB_LOG_I("unmapped lender region %.40s%s (no loan left on it)", r->handle, strlen(r->handle) > 40 ? "..." : "");
    kvb_mem_region_destroy(r->reg);
    free(r->handle);
    r->reg = NULL;
    r->handle = NULL;
    r->refs = 0;
}

static int find_loan(const master *m, uint64_t id) {
    for (int i = 0; i < m->n_loans; i++)
        if (m->loans[i].l.loan_id == id) return i;
    return -1;
}

static void tally(master *m, const kvb_detach_stats *ds) {
    m->n_moved += (uint64_t)ds->moved;
    m->n_dropped += (uint64_t)ds->dropped;
    m->n_preempted += (uint64_t)ds->preempted;
    m->n_kept += (uint64_t)ds->kept + (uint64_t)ds->demoted;
}

/* Detaches loan i from the engine and forgets it. */
static kvb_status drop_loan(master *m, int i, int lender_dead, kvb_detach_stats *ds) {
    loan *ln = &m->loans[i];
    memset(ds, 0, sizeof *ds);
    kvb_status st = kvb_engine_detach(m->eng, ln->l.loan_id, lender_dead, ds);
    if (st != KVB_OK && st != KVB_ERR_NOT_FOUND) return st; /* still attached: keep it mapped */
    tally(m, ds);
    region_put(m, ln->region);
    memmove(ln, ln + 1, (size_t)(m->n_loans - i - 1) * sizeof *ln);
    m->n_loans--;
    for (int k = 0; k < m->n_loans; k++) m->loans[k].l.lender = m->loans[k].lender; /* moved */
    return KVB_OK;
}

/* ---------------------------------------------------------------------------- coordinator messages */

static void cb_load(void *ud, kvb_node_load *out) {
    master *m = ud;
    kvb_node_proc_load(m->p, out);
}

static int cb_loans(void *ud, const kvb_node_loan **out) {
    master *m = ud;
    for (int i = 0; i < m->n_loans; i++) m->view[i] = m->loans[i].l;
    *out = m->view;
    return m->n_loans;
}

static void grant_fail(master *m, uint64_t id, const char *why) {
    KVB_LOG_W("cannot map loan %" PRIu64 ": %s", id, why);
    kvb_node_client_send_grant_ack(m->nc, id, 0, why);
}

static void cb_grant(void *ud, const Kvbank__Grant *g) {
    master *m = ud;
    const Kvbank__Loan *l = g->loan;
    char err[256];
    if (find_loan(m, l->loan_id) >= 0) { /* a repeated Grant */
        kvb_node_client_send_grant_ack(m->nc, l->loan_id, 1, NULL);
        return;
    }
    if (!l->lender || !l->lender[0] || strlen(l->lender) > LENDER_MAX) {
        grant_fail(m, l->loan_id, "bad lender name");
        return;
    }
    if (l->n_master_blocks > (uint32_t)(1 << 30) || (uint64_t)l->n_master_blocks * m->block_bytes > l->bytes) {
        snprintf(err, sizeof err, "%" PRIu64 " bytes cannot hold %u master blocks of %zu bytes", l->bytes,
                 l->n_master_blocks, m->block_bytes);
        grant_fail(m, l->loan_id, err);
        return;
    }
    if (m->n_loans == m->cap_loans) {
        int cap = m->cap_loans ? 2 * m->cap_loans : 8;
        if (kvb_realloc_array((void **)&m->loans, (size_t)cap, sizeof *m->loans) != KVB_OK ||
            kvb_realloc_array((void **)&m->view, (size_t)cap, sizeof *m->view) != KVB_OK) {
            grant_fail(m, l->loan_id, "out of memory");
            return;
        }
        for (int k = 0; k < m->n_loans; k++) m->loans[k].l.lender = m->loans[k].lender; /* moved */
        m->cap_loans = cap;
    }
    int ri = region_get(m, g->region, g->region_bytes, err, sizeof err);
    if (ri < 0) {
        grant_fail(m, l->loan_id, err);
        return;
    }
    mapped *r = &m->regions[ri];
    size_t size = kvb_mem_region_size(r->reg);
    if (l->offset > size || l->bytes > size - l->offset) {
        snprintf(err, sizeof err, "bytes [%" PRIu64 ", %" PRIu64 ") lie outside region %s of %zu bytes", l->offset,
                 l->offset + l->bytes, g->region, size);
        r->refs++;
        region_put(m, ri);
        grant_fail(m, l->loan_id, err);
        return;
    }
    r->refs++;
    void *mem = (char *)kvb_mem_region_base(r->reg) + l->offset;
    kvb_status st = kvb_engine_attach(m->eng, l->loan_id, mem, (size_t)l->bytes, (int)l->n_master_blocks);
    if (st != KVB_OK) {
        region_put(m, ri);
        snprintf(err, sizeof err, "the engine cannot attach it: %s", kvb_status_str(st));
        grant_fail(m, l->loan_id, err);
        return;
    }
    loan *ln = &m->loans[m->n_loans++];
    memset(ln, 0, sizeof *ln);
    snprintf(ln->lender, sizeof ln->lender, "%s", l->lender);
    ln->l = (kvb_node_loan){.loan_id = l->loan_id, .lender = ln->lender, .first_block = l->first_block,
                            .n_blocks = l->n_blocks, .n_master_blocks = l->n_master_blocks, .offset = l->offset,
                            .bytes = l->bytes, .epoch = l->epoch};
    ln->region = ri;
    m->n_grants++;
    KVB_LOG_I("borrowed loan %" PRIu64 " of %s: %u master blocks (its blocks [%u, %u)); %d borrowed in all",
              l->loan_id, l->lender, l->n_master_blocks, l->first_block, l->first_block + l->n_blocks,
              kvb_engine_n_borrowed(m->eng));
    kvb_node_client_send_grant_ack(m->nc, l->loan_id, 1, NULL);
}

/* Partial reclaim (issue 10): gives back the front of loan i up to lender block `end` (whole MEUs:
 * the loan's master blocks per lender block are exact), keeping the rest attached. */
static kvb_status shrink_loan(master *m, int i, uint32_t end, kvb_detach_stats *ds) {
    kvb_node_loan *l = &m->loans[i].l;
    uint32_t k = end - l->first_block; /* lender blocks, 0 < k < n_blocks */
    uint64_t km = (uint64_t)k * l->n_master_blocks;
    if (km % l->n_blocks) {
        KVB_LOG_W("loan %" PRIu64 ": %u of %u lender blocks are no whole number of its %u master blocks; giving "
                  "back all of it", l->loan_id, k, l->n_blocks, l->n_master_blocks);
        return drop_loan(m, i, 0, ds);
    }
    uint32_t mk = (uint32_t)(km / l->n_blocks);
    uint64_t kb = l->bytes / l->n_blocks * k; /* lender block bytes * k */
    KVB_TRY(kvb_engine_detach_front(m->eng, l->loan_id, (int)mk, 0, ds));
    tally(m, ds);
    l->first_block += k;
    l->n_blocks -= k;
    l->n_master_blocks -= mk;
    l->offset += kb;
    l->bytes -= kb;
    return KVB_OK;
}

static void cb_revoke(void *ud, const Kvbank__Revoke *rv) {
    master *m = ud;
    int i = find_loan(m, rv->loan_id);
    kvb_detach_stats ds = {0};
    uint64_t end = (uint64_t)rv->first_block + rv->n_blocks; /* a partial revoke: the loan keeps [end, ...) */
    if (i < 0) {
        /* Not attached (a repeated Revoke, or a Grant that never came): nothing uses it. */
        KVB_LOG_I("revoke of loan %" PRIu64 ", which is not attached here: acknowledged", rv->loan_id);
    } else if (rv->n_blocks && !rv->lender_dead && end <= m->loans[i].l.first_block) {
        KVB_LOG_I("revoke of blocks [%u, %" PRIu64 ") of loan %" PRIu64 ", given back already: acknowledged",
                  rv->first_block, end, rv->loan_id);
    } else {
        uint64_t t0 = kvb_now_ns();
        const kvb_node_loan *l = &m->loans[i].l;
        int part = rv->n_blocks && !rv->lender_dead && end < (uint64_t)l->first_block + l->n_blocks;
        kvb_status st = part ? shrink_loan(m, i, (uint32_t)end, &ds) : drop_loan(m, i, rv->lender_dead, &ds);
        if (st != KVB_OK) {
            /* Still attached and in use: no ack (the coordinator repeats the Revoke). */
            KVB_LOG_E("cannot detach loan %" PRIu64 ": %s; will try again", rv->loan_id, kvb_status_str(st));
            return;
        }
        m->n_revokes++;
        KVB_LOG_I("gave back %sloan %" PRIu64 "%s in %.2f ms: %d block(s) moved, %d cached kept, %d demoted, %d "
                  "dropped, %d sequence(s) preempted",
                  part ? "the front of " : "", rv->loan_id, rv->lender_dead ? " (lender dead)" : "",
                  (double)(kvb_now_ns() - t0) / 1e6, ds.moved, ds.kept, ds.demoted, ds.dropped, ds.preempted);
    }
    kvb_node_client_send_revoke_ack(m->nc, rv->loan_id, rv->epoch, (uint32_t)ds.moved, (uint32_t)ds.dropped,
                                    (uint32_t)ds.preempted, (uint32_t)ds.kept, (uint32_t)ds.demoted);
}

static void cb_control_reply(void *ud, const Kvbank__ControlReply *r) {
    master *m = ud;
    m->drain_answer = r->ok ? 1 : -1;
    if (!r->ok) KVB_LOG_W("the coordinator refused the drain: %s", r->error ? r->error : "");
}

/* ---------------------------------------------------------------------------------------- the plan */

/* Eq. 1-5 for the node config's budgets (the master's and every worker's KV memory). */
static void log_plan(const master *m) {
    const kvb_node_proc_args *a = m->a;
    const kvb_kv_geom *g = kvb_node_proc_geom(m->p);
    if (!a->cfg) {
        KVB_LOG_I("no node config: the LSC/RC plan (Eq. 1-5) needs the workers' budgets; lent blocks are %s",
                  a->lsc_stream ? "streamed through the LSC" : "read in place");
        return;
    }
    uint64_t cw[64];
    int n = 0;
    for (int i = 0; i < a->cfg->n_models && n < (int)KVB_ARRAY_LEN(cw); i++)
        if (a->cfg->models[i].role == KVB_ROLE_WORKER) cw[n++] = (uint64_t)a->cfg->models[i].kv_bytes;
    kvb_swift_plan plan;
    if (kvb_swift_plan_lsc(g, (uint64_t)a->kv_bytes, cw, n, &plan) != KVB_OK) {
        KVB_LOG_W("cannot compute the LSC/RC plan for this geometry");
        return;
    }
    KVB_LOG_I("SwiftCache plan (Eq. 1-5) for %d worker(s): M_block %" PRIu64 " bytes, sum K_i %" PRId64
              ", K_master %" PRId64 ", N_LSC %" PRId64 ", N_RC %" PRId64 " -> longest context %" PRId64
              " tokens (without lending %" PRId64 ", lent blocks in place %" PRId64 "); lent blocks are %s",
              n, plan.m_block, plan.k_workers, plan.k_master, plan.n_lsc, plan.n_rc, plan.max_ctx_tokens,
              plan.no_lending_tokens, plan.inplace_tokens,
              a->lsc_stream ? "streamed through the LSC (\"lsc\": \"stream\")" : "read in place (\"lsc\": \"inplace\")");
    int cap = kvb_engine_max_borrowed(m->eng);
    if (cap >= 0) { /* issue 10: the LSC within the budget (the swiftcache planner's lenders_bytes) */
        int own = kvb_engine_n_own(m->eng);
        KVB_LOG_I("the layer stream cache lies within the KV budget: %d own block(s) for the pool (the regular "
                  "cache), %" PRId64 " for %d stream slot(s); at most %d master blocks borrowed (registered with the "
                  "coordinator, which caps the workers' offers)", own, a->kv_bytes / (int64_t)m->block_bytes - own,
                  cap, cap);
    }
}

/* ------------------------------------------------------------------------------------------- main */

static int drained(void *ud) {
    master *m = ud;
    return m->n_loans == 0 || m->drain_answer < 0;
}

static int answered(void *ud) { return ((master *)ud)->drain_answer != 0; }

int main(int argc, char **argv) {
    kvb_cpu_threads_wait(argv, KVB_CPU_CORES_SHARED);
    kvb_prog_init(argc, argv, "kvbank-master");
    kvb_node_proc_args a;
    int rc = kvb_node_proc_parse(KVB_ROLE_MASTER, argc, argv, &a);
    if (rc >= 0) return rc;
    rc = 1;
    master m;
    memset(&m, 0, sizeof m);
    m.a = &a;
    kvb_node_role role = {
        .ud = &m,
        .cb = {.ud = &m, .load = cb_load, .loans = cb_loans, .on_grant = cb_grant, .on_revoke = cb_revoke,
               .on_control_reply = cb_control_reply},
    };
    kvb_node_proc *p = NULL;
    if (kvb_node_proc_create(&a, &role, &p) != KVB_OK) goto out;
    m.p = p;
    m.eng = kvb_node_proc_engine(p);
    m.nc = kvb_node_proc_client(p);
    m.block_bytes = kvb_kv_block_bytes(kvb_node_proc_geom(p));
    log_plan(&m);

    kvb_status st = kvb_node_proc_run(p);
    /* Stopped: live requests are cancelled, no step runs any more. Give the borrowed blocks back
     * through the coordinator (Control DRAIN: it revokes each loan, we ack, the lenders get them). */
    if (m.n_loans && kvb_node_client_registered(m.nc) &&
        kvb_node_client_send_control(m.nc, KVBANK__CONTROL__OP__OP_DRAIN, a.name, 0) == KVB_OK) {
        KVB_LOG_I("stopping: giving back %d loan(s)", m.n_loans);
        if (kvb_node_proc_pump(p, SHUTDOWN_REPLY_MS, answered, &m) && m.drain_answer > 0)
            kvb_node_proc_pump(p, SHUTDOWN_WAIT_MS, drained, &m);
    }
    if (m.n_loans) KVB_LOG_W("stopping with %d loan(s) still attached (the coordinator returns them)", m.n_loans);
    while (m.n_loans) { /* nothing runs any more: just unmap */
        kvb_detach_stats ds;
        if (drop_loan(&m, m.n_loans - 1, 1, &ds) != KVB_OK) break;
    }
    KVB_LOG_I("borrowed %" PRIu64 " loan(s), gave back %" PRIu64 " (or their fronts): %" PRIu64 " block(s) moved, %"
              PRIu64 " cached kept, %" PRIu64 " dropped, %" PRIu64 " preemption(s)",
              m.n_grants, m.n_revokes, m.n_moved, m.n_kept, m.n_dropped, m.n_preempted);
    if (st != KVB_OK) fprintf(stderr, "kvbank-master: stopped on an error: %s\n", kvb_status_str(st));
    else rc = 0;
out:
    /* the imports first: they live in the memory of the backend that kvb_node_proc_destroy frees */
    for (int i = 0; i < m.n_regions; i++) {
        kvb_mem_region_destroy(m.regions[i].reg);
        free(m.regions[i].handle);
    }
    kvb_node_proc_destroy(p);
    free(m.regions);
    free(m.loans);
    free(m.view);
    kvb_node_proc_args_free(&a);
    return rc;
}
