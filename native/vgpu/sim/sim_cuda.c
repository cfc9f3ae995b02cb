/* sim_cuda.c: a simulated CUDA driver (libcuda.so.1) so that libvgpu's every hook runs in CI without a
 * GPU. It keeps device allocations in host memory (reserved, not committed, so large limits cost
 * nothing), implements contexts, streams, events, memory pools, virtual memory management, arrays and
 * cuGetProcAddress with the driver's versioned names, and simulates kernels on a per-device timeline:
 * each launch occupies the device for TESSERA_SIM_KERNEL_US of device time, and synchronisation
 * sleeps until the timeline catches up. Device memory, including what contexts and loaded modules take,
 * is counted on the simulated card (sim_common.c), which processes share when TESSERA_SIM_CARD names a
 * file; kernel timelines are per process. Graphs and stream capture are in sim_graph.c.
 * Argument checks return the error codes the real driver documents. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "cuda_api.h"
#include "sim_common.h"
#include "sim_cuda.h"

#define GRANULARITY (2ULL << 20)

static sim_device_config cfg;
static int initialized;
static pthread_once_t cfg_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

struct CUevent_st { int magic; int recorded; int64_t ts; };
struct CUmod_st { int magic; int dev; uint64_t bytes; };
struct CUarray_st { int magic; };
struct CUmipmappedArray_st { int magic; };
/* A memory pool keeps what its allocations gave back (reserved) until a synchronisation releases what
 * is above its release threshold (default 0), or cuMemPoolTrimTo; the card counts what it reserves. */
struct CUmemPoolHandle_st {
    int magic, dev;
    uint64_t reserved, in_use, threshold, reserved_high, used_high;
    struct CUmemPoolHandle_st *next;
};
static struct CUctx_st primary[SIM_MAX_DEVICES];
static int primary_refs[SIM_MAX_DEVICES];
static struct CUmemPoolHandle_st default_pool[SIM_MAX_DEVICES];
static __thread struct CUctx_st *current;
static uint64_t used[SIM_MAX_DEVICES];
static int64_t busy_until[SIM_MAX_DEVICES];
static int live_allocations;

/* ---- registry of what the sim handed out -------------------------------------------------- */
enum { R_PTR = 1, R_HANDLE, R_MAPPING, R_ARRAY, R_MIPMAP, R_RESERVE };
typedef struct rec {
    int kind, dev, mapcount, released;
    uint64_t key, size, aux;
    struct rec *next;
} rec;
#define NB 4096
static rec *table[NB];

static unsigned hb(int kind, uint64_t key) { return (unsigned)(((key ^ ((uint64_t)kind << 56)) * 0x9E3779B97F4A7C15ULL) >> 52) & (NB - 1); }
static rec **rfind(int kind, uint64_t key)
{
    rec **pp = &table[hb(kind, key)];
    while (*pp && !((*pp)->kind == kind && (*pp)->key == key))
        pp = &(*pp)->next;
    return pp;
}
static rec *radd(int kind, uint64_t key, int dev, uint64_t size)
{
    rec *r = calloc(1, sizeof *r);
    r->kind = kind;
    r->key = key;
    r->dev = dev;
    r->size = size;
    r->next = table[hb(kind, key)];
    table[hb(kind, key)] = r;
    return r;
}
static void rdel(rec **pp)
{
    rec *r = *pp;
    *pp = r->next;
    free(r);
}

static void load_cfg(void)
{
    sim_config_load(&cfg);
    sim_card_open(&cfg);
}

/* Device memory taken and given back: this process's allocations (the tests' probe) and the card. */
static int take(int dev, uint64_t size)
{
    if (sim_card_take(dev, size, cfg.memory))
        return -1;
    used[dev] += size;
    return 0;
}
static void give(int dev, uint64_t size)
{
    used[dev] -= size;
    sim_card_give(dev, size);
}
static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}
static void sleep_until(int64_t t)
{
    struct timespec ts = {.tv_sec = t / 1000000000LL, .tv_nsec = t % 1000000000LL};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
        ;
}

#define NEED_INIT() do { if (!initialized) return CUDA_ERROR_NOT_INITIALIZED; } while (0)
#define NEED_CTX() do { NEED_INIT(); if (!current) return CUDA_ERROR_INVALID_CONTEXT; } while (0)

/* sim-only introspection for the tests */
CUAPI uint64_t tessera_sim_memory_used(int dev) { return dev >= 0 && dev < SIM_MAX_DEVICES ? used[dev] : 0; }
/* everything on the card: every sharing process's allocations, contexts, modules and graph memory */
CUAPI uint64_t tessera_sim_card_used(int dev)
{
    pthread_once(&cfg_once, load_cfg);
    return dev >= 0 && dev < SIM_MAX_DEVICES ? sim_card_used(dev) : 0;
}
CUAPI int tessera_sim_live_allocations(void) { return live_allocations; }

/* ---- initialisation, devices, contexts ----------------------------------------------------- */

