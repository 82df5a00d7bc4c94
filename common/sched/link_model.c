/* kvbank — the link model's arithmetic (link_model.h): presets, the target's roofline, the time scale. */
#include "common/sched/link_model.h"

#include <math.h>
#include <string.h>

/* Models of the papers' testbeds, from their config.json files. */
static const kvb_target_model m_llama3_8b = {"Llama-3-8B bf16", 32, 4096, 32, 8, 128, 14336, 128256, 2};
static const kvb_target_model m_llama2_13b = {"Llama-2-13B fp16", 40, 5120, 40, 40, 128, 13824, 32000, 2};
/* LWM-1M-Text: Llama-2-7B's shape (MHA), SwiftCache's Fig. 1 and Table 2 */
static const kvb_target_model m_lwm_7b = {"LWM-1M-Text (Llama-2-7B) fp16", 32, 4096, 32, 32, 128, 11008, 32000, 2};

/* The vendors' dense bf16 tensor rates and memory bandwidths. */
static const kvb_target_gpu g_h100 = {"H100 SXM", 989e12, 3.35e12};
static const kvb_target_gpu g_a100 = {"A100 80GB", 312e12, 2.04e12};
static const kvb_target_gpu g_a5000 = {"RTX A5000", 111e12, 768e9};
static const kvb_target_gpu g_h20 = {"H20 96GB", 148e12, 4.0e12};

/* A target machine: GPU, model and its three links (host, peer, local). Link rates are the vendors'
 * figures rounded to what a copy achieves (PCIe 5.0 x16 about 50 GB/s of its 64, NVLink 4 about 450
 * GB/s one way); latency is the cost of one transfer (a copy call or a gather kernel launch), about 10
 * us over PCIe or NVLink, 5 us on the device. */
typedef struct preset {
    const char *name;
    const char *target;
    const kvb_target_gpu *gpu;
    const kvb_target_model *model;
    double gbps[KVB_LINK_COUNT];
    double lat_us[KVB_LINK_COUNT];
} preset;

static const preset presets[] = {
    {"h100-pcie5", "H100 SXM; host tier over PCIe 5.0 x16; lenders on the same GPU (in place)", &g_h100, &m_llama3_8b,
     {50, 1500, 1500}, {10, 5, 5}},
    {"h100-nvlink", "H100 SXM; host tier over PCIe 5.0 x16; lenders on other GPUs over NVLink 4", &g_h100, &m_llama3_8b,
     {50, 450, 1500}, {10, 10, 5}},
    {"a100-pcie4", "A100 80GB; host and peers over PCIe 4.0 x16 (eLLM's testbeds)", &g_a100, &m_llama2_13b,
     {25, 25, 1300}, {10, 10, 5}},
    {"a100-pcie4-8b", "A100 80GB; host over PCIe 4.0 x16 (eLLM elastic's testbed)", &g_a100, &m_llama3_8b,
     {25, 25, 1300}, {10, 10, 5}},
    {"pcie3", "RTX A5000; host and peers over PCIe 3.0 x16 (OrbitFlow's testbed)", &g_a5000, &m_llama3_8b,
     {12, 12, 380}, {10, 10, 5}},
    {"h20-nvlink", "H20 96GB; host over PCIe 4.0 (32 GB/s shared); peers over NVLink 200 GB/s one way "
                   "(SwiftCache's testbed)", &g_h20, &m_lwm_7b, {32, 200, 2000}, {10, 10, 5}},
};

void kvb_link_preset_list(FILE *f) {
    fprintf(f, "%-18s %s\n", "off", "no link model: copies run at memory speed (default)");
    for (size_t i = 0; i < KVB_ARRAY_LEN(presets); i++) {
        const preset *p = &presets[i];
        fprintf(f, "%-18s %s serving %s: host %g GB/s, peer %g GB/s, local %g GB/s\n", p->name, p->target,
                p->model->name, p->gbps[0], p->gbps[1], p->gbps[2]);
    }
    fprintf(f, "%-18s the same target, its times scaled by this model's measured step / the target model's roofline\n"
               "%-18s step, its bandwidths by the KV bytes ratio too (one layer's transfer / compute as the target's)\n",
            "NAME-scaled", "");
}

