/* kvbank — BPE tokenizer from a Hugging Face tokenizer.json (see tokenizer.h).
 *
 * Pipeline of an encode, as Hugging Face's tokenizers run it:
 *   1. split the text on added tokens (leftmost, longest match; special and not), which pass as they are;
 *   2. normalize every other section: its steps in order (NFC for Qwen2/Qwen3; Prepend "▁" and Replace
 *      " " -> "▁" for Llama-2 and Mistral; nothing for Llama-3);
 *   3. split it with the pre-tokenizer: regexes ("Isolated": matches and the gaps between them), or
 *      Metaspace (" " -> "▁", a "▁" in front as its prepend_scheme says, pieces that start at each "▁");
 *   4. turn each piece into its first symbols and merge adjacent symbols by merge rank (lowest rank
 *      first, leftmost first among equals), with a cache of pieces already seen. Byte-level BPE (a
 *      ByteLevel pre-tokenizer) starts from one symbol per byte; SentencePiece-style BPE from one per
 *      character, a character the vocabulary lacks becoming its <0xNN> byte tokens (byte_fallback) or
 *      the unk token;
 *   5. add what the post-processor adds (BOS) when asked.
 * Decoding concatenates every token's bytes (a byte-level token's characters mapped back; a
 * SentencePiece token's text with the decoder's Replace steps applied, a <0xNN> token its byte; an
 * added token's content), turns ill-formed UTF-8 into U+FFFD and strips what a Strip decoder strips
 * from the start of the text. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "common/text/tokenizer.h"

#include <ctype.h>
#include <limits.h>
#include <pcre2.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/text/text_impl.h"
#include "common/text/unicode.h"
#include "common/util/json.h"
#include "common/util/util.h"

#define MAX_REGEX 4
#define CACHE_SLOTS (1u << 15) /* word cache: open addressing; cleared when 3/4 full */
#define CACHE_MAX_WORD 256     /* longer pieces are not cached */
#define MAX_VOCAB (1 << 24)    /* config.json's vocab_size above this does not widen the id range */

typedef struct added_token {
    const char *content; /* into t->strings */
    size_t content_off;  /* its offset there */
    size_t len;
    int32_t id;
    int special, lstrip, rstrip;
} added_token;

/* A normalizer step. */
typedef enum norm_kind {
    NORM_NFC,     /* Unicode NFC */
    NORM_PREPEND, /* `to` before a non-empty text */
    NORM_REPLACE, /* every `from` (a string, left to right, not overlapping) becomes `to` */
} norm_kind;

typedef struct norm_step {
    norm_kind kind;
    char *from, *to; /* owned; NULL where the kind has none */
    size_t from_len, to_len;
} norm_step;

#define MAX_NORM 8
/* Normalized text may grow to this many times the section plus NORM_SLACK bytes (" " -> "▁" triples a
 * space; NFC at most triples a character): beyond it is KVB_ERR_EXHAUSTED, so that no tokenizer.json
 * can make a request's text grow without bound. */
#define NORM_GROWTH 4
#define NORM_SLACK 64

/* Where Metaspace puts a replacement character in front of a section (Hugging Face's PrependScheme). */
typedef enum prepend_scheme {
    PREPEND_ALWAYS, /* every section that does not start with one */
    PREPEND_FIRST,  /* only the section at the start of the text */
    PREPEND_NEVER,
} prepend_scheme;

typedef struct cache_entry {
    uint64_t hash;
    char *key; /* [key_len] piece bytes + [n] int32 ids, one allocation; NULL: empty slot */
    uint32_t key_len, n;
} cache_entry;

struct kvb_tokenizer {
    int n_vocab;            /* one more than the largest id */
    char *strings;          /* every token's text and bytes, back to back */
    size_t strings_len, strings_cap;
    size_t *tok_str;        /* [n_vocab] offset of the token's text (byte-level form), or SIZE_MAX: no token */
    uint32_t *tok_str_len;  /* [n_vocab] */
    size_t *tok_bytes;      /* [n_vocab] offset of the bytes the token decodes to */
    uint32_t *tok_bytes_len;
    uint8_t *special;       /* [n_vocab] 1: a special added token */
    int32_t *vocab_slots;   /* [vocab_mask + 1] model vocabulary: id or -1 (key: the token's text) */
    uint32_t vocab_mask;
    struct merge_slot { int32_t a, b, rank, id; } *merges; /* [merge_mask + 1]; a = -1: empty */
    uint32_t merge_mask;
    int32_t byte_id[256];   /* the vocabulary id of each byte's byte-level character */
    uint16_t byte_char[256]; /* byte -> byte-level code point (GPT-2's bytes_to_unicode) */
    int ignore_merges;      /* a piece that is a vocabulary token is taken whole (Llama-3) */
    int byte_level;         /* 1: byte-level BPE, every byte a first symbol; 0: SentencePiece style,
                             * every character one (tokens are text, "▁" standing for a space) */
    int byte_fallback;      /* a character the vocabulary lacks becomes its <0xNN> byte tokens */
    int32_t fallback_id[256]; /* the id of "<0xNN>", or -1 */
    int32_t unk_id;         /* model.unk_token's id, or -1: an unknown character is dropped */
    int fuse_unk;           /* consecutive unknown characters give one unk token */
    norm_step norm[MAX_NORM]; /* the normalizer's steps, in order */
    int n_norm;
    struct {
        int on;
        char rep[5];        /* the replacement character ("▁"), NUL-terminated */
        size_t rep_len;
        prepend_scheme prepend;
        int split;          /* pieces start at each replacement character */
    } metaspace;            /* a Metaspace pre-tokenizer */
    char space[5];          /* SentencePiece style: the character a space becomes ("▁") */
    size_t space_len;       /* its length; 0 unless merging word by word is exact (spm_word_split) */
    char dec_strip[5];      /* decoder Strip (after Fuse): at most dec_strip_n of this character come */
    size_t dec_strip_len;   /* off the start of the decoded text */
    int dec_strip_n;
    char dec_first_drop[5]; /* decoder Metaspace: the first token loses every one of this character */
    size_t dec_first_drop_len;
    added_token *added;     /* [n_added], by length descending */
    int n_added;
    /* The added tokens' contents as a trie (leftmost-longest matching costs one walk per position, not
     * a scan of every token): node 0 is the root; the child of `node` by `byte` is found by key
     * (node << 8 | byte) + 1 in an open-addressing table. */
    uint64_t *trie_key;     /* [trie_mask + 1]; 0: an empty slot */
    uint32_t *trie_child;   /* [trie_mask + 1] the child's node number */
    uint32_t trie_mask;
    int32_t *trie_tok;      /* [n_trie] index into added of the token that ends at the node, or -1 */
    uint32_t n_trie;
    uint8_t added_first[256]; /* 1: some added token starts with this byte */
    size_t max_encode;      /* budgets (kvb_tokenizer_set_limits) */
    size_t max_decode;
    pcre2_code *regex[MAX_REGEX];
    int n_regex;
    int32_t prefix[4], suffix[4]; /* ids the post-processor puts around a sequence */
    int n_prefix, n_suffix;
    int32_t eos[8];
    int n_eos;
    int32_t bos_id;
    char *bos_str, *eos_str, *pad_str, *unk_str;
    pthread_mutex_t cache_lock;
    cache_entry *cache;     /* [CACHE_SLOTS] */
    uint32_t cache_used;
};

/* ------------------------------------------------------------------------------------- hashing */

static uint64_t hash_bytes(const void *p, size_t n) {
    const uint8_t *s = p;
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a, then a final mix */
    for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 0x100000001b3ull;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return h;
}

/* murmur3's 64-bit finalizer over the pair: every input bit reaches the low bits the tables use. */
static uint64_t hash_pair(int32_t a, int32_t b) {
    uint64_t h = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    return h ^ h >> 33;
}

static uint32_t pow2_at_least(size_t n) {
    uint32_t c = 16;
    while (c < n) c <<= 1;
    return c;
}

static const char *tok_text(const kvb_tokenizer *t, int32_t id) { return t->strings + t->tok_str[id]; }

/* The model-vocabulary id of the token whose text is s[0..n), or -1. */
static int32_t vocab_find(const kvb_tokenizer *t, const char *s, size_t n) {
    for (uint32_t i = (uint32_t)hash_bytes(s, n) & t->vocab_mask;; i = (i + 1) & t->vocab_mask) {
        int32_t id = t->vocab_slots[i];
        if (id < 0) return -1;
        if (t->tok_str_len[id] == n && !memcmp(tok_text(t, id), s, n)) return id;
    }
}

static void vocab_insert(kvb_tokenizer *t, int32_t id) {
    uint32_t i = (uint32_t)hash_bytes(tok_text(t, id), t->tok_str_len[id]) & t->vocab_mask;
    while (t->vocab_slots[i] >= 0) i = (i + 1) & t->vocab_mask;
    t->vocab_slots[i] = id;
}

static const struct merge_slot *merge_find(const kvb_tokenizer *t, int32_t a, int32_t b) {
    for (uint32_t i = (uint32_t)hash_pair(a, b) & t->merge_mask;; i = (i + 1) & t->merge_mask) {
        const struct merge_slot *m = &t->merges[i];
        if (m->a < 0) return NULL;
        if (m->a == a && m->b == b) return m;
    }
}

/* The child of trie node `node` by `byte`, or 0 (the root is nobody's child). */
static uint32_t trie_next(const kvb_tokenizer *t, uint32_t node, uint8_t byte) {
    uint64_t key = ((uint64_t)node << 8 | byte) + 1;
    for (uint32_t i = (uint32_t)hash_pair((int32_t)node, byte) & t->trie_mask;; i = (i + 1) & t->trie_mask) {
        if (t->trie_key[i] == key) return t->trie_child[i];
        if (!t->trie_key[i]) return 0;
    }
}

