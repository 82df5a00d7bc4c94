/* Tests of kvbankctl as a real process against the test's own kvbank-coordinator and fake models
 * (tests/coordtest.h): control, status (text and JSON), plan, generate, and its command line. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <jansson.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include "common/ipc/auth.h"
#include "common/ipc/client.h"
#include "common/ipc/node_client.h"
#include "common/ipc/wire.h"
#include "common/kv/block_pool.h"
#include "common/mem/region.h"
#include "coordinator/coordinator.h"
#include "coordinator/ledger.h"
#include "tests/harness.h"
#include "tests/testfiles.h"
#include "tests/testproc.h"
#include "tests/coordtest.h"

/* Control messages through kvbankctl: lend asks the worker, drain revokes, reclaim runs the flow. */
KVB_TEST(ctl_control) {
    make_dir();
    start_coordinator();
    peer m, w;
    peer_open(&m, "m");
    peer_open(&w, "w");
    peer_register(&m, KVB_ROLE_MASTER, &G_M, 64);
    keep_alive(&m);
    peer_register(&w, KVB_ROLE_WORKER, &G_A, 64);
    keep_alive(&w);
    char out[4096], err[4096];
    const char *lend_argv[] = {"kvbankctl", "--coordinator", g_endpoint, "lend", "w", "8", NULL};
    ck_assert_int_eq(run_tool(lend_argv, out, sizeof out, err, sizeof err), 0);
    ck_assert_ptr_nonnull(strstr(out, "ok"));
    Kvbank__Envelope *e = peer_expect(&w, KVBANK__ENVELOPE__BODY_LEND_REQUEST, 10000, "lend request");
    ck_assert_uint_eq(e->lend_request->n_blocks, 8);
    ck_assert(!e->lend_request->drain);
    kvbank__envelope__free_unpacked(e, NULL);
    uint64_t id = lend_flow(&m, &w, 56, 8);
    /* refusals: exit 1 with the reason */
    const char *bad_argv[] = {"kvbankctl", "--coordinator", g_endpoint, "lend", "m", "8", NULL};
    ck_assert_int_eq(run_tool(bad_argv, out, sizeof out, err, sizeof err), 1);
    ck_assert_msg(strstr(err, "not a worker") != NULL, "stderr: %s", err);
    const char *nosuch_argv[] = {"kvbankctl", "--coordinator", g_endpoint, "reclaim", "nosuch", "4", NULL};
    ck_assert_int_eq(run_tool(nosuch_argv, out, sizeof out, err, sizeof err), 1);
    /* reclaim by hand: the master gets the Revoke (all 8 blocks: one block back would be one MEU, the
     * front of the loan) */
    const char *rec_argv[] = {"kvbankctl", "--coordinator", g_endpoint, "reclaim", "w", "8", NULL};
    ck_assert_int_eq(run_tool(rec_argv, out, sizeof out, err, sizeof err), 0);
    e = peer_expect(&m, KVBANK__ENVELOPE__BODY_REVOKE, 10000, "revoke");
    ck_assert_uint_eq(e->revoke->loan_id, id);
    kvbank__envelope__free_unpacked(e, NULL);
    send_revoke_ack(&m, id, 0);
    e = peer_expect(&w, KVBANK__ENVELOPE__BODY_RECLAIMED, 10000, "reclaimed");
    kvbank__envelope__free_unpacked(e, NULL);
    /* drain the worker: told so, its loan revoked, further offers refused */
    id = lend_flow(&m, &w, 56, 8);
    const char *drain_argv[] = {"kvbankctl", "--coordinator", g_endpoint, "drain", "w", NULL};
    ck_assert_int_eq(run_tool(drain_argv, out, sizeof out, err, sizeof err), 0);
    e = peer_expect(&w, KVBANK__ENVELOPE__BODY_LEND_REQUEST, 10000, "drain");
    ck_assert(e->lend_request->drain);
    kvbank__envelope__free_unpacked(e, NULL);
    e = peer_expect(&m, KVBANK__ENVELOPE__BODY_REVOKE, 10000, "revoke on drain");
    ck_assert_uint_eq(e->revoke->loan_id, id);
    kvbank__envelope__free_unpacked(e, NULL);
    send_offer(&w, 48, 8);
    e = peer_expect(&w, KVBANK__ENVELOPE__BODY_LEND_RESULT, 10000, "offer while draining");
    ck_assert(!e->lend_result->accepted);
    kvbank__envelope__free_unpacked(e, NULL);
    /* usage errors: 2 */
    const char *u1[] = {"kvbankctl", "--coordinator", g_endpoint, "lend", "w", NULL};
    ck_assert_int_eq(run_tool(u1, NULL, 0, err, sizeof err), 2);
    const char *u2[] = {"kvbankctl", "--coordinator", g_endpoint, "lend", "w", "0", NULL};
    ck_assert_int_eq(run_tool(u2, NULL, 0, err, sizeof err), 2);
    const char *u3[] = {"kvbankctl", "frobnicate", NULL};
    ck_assert_int_eq(run_tool(u3, NULL, 0, err, sizeof err), 2);
    const char *u4[] = {"kvbankctl", "status", NULL};
    ck_assert_int_eq(run_tool(u4, NULL, 0, err, sizeof err), 2);
    const char *help[] = {"kvbankctl", "--help", NULL};
    ck_assert_int_eq(run_tool(help, out, sizeof out, NULL, 0), 0);
    ck_assert_ptr_nonnull(strstr(out, "plan"));
    peer_close(&m);
    peer_close(&w);
    teardown();
    /* no coordinator: a clear error at once (no socket file), exit 1 */
    make_dir();
    const char *none[] = {"kvbankctl", "--coordinator", g_endpoint, "--timeout-ms", "300", "status", NULL};
    uint64_t t0 = kvb_now_ns();
    ck_assert_int_eq(run_tool(none, NULL, 0, err, sizeof err), 1);
    ck_assert_msg(strstr(err, "no such socket (is it running?)") != NULL, "stderr: %s", err);
    ck_assert_uint_lt(kvb_now_ns() - t0, 5000000000ull);
    kvb_t_remove_tree(g_dir);
}
KVB_TEST_END

