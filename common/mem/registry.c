/* kvbank — the one place that knows which memory backends are compiled in and which compute backend
 * uses which (mem.h). kernels/registry.c is its twin for compute. */
#include <stdio.h>
#include <string.h>

#include "config.h"
#include "common/mem/mem_impl.h"
#ifdef KVB_WITH_CUDA
#include "common/mem/region_cuda.h" /* the CUDA memory backend's constructor and probe */
#endif

/* 1 if `name` is `family` or "family:variant". */
static int is_family(const char *name, const char *family) {
    size_t n = strlen(family);
    return !strncmp(name, family, n) && (name[n] == 0 || name[n] == ':');
}

const char *kvb_mem_kind_of(const char *backend) {
    if (!backend || is_family(backend, "cpu") || !strcmp(backend, "host")) return "host";
#ifdef KVB_WITH_CUDA
    if (is_family(backend, "cuda")) return "cuda";
#endif
    return NULL;
}

const char *kvb_mem_list(void) {
#ifdef KVB_WITH_CUDA
    return "host,cuda";
#else
    return "host";
#endif
}

int kvb_mem_probe(const char *backend, int device, char *why, size_t why_len) {
    if (why && why_len) why[0] = 0;
    const char *kind = kvb_mem_kind_of(backend);
    if (!kind) {
        if (why && why_len)
            snprintf(why, why_len, "backend \"%.40s\" is not built into this binary (memory: %s)", backend,
                     kvb_mem_list());
        return 0;
    }
    if (!strcmp(kind, "host")) {
        if (device > 0) {
            if (why && why_len) snprintf(why, why_len, "host memory has no device %d (only 0)", device);
            return 0;
        }
        return 1;
    }
#ifdef KVB_WITH_CUDA
    return kvb__mem_cuda_probe(device < 0 ? 0 : device, why, why_len);
#else
    return 0;
#endif
}

kvb_status kvb_mem_create(const char *backend, int device, kvb_mem **out) {
    if (!out) return KVB_ERR_INVALID;
    *out = NULL;
    const char *kind = kvb_mem_kind_of(backend);
    if (!kind) {
        KVB_LOG_E("backend \"%.40s\" has no memory backend in this binary (memory: %s)", backend ? backend : "",
                  kvb_mem_list());
        return KVB_ERR_UNSUPPORTED;
    }
    if (device < -1) {
        KVB_LOG_E("device %d: a device is a number >= 0", device);
        return KVB_ERR_INVALID;
    }
    const kvb_mem_i *iface = NULL;
    void *ctx = NULL;
    if (!strcmp(kind, "host")) {
        if (device > 0) {
            KVB_LOG_E("host memory has no device %d (only 0)", device);
            return KVB_ERR_INVALID;
        }
        KVB_TRY(kvb__mem_host_create(&iface, &ctx));
        device = 0;
    }
#ifdef KVB_WITH_CUDA
    else {
        KVB_TRY(kvb__mem_cuda_create(&device, &iface, &ctx));
    }
#endif
    return kvb__mem_wrap(iface, ctx, device, out);
}
