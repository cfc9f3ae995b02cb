/* t_graph: CUDA graphs obey the claim like plain launches and allocations do.
 *   t_graph sm <pct> <n>      n launches of a 4-kernel graph in one process hold the SM share
 *   t_graph split <kind> <n>  two claims at 30 % and 70 % (own caches), each running n launches of
 *                             <kind> (graph or plain) at once: their throughput splits 30/70 within
 *                             5 points (each one's share of its device time within 10, as t_sm's on a
 *                             loaded CPU, where a process descheduled past the burst allowance idles)
 *   t_graph mem               graph memory nodes (added, and captured from cuMemAllocAsync) count
 *                             against the limit when the graph first runs: past it the launch fails
 *                             with CUDA_ERROR_OUT_OF_MEMORY and nothing is taken; run with a 64 MiB limit
 * Against the library before graphs were hooked, `sm` ran at 100 % and `mem` launched over the limit. */
#include "vt.h"

#define NODES 4

static CUDA_KERNEL_NODE_PARAMS kparams(CUfunction fn)
{
    CUDA_KERNEL_NODE_PARAMS p = {fn, 132, 1, 1, 256, 1, 1, 0, NULL, NULL};
    return p;
}

/* A graph of NODES kernels in a chain: one added node by node, one captured from a stream. */
static CUgraphExec graph_exec(CUfunction fn, CUstream s, int captured)
{
    CUgraph g;
    if (captured) {
        OK(cuStreamBeginCapture_v2(s, 0));
        for (int i = 0; i < NODES; i++)
            OK(cuLaunchKernel(fn, 132, 1, 1, 256, 1, 1, 0, s, NULL, NULL));
        OK(cuStreamEndCapture(s, &g));
    } else {
        OK(cuGraphCreate(&g, 0));
        CUgraphNode prev = NULL, n;
        CUDA_KERNEL_NODE_PARAMS p = kparams(fn);
        for (int i = 0; i < NODES; i++) {
            OK(cuGraphAddKernelNode(&n, g, prev ? &prev : NULL, prev ? 1 : 0, &p));
            prev = n;
        }
    }
    CUgraphExec e;
    OK(cuGraphInstantiateWithFlags(&e, g, 0));
    OK(cuGraphDestroy(g));
    return e;
}

/* n launches of NODES kernels' worth of device time each */
static void run(const char *kind, int n)
{
    CUfunction fn = vt_kernel();
    CUstream s;
    OK(cuStreamCreate(&s, 0));
    if (!strcmp(kind, "plain")) {
        for (int i = 0; i < n * NODES; i++)
            OK(cuLaunchKernel(fn, 132, 1, 1, 256, 1, 1, 0, s, NULL, NULL));
    } else {
        CUgraphExec built = graph_exec(fn, s, 0), captured = graph_exec(fn, s, 1);
        for (int i = 0; i < n; i++) {
            if (i % 2)
                OK(cuGraphLaunch_ptsz(captured, NULL));
            else
                OK(cuGraphLaunch(built, s));
        }
        OK(cuCtxSynchronize());
        OK(cuGraphExecDestroy(built));
        OK(cuGraphExecDestroy(captured));
    }
    OK(cuCtxSynchronize());
}

static int check_share(const char *what, double share, double want, double tol)
{
    printf("graph %s: target %.0f%%, measured %.1f%%\n", what, want * 100, share * 100);
    if (share < want - tol || share > want + tol) {
        fprintf(stderr, "t_graph: %s share %.3f outside %.2f +/- %.2f\n", what, share, want, tol);
        return 1;
    }
    return 0;
}

/* One claim's process of `split`: ready after start-up, goes on the parent's word, reports its clocks. */
static int work(const char *arg)
{
    char kind[16];
    int n, up, down;
    CHECK(sscanf(arg, "%15[a-z],%d,%d,%d", kind, &n, &up, &down) == 4);
    vt_ctx(0);
    vt_send_byte(up);
    vt_expect_byte(down);
    double t0 = vt_now();
    run(kind, n);
    double t[2] = {t0, vt_now()};
    CHECK(write(up, t, sizeof t) == sizeof t);
    return 0;
}

