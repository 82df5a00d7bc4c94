/* kvbank — kvbankd's start-up rules (see kvbankd_start.h). */
#include "coordinator/kvbankd_start.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include "common/mem/region.h"
#include "common/util/util.h"

#define MAX_HOLDERS 512    /* processes of one node: 256 models, the coordinator, the gateway, helpers */
#define KILL_WAIT_MS 5000  /* after SIGKILL: how long a process may take to be reaped */
#define LOCK_FD_MIN 16     /* the lock's descriptor number, at least */

/* What a kvbankd wrote into its lock: its pid, node and run_dir. */
typedef struct lock_info {
    long pid;
    char node[128];
    char run_dir[PATH_MAX];
} lock_info;

static void lock_info_read(int fd, lock_info *li) {
    char buf[PATH_MAX + 192];
    ssize_t r = pread(fd, buf, sizeof buf - 1, 0);
    buf[r > 0 ? r : 0] = '\0';
    *li = (lock_info){.pid = -1};
    char *save = NULL, *line = strtok_r(buf, "\n", &save);
    if (line) li->pid = strtol(line, NULL, 10);
    if ((line = strtok_r(NULL, "\n", &save))) snprintf(li->node, sizeof li->node, "%s", line);
    if ((line = strtok_r(NULL, "\n", &save))) snprintf(li->run_dir, sizeof li->run_dir, "%s", line);
}

/* The program name of `pid`: the last part of its argv[0] ("?" when unknown; the comm of a program
 * that re-executed itself through /proc/self/exe is "exe"). */
