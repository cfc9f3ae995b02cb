/* limiter.c: the SM-share limiter. A share of a GPU is a share of its time, so the limiter meters
 * device time, not SM counts: that is why it holds its share whatever the number of SMs (HAMi-core's
 * utilisation-to-token mapping barely throttles on big GPUs, #274 #314).
 *
 * Each metered launch is bracketed by two events on its own stream; when they complete, the kernel's
 * device time is known. The budget is a GCRA ("virtual scheduling") clock per device, one int64 in
 * the shared Ledger so all processes of a workload draw on one budget: running for t ns at share s
 * advances the clock by t/s; a launch may start while clock - now <= TAU. An estimate (moving average
 * of measured times) is charged at launch and corrected when the measurement arrives, so the queue
 * cannot run far ahead of the budget. Unlimited devices cost one branch per launch.
 *
 * A graph launch is metered the same way (its events bracket the whole graph), with an estimate of its
 * own per executable graph: a decode step's graph may run a hundred kernels, and charging it a single
 * kernel's estimate would let a burst of graphs far past the budget before the measurements arrive.
 * Work captured into a graph is not metered when captured; it is when the graph runs.
 *
 * Runtime priority (priority.c) works through the same clock: a high-priority process stamps its GPU's
 * priority board at each launch; a low-priority one is metered at PRIORITY_FLOOR_PCT while a stamp is
 * younger than PRIORITY_WINDOW_NS, and at its own share (or unmetered) again after. */
#define _GNU_SOURCE
#include <pthread.h>
#include <string.h>
#include <time.h>

#include "vgpu.h"

#define TAU_NS (10 * 1000000LL)  /* burst tolerance: how far ahead of its budget a workload may run; absorbs
                                    * CPU scheduling delays so the GPU queue does not run dry */
#define RING 32                  /* metered launches in flight per device */
#define MAX_SLEEP_NS (50 * 1000000LL)
#define PRIORITY_POLL_SLEEP_NS (5 * 1000000LL)

typedef struct {
    CUevent start, end;
    CUcontext ctx;
    int64_t charged_ns;
    uint32_t pct;
    uint64_t key;
} pair;

#define GRAPH_ESTIMATES 16 /* executable graphs with an estimate of their own, per device */

typedef struct {
    uint64_t key;   /* 0: kernels; else the executable graph */
    int64_t ns;     /* moving average of measured device time */
    int calibrated; /* measured at least once (the first launch is measured synchronously) */
} estimate_t;

typedef struct {
    pthread_mutex_t mu;
    pair pairs[RING];
    int ring[RING];   /* indices into pairs, in flight, oldest first */
    int head, count;
    int free_list[RING];
    int nfree, npairs;
    estimate_t kernels;
    estimate_t graphs[GRAPH_ESTIMATES];
    int next_graph;
} devstate;

static devstate ds[VGPU_MAX_DEVICES];
static pthread_once_t ds_once = PTHREAD_ONCE_INIT;

static void ds_init(void)
{
    for (int d = 0; d < VGPU_MAX_DEVICES; d++)
        pthread_mutex_init(&ds[d].mu, NULL);
}

