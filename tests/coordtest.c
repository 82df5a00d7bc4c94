/* kvbank — the process fixture of the coordinator's suites (test_coordinator, test_ctl): a
 * kvbank-coordinator of the test's own, fake model processes that speak the protocol (peers), and
 * kvbank's programs run against them (tests/coordtest.h). */
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
#include "tests/testfiles.h"
#include "tests/testproc.h"
#include "tests/coordtest.h"

/* Geometries: the master's block is 16384 bytes; worker A's 4096 (MEU 4 worker : 1 master); worker
 * B's 3072 (lcm 49152: MEU 16 : 3). */
const kvb_kv_geom G_M = {.n_layers = 4, .n_kv_heads = 2, .head_dim = 16, .block_size = 16, .elem_size = 4};
const kvb_kv_geom G_A = {.n_layers = 2, .n_kv_heads = 2, .head_dim = 8, .block_size = 16, .elem_size = 4};
const kvb_kv_geom G_B = {.n_layers = 3, .n_kv_heads = 1, .head_dim = 16, .block_size = 8, .elem_size = 4};


char g_dir[64];        /* this test's scratch directory */
char g_endpoint[160];
char g_log[96];
pid_t g_coord = -1;
char g_hb_ms[16] = "100", g_misses[16] = "50";
char g_config[128];    /* non-empty: start the coordinator with --config g_config */
kvb_auth g_sup;        /* has_secret: the test plays kvbankd, handing the coordinator this secret
                               * on an inherited pipe (KVB_AUTH_FD) instead of its key file */

const char *builddir(void) { return kvb_t_builddir(); }

void heartbeat_alive(void);

/* Runs a program of the build directory with stdout into out[out_len] (may be NULL) and stderr into
 * err[err_len] (may be NULL: the test's stderr). The fake peers keep heartbeating while the tool runs: a
 * loaded (sanitizer) machine may run it for longer than the silence limit, and a silent master holding
 * loans is fenced with SIGKILL, which would hit this process. Returns its exit status, -1 if it did not
 * exit. */
int run_tool(const char *const *argv, char *out, size_t out_len, char *err, size_t err_len) {
    char errfile[128];
    snprintf(errfile, sizeof errfile, "%s/tool.err", g_dir);
    return kvb_t_run_tool(argv, &(kvb_t_run){.out = out, .out_len = out_len, .err = err, .err_len = err_len,
                                             .err_file = errfile, .idle = heartbeat_alive});
}

void print_log(void) { kvb_t_print_file(g_log, "coordinator log"); }

int log_contains(const char *needle) { return kvb_t_file_contains(g_log, needle); }

void make_dir(void) {
    kvb_t_remove_stale();
    snprintf(g_dir, sizeof g_dir, "/tmp/kvb-test-%d.d", (int)getpid());
    ck_assert_msg(mkdir(g_dir, 0700) == 0, "mkdir %s: %s", g_dir, strerror(errno));
    snprintf(g_endpoint, sizeof g_endpoint, "ipc://%s/run/coordinator.sock", g_dir);
    snprintf(g_log, sizeof g_log, "%s/coordinator.log", g_dir);
}

/* Forks and execs kvbank-coordinator on g_endpoint (log appended to g_log). Does not wait. */
void spawn_coordinator(void) {
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/kvbank-coordinator", builddir());
    pid_t parent = getpid();
    int sup[2] = {-1, -1};
    if (g_sup.has_secret) { /* kvbankd's way: the secret on a pipe the coordinator inherits */
        char text[256];
        ck_assert_int_eq(kvb_auth_format(&g_sup, text, sizeof text), KVB_OK);
        ck_assert_int_eq(pipe(sup), 0);
        ck_assert_int_eq(write(sup[1], text, strlen(text)), (ssize_t)strlen(text));
        close(sup[1]);
    }
    fflush(NULL);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        setpgid(0, 0); /* check's timeout kill of the test's group must not SIGKILL it */
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != parent) _exit(1);
        if (sup[0] >= 0) {
            char fd[16];
            snprintf(fd, sizeof fd, "%d", sup[0]);
            setenv(KVB_AUTH_FD_ENV, fd, 1);
        }
        int fd = open(g_log, O_WRONLY | O_CREAT | O_APPEND, 0600);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        setenv("KVB_LOG_LEVEL", "debug", 1);
        const char *vg = getenv("KVB_TEST_VALGRIND");
        if (vg && !strcmp(vg, "1")) {
            execlp("valgrind", "valgrind", "-q", "--leak-check=full", "--errors-for-leak-kinds=definite,indirect",
                   "--error-exitcode=99", path, "--endpoint", g_endpoint, "--heartbeat-ms", g_hb_ms,
                   "--heartbeat-misses", g_misses, (char *)NULL);
        }
        if (g_config[0]) execl(path, "kvbank-coordinator", "--config", g_config, (char *)NULL);
        else execl(path, "kvbank-coordinator", "--endpoint", g_endpoint, "--heartbeat-ms", g_hb_ms,
                   "--heartbeat-misses", g_misses, (char *)NULL);
        _exit(127);
    }
    if (sup[0] >= 0) close(sup[0]);
    g_coord = pid;
}

