/* Tests of the coordinator's ledger as a library (coordinator/ledger.h): registrations, offers, grants,
 * revokes, restarts and failures as pure logic, time passed in, pids through a fake table. */
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

KVB_TEST_MAIN("ledger", KVB_T(ledger_meu_per_pair, 10), KVB_T(ledger_offer_validation, 10),
              KVB_T(ledger_refuses_regions_off_the_masters_plan, 10), KVB_T(ledger_master_borrow_limit, 10),
              KVB_T(ledger_restart_mid_partial_revoke, 10), KVB_T(ledger_reclaim_lowest_first, 10),
              KVB_T(ledger_partial_reclaim_widened, 10), KVB_T(ledger_grant_failures, 10),
              KVB_T(ledger_lend_reclaim_counters, 10), KVB_T(ledger_master_death_returns_loans, 10),
              KVB_T(ledger_silent_master_fenced_first, 10), KVB_T(ledger_worker_death_revokes_lender_dead, 10),
              KVB_T(ledger_register_rules, 10), KVB_T(ledger_drain, 10),
              KVB_T(ledger_drain_failure_changes_nothing, 10), KVB_T(ledger_restart_both_sides, 10),
              KVB_T(ledger_restart_worker_alone, 10), KVB_T(ledger_restart_master_alone, 10),
              KVB_T(ledger_reregister_same_pid, 10))
