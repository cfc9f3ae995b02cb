/* allocs.c: this process's table of live allocations. The free side of the driver API names only a
 * pointer or a handle, so the size and device charged at allocation time are kept here to be
 * returned to the Ledger on free. Virtual memory management needs more than a map: physical memory
 * made by cuMemCreate is freed only once the handle is released AND every mapping of it is unmapped,
 * which is what the driver does too. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "vgpu.h"

#define NBUCKETS 4096

typedef struct node {
    uint64_t key, size, aux;
    int kind, dev, mapcount, released;
    struct node *next;
} node;

static node *buckets[NBUCKETS];
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static unsigned bucket(int kind, uint64_t key)
{
    uint64_t x = (key ^ ((uint64_t)kind << 56)) * 0x9E3779B97F4A7C15ULL;
    return (unsigned)(x >> 52) & (NBUCKETS - 1);
}

static node **find(int kind, uint64_t key)
{
    node **pp = &buckets[bucket(kind, key)];
    while (*pp && !((*pp)->kind == kind && (*pp)->key == key))
        pp = &(*pp)->next;
    return pp;
}

static void put_locked(int kind, uint64_t key, int dev, uint64_t size, uint64_t aux)
{
    node **pp = find(kind, key);
    node *n = *pp;
    if (!n) {
        n = calloc(1, sizeof *n);
        if (!n) {
            vgpu_log(VGPU_LOG_ERROR, "out of host memory for the allocation table; this allocation is not uncounted at free");
            return;
        }
        n->kind = kind;
        n->key = key;
        n->next = buckets[bucket(kind, key)];
        buckets[bucket(kind, key)] = n;
    }
    n->dev = dev;
    n->size = size;
    n->aux = aux;
    n->mapcount = 0;
    n->released = 0;
}

void allocs_put(int kind, uint64_t key, int dev, uint64_t size)
{
    pthread_mutex_lock(&mu);
    put_locked(kind, key, dev, size, 0);
    pthread_mutex_unlock(&mu);
}

int allocs_take(int kind, uint64_t key, int *dev, uint64_t *size)
{
    pthread_mutex_lock(&mu);
    node **pp = find(kind, key), *n = *pp;
    if (n) {
        *pp = n->next;
        *dev = n->dev;
        *size = n->size;
        free(n);
    }
    pthread_mutex_unlock(&mu);
    return n != NULL;
}

void vmm_created(uint64_t handle, int dev, uint64_t size) { allocs_put(ALLOC_HANDLE, handle, dev, size); }

int vmm_released(uint64_t handle, int *dev, uint64_t *size)
{
    int uncount = 0;
    pthread_mutex_lock(&mu);
    node **pp = find(ALLOC_HANDLE, handle), *n = *pp;
    if (n) {
        n->released = 1;
        if (n->mapcount <= 0) {
            *pp = n->next;
            *dev = n->dev;
            *size = n->size;
            free(n);
            uncount = 1;
        }
    }
    pthread_mutex_unlock(&mu);
    return uncount;
}

void vmm_mapped(uint64_t va, uint64_t size, uint64_t handle)
{
    pthread_mutex_lock(&mu);
    node *h = *find(ALLOC_HANDLE, handle);
    if (h) {
        h->mapcount++;
        put_locked(ALLOC_MAPPING, va, h->dev, size, handle);
    }
    pthread_mutex_unlock(&mu);
}

void vmm_unmapped(uint64_t va, uint64_t size, void (*release)(int dev, uint64_t size))
{
    /* lock order is always allocs -> Ledger, so releasing under our lock is safe */
    pthread_mutex_lock(&mu);
    uint64_t p = va, end = va + size;
    while (p < end) {
        node **pp = find(ALLOC_MAPPING, p), *m = *pp;
        if (!m)
            break; /* a range we never saw mapped: nothing of ours to release */
        *pp = m->next;
        uint64_t msize = m->size, handle = m->aux;
        free(m);
        node **hp = find(ALLOC_HANDLE, handle), *h = *hp;
        if (h && --h->mapcount <= 0 && h->released) {
            *hp = h->next;
            release(h->dev, h->size);
            free(h);
        }
        if (!msize)
            break;
        p += msize;
    }
    pthread_mutex_unlock(&mu);
}

void allocs_fork_prepare(void) { pthread_mutex_lock(&mu); }
void allocs_fork_parent(void) { pthread_mutex_unlock(&mu); }
void allocs_fork_child(void)
{
    /* the child owns none of the parent's device memory */
    for (int b = 0; b < NBUCKETS; b++) {
        node *n = buckets[b];
        while (n) {
            node *next = n->next;
            free(n);
            n = next;
        }
        buckets[b] = NULL;
    }
    pthread_mutex_unlock(&mu);
}
