/* kvbank — the unified pool's virtual-memory calls on mem.h, with a mapper thread for asynchronous
 * unmapping and speculative pre-mapping (ellm-elastic-memory.txt §5.1). */
#include "common/mem/elastic_vm.h"

#include <pthread.h>
#include <string.h>

enum { T_MAP = 1, T_UNMAP = 2 };

typedef struct vm_task {
    int kind;
    int32_t res;
    kvb_mem_vrange *v;   /* the reservation (so the mapper never reads the caller's arrays) */
    size_t offset;
    int32_t chunk;
    uint64_t ticket;
    const kvb_mem_fence *fence;
} vm_task;

struct kvb_elastic_vm {
    kvb_mem *m;               /* borrowed */
    kvb_mem_chunks *chunks;   /* the P_T chunks */
    size_t chunk_bytes;
    kvb_mem_vrange **res;     /* [n_res] by reservation id (caller's thread) */
    int n_res;
    const kvb_mem_fence *fence;
    uint64_t ticket;
    int async;
    /* mapper */
    int started;
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    vm_task *q;               /* [q_n] tasks, q[q_head..q_n) not yet done (mu) */
    int q_head, q_n, q_cap;
    int *queued;              /* [n_res] tasks not yet done per reservation (mu) */
    int quit;
    kvb_status err;           /* first error of a queued call since the last drain (mu) */
    kvb_elastic_vm_stats st;  /* async fields under mu */
};

static kvb_status map_place(kvb_elastic_vm *vm, kvb_mem_vrange *v, size_t off, int32_t chunk, int *waited) {
    kvb_status st = kvb_mem_map(v, off, vm->chunks, chunk);
    if (st == KVB_ERR_STATE) {
        int pending = 0;
        if (kvb_mem_mapped_at(v, off, NULL, NULL, &pending) == 1 && pending) {
            /* the place's deferred unmap waits for its fence: wait for it, then map */
            KVB_TRY(kvb_mem_collect(vm->m, 1, NULL));
            *waited = 1;
            st = kvb_mem_map(v, off, vm->chunks, chunk);
        }
    }
    return st;
}

static kvb_status unmap_place(kvb_elastic_vm *vm, const vm_task *t) {
    kvb_status st = t->fence ? kvb_mem_unmap_after(t->v, t->offset, t->fence, t->ticket) : kvb_mem_unmap(t->v, t->offset);
    kvb_status c = kvb_mem_collect(vm->m, 0, NULL);
    return st != KVB_OK ? st : c;
}

static void *mapper_main(void *arg) {
    kvb_elastic_vm *vm = arg;
    pthread_mutex_lock(&vm->mu);
    for (;;) {
        while (!vm->quit && vm->q_head == vm->q_n) pthread_cond_wait(&vm->cv, &vm->mu);
        if (vm->q_head == vm->q_n) break;
        vm_task t = vm->q[vm->q_head];
        pthread_mutex_unlock(&vm->mu);
        uint64_t t0 = kvb_now_ns();
        int waited = 0;
        kvb_status st = t.kind == T_MAP ? map_place(vm, t.v, t.offset, t.chunk, &waited) : unmap_place(vm, &t);
        uint64_t dt = kvb_now_ns() - t0;
        pthread_mutex_lock(&vm->mu);
        if (st != KVB_OK && vm->err == KVB_OK) vm->err = st;
        if (t.kind == T_MAP) vm->st.async_maps++;
        else vm->st.async_unmaps++;
        vm->st.async_ns += dt;
        vm->st.fence_waits += (uint64_t)waited;
        vm->queued[t.res]--;
        if (++vm->q_head == vm->q_n) vm->q_head = vm->q_n = 0;
        pthread_cond_broadcast(&vm->cv);
    }
    pthread_mutex_unlock(&vm->mu);
    return NULL;
}

/* Queues a task for the mapper (caller's thread). */
static kvb_status post(kvb_elastic_vm *vm, vm_task t) {
    pthread_mutex_lock(&vm->mu);
    kvb_status st = KVB_OK;
    if (vm->q_n == vm->q_cap) {
        int cap = vm->q_cap ? 2 * vm->q_cap : 64;
        st = kvb_realloc_array((void **)&vm->q, (size_t)cap, sizeof *vm->q);
        if (st == KVB_OK) vm->q_cap = cap;
    }
    if (st == KVB_OK) {
        vm->q[vm->q_n++] = t;
        vm->queued[t.res]++;
        pthread_cond_broadcast(&vm->cv);
    }
    pthread_mutex_unlock(&vm->mu);
    return st;
}

