/* kvbank — Jinja subset: arena, lexer and parser (the evaluator is jinja_eval.c).
 *
 * The lexer turns the source into text and tag tokens, applying whitespace control as the renderer
 * of transformers configures Jinja: `{%-` / `-%}` (and the same on `{{ }}` and `{# #}`) strip all
 * whitespace on that side; lstrip_blocks removes spaces and tabs before a block or comment tag that
 * starts its line; trim_blocks removes the newline after a block or comment tag; a trailing newline of
 * the source is dropped. The parser is recursive descent with Jinja's precedence: conditional
 * expression < or < and < not < comparison and `in` < `~` < + - < * / // % < ** < unary < filters
 * and tests < postfix (. [] ()). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/text/jinja_impl.h"
#include "common/util/util.h"

/* ---------------------------------------------------------------------------------- arena */

struct jchunk {
    struct jchunk *next;
    size_t used, cap;
    _Alignas(16) unsigned char data[];
};

void *kvb__ja_alloc(jarena *a, size_t n) {
    n = (n + 15) & ~(size_t)15;
    struct jchunk *c = a->head;
    if (!c || c->used + n > c->cap) {
        size_t cap = KVB_MAX(n, (size_t)64 << 10);
        if (a->budget && (cap > a->budget || a->used > a->budget - cap)) {
            a->over = 1;
            longjmp(*a->oom, 1);
        }
        c = malloc(sizeof *c + cap);
        if (!c) longjmp(*a->oom, 1);
        a->used += cap;
        c->next = a->head;
        c->used = 0;
        c->cap = cap;
        a->head = c;
    }
    void *p = c->data + c->used;
    c->used += n;
    memset(p, 0, n);
    return p;
}

char *kvb__ja_strdup(jarena *a, const char *s, size_t n) {
    char *p = kvb__ja_alloc(a, n + 1);
    memcpy(p, s, n);
    return p;
}

void kvb__ja_free(jarena *a) {
    for (struct jchunk *c = a->head, *next; c; c = next) {
        next = c->next;
        free(c);
    }
    a->head = NULL;
}

/* ---------------------------------------------------------------------------------- lexer */

typedef enum tk_kind { TK_TEXT, TK_VAR_BEGIN, TK_VAR_END, TK_BLOCK_BEGIN, TK_BLOCK_END, TK_NAME, TK_STR, TK_INT,
                       TK_FLOAT, TK_OP, TK_EOF } tk_kind;

typedef struct tok {
    tk_kind kind;
    int line, col;
    const char *s; /* TEXT, NAME, OP, STR (decoded) */
    size_t n;
    int64_t i;
    double f;
} tok;

typedef struct parser {
    const char *src;
    size_t len, pos;
    int line, col;          /* of src[pos] */
    tok *t;
    int n, cap, i;
    jarena *a;
    int depth;              /* nested parse_* calls that recurse (bounded: KVB_JINJA_MAX_NESTING) */
    kvb_buf str;            /* a string literal being decoded (freed by kvb_jinja_parse on every path) */
    jmp_buf jb;
    kvb_status st;
    char *err;
    size_t err_len;
} parser;

static void fail_at(parser *p, kvb_status st, int line, int col, const char *fmt, ...)
    __attribute__((format(printf, 5, 6), noreturn));
static void fail_at(parser *p, kvb_status st, int line, int col, const char *fmt, ...) {
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(p->err, p->err_len, "chat template line %d, column %d: %s", line, col, msg);
    p->st = st;
    longjmp(p->jb, 1);
}

static void advance(parser *p, size_t k) {
    for (size_t e = p->pos + k; p->pos < e; p->pos++) {
        if (p->src[p->pos] == '\n') {
            p->line++;
            p->col = 1;
        } else if (((unsigned char)p->src[p->pos] & 0xC0) != 0x80) p->col++;
    }
}

static tok *push_tok(parser *p, tk_kind kind, int line, int col) {
    if (p->n == p->cap) {
        int cap = p->cap ? 2 * p->cap : 256;
        tok *t = realloc(p->t, (size_t)cap * sizeof *t);
        if (!t) longjmp(*p->a->oom, 1);
        p->t = t;
        p->cap = cap;
    }
    tok *t = &p->t[p->n++];
    memset(t, 0, sizeof *t);
    t->kind = kind;
    t->line = line;
    t->col = col;
    return t;
}

static int starts(const parser *p, const char *s) {
    size_t n = strlen(s);
    return p->pos + n <= p->len && !memcmp(p->src + p->pos, s, n);
}

static int is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

