/* t_priority: runtime priority between two claims on one GPU (HAMi's nvidia.com/priority, 0 high, 1 low).
 * Two claims, each its own process, config file (the node file a container gets) and Ledger, meet on
 * the GPU's priority board. The low-priority claim runs kernels for the whole run; the high-priority
 * one launches only from 0.5 s to 1.0 s. Each counts the device time its kernels completed per 100 ms
 * bucket, and the table of both shares is printed.
 *   t_priority show   high stops launching at 1.0 s and idles
 *   t_priority kill   high is SIGKILLed at 1.0 s while launching: its stamp must age out by itself
 *   t_priority future the board holds a stamp 10 s in the future (a hostile high claim): ignored
 *   t_priority files LOW HIGH   as `show` without the third claim, with the claim files given (the
 *                     enforcer's vgpu.conf of a low- and a high-priority claim on one GPU)
 * In `show` a third claim without a priority runs throughout too: it neither yields nor is yielded to.
 * Asserted (shares of device time, means over buckets; 10-20 points of slack for a loaded CPU): low
 * >= 50% before high starts and after it stops (from the second bucket after), <= 20% while high
 * launches (from its second bucket; the floor is PRIORITY_FLOOR_PCT = 5%), high and the claim without a
 * priority >= 50% meanwhile.
 * Needs VT_WORK (a directory) and TESSERA_SIM_KERNEL_US; run with the test build (node file hook). */
#include "vt.h"

#define BUCKET_S 0.1
#define BUCKETS 16
#define HIGH_FROM 5 /* buckets */
#define HIGH_TO 10
#define BATCH 2     /* kernels per launch-and-synchronise round */

static int counts_of(const char *role, double t0, int from, int to, int forever, int *counts)
{
    CUfunction fn = vt_kernel();
    CUstream s;
    OK(cuStreamCreate(&s, 0));
    double start = t0 + from * BUCKET_S, end = t0 + to * BUCKET_S;
    while (vt_now() < start)
        usleep(1000);
    while (forever || vt_now() < end) {
        for (int i = 0; i < BATCH; i++)
            OK(cuLaunchKernel(fn, 132, 1, 1, 256, 1, 1, 0, s, NULL, NULL));
        OK(cuStreamSynchronize(s));
        int b = (int)((vt_now() - t0) / BUCKET_S);
        if (b >= 0 && b < BUCKETS)
            counts[b] += BATCH;
    }
    (void)role;
    return 0;
}

/* a claim's process: `role` low|none|high|high-forever, arg "up,down" */
static int worker(const char *role, const char *arg)
{
    int up, down, counts[BUCKETS] = {0};
    CHECK(sscanf(arg, "%d,%d", &up, &down) == 2);
    vt_ctx(0);
    vt_send_byte(up);
    double t0;
    CHECK(read(down, &t0, sizeof t0) == sizeof t0);
    if (!strcmp(role, "low") || !strcmp(role, "none"))
        counts_of(role, t0, 0, BUCKETS, 0, counts);
    else
        counts_of(role, t0, HIGH_FROM, HIGH_TO, !strcmp(role, "high-forever"), counts);
    CHECK(write(up, counts, sizeof counts) == sizeof counts);
    return 0;
}

/* the claim's config file, as the enforcer writes it (priority, the GPU's board, its own Ledger) */
static void claim_file(char *path, size_t n, const char *dir, const char *name, int priority, const char *board)
{
    snprintf(path, n, "%s/%s.conf", dir, name);
    FILE *f = fopen(path, "w");
    CHECK(f);
    fprintf(f, "CUDA_DEVICE_MEMORY_LIMIT_0=1g\nCUDA_DEVICE_MEMORY_SHARED_CACHE=%s/%s.cache\n", dir, name);
    if (priority >= 0) /* the enforcer names a board only for a claim with a priority */
        fprintf(f, "CUDA_TASK_PRIORITY=%d\nTESSERA_VGPU_PRIORITY_BOARD_0=%s\n", priority, board);
    CHECK(fclose(f) == 0);
}

static double mean_share(const int *counts, int from, int to)
{
    double sum = 0;
    for (int b = from; b < to; b++)
        sum += counts[b] * vt_kernel_s() / BUCKET_S;
    return sum / (to - from);
}

static int expect(const char *what, double share, double lo, double hi)
{
    int ok = share >= lo && share <= hi;
    printf("%s: %.1f%% (want %.0f%%..%.0f%%)%s\n", what, share * 100, lo * 100, hi * 100, ok ? "" : "  FAIL");
    return !ok;
}

