/* hooks_ctx.c: device memory that no allocation call names, charged to the claim. A CUDA context
 * takes hundreds of MiB on an H100/H200 and loaded modules take their code and data; a claim whose
 * limit counts only cuMemAlloc lets ten processes of one claim push the card past what the claims add
 * up to, and a neighbour's allocation inside its own limit then fails.
 *
 * - Contexts: the driver does not tell a process what its context took, so each costs the declared
 *   CUDA_DEVICE_CONTEXT_OVERHEAD (the node's figure for the GPU model; every source can only raise
 *   it), charged before the driver is asked (over the limit: CUDA_ERROR_OUT_OF_MEMORY, no context
 *   made). The primary context is charged once per process and device while it is retained. A GPU
 *   outside the claim's list (rule 4) gets its contexts uncharged, as before: its allocations are
 *   what is refused there.
 * - Modules: measured, as the change of the driver's own free memory across the load (a neighbour's
 *   allocation in that instant is charged to us: the error leans towards the claim paying more).
 *   Past the limit the module is unloaded again and the load fails with CUDA_ERROR_OUT_OF_MEMORY. */
#include <pthread.h>

#include "vgpu.h"

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int primary_refs[VGPU_MAX_DEVICES];

/* fork: the child has none of the parent's contexts (and its own, empty, slot in the Ledger) */
void ctx_fork_prepare(void) { pthread_mutex_lock(&mu); }
void ctx_fork_parent(void) { pthread_mutex_unlock(&mu); }
void ctx_fork_child(void)
{
    for (int d = 0; d < VGPU_MAX_DEVICES; d++)
        primary_refs[d] = 0;
    pthread_mutex_unlock(&mu);
}

static uint64_t overhead(int slot) { return slot >= 0 && slot < VGPU_MAX_DEVICES ? vgpu_cfg.ctx_overhead[slot] : 0; }

/* the Ledger's slot of a CUDA ordinal for a context about to be made, or -1 to account nothing */
static int context_slot(CUdevice dev)
{
    if (dev < 0 || dev >= VGPU_MAX_DEVICES)
        return -1;
    vgpu_note_device(dev);
    int slot = vgpu_device_slot(dev);
    return slot < 0 ? -1 : slot;
}

VGPU_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev)
{
    VGPU_ENTER(cuDevicePrimaryCtxRetain);
    int slot = ctx ? context_slot(dev) : -1;
    if (slot == -1 || !overhead(slot))
        return REAL(cuDevicePrimaryCtxRetain)(ctx, dev);
    pthread_mutex_lock(&mu); /* held across the call: retain counts and charges move together */
    uint64_t bytes = !primary_refs[dev] ? overhead(slot) : 0;
    CUresult r;
    if (bytes && ledger_reserve(slot, bytes)) {
        r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        r = REAL(cuDevicePrimaryCtxRetain)(ctx, dev);
        if (r == CUDA_SUCCESS)
            primary_refs[dev]++;
        else if (bytes)
            ledger_release(slot, bytes);
    }
    pthread_mutex_unlock(&mu);
    return r;
}

VGPU_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    VGPU_ENTER(cuDevicePrimaryCtxRelease_v2);
    pthread_mutex_lock(&mu);
    CUresult r = REAL(cuDevicePrimaryCtxRelease_v2)(dev);
    if (r == CUDA_SUCCESS && dev >= 0 && dev < VGPU_MAX_DEVICES && primary_refs[dev] && !--primary_refs[dev]) {
        int slot = vgpu_device_slot(dev);
        if (slot >= 0 && overhead(slot))
            ledger_release(slot, overhead(slot));
    }
    pthread_mutex_unlock(&mu);
    return r;
}