static json_int_t jint(json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    ck_assert_msg(json_is_integer(v), "field %s is not an integer", key);
    return json_integer_value(v);
}

static json_t *model_json(json_t *models, const char *name) {
    size_t i;
    json_t *m;
    json_array_foreach(models, i, m) {
        if (!strcmp(json_string_value(json_object_get(m, "name")), name)) return m;
    }
    ck_abort_msg("no model %s in the status", name);
    return NULL;
}

KVB_TEST(ctl_status_json) {
    make_dir();
    start_coordinator();
    peer m, w;
    peer_open(&m, "m");
    peer_open(&w, "w");
    peer_register(&m, KVB_ROLE_MASTER, &G_M, 64);
    keep_alive(&m);
    peer_register(&w, KVB_ROLE_WORKER, &G_A, 64);
    keep_alive(&w);
    lend_flow(&m, &w, 48, 16);
    heartbeat_alive();
    static char out[65536];
    char err[4096];
    const char *argv[] = {"kvbankctl", "--coordinator", g_endpoint, "status", "--json", NULL};
    ck_assert_int_eq(run_tool(argv, out, sizeof out, err, sizeof err), 0);
    json_error_t je;
    json_t *j = json_loads(out, 0, &je);
    ck_assert_msg(j != NULL, "status --json is not JSON (%s): %s", je.text, out);
    ck_assert(json_is_string(json_object_get(j, "coordinator_id")));
    ck_assert_int_gt(jint(j, "epoch"), 0);
    ck_assert_int_eq(jint(j, "dropped_messages"), 0);
    json_t *models = json_object_get(j, "models");
    ck_assert(json_is_array(models));
    ck_assert_uint_eq(json_array_size(models), 2);
    json_t *jm = model_json(models, "m"), *jw = model_json(models, "w");
    ck_assert_str_eq(json_string_value(json_object_get(jm, "role")), "master");
    ck_assert_str_eq(json_string_value(json_object_get(jw, "role")), "worker");
    ck_assert(json_is_true(json_object_get(jw, "alive")));
    ck_assert_int_eq(jint(jw, "pid"), getpid());
    ck_assert_int_eq(jint(jw, "n_lent"), 16);
    ck_assert_int_eq(jint(jm, "n_borrowed"), 4);
    ck_assert_int_eq(jint(jw, "meu"), 4);
    ck_assert_int_eq(jint(jw, "meu_master"), 1);
    ck_assert_int_eq(jint(jw, "capacity"), 64);
    ck_assert_int_eq(jint(json_object_get(jw, "geom"), "n_layers"), 2);
    json_decref(j);
    /* the table names every model and the MEU */
    const char *targv[] = {"kvbankctl", "--coordinator", g_endpoint, "status", NULL};
    ck_assert_int_eq(run_tool(targv, out, sizeof out, err, sizeof err), 0);
    ck_assert_ptr_nonnull(strstr(out, "MEU"));
    ck_assert_ptr_nonnull(strstr(out, "4:1"));
    ck_assert_ptr_nonnull(strstr(out, "master"));
    /* the ledger */
    const char *largv[] = {"kvbankctl", "--coordinator", g_endpoint, "ledger", "--json", NULL};
    ck_assert_int_eq(run_tool(largv, out, sizeof out, err, sizeof err), 0);
    j = json_loads(out, 0, &je);
    ck_assert_msg(j != NULL, "ledger --json is not JSON (%s): %s", je.text, out);
    json_t *loans = json_object_get(j, "loans");
    ck_assert_uint_eq(json_array_size(loans), 1);
    json_t *l0 = json_array_get(loans, 0);
    ck_assert_str_eq(json_string_value(json_object_get(l0, "lender")), "w");
    ck_assert_int_eq(jint(l0, "first_block"), 48);
    ck_assert_int_eq(jint(l0, "n_blocks"), 16);
    ck_assert_int_eq(jint(l0, "n_master_blocks"), 4);
    ck_assert_int_eq(jint(l0, "offset"), 48 * 4096);
    json_decref(j);
    peer_close(&m);
    peer_close(&w);
    teardown();
}
KVB_TEST_END

