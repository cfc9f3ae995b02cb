/* hooks_nvml.c: NVML reports device-wide memory, which would tell a workload (and nvidia-smi inside
 * its container) about memory it may not use. The NVML device is matched to a CUDA device index by
 * UUID (the CUDA index is what the limits are keyed by), and memory is reported as total = limit,
 * used = the workload's usage, free = max(0, limit - used). Unmatched devices are left untouched. */
#include <string.h>

#include "vgpu.h"

static int cuda_index_of(nvmlDevice_t dev)
{
    char uuid[96];
    if (!vgpu_drv.nvmlDeviceGetUUID || vgpu_drv.nvmlDeviceGetUUID(dev, uuid, sizeof uuid) != NVML_SUCCESS)
        return -1;
    int idx = ledger_find_uuid(uuid);
    if (idx >= 0)
        return idx;
    /* no CUDA process of this workload has recorded the devices yet: ask the driver */
    if (!vgpu_drv.cuDeviceGetCount)
        return -1;
    int n = 0;
    CUresult r = vgpu_drv.cuDeviceGetCount(&n);
    if (r == CUDA_ERROR_NOT_INITIALIZED && vgpu_drv.cuInit && vgpu_drv.cuInit(0) == CUDA_SUCCESS)
        r = vgpu_drv.cuDeviceGetCount(&n);
    if (r != CUDA_SUCCESS)
        return -1;
    for (int d = 0; d < n && d < VGPU_MAX_DEVICES; d++) {
        char cu[48];
        if (vgpu_cuda_uuid(d, cu) == 0) {
            vgpu_note_device(d);
            if (!strcmp(cu, uuid))
                return vgpu_device_slot(d);
        }
    }
    return -1;
}

static int virtual_memory(nvmlDevice_t dev, unsigned long long *total, unsigned long long *free_b,
                          unsigned long long *used_b)
{
    int idx = cuda_index_of(dev);
    if (idx < 0)
        return 0;
    uint64_t limit, used;
    ledger_usage(idx, &limit, &used);
    if (!limit)
        return 0;
    uint64_t t = limit < *total ? limit : *total;
    *total = t;
    *used_b = used;
    *free_b = used >= t ? 0 : t - used;
    return 1;
}

VGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *mem)
{
    VGPU_ENTER(nvmlDeviceGetMemoryInfo);
    nvmlReturn_t r = REAL(nvmlDeviceGetMemoryInfo)(dev, mem);
    if (r == NVML_SUCCESS && mem)
        virtual_memory(dev, &mem->total, &mem->free, &mem->used);
    return r;
}

VGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *mem)
{
    VGPU_ENTER(nvmlDeviceGetMemoryInfo_v2);
    nvmlReturn_t r = REAL(nvmlDeviceGetMemoryInfo_v2)(dev, mem);
    if (r == NVML_SUCCESS && mem && virtual_memory(dev, &mem->total, &mem->free, &mem->used))
        mem->reserved = 0;
    return r;
}
