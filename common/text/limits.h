/* kvbank — the budgets of the text layer: what one call on a client's text may cost. Every call that
 * tokenizes, detokenizes or renders a chat template for a request runs under these, so that no request
 * can take a thread or the process's memory for long; a call that would exceed one fails with
 * KVB_ERR_EXHAUSTED and a message naming the budget (docs/text.md lists them, with their defaults).
 *
 * The defaults are the text layer's (kvb_text_limits_default); a server sets its own on each loaded
 * tokenizer (kvb_tokenizer_set_limits) before it shares it between threads. */
#ifndef KVB_TEXT_LIMITS_H
#define KVB_TEXT_LIMITS_H

#include <stddef.h>
#include <stdint.h>

typedef struct kvb_text_limits {
    size_t encode_bytes;   /* text one kvb_tokenizer_encode takes (bytes of UTF-8) */
    size_t decode_ids;     /* ids one kvb_tokenizer_decode takes */
} kvb_text_limits;

/* The text layer's defaults: 8 MiB of text to encode, 4 Mi ids to decode. */
void kvb_text_limits_default(kvb_text_limits *out);

#endif
