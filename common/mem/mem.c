/* kvbank — the memory interface's common part (mem.h): argument checks, region bookkeeping (double
 * imports), virtual-memory slots with their counters and timers, deferred unmaps behind fences, and
 * the step arena. The backends (mem_host.c and the device ones) only do the work. */
#include "common/mem/mem_impl.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "common/mem/region.h"

/* Deferred unmap: slot `slot` of `v`, once `ticket` of `f` has passed. */
typedef struct pending {
    kvb_mem_vrange *v;
    size_t slot;
    kvb_mem_fence f;
    uint64_t ticket;
} pending;

struct kvb_mem {
    const kvb_mem_i *iface;
    void *ctx;
    int device;
    pthread_mutex_t mu;     /* everything below, and every vrange / chunk-set state of this kvb_mem */
    char **imported;        /* [n_imported] handles of live imported regions */
    int n_imported, cap_imported;
    pending *q;             /* [n_q] deferred unmaps, oldest first */
    int n_q, cap_q;
    kvb_mem_vm_stats st;
};

struct kvb_mem_region {
    kvb_mem *m;
    void *impl;                         /* the backend's region */
    void *base;                         /* [size] bytes (device address on a device backend) */
    size_t size;
    int owner;                          /* 1: created here; 0: imported */
    char handle[KVB_MEM_HANDLE_MAX];
};

struct kvb_mem_chunks {
    kvb_mem *m;
    void *impl;          /* the backend's chunk set */
    size_t chunk_bytes;
    int n;
    int *maps;           /* [n] mappings of each chunk now */
};

typedef struct slot {
    kvb_mem_chunks *c;   /* NULL: unmapped */
    int i;               /* chunk index in c */
    int pending;         /* a deferred unmap is queued */
} slot;

struct kvb_mem_vrange {
    kvb_mem *m;
    void *base;          /* [size] bytes reserved */
    size_t size;
    size_t chunk_bytes;
    size_t n_slots;      /* size / chunk_bytes */
    slot *slots;         /* [n_slots] */
};

static const char *const OP_NAMES[KVB_MEM_OP_N] = {"reserve", "release", "create", "destroy", "map", "unmap"};

const char *kvb_mem_op_name(kvb_mem_op op) { return op >= 0 && op < KVB_MEM_OP_N ? OP_NAMES[op] : "?"; }

/* Adds one call of `op` that started at t0 (mu held). */
static void count(kvb_mem *m, kvb_mem_op op, uint64_t t0) {
    m->st.calls[op]++;
    m->st.ns[op] += kvb_now_ns() - t0;
}

/* ---------------------------------------------------------------------------------------- object */

kvb_status kvb__mem_wrap(const kvb_mem_i *iface, void *ctx, int device, kvb_mem **out) {
    kvb_mem *m = NULL;
    kvb_status st = kvb_calloc(1, sizeof *m, (void **)&m);
    if (st != KVB_OK) {
        iface->destroy(ctx);
        return st;
    }
    m->iface = iface;
    m->ctx = ctx;
    m->device = device;
    pthread_mutex_init(&m->mu, NULL);
    *out = m;
    return KVB_OK;
}

void kvb_mem_destroy(kvb_mem *m) {
    if (!m) return;
    (void)kvb_mem_collect(m, 1, NULL);
    if (m->n_imported) KVB_LOG_E("mem %s: destroyed with %d imported region(s) still mapped", m->iface->kind, m->n_imported);
    for (int i = 0; i < m->n_imported; i++) free(m->imported[i]);
    free(m->imported);
    free(m->q);
    m->iface->destroy(m->ctx);
    pthread_mutex_destroy(&m->mu);
    free(m);
}

const char *kvb_mem_kind(const kvb_mem *m) { return m ? m->iface->kind : NULL; }
int kvb_mem_device(const kvb_mem *m) { return m ? m->device : 0; }
int kvb_mem_is_device(const kvb_mem *m) { return m ? m->iface->device_memory : 0; }