/* Builds the trie of t->added (sorted: among equal contents the first, the lowest id, is kept). */
static kvb_status trie_build(kvb_tokenizer *t) {
    size_t bytes = 0;
    for (int k = 0; k < t->n_added; k++) bytes += t->added[k].len;
    if (bytes >= UINT32_MAX / 4) return KVB_ERR_INVALID;
    uint32_t slots = pow2_at_least(2 * bytes + 2);
    t->trie_mask = slots - 1;
    KVB_TRY(kvb_calloc(slots, sizeof *t->trie_key, (void **)&t->trie_key));
    KVB_TRY(kvb_malloc(slots * sizeof *t->trie_child, (void **)&t->trie_child));
    KVB_TRY(kvb_malloc((bytes + 1) * sizeof *t->trie_tok, (void **)&t->trie_tok));
    t->trie_tok[0] = -1;
    t->n_trie = 1;
    for (int k = 0; k < t->n_added; k++) {
        const uint8_t *c = (const uint8_t *)t->added[k].content;
        uint32_t node = 0;
        t->added_first[c[0]] = 1;
        for (size_t i = 0; i < t->added[k].len; i++) {
            uint32_t child = trie_next(t, node, c[i]);
            if (!child) {
                uint64_t key = ((uint64_t)node << 8 | c[i]) + 1;
                uint32_t s = (uint32_t)hash_pair((int32_t)node, c[i]) & t->trie_mask;
                while (t->trie_key[s]) s = (s + 1) & t->trie_mask;
                child = t->n_trie++;
                t->trie_key[s] = key;
                t->trie_child[s] = child;
                t->trie_tok[child] = -1;
            }
            node = child;
        }
        if (t->trie_tok[node] < 0) t->trie_tok[node] = k;
    }
    return KVB_OK;
}

/* ------------------------------------------------------------------------------------- loading */

static kvb_status strings_add(kvb_tokenizer *t, const void *s, size_t n, size_t *off) {
    if (t->strings_len + n + 1 > t->strings_cap) {
        size_t cap = t->strings_cap ? t->strings_cap : 1 << 20;
        while (cap < t->strings_len + n + 1) cap *= 2;
        char *p = realloc(t->strings, cap);
        if (!p) return KVB_ERR_NOMEM;
        t->strings = p;
        t->strings_cap = cap;
    }
    memcpy(t->strings + t->strings_len, s, n);
    t->strings[t->strings_len + n] = 0;
    *off = t->strings_len;
    t->strings_len += n + 1;
    return KVB_OK;
}

/* GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes for
 * U+0100.. in byte order. */
static void init_byte_chars(kvb_tokenizer *t) {
    int n = 0;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        t->byte_char[b] = (uint16_t)(printable ? b : 0x100 + n++);
    }
}

/* The bytes a vocabulary token stands for: its byte-level characters mapped back, or its own UTF-8 when
 * one of its characters is not a byte-level character (as Hugging Face's ByteLevel decoder does). */
static kvb_status set_token_bytes(kvb_tokenizer *t, int32_t id, const int16_t *char_byte) {
    const uint8_t *s = (const uint8_t *)tok_text(t, id);
    size_t n = t->tok_str_len[id], k = 0;
    uint8_t tmp[1024];
    int ok = n <= sizeof tmp;
    for (size_t i = 0; ok && i < n;) {
        uint32_t cp;
        int len = kvb__utf8_decode(s + i, n - i, &cp);
        if (!len || cp >= 0x144 || char_byte[cp] < 0) ok = 0;
        else tmp[k++] = (uint8_t)char_byte[cp];
        i += len ? (size_t)len : 1;
    }
    size_t off;
    if (!ok) {
        t->tok_bytes[id] = t->tok_str[id];
        t->tok_bytes_len[id] = t->tok_str_len[id];
        return KVB_OK;
    }
    KVB_TRY(strings_add(t, tmp, k, &off));
    t->tok_bytes[id] = off;
    t->tok_bytes_len[id] = (uint32_t)k;
    return KVB_OK;
}

/* s[0..n) with every `from` (non-empty; left to right, not overlapping) replaced by `to`, appended to
 * `out`. The result longer than max_out bytes: KVB_ERR_EXHAUSTED, before anything is allocated. */
static kvb_status replace_all(const uint8_t *s, size_t n, const char *from, size_t flen, const char *to, size_t tlen,
                              size_t max_out, kvb_buf *out) {
    size_t hits = 0, len = n;
    for (const uint8_t *p = s, *e = s + n; (p = memmem(p, (size_t)(e - p), from, flen)); p += flen) hits++;
    if (tlen > flen) len += hits * (tlen - flen);
    else len -= hits * (flen - tlen);
    if (len > max_out) return KVB_ERR_EXHAUSTED;
    KVB_TRY(kvb__buf_reserve(out, len));
    const uint8_t *p = s, *e = s + n, *m;
    while ((m = memmem(p, (size_t)(e - p), from, flen))) {
        KVB_TRY(kvb__buf_append(out, p, (size_t)(m - p)));
        KVB_TRY(kvb__buf_append(out, to, tlen));
        p = m + flen;
    }
    return kvb__buf_append(out, p, (size_t)(e - p));
}

#define UNSUPPORTED(file, ...)                                                                          \
    do {                                                                                               \
        KVB_LOG_E("%s: " file ": " __VA_ARGS__);                                                        \
        return KVB_ERR_UNSUPPORTED;                                                                    \
    } while (0)

static const char *str_field(const json_t *o, const char *key) {
    const json_t *v = json_object_get(o, key);
    return json_is_string(v) ? json_string_value(v) : NULL;
}

static int bool_field(const json_t *o, const char *key) { return json_is_true(json_object_get(o, key)); }

/* Unicode White_Space, as Hugging Face's regex engine (Oniguruma) reads \s. PCRE2's \s differs
 * (it adds U+180E), so patterns are rewritten to this class. */
#define WS_CLASS "\\x{9}-\\x{D}\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}"

static kvb_status rewrite_pattern(const char *dir, const char *pat, kvb_buf *out) {
    int in_class = 0;
    for (const char *p = pat; *p; p++) {
        if (*p == '\\' && p[1]) {
            if (p[1] == 's') KVB_TRY(kvb__buf_printf(out, in_class ? "%s" : "[%s]", WS_CLASS));
            else if (p[1] == 'S' && !in_class) KVB_TRY(kvb__buf_printf(out, "[^%s]", WS_CLASS));
            else if (p[1] == 'S') UNSUPPORTED("tokenizer.json", "pre_tokenizer regex: \\S inside a class: %s", dir, pat);
            else KVB_TRY(kvb__buf_append(out, p, 2));
            p++;
            continue;
        }
        if (*p == '[' && !in_class) in_class = 1;
        else if (*p == ']' && in_class) in_class = 0;
        KVB_TRY(kvb__buf_putc(out, *p));
    }
    return KVB_OK;
}

static kvb_status add_regex(kvb_tokenizer *t, const char *dir, const char *pat) {
    if (t->n_regex == MAX_REGEX) UNSUPPORTED("tokenizer.json", "pre_tokenizer: more than %d Split regexes", dir, MAX_REGEX);
    kvb_buf b = {0};
    kvb_status st = rewrite_pattern(dir, pat, &b);
    if (st != KVB_OK) {
        kvb__buf_free(&b);
        return st;
    }
    int err;
    PCRE2_SIZE off;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)b.p, b.len, PCRE2_UTF | PCRE2_UCP, &err, &off, NULL);
    kvb__buf_free(&b);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        KVB_LOG_E("%s: tokenizer.json: pre_tokenizer regex does not compile at %zu (%s): %s", dir, (size_t)off,
                  (char *)msg, pat);
        return KVB_ERR_UNSUPPORTED;
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* best effort: without JIT it only runs slower */
    t->regex[t->n_regex++] = re;
    return KVB_OK;
}

/* GPT-2's split, used by a ByteLevel pre-tokenizer with use_regex. */
static const char *const GPT2_PATTERN =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

/* o[key] when it is a string of exactly one character (a Metaspace replacement, a Strip content),
 * copied NUL-terminated into out[5]; 0 otherwise. */
static int one_char(const json_t *o, const char *key, char out[5], size_t *len) {
    const char *s = str_field(o, key);
    uint32_t cp;
    size_t n = s ? strlen(s) : 0;
    if (!n || n > 4 || (size_t)kvb__utf8_decode((const uint8_t *)s, n, &cp) != n) return 0;
    memcpy(out, s, n + 1);
    *len = n;
    return 1;
}

/* Metaspace's prepend_scheme, or its older add_prefix_space (false: never), as Hugging Face reads them. */
static kvb_status read_prepend_scheme(const char *dir, const char *what, const json_t *o, prepend_scheme *out) {
    const char *ps = str_field(o, "prepend_scheme");
    const json_t *aps = json_object_get(o, "add_prefix_space");
    *out = PREPEND_ALWAYS;
    if (ps && !strcmp(ps, "first")) *out = PREPEND_FIRST;
    else if (ps && !strcmp(ps, "never")) *out = PREPEND_NEVER;
    else if (ps && strcmp(ps, "always")) UNSUPPORTED("tokenizer.json", "%s Metaspace: prepend_scheme \"%s\"", dir, what, ps);
    if (json_is_false(aps)) {
        if (ps && *out != PREPEND_NEVER)
            UNSUPPORTED("tokenizer.json", "%s Metaspace: add_prefix_space false with prepend_scheme \"%s\"", dir, what, ps);
        *out = PREPEND_NEVER;
    }
    return KVB_OK;
}

