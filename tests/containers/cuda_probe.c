/* cuda_probe: a small CUDA-driver client for the container tests, compiled on the host against the
 * simulated driver's API (native/vgpu/include) and bind-mounted into a container. It allocates
 * <step> MiB at a time on device 0 until the driver (or libvgpu) refuses, or until <max> MiB
 * (0: no maximum), then tries one more byte, and prints one JSON line: what it got and the error
 * that stopped it. With "hold" it keeps its memory until its stdin closes, so a test can see two
 * processes draw on one budget. It also reports the limit variable and LD_PRELOAD as it sees them,
 * so a test that overrides them can check the override took effect.
 *   cuda_probe <step-MiB> <max-MiB> [hold] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_api.h"

#define MiB (1024ULL * 1024ULL)
#define MAX_BLOCKS 4096

/* a JSON string, or null; values here are paths and sizes, so quoting needs no escapes */
static void env_field(const char *key, const char *name, const char *sep)
{
    const char *v = getenv(name);
    if (v && !strpbrk(v, "\"\\"))
        printf("\"%s\": \"%s\"%s", key, v, sep);
    else
        printf("\"%s\": null%s", key, sep);
}

static void fail(const char *what, CUresult rc)
{
    printf("{\"failed\": \"%s\", \"error\": %d}\n", what, (int)rc);
    exit(1);
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: cuda_probe <step-MiB> <max-MiB> [hold]\n");
        return 2;
    }
    unsigned long long step = strtoull(argv[1], NULL, 10) * MiB, max = strtoull(argv[2], NULL, 10) * MiB;
    int hold = argc > 3 && !strcmp(argv[3], "hold");
    CUresult rc;
    CUcontext ctx;
    int count = 0;
    if ((rc = cuInit(0)) != CUDA_SUCCESS) fail("cuInit", rc);
    if ((rc = cuDeviceGetCount(&count)) != CUDA_SUCCESS) fail("cuDeviceGetCount", rc);
    if ((rc = cuDevicePrimaryCtxRetain(&ctx, 0)) != CUDA_SUCCESS) fail("cuDevicePrimaryCtxRetain", rc);
    if ((rc = cuCtxSetCurrent(ctx)) != CUDA_SUCCESS) fail("cuCtxSetCurrent", rc);
    size_t free_b = 0, total_b = 0;
    if ((rc = cuMemGetInfo_v2(&free_b, &total_b)) != CUDA_SUCCESS) fail("cuMemGetInfo_v2", rc);

    static CUdeviceptr blocks[MAX_BLOCKS];
    int n = 0;
    unsigned long long got = 0;
    CUresult stop = CUDA_SUCCESS;
    while (n < MAX_BLOCKS && (!max || got + step <= max)) {
        if ((stop = cuMemAlloc_v2(&blocks[n], step)) != CUDA_SUCCESS)
            break;
        got += step;
        n++;
    }
    CUdeviceptr extra = 0;
    CUresult one_more = cuMemAlloc_v2(&extra, 1);
    if (one_more == CUDA_SUCCESS)
        cuMemFree_v2(extra);
    printf("{");
    env_field("limit_env", "CUDA_DEVICE_MEMORY_LIMIT_0", ", ");
    env_field("preload_env", "LD_PRELOAD", ", ");
    env_field("cache_env", "CUDA_DEVICE_MEMORY_SHARED_CACHE", ", ");
    printf("\"devices\": %d, \"total_mib\": %llu, \"free_mib\": %llu, \"allocated_mib\": %llu, "
           "\"stopped_by\": %d, \"one_more_byte\": %d}\n",
           count, (unsigned long long)total_b / MiB, (unsigned long long)free_b / MiB, got / MiB, (int)stop,
           (int)one_more);
    fflush(stdout);
    if (hold) {
        char buf[256];
        while (read(0, buf, sizeof buf) > 0)
            ;
    }
    for (int i = 0; i < n; i++)
        cuMemFree_v2(blocks[i]);
    return 0;
}
