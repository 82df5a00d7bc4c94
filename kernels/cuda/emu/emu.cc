/* kvbank — the CUDA emulation's scheduler, and the subset of the CUDA runtime and cuBLAS that
 * kernels/cuda/backend_cuda.c and common/mem/region_cuda.c call, on host memory (see emu.h).
 * "Device" memory is malloc'd host memory, kernels and cuBLAS run at the call, cublasGemmEx is a plain
 * triple loop with double accumulation, CUDA IPC reports "not supported", the driver's VMM calls map
 * memfd ranges. Asynchronous copies are deferred (see "Streams" below), so that work which reads a
 * copy's destination without waiting for it reads poison. */
#include "kernels/cuda/emu/emu.h"

#include <cublas_v2.h>
#include <cstdio>
#include <ctime>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <vector>

emu_dim emu_threadIdx, emu_blockIdx, emu_blockDim, emu_gridDim;

/* ---------------------------------------------------------------- fibers */

extern "C" void emu_ctx_switch(void **save_sp, void *load_sp);
asm(R"(
.text
.globl emu_ctx_switch
.type emu_ctx_switch,@function
emu_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size emu_ctx_switch, .-emu_ctx_switch
.section .note.GNU-stack,"",@progbits
.text
)");

namespace {

enum state { RUNNABLE, AT_BLOCK, AT_WARP, DONE };

struct fiber {
    void *sp = nullptr;
    char *stack = nullptr; /* [STACK_BYTES], kept across launches */
    state st = RUNNABLE;
};

constexpr size_t STACK_BYTES = 256 << 10;

struct block_run {
    std::vector<fiber> f;
    void *sched_sp = nullptr;
    int cur = -1;
    int n = 0; /* threads of the running block */
    const std::function<void()> *body = nullptr;
    /* Warp collectives deposit into one of two slot sets by the parity of the collective's number (each
     * lane counts its own; a warp's lanes run the same collectives): the set a collective reads is
     * rewritten two collectives later, when every lane of the warp has arrived at the next one and so
     * has read this one's, so a lane yields once per collective. */
    std::vector<long> coll;               /* [threads] warp collectives finished */
    std::vector<uint64_t> slots[2];       /* [threads] exchange and ballot deposits */
    std::vector<unsigned char> gslots[2]; /* [threads][EMU_GATHER_MAX] gather deposits */
    struct warp_mma {
        long coll = -1;      /* the collective whose A B this holds */
        double ab[16][8];    /* its product, every lane's D without C */
    };
    std::vector<warp_mma> mma; /* [warps] */
    std::vector<char> dyn;       /* dynamic shared memory */
    /* [threads] each thread's cp.async copies not yet completed, oldest first; group -1: not committed */
    struct cp_pending {
        void *dst;
        const void *src;
        size_t bytes, src_bytes;
        long group;
    };
    std::vector<std::vector<cp_pending>> cp;
    std::vector<long> cp_groups; /* [threads] groups committed so far */
};

block_run g_run;
cudaError_t g_last = cudaSuccess;

void yield_to_scheduler() { emu_ctx_switch(&g_run.f[g_run.cur].sp, g_run.sched_sp); }

extern "C" void emu_fiber_entry() {
    (*g_run.body)();
    if (!g_run.cp[g_run.cur].empty()) {
        /* on the device the copies would land after the thread is gone: a missing wait_group */
        std::fprintf(stderr, "emu: thread %d of block %u exits with %zu cp.async copies not waited for\n", g_run.cur,
                     emu_blockIdx.x, g_run.cp[g_run.cur].size());
        std::abort();
    }
    g_run.f[g_run.cur].st = DONE;
    yield_to_scheduler();
    std::abort(); /* a finished fiber is never resumed */
}

void fiber_init(fiber &fb) {
    if (!fb.stack && !(fb.stack = (char *)std::malloc(STACK_BYTES))) std::abort();
    uintptr_t top = ((uintptr_t)fb.stack + STACK_BYTES) & ~(uintptr_t)15;
    void **sp = (void **)top;
    *--sp = nullptr;                          /* alignment slot: entry sees rsp = 8 mod 16 */
    *--sp = (void *)&emu_fiber_entry;         /* where `ret` goes */
    for (int i = 0; i < 6; i++) *--sp = nullptr; /* rbp rbx r12 r13 r14 r15 */
    fb.sp = sp;
    fb.st = RUNNABLE;
}

void set_thread(int t) {
    g_run.cur = t;
    emu_threadIdx = {(unsigned)t, 0, 0};
}

} // namespace

int emu_lane() { return g_run.cur & 31; }

void emu_syncthreads() {
    g_run.f[g_run.cur].st = AT_BLOCK;
    yield_to_scheduler();
}

/* Deposits nothing itself: the calling lane waits until its whole warp has arrived at this collective
 * (see block_run.coll) and returns the parity of the slot set the collective uses. */
static int warp_arrive() {
    int me = g_run.cur, par = (int)(g_run.coll[me] & 1);
    g_run.coll[me]++; /* counted before the wait: a lane that ran on and exited still took part */
    g_run.f[me].st = AT_WARP;
    yield_to_scheduler();
    return par;
}

