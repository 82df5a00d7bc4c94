/* kvbank-bench engine — the engine against this machine's ceilings, and optionally against llama.cpp,
 * measured in the same run.
 *
 * Every measurement (one prefill length or one decode point batch x context, for one engine) runs in a
 * fresh child process, so its peak RSS is that engine's alone: the child resets its peak-RSS mark
 * (/proc/self/clear_refs), loads the model, measures, reads VmHWM and reports through a pipe; the
 * ceilings are sampled in a child of their own just before and just after it. With --llama-cpp both engines
 * run each point in children of their own, their timed windows in turn (kvbank's window w, then
 * llama.cpp's window w, ...; run_pair), so a neighbour's load falls on both and the speedup is taken
 * window pair by window pair.
 *
 *   read bandwidth  B = bytes / time of a multi-threaded sum over 512 MiB (best of 3)
 *   sgemm rate      F = 2 n^3 / time of an n x n x n cblas_sgemm on the same threads (best of 2)
 * Each ratio uses the median of the ceiling samples taken around that measurement.
 *   decode roofline   = max((weight bytes + KV bytes read per step) / B, FLOPs per step / F)
 *   decode ratio      = roofline / measured step time
 *   prefill ratio     = model FLOPs of the prefill / time / F
 * with weight bytes the matrices and norms one step reads (layers, final norm, LM head), KV bytes
 * batch x visible tokens x 2 x layers x KV heads x head_dim x 4, FLOPs = 2 x rows x (layer and LM-head
 * parameters) + attention (2 products x 2 FLOPs x heads x head_dim x visible keys per row and layer).
 * Times are medians over --reps windows (decode: --decode-steps steps each; prefill: one prompt each),
 * printed with their min-max. The RSS limit is the issue's: (all weights + the KV the point holds) x
 * 1.15. */
#include <cblas.h>
#include <errno.h>
#include <getopt.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench/bench.h"
#include "bench/bench_llamacpp.h"
#include "common/model/config.h"
#include "common/model/model.h"
#include "common/policy/policy.h"
#include "common/sched/engine.h"
#include "common/util/progress.h"

void openblas_set_num_threads(int n);

#define MAX_WIN 16
#define MAX_POINTS 64
#define N_GREEDY 8
#define BENCH_MAX_BATCH 1024

static double measure_read_bw(size_t bytes, int threads) {
    uint64_t *a = NULL;
    if (kvb_aligned_alloc(bytes, (void **)&a) != KVB_OK) return 0;
    size_t n = bytes / sizeof *a;
    memset(a, 1, bytes);
    double best = 1e30;
    volatile uint64_t sink = 0;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = kvb_now_s();
        uint64_t total = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : total)
        for (int t = 0; t < threads; t++) {
            size_t i0 = n * (size_t)t / (size_t)threads, i1 = n * (size_t)(t + 1) / (size_t)threads;
            uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
            size_t i = i0;
            for (; i + 4 <= i1; i += 4) s0 += a[i], s1 += a[i + 1], s2 += a[i + 2], s3 += a[i + 3];
            for (; i < i1; i++) s0 += a[i];
            total += s0 + s1 + s2 + s3;
        }
        sink += total;
        double t = kvb_now_s() - t0;
        best = t < best ? t : best;
    }
    free(a);
    return (double)bytes / best;
}

static double measure_sgemm(int n, int threads) {
    float *a = NULL, *b = NULL, *c = NULL;
    size_t sz = (size_t)n * n * sizeof(float);
    if (kvb_aligned_alloc(sz, (void **)&a) || kvb_aligned_alloc(sz, (void **)&b) || kvb_aligned_alloc(sz, (void **)&c)) {
        free(a);
        free(b);
        return 0;
    }
    for (size_t i = 0; i < (size_t)n * n; i++) {
        a[i] = (float)(i % 7) * 0.1f;
        b[i] = (float)(i % 5) * 0.1f;
    }
    openblas_set_num_threads(threads); /* the library's own threads for the reference sgemm */
    double best = 1e30;
    for (int rep = 0; rep < 2; rep++) {
        double t0 = kvb_now_s();
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n);
        double t = kvb_now_s() - t0;
        best = t < best ? t : best;
    }
    openblas_set_num_threads(1); /* back to the backend's setting: one pool, OpenMP */
    free(a);
    free(b);
    free(c);
    return 2.0 * n * (double)n * n / best;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median of v[0..n) (sorts a copy). */
static double median_of(const double *v, int n) {
    double *s = n > 0 ? malloc((size_t)n * sizeof *s) : NULL;
    if (!s) return 0;
    memcpy(s, v, (size_t)n * sizeof *s);
    qsort(s, (size_t)n, sizeof *s, cmp_double);
    double m = n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
    free(s);
    return m;
}

static double min_of(const double *v, int n) {
    double m = v[0];
    for (int i = 1; i < n; i++) m = v[i] < m ? v[i] : m;
    return m;
}

static double max_of(const double *v, int n) {
    double m = v[0];
    for (int i = 1; i < n; i++) m = v[i] > m ? v[i] : m;
    return m;
}

/* Peak RSS bookkeeping (Linux): writing 5 to clear_refs resets VmHWM to the current RSS. */
static void reset_peak_rss(void) {
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (f) {
        fputs("5", f);
        fclose(f);
    }
}

/* A field of /proc/self/status in kB ("VmHWM:", "VmRSS:"); -1 when absent. */
static long status_kb(const char *key) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kb = -1;
    size_t kl = strlen(key);
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, key, kl)) kb = strtol(line + kl, NULL, 10);
    if (f) fclose(f);
    return kb;
}

/* ------------------------------------------------------------------------------- one measurement */

