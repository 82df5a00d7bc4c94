/* kvbank — encoding and validating wire messages. */
#include "common/ipc/wire.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <zmq.h>

/* Logs why a frame was rejected and copies the reason into why[why_len] (when given). */
static void set_why(char *why, size_t why_len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void set_why(char *why, size_t why_len, const char *fmt, ...) {
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    KVB_LOG_W("dropping message: %s", msg);
    if (why && why_len) snprintf(why, why_len, "%s", msg);
}

kvb_status kvb_wire_pack(Kvbank__Envelope *env, uint8_t **buf, size_t *len) {
    if (!env || !buf || !len) return KVB_ERR_INVALID;
    env->version = KVB_PROTO_VERSION;
    size_t n = kvbank__envelope__get_packed_size(env);
    if (n > KVB_WIRE_MAX_FRAME) {
        /* The peer would reject it; say so here, where the caller can still act on it. */
        KVB_LOG_E("message of %zu bytes exceeds the %u-byte frame limit", n, KVB_WIRE_MAX_FRAME);
        return KVB_ERR_INVALID;
    }
    uint8_t *b = NULL;
    KVB_TRY(kvb_malloc(n, (void **)&b));
    size_t w = kvbank__envelope__pack(env, b);
    if (w != n) {
        KVB_LOG_E("protobuf-c packed %zu bytes, expected %zu", w, n);
        free(b);
        return KVB_ERR_STATE;
    }
    *buf = b;
    *len = n;
    return KVB_OK;
}

kvb_status kvb_wire_decode(const uint8_t *buf, size_t len, Kvbank__Envelope **out, kvb_wire_fault *fault) {
    if (!out) return KVB_ERR_INVALID;
    *out = NULL;
    kvb_wire_fault f = KVB_WIRE_MALFORMED;
    Kvbank__Envelope *env = NULL;
    static const uint8_t empty[1] = {0};
    if (len > KVB_WIRE_MAX_FRAME) f = KVB_WIRE_OVERSIZED;
    else if ((buf || !len) && (env = kvbank__envelope__unpack(NULL, len, buf && len ? buf : empty)) != NULL) {
        /* protobuf-c sets the pointer of the body it parsed; an unknown field number leaves NOT_SET */
        if (env->version != KVB_PROTO_VERSION) f = KVB_WIRE_VERSION;
        else if (env->body_case == KVBANK__ENVELOPE__BODY__NOT_SET || !env->register_) f = KVB_WIRE_NO_BODY;
        else f = KVB_WIRE_OK;
    }
    if (fault) *fault = f;
    if (f != KVB_WIRE_OK) {
        if (env) kvbank__envelope__free_unpacked(env, NULL);
        return KVB_ERR_PROTOCOL;
    }
    *out = env;
    return KVB_OK;
}

kvb_status kvb_wire_unpack(const uint8_t *buf, size_t len, Kvbank__Envelope **out, char *why, size_t why_len) {
    if (!out) return KVB_ERR_INVALID;
    *out = NULL;
    if (why && why_len) why[0] = '\0';
    if (!buf && len) return KVB_ERR_INVALID;
    kvb_wire_fault f;
    Kvbank__Envelope *env = NULL;
    if (kvb_wire_decode(buf, len, &env, &f) != KVB_OK) {
        if (f == KVB_WIRE_OVERSIZED)
            set_why(why, why_len, "frame of %zu bytes exceeds the %u-byte limit", len, KVB_WIRE_MAX_FRAME);
        else if (f == KVB_WIRE_VERSION)
            set_why(why, why_len, "unsupported protocol version (expected %u)", KVB_PROTO_VERSION);
        else if (f == KVB_WIRE_NO_BODY) set_why(why, why_len, "envelope has no known body");
        else set_why(why, why_len, "frame of %zu bytes is not a valid kvbank.Envelope", len);
        return KVB_ERR_PROTOCOL;
    }
    int known = 0;
    switch (env->body_case) {
    case KVBANK__ENVELOPE__BODY_GENERATE: known = env->generate != NULL; break;
    case KVBANK__ENVELOPE__BODY_CANCEL: known = env->cancel != NULL; break;
    case KVBANK__ENVELOPE__BODY_TOKENS: known = env->tokens != NULL; break;
    case KVBANK__ENVELOPE__BODY_ERROR: known = env->error != NULL; break;
    case KVBANK__ENVELOPE__BODY_PING: known = env->ping != NULL; break;
    case KVBANK__ENVELOPE__BODY_PONG: known = env->pong != NULL; break;
    default: known = 0; break;
    }
    if (!known) {
        set_why(why, why_len, "envelope has no known body");
        kvbank__envelope__free_unpacked(env, NULL);
        return KVB_ERR_PROTOCOL;
    }
    *out = env;
    return KVB_OK;
}

kvb_status kvb_wire_send(void *sock, const void *ident, size_t ident_len, Kvbank__Envelope *env, int dontwait) {
    if (!sock || !env) return KVB_ERR_INVALID;
    uint8_t *buf = NULL;
    size_t len = 0;
    KVB_TRY(kvb_wire_pack(env, &buf, &len));
    int flags = dontwait ? ZMQ_DONTWAIT : 0;
    int rc = 0;
    if (ident) rc = zmq_send(sock, ident, ident_len, flags | ZMQ_SNDMORE);
    /* With an identity frame accepted, the envelope frame completes the message (ROUTER routes, and
     * decides reachability, on the first frame). */
    if (rc >= 0) rc = zmq_send(sock, buf, len, flags);
    int err = rc < 0 ? errno : 0;
    free(buf);
    if (rc < 0) {
        /* EHOSTUNREACH (peer gone) and EAGAIN (would block / timed out) are for the caller to judge. */
        if (err != EHOSTUNREACH && err != EAGAIN) KVB_LOG_E("zmq_send: %s", zmq_strerror(err));
        errno = err;
        return KVB_ERR_IO;
    }
    return KVB_OK;
}

int kvb_wire_unix_live(const char *path) {
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof sa.sun_path) return 0;
    memcpy(sa.sun_path, path, strlen(path) + 1);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return 0;
    int live = connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
    close(fd);
    return live;
}