/* -------------------------------------------------------------------------- plain and pinned memory */

kvb_status kvb_mem_alloc(kvb_mem *m, size_t bytes, void **out) {
    if (!m || !out || bytes == 0) return KVB_ERR_INVALID;
    return m->iface->alloc(m->ctx, bytes, out);
}

void kvb_mem_free(kvb_mem *m, void *p) {
    if (m && p) m->iface->free(m->ctx, p);
}

kvb_status kvb_mem_pinned_alloc(kvb_mem *m, size_t bytes, void **out) {
    if (!m || !out || bytes == 0) return KVB_ERR_INVALID;
    return m->iface->pinned_alloc(m->ctx, bytes, out);
}

void kvb_mem_pinned_free(kvb_mem *m, void *p) {
    if (m && p) m->iface->pinned_free(m->ctx, p);
}

kvb_status kvb_mem_copy(kvb_mem *m, void *dst, const void *src, size_t bytes) {
    if (!m || (bytes && (!dst || !src))) return KVB_ERR_INVALID;
    if (bytes == 0) return KVB_OK;
    return m->iface->copy(m->ctx, dst, src, bytes);
}

/* ---------------------------------------------------------------------------- exportable regions */

/* Index of `handle` among the live imports (mu held), or -1. */
static int import_find(const kvb_mem *m, const char *handle) {
    for (int i = 0; i < m->n_imported; i++)
        if (!strcmp(m->imported[i], handle)) return i;
    return -1;
}

kvb_status kvb_mem_region_create(kvb_mem *m, const char *tag, size_t bytes, kvb_mem_region **out) {
    if (!m || !out) return KVB_ERR_INVALID;
    *out = NULL;
    if (!kvb_region_tag_valid(tag)) {
        KVB_LOG_E("mem %s: invalid region tag (1..%d of [A-Za-z0-9_-])", m->iface->kind, KVB_REGION_TAG_MAX);
        return KVB_ERR_INVALID;
    }
    if (bytes == 0) {
        KVB_LOG_E("mem %s: a region of 0 bytes", m->iface->kind);
        return KVB_ERR_INVALID;
    }
    kvb_mem_region *r = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *r, (void **)&r));
    kvb_status st = m->iface->region_create(m->ctx, tag, bytes, &r->impl, &r->base, r->handle);
    if (st != KVB_OK) {
        free(r);
        return st;
    }
    r->m = m;
    r->size = bytes;
    r->owner = 1;
    *out = r;
    return KVB_OK;
}

kvb_status kvb_mem_region_import(kvb_mem *m, const char *handle, size_t bytes, kvb_mem_region **out) {
    if (!m || !out) return KVB_ERR_INVALID;
    *out = NULL;
    if (!handle || !handle[0] || strnlen(handle, KVB_MEM_HANDLE_MAX) >= KVB_MEM_HANDLE_MAX) {
        KVB_LOG_E("mem %s: invalid region handle (1..%d characters)", m->iface->kind, KVB_MEM_HANDLE_MAX - 1);
        return KVB_ERR_INVALID;
    }
    if (bytes == 0) {
        KVB_LOG_E("mem %s: region %.40s announced with 0 bytes", m->iface->kind, handle);
        return KVB_ERR_INVALID;
    }
    kvb_mem_region *r = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *r, (void **)&r));
    kvb_status st = KVB_OK;
    pthread_mutex_lock(&m->mu);
    if (import_find(m, handle) >= 0) {
        KVB_LOG_E("mem %s: region %.40s is imported already (a second import of the same handle)", m->iface->kind,
                  handle);
        st = KVB_ERR_STATE;
    } else if (m->n_imported == m->cap_imported) {
        int cap = m->cap_imported ? 2 * m->cap_imported : 8;
        st = kvb_realloc_array((void **)&m->imported, (size_t)cap, sizeof *m->imported);
        if (st == KVB_OK) m->cap_imported = cap;
    }
    char *copy = NULL;
    if (st == KVB_OK) st = kvb_strdup(handle, &copy);
    if (st == KVB_OK) st = m->iface->region_import(m->ctx, handle, bytes, &r->impl, &r->base);
    if (st == KVB_OK) m->imported[m->n_imported++] = copy;
    pthread_mutex_unlock(&m->mu);
    if (st != KVB_OK) {
        free(copy);
        free(r);
        return st;
    }
    r->m = m;
    r->size = bytes;
    r->owner = 0;
    snprintf(r->handle, sizeof r->handle, "%s", handle);
    *out = r;
    return KVB_OK;
}

