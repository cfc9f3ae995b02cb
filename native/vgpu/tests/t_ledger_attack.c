/* t_ledger_attack.c: attacks on the shared accounting file that used to make libvgpu fall back to
 * accounting each process on its own (a fresh budget per process):
 *   header      the workload overwrites the file's header, then starts two processes of 60 MiB each
 *               under one 64 MiB budget
 *   full        every one of the 1,024 process slots is taken (held live by one process)
 *   unopenable  the cache path cannot be opened (a directory)
 * Each must now refuse the allocation (CUDA_ERROR_OUT_OF_MEMORY) with a logged reason.
 * Usage: t_ledger_attack header|full|unopenable   (CUDA_DEVICE_MEMORY_LIMIT_0=64m) */
#include "vt.h"
#include "ledger_layout.h"

static const char *cache(void)
{
    const char *c = getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    CHECK(c && *c);
    return c;
}

/* one process of the workload: try 60 MiB, report the driver's answer as the exit status */
static int child_alloc(void)
{
    vt_ctx(0);
    CUdeviceptr p;
    CUresult r = cuMemAlloc_v2(&p, 60 * MiB);
    return r == CUDA_SUCCESS ? 0 : r == CUDA_ERROR_OUT_OF_MEMORY ? 2 : 3;
}

static int two_children(void)
{
    pid_t a = vt_spawn("alloc", "", NULL), b = vt_spawn("alloc", "", NULL);
    int ra = vt_wait(a), rb = vt_wait(b);
    fprintf(stderr, "children: %d %d (0 granted, 2 refused)\n", ra, rb);
    CHECK(ra == 2 || ra == 0);
    CHECK(rb == 2 || rb == 0);
    return (ra == 0) + (rb == 0);
}

static void write_bad_header(void)
{
    int fd = open(cache(), O_RDWR | O_CREAT, 0600);
    CHECK(fd >= 0);
    CHECK(ftruncate(fd, sizeof(ledger_file)) == 0);
    ledger_header h;
    memset(&h, 0x41, sizeof h); /* not a known layout */
    CHECK(pwrite(fd, &h, sizeof h, 0) == (ssize_t)sizeof h);
    close(fd);
}

/* a valid file whose every slot is live, held so by this (uninitialised, lock-holding) process */
static int fill_slots(void)
{
    int fd = open(cache(), O_RDWR | O_CREAT, 0600);
    CHECK(fd >= 0);
    static ledger_file f;
    memcpy(f.header.magic, LEDGER_MAGIC, 8);
    f.header.version = LEDGER_VERSION;
    f.header.header_size = sizeof(ledger_header);
    f.header.max_devices = LEDGER_MAX_DEVICES;
    f.header.max_procs = LEDGER_MAX_PROCS;
    f.header.device_record_size = sizeof(ledger_device);
    f.header.proc_record_size = sizeof(ledger_proc);
    f.header.devices_offset = LEDGER_DEVICES_OFFSET;
    f.header.procs_offset = LEDGER_PROCS_OFFSET;
    f.header.file_size = sizeof f;
    f.header.proc_hwm = LEDGER_MAX_PROCS;
    for (int k = 0; k < LEDGER_MAX_PROCS; k++) {
        f.procs[k].pid = getpid();
        f.procs[k].state = LEDGER_PROC_LIVE;
    }
    CHECK(pwrite(fd, &f, sizeof f, 0) == (ssize_t)sizeof f);
    struct flock fl = {.l_type = F_RDLCK, .l_whence = SEEK_SET, .l_start = LEDGER_PROCS_OFFSET,
                       .l_len = (off_t)(LEDGER_MAX_PROCS * sizeof(ledger_proc))};
    CHECK(fcntl(fd, F_OFD_SETLK, &fl) == 0);
    return fd; /* kept open: the locks live as long as it does */
}

int main(int argc, char **argv)
{
    CHECK(argc >= 2);
    const char *mode = argv[1];
    if (!strcmp(mode, "alloc"))
        return child_alloc();
    int granted;
    if (!strcmp(mode, "header")) {
        write_bad_header();
        granted = two_children();
    } else if (!strcmp(mode, "full")) {
        int fd = fill_slots();
        granted = two_children();
        close(fd);
    } else if (!strcmp(mode, "unopenable")) {
        CHECK(mkdir(cache(), 0700) == 0 || errno == EEXIST);
        granted = two_children();
    } else {
        fprintf(stderr, "unknown mode %s\n", mode);
        return 2;
    }
    if (granted) {
        fprintf(stderr, "%s: %d of 2 processes got 60 MiB of a 64 MiB budget accounted on their own\n", mode, granted);
        return 1;
    }
    printf("ledger-%s: both processes refused, no private budget\n", mode);
    return 0;
}