static int split(const char *kind, int n)
{
    const char *pct[2] = {"30", "70"};
    char limit[2][64], cache[2][4096], arg[2][64];
    vt_chan ch[2];
    pid_t pid[2];
    const char *dir = getenv("VT_WORK");
    CHECK(dir);
    for (int i = 0; i < 2; i++) {
        vt_chan_open(&ch[i]);
        snprintf(limit[i], sizeof limit[i], "CUDA_DEVICE_SM_LIMIT=%s", pct[i]);
        snprintf(cache[i], sizeof cache[i], "CUDA_DEVICE_MEMORY_SHARED_CACHE=%s/split-%s-%s.cache", dir, kind, pct[i]);
        /* the 70 % claim runs proportionally more work, so both run about as long */
        snprintf(arg[i], sizeof arg[i], "%s,%d,%d,%d", kind, i ? n * 7 / 3 : n, ch[i].up[1], ch[i].down[0]);
        const char *env[] = {limit[i], cache[i], ""};
        pid[i] = vt_spawn("work", arg[i], env);
    }
    for (int i = 0; i < 2; i++)
        vt_expect_byte(ch[i].up[0]);
    for (int i = 0; i < 2; i++)
        vt_send_byte(ch[i].down[1]);
    double share[2];
    for (int i = 0; i < 2; i++) {
        double t[2];
        CHECK(read(ch[i].up[0], t, sizeof t) == sizeof t);
        CHECK_EQ(vt_wait(pid[i]), 0);
        share[i] = (i ? n * 7 / 3 : n) * NODES * vt_kernel_s() / (t[1] - t[0]);
    }
    char what[64];
    int bad = 0;
    snprintf(what, sizeof what, "%s, claim at 30%%", kind);
    bad |= check_share(what, share[0], 0.30, 0.10);
    snprintf(what, sizeof what, "%s, claim at 70%%", kind);
    bad |= check_share(what, share[1], 0.70, 0.10);
    snprintf(what, sizeof what, "%s, split of the two", kind);
    bad |= check_share(what, share[0] / (share[0] + share[1]), 0.30, 0.05);
    return bad;
}

/* A graph: kernel, allocate `bytes`, kernel, free. Built node by node, or captured from a stream. */
static CUgraph mem_graph(CUfunction fn, CUstream s, uint64_t bytes, int captured)
{
    CUgraph g;
    if (captured) {
        OK(cuStreamBeginCapture_v2(s, 0));
        CUdeviceptr p;
        OK(cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL));
        OK(cuMemAllocAsync(&p, bytes, s));
        CHECK_EQ(vt_used(), 0); /* captured, not allocated: the graph takes it when it runs */
        OK(cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL));
        OK(cuMemFreeAsync(p, s));
        OK(cuStreamEndCapture(s, &g));
        return g;
    }
    OK(cuGraphCreate(&g, 0));
    CUDA_KERNEL_NODE_PARAMS kp = kparams(fn);
    CUgraphNode k1, a, k2, f;
    OK(cuGraphAddKernelNode(&k1, g, NULL, 0, &kp));
    CUDA_MEM_ALLOC_NODE_PARAMS ap;
    memset(&ap, 0, sizeof ap);
    ap.poolProps.allocType = 1;
    ap.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    ap.poolProps.location.id = 0;
    ap.bytesize = bytes;
    OK(cuGraphAddMemAllocNode(&a, g, &k1, 1, &ap));
    CHECK(ap.dptr != 0);
    OK(cuGraphAddKernelNode(&k2, g, &a, 1, &kp));
    OK(cuGraphAddMemFreeNode(&f, g, &k2, 1, ap.dptr));
    CHECK_EQ(vt_used(), 0); /* an address, not memory */
    return g;
}

