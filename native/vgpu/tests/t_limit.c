/* t_limit: allocations up to the limit succeed, the next byte fails with CUDA_ERROR_OUT_OF_MEMORY and
 * leaves nothing behind in the driver; per-device limits (device 0: _0, device 1: the all-devices
 * value) are kept apart. Run with CUDA_DEVICE_MEMORY_LIMIT_0=64m CUDA_DEVICE_MEMORY_LIMIT=128m and two
 * simulated devices. */
#include "vt.h"

int main(void)
{
    vt_ctx(0);
    CHECK_EQ(vt_total(), 64 * MiB);
    CHECK_EQ(vt_free(), 64 * MiB);

    CUdeviceptr a, b, c, d = 0xdead;
    OK(cuMemAlloc_v2(&a, 32 * MiB));
    OK(cuMemAlloc_v2(&b, 32 * MiB - 1));
    OK(cuMemAlloc_v2(&c, 1));
    CHECK_EQ(vt_free(), 0);
    int live = tessera_sim_live_allocations();
    uint64_t sim_used = tessera_sim_memory_used(0);
    CHECK_RC(cuMemAlloc_v2(&d, 1), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK_EQ(d, 0xdead);                                   /* output untouched */
    CHECK_EQ(tessera_sim_live_allocations(), live);        /* nothing allocated underneath */
    CHECK_EQ(tessera_sim_memory_used(0), sim_used);
    CHECK_RC(cuMemAlloc_v2(&d, (size_t)-1), CUDA_ERROR_OUT_OF_MEMORY); /* no overflow in the check */

    OK(cuMemFree_v2(c));
    OK(cuMemAlloc_v2(&c, 1));
    OK(cuMemFree_v2(a));
    OK(cuMemFree_v2(b));
    OK(cuMemFree_v2(c));
    CHECK_EQ(vt_free(), 64 * MiB);
    CHECK_RC(cuMemAlloc_v2(&d, 64 * MiB + 1), CUDA_ERROR_OUT_OF_MEMORY);
    OK(cuMemAlloc_v2(&d, 64 * MiB));
    OK(cuMemFree_v2(d));

    /* device 1 has its own budget */
    OK(cuMemAlloc_v2(&a, 64 * MiB));
    vt_ctx(1);
    CHECK_EQ(vt_total(), 128 * MiB);
    CHECK_EQ(vt_free(), 128 * MiB);
    OK(cuMemAlloc_v2(&b, 128 * MiB));
    CHECK_RC(cuMemAlloc_v2(&d, 1), CUDA_ERROR_OUT_OF_MEMORY);
    size_t total;
    OK(cuDeviceTotalMem_v2(&total, 0));
    CHECK_EQ(total, 64 * MiB);
    OK(cuDeviceTotalMem_v2(&total, 1));
    CHECK_EQ(total, 128 * MiB);
    OK(cuMemFree_v2(b));
    vt_ctx(0);
    OK(cuMemFree_v2(a));
    CHECK_EQ(vt_free(), 64 * MiB);
    printf("limit: exact to the byte on two devices\n");
    return 0;
}
