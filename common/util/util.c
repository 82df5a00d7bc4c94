#include "common/util/util.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

size_t kvb_dtype_size(kvb_dtype dt) { return dt == KVB_DTYPE_F32 ? 4 : dt == KVB_DTYPE_F8_E4M3 ? 1 : 2; }

const char *kvb_dtype_name(kvb_dtype dt) {
    switch (dt) {
    case KVB_DTYPE_F32: return "f32";
    case KVB_DTYPE_F16: return "f16";
    case KVB_DTYPE_BF16: return "bf16";
    case KVB_DTYPE_F8_E4M3: return "f8_e4m3";
    }
    return "?";
}

kvb_status kvb_dtype_parse(const char *name, kvb_dtype *out) {
    if (!name) return KVB_ERR_INVALID;
    if (!strcasecmp(name, "f32") || !strcmp(name, "F32") || !strcmp(name, "float32")) *out = KVB_DTYPE_F32;
    else if (!strcasecmp(name, "f16") || !strcmp(name, "float16")) *out = KVB_DTYPE_F16;
    else if (!strcasecmp(name, "bf16") || !strcmp(name, "bfloat16")) *out = KVB_DTYPE_BF16;
    else if (!strcasecmp(name, "f8_e4m3") || !strcmp(name, "float8_e4m3fn")) *out = KVB_DTYPE_F8_E4M3;
    else return KVB_ERR_INVALID;
    return KVB_OK;
}

/* Allocation failures on demand, per thread (tests): -1 never; n >= 0: after n more allocations. */
static _Thread_local int fail_after = -1;

void kvb__alloc_fail_after(int n) { fail_after = n; }

/* 1 if this allocation is to fail (counting it otherwise). */
static int injected_failure(void) {
    if (fail_after < 0) return 0;
    if (fail_after == 0) return 1;
    fail_after--;
    return 0;
}

kvb_status kvb_malloc(size_t bytes, void **out) {
    void *p = injected_failure() ? NULL : malloc(bytes ? bytes : 1);
    if (!p) {
        KVB_LOG_E("allocation of %zu bytes failed", bytes);
        return KVB_ERR_NOMEM;
    }
    *out = p;
    return KVB_OK;
}

kvb_status kvb_calloc(size_t n, size_t size, void **out) {
    void *p = injected_failure() ? NULL : calloc(n ? n : 1, size ? size : 1);
    if (!p) {
        KVB_LOG_E("allocation of %zu x %zu bytes failed", n, size);
        return KVB_ERR_NOMEM;
    }
    *out = p;
    return KVB_OK;
}

kvb_status kvb_realloc_array(void **p, size_t n, size_t size) {
    if (size && n > SIZE_MAX / size) return KVB_ERR_NOMEM;
    size_t bytes = n * size;
    void *q = injected_failure() ? NULL : realloc(*p, bytes ? bytes : 1);
    if (!q) {
        KVB_LOG_E("reallocation to %zu x %zu bytes failed", n, size);
        return KVB_ERR_NOMEM;
    }
    *p = q;
    return KVB_OK;
}

kvb_status kvb_aligned_alloc(size_t bytes, void **out) {
    void *p = NULL;
    if (injected_failure() || posix_memalign(&p, 64, bytes ? bytes : 64) != 0) {
        KVB_LOG_E("aligned allocation of %zu bytes failed", bytes);
        return KVB_ERR_NOMEM;
    }
    *out = p;
    return KVB_OK;
}

kvb_status kvb_strdup(const char *s, char **out) {
    char *p = injected_failure() ? NULL : strdup(s ? s : "");
    if (!p) return KVB_ERR_NOMEM;
    *out = p;
    return KVB_OK;
}

uint64_t kvb_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

double kvb_now_s(void) { return (double)kvb_now_ns() * 1e-9; }

uint64_t kvb_thread_runq_ns(void) {
    FILE *f = fopen("/proc/thread-self/schedstat", "r");
    if (!f) return 0;
    unsigned long long run = 0, wait = 0;
    int n = fscanf(f, "%llu %llu", &run, &wait);
    fclose(f);
    return n == 2 ? (uint64_t)wait : 0;
}

uint64_t kvb_wall_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

kvb_status kvb_parse_i64(const char *s, int64_t min, int64_t max, int64_t *out) {
    if (!s || !*s) return KVB_ERR_INVALID;
    char *end = NULL;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || *end || v < min || v > max) return KVB_ERR_INVALID;
    *out = v;
    return KVB_OK;
}

