/* kvbank — host memory regions: POSIX shared-memory objects mapped MAP_SHARED (see region.h). */
#include "common/mem/region.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define TAG_MAX KVB_REGION_TAG_MAX
/* Where glibc keeps POSIX shared-memory objects on Linux; names there lack the leading '/'. */
#define SHM_DIR "/dev/shm"
/* How many names kvb_region_create tries when a stale object of a dead process with the same pid
 * already holds the name. */
#define CREATE_ATTEMPTS 16

struct kvb_region {
    void *base;                         /* [size] bytes mapped MAP_SHARED, read/write */
    size_t size;                        /* bytes */
    int owner;                          /* 1 if this process created (and must unlink) the name */
    char name[KVB_REGION_HANDLE_MAX];   /* "/kvb-<tag>-<pid>-<seq>" (or the imported name) */
};

/* Process-wide sequence number of created regions (the <seq> of the name). */
static atomic_ulong g_seq;

/* A copy of `s` fit for a log line: at most 40 bytes, non-printable bytes as '?'. */
static const char *printable(const char *s, char buf[44]) {
    if (!s) return "(null)";
    size_t i = 0;
    for (; s[i] && i < 40; i++) buf[i] = (s[i] >= ' ' && s[i] < 0x7f) ? s[i] : '?';
    if (s[i]) buf[i++] = '.', buf[i++] = '.', buf[i++] = '.';
    buf[i] = 0;
    return buf;
}

int kvb_region_tag_valid(const char *tag) {
    if (!tag) return 0;
    size_t n = strlen(tag);
    if (n == 0 || n > TAG_MAX) return 0;
    for (size_t i = 0; i < n; i++) {
        char ch = tag[i];
        int ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '-' ||
                 ch == '_';
        if (!ok) return 0;
    }
    return 1;
}

/* A handle is "/name": one leading '/', no other, printable, shorter than KVB_REGION_HANDLE_MAX. */
static int handle_valid(const char *h) {
    if (!h || h[0] != '/') return 0;
    size_t n = strnlen(h, KVB_REGION_HANDLE_MAX);
    if (n < 2 || n >= KVB_REGION_HANDLE_MAX) return 0;
    for (size_t i = 1; i < n; i++) {
        unsigned char ch = (unsigned char)h[i];
        if (ch == '/' || ch <= ' ' || ch >= 0x7f) return 0;
    }
    if (!strcmp(h, "/.") || !strcmp(h, "/..")) return 0;
    return 1;
}

/* Maps `fd` (`bytes` long) shared read/write into a new region object named `name`. */
static kvb_status map_fd(int fd, const char *name, size_t bytes, int owner, kvb_region **out) {
    kvb_region *r = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *r, (void **)&r));
    void *base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        KVB_LOG_E("region %s: mmap of %zu bytes failed: %s", name, bytes, strerror(errno));
        free(r);
        return errno == ENOMEM ? KVB_ERR_NOMEM : KVB_ERR_IO;
    }
    r->base = base;
    r->size = bytes;
    r->owner = owner;
    snprintf(r->name, sizeof r->name, "%s", name);
    *out = r;
    return KVB_OK;
}

