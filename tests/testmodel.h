/* kvbank — a tiny model for the in-process suites: written by kvbank-mkmodel (a real safetensors
 * directory) into a fresh temporary directory, loaded on the CPU backend, removed afterwards. */
#ifndef KVB_TESTS_TESTMODEL_H
#define KVB_TESTS_TESTMODEL_H

#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/model/model.h"

typedef struct kvb_t_model {
    char dir[256]; /* <tmp>/m */
    kvb_backend *be;
    kvb_model *m;
} kvb_t_model;

/* `args`: kvbank-mkmodel's options (architecture, sizes, seed). */
static inline void kvb_t_model_make(kvb_t_model *t, const char *args) {
    char tmpl[] = "/tmp/kvb-model-XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(tmpl));
    snprintf(t->dir, sizeof t->dir, "%s/m", tmpl);
    const char *bd = getenv("KVB_BUILDDIR");
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s/kvbank-mkmodel %s %s >/dev/null", bd ? bd : ".", args, t->dir);
    ck_assert_int_eq(system(cmd), 0);
    ck_assert_int_eq(kvb_backend_create("cpu", 2, &t->be), KVB_OK);
    ck_assert_int_eq(kvb_model_load(t->dir, t->be, &t->m), KVB_OK);
}

static inline void kvb_t_model_free(kvb_t_model *t) {
    kvb_model_destroy(t->m);
    kvb_backend_destroy(t->be);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %.*s", (int)(strrchr(t->dir, '/') - t->dir), t->dir);
    ck_assert_int_eq(system(cmd), 0);
    memset(t, 0, sizeof *t);
}

#endif