/* cuCtxCreate in all its ABIs: charge, create, remember the charge by the context made */
#define CTX_CREATE_WRAPPER(sym, call_args, ...)                                                      \
    VGPU_EXPORT CUresult sym(CUcontext *ctx, __VA_ARGS__, CUdevice dev)                              \
    {                                                                                                \
        VGPU_ENTER(sym);                                                                             \
        int slot = ctx ? context_slot(dev) : -1;                                                     \
        uint64_t bytes = slot >= 0 ? overhead(slot) : 0;                                             \
        if (!bytes)                                                                                  \
            return REAL(sym) call_args;                                                              \
        if (ledger_reserve(slot, bytes))                                                             \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                         \
        CUresult r = REAL(sym) call_args;                                                            \
        if (r == CUDA_SUCCESS)                                                                       \
            allocs_put(ALLOC_CONTEXT, (uint64_t)(uintptr_t)*ctx, slot, bytes);                       \
        else                                                                                         \
            ledger_release(slot, bytes);                                                             \
        return r;                                                                                    \
    }

CTX_CREATE_WRAPPER(cuCtxCreate_v2, (ctx, flags, dev), unsigned int flags)
CTX_CREATE_WRAPPER(cuCtxCreate_v3, (ctx, params, numParams, flags, dev), CUexecAffinityParam *params, int numParams,
                   unsigned int flags)
CTX_CREATE_WRAPPER(cuCtxCreate_v4, (ctx, params, flags, dev), CUctxCreateParams *params, unsigned int flags)

VGPU_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    VGPU_ENTER(cuCtxDestroy_v2);
    CUresult r = REAL(cuCtxDestroy_v2)(ctx);
    int slot;
    uint64_t bytes;
    if (r == CUDA_SUCCESS && allocs_take(ALLOC_CONTEXT, (uint64_t)(uintptr_t)ctx, &slot, &bytes))
        ledger_release(slot, bytes);
    return r;
}

/* ---- modules: measured around the load -------------------------------------------------------- */

static uint64_t driver_free(void)
{
    size_t f = 0, t = 0;
    return REAL(cuMemGetInfo_v2) && REAL(cuMemGetInfo_v2)(&f, &t) == CUDA_SUCCESS ? f : 0;
}

static CUresult loaded(CUresult r, CUmodule *mod, int dev, uint64_t before)
{
    if (r != CUDA_SUCCESS || dev == -1)
        return r;
    uint64_t after = driver_free(), bytes = before > after ? before - after : 0;
    if (!bytes)
        return r;
    if (ledger_reserve(dev, bytes)) {
        if (REAL(cuModuleUnload))
            REAL(cuModuleUnload)(*mod);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    allocs_put(ALLOC_MODULE, (uint64_t)(uintptr_t)*mod, dev, bytes);
    return r;
}

#define MODULE_LOAD_WRAPPER(sym, call_args, ...)                                                     \
    VGPU_EXPORT CUresult sym(CUmodule *mod, __VA_ARGS__)                                             \
    {                                                                                                \
        VGPU_ENTER(sym);                                                                             \
        int dev = mod ? vgpu_current_device() : -1;                                                  \
        if (dev < 0)                                                                                 \
            dev = -1;                                                                                \
        uint64_t before = dev == -1 ? 0 : driver_free();                                             \
        return loaded(REAL(sym) call_args, mod, dev, before);                                        \
    }

MODULE_LOAD_WRAPPER(cuModuleLoad, (mod, fname), const char *fname)
MODULE_LOAD_WRAPPER(cuModuleLoadData, (mod, image), const void *image)
MODULE_LOAD_WRAPPER(cuModuleLoadDataEx, (mod, image, numOptions, options, optionValues), const void *image,
                    unsigned int numOptions, int *options, void **optionValues)

VGPU_EXPORT CUresult cuModuleUnload(CUmodule mod)
{
    VGPU_ENTER(cuModuleUnload);
    CUresult r = REAL(cuModuleUnload)(mod);
    int dev;
    uint64_t bytes;
    if (r == CUDA_SUCCESS && allocs_take(ALLOC_MODULE, (uint64_t)(uintptr_t)mod, &dev, &bytes))
        ledger_release(dev, bytes);
    return r;
}
