/* kvbank-gateway — the OpenAI request bodies: reading and validating them, and the error bodies.
 *
 * Pure functions over jansson values (no sockets, no models), so the unit tests cover every field.
 * Every field a request may carry is a row of one table (api.c, `gw_fields`): its name, the endpoints
 * that take it, its JSON types and what the gateway does with it:
 *   handled      read into gw_params;
 *   ignored      accepted and ignored, as vLLM does (store, metadata, user, reasoning_effort, ...): a
 *                wrong type is still refused, and the gateway logs each such field name once;
 *   unsupported  needs a feature the node does not have yet (tools, structured output, ...): its
 *                neutral value (tools: [], ...) passes since common clients send it, anything else gets
 *                a 400.
 * Supporting a field is a change of its row (a reader, a gw_params member); docs/gateway.md lists what
 * each handled field does. A request is validated
 * completely before anything is sent to a model: a wrong type, a value out of range, a field no row
 * names or an unsupported value gets a 400 whose OpenAI-shaped body names the field (`param`). */
#ifndef KVB_GATEWAY_API_H
#define KVB_GATEWAY_API_H

#include <jansson.h>
#include <stdint.h>

#include "common/text/grammar.h"
#include "common/sched/sampling.h"
#include "common/util/util.h"

#define GW_MAX_STOP 16        /* stop strings per request */
#define GW_MAX_CHOICES 128    /* sequences one request generates: prompts x max(n, best_of) (OpenAI's n <= 128) */
#define GW_MAX_STOP_LEN 256   /* bytes per stop string */
#define GW_MAX_STOP_IDS 64    /* stop_token_ids per request */
#define GW_MAX_TOOLS 128      /* tools per request (OpenAI's limit) */
#define GW_MAX_GRAMMAR_PARTS 3 /* a forced tool call: prefix, schema, suffix */

/* gw_params.tool_choice */
typedef enum gw_tool_choice {
    GW_TOOL_NONE = 0,         /* no call: tools (if any) are only shown to the template */
    GW_TOOL_AUTO = 1,         /* the model decides; what it writes in its call format is parsed */
    GW_TOOL_REQUIRED = 2,     /* one call of any tool, forced by a grammar */
    GW_TOOL_NAMED = 3,        /* one call of tool_name, forced by a grammar */
} gw_tool_choice;

/* gw_params.grammar_flags (the same bits as kvb_request.grammar_flags) */
#define GW_GRAMMAR_LAX 1u     /* json_schema strict false: objects allow keys the schema does not name */
#define GW_GRAMMAR_COMPACT 2u /* structured_outputs.disable_any_whitespace: no whitespace in JSON */

typedef enum gw_endpoint {
    GW_COMPLETIONS = 0,       /* POST /v1/completions */
    GW_CHAT = 1,              /* POST /v1/chat/completions */
} gw_endpoint;

typedef enum gw_field_kind {
    GW_FIELD_HANDLED = 0,     /* read into gw_params */
    GW_FIELD_IGNORED = 1,     /* accepted (its type checked) and ignored */
    GW_FIELD_UNSUPPORTED = 2, /* only its neutral value passes */
} gw_field_kind;

/* JSON types of a field (a mask); null always means "not given". */
enum {
    GW_J_BOOL = 1 << 0,
    GW_J_INT = 1 << 1,        /* an integer (4.0 counts) */
    GW_J_NUM = 1 << 2,        /* any finite number */
    GW_J_STR = 1 << 3,
    GW_J_OBJ = 1 << 4,
    GW_J_ARR = 1 << 5,
};

#define GW_EP_COMPLETIONS (1u << GW_COMPLETIONS)
#define GW_EP_CHAT (1u << GW_CHAT)
#define GW_EP_BOTH (GW_EP_COMPLETIONS | GW_EP_CHAT)

typedef struct gw_params gw_params;
typedef struct gw_error gw_error;

/* One row of the field table. */
typedef struct gw_field {
    const char *name;
    unsigned eps;             /* GW_EP_*: the endpoints that take it */
    gw_field_kind kind;
    unsigned types;           /* GW_J_* the value may have (handled rows: what `read` takes) */
    /* handled: checks `v` (not null) and stores it into p; fills err and fails otherwise */
    kvb_status (*read)(json_t *v, const char *name, gw_params *p, gw_error *err);
    /* unsupported: 1 when `v` (not null, of the right type) asks for nothing; NULL: only null */
    int (*neutral)(json_t *v);
} gw_field;

/* The table: *n rows; a name may have one row per endpoint (logprobs: a boolean in chat, an integer
 * in completions). Static, never freed. */
const gw_field *gw_fields(int *n);
#define GW_MAX_IGNORED 32     /* ignored fields one request reports (gw_params.ignored): at least the ignored rows */

/* One prompt: text or token ids (chat: the rendered messages' ids). */
typedef struct gw_prompt {
    const char *text;         /* borrowed, or NULL for ids */
    size_t len;
    int32_t *ids;             /* [n_ids] owned (gw_params_free): given, or the tokenizer's */
    int n_ids;
} gw_prompt;

