/* kvbank — text in and out of a model: the tokenizer of a Hugging Face model directory.
 *
 * BPE as in tokenizer.json, byte-level (Llama-3, Qwen2/Qwen3, GPT-2 style) or SentencePiece style
 * with byte fallback (Llama-2, Mistral; docs/text.md): added and special tokens are split off first,
 * the rest is normalized (NFC; Prepend and Replace), split by the pre-tokenizer (regexes on PCRE2, or
 * Metaspace), turned into first symbols (bytes through the byte-level map; characters, or <0xNN>
 * tokens for those the vocabulary lacks) and merged by rank. Decoding turns tokens back into bytes,
 * replaces ill-formed UTF-8 with U+FFFD and strips what a Strip decoder strips from the start. Anything
 * in the files that kvbank does not implement is refused at load with an error naming the file and
 * the field.
 *
 * A loaded tokenizer is immutable and may be used from several threads at once (its word cache has
 * its own lock). */
#ifndef KVB_TEXT_TOKENIZER_H
#define KVB_TEXT_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "common/text/limits.h"
#include "common/util/status.h"

typedef struct kvb_tokenizer kvb_tokenizer;

/* Loads tokenizer.json (+ tokenizer_config.json, generation_config.json, config.json for EOS/BOS) of
 * a Hugging Face model directory. Caller owns *out (kvb_tokenizer_destroy). KVB_ERR_NOT_FOUND when
 * the directory has no tokenizer.json; KVB_ERR_UNSUPPORTED / KVB_ERR_FORMAT with the file and field
 * logged for anything else (an id beyond the vocabulary: ids must lie below the number of tokens
 * tokenizer.json defines, or below config.json's vocab_size when that is larger). */
kvb_status kvb_tokenizer_load(const char *model_dir, kvb_tokenizer **out);
void kvb_tokenizer_destroy(kvb_tokenizer *t);

/* Sets the budgets encode and decode run under (limits.h; the load sets the defaults): text longer than
 * l->encode_bytes, or more than l->decode_ids ids, is KVB_ERR_EXHAUSTED (logged). Not while other
 * threads use t. */
void kvb_tokenizer_set_limits(kvb_tokenizer *t, const kvb_text_limits *l);

/* One more than the largest token id (vocabulary and added tokens). */
int kvb_tokenizer_vocab_size(const kvb_tokenizer *t);

/* text[0..len) (UTF-8; KVB_ERR_INVALID if it is not; KVB_ERR_EXHAUSTED above the encode budget) -> token ids. Special tokens written in the text
 * are recognised as special tokens (as Hugging Face does by default). add_special: add what the
 * tokenizer's post-processor adds (Llama-3's BOS) or, without one, what tokenizer_config.json's
 * add_bos_token / add_eos_token ask for. A rendered chat template already holds its BOS: encode it
 * with add_special = 0. Caller frees *ids (NULL when *n is 0). */
kvb_status kvb_tokenizer_encode(const kvb_tokenizer *t, const char *text, size_t len, int add_special, int32_t **ids,
                                int *n);

/* ids -> text. Caller frees *out (NUL-terminated; *len without the NUL). skip_special drops special
 * tokens. More ids than the decode budget: KVB_ERR_EXHAUSTED. Ids outside [0, vocab_size) or unassigned give KVB_ERR_INVALID. No clean-up of spaces is
 * applied (clean_up_tokenization_spaces is ignored: decoding stays lossless, as streamed text must). */
kvb_status kvb_tokenizer_decode(const kvb_tokenizer *t, const int32_t *ids, int n, int skip_special, char **out,
                                size_t *len);

/* The EOS ids (generation_config.json eos_token_id, int or list; else config.json's; else
 * tokenizer_config.json's eos_token). *ids is borrowed from t; returns how many (0: none known). */
int kvb_tokenizer_eos_ids(const kvb_tokenizer *t, const int32_t **ids);

/* The BOS id, or -1 when the tokenizer has none. */
int32_t kvb_tokenizer_bos_id(const kvb_tokenizer *t);

/* "bos_token" | "eos_token" | "pad_token" | "unk_token" as tokenizer_config.json names them (the text of
 * the token), or NULL. Borrowed from t. */
const char *kvb_tokenizer_token_str(const kvb_tokenizer *t, const char *which);

/* The id of a token written as text (a vocabulary entry in its byte-level form, or an added token's
 * content), or -1. */
int32_t kvb_tokenizer_token_id(const kvb_tokenizer *t, const char *token);

/* 1 when `id` is a special token (added with "special": true). */
int kvb_tokenizer_is_special(const kvb_tokenizer *t, int32_t id);

/* The bytes token `id` decodes to (a byte-level token's characters mapped back; a SentencePiece-style
 * token's text after the decoder's Replace steps, "▁" a space, or the byte of a <0xNN> token; an added
 * token's content), borrowed from t; NULL with *len 0 for an id without a token. Unlike a decode, a
 * token holding part of a UTF-8 character gives its raw bytes (grammars match tokens byte by byte). */
const char *kvb_tokenizer_token_bytes(const kvb_tokenizer *t, int32_t id, size_t *len);

/* Incremental detokenization for streaming: push one id, get the newly completed text (never half a
 * UTF-8 character); the concatenation of all outputs + flush equals kvb_tokenizer_decode of all ids
 * (with the same skip_special). The detokenizer borrows t. */
typedef struct kvb_detok kvb_detok;
kvb_status kvb_detok_create(const kvb_tokenizer *t, int skip_special, kvb_detok **out);
/* *text is valid until the next call on d (not NUL-terminated; *len may be 0). */
kvb_status kvb_detok_push(kvb_detok *d, int32_t id, const char **text, size_t *len);
/* The rest (an incomplete UTF-8 tail becomes U+FFFD); the detokenizer is then empty and reusable. */
kvb_status kvb_detok_flush(kvb_detok *d, const char **text, size_t *len);
void kvb_detok_destroy(kvb_detok *d);

#endif