static void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    ck_assert_msg(f != NULL, "%s: %s", path, strerror(errno));
    fputs(text, f);
    fclose(f);
}

static void write_model(const char *name, int layers, int kv_heads, int head_dim) {
    char dir[256], path[300], text[1024];
    snprintf(dir, sizeof dir, "%s/%s", g_dir, name);
    ck_assert_int_eq(mkdir(dir, 0700), 0);
    snprintf(path, sizeof path, "%s/config.json", dir);
    snprintf(text, sizeof text,
             "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\", \"num_hidden_layers\": %d,"
             " \"hidden_size\": %d, \"num_attention_heads\": %d, \"num_key_value_heads\": %d, \"head_dim\": %d,"
             " \"intermediate_size\": 64, \"vocab_size\": 128, \"max_position_embeddings\": 4096,"
             " \"rms_norm_eps\": 1e-5, \"eos_token_id\": 1, \"torch_dtype\": \"float32\"}",
             layers, 4 * kv_heads * head_dim, 4 * kv_heads, kv_heads, head_dim);
    write_file(path, text);
}

/* kvbankctl plan reproduces numbers computed by hand (see the comments). */
KVB_TEST(ctl_plan) {
    make_dir();
    /* master: 4 layers, 2 kv heads, head dim 16, 16 tokens/block, 4 B: M_block = 2*16*2*16*4 = 4096,
     * block 16384; 1 MiB -> K_master = 256 single-layer blocks.
     * a: 2 layers, 2 kv heads, head dim 8, 16 tokens: block 4096; 1 MiB -> K_a = 2^20 / 16384 = 64;
     *    MEU lcm(16384, 4096) = 16384 -> 4 worker : 1 master; 256 blocks -> 64 master blocks lendable.
     * b: 3 layers, 1 kv head, head dim 16, 8 tokens: block 3072; 2 MiB -> K_b = 128; MEU lcm = 49152 ->
     *    16 : 3; 682 blocks -> 42 units -> 126 master blocks lendable.
     * Eq. 4 N_LSC = min(192, 256) = 192; Eq. 5 N_RC = (256 - 192) / 4 = 16;
     * without lending 256 / 4 * 16 = 1024 tokens; paper (192 + 16) * 16 = 3328; in place
     * (64 + 192) * 16 = 4096. */
    write_model("mm", 4, 2, 16);
    write_model("ma", 2, 2, 8);
    write_model("mb", 3, 1, 16);
    char cfg[256], text[2048];
    snprintf(cfg, sizeof cfg, "%s/node.json", g_dir);
    snprintf(text, sizeof text,
             "{\"node\": \"plan\", \"run_dir\": \"%s/run\",\n"
             " \"coordinator\": {\"endpoint\": \"%s\"},\n"
             " \"models\": [\n"
             "  {\"name\": \"chat\", \"role\": \"master\", \"model_dir\": \"mm\", \"kv_mb\": 1, \"block_size\": 16},\n"
             "  {\"name\": \"a\", \"role\": \"worker\", \"model_dir\": \"ma\", \"kv_mb\": 1, \"block_size\": 16},\n"
             "  {\"name\": \"b\", \"role\": \"worker\", \"model_dir\": \"mb\", \"kv_mb\": 2, \"block_size\": 8}\n"
             " ]}\n",
             g_dir, g_endpoint);
    write_file(cfg, text);
    static char out[65536];
    char err[4096];
    const char *argv[] = {"kvbankctl", "plan", "--config", cfg, "--json", NULL};
    int rc = run_tool(argv, out, sizeof out, err, sizeof err);
    ck_assert_msg(rc == 0, "plan exited %d: %s", rc, err);
    json_error_t je;
    json_t *j = json_loads(out, 0, &je);
    ck_assert_msg(j != NULL, "plan --json is not JSON (%s): %s", je.text, out);
    json_t *p = json_object_get(j, "plan");
    ck_assert_int_eq(jint(p, "m_block"), 4096);
    ck_assert_int_eq(jint(p, "k_master"), 256);
    ck_assert_int_eq(jint(p, "k_workers"), 192);
    ck_assert_int_eq(jint(p, "n_lsc"), 192);
    ck_assert_int_eq(jint(p, "n_rc"), 16);
    ck_assert_int_eq(jint(p, "no_lending_tokens"), 1024);
    ck_assert_int_eq(jint(p, "paper_max_ctx_tokens"), 3328);
    ck_assert_int_eq(jint(p, "inplace_tokens"), 4096);
    ck_assert_int_eq(jint(j, "master_block_bytes"), 16384);
    json_t *ws = json_object_get(j, "workers");
    ck_assert_uint_eq(json_array_size(ws), 2);
    json_t *a = json_array_get(ws, 0), *b = json_array_get(ws, 1);
    ck_assert_str_eq(json_string_value(json_object_get(a, "name")), "a");
    ck_assert_int_eq(jint(a, "block_bytes"), 4096);
    ck_assert_int_eq(jint(a, "meu_worker"), 4);
    ck_assert_int_eq(jint(a, "meu_master"), 1);
    ck_assert_int_eq(jint(a, "k_i"), 64);
    ck_assert_int_eq(jint(a, "lendable_master_blocks"), 64);
    ck_assert_int_eq(jint(b, "block_bytes"), 3072);
    ck_assert_int_eq(jint(b, "meu_worker"), 16);
    ck_assert_int_eq(jint(b, "meu_master"), 3);
    ck_assert_int_eq(jint(b, "lcm_bytes"), 49152);
    ck_assert_int_eq(jint(b, "k_i"), 128);
    ck_assert_int_eq(jint(b, "blocks"), 682);
    ck_assert_int_eq(jint(b, "lendable_master_blocks"), 126);
    json_decref(j);
    /* the text form: the same numbers, the global --config works too */
    const char *targv[] = {"kvbankctl", "--config", cfg, "plan", NULL};
    ck_assert_int_eq(run_tool(targv, out, sizeof out, err, sizeof err), 0);
    ck_assert_ptr_nonnull(strstr(out, "N_LSC    = 192"));
    ck_assert_ptr_nonnull(strstr(out, "N_RC     = 16"));
    ck_assert_ptr_nonnull(strstr(out, "3328 tokens"));
    ck_assert_ptr_nonnull(strstr(out, "4096 tokens"));
    ck_assert_ptr_nonnull(strstr(out, "16:3"));
    /* a config without a readable model: exit 1 */
    const char *missing[] = {"kvbankctl", "plan", "--config", "/nonexistent/node.json", NULL};
    ck_assert_int_eq(run_tool(missing, NULL, 0, err, sizeof err), 1);
    kvb_t_remove_tree(g_dir);
}
KVB_TEST_END