static void tat_add(int dev, int64_t ns, uint32_t pct, int from_now)
{
    int64_t *tat = ledger_sm_tat(dev);
    int64_t add = ns * 100 / (int64_t)pct;
    if (!from_now) {
        __atomic_add_fetch(tat, add, __ATOMIC_RELAXED);
        return;
    }
    int64_t floor = vgpu_now_ns() - TAU_NS;
    int64_t old = __atomic_load_n(tat, __ATOMIC_RELAXED), nv;
    do {
        nv = (old > floor ? old : floor) + add;
    } while (!__atomic_compare_exchange_n(tat, &old, nv, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
}

/* Runtime priority (priority.c): a low-priority process meters at PRIORITY_FLOOR_PCT (or its own
 * share, if lower) while a high-priority one launches on the GPU. The clock it ran up at that floor was
 * a penalty, not its budget: when the high-priority one goes idle the clock is pulled back to now, so
 * its own share resumes at once. */
static int yielding[VGPU_MAX_DEVICES];

static uint32_t share_now(int dev, uint32_t limit)
{
    int y = vgpu_cfg.priority == 1 && priority_yield(dev);
    if (y) {
        __atomic_store_n(&yielding[dev], 1, __ATOMIC_RELAXED);
        return limit && limit < PRIORITY_FLOOR_PCT ? limit : PRIORITY_FLOOR_PCT;
    }
    if (__atomic_exchange_n(&yielding[dev], 0, __ATOMIC_RELAXED)) {
        int64_t *tat = ledger_sm_tat(dev), now = vgpu_now_ns();
        int64_t old = __atomic_load_n(tat, __ATOMIC_RELAXED);
        while (old > now && !__atomic_compare_exchange_n(tat, &old, now, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            ;
    }
    return limit;
}

/* waits until the clock lets a launch start; returns the share it starts under (0: unmetered, which a
 * low-priority process without a share of its own is again once the high-priority one idles) */
static uint32_t wait_admission(int dev, uint32_t limit, uint32_t pct)
{
    int64_t *tat = ledger_sm_tat(dev);
    for (;;) {
        int64_t ahead = __atomic_load_n(tat, __ATOMIC_RELAXED) - vgpu_now_ns() - TAU_NS;
        if (ahead <= 0)
            return pct;
        if (ahead > MAX_SLEEP_NS)
            ahead = MAX_SLEEP_NS;
        if (vgpu_cfg.priority == 1 && ahead > PRIORITY_POLL_SLEEP_NS)
            ahead = PRIORITY_POLL_SLEEP_NS; /* a yielding process wakes to see the high one go idle */
        struct timespec ts = {.tv_sec = ahead / 1000000000LL, .tv_nsec = ahead % 1000000000LL};
        nanosleep(&ts, NULL);
        if (vgpu_cfg.priority == 1)
            pct = share_now(dev, limit);
    }
}

/* under d->mu: the moving-average estimate of a kernel (key 0) or of one executable graph; NULL for a
 * graph that no longer has one (`make` 0) */
static estimate_t *estimate(devstate *d, uint64_t key, int make)
{
    if (!key)
        return &d->kernels;
    for (int i = 0; i < GRAPH_ESTIMATES; i++)
        if (d->graphs[i].key == key)
            return &d->graphs[i];
    if (!make)
        return NULL;
    estimate_t *e = &d->graphs[d->next_graph++ % GRAPH_ESTIMATES]; /* the oldest graph gives its place up */
    e->key = key;
    e->ns = 0;
    e->calibrated = 0;
    return e;
}

/* under d->mu: settle the oldest in-flight launch; `wait` blocks until it has run */
static int settle_oldest(int dev, devstate *d, int wait)
{
    if (!d->count)
        return 0;
    int idx = d->ring[d->head];
    pair *p = &d->pairs[idx];
    CUresult q = wait ? vgpu_drv.cuEventSynchronize(p->end) : vgpu_drv.cuEventQuery(p->end);
    if (q == CUDA_ERROR_NOT_READY)
        return 0;
    float ms = 0;
    if (q == CUDA_SUCCESS && vgpu_drv.cuEventElapsedTime(&ms, p->start, p->end) == CUDA_SUCCESS && ms >= 0) {
        int64_t actual = (int64_t)((double)ms * 1e6);
        tat_add(dev, actual - p->charged_ns, p->pct, 0);
        estimate_t *est = estimate(d, p->key, 0);
        if (est) {
            est->ns = est->calibrated ? (7 * est->ns + actual) / 8 : actual;
            est->calibrated = 1;
        }
    }
    d->head = (d->head + 1) % RING;
    d->count--;
    d->free_list[d->nfree++] = idx;
    return 1;
}

static int record(CUevent ev, CUstream s, int ptds)
{
    if (ptds && vgpu_drv.cuEventRecord_ptsz)
        return vgpu_drv.cuEventRecord_ptsz(ev, s);
    return vgpu_drv.cuEventRecord(ev, s);
}

/* under d->mu: an event pair made in the calling thread's context */
static int acquire_pair(devstate *d)
{
    CUcontext ctx = NULL;
    if (!vgpu_drv.cuCtxGetCurrent || vgpu_drv.cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx)
        return -1;
    for (int i = 0; i < d->nfree; i++) {
        int idx = d->free_list[i];
        if (d->pairs[idx].ctx == ctx) {
            d->free_list[i] = d->free_list[--d->nfree];
            return idx;
        }
    }
    int idx;
    if (d->npairs < RING) {
        idx = d->npairs++;
    } else if (d->nfree) {
        idx = d->free_list[--d->nfree]; /* made in another context: remake it here */
        vgpu_drv.cuEventDestroy(d->pairs[idx].start);
        vgpu_drv.cuEventDestroy(d->pairs[idx].end);
    } else {
        return -1;
    }
    pair *p = &d->pairs[idx];
    if (vgpu_drv.cuEventCreate(&p->start, 0) != CUDA_SUCCESS) {
        p->ctx = NULL;
        d->free_list[d->nfree++] = idx;
        return -1;
    }
    if (vgpu_drv.cuEventCreate(&p->end, 0) != CUDA_SUCCESS) {
        vgpu_drv.cuEventDestroy(p->start);
        p->ctx = NULL;
        d->free_list[d->nfree++] = idx;
        return -1;
    }
    p->ctx = ctx;
    return idx;
}

static int metering_available(void)
{
    return vgpu_drv.cuEventCreate && vgpu_drv.cuEventDestroy && vgpu_drv.cuEventRecord && vgpu_drv.cuEventQuery &&
           vgpu_drv.cuEventSynchronize && vgpu_drv.cuEventElapsedTime && vgpu_drv.cuCtxGetCurrent;
}

int limiter_begin(vgpu_launch *l, CUstream stream, int ptds, uint64_t key)
{
    int prio = vgpu_cfg.priority;
    if ((!ledger_any_sm_limit() && prio < 0) || !vgpu_ready())
        return 0;
    int dev = vgpu_current_device();
    if (dev < 0)
        return 0;
    uint32_t limit = ledger_sm_limit(dev);
    uint32_t pct = prio == 1 ? share_now(dev, limit) : limit;
    if (!pct && prio != 0)
        return 0;
    /* work captured into a graph does not run now; recording events there would break the capture */
    if (vgpu_capturing(stream, ptds))
        return 0;
    if (prio == 0)
        priority_launched(dev); /* high priority: low-priority claims on this GPU see it launch */
    if (!pct || !metering_available())
        return 0;
    pthread_once(&ds_once, ds_init);
    devstate *d = &ds[dev];
    pthread_mutex_lock(&d->mu);
    while (settle_oldest(dev, d, 0))
        ;
    pthread_mutex_unlock(&d->mu);
    pct = wait_admission(dev, limit, pct);
    if (!pct)
        return 0;
    l->dev = dev;
    l->ptds = ptds;
    l->pct = pct;
    l->stream = stream;
    l->key = key;
    pthread_mutex_lock(&d->mu);
    if (d->count == RING)
        settle_oldest(dev, d, 1);
    l->pair = acquire_pair(d);
    if (l->pair >= 0 && record(d->pairs[l->pair].start, stream, ptds) != CUDA_SUCCESS) {
        d->free_list[d->nfree++] = l->pair;
        l->pair = -1;
    }
    pthread_mutex_unlock(&d->mu);
    return 1;
}

void limiter_end(vgpu_launch *l, CUresult r)
{
    devstate *d = &ds[l->dev];
    pthread_mutex_lock(&d->mu);
    if (r != CUDA_SUCCESS) {
        if (l->pair >= 0)
            d->free_list[d->nfree++] = l->pair;
        pthread_mutex_unlock(&d->mu);
        return;
    }
    estimate_t *e = estimate(d, l->key, 1);
    int64_t est = e->ns;
    tat_add(l->dev, est, l->pct, 1);
    if (l->pair >= 0) {
        pair *p = &d->pairs[l->pair];
        if (record(p->end, l->stream, l->ptds) != CUDA_SUCCESS) {
            d->free_list[d->nfree++] = l->pair;
        } else {
            p->charged_ns = est;
            p->pct = l->pct;
            p->key = l->key;
            d->ring[(d->head + d->count) % RING] = l->pair;
            d->count++;
            if (!e->calibrated) {
                /* the first launch (of each graph) is measured at once, so no estimate is zero for long */
                while (d->count)
                    settle_oldest(l->dev, d, 1);
                e->calibrated = 1;
            }
        }
    }
    pthread_mutex_unlock(&d->mu);
}

/* ---- wrappers ------------------------------------------------------------------------------ */

#define LAUNCH_WRAPPER(sym, ptds, stream_expr, args, ...)                                            \
    VGPU_EXPORT CUresult sym(__VA_ARGS__)                                                            \
    {                                                                                                \
        VGPU_ENTER(sym);                                                                             \
        vgpu_launch l;                                                                               \
        if (!limiter_begin(&l, (stream_expr), ptds, 0))                                              \
            return REAL(sym) args;                                                                   \
        CUresult r = REAL(sym) args;                                                                 \
        limiter_end(&l, r);                                                                          \
        return r;                                                                                    \
    }

#define KARGS (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams, extra)
#define CARGS (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams)
LAUNCH_WRAPPER(cuLaunchKernel, 0, hStream, KARGS, TESSERA_LAUNCH_ARGS, void **kernelParams, void **extra)
LAUNCH_WRAPPER(cuLaunchKernel_ptsz, 1, hStream, KARGS, TESSERA_LAUNCH_ARGS, void **kernelParams, void **extra)
LAUNCH_WRAPPER(cuLaunchCooperativeKernel, 0, hStream, CARGS, TESSERA_LAUNCH_ARGS, void **kernelParams)
LAUNCH_WRAPPER(cuLaunchCooperativeKernel_ptsz, 1, hStream, CARGS, TESSERA_LAUNCH_ARGS, void **kernelParams)

VGPU_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra)
{
    VGPU_ENTER(cuLaunchKernelEx);
    vgpu_launch l;
    if (!config || !limiter_begin(&l, config->hStream, 0, 0))
        return REAL(cuLaunchKernelEx)(config, f, kernelParams, extra);
    CUresult r = REAL(cuLaunchKernelEx)(config, f, kernelParams, extra);
    limiter_end(&l, r);
    return r;
}

VGPU_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra)
{
    VGPU_ENTER(cuLaunchKernelEx_ptsz);
    vgpu_launch l;
    if (!config || !limiter_begin(&l, config->hStream, 1, 0))
        return REAL(cuLaunchKernelEx_ptsz)(config, f, kernelParams, extra);
    CUresult r = REAL(cuLaunchKernelEx_ptsz)(config, f, kernelParams, extra);
    limiter_end(&l, r);
    return r;
}

void limiter_fork_prepare(void)
{
    pthread_once(&ds_once, ds_init);
    for (int d = 0; d < VGPU_MAX_DEVICES; d++)
        pthread_mutex_lock(&ds[d].mu);
}
void limiter_fork_parent(void)
{
    for (int d = 0; d < VGPU_MAX_DEVICES; d++)
        pthread_mutex_unlock(&ds[d].mu);
}
void limiter_fork_child(void)
{
    /* the parent's events belong to its contexts, which the child cannot use */
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
        ds[d].head = ds[d].count = ds[d].nfree = ds[d].npairs = 0;
        memset(&ds[d].kernels, 0, sizeof ds[d].kernels);
        memset(ds[d].graphs, 0, sizeof ds[d].graphs);
        pthread_mutex_unlock(&ds[d].mu);
    }
}
