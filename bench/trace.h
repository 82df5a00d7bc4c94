/* kvbank-bench — workload traces from ../shared/traces turned into token-level requests.
 *
 * Mooncake FAST'25 (`synthetic_trace.jsonl`): each hash id stands for one 512-token prefix block and
 * equal ids mean a reusable prefix. A request's prompt is built block by block from its hash ids, each
 * block's tokens derived from the id alone, so equal ids give equal tokens and the trace's prefix reuse
 * becomes real KV reuse; requests are grouped into sessions by the longest shared prefix chain: a
 * request joins the session one of whose prompts' hash ids is the longest prefix of its own (a turn
 * extends its session's previous prompt), else it opens one. Azure LLM inference 2023 (`AzureLLMInferenceTrace_{conv,code}.csv`): arrival times
 * and lengths; prompts are unique (no reuse in that trace).
 * Prompt lengths are multiplied by `len_scale` (to fit a small model's context), output lengths by
 * `out_scale` (capped by max_output), arrival gaps divided by `rate_scale`. */
#ifndef KVB_BENCH_TRACE_H
#define KVB_BENCH_TRACE_H

#include <stdint.h>

#include "common/util/util.h"

typedef struct kvb_trace_req {
    double t_s;         /* arrival, seconds from the trace's start (after rate scaling) */
    int32_t *prompt;    /* [n_prompt] token ids */
    int n_prompt;
    int max_tokens;
    int session;        /* Mooncake: session index (by prefix chain, see above); Azure: -1 */
    int turn;           /* 0-based turn within the session */
    int reused_tokens;  /* prompt tokens whose hash block an earlier request of the trace already had */
} kvb_trace_req;

typedef struct kvb_trace_opts {
    double rate_scale;  /* > 0; 2 = twice the trace's arrival rate */
    double len_scale;   /* prompt tokens per trace token, e.g. 1/32 */
    double out_scale;   /* output tokens per trace token (0 means 1: outputs keep their length, up to max_output) */
    int vocab;          /* token ids are drawn from [3, vocab) */
    int max_len;        /* cap on prompt + max_tokens (the model's context) */
    int max_requests;   /* 0: all */
    double max_time_s;  /* 0: all; else only requests arriving before (scaled time) */
    int min_output;     /* at least this many tokens per request (default 1) */
    int max_output;     /* at most this many (0: no cap beyond max_len) */
} kvb_trace_opts;

typedef struct kvb_trace {
    kvb_trace_req *reqs; /* sorted by arrival */
    int n;
    int n_sessions;
} kvb_trace;

/* Loads a trace, telling the format by the file name (.jsonl: Mooncake; .csv: Azure). Caller owns
 * the result. Errors name the file and line. */
kvb_status kvb_trace_load(const char *path, const kvb_trace_opts *o, kvb_trace **out);
void kvb_trace_free(kvb_trace *t);

#endif