static kvb_status load_pre_tokenizer(kvb_tokenizer *t, const char *dir, const json_t *pt) {
    if (!pt || json_is_null(pt)) return KVB_OK; /* each section is one piece */
    const char *type = str_field(pt, "type");
    if (type && !strcmp(type, "Sequence")) {
        const json_t *list = json_object_get(pt, "pretokenizers");
        size_t i;
        const json_t *p;
        json_array_foreach(list, i, p) KVB_TRY(load_pre_tokenizer(t, dir, p));
        return KVB_OK;
    }
    if (type && !strcmp(type, "Split")) {
        const json_t *pat = json_object_get(pt, "pattern");
        const char *re = str_field(pat, "Regex"), *beh = str_field(pt, "behavior");
        if (!re) UNSUPPORTED("tokenizer.json", "pre_tokenizer Split: only \"pattern\": {\"Regex\": ...} is supported", dir);
        if (!beh || strcmp(beh, "Isolated"))
            UNSUPPORTED("tokenizer.json", "pre_tokenizer Split: behavior \"%s\" (only Isolated)", dir, beh ? beh : "?");
        if (bool_field(pt, "invert")) UNSUPPORTED("tokenizer.json", "pre_tokenizer Split: invert true", dir);
        return add_regex(t, dir, re);
    }
    if (type && !strcmp(type, "ByteLevel")) {
        if (bool_field(pt, "add_prefix_space"))
            UNSUPPORTED("tokenizer.json", "pre_tokenizer ByteLevel: add_prefix_space true", dir);
        t->byte_level = 1;
        const json_t *ur = json_object_get(pt, "use_regex");
        if (!ur || json_is_true(ur)) return add_regex(t, dir, GPT2_PATTERN);
        return KVB_OK;
    }
    if (type && !strcmp(type, "Metaspace")) {
        if (t->metaspace.on) UNSUPPORTED("tokenizer.json", "pre_tokenizer: Metaspace twice", dir);
        if (!one_char(pt, "replacement", t->metaspace.rep, &t->metaspace.rep_len))
            UNSUPPORTED("tokenizer.json", "pre_tokenizer Metaspace: \"replacement\" must be one character", dir);
        KVB_TRY(read_prepend_scheme(dir, "pre_tokenizer", pt, &t->metaspace.prepend));
        const json_t *split = json_object_get(pt, "split");
        t->metaspace.split = !split || json_is_true(split); /* absent in files older than the field: true */
        t->metaspace.on = 1;
        return KVB_OK;
    }
    UNSUPPORTED("tokenizer.json", "pre_tokenizer type \"%s\" (supported: Sequence, Split, ByteLevel, Metaspace)", dir,
                type ? type : "?");
}

static kvb_status add_norm(kvb_tokenizer *t, const char *dir, norm_kind kind, const char *from, const char *to) {
    if (t->n_norm == MAX_NORM) UNSUPPORTED("tokenizer.json", "normalizer: more than %d steps", dir, MAX_NORM);
    norm_step *st = &t->norm[t->n_norm++]; /* counted first: the destructor frees what was copied */
    *st = (norm_step){.kind = kind};
    if (from) {
        KVB_TRY(kvb_strdup(from, &st->from));
        st->from_len = strlen(from);
    }
    if (to) {
        KVB_TRY(kvb_strdup(to, &st->to));
        st->to_len = strlen(to);
    }
    return KVB_OK;
}

/* A Replace's {"pattern": {"String": from}, "content": to} (normalizer or decoder); a Regex pattern is
 * not supported. */
static kvb_status replace_strings(const char *dir, const char *what, const json_t *o, const char **from,
                                  const char **to) {
    *from = str_field(json_object_get(o, "pattern"), "String");
    *to = str_field(o, "content");
    if (!*from || !**from || !*to)
        UNSUPPORTED("tokenizer.json", "%s Replace: only a non-empty \"pattern\": {\"String\": ...} and a \"content\"", dir,
                    what);
    return KVB_OK;
}

static kvb_status load_normalizer(kvb_tokenizer *t, const char *dir, const json_t *n) {
    if (!n || json_is_null(n)) return KVB_OK;
    const char *type = str_field(n, "type");
    if (type && !strcmp(type, "NFC")) return add_norm(t, dir, NORM_NFC, NULL, NULL);
    if (type && !strcmp(type, "Prepend")) {
        const char *pre = str_field(n, "prepend");
        if (!pre) UNSUPPORTED("tokenizer.json", "normalizer Prepend: no \"prepend\" string", dir);
        return add_norm(t, dir, NORM_PREPEND, NULL, pre);
    }
    if (type && !strcmp(type, "Replace")) {
        const char *from, *to;
        KVB_TRY(replace_strings(dir, "normalizer", n, &from, &to));
        return add_norm(t, dir, NORM_REPLACE, from, to);
    }
    if (type && !strcmp(type, "Sequence")) {
        size_t i;
        const json_t *p;
        json_array_foreach(json_object_get(n, "normalizers"), i, p) KVB_TRY(load_normalizer(t, dir, p));
        return KVB_OK;
    }
    UNSUPPORTED("tokenizer.json", "normalizer type \"%s\" (supported: NFC, Prepend, Replace, Sequence)", dir,
                type ? type : "?");
}

/* What tokenizer.json's decoder does to each token, read before the vocabulary so that every token's
 * bytes can be set once. A SentencePiece-style decoder is Replace steps, then ByteFallback, Fuse and
 * Strip, in that order (what Llama-2 and Mistral have), or Metaspace alone. */
typedef struct decoder_cfg {
    int byte_level;              /* ByteLevel */
    int byte_fallback;           /* ByteFallback: a <0xNN> token decodes to the byte */
    const char *from[MAX_NORM];  /* Replace steps, in order (borrowed from the JSON) */
    const char *to[MAX_NORM];
    int n_rep;
    int stage;                   /* 0: Replace steps; 1: after ByteFallback; 2: after Fuse; 3: after Strip */
} decoder_cfg;

static kvb_status load_decoder(kvb_tokenizer *t, const char *dir, const json_t *d, int in_seq, decoder_cfg *dc) {
    const char *type = str_field(d, "type");
    if (!type) UNSUPPORTED("tokenizer.json", "decoder without a type", dir);
    if (!strcmp(type, "ByteLevel") && !in_seq) {
        dc->byte_level = 1;
        return KVB_OK;
    }
    if (!strcmp(type, "Sequence") && !in_seq) {
        size_t i;
        const json_t *p;
        json_array_foreach(json_object_get(d, "decoders"), i, p) KVB_TRY(load_decoder(t, dir, p, 1, dc));
        return KVB_OK;
    }
    if (!strcmp(type, "Metaspace") && !in_seq) { /* every replacement a space; the first token's dropped */
        prepend_scheme ps;
        if (!one_char(d, "replacement", t->dec_first_drop, &t->dec_first_drop_len))
            UNSUPPORTED("tokenizer.json", "decoder Metaspace: \"replacement\" must be one character", dir);
        KVB_TRY(read_prepend_scheme(dir, "decoder", d, &ps));
        dc->from[0] = str_field(d, "replacement");
        dc->to[0] = " ";
        dc->n_rep = 1;
        if (ps == PREPEND_NEVER) t->dec_first_drop_len = 0;
        return KVB_OK;
    }
    if (!strcmp(type, "Replace") && in_seq && dc->stage == 0) {
        if (dc->n_rep == MAX_NORM) UNSUPPORTED("tokenizer.json", "decoder: more than %d Replace steps", dir, MAX_NORM);
        KVB_TRY(replace_strings(dir, "decoder", d, &dc->from[dc->n_rep], &dc->to[dc->n_rep]));
        dc->n_rep++;
        return KVB_OK;
    }
    if (!strcmp(type, "ByteFallback") && in_seq && dc->stage == 0) {
        dc->byte_fallback = 1;
        dc->stage = 1;
        return KVB_OK;
    }
    if (!strcmp(type, "Fuse") && in_seq && dc->stage < 2) {
        dc->stage = 2;
        return KVB_OK;
    }
    if (!strcmp(type, "Strip") && in_seq && dc->stage == 2) { /* on the fused text: only its start changes */
        const json_t *start = json_object_get(d, "start"), *stop = json_object_get(d, "stop");
        if (!one_char(d, "content", t->dec_strip, &t->dec_strip_len) || !json_is_integer(start) ||
            json_integer_value(start) < 0 || json_integer_value(start) > 1024 || !json_is_integer(stop) ||
            json_integer_value(stop) != 0)
            UNSUPPORTED("tokenizer.json", "decoder Strip: only one \"content\" character, \"start\" 0..1024, \"stop\" 0",
                        dir);
        t->dec_strip_n = (int)json_integer_value(start);
        dc->stage = 3;
        return KVB_OK;
    }
    UNSUPPORTED("tokenizer.json",
                "decoder \"%s\" %s (supported: ByteLevel; Metaspace; a Sequence of Replace steps, ByteFallback, Fuse "
                "and Strip, in that order)",
                dir, type, in_seq ? "at this place of its Sequence" : "here");
}

static kvb_status load_post_processor(kvb_tokenizer *t, const char *dir, const json_t *pp) {
    if (!pp || json_is_null(pp)) return KVB_OK;
    const char *type = str_field(pp, "type");
    if (type && !strcmp(type, "ByteLevel")) return KVB_OK; /* offsets only */
    if (type && !strcmp(type, "Sequence")) {
        size_t i;
        const json_t *p;
        json_array_foreach(json_object_get(pp, "processors"), i, p) KVB_TRY(load_post_processor(t, dir, p));
        return KVB_OK;
    }
    if (!type || strcmp(type, "TemplateProcessing"))
        UNSUPPORTED("tokenizer.json", "post_processor type \"%s\" (supported: ByteLevel, TemplateProcessing)", dir,
                    type ? type : "?");
    const json_t *single = json_object_get(pp, "single"), *specials = json_object_get(pp, "special_tokens");
    size_t i;
    const json_t *item;
    int seen_a = 0;
    json_array_foreach(single, i, item) {
        const json_t *sp = json_object_get(item, "SpecialToken");
        if (json_object_get(item, "Sequence")) {
            seen_a = 1;
            continue;
        }
        const char *name = str_field(sp, "id");
        const json_t *ids = json_object_get(json_object_get(specials, name ? name : ""), "ids");
        if (!name || !json_is_array(ids))
            UNSUPPORTED("tokenizer.json", "post_processor.single[%zu]: not a SpecialToken with ids", dir, i);
        size_t k;
        const json_t *id;
        json_array_foreach(ids, k, id) {
            int32_t *dst = seen_a ? t->suffix : t->prefix;
            int *n = seen_a ? &t->n_suffix : &t->n_prefix;
            if (*n == 4 || !json_is_integer(id) || json_integer_value(id) < 0 || json_integer_value(id) >= t->n_vocab)
                UNSUPPORTED("tokenizer.json", "post_processor.special_tokens[\"%s\"].ids: bad id", dir, name);
            dst[(*n)++] = (int32_t)json_integer_value(id);
        }
    }
    return KVB_OK;
}

static int cmp_added_len(const void *a, const void *b) {
    const added_token *x = a, *y = b;
    return x->len != y->len ? (x->len < y->len ? 1 : -1) : (x->id > y->id) - (x->id < y->id);
}

