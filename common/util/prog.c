/* kvbank — program start-up shared by every kvbank program (prog.h). */
#include "common/util/prog.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util/log.h"
#include "config.h"

const char *kvb_version(void) { return PACKAGE_VERSION; }

void kvb_prog_init(int argc, char **argv, const char *prog) {
    kvb_log_set_tag(prog);
    char why[160];
    if (kvb_log_level_from_env(why, sizeof why) != KVB_OK) {
        fprintf(stderr, "%s: %s\n", prog, why);
        exit(2);
    }
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--")) break;
        if (!strcmp(argv[i], "--version")) {
            printf("%s (kvbank) %s\n", prog, PACKAGE_VERSION);
            exit(0);
        }
    }
}
