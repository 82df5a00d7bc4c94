#include "common/util/json.h"

#include <errno.h>
#include <math.h>
#include <string.h>
#include <stdlib.h>

#include "common/util/util.h"

kvb_status kvb_json_load_file_flags(const char *path, size_t flags, json_t **out) {
    json_error_t err;
    char *text = NULL;
    size_t len = 0;
    *out = NULL;
    /* read whole (jansson's json_loadfd reads a byte per system call: 10 M of them for a tokenizer.json) */
    kvb_status st = kvb_read_file(path, KVB_JSON_MAX_FILE, &text, &len);
    if (st == KVB_ERR_NOT_FOUND) KVB_LOG_E("%s: cannot read: it does not exist", path);
    if (st != KVB_OK) return st;
    json_t *j = json_loadb(text, len, flags, &err);
    free(text);
    if (!j) {
        KVB_LOG_E("%s:%d:%d: invalid JSON: %s", path, err.line, err.column, err.text);
        return KVB_ERR_FORMAT;
    }
    *out = j;
    return KVB_OK;
}

kvb_status kvb_json_load_file(const char *path, json_t **out) {
    return kvb_json_load_file_flags(path, JSON_REJECT_DUPLICATES, out);
}

kvb_status kvb_json_load_text(const char *text, size_t len, const char *what, json_t **out) {
    json_error_t err;
    json_t *j = json_loadb(text, len, JSON_REJECT_DUPLICATES, &err);
    if (!j) {
        KVB_LOG_E("%s:%d:%d: invalid JSON: %s", what, err.line, err.column, err.text);
        return KVB_ERR_FORMAT;
    }
    *out = j;
    return KVB_OK;
}

static kvb_status get_field(const json_t *obj, const char *key, int required, const char *what, json_t **v) {
    *v = json_is_object(obj) ? json_object_get(obj, key) : NULL;
    if (!*v || json_is_null(*v)) {
        *v = NULL;
        if (required) {
            KVB_LOG_E("%s: missing field \"%s\"", what, key);
            return KVB_ERR_INVALID;
        }
    }
    return KVB_OK;
}

kvb_status kvb_json_get_int(const json_t *obj, const char *key, int required, int64_t min, int64_t max,
                            const char *what, int64_t *out) {
    json_t *v;
    KVB_TRY(get_field(obj, key, required, what, &v));
    if (!v) return KVB_OK;
    int64_t x;
    if (json_is_integer(v)) {
        x = json_integer_value(v);
    } else if (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)) &&
               fabs(json_real_value(v)) < 9e15) {
        x = (int64_t)json_real_value(v);
    } else {
        KVB_LOG_E("%s: field \"%s\" must be an integer", what, key);
        return KVB_ERR_INVALID;
    }
    if (x < min || x > max) {
        KVB_LOG_E("%s: field \"%s\" = %lld is out of range [%lld, %lld]", what, key, (long long)x, (long long)min,
                  (long long)max);
        return KVB_ERR_INVALID;
    }
    *out = x;
    return KVB_OK;
}

kvb_status kvb_json_get_real(const json_t *obj, const char *key, int required, double min, double max,
                             const char *what, double *out) {
    json_t *v;
    KVB_TRY(get_field(obj, key, required, what, &v));
    if (!v) return KVB_OK;
    if (!json_is_number(v)) {
        KVB_LOG_E("%s: field \"%s\" must be a number", what, key);
        return KVB_ERR_INVALID;
    }
    double x = json_number_value(v);
    if (!(x >= min && x <= max)) {
        KVB_LOG_E("%s: field \"%s\" = %g is out of range [%g, %g]", what, key, x, min, max);
        return KVB_ERR_INVALID;
    }
    *out = x;
    return KVB_OK;
}

kvb_status kvb_json_get_bool(const json_t *obj, const char *key, int required, const char *what, int *out) {
    json_t *v;
    KVB_TRY(get_field(obj, key, required, what, &v));
    if (!v) return KVB_OK;
    if (!json_is_boolean(v)) {
        KVB_LOG_E("%s: field \"%s\" must be true or false", what, key);
        return KVB_ERR_INVALID;
    }
    *out = json_is_true(v);
    return KVB_OK;
}

kvb_status kvb_json_get_str(const json_t *obj, const char *key, int required, const char *what, const char **out) {
    json_t *v;
    *out = NULL;
    KVB_TRY(get_field(obj, key, required, what, &v));
    if (!v) return KVB_OK;
    if (!json_is_string(v)) {
        KVB_LOG_E("%s: field \"%s\" must be a string", what, key);
        return KVB_ERR_INVALID;
    }
    *out = json_string_value(v);
    return KVB_OK;
}
