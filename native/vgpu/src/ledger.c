/* ledger.c: the Ledger, the accounting that all processes of one workload share through the file
 * named by CUDA_DEVICE_MEMORY_SHARED_CACHE (layout in ledger_layout.h and README.md). It exists so a
 * budget is one budget whatever the number of processes, and so the node enforcer can read usage.
 *
 * Locking: one fcntl open-file-description (OFD) write lock on byte 0 serialises updates between
 * processes (the kernel drops it when the holder dies, so a SIGKILL never leaves it held), and a
 * pthread mutex serialises the threads of one process (OFD locks do not). Liveness: each process
 * holds a read lock on the first byte of its own slot for as long as it lives; a slot whose byte is
 * not locked by anyone belongs to a dead process and is reclaimed. This needs no /proc scan, no
 * sleeps and is immune to pid reuse and to pid namespaces. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ledger_layout.h"
#include "vgpu.h"

#define RECLAIM_INTERVAL_NS (200 * 1000000LL)

static ledger_file *L;          /* the mapping (or process-private memory) */
static int fd = -1;
static int lock_cmd_set = F_OFD_SETLKW, lock_cmd_get = F_OFD_GETLK;
static int slot = -1;           /* our process slot */
static ledger_proc *me;         /* == &L->procs[slot], or &private_slot */
static ledger_proc private_slot;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int64_t last_reclaim_ns;
static int any_sm;
static int forked;              /* set in a fork child: reattach before the next use */
/* Why every allocation is refused ("" = none): the workload's accounting cannot be trusted to be the one
 * shared budget (a bad or unopenable file, no free slot) or no trusted limits exist. Accounting such a
 * process on its own would hand it a fresh budget, so it gets no memory instead (fail closed). */
static char refusal[384];

