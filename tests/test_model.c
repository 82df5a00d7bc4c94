/* Unit tests of common/model: config.json parsing, RoPE frequencies, safetensors reading and writing
 * (every malformed case), and loading model directories onto the CPU backend. Every test makes its
 * files under its own mkdtemp directory, removed at exit. */
#include <fcntl.h>
#include <ftw.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/model/config.h"
#include "common/model/model.h"
#include "common/model/model_impl.h"
#include "common/model/safetensors.h"
#include "common/util/util.h"
#include "kernels/backend.h"
#include "tests/harness.h"
#include "tests/testmodel.h"

/* ------------------------------------------------------------------------------------ helpers */

/* All files live under one mkdtemp directory made by the runner process before it forks the tests and
 * removed when the runner exits, so a failed assertion (check's forked child _exits) leaves nothing. */
static char g_root[64];
static pid_t g_root_pid;
static char g_tmp[128];

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

__attribute__((constructor)) static void root_create(void) {
    snprintf(g_root, sizeof g_root, "/tmp/kvb-test-model-XXXXXX");
    if (mkdtemp(g_root)) g_root_pid = getpid();
    else g_root[0] = 0;
}

__attribute__((destructor)) static void root_remove(void) {
    if (g_root[0] && getpid() == g_root_pid) nftw(g_root, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* This test's own directory under the root (one per test process). */
static const char *tmpdir(void) {
    if (!g_tmp[0]) {
        ck_assert_msg(g_root[0] != 0, "could not create a temp directory under /tmp");
        snprintf(g_tmp, sizeof g_tmp, "%s/t-XXXXXX", g_root);
        ck_assert_ptr_nonnull(mkdtemp(g_tmp));
    }
    return g_tmp;
}

/* tmp_path("x") -> "<tmpdir>/x" in a static rotating buffer. */
static const char *tmp_path(const char *name) {
    static char bufs[8][256];
    static int k;
    char *b = bufs[k++ % 8];
    snprintf(b, 256, "%s/%s", tmpdir(), name);
    return b;
}

static void mkdir_tmp(const char *name) { ck_assert_int_eq(mkdir(tmp_path(name), 0755), 0); }

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    ck_assert_int_eq(fputs(text, f) >= 0, 1);
    ck_assert_int_eq(fclose(f), 0);
}

/* Captures what the code under test logs to stderr between capture_begin and capture_end. */
static int g_saved_fd = -1;
static char g_log[16384];

static void capture_begin(void) {
    fflush(stderr);
    int fd = open(tmp_path("stderr.log"), O_CREAT | O_TRUNC | O_RDWR, 0600);
    ck_assert_int_ge(fd, 0);
    g_saved_fd = dup(2);
    dup2(fd, 2);
    close(fd);
}

static const char *capture_end(void) {
    fflush(stderr);
    dup2(g_saved_fd, 2);
    close(g_saved_fd);
    FILE *f = fopen(tmp_path("stderr.log"), "r");
    ck_assert_ptr_nonnull(f);
    size_t n = fread(g_log, 1, sizeof g_log - 1, f);
    g_log[n] = 0;
    fclose(f);
    fputs(g_log, stderr); /* keep it visible in the test output */
    return g_log;
}

#define ck_assert_log_has(needle)                                                                      \
    ck_assert_msg(strstr(g_log, (needle)) != NULL, "log does not mention \"%s\": %s", (needle), g_log)

static kvb_status parse_cfg(const char *text, kvb_model_config *c) {
    return kvb_model_config_parse(text, strlen(text), c);
}

/* ---------------------------------------------------------------------------------------- config */

KVB_TEST(config_llama_defaults) {
    const char *txt = "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, \"intermediate_size\": 128,"
                      " \"num_attention_heads\": 4, \"num_hidden_layers\": 2, \"vocab_size\": 256}";
    kvb_model_config c;
    ck_assert_int_eq(parse_cfg(txt, &c), KVB_OK);
    ck_assert_int_eq(c.arch, KVB_ARCH_LLAMA);
    ck_assert_int_eq(c.n_layers, 2);
    ck_assert_int_eq(c.hidden, 64);
    ck_assert_int_eq(c.n_heads, 4);
    ck_assert_int_eq(c.n_kv_heads, 4);
    ck_assert_int_eq(c.head_dim, 16);
    ck_assert_int_eq(c.intermediate, 128);
    ck_assert_int_eq(c.vocab, 256);
    ck_assert_int_eq(c.max_pos, 2048);
    ck_assert_float_eq(c.rms_eps, 1e-6f);
    ck_assert_double_eq(c.rope_theta, 10000.0);
    ck_assert_int_eq(c.tie_embeddings, 0);
    ck_assert_int_eq(c.rope_type, KVB_ROPE_DEFAULT);
    ck_assert_int_eq(c.bos_id, -1);
    ck_assert_int_eq(c.n_eos, 0);
    ck_assert_int_eq(c.torch_dtype, KVB_DTYPE_F32);
}
KVB_TEST_END

KVB_TEST(config_qwen3) {
    /* the fields of a real Qwen3 config.json (Qwen3-0.6B's shape: head_dim != hidden/heads) */
    const char *txt =
        "{\"architectures\": [\"Qwen3ForCausalLM\"], \"attention_bias\": false, \"attention_dropout\": 0.0,"
        " \"bos_token_id\": 151643, \"eos_token_id\": 151645, \"head_dim\": 128, \"hidden_act\": \"silu\","
        " \"hidden_size\": 1024, \"initializer_range\": 0.02, \"intermediate_size\": 3072,"
        " \"max_position_embeddings\": 40960, \"max_window_layers\": 28, \"model_type\": \"qwen3\","
        " \"num_attention_heads\": 16, \"num_hidden_layers\": 28, \"num_key_value_heads\": 8,"
        " \"rms_norm_eps\": 1e-06, \"rope_scaling\": null, \"rope_theta\": 1000000, \"sliding_window\": null,"
        " \"tie_word_embeddings\": true, \"torch_dtype\": \"bfloat16\", \"use_cache\": true,"
        " \"use_sliding_window\": false, \"vocab_size\": 151936}";
    kvb_model_config c;
    ck_assert_int_eq(parse_cfg(txt, &c), KVB_OK);
    ck_assert_int_eq(c.arch, KVB_ARCH_QWEN3);
    ck_assert_int_eq(c.head_dim, 128);
    ck_assert_int_eq(c.n_kv_heads, 8);
    ck_assert_int_eq(c.max_pos, 40960);
    ck_assert_double_eq(c.rope_theta, 1000000.0);
    ck_assert_int_eq(c.tie_embeddings, 1);
    ck_assert_int_eq(c.bos_id, 151643);
    ck_assert_int_eq(c.n_eos, 1);
    ck_assert_int_eq(c.eos_ids[0], 151645);
    ck_assert_int_eq(c.torch_dtype, KVB_DTYPE_BF16);

    /* no "architectures": model_type decides; Qwen3Config's own head_dim default is 128 */
    const char *mt = "{\"model_type\": \"qwen3\", \"hidden_size\": 64, \"intermediate_size\": 128,"
                     " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"num_hidden_layers\": 2,"
                     " \"vocab_size\": 256}";
    ck_assert_int_eq(parse_cfg(mt, &c), KVB_OK);
    ck_assert_int_eq(c.arch, KVB_ARCH_QWEN3);
    ck_assert_int_eq(c.head_dim, 128);
    ck_assert_int_eq(c.max_pos, 32768);
    const char *ml = "{\"model_type\": \"llama\", \"hidden_size\": 64, \"intermediate_size\": 128,"
                     " \"num_attention_heads\": 4, \"num_hidden_layers\": 2, \"vocab_size\": 256}";
    ck_assert_int_eq(parse_cfg(ml, &c), KVB_OK);
    ck_assert_int_eq(c.arch, KVB_ARCH_LLAMA);
}
KVB_TEST_END

KVB_TEST(config_llama3_rope_and_eos_list) {
    /* Llama 3.1 8B's config.json */
    const char *txt =
        "{\"architectures\": [\"LlamaForCausalLM\"], \"attention_bias\": false, \"bos_token_id\": 128000,"
        " \"eos_token_id\": [128001, 128008, 128009], \"head_dim\": 128, \"hidden_act\": \"silu\","
        " \"hidden_size\": 4096, \"intermediate_size\": 14336, \"max_position_embeddings\": 131072,"
        " \"mlp_bias\": false, \"model_type\": \"llama\", \"num_attention_heads\": 32,"
        " \"num_hidden_layers\": 32, \"num_key_value_heads\": 8, \"pretraining_tp\": 1,"
        " \"rms_norm_eps\": 1e-05, \"rope_scaling\": {\"factor\": 8.0, \"low_freq_factor\": 1.0,"
        " \"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 8192, \"rope_type\": \"llama3\"},"
        " \"rope_theta\": 500000.0, \"tie_word_embeddings\": false, \"torch_dtype\": \"bfloat16\","
        " \"vocab_size\": 128256}";
    kvb_model_config c;
    ck_assert_int_eq(parse_cfg(txt, &c), KVB_OK);
    ck_assert_int_eq(c.rope_type, KVB_ROPE_LLAMA3);
    ck_assert_double_eq(c.rope_factor, 8.0);
    ck_assert_double_eq(c.rope_low_freq_factor, 1.0);
    ck_assert_double_eq(c.rope_high_freq_factor, 4.0);
    ck_assert_int_eq(c.rope_orig_max_pos, 8192);
    ck_assert_double_eq(c.rope_theta, 500000.0);
    ck_assert_float_eq(c.rms_eps, 1e-5f);
    ck_assert_int_eq(c.n_eos, 3);
    ck_assert_int_eq(c.eos_ids[0], 128001);
    ck_assert_int_eq(c.eos_ids[2], 128009);
    ck_assert_int_eq(c.bos_id, 128000);
    ck_assert_int_eq(c.n_kv_heads, 8);

    /* the older "type" spelling, "default", and transformers 4.56+'s rope_parameters */
    const char *base = "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, \"intermediate_size\": 8,"
                       " \"num_attention_heads\": 4, \"num_hidden_layers\": 1, \"vocab_size\": 16, %s}";
    char buf[1024];
    snprintf(buf, sizeof buf, base,
             "\"rope_scaling\": {\"type\": \"llama3\", \"factor\": 2, \"low_freq_factor\": 1,"
             " \"high_freq_factor\": 2, \"original_max_position_embeddings\": 64}");
    ck_assert_int_eq(parse_cfg(buf, &c), KVB_OK);
    ck_assert_int_eq(c.rope_type, KVB_ROPE_LLAMA3);
    ck_assert_double_eq(c.rope_factor, 2.0);
    snprintf(buf, sizeof buf, base, "\"rope_scaling\": {\"rope_type\": \"default\"}");
    ck_assert_int_eq(parse_cfg(buf, &c), KVB_OK);
    ck_assert_int_eq(c.rope_type, KVB_ROPE_DEFAULT);
    snprintf(buf, sizeof buf, base, "\"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 123456.0}");
    ck_assert_int_eq(parse_cfg(buf, &c), KVB_OK);
    ck_assert_double_eq(c.rope_theta, 123456.0);
    ck_assert_int_eq(c.rope_type, KVB_ROPE_DEFAULT);
}
KVB_TEST_END

/* Mistral: a window on every layer (MistralConfig's default 4096 when absent, none when null). */
KVB_TEST(config_mistral_window) {
    /* Mistral-7B-v0.1's config.json */
    const char *txt =
        "{\"architectures\": [\"MistralForCausalLM\"], \"bos_token_id\": 1, \"eos_token_id\": 2,"
        " \"hidden_act\": \"silu\", \"hidden_size\": 4096, \"initializer_range\": 0.02,"
        " \"intermediate_size\": 14336, \"max_position_embeddings\": 32768, \"model_type\": \"mistral\","
        " \"num_attention_heads\": 32, \"num_hidden_layers\": 32, \"num_key_value_heads\": 8,"
        " \"rms_norm_eps\": 1e-05, \"rope_theta\": 10000.0, \"sliding_window\": 4096,"
        " \"tie_word_embeddings\": false, \"torch_dtype\": \"bfloat16\", \"use_cache\": true, \"vocab_size\": 32000}";
    kvb_model_config c;
    ck_assert_int_eq(parse_cfg(txt, &c), KVB_OK);
    ck_assert_int_eq(c.arch, KVB_ARCH_MISTRAL);
    ck_assert_str_eq(kvb_arch_name(c.arch), "Mistral");
    ck_assert_int_eq(c.head_dim, 128);
    ck_assert_int_eq(c.qkv_bias + c.o_bias + c.mlp_bias, 0);
    for (int l = 0; l < 32; l++) ck_assert_int_eq(kvb_model_config_window(&c, l), 4096);
    ck_assert_int_eq(kvb_model_config_window(&c, 32), 0);
    /* v0.2+: "sliding_window": null; absent: the class default 4096; Mistral ignores attention_bias */
    const char *base = "{\"model_type\": \"mistral\", \"hidden_size\": 64, \"intermediate_size\": 128,"
                       " \"num_attention_heads\": 4, \"num_hidden_layers\": 3, \"vocab_size\": 256%s}";
    char buf[1024];
    snprintf(buf, sizeof buf, base, ", \"sliding_window\": null, \"attention_bias\": true");
    ck_assert_int_eq(parse_cfg(buf, &c), KVB_OK);
    ck_assert_int_eq(c.sliding_window, 0);
    ck_assert_int_eq(kvb_model_config_window(&c, 0), 0);
    ck_assert_int_eq(c.qkv_bias + c.o_bias, 0);
    ck_assert_int_eq(c.max_pos, 131072);
    snprintf(buf, sizeof buf, base, "");
    ck_assert_int_eq(parse_cfg(buf, &c), KVB_OK);
    ck_assert_int_eq(kvb_model_config_window(&c, 2), 4096);
}
KVB_TEST_END

/* Qwen2 / Qwen2.5: q/k/v biases always, no o_proj bias; the window only with use_sliding_window, on the
 * layers from max_window_layers on, or as layer_types says. */
KVB_TEST(config_qwen2_bias_window) {
    /* Qwen2.5-7B-Instruct's config.json (with its YaRN block as the model card says to add it) */
    const char *txt =
        "{\"architectures\": [\"Qwen2ForCausalLM\"], \"attention_dropout\": 0.0, \"bos_token_id\": 151643,"
        " \"eos_token_id\": 151645, \"hidden_act\": \"silu\", \"hidden_size\": 3584, \"initializer_range\": 0.02,"
        " \"intermediate_size\": 18944, \"max_position_embeddings\": 32768, \"max_window_layers\": 28,"
        " \"model_type\": \"qwen2\", \"num_attention_heads\": 28, \"num_hidden_layers\": 28,"
        " \"num_key_value_heads\": 4, \"rms_norm_eps\": 1e-06, \"rope_theta\": 1000000.0,"
        " \"rope_scaling\": {\"factor\": 4.0, \"original_max_position_embeddings\": 32768, \"type\": \"yarn\"},"
        " \"sliding_window\": 131072, \"tie_word_embeddings\": false, \"torch_dtype\": \"bfloat16\","
        " \"use_cache\": true, \"use_sliding_window\": false, \"vocab_size\": 152064}";
    kvb_model_config c;
    ck_assert_int_eq(parse_cfg(txt, &c), KVB_OK);
    ck_assert_int_eq(c.arch, KVB_ARCH_QWEN2);
    ck_assert_int_eq(c.head_dim, 128);
    ck_assert_int_eq(c.qkv_bias, 1);
    ck_assert_int_eq(c.o_bias, 0);
    ck_assert_int_eq(c.mlp_bias, 0);
    ck_assert_int_eq(c.sliding_window, 0); /* use_sliding_window false */
    ck_assert_int_eq(c.rope_type, KVB_ROPE_YARN);
    ck_assert_int_eq(c.rope_orig_max_pos, 32768);
    ck_assert_double_eq_tol(c.rope_attn_factor, 0.1 * log(4.0) + 1.0, 1e-12);

    const char *base = "{\"model_type\": \"qwen2\", \"hidden_size\": 64, \"intermediate_size\": 128,"
                       " \"num_attention_heads\": 4, \"num_hidden_layers\": 4, \"vocab_size\": 256%s}";
    char buf[1024];
    snprintf(buf, sizeof buf, base, ", \"use_sliding_window\": true, \"sliding_window\": 24, \"max_window_layers\": 2");
    ck_assert_int_eq(parse_cfg(buf, &c), KVB_OK);
    int want[4] = {0, 0, 24, 24};
    for (int l = 0; l < 4; l++) ck_assert_int_eq(kvb_model_config_window(&c, l), want[l]);
    /* defaults: sliding_window 4096, max_window_layers 28 (so no layer of 4 slides) */
    snprintf(buf, sizeof buf, base, ", \"use_sliding_window\": true");
    ck_assert_int_eq(parse_cfg(buf, &c), KVB_OK);
    for (int l = 0; l < 4; l++) ck_assert_int_eq(kvb_model_config_window(&c, l), 0);
    /* layer_types decides which layers slide */
    snprintf(buf, sizeof buf, base,
             ", \"use_sliding_window\": true, \"sliding_window\": 8, \"max_window_layers\": 0, \"layer_types\":"
             " [\"sliding_attention\", \"full_attention\", \"sliding_attention\", \"full_attention\"]");
    ck_assert_int_eq(parse_cfg(buf, &c), KVB_OK);
    int want2[4] = {8, 0, 8, 0};
    for (int l = 0; l < 4; l++) ck_assert_int_eq(kvb_model_config_window(&c, l), want2[l]);
    /* sliding layers without use_sliding_window: transformers sets sliding_window to None: full attention */
    snprintf(buf, sizeof buf, base,
             ", \"sliding_window\": 8, \"layer_types\": [\"sliding_attention\", \"sliding_attention\","
             " \"sliding_attention\", \"sliding_attention\"]");
    ck_assert_int_eq(parse_cfg(buf, &c), KVB_OK);
    for (int l = 0; l < 4; l++) ck_assert_int_eq(kvb_model_config_window(&c, l), 0);
}
KVB_TEST_END

/* attention_bias on Llama and Qwen3 (q/k/v/o), mlp_bias on Llama only. */
KVB_TEST(config_biases) {
    const char *base = "{\"model_type\": \"%s\", \"hidden_size\": 64, \"intermediate_size\": 128,"
                       " \"num_attention_heads\": 4, \"num_hidden_layers\": 2, \"vocab_size\": 256%s}";
    char buf[1024];
    kvb_model_config c;
    snprintf(buf, sizeof buf, base, "llama", ", \"attention_bias\": true, \"mlp_bias\": true");
    ck_assert_int_eq(parse_cfg(buf, &c), KVB_OK);
    ck_assert_int_eq(c.qkv_bias + c.o_bias + c.mlp_bias, 3);
    snprintf(buf, sizeof buf, base, "qwen3", ", \"attention_bias\": true, \"mlp_bias\": true");
    ck_assert_int_eq(parse_cfg(buf, &c), KVB_OK);
    ck_assert_int_eq(c.qkv_bias + c.o_bias, 2);
    ck_assert_int_eq(c.mlp_bias, 0); /* Qwen3MLP has no bias */
    snprintf(buf, sizeof buf, base, "qwen2", ", \"attention_bias\": false");
    ck_assert_int_eq(parse_cfg(buf, &c), KVB_OK);
    ck_assert_int_eq(c.qkv_bias, 1); /* Qwen2Attention: q/k/v bias=True whatever the config says */
    ck_assert_int_eq(c.o_bias, 0);
}
KVB_TEST_END

KVB_TEST(config_errors) {
    const char *base = "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, \"intermediate_size\": 128,"
                       " \"num_attention_heads\": 4, \"num_hidden_layers\": 2, \"vocab_size\": 256%s}";
    static const struct {
        const char *text; /* full text, or NULL to use `extra` spliced into `base` */
        const char *extra;
        kvb_status want;
        const char *logged; /* must appear in the error log */
    } cases[] = {
        {"{\"hidden_size\": 64,", NULL, KVB_ERR_FORMAT, "invalid JSON"},
        {"[1, 2]", NULL, KVB_ERR_FORMAT, "JSON object"},
        {"{\"architectures\": [\"GPT2LMHeadModel\"], \"hidden_size\": 64}", NULL, KVB_ERR_UNSUPPORTED,
         "GPT2LMHeadModel"},
        {"{\"model_type\": \"gpt2\", \"hidden_size\": 64}", NULL, KVB_ERR_UNSUPPORTED, "gpt2"},
        {"{\"hidden_size\": 64}", NULL, KVB_ERR_INVALID, "model_type"},
        {"{\"architectures\": [\"LlamaForCausalLM\"], \"intermediate_size\": 128, \"num_attention_heads\": 4,"
         " \"num_hidden_layers\": 2, \"vocab_size\": 256}",
         NULL, KVB_ERR_INVALID, "hidden_size"},
        {NULL, ", \"num_key_value_heads\": 3", KVB_ERR_INVALID, "num_key_value_heads"},
        {NULL, ", \"head_dim\": 7", KVB_ERR_INVALID, "head_dim"},
        {"{\"model_type\": \"llama\", \"hidden_size\": 64, \"intermediate_size\": 128, \"num_attention_heads\": 4,"
         " \"num_hidden_layers\": 2, \"vocab_size\": -1}",
         NULL, KVB_ERR_INVALID, "vocab_size"},
        {"{\"model_type\": \"llama\", \"hidden_size\": 64, \"intermediate_size\": 128, \"num_attention_heads\": 4,"
         " \"num_hidden_layers\": 0, \"vocab_size\": 256}",
         NULL, KVB_ERR_INVALID, "num_hidden_layers"},
        {"{\"model_type\": \"llama\", \"hidden_size\": 64, \"intermediate_size\": 128, \"num_attention_heads\": \"4\","
         " \"num_hidden_layers\": 2, \"vocab_size\": 256}",
         NULL, KVB_ERR_INVALID, "num_attention_heads"},
        {"{\"model_type\": \"llama\", \"hidden_size\": 64, \"intermediate_size\": 128, \"num_attention_heads\": 64,"
         " \"num_hidden_layers\": 2, \"vocab_size\": 256}",
         NULL, KVB_ERR_INVALID, "head_dim"},
        {NULL, ", \"rms_norm_eps\": 0", KVB_ERR_INVALID, "rms_norm_eps"},
        {NULL, ", \"rope_theta\": -5", KVB_ERR_INVALID, "rope_theta"},
        {NULL, ", \"rope_scaling\": {\"rope_type\": \"dynamic\", \"factor\": 4.0}", KVB_ERR_UNSUPPORTED, "dynamic"},
        {NULL, ", \"rope_scaling\": {\"type\": \"longrope\", \"factor\": 4.0}", KVB_ERR_UNSUPPORTED, "longrope"},
        {NULL, ", \"rope_scaling\": {\"rope_type\": \"yarn\"}", KVB_ERR_INVALID, "factor"},
        {NULL, ", \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4, \"beta_fast\": \"x\"}", KVB_ERR_INVALID,
         "beta_fast"},
        {NULL, ", \"rope_scaling\": {\"rope_type\": \"linear\"}", KVB_ERR_INVALID, "factor"},
        {NULL, ", \"partial_rotary_factor\": 0.5", KVB_ERR_UNSUPPORTED, "partial_rotary_factor"},
        {NULL, ", \"quantization_config\": {\"quant_method\": \"awq\", \"bits\": 4}", KVB_ERR_UNSUPPORTED,
         "quant_method \"awq\" is not supported"},
        {NULL, ", \"attention_bias\": \"yes\"", KVB_ERR_INVALID, "attention_bias"},
        {"{\"model_type\": \"qwen2\", \"hidden_size\": 64, \"intermediate_size\": 128, \"num_attention_heads\": 4,"
         " \"num_hidden_layers\": 2, \"vocab_size\": 256, \"layer_types\": [\"full_attention\", \"chunked_attention\"]}",
         NULL, KVB_ERR_UNSUPPORTED, "\"layer_types\"[1] = \"chunked_attention\""},
        {"{\"model_type\": \"qwen2\", \"hidden_size\": 64, \"intermediate_size\": 128, \"num_attention_heads\": 4,"
         " \"num_hidden_layers\": 2, \"vocab_size\": 256, \"layer_types\": [\"full_attention\"]}",
         NULL, KVB_ERR_INVALID, "layer_types"},
        {"{\"model_type\": \"mistral\", \"hidden_size\": 64, \"intermediate_size\": 128, \"num_attention_heads\": 4,"
         " \"num_hidden_layers\": 2, \"vocab_size\": 256, \"layer_types\": [\"full_attention\", \"full_attention\"]}",
         NULL, KVB_ERR_UNSUPPORTED, "layer_types"},
        {"{\"model_type\": \"mistral\", \"hidden_size\": 64, \"intermediate_size\": 128, \"num_attention_heads\": 4,"
         " \"num_hidden_layers\": 2, \"vocab_size\": 256, \"sliding_window\": 0}",
         NULL, KVB_ERR_INVALID, "sliding_window"},
        {NULL, ", \"rope_scaling\": {\"factor\": 4.0}", KVB_ERR_INVALID, "rope_type"},
        {NULL, ", \"rope_scaling\": {\"rope_type\": \"llama3\", \"low_freq_factor\": 1, \"high_freq_factor\": 4,"
               " \"original_max_position_embeddings\": 8192}",
         KVB_ERR_INVALID, "factor"},
        {NULL, ", \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8, \"low_freq_factor\": 4,"
               " \"high_freq_factor\": 4, \"original_max_position_embeddings\": 8192}",
         KVB_ERR_INVALID, "high_freq_factor"},
        {NULL, ", \"rope_scaling\": 3", KVB_ERR_INVALID, "rope_scaling"},
        {NULL, ", \"eos_token_id\": [1, 2, 3, 4, 5, 6, 7, 8, 9]", KVB_ERR_INVALID, "eos_token_id"},
        {NULL, ", \"eos_token_id\": [1, \"x\"]", KVB_ERR_INVALID, "eos_token_id"},
        {NULL, ", \"eos_token_id\": 256", KVB_ERR_INVALID, "eos_token_id"},
        {NULL, ", \"bos_token_id\": -1", KVB_ERR_INVALID, "bos_token_id"},
        {NULL, ", \"hidden_act\": \"gelu\"", KVB_ERR_UNSUPPORTED, "gelu"},
        {NULL, ", \"tie_word_embeddings\": 1", KVB_ERR_INVALID, "tie_word_embeddings"},
        {NULL, ", \"architectures\": \"LlamaForCausalLM\"", KVB_ERR_FORMAT, "duplicate"},
    };
    for (size_t i = 0; i < KVB_ARRAY_LEN(cases); i++) {
        char buf[2048];
        if (cases[i].text) snprintf(buf, sizeof buf, "%s", cases[i].text);
        else snprintf(buf, sizeof buf, base, cases[i].extra);
        kvb_model_config c;
        capture_begin();
        kvb_status st = parse_cfg(buf, &c);
        capture_end();
        ck_assert_msg(st == cases[i].want, "case %zu (%s): status %d (%s), want %d", i, buf, st, kvb_status_str(st),
                      cases[i].want);
        ck_assert_log_has(cases[i].logged);
    }
    /* a missing config.json is a NOT_FOUND naming the file */
    mkdir_tmp("empty");
    kvb_model_config c;
    capture_begin();
    kvb_status st = kvb_model_config_load(tmp_path("empty"), &c);
    capture_end();
    ck_assert_int_eq(st, KVB_ERR_NOT_FOUND);
    ck_assert_log_has("config.json");
}
KVB_TEST_END

/* compressed-tensors FP8 configs as llm-compressor writes them: one group targeting Linear, lm_head
 * ignored (quant.h). */
#define CT_WEIGHTS(strategy) \
    "\"weights\": {\"actorder\": null, \"block_structure\": null, \"dynamic\": false, \"group_size\": null, " \
    "\"num_bits\": 8, \"observer\": \"minmax\", \"observer_kwargs\": {}, \"strategy\": \"" strategy "\", " \
    "\"symmetric\": true, \"type\": \"float\"}"
#define CT_ACT_TOKEN \
    "{\"actorder\": null, \"block_structure\": null, \"dynamic\": true, \"group_size\": null, \"num_bits\": 8, " \
    "\"observer\": null, \"observer_kwargs\": {}, \"strategy\": \"token\", \"symmetric\": true, \"type\": \"float\"}"
#define CT_CONFIG(act, weights, ignore, targets, extra) \
    ", \"quantization_config\": {\"config_groups\": {\"group_0\": {\"format\": \"float-quantized\", " \
    "\"input_activations\": " act ", \"output_activations\": null, \"targets\": " targets ", " weights "}}, " \
    "\"format\": \"float-quantized\", \"global_compression_ratio\": null, \"ignore\": " ignore ", " \
    "\"kv_cache_scheme\": null, \"quant_method\": \"compressed-tensors\", \"quantization_status\": \"compressed\"" extra "}"
#define CT_DYNAMIC CT_CONFIG(CT_ACT_TOKEN, CT_WEIGHTS("channel"), "[\"lm_head\"]", "[\"Linear\"]", "")
#define CT_W8A16 CT_CONFIG("null", CT_WEIGHTS("channel"), "[\"lm_head\"]", "[\"Linear\"]", "")

KVB_TEST(config_fp8) {
    const char *base = "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, \"intermediate_size\": 128,"
                       " \"num_attention_heads\": 4, \"num_hidden_layers\": 2, \"vocab_size\": 256%s}";
    char buf[4096];
    kvb_model_config c;
    snprintf(buf, sizeof buf, base, CT_DYNAMIC);
    ck_assert_int_eq(parse_cfg(buf, &c), KVB_OK);
    ck_assert_int_eq(c.quant.fp8, 1);
    ck_assert_int_eq(c.quant.per_channel, 1);
    ck_assert_int_eq(c.quant.act_token, 1);
    ck_assert_int_eq(c.quant.lm_head, 0);
    ck_assert_int_eq(c.quant.layers[0], 0x7f);
    ck_assert_int_eq(c.quant.layers[1], 0x7f);
    snprintf(buf, sizeof buf, base, CT_CONFIG("null", CT_WEIGHTS("tensor"), "[]", "[\"Linear\"]", ""));
    ck_assert_int_eq(parse_cfg(buf, &c), KVB_OK);
    ck_assert_int_eq(c.quant.per_channel, 0);
    ck_assert_int_eq(c.quant.act_token, 0);
    ck_assert_int_eq(c.quant.lm_head, 1); /* not ignored */
    /* ignore: a regex matched from the start of the name, an exact module name */
    snprintf(buf, sizeof buf, base,
             CT_CONFIG("null", CT_WEIGHTS("channel"),
                       "[\"lm_head\", \"re:.*mlp\\\\.down_proj$\", \"model.layers.1.self_attn.o_proj\", \"re:proj\"]",
                       "[\"Linear\"]", ""));
    ck_assert_int_eq(parse_cfg(buf, &c), KVB_OK);
    ck_assert_int_eq(c.quant.layers[0], 0x7f & ~(1 << KVB_PROJ_DOWN));
    ck_assert_int_eq(c.quant.layers[1], 0x7f & ~(1 << KVB_PROJ_DOWN) & ~(1 << KVB_PROJ_O));
    /* targets by regex: the attention projections only */
    snprintf(buf, sizeof buf, base, CT_CONFIG("null", CT_WEIGHTS("channel"), "[\"lm_head\"]", "[\"re:.*self_attn\"]", ""));
    ck_assert_int_eq(parse_cfg(buf, &c), KVB_OK);
    ck_assert_int_eq(c.quant.layers[0], 0x0f);
    /* none: no quantization */
    snprintf(buf, sizeof buf, base, ", \"quantization_config\": null");
    ck_assert_int_eq(parse_cfg(buf, &c), KVB_OK);
    ck_assert_int_eq(c.quant.fp8, 0);

    /* everything else is refused, naming what */
    static const struct {
        const char *extra;
        kvb_status want;
        const char *logged;
    } cases[] = {
        {", \"quantization_config\": {\"quant_method\": \"fp8\", \"activation_scheme\": \"dynamic\"}", KVB_ERR_UNSUPPORTED,
         "quant_method \"fp8\""},
        {", \"quantization_config\": {\"quant_method\": \"gptq\", \"bits\": 4}", KVB_ERR_UNSUPPORTED, "\"gptq\""},
        {CT_CONFIG("null", CT_WEIGHTS("channel"), "[]", "[\"Linear\"]", ", \"format\": \"pack-quantized\""),
         KVB_ERR_FORMAT, "duplicate"},
        {", \"quantization_config\": {\"quant_method\": \"compressed-tensors\", \"format\": \"int-quantized\", "
         "\"config_groups\": {\"g\": {\"targets\": [\"Linear\"], " CT_WEIGHTS("channel") "}}}",
         KVB_ERR_UNSUPPORTED, "\"format\": \"int-quantized\""},
        {CT_CONFIG("{\"dynamic\": false, \"num_bits\": 8, \"strategy\": \"tensor\", \"type\": \"float\"}",
                   CT_WEIGHTS("channel"), "[]", "[\"Linear\"]", ""),
         KVB_ERR_UNSUPPORTED, "only dynamic per-token activation quantization"},
        {CT_CONFIG("{\"dynamic\": true, \"num_bits\": 8, \"strategy\": \"tensor\", \"type\": \"float\"}",
                   CT_WEIGHTS("channel"), "[]", "[\"Linear\"]", ""),
         KVB_ERR_UNSUPPORTED, "\"strategy\": \"tensor\""},
        {CT_CONFIG("null", CT_WEIGHTS("group"), "[]", "[\"Linear\"]", ""), KVB_ERR_UNSUPPORTED, "\"strategy\": \"group\""},
        {CT_CONFIG("null", CT_WEIGHTS("block"), "[]", "[\"Linear\"]", ""), KVB_ERR_UNSUPPORTED, "\"strategy\": \"block\""},
        {CT_CONFIG("null", "\"weights\": {\"num_bits\": 4, \"type\": \"float\", \"strategy\": \"channel\"}", "[]",
                   "[\"Linear\"]", ""),
         KVB_ERR_UNSUPPORTED, "\"num_bits\": 4"},
        {CT_CONFIG("null", "\"weights\": {\"num_bits\": 8, \"type\": \"int\", \"strategy\": \"channel\"}", "[]",
                   "[\"Linear\"]", ""),
         KVB_ERR_UNSUPPORTED, "\"type\": \"int\""},
        {CT_CONFIG("null", "\"weights\": {\"num_bits\": 8, \"type\": \"float\", \"strategy\": \"channel\", "
                           "\"block_structure\": [128, 128]}",
                   "[]", "[\"Linear\"]", ""),
         KVB_ERR_UNSUPPORTED, "block quantization"},
        {", \"quantization_config\": {\"config_groups\": {\"group_0\": {\"targets\": [\"Linear\"], " CT_WEIGHTS("channel")
         "}}, \"kv_cache_scheme\": {\"num_bits\": 8, \"type\": \"float\"}, \"quant_method\": \"compressed-tensors\"}",
         KVB_ERR_UNSUPPORTED, "FP8 KV cache"},
        {", \"quantization_config\": {\"config_groups\": {\"group_0\": {\"targets\": [\"Linear\"], " CT_WEIGHTS("channel")
         ", \"output_activations\": {\"num_bits\": 8}}}, \"quant_method\": \"compressed-tensors\"}",
         KVB_ERR_UNSUPPORTED, "output activation"},
        {", \"quantization_config\": {\"config_groups\": {\"group_0\": {\"targets\": [\"Linear\"], " CT_WEIGHTS("channel")
         "}, \"group_1\": {\"targets\": [\"re:.*mlp.*\"], \"input_activations\": " CT_ACT_TOKEN ", " CT_WEIGHTS("channel")
         "}}, \"quant_method\": \"compressed-tensors\"}",
         KVB_ERR_UNSUPPORTED, "one scheme per model"},
        {", \"quantization_config\": {\"config_groups\": {\"group_0\": {\"targets\": [\"Linear\"], " CT_WEIGHTS("channel")
         "}}, \"ignore\": [\"re:(unclosed\"], \"quant_method\": \"compressed-tensors\"}",
         KVB_ERR_INVALID, "re:(unclosed"},
        {", \"quantization_config\": {\"config_groups\": {}, \"quant_method\": \"compressed-tensors\"}", KVB_ERR_INVALID,
         "config_groups"},
        {", \"tie_word_embeddings\": true" CT_CONFIG("null", CT_WEIGHTS("channel"), "[]", "[\"Linear\"]", ""),
         KVB_ERR_UNSUPPORTED, "tied"},
    };
    for (size_t i = 0; i < KVB_ARRAY_LEN(cases); i++) {
        snprintf(buf, sizeof buf, base, cases[i].extra);
        capture_begin();
        kvb_status st = parse_cfg(buf, &c);
        capture_end();
        ck_assert_msg(st == cases[i].want, "case %zu (%s): status %d (%s), want %d", i, cases[i].extra, st,
                      kvb_status_str(st), cases[i].want);
        ck_assert_log_has(cases[i].logged);
    }
}
KVB_TEST_END

/* ---------------------------------------------------------------------------------------- RoPE */

KVB_TEST(rope_inv_freq_default) {
    kvb_model_config c = {.head_dim = 8, .rope_theta = 10000.0};
    float f[4];
    kvb_model_config_rope_inv_freq(&c, f);
    /* theta^(-2i/d): 1, 10000^-1/4, 10000^-1/2, 10000^-3/4 */
    ck_assert_float_eq(f[0], 1.0f);
    ck_assert_float_eq(f[1], 0.1f);
    ck_assert_float_eq(f[2], 0.01f);
    ck_assert_float_eq(f[3], 0.001f);
    kvb_model_config q = {.head_dim = 128, .rope_theta = 1000000.0};
    float g[64];
    kvb_model_config_rope_inv_freq(&q, g);
    ck_assert_float_eq(g[32], 0.001f); /* 1e6^(-64/128) */
    ck_assert_float_eq_tol(g[63], (float)pow(1e6, -126.0 / 128.0), 1e-12f);
}
KVB_TEST_END

KVB_TEST(rope_inv_freq_llama3) {
    /* head_dim 8, theta 1e4: base frequencies 1, 0.1, 0.01, 0.001, wavelengths 2*pi/f = 6.28, 62.8, 628.3,
     * 6283.2. With original_max_position_embeddings 1024, low_freq_factor 1, high_freq_factor 4:
     * low_freq_wavelen = 1024, high_freq_wavelen = 256. So
     *   f0, f1: wavelen < 256            -> unchanged
     *   f2:     256 <= 628.3 <= 1024     -> smooth = (1024/628.3185307179587 - 1) / (4 - 1) = 0.20991553908700275
     *                                       (1 - smooth) * 0.01 / 8 + smooth * 0.01 = 0.003086760967011274
     *   f3:     6283.2 > 1024            -> 0.001 / 8 = 0.000125 */
    kvb_model_config c = {.head_dim = 8, .rope_theta = 10000.0, .rope_type = KVB_ROPE_LLAMA3, .rope_factor = 8.0,
                          .rope_low_freq_factor = 1.0, .rope_high_freq_factor = 4.0, .rope_orig_max_pos = 1024};
    float f[4];
    kvb_model_config_rope_inv_freq(&c, f);
    ck_assert_float_eq(f[0], 1.0f);
    ck_assert_float_eq(f[1], 0.1f);
    ck_assert_float_eq(f[2], (float)0.003086760967011274);
    ck_assert_float_eq(f[3], (float)0.000125);
    /* a wavelength exactly at high_freq_wavelen is "medium" (smooth = 1: unchanged); exactly at
     * low_freq_wavelen too (smooth = 0: divided by factor) */
    kvb_model_config e = c;
    e.rope_orig_max_pos = 1024;
    e.rope_low_freq_factor = 1024.0 / (2.0 * M_PI / 0.1); /* low wavelen == 62.83 == f1's */
    e.rope_high_freq_factor = 100.0;
    kvb_model_config_rope_inv_freq(&e, f);
    ck_assert_float_eq_tol(f[1], 0.1f / 8.0f, 1e-8f);
}
KVB_TEST_END

KVB_TEST(rope_inv_freq_linear_yarn) {
    kvb_model_config c = {.head_dim = 8, .rope_theta = 10000.0, .rope_type = KVB_ROPE_LINEAR, .rope_factor = 4.0};
    float f[4];
    kvb_model_config_rope_inv_freq(&c, f);
    ck_assert_float_eq(f[0], 0.25f);
    ck_assert_float_eq(f[3], 0.00025f);
    /* YaRN, head_dim 16, theta 1e4, factor 4, original context 1024, beta 32 / 1:
     *   correction dim(r) = 16 ln(1024 / (2 pi r)) / (2 ln 1e4): r = 32 -> 1.41..., floor 1;
     *   r = 1 -> 4.42..., ceil 5; ramp(i) = clamp((i - 1) / 4, 0, 1); extrapolation weight 1 - ramp(i):
     *   i = 0, 1: f (extrapolated), i = 3: half f / 4 + half f, i >= 5: f / 4 (interpolated) */
    kvb_model_config y = {.head_dim = 16, .rope_theta = 10000.0, .rope_type = KVB_ROPE_YARN, .rope_factor = 4.0,
                          .rope_orig_max_pos = 1024, .rope_beta_fast = 32, .rope_beta_slow = 1, .rope_truncate = 1};
    float g[8];
    kvb_model_config_rope_inv_freq(&y, g);
    for (int i = 0; i < 8; i++) {
        double base = pow(10000.0, -2.0 * i / 16.0), ramp = fmin(fmax((i - 1) / 4.0, 0.0), 1.0);
        double want = base / 4.0 * ramp + base * (1.0 - ramp);
        ck_assert_msg(fabs(g[i] - want) <= 1e-7 * want, "yarn inv_freq[%d] = %.9g, want %.9g", i, g[i], want);
    }
    /* without truncation the ramp runs from 1.41.. to 4.42.. */
    y.rope_truncate = 0;
    kvb_model_config_rope_inv_freq(&y, g);
    double lo = 16 * log(1024 / (2 * M_PI * 32)) / (2 * log(1e4)), hi = 16 * log(1024 / (2 * M_PI)) / (2 * log(1e4));
    double base3 = pow(10000.0, -6.0 / 16.0), r3 = (3 - lo) / (hi - lo);
    ck_assert_double_le(fabs(g[3] - (base3 / 4 * r3 + base3 * (1 - r3))), 1e-7 * base3);
    /* the attention factor: default 0.1 ln(factor) + 1, from mscale / mscale_all_dim, or given */
    const char *base = "{\"model_type\": \"qwen3\", \"hidden_size\": 64, \"intermediate_size\": 128,"
                       " \"num_attention_heads\": 4, \"num_hidden_layers\": 2, \"vocab_size\": 256,"
                       " \"max_position_embeddings\": 4096, \"rope_scaling\": %s}";
    char buf[1024];
    kvb_model_config c2;
    snprintf(buf, sizeof buf, base, "{\"rope_type\": \"yarn\", \"factor\": 8}");
    ck_assert_int_eq(parse_cfg(buf, &c2), KVB_OK);
    ck_assert_int_eq(c2.rope_orig_max_pos, 4096); /* defaults to max_position_embeddings */
    ck_assert_double_eq_tol(c2.rope_attn_factor, 0.1 * log(8.0) + 1.0, 1e-12);
    ck_assert_double_eq(c2.rope_beta_fast, 32.0);
    ck_assert_double_eq(c2.rope_beta_slow, 1.0);
    snprintf(buf, sizeof buf, base, "{\"rope_type\": \"yarn\", \"factor\": 8, \"mscale\": 2, \"mscale_all_dim\": 1}");
    ck_assert_int_eq(parse_cfg(buf, &c2), KVB_OK);
    ck_assert_double_eq_tol(c2.rope_attn_factor, (0.2 * log(8.0) + 1.0) / (0.1 * log(8.0) + 1.0), 1e-12);
    snprintf(buf, sizeof buf, base, "{\"rope_type\": \"yarn\", \"factor\": 8, \"attention_factor\": 0.5,"
                                    " \"beta_fast\": 16, \"beta_slow\": 2, \"truncate\": false}");
    ck_assert_int_eq(parse_cfg(buf, &c2), KVB_OK);
    ck_assert_double_eq(c2.rope_attn_factor, 0.5);
    ck_assert_double_eq(c2.rope_beta_fast, 16.0);
    ck_assert_int_eq(c2.rope_truncate, 0);
}
KVB_TEST_END

/* ---------------------------------------------------------------------------------- safetensors */

/* Writes a raw safetensors file: u64 header length, `header` padded with spaces to `hlen` (0: its own
 * length), then `data_len` bytes of pattern. */
static void write_raw(const char *path, uint64_t hlen_field, const char *header, size_t data_len) {
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    uint64_t hl = hlen_field ? hlen_field : strlen(header);
    unsigned char le[8];
    for (int i = 0; i < 8; i++) le[i] = (unsigned char)(hl >> (8 * i));
    ck_assert_uint_eq(fwrite(le, 1, 8, f), 8);
    ck_assert_uint_eq(fwrite(header, 1, strlen(header), f), strlen(header));
    for (size_t i = 0; i < data_len; i++) fputc((int)(i & 0xff), f);
    ck_assert_int_eq(fclose(f), 0);
}

static kvb_status open_file_logged(const char *path) {
    kvb_st_set *s = NULL;
    capture_begin();
    kvb_status st = kvb_st_open_file(path, &s);
    capture_end();
    if (st == KVB_OK) kvb_st_close(s);
    else ck_assert_ptr_null(s);
    return st;
}

KVB_TEST(st_roundtrip) {
    float a[6] = {1, -2, 3.5f, 4, 5, 6};
    uint16_t b[4] = {0x3f80, 0xc000, 0x0000, 0x7f80};
    uint16_t h[8] = {0x3c00, 1, 2, 3, 4, 5, 6, 0xfbff};
    float s = 42.0f;
    kvb_st_write_tensor w[] = {
        {.name = "z.last", .dtype = KVB_DTYPE_F32, .n_dims = 2, .shape = {2, 3}, .data = a},
        {.name = "a.bf16", .dtype = KVB_DTYPE_BF16, .n_dims = 1, .shape = {4}, .data = b},
        {.name = "m.f16", .dtype = KVB_DTYPE_F16, .n_dims = 3, .shape = {2, 2, 2}, .data = h},
        {.name = "scalar", .dtype = KVB_DTYPE_F32, .n_dims = 0, .data = &s},
        {.name = "empty", .dtype = KVB_DTYPE_F32, .n_dims = 2, .shape = {0, 5}, .data = NULL},
    };
    const char *p = tmp_path("rt.safetensors");
    ck_assert_int_eq(kvb_st_write(p, w, 5, "{\"format\": \"pt\"}"), KVB_OK);

    /* the header: padded to a multiple of 8, keys sorted, offsets in key order */
    FILE *f = fopen(p, "rb");
    unsigned char le[8];
    ck_assert_uint_eq(fread(le, 1, 8, f), 8);
    uint64_t hl = 0;
    for (int i = 0; i < 8; i++) hl |= (uint64_t)le[i] << (8 * i);
    ck_assert_uint_eq(hl % 8, 0);
    char hdr[1024] = {0};
    ck_assert_uint_lt(hl, sizeof hdr);
    ck_assert_uint_eq(fread(hdr, 1, hl, f), hl);
    fclose(f);
    const char *order[] = {"__metadata__", "a.bf16", "empty", "m.f16", "scalar", "z.last"};
    for (int i = 1; i < 6; i++) {
        char *x = strstr(hdr, order[i - 1]), *y = strstr(hdr, order[i]);
        ck_assert_ptr_nonnull(x);
        ck_assert_ptr_nonnull(y);
        ck_assert_msg(x < y, "%s should precede %s in %s", order[i - 1], order[i], hdr);
    }
    ck_assert_ptr_nonnull(strstr(hdr, "\"a.bf16\":{\"data_offsets\":[0,8],\"dtype\":\"BF16\",\"shape\":[4]}"));
    ck_assert_ptr_nonnull(strstr(hdr, "\"scalar\":{\"data_offsets\":[24,28],\"dtype\":\"F32\",\"shape\":[]}"));

    kvb_st_set *set = NULL;
    ck_assert_int_eq(kvb_st_open_file(p, &set), KVB_OK);
    ck_assert_int_eq(kvb_st_count(set), 5);
    ck_assert_str_eq(kvb_st_at(set, 0)->name, "a.bf16");
    ck_assert_str_eq(kvb_st_at(set, 4)->name, "z.last");
    ck_assert_ptr_null(kvb_st_at(set, 5));
    ck_assert_ptr_null(kvb_st_find(set, "__metadata__"));
    ck_assert_ptr_null(kvb_st_find(set, "nope"));
    for (size_t i = 0; i < KVB_ARRAY_LEN(w); i++) {
        const kvb_st_tensor *t = kvb_st_find(set, w[i].name);
        ck_assert_ptr_nonnull(t);
        ck_assert_int_eq(t->dtype, w[i].dtype);
        ck_assert_int_eq(t->n_dims, w[i].n_dims);
        size_t n = kvb_dtype_size(t->dtype);
        for (int d = 0; d < t->n_dims; d++) {
            ck_assert_int_eq(t->shape[d], w[i].shape[d]);
            n *= (size_t)w[i].shape[d];
        }
        ck_assert_uint_eq(t->nbytes, n);
        if (n) ck_assert_int_eq(memcmp(t->data, w[i].data, n), 0);
    }
    /* data starts 8-aligned in the file; the F32 tensor is readable in place */
    const kvb_st_tensor *zl = kvb_st_find(set, "z.last");
    float back[6];
    memcpy(back, zl->data, sizeof back);
    ck_assert_float_eq(back[2], 3.5f);
    kvb_st_close(set);
    kvb_st_close(NULL);

    /* the writer refuses what it could not write faithfully */
    kvb_st_write_tensor dup[] = {w[0], w[0]};
    capture_begin();
    ck_assert_int_eq(kvb_st_write(tmp_path("dup.safetensors"), dup, 2, NULL), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_st_write(tmp_path("meta.safetensors"), w, 1, "{\"format\": 1}"), KVB_ERR_INVALID);
    capture_end();
}
KVB_TEST_END

KVB_TEST(st_malformed) {
    static const char *const ok_entry = "\"t\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]}";
    char hdr[512];
    struct {
        const char *name;
        uint64_t hlen;        /* 0: the header's own length */
        const char *header;   /* printf format with one %s for ok_entry, or literal */
        size_t data;
        kvb_status want;
        const char *logged;
    } cases[] = {
        {"bad_json", 0, "{\"t\":{\"dtype\":\"F32\",", 24, KVB_ERR_FORMAT, "invalid JSON"},
        {"empty_header", 0, "{}", 0, KVB_OK, NULL},
        {"array", 0, "[1,2]   ", 0, KVB_ERR_FORMAT, "'{'"},
        {"hdr_too_long", 4096, "{%s}", 24, KVB_ERR_FORMAT, "header length 4096"},
        {"hdr_insane", 1ull << 62, "{%s}", 24, KVB_ERR_FORMAT, "not sane"},
        {"truncated_data", 0, "{%s}", 20, KVB_ERR_FORMAT, "truncated"},
        {"unknown_dtype", 0, "{\"t\":{\"dtype\":\"I64\",\"shape\":[3],\"data_offsets\":[0,24]}}", 24,
         KVB_ERR_UNSUPPORTED, "\"I64\""},
        {"garbage_dtype", 0, "{\"t\":{\"dtype\":\"Q4_K\",\"shape\":[3],\"data_offsets\":[0,24]}}", 24,
         KVB_ERR_UNSUPPORTED, "Q4_K"},
        {"shape_mismatch", 0, "{\"t\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,24]}}", 24,
         KVB_ERR_FORMAT, "expected 16 bytes"},
        {"offsets_past_end", 0, "{\"t\":{\"dtype\":\"F32\",\"shape\":[6],\"data_offsets\":[8,32]}}", 24,
         KVB_ERR_FORMAT, "past the end"},
        {"offsets_reversed", 0, "{\"t\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,0]}}", 24,
         KVB_ERR_FORMAT, "not an interval"},
        {"offsets_negative", 0, "{\"t\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[-8,0]}}", 24,
         KVB_ERR_FORMAT, "not an interval"},
        {"offsets_not_pair", 0, "{\"t\":{\"dtype\":\"F32\",\"shape\":[6],\"data_offsets\":[0]}}", 24,
         KVB_ERR_FORMAT, "data_offsets"},
        {"five_dims", 0, "{\"t\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,6],\"data_offsets\":[0,24]}}", 24,
         KVB_ERR_UNSUPPORTED, "dimensions"},
        {"negative_dim", 0, "{\"t\":{\"dtype\":\"F32\",\"shape\":[-6],\"data_offsets\":[0,24]}}", 24,
         KVB_ERR_FORMAT, "shape[0]"},
        {"huge_dims", 0,
         "{\"t\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4],\"data_offsets\":[0,24]}}", 24,
         KVB_ERR_FORMAT, "\"t\""},
        {"entry_not_object", 0, "{\"t\":[1]}", 0, KVB_ERR_FORMAT, "not an object"},
        {"no_shape", 0, "{\"t\":{\"dtype\":\"F32\",\"data_offsets\":[0,24]}}", 24, KVB_ERR_FORMAT, "shape"},
        {"dup_key", 0, "{%s,%s}", 24, KVB_ERR_FORMAT, "duplicate"},
        {"metadata_ok", 0, "{\"__metadata__\":{\"format\":\"pt\"},%s}", 24, KVB_OK, NULL},
    };
    for (size_t i = 0; i < KVB_ARRAY_LEN(cases); i++) {
        snprintf(hdr, sizeof hdr, cases[i].header, ok_entry, ok_entry);
        char name[64];
        snprintf(name, sizeof name, "%s.safetensors", cases[i].name);
        const char *p = tmp_path(name);
        write_raw(p, cases[i].hlen, hdr, cases[i].data);
        kvb_status st = open_file_logged(p);
        ck_assert_msg(st == cases[i].want, "%s: status %d (%s), want %d", cases[i].name, st, kvb_status_str(st),
                      cases[i].want);
        if (cases[i].logged) {
            ck_assert_log_has(cases[i].logged);
            ck_assert_log_has(name); /* every error names the file */
        }
    }
    /* files too short to hold the length field */
    const char *p = tmp_path("short.safetensors");
    write_text(p, "");
    ck_assert_int_eq(open_file_logged(p), KVB_ERR_FORMAT);
    ck_assert_log_has("too short");
    write_text(p, "\x10\x00\x00");
    ck_assert_int_eq(open_file_logged(p), KVB_ERR_FORMAT);
    ck_assert_log_has("short.safetensors");
    ck_assert_int_eq(open_file_logged(tmp_path("missing.safetensors")), KVB_ERR_NOT_FOUND);
    ck_assert_log_has("missing.safetensors");
}
KVB_TEST_END

/* Every truncation and many single-byte corruptions of a valid file: never a crash, never a tensor
 * outside the file; a truncated file is always an error. */
KVB_TEST(st_truncation_and_corruption) {
    float a[16];
    for (int i = 0; i < 16; i++) a[i] = (float)i;
    kvb_st_write_tensor w[] = {
        {.name = "x", .dtype = KVB_DTYPE_F32, .n_dims = 2, .shape = {2, 4}, .data = a},
        {.name = "y", .dtype = KVB_DTYPE_BF16, .n_dims = 1, .shape = {16}, .data = a},
    };
    const char *src = tmp_path("good.safetensors");
    ck_assert_int_eq(kvb_st_write(src, w, 2, NULL), KVB_OK);
    FILE *f = fopen(src, "rb");
    unsigned char buf[1024];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    ck_assert_uint_gt(n, 64);
    const char *p = tmp_path("cut.safetensors");
    int saved = dup(2), devnull = open("/dev/null", O_WRONLY);
    dup2(devnull, 2); /* thousands of expected error lines */
    for (size_t len = 0; len < n; len++) {
        FILE *g = fopen(p, "wb");
        fwrite(buf, 1, len, g);
        fclose(g);
        kvb_st_set *s = NULL;
        kvb_status st = kvb_st_open_file(p, &s);
        if (st == KVB_OK) kvb_st_close(s);
        ck_assert_msg(st != KVB_OK, "truncated to %zu of %zu bytes but opened", len, n);
    }
    uint64_t rng = 12345;
    for (int iter = 0; iter < 3000; iter++) {
        unsigned char c[1024];
        memcpy(c, buf, n);
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        size_t pos = (size_t)(rng >> 33) % n;
        c[pos] = (unsigned char)(rng >> 17);
        FILE *g = fopen(p, "wb");
        fwrite(c, 1, n, g);
        fclose(g);
        kvb_st_set *s = NULL;
        if (kvb_st_open_file(p, &s) == KVB_OK) {
            for (int i = 0; i < kvb_st_count(s); i++) {
                const kvb_st_tensor *t = kvb_st_at(s, i);
                volatile unsigned char sink = 0;
                for (size_t k = 0; k < t->nbytes; k++) sink ^= ((const unsigned char *)t->data)[k];
                (void)sink;
            }
            kvb_st_close(s);
        }
    }
    dup2(saved, 2);
    close(saved);
    close(devnull);
}
KVB_TEST_END

static void write_st(const char *path, const char *const *names, int n) {
    static const float v[4] = {1, 2, 3, 4};
    kvb_st_write_tensor w[8];
    for (int i = 0; i < n; i++)
        w[i] = (kvb_st_write_tensor){.name = names[i], .dtype = KVB_DTYPE_F32, .n_dims = 1, .shape = {4}, .data = v};
    ck_assert_int_eq(kvb_st_write(path, w, n, NULL), KVB_OK);
}

static kvb_status open_dir_logged(const char *dir, int *count) {
    kvb_st_set *s = NULL;
    capture_begin();
    kvb_status st = kvb_st_open_dir(dir, &s);
    capture_end();
    if (st == KVB_OK) {
        *count = kvb_st_count(s);
        kvb_st_close(s);
    } else {
        ck_assert_ptr_null(s);
    }
    return st;
}

/* kvb_st_release drops a tensor's pages from the process; its data reads back unchanged from the file. */
KVB_TEST(st_release_keeps_data) {
    static float big[3 * 4096];
    for (size_t i = 0; i < KVB_ARRAY_LEN(big); i++) big[i] = (float)i * 0.5f;
    kvb_st_write_tensor w = {.name = "big", .dtype = KVB_DTYPE_F32, .n_dims = 1, .shape = {KVB_ARRAY_LEN(big)},
                             .data = big};
    const char *path = tmp_path("rel.safetensors");
    ck_assert_int_eq(kvb_st_write(path, &w, 1, NULL), KVB_OK);
    kvb_st_set *s = NULL;
    ck_assert_int_eq(kvb_st_open_file(path, &s), KVB_OK);
    const kvb_st_tensor *t = kvb_st_find(s, "big");
    kvb_st_prefault(t);
    ck_assert_int_eq(memcmp(t->data, big, sizeof big), 0);
    kvb_st_release(t);
    ck_assert_int_eq(memcmp(t->data, big, sizeof big), 0);
    kvb_st_close(s);
}
KVB_TEST_END

KVB_TEST(st_dir_and_shards) {
    int count = -1;
    /* no weights at all */
    mkdir_tmp("none");
    write_text(tmp_path("none/config.json"), "{}");
    ck_assert_int_eq(open_dir_logged(tmp_path("none"), &count), KVB_ERR_NOT_FOUND);
    ck_assert_log_has("none");
    ck_assert_int_eq(open_dir_logged(tmp_path("does-not-exist"), &count), KVB_ERR_NOT_FOUND);

    /* every *.safetensors without an index */
    mkdir_tmp("two");
    const char *a[] = {"a.1", "a.2"}, *b[] = {"b.1"};
    write_st(tmp_path("two/x.safetensors"), a, 2);
    write_st(tmp_path("two/y.safetensors"), b, 1);
    write_text(tmp_path("two/notes.txt"), "not weights");
    ck_assert_int_eq(open_dir_logged(tmp_path("two"), &count), KVB_OK);
    ck_assert_int_eq(count, 3);

    /* the same name in two files */
    mkdir_tmp("dup");
    const char *d1[] = {"w", "u"}, *d2[] = {"v", "w"};
    write_st(tmp_path("dup/model-00001-of-00002.safetensors"), d1, 2);
    write_st(tmp_path("dup/model-00002-of-00002.safetensors"), d2, 2);
    ck_assert_int_eq(open_dir_logged(tmp_path("dup"), &count), KVB_ERR_FORMAT);
    ck_assert_log_has("\"w\"");
    ck_assert_log_has("model-00001-of-00002.safetensors");
    ck_assert_log_has("model-00002-of-00002.safetensors");

    /* with an index: each shard opened once, every listed tensor found where the index says */
    mkdir_tmp("idx");
    const char *s1[] = {"t.a", "t.b"}, *s2[] = {"t.c"};
    write_st(tmp_path("idx/model-00001-of-00002.safetensors"), s1, 2);
    write_st(tmp_path("idx/model-00002-of-00002.safetensors"), s2, 1);
    write_st(tmp_path("idx/stale.safetensors"), s2, 1); /* not in the index: ignored, no duplicate */
    const char *good = "{\"metadata\": {\"total_size\": 48}, \"weight_map\": {"
                       "\"t.a\": \"model-00001-of-00002.safetensors\", \"t.b\": \"model-00001-of-00002.safetensors\","
                       " \"t.c\": \"model-00002-of-00002.safetensors\"}}";
    write_text(tmp_path("idx/model.safetensors.index.json"), good);
    ck_assert_int_eq(open_dir_logged(tmp_path("idx"), &count), KVB_OK);
    ck_assert_int_eq(count, 3);

    /* an index naming a tensor no shard has */
    write_text(tmp_path("idx/model.safetensors.index.json"),
               "{\"weight_map\": {\"t.a\": \"model-00001-of-00002.safetensors\","
               " \"t.zzz\": \"model-00002-of-00002.safetensors\"}}");
    ck_assert_int_eq(open_dir_logged(tmp_path("idx"), &count), KVB_ERR_NOT_FOUND);
    ck_assert_log_has("t.zzz");
    /* ... a tensor in another (listed) shard than it says */
    write_text(tmp_path("idx/model.safetensors.index.json"),
               "{\"weight_map\": {\"t.a\": \"model-00002-of-00002.safetensors\","
               " \"t.b\": \"model-00001-of-00002.safetensors\", \"t.c\": \"model-00002-of-00002.safetensors\"}}");
    ck_assert_int_eq(open_dir_logged(tmp_path("idx"), &count), KVB_ERR_FORMAT);
    ck_assert_log_has("t.a");
    /* ... a shard file that does not exist */
    write_text(tmp_path("idx/model.safetensors.index.json"),
               "{\"weight_map\": {\"t.a\": \"model-00001-of-00003.safetensors\"}}");
    ck_assert_int_eq(open_dir_logged(tmp_path("idx"), &count), KVB_ERR_NOT_FOUND);
    ck_assert_log_has("model-00001-of-00003.safetensors");
    /* ... a path outside the directory, a non-string, no weight_map, bad JSON */
    write_text(tmp_path("idx/model.safetensors.index.json"), "{\"weight_map\": {\"t.a\": \"../x.safetensors\"}}");
    ck_assert_int_eq(open_dir_logged(tmp_path("idx"), &count), KVB_ERR_FORMAT);
    write_text(tmp_path("idx/model.safetensors.index.json"), "{\"weight_map\": {\"t.a\": 3}}");
    ck_assert_int_eq(open_dir_logged(tmp_path("idx"), &count), KVB_ERR_FORMAT);
    write_text(tmp_path("idx/model.safetensors.index.json"), "{\"metadata\": {}}");
    ck_assert_int_eq(open_dir_logged(tmp_path("idx"), &count), KVB_ERR_FORMAT);
    ck_assert_log_has("weight_map");
    write_text(tmp_path("idx/model.safetensors.index.json"), "{\"weight_map\": ");
    ck_assert_int_eq(open_dir_logged(tmp_path("idx"), &count), KVB_ERR_FORMAT);
    ck_assert_log_has("model.safetensors.index.json");
}
KVB_TEST_END

/* ---------------------------------------------------------------------------------- model loading */

/* A tiny model: 2 layers, hidden 8, 2 heads of 4 (GQA: 1 kv head), intermediate 12, vocab 10. */
enum { T_LAYERS = 2, T_HIDDEN = 8, T_HEADS = 2, T_KV = 1, T_HD = 4, T_FF = 12, T_VOCAB = 10 };

typedef struct mk_spec {
    int qwen3, tie, shards;
    kvb_dtype dtype;
    const char *omit;      /* tensor to leave out */
    const char *bad_shape; /* tensor written with one extra row */
    const char *extra_cfg; /* spliced into config.json */
    int fp8;               /* linear layers' weights F8_E4M3 holding 2 x the values, X.weight_scale 0.5 (bf16,
                            * [rows][1]) after all the others: the same dequantized weights */
    const char *dense;     /* with fp8: a linear weight left in `dtype` (and without a scale) */
    uint8_t nan_byte;      /* with fp8: the first weight's first byte, when not 0 */
} mk_spec;

static int is_linear_weight(const char *name) {
    size_t n = strlen(name);
    return n > 12 && !strcmp(name + n - 12, "_proj.weight");
}

/* Value of element k of tensor number `ti`: deterministic, exact in bf16 and f16. */
static float tval(int ti, int64_t k) { return (float)((ti * 7 + k * 3) % 17 - 8) / 8.0f; }

static void make_model(const char *dirname, const mk_spec *sp) {
    mkdir_tmp(dirname);
    char path[256], cfg[1024];
    snprintf(path, sizeof path, "%s/config.json", tmp_path(dirname));
    snprintf(cfg, sizeof cfg,
             "{\"architectures\": [\"%s\"], \"hidden_size\": %d, \"intermediate_size\": %d,"
             " \"num_attention_heads\": %d, \"num_key_value_heads\": %d, \"head_dim\": %d,"
             " \"num_hidden_layers\": %d, \"vocab_size\": %d, \"tie_word_embeddings\": %s,"
             " \"rms_norm_eps\": 1e-05, \"rope_theta\": 10000.0%s}",
             sp->qwen3 ? "Qwen3ForCausalLM" : "LlamaForCausalLM", T_HIDDEN, T_FF, T_HEADS, T_KV, T_HD, T_LAYERS,
             T_VOCAB, sp->tie ? "true" : "false", sp->extra_cfg ? sp->extra_cfg : "");
    write_text(path, cfg);

    static char names[64][96];
    static uint16_t buf16[64][T_VOCAB * T_HIDDEN * 2];
    static float buf32[64][T_VOCAB * T_HIDDEN * 2];
    kvb_st_write_tensor w[96];
    int n = 0;
#define T(nm, r, c)                                                                                    \
    do {                                                                                               \
        snprintf(names[n], sizeof names[n], "%s", nm);                                                 \
        w[n] = (kvb_st_write_tensor){.name = names[n], .dtype = sp->dtype, .n_dims = (c) ? 2 : 1,      \
                                     .shape = {(r), (c)}};                                             \
        n++;                                                                                           \
    } while (0)
    T("model.embed_tokens.weight", T_VOCAB, T_HIDDEN);
    for (int l = 0; l < T_LAYERS; l++) {
        char nm[96];
#define L(suffix, r, c)                                                                                \
    do {                                                                                               \
        snprintf(nm, sizeof nm, "model.layers.%d.%s", l, suffix);                                      \
        T(nm, r, c);                                                                                   \
    } while (0)
        L("input_layernorm.weight", T_HIDDEN, 0);
        L("self_attn.q_proj.weight", T_HEADS * T_HD, T_HIDDEN);
        L("self_attn.k_proj.weight", T_KV * T_HD, T_HIDDEN);
        L("self_attn.v_proj.weight", T_KV * T_HD, T_HIDDEN);
        L("self_attn.o_proj.weight", T_HIDDEN, T_HEADS * T_HD);
        if (sp->qwen3) {
            L("self_attn.q_norm.weight", T_HD, 0);
            L("self_attn.k_norm.weight", T_HD, 0);
        }
        L("post_attention_layernorm.weight", T_HIDDEN, 0);
        L("mlp.gate_proj.weight", T_FF, T_HIDDEN);
        L("mlp.up_proj.weight", T_FF, T_HIDDEN);
        L("mlp.down_proj.weight", T_HIDDEN, T_FF);
#undef L
    }
    T("model.norm.weight", T_HIDDEN, 0);
    if (!sp->tie) T("lm_head.weight", T_VOCAB, T_HIDDEN);
#undef T
    static uint8_t buf8[64][T_VOCAB * T_HIDDEN * 2];
    static uint16_t scales[T_VOCAB * 2];
    static char scale_names[64][104];
    int n_scales = 0, first_fp8 = 1;
    for (int k = 0; k < T_VOCAB * 2; k++) scales[k] = kvb_f32_to_bf16(0.5f);
    int m = 0;
    for (int i = 0; i < n; i++) {
        if (sp->omit && !strcmp(w[i].name, sp->omit)) continue;
        if (sp->bad_shape && !strcmp(w[i].name, sp->bad_shape)) w[i].shape[0]++;
        int64_t cnt = w[i].shape[0] * (w[i].n_dims == 2 ? w[i].shape[1] : 1);
        ck_assert_int_le(cnt, T_VOCAB * T_HIDDEN * 2);
        for (int64_t k = 0; k < cnt; k++) {
            float v = tval(i, k);
            buf32[i][k] = v;
            buf16[i][k] = sp->dtype == KVB_DTYPE_BF16 ? kvb_f32_to_bf16(v) : kvb_f32_to_f16(v);
            buf8[i][k] = kvb_f32_to_e4m3(2.0f * v);
        }
        w[i].data = sp->dtype == KVB_DTYPE_F32 ? (const void *)buf32[i] : (const void *)buf16[i];
        if (sp->fp8 && is_linear_weight(w[i].name) && !(sp->dense && !strcmp(w[i].name, sp->dense))) {
            w[i].dtype = KVB_DTYPE_F8_E4M3;
            w[i].data = buf8[i];
            if (first_fp8 && sp->nan_byte) buf8[i][0] = sp->nan_byte;
            first_fp8 = 0;
            snprintf(scale_names[n_scales++], sizeof scale_names[0], "%s_scale", w[i].name);
        }
        w[m++] = w[i];
    }
    for (int i = 0; i < n_scales; i++) { /* the scales last: the other tensors keep their values */
        int64_t rows = 0;
        for (int j = 0; j < m; j++)
            if (!strncmp(w[j].name, scale_names[i], strlen(w[j].name)) && strlen(w[j].name) + 6 == strlen(scale_names[i]))
                rows = w[j].shape[0];
        if (sp->omit && !strcmp(scale_names[i], sp->omit)) continue;
        w[m++] = (kvb_st_write_tensor){.name = scale_names[i], .dtype = KVB_DTYPE_BF16, .n_dims = 2,
                                       .shape = {rows + (sp->bad_shape && !strcmp(scale_names[i], sp->bad_shape)), 1},
                                       .data = scales};
    }
    if (sp->shards <= 1) {
        snprintf(path, sizeof path, "%s/model.safetensors", tmp_path(dirname));
        ck_assert_int_eq(kvb_st_write(path, w, m, "{\"format\": \"pt\"}"), KVB_OK);
        return;
    }
    /* two shards and an index */
    int half = m / 2;
    snprintf(path, sizeof path, "%s/model-00001-of-00002.safetensors", tmp_path(dirname));
    ck_assert_int_eq(kvb_st_write(path, w, half, NULL), KVB_OK);
    snprintf(path, sizeof path, "%s/model-00002-of-00002.safetensors", tmp_path(dirname));
    ck_assert_int_eq(kvb_st_write(path, w + half, m - half, NULL), KVB_OK);
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", tmp_path(dirname));
    FILE *f = fopen(path, "w");
    fprintf(f, "{\"metadata\": {\"total_size\": 0}, \"weight_map\": {");
    for (int i = 0; i < m; i++)
        fprintf(f, "%s\"%s\": \"model-0000%d-of-00002.safetensors\"", i ? ", " : "", w[i].name, i < half ? 1 : 2);
    fprintf(f, "}}");
    ck_assert_int_eq(fclose(f), 0);
}

static int64_t expect_layer_params(int qwen3) {
    int64_t q = T_HEADS * T_HD, kv = T_KV * T_HD;
    return 2 * T_HIDDEN + T_HIDDEN * q + 2 * T_HIDDEN * kv + q * T_HIDDEN + 3 * T_HIDDEN * T_FF + (qwen3 ? 2 * T_HD : 0);
}

/* Bytes a decode step reads of the layers' weights on the CPU backend, matrices stored in `dt` (in place)
 * and norm vectors in f32. */
static int64_t expect_layer_bytes(int qwen3, kvb_dtype dt) {
    int64_t norms = 2 * T_HIDDEN + (qwen3 ? 2 * T_HD : 0);
    return 4 * norms + (int64_t)kvb_dtype_size(dt) * (expect_layer_params(qwen3) - norms);
}

/* The backend's weight `t` equals what the test wrote for tensor number `ti`: a matrix in the file's
 * dtype `dt` (the CPU backend uses it in place), a vector converted to f32. */
static void check_weight(kvb_backend *be, const kvb_tensor *t, int ti, int64_t rows, int64_t cols, kvb_dtype dt) {
    ck_assert_ptr_nonnull(t->data);
    ck_assert_int_eq(t->ne[0], rows);
    ck_assert_int_eq(t->ne[1], cols);
    ck_assert_int_eq(t->dtype, cols == 1 ? KVB_DTYPE_F32 : dt);
    ck_assert_int_eq(t->view, cols > 1 || dt == KVB_DTYPE_F32);
    union {
        float f[256];
        uint16_t h[256];
    } host;
    ck_assert_int_le(rows * cols, 256);
    ck_assert_int_eq(be->iface->to_host(be->ctx, &host, t->data, (size_t)(rows * cols) * kvb_dtype_size(t->dtype)), KVB_OK);
    for (int64_t k = 0; k < rows * cols; k++) {
        float v = t->dtype == KVB_DTYPE_F32 ? host.f[k] : t->dtype == KVB_DTYPE_BF16 ? kvb_bf16_to_f32(host.h[k])
                                                                                        : kvb_f16_to_f32(host.h[k]);
        ck_assert_float_eq(v, tval(ti, k));
    }
}

static kvb_status load_logged(const char *dirname, kvb_backend *be, kvb_model **m) {
    capture_begin();
    kvb_status st = kvb_model_load(tmp_path(dirname), be, m);
    capture_end();
    return st;
}

KVB_TEST(model_load_llama) {
    kvb_backend *be = NULL;
    ck_assert_int_eq(kvb_backend_create("cpu", 1, &be), KVB_OK);
    mk_spec sp = {.dtype = KVB_DTYPE_F32};
    make_model("llama", &sp);
    kvb_model *m = NULL;
    ck_assert_int_eq(load_logged("llama", be, &m), KVB_OK);
    const kvb_model_config *c = kvb_model_cfg(m);
    ck_assert_int_eq(c->arch, KVB_ARCH_LLAMA);
    ck_assert_int_eq(c->n_kv_heads, T_KV);
    ck_assert_ptr_eq(kvb_model_backend(m), be);
    kvb_kv_geom g = kvb_model_kv_geom(m, 16);
    ck_assert_int_eq(g.n_layers, T_LAYERS);
    ck_assert_int_eq(g.n_kv_heads, T_KV);
    ck_assert_int_eq(g.head_dim, T_HD);
    ck_assert_int_eq(g.block_size, 16);
    ck_assert_int_eq(g.elem_size, 4);
    int64_t layer = expect_layer_params(0);
    ck_assert_int_eq(kvb_model_n_params(m), 2 * T_VOCAB * T_HIDDEN + T_LAYERS * layer + T_HIDDEN);
    /* per decode step: all layers, final norm, lm_head; not the embedding table */
    ck_assert_int_eq(kvb_model_weight_bytes_per_token(m), 4 * (T_LAYERS * layer + T_HIDDEN + T_VOCAB * T_HIDDEN));
    /* weights reached the backend unchanged, in the right slots (tensor numbers as written) */
    check_weight(be, &m->embed, 0, T_VOCAB, T_HIDDEN, KVB_DTYPE_F32);
    check_weight(be, &m->layers[0].attn_norm, 1, T_HIDDEN, 1, KVB_DTYPE_F32);
    check_weight(be, &m->layers[0].wk, 3, T_KV * T_HD, T_HIDDEN, KVB_DTYPE_F32);
    check_weight(be, &m->layers[1].w_down, 9 + 9, T_HIDDEN, T_FF, KVB_DTYPE_F32);
    check_weight(be, &m->final_norm, 19, T_HIDDEN, 1, KVB_DTYPE_F32);
    check_weight(be, &m->lm_head, 20, T_VOCAB, T_HIDDEN, KVB_DTYPE_F32);
    ck_assert_int_eq(m->lm_head_tied, 0);
    ck_assert_ptr_null(m->layers[0].q_norm.data);
    ck_assert_int_eq(m->rope.head_dim, T_HD);
    ck_assert_float_eq(m->rope.inv_freq[1], 0.01f); /* 10000^(-2/4) */
    /* f32 weights are the file mapping itself (no second copy): every matrix points into the
     * mapped tensor, and the model keeps the mapping */
    ck_assert_int_eq(m->weights_mapped, 1);
    ck_assert_ptr_nonnull(m->weights_file);
    const kvb_st_tensor *wk = kvb_st_find(m->weights_file, "model.layers.0.self_attn.k_proj.weight");
    ck_assert_ptr_nonnull(wk);
    ck_assert_ptr_eq(m->layers[0].wk.data, wk->data);
    ck_assert_int_eq(m->layers[0].wk.view, 1);
    ck_assert_ptr_eq(m->embed.data, kvb_st_find(m->weights_file, "model.embed_tokens.weight")->data);
    kvb_model_destroy(m);
    kvb_model_destroy(NULL);
    kvb_backend_destroy(be);
}
KVB_TEST_END

/* One rule for the KV element size: by backend name (what kvbankctl uses without loading weights), equal
 * to the activation dtype of every backend built into this binary. */
KVB_TEST(kv_elem_size_rule) {
    int es = 0;
    const struct { const char *name; int bytes; } known[] = {
        {"cpu", 4}, {NULL, 4}, {"cuda", 2}, {"cuda:bf16", 2}, {"cuda:f16", 2}, {"cuda:f32", 4}};
    for (size_t i = 0; i < KVB_ARRAY_LEN(known); i++) {
        ck_assert_int_eq(kvb_model_kv_elem_size(known[i].name, &es), KVB_OK);
        ck_assert_int_eq(es, known[i].bytes);
    }
    ck_assert_int_eq(kvb_model_kv_elem_size("tpu", &es), KVB_ERR_UNSUPPORTED);
    const char *built[] = {"cpu", "cuda", "cuda:f16", "cuda:f32"};
    for (size_t i = 0; i < KVB_ARRAY_LEN(built); i++) {
        kvb_backend *be = NULL;
        if (kvb_backend_create(built[i], 1, &be) != KVB_OK) continue; /* not built in, or no GPU */
        ck_assert_int_eq(kvb_model_kv_elem_size(built[i], &es), KVB_OK);
        ck_assert_int_eq(es, (int)kvb_dtype_size(be->iface->act_dtype));
        kvb_backend_destroy(be);
    }
}
KVB_TEST_END

KVB_TEST(model_load_tied_llama3_f16) {
    kvb_backend *be = NULL;
    ck_assert_int_eq(kvb_backend_create("cpu", 1, &be), KVB_OK);
    mk_spec sp = {.tie = 1, .dtype = KVB_DTYPE_F16,
                  .extra_cfg = ", \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0,"
                               " \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0,"
                               " \"original_max_position_embeddings\": 1}"};
    make_model("tied", &sp);
    kvb_model *m = NULL;
    ck_assert_int_eq(load_logged("tied", be, &m), KVB_OK);
    ck_assert_int_eq(m->lm_head_tied, 1);
    ck_assert_ptr_eq(m->lm_head.data, m->embed.data);
    check_weight(be, &m->embed, 0, T_VOCAB, T_HIDDEN, KVB_DTYPE_F16); /* f16 in place */
    check_weight(be, &m->final_norm, 1 + T_LAYERS * 9, T_HIDDEN, 1, KVB_DTYPE_F16); /* a vector: converted exactly */
    /* f16 matrices are used in place: the mapping lives with the model */
    ck_assert_int_eq(m->weights_mapped, 1);
    ck_assert_ptr_nonnull(m->weights_file);
    int64_t layer = expect_layer_params(0);
    ck_assert_int_eq(kvb_model_n_params(m), T_VOCAB * T_HIDDEN + T_LAYERS * layer + T_HIDDEN);
    /* tied: the LM head reads the whole embedding table every step (f16 as stored) */
    ck_assert_int_eq(kvb_model_weight_bytes_per_token(m),
                     T_LAYERS * expect_layer_bytes(0, KVB_DTYPE_F16) + 4 * T_HIDDEN + 2 * T_VOCAB * T_HIDDEN);
    /* llama3 with original context 1: every wavelength > low_freq_wavelen, so all divided by 8 */
    ck_assert_float_eq(m->inv_freq[0], 1.0f / 8.0f);
    ck_assert_float_eq(m->inv_freq[1], 0.01f / 8.0f);
    kvb_model_destroy(m); /* frees the shared table once (ASan / glibc would catch a double free) */
    kvb_backend_destroy(be);
}
KVB_TEST_END

KVB_TEST(model_load_qwen3_bf16_sharded) {
    kvb_backend *be = NULL;
    ck_assert_int_eq(kvb_backend_create("cpu", 1, &be), KVB_OK);
    mk_spec sp = {.qwen3 = 1, .shards = 2, .dtype = KVB_DTYPE_BF16};
    make_model("qwen3", &sp);
    kvb_model *m = NULL;
    ck_assert_int_eq(load_logged("qwen3", be, &m), KVB_OK);
    ck_assert_int_eq(kvb_model_cfg(m)->arch, KVB_ARCH_QWEN3);
    /* tensor numbers: embed 0; layer 0: norm 1, q 2, k 3, v 4, o 5, q_norm 6, k_norm 7, ... (11 per layer) */
    check_weight(be, &m->layers[0].q_norm, 6, T_HD, 1, KVB_DTYPE_BF16);
    check_weight(be, &m->layers[1].k_norm, 7 + 11, T_HD, 1, KVB_DTYPE_BF16);
    check_weight(be, &m->layers[1].wv, 4 + 11, T_KV * T_HD, T_HIDDEN, KVB_DTYPE_BF16);
    check_weight(be, &m->lm_head, 1 + 2 * 11 + 1, T_VOCAB, T_HIDDEN, KVB_DTYPE_BF16);
    int64_t layer = expect_layer_params(1);
    ck_assert_int_eq(kvb_model_n_params(m), 2 * T_VOCAB * T_HIDDEN + T_LAYERS * layer + T_HIDDEN);
    ck_assert_int_eq(kvb_model_weight_bytes_per_token(m),
                     T_LAYERS * expect_layer_bytes(1, KVB_DTYPE_BF16) + 4 * T_HIDDEN + 2 * T_VOCAB * T_HIDDEN);
    kvb_model_destroy(m);
    kvb_backend_destroy(be);
}
KVB_TEST_END

KVB_TEST(model_load_errors) {
    kvb_backend *be = NULL;
    ck_assert_int_eq(kvb_backend_create("cpu", 1, &be), KVB_OK);
    kvb_model *m = NULL;
    struct {
        const char *dir;
        mk_spec sp;
        kvb_status want;
        const char *logged[2];
    } cases[] = {
        {"missing", {.dtype = KVB_DTYPE_F32, .omit = "model.layers.1.mlp.up_proj.weight"}, KVB_ERR_NOT_FOUND,
         {"model.layers.1.mlp.up_proj.weight", "missing"}},
        {"shape", {.dtype = KVB_DTYPE_F32, .bad_shape = "model.layers.0.self_attn.k_proj.weight"}, KVB_ERR_INVALID,
         {"model.layers.0.self_attn.k_proj.weight", "shape [5, 8], expected [4, 8]"}},
        {"normshape", {.dtype = KVB_DTYPE_BF16, .bad_shape = "model.norm.weight"}, KVB_ERR_INVALID,
         {"model.norm.weight", "expected [8]"}},
        {"no_lm_head", {.dtype = KVB_DTYPE_F32, .omit = "lm_head.weight"}, KVB_ERR_NOT_FOUND,
         {"lm_head.weight", "missing"}},
        {"no_embed", {.dtype = KVB_DTYPE_F32, .omit = "model.embed_tokens.weight"}, KVB_ERR_NOT_FOUND,
         {"model.embed_tokens.weight", "missing"}},
        {"qwen3_no_qnorm", {.qwen3 = 1, .dtype = KVB_DTYPE_F32, .omit = "model.layers.1.self_attn.q_norm.weight"},
         KVB_ERR_NOT_FOUND, {"model.layers.1.self_attn.q_norm.weight", "missing"}},
        {"bad_arch", {.dtype = KVB_DTYPE_F32, .extra_cfg = ", \"architectures\": [\"Gemma2ForCausalLM\"]"},
         KVB_ERR_FORMAT, {"duplicate", "config.json"}},
    };
    for (size_t i = 0; i < KVB_ARRAY_LEN(cases); i++) {
        make_model(cases[i].dir, &cases[i].sp);
        kvb_status st = load_logged(cases[i].dir, be, &m);
        ck_assert_msg(st == cases[i].want, "%s: status %d (%s), want %d", cases[i].dir, st, kvb_status_str(st),
                      cases[i].want);
        for (int k = 0; k < 2; k++) ck_assert_log_has(cases[i].logged[k]);
    }
    /* a Qwen3 config over Llama weights: the first q_norm is missing */
    make_model("llama_w", &(mk_spec){.dtype = KVB_DTYPE_F32});
    write_text(tmp_path("llama_w/config.json"),
               "{\"architectures\": [\"Qwen3ForCausalLM\"], \"hidden_size\": 8, \"intermediate_size\": 12,"
               " \"num_attention_heads\": 2, \"num_key_value_heads\": 1, \"head_dim\": 4, \"num_hidden_layers\": 2,"
               " \"vocab_size\": 10}");
    ck_assert_int_eq(load_logged("llama_w", be, &m), KVB_ERR_NOT_FOUND);
    ck_assert_log_has("model.layers.0.self_attn.q_norm.weight");
    /* a Qwen2 config (q/k/v biases) or a Llama one with mlp_bias over bias-less weights */
    write_text(tmp_path("llama_w/config.json"),
               "{\"architectures\": [\"Qwen2ForCausalLM\"], \"hidden_size\": 8, \"intermediate_size\": 12,"
               " \"num_attention_heads\": 2, \"num_key_value_heads\": 1, \"head_dim\": 4, \"num_hidden_layers\": 2,"
               " \"vocab_size\": 10}");
    ck_assert_int_eq(load_logged("llama_w", be, &m), KVB_ERR_NOT_FOUND);
    ck_assert_log_has("model.layers.0.self_attn.q_proj.bias");
    write_text(tmp_path("llama_w/config.json"),
               "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 8, \"intermediate_size\": 12,"
               " \"num_attention_heads\": 2, \"num_key_value_heads\": 1, \"head_dim\": 4, \"num_hidden_layers\": 2,"
               " \"vocab_size\": 10, \"mlp_bias\": true}");
    ck_assert_int_eq(load_logged("llama_w", be, &m), KVB_ERR_NOT_FOUND);
    ck_assert_log_has("model.layers.0.mlp.gate_proj.bias");
    /* an unknown architecture in config.json */
    write_text(tmp_path("llama_w/config.json"),
               "{\"architectures\": [\"Gemma2ForCausalLM\"], \"hidden_size\": 8, \"intermediate_size\": 12,"
               " \"num_attention_heads\": 2, \"num_hidden_layers\": 2, \"vocab_size\": 10}");
    ck_assert_int_eq(load_logged("llama_w", be, &m), KVB_ERR_UNSUPPORTED);
    ck_assert_log_has("Gemma2ForCausalLM");
    /* no config.json; no weights */
    mkdir_tmp("bare");
    ck_assert_int_eq(load_logged("bare", be, &m), KVB_ERR_NOT_FOUND);
    ck_assert_log_has("config.json");
    write_text(tmp_path("bare/config.json"),
               "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 8, \"intermediate_size\": 12,"
               " \"num_attention_heads\": 2, \"num_hidden_layers\": 2, \"vocab_size\": 10}");
    ck_assert_int_eq(load_logged("bare", be, &m), KVB_ERR_NOT_FOUND);
    ck_assert_log_has("safetensors");
    kvb_backend_destroy(be);
}
KVB_TEST_END

/* An allocator that records what the forward pass asks for and checks that everything comes back. */
typedef struct counting_alloc {
    kvb_mem *mem;
    size_t sizes[64];
    int n_allocs, live;
} counting_alloc;

static kvb_status ca_alloc(void *ctx, size_t bytes, void **out) {
    counting_alloc *a = ctx;
    if (a->n_allocs < 64) a->sizes[a->n_allocs] = bytes;
    a->n_allocs++;
    kvb_status st = kvb_mem_alloc(a->mem, bytes, out);
    if (st == KVB_OK) a->live++;
    return st;
}

static void ca_free(void *ctx, void *p) {
    counting_alloc *a = ctx;
    if (!p) return;
    a->live--;
    kvb_mem_free(a->mem, p);
}

static const kvb_mem_allocator_i ca_iface = {.alloc = ca_alloc, .free = ca_free};

/* One sequence: a 5-token prompt, then one decode token, over one KV block of 16 tokens. Logits of
 * each step go to logits[step][vocab]. */
static void run_two_steps(kvb_model *m, kvb_forward *fw, void *block, float *logits) {
    kvb_backend *be = kvb_model_backend(m);
    kvb_kv_geom g = kvb_model_kv_geom(m, 16);
    size_t layer_bytes = (size_t)2 * g.block_size * g.n_kv_heads * g.head_dim * g.elem_size;
    int32_t toks[5] = {3, 1, 4, 1, 5}, pos[5] = {0, 1, 2, 3, 4};
    for (int step = 0; step < 2; step++) {
        int n = step == 0 ? 5 : 1;
        kvb_attn_seq seq = {.q_start = 0, .q_len = n, .ctx_len = step == 0 ? 5 : 6, .n_blocks = 1, .blk_first = 0};
        void *lb[1] = {block};
        int32_t row = n - 1, tok2 = 9, pos2 = 5;
        kvb_batch b = {.n_tokens = n, .tokens = step == 0 ? toks : &tok2, .pos = step == 0 ? pos : &pos2,
                       .attn = {.geom = &g, .n_seqs = 1, .seqs = &seq, .layer_blocks = lb},
                       .n_logits = 1, .logit_rows = &row};
        ck_assert_int_eq(kvb_forward_begin(fw, &b), KVB_OK);
        for (int l = 0; l < g.n_layers; l++) {
            lb[0] = (char *)block + (size_t)l * layer_bytes;
            ck_assert_int_eq(kvb_forward_layer(fw, l), KVB_OK);
        }
        ck_assert_int_eq(kvb_forward_end(fw, logits + (size_t)step * T_VOCAB), KVB_OK);
    }
    (void)be;
}

KVB_TEST(forward_allocator_seam) {
    kvb_backend *be = NULL;
    ck_assert_int_eq(kvb_backend_create("cpu", 1, &be), KVB_OK);
    mk_spec sp = {.dtype = KVB_DTYPE_F32};
    make_model("fwalloc", &sp);
    kvb_model *m = NULL;
    ck_assert_int_eq(load_logged("fwalloc", be, &m), KVB_OK);
    kvb_kv_geom g = kvb_model_kv_geom(m, 16);
    size_t block_bytes = (size_t)g.n_layers * 2 * g.block_size * g.n_kv_heads * g.head_dim * g.elem_size;
    void *b1 = NULL, *b2 = NULL;
    ck_assert_int_eq(kvb_mem_alloc(be->mem, block_bytes, &b1), KVB_OK);
    ck_assert_int_eq(kvb_mem_alloc(be->mem, block_bytes, &b2), KVB_OK);
    float got[2 * T_VOCAB], want[2 * T_VOCAB];

    /* the caller's allocator: each step asks for buffers sized by its own tokens, gives all back */
    counting_alloc ca = {.mem = be->mem};
    kvb_mem_allocator al = {&ca_iface, &ca};
    kvb_forward *fw = NULL;
    ck_assert_int_eq(kvb_forward_create_with(m, 8, &al, &fw), KVB_OK);
    ck_assert_int_eq(ca.n_allocs, 0); /* nothing sized at creation */
    run_two_steps(m, fw, b1, got);
    ck_assert_int_eq(ca.live, 0);
    ck_assert_int_eq(ca.n_allocs, 2 * 10); /* 8 activation buffers + logit rows + logits, per step */
    ck_assert_uint_eq(ca.sizes[0], (size_t)5 * T_HIDDEN * sizeof(float));  /* x, prompt step */
    ck_assert_uint_eq(ca.sizes[10], (size_t)1 * T_HIDDEN * sizeof(float)); /* x, decode step */
    ck_assert_uint_eq(ca.sizes[6], (size_t)5 * T_FF * sizeof(float));      /* gate */
    ck_assert_uint_eq(ca.sizes[9], (size_t)1 * T_VOCAB * sizeof(float));   /* logits of one row */
    /* a batch beyond max_tokens is refused before anything is allocated */
    int32_t t9[9] = {0}, p9[9] = {0, 1, 2, 3, 4, 5, 6, 7, 8}, r9 = 8;
    kvb_attn_seq s9 = {.q_len = 9, .ctx_len = 9, .n_blocks = 1};
    void *l9[1] = {b1};
    kvb_batch big = {.n_tokens = 9, .tokens = t9, .pos = p9,
                     .attn = {.geom = &g, .n_seqs = 1, .seqs = &s9, .layer_blocks = l9}, .n_logits = 1,
                     .logit_rows = &r9};
    ck_assert_int_eq(kvb_forward_begin(fw, &big), KVB_ERR_INVALID);
    ck_assert_int_eq(ca.n_allocs, 20);
    /* an abandoned step gives its buffers back at the next begin and at destroy */
    big.n_tokens = s9.q_len = s9.ctx_len = 3;
    r9 = 2;
    ck_assert_int_eq(kvb_forward_begin(fw, &big), KVB_OK);
    ck_assert_int_eq(ca.live, 10);
    ck_assert_int_eq(kvb_forward_layer(fw, 0), KVB_OK);
    ck_assert_int_eq(kvb_forward_begin(fw, &big), KVB_OK);
    ck_assert_int_eq(ca.live, 10);
    kvb_forward_destroy(fw);
    ck_assert_int_eq(ca.live, 0);

    /* the default step arena gives the same logits */
    ck_assert_int_eq(kvb_forward_create(m, 8, &fw), KVB_OK);
    run_two_steps(m, fw, b2, want);
    kvb_forward_destroy(fw);
    ck_assert(!memcmp(got, want, sizeof got));
    for (int i = 0; i < 2 * T_VOCAB; i++) ck_assert(isfinite(got[i]));
    kvb_mem_free(be->mem, b1);
    kvb_mem_free(be->mem, b2);
    kvb_model_destroy(m);
    kvb_backend_destroy(be);
}
KVB_TEST_END

/* Logits of two steps (run_two_steps) of the model in `dir`. */
static void two_step_logits(kvb_backend *be, const char *dir, float *logits) {
    kvb_model *m = NULL;
    ck_assert_int_eq(load_logged(dir, be, &m), KVB_OK);
    kvb_kv_geom g = kvb_model_kv_geom(m, 16);
    void *blk = NULL;
    ck_assert_int_eq(kvb_mem_alloc(be->mem, (size_t)g.n_layers * 2 * g.block_size * g.n_kv_heads * g.head_dim * g.elem_size,
                                   &blk), KVB_OK);
    kvb_forward *fw = NULL;
    ck_assert_int_eq(kvb_forward_create(m, 8, &fw), KVB_OK);
    run_two_steps(m, fw, blk, logits);
    kvb_forward_destroy(fw);
    kvb_mem_free(be->mem, blk);
    kvb_model_destroy(m);
}

/* An FP8 checkpoint (compressed-tensors, weights per channel): the linear layers are E4M3 in place with
 * their scales, and weight-only, with power-of-two scales that make the dequantized weights the f32
 * model's, its logits are that model's within rounding (bit for bit where the products take the SIMD
 * kernels; this model's 12 intermediate columns send down_proj to OpenBLAS, whose sgemv adds y into its
 * sums where the FP8 path adds it after); the W8A8 config marks every quantized layer's input for
 * quantization. */
KVB_TEST(model_load_fp8) {
    kvb_backend *be = NULL;
    ck_assert_int_eq(kvb_backend_create("cpu", 1, &be), KVB_OK);
    make_model("f32ref", &(mk_spec){.dtype = KVB_DTYPE_F32});
    make_model("fp8wo", &(mk_spec){.dtype = KVB_DTYPE_F32, .fp8 = 1, .extra_cfg = CT_W8A16});
    make_model("fp8dyn", &(mk_spec){.dtype = KVB_DTYPE_BF16, .fp8 = 1, .extra_cfg = CT_DYNAMIC});
    kvb_model *m = NULL;
    ck_assert_int_eq(load_logged("fp8wo", be, &m), KVB_OK);
    const kvb_layer_weights *w = &m->layers[1];
    const kvb_tensor *lin[] = {&w->wq, &w->wk, &w->wv, &w->wo, &w->w_gate, &w->w_up, &w->w_down};
    for (size_t i = 0; i < KVB_ARRAY_LEN(lin); i++) {
        ck_assert_int_eq(lin[i]->dtype, KVB_DTYPE_F8_E4M3);
        ck_assert_int_eq(lin[i]->view, 1);
        ck_assert_int_eq(lin[i]->n_scale, lin[i]->ne[0]);
        ck_assert_float_eq(lin[i]->scale[lin[i]->ne[0] - 1], 0.5f);
        ck_assert_int_eq(lin[i]->act, KVB_ACT_NONE);
    }
    ck_assert_int_eq(m->lm_head.dtype, KVB_DTYPE_F32); /* ignored */
    ck_assert_int_eq(kvb_model_n_params(m), 2 * T_VOCAB * T_HIDDEN + T_LAYERS * expect_layer_params(0) + T_HIDDEN);
    kvb_model_destroy(m);
    float want[2 * T_VOCAB], got[2 * T_VOCAB];
    two_step_logits(be, "f32ref", want);
    two_step_logits(be, "fp8wo", got);
    double e = 0, mx = 0;
    for (int i = 0; i < 2 * T_VOCAB; i++) e = fmax(e, fabs((double)got[i] - want[i])), mx = fmax(mx, fabs(want[i]));
    ck_assert_msg(e <= 1e-6 * mx, "FP8 weight-only logits differ from the f32 model's by %g of the largest", e / mx);
    ck_assert_int_eq(load_logged("fp8dyn", be, &m), KVB_OK);
    ck_assert_int_eq(m->layers[0].w_down.act, KVB_ACT_FP8_TOKEN);
    ck_assert_int_eq(m->embed.dtype, KVB_DTYPE_BF16);
    kvb_model_destroy(m);
    two_step_logits(be, "fp8dyn", got);
    for (int i = 0; i < 2 * T_VOCAB; i++) ck_assert(isfinite(got[i]));
    kvb_model_config c;
    ck_assert_int_eq(kvb_model_check(tmp_path("fp8dyn"), &c), KVB_OK);
    kvb_backend_destroy(be);
}
KVB_TEST_END

/* An FP8 checkpoint whose tensors and config disagree is refused by kvb_model_load and kvb_model_check,
 * naming the tensor. */
KVB_TEST(model_load_fp8_errors) {
    kvb_backend *be = NULL;
    ck_assert_int_eq(kvb_backend_create("cpu", 1, &be), KVB_OK);
    struct {
        const char *dir;
        mk_spec sp;
        kvb_status want;
        const char *logged[2];
        int checked; /* kvb_model_check (headers only) sees it too */
    } cases[] = {
        {"no_scale", {.fp8 = 1, .extra_cfg = CT_W8A16, .omit = "model.layers.1.mlp.up_proj.weight_scale"},
         KVB_ERR_NOT_FOUND, {"model.layers.1.mlp.up_proj.weight_scale", "missing"}, 1},
        {"scale_shape", {.fp8 = 1, .extra_cfg = CT_W8A16, .bad_shape = "model.layers.0.self_attn.v_proj.weight_scale"},
         KVB_ERR_INVALID, {"model.layers.0.self_attn.v_proj.weight_scale", "a scale per output channel"}, 1},
        {"per_tensor", {.fp8 = 1, .extra_cfg = CT_CONFIG("null", CT_WEIGHTS("tensor"), "[\"lm_head\"]", "[\"Linear\"]", "")},
         KVB_ERR_INVALID, {"weight_scale", "a scale per tensor"}, 1},
        {"no_config", {.fp8 = 1}, KVB_ERR_INVALID, {"model.layers.0.self_attn.q_proj.weight", "does not quantize it"}, 1},
        {"dense", {.fp8 = 1, .extra_cfg = CT_W8A16, .dense = "model.layers.0.mlp.gate_proj.weight"}, KVB_ERR_INVALID,
         {"model.layers.0.mlp.gate_proj.weight", "makes it an FP8"}, 1},
        {"ignored", {.fp8 = 1, .extra_cfg = CT_CONFIG("null", CT_WEIGHTS("channel"), "[\"lm_head\", \"re:.*o_proj\"]",
                                                      "[\"Linear\"]", "")},
         KVB_ERR_INVALID, {"model.layers.0.self_attn.o_proj.weight", "does not quantize it"}, 1},
        {"nan", {.fp8 = 1, .extra_cfg = CT_W8A16, .nan_byte = 0x7f}, KVB_ERR_INVALID, {"NaN", "q_proj"}, 0},
    };
    for (size_t i = 0; i < KVB_ARRAY_LEN(cases); i++) {
        cases[i].sp.dtype = KVB_DTYPE_BF16;
        make_model(cases[i].dir, &cases[i].sp);
        kvb_model *m = NULL;
        kvb_status st = load_logged(cases[i].dir, be, &m);
        ck_assert_msg(st == cases[i].want, "%s: status %d (%s), want %d", cases[i].dir, st, kvb_status_str(st),
                      cases[i].want);
        for (int k = 0; k < 2; k++) ck_assert_log_has(cases[i].logged[k]);
        kvb_model_config c;
        capture_begin();
        st = kvb_model_check(tmp_path(cases[i].dir), &c);
        capture_end();
        ck_assert_int_eq(st, cases[i].checked ? cases[i].want : KVB_OK);
        if (cases[i].checked) ck_assert_log_has(cases[i].logged[0]);
    }
    /* a weight the ignore list keeps dense loads as it is */
    make_model("dense_ok", &(mk_spec){.dtype = KVB_DTYPE_BF16, .fp8 = 1, .dense = "model.layers.1.mlp.down_proj.weight",
                                      .extra_cfg = CT_CONFIG("null", CT_WEIGHTS("channel"),
                                                             "[\"lm_head\", \"model.layers.1.mlp.down_proj\"]",
                                                             "[\"Linear\"]", "")});
    kvb_model *m = NULL;
    ck_assert_int_eq(load_logged("dense_ok", be, &m), KVB_OK);
    ck_assert_int_eq(m->layers[1].w_down.dtype, KVB_DTYPE_BF16);
    ck_assert_int_eq(m->layers[0].w_down.dtype, KVB_DTYPE_F8_E4M3);
    kvb_model_destroy(m);
    kvb_backend_destroy(be);
}
KVB_TEST_END

/* One step of three sequences (1,105 rows) against KV of blocks that `kv` holds (a copy of `kv0`, the
 * KV before the step): C's 5-token prompt (the attention's walk path), A's rows 100..899 (its first 100
 * keys already there), B's 300-token prompt, in that order (A starts off every tile boundary). Every
 * row's logits go to `logits`. With `alloc` the forward pass takes its buffers from it. */
enum { CH_A_PAST = 100, CH_A = 900, CH_B = 300, CH_C = 5, CH_ROWS = CH_A - CH_A_PAST + CH_B + CH_C, CH_BS = 16 };

static void chunk_step(kvb_model *m, int chunk, const kvb_mem_allocator *alloc, const void *kv0, void *kv,
                       size_t kv_bytes, float *logits) {
    const kvb_model_config *c = kvb_model_cfg(m);
    kvb_kv_geom g = kvb_model_kv_geom(m, CH_BS);
    size_t layer_bytes = (size_t)2 * g.block_size * g.n_kv_heads * g.head_dim * g.elem_size;
    size_t block_bytes = layer_bytes * (size_t)c->n_layers;
    memcpy(kv, kv0, kv_bytes);
    int q_len[3] = {CH_C, CH_A - CH_A_PAST, CH_B}, ctx[3] = {CH_C, CH_A, CH_B};
    kvb_attn_seq seqs[3];
    static int32_t tok[CH_ROWS], pos[CH_ROWS], rows[CH_ROWS];
    int n_blocks = 0, row = 0;
    for (int s = 0; s < 3; s++) {
        seqs[s] = (kvb_attn_seq){.q_start = row, .q_len = q_len[s], .ctx_len = ctx[s],
                                 .n_blocks = KVB_DIV_CEIL(ctx[s], CH_BS), .blk_first = n_blocks};
        n_blocks += seqs[s].n_blocks;
        for (int t = 0; t < q_len[s]; t++, row++) {
            pos[row] = ctx[s] - q_len[s] + t;
            tok[row] = (int32_t)(((unsigned)pos[row] * 2654435761u + (unsigned)s * 97u) % (unsigned)c->vocab);
            rows[row] = row;
        }
    }
    ck_assert_uint_eq(kv_bytes, block_bytes * (size_t)n_blocks);
    void **lb = malloc(sizeof(void *) * (size_t)n_blocks);
    ck_assert_ptr_nonnull(lb);
    kvb_batch b = {.n_tokens = CH_ROWS, .tokens = tok, .pos = pos,
                   .attn = {.geom = &g, .n_seqs = 3, .seqs = seqs, .layer_blocks = lb},
                   .n_logits = CH_ROWS, .logit_rows = rows};
    kvb_forward *fw = NULL;
    ck_assert_int_eq(kvb_forward_create_with(m, CH_ROWS, alloc, &fw), KVB_OK);
    ck_assert_int_eq(kvb_forward_chunk(fw, chunk), KVB_OK);
    ck_assert_int_eq(kvb_forward_begin(fw, &b), KVB_OK);
    ck_assert_int_eq(kvb_forward_chunk(fw, chunk), KVB_ERR_INVALID); /* not while a step is in flight */
    for (int l = 0; l < c->n_layers; l++) {
        for (int j = 0; j < n_blocks; j++) lb[j] = (char *)kv + (size_t)j * block_bytes + (size_t)l * layer_bytes;
        ck_assert_int_eq(kvb_forward_layer(fw, l), KVB_OK);
    }
    ck_assert_int_eq(kvb_forward_end(fw, logits), KVB_OK);
    kvb_forward_destroy(fw);
    free(lb);
}

/* A layer's rows run in chunks (kvb_forward_chunk) give the same bits as in one piece: logits of every
 * row and the KV written, on a full-causal and a sliding-window model; the chunk buffers are smaller
 * than the step. */
KVB_TEST(forward_chunks_exact) {
    const char *archs[] = {
        "--arch llama --layers 2 --hidden 64 --heads 6 --kv-heads 2 --head-dim 16 --intermediate 96 --vocab 48 --max-pos 2048 --seed 5",
        "--arch mistral --layers 2 --hidden 64 --heads 4 --kv-heads 4 --intermediate 96 --vocab 48 --max-pos 2048 "
        "--sliding-window 300 --seed 6"};
    for (size_t ai = 0; ai < KVB_ARRAY_LEN(archs); ai++) {
        kvb_t_model t;
        kvb_t_model_make(&t, archs[ai]);
        const kvb_model_config *c = kvb_model_cfg(t.m);
        kvb_kv_geom g = kvb_model_kv_geom(t.m, CH_BS);
        size_t kv_bytes = (size_t)2 * g.block_size * g.n_kv_heads * g.head_dim * g.elem_size * (size_t)c->n_layers *
                          (size_t)(KVB_DIV_CEIL(CH_A, CH_BS) + KVB_DIV_CEIL(CH_B, CH_BS) + KVB_DIV_CEIL(CH_C, CH_BS));
        float *kv0 = calloc(1, kv_bytes), *kv_want = malloc(kv_bytes), *kv_got = malloc(kv_bytes);
        size_t n_logits = (size_t)CH_ROWS * c->vocab;
        float *want = malloc(n_logits * sizeof(float)), *got = malloc(n_logits * sizeof(float));
        ck_assert(kv0 && kv_want && kv_got && want && got);
        /* A's first 100 keys: some values of the KV's scale (the step only reads them) */
        for (size_t i = 0; i < kv_bytes / sizeof(float); i++) kv0[i] = (float)((int)(i * 2654435761u % 2001u) - 1000) / 500.0f;
        chunk_step(t.m, 0, NULL, kv0, kv_want, kv_bytes, want);
        for (size_t i = 0; i < n_logits; i++) ck_assert(isfinite(want[i]));
        int chunks[] = {64, 200, 512};
        for (size_t ci = 0; ci < KVB_ARRAY_LEN(chunks); ci++) {
            counting_alloc ca = {.mem = t.be->mem};
            kvb_mem_allocator al = {&ca_iface, &ca};
            chunk_step(t.m, chunks[ci], &al, kv0, kv_got, kv_bytes, got);
            /* x of the whole step, then h of a chunk: fewer rows than the step */
            ck_assert_uint_eq(ca.sizes[0], (size_t)CH_ROWS * c->hidden * sizeof(float));
            ck_assert_uint_lt(ca.sizes[1], (size_t)CH_ROWS * c->hidden * sizeof(float));
            ck_assert_int_eq(ca.live, 0);
            ck_assert_msg(!memcmp(got, want, n_logits * sizeof(float)), "%s: chunk %d: logits differ", archs[ai],
                          chunks[ci]);
            ck_assert_msg(!memcmp(kv_got, kv_want, kv_bytes), "%s: chunk %d: KV differs", archs[ai], chunks[ci]);
        }
        free(kv0);
        free(kv_want);
        free(kv_got);
        free(want);
        free(got);
        kvb_t_model_free(&t);
    }
}
KVB_TEST_END

KVB_TEST_MAIN("model", KVB_T(config_llama_defaults, 10), KVB_T(config_qwen3, 10),
              KVB_T(config_llama3_rope_and_eos_list, 10), KVB_T(config_mistral_window, 10),
              KVB_T(config_qwen2_bias_window, 10), KVB_T(config_biases, 10), KVB_T(config_errors, 10),
              KVB_T(rope_inv_freq_default, 10), KVB_T(rope_inv_freq_llama3, 10), KVB_T(rope_inv_freq_linear_yarn, 10), KVB_T(st_roundtrip, 10), KVB_T(st_malformed, 10),
              KVB_T(st_truncation_and_corruption, 60), KVB_T(st_release_keeps_data, 10), KVB_T(st_dir_and_shards, 10), KVB_T(model_load_llama, 10),
              KVB_T(model_load_tied_llama3_f16, 10), KVB_T(model_load_qwen3_bf16_sharded, 10),
              KVB_T(model_load_errors, 20), KVB_T(config_fp8, 10), KVB_T(model_load_fp8, 20),
              KVB_T(model_load_fp8_errors, 20), KVB_T(forward_allocator_seam, 30), KVB_T(forward_chunks_exact, 120), KVB_T(kv_elem_size_rule, 10))
