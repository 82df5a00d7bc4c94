/* Unit tests of common/mem (shared-memory regions) and common/kv (block pool, block tables, prefix
 * cache), with real POSIX shared memory and real processes. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include "common/kv/block_pool.h"
#include "common/kv/block_table.h"
#include "common/kv/prefix_cache.h"
#include "common/kv/prefix_cache_impl.h"
#include "common/mem/region.h"
#include "tests/harness.h"

/* Every region these tests create has a tag "kvbt<what><pid>": unique to the test process (other
 * suites and builds may run at the same time), and recognisable so that sweep_stale() can remove what a
 * failed run left behind (a failing check assertion exits the test without running its cleanup). */
static void sweep_stale(void) {
    DIR *d = opendir("/dev/shm");
    if (!d) return;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (strncmp(de->d_name, "kvb-kvbt", 8) != 0) continue;
        /* kvb-<tag>-<pid>-<seq>: the pid is the second-to-last field */
        char *last = strrchr(de->d_name, '-');
        if (!last || last == de->d_name) continue;
        char *p = last - 1;
        while (p > de->d_name && *p != '-') p--;
        long pid = strtol(p + 1, NULL, 10);
        if (pid <= 1 || kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue; /* alive (or not ours) */
        char name[300];
        snprintf(name, sizeof name, "/%s", de->d_name);
        shm_unlink(name);
    }
    closedir(d);
}

static void make_tag(char *buf, size_t n, const char *what) {
    sweep_stale();
    snprintf(buf, n, "kvbt%s%ld", what, (long)getpid());
}

static int shm_exists(const char *handle) {
    int fd = shm_open(handle, O_RDONLY, 0);
    if (fd < 0) return errno == ENOENT ? 0 : -1;
    close(fd);
    return 1;
}

/* ================================================================ regions */

KVB_TEST(region_share_fork) {
    char tag[32];
    make_tag(tag, sizeof tag, "share");
    umask(0277); /* shm_open alone would create 0400: the region must still be 0600 */
    kvb_region *r = NULL;
    const size_t bytes = 3 * 4096 + 100;
    ck_assert_int_eq(kvb_region_create(tag, bytes, &r), KVB_OK);
    ck_assert_ptr_nonnull(r);
    ck_assert_int_eq(kvb_region_is_owner(r), 1);
    ck_assert_uint_eq(kvb_region_size(r), bytes);
    const char *h = kvb_region_handle(r);
    char want_prefix[64];
    snprintf(want_prefix, sizeof want_prefix, "/kvb-%s-%ld-", tag, (long)getpid());
    ck_assert_int_eq(strncmp(h, want_prefix, strlen(want_prefix)), 0);
    ck_assert_uint_lt(strlen(h), KVB_REGION_HANDLE_MAX);

    char path[128];
    snprintf(path, sizeof path, "/dev/shm%s", h);
    int fd = open(path, O_RDONLY);
    ck_assert_int_ge(fd, 0);
    struct stat sb;
    ck_assert_int_eq(fstat(fd, &sb), 0);
    close(fd);
    ck_assert_int_eq(sb.st_mode & 07777, 0600);
    ck_assert_int_eq(sb.st_uid, getuid());
    ck_assert_int_eq(sb.st_size, (off_t)bytes);

    unsigned char *base = kvb_region_base(r);
    for (size_t i = 0; i < bytes; i++) ck_assert_uint_eq(base[i], 0); /* zero-filled */

    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        /* Child: import by handle, write a pattern, unmap (never unlink). */
        kvb_region *m = NULL;
        if (kvb_region_import(h, &m) != KVB_OK) _exit(10);
        if (kvb_region_is_owner(m) || kvb_region_size(m) != bytes) _exit(11);
        if (strcmp(kvb_region_handle(m), h) != 0) _exit(12);
        unsigned char *p = kvb_region_base(m);
        for (size_t i = 0; i < bytes; i++) p[i] = (unsigned char)(i * 7 + 3);
        kvb_region_destroy(m);
        _exit(0);
    }
    int status = 0;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert(WIFEXITED(status));
    ck_assert_int_eq(WEXITSTATUS(status), 0);
    for (size_t i = 0; i < bytes; i++) ck_assert_uint_eq(base[i], (unsigned char)(i * 7 + 3));
    ck_assert_int_eq(shm_exists(h), 1); /* the child's destroy did not unlink */

    /* An importer in this process: destroy unmaps only; the owner's still sees and owns it. */
    kvb_region *imp = NULL;
    ck_assert_int_eq(kvb_region_import(h, &imp), KVB_OK);
    ck_assert_int_eq(kvb_region_is_owner(imp), 0);
    ck_assert_ptr_ne(kvb_region_base(imp), base);
    ((unsigned char *)kvb_region_base(imp))[5] = 0xab;
    ck_assert_uint_eq(base[5], 0xab);
    kvb_region_destroy(imp);
    ck_assert_int_eq(shm_exists(h), 1);

    char saved[KVB_REGION_HANDLE_MAX];
    snprintf(saved, sizeof saved, "%s", h);
    kvb_region_destroy(r);
    errno = 0;
    ck_assert_int_lt(shm_open(saved, O_RDWR, 0), 0);
    ck_assert_int_eq(errno, ENOENT);
    kvb_region *gone = (kvb_region *)1;
    ck_assert_int_eq(kvb_region_import(saved, &gone), KVB_ERR_NOT_FOUND);
    ck_assert_ptr_null(gone);
    kvb_region_destroy(NULL); /* NULL-safe */
}
KVB_TEST_END

KVB_TEST(region_names_unique) {
    char tag[32];
    make_tag(tag, sizeof tag, "uniq");
    kvb_region *a = NULL, *b = NULL;
    ck_assert_int_eq(kvb_region_create(tag, 64, &a), KVB_OK);
    ck_assert_int_eq(kvb_region_create(tag, 64, &b), KVB_OK);
    ck_assert_str_ne(kvb_region_handle(a), kvb_region_handle(b));
    ((char *)kvb_region_base(a))[0] = 1;
    ck_assert_int_eq(((char *)kvb_region_base(b))[0], 0);
    kvb_region_destroy(a);
    kvb_region_destroy(b);
}
KVB_TEST_END

KVB_TEST(region_bad_input) {
    kvb_region *r = (kvb_region *)1;
    char missing[64];
    snprintf(missing, sizeof missing, "/kvb-kvbtmissing%ld-%ld-999999", (long)getpid(), (long)getpid());
    ck_assert_int_eq(kvb_region_import(missing, &r), KVB_ERR_NOT_FOUND);
    ck_assert_ptr_null(r);

    const char *bad_tags[] = {"", "a/b", "a b", "a.b", "dot.", "ä", "x\n", "abcdefghijklmnopqrstuvwxyzabcdefghijklmno" /* 41 */};
    for (size_t i = 0; i < KVB_ARRAY_LEN(bad_tags); i++) {
        r = (kvb_region *)1;
        ck_assert_int_eq(kvb_region_create(bad_tags[i], 64, &r), KVB_ERR_INVALID);
        ck_assert_ptr_null(r);
        ck_assert_int_eq(kvb_region_unlink_stale(bad_tags[i], NULL), KVB_ERR_INVALID);
    }
    ck_assert_int_eq(kvb_region_create(NULL, 64, &r), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_region_unlink_stale(NULL, NULL), KVB_ERR_INVALID);

    char tag[32];
    make_tag(tag, sizeof tag, "bad");
    ck_assert_int_eq(kvb_region_create(tag, 0, &r), KVB_ERR_INVALID); /* empty region */

    /* The longest tag works, with every allowed character class. */
    char longest[41] = "kvbtAZ09-_";
    snprintf(longest + 10, sizeof longest - 10, "%030ld", (long)getpid());
    ck_assert_uint_eq(strlen(longest), 40);
    ck_assert_int_eq(kvb_region_create(longest, 64, &r), KVB_OK);
    ck_assert_uint_lt(strlen(kvb_region_handle(r)), KVB_REGION_HANDLE_MAX);
    kvb_region_destroy(r);

    const char *bad_handles[] = {"", "/", "noslash", "/a/b", "/..", "/with space",
                                 "/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
                                 "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"};
    for (size_t i = 0; i < KVB_ARRAY_LEN(bad_handles); i++)
        ck_assert_int_eq(kvb_region_import(bad_handles[i], &r), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_region_import(NULL, &r), KVB_ERR_INVALID);
}
KVB_TEST_END

/* The stale-segment cleanup removes the objects of dead processes only: a live process's (ours here,
 * another node's of the same name in life) stay, and a longer tag that starts with ours is not ours. */
