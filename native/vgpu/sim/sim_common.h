/* sim_common.h: the simulated device description that the simulated CUDA driver and the simulated
 * NVML must agree on (count, memory, SMs, name, UUIDs), read from TESSERA_SIM_* variables. */
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
} sim_device_config;

__attribute__((visibility("hidden"))) void sim_config_load(sim_device_config *c);
__attribute__((visibility("hidden"))) void sim_uuid_string(const CUuuid *u, char out[48]);

#endif
