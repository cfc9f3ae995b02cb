/* interpose.c: how libvgpu gets between a CUDA program and the driver. Programs linked against
 * libcuda reach our exported wrappers through symbol interposition (LD_PRELOAD); the CUDA runtime
 * (PyTorch, CuPy, JAX) dlopen()s libcuda and asks dlsym for cuGetProcAddress, then asks
 * cuGetProcAddress for everything else, including cuGetProcAddress itself. So dlsym and both
 * cuGetProcAddress entry points hand back our wrappers for every symbol in hooks.def.
 * Also here: lazy, re-entry-safe initialisation and one-time resolution of the real functions. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <link.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "vgpu.h"

const vgpu_hook vgpu_hooks[HOOK_COUNT] = {
#define HOOK(lib, sym, base, since, ptds) {#sym, #base, VGPU_LIB_ID_##lib, since, ptds, (void *)&sym},
#include "hooks.def"
#undef HOOK
};
void *vgpu_real[HOOK_COUNT];
vgpu_driver vgpu_drv;
vgpu_config vgpu_cfg;

/* The newest CUDA version whose entry-point ABIs hooks.def describes. */
#define VGPU_KNOWN_CUDA_VERSION_MAX 13999

static int log_level = VGPU_LOG_WARN;
static void *cuda_handle, *nvml_handle;
static int init_state; /* 0 not started, 1 running, 2 done; read with acquire */
static __thread int tl_in_init;
static pthread_mutex_t init_mu = PTHREAD_MUTEX_INITIALIZER;

int64_t vgpu_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

