/* kvbank — the memory interface (common/mem/mem.h) on one backend: the host backend (tests/test_mem),
 * or, built with -DKVB_TEST_MEM_CUDA, the CUDA backend (tests/test_mem_cuda, which exits 77 without a
 * GPU). Every byte is written and read through kvb_mem_copy, so the same tests hold for device memory.
 * Real processes for export/import, real mappings for virtual memory. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/mem/mem.h"
#include "tests/harness.h"

#ifdef KVB_TEST_MEM_CUDA
#define BACKEND "cuda"
#define KIND "cuda"
#else
#define BACKEND "cpu"
#define KIND "host"
#endif

static kvb_mem *mk(void) {
    kvb_mem *m = NULL;
    ck_assert_int_eq(kvb_mem_create(BACKEND, -1, &m), KVB_OK);
    ck_assert_str_eq(kvb_mem_kind(m), KIND);
    return m;
}

static void fill(unsigned char *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)(i * 31u + seed * 7u + (i >> 8));
}

/* Writes the pattern `seed` into [dst, dst + n) of m's memory. */
static void put(kvb_mem *m, void *dst, size_t n, unsigned seed) {
    unsigned char *h = malloc(n);
    ck_assert_ptr_nonnull(h);
    fill(h, n, seed);
    ck_assert_int_eq(kvb_mem_copy(m, dst, h, n), KVB_OK);
    free(h);
}

/* 1 if [src, src + n) of m's memory holds the pattern `seed`. */
static int holds(kvb_mem *m, const void *src, size_t n, unsigned seed) {
    unsigned char *h = malloc(n), *want = malloc(n);
    ck_assert(h && want);
    fill(want, n, seed);
    ck_assert_int_eq(kvb_mem_copy(m, h, src, n), KVB_OK);
    int same = !memcmp(h, want, n);
    free(h);
    free(want);
    return same;
}

/* ---------------------------------------------------------------------------------------- registry */

KVB_TEST(registry) {
    ck_assert_str_eq(kvb_mem_kind_of("cpu"), "host");
    ck_assert_str_eq(kvb_mem_kind_of("host"), "host");
    ck_assert_ptr_null(kvb_mem_kind_of("tpu"));
    kvb_mem *m = NULL;
    ck_assert_int_eq(kvb_mem_create("tpu", 0, &m), KVB_ERR_UNSUPPORTED);
    ck_assert_ptr_null(m);
    ck_assert_int_eq(kvb_mem_create("cpu", 1, &m), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_mem_create("cpu", -2, &m), KVB_ERR_INVALID);
    char why[256];
    ck_assert_int_eq(kvb_mem_probe("cpu", 0, why, sizeof why), 1);
    ck_assert_int_eq(kvb_mem_probe("tpu", 0, why, sizeof why), 0);
    ck_assert(strstr(why, "tpu") != NULL);
    ck_assert_int_eq(kvb_mem_create("cpu", 0, &m), KVB_OK);
    ck_assert_str_eq(kvb_mem_kind(m), "host");
    ck_assert_int_eq(kvb_mem_is_device(m), 0);
    ck_assert_int_eq(kvb_mem_device(m), 0);
    kvb_mem_destroy(m);
    kvb_mem_destroy(NULL);
    /* a device kind compiled in: its variants share the kind, and without the device the probe and
     * the creation say "no <kind> device" */
    if (strstr(kvb_mem_list(), "cuda")) {
        ck_assert_str_eq(kvb_mem_kind_of("cuda:f32"), "cuda");
        ck_assert_ptr_null(kvb_mem_kind_of("cudax"));
        if (!kvb_mem_probe("cuda", 0, why, sizeof why)) {
            ck_assert_msg(strstr(why, "no CUDA device") != NULL, "probe says: %s", why);
            ck_assert_int_eq(kvb_mem_create("cuda", 0, &m), KVB_ERR_UNSUPPORTED);
            ck_assert_ptr_null(m);
        }
        ck_assert_int_eq(kvb_mem_probe("cuda", 1023, why, sizeof why), 0);
        ck_assert(strstr(why, "no CUDA device") != NULL);
    }
}
KVB_TEST_END

