/* Unit tests of eLLM elastic memory's pure parts (ellm-elastic-memory.txt §4): the unified chunk pool,
 * the activation pool (BFC), the KV slot pool, Algorithm 1, the ballooning amount, Algorithm 2 and its
 * violation window, and the accounting under random workloads. The virtual-memory calls go to a
 * recording stand-in (tests/vm_mock.h); real mappings are tested over common/mem/mem.h. */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/kv/slot_pool.h"
#include "common/mem/act_pool.h"
#include "common/mem/elastic_pool.h"
#include "common/mem/elastic_vm.h"
#include "common/mem/mem.h"
#include "common/policy/ellm_elastic_alg.h"
#include "common/policy/ellm_elastic.h"
#include "common/policy/ellm_elastic_core.h"
#include "common/sched/engine.h"
#include "tests/harness.h"
#include "tests/testmodel.h"
#include "tests/vm_mock.h"

/* A recording VM layer and a unified pool of `n` chunks (`n_act` of them activations') over it. */
typedef struct fixture {
    vm_mock m;
    kvb_vm_ops ops;
    kvb_epool *p;
} fixture;

static void fx_open(fixture *f, int n, int n_act, size_t chunk_bytes) {
    vm_mock_init(&f->m, n, chunk_bytes, &f->ops);
    f->p = NULL;
    ck_assert_int_eq(kvb_epool_create(n, chunk_bytes, n_act, &f->ops, &f->p), KVB_OK);
}

/* Destroys the pool, then checks that the VM layer saw nothing wrong and nothing is left mapped. */
static void fx_close(fixture *f) {
    kvb_epool_destroy(f->p);
    ck_assert_int_eq(f->m.errors, 0);
    ck_assert_int_eq(vm_mock_n_mapped(&f->m), 0);
    vm_mock_free(&f->m);
}

/* ================================================================ unified pool */

KVB_TEST(epool_books) {
    fixture f;
    fx_open(&f, 8, 3, 64);
    vm_mock *m = &f.m;
    kvb_epool *p = f.p;
    ck_assert_int_eq(kvb_epool_n_owned(p, KVB_EPOOL_ACT), 3);
    ck_assert_int_eq(kvb_epool_n_owned(p, KVB_EPOOL_KV), 5);
    ck_assert_int_eq(kvb_epool_n_free(p, KVB_EPOOL_KV), 5);
    int32_t r1, r2;
    ck_assert_int_eq(kvb_epool_reserve(p, 4, &r1), KVB_OK);
    ck_assert_int_eq(kvb_epool_reserve(p, 4, &r2), KVB_OK);
    ck_assert_int_ne(r1, r2);
    int32_t c0, c1;
    ck_assert_int_eq(kvb_epool_map_free(p, KVB_EPOOL_KV, r1, 0, &c0), KVB_OK);
    ck_assert_int_eq(kvb_epool_map_free(p, KVB_EPOOL_KV, r1, 0, &c1), KVB_ERR_STATE); /* place taken */
    ck_assert_int_eq(kvb_epool_map_free(p, KVB_EPOOL_KV, r1, 1, &c1), KVB_OK);
    ck_assert_int_ne(c0, c1);
    ck_assert_int_eq(kvb_epool_chunk_at(p, r1, 0), c0);
    ck_assert_int_eq(kvb_epool_n_mapped(p, KVB_EPOOL_KV), 2);
    ck_assert_int_eq(kvb_epool_check(p), KVB_OK);
    /* data written through one place is read at the place the chunk moves to */
    unsigned char *b = vm_mock_deref(m, kvb_epool_base(p, r1) + 64 + 5);
    ck_assert_ptr_nonnull(b);
    *b = 0xab;
    ck_assert_int_eq(kvb_epool_move(p, r1, 1, r2, 3, KVB_EPOOL_ACT), KVB_OK); /* deflation by remap */
    ck_assert_int_eq(m->max_places, 2); /* mapped at the new place before the old one went */
    ck_assert_ptr_null(vm_mock_deref(m, kvb_epool_base(p, r1) + 64 + 5));
    ck_assert_uint_eq(*vm_mock_deref(m, kvb_epool_base(p, r2) + 3 * 64 + 5), 0xab);
    ck_assert_int_eq(kvb_epool_chunk_at(p, r2, 3), c1);
    ck_assert_int_eq(kvb_epool_n_owned(p, KVB_EPOOL_ACT), 4);
    ck_assert_int_eq(kvb_epool_n_mapped(p, KVB_EPOOL_ACT), 1);
    ck_assert_int_eq(kvb_epool_move(p, r1, 1, r2, 0, KVB_EPOOL_ACT), KVB_ERR_STATE); /* nothing there */
    ck_assert_int_eq(kvb_epool_check(p), KVB_OK);
    /* transfer: free chunks only, all or nothing */
    ck_assert_int_eq(kvb_epool_n_free(p, KVB_EPOOL_ACT), 3);
    ck_assert_int_eq(kvb_epool_transfer(p, KVB_EPOOL_ACT, KVB_EPOOL_KV, 4), KVB_ERR_EXHAUSTED);
    ck_assert_int_eq(kvb_epool_n_free(p, KVB_EPOOL_ACT), 3);
    ck_assert_int_eq(kvb_epool_transfer(p, KVB_EPOOL_ACT, KVB_EPOOL_KV, 3), KVB_OK);
    ck_assert_int_eq(kvb_epool_n_owned(p, KVB_EPOOL_KV), 7);
    /* exhaustion: 7 KV chunks, 1 mapped, 6 free */
    for (int i = 0; i < 3; i++) ck_assert_int_eq(kvb_epool_map_free(p, KVB_EPOOL_KV, r2, i, NULL), KVB_OK);
    ck_assert_int_eq(kvb_epool_check(p), KVB_OK);
    ck_assert_int_eq(kvb_epool_map_free(p, KVB_EPOOL_ACT, r1, 3, NULL), KVB_ERR_EXHAUSTED);
    ck_assert_int_eq(kvb_epool_unmap(p, r1, 3), KVB_ERR_STATE);
    ck_assert_int_eq(kvb_epool_unmap(p, r1, 0), KVB_OK);
    ck_assert_int_eq(kvb_epool_chunk_at(p, r1, 0), -1);
    kvb_epool_stats s;
    kvb_epool_get_stats(p, &s);
    ck_assert_uint_eq(s.moves, 1);
    ck_assert_uint_eq(s.to_act, 1);
    ck_assert_uint_eq(s.to_kv, 3);
    ck_assert_uint_eq(s.maps, 2 + 1 + 3);
    ck_assert_uint_eq(s.unmaps, 1 + 1);
    ck_assert_int_eq(kvb_epool_check(p), KVB_OK);
    fx_close(&f); /* unmaps what is left and releases both reservations */
}
KVB_TEST_END

KVB_TEST(epool_failed_call_changes_nothing) {
    fixture f;
    fx_open(&f, 4, 0, 64);
    vm_mock *m = &f.m;
    kvb_epool *p = f.p;
    int32_t r;
    ck_assert_int_eq(kvb_epool_reserve(p, 4, &r), KVB_OK);
    m->fail_at = 1;
    ck_assert_int_eq(kvb_epool_map_free(p, KVB_EPOOL_KV, r, 0, NULL), KVB_ERR_BACKEND);
    ck_assert_int_eq(kvb_epool_n_free(p, KVB_EPOOL_KV), 4);
    ck_assert_int_eq(kvb_epool_chunk_at(p, r, 0), -1);
    ck_assert_int_eq(kvb_epool_map_free(p, KVB_EPOOL_KV, r, 0, NULL), KVB_OK);
    /* a move whose unmap fails is undone */
    m->fail_at = m->calls + 2;
    ck_assert_int_eq(kvb_epool_move(p, r, 0, r, 1, KVB_EPOOL_ACT), KVB_ERR_BACKEND);
    ck_assert_int_ge(kvb_epool_chunk_at(p, r, 0), 0);
    ck_assert_int_eq(kvb_epool_chunk_at(p, r, 1), -1);
    ck_assert_int_eq(kvb_epool_n_owned(p, KVB_EPOOL_ACT), 0);
    ck_assert_int_eq(vm_mock_n_mapped(m), 1);
    ck_assert_int_eq(kvb_epool_check(p), KVB_OK);
    m->fail_at = 0;
    /* bad arguments */
    kvb_epool *q = NULL;
    ck_assert_int_eq(kvb_epool_create(0, 64, 0, &f.ops, &q), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_epool_create(4, 64, 5, &f.ops, &q), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_epool_map_free(p, KVB_EPOOL_KV, r, 4, NULL), KVB_ERR_STATE);
    ck_assert_int_eq(kvb_epool_map_free(p, KVB_EPOOL_KV, r + 7, 0, NULL), KVB_ERR_STATE);
    fx_close(&f);
}
KVB_TEST_END

/* ================================================================ activation pool */

#define CH 256 /* chunk bytes of the pool tests */