/* The bytes a SentencePiece-style token (its text, or an added token's content) decodes to, stored in
 * t->strings: the text after the decoder's Replace steps; the byte of a <0xNN> token when the decoder
 * has ByteFallback (Hugging Face's ByteFallback reads the token so, after the Replace steps). */
static kvb_status spm_token_bytes(kvb_tokenizer *t, const char *text, size_t n, const decoder_cfg *dc, size_t *off,
                                  uint32_t *len) {
    kvb_buf a = {0}, b = {0};
    kvb_status st;
    KVB_TRY_GOTO(kvb__buf_append(&a, text, n), done); /* a copy: text may lie in t->strings, which moves */
    for (int i = 0; i < dc->n_rep; i++) {
        b.len = 0;
        KVB_TRY_GOTO(replace_all((const uint8_t *)a.p, a.len, dc->from[i], strlen(dc->from[i]), dc->to[i],
                                 strlen(dc->to[i]), SIZE_MAX, &b), done);
        kvb_buf tmp = a;
        a = b;
        b = tmp;
    }
    if (dc->byte_fallback && a.len == 6 && !memcmp(a.p, "<0x", 3) && isxdigit((uint8_t)a.p[3]) &&
        isxdigit((uint8_t)a.p[4]) && a.p[5] == '>') {
        a.p[0] = (char)strtol((char[]){a.p[3], a.p[4], 0}, NULL, 16);
        a.len = 1;
    }
    KVB_TRY_GOTO(strings_add(t, a.p, a.len, off), done);
    *len = (uint32_t)a.len;
done:
    kvb__buf_free(&a);
    kvb__buf_free(&b);
    return st;
}

/* The vocabulary, merges and added tokens of tokenizer.json's "model" and "added_tokens"; the
 * normalizer, pre-tokenizer and decoder are loaded (t->byte_level, dc). */
static kvb_status load_model(kvb_tokenizer *t, const char *dir, const json_t *tj, const json_t *mcfg,
                             const decoder_cfg *dc) {
    const json_t *model = json_object_get(tj, "model"), *added = json_object_get(tj, "added_tokens");
    const char *type = str_field(model, "type");
    if (!type || strcmp(type, "BPE")) UNSUPPORTED("tokenizer.json", "model.type \"%s\" (only BPE)", dir, type ? type : "?");
    t->byte_fallback = bool_field(model, "byte_fallback");
    t->fuse_unk = bool_field(model, "fuse_unk");
    const json_t *dropout = json_object_get(model, "dropout");
    if (dropout && !json_is_null(dropout)) UNSUPPORTED("tokenizer.json", "model.dropout set", dir);
    const char *pfx = str_field(model, "continuing_subword_prefix"), *sfx = str_field(model, "end_of_word_suffix");
    if ((pfx && *pfx) || (sfx && *sfx))
        UNSUPPORTED("tokenizer.json", "model.continuing_subword_prefix / end_of_word_suffix set", dir);
    t->ignore_merges = bool_field(model, "ignore_merges");
    const json_t *vocab = json_object_get(model, "vocab"), *merges = json_object_get(model, "merges");
    if (!json_is_object(vocab) || !json_is_array(merges)) {
        KVB_LOG_E("%s: tokenizer.json: model.vocab (object) and model.merges (array) are required", dir);
        return KVB_ERR_FORMAT;
    }
    /* ids: the largest of the vocabulary and the added tokens. Every id sizes the id-indexed tables, so
     * an id must lie within the vocabulary: below the number of tokens the file defines, or below
     * config.json's vocab_size (the embedding's rows) when that is larger. */
    int64_t max_id = -1, limit = (int64_t)json_object_size(vocab) + (int64_t)json_array_size(added);
    const json_t *vs = json_object_get(mcfg, "vocab_size");
    const char *limit_why = "the tokens tokenizer.json defines";
    if (json_is_integer(vs) && json_integer_value(vs) > limit && json_integer_value(vs) <= MAX_VOCAB) {
        limit = json_integer_value(vs);
        limit_why = "config.json's vocab_size";
    }
    const char *key;
    const json_t *v;
    json_object_foreach((json_t *)vocab, key, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= limit) {
            KVB_LOG_E("%s: tokenizer.json: model.vocab[\"%s\"] is not an id below %lld (%s)", dir, key,
                      (long long)limit, limit_why);
            return KVB_ERR_FORMAT;
        }
        max_id = KVB_MAX(max_id, json_integer_value(v));
    }
    size_t i;
    json_array_foreach(added, i, v) {
        const json_t *id = json_object_get(v, "id");
        if (!json_is_integer(id) || json_integer_value(id) < 0 || !json_is_string(json_object_get(v, "content"))) {
            KVB_LOG_E("%s: tokenizer.json: added_tokens[%zu] needs an \"id\" and a \"content\"", dir, i);
            return KVB_ERR_FORMAT;
        }
        if (json_integer_value(id) >= limit) {
            KVB_LOG_E("%s: tokenizer.json: added_tokens[%zu] has id %lld, beyond the vocabulary (ids below %lld: %s)",
                      dir, i, (long long)json_integer_value(id), (long long)limit, limit_why);
            return KVB_ERR_FORMAT;
        }
        max_id = KVB_MAX(max_id, json_integer_value(id));
    }
    t->n_vocab = (int)(max_id + 1);
    size_t nv = (size_t)t->n_vocab;
    KVB_TRY(kvb_malloc(nv * sizeof *t->tok_str, (void **)&t->tok_str));
    KVB_TRY(kvb_calloc(nv, sizeof *t->tok_str_len, (void **)&t->tok_str_len));
    KVB_TRY(kvb_malloc(nv * sizeof *t->tok_bytes, (void **)&t->tok_bytes));
    KVB_TRY(kvb_calloc(nv, sizeof *t->tok_bytes_len, (void **)&t->tok_bytes_len));
    KVB_TRY(kvb_calloc(nv, 1, (void **)&t->special));
    for (size_t k = 0; k < nv; k++) t->tok_str[k] = t->tok_bytes[k] = SIZE_MAX;
    uint32_t slots = pow2_at_least(2 * json_object_size(vocab) + 1);
    t->vocab_mask = slots - 1;
    KVB_TRY(kvb_malloc(slots * sizeof *t->vocab_slots, (void **)&t->vocab_slots));
    memset(t->vocab_slots, 0xff, slots * sizeof *t->vocab_slots);
    json_object_foreach((json_t *)vocab, key, v) {
        int32_t id = (int32_t)json_integer_value(v);
        size_t len = strlen(key);
        if (t->tok_str[id] != SIZE_MAX) {
            KVB_LOG_E("%s: tokenizer.json: model.vocab: id %d is given twice", dir, id);
            return KVB_ERR_FORMAT;
        }
        KVB_TRY(strings_add(t, key, len, &t->tok_str[id]));
        t->tok_str_len[id] = (uint32_t)len;
        vocab_insert(t, id);
    }
    if (t->byte_level) { /* byte-level alphabet: every byte's character must be a token */
        init_byte_chars(t);
        int16_t char_byte[0x144];
        for (int c = 0; c < 0x144; c++) char_byte[c] = -1;
        for (int b = 0; b < 256; b++) {
            char_byte[t->byte_char[b]] = (int16_t)b;
            uint8_t u[4];
            int len = kvb__utf8_encode(t->byte_char[b], u);
            t->byte_id[b] = vocab_find(t, (const char *)u, (size_t)len);
            if (t->byte_id[b] < 0)
                UNSUPPORTED("tokenizer.json", "model.vocab lacks the byte-level character of byte 0x%02X (not a byte-level BPE vocabulary)",
                            dir, b);
        }
        for (size_t k = 0; k < nv; k++)
            if (t->tok_str[k] != SIZE_MAX) KVB_TRY(set_token_bytes(t, (int32_t)k, char_byte));
    } else { /* SentencePiece style: the <0xNN> tokens, the unk token, every token's decoded bytes */
        for (int b = 0; b < 256; b++) {
            char name[8];
            snprintf(name, sizeof name, "<0x%02X>", b);
            t->fallback_id[b] = vocab_find(t, name, 6);
        }
        const char *unk = str_field(model, "unk_token");
        if (unk && (t->unk_id = vocab_find(t, unk, strlen(unk))) < 0) {
            KVB_LOG_E("%s: tokenizer.json: model.unk_token \"%s\" is not in model.vocab", dir, unk);
            return KVB_ERR_FORMAT;
        }
        for (size_t k = 0; k < nv; k++)
            if (t->tok_str[k] != SIZE_MAX)
                KVB_TRY(spm_token_bytes(t, tok_text(t, (int32_t)k), t->tok_str_len[k], dc, &t->tok_bytes[k],
                                        &t->tok_bytes_len[k]));
    }
    /* merges: "a b" strings or [a, b] pairs; rank = position */
    size_t nm = json_array_size(merges);
    slots = pow2_at_least(2 * nm + 1);
    t->merge_mask = slots - 1;
    KVB_TRY(kvb_malloc(slots * sizeof *t->merges, (void **)&t->merges));
    for (uint32_t k = 0; k < slots; k++) t->merges[k].a = -1;
    json_array_foreach(merges, i, v) {
        const char *a, *b;
        size_t la, lb;
        if (json_is_string(v)) {
            a = json_string_value(v);
            const char *sp = strchr(a, ' ');
            if (!sp) goto bad_merge;
            la = (size_t)(sp - a);
            b = sp + 1;
            lb = strlen(b);
        } else if (json_is_array(v) && json_array_size(v) == 2 && json_is_string(json_array_get(v, 0)) &&
                   json_is_string(json_array_get(v, 1))) {
            a = json_string_value(json_array_get(v, 0));
            b = json_string_value(json_array_get(v, 1));
            la = strlen(a);
            lb = strlen(b);
        } else goto bad_merge;
        int32_t ia = vocab_find(t, a, la), ib = vocab_find(t, b, lb);
        char joined[512];
        if (ia < 0 || ib < 0 || la + lb > sizeof joined) goto bad_merge;
        memcpy(joined, a, la);
        memcpy(joined + la, b, lb);
        int32_t im = vocab_find(t, joined, la + lb);
        if (im < 0) goto bad_merge;
        uint32_t s = (uint32_t)hash_pair(ia, ib) & t->merge_mask;
        while (t->merges[s].a >= 0 && !(t->merges[s].a == ia && t->merges[s].b == ib)) s = (s + 1) & t->merge_mask;
        if (t->merges[s].a >= 0) continue; /* a repeated merge keeps its first (lowest) rank */
        t->merges[s] = (struct merge_slot){ia, ib, (int32_t)i, im};
        continue;
    bad_merge:
        KVB_LOG_E("%s: tokenizer.json: model.merges[%zu] is not a pair of vocabulary tokens whose join is one", dir, i);
        return KVB_ERR_FORMAT;
    }
    /* added tokens */
    KVB_TRY(kvb_calloc(json_array_size(added) + 1, sizeof *t->added, (void **)&t->added));
    json_array_foreach(added, i, v) {
        const char *content = str_field(v, "content");
        int32_t id = (int32_t)json_integer_value(json_object_get(v, "id"));
        size_t len = strlen(content);
        if (!len) continue;
        if (bool_field(v, "single_word"))
            UNSUPPORTED("tokenizer.json", "added_tokens[%zu] (\"%s\"): single_word true", dir, i, content);
        if (kvb__utf8_validate((const uint8_t *)content, len) != len) return KVB_ERR_FORMAT;
        if (t->tok_str[id] == SIZE_MAX) {
            KVB_TRY(strings_add(t, content, len, &t->tok_str[id]));
            t->tok_str_len[id] = (uint32_t)len;
        }
        /* an added token decodes to its content: never through the byte-level map, through a
         * SentencePiece-style decoder as every token does */
        size_t content_off;
        KVB_TRY(strings_add(t, content, len, &content_off));
        if (t->byte_level) {
            t->tok_bytes[id] = content_off;
            t->tok_bytes_len[id] = (uint32_t)len;
        } else
            KVB_TRY(spm_token_bytes(t, content, len, dc, &t->tok_bytes[id], &t->tok_bytes_len[id]));
        t->special[id] = (uint8_t)bool_field(v, "special");
        added_token *a = &t->added[t->n_added++];
        a->id = id;
        a->len = len;
        a->content_off = content_off;
        a->content = NULL; /* set below, once strings stops moving */
        a->special = t->special[id];
        a->lstrip = bool_field(v, "lstrip");
        a->rstrip = bool_field(v, "rstrip");
    }
    for (int k = 0; k < t->n_added; k++) t->added[k].content = t->strings + t->added[k].content_off;
    qsort(t->added, (size_t)t->n_added, sizeof *t->added, cmp_added_len);
    return trie_build(t);
}