void kvb_mem_region_destroy(kvb_mem_region *r) {
    if (!r) return;
    kvb_mem *m = r->m;
    m->iface->region_destroy(m->ctx, r->impl);
    if (!r->owner) {
        pthread_mutex_lock(&m->mu);
        int i = import_find(m, r->handle);
        if (i >= 0) {
            free(m->imported[i]);
            m->imported[i] = m->imported[--m->n_imported];
        }
        pthread_mutex_unlock(&m->mu);
    }
    free(r);
}

void *kvb_mem_region_base(const kvb_mem_region *r) { return r ? r->base : NULL; }
size_t kvb_mem_region_size(const kvb_mem_region *r) { return r ? r->size : 0; }
const char *kvb_mem_region_handle(const kvb_mem_region *r) { return r ? r->handle : NULL; }
int kvb_mem_region_is_owner(const kvb_mem_region *r) { return r ? r->owner : 0; }

/* ------------------------------------------------------------------------------- virtual memory */

kvb_status kvb_mem_granularity(kvb_mem *m, size_t *out) {
    if (!m || !out) return KVB_ERR_INVALID;
    return m->iface->granularity(m->ctx, out);
}

/* KVB_OK if chunk_bytes is a positive multiple of m's granularity (logged otherwise). */
static kvb_status check_chunk_bytes(kvb_mem *m, size_t chunk_bytes) {
    size_t g = 0;
    KVB_TRY(m->iface->granularity(m->ctx, &g));
    if (chunk_bytes == 0 || chunk_bytes % g) {
        KVB_LOG_E("mem %s: chunk size %zu bytes is not a positive multiple of the granularity (%zu bytes)",
                  m->iface->kind, chunk_bytes, g);
        return KVB_ERR_INVALID;
    }
    return KVB_OK;
}

kvb_status kvb_mem_chunks_create(kvb_mem *m, size_t chunk_bytes, int n, kvb_mem_chunks **out) {
    if (!m || !out) return KVB_ERR_INVALID;
    *out = NULL;
    KVB_TRY(check_chunk_bytes(m, chunk_bytes));
    if (n < 1 || chunk_bytes > SIZE_MAX / (size_t)n) {
        KVB_LOG_E("mem %s: %d chunks of %zu bytes", m->iface->kind, n, chunk_bytes);
        return KVB_ERR_INVALID;
    }
    kvb_mem_chunks *c = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *c, (void **)&c));
    kvb_status st;
    KVB_TRY_GOTO(kvb_calloc((size_t)n, sizeof *c->maps, (void **)&c->maps), fail);
    uint64_t t0 = kvb_now_ns();
    KVB_TRY_GOTO(m->iface->chunks_create(m->ctx, chunk_bytes, n, &c->impl), fail);
    pthread_mutex_lock(&m->mu);
    count(m, KVB_MEM_OP_CREATE, t0);
    pthread_mutex_unlock(&m->mu);
    c->m = m;
    c->chunk_bytes = chunk_bytes;
    c->n = n;
    *out = c;
    return KVB_OK;
fail:
    free(c->maps);
    free(c);
    return st;
}

