/* kvbank — the layer-stepped forward pass of Llama / Mistral / Qwen2 / Qwen3 over a flattened token
 * batch. Follows transformers' LlamaDecoderLayer (and its Mistral, Qwen2, Qwen3 twins):
 *   h = x + o_proj(attn(rope(q_norm(q_proj(norm1(x)))), rope(k_norm(k_proj(..))), v_proj(..)))
 *   x' = h + down(silu(gate(norm2(h))) * up(norm2(h)))
 * (q_norm/k_norm only for Qwen3; each projection adds its bias where the architecture has one;
 * attention is sliding-window on the layers kvb_model_config_window names). Every buffer below is backend memory of act_dtype elements, taken
 * for one step from the caller's allocator (common/mem/mem.h) at kvb_forward_begin and given back at
 * kvb_forward_end.
 *
 * A layer runs its rows in chunks of about fw->chunk rows (kvb_forward_chunk), one after the other:
 * norm, QKV, RoPE, KV write, attention, o_proj, FFN of a chunk, then the next. That is exact: a row's
 * attention needs the keys and values of the rows before it, which an earlier chunk of the same layer
 * has written, and everything else is per row. So only the residual stream x is sized by the step's
 * rows (hidden floats a row, an eighth of a 12-layer model's KV); the other activations (q, k, v, the
 * attention output, gate and up: 2 hidden + 2 kv + 2 intermediate floats a row) by the largest chunk.
 * An 8K-token prompt in one step held 250 MB of them on the 125M model, the KV it writes is 200 MB.
 * Chunks are cut (chunk_end) at rows that are multiples of KVB_CHUNK_ALIGN_ROWS, with at least
 * FW_PIECE_MIN rows on each side of a sequence cut inside, and hold at least FW_CHUNK_MIN rows unless
 * the step has fewer: so the backend takes the same path for every row (sgemm above 32 rows, the
 * attention's product path above 32 query rows of a head group) with the same grouping of rows
 * (kernels/backend.h), and its results are the same bits as in one piece (tests/test_model
 * forward_chunks_exact).
 *
 * On a backend with the fused operators (kvb_backend_i.weight_load_stacked: the CUDA backend in bf16 and
 * f16) the model is loaded with q/k/v and gate/up stacked (model.c), and a layer runs as: q/k/v as one
 * product with the attention norm folded in (matmul_norm), bias, q/k norm, RoPE and KV write in one
 * operator (qkv_finish), attention, o_proj, gate/up as one product with the FFN norm folded in, and down
 * with the SiLU-mul folded into its input (matmul_swiglu): 6 operators where the sequence above has 13. */
#include <math.h>
#include <string.h>

#include "common/model/model_impl.h"

/* Rows of the smallest chunk (more than the CPU backend's 32-row decode kernel takes), and of the
 * smallest piece of a sequence cut inside (a gemm-path sequence stays on it at any group size). */
#define FW_CHUNK_MIN 64
#define FW_PIECE_MIN 32

struct kvb_forward {
    kvb_model *m;
    kvb_backend *be;
    int max_tokens;
    kvb_mem_allocator alloc; /* where each step's buffers come from */
    kvb_mem_arena *arena;    /* the default allocator, owned (NULL when the caller supplied one) */
    /* The step in flight's buffers, from `alloc`, sized by its n_tokens (n) and n_logits (r); NULL
     * between steps. */
    void *x;    /* [n][hidden] residual stream */
    /* per chunk of a layer's rows, [cap] rows each */
    void *h;    /* [cap][hidden] normalised input of a sublayer */
    void *q;    /* [cap][n_heads][head_dim] */
    void *k;    /* [cap][n_kv_heads][head_dim] */
    void *v;    /* [cap][n_kv_heads][head_dim] */
    void *att;  /* [cap][n_heads][head_dim] attention output */
    void *gate; /* [cap][intermediate] */
    void *up;   /* [cap][intermediate] */
    /* a model loaded stacked (model_impl.h) has qkv in place of h, k, v, and gu in place of gate, up */
    void *qkv;  /* [cap][(n_heads + 2 n_kv_heads) head_dim] the stacked q/k/v product */
    void *gu;   /* [cap][2 intermediate] the stacked gate/up product */
    void *rows;     /* [r][hidden] rows that want logits */
    void *logits;   /* [r][vocab] */
    const kvb_batch *b; /* the step in flight (borrowed) */
    kvb_attn_batch attn;/* b->attn with the model's head count and scale */
    int next_layer;
    int n_rows;         /* rows the next layers compute: the batch's first n_rows (kvb_forward_rows) */
    int split;          /* 0 < split < n_rows: projections and MLP as two GEMMs, rows [0, split) and the rest */
    int chunk;          /* rows a layer runs at once (about; 0: all) */
    int cap;            /* rows the chunk buffers hold */
    kvb_attn_seq *cseqs;/* a chunk's sequences, [cseqs_cap] (host) */
    int cseqs_cap;
};

