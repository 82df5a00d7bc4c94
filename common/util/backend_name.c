/* kvbank — backend names (backend_name.h). */
#include "common/util/backend_name.h"

#include <string.h>

#include "common/util/log.h"

/* every name a backend answers to, built in or not (kernels/registry.c, kernels/cuda/backend_cuda.c: the
 * variants): its activations' dtype and its KV cache's */
static const struct {
    const char *name;
    kvb_dtype act, kv;
} names[] = {
    {"cpu", KVB_DTYPE_F32, KVB_DTYPE_F32},           {"cpu:bf16", KVB_DTYPE_F32, KVB_DTYPE_BF16},
    {"cuda", KVB_DTYPE_BF16, KVB_DTYPE_BF16},        {"cuda:bf16", KVB_DTYPE_BF16, KVB_DTYPE_BF16},
    {"cuda:f16", KVB_DTYPE_F16, KVB_DTYPE_F16},      {"cuda:f32", KVB_DTYPE_F32, KVB_DTYPE_F32},
};

static kvb_status lookup(const char *name, kvb_dtype *act, kvb_dtype *kv) {
    for (size_t i = 0; i < KVB_ARRAY_LEN(names); i++)
        if (!strcmp(names[i].name, name ? name : "cpu")) {
            if (act) *act = names[i].act;
            if (kv) *kv = names[i].kv;
            return KVB_OK;
        }
    KVB_LOG_E("unknown backend \"%s\" (cpu, cpu:bf16, cuda, cuda:bf16, cuda:f16, cuda:f32)", name);
    return KVB_ERR_UNSUPPORTED;
}

kvb_status kvb_backend_act_dtype(const char *name, kvb_dtype *out) { return lookup(name, out, NULL); }

kvb_status kvb_backend_kv_dtype(const char *name, kvb_dtype *out) { return lookup(name, NULL, out); }
