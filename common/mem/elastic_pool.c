/* kvbank — the unified physical chunk pool of eLLM (§4.2.2): ownership labels, free lists, where each
 * chunk is mapped, and the counted virtual-memory calls. */
#include "common/mem/elastic_pool.h"

#include <string.h>

typedef struct resv {
    int n_chunks;    /* 0: the id is unused */
    uintptr_t base;
    int32_t *at;     /* [n_chunks] chunk mapped at each index, -1 */
} resv;

struct kvb_epool {
    int n;                  /* P_T */
    size_t chunk_bytes;
    kvb_vm_ops ops;
    uint8_t *owner;         /* [n] kvb_epool_owner of each chunk */
    int32_t *where_res;     /* [n] reservation the chunk is mapped in, -1 when free */
    int32_t *where_idx;     /* [n] index there */
    int32_t *free_list[2];  /* [n] per owner: stack of free chunks */
    int n_free[2];
    int n_owned[2];
    resv *res;              /* [n_res] */
    int n_res;
    kvb_epool_stats stats;
};

kvb_status kvb_epool_create(int n_chunks, size_t chunk_bytes, int n_act, const kvb_vm_ops *ops, kvb_epool **out) {
    if (n_chunks < 1 || chunk_bytes == 0 || n_act < 0 || n_act > n_chunks || !ops || !ops->reserve || !ops->map ||
        !ops->unmap) {
        KVB_LOG_E("elastic pool: %d chunks with %d for activations, and the reserve/map/unmap calls, are needed",
                  n_chunks, n_act);
        return KVB_ERR_INVALID;
    }
    kvb_epool *p = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *p, (void **)&p));
    p->n = n_chunks;
    p->chunk_bytes = chunk_bytes;
    p->ops = *ops;
    kvb_status st;
    size_t n = (size_t)n_chunks;
    KVB_TRY_GOTO(kvb_calloc(n, sizeof *p->owner, (void **)&p->owner), fail);
    KVB_TRY_GOTO(kvb_malloc(n * sizeof *p->where_res, (void **)&p->where_res), fail);
    KVB_TRY_GOTO(kvb_malloc(n * sizeof *p->where_idx, (void **)&p->where_idx), fail);
    for (int o = 0; o < 2; o++) KVB_TRY_GOTO(kvb_malloc(n * sizeof(int32_t), (void **)&p->free_list[o]), fail);
    /* pushed from the top so that chunk 0 comes out first */
    for (int32_t c = n_chunks - 1; c >= 0; c--) {
        int o = c < n_act ? KVB_EPOOL_ACT : KVB_EPOOL_KV;
        p->owner[c] = (uint8_t)o;
        p->where_res[c] = p->where_idx[c] = -1;
        p->free_list[o][p->n_free[o]++] = c;
        p->n_owned[o]++;
    }
    *out = p;
    return KVB_OK;
fail:
    kvb_epool_destroy(p);
    return st;
}

static int res_valid(const kvb_epool *p, int32_t r) { return r >= 0 && r < p->n_res && p->res[r].n_chunks > 0; }

static int place_valid(const kvb_epool *p, int32_t r, int idx) {
    return res_valid(p, r) && idx >= 0 && idx < p->res[r].n_chunks;
}

void kvb_epool_destroy(kvb_epool *p) {
    if (!p) return;
    for (int32_t r = 0; r < p->n_res; r++)
        if (p->res[r].n_chunks > 0) kvb_epool_release(p, r);
    free(p->res);
    free(p->owner);
    free(p->where_res);
    free(p->where_idx);
    free(p->free_list[0]);
    free(p->free_list[1]);
    free(p);
}

int kvb_epool_n_chunks(const kvb_epool *p) { return p->n; }
size_t kvb_epool_chunk_bytes(const kvb_epool *p) { return p->chunk_bytes; }
int kvb_epool_n_owned(const kvb_epool *p, kvb_epool_owner o) { return p->n_owned[o]; }
int kvb_epool_n_free(const kvb_epool *p, kvb_epool_owner o) { return p->n_free[o]; }
int kvb_epool_n_mapped(const kvb_epool *p, kvb_epool_owner o) { return p->n_owned[o] - p->n_free[o]; }

/* ---------------------------------------------------------------- reservations */

