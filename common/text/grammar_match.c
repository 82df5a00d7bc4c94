/* kvbank — running a compiled grammar: the vocabulary trie, the matcher (a set of stacks advanced byte
 * by byte), and token masks.
 *
 * A matcher's state is a set of "tops": (automaton state, parent frame), where a frame (state, parent)
 * is where a called rule returns to. Frames are hash-consed so that equal stacks are one index and the
 * set stays small. A step consumes one byte at every top, then closes the result: calls push a frame,
 * final states pop to their parent (keeping the top too: a rule may end or go on), popping the root
 * makes the output complete.
 *
 * The mask of a state set is the union over its tops of what a token can do from that top. Most of it
 * depends on the top's automaton state alone (the bytes stay inside the rule, or inside rules it calls):
 * that part is computed once per state by walking the vocabulary trie from the state with a sentinel
 * parent, and kept in the grammar (kvb__gtable). Tokens whose walk reached the sentinel (the rule ended
 * with bytes left) are listed as context-dependent and checked per step against the real stack. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/text/grammar_impl.h"
#include "common/util/util.h"

#define PARENT_NONE (-1) /* the root: popping it completes the output */
#define PARENT_SENT (-2) /* the unknown stack under a state whose table is being built */
#define MAX_TOPS 8192     /* an ambiguity bound: more tops than this in one state set is refused */

/* ------------------------------------------------------------------------------------- vocabulary */

struct kvb_grammar_vocab {
    int n_vocab;
    char *bytes;     /* every token's bytes back to back */
    size_t *off;     /* [n_vocab] */
    uint32_t *len;   /* [n_vocab]; 0: never allowed (special, empty, unassigned) */
    int32_t eos[16];
    int n_eos;
    /* the trie of the allowed tokens' byte strings, nodes in preorder (children by byte) */
    int32_t *sorted; /* [n_sorted] token ids by byte string */
    int32_t n_sorted;
    uint32_t n_nodes;
    uint8_t *nbyte;   /* [n_nodes] the byte into the node */
    uint16_t *ndepth; /* [n_nodes] depth (1 = a first byte) */
    uint32_t *nend;   /* [n_nodes] the first preorder index after the node's subtree */
    uint32_t *ntok;   /* [n_nodes + 1] tokens ending at node i: sorted[ntok[i] .. ntok[i+1]) */
    int max_len;
};

static int cmp_tok(const void *a, const void *b, void *ctx) {
    const kvb_grammar_vocab *v = ctx;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    uint32_t lx = v->len[x], ly = v->len[y];
    int c = memcmp(v->bytes + v->off[x], v->bytes + v->off[y], lx < ly ? lx : ly);
    if (c) return c;
    if (lx != ly) return lx < ly ? -1 : 1;
    return (x > y) - (x < y);
}

static kvb_status vocab_trie(kvb_grammar_vocab *v) {
    size_t total = 0;
    v->n_sorted = 0;
    for (int i = 0; i < v->n_vocab; i++)
        if (v->len[i]) {
            v->n_sorted++;
            total += v->len[i];
            if ((int)v->len[i] > v->max_len) v->max_len = (int)v->len[i];
        }
    if (v->max_len > 65535) return KVB_ERR_UNSUPPORTED;
    KVB_TRY(kvb_malloc(((size_t)v->n_sorted + 1) * sizeof *v->sorted, (void **)&v->sorted));
    for (int i = 0, k = 0; i < v->n_vocab; i++)
        if (v->len[i]) v->sorted[k++] = i;
    qsort_r(v->sorted, (size_t)v->n_sorted, sizeof *v->sorted, cmp_tok, v);
    /* nodes: at most one per byte of every token */
    KVB_TRY(kvb_malloc(total + 1, (void **)&v->nbyte));
    KVB_TRY(kvb_malloc((total + 1) * sizeof *v->ndepth, (void **)&v->ndepth));
    KVB_TRY(kvb_malloc((total + 1) * sizeof *v->nend, (void **)&v->nend));
    KVB_TRY(kvb_calloc(total + 2, sizeof *v->ntok, (void **)&v->ntok));
    uint32_t *path;
    KVB_TRY(kvb_malloc(((size_t)v->max_len + 1) * sizeof *path, (void **)&path));
    uint32_t n = 0;
    int depth = 0; /* nodes on the path: path[1 .. depth] */
    const uint8_t *prev = NULL;
    uint32_t prev_len = 0;
    for (int32_t k = 0; k < v->n_sorted; k++) {
        int32_t id = v->sorted[k];
        const uint8_t *s = (const uint8_t *)v->bytes + v->off[id];
        uint32_t len = v->len[id], l = 0;
        while (prev && l < len && l < prev_len && s[l] == prev[l]) l++;
        for (; depth > (int)l; depth--) v->nend[path[depth]] = n; /* close what the new token leaves */
        for (uint32_t d = l + 1; d <= len; d++) {
            v->nbyte[n] = s[d - 1];
            v->ndepth[n] = (uint16_t)d;
            path[++depth] = n++;
        }
        v->ntok[path[len] + 1]++;
        prev = s, prev_len = len;
    }
    for (; depth > 0; depth--) v->nend[path[depth]] = n;
    free(path);
    v->n_nodes = n;
    for (uint32_t i = 0; i < n; i++) v->ntok[i + 1] += v->ntok[i];
    return KVB_OK;
}

