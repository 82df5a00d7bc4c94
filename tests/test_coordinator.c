/* Tests of the coordinator: kvbank-coordinator as a real process on a real ipc:// socket, driven by fake model processes: DEALER sockets in the test
 * (and, where a pid must really die, a child process) that speak the protocol of docs/lending.md the way
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
#include "tests/coordtest.h"

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

/* A worker that stops heartbeating is dead: the master gets Revoke(lender_dead). (This process plays
 * the master, which holds a loan and would be fenced with SIGKILL after the same silence: the limit
 * leaves room for a sanitized process on a loaded machine, see proc_hijack_refused.) */
KVB_TEST(proc_worker_silent) {
    make_dir();
    snprintf(g_misses, sizeof g_misses, "10"); /* 1 s of silence */
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
    Kvbank__Envelope *e = peer_expect(&m, KVBANK__ENVELOPE__BODY_REVOKE, 10000, "revoke after silence");
    double dt = (double)(kvb_now_ns() - t0) / 1e9;
    ck_assert_uint_eq(e->revoke->loan_id, id);
    ck_assert(e->revoke->lender_dead);
    ck_assert_msg(dt > 0.5, "revoked after %.3f s, before the silence limit", dt);
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
 * with its loan for many silence limits.
 * This process plays the master, which holds a loan: a silent master is fenced with SIGKILL, so the
 * silence limit must stay well above how long a sanitized process on a loaded machine can go without
 * running (with 200 ms the coordinator killed the test). */
KVB_TEST(proc_hijack_refused) {
    make_dir();
    snprintf(g_hb_ms, sizeof g_hb_ms, "100");
    snprintf(g_misses, sizeof g_misses, "10"); /* dead after 1 s of silence */
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
    heartbeat_alive();
    peer_open_at(&h[1], 0, "w", "w", wrong);
    heartbeat_alive();
    peer_open_at(&h[2], 0, "w", KVB_AUTH_CTL_USER, "-");
    wait_alive(&m, 5000); /* five silence limits */
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

KVB_TEST_MAIN("coordinator", KVB_T(proc_lend_reclaim_flow, 60), KVB_T(proc_master_borrow_limit, 60),
              KVB_T(proc_worker_silent, 60), KVB_T(proc_master_killed, 60), KVB_T(proc_bad_messages, 60),
              KVB_T(proc_restart_rebuilds_ledger, 60), KVB_T(proc_hijack_refused, 60), KVB_T(proc_forged_claims, 60),
              KVB_T(proc_supervised_children_only, 90), KVB_T(proc_route_recovery, 60))
