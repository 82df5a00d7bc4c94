/* kvbank — the compute backend interface (ggml-style vtable).
 *
 * A backend owns its weights and runs the transformer's operators on memory of its kind, which comes
 * from the backend object's memory backend (`kvb_backend.mem`, common/mem/mem.h). Model, scheduler and policy code see only this header; which backends exist is decided in
 * kernels/registry.c alone. Every operator is asynchronous with respect to the host on a device
 * backend (ordered on the backend's stream) and synchronous on the CPU one; `sync` waits for all.
 *
 * Activations live in backend buffers of `act_dtype` elements (f32 on the CPU backend). Row-major
 * everywhere: a matrix [rows][cols] has cols contiguous. Weights are kvb_tensor objects created by
 * `weight_load`, in whatever layout and dtype the backend prefers. */
#ifndef KVB_KERNELS_BACKEND_H
#define KVB_KERNELS_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "common/mem/mem.h"
#include "common/util/backend_name.h"
#include "common/util/kv_geom.h"
#include "common/util/util.h"

/* How a product quantizes its input rows before it multiplies (compressed-tensors' input_activations;
 * docs/weights.md). */
typedef enum kvb_act_quant {
    KVB_ACT_NONE = 0,      /* x as it is */
    KVB_ACT_FP8_TOKEN = 1, /* dynamic, per token: s = max|x| / 448 (the float32 epsilon when 0), q = x / s
                            * clamped to [-448, 448] and rounded to E4M3, ties to even; y = (q . w^T) * s */
} kvb_act_quant;

/* A weight matrix or vector on a backend. ne[0] = rows (output features), ne[1] = columns (input
 * features; 1 for a vector). `data` is backend memory owned by the backend (free with weight_free). */
typedef struct kvb_tensor {
    void *data;
    kvb_dtype dtype;
    int64_t ne[2];
    int view; /* 1: data is the caller's memory, used in place (weight_view); weight_free frees nothing */
    /* FP8 weights (weight_fp8): element [r][c] stands for data[r][c] * scale[r] (n_scale == ne[0]) or
     * data[r][c] * scale[0] (n_scale == 1); f32 in backend memory, owned by the tensor. NULL otherwise. */
    float *scale;
    int64_t n_scale;
    kvb_act_quant act; /* how matmul quantizes x for this weight */
} kvb_tensor;

/* An FP8 weight as a checkpoint holds it (compressed-tensors float-quantized; common/model/quant.h). */
typedef struct kvb_fp8_weight {
    const void *data;   /* [rows][cols] E4M3 bytes, host memory (the mapped file) */
    int64_t rows, cols;
    const float *scale; /* [n_scale] host f32: one per tensor (n_scale 1) or one per output row (rows) */
    int64_t n_scale;
    kvb_act_quant act;
} kvb_fp8_weight;

/* RoPE parameters precomputed from the model config (HF `rotary_emb`, incl. rope_scaling llama3).
 * The rotation is the "rotate_half" (NeoX) form used by Llama and Qwen3 in transformers. */
typedef struct kvb_rope {
    int head_dim;
    const float *inv_freq; /* [head_dim/2] host array, owned by the model */
} kvb_rope;


/* One sequence of a flattened attention batch. Its new tokens are rows [q_start, q_start+q_len) of
 * the batch and sit at positions [ctx_len-q_len, ctx_len) of the sequence; attention is causal over
 * the sequence's first ctx_len tokens, which live in its blocks in order. */
typedef struct kvb_attn_seq {
    int q_start;
    int q_len;
    int ctx_len;
    int n_blocks;  /* = ceil(ctx_len / block_size) */
    int blk_first; /* index of this sequence's first entry in kvb_attn_batch.layer_blocks */
} kvb_attn_seq;

/* The forward pass may run a layer's rows in chunks (common/model/forward.c): a step's rows then
 * arrive at the backend in pieces, [c0, c1) of the step, over several calls; a sequence's rows too,
 * each piece's attention seeing the keys up to its last row (kvb_attn_batch.row0 = c0). Cuts are at
 * rows that are multiples of this, with at least 32 rows of a sequence on each side of a cut inside
 * it, and a piece holds more than 32 rows. A backend's result for a row must not depend on the cuts:
 * the CPU backend's OpenBLAS path (no AVX2; the streaming kernel's products do not depend on the rows at
 * all) handles the rows of its operand in groups counted from the first (12 for the Zen / Haswell
 * kernels, the tail by narrower kernels that sum in another order), so pieces starting at multiples of
 * 192 are grouped as in one piece; its attention tiles a sequence's
 * rows at step rows that are multiples of its tile, which divides this. */