KVB_TEST(act_pool_best_fit_coalesce) {
    fixture f;
    fx_open(&f, 16, 16, CH);
    vm_mock *m = &f.m;
    kvb_epool *p = f.p;
    kvb_act_pool *a = NULL;
    ck_assert_int_eq(kvb_act_pool_create(p, 8, 64, &a), KVB_OK);
    ck_assert_int_eq(kvb_act_pool_n_mapped(a), 0); /* address space only */
    uintptr_t x, y, z, w;
    ck_assert_int_eq(kvb_act_pool_alloc(a, 100, &x), KVB_OK); /* 128 bytes at 0 */
    ck_assert_int_eq(kvb_act_pool_alloc(a, 300, &y), KVB_OK); /* 320 at 128: chunks 0-1 */
    ck_assert_int_eq(kvb_act_pool_alloc(a, 64, &z), KVB_OK);  /* at 448 */
    ck_assert_uint_eq(y - x, 128);
    ck_assert_uint_eq(z - x, 448);
    ck_assert_int_eq(kvb_act_pool_n_mapped(a), 2);
    ck_assert_int_eq(kvb_act_pool_n_live(a), 2);
    /* blocks are usable memory */
    memset(vm_mock_deref(m, y + 200), 7, 50);
    ck_assert_int_eq(kvb_act_pool_free(a, x), KVB_OK);
    ck_assert_int_eq(kvb_act_pool_free(a, x), KVB_ERR_INVALID); /* not live any more */
    ck_assert_int_eq(kvb_act_pool_free(a, y + 1), KVB_ERR_INVALID);
    /* best fit: a 128-byte request takes the 128-byte hole at 0, not the big tail */
    ck_assert_int_eq(kvb_act_pool_alloc(a, 128, &w), KVB_OK);
    ck_assert_uint_eq(w, x);
    ck_assert_int_eq(kvb_act_pool_check(a), KVB_OK);
    /* free everything: the segment coalesces back into one free block */
    ck_assert_int_eq(kvb_act_pool_free(a, y), KVB_OK);
    ck_assert_int_eq(kvb_act_pool_free(a, w), KVB_OK);
    ck_assert_int_eq(kvb_act_pool_free(a, z), KVB_OK);
    ck_assert_int_eq(kvb_act_pool_n_blocks(a), 0);
    ck_assert_int_eq(kvb_act_pool_n_live(a), 0);
    ck_assert_int_eq(kvb_act_pool_n_idle(a), 2); /* cached mapped */
    ck_assert_int_eq(kvb_act_pool_check(a), KVB_OK);
    /* the same step again makes no VM call */
    long calls = m->calls;
    ck_assert_int_eq(kvb_act_pool_alloc(a, 448, &x), KVB_OK);
    ck_assert_int_eq(kvb_act_pool_free(a, x), KVB_OK);
    ck_assert_int_eq(m->calls, calls);
    /* a request larger than the first segment opens a segment of its own; gc releases it */
    ck_assert_int_eq(kvb_act_pool_alloc(a, 9 * CH, &x), KVB_OK);
    ck_assert_int_eq(kvb_act_pool_n_segments(a), 2);
    ck_assert_int_eq(kvb_act_pool_n_mapped(a), 11);
    ck_assert_int_eq(kvb_act_pool_free(a, x), KVB_OK);
    ck_assert_int_eq(kvb_act_pool_gc(a, 100), 11);
    ck_assert_int_eq(kvb_act_pool_n_segments(a), 1);
    ck_assert_int_eq(kvb_epool_n_free(p, KVB_EPOOL_ACT), 16);
    ck_assert_int_eq(kvb_act_pool_check(a), KVB_OK);
    ck_assert_int_eq(kvb_epool_check(p), KVB_OK);
    kvb_act_pool_destroy(a);
    fx_close(&f);
}
KVB_TEST_END

KVB_TEST(act_pool_gc_only_idle_chunks) {
    fixture f;
    fx_open(&f, 8, 4, CH);
    vm_mock *m = &f.m;
    kvb_epool *p = f.p;
    kvb_act_pool *a = NULL;
    ck_assert_int_eq(kvb_act_pool_create(p, 8, 64, &a), KVB_OK);
    uintptr_t x, y;
    ck_assert_int_eq(kvb_act_pool_alloc(a, 3 * CH, &x), KVB_OK); /* chunks 0-2 */
    ck_assert_int_eq(kvb_act_pool_alloc(a, 64, &y), KVB_OK);     /* chunk 3 */
    ck_assert_int_eq(kvb_act_pool_free(a, x), KVB_OK);
    ck_assert_int_eq(kvb_act_pool_n_idle(a), 3);
    /* gc never touches chunk 3 (live) */
    ck_assert_int_eq(kvb_act_pool_gc(a, 100), 3);
    ck_assert_int_eq(kvb_act_pool_n_mapped(a), 1);
    ck_assert_ptr_nonnull(vm_mock_deref(m, y));
    ck_assert_int_eq(kvb_act_pool_check(a), KVB_OK);
    /* all four activation chunks in use: a block that needs a fifth fails, nothing changes */
    ck_assert_int_eq(kvb_act_pool_alloc(a, 3 * CH, &x), KVB_OK);
    ck_assert_int_eq(kvb_act_pool_alloc(a, 2 * CH, &x), KVB_ERR_EXHAUSTED);
    ck_assert_int_eq(kvb_act_pool_n_blocks(a), 2);
    ck_assert_int_eq(kvb_act_pool_check(a), KVB_OK);
    ck_assert_int_eq(kvb_epool_check(p), KVB_OK);
    /* an idle chunk elsewhere moves to where a block needs it when no free chunk is left */
    kvb_act_pool_destroy(a);
    a = NULL;
    ck_assert_int_eq(kvb_act_pool_create(p, 8, 64, &a), KVB_OK);
    uintptr_t b1, b2, b3;
    ck_assert_int_eq(kvb_act_pool_alloc(a, 2 * CH, &b1), KVB_OK); /* chunks 0-1 */
    ck_assert_int_eq(kvb_act_pool_alloc(a, 2 * CH, &b2), KVB_OK); /* chunks 2-3: all four mapped */
    memset(vm_mock_deref(m, b2), 9, 2 * CH);
    ck_assert_int_eq(kvb_act_pool_free(a, b1), KVB_OK);           /* 0-1 idle */
    ck_assert_int_eq(m->max_places, 1);
    ck_assert_int_eq(kvb_act_pool_alloc(a, 3 * CH, &b3), KVB_ERR_EXHAUSTED); /* needs 3, only 2 idle */
    ck_assert_int_eq(m->max_places, 2); /* the 2 idle chunks moved (mapped at 4-5 before unmapped at 0-1) */
    ck_assert_int_eq(kvb_act_pool_check(a), KVB_OK);
    ck_assert_int_eq(kvb_act_pool_alloc(a, 2 * CH, &b3), KVB_OK); /* best fit 2*CH: the idle hole itself */
    ck_assert_uint_eq(b3, b1);
    ck_assert_int_eq(kvb_act_pool_free(a, b3), KVB_OK);
    ck_assert_int_eq(kvb_act_pool_alloc(a, 2 * CH + 64, &b3), KVB_ERR_EXHAUSTED);
    /* the hole at 0-1 is too small for 2*CH + 64: it goes to 4-6, which 0-1's chunks cannot all fill */
    ck_assert_int_eq(kvb_act_pool_n_mapped(a), 4);
    ck_assert_int_eq(kvb_act_pool_alloc(a, 2 * CH, &b1), KVB_OK);
    ck_assert_int_eq(kvb_act_pool_free(a, b1), KVB_OK);
    ck_assert_int_eq(kvb_act_pool_check(a), KVB_OK);
    ck_assert_int_eq(kvb_epool_check(p), KVB_OK);
    for (int i = 0; i < 2 * CH; i++) ck_assert_uint_eq(vm_mock_deref(m, b2)[i], 9); /* b2 untouched */
    kvb_act_pool_destroy(a);
    fx_close(&f);
}
KVB_TEST_END

/* ================================================================ slot pool */