kvb_status kvb_parse_f64(const char *s, double *out) {
    if (!s || !*s) return KVB_ERR_INVALID;
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || *end || !isfinite(v)) return KVB_ERR_INVALID;
    *out = v;
    return KVB_OK;
}

kvb_status kvb_parse_id_list(const char *s, int32_t **out, int *n_out) {
    if (!s || !*s) return KVB_ERR_INVALID;
    int cap = 1;
    for (const char *c = s; *c; c++) cap += *c == ',';
    int32_t *ids = NULL;
    KVB_TRY(kvb_calloc((size_t)cap, sizeof *ids, (void **)&ids));
    int n = 0;
    const char *p = s;
    for (;;) {
        char buf[32];
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        int64_t v;
        if (len == 0 || len >= sizeof buf) goto bad;
        memcpy(buf, p, len);
        buf[len] = 0;
        if (kvb_parse_i64(buf, 0, INT32_MAX, &v) != KVB_OK) goto bad;
        ids[n++] = (int32_t)v;
        if (!comma) break;
        p = comma + 1;
    }
    *out = ids;
    *n_out = n;
    return KVB_OK;
bad:
    free(ids);
    return KVB_ERR_INVALID;
}

void kvb_name_from_path(const char *path, char *out, size_t max) {
    size_t end = strlen(path);
    while (end > 1 && path[end - 1] == '/') end--;
    size_t start = end;
    while (start > 0 && path[start - 1] != '/') start--;
    size_t n = 0;
    for (size_t i = start; i < end && n < max; i++) {
        char c = path[i];
        int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
        out[n++] = ok ? c : '_';
    }
    if (n == 0) out[n++] = 'm';
    out[n] = '\0';
}

float kvb_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) {
                man <<= 1;
                exp--;
            }
            man &= 0x3ff;
            bits = sign | (exp << 23) | (man << 13);
        }
    } else if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp - 15 + 127) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

uint16_t kvb_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000;
    int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
    uint32_t man = x & 0x7fffff;
    if (((x >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));
    if (exp >= 0x1f) return (uint16_t)(sign | 0x7c00);
    if (exp <= 0) {
        if (exp < -10) return (uint16_t)sign;
        man |= 0x800000;
        uint32_t shift = (uint32_t)(14 - exp);
        uint32_t half = man >> shift;
        uint32_t rem = man & ((1u << shift) - 1);
        uint32_t mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t h = sign | ((uint32_t)exp << 10) | (man >> 13);
    uint32_t rem = man & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
    return (uint16_t)h;
}

float kvb_bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

uint16_t kvb_f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)((x >> 16) | 0x40); /* quiet NaN */
    x += 0x7fff + ((x >> 16) & 1);
    return (uint16_t)(x >> 16);
}

float kvb_e4m3_to_f32(uint8_t b) {
    if ((b & 0x7f) == 0x7f) return NAN;
    /* the 7 bits of exponent and mantissa as a float32's low exponent bits and high mantissa bits,
     * then 2^(127 - 7): exact for normal and subnormal E4M3 values alike */
    uint32_t bits = (uint32_t)(b & 0x7f) << 20;
    float f;
    memcpy(&f, &bits, sizeof f);
    f *= 0x1p120f;
    return b & 0x80 ? -f : f;
}

float kvb_e4m3_round(float f) {
    float a = fabsf(f);
    uint32_t bits;
    memcpy(&bits, &a, sizeof bits);
    /* E4M3 keeps 3 mantissa bits, and its subnormals step by 2^-9: the quantum q of a's binade. Adding
     * m = q * 2^23 rounds a to a multiple of q, ties to even (the float32 addition's own rounding),
     * subtracting it again is exact. */
    int e = (int)(bits >> 23) - 3;
    if (e < 127 - 9) e = 127 - 9;
    uint32_t mbits = (uint32_t)(e + 23) << 23;
    float m;
    memcpy(&m, &mbits, sizeof m);
    return copysignf((a + m) - m, f);
}

uint8_t kvb_f32_to_e4m3(float f) {
    float r = fabsf(kvb_e4m3_round(f));
    uint8_t b = 0;
    if (r >= 0x1p-6f) { /* normal: exponent field 1..15 */
        int e;
        float mant = frexpf(r, &e); /* r = mant * 2^e, mant in [0.5, 1) */
        b = (uint8_t)(((e - 1 + 7) << 3) | ((int)(mant * 16.0f) - 8));
    } else {
        b = (uint8_t)(r * 512.0f); /* subnormal: r = m * 2^-9 */
    }
    return (uint8_t)(b | (signbit(f) ? 0x80 : 0));
}