/* The step's buffers, in one array for giving them back; the chunk buffers first. */
#define FW_N_CHUNK_BUFS 9
#define FW_BUFS(fw) {&(fw)->h, &(fw)->q, &(fw)->k, &(fw)->v, &(fw)->att, &(fw)->gate, &(fw)->up, &(fw)->qkv, \
                     &(fw)->gu, &(fw)->x, &(fw)->rows, &(fw)->logits}

static kvb_status fw_alloc(kvb_forward *fw, size_t elems, void **out) {
    size_t es = kvb_dtype_size(fw->be->iface->act_dtype);
    return fw->alloc.iface->alloc(fw->alloc.ctx, elems * es, out);
}

/* Gives the first n of the step's buffers (FW_BUFS order) back to the allocator. */
static void fw_release_n(kvb_forward *fw, size_t n) {
    void **bufs[] = FW_BUFS(fw);
    for (size_t i = 0; i < n && i < KVB_ARRAY_LEN(bufs); i++) {
        if (*bufs[i]) fw->alloc.iface->free(fw->alloc.ctx, *bufs[i]);
        *bufs[i] = NULL;
    }
}

static void fw_release(kvb_forward *fw) {
    fw_release_n(fw, (size_t)-1);
    fw->cap = 0;
}

/* Chunk buffers of `rows` rows (the old ones back first; the backend runs kernels in order, so one
 * still reading them is done before the new ones are written). */
static kvb_status fw_chunk_bufs(kvb_forward *fw, int rows) {
    const kvb_model_config *c = &fw->m->cfg;
    fw_release_n(fw, FW_N_CHUNK_BUFS);
    fw->cap = 0;
    size_t n = (size_t)rows;
    const kvb_layer_weights *w = &fw->m->layers[0]; /* every layer is loaded alike */
    if (!w->wqkv.data || !w->w_gu.data) KVB_TRY(fw_alloc(fw, n * c->hidden, &fw->h));
    KVB_TRY(fw_alloc(fw, n * c->n_heads * c->head_dim, &fw->q));
    if (w->wqkv.data) {
        KVB_TRY(fw_alloc(fw, n * (size_t)(c->n_heads + 2 * c->n_kv_heads) * c->head_dim, &fw->qkv));
    } else {
        KVB_TRY(fw_alloc(fw, n * c->n_kv_heads * c->head_dim, &fw->k));
        KVB_TRY(fw_alloc(fw, n * c->n_kv_heads * c->head_dim, &fw->v));
    }
    KVB_TRY(fw_alloc(fw, n * c->n_heads * c->head_dim, &fw->att));
    if (w->w_gu.data) {
        KVB_TRY(fw_alloc(fw, n * 2 * (size_t)c->intermediate, &fw->gu));
    } else {
        KVB_TRY(fw_alloc(fw, n * c->intermediate, &fw->gate));
        KVB_TRY(fw_alloc(fw, n * c->intermediate, &fw->up));
    }
    fw->cap = rows;
    return KVB_OK;
}

/* Whether the layer's rows may be cut before row c: c a multiple of KVB_CHUNK_ALIGN_ROWS, and a
 * sequence cut there keeps FW_PIECE_MIN rows on each side. */