kvb_status kvb_grammar_vocab_create(int n_vocab, const char *const *bytes, const size_t *lens,
                                    const uint8_t *special, const int32_t *eos, int n_eos, kvb_grammar_vocab **out) {
    *out = NULL;
    if (n_vocab <= 0 || !bytes || !lens || n_eos < 0 || (n_eos && !eos)) return KVB_ERR_INVALID;
    kvb_grammar_vocab *v;
    KVB_TRY(kvb_calloc(1, sizeof *v, (void **)&v));
    kvb_status st;
    size_t total = 0;
    v->n_vocab = n_vocab;
    for (int i = 0; i < n_vocab; i++)
        if (bytes[i]) total += lens[i];
    KVB_TRY_GOTO(kvb_malloc(total + 1, (void **)&v->bytes), fail);
    KVB_TRY_GOTO(kvb_malloc((size_t)n_vocab * sizeof *v->off, (void **)&v->off), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)n_vocab, sizeof *v->len, (void **)&v->len), fail);
    total = 0;
    for (int i = 0; i < n_vocab; i++) {
        v->off[i] = total;
        if (!bytes[i] || !lens[i] || lens[i] > 65535) continue;
        memcpy(v->bytes + total, bytes[i], lens[i]);
        total += lens[i];
        if (!special || !special[i]) v->len[i] = (uint32_t)lens[i];
    }
    for (int i = 0; i < n_eos; i++)
        if (eos[i] >= 0 && eos[i] < n_vocab && v->n_eos < (int)KVB_ARRAY_LEN(v->eos)) {
            v->eos[v->n_eos++] = eos[i];
            v->len[eos[i]] = 0; /* an EOS is allowed by completion, never by its text */
        }
    KVB_TRY_GOTO(vocab_trie(v), fail);
    *out = v;
    return KVB_OK;
fail:
    kvb_grammar_vocab_destroy(v);
    return st;
}

kvb_status kvb_grammar_vocab_from_tokenizer(const kvb_tokenizer *t, kvb_grammar_vocab **out) {
    int n = kvb_tokenizer_vocab_size(t);
    const char **bytes = NULL;
    size_t *lens = NULL;
    uint8_t *special = NULL;
    kvb_status st;
    *out = NULL;
    KVB_TRY_GOTO(kvb_calloc((size_t)n + 1, sizeof *bytes, (void **)&bytes), done);
    KVB_TRY_GOTO(kvb_calloc((size_t)n + 1, sizeof *lens, (void **)&lens), done);
    KVB_TRY_GOTO(kvb_calloc((size_t)n + 1, 1, (void **)&special), done);
    for (int i = 0; i < n; i++) {
        bytes[i] = kvb_tokenizer_token_bytes(t, i, &lens[i]);
        special[i] = (uint8_t)kvb_tokenizer_is_special(t, i);
    }
    const int32_t *eos;
    int n_eos = kvb_tokenizer_eos_ids(t, &eos);
    st = kvb_grammar_vocab_create(n, bytes, lens, special, eos, n_eos, out);
done:
    free(bytes);
    free(lens);
    free(special);
    return st;
}

void kvb_grammar_vocab_destroy(kvb_grammar_vocab *v) {
    if (!v) return;
    free(v->bytes);
    free(v->off);
    free(v->len);
    free(v->sorted);
    free(v->nbyte);
    free(v->ndepth);
    free(v->nend);
    free(v->ntok);
    free(v);
}

int kvb_grammar_vocab_size(const kvb_grammar_vocab *v) { return v->n_vocab; }
size_t kvb_grammar_mask_words(const kvb_grammar_vocab *v) { return ((size_t)v->n_vocab + 31) / 32; }

static const uint8_t *tok_bytes(const kvb_grammar_vocab *v, int32_t id) { return (const uint8_t *)v->bytes + v->off[id]; }

/* ------------------------------------------------------------------------------------- frames and steps */

typedef struct frame {
    int32_t state;  /* where the caller continues */
    int32_t parent; /* a frame index, PARENT_NONE or PARENT_SENT */
    int32_t depth;  /* frames from the bottom, this one included */
} frame;

typedef struct top {
    int32_t state, parent;
} top;

/* Frames, hash-consed; truncatable (a matcher's rollback, the scratch of a check): a slot is valid
 * while its index is below n and the frame there still has the slot's key. */
typedef struct fstore {
    frame *f;
    int32_t n, cap;
    int32_t *slots; /* index, -1 empty */
    uint32_t mask, used;
} fstore;

static uint64_t key_hash(int32_t a, int32_t b) {
    uint64_t h = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return h;
}

static kvb_status fstore_rehash(fstore *fs, uint32_t nslots) {
    int32_t *s;
    KVB_TRY(kvb_malloc((size_t)nslots * sizeof *s, (void **)&s));
    memset(s, 0xff, (size_t)nslots * sizeof *s);
    free(fs->slots);
    fs->slots = s;
    fs->mask = nslots - 1;
    fs->used = 0;
    for (int32_t i = 0; i < fs->n; i++) {
        uint32_t j = (uint32_t)key_hash(fs->f[i].state, fs->f[i].parent) & fs->mask;
        while (fs->slots[j] >= 0) j = (j + 1) & fs->mask;
        fs->slots[j] = i;
        fs->used++;
    }
    return KVB_OK;
}

