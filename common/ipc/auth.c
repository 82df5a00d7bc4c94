/* kvbank — the node's credentials and the ZAP protocol (common/ipc/auth.h). */
#include "common/ipc/auth.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "common/util/sha256.h"

#define TEXT_MAX 256 /* the longest credential text */

void kvb_auth_token(const uint8_t secret[KVB_AUTH_SECRET_BYTES], const char *name, char out[KVB_AUTH_TOKEN_LEN + 1]) {
    char msg[300];
    int n = snprintf(msg, sizeof msg, "kvbank-model:%s", name ? name : "");
    if (n < 0 || n >= (int)sizeof msg) n = (int)sizeof msg - 1;
    uint8_t mac[KVB_SHA256_BYTES];
    kvb_hmac_sha256(secret, KVB_AUTH_SECRET_BYTES, msg, (size_t)n, mac);
    kvb_hex(mac, sizeof mac, out);
}

kvb_status kvb_auth_new_secret(kvb_auth *a) {
    memset(a, 0, sizeof *a);
    size_t got = 0;
    while (got < KVB_AUTH_SECRET_BYTES) {
        ssize_t r = getrandom(a->secret + got, KVB_AUTH_SECRET_BYTES - got, 0);
        if (r < 0) {
            if (errno == EINTR) continue;
            KVB_LOG_E("getrandom: %s", strerror(errno));
            return KVB_ERR_IO;
        }
        got += (size_t)r;
    }
    a->has_secret = 1;
    return KVB_OK;
}

kvb_status kvb_auth_format(const kvb_auth *a, char *out, size_t out_len) {
    char hex[2 * KVB_AUTH_SECRET_BYTES + 1];
    int n;
    if (a->has_secret) {
        kvb_hex(a->secret, KVB_AUTH_SECRET_BYTES, hex);
        n = snprintf(out, out_len, "secret %s\n", hex);
    } else if (strlen(a->token) == KVB_AUTH_TOKEN_LEN) {
        n = snprintf(out, out_len, "token %s\n", a->token);
    } else {
        return KVB_ERR_INVALID;
    }
    return n > 0 && (size_t)n < out_len ? KVB_OK : KVB_ERR_INVALID;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

/* `n` lower-case hex characters of `s`, then a line end or the string's end. */
static int is_hex_word(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (hexval(s[i]) < 0) return 0;
    return s[n] == '\0' || (s[n] == '\n' && s[n + 1] == '\0');
}

kvb_status kvb_auth_parse(const char *text, kvb_auth *a) {
    memset(a, 0, sizeof *a);
    if (!text) return KVB_ERR_INVALID;
    if (!strncmp(text, "secret ", 7) && is_hex_word(text + 7, 2 * KVB_AUTH_SECRET_BYTES)) {
        for (int i = 0; i < KVB_AUTH_SECRET_BYTES; i++)
            a->secret[i] = (uint8_t)(hexval(text[7 + 2 * i]) << 4 | hexval(text[8 + 2 * i]));
        a->has_secret = 1;
        return KVB_OK;
    }
    if (!strncmp(text, "token ", 6) && is_hex_word(text + 6, KVB_AUTH_TOKEN_LEN)) {
        memcpy(a->token, text + 6, KVB_AUTH_TOKEN_LEN);
        a->token[KVB_AUTH_TOKEN_LEN] = '\0';
        return KVB_OK;
    }
    return KVB_ERR_INVALID;
}

/* Reads at most TEXT_MAX - 1 bytes of `fd` into text[TEXT_MAX]. */
static kvb_status read_text(int fd, char text[TEXT_MAX]) {
    size_t n = 0;
    while (n < TEXT_MAX - 1) {
        ssize_t r = read(fd, text + n, TEXT_MAX - 1 - n);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return KVB_ERR_IO;
        if (r == 0) break;
        n += (size_t)r;
    }
    text[n] = '\0';
    return KVB_OK;
}

kvb_status kvb_auth_from_env(kvb_auth *a) {
    memset(a, 0, sizeof *a);
    const char *v = getenv(KVB_AUTH_FD_ENV);
    if (!v) return KVB_ERR_NOT_FOUND;
    int64_t fd = -1;
    kvb_status st = kvb_parse_i64(v, 0, INT_MAX, &fd);
    unsetenv(KVB_AUTH_FD_ENV);
    if (st != KVB_OK) {
        KVB_LOG_E("%s=%s is not a file descriptor", KVB_AUTH_FD_ENV, v);
        return KVB_ERR_INVALID;
    }
    char text[TEXT_MAX];
    st = read_text((int)fd, text);
    close((int)fd);
    if (st == KVB_OK) st = kvb_auth_parse(text, a);
    explicit_bzero(text, sizeof text);
    if (st != KVB_OK) {
        KVB_LOG_E("%s=%d: no valid credentials on it", KVB_AUTH_FD_ENV, (int)fd);
        return st;
    }
    a->from_supervisor = 1;
    return KVB_OK;
}

kvb_status kvb_auth_key_path(const char *endpoint, char *out, size_t out_len) {
    if (!endpoint || strncmp(endpoint, "ipc://", 6) != 0 || endpoint[6] == '\0' || endpoint[6] == '@')
        return KVB_ERR_INVALID;
    int n = snprintf(out, out_len, "%s.key", endpoint + 6);
    return n > 0 && (size_t)n < out_len ? KVB_OK : KVB_ERR_INVALID;
}

kvb_status kvb_auth_read_file(const char *path, kvb_auth *a) {
    memset(a, 0, sizeof *a);
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return errno == ENOENT ? KVB_ERR_NOT_FOUND : KVB_ERR_IO;
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_uid != geteuid() || (sb.st_mode & 077)) {
        KVB_LOG_E("%s: not a key file of this user that only it may read (uid %u, mode %04o)", path,
                  (unsigned)sb.st_uid, (unsigned)(sb.st_mode & 07777));
        close(fd);
        return KVB_ERR_STATE;
    }
    char text[TEXT_MAX];
    kvb_status st = read_text(fd, text);
    close(fd);
    if (st == KVB_OK) st = kvb_auth_parse(text, a);
    explicit_bzero(text, sizeof text);
    return st;
}