typedef enum { ENGINE_KVBANK = 0, ENGINE_LLAMACPP = 1 } engine_kind;
typedef enum { JOB_PREFILL = 0, JOB_DECODE = 1, JOB_GREEDY = 2 } job_kind;

typedef struct job {
    engine_kind engine;
    job_kind kind;
    int batch, ctx; /* decode: batch x context; prefill: ctx = prompt tokens */
} job;

/* What a child reports. */
typedef struct job_result {
    int ok;
    int n_win;
    double win[MAX_WIN]; /* decode: seconds per step of each window; prefill: seconds per prompt */
    double bw[2], fl[2]; /* ceilings sampled before and after */
    int n_mid;           /* ceilings sampled between the windows (kvbank's windows: n_win - 1) */
    double mid_bw[MAX_WIN], mid_fl[MAX_WIN];
    long peak_kb;        /* VmHWM of the measurement (model load included) */
    long base_kb;        /* VmRSS when it started: the bench's code and libraries, before the model */
    int64_t w_step;      /* weight bytes one step reads (kvbank only) */
    int64_t w_all;       /* all weight bytes (kvbank only) */
    int64_t layer_params, lm_params;
    int32_t greedy[N_GREEDY];
} job_result;

typedef struct bench_cfg {
    const char *model_dir, *llama_dir;
    const char *backend; /* "cpu" or "cpu:bf16" (a bf16 KV cache, as llama.cpp's f16 one is half of f32) */
    int threads, steps, reps, block_size;
} bench_cfg;

typedef struct bench_counter {
    int64_t tokens;
    int n_started;
    int per_req[BENCH_MAX_BATCH];
    int32_t first[N_GREEDY]; /* tokens of request 0 */
} bench_counter;

static void count_token(void *ud, uint64_t id, int index, int32_t tok, uint64_t t_ns) {
    bench_counter *c = ud;
    c->tokens++;
    if (id == 0 && index >= 0 && index < N_GREEDY) c->first[index] = tok;
    if (id < BENCH_MAX_BATCH && c->per_req[id]++ == 0) c->n_started++;
}

static int32_t prompt_token(int i, int r, int vocab) { return (int32_t)((i * 31 + r * 17 + 1) % vocab); }

/* The measurement child's end of its pipes to the parent (-1 elsewhere): between two timed windows it
 * asks the parent to sample the ceilings in another child and waits until that is done, so that each
 * window has a sample just before and just after it (see run_job). Paired with the other engine
 * (g_paired, run_pair), it asks before every window, the first too, and the parent runs the two
 * engines' windows in turn. */
static int g_between_ask = -1, g_between_done = -1, g_paired = 0;

static void between_windows(void) {
    if (g_between_ask < 0) return;
    char b = 'w';
    while (write(g_between_ask, &b, 1) < 0 && errno == EINTR) {
    }
    while (read(g_between_done, &b, 1) < 0 && errno == EINTR) {
    }
}

/* Before timed window w: the barrier of the windows (w > 0 always, the first too when paired). */
static void before_window(int w) {
    if (w > 0 || g_paired) between_windows();
}

/* The engine's batch-token budget at a decode point, and the tokens each request decodes there: prompts
 * are prefilled over several steps, so the first requests start decoding earlier: every request gets
 * enough tokens to still be decoding at the end of the timed windows. */
static int decode_batch_tokens(int batch) { return KVB_MAX(512, batch); }
static int decode_tokens(const bench_cfg *cfg, int batch, int ctx) {
    return (cfg->reps + 1) * cfg->steps + KVB_DIV_CEIL(batch * ctx, decode_batch_tokens(batch)) + 2;
}

/* kvbank: `batch` requests with prompts of `ctx` tokens until all decode, then n_win windows of
 * `steps` decode steps. */
static int kvbank_decode(kvb_model *m, const bench_cfg *cfg, int batch, int ctx, job_result *r) {
    const kvb_model_config *c = kvb_model_cfg(m);
    kvb_engine_opts o;
    kvb_engine_opts_default(&o);
    o.block_size = cfg->block_size;
    o.max_seqs = batch;
    o.max_batch_tokens = decode_batch_tokens(batch);
    int max_tokens = decode_tokens(cfg, batch, ctx);
    o.n_blocks = batch * KVB_DIV_CEIL(ctx + max_tokens, cfg->block_size);
    o.enable_prefix_cache = 0;
    bench_counter *cnt = calloc(1, sizeof *cnt);
    int32_t *prompt = malloc((size_t)ctx * sizeof(int32_t));
    kvb_engine_events ev = {.ud = cnt, .on_token = count_token};
    kvb_planner pl = kvb_policy_recompute();
    kvb_engine *e = NULL;
    int ok = cnt && prompt && kvb_engine_create(m, &o, &pl, &ev, &e) == KVB_OK;
    for (int q = 0; q < batch && ok; q++) {
        for (int i = 0; i < ctx; i++) prompt[i] = prompt_token(i, q, c->vocab);
        kvb_request req = {.id = (uint64_t)q, .prompt = prompt, .n_prompt = ctx, .max_tokens = max_tokens};
        ok = kvb_engine_add(e, &req) == KVB_OK;
    }
    while (ok && cnt->n_started < batch) ok = kvb_engine_step(e) == KVB_OK;
    int64_t before = ok ? cnt->tokens : 0;
    for (int w = 0; w < cfg->reps && ok; w++) {
        before_window(w);
        double t0 = kvb_now_s();
        for (int s = 0; s < cfg->steps && ok; s++) ok = kvb_engine_step(e) == KVB_OK;
        r->win[w] = (kvb_now_s() - t0) / cfg->steps;
    }
    ok = ok && cnt->tokens - before == (int64_t)batch * cfg->steps * cfg->reps; /* every step decoded everyone */
    r->n_win = cfg->reps;
    kvb_engine_destroy(e);
    free(prompt);
    free(cnt);
    return ok;
}