/* Whether thread t took part in the calling lane's collective number `seq` (it may have exited since;
 * one that exited before it did not). */
static bool took_part(int t, long seq) { return t < g_run.n && g_run.coll[t] > seq; }

static void check_lane_running(int me, int from, long seq) {
    if (!took_part(from, seq)) {
        std::fprintf(stderr, "emu: lane %d reads lane %d, which is not running\n", me, from);
        std::abort();
    }
}

uint64_t emu_warp_exchange(uint64_t v, int src) {
    int me = g_run.cur, base = me & ~31, par = (int)(g_run.coll[me] & 1);
    long seq = g_run.coll[me];
    g_run.slots[par][me] = v;
    warp_arrive();
    int from = base + (src & 31);
    check_lane_running(me, from, seq);
    return g_run.slots[par][from];
}

void emu_warp_gather(const void *mine, size_t bytes, void *all) {
    if (bytes > EMU_GATHER_MAX) std::abort();
    int me = g_run.cur, base = me & ~31, par = (int)(g_run.coll[me] & 1);
    long seq = g_run.coll[me];
    std::memcpy(&g_run.gslots[par][(size_t)me * EMU_GATHER_MAX], mine, bytes);
    warp_arrive();
    if (bytes == 8) { /* ldmatrix's row addresses: the common case, without a call per lane */
        uint64_t *to = (uint64_t *)all;
        for (int l = 0; l < 32; l++) {
            int t = base + l;
            to[l] = took_part(t, seq) ? *(const uint64_t *)&g_run.gslots[par][(size_t)t * EMU_GATHER_MAX] : 0;
        }
        return;
    }
    for (int l = 0; l < 32; l++) {
        unsigned char *to = (unsigned char *)all + (size_t)l * bytes;
        int t = base + l;
        if (took_part(t, seq)) std::memcpy(to, &g_run.gslots[par][(size_t)t * EMU_GATHER_MAX], bytes);
        else std::memset(to, 0, bytes);
    }
}

/* 16-bit floats as float: bf16 is the top half of an f32; f16 through a table built on first use */
static float f16_to_float(uint16_t h) {
    static std::vector<float> table;
    if (table.empty()) {
        table.resize(65536);
        for (unsigned i = 0; i < 65536; i++) {
            __half x;
            uint16_t b = (uint16_t)i;
            std::memcpy(&x, &b, 2);
            table[i] = __half2float(x);
        }
    }
    return table[h];
}
static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

void emu_mma_16816(int bf16, float *d, const uint32_t *a, const uint32_t *b, const float *c) {
    int me = g_run.cur, base = me & ~31, par = (int)(g_run.coll[me] & 1);
    uint32_t mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
    std::memcpy(&g_run.gslots[par][(size_t)me * EMU_GATHER_MAX], mine, sizeof mine);
    long seq = g_run.coll[me];
    warp_arrive();
    block_run::warp_mma &wm = g_run.mma[me >> 5];
    if (wm.coll != seq) { /* the first lane of the warp to run computes every lane's A B */
        float A[16][16], B[16][8];
        for (int l = 0; l < 32; l++) {
            check_lane_running(me, base + l, seq);
            const uint32_t *r = (const uint32_t *)&g_run.gslots[par][(size_t)(base + l) * EMU_GATHER_MAX];
            int g = l >> 2, t = l & 3;
            for (int e = 0; e < 8; e++) { /* a[0..3] (two elements each) */
                int reg = e >> 1, hi = e & 1;
                uint16_t h = (uint16_t)(hi ? r[reg] >> 16 : r[reg] & 0xFFFFu);
                int row = g + (reg & 1 ? 8 : 0), col = 2 * t + hi + (reg & 2 ? 8 : 0);
                A[row][col] = bf16 ? bf16_to_float(h) : f16_to_float(h);
            }
            for (int e = 0; e < 4; e++) { /* b[0..1] */
                int reg = e >> 1, hi = e & 1;
                uint16_t h = (uint16_t)(hi ? r[4 + reg] >> 16 : r[4 + reg] & 0xFFFFu);
                B[2 * t + hi + (reg ? 8 : 0)][g] = bf16 ? bf16_to_float(h) : f16_to_float(h);
            }
        }
        for (int i = 0; i < 16; i++)
            for (int j = 0; j < 8; j++) {
                double s = 0;
                for (int k = 0; k < 16; k++) s += (double)A[i][k] * (double)B[k][j];
                wm.ab[i][j] = s;
            }
        wm.coll = seq;
    }
    int lane = me & 31, g = lane >> 2, t = lane & 3;
    for (int i = 0; i < 4; i++) d[i] = (float)(wm.ab[g + (i >= 2 ? 8 : 0)][2 * t + (i & 1)] + (double)c[i]);
}

void emu_cp_async(void *dst, const void *src, size_t bytes, size_t src_bytes) {
    std::memset(dst, 0xFF, bytes);
    g_run.cp[g_run.cur].push_back({dst, src, bytes, src_bytes, -1});
}

