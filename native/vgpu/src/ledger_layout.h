/* ledger_layout.h: the on-disk layout (version 1) of the shared accounting file, the contract between
 * libvgpu in every process of a workload and the node enforcer, which reads it with
 * tessera.shared.vgpu_cache. Native byte order (little-endian on every supported machine), fixed-size
 * records, offsets recorded in the header so a reader never guesses. Change any of it only together
 * with LEDGER_VERSION and the Python reader. */
#ifndef TESSERA_LEDGER_LAYOUT_H
#define TESSERA_LEDGER_LAYOUT_H

#include <stdint.h>

#define LEDGER_MAGIC "TESSVGPU"
#define LEDGER_VERSION 1u
#define LEDGER_MAX_DEVICES 16
#define LEDGER_MAX_PROCS 1024
#define LEDGER_PROC_LIVE 1u
#define LEDGER_DEVICE_UUID_SET 1u

typedef struct {
    char magic[8];               /*  0 "TESSVGPU" */
    uint32_t version;            /*  8 1 */
    uint32_t header_size;        /* 12 128 */
    uint32_t max_devices;        /* 16 16 */
    uint32_t max_procs;          /* 20 1024 */
    uint32_t device_count;       /* 24 one past the highest device index seen */
    uint32_t device_record_size; /* 28 128 */
    uint32_t proc_record_size;   /* 32 160 */
    uint32_t flags;              /* 36 0 */
    uint64_t devices_offset;     /* 40 128 */
    uint64_t procs_offset;       /* 48 2176 */
    uint64_t file_size;          /* 56 166016 */
    uint32_t proc_hwm;           /* 64 one past the highest process slot ever used */
    uint32_t reserved0;          /* 68 */
    uint8_t reserved[56];        /* 72 */
} ledger_header;

typedef struct {
    uint64_t mem_limit;          /*  0 bytes; 0 = no limit. Only ever lowered. */
    uint32_t sm_limit;           /*  8 percent 1..99; 0 = no limit. Only ever lowered. */
    uint32_t flags;              /* 12 bit 0: uuid is set */
    char uuid[48];               /* 16 "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", NUL-terminated */
    int64_t sm_tat_ns;           /* 64 SM limiter: theoretical arrival time, CLOCK_MONOTONIC ns */
    uint8_t reserved[56];        /* 72 */
} ledger_device;

typedef struct {
    int32_t pid;                 /*  0 in the process's own pid namespace */
    uint32_t state;              /*  4 0 free, 1 live */
    uint64_t start_time;         /*  8 clock ticks after boot, field 22 of /proc/<pid>/stat */
    uint64_t pidns;              /* 16 inode of /proc/<pid>/ns/pid */
    uint64_t reserved;           /* 24 */
    uint64_t used[LEDGER_MAX_DEVICES]; /* 32 bytes in use per device */
} ledger_proc;

typedef struct {
    ledger_header header;
    ledger_device devices[LEDGER_MAX_DEVICES];
    ledger_proc procs[LEDGER_MAX_PROCS];
} ledger_file;

#define LEDGER_DEVICES_OFFSET 128u
#define LEDGER_PROCS_OFFSET (128u + LEDGER_MAX_DEVICES * 128u)

_Static_assert(sizeof(ledger_header) == 128, "header is 128 bytes");
_Static_assert(sizeof(ledger_device) == 128, "device record is 128 bytes");
_Static_assert(sizeof(ledger_proc) == 160, "process record is 160 bytes");
_Static_assert(__builtin_offsetof(ledger_file, procs) == LEDGER_PROCS_OFFSET, "procs offset");
_Static_assert(sizeof(ledger_file) == 166016, "file size");

/* Locks (fcntl, open file description locks, F_OFD_*):
 *   byte 0, length 1: write lock while updating; take a read lock for a consistent snapshot.
 *   byte procs_offset + k * proc_record_size, length 1: read-locked by the live owner of slot k. */

#endif
