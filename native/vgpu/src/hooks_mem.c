/* hooks_mem.c: the memory wrappers. Every allocation path is charged to the Ledger before the driver
 * is asked, so an allocation over the limit returns CUDA_ERROR_OUT_OF_MEMORY without touching the
 * driver (nothing is left behind), and is uncharged if the driver then fails. Calls we cannot account
 * (NULL outputs, no current context) go to the driver untouched so that it answers with its own error.
 * The queries report the limit as the total and never let free underflow when usage is above it. */
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "vgpu.h"

int vgpu_current_device(void)
{
    CUdevice d;
    if (!vgpu_drv.cuCtxGetDevice || vgpu_drv.cuCtxGetDevice(&d) != CUDA_SUCCESS || d < 0 || d >= VGPU_MAX_DEVICES)
        return -1;
    vgpu_note_device(d);
    return vgpu_device_slot(d);
}

void vgpu_uuid_string(const CUuuid *u, char out[48])
{
    const unsigned char *b = (const unsigned char *)u->bytes;
    snprintf(out, 48, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
             b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

int vgpu_cuda_uuid(int dev, char out[48])
{
    CUuuid u;
    if (!vgpu_drv.cuDeviceGetUuid || vgpu_drv.cuDeviceGetUuid(&u, dev) != CUDA_SUCCESS)
        return -1;
    vgpu_uuid_string(&u, out);
    return 0;
}

/* The ordinal itself, unless the config names the workload's GPUs by UUID: then the GPU's position
 * in that list (so reordering or unsetting CUDA_VISIBLE_DEVICES moves no limit and splits no
 * budget), or VGPU_FOREIGN_DEVICE. Resolved once per ordinal: the driver's numbering is fixed at
 * cuInit. */
int vgpu_device_slot(int ordinal)
{
    static int resolved[VGPU_MAX_DEVICES]; /* slot + 3: 0 = not yet, 1 = foreign */
    if (!vgpu_cfg.n_uuids || ordinal < 0 || ordinal >= VGPU_MAX_DEVICES)
        return ordinal;
    int r = __atomic_load_n(&resolved[ordinal], __ATOMIC_RELAXED);
    if (!r) {
        char uuid[48] = "unknown";
        r = 1;
        if (vgpu_cuda_uuid(ordinal, uuid) == 0)
            for (int i = 0; i < vgpu_cfg.n_uuids; i++)
                if (!strcasecmp(uuid, vgpu_cfg.uuids[i]))
                    r = i + 3;
        if (r == 1)
            vgpu_log(VGPU_LOG_WARN, "CUDA device %d (%s) is not one of this workload's GPUs: no memory there", ordinal,
                     uuid);
        __atomic_store_n(&resolved[ordinal], r, __ATOMIC_RELAXED);
    }
    return r == 1 ? VGPU_FOREIGN_DEVICE : r - 3;
}

/* Record each device's UUID in the Ledger once, so NVML queries and the enforcer can match it. */
void vgpu_note_device(int ordinal)
{
    static unsigned noted;
    int slot = vgpu_device_slot(ordinal);
    if (slot < 0 || (__atomic_load_n(&noted, __ATOMIC_RELAXED) & (1u << slot)))
        return;
    char uuid[48];
    if (vgpu_cuda_uuid(ordinal, uuid) == 0)
        ledger_note_device(slot, uuid);
    __atomic_fetch_or(&noted, 1u << slot, __ATOMIC_RELAXED);
}

static void release_cb(int dev, uint64_t size) { ledger_release(dev, size); }

/* A charge; when refused, what memory pools were charged for keeping is settled first (a
 * synchronisation may have given it back since) and the charge tried once more. */
int vgpu_reserve(int dev, uint64_t bytes)
{
    if (!ledger_reserve(dev, bytes))
        return 0;
    vgpu_pools_settle();
    return ledger_reserve(dev, bytes);
}

/* ---- plain allocations ---------------------------------------------------------------------- */

#define ALLOC_WRAPPER(sym, ptr_t, size_expr, call_args, ...)                                         \
    VGPU_EXPORT CUresult sym(ptr_t *dptr, __VA_ARGS__)                                              \
    {                                                                                                \
        VGPU_ENTER(sym);                                                                             \
        uint64_t bytes = (uint64_t)(size_expr);                                                      \
        int dev;                                                                                     \
        if (!dptr || bytes == 0 || (dev = vgpu_current_device()) == -1)                                \
            return REAL(sym) call_args;                                                              \
        if (vgpu_reserve(dev, bytes))                                                                \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                         \
        CUresult r = REAL(sym) call_args;                                                            \
        if (r == CUDA_SUCCESS)                                                                       \
            allocs_put(ALLOC_PTR, (uint64_t)*dptr, dev, bytes);                                      \
        else                                                                                         \
            ledger_release(dev, bytes);                                                              \
        return r;                                                                                    \
    }

ALLOC_WRAPPER(cuMemAlloc, CUdeviceptr_v1, bytesize, (dptr, bytesize), unsigned int bytesize)
ALLOC_WRAPPER(cuMemAlloc_v2, CUdeviceptr, bytesize, (dptr, bytesize), size_t bytesize)
ALLOC_WRAPPER(cuMemAllocManaged, CUdeviceptr, bytesize, (dptr, bytesize, flags), size_t bytesize, unsigned int flags)
/* the stream-ordered ones, which draw on memory pools, are in hooks_pool.c */

#define FREE_WRAPPER(sym, ptr_t, call_args, ...)                                                     \
    VGPU_EXPORT CUresult sym(ptr_t dptr __VA_ARGS__)                                                 \
    {                                                                                                \
        VGPU_ENTER(sym);                                                                             \
        CUresult r = REAL(sym) call_args;                                                            \
        int dev;                                                                                     \
        uint64_t bytes;                                                                              \
        if (r == CUDA_SUCCESS && allocs_take(ALLOC_PTR, (uint64_t)dptr, &dev, &bytes))               \
            ledger_release(dev, bytes);                                                              \
        if (r == CUDA_SUCCESS)                                                                       \
            vgpu_pools_settle(); /* a pool may keep what was freed */                                \
        return r;                                                                                    \
    }

FREE_WRAPPER(cuMemFree, CUdeviceptr_v1, (dptr))
FREE_WRAPPER(cuMemFree_v2, CUdeviceptr, (dptr))
FREE_WRAPPER(cuMemFreeAsync, CUdeviceptr, (dptr, stream), , CUstream stream)
FREE_WRAPPER(cuMemFreeAsync_ptsz, CUdeviceptr, (dptr, stream), , CUstream stream)

/* ---- pitched allocations: the pitch is known only afterwards; charge an estimate, then settle ---- */

static uint64_t pitch_estimate(uint64_t width, uint64_t height) { return ((width + 511) & ~(uint64_t)511) * height; }

static CUresult settle_pitch(int dev, uint64_t est, uint64_t actual, CUresult (*free_fn)(void), int *over)
{
    (void)free_fn;
    *over = 0;
    if (actual > est) {
        if (ledger_reserve(dev, actual - est)) {
            *over = 1;
            ledger_release(dev, est);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    } else if (actual < est) {
        ledger_release(dev, est - actual);
    }
    return CUDA_SUCCESS;
}

/* Both pitch ABIs end the same way: the driver chose the real size (pitch x height); charge that
 * instead of the estimate, and undo the allocation if the real size does not fit after all. */
static CUresult pitch_settled(int dev, uint64_t est, uint64_t ptr, uint64_t actual, int v2)
{
    int over;
    if (settle_pitch(dev, est, actual, NULL, &over) != CUDA_SUCCESS) {
        if (v2 && REAL(cuMemFree_v2))
            REAL(cuMemFree_v2)((CUdeviceptr)ptr);
        else if (!v2 && REAL(cuMemFree))
            REAL(cuMemFree)((CUdeviceptr_v1)ptr);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    allocs_put(ALLOC_PTR, ptr, dev, actual);
    return CUDA_SUCCESS;
}

VGPU_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                                        unsigned int elementSize)
{
    VGPU_ENTER(cuMemAllocPitch_v2);
    int dev;
    if (!dptr || !pitch || !width || !height || (dev = vgpu_current_device()) == -1)
        return REAL(cuMemAllocPitch_v2)(dptr, pitch, width, height, elementSize);
    uint64_t est = pitch_estimate(width, height);
    if (ledger_reserve(dev, est))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = REAL(cuMemAllocPitch_v2)(dptr, pitch, width, height, elementSize);
    if (r != CUDA_SUCCESS) {
        ledger_release(dev, est);
        return r;
    }
    return pitch_settled(dev, est, (uint64_t)*dptr, (uint64_t)*pitch * height, 1);
}

VGPU_EXPORT CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pitch, unsigned int width, unsigned int height,
                                     unsigned int elementSize)
{
    VGPU_ENTER(cuMemAllocPitch);
    int dev;
    if (!dptr || !pitch || !width || !height || (dev = vgpu_current_device()) == -1)
        return REAL(cuMemAllocPitch)(dptr, pitch, width, height, elementSize);
    uint64_t est = pitch_estimate(width, height);
    if (ledger_reserve(dev, est))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = REAL(cuMemAllocPitch)(dptr, pitch, width, height, elementSize);
    if (r != CUDA_SUCCESS) {
        ledger_release(dev, est);
        return r;
    }
    return pitch_settled(dev, est, (uint64_t)*dptr, (uint64_t)*pitch * height, 0);
}

/* ---- virtual memory management: physical memory is charged at cuMemCreate ------------------- */

VGPU_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                                 unsigned long long flags)
{
    VGPU_ENTER(cuMemCreate);
    int dev = -1;
    if (handle && prop && size) {
        if (prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE)
            dev = prop->location.id >= 0 && prop->location.id < VGPU_MAX_DEVICES ? prop->location.id : -1;
        else
            dev = -1; /* host or other locations are not device memory */
    }
    if (dev < 0)
        return REAL(cuMemCreate)(handle, size, prop, flags);
    vgpu_note_device(dev);
    dev = vgpu_device_slot(dev);
    if (ledger_reserve(dev, size))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = REAL(cuMemCreate)(handle, size, prop, flags);
    if (r == CUDA_SUCCESS)
        vmm_created((uint64_t)*handle, dev, size);
    else
        ledger_release(dev, size);
    return r;
}

VGPU_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    VGPU_ENTER(cuMemRelease);
    CUresult r = REAL(cuMemRelease)(handle);
    int dev;
    uint64_t size;
    if (r == CUDA_SUCCESS && vmm_released((uint64_t)handle, &dev, &size))
        ledger_release(dev, size);
    return r;
}

