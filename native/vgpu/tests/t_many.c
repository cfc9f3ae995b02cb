/* t_many: start-up with many processes (HAMi #1662): N processes of one workload start at once, each
 * allocates, and all of them are in the shared accounting. Prints the time; asserts only that every
 * process got in and that all usage is seen and given back. */
#include "vt.h"

static int child(const char *fds)
{
    int up, down;
    CHECK(sscanf(fds, "%d,%d", &up, &down) == 2);
    vt_ctx(0);
    CUdeviceptr p;
    OK(cuMemAlloc_v2(&p, MiB));
    vt_send_byte(up);
    vt_expect_byte(down);
    OK(cuMemFree_v2(p));
    return 0;
}

int main(int argc, char **argv)
{
    if (argc > 2 && !strcmp(argv[1], "child"))
        return child(argv[2]);
    int n = argc > 1 ? atoi(argv[1]) : 100;
    vt_ctx(0);
    vt_chan ch;
    vt_chan_open(&ch);
    char fds[32];
    snprintf(fds, sizeof fds, "%d,%d", ch.up[1], ch.down[0]);
    pid_t *pids = calloc((size_t)n, sizeof *pids);
    double t0 = vt_now();
    for (int i = 0; i < n; i++)
        pids[i] = vt_spawn("child", fds, NULL);
    for (int i = 0; i < n; i++)
        vt_expect_byte(ch.up[0]);
    double ready = vt_now() - t0;
    CHECK_EQ(vt_used(), (uint64_t)n * MiB);
    for (int i = 0; i < n; i++)
        vt_send_byte(ch.down[1]);
    for (int i = 0; i < n; i++)
        CHECK_EQ(vt_wait(pids[i]), 0);
    double all = vt_now() - t0;
    CHECK_EQ(vt_used(), 0);
    printf("many: %d processes started and allocated in %.0f ms (%.2f ms each), all exited after %.0f ms\n", n,
           ready * 1e3, ready * 1e3 / n, all * 1e3);
    return 0;
}