void kvb_mem_chunks_destroy(kvb_mem_chunks *c) {
    if (!c) return;
    kvb_mem *m = c->m;
    pthread_mutex_lock(&m->mu);
    int mapped = 0;
    for (int i = 0; i < c->n; i++) mapped += c->maps[i];
    if (mapped) {
        pthread_mutex_unlock(&m->mu);
        KVB_LOG_E("mem %s: chunks destroyed with %d mapping(s) left: kept (a caller bug)", m->iface->kind, mapped);
        return;
    }
    uint64_t t0 = kvb_now_ns();
    m->iface->chunks_destroy(m->ctx, c->impl);
    count(m, KVB_MEM_OP_DESTROY, t0);
    pthread_mutex_unlock(&m->mu);
    free(c->maps);
    free(c);
}

size_t kvb_mem_chunks_bytes(const kvb_mem_chunks *c) { return c ? c->chunk_bytes : 0; }
int kvb_mem_chunks_count(const kvb_mem_chunks *c) { return c ? c->n : 0; }

int kvb_mem_chunk_mappings(const kvb_mem_chunks *c, int i) {
    if (!c || i < 0 || i >= c->n) return 0;
    pthread_mutex_lock(&c->m->mu);
    int n = c->maps[i];
    pthread_mutex_unlock(&c->m->mu);
    return n;
}

kvb_status kvb_mem_reserve(kvb_mem *m, size_t bytes, size_t chunk_bytes, kvb_mem_vrange **out) {
    if (!m || !out) return KVB_ERR_INVALID;
    *out = NULL;
    KVB_TRY(check_chunk_bytes(m, chunk_bytes));
    if (bytes == 0 || bytes % chunk_bytes) {
        KVB_LOG_E("mem %s: a reservation of %zu bytes is not a positive multiple of its chunk size (%zu bytes)",
                  m->iface->kind, bytes, chunk_bytes);
        return KVB_ERR_INVALID;
    }
    kvb_mem_vrange *v = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *v, (void **)&v));
    kvb_status st;
    v->n_slots = bytes / chunk_bytes;
    KVB_TRY_GOTO(kvb_calloc(v->n_slots, sizeof *v->slots, (void **)&v->slots), fail);
    uint64_t t0 = kvb_now_ns();
    KVB_TRY_GOTO(m->iface->reserve(m->ctx, bytes, &v->base), fail);
    pthread_mutex_lock(&m->mu);
    count(m, KVB_MEM_OP_RESERVE, t0);
    pthread_mutex_unlock(&m->mu);
    v->m = m;
    v->size = bytes;
    v->chunk_bytes = chunk_bytes;
    *out = v;
    return KVB_OK;
fail:
    free(v->slots);
    free(v);
    return st;
}

void *kvb_mem_vrange_base(const kvb_mem_vrange *v) { return v ? v->base : NULL; }
size_t kvb_mem_vrange_size(const kvb_mem_vrange *v) { return v ? v->size : 0; }
size_t kvb_mem_vrange_chunk_bytes(const kvb_mem_vrange *v) { return v ? v->chunk_bytes : 0; }

/* The slot index of `offset` in v, or -1 (logged) when it is not a chunk-aligned offset inside v. */
static long slot_of(const kvb_mem_vrange *v, size_t offset) {
    if (offset % v->chunk_bytes || offset >= v->size) {
        KVB_LOG_E("mem %s: offset %zu is not a multiple of the chunk size %zu inside a reservation of %zu bytes",
                  v->m->iface->kind, offset, v->chunk_bytes, v->size);
        return -1;
    }
    return (long)(offset / v->chunk_bytes);
}

/* Unmaps slot s of v through the backend (mu held). The slot is cleared even when the backend fails
 * (its state is unknown then; the error is returned). */
static kvb_status unmap_slot(kvb_mem_vrange *v, size_t s) {
    kvb_mem *m = v->m;
    slot *sl = &v->slots[s];
    uint64_t t0 = kvb_now_ns();
    kvb_status st = m->iface->unmap(m->ctx, (char *)v->base + s * v->chunk_bytes, v->chunk_bytes);
    count(m, KVB_MEM_OP_UNMAP, t0);
    sl->c->maps[sl->i]--;
    sl->c = NULL;
    sl->i = 0;
    sl->pending = 0;
    return st;
}