KVB_TEST(region_unlink_stale) {
    char tag[32], longer[40];
    make_tag(tag, sizeof tag, "ul");
    snprintf(longer, sizeof longer, "%s-x", tag); /* starts with "<tag>-": must survive */
    kvb_region *a = NULL, *c = NULL;
    ck_assert_int_eq(kvb_region_create(tag, 128, &a), KVB_OK);
    ck_assert_int_eq(kvb_region_create(longer, 128, &c), KVB_OK);
    /* A segment of a crashed process (a child that exited and was reaped) and one of a live process
     * that is not us (our parent: the test runner) with our tag. */
    pid_t dead = fork();
    ck_assert_int_ge(dead, 0);
    if (dead == 0) _exit(0);
    ck_assert_int_eq(waitpid(dead, NULL, 0), dead);
    char stale[64], live[64], longer_dead[80];
    snprintf(stale, sizeof stale, "/kvb-%s-%d-77", tag, (int)dead);
    snprintf(live, sizeof live, "/kvb-%s-%d-78", tag, (int)getppid());
    snprintf(longer_dead, sizeof longer_dead, "/kvb-%s-%d-79", longer, (int)dead);
    const char *made[] = {stale, live, longer_dead};
    for (int i = 0; i < 3; i++) {
        int fd = shm_open(made[i], O_CREAT | O_EXCL | O_RDWR, 0600);
        ck_assert_int_ge(fd, 0);
        close(fd);
    }
    int n = -1;
    ck_assert_int_eq(kvb_region_unlink_stale(tag, &n), KVB_OK);
    ck_assert_int_eq(n, 1);
    ck_assert_int_eq(shm_exists(stale), 0);
    ck_assert_int_eq(shm_exists(live), 1);
    ck_assert_int_eq(shm_exists(kvb_region_handle(a)), 1);
    ck_assert_int_eq(shm_exists(kvb_region_handle(c)), 1);
    ck_assert_int_eq(shm_exists(longer_dead), 1);
    ck_assert_int_eq(kvb_region_unlink_stale(tag, &n), KVB_OK);
    ck_assert_int_eq(n, 0);
    ck_assert_int_eq(kvb_region_unlink_stale(longer, &n), KVB_OK);
    ck_assert_int_eq(n, 1);
    ck_assert_int_eq(shm_exists(longer_dead), 0);
    ck_assert_int_eq(shm_exists(kvb_region_handle(c)), 1);
    shm_unlink(live);
    kvb_region_destroy(a);
    kvb_region_destroy(c);
}
KVB_TEST_END

/* ================================================================ block pool */

static const kvb_kv_geom k_geom = {.n_layers = 3, .n_kv_heads = 2, .head_dim = 4, .block_size = 4, .elem_size = 4};

KVB_TEST(geom_check) {
    kvb_kv_geom g = k_geom;
    ck_assert_int_eq(kvb_kv_geom_check(&g), KVB_OK);
    ck_assert_uint_eq(kvb_kv_layer_bytes(&g), 2u * 4 * 2 * 4 * 4);
    ck_assert_uint_eq(kvb_kv_block_bytes(&g), 3u * 2 * 4 * 2 * 4 * 4);
    ck_assert_int_eq(kvb_kv_geom_check(NULL), KVB_ERR_INVALID);
    int *fields[] = {&g.n_layers, &g.n_kv_heads, &g.head_dim, &g.block_size, &g.elem_size};
    for (size_t f = 0; f < KVB_ARRAY_LEN(fields); f++) {
        int keep = *fields[f];
        *fields[f] = 0;
        ck_assert_int_eq(kvb_kv_geom_check(&g), KVB_ERR_INVALID);
        ck_assert_uint_eq(kvb_kv_block_bytes(&g), 0);
        *fields[f] = -1;
        ck_assert_int_eq(kvb_kv_geom_check(&g), KVB_ERR_INVALID);
        *fields[f] = keep;
    }
    kvb_kv_geom big = {INT_MAX, INT_MAX, INT_MAX, INT_MAX, 8}; /* 2^158 bytes */
    ck_assert_int_eq(kvb_kv_geom_check(&big), KVB_ERR_INVALID);
    ck_assert_uint_eq(kvb_kv_block_bytes(&big), 0);
    kvb_kv_geom edge = {1, 1, 1, 1, 1}; /* smallest legal block: 2 bytes */
    ck_assert_int_eq(kvb_kv_geom_check(&edge), KVB_OK);
    ck_assert_uint_eq(kvb_kv_block_bytes(&edge), 2);
}
KVB_TEST_END

KVB_TEST(pool_layout) {
    size_t bb = kvb_kv_block_bytes(&k_geom), lb = kvb_kv_layer_bytes(&k_geom);
    size_t mem_bytes = 10 * bb + bb / 2; /* capacity 10, a partial block is ignored */
    unsigned char *mem = malloc(mem_bytes);
    kvb_block_pool *p = NULL;
    ck_assert_int_eq(kvb_block_pool_create(&k_geom, mem, mem_bytes, 11, &p), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_block_pool_create(&k_geom, mem, mem_bytes, -1, &p), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_block_pool_create(&k_geom, mem, bb - 1, 0, &p), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_block_pool_create(&k_geom, NULL, mem_bytes, 1, &p), KVB_ERR_INVALID);
    kvb_kv_geom bad = k_geom;
    bad.head_dim = 0;
    ck_assert_int_eq(kvb_block_pool_create(&bad, mem, mem_bytes, 1, &p), KVB_ERR_INVALID);
    ck_assert_ptr_null(p);

    ck_assert_int_eq(kvb_block_pool_create(&k_geom, mem, mem_bytes, 6, &p), KVB_OK);
    ck_assert_int_eq(kvb_block_pool_capacity(p), 10);
    ck_assert_int_eq(kvb_block_pool_n_blocks(p), 6);
    ck_assert_int_eq(kvb_block_pool_n_free(p), 6);
    ck_assert_int_eq(memcmp(kvb_block_pool_geom(p), &k_geom, sizeof k_geom), 0);
    for (int32_t i = 0; i < 10; i++) {
        ck_assert_ptr_eq(kvb_block_pool_block(p, i), mem + (size_t)i * bb);
        for (int l = 0; l < k_geom.n_layers; l++)
            ck_assert_ptr_eq(kvb_block_pool_block_layer(p, i, l), mem + (size_t)i * bb + (size_t)l * lb);
    }
    /* The last layer of a block ends exactly where the next block starts. */
    ck_assert_ptr_eq((unsigned char *)kvb_block_pool_block_layer(p, 2, k_geom.n_layers - 1) + lb,
                     kvb_block_pool_block(p, 3));
    kvb_block_pool_destroy(p);
    kvb_block_pool_destroy(NULL);
    free(mem);
}
KVB_TEST_END

KVB_TEST(pool_alloc_ref) {
    size_t bb = kvb_kv_block_bytes(&k_geom);
    void *mem = malloc(8 * bb);
    kvb_block_pool *p = NULL;
    ck_assert_int_eq(kvb_block_pool_create(&k_geom, mem, 8 * bb, 6, &p), KVB_OK);
    int32_t id = -1;
    for (int32_t i = 0; i < 6; i++) {
        ck_assert_int_eq(kvb_block_pool_alloc(p, &id), KVB_OK);
        ck_assert_int_eq(id, i); /* lowest first */
        ck_assert_int_eq(kvb_block_pool_refcount(p, id), 1);
        ck_assert_int_eq(kvb_block_pool_is_free(p, id), 0);
    }
    ck_assert_int_eq(kvb_block_pool_n_free(p), 0);
    ck_assert_int_eq(kvb_block_pool_alloc(p, &id), KVB_ERR_EXHAUSTED);
    kvb_block_pool_ref(p, 3);
    ck_assert_int_eq(kvb_block_pool_refcount(p, 3), 2);
    kvb_block_pool_unref(p, 3);
    ck_assert_int_eq(kvb_block_pool_refcount(p, 3), 1);
    ck_assert_int_eq(kvb_block_pool_n_free(p), 0);
    kvb_block_pool_unref(p, 4);
    kvb_block_pool_unref(p, 3);
    kvb_block_pool_unref(p, 1);
    ck_assert_int_eq(kvb_block_pool_n_free(p), 3);
    ck_assert_int_eq(kvb_block_pool_is_free(p, 3), 1);
    ck_assert_int_eq(kvb_block_pool_alloc(p, &id), KVB_OK);
    ck_assert_int_eq(id, 1);
    ck_assert_int_eq(kvb_block_pool_alloc(p, &id), KVB_OK);
    ck_assert_int_eq(id, 3);
    ck_assert_int_eq(kvb_block_pool_alloc(p, &id), KVB_OK);
    ck_assert_int_eq(id, 4);
    ck_assert_int_eq(kvb_block_pool_alloc(p, &id), KVB_ERR_EXHAUSTED);
    ck_assert_int_eq(kvb_block_pool_is_free(p, 7), 0); /* past n_blocks */
    kvb_block_pool_destroy(p);
    free(mem);
}
KVB_TEST_END

/* Lowest-first over a pool large enough for a three-level free bitmap (> 64*64 blocks). */
KVB_TEST(pool_lowest_first_large) {
    kvb_kv_geom g = {1, 1, 1, 1, 1};
    const int n = 64 * 64 * 3 + 17;
    size_t bb = kvb_kv_block_bytes(&g);
    void *mem = malloc((size_t)n * bb);
    kvb_block_pool *p = NULL;
    ck_assert_int_eq(kvb_block_pool_create(&g, mem, (size_t)n * bb, n, &p), KVB_OK);
    int32_t id;
    for (int i = 0; i < n; i++) {
        ck_assert_int_eq(kvb_block_pool_alloc(p, &id), KVB_OK);
        ck_assert_int_eq(id, i);
    }
    ck_assert_int_eq(kvb_block_pool_alloc(p, &id), KVB_ERR_EXHAUSTED);
    /* Free a pseudo-random subset in a scrambled order; they come back in ascending order. */
    unsigned char *freed = calloc((size_t)n, 1);
    uint64_t x = 0x9e3779b97f4a7c15ull;
    int n_freed = 0;
    for (int k = 0; k < n; k++) {
        int i = (int)(((uint64_t)k * 7919u) % (uint64_t)n); /* a permutation: 7919 is prime, n is not a multiple */
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        if (x % 3 == 0) {
            kvb_block_pool_unref(p, i);
            freed[i] = 1;
            n_freed++;
        }
    }
    ck_assert_int_eq(kvb_block_pool_n_free(p), n_freed);
    for (int i = 0; i < n; i++) {
        if (!freed[i]) continue;
        ck_assert_int_eq(kvb_block_pool_alloc(p, &id), KVB_OK);
        ck_assert_int_eq(id, i);
    }
    ck_assert_int_eq(kvb_block_pool_alloc(p, &id), KVB_ERR_EXHAUSTED);
    free(freed);
    kvb_block_pool_destroy(p);
    free(mem);
}
KVB_TEST_END