/* The frame (state, parent), found or added; its index or -1 (out of memory). */
static int32_t fstore_get(fstore *fs, int32_t state, int32_t parent) {
    if (!fs->slots || (fs->used + 1) * 2 > fs->mask) {
        uint32_t want = 64;
        while (want < (uint32_t)(fs->n + 1) * 4) want *= 2;
        if (fstore_rehash(fs, want) != KVB_OK) return -1;
    }
    uint32_t j = (uint32_t)key_hash(state, parent) & fs->mask, reuse = UINT32_MAX;
    for (;; j = (j + 1) & fs->mask) {
        int32_t i = fs->slots[j];
        if (i < 0) break;
        if (i < fs->n && fs->f[i].state == state && fs->f[i].parent == parent) return i;
        if (i >= fs->n && reuse == UINT32_MAX) reuse = j; /* stale: left by a truncation */
    }
    if (fs->n == fs->cap) {
        int32_t c = fs->cap ? fs->cap * 2 : 64;
        if (kvb_realloc_array((void **)&fs->f, (size_t)c, sizeof *fs->f) != KVB_OK) return -1;
        fs->cap = c;
    }
    int32_t depth = 1 + (parent >= 0 ? fs->f[parent].depth : 0);
    fs->f[fs->n] = (frame){state, parent, depth};
    if (reuse != UINT32_MAX) j = reuse;
    else fs->used++;
    fs->slots[j] = fs->n;
    return fs->n++;
}

/* A stale slot may hold an index that is valid again for another frame after a truncation and regrowth:
 * the key comparison in fstore_get rejects it, so it only costs a probe. */
static void fstore_truncate(fstore *fs, int32_t n) {
    if (n < fs->n) fs->n = n;
}

static void fstore_free(fstore *fs) {
    free(fs->f);
    free(fs->slots);
}

/* Scratch of one step: the visited (state, parent) pairs and the work list. */
typedef struct stepper {
    const kvb_grammar *g;
    fstore *fs;
    uint64_t *vkeys; /* open addressing; stamp in the high bits is not needed: cleared per step */
    uint32_t vmask, vused;
    top *work;
    int32_t nwork, capwork;
    int overflow; /* too many tops (MAX_TOPS) or out of memory */
} stepper;

typedef struct topvec {
    top *t;
    int32_t n, cap;
} topvec;

static int topvec_push(topvec *v, top t) {
    if (v->n == v->cap) {
        int32_t c = v->cap ? v->cap * 2 : 16;
        if (kvb_realloc_array((void **)&v->t, (size_t)c, sizeof *v->t) != KVB_OK) return 0;
        v->cap = c;
    }
    v->t[v->n++] = t;
    return 1;
}

static int visit(stepper *sp, int32_t state, int32_t parent) {
    if ((sp->vused + 1) * 2 > sp->vmask) {
        uint32_t nm = sp->vmask ? sp->vmask * 2 + 1 : 255;
        uint64_t *nk;
        if (kvb_malloc(((size_t)nm + 1) * sizeof *nk, (void **)&nk) != KVB_OK) return sp->overflow = 1, 0;
        memset(nk, 0xff, ((size_t)nm + 1) * sizeof *nk);
        for (uint32_t i = 0; sp->vkeys && i <= sp->vmask; i++)
            if (sp->vkeys[i] != UINT64_MAX) {
                uint32_t j = (uint32_t)key_hash((int32_t)(sp->vkeys[i] >> 32), (int32_t)sp->vkeys[i]) & nm;
                while (nk[j] != UINT64_MAX) j = (j + 1) & nm;
                nk[j] = sp->vkeys[i];
            }
        free(sp->vkeys);
        sp->vkeys = nk;
        sp->vmask = nm;
    }
    uint64_t key = (uint64_t)(uint32_t)state << 32 | (uint32_t)parent;
    for (uint32_t j = (uint32_t)key_hash(state, parent) & sp->vmask;; j = (j + 1) & sp->vmask) {
        if (sp->vkeys[j] == key) return 0;
        if (sp->vkeys[j] == UINT64_MAX) {
            sp->vkeys[j] = key;
            sp->vused++;
            return 1;
        }
    }
}

static void visit_clear(stepper *sp) {
    if (sp->vused) memset(sp->vkeys, 0xff, ((size_t)sp->vmask + 1) * sizeof *sp->vkeys);
    sp->vused = 0;
}

enum { FL_ACCEPT = 1, FL_ESC = 2 };

static int work_push(stepper *sp, top t) {
    if (sp->nwork == sp->capwork) {
        int32_t cw = sp->capwork ? sp->capwork * 2 : 64;
        if (kvb_realloc_array((void **)&sp->work, (size_t)cw, sizeof *sp->work) != KVB_OK) return sp->overflow = 1, 0;
        sp->capwork = cw;
    }
    sp->work[sp->nwork++] = t;
    return 1;
}

/* Closes the work list: every (state, parent) reached without consuming a byte; states with byte edges
 * become tops of `out`. Sets FL_ACCEPT when the root pops, FL_ESC when the sentinel does. */
