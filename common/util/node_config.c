/* kvbank — the node config: reading, defaults and validation (format in node_config.h).
 *
 * Errors are logged once, where they are found, as "<file>: model \"<name>\": field \"<key>\" ..." so an
 * operator sees which model and which field to fix. Unknown keys are logged as warnings and ignored;
 * keys that start with '_' ("_comment") are comments and ignored silently. */
#include "common/util/node_config.h"

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util/json.h"

#define NODE_NAME_MAX 16  /* node + '_' + model = 40 chars, the longest region tag (common/mem/region.h) */
#define MODEL_NAME_MAX 23
#define IPC_PATH_MAX 107  /* sizeof(struct sockaddr_un.sun_path) - 1 on Linux */

const char *kvb_role_str(kvb_role r) {
    switch (r) {
    case KVB_ROLE_MASTER: return "master";
    case KVB_ROLE_WORKER: return "worker";
    default: return "none";
    }
}

/* ----------------------------------------------------------------------------------------- helpers */

/* 1 if s is 1..max chars, each a letter, a digit, '_' or (when dash) '-'. */
static int name_valid(const char *s, size_t max, int dash) {
    size_t n = strlen(s);
    if (n == 0 || n > max) return 0;
    for (size_t i = 0; i < n; i++) {
        char ch = s[i];
        int ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' ||
                 (dash && ch == '-');
        if (!ok) return 0;
    }
    return 1;
}

/* Caller owns *out: printf into a new string. */
static kvb_status fmt_dup(char **out, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static kvb_status fmt_dup(char **out, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) return KVB_ERR_INVALID;
    char *s = NULL;
    KVB_TRY(kvb_malloc((size_t)n + 1, (void **)&s));
    va_start(ap, fmt);
    vsnprintf(s, (size_t)n + 1, fmt, ap);
    va_end(ap);
    *out = s;
    return KVB_OK;
}

/* `p` made absolute against directory `dir` (p itself when absolute), without trailing slashes and
 * leading "./" components. Caller owns *out. */
static kvb_status resolve_path(const char *dir, const char *p, char **out) {
    while (p[0] == '.' && p[1] == '/') {
        p += 2;
        while (*p == '/') p++;
    }
    char *s = NULL;
    if (p[0] == '/') KVB_TRY(kvb_strdup(p, &s));
    else if (p[0] == '\0' || !strcmp(p, ".")) KVB_TRY(kvb_strdup(dir, &s));
    else KVB_TRY(fmt_dup(&s, "%s%s%s", dir, !strcmp(dir, "/") ? "" : "/", p));
    size_t n = strlen(s);
    while (n > 1 && s[n - 1] == '/') s[--n] = '\0';
    *out = s;
    return KVB_OK;
}

/* A copy of string field `key`, or of `dflt` when absent (NULL stays NULL). An empty string is an
 * error: every string field of the node config means something when present. */
static kvb_status dup_str(const json_t *obj, const char *key, int required, const char *what, const char *dflt,
                          char **out) {
    const char *s = NULL;
    KVB_TRY(kvb_json_get_str(obj, key, required, what, &s));
    if (s && !s[0]) {
        KVB_LOG_E("%s: field \"%s\" must not be empty", what, key);
        return KVB_ERR_INVALID;
    }
    if (!s) s = dflt;
    *out = NULL;
    if (s) KVB_TRY(kvb_strdup(s, out));
    return KVB_OK;
}