static int cut_ok(const kvb_forward *fw, int c) {
    if (c % KVB_CHUNK_ALIGN_ROWS) return 0;
    for (int s = 0; s < fw->attn.n_seqs; s++) {
        const kvb_attn_seq *sq = &fw->attn.seqs[s];
        if (c > sq->q_start && c < sq->q_start + sq->q_len &&
            (c - sq->q_start < FW_PIECE_MIN || sq->q_start + sq->q_len - c < FW_PIECE_MIN))
            return 0;
    }
    return 1;
}

/* The largest cut in [lo, hi] (`largest`), else the smallest; -1 when there is none. */
static int find_cut(const kvb_forward *fw, int lo, int hi, int largest) {
    int al = KVB_CHUNK_ALIGN_ROWS, first = KVB_DIV_CEIL(lo, al) * al, last = hi / al * al;
    for (int c = largest ? last : first; c >= first && c <= last; c += largest ? -al : al)
        if (cut_ok(fw, c)) return c;
    return -1;
}

/* End of the chunk of the layer's rows that starts at row c0. */
static int chunk_end(const kvb_forward *fw, int c0) {
    int n = fw->n_rows;
    if (fw->chunk <= 0 || n - c0 <= fw->chunk) return n;
    int lo = c0 + FW_CHUNK_MIN, hi = n - FW_CHUNK_MIN;
    int c = find_cut(fw, lo, KVB_MIN(hi, c0 + fw->chunk), 1);
    if (c < 0) c = find_cut(fw, c0 + fw->chunk + 1, hi, 0);
    return c < 0 ? n : c;
}

/* Rows of the largest chunk of the layer's rows. */
static int max_chunk(const kvb_forward *fw) {
    int cap = 0;
    for (int c0 = 0, c1; c0 < fw->n_rows; c0 = c1) {
        c1 = chunk_end(fw, c0);
        cap = KVB_MAX(cap, c1 - c0);
    }
    return cap;
}

/* The attention view of rows [c0, c1) of the layer: the sequences' rows there, each seeing the keys up
 * to its last row there (the layer's rows before c0 have written theirs). */
static kvb_status chunk_attn(kvb_forward *fw, int c0, int c1, kvb_attn_batch *out) {
    *out = fw->attn;
    out->n_tokens = c1 - c0;
    out->row0 = c0;
    if (c0 == 0 && c1 == fw->n_rows) return KVB_OK;
    if (fw->cseqs_cap < fw->attn.n_seqs) {
        KVB_TRY(kvb_realloc_array((void **)&fw->cseqs, (size_t)fw->attn.n_seqs, sizeof *fw->cseqs));
        fw->cseqs_cap = fw->attn.n_seqs;
    }
    int n = 0, bs = fw->attn.geom->block_size;
    for (int s = 0; s < fw->attn.n_seqs; s++) {
        const kvb_attn_seq *sq = &fw->attn.seqs[s];
        int qe = sq->q_start + sq->q_len, a = KVB_MAX(c0, sq->q_start), e = KVB_MIN(c1, qe);
        if (a >= e) continue;
        int ctx = sq->ctx_len - (qe - e);
        fw->cseqs[n++] = (kvb_attn_seq){.q_start = a - c0, .q_len = e - a, .ctx_len = ctx,
                                        .n_blocks = KVB_DIV_CEIL(ctx, bs), .blk_first = sq->blk_first};
    }
    out->n_seqs = n;
    out->seqs = fw->cseqs;
    return KVB_OK;
}

kvb_status kvb_forward_create_with(kvb_model *m, int max_tokens, const kvb_mem_allocator *alloc, kvb_forward **out) {
    if (max_tokens < 1 || !out) return KVB_ERR_INVALID;
    if (alloc && (!alloc->iface || !alloc->iface->alloc || !alloc->iface->free)) return KVB_ERR_INVALID;
    kvb_forward *fw = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *fw, (void **)&fw));
    fw->m = m;
    fw->be = m->be;
    fw->max_tokens = max_tokens;
    fw->chunk = kvb_forward_default_chunk(fw->be);
    if (alloc) {
        fw->alloc = *alloc;
    } else {
        kvb_status st = kvb_mem_arena_create(m->be->mem, &fw->arena);
        if (st != KVB_OK) {
            free(fw);
            return st;
        }
        fw->alloc = kvb_mem_arena_allocator(fw->arena);
    }
    *out = fw;
    return KVB_OK;
}

