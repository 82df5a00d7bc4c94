/* kvbank — the budgets of the text layer: what one call on a client's text may cost. Every call that
 * tokenizes, detokenizes or renders a chat template for a request runs under these, so that no request
 * can take a thread or the process's memory for long; a call that would exceed one fails with
 * KVB_ERR_EXHAUSTED and a message naming the budget (docs/text.md lists them, with their defaults).
 *
 * The defaults are the text layer's (kvb_text_limits_default); a server sets its own on each loaded
 * tokenizer and chat template (kvb_tokenizer_set_limits, kvb_chat_template_set_limits) before it shares
 * them between threads. */
#ifndef KVB_TEXT_LIMITS_H
#define KVB_TEXT_LIMITS_H

#include <stddef.h>
#include <stdint.h>

typedef struct kvb_text_limits {
    size_t encode_bytes;   /* text one kvb_tokenizer_encode takes (bytes of UTF-8) */
    size_t decode_ids;     /* ids one kvb_tokenizer_decode takes */
    uint64_t render_steps; /* units of work one render may do: a node evaluated, a statement run, an item
                            * built, 64 bytes or 16 entries searched */
    size_t render_output;  /* bytes a render may produce; also the longest string it may build */
    size_t render_memory;  /* bytes a render may allocate (its values live until it ends) */
} kvb_text_limits;

/* The text layer's defaults: 8 MiB of text to encode, 4 Mi ids to decode, 20 M render steps, 8 MiB of
 * rendered output and 256 MiB of render memory. */
void kvb_text_limits_default(kvb_text_limits *out);

/* Nesting bounds that keep the parser's and the renderer's recursion within KVB_TEXT_STACK_BYTES of
 * stack (they are part of the template language, not per-server settings): blocks and expressions
 * nest at most KVB_JINJA_MAX_NESTING deep in a template's source, and a render's evaluations (an
 * expression inside an expression, a macro called from a macro) at most KVB_JINJA_MAX_CALL_DEPTH. */
#define KVB_JINJA_MAX_NESTING 64
#define KVB_JINJA_MAX_CALL_DEPTH 256
/* The stack a thread that parses or renders templates must have (a worker thread's size). */
#define KVB_TEXT_STACK_BYTES (1u << 20)

#endif