kvb_status kvb_auth_write_file(const char *path, const kvb_auth *a) {
    char text[TEXT_MAX], tmp[PATH_MAX];
    KVB_TRY(kvb_auth_format(a, text, sizeof text));
    if (snprintf(tmp, sizeof tmp, "%s.tmp-%ld", path, (long)getpid()) >= (int)sizeof tmp) return KVB_ERR_INVALID;
    unlink(tmp);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    kvb_status st = KVB_OK;
    size_t len = strlen(text);
    if (fd < 0 || fchmod(fd, 0600) != 0 || write(fd, text, len) != (ssize_t)len || close(fd) != 0 ||
        rename(tmp, path) != 0) {
        KVB_LOG_E("%s: cannot write the key file: %s", path, strerror(errno));
        if (fd >= 0) unlink(tmp);
        st = KVB_ERR_IO;
    }
    explicit_bzero(text, sizeof text);
    return st;
}

kvb_status kvb_auth_ctl_endpoint(const char *endpoint, char *out, size_t out_len) {
    if (!endpoint) return KVB_ERR_INVALID;
    int n = snprintf(out, out_len, "%s.ctl", endpoint);
    return n > 0 && (size_t)n < out_len ? KVB_OK : KVB_ERR_INVALID;
}

kvb_status kvb_auth_set_plain(void *sock, const char *user, const char *password) {
    if (!sock || !user || !*user || !password || !*password) return KVB_ERR_INVALID;
    if (zmq_setsockopt(sock, ZMQ_PLAIN_USERNAME, user, strlen(user)) != 0 ||
        zmq_setsockopt(sock, ZMQ_PLAIN_PASSWORD, password, strlen(password)) != 0) {
        KVB_LOG_E("zmq_setsockopt(PLAIN): %s", zmq_strerror(errno));
        return KVB_ERR_IO;
    }
    return KVB_OK;
}

