/* Tests of the coordinator: the ledger as a library (coordinator/ledger.h), and kvbank-coordinator as
 * a real process on a real ipc:// socket, driven by fake model processes: DEALER sockets in the test
 * (and, where a pid must really die, a child process) that speak the protocol of docs/design.md the way
 * kvbank-master and kvbank-worker do. kvbankctl runs as a real process too.
 *
 * Programs are found in $KVB_BUILDDIR, or else in the directory above this test binary. Every process
 * test starts its own coordinator (own process group, PR_SET_PDEATHSIG(SIGTERM)) and stops it with
 * SIGTERM at its end: it must exit with status 0 (in a sanitizer build: no error, no leak). The test's
 * files live in /tmp/kvb-test-<pid>.d; every test first removes such directories of test processes
 * that no longer exist. KVB_TEST_VALGRIND=1 runs the coordinator under valgrind (leaks are errors). */
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

/* Geometries: the master's block is 16384 bytes; worker A's 4096 (MEU 4 worker : 1 master); worker
 * B's 3072 (lcm 49152: MEU 16 : 3). */
static const kvb_kv_geom G_M = {.n_layers = 4, .n_kv_heads = 2, .head_dim = 16, .block_size = 16, .elem_size = 4};
static const kvb_kv_geom G_A = {.n_layers = 2, .n_kv_heads = 2, .head_dim = 8, .block_size = 16, .elem_size = 4};
static const kvb_kv_geom G_B = {.n_layers = 3, .n_kv_heads = 1, .head_dim = 16, .block_size = 8, .elem_size = 4};

/* ===================================================================================== ledger units */

static int g_dead_pid; /* the fake pid table: this pid is gone */

static int fake_pid_alive(void *ud, uint32_t pid) {
    (void)ud;
    return (int)pid != g_dead_pid;
}

static kvb_ledger *new_ledger(void) {
    kvb_ledger_opts o = {.heartbeat_ms = 100, .heartbeat_misses = 4, .pid_alive = fake_pid_alive};
    kvb_ledger *l = NULL;
    ck_assert_int_eq(kvb_ledger_create(&o, &l), KVB_OK);
    g_dead_pid = -1;
    if (!getenv("KVB_LOG_LEVEL")) kvb_log_set_level(KVB_LOG_WARN);
    return l;
}

static kvb_status reg_full(kvb_ledger *l, const char *name, kvb_role role, uint32_t pid, const kvb_kv_geom *g,
                           uint32_t capacity, const kvb_loan *loans, int n_loans, uint64_t now, char *why) {
    kvb_ledger_reg r = {.name = name, .role = role, .pid = pid, .geom = *g, .region = "/kvb-test-region",
                        .region_bytes = (uint64_t)capacity * kvb_kv_block_bytes(g), .capacity = capacity,
                        .n_own = capacity, .endpoint = "ipc:///tmp/none", .model = "m", .loans = loans,
                        .n_loans = n_loans};
    return kvb_ledger_register(l, &r, now, why, 256);
}

static void reg(kvb_ledger *l, const char *name, kvb_role role, uint32_t pid, const kvb_kv_geom *g, uint32_t cap) {
    char why[256] = "";
    kvb_status st = reg_full(l, name, role, pid, g, cap, NULL, 0, 0, why);
    ck_assert_msg(st == KVB_OK, "register %s: %s (%s)", name, kvb_status_str(st), why);
}

/* Pops the next action and checks its kind, receiver and loan. */
static kvb_ledger_action expect_act(kvb_ledger *l, kvb_ledger_action_kind kind, const char *to, uint64_t loan_id) {
    kvb_ledger_action a;
    ck_assert_msg(kvb_ledger_pop_action(l, &a), "no action queued, expected kind %d to %s", (int)kind, to);
    ck_assert_int_eq(a.kind, kind);
    ck_assert_str_eq(a.to, to);
    if (loan_id) ck_assert_uint_eq(a.loan.id, loan_id);
    return a;
}

static void expect_no_act(kvb_ledger *l) {
    kvb_ledger_action a;
    int got = kvb_ledger_pop_action(l, &a);
    ck_assert_msg(!got, "unexpected action kind %d to %s (loan %" PRIu64 ")", (int)a.kind, a.to, a.loan.id);
}

/* An accepted offer, its Grant and the master's GrantAck. Returns the loan id. */
static uint64_t lend(kvb_ledger *l, const char *w, uint32_t first, uint32_t n) {
    char why[256] = "";
    kvb_loan ln;
    kvb_status st = kvb_ledger_offer(l, w, first, n, 0, &ln, why, sizeof why);
    ck_assert_msg(st == KVB_OK, "offer %s [%u, +%u): %s (%s)", w, first, n, kvb_status_str(st), why);
    expect_act(l, KVB_ACT_GRANT, "m", ln.id);
    ck_assert_int_eq(kvb_ledger_grant_ack(l, "m", ln.id, 1, 0, why, sizeof why), KVB_OK);
    ck_assert_int_eq(kvb_ledger_loan(l, ln.id)->state, KVB_LOAN_ACTIVE);
    return ln.id;
}

KVB_TEST(ledger_meu_per_pair) {
    kvb_ledger *l = new_ledger();
    reg(l, "a", KVB_ROLE_WORKER, 11, &G_A, 256);
    reg(l, "b", KVB_ROLE_WORKER, 12, &G_B, 682);
    ck_assert(!kvb_ledger_find(l, "a")->has_meu); /* no master yet */
    reg(l, "m", KVB_ROLE_MASTER, 10, &G_M, 64);
    const kvb_ledger_model *a = kvb_ledger_find(l, "a"), *b = kvb_ledger_find(l, "b");
    ck_assert(a->has_meu && b->has_meu);
    ck_assert_uint_eq(a->meu.meu_worker, 4);
    ck_assert_uint_eq(a->meu.meu_master, 1);
    ck_assert_uint_eq(b->meu.meu_worker, 16);
    ck_assert_uint_eq(b->meu.meu_master, 3);
    ck_assert_uint_eq(b->meu.lcm_bytes, 49152);

    /* A loan of B: 16 worker blocks of 3072 bytes hold 3 master blocks of 16384. */
    char why[256];
    kvb_loan ln;
    ck_assert_int_eq(kvb_ledger_offer(l, "b", 32, 32, 0, &ln, why, sizeof why), KVB_OK);
    ck_assert_uint_eq(ln.n_master_blocks, 6);
    ck_assert_uint_eq(ln.offset, 32u * 3072u);
    ck_assert_uint_eq(ln.bytes, 32u * 3072u);
    ck_assert_uint_eq(ln.bytes, 6u * 16384u);
    kvb_ledger_action g = expect_act(l, KVB_ACT_GRANT, "m", ln.id);
    ck_assert_str_eq(g.loan.lender, "b");
    ck_assert_uint_eq(g.loan.n_master_blocks, 6);
    /* ... and one of A: 8 blocks of 4096 = 2 master blocks. */
    ck_assert_int_eq(kvb_ledger_offer(l, "a", 248, 8, 0, &ln, why, sizeof why), KVB_OK);
    ck_assert_uint_eq(ln.n_master_blocks, 2);
    ck_assert_uint_eq(kvb_ledger_n_lent(l, "a"), 8);
    ck_assert_uint_eq(kvb_ledger_n_lent(l, "b"), 32);
    ck_assert_uint_eq(kvb_ledger_n_borrowed(l), 8);

    /* A worker whose unit would exceed its own region can never lend: no MEU. */
    reg(l, "tiny", KVB_ROLE_WORKER, 13, &G_B, 8); /* 8 * 3072 bytes < 49152 */
    ck_assert(!kvb_ledger_find(l, "tiny")->has_meu);
    ck_assert_int_eq(kvb_ledger_offer(l, "tiny", 0, 16, 0, NULL, why, sizeof why), KVB_ERR_STATE);
    ck_assert_ptr_nonnull(strstr(why, "elastic unit"));

    /* The MEU goes with the master. */
    kvb_ledger_model_dead(l, "m", "test", 0);
    ck_assert(!kvb_ledger_find(l, "a")->has_meu);
    kvb_ledger_destroy(l);
}
KVB_TEST_END

KVB_TEST(ledger_offer_validation) {
    kvb_ledger *l = new_ledger();
    char why[256] = "";
    reg(l, "a", KVB_ROLE_WORKER, 11, &G_A, 256);
    /* no master */
    ck_assert_int_eq(kvb_ledger_offer(l, "a", 240, 16, 0, NULL, why, sizeof why), KVB_ERR_STATE);
    ck_assert_msg(strstr(why, "no live master") != NULL, "reason: %s", why);
    reg(l, "m", KVB_ROLE_MASTER, 10, &G_M, 64);
    uint64_t e0 = kvb_ledger_epoch(l);
    /* not a multiple of the MEU (4), or empty */
    ck_assert_int_eq(kvb_ledger_offer(l, "a", 240, 6, 0, NULL, why, sizeof why), KVB_ERR_INVALID);
    ck_assert_msg(strstr(why, "multiple of the MEU") != NULL, "reason: %s", why);
    ck_assert_int_eq(kvb_ledger_offer(l, "a", 240, 0, 0, NULL, why, sizeof why), KVB_ERR_INVALID);
    /* out of the region's 256 blocks */
    ck_assert_int_eq(kvb_ledger_offer(l, "a", 252, 8, 0, NULL, why, sizeof why), KVB_ERR_INVALID);
    ck_assert_msg(strstr(why, "outside") != NULL, "reason: %s", why);
    ck_assert_int_eq(kvb_ledger_offer(l, "a", UINT32_MAX - 3, 4, 0, NULL, why, sizeof why), KVB_ERR_INVALID);
    /* wrong sender: unknown, or the master */
    ck_assert_int_eq(kvb_ledger_offer(l, "ghost", 0, 4, 0, NULL, why, sizeof why), KVB_ERR_NOT_FOUND);
    ck_assert_int_eq(kvb_ledger_offer(l, "m", 0, 4, 0, NULL, why, sizeof why), KVB_ERR_PROTOCOL);
    expect_no_act(l);
    ck_assert_uint_eq(kvb_ledger_epoch(l), e0); /* refusals change nothing */
    ck_assert_int_eq(kvb_ledger_n_loans(l), 0);
    /* accepted: epoch bumps, Grant queued */
    uint64_t id = lend(l, "a", 240, 16);
    ck_assert_uint_gt(kvb_ledger_epoch(l), e0);
    /* overlap with it, partial or inside */
    ck_assert_int_eq(kvb_ledger_offer(l, "a", 236, 8, 0, NULL, why, sizeof why), KVB_ERR_INVALID);
    ck_assert_msg(strstr(why, "overlap") != NULL, "reason: %s", why);
    ck_assert_int_eq(kvb_ledger_offer(l, "a", 244, 4, 0, NULL, why, sizeof why), KVB_ERR_INVALID);
    /* adjacent below is fine */
    uint64_t id2 = lend(l, "a", 224, 16);
    ck_assert_uint_ne(id, id2);
    /* a draining worker offers no more */
    int n = 0;
    ck_assert_int_eq(kvb_ledger_drain(l, "a", 0, &n, why, sizeof why), KVB_OK);
    ck_assert_int_eq(n, 2);
    ck_assert_int_eq(kvb_ledger_offer(l, "a", 200, 8, 0, NULL, why, sizeof why), KVB_ERR_STATE);
    ck_assert_msg(strstr(why, "draining") != NULL, "reason: %s", why);
    kvb_ledger_destroy(l);
}
KVB_TEST_END

/* Registers `name` with its region in `memory` on `device`; a master with `stream` streams lent blocks. */
static void reg_mem(kvb_ledger *l, const char *name, kvb_role role, uint32_t pid, const char *memory,
                    uint32_t device, int stream) {
    const kvb_kv_geom *g = role == KVB_ROLE_MASTER ? &G_M : &G_A;
    uint32_t cap = role == KVB_ROLE_MASTER ? 64 : 256;
    kvb_ledger_reg r = {.name = name, .role = role, .pid = pid, .geom = *g, .region = "0123abcd",
                        .region_bytes = (uint64_t)cap * kvb_kv_block_bytes(g), .capacity = cap, .n_own = cap,
                        .endpoint = "ipc:///tmp/none", .model = "m", .memory = memory, .device = device,
                        .stream = stream};
    char why[256] = "";
    kvb_status st = kvb_ledger_register(l, &r, 0, why, sizeof why);
    ck_assert_msg(st == KVB_OK, "register %s: %s (%s)", name, kvb_status_str(st), why);
}

KVB_TEST(ledger_refuses_regions_off_the_masters_plan) {
    kvb_ledger *l = new_ledger();
    char why[512] = "";
    /* host memory against device memory: never, whoever registers first */
    reg_mem(l, "a", KVB_ROLE_WORKER, 11, "cuda", 0, 0);
    reg_mem(l, "m", KVB_ROLE_MASTER, 10, "host", 0, 0);
    const kvb_ledger_model *a = kvb_ledger_find(l, "a");
    ck_assert(!a->has_meu);
    ck_assert_msg(strstr(a->lend_blocked, "different memory kinds") != NULL, "blocked: %s", a->lend_blocked);
    ck_assert_int_eq(kvb_ledger_offer(l, "a", 240, 16, 0, NULL, why, sizeof why), KVB_ERR_STATE);
    ck_assert_msg(strstr(why, "worker a has cuda memory and master m has host memory") != NULL, "reason: %s", why);
    ck_assert_int_eq(kvb_ledger_lend_request(l, "a", 16, why, sizeof why), KVB_ERR_STATE);
    ck_assert_msg(strstr(why, "different memory kinds") != NULL, "reason: %s", why);
    expect_no_act(l);
    /* the same device kind on another device, with a master that reads lent blocks in place */
    reg_mem(l, "m", KVB_ROLE_MASTER, 10, "cuda", 1, 0);
    ck_assert_int_eq(kvb_ledger_offer(l, "a", 240, 16, 0, NULL, why, sizeof why), KVB_ERR_STATE);
    ck_assert_msg(strstr(why, "on cuda device 0 and master m reads lent blocks in place on device 1") != NULL,
                  "reason: %s", why);
    /* ... which a streaming master can take (peer copies into its LSC) */
    reg_mem(l, "m", KVB_ROLE_MASTER, 10, "cuda", 1, 1);
    ck_assert(kvb_ledger_find(l, "a")->has_meu);
    ck_assert_str_eq(kvb_ledger_find(l, "a")->lend_blocked, "");
    lend(l, "a", 240, 16);
    /* the same device: in place */
    reg_mem(l, "b", KVB_ROLE_WORKER, 12, "cuda", 1, 0);
    lend(l, "b", 240, 16);
    /* no kind given means host memory (models of before this field) */
    reg_mem(l, "c", KVB_ROLE_WORKER, 13, NULL, 0, 0);
    ck_assert_str_eq(kvb_ledger_find(l, "c")->memory, "host");
    ck_assert_int_eq(kvb_ledger_offer(l, "c", 240, 16, 0, NULL, why, sizeof why), KVB_ERR_STATE);
    /* a malformed kind is refused at registration */
    kvb_ledger_reg r = {.name = "d", .role = KVB_ROLE_WORKER, .pid = 14, .geom = G_A, .region = "/x",
                        .region_bytes = 256 * kvb_kv_block_bytes(&G_A), .capacity = 256, .n_own = 256,
                        .endpoint = "e", .memory = "Cuda!"};
    ck_assert_int_eq(kvb_ledger_register(l, &r, 0, why, sizeof why), KVB_ERR_INVALID);
    ck_assert_msg(strstr(why, "memory kind") != NULL, "reason: %s", why);
    kvb_ledger_destroy(l);
}
KVB_TEST_END

