/* Tests of lending inside one process (SwiftCache §3.2-3.5): pool segments and their id layout, the
 * prefix cache over segments, a worker shrinking and growing its own pool, a master serving from
 * borrowed blocks (in place and streamed through the layer stream cache), and detaching a loan while
 * sequences live on it (moving their KV, preempting them, or a dead lender).
 *
 * Borrowed memory is real POSIX shared memory imported by handle, as the master does; where a lender
 * dies it is a real forked process killed with SIGKILL. Every engine test compares the greedy tokens
 * with a plain engine over a big private pool (the lossless invariant), and poisons borrowed memory
 * after it is detached so that a stray read would change the tokens. */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/kv/block_pool.h"
#include "common/kv/prefix_cache.h"
#include "common/kv/prefix_cache_impl.h"
#include "common/mem/region.h"
#include "common/model/model.h"
#include "common/policy/policy.h"
#include "common/sched/engine.h"
#include "tests/harness.h"
#include "tests/testmodel.h"

#define MAXR 64
#define MAXT 160

/* ================================================================ pool segments (no model) */

static const kvb_kv_geom k_geom = {.n_layers = 2, .n_kv_heads = 1, .head_dim = 2, .block_size = 2, .elem_size = 4};

static int keep_block_5(void *ud, int32_t idx) { return idx == 5; }

KVB_TEST(pool_segments) {
    size_t bb = kvb_kv_block_bytes(&k_geom), lb = kvb_kv_layer_bytes(&k_geom);
    unsigned char *own = malloc(4 * bb), *a = malloc(3 * bb), *b = malloc(5 * bb), *c = malloc(2 * bb),
                  *d = malloc(4 * bb), *x = malloc(bb);
    kvb_block_pool *p = NULL;
    ck_assert_int_eq(kvb_block_pool_create(&k_geom, own, 4 * bb, 4, &p), KVB_OK);
    int32_t fa = -1, fb = -1, fc = -1, fd = -1, fx = -1, id;
    ck_assert_int_eq(kvb_block_pool_attach(p, NULL, 3, &fa), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_block_pool_attach(p, a, 0, &fa), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_block_pool_attach(p, a, 3, &fa), KVB_OK);
    ck_assert_int_eq(kvb_block_pool_attach(p, b, 5, &fb), KVB_OK);
    /* segments start at the own capacity and follow each other */
    ck_assert_int_eq(fa, 4);
    ck_assert_int_eq(fb, 7);
    ck_assert_int_eq(kvb_block_pool_capacity(p), 4);
    ck_assert_int_eq(kvb_block_pool_id_limit(p), 12);
    ck_assert_int_eq(kvb_block_pool_n_blocks(p), 12);
    ck_assert_int_eq(kvb_block_pool_n_own(p), 4);
    ck_assert_int_eq(kvb_block_pool_n_attached(p), 8);
    ck_assert_int_eq(kvb_block_pool_n_free(p), 12);
    ck_assert_ptr_eq(kvb_block_pool_block(p, 3), own + 3 * bb);
    ck_assert_ptr_eq(kvb_block_pool_block(p, 4), a);
    ck_assert_ptr_eq(kvb_block_pool_block_layer(p, 5, 1), a + bb + lb);
    ck_assert_ptr_eq(kvb_block_pool_block(p, 11), b + 4 * bb);
    ck_assert_int_eq(kvb_block_pool_has(p, 3), 1);
    ck_assert_int_eq(kvb_block_pool_has(p, 11), 1);
    ck_assert_int_eq(kvb_block_pool_has(p, 12), 0);
    ck_assert_int_eq(kvb_block_pool_has(p, -1), 0);
    ck_assert_int_eq(kvb_block_pool_is_attached(p, 3), 0);
    ck_assert_int_eq(kvb_block_pool_is_attached(p, 4), 1);
    /* lowest id first across own and attached blocks: own ones fill first */
    for (int32_t i = 0; i < 9; i++) {
        ck_assert_int_eq(kvb_block_pool_alloc(p, &id), KVB_OK);
        ck_assert_int_eq(id, i);
    }
    /* detach needs a segment, or the front of one, whose blocks are all free */
    ck_assert_int_eq(kvb_block_pool_detach(p, fa, 3), KVB_ERR_STATE);
    ck_assert_int_eq(kvb_block_pool_detach(p, fa, 2), KVB_ERR_STATE); /* the front, in use */
    ck_assert_int_eq(kvb_block_pool_detach(p, fa, 4), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_block_pool_detach(p, fa, 0), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_block_pool_detach(p, fa + 1, 3), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_block_pool_detach(p, 0, 4), KVB_ERR_INVALID); /* own blocks are no segment */
    kvb_block_pool_set_release_hook(p, keep_block_5, NULL);
    for (int32_t i = 4; i < 7; i++) kvb_block_pool_unref(p, i);
    ck_assert_int_eq(kvb_block_pool_detach(p, fa, 3), KVB_ERR_STATE); /* 5 is held by the hook */
    ck_assert_int_eq(kvb_block_pool_n_blocks(p), 12);                  /* a refused detach changes nothing */
    kvb_block_pool_free_block(p, 5);
    kvb_block_pool_set_release_hook(p, NULL, NULL);
    ck_assert_int_eq(kvb_block_pool_detach(p, fa, 3), KVB_OK);
    ck_assert_int_eq(kvb_block_pool_detach(p, fa, 3), KVB_ERR_INVALID); /* retired now */
    ck_assert_int_eq(kvb_block_pool_n_blocks(p), 9);
    ck_assert_int_eq(kvb_block_pool_id_limit(p), 12); /* a retired range in the middle stays */
    ck_assert_int_eq(kvb_block_pool_has(p, 4), 0);
    ck_assert_int_eq(kvb_block_pool_is_free(p, 4), 0);
    ck_assert_int_eq(kvb_block_pool_n_free(p), 3); /* 9, 10, 11 */
    /* own resizes do not touch segments */
    ck_assert_int_eq(kvb_block_pool_resize(p, 2), KVB_ERR_STATE);
    kvb_block_pool_unref(p, 2);
    kvb_block_pool_unref(p, 3);
    ck_assert_int_eq(kvb_block_pool_resize(p, 5), KVB_ERR_INVALID); /* beyond the own capacity */
    ck_assert_int_eq(kvb_block_pool_resize(p, 2), KVB_OK);
    ck_assert_int_eq(kvb_block_pool_n_blocks(p), 7);
    ck_assert_int_eq(kvb_block_pool_alloc(p, &id), KVB_OK);
    ck_assert_int_eq(id, 9);
    ck_assert_int_eq(kvb_block_pool_resize(p, 4), KVB_OK);
    ck_assert_int_eq(kvb_block_pool_alloc(p, &id), KVB_OK);
    ck_assert_int_eq(id, 2);
    /* first fit over retired ranges: C splits [4,7), D does not fit the rest and is appended, X takes
     * the rest */
    ck_assert_int_eq(kvb_block_pool_attach(p, c, 2, &fc), KVB_OK);
    ck_assert_int_eq(fc, 4);
    ck_assert_ptr_eq(kvb_block_pool_block(p, 5), c + bb);
    ck_assert_int_eq(kvb_block_pool_attach(p, d, 4, &fd), KVB_OK);
    ck_assert_int_eq(fd, 12);
    ck_assert_int_eq(kvb_block_pool_attach(p, x, 1, &fx), KVB_OK);
    ck_assert_int_eq(fx, 6);
    ck_assert_int_eq(kvb_block_pool_id_limit(p), 16);
    ck_assert_int_eq(kvb_block_pool_take(p, 13), KVB_OK); /* a specific free block */
    ck_assert_int_eq(kvb_block_pool_refcount(p, 13), 1);
    ck_assert_int_eq(kvb_block_pool_take(p, 13), KVB_ERR_STATE);
    ck_assert_int_eq(kvb_block_pool_take(p, 99), KVB_ERR_STATE);
    ck_assert_int_eq(kvb_block_pool_detach(p, fd, 4), KVB_ERR_STATE);
    kvb_block_pool_unref(p, 13);
    /* retire everything: neighbours merge and the top of the id space is trimmed */
    ck_assert_int_eq(kvb_block_pool_detach(p, fc, 2), KVB_OK);
    ck_assert_int_eq(kvb_block_pool_detach(p, fd, 4), KVB_OK);
    ck_assert_int_eq(kvb_block_pool_id_limit(p), 12);
    ck_assert_int_eq(kvb_block_pool_detach(p, fx, 1), KVB_OK); /* merges into [4,7) */
    kvb_block_pool_unref(p, 7);
    kvb_block_pool_unref(p, 8);
    kvb_block_pool_unref(p, 9);
    ck_assert_int_eq(kvb_block_pool_detach(p, fb, 5), KVB_OK);
    ck_assert_int_eq(kvb_block_pool_id_limit(p), 4);
    ck_assert_int_eq(kvb_block_pool_n_blocks(p), 4);
    ck_assert_int_eq(kvb_block_pool_n_attached(p), 0);
    /* a re-attach after a full retire starts at capacity again */
    ck_assert_int_eq(kvb_block_pool_attach(p, d, 4, &fd), KVB_OK);
    ck_assert_int_eq(fd, 4);
    /* partial reclaim: the front of a segment goes, the rest stays attached with its addresses */
    ck_assert_int_eq(kvb_block_pool_detach(p, fd, 1), KVB_OK);
    ck_assert_int_eq(kvb_block_pool_has(p, 4), 0);
    ck_assert_int_eq(kvb_block_pool_has(p, 5), 1);
    ck_assert_ptr_eq(kvb_block_pool_block(p, 5), d + bb);
    ck_assert_int_eq(kvb_block_pool_n_attached(p), 3);
    ck_assert_int_eq(kvb_block_pool_detach(p, fd, 3), KVB_ERR_INVALID); /* retired now */
    ck_assert_int_eq(kvb_block_pool_detach(p, fd + 1, 3), KVB_OK);
    ck_assert_int_eq(kvb_block_pool_id_limit(p), 4);
    ck_assert_int_eq(kvb_block_pool_attach(p, d, 4, &fd), KVB_OK);
    ck_assert_int_eq(fd, 4);
    ck_assert_int_eq(kvb_block_pool_detach(p, fd, 4), KVB_OK);

    /* the per-id tables grow past several bitmap levels and keep their state: own block 1 stays
     * allocated, 0 and 3 free */
    kvb_block_pool_unref(p, 0);
    const int big = 64 * 64 * 2 + 5;
    unsigned char *bigmem = malloc((size_t)big * bb);
    ck_assert_int_eq(kvb_block_pool_attach(p, bigmem, big, &fd), KVB_OK);
    ck_assert_int_eq(fd, 4);
    ck_assert_int_eq(kvb_block_pool_refcount(p, 1), 1);
    ck_assert_int_eq(kvb_block_pool_refcount(p, 2), 1);
    ck_assert_int_eq(kvb_block_pool_n_free(p), big + 2);
    ck_assert_int_eq(kvb_block_pool_alloc(p, &id), KVB_OK);
    ck_assert_int_eq(id, 0);
    ck_assert_int_eq(kvb_block_pool_alloc(p, &id), KVB_OK);
    ck_assert_int_eq(id, 3);
    for (int32_t i = 0; i < big; i++) {
        ck_assert_int_eq(kvb_block_pool_alloc(p, &id), KVB_OK);
        ck_assert_int_eq(id, 4 + i);
    }
    ck_assert_int_eq(kvb_block_pool_alloc(p, &id), KVB_ERR_EXHAUSTED);
    ck_assert_ptr_eq(kvb_block_pool_block(p, 4 + big - 1), bigmem + (size_t)(big - 1) * bb);
    kvb_block_pool_destroy(p);
    free(bigmem);
    free(own);
    free(a);
    free(b);
    free(c);
    free(d);
    free(x);
}
KVB_TEST_END