kvb_status kvb_forward_create(kvb_model *m, int max_tokens, kvb_forward **out) {
    return kvb_forward_create_with(m, max_tokens, NULL, out);
}

void kvb_forward_destroy(kvb_forward *fw) {
    if (!fw) return;
    if (fw->x) fw->be->iface->sync(fw->be->ctx); /* a step was abandoned: its kernels may still run */
    fw_release(fw);
    kvb_mem_arena_destroy(fw->arena);
    free(fw->cseqs);
    free(fw);
}

int kvb_forward_default_chunk(const kvb_backend *be) {
    return be->iface->chunk_rows > 0 ? be->iface->chunk_rows : KVB_FORWARD_CHUNK_ROWS;
}

kvb_status kvb_forward_chunk(kvb_forward *fw, int rows) {
    if (fw->b || rows < 0) return KVB_ERR_INVALID;
    fw->chunk = rows > 0 && rows < FW_CHUNK_MIN ? FW_CHUNK_MIN : rows;
    return KVB_OK;
}

kvb_status kvb_forward_begin(kvb_forward *fw, const kvb_batch *b) {
    const kvb_model_config *c = &fw->m->cfg;
    if (b->n_tokens < 1 || b->n_tokens > fw->max_tokens || b->n_logits < 0 || b->n_logits > b->n_tokens) {
        KVB_LOG_E("forward: batch of %d tokens / %d logit rows does not fit (max %d tokens)", b->n_tokens,
                  b->n_logits, fw->max_tokens);
        return KVB_ERR_INVALID;
    }
    for (int i = 0; i < b->n_tokens; i++) {
        if (b->tokens[i] < 0 || b->tokens[i] >= c->vocab || b->pos[i] < 0) {
            KVB_LOG_E("forward: token %d (id %d, position %d) out of range", i, b->tokens[i], b->pos[i]);
            return KVB_ERR_INVALID;
        }
    }
    const kvb_backend_i *be = fw->be->iface;
    if (fw->x) {
        /* the previous step was abandoned mid-way: its buffers go back once its kernels are done */
        KVB_TRY(be->sync(fw->be->ctx));
        fw_release(fw);
    }
    /* this step's buffers: the residual stream sized by its tokens, the rest by its largest chunk */
    size_t n = (size_t)b->n_tokens;
    kvb_status st;
    fw->attn = b->attn;
    fw->n_rows = b->n_tokens;
    KVB_TRY_GOTO(fw_alloc(fw, n * c->hidden, &fw->x), fail);
    KVB_TRY_GOTO(fw_chunk_bufs(fw, max_chunk(fw)), fail);
    if (b->n_logits > 0) {
        KVB_TRY_GOTO(fw_alloc(fw, (size_t)b->n_logits * c->hidden, &fw->rows), fail);
        KVB_TRY_GOTO(fw_alloc(fw, (size_t)b->n_logits * c->vocab, &fw->logits), fail);
    }
    fw->b = b;
    fw->attn.n_heads = c->n_heads;
    fw->attn.n_tokens = b->n_tokens;
    /* YaRN multiplies cos and sin by its attention factor a, so q.k by a^2: folded into the scale */
    fw->attn.scale = (float)(c->rope_attn_factor * c->rope_attn_factor / sqrt((double)c->head_dim));
    fw->next_layer = 0;
    fw->n_rows = b->n_tokens;
    fw->split = 0;
    KVB_TRY_GOTO(be->embed(fw->be->ctx, &fw->m->embed, b->tokens, b->n_tokens, fw->x), fail_step);
    return KVB_OK;
fail_step:
    fw->b = NULL;
    (void)be->sync(fw->be->ctx);
fail:
    fw_release(fw);
    return st;
}

/* y[i] = x . w[i]^T (+ beta * y[i]) for projections sharing their input, n rows of a chunk whose first
 * is the layer's row row0: in one call where the backend has matmul_n (beta 0), else one matmul each;
 * with a split (kvb_forward_split) inside the chunk once per row range. */