void emu_cp_async_commit() {
    int me = g_run.cur;
    long g = g_run.cp_groups[me]++;
    for (auto &c : g_run.cp[me])
        if (c.group < 0) c.group = g;
}

void emu_cp_async_wait(int n) {
    int me = g_run.cur;
    long done_below = g_run.cp_groups[me] - n; /* groups [0, done_below) complete */
    auto &v = g_run.cp[me];
    size_t keep = 0;
    for (size_t i = 0; i < v.size(); i++) {
        auto &c = v[i];
        if (c.group >= 0 && c.group < done_below) {
            std::memcpy(c.dst, c.src, c.src_bytes);
            std::memset((char *)c.dst + c.src_bytes, 0, c.bytes - c.src_bytes);
        } else {
            v[keep++] = c;
        }
    }
    v.resize(keep);
}

unsigned emu_ballot(int pred) {
    int me = g_run.cur, base = me & ~31, par = (int)(g_run.coll[me] & 1);
    long seq = g_run.coll[me];
    g_run.slots[par][me] = (uint64_t)pred;
    warp_arrive();
    unsigned m = 0;
    for (int l = 0; l < 32; l++)
        if (took_part(base + l, seq) && g_run.slots[par][base + l]) m |= 1u << l;
    return m;
}

void *emu_dyn_smem() { return g_run.dyn.data(); }

/* The order in which runnable threads get to run up to their next barrier: KVB_EMU_ORDER=forward
 * (default), reverse, or shuffle (a fresh pseudo-random permutation every round). A kernel that
 * reads shared memory another thread writes without a barrier between gives different results in
 * different orders, so running the suite in all three exposes a missing __syncthreads. In those
 * orders every warp whose warp operation is complete is released at once, so warps doing the same
 * work stay in step; KVB_EMU_ORDER=skew releases one warp at a time, the last first, so a warp runs
 * ahead of the others up to the next __syncthreads (a buffer it overwrites that they still read,
 * with no barrier between, then gives wrong results). */
static std::vector<int> g_order;
static int g_order_mode = -1;
static uint64_t g_order_rng = 0x9e3779b97f4a7c15ull;
static void order_next(int n) {
    if (g_order_mode < 0) {
        const char *e = std::getenv("KVB_EMU_ORDER");
        g_order_mode = !e || !std::strcmp(e, "forward") ? 0
                       : !std::strcmp(e, "reverse")   ? 1
                       : !std::strcmp(e, "skew")      ? 3
                                                      : 2;
    }
    g_order.resize(n);
    for (int i = 0; i < n; i++) g_order[i] = g_order_mode == 1 ? n - 1 - i : i;
    if (g_order_mode == 2)
        for (int i = n - 1; i > 0; i--) {
            g_order_rng = g_order_rng * 6364136223846793005ull + 1442695040888963407ull;
            std::swap(g_order[i], g_order[(int)((g_order_rng >> 33) % (uint64_t)(i + 1))]);
        }
}

cudaError_t emu_last_error() {
    cudaError_t e = g_last;
    g_last = cudaSuccess;
    return e;
}

static void stream_begin(cudaStream_t st); /* "Streams" below */

void emu_launch(unsigned grid, unsigned block, size_t smem, cudaStream_t st, const std::function<void()> &body) {
    stream_begin(st); /* the stream's earlier copies land before its kernel runs */
    if (block == 0 || block > 1024 || grid == 0) {
        g_last = cudaErrorInvalidConfiguration;
        return;
    }
    int n = (int)block;
    if ((int)g_run.f.size() < n) g_run.f.resize(n);
    g_run.n = n;
    g_run.coll.assign(n, 0);
    for (int p = 0; p < 2; p++) {
        g_run.slots[p].assign(n, 0);
        g_run.gslots[p].assign((size_t)n * EMU_GATHER_MAX, 0);
    }
    g_run.mma.assign((size_t)(n + 31) / 32, {});
    g_run.cp.assign(n, {});
    g_run.cp_groups.assign(n, 0);
    g_run.dyn.assign(smem + 16, 0);
    g_run.body = &body;
    emu_blockDim = {block, 1, 1};
    emu_gridDim = {grid, 1, 1};
    for (unsigned b = 0; b < grid; b++) {
        emu_blockIdx = {b, 0, 0};
        /* shared memory starts with garbage on a GPU: make reads of unwritten bytes visible */
        std::memset(g_run.dyn.data(), 0xA5, g_run.dyn.size());
        for (int t = 0; t < n; t++) {
            fiber_init(g_run.f[t]);
            g_run.cp_groups[t] = 0;
            g_run.coll[t] = 0;
        }
        for (auto &wm : g_run.mma) wm.coll = -1;
        for (;;) {
            bool ran = false;
            order_next(n);
            for (int k = 0; k < n; k++) {
                int t = g_order[k];
                if (g_run.f[t].st != RUNNABLE) continue;
                set_thread(t);
                emu_ctx_switch(&g_run.sched_sp, g_run.f[t].sp);
                ran = true;
            }
            if (ran) continue;
            /* everyone waits or is done: release complete barriers */
            int live = 0, at_block = 0;
            bool released = false;
            for (int t = 0; t < n; t++) {
                if (g_run.f[t].st != DONE) live++;
                if (g_run.f[t].st == AT_BLOCK) at_block++;
            }
            if (live == 0) break;
            for (int w = (n - 1) / 32 * 32; w >= 0 && !(released && g_order_mode == 3); w -= 32) {
                int wl = 0, wa = 0;
                for (int t = w; t < std::min(n, w + 32); t++) {
                    if (g_run.f[t].st != DONE) wl++;
                    if (g_run.f[t].st == AT_WARP) wa++;
                }
                if (wa > 0 && wa == wl) {
                    for (int t = w; t < std::min(n, w + 32); t++)
                        if (g_run.f[t].st == AT_WARP) g_run.f[t].st = RUNNABLE;
                    released = true;
                }
            }
            if (!released && at_block == live) {
                for (int t = 0; t < n; t++)
                    if (g_run.f[t].st == AT_BLOCK) g_run.f[t].st = RUNNABLE;
                released = true;
            }
            if (!released) {
                std::fprintf(stderr, "emu: deadlock in block %u: %d live threads, %d at __syncthreads, the rest at a "
                                     "warp operation their warp does not complete\n",
                             b, live, at_block);
                std::abort();
            }
        }
    }
}

