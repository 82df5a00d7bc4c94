/* kvbankctl — the operator's tool: node status and ledger, manual lend / reclaim / drain, one request
 * to a model by name, and the offline SwiftCache plan of a node config. */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>
#include <inttypes.h>
#include <limits.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/ipc/auth.h"
#include "common/ipc/client.h"
#include "common/ipc/wire.h"
#include "common/kv/block_pool.h"
#include "common/model/config.h"
#include "common/policy/swiftcache.h"
#include "common/util/node_config.h"
#include "coordinator/coordinator.h"
#include "coordinator/ctl.h"
#include "common/util/prog.h"

#define PROG "kvbankctl"
#define KVB_DEFAULT_CONFIG "/etc/kvbank/node.json" /* where deploy/ puts a node's config */
#define DEFAULT_TIMEOUT_MS 5000

static const char *role_name(Kvbank__Role r) {
    return r == KVBANK__ROLE__ROLE_MASTER ? "master" : r == KVBANK__ROLE__ROLE_WORKER ? "worker" : "none";
}

/* ------------------------------------------------------------------------------------ coordinator */


/* Connects to the coordinator's control endpoint (EP.ctl, common/ipc/auth.h). */
static int ctl_connect(ctl *c) {
    char why[PATH_MAX + 256], ep[PATH_MAX + 16];
    if (kvb_auth_ctl_endpoint(c->endpoint, ep, sizeof ep) != KVB_OK) return -1;
    if (kvb_wire_ipc_check(ep, why, sizeof why) != KVB_OK) {
        fprintf(stderr, PROG ": cannot reach the coordinator: %s\n", why);
        return -1;
    }
    c->zctx = zmq_ctx_new();
    if (!c->zctx) return -1;
    c->sock = zmq_socket(c->zctx, ZMQ_DEALER);
    if (!c->sock) return -1;
    int zero = 0;
    zmq_setsockopt(c->sock, ZMQ_LINGER, &zero, sizeof zero);
    if (kvb_auth_set_ctl(c->sock) != KVB_OK) return -1; /* the coordinator's control login */
    if (zmq_connect(c->sock, ep) != 0) {
        fprintf(stderr, PROG ": cannot connect to %s: %s\n", ep, zmq_strerror(errno));
        return -1;
    }
    return 0;
}

void kvb__ctl_close(ctl *c) {
    if (c->sock) zmq_close(c->sock);
    if (c->zctx) zmq_ctx_term(c->zctx);
    c->sock = c->zctx = NULL;
}

/* Sends `env` and waits for a reply with body `want`. Returns NULL (with a message) on a timeout or a
 * bad reply; the caller frees the result with kvbank__envelope__free_unpacked. */
static Kvbank__Envelope *ctl_call(ctl *c, Kvbank__Envelope *env, Kvbank__Envelope__BodyCase want) {
    if (!c->sock && ctl_connect(c) != 0) return NULL;
    if (kvb_wire_send(c->sock, NULL, 0, env, 1) != KVB_OK) {
        fprintf(stderr, PROG ": cannot send to the coordinator at %s: %s\n", c->endpoint, zmq_strerror(errno));
        return NULL;
    }
    uint64_t deadline = kvb_now_ns() + (uint64_t)c->timeout_ms * 1000000u;
    for (;;) {
        uint64_t now = kvb_now_ns();
        if (now >= deadline) break;
        zmq_pollitem_t it = {.socket = c->sock, .events = ZMQ_POLLIN};
        int rc = zmq_poll(&it, 1, (long)((deadline - now) / 1000000u) + 1);
        if (rc < 0 && errno == EINTR) continue;
        if (rc <= 0) break;
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, c->sock, 0) < 0) {
            zmq_msg_close(&m);
            continue;
        }
        int more = zmq_msg_more(&m);
        Kvbank__Envelope *r = NULL;
        kvb_drop_reason why;
        kvb_status st = more ? KVB_ERR_PROTOCOL : kvb_coord_decode(zmq_msg_data(&m), zmq_msg_size(&m), &r, &why);
        zmq_msg_close(&m);
        while (more) { /* drain the rest of a multi-frame message */
            zmq_msg_t x;
            zmq_msg_init(&x);
            more = zmq_msg_recv(&x, c->sock, 0) >= 0 && zmq_msg_more(&x);
            zmq_msg_close(&x);
        }
        if (st != KVB_OK) {
            fprintf(stderr, PROG ": ignoring a bad reply from the coordinator\n");
            continue;
        }
        if (r->body_case == want) return r;
        kvbank__envelope__free_unpacked(r, NULL); /* a late answer to something else */
    }
    fprintf(stderr, PROG ": no answer from the coordinator at %s within %d ms (is kvbank-coordinator running?)\n",
            c->endpoint, c->timeout_ms);
    return NULL;
}

Kvbank__Envelope *kvb__ctl_get_status(ctl *c, int ledger) {
    Kvbank__StatusRequest sr = KVBANK__STATUS_REQUEST__INIT;
    sr.ledger = ledger != 0;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_STATUS_REQUEST;
    env.status_request = &sr;
    return ctl_call(c, &env, KVBANK__ENVELOPE__BODY_STATUS_REPLY);
}