VGPU_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                              unsigned long long flags)
{
    VGPU_ENTER(cuMemMap);
    CUresult r = REAL(cuMemMap)(ptr, size, offset, handle, flags);
    if (r == CUDA_SUCCESS)
        vmm_mapped((uint64_t)ptr, size, (uint64_t)handle);
    return r;
}

VGPU_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    VGPU_ENTER(cuMemUnmap);
    CUresult r = REAL(cuMemUnmap)(ptr, size);
    if (r == CUDA_SUCCESS)
        vmm_unmapped((uint64_t)ptr, size, release_cb);
    return r;
}

/* ---- arrays: the driver does not say how much it used; estimate from the descriptor ---------- */

static uint64_t format_bytes(CUarray_format f)
{
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8: case CU_AD_FORMAT_SIGNED_INT8: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16: case CU_AD_FORMAT_SIGNED_INT16: case CU_AD_FORMAT_HALF: return 2;
    default: return 4; /* 32-bit formats; also the estimate for formats we do not know */
    }
}

static uint64_t array_bytes(uint64_t w, uint64_t h, uint64_t d, CUarray_format f, unsigned int channels)
{
    return (w ? w : 1) * (h ? h : 1) * (d ? d : 1) * format_bytes(f) * (channels ? channels : 1);
}

