#include "common/util/status.h"

const char *kvb_status_str(kvb_status st) {
    switch (st) {
    case KVB_OK: return "ok";
    case KVB_ERR_NOMEM: return "out of memory";
    case KVB_ERR_INVALID: return "invalid argument or input";
    case KVB_ERR_IO: return "i/o error";
    case KVB_ERR_FORMAT: return "bad file format";
    case KVB_ERR_UNSUPPORTED: return "unsupported";
    case KVB_ERR_NOT_FOUND: return "not found";
    case KVB_ERR_EXHAUSTED: return "resource exhausted";
    case KVB_ERR_PROTOCOL: return "protocol error";
    case KVB_ERR_TIMEOUT: return "timed out";
    case KVB_ERR_CANCELLED: return "cancelled";
    case KVB_ERR_BACKEND: return "backend error";
    case KVB_ERR_STATE: return "invalid state";
    case KVB_ERR_UNAVAILABLE: return "peer unavailable";
    case KVB_ERR_BUSY: return "no capacity now, try again later";
    }
    return "unknown status";
}
