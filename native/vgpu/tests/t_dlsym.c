/* t_dlsym: a program that never links libcuda but dlopen()s it and dlsym()s its entry points, as the
 * CUDA runtime does, gets libvgpu's wrappers (and so is limited); symbols libvgpu does not hook, and
 * missing ones, are answered as dlsym alone would; dlsym(RTLD_NEXT) still resolves from the caller.
 * Built without -lcuda. Run with CUDA_DEVICE_MEMORY_LIMIT_0=64m. */
#include <dlfcn.h>

#include "vt.h"

int main(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    CHECK(h);
    CUresult (*init)(unsigned int) = (CUresult(*)(unsigned int))dlsym(h, "cuInit");
    CUresult (*retain)(CUcontext *, CUdevice) = (CUresult(*)(CUcontext *, CUdevice))dlsym(h, "cuDevicePrimaryCtxRetain");
    CUresult (*set)(CUcontext) = (CUresult(*)(CUcontext))dlsym(h, "cuCtxSetCurrent");
    CUresult (*alloc)(CUdeviceptr *, size_t) = (CUresult(*)(CUdeviceptr *, size_t))dlsym(h, "cuMemAlloc_v2");
    CUresult (*freep)(CUdeviceptr) = (CUresult(*)(CUdeviceptr))dlsym(h, "cuMemFree_v2");
    CUresult (*info)(size_t *, size_t *) = (CUresult(*)(size_t *, size_t *))dlsym(h, "cuMemGetInfo_v2");
    void *(*sim_symbol)(const char *) = (void *(*)(const char *))dlsym(h, "tessera_sim_symbol");
    CHECK(init && retain && set && alloc && freep && info && sim_symbol);

    /* hooked symbols come back as the wrappers, the rest as the driver's own */
    CHECK((void *)alloc != sim_symbol("cuMemAlloc_v2"));
    CHECK((void *)info != sim_symbol("cuMemGetInfo_v2"));
    CHECK((void *)init == sim_symbol("cuInit"));
    CHECK(dlsym(h, "cuGetProcAddress_v2") != sim_symbol("cuGetProcAddress_v2"));

    /* a missing symbol: NULL and a dlerror message, as without us */
    dlerror();
    CHECK(dlsym(h, "cuNoSuchFunction") == NULL);
    CHECK(dlerror() != NULL);

    /* RTLD_NEXT from the program still finds libc's puts */
    void *next_puts = dlsym(RTLD_NEXT, "puts");
    CHECK(next_puts != NULL && next_puts == dlsym(RTLD_DEFAULT, "puts"));

    CUcontext ctx;
    OK(init(0));
    OK(retain(&ctx, 0));
    OK(set(ctx));
    size_t f, t;
    OK(info(&f, &t));
    CHECK_EQ(t, 64 * MiB);
    CUdeviceptr a, b;
    OK(alloc(&a, 64 * MiB));
    CHECK_RC(alloc(&b, 1), CUDA_ERROR_OUT_OF_MEMORY);
    OK(freep(a));
    OK(info(&f, &t));
    CHECK_EQ(f, 64 * MiB);

    /* the runtime's path: dlsym(cuGetProcAddress_v2), then everything through it */
    CUresult (*gpa)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *) =
        (CUresult(*)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *))dlsym(h, "cuGetProcAddress_v2");
    void *via;
    OK(gpa("cuMemAlloc", &via, 12000, 0, NULL));
    CHECK(via == (void *)alloc);

    /* NVML the same way */
    void *nh = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    CHECK(nh);
    nvmlReturn_t (*ninit)(void) = (nvmlReturn_t(*)(void))dlsym(nh, "nvmlInit_v2");
    nvmlReturn_t (*nget)(unsigned int, nvmlDevice_t *) = (nvmlReturn_t(*)(unsigned int, nvmlDevice_t *))dlsym(nh, "nvmlDeviceGetHandleByIndex_v2");
    nvmlReturn_t (*nmem)(nvmlDevice_t, nvmlMemory_t *) = (nvmlReturn_t(*)(nvmlDevice_t, nvmlMemory_t *))dlsym(nh, "nvmlDeviceGetMemoryInfo");
    CHECK(ninit && nget && nmem);
    nvmlDevice_t dev;
    CHECK_RC(ninit(), NVML_SUCCESS);
    CHECK_RC(nget(0, &dev), NVML_SUCCESS);
    nvmlMemory_t m;
    CHECK_RC(nmem(dev, &m), NVML_SUCCESS);
    CHECK_EQ(m.total, 64 * MiB);
    printf("dlsym: dlopen+dlsym of libcuda.so.1 and libnvidia-ml.so.1 gets the wrappers\n");
    return 0;
}