/* A string literal at p->pos (quote included); Python's escapes. */
static void lex_string(parser *p, int line, int col) {
    char q = p->src[p->pos];
    advance(p, 1);
    kvb_buf *b = &p->str; /* the parser's own: a failure below longjmps past this function */
    b->len = 0;
    while (p->pos < p->len && p->src[p->pos] != q) {
        char c = p->src[p->pos];
        if (c == '\\' && p->pos + 1 < p->len) {
            char e = p->src[p->pos + 1], lit = 0;
            int digits = 0;
            switch (e) {
            case 'n': lit = '\n'; break;
            case 't': lit = '\t'; break;
            case 'r': lit = '\r'; break;
            case 'b': lit = '\b'; break;
            case 'f': lit = '\f'; break;
            case 'v': lit = '\v'; break;
            case '0': lit = 0; digits = -1; break;
            case '\\': case '\'': case '"': lit = e; break;
            case 'x': digits = 2; break;
            case 'u': digits = 4; break;
            case 'U': digits = 8; break;
            default: break;
            }
            kvb_status bst = KVB_OK;
            if (digits > 0) {
                if (p->pos + 2 + (size_t)digits > p->len) fail_at(p, KVB_ERR_FORMAT, line, col, "bad escape in string");
                char hex[9] = {0};
                memcpy(hex, p->src + p->pos + 2, (size_t)digits);
                char *end;
                unsigned long cp = strtoul(hex, &end, 16);
                if (*end || cp >= 0x110000 || (cp >= 0xD800 && cp < 0xE000))
                    fail_at(p, KVB_ERR_FORMAT, line, col, "bad \\%c escape in string", e);
                uint8_t u[4];
                bst = kvb__buf_append(b, u, (size_t)kvb__utf8_encode((uint32_t)cp, u));
                advance(p, 2 + (size_t)digits);
            } else {
                if (lit || digits < 0) bst = kvb__buf_putc(b, lit);
                else bst = kvb__buf_append(b, p->src + p->pos, 2); /* an unknown escape stays as written */
                advance(p, 2);
            }
            if (bst != KVB_OK) longjmp(*p->a->oom, 1);
            continue;
        }
        if (kvb__buf_putc(b, c) != KVB_OK) longjmp(*p->a->oom, 1);
        advance(p, 1);
    }
    if (p->pos >= p->len) fail_at(p, KVB_ERR_FORMAT, line, col, "unterminated string");
    advance(p, 1);
    tok *t = push_tok(p, TK_STR, line, col);
    t->s = kvb__ja_strdup(p->a, b->p ? b->p : "", b->len);
    t->n = b->len;
}

/* The tokens of one {{ }} or {% %} tag, up to and including its end; returns the end's modifier. */
static char lex_tag(parser *p, int block, int line0, int col0) {
    static const char *const ops[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<", ">",
                                      "=", "(", ")", "[", "]", "{", "}", ",", ".", ":", "|"};
    for (;;) {
        while (p->pos < p->len && is_ws(p->src[p->pos])) advance(p, 1);
        if (p->pos >= p->len) fail_at(p, KVB_ERR_FORMAT, line0, col0, "unterminated %s tag", block ? "{%" : "{{");
        const char *end = block ? "%}" : "}}";
        char mod = 0;
        if ((p->src[p->pos] == '-' || p->src[p->pos] == '+') && p->pos + 3 <= p->len &&
            !memcmp(p->src + p->pos + 1, end, 2))
            mod = p->src[p->pos];
        if (mod || starts(p, end)) {
            push_tok(p, block ? TK_BLOCK_END : TK_VAR_END, p->line, p->col);
            advance(p, mod ? 3 : 2);
            return mod;
        }
        int line = p->line, col = p->col;
        char c = p->src[p->pos];
        if (c == '\'' || c == '"') {
            lex_string(p, line, col);
        } else if (c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
            size_t s = p->pos;
            while (p->pos < p->len && (p->src[p->pos] == '_' || (p->src[p->pos] >= 'a' && p->src[p->pos] <= 'z') ||
                                       (p->src[p->pos] >= 'A' && p->src[p->pos] <= 'Z') ||
                                       (p->src[p->pos] >= '0' && p->src[p->pos] <= '9')))
                advance(p, 1);
            tok *t = push_tok(p, TK_NAME, line, col);
            t->s = kvb__ja_strdup(p->a, p->src + s, p->pos - s);
            t->n = p->pos - s;
        } else if (c >= '0' && c <= '9') {
            char *e1, *e2;
            long long iv = strtoll(p->src + p->pos, &e1, 10);
            double fv = strtod(p->src + p->pos, &e2);
            int is_float = e2 > e1 && (*e1 == '.' || *e1 == 'e' || *e1 == 'E');
            /* "1.attr" is not a float: a '.' must be followed by a digit */
            if (is_float && *e1 == '.' && !(e1[1] >= '0' && e1[1] <= '9')) is_float = 0;
            tok *t = push_tok(p, is_float ? TK_FLOAT : TK_INT, line, col);
            t->i = iv;
            t->f = is_float ? fv : (double)iv;
            advance(p, (size_t)((is_float ? e2 : e1) - (p->src + p->pos)));
        } else {
            size_t k;
            for (k = 0; k < KVB_ARRAY_LEN(ops) && !starts(p, ops[k]); k++) {}
            if (k == KVB_ARRAY_LEN(ops)) fail_at(p, KVB_ERR_FORMAT, line, col, "unexpected character '%c'", c);
            tok *t = push_tok(p, TK_OP, line, col);
            t->s = ops[k];
            t->n = strlen(ops[k]);
            advance(p, t->n);
        }
    }
}

