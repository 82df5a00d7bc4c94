/* kvbank — KV eTensor slots: one reservation per concurrency slot, chunks mapped on demand. */
#include "common/kv/slot_pool.h"

#include <string.h>

enum { SLOT_EMPTY = 0, SLOT_LIVE = 1, SLOT_CACHED = 2 };

typedef struct slot {
    int first;          /* index of its chunk 0 in the reservation */
    int state;
    int n_mapped;       /* chunks [0, n_mapped) are mapped */
    int need;           /* live: chunks [0, need) hold KV */
    uint64_t released;  /* cached: when it was released (a counter), for LRU reclaim */
} slot;

struct kvb_slot_pool {
    kvb_epool *ep;      /* borrowed */
    int32_t res;        /* the reservation of all slots (-1 before it exists) */
    slot *s;            /* [n] */
    int n;
    int slot_chunks;
    uint64_t clock;
    int n_live;
    int needed;         /* sum of live needs */
    int mapped;         /* sum of n_mapped */
};

kvb_status kvb_slot_pool_create(kvb_epool *ep, int n_slots, int slot_chunks, kvb_slot_pool **out) {
    if (!ep || n_slots < 1 || slot_chunks < 1) {
        KVB_LOG_E("slot pool: %d slots of %d chunks", n_slots, slot_chunks);
        return KVB_ERR_INVALID;
    }
    kvb_slot_pool *sp = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *sp, (void **)&sp));
    sp->ep = ep;
    sp->slot_chunks = slot_chunks;
    sp->res = -1;
    kvb_status st;
    if ((int64_t)n_slots * slot_chunks > INT32_MAX) {
        KVB_LOG_E("slot pool: %d slots of %d chunks pass the chunk index range", n_slots, slot_chunks);
        st = KVB_ERR_INVALID;
        goto fail;
    }
    KVB_TRY_GOTO(kvb_calloc((size_t)n_slots, sizeof *sp->s, (void **)&sp->s), fail);
    KVB_TRY_GOTO(kvb_epool_reserve(ep, n_slots * slot_chunks, &sp->res), fail);
    for (int i = 0; i < n_slots; i++) sp->s[i].first = i * slot_chunks;
    sp->n = n_slots;
    *out = sp;
    return KVB_OK;
fail:
    kvb_slot_pool_destroy(sp);
    return st;
}

void kvb_slot_pool_destroy(kvb_slot_pool *sp) {
    if (!sp) return;
    if (sp->res >= 0) kvb_epool_release(sp->ep, sp->res);
    free(sp->s);
    free(sp);
}

int kvb_slot_pool_n_slots(const kvb_slot_pool *sp) { return sp->n; }
int kvb_slot_pool_slot_chunks(const kvb_slot_pool *sp) { return sp->slot_chunks; }
uintptr_t kvb_slot_pool_base(const kvb_slot_pool *sp, int i) {
    return kvb_epool_base(sp->ep, sp->res) + (uintptr_t)sp->s[i].first * kvb_epool_chunk_bytes(sp->ep);
}
int32_t kvb_slot_pool_reservation(const kvb_slot_pool *sp) { return sp->res; }
int kvb_slot_pool_is_live(const kvb_slot_pool *sp, int i) { return sp->s[i].state == SLOT_LIVE; }
int kvb_slot_pool_n_mapped(const kvb_slot_pool *sp, int i) { return sp->s[i].n_mapped; }
int kvb_slot_pool_need(const kvb_slot_pool *sp, int i) { return sp->s[i].state == SLOT_LIVE ? sp->s[i].need : 0; }

kvb_status kvb_slot_pool_acquire(kvb_slot_pool *sp, int need, int *out) {
    if (need < 0 || need > sp->slot_chunks) return KVB_ERR_INVALID;
    int cover = -1, most = -1, empty = -1;
    for (int i = 0; i < sp->n; i++) {
        const slot *s = &sp->s[i];
        if (s->state == SLOT_EMPTY || (s->state == SLOT_CACHED && s->n_mapped == 0)) {
            if (empty < 0) empty = i;
        } else if (s->state == SLOT_CACHED) {
            if (s->n_mapped >= need && (cover < 0 || s->n_mapped < sp->s[cover].n_mapped)) cover = i;
            if (most < 0 || s->n_mapped > sp->s[most].n_mapped) most = i;
        }
    }
    int i = cover >= 0 ? cover : most >= 0 ? most : empty;
    if (i < 0) return KVB_ERR_EXHAUSTED;
    sp->s[i].state = SLOT_LIVE;
    sp->s[i].need = need;
    sp->n_live++;
    sp->needed += need;
    *out = i;
    return KVB_OK;
}

void kvb_slot_pool_release(kvb_slot_pool *sp, int i) {
    slot *s = &sp->s[i];
    if (s->state != SLOT_LIVE) return;
    sp->needed -= s->need;
    sp->n_live--;
    s->need = 0;
    s->state = SLOT_CACHED;
    s->released = ++sp->clock;
}

