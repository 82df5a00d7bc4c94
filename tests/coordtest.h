/* kvbank — the process fixture of the coordinator's suites (tests/coordtest.c): the test's own
 * kvbank-coordinator in a scratch directory, fake model processes (peers: DEALER sockets in the test that
 * speak the protocol of docs/lending.md, or a real child process where a pid must really die), and
 * kvbank's programs run against them. */
#ifndef KVB_TESTS_COORDTEST_H
#define KVB_TESTS_COORDTEST_H

#include <stdint.h>
#include <sys/types.h>

#include "common/ipc/auth.h"
#include "common/ipc/wire.h"
#include "common/mem/region.h"
#include "coordinator/ledger.h"

/* Geometries: the master's block is 16384 bytes; worker A's 4096 (MEU 4 worker : 1 master); worker
 * B's 3072 (lcm 49152: MEU 16 : 3). */
extern const kvb_kv_geom G_M, G_A, G_B;

typedef struct peer {
    void *ctx, *sock;
    char name[64];           /* routing id; "" for an anonymous one */
    uint64_t last_hb_ns;
    kvb_region *region;      /* the KV region it registers with (a real one of this process) */
    int refused;             /* its login is to be refused: its sends never wait (see peer_send) */
} peer;

extern char g_dir[64];              /* this test's scratch directory */
extern char g_endpoint[160];
extern char g_log[96];
extern pid_t g_coord;               /* the coordinator's pid, -1: none */
extern char g_hb_ms[16], g_misses[16];
extern char g_config[128];          /* non-empty: start the coordinator with --config g_config */
extern kvb_auth g_sup;              /* has_secret: the test plays kvbankd, handing the coordinator this
                                     * secret on an inherited pipe (KVB_AUTH_FD) instead of its key file */
extern peer *g_alive[8];            /* peers that heartbeat while the test waits */
extern int g_n_alive;
extern int g_reg_limited;           /* the next Registers' borrowing limit (0, 0: none) */
extern uint32_t g_reg_max_borrow;

const char *builddir(void);

/* Runs a program of the build directory with stdout into out[out_len] (may be NULL) and stderr into
 * err[err_len] (may be NULL: the test's stderr). The fake peers keep heartbeating while the tool runs: a
 * loaded (sanitizer) machine may run it for longer than the silence limit, and a silent master holding
 * loans is fenced with SIGKILL, which would hit this process. Returns its exit status, -1 if it did not
 * exit. */
int run_tool(const char *const *argv, char *out, size_t out_len, char *err, size_t err_len);

void print_log(void);

int log_contains(const char *needle);

void make_dir(void);

/* Forks and execs kvbank-coordinator on g_endpoint (log appended to g_log). Does not wait. */
void spawn_coordinator(void);

int stop_coordinator(int sig, double timeout_s);

/* The token of model `name` from the coordinator's key file next to its socket (the way a model run by
 * hand logs in); 0 when there is no key file (a coordinator that does not authenticate). */
int model_token(const char *name, char out[KVB_AUTH_TOKEN_LEN + 1]);

/* A DEALER to the coordinator's models' endpoint (ctl: its control endpoint) with routing id `name`
 * (NULL: none, the ROUTER makes one up) that logs in as `user` with `password` (user NULL: no PLAIN at
 * all). */
void peer_open_at(peer *p, int ctl, const char *name, const char *user, const char *password);

/* A model peer logs in with its token on the models' endpoint; an anonymous one as a control client on
 * the control endpoint. (Without a key file, as against a coordinator that does not authenticate, both
 * connect to the one endpoint without credentials.) */
void peer_open(peer *p, const char *name);

void peer_close(peer *p);

/* A DEALER queues a message only on a connection it has: once the coordinator refused a peer's
 * handshake (which can come before its first send) a blocking send would wait for good, so a peer
 * whose login is to be refused sends without waiting and may drop the message. */
void peer_send(peer *p, Kvbank__Envelope *env);

void send_heartbeat(peer *p);

void keep_alive(peer *p);

void heartbeat_alive(void);

/* The next message on p within timeout_ms other than a HeartbeatReply, or NULL. Heartbeats the
 * g_alive peers meanwhile. */
Kvbank__Envelope *peer_recv(peer *p, int timeout_ms);

Kvbank__Envelope *peer_expect(peer *p, Kvbank__Envelope__BodyCase want, int timeout_ms, const char *what);

/* Waits until the coordinator answers a status request. */
Kvbank__Envelope *status_of(int ledger);

void start_coordinator(void);

void teardown(void);

/* Sends p's Register: `role`, `pid`, geometry `g`, `capacity` blocks in a real region of this process
 * (made or grown here), the loans it reports. */
void peer_send_register(peer *p, kvb_role role, uint32_t pid, const kvb_kv_geom *g, uint32_t capacity,
                               Kvbank__Loan **loans, size_t n_loans);

/* p registers (peer_send_register) and gets its RegisterReply, which *holder owns. */
Kvbank__RegisterReply *peer_register_loans(peer *p, kvb_role role, uint32_t pid, const kvb_kv_geom *g,
                                                  uint32_t capacity, Kvbank__Loan **loans, size_t n_loans,
                                                  Kvbank__Envelope **holder);

void peer_register(peer *p, kvb_role role, const kvb_kv_geom *g, uint32_t capacity);

void send_offer(peer *w, uint32_t first, uint32_t n);

void send_grant_ack(peer *m, uint64_t id, int ok);

void send_revoke_ack(peer *m, uint64_t id, uint64_t epoch);

void send_reclaim(peer *w, uint32_t n);

/* Worker w offers [first, first + n); the master gets the Grant and acks it. Returns the loan id. */
uint64_t lend_flow(peer *m, peer *w, uint32_t first, uint32_t n);

const Kvbank__ModelStatus *find_status(const Kvbank__StatusReply *s, const char *name);

/* The fake master as a real process: registers with its own pid, acks every Grant, heartbeats, and
 * writes one byte to `fd` after its first GrantAck. Never returns. */
void child_master(int fd);

/* Forks child_master; fds gets its pipe (fds[0] the read end, open; fds[1] closed). Returns its pid. */
pid_t spawn_child_master(int fds[2]);

/* 1 once the coordinator counts `child` as model m, alive, with its pid; 0 after 15 s. Bounded by the
 * clock, not by a count of polls: each poll is a new control connection with its own handshake, and on
 * a loaded machine 250 of them took the test past its time limit. */
int wait_child_master(pid_t child);

#endif
