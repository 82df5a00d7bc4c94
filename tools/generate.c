/* kvbank-generate — offline generation in one process, on the embedded engine. */
#include <getopt.h>
#include <stdio.h>
#include <string.h>

#include "common/model/model.h"
#include "common/policy/policy.h"
#include "common/sched/engine.h"
#include "common/text/chat.h"
#include "common/text/tokenizer.h"
#include "common/util/json.h"
#include "common/util/npy.h"
#include "common/util/prog.h"
#include "kernels/backend.h"

#define MAX_REQ 256

static void usage(FILE *f) {
    fprintf(f,
            "usage: kvbank-generate --model DIR --prompt-ids IDS [--prompt-ids IDS ...] --max-tokens N [options]\n"
            "       kvbank-generate --model DIR --prompt TEXT | --chat FILE.json [...] --max-tokens N [options]\n"
            "\n"
            "Generates tokens for each prompt (comma-separated token ids) and prints the generated ids of each\n"
            "request on its own line, comma-separated, in the order the prompts were given. All prompts run as\n"
            "one continuous batch sharing the KV pool, unless --sequential.\n"
            "\n"
            "options:\n"
            "  --model DIR            Hugging Face model directory (config.json + *.safetensors)\n"
            "  --prompt-ids IDS       a prompt, e.g. 1,2,3; repeat for more requests\n"
            "  --prompt TEXT          a prompt as text, tokenized with the model's tokenizer.json (with its BOS)\n"
            "  --chat FILE            a conversation: a JSON array of {role, content} messages, or an object with\n"
            "                         \"messages\" and more template variables (\"enable_thinking\": false, ...),\n"
            "                         rendered with the model's chat template and the generation prompt\n"
            "                         With --prompt or --chat the model's EOS ids stop generation and the\n"
            "                         decoded text of each request is printed instead of its ids.\n"
            "  --ignore-eos           do not stop at the model's EOS ids\n"
            "  --json                 print one JSON object per request: prompt_ids, ids, text, finish\n"
            "  --max-tokens N         tokens to generate per request\n"
            "  --backend NAME         compute backend (built in: %s; default cpu)\n"
            "  --threads N            CPU threads (default 1)\n"
            "  --block-size N         tokens per KV block (default 16)\n"
            "  --kv-blocks N          KV blocks in the pool (default: enough for every request at once);\n"
            "                         a smaller pool forces preemption by recompute\n"
            "  --max-batch-tokens N   token budget per step; longer prompts are prefilled in chunks (default 512)\n"
            "  --no-prefix-cache      do not reuse KV blocks across requests\n"
            "  --policy NAME          planner (default recompute); --policy list prints them\n"
            "  --policy-param K=V     a parameter of the planner (repeat for more)\n"
            "  --link-preset NAME     the stager's link model (default off); --link-preset list prints them\n"
            "  --sequential           run the requests one after another (later ones can hit the prefix cache)\n"
            "  --temperature T        0 (default) is greedy; otherwise sample\n"
            "  --top-k K, --top-p P   sampling filters (default off)\n"
            "  --seed S               sampling seed (request i uses S + i)\n"
            "  --stop-ids IDS         stop a request after it generates one of these ids\n"
            "  --dump-logits FILE     write the first request's logits as .npy float32 [max_tokens, vocab]\n"
            "  --stats                print engine statistics to stderr\n"
            "  -h, --help             this text\n",
            kvb_backend_list());
}

typedef struct gen_state {
    int n_req;
    int32_t *out[MAX_REQ]; /* [max_tokens] generated ids per request */
    int n_out[MAX_REQ];
    kvb_finish fin[MAX_REQ];
    kvb_status err[MAX_REQ];
    float *dump;           /* [max_tokens][vocab] logits of request 0, or NULL */
    int vocab;
    int max_tokens;
} gen_state;

static void on_token(void *ud, uint64_t id, int index, int32_t tok, uint64_t t_ns) {
    gen_state *g = ud;
    g->out[id][index] = tok;
    g->n_out[id] = index + 1;
}

static void on_finish(void *ud, uint64_t id, kvb_finish why, kvb_status err) {
    gen_state *g = ud;
    g->fin[id] = why;
    g->err[id] = err;
}