KVB_TEST(pool_resize) {
    /* Over a real shared-memory region, as a worker's pool is. */
    char tag[32];
    make_tag(tag, sizeof tag, "rs");
    size_t bb = kvb_kv_block_bytes(&k_geom);
    kvb_region *r = NULL;
    ck_assert_int_eq(kvb_region_create(tag, 8 * bb, &r), KVB_OK);
    kvb_block_pool *p = NULL;
    ck_assert_int_eq(kvb_block_pool_create(&k_geom, kvb_region_base(r), kvb_region_size(r), 4, &p), KVB_OK);
    ck_assert_int_eq(kvb_block_pool_capacity(p), 8);
    int32_t id, ids[8];
    for (int i = 0; i < 4; i++) ck_assert_int_eq(kvb_block_pool_alloc(p, &ids[i]), KVB_OK);
    ck_assert_int_eq(kvb_block_pool_alloc(p, &id), KVB_ERR_EXHAUSTED);

    ck_assert_int_eq(kvb_block_pool_resize(p, 9), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_block_pool_resize(p, -1), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_block_pool_resize(p, 8), KVB_OK); /* grow */
    ck_assert_int_eq(kvb_block_pool_n_blocks(p), 8);
    ck_assert_int_eq(kvb_block_pool_n_free(p), 4);
    for (int i = 4; i < 8; i++) {
        ck_assert_int_eq(kvb_block_pool_alloc(p, &ids[i]), KVB_OK);
        ck_assert_int_eq(ids[i], i);
    }
    /* Fill every block with a pattern of its id; remember the addresses. */
    void *addr[8];
    for (int32_t i = 0; i < 8; i++) {
        addr[i] = kvb_block_pool_block(p, i);
        memset(addr[i], 0x40 + i, bb);
    }
    for (int i = 3; i < 8; i++)
        if (i != 6) kvb_block_pool_unref(p, i); /* block 6, in the tail, stays used */
    ck_assert_int_eq(kvb_block_pool_n_free(p), 4); /* 3, 4, 5, 7 */
    ck_assert_int_eq(kvb_block_pool_alloc(p, &id), KVB_OK);
    ck_assert_int_eq(id, 3);
    kvb_block_pool_unref(p, 3);
    ck_assert_int_eq(kvb_block_pool_resize(p, 4), KVB_ERR_STATE);
    ck_assert_int_eq(kvb_block_pool_resize(p, 6), KVB_ERR_STATE);
    ck_assert_int_eq(kvb_block_pool_n_blocks(p), 8); /* a refused shrink changes nothing */
    ck_assert_int_eq(kvb_block_pool_n_free(p), 4);
    ck_assert_int_eq(kvb_block_pool_resize(p, 7), KVB_OK); /* only block 7 goes */
    ck_assert_int_eq(kvb_block_pool_n_free(p), 3);
    kvb_block_pool_unref(p, 6);
    ck_assert_int_eq(kvb_block_pool_resize(p, 3), KVB_OK);
    ck_assert_int_eq(kvb_block_pool_n_blocks(p), 3);
    ck_assert_int_eq(kvb_block_pool_n_free(p), 0);
    ck_assert_int_eq(kvb_block_pool_alloc(p, &id), KVB_ERR_EXHAUSTED);
    ck_assert_int_eq(kvb_block_pool_is_free(p, 5), 0);

    ck_assert_int_eq(kvb_block_pool_resize(p, 8), KVB_OK);
    ck_assert_int_eq(kvb_block_pool_n_free(p), 5);
    /* No block moved and none was touched: every block kept its address and its bytes. */
    for (int32_t i = 0; i < 8; i++) {
        ck_assert_ptr_eq(kvb_block_pool_block(p, i), addr[i]);
        const unsigned char *b = addr[i];
        for (size_t k = 0; k < bb; k++) ck_assert_uint_eq(b[k], 0x40 + i);
    }
    for (int i = 3; i < 8; i++) {
        ck_assert_int_eq(kvb_block_pool_alloc(p, &id), KVB_OK);
        ck_assert_int_eq(id, i);
    }
    for (int i = 0; i < 8; i++) kvb_block_pool_unref(p, i);
    ck_assert_int_eq(kvb_block_pool_resize(p, 0), KVB_OK);
    ck_assert_int_eq(kvb_block_pool_alloc(p, &id), KVB_ERR_EXHAUSTED);
    kvb_block_pool_destroy(p);
    kvb_region_destroy(r);
}
KVB_TEST_END

typedef struct hook_log {
    int calls;
    int32_t order[64];
} hook_log;

/* Keeps even blocks, records every call. */
static int keep_even(void *ud, int32_t idx) {
    hook_log *h = ud;
    if (h->calls < 64) h->order[h->calls] = idx;
    h->calls++;
    return idx % 2 == 0;
}

KVB_TEST(pool_release_hook) {
    size_t bb = kvb_kv_block_bytes(&k_geom);
    void *mem = malloc(6 * bb);
    kvb_block_pool *p = NULL;
    ck_assert_int_eq(kvb_block_pool_create(&k_geom, mem, 6 * bb, 6, &p), KVB_OK);
    hook_log h = {0};
    kvb_block_pool_set_release_hook(p, keep_even, &h);
    int32_t id;
    for (int i = 0; i < 6; i++) ck_assert_int_eq(kvb_block_pool_alloc(p, &id), KVB_OK);
    kvb_block_pool_ref(p, 4);
    kvb_block_pool_unref(p, 4); /* not the last reference: no call */
    ck_assert_int_eq(h.calls, 0);
    kvb_block_pool_unref(p, 4);
    kvb_block_pool_unref(p, 5);
    ck_assert_int_eq(h.calls, 2);
    ck_assert_int_eq(h.order[0], 4);
    ck_assert_int_eq(h.order[1], 5);
    ck_assert_int_eq(kvb_block_pool_refcount(p, 4), 0);
    ck_assert_int_eq(kvb_block_pool_is_free(p, 4), 0); /* held */
    ck_assert_int_eq(kvb_block_pool_is_free(p, 5), 1);
    ck_assert_int_eq(kvb_block_pool_n_free(p), 1);
    ck_assert_int_eq(kvb_block_pool_resize(p, 4), KVB_ERR_STATE); /* held block 4 in the tail */
    ck_assert_int_eq(kvb_block_pool_alloc(p, &id), KVB_OK);
    ck_assert_int_eq(id, 5); /* the held block is not handed out */
    kvb_block_pool_unref(p, 5);
    /* The hook's owner may take a held block back into use ... */
    kvb_block_pool_ref(p, 4);
    ck_assert_int_eq(kvb_block_pool_refcount(p, 4), 1);
    kvb_block_pool_unref(p, 4);
    ck_assert_int_eq(h.calls, 4);
    /* ... or return it to the free list. */
    kvb_block_pool_free_block(p, 4);
    ck_assert_int_eq(kvb_block_pool_is_free(p, 4), 1);
    ck_assert_int_eq(kvb_block_pool_n_free(p), 2);
    ck_assert_int_eq(kvb_block_pool_resize(p, 4), KVB_OK);
    kvb_block_pool_set_release_hook(p, NULL, NULL);
    kvb_block_pool_unref(p, 2);
    ck_assert_int_eq(h.calls, 4); /* no hook any more */
    ck_assert_int_eq(kvb_block_pool_is_free(p, 2), 1);
    kvb_block_pool_destroy(p);
    free(mem);
}
KVB_TEST_END