/* Hugging Face merges a SentencePiece-style section (no pre-tokenizer, or Metaspace without split) as
 * one piece: over a long text that is slow (every merge jumps through the whole text) and the word
 * cache never hits. When no vocabulary token has the space character right after another character
 * (Llama-2 and Mistral have "▁" inside a token only in runs of "▁"), no merge can join the symbols on
 * either side of a "▁" that follows another character, since every merge makes a vocabulary token; so
 * merging the words between such places one by one gives the same tokens. Sets t->space when so. */
static void spm_word_split(kvb_tokenizer *t) {
    const char *sp = NULL;
    size_t sl = 0;
    if (t->byte_level || t->ignore_merges || t->n_regex) return; /* ignore_merges: a whole piece may be a token */
    if (t->metaspace.on) {
        sp = t->metaspace.rep;
        sl = t->metaspace.rep_len;
    }
    for (int i = 0; i < t->n_norm && !sp; i++) {
        uint32_t cp;
        const norm_step *st = &t->norm[i];
        if (st->kind == NORM_REPLACE && st->from_len == 1 && st->from[0] == ' ' && st->to_len <= 4 &&
            (size_t)kvb__utf8_decode((const uint8_t *)st->to, st->to_len, &cp) == st->to_len) {
            sp = st->to;
            sl = st->to_len;
        }
    }
    if (!sp || vocab_find(t, sp, sl) < 0) return;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        if (t->tok_str[id] == SIZE_MAX) continue;
        const char *s = tok_text(t, id), *e = s + t->tok_str_len[id];
        for (const char *p = s + 1; p < e && (p = memmem(p, (size_t)(e - p), sp, sl)); p += sl)
            if ((size_t)(p - s) < sl || memcmp(p - sl, sp, sl)) return; /* after another character */
    }
    memcpy(t->space, sp, sl);
    t->space_len = sl;
}

/* The pieces fit together: byte-level BPE (a ByteLevel pre-tokenizer) decodes with ByteLevel (or no
 * decoder); SentencePiece style needs its own decoder; Metaspace splits alone. */
static kvb_status check_pipeline(const kvb_tokenizer *t, const char *dir, int has_decoder, const decoder_cfg *dc) {
    if (t->metaspace.on && (t->byte_level || t->n_regex))
        UNSUPPORTED("tokenizer.json", "pre_tokenizer: Metaspace with other pre-tokenizers (only alone)", dir);
    if (t->byte_level && has_decoder && !dc->byte_level)
        UNSUPPORTED("tokenizer.json", "decoder: a ByteLevel pre-tokenizer needs the ByteLevel decoder", dir);
    if (!t->byte_level && dc->byte_level)
        UNSUPPORTED("tokenizer.json", "decoder ByteLevel without a ByteLevel pre-tokenizer", dir);
    if (!t->byte_level && !has_decoder)
        UNSUPPORTED("tokenizer.json", "decoder null: SentencePiece-style BPE needs a decoder (without one, Hugging Face "
                    "joins the tokens with spaces)", dir);
    return KVB_OK;
}

/* tokenizer_config.json's bos_token etc.: a string, an AddedToken object {"content": ...}, or null. */
static kvb_status config_token(const json_t *cfg, const char *key, char **out) {
    const json_t *v = json_object_get(cfg, key);
    const char *s = json_is_string(v) ? json_string_value(v) : str_field(v, "content");
    return s ? kvb_strdup(s, out) : KVB_OK;
}

kvb_status kvb__model_json(const char *dir, const char *name, int optional, int int_as_real, json_t **out) {
    char path[PATH_MAX];
    *out = NULL;
    if (snprintf(path, sizeof path, "%s/%s", dir, name) >= (int)sizeof path) return KVB_ERR_INVALID;
    if (access(path, F_OK) != 0) {
        if (optional) return KVB_OK;
        KVB_LOG_E("%s: not found", path);
        return KVB_ERR_NOT_FOUND;
    }
    return kvb_json_load_file_flags(path, int_as_real ? JSON_DECODE_INT_AS_REAL : 0, out);
}

/* eos_token_id of generation_config.json or config.json: an int or a list; 0 when absent. */
static kvb_status eos_from(kvb_tokenizer *t, const char *dir, const char *file, const json_t *j) {
    const json_t *v = json_object_get(j, "eos_token_id");
    if (!v || json_is_null(v)) return KVB_OK;
    json_t *one = json_is_integer(v) ? json_pack("[O]", v) : json_incref((json_t *)v);
    size_t i;
    const json_t *id;
    kvb_status st = KVB_OK;
    if (!json_is_array(one)) st = KVB_ERR_FORMAT;
    json_array_foreach(one, i, id) {
        if (!json_is_integer(id) || json_integer_value(id) < 0 || json_integer_value(id) >= t->n_vocab ||
            i >= KVB_ARRAY_LEN(t->eos)) {
            st = KVB_ERR_FORMAT;
            break;
        }
        t->eos[t->n_eos++] = (int32_t)json_integer_value(id);
    }
    json_decref(one);
    if (st != KVB_OK) {
        t->n_eos = 0;
        KVB_LOG_E("%s: %s: eos_token_id must be a token id below %d or a list of at most %zu", dir, file, t->n_vocab,
                  KVB_ARRAY_LEN(t->eos));
    }
    return st;
}

kvb_status kvb_tokenizer_load(const char *model_dir, kvb_tokenizer **out) {
    kvb_status st;
    json_t *tj = NULL, *cfg = NULL, *gen = NULL, *mcfg = NULL;
    *out = NULL;
    kvb_tokenizer *t;
    KVB_TRY(kvb_calloc(1, sizeof *t, (void **)&t));
    pthread_mutex_init(&t->cache_lock, NULL);
    t->bos_id = -1;
    t->unk_id = -1;
    kvb_text_limits lim;
    kvb_text_limits_default(&lim);
    kvb_tokenizer_set_limits(t, &lim);
    KVB_TRY_GOTO(kvb__model_json(model_dir, "tokenizer.json", 0, 0, &tj), fail);
    KVB_TRY_GOTO(kvb__model_json(model_dir, "config.json", 1, 0, &mcfg), fail);
    KVB_TRY_GOTO(load_normalizer(t, model_dir, json_object_get(tj, "normalizer")), fail);
    KVB_TRY_GOTO(load_pre_tokenizer(t, model_dir, json_object_get(tj, "pre_tokenizer")), fail);
    decoder_cfg dc = {0};
    const json_t *dec = json_object_get(tj, "decoder");
    if (dec && !json_is_null(dec)) KVB_TRY_GOTO(load_decoder(t, model_dir, dec, 0, &dc), fail);
    KVB_TRY_GOTO(check_pipeline(t, model_dir, dec && !json_is_null(dec), &dc), fail);
    KVB_TRY_GOTO(load_model(t, model_dir, tj, mcfg, &dc), fail);
    KVB_TRY_GOTO(load_post_processor(t, model_dir, json_object_get(tj, "post_processor")), fail);
    spm_word_split(t);

    KVB_TRY_GOTO(kvb__model_json(model_dir, "tokenizer_config.json", 1, 1, &cfg), fail);
    KVB_TRY_GOTO(kvb__model_json(model_dir, "generation_config.json", 1, 0, &gen), fail);
    KVB_TRY_GOTO(config_token(cfg, "bos_token", &t->bos_str), fail);
    KVB_TRY_GOTO(config_token(cfg, "eos_token", &t->eos_str), fail);
    KVB_TRY_GOTO(config_token(cfg, "pad_token", &t->pad_str), fail);
    KVB_TRY_GOTO(config_token(cfg, "unk_token", &t->unk_str), fail);
    if (t->bos_str) t->bos_id = kvb_tokenizer_token_id(t, t->bos_str);
    /* without a post-processor template, the slow tokenizers' add_bos_token / add_eos_token decide */
    if (!t->n_prefix && !t->n_suffix) {
        if (bool_field(cfg, "add_bos_token") && t->bos_id >= 0) t->prefix[t->n_prefix++] = t->bos_id;
        int32_t eos = t->eos_str ? kvb_tokenizer_token_id(t, t->eos_str) : -1;
        if (bool_field(cfg, "add_eos_token") && eos >= 0) t->suffix[t->n_suffix++] = eos;
    }
    KVB_TRY_GOTO(eos_from(t, model_dir, "generation_config.json", gen), fail);
    if (!t->n_eos) KVB_TRY_GOTO(eos_from(t, model_dir, "config.json", mcfg), fail);
    if (!t->n_eos && t->eos_str) {
        int32_t id = kvb_tokenizer_token_id(t, t->eos_str);
        if (id >= 0) t->eos[t->n_eos++] = id;
    }
    KVB_TRY_GOTO(kvb_calloc(CACHE_SLOTS, sizeof *t->cache, (void **)&t->cache), fail);
    json_decref(tj);
    json_decref(cfg);
    json_decref(gen);
    json_decref(mcfg);
    *out = t;
    return KVB_OK;
fail:
    json_decref(tj);
    json_decref(cfg);
    json_decref(gen);
    json_decref(mcfg);
    kvb_tokenizer_destroy(t);
    return st;
}

