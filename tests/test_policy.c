/* Unit tests of the SwiftCache rules: MEU (Eq. 6-9), Alg. 1 and its window, LSC/RC sizing (Eq. 1-5)
 * including the worked example of §3.2. */
#include "common/kv/block_pool.h"
#include "common/policy/swiftcache.h"
#include "tests/harness.h"

KVB_TEST(paper_example_lsc_rc) {
    /* §3.2: L = 10, K_master = 100 single-layer blocks, K_1 = 9 and K_2 = 8 full-layer blocks:
     * N_LSC = 17, N_RC = floor(83 / 10) = 8, 25 blocks in all against 10 without LSC. */
    kvb_kv_geom m = {.n_layers = 10, .n_kv_heads = 2, .head_dim = 4, .block_size = 16, .elem_size = 2};
    uint64_t mb = kvb_kv_layer_bytes(&m); /* Eq. 1 = 2 * 16 * 2 * 4 * 2 = 512 */
    ck_assert_uint_eq(mb, 512);
    uint64_t c_master = 100 * mb + mb / 2; /* a partial block does not count */
    uint64_t workers[2] = {9 * mb * 10 + 7, 8 * mb * 10 + mb * 9};
    kvb_swift_plan p;
    ck_assert_int_eq(kvb_swift_plan_lsc(&m, c_master, workers, 2, &p), KVB_OK);
    ck_assert_int_eq(p.k_master, 100);
    ck_assert_int_eq(p.k_workers, 17);
    ck_assert_int_eq(p.n_lsc, 17);
    ck_assert_int_eq(p.n_rc, 8);
    ck_assert_int_eq(p.max_ctx_tokens, 25 * 16);
    ck_assert_int_eq(p.no_lending_tokens, 10 * 16);
    ck_assert_int_eq(p.inplace_tokens, 27 * 16);
    /* kvbank streams a block through two buffers: 17 blocks take 34 single-layer buffers = 4 full-layer
     * blocks of the budget, the regular cache keeps 10 - 4 = 6: (17 + 6) * 16 tokens (issue 10) */
    ck_assert_int_eq(p.n_stream, 17);
    ck_assert_int_eq(p.lsc_own_blocks, 4);
    ck_assert_int_eq(p.n_rc_stream, 6);
    ck_assert_int_eq(p.stream_tokens, 23 * 16);
    ck_assert_int_le(p.lsc_own_blocks * 10 + p.n_rc_stream * 10, p.k_master);
    /* workers hold more than the master: LSC takes all of the master's memory, no RC */
    uint64_t big[1] = {500 * mb * 10};
    ck_assert_int_eq(kvb_swift_plan_lsc(&m, c_master, big, 1, &p), KVB_OK);
    ck_assert_int_eq(p.n_lsc, 100);
    ck_assert_int_eq(p.n_rc, 0);
    /* in stream mode one full-layer block stays the pool's: (100 - 10) / 2 = 45 blocks streamed */
    ck_assert_int_eq(p.n_stream, 45);
    ck_assert_int_eq(p.lsc_own_blocks, 9);
    ck_assert_int_eq(p.n_rc_stream, 1);
    /* one layer (test_ops.sh's maxctx node: 1 MiB master, 1 MiB worker of the same geometry): a single-layer
     * block is a full block, so Eq. 4 gives N_LSC = K_master and Eq. 5 no RC: (N_LSC + N_RC) * B equals
     * the master alone (Eq. 1-5 gain at most L times); kvbank streams nothing (a streamed block would
     * cost two own blocks) */
    kvb_kv_geom one = {.n_layers = 1, .n_kv_heads = 2, .head_dim = 32, .block_size = 16, .elem_size = 4};
    uint64_t w1[1] = {1u << 20};
    ck_assert_int_eq(kvb_swift_plan_lsc(&one, 1u << 20, w1, 1, &p), KVB_OK);
    ck_assert_int_eq(p.k_master, 128);
    ck_assert_int_eq(p.k_workers, 128);
    ck_assert_int_eq(p.n_lsc, 128);
    ck_assert_int_eq(p.n_rc, 0);
    ck_assert_int_eq(p.max_ctx_tokens, p.no_lending_tokens);
    ck_assert_int_eq(p.inplace_tokens, 2 * p.no_lending_tokens);
    ck_assert_int_eq(p.n_stream, 0);
    ck_assert_int_eq(p.lsc_own_blocks, 0);
    ck_assert_int_eq(p.stream_tokens, p.no_lending_tokens);
    one.n_layers = 2; /* two layers: a streamed block costs one own block, no gain either */
    ck_assert_int_eq(kvb_swift_plan_lsc(&one, 1u << 20, w1, 1, &p), KVB_OK);
    ck_assert_int_eq(p.n_stream, 0);
    ck_assert_int_eq(p.stream_tokens, p.no_lending_tokens);
}
KVB_TEST_END

