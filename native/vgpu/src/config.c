/* config.c: where the limits come from, and the rule that keeps a workload from lifting them.
 * Sources are the environment (names as HAMi's device plugin sets them), the node's config file
 * /etc/tessera/vgpu.conf, and an extra file named by TESSERA_VGPU_CONFIG. Every source can only
 * lower a limit: the effective limit is the minimum over all sources that name one (the Ledger then
 * also takes the minimum with what the first process of the workload recorded). There is no switch
 * that turns enforcement off. The shared cache path is taken from the node's file when it names one,
 * so a workload cannot split its budget by pointing processes at different files. A config file may
 * also name the workload's GPUs by UUID (CUDA_VISIBLE_DEVICES=<uuid>,...): the limits' indices then
 * refer to those GPUs in that order, whatever order (or none) the process's own CUDA_VISIBLE_DEVICES
 * gives the driver, and a GPU not in the list gets no memory at all. Only files can say so, the
 * node's first: the environment is the workload's. The same holds for runtime priority
 * (CUDA_TASK_PRIORITY, HAMi's nvidia.com/priority: 0 high, 1 low): the lowest priority any source names
 * applies; the environment can only say 1 (low), and so can TESSERA_VGPU_CONFIG where the node's file
 * is a claim's (a container's); the GPUs' priority boards (priority.c) come from a config file only, the
 * node's first. So a workload can neither lift its priority nor read a board of its own. */
#define _GNU_SOURCE
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "vgpu.h"

#define NODE_CONFIG "/etc/tessera/vgpu.conf"

/* "<n>" bytes, "<n>k", "<n>m", "<n>g", "<n>t" (binary units, either case, optional trailing "b"/"ib") */
int vgpu_parse_size(const char *s, uint64_t *out)
{
    if (!s)
        return -1;
    while (isspace((unsigned char)*s))
        s++;
    if (!isdigit((unsigned char)*s))
        return -1;
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    uint64_t mul = 1;
    switch (tolower((unsigned char)*end)) {
    case 'k': mul = 1ULL << 10; end++; break;
    case 'm': mul = 1ULL << 20; end++; break;
    case 'g': mul = 1ULL << 30; end++; break;
    case 't': mul = 1ULL << 40; end++; break;
    default: break;
    }
    if (mul > 1 && tolower((unsigned char)*end) == 'i')
        end++;
    if (tolower((unsigned char)*end) == 'b')
        end++;
    while (isspace((unsigned char)*end))
        end++;
    if (*end)
        return -1;
    if (v > UINT64_MAX / mul)
        return -1;
    *out = (uint64_t)v * mul;
    return 0;
}

typedef struct {
    uint64_t mem_all, mem[VGPU_MAX_DEVICES];
    uint32_t sm_all, sm[VGPU_MAX_DEVICES];
    uint64_t ctx_all, ctx[VGPU_MAX_DEVICES]; /* CUDA_DEVICE_CONTEXT_OVERHEAD */
    char cache[4096];
    char uuids[VGPU_MAX_DEVICES][48];
    int n_uuids; /* -1: the file's list was unusable (the file then denies every GPU) */
    int names_limits;      /* some limit or GPU list was set: this source is a claim's limits */
    int priority;          /* CUDA_TASK_PRIORITY: -1 not named, 0 high, 1 low */
    char boards[VGPU_MAX_DEVICES][512]; /* TESSERA_VGPU_PRIORITY_BOARD_<i> (files only) */
    int names_boards;
    /* honoured in the node's file only: */
    int enforce_required;  /* TESSERA_VGPU_ENFORCE=required: no trusted claim limits, no memory */
    char claims_dir[4096]; /* TESSERA_VGPU_CLAIMS_DIR: where the enforcer's claim files live */
} source;

static void source_set_uuids(source *src, const char *val, const char *origin)
{
    src->n_uuids = 0;
    for (const char *p = val; *p;) {
        size_t len = strcspn(p, ",");
        while (len && isspace((unsigned char)p[len - 1]))
            len--;
        while (len && isspace((unsigned char)*p)) {
            p++;
            len--;
        }
        if (len) {
            if (src->n_uuids == VGPU_MAX_DEVICES || len >= sizeof src->uuids[0] || strncmp(p, "GPU-", 4)) {
                vgpu_log(VGPU_LOG_ERROR, "%s: CUDA_VISIBLE_DEVICES must list at most %d GPU-<uuid> values; "
                         "no GPU is usable", origin, VGPU_MAX_DEVICES);
                src->n_uuids = -1;
                return;
            }
            memcpy(src->uuids[src->n_uuids], p, len);
            src->uuids[src->n_uuids++][len] = 0;
        }
        p += strcspn(p, ",");
        if (*p)
            p++;
    }
}

