/* kvbankd — the node supervisor: starts the coordinator and every model of one node config, restarts
 * what dies, drains everything on SIGTERM. One libuv loop; children are uv_spawn'ed, their exits are
 * uv exit callbacks; the coordinator's readiness is a ZeroMQ StatusRequest polled from a timer. */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <getopt.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <uv.h>
#include <zmq.h>

#include "common/ipc/auth.h"
#include "common/ipc/wire.h"
#include "common/mem/mem.h"
#include "common/mem/region.h"
#include "common/util/node_config.h"

#define BACKOFF_FIRST_S 0.5    /* first restart delay; doubles per attempt */
#define BACKOFF_MAX_S 30.0
#define BACKOFF_RESET_S 60.0   /* a child that ran this long starts again from the first delay */
#define STOP_GRACE_MS 10000    /* SIGTERM, then SIGKILL after this long */
#define PROBE_TICK_MS 100      /* coordinator readiness poll */
#define PROBE_RESEND_S 2.0     /* a StatusRequest unanswered this long is sent again on a new socket */
#define PROBE_DEADLINE_S 10.0  /* then the models start anyway */

typedef struct kvbankd kvbankd;

/* One supervised process: the coordinator or one model. */
typedef struct child {
    kvbankd *d;
    const char *name;             /* "coordinator" or the model's name (borrowed from the config) */
    const kvb_node_model *model;  /* NULL for the coordinator */
    char tag[48];                 /* the model's region tag "<node>_<model>" (empty for the coordinator) */
    char *argv[8];                /* [0] the program's path (owned), the rest borrowed from the config */
    uv_process_t proc;
    uv_timer_t restart_timer;
    int proc_open;                /* proc was spawned (or a spawn failed) and its close callback has not run */
    int running;                  /* the process lives: spawned, exit callback not yet run */
    int attempts;                 /* restarts since the last run that lasted BACKOFF_RESET_S */
    int pid;
    double started_s;             /* monotonic time of the last spawn */
    char last_exit[96];           /* how the last run ended ("signal 9 Killed", "exit status 1") */
} child;

typedef enum phase {
    PHASE_MKMODEL = 0,     /* generating missing model directories, one at a time */
    PHASE_COORD_WAIT = 1,  /* coordinator started, waiting for its StatusReply */
    PHASE_RUNNING = 2,     /* everything started; children that die are restarted */
    PHASE_DRAIN_MODELS = 3,
    PHASE_DRAIN_COORD = 4,
    PHASE_DONE = 5,
} phase;

struct kvbankd {
    uv_loop_t loop;
    kvb_node_config *cfg;
    char *bin_dir;                /* owned */
    phase phase;
    int exit_code;
    child coord;
    child *models;                /* [cfg->n_models], owned */
    child gw;                     /* kvbank-gateway, when the config has a "gateway" section */
    int has_gw;
    /* kvbank-mkmodel: model mk_index is written into mk_tmp (owned), renamed to model_dir on success */
    uv_process_t mk_proc;
    int mk_open, mk_running, mk_index;
    char *mk_tmp;
    char *mk_argv[64];            /* [0] owned path, words owned by mk_words, the output dir borrowed */
    char *mk_words;
    /* readiness probe: a DEALER sending StatusRequest to the coordinator */
    void *zctx, *zsock;
    double probe_sent_s, probe_deadline_s;
    uv_timer_t probe_timer;
    uv_timer_t drain_timer;       /* SIGKILL after STOP_GRACE_MS */
    uv_signal_t sig_term, sig_int, sig_hup;
    int signals;                  /* stop signals received */
    int pid_fd;                   /* the locked pid file, -1 when none */
    char *pid_path;
    int node_lock_fd;             /* the locked /dev/shm/kvbankd-<uid>-<node>.lock, -1 when none */
    char *node_lock_path;
    kvb_auth auth;                /* this start's node secret (common/ipc/auth.h) */
    char **env;                   /* the children's environment: ours + KVB_AUTH_FD=3 (owned) */
};

static void child_exit_cb(uv_process_t *p, int64_t status, int term_signal);
static void drain_step(kvbankd *d);
static void drain_timeout_cb(uv_timer_t *t);
static void begin_drain(kvbankd *d, int code);
static void start_models(kvbankd *d);

/* ------------------------------------------------------------------------------------------ files */

/* mkdir -p with `mode` for every directory it creates. */
static int mkdir_p(const char *path, mode_t mode) {
    char buf[PATH_MAX];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) {
        errno = ENAMETOOLONG;
        return -1;
    }
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = '\0';
        if (mkdir(buf, mode) != 0 && errno != EEXIST) return -1;
        *p = '/';
    }
    if (mkdir(buf, mode) != 0 && errno != EEXIST) return -1;
    return 0;
}

/* Creates run_dir (0700, owned by us, a directory). */
static kvb_status make_run_dir(const char *dir) {
    if (mkdir_p(dir, 0700) != 0) {
        KVB_LOG_E("run_dir %s: cannot create: %s", dir, strerror(errno));
        return KVB_ERR_IO;
    }
    struct stat sb;
    if (lstat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
        KVB_LOG_E("run_dir %s: not a directory", dir);
        return KVB_ERR_IO;
    }
    if (sb.st_uid != geteuid()) {
        KVB_LOG_E("run_dir %s: owned by uid %u, not by this user (%u)", dir, (unsigned)sb.st_uid, (unsigned)geteuid());
        return KVB_ERR_IO;
    }
    if ((sb.st_mode & 07777) != 0700 && chmod(dir, 0700) != 0) {
        KVB_LOG_E("run_dir %s: chmod 0700: %s", dir, strerror(errno));
        return KVB_ERR_IO;
    }
    return KVB_OK;
}

static int rm_entry(const char *path, const struct stat *sb, int type, struct FTW *ftw) {
    (void)sb, (void)type, (void)ftw;
    if (remove(path) != 0) KVB_LOG_W("cannot remove %s: %s", path, strerror(errno));
    return 0;
}

