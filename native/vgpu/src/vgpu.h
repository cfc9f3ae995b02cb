/* vgpu.h: the internal interfaces of libvgpu, shared by its modules (interposition, configuration,
 * the cross-process Ledger, the per-process allocation table and the SM-share limiter). Nothing here is
 * exported; only the wrappers listed in hooks.def and dlsym leave the library. */
#ifndef TESSERA_VGPU_H
#define TESSERA_VGPU_H

#include <stdint.h>
#include <stddef.h>
#include "cuda_api.h"

#define VGPU_EXPORT __attribute__((visibility("default")))
#define VGPU_MAX_DEVICES 16
#define VGPU_MAX_PROCS 1024

enum { VGPU_LIB_CUDA = 0, VGPU_LIB_NVML = 1 };
#define VGPU_LIB_ID_CUDA VGPU_LIB_CUDA
#define VGPU_LIB_ID_NVML VGPU_LIB_NVML

enum vgpu_hook_id {
#define HOOK(lib, sym, base, since, ptds) HOOK_##sym,
#include "hooks.def"
#undef HOOK
    HOOK_COUNT
};

typedef struct {
    const char *name;
    const char *base;
    int lib;
    int since;
    int ptds;
    void *wrapper;
} vgpu_hook;

extern const vgpu_hook vgpu_hooks[HOOK_COUNT];
extern void *vgpu_real[HOOK_COUNT];

/* The real function behind a wrapper, typed from the prototype in cuda_api.h. */
#define REAL(sym) ((__typeof__(&sym))vgpu_real[HOOK_##sym])

