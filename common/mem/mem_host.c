/* kvbank — the host memory backend (mem.h): ordinary page-aligned memory, POSIX shm regions
 * (region.h), and virtual memory from mmap: physical chunks are ranges of one memfd reserved up front
 * with fallocate, reservations are PROT_NONE anonymous mappings, a chunk is mapped with MAP_FIXED |
 * MAP_SHARED over its slot and unmapped by mapping PROT_NONE anonymous memory back (never munmap, so
 * the range stays reserved and no other mapping can land in it). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/mem/mem_impl.h"
#include "common/mem/region.h"

#define MAX_MAP_COUNT_PATH "/proc/sys/vm/max_map_count"

typedef struct host_chunks {
    int fd;              /* memfd of n * chunk_bytes bytes, all allocated */
    size_t chunk_bytes;
} host_chunks;

static size_t page_size(void) {
    long p = sysconf(_SC_PAGESIZE);
    return p > 0 ? (size_t)p : 4096;
}

static kvb_status host_alloc(void *ctx, size_t bytes, void **out) {
    void *p = NULL;
    int e = posix_memalign(&p, page_size(), bytes);
    if (e != 0) {
        KVB_LOG_E("mem host: allocation of %zu bytes failed: %s", bytes, strerror(e));
        return KVB_ERR_NOMEM;
    }
    *out = p;
    return KVB_OK;
}

static void host_free(void *ctx, void *p) { free(p); }

static kvb_status host_copy(void *ctx, void *dst, const void *src, size_t bytes) {
    memmove(dst, src, bytes);
    return KVB_OK;
}

/* ---------------------------------------------------------------------------------------- regions */

static kvb_status host_region_create(void *ctx, const char *tag, size_t bytes, void **impl, void **base,
                                     char *handle) {
    kvb_region *r = NULL;
    KVB_TRY(kvb_region_create(tag, bytes, &r));
    *impl = r;
    *base = kvb_region_base(r);
    snprintf(handle, KVB_MEM_HANDLE_MAX, "%s", kvb_region_handle(r));
    return KVB_OK;
}

static kvb_status host_region_import(void *ctx, const char *handle, size_t bytes, void **impl, void **base) {
    kvb_region *r = NULL;
    KVB_TRY(kvb_region_import(handle, &r));
    if (kvb_region_size(r) != bytes) {
        KVB_LOG_E("mem host: region %s holds %zu bytes, announced as %zu", handle, kvb_region_size(r), bytes);
        kvb_region_destroy(r);
        return KVB_ERR_INVALID;
    }
    *impl = r;
    *base = kvb_region_base(r);
    return KVB_OK;
}

static void host_region_destroy(void *ctx, void *impl) { kvb_region_destroy(impl); }

/* --------------------------------------------------------------------------------- virtual memory */

static kvb_status host_granularity(void *ctx, size_t *out) {
    *out = page_size();
    return KVB_OK;
}

/* vm.max_map_count, or 0 when it cannot be read. */
static long max_map_count(void) {
    FILE *f = fopen(MAX_MAP_COUNT_PATH, "r");
    if (!f) return 0;
    long v = 0;
    if (fscanf(f, "%ld", &v) != 1) v = 0;
    fclose(f);
    return v;
}

