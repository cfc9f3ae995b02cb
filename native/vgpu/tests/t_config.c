/* t_config: the effective memory limit of device 0 is what the rules say: `t_config <MiB>` checks that
 * the reported total is <MiB> and that exactly <MiB> can be allocated (0: no limit). The runner
 * starts it under different environments and config files: env alone, each size suffix, a config
 * file below the env, env below the config file, a limit recorded by an earlier process, "0". */
#include "vt.h"

int main(int argc, char **argv)
{
    CHECK(argc == 2);
    uint64_t want = strtoull(argv[1], NULL, 10) * MiB;
    vt_ctx(0);
    if (!want) {
        size_t t;
        OK(cuDeviceTotalMem_v2(&t, 0));
        CHECK_EQ(vt_total(), t);
        printf("config: no limit\n");
        return 0;
    }
    CHECK_EQ(vt_total(), want);
    CUdeviceptr p, q;
    CHECK_RC(cuMemAlloc_v2(&p, want + 1), CUDA_ERROR_OUT_OF_MEMORY);
    OK(cuMemAlloc_v2(&p, want));
    CHECK_RC(cuMemAlloc_v2(&q, 1), CUDA_ERROR_OUT_OF_MEMORY);
    OK(cuMemFree_v2(p));
    printf("config: limit %llu MiB\n", (unsigned long long)(want / MiB));
    return 0;
}
