/* t_ctx: memory that no allocation call names — a context's and a loaded module's — counts against
 * the claim, and the card itself (TESSERA_SIM_CARD, shared by every process here) never holds more
 * than the claims add up to. Run with TESSERA_SIM_CONTEXT_MIB=64, TESSERA_SIM_MODULE_KIB=8192 and
 * the claim's CUDA_DEVICE_CONTEXT_OVERHEAD=64m.
 *   t_ctx overhead      one process, limit 512 MiB: context and module show in cuMemGetInfo and NVML
 *   t_ctx ten <mib>     ten processes of one claim, each with its own context, take all the claim's
 *                       free memory: the card holds no more than the claim's limit
 *   t_ctx fill <mib>    two claims of <mib> each exactly fill the card; three processes each take all
 *                       they are told is free, one claim after the other: no allocation fails
 *   t_ctx pool          limit 64 MiB: what a memory pool keeps after cuMemFreeAsync (release threshold
 *                       "everything", as PyTorch sets it) stays charged until the pool gives it back
 * Against the library before contexts were counted, the card held the limit plus ten contexts, and
 * the second claim's allocations failed inside its own limit, and a pool's kept memory was not charged. */
#include "vt.h"

#include <dlfcn.h>

#define CTX (64 * MiB)
#define MOD (8 * MiB)

static nvmlMemory_t nvml_memory(void)
{
    nvmlDevice_t d;
    nvmlMemory_t m;
    CHECK_RC(nvmlInit_v2(), NVML_SUCCESS);
    CHECK_RC(nvmlDeviceGetHandleByIndex_v2(0, &d), NVML_SUCCESS);
    CHECK_RC(nvmlDeviceGetMemoryInfo(d, &m), NVML_SUCCESS);
    return m;
}

static int overhead(void)
{
    vt_ctx(0);
    CHECK_EQ(vt_total(), 512 * MiB);
    CHECK_EQ(vt_used(), CTX);
    CUmodule mod;
    OK(cuModuleLoadData(&mod, "sim"));
    CHECK_EQ(vt_used(), CTX + MOD); /* measured by the driver's own answer around the load */
    nvmlMemory_t m = nvml_memory();
    CHECK_EQ(m.total, 512 * MiB);
    CHECK_EQ(m.used, CTX + MOD);
    CHECK_EQ(m.free, 512 * MiB - CTX - MOD);
    CHECK_EQ(tessera_sim_card_used(0), CTX + MOD); /* what the card holds is what the claim is charged */
    pid_t kid = fork(); /* a fork child (a data-loader worker) neither takes nor returns our overhead */
    CHECK(kid >= 0);
    if (kid == 0)
        exit(0);
    CHECK_EQ(vt_wait(kid), 0);
    CHECK_EQ(vt_used(), CTX + MOD);
    CUdeviceptr p;
    CHECK_RC(cuMemAlloc_v2(&p, 512 * MiB - CTX - MOD + 1), CUDA_ERROR_OUT_OF_MEMORY);
    OK(cuMemAlloc_v2(&p, 512 * MiB - CTX - MOD));
    CHECK_EQ(tessera_sim_card_used(0), 512 * MiB);
    /* no room for another context or module: refused before the driver is asked */
    CUcontext extra;
    CHECK_RC(cuCtxCreate_v2(&extra, 0, 0), CUDA_ERROR_OUT_OF_MEMORY);
    CUmodule mod2;
    CHECK_RC(cuModuleLoadData(&mod2, "sim"), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK_EQ(tessera_sim_card_used(0), 512 * MiB);
    OK(cuModuleUnload(mod));
    OK(cuMemFree_v2(p));
    CHECK_EQ(vt_used(), CTX);
    OK(cuCtxCreate_v2(&extra, 0, 0)); /* a second context of the process is a second overhead */
    CHECK_EQ(vt_used(), 2 * CTX);
    OK(cuCtxDestroy_v2(extra));
    OK(cuCtxSetCurrent(NULL));
    CHECK_EQ(tessera_sim_card_used(0), CTX);
    OK(cuDevicePrimaryCtxRelease_v2(0));
    CHECK_EQ(tessera_sim_card_used(0), 0);
    printf("context and module memory charged and returned; cuMemGetInfo, NVML and the card agree\n");
    return 0;
}

static int pool_keeps(void)
{
    vt_ctx(0);
    CUmemoryPool pool;
    CUstream s;
    OK(cuStreamCreate(&s, 0));
    OK(cuDeviceGetDefaultMemPool(&pool, 0));
    cuuint64_t keep_all = ~0ULL;
    OK(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep_all));
    CUdeviceptr a, b;
    OK(cuMemAllocAsync(&a, 40 * MiB, s));
    OK(cuMemFreeAsync(a, s));
    OK(cuStreamSynchronize(s));
    CHECK_EQ(tessera_sim_card_used(0), 40 * MiB); /* the pool keeps it ... */
    CHECK_EQ(vt_used(), 40 * MiB);                 /* ... and the claim is charged for it */
    CHECK_EQ(nvml_memory().used, 40 * MiB);
    CHECK_RC(cuMemAlloc_v2(&b, 24 * MiB + 1), CUDA_ERROR_OUT_OF_MEMORY);
    OK(cuMemAlloc_v2(&b, 24 * MiB));
    CHECK_EQ(tessera_sim_card_used(0), 64 * MiB);
    OK(cuMemFree_v2(b));
    OK(cuMemAllocAsync(&a, 32 * MiB, s)); /* the pool hands out what it keeps: no second charge */
    CHECK_EQ(vt_used(), 40 * MiB);
    OK(cuMemFreeAsync(a, s));
    OK(cuMemPoolTrimTo(pool, 0));
    CHECK_EQ(tessera_sim_card_used(0), 0);
    CHECK_EQ(vt_used(), 0); /* settled at the query */
    OK(cuMemAlloc_v2(&b, 64 * MiB));
    OK(cuMemFree_v2(b));
    printf("pool: what a pool keeps is charged until it gives it back\n");
    return 0;
}