/* kvbankctl generate finds a model's endpoint in the status and streams its tokens: a real model
 * server (kvbank-serve) behind a fake registered worker; the tokens must be kvbank-request's. */
KVB_TEST(ctl_generate) {
    make_dir();
    start_coordinator();
    char model[128], sock[128], ep[160], slog[128];
    snprintf(model, sizeof model, "%s/model", g_dir);
    snprintf(sock, sizeof sock, "%s/serve.sock", g_dir);
    snprintf(ep, sizeof ep, "ipc://%s", sock);
    snprintf(slog, sizeof slog, "%s/serve.log", g_dir);
    const char *mk[] = {"kvbank-mkmodel", "--arch", "llama", "--seed", "5", model, NULL};
    ck_assert_int_eq(run_tool(mk, NULL, 0, NULL, 0), 0);
    char path[PATH_MAX], name[32];
    snprintf(path, sizeof path, "%s/kvbank-serve", builddir());
    snprintf(name, sizeof name, "c%d", (int)getpid());
    pid_t parent = getpid();
    fflush(NULL);
    pid_t srv = fork();
    ck_assert_int_ge(srv, 0);
    if (srv == 0) {
        setpgid(0, 0);
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != parent) _exit(1);
        int fd = open(slog, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd >= 0) dup2(fd, 1), dup2(fd, 2);
        execl(path, "kvbank-serve", "--model", model, "--endpoint", ep, "--name", name, "--threads", "1", (char *)NULL);
        _exit(127);
    }
    kvb_client *cl = NULL;
    ck_assert_int_eq(kvb_client_connect(ep, &cl), KVB_OK);
    kvb_status st = KVB_ERR_TIMEOUT;
    for (int i = 0; i < 150 && st != KVB_OK; i++) st = kvb_client_ping(cl, 200, NULL);
    kvb_client_destroy(cl);
    ck_assert_msg(st == KVB_OK, "kvbank-serve did not answer");

    /* a worker "w" whose request endpoint is that server */
    peer w;
    peer_open(&w, "w");
    Kvbank__KvGeometry wg = KVBANK__KV_GEOMETRY__INIT;
    wg.n_layers = 2, wg.n_kv_heads = 2, wg.head_dim = 8, wg.block_size = 16, wg.elem_size = 4;
    Kvbank__Register r = KVBANK__REGISTER__INIT;
    r.name = "w";
    r.role = KVBANK__ROLE__ROLE_WORKER;
    r.pid = (uint32_t)getpid(); /* the registration is this connection's: pid and region are ours */
    r.geom = &wg;
    char tag[32];
    snprintf(tag, sizeof tag, "t%d_w", (int)getpid());
    ck_assert_int_eq(kvb_region_create(tag, 64 * kvb_kv_block_bytes(&G_A), &w.region), KVB_OK);
    r.region = (char *)kvb_region_handle(w.region);
    r.capacity = 64;
    r.region_bytes = 64 * kvb_kv_block_bytes(&G_A);
    r.endpoint = ep;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_REGISTER;
    env.register_ = &r;
    peer_send(&w, &env);
    Kvbank__Envelope *e = peer_expect(&w, KVBANK__ENVELOPE__BODY_REGISTER_REPLY, 10000, "register");
    ck_assert(e->register_reply->ok);
    kvbank__envelope__free_unpacked(e, NULL);
    keep_alive(&w);
    heartbeat_alive();

    static char out[16384], ref[4096];
    char err[4096];
    const char *gen[] = {"kvbankctl", "--coordinator", g_endpoint, "generate", "--model", "w", "--prompt-ids",
                         "1,2,3,4", "--max-tokens", "6", NULL};
    int rc = run_tool(gen, out, sizeof out, err, sizeof err);
    ck_assert_msg(rc == 0, "generate exited %d: %s", rc, err);
    const char *req[] = {"kvbank-request", "--endpoint", ep, "--prompt-ids", "1,2,3,4", "--max-tokens", "6",
                         "--quiet", NULL};
    ck_assert_int_eq(run_tool(req, ref, sizeof ref, NULL, 0), 0);
    /* six `INDEX TOKEN MS` lines, then "finish: length, 6 tokens: IDS" with kvbank-request's ids */
    char *fin = strstr(out, "finish: length, 6 tokens: ");
    ck_assert_msg(fin != NULL, "output: %s", out);
    fin += strlen("finish: length, 6 tokens: ");
    size_t n = strcspn(ref, "\n");
    ck_assert_msg(n > 0 && !strncmp(fin, ref, n) && (fin[n] == '\n' || fin[n] == '\0'),
                  "kvbankctl: %s -- kvbank-request: %s", fin, ref);
    int lines = 0;
    for (char *p = out; p < fin; p++) lines += *p == '\n';
    ck_assert_int_eq(lines, 6);
    ck_assert(!strncmp(out, "0 ", 2));
    /* an unknown model */
    const char *bad[] = {"kvbankctl", "--coordinator", g_endpoint, "generate", "--model", "nosuch", "--prompt-ids",
                         "1", "--max-tokens", "1", NULL};
    ck_assert_int_eq(run_tool(bad, out, sizeof out, err, sizeof err), 1);
    ck_assert_msg(strstr(err, "no such model") != NULL, "stderr: %s", err);
    kill(srv, SIGTERM);
    int status = 0;
    ck_assert_int_eq(waitpid(srv, &status, 0), srv);
    ck_assert_int_eq(status, 0);
    peer_close(&w);
    teardown();
}
KVB_TEST_END