int stop_coordinator(int sig, double timeout_s) {
    if (g_coord <= 0) return 0;
    kill(g_coord, sig);
    int status = 0;
    for (int i = 0; i < (int)(timeout_s * 100); i++) {
        if (waitpid(g_coord, &status, WNOHANG) == g_coord) {
            g_coord = -1;
            return status;
        }
        usleep(10000);
    }
    kill(g_coord, SIGKILL);
    waitpid(g_coord, &status, 0);
    g_coord = -1;
    return -1;
}

/* ------------------------------------------------------------------------------------ fake peers */

peer *g_alive[8];
int g_n_alive;

/* The token of model `name` from the coordinator's key file next to its socket (the way a model run by
 * hand logs in); 0 when there is no key file (a coordinator that does not authenticate). */
int model_token(const char *name, char out[KVB_AUTH_TOKEN_LEN + 1]) {
    if (g_sup.has_secret) { /* the test holds the secret it handed the coordinator */
        kvb_auth_token(g_sup.secret, name, out);
        return 1;
    }
    char key[PATH_MAX];
    kvb_auth a;
    if (kvb_auth_key_path(g_endpoint, key, sizeof key) != KVB_OK || kvb_auth_read_file(key, &a) != KVB_OK) return 0;
    kvb_auth_token(a.secret, name, out);
    return 1;
}

/* A DEALER to the coordinator's models' endpoint (ctl: its control endpoint) with routing id `name`
 * (NULL: none, the ROUTER makes one up) that logs in as `user` with `password` (user NULL: no PLAIN at
 * all). */