static void refuse(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void refuse(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(refusal, sizeof refusal, fmt, ap);
    va_end(ap);
    vgpu_log(VGPU_LOG_ERROR, "every GPU memory allocation of this process will be refused: %s", refusal);
}

static void file_lock(short type)
{
    if (fd < 0)
        return;
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
    for (;;) {
        if (fcntl(fd, lock_cmd_set, &fl) == 0)
            return;
        if (errno == EINTR)
            continue;
        if (errno == EINVAL && lock_cmd_set == F_OFD_SETLKW) {
            /* kernels before 3.15: process-associated locks, also released when the holder dies */
            lock_cmd_set = F_SETLKW;
            lock_cmd_get = F_GETLK;
            continue;
        }
        vgpu_log(VGPU_LOG_ERROR, "cannot lock the shared cache: %s", strerror(errno));
        return;
    }
}

static void file_unlock(void)
{
    if (fd < 0)
        return;
    struct flock fl = {.l_type = F_UNLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
    fcntl(fd, lock_cmd_set == F_OFD_SETLKW ? F_OFD_SETLK : F_SETLK, &fl);
}

static off_t slot_byte(int k) { return (off_t)(LEDGER_PROCS_OFFSET + (uint64_t)k * sizeof(ledger_proc)); }

static int slot_alive(int k)
{
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = slot_byte(k), .l_len = 1};
    if (fcntl(fd, lock_cmd_get, &fl) != 0)
        return 1; /* cannot tell: keep it */
    return fl.l_type != F_UNLCK;
}

/* under the lock */
static void reclaim_dead(void)
{
    if (fd < 0)
        return;
    last_reclaim_ns = vgpu_now_ns();
    uint32_t hwm = L->header.proc_hwm;
    for (uint32_t k = 0; k < hwm && k < LEDGER_MAX_PROCS; k++) {
        ledger_proc *p = &L->procs[k];
        if (p->state != LEDGER_PROC_LIVE || (int)k == slot)
            continue;
        if (!slot_alive((int)k)) {
            vgpu_log(VGPU_LOG_INFO, "reclaiming slot %u of dead process %d", k, p->pid);
            memset(p, 0, sizeof *p);
        }
    }
}

static uint64_t used_total(int dev)
{
    if (fd < 0)
        return me->used[dev];
    uint64_t sum = me == &private_slot ? private_slot.used[dev] : 0;
    uint32_t hwm = L->header.proc_hwm;
    for (uint32_t k = 0; k < hwm && k < LEDGER_MAX_PROCS; k++)
        if (L->procs[k].state == LEDGER_PROC_LIVE)
            sum += L->procs[k].used[dev];
    return sum;
}

static uint64_t proc_start_time(void)
{
    char buf[1024];
    FILE *f = fopen("/proc/self/stat", "re");
    if (!f)
        return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* the command name may contain spaces */
    if (!p)
        return 0;
    /* after ")": field 3 is the state; starttime is field 22 */
    int field = 2;
    for (; *p && field < 22; p++)
        if (*p == ' ')
            field++;
    return strtoull(p, NULL, 10);
}

static uint64_t pidns_inode(void)
{
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

static void header_init(void)
{
    ledger_header *h = &L->header;
    memcpy(h->magic, LEDGER_MAGIC, 8);
    h->version = LEDGER_VERSION;
    h->header_size = sizeof(ledger_header);
    h->max_devices = LEDGER_MAX_DEVICES;
    h->max_procs = LEDGER_MAX_PROCS;
    h->device_record_size = sizeof(ledger_device);
    h->proc_record_size = sizeof(ledger_proc);
    h->devices_offset = LEDGER_DEVICES_OFFSET;
    h->procs_offset = LEDGER_PROCS_OFFSET;
    h->file_size = sizeof(ledger_file);
}

static int header_ok(void)
{
    const ledger_header *h = &L->header;
    return !memcmp(h->magic, LEDGER_MAGIC, 8) && h->version == LEDGER_VERSION && h->max_devices == LEDGER_MAX_DEVICES &&
           h->max_procs == LEDGER_MAX_PROCS && h->device_record_size == sizeof(ledger_device) &&
           h->proc_record_size == sizeof(ledger_proc) && h->procs_offset == LEDGER_PROCS_OFFSET &&
           h->header_size == sizeof(ledger_header) && h->devices_offset == LEDGER_DEVICES_OFFSET &&
           h->file_size == sizeof(ledger_file) && h->proc_hwm <= LEDGER_MAX_PROCS;
}

/* under the lock: the recorded limits only ever go down */
static void apply_limits(void)
{
    for (int d = 0; d < LEDGER_MAX_DEVICES; d++) {
        ledger_device *dv = &L->devices[d];
        dv->mem_limit = vgpu_min_limit(dv->mem_limit, vgpu_cfg.mem_limit[d]);
        dv->sm_limit = (uint32_t)vgpu_min_limit(dv->sm_limit, vgpu_cfg.sm_limit[d]);
    }
}

static void refresh_any_sm(void)
{
    int any = 0;
    for (int d = 0; d < LEDGER_MAX_DEVICES; d++)
        if (vgpu_min_limit(L->devices[d].sm_limit, vgpu_cfg.sm_limit[d]))
            any = 1;
    __atomic_store_n(&any_sm, any, __ATOMIC_RELAXED);
}

static void use_private(void)
{
    static ledger_file private_file;
    L = &private_file;
    memset(L, 0, sizeof *L);
    header_init();
    fd = -1;
    slot = 0;
    me = &L->procs[0];
    me->pid = getpid();
    me->state = LEDGER_PROC_LIVE;
    L->header.proc_hwm = 1;
    apply_limits();
    refresh_any_sm();
}

/* under the lock, with fd open and L mapped */
static void register_slot(void)
{
    reclaim_dead();
    slot = -1;
    for (int k = 0; k < LEDGER_MAX_PROCS; k++)
        if (L->procs[k].state != LEDGER_PROC_LIVE) {
            slot = k;
            break;
        }
    if (slot < 0) {
        refuse("the shared cache has no free process slot (all %d in use)", LEDGER_MAX_PROCS);
        memset(&private_slot, 0, sizeof private_slot);
        me = &private_slot;
        return;
    }
    struct flock fl = {.l_type = F_RDLCK, .l_whence = SEEK_SET, .l_start = slot_byte(slot), .l_len = 1};
    if (fcntl(fd, lock_cmd_set == F_OFD_SETLKW ? F_OFD_SETLK : F_SETLK, &fl) != 0)
        vgpu_log(VGPU_LOG_WARN, "cannot hold the liveness lock of slot %d: %s", slot, strerror(errno));
    me = &L->procs[slot];
    memset(me, 0, sizeof *me);
    me->pid = getpid();
    me->start_time = proc_start_time();
    me->pidns = pidns_inode();
    __atomic_store_n(&me->state, LEDGER_PROC_LIVE, __ATOMIC_RELEASE);
    if ((uint32_t)slot + 1 > L->header.proc_hwm)
        L->header.proc_hwm = (uint32_t)slot + 1;
}

static int open_file(const char *path)
{
    fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0) {
        refuse("cannot open the shared cache %.200s: %s", path, strerror(errno));
        return -1;
    }
    file_lock(F_WRLCK);
    struct stat st;
    if (fstat(fd, &st) != 0 || (st.st_size < (off_t)sizeof(ledger_file) && ftruncate(fd, sizeof(ledger_file)) != 0)) {
        refuse("cannot size the shared cache %.200s: %s", path, strerror(errno));
        goto fail;
    }
    void *m = mmap(NULL, sizeof(ledger_file), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        refuse("cannot map the shared cache %.200s: %s", path, strerror(errno));
        goto fail;
    }
    L = m;
    static const char zero[8];
    if (!memcmp(L->header.magic, zero, 8)) {
        header_init();
    } else if (!header_ok()) {
        refuse("the shared cache %.200s has an unknown or damaged header (magic, version or record sizes)", path);
        munmap(m, sizeof(ledger_file));
        L = NULL;
        goto fail;
    }
    apply_limits();
    refresh_any_sm();
    register_slot();
    file_unlock();
    return 0;
fail:
    file_unlock();
    close(fd);
    fd = -1;
    return -1;
}

void ledger_open(const vgpu_config *c)
{
    int saved = errno;
    pthread_mutex_lock(&mu);
    if (c->refusal[0])
        refuse("%s", c->refusal);
    if (!c->cache_path[0] || open_file(c->cache_path) != 0)
        use_private();
    pthread_mutex_unlock(&mu);
    errno = saved;
}

/* A fork child shares our open file description, hence our locks: it must get its own. */
static void reattach(void)
{
    forked = 0;
    int nfd = open(vgpu_cfg.cache_path, O_RDWR | O_CLOEXEC);
    if (nfd < 0) {
        refuse("cannot reopen the shared cache %.200s after fork: %s", vgpu_cfg.cache_path, strerror(errno));
        use_private();
        return;
    }
    fd = nfd;
    file_lock(F_WRLCK);
    register_slot();
    file_unlock();
}

static void lock(void)
{
    pthread_mutex_lock(&mu);
    if (forked)
        reattach();
    file_lock(F_WRLCK);
}

static void unlock(void)
{
    file_unlock();
    pthread_mutex_unlock(&mu);
}

static uint64_t limit_of(int dev) { return vgpu_min_limit(L->devices[dev].mem_limit, vgpu_cfg.mem_limit[dev]); }

int ledger_reserve(int dev, uint64_t bytes)
{
    if (dev == VGPU_FOREIGN_DEVICE)
        return -1;
    if (dev < 0 || dev >= LEDGER_MAX_DEVICES)
        return 0;
    int saved = errno, rc = 0;
    lock();
    if (refusal[0]) {
        vgpu_log(VGPU_LOG_INFO, "device %d: %llu bytes refused: %s", dev, (unsigned long long)bytes, refusal);
        unlock();
        errno = saved;
        return -1;
    }
    uint64_t lim = limit_of(dev);
    if (lim) {
        uint64_t used = used_total(dev);
        if (used > lim || bytes > lim - used) {
            reclaim_dead(); /* a dead process's usage must never cause an OOM */
            used = used_total(dev);
            if (used > lim || bytes > lim - used)
                rc = -1;
        }
    }
    if (rc == 0) {
        me->used[dev] += bytes;
        if ((uint32_t)dev + 1 > L->header.device_count)
            L->header.device_count = (uint32_t)dev + 1;
#ifdef VGPU_TEST_HOOKS
        if (vgpu_cfg.test_hold_lock_ms > 0)
            usleep((useconds_t)vgpu_cfg.test_hold_lock_ms * 1000);
#endif
    } else {
        vgpu_log(VGPU_LOG_INFO, "device %d: %llu more bytes refused (limit %llu)", dev, (unsigned long long)bytes,
                 (unsigned long long)lim);
    }
    refresh_any_sm();
    unlock();
    errno = saved;
    return rc;
}

void ledger_release(int dev, uint64_t bytes)
{
    if (dev < 0 || dev >= LEDGER_MAX_DEVICES)
        return;
    int saved = errno;
    lock();
    me->used[dev] = me->used[dev] >= bytes ? me->used[dev] - bytes : 0;
    unlock();
    errno = saved;
}

void ledger_usage(int dev, uint64_t *limit, uint64_t *used)
{
    *limit = 0;
    *used = 0;
    if (dev < 0 || dev >= LEDGER_MAX_DEVICES)
        return;
    int saved = errno;
    lock();
    if (vgpu_now_ns() - last_reclaim_ns > RECLAIM_INTERVAL_NS)
        reclaim_dead();
    *limit = limit_of(dev);
    *used = used_total(dev);
    refresh_any_sm();
    unlock();
    errno = saved;
}

void ledger_note_device(int dev, const char *uuid)
{
    if (dev < 0 || dev >= LEDGER_MAX_DEVICES)
        return;
    int saved = errno;
    lock();
    ledger_device *dv = &L->devices[dev];
    if (!(dv->flags & LEDGER_DEVICE_UUID_SET) && uuid && uuid[0]) {
        snprintf(dv->uuid, sizeof dv->uuid, "%s", uuid);
        dv->flags |= LEDGER_DEVICE_UUID_SET;
    }
    if ((uint32_t)dev + 1 > L->header.device_count)
        L->header.device_count = (uint32_t)dev + 1;
    unlock();
    errno = saved;
}

int ledger_find_uuid(const char *uuid)
{
    for (int d = 0; d < LEDGER_MAX_DEVICES; d++)
        if ((L->devices[d].flags & LEDGER_DEVICE_UUID_SET) && !strncmp(L->devices[d].uuid, uuid, sizeof L->devices[d].uuid))
            return d;
    return -1;
}

uint32_t ledger_sm_limit(int dev)
{
    if (dev < 0 || dev >= LEDGER_MAX_DEVICES)
        return 0;
    return (uint32_t)vgpu_min_limit(__atomic_load_n(&L->devices[dev].sm_limit, __ATOMIC_RELAXED), vgpu_cfg.sm_limit[dev]);
}

int ledger_any_sm_limit(void) { return __atomic_load_n(&any_sm, __ATOMIC_RELAXED); }

int64_t *ledger_sm_tat(int dev) { return &L->devices[dev].sm_tat_ns; }

void ledger_close(void)
{
    if (fd < 0 || slot < 0 || forked)
        return;
    pthread_mutex_lock(&mu);
    file_lock(F_WRLCK);
    memset(me, 0, sizeof *me);
    file_unlock();
    close(fd);
    fd = -1;
    slot = -1;
    me = &private_slot;
    pthread_mutex_unlock(&mu);
}

void ledger_fork_prepare(void) { pthread_mutex_lock(&mu); }
void ledger_fork_parent(void) { pthread_mutex_unlock(&mu); }
void ledger_fork_child(void)
{
    pthread_mutex_unlock(&mu);
    if (fd >= 0) {
        close(fd); /* the parent's description (and its locks) stay with the parent */
        fd = -1;
        forked = 1;
        slot = -1;
    } else if (me) {
        memset(me->used, 0, sizeof me->used); /* the child holds none of the parent's allocations */
    }
}
