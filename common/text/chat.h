/* kvbank — chat templates: a model's chat_template rendered over OpenAI-style messages.
 * The template language is a Jinja subset interpreted by kvbank itself (docs/design.md lists it). */
#ifndef KVB_TEXT_CHAT_H
#define KVB_TEXT_CHAT_H

#include <jansson.h>
#include <stddef.h>

#include "common/text/limits.h"
#include "common/util/status.h"

typedef struct kvb_chat_template kvb_chat_template;

/* The model's chat template: chat_template.jinja, else tokenizer_config.json's "chat_template" (a
 * string, or a list of {"name", "template"} from which "default" is taken), parsed once. bos_token and
 * eos_token come from tokenizer_config.json. KVB_ERR_NOT_FOUND when the model has none;
 * KVB_ERR_FORMAT / KVB_ERR_UNSUPPORTED (logged, with line and column) when it does not parse.
 * Caller owns *out. Immutable once loaded: renders may run concurrently. */
kvb_status kvb_chat_template_load(const char *model_dir, kvb_chat_template **out);
/* The same, with why the template cannot be used in why[why_len] (the file and the parser's message,
 * e.g. "chat_template.jinja: chat template line 3, column 7: ..."; empty for KVB_ERR_NOT_FOUND and OK):
 * what a server without chat for this model tells its clients. */
kvb_status kvb_chat_template_load_why(const char *model_dir, kvb_chat_template **out, char *why, size_t why_len);
/* The same from template source text (bos/eos may be NULL). */
kvb_status kvb_chat_template_parse(const char *source, const char *bos_token, const char *eos_token,
                                   kvb_chat_template **out, char *err, size_t err_len);
void kvb_chat_template_destroy(kvb_chat_template *t);

/* Sets the budgets every render of t runs under (limits.h; parse and load set the defaults). Not while
 * other threads render with t. */
void kvb_chat_template_set_limits(kvb_chat_template *t, const kvb_text_limits *l);

/* Renders `messages` (a jansson array of {role, content, ...}; a content given as OpenAI text parts
 * [{"type": "text", "text": ...}] is joined with "\n" first, other part types are KVB_ERR_INVALID)
 * with add_generation_prompt, bos_token,
 * eos_token and the variables of `extra` (a JSON object such as {"enable_thinking": false, "tools":
 * [...]}; may be NULL; its keys override the others). raise_exception in the template -> KVB_ERR_INVALID
 * with its message in err; other template errors -> KVB_ERR_INVALID with line and column in err; a
 * budget spent (kvb_chat_template_set_limits) -> KVB_ERR_EXHAUSTED naming it in err.
 * Caller frees *out (NUL-terminated). */
kvb_status kvb_chat_render(const kvb_chat_template *t, const json_t *messages, int add_generation_prompt,
                           const json_t *extra, char **out, char *err, size_t err_len);

#endif
