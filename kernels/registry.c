/* kvbank — the one place that knows which backends are compiled in. */
#include <string.h>

#include "config.h"
#include "kernels/backend.h"

kvb_status kvb_backend_create(const char *name, int n_threads, kvb_backend **out) {
    kvb_backend *be = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *be, (void **)&be));
    kvb_status st;
    if (!name || !strcmp(name, "cpu")) {
        st = kvb__backend_cpu_create(n_threads, be);
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

const char *kvb_backend_list(void) { return "cpu"; }