static kvb_status matmuls(kvb_forward *fw, int row0, const void *x, int n, const kvb_tensor *const *w, void *const *y,
                          int nw, float beta) {
    const kvb_backend_i *be = fw->be->iface;
    size_t es = kvb_dtype_size(be->act_dtype);
    int sp = fw->split - row0;
    int cut[3] = {0, sp > 0 && sp < n ? sp : n, n};
    for (int part = 0; part < 2; part++) {
        int r0 = cut[part], rn = cut[part + 1] - r0;
        if (rn <= 0) continue;
        const void *xp = (const char *)x + (size_t)r0 * (size_t)w[0]->ne[1] * es;
        void *yp[8];
        for (int i = 0; i < nw; i++) yp[i] = (char *)y[i] + (size_t)r0 * (size_t)w[i]->ne[0] * es;
        if (be->matmul_n && beta == 0.0f && nw > 1) {
            KVB_TRY(be->matmul_n(fw->be->ctx, xp, rn, w, nw, yp));
            continue;
        }
        for (int i = 0; i < nw; i++) KVB_TRY(be->matmul(fw->be->ctx, xp, rn, w[i], beta, yp[i]));
    }
    return KVB_OK;
}

static kvb_status matmul1(kvb_forward *fw, int r0, const void *x, int n, const kvb_tensor *w, float beta, void *y) {
    return matmuls(fw, r0, x, n, &w, &y, 1, beta);
}

/* The fused products of a model loaded stacked: y = RMSNorm(x; norm) . w^T (norm != NULL) or y =
 * SwiGLU(x) . w^T + beta y (x the stacked gate/up product), n rows of a chunk whose first is the layer's
 * row row0, once per row range of a split (kvb_forward_split) as matmuls does. */
static kvb_status fused_matmul(kvb_forward *fw, int row0, const void *x, int n, const kvb_tensor *norm,
                               const kvb_tensor *w, float beta, void *y) {
    const kvb_backend_i *be = fw->be->iface;
    size_t es = kvb_dtype_size(be->act_dtype), xw = norm ? (size_t)w->ne[1] : 2 * (size_t)w->ne[1];
    int sp = fw->split - row0;
    int cut[3] = {0, sp > 0 && sp < n ? sp : n, n};
    for (int part = 0; part < 2; part++) {
        int r0 = cut[part], rn = cut[part + 1] - r0;
        if (rn <= 0) continue;
        const void *xp = (const char *)x + (size_t)r0 * xw * es;
        void *yp = (char *)y + (size_t)r0 * (size_t)w->ne[0] * es;
        if (norm) KVB_TRY(be->matmul_norm(fw->be->ctx, xp, rn, norm, fw->m->cfg.rms_eps, w, yp));
        else KVB_TRY(be->matmul_swiglu(fw->be->ctx, xp, rn, w, beta, yp));
    }
    return KVB_OK;
}

kvb_status kvb_forward_rows(kvb_forward *fw, int n_rows, int n_seqs) {
    if (!fw->b || n_rows < 1 || n_rows > fw->n_rows || n_seqs < 1 || n_seqs > fw->attn.n_seqs) return KVB_ERR_INVALID;
    for (int i = 0; i < fw->b->n_logits; i++)
        if (fw->b->logit_rows[i] >= n_rows) return KVB_ERR_INVALID;
    for (int i = 0; i < n_seqs; i++)
        if (fw->attn.seqs[i].q_start + fw->attn.seqs[i].q_len > n_rows) return KVB_ERR_INVALID;
    fw->n_rows = n_rows;
    fw->attn.n_tokens = n_rows;
    fw->attn.n_seqs = n_seqs;
    return KVB_OK;
}

kvb_status kvb_forward_split(kvb_forward *fw, int rows) {
    if (!fw->b || rows < 0) return KVB_ERR_INVALID;
    fw->split = rows;
    return KVB_OK;
}