static void cache_clear(kvb_tokenizer *t) {
    for (uint32_t i = 0; i < CACHE_SLOTS; i++) {
        free(t->cache[i].key);
        t->cache[i].key = NULL;
    }
    t->cache_used = 0;
}

void kvb_tokenizer_destroy(kvb_tokenizer *t) {
    if (!t) return;
    if (t->cache) cache_clear(t);
    free(t->cache);
    pthread_mutex_destroy(&t->cache_lock);
    for (int i = 0; i < t->n_regex; i++) pcre2_code_free(t->regex[i]);
    for (int i = 0; i < t->n_norm; i++) {
        free(t->norm[i].from);
        free(t->norm[i].to);
    }
    free(t->strings);
    free(t->tok_str);
    free(t->tok_str_len);
    free(t->tok_bytes);
    free(t->tok_bytes_len);
    free(t->special);
    free(t->vocab_slots);
    free(t->merges);
    free(t->added);
    free(t->trie_key);
    free(t->trie_child);
    free(t->trie_tok);
    free(t->bos_str);
    free(t->eos_str);
    free(t->pad_str);
    free(t->unk_str);
    free(t);
}

/* ------------------------------------------------------------------------------------- queries */

void kvb_tokenizer_set_limits(kvb_tokenizer *t, const kvb_text_limits *l) {
    t->max_encode = l->encode_bytes;
    t->max_decode = l->decode_ids;
}

int kvb_tokenizer_vocab_size(const kvb_tokenizer *t) { return t->n_vocab; }

int kvb_tokenizer_eos_ids(const kvb_tokenizer *t, const int32_t **ids) {
    *ids = t->eos;
    return t->n_eos;
}

int32_t kvb_tokenizer_bos_id(const kvb_tokenizer *t) { return t->bos_id; }

const char *kvb_tokenizer_token_str(const kvb_tokenizer *t, const char *which) {
    if (!strcmp(which, "bos_token")) return t->bos_str;
    if (!strcmp(which, "eos_token")) return t->eos_str;
    if (!strcmp(which, "pad_token")) return t->pad_str;
    if (!strcmp(which, "unk_token")) return t->unk_str;
    return NULL;
}

int32_t kvb_tokenizer_token_id(const kvb_tokenizer *t, const char *token) {
    size_t n = strlen(token);
    uint32_t node = 0;
    for (size_t i = 0; i < n && t->n_trie; i++)
        if (!(node = trie_next(t, node, (uint8_t)token[i]))) break;
    if (n && node && t->trie_tok[node] >= 0) return t->added[t->trie_tok[node]].id;
    return vocab_find(t, token, n);
}

int kvb_tokenizer_is_special(const kvb_tokenizer *t, int32_t id) {
    return id >= 0 && id < t->n_vocab && t->special[id];
}

const char *kvb_tokenizer_token_bytes(const kvb_tokenizer *t, int32_t id, size_t *len) {
    *len = 0;
    if (id < 0 || id >= t->n_vocab || t->tok_bytes[id] == SIZE_MAX) return NULL;
    *len = t->tok_bytes_len[id];
    return t->strings + t->tok_bytes[id];
}

/* ------------------------------------------------------------------------------------- encoding */

typedef struct id_vec {
    int32_t *v;
    int n, cap;
} id_vec;

static kvb_status ids_push(id_vec *o, const int32_t *ids, int n) {
    if (n <= 0) return KVB_OK; /* an empty push may come with a NULL vector: memcpy must not see it */
    if (o->n + n > o->cap) {
        int cap = o->cap ? o->cap : 64;
        while (cap < o->n + n) cap *= 2;
        KVB_TRY(kvb_realloc_array((void **)&o->v, (size_t)cap, sizeof *o->v));
        o->cap = cap;
    }
    memcpy(o->v + o->n, ids, (size_t)n * sizeof *ids);
    o->n += n;
    return KVB_OK;
}

static int cache_get(kvb_tokenizer *t, uint64_t h, const uint8_t *s, size_t n, id_vec *out, kvb_status *st) {
    int hit = 0;
    pthread_mutex_lock(&t->cache_lock);
    for (uint32_t i = (uint32_t)h & (CACHE_SLOTS - 1);; i = (i + 1) & (CACHE_SLOTS - 1)) {
        cache_entry *e = &t->cache[i];
        if (!e->key) break;
        if (e->hash == h && e->key_len == n && !memcmp(e->key, s, n)) {
            int32_t ids[CACHE_MAX_WORD];
            memcpy(ids, e->key + n, e->n * sizeof(int32_t));
            hit = 1;
            pthread_mutex_unlock(&t->cache_lock);
            *st = ids_push(out, ids, (int)e->n);
            return hit;
        }
    }
    pthread_mutex_unlock(&t->cache_lock);
    return hit;
}

static void cache_put(kvb_tokenizer *t, uint64_t h, const uint8_t *s, size_t n, const int32_t *ids, int k) {
    char *key = malloc(n + (size_t)k * sizeof(int32_t));
    if (!key) return; /* the cache is an optimization: skip it */
    memcpy(key, s, n);
    memcpy(key + n, ids, (size_t)k * sizeof(int32_t));
    pthread_mutex_lock(&t->cache_lock);
    if (t->cache_used >= CACHE_SLOTS / 4 * 3) cache_clear(t);
    uint32_t i = (uint32_t)h & (CACHE_SLOTS - 1);
    while (t->cache[i].key) {
        if (t->cache[i].hash == h && t->cache[i].key_len == n && !memcmp(t->cache[i].key, s, n)) { /* raced */
            pthread_mutex_unlock(&t->cache_lock);
            free(key);
            return;
        }
        i = (i + 1) & (CACHE_SLOTS - 1);
    }
    t->cache[i] = (cache_entry){h, key, (uint32_t)n, (uint32_t)k};
    t->cache_used++;
    pthread_mutex_unlock(&t->cache_lock);
}

/* The pairs of adjacent symbols that have a merge, as an indexed min-heap: one entry per left symbol,
 * keyed (rank << 32 | position), so the lowest rank comes first and the leftmost among equals (as
 * Hugging Face's BPE); where[] finds a position's entry to change or remove it when a merge changes
 * its pair. At most one entry per symbol: 12 bytes each, however many merges happen. */
typedef struct pair_heap {
    uint64_t *key;  /* [n symbols] heap of (rank << 32 | position) */
    int32_t *where; /* [n symbols] index in key of the position's entry, or -1 */
    int n;
} pair_heap;

static void heap_place(pair_heap *h, int i, uint64_t k) {
    h->key[i] = k;
    h->where[(uint32_t)k] = i;
}

static void heap_up(pair_heap *h, int i) {
    uint64_t k = h->key[i];
    while (i > 0 && k < h->key[(i - 1) / 2]) {
        heap_place(h, i, h->key[(i - 1) / 2]);
        i = (i - 1) / 2;
    }
    heap_place(h, i, k);
}

static void heap_down(pair_heap *h, int i) {
    uint64_t k = h->key[i];
    for (;;) {
        int c = 2 * i + 1;
        if (c >= h->n) break;
        if (c + 1 < h->n && h->key[c + 1] < h->key[c]) c++;
        if (h->key[c] >= k) break;
        heap_place(h, i, h->key[c]);
        i = c;
    }
    heap_place(h, i, k);
}

static void heap_remove(pair_heap *h, int32_t pos) {
    int i = h->where[pos];
    if (i < 0) return;
    h->where[pos] = -1;
    if (i == --h->n) return;
    uint64_t old = h->key[i], last = h->key[h->n];
    heap_place(h, i, last);
    if (last < old) heap_up(h, i);
    else heap_down(h, i);
}

/* Sets the entry of position `pos` to its pair's merge (removed when the pair has none). */
static void heap_set(pair_heap *h, const kvb_tokenizer *t, int32_t pos, int32_t a, int32_t b) {
    const struct merge_slot *m = b >= 0 ? merge_find(t, a, b) : NULL;
    if (!m) {
        heap_remove(h, pos);
        return;
    }
    uint64_t k = (uint64_t)(uint32_t)m->rank << 32 | (uint32_t)pos;
    int i = h->where[pos];
    if (i < 0) {
        i = h->n++;
        heap_place(h, i, k);
        heap_up(h, i);
    } else if (k != h->key[i]) {
        uint64_t old = h->key[i];
        heap_place(h, i, k);
        if (k < old) heap_up(h, i);
        else heap_down(h, i);
    }
}

/* The first symbols of a SentencePiece-style piece s[0..n) (valid UTF-8), into sym[] (at most n): each
 * character's token; a character the vocabulary lacks becomes its <0xNN> tokens (byte_fallback, when
 * all of them exist), else the unk token (one for a run of them with fuse_unk), else nothing. As
 * Hugging Face's BPE does it, a pending unk is written only when a known character or the end comes. */