kvb_status kvb_link_preset_find(const char *name, kvb_link_model *out) {
    memset(out, 0, sizeof *out);
    out->scale = 1;
    if (!name || !strcmp(name, "off")) {
        snprintf(out->name, sizeof out->name, "off");
        snprintf(out->target, sizeof out->target, "copies at memory speed");
        return KVB_OK;
    }
    size_t len = strlen(name);
    const char *suffix = "-scaled";
    int scaled = len > strlen(suffix) && !strcmp(name + len - strlen(suffix), suffix);
    size_t base = scaled ? len - strlen(suffix) : len;
    for (size_t i = 0; i < KVB_ARRAY_LEN(presets); i++) {
        const preset *p = &presets[i];
        if (strlen(p->name) != base || strncmp(p->name, name, base)) continue;
        snprintf(out->name, sizeof out->name, "%s", name);
        snprintf(out->target, sizeof out->target, "%s", p->target);
        snprintf(out->model, sizeof out->model, "%s", p->model->name);
        out->tm = *p->model;
        out->gpu = *p->gpu;
        out->target_flops = p->gpu->peak_flops;
        out->calibrate = scaled;
        for (int k = 0; k < KVB_LINK_COUNT; k++) {
            out->target_links[k] = (kvb_link){p->gbps[k] * 1e9, p->lat_us[k] * 1e-6};
            out->links[k] = out->target_links[k];
        }
        return KVB_OK;
    }
    char names[512];
    size_t at = (size_t)snprintf(names, sizeof names, "off");
    for (size_t i = 0; i < KVB_ARRAY_LEN(presets) && at < sizeof names; i++)
        at += (size_t)snprintf(names + at, sizeof names - at, ", %s", presets[i].name);
    KVB_LOG_E("unknown link preset \"%s\" (available: %s, each also as NAME-scaled)", name, names);
    return KVB_ERR_NOT_FOUND;
}

/* ---------------------------------------------------------------------------- the target's roofline */

double kvb_target_kv_bytes(const kvb_target_model *m) {
    return 2.0 * m->n_kv_heads * m->head_dim * m->elem_bytes; /* K and V */
}

/* Parameters a token passes through: every layer's projections and MLP (norms are negligible). */
static double layer_params(const kvb_target_model *m) {
    double q = (double)m->n_heads * m->head_dim, kv = (double)m->n_kv_heads * m->head_dim;
    return m->hidden * (q + 2 * kv) + q * m->hidden + 3.0 * m->hidden * m->intermediate;
}

double kvb_target_weight_bytes(const kvb_target_model *m) {
    /* the layers and the LM head; the embedding is a lookup, not read whole */
    return (m->n_layers * layer_params(m) + (double)m->hidden * m->vocab) * m->elem_bytes;
}

double kvb_target_step_flops(const kvb_target_model *m, int batch, double q, double ctx) {
    /* per new token: 2 FLOPs per parameter, and attention QK^T and PV over the cached tokens and the
     * earlier new ones (on average (q + 1) / 2 of them); one row of logits per request */
    double tok = (double)batch * q;
    double attn = 4.0 * m->n_heads * m->head_dim * (ctx + (q + 1) / 2) * m->n_layers;
    return tok * (2 * m->n_layers * layer_params(m) + attn) + batch * 2.0 * m->hidden * m->vocab;
}

double kvb_target_step_bytes(const kvb_target_model *m, int batch, double q, double ctx) {
    /* the weights once, every request's KV read (cached and new) and the new KV written */
    return kvb_target_weight_bytes(m) + batch * (ctx + 2 * q) * kvb_target_kv_bytes(m) * m->n_layers;
}

double kvb_target_step_s(const kvb_target_gpu *g, const kvb_target_model *m, int batch, double q, double ctx) {
    return fmax(kvb_target_step_flops(m, batch, q, ctx) / g->peak_flops,
                kvb_target_step_bytes(m, batch, q, ctx) / g->mem_bytes_per_s);
}

/* ------------------------------------------------------------------------------------ the time scale */

kvb_status kvb_link_scale(kvb_link_model *m, const kvb_link_point *p, double measured_step_s, int bench_layers,
                          double bench_kv_bytes) {
    if (!m->target_flops || !m->tm.n_layers || !p || p->batch < 1 || p->q < 1 || !(p->ctx > 0) ||
        !(measured_step_s > 0) || bench_layers < 1 || !(bench_kv_bytes > 0)) {
        KVB_LOG_E("link model: a time scale needs a target, a positive point (batch, q, ctx) and a measured step");
        return KVB_ERR_INVALID;
    }
    kvb_link_point pt = *p;
    if (!(pt.target_ctx > 0)) pt.target_ctx = pt.ctx;
    if (!(pt.target_q > 0)) pt.target_q = pt.q;
    m->point = pt;
    m->target_layers = m->tm.n_layers;
    m->bench_layers = bench_layers;
    m->target_step_s = kvb_target_step_s(&m->gpu, &m->tm, pt.batch, pt.target_q, pt.target_ctx);
    m->measured_step_s = measured_step_s;
    m->target_layer_bytes = pt.batch * pt.target_ctx * kvb_target_kv_bytes(&m->tm);
    m->bench_layer_bytes = pt.batch * pt.ctx * bench_kv_bytes;
    m->kv_ratio = m->bench_layer_bytes / m->target_layer_bytes;
    m->scale = (measured_step_s / bench_layers) / (m->target_step_s / m->target_layers);
    for (int k = 0; k < KVB_LINK_COUNT; k++) {
        const kvb_link *t = &m->target_links[k];
        m->links[k].latency_s = t->latency_s * m->scale;
        m->links[k].bytes_per_s = t->bytes_per_s * m->kv_ratio / m->scale;
    }
    m->calibrate = 0;
    return KVB_OK;
}