static int kvbank_prefill(kvb_model *m, const bench_cfg *cfg, int tokens, job_result *r) {
    const kvb_model_config *c = kvb_model_cfg(m);
    kvb_engine_opts o;
    kvb_engine_opts_default(&o);
    o.block_size = cfg->block_size;
    o.max_batch_tokens = tokens;
    o.n_blocks = KVB_DIV_CEIL(tokens + 1, cfg->block_size);
    o.enable_prefix_cache = 0;
    bench_counter *cnt = calloc(1, sizeof *cnt);
    int32_t *prompt = malloc((size_t)tokens * sizeof(int32_t));
    kvb_engine_events ev = {.ud = cnt, .on_token = count_token};
    kvb_engine *e = NULL;
    kvb_planner pl = kvb_policy_recompute();
    int ok = cnt && prompt && kvb_engine_create(m, &o, &pl, &ev, &e) == KVB_OK;
    for (int rep = 0; rep < cfg->reps && ok; rep++) {
        before_window(rep);
        for (int i = 0; i < tokens; i++) prompt[i] = prompt_token(i, rep + 1000, c->vocab);
        kvb_request req = {.id = (uint64_t)rep + 1, .prompt = prompt, .n_prompt = tokens, .max_tokens = 1};
        ok = kvb_engine_add(e, &req) == KVB_OK;
        double t0 = kvb_now_s();
        ok = ok && kvb_engine_step(e) == KVB_OK && cnt->tokens == rep + 1;
        r->win[rep] = kvb_now_s() - t0;
    }
    r->n_win = cfg->reps;
    kvb_engine_destroy(e);
    free(prompt);
    free(cnt);
    return ok;
}

static int kvbank_greedy(kvb_model *m, int n_prompt, job_result *r) {
    const kvb_model_config *c = kvb_model_cfg(m);
    kvb_engine_opts o;
    kvb_engine_opts_default(&o);
    bench_counter *cnt = calloc(1, sizeof *cnt);
    int32_t prompt[256];
    kvb_engine_events ev = {.ud = cnt, .on_token = count_token};
    kvb_engine *e = NULL;
    kvb_planner pl = kvb_policy_recompute();
    int ok = cnt && kvb_engine_create(m, &o, &pl, &ev, &e) == KVB_OK;
    for (int i = 0; i < n_prompt; i++) prompt[i] = prompt_token(i, 0, c->vocab);
    kvb_request req = {.id = 0, .prompt = prompt, .n_prompt = n_prompt, .max_tokens = N_GREEDY};
    ok = ok && kvb_engine_add(e, &req) == KVB_OK;
    while (ok && cnt->tokens < N_GREEDY) ok = kvb_engine_step(e) == KVB_OK;
    if (ok) memcpy(r->greedy, cnt->first, sizeof r->greedy);
    kvb_engine_destroy(e);
    free(cnt);
    return ok;
}

static int run_kvbank(const bench_cfg *cfg, const job *jb, job_result *r) {
    kvb_backend *be = NULL;
    kvb_model *m = NULL;
    int ok = kvb_backend_create(cfg->backend, cfg->threads, &be) == KVB_OK && kvb_model_load(cfg->model_dir, be, &m) == KVB_OK;
    if (ok) {
        const kvb_model_config *c = kvb_model_cfg(m);
        r->w_step = kvb_model_weight_bytes_per_token(m);
        r->lm_params = (int64_t)c->vocab * c->hidden;
        r->layer_params = kvb_model_n_params(m) - r->lm_params * (c->tie_embeddings ? 1 : 2) - c->hidden;
        r->w_all = kvb_model_weight_bytes(m); /* as the backend holds them: bf16 in place stays bf16 */
        if (jb->kind == JOB_DECODE) ok = kvbank_decode(m, cfg, jb->batch, jb->ctx, r);
        else if (jb->kind == JOB_PREFILL) ok = kvbank_prefill(m, cfg, jb->ctx, r);
        else ok = kvbank_greedy(m, jb->ctx, r);
    }
    kvb_model_destroy(m);
    kvb_backend_destroy(be);
    return ok;
}

static int run_llamacpp(const bench_cfg *cfg, const job *jb, job_result *r) {
    kvb_model_config c;
    if (kvb_model_config_load(cfg->model_dir, &c) != KVB_OK) return 0;
    kvb_llamacpp *l = NULL;
    if (kvb_llamacpp_open(cfg->llama_dir, cfg->model_dir, cfg->threads, &l) != KVB_OK) return 0;
    int n_seq = jb->kind == JOB_DECODE ? jb->batch : 1;
    int32_t **prompts = calloc((size_t)n_seq, sizeof *prompts);
    int ok = prompts != NULL;
    for (int s = 0; s < n_seq && ok; s++) {
        ok = (prompts[s] = malloc((size_t)jb->ctx * sizeof(int32_t))) != NULL;
        for (int i = 0; ok && i < jb->ctx; i++) prompts[s][i] = prompt_token(i, jb->kind == JOB_PREFILL ? 1000 : s, c.vocab);
    }
    if (ok && jb->kind == JOB_DECODE) {
        ok = kvb_llamacpp_decode(l, jb->batch, (const int32_t *const *)prompts, jb->ctx, cfg->steps, r->win, cfg->reps,
                                 before_window) == 0;
        r->n_win = cfg->reps;
    } else if (ok && jb->kind == JOB_PREFILL) {
        for (int rep = 0; rep < cfg->reps && ok; rep++) {
            before_window(rep);
            ok = (r->win[rep] = kvb_llamacpp_prefill(l, prompts[0], jb->ctx)) > 0;
        }
        r->n_win = cfg->reps;
    } else if (ok) {
        ok = kvb_llamacpp_greedy(l, prompts[0], jb->ctx, N_GREEDY, r->greedy) == 0;
    }
    for (int s = 0; prompts && s < n_seq; s++) free(prompts[s]);
    free(prompts);
    kvb_llamacpp_close(l);
    return ok;
}

