/* kvbank — a Jinja subset interpreter for chat templates (internal to common/text; chat.h is the
 * public face). The subset is what real chat templates use (docs/design.md lists it); templates are
 * rendered as transformers' apply_chat_template renders them: trim_blocks and lstrip_blocks on, a
 * trailing newline of the source dropped, `tojson` as json.dumps(ensure_ascii=False), and
 * raise_exception / namespace / range / strftime_now as globals. */
#ifndef KVB_TEXT_JINJA_H
#define KVB_TEXT_JINJA_H

#include <jansson.h>
#include <stddef.h>

#include "common/text/limits.h"
#include "common/util/status.h"

typedef struct kvb_jinja kvb_jinja;

/* Parses src[0..len). KVB_ERR_FORMAT (a syntax error) or KVB_ERR_UNSUPPORTED (a construct outside
 * the subset, or blocks and expressions nested deeper than KVB_JINJA_MAX_NESTING) with "line L,
 * column C: what" in err. Caller owns *out. */
kvb_status kvb_jinja_parse(const char *src, size_t len, kvb_jinja **out, char *err, size_t err_len);
void kvb_jinja_destroy(kvb_jinja *j);

/* Renders with the variables of the JSON object `vars` under the budgets `lim` (NULL: the defaults).
 * KVB_ERR_INVALID for raise_exception (its message in err) and for run-time errors (a type error, an
 * undefined attribute; with the line and column); KVB_ERR_EXHAUSTED when a budget is spent (steps,
 * output bytes, memory, or recursion deeper than KVB_JINJA_MAX_CALL_DEPTH). Caller frees *out
 * (NUL-terminated, *len without the NUL). */
kvb_status kvb_jinja_render(const kvb_jinja *j, const json_t *vars, const kvb_text_limits *lim, char **out,
                            size_t *len, char *err, size_t err_len);

#endif