void vgpu_log(int level, const char *fmt, ...)
{
    if (level > log_level)
        return;
    int saved = errno;
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    int n = snprintf(buf, sizeof buf, "libvgpu[%d]: ", (int)getpid());
    vsnprintf(buf + n, sizeof buf - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = strlen(buf);
    buf[len++] = '\n';
    ssize_t w = write(2, buf, len);
    (void)w;
    errno = saved;
}

/* glibc >= 2.34 keeps dlsym in libc as GLIBC_2.34; older ones as GLIBC_2.2.5 (x86_64) or GLIBC_2.17
 * (aarch64). dlvsym is not interposed by us, so this never recurses into our own dlsym. */
void *vgpu_real_dlsym(void *handle, const char *name)
{
    static void *(*real)(void *, const char *);
    void *(*f)(void *, const char *) = __atomic_load_n(&real, __ATOMIC_ACQUIRE);
    if (!f) {
        f = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
        if (!f)
            f = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
        if (!f) /* aarch64's base version */
            f = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.17");
        if (!f) {
            static const char msg[] = "libvgpu: FATAL: cannot find the real dlsym (GLIBC_2.34 / GLIBC_2.2.5)\n";
            ssize_t w = write(2, msg, sizeof msg - 1);
            (void)w;
            abort();
        }
        __atomic_store_n(&real, f, __ATOMIC_RELEASE);
    }
    return f(handle, name);
}

static int hook_by_name(const char *name)
{
    for (int i = 0; i < HOOK_COUNT; i++)
        if (strcmp(vgpu_hooks[i].name, name) == 0)
            return i;
    return -1;
}

static void *lib_handle(int lib) { return lib == VGPU_LIB_NVML ? nvml_handle : cuda_handle; }

static void resolve_imports(void)
{
#define IMPORT(field, name) vgpu_drv.field = (__typeof__(vgpu_drv.field))(cuda_handle ? vgpu_real_dlsym(cuda_handle, name) : NULL)
    IMPORT(cuInit, "cuInit");
    IMPORT(cuCtxGetDevice, "cuCtxGetDevice");
    IMPORT(cuCtxGetCurrent, "cuCtxGetCurrent");
    IMPORT(cuDeviceGetCount, "cuDeviceGetCount");
    IMPORT(cuDeviceGetUuid, "cuDeviceGetUuid_v2");
    if (!vgpu_drv.cuDeviceGetUuid)
        IMPORT(cuDeviceGetUuid, "cuDeviceGetUuid");
    IMPORT(cuEventCreate, "cuEventCreate");
    IMPORT(cuEventDestroy, "cuEventDestroy_v2");
    IMPORT(cuEventRecord, "cuEventRecord");
    IMPORT(cuEventRecord_ptsz, "cuEventRecord_ptsz");
    IMPORT(cuEventQuery, "cuEventQuery");
    IMPORT(cuEventSynchronize, "cuEventSynchronize");
    IMPORT(cuEventElapsedTime, "cuEventElapsedTime");
    if (!vgpu_drv.cuEventElapsedTime)
        IMPORT(cuEventElapsedTime, "cuEventElapsedTime_v2");
    IMPORT(cuStreamIsCapturing, "cuStreamIsCapturing");
    IMPORT(cuStreamIsCapturing_ptsz, "cuStreamIsCapturing_ptsz");
    IMPORT(cuGraphGetNodes, "cuGraphGetNodes");
    IMPORT(cuGraphNodeGetType, "cuGraphNodeGetType");
    IMPORT(cuGraphMemAllocNodeGetParams, "cuGraphMemAllocNodeGetParams");
    IMPORT(cuGraphChildGraphNodeGetGraph, "cuGraphChildGraphNodeGetGraph");
    IMPORT(cuMemPoolGetAttribute, "cuMemPoolGetAttribute");
    IMPORT(cuDeviceGetMemPool, "cuDeviceGetMemPool");
#undef IMPORT
    vgpu_drv.nvmlDeviceGetUUID = (__typeof__(vgpu_drv.nvmlDeviceGetUUID))(nvml_handle ? vgpu_real_dlsym(nvml_handle, "nvmlDeviceGetUUID") : NULL);
    if (cuda_handle && !vgpu_drv.cuCtxGetDevice)
        vgpu_log(VGPU_LOG_ERROR, "the CUDA driver has no cuCtxGetDevice: memory cannot be accounted per device");
}

/* (locks taken in one order, released in the reverse) */
static void fork_prepare(void)
{
    ctx_fork_prepare();
    pools_fork_prepare();
    allocs_fork_prepare();
    limiter_fork_prepare();
    ledger_fork_prepare();
}
static void fork_parent(void)
{
    ledger_fork_parent();
    limiter_fork_parent();
    allocs_fork_parent();
    pools_fork_parent();
    ctx_fork_parent();
}
static void fork_child(void)
{
    ledger_fork_child();
    limiter_fork_child();
    allocs_fork_child();
    pools_fork_child();
    ctx_fork_child();
}

static void do_init(void)
{
    const char *lv = getenv("TESSERA_VGPU_LOG");
    if (lv)
        log_level = !strcmp(lv, "debug") ? VGPU_LOG_DEBUG : !strcmp(lv, "info") ? VGPU_LOG_INFO
                  : !strcmp(lv, "error") ? VGPU_LOG_ERROR : VGPU_LOG_WARN;
    vgpu_config_load(&vgpu_cfg);
    cuda_handle = dlopen("libcuda.so.1", RTLD_LAZY);
    if (!cuda_handle)
        vgpu_log(VGPU_LOG_ERROR, "cannot load the CUDA driver libcuda.so.1: %s", dlerror());
    nvml_handle = dlopen("libnvidia-ml.so.1", RTLD_LAZY | RTLD_NOLOAD);
    for (int i = 0; i < HOOK_COUNT; i++) {
        void *h = lib_handle(vgpu_hooks[i].lib);
        void *f = h ? vgpu_real_dlsym(h, vgpu_hooks[i].name) : NULL;
        __atomic_store_n(&vgpu_real[i], f, __ATOMIC_RELEASE);
        if (!f && h)
            vgpu_log(VGPU_LOG_DEBUG, "driver has no %s", vgpu_hooks[i].name);
    }
    resolve_imports();
    ledger_open(&vgpu_cfg);
    priority_open(&vgpu_cfg);
    pthread_atfork(fork_prepare, fork_parent, fork_child);
}

void vgpu_ensure_init(void)
{
    if (__atomic_load_n(&init_state, __ATOMIC_ACQUIRE) == 2 || tl_in_init)
        return;
    int saved = errno;
    pthread_mutex_lock(&init_mu);
    if (__atomic_load_n(&init_state, __ATOMIC_ACQUIRE) != 2) {
        tl_in_init = 1;
        __atomic_store_n(&init_state, 1, __ATOMIC_RELEASE);
        do_init();
        __atomic_store_n(&init_state, 2, __ATOMIC_RELEASE);
        tl_in_init = 0;
    }
    pthread_mutex_unlock(&init_mu);
    errno = saved;
}

int vgpu_ready(void) { return __atomic_load_n(&init_state, __ATOMIC_ACQUIRE) == 2; }

/* A wrapper reached before resolution finished (re-entry while the driver loads) or an NVML wrapper
 * reached before libnvidia-ml was loaded: resolve that one symbol now. */
int vgpu_resolve_late(int id)
{
    const vgpu_hook *h = &vgpu_hooks[id];
    void *f = NULL;
    if (h->lib == VGPU_LIB_NVML && vgpu_ready()) {
        if (!__atomic_load_n(&nvml_handle, __ATOMIC_ACQUIRE)) {
            void *nh = dlopen("libnvidia-ml.so.1", RTLD_LAZY);
            if (nh) {
                __atomic_store_n(&nvml_handle, nh, __ATOMIC_RELEASE);
                vgpu_drv.nvmlDeviceGetUUID = (__typeof__(vgpu_drv.nvmlDeviceGetUUID))vgpu_real_dlsym(nh, "nvmlDeviceGetUUID");
            }
        }
        if (nvml_handle)
            f = vgpu_real_dlsym(nvml_handle, h->name);
    } else if (!vgpu_ready()) {
        f = vgpu_real_dlsym(RTLD_NEXT, h->name);
        if (f == h->wrapper)
            f = NULL;
    }
    if (f)
        __atomic_store_n(&vgpu_real[id], f, __ATOMIC_RELEASE);
    return f != NULL;
}

int vgpu_missing(int id)
{
    static int warned[HOOK_COUNT];
    if (!__atomic_exchange_n(&warned[id], 1, __ATOMIC_RELAXED))
        vgpu_log(VGPU_LOG_ERROR, "%s was called but the real %s has no such function; returning not-found",
                 vgpu_hooks[id].name, vgpu_hooks[id].lib == VGPU_LIB_NVML ? "libnvidia-ml.so.1" : "libcuda.so.1");
    return vgpu_hooks[id].lib == VGPU_LIB_NVML ? NVML_ERROR_FUNCTION_NOT_FOUND : CUDA_ERROR_NOT_FOUND;
}

__attribute__((destructor)) static void vgpu_fini(void)
{
    if (vgpu_ready())
        ledger_close();
}

/* dlsym(RTLD_NEXT, ...) must resolve relative to its caller, but the real dlsym would see libvgpu as
 * the caller. Walk the link map from the caller's object onwards, as the loader does. */
static void *dlsym_next(const char *name, const void *caller)
{
    Dl_info info;
    struct link_map *self = NULL;
    if (!dladdr1(caller, &info, (void **)&self, RTLD_DL_LINKMAP) || !self)
        return vgpu_real_dlsym(RTLD_NEXT, name);
    for (struct link_map *m = self->l_next; m; m = m->l_next) {
        if (!m->l_name || !m->l_name[0])
            continue;
        void *h = dlopen(m->l_name, RTLD_LAZY | RTLD_NOLOAD);
        if (!h)
            continue;
        void *s = vgpu_real_dlsym(h, name);
        dlclose(h);
        struct link_map *owner = NULL;
        Dl_info si;
        if (s && dladdr1(s, &si, (void **)&owner, RTLD_DL_LINKMAP) && owner == m)
            return s;
    }
    return NULL;
}

VGPU_EXPORT void *dlsym(void *handle, const char *symbol)
{
    void *r = handle == RTLD_NEXT ? dlsym_next(symbol, __builtin_return_address(0)) : vgpu_real_dlsym(handle, symbol);
    if (r && ((symbol[0] == 'c' && symbol[1] == 'u') || strncmp(symbol, "nvml", 4) == 0)) {
        int id = hook_by_name(symbol);
        if (id >= 0) {
            vgpu_ensure_init();
            if (vgpu_ready())
                return vgpu_hooks[id].wrapper;
        }
    }
    return r;
}

/* Names of entry points that take device memory. One that reaches substitute() unmatched (a newer
 * ABI, or one hooks.def does not know) would allocate uncharged, so it is refused, never handed back. */
static int allocates_device_memory(const char *symbol)
{
    static const char *const prefixes[] = {"cuMemAlloc", "cuMemCreate", "cuArrayCreate", "cuArray3DCreate",
                                           "cuMipmappedArrayCreate"};
    if (!strncmp(symbol, "cuMemAllocHost", 14)) /* pinned host memory: not the GPU's */
        return 0;
    for (size_t i = 0; i < sizeof prefixes / sizeof prefixes[0]; i++)
        if (!strncmp(symbol, prefixes[i], strlen(prefixes[i])))
            return 1;
    return 0;
}

/* What cuGetProcAddress answered (`fn`) is swapped for our wrapper when it is the real function of a
 * hooked symbol. Matching by address follows the driver's own version mapping exactly; when the
 * driver answers with an internal address we fall back to the version rules recorded in hooks.def.
 * NULL: refuse the lookup (an allocation entry point we cannot wrap must not leave unwrapped). */
static void *substitute(const char *symbol, void *fn, int cuda_version, cuuint64_t flags)
{
    for (int i = 0; i < HOOK_COUNT; i++)
        if (vgpu_hooks[i].lib == VGPU_LIB_CUDA && vgpu_real[i] == fn)
            return vgpu_hooks[i].wrapper;
    if (cuda_version > VGPU_KNOWN_CUDA_VERSION_MAX) {
        /* a newer ABI may exist for this name: never hand back a wrapper of an older one */
        int hooked = 0;
        for (int i = 0; i < HOOK_COUNT; i++)
            if (vgpu_hooks[i].lib == VGPU_LIB_CUDA && !strcmp(vgpu_hooks[i].base, symbol))
                hooked = 1;
        if (hooked || allocates_device_memory(symbol)) {
            vgpu_log(VGPU_LOG_ERROR, "cuGetProcAddress(%s, %d): the driver answered for a CUDA version newer than "
                     "libvgpu knows and libvgpu cannot wrap it; refused (not found). Ask for version %d or "
                     "update libvgpu", symbol, cuda_version, VGPU_KNOWN_CUDA_VERSION_MAX);
            return NULL;
        }
        return fn;
    }
    int want_ptds = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    int best = -1;
    for (int i = 0; i < HOOK_COUNT; i++) {
        const vgpu_hook *h = &vgpu_hooks[i];
        if (h->lib != VGPU_LIB_CUDA || strcmp(h->base, symbol) != 0 || h->since > cuda_version || !vgpu_real[i])
            continue;
        if (h->ptds && !want_ptds)
            continue;
        if (best < 0 || h->since > vgpu_hooks[best].since || (h->since == vgpu_hooks[best].since && h->ptds == want_ptds))
            best = i;
    }
    if (best < 0)
        best = hook_by_name(symbol);
    if (best >= 0 && vgpu_hooks[best].lib == VGPU_LIB_CUDA) {
        vgpu_log(VGPU_LOG_DEBUG, "cuGetProcAddress(%s, %d): driver gave an unknown address; using %s by name",
                 symbol, cuda_version, vgpu_hooks[best].name);
        return vgpu_hooks[best].wrapper;
    }
    if (allocates_device_memory(symbol)) {
        vgpu_log(VGPU_LOG_ERROR, "cuGetProcAddress(%s, %d): an allocation entry point libvgpu does not know; "
                 "refused (not found)", symbol, cuda_version);
        return NULL;
    }
    return fn;
}

VGPU_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    VGPU_ENTER(cuGetProcAddress);
    CUresult r = REAL(cuGetProcAddress)(symbol, pfn, cudaVersion, flags);
    if (r == CUDA_SUCCESS && symbol && pfn && *pfn && vgpu_ready() &&
        !(*pfn = substitute(symbol, *pfn, cudaVersion, flags)))
        r = CUDA_ERROR_NOT_FOUND;
    return r;
}

VGPU_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                         CUdriverProcAddressQueryResult *symbolStatus)
{
    VGPU_ENTER(cuGetProcAddress_v2);
    CUresult r = REAL(cuGetProcAddress_v2)(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (r == CUDA_SUCCESS && symbol && pfn && *pfn && vgpu_ready() &&
        !(*pfn = substitute(symbol, *pfn, cudaVersion, flags))) {
        r = CUDA_ERROR_NOT_FOUND;
        if (symbolStatus)
            *symbolStatus = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    }
    return r;
}