kvb_status kvb_region_create(const char *tag, size_t bytes, kvb_region **out) {
    if (!out) return KVB_ERR_INVALID;
    *out = NULL;
    if (!kvb_region_tag_valid(tag)) {
        char buf[44];
        KVB_LOG_E("region: invalid tag '%s' (1..%d of [A-Za-z0-9_-])", printable(tag, buf), TAG_MAX);
        return KVB_ERR_INVALID;
    }
    if (bytes == 0 || bytes > (size_t)INT64_MAX) {
        KVB_LOG_E("region %s: invalid size %zu", tag, bytes);
        return KVB_ERR_INVALID;
    }

    char name[KVB_REGION_HANDLE_MAX];
    int fd = -1;
    for (int attempt = 0; attempt < CREATE_ATTEMPTS; attempt++) {
        unsigned long seq = atomic_fetch_add(&g_seq, 1);
        int n = snprintf(name, sizeof name, "/kvb-%s-%ld-%lu", tag, (long)getpid(), seq);
        if (n < 0 || (size_t)n >= sizeof name) {
            KVB_LOG_E("region: name for tag '%s' does not fit %d bytes", tag, KVB_REGION_HANDLE_MAX);
            return KVB_ERR_INVALID;
        }
        fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd >= 0) break;
        if (errno != EEXIST) {
            KVB_LOG_E("region %s: shm_open failed: %s", name, strerror(errno));
            return KVB_ERR_IO;
        }
        KVB_LOG_W("region %s: shm_open: %s (a stale object of an earlier process?); trying the next name", name,
                  strerror(EEXIST));
    }
    if (fd < 0) {
        KVB_LOG_E("region: no free name for tag '%s' after %d attempts", tag, CREATE_ATTEMPTS);
        return KVB_ERR_IO;
    }

    kvb_status st;
    /* shm_open applied the umask to 0600; make the mode exactly 0600 whatever the umask was. */
    if (fchmod(fd, 0600) != 0) {
        KVB_LOG_E("region %s: fchmod 0600 failed: %s", name, strerror(errno));
        st = KVB_ERR_IO;
        goto fail_unlink;
    }
    if (ftruncate(fd, (off_t)bytes) != 0) {
        KVB_LOG_E("region %s: ftruncate to %zu bytes failed: %s", name, bytes, strerror(errno));
        st = KVB_ERR_IO;
        goto fail_unlink;
    }
    /* Reserve the pages now: on a full tmpfs a later first touch would raise SIGBUS instead of an
     * error here. Filesystems without fallocate keep the sparse object. */
    int fa = posix_fallocate(fd, 0, (off_t)bytes);
    if (fa == ENOSPC || fa == ENOMEM) {
        KVB_LOG_E("region %s: posix_fallocate of %zu bytes failed: %s", name, bytes, strerror(fa));
        st = KVB_ERR_NOMEM;
        goto fail_unlink;
    } else if (fa != 0 && fa != EOPNOTSUPP && fa != EINVAL) {
        KVB_LOG_E("region %s: posix_fallocate of %zu bytes failed: %s", name, bytes, strerror(fa));
        st = KVB_ERR_IO;
        goto fail_unlink;
    }
    KVB_TRY_GOTO(map_fd(fd, name, bytes, 1, out), fail_unlink);
    if (close(fd) != 0) KVB_LOG_W("region %s: close failed: %s", name, strerror(errno));
    KVB_LOG_D("region %s: created, %zu bytes", name, bytes);
    return KVB_OK;

fail_unlink:
    if (close(fd) != 0) KVB_LOG_W("region %s: close failed: %s", name, strerror(errno));
    if (shm_unlink(name) != 0) KVB_LOG_E("region %s: shm_unlink failed: %s", name, strerror(errno));
    return st;
}

kvb_status kvb_region_import(const char *handle, kvb_region **out) {
    if (!out) return KVB_ERR_INVALID;
    *out = NULL;
    if (!handle_valid(handle)) {
        char buf[44];
        KVB_LOG_E("region: invalid handle '%s'", printable(handle, buf));
        return KVB_ERR_INVALID;
    }
    int fd = shm_open(handle, O_RDWR, 0);
    if (fd < 0) {
        int e = errno;
        if (e == ENOENT) {
            KVB_LOG_W("region %s: shm_open failed: %s", handle, strerror(e));
            return KVB_ERR_NOT_FOUND;
        }
        KVB_LOG_E("region %s: shm_open failed: %s", handle, strerror(e));
        return KVB_ERR_IO;
    }
    kvb_status st;
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        KVB_LOG_E("region %s: fstat failed: %s", handle, strerror(errno));
        st = KVB_ERR_IO;
        goto fail_close;
    }
    if (sb.st_size <= 0) {
        /* The creator has not sized it yet (or it is not a kvbank region). */
        KVB_LOG_E("region %s: object is empty", handle);
        st = KVB_ERR_STATE;
        goto fail_close;
    }
    KVB_TRY_GOTO(map_fd(fd, handle, (size_t)sb.st_size, 0, out), fail_close);
    if (close(fd) != 0) KVB_LOG_W("region %s: close failed: %s", handle, strerror(errno));
    KVB_LOG_D("region %s: imported, %zu bytes", handle, (size_t)sb.st_size);
    return KVB_OK;

