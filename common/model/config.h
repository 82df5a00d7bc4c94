/* kvbank — the Hugging Face `config.json` of a causal LM, validated. */
#ifndef KVB_MODEL_CONFIG_H
#define KVB_MODEL_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "common/model/quant.h"
#include "common/util/util.h"

typedef enum kvb_arch {
    KVB_ARCH_LLAMA = 0,   /* LlamaForCausalLM (Llama 2/3): optional attention_bias, mlp_bias */
    KVB_ARCH_QWEN3 = 1,   /* Qwen3ForCausalLM: Llama plus per-head q/k RMSNorm; optional attention_bias,
                           * sliding window on the layers from max_window_layers on */
    KVB_ARCH_MISTRAL = 2, /* MistralForCausalLM: Llama with a sliding window on every layer */
    KVB_ARCH_QWEN2 = 3,   /* Qwen2ForCausalLM (Qwen2, Qwen2.5): Llama with q/k/v biases; window as Qwen3 */
} kvb_arch;

/* rope_scaling types kvbank computes (transformers' ROPE_INIT_FUNCTIONS of the same names). */
typedef enum kvb_rope_type {
    KVB_ROPE_DEFAULT = 0,
    KVB_ROPE_LINEAR = 1, /* inv_freq / factor */
    KVB_ROPE_LLAMA3 = 2, /* Llama 3.1's wavelength-banded interpolation */
    KVB_ROPE_YARN = 3,   /* YaRN: ramp between interpolation and extrapolation, attention factor */
} kvb_rope_type;

#define KVB_MAX_EOS 8
#define KVB_MODEL_MAX_LAYERS 4096

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
    /* rope_scaling (or rope_parameters); the fields a type does not use are 0 */
    kvb_rope_type rope_type;
    double rope_factor;           /* linear, llama3, yarn */
    double rope_low_freq_factor;  /* llama3 */
    double rope_high_freq_factor; /* llama3 */
    int rope_orig_max_pos;        /* llama3, yarn: original_max_position_embeddings */
    double rope_beta_fast;        /* yarn (default 32) */
    double rope_beta_slow;        /* yarn (default 1) */
    int rope_truncate;            /* yarn: round the correction range outwards (default 1) */
    double rope_attn_factor;      /* yarn's attention factor on cos and sin (1 for the other types) */
    /* biases of the linear layers (each a [out] vector next to its weight) */
    int qkv_bias;          /* q_proj, k_proj, v_proj: Qwen2 always; Llama / Qwen3 with attention_bias */
    int o_bias;            /* o_proj: Llama / Qwen3 with attention_bias */
    int mlp_bias;          /* gate_proj, up_proj, down_proj: Llama with mlp_bias */
    /* sliding-window attention: layer l attends to its last sliding_window keys when bit l of
     * window_layers is set (kvb_model_config_window); sliding_window 0 = no layer slides */
    int sliding_window;
    uint8_t window_layers[KVB_MODEL_MAX_LAYERS / 8];
    int bos_id;            /* -1 when absent */
    int eos_ids[KVB_MAX_EOS];
    int n_eos;
    kvb_dtype torch_dtype; /* informational */
    kvb_quant_config quant; /* quantization_config: which linear layers hold FP8 weights, and how */
} kvb_model_config;

/* Parses config.json text. On error returns KVB_ERR_FORMAT (bad JSON), KVB_ERR_UNSUPPORTED (an unknown
 * architecture, or a field whose value changes the computation in a way kvbank does not implement) or
 * KVB_ERR_INVALID (a missing or out-of-range field) and logs a message naming the field. */
kvb_status kvb_model_config_parse(const char *text, size_t len, kvb_model_config *out);
/* Reads and parses `dir`/config.json. */
kvb_status kvb_model_config_load(const char *dir, kvb_model_config *out);

/* Bytes per KV element of a model run on the backend called `backend` (NULL: cpu): the KV cache is
 * stored in the backend's activation dtype. The one rule for every place that sizes KV memory (the
 * model's geometry, kvbankctl's plan, which reads no weights). KVB_ERR_UNSUPPORTED for an unknown
 * backend name. */
kvb_status kvb_model_kv_elem_size(const char *backend, int *out);

/* Fills inv_freq[head_dim/2] as transformers' rotary embedding does (default, linear, llama3, yarn). */
void kvb_model_config_rope_inv_freq(const kvb_model_config *c, float *inv_freq);

/* The sliding window of layer `layer` (0: full causal attention). */
int kvb_model_config_window(const kvb_model_config *c, int layer);

/* "Llama", "Qwen3", "Mistral", "Qwen2" (static string). */
const char *kvb_arch_name(kvb_arch a);

#endif
