/* hooks_pool.c: what memory pools keep. A stream-ordered free (cuMemFreeAsync) gives the memory back
 * to its pool, not to the card: the pool keeps it up to its release threshold (PyTorch's cudaMallocAsync
 * backend sets that to "everything") until a synchronisation or cuMemPoolTrimTo. Returning the charge
 * at the free let a claim's pools hold memory its limit no longer counted.
 *
 * So each pool this process allocated from is charged what it reserves beyond what its allocations use
 * (the driver's CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT minus USED_MEM_CURRENT), settled against the
 * driver's figures at every stream-ordered allocation and free, at the queries, and when a charge
 * would otherwise be refused. A stream-ordered allocation is charged only for what the pool's kept
 * memory does not cover, since the pool hands that out again. */
#include <pthread.h>

#include "vgpu.h"

#define MAX_POOLS 64

typedef struct {
    CUmemoryPool pool;
    int dev;         /* the Ledger's slot the pool's memory is charged to */
    uint64_t kept;   /* charged: reserved beyond what its allocations use */
} pool_charge;

static pool_charge pools[MAX_POOLS];
static int npools;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

/* fork: the child's pools are not the parent's (and its slot in the Ledger starts empty) */
void pools_fork_prepare(void) { pthread_mutex_lock(&mu); }
void pools_fork_parent(void) { pthread_mutex_unlock(&mu); }
void pools_fork_child(void)
{
    npools = 0;
    pthread_mutex_unlock(&mu);
}

static int driver_figures(CUmemoryPool pool, uint64_t *kept)
{
    cuuint64_t reserved = 0, in_use = 0;
    if (!vgpu_drv.cuMemPoolGetAttribute ||
        vgpu_drv.cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved) != CUDA_SUCCESS ||
        vgpu_drv.cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &in_use) != CUDA_SUCCESS)
        return -1;
    *kept = reserved > in_use ? reserved - in_use : 0;
    return 0;
}

/* under mu */
static pool_charge *find(CUmemoryPool pool, int dev, int make)
{
    for (int i = 0; i < npools; i++)
        if (pools[i].pool == pool)
            return &pools[i];
    if (!make || npools == MAX_POOLS)
        return NULL;
    pools[npools] = (pool_charge){pool, dev, 0};
    return &pools[__atomic_add_fetch(&npools, 1, __ATOMIC_RELEASE) - 1];
}

/* under mu: the charge follows the driver's figure (a charge over the limit is kept at what fits:
 * the next allocation is refused either way) */
static void settle(pool_charge *p)
{
    uint64_t kept;
    if (driver_figures(p->pool, &kept))
        return;
    if (kept < p->kept) {
        ledger_release(p->dev, p->kept - kept);
        p->kept = kept;
    } else if (kept > p->kept && !ledger_reserve(p->dev, kept - p->kept)) {
        p->kept = kept;
    }
}

void vgpu_pools_settle(void)
{
    if (!__atomic_load_n(&npools, __ATOMIC_ACQUIRE))
        return;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < npools; i++)
        settle(&pools[i]);
    pthread_mutex_unlock(&mu);
}

/* the pool a cuMemAllocAsync on the current context's device draws from */
static CUmemoryPool current_pool(void)
{
    CUdevice d;
    CUmemoryPool pool = NULL;
    if (!vgpu_drv.cuCtxGetDevice || vgpu_drv.cuCtxGetDevice(&d) != CUDA_SUCCESS || !vgpu_drv.cuDeviceGetMemPool ||
        vgpu_drv.cuDeviceGetMemPool(&pool, d) != CUDA_SUCCESS)
        return NULL;
    return pool;
}

/* Charge a stream-ordered allocation of `bytes` from `pool`: what the pool keeps covers part of it.
 * Returns 0 and the part newly charged in *charged, or -1 (over the limit: nothing charged). */
static int charge(CUmemoryPool pool, int dev, uint64_t bytes, uint64_t *charged, uint64_t *covered)
{
    pthread_mutex_lock(&mu);
    pool_charge *p = pool ? find(pool, dev, 1) : NULL;
    *covered = 0;
    if (p) {
        settle(p);
        *covered = p->kept < bytes ? p->kept : bytes;
        p->kept -= *covered;
    }
    *charged = bytes - *covered;
    int r = 0;
    if (*charged && ledger_reserve(dev, *charged)) {
        if (p)
            p->kept += *covered;
        r = -1;
    }
    pthread_mutex_unlock(&mu);
    return r;
}

static void uncharge(CUmemoryPool pool, int dev, uint64_t charged, uint64_t covered)
{
    pthread_mutex_lock(&mu);
    pool_charge *p = pool ? find(pool, dev, 0) : NULL;
    if (p)
        p->kept += covered;
    else if (covered)
        ledger_release(dev, covered);
    if (charged)
        ledger_release(dev, charged);
    if (p)
        settle(p);
    pthread_mutex_unlock(&mu);
}

static void settled(CUmemoryPool pool, int dev)
{
    pthread_mutex_lock(&mu);
    pool_charge *p = pool ? find(pool, dev, 0) : NULL;
    if (p)
        settle(p);
    pthread_mutex_unlock(&mu);
}

/* `pool_expr` is NULL for the current device's pool; `ptds` for the capture check */
#define POOL_ALLOC_WRAPPER(sym, ptds, pool_expr, call_args, ...)                                     \
    VGPU_EXPORT CUresult sym(CUdeviceptr *dptr, size_t bytesize, __VA_ARGS__)                         \
    {                                                                                                \
        VGPU_ENTER(sym);                                                                             \
        int dev;                                                                                     \
        if (!dptr || bytesize == 0 || vgpu_capturing(stream, ptds) || (dev = vgpu_current_device()) == -1) \
            return REAL(sym) call_args;                                                              \
        CUmemoryPool p = (pool_expr) ? (pool_expr) : current_pool();                                 \
        uint64_t charged, covered;                                                                   \
        if (charge(p, dev, bytesize, &charged, &covered))                                            \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                         \
        CUresult r = REAL(sym) call_args;                                                            \
        if (r == CUDA_SUCCESS) {                                                                     \
            allocs_put(ALLOC_PTR, (uint64_t)*dptr, dev, bytesize);                                   \
            settled(p, dev);                                                                         \
        } else {                                                                                     \
            uncharge(p, dev, charged, covered);                                                      \
        }                                                                                            \
        return r;                                                                                    \
    }

POOL_ALLOC_WRAPPER(cuMemAllocAsync, 0, (CUmemoryPool)NULL, (dptr, bytesize, stream), CUstream stream)
POOL_ALLOC_WRAPPER(cuMemAllocAsync_ptsz, 1, (CUmemoryPool)NULL, (dptr, bytesize, stream), CUstream stream)
POOL_ALLOC_WRAPPER(cuMemAllocFromPoolAsync, 0, pool, (dptr, bytesize, pool, stream), CUmemoryPool pool,
                   CUstream stream)
POOL_ALLOC_WRAPPER(cuMemAllocFromPoolAsync_ptsz, 1, pool, (dptr, bytesize, pool, stream), CUmemoryPool pool,
                   CUstream stream)
