/* hooks_graph.c: CUDA graphs under the claim. vLLM, TensorRT-LLM, SGLang and torch.cuda.graphs run
 * their steady state as graph launches, so a limiter that meters only cuLaunchKernel leaves the
 * workloads most likely to share a GPU unlimited, and graph memory nodes take device memory that no
 * allocation call names.
 *
 * - cuGraphLaunch(_ptsz) goes through the SM-share limiter like a kernel launch (limiter.c), with an
 *   estimate per executable graph.
 * - Graph memory (cuGraphAddMemAllocNode, and cuMemAllocAsync captured from a stream) is what the
 *   driver takes from its graph pool when the graph first runs and keeps for the exec's later
 *   launches. At instantiation the exec's memory nodes are read back from the driver (so captured
 *   allocations count too); the sum is charged at the exec's first launch, which fails with
 *   CUDA_ERROR_OUT_OF_MEMORY past the limit without reaching the driver, and returned when the exec
 *   is destroyed. Nothing is charged while a stream is captured: that work runs only with the graph. */
#include <stdlib.h>

#include "vgpu.h"

int vgpu_capturing(CUstream stream, int ptds)
{
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
    CUresult (*is_capturing)(CUstream, CUstreamCaptureStatus *) =
        ptds && vgpu_drv.cuStreamIsCapturing_ptsz ? vgpu_drv.cuStreamIsCapturing_ptsz : vgpu_drv.cuStreamIsCapturing;
    /* a stream the driver cannot say about is treated as capturing: it neither meters nor charges */
    return is_capturing && (is_capturing(stream, &cs) != CUDA_SUCCESS || cs != CU_STREAM_CAPTURE_STATUS_NONE);
}

/* The bytes of the memory nodes of `g` and of its child graphs (depth-limited against cycles). */
static uint64_t graph_memory(CUgraph g, int depth)
{
    size_t n = 0;
    if (depth > 8 || !vgpu_drv.cuGraphGetNodes || !vgpu_drv.cuGraphNodeGetType ||
        vgpu_drv.cuGraphGetNodes(g, NULL, &n) != CUDA_SUCCESS || !n)
        return 0;
    CUgraphNode *nodes = calloc(n, sizeof *nodes);
    if (!nodes || vgpu_drv.cuGraphGetNodes(g, nodes, &n) != CUDA_SUCCESS) {
        free(nodes);
        return 0;
    }
    uint64_t bytes = 0;
    for (size_t i = 0; i < n; i++) {
        CUgraphNodeType t;
        if (vgpu_drv.cuGraphNodeGetType(nodes[i], &t) != CUDA_SUCCESS)
            continue;
        CUDA_MEM_ALLOC_NODE_PARAMS p;
        CUgraph child;
        if (t == CU_GRAPH_NODE_TYPE_MEM_ALLOC && vgpu_drv.cuGraphMemAllocNodeGetParams &&
            vgpu_drv.cuGraphMemAllocNodeGetParams(nodes[i], &p) == CUDA_SUCCESS)
            bytes += p.bytesize;
        else if (t == CU_GRAPH_NODE_TYPE_GRAPH && vgpu_drv.cuGraphChildGraphNodeGetGraph &&
                 vgpu_drv.cuGraphChildGraphNodeGetGraph(nodes[i], &child) == CUDA_SUCCESS)
            bytes += graph_memory(child, depth + 1);
    }
    free(nodes);
    return bytes;
}

/* after a successful instantiation: what the exec's first launch must be charged */
static void instantiated(CUgraphExec exec, CUgraph graph)
{
    int dev = vgpu_current_device();
    uint64_t bytes = dev == -1 ? 0 : graph_memory(graph, 0);
    if (bytes)
        allocs_put(ALLOC_GRAPH_DUE, (uint64_t)(uintptr_t)exec, dev, bytes);
}

#define INSTANTIATE_WRAPPER(sym, call_args, ...)                                                     \
    VGPU_EXPORT CUresult sym(CUgraphExec *exec, CUgraph graph, __VA_ARGS__)                          \
    {                                                                                                \
        VGPU_ENTER(sym);                                                                             \
        CUresult r = REAL(sym) call_args;                                                            \
        if (r == CUDA_SUCCESS && exec)                                                               \
            instantiated(*exec, graph);                                                              \
        return r;                                                                                    \
    }

INSTANTIATE_WRAPPER(cuGraphInstantiate, (exec, graph, errNode, log, logSize), CUgraphNode *errNode, char *log,
                    size_t logSize)
INSTANTIATE_WRAPPER(cuGraphInstantiate_v2, (exec, graph, errNode, log, logSize), CUgraphNode *errNode, char *log,
                    size_t logSize)
INSTANTIATE_WRAPPER(cuGraphInstantiateWithFlags, (exec, graph, flags), unsigned long long flags)
INSTANTIATE_WRAPPER(cuGraphInstantiateWithParams, (exec, graph, params), CUDA_GRAPH_INSTANTIATE_PARAMS *params)
INSTANTIATE_WRAPPER(cuGraphInstantiateWithParams_ptsz, (exec, graph, params), CUDA_GRAPH_INSTANTIATE_PARAMS *params)

static CUresult graph_launch(CUresult (*real)(CUgraphExec, CUstream), CUgraphExec exec, CUstream stream, int ptds)
{
    int dev = -1;
    uint64_t bytes = 0, key = (uint64_t)(uintptr_t)exec;
    /* a launch into a capturing stream only adds the graph to another graph: that one is charged */
    if (exec && allocs_take(ALLOC_GRAPH_DUE, key, &dev, &bytes) && !vgpu_capturing(stream, ptds)) {
        if (ledger_reserve(dev, bytes)) {
            allocs_put(ALLOC_GRAPH_DUE, key, dev, bytes);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    } else if (bytes) {
        allocs_put(ALLOC_GRAPH_DUE, key, dev, bytes);
        bytes = 0;
    }
    vgpu_launch l;
    int metered = exec && limiter_begin(&l, stream, ptds, key);
    CUresult r = real(exec, stream);
    if (metered)
        limiter_end(&l, r);
    if (bytes && r == CUDA_SUCCESS) {
        allocs_put(ALLOC_GRAPH_HELD, key, dev, bytes);
    } else if (bytes) {
        ledger_release(dev, bytes);
        allocs_put(ALLOC_GRAPH_DUE, key, dev, bytes);
    }
    return r;
}

VGPU_EXPORT CUresult cuGraphLaunch(CUgraphExec exec, CUstream stream)
{
    VGPU_ENTER(cuGraphLaunch);
    return graph_launch(REAL(cuGraphLaunch), exec, stream, 0);
}

VGPU_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec exec, CUstream stream)
{
    VGPU_ENTER(cuGraphLaunch_ptsz);
    return graph_launch(REAL(cuGraphLaunch_ptsz), exec, stream, 1);
}

VGPU_EXPORT CUresult cuGraphExecDestroy(CUgraphExec exec)
{
    VGPU_ENTER(cuGraphExecDestroy);
    CUresult r = REAL(cuGraphExecDestroy)(exec);
    int dev;
    uint64_t bytes, key = (uint64_t)(uintptr_t)exec;
    if (r == CUDA_SUCCESS) {
        allocs_take(ALLOC_GRAPH_DUE, key, &dev, &bytes);
        if (allocs_take(ALLOC_GRAPH_HELD, key, &dev, &bytes))
            ledger_release(dev, bytes);
    }
    return r;
}
