/* kvbank — internals of kvb_model shared by the loader (model.c) and the forward pass (forward.c). */
#ifndef KVB_MODEL_MODEL_IMPL_H
#define KVB_MODEL_MODEL_IMPL_H

#include "common/model/model.h"

/* One decoder layer's weights (HF names under model.layers.N.). Matrices are [out][in]; a bias is an
 * [out] vector whose data is NULL when the architecture has none. */
typedef struct kvb_layer_weights {
    kvb_tensor attn_norm; /* input_layernorm.weight            [hidden] */
    kvb_tensor wq;        /* self_attn.q_proj.weight           [n_heads*head_dim][hidden] */
    kvb_tensor wk;        /* self_attn.k_proj.weight           [n_kv_heads*head_dim][hidden] */
    kvb_tensor wv;        /* self_attn.v_proj.weight           [n_kv_heads*head_dim][hidden] */
    kvb_tensor wo;        /* self_attn.o_proj.weight           [hidden][n_heads*head_dim] */
    kvb_tensor bq;        /* self_attn.q_proj.bias (qkv_bias)  [n_heads*head_dim] */
    kvb_tensor bk;        /* self_attn.k_proj.bias (qkv_bias)  [n_kv_heads*head_dim] */
    kvb_tensor bv;        /* self_attn.v_proj.bias (qkv_bias)  [n_kv_heads*head_dim] */
    kvb_tensor bo;        /* self_attn.o_proj.bias (o_bias)    [hidden] */
    kvb_tensor q_norm;    /* self_attn.q_norm.weight (Qwen3)   [head_dim]; data NULL for the others */
    kvb_tensor k_norm;    /* self_attn.k_norm.weight (Qwen3)   [head_dim]; data NULL for the others */
    kvb_tensor ffn_norm;  /* post_attention_layernorm.weight   [hidden] */
    kvb_tensor w_gate;    /* mlp.gate_proj.weight              [intermediate][hidden] */
    kvb_tensor w_up;      /* mlp.up_proj.weight                [intermediate][hidden] */
    kvb_tensor w_down;    /* mlp.down_proj.weight              [hidden][intermediate] */
    kvb_tensor b_gate;    /* mlp.gate_proj.bias (mlp_bias)     [intermediate] */
    kvb_tensor b_up;      /* mlp.up_proj.bias (mlp_bias)       [intermediate] */
    kvb_tensor b_down;    /* mlp.down_proj.bias (mlp_bias)     [hidden] */
    /* On a backend with weight_load_stacked (kernels/backend.h) the projections that share an input
     * are loaded as one weight each, and the separate ones above hold no data: */
    kvb_tensor wqkv;      /* wq, wk, wv stacked                [(n_heads + 2 n_kv_heads) head_dim][hidden] */
    kvb_tensor bqkv;      /* bq, bk, bv stacked (qkv_bias)     [(n_heads + 2 n_kv_heads) head_dim] */
    kvb_tensor w_gu;      /* w_gate, w_up stacked, without mlp_bias [2 intermediate][hidden] */
} kvb_layer_weights;

/* Every tensor of a layer, for walking them all (freeing, counting bytes). */
#define KVB_LAYER_TENSORS(w)                                                                           \
    {&(w)->attn_norm, &(w)->wq, &(w)->wk, &(w)->wv, &(w)->wo, &(w)->bq, &(w)->bk, &(w)->bv, &(w)->bo,       \
     &(w)->q_norm, &(w)->k_norm, &(w)->ffn_norm, &(w)->w_gate, &(w)->w_up, &(w)->w_down, &(w)->b_gate,     \
     &(w)->b_up, &(w)->b_down}
/* The stacked weights, which no checkpoint names; a walk over every tensor a layer holds takes both lists. */
#define KVB_LAYER_STACKED(w) {&(w)->wqkv, &(w)->bqkv, &(w)->w_gu}

struct kvb_model {
    kvb_model_config cfg;
    kvb_backend *be;          /* borrowed */
    kvb_tensor embed;         /* model.embed_tokens.weight [vocab][hidden] */
    kvb_tensor final_norm;    /* model.norm.weight [hidden] */
    kvb_tensor lm_head;       /* lm_head.weight [vocab][hidden]; when tied, data == embed.data */
    int lm_head_tied;         /* lm_head aliases embed: free once */
    kvb_layer_weights *layers;/* [n_layers] */
    float *inv_freq;          /* [head_dim/2] RoPE inverse frequencies (host) */
    int weights_mapped;       /* some weights are the safetensors mapping itself (weight_view) */
    struct kvb_st_set *weights_file; /* that mapping, owned, closed after the weights; NULL otherwise */
    kvb_rope rope;
};

#endif
