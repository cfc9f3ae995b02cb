/* t_procaddr: cuGetProcAddress and cuGetProcAddress_v2 hand back libvgpu's wrappers for the hooked
 * symbols at cudaVersion 11030, 12000 and 13000, with the driver's versioned mapping (cuMemAlloc ->
 * cuMemAlloc_v2, per-thread-stream variants with the PTDS flag), including when asked for
 * cuGetProcAddress itself; other symbols come back untouched, unknown ones as the driver's error.
 * Run once normally and once with TESSERA_SIM_PROCADDR_INTERNAL=1, where the simulated driver answers
 * with internal addresses (the name-based fallback must then find the wrappers). */
#include "vt.h"

typedef CUresult (*gpa_v1_t)(const char *, void **, int, cuuint64_t);
typedef CUresult (*gpa_v2_t)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);

/* wrappers as this program sees them: with libvgpu preloaded these names bind to it */
static const struct { const char *ask; void *want; cuuint64_t flags; int since; } cases[] = {
    {"cuMemAlloc", (void *)&cuMemAlloc_v2, 0, 0},
    {"cuMemFree", (void *)&cuMemFree_v2, 0, 0},
    {"cuMemGetInfo", (void *)&cuMemGetInfo_v2, 0, 0},
    {"cuMemAllocPitch", (void *)&cuMemAllocPitch_v2, 0, 0},
    {"cuMemAllocManaged", (void *)&cuMemAllocManaged, 0, 0},
    {"cuMemAllocAsync", (void *)&cuMemAllocAsync, CU_GET_PROC_ADDRESS_LEGACY_STREAM, 0},
    {"cuMemAllocAsync", (void *)&cuMemAllocAsync_ptsz, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, 0},
    {"cuMemAllocFromPoolAsync", (void *)&cuMemAllocFromPoolAsync, 0, 0},
    {"cuMemFreeAsync", (void *)&cuMemFreeAsync, 0, 0},
    {"cuMemCreate", (void *)&cuMemCreate, 0, 0},
    {"cuMemRelease", (void *)&cuMemRelease, 0, 0},
    {"cuMemMap", (void *)&cuMemMap, 0, 0},
    {"cuMemUnmap", (void *)&cuMemUnmap, 0, 0},
    {"cuArrayCreate", (void *)&cuArrayCreate_v2, 0, 0},
    {"cuArray3DCreate", (void *)&cuArray3DCreate_v2, 0, 0},
    {"cuArrayDestroy", (void *)&cuArrayDestroy, 0, 0},
    {"cuMipmappedArrayCreate", (void *)&cuMipmappedArrayCreate, 0, 0},
    {"cuDeviceTotalMem", (void *)&cuDeviceTotalMem_v2, 0, 0},
    {"cuLaunchKernel", (void *)&cuLaunchKernel, 0, 0},
    {"cuLaunchKernel", (void *)&cuLaunchKernel_ptsz, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, 0},
    {"cuLaunchKernelEx", (void *)&cuLaunchKernelEx, 0, 11060},
    {"cuLaunchCooperativeKernel", (void *)&cuLaunchCooperativeKernel, 0, 0},
};

static void *ask(int api, const char *sym, int ver, cuuint64_t flags, CUresult want_rc)
{
    void *p = (void *)0x1;
    CUresult r;
    if (api == 1) {
        r = cuGetProcAddress(sym, &p, ver, flags);
    } else {
        CUdriverProcAddressQueryResult st = 99;
        r = cuGetProcAddress_v2(sym, &p, ver, flags, &st);
        CHECK(r == CUDA_SUCCESS ? st == CU_GET_PROC_ADDRESS_SUCCESS : st != CU_GET_PROC_ADDRESS_SUCCESS);
    }
    if (r != want_rc) {
        fprintf(stderr, "cuGetProcAddress%s(%s, %d) returned %d\n", api == 1 ? "" : "_v2", sym, ver, r);
        abort();
    }
    return p;
}

int main(void)
{
    static const int versions[] = {11030, 12000, 13000};
    int checked = 0;
    for (int api = 1; api <= 2; api++) {
        for (size_t v = 0; v < 3; v++) {
            int ver = versions[v];
            for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
                if (cases[i].since > ver) {
                    /* newer than the version asked: the driver's own "not found" */
                    CHECK(ask(api, cases[i].ask, ver, cases[i].flags, CUDA_ERROR_NOT_FOUND) == NULL);
                    continue;
                }
                void *got = ask(api, cases[i].ask, ver, cases[i].flags, CUDA_SUCCESS);
                if (got != cases[i].want) {
                    fprintf(stderr, "cuGetProcAddress%s(%s, %d, flags %llu) gave %p, want the wrapper %p\n",
                            api == 1 ? "" : "_v2", cases[i].ask, ver, cases[i].flags, got, cases[i].want);
                    abort();
                }
                CHECK(got != tessera_sim_symbol(cases[i].ask));
                checked++;
            }
            /* cuGetProcAddress itself: the runtime asks for it and uses the answer for everything after */
            void *self = ask(api, "cuGetProcAddress", ver, 0, CUDA_SUCCESS);
            CHECK(self == (ver >= 12000 ? (void *)&cuGetProcAddress_v2 : (void *)&cuGetProcAddress));
            void *alloc;
            if (ver >= 12000)
                OK(((gpa_v2_t)self)("cuMemAlloc", &alloc, ver, 0, NULL));
            else
                OK(((gpa_v1_t)self)("cuMemAlloc", &alloc, ver, 0));
            CHECK(alloc == (void *)&cuMemAlloc_v2);
            /* an unhooked symbol comes back as the driver's own */
            CHECK(ask(api, "cuCtxGetDevice", ver, 0, CUDA_SUCCESS) == tessera_sim_symbol("cuCtxGetDevice"));
            /* an unknown one with the driver's error */
            CHECK(ask(api, "cuNoSuchFunction", ver, 0, CUDA_ERROR_NOT_FOUND) == NULL);
            checked += 4;
        }
    }

    /* and the wrappers so obtained enforce */
    vt_ctx(0);
    CUresult (*alloc)(CUdeviceptr *, size_t);
    CUresult (*info)(size_t *, size_t *);
    OK(cuGetProcAddress_v2("cuMemAlloc", (void **)&alloc, 13000, 0, NULL));
    OK(cuGetProcAddress_v2("cuMemGetInfo", (void **)&info, 13000, 0, NULL));
    CUdeviceptr p;
    CHECK_RC(alloc(&p, 64 * MiB + 1), CUDA_ERROR_OUT_OF_MEMORY);
    OK(alloc(&p, 16 * MiB));
    size_t f, t;
    OK(info(&f, &t));
    CHECK_EQ(t, 64 * MiB);
    CHECK_EQ(f, 48 * MiB);
    printf("procaddr: %d lookups at cudaVersion 11030/12000/13000 answered with the wrappers%s\n", checked,
           getenv("TESSERA_SIM_PROCADDR_INTERNAL") ? " (driver gave internal addresses)" : "");
    return 0;
}