fail_close:
    if (close(fd) != 0) KVB_LOG_W("region %s: close failed: %s", handle, strerror(errno));
    return st;
}

void kvb_region_destroy(kvb_region *r) {
    if (!r) return;
    if (munmap(r->base, r->size) != 0) KVB_LOG_E("region %s: munmap failed: %s", r->name, strerror(errno));
    if (r->owner && shm_unlink(r->name) != 0) {
        /* ENOENT: someone removed the name already; the mapping was ours. */
        if (errno == ENOENT) KVB_LOG_W("region %s: shm_unlink failed: %s", r->name, strerror(errno));
        else KVB_LOG_E("region %s: shm_unlink failed: %s", r->name, strerror(errno));
    }
    free(r);
}

void *kvb_region_base(const kvb_region *r) { return r ? r->base : NULL; }
size_t kvb_region_size(const kvb_region *r) { return r ? r->size : 0; }
const char *kvb_region_handle(const kvb_region *r) { return r ? r->name : NULL; }
int kvb_region_is_owner(const kvb_region *r) { return r ? r->owner : 0; }

/* The pid of "<pid>-<seq>" (both decimal, nothing else), or -1. */
static long parse_pid_seq(const char *s) {
    long pid = 0;
    const char *p = s;
    if (*p < '0' || *p > '9') return -1;
    while (*p >= '0' && *p <= '9') {
        if (pid > (long)INT_MAX / 10) return -1;
        pid = pid * 10 + (*p++ - '0');
    }
    if (*p++ != '-' || *p < '0' || *p > '9') return -1;
    while (*p >= '0' && *p <= '9') p++;
    return *p || pid <= 0 ? -1 : pid;
}

/* Calls fn(name, pid, arg) for every shared-memory object "kvb-<tag>-<pid>-<seq>" (name without the
 * leading '/'), in readdir order. */
static kvb_status for_each_segment(const char *tag, void (*fn)(const char *name, long pid, void *arg), void *arg) {
    if (!kvb_region_tag_valid(tag)) {
        char buf[44];
        KVB_LOG_E("region: invalid tag '%s' (1..%d of [A-Za-z0-9_-])", printable(tag, buf), TAG_MAX);
        return KVB_ERR_INVALID;
    }
    char prefix[8 + TAG_MAX];
    int plen = snprintf(prefix, sizeof prefix, "kvb-%s-", tag);
    DIR *d = opendir(SHM_DIR);
    if (!d) {
        KVB_LOG_E("region: opendir %s failed: %s", SHM_DIR, strerror(errno));
        return KVB_ERR_IO;
    }
    kvb_status st = KVB_OK;
    for (;;) {
        errno = 0;
        struct dirent *de = readdir(d);
        if (!de) {
            if (errno != 0) {
                KVB_LOG_E("region: readdir %s failed: %s", SHM_DIR, strerror(errno));
                st = KVB_ERR_IO;
            }
            break;
        }
        /* Exactly "kvb-<tag>-<pid>-<seq>": a tag that merely starts with ours ("<tag>-x") is not ours. */
        if (strncmp(de->d_name, prefix, (size_t)plen) != 0) continue;
        long pid = parse_pid_seq(de->d_name + plen);
        if (pid > 0) fn(de->d_name, pid, arg);
    }
    if (closedir(d) != 0) KVB_LOG_W("region: closedir %s failed: %s", SHM_DIR, strerror(errno));
    return st;
}

typedef struct unlink_acc {
    int removed;
    kvb_status st;
} unlink_acc;