static void close_work(stepper *sp, topvec *out, int *flags) {
    const kvb_grammar *g = sp->g;
    while (sp->nwork && !sp->overflow) {
        top w = sp->work[--sp->nwork];
        if (!visit(sp, w.state, w.parent)) continue;
        const kvb__gstate *s = &g->states[w.state];
        if (s->ne) {
            if (out->n >= MAX_TOPS || !topvec_push(out, w)) {
                sp->overflow = 1;
                return;
            }
        }
        int32_t depth = w.parent >= 0 ? sp->fs->f[w.parent].depth : 0;
        for (int32_t c = 0; c < s->nc; c++) {
            const kvb__gcall *k = &g->calls[s->c0 + c];
            if (depth + 1 > g->opts.max_depth) continue; /* deeper output is not allowed */
            int32_t r = fstore_get(sp->fs, k->to, w.parent);
            if (r < 0) {
                sp->overflow = 1;
                return;
            }
            if (!work_push(sp, (top){g->rule_start[k->rule], r})) return;
        }
        if (s->final) {
            if (w.parent == PARENT_NONE) *flags |= FL_ACCEPT;
            else if (w.parent == PARENT_SENT) *flags |= FL_ESC;
            else {
                const frame *f = &sp->fs->f[w.parent];
                if (!work_push(sp, (top){f->state, f->parent})) return;
            }
        }
    }
}


static int cmp_top(const void *a, const void *b) {
    const top *x = a, *y = b;
    if (x->state != y->state) return x->state < y->state ? -1 : 1;
    return (x->parent > y->parent) - (x->parent < y->parent);
}

/* in[n_in] --byte--> out (appended, sorted). Returns the flags of the closure. */
static int step(stepper *sp, const top *in, int32_t n_in, uint8_t byte, topvec *out) {
    const kvb_grammar *g = sp->g;
    int flags = 0;
    int32_t base = out->n;
    visit_clear(sp);
    sp->nwork = 0;
    for (int32_t i = 0; i < n_in; i++) {
        const kvb__gstate *s = &g->states[in[i].state];
        const kvb__gedge *e = g->edges + s->e0;
        for (int32_t k = 0; k < s->ne; k++)
            if (byte >= e[k].lo && byte <= e[k].hi) {
                work_push(sp, (top){e[k].to, in[i].parent});
                break; /* edges are disjoint */
            }
    }
    close_work(sp, out, &flags);
    if (out->n - base > 1) qsort(out->t + base, (size_t)(out->n - base), sizeof *out->t, cmp_top);
    return flags;
}

/* The closure of (state, parent): the start of a rule. */
static int start(stepper *sp, int32_t state, int32_t parent, topvec *out) {
    int flags = 0;
    visit_clear(sp);
    sp->nwork = 0;
    work_push(sp, (top){state, parent});
    close_work(sp, out, &flags);
    if (out->n > 1) qsort(out->t, (size_t)out->n, sizeof *out->t, cmp_top);
    return flags;
}

static void stepper_free(stepper *sp) {
    free(sp->vkeys);
    free(sp->work);
}

/* ------------------------------------------------------------------------------------- per-state tables */

struct kvb__gtable {
    uint32_t *ci;     /* [mask words] tokens decided inside the state's rule: allowed; NULL when sparse */
    int32_t *ci_ids;  /* [n_ci] the same as ids when few are allowed (most structural states) */
    int32_t n_ci;
    int32_t *cd;  /* [n_cd] positions in vocab->sorted of the tokens the stack decides, in trie order */
    int32_t n_cd;
    int32_t max_push; /* the most frames a token pushed on the walk: ci holds only below max_depth - max_push */
};

/* The walk's interned state sets: tops sorted, plus the flags; transitions memoized per byte. */
typedef struct walk {
    stepper sp;
    fstore fs;
    top *tops; /* all sets back to back */
    int64_t ntops, captops;
    int64_t *t0;    /* [n + 1] set i is tops[t0[i] .. t0[i+1]) */
    uint8_t *flags; /* [n] */
    int32_t **next; /* [n] -> [256] next set, -1 unknown; NULL until used */
    int32_t n, cap;
    int32_t *slots; /* hash table of set ids, -1 empty */
    uint32_t mask;
    topvec out;
    int failed;
} walk;

static uint64_t set_hash(const top *t, int32_t n, int flags) {
    uint64_t h = 0x243f6a8885a308d3ull ^ (uint64_t)flags;
    for (int32_t i = 0; i < n; i++) h = (h ^ key_hash(t[i].state, t[i].parent)) * 0x100000001b3ull;
    return h;
}

