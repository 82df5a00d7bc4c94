/* kvbank — what a backend's name alone says, known below the kernels library: the layers that check a
 * node's config and models (kvbankd, the model checks) size KV blocks by it without linking a backend. */
#ifndef KVB_BACKEND_NAME_H
#define KVB_BACKEND_NAME_H

#include "common/util/status.h"
#include "common/util/util.h"

/* The activation dtype of the backend called `name` ("cpu", "cpu:bf16", "cuda", "cuda:f16", ...; NULL
 * is "cpu"), also for backends not built into this binary; it must equal the created backend's
 * iface->act_dtype (kernels/cpu, kernels/cuda: test_backend_consistency and test_kernels check it).
 * KVB_ERR_UNSUPPORTED (logged) for a name no backend answers to. */
kvb_status kvb_backend_act_dtype(const char *name, kvb_dtype *out);
/* The dtype of its KV cache: the activation dtype, except "cpu:bf16" (f32 arithmetic on a bf16 KV cache:
 * half the bytes a decode step reads from its context, agreeing with "cpu" within bf16's rounding). The
 * kernels read it from the geometry's elem_size (kvb_model_kv_elem_size). */
kvb_status kvb_backend_kv_dtype(const char *name, kvb_dtype *out);

#endif
