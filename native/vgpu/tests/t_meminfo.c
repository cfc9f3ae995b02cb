/* t_meminfo: the virtualised queries. cuMemGetInfo(_v2), cuDeviceTotalMem(_v2) and
 * nvmlDeviceGetMemoryInfo(_v2) report the limit as total and limit - used as free; when usage is
 * above the limit (a later process of the workload lowered it) free is 0, never an underflow
 * (HAMi-core #200). Run with CUDA_DEVICE_MEMORY_LIMIT_0=64m and a shared cache file. */
#include "vt.h"

static void nvml_expect(uint64_t total, uint64_t used, uint64_t free_b)
{
    nvmlDevice_t dev;
    CHECK_RC(nvmlInit_v2(), NVML_SUCCESS);
    CHECK_RC(nvmlDeviceGetHandleByIndex_v2(0, &dev), NVML_SUCCESS);
    nvmlMemory_t m;
    CHECK_RC(nvmlDeviceGetMemoryInfo(dev, &m), NVML_SUCCESS);
    CHECK_EQ(m.total, total);
    CHECK_EQ(m.used, used);
    CHECK_EQ(m.free, free_b);
    nvmlMemory_v2_t m2;
    memset(&m2, 0, sizeof m2);
    m2.version = nvmlMemory_v2;
    CHECK_RC(nvmlDeviceGetMemoryInfo_v2(dev, &m2), NVML_SUCCESS);
    CHECK_EQ(m2.total, total);
    CHECK_EQ(m2.used, used);
    CHECK_EQ(m2.free, free_b);
    CHECK_RC(nvmlShutdown(), NVML_SUCCESS);
}

/* a later process of the workload, started with a lower limit */
static int lower(void)
{
    vt_ctx(0);
    CHECK_EQ(vt_total(), 32 * MiB);
    CHECK_EQ(vt_free(), 0); /* 48 MiB used by the parent > 32 MiB limit */
    unsigned int f1, t1;
    OK(cuMemGetInfo(&f1, &t1));
    CHECK_EQ(t1, 32 * MiB);
    CHECK_EQ(f1, 0);
    nvml_expect(32 * MiB, 48 * MiB, 0);
    CUdeviceptr p;
    CHECK_RC(cuMemAlloc_v2(&p, 1), CUDA_ERROR_OUT_OF_MEMORY);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "lower"))
        return lower();

    /* NVML before any CUDA call: the NVML device is matched to CUDA device 0 through the driver */
    nvml_expect(64 * MiB, 0, 64 * MiB);

    vt_ctx(0);
    CHECK_EQ(vt_total(), 64 * MiB);
    size_t total;
    OK(cuDeviceTotalMem_v2(&total, 0));
    CHECK_EQ(total, 64 * MiB);
    unsigned int t1, f1;
    OK(cuDeviceTotalMem(&t1, 0));
    CHECK_EQ(t1, 64 * MiB);

    CUdeviceptr a, b;
    OK(cuMemAlloc_v2(&a, 16 * MiB));
    OK(cuMemAlloc_v2(&b, 32 * MiB));
    CHECK_EQ(vt_free(), 16 * MiB);
    OK(cuMemGetInfo(&f1, &t1));
    CHECK_EQ(f1, 16 * MiB);
    CHECK_EQ(t1, 64 * MiB);
    nvml_expect(64 * MiB, 48 * MiB, 16 * MiB);

    /* a second process lowers the limit to 32 MiB: usage (48) is now above it */
    static const char *const env[] = {"CUDA_DEVICE_MEMORY_LIMIT_0=32m", ""};
    CHECK_EQ(vt_wait(vt_spawn("lower", NULL, env)), 0);
    CHECK_EQ(vt_total(), 32 * MiB); /* the recorded limit only goes down, for everyone */
    CHECK_EQ(vt_free(), 0);
    OK(cuMemGetInfo(&f1, &t1));
    CHECK_EQ(f1, 0);
    nvml_expect(32 * MiB, 48 * MiB, 0);
    CUdeviceptr c;
    CHECK_RC(cuMemAlloc_v2(&c, 1), CUDA_ERROR_OUT_OF_MEMORY);
    OK(cuMemFree_v2(b));
    CHECK_EQ(vt_free(), 16 * MiB);
    OK(cuMemFree_v2(a));
    CHECK_EQ(vt_free(), 32 * MiB);
    printf("meminfo: totals and free right before and after usage passed the limit\n");
    return 0;
}