static void mem_case(CUfunction fn, CUstream s, int captured)
{
    uint64_t graph_bytes = captured ? 40 * MiB : 48 * MiB;
    CUgraph g = mem_graph(fn, s, graph_bytes, captured);
    CUgraphExec e;
    OK(cuGraphInstantiateWithFlags(&e, g, 0));
    CUdeviceptr held;
    OK(cuMemAlloc_v2(&held, 32 * MiB));
    uint64_t card = tessera_sim_card_used(0);
    /* 32 MiB held + the graph's memory > 64 MiB: the launch fails as a CUDA program expects */
    CHECK_RC(cuGraphLaunch(e, s), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK_RC(cuGraphLaunch_ptsz(e, NULL), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK_EQ(tessera_sim_card_used(0), card); /* nothing taken */
    CHECK_EQ(vt_used(), 32 * MiB);
    OK(cuMemFree_v2(held));
    OK(cuGraphLaunch(e, s));
    OK(cuStreamSynchronize(s));
    CHECK_EQ(vt_used(), graph_bytes); /* the graph pool keeps it for the next launch */
    OK(cuGraphLaunch(e, s));
    CHECK_EQ(vt_used(), graph_bytes); /* once per exec, not per launch */
    CHECK_RC(cuMemAlloc_v2(&held, 64 * MiB - graph_bytes + 1), CUDA_ERROR_OUT_OF_MEMORY);
    /* kernel-node updates and whole-graph updates pass through */
    if (!captured) {
        CUgraphNode nodes[4];
        size_t nn = 4;
        OK(cuGraphGetNodes(g, nodes, &nn));
        CHECK_EQ(nn, 4);
        CUDA_KERNEL_NODE_PARAMS kp = kparams(fn);
        kp.gridDimX = 64;
        OK(cuGraphExecKernelNodeSetParams(e, nodes[0], &kp));
        CUgraphExecUpdateResultInfo info;
        OK(cuGraphExecUpdate_v2(e, g, &info));
        CHECK_EQ(info.result, CU_GRAPH_EXEC_UPDATE_SUCCESS);
        OK(cuGraphLaunch(e, s));
    }
    OK(cuCtxSynchronize());
    OK(cuGraphExecDestroy(e));
    CHECK_EQ(vt_used(), 0);
    OK(cuGraphDestroy(g));
    /* a graph whose memory alone is over the limit never runs */
    g = mem_graph(fn, s, 64 * MiB + 2 * MiB, captured);
    OK(cuGraphInstantiateWithFlags(&e, g, 0));
    CHECK_RC(cuGraphLaunch(e, s), CUDA_ERROR_OUT_OF_MEMORY);
    OK(cuGraphExecDestroy(e));
    OK(cuGraphDestroy(g));
    CHECK_EQ(vt_used(), 0);
}

int main(int argc, char **argv)
{
    CHECK(argc >= 2);
    if (!strcmp(argv[1], "work"))
        return work(argv[2]);
    if (!strcmp(argv[1], "mem")) {
        vt_ctx(0);
        CUfunction fn = vt_kernel();
        CUstream s;
        OK(cuStreamCreate(&s, 0));
        mem_case(fn, s, 0);
        mem_case(fn, s, 1);
        printf("graph memory: charged at first launch, refused over the limit, returned with the exec\n");
        return 0;
    }
    CHECK(argc == 4);
    if (!strcmp(argv[1], "split"))
        return split(argv[2], atoi(argv[3]));
    CHECK(!strcmp(argv[1], "sm"));
    double want = atof(argv[2]) / 100;
    int n = atoi(argv[3]);
    vt_ctx(0);
    double t0 = vt_now();
    run("graph", n);
    return check_share("one process", n * NODES * vt_kernel_s() / (vt_now() - t0), want, 0.10);
}
