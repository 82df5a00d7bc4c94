/* kvbank-bench lend — lend and reclaim latency against the size of the worker's pool (SwiftCache §3.4).
 *
 * In one process, with real shared memory: a worker engine over a region of N blocks lends a loan of
 * U blocks from its tail (kvb_engine_shrink) and a master engine attaches that memory
 * (kvb_engine_attach); reclaim is the master's fenced detach (kvb_engine_detach) and the worker's grow.
 * The block-major layout makes both independent of N. Beside it, the same resize of a layer-major
 * cache of the same bytes (SwiftCache Fig. 5: every layer but the first shifts) is timed as a memmove.
 * Coordinator messaging is not included (it is one round trip per loan, also independent of N). */
#include <getopt.h>
#include <stdio.h>
#include <string.h>

#include "bench/bench.h"
#include "bench/plot.h"
#include "common/kv/block_pool.h"
#include "common/mem/mem.h"
#include "common/model/model.h"
#include "common/policy/policy.h"
#include "common/sched/engine.h"
#include "common/util/progress.h"

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double med(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return v[n / 2];
}

static void usage(FILE *f) {
    fprintf(f, "usage: kvbank-bench lend --model DIR [--sizes 1024,65536,1048576] [--loan U] [--reps R]\n"
               "                         [--layers-major L] [--plot FILE.svg]\n"
               "\n"
               "  --model DIR       a model directory; use a tiny one (e.g. kvbank-mkmodel --layers 1 --hidden 8\n"
               "                    --heads 1 --kv-heads 1 --head-dim 8) so that 1M blocks fit in memory\n"
               "  --sizes LIST      worker pool sizes in blocks (default 1024,65536,1048576)\n"
               "  --loan U          blocks per loan (default 16)\n"
               "  --reps R          repetitions, median reported (default 200)\n"
               "  --layer-major L   layers of the layer-major comparison (default 32)\n"
               "  --plot FILE.svg   draw lend, reclaim and the layer-major resize against the pool size\n"
               "                    (log-log; gnuplot)\n");
}