/* Levenshtein distance between a and b, or `cap` when it is at least cap (keys are short). */
static int edit_distance(const char *a, const char *b, int cap) {
    size_t la = strlen(a), lb = strlen(b);
    if (la > 63 || lb > 63) return cap;
    int row[64];
    for (size_t j = 0; j <= lb; j++) row[j] = (int)j;
    for (size_t i = 1; i <= la; i++) {
        int diag = row[0];
        row[0] = (int)i;
        for (size_t j = 1; j <= lb; j++) {
            int up = row[j];
            int best = diag + (a[i - 1] != b[j - 1]);
            if (row[j] + 1 < best) best = row[j] + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[lb] < cap ? row[lb] : cap;
}

/* Warns about every key of `obj` that is not in `known` (NULL-terminated), with the known key it is a
 * near miss of ("kv_mbb": did you mean "kv_mb"?); "_..." keys are comments. kvbankd checks the config
 * before it starts its children and sets KVB_CONFIG_CHECKED=1 for them, so that a node prints each
 * warning once: under that variable they are debug lines. */
static void warn_unknown(const json_t *obj, const char *const *known, const char *what) {
    const char *key;
    json_t *v;
    const char *checked = getenv("KVB_CONFIG_CHECKED");
    kvb_log_level lvl = checked && !strcmp(checked, "1") ? KVB_LOG_DEBUG : KVB_LOG_WARN;
    json_object_foreach((json_t *)obj, key, v) {
        (void)v;
        if (key[0] == '_') continue;
        int found = 0;
        const char *near = NULL;
        int cap = strlen(key) <= 4 ? 2 : 3, best = cap; /* at most 1 edit for short keys, else 2 */
        for (const char *const *k = known; *k; k++) {
            found |= !strcmp(*k, key);
            int dist = edit_distance(key, *k, best);
            if (dist < best) best = dist, near = *k;
        }
        if (found) continue;
        if (near) kvb_log(lvl, "%s: unknown field \"%s\" ignored (did you mean \"%s\"?)", what, key, near);
        else kvb_log(lvl, "%s: unknown field \"%s\" ignored", what, key);
    }
}

/* Endpoints are "tcp://..." or "ipc://<absolute path>" whose path fits a Unix socket address. Every
 * process of the node binds or connects the same string, so a relative path (resolved against each
 * process's working directory) is refused. */
static kvb_status check_endpoint(const char *ep, const char *what, const char *key) {
    if (!strncmp(ep, "tcp://", 6) && ep[6]) return KVB_OK;
    if (!strncmp(ep, "ipc://", 6)) {
        const char *path = ep + 6;
        if (path[0] != '/') {
            KVB_LOG_E("%s: field \"%s\" = \"%s\": an ipc:// endpoint needs an absolute path", what, key, ep);
            return KVB_ERR_INVALID;
        }
        if (strlen(path) > IPC_PATH_MAX) {
            KVB_LOG_E("%s: field \"%s\" = \"%s\": the socket path is %zu bytes, longer than the %d a Unix socket "
                      "allows (use a shorter run_dir or endpoint)",
                      what, key, ep, strlen(path), IPC_PATH_MAX);
            return KVB_ERR_INVALID;
        }
        return KVB_OK;
    }
    KVB_LOG_E("%s: field \"%s\" = \"%s\" must be tcp://HOST:PORT or ipc:///ABSOLUTE/PATH", what, key, ep);
    return KVB_ERR_INVALID;
}

/* --------------------------------------------------------------------------------------- sections */

static kvb_status load_coordinator(kvb_node_config *c, const json_t *root) {
    char what[PATH_MAX + 32];
    snprintf(what, sizeof what, "%s: coordinator", c->path);
    const json_t *co = json_object_get(root, "coordinator");
    if (co && !json_is_null(co) && !json_is_object(co)) {
        KVB_LOG_E("%s: field \"coordinator\" must be an object", c->path);
        return KVB_ERR_INVALID;
    }
    if (co && json_is_null(co)) co = NULL;
    char *dflt = NULL;
    KVB_TRY(fmt_dup(&dflt, "ipc://%s/coordinator.sock", c->run_dir));
    kvb_status st = dup_str(co, "endpoint", 0, what, dflt, &c->coordinator);
    free(dflt);
    KVB_TRY(st);
    KVB_TRY(check_endpoint(c->coordinator, what, "endpoint"));
    /* The coordinator serves this node's processes: ipc:// only (docs/lending.md, threat model), and its
     * control endpoint "<path>.ctl" must fit a Unix socket address too. */
    if (strncmp(c->coordinator, "ipc://", 6) != 0) {
        KVB_LOG_E("%s: field \"endpoint\" = \"%s\": the coordinator listens on ipc:// only (it serves the processes "
                  "of one node; tcp:// would be open to every user of the machine)", what, c->coordinator);
        return KVB_ERR_INVALID;
    }
    if (strlen(c->coordinator + 6) + 4 > IPC_PATH_MAX) {
        KVB_LOG_E("%s: field \"endpoint\" = \"%s\": the socket path leaves no room for its \".ctl\" twin (at most "
                  "%d bytes)", what, c->coordinator, IPC_PATH_MAX - 4);
        return KVB_ERR_INVALID;
    }
    int64_t v = c->heartbeat_ms;
    KVB_TRY(kvb_json_get_int(co, "heartbeat_ms", 0, 10, 3600000, what, &v));
    c->heartbeat_ms = (int)v;
    v = c->heartbeat_misses;
    KVB_TRY(kvb_json_get_int(co, "heartbeat_misses", 0, 1, 1000, what, &v));
    c->heartbeat_misses = (int)v;
    KVB_TRY(kvb_json_get_real(co, "lend_interval_s", 0, 0.001, 86400.0, what, &c->lend_interval_s));
    KVB_TRY(kvb_json_get_real(co, "window_s", 0, 0.001, 7 * 86400.0, what, &c->window_s));
    static const char *const known[] = {"endpoint", "heartbeat_ms", "heartbeat_misses", "lend_interval_s",
                                        "window_s", NULL};
    if (co) warn_unknown(co, known, what);
    return KVB_OK;
}

static kvb_status add_api_key(kvb_node_gateway *g, const char *key, size_t len, const char *what) {
    if (len < 8) {
        KVB_LOG_E("%s: an API key is %zu characters; at least 8 are required", what, len);
        return KVB_ERR_INVALID;
    }
    KVB_TRY(kvb_realloc_array((void **)&g->api_keys, (size_t)g->n_api_keys + 1, sizeof *g->api_keys));
    char *k = NULL;
    KVB_TRY(kvb_malloc(len + 1, (void **)&k));
    memcpy(k, key, len);
    k[len] = '\0';
    g->api_keys[g->n_api_keys++] = k;
    return KVB_OK;
}

/* "api_keys": ["KEY", ...] and "api_keys_file": a file of keys, one a line (blank lines and lines
 * starting with '#' skipped, surrounding white space trimmed). */
static kvb_status load_api_keys(kvb_node_config *c, const char *dir, const json_t *go, const char *what) {
    kvb_node_gateway *g = &c->gateway;
    const json_t *a = json_object_get(go, "api_keys");
    if (a && !json_is_null(a)) {
        if (!json_is_array(a)) {
            KVB_LOG_E("%s: field \"api_keys\" must be an array of strings", what);
            return KVB_ERR_INVALID;
        }
        for (size_t i = 0; i < json_array_size(a); i++) {
            const json_t *k = json_array_get(a, i);
            if (!json_is_string(k)) {
                KVB_LOG_E("%s: field \"api_keys\"[%zu] must be a string", what, i);
                return KVB_ERR_INVALID;
            }
            KVB_TRY(add_api_key(g, json_string_value(k), json_string_length(k), what));
        }
    }
    char *rel = NULL, *path = NULL;
    KVB_TRY(dup_str(go, "api_keys_file", 0, what, NULL, &rel));
    if (!rel) return KVB_OK;
    kvb_status st = resolve_path(dir, rel, &path);
    free(rel);
    KVB_TRY(st);
    FILE *f = fopen(path, "r");
    if (!f) {
        KVB_LOG_E("%s: field \"api_keys_file\": cannot open %s: %s", what, path, strerror(errno));
        free(path);
        return KVB_ERR_INVALID;
    }
    char line[4096];
    while (st == KVB_OK && fgets(line, sizeof line, f)) {
        char *b = line, *e = line + strlen(line);
        while (*b == ' ' || *b == '\t') b++;
        while (e > b && (e[-1] == '\n' || e[-1] == '\r' || e[-1] == ' ' || e[-1] == '\t')) e--;
        if (e == b || *b == '#') continue;
        st = add_api_key(g, b, (size_t)(e - b), what);
    }
    fclose(f);
    free(path);
    return st;
}

/* "gateway": {"listen": "HOST:PORT", "max_body_kb", "max_streams", "tbt_slo_ms", ...} (optional). */
static kvb_status load_gateway(kvb_node_config *c, const char *dir, const json_t *root) {
    kvb_node_gateway *g = &c->gateway;
    g->port = 8000;
    g->max_body = 1 << 20;
    g->max_streams = 256;
    g->drain_timeout_s = 30;
    g->text_workers = 2;
    g->health_open = g->metrics_open = 1;
    g->retry_after_s = 5;
    const json_t *go = json_object_get(root, "gateway");
    if (!go || json_is_null(go)) return KVB_OK;
    char what[PATH_MAX + 32];
    snprintf(what, sizeof what, "%s: gateway", c->path);
    if (!json_is_object(go)) {
        KVB_LOG_E("%s: field \"gateway\" must be an object", c->path);
        return KVB_ERR_INVALID;
    }
    g->enabled = 1;
    char *listen = NULL;
    KVB_TRY(dup_str(go, "listen", 0, what, "127.0.0.1:8000", &listen));
    /* HOST:PORT, the host of an IPv6 address in brackets */
    char *colon = strrchr(listen, ':');
    char *host = listen, *end = NULL;
    long port = colon ? strtol(colon + 1, &end, 10) : -1;
    if (colon) *colon = '\0';
    if (host[0] == '[') {
        size_t n = strlen(host);
        if (n < 2 || host[n - 1] != ']') port = -1;
        else host[n - 1] = '\0', host++;
    }
    if (!colon || !end || *end || colon[1] == '\0' || port < 0 || port > 65535 || !*host) {
        KVB_LOG_E("%s: field \"listen\" must be HOST:PORT (e.g. 127.0.0.1:8000 or [::1]:8000)", what);
        free(listen);
        return KVB_ERR_INVALID;
    }
    kvb_status st = kvb_strdup(host, &g->host);
    free(listen);
    KVB_TRY(st);
    g->port = (int)port;
    int64_t v = g->max_body / 1024;
    KVB_TRY(kvb_json_get_int(go, "max_body_kb", 0, 1, 1 << 20, what, &v));
    g->max_body = v * 1024;
    v = g->max_streams;
    KVB_TRY(kvb_json_get_int(go, "max_streams", 0, 1, 100000, what, &v));
    g->max_streams = (int)v;
    KVB_TRY(kvb_json_get_real(go, "tbt_slo_ms", 0, 0, 60000, what, &g->tbt_slo_ms));
    KVB_TRY(kvb_json_get_real(go, "drain_timeout_s", 0, 0, 3600, what, &g->drain_timeout_s));
    v = g->max_body / 1024;
    KVB_TRY(kvb_json_get_int(go, "max_text_kb", 0, 1, 1 << 20, what, &v));
    g->max_text = v * 1024;
    v = g->text_workers;
    KVB_TRY(kvb_json_get_int(go, "text_workers", 0, 1, 64, what, &v));
    g->text_workers = (int)v;
    KVB_TRY(kvb_json_get_bool(go, "health_open", 0, what, &g->health_open));
    KVB_TRY(kvb_json_get_bool(go, "metrics_open", 0, what, &g->metrics_open));
    KVB_TRY(load_api_keys(c, dir, go, what));
    v = g->retry_after_s;
    KVB_TRY(kvb_json_get_int(go, "retry_after_s", 0, 1, 3600, what, &v));
    g->retry_after_s = (int)v;
    /* the text budgets: absent (0) leaves the text layer's defaults, which live in common/text */
    v = 0;
    KVB_TRY(kvb_json_get_int(go, "encode_kb", 0, 1, 1 << 20, what, &v));
    g->encode_bytes = v * 1024;
    KVB_TRY(kvb_json_get_int(go, "decode_ids", 0, 1, 1 << 28, what, &g->decode_ids));
    KVB_TRY(kvb_json_get_int(go, "render_steps", 0, 1000, (int64_t)1 << 40, what, &g->render_steps));
    v = 0;
    KVB_TRY(kvb_json_get_int(go, "render_output_kb", 0, 1, 1 << 20, what, &v));
    g->render_output = v * 1024;
    v = 0;
    KVB_TRY(kvb_json_get_int(go, "render_memory_mb", 0, 1, 1 << 16, what, &v));
    g->render_memory = v << 20;
    char *rel = NULL;
    KVB_TRY(dup_str(go, "tls_cert", 0, what, NULL, &rel));
    if (rel) {
        st = resolve_path(dir, rel, &g->tls_cert);
        free(rel);
        KVB_TRY(st);
    }
    KVB_TRY(dup_str(go, "tls_key", 0, what, NULL, &rel));
    if (rel) {
        st = resolve_path(dir, rel, &g->tls_key);
        free(rel);
        KVB_TRY(st);
    }
    if (!g->tls_cert != !g->tls_key) {
        KVB_LOG_E("%s: fields \"tls_cert\" and \"tls_key\" go together", what);
        return KVB_ERR_INVALID;
    }
    static const char *const known[] = {"listen", "max_body_kb", "max_streams", "tbt_slo_ms", "drain_timeout_s",
                                        "max_text_kb", "text_workers", "api_keys", "api_keys_file", "health_open",
                                        "metrics_open", "tls_cert", "tls_key", "retry_after_s", "encode_kb",
                                        "decode_ids", "render_steps", "render_output_kb", "render_memory_mb", NULL};
    warn_unknown(go, known, what);
    return KVB_OK;
}

/* "policy_params": {"KEY": VALUE, ...}: strings, numbers and booleans, kept as text for the planner to
 * parse (it refuses keys it does not know). */
static kvb_status load_policy_params(const json_t *jm, const char *what, kvb_node_model *m) {
    const json_t *pp = json_object_get(jm, "policy_params");
    if (!pp || json_is_null(pp)) return KVB_OK;
    if (!json_is_object(pp)) {
        KVB_LOG_E("%s: field \"policy_params\" must be an object of KEY: value", what);
        return KVB_ERR_INVALID;
    }
    size_t n = json_object_size(pp);
    if (n == 0) return KVB_OK;
    KVB_TRY(kvb_calloc(n, sizeof *m->policy_keys, (void **)&m->policy_keys));
    KVB_TRY(kvb_calloc(n, sizeof *m->policy_values, (void **)&m->policy_values));
    const char *key;
    const json_t *val;
    json_object_foreach((json_t *)pp, key, val) {
        char buf[64];
        const char *text = buf;
        if (json_is_string(val)) text = json_string_value(val);
        else if (json_is_integer(val)) snprintf(buf, sizeof buf, "%lld", (long long)json_integer_value(val));
        else if (json_is_real(val)) snprintf(buf, sizeof buf, "%.17g", json_real_value(val));
        else if (json_is_boolean(val)) text = json_is_true(val) ? "true" : "false";
        else {
            KVB_LOG_E("%s: policy_params.%s must be a string, a number or a boolean", what, key);
            return KVB_ERR_INVALID;
        }
        if (!key[0]) {
            KVB_LOG_E("%s: policy_params has an empty key", what);
            return KVB_ERR_INVALID;
        }
        int i = m->n_policy_params;
        KVB_TRY(kvb_strdup(key, &m->policy_keys[i]));
        KVB_TRY(kvb_strdup(text, &m->policy_values[i]));
        m->n_policy_params++;
    }
    return KVB_OK;
}

static kvb_status load_model(kvb_node_config *c, const char *dir, const json_t *jm, int idx, kvb_node_model *m) {
    char what[PATH_MAX + 64];
    snprintf(what, sizeof what, "%s: models[%d]", c->path, idx);
    if (!json_is_object(jm)) {
        KVB_LOG_E("%s must be an object", what);
        return KVB_ERR_INVALID;
    }
    KVB_TRY(dup_str(jm, "name", 1, what, NULL, &m->name));
    if (!name_valid(m->name, MODEL_NAME_MAX, 1)) {
        KVB_LOG_E("%s: field \"name\" = \"%s\" must be 1..%d of [A-Za-z0-9_-]", what, m->name, MODEL_NAME_MAX);
        return KVB_ERR_INVALID;
    }
    snprintf(what, sizeof what, "%s: model \"%s\"", c->path, m->name);
    /* unknown keys first: a misspelt required field ("kv_mbb") then comes with its "did you mean" before
     * the error about the missing one */
    static const char *const known[] = {"name",  "role",     "model_dir", "mkmodel",          "backend",
                                        "device", "threads", "kv_mb",     "block_size",       "endpoint",
                                        "policy", "lsc",     "max_seqs",  "max_batch_tokens", "lend",
                                        "max_live", "max_live_per_client", "tbt_slo_ms", "policy_params",
                                        "stall_wait_s", "stall_overtake", "link_preset", NULL};
    warn_unknown(jm, known, what);

    const char *role = NULL;
    KVB_TRY(kvb_json_get_str(jm, "role", 1, what, &role));
    if (!strcmp(role, "master")) m->role = KVB_ROLE_MASTER;
    else if (!strcmp(role, "worker")) m->role = KVB_ROLE_WORKER;
    else {
        KVB_LOG_E("%s: field \"role\" = \"%s\" must be \"master\" or \"worker\"", what, role);
        return KVB_ERR_INVALID;
    }

    char *rel = NULL;
    KVB_TRY(dup_str(jm, "model_dir", 1, what, NULL, &rel));
    kvb_status st = resolve_path(dir, rel, &m->model_dir);
    free(rel);
    KVB_TRY(st);

    KVB_TRY(dup_str(jm, "mkmodel", 0, what, NULL, &m->mkmodel));
    if (m->mkmodel && strpbrk(m->mkmodel, "\"'\\`$")) {
        /* kvbankd splits the arguments on whitespace and runs no shell: quoting would be taken literally. */
        KVB_LOG_E("%s: field \"mkmodel\" = \"%s\": arguments are split on whitespace; quotes, '\\', '`' and '$' "
                  "are not allowed",
                  what, m->mkmodel);
        return KVB_ERR_INVALID;
    }
    KVB_TRY(dup_str(jm, "backend", 0, what, "cpu", &m->backend));

    int64_t v = 0;
    KVB_TRY(kvb_json_get_int(jm, "device", 0, 0, 1023, what, &v));
    m->device = (int)v;

    v = 1;
    KVB_TRY(kvb_json_get_int(jm, "threads", 0, 1, 1024, what, &v));
    m->threads = (int)v;
    v = 0;
    KVB_TRY(kvb_json_get_int(jm, "kv_mb", 1, 1, (int64_t)1 << 20, what, &v));
    m->kv_bytes = v << 20;
    v = 16;
    KVB_TRY(kvb_json_get_int(jm, "block_size", 0, 1, 4096, what, &v));
    m->block_size = (int)v;

    char *dflt = NULL;
    KVB_TRY(fmt_dup(&dflt, "ipc://%s/%s.sock", c->run_dir, m->name));
    st = dup_str(jm, "endpoint", 0, what, dflt, &m->endpoint);
    free(dflt);
    KVB_TRY(st);
    KVB_TRY(check_endpoint(m->endpoint, what, "endpoint"));

    KVB_TRY(dup_str(jm, "policy", 0, what, "recompute", &m->policy));
    KVB_TRY(dup_str(jm, "link_preset", 0, what, NULL, &m->link_preset));
    KVB_TRY(load_policy_params(jm, what, m));
    v = 512;
    KVB_TRY(kvb_json_get_int(jm, "max_batch_tokens", 0, 1, 1 << 24, what, &v));
    m->max_batch_tokens = (int)v;
    v = 64;
    KVB_TRY(kvb_json_get_int(jm, "max_seqs", 0, 1, 1 << 20, what, &v));
    m->max_seqs = (int)v;
    v = 1024;
    KVB_TRY(kvb_json_get_int(jm, "max_live", 0, 1, 1 << 20, what, &v));
    m->max_live = (int)v;
    v = 0;
    KVB_TRY(kvb_json_get_int(jm, "max_live_per_client", 0, 1, 1 << 20, what, &v));
    m->max_live_per_client = (int)v;

    const char *lsc = NULL;
    KVB_TRY(kvb_json_get_str(jm, "lsc", 0, what, &lsc));
    m->lsc_stream = 0;
    if (lsc) {
        if (!strcmp(lsc, "stream")) m->lsc_stream = 1;
        else if (strcmp(lsc, "inplace")) {
            KVB_LOG_E("%s: field \"lsc\" = \"%s\" must be \"inplace\" or \"stream\"", what, lsc);
            return KVB_ERR_INVALID;
        }
        if (m->role != KVB_ROLE_MASTER) {
            KVB_LOG_W("%s: field \"lsc\" applies to the master only; ignored for a worker", what);
            m->lsc_stream = 0;
        }
    }
    m->lend = 1;
    KVB_TRY(kvb_json_get_bool(jm, "lend", 0, what, &m->lend));
    if (!m->lend && m->role != KVB_ROLE_WORKER) {
        KVB_LOG_W("%s: field \"lend\" applies to workers only; ignored", what);
        m->lend = 1;
    }
    m->tbt_slo_ms = -1;
    KVB_TRY(kvb_json_get_real(jm, "tbt_slo_ms", 0, 0, 60000, what, &m->tbt_slo_ms));
    m->stall_wait_s = 60;
    KVB_TRY(kvb_json_get_real(jm, "stall_wait_s", 0, 0, 86400, what, &m->stall_wait_s));
    v = 64;
    KVB_TRY(kvb_json_get_int(jm, "stall_overtake", 0, 0, 1 << 20, what, &v));
    m->stall_overtake = (int)v;
    return KVB_OK;
}

/* The family of a backend name: the part before ':' ("cpu" for "cpu"). Backends of one family keep
 * their KV memory in the same kind of memory (common/mem/registry.c maps families to kinds). */
static size_t backend_family_len(const char *backend) { return strcspn(backend, ":"); }

static int same_family(const char *a, const char *b) {
    size_t n = backend_family_len(a);
    return n == backend_family_len(b) && !strncmp(a, b, n);
}

/* Models that may lend to each other (the master and every worker that lends) need KV memory of one
 * kind: a host shm region and a device region cannot be imported by each other's process. */
static kvb_status check_memory_kinds(const kvb_node_config *c) {
    const kvb_node_model *master = kvb_node_config_master(c);
    for (int i = 0; i < c->n_models; i++) {
        const kvb_node_model *m = &c->models[i];
        if (m == master || !m->lend || same_family(m->backend, master->backend)) continue;
        KVB_LOG_E("%s: model \"%s\" (backend \"%s\") and model \"%s\" (backend \"%s\") cannot lend to each other: "
                  "their KV memory is of different kinds (host memory and device memory); give them backends of one "
                  "kind, or the worker \"lend\": false",
                  c->path, m->name, m->backend, master->name, master->backend);
        return KVB_ERR_INVALID;
    }
    return KVB_OK;
}

/* Node-wide rules: exactly one master, unique names, unique endpoints (the coordinator's included). */
static kvb_status check_node(const kvb_node_config *c) {
    int masters = 0;
    for (int i = 0; i < c->n_models; i++) {
        const kvb_node_model *m = &c->models[i];
        if (m->role == KVB_ROLE_MASTER && ++masters > 1) {
            KVB_LOG_E("%s: model \"%s\": field \"role\": a second master (the first is \"%s\"); a node has exactly "
                      "one",
                      c->path, m->name, kvb_node_config_master(c)->name);
            return KVB_ERR_INVALID;
        }
        if (!strcmp(m->endpoint, c->coordinator)) {
            KVB_LOG_E("%s: model \"%s\": field \"endpoint\" = \"%s\" is the coordinator's endpoint", c->path, m->name,
                      m->endpoint);
            return KVB_ERR_INVALID;
        }
        for (int k = 0; k < i; k++) {
            if (!strcmp(c->models[k].name, m->name)) {
                KVB_LOG_E("%s: models[%d]: field \"name\" = \"%s\" is already the name of models[%d]", c->path, i,
                          m->name, k);
                return KVB_ERR_INVALID;
            }
            if (!strcmp(c->models[k].endpoint, m->endpoint)) {
                KVB_LOG_E("%s: model \"%s\": field \"endpoint\" = \"%s\" is already the endpoint of model \"%s\"",
                          c->path, m->name, m->endpoint, c->models[k].name);
                return KVB_ERR_INVALID;
            }
        }
    }
    if (masters == 0) {
        KVB_LOG_E("%s: field \"models\": no model has \"role\": \"master\"; a node has exactly one", c->path);
        return KVB_ERR_INVALID;
    }
    return check_memory_kinds(c);
}

/* ------------------------------------------------------------------------------------------ public */

kvb_status kvb_node_config_load(const char *path, kvb_node_config **out) {
    if (!path || !out) return KVB_ERR_INVALID;
    *out = NULL;
    json_t *root = NULL;
    KVB_TRY(kvb_json_load_file(path, &root));
    kvb_status st = KVB_OK;
    kvb_node_config *c = NULL;
    char *dir = NULL;
    KVB_TRY_GOTO(kvb_calloc(1, sizeof *c, (void **)&c), fail);
    c->heartbeat_ms = 500;
    c->heartbeat_misses = 4;
    c->lend_interval_s = 2.0;
    c->window_s = 60.0;

    char abs[PATH_MAX];
    if (!realpath(path, abs)) {
        KVB_LOG_E("%s: cannot resolve the path: %s", path, strerror(errno));
        st = KVB_ERR_IO;
        goto fail;
    }
    KVB_TRY_GOTO(kvb_strdup(abs, &c->path), fail);
    char *slash = strrchr(abs, '/');
    if (slash == abs) slash[1] = '\0';
    else *slash = '\0';
    KVB_TRY_GOTO(kvb_strdup(abs, &dir), fail);

    if (!json_is_object(root)) {
        KVB_LOG_E("%s: the node config must be a JSON object", c->path);
        st = KVB_ERR_INVALID;
        goto fail;
    }
    KVB_TRY_GOTO(dup_str(root, "node", 1, c->path, NULL, &c->node), fail);
    if (!name_valid(c->node, NODE_NAME_MAX, 0)) {
        KVB_LOG_E("%s: field \"node\" = \"%s\" must be 1..%d of [A-Za-z0-9_]", c->path, c->node, NODE_NAME_MAX);
        st = KVB_ERR_INVALID;
        goto fail;
    }

    char *rel = NULL;
    char *dflt = NULL;
    KVB_TRY_GOTO(fmt_dup(&dflt, "/run/kvbank/%s", c->node), fail);
    st = dup_str(root, "run_dir", 0, c->path, dflt, &rel);
    free(dflt);
    if (st != KVB_OK) goto fail;
    st = resolve_path(dir, rel, &c->run_dir);
    free(rel);
    if (st != KVB_OK) goto fail;

    rel = NULL;
    KVB_TRY_GOTO(dup_str(root, "bin_dir", 0, c->path, NULL, &rel), fail);
    if (rel) {
        st = resolve_path(dir, rel, &c->bin_dir);
        free(rel);
        if (st != KVB_OK) goto fail;
    }

    static const char *const known[] = {"node", "run_dir", "bin_dir", "coordinator", "models", "gateway", NULL};
    warn_unknown(root, known, c->path);
    KVB_TRY_GOTO(load_coordinator(c, root), fail);
    KVB_TRY_GOTO(load_gateway(c, dir, root), fail);

    const json_t *models = json_object_get(root, "models");
    if (!json_is_array(models) || json_array_size(models) == 0) {
        KVB_LOG_E("%s: field \"models\" must be a non-empty array", c->path);
        st = KVB_ERR_INVALID;
        goto fail;
    }
    size_t n = json_array_size(models);
    if (n > 256) {
        KVB_LOG_E("%s: field \"models\" has %zu entries; at most 256", c->path, n);
        st = KVB_ERR_INVALID;
        goto fail;
    }
    KVB_TRY_GOTO(kvb_calloc(n, sizeof *c->models, (void **)&c->models), fail);
    for (size_t i = 0; i < n; i++) {
        c->n_models = (int)i + 1; /* counted before loading so that free releases a half-loaded model */
        KVB_TRY_GOTO(load_model(c, dir, json_array_get(models, i), (int)i, &c->models[i]), fail);
    }
    KVB_TRY_GOTO(check_node(c), fail);

    free(dir);
    json_decref(root);
    *out = c;
    return KVB_OK;

fail:
    free(dir);
    kvb_node_config_free(c);
    json_decref(root);
    return st;
}

void kvb_node_config_free(kvb_node_config *c) {
    if (!c) return;
    for (int i = 0; i < c->n_models; i++) {
        kvb_node_model *m = &c->models[i];
        free(m->name);
        free(m->model_dir);
        free(m->mkmodel);
        free(m->backend);
        free(m->endpoint);
        free(m->policy);
        free(m->link_preset);
        for (int k = 0; k < m->n_policy_params; k++) {
            free(m->policy_keys[k]);
            free(m->policy_values[k]);
        }
        free(m->policy_keys);
        free(m->policy_values);
    }
    free(c->models);
    free(c->path);
    free(c->node);
    free(c->run_dir);
    free(c->bin_dir);
    free(c->coordinator);
    free(c->gateway.host);
    for (int i = 0; i < c->gateway.n_api_keys; i++) free(c->gateway.api_keys[i]);
    free(c->gateway.api_keys);
    free(c->gateway.tls_cert);
    free(c->gateway.tls_key);
    free(c);
}

const kvb_node_model *kvb_node_config_model(const kvb_node_config *c, const char *name) {
    if (!c || !name) return NULL;
    for (int i = 0; i < c->n_models; i++)
        if (!strcmp(c->models[i].name, name)) return &c->models[i];
    return NULL;
}

const kvb_node_model *kvb_node_config_master(const kvb_node_config *c) {
    if (!c) return NULL;
    for (int i = 0; i < c->n_models; i++)
        if (c->models[i].role == KVB_ROLE_MASTER) return &c->models[i];
    return NULL;
}

void kvb_node_region_tag(const kvb_node_config *c, const char *model, char *tag, size_t len) {
    if (!tag || !len) return;
    snprintf(tag, len, "%s_%s", c && c->node ? c->node : "", model ? model : "");
}