/* ---------------------------------------------------------------------------- plain and pinned */

KVB_TEST(alloc_pinned_copy) {
    kvb_mem *m = mk();
    size_t n = (size_t)1 << 20;
    void *d = NULL, *p = NULL;
    ck_assert_int_eq(kvb_mem_alloc(m, 0, &d), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_mem_alloc(m, n, &d), KVB_OK);
    ck_assert_uint_eq((uintptr_t)d % 256, 0);
    ck_assert_int_eq(kvb_mem_pinned_alloc(m, n, &p), KVB_OK);
    fill(p, n, 3); /* pinned memory is host memory on every backend */
    ck_assert_int_eq(kvb_mem_copy(m, d, p, n), KVB_OK);
    memset(p, 0, n);
    ck_assert_int_eq(kvb_mem_copy(m, p, d, n), KVB_OK);
    unsigned char *want = malloc(n);
    fill(want, n, 3);
    ck_assert(!memcmp(p, want, n));
    ck_assert(holds(m, d, n, 3));
    free(want);
    ck_assert_int_eq(kvb_mem_copy(m, d, p, 0), KVB_OK);
    kvb_mem_free(m, d);
    kvb_mem_pinned_free(m, p);
    kvb_mem_free(m, NULL);
    kvb_mem_pinned_free(m, NULL);
    kvb_mem_destroy(m);
}
KVB_TEST_END

/* ---------------------------------------------------------------------- regions, two processes */

static ssize_t read_line(int fd, char *buf, size_t len) {
    size_t n = 0;
    while (n + 1 < len) {
        ssize_t r = read(fd, buf + n, 1);
        if (r <= 0) break;
        if (buf[n++] == '\n') break;
    }
    buf[n] = 0;
    return (ssize_t)n;
}

/* The exporter: creates a region, writes pattern 5, sends "HANDLE BYTES\n", waits for one byte, then
 * exits 0 if the importer's pattern 9 is in its first 4 KiB (writes through an import reach it). */
static int exporter(int out_fd, int in_fd, size_t bytes) {
    kvb_mem *m = NULL;
    kvb_mem_region *r = NULL;
    char tag[40];
    snprintf(tag, sizeof tag, "tmem-%ld", (long)getpid());
    if (kvb_mem_create(BACKEND, -1, &m) != KVB_OK || kvb_mem_region_create(m, tag, bytes, &r) != KVB_OK) return 3;
    if (!kvb_mem_region_is_owner(r) || kvb_mem_region_size(r) != bytes) return 4;
    unsigned char z[4096], zero[4096] = {0};
    if (kvb_mem_copy(m, z, kvb_mem_region_base(r), sizeof z) != KVB_OK || memcmp(z, zero, sizeof z)) return 5;
    put(m, kvb_mem_region_base(r), bytes, 5);
    char line[KVB_MEM_HANDLE_MAX + 32];
    int n = snprintf(line, sizeof line, "%s %zu\n", kvb_mem_region_handle(r), bytes);
    if (write(out_fd, line, (size_t)n) != n) return 6;
    char go;
    if (read(in_fd, &go, 1) != 1) return 7;
    int ok = holds(m, kvb_mem_region_base(r), 4096, 9);
    kvb_mem_region_destroy(r);
    kvb_mem_destroy(m);
    return ok ? 0 : 8;
}