static void unlink_if_stale(const char *d_name, long pid, void *arg) {
    unlink_acc *acc = arg;
    if (kvb_pid_alive(pid)) return; /* its creator runs: not stale, whoever it is */
    char name[KVB_REGION_HANDLE_MAX + 8];
    int n = snprintf(name, sizeof name, "/%s", d_name);
    if (n < 0 || (size_t)n >= sizeof name) return;
    if (shm_unlink(name) == 0) {
        acc->removed++;
        KVB_LOG_I("region %s: unlinked (its process %ld is gone)", name, pid);
    } else if (errno != ENOENT) { /* ENOENT: someone else cleaned it up since readdir */
        KVB_LOG_E("region %s: shm_unlink failed: %s", name, strerror(errno));
        acc->st = KVB_ERR_IO;
    }
}

kvb_status kvb_region_unlink_stale(const char *tag, int *n_removed) {
    if (n_removed) *n_removed = 0;
    unlink_acc acc = {0, KVB_OK};
    kvb_status st = for_each_segment(tag, unlink_if_stale, &acc);
    if (n_removed) *n_removed = acc.removed;
    return st != KVB_OK ? st : acc.st;
}

typedef struct owner_acc {
    long *pids;
    int max, n;
} owner_acc;

static void add_live_owner(const char *d_name, long pid, void *arg) {
    owner_acc *acc = arg;
    (void)d_name;
    if (!kvb_pid_alive(pid)) return;
    for (int i = 0; i < acc->n; i++)
        if (acc->pids[i] == pid) return;
    if (acc->n < acc->max) acc->pids[acc->n++] = pid;
}

kvb_status kvb_region_live_owners(const char *tag, long *pids, int max, int *n) {
    owner_acc acc = {pids, max, 0};
    kvb_status st = for_each_segment(tag, add_live_owner, &acc);
    *n = acc.n;
    return st;
}

kvb_status kvb_region_check(const char *handle, long pid, uint64_t bytes, char *why, size_t why_len) {
    if (why && why_len) why[0] = '\0';
    /* "/kvb-" <tag> "-" <pid> "-" <seq>: the tag may hold '-', so the pid is the next-to-last field */
    const char *dash = handle && handle_valid(handle) && !strncmp(handle, "/kvb-", 5) ? strrchr(handle, '-') : NULL;
    const char *p = dash;
    while (p && p > handle + 5 && p[-1] != '-') p--;
    if (!dash || p <= handle + 5 || parse_pid_seq(p) < 0) {
        if (why) snprintf(why, why_len, "region handle '%.100s' is not /kvb-<tag>-<pid>-<seq>", handle ? handle : "");
        return KVB_ERR_INVALID;
    }
    long owner = parse_pid_seq(p);
    if (owner != pid) {
        if (why) snprintf(why, why_len, "region %s belongs to pid %ld, not to pid %ld", handle, owner, pid);
        return KVB_ERR_INVALID;
    }
    char path[sizeof SHM_DIR + KVB_REGION_HANDLE_MAX];
    snprintf(path, sizeof path, "%s%s", SHM_DIR, handle);
    struct stat sb;
    if (lstat(path, &sb) != 0) {
        if (why) snprintf(why, why_len, "region %s does not exist", handle);
        return KVB_ERR_INVALID;
    }
    if (!S_ISREG(sb.st_mode) || sb.st_uid != geteuid() || (sb.st_mode & 077)) {
        if (why) snprintf(why, why_len, "region %s is not a private object of this user (uid %u, mode %04o)", handle,
                          (unsigned)sb.st_uid, (unsigned)(sb.st_mode & 07777));
        return KVB_ERR_INVALID;
    }
    if ((uint64_t)sb.st_size < bytes) {
        if (why) snprintf(why, why_len, "region %s holds %lld bytes, fewer than the %llu claimed", handle,
                          (long long)sb.st_size, (unsigned long long)bytes);
        return KVB_ERR_INVALID;
    }
    return KVB_OK;
}
