/* kvbank — what a backend's name alone says, known below the kernels library: the layers that check a
 * node's config and models (kvbankd, the model checks) size KV blocks by it without linking a backend. */
#ifndef KVB_BACKEND_NAME_H
#define KVB_BACKEND_NAME_H

#include "common/util/status.h"
#include "common/util/util.h"

/* The activation dtype (which the KV cache shares) of the backend called `name` ("cpu", "cuda",
 * "cuda:f16", ...; NULL is "cpu"), also for backends not built into this binary; it must equal the
 * created backend's iface->act_dtype (kernels/cpu, kernels/cuda: test_backend_consistency and
 * test_kernels check it). KVB_ERR_UNSUPPORTED (logged) for a name no backend answers to. */
kvb_status kvb_backend_act_dtype(const char *name, kvb_dtype *out);

#endif
