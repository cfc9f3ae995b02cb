/* t_kill: a process SIGKILLed while holding memory, or while holding the shared cache lock in the
 * middle of an update, leaves no deadlock behind and its usage is reclaimed (HAMi-core #86).
 * The second case needs the test build of the library (build/test/libvgpu.so), whose
 * TESSERA_VGPU_TEST_HOLD_LOCK_MS makes an allocation sleep while it holds the lock.
 * Run with CUDA_DEVICE_MEMORY_LIMIT_0=64m and a shared cache file. */
#include "vt.h"

static int holder(const char *fd_s)
{
    int up = atoi(fd_s);
    vt_ctx(0);
    CUdeviceptr p;
    OK(cuMemAlloc_v2(&p, 40 * MiB)); /* with the hold hook this never returns */
    vt_send_byte(up);
    for (;;)
        pause();
}

/* Is the shared cache's update lock (byte 0) held by another process? */
static int lock_held(const char *path)
{
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return 0;
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
    int held = fcntl(fd, F_OFD_GETLK, &fl) == 0 && fl.l_type != F_UNLCK;
    close(fd);
    return held;
}

static void on_alarm(int sig)
{
    (void)sig;
    static const char msg[] = "t_kill: deadlock: no progress within 10 s\n";
    ssize_t w = write(2, msg, sizeof msg - 1);
    (void)w;
    _exit(3);
}

int main(int argc, char **argv)
{
    if (argc > 2 && !strcmp(argv[1], "holder"))
        return holder(argv[2]);
    const char *cache = getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    CHECK(cache);
    signal(SIGALRM, on_alarm);
    vt_ctx(0);
    CHECK_EQ(vt_free(), 64 * MiB);

    /* 1. killed while holding memory (not the lock) */
    vt_chan ch;
    vt_chan_open(&ch);
    char fd_s[16];
    snprintf(fd_s, sizeof fd_s, "%d", ch.up[1]);
    pid_t pid = vt_spawn("holder", fd_s, NULL);
    vt_expect_byte(ch.up[0]);
    CHECK_EQ(vt_free(), 24 * MiB);
    kill(pid, SIGKILL);
    CHECK_EQ(vt_wait(pid), 128 + SIGKILL);
    alarm(10);
    CUdeviceptr p;
    OK(cuMemAlloc_v2(&p, 40 * MiB)); /* only fits once the dead process's 40 MiB are reclaimed */
    OK(cuMemFree_v2(p));
    CHECK_EQ(vt_free(), 64 * MiB);
    alarm(0);
    printf("kill: usage of a SIGKILLed process reclaimed\n");

    /* 2. killed in the middle of an update, holding the lock */
    static const char *const hold_env[] = {"TESSERA_VGPU_TEST_HOLD_LOCK_MS=60000", ""};
    pid = vt_spawn("holder", fd_s, hold_env);
    double t0 = vt_now();
    while (!lock_held(cache)) {
        CHECK(vt_now() - t0 < 10);
        usleep(2000);
    }
    kill(pid, SIGKILL);
    CHECK_EQ(vt_wait(pid), 128 + SIGKILL);
    alarm(10);
    t0 = vt_now();
    OK(cuMemAlloc_v2(&p, 64 * MiB));
    double took = vt_now() - t0;
    alarm(0);
    CHECK_EQ(vt_free(), 0);
    OK(cuMemFree_v2(p));
    CHECK_EQ(vt_free(), 64 * MiB);
    printf("kill: lock holder SIGKILLed mid-update: no deadlock (next allocation took %.1f ms), usage reclaimed\n",
           took * 1e3);
    return 0;
}
