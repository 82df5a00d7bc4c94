/* kvbank — running the build's programs from a process test: where the build directory is, and one spawn
 * that captures what the program prints while the test keeps its own peers alive. */
#ifndef KVB_TESTS_TESTPROC_H
#define KVB_TESTS_TESTPROC_H

#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* The build directory: $KVB_BUILDDIR, else two levels above this test's executable (build/tests/x). */
static inline const char *kvb_t_builddir(void) {
    static char dir[PATH_MAX];
    if (dir[0]) return dir;
    const char *env = getenv("KVB_BUILDDIR");
    if (env && *env) {
        snprintf(dir, sizeof dir, "%s", env);
        return dir;
    }
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    ck_assert_int_gt(n, 0);
    exe[n] = '\0';
    for (int up = 0; up < 2; up++) {
        char *slash = strrchr(exe, '/');
        ck_assert_ptr_nonnull(slash);
        *slash = '\0';
    }
    memcpy(dir, exe, strlen(exe) + 1);
    return dir;
}

/* How kvb_t_run_tool runs a program. Zeroed: stdout discarded, stderr to the test's. */
typedef struct kvb_t_run {
    char *out;              /* its stdout, NUL-terminated (what fits in out_len), or NULL */
    size_t out_len;
    char *err;              /* its stderr, NUL-terminated, or NULL */
    size_t err_len;
    const char *err_file;   /* with err: the file its stderr goes to while it runs */
    int quiet;              /* without err: its stderr to /dev/null */
    void (*idle)(void);     /* called every 20 ms without output (a test's peers heartbeat meanwhile) */
} kvb_t_run;

/* Runs argv[0] from the build directory (KVB_LOG_LEVEL=warn) until it exits. Returns its exit status,
 * -1 if it did not exit normally. */
static inline int kvb_t_run_tool(const char *const *argv, const kvb_t_run *r) {
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/%s", kvb_t_builddir(), argv[0]);
    int fds[2];
    ck_assert_int_eq(pipe(fds), 0);
    fflush(NULL);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        dup2(fds[1], 1);
        close(fds[0]);
        close(fds[1]);
        const char *to = r->err ? r->err_file : r->quiet ? "/dev/null" : NULL;
        if (to) {
            int fd = open(to, O_WRONLY | O_CREAT | O_TRUNC, 0600);
            if (fd >= 0) dup2(fd, 2);
        }
        setenv("KVB_LOG_LEVEL", "warn", 1);
        execv(path, (char *const *)argv);
        fprintf(stderr, "exec %s: %s\n", path, strerror(errno));
        _exit(127);
    }
    close(fds[1]);
    size_t n = 0;
    char sink[4096];
    for (;;) {
        struct pollfd pf = {.fd = fds[0], .events = POLLIN};
        if (r->idle && poll(&pf, 1, 20) == 0) {
            r->idle();
            continue;
        }
        char *dst = r->out && n + 1 < r->out_len ? r->out + n : sink;
        size_t room = r->out && n + 1 < r->out_len ? r->out_len - 1 - n : sizeof sink;
        ssize_t got = read(fds[0], dst, room);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) break;
        if (dst != sink) n += (size_t)got;
    }
    close(fds[0]);
    if (r->out && r->out_len) r->out[n] = '\0';
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (r->err && r->err_len) {
        r->err[0] = '\0';
        FILE *f = fopen(r->err_file, "r");
        if (f) {
            size_t k = fread(r->err, 1, r->err_len - 1, f);
            r->err[k] = '\0';
            fclose(f);
        }
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

#endif
