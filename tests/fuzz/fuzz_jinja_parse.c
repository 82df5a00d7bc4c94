/* libFuzzer target: the Jinja parser (common/text/jinja_parse.c) on any bytes as a template's source.
 * Every input must parse or be refused with an error message; nothing may crash, leak or run past the
 * nesting bound. tests/fuzz/README (docs/text.md) says how to run it longer. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/text/chat.h"
#include "common/util/log.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    kvb_log_set_level(KVB_LOG_ERROR); /* the refusals are expected */
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *src = malloc(size + 1);
    if (!src) return 0;
    memcpy(src, data, size);
    src[size] = 0; /* a NUL inside ends the template, as it would for a C string from JSON */
    kvb_chat_template *t = NULL;
    char err[256] = "";
    kvb_status st = kvb_chat_template_parse(src, "<s>", "</s>", &t, err, sizeof err);
    if (st != KVB_OK && (t || !err[0])) abort(); /* a refusal says why and returns nothing */
    kvb_chat_template_destroy(t);
    free(src);
    return 0;
}