KVB_TEST(slot_pool_best_fit_reuse) {
    fixture f;
    fx_open(&f, 20, 0, CH);
    vm_mock *m = &f.m;
    kvb_epool *p = f.p;
    kvb_slot_pool *sp = NULL;
    ck_assert_int_eq(kvb_slot_pool_create(p, 4, 8, &sp), KVB_OK);
    int s[4];
    int sizes[3] = {5, 2, 3};
    for (int i = 0; i < 3; i++) {
        ck_assert_int_eq(kvb_slot_pool_acquire(sp, sizes[i], &s[i]), KVB_OK);
        ck_assert_int_eq(kvb_slot_pool_map(sp, s[i], sizes[i], KVB_SLOT_RECLAIM_NONE), KVB_OK);
    }
    ck_assert_int_eq(kvb_slot_pool_n_needed(sp), 10);
    ck_assert_int_eq(kvb_slot_pool_check(sp), KVB_OK);
    for (int i = 0; i < 3; i++) kvb_slot_pool_release(sp, s[i]);
    ck_assert_int_eq(kvb_slot_pool_n_reclaimable(sp), 10);
    /* need 3: the smallest cached slot that covers it is the 3-chunk one (not the 5) */
    int t;
    long calls = m->calls;
    ck_assert_int_eq(kvb_slot_pool_acquire(sp, 3, &t), KVB_OK);
    ck_assert_int_eq(t, s[2]);
    ck_assert_int_eq(kvb_slot_pool_map(sp, t, 3, KVB_SLOT_RECLAIM_NONE), KVB_OK);
    ck_assert_int_eq(m->calls, calls); /* a cached slot: no map call */
    /* need 7: none covers; the cached slot with the most mapped (5) is extended by 2 */
    int u;
    ck_assert_int_eq(kvb_slot_pool_acquire(sp, 7, &u), KVB_OK);
    ck_assert_int_eq(u, s[0]);
    ck_assert_int_eq(kvb_slot_pool_map(sp, u, 7, KVB_SLOT_RECLAIM_NONE), KVB_OK);
    ck_assert_int_eq(m->calls, calls + 2);
    /* need 1: the remaining cached slot (2) covers it; 1 chunk of excess is reclaimable */
    int v;
    ck_assert_int_eq(kvb_slot_pool_acquire(sp, 1, &v), KVB_OK);
    ck_assert_int_eq(v, s[1]);
    ck_assert_int_eq(kvb_slot_pool_n_reclaimable(sp), 1);
    int w;
    ck_assert_int_eq(kvb_slot_pool_acquire(sp, 0, &w), KVB_OK); /* the empty one */
    ck_assert_int_eq(kvb_slot_pool_acquire(sp, 0, &w), KVB_ERR_EXHAUSTED);
    ck_assert_int_eq(kvb_slot_pool_check(sp), KVB_OK);
    kvb_slot_pool_destroy(sp);
    ck_assert_int_eq(kvb_epool_n_free(p, KVB_EPOOL_KV), 20);
    fx_close(&f);
}
KVB_TEST_END

KVB_TEST(slot_pool_reclaim_lru_and_excess) {
    fixture f;
    fx_open(&f, 8, 0, CH);
    vm_mock *m = &f.m;
    kvb_epool *p = f.p;
    kvb_slot_pool *sp = NULL;
    ck_assert_int_eq(kvb_slot_pool_create(p, 3, 8, &sp), KVB_OK);
    int a, b, c;
    ck_assert_int_eq(kvb_slot_pool_acquire(sp, 3, &a), KVB_OK);
    ck_assert_int_eq(kvb_slot_pool_map(sp, a, 3, KVB_SLOT_RECLAIM_NONE), KVB_OK);
    ck_assert_int_eq(kvb_slot_pool_acquire(sp, 3, &b), KVB_OK);
    ck_assert_int_eq(kvb_slot_pool_map(sp, b, 4, KVB_SLOT_RECLAIM_NONE), KVB_OK); /* one pre-mapped (excess) chunk */
    kvb_slot_pool_release(sp, a);                            /* a is cached first (LRU) */
    ck_assert_int_eq(kvb_slot_pool_acquire(sp, 2, &c), KVB_OK);
    ck_assert_int_eq(c, a); /* covers */
    kvb_slot_pool_set_need(sp, c, 1);
    ck_assert_int_eq(kvb_slot_pool_n_reclaimable(sp), 2 + 1);
    /* a fresh slot needs 3 chunks; 1 is free, 2 come from the excess of the others (moved, not copied) */
    int d;
    kvb_slot_pool_release(sp, c);
    ck_assert_int_eq(kvb_slot_pool_acquire(sp, 3, &d), KVB_OK);
    ck_assert_int_eq(d, c); /* the cached 3-chunk slot covers */
    kvb_slot_pool_release(sp, d);
    /* data in a live slot survives while other slots are reclaimed */
    unsigned char *x = vm_mock_deref(m, kvb_slot_pool_base(sp, b) + 2 * CH + 7);
    *x = 42;
    int e;
    ck_assert_int_eq(kvb_slot_pool_acquire(sp, 8, &e), KVB_OK);
    ck_assert_int_eq(e, d); /* the most-mapped cached slot */
    ck_assert_int_eq(kvb_slot_pool_map(sp, e, 8, KVB_SLOT_RECLAIM_NONE), KVB_ERR_EXHAUSTED); /* 3 + 1 free: 4 of 8 */
    ck_assert_int_eq(kvb_slot_pool_n_mapped(sp, e), 4);
    kvb_slot_pool_set_need(sp, e, 4);
    ck_assert_int_eq(kvb_slot_pool_map(sp, e, 5, KVB_SLOT_RECLAIM_ALL), KVB_OK); /* b's excess chunk moves */
    ck_assert_int_eq(kvb_slot_pool_n_mapped(sp, b), 3);
    ck_assert_int_eq(kvb_slot_pool_map(sp, e, 6, KVB_SLOT_RECLAIM_ALL), KVB_ERR_EXHAUSTED); /* nothing reclaimable left */
    ck_assert_uint_eq(*vm_mock_deref(m, kvb_slot_pool_base(sp, b) + 2 * CH + 7), 42);
    ck_assert_int_eq(kvb_slot_pool_check(sp), KVB_OK);
    ck_assert_int_eq(kvb_epool_check(p), KVB_OK);
    /* reclaim: cached first, then live excess; never live need */
    kvb_slot_pool_set_need(sp, e, 2);
    ck_assert_int_eq(kvb_slot_pool_reclaim(sp, 100), 3);
    ck_assert_int_eq(kvb_slot_pool_n_mapped(sp, e), 2);
    ck_assert_int_eq(kvb_slot_pool_n_mapped(sp, b), 3);
    ck_assert_int_eq(kvb_epool_n_free(p, KVB_EPOOL_KV), 3);
    ck_assert_int_eq(kvb_slot_pool_check(sp), KVB_OK);
    kvb_slot_pool_destroy(sp);
    fx_close(&f);
}
KVB_TEST_END

/* ================================================================ Algorithm 1 */

/* A linear activation model for the tests: 1 chunk per 4 tokens, a seq's logits row adds nothing,
 * staging bytes in chunks of 100. */
static int64_t act4(void *ud, int64_t n_tokens, int n_seqs, int64_t stage) {
    (void)ud;
    (void)n_seqs;
    return (n_tokens + 3) / 4 + (stage + 99) / 100;
}

static kvb_ee_alg1_in alg_in(kvb_ee_phase ph, int p_kv, int p_act) {
    return (kvb_ee_alg1_in){.phase = ph, .p_kv = p_kv, .p_act = p_act, .theta = 0, .buf_avail = 0, .free_slots = 64,
                            .max_tokens = 1 << 20, .max_seqs = 64, .intra = 1, .act = act4};
}

KVB_TEST(alg1_fcfs_break) {
    /* 20 chunks: r0 takes 8 KV + 2 act, r1 would need 12 + 2 (no), r2 is small but FCFS stops at r1 */
    kvb_ee_cand c[3] = {{.kv_chunks = 8, .q_len = 8}, {.kv_chunks = 12, .q_len = 8}, {.kv_chunks = 1, .q_len = 1}};
    uint8_t off[3];
    kvb_ee_alg1_out o;
    kvb_ee_alg1_in in = alg_in(KVB_EE_PREFILL, 15, 5);
    ck_assert_int_eq(kvb_ee_alg1(&in, c, 3, off, &o), KVB_OK);
    ck_assert_int_eq(o.n_batch, 1);
    ck_assert_int_eq(o.m_kv, 8);
    ck_assert_int_eq(o.m_act, 2);
    ck_assert_int_eq(o.n_offload, 0);
    /* θ: the same batch with θ = 11 admits nothing (20 - 10 < 11) */
    in.theta = 11;
    ck_assert_int_eq(kvb_ee_alg1(&in, c, 3, off, &o), KVB_OK);
    ck_assert_int_eq(o.n_batch, 0);
    ck_assert_int_eq(o.m_act, 0);
    /* θ = 10 admits r0 exactly */
    in.theta = 10;
    ck_assert_int_eq(kvb_ee_alg1(&in, c, 3, off, &o), KVB_OK);
    ck_assert_int_eq(o.n_batch, 1);
    /* the token budget and the sequence cap break FCFS too */
    in = alg_in(KVB_EE_PREFILL, 100, 100);
    in.max_tokens = 15;
    ck_assert_int_eq(kvb_ee_alg1(&in, c, 3, off, &o), KVB_OK);
    ck_assert_int_eq(o.n_batch, 1);
    in.max_tokens = 1000;
    in.max_seqs = 2;
    ck_assert_int_eq(kvb_ee_alg1(&in, c, 3, off, &o), KVB_OK);
    ck_assert_int_eq(o.n_batch, 2);
    /* no free slot: a device-resident candidate cannot join (and, without a buffer, stops the queue) */
    in = alg_in(KVB_EE_DECODE, 100, 100);
    in.free_slots = 0;
    c[0].needs_slot = 1;
    ck_assert_int_eq(kvb_ee_alg1(&in, c, 3, off, &o), KVB_OK);
    ck_assert_int_eq(o.n_batch, 0);
    /* bad input */
    in.max_tokens = 0;
    ck_assert_int_eq(kvb_ee_alg1(&in, c, 3, off, &o), KVB_ERR_INVALID);
}
KVB_TEST_END