/* rm -r; quiet when it does not exist. */
static void remove_tree(const char *path) {
    struct stat sb;
    if (lstat(path, &sb) != 0) return;
    nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* The socket file of an ipc:// endpoint, or NULL. */
static const char *ipc_path(const char *ep) { return ep && !strncmp(ep, "ipc://", 6) ? ep + 6 : NULL; }

/* Removes the socket file of an ipc:// endpoint if one is there (nothing else: a regular file at that
 * path is somebody's mistake, not ours to delete). */
static void remove_socket(const char *ep) {
    const char *p = ipc_path(ep);
    struct stat sb;
    if (!p || lstat(p, &sb) != 0 || !S_ISSOCK(sb.st_mode)) return;
    if (unlink(p) != 0) KVB_LOG_W("cannot remove socket %s: %s", p, strerror(errno));
    else KVB_LOG_D("removed socket %s", p);
}

/* Removes the shared-memory segments of the node's models whose process is dead (kvb_region_unlink_stale:
 * a live process's segments stay, even one of another node of the same name). Returns how many went. */
static int unlink_node_shm(const kvbankd *d) {
    int total = 0;
    for (int i = 0; i < d->cfg->n_models; i++) {
        int n = 0;
        if (kvb_region_unlink_stale(d->models[i].tag, &n) == KVB_OK) total += n;
    }
    return total;
}

/* Locks /dev/shm/kvbankd-<uid>-<node>.lock: one kvbankd per node name (and user) on the machine,
 * whatever its run_dir, because the node's shared-memory names are machine-wide. A second one refuses
 * to start, naming the running one's pid and run_dir (written into the file by write_pid_file). */
static kvb_status lock_node(kvbankd *d) {
    size_t n = strlen(d->cfg->node) + 64;
    KVB_TRY(kvb_malloc(n, (void **)&d->node_lock_path));
    snprintf(d->node_lock_path, n, "/dev/shm/kvbankd-%u-%s.lock", (unsigned)geteuid(), d->cfg->node);
    for (int attempt = 0; attempt < 8; attempt++) {
        int fd = open(d->node_lock_path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
        struct stat sb, sp;
        if (fd < 0 || fstat(fd, &sb) != 0) {
            KVB_LOG_E("%s: cannot open: %s", d->node_lock_path, strerror(errno));
            if (fd >= 0) close(fd);
            return KVB_ERR_IO;
        }
        if (sb.st_uid != geteuid() || !S_ISREG(sb.st_mode)) {
            KVB_LOG_E("%s: not a file of this user (uid %u)", d->node_lock_path, (unsigned)sb.st_uid);
            close(fd);
            return KVB_ERR_IO;
        }
        if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
            char who[PATH_MAX + 32] = "";
            ssize_t r = pread(fd, who, sizeof who - 1, 0);
            who[r > 0 ? r : 0] = '\0';
            char *nl = strchr(who, '\n');
            const char *run_dir = "?";
            if (nl) {
                *nl = '\0';
                run_dir = nl + 1;
                nl = strchr(nl + 1, '\n');
                if (nl) *nl = '\0';
            }
            KVB_LOG_E("kvbankd for node \"%s\" already runs on this machine (pid %s, run_dir %s; lock %s)",
                      d->cfg->node, who[0] ? who : "?", run_dir[0] ? run_dir : "?", d->node_lock_path);
            close(fd);
            return KVB_ERR_STATE;
        }
        /* The holder may have removed the file between our open and our lock: ours must be the file at
         * the path, else a third kvbankd could lock a new one at the same time. */
        if (stat(d->node_lock_path, &sp) == 0 && sp.st_dev == sb.st_dev && sp.st_ino == sb.st_ino) {
            d->node_lock_fd = fd;
            return KVB_OK;
        }
        close(fd);
    }
    KVB_LOG_E("%s: cannot take the lock (the file keeps being replaced)", d->node_lock_path);
    return KVB_ERR_STATE;
}

/* Locks run_dir/kvbankd.pid so that a second kvbankd of the same node refuses to start. */
static kvb_status lock_pid_file(kvbankd *d) {
    size_t n = strlen(d->cfg->run_dir) + sizeof "/kvbankd.pid";
    KVB_TRY(kvb_malloc(n, (void **)&d->pid_path));
    snprintf(d->pid_path, n, "%s/kvbankd.pid", d->cfg->run_dir);
    d->pid_fd = open(d->pid_path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (d->pid_fd < 0) {
        KVB_LOG_E("%s: cannot open: %s", d->pid_path, strerror(errno));
        return KVB_ERR_IO;
    }
    if (flock(d->pid_fd, LOCK_EX | LOCK_NB) != 0) {
        char old[32] = "";
        ssize_t r = pread(d->pid_fd, old, sizeof old - 1, 0);
        if (r > 0) old[strcspn(old, "\n")] = '\0';
        KVB_LOG_E("%s is locked: kvbankd for node \"%s\" already runs (pid %s)", d->pid_path, d->cfg->node,
                  r > 0 ? old : "?");
        close(d->pid_fd);
        d->pid_fd = -1;
        return KVB_ERR_STATE;
    }
    return KVB_OK;
}

/* Writes our pid into the pid file, and pid and run_dir into the node lock. */
static kvb_status write_pid_file(kvbankd *d) {
    char buf[PATH_MAX + 32];
    int n = snprintf(buf, sizeof buf, "%ld\n", (long)getpid());
    if (ftruncate(d->pid_fd, 0) != 0 || pwrite(d->pid_fd, buf, (size_t)n, 0) != n) {
        KVB_LOG_E("%s: cannot write: %s", d->pid_path, strerror(errno));
        return KVB_ERR_IO;
    }
    n = snprintf(buf, sizeof buf, "%ld\n%s\n", (long)getpid(), d->cfg->run_dir);
    if (n >= (int)sizeof buf) n = (int)sizeof buf - 1;
    if (ftruncate(d->node_lock_fd, 0) != 0 || pwrite(d->node_lock_fd, buf, (size_t)n, 0) != n) {
        KVB_LOG_E("%s: cannot write: %s", d->node_lock_path, strerror(errno));
        return KVB_ERR_IO;
    }
    return KVB_OK;
}

static void remove_pid_file(kvbankd *d) {
    if (d->pid_fd >= 0) {
        unlink(d->pid_path);
        close(d->pid_fd); /* releases the lock */
        d->pid_fd = -1;
    }
    if (d->node_lock_fd >= 0) {
        unlink(d->node_lock_path); /* under the lock: a waiting kvbankd re-checks the path (lock_node) */
        close(d->node_lock_fd);
        d->node_lock_fd = -1;
    }
}

/* The coordinator's two socket files: the models' endpoint and the control one (EP.ctl). */
static void remove_coordinator_sockets(const kvbankd *d) {
    char ctl[PATH_MAX + 16];
    remove_socket(d->cfg->coordinator);
    if (kvb_auth_ctl_endpoint(d->cfg->coordinator, ctl, sizeof ctl) == KVB_OK) remove_socket(ctl);
}

/* ------------------------------------------------------------------------------------- children */

static void describe_exit(int64_t status, int sig, char *buf, size_t len) {
    if (sig) snprintf(buf, len, "signal %d %s", sig, strsignal(sig));
    else snprintf(buf, len, "exit status %lld", (long long)status);
}

static void spawn_child(child *c);

static void restart_timer_cb(uv_timer_t *t) {
    child *c = t->data;
    if (c->d->phase >= PHASE_DRAIN_MODELS) return;
    spawn_child(c);
}

/* The process handle of `c` is closed: restart the child later, or let the drain go on. */
static void child_closed_cb(uv_handle_t *h) {
    child *c = h->data;
    kvbankd *d = c->d;
    c->proc_open = 0;
    if (d->phase >= PHASE_DRAIN_MODELS) {
        drain_step(d);
        return;
    }
    double ran = kvb_now_s() - c->started_s;
    if (ran >= BACKOFF_RESET_S) c->attempts = 0;
    c->attempts++;
    double delay = BACKOFF_FIRST_S;
    for (int k = 1; k < c->attempts && delay < BACKOFF_MAX_S; k++) delay *= 2;
    if (delay > BACKOFF_MAX_S) delay = BACKOFF_MAX_S;
    KVB_LOG_W("restarting %s (%s, attempt %d, in %.1f s)", c->name, c->last_exit, c->attempts, delay);
    uv_timer_start(&c->restart_timer, restart_timer_cb, (uint64_t)(delay * 1000.0 + 0.5), 0);
}

static void spawn_child(child *c) {
    kvbankd *d = c->d;
    if (c->model) {
        /* A dead process leaves its segments behind; the new one creates its own under a new name. */
        int n = 0;
        kvb_region_unlink_stale(c->tag, &n);
        if (n) KVB_LOG_I("%s: removed %d stale shared-memory segment(s)", c->name, n);
    }
    /* Its credentials on fd 3 (KVB_AUTH_FD): the node secret for the coordinator, its own token for a
     * model. A pipe written and closed before the spawn: the child reads it to the end once. */
    int pfd[2] = {-1, -1};
    kvb_auth cred = d->auth;
    if (c->model) {
        memset(&cred, 0, sizeof cred);
        kvb_auth_token(d->auth.secret, c->name, cred.token);
    }
    char text[256];
    if (kvb_auth_format(&cred, text, sizeof text) != KVB_OK || pipe2(pfd, O_CLOEXEC) != 0 ||
        write(pfd[1], text, strlen(text)) != (ssize_t)strlen(text)) {
        /* uv_spawn then fails on the bad fd and the child is retried like one that could not start */
        KVB_LOG_E("%s: cannot pass its credentials: %s", c->name, strerror(errno));
        if (pfd[0] >= 0) close(pfd[0]);
        pfd[0] = -1;
    }
    explicit_bzero(text, sizeof text);
    explicit_bzero(&cred, sizeof cred);
    if (pfd[1] >= 0) close(pfd[1]);
    uv_stdio_container_t stdio[4] = {
        {.flags = UV_IGNORE},
        {.flags = UV_INHERIT_FD, .data.fd = 1},
        {.flags = UV_INHERIT_FD, .data.fd = 2},
        {.flags = UV_INHERIT_FD, .data.fd = pfd[0]},
    };
    uv_process_options_t o = {
        .exit_cb = child_exit_cb,
        .file = c->argv[0],
        .args = c->argv,
        .env = d->env,
        .stdio_count = 4,
        .stdio = stdio,
    };
    c->proc.data = c;
    c->started_s = kvb_now_s();
    c->proc_open = 1;
    int rc = uv_spawn(&d->loop, &c->proc, &o);
    if (pfd[0] >= 0) close(pfd[0]);
    if (rc != 0) {
        KVB_LOG_E("%s: cannot start %s: %s", c->name, c->argv[0], uv_strerror(rc));
        /* uv_spawn initialised the handle before failing: close it like an exited one. */
        snprintf(c->last_exit, sizeof c->last_exit, "spawn failed: %s", uv_strerror(rc));
        uv_close((uv_handle_t *)&c->proc, child_closed_cb);
        return;
    }
    c->running = 1;
    c->pid = c->proc.pid;
    KVB_LOG_I("started %s (pid %d): %s", c->name, c->pid, c->argv[0]);
}

/* The uv exit callback of a coordinator or model process. */
static void child_exit_cb(uv_process_t *p, int64_t status, int term_signal) {
    child *c = p->data;
    kvbankd *d = c->d;
    c->running = 0;
    describe_exit(status, term_signal, c->last_exit, sizeof c->last_exit);
    double ran = kvb_now_s() - c->started_s;
    if (d->phase >= PHASE_DRAIN_MODELS) KVB_LOG_I("%s (pid %d) stopped: %s", c->name, c->pid, c->last_exit);
    else KVB_LOG_W("%s (pid %d) died after %.1f s: %s", c->name, c->pid, ran, c->last_exit);
    if (c->model) {
        int n = 0;
        kvb_region_unlink_stale(c->tag, &n);
        if (n) KVB_LOG_I("%s: removed %d shared-memory segment(s) it left behind", c->name, n);
    }
    c->pid = 0;
    uv_close((uv_handle_t *)p, child_closed_cb);
}

static void kill_child(child *c, int sig) {
    if (!c->running) return;
    int rc = uv_process_kill(&c->proc, sig);
    if (rc != 0 && rc != UV_ESRCH)
        KVB_LOG_E("%s (pid %d): kill %s: %s", c->name, c->pid, strsignal(sig), uv_strerror(rc));
}

/* ------------------------------------------------------------------------- coordinator readiness */

static void probe_close(kvbankd *d) {
    if (d->zsock) zmq_close(d->zsock);
    d->zsock = NULL;
}

static void probe_stop(kvbankd *d) {
    uv_timer_stop(&d->probe_timer);
    probe_close(d);
    if (d->zctx) zmq_ctx_term(d->zctx);
    d->zctx = NULL;
}

/* A new DEALER to the coordinator with one StatusRequest queued (it leaves when the connection is up). */
static void probe_send(kvbankd *d) {
    probe_close(d);
    d->probe_sent_s = kvb_now_s();
    d->zsock = zmq_socket(d->zctx, ZMQ_DEALER);
    if (!d->zsock) {
        KVB_LOG_E("zmq_socket: %s", zmq_strerror(errno));
        return;
    }
    int linger = 0;
    zmq_setsockopt(d->zsock, ZMQ_LINGER, &linger, sizeof linger);
    kvb_auth_set_ctl(d->zsock); /* the coordinator's control login */
    char ep[PATH_MAX + 16]; /* the control endpoint */
    if (kvb_auth_ctl_endpoint(d->cfg->coordinator, ep, sizeof ep) != KVB_OK || zmq_connect(d->zsock, ep) != 0) {
        KVB_LOG_E("zmq_connect %s: %s", ep, zmq_strerror(errno));
        probe_close(d);
        return;
    }
    Kvbank__StatusRequest req = KVBANK__STATUS_REQUEST__INIT;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_STATUS_REQUEST;
    env.status_request = &req;
    if (kvb_wire_send(d->zsock, NULL, 0, &env, 1) != KVB_OK)
        KVB_LOG_D("status probe not sent: %s", zmq_strerror(errno));
}

/* 1 when a StatusReply arrived on the probe socket. */
static int probe_answered(kvbankd *d) {
    int ok = 0;
    while (d->zsock && !ok) {
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        if (zmq_msg_recv(&msg, d->zsock, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&msg);
            break;
        }
        /* kvb_wire_unpack knows the model-server bodies only: check size, version and body here. */
        size_t len = zmq_msg_size(&msg);
        Kvbank__Envelope *env = NULL;
        if (len <= KVB_WIRE_MAX_FRAME) env = kvbank__envelope__unpack(NULL, len, zmq_msg_data(&msg));
        if (!env) {
            KVB_LOG_W("status probe: dropping a malformed frame of %zu bytes", len);
        } else if (env->version != KVB_PROTO_VERSION) {
            KVB_LOG_W("status probe: dropping a message of protocol version %u (expected %u)", env->version,
                      KVB_PROTO_VERSION);
        } else if (env->body_case == KVBANK__ENVELOPE__BODY_STATUS_REPLY && env->status_reply) {
            const Kvbank__StatusReply *r = env->status_reply;
            KVB_LOG_I("coordinator answers (id %s, epoch %llu, %zu model(s) registered)",
                      r->coordinator_id ? r->coordinator_id : "?", (unsigned long long)r->epoch, r->n_models);
            ok = 1;
        } else {
            KVB_LOG_W("status probe: dropping an unexpected message (body %d)", (int)env->body_case);
        }
        if (env) kvbank__envelope__free_unpacked(env, NULL);
        zmq_msg_close(&msg);
    }
    return ok;
}

static void probe_tick(uv_timer_t *t) {
    kvbankd *d = t->data;
    if (d->phase != PHASE_COORD_WAIT) return;
    double now = kvb_now_s();
    if (probe_answered(d)) {
        probe_stop(d);
        start_models(d);
    } else if (now >= d->probe_deadline_s) {
        KVB_LOG_W("the coordinator did not answer a StatusRequest on %s within %.0f s; starting the models anyway",
                  d->cfg->coordinator, PROBE_DEADLINE_S);
        probe_stop(d);
        start_models(d);
    } else if (now - d->probe_sent_s >= PROBE_RESEND_S) {
        probe_send(d); /* a request queued to a coordinator that died meanwhile is lost: ask again */
    }
}

static void start_coordinator(kvbankd *d) {
    d->phase = PHASE_COORD_WAIT;
    spawn_child(&d->coord);
    d->zctx = zmq_ctx_new();
    if (!d->zctx) {
        KVB_LOG_W("zmq_ctx_new: %s; starting the models without waiting for the coordinator", zmq_strerror(errno));
        start_models(d);
        return;
    }
    d->probe_deadline_s = kvb_now_s() + PROBE_DEADLINE_S;
    probe_send(d);
    uv_timer_start(&d->probe_timer, probe_tick, PROBE_TICK_MS, PROBE_TICK_MS);
}

static void start_models(kvbankd *d) {
    d->phase = PHASE_RUNNING;
    for (int pass = 0; pass < 2; pass++) /* the master first: workers lend to it */
        for (int i = 0; i < d->cfg->n_models; i++)
            if ((d->models[i].model->role == KVB_ROLE_MASTER) == (pass == 0)) spawn_child(&d->models[i]);
    /* The gateway finds the models through the coordinator and retries them, so it may start now. */
    if (d->has_gw) spawn_child(&d->gw);
}

/* ------------------------------------------------------------------------------------ kvbank-mkmodel */

static void mk_next(kvbankd *d);

static void mk_free(kvbankd *d) {
    free(d->mk_tmp);
    free(d->mk_words);
    free(d->mk_argv[0]);
    d->mk_tmp = d->mk_words = d->mk_argv[0] = NULL;
}

static void mk_closed_cb(uv_handle_t *h) {
    kvbankd *d = h->data;
    d->mk_open = 0;
    const kvb_node_model *m = &d->cfg->models[d->mk_index];
    if (d->phase >= PHASE_DRAIN_MODELS) {
        remove_tree(d->mk_tmp);
        mk_free(d);
        drain_step(d);
        return;
    }
    if (d->exit_code != 0 || rename(d->mk_tmp, m->model_dir) != 0) {
        if (d->exit_code == 0) KVB_LOG_E("%s: rename %s -> %s: %s", m->name, d->mk_tmp, m->model_dir, strerror(errno));
        remove_tree(d->mk_tmp);
        mk_free(d);
        begin_drain(d, 1);
        return;
    }
    KVB_LOG_I("%s: created %s with kvbank-mkmodel %s", m->name, m->model_dir, m->mkmodel);
    mk_free(d);
    d->mk_index++;
    mk_next(d);
}

static void mk_exit_cb(uv_process_t *p, int64_t status, int term_signal) {
    kvbankd *d = p->data;
    d->mk_running = 0;
    if ((status != 0 || term_signal != 0) && d->phase < PHASE_DRAIN_MODELS) {
        char why[96];
        describe_exit(status, term_signal, why, sizeof why);
        KVB_LOG_E("%s: kvbank-mkmodel %s %s failed (%s)", d->cfg->models[d->mk_index].name,
                  d->cfg->models[d->mk_index].mkmodel, d->mk_tmp, why);
        d->exit_code = 1;
    }
    uv_close((uv_handle_t *)p, mk_closed_cb);
}

/* Runs `kvbank-mkmodel ARGS <model_dir>.partial-<pid>` for model `i` (renamed to model_dir once it
 * succeeded, so that a failed or interrupted run never leaves a half-written model_dir behind). */
static kvb_status mk_start(kvbankd *d, int i) {
    const kvb_node_model *m = &d->cfg->models[i];
    char parent[PATH_MAX];
    snprintf(parent, sizeof parent, "%s", m->model_dir);
    char *slash = strrchr(parent, '/');
    if (slash && slash != parent) {
        *slash = '\0';
        if (mkdir_p(parent, 0755) != 0) {
            KVB_LOG_E("%s: cannot create %s: %s", m->name, parent, strerror(errno));
            return KVB_ERR_IO;
        }
    }
    size_t n = strlen(m->model_dir) + 32;
    KVB_TRY(kvb_malloc(n, (void **)&d->mk_tmp));
    snprintf(d->mk_tmp, n, "%s.partial-%ld", m->model_dir, (long)getpid());
    remove_tree(d->mk_tmp);
    KVB_TRY(kvb_strdup(m->mkmodel, &d->mk_words));
    size_t pn = strlen(d->bin_dir) + sizeof "/kvbank-mkmodel";
    KVB_TRY(kvb_malloc(pn, (void **)&d->mk_argv[0]));
    snprintf(d->mk_argv[0], pn, "%s/kvbank-mkmodel", d->bin_dir);
    int argc = 1;
    char *save = NULL;
    for (char *w = strtok_r(d->mk_words, " \t\n", &save); w; w = strtok_r(NULL, " \t\n", &save)) {
        if (argc >= (int)KVB_ARRAY_LEN(d->mk_argv) - 2) {
            KVB_LOG_E("%s: \"mkmodel\" has more than %d arguments", m->name, (int)KVB_ARRAY_LEN(d->mk_argv) - 3);
            return KVB_ERR_INVALID;
        }
        d->mk_argv[argc++] = w;
    }
    d->mk_argv[argc++] = d->mk_tmp;
    d->mk_argv[argc] = NULL;
    uv_stdio_container_t stdio[3] = {
        {.flags = UV_IGNORE},
        {.flags = UV_INHERIT_FD, .data.fd = 1},
        {.flags = UV_INHERIT_FD, .data.fd = 2},
    };
    uv_process_options_t o = {
        .exit_cb = mk_exit_cb, .file = d->mk_argv[0], .args = d->mk_argv, .stdio_count = 3, .stdio = stdio};
    d->mk_index = i;
    d->mk_proc.data = d;
    d->mk_open = 1;
    KVB_LOG_I("%s: %s does not exist; running kvbank-mkmodel %s", m->name, m->model_dir, m->mkmodel);
    int rc = uv_spawn(&d->loop, &d->mk_proc, &o);
    if (rc != 0) {
        KVB_LOG_E("%s: cannot start %s: %s", m->name, d->mk_argv[0], uv_strerror(rc));
        d->exit_code = 1;
        uv_close((uv_handle_t *)&d->mk_proc, mk_closed_cb);
        return KVB_OK; /* mk_closed_cb ends the start-up */
    }
    d->mk_running = 1;
    return KVB_OK;
}

/* Generates the next missing model directory, or starts the coordinator when none is missing. */
static void mk_next(kvbankd *d) {
    for (int i = d->mk_index; i < d->cfg->n_models; i++) {
        const kvb_node_model *m = &d->cfg->models[i];
        if (access(m->model_dir, F_OK) == 0) continue;
        kvb_status st = mk_start(d, i);
        if (st != KVB_OK) {
            mk_free(d);
            begin_drain(d, 1);
        }
        return;
    }
    d->mk_index = d->cfg->n_models;
    start_coordinator(d);
}

/* ------------------------------------------------------------------------------------------ drain */

static void close_handle(uv_handle_t *h) {
    if (!uv_is_closing(h)) uv_close(h, NULL);
}

/* Everything has stopped: clean the node up and let the loop end. */
static void finish(kvbankd *d) {
    d->phase = PHASE_DONE;
    uv_timer_stop(&d->drain_timer);
    int n = unlink_node_shm(d);
    if (n) KVB_LOG_I("removed %d stale shared-memory segment(s) of node %s", n, d->cfg->node);
    remove_coordinator_sockets(d);
    for (int i = 0; i < d->cfg->n_models; i++) remove_socket(d->cfg->models[i].endpoint);
    remove_pid_file(d);
    close_handle((uv_handle_t *)&d->sig_term);
    close_handle((uv_handle_t *)&d->sig_int);
    close_handle((uv_handle_t *)&d->sig_hup);
    close_handle((uv_handle_t *)&d->probe_timer);
    close_handle((uv_handle_t *)&d->drain_timer);
    close_handle((uv_handle_t *)&d->coord.restart_timer);
    close_handle((uv_handle_t *)&d->gw.restart_timer);
    for (int i = 0; i < d->cfg->n_models; i++) close_handle((uv_handle_t *)&d->models[i].restart_timer);
    KVB_LOG_I("node %s stopped (exit status %d)", d->cfg->node, d->exit_code);
}

static void stop_coordinator(kvbankd *d, int sig) {
    if (!d->coord.running) return;
    KVB_LOG_I("stopping the coordinator (pid %d, %s)", d->coord.pid, sig == SIGKILL ? "SIGKILL" : "SIGTERM");
    kill_child(&d->coord, sig);
}

static void drain_step(kvbankd *d) {
    if (d->phase == PHASE_DRAIN_MODELS) {
        if (d->mk_open || d->gw.proc_open) return;
        for (int i = 0; i < d->cfg->n_models; i++)
            if (d->models[i].proc_open) return;
        d->phase = PHASE_DRAIN_COORD;
        uv_timer_stop(&d->drain_timer);
        if (d->coord.running) {
            stop_coordinator(d, d->signals > 1 ? SIGKILL : SIGTERM);
            uv_timer_start(&d->drain_timer, drain_timeout_cb, STOP_GRACE_MS, 0);
        }
    }
    if (d->phase == PHASE_DRAIN_COORD && !d->coord.proc_open) finish(d);
}

/* SIGKILL whatever the current drain phase is still waiting for. */
static void drain_kill(kvbankd *d) {
    if (d->phase == PHASE_DRAIN_MODELS) {
        if (d->mk_running) uv_process_kill(&d->mk_proc, SIGKILL);
        if (d->gw.running) KVB_LOG_W("the gateway (pid %d) did not stop: SIGKILL", d->gw.pid);
        kill_child(&d->gw, SIGKILL);
        for (int i = 0; i < d->cfg->n_models; i++) {
            child *c = &d->models[i];
            if (!c->running) continue;
            KVB_LOG_W("%s (pid %d) did not stop: SIGKILL", c->name, c->pid);
            kill_child(c, SIGKILL);
        }
    } else if (d->phase == PHASE_DRAIN_COORD) {
        if (d->coord.running) KVB_LOG_W("the coordinator (pid %d) did not stop: SIGKILL", d->coord.pid);
        kill_child(&d->coord, SIGKILL);
    }
}

static void drain_timeout_cb(uv_timer_t *t) { drain_kill(t->data); }

/* Stops restarting, SIGTERMs the models (the coordinator follows once they are gone). */
static void begin_drain(kvbankd *d, int code) {
    if (d->phase >= PHASE_DRAIN_MODELS) return;
    if (code > d->exit_code) d->exit_code = code;
    probe_stop(d);
    uv_timer_stop(&d->coord.restart_timer);
    uv_timer_stop(&d->gw.restart_timer);
    for (int i = 0; i < d->cfg->n_models; i++) uv_timer_stop(&d->models[i].restart_timer);
    d->phase = PHASE_DRAIN_MODELS;
    if (d->mk_running) uv_process_kill(&d->mk_proc, SIGTERM);
    if (d->gw.running) KVB_LOG_I("stopping the gateway (pid %d, SIGTERM)", d->gw.pid);
    kill_child(&d->gw, SIGTERM);
    for (int i = 0; i < d->cfg->n_models; i++) {
        child *c = &d->models[i];
        if (!c->running) continue;
        KVB_LOG_I("stopping %s (pid %d, SIGTERM)", c->name, c->pid);
        kill_child(c, SIGTERM);
    }
    uv_timer_start(&d->drain_timer, drain_timeout_cb, STOP_GRACE_MS, 0);
    drain_step(d);
}

static void on_stop_signal(uv_signal_t *s, int signum) {
    kvbankd *d = s->data;
    d->signals++;
    if (d->phase < PHASE_DRAIN_MODELS) {
        KVB_LOG_I("%s: draining node %s", strsignal(signum), d->cfg->node);
        begin_drain(d, 0);
    } else if (d->phase < PHASE_DONE) {
        KVB_LOG_W("%s again: killing what is still running", strsignal(signum));
        drain_kill(d);
    }
}

static void on_hup(uv_signal_t *s, int signum) {
    (void)s, (void)signum;
    KVB_LOG_W("SIGHUP: reloading the node config is not supported; restart kvbankd to apply a changed config");
}

/* ------------------------------------------------------------------------------------------- main */

#define USAGE_LINE "usage: kvbankd --config FILE [--bin-dir DIR] [--foreground] (kvbankd --help for more)\n"

static void usage(FILE *f) {
    fprintf(f,
            "usage: kvbankd --config FILE [--bin-dir DIR] [--foreground]\n"
            "\n"
            "The node supervisor. Reads the node config (JSON, see common/util/node_config.h), then:\n"
            "  1. locks /dev/shm/kvbankd-<uid>-<node>.lock: a second kvbankd of the same node name on\n"
            "     this machine refuses to start (whatever its run_dir), naming the first's pid and\n"
            "     run_dir; creates run_dir (mode 0700) with the locked pid file run_dir/kvbankd.pid;\n"
            "  2. removes the shared-memory segments /dev/shm/kvb-<node>_<model>-<pid>-* whose process\n"
            "     <pid> is dead (left by crashed runs) and stale socket files of the node's endpoints;\n"
            "  3. for a model whose model_dir is missing and that has \"mkmodel\" arguments, runs\n"
            "     kvbank-mkmodel ARGS into a temporary directory renamed to model_dir when it succeeded\n"
            "     (a model_dir missing without \"mkmodel\" is an error);\n"
            "  4. starts kvbank-coordinator --config FILE and waits until it answers a StatusRequest\n"
            "     (at most %.0f s), then kvbank-master --config FILE --name NAME for the master and\n"
            "     kvbank-worker --config FILE --name NAME for every worker.\n"
            "Children inherit stdout and stderr (their log lines carry their name). A child that exits\n"
            "without being asked to is restarted after %.1f s, doubling per attempt up to %.0f s; the delay\n"
            "starts over once a run lasted %.0f s. A dead model's shared-memory segments are removed\n"
            "before it restarts.\n"
            "SIGTERM or SIGINT drains the node: SIGTERM to the models, SIGKILL to those still running\n"
            "after %d s, then the same for the coordinator; then the node's shared-memory segments left\n"
            "by dead processes, its socket files, the pid file and the lock are removed and kvbankd exits\n"
            "0. A second signal kills at once.\n"
            "SIGHUP is logged and ignored: reloading the config is not supported.\n"
            "\n"
            "options:\n"
            "  --config FILE   the node config\n"
            "  --bin-dir DIR   where kvbank-coordinator, -master, -worker and -mkmodel are (default: the\n"
            "                  config's \"bin_dir\", else the directory of this executable)\n"
            "  --foreground    stay in the foreground and log to stderr; without it kvbankd detaches\n"
            "                  (new session, working directory /) once the pid file is locked and\n"
            "                  appends its and its children's output to run_dir/kvbankd.log\n"
            "  -h, --help      this text\n"
            "\n"
            "Log level: KVB_LOG_LEVEL=error|warn|info|debug (children inherit it). Exit status 0 after a\n"
            "drain, 1 on an error (bad config, missing program, failed kvbank-mkmodel), 2 on a usage error.\n",
            PROBE_DEADLINE_S, BACKOFF_FIRST_S, BACKOFF_MAX_S, BACKOFF_RESET_S, STOP_GRACE_MS / 1000);
}

/* Directory of this executable (caller frees). */
static kvb_status self_dir(char **out) {
    char buf[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
    if (n <= 0) {
        KVB_LOG_E("readlink /proc/self/exe: %s; pass --bin-dir", strerror(errno));
        return KVB_ERR_IO;
    }
    buf[n] = '\0';
    char *slash = strrchr(buf, '/');
    if (slash == buf) slash[1] = '\0';
    else if (slash) *slash = '\0';
    return kvb_strdup(buf, out);
}

static kvb_status program_path(const kvbankd *d, const char *prog, char **out) {
    size_t n = strlen(d->bin_dir) + strlen(prog) + 2;
    KVB_TRY(kvb_malloc(n, (void **)out));
    snprintf(*out, n, "%s/%s", d->bin_dir, prog);
    if (access(*out, X_OK) != 0) {
        KVB_LOG_E("%s: %s (see --bin-dir)", *out, strerror(errno));
        return KVB_ERR_NOT_FOUND;
    }
    return KVB_OK;
}

/* Argument vectors, tags and handles of every child; checks the programs and the model directories. */
static kvb_status setup_children(kvbankd *d) {
    kvb_node_config *cfg = d->cfg;
    KVB_TRY(kvb_calloc((size_t)cfg->n_models, sizeof *d->models, (void **)&d->models));
    child *co = &d->coord;
    co->d = d;
    co->name = "coordinator";
    KVB_TRY(program_path(d, "kvbank-coordinator", &co->argv[0]));
    co->argv[1] = "--config";
    co->argv[2] = cfg->path;
    if (cfg->gateway.enabled) {
        child *g = &d->gw;
        g->d = d;
        g->name = "gateway";
        KVB_TRY(program_path(d, "kvbank-gateway", &g->argv[0]));
        g->argv[1] = "--config";
        g->argv[2] = cfg->path;
        d->has_gw = 1;
    }
    int need_mkmodel = 0;
    for (int i = 0; i < cfg->n_models; i++) {
        child *c = &d->models[i];
        const kvb_node_model *m = &cfg->models[i];
        c->d = d;
        c->model = m;
        c->name = m->name;
        kvb_node_region_tag(cfg, m->name, c->tag, sizeof c->tag);
        KVB_TRY(program_path(d, m->role == KVB_ROLE_MASTER ? "kvbank-master" : "kvbank-worker", &c->argv[0]));
        c->argv[1] = "--config";
        c->argv[2] = cfg->path;
        c->argv[3] = "--name";
        c->argv[4] = m->name;
        if (access(m->model_dir, F_OK) != 0) {
            if (!m->mkmodel) {
                KVB_LOG_E("%s: model \"%s\": model_dir %s does not exist and the model has no \"mkmodel\" arguments",
                          cfg->path, m->name, m->model_dir);
                return KVB_ERR_NOT_FOUND;
            }
            need_mkmodel = 1;
        }
    }
    if (need_mkmodel) {
        char *mk = NULL;
        kvb_status st = program_path(d, "kvbank-mkmodel", &mk);
        free(mk);
        KVB_TRY(st);
    }
    return KVB_OK;
}

/* This start's node secret, and the environment of the children: ours with KVB_AUTH_FD=3 (the
 * strings are borrowed from environ, which kvbankd does not change). */
static kvb_status setup_auth(kvbankd *d) {
    extern char **environ;
    KVB_TRY(kvb_auth_new_secret(&d->auth));
    size_t n = 0;
    while (environ[n]) n++;
    KVB_TRY(kvb_calloc(n + 2, sizeof *d->env, (void **)&d->env));
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (strncmp(environ[i], KVB_AUTH_FD_ENV "=", sizeof KVB_AUTH_FD_ENV)) d->env[k++] = environ[i];
    d->env[k] = (char *)KVB_AUTH_FD_ENV "=3";
    return KVB_OK;
}

static kvb_status setup_loop(kvbankd *d) {
    int rc = uv_loop_init(&d->loop);
    if (rc != 0) {
        KVB_LOG_E("uv_loop_init: %s", uv_strerror(rc));
        return KVB_ERR_IO;
    }
    d->loop.data = d;
    uv_timer_init(&d->loop, &d->probe_timer);
    d->probe_timer.data = d;
    uv_timer_init(&d->loop, &d->drain_timer);
    d->drain_timer.data = d;
    uv_timer_init(&d->loop, &d->coord.restart_timer);
    d->coord.restart_timer.data = &d->coord;
    uv_timer_init(&d->loop, &d->gw.restart_timer);
    d->gw.restart_timer.data = &d->gw;
    for (int i = 0; i < d->cfg->n_models; i++) {
        uv_timer_init(&d->loop, &d->models[i].restart_timer);
        d->models[i].restart_timer.data = &d->models[i];
    }
    uv_signal_t *sigs[] = {&d->sig_term, &d->sig_int, &d->sig_hup};
    const int nums[] = {SIGTERM, SIGINT, SIGHUP};
    for (int k = 0; k < 3; k++) {
        uv_signal_init(&d->loop, sigs[k]);
        sigs[k]->data = d;
        rc = uv_signal_start(sigs[k], nums[k] == SIGHUP ? on_hup : on_stop_signal, nums[k]);
        if (rc != 0) {
            KVB_LOG_E("uv_signal_start(%s): %s", strsignal(nums[k]), uv_strerror(rc));
            return KVB_ERR_IO;
        }
    }
    return KVB_OK;
}

/* Detaches from the terminal: the parent exits 0, the child leads a new session with stdin from
 * /dev/null and stdout/stderr appended to `log_path`. */
static kvb_status daemonize(const char *log_path) {
    int lf = open(log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (lf < 0) {
        KVB_LOG_E("%s: cannot open: %s", log_path, strerror(errno));
        return KVB_ERR_IO;
    }
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) {
        KVB_LOG_E("fork: %s", strerror(errno));
        close(lf);
        return KVB_ERR_IO;
    }
    if (pid > 0) {
        printf("kvbankd: running as pid %ld, log in %s\n", (long)pid, log_path);
        fflush(stdout);
        _exit(0);
    }
    setsid();
    int nul = open("/dev/null", O_RDONLY);
    if (nul >= 0) {
        dup2(nul, 0);
        if (nul != 0) close(nul);
    }
    dup2(lf, 1);
    dup2(lf, 2);
    close(lf);
    if (chdir("/") != 0) KVB_LOG_W("chdir /: %s", strerror(errno));
    return KVB_OK;
}

static void kvbankd_free(kvbankd *d) {
    if (!d) return;
    remove_pid_file(d);
    free(d->pid_path);
    free(d->node_lock_path);
    free(d->env);
    explicit_bzero(&d->auth, sizeof d->auth);
    free(d->coord.argv[0]);
    free(d->gw.argv[0]);
    if (d->models)
        for (int i = 0; i < d->cfg->n_models; i++) free(d->models[i].argv[0]);
    free(d->models);
    mk_free(d);
    free(d->bin_dir);
    kvb_node_config_free(d->cfg);
    free(d);
}

int main(int argc, char **argv) {
    kvb_log_set_tag("kvbankd");
    enum { O_CONFIG = 256, O_BIN_DIR, O_FOREGROUND };
    static const struct option opts[] = {
        {"config", required_argument, NULL, O_CONFIG},
        {"bin-dir", required_argument, NULL, O_BIN_DIR},
        {"foreground", no_argument, NULL, O_FOREGROUND},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *config = NULL, *bin_dir = NULL;
    int foreground = 0;
    opterr = 0;
    for (;;) {
        int o = getopt_long(argc, argv, "h", opts, NULL);
        if (o == -1) break;
        switch (o) {
        case O_CONFIG: config = optarg; break;
        case O_BIN_DIR: bin_dir = optarg; break;
        case O_FOREGROUND: foreground = 1; break;
        case 'h': usage(stdout); return 0;
        default:
            if (optopt) fprintf(stderr, "kvbankd: option %s needs a value\n", argv[optind - 1]);
            else fprintf(stderr, "kvbankd: unknown option %s\n", argv[optind - 1]);
            fprintf(stderr, USAGE_LINE);
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "kvbankd: unexpected argument '%s'\n", argv[optind]);
        fprintf(stderr, USAGE_LINE);
        return 2;
    }
    if (!config) {
        fprintf(stderr, "kvbankd: --config FILE is required\n");
        fprintf(stderr, USAGE_LINE);
        return 2;
    }

    umask(077); /* the run_dir, pid file, log and whatever the children create are ours alone */
    signal(SIGPIPE, SIG_IGN);
    kvbankd *d = NULL;
    int code = 1;
    if (kvb_calloc(1, sizeof *d, (void **)&d) != KVB_OK) return 1;
    d->pid_fd = d->node_lock_fd = -1;
    if (kvb_node_config_load(config, &d->cfg) != KVB_OK) goto out;
    /* Every model's device must be there before anything is created: a node whose GPU is missing fails
     * here (exit 1) instead of restarting its models forever, and leaves nothing behind. */
    for (int i = 0; i < d->cfg->n_models; i++) {
        const kvb_node_model *m = &d->cfg->models[i];
        char why[256];
        if (!kvb_mem_probe(m->backend, m->device, why, sizeof why)) {
            KVB_LOG_E("model \"%s\": backend \"%s\" on device %d: %s", m->name, m->backend, m->device, why);
            goto out;
        }
    }
    const char *bd = bin_dir ? bin_dir : d->cfg->bin_dir;
    if (bd) {
        char abs[PATH_MAX];
        if (!realpath(bd, abs)) {
            KVB_LOG_E("bin dir %s: %s", bd, strerror(errno));
            goto out;
        }
        if (kvb_strdup(abs, &d->bin_dir) != KVB_OK) goto out;
    } else if (self_dir(&d->bin_dir) != KVB_OK) {
        goto out;
    }
    if (setup_children(d) != KVB_OK) goto out;
    if (lock_node(d) != KVB_OK) goto out;
    if (make_run_dir(d->cfg->run_dir) != KVB_OK) goto out;
    if (lock_pid_file(d) != KVB_OK) goto out;
    if (!foreground) {
        char log_path[PATH_MAX];
        snprintf(log_path, sizeof log_path, "%s/kvbankd.log", d->cfg->run_dir);
        if (daemonize(log_path) != KVB_OK) goto out;
    }
    if (write_pid_file(d) != KVB_OK) goto out;
    KVB_LOG_I("node %s: %d model(s), run_dir %s, programs from %s", d->cfg->node, d->cfg->n_models, d->cfg->run_dir,
              d->bin_dir);
    /* The locks say no other kvbankd runs this node: its endpoints' socket files are stale, and so are
     * the segments of its tags whose process is dead (only those are removed). */
    remove_coordinator_sockets(d);
    for (int i = 0; i < d->cfg->n_models; i++) remove_socket(d->cfg->models[i].endpoint);
    int n = unlink_node_shm(d);
    if (n) KVB_LOG_I("removed %d stale shared-memory segment(s) of node %s", n, d->cfg->node);

    if (setup_auth(d) != KVB_OK) goto out;
    if (setup_loop(d) != KVB_OK) goto out;
    mk_next(d);
    uv_run(&d->loop, UV_RUN_DEFAULT);
    int rc = uv_loop_close(&d->loop);
    if (rc != 0) KVB_LOG_W("uv_loop_close: %s", uv_strerror(rc));
    code = d->exit_code;
out:
    kvbankd_free(d);
    return code;
}