kvb_status kvb_open_regular(const char *path, int *fd) {
    *fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (*fd < 0) {
        if (errno == ENOENT) return KVB_ERR_NOT_FOUND;
        KVB_LOG_E("%s: cannot open: %s", path, strerror(errno));
        return KVB_ERR_IO;
    }
    struct stat sb;
    kvb_status st = KVB_OK;
    if (fstat(*fd, &sb) != 0) {
        KVB_LOG_E("%s: cannot stat: %s", path, strerror(errno));
        st = KVB_ERR_IO;
    } else if (!S_ISREG(sb.st_mode)) {
        KVB_LOG_E("%s: not a regular file (%s)", path,
                  S_ISFIFO(sb.st_mode) ? "a FIFO" : S_ISDIR(sb.st_mode) ? "a directory" : S_ISSOCK(sb.st_mode) ? "a socket"
                                                                                                     : "a device");
        st = KVB_ERR_FORMAT;
    } else if (fcntl(*fd, F_SETFL, 0) != 0) { /* a regular file: back to blocking reads */
        KVB_LOG_E("%s: fcntl: %s", path, strerror(errno));
        st = KVB_ERR_IO;
    }
    if (st != KVB_OK) {
        close(*fd);
        *fd = -1;
    }
    return st;
}

kvb_status kvb_read_file(const char *path, size_t max, char **out, size_t *len) {
    int fd;
    *out = NULL;
    *len = 0;
    KVB_TRY(kvb_open_regular(path, &fd));
    struct stat sb;
    kvb_status st = KVB_OK;
    char *buf = NULL;
    if (fstat(fd, &sb) != 0 || (uint64_t)sb.st_size > max) {
        KVB_LOG_E("%s: larger than %zu bytes", path, max);
        st = KVB_ERR_FORMAT;
        goto done;
    }
    size_t cap = (size_t)sb.st_size + 1, n = 0; /* a file that grows meanwhile is read up to its size then */
    KVB_TRY_GOTO(kvb_malloc(cap, (void **)&buf), done);
    while (n < cap - 1) {
        ssize_t r = read(fd, buf + n, cap - 1 - n);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            KVB_LOG_E("%s: cannot read: %s", path, strerror(errno));
            st = KVB_ERR_IO;
            goto done;
        }
        if (r == 0) break;
        n += (size_t)r;
    }
    buf[n] = '\0';
    *out = buf;
    *len = n;
    buf = NULL;
done:
    free(buf);
    close(fd);
    return st;
}

kvb_status kvb_proc_stat(long pid, char *state, long *ppid) {
    if (pid <= 0 || pid > INT_MAX) return KVB_ERR_INVALID;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT || errno == ESRCH ? KVB_ERR_NOT_FOUND : KVB_ERR_IO;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return n < 0 && errno == ESRCH ? KVB_ERR_NOT_FOUND : KVB_ERR_IO;
    buf[n] = '\0';
    const char *rp = strrchr(buf, ')'); /* "pid (comm) S ppid ..." and comm may hold ')' */
    long pp = 0;
    char st = 0;
    if (!rp || sscanf(rp + 1, " %c %ld", &st, &pp) != 2) return KVB_ERR_IO;
    if (state) *state = st;
    if (ppid) *ppid = pp;
    return KVB_OK;
}

int kvb_pid_alive(long pid) {
    if (pid <= 0 || pid > INT_MAX) return 1;
    if (kill((pid_t)pid, 0) != 0 && errno == ESRCH) return 0;
    char st = 0;
    kvb_status s = kvb_proc_stat(pid, &st, NULL);
    if (s == KVB_ERR_NOT_FOUND) return 0;
    if (s != KVB_OK) return 1; /* no /proc: trust kill() */
    return st != 'Z' && st != 'X';
}

void kvb_fmt_py_float(double x, char *buf, size_t cap) {
    if (isnan(x) || isinf(x)) {
        snprintf(buf, cap, "%s", isnan(x) ? "nan" : x > 0 ? "inf" : "-inf");
        return;
    }
    char tmp[64];
    int p;
    for (p = 1; p < 17; p++) {
        snprintf(tmp, sizeof tmp, "%.*e", p - 1, x);
        if (strtod(tmp, NULL) == x) break;
    }
    snprintf(tmp, sizeof tmp, "%.*e", p - 1, x);
    int e = atoi(strchr(tmp, 'e') + 1);
    if (e >= -4 && e < 16) snprintf(buf, cap, "%.*f", KVB_MAX(p - 1 - e, 1), x);
    else snprintf(buf, cap, "%s", tmp);
}