static void proc_name(long pid, char *out, size_t len) {
    char path[64], buf[PATH_MAX];
    snprintf(path, sizeof path, "/proc/%ld/cmdline", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    ssize_t r = fd >= 0 ? read(fd, buf, sizeof buf - 1) : -1;
    if (fd >= 0) close(fd);
    buf[r > 0 ? r : 0] = '\0'; /* argv[0] ends at the first NUL */
    const char *slash = strrchr(buf, '/');
    const char *name = buf[0] ? (slash ? slash + 1 : buf) : "?";
    size_t n = strnlen(name, len - 1);
    memcpy(out, name, n);
    out[n] = '\0';
}

/* 1 when process `pid` has a descriptor open on the file (dev, ino); when `lock_path` is not NULL, also
 * the first descriptor it has on a file named ".../kvbankd.lock" (another node's lock) is written there. */
static int proc_has_file(long pid, dev_t dev, ino_t ino, char *lock_path, size_t len) {
    char dir[64];
    snprintf(dir, sizeof dir, "/proc/%ld/fd", pid);
    DIR *d = opendir(dir);
    if (!d) return 0; /* gone, or another user's */
    int found = 0;
    struct dirent *de;
    while (!found && (de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        char p[64 + sizeof de->d_name];
        struct stat sb;
        snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
        if (stat(p, &sb) == 0 && sb.st_dev == dev && sb.st_ino == ino) found = 1;
        if (lock_path && !lock_path[0]) {
            char target[PATH_MAX];
            ssize_t n = readlink(p, target, sizeof target - 1);
            if (n > 0) {
                target[n] = '\0';
                size_t tl = strlen(target);
                if (tl > 13 && !strcmp(target + tl - 13, "/kvbankd.lock")) snprintf(lock_path, len, "%s", target);
            }
        }
    }
    closedir(d);
    return found;
}

/* The processes of this user, other than this one, with a descriptor on (dev, ino): at most max. */
static int holders_of(dev_t dev, ino_t ino, long *pids, int max) {
    DIR *d = opendir("/proc");
    if (!d) return 0;
    int n = 0;
    struct dirent *de;
    long self = (long)getpid();
    while (n < max && (de = readdir(d))) {
        char *end;
        long pid = strtol(de->d_name, &end, 10);
        if (*end || pid <= 0 || pid == self) continue;
        if (proc_has_file(pid, dev, ino, NULL, 0)) pids[n++] = pid;
    }
    closedir(d);
    return n;
}

kvb_status kvb__node_check_others(const kvb_node_config *cfg, char tags[][48], int n_tags) {
    /* this run_dir's processes hold its lock: theirs are not another node's */
    char lock[PATH_MAX];
    struct stat lsb;
    int have_lock = snprintf(lock, sizeof lock, "%s/kvbankd.lock", cfg->run_dir) < (int)sizeof lock &&
                    stat(lock, &lsb) == 0;
    for (int t = 0; t < n_tags; t++) {
        long pids[MAX_HOLDERS];
        int n = 0;
        if (kvb_region_live_owners(tags[t], pids, MAX_HOLDERS, &n) != KVB_OK) continue;
        for (int i = 0; i < n; i++) {
            char other[PATH_MAX] = "", name[32];
            if (have_lock && proc_has_file(pids[i], lsb.st_dev, lsb.st_ino, NULL, 0)) continue;
            proc_has_file(pids[i], 0, 0, other, sizeof other);
            proc_name(pids[i], name, sizeof name);
            lock_info li = {.pid = -1};
            int fd = other[0] ? open(other, O_RDONLY | O_CLOEXEC | O_NOFOLLOW) : -1;
            if (fd >= 0) {
                lock_info_read(fd, &li);
                close(fd);
            }
            if (li.pid > 0)
                KVB_LOG_E("kvbankd for node \"%s\" already runs on this machine (pid %ld, run_dir %s; its process %ld, "
                          "%s, holds the shared-memory objects of %s): one node of a name per machine",
                          li.node[0] ? li.node : cfg->node, li.pid, li.run_dir[0] ? li.run_dir : "?", pids[i], name, tags[t]);
            else
                KVB_LOG_E("a node named \"%s\" already runs on this machine: process %ld (%s) holds the shared-memory "
                          "objects /dev/shm/kvb-%s-%ld-* and is not one of %s's; stop it or give this node another name",
                          cfg->node, pids[i], name, tags[t], pids[i], cfg->run_dir);
            return KVB_ERR_STATE;
        }
    }
    return KVB_OK;
}

static int pidfd_open_(long pid) { return (int)syscall(SYS_pidfd_open, (pid_t)pid, 0); }
static int pidfd_signal(int pfd, int sig) { return (int)syscall(SYS_pidfd_send_signal, pfd, sig, NULL, 0); }

/* Waits until every pidfd in pfd[n] (-1: done) is readable (its process exited) or ms pass. Returns how
 * many still run. */
static int wait_exits(int *pfd, int n, int ms) {
    double end = kvb_now_s() + ms / 1000.0;
    for (;;) {
        struct pollfd p[MAX_HOLDERS];
        int k = 0, map[MAX_HOLDERS];
        for (int i = 0; i < n; i++)
            if (pfd[i] >= 0) {
                p[k] = (struct pollfd){.fd = pfd[i], .events = POLLIN};
                map[k++] = i;
            }
        if (!k) return 0;
        int left_ms = (int)((end - kvb_now_s()) * 1000.0);
        if (left_ms <= 0) return k;
        int r = poll(p, (nfds_t)k, left_ms);
        if (r < 0 && errno != EINTR) return k;
        for (int j = 0; r > 0 && j < k; j++)
            if (p[j].revents) {
                close(pfd[map[j]]);
                pfd[map[j]] = -1;
            }
    }
}

/* Stops the processes a dead kvbankd left holding the lock (dev, ino). KVB_ERR_STATE when some live on. */
static kvb_status stop_orphans(const kvb_node_config *cfg, const lock_info *li, dev_t dev, ino_t ino, int grace_ms) {
    long pids[MAX_HOLDERS];
    int pfd[MAX_HOLDERS];
    int n = holders_of(dev, ino, pids, MAX_HOLDERS), k = 0;
    char list[1024] = "";
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        /* a pidfd first, then the check that this pid (not a reuse) still holds the lock */
        int p = pidfd_open_(pids[i]);
        if (p < 0) continue;
        if (!proc_has_file(pids[i], dev, ino, NULL, 0)) {
            close(p);
            continue;
        }
        char name[32];
        proc_name(pids[i], name, sizeof name);
        if (at < sizeof list) at += (size_t)snprintf(list + at, sizeof list - at, "%s%ld (%s)", k ? ", " : "", pids[i], name);
        pids[k] = pids[i];
        pfd[k++] = p;
    }
    if (!k) return KVB_OK;
    KVB_LOG_W("kvbankd for node \"%s\" (pid %ld) is gone but left %d process(es) of the node running: %s; stopping "
              "them (SIGTERM, SIGKILL after %d s) before the node starts again",
              li->node[0] ? li->node : cfg->node, li->pid, k, list, grace_ms / 1000);
    for (int i = 0; i < k; i++)
        if (pidfd_signal(pfd[i], SIGTERM) != 0 && errno != ESRCH)
            KVB_LOG_W("pid %ld: SIGTERM: %s", pids[i], strerror(errno));
    int left = wait_exits(pfd, k, grace_ms);
    if (left) {
        for (int i = 0; i < k; i++)
            if (pfd[i] >= 0) {
                KVB_LOG_W("pid %ld did not stop after SIGTERM: SIGKILL", pids[i]);
                pidfd_signal(pfd[i], SIGKILL);
            }
        left = wait_exits(pfd, k, KILL_WAIT_MS);
    }
    if (left) {
        at = 0;
        list[0] = '\0';
        for (int i = 0; i < k; i++)
            if (pfd[i] >= 0) {
                if (at < sizeof list) at += (size_t)snprintf(list + at, sizeof list - at, " %ld", pids[i]);
                close(pfd[i]);
            }
        KVB_LOG_E("the old node's processes%s do not exit (stopped? traced?); end them (kill -KILL%s) and start "
                  "kvbankd again", list, list);
        return KVB_ERR_STATE;
    }
    KVB_LOG_I("the %d process(es) the old kvbankd left are gone", k);
    return KVB_OK;
}

kvb_status kvb__node_lock(const kvb_node_config *cfg, int grace_ms, int *fd_out, char **path_out) {
    size_t n = strlen(cfg->run_dir) + sizeof "/kvbankd.lock";
    char *path;
    KVB_TRY(kvb_malloc(n, (void **)&path));
    snprintf(path, n, "%s/kvbankd.lock", cfg->run_dir);
    *fd_out = -1;
    *path_out = path;
    for (int attempt = 0; attempt < 8; attempt++) {
        /* not close-on-exec: the children hold the lock with kvbankd, and after it. Above the descriptors
         * a child's stdio and credentials take (0-3, KVB_AUTH_FD): there the spawn would replace it. */
        int fd = open(path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (fd >= 0) {
            int high = fcntl(fd, F_DUPFD, LOCK_FD_MIN);
            close(fd);
            fd = high;
        }
        struct stat sb, sp;
        if (fd < 0 || fstat(fd, &sb) != 0) {
            KVB_LOG_E("%s: cannot open: %s", path, strerror(errno));
            if (fd >= 0) close(fd);
            return KVB_ERR_IO;
        }
        if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
            lock_info li;
            lock_info_read(fd, &li);
            if (li.pid > 0 && kvb_pid_alive(li.pid) && proc_has_file(li.pid, sb.st_dev, sb.st_ino, NULL, 0)) {
                KVB_LOG_E("kvbankd for node \"%s\" already runs on this machine (pid %ld, run_dir %s; lock %s)",
                          li.node[0] ? li.node : "?", li.pid, li.run_dir[0] ? li.run_dir : cfg->run_dir, path);
                close(fd);
                return KVB_ERR_STATE;
            }
            kvb_status st = stop_orphans(cfg, &li, sb.st_dev, sb.st_ino, grace_ms);
            if (st == KVB_OK && flock(fd, LOCK_EX | LOCK_NB) != 0) {
                KVB_LOG_E("%s is still locked after the old node's processes stopped (by a process of another "
                          "user?)", path);
                st = KVB_ERR_STATE;
            }
            if (st != KVB_OK) {
                close(fd);
                return st;
            }
        }
        /* The holder may have removed the file between our open and our lock: ours must be the file at
         * the path, else a third kvbankd could lock a new one at the same time. */
        if (stat(path, &sp) == 0 && sp.st_dev == sb.st_dev && sp.st_ino == sb.st_ino) {
            *fd_out = fd;
            return KVB_OK;
        }
        close(fd);
    }
    KVB_LOG_E("%s: cannot take the lock (the file keeps being replaced)", path);
    return KVB_ERR_STATE;
}

kvb_status kvb__node_lock_write(int fd, const char *path, const kvb_node_config *cfg) {
    char buf[PATH_MAX + 192];
    int n = snprintf(buf, sizeof buf, "%ld\n%s\n%s\n", (long)getpid(), cfg->node, cfg->run_dir);
    if (n >= (int)sizeof buf) n = (int)sizeof buf - 1;
    if (ftruncate(fd, 0) != 0 || pwrite(fd, buf, (size_t)n, 0) != n) {
        KVB_LOG_E("%s: cannot write: %s", path, strerror(errno));
        return KVB_ERR_IO;
    }
    return KVB_OK;
}

kvb_status kvb__node_clear_socket(const char *ep) {
    const char *p = ep && !strncmp(ep, "ipc://", 6) ? ep + 6 : NULL;
    struct stat sb;
    if (!p || lstat(p, &sb) != 0 || !S_ISSOCK(sb.st_mode)) return KVB_OK;
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    if (strlen(p) >= sizeof a.sun_path) return KVB_OK; /* ZeroMQ could not bind it either */
    memcpy(a.sun_path, p, strlen(p) + 1);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s >= 0 && connect(s, (struct sockaddr *)&a, sizeof a) == 0) {
        close(s);
        KVB_LOG_E("socket %s is live (a process accepts connections on it): it is not this node's to remove; "
                  "another node or server uses the endpoint %s", p, ep);
        return KVB_ERR_STATE;
    }
    if (s >= 0) close(s); /* refused (nobody listens) or not ours to connect to: the old behaviour, removed */
    if (unlink(p) != 0) KVB_LOG_W("cannot remove socket %s: %s", p, strerror(errno));
    else KVB_LOG_D("removed stale socket %s", p);
    return KVB_OK;
}