static void source_set(source *src, const char *key, const char *val, const char *origin)
{
    const char *mp = "CUDA_DEVICE_MEMORY_LIMIT", *sp = "CUDA_DEVICE_SM_LIMIT", *cp = "CUDA_DEVICE_CONTEXT_OVERHEAD";
    size_t ml = strlen(mp), sl = strlen(sp), cl = strlen(cp);
    if (!strcmp(key, "CUDA_DEVICE_MEMORY_SHARED_CACHE")) {
        snprintf(src->cache, sizeof src->cache, "%s", val);
        return;
    }
    if (!strcmp(key, "TESSERA_VGPU_ENFORCE")) {
        /* anything but "required" is a mistake the operator must hear about; it never disables */
        src->enforce_required = strcmp(val, "required") == 0;
        if (!src->enforce_required)
            vgpu_log(VGPU_LOG_ERROR, "%s: TESSERA_VGPU_ENFORCE=%s: the only value is \"required\"; ignored", origin, val);
        return;
    }
    if (!strcmp(key, "TESSERA_VGPU_CLAIMS_DIR")) {
        snprintf(src->claims_dir, sizeof src->claims_dir, "%s", val);
        return;
    }
    if (!strcmp(key, "CUDA_TASK_PRIORITY")) {
        if (strcmp(val, "0") && strcmp(val, "1")) {
            vgpu_log(VGPU_LOG_ERROR, "%s: CUDA_TASK_PRIORITY=%s: want 0 (high) or 1 (low); ignored", origin, val);
            return;
        }
        src->priority = val[0] - '0';
        return;
    }
    const char *bp = "TESSERA_VGPU_PRIORITY_BOARD_";
    if (!strncmp(key, bp, strlen(bp))) {
        char *end;
        long d = strtol(key + strlen(bp), &end, 10);
        if (end == key + strlen(bp) || *end || d < 0 || d >= VGPU_MAX_DEVICES || strlen(val) >= sizeof src->boards[0]) {
            vgpu_log(VGPU_LOG_ERROR, "%s: %s: want _<device index below %d> and a path shorter than %zu; ignored",
                     origin, key, VGPU_MAX_DEVICES, sizeof src->boards[0]);
            return;
        }
        snprintf(src->boards[d], sizeof src->boards[d], "%s", val);
        src->names_boards = 1;
        return;
    }
    int is_mem = !strncmp(key, mp, ml), is_sm = !strncmp(key, sp, sl), is_ctx = !strncmp(key, cp, cl);
    if (!is_mem && !is_sm && !is_ctx)
        return;
    const char *rest = key + (is_mem ? ml : is_sm ? sl : cl);
    int dev = -1;
    if (*rest == '_') {
        char *end;
        long d = strtol(rest + 1, &end, 10);
        if (end == rest + 1 || *end || d < 0)
            return;
        if (d >= VGPU_MAX_DEVICES) {
            vgpu_log(VGPU_LOG_WARN, "%s: %s: only %d devices are supported", origin, key, VGPU_MAX_DEVICES);
            return;
        }
        dev = (int)d;
    } else if (*rest) {
        return;
    }
    if (is_ctx) {
        uint64_t v;
        if (vgpu_parse_size(val, &v)) {
            vgpu_log(VGPU_LOG_ERROR, "%s: cannot parse %s=%s (want <n>, <n>k, <n>m or <n>g); ignored", origin, key, val);
            return;
        }
        if (dev < 0) src->ctx_all = v; else src->ctx[dev] = v;
    } else if (is_mem) {
        uint64_t v;
        if (vgpu_parse_size(val, &v)) {
            vgpu_log(VGPU_LOG_ERROR, "%s: cannot parse %s=%s (want <n>, <n>k, <n>m or <n>g); ignored", origin, key, val);
            return;
        }
        if (dev < 0) src->mem_all = v; else src->mem[dev] = v;
        src->names_limits |= v != 0;
    } else {
        char *end;
        long pct = strtol(val, &end, 10);
        if (end == val || *end || pct < 0) {
            vgpu_log(VGPU_LOG_ERROR, "%s: cannot parse %s=%s (want a percentage); ignored", origin, key, val);
            return;
        }
        uint32_t p = pct >= 100 ? 0 : (uint32_t)pct;
        if (dev < 0) src->sm_all = p; else src->sm[dev] = p;
        src->names_limits |= p != 0;
    }
}