static int spm_symbols(const kvb_tokenizer *t, const uint8_t *s, size_t n, int32_t *sym) {
    int k = 0, unk = 0;
    for (size_t i = 0; i < n;) {
        size_t len = s[i] < 0x80 ? 1 : s[i] < 0xE0 ? 2 : s[i] < 0xF0 ? 3 : 4;
        int32_t id = vocab_find(t, (const char *)s + i, len);
        int bytes = id < 0 && t->byte_fallback;
        for (size_t b = 0; bytes && b < len; b++) bytes = t->fallback_id[s[i + b]] >= 0;
        if (id >= 0) {
            if (unk) sym[k++] = t->unk_id;
            unk = 0;
            sym[k++] = id;
        } else if (bytes) {
            for (size_t b = 0; b < len; b++) sym[k++] = t->fallback_id[s[i + b]];
        } else if (t->unk_id >= 0) {
            if (unk && !t->fuse_unk) sym[k++] = t->unk_id;
            unk = 1;
        }
        i += len;
    }
    if (unk) sym[k++] = t->unk_id;
    return k;
}

/* The vocabulary id of the whole piece s[0..n) (in the byte-level alphabet for byte-level BPE), or -1. */
static int32_t whole_piece(const kvb_tokenizer *t, const uint8_t *s, size_t n) {
    if (!t->byte_level) return vocab_find(t, (const char *)s, n);
    char small[4 * CACHE_MAX_WORD];
    if (2 * n > sizeof small) return -1; /* a byte-level character takes at most 2 bytes */
    size_t k = 0;
    for (size_t i = 0; i < n; i++) k += (size_t)kvb__utf8_encode(t->byte_char[s[i]], (uint8_t *)small + k);
    return vocab_find(t, small, k);
}

/* BPE of one pre-tokenized piece s[0..n) (raw bytes): its first symbols (one per byte for byte-level
 * BPE, one per character or byte token for SentencePiece style), then merges by rank. */
static kvb_status bpe_piece(const kvb_tokenizer *tc, const uint8_t *s, size_t n, id_vec *out) {
    kvb_tokenizer *t = (kvb_tokenizer *)tc; /* only the word cache changes, under its lock */
    kvb_status st = KVB_OK;
    uint64_t h = 0;
    int cacheable = n <= CACHE_MAX_WORD;
    if (cacheable) {
        h = hash_bytes(s, n);
        if (cache_get(t, h, s, n, out, &st)) return st;
    }
    if (t->ignore_merges) { /* the whole piece, if the vocabulary has it */
        int32_t id = whole_piece(t, s, n);
        if (id >= 0) {
            if (cacheable) cache_put(t, h, s, n, &id, 1);
            return ids_push(out, &id, 1);
        }
    }
    int32_t *sym = NULL, *next = NULL, *prev = NULL;
    pair_heap heap = {0};
    KVB_TRY_GOTO(kvb_malloc(n * sizeof *sym, (void **)&sym), done);
    KVB_TRY_GOTO(kvb_malloc(n * sizeof *next, (void **)&next), done);
    KVB_TRY_GOTO(kvb_malloc(n * sizeof *prev, (void **)&prev), done);
    KVB_TRY_GOTO(kvb_malloc(n * sizeof *heap.key, (void **)&heap.key), done);
    KVB_TRY_GOTO(kvb_malloc(n * sizeof *heap.where, (void **)&heap.where), done);
    size_t nsym = n;
    if (t->byte_level)
        for (size_t i = 0; i < n; i++) sym[i] = t->byte_id[s[i]];
    else if (!(nsym = (size_t)spm_symbols(t, s, n, sym)))
        goto done; /* only unknown characters, and no unk token */
    for (size_t i = 0; i < nsym; i++) {
        next[i] = i + 1 < nsym ? (int32_t)i + 1 : -1;
        prev[i] = (int32_t)i - 1;
        heap.where[i] = -1;
    }
    for (size_t i = 0; i + 1 < nsym; i++) heap_set(&heap, t, (int32_t)i, sym[i], sym[i + 1]);
    while (heap.n > 0) {
        int32_t p = (int32_t)(uint32_t)heap.key[0], q = next[p];
        sym[p] = merge_find(t, sym[p], sym[q])->id;
        heap_remove(&heap, p);
        heap_remove(&heap, q); /* q's pair is gone with q */
        next[p] = next[q];
        if (next[q] >= 0) prev[next[q]] = p;
        if (prev[p] >= 0) heap_set(&heap, t, prev[p], sym[prev[p]], sym[p]);
        heap_set(&heap, t, p, sym[p], next[p] >= 0 ? sym[next[p]] : -1);
    }
    int k = 0;
    for (int32_t i = 0; i >= 0; i = next[i]) sym[k++] = sym[i];
    if (cacheable) cache_put(t, h, s, n, sym, k);
    st = ids_push(out, sym, k);
done:
    free(sym);
    free(next);
    free(prev);
    free(heap.key);
    free(heap.where);
    return st;
}

/* Splits s[0..n) with regex `level` (matches and the gaps between them) and hands each piece to the
 * next level; past the last regex, to BPE. */