static void lex(parser *p) {
    int strip_next = 0; /* the previous tag ended with '-': strip leading whitespace of the next text */
    while (p->pos < p->len) {
        const char *q = p->src + p->pos;
        const char *tag = NULL;
        for (const char *s = q; (s = memchr(s, '{', (size_t)(p->src + p->len - s))); s++)
            if (s + 1 < p->src + p->len && (s[1] == '{' || s[1] == '%' || s[1] == '#')) {
                tag = s;
                break;
            }
        size_t tlen = (size_t)((tag ? tag : p->src + p->len) - q);
        size_t ts = 0, te = tlen; /* the text kept: q[ts..te) */
        if (strip_next)
            while (ts < te && is_ws(q[ts])) ts++;
        char kind = tag ? tag[1] : 0, mod = tag && tag + 2 < p->src + p->len ? tag[2] : 0;
        if (tag && mod == '-') {
            while (te > ts && is_ws(q[te - 1])) te--;
        } else if (tag && kind != '{' && mod != '+') { /* lstrip_blocks: only blanks before the tag on its line */
            size_t k = te;
            while (k > ts && (q[k - 1] == ' ' || q[k - 1] == '\t')) k--;
            int line_start = k > 0 ? q[k - 1] == '\n' : (p->pos == 0 || p->src[p->pos - 1] == '\n');
            if (line_start) te = k;
        }
        if (te > ts) {
            tok *t = push_tok(p, TK_TEXT, p->line, p->col);
            t->s = kvb__ja_strdup(p->a, q + ts, te - ts);
            t->n = te - ts;
        }
        advance(p, tlen);
        if (!tag) break;
        int line = p->line, col = p->col;
        advance(p, mod == '-' || mod == '+' ? 3 : 2);
        char endmod;
        if (kind == '#') {
            const char *e = NULL;
            for (const char *s = p->src + p->pos; s + 1 < p->src + p->len; s++)
                if (s[0] == '#' && s[1] == '}') {
                    e = s;
                    break;
                }
            if (!e) fail_at(p, KVB_ERR_FORMAT, line, col, "unterminated comment");
            endmod = e > p->src + p->pos && (e[-1] == '-' || e[-1] == '+') ? e[-1] : 0;
            advance(p, (size_t)(e + 2 - (p->src + p->pos)));
        } else {
            push_tok(p, kind == '%' ? TK_BLOCK_BEGIN : TK_VAR_BEGIN, line, col);
            endmod = lex_tag(p, kind == '%', line, col);
        }
        strip_next = endmod == '-';
        if (!strip_next && kind != '{' && endmod != '+') { /* trim_blocks */
            if (starts(p, "\r\n")) advance(p, 2);
            else if (starts(p, "\n")) advance(p, 1);
        }
    }
    push_tok(p, TK_EOF, p->line, p->col);
}

/* ---------------------------------------------------------------------------------- parser */

static tok *peek(parser *p) { return &p->t[p->i]; }
static tok *next(parser *p) { return &p->t[p->i < p->n - 1 ? p->i++ : p->i]; }

static int is_op(const tok *t, const char *op) { return t->kind == TK_OP && !strcmp(t->s, op); }
static int is_name(const tok *t, const char *name) { return t->kind == TK_NAME && !strcmp(t->s, name); }

static const char *tok_desc(const tok *t) {
    switch (t->kind) {
    case TK_TEXT: return "text";
    case TK_VAR_BEGIN: return "'{{'";
    case TK_VAR_END: return "'}}'";
    case TK_BLOCK_BEGIN: return "'{%'";
    case TK_BLOCK_END: return "'%}'";
    case TK_STR: return "a string";
    case TK_INT:
    case TK_FLOAT: return "a number";
    case TK_EOF: return "the end of the template";
    default: return t->s;
    }
}

static void expect_op(parser *p, const char *op) {
    tok *t = next(p);
    if (!is_op(t, op)) fail_at(p, KVB_ERR_FORMAT, t->line, t->col, "expected '%s', found %s", op, tok_desc(t));
}

static const char *expect_name(parser *p) {
    tok *t = next(p);
    if (t->kind != TK_NAME) fail_at(p, KVB_ERR_FORMAT, t->line, t->col, "expected a name, found %s", tok_desc(t));
    return t->s;
}

static void expect_kind(parser *p, tk_kind k) {
    tok *t = next(p);
    if (t->kind != k) {
        tok want = {.kind = k};
        fail_at(p, KVB_ERR_FORMAT, t->line, t->col, "expected %s, found %s", tok_desc(&want), tok_desc(t));
    }
}

/* Bounds the parser's recursion (a template nested 20,000 levels deep overflowed the stack). */
static void enter(parser *p, const tok *at) {
    if (++p->depth > KVB_JINJA_MAX_NESTING)
        fail_at(p, KVB_ERR_UNSUPPORTED, at->line, at->col, "blocks and expressions nest deeper than %d levels",
                KVB_JINJA_MAX_NESTING);
}