kvb_status kvb_mem_map(kvb_mem_vrange *v, size_t offset, kvb_mem_chunks *c, int i) {
    if (!v || !c) return KVB_ERR_INVALID;
    kvb_mem *m = v->m;
    if (c->m != m) {
        KVB_LOG_E("mem %s: chunks of another memory backend", m->iface->kind);
        return KVB_ERR_INVALID;
    }
    if (c->chunk_bytes != v->chunk_bytes) {
        KVB_LOG_E("mem %s: a chunk of %zu bytes does not fit the reservation's %zu-byte slots", m->iface->kind,
                  c->chunk_bytes, v->chunk_bytes);
        return KVB_ERR_INVALID;
    }
    if (i < 0 || i >= c->n) {
        KVB_LOG_E("mem %s: chunk %d of %d", m->iface->kind, i, c->n);
        return KVB_ERR_INVALID;
    }
    long s = slot_of(v, offset);
    if (s < 0) return KVB_ERR_INVALID;
    pthread_mutex_lock(&m->mu);
    kvb_status st = KVB_OK;
    slot *sl = &v->slots[s];
    if (sl->c) {
        KVB_LOG_E("mem %s: offset %zu is mapped already%s", m->iface->kind, offset,
                  sl->pending ? " (its unmap waits for a fence)" : "");
        st = KVB_ERR_STATE;
    } else {
        uint64_t t0 = kvb_now_ns();
        st = m->iface->map(m->ctx, (char *)v->base + offset, v->chunk_bytes, c->impl, i);
        count(m, KVB_MEM_OP_MAP, t0);
        if (st == KVB_OK) {
            sl->c = c;
            sl->i = i;
            c->maps[i]++;
        }
    }
    pthread_mutex_unlock(&m->mu);
    return st;
}

/* The slot at `offset` if it is mapped and not pending (mu held), else -1 with the error in *st. */
static long mapped_slot(kvb_mem_vrange *v, size_t offset, kvb_status *st) {
    long s = slot_of(v, offset);
    if (s < 0) {
        *st = KVB_ERR_INVALID;
        return -1;
    }
    if (!v->slots[s].c || v->slots[s].pending) {
        KVB_LOG_E("mem %s: offset %zu is %s", v->m->iface->kind, offset,
                  v->slots[s].c ? "being unmapped already (behind a fence)" : "not mapped");
        *st = KVB_ERR_STATE;
        return -1;
    }
    return s;
}

kvb_status kvb_mem_unmap(kvb_mem_vrange *v, size_t offset) {
    if (!v) return KVB_ERR_INVALID;
    kvb_status st = KVB_OK;
    pthread_mutex_lock(&v->m->mu);
    long s = mapped_slot(v, offset, &st);
    if (s >= 0) st = unmap_slot(v, (size_t)s);
    pthread_mutex_unlock(&v->m->mu);
    return st;
}

kvb_status kvb_mem_unmap_after(kvb_mem_vrange *v, size_t offset, const kvb_mem_fence *f, uint64_t ticket) {
    if (!v || !f || !f->passed) return KVB_ERR_INVALID;
    kvb_mem *m = v->m;
    kvb_status st = KVB_OK;
    pthread_mutex_lock(&m->mu);
    long s = mapped_slot(v, offset, &st);
    if (s >= 0) {
        if (f->passed(f->ud, ticket)) {
            st = unmap_slot(v, (size_t)s);
        } else {
            if (m->n_q == m->cap_q) {
                int cap = m->cap_q ? 2 * m->cap_q : 16;
                st = kvb_realloc_array((void **)&m->q, (size_t)cap, sizeof *m->q);
                if (st == KVB_OK) m->cap_q = cap;
            }
            if (st == KVB_OK) {
                m->q[m->n_q++] = (pending){.v = v, .slot = (size_t)s, .f = *f, .ticket = ticket};
                v->slots[s].pending = 1;
                m->st.deferred++;
            }
        }
    }
    pthread_mutex_unlock(&m->mu);
    return st;
}

