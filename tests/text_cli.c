/* text_cli — drives the text layer for the oracle test (tests/test_text_oracle.sh); not installed.
 *
 *   text_cli encode MODEL_DIR < corpus.json        corpus: a JSON array of strings. Prints a JSON array
 *                                                  with, per string, {"ids": [...], "decoded": "...",
 *                                                  "decoded_skip": "...", "stream_ok": true|false}
 *   text_cli render MODEL_DIR < conversations.json  conversations: [{"messages": [...],
 *                                                  "add_generation_prompt": b, "extra": {...}}, ...].
 *                                                  Prints [{"text": "..."} | {"error": "..."}, ...]
 *   text_cli decode MODEL_DIR < [[ids...], ...]    per list: {"text": decode skipping special tokens,
 *                                                  "text_all": decode with them, "stream_ok": ...}
 *   text_cli speed MODEL_DIR FILE [REPEATS]        encode FILE's text, print tokens/s (cold, then warm cache) */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/text/chat.h"
#include "common/text/tokenizer.h"
#include "common/util/util.h"

static json_t *read_stdin(void) {
    json_error_t err;
    json_t *j = json_loadf(stdin, 0, &err);
    if (!j) fprintf(stderr, "text_cli: stdin: %s (line %d)\n", err.text, err.line);
    return j;
}

/* Streams ids through a detokenizer and checks the pieces join to `want`. */
static int stream_matches(const kvb_tokenizer *t, const int32_t *ids, int n, int skip, const char *want, size_t wlen) {
    kvb_detok *d;
    if (kvb_detok_create(t, skip, &d) != KVB_OK) return 0;
    char *acc = malloc(wlen * 2 + 64);
    size_t alen = 0, cap = wlen * 2 + 64;
    int ok = 1;
    for (int i = 0; i <= n && ok; i++) {
        const char *p;
        size_t l;
        if ((i < n ? kvb_detok_push(d, ids[i], &p, &l) : kvb_detok_flush(d, &p, &l)) != KVB_OK) ok = 0;
        else if (alen + l > cap) ok = 0;
        else {
            memcpy(acc + alen, p, l);
            alen += l;
        }
    }
    ok = ok && alen == wlen && !memcmp(acc, want, wlen);
    free(acc);
    kvb_detok_destroy(d);
    return ok;
}

/* {key_all: decode with special tokens, key_skip: without, "stream_ok": both streams join to them},
 * or NULL when a decode fails. */
static json_t *decode_both(const kvb_tokenizer *t, const int32_t *ids, int n, const char *key_all,
                           const char *key_skip) {
    char *all, *skip;
    size_t alen, slen;
    if (kvb_tokenizer_decode(t, ids, n, 0, &all, &alen) != KVB_OK) return NULL;
    if (kvb_tokenizer_decode(t, ids, n, 1, &skip, &slen) != KVB_OK) {
        free(all);
        return NULL;
    }
    int sok = stream_matches(t, ids, n, 0, all, alen) && stream_matches(t, ids, n, 1, skip, slen);
    json_t *o = json_pack("{s:s%, s:s%, s:b}", key_all, all, alen, key_skip, skip, slen, "stream_ok", sok);
    free(all);
    free(skip);
    return o;
}

/* encode: every string of the input -> its ids and decodes; decode: every id list -> its decodes. */
static int cmd_tokens(const char *dir, int encode) {
    kvb_tokenizer *t;
    if (kvb_tokenizer_load(dir, &t) != KVB_OK) return 1;
    json_t *in = read_stdin(), *out = json_array();
    if (!in) return 1;
    size_t i, k;
    json_t *item, *v;
    json_array_foreach(in, i, item) {
        int32_t *ids;
        int n = (int)json_array_size(item);
        if (!encode) {
            ids = calloc((size_t)n + 1, sizeof *ids);
            json_array_foreach(item, k, v) ids[k] = (int32_t)json_integer_value(v);
        } else if (kvb_tokenizer_encode(t, json_string_value(item), json_string_length(item), 0, &ids, &n) != KVB_OK) {
            json_array_append_new(out, json_pack("{s:s}", "error", "encode failed"));
            continue;
        }
        json_t *o = decode_both(t, ids, n, encode ? "decoded" : "text_all", encode ? "decoded_skip" : "text");
        if (!o) return 1;
        if (encode) {
            json_t *arr = json_array();
            for (int j = 0; j < n; j++) json_array_append_new(arr, json_integer(ids[j]));
            json_object_set_new(o, "ids", arr);
        }
        json_array_append_new(out, o);
        free(ids);
    }
    json_dumpf(out, stdout, JSON_ENSURE_ASCII | JSON_COMPACT);
    printf("\n");
    json_decref(in);
    json_decref(out);
    kvb_tokenizer_destroy(t);
    return 0;
}

static int cmd_render(const char *dir) {
    kvb_chat_template *ct;
    if (kvb_chat_template_load(dir, &ct) != KVB_OK) return 1;
    json_t *in = read_stdin(), *out = json_array();
    if (!in) return 1;
    size_t i;
    json_t *c;
    json_array_foreach(in, i, c) {
        char *text = NULL, err[512] = "";
        kvb_status st = kvb_chat_render(ct, json_object_get(c, "messages"),
                                        json_is_true(json_object_get(c, "add_generation_prompt")),
                                        json_object_get(c, "extra"), &text, err, sizeof err);
        if (st == KVB_OK) json_array_append_new(out, json_pack("{s:s}", "text", text));
        else json_array_append_new(out, json_pack("{s:s}", "error", err));
        free(text);
    }
    json_dumpf(out, stdout, JSON_ENSURE_ASCII | JSON_COMPACT);
    printf("\n");
    json_decref(in);
    json_decref(out);
    kvb_chat_template_destroy(ct);
    return 0;
}

static int cmd_speed(const char *dir, const char *file, int repeats) {
    kvb_tokenizer *t;
    if (kvb_tokenizer_load(dir, &t) != KVB_OK) return 1;
    FILE *f = fopen(file, "rb");
    if (!f) return 1;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)sz + 1);
    if (fread(buf, 1, (size_t)sz, f) != (size_t)sz) return 1;
    fclose(f);
    for (int r = 0; r < repeats; r++) {
        int32_t *ids;
        int n;
        double t0 = kvb_now_s();
        if (kvb_tokenizer_encode(t, buf, (size_t)sz, 0, &ids, &n) != KVB_OK) return 1;
        double dt = kvb_now_s() - t0;
        printf("run %d: %ld bytes -> %d tokens in %.3f s: %.0f tokens/s, %.1f MB/s\n", r, sz, n, dt, n / dt,
               sz / dt / 1e6);
        free(ids);
    }
    free(buf);
    kvb_tokenizer_destroy(t);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 3 && !strcmp(argv[1], "encode")) return cmd_tokens(argv[2], 1);
    if (argc >= 3 && !strcmp(argv[1], "render")) return cmd_render(argv[2]);
    if (argc >= 3 && !strcmp(argv[1], "decode")) return cmd_tokens(argv[2], 0);
    if (argc >= 4 && !strcmp(argv[1], "speed")) return cmd_speed(argv[2], argv[3], argc > 4 ? atoi(argv[4]) : 3);
    fprintf(stderr, "usage: text_cli encode|decode|render MODEL_DIR < JSON | text_cli speed MODEL_DIR FILE [N]\n");
    return 2;
}
