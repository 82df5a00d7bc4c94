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

kvb_status kvb_backend_create(const char *name, int n_threads, kvb_backend **out) {
#ifdef KVB_WITH_CUDA
    const char *variant = NULL;
#endif
    kvb_backend *be = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *be, (void **)&be));
    kvb_status st;
    if (!name || !strcmp(name, "cpu")) {
        st = kvb__backend_cpu_create(n_threads, be);
#ifdef KVB_WITH_CUDA
    } else if (is_cuda_name(name, &variant)) {
        st = kvb__backend_cuda_create(variant, n_threads, be);
#endif
    } else {
        KVB_LOG_E("backend \"%s\" is not built into this binary (available: %s)", name, kvb_backend_list());
        st = KVB_ERR_UNSUPPORTED;
    }
    if (st != KVB_OK) {
        free(be);
        return st;
    }
    *out = be;
    return KVB_OK;
}

void kvb_backend_destroy(kvb_backend *be) {
    if (!be) return;
    if (be->iface && be->iface->destroy) be->iface->destroy(be->ctx);
    free(be);
}

const char *kvb_backend_list(void) {
#ifdef KVB_WITH_CUDA
    return "cpu,cuda";
#else
    return "cpu";
#endif
}
