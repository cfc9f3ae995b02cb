/* bench_launch: CPU cost of one launch through whatever is preloaded, on the simulated driver with
 * kernels of no device time (so only the host side is measured).
 *   bench_launch graph|plain <n>   prints the mean ns per cuGraphLaunch / cuLaunchKernel over n calls
 * tests/bench.sh runs it with the driver alone, with libvgpu and no SM limit, and with libvgpu metering
 * a 99 % share, and prints the three side by side. */
#include "vt.h"

int main(int argc, char **argv)
{
    CHECK(argc == 3);
    int n = atoi(argv[2]), graph = !strcmp(argv[1], "graph");
    vt_ctx(0);
    CUfunction fn = vt_kernel();
    CUstream s;
    OK(cuStreamCreate(&s, 0));
    CUgraphExec exec = NULL;
    if (graph) {
        CUgraph g;
        CUgraphNode node;
        CUDA_KERNEL_NODE_PARAMS p = {fn, 132, 1, 1, 256, 1, 1, 0, NULL, NULL};
        OK(cuGraphCreate(&g, 0));
        OK(cuGraphAddKernelNode(&node, g, NULL, 0, &p));
        OK(cuGraphInstantiateWithFlags(&exec, g, 0));
    }
    for (int warm = 0; warm < 2; warm++) { /* the first pass warms caches, the second is measured */
        double t0 = vt_now();
        for (int i = 0; i < n; i++) {
            if (graph)
                OK(cuGraphLaunch(exec, s));
            else
                OK(cuLaunchKernel(fn, 132, 1, 1, 256, 1, 1, 0, s, NULL, NULL));
        }
        OK(cuCtxSynchronize());
        if (warm)
            printf("%.1f\n", (vt_now() - t0) * 1e9 / n);
    }
    return 0;
}
