/* kvbank — what the files of common/text share (internal). */
#ifndef KVB_TEXT_IMPL_H
#define KVB_TEXT_IMPL_H

#include <jansson.h>

#include "common/util/status.h"

/* Loads DIR/NAME. A missing file is KVB_OK with *out = NULL when `optional`, else KVB_ERR_NOT_FOUND
 * (logged). int_as_real: integers become reals (tokenizer_config.json's model_max_length can exceed
 * 64 bits). Errors name the file, line and column. Caller json_decref's *out. */
kvb_status kvb__model_json(const char *dir, const char *name, int optional, int int_as_real, json_t **out);

#endif