/* Rows [c0, c1) of the layer (fw->x's rows; the chunk buffers hold them from their row 0). */
static kvb_status layer_chunk(kvb_forward *fw, const kvb_layer_weights *w, int c0, int c1) {
    const kvb_model_config *c = &fw->m->cfg;
    const kvb_backend_i *be = fw->be->iface;
    void *ctx = fw->be->ctx;
    int n = c1 - c0;
    float eps = c->rms_eps;
    void *x = (char *)fw->x + (size_t)c0 * c->hidden * kvb_dtype_size(be->act_dtype);
    kvb_attn_batch attn;
    KVB_TRY(chunk_attn(fw, c0, c1, &attn));

    if (w->wqkv.data) { /* stacked: the norm folded into one q/k/v product, then bias, q/k norm, RoPE, KV write */
        KVB_TRY(fused_matmul(fw, c0, x, n, &w->attn_norm, &w->wqkv, 0.0f, fw->qkv));
        KVB_TRY(be->qkv_finish(ctx, &attn, fw->qkv, w->bqkv.data ? &w->bqkv : NULL, w->q_norm.data ? &w->q_norm : NULL,
                               w->k_norm.data ? &w->k_norm : NULL, eps, fw->b->pos + c0, &fw->m->rope, fw->q));
    } else {
        KVB_TRY(be->rmsnorm(ctx, x, n, c->hidden, &w->attn_norm, eps, fw->h));
        const kvb_tensor *qkv[] = {&w->wq, &w->wk, &w->wv};
        void *qkv_out[] = {fw->q, fw->k, fw->v};
        KVB_TRY(matmuls(fw, c0, fw->h, n, qkv, qkv_out, 3, 0.0f));
        if (w->bq.data) { /* Qwen2; Llama / Qwen3 with attention_bias */
            KVB_TRY(be->bias_add(ctx, fw->q, n, &w->bq));
            KVB_TRY(be->bias_add(ctx, fw->k, n, &w->bk));
            KVB_TRY(be->bias_add(ctx, fw->v, n, &w->bv));
        }
        if (w->q_norm.data) { /* Qwen3: RMSNorm over each head before RoPE */
            KVB_TRY(be->rmsnorm(ctx, fw->q, n * c->n_heads, c->head_dim, &w->q_norm, eps, fw->q));
            KVB_TRY(be->rmsnorm(ctx, fw->k, n * c->n_kv_heads, c->head_dim, &w->k_norm, eps, fw->k));
        }
        KVB_TRY(be->rope(ctx, fw->q, c->n_heads, fw->k, c->n_kv_heads, n, fw->b->pos + c0, &fw->m->rope));
        KVB_TRY(be->kv_write(ctx, &attn, fw->k, fw->v));
    }
    KVB_TRY(be->attention(ctx, &attn, fw->q, fw->att));
    KVB_TRY(matmul1(fw, c0, fw->att, n, &w->wo, 1.0f, x)); /* x += o_proj(att) */
    if (w->bo.data) KVB_TRY(be->bias_add(ctx, x, n, &w->bo));

    if (w->w_gu.data) { /* stacked: the norm folded into one gate/up product, the SiLU-mul into down's input */
        KVB_TRY(fused_matmul(fw, c0, x, n, &w->ffn_norm, &w->w_gu, 0.0f, fw->gu));
        KVB_TRY(fused_matmul(fw, c0, fw->gu, n, NULL, &w->w_down, 1.0f, x)); /* x += down(...) */
    } else {
        KVB_TRY(be->rmsnorm(ctx, x, n, c->hidden, &w->ffn_norm, eps, fw->h));
        const kvb_tensor *gate_up[] = {&w->w_gate, &w->w_up};
        void *gate_up_out[] = {fw->gate, fw->up};
        KVB_TRY(matmuls(fw, c0, fw->h, n, gate_up, gate_up_out, 2, 0.0f));
        if (w->b_gate.data) { /* Llama with mlp_bias */
            KVB_TRY(be->bias_add(ctx, fw->gate, n, &w->b_gate));
            KVB_TRY(be->bias_add(ctx, fw->up, n, &w->b_up));
        }
        KVB_TRY(be->silu_mul(ctx, fw->gate, fw->up, (size_t)n * c->intermediate, fw->gate));
        KVB_TRY(matmul1(fw, c0, fw->gate, n, &w->w_down, 1.0f, x)); /* x += down(...) */
    }
    if (w->b_down.data) KVB_TRY(be->bias_add(ctx, x, n, &w->b_down));
    return KVB_OK;
}

