/* t_order: when a config file names the workload's GPUs by UUID (CUDA_VISIBLE_DEVICES=<A>,<B> in the
 * file), limits and the shared budget follow the GPU, not the CUDA ordinal, so a workload that
 * reorders or unsets its own CUDA_VISIBLE_DEVICES moves no limit, and a GPU outside the list gets no
 * memory. The simulated driver numbers its GPUs in the order of TESSERA_SIM_GPU_UUIDS, which stands
 * in for the driver applying the process's CUDA_VISIBLE_DEVICES.
 *   t_order limit <ordinal> <MiB>   exactly <MiB> can be allocated on that device (0: not one byte)
 *   t_order pair <uuids-reversed>   this process fills device 0's budget; a second process of the
 *                                   workload that sees the GPUs reversed gets nothing on device 1 */
#include "vt.h"

static void check_limit(int ordinal, uint64_t want)
{
    vt_ctx(ordinal);
    CUdeviceptr p, q;
    if (!want) {
        CHECK_RC(cuMemAlloc_v2(&p, 1), CUDA_ERROR_OUT_OF_MEMORY);
        return;
    }
    CHECK_EQ(vt_total(), want);
    CHECK_RC(cuMemAlloc_v2(&p, want + 1), CUDA_ERROR_OUT_OF_MEMORY);
    OK(cuMemAlloc_v2(&p, want));
    CHECK_RC(cuMemAlloc_v2(&q, 1), CUDA_ERROR_OUT_OF_MEMORY);
    OK(cuMemFree_v2(p));
}

int main(int argc, char **argv)
{
    CHECK(argc >= 3);
    if (!strcmp(argv[1], "nothing-on-1")) { /* the second process of "pair" (vt_spawn) */
        check_limit(1, 0);
        return 0;
    }
    if (!strcmp(argv[1], "limit")) {
        CHECK(argc == 4);
        check_limit(atoi(argv[2]), strtoull(argv[3], NULL, 10) * MiB);
        printf("order: device %s limit %s MiB\n", argv[2], argv[3]);
        return 0;
    }
    CHECK(!strcmp(argv[1], "pair"));
    vt_ctx(0);
    CUdeviceptr p;
    uint64_t budget = vt_total();
    OK(cuMemAlloc_v2(&p, budget));
    char env[256];
    snprintf(env, sizeof env, "TESSERA_SIM_GPU_UUIDS=%s", argv[2]);
    const char *const extra[] = {env, ""};
    CHECK_EQ(vt_wait(vt_spawn("nothing-on-1", "", extra)), 0);
    OK(cuMemFree_v2(p));
    printf("order: one budget per GPU whatever each process's order (%llu MiB)\n", (unsigned long long)(budget / MiB));
    return 0;
}