/* Within one source a per-device value overrides the all-devices value; across sources, minimum for
 * limits and maximum for the context overhead (what a context costs can only be raised: a workload
 * that declared its contexts free would take more of the card than its claim). */
static void source_merge(vgpu_config *c, const source *src)
{
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
        uint64_t m = src->mem[d] ? src->mem[d] : src->mem_all;
        uint32_t s = src->sm[d] ? src->sm[d] : src->sm_all;
        c->mem_limit[d] = vgpu_min_limit(c->mem_limit[d], m);
        c->sm_limit[d] = (uint32_t)vgpu_min_limit(c->sm_limit[d], s);
        uint64_t o = src->ctx[d] ? src->ctx[d] : src->ctx_all;
        c->ctx_overhead[d] = o > c->ctx_overhead[d] ? o : c->ctx_overhead[d];
    }
}

/* Reads `path`; `st` (if given) receives what was actually opened, for the trust check. */
static int read_file(const char *path, source *src, struct stat *st)
{
    FILE *f = fopen(path, "re");
    if (!f)
        return -1;
    if (st && fstat(fileno(f), st) != 0) {
        fclose(f);
        return -1;
    }
    char line[4352];
    while (fgets(line, sizeof line, f)) {
        char *p = line;
        while (isspace((unsigned char)*p))
            p++;
        if (*p == '#' || !*p)
            continue;
        char *eq = strchr(p, '=');
        if (!eq)
            continue;
        *eq = 0;
        char *val = eq + 1, *k_end = eq;
        while (k_end > p && isspace((unsigned char)k_end[-1]))
            *--k_end = 0;
        if (!strncmp(p, "export ", 7))
            p += 7;
        size_t vl = strlen(val);
        while (vl && isspace((unsigned char)val[vl - 1]))
            val[--vl] = 0;
        while (isspace((unsigned char)*val))
            val++;
        if (!strcmp(p, "CUDA_VISIBLE_DEVICES")) {
            source_set_uuids(src, val, path);
            src->names_limits = 1;
        }
        else
            source_set(src, p, val, path);
    }
    fclose(f);
    return 0;
}

/* Host mode with enforcement required: the claim's file named by TESSERA_VGPU_CONFIG is trusted only
 * if root wrote it where the enforcer keeps claim files and nobody else can change it. Returns "" or
 * why not (into `why`). The workload chooses the name, so the name proves nothing; the file must. */
static const char *claim_file_untrusted(const char *path, const char *claims_dir, char *why, size_t n)
{
    char real[4096], dir[4096];
    struct stat st;
    why[0] = 0;
    if (!path || !*path)
        snprintf(why, n, "TESSERA_VGPU_CONFIG is not set: no claim's limits file");
    else if (!realpath(path, real))
        snprintf(why, n, "TESSERA_VGPU_CONFIG=%.150s cannot be resolved", path);
    else if (claims_dir[0] && (!realpath(claims_dir, dir) || strncmp(real, dir, strlen(dir)) || real[strlen(dir)] != '/'))
        snprintf(why, n, "TESSERA_VGPU_CONFIG=%.150s is not under the node's claims directory %.150s", path, claims_dir);
    else if (stat(real, &st) != 0 || !S_ISREG(st.st_mode))
        snprintf(why, n, "TESSERA_VGPU_CONFIG=%.150s is not a regular file", path);
    else if (st.st_uid != 0 || (st.st_mode & 022))
        snprintf(why, n, "TESSERA_VGPU_CONFIG=%.150s is not root's alone (owner uid %u, mode %03o): a workload could "
                 "have written it", path, (unsigned)st.st_uid, (unsigned)(st.st_mode & 0777));
    return why;
}

