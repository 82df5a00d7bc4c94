/* kvbank — small file helpers shared by the process tests (logs of the programs they start). */
#ifndef KVB_TESTS_TESTFILES_H
#define KVB_TESTS_TESTFILES_H

#include <stdio.h>
#include <string.h>

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

#endif