kvb_status kvb_forward_layer(kvb_forward *fw, int layer) {
    if (!fw->b || layer != fw->next_layer || layer >= fw->m->cfg.n_layers) return KVB_ERR_STATE;
    const kvb_model_config *c = &fw->m->cfg;

    /* layer_blocks may have been refilled for this layer since begin */
    fw->attn.layer_blocks = fw->b->attn.layer_blocks;
    fw->attn.window = kvb_model_config_window(c, layer);
    /* fewer rows than at begin (kvb_forward_rows) can end a chunk at a later cut: the buffers grow then */
    int cap = max_chunk(fw);
    if (cap > fw->cap) KVB_TRY(fw_chunk_bufs(fw, cap));
    for (int c0 = 0, c1; c0 < fw->n_rows; c0 = c1) {
        c1 = chunk_end(fw, c0);
        KVB_TRY(layer_chunk(fw, &fw->m->layers[layer], c0, c1));
    }
    fw->next_layer = layer + 1;
    return KVB_OK;
}

/* Final norm and LM head of rows[n] of the residual stream into the step's logit buffer (device). */
static kvb_status lm_head_rows(kvb_forward *fw, const int32_t *rows, int n) {
    const kvb_model_config *c = &fw->m->cfg;
    const kvb_backend_i *be = fw->be->iface;
    void *ctx = fw->be->ctx;
    kvb_status st = be->gather_rows(ctx, fw->x, rows, n, c->hidden, fw->rows);
    if (st == KVB_OK) st = be->rmsnorm(ctx, fw->rows, n, c->hidden, &fw->m->final_norm, c->rms_eps, fw->rows);
    if (st == KVB_OK) st = be->matmul(ctx, fw->rows, n, &fw->m->lm_head, 0.0f, fw->logits);
    return st;
}

/* lm_head_rows, then the logits [n][vocab] to the host. Waits for the device. */
static kvb_status lm_head(kvb_forward *fw, const int32_t *rows, int n, float *logits) {
    const kvb_backend_i *be = fw->be->iface;
    kvb_status st = lm_head_rows(fw, rows, n);
    /* waits for the device: every kernel of the step is done when it returns */
    if (st == KVB_OK) st = be->to_host_f32(fw->be->ctx, logits, fw->logits, (size_t)n * fw->m->cfg.vocab);
    if (st != KVB_OK) (void)be->sync(fw->be->ctx);
    return st;
}

kvb_status kvb_forward_logits(kvb_forward *fw, const int32_t *rows, int n, float *logits) {
    if (!fw->b || fw->next_layer != fw->m->cfg.n_layers || n < 1 || n > fw->b->n_logits) return KVB_ERR_INVALID;
    for (int i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= fw->n_rows) return KVB_ERR_INVALID;
    return lm_head(fw, rows, n, logits);
}

/* The final norm and LM head of the logit rows, then either their logits to the host (`logits`) or
 * the tokens the backend samples from them (`p`, `tokens`). */
static kvb_status forward_end(kvb_forward *fw, float *logits, const kvb_sample_row *p, int32_t *tokens) {
    const kvb_model_config *c = &fw->m->cfg;
    if (!fw->b || fw->next_layer != c->n_layers) return KVB_ERR_STATE;
    const kvb_batch *b = fw->b;
    fw->b = NULL;
    kvb_status st;
    if (b->n_logits == 0) {
        st = fw->be->iface->sync(fw->be->ctx);
    } else if (!tokens) {
        st = lm_head(fw, b->logit_rows, b->n_logits, logits);
    } else {
        /* waits for the device: every kernel of the step is done when the tokens are on the host */
        st = lm_head_rows(fw, b->logit_rows, b->n_logits);
        if (st == KVB_OK) st = fw->be->iface->sample(fw->be->ctx, fw->logits, b->n_logits, c->vocab, p, tokens);
        if (st != KVB_OK) (void)fw->be->iface->sync(fw->be->ctx);
    }
    /* The buffers go back; work already on the stream is done (sync above), and the next step's
     * kernels run after this one's on the same stream anyway. */
    fw_release(fw);
    return st;
}