#define KVB_CHUNK_ALIGN_ROWS 192

/* The attention view of one step for one layer. `layer_blocks[blk_first + j]` is the address of the
 * j-th block's slice for the current layer ([2][block_size][n_kv_heads][head_dim]); the executor fills
 * it per layer, so a block may live in the local pool, another process's region, a layer stream
 * buffer or a prefetch buffer, and attention does not care. */
typedef struct kvb_attn_batch {
    const kvb_kv_geom *geom;
    int n_heads;     /* query heads; n_heads % geom->n_kv_heads == 0 */
    int n_tokens;    /* rows of q */
    int n_seqs;
    const kvb_attn_seq *seqs;   /* [n_seqs] host array */
    void *const *layer_blocks;  /* [sum of n_blocks] backend addresses */
    float scale;                /* softmax scale: 1/sqrt(head_dim), times YaRN's attention factor squared */
    int window;                 /* sliding window (Mistral, Qwen2): a query at position p sees the keys at
                                 * positions (p - window, p]; 0 = every earlier key (full causal) */
    int row0;                   /* the step's row that is q's first: the rows of a piece (see
                                 * KVB_CHUNK_ALIGN_ROWS); 0 for a whole step */
} kvb_attn_batch;

/* The copy engines of a device: each direction has its stream (OrbitFlow §3.3.1 models the host link as
 * shared per direction), so loads, stores and peer copies run beside each other and beside the compute. */
typedef enum kvb_copy_engine {
    KVB_ENGINE_H2D = 0,  /* host -> backend memory (pinned host memory overlaps; pageable is staged) */
    KVB_ENGINE_D2H = 1,  /* backend -> host memory */
    KVB_ENGINE_PEER = 2, /* backend -> backend memory: this device, or a region imported from another process */
    KVB_ENGINE_COUNT = 3,
} kvb_copy_engine;

/* One piece of an asynchronous copy: `bytes` from `src` to `dst`. */
typedef struct kvb_copy_piece {
    void *dst;
    const void *src;
    size_t bytes;
} kvb_copy_piece;

/* How one logit row is sampled (common/sched/sampling.h's kvb_sampling with the row's uniform draw). */
typedef struct kvb_sample_row {
    float temperature; /* <= 0: greedy (argmax, lowest id on ties) */
    int32_t top_k;     /* 0: off */
    float top_p;       /* <= 0 or >= 1: off */
    double u;          /* uniform in [0, 1) from the request's kvb_rng; unused when greedy */
} kvb_sample_row;