KVB_TEST(meu_lcm) {
    /* master block 2*L*B*H*D*es = 2*4*16*2*16*4 = 16384 bytes; worker 2*3*8*3*16*4 = 9216 bytes;
     * lcm = 147456: 9 master blocks = 16 worker blocks */
    kvb_kv_geom m = {.n_layers = 4, .n_kv_heads = 2, .head_dim = 16, .block_size = 16, .elem_size = 4};
    kvb_kv_geom w = {.n_layers = 3, .n_kv_heads = 3, .head_dim = 16, .block_size = 8, .elem_size = 4};
    kvb_meu u;
    ck_assert_int_eq(kvb_swift_meu(&m, &w, 0, &u), KVB_OK);
    ck_assert_uint_eq(u.lcm_bytes, 147456);
    ck_assert_uint_eq(u.meu_master, 9);
    ck_assert_uint_eq(u.meu_worker, 16);
    ck_assert_uint_eq(u.meu_master * kvb_kv_block_bytes(&m), u.meu_worker * kvb_kv_block_bytes(&w));
    /* identical geometries: 1 and 1 */
    ck_assert_int_eq(kvb_swift_meu(&m, &m, 0, &u), KVB_OK);
    ck_assert_uint_eq(u.meu_master, 1);
    ck_assert_uint_eq(u.meu_worker, 1);
    /* a cap on the unit */
    ck_assert_int_eq(kvb_swift_meu(&m, &w, 100000, &u), KVB_ERR_UNSUPPORTED);
    kvb_kv_geom bad = w;
    bad.head_dim = 0;
    ck_assert_int_eq(kvb_swift_meu(&m, &bad, 0, &u), KVB_ERR_INVALID);
}
KVB_TEST_END

KVB_TEST(alg1_scale_up_down) {
    int64_t dw, dm;
    /* worker holds 10 blocks of 16 tokens, MEU 4 (worker) / 3 (master) */
    kvb_swift_scale_up(10, 16, 4, 3, 160, &dw, &dm); /* need 10 <= 10: nothing */
    ck_assert_int_eq(dw, 0);
    ck_assert_int_eq(dm, 0);
    kvb_swift_scale_up(10, 16, 4, 3, 161, &dw, &dm); /* need 11: diff 1 -> one unit */
    ck_assert_int_eq(dw, 4);
    ck_assert_int_eq(dm, 3);
    kvb_swift_scale_up(10, 16, 4, 3, 16 * 19, &dw, &dm); /* need 19: diff 9 -> 3 units */
    ck_assert_int_eq(dw, 12);
    ck_assert_int_eq(dm, 9);
    kvb_swift_scale_down(10, 16, 4, 3, 160, &dw, &dm); /* max need 10 >= 10: nothing */
    ck_assert_int_eq(dw, 0);
    kvb_swift_scale_down(10, 16, 4, 3, 33, &dw, &dm); /* max need 3: diff 7 -> 1 unit */
    ck_assert_int_eq(dw, 4);
    ck_assert_int_eq(dm, 3);
    kvb_swift_scale_down(10, 16, 4, 3, 0, &dw, &dm); /* idle: diff 10 -> 2 units */
    ck_assert_int_eq(dw, 8);
    ck_assert_int_eq(dm, 6);
}
KVB_TEST_END

KVB_TEST(alg1_window) {
    kvb_swift_window w;
    ck_assert_int_eq(kvb_swift_window_init(&w, 60.0, 8), KVB_OK);
    ck_assert_int_eq(kvb_swift_window_max(&w, 0), 0);
    kvb_swift_window_add(&w, 0, 100);
    kvb_swift_window_add(&w, 10, 50);
    kvb_swift_window_add(&w, 20, 70);
    ck_assert_int_eq(kvb_swift_window_max(&w, 30), 100);
    ck_assert_int_eq(kvb_swift_window_max(&w, 60.5), 70); /* 100 left the window */
    ck_assert_int_eq(kvb_swift_window_max(&w, 80.5), 0);
    /* many samples: the maximum over the last window, checked against brute force */
    int64_t lens[500];
    for (int i = 0; i < 500; i++) {
        lens[i] = (i * 7919) % 1000;
        kvb_swift_window_add(&w, 100 + i, lens[i]);
        int64_t want = 0;
        for (int j = i; j >= 0 && 100 + j > 100 + i - 60; j--) want = lens[j] > want ? lens[j] : want;
        ck_assert_int_eq(kvb_swift_window_max(&w, 100 + i), want);
    }
    kvb_swift_window_free(&w);
}
KVB_TEST_END

KVB_TEST_MAIN("policy", KVB_T(paper_example_lsc_rc, 10), KVB_T(meu_lcm, 10), KVB_T(alg1_scale_up_down, 10),
              KVB_T(alg1_window, 10))