CUAPI CUresult cuInit(unsigned int flags)
{
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_once(&cfg_once, load_cfg);
    if (cfg.count == 0)
        return 100; /* CUDA_ERROR_NO_DEVICE */
    pthread_mutex_lock(&mu);
    for (int i = 0; i < SIM_MAX_DEVICES; i++) {
        primary[i].magic = MAGIC;
        primary[i].dev = i;
        default_pool[i].magic = MAGIC;
        default_pool[i].dev = i;
    }
    initialized = 1;
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDriverGetVersion(int *version)
{
    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_once(&cfg_once, load_cfg);
    *version = cfg.driver_version;
    return CUDA_SUCCESS;
}

#define CHECK_DEV(d) do { NEED_INIT(); if ((d) < 0 || (d) >= cfg.count) return CUDA_ERROR_INVALID_DEVICE; } while (0)

CUAPI CUresult cuDeviceGet(CUdevice *dev, int ordinal)
{
    if (!dev)
        return CUDA_ERROR_INVALID_VALUE;
    CHECK_DEV(ordinal);
    *dev = ordinal;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDeviceGetCount(int *count)
{
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    NEED_INIT();
    *count = cfg.count;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    CHECK_DEV(dev);
    snprintf(name, (size_t)len, "%s", cfg.name);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
    if (!uuid)
        return CUDA_ERROR_INVALID_VALUE;
    CHECK_DEV(dev);
    *uuid = cfg.uuid[dev];
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) { return cuDeviceGetUuid(uuid, dev); }

CUAPI CUresult cuDeviceGetAttribute(int *value, int attrib, CUdevice dev)
{
    if (!value)
        return CUDA_ERROR_INVALID_VALUE;
    CHECK_DEV(dev);
    switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *value = cfg.sm_count; break;
    case 75: *value = 9; break; /* compute capability major */
    case 76: *value = 0; break; /* minor */
    default: *value = 0; break;
    }
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    CHECK_DEV(dev);
    *bytes = cfg.memory;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)
{
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    CHECK_DEV(dev);
    *bytes = cfg.memory > 0xffffffffULL ? 0xffffffffU : (unsigned int)cfg.memory;
    return CUDA_SUCCESS;
}

/* A context takes TESSERA_SIM_CONTEXT_MIB of the card while it exists (the primary one while retained). */
static CUresult context_memory(int dev)
{
    if (!cfg.context_bytes)
        return CUDA_SUCCESS;
    return sim_card_take(dev, cfg.context_bytes, cfg.memory) ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS;
}

CUAPI CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned int flags, CUdevice dev)
{
    (void)flags;
    if (!ctx)
        return CUDA_ERROR_INVALID_VALUE;
    CHECK_DEV(dev);
    if (context_memory(dev) != CUDA_SUCCESS)
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct CUctx_st *c = calloc(1, sizeof *c);
    c->magic = MAGIC;
    c->dev = dev;
    current = c;
    *ctx = c;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    NEED_INIT();
    if (!ctx || ctx->magic != MAGIC)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (current == ctx)
        current = NULL;
    if (ctx < primary || ctx >= primary + SIM_MAX_DEVICES) {
        if (cfg.context_bytes)
            sim_card_give(ctx->dev, cfg.context_bytes);
        ctx->magic = 0;
        free(ctx);
    }
    return CUDA_SUCCESS;
}

CUAPI CUresult cuCtxCreate_v3(CUcontext *ctx, CUexecAffinityParam *params, int numParams, unsigned int flags,
                              CUdevice dev)
{
    if (numParams < 0 || (numParams > 0 && !params))
        return CUDA_ERROR_INVALID_VALUE;
    return cuCtxCreate_v2(ctx, flags, dev);
}

CUAPI CUresult cuCtxCreate_v4(CUcontext *ctx, CUctxCreateParams *params, unsigned int flags, CUdevice dev)
{
    (void)params;
    return cuCtxCreate_v2(ctx, flags, dev);
}

CUAPI CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev)
{
    if (!ctx)
        return CUDA_ERROR_INVALID_VALUE;
    CHECK_DEV(dev);
    pthread_mutex_lock(&mu);
    CUresult r = primary_refs[dev] ? CUDA_SUCCESS : context_memory(dev);
    if (r == CUDA_SUCCESS) {
        primary_refs[dev]++;
        *ctx = &primary[dev];
    }
    pthread_mutex_unlock(&mu);
    return r;
}

CUAPI CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    CHECK_DEV(dev);
    pthread_mutex_lock(&mu);
    CUresult r = CUDA_SUCCESS;
    if (!primary_refs[dev])
        r = CUDA_ERROR_INVALID_CONTEXT; /* released more often than retained */
    else if (!--primary_refs[dev] && cfg.context_bytes)
        sim_card_give(dev, cfg.context_bytes);
    pthread_mutex_unlock(&mu);
    return r;
}