kvb_status kvb_wire_router_bind(void *zctx, const char *endpoint, int handover, const char *zap_domain, int sndhwm,
                                int64_t maxmsg, kvb_wire_router *out) {
    memset(out, 0, sizeof *out);
    if (!strncmp(endpoint, "ipc://", 6) && endpoint[6] != '@' && endpoint[6] != '\0' && strcmp(endpoint + 6, "*") &&
        kvb_wire_unix_live(endpoint + 6)) {
        KVB_LOG_E("cannot bind %s: another process is listening there (it keeps its endpoint; stop it first)",
                  endpoint);
        return KVB_ERR_STATE;
    }
    void *sock = zmq_socket(zctx, ZMQ_ROUTER);
    if (!sock) {
        KVB_LOG_E("zmq_socket: %s", zmq_strerror(errno));
        return KVB_ERR_IO;
    }
    int one = 1, zero = 0;
    if (zmq_setsockopt(sock, ZMQ_ROUTER_MANDATORY, &one, sizeof one) ||
        (handover && zmq_setsockopt(sock, ZMQ_ROUTER_HANDOVER, &one, sizeof one)) ||
        zmq_setsockopt(sock, ZMQ_LINGER, &zero, sizeof zero) ||
        zmq_setsockopt(sock, ZMQ_SNDHWM, &sndhwm, sizeof sndhwm) ||
        zmq_setsockopt(sock, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg) ||
        (zap_domain && (zmq_setsockopt(sock, ZMQ_PLAIN_SERVER, &one, sizeof one) ||
                        zmq_setsockopt(sock, ZMQ_ZAP_DOMAIN, zap_domain, strlen(zap_domain))))) {
        KVB_LOG_E("zmq_setsockopt: %s", zmq_strerror(errno));
        zmq_close(sock);
        return KVB_ERR_IO;
    }
    /* zmq_bind creates the socket file in this thread: no moment with looser permissions */
    mode_t old_mask = umask(0077);
    int rc = zmq_bind(sock, endpoint);
    int bind_err = errno;
    umask(old_mask);
    if (rc != 0) {
        KVB_LOG_E("cannot bind %s: %s", endpoint, zmq_strerror(bind_err));
        zmq_close(sock);
        return KVB_ERR_IO;
    }
    char last[1024];
    size_t last_len = sizeof last;
    if (zmq_getsockopt(sock, ZMQ_LAST_ENDPOINT, last, &last_len) != 0) snprintf(last, sizeof last, "%s", endpoint);
    last[sizeof last - 1] = '\0';
    kvb_status st = kvb_strdup(last, &out->endpoint);
    if (st == KVB_OK && !strncmp(last, "ipc://", 6) && last[6] != '@' && last[6] != '\0') {
        /* abstract sockets ("ipc://@name") have no file */
        struct stat sb;
        if (chmod(last + 6, 0600) != 0 || stat(last + 6, &sb) != 0) {
            KVB_LOG_E("chmod 0600 %s: %s", last + 6, strerror(errno));
            st = KVB_ERR_IO;
        } else if ((st = kvb_strdup(last + 6, &out->ipc_path)) == KVB_OK) {
            out->ipc_dev = sb.st_dev;
            out->ipc_ino = sb.st_ino;
        }
    }
    if (st != KVB_OK) {
        zmq_close(sock);
        free(out->endpoint);
        free(out->ipc_path);
        memset(out, 0, sizeof *out);
        return st;
    }
    out->sock = sock;
    return KVB_OK;
}