typedef struct kvb_backend_i {
    const char *name;
    kvb_dtype act_dtype; /* element type of activation buffers */
    /* Rows a layer runs at once in the forward pass (kvb_forward_chunk's default; 0: KVB_FORWARD_CHUNK_ROWS).
     * A device backend takes more: its products reach the GEMM rate only on larger tiles. */
    int chunk_rows;

    /* Memory is not the compute backend's business: buffers, pools and regions come from the
     * backend object's `mem` (common/mem/mem.h). */
    /* Host <-> backend copies of raw bytes; `to_host` waits for the data. */
    kvb_status (*to_device)(void *ctx, void *dst, const void *src, size_t bytes);
    kvb_status (*to_host)(void *ctx, void *dst, const void *src, size_t bytes);
    /* Copy activations to host as f32 (n elements), converting from act_dtype. */
    kvb_status (*to_host_f32)(void *ctx, float *dst, const void *src, size_t n);
    /* Backend -> backend copy of raw bytes: both addresses are backend memory, possibly in a region
     * imported from another process (moving a lent block, streaming the LSC). Returns when the
     * bytes are in place, so the copy is ordered after nothing and before everything the caller
     * does next. Safe to call from a second host thread while operators run (the LSC copy thread
     * does), on ranges those operators do not touch. May be NULL: lending then preempts instead of
     * moving and refuses LSC streaming. */
    kvb_status (*copy)(void *ctx, void *dst, const void *src, size_t bytes);
    /* Wait until every operator issued so far has finished. */
    kvb_status (*sync)(void *ctx);

    /* Tickets: copies that complete on their own, so that compute and copies overlap. Optional together
     * (NULL: the stager copies with to_device / to_host / copy, each done when it returns). A ticket is a
     * number > 0, increasing with every copy_async of the backend object; every member may be called from
     * any host thread (the stager's copy threads), and a device backend makes its device current there. */
    /* Issues pieces x[0..n) in order on `dir`'s copy stream, after every operator issued before the call
     * (a store reads what they wrote; a load may overwrite what they read), and returns the ticket of
     * their completion. Returns without waiting for the bytes (for pageable host memory the device
     * backend may wait; pinned memory from kvb_mem_pinned_alloc overlaps). The host must not touch the
     * destinations, nor change the sources, before the ticket is done. */
    kvb_status (*copy_async)(void *ctx, kvb_copy_engine dir, const kvb_copy_piece *x, int n, uint64_t *ticket);
    /* Operators issued after this call run after copy `ticket` has landed (cudaStreamWaitEvent on the
     * compute stream); the host does not wait. */
    kvb_status (*wait_ticket)(void *ctx, uint64_t ticket);
    /* 1 when copy `ticket` has landed (its buffers may be reused), 0 when not yet; never blocks. */
    int (*ticket_done)(void *ctx, uint64_t ticket);
    /* The host waits until copy `ticket` has landed; the copy's error, if it failed. */
    kvb_status (*ticket_wait)(void *ctx, uint64_t ticket);

    /* Weights. Creates `dst` from host data in `src_dtype` of shape [rows][cols]; converts as needed. */
    kvb_status (*weight_load)(void *ctx, const void *src, kvb_dtype src_dtype, int64_t rows, int64_t cols,
                              kvb_tensor *dst);
    /* Optional (NULL: every weight goes through weight_load). Makes `dst` use host memory `src` of
     * shape [rows][cols] in place, without a copy, when the backend computes on it as it lies (the CPU
     * backend: f32 anything, bf16 and f16 matrices); KVB_ERR_UNSUPPORTED otherwise, and the caller loads a
     * copy. The caller keeps `src` readable until weight_free (the model keeps its safetensors mapping open). */
    kvb_status (*weight_view)(void *ctx, const void *src, kvb_dtype src_dtype, int64_t rows, int64_t cols,
                              kvb_tensor *dst);
    /* Optional (NULL: FP8 checkpoints are refused on this backend). Creates `dst` from an FP8 weight: the
     * E4M3 data in place where the backend computes on it as it lies (dst->view = 1: the caller keeps
     * src->data readable until weight_free, as for weight_view), else copied; the scales copied.
     * KVB_ERR_INVALID for a NaN byte (0x7f / 0xff) in the data. */
    kvb_status (*weight_fp8)(void *ctx, const kvb_fp8_weight *src, kvb_tensor *dst);
    void (*weight_free)(void *ctx, kvb_tensor *t);

    /* out[i][:] = table[ids[i]][:] for i < n; ids is a host array already validated (< rows). */
    kvb_status (*embed)(void *ctx, const kvb_tensor *table, const int32_t *ids, int n, void *out);
    /* y[n][rows(w)] = x[n][cols(w)] . w^T + beta * y   (beta 0 or 1: 1 fuses the residual add); for an FP8
     * weight, w^T's dequantized values and x quantized as w->act says. */
    kvb_status (*matmul)(void *ctx, const void *x, int n, const kvb_tensor *w, float beta, void *y);
    /* Optional (NULL: the caller runs `matmul` with beta 0 per weight). y[i] = x . w[i]^T for i < nw,
     * weights of the same cols sharing one input (q/k/v, gate/up): one pass of the backend's threads
     * over all of them, so a decode step waits at a third fewer joins of the team. */
    kvb_status (*matmul_n)(void *ctx, const void *x, int n, const kvb_tensor *const *w, int nw, void *const *y);
    /* RMSNorm over `rows` rows of `dim`: y = x / sqrt(mean(x^2) + eps) * w  (w has `dim` entries).
     * x and y may alias. Used for layer norms and Qwen3's per-head q/k norm (rows = tokens*heads). */
    kvb_status (*rmsnorm)(void *ctx, const void *x, int rows, int dim, const kvb_tensor *w, float eps, void *y);
    /* Rotates q [n][n_heads][hd] and k [n][n_kv_heads][hd] in place at positions pos[n] (host array). */
    kvb_status (*rope)(void *ctx, void *q, int n_heads, void *k, int n_kv_heads, int n, const int32_t *pos,
                       const kvb_rope *rope);
    /* y[i][:] += b[:] for i < n: a linear layer's bias (b is a vector weight of `dim` entries, from
     * weight_load with cols 1; y is [n][dim] activations). */
    kvb_status (*bias_add)(void *ctx, void *y, int n, const kvb_tensor *b);
    /* out[i] = silu(gate[i]) * up[i] for i < n. out may alias gate. */
    kvb_status (*silu_mul)(void *ctx, const void *gate, const void *up, size_t n, void *out);
    /* Writes the batch's new K and V rows ([n_tokens][n_kv_heads][hd] each) into their slots of the
     * current layer's blocks (token at position p goes to block p / bs, row p % bs). */
    kvb_status (*kv_write)(void *ctx, const kvb_attn_batch *b, const void *k, const void *v);
    /* Causal paged attention, GQA: out[n_tokens][n_heads][hd] from q [n_tokens][n_heads][hd] and the
     * K/V in the current layer's blocks (which already hold this step's rows); with b->window > 0 a
     * query sees only the last `window` keys up to its own position (sliding-window attention). */
    kvb_status (*attention)(void *ctx, const kvb_attn_batch *b, const void *q, void *out);
    /* out[i][:] = x[rows[i]][:] for i < n (rows: host array). */
    kvb_status (*gather_rows)(void *ctx, const void *x, const int32_t *rows, int n, int dim, void *out);

    /* Fused forms of the operators above, for the model's layers (common/model/forward.c). Optional
     * together: a backend with weight_load_stacked has the other three. */
    /* Creates `dst` [sum of rows[i]][cols] from n host matrices of the same cols stacked in order (each
     * from its own dtype; cols 1: vectors, the stacked biases). The model then loads q/k/v and gate/up
     * stacked and runs each as one product through the operators below; NULL: it keeps them apart. */
    kvb_status (*weight_load_stacked)(void *ctx, const void *const *src, const kvb_dtype *src_dtype, const int64_t *rows,
                                      int n, int64_t cols, kvb_tensor *dst);
    /* y[n][rows(w)] = RMSNorm(x; norm, eps) . w^T, x [n][cols(w)] unchanged: a layer's norm folded into the
     * product after it. */
    kvb_status (*matmul_norm)(void *ctx, const void *x, int n, const kvb_tensor *norm, float eps, const kvb_tensor *w,
                              void *y);
    /* y[n][rows(w)] = (silu(gu[:, 0:c]) * gu[:, c:2c]) . w^T + beta * y, c = cols(w): gu [n][2c] is the
     * stacked gate/up product, the SiLU-mul folded into the down product's input. */
    kvb_status (*matmul_swiglu)(void *ctx, const void *gu, int n, const kvb_tensor *w, float beta, void *y);
    /* What follows the stacked q/k/v product qkv [n_tokens][(n_heads + 2 n_kv_heads) hd] of batch b: adds
     * `bias` (the stacked q/k/v biases; NULL: none), applies RMSNorm with q_norm / k_norm to every q / k
     * head (NULL: none), rotates q and k at pos[n_tokens] (host array), writes q to q_out
     * [n_tokens][n_heads][hd] and K, V into the current layer's blocks as kv_write does. */
    kvb_status (*qkv_finish)(void *ctx, const kvb_attn_batch *b, const void *qkv, const kvb_tensor *bias,
                             const kvb_tensor *q_norm, const kvb_tensor *k_norm, float eps, const int32_t *pos,
                             const kvb_rope *rope, void *q_out);

    /* Optional (NULL: the engine copies the logit rows to the host and samples there). out[r] = the token
     * row r of `logits` ([rows][vocab] activations) gives under p[r], chosen on the device as
     * common/sched/sampling.c chooses it (greedy: the same token; sampled: the same token unless u falls
     * within vocab * 2^-44 of a boundary between two tokens' masses); `out` is a host array. Waits for
     * the device, so only the token ids cross to the host. */
    kvb_status (*sample)(void *ctx, const void *logits, int rows, int vocab, const kvb_sample_row *p, int32_t *out);

    /* Sets the number of CPU threads the backend may use (CPU backend: OpenBLAS and OpenMP). */
    void (*set_threads)(void *ctx, int n_threads);
    /* Releases the backend context. */
    void (*destroy)(void *ctx);
} kvb_backend_i;

