/* cuda_api.h: prototypes of the CUDA driver and NVML entry points that libvgpu wraps or calls and that
 * the simulated driver implements. One set of prototypes for both sides means the compiler checks that
 * a wrapper, the simulated driver and the real ABI agree on every signature. */
#ifndef TESSERA_CUDA_API_H
#define TESSERA_CUDA_API_H

#include "cuda_types.h"

#define CUAPI __attribute__((visibility("default")))

/* initialisation, devices, contexts */
CUAPI CUresult cuInit(unsigned int flags);
CUAPI CUresult cuDriverGetVersion(int *version);
CUAPI CUresult cuDeviceGet(CUdevice *dev, int ordinal);
CUAPI CUresult cuDeviceGetCount(int *count);
CUAPI CUresult cuDeviceGetName(char *name, int len, CUdevice dev);
CUAPI CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev);
CUAPI CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev);
CUAPI CUresult cuDeviceGetAttribute(int *value, int attrib, CUdevice dev);
CUAPI CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev);
CUAPI CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev);
CUAPI CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned int flags, CUdevice dev);
CUAPI CUresult cuCtxCreate_v3(CUcontext *ctx, CUexecAffinityParam *params, int numParams, unsigned int flags,
                              CUdevice dev);
CUAPI CUresult cuCtxCreate_v4(CUcontext *ctx, CUctxCreateParams *params, unsigned int flags, CUdevice dev);
CUAPI CUresult cuCtxDestroy_v2(CUcontext ctx);
CUAPI CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev);
CUAPI CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev);
CUAPI CUresult cuCtxSetCurrent(CUcontext ctx);
CUAPI CUresult cuCtxGetCurrent(CUcontext *ctx);
CUAPI CUresult cuCtxGetDevice(CUdevice *dev);
CUAPI CUresult cuCtxSynchronize(void);
CUAPI CUresult cuGetErrorString(CUresult error, const char **str);
CUAPI CUresult cuGetErrorName(CUresult error, const char **str);
CUAPI CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
CUAPI CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                   CUdriverProcAddressQueryResult *symbolStatus);

/* memory */
CUAPI CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize);
CUAPI CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUAPI CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pitch, unsigned int width, unsigned int height,
                               unsigned int elementSize);
CUAPI CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                                  unsigned int elementSize);
CUAPI CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags);
CUAPI CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream stream);
CUAPI CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream stream);
CUAPI CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream stream);
CUAPI CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream stream);
CUAPI CUresult cuMemFree(CUdeviceptr_v1 dptr);
CUAPI CUresult cuMemFree_v2(CUdeviceptr dptr);
CUAPI CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream stream);
CUAPI CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream);
CUAPI CUresult cuMemGetInfo(unsigned int *free_bytes, unsigned int *total_bytes);
CUAPI CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes);
CUAPI CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props);
CUAPI CUresult cuMemPoolDestroy(CUmemoryPool pool);
CUAPI CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev);
CUAPI CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev);
CUAPI CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep);
CUAPI CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value);
CUAPI CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value);
CUAPI CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                           unsigned long long flags);
CUAPI CUresult cuMemRelease(CUmemGenericAllocationHandle handle);
CUAPI CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                        unsigned long long flags);
CUAPI CUresult cuMemUnmap(CUdeviceptr ptr, size_t size);
CUAPI CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                   unsigned long long flags);
CUAPI CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size);
CUAPI CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop, int option);
CUAPI CUresult cuArrayCreate(CUarray *arr, const CUDA_ARRAY_DESCRIPTOR_v1 *desc);
CUAPI CUresult cuArrayCreate_v2(CUarray *arr, const CUDA_ARRAY_DESCRIPTOR *desc);
CUAPI CUresult cuArray3DCreate(CUarray *arr, const CUDA_ARRAY3D_DESCRIPTOR_v1 *desc);
CUAPI CUresult cuArray3DCreate_v2(CUarray *arr, const CUDA_ARRAY3D_DESCRIPTOR *desc);
CUAPI CUresult cuArrayDestroy(CUarray arr);
CUAPI CUresult cuMipmappedArrayCreate(CUmipmappedArray *arr, const CUDA_ARRAY3D_DESCRIPTOR *desc,
                                      unsigned int numLevels);
CUAPI CUresult cuMipmappedArrayDestroy(CUmipmappedArray arr);

/* modules, launches, streams, events */
CUAPI CUresult cuModuleLoadData(CUmodule *mod, const void *image);
CUAPI CUresult cuModuleLoadDataEx(CUmodule *mod, const void *image, unsigned int numOptions, int *options,
                                  void **optionValues);
CUAPI CUresult cuModuleLoad(CUmodule *mod, const char *fname);
CUAPI CUresult cuModuleUnload(CUmodule mod);
CUAPI CUresult cuModuleGetFunction(CUfunction *fn, CUmodule mod, const char *name);
#define TESSERA_LAUNCH_ARGS CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ, \
    unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ, unsigned int sharedMemBytes, \
    CUstream hStream