/* Registers master "m" (pid 10, 64 blocks of G_M) that can attach at most `max` master blocks (issue 10:
 * its LSC within its budget), reporting `loans`. */
static kvb_status reg_limited(kvb_ledger *l, kvb_role role, int limited, uint32_t max, const kvb_loan *loans,
                              int n_loans, char *why) {
    kvb_ledger_reg r = {.name = role == KVB_ROLE_MASTER ? "m" : "a", .role = role,
                        .pid = role == KVB_ROLE_MASTER ? 10 : 11, .geom = role == KVB_ROLE_MASTER ? G_M : G_A,
                        .region = "/kvb-test-region", .capacity = 64, .n_own = 64, .endpoint = "e", .model = "m",
                        .stream = role == KVB_ROLE_MASTER, .borrow_limited = limited, .max_borrow = max,
                        .loans = loans, .n_loans = n_loans};
    r.region_bytes = 64 * kvb_kv_block_bytes(&r.geom);
    return kvb_ledger_register(l, &r, 0, why, 256);
}

KVB_TEST(ledger_master_borrow_limit) {
    kvb_ledger *l = new_ledger();
    char why[256] = "";
    uint32_t room = 0;
    ck_assert_int_eq(reg_limited(l, KVB_ROLE_MASTER, 1, 5, NULL, 0, why), KVB_OK);
    ck_assert_int_eq(reg_limited(l, KVB_ROLE_WORKER, 0, 0, NULL, 0, why), KVB_OK);
    const kvb_ledger_model *a = kvb_ledger_find(l, "a"), *m = kvb_ledger_find(l, "m");
    ck_assert(a->has_meu && m->borrow_limited && m->max_borrow == 5);
    uint32_t mw = a->meu.meu_worker, mm = a->meu.meu_master; /* G_A : G_M = 4 : 1 */
    ck_assert_uint_eq(mw, 4);
    ck_assert_uint_eq(mm, 1);
    ck_assert(kvb_ledger_lend_room(l, "a", &room));
    ck_assert_uint_eq(room, 5 * mw);
    ck_assert(!kvb_ledger_lend_room(l, "m", &room)); /* the master has no room of its own */
    /* an offer beyond the room is refused with the numbers, and changes nothing */
    ck_assert_int_eq(kvb_ledger_offer(l, "a", 40, 24, 0, NULL, why, sizeof why), KVB_ERR_STATE);
    ck_assert_msg(strstr(why, "master m can attach 20 more of a's blocks (its layer stream cache streams at most 5 "
                              "master blocks, 0 borrowed or being granted), not 24") != NULL, "reason: %s", why);
    ck_assert_int_eq(kvb_ledger_n_loans(l), 0);
    expect_no_act(l);
    /* a Grant on its way counts: 3 of 5 granted, 2 left */
    kvb_loan ln;
    ck_assert_int_eq(kvb_ledger_offer(l, "a", 52, 12, 0, &ln, why, sizeof why), KVB_OK);
    expect_act(l, KVB_ACT_GRANT, "m", ln.id);
    ck_assert(kvb_ledger_lend_room(l, "a", &room) && room == 2 * mw);
    ck_assert_int_eq(kvb_ledger_offer(l, "a", 40, 12, 0, NULL, why, sizeof why), KVB_ERR_STATE);
    ck_assert_int_eq(kvb_ledger_grant_ack(l, "m", ln.id, 1, 0, why, sizeof why), KVB_OK);
    lend(l, "a", 44, 8);
    ck_assert(kvb_ledger_lend_room(l, "a", &room) && room == 0);
    ck_assert_uint_eq(kvb_ledger_n_borrowed(l), 5);
    /* a reclaim gives room back once the master acked it */
    uint32_t n = 0;
    ck_assert_int_eq(kvb_ledger_reclaim(l, "a", 8, 0, &n, why, sizeof why), KVB_OK);
    kvb_ledger_action rv = expect_act(l, KVB_ACT_REVOKE, "m", 0);
    ck_assert(kvb_ledger_lend_room(l, "a", &room) && room == 0); /* still the master's until its ack */
    ck_assert_int_eq(kvb_ledger_revoke_ack(l, "m", rv.loan.id, rv.epoch, 0, why, sizeof why), KVB_OK);
    expect_act(l, KVB_ACT_RECLAIMED, "a", rv.loan.id);
    ck_assert(kvb_ledger_lend_room(l, "a", &room) && room == 2 * mw);

    /* hostile or malformed limits: refused with a reason, the ledger unchanged */
    uint64_t epoch = kvb_ledger_epoch(l);
    ck_assert_int_eq(reg_limited(l, KVB_ROLE_WORKER, 1, 8, NULL, 0, why), KVB_ERR_INVALID); /* from a worker */
    ck_assert_msg(strstr(why, "max_borrow 8 from a worker: only a master limits its borrowing") != NULL, "%s", why);
    ck_assert_int_eq(reg_limited(l, KVB_ROLE_MASTER, 0, 8, NULL, 0, why), KVB_ERR_INVALID); /* no flag */
    ck_assert_msg(strstr(why, "a master without borrow_limited") != NULL, "reason: %s", why);
    ck_assert_int_eq(reg_limited(l, KVB_ROLE_MASTER, 1, (1u << 30) + 1, NULL, 0, why), KVB_ERR_INVALID);
    ck_assert_msg(strstr(why, "above 2^30") != NULL, "reason: %s", why);
    kvb_loan held[1] = {{.id = ln.id, .first_block = 52, .n_blocks = 12, .n_master_blocks = 3}};
    snprintf(held[0].lender, sizeof held[0].lender, "a");
    ck_assert_int_eq(reg_limited(l, KVB_ROLE_MASTER, 1, 2, held, 1, why), KVB_ERR_INVALID); /* holds more */
    ck_assert_msg(strstr(why, "below the 3 its reported loans hold") != NULL, "reason: %s", why);
    ck_assert_uint_eq(kvb_ledger_epoch(l), epoch);
    ck_assert(kvb_ledger_find(l, "m")->max_borrow == 5 && kvb_ledger_find(l, "a")->alive);
    ck_assert_uint_eq(kvb_ledger_n_borrowed(l), 3);
    expect_no_act(l);
    /* the same master registering again without a limit: no room limit any more */
    ck_assert_int_eq(reg_limited(l, KVB_ROLE_MASTER, 0, 0, held, 1, why), KVB_OK);
    ck_assert(!kvb_ledger_lend_room(l, "a", &room));
    kvb_ledger_destroy(l);
}
KVB_TEST_END

KVB_TEST(ledger_reclaim_lowest_first) {
    kvb_ledger *l = new_ledger();
    char why[256] = "";
    reg(l, "m", KVB_ROLE_MASTER, 10, &G_M, 64);
    reg(l, "a", KVB_ROLE_WORKER, 11, &G_A, 64);
    /* loans stack downward: the lowest is the newest */
    uint64_t l12 = lend(l, "a", 48, 16), l8 = lend(l, "a", 32, 16), l4 = lend(l, "a", 16, 8);
    ck_assert_uint_eq(kvb_ledger_n_lent(l, "a"), 40);
    /* 20 blocks: the loan at 16 (8 blocks) whole and the first 12 of the loan at 32 (16 blocks; whole
     * MEUs of 4 worker blocks), lowest first (issue 10: a reclaim takes back what it asks for) */
    uint32_t n = 0;
    uint64_t e0 = kvb_ledger_epoch(l);
    ck_assert_int_eq(kvb_ledger_reclaim(l, "a", 20, 0, &n, why, sizeof why), KVB_OK);
    ck_assert_uint_eq(n, 20);
    kvb_ledger_action r1 = expect_act(l, KVB_ACT_REVOKE, "m", l4);
    kvb_ledger_action r2 = expect_act(l, KVB_ACT_REVOKE, "m", l8);
    ck_assert(!r1.lender_dead && !r2.lender_dead);
    ck_assert_uint_eq(r1.loan.revoke_blocks, 0); /* all of it */
    ck_assert_uint_eq(r2.loan.revoke_blocks, 12);
    ck_assert_uint_eq(r2.loan.first_block, 32);
    ck_assert_uint_gt(r1.epoch, e0);
    ck_assert_uint_gt(r2.epoch, r1.epoch);
    expect_no_act(l); /* no Reclaimed before the RevokeAck */
    ck_assert_int_eq(kvb_ledger_loan(l, l4)->state, KVB_LOAN_REVOKING);
    ck_assert_int_eq(kvb_ledger_loan(l, l12)->state, KVB_LOAN_ACTIVE);
    /* asking again for what is on its way changes nothing; asking for more takes the next loan */
    ck_assert_int_eq(kvb_ledger_reclaim(l, "a", 20, 0, &n, why, sizeof why), KVB_OK);
    expect_no_act(l);
    /* a RevokeAck for a loan not being revoked is ignored: it stays */
    ck_assert_int_eq(kvb_ledger_revoke_ack(l, "m", l12, 0, 0, why, sizeof why), KVB_ERR_STATE);
    ck_assert_ptr_nonnull(kvb_ledger_loan(l, l12));
    expect_no_act(l);
    /* ... and only the master may ack */
    ck_assert_int_eq(kvb_ledger_revoke_ack(l, "a", l8, r2.epoch, 0, why, sizeof why), KVB_ERR_PROTOCOL);
    ck_assert_ptr_nonnull(kvb_ledger_loan(l, l8));
    /* the acks, in any order, each give exactly what was revoked back: the part of l8, the loan keeps
     * its end ([44, 48): 4 worker blocks = 1 master block) */
    ck_assert_int_eq(kvb_ledger_revoke_ack(l, "m", l8, r2.epoch, 0, why, sizeof why), KVB_OK);
    kvb_ledger_action rc = expect_act(l, KVB_ACT_RECLAIMED, "a", l8);
    ck_assert_uint_eq(rc.loan.first_block, 32);
    ck_assert_uint_eq(rc.loan.n_blocks, 12);
    expect_no_act(l);
    const kvb_loan *k8 = kvb_ledger_loan(l, l8);
    ck_assert_ptr_nonnull(k8);
    ck_assert_int_eq(k8->state, KVB_LOAN_ACTIVE);
    ck_assert_uint_eq(k8->first_block, 44);
    ck_assert_uint_eq(k8->n_blocks, 4);
    ck_assert_uint_eq(k8->n_master_blocks, 1);
    ck_assert_uint_eq(k8->offset, 44u * 4096u);
    ck_assert_uint_eq(k8->bytes, 4u * 4096u);
    /* a repeated ack of the part finds the loan active: ignored, nothing more comes back */
    ck_assert_int_eq(kvb_ledger_revoke_ack(l, "m", l8, r2.epoch, 0, why, sizeof why), KVB_ERR_STATE);
    expect_no_act(l);
    ck_assert_int_eq(kvb_ledger_revoke_ack(l, "m", l4, r1.epoch, 0, why, sizeof why), KVB_OK);
    expect_act(l, KVB_ACT_RECLAIMED, "a", l4);
    ck_assert_int_eq(kvb_ledger_revoke_ack(l, "m", l4, r1.epoch, 0, why, sizeof why), KVB_ERR_NOT_FOUND);
    ck_assert_uint_eq(kvb_ledger_n_lent(l, "a"), 20);
    ck_assert_int_eq(kvb_ledger_reclaim(l, "a", 30, 0, &n, why, sizeof why), KVB_OK);
    ck_assert_uint_eq(n, 20);
    expect_act(l, KVB_ACT_REVOKE, "m", l8);
    expect_act(l, KVB_ACT_REVOKE, "m", l12);
    /* a worker with nothing lent */
    reg(l, "b", KVB_ROLE_WORKER, 12, &G_A, 64);
    ck_assert_int_eq(kvb_ledger_reclaim(l, "b", 4, 0, &n, why, sizeof why), KVB_ERR_STATE);
    kvb_ledger_destroy(l);
}
KVB_TEST_END

/* Partial reclaim (issue 10): a partial revoke still in flight is widened to the whole loan by a drain
 * (or the lender's death), and the late ack of the part then finishes nothing. */
KVB_TEST(ledger_partial_reclaim_widened) {
    kvb_ledger *l = new_ledger();
    char why[256] = "";
    reg(l, "m", KVB_ROLE_MASTER, 10, &G_M, 64);
    reg(l, "a", KVB_ROLE_WORKER, 11, &G_A, 64);
    uint64_t id = lend(l, "a", 32, 32);
    uint32_t n = 0;
    ck_assert_int_eq(kvb_ledger_reclaim(l, "a", 5, 0, &n, why, sizeof why), KVB_OK);
    ck_assert_uint_eq(n, 8); /* rounded up to whole MEUs of 4 */
    kvb_ledger_action p = expect_act(l, KVB_ACT_REVOKE, "m", id);
    ck_assert_uint_eq(p.loan.revoke_blocks, 8);
    /* asked again: it is on its way */
    ck_assert_int_eq(kvb_ledger_reclaim(l, "a", 8, 0, &n, why, sizeof why), KVB_OK);
    ck_assert_uint_eq(n, 8);
    expect_no_act(l);
    int nl = 0;
    ck_assert_int_eq(kvb_ledger_drain(l, "a", 0, &nl, why, sizeof why), KVB_OK);
    ck_assert_int_eq(nl, 1);
    expect_act(l, KVB_ACT_LEND_REQUEST, "a", 0);
    kvb_ledger_action w = expect_act(l, KVB_ACT_REVOKE, "m", id);
    ck_assert_uint_eq(w.loan.revoke_blocks, 0); /* the whole loan now */
    ck_assert_uint_gt(w.epoch, p.epoch);
    /* the part's ack comes first: it finishes nothing */
    ck_assert_int_eq(kvb_ledger_revoke_ack(l, "m", id, p.epoch, 0, why, sizeof why), KVB_ERR_STATE);
    ck_assert_msg(strstr(why, "partial") != NULL, "reason: %s", why);
    expect_no_act(l);
    ck_assert_int_eq(kvb_ledger_loan(l, id)->n_blocks, 32);
    ck_assert_int_eq(kvb_ledger_revoke_ack(l, "m", id, w.epoch, 0, why, sizeof why), KVB_OK);
    kvb_ledger_action rc = expect_act(l, KVB_ACT_RECLAIMED, "a", id);
    ck_assert_uint_eq(rc.loan.first_block, 32);
    ck_assert_uint_eq(rc.loan.n_blocks, 32);
    ck_assert_int_eq(kvb_ledger_n_loans(l), 0);
    kvb_ledger_destroy(l);
}
KVB_TEST_END