KVB_TEST(alg1_offload_branch) {
    /* 14 chunks free; r0 needs 8 KV + 2 act: fits. r1 needs 6 KV + 2 act: does not (8+6+4 > 14), but
     * fits without its KV (8 + 4 + its 1 staging chunk <= 14) and its 6 chunks fit the buffer. */
    kvb_ee_cand c[3] = {{.kv_chunks = 8, .q_len = 8, .stage_bytes = 50},
                        {.kv_chunks = 6, .q_len = 8, .stage_bytes = 50},
                        {.kv_chunks = 3, .q_len = 4, .stage_bytes = 50}};
    uint8_t off[3];
    kvb_ee_alg1_out o;
    kvb_ee_alg1_in in = alg_in(KVB_EE_PREFILL, 12, 2);
    in.buf_avail = 8;
    ck_assert_int_eq(kvb_ee_alg1(&in, c, 3, off, &o), KVB_OK);
    ck_assert_int_eq(o.n_batch, 2); /* r2: 3 KV do not fit on the device, nor in the buffer's 2 left */
    ck_assert_int_eq(off[0], 0);
    ck_assert_int_eq(off[1], 1);
    ck_assert_int_eq(off[2], 0);
    ck_assert_int_eq(o.n_offload, 1);
    ck_assert_int_eq(o.m_kv, 8);       /* r1's KV is not counted on the device */
    ck_assert_int_eq(o.m_act, 4 + 1);  /* 16 tokens + r1's staging area */
    ck_assert_int_eq(o.buf_used, 6);   /* P_B <- P_B - KV_r */
    /* KV_r > P_B: no offload, FCFS stops */
    in.buf_avail = 5;
    ck_assert_int_eq(kvb_ee_alg1(&in, c, 3, off, &o), KVB_OK);
    ck_assert_int_eq(o.n_batch, 1);
    ck_assert_int_eq(o.buf_used, 0);
    /* the buffer takes r1 and r2 once P_B = 9 */
    in.buf_avail = 9;
    ck_assert_int_eq(kvb_ee_alg1(&in, c, 3, off, &o), KVB_OK);
    ck_assert_int_eq(o.n_batch, 3);
    ck_assert_int_eq(o.n_offload, 2);
    ck_assert_int_eq(o.buf_used, 9);
    /* decode never offloads */
    in.phase = KVB_EE_DECODE;
    ck_assert_int_eq(kvb_ee_alg1(&in, c, 3, off, &o), KVB_OK);
    ck_assert_int_eq(o.n_batch, 1);
    ck_assert_int_eq(o.n_offload, 0);
    /* with no slot free, the offload branch still admits (an offloaded request holds no slot) */
    in = alg_in(KVB_EE_PREFILL, 100, 100);
    in.free_slots = 0;
    in.buf_avail = 100;
    for (int i = 0; i < 3; i++) c[i].needs_slot = 1;
    ck_assert_int_eq(kvb_ee_alg1(&in, c, 3, off, &o), KVB_OK);
    ck_assert_int_eq(o.n_batch, 3);
    ck_assert_int_eq(o.n_offload, 3);
    ck_assert_int_eq(o.m_kv, 0);
}
KVB_TEST_END

KVB_TEST(alg1_balloon_sign_and_bounds) {
    /* lines 24-27 */
    ck_assert_int_eq(kvb_ee_balloon(3, 10, 5, 2), 2);   /* KV short by 2, act has spare: inflate +2 */
    ck_assert_int_eq(kvb_ee_balloon(10, 1, 4, 5), -4);  /* act short by 4: deflate, I = P_act - M_act < 0 */
    ck_assert_int_eq(kvb_ee_balloon(5, 5, 5, 5), 0);
    ck_assert_int_eq(kvb_ee_balloon(3, 3, 5, 5), 0);    /* both short: nothing to move (Alg. 1 never plans it) */
    ck_assert_int_eq(kvb_ee_balloon(0, 9, 9, 0), 9);    /* all of it */
    /* through Alg. 1: a prefill that needs more KV than the KV side owns inflates by the shortfall */
    kvb_ee_cand c[1] = {{.kv_chunks = 9, .q_len = 4}};
    uint8_t off[1];
    kvb_ee_alg1_out o;
    kvb_ee_alg1_in in = alg_in(KVB_EE_PREFILL, 4, 10);
    ck_assert_int_eq(kvb_ee_alg1(&in, c, 1, off, &o), KVB_OK);
    ck_assert_int_eq(o.n_batch, 1);
    ck_assert_int_eq(o.inflate, 5);
    ck_assert(o.inflate <= in.p_act - o.m_act); /* line 5 guarantees the donor keeps what it needs */
    /* a long prefill whose activations exceed the activation side deflates */
    c[0] = (kvb_ee_cand){.kv_chunks = 2, .q_len = 40};
    in = alg_in(KVB_EE_PREFILL, 20, 3);
    ck_assert_int_eq(kvb_ee_alg1(&in, c, 1, off, &o), KVB_OK);
    ck_assert_int_eq(o.m_act, 10);
    ck_assert_int_eq(o.inflate, -7);
    ck_assert(-o.inflate <= in.p_kv - o.m_kv);
    /* without intra-GPU elasticity each side must fit what it owns, and nothing moves */
    in.intra = 0;
    ck_assert_int_eq(kvb_ee_alg1(&in, c, 1, off, &o), KVB_OK);
    ck_assert_int_eq(o.n_batch, 0);
    ck_assert_int_eq(o.inflate, 0);
    c[0].q_len = 12;
    ck_assert_int_eq(kvb_ee_alg1(&in, c, 1, off, &o), KVB_OK);
    ck_assert_int_eq(o.n_batch, 1);
    ck_assert_int_eq(o.inflate, 0);
}
KVB_TEST_END

/* Alg. 1 against a brute-force reading of the pseudo-code on random inputs. */
KVB_TEST(alg1_random_against_pseudocode) {
    srand(7);
    for (int it = 0; it < 20000; it++) {
        int n = rand() % 6;
        kvb_ee_cand c[6];
        for (int i = 0; i < n; i++)
            c[i] = (kvb_ee_cand){.kv_chunks = rand() % 8, .q_len = 1 + rand() % 20, .stage_bytes = rand() % 300,
                                 .needs_slot = rand() % 2};
        kvb_ee_alg1_in in = alg_in(rand() % 2 ? KVB_EE_DECODE : KVB_EE_PREFILL, rand() % 30, rand() % 30);
        in.theta = rand() % 4;
        in.buf_avail = rand() % 10;
        in.free_slots = rand() % 4;
        in.intra = rand() % 4 != 0;
        uint8_t off[6];
        kvb_ee_alg1_out o;
        ck_assert_int_eq(kvb_ee_alg1(&in, c, n, off, &o), KVB_OK);
        /* replay */
        int mkv = 0, tok = 0, seqs = 0, slots = in.free_slots, pb = in.buf_avail;
        int64_t stage = 0, mact = 0;
        int nb = 0;
        for (int i = 0; i < n; i++) {
            int64_t a1 = act4(NULL, tok + c[i].q_len, seqs + 1, stage);
            int ok1 = in.intra ? in.p_kv + in.p_act - (mkv + c[i].kv_chunks + a1) >= in.theta
                               : in.p_kv - (mkv + c[i].kv_chunks) >= in.theta && in.p_act - a1 >= 0;
            if (ok1 && (!c[i].needs_slot || slots > 0)) {
                ck_assert_int_eq(off[i], 0);
                mkv += c[i].kv_chunks;
                mact = a1;
                slots -= c[i].needs_slot;
            } else if (in.phase == KVB_EE_PREFILL && c[i].kv_chunks <= pb &&
                       (in.intra ? in.p_kv + in.p_act - (mkv + act4(NULL, tok + c[i].q_len, seqs + 1, stage + c[i].stage_bytes)) >= in.theta
                                 : in.p_kv - mkv >= in.theta &&
                                       in.p_act - act4(NULL, tok + c[i].q_len, seqs + 1, stage + c[i].stage_bytes) >= 0)) {
                ck_assert_int_eq(off[i], 1);
                stage += c[i].stage_bytes;
                mact = act4(NULL, tok + c[i].q_len, seqs + 1, stage);
                pb -= c[i].kv_chunks;
            } else {
                break;
            }
            tok += c[i].q_len;
            seqs++;
            nb++;
        }
        ck_assert_int_eq(o.n_batch, nb);
        ck_assert_int_eq(o.m_kv, mkv);
        ck_assert_int_eq(o.m_act, mact);
        ck_assert_int_eq(o.buf_used, in.buf_avail - pb);
        /* what the batch takes never exceeds what it may use, and the balloon only moves spare chunks */
        if (in.intra) {
            ck_assert_int_ge(in.p_kv + in.p_act - o.m_kv - o.m_act, nb ? in.theta : -1000);
            if (o.inflate > 0) ck_assert_int_le(o.inflate, in.p_act - o.m_act);
            if (o.inflate < 0) ck_assert_int_le(-o.inflate, in.p_kv - o.m_kv);
            ck_assert_int_ge(in.p_kv + (o.inflate > 0 ? o.inflate : 0), nb ? o.m_kv : 0);
        }
    }
}
KVB_TEST_END