/* Sliced pool: 4 physical blocks of 3 layers = 12 slices, 20 virtual ids. */
KVB_TEST(pool_sliced) {
    size_t bb = kvb_kv_block_bytes(&k_geom), lb = kvb_kv_layer_bytes(&k_geom);
    unsigned char *mem = malloc(4 * bb);
    kvb_block_pool *p = NULL;
    ck_assert_int_eq(kvb_block_pool_create_sliced(&k_geom, mem, 4 * bb, 5, 20, &p), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_block_pool_create_sliced(&k_geom, mem, 4 * bb, 4, 0, &p), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_block_pool_create_sliced(&k_geom, mem, 4 * bb, 4, 20, &p), KVB_OK);
    ck_assert(kvb_block_pool_is_sliced(p));
    ck_assert_int_eq(kvb_block_pool_n_slices(p), 12);
    ck_assert_int_eq(kvb_block_pool_n_free_slices(p), 12);
    ck_assert_int_eq(kvb_block_pool_n_free(p), 4); /* whole blocks */
    ck_assert_int_eq(kvb_block_pool_id_limit(p), 20);
    ck_assert_int_eq(kvb_block_pool_capacity(p), 4);
    int32_t id[6];
    for (int i = 0; i < 4; i++) {
        ck_assert_int_eq(kvb_block_pool_alloc(p, &id[i]), KVB_OK);
        ck_assert_int_eq(id[i], i);
        ck_assert_int_eq(kvb_block_pool_n_resident(p, id[i]), 3);
    }
    /* slices are handed out lowest first: block i's layers are slices 3i .. 3i+2, the block-major layout */
    for (int i = 0; i < 4; i++)
        for (int l = 0; l < 3; l++)
            ck_assert_ptr_eq(kvb_block_pool_block_layer(p, id[i], l), mem + (size_t)(3 * i + l) * lb);
    ck_assert_int_eq(kvb_block_pool_n_free(p), 0);
    ck_assert_int_eq(kvb_block_pool_alloc(p, &id[4]), KVB_ERR_EXHAUSTED);
    /* more ids than memory: a bare block has no slice until one is freed */
    ck_assert_int_eq(kvb_block_pool_alloc_bare(p, &id[4]), KVB_OK);
    ck_assert_int_eq(id[4], 4);
    ck_assert_int_eq(kvb_block_pool_n_resident(p, id[4]), 0);
    ck_assert_int_eq(kvb_block_pool_slice_alloc(p, id[4], 1), KVB_ERR_EXHAUSTED);
    memset(kvb_block_pool_block_layer(p, id[1], 2), 0x5a, lb);
    kvb_block_pool_slice_free(p, id[1], 0); /* block 1 moves layer 0 away: its slice serves block 4 */
    ck_assert(!kvb_block_pool_slice_resident(p, id[1], 0));
    ck_assert_int_eq(kvb_block_pool_slice_alloc(p, id[4], 1), KVB_OK);
    ck_assert_int_eq(kvb_block_pool_slice_alloc(p, id[4], 1), KVB_OK); /* already resident */
    ck_assert_ptr_eq(kvb_block_pool_block_layer(p, id[4], 1), mem + 3 * lb);
    ck_assert_int_eq(((unsigned char *)kvb_block_pool_block_layer(p, id[1], 2))[lb - 1], 0x5a);
    ck_assert_int_eq(kvb_block_pool_n_free_slices(p), 0);
    /* the last reference returns every slice with the id */
    kvb_block_pool_unref(p, id[2]);
    ck_assert_int_eq(kvb_block_pool_n_free_slices(p), 3);
    ck_assert_int_eq(kvb_block_pool_n_free(p), 1);
    ck_assert(kvb_block_pool_is_free(p, id[2]));
    /* scratch slices count against the same memory */
    int32_t sc;
    ck_assert_int_eq(kvb_block_pool_scratch_alloc(p, &sc), KVB_OK);
    ck_assert_int_eq(sc, 6);
    ck_assert_ptr_eq(kvb_block_pool_slice_addr(p, sc), mem + 6 * lb);
    ck_assert_int_eq(kvb_block_pool_n_free(p), 0);
    kvb_block_pool_scratch_free(p, sc);
    /* a held block keeps its slices until it is freed */
    hook_log h = {0};
    kvb_block_pool_set_release_hook(p, keep_even, &h);
    kvb_block_pool_unref(p, id[0]);
    ck_assert_int_eq(kvb_block_pool_n_free_slices(p), 3);
    ck_assert_int_eq(kvb_block_pool_slice_alloc(p, id[0], 0), KVB_OK); /* a held block may gain a layer */
    kvb_block_pool_free_block(p, id[0]);
    ck_assert_int_eq(kvb_block_pool_n_free_slices(p), 6);
    kvb_block_pool_set_release_hook(p, NULL, NULL);
    /* lending: the tail block's slices must be free; slices 6..11 are blocks 3 (in use) and ... */
    ck_assert_int_eq(kvb_block_pool_resize(p, 3), KVB_ERR_STATE);
    kvb_block_pool_unref(p, id[3]);
    ck_assert_int_eq(kvb_block_pool_resize(p, 3), KVB_OK);
    ck_assert_int_eq(kvb_block_pool_n_slices(p), 9);
    ck_assert_int_eq(kvb_block_pool_resize(p, 4), KVB_OK);
    ck_assert_int_eq(kvb_block_pool_n_slices(p), 12);
    int32_t first;
    ck_assert_int_eq(kvb_block_pool_attach(p, mem, 1, &first), KVB_ERR_UNSUPPORTED);
    ck_assert_int_eq(kvb_block_pool_detach(p, 4, 1), KVB_ERR_UNSUPPORTED);
    kvb_block_pool_destroy(p);
    /* a block-major pool has none of this */
    ck_assert_int_eq(kvb_block_pool_create(&k_geom, mem, 4 * bb, 4, &p), KVB_OK);
    ck_assert(!kvb_block_pool_is_sliced(p));
    ck_assert_int_eq(kvb_block_pool_alloc_bare(p, &id[0]), KVB_ERR_UNSUPPORTED);
    ck_assert_int_eq(kvb_block_pool_scratch_alloc(p, &sc), KVB_ERR_UNSUPPORTED);
    ck_assert_int_eq(kvb_block_pool_n_slices(p), 0);
    kvb_block_pool_destroy(p);
    free(mem);
}
KVB_TEST_END

/* Random operations on a sliced pool against a model: every resident (block, layer) keeps its bytes,
 * no two share a slice, the counts add up. */
KVB_TEST(pool_sliced_random) {
    enum { PHYS = 16, IDS = 64, L = 3 };
    kvb_kv_geom g = k_geom;
    size_t bb = kvb_kv_block_bytes(&g), lb = kvb_kv_layer_bytes(&g);
    unsigned char *mem = malloc(PHYS * bb);
    kvb_block_pool *p = NULL;
    ck_assert_int_eq(kvb_block_pool_create_sliced(&g, mem, PHYS * bb, PHYS, IDS, &p), KVB_OK);
    int live[IDS] = {0};
    unsigned char tag[IDS][L] = {{0}}; /* byte written into each resident slice, 0 when not resident */
    uint64_t x = 88172645463325252ull;
    int scratch[PHYS * L], n_scratch = 0;
    for (int it = 0; it < 20000; it++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        int op = (int)(x % 6), i = (int)((x >> 8) % IDS), l = (int)((x >> 20) % L);
        int32_t got;
        if (op == 0) {
            kvb_status st = kvb_block_pool_alloc(p, &got);
            if (st == KVB_OK) {
                live[got] = 1;
                for (int k = 0; k < L; k++) tag[got][k] = 0;
            } else {
                int n_live = 0;
                for (int b = 0; b < IDS; b++) n_live += live[b];
                ck_assert(kvb_block_pool_n_free_slices(p) < L || n_live == IDS);
            }
        } else if (op == 1) {
            if (kvb_block_pool_alloc_bare(p, &got) == KVB_OK) live[got] = 1;
        } else if (op == 2 && live[i]) {
            kvb_block_pool_unref(p, i);
            live[i] = 0;
            memset(tag[i], 0, L);
        } else if (op == 3 && live[i]) {
            if (kvb_block_pool_slice_alloc(p, i, l) == KVB_OK && !tag[i][l]) {
                tag[i][l] = (unsigned char)(1 + (x >> 32) % 250);
                memset(kvb_block_pool_block_layer(p, i, l), tag[i][l], lb);
            }
        } else if (op == 4 && live[i] && kvb_block_pool_slice_resident(p, i, l)) {
            kvb_block_pool_slice_free(p, i, l);
            tag[i][l] = 0;
        } else if (op == 5) {
            if (n_scratch && x >> 40 & 1) kvb_block_pool_scratch_free(p, scratch[--n_scratch]);
            else if (kvb_block_pool_scratch_alloc(p, &got) == KVB_OK) scratch[n_scratch++] = got;
        }
        if (it % 97) continue;
        int used = n_scratch;
        for (int b = 0; b < IDS; b++) {
            if (!live[b]) continue;
            for (int k = 0; k < L; k++) {
                if (!kvb_block_pool_slice_resident(p, b, k)) continue;
                used++;
                const unsigned char *q = kvb_block_pool_block_layer(p, b, k);
                if (tag[b][k]) ck_assert(q[0] == tag[b][k] && q[lb - 1] == tag[b][k]);
                for (int s2 = 0; s2 < n_scratch; s2++) ck_assert_ptr_ne(q, kvb_block_pool_slice_addr(p, scratch[s2]));
            }
        }
        ck_assert_int_eq(used + kvb_block_pool_n_free_slices(p), PHYS * L);
    }
    kvb_block_pool_destroy(p);
    free(mem);
}
KVB_TEST_END

