/* Unit tests of eLLM elastic memory's pure parts (ellm-elastic-memory.txt §4): the unified chunk pool,
 * the activation pool (BFC), the KV slot pool, Algorithm 1, the ballooning amount, Algorithm 2 and its
 * violation window, and the accounting under random workloads. The virtual-memory calls go to a
 * recording stand-in (tests/vm_mock.h); real mappings are tested over common/mem/mem.h. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv/slot_pool.h"
#include "common/mem/act_pool.h"
#include "common/mem/elastic_pool.h"
#include "common/policy/ellm_elastic_alg.h"
#include "tests/harness.h"
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
    ck_assert_int_eq(kvb_epool_create(n, n_act, &f->ops, &f->p), KVB_OK);
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
    ck_assert_int_eq(kvb_epool_create(0, 0, &f.ops, &q), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_epool_create(4, 5, &f.ops, &q), KVB_ERR_INVALID);
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
    ck_assert_int_eq(kvb_act_pool_create(p, CH, 8, 64, &a), KVB_OK);
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
    ck_assert_int_eq(kvb_act_pool_create(p, CH, 8, 64, &a), KVB_OK);
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
    ck_assert_int_eq(kvb_act_pool_create(p, CH, 8, 64, &a), KVB_OK);
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
        ck_assert_int_eq(kvb_slot_pool_map(sp, s[i], sizes[i], 0), KVB_OK);
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
    ck_assert_int_eq(kvb_slot_pool_map(sp, t, 3, 0), KVB_OK);
    ck_assert_int_eq(m->calls, calls); /* a cached slot: no map call */
    /* need 7: none covers; the cached slot with the most mapped (5) is extended by 2 */
    int u;
    ck_assert_int_eq(kvb_slot_pool_acquire(sp, 7, &u), KVB_OK);
    ck_assert_int_eq(u, s[0]);
    ck_assert_int_eq(kvb_slot_pool_map(sp, u, 7, 0), KVB_OK);
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
    ck_assert_int_eq(kvb_slot_pool_map(sp, a, 3, 0), KVB_OK);
    ck_assert_int_eq(kvb_slot_pool_acquire(sp, 3, &b), KVB_OK);
    ck_assert_int_eq(kvb_slot_pool_map(sp, b, 4, 0), KVB_OK); /* one pre-mapped (excess) chunk */
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
    ck_assert_int_eq(kvb_slot_pool_map(sp, e, 8, 0), KVB_ERR_EXHAUSTED); /* 3 + 1 free: 4 of 8 */
    ck_assert_int_eq(kvb_slot_pool_n_mapped(sp, e), 4);
    kvb_slot_pool_set_need(sp, e, 4);
    ck_assert_int_eq(kvb_slot_pool_map(sp, e, 5, 1), KVB_OK); /* b's excess chunk moves */
    ck_assert_int_eq(kvb_slot_pool_n_mapped(sp, b), 3);
    ck_assert_int_eq(kvb_slot_pool_map(sp, e, 6, 1), KVB_ERR_EXHAUSTED); /* nothing reclaimable left */
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

KVB_TEST_MAIN("ellm_elastic", KVB_T(epool_books, 10), KVB_T(epool_failed_call_changes_nothing, 10),
              KVB_T(act_pool_best_fit_coalesce, 10), KVB_T(act_pool_gc_only_idle_chunks, 10),
              KVB_T(slot_pool_best_fit_reuse, 10), KVB_T(slot_pool_reclaim_lru_and_excess, 10),
              KVB_T(alg1_fcfs_break, 10), KVB_T(alg1_offload_branch, 10), KVB_T(alg1_balloon_sign_and_bounds, 10),
              KVB_T(alg1_random_against_pseudocode, 30), KVB_T(alg2_scaling, 10), KVB_T(alg2_window_3_in_5, 10))
