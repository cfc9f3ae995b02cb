/* sim_common.h: the simulated device description that the simulated CUDA driver and the simulated
 * NVML must agree on (count, memory, SMs, name, UUIDs, overheads), read from TESSERA_SIM_* variables,
 * and the simulated card: the memory in use on each device, as the card itself sees it. */
#ifndef TESSERA_SIM_COMMON_H
#define TESSERA_SIM_COMMON_H

#include <stdint.h>
#include "cuda_types.h"

#define SIM_MAX_DEVICES 16

typedef struct {
    int count;
    uint64_t memory;     /* bytes per device */
    int sm_count;
    char name[256];
    CUuuid uuid[SIM_MAX_DEVICES];
    int64_t kernel_ns;   /* device time of one simulated kernel */
    int driver_version;
    int procaddr_internal;
    uint64_t context_bytes; /* device memory a context takes (TESSERA_SIM_CONTEXT_MIB) */
    uint64_t module_bytes;  /* device memory a loaded module takes (TESSERA_SIM_MODULE_KIB) */
    char card_path[4096];   /* TESSERA_SIM_CARD: a file shared by processes, so they share one card */
} sim_device_config;

/* The card: bytes in use per device, counted for every process that shares TESSERA_SIM_CARD (else this
 * process alone). What a process took is given back when it exits normally (a SIGKILLed process's
 * memory stays on the file's card: the tests that share a card end their processes normally). */
__attribute__((visibility("hidden"))) void sim_card_open(const sim_device_config *c);
__attribute__((visibility("hidden"))) int sim_card_take(int dev, uint64_t bytes, uint64_t capacity);
__attribute__((visibility("hidden"))) void sim_card_give(int dev, uint64_t bytes);
__attribute__((visibility("hidden"))) uint64_t sim_card_used(int dev);

__attribute__((visibility("hidden"))) void sim_config_load(sim_device_config *c);
__attribute__((visibility("hidden"))) void sim_uuid_string(const CUuuid *u, char out[48]);

#endif
