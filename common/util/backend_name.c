/* kvbank — backend names (backend_name.h). */
#include "common/util/backend_name.h"

#include <string.h>

#include "common/util/log.h"

kvb_status kvb_backend_act_dtype(const char *name, kvb_dtype *out) {
    /* every name a backend answers to, built in or not (kernels/cuda/backend_cuda.c: the variants) */
    static const struct { const char *name; kvb_dtype dt; } names[] = {
        {"cpu", KVB_DTYPE_F32},       {"cuda", KVB_DTYPE_BF16},     {"cuda:bf16", KVB_DTYPE_BF16},
        {"cuda:f16", KVB_DTYPE_F16},  {"cuda:f32", KVB_DTYPE_F32},
    };
    for (size_t i = 0; i < KVB_ARRAY_LEN(names); i++)
        if (!strcmp(names[i].name, name ? name : "cpu")) {
            *out = names[i].dt;
            return KVB_OK;
        }
    KVB_LOG_E("unknown backend \"%s\" (cpu, cuda, cuda:bf16, cuda:f16, cuda:f32)", name);
    return KVB_ERR_UNSUPPORTED;
}
