/* libFuzzer target: the tokenizer (common/text/tokenizer.c, unicode.c) on any bytes. Four tokenizers are
 * written at start into temporary directories: byte-level BPE with merges, special and plain added
 * tokens sharing prefixes, and Llama-3's split regex, one without a normalizer, one with NFC; and
 * SentencePiece-style BPE: Llama-2's pipeline (Prepend and Replace normalizer, byte fallback for every
 * byte, decoder Replace, ByteFallback, Fuse, Strip), and Metaspace (split, prepend_scheme first) with
 * the Metaspace decoder, fuse_unk and no byte tokens for 0xF0..0xFF (4-byte characters become <unk>).
 * Checks:
 *   - invalid UTF-8 is refused with KVB_ERR_INVALID, nothing else;
 *   - without a normalizer, decode(encode(text)) == text (byte-level BPE is lossless);
 *   - with NFC, encode(decode(encode(text))) == encode(text) (NFC is idempotent, BPE deterministic),
 *     unless NFC composed an added token's content (added tokens are matched before normalizing);
 *   - Llama-2's pipeline: decode(encode(text)) == text for text without "▁" or an added token (the
 *     "▁" prepended to the text is the space the decoder strips);
 *   - every id an encode gives lies in the vocabulary;
 *   - the input read as token ids: streamed detokenization joins to the decode, whatever the ids, on
 *     every tokenizer. */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/text/tokenizer.h"
#include "common/util/log.h"

static kvb_tokenizer *g_plain, *g_nfc, *g_llama2, *g_metaspace;

#define MS "\xe2\x96\x81" /* U+2581, SentencePiece's space */

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

static kvb_tokenizer *load_written(const char *dir, json_t *tj) {
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
    return load_written(dir, tj);
}

/* SentencePiece-style BPE: <unk> <s> </s> (special) and "<|x|>" (not), byte tokens for bytes below
 * `bytes_below`, ASCII letters, "▁", "é", and merges of frequent pairs and of merges. */
static kvb_tokenizer *make_spm(const char *dir, int metaspace, int bytes_below) {
    mkdir(dir, 0700);
    json_t *vocab = json_pack("{s:i, s:i, s:i}", "<unk>", 0, "<s>", 1, "</s>", 2), *merges = json_array();
    int id = 3;
    for (int b = 0; b < bytes_below; b++) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b);
        json_object_set_new(vocab, name, json_integer(id++));
    }
    static const char *const chars[] = {MS, "\xc3\xa9", "e", "t", "h", "r", "i", "n", "g", "a", "o", "s", "l", "d", "<", ">"};
    for (size_t i = 0; i < sizeof chars / sizeof chars[0]; i++) json_object_set_new(vocab, chars[i], json_integer(id++));
    static const char *const pairs[][2] = {{MS, "t"}, {"h", "e"}, {MS "t", "he"}, {"e", "r"}, {"i", "n"}, {"in", "g"},
                                           {MS, MS}, {MS MS, MS MS}, {"a", "a"}, {"aa", "aa"}, {MS, "a"}, {"<", "s"},
                                           {"<s", ">"}, {"\xc3\xa9", "t"}, {MS, "\xc3\xa9t"}};
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
        char joined[64];
        snprintf(joined, sizeof joined, "%s%s", pairs[i][0], pairs[i][1]);
        json_object_set_new(vocab, joined, json_integer(id++));
        json_array_append_new(merges, json_pack("[s,s]", pairs[i][0], pairs[i][1]));
    }
    json_t *added = json_pack("[{s:i, s:s, s:b}, {s:i, s:s, s:b}, {s:i, s:s, s:b}, {s:i, s:s, s:b}]", "id", 0, "content",
                              "<unk>", "special", 1, "id", 1, "content", "<s>", "special", 1, "id", 2, "content", "</s>",
                              "special", 1, "id", id, "content", "<|x|>", "special", 0);
    json_t *normalizer, *pre, *decoder;
    if (metaspace) {
        normalizer = json_null();
        pre = json_pack("{s:s, s:s, s:s, s:b}", "type", "Metaspace", "replacement", MS, "prepend_scheme", "first",
                        "split", 1);
        decoder = json_pack("{s:s, s:s, s:s}", "type", "Metaspace", "replacement", MS, "prepend_scheme", "first");
    } else {
        normalizer = json_pack("{s:s, s:[{s:s, s:s}, {s:s, s:{s:s}, s:s}]}", "type", "Sequence", "normalizers", "type",
                               "Prepend", "prepend", MS, "type", "Replace", "pattern", "String", " ", "content", MS);
        pre = json_null();
        decoder = json_pack("{s:s, s:[{s:s, s:{s:s}, s:s}, {s:s}, {s:s}, {s:s, s:s, s:i, s:i}]}", "type", "Sequence",
                            "decoders", "type", "Replace", "pattern", "String", MS, "content", " ", "type",
                            "ByteFallback", "type", "Fuse", "type", "Strip", "content", " ", "start", 1, "stop", 0);
    }
    return load_written(dir, json_pack("{s:o, s:o, s:o, s:o, s:{s:s, s:o, s:o, s:b, s:b, s:s}}", "added_tokens", added,
                                       "normalizer", normalizer, "pre_tokenizer", pre, "decoder", decoder, "model",
                                       "type", "BPE", "vocab", vocab, "merges", merges, "byte_fallback", 1,
                                       "fuse_unk", 1, "unk_token", "<unk>"));
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    kvb_log_set_level(KVB_LOG_ERROR);
    char a[] = "/tmp/kvb-fuzz-tok-XXXXXX", b[] = "/tmp/kvb-fuzz-tok-XXXXXX", c[] = "/tmp/kvb-fuzz-tok-XXXXXX",
         d[] = "/tmp/kvb-fuzz-tok-XXXXXX";
    if (!mkdtemp(a) || !mkdtemp(b) || !mkdtemp(c) || !mkdtemp(d)) abort();
    g_plain = make(a, 0);
    g_nfc = make(b, 1);
    g_llama2 = make_spm(c, 0, 256);
    g_metaspace = make_spm(d, 1, 0xF0);
    return 0;
}