/* ---------------------------------------------------------------- Streams
 *
 * A cudaMemcpyAsync is not done at the call: its destination is filled with 0xFF (NaN in f32, f16 and
 * bf16) and the bytes land only when something orders work after it: a kernel or cuBLAS call on the
 * same stream, cudaStreamWaitEvent of an event recorded after it (the waiting stream's later work), a
 * synchronisation of its stream, of an event after it or of the device, or an event query. So a kernel
 * that reads a copy on another stream without waiting for its event reads NaN, and so does the host
 * when it reads a destination before the copy's event. As CUDA does, a copy from pageable host memory
 * takes its bytes at the call (staged) and a copy into pageable host memory is done when the call
 * returns; pinned memory (cudaHostAlloc) and device memory are copied at delivery. A copy issued on a
 * stream runs after the stream's earlier copies: those that read or write its destination land before
 * it is poisoned. What this does not model: a copy that overwrites memory an earlier kernel still reads
 * (kernels have run by then).
 *
 * KVB_EMU_STATS=1 prints at exit what made the deferred copies land: a host wait (event or stream
 * synchronisation, event query, device synchronisation), a stream's cudaStreamWaitEvent (the compute
 * waiting on the device), or later work on their own stream. */

struct emu_copy {
    void *dst;
    const void *src;
    size_t n;
    uint64_t seq;
    std::vector<unsigned char> staged; /* a pageable source's bytes, taken at the call */
};
struct emu_stream {
    std::deque<emu_copy> q;
    uint64_t issued = 0;
};
struct emu_event {
    struct timespec t; /* host time of the last record (work runs at delivery, so close enough) */
    emu_stream *s;     /* the stream of the last record, NULL: never recorded */
    uint64_t upto;     /* the copies of s up to this sequence number precede it */
};
enum emu_mem { EMU_PAGEABLE = 0, EMU_PINNED = 1, EMU_DEVICE = 2 };

static std::mutex g_copy_mu;
static std::map<uintptr_t, std::pair<size_t, emu_mem>> g_ranges; /* start -> (bytes, kind) */
static emu_stream g_null_stream;
static std::vector<emu_stream *> g_streams; /* every stream created and not destroyed */

static emu_stream *stream_of(cudaStream_t st) { return st ? (emu_stream *)st : &g_null_stream; }
static void range_add(const void *p, size_t n, emu_mem k) {
    std::lock_guard<std::mutex> g(g_copy_mu);
    g_ranges[(uintptr_t)p] = {n, k};
}
static void range_del(const void *p) {
    std::lock_guard<std::mutex> g(g_copy_mu);
    g_ranges.erase((uintptr_t)p);
}
/* with g_copy_mu held */
static emu_mem mem_kind(const void *p) {
    auto it = g_ranges.upper_bound((uintptr_t)p);
    if (it == g_ranges.begin()) return EMU_PAGEABLE;
    --it;
    return (uintptr_t)p < it->first + it->second.first ? it->second.second : EMU_PAGEABLE;
}
/* What made a copy land (KVB_EMU_STATS). */
enum emu_cause { EMU_BY_HOST = 0, EMU_BY_STREAM_WAIT = 1, EMU_BY_STREAM = 2 };
static unsigned long long g_landed[3]; /* deferred copies by cause (g_copy_mu) */
static struct emu_stats_print {
    ~emu_stats_print() {
        const char *e = std::getenv("KVB_EMU_STATS");
        if (e && *e && std::strcmp(e, "0"))
            std::fprintf(stderr, "emu: asynchronous copies landed: %llu by a host wait, %llu by a stream's event wait, "
                                 "%llu by later work on their stream\n",
                         g_landed[EMU_BY_HOST], g_landed[EMU_BY_STREAM_WAIT], g_landed[EMU_BY_STREAM]);
    }
} g_stats_print;
/* Delivers the copies of s up to sequence `upto` (with g_copy_mu held). */
static void deliver(emu_stream *s, uint64_t upto, emu_cause why) {
    while (!s->q.empty() && s->q.front().seq <= upto) {
        emu_copy &c = s->q.front();
        std::memmove(c.dst, c.staged.empty() ? c.src : c.staged.data(), c.n);
        g_landed[why]++;
        s->q.pop_front();
    }
}
static void deliver_all(emu_stream *s, emu_cause why) { deliver(s, UINT64_MAX, why); }
/* Work on `st` starts: its earlier copies land. */
static void stream_begin(cudaStream_t st) {
    std::lock_guard<std::mutex> g(g_copy_mu);
    deliver_all(stream_of(st), EMU_BY_STREAM);
}
static bool overlaps(const void *a, size_t na, const void *b, size_t nb) {
    return (uintptr_t)a < (uintptr_t)b + nb && (uintptr_t)b < (uintptr_t)a + na;
}

