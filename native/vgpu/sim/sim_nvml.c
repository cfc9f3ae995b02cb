/* sim_nvml.c: a simulated NVML (libnvidia-ml.so.1) reporting the same devices as the simulated CUDA
 * driver, so libvgpu's NVML hooks (and the UUID match between NVML and CUDA devices) run in CI. Memory
 * in use is the simulated card's (sim_common.c): everything the processes sharing TESSERA_SIM_CARD hold
 * (allocations, contexts, modules, graph memory); without a shared card, NVML sees an idle device. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "cuda_api.h"
#include "sim_common.h"

struct nvmlDevice_st { int index; };
static struct nvmlDevice_st devices[SIM_MAX_DEVICES];
static sim_device_config cfg;
static int initialized;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

CUAPI nvmlReturn_t nvmlInit_v2(void)
{
    pthread_mutex_lock(&mu);
    if (!initialized) {
        sim_config_load(&cfg);
        if (cfg.card_path[0])
            sim_card_open(&cfg);
        for (int i = 0; i < SIM_MAX_DEVICES; i++)
            devices[i].index = i;
    }
    initialized++;
    pthread_mutex_unlock(&mu);
    return NVML_SUCCESS;
}
CUAPI nvmlReturn_t nvmlInit(void) { return nvmlInit_v2(); }

CUAPI nvmlReturn_t nvmlShutdown(void)
{
    pthread_mutex_lock(&mu);
    nvmlReturn_t r = initialized ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (initialized)
        initialized--;
    pthread_mutex_unlock(&mu);
    return r;
}

static int valid(nvmlDevice_t d) { return d && d >= devices && d < devices + cfg.count; }

/* NVML of a process that does not share a card file sees nobody's memory */
static unsigned long long card_used(nvmlDevice_t d)
{
    uint64_t u = cfg.card_path[0] ? sim_card_used(d->index) : 0;
    return u > cfg.memory ? cfg.memory : u;
}

CUAPI nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    if (!initialized)
        return NVML_ERROR_UNINITIALIZED;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = (unsigned int)cfg.count;
    return NVML_SUCCESS;
}
CUAPI nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

CUAPI nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *dev)
{
    if (!initialized)
        return NVML_ERROR_UNINITIALIZED;
    if (!dev || index >= (unsigned int)cfg.count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *dev = &devices[index];
    return NVML_SUCCESS;
}
CUAPI nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *dev)
{
    return nvmlDeviceGetHandleByIndex_v2(index, dev);
}

CUAPI nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t dev, char *uuid, unsigned int len)
{
    if (!initialized)
        return NVML_ERROR_UNINITIALIZED;
    if (!valid(dev) || !uuid)
        return NVML_ERROR_INVALID_ARGUMENT;
    char s[48];
    sim_uuid_string(&cfg.uuid[dev->index], s);
    if (len < strlen(s) + 1)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(uuid, s, strlen(s) + 1);
    return NVML_SUCCESS;
}

CUAPI nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t dev, char *name, unsigned int len)
{
    if (!initialized)
        return NVML_ERROR_UNINITIALIZED;
    if (!valid(dev) || !name)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (len < strlen(cfg.name) + 1)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(name, cfg.name, strlen(cfg.name) + 1);
    return NVML_SUCCESS;
}

CUAPI nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *mem)
{
    if (!initialized)
        return NVML_ERROR_UNINITIALIZED;
    if (!valid(dev) || !mem)
        return NVML_ERROR_INVALID_ARGUMENT;
    mem->total = cfg.memory;
    mem->used = card_used(dev);
    mem->free = cfg.memory - mem->used;
    return NVML_SUCCESS;
}

CUAPI nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *mem)
{
    if (!initialized)
        return NVML_ERROR_UNINITIALIZED;
    if (!valid(dev) || !mem)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (mem->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    mem->total = cfg.memory;
    mem->reserved = 0;
    mem->used = card_used(dev);
    mem->free = cfg.memory - mem->used;
    return NVML_SUCCESS;
}

CUAPI const char *nvmlErrorString(nvmlReturn_t r)
{
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument Version Mismatch";
    default: return "Unknown Error";
    }
}
