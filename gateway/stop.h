/* kvbank-gateway — stop strings matched on the detokenized text across token boundaries.
 *
 * Text arrives in pieces (one per token, from the incremental detokenizer). The matcher releases
 * text only once no stop string can begin inside it: it holds back the longest tail of the text seen
 * so far that is a proper prefix of a stop string. When a stop string appears, the text before it is
 * released, the stop string and everything after it are dropped (OpenAI's behaviour: the stop
 * sequence is not part of the output; vLLM's include_stop_str_in_output keeps the stop string), and the matcher reports the stop. At the natural end of a
 * request the held-back tail is released (kvb_stop_flush). A held-back tail starts with a stop
 * string's first byte, so released text always ends on a UTF-8 character boundary. */
#ifndef KVB_GATEWAY_STOP_H
#define KVB_GATEWAY_STOP_H

#include <stddef.h>

#include "common/util/util.h"

typedef struct gw_stop gw_stop;

/* Borrows nothing: the `n` strings (lengths len[i] > 0) are copied. `include`: the stop string found
 * is released too, as the text's end (vLLM's include_stop_str_in_output). Caller owns the result. */
kvb_status gw_stop_create(const char *const *stops, const size_t *len, int n, int include, gw_stop **out);
void gw_stop_destroy(gw_stop *s);

/* Feeds `piece`; appends the text now safe to release to `out` (a growing buffer owned by the caller:
 * *out / *out_len / *out_cap, realloc'd here). Returns 1 when a stop string was found (the output is
 * complete; later pieces are ignored), 0 otherwise; < 0 on allocation failure. `which` (may be NULL)
 * gets the index of the stop string found. */
int gw_stop_push(gw_stop *s, const char *piece, size_t len, char **out, size_t *out_len, size_t *out_cap, int *which);
/* End of the request without a stop: releases the held-back tail. */
kvb_status gw_stop_flush(gw_stop *s, char **out, size_t *out_len, size_t *out_cap);

/* Appends `len` bytes to a growing buffer (doubling). */
kvb_status gw_buf_append(char **buf, size_t *len, size_t *cap, const char *data, size_t n);

#endif