/* The coordinator program: --help, usage errors, a second instance on a live endpoint. */
KVB_TEST(proc_cli) {
    make_dir();
    char out[8192], err[4096];
    const char *help[] = {"kvbank-coordinator", "--help", NULL};
    ck_assert_int_eq(run_tool(help, out, sizeof out, NULL, 0), 0);
    ck_assert_ptr_nonnull(strstr(out, "--heartbeat-misses"));
    const char *none[] = {"kvbank-coordinator", NULL};
    ck_assert_int_eq(run_tool(none, NULL, 0, err, sizeof err), 2);
    const char *both[] = {"kvbank-coordinator", "--endpoint", g_endpoint, "--config", "x.json", NULL};
    ck_assert_int_eq(run_tool(both, NULL, 0, err, sizeof err), 2);
    const char *badn[] = {"kvbank-coordinator", "--endpoint", g_endpoint, "--heartbeat-ms", "0", NULL};
    ck_assert_int_eq(run_tool(badn, NULL, 0, err, sizeof err), 2);
    const char *badcfg[] = {"kvbank-coordinator", "--config", "/nonexistent.json", NULL};
    ck_assert_int_eq(run_tool(badcfg, NULL, 0, err, sizeof err), 1);
    /* tcp is refused: the coordinator serves one node's processes, on ipc:// */
    const char *tcp[] = {"kvbank-coordinator", "--endpoint", "tcp://127.0.0.1:0", NULL};
    ck_assert_int_eq(run_tool(tcp, NULL, 0, err, sizeof err), 1);
    ck_assert_msg(strstr(err, "ipc:// only") != NULL, "stderr: %s", err);
    start_coordinator();
    const char *second[] = {"kvbank-coordinator", "--endpoint", g_endpoint, NULL};
    ck_assert_int_eq(run_tool(second, NULL, 0, err, sizeof err), 1);
    ck_assert_msg(strstr(err, "another process is listening") != NULL, "stderr: %s", err);
    /* the first one still serves */
    Kvbank__Envelope *s = status_of(0);
    kvbank__envelope__free_unpacked(s, NULL);
    /* SIGINT stops it cleanly and removes its socket file */
    ck_assert_int_eq(stop_coordinator(SIGINT, 20), 0);
    ck_assert_int_ne(access(g_endpoint + 6, F_OK), 0);
    /* --config: endpoint and heartbeat settings from the node config; kvbankctl finds it there too */
    char text[1024];
    snprintf(g_config, sizeof g_config, "%s/node.json", g_dir);
    snprintf(text, sizeof text,
             "{\"node\": \"cli\", \"run_dir\": \"%s/run\",\n"
             " \"coordinator\": {\"endpoint\": \"%s\", \"heartbeat_ms\": 250, \"heartbeat_misses\": 7},\n"
             " \"models\": [{\"name\": \"chat\", \"role\": \"master\", \"model_dir\": \"m\", \"kv_mb\": 1}]}\n",
             g_dir, g_endpoint);
    write_file(g_config, text);
    snprintf(g_hb_ms, sizeof g_hb_ms, "250");
    start_coordinator();
    ck_assert(log_contains("heartbeat 250 ms, dead after 7 misses"));
    peer m;
    peer_open(&m, "m");
    peer_register(&m, KVB_ROLE_MASTER, &G_M, 64); /* checks RegisterReply.heartbeat_ms == 250 */
    peer_close(&m);
    const char *st[] = {"kvbankctl", "--config", g_config, "status", NULL};
    ck_assert_int_eq(run_tool(st, out, sizeof out, err, sizeof err), 0);
    ck_assert_ptr_nonnull(strstr(out, "master"));
    teardown();
}
KVB_TEST_END

KVB_TEST_MAIN("ctl", KVB_T(ctl_control, 60), KVB_T(ctl_status_json, 60), KVB_T(ctl_plan, 30),
              KVB_T(ctl_generate, 120), KVB_T(proc_cli, 60))