/* ================================================================ Algorithm 2 */

KVB_TEST(alg2_scaling) {
    /* TTFT grows by α up to B_max (the paper's line 4 bound read as B_max) */
    ck_assert_int_eq(kvb_ee_buffer_scale(1, 1, 0, 100, 2), 2);
    ck_assert_int_eq(kvb_ee_buffer_scale(2, 1, 0, 100, 2), 4);
    ck_assert_int_eq(kvb_ee_buffer_scale(64, 1, 0, 100, 2), 100);
    ck_assert_int_eq(kvb_ee_buffer_scale(100, 1, 0, 100, 2), 100);
    /* TPOT shrinks by α down to 1, and wins when both fire */
    ck_assert_int_eq(kvb_ee_buffer_scale(100, 0, 1, 100, 2), 50);
    ck_assert_int_eq(kvb_ee_buffer_scale(3, 0, 1, 100, 2), 1);
    ck_assert_int_eq(kvb_ee_buffer_scale(1, 0, 1, 100, 2), 1);
    ck_assert_int_eq(kvb_ee_buffer_scale(8, 1, 1, 100, 2), 4);
    ck_assert_int_eq(kvb_ee_buffer_scale(8, 0, 0, 100, 2), 8);
    /* no overflow near the top */
    ck_assert_int_eq(kvb_ee_buffer_scale(INT64_MAX / 2 + 1, 1, 0, INT64_MAX, 2), INT64_MAX);
    /* P_B = max(0, B_logic - offloaded): shrinking below what is offloaded blocks new offloads but evicts nothing */
    ck_assert_int_eq(kvb_ee_buffer_avail(8, 3), 5);
    ck_assert_int_eq(kvb_ee_buffer_avail(2, 3), 0);
}
KVB_TEST_END

KVB_TEST(alg2_window_3_in_5) {
    kvb_ee_window w;
    ck_assert_int_eq(kvb_ee_window_init(&w, 5, 3), KVB_OK);
    int et, ep;
    kvb_ee_window_push(&w, 1, 0, &et, &ep);
    ck_assert(!et && !ep);
    kvb_ee_window_push(&w, 0, 0, &et, &ep);
    kvb_ee_window_push(&w, 1, 0, &et, &ep);
    ck_assert(!et);
    kvb_ee_window_push(&w, 0, 0, &et, &ep);
    kvb_ee_window_push(&w, 1, 0, &et, &ep); /* third miss in iterations 1..5 */
    ck_assert(et && !ep);
    kvb_ee_window_push(&w, 0, 0, &et, &ep); /* restarted: no second event from the same misses */
    ck_assert(!et);
    /* misses spread over 6 iterations: the first has left the window when the third comes */
    ck_assert_int_eq(kvb_ee_window_init(&w, 5, 3), KVB_OK);
    int seq[8] = {1, 0, 0, 0, 0, 1, 0, 1};
    for (int i = 0; i < 8; i++) {
        kvb_ee_window_push(&w, 0, seq[i], &et, &ep);
        ck_assert(!ep);
    }
    kvb_ee_window_push(&w, 0, 1, &et, &ep); /* 1, 1, 1 within iterations 6..9 */
    ck_assert(ep);
    /* many misses in one iteration are an event at once */
    kvb_ee_window_push(&w, 4, 0, &et, &ep);
    ck_assert(et);
    ck_assert_int_eq(kvb_ee_window_init(&w, 0, 3), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_ee_window_init(&w, 5, 0), KVB_ERR_INVALID);
}
KVB_TEST_END



/* ================================================================ real mappings (host backend) */

/* Reserve, map, unmap (the range stays reserved), remap, one chunk at two addresses: through the
 * unified pool over mem.h's host backend, with the mapper thread. */
KVB_TEST(host_mapping_semantics) {
    kvb_mem *m = NULL;
    ck_assert_int_eq(kvb_mem_create("host", -1, &m), KVB_OK);
    size_t C;
    ck_assert_int_eq(kvb_mem_granularity(m, &C), KVB_OK);
    kvb_elastic_vm *vm = NULL;
    ck_assert_int_eq(kvb_elastic_vm_create(m, C, 4, 1, &vm), KVB_OK);
    kvb_vm_ops ops = kvb_elastic_vm_ops(vm);
    kvb_epool *p = NULL;
    ck_assert_int_eq(kvb_epool_create(4, C, 1, &ops, &p), KVB_OK);
    int32_t a, b;
    ck_assert_int_eq(kvb_epool_reserve(p, 3, &a), KVB_OK);
    ck_assert_int_eq(kvb_epool_reserve(p, 3, &b), KVB_OK);
    unsigned char *pa = (unsigned char *)kvb_epool_base(p, a), *pb = (unsigned char *)kvb_epool_base(p, b);
    ck_assert_ptr_eq(kvb_elastic_vm_addr(vm, a, C), pa + C);
    /* map and write */
    ck_assert_int_eq(kvb_epool_map_free(p, KVB_EPOOL_KV, a, 1, NULL), KVB_OK);
    memset(pa + C, 0x11, C);
    /* the same chunk at a second address (mapped there first, the old place unmapped after: a move)
     * reads the bytes written through the first */
    ck_assert_int_eq(kvb_epool_move(p, a, 1, b, 2, KVB_EPOOL_ACT), KVB_OK);
    ck_assert_int_eq(kvb_elastic_vm_drain(vm), KVB_OK);
    for (size_t i = 0; i < C; i += 97) ck_assert_uint_eq(pb[2 * C + i], 0x11);
    /* the old place is unmapped but still reserved: touching it faults, and nothing else lives there */
    pid_t pid = fork();
    if (pid == 0) {
        signal(SIGSEGV, SIG_DFL); /* a sanitizer's handler would report and exit instead */
        volatile unsigned char x = pa[C];
        (void)x;
        _exit(0);
    }
    int status = 0;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    /* it faulted: killed by SIGSEGV (or, where a sanitizer kept its handler, exited with its report) */
    ck_assert_msg((WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV) || (WIFEXITED(status) && WEXITSTATUS(status)),
                  "unmapped place readable: %d", status);
    /* remap: a fresh chunk at the old place is a different chunk (its own bytes) */
    ck_assert_int_eq(kvb_epool_map_free(p, KVB_EPOOL_KV, a, 1, NULL), KVB_OK);
    memset(pa + C, 0x22, 16);
    ck_assert_uint_eq(pb[2 * C], 0x11);
    ck_assert_int_eq(kvb_epool_check(p), KVB_OK);
    /* both mappings of one chunk while a move is in flight: map it at a second place of b by hand
     * through the ops (the pool never does this outside a move) */
    int32_t c2 = kvb_epool_chunk_at(p, b, 2);
    ck_assert_int_ge(c2, 0);
    ck_assert_int_eq(ops.map(ops.ctx, b, 0, c2), KVB_OK);
    pb[0] = 0x33;
    ck_assert_uint_eq(pb[2 * C], 0x33);
    ck_assert_int_eq(ops.unmap(ops.ctx, b, 0), KVB_OK);
    ck_assert_int_eq(kvb_elastic_vm_drain(vm), KVB_OK);
    ck_assert_uint_eq(pb[2 * C], 0x33); /* still mapped at its place */
    kvb_epool_stats es;
    kvb_epool_get_stats(p, &es);
    kvb_epool_destroy(p);
    kvb_elastic_vm_stats vs;
    kvb_elastic_vm_get_stats(vm, &vs);
    ck_assert_uint_eq(vs.sync_maps + vs.async_maps, es.maps + 1);
    ck_assert_uint_eq(vs.async_unmaps, es.unmaps + 1 + 2); /* every unmap went to the mapper (2 at destroy) */
    kvb_elastic_vm_destroy(vm);
    kvb_mem_vm_stats ms;
    kvb_mem_vm_stats_get(m, &ms);
    ck_assert_uint_eq(ms.calls[KVB_MEM_OP_MAP], es.maps + 1);
    ck_assert_uint_eq(ms.calls[KVB_MEM_OP_MAP], ms.calls[KVB_MEM_OP_UNMAP]);
    ck_assert_uint_eq(ms.calls[KVB_MEM_OP_RESERVE], 2);
    kvb_mem_destroy(m);
}
KVB_TEST_END

/* ================================================================ the core under random workloads */

/* The simulated model: a token's KV is 16 bytes (its request id and position, so that every read can
 * tell whose KV it is), 16 tokens per chunk; a step's activations are five buffers. */
