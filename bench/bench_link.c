/* kvbank-bench — the backend and the link model of a paper bench (bench_link.h). */
#include "bench/bench_link.h"

#include <stdio.h>
#include <string.h>

#include "common/mem/mem.h"
#include "common/sched/link_calib.h"
#include "common/sched/stager.h"

int kvb_bench_dev_opt(kvb_bench_dev *d, int opt, const char *arg, const char *prog) {
    int64_t v;
    if (opt == 'B') {
        kvb_dtype dt;
        if (kvb_backend_act_dtype(arg, &dt) != KVB_OK) {
            fprintf(stderr, "%s: unknown --backend '%s' (built in: %s)\n", prog, arg, kvb_backend_list());
            return 2;
        }
        d->backend = arg;
        return 1;
    }
    if (opt == 'D') {
        if (kvb_parse_i64(arg, 0, 1024, &v) != KVB_OK) {
            fprintf(stderr, "%s: bad --device '%s'\n", prog, arg);
            return 2;
        }
        d->device = (int)v;
        return 1;
    }
    return 0;
}

int kvb_bench_dev_is_gpu(const kvb_bench_dev *d) {
    const char *kind = kvb_mem_kind_of(d->backend); /* NULL: a device backend not built in here */
    return !kind || strcmp(kind, "host") != 0;
}

kvb_status kvb_bench_backend(const kvb_bench_dev *d, kvb_backend **out) {
    kvb_status st = kvb_backend_create_on(d->backend ? d->backend : "cpu", d->device, d->threads, out);
    if (st != KVB_OK)
        fprintf(stderr, "cannot create the %s backend: %s (kvbank-bench was built with: %s)\n",
                d->backend ? d->backend : "cpu", kvb_status_str(st), kvb_backend_list());
    return st;
}

kvb_status kvb_bench_links(kvb_model *m, const kvb_bench_dev *d, const char *preset, const char *cpu_default,
                           const kvb_link_point *pt, kvb_link_model *out) {
    if (!preset) preset = kvb_bench_dev_is_gpu(d) ? "off" : cpu_default;
    KVB_TRY(kvb_link_preset(preset, kvb_model_backend(m), out));
    KVB_TRY(kvb_link_calibrate(m, pt, out));
    printf("  ");
    kvb_link_model_print(stdout, out);
    return KVB_OK;
}
