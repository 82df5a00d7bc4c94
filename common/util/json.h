/* kvbank — JSON helpers over jansson with errors that name the file and the field. */
#ifndef KVB_UTIL_JSON_H
#define KVB_UTIL_JSON_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "common/util/util.h"

/* Parses `path` into a new reference (caller json_decref's it). KVB_ERR_NOT_FOUND / KVB_ERR_IO /
 * KVB_ERR_FORMAT with the parse position logged. */
kvb_status kvb_json_load_file(const char *path, json_t **out);
/* The same with jansson's decoding flags (kvb_json_load_file: JSON_REJECT_DUPLICATES). The file must be
 * a regular file (kvb_open_regular): a FIFO at the path is refused instead of blocking; files above
 * KVB_JSON_MAX_FILE are refused (the largest real tokenizer.json files are tens of MB). */
#define KVB_JSON_MAX_FILE (1u << 30)
kvb_status kvb_json_load_file_flags(const char *path, size_t flags, json_t **out);
kvb_status kvb_json_load_text(const char *text, size_t len, const char *what, json_t **out);

/* Reads an integer field `key` of `obj` into *out, which must lie in [min, max]. If the field is absent
 * and `required` is 0, *out is left untouched and KVB_OK returned. `what` names the document in errors. */
kvb_status kvb_json_get_int(const json_t *obj, const char *key, int required, int64_t min, int64_t max,
                            const char *what, int64_t *out);
kvb_status kvb_json_get_real(const json_t *obj, const char *key, int required, double min, double max,
                             const char *what, double *out);
kvb_status kvb_json_get_bool(const json_t *obj, const char *key, int required, const char *what, int *out);
/* Borrowed string (valid while obj lives), or NULL when absent and not required. */
kvb_status kvb_json_get_str(const json_t *obj, const char *key, int required, const char *what, const char **out);

#endif