static void on_logits(void *ud, uint64_t id, int index, const float *logits, int vocab) {
    gen_state *g = ud;
    if (id == 0 && g->dump) memcpy(g->dump + (size_t)index * vocab, logits, (size_t)vocab * sizeof(float));
}

static int parse_int(const char *flag, const char *v, int min, int *out) {
    int64_t x;
    if (kvb_parse_i64(v, min, 1 << 30, &x) != KVB_OK) {
        fprintf(stderr, "kvbank-generate: %s needs an integer >= %d, got '%s'\n", flag, min, v);
        return -1;
    }
    *out = (int)x;
    return 0;
}

/* --chat FILE: the messages and any other template variables (an array is just the messages). */
static kvb_status render_chat(const char *model_dir, const char *file, char **text) {
    json_t *j = NULL, *extra = NULL;
    kvb_chat_template *ct = NULL;
    char err[512];
    kvb_status st = kvb_json_load_file(file, &j);
    if (st != KVB_OK) return st;
    const json_t *msgs = j;
    if (json_is_object(j)) {
        msgs = json_object_get(j, "messages");
        extra = json_deep_copy(j);
        json_object_del(extra, "messages");
    }
    if (!json_is_array(msgs)) {
        fprintf(stderr, "kvbank-generate: %s: want an array of messages or an object with \"messages\"\n", file);
        st = KVB_ERR_INVALID;
    }
    if (st == KVB_OK && (st = kvb_chat_template_load(model_dir, &ct)) != KVB_OK)
        fprintf(stderr, "kvbank-generate: %s has no usable chat template (see the log above)\n", model_dir);
    if (st == KVB_OK && (st = kvb_chat_render(ct, msgs, 1, extra, text, err, sizeof err)) != KVB_OK)
        fprintf(stderr, "kvbank-generate: %s: %s\n", file, err);
    kvb_chat_template_destroy(ct);
    json_decref(extra);
    json_decref(j);
    return st;
}

/* Tokenizes the --prompt and --chat requests with the model's tokenizer (kept in *tok for decoding). */
static kvb_status text_prompts(const char *model_dir, int n_req, const char **req_text, const int *req_chat,
                               int32_t **prompts, int *n_prompt, kvb_tokenizer **tok) {
    kvb_status st = kvb_tokenizer_load(model_dir, tok);
    if (st != KVB_OK) {
        fprintf(stderr, "kvbank-generate: cannot load the tokenizer of %s (see the log above)\n", model_dir);
        return st;
    }
    for (int i = 0; i < n_req; i++) {
        if (!req_text[i]) continue;
        char *chat = NULL;
        if (req_chat[i]) KVB_TRY(render_chat(model_dir, req_text[i], &chat));
        const char *text = chat ? chat : req_text[i];
        /* a rendered template holds its BOS already */
        st = kvb_tokenizer_encode(*tok, text, strlen(text), !chat, &prompts[i], &n_prompt[i]);
        free(chat);
        if (st != KVB_OK) {
            fprintf(stderr, "kvbank-generate: cannot tokenize prompt %d (not UTF-8?)\n", i);
            return st;
        }
        if (!n_prompt[i]) {
            fprintf(stderr, "kvbank-generate: prompt %d is empty\n", i);
            return KVB_ERR_INVALID;
        }
    }
    return KVB_OK;
}

/* The tokenizer's EOS ids join --stop-ids. */
static kvb_status add_eos_stops(const kvb_tokenizer *tok, int32_t **stop, int *n_stop) {
    const int32_t *eos;
    int n = kvb_tokenizer_eos_ids(tok, &eos);
    KVB_TRY(kvb_realloc_array((void **)stop, (size_t)(*n_stop + n + 1), sizeof **stop));
    for (int i = 0; i < n; i++) (*stop)[(*n_stop)++] = eos[i];
    return KVB_OK;
}

static json_t *id_array(const int32_t *ids, int n) {
    json_t *a = json_array();
    for (int i = 0; a && i < n; i++) json_array_append_new(a, json_integer(ids[i]));
    return a;
}

/* One request's result: its decoded text (special tokens skipped) on a line, or with --json an object
 * with the prompt's ids, the generated ids, the text and why it finished. */
