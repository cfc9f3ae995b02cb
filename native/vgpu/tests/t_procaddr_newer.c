/* t_procaddr_newer.c: the attack "ask cuGetProcAddress for an allocation entry point at a CUDA version
 * newer than libvgpu knows". When the driver answers with an internal address (not one of its exported
 * symbols), libvgpu cannot match it to a wrapper by address; handing it back raw lets the workload
 * allocate past its limit. It must be refused the way the driver refuses an unknown symbol, or be
 * wrapped. Run with CUDA_DEVICE_MEMORY_LIMIT_0=64m and TESSERA_SIM_PROCADDR_INTERNAL=1. */
#include "vt.h"

typedef CUresult (*alloc_t)(CUdeviceptr *, size_t);

/* returns 1 if the answer was refused, 0 if it was an entry point that enforces the limit */
static int probe(int api, const char *sym, int ver)
{
    void *fn = (void *)1;
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SUCCESS;
    CUresult r = api == 1 ? cuGetProcAddress(sym, &fn, ver, 0) : cuGetProcAddress_v2(sym, &fn, ver, 0, &st);
    if (r != CUDA_SUCCESS) {
        CHECK_RC(r, CUDA_ERROR_NOT_FOUND);
        CHECK(fn == NULL);
        if (api == 2)
            CHECK(st == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
        return 1;
    }
    CHECK(fn != NULL);
    CUdeviceptr p;
    /* the bypass: 128 MiB under a 64 MiB limit */
    CHECK_RC(((alloc_t)fn)(&p, 128 * MiB), CUDA_ERROR_OUT_OF_MEMORY);
    return 0;
}

int main(void)
{
    vt_ctx(0);
    int refused = 0;
    static const int versions[] = {14000, 20000, 99999};
    for (int api = 1; api <= 2; api++)
        for (size_t v = 0; v < 3; v++) {
            refused += probe(api, "cuMemAlloc", versions[v]);
            refused += probe(api, "cuMemAlloc_v2", versions[v]);
        }
    /* a known version still gets the wrapper, which enforces */
    alloc_t fn;
    OK(cuGetProcAddress_v2("cuMemAlloc", (void **)&fn, 13000, 0, NULL));
    CHECK(fn == &cuMemAlloc_v2);
    CHECK_EQ(tessera_sim_memory_used(0), 0);
    printf("procaddr-newer: %d of 12 newer-ABI lookups refused, the rest enforce; nothing allocated past the limit\n",
           refused);
    return 0;
}
