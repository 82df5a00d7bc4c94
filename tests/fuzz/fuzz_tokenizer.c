/* libFuzzer target: the tokenizer (common/text/tokenizer.c, unicode.c) on any bytes. Two tokenizers are
 * written at start into a temporary directory: byte-level BPE with merges, special and plain added
 * tokens sharing prefixes, and Llama-3's split regex; one without a normalizer, one with NFC. Checks:
 *   - invalid UTF-8 is refused with KVB_ERR_INVALID, nothing else;
 *   - without a normalizer, decode(encode(text)) == text (byte-level BPE is lossless);
 *   - with NFC, encode(decode(encode(text))) == encode(text) (NFC is idempotent, BPE deterministic);
 *   - the input read as token ids: streamed detokenization joins to the decode, whatever the ids. */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/text/tokenizer.h"
#include "common/util/log.h"

static kvb_tokenizer *g_plain, *g_nfc;

/* GPT-2's byte -> character map (as UTF-8). */
static void byte_char(int b, char out[4]) {
    int n = 0;
    for (int k = 0; k < b; k++)
        if (!((k >= 0x21 && k <= 0x7E) || (k >= 0xA1 && k <= 0xAC) || (k >= 0xAE && k <= 0xFF))) n++;
    int printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    int cp = printable ? b : 0x100 + n;
    memset(out, 0, 4);
    if (cp < 0x80) out[0] = (char)cp;
    else {
        out[0] = (char)(0xC0 | cp >> 6);
        out[1] = (char)(0x80 | (cp & 0x3F));
    }
}

static kvb_tokenizer *make(const char *dir, int nfc) {
    mkdir(dir, 0700);
    json_t *vocab = json_object(), *merges = json_array();
    char names[256][4];
    for (int b = 0; b < 256; b++) {
        byte_char(b, names[b]);
        json_object_set_new(vocab, names[b], json_integer(b));
    }
    /* merges of frequent pairs, and merges of merges */
    static const char *const pairs[][2] = {{"t", "h"}, {"h", "e"}, {"th", "e"}, {"\xc4\xa0", "t"}, {"\xc4\xa0t", "he"}, {"e", "r"},
                                           {"i", "n"}, {"in", "g"}, {"\xc4\xa0", "a"}, {"o", "n"}, {"e", "s"},
                                           {"a", "a"}, {"aa", "aa"}, {"aaaa", "aaaa"}};
    int id = 256;
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
        char joined[64];
        snprintf(joined, sizeof joined, "%s%s", pairs[i][0], pairs[i][1]);
        json_object_set_new(vocab, joined, json_integer(id++));
        json_array_append_new(merges, json_pack("[s,s]", pairs[i][0], pairs[i][1]));
    }
    json_t *added = json_pack("[{s:i, s:s, s:b}, {s:i, s:s, s:b}, {s:i, s:s, s:b}, {s:i, s:s, s:b}]", "id", id,
                              "content", "<|s|>", "special", 1, "id", id + 1, "content", "<|s|>x", "special", 0, "id",
                              id + 2, "content", "<|im_start|>", "special", 1, "id", id + 3, "content", "\xc3\xa9t\xc3\xa9",
                              "special", 0);
    json_t *tj = json_pack("{s:o, s:o, s:{s:s, s:[{s:s, s:{s:s}, s:s}, {s:s, s:b}]}, s:{s:s}, s:{s:s, s:o, s:o}}",
                           "added_tokens", added, "normalizer", nfc ? json_pack("{s:s}", "type", "NFC") : json_null(),
                           "pre_tokenizer", "type", "Sequence", "pretokenizers", "type", "Split", "pattern", "Regex",
                           "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
                           "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                           "behavior", "Isolated", "type", "ByteLevel", "use_regex", 0, "decoder", "type", "ByteLevel",
                           "model", "type", "BPE", "vocab", vocab, "merges", merges);
    char path[512];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    if (!tj || json_dump_file(tj, path, 0) != 0) abort();
    json_decref(tj);
    kvb_tokenizer *t = NULL;
    if (kvb_tokenizer_load(dir, &t) != KVB_OK) abort();
    unlink(path);
    rmdir(dir);
    return t;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    kvb_log_set_level(KVB_LOG_ERROR);
    char a[] = "/tmp/kvb-fuzz-tok-XXXXXX", b[] = "/tmp/kvb-fuzz-tok-XXXXXX";
    if (!mkdtemp(a) || !mkdtemp(b)) abort();
    g_plain = make(a, 0);
    g_nfc = make(b, 1);
    return 0;
}

static int same_ids(const int32_t *x, int nx, const int32_t *y, int ny) {
    return nx == ny && (!nx || !memcmp(x, y, (size_t)nx * sizeof *x));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *text = (const char *)data;
    int32_t *ids = NULL, *ids2 = NULL;
    int n = 0, n2 = 0;
    char *out = NULL;
    size_t len = 0;
    kvb_status st = kvb_tokenizer_encode(g_plain, text, size, 0, &ids, &n);
    if (st != KVB_OK && st != KVB_ERR_INVALID) abort();
    if (st == KVB_OK) {
        if (kvb_tokenizer_decode(g_plain, ids, n, 0, &out, &len) != KVB_OK) abort();
        if (len != size || memcmp(out, text, size)) abort(); /* lossless */
        free(out);
        free(ids);
        /* NFC: encoding what the decode gives is a fixed point */
        if (kvb_tokenizer_encode(g_nfc, text, size, 0, &ids, &n) != KVB_OK) abort();
        if (kvb_tokenizer_decode(g_nfc, ids, n, 0, &out, &len) != KVB_OK) abort();
        if (kvb_tokenizer_encode(g_nfc, out, len, 0, &ids2, &n2) != KVB_OK) abort();
        if (!same_ids(ids, n, ids2, n2)) abort();
        free(out);
        free(ids);
        free(ids2);
    }
    /* the bytes as ids (non-negative, some beyond the vocabulary): the stream joins to the decode */
    int m = (int)(size / 2);
    int32_t *raw = malloc(((size_t)m + 1) * sizeof *raw);
    if (!raw) return 0;
    for (int i = 0; i < m; i++) raw[i] = (int32_t)(data[2 * i] | (data[2 * i + 1] & 0x01) << 8);
    for (int skip = 0; skip < 2; skip++) {
        if (kvb_tokenizer_decode(g_plain, raw, m, skip, &out, &len) != KVB_OK) abort();
        kvb_detok *d = NULL;
        if (kvb_detok_create(g_plain, skip, &d) != KVB_OK) abort();
        char *acc = malloc(len + 1);
        size_t at = 0;
        for (int i = 0; i <= m; i++) {
            const char *p;
            size_t pl;
            if ((i < m ? kvb_detok_push(d, raw[i], &p, &pl) : kvb_detok_flush(d, &p, &pl)) != KVB_OK) abort();
            if (at + pl > len) abort();
            memcpy(acc + at, p, pl);
            at += pl;
        }
        if (at != len || memcmp(acc, out, len)) abort();
        kvb_detok_destroy(d);
        free(acc);
        free(out);
    }
    free(raw);
    return 0;
}