kvb_status kvb_wire_ipc_check(const char *endpoint, char *why, size_t why_len) {
    if (why && why_len) why[0] = '\0';
    if (!endpoint || strncmp(endpoint, "ipc://", 6) != 0 || endpoint[6] == '@' || endpoint[6] == '\0') return KVB_OK;
    const char *path = endpoint + 6;
    struct stat sb;
    if (stat(path, &sb) != 0) {
        int e = errno;
        if (e == EACCES) {
            if (why) snprintf(why, why_len, "permission denied: %s is inside a directory this user (uid %u) may not "
                                            "enter; talk to the node as the user that runs it", path,
                              (unsigned)geteuid());
            return KVB_ERR_IO;
        }
        if (why) snprintf(why, why_len, "%s: %s", path, e == ENOENT ? "no such socket (is it running?)" : strerror(e));
        return e == ENOENT ? KVB_ERR_NOT_FOUND : KVB_ERR_IO;
    }
    if (!S_ISSOCK(sb.st_mode)) {
        if (why) snprintf(why, why_len, "%s is not a socket", path);
        return KVB_ERR_INVALID;
    }
    /* connect() on a unix socket needs write permission on its file */
    if (faccessat(AT_FDCWD, path, W_OK, AT_EACCESS) != 0 && (errno == EACCES || errno == EPERM)) {
        if (why) snprintf(why, why_len, "permission denied: %s belongs to uid %u (mode %04o), this is uid %u; talk to "
                                        "the node as the user that runs it", path, (unsigned)sb.st_uid,
                          (unsigned)(sb.st_mode & 07777), (unsigned)geteuid());
        return KVB_ERR_IO;
    }
    return KVB_OK;
}

int kvb_wire_monitor_event(void *mon, uint16_t *ev) {
    zmq_msg_t m;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, mon, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&m);
        return 0;
    }
    *ev = 0; /* frame 1: the event (16 bits) and a value (32 bits); frame 2: the endpoint */
    if (zmq_msg_size(&m) >= sizeof *ev) memcpy(ev, zmq_msg_data(&m), sizeof *ev);
    int more = zmq_msg_more(&m);
    zmq_msg_close(&m);
    while (more) {
        zmq_msg_init(&m);
        more = zmq_msg_recv(&m, mon, ZMQ_DONTWAIT) >= 0 && zmq_msg_more(&m);
        zmq_msg_close(&m);
    }
    return 1;
}