typedef void (*child_fn)(const bench_cfg *cfg, const job *jb, job_result *r);

/* The ceilings, into bw[0] / fl[0]. */
static void sample_ceilings(const bench_cfg *cfg, const job *jb, job_result *r) {
    r->bw[0] = measure_read_bw((size_t)512 << 20, cfg->threads);
    r->fl[0] = measure_sgemm(1024, cfg->threads);
    r->ok = r->bw[0] > 0 && r->fl[0] > 0;
}

/* The measurement, with its peak RSS from a reset mark (after fork: the bench's own pages only). */
static void measure(const bench_cfg *cfg, const job *jb, job_result *r) {
    reset_peak_rss();
    r->base_kb = status_kb("VmRSS:");
    r->ok = jb->engine == ENGINE_KVBANK ? run_kvbank(cfg, jb, r) : run_llamacpp(cfg, jb, r);
    r->peak_kb = status_kb("VmHWM:");
}

/* A child running one job, and the parent's ends of its pipes (-1: none). */
typedef struct proc {
    pid_t pid;
    int res;        /* the job_result comes back here */
    int ask, done;  /* the child's requests at window boundaries, and the parent's answers */
} proc;

/* Forks a child that runs fn and writes its job_result to p->res; with `windows`, the child asks at its
 * window boundaries (between_windows; before every window when `paired`). Returns 1 when it started. */
static int spawn(child_fn fn, const bench_cfg *cfg, const job *jb, int windows, int paired, proc *p) {
    int fd[2], ask[2] = {-1, -1}, done[2] = {-1, -1};
    *p = (proc){-1, -1, -1, -1};
    if (pipe(fd) != 0) return 0;
    if (windows && (pipe(ask) != 0 || pipe(done) != 0)) {
        int all[] = {fd[0], fd[1], ask[0], ask[1], done[0], done[1]};
        for (size_t i = 0; i < KVB_ARRAY_LEN(all); i++)
            if (all[i] >= 0) close(all[i]);
        return 0;
    }
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        close(fd[0]);
        if (windows) {
            close(ask[0]);
            close(done[1]);
            g_between_ask = ask[1], g_between_done = done[0], g_paired = paired;
        }
        kvb_log_set_level(KVB_LOG_WARN); /* the table is the output */
        job_result cr = {0};
        fn(cfg, jb, &cr);
        ssize_t n = write(fd[1], &cr, sizeof cr);
        _exit(n == (ssize_t)sizeof cr ? 0 : 1);
    }
    close(fd[1]);
    if (windows) close(ask[1]), close(done[0]);
    if (pid < 0) {
        close(fd[0]);
        if (windows) close(ask[0]), close(done[1]);
        return 0;
    }
    *p = (proc){pid, fd[0], windows ? ask[0] : -1, windows ? done[1] : -1};
    return 1;
}

/* Waits for p's next request at a window boundary; 0 when it has none (it finished or died). */
static int next_request(proc *p) {
    char b;
    ssize_t n;
    while (p->ask >= 0 && (n = read(p->ask, &b, 1)) != 0) {
        if (n > 0) return 1;
        if (errno != EINTR) break;
    }
    return 0;
}

static void answer(proc *p) {
    char b = 'd';
    while (p->done >= 0 && write(p->done, &b, 1) < 0 && errno == EINTR) {
    }
}

