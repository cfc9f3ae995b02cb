/* alloc_bench: cuMemAlloc_v2 + cuMemFree_v2 latency of 1 MiB against the real driver, for run.sh to
 * compare with and without libvgpu. Resolves the driver with dlopen+dlsym (as the runtime does), so
 * it needs no CUDA headers or stubs. Prints nanoseconds per alloc+free pair. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "cuda_types.h"

int main(int argc, char **argv)
{
    int n = argc > 1 ? atoi(argv[1]) : 10000;
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    CUresult (*init)(unsigned) = (CUresult(*)(unsigned))dlsym(h, "cuInit");
    CUresult (*retain)(CUcontext *, CUdevice) = (CUresult(*)(CUcontext *, CUdevice))dlsym(h, "cuDevicePrimaryCtxRetain");
    CUresult (*set)(CUcontext) = (CUresult(*)(CUcontext))dlsym(h, "cuCtxSetCurrent");
    CUresult (*alloc)(CUdeviceptr *, size_t) = (CUresult(*)(CUdeviceptr *, size_t))dlsym(h, "cuMemAlloc_v2");
    CUresult (*release)(CUdeviceptr) = (CUresult(*)(CUdeviceptr))dlsym(h, "cuMemFree_v2");
    CUcontext ctx;
    if (init(0) || retain(&ctx, 0) || set(ctx)) { fprintf(stderr, "no CUDA context\n"); return 1; }
    CUdeviceptr p;
    for (int i = 0; i < 100; i++) { alloc(&p, 1 << 20); release(p); }
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int i = 0; i < n; i++) {
        if (alloc(&p, 1 << 20) || release(p)) { fprintf(stderr, "alloc/free failed\n"); return 1; }
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("%.1f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / n);
    return 0;
}