void vgpu_config_load(vgpu_config *c)
{
    memset(c, 0, sizeof *c);
    /* static: three sources of 16 board paths would be a lot for the stack of whatever thread first
     * calls CUDA; this runs once, under the initialisation lock */
    static source node, extra, env;
    memset(&node, 0, sizeof node);
    memset(&extra, 0, sizeof extra);
    memset(&env, 0, sizeof env);
    node.priority = extra.priority = env.priority = -1;
    const char *node_path = NODE_CONFIG;
#ifdef VGPU_TEST_HOOKS
    if (getenv("TESSERA_VGPU_TEST_NODE_CONFIG"))
        node_path = getenv("TESSERA_VGPU_TEST_NODE_CONFIG");
#endif
    int have_node = read_file(node_path, &node, NULL) == 0;
    const char *extra_path = getenv("TESSERA_VGPU_CONFIG");
    /* Enforcement required and the node's file is not itself a claim's (a container gets the claim's
     * file there): the limits must come from a trusted claim file, or there is no memory at all. */
    int need_claim = node.enforce_required && !node.names_limits;
    if (need_claim && claim_file_untrusted(extra_path, node.claims_dir, c->refusal, sizeof c->refusal)[0])
        extra_path = NULL;
    struct stat est;
    int have_extra = extra_path && *extra_path && read_file(extra_path, &extra, &est) == 0;
    if (extra_path && *extra_path && !have_extra) {
        vgpu_log(VGPU_LOG_WARN, "TESSERA_VGPU_CONFIG=%.150s cannot be read; ignored", extra_path);
        if (need_claim)
            snprintf(c->refusal, sizeof c->refusal, "TESSERA_VGPU_CONFIG=%.150s cannot be read", extra_path);
    }
    if (need_claim && have_extra && (est.st_uid != 0 || (est.st_mode & 022))) /* swapped after the check */
        snprintf(c->refusal, sizeof c->refusal, "TESSERA_VGPU_CONFIG=%.150s changed while it was read", extra_path);
    if (need_claim && have_extra && !c->refusal[0] && (!extra.names_limits || !extra.cache[0]))
        snprintf(c->refusal, sizeof c->refusal, "TESSERA_VGPU_CONFIG=%.150s names no limits or no shared cache", extra_path);
    for (char **e = environ; e && *e; e++) {
        if (strncmp(*e, "CUDA_DEVICE_", 12) != 0)
            continue;
        char key[128];
        const char *eq = strchr(*e, '=');
        if (!eq || (size_t)(eq - *e) >= sizeof key)
            continue;
        memcpy(key, *e, (size_t)(eq - *e));
        key[eq - *e] = 0;
        source_set(&env, key, eq + 1, "environment");
    }
    const char *tp = getenv("CUDA_TASK_PRIORITY");
    if (tp)
        source_set(&env, "CUDA_TASK_PRIORITY", tp, "environment");
    if (env.priority == 0) { /* the environment names no boards either: only CUDA_DEVICE_* keys are read */
        vgpu_log(VGPU_LOG_INFO, "environment: CUDA_TASK_PRIORITY=0 ignored: only the claim's config can make it high");
        env.priority = -1;
    }
    if (extra.priority == 0 && node.names_limits) {
        /* a container's node file is its claim's file: the workload's own file cannot make it high */
        vgpu_log(VGPU_LOG_INFO, "%.150s: CUDA_TASK_PRIORITY=0 ignored: the claim's file names the priority", extra_path);
        extra.priority = -1;
    }
    source_merge(c, &node);
    source_merge(c, &extra);
    source_merge(c, &env);
    c->priority = -1;
    for (const source *s = &node; s; s = s == &node ? &extra : s == &extra ? &env : NULL)
        if (s->priority > c->priority)
            c->priority = s->priority;
    /* a node file that names a priority names its boards too: none there is none, not the workload's */
    memcpy(c->boards, node.names_boards || node.priority >= 0 ? node.boards : extra.boards, sizeof c->boards);
    /* where enforcement is required the environment never chooses the budget's file */
    const char *cache = node.cache[0] ? node.cache : extra.cache[0] ? extra.cache : node.enforce_required ? "" : env.cache;
    snprintf(c->cache_path, sizeof c->cache_path, "%s", cache);
    const source *listed = node.n_uuids ? &node : &extra;
    if (listed->n_uuids) {
        /* an unusable list keeps one impossible entry, so every GPU is foreign: fail closed */
        c->n_uuids = listed->n_uuids < 0 ? 1 : listed->n_uuids;
        memcpy(c->uuids, listed->uuids, sizeof c->uuids);
        if (listed->n_uuids < 0)
            snprintf(c->uuids[0], sizeof c->uuids[0], "none");
    }
    if (have_node)
        vgpu_log(VGPU_LOG_INFO, "limits from %s apply as ceilings", node_path);
#ifdef VGPU_TEST_HOOKS
    const char *hold = getenv("TESSERA_VGPU_TEST_HOLD_LOCK_MS");
    c->test_hold_lock_ms = hold ? atoi(hold) : 0;
#endif
    for (int d = 0; d < VGPU_MAX_DEVICES; d++)
        if (c->mem_limit[d] || c->sm_limit[d])
            vgpu_log(VGPU_LOG_INFO, "device %d: memory limit %llu bytes, SM limit %u%%", d,
                     (unsigned long long)c->mem_limit[d], c->sm_limit[d]);
}