KVB_TEST(region_two_processes) {
    size_t bytes = (size_t)4 << 20;
    int up[2], down[2];
    ck_assert_int_eq(pipe(up), 0);
    ck_assert_int_eq(pipe(down), 0);
    pid_t pid = fork(); /* before this process touches the device: a forked child could not */
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(up[0]);
        close(down[1]);
        _exit(exporter(up[1], down[0], bytes));
    }
    close(up[1]);
    close(down[0]);
    char line[KVB_MEM_HANDLE_MAX + 32], handle[KVB_MEM_HANDLE_MAX];
    size_t announced = 0;
    ck_assert_int_gt(read_line(up[0], line, sizeof line), 0);
    ck_assert_int_eq(sscanf(line, "%159s %zu", handle, &announced), 2);
    ck_assert_uint_eq(announced, bytes);

    kvb_mem *m = mk();
    size_t g = 0;
    ck_assert_int_eq(kvb_mem_granularity(m, &g), KVB_OK);
    kvb_mem_region *r = NULL, *again = NULL;
    /* a size mismatch, a bad handle, then the import, a double import, and the import once more */
    ck_assert_int_eq(kvb_mem_region_import(m, handle, bytes + g, &r), KVB_ERR_INVALID);
    ck_assert_ptr_null(r);
    ck_assert_int_eq(kvb_mem_region_import(m, "no/such\\handle", bytes, &r), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_mem_region_import(m, "", bytes, &r), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_mem_region_import(m, handle, 0, &r), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_mem_region_import(m, handle, bytes, &r), KVB_OK);
    ck_assert_int_eq(kvb_mem_region_is_owner(r), 0);
    ck_assert_uint_eq(kvb_mem_region_size(r), bytes);
    ck_assert_str_eq(kvb_mem_region_handle(r), handle);
    ck_assert_int_eq(kvb_mem_region_import(m, handle, bytes, &again), KVB_ERR_STATE);
    ck_assert_ptr_null(again);
    ck_assert(holds(m, kvb_mem_region_base(r), bytes, 5));
    kvb_mem_region_destroy(r);
    ck_assert_int_eq(kvb_mem_region_import(m, handle, bytes, &r), KVB_OK);
    ck_assert(holds(m, kvb_mem_region_base(r), bytes, 5));
    put(m, kvb_mem_region_base(r), 4096, 9);
    kvb_mem_region_destroy(r);
    ck_assert_int_eq(write(down[1], "g", 1), 1);
    int status = 0;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "exporter: status %d", status);
    /* the exporter freed it and exited: the handle leads nowhere */
    kvb_status st = kvb_mem_region_import(m, handle, bytes, &r);
    ck_assert_int_ne(st, KVB_OK);
#ifndef KVB_TEST_MEM_CUDA
    ck_assert_int_eq(st, KVB_ERR_NOT_FOUND);
#endif
    close(up[0]);
    close(down[1]);
    kvb_mem_destroy(m);
}
KVB_TEST_END

/* --------------------------------------------------------------------------------- virtual memory */

/* Counts and times every call: `calls` of each op, each with a time. */
static void expect_calls(kvb_mem *m, kvb_mem_op op, uint64_t n) {
    kvb_mem_vm_stats s;
    kvb_mem_vm_stats_get(m, &s);
    ck_assert_msg(s.calls[op] == n, "%s: %llu calls, expected %llu", kvb_mem_op_name(op),
                  (unsigned long long)s.calls[op], (unsigned long long)n);
    if (n) ck_assert_msg(s.ns[op] > 0, "%s: no time recorded", kvb_mem_op_name(op));
}

