/* kvbank — the registry of planners (the lines of policies.def) and the parameter helpers. */
#include <string.h>

#include "common/policy/policy.h"

static const kvb_policy_info registry[] = {
#define KVB_POLICY(fn, name, params, summary) {name, params, summary, fn},
#include "common/policy/policies.def"
#undef KVB_POLICY
};

int kvb_policy_count(void) { return (int)KVB_ARRAY_LEN(registry); }

const kvb_policy_info *kvb_policy_info_at(int i) { return i >= 0 && i < kvb_policy_count() ? &registry[i] : NULL; }

const kvb_policy_info *kvb_policy_find(const char *name) {
    for (int i = 0; name && i < kvb_policy_count(); i++)
        if (!strcmp(registry[i].name, name)) return &registry[i];
    return NULL;
}

/* Writes items[0..n) (n < 0: up to a NULL) joined by `sep` into buf (truncated to len). */
static void join(char *buf, size_t len, const char *sep, const char *const *items, int n) {
    size_t at = 0;
    buf[0] = 0;
    for (int i = 0; (n < 0 ? items[i] != NULL : i < n) && at < len; i++) {
        int w = snprintf(buf + at, len - at, "%s%s", i ? sep : "", items[i]);
        if (w < 0) break;
        at += (size_t)w;
    }
}

kvb_status kvb_policy_create(const char *name, const kvb_policy_params *params, kvb_planner *out) {
    const kvb_policy_info *pi = kvb_policy_find(name);
    *out = (kvb_planner){0};
    if (!pi) {
        const char *all[KVB_ARRAY_LEN(registry)];
        for (int i = 0; i < kvb_policy_count(); i++) all[i] = registry[i].name;
        char list[512];
        join(list, sizeof list, ", ", all, kvb_policy_count());
        KVB_LOG_E("unknown policy \"%s\" (available: %s)", name ? name : "", list);
        return KVB_ERR_NOT_FOUND;
    }
    return pi->create(params, out);
}

kvb_status kvb_policy_by_name(const char *name, kvb_planner *out) { return kvb_policy_create(name, NULL, out); }

void kvb_policy_print_list(FILE *f) {
    int w = 0;
    for (int i = 0; i < kvb_policy_count(); i++) w = KVB_MAX(w, (int)strlen(registry[i].name));
    for (int i = 0; i < kvb_policy_count(); i++) {
        const kvb_policy_info *pi = &registry[i];
        fprintf(f, "%-*s  %s", w, pi->name, pi->summary);
        if (pi->params[0]) fprintf(f, " [params: %s]", pi->params);
        fprintf(f, "\n");
    }
}

/* ---------------------------------------------------------------- parameters */

kvb_status kvb_policy_params_set(kvb_policy_params *p, const char *key, const char *value) {
    for (int i = 0; i < p->n; i++) {
        if (strcmp(p->items[i].key, key)) continue;
        char *v;
        KVB_TRY(kvb_strdup(value, &v));
        free(p->items[i].value);
        p->items[i].value = v;
        return KVB_OK;
    }
    if (p->n == p->cap) {
        int cap = p->cap ? 2 * p->cap : 4;
        KVB_TRY(kvb_realloc_array((void **)&p->items, (size_t)cap, sizeof *p->items));
        p->cap = cap;
    }
    kvb_policy_param it = {0};
    KVB_TRY(kvb_strdup(key, &it.key));
    if (kvb_strdup(value, &it.value) != KVB_OK) {
        free(it.key);
        return KVB_ERR_NOMEM;
    }
    p->items[p->n++] = it;
    return KVB_OK;
}

kvb_status kvb_policy_params_add(kvb_policy_params *p, const char *key_eq_value) {
    const char *eq = key_eq_value ? strchr(key_eq_value, '=') : NULL;
    if (!eq || eq == key_eq_value) {
        KVB_LOG_E("policy parameter '%s' is not KEY=VALUE", key_eq_value ? key_eq_value : "");
        return KVB_ERR_INVALID;
    }
    char *key;
    KVB_TRY(kvb_strdup(key_eq_value, &key));
    key[eq - key_eq_value] = 0;
    kvb_status st = kvb_policy_params_set(p, key, eq + 1);
    free(key);
    return st;
}

const char *kvb_policy_params_get(const kvb_policy_params *p, const char *key) {
    for (int i = 0; p && i < p->n; i++)
        if (!strcmp(p->items[i].key, key)) return p->items[i].value;
    return NULL;
}

void kvb_policy_params_free(kvb_policy_params *p) {
    if (!p) return;
    for (int i = 0; i < p->n; i++) {
        free(p->items[i].key);
        free(p->items[i].value);
    }
    free(p->items);
    memset(p, 0, sizeof *p);
}

kvb_status kvb_policy_params_check(const kvb_policy_params *p, const char *policy, const char *const *known) {
    for (int i = 0; p && i < p->n; i++) {
        int ok = 0;
        for (int k = 0; known[k] && !ok; k++) ok = !strcmp(known[k], p->items[i].key);
        if (ok) continue;
        char list[256];
        join(list, sizeof list, ", ", known, -1);
        KVB_LOG_E("policy %s: unknown parameter '%s' (%s%s)", policy, p->items[i].key, known[0] ? "known: " : "it takes none",
                  list);
        return KVB_ERR_INVALID;
    }
    return KVB_OK;
}

kvb_status kvb_policy_param_i64(const kvb_policy_params *p, const char *policy, const char *key, int64_t min,
                                int64_t max, int64_t *inout) {
    const char *v = kvb_policy_params_get(p, key);
    if (!v) return KVB_OK;
    if (kvb_parse_i64(v, min, max, inout) != KVB_OK) {
        KVB_LOG_E("policy %s: parameter %s='%s' must be an integer in [%lld, %lld]", policy, key, v, (long long)min,
                  (long long)max);
        return KVB_ERR_INVALID;
    }
    return KVB_OK;
}

kvb_status kvb_policy_param_f64(const kvb_policy_params *p, const char *policy, const char *key, double min, double max,
                                double *inout) {
    const char *v = kvb_policy_params_get(p, key);
    if (!v) return KVB_OK;
    double d;
    if (kvb_parse_f64(v, &d) != KVB_OK || !(d >= min && d <= max)) {
        KVB_LOG_E("policy %s: parameter %s='%s' must be a number in [%g, %g]", policy, key, v, min, max);
        return KVB_ERR_INVALID;
    }
    *inout = d;
    return KVB_OK;
}

kvb_status kvb_policy_param_choice(const kvb_policy_params *p, const char *policy, const char *key,
                                   const char *const *choices, int *inout) {
    const char *v = kvb_policy_params_get(p, key);
    if (!v) return KVB_OK;
    for (int i = 0; choices[i]; i++) {
        if (strcmp(choices[i], v)) continue;
        *inout = i;
        return KVB_OK;
    }
    char list[256];
    join(list, sizeof list, "|", choices, -1);
    KVB_LOG_E("policy %s: parameter %s='%s' must be one of %s", policy, key, v, list);
    return KVB_ERR_INVALID;
}