CUAPI CUresult cuLaunchKernel(TESSERA_LAUNCH_ARGS, void **kernelParams, void **extra);
CUAPI CUresult cuLaunchKernel_ptsz(TESSERA_LAUNCH_ARGS, void **kernelParams, void **extra);
CUAPI CUresult cuLaunchCooperativeKernel(TESSERA_LAUNCH_ARGS, void **kernelParams);
CUAPI CUresult cuLaunchCooperativeKernel_ptsz(TESSERA_LAUNCH_ARGS, void **kernelParams);
CUAPI CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra);
CUAPI CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra);
CUAPI CUresult cuStreamCreate(CUstream *stream, unsigned int flags);
CUAPI CUresult cuStreamDestroy_v2(CUstream stream);
CUAPI CUresult cuStreamSynchronize(CUstream stream);
CUAPI CUresult cuStreamSynchronize_ptsz(CUstream stream);
CUAPI CUresult cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus *status);
CUAPI CUresult cuStreamIsCapturing_ptsz(CUstream stream, CUstreamCaptureStatus *status);
CUAPI CUresult cuEventCreate(CUevent *ev, unsigned int flags);
CUAPI CUresult cuEventDestroy_v2(CUevent ev);
CUAPI CUresult cuEventRecord(CUevent ev, CUstream stream);
CUAPI CUresult cuEventRecord_ptsz(CUevent ev, CUstream stream);
CUAPI CUresult cuEventQuery(CUevent ev);
CUAPI CUresult cuEventSynchronize(CUevent ev);
CUAPI CUresult cuEventElapsedTime(float *ms, CUevent start, CUevent end);
CUAPI CUresult cuEventElapsedTime_v2(float *ms, CUevent start, CUevent end);

CUAPI CUresult cuStreamBeginCapture_v2(CUstream stream, CUstreamCaptureMode mode);
CUAPI CUresult cuStreamBeginCapture_v2_ptsz(CUstream stream, CUstreamCaptureMode mode);
CUAPI CUresult cuStreamEndCapture(CUstream stream, CUgraph *graph);
CUAPI CUresult cuStreamEndCapture_ptsz(CUstream stream, CUgraph *graph);

/* graphs */
CUAPI CUresult cuGraphCreate(CUgraph *graph, unsigned int flags);
CUAPI CUresult cuGraphDestroy(CUgraph graph);
CUAPI CUresult cuGraphAddKernelNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps, size_t ndeps,
                                    const CUDA_KERNEL_NODE_PARAMS *params);
CUAPI CUresult cuGraphAddKernelNode_v2(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps, size_t ndeps,
                                       const CUDA_KERNEL_NODE_PARAMS_v2 *params);
CUAPI CUresult cuGraphAddMemAllocNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps, size_t ndeps,
                                      CUDA_MEM_ALLOC_NODE_PARAMS *params);
CUAPI CUresult cuGraphAddMemFreeNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps, size_t ndeps,
                                     CUdeviceptr dptr);
CUAPI CUresult cuGraphGetNodes(CUgraph graph, CUgraphNode *nodes, size_t *numNodes);
CUAPI CUresult cuGraphNodeGetType(CUgraphNode node, CUgraphNodeType *type);
CUAPI CUresult cuGraphMemAllocNodeGetParams(CUgraphNode node, CUDA_MEM_ALLOC_NODE_PARAMS *params);
CUAPI CUresult cuGraphInstantiate(CUgraphExec *exec, CUgraph graph, CUgraphNode *errNode, char *log, size_t logSize);
CUAPI CUresult cuGraphInstantiate_v2(CUgraphExec *exec, CUgraph graph, CUgraphNode *errNode, char *log,
                                     size_t logSize);
CUAPI CUresult cuGraphInstantiateWithFlags(CUgraphExec *exec, CUgraph graph, unsigned long long flags);
CUAPI CUresult cuGraphInstantiateWithParams(CUgraphExec *exec, CUgraph graph, CUDA_GRAPH_INSTANTIATE_PARAMS *params);
CUAPI CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *exec, CUgraph graph,
                                                 CUDA_GRAPH_INSTANTIATE_PARAMS *params);
CUAPI CUresult cuGraphLaunch(CUgraphExec exec, CUstream stream);
CUAPI CUresult cuGraphLaunch_ptsz(CUgraphExec exec, CUstream stream);
CUAPI CUresult cuGraphExecKernelNodeSetParams(CUgraphExec exec, CUgraphNode node,
                                              const CUDA_KERNEL_NODE_PARAMS *params);
CUAPI CUresult cuGraphExecKernelNodeSetParams_v2(CUgraphExec exec, CUgraphNode node,
                                                 const CUDA_KERNEL_NODE_PARAMS_v2 *params);
CUAPI CUresult cuGraphExecUpdate(CUgraphExec exec, CUgraph graph, CUgraphNode *errNode,
                                 CUgraphExecUpdateResult *result);
CUAPI CUresult cuGraphExecUpdate_v2(CUgraphExec exec, CUgraph graph, CUgraphExecUpdateResultInfo *info);
CUAPI CUresult cuGraphExecDestroy(CUgraphExec exec);
CUAPI CUresult cuDeviceGraphMemTrim(CUdevice dev);

/* NVML */
CUAPI nvmlReturn_t nvmlInit(void);
CUAPI nvmlReturn_t nvmlInit_v2(void);
CUAPI nvmlReturn_t nvmlShutdown(void);
CUAPI nvmlReturn_t nvmlDeviceGetCount(unsigned int *count);
CUAPI nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count);
CUAPI nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *dev);
CUAPI nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *dev);
CUAPI nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t dev, char *uuid, unsigned int len);
CUAPI nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t dev, char *name, unsigned int len);
CUAPI nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *mem);
CUAPI nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *mem);
CUAPI const char *nvmlErrorString(nvmlReturn_t r);

#endif