static int print_json(json_t *j) {
    if (!j) {
        fprintf(stderr, PROG ": out of memory\n");
        return 1;
    }
    char *s = json_dumps(j, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(j);
    if (!s) {
        fprintf(stderr, PROG ": out of memory\n");
        return 1;
    }
    printf("%s\n", s);
    free(s);
    return 0;
}

static json_t *loan_json(const Kvbank__Loan *l) {
    return json_pack("{s:I, s:s, s:I, s:I, s:I, s:I, s:I, s:I, s:b}", "loan_id", (json_int_t)l->loan_id, "lender",
                     l->lender ? l->lender : "", "first_block", (json_int_t)l->first_block, "n_blocks",
                     (json_int_t)l->n_blocks, "n_master_blocks", (json_int_t)l->n_master_blocks, "offset",
                     (json_int_t)l->offset, "bytes", (json_int_t)l->bytes, "epoch", (json_int_t)l->epoch, "revoking",
                     (int)l->revoking);
}

const Kvbank__ChildState *kvb__ctl_child_of(const Kvbank__StatusReply *s, const char *name);
const char *kvb__ctl_model_state(const Kvbank__ModelStatus *m, const Kvbank__ChildState *k);
static void model_why(const Kvbank__ModelStatus *m, const Kvbank__ChildState *k, const char *state, char *buf,
                      size_t len);

/* "status", "restarts" and "age_ms" (kvbankd's, when it reports) and "why" (when not serving) of one model. */
static int supervision_json(const Kvbank__StatusReply *s, const Kvbank__ModelStatus *m, const Kvbank__ChildState *k,
                            json_t *o) {
    const char *state = kvb__ctl_model_state(m, k);
    char why[256];
    model_why(m, k, state, why, sizeof why);
    if (json_object_set_new(o, "status", json_string(state))) return -1;
    if (k && (json_object_set_new(o, "restarts", json_integer(k->restarts)) ||
              json_object_set_new(o, "age_ms", json_integer((json_int_t)(k->age_ms + s->children_report_ms))) ||
              json_object_set_new(o, "last_exit", json_string(k->last_exit ? k->last_exit : ""))))
        return -1;
    if (why[0] && json_object_set_new(o, "why", json_string(why))) return -1;
    return 0;
}

static json_t *status_json(const Kvbank__StatusReply *s, int with_loans) {
    json_t *models = json_array();
    for (size_t i = 0; models && i < s->n_models; i++) {
        const Kvbank__ModelStatus *m = s->models[i];
        json_t *g = m->geom ? json_pack("{s:I, s:I, s:I, s:I, s:I}", "n_layers", (json_int_t)m->geom->n_layers,
                                        "n_kv_heads", (json_int_t)m->geom->n_kv_heads, "head_dim",
                                        (json_int_t)m->geom->head_dim, "block_size", (json_int_t)m->geom->block_size,
                                        "elem_size", (json_int_t)m->geom->elem_size)
                            : json_null();
        json_t *o = json_pack("{s:s, s:s, s:I, s:b, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:s, s:o, s:I, s:I, s:b, "
                              "s:I, s:s}",
                              "name", m->name ? m->name : "", "role", role_name(m->role), "pid", (json_int_t)m->pid,
                              "alive", (int)m->alive, "capacity", (json_int_t)m->capacity, "n_own",
                              (json_int_t)m->n_own, "n_lent", (json_int_t)m->n_lent, "n_borrowed",
                              (json_int_t)m->n_borrowed, "live_requests", (json_int_t)m->live_requests,
                              "waiting_requests", (json_int_t)m->waiting_requests, "last_heartbeat_ms",
                              (json_int_t)m->last_heartbeat_ms, "endpoint", m->endpoint ? m->endpoint : "", "geom", g,
                              "meu", (json_int_t)m->meu, "meu_master", (json_int_t)m->meu_master, "draining",
                              (int)m->draining, "tokens_generated", (json_int_t)m->tokens_generated, "model",
                              m->model ? m->model : "");
        if (o && (json_object_set_new(o, "memory", json_string(m->memory && m->memory[0] ? m->memory : "host")) ||
                  json_object_set_new(o, "device", json_integer((json_int_t)m->device)) ||
                  json_object_set_new(o, "registered", json_true()) ||
                  json_object_set_new(o, "lends", json_integer((json_int_t)m->lends)) ||
                  json_object_set_new(o, "reclaims", json_integer((json_int_t)m->reclaims)) ||
                  (m->borrow_limited &&
                   json_object_set_new(o, "max_borrow", json_integer((json_int_t)m->max_borrow))) ||
                  supervision_json(s, m, kvb__ctl_child_of(s, m->name ? m->name : ""), o) ||
                  (m->lend_blocked && m->lend_blocked[0] &&
                   json_object_set_new(o, "lend_blocked", json_string(m->lend_blocked))))) {
            json_decref(o);
            o = NULL;
        }
        if (!o || json_array_append_new(models, o)) {
            json_decref(models);
            return NULL;
        }
    }
    /* kvbankd's models that never registered */
    for (size_t i = 0; models && i < s->n_children; i++) {
        const Kvbank__ChildState *k = s->children[i];
        const char *role = k->role ? k->role : "";
        if ((strcmp(role, "master") && strcmp(role, "worker")) || !k->name) continue;
        int seen = 0;
        for (size_t j = 0; j < s->n_models; j++) seen |= s->models[j]->name && !strcmp(s->models[j]->name, k->name);
        if (seen) continue;
        json_t *o = json_pack("{s:s, s:s, s:I, s:b, s:b}", "name", k->name, "role", role, "pid", (json_int_t)k->pid,
                              "alive", 0, "registered", 0);
        if (!o || supervision_json(s, NULL, k, o)) {
            json_decref(o);
            json_decref(models);
            return NULL;
        }
        if (json_array_append_new(models, o)) { /* takes o even when it fails */
            json_decref(models);
            return NULL;
        }
    }
    json_t *j = json_pack("{s:s, s:I, s:I, s:I, s:I, s:o}", "coordinator_id",
                          s->coordinator_id ? s->coordinator_id : "", "epoch", (json_int_t)s->epoch, "uptime_ms",
                          (json_int_t)s->uptime_ms, "dropped_messages", (json_int_t)s->dropped_messages,
                          "auth_refused", (json_int_t)s->auth_refused, "models", models);
    if (j && with_loans) {
        json_t *loans = json_array();
        for (size_t i = 0; loans && i < s->n_loans; i++) json_array_append_new(loans, loan_json(s->loans[i]));
        if (!loans || json_object_set_new(j, "loans", loans)) {
            json_decref(j);
            return NULL;
        }
    }
    return j;
}

/* ----------------------------------------------------------------------------------------- status */

/* kvbankd's state of `name` in the report, or NULL (no kvbankd, or not one of its children). */
const Kvbank__ChildState *kvb__ctl_child_of(const Kvbank__StatusReply *s, const char *name) {
    for (size_t i = 0; i < s->n_children; i++)
        if (s->children[i]->name && !strcmp(s->children[i]->name, name)) return s->children[i];
    return NULL;
}

static const Kvbank__ModelStatus *model_of(const Kvbank__StatusReply *s, const char *name) {
    for (size_t i = 0; i < s->n_models; i++)
        if (s->models[i]->name && !strcmp(s->models[i]->name, name)) return s->models[i];
    return NULL;
}

#define CRASH_LOOP_ATTEMPTS 3 /* restarts in a row (no run long enough to reset kvbankd's backoff) */

/* The STATUS column (kubectl's idea): running, starting (its process runs, it has not registered),
 * restarting, crash-looping (restarting for the CRASH_LOOP_ATTEMPTS-th time in a row), draining,
 * pending / generating (kvbankd has not started it yet), stopping, dead (without kvbankd). */
const char *kvb__ctl_model_state(const Kvbank__ModelStatus *m, const Kvbank__ChildState *k) {
    const char *ks = k && k->state ? k->state : "";
    if (!strcmp(ks, "restarting"))
        return k->attempts >= CRASH_LOOP_ATTEMPTS ? "crash-looping" : "restarting";
    if (!strcmp(ks, "pending") || !strcmp(ks, "generating") || !strcmp(ks, "stopping") || !strcmp(ks, "stopped"))
        return ks;
    /* kvbankd says it runs (or there is no kvbankd): the coordinator's view decides */
    if (m && m->alive && (!k || !k->pid || k->pid == m->pid)) return m->draining ? "draining" : "running";
    if (k && !strcmp(ks, "running")) return "starting";
    return "dead";
}

/* Why a configured model is not serving, for the line under it ("" when it is). */
static void model_why(const Kvbank__ModelStatus *m, const Kvbank__ChildState *k, const char *state, char *buf,
                      size_t len) {
    buf[0] = '\0';
    const char *ex = k && k->last_exit && k->last_exit[0] ? k->last_exit : NULL;
    if (!strcmp(state, "crash-looping") || !strcmp(state, "restarting"))
        snprintf(buf, len, "%s: its last run ended with %s; restart %u in a row (see kvbankd's log)",
                 m ? "dead" : "not registered", ex ? ex : "?", k->attempts);
    else if (!strcmp(state, "starting"))
        snprintf(buf, len, "process %u runs but has not registered with the coordinator yet (loading its weights?)%s%s",
                 k->pid, ex ? "; last exit: " : "", ex ? ex : "");
    else if (!strcmp(state, "pending"))
        snprintf(buf, len, "not started yet (kvbankd starts the models once the coordinator answers)");
    else if (!strcmp(state, "generating"))
        snprintf(buf, len, "kvbankd is writing its model_dir with kvbank-mkmodel");
    else if (!strcmp(state, "dead") && m)
        snprintf(buf, len, "the coordinator heard no heartbeat for %" PRIu64 " ms", m->last_heartbeat_ms);
}

/* "45s", "3m12s", "2h05m", "3d04h" */
static void format_age(uint64_t ms, char *buf, size_t len) {
    uint64_t s = ms / 1000;
    if (s < 60) snprintf(buf, len, "%" PRIu64 "s", s);
    else if (s < 3600) snprintf(buf, len, "%" PRIu64 "m%02" PRIu64 "s", s / 60, s % 60);
    else if (s < 86400) snprintf(buf, len, "%" PRIu64 "h%02" PRIu64 "m", s / 3600, s % 3600 / 60);
    else snprintf(buf, len, "%" PRIu64 "d%02" PRIu64 "h", s / 86400, s % 86400 / 3600);
}

/* The names to show: the registered models in the coordinator's order, then kvbankd's models that
 * did not register (configured, never seen by the coordinator). Returns the count; *names borrowed. */
static size_t status_names(const Kvbank__StatusReply *s, const char ***names) {
    *names = NULL;
    size_t n = 0, cap = s->n_models + s->n_children;
    if (!cap || kvb_calloc(cap, sizeof **names, (void **)names) != KVB_OK) return 0;
    for (size_t i = 0; i < s->n_models; i++) (*names)[n++] = s->models[i]->name ? s->models[i]->name : "";
    for (size_t i = 0; i < s->n_children; i++) {
        const Kvbank__ChildState *k = s->children[i];
        const char *role = k->role ? k->role : "";
        if (strcmp(role, "master") && strcmp(role, "worker")) continue;
        if (k->name && !model_of(s, k->name)) (*names)[n++] = k->name;
    }
    return n;
}

static void print_status_table(const Kvbank__StatusReply *s) {
    printf("coordinator %s  epoch %" PRIu64 "  up %.1f s  dropped messages %" PRIu64 "  refused %" PRIu64 "%s\n",
           s->coordinator_id ? s->coordinator_id : "", s->epoch, (double)s->uptime_ms / 1000.0, s->dropped_messages,
           s->auth_refused, s->n_children ? "" : "  (no kvbankd report: STATUS from heartbeats only)");
    printf("%-16s %-6s %-13s %8s %6s %8s %11s %6s %8s %9s %9s %7s %s\n", "NAME", "ROLE", "STATUS", "RESTARTS", "AGE",
           "PID", "OWN/CAP", "LENT", "BORROWED", "LIVE/WAIT", "MEU(W:M)", "HB(ms)", "ENDPOINT");
    const char **names = NULL;
    size_t n = status_names(s, &names);
    for (size_t i = 0; i < n; i++) {
        const Kvbank__ModelStatus *m = model_of(s, names[i]);
        const Kvbank__ChildState *k = kvb__ctl_child_of(s, names[i]);
        const char *state = kvb__ctl_model_state(m, k);
        char restarts[16] = "-", age[24] = "-", own[32] = "-", load[32] = "-", meu[32] = "-", lent[16] = "-",
             borrowed[16] = "-", hb[24] = "-", pid[16] = "-";
        if (k) {
            snprintf(restarts, sizeof restarts, "%u", k->restarts);
            if (k->age_ms) format_age(k->age_ms + s->children_report_ms, age, sizeof age);
        }
        const char *role = k && k->role ? k->role : "";
        if (m) {
            role = m->role == KVBANK__ROLE__ROLE_MASTER ? "master" : m->role == KVBANK__ROLE__ROLE_WORKER ? "worker" : "none";
            int worker = m->role == KVBANK__ROLE__ROLE_WORKER;
            snprintf(own, sizeof own, "%" PRIu32 "/%" PRIu32, m->n_own, m->capacity);
            snprintf(load, sizeof load, "%" PRIu32 "/%" PRIu32, m->live_requests, m->waiting_requests);
            if (worker && m->meu) snprintf(meu, sizeof meu, "%" PRIu32 ":%" PRIu32, m->meu, m->meu_master);
            if (worker) snprintf(lent, sizeof lent, "%" PRIu32, m->n_lent);
            else if (m->borrow_limited) /* issue 10: at most what its LSC streams */
                snprintf(borrowed, sizeof borrowed, "%" PRIu32 "/%" PRIu32, m->n_borrowed, m->max_borrow);
            else snprintf(borrowed, sizeof borrowed, "%" PRIu32, m->n_borrowed);
            snprintf(hb, sizeof hb, "%" PRIu64, m->last_heartbeat_ms);
            if (m->alive) snprintf(pid, sizeof pid, "%" PRIu32, m->pid);
            else if (k && k->pid) snprintf(pid, sizeof pid, "%u", k->pid); /* its new process */
        } else if (k && k->pid) {
            snprintf(pid, sizeof pid, "%u", k->pid);
        }
        printf("%-16s %-6s %-13s %8s %6s %8s %11s %6s %8s %9s %9s %7s %s\n", names[i], role, state, restarts, age, pid,
               own, lent, borrowed, load, meu, hb, m && m->endpoint ? m->endpoint : "");
        char why[256];
        model_why(m, k, state, why, sizeof why);
        if (why[0]) printf("%-16s %s\n", "", why);
        if (m && m->lend_blocked && m->lend_blocked[0]) printf("%-16s cannot lend: %s\n", "", m->lend_blocked);
    }
    free(names);
    for (size_t i = 0; i < s->n_children; i++) { /* the coordinator and the gateway, from kvbankd */
        const Kvbank__ChildState *k = s->children[i];
        const char *role = k->role ? k->role : "";
        if (!strcmp(role, "master") || !strcmp(role, "worker")) continue;
        char age[24] = "-";
        if (k->age_ms) format_age(k->age_ms + s->children_report_ms, age, sizeof age);
        const char *st = kvb__ctl_model_state(NULL, k);
        if (!strcmp(st, "starting")) st = "running"; /* not a model: nothing to register */
        printf("%-16s %-6s %-13s %8u %6s %8u%s%s\n", k->name ? k->name : "", "-", st, k->restarts, age, k->pid,
               k->last_exit && k->last_exit[0] ? "  last exit: " : "", k->last_exit ? k->last_exit : "");
    }
}

static int cmd_status(ctl *c, int json) {
    Kvbank__Envelope *r = kvb__ctl_get_status(c, 0);
    if (!r) return 1;
    const Kvbank__StatusReply *s = r->status_reply;
    int rc = 0;
    if (json) rc = print_json(status_json(s, 0));
    else print_status_table(s);
    kvbank__envelope__free_unpacked(r, NULL);
    return rc;
}

static volatile sig_atomic_t g_stop;
static void on_sigint(int sig) {
    (void)sig;
    g_stop = 1;
}

/* status --watch: the table again every `interval_s`, on a cleared terminal, until SIGINT/SIGTERM;
 * a coordinator that does not answer is shown as such and asked again. */
static int cmd_status_watch(ctl *c, double interval_s) {
    signal(SIGINT, on_sigint);
    signal(SIGTERM, on_sigint);
    int tty = isatty(STDOUT_FILENO);
    while (!g_stop) {
        Kvbank__Envelope *r = kvb__ctl_get_status(c, 0);
        if (tty) printf("\033[H\033[2J");
        time_t now = time(NULL);
        char when[32];
        strftime(when, sizeof when, "%H:%M:%S", localtime(&now));
        printf("every %.1f s, %s (Ctrl-C to stop)\n", interval_s, when);
        if (r) {
            print_status_table(r->status_reply);
            kvbank__envelope__free_unpacked(r, NULL);
        } else {
            printf("no answer from the coordinator at %s\n", c->endpoint);
            kvb__ctl_close(c); /* a new socket for the next try */
        }
        fflush(stdout);
        struct timespec ts = {.tv_sec = (time_t)interval_s, .tv_nsec = (long)((interval_s - (double)(time_t)interval_s) * 1e9)};
        while (!g_stop && nanosleep(&ts, &ts) != 0) {}
    }
    return 0;
}

static int cmd_ledger(ctl *c, int json) {
    Kvbank__Envelope *r = kvb__ctl_get_status(c, 1);
    if (!r) return 1;
    const Kvbank__StatusReply *s = r->status_reply;
    int rc = 0;
    if (json) {
        json_t *loans = json_array();
        for (size_t i = 0; loans && i < s->n_loans; i++) json_array_append_new(loans, loan_json(s->loans[i]));
        rc = print_json(loans ? json_pack("{s:I, s:o}", "epoch", (json_int_t)s->epoch, "loans", loans) : NULL);
    } else {
        printf("epoch %" PRIu64 ", %zu loan(s)\n", s->epoch, s->n_loans);
        printf("%6s %-16s %15s %8s %12s %12s %6s %s\n", "LOAN", "LENDER", "WORKER BLOCKS", "MASTER", "OFFSET", "BYTES",
               "EPOCH", "STATE");
        for (size_t i = 0; i < s->n_loans; i++) {
            const Kvbank__Loan *l = s->loans[i];
            char range[40];
            snprintf(range, sizeof range, "[%" PRIu32 ", %" PRIu64 ")", l->first_block,
                     (uint64_t)l->first_block + l->n_blocks);
            printf("%6" PRIu64 " %-16s %15s %8" PRIu32 " %12" PRIu64 " %12" PRIu64 " %6" PRIu64 " %s\n", l->loan_id,
                   l->lender ? l->lender : "", range, l->n_master_blocks, l->offset, l->bytes, l->epoch,
                   l->revoking ? "revoking" : "lent");
        }
    }
    kvbank__envelope__free_unpacked(r, NULL);
    return rc;
}

static int cmd_control(ctl *c, Kvbank__Control__Op op, const char *model, uint32_t n) {
    Kvbank__Control ct = KVBANK__CONTROL__INIT;
    ct.op = op;
    ct.model = (char *)model;
    ct.n_blocks = n;
    Kvbank__Envelope env = KVBANK__ENVELOPE__INIT;
    env.body_case = KVBANK__ENVELOPE__BODY_CONTROL;
    env.control = &ct;
    Kvbank__Envelope *r = ctl_call(c, &env, KVBANK__ENVELOPE__BODY_CONTROL_REPLY);
    if (!r) return 1;
    int ok = r->control_reply->ok;
    if (!ok) {
        fprintf(stderr, PROG ": refused: %s\n", r->control_reply->error ? r->control_reply->error : "");
    } else if (op == KVBANK__CONTROL__OP__OP_LEND) {
        printf("ok: asked %s to lend %" PRIu32 " blocks\n", model, n);
    } else if (op == KVBANK__CONTROL__OP__OP_RECLAIM) {
        printf("ok: reclaiming at least %" PRIu32 " blocks of %s\n", n, model);
    } else if (op == KVBANK__CONTROL__OP__OP_UNDRAIN) {
        printf("ok: %s no longer drains\n", model);
    } else {
        printf("ok: %s drains\n", model);
    }
    kvbank__envelope__free_unpacked(r, NULL);
    return ok ? 0 : 1;
}

/* -------------------------------------------------------------------------------------- generate */

typedef struct gen_state {
    uint64_t t0;
    int quiet; /* print only the ids at the end */
    int32_t *ids;
    int n, cap;
} gen_state;

static int on_token(void *ud, int index, int32_t token, uint64_t t_ns) {
    gen_state *s = ud;
    if (!s->quiet) {
        printf("%d %d %.3f\n", index, token, (double)(int64_t)(t_ns - s->t0) / 1e6);
        fflush(stdout);
    }
    if (s->n < s->cap) s->ids[s->n++] = token;
    return 0;
}

static int cmd_generate(ctl *c, const char *model, const int32_t *prompt, int n_prompt, const int32_t *stop,
                        int n_stop, int max_tokens, int quiet) {
    Kvbank__Envelope *r = kvb__ctl_get_status(c, 0);
    if (!r) return 1;
    char *ep = NULL;
    int found = 0, alive = 0;
    char names[512] = "";
    size_t nl = 0;
    for (size_t i = 0; i < r->status_reply->n_models; i++) {
        const Kvbank__ModelStatus *m = r->status_reply->models[i];
        if (m->name && nl < sizeof names)
            nl += (size_t)snprintf(names + nl, sizeof names - nl, "%s%s", nl ? ", " : "", m->name);
        if (!m->name || strcmp(m->name, model)) continue;
        found = 1;
        alive = m->alive;
        if (m->endpoint && m->endpoint[0] && kvb_strdup(m->endpoint, &ep) != KVB_OK) ep = NULL;
    }
    kvbank__envelope__free_unpacked(r, NULL);
    if (!found) {
        fprintf(stderr, PROG ": no such model registered: '%s' (the coordinator has: %s)\n", model,
                names[0] ? names : "none");
        return 1;
    }
    if (!ep) {
        fprintf(stderr, PROG ": model '%s' has no endpoint\n", model);
        return 1;
    }
    if (!alive) fprintf(stderr, PROG ": warning: the coordinator counts %s as dead; trying %s anyway\n", model, ep);
    char why[PATH_MAX + 256];
    if (kvb_wire_ipc_check(ep, why, sizeof why) == KVB_ERR_IO) {
        fprintf(stderr, PROG ": cannot reach %s: %s\n", model, why);
        free(ep);
        return 1;
    }
    int rc = 1;
    kvb_client *cl = NULL;
    gen_state s = {.cap = max_tokens, .quiet = quiet};
    if (kvb_malloc((size_t)max_tokens * sizeof(int32_t), (void **)&s.ids) != KVB_OK) goto out;
    if (kvb_client_connect(ep, &cl) != KVB_OK) {
        fprintf(stderr, PROG ": cannot connect to %s\n", ep);
        goto out;
    }
    kvb_request req = {.prompt = prompt, .n_prompt = n_prompt, .max_tokens = max_tokens, .stop_ids = stop,
                       .n_stop = n_stop};
    kvb_finish fin = KVB_FINISH_NONE;
    char err[256] = "";
    s.t0 = kvb_wall_ns();
    kvb_status st = kvb_client_generate(cl, &req, on_token, &s, c->timeout_ms, &fin, err, sizeof err);
    if (st != KVB_OK) {
        fprintf(stderr, PROG ": %s: %s%s%s\n", ep, kvb_status_str(st), err[0] ? ": " : "", err);
        if (!s.n) goto out;
        fin = KVB_FINISH_ERROR; /* the tokens delivered before the error are shown, --quiet too */
    }
    if (!quiet) printf("finish: %s, %d tokens: ", kvb_finish_str(fin), s.n);
    for (int i = 0; i < s.n; i++) printf(i ? ",%d" : "%d", s.ids[i]);
    printf("\n");
    rc = fin == KVB_FINISH_ERROR ? 1 : 0;
out:
    kvb_client_destroy(cl);
    free(s.ids);
    free(ep);
    return rc;
}

/* ------------------------------------------------------------------------------------------- plan */

/* The KV geometry a model of the node config will register with: layers, KV heads and head dim from
 * its config.json, block size from the node config, the element size of its backend
 * (kvb_model_kv_elem_size, the rule the model itself uses; no weights are read). */
static int model_geom(const kvb_node_model *m, kvb_kv_geom *g, int *max_pos) {
    kvb_model_config mc;
    if (kvb_model_config_load(m->model_dir, &mc) != KVB_OK) {
        fprintf(stderr, PROG ": model %s: cannot read %s/config.json\n", m->name, m->model_dir);
        return -1;
    }
    if (max_pos) *max_pos = mc.max_pos;
    g->n_layers = mc.n_layers;
    g->n_kv_heads = mc.n_kv_heads;
    g->head_dim = mc.head_dim;
    g->block_size = m->block_size;
    if (kvb_model_kv_elem_size(m->backend, &g->elem_size) != KVB_OK) {
        fprintf(stderr, PROG ": model %s: unknown backend '%s'\n", m->name, m->backend ? m->backend : "");
        return -1;
    }
    if (kvb_kv_geom_check(g) != KVB_OK) {
        fprintf(stderr, PROG ": model %s: bad KV geometry\n", m->name);
        return -1;
    }
    return 0;
}

static int cmd_plan(const char *path, int json) {
    kvb_node_config *nc = NULL;
    if (kvb_node_config_load(path, &nc) != KVB_OK) {
        fprintf(stderr, PROG ": cannot load the node config %s (see the log above)\n", path);
        return 1;
    }
    int rc = 1;
    const kvb_node_model *master = kvb_node_config_master(nc);
    int n_workers = nc->n_models - 1;
    kvb_kv_geom mg, *wg = NULL;
    uint64_t *c_workers = NULL;
    json_t *jw = NULL;
    if (!master || n_workers < 0) {
        fprintf(stderr, PROG ": %s has no master\n", path);
        goto out;
    }
    if (kvb_calloc((size_t)KVB_MAX(n_workers, 1), sizeof *wg, (void **)&wg) != KVB_OK ||
        kvb_calloc((size_t)KVB_MAX(n_workers, 1), sizeof *c_workers, (void **)&c_workers) != KVB_OK)
        goto out;
    int max_pos = 0; /* the master's context: what the gateway's /v1/models advertises as max_model_len */
    if (model_geom(master, &mg, &max_pos) != 0) goto out;
    const kvb_node_model **workers = NULL;
    if (kvb_calloc((size_t)KVB_MAX(n_workers, 1), sizeof *workers, (void **)&workers) != KVB_OK) goto out;
    int k = 0;
    for (int i = 0; i < nc->n_models; i++) {
        const kvb_node_model *m = &nc->models[i];
        if (m == master) continue;
        workers[k] = m;
        c_workers[k] = (uint64_t)m->kv_bytes;
        if (model_geom(m, &wg[k], NULL) != 0) {
            free(workers);
            goto out;
        }
        k++;
    }
    kvb_swift_plan p;
    if (kvb_swift_plan_lsc(&mg, (uint64_t)master->kv_bytes, c_workers, n_workers, &p) != KVB_OK) {
        fprintf(stderr, PROG ": cannot compute the plan\n");
        free(workers);
        goto out;
    }
    uint64_t mbb = kvb_kv_block_bytes(&mg), full = p.m_block * (uint64_t)mg.n_layers;
    if (json) jw = json_array();
    if (!json) {
        printf("node %s: master %s: %d layers, %d kv heads, head dim %d, %d tokens/block, %d B/element: "
               "block %" PRIu64 " bytes, KV %" PRId64 " bytes = %" PRIu64 " blocks\n",
               nc->node, master->name, mg.n_layers, mg.n_kv_heads, mg.head_dim, mg.block_size, mg.elem_size, mbb,
               master->kv_bytes, (uint64_t)master->kv_bytes / mbb);
        printf("%-16s %12s %11s %8s %12s %9s %12s %10s\n", "WORKER", "KV BYTES", "BLOCK BYTES", "BLOCKS", "MEU(W:M)",
               "UNIT B", "K_i (Eq. 2)", "LENDABLE M");
    }
    for (int i = 0; i < n_workers; i++) {
        const kvb_node_model *w = workers[i];
        uint64_t wbb = kvb_kv_block_bytes(&wg[i]), cap = (uint64_t)w->kv_bytes / wbb;
        int64_t k_i = (int64_t)((uint64_t)w->kv_bytes / full);
        kvb_meu u;
        int has = kvb_swift_meu(&mg, &wg[i], (uint64_t)w->kv_bytes, &u) == KVB_OK;
        /* Master blocks the worker's whole region holds when lent in MEU units (what kvbank can attach). */
        uint64_t lendable = has ? cap / u.meu_worker * u.meu_master : 0;
        if (json) {
            json_t *o = json_pack("{s:s, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I}", "name", w->name, "kv_bytes",
                                  (json_int_t)w->kv_bytes, "block_bytes", (json_int_t)wbb, "blocks", (json_int_t)cap,
                                  "meu_worker", (json_int_t)(has ? u.meu_worker : 0), "meu_master",
                                  (json_int_t)(has ? u.meu_master : 0), "lcm_bytes", (json_int_t)(has ? u.lcm_bytes : 0),
                                  "k_i", (json_int_t)k_i, "lendable_master_blocks", (json_int_t)lendable);
            if (jw) json_array_append_new(jw, o);
        } else {
            char meu[32], unit[24];
            if (has) {
                snprintf(meu, sizeof meu, "%" PRIu32 ":%" PRIu32, u.meu_worker, u.meu_master);
                snprintf(unit, sizeof unit, "%" PRIu64, u.lcm_bytes);
            } else {
                snprintf(meu, sizeof meu, "none");
                snprintf(unit, sizeof unit, "-");
            }
            printf("%-16s %12" PRId64 " %11" PRIu64 " %8" PRIu64 " %12s %9s %12" PRId64 " %10" PRIu64 "\n", w->name,
                   w->kv_bytes, wbb, cap, meu, unit, k_i, lendable);
        }
    }
    free(workers);
    if (json) {
        json_t *j = json_pack("{s:s, s:s, s:I, s:I, s:{s:I, s:I, s:I, s:I, s:I}, s:o, s:{s:I, s:I, s:I, s:I, s:I, "
                              "s:I, s:I, s:I}}",
                              "node", nc->node, "master", master->name, "master_kv_bytes",
                              (json_int_t)master->kv_bytes, "master_block_bytes", (json_int_t)mbb, "master_geom",
                              "n_layers", (json_int_t)mg.n_layers, "n_kv_heads", (json_int_t)mg.n_kv_heads, "head_dim",
                              (json_int_t)mg.head_dim, "block_size", (json_int_t)mg.block_size, "elem_size",
                              (json_int_t)mg.elem_size, "workers", jw ? jw : json_array(), "plan", "m_block",
                              (json_int_t)p.m_block, "k_workers", (json_int_t)p.k_workers, "k_master",
                              (json_int_t)p.k_master, "n_lsc", (json_int_t)p.n_lsc, "n_rc", (json_int_t)p.n_rc,
                              "no_lending_tokens", (json_int_t)p.no_lending_tokens, "paper_max_ctx_tokens",
                              (json_int_t)p.max_ctx_tokens, "inplace_tokens", (json_int_t)p.inplace_tokens);
        if (j) {
            json_object_set_new(j, "max_model_len", json_integer(max_pos));
            json_object_set_new(j, "longest_context_tokens", json_integer(KVB_MIN((int64_t)max_pos, p.inplace_tokens)));
        }
        jw = NULL;
        rc = print_json(j);
        goto out;
    }
    printf("\nmaster (SwiftCache §3.2):\n");
    printf("  Eq. 1  M_block  = 2 * B * H_kv * D_kv * dtype = %" PRIu64 " bytes (one block of one layer)\n", p.m_block);
    printf("  Eq. 2  sum K_i  = %" PRId64 " master full-layer blocks in the workers' KV memory\n", p.k_workers);
    printf("  Eq. 3  K_master = %" PRId64 " single-layer blocks in the master's KV memory\n", p.k_master);
    printf("  Eq. 4  N_LSC    = %" PRId64 " blocks (layer stream cache)\n", p.n_lsc);
    printf("  Eq. 5  N_RC     = %" PRId64 " full-layer blocks (regular cache)\n", p.n_rc);
    printf("longest context of the master:\n");
    printf("  without lending                          %10" PRId64 " tokens\n", p.no_lending_tokens);
    printf("  with lending, paper (N_LSC + N_RC) * B   %10" PRId64 " tokens\n", p.max_ctx_tokens);
    printf("  with lending, kvbank in place            %10" PRId64 " tokens\n", p.inplace_tokens);
    printf("  the model's context (max_model_len)      %10d tokens (config.json max_position_embeddings; /v1/models)\n",
           max_pos);
    printf("  longest request (prompt + completion)    %10" PRId64 " tokens%s\n", KVB_MIN((int64_t)max_pos, p.inplace_tokens),
           max_pos < p.inplace_tokens ? " (the model's context: the memory would hold more)" : " (its KV memory)");
    rc = 0;
out:
    json_decref(jw);
    free(wg);
    free(c_workers);
    kvb_node_config_free(nc);
    return rc;
}

/* ------------------------------------------------------------------------------------------- main */

static int parse_n(const char *what, const char *v, int64_t min, int64_t max, int64_t *out) {
    if (kvb_parse_i64(v, min, max, out) != KVB_OK) {
        fprintf(stderr, PROG ": %s must be an integer in [%lld, %lld], got '%s'\n", what, (long long)min,
                (long long)max, v);
        return -1;
    }
    return 0;
}

/* One subcommand: its synopsis and what it does (kvbankctl COMMAND --help). */
typedef struct command {
    const char *name;
    const char *synopsis;
    const char *help;
} command;

static const command g_commands[] = {
    {"status", "status [--json] [--watch[=SECONDS]]",
     "Every model of the node, one line each: NAME, ROLE, STATUS (running, starting, restarting,\n"
     "crash-looping, draining, pending, generating, stopping, dead), RESTARTS and AGE (from kvbankd's\n"
     "report to the coordinator), PID, blocks OWN/CAP, LENT, BORROWED, LIVE/WAIT requests, the MEU of\n"
     "a worker with the master (worker blocks : master blocks), the last heartbeat and the endpoint.\n"
     "A model kvbankd runs that is not registered is shown too, with why under it; then the\n"
     "coordinator and the gateway.\n"
     "  --json              the same as JSON (\"status\", \"restarts\", \"age_ms\", \"why\" per model)\n"
     "  --watch[=SECONDS]   show it again every SECONDS (default 2) until Ctrl-C\n"},
    {"ledger", "ledger [--json]", "The loans: id, lender, worker blocks, master blocks, offset, bytes, epoch, state.\n"
                                   "  --json              as JSON\n"},
    {"top", "top [--interval SECONDS]",
     "A live view of the node (ncurses): per model a bar of its KV memory split into own used, own\n"
     "free, lent and borrowed blocks, requests running and waiting, tokens/s, and the loans moving\n"
     "(lends and reclaims since the last refresh). q quits.\n"
     "  --interval SECONDS  refresh period (default 1)\n"},
    {"lend", "lend WORKER N", "Ask WORKER to offer N of its blocks to the master (the worker decides what it can lend;\n"
                               "`ok` means it was asked).\n"},
    {"reclaim", "reclaim WORKER N", "Give WORKER at least N blocks back (whole loans, lowest first; blocks already being\n"
                                     "reclaimed count).\n"},
    {"drain", "drain MODEL", "A worker stops lending and takes all its blocks back; the master gives back everything it\n"
                              "borrowed and borrows no more. `undrain` undoes it.\n"},
    {"undrain", "undrain MODEL", "Undo `drain`: a worker lends again when SwiftCache's Alg. 1 says so; the master borrows\n"
                                  "again. Refused when MODEL does not drain.\n"},
    {"generate", "generate --model NAME --prompt-ids IDS --max-tokens N [--stop-ids IDS] [--quiet]",
     "Send one request to the model's endpoint (from the status) and print each token as\n"
     "`INDEX TOKEN MS`, then a summary line.\n"
     "  --quiet             print only the ids\n"},
    {"plan", "plan [--config NODE.json] [--json]",
     "Offline, no coordinator: for each worker its MEU with the master, the master's layer stream\n"
     "cache and regular cache sizes (SwiftCache Eq. 1-5) from the kv budgets, and its longest context\n"
     "without lending, with lending as in the paper ((N_LSC + N_RC) * B) and in place (kvbank), and the\n"
     "longest request it serves: that, at most its context (max_model_len, as the gateway's /v1/models says).\n"
     "  --config NODE.json  the node config (default: kvbankctl's --config)\n"
     "  --json              as JSON\n"},
};

static const command *find_command(const char *name) {
    for (size_t i = 0; i < KVB_ARRAY_LEN(g_commands); i++)
        if (!strcmp(g_commands[i].name, name)) return &g_commands[i];
    return NULL;
}

static void usage(FILE *f) {
    fprintf(f, "usage: kvbankctl [--coordinator EP | --config NODE.json] [--timeout-ms N] COMMAND [ARGS]\n"
               "\n"
               "Talks to kvbank-coordinator (the endpoint is --coordinator, or the \"coordinator\" section of the\n"
               "node config). `kvbankctl COMMAND --help` tells more about each command.\n"
               "\n"
               "commands:\n");
    for (size_t i = 0; i < KVB_ARRAY_LEN(g_commands); i++) fprintf(f, "  %s\n", g_commands[i].synopsis);
    fprintf(f,
            "\n"
            "options:\n"
            "  --coordinator EP       the coordinator's endpoint\n"
            "  --config NODE.json     node config (coordinator endpoint; the default config of `plan`);\n"
            "                         default: $KVBANK_CONFIG, else " KVB_DEFAULT_CONFIG " when it exists\n"
            "  --timeout-ms N         give up when the coordinator (or the model) is silent this long\n"
            "                         (default %d)\n"
            "  -h, --help             this text\n"
            "  --version              the version\n"
            "\n"
            "Exit status 0 on success, 1 on an error (no answer, refused, unknown model), 2 on a usage error.\n",
            DEFAULT_TIMEOUT_MS);
}

static void command_usage(FILE *f, const command *c) {
    fprintf(f, "usage: kvbankctl [OPTIONS] %s\n\n%s", c->synopsis, c->help);
}

/* getopt_long's error for argv[optind - 1] in `cmd` ("" for the global options), on stderr. */
static int bad_option(const char *cmd, char **argv, const char *usage_hint) {
    const char *a = argv[optind - 1], *sp = cmd[0] ? " " : "";
    if (strncmp(a, "--", 2) != 0) fprintf(stderr, PROG "%s%s: unknown option '-%c'\n", sp, cmd, optopt ? optopt : '?');
    else if (!optopt) fprintf(stderr, PROG "%s%s: unknown option '%s'\n", sp, cmd, a);
    else if (strchr(a, '=')) fprintf(stderr, PROG "%s%s: option '%s' takes no value\n", sp, cmd, a);
    else fprintf(stderr, PROG "%s%s: option '%s' needs a value\n", sp, cmd, a);
    fprintf(stderr, "%s\n", usage_hint);
    return 2;
}

/* What a command was given. */
typedef struct cmd_args {
    int json, quiet, watch;
    double interval_s;
    const char *model, *config;
    int64_t n, max_tokens;
    int32_t *prompt, *stop;
    int n_prompt, n_stop;
} cmd_args;

/* Parses ARGS of `cmd` (argv[0] is the command). 0 ok, 1 --help printed, 2 usage error (printed). */
static int parse_command(const command *cmd, int argc, char **argv, cmd_args *a) {
    enum { O_JSON = 256, O_WATCH, O_INTERVAL, O_MODEL, O_PROMPT, O_STOP, O_MAX, O_QUIET, O_CONFIG };
    static const struct option opts[] = {
        {"help", no_argument, NULL, 'h'},           {"json", no_argument, NULL, O_JSON},
        {"watch", optional_argument, NULL, O_WATCH}, {"interval", required_argument, NULL, O_INTERVAL},
        {"model", required_argument, NULL, O_MODEL}, {"prompt-ids", required_argument, NULL, O_PROMPT},
        {"stop-ids", required_argument, NULL, O_STOP}, {"max-tokens", required_argument, NULL, O_MAX},
        {"quiet", no_argument, NULL, O_QUIET},       {"config", required_argument, NULL, O_CONFIG},
        {NULL, 0, NULL, 0},
    };
    /* which options each command takes */
    const char *n = cmd->name;
    int takes_json = !strcmp(n, "status") || !strcmp(n, "ledger") || !strcmp(n, "plan");
    char hint[96];
    snprintf(hint, sizeof hint, "usage: kvbankctl %s (kvbankctl %s --help for more)", cmd->synopsis, n);
    optind = 0; /* a fresh scan of this argv */
    opterr = 0;
    int o;
    while ((o = getopt_long(argc, argv, "+h", opts, NULL)) != -1) {
        int ok = 1;
        switch (o) {
        case 'h': command_usage(stdout, cmd); return 1;
        case O_JSON: ok = takes_json; a->json = 1; break;
        case O_WATCH:
            ok = !strcmp(n, "status");
            a->watch = 1;
            a->interval_s = 2.0;
            if (ok && optarg) {
                char *end = NULL;
                a->interval_s = strtod(optarg, &end);
                if (!end || *end || !(a->interval_s >= 0.1 && a->interval_s <= 3600)) {
                    fprintf(stderr, PROG " status: --watch=SECONDS must be a number in [0.1, 3600], got '%s'\n", optarg);
                    return 2;
                }
            }
            break;
        case O_INTERVAL: {
            ok = !strcmp(n, "top");
            char *end = NULL;
            a->interval_s = strtod(optarg, &end);
            if (ok && (!end || *end || !(a->interval_s >= 0.1 && a->interval_s <= 3600))) {
                fprintf(stderr, PROG " top: --interval must be a number of seconds in [0.1, 3600], got '%s'\n", optarg);
                return 2;
            }
            break;
        }
        case O_CONFIG: ok = !strcmp(n, "plan"); a->config = optarg; break;
        case O_QUIET: ok = !strcmp(n, "generate"); a->quiet = 1; break;
        case O_MODEL: ok = !strcmp(n, "generate"); a->model = optarg; break;
        case O_MAX:
            ok = !strcmp(n, "generate");
            if (ok && parse_n("--max-tokens", optarg, 1, 1 << 30, &a->max_tokens)) return 2;
            break;
        case O_PROMPT:
        case O_STOP: {
            ok = !strcmp(n, "generate");
            int32_t **ids = o == O_PROMPT ? &a->prompt : &a->stop;
            int *cnt = o == O_PROMPT ? &a->n_prompt : &a->n_stop;
            free(*ids);
            *ids = NULL;
            if (ok && kvb_parse_id_list(optarg, ids, cnt) != KVB_OK) {
                fprintf(stderr, PROG " generate: bad %s '%s'\n", o == O_PROMPT ? "--prompt-ids" : "--stop-ids", optarg);
                return 2;
            }
            break;
        }
        default: return bad_option(n, argv, hint);
        }
        if (!ok) {
            fprintf(stderr, PROG " %s: option '%s' does not apply to this command\n%s\n", n, argv[optind - 1], hint);
            return 2;
        }
    }
    int rest = argc - optind, want = 0;
    if (!strcmp(n, "lend") || !strcmp(n, "reclaim")) want = 2;
    else if (!strcmp(n, "drain") || !strcmp(n, "undrain")) want = 1;
    if (rest != want) {
        if (rest > want) fprintf(stderr, PROG " %s: unexpected argument '%s'\n", n, argv[optind + want]);
        else fprintf(stderr, PROG " %s: %s required\n", n, want == 2 ? "WORKER and N are" : "MODEL is");
        fprintf(stderr, "%s\n", hint);
        return 2;
    }
    if (want) a->model = argv[optind];
    if (want == 2 && parse_n("N", argv[optind + 1], 1, UINT32_MAX, &a->n)) return 2;
    if (!strcmp(n, "generate") && (!a->model || !a->prompt || !a->max_tokens)) {
        fprintf(stderr, PROG " generate: --model, --prompt-ids and --max-tokens are required\n%s\n", hint);
        return 2;
    }
    return 0;
}

/* The node config when none was given: $KVBANK_CONFIG, else KVB_DEFAULT_CONFIG when it exists. */
static const char *default_config(void) {
    const char *env = getenv("KVBANK_CONFIG");
    if (env && *env) return env;
    return access(KVB_DEFAULT_CONFIG, F_OK) == 0 ? KVB_DEFAULT_CONFIG : NULL;
}

int main(int argc, char **argv) {
    kvb_prog_init(argc, argv, "kvbankctl");
    const char *endpoint = NULL, *config = NULL;
    int64_t timeout = DEFAULT_TIMEOUT_MS;
    enum { O_COORD = 256, O_CONFIG, O_TIMEOUT };
    static const struct option opts[] = {
        {"coordinator", required_argument, NULL, O_COORD},
        {"config", required_argument, NULL, O_CONFIG},
        {"timeout-ms", required_argument, NULL, O_TIMEOUT},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    static const char hint[] = "usage: kvbankctl [OPTIONS] COMMAND [ARGS] (kvbankctl --help for more)";
    opterr = 0;
    int o;
    /* "+": the options before the command; the command's own come after it */
    while ((o = getopt_long(argc, argv, "+h", opts, NULL)) != -1) {
        switch (o) {
        case 'h': usage(stdout); return 0;
        case O_COORD: endpoint = optarg; break;
        case O_CONFIG: config = optarg; break;
        case O_TIMEOUT:
            if (parse_n("--timeout-ms", optarg, 1, 3600000, &timeout)) return 2;
            break;
        default: return bad_option("", argv, hint);
        }
    }
    if (optind >= argc) {
        fprintf(stderr, PROG ": no command\n%s\n", hint);
        return 2;
    }
    const command *cmd = find_command(argv[optind]);
    if (!cmd) {
        fprintf(stderr, PROG ": unknown command '%s'\n%s\n", argv[optind], hint);
        return 2;
    }
    cmd_args a = {.interval_s = 1.0};
    int pr = parse_command(cmd, argc - optind, argv + optind, &a);
    if (pr) {
        free(a.prompt);
        free(a.stop);
        return pr == 1 ? 0 : 2;
    }
    if (!endpoint && !config) config = default_config();
    if (!strcmp(cmd->name, "plan")) {
        const char *path = a.config ? a.config : config;
        if (!path) {
            fprintf(stderr, PROG " plan: --config NODE.json is required (or KVBANK_CONFIG; " KVB_DEFAULT_CONFIG
                            " does not exist)\n");
            return 2;
        }
        return cmd_plan(path, a.json);
    }

    int rc = 1;
    kvb_node_config *nc = NULL;
    if (!endpoint && config) {
        /* only for the endpoint: the config's warnings are kvbankd's (and `plan`'s) to print */
        setenv("KVB_CONFIG_CHECKED", "1", 1);
        if (kvb_node_config_load(config, &nc) != KVB_OK) {
            fprintf(stderr, PROG ": cannot load the node config %s (see the log above)\n", config);
            goto done;
        }
        endpoint = nc->coordinator;
    }
    if (!endpoint) {
        fprintf(stderr, PROG ": give --coordinator EP or --config NODE.json (or set KVBANK_CONFIG; " KVB_DEFAULT_CONFIG
                        " does not exist)\n");
        rc = 2;
        goto done;
    }
    ctl c = {.endpoint = endpoint, .timeout_ms = (int)timeout};
    const char *n = cmd->name;
    if (!strcmp(n, "status")) rc = a.watch ? cmd_status_watch(&c, a.interval_s) : cmd_status(&c, a.json);
    else if (!strcmp(n, "ledger")) rc = cmd_ledger(&c, a.json);
    else if (!strcmp(n, "top")) rc = kvb__ctl_top(&c, a.interval_s);
    else if (!strcmp(n, "generate"))
        rc = cmd_generate(&c, a.model, a.prompt, a.n_prompt, a.stop, a.n_stop, (int)a.max_tokens, a.quiet);
    else {
        Kvbank__Control__Op op = !strcmp(n, "lend")      ? KVBANK__CONTROL__OP__OP_LEND
                                 : !strcmp(n, "reclaim") ? KVBANK__CONTROL__OP__OP_RECLAIM
                                 : !strcmp(n, "drain")   ? KVBANK__CONTROL__OP__OP_DRAIN
                                                         : KVBANK__CONTROL__OP__OP_UNDRAIN;
        rc = cmd_control(&c, op, a.model, (uint32_t)a.n);
    }
    kvb__ctl_close(&c);
done:
    kvb_node_config_free(nc);
    free(a.prompt);
    free(a.stop);
    return rc;
}