kvb_status kvb_auth_set_ctl(void *sock) { return kvb_auth_set_plain(sock, KVB_AUTH_CTL_USER, "-"); }

/* ------------------------------------------------------------------------------------------ ZAP */

/* Copies a frame into out[cap] as a string (cut, NUL-terminated). */
static void frame_str(zmq_msg_t *m, char *out, size_t cap) {
    size_t n = zmq_msg_size(m);
    if (n >= cap) n = cap - 1;
    memcpy(out, zmq_msg_data(m), n);
    out[n] = '\0';
}

/* uid, gid and pid from the last three ':'-separated fields of an ipc:// peer address. */
static void parse_creds(kvb_zap_req *r) {
    r->uid = r->gid = r->pid = -1;
    long v[3];
    const char *end = r->address + strlen(r->address);
    for (int k = 2; k >= 0; k--) {
        const char *p = end;
        while (p > r->address && p[-1] != ':') p--;
        if (p == r->address || p == end) return;
        char num[24];
        size_t n = (size_t)(end - p);
        if (n >= sizeof num) return;
        memcpy(num, p, n);
        num[n] = '\0';
        int64_t x;
        if (kvb_parse_i64(num, 0, INT_MAX, &x) != KVB_OK) return;
        v[k] = (long)x;
        end = p - 1;
    }
    r->uid = v[0];
    r->gid = v[1];
    r->pid = v[2];
}

kvb_status kvb_zap_recv(void *rep, kvb_zap_req *req) {
    memset(req, 0, sizeof *req);
    enum { N_MAX = 9 };
    zmq_msg_t f[N_MAX];
    int n = 0, more = 1;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, rep, n ? 0 : ZMQ_DONTWAIT) < 0) {
            int e = errno;
            zmq_msg_close(&m);
            if (n == 0 && (e == EAGAIN || e == EINTR)) return KVB_ERR_NOT_FOUND;
            break;
        }
        more = zmq_msg_more(&m);
        if (n < N_MAX) f[n++] = m;
        else zmq_msg_close(&m);
    }
    kvb_status st = KVB_OK;
    /* version, request id, domain, address, identity, mechanism, then the mechanism's credentials */
    if (n < 6) {
        st = KVB_ERR_PROTOCOL;
    } else {
        char version[8];
        frame_str(&f[0], version, sizeof version);
        frame_str(&f[1], req->request_id, sizeof req->request_id);
        frame_str(&f[2], req->domain, sizeof req->domain);
        frame_str(&f[3], req->address, sizeof req->address);
        frame_str(&f[5], req->mechanism, sizeof req->mechanism);
        if (n >= 8) {
            frame_str(&f[6], req->user, sizeof req->user);
            frame_str(&f[7], req->password, sizeof req->password);
        }
        if (strcmp(version, "1.0") != 0) st = KVB_ERR_PROTOCOL;
        parse_creds(req);
    }
    for (int i = 0; i < n; i++) zmq_msg_close(&f[i]);
    if (st != KVB_OK) {
        KVB_LOG_W("ZAP: malformed request (%d frames)", n);
        kvb_zap_reply(rep, req, 0, NULL, "malformed ZAP request");
    }
    return st;
}

kvb_status kvb_zap_reply(void *rep, const kvb_zap_req *req, int ok, const char *user_id, const char *why) {
    const char *parts[6] = {"1.0", req->request_id, ok ? "200" : "400", ok ? "OK" : (why ? why : "refused"),
                            ok && user_id ? user_id : "", ""};
    for (int i = 0; i < 6; i++) {
        if (zmq_send(rep, parts[i], strlen(parts[i]), i < 5 ? ZMQ_SNDMORE : 0) < 0) {
            KVB_LOG_E("ZAP: cannot reply: %s", zmq_strerror(errno));
            return KVB_ERR_IO;
        }
    }
    return KVB_OK;
}
