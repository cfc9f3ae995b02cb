/* priority.c: runtime priority (HAMi's nvidia.com/priority: 0 high, 1 low) between the claims that
 * share one GPU: a low-priority claim yields its SM share while a high-priority one is launching, and
 * gets it back once that one idles. Each claim has a Ledger of its own, so claims cannot meet there;
 * they meet on the GPU's priority board, a small file per GPU that the enforcer creates and hands to
 * every claim with a priority on that GPU: writable to high-priority claims, read-only to low ones.
 *
 * A high-priority process stamps the board with the time of its latest launch (CLOCK_MONOTONIC, one
 * pwrite at most every STAMP_NS). A low-priority process reads it (one pread at most every POLL_NS)
 * and its limiter meters it at PRIORITY_FLOOR_PCT of the GPU's time while the stamp is younger than
 * PRIORITY_WINDOW_NS (limiter.c). A high-priority process that dies stops stamping, so its stamp
 * ages out; a stamp from the future (beyond SLACK_NS) is ignored, so no stamp holds low claims back
 * for longer than the window. pread/pwrite, never a mapping: a board truncated under us is a short
 * read (no stamp), never a SIGBUS. The priority and the boards come from config files only (config.c).
 *
 * Board layout (version 1, native byte order; a file shorter than 24 bytes holds no stamp yet):
 *   0 char magic[8] "TESSPRIO", 8 u32 version 1, 12 u32 header size 16, 16 i64 latest high launch ns. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <string.h>
#include <unistd.h>

#include "vgpu.h"

#define BOARD_MAGIC "TESSPRIO"
#define STAMP_NS 1000000LL /* a high-priority process writes the board at most once a millisecond */
#define POLL_NS 1000000LL  /* a low-priority process reads it at most once a millisecond */
#define SLACK_NS 5000000LL /* a stamp this far in the future is not a clock's: ignored */

typedef struct {
    char magic[8];
    uint32_t version;
    uint32_t header_size;
    int64_t high_launch_ns;
} board;
_Static_assert(offsetof(board, high_launch_ns) == 16 && sizeof(board) == 24, "board layout");

static int fds[VGPU_MAX_DEVICES];        /* each device's board, -1 none (set by priority_open) */
static int opened;                       /* priority_open ran: fds[] holds descriptors or -1 */
static int unreadable[VGPU_MAX_DEVICES]; /* low priority, board named but not readable: always yield */
static int64_t io_ns[VGPU_MAX_DEVICES];  /* when this process last stamped / read the board */
static int active[VGPU_MAX_DEVICES];     /* what the last read found */

void priority_open(const vgpu_config *c)
{
    for (int d = 0; d < VGPU_MAX_DEVICES; d++)
        fds[d] = -1;
    opened = 1;
    if (c->priority < 0)
        return;
    int saved = errno;
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
        if (!c->boards[d][0])
            continue;
        int high = c->priority == 0;
        fds[d] = open(c->boards[d], high ? O_RDWR | O_CREAT | O_CLOEXEC : O_RDONLY | O_CLOEXEC, 0666);
        if (fds[d] < 0 && high) {
            vgpu_log(VGPU_LOG_ERROR, "device %d: cannot open the priority board %.200s to write: %s; low-priority "
                     "claims on this GPU will not yield to this process", d, c->boards[d], strerror(errno));
        } else if (fds[d] < 0) {
            /* fail closed: a low-priority claim that cannot see the board yields as if a high one ran */
            unreadable[d] = 1;
            vgpu_log(VGPU_LOG_ERROR, "device %d: cannot read the priority board %.200s: %s; this low-priority "
                     "process keeps %u%% of the GPU", d, c->boards[d], strerror(errno), PRIORITY_FLOOR_PCT);
        } else if (high) {
            board hdr = {.magic = BOARD_MAGIC, .version = 1, .header_size = offsetof(board, high_launch_ns)};
            if (pwrite(fds[d], &hdr, offsetof(board, high_launch_ns), 0) != (ssize_t)offsetof(board, high_launch_ns))
                vgpu_log(VGPU_LOG_ERROR, "device %d: cannot write the priority board %.200s: %s", d, c->boards[d],
                         strerror(errno));
        }
    }
    vgpu_log(VGPU_LOG_INFO, "runtime priority %s", c->priority ? "low (1)" : "high (0)");
    errno = saved;
}

void priority_launched(int dev)
{
    if (!opened || dev < 0 || dev >= VGPU_MAX_DEVICES || fds[dev] < 0)
        return;
    int64_t now = vgpu_now_ns();
    if (now - __atomic_load_n(&io_ns[dev], __ATOMIC_RELAXED) < STAMP_NS)
        return;
    __atomic_store_n(&io_ns[dev], now, __ATOMIC_RELAXED);
    int saved = errno;
    if (pwrite(fds[dev], &now, sizeof now, offsetof(board, high_launch_ns)) != (ssize_t)sizeof now)
        vgpu_log(VGPU_LOG_DEBUG, "device %d: cannot stamp the priority board: %s", dev, strerror(errno));
    errno = saved;
}

int priority_yield(int dev)
{
    if (!opened || dev < 0 || dev >= VGPU_MAX_DEVICES)
        return 0;
    if (unreadable[dev])
        return 1;
    if (fds[dev] < 0)
        return 0;
    int64_t now = vgpu_now_ns();
    if (now - __atomic_load_n(&io_ns[dev], __ATOMIC_RELAXED) < POLL_NS)
        return __atomic_load_n(&active[dev], __ATOMIC_RELAXED);
    __atomic_store_n(&io_ns[dev], now, __ATOMIC_RELAXED);
    int saved = errno, yes = 0;
    board b;
    if (pread(fds[dev], &b, sizeof b, 0) == (ssize_t)sizeof b && !memcmp(b.magic, BOARD_MAGIC, 8) && b.version == 1)
        yes = b.high_launch_ns <= now + SLACK_NS && now - b.high_launch_ns < PRIORITY_WINDOW_NS;
    errno = saved;
    __atomic_store_n(&active[dev], yes, __ATOMIC_RELAXED);
    return yes;
}