kvb_status kvb_epool_reserve(kvb_epool *p, int n_chunks, int32_t *res) {
    if (n_chunks < 1) return KVB_ERR_INVALID;
    int32_t r = 0;
    while (r < p->n_res && p->res[r].n_chunks > 0) r++;
    if (r == p->n_res) {
        KVB_TRY(kvb_realloc_array((void **)&p->res, (size_t)p->n_res + 1, sizeof *p->res));
        p->res[p->n_res++] = (resv){0};
    }
    int32_t *at = NULL;
    KVB_TRY(kvb_malloc((size_t)n_chunks * sizeof *at, (void **)&at));
    for (int i = 0; i < n_chunks; i++) at[i] = -1;
    uintptr_t base = 0;
    kvb_status st = p->ops.reserve(p->ops.ctx, r, n_chunks, &base);
    if (st != KVB_OK) {
        free(at);
        return st;
    }
    p->res[r] = (resv){.n_chunks = n_chunks, .base = base, .at = at};
    p->stats.reserves++;
    *res = r;
    return KVB_OK;
}

void kvb_epool_release(kvb_epool *p, int32_t r) {
    if (!res_valid(p, r)) return;
    for (int i = 0; i < p->res[r].n_chunks; i++)
        if (p->res[r].at[i] >= 0) (void)kvb_epool_unmap(p, r, i);
    if (p->ops.release) p->ops.release(p->ops.ctx, r);
    free(p->res[r].at);
    p->res[r] = (resv){0};
}

uintptr_t kvb_epool_base(const kvb_epool *p, int32_t r) { return res_valid(p, r) ? p->res[r].base : 0; }
int kvb_epool_res_chunks(const kvb_epool *p, int32_t r) { return res_valid(p, r) ? p->res[r].n_chunks : 0; }

int32_t kvb_epool_chunk_at(const kvb_epool *p, int32_t r, int idx) {
    return place_valid(p, r, idx) ? p->res[r].at[idx] : -1;
}

/* ---------------------------------------------------------------- mapping */

static void set_owner(kvb_epool *p, int32_t c, kvb_epool_owner o) {
    if (p->owner[c] == o) return;
    p->n_owned[p->owner[c]]--;
    p->n_owned[o]++;
    p->owner[c] = (uint8_t)o;
    if (o == KVB_EPOOL_KV) p->stats.to_kv++;
    else p->stats.to_act++;
}

kvb_status kvb_epool_map_free(kvb_epool *p, kvb_epool_owner o, int32_t r, int idx, int32_t *chunk) {
    if (!place_valid(p, r, idx) || p->res[r].at[idx] >= 0) return KVB_ERR_STATE;
    if (p->n_free[o] == 0) return KVB_ERR_EXHAUSTED;
    int32_t c = p->free_list[o][p->n_free[o] - 1];
    KVB_TRY(p->ops.map(p->ops.ctx, r, idx, c));
    p->n_free[o]--;
    p->res[r].at[idx] = c;
    p->where_res[c] = r;
    p->where_idx[c] = idx;
    p->stats.maps++;
    if (chunk) *chunk = c;
    return KVB_OK;
}

kvb_status kvb_epool_unmap(kvb_epool *p, int32_t r, int idx) {
    if (!place_valid(p, r, idx) || p->res[r].at[idx] < 0) return KVB_ERR_STATE;
    int32_t c = p->res[r].at[idx];
    KVB_TRY(p->ops.unmap(p->ops.ctx, r, idx));
    p->res[r].at[idx] = -1;
    p->where_res[c] = p->where_idx[c] = -1;
    p->free_list[p->owner[c]][p->n_free[p->owner[c]]++] = c;
    p->stats.unmaps++;
    return KVB_OK;
}

kvb_status kvb_epool_move(kvb_epool *p, int32_t from_res, int from_idx, int32_t to_res, int to_idx,
                          kvb_epool_owner o) {
    if (!place_valid(p, from_res, from_idx) || !place_valid(p, to_res, to_idx)) return KVB_ERR_STATE;
    int32_t c = p->res[from_res].at[from_idx];
    if (c < 0 || p->res[to_res].at[to_idx] >= 0) return KVB_ERR_STATE;
    /* map at the new place first: the chunk is at two addresses until the old unmap is done */
    KVB_TRY(p->ops.map(p->ops.ctx, to_res, to_idx, c));
    p->stats.maps++;
    kvb_status st = p->ops.unmap(p->ops.ctx, from_res, from_idx);
    if (st != KVB_OK) {
        /* undo the new mapping so the books stay true; if even that fails the chunk stays at both */
        if (p->ops.unmap(p->ops.ctx, to_res, to_idx) == KVB_OK) p->stats.unmaps++;
        else KVB_LOG_E("elastic pool: chunk %d left mapped at (%d, %d) as well", (int)c, (int)to_res, to_idx);
        return st;
    }
    p->stats.unmaps++;
    p->stats.moves++;
    p->res[from_res].at[from_idx] = -1;
    p->res[to_res].at[to_idx] = c;
    p->where_res[c] = to_res;
    p->where_idx[c] = to_idx;
    set_owner(p, c, o);
    return KVB_OK;
}