static int32_t walk_intern(walk *w, const top *t, int32_t n, int flags) {
    if (w->n * 2 >= (int32_t)w->mask) {
        uint32_t nm = w->mask ? w->mask * 2 + 1 : 1023;
        int32_t *ns;
        if (kvb_malloc(((size_t)nm + 1) * sizeof *ns, (void **)&ns) != KVB_OK) return w->failed = 1, 0;
        memset(ns, 0xff, ((size_t)nm + 1) * sizeof *ns);
        for (int32_t i = 0; i < w->n; i++) {
            uint32_t j = (uint32_t)set_hash(w->tops + w->t0[i], (int32_t)(w->t0[i + 1] - w->t0[i]), w->flags[i]) & nm;
            while (ns[j] >= 0) j = (j + 1) & nm;
            ns[j] = i;
        }
        free(w->slots);
        w->slots = ns;
        w->mask = nm;
    }
    uint32_t j = (uint32_t)set_hash(t, n, flags) & w->mask;
    for (;; j = (j + 1) & w->mask) {
        int32_t i = w->slots[j];
        if (i < 0) break;
        if (w->flags[i] == flags && w->t0[i + 1] - w->t0[i] == n && (!n || !memcmp(w->tops + w->t0[i], t, (size_t)n * sizeof *t)))
            return i;
    }
    if (w->n + 1 >= w->cap) {
        int32_t c = w->cap ? w->cap * 2 : 256;
        if (kvb_realloc_array((void **)&w->t0, (size_t)c + 1, sizeof *w->t0) != KVB_OK ||
            kvb_realloc_array((void **)&w->flags, (size_t)c, 1) != KVB_OK ||
            kvb_realloc_array((void **)&w->next, (size_t)c, sizeof *w->next) != KVB_OK)
            return w->failed = 1, 0;
        w->cap = c;
    }
    while (w->ntops + n > w->captops) {
        int64_t c = w->captops ? w->captops * 2 : 1024;
        if (kvb_realloc_array((void **)&w->tops, (size_t)c, sizeof *w->tops) != KVB_OK) return w->failed = 1, 0;
        w->captops = c;
    }
    int32_t id = w->n++;
    w->t0[id] = w->ntops;
    if (n) memcpy(w->tops + w->ntops, t, (size_t)n * sizeof *t);
    w->ntops += n;
    w->t0[id + 1] = w->ntops;
    w->flags[id] = (uint8_t)flags;
    w->next[id] = NULL;
    w->slots[j] = id;
    return id;
}

/* The set after `byte` from set c; 0 is the dead set (no tops, no flags). */
static int32_t walk_next(walk *w, int32_t c, uint8_t byte) {
    if (!w->next[c]) {
        if (kvb_malloc(256 * sizeof **w->next, (void **)&w->next[c]) != KVB_OK) return w->failed = 1, 0;
        memset(w->next[c], 0xff, 256 * sizeof **w->next);
    }
    int32_t r = w->next[c][byte];
    if (r >= 0) return r;
    w->out.n = 0;
    /* w->tops may move while interning: step from a copy's position, not a pointer kept across */
    int flags = step(&w->sp, w->tops + w->t0[c], (int32_t)(w->t0[c + 1] - w->t0[c]), byte, &w->out);
    if (w->sp.overflow) return w->failed = 1, 0;
    flags &= FL_ESC;
    r = (w->out.n || flags) ? walk_intern(w, w->out.t, w->out.n, flags) : 0;
    w->next[c][byte] = r;
    return r;
}

static void walk_free(walk *w) {
    stepper_free(&w->sp);
    fstore_free(&w->fs);
    for (int32_t i = 0; i < w->n; i++) free(w->next[i]);
    free(w->next);
    free(w->tops);
    free(w->t0);
    free(w->flags);
    free(w->slots);
    free(w->out.t);
}

static void table_free(kvb__gtable *t) {
    if (!t) return;
    free(t->ci);
    free(t->ci_ids);
    free(t->cd);
    free(t);
}

/* Walks the vocabulary trie from state s over a sentinel parent (module comment). */
static kvb_status table_build(const kvb_grammar *g, int32_t s, kvb__gtable **out) {
    const kvb_grammar_vocab *v = g->v;
    kvb__gtable *t;
    kvb_status st;
    walk w = {0};
    int32_t *cfg = NULL;
    uint8_t *escf = NULL;
    int32_t cap_cd = 0;
    KVB_TRY(kvb_calloc(1, sizeof *t, (void **)&t));
    KVB_TRY_GOTO(kvb_calloc(kvb_grammar_mask_words(v), sizeof *t->ci, (void **)&t->ci), fail);
    KVB_TRY_GOTO(kvb_malloc(((size_t)v->max_len + 1) * sizeof *cfg, (void **)&cfg), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)v->max_len + 1, 1, (void **)&escf), fail);
    w.sp.g = g;
    w.sp.fs = &w.fs;
    walk_intern(&w, NULL, 0, 0); /* 0: dead */
    cfg[0] = walk_intern(&w, &(top){s, PARENT_SENT}, 1, 0);
    for (uint32_t i = 0; i < v->n_nodes && !w.failed;) {
        int d = v->ndepth[i];
        int32_t c = walk_next(&w, cfg[d - 1], v->nbyte[i]);
        if (!c) {
            if (escf[d - 1]) { /* the rule could end earlier: the stack decides the whole subtree */
                uint32_t a = v->ntok[i], b = v->ntok[v->nend[i]];
                if (t->n_cd + (int32_t)(b - a) > cap_cd) {
                    while (t->n_cd + (int32_t)(b - a) > cap_cd) cap_cd = cap_cd ? cap_cd * 2 : 256;
                    KVB_TRY_GOTO(kvb_realloc_array((void **)&t->cd, (size_t)cap_cd, sizeof *t->cd), fail);
                }
                for (uint32_t k = a; k < b; k++) t->cd[t->n_cd++] = (int32_t)k;
            }
            i = v->nend[i];
            continue;
        }
        cfg[d] = c;
        escf[d] = escf[d - 1] | ((w.flags[c] & FL_ESC) != 0);
        for (uint32_t k = v->ntok[i]; k < v->ntok[i + 1]; k++) {
            int32_t id = v->sorted[k];
            t->n_ci += !(t->ci[id >> 5] >> (id & 31) & 1);
            t->ci[id >> 5] |= 1u << (id & 31);
        }
        i++;
    }
    if (w.failed) {
        st = KVB_ERR_NOMEM;
        goto fail;
    }
    for (int32_t f = 0; f < w.fs.n; f++) t->max_push = KVB_MAX(t->max_push, w.fs.f[f].depth);
    if (t->n_ci < (int32_t)(kvb_grammar_mask_words(v) / 2)) { /* a list is smaller and ORs faster */
        if (t->n_ci) KVB_TRY_GOTO(kvb_malloc((size_t)t->n_ci * sizeof *t->ci_ids, (void **)&t->ci_ids), fail);
        int32_t k = 0;
        for (size_t wd = 0; wd < kvb_grammar_mask_words(v); wd++)
            for (uint32_t b = t->ci[wd]; b; b &= b - 1) t->ci_ids[k++] = (int32_t)(wd * 32 + (size_t)__builtin_ctz(b));
        free(t->ci);
        t->ci = NULL;
    }
    walk_free(&w);
    free(cfg);
    free(escf);
    *out = t;
    return KVB_OK;
