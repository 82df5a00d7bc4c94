/* Unit tests of common/util: status strings, parsing, half-precision conversion, npy, JSON fields,
 * the node config. */
#include <fcntl.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/util/json.h"
#include "common/util/node_config.h"
#include "common/util/npy.h"
#include "common/util/sha256.h"
#include "common/util/token_deposit.h"
#include "common/util/util.h"
#include "tests/harness.h"

KVB_TEST(status_strings) {
    ck_assert_str_eq(kvb_status_str(KVB_OK), "ok");
    ck_assert_str_eq(kvb_status_str(KVB_ERR_NOMEM), "out of memory");
    ck_assert_str_eq(kvb_status_str((kvb_status)-999), "unknown status");
}
KVB_TEST_END

KVB_TEST(parse_id_list) {
    int32_t *ids = NULL;
    int n = 0;
    ck_assert_int_eq(kvb_parse_id_list("1,22,333", &ids, &n), KVB_OK);
    ck_assert_int_eq(n, 3);
    ck_assert_int_eq(ids[0], 1);
    ck_assert_int_eq(ids[2], 333);
    free(ids);
    const char *bad[] = {"", ",", "1,,2", "1,", "-1", "abc", "1 2", "99999999999"};
    for (size_t i = 0; i < KVB_ARRAY_LEN(bad); i++) ck_assert_int_eq(kvb_parse_id_list(bad[i], &ids, &n), KVB_ERR_INVALID);
}
KVB_TEST_END

KVB_TEST(half_roundtrip) {
    /* Every finite f16 survives f16 -> f32 -> f16; known values convert exactly. */
    for (uint32_t h = 0; h < 0x10000; h++) {
        if ((h & 0x7c00) == 0x7c00) continue;
        float f = kvb_f16_to_f32((uint16_t)h);
        ck_assert_uint_eq(kvb_f32_to_f16(f), h);
    }
    ck_assert_float_eq(kvb_f16_to_f32(0x3c00), 1.0f);
    ck_assert_float_eq(kvb_f16_to_f32(0xc000), -2.0f);
    ck_assert_float_eq(kvb_f16_to_f32(0x0001), ldexpf(1.0f, -24));
    ck_assert_float_eq(kvb_bf16_to_f32(0x3f80), 1.0f);
    ck_assert_uint_eq(kvb_f32_to_bf16(1.0f), 0x3f80);
    /* round to nearest even: 1 + 2^-8 lies halfway between bf16 1.0 and 1 + 2^-7 */
    ck_assert_uint_eq(kvb_f32_to_bf16(1.0f + ldexpf(1.0f, -8)), 0x3f80);
    ck_assert_uint_eq(kvb_f32_to_bf16(1.0f + 3 * ldexpf(1.0f, -8)), 0x3f82);
}
KVB_TEST_END

KVB_TEST(npy_header) {
    char path[] = "/tmp/kvb-npy-XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    close(fd);
    float data[6] = {1, 2, 3, 4, 5, 6};
    ck_assert_int_eq(kvb_npy_write_f32(path, data, 2, 3), KVB_OK);
    FILE *f = fopen(path, "rb");
    unsigned char hdr[10];
    ck_assert_uint_eq(fread(hdr, 1, 10, f), 10);
    int hlen = hdr[8] | hdr[9] << 8;
    ck_assert_int_eq((10 + hlen) % 64, 0);
    char dict[256] = {0};
    ck_assert_uint_eq(fread(dict, 1, (size_t)hlen, f), (size_t)hlen);
    ck_assert_ptr_nonnull(strstr(dict, "'shape': (2, 3)"));
    float back[6];
    ck_assert_uint_eq(fread(back, sizeof(float), 6, f), 6);
    ck_assert_float_eq(back[5], 6.0f);
    fclose(f);
    unlink(path);
}
KVB_TEST_END

KVB_TEST(json_fields) {
    json_t *j = NULL;
    const char *txt = "{\"a\": 3, \"b\": 2.5, \"c\": true, \"s\": \"x\", \"f\": 4.0}";
    ck_assert_int_eq(kvb_json_load_text(txt, strlen(txt), "t", &j), KVB_OK);
    int64_t v = -1;
    ck_assert_int_eq(kvb_json_get_int(j, "a", 1, 0, 10, "t", &v), KVB_OK);
    ck_assert_int_eq(v, 3);
    ck_assert_int_eq(kvb_json_get_int(j, "f", 1, 0, 10, "t", &v), KVB_OK);
    ck_assert_int_eq(v, 4);
    ck_assert_int_eq(kvb_json_get_int(j, "b", 1, 0, 10, "t", &v), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_json_get_int(j, "a", 1, 5, 10, "t", &v), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_json_get_int(j, "zz", 1, 0, 10, "t", &v), KVB_ERR_INVALID);
    v = 77;
    ck_assert_int_eq(kvb_json_get_int(j, "zz", 0, 0, 10, "t", &v), KVB_OK);
    ck_assert_int_eq(v, 77);
    int b = 0;
    ck_assert_int_eq(kvb_json_get_bool(j, "c", 1, "t", &b), KVB_OK);
    ck_assert_int_eq(b, 1);
    json_decref(j);
    ck_assert_int_eq(kvb_json_load_text("{\"a\": 1, \"a\": 2}", 16, "dup", &j), KVB_ERR_FORMAT);
    ck_assert_int_eq(kvb_json_load_text("{", 1, "trunc", &j), KVB_ERR_FORMAT);
}
KVB_TEST_END