double kvb_link_regime(const kvb_link_model *m, kvb_link_kind link, int here) {
    if (!m || !m->target_flops || m->calibrate || !m->target_layers || link < 0 || link >= KVB_LINK_COUNT) return 0;
    if (here) {
        const kvb_link *l = &m->links[link];
        double x = l->latency_s + (l->bytes_per_s > 0 ? m->bench_layer_bytes / l->bytes_per_s : 0);
        return x / (m->measured_step_s / m->bench_layers);
    }
    const kvb_link *l = &m->target_links[link];
    double x = l->latency_s + (l->bytes_per_s > 0 ? m->target_layer_bytes / l->bytes_per_s : 0);
    return x / (m->target_step_s / m->target_layers);
}

int kvb_link_regime_far(double ratio, double paper) {
    if (!(paper > 0)) return 0;
    return !(ratio > 0) || ratio > 2 * paper || ratio < paper / 2;
}

void kvb_link_regime_print(FILE *f, const kvb_link_model *m, kvb_link_kind link, double paper, const char *paper_what) {
    if (!m->target_flops || !m->target_layers) return;
    double here = kvb_link_regime(m, link, 1), there = kvb_link_regime(m, link, 0);
    fprintf(f, "regime (one layer's KV of %d request%s over the %s link / one layer's compute of %d x %g new tokens over "
               "%g cached): %.2fx here, %.2fx on the target",
            m->point.batch, m->point.batch == 1 ? "" : "s", kvb_link_kind_str(link), m->point.batch, m->point.target_q,
            m->point.target_ctx, here, there);
    if (paper > 0)
        fprintf(f, "; the paper: %.2gx (%s)%s", paper, paper_what ? paper_what : "",
                kvb_link_regime_far(here, paper) ? " -- MORE THAN 2x AWAY FROM THE PAPER'S REGIME" : "");
    fprintf(f, "\n");
}

/* ----------------------------------------------------------------------------------------- printing */

/* "12.5 GB/s", "9.6 MB/s". */
static void fmt_rate(char *buf, size_t len, double bps) {
    if (bps >= 1e9) snprintf(buf, len, "%.3g GB/s", bps / 1e9);
    else if (bps >= 1e6) snprintf(buf, len, "%.3g MB/s", bps / 1e6);
    else snprintf(buf, len, "%.3g kB/s", bps / 1e3);
}

static void fmt_time(char *buf, size_t len, double s) {
    if (s >= 1) snprintf(buf, len, "%.3g s", s);
    else if (s >= 1e-3) snprintf(buf, len, "%.3g ms", s * 1e3);
    else snprintf(buf, len, "%.3g us", s * 1e6);
}

void kvb_link_model_print(FILE *f, const kvb_link_model *m) {
    if (!m->target_flops) {
        fprintf(f, "link preset: off (copies at memory speed)\n");
        return;
    }
    fprintf(f, "link preset: %s%s (%s", m->name, m->share ? ", transfers share each link equally" : "", m->target);
    if (m->model[0]) fprintf(f, ", serving %s", m->model);
    if (m->calibrate) fprintf(f, "; time scale not measured yet");
    else if (m->target_layers) {
        char a[32], b[32];
        fmt_time(a, sizeof a, m->measured_step_s / m->bench_layers);
        fmt_time(b, sizeof b, m->target_step_s / m->target_layers);
        fprintf(f, "; time x%.3g = this model's %s / the target's %s (roofline) per layer of a step of %d x %g new "
                   "tokens over %g cached (%g on the target); KV bytes x%.3g",
                m->scale, a, b, m->point.batch, (double)m->point.q, m->point.ctx, m->point.target_ctx, m->kv_ratio);
    }
    for (int k = 0; k < KVB_LINK_COUNT; k++) {
        char r[32], t[32];
        fmt_rate(r, sizeof r, m->links[k].bytes_per_s);
        fmt_time(t, sizeof t, m->links[k].latency_s);
        fprintf(f, "%s %s %s + %s", k ? "," : ";", kvb_link_kind_str((kvb_link_kind)k), r, t);
    }
    fprintf(f, ")\n");
}

double kvb_link_seconds(const kvb_link_model *m, kvb_link_kind link, size_t bytes) {
    if (!m || link < 0 || link >= KVB_LINK_COUNT) return 0;
    const kvb_link *l = &m->links[link];
    return l->latency_s + (l->bytes_per_s > 0 ? (double)bytes / l->bytes_per_s : 0);
}