/* ---------------------------------------------------------------- CUDA runtime subset */

extern "C" {

const char *cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "emulated error"; }
const char *cudaGetErrorName(cudaError_t e) { return e == cudaSuccess ? "cudaSuccess" : "cudaErrorEmulated"; }
cudaError_t cudaGetDeviceCount(int *n) {
    *n = 1;
    return cudaSuccess;
}
cudaError_t cudaGetDevice(int *d) {
    *d = 0;
    return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
cudaError_t cudaMalloc(void **p, size_t bytes) {
    *p = std::aligned_alloc(256, (bytes + 255) & ~(size_t)255);
    if (!*p) return cudaErrorMemoryAllocation;
    std::memset(*p, 0x5A, bytes); /* cudaMalloc does not zero */
    range_add(*p, bytes, EMU_DEVICE);
    return cudaSuccess;
}
cudaError_t cudaFree(void *p) {
    if (p) range_del(p);
    std::free(p);
    return cudaSuccess;
}
cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned int) {
    *p = std::aligned_alloc(256, (bytes + 255) & ~(size_t)255);
    if (!*p) return cudaErrorMemoryAllocation;
    std::memset(*p, 0x5A, bytes);
    range_add(*p, bytes, EMU_PINNED);
    return cudaSuccess;
}
cudaError_t cudaFreeHost(void *p) { return cudaFree(p); }
cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t st) {
    stream_begin(st);
    std::memset(p, v, n);
    return cudaSuccess;
}
/* A copy of n bytes from s to d on es, deferred (with g_copy_mu held); `now`: its source is read at the
 * call (a pageable source, or a batch copy whose source order is not the stream's). */
static void enqueue_copy(emu_stream *es, void *d, const void *s, size_t n, bool now) {
    if (mem_kind(d) == EMU_PAGEABLE) { /* into pageable host memory: done when the call returns */
        deliver_all(es, EMU_BY_HOST);
        std::memmove(d, s, n);
        return;
    }
    /* stream order: the earlier copies that read or write the destination have run before this one */
    uint64_t before = 0;
    for (const emu_copy &c : es->q)
        if (overlaps(c.dst, c.n, d, n) || overlaps(c.src, c.n, d, n)) before = c.seq;
    if (before) deliver(es, before, EMU_BY_STREAM);
    emu_copy c{d, s, n, ++es->issued, {}};
    if (now || mem_kind(s) == EMU_PAGEABLE) c.staged.assign((const unsigned char *)s, (const unsigned char *)s + n);
    es->q.push_back(std::move(c));
    std::memset(d, 0xFF, n);
}
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, enum cudaMemcpyKind, cudaStream_t st) {
    if (!st) return cudaErrorInvalidValue; /* kvbank never uses the legacy default stream */
    if (!n) return cudaSuccess;
    std::lock_guard<std::mutex> g(g_copy_mu);
    enqueue_copy(stream_of(st), d, s, n, false);
    return cudaSuccess;
}

/* cudaMemcpyBatchAsync as CUDA 12.8+ defines it: the batch is one operation of the stream, its copies
 * run in no particular order (here: each deferred and poisoned like a cudaMemcpyAsync, landing when
 * work is ordered after the batch). Checked as the runtime documents it (a valid srcAccessOrder for
 * every copy, attrsIdxs from 0 and rising, not the legacy stream: cudaErrorInvalidValue, which is also
 * the thread's last error, as on the device); two copies of a batch of which one writes bytes the other
 * reads or writes, undefined on a device, abort with a message. KVB_EMU_NO_BATCH=1 makes it return
 * cudaErrorNotSupported (a runtime or driver without it) so that callers' fallbacks run. */