CUAPI CUresult cuCtxSetCurrent(CUcontext ctx)
{
    NEED_INIT();
    if (ctx && ctx->magic != MAGIC)
        return CUDA_ERROR_INVALID_CONTEXT;
    current = ctx;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuCtxGetCurrent(CUcontext *ctx)
{
    if (!ctx)
        return CUDA_ERROR_INVALID_VALUE;
    NEED_INIT();
    *ctx = current;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuCtxGetDevice(CUdevice *dev)
{
    if (!dev)
        return CUDA_ERROR_INVALID_VALUE;
    NEED_CTX();
    *dev = current->dev;
    return CUDA_SUCCESS;
}

static int64_t device_busy_until(int dev)
{
    pthread_mutex_lock(&mu);
    int64_t t = busy_until[dev];
    pthread_mutex_unlock(&mu);
    return t;
}

static void pools_synchronized(void);

CUAPI CUresult cuCtxSynchronize(void)
{
    NEED_CTX();
    sleep_until(device_busy_until(current->dev));
    pools_synchronized();
    return CUDA_SUCCESS;
}

static const char *error_name(CUresult e)
{
    switch (e) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case CUDA_ERROR_INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
    case CUDA_ERROR_NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
    case CUDA_ERROR_NOT_READY: return "CUDA_ERROR_NOT_READY";
    case CUDA_ERROR_NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    default: return NULL;
    }
}

CUAPI CUresult cuGetErrorName(CUresult error, const char **str)
{
    if (!str)
        return CUDA_ERROR_INVALID_VALUE;
    *str = error_name(error);
    return *str ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUAPI CUresult cuGetErrorString(CUresult error, const char **str)
{
    if (!str)
        return CUDA_ERROR_INVALID_VALUE;
    switch (error) {
    case CUDA_SUCCESS: *str = "no error"; break;
    case CUDA_ERROR_INVALID_VALUE: *str = "invalid argument"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *str = "out of memory"; break;
    case CUDA_ERROR_NOT_INITIALIZED: *str = "initialization error"; break;
    case CUDA_ERROR_INVALID_DEVICE: *str = "invalid device ordinal"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *str = "invalid device context"; break;
    case CUDA_ERROR_INVALID_HANDLE: *str = "invalid resource handle"; break;
    case CUDA_ERROR_NOT_FOUND: *str = "named symbol not found"; break;
    case CUDA_ERROR_NOT_READY: *str = "device not ready"; break;
    case CUDA_ERROR_NOT_SUPPORTED: *str = "operation not supported"; break;
    default: *str = NULL; return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

/* ---- memory ---------------------------------------------------------------------------------- */

/* under mu */
static CUresult sim_alloc(int dev, uint64_t size, int low, uint64_t *out)
{
    if (take(dev, size))
        return CUDA_ERROR_OUT_OF_MEMORY;
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | (low ? MAP_32BIT : 0), -1, 0);
    if (p == MAP_FAILED) {
        give(dev, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    live_allocations++;
    radd(R_PTR, (uint64_t)(uintptr_t)p, dev, size);
    *out = (uint64_t)(uintptr_t)p;
    return CUDA_SUCCESS;
}

static CUresult alloc_common(uint64_t *out, uint64_t size, int dev, int low)
{
    if (size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    CUresult r = sim_alloc(dev, size, low, out);
    pthread_mutex_unlock(&mu);
    return r;
}

static struct CUmemPoolHandle_st *pools; /* created pools (the default ones are default_pool[]) */

/* under mu: a stream-ordered allocation from `pool`: the card gives only what the pool lacks */
static CUresult pool_alloc(struct CUmemPoolHandle_st *pool, uint64_t size, uint64_t *out)
{
    uint64_t need = pool->in_use + size > pool->reserved ? pool->in_use + size - pool->reserved : 0;
    if (need && sim_card_take(pool->dev, need, cfg.memory))
        return CUDA_ERROR_OUT_OF_MEMORY;
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        if (need)
            sim_card_give(pool->dev, need);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pool->reserved += need;
    pool->in_use += size;
    pool->reserved_high = pool->reserved > pool->reserved_high ? pool->reserved : pool->reserved_high;
    pool->used_high = pool->in_use > pool->used_high ? pool->in_use : pool->used_high;
    used[pool->dev] += size;
    live_allocations++;
    rec *r = radd(R_PTR, (uint64_t)(uintptr_t)p, pool->dev, size);
    r->aux = (uint64_t)(uintptr_t)pool;
    *out = (uint64_t)(uintptr_t)p;
    return CUDA_SUCCESS;
}

/* under mu: give back to the card what the pool holds beyond its allocations and `keep` */
static void pool_release(struct CUmemPoolHandle_st *pool, uint64_t keep)
{
    uint64_t floor = pool->in_use > keep ? pool->in_use : keep;
    if (pool->reserved > floor) {
        sim_card_give(pool->dev, pool->reserved - floor);
        pool->reserved = floor;
    }
}

/* a synchronisation: every pool releases what is above its threshold */
static void pools_synchronized(void)
{
    pthread_mutex_lock(&mu);
    for (int d = 0; d < SIM_MAX_DEVICES; d++)
        pool_release(&default_pool[d], default_pool[d].threshold);
    for (struct CUmemPoolHandle_st *p = pools; p; p = p->next)
        pool_release(p, p->threshold);
    pthread_mutex_unlock(&mu);
}

static CUresult free_common(uint64_t ptr)
{
    NEED_INIT();
    if (!ptr)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    rec **pp = rfind(R_PTR, ptr);
    if (!*pp) {
        pthread_mutex_unlock(&mu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct CUmemPoolHandle_st *pool = (struct CUmemPoolHandle_st *)(uintptr_t)(*pp)->aux;
    if (pool) { /* back to its pool, which keeps the memory */
        pool->in_use -= (*pp)->size;
        used[(*pp)->dev] -= (*pp)->size;
    } else {
        give((*pp)->dev, (*pp)->size);
    }
    munmap((void *)(uintptr_t)ptr, (*pp)->size);
    live_allocations--;
    rdel(pp);
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    if (!dptr)
        return CUDA_ERROR_INVALID_VALUE;
    NEED_CTX();
    uint64_t p;
    CUresult r = alloc_common(&p, bytesize, current->dev, 0);
    if (r == CUDA_SUCCESS)
        *dptr = p;
    return r;
}

CUAPI CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize)
{
    if (!dptr)
        return CUDA_ERROR_INVALID_VALUE;
    NEED_CTX();
    uint64_t p;
    CUresult r = alloc_common(&p, bytesize, current->dev, 1);
    if (r == CUDA_SUCCESS)
        *dptr = (CUdeviceptr_v1)p;
    return r;
}

CUAPI CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned int elementSize)
{
    if (!dptr || !pitch || !width || !height || (elementSize != 4 && elementSize != 8 && elementSize != 16))
        return CUDA_ERROR_INVALID_VALUE;
    NEED_CTX();
    size_t pt = (width + 511) & ~(size_t)511;
    uint64_t p;
    CUresult r = alloc_common(&p, (uint64_t)pt * height, current->dev, 0);
    if (r == CUDA_SUCCESS) {
        *dptr = p;
        *pitch = pt;
    }
    return r;
}

CUAPI CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pitch, unsigned int width, unsigned int height,
                               unsigned int elementSize)
{
    if (!dptr || !pitch || !width || !height || (elementSize != 4 && elementSize != 8 && elementSize != 16))
        return CUDA_ERROR_INVALID_VALUE;
    NEED_CTX();
    unsigned int pt = (width + 511) & ~511U;
    uint64_t p;
    CUresult r = alloc_common(&p, (uint64_t)pt * height, current->dev, 1);
    if (r == CUDA_SUCCESS) {
        *dptr = (CUdeviceptr_v1)p;
        *pitch = pt;
    }
    return r;
}

CUAPI CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    if (!dptr || (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST))
        return CUDA_ERROR_INVALID_VALUE;
    NEED_CTX();
    uint64_t p;
    CUresult r = alloc_common(&p, bytesize, current->dev, 0);
    if (r == CUDA_SUCCESS)
        *dptr = p;
    return r;
}

CUAPI CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream stream)
{
    if (!dptr)
        return CUDA_ERROR_INVALID_VALUE;
    NEED_CTX();
    CUgraph g = sim_capturing(stream);
    if (g) /* captured: a memory node, whose memory the graph takes when it runs */
        return bytesize ? sim_capture_alloc(g, current->dev, bytesize, dptr) : CUDA_ERROR_INVALID_VALUE;
    if (!bytesize)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t p;
    pthread_mutex_lock(&mu);
    CUresult r = pool_alloc(&default_pool[current->dev], bytesize, &p);
    pthread_mutex_unlock(&mu);
    if (r == CUDA_SUCCESS)
        *dptr = p;
    return r;
}
CUAPI CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream stream)
{
    return cuMemAllocAsync(dptr, bytesize, stream);
}

CUAPI CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream stream)
{
    (void)stream;
    if (!dptr || !pool || pool->magic != MAGIC || !bytesize)
        return CUDA_ERROR_INVALID_VALUE;
    NEED_CTX();
    uint64_t p;
    pthread_mutex_lock(&mu);
    CUresult r = pool_alloc(pool, bytesize, &p);
    pthread_mutex_unlock(&mu);
    if (r == CUDA_SUCCESS)
        *dptr = p;
    return r;
}
CUAPI CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream stream)
{
    return cuMemAllocFromPoolAsync(dptr, bytesize, pool, stream);
}