KVB_TEST(prefix_on_segments) {
    size_t bb = kvb_kv_block_bytes(&k_geom);
    unsigned char *own = malloc(4 * bb), *seg = malloc(4 * bb);
    kvb_block_pool *p = NULL;
    kvb_prefix_cache *pc = NULL;
    ck_assert_int_eq(kvb_block_pool_create(&k_geom, own, 4 * bb, 4, &p), KVB_OK);
    ck_assert_int_eq(kvb_prefix_cache_create(p, &pc), KVB_OK);
    int32_t first, id, ids[8];
    ck_assert_int_eq(kvb_block_pool_attach(p, seg, 4, &first), KVB_OK);
    ck_assert_int_eq(first, 4);
    for (int i = 0; i < 8; i++) {
        ck_assert_int_eq(kvb_prefix_cache_alloc(pc, &ids[i]), KVB_OK);
        ck_assert_int_eq(ids[i], i);
    }
    /* a chain of 4 blocks: 2 own (2, 3), then 2 borrowed (5, 6) */
    const int32_t toks[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    int32_t chain[4] = {2, 3, 5, 6};
    uint64_t h = KVB_PREFIX_ROOT;
    for (int i = 0; i < 4; i++) ck_assert_int_eq(kvb_prefix_cache_publish(pc, h, toks + 2 * i, chain[i], &h), KVB_OK);
    ck_assert_int_eq(kvb_prefix_cache_is_cached(pc, 5), 1);
    ck_assert_int_eq(kvb_prefix_cache_is_cached(pc, 4), 0);
    /* move the entry of borrowed block 5 to own block 0 (both held), then drop the holders */
    ck_assert_int_eq(kvb_prefix_cache_move(pc, 5, 0), KVB_OK);
    ck_assert_int_eq(kvb_prefix_cache_move(pc, 5, 1), KVB_ERR_STATE); /* 5 is no entry now */
    ck_assert_int_eq(kvb_prefix_cache_move(pc, 2, 3), KVB_ERR_STATE); /* 3 already is one */
    ck_assert_int_eq(kvb__prefix_cache_check(pc), 0);
    for (int i = 0; i < 8; i++) kvb_block_pool_unref(p, ids[i]);
    ck_assert_int_eq(kvb__prefix_cache_check(pc), 0);
    ck_assert_int_eq(kvb_block_pool_is_free(p, 5), 1); /* no entry: free */
    ck_assert_int_eq(kvb_block_pool_is_free(p, 6), 0); /* cached, unreferenced */
    int32_t got[4];
    uint64_t last;
    ck_assert_int_eq(kvb_prefix_cache_match(pc, toks, 8, 4, got, &last), 4);
    ck_assert_int_eq(got[2], 0); /* the moved entry */
    ck_assert_int_eq(got[3], 6);
    for (int i = 0; i < 4; i++) kvb_block_pool_unref(p, got[i]);
    /* drop_tail covers own ids only; drop_range the segment */
    ck_assert_int_eq(kvb_prefix_cache_drop_tail(pc, 3), 1); /* block 3 */
    ck_assert_int_eq(kvb_prefix_cache_is_cached(pc, 6), 1);
    ck_assert_int_eq(kvb_prefix_cache_drop_range(pc, first, 4), 1); /* block 6 */
    ck_assert_int_eq(kvb_prefix_cache_n_cached(pc), 2);            /* blocks 2 and 0 */
    ck_assert_int_eq(kvb__prefix_cache_check(pc), 0);
    ck_assert_int_eq(kvb_block_pool_detach(p, first, 4), KVB_OK);
    ck_assert_int_eq(kvb__prefix_cache_check(pc), 0);
    ck_assert_int_eq(kvb_prefix_cache_match(pc, toks, 8, 4, got, &last), 1); /* chain broken at 3 */
    kvb_block_pool_unref(p, got[0]);
    ck_assert_int_eq(kvb_prefix_cache_alloc(pc, &id), KVB_OK);
    ck_assert_int_lt(id, 4);
    kvb_block_pool_unref(p, id);
    kvb_prefix_cache_destroy(pc);
    kvb_block_pool_destroy(p);
    free(own);
    free(seg);
}
KVB_TEST_END

/* ================================================================ engines over a real model */

typedef struct rec {
    int32_t toks[MAXR][MAXT];
    int n[MAXR];
    kvb_finish fin[MAXR];
    kvb_status err[MAXR];
} rec;

static void on_token(void *ud, uint64_t id, int index, int32_t tok, uint64_t t_ns) {
    rec *r = ud;
    ck_assert_int_lt(id, MAXR);
    ck_assert_int_eq(index, r->n[id]);
    ck_assert_int_lt(index, MAXT);
    r->toks[id][r->n[id]++] = tok;
}
static void on_finish(void *ud, uint64_t id, kvb_finish why, kvb_status err) {
    rec *r = ud;
    ck_assert_int_eq(r->fin[id], KVB_FINISH_NONE);
    r->fin[id] = why;
    r->err[id] = err;
}

static kvb_t_model tm;
static kvb_model *model;
static int n_layers;

static void setup_model(const char *arch, int layers) {
    char args[256];
    snprintf(args, sizeof args, "--arch %s --layers %d --hidden 64 --heads 4 --kv-heads 2 --vocab 200 --max-pos 512 "
             "--seed 11", arch, layers);
    kvb_t_model_make(&tm, args);
    model = tm.m;
    n_layers = layers;
}

static void teardown_model(void) { kvb_t_model_free(&tm); }

static size_t block_bytes(int bs) {
    kvb_kv_geom g = kvb_model_kv_geom(model, bs);
    return kvb_kv_block_bytes(&g);
}

typedef struct eopts {
    int bs, n_blocks, budget, prefix, stream;
    double stall_wait_s; /* > 0: kvb_engine_opts.stall_wait_s, with stall_overtake */
    long long lenders_bytes; /* stream: the swiftcache planner's lenders_bytes (LSC inside the budget) */
    int stall_overtake;
    int borrows;        /* kvb_engine_opts.borrows (a master) */
    void *mem;
    size_t mem_bytes;
} eopts;

static kvb_engine *mk(rec *r, eopts x) {
    kvb_engine_opts o;
    kvb_engine_opts_default(&o);
    o.block_size = x.bs;
    o.n_blocks = x.n_blocks;
    o.max_batch_tokens = x.budget ? x.budget : 512;
    o.enable_prefix_cache = x.prefix;
    o.kv_mem = x.mem;
    o.kv_mem_bytes = x.mem_bytes;
    o.borrows = x.borrows;
    if (x.stall_wait_s > 0) {
        o.stall_wait_s = x.stall_wait_s;
        o.stall_overtake = x.stall_overtake;
    }
    kvb_engine_events ev = {.ud = r, .on_token = on_token, .on_finish = on_finish};
    kvb_planner pl = kvb_policy_recompute();
    if (x.stream) { /* SwiftCache's layer stream cache: the swiftcache planner with lsc=stream */
        kvb_policy_params pp = {0};
        ck_assert_int_eq(kvb_policy_params_add(&pp, "lsc=stream"), KVB_OK);
        if (x.lenders_bytes > 0) {
            char kv[48];
            snprintf(kv, sizeof kv, "lenders_bytes=%lld", x.lenders_bytes);
            ck_assert_int_eq(kvb_policy_params_add(&pp, kv), KVB_OK);
        }
        ck_assert_int_eq(kvb_policy_create("swiftcache", &pp, &pl), KVB_OK);
        kvb_policy_params_free(&pp);
    }
    kvb_engine *e = NULL;
    ck_assert_int_eq(kvb_engine_create(model, &o, &pl, &ev, &e), KVB_OK);
    return e;
}

static void add(kvb_engine *e, uint64_t id, const int32_t *p, int n, int max_tokens) {
    kvb_request q = {.id = id, .prompt = p, .n_prompt = n, .max_tokens = max_tokens};
    ck_assert_msg(kvb_engine_add(e, &q) == KVB_OK, "add %llu: %s", (unsigned long long)id, kvb_engine_last_error(e));
}

static void steps(kvb_engine *e, int n) {
    for (int i = 0; i < n; i++) ck_assert_int_eq(kvb_engine_step(e), KVB_OK);
}

static void run(kvb_engine *e) {
    for (int i = 0; i < 20000 && kvb_engine_n_live(e) > 0; i++) ck_assert_int_eq(kvb_engine_step(e), KVB_OK);
    ck_assert_int_eq(kvb_engine_n_live(e), 0);
}

/* A request as the tests describe it. */
typedef struct req {
    uint64_t id;
    const int32_t *p;
    int n;
    int max;
} req;

/* The reference: the requests on a plain engine with a big private pool and no prefix cache. */
static void reference(rec *ref, const req *rs, int n) {
    memset(ref, 0, sizeof *ref);
    kvb_engine *e = mk(ref, (eopts){.bs = 16, .n_blocks = 128});
    for (int i = 0; i < n; i++) add(e, rs[i].id, rs[i].p, rs[i].n, rs[i].max);
    run(e);
    kvb_engine_destroy(e);
}

static void assert_same(const rec *want, const rec *got, const req *rs, int n) {
    for (int i = 0; i < n; i++) {
        uint64_t id = rs[i].id;
        ck_assert_msg(got->n[id] == want->n[id], "request %llu: %d tokens, want %d", (unsigned long long)id,
                      got->n[id], want->n[id]);
        ck_assert_int_eq(got->fin[id], KVB_FINISH_LENGTH);
        for (int k = 0; k < want->n[id]; k++)
            ck_assert_msg(got->toks[id][k] == want->toks[id][k], "request %llu token %d: %d, want %d",
                          (unsigned long long)id, k, got->toks[id][k], want->toks[id][k]);
    }
}

/* every block is free or an evictable prefix-cache entry once nothing runs */
static void assert_no_leak(kvb_engine *e) {
    kvb_engine_stats s;
    kvb_engine_get_stats(e, &s);
    ck_assert_int_eq(s.blocks_free, s.blocks_total);
}

static int32_t P[3][64];
static const int PL[3] = {37, 5, 23};
static void make_prompts(void) {
    for (int r = 0; r < 3; r++)
        for (int i = 0; i < PL[r]; i++) P[r][i] = (i * 13 + r * 29 + 1) % 200;
}

/* Blocks of the attached id space with a reference (sequences live on borrowed memory). */
static int borrowed_referenced(kvb_engine *e) {
    kvb_block_pool *p = kvb_engine_pool(e);
    int n = 0;
    for (int32_t i = kvb_block_pool_capacity(p); i < kvb_block_pool_id_limit(p); i++)
        if (kvb_block_pool_has(p, i) && kvb_block_pool_refcount(p, i) > 0) n++;
    return n;
}

/* Blocks of [first, first+n) with a reference, and unreferenced prefix-cache entries among them. */
static void range_census(kvb_engine *e, int32_t first, int n, int *live, int *cached) {
    kvb_block_pool *p = kvb_engine_pool(e);
    *live = *cached = 0;
    for (int32_t i = first; i < first + n; i++) {
        if (kvb_block_pool_refcount(p, i) > 0) (*live)++;
        else if (!kvb_block_pool_is_free(p, i)) (*cached)++; /* held by the prefix cache */
    }
}

/* ---------------------------------------------------------------- borrowed memory */

/* An exportable region of host memory (the memory interface, as the node uses it) made by this
 * process and imported a second time by handle, as the master imports a worker's region. */
typedef struct shm {
    kvb_mem *mem;
    kvb_mem_region *made;
    kvb_mem_region *mapped;
    unsigned char *base; /* the imported mapping */
} shm;

static void shm_open_(shm *s, size_t bytes) {
    char tag[40];
    snprintf(tag, sizeof tag, "kvbtlend%ld", (long)getpid());
    ck_assert_int_eq(kvb_mem_create("cpu", -1, &s->mem), KVB_OK);
    ck_assert_int_eq(kvb_mem_region_create(s->mem, tag, bytes, &s->made), KVB_OK);
    ck_assert_int_eq(kvb_mem_region_import(s->mem, kvb_mem_region_handle(s->made), bytes, &s->mapped), KVB_OK);
    s->base = kvb_mem_region_base(s->mapped);
}

static void shm_close(shm *s) {
    kvb_mem_region_destroy(s->mapped);
    kvb_mem_region_destroy(s->made);
    kvb_mem_destroy(s->mem);
}

/* A lender in another process: a forked child creates the region and sends its handle; the test
 * imports it. Closing `ctl` lets the child unlink and exit; lender_kill kills it outright. */
typedef struct lender {
    pid_t pid;
    int ctl;
    char tag[40];
    kvb_mem *mem;
    kvb_mem_region *mapped;
    unsigned char *base;
} lender;

static void lender_start(lender *L, size_t bytes) {
    int hp[2], cp[2];
    ck_assert_int_eq(pipe(hp), 0);
    ck_assert_int_eq(pipe(cp), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(hp[0]);
        close(cp[1]);
        char tag[40];
        snprintf(tag, sizeof tag, "kvbtlender%ld", (long)getpid());
        kvb_mem *m = NULL;
        kvb_mem_region *r = NULL;
        if (kvb_mem_create("cpu", -1, &m) != KVB_OK || kvb_mem_region_create(m, tag, bytes, &r) != KVB_OK) _exit(3);
        const char *h = kvb_mem_region_handle(r);
        if (write(hp[1], h, strlen(h) + 1) != (ssize_t)(strlen(h) + 1)) _exit(4);
        close(hp[1]);
        char c;
        while (read(cp[0], &c, 1) > 0) {
        }
        kvb_mem_region_destroy(r);
        kvb_mem_destroy(m);
        _exit(0);
    }
    close(hp[1]);
    close(cp[0]);
    char handle[KVB_MEM_HANDLE_MAX];
    size_t got = 0;
    for (;;) {
        ck_assert_uint_lt(got, sizeof handle);
        ssize_t k = read(hp[0], handle + got, 1);
        ck_assert_int_eq(k, 1);
        if (handle[got++] == '\0') break;
    }
    close(hp[0]);
    L->pid = pid;
    L->ctl = cp[1];
    snprintf(L->tag, sizeof L->tag, "kvbtlender%ld", (long)pid);
    ck_assert_int_eq(kvb_mem_create("cpu", -1, &L->mem), KVB_OK);
    ck_assert_int_eq(kvb_mem_region_import(L->mem, handle, bytes, &L->mapped), KVB_OK);
    L->base = kvb_mem_region_base(L->mapped);
}

/* The lender dies; the master's mapping stays (as a CUDA IPC mapping may, or may not: never read). */
static void lender_kill(lender *L) {
    ck_assert_int_eq(kill(L->pid, SIGKILL), 0);
    int status;
    ck_assert_int_eq(waitpid(L->pid, &status, 0), L->pid);
    ck_assert(WIFSIGNALED(status));
    close(L->ctl);
    kvb_region_unlink_stale(L->tag, NULL); /* it could not clean up itself */
}

static void lender_stop(lender *L, int killed) {
    if (!killed) {
        close(L->ctl);
        int status;
        ck_assert_int_eq(waitpid(L->pid, &status, 0), L->pid);
        ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    kvb_mem_region_destroy(L->mapped);
    kvb_mem_destroy(L->mem);
}

/* Fills bytes with 0xff: every f32 there is a NaN. */
static void poison(void *p, size_t n) { memset(p, 0xff, n); }

/* ---------------------------------------------------------------- (a) worker shrink / grow */

KVB_TEST(worker_shrink_grow) {
    setup_model("llama", 3);
    make_prompts();
    static rec ref, got;
    const req rs[] = {{0, P[0], 37, 40}, {1, P[2], 23, 100}};
    reference(&ref, rs, 2);

    /* the worker's own KV memory: a shared region of 32 blocks of 8 tokens */
    size_t bb = block_bytes(8);
    kvb_mem_region *region = NULL;
    char tag[40];
    snprintf(tag, sizeof tag, "kvbtlendw%ld", (long)getpid());
    ck_assert_int_eq(kvb_mem_region_create(kvb_model_backend(model)->mem, tag, 32 * bb, &region), KVB_OK);
    memset(&got, 0, sizeof got);
    kvb_engine *e = mk(&got, (eopts){.bs = 8, .n_blocks = 32, .prefix = 1, .mem = kvb_mem_region_base(region),
                                    .mem_bytes = kvb_mem_region_size(region)});
    ck_assert_int_eq(kvb_engine_capacity(e), 32);
    ck_assert_int_eq(kvb_engine_n_own(e), 32);
    ck_assert_int_eq(kvb_engine_free_tail(e), 32);
    ck_assert_int_eq(kvb_engine_shrink(e, 33), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_engine_shrink(e, -1), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_engine_shrink(e, 12), KVB_OK); /* lend 20 blocks */
    ck_assert_int_eq(kvb_engine_n_own(e), 12);
    ck_assert_int_eq(kvb_engine_free_tail(e), 12);
    ck_assert_int_eq(kvb_engine_starved(e), 0);

    /* 37 + 40 tokens need 10 blocks; after the prefill and two decode steps it holds 5 */
    add(e, 0, P[0], 37, 40);
    steps(e, 3);
    ck_assert_int_eq(kvb_engine_free_tail(e), 7);
    ck_assert_int_eq(kvb_engine_shrink(e, 4), KVB_ERR_STATE); /* block 4 is referenced */
    ck_assert_int_eq(kvb_engine_n_own(e), 12);               /* nothing changed */
    ck_assert_int_eq(kvb_engine_free_tail(e), 7);
    ck_assert_int_eq(kvb_engine_shrink(e, 5), KVB_OK);
    ck_assert_int_eq(kvb_engine_free_tail(e), 0);
    ck_assert_int_eq(kvb_engine_starved(e), 0);
    /* the request outgrows 5 blocks: it preempts itself and waits, starved */
    steps(e, 4);
    kvb_engine_stats s;
    kvb_engine_get_stats(e, &s);
    ck_assert_int_eq(s.preemptions, 1);
    ck_assert_int_eq(s.n_waiting, 1);
    ck_assert_int_eq(kvb_engine_starved(e), 1);
    /* longer than n_own but within the capacity: queued; longer than the capacity: rejected */
    add(e, 1, P[2], 23, 100); /* 123 tokens = 16 blocks */
    kvb_request q = {.id = 2, .prompt = P[0], .n_prompt = 37, .max_tokens = 250}; /* 36 blocks */
    ck_assert_int_eq(kvb_engine_add(e, &q), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_engine_max_request_tokens(e), 123);
    uint64_t gen = s.generated_tokens;
    steps(e, 3);
    kvb_engine_get_stats(e, &s);
    ck_assert_int_eq(s.generated_tokens, gen); /* nothing runs */
    ck_assert_int_eq(kvb_engine_starved(e), 1);
    ck_assert_int_eq(kvb_engine_n_live(e), 2);
    ck_assert_int_eq(kvb_engine_grow(e, 4), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_engine_grow(e, 33), KVB_ERR_INVALID);
    /* 12 blocks: request 0 runs, request 1 (16 blocks) waits behind it, starved again */
    ck_assert_int_eq(kvb_engine_grow(e, 12), KVB_OK);
    ck_assert_int_eq(kvb_engine_starved(e), 0);
    steps(e, 1);
    kvb_engine_get_stats(e, &s);
    ck_assert_int_eq(s.n_running, 1);
    ck_assert_int_eq(kvb_engine_starved(e), 1);
    ck_assert_int_eq(kvb_engine_grow(e, 32), KVB_OK);
    ck_assert_int_eq(kvb_engine_starved(e), 0);
    run(e);
    assert_same(&ref, &got, rs, 2);
    ck_assert_int_eq(kvb_engine_max_request_tokens(e), 0);
    assert_no_leak(e);
    /* idle with cached blocks everywhere: all of it can go; the cached tail is dropped on shrink and
     * the same prompt still gives the same tokens (from the entries below the new tail) */
    ck_assert_int_eq(kvb_engine_free_tail(e), 32);
    ck_assert_int_eq(kvb_engine_shrink(e, 3), KVB_OK);
    ck_assert_int_eq(kvb_engine_grow(e, 32), KVB_OK);
    kvb_engine_get_stats(e, &s);
    uint64_t hits = s.prefix_hit_tokens;
    add(e, 10, P[0], 37, 40);
    run(e);
    kvb_engine_get_stats(e, &s);
    ck_assert_int_eq(s.prefix_hit_tokens - hits, 24); /* blocks 0..2 survived the shrink */
    ck_assert_int_eq(got.n[10], 40);
    for (int k = 0; k < 40; k++) ck_assert_int_eq(got.toks[10][k], ref.toks[0][k]);
    kvb_engine_destroy(e);
    kvb_mem_region_destroy(region);
    teardown_model();
}
KVB_TEST_END

/* ---------------------------------------------------------------- (b) master on borrowed blocks */

KVB_TEST(master_borrowed_session) {
    setup_model("qwen3", 3);
    make_prompts();
    size_t bb = block_bytes(8);
    lender L;
    lender_start(&L, 40 * bb);
    static rec ref, got;
    memset(&got, 0, sizeof got);
    /* own pool of 4 blocks (32 tokens) plus a loan of 32 blocks at block 3 of the lender's region */
    kvb_engine *e = mk(&got, (eopts){.bs = 8, .n_blocks = 4, .prefix = 1});
    ck_assert_int_eq(kvb_engine_attach(e, 77, L.base + 3 * bb, 32 * bb - 1, 32), KVB_ERR_INVALID); /* too small */
    ck_assert_int_eq(kvb_engine_attach(e, 77, NULL, 32 * bb, 32), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_engine_attach(e, 77, L.base + 3 * bb, 32 * bb, 32), KVB_OK);
    ck_assert_int_eq(kvb_engine_attach(e, 77, L.base + 3 * bb, 32 * bb, 32), KVB_ERR_INVALID); /* same tag */
    ck_assert_int_eq(kvb_engine_n_borrowed(e), 32);
    uint64_t tags[2];
    int nb[2];
    ck_assert_int_eq(kvb_engine_loans(e, tags, nb, 2), 1);
    ck_assert_uint_eq(tags[0], 77);
    ck_assert_int_eq(nb[0], 32);
    kvb_engine_stats s;
    kvb_engine_get_stats(e, &s);
    ck_assert_int_eq(s.blocks_total, 36);
    ck_assert_int_eq(s.blocks_own, 4);
    ck_assert_int_eq(s.blocks_borrowed, 32);

    /* turn 1: 57 tokens, turn 2: turn 1 + its answer + 2 tokens, 89 tokens (12 blocks) */
    add(e, 0, P[0], 37, 20);
    run(e);
    int32_t turn2[64];
    memcpy(turn2, P[0], 37 * sizeof(int32_t));
    memcpy(turn2 + 37, got.toks[0], 20 * sizeof(int32_t));
    turn2[57] = 11;
    turn2[58] = 12;
    add(e, 1, turn2, 59, 30);
    steps(e, 1);
    kvb_engine_get_stats(e, &s);
    ck_assert_int_eq(s.prefix_hit_tokens, 56); /* 7 full blocks: 4 own, 3 borrowed */
    ck_assert_int_ge(borrowed_referenced(e), 4);
    run(e);
    const req rs[] = {{0, P[0], 37, 20}, {1, turn2, 59, 30}};
    reference(&ref, rs, 2);
    assert_same(&ref, &got, rs, 2);
    assert_no_leak(e);
    /* the KV lives in the loan and nowhere else of the lender's region */
    int nonzero = 0;
    for (size_t i = 3 * bb; i < 35 * bb && !nonzero; i++) nonzero = L.base[i] != 0;
    ck_assert(nonzero);
    for (size_t i = 0; i < 3 * bb; i++) ck_assert_uint_eq(L.base[i], 0);
    for (size_t i = 35 * bb; i < 40 * bb; i++) ck_assert_uint_eq(L.base[i], 0);
    kvb_detach_stats ds;
    ck_assert_int_eq(kvb_engine_detach(e, 78, 0, &ds), KVB_ERR_NOT_FOUND);
    ck_assert_int_eq(kvb_engine_detach(e, 77, 0, &ds), KVB_OK);
    ck_assert_int_eq(ds.moved, 0);
    ck_assert_int_eq(ds.preempted, 0);
    ck_assert_int_gt(ds.dropped, 0);
    ck_assert_int_eq(kvb_engine_n_borrowed(e), 0);
    ck_assert_int_eq(kvb_engine_loans(e, NULL, NULL, 0), 0);
    kvb_engine_destroy(e);
    lender_stop(&L, 0);
    teardown_model();
}
KVB_TEST_END

/* ---------------------------------------------------------------- (c) detach with live sequences */

/* The three requests of the detach tests: request 1 shares request 0's first 32 tokens through the
 * prefix cache (its blocks are referenced twice), request 2 is unrelated. bs 4. */
static int32_t P1s[40];
static void detach_requests(req *rs) {
    memcpy(P1s, P[0], 32 * sizeof(int32_t));
    P1s[32] = 5, P1s[33] = 6, P1s[34] = 7;
    rs[0] = (req){0, P[0], 37, 30};
    rs[1] = (req){1, P1s, 35, 30};
    rs[2] = (req){2, P[2], 23, 30};
}

/* Starts them: request 0 is prefilled first so that request 1 hits its published blocks. */
static void start_detach_requests(kvb_engine *e, const req *rs) {
    add(e, rs[0].id, rs[0].p, rs[0].n, rs[0].max);
    steps(e, 1);
    add(e, rs[1].id, rs[1].p, rs[1].n, rs[1].max);
    add(e, rs[2].id, rs[2].p, rs[2].n, rs[2].max);
    steps(e, 4);
}

KVB_TEST(detach_moves_live_blocks) {
    setup_model("llama", 3);
    make_prompts();
    req rs[4];
    detach_requests(rs);
    static rec ref, got;
    reference(&ref, rs, 3);
    size_t bb = block_bytes(4);
    shm lend;
    shm_open_(&lend, 60 * bb);
    memset(&got, 0, sizeof got);
    kvb_engine *e = mk(&got, (eopts){.bs = 4, .n_blocks = 4, .prefix = 1});
    /* loan A: 12 blocks (ids 4..15), loan B: 40 blocks (ids 16..55) */
    ck_assert_int_eq(kvb_engine_attach(e, 1, lend.base, 12 * bb, 12), KVB_OK);
    ck_assert_int_eq(kvb_engine_attach(e, 2, lend.base + 12 * bb, 40 * bb, 40), KVB_OK);
    start_detach_requests(e, rs);
    kvb_engine_stats s;
    kvb_engine_get_stats(e, &s);
    ck_assert_int_eq(s.n_running, 3);
    ck_assert_int_eq(s.prefix_hit_tokens, 32);
    kvb_block_pool *p = kvb_engine_pool(e);
    ck_assert_int_eq(kvb_block_pool_refcount(p, 4), 2); /* shared by requests 0 and 1, on loan A */
    int live, cached;
    range_census(e, 4, 12, &live, &cached);
    ck_assert_int_ge(live, 8);
    uint64_t preempt0 = s.preemptions;

    kvb_detach_stats ds;
    ck_assert_int_eq(kvb_engine_detach(e, 1, 0, &ds), KVB_OK);
    ck_assert_int_eq(ds.moved, live); /* each live block once, however many tables refer to it */
    ck_assert_int_eq(ds.preempted, 0);
    ck_assert_int_eq(ds.dropped, cached);
    for (int32_t i = 4; i < 16; i++) ck_assert_int_eq(kvb_block_pool_has(p, i), 0);
    kvb_engine_get_stats(e, &s);
    ck_assert_int_eq(s.n_running, 3);
    ck_assert_int_eq(s.preemptions, preempt0);
    ck_assert_int_eq(kvb_engine_n_borrowed(e), 40);
    /* nothing may read loan A any more */
    poison(lend.base, 12 * bb);
    run(e);
    assert_same(&ref, &got, rs, 3);
    kvb_engine_get_stats(e, &s);
    ck_assert_int_eq(s.preemptions, preempt0);
    /* the moved prefix-cache entries still serve: request 1's prompt again hits 8 blocks */
    uint64_t hits = s.prefix_hit_tokens;
    add(e, 3, P1s, 35, 30);
    run(e);
    kvb_engine_get_stats(e, &s);
    ck_assert_int_eq(s.prefix_hit_tokens - hits, 32);
    for (int k = 0; k < 30; k++) ck_assert_int_eq(got.toks[3][k], ref.toks[1][k]);
    assert_no_leak(e);
    kvb_engine_destroy(e);
    shm_close(&lend);
    teardown_model();
}
KVB_TEST_END

KVB_TEST(detach_preempts_without_free_blocks) {
    setup_model("llama", 3);
    make_prompts();
    req rs[4];
    detach_requests(rs);
    static rec ref, got;
    reference(&ref, rs, 3);
    size_t bb = block_bytes(4);
    shm lend;
    shm_open_(&lend, 80 * bb);
    memset(&got, 0, sizeof got);
    kvb_engine *e = mk(&got, (eopts){.bs = 4, .n_blocks = 4, .prefix = 1});
    ck_assert_int_eq(kvb_engine_attach(e, 1, lend.base, 40 * bb, 40), KVB_OK);
    start_detach_requests(e, rs);
    /* the own blocks all belong to request 0: no block outside the loan is free or evictable */
    kvb_block_pool *p = kvb_engine_pool(e);
    for (int32_t i = 0; i < 4; i++) ck_assert_int_gt(kvb_block_pool_refcount(p, i), 0);
    kvb_engine_stats s;
    kvb_engine_get_stats(e, &s);
    uint64_t preempt0 = s.preemptions;
    kvb_detach_stats ds;
    ck_assert_int_eq(kvb_engine_detach(e, 1, 0, &ds), KVB_OK);
    ck_assert_int_eq(ds.moved, 0);
    ck_assert_int_eq(ds.preempted, 3);
    kvb_engine_get_stats(e, &s);
    ck_assert_int_eq(s.preemptions - preempt0, 3);
    ck_assert_int_eq(s.n_running, 0);
    ck_assert_int_eq(s.n_waiting, 3);
    ck_assert_int_eq(kvb_block_pool_id_limit(p), 4); /* the retired range was the top: trimmed */
    poison(lend.base, 40 * bb);
    /* 4 own blocks cannot hold request 0 (17 blocks): it waits until a new loan comes */
    steps(e, 2);
    ck_assert_int_eq(kvb_engine_starved(e), 1);
    ck_assert_int_eq(kvb_engine_attach(e, 2, lend.base + 40 * bb, 40 * bb, 40), KVB_OK);
    ck_assert_int_eq(kvb_block_pool_id_limit(p), 44); /* the range is reused */
    ck_assert_int_eq(kvb_engine_starved(e), 0);
    run(e);
    assert_same(&ref, &got, rs, 3);
    assert_no_leak(e);
    kvb_engine_destroy(e);
    shm_close(&lend);
    teardown_model();
}
KVB_TEST_END

/* Issue 10: requests admitted on borrowed blocks, preempted when the loan goes and no longer fitting the
 * pool, must not hold the queue for good: a later request that fits is served past them (at most
 * stall_overtake of them), and they fail with KVB_ERR_BUSY after stall_wait_s. */
KVB_TEST(stalled_head_overtaken_then_fails) {
    setup_model("llama", 3);
    make_prompts();
    req rs[6];
    detach_requests(rs);
    rs[3] = (req){4, P[1], 5, 8}; /* 13 tokens: 4 blocks, the whole own pool */
    rs[4] = (req){5, P[1], 5, 6};
    static rec ref, got;
    reference(&ref, rs, 5);
    size_t bb = block_bytes(4);
    shm lend;
    shm_open_(&lend, 40 * bb);
    memset(&got, 0, sizeof got);
    kvb_engine *e = mk(&got, (eopts){.bs = 4, .n_blocks = 4, .prefix = 0, .stall_wait_s = 5, .stall_overtake = 1});
    ck_assert_int_eq(kvb_engine_attach(e, 1, lend.base, 40 * bb, 40), KVB_OK);
    start_detach_requests(e, rs);
    kvb_detach_stats ds;
    ck_assert_int_eq(kvb_engine_detach(e, 1, 0, &ds), KVB_OK);
    ck_assert_int_eq(ds.preempted, 3); /* all three wait now, none fits the 4 own blocks */
    poison(lend.base, 40 * bb);
    add(e, 4, rs[3].p, rs[3].n, rs[3].max);
    add(e, 5, rs[4].p, rs[4].n, rs[4].max);
    /* request 4 overtakes the stalled three; request 5 may not (one overtake each) and waits */
    for (int i = 0; i < 20000 && got.fin[4] == KVB_FINISH_NONE; i++) ck_assert_int_eq(kvb_engine_step(e), KVB_OK);
    ck_assert_int_eq(got.fin[4], KVB_FINISH_LENGTH);
    ck_assert_int_eq(got.n[5], 0);
    for (int k = 0; k < 3; k++) ck_assert_int_eq(got.fin[rs[k].id], KVB_FINISH_NONE);
    ck_assert_int_eq(kvb_engine_starved(e), 1);
    /* no loan comes: after the stall wait they fail with an explicit error, and request 5 runs */
    for (int i = 0; i < 100000 && kvb_engine_n_live(e) > 0; i++) {
        ck_assert_int_eq(kvb_engine_step(e), KVB_OK);
        if (got.fin[5] == KVB_FINISH_NONE) usleep(500);
    }
    ck_assert_int_eq(kvb_engine_n_live(e), 0);
    for (int k = 0; k < 3; k++) {
        ck_assert_int_eq(got.fin[rs[k].id], KVB_FINISH_ERROR);
        ck_assert_int_eq(got.err[rs[k].id], KVB_ERR_BUSY);
    }
    kvb_engine_stats s;
    kvb_engine_get_stats(e, &s);
    ck_assert_uint_eq(s.stalled_failed, 3);
    const req done[] = {rs[3], rs[4]};
    assert_same(&ref, &got, done, 2);
    assert_no_leak(e);
    kvb_engine_destroy(e);
    shm_close(&lend);
    teardown_model();
}
KVB_TEST_END

/* Issue 26: a master's loans come and go (a restart, a drain), so a request within the context that
 * its own blocks plus the loans attached now cannot hold waits for loans (stalled) instead of being
 * refused as if it could never fit; it runs when a loan comes, with the reference's tokens. Refused
 * still: beyond max_model_len, beyond the memory of an engine that does not borrow, and beyond what
 * the planner lets a master borrow at most (the LSC within its budget). */
KVB_TEST(master_waits_for_loans) {
    setup_model("llama", 3);
    make_prompts();
    const req rs[] = {{0, P[0], 37, 30}}; /* 67 tokens: 17 blocks of 4 */
    static rec ref, got;
    reference(&ref, rs, 1);
    size_t bb = block_bytes(4);
    memset(&got, 0, sizeof got);
    kvb_engine *e = mk(&got, (eopts){.bs = 4, .n_blocks = 4});
    kvb_request q = {.id = 0, .prompt = P[0], .n_prompt = 37, .max_tokens = 30};
    ck_assert_int_eq(kvb_engine_add(e, &q), KVB_ERR_INVALID); /* it never borrows: 4 blocks is all */
    ck_assert_msg(strstr(kvb_engine_last_error(e), "can never fit in 4 KV blocks"), "%s", kvb_engine_last_error(e));
    kvb_engine_destroy(e);

    e = mk(&got, (eopts){.bs = 4, .n_blocks = 4, .borrows = 1});
    q.max_tokens = 512 - 37 + 1; /* the context still bounds it */
    ck_assert_int_eq(kvb_engine_add(e, &q), KVB_ERR_INVALID);
    ck_assert_msg(strstr(kvb_engine_last_error(e), "exceeds the model length 512"), "%s", kvb_engine_last_error(e));
    add(e, 0, P[0], 37, 30);
    steps(e, 5);
    kvb_engine_stats s;
    kvb_engine_get_stats(e, &s);
    ck_assert_int_eq(got.n[0], 0);
    ck_assert_int_eq(s.n_waiting, 1);
    ck_assert_int_eq(s.n_stalled, 1);
    ck_assert_int_eq(kvb_engine_starved(e), 1);
    shm lend;
    shm_open_(&lend, 16 * bb);
    ck_assert_int_eq(kvb_engine_attach(e, 1, lend.base, 16 * bb, 16), KVB_OK);
    kvb_engine_get_stats(e, &s);
    ck_assert_int_eq(s.n_stalled, 0);
    run(e);
    assert_same(&ref, &got, rs, 1);
    kvb_engine_destroy(e);

    /* the swiftcache planner streams at most 24 borrowed blocks (lsc_within_budget): 24 own + 24 */
    shm own;
    shm_open_(&own, 40 * bb);
    e = mk(&got, (eopts){.bs = 4, .n_blocks = 40, .stream = 1, .mem = own.base, .mem_bytes = 40 * bb,
                         .lenders_bytes = (long long)(24 * bb), .borrows = 1});
    ck_assert_int_eq(kvb_engine_capacity(e), 24);
    ck_assert_int_eq(kvb_engine_max_borrowed(e), 24);
    q = (kvb_request){.id = 7, .prompt = P[0], .n_prompt = 37, .max_tokens = 48 * 4 - 37 + 1}; /* 49 blocks */
    ck_assert_int_eq(kvb_engine_add(e, &q), KVB_ERR_INVALID);
    ck_assert_msg(strstr(kvb_engine_last_error(e), "can never fit in 48 KV blocks"), "%s", kvb_engine_last_error(e));
    q.max_tokens--; /* 48 blocks: waits for the loans */
    ck_assert_int_eq(kvb_engine_add(e, &q), KVB_OK);
    ck_assert_int_eq(kvb_engine_cancel(e, 7), KVB_OK);
    kvb_engine_destroy(e);
    shm_close(&own);
    shm_close(&lend);
    teardown_model();
}
KVB_TEST_END

KVB_TEST(detach_lender_dead) {
    setup_model("llama", 3);
    make_prompts();
    static rec ref, got;
    /* request 1 (short) and 0 fill the own blocks; request 2's tail lands on the loan */
    const req rs[] = {{1, P[1], 5, 30}, {0, P[0], 37, 30}, {2, P[2], 23, 30}};
    reference(&ref, rs, 3);
    size_t bb = block_bytes(4);
    lender L1, L2;
    lender_start(&L1, 40 * bb);
    lender_start(&L2, 40 * bb);
    memset(&got, 0, sizeof got);
    kvb_engine *e = mk(&got, (eopts){.bs = 4, .n_blocks = 16, .prefix = 1});
    ck_assert_int_eq(kvb_engine_attach(e, 1, L1.base, 40 * bb, 40), KVB_OK);
    for (int i = 0; i < 3; i++) add(e, rs[i].id, rs[i].p, rs[i].n, rs[i].max);
    steps(e, 4);
    int live, cached;
    range_census(e, 16, 40, &live, &cached);
    ck_assert_int_gt(live, 0);
    kvb_engine_stats s;
    kvb_engine_get_stats(e, &s);
    ck_assert_int_eq(s.n_running, 3);
    uint64_t gen = s.generated_tokens;

    lender_kill(&L1);
    kvb_detach_stats ds;
    ck_assert_int_eq(kvb_engine_detach(e, 1, 1, &ds), KVB_OK);
    ck_assert_int_eq(ds.moved, 0);
    ck_assert_int_eq(ds.preempted, 1); /* request 2 only */
    kvb_engine_get_stats(e, &s);
    ck_assert_int_eq(s.n_running, 2);
    /* the dead lender's memory is garbage from now on */
    poison(L1.base, 40 * bb);
    /* requests 0 and 1 go on from their own blocks */
    steps(e, 2);
    kvb_engine_get_stats(e, &s);
    ck_assert_int_eq(s.generated_tokens - gen, 4);
    ck_assert_int_eq(kvb_engine_attach(e, 2, L2.base, 40 * bb, 40), KVB_OK);
    run(e);
    assert_same(&ref, &got, rs, 3);
    assert_no_leak(e);
    kvb_engine_destroy(e);
    lender_stop(&L1, 1);
    lender_stop(&L2, 0);
    teardown_model();
}
KVB_TEST_END

/* ---------------------------------------------------------------- (d) cached blocks dropped */

KVB_TEST(detach_drops_cached_prefix) {
    setup_model("qwen3", 3);
    make_prompts();
    static rec ref, got;
    const req rs[] = {{0, P[0], 37, 10}};
    reference(&ref, rs, 1);
    size_t bb = block_bytes(4);
    shm lend;
    shm_open_(&lend, 40 * bb);
    memset(&got, 0, sizeof got);
    kvb_engine *e = mk(&got, (eopts){.bs = 4, .n_blocks = 4, .prefix = 1});
    ck_assert_int_eq(kvb_engine_attach(e, 5, lend.base, 20 * bb, 20), KVB_OK);
    add(e, 0, P[0], 37, 10);
    run(e);
    /* 46 tokens of KV: 11 full blocks published, 4 own and 7 on the loan, none referenced */
    int live, cached;
    range_census(e, 4, 20, &live, &cached);
    ck_assert_int_eq(live, 0);
    ck_assert_int_eq(cached, 7);
    kvb_detach_stats ds;
    ck_assert_int_eq(kvb_engine_detach(e, 5, 0, &ds), KVB_OK);
    ck_assert_int_eq(ds.dropped, 7);
    ck_assert_int_eq(ds.moved, 0);
    ck_assert_int_eq(ds.preempted, 0);
    poison(lend.base, 20 * bb);
    ck_assert_int_eq(kvb_engine_attach(e, 6, lend.base + 20 * bb, 20 * bb, 20), KVB_OK);
    kvb_engine_stats s;
    kvb_engine_get_stats(e, &s);
    uint64_t hits = s.prefix_hit_tokens;
    add(e, 1, P[0], 37, 10);
    run(e);
    kvb_engine_get_stats(e, &s);
    ck_assert_int_eq(s.prefix_hit_tokens - hits, 16); /* the 4 own blocks only */
    ck_assert_int_eq(got.n[1], 10);
    for (int k = 0; k < 10; k++) ck_assert_int_eq(got.toks[1][k], ref.toks[0][k]);
    assert_same(&ref, &got, rs, 1);
    assert_no_leak(e);
    kvb_engine_destroy(e);
    shm_close(&lend);
    teardown_model();
}
KVB_TEST_END

/* ---------------------------------------------------------------- (d2) partial reclaim (issue 10) */

/* The hits of prompt p (n tokens) when run again as request id, and its tokens against `want`. */
static uint64_t rerun_hits(kvb_engine *e, rec *got, uint64_t id, const int32_t *p, int n, int max, const rec *ref,
                           uint64_t ref_id) {
    kvb_engine_stats s;
    kvb_engine_get_stats(e, &s);
    uint64_t h0 = s.prefix_hit_tokens;
    add(e, id, p, n, max);
    run(e);
    kvb_engine_get_stats(e, &s);
    ck_assert_int_eq(got->n[id], max);
    for (int k = 0; k < max; k++) ck_assert_int_eq(got->toks[id][k], ref->toks[ref_id][k]);
    return s.prefix_hit_tokens - h0;
}

/* The partial-detach scene (llama, bs 4): 8 own blocks and one loan of `loan_blocks` under `tag` in
 * shared memory `lend`; rs[0] and then rs[1] run to completion (rs[1]'s blocks are the more recently
 * used), `ref` gets the reference tokens of rs[0..n). Caller owns the engine and `lend`. */
static kvb_engine *two_prompts_on_loan(rec *ref, rec *got, const req *rs, int n, shm *lend, int loan_blocks,
                                       uint64_t tag) {
    setup_model("llama", 3);
    make_prompts();
    reference(ref, rs, n);
    size_t bb = block_bytes(4);
    shm_open_(lend, (size_t)loan_blocks * bb);
    memset(got, 0, sizeof *got);
    kvb_engine *e = mk(got, (eopts){.bs = 4, .n_blocks = 8, .prefix = 1});
    ck_assert_int_eq(kvb_engine_attach(e, tag, lend->base, (size_t)loan_blocks * bb, loan_blocks), KVB_OK);
    for (int i = 0; i < 2; i++) {
        add(e, rs[i].id, rs[i].p, rs[i].n, rs[i].max);
        run(e);
    }
    return e;
}

/* A loan shrinks by its first blocks; the idle cached blocks there are kept (copied into free blocks
 * elsewhere) when there is room, and a live request on the range keeps running with identical tokens. */
KVB_TEST(partial_detach_keeps_hot_cache) {
    static rec ref, got;
    const req rs[] = {{0, P[0], 37, 30}, {2, P[2], 23, 20}, {1, P[1], 5, 40}};
    shm lend;
    kvb_engine *e = two_prompts_on_loan(&ref, &got, rs, 3, &lend, 64, 9); /* loan ids 8..71 */
    size_t bb = block_bytes(4);
    add(e, 1, P[1], 5, 40); /* live across the detach, its blocks on the range */
    steps(e, 3);
    int live, cached;
    range_census(e, 8, 24, &live, &cached);
    ck_assert_int_ge(cached, 12);
    ck_assert_int_gt(live, 0);
    kvb_detach_stats ds;
    ck_assert_int_eq(kvb_engine_detach_front(e, 9, 0, 0, &ds), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_engine_detach_front(e, 9, 65, 0, &ds), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_engine_detach_front(e, 9, 24, 0, &ds), KVB_OK);
    ck_assert_int_eq(ds.kept, cached); /* room for all of them */
    ck_assert_int_eq(ds.dropped, 0);
    ck_assert_int_eq(ds.moved, live);
    ck_assert_int_eq(ds.preempted, 0);
    /* the loan keeps its end, same tag */
    uint64_t tag;
    int nb;
    ck_assert_int_eq(kvb_engine_loans(e, &tag, &nb, 1), 1);
    ck_assert_uint_eq(tag, 9);
    ck_assert_int_eq(nb, 40);
    ck_assert_int_eq(kvb_engine_n_borrowed(e), 40);
    kvb_block_pool *p = kvb_engine_pool(e);
    for (int32_t i = 8; i < 32; i++) ck_assert_int_eq(kvb_block_pool_has(p, i), 0);
    for (int32_t i = 32; i < 72; i++) ck_assert_int_eq(kvb_block_pool_has(p, i), 1);
    poison(lend.base, 24 * bb); /* nothing may read the front any more */
    run(e);
    assert_same(&ref, &got, rs, 3);
    /* every cached block still serves (the pool holds them all): both prompts hit all their full blocks */
    ck_assert_uint_eq(rerun_hits(e, &got, 3, P[0], 37, 30, &ref, 0), 36);
    ck_assert_uint_eq(rerun_hits(e, &got, 4, P[2], 23, 20, &ref, 2), 20);
    /* the rest of the loan goes whole */
    ck_assert_int_eq(kvb_engine_detach(e, 9, 0, &ds), KVB_OK);
    ck_assert_int_eq(kvb_engine_n_borrowed(e), 0);
    assert_no_leak(e);
    kvb_engine_destroy(e);
    shm_close(&lend);
    teardown_model();
}
KVB_TEST_END

/* Without free room the range's cached blocks displace colder ones elsewhere, most recent first: after
 * the detach the newest prompt still hits in full, and what had no colder block to displace is dropped. */
KVB_TEST(partial_detach_keeps_most_recent) {
    static rec ref, got;
    const req rs[] = {{0, P[0], 37, 30}, {2, P[2], 23, 20}};
    shm lend;
    kvb_engine *e = two_prompts_on_loan(&ref, &got, rs, 2, &lend, 20, 4); /* loan ids 8..27 */
    size_t bb = block_bytes(4);
    int live, cached;
    range_census(e, 8, 12, &live, &cached);
    ck_assert_int_eq(live, 0);
    ck_assert_int_lt(kvb_block_pool_n_free(kvb_engine_pool(e)), cached); /* too few free blocks for all */
    kvb_detach_stats ds;
    ck_assert_int_eq(kvb_engine_detach_front(e, 4, 12, 0, &ds), KVB_OK);
    printf("partial detach without room: %d cached on the range, %d kept, %d dropped\n", cached, ds.kept, ds.dropped);
    ck_assert_int_eq(ds.kept + ds.dropped, cached);
    ck_assert_int_gt(ds.kept, 0);
    ck_assert_int_eq(kvb_engine_n_borrowed(e), 8);
    poison(lend.base, 12 * bb);
    ck_assert_uint_eq(rerun_hits(e, &got, 4, P[2], 23, 20, &ref, 2), 20); /* the newest prompt: all 5 blocks */
    assert_same(&ref, &got, rs, 2);
    assert_no_leak(e);
    kvb_engine_destroy(e);
    shm_close(&lend);
    teardown_model();
}
KVB_TEST_END

/* ---------------------------------------------------------------- (e) LSC streaming */

/* One run of the LSC scenario with block size `bs`: own pool of 2 blocks, one loan, requests with
 * a shared prefix and chunked prefill (a 16-token budget), a second loan attached mid-run, and a
 * detach of the first loan mid-run. Returns the stats; `mem` is the lender's memory afterwards. */
static void lsc_scenario(int bs, int stream, rec *got, const req *rs, unsigned char *mem, size_t mem_bytes,
                         kvb_engine_stats *out) {
    size_t bb = block_bytes(bs);
    int n_loan = (int)(mem_bytes / bb / 2);
    memset(got, 0, sizeof *got);
    kvb_engine *e = mk(got, (eopts){.bs = bs, .n_blocks = 2, .budget = 16, .prefix = 1, .stream = stream});
    ck_assert_int_eq(kvb_engine_attach(e, 1, mem, (size_t)n_loan * bb, n_loan), KVB_OK);
    add(e, rs[0].id, rs[0].p, rs[0].n, rs[0].max);
    steps(e, 3); /* 37 tokens in chunks of 16: published blocks for request 1 to share */
    add(e, rs[1].id, rs[1].p, rs[1].n, rs[1].max);
    add(e, rs[2].id, rs[2].p, rs[2].n, rs[2].max);
    steps(e, 5);
    ck_assert_int_gt(borrowed_referenced(e), 0);
    ck_assert_int_eq(kvb_engine_attach(e, 2, mem + (size_t)n_loan * bb, (size_t)n_loan * bb, n_loan), KVB_OK);
    steps(e, 5);
    kvb_detach_stats ds;
    ck_assert_int_eq(kvb_engine_detach(e, 1, 0, &ds), KVB_OK);
    ck_assert_int_gt(ds.moved, 0);
    run(e);
    kvb_engine_get_stats(e, out);
    assert_no_leak(e);
    kvb_engine_destroy(e);
}

KVB_TEST(lsc_stream_lossless) {
    setup_model("llama", 3);
    make_prompts();
    req rs[4];
    detach_requests(rs);
    static rec ref, inplace, streamed;
    reference(&ref, rs, 3);
    const int sizes[] = {1, 4, 16};
    for (size_t k = 0; k < KVB_ARRAY_LEN(sizes); k++) {
        int bs = sizes[k];
        size_t bytes = block_bytes(bs) * 2 * (size_t)KVB_DIV_CEIL(200, bs);
        shm a, b;
        shm_open_(&a, bytes);
        shm_open_(&b, bytes);
        kvb_engine_stats sa, sb;
        lsc_scenario(bs, 0, &inplace, rs, a.base, bytes, &sa);
        lsc_scenario(bs, 1, &streamed, rs, b.base, bytes, &sb);
        assert_same(&ref, &inplace, rs, 3);
        assert_same(&ref, &streamed, rs, 3);
        ck_assert_uint_eq(sa.lsc_loads, 0);
        ck_assert_uint_eq(sa.lsc_stores, 0);
        ck_assert_uint_gt(sb.lsc_loads, 0);
        ck_assert_uint_gt(sb.lsc_stores, 0);
        ck_assert_uint_eq(sb.lsc_loads % (uint64_t)n_layers, 0); /* every layer of each streamed block */
        ck_assert_uint_le(sb.lsc_stores, sb.lsc_loads);
        /* the stores put exactly the in-place run's KV into the borrowed memory */
        ck_assert_int_eq(memcmp(a.base, b.base, bytes), 0);
        printf("lsc bs %d: %llu slices loaded, %llu stored\n", bs, (unsigned long long)sb.lsc_loads,
               (unsigned long long)sb.lsc_stores);
        shm_close(&a);
        shm_close(&b);
    }
    teardown_model();
}
KVB_TEST_END

/* Issue 10: with lenders_bytes the layer stream cache comes out of the master's KV budget (Eq. 1-5 with
 * two single-layer buffers per streamed block): own blocks + LSC never exceed the budget, an attach
 * beyond what the LSC streams is refused and changes nothing, and streaming stays lossless. */
KVB_TEST(lsc_within_budget) {
    setup_model("llama", 3);
    make_prompts();
    req rs[4];
    detach_requests(rs);
    static rec ref, got;
    reference(&ref, rs, 3);
    size_t bb = block_bytes(4), lb = bb / (size_t)n_layers;
    shm own, lend;
    shm_open_(&own, 40 * bb); /* the master's budget: 40 blocks, K_master = 120 single-layer blocks */
    shm_open_(&lend, 25 * bb);
    memset(&got, 0, sizeof got);
    /* K = 24 full-layer blocks lendable: n_stream = min(24, (120 - 3) / 2) = 24, the LSC takes
     * ceil(48 / 3) = 16 blocks, the pool keeps 24 */
    kvb_engine *e = mk(&got, (eopts){.bs = 4, .n_blocks = 40, .prefix = 1, .stream = 1, .mem = own.base,
                                     .mem_bytes = 40 * bb, .lenders_bytes = (long long)(24 * bb)});
    kvb_engine_stats s;
    kvb_engine_get_stats(e, &s);
    ck_assert_int_eq(kvb_engine_capacity(e), 24);
    ck_assert_int_eq(s.stage_slots, 24);
    ck_assert_int_eq(kvb_engine_max_borrowed(e), 24); /* what the node master registers (max_borrow) */
    ck_assert_uint_le((size_t)kvb_engine_capacity(e) * bb + (size_t)s.stage_slots * 2 * lb, 40 * bb);
    ck_assert_int_eq(kvb_engine_attach(e, 1, lend.base, 24 * bb, 24), KVB_OK);
    /* one block more than the LSC streams: refused, nothing attached */
    ck_assert_int_ne(kvb_engine_attach(e, 2, lend.base + 24 * bb, bb, 1), KVB_OK);
    ck_assert_int_eq(kvb_engine_n_borrowed(e), 24);
    ck_assert_int_eq(kvb_engine_loans(e, NULL, NULL, 0), 1);
    start_detach_requests(e, rs);
    run(e);
    assert_same(&ref, &got, rs, 3);
    kvb_engine_get_stats(e, &s);
    ck_assert_uint_gt(s.lsc_loads, 0); /* borrowed blocks were streamed */
    ck_assert_int_eq(s.stage_slots, 24);
    assert_no_leak(e);
    kvb_engine_destroy(e);
    shm_close(&lend);
    shm_close(&own);
    teardown_model();
}
KVB_TEST_END

/* ---------------------------------------------------------------- (f) id ranges are reused */

KVB_TEST(attach_detach_cycles) {
    setup_model("llama", 2);
    make_prompts();
    static rec ref, got;
    const req rs[] = {{0, P[0], 37, 12}};
    reference(&ref, rs, 1);
    size_t bb = block_bytes(4);
    shm lend;
    shm_open_(&lend, 64 * bb);
    memset(&got, 0, sizeof got);
    kvb_engine *e = mk(&got, (eopts){.bs = 4, .n_blocks = 4, .prefix = 0});
    kvb_block_pool *p = kvb_engine_pool(e);
    /* a long-lived loan of 4 blocks (ids 4..7); the request (13 blocks) always needs a second loan,
     * which comes and goes: on even cycles the next loan arrives before the old one leaves (its live
     * blocks move there), on odd ones after (they are preempted); every third detach is a dead
     * lender's */
    ck_assert_int_eq(kvb_engine_attach(e, 1000, lend.base, 4 * bb, 4), KVB_OK);
    int most = 0, moved = 0;
    for (int i = 0; i < 24; i++) {
        int n = 8 + (i * 5) % 8, n2 = 8 + (i * 3) % 8;
        unsigned char *m = lend.base + (size_t)(4 + (i * 3) % 20) * bb, *m2 = lend.base + 42 * bb;
        uint64_t tag = 2000 + (uint64_t)i, tag2 = 3000 + (uint64_t)i;
        ck_assert_int_eq(kvb_engine_attach(e, tag, m, (size_t)n * bb, n), KVB_OK);
        ck_assert_int_eq(kvb_engine_n_borrowed(e), 4 + n);
        most = KVB_MAX(most, kvb_block_pool_id_limit(p));
        add(e, (uint64_t)i, P[0], 37, 12);
        steps(e, 1 + i % 4);
        ck_assert_int_gt(borrowed_referenced(e), 4); /* the prefill reached the cycling loan */
        if (i % 2 == 0) ck_assert_int_eq(kvb_engine_attach(e, tag2, m2, (size_t)n2 * bb, n2), KVB_OK);
        most = KVB_MAX(most, kvb_block_pool_id_limit(p));
        kvb_detach_stats ds;
        ck_assert_int_eq(kvb_engine_detach(e, tag, i % 3 == 2, &ds), KVB_OK);
        if (i % 2 == 0 && i % 3 != 2) {
            ck_assert_int_gt(ds.moved, 0);
            ck_assert_int_eq(ds.preempted, 0);
        } else {
            ck_assert_int_eq(ds.moved, 0);
            ck_assert_int_eq(ds.preempted, 1);
        }
        moved += ds.moved;
        if (i % 2 == 1) ck_assert_int_eq(kvb_engine_attach(e, tag2, m2, (size_t)n2 * bb, n2), KVB_OK);
        most = KVB_MAX(most, kvb_block_pool_id_limit(p));
        run(e);
        ck_assert_int_eq(kvb_engine_detach(e, tag2, 0, NULL), KVB_OK);
        ck_assert_int_eq(kvb_engine_capacity(e), 4);
        ck_assert_int_eq(kvb_block_pool_id_limit(p), 8); /* back to own + the long-lived loan */
        ck_assert_int_eq(got.n[i], 12);
        for (int k = 0; k < 12; k++) ck_assert_int_eq(got.toks[i][k], ref.toks[0][k]);
    }
    ck_assert_int_gt(moved, 0);
    ck_assert_int_le(most, 8 + 15 + 15);
    ck_assert_int_eq(kvb_engine_detach(e, 1000, 0, NULL), KVB_OK);
    ck_assert_int_eq(kvb_block_pool_id_limit(p), 4);
    assert_no_leak(e);
    kvb_engine_destroy(e);
    shm_close(&lend);
    teardown_model();
}
KVB_TEST_END

KVB_TEST_MAIN("lending", KVB_T(pool_segments, 20), KVB_T(prefix_on_segments, 10), KVB_T(worker_shrink_grow, 60),
              KVB_T(master_borrowed_session, 60), KVB_T(detach_moves_live_blocks, 60),
              KVB_T(detach_preempts_without_free_blocks, 60), KVB_T(detach_lender_dead, 60), KVB_T(stalled_head_overtaken_then_fails, 60), KVB_T(master_waits_for_loans, 60),
              KVB_T(detach_drops_cached_prefix, 60), KVB_T(partial_detach_keeps_hot_cache, 60),
              KVB_T(partial_detach_keeps_most_recent, 60), KVB_T(lsc_stream_lossless, 120), KVB_T(lsc_within_budget, 60),
              KVB_T(attach_detach_cycles, 120))