KVB_TEST(vm_map_unmap_remap) {
    kvb_mem *m = mk();
    size_t g = 0;
    ck_assert_int_eq(kvb_mem_granularity(m, &g), KVB_OK);
    ck_assert_uint_ge(g, 4096);
    size_t cb = 2 * g; /* the chunk size is a parameter: any multiple of the granularity */
    kvb_mem_chunks *c = NULL, *odd = NULL;
    kvb_mem_vrange *v = NULL;
    /* misaligned requests are refused and reach no backend */
    ck_assert_int_eq(kvb_mem_chunks_create(m, g + 512, 2, &c), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_mem_chunks_create(m, cb, 0, &c), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_mem_reserve(m, 4 * cb, cb + 512, &v), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_mem_reserve(m, 3 * cb + g, cb, &v), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_mem_reserve(m, 0, cb, &v), KVB_ERR_INVALID);
    expect_calls(m, KVB_MEM_OP_CREATE, 0);
    expect_calls(m, KVB_MEM_OP_RESERVE, 0);

    ck_assert_int_eq(kvb_mem_chunks_create(m, cb, 3, &c), KVB_OK);
    ck_assert_int_eq(kvb_mem_chunks_count(c), 3);
    ck_assert_uint_eq(kvb_mem_chunks_bytes(c), cb);
    ck_assert_int_eq(kvb_mem_chunks_create(m, g, 1, &odd), KVB_OK);
    ck_assert_int_eq(kvb_mem_reserve(m, 4 * cb, cb, &v), KVB_OK);
    ck_assert_uint_eq(kvb_mem_vrange_size(v), 4 * cb);
    char *base = kvb_mem_vrange_base(v);
    ck_assert_uint_eq((uintptr_t)base % g, 0);

    /* one chunk at two addresses: written through one, read through the other */
    ck_assert_int_eq(kvb_mem_map(v, 0, c, 0), KVB_OK);
    ck_assert_int_eq(kvb_mem_map(v, 2 * cb, c, 0), KVB_OK);
    ck_assert_int_eq(kvb_mem_chunk_mappings(c, 0), 2);
    put(m, base, cb, 11);
    ck_assert(holds(m, base + 2 * cb, cb, 11));
    put(m, base + 2 * cb + 100, 50, 12);
    ck_assert(holds(m, base + 100, 50, 12));
    put(m, base, cb, 11);

    /* refusals: a mapped slot, misaligned or outside offsets, a chunk out of range, another chunk size */
    ck_assert_int_eq(kvb_mem_map(v, 0, c, 1), KVB_ERR_STATE);
    ck_assert_int_eq(kvb_mem_map(v, cb / 2, c, 1), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_mem_map(v, 4 * cb, c, 1), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_mem_map(v, cb, c, 3), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_mem_map(v, cb, c, -1), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_mem_map(v, cb, odd, 0), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_mem_unmap(v, cb), KVB_ERR_STATE);
    ck_assert_int_eq(kvb_mem_unmap(v, 3), KVB_ERR_INVALID);

    /* unmap: the other address keeps the chunk and its bytes */
    ck_assert_int_eq(kvb_mem_unmap(v, 0), KVB_OK);
    ck_assert_int_eq(kvb_mem_unmap(v, 0), KVB_ERR_STATE);
    ck_assert_int_eq(kvb_mem_chunk_mappings(c, 0), 1);
    ck_assert_int_eq(kvb_mem_mapped_at(v, 0, NULL, NULL, NULL), 0);
    ck_assert(holds(m, base + 2 * cb, cb, 11));
#ifndef KVB_TEST_MEM_CUDA
    /* the range stays reserved: nothing else can be mapped there, and touching it faults */
    void *other = mmap(base, cb, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    ck_assert_msg(other == MAP_FAILED && errno == EEXIST, "the unmapped slot was not reserved any more");
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        signal(SIGSEGV, SIG_DFL); /* a sanitizer's handler would report and exit instead */
        volatile char x = *(volatile char *)base;
        (void)x;
        _exit(0);
    }
    int status = 0;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    /* it faulted: killed by SIGSEGV (or, where a sanitizer kept its handler, exited with its report) */
    ck_assert_msg((WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV) || (WIFEXITED(status) && WEXITSTATUS(status)),
                  "reading an unmapped slot did not fault: status %d", status);
#endif
    /* remap: another chunk at the same offset, and chunk 0 at a third address */
    ck_assert_int_eq(kvb_mem_map(v, 0, c, 1), KVB_OK);
    put(m, base, cb, 13);
    ck_assert(holds(m, base + 2 * cb, cb, 11));
    ck_assert_int_eq(kvb_mem_map(v, cb, c, 0), KVB_OK);
    ck_assert(holds(m, base + cb, cb, 11));
    kvb_mem_chunks *at = NULL;
    int idx = -1, pend = -1;
    ck_assert_int_eq(kvb_mem_mapped_at(v, cb, &at, &idx, &pend), 1);
    ck_assert_ptr_eq(at, c);
    ck_assert_int_eq(idx, 0);
    ck_assert_int_eq(pend, 0);

    expect_calls(m, KVB_MEM_OP_CREATE, 2);
    expect_calls(m, KVB_MEM_OP_RESERVE, 1);
    expect_calls(m, KVB_MEM_OP_MAP, 4);
    expect_calls(m, KVB_MEM_OP_UNMAP, 1);
    /* chunks with mappings are not released */
    kvb_mem_chunks_destroy(c);
    expect_calls(m, KVB_MEM_OP_DESTROY, 0);
    kvb_mem_vrange_destroy(v); /* unmaps the three mapped slots, then releases */
    expect_calls(m, KVB_MEM_OP_UNMAP, 4);
    expect_calls(m, KVB_MEM_OP_RELEASE, 1);
    for (int i = 0; i < 3; i++) ck_assert_int_eq(kvb_mem_chunk_mappings(c, i), 0);
    kvb_mem_chunks_destroy(c);
    kvb_mem_chunks_destroy(odd);
    expect_calls(m, KVB_MEM_OP_DESTROY, 2);
    kvb_mem_destroy(m);
}
KVB_TEST_END