/* Carries out the queued unmaps (of `only` if not NULL) whose tickets passed, or all of them with
 * `wait` (mu held). Keeps the queue's order for the rest. */
static kvb_status collect_locked(kvb_mem *m, const kvb_mem_vrange *only, int wait, int *n_done) {
    kvb_status first = KVB_OK;
    int done = 0, k = 0;
    for (int j = 0; j < m->n_q; j++) {
        pending *p = &m->q[j];
        int go = 0;
        if (!only || p->v == only) {
            go = p->f.passed(p->f.ud, p->ticket);
            if (!go && wait) {
                kvb_status ws = KVB_OK;
                if (p->f.wait) ws = p->f.wait(p->f.ud, p->ticket);
                else
                    while (!p->f.passed(p->f.ud, p->ticket)) nanosleep(&(struct timespec){0, 50000}, NULL);
                if (ws != KVB_OK) {
                    /* The fence cannot say; unmapping could pull memory from under a kernel. */
                    KVB_LOG_E("mem %s: waiting for ticket %llu failed: %s; the chunk stays mapped", m->iface->kind,
                              (unsigned long long)p->ticket, kvb_status_str(ws));
                    if (first == KVB_OK) first = ws;
                } else {
                    go = 1;
                }
            }
        }
        if (go) {
            kvb_status st = unmap_slot(p->v, p->slot);
            if (st != KVB_OK && first == KVB_OK) first = st;
            done++;
        } else {
            m->q[k++] = *p;
        }
    }
    m->n_q = k;
    if (n_done) *n_done = done;
    return first;
}

kvb_status kvb_mem_collect(kvb_mem *m, int wait, int *n_done) {
    if (n_done) *n_done = 0;
    if (!m) return KVB_ERR_INVALID;
    pthread_mutex_lock(&m->mu);
    kvb_status st = collect_locked(m, NULL, wait, n_done);
    pthread_mutex_unlock(&m->mu);
    return st;
}

int kvb_mem_pending(const kvb_mem *m) {
    if (!m) return 0;
    pthread_mutex_lock((pthread_mutex_t *)&m->mu);
    int n = m->n_q;
    pthread_mutex_unlock((pthread_mutex_t *)&m->mu);
    return n;
}

int kvb_mem_mapped_at(const kvb_mem_vrange *v, size_t offset, kvb_mem_chunks **c, int *i, int *pending) {
    if (!v) return KVB_ERR_INVALID;
    long s = slot_of(v, offset);
    if (s < 0) return KVB_ERR_INVALID;
    pthread_mutex_lock(&v->m->mu);
    const slot *sl = &v->slots[s];
    int mapped = sl->c != NULL;
    if (c) *c = sl->c;
    if (i) *i = sl->i;
    if (pending) *pending = sl->pending;
    pthread_mutex_unlock(&v->m->mu);
    return mapped;
}

void kvb_mem_vrange_destroy(kvb_mem_vrange *v) {
    if (!v) return;
    kvb_mem *m = v->m;
    pthread_mutex_lock(&m->mu);
    (void)collect_locked(m, v, 1, NULL);
    for (size_t s = 0; s < v->n_slots; s++)
        if (v->slots[s].c && !v->slots[s].pending) (void)unmap_slot(v, s);
    int left = 0;
    for (size_t s = 0; s < v->n_slots; s++) left += v->slots[s].c != NULL;
    if (left) {
        /* a fence failed: those chunks may still be read; keep the range (and them) mapped */
        pthread_mutex_unlock(&m->mu);
        KVB_LOG_E("mem %s: reservation kept: %d slot(s) could not be unmapped safely", m->iface->kind, left);
        return;
    }
    uint64_t t0 = kvb_now_ns();
    m->iface->release(m->ctx, v->base, v->size);
    count(m, KVB_MEM_OP_RELEASE, t0);
    pthread_mutex_unlock(&m->mu);
    free(v->slots);
    free(v);
}