KVB_TEST(block_table) {
    size_t bb = kvb_kv_block_bytes(&k_geom);
    void *mem = malloc(40 * bb);
    kvb_block_pool *p = NULL;
    ck_assert_int_eq(kvb_block_pool_create(&k_geom, mem, 40 * bb, 40, &p), KVB_OK);
    hook_log h = {0};
    kvb_block_pool_set_release_hook(p, keep_even, &h);
    kvb_block_table t = {0};
    for (int i = 0; i < 20; i++) {
        int32_t id;
        ck_assert_int_eq(kvb_block_pool_alloc(p, &id), KVB_OK);
        ck_assert_int_eq(kvb_block_table_push(&t, id), KVB_OK);
    }
    kvb_block_pool_ref(p, 7); /* someone else shares block 7 */
    ck_assert_int_eq(t.n, 20);
    ck_assert_int_ge(t.cap, 20);
    for (int i = 0; i < 20; i++) ck_assert_int_eq(t.ids[i], i);
    kvb_block_table_release(&t, p);
    ck_assert_int_eq(t.n, 0);
    for (int i = 0; i < 20; i++) ck_assert_int_eq(kvb_block_pool_refcount(p, i), i == 7 ? 1 : 0);
    /* The newest block was released first. */
    ck_assert_int_eq(h.calls, 19);
    ck_assert_int_eq(h.order[0], 19);
    ck_assert_int_eq(h.order[18], 0);
    ck_assert_int_eq(kvb_block_pool_n_free(p), 20 + 9); /* 20 untouched + odd ones except 7 */
    /* The table is reusable after a release. */
    ck_assert_int_eq(kvb_block_table_push(&t, 7), KVB_OK);
    kvb_block_table_release(&t, p);
    ck_assert_int_eq(kvb_block_pool_is_free(p, 7), 1);
    kvb_block_table_free(&t);
    ck_assert_ptr_null(t.ids);
    kvb_block_table_free(&t);
    kvb_block_table_free(NULL);
    kvb_block_pool_destroy(p);
    free(mem);
}
KVB_TEST_END

/* ================================================================ prefix cache */

/* A pool of n blocks (bs tokens each) with a prefix cache; released by fixture_free. */
typedef struct fixture {
    void *mem;
    kvb_block_pool *pool;
    kvb_prefix_cache *cache;
} fixture;

static void fixture_init(fixture *f, int block_size, int n_blocks, int capacity) {
    kvb_kv_geom g = {.n_layers = 2, .n_kv_heads = 1, .head_dim = 2, .block_size = block_size, .elem_size = 4};
    size_t bb = kvb_kv_block_bytes(&g);
    f->mem = calloc((size_t)capacity, bb);
    ck_assert_ptr_nonnull(f->mem);
    ck_assert_int_eq(kvb_block_pool_create(&g, f->mem, (size_t)capacity * bb, n_blocks, &f->pool), KVB_OK);
    ck_assert_int_eq(kvb_prefix_cache_create(f->pool, &f->cache), KVB_OK);
}

static void fixture_free(fixture *f) {
    ck_assert_int_eq(kvb__prefix_cache_check(f->cache), 0);
    kvb_prefix_cache_destroy(f->cache);
    kvb_block_pool_destroy(f->pool);
    free(f->mem);
}

static uint64_t ref_hash(uint64_t parent, const int32_t *tokens, int bs) {
    return XXH64(tokens, (size_t)bs * sizeof(int32_t), parent);
}

/* Allocates a block through the cache, publishes it under `parent` and returns it (still held). */
static int32_t alloc_publish(fixture *f, uint64_t parent, const int32_t *tokens, uint64_t *hash) {
    int32_t id = -1;
    ck_assert_int_eq(kvb_prefix_cache_alloc(f->cache, &id), KVB_OK);
    ck_assert_int_eq(kvb_prefix_cache_publish(f->cache, parent, tokens, id, hash), KVB_OK);
    return id;
}

KVB_TEST(prefix_hash_chain) {
    const int32_t a[4] = {1, 2, 3, 4}, b[4] = {1, 2, 3, 5};
    uint64_t h0 = kvb_prefix_hash(KVB_PREFIX_ROOT, a, 4);
    ck_assert_uint_eq(h0, ref_hash(KVB_PREFIX_ROOT, a, 4));
    ck_assert_uint_eq(h0, kvb_prefix_hash(KVB_PREFIX_ROOT, a, 4)); /* deterministic */
    ck_assert_uint_ne(h0, kvb_prefix_hash(KVB_PREFIX_ROOT, b, 4));
    /* The same tokens under different parents hash differently. */
    uint64_t ha = kvb_prefix_hash(h0, a, 4);
    uint64_t hb = kvb_prefix_hash(kvb_prefix_hash(KVB_PREFIX_ROOT, b, 4), a, 4);
    ck_assert_uint_ne(ha, hb);
    ck_assert_uint_ne(ha, h0);
    ck_assert_uint_eq(ha, ref_hash(h0, a, 4));
    /* Only block_size tokens count. */
    ck_assert_uint_eq(kvb_prefix_hash(KVB_PREFIX_ROOT, a, 3), kvb_prefix_hash(KVB_PREFIX_ROOT, b, 3));
}
KVB_TEST_END

KVB_TEST(prefix_publish_match) {
    fixture f;
    fixture_init(&f, 4, 8, 8);
    int32_t toks[14];
    for (int i = 0; i < 14; i++) toks[i] = 100 + i;
    uint64_t h[3], parent = KVB_PREFIX_ROOT;
    int32_t ids[3];
    for (int b = 0; b < 3; b++) {
        ids[b] = alloc_publish(&f, parent, toks + 4 * b, &h[b]);
        ck_assert_uint_eq(h[b], ref_hash(parent, toks + 4 * b, 4));
        parent = h[b];
    }
    ck_assert_int_eq(kvb_prefix_cache_n_cached(f.cache), 3);
    ck_assert_int_eq(kvb_prefix_cache_n_available(f.cache), 5); /* all 3 are referenced */
    for (int b = 0; b < 3; b++) kvb_block_pool_unref(f.pool, ids[b]);
    ck_assert_int_eq(kvb_prefix_cache_n_cached(f.cache), 3);
    ck_assert_int_eq(kvb_block_pool_n_free(f.pool), 5);
    ck_assert_int_eq(kvb_prefix_cache_n_available(f.cache), 8);

    int32_t out[8];
    uint64_t last = 0;
    ck_assert_int_eq(kvb_prefix_cache_match(f.cache, toks, 14, 8, out, &last), 3);
    for (int b = 0; b < 3; b++) {
        ck_assert_int_eq(out[b], ids[b]);
        ck_assert_int_eq(kvb_block_pool_refcount(f.pool, ids[b]), 1);
    }
    ck_assert_uint_eq(last, h[2]);
    ck_assert_int_eq(kvb_prefix_cache_n_available(f.cache), 5);
    ck_assert_int_eq(kvb_prefix_cache_match(f.cache, toks, 14, 2, out, &last), 2); /* max_blocks */
    ck_assert_uint_eq(last, h[1]);
    ck_assert_int_eq(kvb_block_pool_refcount(f.pool, ids[0]), 2);
    ck_assert_int_eq(kvb_block_pool_refcount(f.pool, ids[2]), 1);
    ck_assert_int_eq(kvb_prefix_cache_match(f.cache, toks, 11, 8, out, &last), 2); /* 11 tokens: 2 full blocks */
    ck_assert_uint_eq(last, h[1]);

    /* Partial match stops at the first miss, even when a later block would hit on its own. */
    int32_t other[12];
    memcpy(other, toks, sizeof other);
    other[5] = -7;
    ck_assert_int_eq(kvb_prefix_cache_match(f.cache, other, 12, 8, out, &last), 1);
    ck_assert_int_eq(out[0], ids[0]);
    ck_assert_uint_eq(last, h[0]);
    other[0] = -7;
    ck_assert_int_eq(kvb_prefix_cache_match(f.cache, other, 12, 8, out, &last), 0);
    ck_assert_uint_eq(last, KVB_PREFIX_ROOT);
    /* Block 1's tokens at position 0 have another parent: no hit. */
    ck_assert_int_eq(kvb_prefix_cache_match(f.cache, toks + 4, 4, 8, out, &last), 0);
    ck_assert_int_eq(kvb_prefix_cache_match(f.cache, toks, 3, 8, out, &last), 0); /* no full block */
    ck_assert_int_eq(kvb_prefix_cache_match(f.cache, toks, 14, 0, out, &last), 0);

    kvb_prefix_stats s;
    kvb_prefix_cache_stats(f.cache, &s);
    /* queries: 3 + 2 + 2 + (1 hit + 1 miss) + 1 miss + 1 miss = 11; hits 3 + 2 + 2 + 1 = 8 */
    ck_assert_uint_eq(s.queries, 11);
    ck_assert_uint_eq(s.hits, 8);
    ck_assert_uint_eq(s.evictions, 0);
    ck_assert_int_eq(kvb_block_pool_refcount(f.pool, ids[0]), 4);
    ck_assert_int_eq(kvb_block_pool_refcount(f.pool, ids[1]), 3);
    ck_assert_int_eq(kvb_block_pool_refcount(f.pool, ids[2]), 1);
    ck_assert_int_eq(kvb__prefix_cache_check(f.cache), 0);
    for (int k = 0; k < 4; k++) kvb_block_pool_unref(f.pool, ids[0]);
    for (int k = 0; k < 3; k++) kvb_block_pool_unref(f.pool, ids[1]);
    kvb_block_pool_unref(f.pool, ids[2]);
    ck_assert_int_eq(kvb_prefix_cache_n_available(f.cache), 8);
    fixture_free(&f);
}
KVB_TEST_END

