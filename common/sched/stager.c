/* kvbank — the stager (stager.h): one copy thread per link, transfers in post order per link, tickets,
 * and the link model's delays (the model's arithmetic is link_model.c). */
#include "common/sched/stager.h"

#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <time.h>

/* ------------------------------------------------------------------------------------ link model */

static pthread_mutex_t flops_mu = PTHREAD_MUTEX_INITIALIZER;
static char flops_backend[32];
static double flops_cached;

kvb_status kvb_link_measure_flops(kvb_backend *be, double *flops) {
    pthread_mutex_lock(&flops_mu);
    if (flops_cached > 0 && !strcmp(flops_backend, be->iface->name)) {
        *flops = flops_cached;
        pthread_mutex_unlock(&flops_mu);
        return KVB_OK;
    }
    pthread_mutex_unlock(&flops_mu);
    enum { N = 256, K = 1024, R = 1024 };
    const kvb_backend_i *bi = be->iface;
    size_t es = kvb_dtype_size(bi->act_dtype);
    float *host = NULL;
    void *x = NULL, *y = NULL;
    kvb_tensor w = {0};
    kvb_status st;
    KVB_TRY_GOTO(kvb_malloc((size_t)R * K * sizeof(float), (void **)&host), out);
    for (size_t i = 0; i < (size_t)R * K; i++) host[i] = (float)((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
    KVB_TRY_GOTO(bi->weight_load(be->ctx, host, KVB_DTYPE_F32, R, K, &w), out);
    KVB_TRY_GOTO(kvb_mem_alloc(be->mem, (size_t)N * K * es, &x), out);
    KVB_TRY_GOTO(kvb_mem_alloc(be->mem, (size_t)N * R * es, &y), out);
    float *xh = host; /* reuse: N x K <= R x K */
    if (bi->act_dtype == KVB_DTYPE_F32) KVB_TRY_GOTO(bi->to_device(be->ctx, x, xh, (size_t)N * K * sizeof(float)), out);
    /* (other dtypes: the values do not change the time a matmul takes) */
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        /* time this thread waited for a CPU is not the backend's (a machine shared with others) */
        uint64_t t0 = kvb_now_ns(), q0 = kvb_thread_runq_ns();
        KVB_TRY_GOTO(bi->matmul(be->ctx, x, N, &w, 0.0f, y), out);
        KVB_TRY_GOTO(bi->sync(be->ctx), out);
        uint64_t dt = kvb_now_ns() - t0, dq = kvb_thread_runq_ns() - q0;
        double s = (double)(dq < dt ? dt - dq : dt) / 1e9;
        if (s > 0) best = KVB_MAX(best, 2.0 * N * K * R / s);
    }
    *flops = best;
    pthread_mutex_lock(&flops_mu);
    flops_cached = best;
    snprintf(flops_backend, sizeof flops_backend, "%s", bi->name);
    pthread_mutex_unlock(&flops_mu);
out:
    if (w.data) bi->weight_free(be->ctx, &w);
    kvb_mem_free(be->mem, x);
    kvb_mem_free(be->mem, y);
    free(host);
    return st;
}

kvb_status kvb_link_preset(const char *name, kvb_backend *be, kvb_link_model *out) {
    KVB_TRY(kvb_link_preset_find(name, out));
    if (out->calibrate && be) KVB_TRY(kvb_link_measure_flops(be, &out->measured_flops));
    return KVB_OK;
}

/* ---------------------------------------------------------------------------------------- stager */

typedef struct task {
    kvb_xfer_dir dir;
    const kvb_xfer *x; /* borrowed until issued (device waits) or waited */
    int n;
    uint64_t bt;       /* device waits: the backend's ticket once issued (0: not yet, or its copy failed) */
} task;

/* Sharing links: the model's state of one transfer, and of a link's two directions. Times are
 * monotonic seconds. */
typedef struct vxfer {
    uint64_t t;      /* its ticket number on the lane */
    int dirn;        /* 0: towards the device (H2D, D2D), 1: from it (D2H) */
    double rem;      /* bytes the model has not carried yet */
    double act;      /* when it starts moving data (post + latency) */
    int done;
} vxfer;

typedef struct lane {
    struct kvb_stager *s;
    kvb_link_kind kind;
    pthread_t thread;
    int started;
    task *q;             /* ring of cap tasks: task t (1-based) at q[(t - 1) % cap] */
    int cap;
    uint64_t posted, done;
    /* device waits (see issue_thread): done <= issued <= posted; the tasks in (done, issued] are issued
     * and not known to have landed, all on the copy engine `eng` */
    uint64_t issued;
    kvb_copy_engine eng;
    uint64_t dev_upto;   /* the newest task kvb_stager_wait_device ordered compute after since the last settle */
    kvb_status err;      /* first error since the last drain */
    kvb_link_report now; /* since the last report */
    kvb_link_report total;
    /* sharing links: transfers posted since the last drain, and the model's clock */
    vxfer *v;
    int nv, capv;
    double vt;           /* the model has been advanced to this time */
} lane;

/* Lane k < KVB_LINK_COUNT is link k; lane OUT_LANE(k) its from-device queue (kvb_stager_post_out). */
#define N_LANES (2 * KVB_LINK_COUNT)
#define OUT_LANE(k) (KVB_LINK_COUNT + (int)(k))

struct kvb_stager {
    kvb_backend *be;
    kvb_link_model lm;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int quit;
    lane lanes[N_LANES];
    void *buf_mem;       /* [n_buf][buf_bytes] backend memory (ext_mem when that is set) */
    int n_buf;
    size_t buf_bytes;
    void *ext_mem;       /* the caller's memory for the buffers, borrowed (NULL: allocate) */
    size_t ext_bytes;
    int dev;             /* 1: copies complete on the device (kvb_stager_wait_device orders compute after them) */
    uint64_t n_host_waits, n_dev_waits; /* kvb_stager_wait_counts */
};

/* The copy engine of a direction. */
static kvb_copy_engine engine_of(kvb_xfer_dir d) {
    return d == KVB_XFER_H2D ? KVB_ENGINE_H2D : d == KVB_XFER_D2H ? KVB_ENGINE_D2H : KVB_ENGINE_PEER;
}

static kvb_status run_task(kvb_stager *s, const task *t) {
    const kvb_backend_i *bi = s->be->iface;
    if (bi->copy_async) {
        /* the pieces back to back on the direction's copy stream, one completion for all: nothing on the
         * compute stream, which runs on meanwhile; this copy thread waits, not the engine's */
        uint64_t ticket;
        KVB_TRY(bi->copy_async(s->be->ctx, engine_of(t->dir), t->x, t->n, &ticket));
        return bi->ticket_wait(s->be->ctx, ticket);
    }
    for (int i = 0; i < t->n; i++) {
        const kvb_xfer *x = &t->x[i];
        if (!x->bytes) continue;
        switch (t->dir) {
        case KVB_XFER_D2D: KVB_TRY(bi->copy(s->be->ctx, x->dst, x->src, x->bytes)); break;
        case KVB_XFER_D2H: KVB_TRY(bi->to_host(s->be->ctx, x->dst, x->src, x->bytes)); break;
        case KVB_XFER_H2D: KVB_TRY(bi->to_device(s->be->ctx, x->dst, x->src, x->bytes)); break;
        }
    }
    return KVB_OK;
}

/* Sleeps until the monotonic time `until_ns`. */
static void sleep_until(uint64_t until_ns) {
    struct timespec ts = {.tv_sec = (time_t)(until_ns / 1000000000u), .tv_nsec = (long)(until_ns % 1000000000u)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

/* Monotonic seconds since the process's first call (small numbers keep the model's sums exact). */
static double mono_s(void) {
    static uint64_t base;
    uint64_t now = kvb_now_ns(), zero = 0;
    __atomic_compare_exchange_n(&base, &zero, now - 1, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return (double)(now - __atomic_load_n(&base, __ATOMIC_RELAXED)) * 1e-9;
}

/* Sharing links: advances the model of `ln` to time `until` (with s->mu held). In each direction the
 * transfers that have started share the bandwidth equally; a transfer's share is redistributed when
 * it is done. The time either direction is busy counts in the reports. */
static void share_advance(kvb_stager *s, lane *ln, double until) {
    double bw = s->lm.links[ln->kind].bytes_per_s;
    while (ln->vt < until) {
        int n_act[2] = {0, 0};
        double min_rem[2] = {1e300, 1e300}, next_act = 1e300;
        for (int i = 0; i < ln->nv; i++) {
            vxfer *x = &ln->v[i];
            if (x->done) continue;
            if (x->act <= ln->vt) {
                if (x->rem <= 0 || !(bw > 0)) { /* nothing left, or an unlimited link: done as it starts */
                    x->rem = 0;
                    x->done = 1;
                    continue;
                }
                n_act[x->dirn]++;
                if (x->rem < min_rem[x->dirn]) min_rem[x->dirn] = x->rem;
            } else if (x->act < next_act) {
                next_act = x->act;
            }
        }
        double tn = KVB_MIN(next_act, until), t_fin[2] = {1e300, 1e300};
        for (int d = 0; d < 2; d++)
            if (n_act[d]) tn = KVB_MIN(tn, t_fin[d] = ln->vt + min_rem[d] * n_act[d] / bw);
        double dt = tn - ln->vt;
        if (n_act[0] || n_act[1]) {
            uint64_t busy = (uint64_t)(dt * 1e9);
            ln->now.busy_ns += busy;
            ln->total.busy_ns += busy;
        }
        for (int i = 0; i < ln->nv; i++) {
            vxfer *x = &ln->v[i];
            if (x->done || x->act > ln->vt) continue;
            double moved = dt * bw / n_act[x->dirn];
            /* the smallest of a direction is done when its finishing time is reached (exactly, so that
             * rounding can never leave a sliver that takes no time to move) */
            if ((tn >= t_fin[x->dirn] && x->rem <= min_rem[x->dirn] * (1 + 1e-9)) || x->rem - moved <= 1e-6) {
                x->rem = 0;
                x->done = 1;
            } else {
                x->rem -= moved;
            }
        }
        ln->vt = tn;
    }
}

/* Sharing links: when transfer `x` will be done if nothing else is posted (s->mu held). */
static double share_eta(kvb_stager *s, lane *ln, const vxfer *x) {
    double bw = s->lm.links[ln->kind].bytes_per_s, t = ln->vt, rem = x->rem;
    if (!(bw > 0)) return KVB_MAX(t, x->act);
    /* the other started transfers of its direction, by remaining bytes: each one done first shares the
     * link until then. Ones that start later would slow x down: leaving them out makes this the earliest
     * x can be done, and the waiter looks again when it wakes. */
    double others[256];
    int n = 0;
    if (x->act > t) t = x->act;
    for (int i = 0; i < ln->nv && n < 256; i++) {
        const vxfer *y = &ln->v[i];
        if (y != x && !y->done && y->dirn == x->dirn && y->act <= t) others[n++] = y->rem;
    }
    for (int i = 1; i < n; i++)
        for (int k = i; k > 0 && others[k] < others[k - 1]; k--) {
            double tmp = others[k];
            others[k] = others[k - 1];
            others[k - 1] = tmp;
        }
    double done = 0; /* bytes every remaining transfer has moved so far in this projection */
    int active = n + 1;
    for (int i = 0; i < n && others[i] < rem; i++) {
        t += (others[i] - done) * active / bw;
        done = others[i];
        active--;
    }
    return t + (rem - done) * active / bw;
}

/* A transfer of `bytes` the copy thread is through with (s->mu held): its error and the reports. */
static void account(lane *ln, kvb_status st, size_t bytes, uint64_t busy) {
    if (st != KVB_OK && ln->err == KVB_OK) ln->err = st;
    kvb_link_report *reps[2] = {&ln->now, &ln->total};
    for (int r = 0; r < 2; r++) {
        reps[r]->bytes += bytes;
        reps[r]->copies++;
        reps[r]->busy_ns += busy;
    }
}

static void *lane_thread(void *arg) {
    lane *ln = arg;
    kvb_stager *s = ln->s;
    const kvb_link *link = &s->lm.links[ln->kind];
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->quit && ln->done == ln->posted) pthread_cond_wait(&s->cv, &s->mu);
        if (ln->done == ln->posted) break; /* quit with nothing left */
        task t = ln->q[ln->done % (uint64_t)ln->cap];
        pthread_mutex_unlock(&s->mu);
        uint64_t t0 = kvb_now_ns();
        kvb_status st = run_task(s, &t);
        size_t bytes = 0;
        for (int i = 0; i < t.n; i++) bytes += t.x[i].bytes;
        /* one after the other: the copy takes what the model charges; sharing: the model decides when
         * a waiter sees it done, the copy itself runs at once */
        double want_s = s->lm.share ? 0 : link->latency_s + (link->bytes_per_s > 0 ? (double)bytes / link->bytes_per_s : 0);
        uint64_t until = t0 + (uint64_t)(want_s * 1e9);
        if (want_s > 0 && kvb_now_ns() < until) sleep_until(until);
        uint64_t busy = s->lm.share ? 0 : kvb_now_ns() - t0;
        pthread_mutex_lock(&s->mu);
        account(ln, st, bytes, busy);
        ln->done++;
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* ---------------------------------------------------------------- device waits
 * On a backend with tickets and a link model that does not pace copies, a link's copy thread only issues
 * its transfers (issue_thread) and the host learns that they landed when it asks: kvb_stager_wait and
 * drain wait for the backend's ticket (land), kvb_stager_done asks ticket_done, and
 * kvb_stager_wait_device has the compute stream wait for it (wait_ticket). Post order per link holds:
 * transfers on one copy engine run in issue order on its stream, and before a transfer on another
 * engine is issued the thread lands the ones before it. */

/* The backend ticket that covers tasks (ln->done, upto] of `ln` (s->mu held, upto <= ln->issued): the
 * newest one issued with a ticket (all of them are on one stream); 0 when none is (failed copies). */
static uint64_t cover_ticket(const lane *ln, uint64_t upto) {
    for (uint64_t t = upto; t > ln->done; t--) {
        uint64_t bt = ln->q[(t - 1) % (uint64_t)ln->cap].bt;
        if (bt) return bt;
    }
    return 0;
}

/* Waits (s->mu held, released meanwhile) until the issued tasks up to `upto` have landed; a landing's
 * error becomes the lane's. */
static void land(kvb_stager *s, lane *ln, uint64_t upto) {
    while (ln->done < upto) {
        uint64_t bt = cover_ticket(ln, upto);
        kvb_status st = KVB_OK;
        if (bt) {
            pthread_mutex_unlock(&s->mu);
            st = s->be->iface->ticket_wait(s->be->ctx, bt);
            pthread_mutex_lock(&s->mu);
        }
        if (st != KVB_OK && ln->err == KVB_OK) ln->err = st;
        if (ln->done < upto) ln->done = upto;
        pthread_cond_broadcast(&s->cv);
    }
}

/* A link's copy thread under device waits: issues each transfer with copy_async and goes on to the
 * next without waiting for it to land. */
static void *issue_thread(void *arg) {
    lane *ln = arg;
    kvb_stager *s = ln->s;
    const kvb_backend_i *bi = s->be->iface;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->quit && ln->issued == ln->posted) pthread_cond_wait(&s->cv, &s->mu);
        if (ln->issued == ln->posted) break; /* quit with nothing left to issue */
        task t = ln->q[ln->issued % (uint64_t)ln->cap];
        kvb_copy_engine eng = engine_of(t.dir);
        if (ln->done < ln->issued && eng != ln->eng) { /* another stream: what came before lands first */
            land(s, ln, ln->issued);
            continue;
        }
        pthread_mutex_unlock(&s->mu);
        uint64_t t0 = kvb_now_ns(), bt = 0;
        kvb_status st = bi->copy_async(s->be->ctx, eng, t.x, t.n, &bt);
        size_t bytes = 0;
        for (int i = 0; i < t.n; i++) bytes += t.x[i].bytes;
        uint64_t busy = kvb_now_ns() - t0; /* issuing: the copy runs on after */
        pthread_mutex_lock(&s->mu);
        ln->q[ln->issued % (uint64_t)ln->cap].bt = st == KVB_OK ? bt : 0; /* the ring may have grown */
        account(ln, st, bytes, busy);
        ln->eng = eng;
        ln->issued++;
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* 1 when a link model delays copies (the copy threads sleep out link time: the host must see them land). */
static int paces(const kvb_link_model *lm) {
    if (lm->share) return 1;
    for (int k = 0; k < KVB_LINK_COUNT; k++)
        if (lm->links[k].latency_s > 0 || lm->links[k].bytes_per_s > 0) return 1;
    return 0;
}

kvb_status kvb_stager_create(kvb_backend *be, const kvb_link_model *links, kvb_stager **out) {
    kvb_stager *s = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *s, (void **)&s));
    s->be = be;
    if (links) s->lm = *links;
    else KVB_TRY(kvb_link_preset("off", NULL, &s->lm));
    if (pthread_mutex_init(&s->mu, NULL)) {
        free(s);
        return KVB_ERR_NOMEM;
    }
    if (pthread_cond_init(&s->cv, NULL)) {
        pthread_mutex_destroy(&s->mu);
        free(s);
        return KVB_ERR_NOMEM;
    }
    for (int k = 0; k < N_LANES; k++) s->lanes[k] = (lane){.s = s, .kind = (kvb_link_kind)(k % KVB_LINK_COUNT)};
    const kvb_backend_i *bi = be->iface;
    s->dev = bi->copy_async && bi->wait_ticket && bi->ticket_done && bi->ticket_wait && !paces(&s->lm);
    *out = s;
    return KVB_OK;
}

void kvb_stager_destroy(kvb_stager *s) {
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    s->quit = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    for (int k = 0; k < N_LANES; k++) {
        if (s->lanes[k].started) pthread_join(s->lanes[k].thread, NULL);
        if (s->dev) { /* issued: they land before their memory may go */
            pthread_mutex_lock(&s->mu);
            land(s, &s->lanes[k], s->lanes[k].issued);
            pthread_mutex_unlock(&s->mu);
        }
        free(s->lanes[k].q);
        free(s->lanes[k].v);
    }
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    if (s->buf_mem && s->buf_mem != s->ext_mem) kvb_mem_free(s->be->mem, s->buf_mem);
    free(s);
}

const kvb_link_model *kvb_stager_links(const kvb_stager *s) { return &s->lm; }

/* Posts on lane `li` (of link `link`). */
static kvb_status post_lane(kvb_stager *s, int li, kvb_link_kind link, kvb_xfer_dir dir, const kvb_xfer *x, int n,
                            uint64_t *ticket) {
    const kvb_backend_i *bi = s->be->iface;
    if (link < 0 || link >= KVB_LINK_COUNT || n < 0) return KVB_ERR_INVALID;
    if ((dir == KVB_XFER_D2D && !bi->copy) || (dir == KVB_XFER_D2H && !bi->to_host) ||
        (dir == KVB_XFER_H2D && !bi->to_device)) {
        KVB_LOG_E("stager: the %s backend cannot copy in this direction", bi->name);
        return KVB_ERR_UNSUPPORTED;
    }
    lane *ln = &s->lanes[li];
    kvb_status st = KVB_OK;
    pthread_mutex_lock(&s->mu);
    if (n == 0) {
        *ticket = ((uint64_t)li << 56) | ln->posted; /* done once everything before it is */
        goto out;
    }
    if (ln->posted - ln->done == (uint64_t)ln->cap) { /* full: grow the ring, keeping the order */
        int cap = ln->cap ? 2 * ln->cap : 16;
        task *q = NULL;
        if ((st = kvb_malloc((size_t)cap * sizeof *q, (void **)&q)) != KVB_OK) goto out;
        for (uint64_t t = ln->done; t < ln->posted; t++) q[t % (uint64_t)cap] = ln->q[t % (uint64_t)ln->cap];
        free(ln->q);
        ln->q = q;
        ln->cap = cap;
    }
    if (!ln->started) {
        if (pthread_create(&ln->thread, NULL, s->dev ? issue_thread : lane_thread, ln)) {
            KVB_LOG_E("stager: cannot start the %s link's copy thread", kvb_link_kind_str(link));
            st = KVB_ERR_NOMEM;
            goto out;
        }
        ln->started = 1;
    }
    if (s->lm.share) { /* the model's record of it */
        if (ln->nv == ln->capv) {
            int cap = ln->capv ? 2 * ln->capv : 64;
            if ((st = kvb_realloc_array((void **)&ln->v, (size_t)cap, sizeof *ln->v)) != KVB_OK) goto out;
            ln->capv = cap;
        }
        double now = mono_s();
        share_advance(s, ln, now);
        size_t bytes = 0;
        for (int i = 0; i < n; i++) bytes += x[i].bytes;
        ln->v[ln->nv++] = (vxfer){.t = ln->posted + 1, .dirn = dir == KVB_XFER_D2H, .rem = (double)bytes,
                                  .act = now + s->lm.links[link].latency_s};
    }
    ln->q[ln->posted % (uint64_t)ln->cap] = (task){.dir = dir, .x = x, .n = n, .bt = 0};
    ln->posted++;
    *ticket = ((uint64_t)li << 56) | ln->posted;
    pthread_cond_broadcast(&s->cv);
out:
    pthread_mutex_unlock(&s->mu);
    return st;
}

kvb_status kvb_stager_post(kvb_stager *s, kvb_link_kind link, kvb_xfer_dir dir, const kvb_xfer *x, int n,
                           uint64_t *ticket) {
    return post_lane(s, (int)link, link, dir, x, n, ticket);
}

kvb_status kvb_stager_post_out(kvb_stager *s, kvb_link_kind link, const kvb_xfer *x, int n, uint64_t *ticket) {
    if (link < 0 || link >= KVB_LINK_COUNT) return KVB_ERR_INVALID;
    /* a sharing link models each direction apart already (and the copies themselves run at once) */
    return post_lane(s, s->lm.share ? (int)link : OUT_LANE(link), link, KVB_XFER_D2H, x, n, ticket);
}

/* Sharing links: waits (s->mu held) until the model has carried transfer t of `ln` (posted since the
 * last drain; an older one is done). A post meanwhile wakes the waiter, which estimates again. */
static void share_wait(kvb_stager *s, lane *ln, uint64_t t) {
    for (;;) {
        share_advance(s, ln, mono_s());
        const vxfer *x = NULL;
        for (int i = 0; i < ln->nv && !x; i++)
            if (ln->v[i].t == t) x = &ln->v[i];
        if (!x || x->done) return;
        double wait = share_eta(s, ln, x) - mono_s();
        if (wait <= 0) wait = 1e-6;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        double end = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9 + wait;
        ts.tv_sec = (time_t)end;
        ts.tv_nsec = (long)((end - (double)ts.tv_sec) * 1e9);
        pthread_cond_timedwait(&s->cv, &s->mu, &ts);
    }
}

kvb_status kvb_stager_wait(kvb_stager *s, uint64_t ticket) {
    int link = (int)(ticket >> 56);
    if (link >= N_LANES) return KVB_ERR_INVALID;
    uint64_t t = ticket & ((1ull << 56) - 1);
    lane *ln = &s->lanes[link];
    pthread_mutex_lock(&s->mu);
    s->n_host_waits++;
    if (s->dev) {
        while (ln->issued < t) pthread_cond_wait(&s->cv, &s->mu);
        land(s, ln, t);
    }
    while (ln->done < t) pthread_cond_wait(&s->cv, &s->mu);
    if (s->lm.share) share_wait(s, ln, t);
    kvb_status st = ln->err;
    pthread_mutex_unlock(&s->mu);
    return st;
}

kvb_status kvb_stager_wait_device(kvb_stager *s, uint64_t ticket) {
    if (!s->dev) return kvb_stager_wait(s, ticket);
    int link = (int)(ticket >> 56);
    if (link >= N_LANES) return KVB_ERR_INVALID;
    uint64_t t = ticket & ((1ull << 56) - 1), bt = 0;
    lane *ln = &s->lanes[link];
    pthread_mutex_lock(&s->mu);
    s->n_dev_waits++;
    while (ln->issued < t) pthread_cond_wait(&s->cv, &s->mu);
    if (t > ln->done) bt = cover_ticket(ln, t); /* the earlier ones on its stream land before it */
    if (t > ln->dev_upto) ln->dev_upto = t;
    kvb_status st = ln->err;
    pthread_mutex_unlock(&s->mu);
    if (st == KVB_OK && bt) st = s->be->iface->wait_ticket(s->be->ctx, bt);
    return st;
}

kvb_status kvb_stager_settle(kvb_stager *s) {
    kvb_status st = KVB_OK;
    pthread_mutex_lock(&s->mu);
    for (int k = 0; s->dev && k < N_LANES; k++) {
        lane *ln = &s->lanes[k];
        if (!ln->dev_upto) continue;
        land(s, ln, ln->dev_upto);
        ln->dev_upto = 0;
        if (st == KVB_OK) st = ln->err;
    }
    pthread_mutex_unlock(&s->mu);
    return st;
}

void kvb_stager_wait_counts(kvb_stager *s, uint64_t *host, uint64_t *device) {
    pthread_mutex_lock(&s->mu);
    *host = s->n_host_waits;
    *device = s->n_dev_waits;
    pthread_mutex_unlock(&s->mu);
}

int kvb_stager_device_waits(const kvb_stager *s) { return s->dev; }

int kvb_stager_done(kvb_stager *s, uint64_t ticket) {
    int link = (int)(ticket >> 56);
    if (link >= N_LANES) return 1;
    uint64_t t = ticket & ((1ull << 56) - 1);
    lane *ln = &s->lanes[link];
    pthread_mutex_lock(&s->mu);
    int done = ln->done >= t;
    if (!done && s->dev && ln->issued >= t) { /* issued: the backend knows (a failed copy is done too) */
        uint64_t bt = cover_ticket(ln, t);
        done = !bt || s->be->iface->ticket_done(s->be->ctx, bt);
    }
    if (done && s->lm.share) { /* the model's record of it, if it was posted since the last drain */
        share_advance(s, ln, mono_s());
        for (int i = 0; i < ln->nv; i++)
            if (ln->v[i].t == t) done = ln->v[i].done;
    }
    pthread_mutex_unlock(&s->mu);
    return done;
}

kvb_status kvb_stager_drain(kvb_stager *s) {
    kvb_status st = KVB_OK;
    pthread_mutex_lock(&s->mu);
    for (int k = 0; k < N_LANES; k++) {
        lane *ln = &s->lanes[k];
        if (s->dev) {
            while (ln->issued < ln->posted) pthread_cond_wait(&s->cv, &s->mu);
            land(s, ln, ln->posted);
            ln->dev_upto = 0;
        }
        while (ln->done < ln->posted) pthread_cond_wait(&s->cv, &s->mu);
        for (int i = 0; s->lm.share && i < ln->nv; i++) share_wait(s, ln, ln->v[i].t);
        ln->nv = 0;
        if (st == KVB_OK) st = ln->err;
        ln->err = KVB_OK;
    }
    pthread_mutex_unlock(&s->mu);
    return st;
}

static void finish_report(kvb_link_report *r) { r->gbps = r->busy_ns ? (double)r->bytes / (double)r->busy_ns : 0; }

/* A link's report: its lane and its from-device lane together (busy: the time of both). */
static kvb_link_report link_report(const kvb_link_report *a, const kvb_link_report *b) {
    kvb_link_report r = {.bytes = a->bytes + b->bytes, .copies = a->copies + b->copies, .busy_ns = a->busy_ns + b->busy_ns};
    finish_report(&r);
    return r;
}

void kvb_stager_take_report(kvb_stager *s, kvb_link_report out[KVB_LINK_COUNT]) {
    pthread_mutex_lock(&s->mu);
    for (int k = 0; k < KVB_LINK_COUNT; k++) {
        if (s->lm.share) share_advance(s, &s->lanes[k], mono_s()); /* the busy time up to now */
        out[k] = link_report(&s->lanes[k].now, &s->lanes[OUT_LANE(k)].now);
        s->lanes[k].now = s->lanes[OUT_LANE(k)].now = (kvb_link_report){0};
    }
    pthread_mutex_unlock(&s->mu);
}

void kvb_stager_totals(const kvb_stager *s, kvb_link_report out[KVB_LINK_COUNT]) {
    pthread_mutex_lock((pthread_mutex_t *)&s->mu);
    for (int k = 0; k < KVB_LINK_COUNT; k++) out[k] = link_report(&s->lanes[k].total, &s->lanes[OUT_LANE(k)].total);
    pthread_mutex_unlock((pthread_mutex_t *)&s->mu);
}

kvb_status kvb_stager_reserve(kvb_stager *s, int n, size_t bytes) {
    if (n < 0) return KVB_ERR_INVALID;
    if (n == s->n_buf && bytes == s->buf_bytes) return KVB_OK;
    if (s->ext_mem) { /* the caller's memory: no allocation, and never more than it holds */
        if ((size_t)n * bytes > s->ext_bytes) {
            KVB_LOG_E("stager: %d stage buffers of %zu bytes do not fit the %zu bytes set aside for them", n, bytes,
                      s->ext_bytes);
            return KVB_ERR_EXHAUSTED;
        }
        s->buf_mem = s->ext_mem;
        s->n_buf = n;
        s->buf_bytes = bytes;
        return KVB_OK;
    }
    void *mem = NULL;
    if (n > 0) KVB_TRY(kvb_mem_alloc(s->be->mem, (size_t)n * bytes, &mem));
    if (s->buf_mem) kvb_mem_free(s->be->mem, s->buf_mem);
    s->buf_mem = mem;
    s->n_buf = n;
    s->buf_bytes = bytes;
    return KVB_OK;
}

kvb_status kvb_stager_use_memory(kvb_stager *s, void *mem, size_t bytes) {
    if (!s || !mem || s->n_buf) return KVB_ERR_INVALID;
    s->ext_mem = mem;
    s->ext_bytes = bytes;
    return KVB_OK;
}

int kvb_stager_n_buffers(const kvb_stager *s) { return s->n_buf; }

void *kvb_stager_buffer(const kvb_stager *s, int i) {
    return i >= 0 && i < s->n_buf ? (char *)s->buf_mem + (size_t)i * s->buf_bytes : NULL;
}