/* A backend object: its table, its context, and the memory its operators work on. */
typedef struct kvb_backend {
    const kvb_backend_i *iface;
    void *ctx;
    kvb_mem *mem; /* the memory backend of the same kind and device (common/mem/mem.h), owned: every
                   * buffer, pool and region this backend computes on comes from it */
} kvb_backend;

/* Creates the backend named `name` ("cpu", "cpu:bf16"; "cuda[:variant]" when built with CUDA) on device `device`
 * (-1: the current one; device backends make it current on the calling thread), with its memory
 * backend (kvb_mem_create). Caller owns the result and releases it with kvb_backend_destroy
 * (NULL-safe). KVB_ERR_UNSUPPORTED for a backend not built in, or, logged as "no CUDA device: ...",
 * when the device is missing. kvb_backend_create is kvb_backend_create_on(name, -1, ...). */
kvb_status kvb_backend_create_on(const char *name, int device, int n_threads, kvb_backend **out);
kvb_status kvb_backend_create(const char *name, int n_threads, kvb_backend **out);
void kvb_backend_destroy(kvb_backend *be);
/* kvb_backend_act_dtype (a backend's activation dtype by its name): common/util/backend_name.h */
/* Comma-separated names of the backends compiled into this binary (static string). */
const char *kvb_backend_list(void);