/* Waits until reservation `res` (or everything with res < 0) has no queued task. */
static kvb_status wait_queue(kvb_elastic_vm *vm, int32_t res) {
    if (!vm->started) return KVB_OK;
    pthread_mutex_lock(&vm->mu);
    int busy = res < 0 ? vm->q_head != vm->q_n : vm->queued[res] > 0;
    if (busy) {
        uint64_t t0 = kvb_now_ns();
        while (res < 0 ? vm->q_head != vm->q_n : vm->queued[res] > 0) pthread_cond_wait(&vm->cv, &vm->mu);
        vm->st.drain_waits++;
        vm->st.drain_wait_ns += kvb_now_ns() - t0;
    }
    kvb_status st = vm->err;
    vm->err = KVB_OK;
    pthread_mutex_unlock(&vm->mu);
    return st;
}

/* ---------------------------------------------------------------- the calls */

static kvb_status op_reserve(void *ctx, int32_t res, int n_chunks, uintptr_t *base) {
    kvb_elastic_vm *vm = ctx;
    if (res < 0 || n_chunks < 1) return KVB_ERR_INVALID;
    if (res >= vm->n_res) {
        int n = KVB_MAX(res + 1, 2 * vm->n_res);
        pthread_mutex_lock(&vm->mu); /* the mapper reads queued[] */
        kvb_status st = kvb_realloc_array((void **)&vm->queued, (size_t)n, sizeof *vm->queued);
        if (st == KVB_OK) memset(vm->queued + vm->n_res, 0, (size_t)(n - vm->n_res) * sizeof *vm->queued);
        pthread_mutex_unlock(&vm->mu);
        KVB_TRY(st);
        KVB_TRY(kvb_realloc_array((void **)&vm->res, (size_t)n, sizeof *vm->res));
        memset(vm->res + vm->n_res, 0, (size_t)(n - vm->n_res) * sizeof *vm->res);
        vm->n_res = n;
    }
    if (vm->res[res]) return KVB_ERR_STATE;
    KVB_TRY(kvb_mem_reserve(vm->m, (size_t)n_chunks * vm->chunk_bytes, vm->chunk_bytes, &vm->res[res]));
    *base = (uintptr_t)kvb_mem_vrange_base(vm->res[res]);
    return KVB_OK;
}

static void op_release(void *ctx, int32_t res) {
    kvb_elastic_vm *vm = ctx;
    if (res < 0 || res >= vm->n_res || !vm->res[res]) return;
    kvb_status st = wait_queue(vm, res);
    if (st != KVB_OK) KVB_LOG_E("elastic vm: a queued call failed: %s", kvb_status_str(st));
    kvb_mem_vrange_destroy(vm->res[res]); /* carries out its deferred unmaps */
    vm->res[res] = NULL;
}

static kvb_status op_map(void *ctx, int32_t res, int idx, int32_t chunk) {
    kvb_elastic_vm *vm = ctx;
    if (res < 0 || res >= vm->n_res || !vm->res[res]) return KVB_ERR_STATE;
    size_t off = (size_t)idx * vm->chunk_bytes;
    if (vm->async && vm->started)
        return post(vm, (vm_task){.kind = T_MAP, .res = res, .v = vm->res[res], .offset = off, .chunk = chunk});
    KVB_TRY(wait_queue(vm, res));
    uint64_t t0 = kvb_now_ns();
    int waited = 0;
    kvb_status st = map_place(vm, vm->res[res], off, chunk, &waited);
    vm->st.sync_ns += kvb_now_ns() - t0;
    vm->st.fence_waits += (uint64_t)waited;
    if (st == KVB_OK) vm->st.sync_maps++;
    return st;
}

