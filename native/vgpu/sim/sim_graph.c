/* sim_graph.c: CUDA graphs in the simulated driver, so that libvgpu's graph hooks (the SM-share limiter
 * on cuGraphLaunch, graph memory charged against a claim) run in CI. A graph holds kernel nodes and
 * memory nodes, built node by node or by capturing a stream (launches and cuMemAllocAsync/FreeAsync
 * on a capturing stream become nodes). Instantiating copies the kernel nodes into an executable graph;
 * launching one runs its kernels on the device timeline, one after another.
 *
 * Memory nodes behave as the driver documents: cuGraphAddMemAllocNode hands out a fixed address at
 * once, while the physical memory comes from the device's graph pool when the graph first runs, and
 * stays with that executable graph until it is destroyed or cuDeviceGraphMemTrim gives it back. A
 * launch that needs memory the card no longer has fails with CUDA_ERROR_OUT_OF_MEMORY. Dependencies
 * are checked for validity and otherwise ignored: nodes run in the order they were added. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "cuda_api.h"
#include "sim_common.h"
#include "sim_cuda.h"

struct CUgraphNode_st {
    int magic;
    CUgraphNodeType type;
    CUgraph graph;
    CUfunction fn;              /* kernel */
    unsigned int dims[6];
    int dev;                    /* memory alloc */
    uint64_t bytes;
    CUdeviceptr dptr;           /* memory alloc and free */
    CUDA_MEM_ALLOC_NODE_PARAMS params;
};

struct CUgraph_st {
    int magic;
    CUgraphNode *nodes;
    size_t n, cap;
};

typedef struct { CUgraphNode src; CUfunction fn; unsigned int dims[6]; } exec_kernel;

struct CUgraphExec_st {
    int magic;
    CUgraph graph;              /* the graph it was instantiated from (for kernel-node updates) */
    exec_kernel *kernels;
    size_t nkernels;
    uint64_t mem[SIM_MAX_DEVICES]; /* graph memory per device, taken from the card at first launch */
    int held;
    struct CUgraphExec_st *next;
};

static pthread_mutex_t gmu = PTHREAD_MUTEX_INITIALIZER;
static struct CUgraphExec_st *execs; /* every live executable graph, for cuDeviceGraphMemTrim */

static int graph_ok(CUgraph g) { return g && g->magic == MAGIC; }
static int exec_ok(CUgraphExec e) { return e && e->magic == MAGIC; }

static CUresult deps_ok(CUgraph g, const CUgraphNode *deps, size_t ndeps)
{
    if (ndeps && !deps)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < ndeps; i++)
        if (!deps[i] || deps[i]->magic != MAGIC || deps[i]->graph != g)
            return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

/* under gmu */
static CUgraphNode add_node(CUgraph g, CUgraphNodeType type)
{
    if (g->n == g->cap) {
        size_t cap = g->cap ? 2 * g->cap : 16;
        CUgraphNode *n = realloc(g->nodes, cap * sizeof *n);
        if (!n)
            return NULL;
        g->nodes = n;
        g->cap = cap;
    }
    CUgraphNode node = calloc(1, sizeof *node);
    if (!node)
        return NULL;
    node->magic = MAGIC;
    node->type = type;
    node->graph = g;
    g->nodes[g->n++] = node;
    return node;
}