#define SIM_KV_BYTES 16
#define SIM_CHUNK_TOKENS 16
#define SIM_CHUNK (SIM_KV_BYTES * SIM_CHUNK_TOKENS)
#define SIM_STAGE_PER_TOKEN 32

static void sim_act_sizes(int64_t n_tokens, int n_seqs, int64_t stage, size_t sizes[5]) {
    sizes[0] = (size_t)n_tokens * 8;
    sizes[1] = (size_t)n_tokens * 8;
    sizes[2] = (size_t)n_tokens * 16;
    sizes[3] = (size_t)n_seqs * 100;
    sizes[4] = (size_t)stage;
}

static int64_t sim_act(void *ud, int64_t n_tokens, int n_seqs, int64_t stage) {
    (void)ud;
    if (n_tokens == 0) return 0;
    size_t sizes[5];
    sim_act_sizes(n_tokens, n_seqs, stage, sizes);
    return kvb_act_span_chunks(sizes, stage ? 5 : 4, 64, SIM_CHUNK);
}

typedef struct sim_req {
    kvb_ee_req r;
    int max_tokens;
} sim_req;

typedef struct sim {
    fixture f;           /* only the mock is used; the core owns its pool */
    kvb_mem *mem;        /* real mappings: the host memory backend and the VM layer over it */
    size_t stride;       /* bytes between two tokens' KV in a slot: chunk bytes / tokens per chunk */
    kvb_elastic_vm *vm;
    kvb_ee_core *core;
    sim_req reqs[512];
    int n;
    uint64_t next_id;
    unsigned char *host; /* [buf_max][SIM_CHUNK] the CPU buffer */
    uint64_t finished;
} sim;

static void kv_stamp(unsigned char *p, uint64_t id, int t) {
    memcpy(p, &id, 8);
    int64_t tt = t;
    memcpy(p + 8, &tt, 8);
}

static int kv_is(const unsigned char *p, uint64_t id, int t) {
    uint64_t a;
    int64_t b;
    memcpy(&a, p, 8);
    memcpy(&b, p + 8, 8);
    return a == id && b == t;
}

/* The bytes at pool address `a`: a real pointer over mem.h, or through the mock's mapping. */
static unsigned char *sim_deref(sim *S, uintptr_t a) { return S->vm ? (unsigned char *)a : vm_mock_deref(&S->f.m, a); }

static unsigned char *slot_kv(sim *S, int slot, int t) {
    return sim_deref(S, kvb_slot_pool_base(kvb_ee_core_slots(S->core), slot) + (uintptr_t)t * S->stride);
}

/* Every request's KV reads back as its own, wherever it is (slot or CPU buffer). (Plain tests with
 * ck_abort_msg in the loops: check's assertions write to a file each time they pass.) */
static void sim_verify(sim *S) {
    for (int i = 0; i < S->n; i++) {
        const kvb_ee_req *r = &S->reqs[i].r;
        if (r->waiting) continue;
        int slot = kvb_ee_core_slot_of(S->core, r->id);
        const int32_t *host;
        int nh = kvb_ee_core_host_chunks(S->core, r->id, &host);
        for (int t = 0; t < r->n_computed; t++) {
            const unsigned char *p = NULL;
            if (slot >= 0) p = slot_kv(S, slot, t);
            else if (nh > t / SIM_CHUNK_TOKENS)
                p = S->host + (size_t)host[t / SIM_CHUNK_TOKENS] * SIM_CHUNK + (size_t)(t % SIM_CHUNK_TOKENS) * SIM_KV_BYTES;
            if (!p || !kv_is(p, r->id, t))
                ck_abort_msg("request %llu token %d: KV %s", (unsigned long long)r->id, t, p ? "overwritten" : "missing");
        }
    }
}

static sim_req *sim_find(sim *S, uint64_t id) {
    for (int i = 0; i < S->n; i++)
        if (S->reqs[i].r.id == id) return &S->reqs[i];
    return NULL;
}

/* One iteration of the engine the core plans for. Returns the tokens computed. */
static int sim_step(sim *S, uint64_t now, kvb_ee_step *st) {
    kvb_ee_req view[512];
    for (int i = 0; i < S->n; i++) view[i] = S->reqs[i].r;
    if (kvb_ee_core_sync(S->core, view, S->n, now) != KVB_OK || kvb_ee_core_plan(S->core, st) != KVB_OK ||
        kvb_ee_core_apply(S->core, st) != KVB_OK || kvb_ee_core_check(S->core) != KVB_OK)
        ck_abort_msg("sync, plan, apply or the books failed");
    /* speculative pre-mapping for the next decode, on the mapper thread while the step runs */
    if (S->vm) kvb_elastic_vm_async(S->vm, 1);
    kvb_ee_core_premap(S->core, st);
    if (S->vm) kvb_elastic_vm_async(S->vm, 0);
    /* the step's activations, from the pool */
    int seqs = 0;
    int64_t stage = 0;
    for (int i = 0; i < st->n_items; i++) {
        seqs += st->items[i].action != KVB_EE_DO_PREEMPT;
        if (st->items[i].action == KVB_EE_DO_OFFLOAD) stage += (int64_t)st->items[i].q_len * SIM_STAGE_PER_TOKEN;
    }
    size_t sizes[5];
    uintptr_t bufs[5];
    int nb = 0;
    if (st->n_tokens > 0) {
        sim_act_sizes(st->n_tokens, seqs, stage, sizes);
        nb = stage ? 5 : 4;
        for (int b = 0; b < nb; b++) {
            if (kvb_ee_core_act_alloc(S->core, sizes[b], &bufs[b]) != KVB_OK) ck_abort_msg("activation %d", b);
            unsigned char *p = sim_deref(S, bufs[b] + sizes[b] - 1), *p0 = sim_deref(S, bufs[b]);
            if (!p || !p0) ck_abort_msg("activation buffer %d not mapped", b);
            *p0 = *p = 0x5a;
        }
    }
    /* what the executor does: preemptions, fetches, KV writes (the slot, or the CPU buffer) */
    for (int i = 0; i < st->n_items; i++) {
        const kvb_ee_item *it = &st->items[i];
        sim_req *q = sim_find(S, it->id);
        if (!q || (it->action != KVB_EE_DO_PREEMPT && it->kv_before != q->r.n_computed))
            ck_abort_msg("item for request %llu does not match the engine", (unsigned long long)it->id);
        if (it->action == KVB_EE_DO_PREEMPT) {
            q->r.waiting = 1;
            q->r.n_computed = 0;
            continue;
        }
        if (it->action == KVB_EE_DO_FETCH) {
            const int32_t *host;
            int nh = kvb_ee_core_host_chunks(S->core, it->id, &host);
            if (nh != KVB_DIV_CEIL(q->r.n_computed, SIM_CHUNK_TOKENS)) ck_abort_msg("fetch without its buffer chunks");
            for (int t = 0; t < q->r.n_computed; t++)
                memcpy(slot_kv(S, it->slot, t),
                       S->host + (size_t)host[t / SIM_CHUNK_TOKENS] * SIM_CHUNK + (size_t)(t % SIM_CHUNK_TOKENS) * SIM_KV_BYTES,
                       SIM_KV_BYTES);
        }
        for (int t = it->kv_before; t < it->kv_before + it->q_len; t++) {
            unsigned char *p;
            if (it->action == KVB_EE_DO_OFFLOAD) {
                const int32_t *host;
                kvb_ee_core_host_chunks(S->core, it->id, &host);
                p = S->host + (size_t)host[t / SIM_CHUNK_TOKENS] * SIM_CHUNK + (size_t)(t % SIM_CHUNK_TOKENS) * SIM_KV_BYTES;
            } else {
                p = slot_kv(S, it->slot, t);
            }
            if (!p) ck_abort_msg("request %llu token %d: no memory behind its KV", (unsigned long long)it->id, t);
            kv_stamp(p, it->id, t);
        }
    }
    for (int b = 0; b < nb; b++) kvb_ee_core_act_free(S->core, bufs[b]);
    if (kvb_ee_core_done(S->core, st) != KVB_OK) ck_abort_msg("done failed");
    if (S->vm) {
        /* the step is over: unmaps may go; pre-maps run on the mapper meanwhile */
        kvb_elastic_vm_set_ticket(S->vm, 0);
        if (kvb_elastic_vm_drain(S->vm) != KVB_OK) ck_abort_msg("a queued map or unmap failed");
    }
    /* progress and sampling */
    for (int i = 0; i < st->n_items; i++) {
        const kvb_ee_item *it = &st->items[i];
        if (it->action == KVB_EE_DO_PREEMPT) continue;
        sim_req *q = sim_find(S, it->id);
        q->r.waiting = 0;
        q->r.n_computed += it->q_len;
        if (q->r.n_computed == q->r.n_tokens) {
            q->r.n_tokens++;
            q->r.n_generated++;
        }
    }
    for (int i = 0; i < S->n;) {
        if (S->reqs[i].r.n_generated >= S->reqs[i].max_tokens) {
            S->reqs[i] = S->reqs[--S->n];
            S->finished++;
        } else {
            i++;
        }
    }
    if (kvb_ee_core_check(S->core) != KVB_OK) ck_abort_msg("the books after the step");
    sim_verify(S);
    return st->n_tokens;
}

