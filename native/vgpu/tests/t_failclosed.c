/* t_failclosed.c: the attack "switch enforcement off from the environment" in host mode (no container,
 * so no read-only /etc/ld.so.preload or mounted claim file): the workload unsets TESSERA_VGPU_CONFIG
 * and every CUDA_DEVICE_MEMORY_LIMIT_* variable, or points TESSERA_VGPU_CONFIG at a file of its own.
 * Where the node's config says enforcement is required, no trusted claim file means no memory at all.
 * Usage: t_failclosed refused   -- every allocation path answers CUDA_ERROR_OUT_OF_MEMORY
 *        t_failclosed granted <MiB> -- <MiB> can be allocated and not one byte more */
#include "vt.h"

int main(int argc, char **argv)
{
    CHECK(argc >= 2);
    vt_ctx(0);
    CUdeviceptr p;
    if (!strcmp(argv[1], "refused")) {
        CHECK_RC(cuMemAlloc_v2(&p, 1 * MiB), CUDA_ERROR_OUT_OF_MEMORY);
        CHECK_RC(cuMemAllocManaged(&p, 1 * MiB, 1), CUDA_ERROR_OUT_OF_MEMORY);
        size_t pitch;
        CHECK_RC(cuMemAllocPitch_v2(&p, &pitch, 1024, 1024, 4), CUDA_ERROR_OUT_OF_MEMORY);
        CHECK_EQ(tessera_sim_memory_used(0), 0);
        printf("failclosed: no trusted limits source, every allocation refused\n");
        return 0;
    }
    CHECK(argc == 3);
    uint64_t want = strtoull(argv[2], NULL, 10) * MiB;
    CHECK_RC(cuMemAlloc_v2(&p, want + 1), CUDA_ERROR_OUT_OF_MEMORY);
    OK(cuMemAlloc_v2(&p, want));
    OK(cuMemFree_v2(p));
    printf("failclosed: trusted claim file, limit %llu MiB\n", (unsigned long long)(want / MiB));
    return 0;
}
