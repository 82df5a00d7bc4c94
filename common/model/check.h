/* kvbank — checking a model directory without loading it: what kvbankd (--check-config, and before it
 * starts anything) needs, in a library of its own so that kvbankd does not link the engine. config.json,
 * the safetensors headers with every tensor the architecture needs by name and shape (no weight is
 * read), the tokenizer and the chat template (parsed as the gateway parses them), and the names a node
 * config may give a model's policy. */
#ifndef KVB_MODEL_CHECK_H
#define KVB_MODEL_CHECK_H

#include <stddef.h>
#include <stdint.h>

#include "common/model/config.h"
#include "common/model/safetensors.h"

/* The tensors of one decoder layer, in the order of model_impl.h's KVB_LAYER_TENSORS. */
typedef enum kvb_layer_tensor_id {
    KVB_LT_ATTN_NORM, KVB_LT_WQ, KVB_LT_WK, KVB_LT_WV, KVB_LT_WO, KVB_LT_BQ, KVB_LT_BK, KVB_LT_BV, KVB_LT_BO,
    KVB_LT_Q_NORM, KVB_LT_K_NORM, KVB_LT_FFN_NORM, KVB_LT_W_GATE, KVB_LT_W_UP, KVB_LT_W_DOWN, KVB_LT_B_GATE,
    KVB_LT_B_UP, KVB_LT_B_DOWN, KVB_LT_COUNT
} kvb_layer_tensor_id;

/* One tensor a layer of this architecture has: its name under model.layers.N., which one it is, and
 * its shape (cols 0: a vector). */
typedef struct kvb_layer_tensor_spec {
    const char *suffix;
    kvb_layer_tensor_id id;
    int64_t rows, cols;
} kvb_layer_tensor_spec;

/* The tensors every layer of `c`'s architecture has; returns how many were written to spec. */
int kvb_model_layer_spec(const kvb_model_config *c, kvb_layer_tensor_spec spec[KVB_LT_COUNT]);

/* Finds `name` in `set` and checks it is exactly [rows] (cols 0) or [rows][cols]; errors name the tensor
 * and both shapes (logged). Reads only the header. */
kvb_status kvb_model_find_weight(const kvb_st_set *set, const char *name, int64_t rows, int64_t cols,
                                 const kvb_st_tensor **out);

/* The linear layer (kvb_proj, common/model/quant.h) whose weight layer tensor `id` is; -1 for the others. */
int kvb_model_layer_proj(kvb_layer_tensor_id id);

/* The checks of an FP8 weight `t` called `wname` ("X.weight") without reading its data: F8_E4M3, and its
 * scale "X.weight_scale" there with one value ([], [1], [1, 1]) or one per output row ([rows], [rows, 1])
 * as `per_channel` says, in f32, bf16 or f16 (*scale_out). Errors name the tensor (logged). */
kvb_status kvb_model_find_fp8(const kvb_st_set *set, const char *wname, const kvb_st_tensor *t, int per_channel,
                              const kvb_st_tensor **scale_out);

/* Tensor `t` called `name` is FP8 (with its scale) exactly when the config quantizes it (`fp8`). */
kvb_status kvb_model_check_dtype(const kvb_st_set *set, const kvb_model_config *c, const char *name,
                                 const kvb_st_tensor *t, int fp8);

/* The checks of kvb_model_load without loading anything: config.json, the safetensors headers and
 * every tensor the architecture needs, by name, shape and (FP8 checkpoints) dtype and scale; no weight is
 * read. Errors name the file, field or tensor (logged). Fills *cfg when not NULL. */
kvb_status kvb_model_check(const char *dir, kvb_model_config *cfg);

/* What a model directory offers for text: has_tokenizer (tokenizer.json loads), has_chat (its chat
 * template parses). A tokenizer or template that is there but cannot be used is described in
 * why[why_len] (the file and the reason); a server then takes token ids only, or serves the model
 * without chat. Returns KVB_OK whether or not they are there. */
kvb_status kvb_model_check_text(const char *dir, int *has_tokenizer, int *has_chat, char *why, size_t why_len);

/* 1 when `name` is a policy of the registry (common/policy/policies.def). */
int kvb_model_policy_known(const char *name);

#endif
