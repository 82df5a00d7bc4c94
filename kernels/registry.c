/* kvbank — the one place that knows which backends are compiled in. */
#include <string.h>

#include "config.h"
#include "kernels/backend.h"
#ifdef KVB_WITH_CUDA
#include "kernels/cuda/backend_cuda.h"
#endif

#ifdef KVB_WITH_CUDA
/* "cuda" or "cuda:VARIANT" (see kernels/cuda/backend_cuda.h); *variant is NULL for plain "cuda". */
static int is_cuda_name(const char *name, const char **variant) {
    if (strncmp(name, "cuda", 4) || (name[4] && name[4] != ':')) return 0;
    *variant = name[4] ? name + 5 : NULL;
    return 1;
}
#endif

kvb_status kvb_backend_create_on(const char *name, int device, int n_threads, kvb_backend **out) {
    if (!out) return KVB_ERR_INVALID;
    *out = NULL;
    if (!name) name = "cpu";
#ifdef KVB_WITH_CUDA
    const char *variant = NULL;
    int cuda = is_cuda_name(name, &variant);
#else
    int cuda = 0;
#endif
    int cpu_bf16 = !strcmp(name, "cpu:bf16");
    if (strcmp(name, "cpu") != 0 && !cpu_bf16 && !cuda) {
        KVB_LOG_E("backend \"%s\" is not built into this binary (available: %s)", name, kvb_backend_list());
        return KVB_ERR_UNSUPPORTED;
    }
    kvb_backend *be = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *be, (void **)&be));
    kvb_status st;
    /* memory first: it selects the device (and says "no CUDA device" when there is none) */
    KVB_TRY_GOTO(kvb_mem_create(name, device, &be->mem), fail);
    if (!cuda) st = kvb__backend_cpu_create(n_threads, cpu_bf16, be);
#ifdef KVB_WITH_CUDA
    else st = kvb__backend_cuda_create(variant, n_threads, be);
#endif
    if (st != KVB_OK) goto fail;
    *out = be;
    return KVB_OK;
fail:
    kvb_mem_destroy(be->mem);
    free(be);
    return st;
}

kvb_status kvb_backend_create(const char *name, int n_threads, kvb_backend **out) {
    return kvb_backend_create_on(name, -1, n_threads, out);
}

void kvb_backend_destroy(kvb_backend *be) {
    if (!be) return;
    if (be->iface && be->iface->destroy) be->iface->destroy(be->ctx);
    kvb_mem_destroy(be->mem);
    free(be);
}

const char *kvb_backend_list(void) {
#ifdef KVB_WITH_CUDA
    return "cpu,cpu:bf16,cuda";
#else
    return "cpu,cpu:bf16";
#endif
}
