/* kvbank — small file helpers shared by the process tests (logs of the programs they start). */
#ifndef KVB_TESTS_TESTFILES_H
#define KVB_TESTS_TESTFILES_H

#include <dirent.h>
#include <errno.h>
#include <ftw.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* Copies the file at `path` to stderr under a `---- title ----` line (nothing if it cannot be read). */
static inline void kvb_t_print_file(const char *path, const char *title) {
    FILE *f = fopen(path, "r");
    if (!f) return;
    char line[4096];
    fprintf(stderr, "---- %s ----\n", title);
    while (fgets(line, sizeof line, f)) fputs(line, stderr);
    fclose(f);
}

/* 1 when a line of the file at `path` contains `needle`. */
static inline int kvb_t_file_contains(const char *path, const char *needle) {
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char line[4096];
    int found = 0;
    while (!found && fgets(line, sizeof line, f)) found = strstr(line, needle) != NULL;
    fclose(f);
    return found;
}

static inline int kvb_t_rm_entry(const char *path, const struct stat *sb, int type, struct FTW *ftw) {
    (void)sb, (void)type, (void)ftw;
    remove(path);
    return 0;
}

/* Removes `dir` and everything below it (links are not followed). */
static inline void kvb_t_remove_tree(const char *dir) { nftw(dir, kvb_t_rm_entry, 8, FTW_DEPTH | FTW_PHYS); }

/* Removes /tmp/kvb-test-<pid>.d directories and /tmp/kvb-test-<pid>-* files of dead test processes
 * (check's forked tests skip their cleanup when an assertion fails). */
static inline void kvb_t_remove_stale(void) {
    DIR *d = opendir("/tmp");
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        int pid = 0, n = 0;
        if (sscanf(e->d_name, "kvb-test-%d%n", &pid, &n) != 1 || pid <= 0 || pid == getpid()) continue;
        if (e->d_name[n] != '.' && e->d_name[n] != '-') continue;
        if (kill(pid, 0) == 0 || errno != ESRCH) continue;
        char p[PATH_MAX];
        snprintf(p, sizeof p, "/tmp/%s", e->d_name);
        kvb_t_remove_tree(p);
    }
    closedir(d);
}

#endif