CUAPI CUresult cuGraphCreate(CUgraph *graph, unsigned int flags)
{
    int dev;
    if (!graph || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = sim_current_device(&dev);
    if (r != CUDA_SUCCESS)
        return r;
    CUgraph g = calloc(1, sizeof *g);
    if (!g)
        return CUDA_ERROR_OUT_OF_MEMORY;
    g->magic = MAGIC;
    *graph = g;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuGraphDestroy(CUgraph graph)
{
    if (!graph_ok(graph))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&gmu);
    for (size_t i = 0; i < graph->n; i++) {
        CUgraphNode n = graph->nodes[i];
        if (n->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC)
            munmap((void *)(uintptr_t)n->dptr, n->bytes); /* the address only: the memory is the exec's */
        n->magic = 0;
        free(n);
    }
    for (struct CUgraphExec_st *e = execs; e; e = e->next)
        if (e->graph == graph)
            e->graph = NULL;
    free(graph->nodes);
    graph->magic = 0;
    free(graph);
    pthread_mutex_unlock(&gmu);
    return CUDA_SUCCESS;
}

static CUresult kernel_params_ok(CUfunction f, const unsigned int d[6])
{
    if (!sim_function_ok(f))
        return CUDA_ERROR_INVALID_VALUE;
    if (!d[0] || !d[1] || !d[2] || !d[3] || !d[4] || !d[5] || (uint64_t)d[3] * d[4] * d[5] > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

static CUresult add_kernel(CUgraphNode *out, CUgraph g, const CUgraphNode *deps, size_t ndeps, CUfunction f,
                           const unsigned int dims[6])
{
    int dev;
    CUresult r = sim_current_device(&dev);
    if (r != CUDA_SUCCESS)
        return r;
    if (!graph_ok(g))
        return CUDA_ERROR_INVALID_VALUE;
    if ((r = deps_ok(g, deps, ndeps)) != CUDA_SUCCESS || (r = kernel_params_ok(f, dims)) != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&gmu);
    CUgraphNode n = add_node(g, CU_GRAPH_NODE_TYPE_KERNEL);
    if (n) {
        n->fn = f;
        memcpy(n->dims, dims, sizeof n->dims);
    }
    pthread_mutex_unlock(&gmu);
    if (!n)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (out)
        *out = n;
    return CUDA_SUCCESS;
}

#define DIMS(p) {(p)->gridDimX, (p)->gridDimY, (p)->gridDimZ, (p)->blockDimX, (p)->blockDimY, (p)->blockDimZ}

CUAPI CUresult cuGraphAddKernelNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps, size_t ndeps,
                                    const CUDA_KERNEL_NODE_PARAMS *params)
{
    if (!node || !params)
        return CUDA_ERROR_INVALID_VALUE;
    const unsigned int dims[6] = DIMS(params);
    return add_kernel(node, graph, deps, ndeps, params->func, dims);
}

CUAPI CUresult cuGraphAddKernelNode_v2(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps, size_t ndeps,
                                       const CUDA_KERNEL_NODE_PARAMS_v2 *params)
{
    if (!node || !params)
        return CUDA_ERROR_INVALID_VALUE;
    const unsigned int dims[6] = DIMS(params);
    return add_kernel(node, graph, deps, ndeps, params->func, dims);
}

static CUresult add_alloc(CUgraphNode *out, CUgraph g, int dev, uint64_t bytes, CUDA_MEM_ALLOC_NODE_PARAMS *p)
{
    /* the address is fixed now; the memory behind it is taken when the graph runs */
    void *va = mmap(NULL, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (va == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&gmu);
    CUgraphNode n = add_node(g, CU_GRAPH_NODE_TYPE_MEM_ALLOC);
    if (n) {
        n->dev = dev;
        n->bytes = bytes;
        n->dptr = (CUdeviceptr)(uintptr_t)va;
        if (p)
            n->params = *p;
        n->params.bytesize = bytes;
        n->params.dptr = n->dptr;
    }
    pthread_mutex_unlock(&gmu);
    if (!n) {
        munmap(va, bytes);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (out)
        *out = n;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuGraphAddMemAllocNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps, size_t ndeps,
                                      CUDA_MEM_ALLOC_NODE_PARAMS *params)
{
    int dev;
    CUresult r;
    if (!node || !params || !params->bytesize || params->poolProps.location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if ((r = sim_current_device(&dev)) != CUDA_SUCCESS)
        return r;
    if (!graph_ok(graph) || (r = deps_ok(graph, deps, ndeps)) != CUDA_SUCCESS)
        return CUDA_ERROR_INVALID_VALUE;
    dev = params->poolProps.location.id;
    if (dev < 0 || dev >= sim_device_count())
        return CUDA_ERROR_INVALID_DEVICE;
    if ((r = add_alloc(node, graph, dev, params->bytesize, params)) == CUDA_SUCCESS)
        params->dptr = (*node)->dptr;
    return r;
}

/* under gmu: the alloc node of `g` whose allocation is `dptr` and not yet freed in `g` */
static CUgraphNode alloc_of(CUgraph g, CUdeviceptr dptr)
{
    CUgraphNode found = NULL;
    for (size_t i = 0; i < g->n; i++) {
        CUgraphNode n = g->nodes[i];
        if (n->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC && n->dptr == dptr)
            found = n;
        else if (n->type == CU_GRAPH_NODE_TYPE_MEM_FREE && n->dptr == dptr)
            found = NULL;
    }
    return found;
}

static CUresult add_free(CUgraphNode *out, CUgraph g, CUdeviceptr dptr)
{
    pthread_mutex_lock(&gmu);
    CUgraphNode n = NULL;
    CUresult r = CUDA_ERROR_INVALID_VALUE; /* only this graph's own allocations are freed by its nodes here */
    if (alloc_of(g, dptr) && (n = add_node(g, CU_GRAPH_NODE_TYPE_MEM_FREE)) != NULL) {
        n->dptr = dptr;
        r = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&gmu);
    if (r == CUDA_SUCCESS && out)
        *out = n;
    return r;
}

CUAPI CUresult cuGraphAddMemFreeNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps, size_t ndeps,
                                     CUdeviceptr dptr)
{
    int dev;
    CUresult r;
    if (!node || !dptr)
        return CUDA_ERROR_INVALID_VALUE;
    if ((r = sim_current_device(&dev)) != CUDA_SUCCESS)
        return r;
    if (!graph_ok(graph) || deps_ok(graph, deps, ndeps) != CUDA_SUCCESS)
        return CUDA_ERROR_INVALID_VALUE;
    return add_free(node, graph, dptr);
}

CUAPI CUresult cuGraphGetNodes(CUgraph graph, CUgraphNode *nodes, size_t *numNodes)
{
    if (!graph_ok(graph) || !numNodes)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&gmu);
    if (nodes) {
        size_t k = *numNodes < graph->n ? *numNodes : graph->n;
        memcpy(nodes, graph->nodes, k * sizeof *nodes);
        for (size_t i = k; i < *numNodes; i++)
            nodes[i] = NULL;
        *numNodes = k;
    } else {
        *numNodes = graph->n;
    }
    pthread_mutex_unlock(&gmu);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuGraphNodeGetType(CUgraphNode node, CUgraphNodeType *type)
{
    if (!node || node->magic != MAGIC || !type)
        return CUDA_ERROR_INVALID_VALUE;
    *type = node->type;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuGraphMemAllocNodeGetParams(CUgraphNode node, CUDA_MEM_ALLOC_NODE_PARAMS *params)
{
    if (!node || node->magic != MAGIC || node->type != CU_GRAPH_NODE_TYPE_MEM_ALLOC || !params)
        return CUDA_ERROR_INVALID_VALUE;
    *params = node->params;
    return CUDA_SUCCESS;
}

/* ---- stream capture ------------------------------------------------------------------------ */

CUresult sim_capture_kernel(CUgraph g, CUfunction f, const unsigned int dims[6])
{
    return add_kernel(NULL, g, NULL, 0, f, dims);
}

CUresult sim_capture_alloc(CUgraph g, int dev, uint64_t bytes, CUdeviceptr *dptr)
{
    CUgraphNode n;
    CUresult r = add_alloc(&n, g, dev, bytes, NULL);
    if (r == CUDA_SUCCESS) {
        n->params.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        n->params.poolProps.location.id = dev;
        *dptr = n->dptr;
    }
    return r;
}

CUresult sim_capture_free(CUgraph g, CUdeviceptr dptr) { return add_free(NULL, g, dptr); }

CUAPI CUresult cuStreamBeginCapture_v2(CUstream stream, CUstreamCaptureMode mode)
{
    int dev;
    CUresult r = sim_current_device(&dev);
    if (r != CUDA_SUCCESS)
        return r;
    if (mode < 0 || mode > 2)
        return CUDA_ERROR_INVALID_VALUE;
    if (!stream || stream == CU_STREAM_LEGACY || stream == CU_STREAM_PER_THREAD)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; /* the sim captures created streams only */
    if (stream->magic != MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    if (stream->capture)
        return CUDA_ERROR_ILLEGAL_STATE;
    return cuGraphCreate(&stream->capture, 0);
}
CUAPI CUresult cuStreamBeginCapture_v2_ptsz(CUstream stream, CUstreamCaptureMode mode)
{
    return cuStreamBeginCapture_v2(stream, mode);
}

CUAPI CUresult cuStreamEndCapture(CUstream stream, CUgraph *graph)
{
    if (!graph)
        return CUDA_ERROR_INVALID_VALUE;
    CUgraph g = sim_capturing(stream);
    if (!g)
        return CUDA_ERROR_ILLEGAL_STATE;
    stream->capture = NULL;
    *graph = g;
    return CUDA_SUCCESS;
}
CUAPI CUresult cuStreamEndCapture_ptsz(CUstream stream, CUgraph *graph) { return cuStreamEndCapture(stream, graph); }

/* ---- executable graphs --------------------------------------------------------------------- */

/* under gmu: the exec's kernels and memory from its graph's nodes */
static CUresult fill_exec(struct CUgraphExec_st *e, CUgraph g)
{
    size_t nk = 0;
    for (size_t i = 0; i < g->n; i++)
        nk += g->nodes[i]->type == CU_GRAPH_NODE_TYPE_KERNEL;
    exec_kernel *k = nk ? calloc(nk, sizeof *k) : NULL;
    if (nk && !k)
        return CUDA_ERROR_OUT_OF_MEMORY;
    memset(e->mem, 0, sizeof e->mem);
    for (size_t i = 0, j = 0; i < g->n; i++) {
        CUgraphNode n = g->nodes[i];
        if (n->type == CU_GRAPH_NODE_TYPE_KERNEL) {
            k[j].src = n;
            k[j].fn = n->fn;
            memcpy(k[j].dims, n->dims, sizeof n->dims);
            j++;
        } else if (n->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC) {
            e->mem[n->dev] += n->bytes;
        }
    }
    free(e->kernels);
    e->kernels = k;
    e->nkernels = nk;
    return CUDA_SUCCESS;
}

static CUresult instantiate(CUgraphExec *exec, CUgraph graph)
{
    int dev;
    CUresult r;
    if (!exec)
        return CUDA_ERROR_INVALID_VALUE;
    if ((r = sim_current_device(&dev)) != CUDA_SUCCESS)
        return r;
    if (!graph_ok(graph))
        return CUDA_ERROR_INVALID_VALUE;
    struct CUgraphExec_st *e = calloc(1, sizeof *e);
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&gmu);
    r = fill_exec(e, graph);
    if (r == CUDA_SUCCESS) {
        e->magic = MAGIC;
        e->graph = graph;
        e->next = execs;
        execs = e;
    }
    pthread_mutex_unlock(&gmu);
    if (r != CUDA_SUCCESS) {
        free(e);
        return r;
    }
    *exec = e;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuGraphInstantiate(CUgraphExec *exec, CUgraph graph, CUgraphNode *errNode, char *log, size_t logSize)
{
    if (errNode)
        *errNode = NULL;
    if (log && logSize)
        log[0] = 0;
    return instantiate(exec, graph);
}
CUAPI CUresult cuGraphInstantiate_v2(CUgraphExec *exec, CUgraph graph, CUgraphNode *errNode, char *log,
                                     size_t logSize)
{
    return cuGraphInstantiate(exec, graph, errNode, log, logSize);
}
CUAPI CUresult cuGraphInstantiateWithFlags(CUgraphExec *exec, CUgraph graph, unsigned long long flags)
{
    if (flags & ~0xfULL) /* auto-free on launch, upload, device launch, use node priority */
        return CUDA_ERROR_INVALID_VALUE;
    return instantiate(exec, graph);
}
CUAPI CUresult cuGraphInstantiateWithParams(CUgraphExec *exec, CUgraph graph, CUDA_GRAPH_INSTANTIATE_PARAMS *params)
{
    if (!params)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = cuGraphInstantiateWithFlags(exec, graph, params->flags);
    params->hErrNode_out = NULL;
    params->result_out = r == CUDA_SUCCESS ? 0 : 1;
    return r;
}
CUAPI CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *exec, CUgraph graph,
                                                 CUDA_GRAPH_INSTANTIATE_PARAMS *params)
{
    return cuGraphInstantiateWithParams(exec, graph, params);
}

/* under gmu: the exec's graph memory from the card (the graph pool), once */
static CUresult hold_memory(struct CUgraphExec_st *e)
{
    if (e->held)
        return CUDA_SUCCESS;
    for (int d = 0; d < SIM_MAX_DEVICES; d++) {
        if (e->mem[d] && sim_take(d, e->mem[d])) {
            while (--d >= 0)
                if (e->mem[d])
                    sim_give(d, e->mem[d]);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    e->held = 1;
    return CUDA_SUCCESS;
}

/* under gmu */
static void drop_memory(struct CUgraphExec_st *e)
{
    if (!e->held)
        return;
    for (int d = 0; d < SIM_MAX_DEVICES; d++)
        if (e->mem[d])
            sim_give(d, e->mem[d]);
    e->held = 0;
}

CUAPI CUresult cuGraphLaunch(CUgraphExec exec, CUstream stream)
{
    int dev;
    CUresult r = sim_current_device(&dev);
    if (r != CUDA_SUCCESS)
        return r;
    if (!exec)
        return CUDA_ERROR_INVALID_VALUE;
    if (!exec_ok(exec))
        return CUDA_ERROR_INVALID_HANDLE;
    if (sim_capturing(stream))
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; /* a child graph node: not simulated */
    pthread_mutex_lock(&gmu);
    r = hold_memory(exec);
    int64_t kernels = (int64_t)exec->nkernels;
    pthread_mutex_unlock(&gmu);
    if (r == CUDA_SUCCESS && kernels)
        sim_run_kernels(dev, kernels);
    return r;
}
CUAPI CUresult cuGraphLaunch_ptsz(CUgraphExec exec, CUstream stream) { return cuGraphLaunch(exec, stream); }

static CUresult set_kernel(CUgraphExec exec, CUgraphNode node, CUfunction f, const unsigned int dims[6])
{
    if (!exec_ok(exec) || !node || node->magic != MAGIC || node->type != CU_GRAPH_NODE_TYPE_KERNEL)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = kernel_params_ok(f, dims);
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&gmu);
    r = CUDA_ERROR_INVALID_VALUE; /* not a node of the graph this exec was made from */
    for (size_t i = 0; i < exec->nkernels; i++) {
        if (exec->kernels[i].src == node) {
            exec->kernels[i].fn = f;
            memcpy(exec->kernels[i].dims, dims, sizeof exec->kernels[i].dims);
            r = CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&gmu);
    return r;
}

CUAPI CUresult cuGraphExecKernelNodeSetParams(CUgraphExec exec, CUgraphNode node, const CUDA_KERNEL_NODE_PARAMS *params)
{
    if (!params)
        return CUDA_ERROR_INVALID_VALUE;
    const unsigned int dims[6] = DIMS(params);
    return set_kernel(exec, node, params->func, dims);
}

CUAPI CUresult cuGraphExecKernelNodeSetParams_v2(CUgraphExec exec, CUgraphNode node,
                                                 const CUDA_KERNEL_NODE_PARAMS_v2 *params)
{
    if (!params)
        return CUDA_ERROR_INVALID_VALUE;
    const unsigned int dims[6] = DIMS(params);
    return set_kernel(exec, node, params->func, dims);
}

/* Update an exec in place from a graph of the same shape: same node types in the same order, memory
 * nodes unchanged (the driver does not update memory nodes). */
static CUresult exec_update(CUgraphExec exec, CUgraph graph, CUgraphExecUpdateResult *result, CUgraphNode *err)
{
    *result = CU_GRAPH_EXEC_UPDATE_ERROR;
    *err = NULL;
    if (!exec_ok(exec) || !graph_ok(graph))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&gmu);
    CUresult r = CUDA_SUCCESS;
    CUgraph old = exec->graph;
    if (!old || old->n != graph->n) {
        *result = CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED;
        r = CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE;
    }
    for (size_t i = 0; r == CUDA_SUCCESS && i < graph->n; i++) {
        CUgraphNode a = old->nodes[i], b = graph->nodes[i];
        if (a->type != b->type || (a->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC && (a->bytes != b->bytes || a->dev != b->dev))) {
            *result = a->type != b->type ? CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED : CU_GRAPH_EXEC_UPDATE_ERROR;
            *err = b;
            r = CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE;
        }
    }
    if (r == CUDA_SUCCESS) {
        for (size_t i = 0, j = 0; i < graph->n; i++) {
            CUgraphNode b = graph->nodes[i];
            if (b->type != CU_GRAPH_NODE_TYPE_KERNEL)
                continue;
            exec->kernels[j].fn = b->fn;
            memcpy(exec->kernels[j].dims, b->dims, sizeof b->dims);
            exec->kernels[j].src = b; /* later kernel-node updates name the new graph's nodes */
            j++;
        }
        exec->graph = graph;
        *result = CU_GRAPH_EXEC_UPDATE_SUCCESS;
    }
    pthread_mutex_unlock(&gmu);
    return r;
}

CUAPI CUresult cuGraphExecUpdate(CUgraphExec exec, CUgraph graph, CUgraphNode *errNode, CUgraphExecUpdateResult *result)
{
    if (!errNode || !result)
        return CUDA_ERROR_INVALID_VALUE;
    return exec_update(exec, graph, result, errNode);
}

CUAPI CUresult cuGraphExecUpdate_v2(CUgraphExec exec, CUgraph graph, CUgraphExecUpdateResultInfo *info)
{
    if (!info)
        return CUDA_ERROR_INVALID_VALUE;
    info->errorFromNode = NULL;
    return exec_update(exec, graph, &info->result, &info->errorNode);
}

CUAPI CUresult cuGraphExecDestroy(CUgraphExec exec)
{
    if (!exec_ok(exec))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&gmu);
    for (struct CUgraphExec_st **pp = &execs; *pp; pp = &(*pp)->next) {
        if (*pp == exec) {
            *pp = exec->next;
            break;
        }
    }
    drop_memory(exec);
    free(exec->kernels);
    exec->magic = 0;
    free(exec);
    pthread_mutex_unlock(&gmu);
    return CUDA_SUCCESS;
}

/* the graph pool gives its memory back; a later launch takes it again */
CUAPI CUresult cuDeviceGraphMemTrim(CUdevice dev)
{
    int cur;
    CUresult r = sim_current_device(&cur);
    if (r != CUDA_SUCCESS)
        return r;
    if (dev < 0 || dev >= sim_device_count())
        return CUDA_ERROR_INVALID_DEVICE;
    cuCtxSynchronize();
    pthread_mutex_lock(&gmu);
    for (struct CUgraphExec_st *e = execs; e; e = e->next)
        if (e->mem[dev])
            drop_memory(e); /* all of the exec's graph memory: its next launch takes it again */
    pthread_mutex_unlock(&gmu);
    return CUDA_SUCCESS;
}