/* Runs `n_req` random requests through the core with the given switches; every iteration checks the
 * books, the KV of every request, and that something progresses until all have finished. */
static void run_sim_on(int real, kvb_ee_mode mode, int intra, int inter, int premap, double slo, unsigned seed) {
    srand(seed);
    sim *S = calloc(1, sizeof *S);
    ck_assert_ptr_nonnull(S);
    const int n_chunks = 96, slot_chunks = 12; /* 192 tokens per request at most */
    kvb_ee_config c = {
        .mode = mode,
        .chunk_bytes = SIM_CHUNK,
        .chunk_tokens = SIM_CHUNK_TOKENS,
        .n_chunks = n_chunks,
        .n_slots = 10,
        .slot_chunks = slot_chunks,
        .act_seg_chunks = 64,
        .act_align = 64,
        .act = sim_act,
        .stage_bytes_per_token = SIM_STAGE_PER_TOKEN,
        .max_tokens = mode == KVB_EE_MODE_CHUNKED ? 64 : slot_chunks * SIM_CHUNK_TOKENS,
        .max_seqs = 16,
        .theta = 2,
        .intra = intra,
        .inter = inter,
        .buf_max = inter ? 40 : 0,
        .buf_start = 1,
        .alpha = 2,
        .win_iters = 5,
        .win_misses = 3,
        .slo_ttft_s = slo,
        .slo_tpot_s = slo,
        .premap = premap,
        .premap_max = 4,
    };
    c.act_chunks_start = (int)sim_act(NULL, c.max_tokens, KVB_MIN(c.max_seqs, c.max_tokens), 0);
    vm_mock_init(&S->f.m, n_chunks, SIM_CHUNK, &S->f.ops);
    S->stride = SIM_KV_BYTES;
    if (real) { /* the host backend: memfd chunks of one page, mapped by the mapper thread */
        size_t gran;
        ck_assert_int_eq(kvb_mem_create("host", -1, &S->mem), KVB_OK);
        ck_assert_int_eq(kvb_mem_granularity(S->mem, &gran), KVB_OK);
        c.chunk_bytes = gran; /* 16 tokens per chunk still: a token's KV every gran / 16 bytes */
        S->stride = gran / SIM_CHUNK_TOKENS;
        ck_assert_int_eq(kvb_elastic_vm_create(S->mem, gran, n_chunks, 1, &S->vm), KVB_OK);
        S->f.ops = kvb_elastic_vm_ops(S->vm);
    }
    ck_assert_int_eq(kvb_ee_core_create(&c, &S->f.ops, &S->core), KVB_OK);
    S->host = calloc(40, SIM_CHUNK);
    const int n_req = 120;
    int added = 0, idle = 0;
    uint64_t now = 1000000000ull;
    kvb_ee_step st = {0};
    for (int it = 0; it < 20000 && (added < n_req || S->n > 0); it++) {
        /* arrivals in bursts */
        if (added < n_req && rand() % 3 == 0) {
            int k = 1 + rand() % 6;
            for (int j = 0; j < k && added < n_req && S->n < 512; j++, added++) {
                sim_req *q = &S->reqs[S->n++];
                int len = 1 + rand() % (slot_chunks * SIM_CHUNK_TOKENS - 8);
                int out = 1 + rand() % KVB_MIN(40, slot_chunks * SIM_CHUNK_TOKENS - len);
                *q = (sim_req){.r = {.id = ++S->next_id, .t_arrival_ns = now, .n_tokens = len, .waiting = 1},
                               .max_tokens = out};
            }
        }
        now += 1000000 + (uint64_t)(rand() % 3000000);
        int tok = sim_step(S, now, &st);
        idle = (tok == 0 && S->n > 0) ? idle + 1 : 0;
        if (idle >= 3) ck_abort_msg("no progress with %d live requests (deadlock)", S->n);
    }
    ck_assert_int_eq(S->n, 0);
    ck_assert_uint_eq(S->finished, (uint64_t)n_req);
    ck_assert_int_eq(kvb_ee_core_sync(S->core, NULL, 0, now), KVB_OK); /* the last ones finished */
    kvb_ee_stats s;
    kvb_ee_core_get_stats(S->core, &s);
    fprintf(stderr,
            "sim mode %d intra %d inter %d premap %d slo %g seed %u: %llu iterations (%llu prefill), %llu preempted, "
            "%llu offloaded / %llu fetched, %llu inflated / %llu deflated, %llu premapped, %llu decode maps, largest "
            "batch %d, TTFT/TPOT events %llu/%llu\n",
            (int)mode, intra, inter, premap, slo, seed, (unsigned long long)s.iterations,
            (unsigned long long)s.prefill_iters, (unsigned long long)s.preemptions, (unsigned long long)s.offloads,
            (unsigned long long)s.fetches, (unsigned long long)s.inflated, (unsigned long long)s.deflated,
            (unsigned long long)s.premapped, (unsigned long long)s.decode_maps, s.max_batch,
            (unsigned long long)s.events_ttft, (unsigned long long)s.events_tpot);
    ck_assert_uint_eq(s.act_rescues, 0); /* Alg. 1's activation need was exact */
    if (intra && mode == KVB_EE_MODE_ELASTIC) ck_assert_uint_gt(s.inflated + s.deflated, 0);
    if (!intra) ck_assert_uint_eq(s.inflated + s.deflated, 0);
    if (inter && slo == 0) ck_assert_uint_gt(s.offloads, 0);
    ck_assert_uint_ge(s.offloads, s.fetches); /* a request of one token never decodes */
    if (!inter) ck_assert_uint_eq(s.offloads, 0);
    if (premap) ck_assert_uint_gt(s.premapped, 0);
    ck_assert_int_eq(s.buf_used, 0);
    /* with nothing live, every chunk is free, cached or idle: KV + act + free = P_T */
    kvb_epool *p = kvb_ee_core_epool(S->core);
    ck_assert_int_eq(kvb_epool_n_mapped(p, KVB_EPOOL_KV) + kvb_epool_n_mapped(p, KVB_EPOOL_ACT) +
                         kvb_epool_n_free(p, KVB_EPOOL_KV) + kvb_epool_n_free(p, KVB_EPOOL_ACT),
                     n_chunks);
    ck_assert_int_eq(kvb_slot_pool_n_needed(kvb_ee_core_slots(S->core)), 0);
    kvb_ee_step_free(&st);
    kvb_ee_core_destroy(S->core);
    if (S->vm) {
        kvb_elastic_vm_stats vs;
        kvb_elastic_vm_get_stats(S->vm, &vs);
        if (premap) ck_assert_uint_gt(vs.async_maps, 0);
        ck_assert_uint_gt(vs.async_unmaps, 0);
        kvb_elastic_vm_destroy(S->vm);
        kvb_mem_vm_stats ms;
        kvb_mem_vm_stats_get(S->mem, &ms);
        ck_assert_uint_eq(ms.calls[KVB_MEM_OP_MAP], ms.calls[KVB_MEM_OP_UNMAP]); /* everything unmapped */
        ck_assert_uint_eq(ms.calls[KVB_MEM_OP_MAP], vs.sync_maps + vs.async_maps);
        kvb_mem_destroy(S->mem);
    }
    ck_assert_int_eq(S->f.m.errors, 0);
    ck_assert_int_eq(vm_mock_n_mapped(&S->f.m), 0);
    ck_assert_int_le(S->f.m.max_places, 2);
    vm_mock_free(&S->f.m);
    free(S->host);
    free(S);
}

static void run_sim(kvb_ee_mode mode, int intra, int inter, int premap, double slo, unsigned seed) {
    run_sim_on(0, mode, intra, inter, premap, slo, seed);
}

/* The same workload over real mappings (memfd chunks, reservations, the mapper thread): KV written
 * through one mapping survives every remap. */
KVB_TEST(core_random_real_mappings) {
    run_sim_on(1, KVB_EE_MODE_ELASTIC, 1, 1, 1, 0, 11);
    run_sim_on(1, KVB_EE_MODE_CHUNKED, 0, 0, 1, 0, 12);
}
KVB_TEST_END

KVB_TEST(core_random_elastic) {
    for (unsigned seed = 1; seed <= 4; seed++) run_sim(KVB_EE_MODE_ELASTIC, 1, 1, 1, 0, seed);
}
KVB_TEST_END

KVB_TEST(core_random_ablations) {
    for (unsigned seed = 1; seed <= 2; seed++) {
        run_sim(KVB_EE_MODE_ELASTIC, 1, 0, 1, 0, seed);  /* intra only */
        run_sim(KVB_EE_MODE_ELASTIC, 0, 1, 0, 0, seed);  /* inter only */
        run_sim(KVB_EE_MODE_ELASTIC, 0, 0, 0, 0, seed);  /* static split */
        run_sim(KVB_EE_MODE_ELASTIC, 1, 1, 0, 0.004, seed); /* Alg. 2 with tight SLOs */
    }
}
KVB_TEST_END