static jnode *node(parser *p, jn_kind kind, const tok *at) {
    jnode *n = kvb__ja_alloc(p->a, sizeof *n);
    n->kind = kind;
    n->line = at->line;
    n->col = at->col;
    return n;
}

/* A growable array of node pointers in the arena. */
typedef struct nvec {
    jnode **v;
    int n, cap;
} nvec;

static void nvec_push(parser *p, nvec *v, jnode *x) {
    if (v->n == v->cap) {
        int cap = v->cap ? 2 * v->cap : 8;
        jnode **nv = kvb__ja_alloc(p->a, (size_t)cap * sizeof *nv);
        if (v->n) memcpy(nv, v->v, (size_t)v->n * sizeof *nv);
        v->v = nv;
        v->cap = cap;
    }
    v->v[v->n++] = x;
}

static jnode *parse_expr(parser *p);
static jnode *parse_or(parser *p);
static jnode *parse_unary(parser *p);

/* Call arguments after '(' up to ')': positional, then name=value. */
static void parse_args(parser *p, jnode *n) {
    nvec args = {0};
    const char **kw = NULL;
    int cap = 0;
    while (!is_op(peek(p), ")")) {
        if (args.n) expect_op(p, ",");
        if (is_op(peek(p), ")")) break; /* a trailing comma */
        const char *name = NULL;
        if (peek(p)->kind == TK_NAME && is_op(&p->t[p->i + 1], "=")) {
            name = next(p)->s;
            next(p);
        }
        nvec_push(p, &args, parse_expr(p));
        if (args.n > cap) {
            int ncap = cap ? 2 * cap : 8;
            const char **nk = kvb__ja_alloc(p->a, (size_t)ncap * sizeof *nk);
            if (cap) memcpy(nk, kw, (size_t)cap * sizeof *nk);
            kw = nk;
            cap = ncap;
        }
        kw[args.n - 1] = name;
    }
    expect_op(p, ")");
    n->args = args.v;
    n->n_args = args.n;
    n->kw = kw;
}

static jnode *parse_primary(parser *p) {
    tok *t = next(p);
    jnode *n;
    switch (t->kind) {
    case TK_STR: {
        n = node(p, JN_LIT, t);
        kvb_buf b = {0};
        int ok = kvb__buf_append(&b, t->s, t->n) == KVB_OK;
        while (peek(p)->kind == TK_STR) { /* adjacent literals concatenate */
            tok *u = next(p);
            ok = ok && kvb__buf_append(&b, u->s, u->n) == KVB_OK;
        }
        if (!ok) {
            kvb__buf_free(&b);
            longjmp(*p->a->oom, 1);
        }
        n->lit = (jv){.kind = JV_STR, .u.s = {kvb__ja_strdup(p->a, b.p ? b.p : "", b.len), b.len}};
        kvb__buf_free(&b);
        return n;
    }
    case TK_INT:
        n = node(p, JN_LIT, t);
        n->lit = (jv){.kind = JV_INT, .u.i = t->i};
        return n;
    case TK_FLOAT:
        n = node(p, JN_LIT, t);
        n->lit = (jv){.kind = JV_FLOAT, .u.f = t->f};
        return n;
    case TK_NAME:
        n = node(p, JN_LIT, t);
        if (!strcmp(t->s, "true") || !strcmp(t->s, "True")) n->lit = (jv){.kind = JV_BOOL, .u.b = 1};
        else if (!strcmp(t->s, "false") || !strcmp(t->s, "False")) n->lit = (jv){.kind = JV_BOOL, .u.b = 0};
        else if (!strcmp(t->s, "none") || !strcmp(t->s, "None")) n->lit = (jv){.kind = JV_NONE};
        else {
            n->kind = JN_NAME;
            n->name = t->s;
        }
        return n;
    case TK_OP:
        if (is_op(t, "(")) {
            if (is_op(peek(p), ")")) {
                next(p);
                return node(p, JN_TUPLE, t);
            }
            jnode *e = parse_expr(p);
            if (!is_op(peek(p), ",")) {
                expect_op(p, ")");
                return e;
            }
            n = node(p, JN_TUPLE, t);
            nvec items = {0};
            nvec_push(p, &items, e);
            while (is_op(peek(p), ",")) {
                next(p);
                if (is_op(peek(p), ")")) break;
                nvec_push(p, &items, parse_expr(p));
            }
            expect_op(p, ")");
            n->args = items.v;
            n->n_args = items.n;
            return n;
        }
        if (is_op(t, "[")) {
            n = node(p, JN_LIST, t);
            nvec items = {0};
            while (!is_op(peek(p), "]")) {
                if (items.n) expect_op(p, ",");
                if (is_op(peek(p), "]")) break;
                nvec_push(p, &items, parse_expr(p));
            }
            expect_op(p, "]");
            n->args = items.v;
            n->n_args = items.n;
            return n;
        }
        if (is_op(t, "{")) {
            n = node(p, JN_DICT, t);
            nvec items = {0};
            while (!is_op(peek(p), "}")) {
                if (items.n) expect_op(p, ",");
                if (is_op(peek(p), "}")) break;
                nvec_push(p, &items, parse_expr(p));
                expect_op(p, ":");
                nvec_push(p, &items, parse_expr(p));
            }
            expect_op(p, "}");
            n->args = items.v;
            n->n_args = items.n;
            return n;
        }
        break;
    default: break;
    }
    fail_at(p, KVB_ERR_FORMAT, t->line, t->col, "unexpected %s", tok_desc(t));
}