int kvb_bench_lend(int argc, char **argv) {
    const char *model_dir = NULL, *plot_path = NULL;
    int32_t *sizes = NULL;
    int n_sizes = 0, loan = 16, reps = 200, lm_layers = 32;
    static const struct option opts[] = {{"model", 1, 0, 'm'},       {"sizes", 1, 0, 's'},
                                         {"loan", 1, 0, 'u'},        {"reps", 1, 0, 'r'},
                                         {"layer-major", 1, 0, 'L'}, {"help", 0, 0, 'h'},
                                         {"plot", 1, 0, 'P'},
                                         {0, 0, 0, 0}};
    int ch;
    int64_t v;
    while ((ch = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        if (ch == 'm') model_dir = optarg;
        else if (ch == 'P') plot_path = optarg;
        else if (ch == 's') {
            free(sizes);
            if (kvb_parse_id_list(optarg, &sizes, &n_sizes) != KVB_OK) {
                fprintf(stderr, "kvbank-bench lend: --sizes needs a list of block counts\n");
                return 2;
            }
        } else if (ch == 'u' || ch == 'r' || ch == 'L') {
            if (kvb_parse_i64(optarg, 1, 1 << 24, &v) != KVB_OK) {
                fprintf(stderr, "kvbank-bench lend: bad number '%s'\n", optarg);
                free(sizes);
                return 2;
            }
            *(ch == 'u' ? &loan : ch == 'r' ? &reps : &lm_layers) = (int)v;
        } else {
            usage(ch == 'h' ? stdout : stderr);
            free(sizes);
            return ch == 'h' ? 0 : 2;
        }
    }
    if (!model_dir) {
        usage(stderr);
        free(sizes);
        return 2;
    }
    if (!sizes) {
        static const int32_t def[] = {1024, 65536, 1048576};
        if (kvb_malloc(sizeof def, (void **)&sizes) != KVB_OK) return 1;
        memcpy(sizes, def, sizeof def);
        n_sizes = 3;
    }
    int rc = 1;
    kvb_backend *be = NULL;
    kvb_model *m = NULL;
    double *t_lend = NULL, *t_reclaim = NULL, *t_lm = NULL;
    double *px = NULL, *py[3] = {NULL, NULL, NULL}; /* --plot: pool size; lend, reclaim, layer-major us */
    int n_pts = 0;
    if (kvb_backend_create("cpu", 1, &be) != KVB_OK || kvb_model_load(model_dir, be, &m) != KVB_OK) goto out;
    if (kvb_calloc((size_t)reps, sizeof(double), (void **)&t_lend) || kvb_calloc((size_t)reps, sizeof(double), (void **)&t_reclaim) ||
        kvb_calloc((size_t)reps, sizeof(double), (void **)&t_lm) ||
        kvb_calloc((size_t)n_sizes, sizeof(double), (void **)&px) ||
        kvb_calloc((size_t)n_sizes, sizeof(double), (void **)&py[0]) ||
        kvb_calloc((size_t)n_sizes, sizeof(double), (void **)&py[1]) ||
        kvb_calloc((size_t)n_sizes, sizeof(double), (void **)&py[2]))
        goto out;
    kvb_kv_geom g = kvb_model_kv_geom(m, 1);
    size_t bb = kvb_kv_block_bytes(&g);
    printf("kvbank-bench lend: block %zu bytes, loan %d blocks, %d repetitions (medians)\n\n", bb, loan, reps);
    printf("%10s %12s %12s %14s | %16s\n", "pool", "lend us", "reclaim us", "lend+reclaim", "layer-major us");
    double base_lr = 0, base_lm = 0;
    for (int si = 0; si < n_sizes; si++) {
        int n = sizes[si];
        if (n <= loan) continue;
        kvb_mem_region *wr = NULL;
        kvb_engine *w = NULL, *ms = NULL;
        kvb_progress pg;
        int pg_open = 0;
        char *lm = NULL;
        kvb_engine_opts o;
        kvb_engine_opts_default(&o);
        o.block_size = 1;
        o.max_seqs = 4;
        o.max_batch_tokens = 64;
        if (kvb_mem_region_create(be->mem, "bench-lend", bb * (size_t)n, &wr) != KVB_OK) goto size_fail;
        o.n_blocks = n;
        o.kv_mem = kvb_mem_region_base(wr);
        o.kv_mem_bytes = kvb_mem_region_size(wr);
        kvb_planner wpl = kvb_policy_recompute(), mpl = kvb_policy_recompute();
        if (kvb_engine_create(m, &o, &wpl, NULL, &w) != KVB_OK) goto size_fail;
        kvb_engine_opts mo = o;
        mo.kv_mem = NULL;
        mo.kv_mem_bytes = 0;
        mo.n_blocks = 64;
        if (kvb_engine_create(m, &mo, &mpl, NULL, &ms) != KVB_OK) goto size_fail;
        size_t lm_bytes = bb * (size_t)n;
        /* a progress line per pool size on a terminal (common/util/progress.h): both loops' repetitions */
        char what[64];
        snprintf(what, sizeof what, "pool of %d blocks", n);
        kvb_progress_begin(&pg, what, 2 * (uint64_t)reps, KVB_PROGRESS_COUNT);
        pg_open = 1;
        for (int r = 0; r < reps; r++) {
            int own = kvb_engine_n_own(w);
            double t0 = kvb_now_s();
            if (kvb_engine_shrink(w, own - loan) != KVB_OK ||
                kvb_engine_attach(ms, (uint64_t)r + 1, (char *)kvb_mem_region_base(wr) + (size_t)(own - loan) * bb,
                                  (size_t)loan * bb, loan) != KVB_OK)
                goto size_fail;
            double t1 = kvb_now_s();
            kvb_detach_stats ds;
            if (kvb_engine_detach(ms, (uint64_t)r + 1, 0, &ds) != KVB_OK || kvb_engine_grow(w, own) != KVB_OK)
                goto size_fail;
            double t2 = kvb_now_s();
            t_lend[r] = (t1 - t0) * 1e6;
            t_reclaim[r] = (t2 - t1) * 1e6;
            kvb_progress_update(&pg, (uint64_t)r + 1);
        }
        /* timed in a loop of its own, afterwards: its buffer and memmoves would evict the pool's
         * metadata from the caches */
        if (kvb_malloc(lm_bytes, (void **)&lm) != KVB_OK) goto size_fail;
        memset(lm, 1, lm_bytes);
        for (int r = 0; r < reps; r++) {
            /* layer-major: the cache is [L][n][slice]; giving away the last `loan` blocks of every layer
             * shifts layers 1..L-1 down (Fig. 5), and taking them back shifts them up again */
            size_t per_layer = lm_bytes / (size_t)lm_layers, slice = per_layer / (size_t)n, cut = slice * (size_t)loan;
            double t3 = kvb_now_s();
            for (int l = 1; l < lm_layers; l++)
                memmove(lm + l * (per_layer - cut), lm + l * per_layer, per_layer - cut);
            for (int l = lm_layers - 1; l >= 1; l--)
                memmove(lm + l * per_layer, lm + l * (per_layer - cut), per_layer - cut);
            t_lm[r] = (kvb_now_s() - t3) * 1e6;
            kvb_progress_update(&pg, (uint64_t)(reps + r + 1));
        }
        kvb_progress_end(&pg);
        pg_open = 0;
        {
            double a = med(t_lend, reps), b = med(t_reclaim, reps), c = med(t_lm, reps);
            if (base_lr == 0) {
                base_lr = a + b;
                base_lm = c;
            }
            printf("%10d %12.2f %12.2f %8.2f (%4.2fx) | %10.1f (%6.1fx)\n", n, a, b, a + b, (a + b) / base_lr, c,
                   c / base_lm);
            px[n_pts] = n;
            py[0][n_pts] = a;
            py[1][n_pts] = b;
            py[2][n_pts] = c;
            n_pts++;
        }
    size_fail:
        if (pg_open) kvb_progress_cancel(&pg);
        free(lm);
        kvb_engine_destroy(ms);
        kvb_engine_destroy(w);
        kvb_mem_region_destroy(wr);
    }
    printf("\nratios are against the smallest pool: block-major lend+reclaim stays flat (O(1) in the pool size);\n"
           "a layer-major resize moves (L-1)/L of the cache, linear in it.\n");
    rc = 0;
    if (plot_path) {
        char t[160];
        snprintf(t, sizeof t, "lend and reclaim latency against the worker's pool size (loan %d blocks, median of %d)", loan,
                 reps);
        const kvb_plot_series ser[3] = {
            {.name = "lend (block-major)", .x = px, .y = py[0], .n = (size_t)n_pts},
            {.name = "reclaim (block-major)", .x = px, .y = py[1], .n = (size_t)n_pts},
            {.name = "layer-major resize (SwiftCache Fig. 5)", .x = px, .y = py[2], .n = (size_t)n_pts},
        };
        const kvb_plot pl = {.title = t, .xlabel = "worker pool (blocks)", .ylabel = "latency (us)", .logx = 1,
                             .logy = 1, .series = ser, .n_series = 3};
        if (kvb_plot_svg(plot_path, &pl) != 0) rc = 1;
    }
out:
    free(px);
    for (int i = 0; i < 3; i++) free(py[i]);
    free(t_lend);
    free(t_reclaim);
    free(t_lm);
    free(sizes);
    kvb_model_destroy(m);
    kvb_backend_destroy(be);
    return rc;
}