/* A coordinator restart in the middle of a partial revoke (issue 10). A lends [32, 64) (8 master
 * blocks); a reclaim of 8 revokes its front [32, 40); then the coordinator dies and a new one (a new
 * ledger) hears the models register again, in `worker_first` order. `applied`: the master had shrunk
 * its loan to [40, 64) and acked (the ack was lost), else it still holds all of it. Whatever the order,
 * no worker block may end up both lent and the worker's: every block of [32, 64) is either in a loan
 * both sides hold with the same range, or returned to the worker (Reclaimed, after the master dropped
 * what it had of it), and a block that the master reads is never returned. (Before the fix this test
 * came with, `applied` returned all of [32, 64) to the worker at once while the master still read
 * [40, 64): the worker's report overlapped a loan the master reported before the worker registered.)
 * With `applied` the partial revoke is finished: the front goes back, the loan keeps [40, 64). */
static void restart_mid_partial(int applied, int worker_first) {
    kvb_ledger *l = new_ledger();
    char why[256] = "";
    reg(l, "m", KVB_ROLE_MASTER, 10, &G_M, 64);
    reg(l, "a", KVB_ROLE_WORKER, 11, &G_A, 64);
    uint64_t id = lend(l, "a", 32, 32);
    uint32_t n = 0;
    ck_assert_int_eq(kvb_ledger_reclaim(l, "a", 8, 0, &n, why, sizeof why), KVB_OK);
    kvb_ledger_action p = expect_act(l, KVB_ACT_REVOKE, "m", id);
    ck_assert_uint_eq(p.loan.revoke_blocks, 8);
    kvb_ledger_destroy(l); /* the coordinator dies */

    l = new_ledger();
    kvb_loan wl = {.id = id, .first_block = 32, .n_blocks = 32, .n_master_blocks = 8, .epoch = p.loan.epoch};
    kvb_loan ml = wl;
    if (applied) {
        ml.first_block = 40;
        ml.n_blocks = 24;
        ml.n_master_blocks = 6;
    }
    snprintf(wl.lender, sizeof wl.lender, "a");
    snprintf(ml.lender, sizeof ml.lender, "a");
    for (int k = 0; k < 2; k++) {
        int worker = (k == 0) == (worker_first != 0);
        kvb_status st = worker ? reg_full(l, "a", KVB_ROLE_WORKER, 11, &G_A, 64, &wl, 1, 10, why)
                               : reg_full(l, "m", KVB_ROLE_MASTER, 10, &G_M, 64, &ml, 1, 10, why);
        ck_assert_msg(st == KVB_OK, "register again: %s", why);
    }
    /* the models answer what they are told: the master acks every Revoke (dropping its range), the
     * worker takes back every Reclaimed range; the grace periods pass */
    uint8_t master_has[64] = {0}, worker_has[64] = {0}; /* per worker block; [32, 64) lent */
    for (uint32_t b = ml.first_block; b < ml.first_block + ml.n_blocks; b++) master_has[b] = 1;
    for (int b = 0; b < 32; b++) worker_has[b] = 1;
    for (int round = 0; round < 20; round++) { /* 50 ms apart, both models heartbeating */
        uint64_t now = 10 + (uint64_t)round * 50;
        kvb_ledger_heartbeat(l, "m", NULL, now);
        kvb_ledger_heartbeat(l, "a", NULL, now);
        kvb_ledger_tick(l, now);
        kvb_ledger_action a;
        while (kvb_ledger_pop_action(l, &a)) {
            if (a.kind == KVB_ACT_REVOKE) {
                uint32_t f = a.loan.first_block, cnt = a.loan.revoke_blocks ? a.loan.revoke_blocks : a.loan.n_blocks;
                for (uint32_t b = f; b < f + cnt && b < 64; b++) master_has[b] = 0;
                kvb_status st = kvb_ledger_revoke_ack(l, "m", a.loan.id, a.epoch, now, why, sizeof why);
                ck_assert_msg(st == KVB_OK || st == KVB_ERR_NOT_FOUND || st == KVB_ERR_STATE, "ack: %s", why);
            } else if (a.kind == KVB_ACT_RECLAIMED) {
                for (uint32_t b = a.loan.first_block; b < a.loan.first_block + a.loan.n_blocks && b < 64; b++) {
                    ck_assert_msg(!master_has[b], "block %u returned to the worker while the master holds it", b);
                    worker_has[b] = 1;
                }
            }
        }
    }
    /* the end state: what the ledger says is lent, the master holds and the worker does not; the rest is
     * the worker's */
    uint8_t lent[64] = {0};
    for (int i = 0; i < kvb_ledger_n_loans(l); i++) {
        const kvb_loan *ln = kvb_ledger_loan_at(l, i);
        ck_assert_int_eq(ln->state, KVB_LOAN_ACTIVE);
        for (uint32_t b = ln->first_block; b < ln->first_block + ln->n_blocks; b++) lent[b] = 1;
    }
    for (int b = 32; b < 64; b++) {
        ck_assert_msg(lent[b] ? master_has[b] && !worker_has[b] : worker_has[b] && !master_has[b],
                      "block %d (applied %d, worker first %d): lent %d, master %d, worker %d", b, applied,
                      worker_first, lent[b], master_has[b], worker_has[b]);
        ck_assert_int_eq(lent[b], applied ? b >= 40 : 1); /* nothing dropped that need not be */
    }
    /* the worker, still short of blocks, asks again (it repeats an unanswered ReclaimRequest): what is
     * still lent comes back by the front, as before the restart */
    if (kvb_ledger_n_loans(l) > 0) {
        const kvb_loan *ln = kvb_ledger_loan_at(l, 0);
        uint32_t f = ln->first_block, total = ln->n_blocks;
        ck_assert_int_eq(kvb_ledger_reclaim(l, "a", 8, 1010, &n, why, sizeof why), KVB_OK);
        kvb_ledger_action rv = expect_act(l, KVB_ACT_REVOKE, "m", ln->id);
        ck_assert_uint_eq(rv.loan.revoke_blocks, total > 8 ? 8 : 0);
        ck_assert_int_eq(kvb_ledger_revoke_ack(l, "m", rv.loan.id, rv.epoch, 1010, why, sizeof why), KVB_OK);
        kvb_ledger_action rc = expect_act(l, KVB_ACT_RECLAIMED, "a", rv.loan.id);
        ck_assert_uint_eq(rc.loan.first_block, f);
        ck_assert_uint_eq(rc.loan.n_blocks, total > 8 ? 8 : total);
    }
    kvb_ledger_destroy(l);
}

KVB_TEST(ledger_restart_mid_partial_revoke) {
    for (int applied = 0; applied < 2; applied++)
        for (int worker_first = 0; worker_first < 2; worker_first++) restart_mid_partial(applied, worker_first);
}
KVB_TEST_END

KVB_TEST(ledger_lend_reclaim_counters) {
    /* The numbers behind the gateway's kvbank_lend / kvbank_reclaim metrics: loans that became active
     * and loans given back, with their latencies (offer -> GrantAck, Revoke -> RevokeAck). */
    kvb_ledger *l = new_ledger();
    char why[256] = "";
    reg(l, "m", KVB_ROLE_MASTER, 10, &G_M, 64);
    reg(l, "a", KVB_ROLE_WORKER, 11, &G_A, 64);
    kvb_loan ln;
    ck_assert_int_eq(kvb_ledger_offer(l, "a", 48, 16, 100, &ln, why, sizeof why), KVB_OK);
    expect_act(l, KVB_ACT_GRANT, "m", ln.id);
    ck_assert_int_eq(kvb_ledger_grant_ack(l, "m", ln.id, 1, 130, why, sizeof why), KVB_OK);
    kvb_loan bad;
    ck_assert_int_eq(kvb_ledger_offer(l, "a", 32, 16, 140, &bad, why, sizeof why), KVB_OK);
    expect_act(l, KVB_ACT_GRANT, "m", bad.id);
    ck_assert_int_eq(kvb_ledger_grant_ack(l, "m", bad.id, 0, 150, why, sizeof why), KVB_OK); /* failed: no lend */
    expect_act(l, KVB_ACT_RECLAIMED, "a", bad.id);
    const kvb_ledger_model *a = kvb_ledger_find(l, "a");
    ck_assert_uint_eq(a->n_lends, 1);
    ck_assert_uint_eq(a->lend_ms_total, 30);
    ck_assert_uint_eq(a->n_reclaims, 0);
    uint32_t n = 0;
    ck_assert_int_eq(kvb_ledger_reclaim(l, "a", 16, 200, &n, why, sizeof why), KVB_OK);
    kvb_ledger_action r = expect_act(l, KVB_ACT_REVOKE, "m", ln.id);
    ck_assert_int_eq(kvb_ledger_revoke_ack(l, "m", ln.id, r.epoch, 260, why, sizeof why), KVB_OK);
    a = kvb_ledger_find(l, "a");
    ck_assert_uint_eq(a->n_reclaims, 1);
    ck_assert_uint_eq(a->reclaim_ms_total, 60);
    ck_assert_uint_eq(kvb_ledger_find(l, "m")->n_lends, 0);
    kvb_ledger_destroy(l);
}
KVB_TEST_END

KVB_TEST(ledger_grant_failures) {
    kvb_ledger *l = new_ledger();
    char why[256] = "";
    reg(l, "m", KVB_ROLE_MASTER, 10, &G_M, 64);
    reg(l, "a", KVB_ROLE_WORKER, 11, &G_A, 64);
    kvb_loan ln;
    /* GrantAck(false): the loan is cancelled, the worker grows back */
    ck_assert_int_eq(kvb_ledger_offer(l, "a", 60, 4, 0, &ln, why, sizeof why), KVB_OK);
    expect_act(l, KVB_ACT_GRANT, "m", ln.id);
    ck_assert_int_eq(kvb_ledger_grant_ack(l, "a", ln.id, 0, 0, why, sizeof why), KVB_ERR_PROTOCOL);
    ck_assert_int_eq(kvb_ledger_grant_ack(l, "m", ln.id, 0, 0, why, sizeof why), KVB_OK);
    expect_act(l, KVB_ACT_RECLAIMED, "a", ln.id);
    ck_assert_int_eq(kvb_ledger_n_loans(l), 0);
    /* a Grant that could not be delivered */
    ck_assert_int_eq(kvb_ledger_offer(l, "a", 60, 4, 0, &ln, why, sizeof why), KVB_OK);
    expect_act(l, KVB_ACT_GRANT, "m", ln.id);
    ck_assert_int_eq(kvb_ledger_grant_undeliverable(l, ln.id, 0), KVB_OK);
    expect_act(l, KVB_ACT_RECLAIMED, "a", ln.id);
    /* no GrantAck within the silence limit (4 x 100 ms): revoked, not returned blindly */
    ck_assert_int_eq(kvb_ledger_offer(l, "a", 60, 4, 1000, &ln, why, sizeof why), KVB_OK);
    expect_act(l, KVB_ACT_GRANT, "m", ln.id);
    kvb_ledger_heartbeat(l, "m", NULL, 1300);
    kvb_ledger_heartbeat(l, "a", NULL, 1300);
    kvb_ledger_tick(l, 1300);
    expect_no_act(l);
    kvb_ledger_tick(l, 1400);
    expect_act(l, KVB_ACT_REVOKE, "m", ln.id);
    expect_no_act(l);
    /* an unacknowledged Revoke is sent again */
    kvb_ledger_heartbeat(l, "m", NULL, 1700);
    kvb_ledger_heartbeat(l, "a", NULL, 1700);
    kvb_ledger_tick(l, 1800);
    expect_act(l, KVB_ACT_REVOKE, "m", ln.id);
    kvb_ledger_destroy(l);
}
KVB_TEST_END

KVB_TEST(ledger_master_death_returns_loans) {
    kvb_ledger *l = new_ledger();
    char why[256] = "";
    reg(l, "m", KVB_ROLE_MASTER, 10, &G_M, 64);
    reg(l, "a", KVB_ROLE_WORKER, 11, &G_A, 64);
    reg(l, "b", KVB_ROLE_WORKER, 12, &G_A, 64);
    uint64_t la = lend(l, "a", 60, 4), lb = lend(l, "b", 56, 8);
    uint64_t lb2 = lend(l, "b", 48, 8);
    uint32_t n;
    ck_assert_int_eq(kvb_ledger_reclaim(l, "b", 8, 0, &n, why, sizeof why), KVB_OK); /* lb2 is revoking */
    expect_act(l, KVB_ACT_REVOKE, "m", lb2);
    uint64_t e0 = kvb_ledger_epoch(l);
    g_dead_pid = 10;
    kvb_ledger_heartbeat(l, "a", NULL, 100);
    kvb_ledger_heartbeat(l, "b", NULL, 100);
    kvb_ledger_tick(l, 100); /* the pid check finds it */
    ck_assert(!kvb_ledger_find(l, "m")->alive);
    ck_assert_ptr_nonnull(strstr(kvb_ledger_find(l, "m")->death, "pid"));
    /* every loan, the revoking one included, goes back to its lender */
    int got_a = 0, got_b = 0, got_b2 = 0;
    kvb_ledger_action act;
    while (kvb_ledger_pop_action(l, &act)) {
        ck_assert_int_eq(act.kind, KVB_ACT_RECLAIMED);
        got_a += act.loan.id == la && !strcmp(act.to, "a");
        got_b += act.loan.id == lb && !strcmp(act.to, "b");
        got_b2 += act.loan.id == lb2 && !strcmp(act.to, "b");
    }
    ck_assert(got_a == 1 && got_b == 1 && got_b2 == 1);
    ck_assert_int_eq(kvb_ledger_n_loans(l), 0);
    ck_assert_uint_ge(kvb_ledger_epoch(l), e0 + 3);
    /* a late RevokeAck of the dead master is not from a registered model */
    ck_assert_int_eq(kvb_ledger_revoke_ack(l, "m", lb2, 0, 0, why, sizeof why), KVB_ERR_NOT_FOUND);
    /* offers are refused until a master registers */
    ck_assert_int_eq(kvb_ledger_offer(l, "a", 60, 4, 100, NULL, why, sizeof why), KVB_ERR_STATE);
    kvb_ledger_destroy(l);
}
KVB_TEST_END

