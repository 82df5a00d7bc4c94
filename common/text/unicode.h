/* kvbank — the Unicode the text layer needs: UTF-8 decoding and validation, WHATWG-style lossy
 * decoding (for byte-level detokenization), and NFC normalization (Qwen2/Qwen3 tokenizers' normalizer).
 * Internal to common/text. */
#ifndef KVB_TEXT_UNICODE_H
#define KVB_TEXT_UNICODE_H

#include <stddef.h>
#include <stdint.h>

#include "common/util/status.h"

/* A growable byte buffer; `p` is owned (free()), always NUL-terminated once anything was appended. */
typedef struct kvb_buf {
    char *p;
    size_t len, cap;
} kvb_buf;

kvb_status kvb__buf_reserve(kvb_buf *b, size_t extra);
kvb_status kvb__buf_append(kvb_buf *b, const void *data, size_t n);
kvb_status kvb__buf_putc(kvb_buf *b, char c);
kvb_status kvb__buf_printf(kvb_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kvb__buf_free(kvb_buf *b);

/* Decodes one UTF-8 character at s[0..n): returns its length (1..4) and stores the code point, or 0
 * when the bytes there are not a valid, complete character (overlong forms and surrogates are invalid). */
int kvb__utf8_decode(const uint8_t *s, size_t n, uint32_t *cp);
/* Encodes `cp` (< 0x110000, not a surrogate) into out[4]; returns the length. */
int kvb__utf8_encode(uint32_t cp, uint8_t out[4]);
/* Offset of the first byte that starts an invalid sequence, or n when all of s[0..n) is valid UTF-8. */
size_t kvb__utf8_validate(const uint8_t *s, size_t n);

/* Lossy UTF-8 to valid UTF-8, as browsers' TextDecoder and Rust's from_utf8_lossy do: every maximal
 * subpart of an ill-formed sequence becomes one U+FFFD. Appends to `out` and returns how many bytes of
 * s were consumed: all of them when `final`, else all but a trailing incomplete (but so far valid)
 * sequence, which the caller keeps for the next call. */
kvb_status kvb__utf8_lossy(const uint8_t *s, size_t n, int final, kvb_buf *out, size_t *consumed);

/* NFC of valid UTF-8 s[0..n), appended to `out`. */
kvb_status kvb__nfc(const uint8_t *s, size_t n, kvb_buf *out);
/* The Unicode version of the NFC tables ("14.0.0"). */
const char *kvb__unicode_version(void);

#endif