fail:
    walk_free(&w);
    free(cfg);
    free(escf);
    table_free(t);
    return st;
}

/* State s's table; *owned: the grammar is over max_table_bytes and the caller frees this one. Tables
 * kept are never freed before the grammar (other threads read them without the lock). */
static kvb_status table_get(kvb_grammar *g, int32_t s, kvb__gtable **out, int *owned) {
    kvb__gtable *t = __atomic_load_n(&g->tables[s], __ATOMIC_ACQUIRE);
    *owned = 0;
    if (t) {
        *out = t;
        return KVB_OK;
    }
    pthread_mutex_lock(&g->lock); /* one builder per grammar: a second caller waits and reuses */
    t = g->tables[s];
    kvb_status st = KVB_OK;
    if (!t) {
        st = table_build(g, s, &t);
        if (st == KVB_OK) {
            size_t bytes = (t->ci ? kvb_grammar_mask_words(g->v) * 4 : (size_t)t->n_ci * 4) + (size_t)t->n_cd * 4;
            if (g->table_bytes + bytes <= g->opts.max_table_bytes) {
                g->table_bytes += bytes;
                __atomic_store_n(&g->tables[s], t, __ATOMIC_RELEASE);
            } else {
                *owned = 1;
            }
        }
    }
    pthread_mutex_unlock(&g->lock);
    *out = t;
    return st;
}

void kvb__grammar_tables_free(kvb_grammar *g) {
    for (int32_t s = 0; g->tables && s < g->n_states; s++) table_free(g->tables[s]);
    free(g->tables);
    g->tables = NULL;
}

/* ------------------------------------------------------------------------------------- matcher */

typedef struct hist {
    int64_t t0;     /* the state set: tops[t0 .. t0+n) */
    int32_t n;
    int32_t frames; /* frames in use */
    int flags;      /* FL_ACCEPT; ENDED: an EOS was accepted */
} hist;

#define ENDED 4

struct kvb_grammar_matcher {
    kvb_grammar *g;
    fstore fs;
    topvec tops; /* every state set so far, back to back (rollback truncates) */
    hist *h;     /* [nh]: h[0] the start, h[i] after the i-th accepted token */
    int32_t nh, caph;
    stepper sp;
    topvec a, b; /* scratch of accept_bytes */
    topvec lv;   /* scratch of the context-dependent checks: the state sets by depth */
    int64_t *lv0;
    int32_t *lvframes;
    int lvcap;
};

static kvb_status hist_push(kvb_grammar_matcher *m, hist h) {
    if (m->nh == m->caph) {
        int32_t c = m->caph ? m->caph * 2 : 64;
        KVB_TRY(kvb_realloc_array((void **)&m->h, (size_t)c, sizeof *m->h));
        m->caph = c;
    }
    m->h[m->nh++] = h;
    return KVB_OK;
}

kvb_status kvb_grammar_matcher_create(kvb_grammar *g, kvb_grammar_matcher **out) {
    kvb_grammar_matcher *m;
    *out = NULL;
    if (!g) return KVB_ERR_INVALID;
    KVB_TRY(kvb_calloc(1, sizeof *m, (void **)&m));
    m->g = kvb_grammar_retain(g);
    m->sp.g = g;
    m->sp.fs = &m->fs;
    int flags = start(&m->sp, g->rule_start[g->root], PARENT_NONE, &m->tops);
    kvb_status st = m->sp.overflow ? KVB_ERR_NOMEM : hist_push(m, (hist){0, m->tops.n, m->fs.n, flags & FL_ACCEPT});
    if (st != KVB_OK) {
        kvb_grammar_matcher_destroy(m);
        return st;
    }
    *out = m;
    return KVB_OK;
}

void kvb_grammar_matcher_destroy(kvb_grammar_matcher *m) {
    if (!m) return;
    fstore_free(&m->fs);
    stepper_free(&m->sp);
    free(m->tops.t);
    free(m->h);
    free(m->a.t);
    free(m->b.t);
    free(m->lv.t);
    free(m->lv0);
    free(m->lvframes);
    kvb_grammar_release(m->g);
    free(m);
}

static kvb_status dup(void **dst, const void *src, size_t bytes) {
    *dst = NULL;
    if (!bytes) return KVB_OK;
    KVB_TRY(kvb_malloc(bytes, dst));
    memcpy(*dst, src, bytes);
    return KVB_OK;
}