void peer_open_at(peer *p, int ctl, const char *name, const char *user, const char *password) {
    memset(p, 0, sizeof p[0]);
    p->ctx = zmq_ctx_new();
    ck_assert_ptr_nonnull(p->ctx);
    p->sock = zmq_socket(p->ctx, ZMQ_DEALER);
    ck_assert_ptr_nonnull(p->sock);
    int zero = 0, ivl = 50;
    zmq_setsockopt(p->sock, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(p->sock, ZMQ_RECONNECT_IVL, &ivl, sizeof ivl);
    if (name) {
        snprintf(p->name, sizeof p->name, "%s", name);
        ck_assert_int_eq(zmq_setsockopt(p->sock, ZMQ_ROUTING_ID, name, strlen(name)), 0);
    }
    if (user) ck_assert_int_eq(kvb_auth_set_plain(p->sock, user, password), KVB_OK);
    char ep[sizeof g_endpoint + 8];
    snprintf(ep, sizeof ep, "%s%s", g_endpoint, ctl ? ".ctl" : "");
    ck_assert_int_eq(zmq_connect(p->sock, ep), 0);
}

/* A model peer logs in with its token on the models' endpoint; an anonymous one as a control client on
 * the control endpoint. (Without a key file, as against a coordinator that does not authenticate, both
 * connect to the one endpoint without credentials.) */
void peer_open(peer *p, const char *name) {
    char tok[KVB_AUTH_TOKEN_LEN + 1];
    if (name && model_token(name, tok)) peer_open_at(p, 0, name, name, tok);
    else if (!name && model_token("-", tok)) peer_open_at(p, 1, NULL, KVB_AUTH_CTL_USER, "-");
    else peer_open_at(p, 0, name, NULL, NULL);
}

void peer_close(peer *p) {
    kvb_region_destroy(p->region);
    p->region = NULL;
    if (p->sock) zmq_close(p->sock);
    if (p->ctx) zmq_ctx_term(p->ctx);
    p->sock = p->ctx = NULL;
    for (int i = 0; i < g_n_alive; i++)
        if (g_alive[i] == p) g_alive[i] = g_alive[--g_n_alive];
}

/* A DEALER queues a message only on a connection it has: once the coordinator refused a peer's
 * handshake (which can come before its first send) a blocking send would wait for good, so a peer
 * whose login is to be refused sends without waiting and may drop the message. */
void peer_send(peer *p, Kvbank__Envelope *env) {
    if (p->refused) (void)kvb_wire_send(p->sock, NULL, 0, env, ZMQ_DONTWAIT);
    else ck_assert_int_eq(kvb_wire_send(p->sock, NULL, 0, env, 0), KVB_OK);
}

void send_heartbeat(peer *p) {
    Kvbank__Heartbeat h = KVBANK__HEARTBEAT__INIT;
    h.name = p->name;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_HEARTBEAT;
    env.heartbeat = &h;
    peer_send(p, &env);
    p->last_hb_ns = kvb_now_ns();
}

void keep_alive(peer *p) { g_alive[g_n_alive++] = p; }

void heartbeat_alive(void) {
    for (int i = 0; i < g_n_alive; i++)
        if (kvb_now_ns() - g_alive[i]->last_hb_ns > 40000000u) send_heartbeat(g_alive[i]);
}

/* The next message on p within timeout_ms other than a HeartbeatReply, or NULL. Heartbeats the
 * g_alive peers meanwhile. */
Kvbank__Envelope *peer_recv(peer *p, int timeout_ms) {
    uint64_t deadline = kvb_now_ns() + (uint64_t)timeout_ms * 1000000u;
    for (;;) {
        heartbeat_alive();
        zmq_pollitem_t it = {.socket = p->sock, .events = ZMQ_POLLIN};
        int rc = zmq_poll(&it, 1, 20);
        if (rc > 0) {
            zmq_msg_t m;
            zmq_msg_init(&m);
            ck_assert_int_ge(zmq_msg_recv(&m, p->sock, 0), 0);
            ck_assert_int_eq(zmq_msg_more(&m), 0);
            Kvbank__Envelope *env = NULL;
            kvb_status st = kvb_coord_decode(zmq_msg_data(&m), zmq_msg_size(&m), &env, NULL);
            zmq_msg_close(&m);
            ck_assert_int_eq(st, KVB_OK);
            if (env->body_case != KVBANK__ENVELOPE__BODY_HEARTBEAT_REPLY) return env;
            kvbank__envelope__free_unpacked(env, NULL);
            continue;
        }
        if (kvb_now_ns() >= deadline) return NULL;
    }
}

Kvbank__Envelope *peer_expect(peer *p, Kvbank__Envelope__BodyCase want, int timeout_ms, const char *what) {
    Kvbank__Envelope *e = peer_recv(p, timeout_ms);
    if (!e) print_log();
    ck_assert_msg(e != NULL, "%s: %s got nothing within %d ms (expected message type %d)", what, p->name, timeout_ms,
                  (int)want);
    if (e->body_case != want) print_log();
    ck_assert_msg(e->body_case == want, "%s: %s got message type %d, expected %d", what, p->name, (int)e->body_case,
                  (int)want);
    return e;
}

/* Waits until the coordinator answers a status request. */
Kvbank__Envelope *status_of(int ledger) {
    peer q;
    peer_open(&q, NULL);
    Kvbank__StatusRequest sr = KVBANK__STATUS_REQUEST__INIT;
    sr.ledger = ledger != 0;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_STATUS_REQUEST;
    env.status_request = &sr;
    peer_send(&q, &env);
    Kvbank__Envelope *r = peer_expect(&q, KVBANK__ENVELOPE__BODY_STATUS_REPLY, 10000, "status");
    peer_close(&q);
    return r;
}

void start_coordinator(void) {
    spawn_coordinator();
    /* wait for the socket file, then for an answer */
    char path[256];
    snprintf(path, sizeof path, "%s", g_endpoint + 6);
    for (int i = 0; i < 1000 && access(path, F_OK) != 0; i++) {
        int status;
        if (waitpid(g_coord, &status, WNOHANG) == g_coord) {
            g_coord = -1;
            print_log();
            ck_abort_msg("kvbank-coordinator exited early (status 0x%x)", status);
        }
        usleep(10000);
    }
    Kvbank__Envelope *r = status_of(0);
    kvbank__envelope__free_unpacked(r, NULL);
}

void teardown(void) {
    int status = stop_coordinator(SIGTERM, 20);
    if (status != 0) print_log();
    ck_assert_msg(status == 0, "kvbank-coordinator ended with wait status 0x%x (-1: killed after a timeout)", status);
    if (g_dir[0]) kvb_t_remove_tree(g_dir);
}

/* The next Registers' borrowing limit (issue 10; 0, 0: none). */
int g_reg_limited;
uint32_t g_reg_max_borrow;

/* Sends p's Register: `role`, `pid`, geometry `g`, `capacity` blocks in a real region of this process
 * (made or grown here), the loans it reports. */
void peer_send_register(peer *p, kvb_role role, uint32_t pid, const kvb_kv_geom *g, uint32_t capacity,
                               Kvbank__Loan **loans, size_t n_loans) {
    Kvbank__KvGeometry wg = KVBANK__KV_GEOMETRY__INIT;
    wg.n_layers = (uint32_t)g->n_layers;
    wg.n_kv_heads = (uint32_t)g->n_kv_heads;
    wg.head_dim = (uint32_t)g->head_dim;
    wg.block_size = (uint32_t)g->block_size;
    wg.elem_size = (uint32_t)g->elem_size;
    char ep[192];
    snprintf(ep, sizeof ep, "ipc://%s/%s.sock", g_dir, p->name);
    size_t bytes = (size_t)capacity * kvb_kv_block_bytes(g);
    if (!p->region || kvb_region_size(p->region) < bytes) { /* a real region of this process */
        kvb_region_destroy(p->region);
        char tag[40];
        snprintf(tag, sizeof tag, "t%d_%.20s", (int)getpid(), p->name);
        ck_assert_int_eq(kvb_region_create(tag, bytes, &p->region), KVB_OK);
    }
    const char *region = kvb_region_handle(p->region);
    Kvbank__Register r = KVBANK__REGISTER__INIT;
    r.name = p->name;
    r.role = role == KVB_ROLE_MASTER ? KVBANK__ROLE__ROLE_MASTER : KVBANK__ROLE__ROLE_WORKER;
    r.pid = pid;
    r.geom = &wg;
    r.region = (char *)region;
    r.region_bytes = (uint64_t)bytes;
    r.capacity = capacity;
    r.n_own = capacity;
    r.endpoint = ep;
    r.loans = loans;
    r.n_loans = n_loans;
    r.model = "test";
    r.borrow_limited = g_reg_limited != 0;
    r.max_borrow = g_reg_max_borrow;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_REGISTER;
    env.register_ = &r;
    peer_send(p, &env);
}

/* p registers (peer_send_register) and gets its RegisterReply, which *holder owns. */
Kvbank__RegisterReply *peer_register_loans(peer *p, kvb_role role, uint32_t pid, const kvb_kv_geom *g,
                                                  uint32_t capacity, Kvbank__Loan **loans, size_t n_loans,
                                                  Kvbank__Envelope **holder) {
    peer_send_register(p, role, pid, g, capacity, loans, n_loans);
    *holder = peer_expect(p, KVBANK__ENVELOPE__BODY_REGISTER_REPLY, 10000, "register");
    p->last_hb_ns = kvb_now_ns();
    return (*holder)->register_reply;
}

void peer_register(peer *p, kvb_role role, const kvb_kv_geom *g, uint32_t capacity) {
    Kvbank__Envelope *h = NULL;
    Kvbank__RegisterReply *rr = peer_register_loans(p, role, (uint32_t)getpid(), g, capacity, NULL, 0, &h);
    ck_assert_msg(rr->ok, "register %s refused: %s", p->name, rr->error);
    ck_assert_uint_eq(rr->heartbeat_ms, (uint32_t)atoi(g_hb_ms));
    kvbank__envelope__free_unpacked(h, NULL);
}

void send_offer(peer *w, uint32_t first, uint32_t n) {
    Kvbank__LendOffer o = KVBANK__LEND_OFFER__INIT;
    o.worker = w->name;
    o.first_block = first;
    o.n_blocks = n;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_LEND_OFFER;
    env.lend_offer = &o;
    peer_send(w, &env);
}

void send_grant_ack(peer *m, uint64_t id, int ok) {
    Kvbank__GrantAck g = KVBANK__GRANT_ACK__INIT;
    g.loan_id = id;
    g.ok = ok != 0;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_GRANT_ACK;
    env.grant_ack = &g;
    peer_send(m, &env);
}

void send_revoke_ack(peer *m, uint64_t id, uint64_t epoch) {
    Kvbank__RevokeAck a = KVBANK__REVOKE_ACK__INIT;
    a.loan_id = id;
    a.epoch = epoch;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_REVOKE_ACK;
    env.revoke_ack = &a;
    peer_send(m, &env);
}

void send_reclaim(peer *w, uint32_t n) {
    Kvbank__ReclaimRequest r = KVBANK__RECLAIM_REQUEST__INIT;
    r.worker = w->name;
    r.n_blocks = n;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_RECLAIM_REQUEST;
    env.reclaim_request = &r;
    peer_send(w, &env);
}

/* Worker w offers [first, first + n); the master gets the Grant and acks it. Returns the loan id. */
uint64_t lend_flow(peer *m, peer *w, uint32_t first, uint32_t n) {
    send_offer(w, first, n);
    Kvbank__Envelope *e = peer_expect(w, KVBANK__ENVELOPE__BODY_LEND_RESULT, 10000, "offer");
    ck_assert_msg(e->lend_result->accepted, "offer refused: %s", e->lend_result->error);
    ck_assert_ptr_nonnull(e->lend_result->loan);
    uint64_t id = e->lend_result->loan->loan_id;
    ck_assert_uint_eq(e->lend_result->loan->first_block, first);
    ck_assert_uint_eq(e->lend_result->loan->n_blocks, n);
    kvbank__envelope__free_unpacked(e, NULL);
    e = peer_expect(m, KVBANK__ENVELOPE__BODY_GRANT, 10000, "grant");
    const Kvbank__Grant *g = e->grant;
    ck_assert_uint_eq(g->loan->loan_id, id);
    ck_assert_str_eq(g->loan->lender, w->name);
    ck_assert_uint_eq(g->loan->offset, (uint64_t)first * kvb_kv_block_bytes(&G_A));
    ck_assert_uint_eq(g->loan->bytes, (uint64_t)n * kvb_kv_block_bytes(&G_A));
    ck_assert_uint_eq(g->loan->n_master_blocks, n / 4);
    ck_assert_ptr_nonnull(g->lender_geom);
    ck_assert_uint_eq(g->lender_geom->n_layers, (uint32_t)G_A.n_layers);
    ck_assert_str_eq(g->region, kvb_region_handle(w->region));
    kvbank__envelope__free_unpacked(e, NULL);
    send_grant_ack(m, id, 1);
    return id;
}

const Kvbank__ModelStatus *find_status(const Kvbank__StatusReply *s, const char *name) {
    for (size_t i = 0; i < s->n_models; i++)
        if (!strcmp(s->models[i]->name, name)) return s->models[i];
    return NULL;
}

/* The whole fenced flow: lend, Grant, GrantAck, reclaim, Revoke, (nothing for the worker), RevokeAck,
 * Reclaimed. */

/* The fake master as a real process: registers with its own pid, acks every Grant, heartbeats, and
 * writes one byte to `fd` after its first GrantAck. Never returns. */
void child_master(int fd) {
    void *ctx = zmq_ctx_new();
    void *s = ctx ? zmq_socket(ctx, ZMQ_DEALER) : NULL;
    if (!s) _exit(3);
    int zero = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(s, ZMQ_ROUTING_ID, "m", 1);
    char tok[KVB_AUTH_TOKEN_LEN + 1];
    if (!model_token("m", tok) || kvb_auth_set_plain(s, "m", tok) != KVB_OK) _exit(3);
    if (zmq_connect(s, g_endpoint) != 0) _exit(3);
    kvb_region *region = NULL; /* its own (it dies with SIGKILL: the test removes it) */
    char tag[32];
    snprintf(tag, sizeof tag, "t%d_m", (int)getpid());
    if (kvb_region_create(tag, 64 * kvb_kv_block_bytes(&G_M), &region) != KVB_OK) _exit(3);
    Kvbank__KvGeometry wg = KVBANK__KV_GEOMETRY__INIT;
    wg.n_layers = (uint32_t)G_M.n_layers;
    wg.n_kv_heads = (uint32_t)G_M.n_kv_heads;
    wg.head_dim = (uint32_t)G_M.head_dim;
    wg.block_size = (uint32_t)G_M.block_size;
    wg.elem_size = (uint32_t)G_M.elem_size;
    Kvbank__Register r = KVBANK__REGISTER__INIT;
    r.name = "m";
    r.role = KVBANK__ROLE__ROLE_MASTER;
    r.pid = (uint32_t)getpid();
    r.geom = &wg;
    r.region = (char *)kvb_region_handle(region);
    r.capacity = 64;
    r.region_bytes = 64 * kvb_kv_block_bytes(&G_M);
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_REGISTER;
    env.register_ = &r;
    if (kvb_wire_send(s, NULL, 0, &env, 0) != KVB_OK) _exit(3);
    for (;;) {
        zmq_pollitem_t it = {.socket = s, .events = ZMQ_POLLIN};
        if (zmq_poll(&it, 1, 100) > 0) {
            zmq_msg_t m;
            zmq_msg_init(&m);
            if (zmq_msg_recv(&m, s, 0) >= 0) {
                Kvbank__Envelope *e = NULL;
                if (kvb_coord_decode(zmq_msg_data(&m), zmq_msg_size(&m), &e, NULL) == KVB_OK) {
                    if (e->body_case == KVBANK__ENVELOPE__BODY_GRANT) {
                        Kvbank__GrantAck g = KVBANK__GRANT_ACK__INIT;
                        g.loan_id = e->grant->loan->loan_id;
                        g.ok = 1;
                        Kvbank__Envelope a = KVBANK__ENVELOPE__INIT;
                        a.body_case = KVBANK__ENVELOPE__BODY_GRANT_ACK;
                        a.grant_ack = &g;
                        kvb_wire_send(s, NULL, 0, &a, 0);
                        if (write(fd, "g", 1) != 1) _exit(4);
                    }
                    kvbank__envelope__free_unpacked(e, NULL);
                }
            }
            zmq_msg_close(&m);
        }
        Kvbank__Heartbeat hb = KVBANK__HEARTBEAT__INIT;
        hb.name = "m";
        Kvbank__Envelope he = KVBANK__ENVELOPE__INIT;
        he.body_case = KVBANK__ENVELOPE__BODY_HEARTBEAT;
        he.heartbeat = &hb;
        kvb_wire_send(s, NULL, 0, &he, 0);
    }
}

/* Forks child_master; fds gets its pipe (fds[0] the read end, open; fds[1] closed). Returns its pid. */
pid_t spawn_child_master(int fds[2]) {
    ck_assert_int_eq(pipe(fds), 0);
    fflush(NULL);
    pid_t child = fork();
    ck_assert_int_ge(child, 0);
    if (child == 0) {
        close(fds[0]);
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        child_master(fds[1]);
    }
    close(fds[1]);
    fds[1] = -1;
    return child;
}

/* 1 once the coordinator counts `child` as model m, alive, with its pid; 0 after 15 s. Bounded by the
 * clock, not by a count of polls: each poll is a new control connection with its own handshake, and on
 * a loaded machine 250 of them took the test past its time limit. */
int wait_child_master(pid_t child) {
    int registered = 0;
    uint64_t deadline = kvb_now_ns() + 15000000000ull;
    while (!registered && kvb_now_ns() < deadline) {
        Kvbank__Envelope *s = status_of(0);
        const Kvbank__ModelStatus *ms = find_status(s->status_reply, "m");
        registered = ms && ms->alive && ms->pid == (uint32_t)child;
        kvbank__envelope__free_unpacked(s, NULL);
        if (!registered) usleep(20000);
    }
    return registered;
}
