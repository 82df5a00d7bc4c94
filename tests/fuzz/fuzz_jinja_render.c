/* libFuzzer target: the Jinja renderer (common/text/jinja_eval.c). The input is a template, optionally
 * followed by a NUL and a JSON object of extra variables; it is rendered over a fixed conversation
 * (messages with text, parts, tool calls; tools; add_generation_prompt) under small budgets, so that
 * every input ends quickly: rendered, refused by raise_exception or a run-time error, or stopped by a
 * budget with KVB_ERR_EXHAUSTED. Nothing may crash, leak, overflow the stack or pass a budget. */
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/text/chat.h"
#include "common/util/log.h"

static json_t *g_messages;
static kvb_text_limits g_lim;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    kvb_log_set_level(KVB_LOG_ERROR);
    json_error_t je;
    g_messages = json_loads(
        "[{\"role\": \"system\", \"content\": \"You are terse.\"},"
        " {\"role\": \"user\", \"content\": \"What is 2+2? caf\\u00e9 \\u65e5\\u672c\"},"
        " {\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"type\": \"function\", \"function\":"
        "   {\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": [1, 2.5, null, true]}}}]},"
        " {\"role\": \"tool\", \"content\": \"4\"},"
        " {\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"and\"}, {\"type\": \"text\", \"text\": \"3+3\"}]}]",
        0, &je);
    if (!g_messages) abort();
    kvb_text_limits_default(&g_lim);
    g_lim.render_steps = 200000;
    g_lim.render_output = 1 << 20;
    g_lim.render_memory = 64u << 20;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    size_t tlen = strnlen((const char *)data, size);
    char *src = malloc(tlen + 1);
    if (!src) return 0;
    memcpy(src, data, tlen);
    src[tlen] = 0;
    json_t *extra = NULL;
    if (tlen + 1 < size) {
        json_error_t je;
        extra = json_loadb((const char *)data + tlen + 1, size - tlen - 1, 0, &je);
        if (extra && !json_is_object(extra)) {
            json_decref(extra);
            extra = NULL;
        }
    }
    if (!extra) extra = json_pack("{s:b, s:[{s:s, s:{s:s, s:{s:s}}}]}", "enable_thinking", 0, "tools", "type",
                                  "function", "function", "name", "add", "parameters", "type", "object");
    kvb_chat_template *t = NULL;
    char err[256] = "";
    if (kvb_chat_template_parse(src, "<s>", "</s>", &t, err, sizeof err) == KVB_OK) {
        kvb_chat_template_set_limits(t, &g_lim);
        for (int gen = 0; gen < 2; gen++) {
            char *out = NULL;
            kvb_status st = kvb_chat_render(t, g_messages, gen, extra, &out, err, sizeof err);
            if (st == KVB_OK) {
                if (!out || strlen(out) > g_lim.render_output) abort(); /* the output budget held */
            } else if (out || !err[0]) {
                abort(); /* an error says why and returns nothing */
            }
            free(out);
        }
    }
    kvb_chat_template_destroy(t);
    json_decref(extra);
    free(src);
    return 0;
}