/* ------------------------------------------------------------------------------------ node config */

/* A temporary directory holding config.json; `log` receives what the loader wrote to stderr. */
typedef struct node_fixture {
    char dir[64];
    char path[96];
    char log[8192];
} node_fixture;

static void fixture_init(node_fixture *f) {
    snprintf(f->dir, sizeof f->dir, "/tmp/kvb-nodecfg-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(f->dir));
    snprintf(f->path, sizeof f->path, "%s/config.json", f->dir);
    f->log[0] = '\0';
}

static void fixture_fini(node_fixture *f) {
    unlink(f->path);
    rmdir(f->dir);
}

/* Writes `text` as the fixture's config.json and loads it with stderr captured into f->log. */
static kvb_status load_text(node_fixture *f, const char *text, kvb_node_config **out) {
    FILE *cf = fopen(f->path, "w");
    ck_assert_ptr_nonnull(cf);
    ck_assert_int_eq(fputs(text, cf) >= 0, 1);
    fclose(cf);
    char logpath[128];
    snprintf(logpath, sizeof logpath, "%s/stderr.txt", f->dir);
    fflush(stderr);
    int saved = dup(2);
    int fd = open(logpath, O_CREAT | O_TRUNC | O_WRONLY, 0600);
    ck_assert_int_ge(fd, 0);
    dup2(fd, 2);
    close(fd);
    *out = NULL;
    kvb_status st = kvb_node_config_load(f->path, out);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    FILE *lf = fopen(logpath, "r");
    size_t n = fread(f->log, 1, sizeof f->log - 1, lf);
    f->log[n] = '\0';
    fclose(lf);
    unlink(logpath);
    return st;
}

KVB_TEST(node_config_defaults) {
    node_fixture f;
    fixture_init(&f);
    const char *txt = "{\"node\": \"n1\", \"_comment\": \"ignored silently\", \"colour\": \"blue\",\n"
                      " \"models\": [\n"
                      "  {\"name\": \"chat\", \"role\": \"master\", \"model_dir\": \"models/chat\", \"kv_mb\": 2},\n"
                      "  {\"name\": \"code-1\", \"role\": \"worker\", \"model_dir\": \"./m/../code/\", \"kv_mb\": 8,\n"
                      "   \"mkmodel\": \"--arch qwen3 --layers 3\", \"lsc\": \"stream\", \"block_size\": 8,\n"
                      "   \"endpoint\": \"tcp://127.0.0.1:5601\", \"threads\": 2, \"device\": 1,\n"
                      "   \"policy\": \"swiftcache\", \"max_seqs\": 4, \"max_batch_tokens\": 64, \"flavour\": 1}]}";
    kvb_node_config *c = NULL;
    ck_assert_int_eq(load_text(&f, txt, &c), KVB_OK);
    ck_assert_str_eq(c->path, f.path);
    ck_assert_str_eq(c->node, "n1");
    ck_assert_str_eq(c->run_dir, "/run/kvbank/n1");
    ck_assert_ptr_null(c->bin_dir);
    ck_assert_str_eq(c->coordinator, "ipc:///run/kvbank/n1/coordinator.sock");
    ck_assert_int_eq(c->heartbeat_ms, 500);
    ck_assert_int_eq(c->heartbeat_misses, 4);
    ck_assert_double_eq(c->lend_interval_s, 2.0);
    ck_assert_double_eq(c->window_s, 60.0);
    ck_assert_int_eq(c->n_models, 2);

    const kvb_node_model *m = kvb_node_config_master(c);
    ck_assert_ptr_eq(m, &c->models[0]);
    ck_assert_ptr_eq(kvb_node_config_model(c, "chat"), m);
    ck_assert_str_eq(kvb_role_str(m->role), "master");
    char want[160];
    snprintf(want, sizeof want, "%s/models/chat", f.dir);
    ck_assert_str_eq(m->model_dir, want);
    ck_assert_ptr_null(m->mkmodel);
    ck_assert_str_eq(m->backend, "cpu");
    ck_assert_int_eq(m->device, 0);
    ck_assert_int_eq(m->threads, 1);
    ck_assert_int_eq(m->kv_bytes, 2 << 20);
    ck_assert_int_eq(m->block_size, 16);
    ck_assert_str_eq(m->endpoint, "ipc:///run/kvbank/n1/chat.sock");
    ck_assert_str_eq(m->policy, "recompute");
    ck_assert_int_eq(m->max_batch_tokens, 512);
    ck_assert_int_eq(m->max_seqs, 64);
    ck_assert_int_eq(m->lsc_stream, 0);

    const kvb_node_model *w = kvb_node_config_model(c, "code-1");
    ck_assert_ptr_eq(w, &c->models[1]);
    ck_assert_str_eq(kvb_role_str(w->role), "worker");
    snprintf(want, sizeof want, "%s/m/../code", f.dir);
    ck_assert_str_eq(w->model_dir, want);
    ck_assert_str_eq(w->mkmodel, "--arch qwen3 --layers 3");
    ck_assert_int_eq(w->kv_bytes, 8 << 20);
    ck_assert_int_eq(w->block_size, 8);
    ck_assert_str_eq(w->endpoint, "tcp://127.0.0.1:5601");
    ck_assert_int_eq(w->threads, 2);
    ck_assert_int_eq(w->device, 1);
    ck_assert_str_eq(w->policy, "swiftcache");
    ck_assert_int_eq(w->max_seqs, 4);
    ck_assert_int_eq(w->max_batch_tokens, 64);
    ck_assert_int_eq(w->lsc_stream, 0); /* master only: ignored with a warning */
    ck_assert_ptr_null(kvb_node_config_model(c, "nobody"));

    char tag[64];
    kvb_node_region_tag(c, "code-1", tag, sizeof tag);
    ck_assert_str_eq(tag, "n1_code-1");
    kvb_node_region_tag(c, "code-1", tag, 4);
    ck_assert_str_eq(tag, "n1_");

    /* Unknown keys are warnings naming the key (and the model); "_..." keys are comments. */
    ck_assert_ptr_nonnull(strstr(f.log, "unknown field \"colour\""));
    ck_assert_ptr_nonnull(strstr(f.log, "model \"code-1\": unknown field \"flavour\""));
    ck_assert_ptr_nonnull(strstr(f.log, "model \"code-1\": field \"lsc\""));
    ck_assert_ptr_null(strstr(f.log, "_comment"));
    ck_assert_ptr_null(strstr(f.log, "error"));
    kvb_node_config_free(c);
    kvb_node_config_free(NULL);
    ck_assert_str_eq(kvb_role_str(KVB_ROLE_NONE), "none");
    fixture_fini(&f);
}
KVB_TEST_END

KVB_TEST(node_config_explicit) {
    node_fixture f;
    fixture_init(&f);
    /* Relative run_dir and bin_dir resolve against the config's directory like model_dir; the longest
     * names (node 16, model 23) make a 40-char region tag. */
    const char *txt = "{\"node\": \"N_23456789012345\", \"run_dir\": \"run/\", \"bin_dir\": \"/opt/kvbank/bin\",\n"
                      " \"coordinator\": {\"endpoint\": \"ipc:///tmp/kvb-explicit/c.sock\", \"heartbeat_ms\": 100,\n"
                      "   \"heartbeat_misses\": 3, \"lend_interval_s\": 0.5, \"window_s\": 5},\n"
                      " \"models\": [\n"
                      "  {\"name\": \"w\", \"role\": \"worker\", \"model_dir\": \"/abs/w\", \"kv_mb\": 1, \"lend\": false},\n"
                      "  {\"name\": \"M_23456789-123456789012\", \"role\": \"master\", \"model_dir\": \".\",\n"
                      "   \"kv_mb\": 3, \"lsc\": \"stream\", \"backend\": \"cuda\", \"link_preset\": \"h100-pcie5-scaled\"}]}";
    kvb_node_config *c = NULL;
    ck_assert_int_eq(load_text(&f, txt, &c), KVB_OK);
    char want[160];
    snprintf(want, sizeof want, "%s/run", f.dir);
    ck_assert_str_eq(c->run_dir, want);
    ck_assert_str_eq(c->bin_dir, "/opt/kvbank/bin");
    ck_assert_str_eq(c->coordinator, "ipc:///tmp/kvb-explicit/c.sock");
    ck_assert_int_eq(c->heartbeat_ms, 100);
    ck_assert_int_eq(c->heartbeat_misses, 3);
    ck_assert_double_eq(c->lend_interval_s, 0.5);
    ck_assert_double_eq(c->window_s, 5.0);
    ck_assert_str_eq(c->models[0].model_dir, "/abs/w");
    snprintf(want, sizeof want, "ipc://%s/run/w.sock", f.dir);
    ck_assert_str_eq(c->models[0].endpoint, want);
    const kvb_node_model *m = kvb_node_config_master(c);
    ck_assert_ptr_eq(m, &c->models[1]);
    ck_assert_str_eq(m->model_dir, f.dir);
    ck_assert_int_eq(m->lsc_stream, 1);
    ck_assert_int_eq(c->models[0].lend, 0); /* a worker that never lends */
    ck_assert_int_eq(m->lend, 1);           /* the default */
    ck_assert_str_eq(m->backend, "cuda");
    ck_assert_str_eq(m->link_preset, "h100-pcie5-scaled");
    ck_assert_ptr_null(c->models[0].link_preset); /* off by default */
    char tag[41];
    kvb_node_region_tag(c, m->name, tag, sizeof tag);
    ck_assert_str_eq(tag, "N_23456789012345_M_23456789-123456789012");
    ck_assert_int_eq(strlen(tag), 40);
    ck_assert_ptr_null(strstr(f.log, "warn"));
    kvb_node_config_free(c);
    fixture_fini(&f);
}
KVB_TEST_END

/* Each bad config is refused with KVB_ERR_INVALID and an error that names the model (when there is
 * one) and the field. */
KVB_TEST(node_config_invalid) {
#define M_OK "{\"name\": \"chat\", \"role\": \"master\", \"model_dir\": \"m\", \"kv_mb\": 2}"
#define W(extra) "{\"name\": \"code\", \"role\": \"worker\", \"model_dir\": \"c\", \"kv_mb\": 8" extra "}"
#define NODE(models) "{\"node\": \"n\", \"run_dir\": \"/tmp/r\", \"models\": [" models "]}"
    static const struct {
        const char *text;
        const char *log1, *log2; /* substrings the error must contain */
    } bad[] = {
        {"{\"models\": [" M_OK "]}", "missing field \"node\"", NULL},
        {"{\"node\": \"cpu-demo\", \"models\": [" M_OK "]}", "field \"node\" = \"cpu-demo\"", "[A-Za-z0-9_]"},
        {"{\"node\": \"n2345678901234567\", \"models\": [" M_OK "]}", "field \"node\"", "1..16"},
        {"{\"node\": 7, \"models\": [" M_OK "]}", "field \"node\" must be a string", NULL},
        {"{\"node\": \"n\"}", "field \"models\" must be a non-empty array", NULL},
        {"{\"node\": \"n\", \"models\": []}", "field \"models\" must be a non-empty array", NULL},
        {"[1, 2]", "must be a JSON object", NULL},
        {"{\"node\": \"n\", \"models\": [" M_OK "] ", "invalid JSON", NULL},
        {NODE(M_OK ", 5"), "models[1] must be an object", NULL},
        {NODE(M_OK ", {\"role\": \"worker\", \"model_dir\": \"c\", \"kv_mb\": 8}"), "models[1]: missing field \"name\"",
         NULL},
        {NODE(M_OK ", {\"name\": \"a.b\", \"role\": \"worker\", \"model_dir\": \"c\", \"kv_mb\": 8}"),
         "models[1]: field \"name\" = \"a.b\"", NULL},
        {NODE(M_OK ", {\"name\": \"w23456789012345678901234\", \"role\": \"worker\", \"model_dir\": \"c\", "
                   "\"kv_mb\": 8}"),
         "field \"name\" = \"w23456789012345678901234\"", "1..23"},
        {NODE(M_OK ", {\"name\": \"code\", \"role\": \"boss\", \"model_dir\": \"c\", \"kv_mb\": 8}"),
         "model \"code\": field \"role\" = \"boss\"", NULL},
        {NODE(M_OK ", {\"name\": \"code\", \"role\": \"worker\", \"kv_mb\": 8}"),
         "model \"code\": missing field \"model_dir\"", NULL},
        {NODE(M_OK ", {\"name\": \"code\", \"role\": \"worker\", \"model_dir\": \"c\"}"),
         "model \"code\": missing field \"kv_mb\"", NULL},
        {NODE(M_OK ", " W(", \"kv_mb\": 0")), NULL, NULL}, /* duplicate key: invalid JSON (checked below) */
        {NODE(M_OK ", {\"name\": \"code\", \"role\": \"worker\", \"model_dir\": \"c\", \"kv_mb\": 0}"),
         "model \"code\": field \"kv_mb\" = 0 is out of range", NULL},
        {NODE(M_OK ", {\"name\": \"code\", \"role\": \"worker\", \"model_dir\": \"c\", \"kv_mb\": -4}"),
         "model \"code\": field \"kv_mb\" = -4", NULL},
        {NODE(M_OK ", {\"name\": \"code\", \"role\": \"worker\", \"model_dir\": \"c\", \"kv_mb\": 1.5}"),
         "model \"code\": field \"kv_mb\" must be an integer", NULL},
        {NODE(M_OK ", " W(", \"block_size\": 0")), "model \"code\": field \"block_size\" = 0", NULL},
        {NODE(M_OK ", " W(", \"threads\": 0")), "model \"code\": field \"threads\" = 0", NULL},
        {NODE(M_OK ", " W(", \"max_seqs\": -1")), "model \"code\": field \"max_seqs\"", NULL},
        {NODE(M_OK ", " W(", \"max_batch_tokens\": 0")), "model \"code\": field \"max_batch_tokens\"", NULL},
        {NODE(M_OK ", " W(", \"model_dir\": \"\"")), NULL, NULL}, /* duplicate key again */
        {NODE(M_OK ", " W(", \"policy\": \"\"")), "model \"code\": field \"policy\" must not be empty", NULL},
        {NODE(M_OK ", " W(", \"link_preset\": \"\"")), "model \"code\": field \"link_preset\" must not be empty", NULL},
        {NODE(M_OK ", " W(", \"link_preset\": 5")), "model \"code\": field \"link_preset\"", NULL},
        {NODE(M_OK ", " W(", \"mkmodel\": \"--arch 'llama'\"")), "model \"code\": field \"mkmodel\"", NULL},
        {NODE(M_OK ", " W(", \"mkmodel\": 3")), "model \"code\": field \"mkmodel\" must be a string", NULL},
        {NODE(M_OK ", " W(", \"lsc\": \"fast\"")), "model \"code\": field \"lsc\" = \"fast\"", NULL},
        {NODE(M_OK ", " W(", \"endpoint\": \"ipc://rel.sock\"")), "model \"code\": field \"endpoint\"",
         "absolute path"},
        {NODE(M_OK ", " W(", \"endpoint\": \"inproc://x\"")), "model \"code\": field \"endpoint\" = \"inproc://x\"",
         NULL},
        {NODE(M_OK ", " W(", \"endpoint\": \"ipc:///tmp/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
                         "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa.sock\"")),
         "model \"code\": field \"endpoint\"", "Unix socket"},
        {NODE(M_OK ", " W(", \"endpoint\": \"ipc:///tmp/r/chat.sock\"")),
         "model \"code\": field \"endpoint\" = \"ipc:///tmp/r/chat.sock\" is already the endpoint of model \"chat\"",
         NULL},
        {NODE(M_OK ", " W(", \"endpoint\": \"ipc:///tmp/r/coordinator.sock\"")),
         "model \"code\": field \"endpoint\"", "is the coordinator's endpoint"},
        {NODE(M_OK ", " W("") ", " W("")), "models[2]: field \"name\" = \"code\" is already the name of models[1]",
         NULL},
        {NODE(W("")), "no model has \"role\": \"master\"", NULL},
        {NODE(M_OK ", {\"name\": \"chat2\", \"role\": \"master\", \"model_dir\": \"m2\", \"kv_mb\": 2}"),
         "model \"chat2\": field \"role\": a second master", "\"chat\""},
        {"{\"node\": \"n\", \"coordinator\": {\"heartbeat_ms\": 0}, \"models\": [" M_OK "]}",
         "coordinator: field \"heartbeat_ms\" = 0", NULL},
        {"{\"node\": \"n\", \"coordinator\": {\"lend_interval_s\": 0}, \"models\": [" M_OK "]}",
         "coordinator: field \"lend_interval_s\"", NULL},
        {"{\"node\": \"n\", \"coordinator\": {\"window_s\": -1}, \"models\": [" M_OK "]}",
         "coordinator: field \"window_s\"", NULL},
        {"{\"node\": \"n\", \"coordinator\": {\"heartbeat_misses\": 0}, \"models\": [" M_OK "]}",
         "coordinator: field \"heartbeat_misses\"", NULL},
        {"{\"node\": \"n\", \"coordinator\": {\"endpoint\": \"udp://x\"}, \"models\": [" M_OK "]}",
         "coordinator: field \"endpoint\" = \"udp://x\"", NULL},
        {"{\"node\": \"n\", \"coordinator\": {\"endpoint\": \"tcp://127.0.0.1:5600\"}, \"models\": [" M_OK "]}",
         "the coordinator listens on ipc:// only", NULL},
        {"{\"node\": \"n\", \"coordinator\": [], \"models\": [" M_OK "]}", "field \"coordinator\" must be an object",
         NULL},
        {"{\"node\": \"n\", \"run_dir\": \"\", \"models\": [" M_OK "]}", "field \"run_dir\" must not be empty", NULL},
        /* a lending worker whose KV memory is of another kind than the master's: both named */
        {NODE(M_OK ", " W(", \"backend\": \"cuda\", \"device\": 1")),
         "model \"code\" (backend \"cuda\") and model \"chat\" (backend \"cpu\") cannot lend to each other",
         "different kinds"},
        {NODE(M_OK ", " W(", \"policy_params\": [1]")), "model \"code\": field \"policy_params\" must be an object",
         NULL},
        {NODE(M_OK ", " W(", \"policy_params\": {\"lsc\": [\"stream\"]}")),
         "policy_params.lsc must be a string, a number or a boolean", NULL},
    };
    node_fixture f;
    fixture_init(&f);
    for (size_t i = 0; i < KVB_ARRAY_LEN(bad); i++) {
        kvb_node_config *c = (kvb_node_config *)1;
        kvb_status st = load_text(&f, bad[i].text, &c);
        if (!bad[i].log1) {
            ck_assert_msg(st == KVB_ERR_FORMAT, "case %zu: status %d, log: %s", i, st, f.log);
            ck_assert_ptr_nonnull(strstr(f.log, "duplicate object key"));
        } else {
            ck_assert_msg(st == KVB_ERR_INVALID || (st == KVB_ERR_FORMAT && strstr(bad[i].log1, "JSON")),
                          "case %zu: status %d, log: %s", i, st, f.log);
            ck_assert_msg(strstr(f.log, bad[i].log1) != NULL, "case %zu: want \"%s\" in: %s", i, bad[i].log1, f.log);
            ck_assert_msg(!bad[i].log2 || strstr(f.log, bad[i].log2), "case %zu: want \"%s\" in: %s", i, bad[i].log2,
                          f.log);
        }
        ck_assert_ptr_null(c);
    }
    /* the same kind (variants of one backend), or a worker that never lends, are fine */
    static const char *const good[] = {
        "{\"node\": \"n\", \"models\": [{\"name\": \"chat\", \"role\": \"master\", \"model_dir\": \"m\", \"kv_mb\": 2, "
        "\"backend\": \"cuda\"}, " W(", \"backend\": \"cuda:f32\", \"device\": 1") "]}",
        NODE(M_OK ", " W(", \"backend\": \"cuda\", \"lend\": false")),
    };
    for (size_t i = 0; i < KVB_ARRAY_LEN(good); i++) {
        kvb_node_config *ok = NULL;
        ck_assert_msg(load_text(&f, good[i], &ok) == KVB_OK, "good case %zu refused: %s", i, f.log);
        kvb_node_config_free(ok);
    }
    fixture_fini(&f);
    kvb_node_config *c = NULL;
    ck_assert_int_eq(kvb_node_config_load("/nonexistent/kvbank/node.json", &c), KVB_ERR_NOT_FOUND);
    ck_assert_ptr_null(c);
#undef M_OK
#undef W
#undef NODE
}
KVB_TEST_END

KVB_TEST(node_config_policy_params) {
    node_fixture f;
    fixture_init(&f);
    const char *txt = "{\"node\": \"n\", \"models\": [{\"name\": \"chat\", \"role\": \"master\", \"model_dir\": \"m\", "
                      "\"kv_mb\": 2, \"policy\": \"swiftcache\", \"policy_params\": {\"lsc\": \"stream\", "
                      "\"window_s\": 30, \"ratio\": 0.25, \"deposit\": true}}]}";
    kvb_node_config *c = NULL;
    ck_assert_msg(load_text(&f, txt, &c) == KVB_OK, "%s", f.log);
    const kvb_node_model *m = kvb_node_config_master(c);
    ck_assert_int_eq(m->n_policy_params, 4);
    const char *want[][2] = {{"lsc", "stream"}, {"window_s", "30"}, {"ratio", "0.25"}, {"deposit", "true"}};
    for (int i = 0; i < 4; i++) {
        ck_assert_str_eq(m->policy_keys[i], want[i][0]);
        ck_assert_str_eq(m->policy_values[i], want[i][1]);
    }
    kvb_node_config_free(c);
    fixture_fini(&f);
}
KVB_TEST_END

KVB_TEST(token_deposit) {
    /* OrbitFlow §3.2: tokens generated faster than the SLO are held and released one per interval. */
    const uint64_t slo = 10;
    uint64_t d[5];
    const uint64_t burst[5] = {0, 1, 2, 3, 100};
    ck_assert_int_eq(kvb_deposit_schedule(burst, 5, slo, 0, d), 0);
    const uint64_t want[5] = {0, 10, 20, 30, 100};
    for (int i = 0; i < 5; i++) ck_assert_uint_eq(d[i], want[i]);
    ck_assert_int_eq(kvb_deposit_level(burst, d, 5, 5), 3);  /* 1, 2, 3 generated, not delivered */
    ck_assert_int_eq(kvb_deposit_level(burst, d, 5, 30), 0); /* token 3 leaves at 30 */
    ck_assert_int_eq(kvb_deposit_level(burst, d, 5, 29), 1);
    /* slower than the SLO: nothing is held, each token leaves when generated */
    const uint64_t slow[4] = {0, 15, 40, 41};
    kvb_deposit_schedule(slow, 4, slo, 0, d);
    ck_assert_uint_eq(d[1], 15);
    ck_assert_uint_eq(d[2], 40);
    ck_assert_uint_eq(d[3], 50); /* 41 came 1 after 40: held until 40 + 10 */
    /* finish at 15: what is still held leaves at once */
    ck_assert_int_eq(kvb_deposit_schedule(burst, 4, slo, 15, d), 2);
    ck_assert_uint_eq(d[1], 10);
    ck_assert_uint_eq(d[2], 15);
    ck_assert_uint_eq(d[3], 15);
    /* the first token is never held; slo 0 never holds */
    ck_assert_uint_eq(kvb_deposit_next(1, 999, 5, slo), 5);
    ck_assert_uint_eq(kvb_deposit_next(0, 5, 7, 0), 7);
}
KVB_TEST_END

/* SHA-256 against FIPS 180-4's examples (and lengths around the padding boundary, from Python's
 * hashlib), HMAC-SHA-256 against RFC 4231 (cases 1, 2 and 6: a key longer than a block). */
static void hex_of(const uint8_t *d, char out[65]) { kvb_hex(d, KVB_SHA256_BYTES, out); }

KVB_TEST(sha256_vectors) {
    uint8_t d[KVB_SHA256_BYTES];
    char hx[65];
    struct { const char *msg; const char *want; } v[] = {
        {"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
        {"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"},
        {"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
         "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"},
    };
    for (size_t i = 0; i < KVB_ARRAY_LEN(v); i++) {
        kvb_sha256_digest(v[i].msg, strlen(v[i].msg), d);
        hex_of(d, hx);
        ck_assert_str_eq(hx, v[i].want);
    }
    const char *xs[] = {"d5e285683cd4efc02d021a5c62014694958901005d6f71e89e0989fac77e4072",  /* 55 x */
                        "04c26261370ee7541549d16dee320c723e3fd14671e66a099afe0a377c16888e",  /* 56 x */
                        "7ce100971f64e7001e8fe5a51973ecdfe1ced42befe7ee8d5fd6219506b5393c"}; /* 64 x */
    const size_t xn[] = {55, 56, 64};
    char xbuf[64];
    memset(xbuf, 'x', sizeof xbuf);
    for (int i = 0; i < 3; i++) {
        kvb_sha256_digest(xbuf, xn[i], d);
        hex_of(d, hx);
        ck_assert_str_eq(hx, xs[i]);
    }
    /* a million 'a' fed in uneven pieces */
    kvb_sha256 s;
    kvb_sha256_init(&s);
    char a[997];
    memset(a, 'a', sizeof a);
    size_t left = 1000000;
    while (left) {
        size_t n = left < sizeof a ? left : sizeof a;
        kvb_sha256_update(&s, a, n);
        left -= n;
    }
    kvb_sha256_final(&s, d);
    hex_of(d, hx);
    ck_assert_str_eq(hx, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");

    uint8_t k1[20];
    memset(k1, 0x0b, sizeof k1);
    kvb_hmac_sha256(k1, sizeof k1, "Hi There", 8, d);
    hex_of(d, hx);
    ck_assert_str_eq(hx, "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
    const char *m2 = "what do ya want for nothing?";
    kvb_hmac_sha256("Jefe", 4, m2, strlen(m2), d);
    hex_of(d, hx);
    ck_assert_str_eq(hx, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
    uint8_t k6[131];
    memset(k6, 0xaa, sizeof k6);
    const char *m6 = "Test Using Larger Than Block-Size Key - Hash Key First";
    kvb_hmac_sha256(k6, sizeof k6, m6, strlen(m6), d);
    hex_of(d, hx);
    ck_assert_str_eq(hx, "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
    ck_assert_int_eq(kvb_memcmp_ct("abc", "abc", 3), 0);
    ck_assert_int_ne(kvb_memcmp_ct("abc", "abd", 3), 0);
}
KVB_TEST_END

/* Files a model directory holds must be regular files: a FIFO named config.json, model.safetensors or
 * tokenizer.json blocked open() forever (kvbankd --check-config and the loader hung; this test's hang
 * limit fails that). A FIFO, a directory and /dev/null are refused at once; a symbolic link to a
 * regular file (Hugging Face's cache layout) is followed. */
KVB_TEST(open_regular_only) {
    char dir[] = "/tmp/kvb-reg-XXXXXX", path[512], link[512];
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/fifo.json", dir);
    ck_assert_int_eq(mkfifo(path, 0600), 0);
    int fd = -1;
    ck_assert_int_eq(kvb_open_regular(path, &fd), KVB_ERR_FORMAT);
    ck_assert_int_eq(fd, -1);
    json_t *j = NULL;
    ck_assert_int_eq(kvb_json_load_file(path, &j), KVB_ERR_FORMAT);
    char *buf = NULL;
    size_t len = 0;
    ck_assert_int_eq(kvb_read_file(path, 1 << 20, &buf, &len), KVB_ERR_FORMAT);
    unlink(path);
    ck_assert_int_eq(kvb_open_regular(dir, &fd), KVB_ERR_FORMAT);
    ck_assert_int_eq(kvb_open_regular("/dev/null", &fd), KVB_ERR_FORMAT);
    ck_assert_int_eq(kvb_open_regular(path, &fd), KVB_ERR_NOT_FOUND);
    /* a regular file, directly and through a symbolic link; blocking reads after the open */
    snprintf(path, sizeof path, "%s/real.json", dir);
    FILE *f = fopen(path, "w");
    fputs("{\"a\": [1, 2]}", f);
    fclose(f);
    snprintf(link, sizeof link, "%s/link.json", dir);
    ck_assert_int_eq(symlink(path, link), 0);
    ck_assert_int_eq(kvb_open_regular(link, &fd), KVB_OK);
    ck_assert_int_eq(fcntl(fd, F_GETFL) & O_NONBLOCK, 0);
    close(fd);
    ck_assert_int_eq(kvb_json_load_file(link, &j), KVB_OK);
    ck_assert_int_eq(json_array_size(json_object_get(j, "a")), 2);
    json_decref(j);
    ck_assert_int_eq(kvb_read_file(link, 1 << 20, &buf, &len), KVB_OK);
    ck_assert_uint_eq(len, 13);
    ck_assert_str_eq(buf, "{\"a\": [1, 2]}");
    free(buf);
    ck_assert_int_eq(kvb_read_file(link, 12, &buf, &len), KVB_ERR_FORMAT); /* larger than max */
    unlink(link);
    unlink(path);
    rmdir(dir);
}
KVB_TEST_END

/* Repeated log lines: a call site prints `burst` lines per window, then one line saying how many it
 * did not print; another site is counted apart. */
static void log_site_a(int i) { KVB_LOG_W("site a says %d", i); }
static void log_site_b(int i) { KVB_LOG_W("site b says %d", i); }
KVB_TEST(log_rate_limit) {
    char path[] = "/tmp/kvb-log-XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    int saved = dup(2);
    dup2(fd, 2);
    kvb_log_set_rate(3, 300);
    for (int i = 0; i < 10; i++) log_site_a(i);
    log_site_b(0);
    usleep(400 * 1000);
    log_site_a(10);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    kvb_log_set_rate(20, 10000);
    char buf[4096] = "";
    ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
    close(fd);
    unlink(path);
    ck_assert_int_gt(n, 0);
    int a = 0;
    for (const char *p = buf; (p = strstr(p, "] site a says")); p++) a++;
    ck_assert_msg(a == 4, "site a printed %d lines (3, then 1 in the next window):\n%s", a, buf);
    ck_assert_ptr_nonnull(strstr(buf, "site a says 2"));
    ck_assert_ptr_null(strstr(buf, "site a says 3\n"));
    ck_assert_ptr_nonnull(strstr(buf, "site a says 10"));
    ck_assert_ptr_nonnull(strstr(buf, "(7 more lines like \"site a says %d\" were not logged"));
    ck_assert_ptr_nonnull(strstr(buf, "site b says 0"));
}
KVB_TEST_END

/* The runner (tests/harness.h): a test that cannot run here is skipped, and a suite that skipped one
 * reports SKIP (77), never a pass; a failure still fails the suite. */
KVB_TEST(harness_inner_pass) { ck_assert_int_eq(1, 1); }
KVB_TEST_END

KVB_TEST(harness_inner_fail) { ck_assert_int_eq(1, 2); }
KVB_TEST_END

static const char *never_here(void) { return "this machine never has it"; }
static const char *always_here(void) { return NULL; }

KVB_TEST(harness_skip) {
    char *argv[] = {"inner", NULL};
    const kvb_test pass[] = {KVB_T(harness_inner_pass, 10), KVB_T_NEED(harness_inner_pass, 10, always_here)};
    const kvb_test skip[] = {KVB_T(harness_inner_pass, 10), KVB_T_NEED(harness_inner_fail, 10, never_here)};
    const kvb_test fail[] = {KVB_T(harness_inner_fail, 10), KVB_T_NEED(harness_inner_pass, 10, never_here)};
    ck_assert_int_eq(kvb_test_main(1, argv, "inner", pass, 2), 0);
    ck_assert_int_eq(kvb_test_main(1, argv, "inner", skip, 2), 77);
    ck_assert_int_eq(kvb_test_main(1, argv, "inner", fail, 2), 1);
}
KVB_TEST_END

KVB_TEST_MAIN("util", KVB_T(status_strings, 10), KVB_T(parse_id_list, 10), KVB_T(half_roundtrip, 30),
              KVB_T(npy_header, 10), KVB_T(json_fields, 10), KVB_T(node_config_defaults, 10),
              KVB_T(node_config_explicit, 10), KVB_T(node_config_invalid, 20), KVB_T(node_config_policy_params, 10), KVB_T(token_deposit, 10), KVB_T(sha256_vectors, 10), KVB_T(log_rate_limit, 10),
              KVB_T(harness_skip, 30), KVB_T(open_regular_only, 10))