KVB_TEST(prefix_publish_duplicate) {
    fixture f;
    fixture_init(&f, 2, 4, 4);
    const int32_t t[2] = {5, 6}, u[2] = {5, 7};
    uint64_t ha, hb;
    int32_t a = alloc_publish(&f, KVB_PREFIX_ROOT, t, &ha);
    int32_t b = -1;
    ck_assert_int_eq(kvb_prefix_cache_alloc(f.cache, &b), KVB_OK);
    ck_assert_int_ne(a, b);
    ck_assert_int_eq(kvb_prefix_cache_publish(f.cache, KVB_PREFIX_ROOT, t, b, &hb), KVB_OK);
    ck_assert_uint_eq(ha, hb);
    ck_assert_int_eq(kvb_prefix_cache_n_cached(f.cache), 1); /* the old entry stays */
    ck_assert_int_eq(kvb_block_pool_refcount(f.pool, b), 1);  /* idx untouched */
    kvb_block_pool_unref(f.pool, b);
    ck_assert_int_eq(kvb_block_pool_is_free(f.pool, b), 1); /* unpublished: straight to the free list */
    /* Re-publishing the same block with the same key is a no-op; with another key it is refused. */
    ck_assert_int_eq(kvb_prefix_cache_publish(f.cache, KVB_PREFIX_ROOT, t, a, NULL), KVB_OK);
    ck_assert_int_eq(kvb_prefix_cache_publish(f.cache, KVB_PREFIX_ROOT, u, a, NULL), KVB_ERR_STATE);
    ck_assert_int_eq(kvb_prefix_cache_n_cached(f.cache), 1);
    ck_assert_int_eq(kvb_prefix_cache_publish(f.cache, KVB_PREFIX_ROOT, NULL, a, NULL), KVB_ERR_INVALID);
    kvb_block_pool_unref(f.pool, a);
    int32_t out[2];
    uint64_t last;
    ck_assert_int_eq(kvb_prefix_cache_match(f.cache, t, 2, 2, out, &last), 1);
    ck_assert_int_eq(out[0], a);
    ck_assert_uint_eq(last, ha);
    ck_assert_int_eq(kvb_prefix_cache_match(f.cache, u, 2, 2, out, &last), 0);
    kvb_block_pool_unref(f.pool, a);
    fixture_free(&f);
}
KVB_TEST_END

KVB_TEST(prefix_lru_eviction) {
    fixture f;
    fixture_init(&f, 2, 4, 4);
    int32_t t[4][2] = {{10, 11}, {20, 21}, {30, 31}, {40, 41}};
    int32_t id[4];
    for (int i = 0; i < 4; i++) {
        id[i] = alloc_publish(&f, KVB_PREFIX_ROOT, t[i], NULL);
        ck_assert_int_eq(id[i], i);
    }
    int32_t x;
    ck_assert_int_eq(kvb_prefix_cache_alloc(f.cache, &x), KVB_ERR_EXHAUSTED); /* all referenced */
    ck_assert_int_eq(kvb_prefix_cache_n_available(f.cache), 0);
    /* Release order 2, 0, 3, 1: that is the LRU order. */
    const int order[4] = {2, 0, 3, 1};
    for (int k = 0; k < 4; k++) kvb_block_pool_unref(f.pool, id[order[k]]);
    ck_assert_int_eq(kvb_block_pool_n_free(f.pool), 0);
    ck_assert_int_eq(kvb_prefix_cache_n_available(f.cache), 4);
    /* A hit on 0 moves it out of the LRU; releasing it puts it at the tail: 2, 3, 1, 0. */
    int32_t out[1];
    ck_assert_int_eq(kvb_prefix_cache_match(f.cache, t[0], 2, 1, out, NULL), 1);
    ck_assert_int_eq(out[0], 0);
    ck_assert_int_eq(kvb_prefix_cache_n_available(f.cache), 3);
    kvb_block_pool_unref(f.pool, 0);

    ck_assert_int_eq(kvb_prefix_cache_alloc(f.cache, &x), KVB_OK);
    ck_assert_int_eq(x, 2);
    ck_assert_int_eq(kvb_block_pool_refcount(f.pool, 2), 1);
    ck_assert_int_eq(kvb_prefix_cache_n_cached(f.cache), 3);
    ck_assert_int_eq(kvb_prefix_cache_match(f.cache, t[2], 2, 1, out, NULL), 0); /* evicted */
    ck_assert_int_eq(kvb_prefix_cache_alloc(f.cache, &x), KVB_OK);
    ck_assert_int_eq(x, 3);
    /* Take a reference on 1: only 0 is evictable now. */
    ck_assert_int_eq(kvb_prefix_cache_match(f.cache, t[1], 2, 1, out, NULL), 1);
    ck_assert_int_eq(out[0], 1);
    ck_assert_int_eq(kvb_prefix_cache_alloc(f.cache, &x), KVB_OK);
    ck_assert_int_eq(x, 0);
    ck_assert_int_eq(kvb_prefix_cache_alloc(f.cache, &x), KVB_ERR_EXHAUSTED);
    ck_assert_int_eq(kvb_prefix_cache_n_cached(f.cache), 1);
    ck_assert_int_eq(kvb_block_pool_refcount(f.pool, 1), 1);

    kvb_prefix_stats s;
    kvb_prefix_cache_stats(f.cache, &s);
    ck_assert_uint_eq(s.evictions, 3);
    ck_assert_uint_eq(s.queries, 3);
    ck_assert_uint_eq(s.hits, 2);
    /* An evicted block handed out for writing goes to the free list when dropped (not cached). */
    kvb_block_pool_unref(f.pool, 2);
    ck_assert_int_eq(kvb_block_pool_is_free(f.pool, 2), 1);
    ck_assert_int_eq(kvb_prefix_cache_alloc(f.cache, &x), KVB_OK); /* free block before any eviction */
    ck_assert_int_eq(x, 2);
    kvb_prefix_cache_stats(f.cache, &s);
    ck_assert_uint_eq(s.evictions, 3);
    for (int i = 0; i < 4; i++) kvb_block_pool_unref(f.pool, i);
    ck_assert_int_eq(kvb_prefix_cache_n_available(f.cache), 4);
    fixture_free(&f);
}
KVB_TEST_END

KVB_TEST(prefix_collision) {
    fixture f;
    fixture_init(&f, 3, 8, 8);
    const int32_t A[3] = {1, 2, 3}, B[3] = {9, 9, 9}, C[3] = {4, 5, 6};
    uint64_t hA = kvb_prefix_hash(KVB_PREFIX_ROOT, A, 3);
    int32_t x, y;
    /* Entry X: A's hash and parent but other tokens. Entry Y: A's hash and tokens but another parent. */
    ck_assert_int_eq(kvb_prefix_cache_alloc(f.cache, &x), KVB_OK);
    ck_assert_int_eq(kvb__prefix_cache_insert_raw(f.cache, hA, KVB_PREFIX_ROOT, B, x), KVB_OK);
    ck_assert_int_eq(kvb_prefix_cache_alloc(f.cache, &y), KVB_OK);
    ck_assert_int_eq(kvb__prefix_cache_insert_raw(f.cache, hA, 0x1234, A, y), KVB_OK);
    kvb_block_pool_unref(f.pool, x);
    kvb_block_pool_unref(f.pool, y);
    ck_assert_int_eq(kvb_prefix_cache_n_cached(f.cache), 2);

    int32_t out[4];
    uint64_t last = 0;
    ck_assert_int_eq(kvb_prefix_cache_match(f.cache, A, 3, 4, out, &last), 0); /* never X or Y */
    ck_assert_uint_eq(last, KVB_PREFIX_ROOT);
    ck_assert_int_eq(kvb_prefix_cache_match(f.cache, B, 3, 4, out, &last), 0); /* X is keyed by hA */
    /* The real block for A is not mistaken for a duplicate of X or Y. */
    uint64_t h;
    int32_t z = alloc_publish(&f, KVB_PREFIX_ROOT, A, &h);
    ck_assert_uint_eq(h, hA);
    ck_assert_int_eq(kvb_prefix_cache_n_cached(f.cache), 3);
    uint64_t hAC;
    int32_t w = alloc_publish(&f, hA, C, &hAC);
    /* A colliding second-level entry: C's chained hash, parent hA, other tokens. */
    int32_t v;
    ck_assert_int_eq(kvb_prefix_cache_alloc(f.cache, &v), KVB_OK);
    ck_assert_int_eq(kvb__prefix_cache_insert_raw(f.cache, hAC, hA, B, v), KVB_OK);
    ck_assert_int_eq(kvb__prefix_cache_insert_raw(f.cache, hAC, hA, B, v), KVB_ERR_STATE); /* already cached */
    kvb_block_pool_unref(f.pool, z);
    kvb_block_pool_unref(f.pool, w);
    kvb_block_pool_unref(f.pool, v);
    int32_t AC[6] = {1, 2, 3, 4, 5, 6};
    ck_assert_int_eq(kvb_prefix_cache_match(f.cache, AC, 6, 4, out, &last), 2);
    ck_assert_int_eq(out[0], z);
    ck_assert_int_eq(out[1], w);
    ck_assert_uint_eq(last, hAC);
    kvb_block_pool_unref(f.pool, z);
    kvb_block_pool_unref(f.pool, w);
    /* Evicting the colliding entries (oldest first: x, y) leaves the real ones findable. */
    int32_t fill[8];
    int n_fill = 0;
    while (kvb_block_pool_n_free(f.pool) > 0) ck_assert_int_eq(kvb_prefix_cache_alloc(f.cache, &fill[n_fill++]), KVB_OK);
    int32_t e;
    ck_assert_int_eq(kvb_prefix_cache_alloc(f.cache, &e), KVB_OK);
    ck_assert_int_eq(e, x);
    ck_assert_int_eq(kvb_prefix_cache_alloc(f.cache, &e), KVB_OK);
    ck_assert_int_eq(e, y);
    ck_assert_int_eq(kvb__prefix_cache_check(f.cache), 0);
    ck_assert_int_eq(kvb_prefix_cache_match(f.cache, AC, 6, 4, out, &last), 2);
    ck_assert_int_eq(out[0], z);
    ck_assert_int_eq(out[1], w);
    kvb_block_pool_unref(f.pool, z);
    kvb_block_pool_unref(f.pool, w);
    kvb_block_pool_unref(f.pool, x);
    kvb_block_pool_unref(f.pool, y);
    for (int i = 0; i < n_fill; i++) kvb_block_pool_unref(f.pool, fill[i]);
    fixture_free(&f);
}
KVB_TEST_END

