/* sim_cuda.h: what the simulated driver's graph module (sim_graph.c) shares with the rest of the
 * simulated driver (sim_cuda.c): the handle layouts a graph reaches into, the device timeline that
 * runs its kernels, and the card its memory nodes take memory from. Nothing here is exported. */
#ifndef TESSERA_SIM_CUDA_H
#define TESSERA_SIM_CUDA_H

#include <stdint.h>
#include "cuda_types.h"

#define MAGIC 0x7e55e7a
#define SIM_HIDDEN __attribute__((visibility("hidden")))

struct CUctx_st { int magic; int dev; };
struct CUfunc_st { int magic; };
/* capture: the graph a stream is being captured into (NULL: not capturing) */
struct CUstream_st { int magic; CUgraph capture; };

SIM_HIDDEN CUresult sim_current_device(int *dev); /* NOT_INITIALIZED / INVALID_CONTEXT / SUCCESS */
SIM_HIDDEN int sim_device_count(void);
SIM_HIDDEN void sim_run_kernels(int dev, int64_t kernels); /* enqueue on the device's timeline */
SIM_HIDDEN int sim_take(int dev, uint64_t bytes);          /* card memory; -1 when it is full */
SIM_HIDDEN void sim_give(int dev, uint64_t bytes);
SIM_HIDDEN int sim_function_ok(CUfunction f);
/* the graph a launch or an async allocation on `stream` is captured into, or NULL */
SIM_HIDDEN CUgraph sim_capturing(CUstream stream);
SIM_HIDDEN CUresult sim_capture_kernel(CUgraph g, CUfunction f, const unsigned int dims[6]);
SIM_HIDDEN CUresult sim_capture_alloc(CUgraph g, int dev, uint64_t bytes, CUdeviceptr *dptr);
SIM_HIDDEN CUresult sim_capture_free(CUgraph g, CUdeviceptr dptr);

#endif