static jnode *parse_postfix(parser *p, jnode *n) {
    for (;;) {
        tok *t = peek(p);
        if (is_op(t, ".")) {
            next(p);
            tok *nt = next(p);
            jnode *a = node(p, nt->kind == TK_INT ? JN_ITEM : JN_ATTR, t);
            a->a = n;
            if (nt->kind == TK_INT) { /* x.0 is x[0] */
                a->b = node(p, JN_LIT, nt);
                a->b->lit = (jv){.kind = JV_INT, .u.i = nt->i};
            } else if (nt->kind == TK_NAME) a->name = nt->s;
            else fail_at(p, KVB_ERR_FORMAT, nt->line, nt->col, "expected an attribute name after '.'");
            n = a;
        } else if (is_op(t, "[")) {
            next(p);
            jnode *parts[3] = {NULL, NULL, NULL};
            int k = 0, slice = 0;
            for (;;) {
                if (!is_op(peek(p), ":") && !is_op(peek(p), "]")) parts[k] = parse_expr(p);
                if (is_op(peek(p), ":") && k < 2) {
                    next(p);
                    slice = 1;
                    k++;
                    continue;
                }
                break;
            }
            expect_op(p, "]");
            jnode *a = node(p, slice ? JN_SLICE : JN_ITEM, t);
            a->a = n;
            a->b = parts[0];
            a->c = parts[1];
            a->d = parts[2];
            if (!slice && !parts[0]) fail_at(p, KVB_ERR_FORMAT, t->line, t->col, "empty subscript");
            n = a;
        } else if (is_op(t, "(")) {
            next(p);
            jnode *c = node(p, JN_CALL, t);
            c->a = n;
            parse_args(p, c);
            n = c;
        } else return n;
    }
}

static int is_keyword(const tok *t) {
    static const char *const kws[] = {"and", "or", "not", "in", "is", "if", "else", "elif", "endif", "endfor"};
    if (t->kind != TK_NAME) return 0;
    for (size_t k = 0; k < KVB_ARRAY_LEN(kws); k++)
        if (!strcmp(t->s, kws[k])) return 1;
    return 0;
}

/* Filters (`| name(args)`) and tests (`is [not] name [arg | (args)]`) after a unary expression. */
static jnode *parse_filters(parser *p, jnode *n) {
    for (;;) {
        tok *t = peek(p);
        if (is_op(t, "|")) {
            next(p);
            jnode *f = node(p, JN_FILTER, t);
            f->a = n;
            f->name = expect_name(p);
            if (is_op(peek(p), "(")) {
                next(p);
                parse_args(p, f);
            }
            n = f;
        } else if (is_name(t, "is")) {
            next(p);
            jnode *f = node(p, JN_TEST, t);
            f->a = n;
            if (is_name(peek(p), "not")) {
                next(p);
                f->op = OP_NE; /* negated */
            } else f->op = OP_EQ;
            f->name = expect_name(p); /* `none`, `true`, `false` lex as names too */
            if (is_op(peek(p), "(")) {
                next(p);
                parse_args(p, f);
            } else {
                tok *a = peek(p);
                if (a->kind == TK_STR || a->kind == TK_INT || a->kind == TK_FLOAT ||
                    (a->kind == TK_NAME && !is_keyword(a))) {
                    f->args = kvb__ja_alloc(p->a, sizeof *f->args);
                    f->kw = kvb__ja_alloc(p->a, sizeof *f->kw);
                    f->args[0] = parse_postfix(p, parse_primary(p));
                    f->n_args = 1;
                }
            }
            n = f;
        } else return n;
    }
}

static jnode *parse_unary(parser *p) {
    tok *t = peek(p);
    if (is_op(t, "-") || is_op(t, "+")) {
        next(p);
        jnode *n = node(p, is_op(t, "-") ? JN_NEG : JN_POS, t);
        enter(p, t);
        n->a = parse_unary(p);
        p->depth--;
        return parse_filters(p, n);
    }
    return parse_filters(p, parse_postfix(p, parse_primary(p)));
}

static jnode *binary(parser *p, jn_kind kind, jop op, const tok *at, jnode *a, jnode *b) {
    jnode *n = node(p, kind, at);
    n->op = op;
    n->a = a;
    n->b = b;
    return n;
}

static jnode *parse_pow(parser *p) {
    jnode *n = parse_unary(p);
    while (is_op(peek(p), "**")) {
        tok *t = next(p);
        n = binary(p, JN_BIN, OP_POW, t, n, parse_unary(p));
    }
    return n;
}