/* ---------------------------------------------------------------- ownership */

kvb_status kvb_epool_transfer(kvb_epool *p, kvb_epool_owner from, kvb_epool_owner to, int n) {
    if (n < 0) return KVB_ERR_INVALID;
    if (from == to || n == 0) return KVB_OK;
    if (p->n_free[from] < n) return KVB_ERR_EXHAUSTED;
    for (int i = 0; i < n; i++) {
        int32_t c = p->free_list[from][--p->n_free[from]];
        set_owner(p, c, to);
        p->free_list[to][p->n_free[to]++] = c;
    }
    return KVB_OK;
}

/* ---------------------------------------------------------------- counters and checks */

void kvb_epool_get_stats(const kvb_epool *p, kvb_epool_stats *out) { *out = p->stats; }

kvb_status kvb_epool_check(const kvb_epool *p) {
    int owned[2] = {0, 0}, mapped[2] = {0, 0};
    for (int32_t c = 0; c < p->n; c++) {
        if (p->owner[c] > KVB_EPOOL_ACT) {
            KVB_LOG_E("elastic pool: chunk %d has no owner", (int)c);
            return KVB_ERR_STATE;
        }
        owned[p->owner[c]]++;
        int32_t r = p->where_res[c];
        if (r < 0) continue;
        mapped[p->owner[c]]++;
        if (!place_valid(p, r, p->where_idx[c]) || p->res[r].at[p->where_idx[c]] != c) {
            KVB_LOG_E("elastic pool: chunk %d says it is at (%d, %d), which holds another", (int)c, (int)r,
                      (int)p->where_idx[c]);
            return KVB_ERR_STATE;
        }
    }
    /* every place that holds a chunk is that chunk's one place */
    int places = 0;
    for (int32_t r = 0; r < p->n_res; r++) {
        for (int i = 0; i < p->res[r].n_chunks; i++) {
            int32_t c = p->res[r].at[i];
            if (c < 0) continue;
            places++;
            if (c >= p->n || p->where_res[c] != r || p->where_idx[c] != i) {
                KVB_LOG_E("elastic pool: (%d, %d) holds chunk %d, which is elsewhere", (int)r, i, (int)c);
                return KVB_ERR_STATE;
            }
        }
    }
    /* free lists: exactly the unmapped chunks, each once, under its owner */
    uint8_t *seen = NULL;
    if (kvb_calloc((size_t)p->n, 1, (void **)&seen) != KVB_OK) return KVB_ERR_NOMEM;
    kvb_status st = KVB_OK;
    for (int o = 0; o < 2 && st == KVB_OK; o++) {
        for (int i = 0; i < p->n_free[o]; i++) {
            int32_t c = p->free_list[o][i];
            if (c < 0 || c >= p->n || seen[c] || p->owner[c] != o || p->where_res[c] >= 0) {
                KVB_LOG_E("elastic pool: free list of owner %d holds chunk %d wrongly", o, (int)c);
                st = KVB_ERR_STATE;
                break;
            }
            seen[c] = 1;
        }
    }
    free(seen);
    if (st != KVB_OK) return st;
    for (int o = 0; o < 2; o++) {
        if (owned[o] != p->n_owned[o] || mapped[o] + p->n_free[o] != owned[o]) {
            KVB_LOG_E("elastic pool: owner %d counts %d owned / %d free, found %d owned / %d mapped", o, p->n_owned[o],
                      p->n_free[o], owned[o], mapped[o]);
            return KVB_ERR_STATE;
        }
    }
    if (mapped[0] + mapped[1] + p->n_free[0] + p->n_free[1] != p->n || places != mapped[0] + mapped[1]) {
        KVB_LOG_E("elastic pool: KV %d + act %d mapped + %d free != P_T %d", mapped[0], mapped[1],
                  p->n_free[0] + p->n_free[1], p->n);
        return KVB_ERR_STATE;
    }
    return KVB_OK;
}