static kvb_status host_chunks_create(void *ctx, size_t chunk_bytes, int n, void **impl) {
    /* Every mapped chunk can be a mapping of its own (neighbours merge only when they are consecutive
     * ranges of the memfd), and the kernel refuses mmap beyond vm.max_map_count. */
    long limit = max_map_count();
    if (limit > 0 && (long)n > limit / 2) {
        KVB_LOG_E("mem host: %d chunks could need more mappings than half of vm.max_map_count (%ld); use larger "
                  "chunks or raise it (sysctl vm.max_map_count)",
                  n, limit);
        return KVB_ERR_INVALID;
    }
    size_t total = chunk_bytes * (size_t)n;
    if (total > (size_t)INT64_MAX) return KVB_ERR_INVALID;
    host_chunks *hc = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *hc, (void **)&hc));
    kvb_status st;
    hc->chunk_bytes = chunk_bytes;
    hc->fd = memfd_create("kvb-chunks", MFD_CLOEXEC);
    if (hc->fd < 0) {
        KVB_LOG_E("mem host: memfd_create failed: %s", strerror(errno));
        st = KVB_ERR_IO;
        goto fail;
    }
    if (ftruncate(hc->fd, (off_t)total) != 0) {
        KVB_LOG_E("mem host: sizing the chunk file to %zu bytes failed: %s", total, strerror(errno));
        st = errno == ENOMEM || errno == ENOSPC || errno == EFBIG ? KVB_ERR_NOMEM : KVB_ERR_IO;
        goto fail_fd;
    }
    /* All pages now: a full machine fails here rather than with SIGBUS when a step first touches one. */
    if (fallocate(hc->fd, 0, 0, (off_t)total) != 0) {
        int e = errno;
        KVB_LOG_E("mem host: allocating %d chunks of %zu bytes (fallocate) failed: %s", n, chunk_bytes, strerror(e));
        st = e == ENOMEM || e == ENOSPC ? KVB_ERR_NOMEM : KVB_ERR_IO;
        goto fail_fd;
    }
    *impl = hc;
    return KVB_OK;
fail_fd:
    close(hc->fd);
fail:
    free(hc);
    return st;
}

static void host_chunks_destroy(void *ctx, void *impl) {
    host_chunks *hc = impl;
    if (close(hc->fd) != 0) KVB_LOG_W("mem host: close of the chunk file failed: %s", strerror(errno));
    free(hc);
}

static kvb_status host_reserve(void *ctx, size_t bytes, void **base) {
    void *p = mmap(NULL, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        KVB_LOG_E("mem host: reserving %zu bytes of address space failed: %s", bytes, strerror(errno));
        return KVB_ERR_NOMEM;
    }
    *base = p;
    return KVB_OK;
}

static void host_release(void *ctx, void *base, size_t bytes) {
    if (munmap(base, bytes) != 0) KVB_LOG_E("mem host: releasing a reservation failed: %s", strerror(errno));
}

static kvb_status host_map(void *ctx, void *at, size_t chunk_bytes, void *chunks, int i) {
    host_chunks *hc = chunks;
    void *p = mmap(at, chunk_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, hc->fd,
                   (off_t)((size_t)i * hc->chunk_bytes));
    if (p == MAP_FAILED) {
        int e = errno;
        KVB_LOG_E("mem host: mapping chunk %d at %p failed: %s", i, at, strerror(e));
        /* MAP_FIXED may have removed the old mapping before failing: put the reservation back */
        (void)mmap(at, chunk_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
        return e == ENOMEM ? KVB_ERR_NOMEM : KVB_ERR_IO;
    }
    return KVB_OK;
}

static kvb_status host_unmap(void *ctx, void *at, size_t bytes) {
    void *p = mmap(at, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        KVB_LOG_E("mem host: unmapping %zu bytes at %p failed: %s", bytes, at, strerror(errno));
        return errno == ENOMEM ? KVB_ERR_NOMEM : KVB_ERR_IO;
    }
    return KVB_OK;
}

static void host_destroy(void *ctx) {}

static const kvb_mem_i host_iface = {
    .kind = "host",
    .device_memory = 0,
    .alloc = host_alloc,
    .free = host_free,
    .pinned_alloc = host_alloc,
    .pinned_free = host_free,
    .copy = host_copy,
    .region_create = host_region_create,
    .region_import = host_region_import,
    .region_destroy = host_region_destroy,
    .granularity = host_granularity,
    .chunks_create = host_chunks_create,
    .chunks_destroy = host_chunks_destroy,
    .reserve = host_reserve,
    .release = host_release,
    .map = host_map,
    .unmap = host_unmap,
    .destroy = host_destroy,
};

kvb_status kvb__mem_host_create(const kvb_mem_i **iface, void **ctx) {
    *iface = &host_iface;
    *ctx = NULL;
    return KVB_OK;
}
