/* t_null: NULL and invalid arguments get the driver's own errors through libvgpu. `t_null record`
 * runs without the library and prints what the driver answers; `t_null check FILE` runs with it and
 * compares, call by call, so this holds against any driver, simulated or real. */
#include "vt.h"

static FILE *out;
static char (*expect)[128];
static int n_expect, n_seen, failures;

static void note(const char *what, long rc)
{
    char line[128];
    snprintf(line, sizeof line, "%s %ld", what, rc);
    if (out) {
        fprintf(out, "%s\n", line);
    } else {
        if (n_seen >= n_expect || strcmp(expect[n_seen], line)) {
            fprintf(stderr, "t_null: got \"%s\", the driver alone said \"%s\"\n", line,
                    n_seen < n_expect ? expect[n_seen] : "(nothing)");
            failures++;
        }
        n_seen++;
    }
}
#define CALL(expr) note(#expr, (long)(expr))

int main(int argc, char **argv)
{
    CHECK(argc >= 2);
    if (!strcmp(argv[1], "record")) {
        out = stdout;
    } else {
        CHECK(argc == 3);
        FILE *f = fopen(argv[2], "r");
        CHECK(f);
        expect = calloc(256, sizeof *expect);
        while (n_expect < 256 && fgets(expect[n_expect], sizeof expect[0], f)) {
            expect[n_expect][strcspn(expect[n_expect], "\n")] = 0;
            n_expect++;
        }
        fclose(f);
    }
    CUdeviceptr d = 0;
    CUdeviceptr_v1 d1 = 0;
    size_t f = 0, t = 0, pitch = 0;
    unsigned int f1 = 0, t1 = 0;
    CUmemGenericAllocationHandle h = 0;
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    CUDA_ARRAY_DESCRIPTOR ad = {.Width = 16, .Height = 16, .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 1};
    CUDA_ARRAY3D_DESCRIPTOR ad3 = {.Width = 16, .Height = 16, .Depth = 16, .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 1};
    CUarray arr = NULL;
    CUmipmappedArray mm = NULL;
    void *p = NULL;

    /* before cuInit */
    CALL(cuMemAlloc_v2(&d, 1));
    CALL(cuMemGetInfo_v2(&f, &t));
    CALL(cuDeviceTotalMem_v2(&t, 0));
    CALL(cuInit(0));

    /* initialised, no context */
    CALL(cuMemAlloc_v2(&d, 1));
    CALL(cuMemAllocManaged(&d, 1, CU_MEM_ATTACH_GLOBAL));
    CALL(cuMemGetInfo_v2(&f, &t));
    CALL(cuMemFree_v2(0x1234));
    CALL(cuArrayCreate_v2(&arr, &ad));

    vt_ctx(0);
    CALL(cuMemAlloc_v2(NULL, 1));
    CALL(cuMemAlloc_v2(&d, 0));
    CALL(cuMemAlloc(NULL, 1));
    CALL(cuMemAlloc(&d1, 0));
    CALL(cuMemAllocPitch_v2(NULL, &pitch, 16, 16, 4));
    CALL(cuMemAllocPitch_v2(&d, NULL, 16, 16, 4));
    CALL(cuMemAllocPitch_v2(&d, &pitch, 16, 16, 3));
    CALL(cuMemAllocPitch(NULL, &t1, 16, 16, 4));
    CALL(cuMemAllocManaged(NULL, 1, CU_MEM_ATTACH_GLOBAL));
    CALL(cuMemAllocManaged(&d, 1, 0));
    CALL(cuMemAllocAsync(NULL, 1, NULL));
    CALL(cuMemAllocAsync_ptsz(NULL, 1, NULL));
    CALL(cuMemAllocFromPoolAsync(NULL, 1, NULL, NULL));
    CALL(cuMemAllocFromPoolAsync(&d, 1, NULL, NULL));
    CALL(cuMemAllocFromPoolAsync_ptsz(&d, 1, NULL, NULL));
    CALL(cuMemFree_v2(0));
    CALL(cuMemFree_v2(0x1234));
    CALL(cuMemFree(0));
    CALL(cuMemFreeAsync(0, NULL));
    CALL(cuMemFreeAsync_ptsz(0x1234, NULL));
    CALL(cuMemGetInfo_v2(NULL, NULL));
    CALL(cuMemGetInfo_v2(NULL, &t));
    CALL(cuMemGetInfo_v2(&f, NULL));
    CALL(cuMemGetInfo(NULL, &t1));
    CALL(cuMemGetInfo(&f1, NULL));
    CALL(cuDeviceTotalMem_v2(NULL, 0));
    CALL(cuDeviceTotalMem_v2(&t, 99));
    CALL(cuDeviceTotalMem(NULL, 0));
    CALL(cuMemCreate(NULL, 2 * MiB, &prop, 0));
    CALL(cuMemCreate(&h, 2 * MiB, NULL, 0));
    CALL(cuMemCreate(&h, 1, &prop, 0));
    CALL(cuMemRelease(0));
    CALL(cuMemMap(0, 0, 0, 0, 0));
    CALL(cuMemUnmap(0, 0));
    CALL(cuArrayCreate_v2(NULL, &ad));
    CALL(cuArrayCreate_v2(&arr, NULL));
    CALL(cuArrayCreate(NULL, NULL));
    CALL(cuArray3DCreate_v2(NULL, &ad3));
    CALL(cuArray3DCreate_v2(&arr, NULL));
    CALL(cuArray3DCreate(&arr, NULL));
    CALL(cuArrayDestroy(NULL));
    CALL(cuMipmappedArrayCreate(NULL, &ad3, 1));
    CALL(cuMipmappedArrayCreate(&mm, NULL, 1));
    CALL(cuMipmappedArrayCreate(&mm, &ad3, 0));
    CALL(cuMipmappedArrayDestroy(NULL));
    CALL(cuLaunchKernel(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
    CALL(cuLaunchKernel_ptsz(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
    CALL(cuLaunchCooperativeKernel(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL));
    CALL(cuLaunchKernelEx(NULL, NULL, NULL, NULL));
    CALL(cuLaunchKernelEx_ptsz(NULL, NULL, NULL, NULL));
    CUgraphExec ge = NULL;
    CUcontext nc = NULL;
    CUmodule nm = NULL;
    CALL(cuGraphLaunch(NULL, NULL));
    CALL(cuGraphLaunch_ptsz(NULL, NULL));
    CALL(cuGraphInstantiateWithFlags(NULL, NULL, 0));
    CALL(cuGraphInstantiateWithFlags(&ge, NULL, 0));
    CALL(cuGraphInstantiate_v2(NULL, NULL, NULL, NULL, 0));
    CALL(cuGraphInstantiateWithParams(&ge, NULL, NULL));
    CALL(cuGraphExecDestroy(NULL));
    CALL(cuCtxCreate_v2(NULL, 0, 0));
    CALL(cuCtxCreate_v2(&nc, 0, 99));
    CALL(cuDevicePrimaryCtxRetain(NULL, 0));
    CALL(cuDevicePrimaryCtxRetain(&nc, 99));
    CALL(cuDevicePrimaryCtxRelease_v2(99));
    CALL(cuCtxDestroy_v2(NULL));
    CALL(cuModuleLoadData(NULL, "sim"));
    CALL(cuModuleLoadData(&nm, NULL));
    CALL(cuModuleUnload(NULL));
    CALL(cuGetProcAddress(NULL, &p, 12000, 0));
    CALL(cuGetProcAddress("cuMemAlloc", NULL, 12000, 0));
    CALL(cuGetProcAddress_v2(NULL, &p, 12000, 0, NULL));
    CALL(cuGetProcAddress_v2("cuMemAlloc", NULL, 12000, 0, NULL));
    CALL(cuGetProcAddress_v2("cuNoSuchFunction", &p, 12000, 0, NULL));

    nvmlDevice_t dev = NULL;
    CALL(nvmlDeviceGetMemoryInfo(NULL, NULL));
    CALL(nvmlInit_v2());
    CALL(nvmlDeviceGetHandleByIndex_v2(0, &dev));
    CALL(nvmlDeviceGetMemoryInfo(dev, NULL));
    CALL(nvmlDeviceGetMemoryInfo_v2(dev, NULL));
    nvmlMemory_v2_t m2;
    memset(&m2, 0, sizeof m2);
    CALL(nvmlDeviceGetMemoryInfo_v2(dev, &m2)); /* version not set */
    CALL(nvmlDeviceGetMemoryInfo(NULL, NULL));

    if (out)
        return 0;
    if (n_seen != n_expect) {
        fprintf(stderr, "t_null: %d calls, %d recorded\n", n_seen, n_expect);
        failures++;
    }
    if (failures)
        return 1;
    printf("null: %d calls with NULL or invalid arguments answered with the driver's own errors\n", n_seen);
    return 0;
}
