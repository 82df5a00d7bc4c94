/* kvbank — quantized checkpoints: the `quantization_config` of config.json.
 *
 * One format is understood: compressed-tensors (what llm-compressor writes; quant_method
 * "compressed-tensors", format "float-quantized"), FP8 E4M3 weights of the linear layers with a scale per
 * tensor or per output channel, either weight-only (input_activations null) or with the layers' inputs
 * quantized to FP8 dynamically per token (input_activations {dynamic: true, strategy: "token"}). The
 * `targets` and `ignore` lists decide which linear layers are quantized ("Linear", module names, and
 * "re:" regular expressions matched from the start of the name, as compressed-tensors matches them).
 * Everything else — other formats and methods, static or per-tensor activation scales, group and block
 * strategies, integer types, output activations, an FP8 KV cache (kv_cache_scheme) — is refused by name.
 * docs/weights.md has the scheme and the arithmetic. */
#ifndef KVB_MODEL_QUANT_H
#define KVB_MODEL_QUANT_H

#include <stdint.h>

#include "common/util/util.h"

/* The linear layers of a decoder layer, as bits of kvb_quant_config.layers. */
typedef enum kvb_proj {
    KVB_PROJ_Q = 0,
    KVB_PROJ_K,
    KVB_PROJ_V,
    KVB_PROJ_O,
    KVB_PROJ_GATE,
    KVB_PROJ_UP,
    KVB_PROJ_DOWN,
    KVB_PROJ_COUNT,
} kvb_proj;

/* The HF module name of projection p under model.layers.N. ("self_attn.q_proj", ..., "mlp.down_proj"). */
const char *kvb_proj_name(kvb_proj p);

#define KVB_QUANT_MAX_LAYERS 4096

typedef struct kvb_quant_config {
    int fp8;         /* 1: FP8 E4M3 weights (compressed-tensors float-quantized); 0: none, the rest is 0 */
    int per_channel; /* weights' strategy "channel": a scale per output row; 0: "tensor", one scale */
    int act_token;   /* input_activations dynamic per token (W8A8); 0: weight-only (W8A16) */
    int lm_head;     /* lm_head is quantized (a target and not in `ignore`) */
    uint8_t layers[KVB_QUANT_MAX_LAYERS]; /* bit p (kvb_proj): that linear layer of layer l is quantized */
} kvb_quant_config;

/* Parses config.json's `quantization_config` value `qc` (a jansson object; NULL or null: not quantized)
 * for a model of n_layers layers whose LM head is tied to the embedding when `tied`. KVB_ERR_UNSUPPORTED
 * for a scheme kvbank does not run, KVB_ERR_INVALID for a malformed one, each logged naming the field
 * and value. */
struct json_t;
kvb_status kvb_quant_config_parse(const struct json_t *qc, int n_layers, int tied, kvb_quant_config *out);

/* Whether projection p of layer l (p = KVB_PROJ_COUNT: the LM head) is quantized. */
int kvb_quant_is_quantized(const kvb_quant_config *q, int layer, int p);

#endif