CUAPI CUresult cuMemFree_v2(CUdeviceptr dptr) { return free_common(dptr); }
CUAPI CUresult cuMemFree(CUdeviceptr_v1 dptr) { return free_common(dptr); }
CUAPI CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream stream)
{
    CUgraph g = sim_capturing(stream);
    return g ? sim_capture_free(g, dptr) : free_common(dptr);
}
CUAPI CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream) { return cuMemFreeAsync(dptr, stream); }

CUAPI CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
    if (!free_bytes || !total_bytes)
        return CUDA_ERROR_INVALID_VALUE;
    NEED_CTX();
    pthread_mutex_lock(&mu);
    *total_bytes = cfg.memory;
    uint64_t on_card = sim_card_used(current->dev);
    *free_bytes = on_card >= cfg.memory ? 0 : cfg.memory - on_card;
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemGetInfo(unsigned int *free_bytes, unsigned int *total_bytes)
{
    size_t f, t;
    if (!free_bytes || !total_bytes)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = cuMemGetInfo_v2(&f, &t);
    if (r == CUDA_SUCCESS) {
        *free_bytes = f > 0xffffffffULL ? 0xffffffffU : (unsigned int)f;
        *total_bytes = t > 0xffffffffULL ? 0xffffffffU : (unsigned int)t;
    }
    return r;
}

CUAPI CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    if (!pool || !props || props->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    CHECK_DEV(props->location.id);
    struct CUmemPoolHandle_st *p = calloc(1, sizeof *p);
    p->magic = MAGIC;
    p->dev = props->location.id;
    pthread_mutex_lock(&mu);
    p->next = pools;
    pools = p;
    pthread_mutex_unlock(&mu);
    *pool = p;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    if (!pool || pool->magic != MAGIC)
        return CUDA_ERROR_INVALID_VALUE;
    if (pool < default_pool || pool >= default_pool + SIM_MAX_DEVICES) {
        pthread_mutex_lock(&mu);
        pool_release(pool, 0);
        for (struct CUmemPoolHandle_st **pp = &pools; *pp; pp = &(*pp)->next)
            if (*pp == pool) {
                *pp = pool->next;
                break;
            }
        pthread_mutex_unlock(&mu);
        if (pool->in_use) /* the driver frees it once its allocations are freed; the sim keeps it */
            return CUDA_SUCCESS;
        pool->magic = 0;
        free(pool);
    }
    return CUDA_SUCCESS;
}

/* the sim has no cuDeviceSetMemPool: a device's current pool is its default one */
CUAPI CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev) { return cuDeviceGetDefaultMemPool(pool, dev); }

CUAPI CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)
{
    if (!pool || pool->magic != MAGIC)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    pool_release(pool, minBytesToKeep);
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value)
{
    if (!pool || pool->magic != MAGIC || !value)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    CUresult r = CUDA_SUCCESS;
    switch (attr) {
    case 1: case 2: case 3: *(int *)value = 1; break; /* the reuse policies: all allowed */
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: *(cuuint64_t *)value = pool->threshold; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: *(cuuint64_t *)value = pool->reserved; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: *(cuuint64_t *)value = pool->reserved_high; break;
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: *(cuuint64_t *)value = pool->in_use; break;
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH: *(cuuint64_t *)value = pool->used_high; break;
    default: r = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&mu);
    return r;
}

CUAPI CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value)
{
    if (!pool || pool->magic != MAGIC || !value)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    CUresult r = CUDA_SUCCESS;
    switch (attr) {
    case 1: case 2: case 3: break;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: pool->threshold = *(cuuint64_t *)value; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH: /* only a reset to 0 */
        if (*(cuuint64_t *)value)
            r = CUDA_ERROR_INVALID_VALUE;
        else if (attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)
            pool->reserved_high = pool->reserved;
        else
            pool->used_high = pool->in_use;
        break;
    default: r = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&mu);
    return r;
}

CUAPI CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev)
{
    if (!pool)
        return CUDA_ERROR_INVALID_VALUE;
    CHECK_DEV(dev);
    *pool = &default_pool[dev];
    return CUDA_SUCCESS;
}