static cudaError_t memcpy_batch(void *const *dsts, const void *const *srcs, const size_t *sizes, size_t count,
                                const struct cudaMemcpyAttributes *attrs, const size_t *idxs, size_t n_attrs,
                                cudaStream_t st) {
    const char *off = std::getenv("KVB_EMU_NO_BATCH");
    if (off && *off && std::strcmp(off, "0")) return g_last = cudaErrorNotSupported;
    if (!st || !count || !dsts || !srcs || !sizes || !attrs || !idxs || !n_attrs || n_attrs > count || idxs[0] != 0)
        return g_last = cudaErrorInvalidValue;
    std::vector<bool> now(count);
    for (size_t k = 0; k < n_attrs; k++) {
        if (k && (idxs[k] <= idxs[k - 1] || idxs[k] >= count)) return g_last = cudaErrorInvalidValue;
        enum cudaMemcpySrcAccessOrder o = attrs[k].srcAccessOrder;
        if (o != cudaMemcpySrcAccessOrderStream && o != cudaMemcpySrcAccessOrderDuringApiCall &&
            o != cudaMemcpySrcAccessOrderAny)
            return g_last = cudaErrorInvalidValue;
        for (size_t i = idxs[k]; i < (k + 1 < n_attrs ? idxs[k + 1] : count); i++)
            now[i] = o != cudaMemcpySrcAccessOrderStream;
    }
    struct span {
        uintptr_t a, b;
        bool dst;
        size_t i;
    };
    std::vector<span> v;
    for (size_t i = 0; i < count; i++)
        if (sizes[i]) {
            v.push_back({(uintptr_t)dsts[i], (uintptr_t)dsts[i] + sizes[i], true, i});
            v.push_back({(uintptr_t)srcs[i], (uintptr_t)srcs[i] + sizes[i], false, i});
        }
    std::sort(v.begin(), v.end(), [](const span &x, const span &y) { return x.a < y.a; });
    uintptr_t end_any = 0, end_dst = 0; /* the furthest end of the spans before, of all, of destinations */
    size_t who_any = 0, who_dst = 0;
    for (const span &x : v) {
        if ((x.dst && x.a < end_any) || x.a < end_dst) {
            std::fprintf(stderr, "emu: cudaMemcpyBatchAsync: copy %zu overlaps copy %zu's destination or source "
                                 "(the copies of a batch run in no order)\n",
                         x.i, x.a < end_dst ? who_dst : who_any);
            std::abort();
        }
        if (x.b > end_any) end_any = x.b, who_any = x.i;
        if (x.dst && x.b > end_dst) end_dst = x.b, who_dst = x.i;
    }
    std::lock_guard<std::mutex> g(g_copy_mu);
    emu_stream *es = stream_of(st);
    for (size_t i = 0; i < count; i++)
        if (sizes[i]) enqueue_copy(es, dsts[i], srcs[i], sizes[i], now[i]);
    return cudaSuccess;
}
#if CUDART_VERSION >= 13000
cudaError_t cudaMemcpyBatchAsync(void *const *dsts, const void *const *srcs, const size_t *sizes, size_t count,
                                 struct cudaMemcpyAttributes *attrs, size_t *idxs, size_t n_attrs, cudaStream_t st) {
    return memcpy_batch(dsts, srcs, sizes, count, attrs, idxs, n_attrs, st);
}
#elif CUDART_VERSION >= 12080
cudaError_t cudaMemcpyBatchAsync(void **dsts, void **srcs, size_t *sizes, size_t count,
                                 struct cudaMemcpyAttributes *attrs, size_t *idxs, size_t n_attrs, size_t *fail_idx,
                                 cudaStream_t st) {
    *fail_idx = SIZE_MAX;
    return memcpy_batch(dsts, srcs, sizes, count, attrs, idxs, n_attrs, st);
}
#endif
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned int) {
    emu_stream *es = new emu_stream;
    std::lock_guard<std::mutex> g(g_copy_mu);
    g_streams.push_back(es);
    *s = (cudaStream_t)es;
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t st) {
    std::lock_guard<std::mutex> g(g_copy_mu);
    deliver_all(stream_of(st), EMU_BY_HOST);
    return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
    std::lock_guard<std::mutex> g(g_copy_mu);
    emu_stream *es = (emu_stream *)s;
    deliver_all(es, EMU_BY_HOST);
    g_streams.erase(std::remove(g_streams.begin(), g_streams.end(), es), g_streams.end());
    delete es;
    return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) {
    std::lock_guard<std::mutex> g(g_copy_mu);
    deliver_all(&g_null_stream, EMU_BY_HOST);
    for (emu_stream *es : g_streams) deliver_all(es, EMU_BY_HOST);
    return cudaSuccess;
}
/* The waiting stream's later work is ordered after the event: its copies land now (work on the waiting
 * stream runs at its calls, which come after this one). */