void kvb_slot_pool_set_need(kvb_slot_pool *sp, int i, int need) {
    slot *s = &sp->s[i];
    if (s->state != SLOT_LIVE) return;
    need = KVB_MAX(0, KVB_MIN(need, sp->slot_chunks));
    sp->needed += need - s->need;
    s->need = need;
}

/* The slot to take a reclaimable chunk from (not `except`): the least recently released cached slot
 * with a chunk mapped, else (with `live`) the live slot with the most excess. -1 if none. */
static int reclaim_victim(const kvb_slot_pool *sp, int except, int live) {
    int v = -1;
    for (int i = 0; i < sp->n; i++) {
        const slot *s = &sp->s[i];
        if (i == except || s->state != SLOT_CACHED || s->n_mapped == 0) continue;
        if (v < 0 || s->released < sp->s[v].released) v = i;
    }
    if (v >= 0 || !live) return v;
    for (int i = 0; i < sp->n; i++) {
        const slot *s = &sp->s[i];
        if (i == except || s->state != SLOT_LIVE || s->n_mapped <= s->need) continue;
        if (v < 0 || s->n_mapped - s->need > sp->s[v].n_mapped - sp->s[v].need) v = i;
    }
    return v;
}

kvb_status kvb_slot_pool_map(kvb_slot_pool *sp, int i, int n, kvb_slot_reclaim from) {
    slot *s = &sp->s[i];
    if (s->state != SLOT_LIVE || n > sp->slot_chunks) return KVB_ERR_INVALID;
    while (s->n_mapped < n) {
        kvb_status st = kvb_epool_map_free(sp->ep, KVB_EPOOL_KV, sp->res, s->first + s->n_mapped, NULL);
        if (st == KVB_ERR_EXHAUSTED && from != KVB_SLOT_RECLAIM_NONE) {
            int v = reclaim_victim(sp, i, from == KVB_SLOT_RECLAIM_ALL);
            if (v < 0) return KVB_ERR_EXHAUSTED;
            slot *vs = &sp->s[v];
            st = kvb_epool_move(sp->ep, sp->res, vs->first + vs->n_mapped - 1, sp->res, s->first + s->n_mapped, KVB_EPOOL_KV);
            if (st == KVB_OK) {
                vs->n_mapped--;
                sp->mapped--;
            }
        }
        KVB_TRY(st);
        s->n_mapped++;
        sp->mapped++;
    }
    return KVB_OK;
}

int kvb_slot_pool_reclaim(kvb_slot_pool *sp, int n) {
    int done = 0;
    while (done < n) {
        int v = reclaim_victim(sp, -1, 1);
        if (v < 0) break;
        slot *s = &sp->s[v];
        if (kvb_epool_unmap(sp->ep, sp->res, s->first + s->n_mapped - 1) != KVB_OK) break;
        s->n_mapped--;
        sp->mapped--;
        done++;
    }
    return done;
}

int kvb_slot_pool_n_reclaimable(const kvb_slot_pool *sp) {
    int n = 0;
    for (int i = 0; i < sp->n; i++) {
        const slot *s = &sp->s[i];
        if (s->state == SLOT_CACHED) n += s->n_mapped;
        else if (s->state == SLOT_LIVE) n += KVB_MAX(0, s->n_mapped - s->need);
    }
    return n;
}

int kvb_slot_pool_n_needed(const kvb_slot_pool *sp) { return sp->needed; }

int kvb_slot_pool_n_excess(const kvb_slot_pool *sp) {
    int n = 0;
    for (int i = 0; i < sp->n; i++)
        if (sp->s[i].state == SLOT_LIVE) n += KVB_MAX(0, sp->s[i].n_mapped - sp->s[i].need);
    return n;
}
int kvb_slot_pool_n_mapped_total(const kvb_slot_pool *sp) { return sp->mapped; }
int kvb_slot_pool_n_free_slots(const kvb_slot_pool *sp) { return sp->n - sp->n_live; }

kvb_status kvb_slot_pool_check(const kvb_slot_pool *sp) {
    int live = 0, needed = 0, mapped = 0;
    for (int i = 0; i < sp->n; i++) {
        const slot *s = &sp->s[i];
        for (int c = 0; c < sp->slot_chunks; c++) {
            int m = kvb_epool_chunk_at(sp->ep, sp->res, s->first + c) >= 0;
            if (m != (c < s->n_mapped)) {
                KVB_LOG_E("slot pool: slot %d chunk %d is %smapped, the slot maps [0, %d)", i, c, m ? "" : "not ",
                          s->n_mapped);
                return KVB_ERR_STATE;
            }
        }
        if (s->state == SLOT_LIVE) {
            live++;
            needed += s->need;
            if (s->need > s->n_mapped) {
                KVB_LOG_E("slot pool: live slot %d needs %d chunks, %d mapped", i, s->need, s->n_mapped);
                return KVB_ERR_STATE;
            }
        }
        mapped += s->n_mapped;
    }
    if (live != sp->n_live || needed != sp->needed || mapped != sp->mapped) {
        KVB_LOG_E("slot pool: counts %d live / %d needed / %d mapped, found %d / %d / %d", sp->n_live, sp->needed,
                  sp->mapped, live, needed, mapped);
        return KVB_ERR_STATE;
    }
    return KVB_OK;
}