/* virtual memory management: physical memory lives until released AND unmapped, as on the driver */
CUAPI CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop, int option)
{
    (void)option;
    if (!granularity || !prop)
        return CUDA_ERROR_INVALID_VALUE;
    *granularity = GRANULARITY;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                           unsigned long long flags)
{
    if (!handle || !prop || flags != 0 || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || size == 0 ||
        size % GRANULARITY)
        return CUDA_ERROR_INVALID_VALUE;
    CHECK_DEV(prop->location.id);
    int dev = prop->location.id;
    pthread_mutex_lock(&mu);
    if (take(dev, size)) {
        pthread_mutex_unlock(&mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    static uint64_t next_handle = 0x1000;
    uint64_t h = next_handle++;
    radd(R_HANDLE, h, dev, size);
    live_allocations++;
    pthread_mutex_unlock(&mu);
    *handle = h;
    return CUDA_SUCCESS;
}

/* under mu */
static void handle_maybe_free(rec **hp)
{
    rec *h = *hp;
    if (h->released && h->mapcount <= 0) {
        give(h->dev, h->size);
        live_allocations--;
        rdel(hp);
    }
}

CUAPI CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    NEED_INIT();
    pthread_mutex_lock(&mu);
    rec **hp = rfind(R_HANDLE, handle);
    if (!*hp || (*hp)->released) {
        pthread_mutex_unlock(&mu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    (*hp)->released = 1;
    handle_maybe_free(hp);
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                   unsigned long long flags)
{
    (void)alignment; (void)addr; (void)flags;
    if (!ptr || size == 0 || size % GRANULARITY)
        return CUDA_ERROR_INVALID_VALUE;
    NEED_INIT();
    void *p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&mu);
    radd(R_RESERVE, (uint64_t)(uintptr_t)p, 0, size);
    pthread_mutex_unlock(&mu);
    *ptr = (uint64_t)(uintptr_t)p;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    NEED_INIT();
    pthread_mutex_lock(&mu);
    rec **pp = rfind(R_RESERVE, ptr);
    if (!*pp || (*pp)->size != size) {
        pthread_mutex_unlock(&mu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    munmap((void *)(uintptr_t)ptr, size);
    rdel(pp);
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                        unsigned long long flags)
{
    if (!ptr || !size || offset || flags)
        return CUDA_ERROR_INVALID_VALUE;
    NEED_INIT();
    pthread_mutex_lock(&mu);
    rec **hp = rfind(R_HANDLE, handle);
    if (!*hp || (*hp)->released || (*hp)->size != size || *rfind(R_MAPPING, ptr)) {
        pthread_mutex_unlock(&mu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    (*hp)->mapcount++;
    rec *m = radd(R_MAPPING, ptr, (*hp)->dev, size);
    m->aux = handle;
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    if (!ptr || !size)
        return CUDA_ERROR_INVALID_VALUE;
    NEED_INIT();
    pthread_mutex_lock(&mu);
    if (!*rfind(R_MAPPING, ptr)) {
        pthread_mutex_unlock(&mu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    uint64_t p = ptr, end = ptr + size;
    while (p < end) {
        rec **mp = rfind(R_MAPPING, p);
        if (!*mp)
            break;
        uint64_t msize = (*mp)->size, h = (*mp)->aux;
        rdel(mp);
        rec **hp = rfind(R_HANDLE, h);
        if (*hp) {
            (*hp)->mapcount--;
            handle_maybe_free(hp);
        }
        p += msize;
    }
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

/* arrays: sized as width * height * depth * element size * channels */
static uint64_t fmt_bytes(CUarray_format f)
{
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8: case CU_AD_FORMAT_SIGNED_INT8: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16: case CU_AD_FORMAT_SIGNED_INT16: case CU_AD_FORMAT_HALF: return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32: case CU_AD_FORMAT_SIGNED_INT32: case CU_AD_FORMAT_FLOAT: return 4;
    default: return 0;
    }
}

static CUresult array_create(int kind, void **out, uint64_t w, uint64_t h, uint64_t d, CUarray_format f,
                             unsigned int ch, unsigned int levels)
{
    if (!w || !fmt_bytes(f) || (ch != 1 && ch != 2 && ch != 4))
        return CUDA_ERROR_INVALID_VALUE;
    NEED_CTX();
    uint64_t size = 0;
    for (unsigned int l = 0; l < levels; l++) {
        uint64_t lw = w >> l, lh = h >> l, ld = d >> l;
        size += (lw ? lw : 1) * (h ? (lh ? lh : 1) : 1) * (d ? (ld ? ld : 1) : 1) * fmt_bytes(f) * ch;
    }
    pthread_mutex_lock(&mu);
    int dev = current->dev;
    if (take(dev, size)) {
        pthread_mutex_unlock(&mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    void *a = calloc(1, 16);
    ((int *)a)[0] = MAGIC;
    radd(kind, (uint64_t)(uintptr_t)a, dev, size);
    live_allocations++;
    pthread_mutex_unlock(&mu);
    *out = a;
    return CUDA_SUCCESS;
}

static CUresult array_destroy(int kind, void *a)
{
    NEED_INIT();
    if (!a)
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&mu);
    rec **pp = rfind(kind, (uint64_t)(uintptr_t)a);
    if (!*pp) {
        pthread_mutex_unlock(&mu);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    give((*pp)->dev, (*pp)->size);
    live_allocations--;
    rdel(pp);
    free(a);
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuArrayCreate_v2(CUarray *arr, const CUDA_ARRAY_DESCRIPTOR *d)
{
    if (!arr || !d)
        return CUDA_ERROR_INVALID_VALUE;
    return array_create(R_ARRAY, (void **)arr, d->Width, d->Height, 0, d->Format, d->NumChannels, 1);
}
CUAPI CUresult cuArrayCreate(CUarray *arr, const CUDA_ARRAY_DESCRIPTOR_v1 *d)
{
    if (!arr || !d)
        return CUDA_ERROR_INVALID_VALUE;
    return array_create(R_ARRAY, (void **)arr, d->Width, d->Height, 0, d->Format, d->NumChannels, 1);
}
CUAPI CUresult cuArray3DCreate_v2(CUarray *arr, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    if (!arr || !d)
        return CUDA_ERROR_INVALID_VALUE;
    return array_create(R_ARRAY, (void **)arr, d->Width, d->Height, d->Depth, d->Format, d->NumChannels, 1);
}
CUAPI CUresult cuArray3DCreate(CUarray *arr, const CUDA_ARRAY3D_DESCRIPTOR_v1 *d)
{
    if (!arr || !d)
        return CUDA_ERROR_INVALID_VALUE;
    return array_create(R_ARRAY, (void **)arr, d->Width, d->Height, d->Depth, d->Format, d->NumChannels, 1);
}
CUAPI CUresult cuArrayDestroy(CUarray arr) { return array_destroy(R_ARRAY, arr); }
CUAPI CUresult cuMipmappedArrayCreate(CUmipmappedArray *arr, const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned int numLevels)
{
    if (!arr || !d || !numLevels || numLevels > 32)
        return CUDA_ERROR_INVALID_VALUE;
    return array_create(R_MIPMAP, (void **)arr, d->Width, d->Height, d->Depth, d->Format, d->NumChannels, numLevels);
}
CUAPI CUresult cuMipmappedArrayDestroy(CUmipmappedArray arr) { return array_destroy(R_MIPMAP, arr); }

/* ---- modules, launches, streams, events ---------------------------------------------------- */

static struct CUfunc_st the_function = {MAGIC};

/* A loaded module takes TESSERA_SIM_MODULE_KIB of the card (its code and data) until unloaded. */
CUAPI CUresult cuModuleLoadData(CUmodule *mod, const void *image)
{
    if (!mod || !image)
        return CUDA_ERROR_INVALID_VALUE;
    NEED_CTX();
    int dev = current->dev;
    if (cfg.module_bytes && sim_card_take(dev, cfg.module_bytes, cfg.memory))
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct CUmod_st *m = calloc(1, sizeof *m);
    m->magic = MAGIC;
    m->dev = dev;
    m->bytes = cfg.module_bytes;
    *mod = m;
    return CUDA_SUCCESS;
}
CUAPI CUresult cuModuleLoadDataEx(CUmodule *mod, const void *image, unsigned int numOptions, int *options,
                                  void **optionValues)
{
    if (numOptions && (!options || !optionValues))
        return CUDA_ERROR_INVALID_VALUE;
    return cuModuleLoadData(mod, image);
}
CUAPI CUresult cuModuleLoad(CUmodule *mod, const char *fname)
{
    if (!fname)
        return CUDA_ERROR_INVALID_VALUE;
    return cuModuleLoadData(mod, fname);
}
CUAPI CUresult cuModuleUnload(CUmodule mod)
{
    NEED_INIT();
    if (!mod || mod->magic != MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    if (mod->bytes)
        sim_card_give(mod->dev, mod->bytes);
    mod->magic = 0;
    free(mod);
    return CUDA_SUCCESS;
}
CUAPI CUresult cuModuleGetFunction(CUfunction *fn, CUmodule mod, const char *name)
{
    if (!fn || !name)
        return CUDA_ERROR_INVALID_VALUE;
    NEED_CTX();
    if (!mod || mod->magic != MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    *fn = &the_function;
    return CUDA_SUCCESS;
}

/* ---- what the graph module (sim_graph.c) uses ----------------------------------------------- */

CUresult sim_current_device(int *dev)
{
    NEED_CTX();
    *dev = current->dev;
    return CUDA_SUCCESS;
}
int sim_device_count(void) { return cfg.count; }
void sim_run_kernels(int dev, int64_t kernels)
{
    pthread_mutex_lock(&mu);
    int64_t now = now_ns(), start = busy_until[dev] > now ? busy_until[dev] : now;
    busy_until[dev] = start + kernels * cfg.kernel_ns;
    pthread_mutex_unlock(&mu);
}
int sim_take(int dev, uint64_t bytes) { return sim_card_take(dev, bytes, cfg.memory); }
void sim_give(int dev, uint64_t bytes) { sim_card_give(dev, bytes); }
int sim_function_ok(CUfunction f) { return f && f->magic == MAGIC; }
CUgraph sim_capturing(CUstream stream)
{
    if (!stream || stream == CU_STREAM_LEGACY || stream == CU_STREAM_PER_THREAD || stream->magic != MAGIC)
        return NULL;
    return stream->capture;
}

/* a launch on a stream being captured becomes a kernel node of the capture's graph */
static CUresult launch(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                       unsigned int by, unsigned int bz, CUstream stream)
{
    NEED_CTX();
    if (!f || f->magic != MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!gx || !gy || !gz || !bx || !by || !bz || (uint64_t)bx * by * bz > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    CUgraph g = sim_capturing(stream);
    if (g) {
        const unsigned int dims[6] = {gx, gy, gz, bx, by, bz};
        return sim_capture_kernel(g, f, dims);
    }
    sim_run_kernels(current->dev, 1);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuLaunchKernel(TESSERA_LAUNCH_ARGS, void **kernelParams, void **extra)
{
    (void)sharedMemBytes; (void)kernelParams; (void)extra;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream);
}
CUAPI CUresult cuLaunchKernel_ptsz(TESSERA_LAUNCH_ARGS, void **kernelParams, void **extra)
{
    return cuLaunchKernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,
                          kernelParams, extra);
}
CUAPI CUresult cuLaunchCooperativeKernel(TESSERA_LAUNCH_ARGS, void **kernelParams)
{
    return cuLaunchKernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,
                          kernelParams, NULL);
}
CUAPI CUresult cuLaunchCooperativeKernel_ptsz(TESSERA_LAUNCH_ARGS, void **kernelParams)
{
    return cuLaunchCooperativeKernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                                     sharedMemBytes, hStream, kernelParams);
}
CUAPI CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **kernelParams, void **extra)
{
    (void)kernelParams; (void)extra;
    if (!c)
        return CUDA_ERROR_INVALID_VALUE;
    return launch(f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY, c->blockDimZ, c->hStream);
}
CUAPI CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *c, CUfunction f, void **kernelParams, void **extra)
{
    return cuLaunchKernelEx(c, f, kernelParams, extra);
}

CUAPI CUresult cuStreamCreate(CUstream *stream, unsigned int flags)
{
    (void)flags;
    if (!stream)
        return CUDA_ERROR_INVALID_VALUE;
    NEED_CTX();
    struct CUstream_st *s = calloc(1, sizeof *s);
    s->magic = MAGIC;
    *stream = s;
    return CUDA_SUCCESS;
}
CUAPI CUresult cuStreamDestroy_v2(CUstream stream)
{
    NEED_INIT();
    if (!stream || stream == CU_STREAM_LEGACY || stream == CU_STREAM_PER_THREAD || stream->magic != MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    if (stream->capture)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    stream->magic = 0;
    free(stream);
    return CUDA_SUCCESS;
}
/* all streams of a device share its timeline in the sim */
CUAPI CUresult cuStreamSynchronize(CUstream stream)
{
    (void)stream;
    NEED_CTX();
    sleep_until(device_busy_until(current->dev));
    pools_synchronized();
    return CUDA_SUCCESS;
}
CUAPI CUresult cuStreamSynchronize_ptsz(CUstream stream) { return cuStreamSynchronize(stream); }
CUAPI CUresult cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus *status)
{
    if (!status)
        return CUDA_ERROR_INVALID_VALUE;
    NEED_CTX();
    *status = sim_capturing(stream) ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
}
CUAPI CUresult cuStreamIsCapturing_ptsz(CUstream stream, CUstreamCaptureStatus *status)
{
    return cuStreamIsCapturing(stream, status);
}

CUAPI CUresult cuEventCreate(CUevent *ev, unsigned int flags)
{
    (void)flags;
    if (!ev)
        return CUDA_ERROR_INVALID_VALUE;
    NEED_CTX();
    struct CUevent_st *e = calloc(1, sizeof *e);
    e->magic = MAGIC;
    *ev = e;
    return CUDA_SUCCESS;
}
CUAPI CUresult cuEventDestroy_v2(CUevent ev)
{
    NEED_INIT();
    if (!ev || ev->magic != MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    ev->magic = 0;
    free(ev);
    return CUDA_SUCCESS;
}
CUAPI CUresult cuEventRecord(CUevent ev, CUstream stream)
{
    (void)stream;
    NEED_CTX();
    if (!ev || ev->magic != MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&mu);
    int64_t now = now_ns(), b = busy_until[current->dev];
    ev->ts = b > now ? b : now;
    ev->recorded = 1;
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}
CUAPI CUresult cuEventRecord_ptsz(CUevent ev, CUstream stream) { return cuEventRecord(ev, stream); }
CUAPI CUresult cuEventQuery(CUevent ev)
{
    NEED_INIT();
    if (!ev || ev->magic != MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    return !ev->recorded || now_ns() >= ev->ts ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}
CUAPI CUresult cuEventSynchronize(CUevent ev)
{
    NEED_INIT();
    if (!ev || ev->magic != MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    if (ev->recorded)
        sleep_until(ev->ts);
    return CUDA_SUCCESS;
}
CUAPI CUresult cuEventElapsedTime(float *ms, CUevent start, CUevent end)
{
    if (!ms)
        return CUDA_ERROR_INVALID_VALUE;
    NEED_INIT();
    if (!start || !end || start->magic != MAGIC || end->magic != MAGIC || !start->recorded || !end->recorded)
        return CUDA_ERROR_INVALID_HANDLE;
    int64_t now = now_ns();
    if (now < start->ts || now < end->ts)
        return CUDA_ERROR_NOT_READY;
    *ms = (float)((double)(end->ts - start->ts) / 1e6);
    return CUDA_SUCCESS;
}
CUAPI CUresult cuEventElapsedTime_v2(float *ms, CUevent start, CUevent end) { return cuEventElapsedTime(ms, start, end); }

/* ---- cuGetProcAddress: the driver's versioned names ----------------------------------------- */

/* Distinct addresses for a few entry points, handed out when TESSERA_SIM_PROCADDR_INTERNAL=1: some
 * drivers answer cuGetProcAddress with internal addresses rather than their exported symbols. */
static CUresult internal_cuMemAlloc_v2(CUdeviceptr *d, size_t n) { return cuMemAlloc_v2(d, n); }
static CUresult internal_cuMemFree_v2(CUdeviceptr d) { return cuMemFree_v2(d); }
static CUresult internal_cuMemGetInfo_v2(size_t *f, size_t *t) { return cuMemGetInfo_v2(f, t); }
static CUresult internal_cuLaunchKernel(TESSERA_LAUNCH_ARGS, void **kernelParams, void **extra)
{
    return cuLaunchKernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,
                          kernelParams, extra);
}
static CUresult internal_cuGetProcAddress_v2(const char *s, void **p, int v, cuuint64_t fl, CUdriverProcAddressQueryResult *st)
{
    return cuGetProcAddress_v2(s, p, v, fl, st);
}

typedef struct { const char *base, *sym; int since, ptds; void *fn, *internal; } proc_entry;
#define E(base, sym, since, ptds) {#base, #sym, since, ptds, (void *)&sym, NULL}
#define EI(base, sym, since, ptds) {#base, #sym, since, ptds, (void *)&sym, (void *)&internal_##sym}
static const proc_entry procs[] = {
    E(cuInit, cuInit, 2000, 0), E(cuDriverGetVersion, cuDriverGetVersion, 2020, 0),
    E(cuDeviceGet, cuDeviceGet, 2000, 0), E(cuDeviceGetCount, cuDeviceGetCount, 2000, 0),
    E(cuDeviceGetName, cuDeviceGetName, 2000, 0), E(cuDeviceGetUuid, cuDeviceGetUuid, 9020, 0),
    E(cuDeviceGetUuid, cuDeviceGetUuid_v2, 11040, 0), E(cuDeviceGetAttribute, cuDeviceGetAttribute, 2000, 0),
    E(cuDeviceTotalMem, cuDeviceTotalMem, 2000, 0), E(cuDeviceTotalMem, cuDeviceTotalMem_v2, 3020, 0),
    E(cuCtxCreate, cuCtxCreate_v2, 3020, 0), E(cuCtxCreate, cuCtxCreate_v3, 11040, 0),
    E(cuCtxCreate, cuCtxCreate_v4, 12050, 0), E(cuCtxDestroy, cuCtxDestroy_v2, 4000, 0),
    E(cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain, 7000, 0),
    E(cuDevicePrimaryCtxRelease, cuDevicePrimaryCtxRelease_v2, 11000, 0),
    E(cuCtxSetCurrent, cuCtxSetCurrent, 4000, 0), E(cuCtxGetCurrent, cuCtxGetCurrent, 4000, 0),
    E(cuCtxGetDevice, cuCtxGetDevice, 2000, 0), E(cuCtxSynchronize, cuCtxSynchronize, 2000, 0),
    E(cuGetErrorString, cuGetErrorString, 6000, 0), E(cuGetErrorName, cuGetErrorName, 6000, 0),
    E(cuGetProcAddress, cuGetProcAddress, 11030, 0), EI(cuGetProcAddress, cuGetProcAddress_v2, 12000, 0),
    E(cuMemAlloc, cuMemAlloc, 2000, 0), EI(cuMemAlloc, cuMemAlloc_v2, 3020, 0),
    E(cuMemAllocPitch, cuMemAllocPitch, 2000, 0), E(cuMemAllocPitch, cuMemAllocPitch_v2, 3020, 0),
    E(cuMemAllocManaged, cuMemAllocManaged, 6000, 0),
    E(cuMemAllocAsync, cuMemAllocAsync, 11020, 0), E(cuMemAllocAsync, cuMemAllocAsync_ptsz, 11020, 1),
    E(cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync, 11020, 0),
    E(cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync_ptsz, 11020, 1),
    E(cuMemFree, cuMemFree, 2000, 0), EI(cuMemFree, cuMemFree_v2, 3020, 0),
    E(cuMemFreeAsync, cuMemFreeAsync, 11020, 0), E(cuMemFreeAsync, cuMemFreeAsync_ptsz, 11020, 1),
    E(cuMemGetInfo, cuMemGetInfo, 2000, 0), EI(cuMemGetInfo, cuMemGetInfo_v2, 3020, 0),
    E(cuMemPoolCreate, cuMemPoolCreate, 11020, 0), E(cuMemPoolDestroy, cuMemPoolDestroy, 11020, 0),
    E(cuDeviceGetDefaultMemPool, cuDeviceGetDefaultMemPool, 11020, 0),
    E(cuDeviceGetMemPool, cuDeviceGetMemPool, 11020, 0), E(cuMemPoolTrimTo, cuMemPoolTrimTo, 11020, 0),
    E(cuMemPoolGetAttribute, cuMemPoolGetAttribute, 11020, 0),
    E(cuMemPoolSetAttribute, cuMemPoolSetAttribute, 11020, 0),
    E(cuMemCreate, cuMemCreate, 10020, 0), E(cuMemRelease, cuMemRelease, 10020, 0),
    E(cuMemMap, cuMemMap, 10020, 0), E(cuMemUnmap, cuMemUnmap, 10020, 0),
    E(cuMemAddressReserve, cuMemAddressReserve, 10020, 0), E(cuMemAddressFree, cuMemAddressFree, 10020, 0),
    E(cuMemGetAllocationGranularity, cuMemGetAllocationGranularity, 10020, 0),
    E(cuArrayCreate, cuArrayCreate, 2000, 0), E(cuArrayCreate, cuArrayCreate_v2, 3020, 0),
    E(cuArray3DCreate, cuArray3DCreate, 2000, 0), E(cuArray3DCreate, cuArray3DCreate_v2, 3020, 0),
    E(cuArrayDestroy, cuArrayDestroy, 2000, 0),
    E(cuMipmappedArrayCreate, cuMipmappedArrayCreate, 5000, 0),
    E(cuMipmappedArrayDestroy, cuMipmappedArrayDestroy, 5000, 0),
    E(cuModuleLoadData, cuModuleLoadData, 2000, 0), E(cuModuleLoadDataEx, cuModuleLoadDataEx, 2010, 0),
    E(cuModuleLoad, cuModuleLoad, 2000, 0), E(cuModuleUnload, cuModuleUnload, 2000, 0),
    E(cuModuleGetFunction, cuModuleGetFunction, 2000, 0),
    EI(cuLaunchKernel, cuLaunchKernel, 4000, 0), E(cuLaunchKernel, cuLaunchKernel_ptsz, 7000, 1),
    E(cuLaunchKernelEx, cuLaunchKernelEx, 11060, 0), E(cuLaunchKernelEx, cuLaunchKernelEx_ptsz, 11060, 1),
    E(cuLaunchCooperativeKernel, cuLaunchCooperativeKernel, 9000, 0),
    E(cuLaunchCooperativeKernel, cuLaunchCooperativeKernel_ptsz, 9000, 1),
    E(cuStreamCreate, cuStreamCreate, 2000, 0), E(cuStreamDestroy, cuStreamDestroy_v2, 4000, 0),
    E(cuStreamSynchronize, cuStreamSynchronize, 2000, 0), E(cuStreamSynchronize, cuStreamSynchronize_ptsz, 7000, 1),
    E(cuStreamIsCapturing, cuStreamIsCapturing, 10000, 0), E(cuStreamIsCapturing, cuStreamIsCapturing_ptsz, 10000, 1),
    E(cuStreamBeginCapture, cuStreamBeginCapture_v2, 10010, 0),
    E(cuStreamBeginCapture, cuStreamBeginCapture_v2_ptsz, 10010, 1),
    E(cuStreamEndCapture, cuStreamEndCapture, 10000, 0), E(cuStreamEndCapture, cuStreamEndCapture_ptsz, 10000, 1),
    E(cuGraphCreate, cuGraphCreate, 10000, 0), E(cuGraphDestroy, cuGraphDestroy, 10000, 0),
    E(cuGraphAddKernelNode, cuGraphAddKernelNode, 10000, 0), E(cuGraphAddKernelNode, cuGraphAddKernelNode_v2, 12000, 0),
    E(cuGraphAddMemAllocNode, cuGraphAddMemAllocNode, 11040, 0),
    E(cuGraphAddMemFreeNode, cuGraphAddMemFreeNode, 11040, 0),
    E(cuGraphGetNodes, cuGraphGetNodes, 10000, 0), E(cuGraphNodeGetType, cuGraphNodeGetType, 10000, 0),
    E(cuGraphMemAllocNodeGetParams, cuGraphMemAllocNodeGetParams, 11040, 0),
    E(cuGraphInstantiate, cuGraphInstantiate, 10000, 0), E(cuGraphInstantiate, cuGraphInstantiate_v2, 11000, 0),
    E(cuGraphInstantiate, cuGraphInstantiateWithFlags, 12000, 0),
    E(cuGraphInstantiateWithFlags, cuGraphInstantiateWithFlags, 11040, 0),
    E(cuGraphInstantiateWithParams, cuGraphInstantiateWithParams, 12000, 0),
    E(cuGraphInstantiateWithParams, cuGraphInstantiateWithParams_ptsz, 12000, 1),
    E(cuGraphLaunch, cuGraphLaunch, 10000, 0), E(cuGraphLaunch, cuGraphLaunch_ptsz, 10000, 1),
    E(cuGraphExecKernelNodeSetParams, cuGraphExecKernelNodeSetParams, 10010, 0),
    E(cuGraphExecKernelNodeSetParams, cuGraphExecKernelNodeSetParams_v2, 12000, 0),
    E(cuGraphExecUpdate, cuGraphExecUpdate, 10020, 0), E(cuGraphExecUpdate, cuGraphExecUpdate_v2, 12000, 0),
    E(cuGraphExecDestroy, cuGraphExecDestroy, 10000, 0), E(cuDeviceGraphMemTrim, cuDeviceGraphMemTrim, 11040, 0),
    E(cuEventCreate, cuEventCreate, 2000, 0), E(cuEventDestroy, cuEventDestroy_v2, 4000, 0),
    E(cuEventRecord, cuEventRecord, 2000, 0), E(cuEventRecord, cuEventRecord_ptsz, 7000, 1),
    E(cuEventQuery, cuEventQuery, 2000, 0), E(cuEventSynchronize, cuEventSynchronize, 2000, 0),
    E(cuEventElapsedTime, cuEventElapsedTime, 2000, 0), E(cuEventElapsedTime, cuEventElapsedTime_v2, 12080, 0),
};
#define NPROCS (sizeof procs / sizeof procs[0])

CUAPI void *tessera_sim_symbol(const char *name)
{
    for (size_t i = 0; i < NPROCS; i++)
        if (!strcmp(procs[i].sym, name))
            return procs[i].fn;
    return NULL;
}

CUAPI CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                   CUdriverProcAddressQueryResult *status)
{
    if (!symbol || !pfn)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_once(&cfg_once, load_cfg);
    int want_ptds = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    const proc_entry *best = NULL;
    int base_known = 0;
    for (size_t i = 0; i < NPROCS; i++) {
        const proc_entry *e = &procs[i];
        if (strcmp(e->base, symbol))
            continue;
        base_known = 1;
        if (e->since > cudaVersion || (e->ptds && !want_ptds))
            continue;
        if (!best || e->since > best->since || (e->since == best->since && e->ptds == want_ptds))
            best = e;
    }
    *pfn = NULL;
    if (!best) {
        if (status)
            *status = base_known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    *pfn = cfg.procaddr_internal && best->internal ? best->internal : best->fn;
    if (status)
        *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    return cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, NULL);
}