cudaError_t cudaStreamWaitEvent(cudaStream_t st, cudaEvent_t e, unsigned int) {
    emu_event *ev = (emu_event *)e;
    std::lock_guard<std::mutex> g(g_copy_mu);
    if (ev->s) deliver(ev->s, ev->upto, st ? EMU_BY_STREAM_WAIT : EMU_BY_HOST); /* no stream: the host waits */
    return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned int) {
    *e = (cudaEvent_t)std::calloc(1, sizeof(emu_event));
    return *e ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t st) {
    emu_event *ev = (emu_event *)e;
    clock_gettime(CLOCK_MONOTONIC, &ev->t);
    std::lock_guard<std::mutex> g(g_copy_mu);
    ev->s = stream_of(st);
    ev->upto = ev->s->issued;
    return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) { return cudaStreamWaitEvent(nullptr, e, 0); }
/* a device finishes copies on its own: a query finds the event reached */
cudaError_t cudaEventQuery(cudaEvent_t e) { return cudaStreamWaitEvent(nullptr, e, 0); }
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
    const struct timespec *x = &((const emu_event *)a)->t, *y = &((const emu_event *)b)->t;
    *ms = (float)((y->tv_sec - x->tv_sec) * 1e3 + (y->tv_nsec - x->tv_nsec) * 1e-6);
    return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
    std::free(e);
    return cudaSuccess;
}
/* multiprocessors the emulated device reports (the backend plans decode splits from it): an H200's
 * 132 unless KVB_EMU_SMS says otherwise */
static int emu_sms() {
    const char *e = std::getenv("KVB_EMU_SMS");
    int n = e ? std::atoi(e) : 132;
    return n > 0 ? n : 132;
}
cudaError_t cudaDeviceGetAttribute(int *v, enum cudaDeviceAttr a, int) {
    *v = a == cudaDevAttrMultiProcessorCount ? emu_sms() : 0;
    return cudaSuccess;
}
#undef cudaGetLastError
cudaError_t cudaGetLastError(void) { return emu_last_error(); }
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int d);
cudaError_t cudaGetDeviceProperties_v2(struct cudaDeviceProp *p, int d) { return cudaGetDeviceProperties(p, d); }
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int) {
    std::memset(p, 0, sizeof *p);
    std::snprintf(p->name, sizeof p->name, "kvbank CUDA emulation");
    p->major = 9;
    p->multiProcessorCount = emu_sms();
    p->l2CacheSize = 1 << 20;
    return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t *f, size_t *t) {
    *f = *t = (size_t)1 << 30;
    return cudaSuccess;
}
cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t *h, void *p) {
    std::memset(h, 0, sizeof *h);
    std::memcpy(h, &p, sizeof p);
    return cudaSuccess;
}
cudaError_t cudaIpcOpenMemHandle(void **, cudaIpcMemHandle_t, unsigned int) { return cudaErrorNotSupported; }
cudaError_t cudaIpcCloseMemHandle(void *) { return cudaErrorNotSupported; }

/* ---------------------------------------------------------------- driver API subset (VMM)
 * A reservation is an mmap(PROT_NONE) range; a physical allocation is a memfd; mapping puts the memfd
 * at a fixed address of the range, unmapping puts PROT_NONE back: bytes live with the allocation,
 * as on the device. */
}
#include <cuda.h>
#include <sys/mman.h>
#include <unistd.h>
extern "C" {
static CUresult d_GetErrorString(CUresult, const char **s) {
    *s = "emulated driver error";
    return CUDA_SUCCESS;
}
static CUresult d_DeviceGet(CUdevice *d, int o) {
    *d = o;
    return CUDA_SUCCESS;
}
static CUresult d_DeviceGetAttribute(int *v, CUdevice_attribute a, CUdevice) {
    *v = a == CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED ? 1 : 0;
    return CUDA_SUCCESS;
}
static CUresult d_MemGetAddressRange(CUdeviceptr *b, size_t *s, CUdeviceptr) {
    *b = 0;
    *s = 0;
    return CUDA_ERROR_NOT_SUPPORTED;
}
static const size_t EMU_GRAN = (size_t)2 << 20;
static CUresult d_MemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *, CUmemAllocationGranularity_flags) {
    *g = EMU_GRAN;
    return CUDA_SUCCESS;
}
static CUresult d_MemAddressReserve(CUdeviceptr *p, size_t size, size_t, CUdeviceptr, unsigned long long) {
    if (size % EMU_GRAN) return CUDA_ERROR_INVALID_VALUE;
    void *m = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    *p = (CUdeviceptr)(uintptr_t)m;
    range_add(m, size, EMU_DEVICE);
    return CUDA_SUCCESS;
}
static CUresult d_MemAddressFree(CUdeviceptr p, size_t size) {
    range_del((void *)(uintptr_t)p);
    return munmap((void *)(uintptr_t)p, size) ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}
static CUresult d_MemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *, unsigned long long) {
    if (size % EMU_GRAN) return CUDA_ERROR_INVALID_VALUE;
    int fd = memfd_create("kvb-emu-phys", 0);
    if (fd < 0 || ftruncate(fd, (off_t)size)) return CUDA_ERROR_OUT_OF_MEMORY;
    *h = (CUmemGenericAllocationHandle)fd + 1; /* never 0 */
    return CUDA_SUCCESS;
}
static CUresult d_MemRelease(CUmemGenericAllocationHandle h) {
    return close((int)(h - 1)) ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}