static int same_ids(const int32_t *x, int nx, const int32_t *y, int ny) {
    return nx == ny && (!nx || !memcmp(x, y, (size_t)nx * sizeof *x));
}

/* Added tokens are matched in the text before it is normalized (as transformers.js does; Hugging Face's
 * Rust library matches a "normalized" one after): NFC can compose an added token's content that the
 * text did not have ("e\u0301te\u0301" -> "été"), which a second encode then matches. */
static int nfc_made_added(const char *text, size_t size, const char *out, size_t len) {
    static const char *const added[] = {"<|s|>", "<|im_start|>", "\xc3\xa9t\xc3\xa9"};
    for (size_t i = 0; i < sizeof added / sizeof added[0]; i++) {
        size_t k = strlen(added[i]), a = 0, b = 0;
        for (const char *p = text; (p = memmem(p, size - (size_t)(p - text), added[i], k)); p += k) a++;
        for (const char *p = out; (p = memmem(p, len - (size_t)(p - out), added[i], k)); p += k) b++;
        if (b > a) return 1;
    }
    return 0;
}

static void ids_in_vocab(const kvb_tokenizer *t, const int32_t *ids, int n) {
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= kvb_tokenizer_vocab_size(t)) abort();
}

/* Streamed detokenization of ids[0..m) joins to their decode, with and without special tokens. */
static void stream_equals_decode(const kvb_tokenizer *t, const int32_t *ids, int m) {
    for (int skip = 0; skip < 2; skip++) {
        char *out;
        size_t len;
        if (kvb_tokenizer_decode(t, ids, m, skip, &out, &len) != KVB_OK) abort();
        kvb_detok *d = NULL;
        if (kvb_detok_create(t, skip, &d) != KVB_OK) abort();
        char *acc = malloc(len + 1);
        size_t at = 0;
        for (int i = 0; i <= m; i++) {
            const char *p;
            size_t pl;
            if ((i < m ? kvb_detok_push(d, ids[i], &p, &pl) : kvb_detok_flush(d, &p, &pl)) != KVB_OK) abort();
            if (at + pl > len) abort();
            memcpy(acc + at, p, pl);
            at += pl;
        }
        if (at != len || memcmp(acc, out, len)) abort();
        kvb_detok_destroy(d);
        free(acc);
        free(out);
    }
}

/* Llama-2's pipeline on text without "▁" and without an added token's content gives the text back. */
static void llama2_round_trip(const char *text, size_t size) {
    int32_t *ids;
    int n;
    char *out;
    size_t len;
    if (kvb_tokenizer_encode(g_llama2, text, size, 0, &ids, &n) != KVB_OK) abort();
    ids_in_vocab(g_llama2, ids, n);
    if (kvb_tokenizer_decode(g_llama2, ids, n, 0, &out, &len) != KVB_OK) abort();
    static const char *const marks[] = {MS, "<unk>", "<s>", "</s>", "<|x|>"};
    int plain = 1;
    for (size_t i = 0; i < sizeof marks / sizeof marks[0]; i++)
        if (memmem(text, size, marks[i], strlen(marks[i]))) plain = 0;
    if (plain && (len != size || memcmp(out, text, size))) abort();
    free(out);
    free(ids);
    if (kvb_tokenizer_encode(g_metaspace, text, size, 0, &ids, &n) != KVB_OK) abort();
    ids_in_vocab(g_metaspace, ids, n);
    free(ids);
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
        ids_in_vocab(g_plain, ids, n);
        if (kvb_tokenizer_decode(g_plain, ids, n, 0, &out, &len) != KVB_OK) abort();
        if (len != size || memcmp(out, text, size)) abort(); /* lossless */
        free(out);
        free(ids);
        /* NFC: encoding what the decode gives is a fixed point */
        if (kvb_tokenizer_encode(g_nfc, text, size, 0, &ids, &n) != KVB_OK) abort();
        if (kvb_tokenizer_decode(g_nfc, ids, n, 0, &out, &len) != KVB_OK) abort();
        if (kvb_tokenizer_encode(g_nfc, out, len, 0, &ids2, &n2) != KVB_OK) abort();
        if (!same_ids(ids, n, ids2, n2) && !nfc_made_added(text, size, out, len)) abort();
        free(out);
        free(ids);
        free(ids2);
        llama2_round_trip(text, size);
    } else if (kvb_tokenizer_encode(g_llama2, text, size, 0, &ids, &n) != KVB_ERR_INVALID) {
        abort();
    }
    /* the bytes as ids (non-negative, some beyond the vocabulary): the stream joins to the decode */
    int m = (int)(size / 2);
    int32_t *raw = malloc(((size_t)m + 1) * sizeof *raw);
    if (!raw) return 0;
    for (int i = 0; i < m; i++) raw[i] = (int32_t)(data[2 * i] | (data[2 * i + 1] & 0x01) << 8);
    stream_equals_decode(g_plain, raw, m);
    stream_equals_decode(g_llama2, raw, m);
    stream_equals_decode(g_metaspace, raw, m);
    free(raw);
    return 0;
}
