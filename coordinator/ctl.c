/* kvbankctl — the operator's tool: node status and ledger, manual lend / reclaim / drain, one request
 * to a model by name, and the offline SwiftCache plan of a node config. */
#include <errno.h>
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

#define PROG "kvbankctl"
#define DEFAULT_TIMEOUT_MS 5000

static void usage(FILE *f) {
    fprintf(f,
            "usage: kvbankctl [--coordinator EP | --config NODE.json] [--timeout-ms N] COMMAND [ARGS]\n"
            "\n"
            "Talks to kvbank-coordinator (the endpoint is --coordinator, or the \"coordinator\" section of the\n"
            "node config).\n"
            "\n"
            "commands:\n"
            "  status [--json]        every model: role, pid, alive, blocks own/capacity, lent, borrowed,\n"
            "                         load (live/waiting requests), the MEU of each worker with the master\n"
            "                         (worker blocks : master blocks), draining; the ledger epoch\n"
            "  ledger [--json]        the loans: id, lender, worker blocks, master blocks, bytes, epoch,\n"
            "                         revoking\n"
            "  lend WORKER N          ask WORKER to offer N of its blocks to the master (the worker decides\n"
            "                         what it can lend; `ok` means it was asked)\n"
            "  reclaim WORKER N       give WORKER at least N blocks back (whole loans, lowest first; blocks\n"
            "                         already being reclaimed count)\n"
            "  drain MODEL            a worker stops lending and takes all its blocks back; the master gives\n"
            "                         back everything it borrowed and borrows no more\n"
            "  generate --model NAME --prompt-ids IDS --max-tokens N [--stop-ids IDS] [--quiet]\n"
            "                         send one request to the model's endpoint (from the status) and print\n"
            "                         each token as `INDEX TOKEN MS`, then a summary line (--quiet: only the ids)\n"
            "  plan [--config NODE.json] [--json]\n"
            "                         offline, no coordinator: for each worker its MEU with the master, the\n"
            "                         master's layer stream cache and regular cache sizes (SwiftCache Eq.\n"
            "                         1-5) from the kv budgets, and its longest context without lending,\n"
            "                         with lending as in the paper ((N_LSC + N_RC) * B) and in place (kvbank)\n"
            "\n"
            "options:\n"
            "  --coordinator EP       the coordinator's endpoint\n"
            "  --config NODE.json     node config (coordinator endpoint; the default config of `plan`)\n"
            "  --timeout-ms N         give up when the coordinator (or the model) is silent this long\n"
            "                         (default %d)\n"
            "  -h, --help             this text\n"
            "\n"
            "Exit status 0 on success, 1 on an error (no answer, refused, unknown model), 2 on a usage error.\n",
            DEFAULT_TIMEOUT_MS);
}

static const char *role_name(Kvbank__Role r) {
    return r == KVBANK__ROLE__ROLE_MASTER ? "master" : r == KVBANK__ROLE__ROLE_WORKER ? "worker" : "none";
}

/* ------------------------------------------------------------------------------------ coordinator */

typedef struct ctl {
    const char *endpoint;
    int timeout_ms;
    void *zctx, *sock;
} ctl;

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