/* The child's job_result, once it exits; returns 1 when it reported success. */
static int collect(proc *p, job_result *r) {
    memset(r, 0, sizeof *r);
    if (p->ask >= 0) close(p->ask);
    if (p->done >= 0) close(p->done);
    size_t got = 0;
    while (got < sizeof *r) {
        ssize_t n = read(p->res, (char *)r + got, sizeof *r - got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        got += (size_t)n;
    }
    close(p->res);
    int status = 0;
    while (waitpid(p->pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (got != sizeof *r) memset(r, 0, sizeof *r);
    return r->ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

/* The ceilings sampled in a child of their own into (*bw, *fl); 0 when that failed. */
static int sample_into(const bench_cfg *cfg, const job *jb, double *bw, double *fl) {
    proc p;
    job_result c;
    if (!spawn(sample_ceilings, cfg, jb, 0, 0, &p) || !collect(&p, &c)) return 0;
    *bw = c.bw[0], *fl = c.fl[0];
    return 1;
}

/* Runs fn in a fresh child process, its result coming back through a pipe; returns 1 when the child
 * reported success. With `between` (a measurement), the child may ask between its windows for the
 * ceilings to be sampled: each time, they are, in a child of their own while it waits, into between's
 * mid_bw / mid_fl. */
static int in_child(child_fn fn, const bench_cfg *cfg, const job *jb, job_result *r, job_result *between) {
    proc p;
    if (!spawn(fn, cfg, jb, between != NULL, 0, &p)) {
        memset(r, 0, sizeof *r);
        return 0;
    }
    if (between) {
        between->n_mid = 0;
        /* until the child closes its end (it exits): a request per window boundary */
        while (next_request(&p)) {
            if (between->n_mid < MAX_WIN &&
                sample_into(cfg, jb, &between->mid_bw[between->n_mid], &between->mid_fl[between->n_mid]))
                between->n_mid++;
            answer(&p);
        }
    }
    return collect(&p, r);
}

/* One job: the ceilings in a child of their own just before and just after the measurement's child,
 * and between its windows (so that neither the 512 MiB read buffer nor OpenBLAS's threaded buffers
 * count in the measurement's peak RSS, and each window has a sample on either side of it). Returns 1
 * when the samples before and after and the measurement reported. */
static int run_job(const bench_cfg *cfg, const job *jb, job_result *r) {
    job_result before, after, mid = {0};
    int ok = in_child(sample_ceilings, cfg, jb, &before, NULL);
    ok = in_child(measure, cfg, jb, r, &mid) && ok;
    ok = in_child(sample_ceilings, cfg, jb, &after, NULL) && ok;
    r->bw[0] = before.bw[0], r->fl[0] = before.fl[0];
    r->bw[1] = after.bw[0], r->fl[1] = after.fl[0];
    r->n_mid = mid.n_mid;
    memcpy(r->mid_bw, mid.mid_bw, sizeof r->mid_bw);
    memcpy(r->mid_fl, mid.mid_fl, sizeof r->mid_fl);
    return ok;
}

/* One point on both engines, their windows in turn: a child for each (both set up before either is timed:
 * model load, prompts), then kvbank's window w, llama.cpp's window w, and so on, the ceilings sampled
 * before each pair and after the last. A neighbour's load then falls on both engines' windows alike, where
 * running one engine's windows and then the other's put minutes between them (on this shared machine
 * a point's speedup moved by 3x that way). Each engine's job_result gets the ceilings around its windows
 * as run_job gives them. Returns 1 when both reported. */
static int run_pair(const bench_cfg *cfg, const job *jb, job_result *kv, job_result *lc) {
    job lj = *jb;
    lj.engine = ENGINE_LLAMACPP;
    proc a, b;
    int ok_a = spawn(measure, cfg, jb, 1, 1, &a);
    int ok_b = ok_a && spawn(measure, cfg, &lj, 1, 1, &b);
    if (!ok_b) {
        if (ok_a) collect(&a, kv);
        return 0;
    }
    double bw[MAX_WIN + 1], fl[MAX_WIN + 1];
    int live_a = next_request(&a), live_b = next_request(&b), n = 0, sampled = 1;
    for (int w = 0; w < cfg->reps && live_a && live_b; w++) {
        sampled = sample_into(cfg, jb, &bw[n], &fl[n]) && sampled;
        n++;
        answer(&a);
        live_a = next_request(&a) || w == cfg->reps - 1;
        answer(&b);
        live_b = next_request(&b) || w == cfg->reps - 1;
    }
    sampled = sample_into(cfg, jb, &bw[n], &fl[n]) && sampled;
    n++;
    int ok = collect(&a, kv) & collect(&b, lc);
    job_result *both[] = {kv, lc};
    for (int e = 0; e < 2 && n >= 2; e++) {
        job_result *r = both[e];
        r->bw[0] = bw[0], r->fl[0] = fl[0];
        r->bw[1] = bw[n - 1], r->fl[1] = fl[n - 1];
        r->n_mid = n - 2;
        for (int k = 0; k < n - 2; k++) r->mid_bw[k] = bw[k + 1], r->mid_fl[k] = fl[k + 1];
    }
    return ok && sampled;
}

/* ------------------------------------------------------------------------------------ the report */

static void usage(FILE *f) {
    fprintf(f, "usage: kvbank-bench engine --model DIR [--threads N] [--prefill LIST] [--contexts LIST]\n"
               "                           [--batches LIST] [--max-tokens N] [--decode-steps N] [--reps N]\n"
               "                           [--block-size N] [--backend cpu|cpu:bf16] [--llama-cpp LIBDIR]\n"
               "\n"
               "  --threads N        CPU threads for the engines and the ceilings (default 2)\n"
               "  --prefill LIST     prompt lengths of the prefill measurements (default 512,8192)\n"
               "  --contexts LIST    prompt lengths before the timed decode steps (default 128,2048,8192)\n"
               "  --batches LIST     decode batch sizes (default 1,8,32)\n"
               "  --max-tokens N     skip decode points whose batch x context exceeds N (their prefill\n"
               "                     alone would take minutes here; default 16384)\n"
               "  --decode-steps N   decode steps per timed window (default 16)\n"
               "  --reps N           timed windows (decode) or prompts (prefill) per point (default 5)\n"
               "  --block-size N     KV block size in tokens (default 16)\n"
               "  --backend NAME     kvbank's backend: cpu (f32 KV cache, the default) or cpu:bf16 (a bf16\n"
               "                     KV cache: half the bytes a decode step reads from its context)\n"
               "  --llama-cpp DIR    also run llama.cpp's prebuilt CPU library from DIR (libllama and\n"
               "                     libggml*, e.g. the npm package @node-llama-cpp/linux-x64's\n"
               "                     bins/linux-x64) on the same weights, point by point\n");
}

static int parse_list(const char *arg, int32_t **out, int *n) {
    free(*out);
    *out = NULL;
    return kvb_parse_id_list(arg, out, n) == KVB_OK && *n > 0 && *n <= MAX_POINTS;
}

typedef struct point_stats {
    double med, lo, hi;   /* seconds */
    double bw, fl;        /* median ceilings around the point */
} point_stats;

/* The ceilings around window w, into *bw / *fl: the mean of the samples just before and just after it
 * (the point's first sample, those between its windows, its last). Without a sample between every two
 * windows (llama.cpp's measurements), every window gets the mean of the point's first and last. */
static void window_ceilings(const job_result *r, int w, double *bw, double *fl) {
    if (r->n_mid != r->n_win - 1) {
        *bw = 0.5 * (r->bw[0] + r->bw[1]);
        *fl = 0.5 * (r->fl[0] + r->fl[1]);
        return;
    }
    int last = w == r->n_win - 1;
    *bw = 0.5 * ((w == 0 ? r->bw[0] : r->mid_bw[w - 1]) + (last ? r->bw[1] : r->mid_bw[w]));
    *fl = 0.5 * ((w == 0 ? r->fl[0] : r->mid_fl[w - 1]) + (last ? r->fl[1] : r->mid_fl[w]));
}

static point_stats stats_of(const job_result *r) {
    point_stats s = {median_of(r->win, r->n_win), min_of(r->win, r->n_win), max_of(r->win, r->n_win), 0, 0};
    s.bw = 0.5 * (r->bw[0] + r->bw[1]);
    s.fl = 0.5 * (r->fl[0] + r->fl[1]);
    return s;
}

/* Every ceiling sample of the run (for the summary line). */
typedef struct ceiling_log {
    double bw[(MAX_WIN + 1) * 2 * MAX_POINTS * MAX_POINTS], fl[(MAX_WIN + 1) * 2 * MAX_POINTS * MAX_POINTS];
    int n;
} ceiling_log;

/* Runs `jb` on kvbank, and with `lc` on llama.cpp too, their windows in turn (run_pair); logs the ceiling
 * samples. Prints "failed" and returns 0 when it failed. */
static int kvbank_point(const bench_cfg *cfg, const job *jb, const char *label, job_result *r, job_result *lc,
                        ceiling_log *ce) {
    if (!(lc ? run_pair(cfg, jb, r, lc) : run_job(cfg, jb, r))) {
        printf("%-20s failed%s\n", label, lc && !lc->ok ? " (llama.cpp)" : "");
        return 0;
    }
    for (int i = 0; i < 2 && ce->n < (int)KVB_ARRAY_LEN(ce->bw); i++, ce->n++) ce->bw[ce->n] = r->bw[i], ce->fl[ce->n] = r->fl[i];
    for (int i = 0; i < r->n_mid && ce->n < (int)KVB_ARRAY_LEN(ce->bw); i++, ce->n++)
        ce->bw[ce->n] = r->mid_bw[i], ce->fl[ce->n] = r->mid_fl[i];
    return 1;
}

/* Prints llama.cpp's columns for a point run_pair measured: time per window, tokens per second (`tokens`
 * per window), kvbank's speedup window by window (llama.cpp's window w over kvbank's window w, the two
 * run one after the other: median (min-max)), for a decode point the speedup's bound (llama.cpp's window
 * w over kvbank's roofline for its window w, `roof`; median: the speedup of an engine that read kvbank's
 * bytes at the read bandwidth sampled around the window), peak RSS. */
static void llamacpp_column(const job_result *r, const job_result *kv, double tokens, const double *roof) {
    point_stats s = stats_of(r);
    double sp[MAX_WIN], bound[MAX_WIN];
    int n = KVB_MIN(r->n_win, kv->n_win);
    for (int w = 0; w < n; w++) {
        sp[w] = r->win[w] / kv->win[w];
        if (roof) bound[w] = r->win[w] / roof[w];
    }
    printf(" %8.2fms (%.2f-%.2f) %6.1f tok/s %5.2fx (%.2f-%.2f)", s.med * 1e3, s.lo * 1e3, s.hi * 1e3, tokens / s.med,
           median_of(sp, n), min_of(sp, n), max_of(sp, n));
    if (roof) printf(" %5.2fx", median_of(bound, n));
    else printf(" %6s", "");
    printf(" %6.0f MB", r->peak_kb / 1e3);
}

/* The last position a decode point's requests reach when it is past the model's max_position_embeddings
 * (the engine would refuse them), else 0. */
static int past_positions(const bench_cfg *cfg, const kvb_model_config *c, int batch, int ctx) {
    int last = ctx + decode_tokens(cfg, batch, ctx);
    return c->max_pos > 0 && last > c->max_pos ? last : 0;
}

int kvb_bench_engine(int argc, char **argv) {
    bench_cfg cfg = {.backend = "cpu", .threads = 2, .steps = 16, .reps = 5, .block_size = 16};
    int max_tokens = 16384;
    int32_t *prefill = NULL, *contexts = NULL, *batches = NULL;
    int n_prefill = 0, n_ctx = 0, n_batch = 0;
    static const struct option opts[] = {
        {"model", 1, 0, 'm'},    {"threads", 1, 0, 't'},      {"prefill", 1, 0, 'p'},      {"contexts", 1, 0, 'c'},
        {"batches", 1, 0, 'b'},  {"max-tokens", 1, 0, 'x'},   {"decode-steps", 1, 0, 's'}, {"reps", 1, 0, 'r'},
        {"block-size", 1, 0, 'k'}, {"llama-cpp", 1, 0, 'l'},  {"backend", 1, 0, 'B'},      {"help", 0, 0, 'h'},
        {0, 0, 0, 0}};
    int ch, rc = 2;
    int64_t v;
    while ((ch = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        int *dst = ch == 't' ? &cfg.threads : ch == 's' ? &cfg.steps : ch == 'r' ? &cfg.reps
                 : ch == 'k' ? &cfg.block_size : ch == 'x' ? &max_tokens : NULL;
        if (dst) {
            if (kvb_parse_i64(optarg, 1, 1 << 24, &v) != KVB_OK || (ch == 'r' && v > MAX_WIN)) {
                if (ch == 'r') fprintf(stderr, "kvbank-bench engine: --reps '%s': a number from 1 to %d\n", optarg, MAX_WIN);
                else fprintf(stderr, "kvbank-bench engine: bad number '%s'\n", optarg);
                goto out;
            }
            *dst = (int)v;
        } else if (ch == 'm') {
            cfg.model_dir = optarg;
        } else if (ch == 'l') {
            cfg.llama_dir = optarg;
        } else if (ch == 'B') {
            if (strcmp(optarg, "cpu") != 0 && strcmp(optarg, "cpu:bf16") != 0) {
                fprintf(stderr, "kvbank-bench engine: --backend is cpu or cpu:bf16, not '%s'\n", optarg);
                goto out;
            }
            cfg.backend = optarg;
        } else if (ch == 'p' || ch == 'c' || ch == 'b') {
            int32_t **l = ch == 'p' ? &prefill : ch == 'c' ? &contexts : &batches;
            int *n = ch == 'p' ? &n_prefill : ch == 'c' ? &n_ctx : &n_batch;
            if (!parse_list(optarg, l, n)) {
                fprintf(stderr, "kvbank-bench engine: --%s needs a list like 1,8,32\n",
                        ch == 'p' ? "prefill" : ch == 'c' ? "contexts" : "batches");
                goto out;
            }
        } else {
            usage(ch == 'h' ? stdout : stderr);
            rc = ch == 'h' ? 0 : 2;
            goto out;
        }
    }
    if (!cfg.model_dir) {
        usage(stderr);
        goto out;
    }
    if ((!prefill && !parse_list("512,8192", &prefill, &n_prefill)) ||
        (!contexts && !parse_list("128,2048,8192", &contexts, &n_ctx)) ||
        (!batches && !parse_list("1,8,32", &batches, &n_batch))) {
        rc = 1;
        goto out;
    }
    kvb_model_config c;
    if (kvb_model_config_load(cfg.model_dir, &c) != KVB_OK) {
        rc = 1;
        goto out;
    }
    int cmp = cfg.llama_dir != NULL;
    int kv_elem = 4;
    (void)kvb_model_kv_elem_size(cfg.backend, &kv_elem);
    printf("kvbank-bench engine: %s, %d layers, hidden %d, %d heads / %d KV heads of %d, intermediate %d, vocab %d, "
           "%d threads, backend %s (%s KV cache)%s\n",
           cfg.model_dir, c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.intermediate, c.vocab,
           cfg.threads, cfg.backend, kv_elem == 2 ? "bf16" : "f32",
           cmp ? ", against llama.cpp (prebuilt CPU library, its default f16 KV cache)" : "");
    printf("each point in a fresh process; times: median (min-max) over %d windows of %d decode steps or %d prompts\n\n",
           cfg.reps, cfg.steps, cfg.reps);

    double kv_per_tok = 2.0 * c.n_layers * c.n_kv_heads * c.head_dim * kv_elem;
    static ceiling_log ce;
    job_result r, rl;
    int failures = 0;

    /* greedy agreement */
    if (cmp) {
        job g = {.engine = ENGINE_KVBANK, .kind = JOB_GREEDY, .ctx = 32};
        job gl = g;
        gl.engine = ENGINE_LLAMACPP;
        int a = in_child(measure, &cfg, &g, &r, NULL), b = in_child(measure, &cfg, &gl, &rl, NULL);
        if (a && b) {
            int same = 0;
            while (same < N_GREEDY && r.greedy[same] == rl.greedy[same]) same++;
            printf("greedy check, %d tokens after a 32-token prompt: the first %d agree (kvbank %d %d %d ..., llama.cpp "
                   "%d %d %d ...)\n\n",
                   N_GREEDY, same, r.greedy[0], r.greedy[1], r.greedy[2], rl.greedy[0], rl.greedy[1], rl.greedy[2]);
        } else { /* every point would fail the same way (an unsupported model, no loadable library) */
            printf("greedy check failed (kvbank %s, llama.cpp %s): nothing measured\n", a ? "ok" : "failed",
                   b ? "ok" : "failed");
            rc = 1;
            goto out;
        }
    }

    printf("%-20s %22s %10s %9s %7s %27s", "point", "kvbank", "rate", "ceiling", "ratio", "peak RSS / limit (base)");
    if (cmp) printf(" %22s %10s %18s %6s %9s", "llama.cpp", "rate", "speedup", "bound", "peak RSS");
    printf("\n");
    fflush(stdout);
    /* one progress line over every point on a terminal (common/util/progress.h), taken off while a row prints */
    int n_points = n_prefill;
    for (int bi = 0; bi < n_batch; bi++)
        for (int ci = 0; ci < n_ctx; ci++)
            n_points += (int64_t)batches[bi] * contexts[ci] <= max_tokens && batches[bi] <= BENCH_MAX_BATCH &&
                        past_positions(&cfg, &c, batches[bi], contexts[ci]) == 0;
    kvb_progress pg;
    int n_done = 0;
    kvb_progress_begin(&pg, "measuring points", (uint64_t)n_points, KVB_PROGRESS_COUNT);
    for (int i = 0; i < n_prefill; i++) {
        job jb = {.engine = ENGINE_KVBANK, .kind = JOB_PREFILL, .ctx = prefill[i]};
        char label[48];
        snprintf(label, sizeof label, "prefill %d", prefill[i]);
        kvb_progress_update(&pg, (uint64_t)n_done); /* drawn while the point runs */
        int got = kvbank_point(&cfg, &jb, label, &r, cmp ? &rl : NULL, &ce);
        kvb_progress_clear(&pg);
        n_done++;
        if (!got) {
            failures++;
            continue;
        }
        point_stats s = stats_of(&r);
        double T = prefill[i];
        double flops = 2.0 * T * (double)r.layer_params + 2.0 * (double)r.lm_params +
                       4.0 * c.n_layers * c.n_heads * (double)c.head_dim * T * (T + 1) / 2;
        double limit_mb = ((double)r.w_all + T * kv_per_tok) * 1.15 / 1e6;
        double ratio[MAX_WIN], rate[MAX_WIN];
        for (int w = 0; w < r.n_win; w++) {
            double bw, fl;
            window_ceilings(&r, w, &bw, &fl);
            rate[w] = fl;
            ratio[w] = flops / r.win[w] / fl;
        }
        printf("%-20s %8.1fms (%.1f-%.1f) %6.1f GF/s %5.1f GF/s %5.2f (%.2f-%.2f) %6.0f / %5.0f MB (base %3.0f)", label, s.med * 1e3,
               s.lo * 1e3, s.hi * 1e3, flops / s.med / 1e9, median_of(rate, r.n_win) / 1e9, median_of(ratio, r.n_win),
               min_of(ratio, r.n_win), max_of(ratio, r.n_win), r.peak_kb / 1e3, limit_mb, r.base_kb / 1e3);
        if (cmp) llamacpp_column(&rl, &r, T, NULL);
        printf("\n");
    }
    for (int bi = 0; bi < n_batch; bi++) {
        for (int ci = 0; ci < n_ctx; ci++) {
            int b = batches[bi], ctx = contexts[ci];
            char label[48];
            snprintf(label, sizeof label, "decode %dx%d", b, ctx);
            if ((int64_t)b * ctx > max_tokens || b > BENCH_MAX_BATCH) {
                printf("%-20s skipped (batch x context above --max-tokens %d)\n", label, max_tokens);
                continue;
            }
            int last = past_positions(&cfg, &c, b, ctx);
            if (last) {
                printf("%-20s skipped (context + the %d tokens each request decodes reach position %d, past the "
                       "model's max_position_embeddings %d)\n", label, decode_tokens(&cfg, b, ctx), last, c.max_pos);
                continue;
            }
            job jb = {.engine = ENGINE_KVBANK, .kind = JOB_DECODE, .batch = b, .ctx = ctx};
            kvb_progress_update(&pg, (uint64_t)n_done);
            int got = kvbank_point(&cfg, &jb, label, &r, cmp ? &rl : NULL, &ce);
            kvb_progress_clear(&pg);
            n_done++;
            if (!got) {
                failures++;
                continue;
            }
            point_stats s = stats_of(&r);
            /* visible tokens per sequence, averaged over the timed windows (conservative: the
             * first requests of a batch started decoding a few steps earlier) */
            double vis = ctx + 0.5 * cfg.reps * cfg.steps;
            double bytes = (double)r.w_step + b * vis * kv_per_tok;
            double flops = 2.0 * b * (double)(r.layer_params + r.lm_params) + 4.0 * c.n_layers * c.n_heads * c.head_dim * b * vis;
            double limit_mb = ((double)r.w_all + b * (vis + 0.5 * cfg.reps * cfg.steps) * kv_per_tok) * 1.15 / 1e6;
            double roof[MAX_WIN], ratio[MAX_WIN];
            for (int w = 0; w < r.n_win; w++) {
                double bw, fl;
                window_ceilings(&r, w, &bw, &fl);
                roof[w] = KVB_MAX(bytes / bw, flops / fl);
                ratio[w] = roof[w] / r.win[w];
            }
            printf("%-20s %8.2fms (%.2f-%.2f) %6.1f tok/s %5.2fms %5.2f (%.2f-%.2f) %6.0f / %5.0f MB (base %3.0f)", label, s.med * 1e3,
                   s.lo * 1e3, s.hi * 1e3, b / s.med, median_of(roof, r.n_win) * 1e3, median_of(ratio, r.n_win),
                   min_of(ratio, r.n_win), max_of(ratio, r.n_win), r.peak_kb / 1e3, limit_mb, r.base_kb / 1e3);
            if (cmp) llamacpp_column(&rl, &r, b, roof);
            printf("   [%s-bound]\n", bytes / s.bw >= flops / s.fl ? "memory" : "compute");
        }
    }
    kvb_progress_end(&pg);
    if (ce.n > 0)
        printf("\nceilings around the points (%d samples): read bandwidth %.2f GB/s (range %.2f-%.2f), sgemm %.1f GFLOP/s "
               "(range %.1f-%.1f)\n",
               ce.n, median_of(ce.bw, ce.n) / 1e9, min_of(ce.bw, ce.n) / 1e9, max_of(ce.bw, ce.n) / 1e9,
               median_of(ce.fl, ce.n) / 1e9, min_of(ce.fl, ce.n) / 1e9, max_of(ce.fl, ce.n) / 1e9);
    printf("ratio: prefill = model FLOPs / time / sgemm rate; decode = roofline / time, roofline = max((weights + KV "
           "read) / read bandwidth, FLOPs / sgemm rate); ratios window by window, each against the ceilings sampled just "
           "before and just after it (before the point, between its windows, after it), median (min-max); ceiling: "
           "the median window's; speedup = llama.cpp time / kvbank time of the windows run one after the other "
           "(kvbank's window w, llama.cpp's window w, ...), median (min-max); bound (decode) = llama.cpp time / kvbank's "
           "roofline, window by window, median: the speedup an engine reading kvbank's bytes at the read bandwidth would "
           "have; peak RSS: the measurement's own (reset when it starts), base: what it held then (the bench's "
           "code and libraries), limit: (all weights + the point's KV) x 1.15\n");
    rc = failures ? 1 : 0;
out:
    free(prefill);
    free(contexts);
    free(batches);
    return rc;
}