/* Many entries: the map grows past its first size, everything stays findable. */
KVB_TEST(prefix_map_grows) {
    const int n = 3000;
    fixture f;
    fixture_init(&f, 2, n, n);
    uint64_t parent = KVB_PREFIX_ROOT;
    int32_t *toks = malloc(sizeof(int32_t) * 2 * (size_t)n);
    for (int i = 0; i < 2 * n; i++) toks[i] = i * 31 + 7;
    for (int b = 0; b < n; b++) {
        int32_t id = alloc_publish(&f, parent, toks + 2 * b, &parent);
        ck_assert_int_eq(id, b);
    }
    ck_assert_int_eq(kvb_prefix_cache_n_cached(f.cache), n);
    for (int b = n - 1; b >= 0; b--) kvb_block_pool_unref(f.pool, b);
    int32_t *out = malloc(sizeof(int32_t) * (size_t)n);
    uint64_t last;
    ck_assert_int_eq(kvb_prefix_cache_match(f.cache, toks, 2 * n, n, out, &last), n);
    ck_assert_uint_eq(last, parent);
    for (int b = 0; b < n; b++) ck_assert_int_eq(out[b], b);
    ck_assert_int_eq(kvb__prefix_cache_check(f.cache), 0);
    for (int b = 0; b < n; b++) kvb_block_pool_unref(f.pool, b);
    free(out);
    free(toks);
    fixture_free(&f);
}
KVB_TEST_END

KVB_TEST(prefix_clear_drop_tail_destroy) {
    fixture f;
    fixture_init(&f, 2, 8, 8);
    int32_t t[8][2];
    int32_t id[8];
    for (int i = 0; i < 8; i++) {
        t[i][0] = i;
        t[i][1] = -i;
        id[i] = alloc_publish(&f, KVB_PREFIX_ROOT, t[i], NULL);
    }
    for (int i = 0; i < 8; i++)
        if (i != 1 && i != 6) kvb_block_pool_unref(f.pool, id[i]);
    ck_assert_int_eq(kvb_block_pool_n_free(f.pool), 0);
    /* Shrinking to 5 meets cached blocks 5 and 7 (held) and 6 (referenced). */
    ck_assert_int_eq(kvb_block_pool_resize(f.pool, 5), KVB_ERR_STATE);
    ck_assert_int_eq(kvb_prefix_cache_drop_tail(f.cache, 5), 2);
    ck_assert_int_eq(kvb_block_pool_n_free(f.pool), 2);
    ck_assert_int_eq(kvb_block_pool_resize(f.pool, 5), KVB_ERR_STATE); /* 6 still referenced */
    kvb_block_pool_unref(f.pool, 6);                                    /* cached, back in the LRU */
    ck_assert_int_eq(kvb_prefix_cache_drop_tail(f.cache, 5), 1);
    ck_assert_int_eq(kvb_block_pool_resize(f.pool, 5), KVB_OK);
    ck_assert_int_eq(kvb_prefix_cache_n_cached(f.cache), 5);
    /* clear drops the unreferenced entries only. */
    kvb_prefix_cache_clear(f.cache);
    ck_assert_int_eq(kvb_prefix_cache_n_cached(f.cache), 1);
    ck_assert_int_eq(kvb_block_pool_n_free(f.pool), 4);
    int32_t out[1];
    ck_assert_int_eq(kvb_prefix_cache_match(f.cache, t[1], 2, 1, out, NULL), 1);
    ck_assert_int_eq(out[0], 1);
    ck_assert_int_eq(kvb_prefix_cache_match(f.cache, t[0], 2, 1, out, NULL), 0);
    kvb_block_pool_unref(f.pool, 1);
    /* Block 1 is cached and referenced once; destroying the cache returns the rest and removes the
     * hook, so block 1 goes to the free list when its holder drops it. */
    ck_assert_int_eq(kvb__prefix_cache_check(f.cache), 0);
    kvb_prefix_cache_destroy(f.cache);
    f.cache = NULL;
    ck_assert_int_eq(kvb_block_pool_n_free(f.pool), 4);
    kvb_block_pool_unref(f.pool, 1);
    ck_assert_int_eq(kvb_block_pool_n_free(f.pool), 5);
    /* And a cache destroyed with unreferenced entries gives them all back. */
    ck_assert_int_eq(kvb_prefix_cache_create(f.pool, &f.cache), KVB_OK);
    for (int i = 0; i < 5; i++) id[i] = alloc_publish(&f, KVB_PREFIX_ROOT, t[i], NULL);
    for (int i = 0; i < 5; i++) kvb_block_pool_unref(f.pool, id[i]);
    ck_assert_int_eq(kvb_block_pool_n_free(f.pool), 0);
    kvb_prefix_cache_destroy(f.cache);
    ck_assert_int_eq(kvb_block_pool_n_free(f.pool), 5);
    kvb_prefix_cache_destroy(NULL);
    kvb_block_pool_destroy(f.pool);
    free(f.mem);
}
KVB_TEST_END

/* ---------------------------------------------------------------- randomized model check */

#define M_CAP 24
#define M_BS 2
#define M_PATTERNS 3
#define M_MAX_LEN 3
#define M_MAX_REFS 4096

/* The reference model: refcounts, cache entries (one per block, linear search), LRU by release time. */
typedef struct model {
    int n_blocks;
    int rc[M_CAP];
    int cached[M_CAP];
    uint64_t hash[M_CAP], parent[M_CAP];
    int32_t tok[M_CAP][M_BS];
    uint64_t released_at[M_CAP]; /* when a cached block's refcount last dropped to 0 */
    uint64_t clock;
    int32_t refs[M_MAX_REFS]; /* the engine's references, one entry per reference */
    int n_refs;
    kvb_prefix_stats stats;
} model;

static uint64_t rng_next(uint64_t *s) {
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}
static int rng_below(uint64_t *s, int n) { return (int)(rng_next(s) % (uint64_t)n); }

static void pattern(int k, int32_t *out) {
    for (int j = 0; j < M_BS; j++) out[j] = 1000 * (k + 1) + j;
}

static int m_find(const model *m, uint64_t h, uint64_t parent, const int32_t *tok) {
    for (int i = 0; i < M_CAP; i++)
        if (m->cached[i] && m->hash[i] == h && m->parent[i] == parent && !memcmp(m->tok[i], tok, sizeof m->tok[i]))
            return i;
    return -1;
}

static int m_lowest_free(const model *m) {
    for (int i = 0; i < m->n_blocks; i++)
        if (m->rc[i] == 0 && !m->cached[i]) return i;
    return -1;
}

static int m_lru_head(const model *m) {
    int best = -1;
    for (int i = 0; i < M_CAP; i++)
        if (m->cached[i] && m->rc[i] == 0 && (best < 0 || m->released_at[i] < m->released_at[best])) best = i;
    return best;
}

static void m_take_ref(model *m, int32_t id) {
    ck_assert_int_lt(m->n_refs, M_MAX_REFS);
    m->rc[id]++;
    m->refs[m->n_refs++] = id;
}

static void m_compare(const model *m, const fixture *f, uint64_t seed, int step) {
    int n_free = 0, n_lru = 0, n_cached = 0;
    for (int i = 0; i < M_CAP; i++) {
        int rc = kvb_block_pool_refcount(f->pool, i);
        if (rc != m->rc[i]) ck_abort_msg("seed %llu step %d: block %d refcount %d, model %d", (unsigned long long)seed,
                                         step, i, rc, m->rc[i]);
        int is_free = i < m->n_blocks && m->rc[i] == 0 && !m->cached[i];
        if (kvb_block_pool_is_free(f->pool, i) != is_free)
            ck_abort_msg("seed %llu step %d: block %d free %d, model %d", (unsigned long long)seed, step, i,
                         kvb_block_pool_is_free(f->pool, i), is_free);
        n_free += is_free;
        n_lru += m->cached[i] && m->rc[i] == 0;
        n_cached += m->cached[i];
    }
    ck_assert_int_eq(kvb_block_pool_n_blocks(f->pool), m->n_blocks);
    ck_assert_int_eq(kvb_block_pool_n_free(f->pool), n_free);
    ck_assert_int_eq(kvb_prefix_cache_n_available(f->cache), n_free + n_lru);
    ck_assert_int_eq(kvb_prefix_cache_n_cached(f->cache), n_cached);
    kvb_prefix_stats s;
    kvb_prefix_cache_stats(f->cache, &s);
    ck_assert_uint_eq(s.queries, m->stats.queries);
    ck_assert_uint_eq(s.hits, m->stats.hits);
    ck_assert_uint_eq(s.evictions, m->stats.evictions);
    if (kvb__prefix_cache_check(f->cache) != 0)
        ck_abort_msg("seed %llu step %d: cache invariants broken", (unsigned long long)seed, step);
}