static kvb_status split_piece(const kvb_tokenizer *t, int level, const uint8_t *s, size_t n, pcre2_match_data *md,
                              id_vec *out) {
    if (!n) return KVB_OK;
    if (level == t->n_regex) return bpe_piece(t, s, n, out);
    size_t pos = 0, start = 0;
    while (start < n) {
        int rc = pcre2_match(t->regex[level], s, n, start, PCRE2_NO_UTF_CHECK, md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            KVB_LOG_E("tokenizer: pre-tokenizer regex failed: %s", (char *)msg);
            return KVB_ERR_INVALID;
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        if (ov[0] > pos) KVB_TRY(split_piece(t, level + 1, s + pos, ov[0] - pos, md, out));
        if (ov[1] > ov[0]) {
            KVB_TRY(split_piece(t, level + 1, s + ov[0], ov[1] - ov[0], md, out));
            pos = start = ov[1];
        } else { /* an empty match: the gap before it is done; step over one character */
            pos = ov[1];
            start = ov[1] + 1;
            while (start < n && (s[start] & 0xC0) == 0x80) start++;
        }
    }
    if (pos < n) KVB_TRY(split_piece(t, level + 1, s + pos, n - pos, md, out));
    return KVB_OK;
}

/* The growth a normalizer may give a section of n bytes (NORM_GROWTH). */
static kvb_status norm_check(const kvb_tokenizer *t, size_t n, size_t got) {
    (void)t;
    if (got <= NORM_GROWTH * n + NORM_SLACK) return KVB_OK;
    KVB_LOG_W("tokenizer: normalizing %zu bytes of text gives more than %zu bytes (%d times the text, plus %d)", n,
              (size_t)NORM_GROWTH * n + NORM_SLACK, NORM_GROWTH, NORM_SLACK);
    return KVB_ERR_EXHAUSTED;
}

/* Scratch of an encode: two buffers the normalizer's steps write in turn. */
typedef struct enc_scratch {
    kvb_buf buf[2];
    int cur; /* the buffer the next step writes */
} enc_scratch;

static kvb_buf *scratch_next(enc_scratch *sc) {
    kvb_buf *b = &sc->buf[sc->cur];
    sc->cur ^= 1;
    b->len = 0;
    return b;
}

/* Section s[0..n) -> its normalized text, in *s, *n (pointing into sc). */
static kvb_status normalize(const kvb_tokenizer *t, const uint8_t **s, size_t *n, enc_scratch *sc) {
    size_t n0 = *n;
    for (int i = 0; i < t->n_norm && *n; i++) { /* an empty text stays empty (Prepend adds to none) */
        const norm_step *st = &t->norm[i];
        kvb_buf *o = scratch_next(sc);
        if (st->kind == NORM_NFC) KVB_TRY(kvb__nfc(*s, *n, o));
        else if (st->kind == NORM_PREPEND) {
            KVB_TRY(kvb__buf_append(o, st->to, st->to_len));
            KVB_TRY(kvb__buf_append(o, *s, *n));
        } else {
            kvb_status rs = replace_all(*s, *n, st->from, st->from_len, st->to, st->to_len,
                                        NORM_GROWTH * n0 + NORM_SLACK, o);
            if (rs == KVB_ERR_EXHAUSTED) return norm_check(t, n0, SIZE_MAX);
            KVB_TRY(rs);
        }
        KVB_TRY(norm_check(t, n0, o->len));
        *s = (const uint8_t *)o->p;
        *n = o->len;
    }
    return KVB_OK;
}

/* A SentencePiece-style piece merged word by word where that is exact (spm_word_split): a word starts
 * at each space character that follows another character. */
static kvb_status spm_words(const kvb_tokenizer *t, const uint8_t *s, size_t n, pcre2_match_data *md, id_vec *out) {
    size_t start = 0, sl = t->space_len;
    for (const uint8_t *p = s + 1; n > 1 && (p = memmem(p, (size_t)(s + n - p), t->space, sl)); p += sl) {
        size_t at = (size_t)(p - s);
        if (at >= sl && !memcmp(s + at - sl, t->space, sl)) continue; /* in a run of them */
        KVB_TRY(split_piece(t, 0, s + start, at - start, md, out));
        start = at;
    }
    return split_piece(t, 0, s + start, n - start, md, out);
}

/* Metaspace: every " " becomes the replacement character, one goes in front as prepend_scheme says
 * (`first`: the section starts the text), and the text splits before each one (split), as Hugging
 * Face's Metaspace pre-tokenizer does. */
static kvb_status metaspace_split(const kvb_tokenizer *t, const uint8_t *s, size_t n, int first, enc_scratch *sc,
                                  pcre2_match_data *md, id_vec *out) {
    const char *rep = t->metaspace.rep;
    size_t rl = t->metaspace.rep_len, n0 = n;
    kvb_buf *o = scratch_next(sc);
    int pre = t->metaspace.prepend == PREPEND_ALWAYS || (t->metaspace.prepend == PREPEND_FIRST && first);
    /* not when the text (with its spaces replaced) starts with the character already */
    int starts = s[0] == ' ' || (n >= rl && !memcmp(s, rep, rl));
    if (pre && !starts) KVB_TRY(kvb__buf_append(o, rep, rl));
    kvb_status rs = replace_all(s, n, " ", 1, rep, rl, NORM_GROWTH * n0 + NORM_SLACK, o);
    if (rs == KVB_ERR_EXHAUSTED) return norm_check(t, n0, SIZE_MAX);
    KVB_TRY(rs);
    s = (const uint8_t *)o->p;
    n = o->len;
    if (!t->metaspace.split) return t->space_len ? spm_words(t, s, n, md, out) : split_piece(t, 0, s, n, md, out);
    size_t start = 0;
    for (const uint8_t *p = s + 1; n > 1 && (p = memmem(p, (size_t)(s + n - p), rep, rl)); p += rl) {
        KVB_TRY(split_piece(t, 0, s + start, (size_t)(p - s) - start, md, out));
        start = (size_t)(p - s);
    }
    return split_piece(t, 0, s + start, n - start, md, out);
}

/* One section of text between added tokens; `first`: it starts the text. */
static kvb_status encode_section(const kvb_tokenizer *t, const uint8_t *s, size_t n, int first, pcre2_match_data *md,
                                 enc_scratch *sc, id_vec *out) {
    if (!n) return KVB_OK;
    KVB_TRY(normalize(t, &s, &n, sc));
    if (t->metaspace.on && n) return metaspace_split(t, s, n, first, sc, md, out);
    if (t->space_len) return spm_words(t, s, n, md, out);
    return split_piece(t, 0, s, n, md, out);
}

/* The added token that matches at s[0..n) (the longest), or NULL. */
static const added_token *added_at(const kvb_tokenizer *t, const uint8_t *s, size_t n) {
    if (!t->added_first[s[0]]) return NULL;
    int32_t best = -1;
    uint32_t node = 0;
    for (size_t i = 0; i < n && (node = trie_next(t, node, s[i])); i++)
        if (t->trie_tok[node] >= 0) best = t->trie_tok[node];
    return best >= 0 ? &t->added[best] : NULL;
}

static int is_space_at(const uint8_t *s, size_t n, int *len) {
    uint32_t cp;
    *len = kvb__utf8_decode(s, n, &cp);
    if (!*len) return 0;
    return (cp >= 9 && cp <= 13) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
           cp == 0x3000;
}

kvb_status kvb_tokenizer_encode(const kvb_tokenizer *t, const char *text, size_t len, int add_special, int32_t **ids,
                                int *n) {
    const uint8_t *s = (const uint8_t *)text;
    *ids = NULL;
    *n = 0;
    if (len > t->max_encode) {
        KVB_LOG_W("tokenizer: %zu bytes of text exceed the encode budget of %zu bytes", len, t->max_encode);
        return KVB_ERR_EXHAUSTED;
    }
    size_t bad = kvb__utf8_validate(s, len);
    if (bad != len) {
        KVB_LOG_W("tokenizer: the text is not valid UTF-8 at byte %zu", bad);
        return KVB_ERR_INVALID;
    }
    if (len > (size_t)INT32_MAX / 2) return KVB_ERR_INVALID;
    id_vec out = {0};
    enc_scratch sc = {0};
    kvb_status st = KVB_OK;
    pcre2_match_data *md = t->n_regex ? pcre2_match_data_create_from_pattern(t->regex[0], NULL) : NULL;
    if (t->n_regex && !md) return KVB_ERR_NOMEM;
    if (add_special) KVB_TRY_GOTO(ids_push(&out, t->prefix, t->n_prefix), done);
    size_t sec = 0, i = 0;
    while (i < len) {
        const added_token *a = t->n_added ? added_at(t, s + i, len - i) : NULL;
        if (!a) {
            i++;
            continue;
        }
        size_t end = i;
        int w;
        if (a->lstrip) /* the token takes the whitespace on its left */
            while (end > sec) {
                size_t b = end - 1;
                while (b > sec && (s[b] & 0xC0) == 0x80) b--;
                if (!is_space_at(s + b, end - b, &w)) break;
                end = b;
            }
        KVB_TRY_GOTO(encode_section(t, s + sec, end - sec, sec == 0, md, &sc, &out), done);
        KVB_TRY_GOTO(ids_push(&out, &a->id, 1), done);
        i += a->len;
        if (a->rstrip)
            while (i < len && is_space_at(s + i, len - i, &w)) i += (size_t)w;
        sec = i;
    }
    KVB_TRY_GOTO(encode_section(t, s + sec, len - sec, sec == 0, md, &sc, &out), done);
    if (add_special) KVB_TRY_GOTO(ids_push(&out, t->suffix, t->n_suffix), done);
    *ids = out.v;
    *n = out.n;
    out.v = NULL;
done:
    pcre2_match_data_free(md);
    kvb__buf_free(&sc.buf[0]);
    kvb__buf_free(&sc.buf[1]);
    free(out.v);
    return st;
}

/* ------------------------------------------------------------------------------------- decoding */

/* Appends the bytes of `id` to `raw` (nothing for ids without a token, as Hugging Face skips them).
 * *first: no token has been appended yet (a Metaspace decoder drops every replacement character of
 * the first token's text); cleared once one is. */
static kvb_status token_bytes(const kvb_tokenizer *t, int32_t id, int skip_special, int *first, kvb_buf *raw) {
    if (id < 0) {
        KVB_LOG_W("tokenizer: cannot decode the negative token id %d", id);
        return KVB_ERR_INVALID;
    }
    if (id >= t->n_vocab || t->tok_bytes[id] == SIZE_MAX || (skip_special && t->special[id])) return KVB_OK;
    if (*first && t->dec_first_drop_len) {
        *first = 0;
        const char *p = tok_text(t, id), *e = p + t->tok_str_len[id], *m;
        size_t dl = t->dec_first_drop_len;
        for (; (m = memmem(p, (size_t)(e - p), t->dec_first_drop, dl)); p = m + dl) KVB_TRY(kvb__buf_append(raw, p, (size_t)(m - p)));
        return kvb__buf_append(raw, p, (size_t)(e - p));
    }
    *first = 0;
    return kvb__buf_append(raw, t->strings + t->tok_bytes[id], t->tok_bytes_len[id]);
}

/* How many bytes of s[0..n), the start of the decoded text, a Strip decoder takes: up to *left of its
 * character. *left counts down; it drops to 0 once anything else came (the start is over). */
static size_t strip_start(const kvb_tokenizer *t, const char *s, size_t n, int *left) {
    size_t k = 0, cl = t->dec_strip_len;
    while (*left > 0 && n - k >= cl && !memcmp(s + k, t->dec_strip, cl)) {
        k += cl;
        (*left)--;
    }
    if (k < n) *left = 0;
    return k;
}

kvb_status kvb_tokenizer_decode(const kvb_tokenizer *t, const int32_t *ids, int n, int skip_special, char **out,
                                size_t *len) {
    kvb_buf raw = {0}, txt = {0};
    kvb_status st = KVB_OK;
    size_t used;
    int first = 1, left = t->dec_strip_n;
    *out = NULL;
    *len = 0;
    if (n < 0 || (size_t)n > t->max_decode) {
        KVB_LOG_W("tokenizer: %d ids to decode exceed the decode budget of %zu ids", n, t->max_decode);
        return KVB_ERR_EXHAUSTED;
    }
    for (int i = 0; i < n; i++) KVB_TRY_GOTO(token_bytes(t, ids[i], skip_special, &first, &raw), fail);
    KVB_TRY_GOTO(kvb__buf_reserve(&txt, 0), fail);
    KVB_TRY_GOTO(kvb__utf8_lossy((const uint8_t *)raw.p, raw.len, 1, &txt, &used), fail);
    size_t cut = strip_start(t, txt.p, txt.len, &left);
    memmove(txt.p, txt.p + cut, txt.len - cut + 1);
    txt.len -= cut;
    kvb__buf_free(&raw);
    *out = txt.p;
    *len = txt.len;
    return KVB_OK;
fail:
    kvb__buf_free(&raw);
    kvb__buf_free(&txt);
    return st;
}

struct kvb_detok {
    const kvb_tokenizer *t;
    int skip_special;
    int first;       /* no token has given bytes yet */
    int strip_left;  /* what a Strip decoder may still take off the start */
    kvb_buf pending; /* bytes of an incomplete UTF-8 sequence at the end of the stream so far */
    kvb_buf text;    /* the text handed out by the last call */
};

kvb_status kvb_detok_create(const kvb_tokenizer *t, int skip_special, kvb_detok **out) {
    kvb_detok *d;
    KVB_TRY(kvb_calloc(1, sizeof *d, (void **)&d));
    d->t = t;
    d->skip_special = skip_special;
    d->first = 1;
    d->strip_left = t->dec_strip_n;
    *out = d;
    return KVB_OK;
}

static kvb_status detok_emit(kvb_detok *d, int final, const char **text, size_t *len) {
    size_t used;
    d->text.len = 0;
    KVB_TRY(kvb__buf_reserve(&d->text, 0));
    KVB_TRY(kvb__utf8_lossy((const uint8_t *)d->pending.p, d->pending.len, final, &d->text, &used));
    memmove(d->pending.p, d->pending.p + used, d->pending.len - used);
    d->pending.len -= used;
    size_t cut = strip_start(d->t, d->text.p, d->text.len, &d->strip_left);
    *text = d->text.p + cut;
    *len = d->text.len - cut;
    return KVB_OK;
}

kvb_status kvb_detok_push(kvb_detok *d, int32_t id, const char **text, size_t *len) {
    *text = "";
    *len = 0;
    KVB_TRY(kvb__buf_reserve(&d->pending, 0));
    KVB_TRY(token_bytes(d->t, id, d->skip_special, &d->first, &d->pending));
    return detok_emit(d, 0, text, len);
}

kvb_status kvb_detok_flush(kvb_detok *d, const char **text, size_t *len) {
    *text = "";
    *len = 0;
    KVB_TRY(kvb__buf_reserve(&d->pending, 0));
    KVB_TRY(detok_emit(d, 1, text, len));
    d->first = 1; /* a new stream begins */
    d->strip_left = d->t->dec_strip_n;
    return KVB_OK;
}

void kvb_detok_destroy(kvb_detok *d) {
    if (!d) return;
    kvb__buf_free(&d->pending);
    kvb__buf_free(&d->text);
    free(d);
}
