/* kvbank — the Jinja interpreter's shared types: arena, values, syntax tree (internal). */
#ifndef KVB_TEXT_JINJA_IMPL_H
#define KVB_TEXT_JINJA_IMPL_H

#include <setjmp.h>
#include <stddef.h>
#include <stdint.h>

#include "common/text/jinja.h"
#include "common/text/limits.h"
#include "common/text/unicode.h"

/* ---------------------------------------------------------------------------------- arena */

/* Bump allocation in chunks; everything is released at once. A failed allocation longjmps to `oom`
 * (set by the parser or the renderer), so the tree and value code never checks for NULL. */
typedef struct jarena {
    struct jchunk *head;
    jmp_buf *oom;
    size_t budget;  /* bytes the arena may hold (0: no bound); past it an allocation fails with `over` set */
    size_t used;    /* bytes of its chunks */
    int over;       /* the failed allocation was over the budget (not a malloc failure) */
} jarena;

void *kvb__ja_alloc(jarena *a, size_t n); /* zeroed, 16-byte aligned */
char *kvb__ja_strdup(jarena *a, const char *s, size_t n);
void kvb__ja_free(jarena *a);

/* ---------------------------------------------------------------------------------- values */

typedef enum jv_kind {
    JV_UNDEF, JV_NONE, JV_BOOL, JV_INT, JV_FLOAT, JV_STR, JV_LIST, JV_DICT,
    JV_NS,     /* namespace(): a dict whose attributes `set` may assign */
    JV_FUNC,   /* a global function (raise_exception, namespace, range, strftime_now) */
    JV_METHOD, /* a method bound to a value: "abc".startswith */
    JV_MACRO,
} jv_kind;

typedef struct jlist jlist;
typedef struct jdict jdict;
typedef struct jnode jnode;

typedef struct jv {
    jv_kind kind;
    union {
        int b;
        int64_t i;
        double f;
        struct { const char *p; size_t n; } s;
        jlist *l;
        jdict *d;
        const char *fn;          /* JV_FUNC: its name */
        struct jmethod *m;       /* JV_METHOD */
        const jnode *macro;      /* JV_MACRO: the macro's node */
    } u;
    const char *undef_name; /* JV_UNDEF: the name that was missing (for error messages), or NULL */
} jv;

struct jlist {
    jv *v;
    size_t n, cap;
};

struct jdict { /* insertion-ordered; chat data are small, lookups are linear */
    jv *keys, *vals;
    size_t n, cap;
};

struct jmethod {
    jv self;
    const char *name;
};

/* ---------------------------------------------------------------------------------- syntax tree */

typedef enum jn_kind {
    /* statements */
    JN_TEXT, JN_OUTPUT, JN_IF, JN_FOR, JN_SET, JN_SET_BLOCK, JN_MACRO, JN_BREAK, JN_CONTINUE, JN_BLOCK,
    /* expressions */
    JN_LIT, JN_NAME, JN_ATTR, JN_ITEM, JN_SLICE, JN_CALL, JN_FILTER, JN_TEST, JN_NEG, JN_POS, JN_NOT, JN_AND,
    JN_OR, JN_BIN, JN_CMP, JN_IN, JN_NOT_IN, JN_COND, JN_LIST, JN_TUPLE, JN_DICT,
} jn_kind;

/* Binary operators (JN_BIN, JN_CMP). */
typedef enum jop { OP_ADD, OP_SUB, OP_MUL, OP_DIV, OP_FLOORDIV, OP_MOD, OP_POW, OP_CONCAT, OP_EQ, OP_NE, OP_LT,
                   OP_LE, OP_GT, OP_GE } jop;

/* A node; which members mean something depends on the kind (see jinja_parse.c's constructors). */
struct jnode {
    jn_kind kind;
    int line, col;
    jop op;
    const char *name;   /* NAME, ATTR, FILTER, TEST, FOR target, SET target, MACRO name */
    const char *name2;  /* FOR second target ("k, v"), SET attribute (ns.x) */
    size_t name_len;    /* TEXT: length of `name` (the text) */
    jnode *a, *b, *c;   /* operands; IF: a = condition; FOR: a = iterable, c = filter; SLICE: a[b:c:d] */
    jnode *d;
    jnode **args;       /* CALL / FILTER / TEST arguments; LIST/TUPLE items; DICT keys and values alternating */
    const char **kw;    /* keyword names of args ([n_args], NULL for a positional one) */
    int n_args;
    jnode **body;       /* statements: IF/FOR/MACRO/SET_BLOCK/BLOCK body */
    int n_body;
    jnode **orelse;     /* IF's elif/else chain (one node: another IF or a BLOCK), FOR's else */
    int n_orelse;
    const char **params; /* MACRO parameter names; defaults in args */
    int n_params;
    jv lit;             /* LIT */
};

struct kvb_jinja {
    jarena arena; /* the tree */
    jnode **body;
    int n_body;
};

#endif