#define ARRAY_WRAPPER(sym, desc_t, size_expr)                                                        \
    VGPU_EXPORT CUresult sym(CUarray *arr, const desc_t *desc)                                      \
    {                                                                                                \
        VGPU_ENTER(sym);                                                                             \
        int dev;                                                                                     \
        if (!arr || !desc || (dev = vgpu_current_device()) == -1)                                      \
            return REAL(sym)(arr, desc);                                                             \
        uint64_t bytes = (size_expr);                                                                \
        if (ledger_reserve(dev, bytes))                                                              \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                         \
        CUresult r = REAL(sym)(arr, desc);                                                           \
        if (r == CUDA_SUCCESS)                                                                       \
            allocs_put(ALLOC_ARRAY, (uint64_t)(uintptr_t)*arr, dev, bytes);                          \
        else                                                                                         \
            ledger_release(dev, bytes);                                                              \
        return r;                                                                                    \
    }

ARRAY_WRAPPER(cuArrayCreate, CUDA_ARRAY_DESCRIPTOR_v1, array_bytes(desc->Width, desc->Height, 1, desc->Format, desc->NumChannels))
ARRAY_WRAPPER(cuArrayCreate_v2, CUDA_ARRAY_DESCRIPTOR, array_bytes(desc->Width, desc->Height, 1, desc->Format, desc->NumChannels))
ARRAY_WRAPPER(cuArray3DCreate, CUDA_ARRAY3D_DESCRIPTOR_v1,
              array_bytes(desc->Width, desc->Height, desc->Depth, desc->Format, desc->NumChannels))
ARRAY_WRAPPER(cuArray3DCreate_v2, CUDA_ARRAY3D_DESCRIPTOR,
              array_bytes(desc->Width, desc->Height, desc->Depth, desc->Format, desc->NumChannels))

VGPU_EXPORT CUresult cuArrayDestroy(CUarray arr)
{
    VGPU_ENTER(cuArrayDestroy);
    CUresult r = REAL(cuArrayDestroy)(arr);
    int dev;
    uint64_t bytes;
    if (r == CUDA_SUCCESS && allocs_take(ALLOC_ARRAY, (uint64_t)(uintptr_t)arr, &dev, &bytes))
        ledger_release(dev, bytes);
    return r;
}

