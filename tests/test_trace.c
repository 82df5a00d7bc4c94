/* kvbank — the trace loader of kvbank-bench (bench/trace.c) on small files in the traces' real formats. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench/trace.h"
#include "tests/harness.h"

/* Writes `text` to a fresh file named `name` in a temporary directory; *dir gets the directory. */
static void write_file(char dir[64], const char *name, const char *text, char *path, size_t path_len) {
    snprintf(dir, 64, "/tmp/kvbttrace-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(path, path_len, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    ck_assert_int_eq(fputs(text, f) >= 0, 1);
    ck_assert_int_eq(fclose(f), 0);
}

static void remove_file(const char *dir, const char *path) {
    unlink(path);
    rmdir(dir);
}

static kvb_trace_opts opts(void) {
    return (kvb_trace_opts){.rate_scale = 1, .len_scale = 1.0 / 32, .out_scale = 1, .vocab = 200, .max_len = 4096};
}

/* Mooncake's conversation traces start every request with the same system-prompt block: sessions are
 * told apart by the longest shared prefix chain, a turn extending its session's previous prompt. */
KVB_TEST(mooncake_sessions_by_prefix_chain) {
    static const char *text =
        "{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 8, \"hash_ids\": [1, 2]}\n"
        "{\"timestamp\": 100, \"input_length\": 1024, \"output_length\": 8, \"hash_ids\": [1, 3]}\n"
        "{\"timestamp\": 200, \"input_length\": 1536, \"output_length\": 8, \"hash_ids\": [1, 2, 4]}\n"
        "{\"timestamp\": 300, \"input_length\": 2000, \"output_length\": 8, \"hash_ids\": [1, 3, 5, 6]}\n"
        "{\"timestamp\": 400, \"input_length\": 2048, \"output_length\": 8, \"hash_ids\": [1, 2, 4, 7]}\n"
        "{\"timestamp\": 500, \"input_length\": 512, \"output_length\": 8, \"hash_ids\": [8]}\n"
        "{\"timestamp\": 600, \"input_length\": 1024, \"output_length\": 8, \"hash_ids\": [1, 9]}\n";
    char dir[64], path[128];
    write_file(dir, "conv.jsonl", text, path, sizeof path);
    kvb_trace_opts o = opts();
    kvb_trace *t = NULL;
    ck_assert_int_eq(kvb_trace_load(path, &o, &t), KVB_OK);
    ck_assert_int_eq(t->n, 7);
    /* A: [1,2] [1,2,4] [1,2,4,7]; B: [1,3] [1,3,5,6]; C: [8]; D: [1,9] (shares only the system block) */
    const int session[] = {0, 1, 0, 1, 0, 2, 3}, turn[] = {0, 0, 1, 1, 2, 0, 0};
    ck_assert_int_eq(t->n_sessions, 4);
    for (int i = 0; i < t->n; i++) {
        ck_assert_msg(t->reqs[i].session == session[i] && t->reqs[i].turn == turn[i],
                      "request %d: session %d turn %d, want %d / %d", i, t->reqs[i].session, t->reqs[i].turn,
                      session[i], turn[i]);
    }
    /* a turn's prompt starts with its session's previous prompt (16 tokens per hash block here) */
    for (int i = 0; i < t->n; i++)
        for (int k = 0; k < i; k++)
            if (t->reqs[k].session == t->reqs[i].session && t->reqs[k].turn == t->reqs[i].turn - 1)
                ck_assert_int_eq(memcmp(t->reqs[i].prompt, t->reqs[k].prompt,
                                        (size_t)KVB_MIN(t->reqs[k].n_prompt, t->reqs[i].n_prompt) * sizeof(int32_t)), 0);
    /* reuse: the system block of requests 1, 2, 3, 4, 6; request 2's [1,2]; ... */
    ck_assert_int_eq(t->reqs[0].reused_tokens, 0);
    ck_assert_int_eq(t->reqs[1].reused_tokens, 16);
    ck_assert_int_eq(t->reqs[2].reused_tokens, 32);
    ck_assert_int_eq(t->reqs[4].reused_tokens, 48);
    kvb_trace_free(t);
    remove_file(dir, path);
}
KVB_TEST_END

KVB_TEST(mooncake_bad_record_named) {
    static const char *text = "{\"timestamp\": 0, \"input_length\": 512, \"output_length\": 8, \"hash_ids\": [1]}\n"
                              "{\"timestamp\": 1, \"input_length\": 512, \"hash_ids\": [1]}\n";
    char dir[64], path[128];
    write_file(dir, "bad.jsonl", text, path, sizeof path);
    kvb_trace_opts o = opts();
    kvb_trace *t = NULL;
    ck_assert_int_eq(kvb_trace_load(path, &o, &t), KVB_ERR_FORMAT);
    ck_assert_ptr_null(t);
    remove_file(dir, path);
}
KVB_TEST_END

KVB_TEST_MAIN("trace", KVB_T(mooncake_sessions_by_prefix_chain, 20), KVB_T(mooncake_bad_record_named, 20))