kvb_status kvb_grammar_matcher_fork(const kvb_grammar_matcher *m, kvb_grammar_matcher **out) {
    kvb_grammar_matcher *c;
    *out = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *c, (void **)&c));
    c->g = kvb_grammar_retain(m->g);
    c->sp.g = c->g;
    c->sp.fs = &c->fs;
    kvb_status st;
    const hist *h = &m->h[m->nh - 1];
    /* only what the current state needs: the history before it is not copied (the fork cannot roll back
     * past its own start) */
    c->fs.n = c->fs.cap = h->frames;
    KVB_TRY_GOTO(dup((void **)&c->fs.f, m->fs.f, (size_t)h->frames * sizeof *m->fs.f), fail);
    KVB_TRY_GOTO(dup((void **)&c->tops.t, m->tops.t + h->t0, (size_t)h->n * sizeof *m->tops.t), fail);
    c->tops.n = c->tops.cap = h->n;
    KVB_TRY_GOTO(hist_push(c, (hist){0, h->n, h->frames, h->flags}), fail);
    *out = c;
    return KVB_OK;
fail:
    kvb_grammar_matcher_destroy(c);
    return st;
}

int kvb_grammar_matcher_accepting(const kvb_grammar_matcher *m) {
    const hist *h = &m->h[m->nh - 1];
    return (h->flags & ENDED) || (h->flags & FL_ACCEPT);
}

int kvb_grammar_matcher_done(const kvb_grammar_matcher *m) {
    const hist *h = &m->h[m->nh - 1];
    return (h->flags & ENDED) || ((h->flags & FL_ACCEPT) && h->n == 0);
}

const kvb_grammar_vocab *kvb_grammar_matcher_vocab(const kvb_grammar_matcher *m) { return m->g->v; }

kvb_status kvb_grammar_matcher_accept_bytes(kvb_grammar_matcher *m, const void *bytes, size_t len) {
    const hist h = m->h[m->nh - 1];
    if (h.flags & ENDED) return KVB_ERR_INVALID;
    const uint8_t *p = bytes;
    topvec *cur = &m->a, *nxt = &m->b;
    cur->n = 0;
    for (int32_t i = 0; i < h.n; i++)
        if (!topvec_push(cur, m->tops.t[h.t0 + i])) return KVB_ERR_NOMEM;
    int flags = h.flags & FL_ACCEPT;
    for (size_t i = 0; i < len; i++) {
        nxt->n = 0;
        flags = step(&m->sp, cur->t, cur->n, p[i], nxt);
        if (m->sp.overflow) {
            m->sp.overflow = 0;
            fstore_truncate(&m->fs, h.frames);
            return KVB_ERR_EXHAUSTED;
        }
        topvec *t = cur;
        cur = nxt, nxt = t;
        if (!cur->n && !(flags & FL_ACCEPT)) break;
        if (!cur->n && i + 1 < len) { /* complete, but bytes are left */
            flags = 0;
            break;
        }
    }
    if (!cur->n && !(flags & FL_ACCEPT)) {
        fstore_truncate(&m->fs, h.frames);
        return KVB_ERR_INVALID;
    }
    int64_t t0 = m->tops.n;
    for (int32_t i = 0; i < cur->n; i++)
        if (!topvec_push(&m->tops, cur->t[i])) return KVB_ERR_NOMEM;
    kvb_status st = hist_push(m, (hist){t0, cur->n, m->fs.n, flags & FL_ACCEPT});
    if (st != KVB_OK) m->tops.n = t0;
    return st;
}

static int is_eos(const kvb_grammar_vocab *v, int32_t id) {
    for (int i = 0; i < v->n_eos; i++)
        if (v->eos[i] == id) return 1;
    return 0;
}

kvb_status kvb_grammar_matcher_accept_token(kvb_grammar_matcher *m, int32_t id) {
    const kvb_grammar_vocab *v = m->g->v;
    const hist h = m->h[m->nh - 1];
    if (id < 0 || id >= v->n_vocab || (h.flags & ENDED)) return KVB_ERR_INVALID;
    if (is_eos(v, id)) {
        if (!(h.flags & FL_ACCEPT)) return KVB_ERR_INVALID;
        return hist_push(m, (hist){m->tops.n, 0, m->fs.n, FL_ACCEPT | ENDED});
    }
    if (!v->len[id]) return KVB_ERR_INVALID;
    return kvb_grammar_matcher_accept_bytes(m, tok_bytes(v, id), v->len[id]);
}

kvb_status kvb_grammar_matcher_rollback(kvb_grammar_matcher *m, int n) {
    if (n < 0 || n >= m->nh) return KVB_ERR_INVALID;
    m->nh -= n;
    const hist *h = &m->h[m->nh - 1];
    m->tops.n = h->t0 + h->n;
    fstore_truncate(&m->fs, h->frames);
    return KVB_OK;
}

/* Tokens walked from top t with the real stack, in trie order so that a shared prefix is walked once:
 * positions pos[n] of vocab->sorted (the context-dependent tokens of t's table), or every token when
 * pos is NULL (near the depth limit, where the table's allowed set may push too deep). */
