/* kvbank-gateway — tool calling: which format a model writes its tool calls in, the grammar of a forced
 * call, and the parsers that turn the model's text back into OpenAI `tool_calls`.
 *
 * A model writes tool calls in the format its chat template teaches it (and renders an assistant's
 * earlier calls in). The gateway finds that format by rendering a probe conversation, an assistant
 * message with one tool call, through the model's own template and looking at what came out
 * (gw_tool_format_detect); a template that renders nothing recognisable falls back on the marker tokens
 * of the tokenizer. One parser per format:
 *   llama3   Llama 3.1 / 3.2: the whole output is {"name": "f", "parameters": {...}} (optionally after
 *            <|python_tag|>), several separated by ';'
 *   hermes   Qwen2.5 / Qwen3: <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>, repeated,
 *            after optional content
 *   mistral  Mistral v0.3: [TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...] after optional content
 * A parser is incremental (a stream's text arrives in pieces) and emits content, the start of a call
 * (its name) and pieces of a call's arguments, in order. In `whole` mode (a response that is not
 * streamed) a call is emitted only once it is complete and parses as JSON; anything that does not
 * parse stays content. */
#ifndef KVB_GATEWAY_TOOLS_H
#define KVB_GATEWAY_TOOLS_H

#include <jansson.h>
#include <stddef.h>

#include "common/text/chat.h"
#include "common/text/grammar.h"
#include "common/text/tokenizer.h"
#include "common/util/util.h"

typedef enum gw_tool_format {
    GW_TOOLS_NONE = 0,    /* the template renders no tool call this gateway knows */
    GW_TOOLS_LLAMA3 = 1,
    GW_TOOLS_HERMES = 2,
    GW_TOOLS_MISTRAL = 3,
} gw_tool_format;

const char *gw_tool_format_name(gw_tool_format f);
/* The format `t` renders an assistant's tool call in (NULL t: none), else the one whose marker token
 * `tok` has (may be NULL). */
gw_tool_format gw_tool_format_detect(const kvb_chat_template *t, const kvb_tokenizer *tok);
/* The token that starts a call in format f ("<|python_tag|>", "<tool_call>", "[TOOL_CALLS]"). */
const char *gw_tool_format_marker(gw_tool_format f);

/* The grammar of a forced call in format f: the function `name` of `tools` (tool_choice naming it), or
 * any one of them (name NULL: "required", an anyOf over the functions); Mistral writes a list, of one
 * call or (parallel) of one or more. The arguments fit the function's `parameters` schema. */
#define GW_TOOL_GRAMMAR_PARTS 3
typedef struct gw_tool_grammar {
    kvb_grammar_part parts[GW_TOOL_GRAMMAR_PARTS];
    int n_parts;
    char *owned[GW_TOOL_GRAMMAR_PARTS]; /* the texts, freed by gw_tool_grammar_free */
} gw_tool_grammar;
kvb_status gw_tool_grammar_build(gw_tool_format f, const json_t *tools, const char *name, int parallel,
                                 gw_tool_grammar *out, char *err, size_t err_len);
void gw_tool_grammar_free(gw_tool_grammar *g);

/* What a parser emits. */
typedef enum gw_tool_ev_kind {
    GW_TOOL_EV_CONTENT = 0, /* text: content */
    GW_TOOL_EV_CALL = 1,    /* call `index` begins: text is its function name */
    GW_TOOL_EV_ARGS = 2,    /* text: the next piece of call `index`'s arguments (JSON text) */
} gw_tool_ev_kind;
typedef void (*gw_tool_emit_fn)(void *ud, gw_tool_ev_kind kind, int index, const char *text, size_t len);

typedef struct gw_tool_parser gw_tool_parser;
/* `whole`: calls only once complete and valid (a response that is not streamed); `parallel` 0: calls
 * after the first are dropped (parallel_tool_calls false). Caller owns *out. */
kvb_status gw_tool_parser_create(gw_tool_format f, int whole, int parallel, gw_tool_parser **out);
void gw_tool_parser_destroy(gw_tool_parser *p);
/* Feeds the next piece of the model's text; emits what is decided. KVB_ERR_NOMEM. */
kvb_status gw_tool_parser_push(gw_tool_parser *p, const char *text, size_t len, gw_tool_emit_fn emit, void *ud);
/* The text ended: emits what was held back (a call left incomplete stays content, unless streaming
 * already began it). */
kvb_status gw_tool_parser_finish(gw_tool_parser *p, gw_tool_emit_fn emit, void *ud);
/* Calls emitted so far. */
int gw_tool_parser_n_calls(const gw_tool_parser *p);

#endif
