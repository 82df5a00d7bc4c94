/* kvbank — the Hugging Face `config.json` of a causal LM, validated. */
#ifndef KVB_MODEL_CONFIG_H
#define KVB_MODEL_CONFIG_H

#include <stddef.h>

#include "common/util/util.h"

typedef enum kvb_arch {
    KVB_ARCH_LLAMA = 0, /* LlamaForCausalLM (Llama 2/3) */
    KVB_ARCH_QWEN3 = 1, /* Qwen3ForCausalLM: Llama plus per-head q/k RMSNorm */
} kvb_arch;

#define KVB_MAX_EOS 8

typedef struct kvb_model_config {
    kvb_arch arch;
    int n_layers;          /* num_hidden_layers */
    int hidden;            /* hidden_size */
    int n_heads;           /* num_attention_heads */
    int n_kv_heads;        /* num_key_value_heads (defaults to n_heads) */
    int head_dim;          /* head_dim (defaults to hidden / n_heads) */
    int intermediate;      /* intermediate_size */
    int vocab;             /* vocab_size */
    int max_pos;           /* max_position_embeddings */
    float rms_eps;         /* rms_norm_eps */
    double rope_theta;     /* rope_theta (default 10000) */
    int tie_embeddings;    /* tie_word_embeddings */
    /* rope_scaling {"rope_type": "llama3", factor, low_freq_factor, high_freq_factor,
     * original_max_position_embeddings}; rope_llama3 = 0 when absent. */
    int rope_llama3;
    double rope_factor;
    double rope_low_freq_factor;
    double rope_high_freq_factor;
    int rope_orig_max_pos;
    int bos_id;            /* -1 when absent */
    int eos_ids[KVB_MAX_EOS];
    int n_eos;
    kvb_dtype torch_dtype; /* informational */
} kvb_model_config;

/* Parses config.json text. On error returns KVB_ERR_FORMAT (bad JSON), KVB_ERR_UNSUPPORTED (unknown
 * architecture or rope type) or KVB_ERR_INVALID (a missing or out-of-range field) and logs a message
 * naming the field. */
kvb_status kvb_model_config_parse(const char *text, size_t len, kvb_model_config *out);
/* Reads and parses `dir`/config.json. */
kvb_status kvb_model_config_load(const char *dir, kvb_model_config *out);

/* Bytes per KV element of a model run on the backend called `backend` (NULL: cpu): the KV cache is
 * stored in the backend's activation dtype. The one rule for every place that sizes KV memory (the
 * model's geometry, kvbankctl's plan, which reads no weights). KVB_ERR_UNSUPPORTED for an unknown
 * backend name. */
kvb_status kvb_model_kv_elem_size(const char *backend, int *out);

/* Fills inv_freq[head_dim/2] as transformers' rotary embedding does (default and llama3 types). */
void kvb_model_config_rope_inv_freq(const kvb_model_config *c, float *inv_freq);

#endif