KVB_TEST(ledger_worker_death_revokes_lender_dead) {
    kvb_ledger *l = new_ledger();
    char why[256] = "";
    reg(l, "m", KVB_ROLE_MASTER, 10, &G_M, 64);
    reg(l, "a", KVB_ROLE_WORKER, 11, &G_A, 64);
    uint64_t l1 = lend(l, "a", 60, 4), l2 = lend(l, "a", 56, 4);
    uint32_t n;
    ck_assert_int_eq(kvb_ledger_reclaim(l, "a", 4, 0, &n, why, sizeof why), KVB_OK);
    kvb_ledger_action r = expect_act(l, KVB_ACT_REVOKE, "m", l2);
    ck_assert(!r.lender_dead);
    /* silent past 4 x 100 ms while the master heartbeats */
    kvb_ledger_heartbeat(l, "m", NULL, 350);
    kvb_ledger_tick(l, 350);
    ck_assert(kvb_ledger_find(l, "a")->alive);
    kvb_ledger_heartbeat(l, "m", NULL, 450);
    kvb_ledger_tick(l, 450);
    ck_assert(!kvb_ledger_find(l, "a")->alive);
    ck_assert(kvb_ledger_find(l, "m")->alive);
    /* both loans: revoked as lender_dead (the one already revoking is told again, sharper) */
    int seen1 = 0, seen2 = 0;
    kvb_ledger_action act;
    while (kvb_ledger_pop_action(l, &act)) {
        ck_assert_int_eq(act.kind, KVB_ACT_REVOKE);
        ck_assert(act.lender_dead);
        seen1 += act.loan.id == l1;
        seen2 += act.loan.id == l2;
    }
    ck_assert(seen1 == 1 && seen2 == 1);
    /* acks delete them; nobody gets Reclaimed */
    ck_assert_int_eq(kvb_ledger_revoke_ack(l, "m", l1, 0, 0, why, sizeof why), KVB_OK);
    ck_assert_int_eq(kvb_ledger_revoke_ack(l, "m", l2, 0, 0, why, sizeof why), KVB_OK);
    expect_no_act(l);
    ck_assert_int_eq(kvb_ledger_n_loans(l), 0);
    /* heartbeats of the dead worker: "register again" */
    ck_assert_int_eq(kvb_ledger_heartbeat(l, "a", NULL, 500), 0);
    kvb_ledger_destroy(l);
}
KVB_TEST_END

static int g_fenced_pid;
static void fake_fence(void *ud, const char *name, uint32_t pid) { g_fenced_pid = (int)pid; }

KVB_TEST(ledger_silent_master_fenced_first) {
    /* A master that stops heartbeating while holding loans, with its pid alive, is fenced (stopped)
     * before any lender gets a block back: no Reclaimed while it could still touch the memory. */
    kvb_ledger_opts o = {.heartbeat_ms = 100, .heartbeat_misses = 4, .pid_alive = fake_pid_alive,
                         .fence = fake_fence};
    kvb_ledger *l = NULL;
    ck_assert_int_eq(kvb_ledger_create(&o, &l), KVB_OK);
    g_dead_pid = -1;
    g_fenced_pid = 0;
    reg(l, "m", KVB_ROLE_MASTER, 10, &G_M, 64);
    reg(l, "a", KVB_ROLE_WORKER, 11, &G_A, 64);
    uint64_t la = lend(l, "a", 60, 4);
    kvb_ledger_heartbeat(l, "a", NULL, 1000);
    kvb_ledger_tick(l, 1000); /* m silent for 1000 ms > 400 ms, pid alive */
    ck_assert_int_eq(g_fenced_pid, 10);
    ck_assert(kvb_ledger_find(l, "m")->alive);
    expect_no_act(l);
    ck_assert_int_eq(kvb_ledger_n_loans(l), 1);
    g_dead_pid = 10; /* the fence worked */
    kvb_ledger_heartbeat(l, "a", NULL, 1100);
    kvb_ledger_tick(l, 1100);
    ck_assert(!kvb_ledger_find(l, "m")->alive);
    kvb_ledger_action act = expect_act(l, KVB_ACT_RECLAIMED, "a", la);
    ck_assert_uint_eq(act.loan.id, la);
    ck_assert_int_eq(kvb_ledger_n_loans(l), 0);
    kvb_ledger_destroy(l);
}
KVB_TEST_END

KVB_TEST(ledger_register_rules) {
    kvb_ledger *l = new_ledger();
    char why[256] = "";
    reg(l, "m", KVB_ROLE_MASTER, 10, &G_M, 64);
    reg(l, "a", KVB_ROLE_WORKER, 11, &G_A, 64);
    /* a second master while the first lives */
    ck_assert_int_eq(reg_full(l, "m2", KVB_ROLE_MASTER, 20, &G_M, 64, NULL, 0, 0, why), KVB_ERR_STATE);
    ck_assert_msg(strstr(why, "master") != NULL, "reason: %s", why);
    /* a name held by another live pid */
    ck_assert_int_eq(reg_full(l, "a", KVB_ROLE_WORKER, 21, &G_A, 64, NULL, 0, 0, why), KVB_ERR_STATE);
    ck_assert_msg(strstr(why, "live pid 11") != NULL, "reason: %s", why);
    /* bad geometries and sizes */
    kvb_kv_geom bad = G_A;
    bad.head_dim = 0;
    ck_assert_int_eq(reg_full(l, "c", KVB_ROLE_WORKER, 22, &bad, 64, NULL, 0, 0, why), KVB_ERR_INVALID);
    ck_assert_msg(strstr(why, "geometry") != NULL, "reason: %s", why);
    kvb_ledger_reg r = {.name = "c", .role = KVB_ROLE_WORKER, .pid = 22, .geom = G_A, .region = "/x",
                        .region_bytes = 4096 * 10, .capacity = 11};
    ck_assert_int_eq(kvb_ledger_register(l, &r, 0, why, sizeof why), KVB_ERR_INVALID); /* 11 blocks in 10 */
    r.capacity = 10;
    r.name = "bad name";
    ck_assert_int_eq(kvb_ledger_register(l, &r, 0, why, sizeof why), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_ledger_n_models(l), 2);
    /* a new process under the name of one whose pid is gone replaces it; its loans were revoked */
    uint64_t la = lend(l, "a", 60, 4);
    g_dead_pid = 11;
    ck_assert_int_eq(reg_full(l, "a", KVB_ROLE_WORKER, 21, &G_A, 64, NULL, 0, 0, why), KVB_OK);
    kvb_ledger_action act = expect_act(l, KVB_ACT_REVOKE, "m", la);
    ck_assert(act.lender_dead);
    ck_assert_uint_eq(kvb_ledger_find(l, "a")->pid, 21);
    ck_assert_uint_eq(kvb_ledger_n_lent(l, "a"), 0);
    /* the new process may lend the same range of its own (new) region at once */
    lend(l, "a", 60, 4);
    ck_assert_int_eq(kvb_ledger_revoke_ack(l, "m", la, 0, 0, why, sizeof why), KVB_OK);
    expect_no_act(l); /* the old loan's Reclaimed would reach the new process: none */
    /* a new master once the old one's pid is gone */
    g_dead_pid = 10;
    ck_assert_int_eq(reg_full(l, "m2", KVB_ROLE_MASTER, 30, &G_M, 64, NULL, 0, 0, why), KVB_OK);
    ck_assert(!kvb_ledger_find(l, "m")->alive);
    ck_assert_str_eq(kvb_ledger_master(l)->name, "m2");
    kvb_ledger_destroy(l);
}
KVB_TEST_END

KVB_TEST(ledger_drain) {
    kvb_ledger *l = new_ledger();
    char why[256] = "";
    reg(l, "m", KVB_ROLE_MASTER, 10, &G_M, 64);
    reg(l, "a", KVB_ROLE_WORKER, 11, &G_A, 64);
    reg(l, "b", KVB_ROLE_WORKER, 12, &G_A, 64);
    uint64_t la = lend(l, "a", 60, 4), lb = lend(l, "b", 60, 4);
    /* Control(LEND) asks the worker */
    ck_assert_int_eq(kvb_ledger_lend_request(l, "b", 8, why, sizeof why), KVB_OK);
    kvb_ledger_action act = expect_act(l, KVB_ACT_LEND_REQUEST, "b", 0);
    ck_assert_uint_eq(act.n_blocks, 8);
    ck_assert(!act.drain);
    ck_assert_int_eq(kvb_ledger_lend_request(l, "m", 8, why, sizeof why), KVB_ERR_INVALID);
    /* drain a worker: told, and its loans revoked */
    int n = 0;
    ck_assert_int_eq(kvb_ledger_drain(l, "a", 0, &n, why, sizeof why), KVB_OK);
    ck_assert_int_eq(n, 1);
    act = expect_act(l, KVB_ACT_LEND_REQUEST, "a", 0);
    ck_assert(act.drain);
    expect_act(l, KVB_ACT_REVOKE, "m", la);
    expect_no_act(l);
    ck_assert_int_eq(kvb_ledger_lend_request(l, "a", 4, why, sizeof why), KVB_ERR_STATE);
    /* drain the master: everything revoked, nothing lent any more */
    ck_assert_int_eq(kvb_ledger_drain(l, "m", 0, &n, why, sizeof why), KVB_OK);
    ck_assert_int_eq(n, 1); /* la was already being revoked */
    expect_act(l, KVB_ACT_REVOKE, "m", lb);
    expect_no_act(l);
    ck_assert_int_eq(kvb_ledger_offer(l, "b", 52, 4, 0, NULL, why, sizeof why), KVB_ERR_STATE);
    ck_assert_msg(strstr(why, "master m is draining") != NULL, "reason: %s", why);
    ck_assert_int_eq(kvb_ledger_drain(l, "ghost", 0, &n, why, sizeof why), KVB_ERR_NOT_FOUND);
    /* undrain: the master borrows again, the worker is told (LendRequest of 0 blocks, no drain) and may
     * be asked to lend again; a model that does not drain is refused, naming it */
    ck_assert_int_eq(kvb_ledger_undrain(l, "b", why, sizeof why), KVB_ERR_STATE);
    ck_assert_msg(strstr(why, "b is not draining") != NULL, "reason: %s", why);
    expect_no_act(l);
    ck_assert_int_eq(kvb_ledger_undrain(l, "m", why, sizeof why), KVB_OK);
    expect_no_act(l);
    ck_assert(!kvb_ledger_find(l, "m")->draining);
    ck_assert_int_eq(kvb_ledger_undrain(l, "a", why, sizeof why), KVB_OK);
    act = expect_act(l, KVB_ACT_LEND_REQUEST, "a", 0);
    ck_assert(!act.drain);
    ck_assert_uint_eq(act.n_blocks, 0);
    expect_no_act(l);
    ck_assert_int_eq(kvb_ledger_lend_request(l, "a", 4, why, sizeof why), KVB_OK);
    expect_act(l, KVB_ACT_LEND_REQUEST, "a", 0);
    ck_assert_int_eq(kvb_ledger_undrain(l, "ghost", why, sizeof why), KVB_ERR_NOT_FOUND);
    kvb_ledger_destroy(l);
}
KVB_TEST_END

/* kvb_ledger_drain promises that nothing changes when it fails: every allocation it makes is made to fail
 * in turn (a fresh ledger each time), and the ledger must be as before with no action queued. */
KVB_TEST(ledger_drain_failure_changes_nothing) {
    int failed = 0;
    for (int k = 0; k < 32; k++) {
        kvb_ledger *l = new_ledger();
        char why[256] = "";
        reg(l, "m", KVB_ROLE_MASTER, 10, &G_M, 64);
        reg(l, "a", KVB_ROLE_WORKER, 11, &G_A, 64);
        uint64_t la = lend(l, "a", 60, 4);
        expect_no_act(l);
        uint64_t epoch = kvb_ledger_epoch(l);
        int state = (int)kvb_ledger_loan(l, la)->state, n = -1;
        kvb__alloc_fail_after(k);
        kvb_status st = kvb_ledger_drain(l, "a", 0, &n, why, sizeof why);
        kvb__alloc_fail_after(-1);
        if (st == KVB_OK) { /* k allocations were enough: the drain happened */
            ck_assert_int_eq(n, 1);
            ck_assert(kvb_ledger_find(l, "a")->draining);
            kvb_ledger_destroy(l);
            break;
        }
        ck_assert_int_eq(st, KVB_ERR_NOMEM);
        failed++;
        ck_assert(!kvb_ledger_find(l, "a")->draining);
        ck_assert_uint_eq(kvb_ledger_epoch(l), epoch);
        ck_assert_int_eq((int)kvb_ledger_loan(l, la)->state, state);
        expect_no_act(l);
        /* and it still works afterwards */
        ck_assert_int_eq(kvb_ledger_drain(l, "a", 0, &n, why, sizeof why), KVB_OK);
        ck_assert_int_eq(n, 1);
        kvb_ledger_destroy(l);
    }
    ck_assert_int_gt(failed, 0);
}
KVB_TEST_END

static kvb_loan rep_loan(uint64_t id, const char *lender, uint32_t first, uint32_t n, uint32_t n_master) {
    kvb_loan r;
    memset(&r, 0, sizeof r);
    r.id = id;
    snprintf(r.lender, sizeof r.lender, "%s", lender);
    r.first_block = first;
    r.n_blocks = n;
    r.n_master_blocks = n_master;
    r.epoch = 40;
    r.state = KVB_LOAN_ACTIVE;
    return r;
}

/* After a coordinator restart: loans reported by both sides are kept, whatever the order. */
KVB_TEST(ledger_restart_both_sides) {
    for (int order = 0; order < 2; order++) {
        kvb_ledger *l = new_ledger();
        char why[256] = "";
        kvb_loan r7 = rep_loan(7, "a", 56, 8, 2);
        for (int k = 0; k < 2; k++) {
            if ((k == 0) == (order == 0))
                ck_assert_int_eq(reg_full(l, "a", KVB_ROLE_WORKER, 11, &G_A, 64, &r7, 1, 0, why), KVB_OK);
            else ck_assert_int_eq(reg_full(l, "m", KVB_ROLE_MASTER, 10, &G_M, 64, &r7, 1, 0, why), KVB_OK);
        }
        expect_no_act(l);
        ck_assert_int_eq(kvb_ledger_n_loans(l), 1);
        const kvb_loan *ln = kvb_ledger_loan(l, 7);
        ck_assert_ptr_nonnull(ln);
        ck_assert_int_eq(ln->state, KVB_LOAN_ACTIVE);
        ck_assert_uint_eq(ln->offset, 56u * 4096u);
        ck_assert_uint_eq(kvb_ledger_n_lent(l, "a"), 8);
        ck_assert_uint_eq(kvb_ledger_n_borrowed(l), 2);
        ck_assert_uint_gt(kvb_ledger_epoch(l), 40); /* never behind a reported epoch */
        /* the grace period passes: nothing happens to a confirmed loan */
        kvb_ledger_heartbeat(l, "a", NULL, 300);
        kvb_ledger_heartbeat(l, "m", NULL, 300);
        kvb_ledger_tick(l, 300);
        expect_no_act(l);
        /* new loans get new ids, and the kept one can be reclaimed as usual */
        uint64_t id = lend(l, "a", 48, 8);
        ck_assert_uint_gt(id, 7);
        uint32_t n;
        ck_assert_int_eq(kvb_ledger_reclaim(l, "a", 16, 300, &n, why, sizeof why), KVB_OK);
        expect_act(l, KVB_ACT_REVOKE, "m", id);
        expect_act(l, KVB_ACT_REVOKE, "m", 7);
        ck_assert_int_eq(kvb_ledger_revoke_ack(l, "m", 7, 0, 300, why, sizeof why), KVB_OK);
        expect_act(l, KVB_ACT_RECLAIMED, "a", 7);
        kvb_ledger_destroy(l);
    }
}
KVB_TEST_END