/* One process of a claim: its own context, then, on the word, everything it is told is free. */
static int greedy(const char *arg)
{
    int up, down;
    CHECK(sscanf(arg, "%d,%d", &up, &down) == 2);
    CUcontext ctx;
    OK(cuInit(0));
    OK(cuCtxCreate_v2(&ctx, 0, 0));
    vt_send_byte(up);
    vt_expect_byte(down);
    uint64_t got = 0;
    for (;;) {
        uint64_t f = vt_free() / MiB * MiB;
        if (!f)
            break;
        uint64_t chunk = f < 16 * MiB ? f : 16 * MiB;
        CUdeviceptr p;
        CUresult r = cuMemAlloc_v2(&p, chunk);
        if (r != CUDA_SUCCESS) {
            fprintf(stderr, "t_ctx: pid %d: %llu MiB failed (%d) with %llu MiB free by cuMemGetInfo: a neighbour's "
                    "memory is on the card\n", (int)getpid(), (unsigned long long)(chunk / MiB), (int)r,
                    (unsigned long long)(f / MiB));
            return 3;
        }
        got += chunk;
    }
    CHECK(write(up, &got, sizeof got) == sizeof got);
    vt_expect_byte(down); /* hold it until the parent has looked at the card */
    return 0;
}

typedef struct { pid_t pid; vt_chan ch; } proc;

static void start(proc *p, const char *limit, const char *cache)
{
    char arg[32], lim[64], cch[4200];
    vt_chan_open(&p->ch);
    snprintf(arg, sizeof arg, "%d,%d", p->ch.up[1], p->ch.down[0]);
    snprintf(lim, sizeof lim, "CUDA_DEVICE_MEMORY_LIMIT_0=%s", limit);
    snprintf(cch, sizeof cch, "CUDA_DEVICE_MEMORY_SHARED_CACHE=%s", cache);
    const char *env[] = {lim, cch, ""};
    p->pid = vt_spawn("greedy", arg, env);
    vt_expect_byte(p->ch.up[0]);
}

static uint64_t take_all(proc *p)
{
    uint64_t got;
    vt_send_byte(p->ch.down[1]);
    CHECK(read(p->ch.up[0], &got, sizeof got) == sizeof got);
    return got;
}

static void finish(proc *p)
{
    vt_send_byte(p->ch.down[1]);
    CHECK_EQ(vt_wait(p->pid), 0);
}

int main(int argc, char **argv)
{
    CHECK(argc >= 2);
    if (!strcmp(argv[1], "overhead"))
        return overhead();
    if (!strcmp(argv[1], "pool"))
        return pool_keeps();
    if (!strcmp(argv[1], "greedy"))
        return greedy(argv[2]);
    CHECK(argc == 3);
    uint64_t mib = strtoull(argv[2], NULL, 10);
    const char *dir = getenv("VT_WORK");
    CHECK(dir);
    char limit[32], cache[2][4096];
    snprintf(limit, sizeof limit, "%llum", (unsigned long long)mib);
    if (!strcmp(argv[1], "ten")) {
        proc p[10];
        snprintf(cache[0], sizeof cache[0], "%s/ten.cache", dir);
        for (int i = 0; i < 10; i++)
            start(&p[i], limit, cache[0]);
        uint64_t got = 0;
        for (int i = 0; i < 10; i++)
            got += take_all(&p[i]);
        uint64_t card = tessera_sim_card_used(0);
        printf("ten: the processes hold %llu MiB in allocations; the card holds %llu MiB; the claim's limit is %llu MiB\n",
               (unsigned long long)(got / MiB), (unsigned long long)(card / MiB), (unsigned long long)mib);
        CHECK(card <= mib * MiB);
        CHECK(card >= mib * MiB - 10 * MiB); /* and the claim got what it was promised */
        for (int i = 0; i < 10; i++)
            finish(&p[i]);
        return 0;
    }
    CHECK(!strcmp(argv[1], "fill"));
    proc p[2][3];
    for (int c = 0; c < 2; c++) {
        snprintf(cache[c], sizeof cache[c], "%s/fill-%d.cache", dir, c);
        for (int i = 0; i < 3; i++)
            start(&p[c][i], limit, cache[c]);
    }
    uint64_t got[2] = {0, 0};
    for (int c = 0; c < 2; c++) /* the first claim takes all it may, then the second */
        for (int i = 0; i < 3; i++)
            got[c] += take_all(&p[c][i]);
    printf("fill: claims of %llu MiB each got %llu and %llu MiB in allocations; the card holds %llu MiB\n",
           (unsigned long long)mib, (unsigned long long)(got[0] / MiB), (unsigned long long)(got[1] / MiB),
           (unsigned long long)(tessera_sim_card_used(0) / MiB));
    CHECK(tessera_sim_card_used(0) <= 2 * mib * MiB);
    for (int c = 0; c < 2; c++) /* each claim got all its limit: contexts plus allocations */
        CHECK(got[c] + 3 * CTX >= mib * MiB);
    for (int c = 0; c < 2; c++)
        for (int i = 0; i < 3; i++)
            finish(&p[c][i]);
    return 0;
}
