/* startup: the smallest CUDA process (driver init, primary context, one 1 MiB allocation), for
 * run.sh to start 100 at once with and without libvgpu. */
#include <dlfcn.h>
#include <stdio.h>

#include "cuda_types.h"

int main(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    CUresult (*init)(unsigned) = (CUresult(*)(unsigned))dlsym(h, "cuInit");
    CUresult (*retain)(CUcontext *, CUdevice) = (CUresult(*)(CUcontext *, CUdevice))dlsym(h, "cuDevicePrimaryCtxRetain");
    CUresult (*set)(CUcontext) = (CUresult(*)(CUcontext))dlsym(h, "cuCtxSetCurrent");
    CUresult (*alloc)(CUdeviceptr *, size_t) = (CUresult(*)(CUdeviceptr *, size_t))dlsym(h, "cuMemAlloc_v2");
    CUresult (*release)(CUdeviceptr) = (CUresult(*)(CUdeviceptr))dlsym(h, "cuMemFree_v2");
    CUcontext ctx;
    CUdeviceptr p;
    if (init(0) || retain(&ctx, 0) || set(ctx) || alloc(&p, 1 << 20) || release(p)) return 1;
    return 0;
}