/* A validated request. Pointers borrow from the JSON document it was read from. */
struct gw_params {
    gw_endpoint ep;
    const char *model;
    /* completions: the prompts (a string, token ids, or a list of either); chat: one, from messages */
    gw_prompt *prompts;       /* [n_prompts] owned */
    int n_prompts;
    /* chat */
    json_t *messages;         /* borrowed array of {role, content} objects */
    json_t *template_kwargs;  /* chat_template_kwargs (borrowed object) or NULL */
    int add_generation_prompt;/* default 1 */
    int max_tokens;           /* 0: not given (the gateway picks the default) */
    int echo_only;            /* completions: max_tokens 0 with echo (vLLM): the prompt and its logprobs only */
    double temperature;       /* default 1 */
    double top_p;             /* default 1 */
    int top_k;                /* 0: off (-1 is accepted as off too) */
    int has_seed;
    uint64_t seed;
    const char *stop[GW_MAX_STOP];  /* borrowed strings */
    size_t stop_len[GW_MAX_STOP];
    int n_stop;
    int32_t stop_ids[GW_MAX_STOP_IDS]; /* stop_token_ids (vLLM) */
    int n_stop_ids;
    int ignore_eos;
    int stream;
    int include_usage;        /* stream_options.include_usage */
    int return_token_ids;     /* vLLM: choices carry token_ids (and the response prompt_token_ids) */
    int skip_special_tokens;  /* default 1 */
    int add_special_tokens;   /* default 1 for completions, 0 for chat */
    double tbt_slo_ms;        /* kvbank_tbt_slo_ms: Token-Deposit target; < 0: not given */
    int timings;              /* kvbank_timings: the response carries every token's generation, arrival
                               * and delivery time */
    int include_stop_str;     /* include_stop_str_in_output (vLLM): the stop string ends the text */
    /* ---- structured output and tools (docs/gateway.md "Structured output and tool calling") */
    kvb_grammar_part grammar[GW_MAX_GRAMMAR_PARTS]; /* the grammar the output must match: response_format,
                               * guided_json / _regex / _choice, structured_outputs (texts owned) */
    int n_grammar;
    unsigned grammar_flags;   /* GW_GRAMMAR_* */
    const char *grammar_field;/* the field that asked for it ("response_format", ...; borrowed from the
                               * request's JSON like the other names), NULL: none */
    char *grammar_text;       /* owned text of grammar[0] (a schema dumped compact) */
    const char **grammar_choices; /* owned array of borrowed strings (guided_choice) */
    json_t *tools;            /* borrowed, validated array of {type: function, function: {name, ...}}; NULL: none */
    int tool_choice;          /* gw_tool_choice (default AUTO with tools, NONE without) */
    const char *tool_name;    /* GW_TOOL_NAMED: the function (borrowed) */
    int parallel_tool_calls;  /* default 1 */
    int has_tool_messages;    /* messages carry assistant tool_calls (their arguments are parsed for the template) */
    /* sampling beyond temperature / top_p / top_k (vLLM's SamplingParams, OpenAI's penalties) */
    double min_p, presence_penalty, frequency_penalty;
    double repetition_penalty;  /* default 1 (off) */
    int min_tokens;
    kvb_logit_bias *logit_bias; /* [n_logit_bias] owned; ids checked against the model's vocabulary at submit */
    int n_logit_bias;
    /* outputs */
    int logprobs;             /* the tokens' logprobs (completions: `logprobs` given; chat: logprobs true) */
    int top_logprobs;         /* alternatives per token (completions: logprobs' value; chat: top_logprobs) */
    int has_top_logprobs;     /* chat: top_logprobs was given (it needs logprobs true) */
    int echo;                 /* completions: the prompt starts the text (and its logprobs the logprobs);
                               * chat (vLLM): the last message's content starts the reply when it has the
                               * reply's role */
    int n;                    /* choices per prompt (default 1) */
    int best_of;              /* sequences generated per prompt, the n of highest cumulative logprob
                               * returned (default n) */
    int return_tokens_as_ids; /* logprobs name tokens "token_id:N" (vLLM's return_tokens_as_token_ids) */
    /* ignored fields the request had: indices into gw_fields() [n_ignored] (the gateway logs them) */
    short ignored[GW_MAX_IGNORED];
    int n_ignored;
};

/* An error to return: HTTP status, OpenAI error type, the field it is about ("" for none), message. */
struct gw_error {
    int status;
    const char *type;         /* "invalid_request_error", "not_found_error", "server_error", ... */
    char param[64];
    char message[512];
    const char *code;         /* OpenAI's "code" ("invalid_api_key"), or NULL (null) */
    int retry_after_s;        /* > 0: the response says Retry-After (a 503 for capacity that may come back) */
};

void gw_error_set(gw_error *e, int status, const char *type, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
/* `s` cut to at most n - 4 bytes on a UTF-8 character boundary, "..." added when cut, into buf[n];
 * returns buf. For names a client sent that an error message repeats. */
const char *gw_clip(const char *s, char *buf, size_t n);
/* The OpenAI error body {"error": {"message", "type", "param", "code"}}; caller frees. */
char *gw_error_body(const gw_error *e, size_t *len);

/* Parses and validates a request body of endpoint `ep`. On failure fills *err (400, or 413 for a
 * body with more than `max_prompt_ids` prompt ids) and returns an error; `*p` is then freed. On
 * success *doc owns the JSON that p borrows from: free with gw_params_free then json_decref(*doc). */
kvb_status gw_params_parse(gw_endpoint ep, const char *body, size_t len, gw_params *p, json_t **doc, gw_error *err);
void gw_params_free(gw_params *p);

/* POST /tokenize and /detokenize bodies (vLLM). */
typedef struct gw_tok_params {
    const char *model;
    const char *prompt;       /* tokenize: text (or NULL with messages) */
    size_t prompt_len;
    json_t *messages;         /* tokenize: chat messages (rendered with the template) */
    int add_special_tokens;   /* default 1 (0 with messages) */
    int add_generation_prompt;/* messages: default 1 */
    int32_t *ids;             /* detokenize: [n_ids], owned */
    int n_ids;
} gw_tok_params;
kvb_status gw_tok_params_parse(int detokenize, const char *body, size_t len, gw_tok_params *p, json_t **doc,
                               gw_error *err);
void gw_tok_params_free(gw_tok_params *p);

#endif