KVB_TEST(core_random_chunked) {
    for (unsigned seed = 1; seed <= 3; seed++) run_sim(KVB_EE_MODE_CHUNKED, 0, 0, 1, 0, seed);
}
KVB_TEST_END

/* ================================================================ the planners in the engine */

#define LR 10   /* requests */
#define LT 40   /* tokens each generates */

typedef struct lrec {
    int32_t toks[LR][LT];
    int n[LR];
    int finished;
} lrec;

static void l_on_token(void *ud, uint64_t id, int index, int32_t tok, uint64_t t_ns) {
    (void)t_ns;
    lrec *r = ud;
    if (id >= LR || index != r->n[id] || index >= LT) ck_abort_msg("token %d of request %llu out of order", index, (unsigned long long)id);
    r->toks[id][r->n[id]++] = tok;
}

static void l_on_finish(void *ud, uint64_t id, kvb_finish why, kvb_status err) {
    (void)id, (void)err;
    lrec *r = ud;
    if (why != KVB_FINISH_LENGTH) ck_abort_msg("request %llu finished with %s", (unsigned long long)id, kvb_finish_str(why));
    r->finished++;
}

static int32_t LP[LR][256];
static int LPL[LR];

/* Runs the LR prompts through `policy` (params "k=v,k=v" or NULL) on an engine of max_seqs 16; the
 * planner's report goes to *rep when it is one of eLLM's. Requests 6.. arrive after 8 steps. */
static void l_run(kvb_model *m, const char *policy, const char *params, lrec *out, kvb_ee_report *rep) {
    memset(out, 0, sizeof *out);
    kvb_policy_params pp = {0};
    if (params) {
        char buf[512];
        snprintf(buf, sizeof buf, "%s", params);
        for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) ck_assert_int_eq(kvb_policy_params_add(&pp, tok), KVB_OK);
    }
    kvb_planner pl;
    ck_assert_int_eq(kvb_policy_create(policy, &pp, &pl), KVB_OK);
    kvb_policy_params_free(&pp);
    kvb_planner keep = pl;
    kvb_engine_opts o;
    kvb_engine_opts_default(&o);
    o.block_size = 16;
    o.n_blocks = 200;
    o.max_seqs = 16;
    o.enable_prefix_cache = 0;
    kvb_engine_events ev = {.ud = out, .on_token = l_on_token, .on_finish = l_on_finish};
    kvb_engine *e = NULL;
    ck_assert_int_eq(kvb_engine_create(m, &o, &pl, &ev, &e), KVB_OK);
    for (int r = 0; r < LR; r++) {
        if (r == 6)
            for (int i = 0; i < 8; i++) ck_assert_msg(kvb_engine_step(e) == KVB_OK, "step: %s", kvb_engine_last_error(e));
        kvb_request q = {.id = (uint64_t)r, .prompt = LP[r], .n_prompt = LPL[r], .max_tokens = LT};
        ck_assert_int_eq(kvb_engine_add(e, &q), KVB_OK);
    }
    for (int i = 0; i < 20000 && kvb_engine_n_live(e) > 0; i++)
        ck_assert_msg(kvb_engine_step(e) == KVB_OK, "step: %s", kvb_engine_last_error(e));
    ck_assert_int_eq(kvb_engine_n_live(e), 0);
    ck_assert_int_eq(out->finished, LR);
    if (rep) ck_assert(kvb_ee_planner_report(&keep, rep));
    kvb_engine_destroy(e);
}

static void l_same(const lrec *a, const lrec *b, const char *what) {
    for (int r = 0; r < LR; r++) {
        ck_assert_int_eq(a->n[r], b->n[r]);
        for (int i = 0; i < a->n[r]; i++)
            if (a->toks[r][i] != b->toks[r][i])
                ck_abort_msg("%s: request %d token %d: %d vs %d", what, r, i, a->toks[r][i], b->toks[r][i]);
    }
}

static void l_print(const char *what, const kvb_ee_report *p) {
    fprintf(stderr,
            "%-34s P_T %d: %llu iterations (%llu prefill), largest decode batch %d, %llu preempted, inflated %llu / "
            "deflated %llu, offloaded %llu / fetched %llu, premapped %llu, maps %llu sync / %llu async, act now %d "
            "(start %d)\n",
            what, p->n_chunks, (unsigned long long)p->core.iterations, (unsigned long long)p->core.prefill_iters,
            p->core.max_batch, (unsigned long long)p->core.preemptions, (unsigned long long)p->core.inflated,
            (unsigned long long)p->core.deflated, (unsigned long long)p->core.offloads,
            (unsigned long long)p->core.fetches, (unsigned long long)p->core.premapped,
            (unsigned long long)p->sync_maps, (unsigned long long)p->async_maps, p->act_owned, p->act_start);
}

/* Greedy tokens under ellm-elastic (inflation, deflation, preemption, offload to the CPU buffer and
 * fetch), its ablations and both baselines equal the plain engine's, on a budget too small for everyone
 * at once. */
KVB_TEST(planners_lossless_under_pressure) {
    kvb_t_model tm;
    kvb_t_model_make(&tm, "--arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 --vocab 200 --max-pos 256 --seed 3");
    for (int r = 0; r < LR; r++) {
        LPL[r] = r % 3 == 0 ? 150 + 7 * r : 10 + 9 * r;
        for (int i = 0; i < LPL[r]; i++) LP[r][i] = (i * 17 + r * 31 + 5) % 200;
    }
    static lrec ref, got;
    l_run(tm.m, "recompute", NULL, &ref, NULL);
    static const struct {
        const char *policy, *params;
    } runs[] = {
        {"ellm-elastic", "budget_mb=1"},
        {"ellm-elastic", "budget_mb=1,intra=0"},
        {"ellm-elastic", "budget_mb=1,premap=0,mapper=0"},
        {"static-split", "budget_mb=1"},
        {"static-split-chunked", "budget_mb=1,prefill_chunk=64"},
        {"ellm-elastic", "budget_mb=1,slots=3"},
    };
    kvb_ee_report rep[KVB_ARRAY_LEN(runs)];
    for (size_t k = 0; k < KVB_ARRAY_LEN(runs); k++) {
        l_run(tm.m, runs[k].policy, runs[k].params, &got, &rep[k]);
        char what[96];
        snprintf(what, sizeof what, "%s %s", runs[k].policy, runs[k].params);
        l_print(what, &rep[k]);
        l_same(&ref, &got, what);
        /* the forward pass took its buffers from the activation pool, exactly as Alg. 1 counted them */
        ck_assert_uint_eq(rep[k].core.act_rescues, 0);
    }
    /* the scenario exercised what it is about */
    ck_assert_uint_gt(rep[0].core.inflated, 0);
    ck_assert_uint_gt(rep[0].core.deflated, 0);
    ck_assert_uint_gt(rep[0].core.premapped, 0);
    ck_assert_uint_gt(rep[0].async_maps, 0);
    ck_assert_uint_eq(rep[1].core.inflated + rep[1].core.deflated, 0);
    ck_assert_uint_eq(rep[2].async_maps, 0);
    /* the CPU buffer (§4.3.2): prefills offloaded to the host tier and fetched back for their decode, with
     * the activations' staging counted exactly (no rescue above), in the inter-only ablation and in eLLM
     * with fewer slots than requests */
    ck_assert_uint_gt(rep[1].core.offloads, 0);
    ck_assert_uint_gt(rep[1].core.fetches, 0);
    ck_assert_uint_gt(rep[5].core.offloads, 0);
    ck_assert_uint_gt(rep[5].core.fetches, 0);
    ck_assert_uint_eq(rep[3].core.offloads + rep[4].core.offloads, 0);
    /* KV borrowed from the activations: larger decode batches than the static split */
    ck_assert_int_gt(rep[0].core.max_batch, rep[3].core.max_batch);
    kvb_t_model_free(&tm);
}
KVB_TEST_END

KVB_TEST_MAIN("ellm_elastic", KVB_T(epool_books, 10), KVB_T(epool_failed_call_changes_nothing, 10),
              KVB_T(act_pool_best_fit_coalesce, 10), KVB_T(act_pool_gc_only_idle_chunks, 10),
              KVB_T(slot_pool_best_fit_reuse, 10), KVB_T(slot_pool_reclaim_lru_and_excess, 10),
              KVB_T(alg1_fcfs_break, 10), KVB_T(alg1_offload_branch, 10), KVB_T(alg1_balloon_sign_and_bounds, 10),
              KVB_T(alg1_random_against_pseudocode, 30), KVB_T(alg2_scaling, 10), KVB_T(alg2_window_3_in_5, 10),
              KVB_T(core_random_elastic, 60), KVB_T(core_random_ablations, 60), KVB_T(core_random_chunked, 60),
              KVB_T(core_random_real_mappings, 60), KVB_T(host_mapping_semantics, 20),
              KVB_T(planners_lossless_under_pressure, 240))