static jnode *parse_mul(parser *p) {
    jnode *n = parse_pow(p);
    for (;;) {
        tok *t = peek(p);
        jop op;
        if (is_op(t, "*")) op = OP_MUL;
        else if (is_op(t, "/")) op = OP_DIV;
        else if (is_op(t, "//")) op = OP_FLOORDIV;
        else if (is_op(t, "%")) op = OP_MOD;
        else return n;
        next(p);
        n = binary(p, JN_BIN, op, t, n, parse_pow(p));
    }
}

static jnode *parse_add(parser *p) {
    jnode *n = parse_mul(p);
    for (;;) {
        tok *t = peek(p);
        if (!is_op(t, "+") && !is_op(t, "-")) return n;
        next(p);
        n = binary(p, JN_BIN, is_op(t, "+") ? OP_ADD : OP_SUB, t, n, parse_mul(p));
    }
}

static jnode *parse_concat(parser *p) {
    jnode *n = parse_add(p);
    while (is_op(peek(p), "~")) {
        tok *t = next(p);
        n = binary(p, JN_BIN, OP_CONCAT, t, n, parse_add(p));
    }
    return n;
}

static jnode *parse_cmp(parser *p) {
    jnode *n = parse_concat(p);
    for (;;) {
        tok *t = peek(p);
        static const struct { const char *s; jop op; } cmps[] = {{"==", OP_EQ}, {"!=", OP_NE}, {"<", OP_LT},
                                                                 {"<=", OP_LE}, {">", OP_GT}, {">=", OP_GE}};
        size_t k;
        for (k = 0; k < KVB_ARRAY_LEN(cmps) && !is_op(t, cmps[k].s); k++) {}
        if (k < KVB_ARRAY_LEN(cmps)) {
            next(p);
            n = binary(p, JN_CMP, cmps[k].op, t, n, parse_concat(p));
        } else if (is_name(t, "in")) {
            next(p);
            n = binary(p, JN_IN, OP_EQ, t, n, parse_concat(p));
        } else if (is_name(t, "not") && is_name(&p->t[p->i + 1], "in")) {
            next(p);
            next(p);
            n = binary(p, JN_NOT_IN, OP_EQ, t, n, parse_concat(p));
        } else return n;
    }
}

static jnode *parse_not(parser *p) {
    tok *t = peek(p);
    if (is_name(t, "not")) {
        next(p);
        jnode *n = node(p, JN_NOT, t);
        enter(p, t);
        n->a = parse_not(p);
        p->depth--;
        return n;
    }
    return parse_cmp(p);
}

static jnode *parse_and(parser *p) {
    jnode *n = parse_not(p);
    while (is_name(peek(p), "and")) {
        tok *t = next(p);
        n = binary(p, JN_AND, OP_EQ, t, n, parse_not(p));
    }
    return n;
}

static jnode *parse_or(parser *p) {
    jnode *n = parse_and(p);
    while (is_name(peek(p), "or")) {
        tok *t = next(p);
        n = binary(p, JN_OR, OP_EQ, t, n, parse_and(p));
    }
    return n;
}

/* `a if cond else b` (without else: undefined when cond is false). */
static jnode *parse_cond(parser *p);
static jnode *parse_expr(parser *p) {
    enter(p, peek(p));
    jnode *n = parse_cond(p);
    p->depth--;
    return n;
}

static jnode *parse_cond(parser *p) {
    jnode *n = parse_or(p);
    while (is_name(peek(p), "if")) {
        tok *t = next(p);
        jnode *c = node(p, JN_COND, t);
        c->b = n;
        c->a = parse_or(p);
        if (is_name(peek(p), "else")) {
            next(p);
            c->c = parse_expr(p);
        }
        n = c;
    }
    return n;
}

/* ---------------------------------------------------------------------------------- statements */

static void parse_body(parser *p, nvec *body, const char *const *ends, const char **stopped);

static jnode *parse_if_rest(parser *p, const tok *at) {
    jnode *n = node(p, JN_IF, at);
    n->a = parse_expr(p);
    expect_kind(p, TK_BLOCK_END);
    nvec body = {0};
    static const char *const ends[] = {"elif", "else", "endif", NULL};
    const char *stop;
    parse_body(p, &body, ends, &stop);
    n->body = body.v;
    n->n_body = body.n;
    if (!strcmp(stop, "elif")) {
        n->orelse = kvb__ja_alloc(p->a, sizeof *n->orelse);
        enter(p, &p->t[p->i - 1]);
        n->orelse[0] = parse_if_rest(p, &p->t[p->i - 1]);
        p->depth--;
        n->n_orelse = 1;
        return n; /* the nested if consumed endif */
    }
    if (!strcmp(stop, "else")) {
        expect_kind(p, TK_BLOCK_END);
        nvec els = {0};
        static const char *const ends2[] = {"endif", NULL};
        parse_body(p, &els, ends2, &stop);
        n->orelse = els.v;
        n->n_orelse = els.n;
    }
    expect_kind(p, TK_BLOCK_END);
    return n;
}