kvb_status kvb_forward_end(kvb_forward *fw, float *logits) { return forward_end(fw, logits, NULL, NULL); }

kvb_status kvb_forward_end_sample(kvb_forward *fw, const kvb_sample_row *p, int32_t *tokens) {
    if (!fw->be->iface->sample || !p || !tokens) return KVB_ERR_UNSUPPORTED;
    return forward_end(fw, NULL, p, tokens);
}

const void *kvb_forward_hidden(const kvb_forward *fw) { return fw->x; }

kvb_status kvb_forward_kv_from_hidden(kvb_forward *fw, int layer, const void *x, const int32_t *pos,
                                      const kvb_attn_batch *a) {
    const kvb_model_config *c = &fw->m->cfg;
    int n = a->n_tokens;
    if (fw->b || layer < 0 || layer >= c->n_layers || n < 1 || n > fw->max_tokens) return KVB_ERR_INVALID;
    const kvb_layer_weights *w = &fw->m->layers[layer];
    const kvb_backend_i *be = fw->be->iface;
    void *ctx = fw->be->ctx;
    /* buffers of its own (a step's are given back when it ends) */
    void *h = NULL, *q = NULL, *k = NULL, *v = NULL;
    size_t nn = (size_t)n;
    kvb_status st;
    if (w->wqkv.data) { /* stacked: the layer's own path up to the KV write; q is computed and dropped */
        KVB_TRY_GOTO(fw_alloc(fw, nn * (size_t)(c->n_heads + 2 * c->n_kv_heads) * c->head_dim, &h), out);
        KVB_TRY_GOTO(fw_alloc(fw, nn * c->n_heads * c->head_dim, &q), out);
        KVB_TRY_GOTO(be->matmul_norm(ctx, x, n, &w->attn_norm, c->rms_eps, &w->wqkv, h), out);
        KVB_TRY_GOTO(be->qkv_finish(ctx, a, h, w->bqkv.data ? &w->bqkv : NULL, w->q_norm.data ? &w->q_norm : NULL,
                                    w->k_norm.data ? &w->k_norm : NULL, c->rms_eps, pos, &fw->m->rope, q),
                     out);
        st = be->sync(ctx);
        goto out;
    }
    KVB_TRY_GOTO(fw_alloc(fw, nn * c->hidden, &h), out);
    KVB_TRY_GOTO(fw_alloc(fw, nn * c->n_heads * c->head_dim, &q), out);
    KVB_TRY_GOTO(fw_alloc(fw, nn * c->n_kv_heads * c->head_dim, &k), out);
    KVB_TRY_GOTO(fw_alloc(fw, nn * c->n_kv_heads * c->head_dim, &v), out);
    /* the layer's first half up to the KV write: norm, K and V projections, Qwen3's k norm, RoPE */
    KVB_TRY_GOTO(be->rmsnorm(ctx, x, n, c->hidden, &w->attn_norm, c->rms_eps, h), out);
    KVB_TRY_GOTO(be->matmul(ctx, h, n, &w->wk, 0.0f, k), out);
    KVB_TRY_GOTO(be->matmul(ctx, h, n, &w->wv, 0.0f, v), out);
    if (w->k_norm.data) KVB_TRY_GOTO(be->rmsnorm(ctx, k, n * c->n_kv_heads, c->head_dim, &w->k_norm, c->rms_eps, k), out);
    /* rope rotates q and k together: q is projected too (defined values), then dropped */
    KVB_TRY_GOTO(be->matmul(ctx, h, n, &w->wq, 0.0f, q), out);
    KVB_TRY_GOTO(be->rope(ctx, q, c->n_heads, k, c->n_kv_heads, n, pos, &fw->m->rope), out);
    KVB_TRY_GOTO(be->kv_write(ctx, a, k, v), out);
    st = be->sync(ctx);
out:
    if (h || q || k || v) (void)be->sync(ctx);
    void *bufs[] = {h, q, k, v};
    for (size_t i = 0; i < KVB_ARRAY_LEN(bufs); i++)
        if (bufs[i]) fw->alloc.iface->free(fw->alloc.ctx, bufs[i]);
    return st;
}