/* Every wrapper starts here: lazy initialisation, then the loud answer if the driver lacks the function. */
#define VGPU_ENTER(sym)                                                        \
    do {                                                                       \
        vgpu_ensure_init();                                                    \
        if (!vgpu_real[HOOK_##sym] && !vgpu_resolve_late(HOOK_##sym))          \
            return vgpu_missing(HOOK_##sym);                                   \
    } while (0)

void vgpu_ensure_init(void);
int vgpu_ready(void);
int vgpu_resolve_late(int id);
int vgpu_missing(int id);
void *vgpu_real_dlsym(void *handle, const char *name);

/* Functions of the real driver that libvgpu calls for itself (never wrapped). */
typedef struct {
    CUresult (*cuInit)(unsigned int);
    CUresult (*cuCtxGetDevice)(CUdevice *);
    CUresult (*cuCtxGetCurrent)(CUcontext *);
    CUresult (*cuDeviceGetCount)(int *);
    CUresult (*cuDeviceGetUuid)(CUuuid *, CUdevice);
    CUresult (*cuEventCreate)(CUevent *, unsigned int);
    CUresult (*cuEventDestroy)(CUevent);
    CUresult (*cuEventRecord)(CUevent, CUstream);
    CUresult (*cuEventRecord_ptsz)(CUevent, CUstream);
    CUresult (*cuEventQuery)(CUevent);
    CUresult (*cuEventSynchronize)(CUevent);
    CUresult (*cuEventElapsedTime)(float *, CUevent, CUevent);
    CUresult (*cuStreamIsCapturing)(CUstream, CUstreamCaptureStatus *);
    CUresult (*cuStreamIsCapturing_ptsz)(CUstream, CUstreamCaptureStatus *);
    CUresult (*cuGraphGetNodes)(CUgraph, CUgraphNode *, size_t *);
    CUresult (*cuGraphNodeGetType)(CUgraphNode, CUgraphNodeType *);
    CUresult (*cuGraphMemAllocNodeGetParams)(CUgraphNode, CUDA_MEM_ALLOC_NODE_PARAMS *);
    CUresult (*cuGraphChildGraphNodeGetGraph)(CUgraphNode, CUgraph *);
    CUresult (*cuMemPoolGetAttribute)(CUmemoryPool, int, void *);
    CUresult (*cuDeviceGetMemPool)(CUmemoryPool *, CUdevice);
    nvmlReturn_t (*nvmlDeviceGetUUID)(nvmlDevice_t, char *, unsigned int);
} vgpu_driver;
extern vgpu_driver vgpu_drv;

/* logging: TESSERA_VGPU_LOG=error|warn|info|debug (default warn) */
enum { VGPU_LOG_ERROR = 0, VGPU_LOG_WARN = 1, VGPU_LOG_INFO = 2, VGPU_LOG_DEBUG = 3 };
void vgpu_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* configuration (config.c) */
typedef struct {
    uint64_t mem_limit[VGPU_MAX_DEVICES]; /* bytes, 0 = none */
    uint32_t sm_limit[VGPU_MAX_DEVICES];  /* percent 1..99, 0 = none */
    uint64_t ctx_overhead[VGPU_MAX_DEVICES]; /* device memory one context takes, charged per context */
    char cache_path[4096];                /* "" = process-private accounting */
    /* The claim's GPUs by UUID, in the order the limits are numbered (CUDA_VISIBLE_DEVICES in a
     * config file, never the environment's); n_uuids 0 = limits are numbered by CUDA ordinal. */
    char uuids[VGPU_MAX_DEVICES][48];
    int n_uuids;
    /* Runtime priority (HAMi's nvidia.com/priority, CUDA_TASK_PRIORITY): -1 none, 0 high, 1 low. The
     * lowest priority any source names (the environment may only say 1), and each device's priority
     * board (priority.c), named by a config file only, the node's first. */
    int priority;
    char boards[VGPU_MAX_DEVICES][512];
    int test_hold_lock_ms;                /* only read in a VGPU_TEST_HOOKS build */
    char refusal[384];                    /* "" or why no allocation may be granted (fail closed) */
} vgpu_config;
extern vgpu_config vgpu_cfg;
void vgpu_config_load(vgpu_config *c);
int vgpu_parse_size(const char *s, uint64_t *out);
static inline uint64_t vgpu_min_limit(uint64_t a, uint64_t b) { return !a ? b : !b ? a : (a < b ? a : b); }

/* the cross-process Ledger (ledger.c) */
void ledger_open(const vgpu_config *c);
void ledger_close(void);
int ledger_reserve(int dev, uint64_t bytes); /* 0 = granted, -1 = over the limit */
void ledger_release(int dev, uint64_t bytes);
void ledger_usage(int dev, uint64_t *limit, uint64_t *used); /* limit 0 = none */
void ledger_note_device(int dev, const char *uuid);
int ledger_find_uuid(const char *uuid);
uint32_t ledger_sm_limit(int dev);
int ledger_any_sm_limit(void);
int64_t *ledger_sm_tat(int dev);
void ledger_fork_prepare(void);
void ledger_fork_parent(void);
void ledger_fork_child(void);

/* the per-process table of live allocations (allocs.c) */
enum { ALLOC_PTR = 1, ALLOC_ARRAY, ALLOC_MIPMAP, ALLOC_HANDLE, ALLOC_MAPPING,
       ALLOC_CONTEXT,      /* a context's overhead, keyed by the context */
       ALLOC_MODULE,       /* what loading a module took, keyed by the module */
       ALLOC_GRAPH_DUE,    /* an exec's graph memory, charged at its first launch */
       ALLOC_GRAPH_HELD }; /* ... and once charged, returned when the exec is destroyed */
void allocs_put(int kind, uint64_t key, int dev, uint64_t size);
int allocs_take(int kind, uint64_t key, int *dev, uint64_t *size);
void vmm_created(uint64_t handle, int dev, uint64_t size);
int vmm_released(uint64_t handle, int *dev, uint64_t *size);
void vmm_mapped(uint64_t va, uint64_t size, uint64_t handle);
void vmm_unmapped(uint64_t va, uint64_t size, void (*release)(int dev, uint64_t size));
void allocs_fork_prepare(void);
void allocs_fork_parent(void);
void allocs_fork_child(void);

/* memory hooks helpers (hooks_mem.c) */
/* A CUDA device that is not one of the config file's GPUs: nothing may be allocated on it. */
#define VGPU_FOREIGN_DEVICE (-2)
int vgpu_device_slot(int ordinal); /* the limits' and the Ledger's index of a CUDA ordinal */
int vgpu_current_device(void);     /* that index for the current context; -1 none, or VGPU_FOREIGN_DEVICE */
void vgpu_note_device(int ordinal);
int vgpu_cuda_uuid(int dev, char out[48]);
void vgpu_uuid_string(const CUuuid *u, char out[48]);

/* SM-share limiter (limiter.c) */
typedef struct {
    int dev;
    int ptds;
    uint32_t pct;
    CUstream stream;
    uint64_t key; /* 0 for a kernel; the executable graph for a graph launch (its own estimate) */
    int pair;     /* index of the event pair, -1 when not measuring */
} vgpu_launch;
int limiter_begin(vgpu_launch *l, CUstream stream, int ptds, uint64_t key);
void limiter_end(vgpu_launch *l, CUresult r);
void ctx_fork_prepare(void);
void ctx_fork_parent(void);
void ctx_fork_child(void);
void pools_fork_prepare(void);
void pools_fork_parent(void);
void pools_fork_child(void);
void limiter_fork_prepare(void);
void limiter_fork_parent(void);
void limiter_fork_child(void);

/* runtime priority between the claims of one GPU (priority.c) */
#define PRIORITY_WINDOW_NS (50 * 1000000LL) /* a high-priority launch holds low ones back this long */
#define PRIORITY_FLOOR_PCT 5u                /* the share of GPU time a yielding low-priority claim keeps */
void priority_open(const vgpu_config *c);
void priority_launched(int dev); /* high priority: stamp the device's board (at most once a ms) */
int priority_yield(int dev);     /* low priority: has a high-priority process launched within the window? */

/* memory pools (hooks_pool.c): settle what pools keep against the driver's figures */
void vgpu_pools_settle(void);
int vgpu_reserve(int dev, uint64_t bytes); /* ledger_reserve, settling pools once if refused */

/* is work on this stream being captured into a graph (hooks_graph.c)? */
int vgpu_capturing(CUstream stream, int ptds);

int64_t vgpu_now_ns(void);

#endif