static jnode *parse_statement(parser *p) {
    tok *t = next(p);
    if (t->kind != TK_NAME) fail_at(p, KVB_ERR_FORMAT, t->line, t->col, "expected a statement name");
    const char *stop;
    if (!strcmp(t->s, "if")) return parse_if_rest(p, t);
    if (!strcmp(t->s, "for")) {
        jnode *n = node(p, JN_FOR, t);
        n->name = expect_name(p);
        if (is_op(peek(p), ",")) {
            next(p);
            n->name2 = expect_name(p);
        }
        tok *in = next(p);
        if (!is_name(in, "in")) fail_at(p, KVB_ERR_FORMAT, in->line, in->col, "expected 'in' in a for loop");
        n->a = parse_or(p);
        if (is_name(peek(p), "if")) {
            next(p);
            n->c = parse_expr(p);
        }
        if (is_name(peek(p), "recursive")) fail_at(p, KVB_ERR_UNSUPPORTED, t->line, t->col, "recursive loops are not supported");
        expect_kind(p, TK_BLOCK_END);
        nvec body = {0}, els = {0};
        static const char *const ends[] = {"else", "endfor", NULL}, *const ends2[] = {"endfor", NULL};
        parse_body(p, &body, ends, &stop);
        if (!strcmp(stop, "else")) {
            expect_kind(p, TK_BLOCK_END);
            parse_body(p, &els, ends2, &stop);
        }
        expect_kind(p, TK_BLOCK_END);
        n->body = body.v;
        n->n_body = body.n;
        n->orelse = els.v;
        n->n_orelse = els.n;
        return n;
    }
    if (!strcmp(t->s, "set")) {
        jnode *n = node(p, JN_SET, t);
        n->name = expect_name(p);
        if (is_op(peek(p), ".")) {
            next(p);
            n->name2 = expect_name(p); /* ns.attr */
            n->op = OP_GT;             /* marks an attribute target */
        } else if (is_op(peek(p), ",")) {
            next(p);
            n->name2 = expect_name(p); /* a, b = pair */
        }
        if (peek(p)->kind == TK_BLOCK_END && !n->name2) { /* {% set x %}...{% endset %} */
            next(p);
            n->kind = JN_SET_BLOCK;
            nvec body = {0};
            static const char *const ends[] = {"endset", NULL};
            parse_body(p, &body, ends, &stop);
            expect_kind(p, TK_BLOCK_END);
            n->body = body.v;
            n->n_body = body.n;
            return n;
        }
        expect_op(p, "=");
        n->a = parse_expr(p);
        if (is_op(peek(p), ",")) { /* set x = a, b: a tuple */
            jnode *tup = node(p, JN_TUPLE, t);
            nvec items = {0};
            nvec_push(p, &items, n->a);
            while (is_op(peek(p), ",")) {
                next(p);
                nvec_push(p, &items, parse_expr(p));
            }
            tup->args = items.v;
            tup->n_args = items.n;
            n->a = tup;
        }
        expect_kind(p, TK_BLOCK_END);
        return n;
    }
    if (!strcmp(t->s, "macro")) {
        jnode *n = node(p, JN_MACRO, t);
        n->name = expect_name(p);
        expect_op(p, "(");
        nvec defs = {0};
        const char **params = kvb__ja_alloc(p->a, 32 * sizeof *params);
        while (!is_op(peek(p), ")")) {
            if (n->n_params) expect_op(p, ",");
            if (n->n_params == 32) fail_at(p, KVB_ERR_UNSUPPORTED, t->line, t->col, "more than 32 macro parameters");
            params[n->n_params++] = expect_name(p);
            jnode *def = NULL;
            if (is_op(peek(p), "=")) {
                next(p);
                def = parse_expr(p);
            }
            nvec_push(p, &defs, def);
        }
        expect_op(p, ")");
        expect_kind(p, TK_BLOCK_END);
        n->params = params;
        n->args = defs.v;
        n->n_args = defs.n;
        nvec body = {0};
        static const char *const ends[] = {"endmacro", NULL};
        parse_body(p, &body, ends, &stop);
        if (peek(p)->kind == TK_NAME) next(p); /* {% endmacro name %} */
        expect_kind(p, TK_BLOCK_END);
        n->body = body.v;
        n->n_body = body.n;
        return n;
    }
    if (!strcmp(t->s, "break") || !strcmp(t->s, "continue")) {
        jnode *n = node(p, t->s[0] == 'b' ? JN_BREAK : JN_CONTINUE, t);
        expect_kind(p, TK_BLOCK_END);
        return n;
    }
    if (!strcmp(t->s, "generation")) { /* transformers' assistant-mask marker: renders its body */
        jnode *n = node(p, JN_BLOCK, t);
        expect_kind(p, TK_BLOCK_END);
        nvec body = {0};
        static const char *const ends[] = {"endgeneration", NULL};
        parse_body(p, &body, ends, &stop);
        expect_kind(p, TK_BLOCK_END);
        n->body = body.v;
        n->n_body = body.n;
        return n;
    }
    fail_at(p, KVB_ERR_UNSUPPORTED, t->line, t->col, "the '%s' statement is not supported", t->s);
}