static kvb_status print_result(const kvb_tokenizer *tok, int json_out, const int32_t *prompt, int n_prompt,
                               const int32_t *ids, int n, kvb_finish fin) {
    char *text = NULL;
    size_t len = 0;
    if (tok) KVB_TRY(kvb_tokenizer_decode(tok, ids, n, 1, &text, &len));
    if (!json_out) {
        fwrite(text, 1, len, stdout);
        printf("\n");
        free(text);
        return KVB_OK;
    }
    json_t *o = json_pack("{s:o, s:o, s:s, s:s}", "prompt_ids", id_array(prompt, n_prompt), "ids", id_array(ids, n),
                          "finish", fin == KVB_FINISH_STOP ? "stop" : "length", "text", "");
    if (o && text) json_object_set_new(o, "text", json_stringn(text, len));
    free(text);
    if (!o) return KVB_ERR_NOMEM;
    json_dumpf(o, stdout, JSON_COMPACT | JSON_ENSURE_ASCII);
    printf("\n");
    json_decref(o);
    return KVB_OK;
}

int main(int argc, char **argv) {
    kvb_cpu_threads_wait(argv, KVB_CPU_CORES_OWN);
    kvb_prog_init(argc, argv, "kvbank-generate");
    const char *model_dir = NULL, *backend = "cpu", *dump_path = NULL, *policy = "recompute", *links = "off";
    kvb_policy_params pparams = {0};
    int32_t *prompts[MAX_REQ];
    int n_prompt[MAX_REQ], n_req = 0;
    const char *req_text[MAX_REQ] = {0}; /* --prompt text or --chat file of a request; NULL: --prompt-ids */
    int req_chat[MAX_REQ] = {0};
    int32_t *stop = NULL;
    int n_stop = 0, max_tokens = 0, threads = 1, show_stats = 0, sequential = 0, ignore_eos = 0, json_out = 0;
    int n_text = 0;
    kvb_tokenizer *tok = NULL;
    kvb_engine_opts o;
    kvb_engine_opts_default(&o);
    o.n_blocks = 0;
    kvb_sampling samp = {0};
    double d;
    int64_t seed = 0;
    int rc = 1;
    kvb_backend *be = NULL;
    kvb_model *m = NULL;
    kvb_engine *e = NULL;
    gen_state g = {0};

    enum { O_MODEL = 256, O_PROMPT, O_MAXTOK, O_BACKEND, O_THREADS, O_BS, O_BLOCKS, O_MBT, O_NOPC, O_SEQ, O_TEMP,
           O_TOPK, O_TOPP, O_SEED, O_STOP, O_DUMP, O_STATS, O_TEXT, O_CHAT, O_IGNORE_EOS, O_JSON, O_POLICY, O_PPARAM,
           O_LINKS };
    static const struct option opts[] = {
        {"model", 1, 0, O_MODEL},         {"prompt-ids", 1, 0, O_PROMPT},   {"max-tokens", 1, 0, O_MAXTOK},
        {"backend", 1, 0, O_BACKEND},     {"threads", 1, 0, O_THREADS},     {"block-size", 1, 0, O_BS},
        {"kv-blocks", 1, 0, O_BLOCKS},    {"max-batch-tokens", 1, 0, O_MBT}, {"no-prefix-cache", 0, 0, O_NOPC},
        {"sequential", 0, 0, O_SEQ},      {"temperature", 1, 0, O_TEMP},    {"top-k", 1, 0, O_TOPK},
        {"top-p", 1, 0, O_TOPP},          {"seed", 1, 0, O_SEED},           {"stop-ids", 1, 0, O_STOP},
        {"dump-logits", 1, 0, O_DUMP},    {"stats", 0, 0, O_STATS},         {"policy", 1, 0, O_POLICY},
        {"policy-param", 1, 0, O_PPARAM}, {"prompt", 1, 0, O_TEXT},        {"chat", 1, 0, O_CHAT},
        {"ignore-eos", 0, 0, O_IGNORE_EOS}, {"json", 0, 0, O_JSON},      {"link-preset", 1, 0, O_LINKS},
        {"help", 0, 0, 'h'},
        {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case O_MODEL: model_dir = optarg; break;
        case O_PROMPT:
            if (n_req == MAX_REQ) {
                fprintf(stderr, "kvbank-generate: at most %d prompts\n", MAX_REQ);
                goto bad_args;
            }
            if (kvb_parse_id_list(optarg, &prompts[n_req], &n_prompt[n_req]) != KVB_OK) {
                fprintf(stderr, "kvbank-generate: --prompt-ids needs comma-separated token ids, got '%s'\n", optarg);
                goto bad_args;
            }
            n_req++;
            break;
        case O_TEXT:
        case O_CHAT:
            if (n_req == MAX_REQ) {
                fprintf(stderr, "kvbank-generate: at most %d prompts\n", MAX_REQ);
                goto bad_args;
            }
            prompts[n_req] = NULL;
            n_prompt[n_req] = 0;
            req_text[n_req] = optarg;
            req_chat[n_req++] = c == O_CHAT;
            n_text++;
            break;
        case O_IGNORE_EOS: ignore_eos = 1; break;
        case O_JSON: json_out = 1; break;
        case O_MAXTOK: if (parse_int("--max-tokens", optarg, 1, &max_tokens)) goto bad_args; break;
        case O_BACKEND: backend = optarg; break;
        case O_THREADS: if (parse_int("--threads", optarg, 1, &threads)) goto bad_args; break;
        case O_BS: if (parse_int("--block-size", optarg, 1, &o.block_size)) goto bad_args; break;
        case O_BLOCKS: if (parse_int("--kv-blocks", optarg, 1, &o.n_blocks)) goto bad_args; break;
        case O_MBT: if (parse_int("--max-batch-tokens", optarg, 1, &o.max_batch_tokens)) goto bad_args; break;
        case O_NOPC: o.enable_prefix_cache = 0; break;
        case O_SEQ: sequential = 1; break;
        case O_TEMP:
        case O_TOPP:
            if (kvb_parse_f64(optarg, &d) != KVB_OK) {
                fprintf(stderr, "kvbank-generate: %s needs a number, got '%s'\n", c == O_TEMP ? "--temperature" : "--top-p",
                        optarg);
                goto bad_args;
            }
            if (c == O_TEMP) samp.temperature = (float)d;
            else samp.top_p = (float)d;
            break;
        case O_TOPK: if (parse_int("--top-k", optarg, 0, &samp.top_k)) goto bad_args; break;
        case O_SEED:
            if (kvb_parse_i64(optarg, 0, INT64_MAX, &seed) != KVB_OK) {
                fprintf(stderr, "kvbank-generate: --seed needs a non-negative integer\n");
                goto bad_args;
            }
            break;
        case O_STOP:
            free(stop);
            if (kvb_parse_id_list(optarg, &stop, &n_stop) != KVB_OK) {
                fprintf(stderr, "kvbank-generate: --stop-ids needs comma-separated token ids\n");
                goto bad_args;
            }
            break;
        case O_DUMP: dump_path = optarg; break;
        case O_STATS: show_stats = 1; break;
        case O_POLICY: policy = optarg; break;
        case O_LINKS: links = optarg; break;
        case O_PPARAM:
            if (kvb_policy_params_add(&pparams, optarg) != KVB_OK) {
                fprintf(stderr, "kvbank-generate: --policy-param needs KEY=VALUE, got '%s'\n", optarg);
                goto bad_args;
            }
            break;
        case 'h': usage(stdout); rc = 0; goto out;
        default: usage(stderr); goto bad_args;
        }
    }
    if (!strcmp(policy, "list") || !strcmp(links, "list")) {
        if (!strcmp(policy, "list")) kvb_policy_print_list(stdout);
        else kvb_link_preset_list(stdout);
        rc = 0;
        goto out;
    }
    if (optind != argc || !model_dir || !n_req || !max_tokens) {
        if (optind != argc) fprintf(stderr, "kvbank-generate: unexpected argument '%s'\n", argv[optind]);
        else fprintf(stderr, "kvbank-generate: --model, a prompt (--prompt-ids, --prompt or --chat) and --max-tokens are required\n");
        usage(stderr);
        goto bad_args;
    }
    char why[160];
    if (kvb_sampling_check(&samp, 0, why, sizeof why) != KVB_OK) {
        fprintf(stderr, "kvbank-generate: invalid sampling parameters: %s\n", why);
        goto bad_args;
    }

    if (n_text && text_prompts(model_dir, n_req, req_text, req_chat, prompts, n_prompt, &tok) != KVB_OK) goto out;
    if (tok && !ignore_eos && add_eos_stops(tok, &stop, &n_stop) != KVB_OK) goto out;

    g.n_req = n_req;
    g.max_tokens = max_tokens;
    if (kvb_backend_create(backend, threads, &be) != KVB_OK) goto out;
    if (kvb_model_load(model_dir, be, &m) != KVB_OK) {
        fprintf(stderr, "kvbank-generate: cannot load model from %s\n", model_dir);
        goto out;
    }
    const kvb_model_config *cfg = kvb_model_cfg(m);
    g.vocab = cfg->vocab;
    if (o.n_blocks == 0) {
        for (int i = 0; i < n_req; i++) o.n_blocks += KVB_DIV_CEIL(n_prompt[i] + max_tokens, o.block_size);
    }
    o.max_seqs = KVB_MAX(o.max_seqs, n_req);
    for (int i = 0; i < n_req; i++) {
        if (kvb_malloc((size_t)max_tokens * sizeof(int32_t), (void **)&g.out[i]) != KVB_OK) goto out;
    }
    if (dump_path && kvb_calloc((size_t)max_tokens * cfg->vocab, sizeof(float), (void **)&g.dump) != KVB_OK) goto out;
    /* without --dump-logits nobody reads the logits: a backend that samples on the device does */
    kvb_engine_events ev = {.ud = &g, .on_token = on_token, .on_finish = on_finish,
                            .on_logits = dump_path ? on_logits : NULL};
    if (kvb_link_preset(links, be, &o.links) != KVB_OK) {
        fprintf(stderr, "kvbank-generate: unknown --link-preset '%s' (--link-preset list names them)\n", links);
        goto bad_args;
    }
    kvb_planner planner;
    if (kvb_policy_create(policy, &pparams, &planner) != KVB_OK) {
        fprintf(stderr, "kvbank-generate: cannot create policy '%s' (see the log above; --policy list names them)\n",
                policy);
        goto bad_args;
    }
    if (kvb_engine_create(m, &o, &planner, &ev, &e) != KVB_OK) goto out; /* the engine took the planner */
    if (show_stats) kvb_link_model_print(stderr, kvb_engine_links(e)); /* a scaled preset calibrated */

    for (int i = 0; i < n_req; i++) {
        kvb_request r = {.id = (uint64_t)i, .prompt = prompts[i], .n_prompt = n_prompt[i], .max_tokens = max_tokens,
                         .stop_ids = stop, .n_stop = n_stop, .sampling = samp};
        r.sampling.seed = (uint64_t)seed + (uint64_t)i;
        if (kvb_engine_add(e, &r) != KVB_OK) {
            fprintf(stderr, "kvbank-generate: request %d was rejected (see the log above)\n", i);
            goto out;
        }
        while (sequential && kvb_engine_n_live(e) > 0)
            if (kvb_engine_step(e) != KVB_OK) goto out;
    }
    while (kvb_engine_n_live(e) > 0)
        if (kvb_engine_step(e) != KVB_OK) goto out;

    for (int i = 0; i < n_req; i++) {
        if (g.fin[i] == KVB_FINISH_ERROR) {
            fprintf(stderr, "kvbank-generate: request %d failed: %s\n", i, kvb_status_str(g.err[i]));
            goto out;
        }
        if (json_out || tok) {
            if (print_result(tok, json_out, prompts[i], n_prompt[i], g.out[i], g.n_out[i], g.fin[i]) != KVB_OK) goto out;
            continue;
        }
        for (int k = 0; k < g.n_out[i]; k++) printf(k ? ",%d" : "%d", g.out[i][k]);
        printf("\n");
    }
    if (dump_path && kvb_npy_write_f32(dump_path, g.dump, g.n_out[0], cfg->vocab) != KVB_OK) goto out;
    if (show_stats) {
        char line[1024];
        kvb_engine_stats_format(e, line, sizeof line);
        fprintf(stderr, "stats: %s\n", line);
    }
    rc = 0;
    goto out;
bad_args:
    rc = 2;
out:
    kvb_engine_destroy(e);
    kvb_model_destroy(m);
    kvb_backend_destroy(be);
    for (int i = 0; i < n_req; i++) {
        free(prompts[i]);
        free(g.out[i]);
    }
    free(g.dump);
    free(stop);
    kvb_tokenizer_destroy(tok);
    kvb_policy_params_free(&pparams);
    return rc;
}