static void ctl_close(ctl *c) {
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

static Kvbank__Envelope *get_status(ctl *c, int ledger) {
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

static int cmd_status(ctl *c, int json) {
    Kvbank__Envelope *r = get_status(c, 0);
    if (!r) return 1;
    const Kvbank__StatusReply *s = r->status_reply;
    int rc = 0;
    if (json) {
        rc = print_json(status_json(s, 0));
    } else {
        printf("coordinator %s  epoch %" PRIu64 "  up %.1f s  dropped messages %" PRIu64 "  refused %" PRIu64 "\n",
               s->coordinator_id ? s->coordinator_id : "", s->epoch, (double)s->uptime_ms / 1000.0,
               s->dropped_messages, s->auth_refused);
        printf("%-16s %-6s %8s %-5s %11s %6s %8s %9s %9s %7s %s\n", "NAME", "ROLE", "PID", "ALIVE", "OWN/CAP", "LENT",
               "BORROWED", "LIVE/WAIT", "MEU(W:M)", "HB(ms)", "ENDPOINT");
        for (size_t i = 0; i < s->n_models; i++) {
            const Kvbank__ModelStatus *m = s->models[i];
            char own[32], load[32], meu[32], lent[16], borrowed[16];
            snprintf(own, sizeof own, "%" PRIu32 "/%" PRIu32, m->n_own, m->capacity);
            snprintf(load, sizeof load, "%" PRIu32 "/%" PRIu32, m->live_requests, m->waiting_requests);
            int worker = m->role == KVBANK__ROLE__ROLE_WORKER;
            if (worker && m->meu) snprintf(meu, sizeof meu, "%" PRIu32 ":%" PRIu32, m->meu, m->meu_master);
            else snprintf(meu, sizeof meu, "-");
            if (worker) snprintf(lent, sizeof lent, "%" PRIu32, m->n_lent);
            else snprintf(lent, sizeof lent, "-");
            if (!worker) snprintf(borrowed, sizeof borrowed, "%" PRIu32, m->n_borrowed);
            else snprintf(borrowed, sizeof borrowed, "-");
            printf("%-16s %-6s %8" PRIu32 " %-5s %11s %6s %8s %9s %9s %7" PRIu64 " %s%s\n", m->name ? m->name : "",
                   role_name(m->role), m->pid, m->alive ? "yes" : "no", own, lent, borrowed, load, meu,
                   m->last_heartbeat_ms, m->endpoint ? m->endpoint : "", m->draining ? "  (draining)" : "");
            if (m->lend_blocked && m->lend_blocked[0]) printf("%-16s cannot lend: %s\n", "", m->lend_blocked);
        }
    }
    kvbank__envelope__free_unpacked(r, NULL);
    return rc;
}

static int cmd_ledger(ctl *c, int json) {
    Kvbank__Envelope *r = get_status(c, 1);
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
    Kvbank__Envelope *r = get_status(c, 0);
    if (!r) return 1;
    char *ep = NULL;
    int found = 0, alive = 0;
    for (size_t i = 0; i < r->status_reply->n_models; i++) {
        const Kvbank__ModelStatus *m = r->status_reply->models[i];
        if (!m->name || strcmp(m->name, model)) continue;
        found = 1;
        alive = m->alive;
        if (m->endpoint && m->endpoint[0] && kvb_strdup(m->endpoint, &ep) != KVB_OK) ep = NULL;
    }
    kvbank__envelope__free_unpacked(r, NULL);
    if (!found || !ep) {
        fprintf(stderr, PROG ": %s\n", found ? "the model has no endpoint" : "no such model registered");
        free(ep);
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
static int model_geom(const kvb_node_model *m, kvb_kv_geom *g) {
    kvb_model_config mc;
    if (kvb_model_config_load(m->model_dir, &mc) != KVB_OK) {
        fprintf(stderr, PROG ": model %s: cannot read %s/config.json\n", m->name, m->model_dir);
        return -1;
    }
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
    if (model_geom(master, &mg) != 0) goto out;
    const kvb_node_model **workers = NULL;
    if (kvb_calloc((size_t)KVB_MAX(n_workers, 1), sizeof *workers, (void **)&workers) != KVB_OK) goto out;
    int k = 0;
    for (int i = 0; i < nc->n_models; i++) {
        const kvb_node_model *m = &nc->models[i];
        if (m == master) continue;
        workers[k] = m;
        c_workers[k] = (uint64_t)m->kv_bytes;
        if (model_geom(m, &wg[k]) != 0) {
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

/* 1 if argv[i..argc) is exactly nothing or "--json" (sets *json); prints a usage error otherwise. */
static int json_flag_only(int argc, char **argv, int i, const char *cmd, int *json) {
    *json = 0;
    for (; i < argc; i++) {
        if (!strcmp(argv[i], "--json")) *json = 1;
        else {
            fprintf(stderr, PROG " %s: unexpected argument '%s'\n", cmd, argv[i]);
            return 0;
        }
    }
    return 1;
}

int main(int argc, char **argv) {
    const char *endpoint = NULL, *config = NULL;
    int64_t timeout = DEFAULT_TIMEOUT_MS;
    int i = 1;
    for (; i < argc && argv[i][0] == '-'; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, PROG ": %s needs a value\n", a);
            return 2;
        }
        if (!strcmp(a, "--coordinator")) endpoint = argv[++i];
        else if (!strcmp(a, "--config")) config = argv[++i];
        else if (!strcmp(a, "--timeout-ms")) {
            if (parse_n("--timeout-ms", argv[++i], 1, 3600000, &timeout)) return 2;
        } else {
            fprintf(stderr, PROG ": unknown option '%s'\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (i >= argc) {
        fprintf(stderr, PROG ": no command\n");
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[i++];
    kvb_log_set_tag(PROG);

    if (!strcmp(cmd, "plan")) {
        const char *path = config;
        int json = 0;
        for (; i < argc; i++) {
            if (!strcmp(argv[i], "--json")) json = 1;
            else if (!strcmp(argv[i], "--config") && i + 1 < argc) path = argv[++i];
            else {
                fprintf(stderr, PROG " plan: unexpected argument '%s'\n", argv[i]);
                return 2;
            }
        }
        if (!path) {
            fprintf(stderr, PROG " plan: --config NODE.json is required\n");
            return 2;
        }
        return cmd_plan(path, json);
    }

    /* Every other command talks to the coordinator; check its arguments before connecting. */
    int json = 0, rc = 2;
    int64_t n = 0, max_tokens = 0;
    int quiet = 0;
    const char *model = NULL;
    int32_t *prompt = NULL, *stop = NULL;
    int n_prompt = 0, n_stop = 0;
    Kvbank__Control__Op op = KVBANK__CONTROL__OP__OP_NONE;
    if (!strcmp(cmd, "status") || !strcmp(cmd, "ledger")) {
        if (!json_flag_only(argc, argv, i, cmd, &json)) return 2;
    } else if (!strcmp(cmd, "lend") || !strcmp(cmd, "reclaim")) {
        if (argc - i != 2) {
            fprintf(stderr, PROG " %s: WORKER and N are required\n", cmd);
            return 2;
        }
        model = argv[i];
        if (parse_n("N", argv[i + 1], 1, UINT32_MAX, &n)) return 2;
        op = !strcmp(cmd, "lend") ? KVBANK__CONTROL__OP__OP_LEND : KVBANK__CONTROL__OP__OP_RECLAIM;
    } else if (!strcmp(cmd, "drain")) {
        if (argc - i != 1) {
            fprintf(stderr, PROG " drain: MODEL is required\n");
            return 2;
        }
        model = argv[i];
        op = KVBANK__CONTROL__OP__OP_DRAIN;
    } else if (!strcmp(cmd, "generate")) {
        for (; i < argc; i++) {
            const char *a = argv[i];
            const char *v = i + 1 < argc ? argv[i + 1] : NULL;
            if (!strcmp(a, "--quiet")) {
                quiet = 1;
                continue;
            }
            if (!v) {
                fprintf(stderr, PROG " generate: unexpected argument '%s'\n", a);
                goto usage_error;
            }
            if (!strcmp(a, "--model")) model = v;
            else if (!strcmp(a, "--prompt-ids")) {
                free(prompt);
                prompt = NULL;
                if (kvb_parse_id_list(v, &prompt, &n_prompt) != KVB_OK) {
                    fprintf(stderr, PROG " generate: bad --prompt-ids '%s'\n", v);
                    goto usage_error;
                }
            } else if (!strcmp(a, "--stop-ids")) {
                free(stop);
                stop = NULL;
                if (kvb_parse_id_list(v, &stop, &n_stop) != KVB_OK) {
                    fprintf(stderr, PROG " generate: bad --stop-ids '%s'\n", v);
                    goto usage_error;
                }
            } else if (!strcmp(a, "--max-tokens")) {
                if (parse_n("--max-tokens", v, 1, 1 << 30, &max_tokens)) goto usage_error;
            } else {
                fprintf(stderr, PROG " generate: unexpected argument '%s'\n", a);
                goto usage_error;
            }
            i++;
        }
        if (!model || !prompt || !max_tokens) {
            fprintf(stderr, PROG " generate: --model, --prompt-ids and --max-tokens are required\n");
            goto usage_error;
        }
    } else {
        fprintf(stderr, PROG ": unknown command '%s'\n", cmd);
        usage(stderr);
        return 2;
    }

    kvb_node_config *nc = NULL;
    if (!endpoint && config) {
        if (kvb_node_config_load(config, &nc) != KVB_OK) {
            fprintf(stderr, PROG ": cannot load the node config %s (see the log above)\n", config);
            rc = 1;
            goto done;
        }
        endpoint = nc->coordinator;
    }
    if (!endpoint) {
        fprintf(stderr, PROG ": give --coordinator EP or --config NODE.json\n");
        rc = 2;
        goto done;
    }
    ctl c = {.endpoint = endpoint, .timeout_ms = (int)timeout};
    if (!strcmp(cmd, "status")) rc = cmd_status(&c, json);
    else if (!strcmp(cmd, "ledger")) rc = cmd_ledger(&c, json);
    else if (!strcmp(cmd, "generate")) rc = cmd_generate(&c, model, prompt, n_prompt, stop, n_stop, (int)max_tokens, quiet);
    else rc = cmd_control(&c, op, model, (uint32_t)n);
    ctl_close(&c);
done:
    kvb_node_config_free(nc);
    free(prompt);
    free(stop);
    return rc;
usage_error:
    free(prompt);
    free(stop);
    return 2;
}