KVB_TEST(chunks_outlive_mappings) {
    kvb_mem *m = mk();
    size_t cb = 0;
    ck_assert_int_eq(kvb_mem_granularity(m, &cb), KVB_OK);
    kvb_mem_chunks *c = NULL;
    kvb_mem_vrange *a = NULL, *b = NULL;
    ck_assert_int_eq(kvb_mem_chunks_create(m, cb, 2, &c), KVB_OK);
    ck_assert_int_eq(kvb_mem_reserve(m, 2 * cb, cb, &a), KVB_OK);
    ck_assert_int_eq(kvb_mem_map(a, cb, c, 1), KVB_OK);
    put(m, (char *)kvb_mem_vrange_base(a) + cb, cb, 21);
    kvb_mem_vrange_destroy(a); /* the chunk keeps its bytes without any mapping */
    ck_assert_int_eq(kvb_mem_chunk_mappings(c, 1), 0);
    ck_assert_int_eq(kvb_mem_reserve(m, 4 * cb, cb, &b), KVB_OK);
    ck_assert_int_eq(kvb_mem_map(b, 3 * cb, c, 1), KVB_OK);
    ck_assert(holds(m, (char *)kvb_mem_vrange_base(b) + 3 * cb, cb, 21));
    /* the same chunk in two reservations at once */
    ck_assert_int_eq(kvb_mem_reserve(m, cb, cb, &a), KVB_OK);
    ck_assert_int_eq(kvb_mem_map(a, 0, c, 1), KVB_OK);
    put(m, kvb_mem_vrange_base(a), 64, 22);
    ck_assert(holds(m, (char *)kvb_mem_vrange_base(b) + 3 * cb, 64, 22));
    ck_assert_int_eq(kvb_mem_chunk_mappings(c, 1), 2);
    kvb_mem_vrange_destroy(a);
    kvb_mem_vrange_destroy(b);
    kvb_mem_chunks_destroy(c);
    kvb_mem_destroy(m);
}
KVB_TEST_END

/* A fence whose tickets pass when `done` reaches them; waiting moves `done` (as a stream sync). */
typedef struct counter_fence {
    uint64_t done;
    int waits;
} counter_fence;

static int cf_passed(void *ud, uint64_t t) { return ((counter_fence *)ud)->done >= t; }

static kvb_status cf_wait(void *ud, uint64_t t) {
    counter_fence *f = ud;
    f->waits++;
    if (f->done < t) f->done = t;
    return KVB_OK;
}

