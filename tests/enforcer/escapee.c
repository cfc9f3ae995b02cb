/* escapee: a process of a claim that reaches the (simulated) GPU without libvgpu in force, for the
 * enforcer's watchdog tests.
 *   escapee static <libcuda path> <ready file>   built with -static: LD_PRELOAD and /etc/ld.so.preload
 *       mean nothing to it; it maps the driver library itself, which is what "the GPU open" is on a
 *       simulated node
 *   escapee dlmopen <ready file> <MiB>           dynamically linked, run with libvgpu preloaded: loads
 *       libcuda.so.1 once more into a fresh link-map namespace, where libvgpu's interposition never
 *       reaches, and allocates <MiB> there (past the claim's limit) through the real dlsym
 *   escapee dlmopen-only <ready file> <MiB>      the same without ever touching libcuda in the main
 *       namespace (so libvgpu never initialises and the driver is mapped once)
 * Each writes its pid to the ready file once it holds the GPU, then waits to be killed. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#ifndef ESCAPEE_STATIC
#include <dlfcn.h>
#endif

/* the ready file says who is holding the GPU: this process's pid */
static void ready(const char *path)
{
    char tmp[4096], pid[32];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int n = snprintf(pid, sizeof pid, "%d\n", (int)getpid());
    if (fd < 0 || write(fd, pid, (size_t)n) != n || close(fd) != 0 || rename(tmp, path) != 0) {
        perror(path);
        exit(1);
    }
}

static void wait_forever(void)
{
    for (;;)
        pause();
}

#ifdef ESCAPEE_STATIC
int main(int argc, char **argv)
{
    if (argc != 4 || strcmp(argv[1], "static")) {
        fprintf(stderr, "usage: escapee static <libcuda path> <ready file>\n");
        return 2;
    }
    int fd = open(argv[2], O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 || mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0) == MAP_FAILED) {
        perror(argv[2]);
        return 1;
    }
    ready(argv[3]);
    wait_forever();
}
#else
typedef int (*cu_init)(unsigned);
typedef int (*cu_retain)(void **, int);
typedef int (*cu_set)(void *);
typedef int (*cu_alloc)(unsigned long long *, size_t);

int main(int argc, char **argv)
{
    if (argc != 4 || (strcmp(argv[1], "dlmopen") && strcmp(argv[1], "dlmopen-only"))) {
        fprintf(stderr, "usage: escapee dlmopen|dlmopen-only <ready file> <MiB>\n");
        return 2;
    }
    if (!strcmp(argv[1], "dlmopen")) { /* a normal CUDA start first: libvgpu is in force here */
        void *main_ns = dlopen("libcuda.so.1", RTLD_NOW);
        cu_init init = main_ns ? (cu_init)dlsym(main_ns, "cuInit") : NULL;
        if (!init || init(0) != 0) {
            fprintf(stderr, "escapee: no libcuda.so.1 in the main namespace\n");
            return 1;
        }
    }
    /* libvgpu answers dlsym for the hooked names with its wrappers; dlvsym is the loader's own */
    void *(*real_dlsym)(void *, const char *) = (void *(*)(void *, const char *))dlvsym(RTLD_DEFAULT, "dlsym", "GLIBC_2.34");
    if (!real_dlsym)
        real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_DEFAULT, "dlsym", "GLIBC_2.2.5");
    void *h = dlmopen(LM_ID_NEWLM, "libcuda.so.1", RTLD_NOW);
    if (!h || !real_dlsym) {
        fprintf(stderr, "escapee: dlmopen: %s\n", dlerror());
        return 1;
    }
    cu_init init = (cu_init)real_dlsym(h, "cuInit");
    cu_retain retain = (cu_retain)real_dlsym(h, "cuDevicePrimaryCtxRetain");
    cu_set set = (cu_set)real_dlsym(h, "cuCtxSetCurrent");
    cu_alloc alloc = (cu_alloc)real_dlsym(h, "cuMemAlloc_v2");
    void *ctx;
    unsigned long long p;
    if (!init || init(0) || retain(&ctx, 0) || set(ctx) || alloc(&p, strtoull(argv[3], NULL, 10) << 20)) {
        fprintf(stderr, "escapee: the driver in the new namespace refused\n");
        return 1;
    }
    printf("escapee: %s MiB allocated past libvgpu\n", argv[3]);
    fflush(stdout);
    ready(argv[2]);
    wait_forever();
}
#endif