/* Statements until one of `ends` (a NULL-terminated list; NULL: the end of the template), whose name
 * is consumed and returned in *stopped. */
static void parse_body(parser *p, nvec *body, const char *const *ends, const char **stopped) {
    for (;;) {
        tok *t = peek(p);
        if (t->kind == TK_EOF) {
            if (!ends) return;
            int last = 0;
            while (ends[last + 1]) last++; /* the closing tag ("endfor", not "else") */
            fail_at(p, KVB_ERR_FORMAT, t->line, t->col, "missing {%% %s %%}", ends[last]);
        }
        if (t->kind == TK_TEXT) {
            next(p);
            jnode *n = node(p, JN_TEXT, t);
            n->name = t->s;
            n->name_len = t->n;
            nvec_push(p, body, n);
        } else if (t->kind == TK_VAR_BEGIN) {
            next(p);
            jnode *n = node(p, JN_OUTPUT, t);
            n->a = parse_expr(p);
            expect_kind(p, TK_VAR_END);
            nvec_push(p, body, n);
        } else if (t->kind == TK_BLOCK_BEGIN) {
            tok *name = &p->t[p->i + 1];
            for (int k = 0; ends && ends[k]; k++)
                if (is_name(name, ends[k])) {
                    p->i += 2;
                    *stopped = ends[k];
                    return;
                }
            static const char *const closers[] = {"endif", "endfor", "elif", "else", "endmacro", "endset", "endgeneration"};
            for (size_t k = 0; k < KVB_ARRAY_LEN(closers); k++)
                if (is_name(name, closers[k]))
                    fail_at(p, KVB_ERR_FORMAT, name->line, name->col, "unexpected {%% %s %%}", closers[k]);
            next(p);
            enter(p, t);
            nvec_push(p, body, parse_statement(p));
            p->depth--;
        } else fail_at(p, KVB_ERR_FORMAT, t->line, t->col, "unexpected %s", tok_desc(t));
    }
}

/* The first node deeper than `limit` below n, or NULL. Chains the parser builds in loops (a.b.c...,
 * a + b + c ..., x|f|g...) nest without recursing, and the evaluator recurses over the tree: it is
 * bounded here, with a recursion no deeper than the bound itself. */
static const jnode *too_deep(const jnode *n, int depth, int limit) {
    if (!n) return NULL;
    if (depth > limit) return n;
    const jnode *kids[] = {n->a, n->b, n->c, n->d}, *bad;
    for (size_t k = 0; k < KVB_ARRAY_LEN(kids); k++)
        if ((bad = too_deep(kids[k], depth + 1, limit))) return bad;
    for (int k = 0; k < n->n_args; k++)
        if ((bad = too_deep(n->args[k], depth + 1, limit))) return bad;
    for (int k = 0; k < n->n_body; k++)
        if ((bad = too_deep(n->body[k], depth + 1, limit))) return bad;
    for (int k = 0; k < n->n_orelse; k++)
        if ((bad = too_deep(n->orelse[k], depth + 1, limit))) return bad;
    return NULL;
}

kvb_status kvb_jinja_parse(const char *src, size_t len, kvb_jinja **out, char *err, size_t err_len) {
    kvb_jinja *j = calloc(1, sizeof *j);
    if (!j) return KVB_ERR_NOMEM;
    jmp_buf oom;
    parser p = {.src = src, .len = len, .line = 1, .col = 1, .a = &j->arena, .err = err, .err_len = err_len};
    j->arena.oom = &oom;
    if (len && src[len - 1] == '\n') p.len--; /* keep_trailing_newline=False */
    if (setjmp(oom)) {
        snprintf(err, err_len, "out of memory parsing the chat template");
        p.st = KVB_ERR_NOMEM;
        goto fail;
    }
    if (setjmp(p.jb)) goto fail;
    lex(&p);
    nvec body = {0};
    parse_body(&p, &body, NULL, NULL);
    for (int k = 0; k < body.n; k++) {
        const jnode *bad = too_deep(body.v[k], 1, KVB_JINJA_MAX_NESTING);
        if (bad)
            fail_at(&p, KVB_ERR_UNSUPPORTED, bad->line, bad->col, "blocks and expressions nest deeper than %d levels",
                    KVB_JINJA_MAX_NESTING);
    }
    j->body = body.v;
    j->n_body = body.n;
    free(p.t);
    kvb__buf_free(&p.str);
    j->arena.oom = NULL;
    *out = j;
    return KVB_OK;
fail:
    free(p.t);
    kvb__buf_free(&p.str);
    kvb__ja_free(&j->arena);
    free(j);
    *out = NULL;
    return p.st;
}

void kvb_jinja_destroy(kvb_jinja *j) {
    if (!j) return;
    kvb__ja_free(&j->arena);
    free(j);
}