/* The CPU backend (kernels/cpu): "cpu", or with kv_bf16 "cpu:bf16" (the same f32 arithmetic on a bf16
 * KV cache: kv_write rounds K and V to bf16, attention widens them as it reads them). */
kvb_status kvb__backend_cpu_create(int n_threads, int kv_bf16, kvb_backend *out);

/* How the CPU backend's waiting threads wait, by who else runs on the cores (kvb_cpu_threads_wait). */
typedef enum kvb_cpu_cores {
    KVB_CPU_CORES_OWN,    /* a program alone with its model (kvbank-generate, -serve, -bench): a waiting
                           * thread spins briefly (GOMP_SPINCOUNT=KVB_CPU_SPIN), then sleeps */
    KVB_CPU_CORES_SHARED, /* a node's model process (kvbank-master, -worker), several on the same cores by
                           * design: a waiting thread sleeps at once */
} kvb_cpu_cores;

/* The bounded spin of KVB_CPU_CORES_OWN, in libgomp's spin iterations (docs/perf.md, "Waiting threads sleep"). */
#define KVB_CPU_SPIN "3000"

/* Called first in the main of a program that may compute on the CPU backend, before it has any other
 * effect. The CPU backend's threads are an OpenMP team, and libgomp reads its wait policy once, when it
 * is loaded: by default a thread that waits at a join spins for up to ~3 ms. On cores shared with other
 * processes the spinning thread holds a core, the scheduler counts it as busy, and the thread it waits
 * for sits in the run queue, so each of a decode step's joins can cost a scheduler period (on 2 cores at
 * load 30 a 125M-model decode step took 5.6 s spinning, 0.14 s with sleeping waits); sleeping at once
 * costs a wake-up per join instead (tens to hundreds of us on a virtual machine). When OMP_WAIT_POLICY is
 * not set, this re-executes the program (/proc/self/exe, same argv) once with OMP_WAIT_POLICY=passive
 * and, for KVB_CPU_CORES_OWN, GOMP_SPINCOUNT=KVB_CPU_SPIN unless GOMP_SPINCOUNT is set; a policy set in
 * the environment is kept as it is. The re-executed program takes the variables it was given out of its
 * environment again (libgomp has read them), so the programs it starts choose for themselves: kvbankd
 * started by `kvbank-bench interference` gives its model processes no spin. Returns when it did not re-execute. */
void kvb_cpu_threads_wait(char **argv, kvb_cpu_cores cores);

#endif