static kvb_status check_tokens(kvb_grammar_matcher *m, top t, const int32_t *pos, int32_t n_pos, uint32_t *mask) {
    const kvb_grammar_vocab *v = m->g->v;
    if (m->lvcap < v->max_len + 2) {
        int c = v->max_len + 2;
        KVB_TRY(kvb_realloc_array((void **)&m->lv0, (size_t)c, sizeof *m->lv0));
        KVB_TRY(kvb_realloc_array((void **)&m->lvframes, (size_t)c, sizeof *m->lvframes));
        m->lvcap = c;
    }
    int32_t frames0 = m->fs.n;
    m->lv.n = 0;
    if (!topvec_push(&m->lv, t)) return KVB_ERR_NOMEM;
    m->lv0[0] = 0, m->lv0[1] = 1;
    m->lvframes[0] = frames0;
    int have = 0; /* levels 0..have are valid for `prev` */
    const uint8_t *prev = NULL;
    uint32_t prev_len = 0;
    uint32_t dead_at = UINT32_MAX; /* the previous token died after this many bytes */
    for (int32_t k = 0; k < n_pos; k++) {
        int32_t id = v->sorted[pos ? pos[k] : k];
        const uint8_t *s = tok_bytes(v, id);
        uint32_t len = v->len[id], l = 0;
        while (prev && l < len && l < prev_len && s[l] == prev[l]) l++;
        if (dead_at != UINT32_MAX && l >= dead_at) continue; /* shares the dead prefix */
        if ((int)l > have) l = (uint32_t)have;
        dead_at = UINT32_MAX;
        /* back to level l, then forward */
        m->lv.n = (int32_t)m->lv0[l + 1];
        fstore_truncate(&m->fs, m->lvframes[l]);
        int flags = 0, alive = 1;
        for (uint32_t d = l; d < len; d++) {
            int32_t a = (int32_t)m->lv0[d], n = (int32_t)(m->lv0[d + 1] - m->lv0[d]);
            /* the input set lives in lv, which the output grows: step from a copy */
            m->a.n = 0;
            for (int32_t i = 0; i < n; i++)
                if (!topvec_push(&m->a, m->lv.t[a + i])) return KVB_ERR_NOMEM;
            flags = step(&m->sp, m->a.t, n, s[d], &m->lv);
            if (m->sp.overflow) {
                m->sp.overflow = 0;
                fstore_truncate(&m->fs, frames0);
                return KVB_ERR_EXHAUSTED;
            }
            m->lv0[d + 2] = m->lv.n;
            m->lvframes[d + 1] = m->fs.n;
            have = (int)d + 1;
            int32_t got = (int32_t)(m->lv0[d + 2] - m->lv0[d + 1]);
            if (!got && !(d + 1 == len && (flags & FL_ACCEPT))) {
                alive = 0;
                dead_at = d + 1;
                have = (int)d; /* the dead level holds nothing useful */
                break;
            }
        }
        if (alive) mask[id >> 5] |= 1u << (id & 31);
        prev = s, prev_len = len;
    }
    fstore_truncate(&m->fs, frames0);
    return KVB_OK;
}

/* Top t's part of the mask from its state's table: the context-independent tokens (or_ci: not yet ORed
 * for this state; tops are sorted by state), then the context-dependent ones walked with t's stack. */
static kvb_status mask_from_table(kvb_grammar_matcher *m, top t, const kvb__gtable *tb, int or_ci, uint32_t *mask) {
    size_t words = kvb_grammar_mask_words(m->g->v);
    if (or_ci) {
        if (tb->ci)
            for (size_t w = 0; w < words; w++) mask[w] |= tb->ci[w];
        else
            for (int32_t k = 0; k < tb->n_ci; k++) mask[tb->ci_ids[k] >> 5] |= 1u << (tb->ci_ids[k] & 31);
    }
    return tb->n_cd ? check_tokens(m, t, tb->cd, tb->n_cd, mask) : KVB_OK;
}

kvb_status kvb_grammar_matcher_fill_mask(kvb_grammar_matcher *m, uint32_t *mask) {
    const kvb_grammar_vocab *v = m->g->v;
    size_t words = kvb_grammar_mask_words(v);
    memset(mask, 0, words * sizeof *mask);
    const hist h = m->h[m->nh - 1];
    if (h.flags & ENDED) return KVB_OK;
    int32_t last = -1;
    for (int32_t i = 0; i < h.n; i++) {
        top t = m->tops.t[h.t0 + i];
        kvb__gtable *tb;
        int owned;
        KVB_TRY(table_get(m->g, t.state, &tb, &owned));
        int32_t depth = t.parent >= 0 ? m->fs.f[t.parent].depth : 0;
        kvb_status st = KVB_OK;
        if (depth + tb->max_push > m->g->opts.max_depth) {
            st = check_tokens(m, t, NULL, v->n_sorted, mask);
        } else {
            st = mask_from_table(m, t, tb, t.state != last, mask);
            last = t.state;
        }
        if (owned) table_free(tb);
        KVB_TRY(st);
    }
    if (h.flags & FL_ACCEPT)
        for (int i = 0; i < v->n_eos; i++) mask[v->eos[i] >> 5] |= 1u << (v->eos[i] & 31);
    return KVB_OK;
}
void kvb_grammar_mask_apply(const kvb_grammar_vocab *v, const uint32_t *mask, float *logits, int n_logits) {
    int n = KVB_MIN(n_logits, v->n_vocab);
    for (int i = 0; i < n; i++)
        if (!(mask[i >> 5] >> (i & 31) & 1)) logits[i] = -__builtin_inff();
    for (int i = n; i < n_logits; i++) logits[i] = -__builtin_inff(); /* ids past the tokenizer have no bytes */
}
