/* kvbank — the KV block layout: plain data that the kernels (attention reads blocks) and the KV layer
 * (pools of blocks) share, below both. */
#ifndef KVB_UTIL_KV_GEOM_H
#define KVB_UTIL_KV_GEOM_H

/* KV geometry of one model's cache, shared by every layer that reads blocks.
 * One block holds `block_size` tokens of every layer: [n_layers][2 (K,V)][block_size][n_kv_heads][head_dim]
 * (SwiftCache §3.4 block-major). A block's slice for one layer is [2][block_size][n_kv_heads][head_dim]. */
typedef struct kvb_kv_geom {
    int n_layers;
    int n_kv_heads;
    int head_dim;
    int block_size; /* tokens per block */
    int elem_size;  /* bytes per K/V element (4 on the CPU backend) */
} kvb_kv_geom;

#endif
