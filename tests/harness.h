/* kvbank — one test runner per suite, on top of the `check` framework.
 *
 *   KVB_TEST(example) { ... ck_assert_int_eq(a, b); ... } KVB_TEST_END
 *   KVB_TEST_MAIN("suite", KVB_T(example, 10), ...)     (name, timeout in seconds)
 *
 *   KVB_T_NEED(example, 10, need)   (need() returns NULL when this machine can run the test, else why not)
 *
 * Every test runs in its own forked process (check's CK_FORK) with its own timeout in seconds.
 * `--list` prints the names, `--test NAME` runs one, no argument runs all. A test whose need is not met
 * is not run: it prints "SKIP: NAME: why". The exit code is 1 if a selected test failed, else 77 (the
 * test suite's SKIP) if one was skipped, else 0: a suite passes only when it checked everything it names.
 * check's assertions print both values on failure. */
#ifndef KVB_TESTS_HARNESS_H
#define KVB_TESTS_HARNESS_H

#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

typedef struct kvb_test {
    const char *name;
    const TTest *fn;
    double timeout_s;
    const char *(*need)(void); /* NULL, or: NULL when the test can check what it names here, else why not */
} kvb_test;

#define KVB_TEST(name) START_TEST(t_##name)
#define KVB_TEST_END END_TEST
#define KVB_T(name, timeout) {#name, t_##name, (timeout), NULL}
#define KVB_T_NEED(name, timeout, need) {#name, t_##name, (timeout), (need)}

static inline int kvb_test_main(int argc, char **argv, const char *suite_name, const kvb_test *tests, int n) {
    const char *only = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--list")) {
            for (int k = 0; k < n; k++) printf("%s\n", tests[k].name);
            return 0;
        } else if (!strcmp(argv[i], "--test") && i + 1 < argc) {
            only = argv[++i];
        } else {
            fprintf(stderr, "usage: %s [--list | --test NAME]\n", argv[0]);
            return 2;
        }
    }
    Suite *s = suite_create(suite_name);
    int selected = 0, skipped = 0, run = 0;
    for (int k = 0; k < n; k++) {
        if (only && strcmp(only, tests[k].name)) continue;
        selected++;
        const char *why = tests[k].need ? tests[k].need() : NULL;
        if (why) {
            printf("SKIP: %s: %s\n", tests[k].name, why);
            skipped++;
            continue;
        }
        TCase *tc = tcase_create(tests[k].name);
        tcase_set_timeout(tc, tests[k].timeout_s);
        tcase_add_test(tc, tests[k].fn);
        suite_add_tcase(s, tc);
        run++;
    }
    SRunner *sr = srunner_create(s); /* frees the suite with it */
    if (!selected) {
        srunner_free(sr);
        fprintf(stderr, "no test named '%s' (see --list)\n", only ? only : "");
        return 2;
    }
    int failed = 0;
    if (run) {
        srunner_set_fork_status(sr, CK_FORK);
        srunner_run_all(sr, CK_NORMAL);
        failed = srunner_ntests_failed(sr);
    }
    srunner_free(sr);
    fflush(stdout);
    return failed ? 1 : skipped ? 77 : 0;
}

/* A multiplier m for scrambling n blocks as j -> (m*j + 3) mod n: a permutation only when m is prime to
 * n (a multiplier that merely does not divide n, 9 for n = 21, maps two blocks to one place). */
static inline int kvb_test_scramble_mul(int n) {
    for (int m = 7;; m += 2) {
        int a = m, b = n;
        while (b) {
            int t = a % b;
            a = b;
            b = t;
        }
        if (a == 1) return m;
    }
}

/* For suites that need a device: runs `probe` (1 when the device is there, else 0 with the reason in
 * why[len]) in a child process, so that the runner, which forks every test, never initialises the
 * device itself, and returns 77 after printing "SKIP: <reason>" when it is missing; -1 when it is
 * there or when the runner only lists its tests. */
static inline int kvb_test_need_device(int argc, char **argv, int (*probe)(char *why, size_t len)) {
    if (argc > 1 && !strcmp(argv[1], "--list")) return -1;
    char why[256] = "";
    int fds[2];
    if (pipe(fds)) return printf("SKIP: pipe failed\n"), 77;
    pid_t pid = fork();
    if (pid < 0) return printf("SKIP: fork failed\n"), 77;
    if (pid == 0) {
        close(fds[0]);
        char msg[256] = "";
        int ok = probe(msg, sizeof msg);
        if (write(fds[1], msg, strlen(msg)) < 0) _exit(3);
        _exit(ok ? 0 : 1);
    }
    close(fds[1]);
    ssize_t got = read(fds[0], why, sizeof why - 1);
    why[got > 0 ? got : 0] = 0;
    close(fds[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    if (WIFEXITED(st) && WEXITSTATUS(st) == 0) return -1;
    printf("SKIP: %s\n", why[0] ? why : "no device");
    return 77;
}

#define KVB_TEST_MAIN(suite_name, ...)                                                                 \
    int main(int argc, char **argv) {                                                                  \
        const kvb_test table[] = {__VA_ARGS__};                                                        \
        return kvb_test_main(argc, argv, suite_name, table, (int)(sizeof table / sizeof table[0]));    \
    }

#endif