/* Reported by the worker alone: returned when the master registers without it, or when no master
 * registers within the master grace period (30 s at least: a live master may still have it attached,
 * so it is never returned as early as 2 heartbeat periods). */
KVB_TEST(ledger_restart_worker_alone) {
    kvb_ledger *l = new_ledger();
    char why[256] = "";
    kvb_loan reps[2] = {rep_loan(7, "a", 56, 8, 2), rep_loan(9, "a", 48, 8, 2)};
    ck_assert_int_eq(reg_full(l, "a", KVB_ROLE_WORKER, 11, &G_A, 64, reps, 2, 0, why), KVB_OK);
    expect_no_act(l); /* waiting for the master */
    ck_assert_int_eq(kvb_ledger_n_loans(l), 2);
    /* an offer may not overlap what is still unconfirmed */
    ck_assert_int_eq(reg_full(l, "m", KVB_ROLE_MASTER, 10, &G_M, 64, &reps[0], 1, 50, why), KVB_OK);
    kvb_ledger_action act = expect_act(l, KVB_ACT_RECLAIMED, "a", 9);
    ck_assert_uint_eq(act.loan.first_block, 48);
    ck_assert_uint_eq(act.loan.n_blocks, 8);
    expect_no_act(l);
    ck_assert_int_eq(kvb_ledger_n_loans(l), 1);
    ck_assert_int_eq(kvb_ledger_loan(l, 7)->state, KVB_LOAN_ACTIVE);
    kvb_ledger_destroy(l);

    /* no master at all */
    l = new_ledger();
    ck_assert_int_eq(reg_full(l, "a", KVB_ROLE_WORKER, 11, &G_A, 64, reps, 2, 1000, why), KVB_OK);
    kvb_ledger_heartbeat(l, "a", NULL, 1150);
    kvb_ledger_tick(l, 1150);
    expect_no_act(l);
    kvb_ledger_heartbeat(l, "a", NULL, 1200);
    kvb_ledger_tick(l, 1200); /* 2 heartbeat periods: still waiting */
    expect_no_act(l);
    kvb_ledger_heartbeat(l, "a", NULL, 30999);
    kvb_ledger_tick(l, 30999);
    expect_no_act(l);
    kvb_ledger_heartbeat(l, "a", NULL, 31001);
    kvb_ledger_tick(l, 31001);
    expect_act(l, KVB_ACT_RECLAIMED, "a", 7);
    expect_act(l, KVB_ACT_RECLAIMED, "a", 9);
    ck_assert_int_eq(kvb_ledger_n_loans(l), 0);
    kvb_ledger_destroy(l);

    /* a master that registers with no knowledge of the loan after the coordinator knows it returned
     * blocks to the worker: the worker re-registers still reporting it (a retry) -> returned again */
    l = new_ledger();
    reg(l, "m", KVB_ROLE_MASTER, 10, &G_M, 64);
    ck_assert_int_eq(reg_full(l, "a", KVB_ROLE_WORKER, 11, &G_A, 64, reps, 1, 0, why), KVB_OK);
    expect_act(l, KVB_ACT_RECLAIMED, "a", 7);
    ck_assert_int_eq(kvb_ledger_n_loans(l), 0);
    kvb_ledger_destroy(l);
}
KVB_TEST_END

/* Reported by the master alone: revoked as lender_dead when the lender registers without it, or when
 * it does not register within the grace period. */
KVB_TEST(ledger_restart_master_alone) {
    kvb_ledger *l = new_ledger();
    char why[256] = "";
    kvb_loan reps[2] = {rep_loan(7, "a", 56, 8, 2), rep_loan(9, "b", 48, 8, 2)};
    ck_assert_int_eq(reg_full(l, "m", KVB_ROLE_MASTER, 10, &G_M, 64, reps, 2, 1000, why), KVB_OK);
    expect_no_act(l);
    ck_assert_uint_eq(kvb_ledger_n_borrowed(l), 4);
    /* a registers without loan 7 */
    ck_assert_int_eq(reg_full(l, "a", KVB_ROLE_WORKER, 11, &G_A, 64, NULL, 0, 1050, why), KVB_OK);
    kvb_ledger_action act = expect_act(l, KVB_ACT_REVOKE, "m", 7);
    ck_assert(act.lender_dead);
    expect_no_act(l);
    /* a may not lend that range again until the master let go of it */
    ck_assert_int_eq(kvb_ledger_offer(l, "a", 56, 8, 1050, NULL, why, sizeof why), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_ledger_revoke_ack(l, "m", 7, act.epoch, 1060, why, sizeof why), KVB_OK);
    expect_no_act(l); /* no Reclaimed: a never thought it lent them */
    /* b never registers: after the silence limit (4 x 100 ms, as long as a registered model may stay
     * silent) its loan is revoked as lender_dead; a lender two heartbeat periods late keeps it */
    kvb_ledger_heartbeat(l, "m", NULL, 1250);
    kvb_ledger_heartbeat(l, "a", NULL, 1250);
    kvb_ledger_tick(l, 1250);
    expect_no_act(l);
    kvb_ledger_tick(l, 1399);
    expect_no_act(l);
    kvb_ledger_tick(l, 1400);
    act = expect_act(l, KVB_ACT_REVOKE, "m", 9);
    ck_assert(act.lender_dead);
    ck_assert_int_eq(kvb_ledger_revoke_ack(l, "m", 9, act.epoch, 1210, why, sizeof why), KVB_OK);
    expect_no_act(l);
    ck_assert_int_eq(kvb_ledger_n_loans(l), 0);
    kvb_ledger_destroy(l);
}
KVB_TEST_END

/* A model declared dead while it was only slow registers again with the same pid. */
KVB_TEST(ledger_reregister_same_pid) {
    kvb_ledger *l = new_ledger();
    char why[256] = "";
    reg(l, "m", KVB_ROLE_MASTER, 10, &G_M, 64);
    reg(l, "a", KVB_ROLE_WORKER, 11, &G_A, 64);
    uint64_t id = lend(l, "a", 60, 4);
    kvb_ledger_model_dead(l, "a", "test: silent", 0);
    kvb_ledger_action act = expect_act(l, KVB_ACT_REVOKE, "m", id);
    ck_assert(act.lender_dead);
    /* it comes back still holding the loan as lent: once the master let go, it gets it back */
    kvb_loan r = rep_loan(id, "a", 60, 4, 1);
    ck_assert_int_eq(reg_full(l, "a", KVB_ROLE_WORKER, 11, &G_A, 64, &r, 1, 10, why), KVB_OK);
    expect_no_act(l);
    ck_assert_int_eq(kvb_ledger_revoke_ack(l, "m", id, act.epoch, 20, why, sizeof why), KVB_OK);
    expect_act(l, KVB_ACT_RECLAIMED, "a", id);
    /* the master, declared dead, comes back reporting a loan whose blocks went back to their lender */
    id = lend(l, "a", 60, 4);
    kvb_ledger_model_dead(l, "m", "test: silent", 30);
    expect_act(l, KVB_ACT_RECLAIMED, "a", id);
    r = rep_loan(id, "a", 60, 4, 1);
    ck_assert_int_eq(reg_full(l, "m", KVB_ROLE_MASTER, 10, &G_M, 64, &r, 1, 40, why), KVB_OK);
    act = expect_act(l, KVB_ACT_REVOKE, "m", id);
    ck_assert(act.lender_dead);
    ck_assert_int_eq(kvb_ledger_revoke_ack(l, "m", id, act.epoch, 50, why, sizeof why), KVB_OK);
    expect_no_act(l);
    kvb_ledger_destroy(l);
}
KVB_TEST_END

/* ===================================================================================== processes */

static char g_dir[64];        /* this test's scratch directory */
static char g_endpoint[160];
static char g_log[96];
static pid_t g_coord = -1;
static char g_hb_ms[16] = "100", g_misses[16] = "50";
static char g_config[128];    /* non-empty: start the coordinator with --config g_config */
static kvb_auth g_sup;        /* has_secret: the test plays kvbankd, handing the coordinator this secret
                               * on an inherited pipe (KVB_AUTH_FD) instead of its key file */

static const char *builddir(void) { return kvb_t_builddir(); }

static void heartbeat_alive(void);

/* Runs a program of the build directory with stdout into out[out_len] (may be NULL) and stderr into
 * err[err_len] (may be NULL: the test's stderr). The fake peers keep heartbeating while the tool runs: a
 * loaded (sanitizer) machine may run it for longer than the silence limit, and a silent master holding
 * loans is fenced with SIGKILL, which would hit this process. Returns its exit status, -1 if it did not
 * exit. */
static int run_tool(const char *const *argv, char *out, size_t out_len, char *err, size_t err_len) {
    char errfile[128];
    snprintf(errfile, sizeof errfile, "%s/tool.err", g_dir);
    return kvb_t_run_tool(argv, &(kvb_t_run){.out = out, .out_len = out_len, .err = err, .err_len = err_len,
                                             .err_file = errfile, .idle = heartbeat_alive});
}

static void print_log(void) { kvb_t_print_file(g_log, "coordinator log"); }

static int log_contains(const char *needle) { return kvb_t_file_contains(g_log, needle); }

static void make_dir(void) {
    kvb_t_remove_stale();
    snprintf(g_dir, sizeof g_dir, "/tmp/kvb-test-%d.d", (int)getpid());
    ck_assert_msg(mkdir(g_dir, 0700) == 0, "mkdir %s: %s", g_dir, strerror(errno));
    snprintf(g_endpoint, sizeof g_endpoint, "ipc://%s/run/coordinator.sock", g_dir);
    snprintf(g_log, sizeof g_log, "%s/coordinator.log", g_dir);
}

