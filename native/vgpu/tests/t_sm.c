/* t_sm: the SM-share limiter holds its share of device time. The simulated device runs each kernel
 * for TESSERA_SIM_KERNEL_US of device time, so the share achieved is (kernels * kernel time) / wall
 * time. `t_sm one <pct> <n>` runs n kernels in one process; `t_sm pair <pct> <n>` runs two processes
 * of one workload at once, whose combined share must be the workload's share, not twice it.
 * Tolerance: 10 points on a loaded CPU (the GPU script's target is 5). */
#include "vt.h"

static void run_kernels(int n)
{
    CUfunction fn = vt_kernel();
    CUstream s;
    OK(cuStreamCreate(&s, 0));
    for (int i = 0; i < n; i++) {
        switch (i % 4) {
        case 0: OK(cuLaunchKernel(fn, 132, 1, 1, 256, 1, 1, 0, s, NULL, NULL)); break;
        case 1: OK(cuLaunchKernel_ptsz(fn, 132, 1, 1, 256, 1, 1, 0, NULL, NULL, NULL)); break;
        case 2: OK(cuLaunchCooperativeKernel(fn, 132, 1, 1, 256, 1, 1, 0, s, NULL)); break;
        default: {
            CUlaunchConfig c = {132, 1, 1, 256, 1, 1, 0, s, NULL, 0};
            OK(cuLaunchKernelEx(&c, fn, NULL, NULL));
        }
        }
    }
    OK(cuCtxSynchronize());
}

static int check_share(const char *what, double share, double want)
{
    printf("sm %s: target %.0f%%, measured %.1f%%\n", what, want * 100, share * 100);
    if (share < want - 0.10 || share > want + 0.10) {
        fprintf(stderr, "t_sm: share %.3f outside %.2f +/- 0.10\n", share, want);
        return 1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    CHECK(argc >= 2);
    if (!strcmp(argv[1], "work")) {
        /* argv[2] = "n,up,down": ready after start-up, go on the parent's word, report start/end */
        int n, up, down;
        CHECK(sscanf(argv[2], "%d,%d,%d", &n, &up, &down) == 3);
        vt_ctx(0);
        vt_send_byte(up);
        vt_expect_byte(down);
        double t0 = vt_now();
        run_kernels(n);
        double t[2] = {t0, vt_now()};
        CHECK(write(up, t, sizeof t) == sizeof t);
        return 0;
    }
    CHECK(argc == 4);
    double want = atof(argv[2]) / 100;
    int n = atoi(argv[3]);
    if (!strcmp(argv[1], "one")) {
        vt_ctx(0);
        double t0 = vt_now();
        run_kernels(n);
        double wall = vt_now() - t0;
        return check_share("one process", n * vt_kernel_s() / wall, want);
    }
    CHECK(!strcmp(argv[1], "pair"));
    /* process start-up is not GPU time: both start kernels together and report their own clocks */
    vt_chan ca, cb;
    vt_chan_open(&ca);
    vt_chan_open(&cb);
    char arg_a[64], arg_b[64];
    snprintf(arg_a, sizeof arg_a, "%d,%d,%d", n, ca.up[1], ca.down[0]);
    snprintf(arg_b, sizeof arg_b, "%d,%d,%d", n, cb.up[1], cb.down[0]);
    pid_t a = vt_spawn("work", arg_a, NULL), b = vt_spawn("work", arg_b, NULL);
    vt_expect_byte(ca.up[0]);
    vt_expect_byte(cb.up[0]);
    vt_send_byte(ca.down[1]);
    vt_send_byte(cb.down[1]);
    double ta[2], tb[2];
    CHECK(read(ca.up[0], ta, sizeof ta) == sizeof ta);
    CHECK(read(cb.up[0], tb, sizeof tb) == sizeof tb);
    CHECK_EQ(vt_wait(a), 0);
    CHECK_EQ(vt_wait(b), 0);
    double wall = (ta[1] > tb[1] ? ta[1] : tb[1]) - (ta[0] < tb[0] ? ta[0] : tb[0]);
    return check_share("two processes, one budget", 2 * n * vt_kernel_s() / wall, want);
}