VGPU_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *arr, const CUDA_ARRAY3D_DESCRIPTOR *desc,
                                            unsigned int numLevels)
{
    VGPU_ENTER(cuMipmappedArrayCreate);
    int dev;
    if (!arr || !desc || !numLevels || (dev = vgpu_current_device()) == -1)
        return REAL(cuMipmappedArrayCreate)(arr, desc, numLevels);
    uint64_t bytes = 0;
    for (unsigned int l = 0; l < numLevels && l < 64; l++) {
        uint64_t w = desc->Width >> l, h = desc->Height >> l, d = desc->Depth >> l;
        bytes += array_bytes(w ? w : 1, desc->Height ? (h ? h : 1) : 1, desc->Depth ? (d ? d : 1) : 1, desc->Format,
                             desc->NumChannels);
    }
    if (ledger_reserve(dev, bytes))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = REAL(cuMipmappedArrayCreate)(arr, desc, numLevels);
    if (r == CUDA_SUCCESS)
        allocs_put(ALLOC_MIPMAP, (uint64_t)(uintptr_t)*arr, dev, bytes);
    else
        ledger_release(dev, bytes);
    return r;
}

VGPU_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray arr)
{
    VGPU_ENTER(cuMipmappedArrayDestroy);
    CUresult r = REAL(cuMipmappedArrayDestroy)(arr);
    int dev;
    uint64_t bytes;
    if (r == CUDA_SUCCESS && allocs_take(ALLOC_MIPMAP, (uint64_t)(uintptr_t)arr, &dev, &bytes))
        ledger_release(dev, bytes);
    return r;
}

/* ---- virtualised queries ------------------------------------------------------------------- */

/* total := min(real total, limit); free := min(real free, limit - used), never below zero */
static int virtual_info(int dev, uint64_t *free_b, uint64_t *total_b)
{
    uint64_t limit, used;
    ledger_usage(dev, &limit, &used);
    if (!limit)
        return 0;
    uint64_t total = limit < *total_b ? limit : *total_b;
    uint64_t avail = used >= total ? 0 : total - used;
    *total_b = total;
    if (free_b && avail < *free_b)
        *free_b = avail;
    return 1;
}

VGPU_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
    VGPU_ENTER(cuMemGetInfo_v2);
    vgpu_pools_settle();
    CUresult r = REAL(cuMemGetInfo_v2)(free_bytes, total_bytes);
    int dev;
    if (r == CUDA_SUCCESS && free_bytes && total_bytes && (dev = vgpu_current_device()) >= 0) {
        uint64_t f = *free_bytes, t = *total_bytes;
        if (virtual_info(dev, &f, &t)) {
            *free_bytes = (size_t)f;
            *total_bytes = (size_t)t;
        }
    }
    return r;
}

VGPU_EXPORT CUresult cuMemGetInfo(unsigned int *free_bytes, unsigned int *total_bytes)
{
    VGPU_ENTER(cuMemGetInfo);
    vgpu_pools_settle();
    CUresult r = REAL(cuMemGetInfo)(free_bytes, total_bytes);
    int dev;
    if (r == CUDA_SUCCESS && free_bytes && total_bytes && (dev = vgpu_current_device()) >= 0) {
        uint64_t f = *free_bytes, t = *total_bytes;
        if (virtual_info(dev, &f, &t)) {
            *free_bytes = (unsigned int)(f > UINT_MAX ? UINT_MAX : f);
            *total_bytes = (unsigned int)(t > UINT_MAX ? UINT_MAX : t);
        }
    }
    return r;
}

VGPU_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    VGPU_ENTER(cuDeviceTotalMem_v2);
    CUresult r = REAL(cuDeviceTotalMem_v2)(bytes, dev);
    if (r == CUDA_SUCCESS && bytes && (dev = vgpu_device_slot(dev)) >= 0 && dev < VGPU_MAX_DEVICES) {
        uint64_t t = *bytes;
        if (virtual_info(dev, NULL, &t))
            *bytes = (size_t)t;
    }
    return r;
}

VGPU_EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)
{
    VGPU_ENTER(cuDeviceTotalMem);
    CUresult r = REAL(cuDeviceTotalMem)(bytes, dev);
    if (r == CUDA_SUCCESS && bytes && (dev = vgpu_device_slot(dev)) >= 0 && dev < VGPU_MAX_DEVICES) {
        uint64_t t = *bytes;
        if (virtual_info(dev, NULL, &t))
            *bytes = (unsigned int)(t > UINT_MAX ? UINT_MAX : t);
    }
    return r;
}