int main(int argc, char **argv)
{
    CHECK(argc >= 2);
    if (argc == 3)
        return worker(argv[1], argv[2]);
    const char *mode = argv[1], *dir = getenv("VT_WORK");
    CHECK(dir);
    int files = !strcmp(mode, "files");
    CHECK(!strcmp(mode, "show") || !strcmp(mode, "kill") || !strcmp(mode, "future") || (files && argc == 4));
    char board[4096], conf[3][4096], node[3][4200], arg[3][64];
    snprintf(board, sizeof board, "%s/priority-%s.board", dir, mode);
    int bfd = files ? -2 : open(board, O_WRONLY | O_CREAT | O_TRUNC, 0666); /* as the enforcer does: empty */
    CHECK(bfd == -2 || (bfd >= 0 && close(bfd) == 0));
    /* claims: 0 low, 1 high, 2 none (no priority: neither yields nor is yielded to) */
    const char *names[3] = {"low", "high", "none"};
    int n = !strcmp(mode, "show") ? 3 : !strcmp(mode, "kill") || files ? 2 : 1;
    for (int i = 0; i < n && files; i++)
        snprintf(conf[i], sizeof conf[i], "%s", argv[2 + i]);
    for (int i = 0; i < n && !files; i++) {
        char name[64];
        snprintf(name, sizeof name, "%s-%s", names[i], mode);
        claim_file(conf[i], sizeof conf[i], dir, name, i == 0 ? 1 : i == 1 ? 0 : -1, board);
    }
    if (n == 1) { /* what a hostile high-priority claim could write: a stamp far ahead of now */
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        struct { char magic[8]; uint32_t version, header_size; int64_t stamp; } b = {
            "TESSPRIO", 1, 16, (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec + 10000000000LL};
        int fd = open(board, O_WRONLY | O_TRUNC);
        CHECK(fd >= 0 && write(fd, &b, sizeof b) == (ssize_t)sizeof b && close(fd) == 0);
    }
    vt_chan ch[3];
    pid_t pid[3] = {0, 0, 0};
    for (int i = 0; i < n; i++) {
        vt_chan_open(&ch[i]);
        snprintf(node[i], sizeof node[i], "TESSERA_VGPU_TEST_NODE_CONFIG=%s", conf[i]);
        snprintf(arg[i], sizeof arg[i], "%d,%d", ch[i].up[1], ch[i].down[0]);
        const char *env[] = {node[i], ""};
        pid[i] = vt_spawn(i == 1 && !strcmp(mode, "kill") ? "high-forever" : names[i], arg[i], env);
    }
    for (int i = 0; i < n; i++)
        vt_expect_byte(ch[i].up[0]);
    double t0 = vt_now() + 0.05;
    for (int i = 0; i < n; i++)
        CHECK(write(ch[i].down[1], &t0, sizeof t0) == sizeof t0);
    int counts[3][BUCKETS] = {{0}};
    if (!strcmp(mode, "kill")) { /* high dies while launching, at the end of its phase */
        while (vt_now() < t0 + HIGH_TO * BUCKET_S)
            usleep(1000);
        kill(pid[1], SIGKILL);
        CHECK_EQ(vt_wait(pid[1]), 128 + SIGKILL);
    }
    for (int i = 0; i < n; i++) {
        if (i == 1 && !strcmp(mode, "kill"))
            continue;
        CHECK(read(ch[i].up[0], counts[i], sizeof counts[i]) == sizeof counts[i]);
        CHECK_EQ(vt_wait(pid[i]), 0);
    }
    printf("| t (ms) | high priority (0) | low priority (1) |%s\n|---:|---:|---:|%s\n", n == 3 ? " no priority |" : "",
           n == 3 ? "---:|" : "");
    for (int b = 0; b < BUCKETS; b++) {
        printf("| %d–%d | %.0f%% | %.0f%% |", b * 100, (b + 1) * 100, counts[1][b] * vt_kernel_s() / BUCKET_S * 100,
               counts[0][b] * vt_kernel_s() / BUCKET_S * 100);
        if (n == 3)
            printf(" %.0f%% |", counts[2][b] * vt_kernel_s() / BUCKET_S * 100);
        printf("\n");
    }
    int bad = 0;
    if (n == 1) {
        bad |= expect("low, a stamp from the future on the board", mean_share(counts[0], 1, BUCKETS), 0.5, 1.1);
    } else {
        bad |= expect("low before high launches", mean_share(counts[0], 1, HIGH_FROM), 0.5, 1.1);
        bad |= expect("low while high launches", mean_share(counts[0], HIGH_FROM + 1, HIGH_TO), 0, 0.2);
        if (strcmp(mode, "kill"))
            bad |= expect("high while it launches", mean_share(counts[1], HIGH_FROM + 1, HIGH_TO), 0.5, 1.1);
        bad |= expect(strcmp(mode, "kill") ? "low after high idles" : "low after high was killed",
                      mean_share(counts[0], HIGH_TO + 2, BUCKETS), 0.5, 1.1);
        if (n == 3)
            bad |= expect("no priority while high launches", mean_share(counts[2], HIGH_FROM + 1, HIGH_TO), 0.5, 1.1);
    }
    printf("priority %s: %s\n", mode, bad ? "FAILED" : "low yields to high and recovers");
    return bad;
}