KVB_TEST(vm_deferred_unmap) {
    kvb_mem *m = mk();
    size_t cb = 0;
    ck_assert_int_eq(kvb_mem_granularity(m, &cb), KVB_OK);
    kvb_mem_chunks *c = NULL;
    kvb_mem_vrange *v = NULL;
    ck_assert_int_eq(kvb_mem_chunks_create(m, cb, 2, &c), KVB_OK);
    ck_assert_int_eq(kvb_mem_reserve(m, 3 * cb, cb, &v), KVB_OK);
    char *base = kvb_mem_vrange_base(v);
    ck_assert_int_eq(kvb_mem_map(v, 0, c, 0), KVB_OK);
    ck_assert_int_eq(kvb_mem_map(v, cb, c, 1), KVB_OK);
    put(m, base, cb, 31);
    counter_fence cf = {.done = 3};
    kvb_mem_fence f = {.ud = &cf, .passed = cf_passed, .wait = cf_wait};
    kvb_mem_fence bad = {.ud = &cf};
    ck_assert_int_eq(kvb_mem_unmap_after(v, 0, &bad, 5), KVB_ERR_INVALID);

    /* ticket 5 has not passed: the chunk stays mapped, counted and readable; the slot is blocked */
    ck_assert_int_eq(kvb_mem_unmap_after(v, 0, &f, 5), KVB_OK);
    ck_assert_int_eq(kvb_mem_pending(m), 1);
    int pend = 0;
    ck_assert_int_eq(kvb_mem_mapped_at(v, 0, NULL, NULL, &pend), 1);
    ck_assert_int_eq(pend, 1);
    ck_assert_int_eq(kvb_mem_chunk_mappings(c, 0), 1);
    ck_assert(holds(m, base, cb, 31));
    ck_assert_int_eq(kvb_mem_map(v, 0, c, 1), KVB_ERR_STATE);
    ck_assert_int_eq(kvb_mem_unmap(v, 0), KVB_ERR_STATE);
    ck_assert_int_eq(kvb_mem_unmap_after(v, 0, &f, 6), KVB_ERR_STATE);
    int n = -1;
    ck_assert_int_eq(kvb_mem_collect(m, 0, &n), KVB_OK);
    ck_assert_int_eq(n, 0);
    expect_calls(m, KVB_MEM_OP_UNMAP, 0);

    cf.done = 5; /* the work behind ticket 5 finished */
    ck_assert_int_eq(kvb_mem_collect(m, 0, &n), KVB_OK);
    ck_assert_int_eq(n, 1);
    ck_assert_int_eq(kvb_mem_pending(m), 0);
    ck_assert_int_eq(kvb_mem_mapped_at(v, 0, NULL, NULL, NULL), 0);
    ck_assert_int_eq(kvb_mem_chunk_mappings(c, 0), 0);
    expect_calls(m, KVB_MEM_OP_UNMAP, 1);
    ck_assert_int_eq(kvb_mem_map(v, 0, c, 0), KVB_OK); /* the slot is free again */
    ck_assert(holds(m, base, cb, 31));

    /* a ticket that has passed: unmapped at once */
    ck_assert_int_eq(kvb_mem_unmap_after(v, 0, &f, 4), KVB_OK);
    ck_assert_int_eq(kvb_mem_pending(m), 0);
    expect_calls(m, KVB_MEM_OP_UNMAP, 2);

    /* collect(wait) waits on the fence; destroying the range waits for its own pending unmaps */
    ck_assert_int_eq(kvb_mem_unmap_after(v, cb, &f, 8), KVB_OK);
    ck_assert_int_eq(kvb_mem_collect(m, 1, &n), KVB_OK);
    ck_assert_int_eq(n, 1);
    ck_assert_int_eq(cf.waits, 1);
    ck_assert_int_eq(kvb_mem_map(v, 2 * cb, c, 1), KVB_OK);
    ck_assert_int_eq(kvb_mem_unmap_after(v, 2 * cb, &f, 9), KVB_OK);
    kvb_mem_vrange_destroy(v);
    ck_assert_int_eq(cf.waits, 2);
    ck_assert_uint_eq(cf.done, 9);
    ck_assert_int_eq(kvb_mem_pending(m), 0);
    ck_assert_int_eq(kvb_mem_chunk_mappings(c, 1), 0);
    kvb_mem_vm_stats s;
    kvb_mem_vm_stats_get(m, &s);
    ck_assert_uint_eq(s.deferred, 3);
    kvb_mem_chunks_destroy(c);
    kvb_mem_destroy(m);
}
KVB_TEST_END

/* -------------------------------------------------------------------------------------- the arena */

