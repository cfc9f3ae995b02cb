/* sim_common.c: reads the simulated device description shared by the simulated CUDA driver and the
 * simulated NVML, so both report the same devices, and keeps the simulated card's memory counters
 * (in a file shared between processes when TESSERA_SIM_CARD names one). */
#include <ctype.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim_common.h"

static long env_long(const char *name, long dflt)
{
    const char *v = getenv(name);
    if (!v || !*v)
        return dflt;
    char *end;
    long r = strtol(v, &end, 10);
    return *end ? dflt : r;
}

static int hexval(int c) { return isdigit(c) ? c - '0' : tolower(c) - 'a' + 10; }

static int parse_uuid(const char *s, size_t len, CUuuid *out)
{
    if (len >= 4 && !strncmp(s, "GPU-", 4)) {
        s += 4;
        len -= 4;
    }
    int n = 0;
    for (size_t i = 0; i < len && n < 32; i++) {
        if (s[i] == '-')
            continue;
        if (!isxdigit((unsigned char)s[i]))
            return -1;
        int v = hexval((unsigned char)s[i]);
        if (n % 2 == 0)
            out->bytes[n / 2] = (char)(v << 4);
        else
            out->bytes[n / 2] = (char)(out->bytes[n / 2] | v);
        n++;
    }
    return n == 32 ? 0 : -1;
}

void sim_uuid_string(const CUuuid *u, char out[48])
{
    const unsigned char *b = (const unsigned char *)u->bytes;
    snprintf(out, 48, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
             b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

void sim_config_load(sim_device_config *c)
{
    memset(c, 0, sizeof *c);
    c->count = (int)env_long("TESSERA_SIM_GPU_COUNT", 1);
    if (c->count < 0)
        c->count = 0;
    if (c->count > SIM_MAX_DEVICES)
        c->count = SIM_MAX_DEVICES;
    c->memory = (uint64_t)env_long("TESSERA_SIM_GPU_MEMORY_MIB", 16384) << 20;
    c->sm_count = (int)env_long("TESSERA_SIM_GPU_SM_COUNT", 132);
    c->kernel_ns = env_long("TESSERA_SIM_KERNEL_US", 100) * 1000;
    c->driver_version = (int)env_long("TESSERA_SIM_DRIVER_VERSION", 13000);
    c->procaddr_internal = (int)env_long("TESSERA_SIM_PROCADDR_INTERNAL", 0);
    c->context_bytes = (uint64_t)env_long("TESSERA_SIM_CONTEXT_MIB", 0) << 20;
    c->module_bytes = (uint64_t)env_long("TESSERA_SIM_MODULE_KIB", 0) << 10;
    const char *card = getenv("TESSERA_SIM_CARD");
    snprintf(c->card_path, sizeof c->card_path, "%s", card ? card : "");
    const char *name = getenv("TESSERA_SIM_GPU_NAME");
    snprintf(c->name, sizeof c->name, "%s", name && *name ? name : "Tessera Simulated GPU");
    const char *uuids = getenv("TESSERA_SIM_GPU_UUIDS");
    for (int i = 0; i < SIM_MAX_DEVICES; i++) {
        /* default: GPU-5e55e7a0-0000-4000-8000-0000000000<i> */
        static const unsigned char base[16] = {0x5e, 0x55, 0xe7, 0xa0, 0, 0, 0x40, 0, 0x80, 0, 0, 0, 0, 0, 0, 0};
        memcpy(c->uuid[i].bytes, base, 16);
        c->uuid[i].bytes[15] = (char)i;
    }
    for (int i = 0; uuids && *uuids && i < SIM_MAX_DEVICES; i++) {
        const char *comma = strchr(uuids, ',');
        size_t len = comma ? (size_t)(comma - uuids) : strlen(uuids);
        if (parse_uuid(uuids, len, &c->uuid[i]) != 0)
            fprintf(stderr, "tessera-sim: TESSERA_SIM_GPU_UUIDS entry %d is not a UUID; using the default\n", i);
        uuids = comma ? comma + 1 : NULL;
    }
}

/* ---- the card ------------------------------------------------------------------------------ */

static uint64_t local_card[SIM_MAX_DEVICES];
static uint64_t *card = local_card;
static uint64_t mine[SIM_MAX_DEVICES]; /* what this process holds on a shared card */
static pid_t mine_pid;                 /* ... this process: a fork child holds none of it */
static pthread_once_t card_once = PTHREAD_ONCE_INIT;
static const sim_device_config *card_cfg;

static void card_map(void)
{
    if (!card_cfg || !card_cfg->card_path[0])
        return;
    size_t size = sizeof(uint64_t) * SIM_MAX_DEVICES;
    int fd = open(card_cfg->card_path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
        fprintf(stderr, "tessera-sim: TESSERA_SIM_CARD=%s cannot be opened; this process has a card of its own\n",
                card_cfg->card_path);
        if (fd >= 0)
            close(fd);
        return;
    }
    void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m != MAP_FAILED)
        card = m;
}

void sim_card_open(const sim_device_config *c)
{
    card_cfg = c;
    pthread_once(&card_once, card_map);
}

int sim_card_take(int dev, uint64_t bytes, uint64_t capacity)
{
    uint64_t old = __atomic_load_n(&card[dev], __ATOMIC_RELAXED);
    do {
        if (bytes > capacity || old > capacity - bytes)
            return -1;
    } while (!__atomic_compare_exchange_n(&card[dev], &old, old + bytes, 1, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED));
    __atomic_add_fetch(&mine[dev], bytes, __ATOMIC_RELAXED);
    mine_pid = getpid();
    return 0;
}

void sim_card_give(int dev, uint64_t bytes)
{
    __atomic_sub_fetch(&card[dev], bytes, __ATOMIC_ACQ_REL);
    __atomic_sub_fetch(&mine[dev], bytes, __ATOMIC_RELAXED);
}

uint64_t sim_card_used(int dev) { return __atomic_load_n(&card[dev], __ATOMIC_ACQUIRE); }

/* a process that ends gives its memory back, as a real card's driver does */
__attribute__((destructor)) static void card_leave(void)
{
    if (card == local_card || mine_pid != getpid())
        return;
    for (int d = 0; d < SIM_MAX_DEVICES; d++)
        if (mine[d])
            __atomic_sub_fetch(&card[d], mine[d], __ATOMIC_ACQ_REL);
}
