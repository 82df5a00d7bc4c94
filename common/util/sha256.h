/* kvbank — SHA-256 (FIPS 180-4) and HMAC-SHA-256 (RFC 2104), for the node's per-model tokens
 * (common/ipc/auth.h): the stack has no crypto library, and this is all the node needs. */
#ifndef KVB_UTIL_SHA256_H
#define KVB_UTIL_SHA256_H

#include <stddef.h>
#include <stdint.h>

#define KVB_SHA256_BYTES 32

typedef struct kvb_sha256 {
    uint32_t h[8];     /* the chaining state */
    uint8_t buf[64];   /* a partial block ([n_buf] valid) */
    size_t n_buf;
    uint64_t n_bytes;  /* hashed so far */
} kvb_sha256;

void kvb_sha256_init(kvb_sha256 *s);
void kvb_sha256_update(kvb_sha256 *s, const void *data, size_t len);
void kvb_sha256_final(kvb_sha256 *s, uint8_t out[KVB_SHA256_BYTES]);
/* One call: out = SHA-256(data). */
void kvb_sha256_digest(const void *data, size_t len, uint8_t out[KVB_SHA256_BYTES]);
/* out = HMAC-SHA-256(key, msg). */
void kvb_hmac_sha256(const void *key, size_t key_len, const void *msg, size_t msg_len, uint8_t out[KVB_SHA256_BYTES]);
/* Lower-case hex of `n` bytes into out[2n + 1]. */
void kvb_hex(const uint8_t *b, size_t n, char *out);
/* Compares `n` bytes in time independent of where they differ: 0 when equal. */
int kvb_memcmp_ct(const void *a, const void *b, size_t n);

#endif