KVB_TEST(step_arena) {
    kvb_mem *m = mk();
    kvb_mem_arena *a = NULL;
    ck_assert_int_eq(kvb_mem_arena_create(m, &a), KVB_OK);
    kvb_mem_allocator al = kvb_mem_arena_allocator(a);
    size_t sizes[3] = {1000, 5000, 300};
    void *p[3];
    for (int round = 0; round < 4; round++) {
        size_t scale = round == 3 ? 8 : 1; /* the fourth step is larger */
        for (int i = 0; i < 3; i++) {
            ck_assert_int_eq(al.iface->alloc(al.ctx, sizes[i] * scale, &p[i]), KVB_OK);
            ck_assert_uint_eq((uintptr_t)p[i] % 256, 0);
            put(m, p[i], sizes[i] * scale, (unsigned)(round * 3 + i));
        }
        for (int i = 0; i < 3; i++) ck_assert(holds(m, p[i], sizes[i] * scale, (unsigned)(round * 3 + i)));
        if (round >= 1 && round <= 2) {
            /* steady steps: all three from the block, one after the other */
            char *b = p[0];
            ck_assert_ptr_eq(p[1], b + 1024);
            ck_assert_ptr_eq(p[2], b + 1024 + 5120);
        }
        for (int i = 0; i < 3; i++) al.iface->free(al.ctx, p[i]);
        al.iface->free(al.ctx, NULL);
        /* the first step grows the block once; steady steps allocate nothing more */
        ck_assert_uint_eq(kvb_mem_arena_grows(a), round == 0 ? 0 : 1);
    }
    ck_assert_uint_ge(kvb_mem_arena_capacity(a), 1024 + 5120 + 512);
    /* the step that needed more grows the block at the next start */
    ck_assert_int_eq(al.iface->alloc(al.ctx, 16, &p[0]), KVB_OK);
    ck_assert_uint_eq(kvb_mem_arena_grows(a), 2);
    ck_assert_uint_ge(kvb_mem_arena_capacity(a), 8 * (1024 + 5120 + 512));
    al.iface->free(al.ctx, p[0]);
    kvb_mem_arena_destroy(a);
    kvb_mem_arena_destroy(NULL);
    kvb_mem_destroy(m);
}
KVB_TEST_END

#ifndef KVB_TEST_MEM_CUDA
/* ------------------------------------------------------------------------------------- host only */

KVB_TEST(host_chunk_limits) {
    kvb_mem *m = mk();
    size_t g = 0;
    ck_assert_int_eq(kvb_mem_granularity(m, &g), KVB_OK);
    ck_assert_uint_eq(g, (size_t)sysconf(_SC_PAGESIZE));
    FILE *f = fopen("/proc/sys/vm/max_map_count", "r");
    long limit = 0;
    if (f) {
        if (fscanf(f, "%ld", &limit) != 1) limit = 0;
        fclose(f);
    }
    if (limit > 0) {
        /* more chunks than half the mapping limit could fail mid-step: refused up front */
        kvb_mem_chunks *c = NULL;
        ck_assert_int_eq(kvb_mem_chunks_create(m, g, (int)(limit / 2 + 1), &c), KVB_ERR_INVALID);
        ck_assert_ptr_null(c);
    }
    /* every page of the chunks is allocated at creation (fallocate): the memfd shows in this process's
     * resident shared memory only when touched, but its blocks are taken from tmpfs now */
    kvb_mem_chunks *c = NULL;
    ck_assert_int_eq(kvb_mem_chunks_create(m, 64 * g, 4, &c), KVB_OK);
    kvb_mem_chunks_destroy(c);
    kvb_mem_destroy(m);
}
KVB_TEST_END
#endif

/* Whether this machine has a device for BACKEND (kvb_test_need_device runs it in a child). */
static int probe(char *why, size_t len) { return kvb_mem_probe(BACKEND, 0, why, len); }

int main(int argc, char **argv) {
    const kvb_test table[] = {
        KVB_T(registry, 30),
        KVB_T(alloc_pinned_copy, 30),
        KVB_T(region_two_processes, 60),
        KVB_T(vm_map_unmap_remap, 30),
        KVB_T(chunks_outlive_mappings, 30),
        KVB_T(vm_deferred_unmap, 30),
        KVB_T(step_arena, 30),
#ifndef KVB_TEST_MEM_CUDA
        KVB_T(host_chunk_limits, 30),
#endif
    };
    int skip = kvb_test_need_device(argc, argv, probe);
    if (skip >= 0) return skip;
    return kvb_test_main(argc, argv, "mem-" KIND, table, (int)KVB_ARRAY_LEN(table));
}
