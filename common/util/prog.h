/* kvbank — what every kvbank program does first: its log tag, the KVB_LOG_LEVEL check and --version. */
#ifndef KVB_UTIL_PROG_H
#define KVB_UTIL_PROG_H

/* Sets the log tag to `prog`; exits 2 with a message naming the levels when KVB_LOG_LEVEL is set to
 * something that is not one; prints "PROG (kvbank) VERSION" and exits 0 when an argument before any
 * "--" is exactly "--version". Call it first in main. */
void kvb_prog_init(int argc, char **argv, const char *prog);

/* The version string of the build ("0.1.0"). */
const char *kvb_version(void);

#endif
