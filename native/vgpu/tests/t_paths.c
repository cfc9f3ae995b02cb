/* t_paths: every allocation path is charged to the budget, refused at the limit without a driver
 * allocation, and uncharged by its matching free: cuMemAlloc(_v2), cuMemAllocPitch(_v2),
 * cuMemAllocManaged, cuMemAllocAsync(_ptsz), cuMemAllocFromPoolAsync(_ptsz), cuMemCreate with
 * cuMemMap/cuMemUnmap/cuMemRelease in both orders, arrays, 3D arrays and mipmapped arrays. A
 * stream-ordered free gives the memory to its pool, which keeps it (charged) until a synchronisation.
 * Run with CUDA_DEVICE_MEMORY_LIMIT_0=64m. */
#include "vt.h"

#define LIMIT (64 * MiB)

/* the path charged `want` bytes; now fill to the limit and check the next allocation is refused */
static void expect_charged(const char *what, uint64_t want)
{
    uint64_t used = vt_used();
    if (used != want) {
        fprintf(stderr, "%s: charged %llu bytes, want %llu\n", what, (unsigned long long)used, (unsigned long long)want);
        abort();
    }
}

/* after a stream-ordered free: the pool keeps `kept` until a synchronisation releases it */
static void expect_kept_until_sync(const char *what, uint64_t kept)
{
    expect_charged(what, kept);
    OK(cuCtxSynchronize());
    expect_charged(what, 0);
}

