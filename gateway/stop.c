/* kvbank-gateway — stop strings across token boundaries (see stop.h). */
#include "gateway/stop.h"

#include <stdlib.h>
#include <string.h>

struct gw_stop {
    char **s;        /* [n] the stop strings */
    size_t *len;     /* [n] */
    int n;
    size_t max_len;  /* longest stop string */
    char *held;      /* text not yet released: a proper prefix of some stop string, [n_held] */
    size_t n_held, cap_held;
    int stopped;
    int include;     /* the stop string found is part of the output */
};

kvb_status gw_buf_append(char **buf, size_t *len, size_t *cap, const char *data, size_t n) {
    if (!n) return KVB_OK;
    if (*len + n + 1 > *cap) {
        size_t c = *cap ? *cap : 64;
        while (c < *len + n + 1) c *= 2;
        char *b = realloc(*buf, c);
        if (!b) return KVB_ERR_NOMEM;
        *buf = b;
        *cap = c;
    }
    memcpy(*buf + *len, data, n);
    *len += n;
    (*buf)[*len] = '\0';
    return KVB_OK;
}

kvb_status gw_stop_create(const char *const *stops, const size_t *len, int n, int include, gw_stop **out) {
    if (n < 0 || (n && (!stops || !len)) || !out) return KVB_ERR_INVALID;
    gw_stop *s = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *s, (void **)&s));
    s->include = include;
    kvb_status st = KVB_OK;
    if (n) {
        KVB_TRY_GOTO(kvb_calloc((size_t)n, sizeof *s->s, (void **)&s->s), fail);
        KVB_TRY_GOTO(kvb_calloc((size_t)n, sizeof *s->len, (void **)&s->len), fail);
    }
    for (int i = 0; i < n; i++) {
        if (!len[i]) {
            st = KVB_ERR_INVALID;
            goto fail;
        }
        KVB_TRY_GOTO(kvb_malloc(len[i], (void **)&s->s[i]), fail);
        memcpy(s->s[i], stops[i], len[i]);
        s->len[i] = len[i];
        s->n = i + 1;
        if (len[i] > s->max_len) s->max_len = len[i];
    }
    *out = s;
    return KVB_OK;
fail:
    gw_stop_destroy(s);
    return st;
}

void gw_stop_destroy(gw_stop *s) {
    if (!s) return;
    for (int i = 0; i < s->n; i++) free(s->s[i]);
    free(s->s);
    free(s->len);
    free(s->held);
    free(s);
}

/* Length of the longest tail of t[0..n) that is a proper prefix of some stop string. */
static size_t held_tail(const gw_stop *s, const char *t, size_t n) {
    size_t best = 0;
    for (int i = 0; i < s->n; i++) {
        size_t k = KVB_MIN(n, s->len[i] - 1);
        for (; k > best; k--)
            if (!memcmp(t + n - k, s->s[i], k)) {
                best = k;
                break;
            }
    }
    return best;
}

int gw_stop_push(gw_stop *s, const char *piece, size_t len, char **out, size_t *out_len, size_t *out_cap, int *which) {
    if (s->stopped) return 1;
    if (gw_buf_append(&s->held, &s->n_held, &s->cap_held, piece, len) != KVB_OK) return -1;
    if (!s->held) return 0; /* nothing held and nothing new */
    /* The earliest occurrence of any stop string (ties: the longest). A match cannot start in text
     * released before: that text had no tail in common with a stop string's start. */
    size_t best_pos = SIZE_MAX;
    int best = -1;
    for (int i = 0; i < s->n; i++) {
        const char *p = memmem(s->held, s->n_held, s->s[i], s->len[i]);
        if (!p) continue;
        size_t pos = (size_t)(p - s->held);
        if (pos < best_pos || (pos == best_pos && s->len[i] > s->len[best])) {
            best_pos = pos;
            best = i;
        }
    }
    if (best >= 0) {
        size_t upto = best_pos + (s->include ? s->len[best] : 0);
        if (gw_buf_append(out, out_len, out_cap, s->held, upto) != KVB_OK) return -1;
        s->n_held = 0;
        s->stopped = 1;
        if (which) *which = best;
        return 1;
    }
    size_t keep = held_tail(s, s->held, s->n_held);
    size_t rel = s->n_held - keep;
    if (gw_buf_append(out, out_len, out_cap, s->held, rel) != KVB_OK) return -1;
    memmove(s->held, s->held + rel, keep);
    s->n_held = keep;
    return 0;
}

kvb_status gw_stop_flush(gw_stop *s, char **out, size_t *out_len, size_t *out_cap) {
    if (s->stopped || !s->n_held) return KVB_OK;
    KVB_TRY(gw_buf_append(out, out_len, out_cap, s->held, s->n_held));
    s->n_held = 0;
    return KVB_OK;
}