/* Forks and execs kvbank-coordinator on g_endpoint (log appended to g_log). Does not wait. */
static void spawn_coordinator(void) {
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

static int stop_coordinator(int sig, double timeout_s) {
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

typedef struct peer {
    void *ctx, *sock;
    char name[64];           /* routing id; "" for an anonymous one */
    uint64_t last_hb_ns;
    kvb_region *region;      /* the KV region it registers with (a real one of this process) */
    int refused;             /* its login is to be refused: its sends never wait (see peer_send) */
} peer;

static peer *g_alive[8];     /* peers that heartbeat while the test waits */
static int g_n_alive;

/* The token of model `name` from the coordinator's key file next to its socket (the way a model run by
 * hand logs in); 0 when there is no key file (a coordinator that does not authenticate). */
static int model_token(const char *name, char out[KVB_AUTH_TOKEN_LEN + 1]) {
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
static void peer_open_at(peer *p, int ctl, const char *name, const char *user, const char *password) {
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
static void peer_open(peer *p, const char *name) {
    char tok[KVB_AUTH_TOKEN_LEN + 1];
    if (name && model_token(name, tok)) peer_open_at(p, 0, name, name, tok);
    else if (!name && model_token("-", tok)) peer_open_at(p, 1, NULL, KVB_AUTH_CTL_USER, "-");
    else peer_open_at(p, 0, name, NULL, NULL);
}

static void peer_close(peer *p) {
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
static void peer_send(peer *p, Kvbank__Envelope *env) {
    if (p->refused) (void)kvb_wire_send(p->sock, NULL, 0, env, ZMQ_DONTWAIT);
    else ck_assert_int_eq(kvb_wire_send(p->sock, NULL, 0, env, 0), KVB_OK);
}

static void send_heartbeat(peer *p) {
    Kvbank__Heartbeat h = KVBANK__HEARTBEAT__INIT;
    h.name = p->name;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_HEARTBEAT;
    env.heartbeat = &h;
    peer_send(p, &env);
    p->last_hb_ns = kvb_now_ns();
}

static void keep_alive(peer *p) { g_alive[g_n_alive++] = p; }

static void heartbeat_alive(void) {
    for (int i = 0; i < g_n_alive; i++)
        if (kvb_now_ns() - g_alive[i]->last_hb_ns > 40000000u) send_heartbeat(g_alive[i]);
}

/* The next message on p within timeout_ms other than a HeartbeatReply, or NULL. Heartbeats the
 * g_alive peers meanwhile. */
static Kvbank__Envelope *peer_recv(peer *p, int timeout_ms) {
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

static Kvbank__Envelope *peer_expect(peer *p, Kvbank__Envelope__BodyCase want, int timeout_ms, const char *what) {
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
static Kvbank__Envelope *status_of(int ledger) {
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

static void start_coordinator(void) {
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

static void teardown(void) {
    int status = stop_coordinator(SIGTERM, 20);
    if (status != 0) print_log();
    ck_assert_msg(status == 0, "kvbank-coordinator ended with wait status 0x%x (-1: killed after a timeout)", status);
    if (g_dir[0]) kvb_t_remove_tree(g_dir);
}

/* The next Registers' borrowing limit (issue 10; 0, 0: none). */
static int g_reg_limited;
static uint32_t g_reg_max_borrow;

/* Sends p's Register: `role`, `pid`, geometry `g`, `capacity` blocks in a real region of this process
 * (made or grown here), the loans it reports. */
static void peer_send_register(peer *p, kvb_role role, uint32_t pid, const kvb_kv_geom *g, uint32_t capacity,
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
static Kvbank__RegisterReply *peer_register_loans(peer *p, kvb_role role, uint32_t pid, const kvb_kv_geom *g,
                                                  uint32_t capacity, Kvbank__Loan **loans, size_t n_loans,
                                                  Kvbank__Envelope **holder) {
    peer_send_register(p, role, pid, g, capacity, loans, n_loans);
    *holder = peer_expect(p, KVBANK__ENVELOPE__BODY_REGISTER_REPLY, 10000, "register");
    p->last_hb_ns = kvb_now_ns();
    return (*holder)->register_reply;
}

static void peer_register(peer *p, kvb_role role, const kvb_kv_geom *g, uint32_t capacity) {
    Kvbank__Envelope *h = NULL;
    Kvbank__RegisterReply *rr = peer_register_loans(p, role, (uint32_t)getpid(), g, capacity, NULL, 0, &h);
    ck_assert_msg(rr->ok, "register %s refused: %s", p->name, rr->error);
    ck_assert_uint_eq(rr->heartbeat_ms, (uint32_t)atoi(g_hb_ms));
    kvbank__envelope__free_unpacked(h, NULL);
}

static void send_offer(peer *w, uint32_t first, uint32_t n) {
    Kvbank__LendOffer o = KVBANK__LEND_OFFER__INIT;
    o.worker = w->name;
    o.first_block = first;
    o.n_blocks = n;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_LEND_OFFER;
    env.lend_offer = &o;
    peer_send(w, &env);
}

static void send_grant_ack(peer *m, uint64_t id, int ok) {
    Kvbank__GrantAck g = KVBANK__GRANT_ACK__INIT;
    g.loan_id = id;
    g.ok = ok != 0;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_GRANT_ACK;
    env.grant_ack = &g;
    peer_send(m, &env);
}

static void send_revoke_ack(peer *m, uint64_t id, uint64_t epoch) {
    Kvbank__RevokeAck a = KVBANK__REVOKE_ACK__INIT;
    a.loan_id = id;
    a.epoch = epoch;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_REVOKE_ACK;
    env.revoke_ack = &a;
    peer_send(m, &env);
}

static void send_reclaim(peer *w, uint32_t n) {
    Kvbank__ReclaimRequest r = KVBANK__RECLAIM_REQUEST__INIT;
    r.worker = w->name;
    r.n_blocks = n;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_RECLAIM_REQUEST;
    env.reclaim_request = &r;
    peer_send(w, &env);
}

/* Worker w offers [first, first + n); the master gets the Grant and acks it. Returns the loan id. */
static uint64_t lend_flow(peer *m, peer *w, uint32_t first, uint32_t n) {
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

static const Kvbank__ModelStatus *find_status(const Kvbank__StatusReply *s, const char *name) {
    for (size_t i = 0; i < s->n_models; i++)
        if (!strcmp(s->models[i]->name, name)) return s->models[i];
    return NULL;
}

/* The whole fenced flow: lend, Grant, GrantAck, reclaim, Revoke, (nothing for the worker), RevokeAck,
 * Reclaimed. */
KVB_TEST(proc_lend_reclaim_flow) {
    make_dir();
    start_coordinator();
    /* the socket's directory was created 0700 and the socket file is 0600 */
    char path[256];
    struct stat sb;
    snprintf(path, sizeof path, "%s/run", g_dir);
    ck_assert_int_eq(stat(path, &sb), 0);
    ck_assert_uint_eq(sb.st_mode & 0777, 0700);
    ck_assert_int_eq(stat(g_endpoint + 6, &sb), 0);
    ck_assert_uint_eq(sb.st_mode & 0777, 0600);

    peer m, w;
    peer_open(&m, "m");
    peer_open(&w, "w");
    peer_register(&m, KVB_ROLE_MASTER, &G_M, 64);
    keep_alive(&m);
    Kvbank__Envelope *h = NULL;
    Kvbank__RegisterReply *rr = peer_register_loans(&w, KVB_ROLE_WORKER, (uint32_t)getpid(), &G_A, 64, NULL, 0, &h);
    ck_assert(rr->ok);
    ck_assert_uint_eq(rr->meu_worker, 4);
    ck_assert_uint_eq(rr->meu_master, 1);
    kvbank__envelope__free_unpacked(h, NULL);
    keep_alive(&w);

    uint64_t id = lend_flow(&m, &w, 48, 16);
    Kvbank__Envelope *s = status_of(1);
    ck_assert_uint_eq(s->status_reply->n_loans, 1);
    ck_assert_uint_eq(find_status(s->status_reply, "w")->n_lent, 16);
    ck_assert_uint_eq(find_status(s->status_reply, "m")->n_borrowed, 4);
    uint64_t epoch0 = s->status_reply->epoch;
    kvbank__envelope__free_unpacked(s, NULL);

    /* one MEU (4 worker blocks): the loan's first 4 blocks come back, it keeps the rest (issue 10) */
    send_reclaim(&w, 4);
    Kvbank__Envelope *e = peer_expect(&m, KVBANK__ENVELOPE__BODY_REVOKE, 10000, "revoke");
    ck_assert_uint_eq(e->revoke->loan_id, id);
    ck_assert(!e->revoke->lender_dead);
    ck_assert_uint_eq(e->revoke->first_block, 48);
    ck_assert_uint_eq(e->revoke->n_blocks, 4);
    uint64_t pepoch = e->revoke->epoch;
    kvbank__envelope__free_unpacked(e, NULL);
    send_revoke_ack(&m, id, pepoch);
    e = peer_expect(&w, KVBANK__ENVELOPE__BODY_RECLAIMED, 10000, "reclaimed part");
    ck_assert_uint_eq(e->reclaimed->loan_id, id);
    ck_assert_uint_eq(e->reclaimed->first_block, 48);
    ck_assert_uint_eq(e->reclaimed->n_blocks, 4);
    kvbank__envelope__free_unpacked(e, NULL);
    s = status_of(1);
    ck_assert_uint_eq(s->status_reply->n_loans, 1);
    ck_assert_uint_eq(s->status_reply->loans[0]->first_block, 52);
    ck_assert_uint_eq(s->status_reply->loans[0]->n_blocks, 12);
    ck_assert_uint_eq(s->status_reply->loans[0]->n_master_blocks, 3);
    ck_assert(!s->status_reply->loans[0]->revoking);
    epoch0 = s->status_reply->epoch;
    kvbank__envelope__free_unpacked(s, NULL);

    /* the rest: the whole loan */
    send_reclaim(&w, 12);
    e = peer_expect(&m, KVBANK__ENVELOPE__BODY_REVOKE, 10000, "revoke");
    ck_assert_uint_eq(e->revoke->loan_id, id);
    ck_assert(!e->revoke->lender_dead);
    ck_assert_uint_eq(e->revoke->n_blocks, 0); /* the whole loan */
    ck_assert_uint_gt(e->revoke->epoch, epoch0);
    uint64_t repoch = e->revoke->epoch;
    kvbank__envelope__free_unpacked(e, NULL);
    /* the fence: nothing for the worker while the master has not acked */
    e = peer_recv(&w, 600);
    ck_assert_msg(e == NULL, "the worker got message type %d before the RevokeAck", e ? (int)e->body_case : 0);
    s = status_of(1);
    ck_assert_uint_eq(s->status_reply->n_loans, 1);
    ck_assert(s->status_reply->loans[0]->revoking);
    kvbank__envelope__free_unpacked(s, NULL);
    send_revoke_ack(&m, id, repoch);
    e = peer_expect(&w, KVBANK__ENVELOPE__BODY_RECLAIMED, 10000, "reclaimed");
    ck_assert_uint_eq(e->reclaimed->loan_id, id);
    ck_assert_uint_eq(e->reclaimed->first_block, 52);
    ck_assert_uint_eq(e->reclaimed->n_blocks, 12);
    ck_assert_uint_gt(e->reclaimed->epoch, repoch);
    kvbank__envelope__free_unpacked(e, NULL);
    s = status_of(1);
    ck_assert_uint_eq(s->status_reply->n_loans, 0);
    ck_assert_uint_eq(s->status_reply->dropped_messages, 0);
    kvbank__envelope__free_unpacked(s, NULL);

    /* refusals come back as LendResult with a reason */
    send_offer(&w, 60, 3);
    e = peer_expect(&w, KVBANK__ENVELOPE__BODY_LEND_RESULT, 10000, "bad offer");
    ck_assert(!e->lend_result->accepted);
    ck_assert_ptr_nonnull(strstr(e->lend_result->error, "multiple"));
    kvbank__envelope__free_unpacked(e, NULL);
    peer_close(&m);
    peer_close(&w);
    teardown();
}
KVB_TEST_END

/* Issue 10 over the wire: a master whose LSC lies within its budget registers how many blocks it can
 * attach; workers hear their room in the RegisterReply, an offer beyond it is refused, kvbankctl's status
 * shows the limit; a worker claiming a limit is refused with the reason and registers nothing. */
KVB_TEST(proc_master_borrow_limit) {
    make_dir();
    start_coordinator();
    peer m, w;
    peer_open(&m, "m");
    peer_open(&w, "w");
    Kvbank__Envelope *h = NULL;
    g_reg_limited = 1;
    g_reg_max_borrow = 3;
    Kvbank__RegisterReply *rr = peer_register_loans(&w, KVB_ROLE_WORKER, (uint32_t)getpid(), &G_A, 64, NULL, 0, &h);
    ck_assert(!rr->ok);
    ck_assert_msg(strstr(rr->error, "max_borrow 3 from a worker: only a master limits its borrowing") != NULL,
                  "error: %s", rr->error);
    kvbank__envelope__free_unpacked(h, NULL);
    Kvbank__Envelope *s = status_of(0);
    ck_assert_uint_eq(s->status_reply->n_models, 0);
    kvbank__envelope__free_unpacked(s, NULL);
    peer_register(&m, KVB_ROLE_MASTER, &G_M, 64);
    keep_alive(&m);
    g_reg_limited = 0;
    g_reg_max_borrow = 0;
    rr = peer_register_loans(&w, KVB_ROLE_WORKER, (uint32_t)getpid(), &G_A, 64, NULL, 0, &h);
    ck_assert(rr->ok);
    ck_assert(rr->room_limited);
    ck_assert_uint_eq(rr->lend_room, 12); /* 3 master blocks, MEU 4 : 1 */
    kvbank__envelope__free_unpacked(h, NULL);
    keep_alive(&w);
    send_offer(&w, 44, 20);
    Kvbank__Envelope *e = peer_expect(&w, KVBANK__ENVELOPE__BODY_LEND_RESULT, 10000, "offer beyond the room");
    ck_assert(!e->lend_result->accepted);
    ck_assert_msg(strstr(e->lend_result->error, "master m can attach 12 more of w's blocks") != NULL, "error: %s",
                  e->lend_result->error);
    kvbank__envelope__free_unpacked(e, NULL);
    lend_flow(&m, &w, 52, 12);
    s = status_of(1);
    const Kvbank__ModelStatus *ms = find_status(s->status_reply, "m");
    ck_assert(ms->borrow_limited);
    ck_assert_uint_eq(ms->max_borrow, 3);
    ck_assert_uint_eq(ms->n_borrowed, 3);
    ck_assert(!find_status(s->status_reply, "w")->borrow_limited);
    ck_assert_uint_eq(s->status_reply->n_loans, 1);
    kvbank__envelope__free_unpacked(s, NULL);
    peer_close(&m);
    peer_close(&w);
    teardown();
}
KVB_TEST_END

/* A worker that stops heartbeating is dead: the master gets Revoke(lender_dead). */
KVB_TEST(proc_worker_silent) {
    make_dir();
    snprintf(g_misses, sizeof g_misses, "3"); /* 300 ms of silence */
    start_coordinator();
    peer m, w;
    peer_open(&m, "m");
    peer_open(&w, "w");
    peer_register(&m, KVB_ROLE_MASTER, &G_M, 64);
    keep_alive(&m);
    peer_register(&w, KVB_ROLE_WORKER, &G_A, 64);
    keep_alive(&w);
    uint64_t id = lend_flow(&m, &w, 56, 8);
    g_n_alive = 0;
    keep_alive(&m); /* the worker falls silent */
    uint64_t t0 = kvb_now_ns();
    Kvbank__Envelope *e = peer_expect(&m, KVBANK__ENVELOPE__BODY_REVOKE, 5000, "revoke after silence");
    double dt = (double)(kvb_now_ns() - t0) / 1e9;
    ck_assert_uint_eq(e->revoke->loan_id, id);
    ck_assert(e->revoke->lender_dead);
    ck_assert_msg(dt > 0.15, "revoked after %.3f s, before the silence limit", dt);
    kvbank__envelope__free_unpacked(e, NULL);
    Kvbank__Envelope *s = status_of(0);
    ck_assert(!find_status(s->status_reply, "w")->alive);
    ck_assert(find_status(s->status_reply, "m")->alive);
    kvbank__envelope__free_unpacked(s, NULL);
    ck_assert(log_contains("no heartbeat for"));
    /* the dead worker's heartbeat is answered "register again" */
    send_heartbeat(&w);
    zmq_pollitem_t it = {.socket = w.sock, .events = ZMQ_POLLIN};
    Kvbank__Envelope *hr = NULL;
    for (int i = 0; i < 100 && !hr; i++) {
        if (zmq_poll(&it, 1, 100) <= 0) continue;
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        zmq_msg_recv(&msg, w.sock, 0);
        Kvbank__Envelope *x = NULL;
        ck_assert_int_eq(kvb_coord_decode(zmq_msg_data(&msg), zmq_msg_size(&msg), &x, NULL), KVB_OK);
        zmq_msg_close(&msg);
        if (x->body_case == KVBANK__ENVELOPE__BODY_HEARTBEAT_REPLY && !x->heartbeat_reply->known) hr = x;
        else kvbank__envelope__free_unpacked(x, NULL);
    }
    ck_assert_ptr_nonnull(hr);
    kvbank__envelope__free_unpacked(hr, NULL);
    /* the master's ack deletes the loan; the dead worker gets no Reclaimed */
    send_revoke_ack(&m, id, 0);
    for (int i = 0; i < 100; i++) {
        s = status_of(1);
        size_t n = s->status_reply->n_loans;
        kvbank__envelope__free_unpacked(s, NULL);
        if (!n) break;
        usleep(20000);
    }
    s = status_of(1);
    ck_assert_uint_eq(s->status_reply->n_loans, 0);
    kvbank__envelope__free_unpacked(s, NULL);
    peer_close(&m);
    peer_close(&w);
    teardown();
}
KVB_TEST_END

/* The fake master as a real process: registers with its own pid, acks every Grant, heartbeats, and
 * writes one byte to `fd` after its first GrantAck. Never returns. */
static void child_master(int fd) {
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
static pid_t spawn_child_master(int fds[2]) {
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
static int wait_child_master(pid_t child) {
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

/* A master killed with SIGKILL: the coordinator sees its pid gone (long before any heartbeat silence
 * limit) and every lender gets its blocks back. */
KVB_TEST(proc_master_killed) {
    make_dir();
    snprintf(g_hb_ms, sizeof g_hb_ms, "1000");
    snprintf(g_misses, sizeof g_misses, "30"); /* silence would take 30 s */
    start_coordinator();
    int fds[2];
    pid_t child = spawn_child_master(fds);
    ck_assert_msg(wait_child_master(child), "the child master did not register");
    peer w;
    peer_open(&w, "w");
    peer_register(&w, KVB_ROLE_WORKER, &G_A, 64);
    keep_alive(&w);
    send_offer(&w, 56, 8);
    Kvbank__Envelope *e = peer_expect(&w, KVBANK__ENVELOPE__BODY_LEND_RESULT, 10000, "offer");
    ck_assert(e->lend_result->accepted);
    uint64_t id = e->lend_result->loan->loan_id;
    kvbank__envelope__free_unpacked(e, NULL);
    char b;
    struct timeval tv = {.tv_sec = 10};
    fd_set set;
    FD_ZERO(&set);
    FD_SET(fds[0], &set);
    ck_assert_int_eq(select(fds[0] + 1, &set, NULL, NULL, &tv), 1);
    ck_assert_int_eq(read(fds[0], &b, 1), 1); /* the child acked the Grant */
    close(fds[0]);
    e = peer_recv(&w, 300);
    ck_assert_msg(e == NULL, "message type %d before the master died", e ? (int)e->body_case : 0);

    uint64_t t0 = kvb_now_ns();
    kill(child, SIGKILL);
    ck_assert_int_eq(waitpid(child, NULL, 0), child); /* reaped: the pid is gone */
    char ctag[32];
    snprintf(ctag, sizeof ctag, "t%d_m", (int)child);
    kvb_region_unlink_stale(ctag, NULL); /* the killed child's region */
    e = peer_expect(&w, KVBANK__ENVELOPE__BODY_RECLAIMED, 10000, "reclaimed after the master died");
    double dt = (double)(kvb_now_ns() - t0) / 1e9;
    ck_assert_uint_eq(e->reclaimed->loan_id, id);
    ck_assert_uint_eq(e->reclaimed->first_block, 56);
    ck_assert_uint_eq(e->reclaimed->n_blocks, 8);
    kvbank__envelope__free_unpacked(e, NULL);
    ck_assert_msg(dt < 8.0, "took %.2f s (the heartbeat silence limit is 30 s)", dt);
    Kvbank__Envelope *s = status_of(1);
    ck_assert(!find_status(s->status_reply, "m")->alive);
    ck_assert_uint_eq(s->status_reply->n_loans, 0);
    kvbank__envelope__free_unpacked(s, NULL);
    ck_assert(log_contains("is gone"));
    /* no master: offers are refused with a reason */
    send_offer(&w, 56, 8);
    e = peer_expect(&w, KVBANK__ENVELOPE__BODY_LEND_RESULT, 10000, "offer without master");
    ck_assert(!e->lend_result->accepted);
    ck_assert_ptr_nonnull(strstr(e->lend_result->error, "master"));
    kvbank__envelope__free_unpacked(e, NULL);
    peer_close(&w);
    teardown();
}
KVB_TEST_END

static uint64_t dropped(void) {
    Kvbank__Envelope *s = status_of(0);
    uint64_t n = s->status_reply->dropped_messages;
    kvbank__envelope__free_unpacked(s, NULL);
    return n;
}

/* Bad messages are dropped, counted and change nothing; the coordinator keeps serving. */
KVB_TEST(proc_bad_messages) {
    make_dir();
    start_coordinator();
    peer m, w, ghost, anon;
    peer_open(&m, "m");
    peer_open(&w, "w");
    peer_open(&ghost, "ghost");
    peer_open(&anon, NULL);
    peer_register(&m, KVB_ROLE_MASTER, &G_M, 64);
    keep_alive(&m);
    peer_register(&w, KVB_ROLE_WORKER, &G_A, 64);
    keep_alive(&w);
    uint64_t id = lend_flow(&m, &w, 56, 8);
    ck_assert_uint_eq(dropped(), 0);
    uint64_t want = 0;

    /* garbage */
    static const uint8_t junk[] = {0xff, 0xff, 0xff, 0x01, 0x02};
    ck_assert_int_eq(zmq_send(anon.sock, junk, sizeof junk, 0), (int)sizeof junk);
    want++;
    /* oversized: 5 MiB */
    size_t big = (size_t)5 << 20;
    uint8_t *buf = calloc(1, big);
    ck_assert_ptr_nonnull(buf);
    ck_assert_int_eq(zmq_send(anon.sock, buf, big, 0), (int)big);
    free(buf);
    want++;
    /* wrong version */
    Kvbank__StatusRequest sr = KVBANK__STATUS_REQUEST__INIT;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_STATUS_REQUEST;
    env.status_request = &sr;
    env.version = 2;
    uint8_t vbuf[64];
    size_t vlen = kvbank__envelope__pack(&env, vbuf);
    ck_assert_int_eq(zmq_send(anon.sock, vbuf, vlen, 0), (int)vlen);
    want++;
    /* two frames */
    ck_assert_int_eq(zmq_send(anon.sock, "a", 1, ZMQ_SNDMORE), 1);
    ck_assert_int_eq(zmq_send(anon.sock, "b", 1, 0), 1);
    want++;
    /* a body the coordinator never takes */
    Kvbank__TokenEvent te = KVBANK__TOKEN_EVENT__INIT;
    Kvbank__Envelope tenv = KVBANK__ENVELOPE__INIT;
    tenv.body_case = KVBANK__ENVELOPE__BODY_TOKENS;
    tenv.tokens = &te;
    peer_send(&anon, &tenv);
    want++;
    /* unregistered: an offer and a reclaim from "ghost", a RevokeAck from an anonymous peer */
    send_offer(&ghost, 0, 4);
    send_reclaim(&ghost, 4);
    send_revoke_ack(&anon, id, 0);
    want += 3;
    /* wrong role: the worker acks a Grant, the master offers */
    send_grant_ack(&w, id, 0);
    send_offer(&m, 0, 4);
    want += 2;
    /* a name that is not the sender's */
    Kvbank__LendOffer o = KVBANK__LEND_OFFER__INIT;
    o.worker = "m";
    o.first_block = 0;
    o.n_blocks = 4;
    Kvbank__Envelope oenv = KVBANK__ENVELOPE__INIT;
    oenv.body_case = KVBANK__ENVELOPE__BODY_LEND_OFFER;
    oenv.lend_offer = &o;
    peer_send(&w, &oenv);
    want++;

    uint64_t got = 0;
    for (int i = 0; i < 200 && (got = dropped()) < want; i++) usleep(20000);
    if (got != want) print_log();
    ck_assert_uint_eq(got, want);
    /* nothing changed: the loan is still active and nobody got an answer to the dropped messages */
    Kvbank__Envelope *s = status_of(1);
    ck_assert_uint_eq(s->status_reply->n_loans, 1);
    ck_assert(!s->status_reply->loans[0]->revoking);
    kvbank__envelope__free_unpacked(s, NULL);
    Kvbank__Envelope *e = peer_recv(&ghost, 200);
    ck_assert_ptr_null(e);
    e = peer_recv(&w, 200);
    ck_assert_ptr_null(e);
    e = peer_recv(&m, 200);
    ck_assert_ptr_null(e);
    /* per-reason counters in the log */
    ck_assert(log_contains("oversized"));
    ck_assert(log_contains(": unregistered:"));
    ck_assert(log_contains(": role:"));
    ck_assert(log_contains(": version:"));
    /* and it still serves */
    peer_register(&ghost, KVB_ROLE_WORKER, &G_A, 64);
    keep_alive(&ghost);
    lend_flow(&m, &ghost, 60, 4);
    peer_close(&m);
    peer_close(&w);
    peer_close(&ghost);
    peer_close(&anon);
    teardown();
}
KVB_TEST_END

/* Heartbeats until the coordinator says it does not know the peer (it restarted). */
static void wait_unknown(peer *p) {
    for (int i = 0; i < 200; i++) {
        send_heartbeat(p);
        zmq_pollitem_t it = {.socket = p->sock, .events = ZMQ_POLLIN};
        if (zmq_poll(&it, 1, 50) <= 0) continue;
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        ck_assert_int_ge(zmq_msg_recv(&msg, p->sock, 0), 0);
        Kvbank__Envelope *x = NULL;
        ck_assert_int_eq(kvb_coord_decode(zmq_msg_data(&msg), zmq_msg_size(&msg), &x, NULL), KVB_OK);
        zmq_msg_close(&msg);
        int unknown = x->body_case == KVBANK__ENVELOPE__BODY_HEARTBEAT_REPLY && !x->heartbeat_reply->known;
        kvbank__envelope__free_unpacked(x, NULL);
        if (unknown) return;
    }
    ck_abort_msg("%s: the restarted coordinator never answered 'unknown'", p->name);
}

static Kvbank__Loan wire_loan(uint64_t id, const char *lender, uint32_t first, uint32_t n) {
    Kvbank__Loan l = KVBANK__LOAN__INIT;
    l.loan_id = id;
    l.lender = (char *)lender;
    l.first_block = first;
    l.n_blocks = n;
    l.n_master_blocks = n / 4;
    l.offset = (uint64_t)first * kvb_kv_block_bytes(&G_A);
    l.bytes = (uint64_t)n * kvb_kv_block_bytes(&G_A);
    l.epoch = 3;
    return l;
}

/* kill -9 of the coordinator and a restart on the same endpoint: the models register again with their
 * loans and the ledger is rebuilt. */
KVB_TEST(proc_restart_rebuilds_ledger) {
    make_dir();
    snprintf(g_hb_ms, sizeof g_hb_ms, "500"); /* grace 1 s between the worker's and the master's Register */
    start_coordinator();
    peer m, w;
    peer_open(&m, "m");
    peer_open(&w, "w");
    peer_register(&m, KVB_ROLE_MASTER, &G_M, 64);
    keep_alive(&m);
    peer_register(&w, KVB_ROLE_WORKER, &G_A, 64);
    keep_alive(&w);
    uint64_t id = lend_flow(&m, &w, 56, 8);
    Kvbank__Envelope *s = status_of(1);
    char *cid = strdup(s->status_reply->coordinator_id);
    kvbank__envelope__free_unpacked(s, NULL);

    ck_assert_int_eq(stop_coordinator(SIGKILL, 10), SIGKILL); /* wait status of a SIGKILLed process */
    g_n_alive = 0;
    start_coordinator();
    wait_unknown(&w);
    wait_unknown(&m);
    /* the worker first (no master yet): its loans wait; one of them the master never had */
    Kvbank__Loan wl[2] = {wire_loan(id, "w", 56, 8), wire_loan(99, "w", 48, 8)};
    Kvbank__Loan *wlp[2] = {&wl[0], &wl[1]};
    Kvbank__Envelope *h = NULL;
    Kvbank__RegisterReply *rr = peer_register_loans(&w, KVB_ROLE_WORKER, (uint32_t)getpid(), &G_A, 64, wlp, 2, &h);
    ck_assert_msg(rr->ok, "%s", rr->error);
    ck_assert_str_ne(rr->coordinator_id, cid);
    kvbank__envelope__free_unpacked(h, NULL);
    keep_alive(&w);
    Kvbank__Loan ml = wire_loan(id, "w", 56, 8);
    Kvbank__Loan *mlp = &ml;
    rr = peer_register_loans(&m, KVB_ROLE_MASTER, (uint32_t)getpid(), &G_M, 64, &mlp, 1, &h);
    ck_assert(rr->ok);
    kvbank__envelope__free_unpacked(h, NULL);
    keep_alive(&m);
    /* the loan the master did not have goes back to the worker */
    Kvbank__Envelope *e = peer_expect(&w, KVBANK__ENVELOPE__BODY_RECLAIMED, 10000, "worker-only loan");
    ck_assert_uint_eq(e->reclaimed->loan_id, 99);
    ck_assert_uint_eq(e->reclaimed->first_block, 48);
    kvbank__envelope__free_unpacked(e, NULL);
    s = status_of(1);
    const Kvbank__StatusReply *sr = s->status_reply;
    ck_assert_str_ne(sr->coordinator_id, cid);
    ck_assert_uint_eq(sr->n_loans, 1);
    ck_assert_uint_eq(sr->loans[0]->loan_id, id);
    ck_assert_str_eq(sr->loans[0]->lender, "w");
    ck_assert_uint_eq(sr->loans[0]->first_block, 56);
    ck_assert_uint_eq(sr->loans[0]->n_blocks, 8);
    ck_assert(!sr->loans[0]->revoking);
    ck_assert_uint_eq(find_status(sr, "w")->n_lent, 8);
    ck_assert_uint_eq(find_status(sr, "m")->n_borrowed, 2);
    kvbank__envelope__free_unpacked(s, NULL);
    free(cid);
    /* the rebuilt loan is reclaimed the usual way, and new loans get new ids */
    uint64_t id2 = lend_flow(&m, &w, 40, 8);
    ck_assert_uint_gt(id2, 99);
    send_reclaim(&w, 16);
    e = peer_expect(&m, KVBANK__ENVELOPE__BODY_REVOKE, 10000, "revoke 1");
    uint64_t r1 = e->revoke->loan_id;
    kvbank__envelope__free_unpacked(e, NULL);
    e = peer_expect(&m, KVBANK__ENVELOPE__BODY_REVOKE, 10000, "revoke 2");
    uint64_t r2 = e->revoke->loan_id;
    kvbank__envelope__free_unpacked(e, NULL);
    ck_assert_uint_eq(r1, id2); /* lowest first_block first */
    ck_assert_uint_eq(r2, id);
    send_revoke_ack(&m, id, 0);
    e = peer_expect(&w, KVBANK__ENVELOPE__BODY_RECLAIMED, 10000, "reclaimed");
    ck_assert_uint_eq(e->reclaimed->loan_id, id);
    kvbank__envelope__free_unpacked(e, NULL);
    peer_close(&m);
    peer_close(&w);
    teardown();
}
KVB_TEST_END

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

/* ------------------------------------------------------------------------------------ trust (issue 15) */

/* Waits `ms` while the g_alive peers heartbeat (and reads what comes to `p`, which must be nothing but
 * heartbeat replies when `quiet`). */
static void wait_alive(peer *p, int ms) {
    uint64_t end = kvb_now_ns() + (uint64_t)ms * 1000000u;
    while (kvb_now_ns() < end) {
        Kvbank__Envelope *e = peer_recv(p, 20);
        if (e) kvbank__envelope__free_unpacked(e, NULL);
    }
}

static uint64_t auth_refused(void) {
    Kvbank__Envelope *s = status_of(0);
    uint64_t n = s->status_reply->auth_refused;
    kvbank__envelope__free_unpacked(s, NULL);
    return n;
}

/* A connection under a worker's name cannot take the worker's route: one without credentials (the
 * hijacker of the issue, which sends nothing), one with a wrong token, one with the control login on
 * the models' endpoint. Each is refused at its handshake and counted; the real worker stays alive
 * with its loan for many silence limits. */
KVB_TEST(proc_hijack_refused) {
    make_dir();
    snprintf(g_hb_ms, sizeof g_hb_ms, "50");
    snprintf(g_misses, sizeof g_misses, "4"); /* dead after 200 ms of silence */
    start_coordinator();
    peer m, w, h[3];
    peer_open(&m, "m");
    peer_open(&w, "w");
    peer_register(&m, KVB_ROLE_MASTER, &G_M, 64);
    keep_alive(&m);
    peer_register(&w, KVB_ROLE_WORKER, &G_A, 64);
    keep_alive(&w);
    uint64_t id = lend_flow(&m, &w, 56, 8);
    wait_alive(&m, 100);
    uint64_t refused0 = auth_refused();
    char wrong[KVB_AUTH_TOKEN_LEN + 1];
    memset(wrong, '0', KVB_AUTH_TOKEN_LEN);
    wrong[KVB_AUTH_TOKEN_LEN] = '\0';
    peer_open_at(&h[0], 0, "w", NULL, NULL);
    peer_open_at(&h[1], 0, "w", "w", wrong);
    peer_open_at(&h[2], 0, "w", KVB_AUTH_CTL_USER, "-");
    wait_alive(&m, 1000); /* five silence limits */
    Kvbank__Envelope *s = status_of(1);
    const Kvbank__ModelStatus *ws = find_status(s->status_reply, "w");
    ck_assert_ptr_nonnull(ws);
    if (!ws->alive) print_log();
    ck_assert_msg(ws->alive, "the worker lost its route to a hijacker");
    ck_assert_uint_eq(s->status_reply->n_loans, 1);
    ck_assert_uint_eq(s->status_reply->loans[0]->loan_id, id);
    ck_assert(!s->status_reply->loans[0]->revoking);
    ck_assert_uint_ge(s->status_reply->auth_refused, refused0 + 3);
    kvbank__envelope__free_unpacked(s, NULL);
    /* the worker's route still works: its reclaim goes through and comes back */
    send_reclaim(&w, 8);
    Kvbank__Envelope *e = peer_expect(&m, KVBANK__ENVELOPE__BODY_REVOKE, 10000, "revoke after the hijack");
    ck_assert_uint_eq(e->revoke->loan_id, id);
    uint64_t ep = e->revoke->epoch;
    kvbank__envelope__free_unpacked(e, NULL);
    send_revoke_ack(&m, id, ep);
    e = peer_expect(&w, KVBANK__ENVELOPE__BODY_RECLAIMED, 10000, "reclaimed after the hijack");
    kvbank__envelope__free_unpacked(e, NULL);
    ck_assert(log_contains("refused a connection"));
    for (int i = 0; i < 3; i++) peer_close(&h[i]);
    peer_close(&m);
    peer_close(&w);
    teardown();
}
KVB_TEST_END

/* Forged claims are refused, counted, and kill nothing: a registration without credentials gets no
 * answer at all; a master that registers with another process's pid (the pid the coordinator would
 * SIGKILL to fence it) is refused, and so are registrations with a region of another pid or one that
 * does not exist. The victim process lives on, also after the would-be master falls silent. */
KVB_TEST(proc_forged_claims) {
    make_dir();
    snprintf(g_hb_ms, sizeof g_hb_ms, "50");
    snprintf(g_misses, sizeof g_misses, "4");
    start_coordinator();
    pid_t victim = fork();
    ck_assert_int_ge(victim, 0);
    if (victim == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        for (;;) pause();
    }
    uint64_t refused0 = auth_refused();

    /* no credentials: the handshake is refused, the Register never arrives */
    peer x;
    peer_open_at(&x, 0, "x", NULL, NULL);
    Kvbank__KvGeometry wg = KVBANK__KV_GEOMETRY__INIT;
    wg.n_layers = (uint32_t)G_M.n_layers, wg.n_kv_heads = (uint32_t)G_M.n_kv_heads;
    wg.head_dim = (uint32_t)G_M.head_dim, wg.block_size = (uint32_t)G_M.block_size;
    wg.elem_size = (uint32_t)G_M.elem_size;
    Kvbank__Register r = KVBANK__REGISTER__INIT;
    r.name = "x";
    r.role = KVBANK__ROLE__ROLE_WORKER;
    r.pid = (uint32_t)getpid();
    r.geom = &wg;
    r.region = "/kvb-none";
    r.capacity = 64;
    r.region_bytes = 64 * kvb_kv_block_bytes(&G_M);
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_REGISTER;
    env.register_ = &r;
    zmq_send(x.sock, "", 0, ZMQ_DONTWAIT); /* (a DEALER without a connection queues nothing) */
    kvb_wire_send(x.sock, NULL, 0, &env, 1);
    Kvbank__Envelope *e = peer_recv(&x, 500);
    int x_answered = e != NULL;
    if (e) kvbank__envelope__free_unpacked(e, NULL);

    /* a master that names the victim's pid: refused (its connection is this process) */
    peer m, w;
    peer_open(&m, "m");
    Kvbank__Envelope *h = NULL;
    Kvbank__RegisterReply *rr = peer_register_loans(&m, KVB_ROLE_MASTER, (uint32_t)victim, &G_M, 64, NULL, 0, &h);
    int forged_ok = rr->ok;
    char forged_err[256];
    snprintf(forged_err, sizeof forged_err, "%s", rr->error ? rr->error : "");
    kvbank__envelope__free_unpacked(h, NULL);
    if (forged_ok) {
        /* (a coordinator that takes it: the master borrows and falls silent, and is fenced) */
        peer_open(&w, "w");
        peer_register(&w, KVB_ROLE_WORKER, &G_A, 64);
        keep_alive(&w);
        send_offer(&w, 56, 8);
        e = peer_expect(&m, KVBANK__ENVELOPE__BODY_GRANT, 10000, "grant to the forged master");
        send_grant_ack(&m, e->grant->loan->loan_id, 1);
        kvbank__envelope__free_unpacked(e, NULL);
        wait_alive(&w, 1000);
        peer_close(&w);
    }

    /* regions that are not the registering process's */
    peer y, z;
    peer_open(&y, "y");
    peer_open(&z, "z");
    char other[96];
    snprintf(other, sizeof other, "/kvb-t%d_y-%d-0", (int)getpid(), (int)victim); /* another pid's name */
    int fd = shm_open(other, O_CREAT | O_RDWR, 0600);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(ftruncate(fd, 64 * (off_t)kvb_kv_block_bytes(&G_M)), 0);
    close(fd);
    const char *regions[2] = {other, "/kvb-nothere-1-1"};
    peer *ps[2] = {&y, &z};
    int region_ok[2];
    char region_err[2][256];
    for (int i = 0; i < 2; i++) {
        Kvbank__Register rg = r;
        rg.name = ps[i]->name;
        rg.region = (char *)regions[i];
        env.register_ = &rg;
        peer_send(ps[i], &env);
        e = peer_expect(ps[i], KVBANK__ENVELOPE__BODY_REGISTER_REPLY, 10000, "register with a foreign region");
        region_ok[i] = e->register_reply->ok;
        snprintf(region_err[i], sizeof region_err[i], "%s", e->register_reply->error ? e->register_reply->error : "");
        kvbank__envelope__free_unpacked(e, NULL);
    }
    shm_unlink(other);

    int victim_alive = kill(victim, 0) == 0 && waitpid(victim, NULL, WNOHANG) == 0;
    uint64_t refused = auth_refused();
    kill(victim, SIGKILL);
    waitpid(victim, NULL, 0);
    if (forged_ok || !victim_alive) print_log();
    ck_assert_msg(victim_alive, "the coordinator killed pid %d, which a peer named as its own", (int)victim);
    ck_assert_msg(!forged_ok, "a registration with another process's pid was accepted");
    ck_assert_msg(!x_answered, "a registration without credentials was answered");
    ck_assert_msg(strstr(forged_err, "pid") != NULL, "refusal: %s", forged_err);
    for (int i = 0; i < 2; i++) {
        ck_assert_msg(!region_ok[i], "a registration with region %s was accepted", regions[i]);
        ck_assert_msg(strstr(region_err[i], "region") != NULL, "refusal: %s", region_err[i]);
    }
    ck_assert_uint_ge(refused, refused0 + 4); /* x's handshake, m's pid, y's and z's regions */
    peer_close(&x);
    peer_close(&m);
    peer_close(&y);
    peer_close(&z);
    teardown();
}
KVB_TEST_END

/* Under kvbankd (the node secret on KVB_AUTH_FD, no key file) only kvbankd's children may log in as
 * models: a token alone does not make a process the model. The test plays kvbankd. A connection of the
 * test process itself with model m's right token is refused at its handshake and counted (the process
 * is not a child of the supervisor), its Register never arrives; a forked child with the same token
 * registers as m and is served. The supervised coordinator keeps the secret off the disk. */
KVB_TEST(proc_supervised_children_only) {
    make_dir();
    snprintf(g_hb_ms, sizeof g_hb_ms, "100");
    snprintf(g_misses, sizeof g_misses, "50");
    ck_assert_int_eq(kvb_auth_new_secret(&g_sup), KVB_OK);
    start_coordinator();
    char key[PATH_MAX];
    ck_assert_int_eq(kvb_auth_key_path(g_endpoint, key, sizeof key), KVB_OK);
    ck_assert_msg(access(key, F_OK) != 0, "a coordinator under a supervisor wrote the node key to %s", key);
    uint64_t refused0 = auth_refused();

    /* the right token from a process kvbankd did not start */
    peer self;
    peer_open(&self, "m");
    self.refused = 1;
    peer_send_register(&self, KVB_ROLE_MASTER, (uint32_t)getpid(), &G_M, 64, NULL, 0);
    Kvbank__Envelope *e = peer_recv(&self, 1000);
    int self_answered = e != NULL;
    if (e) kvbank__envelope__free_unpacked(e, NULL);
    uint64_t refused1 = auth_refused();

    /* the same token from a child of the supervisor */
    int fds[2];
    pid_t child = spawn_child_master(fds);
    close(fds[0]);
    int registered = wait_child_master(child);
    kill(child, SIGKILL);
    ck_assert_int_eq(waitpid(child, NULL, 0), child);
    char ctag[32];
    snprintf(ctag, sizeof ctag, "t%d_m", (int)child);
    kvb_region_unlink_stale(ctag, NULL); /* the killed child's region */
    if (self_answered || !registered) print_log();
    ck_assert_msg(!self_answered, "a process that kvbankd did not start registered with a model's token");
    ck_assert_uint_ge(refused1, refused0 + 1);
    ck_assert(log_contains("did not start it"));
    ck_assert_msg(registered, "kvbankd's child did not register with its token");
    peer_close(&self);
    teardown();
}
KVB_TEST_END

static void nc_load(void *ud, kvb_node_load *out) {
    (void)ud;
    memset(out, 0, sizeof *out);
}

/* A model whose route is lost (another connection logged in under its name took it, e.g. a stray
 * second process of the same model) notices the silence, makes a new socket and registers again: it
 * recovers without a restart and before the coordinator's silence limit, so it is never declared
 * dead. The real node client (common/ipc/node_client.c), with its token from the key file. */
KVB_TEST(proc_route_recovery) {
    make_dir();
    snprintf(g_hb_ms, sizeof g_hb_ms, "100");
    snprintf(g_misses, sizeof g_misses, "15"); /* dead after 1.5 s of silence; the client reconnects after 0.5 s */
    start_coordinator();
    char tag[32];
    snprintf(tag, sizeof tag, "t%d_w", (int)getpid());
    kvb_region *reg = NULL;
    ck_assert_int_eq(kvb_region_create(tag, 64 * kvb_kv_block_bytes(&G_A), &reg), KVB_OK);
    kvb_node_identity id = {.name = "w", .role = KVB_ROLE_WORKER, .geom = G_A, .region = kvb_region_handle(reg),
                            .region_bytes = kvb_region_size(reg), .capacity = 64, .endpoint = "ipc:///nowhere"};
    kvb_node_callbacks cb = {.load = nc_load};
    kvb_node_client *nc = NULL;
    ck_assert_int_eq(kvb_node_client_create(g_endpoint, &id, &cb, 100, &nc), KVB_OK);
    for (int i = 0; i < 100 && !kvb_node_client_registered(nc); i++) kvb_node_client_pump(nc, 50);
    ck_assert(kvb_node_client_registered(nc));

    /* the stray connection: w's own credentials, routing id w, silent */
    char tok[KVB_AUTH_TOKEN_LEN + 1];
    ck_assert(model_token("w", tok));
    peer stray;
    peer_open_at(&stray, 0, "w", "w", tok);
    kvb_node_client_pump(nc, 3000); /* two coordinator silence limits */
    ck_assert(kvb_node_client_registered(nc));
    Kvbank__Envelope *s = status_of(0);
    const Kvbank__ModelStatus *ws = find_status(s->status_reply, "w");
    ck_assert_ptr_nonnull(ws);
    ck_assert(ws->alive);
    ck_assert_uint_lt(ws->last_heartbeat_ms, 500);
    kvbank__envelope__free_unpacked(s, NULL);
    if (log_contains(" is dead")) print_log();
    ck_assert_msg(!log_contains(" is dead"), "the worker was declared dead while its route was lost");
    peer_close(&stray);
    kvb_node_client_destroy(nc);
    kvb_region_destroy(reg);
    teardown();
}
KVB_TEST_END

KVB_TEST_MAIN("coordinator", KVB_T(ledger_meu_per_pair, 10), KVB_T(ledger_offer_validation, 10),
              KVB_T(ledger_refuses_regions_off_the_masters_plan, 10),
              KVB_T(ledger_master_borrow_limit, 10), KVB_T(ledger_restart_mid_partial_revoke, 10), KVB_T(ledger_reclaim_lowest_first, 10), KVB_T(ledger_partial_reclaim_widened, 10), KVB_T(ledger_grant_failures, 10),
              KVB_T(ledger_lend_reclaim_counters, 10),
              KVB_T(ledger_master_death_returns_loans, 10), KVB_T(ledger_silent_master_fenced_first, 10), KVB_T(ledger_worker_death_revokes_lender_dead, 10),
              KVB_T(ledger_register_rules, 10), KVB_T(ledger_drain, 10), KVB_T(ledger_drain_failure_changes_nothing, 10), KVB_T(ledger_restart_both_sides, 10),
              KVB_T(ledger_restart_worker_alone, 10), KVB_T(ledger_restart_master_alone, 10),
              KVB_T(ledger_reregister_same_pid, 10), KVB_T(proc_lend_reclaim_flow, 60), KVB_T(proc_master_borrow_limit, 60), KVB_T(proc_worker_silent, 60),
              KVB_T(proc_master_killed, 60), KVB_T(proc_bad_messages, 60), KVB_T(proc_restart_rebuilds_ledger, 60),
              KVB_T(ctl_control, 60), KVB_T(ctl_status_json, 60), KVB_T(ctl_plan, 30), KVB_T(ctl_generate, 120),
              KVB_T(proc_cli, 60), KVB_T(proc_hijack_refused, 60),
              KVB_T(proc_forged_claims, 60), KVB_T(proc_supervised_children_only, 90),
              KVB_T(proc_route_recovery, 60))
