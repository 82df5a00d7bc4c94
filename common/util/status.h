/* kvbank — project-wide status codes and the propagation macros every layer uses. */
#ifndef KVB_UTIL_STATUS_H
#define KVB_UTIL_STATUS_H

/* 0 is success, every error is negative. Functions return a kvb_status and hand results back through
 * out-parameters; the message that explains an error is logged where the error is first seen. */
typedef enum kvb_status {
    KVB_OK = 0,
    KVB_ERR_NOMEM = -1,       /* an allocation failed */
    KVB_ERR_INVALID = -2,     /* a bad argument or a malformed input (message, file, config) */
    KVB_ERR_IO = -3,          /* a system call on a file, socket or shared-memory object failed */
    KVB_ERR_FORMAT = -4,      /* a file is not in the format it claims (safetensors, JSON, npy) */
    KVB_ERR_UNSUPPORTED = -5, /* well-formed but not something kvbank implements (an architecture, a dtype) */
    KVB_ERR_NOT_FOUND = -6,   /* a named thing (tensor, field, model, file) does not exist */
    KVB_ERR_EXHAUSTED = -7,   /* a pool is out of blocks / a budget is spent */
    KVB_ERR_PROTOCOL = -8,    /* a peer broke the wire protocol (version, unknown message) */
    KVB_ERR_TIMEOUT = -9,     /* a peer did not answer in time */
    KVB_ERR_CANCELLED = -10,  /* the request was cancelled (client gone, drain) */
    KVB_ERR_BACKEND = -11,    /* the compute or memory backend reported an error */
    KVB_ERR_STATE = -12,      /* the call is not valid in the object's current state */
    KVB_ERR_UNAVAILABLE = -13,/* a peer went away (its connection was lost) and did not come back in time */
    KVB_ERR_BUSY = -14,       /* no capacity now (KV memory lent, not borrowed yet): the same call may
                               * succeed later; a client should retry (HTTP 503 with Retry-After) */
} kvb_status;

/* A static string naming the status ("ok", "out of memory", ...). Never NULL. */
const char *kvb_status_str(kvb_status st);

/* Return the status of `x` from the enclosing function if it is an error. */
#define KVB_TRY(x)                                                                                     \
    do {                                                                                               \
        kvb_status kvb__st = (x);                                                                      \
        if (kvb__st != KVB_OK) return kvb__st;                                                         \
    } while (0)

/* Store the status of `x` in the local `st` and jump to `label` if it is an error. */
#define KVB_TRY_GOTO(x, label)                                                                         \
    do {                                                                                               \
        st = (x);                                                                                      \
        if (st != KVB_OK) goto label;                                                                  \
    } while (0)

#define KVB_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))
#define KVB_MIN(a, b) ((a) < (b) ? (a) : (b))
#define KVB_MAX(a, b) ((a) > (b) ? (a) : (b))
#define KVB_DIV_CEIL(a, b) (((a) + (b) - 1) / (b))

#endif
