/* t_shared: two processes of one workload share one budget through the shared cache file, and the
 * second sees the first one's usage (HAMi-core #191). A process leaving normally gives its usage
 * back; a fork child that exits does not take its parent's usage with it.
 * Run with CUDA_DEVICE_MEMORY_LIMIT_0=64m and a shared cache file. */
#include "vt.h"

static int second(const char *fds)
{
    int up, down;
    CHECK(sscanf(fds, "%d,%d", &up, &down) == 2);
    vt_ctx(0);
    CHECK_EQ(vt_total(), 64 * MiB);
    CHECK_EQ(vt_free(), 24 * MiB); /* the first process holds 40 MiB */
    CUdeviceptr p;
    CHECK_RC(cuMemAlloc_v2(&p, 24 * MiB + 1), CUDA_ERROR_OUT_OF_MEMORY);
    OK(cuMemAlloc_v2(&p, 24 * MiB));
    CHECK_EQ(vt_free(), 0);
    vt_send_byte(up);
    vt_expect_byte(down);
    return 0; /* exits holding 24 MiB: the library gives it back */
}

int main(int argc, char **argv)
{
    if (argc > 2 && !strcmp(argv[1], "second"))
        return second(argv[2]);

    vt_ctx(0);
    CUdeviceptr a;
    OK(cuMemAlloc_v2(&a, 40 * MiB));

    vt_chan ch;
    vt_chan_open(&ch);
    char fds[32];
    snprintf(fds, sizeof fds, "%d,%d", ch.up[1], ch.down[0]);
    pid_t pid = vt_spawn("second", fds, NULL);
    vt_expect_byte(ch.up[0]);
    CHECK_EQ(vt_free(), 0); /* and the first sees the second */
    CUdeviceptr b;
    CHECK_RC(cuMemAlloc_v2(&b, 1), CUDA_ERROR_OUT_OF_MEMORY);
    vt_send_byte(ch.down[1]);
    CHECK_EQ(vt_wait(pid), 0);
    CHECK_EQ(vt_free(), 24 * MiB);

    /* a fork child (no CUDA, as a data-loader worker) exits: our 40 MiB stay ours */
    pid_t kid = fork();
    CHECK(kid >= 0);
    if (kid == 0)
        exit(0); /* runs the library's destructor in the child */
    CHECK_EQ(vt_wait(kid), 0);
    CHECK_EQ(vt_free(), 24 * MiB);
    CHECK_RC(cuMemAlloc_v2(&b, 24 * MiB + 1), CUDA_ERROR_OUT_OF_MEMORY);
    OK(cuMemFree_v2(a));
    CHECK_EQ(vt_free(), 64 * MiB);
    printf("shared: two processes, one budget, each sees the other\n");
    return 0;
}