static kvb_status op_unmap(void *ctx, int32_t res, int idx) {
    kvb_elastic_vm *vm = ctx;
    if (res < 0 || res >= vm->n_res || !vm->res[res]) return KVB_ERR_STATE;
    vm_task t = {.kind = T_UNMAP, .res = res, .v = vm->res[res], .offset = (size_t)idx * vm->chunk_bytes,
                 .ticket = vm->ticket, .fence = vm->fence};
    if (vm->started) return post(vm, t);
    uint64_t t0 = kvb_now_ns();
    kvb_status st = unmap_place(vm, &t);
    vm->st.sync_ns += kvb_now_ns() - t0;
    if (st == KVB_OK) vm->st.sync_unmaps++;
    return st;
}

/* ---------------------------------------------------------------- lifetime */

kvb_status kvb_elastic_vm_create(kvb_mem *m, size_t chunk_bytes, int n_chunks, int mapper, kvb_elastic_vm **out) {
    if (!m || n_chunks < 1) return KVB_ERR_INVALID;
    kvb_elastic_vm *vm = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *vm, (void **)&vm));
    vm->m = m;
    vm->chunk_bytes = chunk_bytes;
    kvb_status st;
    if (pthread_mutex_init(&vm->mu, NULL)) {
        free(vm);
        return KVB_ERR_NOMEM;
    }
    if (pthread_cond_init(&vm->cv, NULL)) {
        pthread_mutex_destroy(&vm->mu);
        free(vm);
        return KVB_ERR_NOMEM;
    }
    KVB_TRY_GOTO(kvb_mem_chunks_create(m, chunk_bytes, n_chunks, &vm->chunks), fail);
    if (mapper) {
        if (pthread_create(&vm->th, NULL, mapper_main, vm)) {
            KVB_LOG_E("elastic vm: cannot start the mapper thread");
            st = KVB_ERR_NOMEM;
            goto fail;
        }
        vm->started = 1;
    }
    *out = vm;
    return KVB_OK;
fail:
    kvb_elastic_vm_destroy(vm);
    return st;
}

void kvb_elastic_vm_destroy(kvb_elastic_vm *vm) {
    if (!vm) return;
    if (vm->started) {
        (void)wait_queue(vm, -1);
        pthread_mutex_lock(&vm->mu);
        vm->quit = 1;
        pthread_cond_broadcast(&vm->cv);
        pthread_mutex_unlock(&vm->mu);
        pthread_join(vm->th, NULL);
    }
    for (int r = 0; r < vm->n_res; r++) kvb_mem_vrange_destroy(vm->res[r]);
    (void)kvb_mem_collect(vm->m, 1, NULL);
    kvb_mem_chunks_destroy(vm->chunks);
    pthread_cond_destroy(&vm->cv);
    pthread_mutex_destroy(&vm->mu);
    free(vm->res);
    free(vm->queued);
    free(vm->q);
    free(vm);
}

kvb_vm_ops kvb_elastic_vm_ops(kvb_elastic_vm *vm) {
    return (kvb_vm_ops){.reserve = op_reserve, .release = op_release, .map = op_map, .unmap = op_unmap, .ctx = vm};
}

void kvb_elastic_vm_set_fence(kvb_elastic_vm *vm, const kvb_mem_fence *f) { vm->fence = f; }
void kvb_elastic_vm_set_ticket(kvb_elastic_vm *vm, uint64_t ticket) { vm->ticket = ticket; }
void kvb_elastic_vm_async(kvb_elastic_vm *vm, int on) { vm->async = on && vm->started; }
kvb_status kvb_elastic_vm_drain(kvb_elastic_vm *vm) { return wait_queue(vm, -1); }

void *kvb_elastic_vm_addr(const kvb_elastic_vm *vm, int32_t res, size_t offset) {
    if (res < 0 || res >= vm->n_res || !vm->res[res]) return NULL;
    return (char *)kvb_mem_vrange_base(vm->res[res]) + offset;
}

kvb_mem *kvb_elastic_vm_mem(const kvb_elastic_vm *vm) { return vm->m; }

void kvb_elastic_vm_get_stats(const kvb_elastic_vm *vm, kvb_elastic_vm_stats *out) {
    pthread_mutex_lock((pthread_mutex_t *)&vm->mu);
    *out = vm->st;
    pthread_mutex_unlock((pthread_mutex_t *)&vm->mu);
}