/* A random sequence of 1..M_MAX_LEN blocks drawn from M_PATTERNS patterns (so prefixes repeat). */
static int random_seq(uint64_t *rng, int32_t *toks) {
    int len = 1 + rng_below(rng, M_MAX_LEN);
    for (int b = 0; b < len; b++) pattern(rng_below(rng, M_PATTERNS), toks + b * M_BS);
    return len;
}

/* How often the interesting outcomes happened, over all seeds (each must happen). */
typedef struct coverage {
    int exhausted, evicted, dup_publish, state_publish, new_publish, hit, shrink_ok, shrink_refused, dropped;
} coverage;

static void run_model(uint64_t seed, int steps, coverage *cov) {
    fixture f;
    fixture_init(&f, M_BS, 16, M_CAP);
    model *m = calloc(1, sizeof *m);
    m->n_blocks = 16;
    uint64_t rng = seed;
    int32_t toks[M_MAX_LEN * M_BS + M_BS];
    for (int step = 0; step < steps; step++) {
        int op = rng_below(&rng, 100);
        if (op < 22) { /* alloc through the cache */
            int32_t id = -1;
            kvb_status st = kvb_prefix_cache_alloc(f.cache, &id);
            int want = m_lowest_free(m);
            if (want < 0) {
                want = m_lru_head(m);
                if (want >= 0) {
                    m->cached[want] = 0;
                    m->stats.evictions++;
                    cov->evicted++;
                }
            }
            if (want < 0) {
                ck_assert_int_eq(st, KVB_ERR_EXHAUSTED);
                cov->exhausted++;
            } else {
                ck_assert_int_eq(st, KVB_OK);
                ck_assert_int_eq(id, want);
                m_take_ref(m, id);
            }
        } else if (op < 26) { /* alloc straight from the pool: never a cached block */
            int32_t id = -1;
            kvb_status st = kvb_block_pool_alloc(f.pool, &id);
            int want = m_lowest_free(m);
            ck_assert_int_eq(st, want < 0 ? KVB_ERR_EXHAUSTED : KVB_OK);
            if (want >= 0) {
                ck_assert_int_eq(id, want);
                m_take_ref(m, id);
            }
        } else if (op < 48) { /* publish a held block at a random position of a random sequence */
            if (m->n_refs == 0) continue;
            int32_t id = m->refs[rng_below(&rng, m->n_refs)];
            int len = random_seq(&rng, toks);
            int pos = rng_below(&rng, len);
            uint64_t parent = KVB_PREFIX_ROOT;
            for (int b = 0; b < pos; b++) parent = ref_hash(parent, toks + b * M_BS, M_BS);
            const int32_t *tk = toks + pos * M_BS;
            uint64_t h = ref_hash(parent, tk, M_BS), got = 0;
            kvb_status st = kvb_prefix_cache_publish(f.cache, parent, tk, id, &got);
            ck_assert_uint_eq(got, h);
            if (m_find(m, h, parent, tk) >= 0) {
                ck_assert_int_eq(st, KVB_OK);
                cov->dup_publish++;
            } else if (m->cached[id]) {
                ck_assert_int_eq(st, KVB_ERR_STATE);
                cov->state_publish++;
            } else {
                ck_assert_int_eq(st, KVB_OK);
                cov->new_publish++;
                m->cached[id] = 1;
                m->hash[id] = h;
                m->parent[id] = parent;
                memcpy(m->tok[id], tk, sizeof m->tok[id]);
            }
        } else if (op < 70) { /* match */
            int len = random_seq(&rng, toks);
            int extra = rng_below(&rng, M_BS);
            for (int j = 0; j < extra; j++) toks[len * M_BS + j] = 7;
            int max_blocks = rng_below(&rng, M_MAX_LEN + 2);
            int32_t out[M_MAX_LEN + 2];
            uint64_t last = 0;
            int n = kvb_prefix_cache_match(f.cache, toks, len * M_BS + extra, max_blocks, out, &last);
            uint64_t parent = KVB_PREFIX_ROOT;
            int want = 0;
            for (int b = 0; b < KVB_MIN(len, max_blocks); b++) {
                uint64_t h = ref_hash(parent, toks + b * M_BS, M_BS);
                m->stats.queries++;
                int i = m_find(m, h, parent, toks + b * M_BS);
                if (i < 0) break;
                m->stats.hits++;
                cov->hit++;
                if (want >= n || out[want] != i)
                    ck_abort_msg("seed %llu step %d: match block %d is %d, model %d", (unsigned long long)seed, step,
                                 want, want < n ? out[want] : -1, i);
                m_take_ref(m, i);
                want++;
                parent = h;
            }
            ck_assert_int_eq(n, want);
            ck_assert_uint_eq(last, parent);
        } else if (op < 96) { /* drop 1..3 references (matches take several at once) */
            for (int r = 1 + rng_below(&rng, 3); r > 0 && m->n_refs > 0; r--) {
                int k = rng_below(&rng, m->n_refs);
                int32_t id = m->refs[k];
                m->refs[k] = m->refs[--m->n_refs];
                kvb_block_pool_unref(f.pool, id);
                if (--m->rc[id] == 0 && m->cached[id]) m->released_at[id] = ++m->clock;
            }
        } else if (op < 97) { /* clear */
            kvb_prefix_cache_clear(f.cache);
            for (int i = 0; i < M_CAP; i++)
                if (m->cached[i] && m->rc[i] == 0) m->cached[i] = 0;
        } else { /* resize, sometimes after dropping the cached tail */
            int n = 8 + rng_below(&rng, M_CAP - 8 + 1);
            if (n < m->n_blocks && rng_below(&rng, 2)) {
                int dropped = kvb_prefix_cache_drop_tail(f.cache, n), want = 0;
                for (int i = n; i < M_CAP; i++)
                    if (m->cached[i] && m->rc[i] == 0) m->cached[i] = 0, want++;
                ck_assert_int_eq(dropped, want);
                cov->dropped += dropped;
            }
            int ok = 1;
            for (int i = n; i < m->n_blocks; i++)
                if (m->rc[i] != 0 || m->cached[i]) ok = 0;
            kvb_status st = kvb_block_pool_resize(f.pool, n);
            ck_assert_int_eq(st, ok ? KVB_OK : KVB_ERR_STATE);
            if (n < m->n_blocks) ok ? cov->shrink_ok++ : cov->shrink_refused++;
            if (ok) m->n_blocks = n;
        }
        m_compare(m, &f, seed, step);
    }
    /* Drop everything: every block comes back (free or evictable). */
    while (m->n_refs > 0) kvb_block_pool_unref(f.pool, m->refs[--m->n_refs]);
    ck_assert_int_eq(kvb_prefix_cache_n_available(f.cache), m->n_blocks);
    kvb_prefix_cache_destroy(f.cache);
    ck_assert_int_eq(kvb_block_pool_n_free(f.pool), m->n_blocks);
    kvb_block_pool_destroy(f.pool);
    free(f.mem);
    free(m);
}

KVB_TEST(prefix_model_random) {
    kvb_log_set_level(KVB_LOG_ERROR); /* refused publishes are expected here and log warnings */
    const uint64_t seeds[] = {1, 2, 3, 0x5eedull, 0xdeadbeefcafef00dull, 424242};
    coverage cov = {0};
    for (size_t k = 0; k < KVB_ARRAY_LEN(seeds); k++) run_model(seeds[k], 6000, &cov);
    printf("model: %d exhausted, %d evicted, publish %d new / %d duplicate / %d refused, %d hits, "
           "shrink %d ok / %d refused, %d dropped from the tail\n",
           cov.exhausted, cov.evicted, cov.new_publish, cov.dup_publish, cov.state_publish, cov.hit, cov.shrink_ok,
           cov.shrink_refused, cov.dropped);
    int *counts[] = {&cov.exhausted, &cov.evicted, &cov.dup_publish, &cov.state_publish, &cov.new_publish, &cov.hit,
                     &cov.shrink_ok, &cov.shrink_refused, &cov.dropped};
    for (size_t k = 0; k < KVB_ARRAY_LEN(counts); k++) ck_assert_int_gt(*counts[k], 0);
}
KVB_TEST_END

KVB_TEST_MAIN("kv",
              KVB_T(region_share_fork, 20),
              KVB_T(region_names_unique, 10),
              KVB_T(region_bad_input, 10),
              KVB_T(region_unlink_stale, 10),
              KVB_T(geom_check, 10),
              KVB_T(pool_layout, 10),
              KVB_T(pool_alloc_ref, 10),
              KVB_T(pool_lowest_first_large, 20),
              KVB_T(pool_resize, 10),
              KVB_T(pool_release_hook, 10),
              KVB_T(pool_sliced, 10),
              KVB_T(pool_sliced_random, 30),
              KVB_T(block_table, 10),
              KVB_T(prefix_hash_chain, 10),
              KVB_T(prefix_publish_match, 10),
              KVB_T(prefix_publish_duplicate, 10),
              KVB_T(prefix_lru_eviction, 10),
              KVB_T(prefix_collision, 10),
              KVB_T(prefix_map_grows, 20),
              KVB_T(prefix_clear_drop_tail_destroy, 10),
              KVB_T(prefix_model_random, 120))