void kvb_mem_vm_stats_get(const kvb_mem *m, kvb_mem_vm_stats *out) {
    memset(out, 0, sizeof *out);
    if (!m) return;
    pthread_mutex_lock((pthread_mutex_t *)&m->mu);
    *out = m->st;
    pthread_mutex_unlock((pthread_mutex_t *)&m->mu);
}

/* ------------------------------------------------------------------------------------ step arena */

#define ARENA_ALIGN 256

typedef struct overflow {
    void *p;
    struct overflow *next;
} overflow;

struct kvb_mem_arena {
    kvb_mem *m;
    char *base;          /* [cap] bytes of kvb_mem_alloc memory, or NULL */
    size_t cap;
    size_t off;          /* next free byte of base */
    size_t want;         /* bytes the current round asked for in all (aligned) */
    int live;            /* buffers handed out and not given back */
    overflow *extra;     /* buffers of this round that did not fit base */
    uint64_t grows;
};

static kvb_status arena_alloc(void *ctx, size_t bytes, void **out) {
    kvb_mem_arena *a = ctx;
    if (!out || bytes == 0) return KVB_ERR_INVALID;
    size_t need = KVB_DIV_CEIL(bytes, (size_t)ARENA_ALIGN) * ARENA_ALIGN;
    if (a->live == 0) {
        /* a new round: grow the block to what the last round needed, then start at the front */
        if (a->want > a->cap) {
            kvb_mem_free(a->m, a->base);
            a->base = NULL;
            a->cap = 0;
            size_t cap = a->want + a->want / 4;
            if (kvb_mem_alloc(a->m, cap, (void **)&a->base) == KVB_OK) {
                a->cap = cap;
                a->grows++;
            }
        }
        a->off = 0;
        a->want = 0;
    }
    a->want += need;
    if (a->base && need <= a->cap - a->off) {
        *out = a->base + a->off;
        a->off += need;
    } else {
        overflow *o = NULL;
        KVB_TRY(kvb_calloc(1, sizeof *o, (void **)&o));
        kvb_status st = kvb_mem_alloc(a->m, need, &o->p);
        if (st != KVB_OK) {
            free(o);
            a->want -= need;
            return st;
        }
        o->next = a->extra;
        a->extra = o;
        *out = o->p;
    }
    a->live++;
    return KVB_OK;
}

static void arena_free(void *ctx, void *p) {
    kvb_mem_arena *a = ctx;
    if (!p) return;
    for (overflow **o = &a->extra; *o; o = &(*o)->next) {
        if ((*o)->p == p) {
            overflow *dead = *o;
            *o = dead->next;
            kvb_mem_free(a->m, dead->p);
            free(dead);
            break;
        }
    }
    if (a->live > 0) a->live--;
}

static const kvb_mem_allocator_i arena_iface = {.alloc = arena_alloc, .free = arena_free};

kvb_status kvb_mem_arena_create(kvb_mem *m, kvb_mem_arena **out) {
    if (!m || !out) return KVB_ERR_INVALID;
    kvb_mem_arena *a = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *a, (void **)&a));
    a->m = m;
    *out = a;
    return KVB_OK;
}

void kvb_mem_arena_destroy(kvb_mem_arena *a) {
    if (!a) return;
    if (a->live) KVB_LOG_E("mem arena destroyed with %d buffer(s) still handed out", a->live);
    while (a->extra) {
        overflow *o = a->extra;
        a->extra = o->next;
        kvb_mem_free(a->m, o->p);
        free(o);
    }
    kvb_mem_free(a->m, a->base);
    free(a);
}

kvb_mem_allocator kvb_mem_arena_allocator(kvb_mem_arena *a) { return (kvb_mem_allocator){&arena_iface, a}; }
size_t kvb_mem_arena_capacity(const kvb_mem_arena *a) { return a ? a->cap : 0; }
uint64_t kvb_mem_arena_grows(const kvb_mem_arena *a) { return a ? a->grows : 0; }
