/* vt.h: the little the C tests share: plain asserts that print the driver's answer, context setup,
 * spawning this same test binary as a second process, and the simulated driver's test-only probes. */
#ifndef TESSERA_VT_H
#define TESSERA_VT_H

#define _GNU_SOURCE
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cuda_api.h"

#define MiB (1024ULL * 1024ULL)

#define CHECK(cond)                                                                                   \
    do {                                                                                              \
        if (!(cond)) {                                                                                \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);                  \
            abort();                                                                                  \
        }                                                                                             \
    } while (0)

#define CHECK_RC(call, want)                                                                          \
    do {                                                                                              \
        long _r = (long)(call), _w = (long)(want);                                                    \
        if (_r != _w) {                                                                               \
            fprintf(stderr, "%s:%d: %s returned %ld, want %ld\n", __FILE__, __LINE__, #call, _r, _w); \
            abort();                                                                                  \
        }                                                                                             \
    } while (0)

#define CHECK_EQ(a, b)                                                                                \
    do {                                                                                              \
        unsigned long long _a = (unsigned long long)(a), _b = (unsigned long long)(b);                \
        if (_a != _b) {                                                                               \
            fprintf(stderr, "%s:%d: %s == %llu, want %s == %llu\n", __FILE__, __LINE__, #a, _a, #b, _b); \
            abort();                                                                                  \
        }                                                                                             \
    } while (0)

#define OK(call) CHECK_RC(call, CUDA_SUCCESS)

/* simulated driver probes (not part of any real driver) */
uint64_t tessera_sim_memory_used(int dev);
uint64_t tessera_sim_card_used(int dev); /* the whole card: every process sharing TESSERA_SIM_CARD */
int tessera_sim_live_allocations(void);
void *tessera_sim_symbol(const char *name);

static inline CUcontext vt_ctx(int dev)
{
    CUcontext ctx;
    OK(cuInit(0));
    OK(cuDevicePrimaryCtxRetain(&ctx, dev));
    OK(cuCtxSetCurrent(ctx));
    return ctx;
}

static inline uint64_t vt_total(void)
{
    size_t f, t;
    OK(cuMemGetInfo_v2(&f, &t));
    return t;
}

static inline uint64_t vt_free(void)
{
    size_t f, t;
    OK(cuMemGetInfo_v2(&f, &t));
    return f;
}

static inline uint64_t vt_used(void)
{
    size_t f, t;
    OK(cuMemGetInfo_v2(&f, &t));
    return t - f;
}

static inline double vt_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Run this test binary again as `argv0 role [arg]` with extra NAME=VALUE settings ("" ends the list). */
static inline pid_t vt_spawn(const char *role, const char *arg, const char *const *env)
{
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* a failed test leaves no process behind */
        for (; env && *env && **env; env++)
            putenv((char *)*env);
        execl("/proc/self/exe", "child", role, arg, (char *)NULL);
        _exit(127);
    }
    return pid;
}

static inline int vt_wait(pid_t pid)
{
    int st;
    while (waitpid(pid, &st, 0) < 0)
        CHECK(errno == EINTR);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* the simulated driver's one kernel (any module image and name will do) */
static inline CUfunction vt_kernel(void)
{
    CUmodule mod;
    CUfunction fn;
    OK(cuModuleLoadData(&mod, "sim"));
    OK(cuModuleGetFunction(&fn, mod, "spin"));
    return fn;
}

static inline double vt_kernel_s(void)
{
    const char *us = getenv("TESSERA_SIM_KERNEL_US");
    CHECK(us);
    return atof(us) / 1e6;
}

/* A pipe to hear "ready" from a child and to tell it to go on. */
typedef struct { int up[2], down[2]; } vt_chan;
static inline void vt_chan_open(vt_chan *c) { CHECK(pipe(c->up) == 0 && pipe(c->down) == 0); }
static inline void vt_expect_byte(int fd)
{
    char b;
    ssize_t n;
    while ((n = read(fd, &b, 1)) < 0 && errno == EINTR)
        ;
    CHECK(n == 1);
}
static inline void vt_send_byte(int fd)
{
    char b = 'x';
    CHECK(write(fd, &b, 1) == 1);
}

#endif