static CUresult d_MemMap(CUdeviceptr p, size_t size, size_t off, CUmemGenericAllocationHandle h, unsigned long long) {
    /* mapped without access until cuMemSetAccess, as on the device */
    void *m = mmap((void *)(uintptr_t)p, size, PROT_NONE, MAP_SHARED | MAP_FIXED, (int)(h - 1), (off_t)off);
    return m == MAP_FAILED ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}
static CUresult d_MemSetAccess(CUdeviceptr p, size_t size, const CUmemAccessDesc *d, size_t n) {
    if (n != 1 || d->flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE) return CUDA_ERROR_INVALID_VALUE;
    return mprotect((void *)(uintptr_t)p, size, PROT_READ | PROT_WRITE) ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}
static CUresult d_MemUnmap(CUdeviceptr p, size_t size) {
    void *m = mmap((void *)(uintptr_t)p, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    return m == MAP_FAILED ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

cudaError_t cudaGetDriverEntryPointByVersion(const char *sym, void **fn, unsigned int, unsigned long long,
                                             enum cudaDriverEntryPointQueryResult *q) {
    static const struct {
        const char *name;
        void *fn;
    } table[] = {{"cuGetErrorString", (void *)d_GetErrorString},
                 {"cuDeviceGet", (void *)d_DeviceGet},
                 {"cuDeviceGetAttribute", (void *)d_DeviceGetAttribute},
                 {"cuMemGetAddressRange", (void *)d_MemGetAddressRange},
                 {"cuMemGetAllocationGranularity", (void *)d_MemGetAllocationGranularity},
                 {"cuMemAddressReserve", (void *)d_MemAddressReserve},
                 {"cuMemAddressFree", (void *)d_MemAddressFree},
                 {"cuMemCreate", (void *)d_MemCreate},
                 {"cuMemRelease", (void *)d_MemRelease},
                 {"cuMemMap", (void *)d_MemMap},
                 {"cuMemUnmap", (void *)d_MemUnmap},
                 {"cuMemSetAccess", (void *)d_MemSetAccess}};
    for (const auto &t : table)
        if (!std::strcmp(t.name, sym)) {
            *fn = t.fn;
            if (q) *q = cudaDriverEntryPointSuccess;
            return cudaSuccess;
        }
    *fn = nullptr;
    if (q) *q = cudaDriverEntryPointSymbolNotFound;
    return cudaErrorNotSupported;
}

/* ---------------------------------------------------------------- cuBLAS subset */

/* a handle holds its stream */
cublasStatus_t cublasCreate_v2(cublasHandle_t *h) {
    *h = (cublasHandle_t)std::calloc(1, sizeof(cudaStream_t));
    return *h ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_ALLOC_FAILED;
}
cublasStatus_t cublasDestroy_v2(cublasHandle_t h) {
    std::free(h);
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream_v2(cublasHandle_t h, cudaStream_t st) {
    *(cudaStream_t *)h = st;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t, void *, size_t) { return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetPointerMode_v2(cublasHandle_t, cublasPointerMode_t) { return CUBLAS_STATUS_SUCCESS; }
const char *cublasGetStatusString(cublasStatus_t) { return "emulated cublas error"; }
const char *cublasGetStatusName(cublasStatus_t) { return "CUBLAS_STATUS_EMULATED"; }

static double load(const void *p, cudaDataType t, size_t i) {
    switch (t) {
    case CUDA_R_16F: return __half2float(((const __half *)p)[i]);
    case CUDA_R_16BF: return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    default: return ((const float *)p)[i];
    }
}
static void store(void *p, cudaDataType t, size_t i, float v) {
    switch (t) {
    case CUDA_R_16F: ((__half *)p)[i] = __float2half_rn(v); break;
    case CUDA_R_16BF: ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v); break;
    default: ((float *)p)[i] = v;
    }
}

/* column-major C[m][n] = alpha op(A) op(B) + beta C, as cuBLAS defines it */
cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const void *alpha, const void *A, cudaDataType at, int lda, const void *B, cudaDataType bt,
                            int ldb, const void *beta, void *C, cudaDataType ct, int ldc, cublasComputeType_t,
                            cublasGemmAlgo_t) {
    stream_begin(*(cudaStream_t *)h);
    float al = *(const float *)alpha, be = *(const float *)beta;
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            double s = 0;
            for (int l = 0; l < k; l++) {
                size_t ia = ta == CUBLAS_OP_N ? (size_t)l * lda + i : (size_t)i * lda + l;
                size_t ib = tb == CUBLAS_OP_N ? (size_t)j * ldb + l : (size_t)l * ldb + j;
                s += load(A, at, ia) * load(B, bt, ib);
            }
            size_t ic = (size_t)j * ldc + i;
            double prev = be != 0.0f ? load(C, ct, ic) : 0.0;
            store(C, ct, ic, (float)(al * s + be * prev));
        }
    return CUBLAS_STATUS_SUCCESS;
}

} // extern "C"