static void expect_refused_at_limit(CUresult (*try_alloc)(uint64_t bytes), uint64_t over)
{
    int live = tessera_sim_live_allocations();
    CHECK_RC(try_alloc(over), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK_EQ(tessera_sim_live_allocations(), live);
}

static CUresult try_alloc_v2(uint64_t n) { CUdeviceptr p; return cuMemAlloc_v2(&p, n); }
static CUresult try_alloc_v1(uint64_t n) { CUdeviceptr_v1 p; return cuMemAlloc(&p, (unsigned int)n); }
static CUresult try_managed(uint64_t n) { CUdeviceptr p; return cuMemAllocManaged(&p, n, CU_MEM_ATTACH_GLOBAL); }
static CUresult try_async(uint64_t n) { CUdeviceptr p; return cuMemAllocAsync(&p, n, NULL); }
static CUresult try_async_ptsz(uint64_t n) { CUdeviceptr p; return cuMemAllocAsync_ptsz(&p, n, NULL); }
static CUmemoryPool pool;
static CUresult try_pool(uint64_t n) { CUdeviceptr p; return cuMemAllocFromPoolAsync(&p, n, pool, NULL); }
static CUresult try_pool_ptsz(uint64_t n) { CUdeviceptr p; return cuMemAllocFromPoolAsync_ptsz(&p, n, pool, NULL); }
static CUresult try_pitch(uint64_t n) { CUdeviceptr p; size_t pitch; return cuMemAllocPitch_v2(&p, &pitch, 512, n / 512, 4); }
static CUmemAllocationProp vmm_prop(void)
{
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = 1;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    return prop;
}
static CUresult try_create(uint64_t n)
{
    CUmemAllocationProp prop = vmm_prop();
    CUmemGenericAllocationHandle h;
    return cuMemCreate(&h, (n + (2 * MiB - 1)) & ~(2 * MiB - 1), &prop, 0);
}
static CUresult try_array(uint64_t n)
{
    CUDA_ARRAY_DESCRIPTOR d = {.Width = n / 4, .Height = 1, .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 1};
    CUarray a;
    return cuArrayCreate_v2(&a, &d);
}

static void plain_paths(void)
{
    CUdeviceptr p;
    CUdeviceptr_v1 p1;

    OK(cuMemAlloc(&p1, (unsigned int)MiB));
    expect_charged("cuMemAlloc", MiB);
    expect_refused_at_limit(try_alloc_v1, LIMIT - MiB + 1);
    OK(cuMemFree(p1));
    expect_charged("cuMemFree", 0);

    OK(cuMemAlloc_v2(&p, 3 * MiB));
    expect_charged("cuMemAlloc_v2", 3 * MiB);
    expect_refused_at_limit(try_alloc_v2, LIMIT - 3 * MiB + 1);
    OK(cuMemFree_v2(p));
    expect_charged("cuMemFree_v2", 0);

    size_t pitch;
    OK(cuMemAllocPitch_v2(&p, &pitch, 1000, 100, 4));
    CHECK_EQ(pitch, 1024);
    expect_charged("cuMemAllocPitch_v2", 1024 * 100);
    expect_refused_at_limit(try_pitch, LIMIT);
    OK(cuMemFree_v2(p));
    expect_charged("cuMemFree_v2 (pitch)", 0);

    unsigned int pitch1;
    OK(cuMemAllocPitch(&p1, &pitch1, 1000, 100, 4));
    CHECK_EQ(pitch1, 1024);
    expect_charged("cuMemAllocPitch", 1024 * 100);
    OK(cuMemFree(p1));
    expect_charged("cuMemFree (pitch)", 0);

    OK(cuMemAllocManaged(&p, 5 * MiB, CU_MEM_ATTACH_GLOBAL));
    expect_charged("cuMemAllocManaged", 5 * MiB);
    expect_refused_at_limit(try_managed, LIMIT - 5 * MiB + 1);
    OK(cuMemFree_v2(p));
    expect_charged("cuMemFree_v2 (managed)", 0);

    OK(cuMemAllocAsync(&p, 7 * MiB, NULL));
    expect_charged("cuMemAllocAsync", 7 * MiB);
    expect_refused_at_limit(try_async, LIMIT - 7 * MiB + 1);
    OK(cuMemFreeAsync(p, NULL));
    expect_kept_until_sync("cuMemFreeAsync", 7 * MiB);

    OK(cuMemAllocAsync_ptsz(&p, 7 * MiB, NULL));
    expect_charged("cuMemAllocAsync_ptsz", 7 * MiB);
    expect_refused_at_limit(try_async_ptsz, LIMIT - 7 * MiB + 1);
    OK(cuMemFreeAsync_ptsz(p, NULL));
    expect_kept_until_sync("cuMemFreeAsync_ptsz", 7 * MiB);

    CUmemPoolProps props;
    memset(&props, 0, sizeof props);
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = 0;
    OK(cuMemPoolCreate(&pool, &props));
    OK(cuMemAllocFromPoolAsync(&p, 9 * MiB, pool, NULL));
    expect_charged("cuMemAllocFromPoolAsync", 9 * MiB);
    expect_refused_at_limit(try_pool, LIMIT - 9 * MiB + 1);
    OK(cuMemFreeAsync(p, NULL));
    expect_kept_until_sync("cuMemFreeAsync (pool)", 9 * MiB);
    OK(cuDeviceGetDefaultMemPool(&pool, 0));
    OK(cuMemAllocFromPoolAsync_ptsz(&p, 9 * MiB, pool, NULL));
    expect_charged("cuMemAllocFromPoolAsync_ptsz", 9 * MiB);
    expect_refused_at_limit(try_pool_ptsz, LIMIT - 9 * MiB + 1);
    OK(cuMemFreeAsync_ptsz(p, NULL));
    expect_kept_until_sync("cuMemFreeAsync_ptsz (pool)", 9 * MiB);
}

static void vmm_paths(void)
{
    CUmemAllocationProp prop = vmm_prop();
    CUmemGenericAllocationHandle h1, h2;
    CUdeviceptr va;

    /* release while mapped: the memory stays until the last unmap */
    OK(cuMemCreate(&h1, 4 * MiB, &prop, 0));
    OK(cuMemCreate(&h2, 2 * MiB, &prop, 0));
    expect_charged("cuMemCreate", 6 * MiB);
    expect_refused_at_limit(try_create, LIMIT - 4 * MiB);
    OK(cuMemAddressReserve(&va, 6 * MiB, 0, 0, 0));
    OK(cuMemMap(va, 4 * MiB, 0, h1, 0));
    OK(cuMemMap(va + 4 * MiB, 2 * MiB, 0, h2, 0));
    expect_charged("cuMemMap (no new memory)", 6 * MiB);
    OK(cuMemRelease(h1));
    OK(cuMemRelease(h2));
    expect_charged("cuMemRelease while mapped", 6 * MiB);
    OK(cuMemUnmap(va, 6 * MiB));
    expect_charged("cuMemUnmap after release", 0);
    CHECK_EQ(tessera_sim_memory_used(0), 0);

    /* unmap first, release second */
    OK(cuMemCreate(&h1, 2 * MiB, &prop, 0));
    OK(cuMemMap(va, 2 * MiB, 0, h1, 0));
    OK(cuMemUnmap(va, 2 * MiB));
    expect_charged("cuMemUnmap before release", 2 * MiB);
    OK(cuMemRelease(h1));
    expect_charged("cuMemRelease after unmap", 0);
    OK(cuMemAddressFree(va, 6 * MiB));
}

static void array_paths(void)
{
    CUarray a;
    CUDA_ARRAY_DESCRIPTOR d2 = {.Width = 256, .Height = 256, .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 4};
    OK(cuArrayCreate_v2(&a, &d2));
    expect_charged("cuArrayCreate_v2", 256 * 256 * 16);
    expect_refused_at_limit(try_array, LIMIT - MiB + 4);
    OK(cuArrayDestroy(a));
    expect_charged("cuArrayDestroy", 0);

    CUDA_ARRAY_DESCRIPTOR_v1 d1 = {.Width = 512, .Height = 512, .Format = CU_AD_FORMAT_UNSIGNED_INT8, .NumChannels = 2};
    OK(cuArrayCreate(&a, &d1));
    expect_charged("cuArrayCreate", 512 * 512 * 2);
    OK(cuArrayDestroy(a));
    expect_charged("cuArrayDestroy (v1)", 0);

    CUDA_ARRAY3D_DESCRIPTOR d3 = {.Width = 64, .Height = 64, .Depth = 64, .Format = CU_AD_FORMAT_HALF, .NumChannels = 1};
    OK(cuArray3DCreate_v2(&a, &d3));
    expect_charged("cuArray3DCreate_v2", 64 * 64 * 64 * 2);
    OK(cuArrayDestroy(a));
    CUDA_ARRAY3D_DESCRIPTOR_v1 d31 = {.Width = 32, .Height = 32, .Depth = 32, .Format = CU_AD_FORMAT_SIGNED_INT32, .NumChannels = 1};
    OK(cuArray3DCreate(&a, &d31));
    expect_charged("cuArray3DCreate", 32 * 32 * 32 * 4);
    OK(cuArrayDestroy(a));
    expect_charged("cuArrayDestroy (3D)", 0);

    CUmipmappedArray m;
    CUDA_ARRAY3D_DESCRIPTOR dm = {.Width = 256, .Height = 256, .Depth = 0, .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 1};
    OK(cuMipmappedArrayCreate(&m, &dm, 3));
    expect_charged("cuMipmappedArrayCreate", (256 * 256 + 128 * 128 + 64 * 64) * 4);
    OK(cuMipmappedArrayDestroy(m));
    expect_charged("cuMipmappedArrayDestroy", 0);
}

int main(void)
{
    vt_ctx(0);
    plain_paths();
    vmm_paths();
    array_paths();
    CHECK_EQ(tessera_sim_live_allocations(), 0);
    CHECK_EQ(vt_free(), LIMIT);
    printf("paths: 9 allocation paths (+ _ptsz and v1 variants) charged, refused at the limit and uncharged\n");
    return 0;
}
