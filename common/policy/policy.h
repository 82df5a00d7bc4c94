/* kvbank — planners (policies) and the one registry that names them.
 *
 * A planner is a kvb_planner (common/sched/plan.h). Each one is registered by a single line in
 * common/policy/policies.def; programs create them by name with parameters (--policy NAME and
 * --policy-param KEY=VALUE on the command line, "policy" and "policy_params" in the node config), and
 * `--policy list` prints the table. A planner parses its own parameters with the helpers below and
 * refuses unknown keys by name. */
#ifndef KVB_POLICY_POLICY_H
#define KVB_POLICY_POLICY_H

#include <stdio.h>

#include "common/sched/engine.h"

/* ---------------------------------------------------------------- parameters */

typedef struct kvb_policy_param {
    char *key;
    char *value;
} kvb_policy_param;

/* KEY=VALUE pairs, in the order given (a later value of the same key replaces the earlier one). An
 * all-zero struct is an empty set. */
typedef struct kvb_policy_params {
    kvb_policy_param *items; /* [n] owned */
    int n, cap;
} kvb_policy_params;

/* Adds "KEY=VALUE" (KVB_ERR_INVALID, logged, for text without '=' or with an empty key). */
kvb_status kvb_policy_params_add(kvb_policy_params *p, const char *key_eq_value);
/* Sets KEY to VALUE (copies both). */
kvb_status kvb_policy_params_set(kvb_policy_params *p, const char *key, const char *value);
/* The value of KEY, or NULL. */
const char *kvb_policy_params_get(const kvb_policy_params *p, const char *key);
void kvb_policy_params_free(kvb_policy_params *p);

/* For planners (p may be NULL: no parameters). KVB_ERR_INVALID with a logged sentence naming the
 * policy and the key: a key not in `known` (NULL-terminated), a value that does not parse or lies
 * outside [min, max], a choice not in `choices`. A key that is absent leaves *inout alone. */
kvb_status kvb_policy_params_check(const kvb_policy_params *p, const char *policy, const char *const *known);
kvb_status kvb_policy_param_i64(const kvb_policy_params *p, const char *policy, const char *key, int64_t min,
                                int64_t max, int64_t *inout);
kvb_status kvb_policy_param_f64(const kvb_policy_params *p, const char *policy, const char *key, double min, double max,
                                double *inout);
/* *inout becomes the index of the value in `choices` (NULL-terminated). */
kvb_status kvb_policy_param_choice(const kvb_policy_params *p, const char *policy, const char *key,
                                   const char *const *choices, int *inout);

/* ---------------------------------------------------------------- the registry */

/* Creates the planner; the caller owns *out (kvb_planner_destroy, or hand it to kvb_engine_create). */
typedef kvb_status (*kvb_policy_create_fn)(const kvb_policy_params *params, kvb_planner *out);

typedef struct kvb_policy_info {
    const char *name;
    const char *params;  /* its parameters, e.g. "lsc=inplace|stream" ("" for none) */
    const char *summary; /* one line */
    kvb_policy_create_fn create;
} kvb_policy_info;

int kvb_policy_count(void);
const kvb_policy_info *kvb_policy_info_at(int i);
/* NULL for an unknown name. */
const kvb_policy_info *kvb_policy_find(const char *name);
/* Creates the planner `name` with `params` (may be NULL). KVB_ERR_NOT_FOUND (logged with the list of
 * names) for an unknown name; KVB_ERR_INVALID for bad parameters. */
kvb_status kvb_policy_create(const char *name, const kvb_policy_params *params, kvb_planner *out);
/* Prints one line per planner: name, parameters, summary (what `--policy list` shows). */
void kvb_policy_print_list(FILE *f);

/* The same as kvb_policy_create(name, NULL, out). */
kvb_status kvb_policy_by_name(const char *name, kvb_planner *out);

/* ---------------------------------------------------------------- the planners (policies.def) */

#define KVB_POLICY(fn, name, params, summary) kvb_status fn(const kvb_policy_params *params_, kvb_planner *out);
#include "common/policy/policies.def"
#undef KVB_POLICY

/* vLLM's default (`recompute`) without parameters. */
kvb_planner kvb_policy_recompute(void);

#endif
