/* tessera-cdi-hook: the OCI createContainer hook of the CDI specs the Tessera enforcer writes.
 *
 * The spec mounts the driver's libraries read-only into the container at the driver's own
 * directories; this hook makes them loadable there, the way ldconfig does for a driver installed in
 * the image: it runs the host's ldconfig inside the container's root filesystem over those
 * directories, which creates the soname links (libcuda.so.1 -> libcuda.so.<version>) and puts the
 * libraries into the container's /etc/ld.so.cache. It also names the directories in
 * /etc/ld.so.conf.d/00-tessera-driver.conf, so an ldconfig the workload runs later keeps them, and
 * creates the extra links it is given (libcuda.so -> libcuda.so.1, which many programs dlopen).
 *
 *   tessera-cdi-hook update-ldcache [--folder DIR]... [--link TARGET::LINK]... [--ldconfig PATH]
 *   tessera-cdi-hook print-root            (reads the state, prints the container's root, nothing else)
 *
 * The runtime passes the container's state (JSON) on stdin; its "bundle" names the directory whose
 * config.json has the root ("root": {"path": ...}, relative to the bundle unless absolute). The hook
 * runs as root in the runtime's namespaces before the container's root is pivoted to, so everything
 * it does inside the root is done after chroot(2) into it: a link or a symlinked directory of the
 * image resolves inside the image, never on the host. Its own file is opened with openat2
 * RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV (no symlink anywhere on the path, no mount crossed), so an
 * image cannot point that write at /proc or at a file mounted into the container; where that is
 * refused (or the kernel has no openat2) the file is skipped and the directories still reach the
 * cache through ldconfig's command line. ldconfig is the host's (statically linked; Ubuntu's
 * /sbin/ldconfig is a script, so ldconfig.real is tried first), opened before the chroot and run
 * with fexecve and an empty environment: nothing of the image's is executed.
 *
 * Exit status 0 on success; otherwise a message on stderr and 1, and the runtime fails the
 * container (a container of a claim never starts without its driver). Needs only libc.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_STATE (1 << 20)
#define MAX_CONFIG (64 << 20)
#define MAX_PATH 4096
#define MAX_ITEMS 64
#define CONF_DIR "/etc/ld.so.conf.d"
#define CONF_NAME "00-tessera-driver.conf"

static void die(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));
static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("tessera-cdi-hook: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

static void warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void warn(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("tessera-cdi-hook: warning: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

/* --- reading a whole file ------------------------------------------------------------------ */

static char *read_fd(int fd, size_t limit, const char *what)
{
    size_t cap = 8192, len = 0;
    char *buf = malloc(cap + 1);
    if (!buf)
        die("out of memory");
    for (;;) {
        if (len == cap) {
            if (cap >= limit)
                die("%s is larger than %zu bytes", what, limit);
            cap *= 2;
            char *bigger = realloc(buf, cap + 1);
            if (!bigger)
                die("out of memory");
            buf = bigger;
        }
        ssize_t n = read(fd, buf + len, cap - len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            die("reading %s: %s", what, strerror(errno));
        if (n == 0)
            break;
        len += (size_t)n;
    }
    buf[len] = '\0';
    if (strlen(buf) != len)
        die("%s has a NUL byte", what);
    return buf;
}

/* --- just enough JSON: the string value of a top-level member -------------------------------- */

struct json {
    const char *p;
    const char *what;
};

static void json_fail(struct json *j, const char *why) __attribute__((noreturn));
static void json_fail(struct json *j, const char *why)
{
    die("%s is not valid JSON: %s", j->what, why);
}

static void ws(struct json *j)
{
    while (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r')
        j->p++;
}

static int hex(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* A string at j->p (which must be '"'); decoded into out (cap bytes) when out is not NULL.
 * Returns the decoded length; a string longer than cap - 1 is refused. \u escapes are decoded to
 * UTF-8 (surrogate pairs included); \u0000 is refused, since no path holds a NUL. */
static size_t json_string(struct json *j, char *out, size_t cap)
{
    size_t n = 0;
    if (*j->p != '"')
        json_fail(j, "a string was expected");
    j->p++;
    for (;;) {
        unsigned char c = (unsigned char)*j->p++;
        unsigned long cp;
        if (c == '\0')
            json_fail(j, "unterminated string");
        if (c == '"')
            break;
        if (c < 0x20)
            json_fail(j, "control character in a string");
        if (c != '\\') {
            cp = c;
            if (out && n + 1 >= cap)
                die("%s: a string is too long", j->what);
            if (out)
                out[n] = (char)c;
            n++;
            continue;
        }
        c = (unsigned char)*j->p++;
        switch (c) {
        case '"': cp = '"'; break;
        case '\\': cp = '\\'; break;
        case '/': cp = '/'; break;
        case 'b': cp = '\b'; break;
        case 'f': cp = '\f'; break;
        case 'n': cp = '\n'; break;
        case 'r': cp = '\r'; break;
        case 't': cp = '\t'; break;
        case 'u': {
            cp = 0;
            for (int i = 0; i < 4; i++) {
                int h = hex(*j->p++);
                if (h < 0)
                    json_fail(j, "bad \\u escape");
                cp = cp * 16 + (unsigned long)h;
            }
            if (cp >= 0xd800 && cp < 0xdc00) {
                unsigned long lo = 0;
                if (j->p[0] != '\\' || j->p[1] != 'u')
                    json_fail(j, "lone surrogate");
                j->p += 2;
                for (int i = 0; i < 4; i++) {
                    int h = hex(*j->p++);
                    if (h < 0)
                        json_fail(j, "bad \\u escape");
                    lo = lo * 16 + (unsigned long)h;
                }
                if (lo < 0xdc00 || lo >= 0xe000)
                    json_fail(j, "lone surrogate");
                cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
            } else if (cp >= 0xdc00 && cp < 0xe000) {
                json_fail(j, "lone surrogate");
            }
            if (cp == 0)
                json_fail(j, "\\u0000 in a string");
            break;
        }
        default:
            json_fail(j, "bad escape");
        }
        char utf8[4];
        size_t len;
        if (cp < 0x80) {
            utf8[0] = (char)cp;
            len = 1;
        } else if (cp < 0x800) {
            utf8[0] = (char)(0xc0 | (cp >> 6));
            utf8[1] = (char)(0x80 | (cp & 0x3f));
            len = 2;
        } else if (cp < 0x10000) {
            utf8[0] = (char)(0xe0 | (cp >> 12));
            utf8[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
            utf8[2] = (char)(0x80 | (cp & 0x3f));
            len = 3;
        } else {
            utf8[0] = (char)(0xf0 | (cp >> 18));
            utf8[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
            utf8[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
            utf8[3] = (char)(0x80 | (cp & 0x3f));
            len = 4;
        }
        if (out && n + len >= cap)
            die("%s: a string is too long", j->what);
        if (out)
            memcpy(out + n, utf8, len);
        n += len;
    }
    if (out)
        out[n] = '\0';
    return n;
}

static void json_value(struct json *j, int depth);

/* Walks the object at j->p ('{'); for each member calls found(key, j) with j at the value, which
 * must consume the value (or leave j untouched to have it skipped: return 0). */
typedef int (*member_fn)(const char *key, struct json *j, void *ctx);

static void json_object(struct json *j, int depth, member_fn found, void *ctx)
{
    char key[256];
    if (depth > 64)
        json_fail(j, "nested too deeply");
    if (*j->p != '{')
        json_fail(j, "an object was expected");
    j->p++;
    ws(j);
    if (*j->p == '}') {
        j->p++;
        return;
    }
    for (;;) {
        ws(j);
        const char *start = j->p;
        if (json_string(j, NULL, 0) < sizeof key) {
            j->p = start;
            json_string(j, key, sizeof key);
        } else {
            key[0] = '\0'; /* a key this long is none we look for */
        }
        ws(j);
        if (*j->p != ':')
            json_fail(j, "':' was expected");
        j->p++;
        ws(j);
        if (!(found && key[0] && found(key, j, ctx)))
            json_value(j, depth + 1);
        ws(j);
        if (*j->p == ',') {
            j->p++;
            continue;
        }
        if (*j->p == '}') {
            j->p++;
            return;
        }
        json_fail(j, "',' or '}' was expected");
    }
}

static void json_value(struct json *j, int depth)
{
    if (depth > 64)
        json_fail(j, "nested too deeply");
    ws(j);
    switch (*j->p) {
    case '"':
        json_string(j, NULL, 0);
        return;
    case '{':
        json_object(j, depth, NULL, NULL);
        return;
    case '[':
        j->p++;
        ws(j);
        if (*j->p == ']') {
            j->p++;
            return;
        }
        for (;;) {
            json_value(j, depth + 1);
            ws(j);
            if (*j->p == ',') {
                j->p++;
                continue;
            }
            if (*j->p == ']') {
                j->p++;
                return;
            }
            json_fail(j, "',' or ']' was expected");
        }
    default: {
        /* a number, true, false or null */
        const char *start = j->p;
        while (*j->p && strchr("+-0123456789.eEtruefalsn", *j->p))
            j->p++;
        if (j->p == start)
            json_fail(j, "a value was expected");
        return;
    }
    }
}

struct want {
    const char *key;  /* the top-level member wanted */
    const char *sub;  /* ... and, if set, the member of that object (its value a string) */
    char *out;
    int found;
};

static int sub_member(const char *key, struct json *j, void *ctx)
{
    struct want *w = ctx;
    if (strcmp(key, w->sub) != 0)
        return 0;
    json_string(j, w->out, MAX_PATH); /* the last one wins, as with Go's encoding/json */
    w->found = 1;
    return 1;
}

static int top_member(const char *key, struct json *j, void *ctx)
{
    struct want *w = ctx;
    if (strcmp(key, w->key) != 0)
        return 0;
    if (w->sub) {
        if (*j->p != '{')
            json_fail(j, "an object was expected");
        json_object(j, 1, sub_member, w);
    } else {
        json_string(j, w->out, MAX_PATH);
        w->found = 1;
    }
    return 1;
}

/* The string at key (or key.sub) of the top-level object in text; dies if there is none. */
static void json_get(const char *text, const char *what, const char *key, const char *sub, char *out)
{
    struct json j = {.p = text, .what = what};
    struct want w = {.key = key, .sub = sub, .out = out, .found = 0};
    ws(&j);
    json_object(&j, 0, top_member, &w);
    ws(&j);
    if (*j.p)
        json_fail(&j, "text after the value");
    if (!w.found || !out[0])
        die("%s has no %s%s%s", what, key, sub ? "." : "", sub ? sub : "");
}

/* --- the container's root -------------------------------------------------------------------- */

static void container_root(char *root)
{
    char bundle[MAX_PATH], path[MAX_PATH], config[MAX_PATH + 16];
    char *state = read_fd(0, MAX_STATE, "the container state on stdin");
    json_get(state, "the container state on stdin", "bundle", NULL, bundle);
    free(state);
    if (bundle[0] != '/')
        die("the state's bundle %s is not an absolute path", bundle);
    snprintf(config, sizeof config, "%s/config.json", bundle);
    int fd = open(config, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        die("opening %s: %s", config, strerror(errno));
    char *spec = read_fd(fd, MAX_CONFIG, config);
    close(fd);
    json_get(spec, config, "root", "path", path);
    free(spec);
    if (path[0] == '/') {
        snprintf(root, MAX_PATH, "%s", path);
    } else if ((size_t)snprintf(root, MAX_PATH, "%s/%s", bundle, path) >= MAX_PATH) {
        die("the container's root path is too long");
    }
    /* "/" (or nothing) would be the host's own root: never run ldconfig there. */
    const char *c = root;
    while (*c == '/' || *c == '.')
        c++;
    if (!*c)
        die("the container's root is %s, the runtime's own root", root);
}

/* --- inside the root --------------------------------------------------------------------------- */

static int open_beneath(const char *path, int flags, mode_t mode)
{
#ifdef SYS_openat2
    struct open_how how = {
        .flags = (unsigned long long)(flags | O_CLOEXEC),
        .mode = (flags & O_CREAT) ? mode : 0,
        .resolve = RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV | RESOLVE_NO_MAGICLINKS,
    };
    return (int)syscall(SYS_openat2, AT_FDCWD, path, &how, sizeof how);
#else
    (void)path; (void)flags; (void)mode;
    errno = ENOSYS;
    return -1;
#endif
}

static void write_conf(char **folders, int n)
{
    if (n == 0)
        return;
    int dir = open_beneath(CONF_DIR, O_PATH | O_DIRECTORY, 0);
    if (dir < 0) {
        warn("%s left out (%s): the driver's directories reach the cache on ldconfig's command line only",
             CONF_DIR "/" CONF_NAME, strerror(errno));
        return;
    }
    int fd = openat(dir, CONF_NAME, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644);
    close(dir);
    if (fd < 0) {
        warn("%s not written: %s", CONF_DIR "/" CONF_NAME, strerror(errno));
        return;
    }
    FILE *out = fdopen(fd, "w");
    if (!out)
        die("fdopen: %s", strerror(errno));
    fputs("# the NVIDIA driver's libraries, mounted by the Tessera CDI spec of this container's claim\n", out);
    for (int i = 0; i < n; i++)
        fprintf(out, "%s\n", folders[i]);
    if (fchmod(fd, 0644) != 0 || fclose(out) != 0)
        die("writing %s: %s", CONF_DIR "/" CONF_NAME, strerror(errno));
}

/* TARGET::LINK: a symlink LINK -> TARGET (a name in the same directory), unless LINK exists. The
 * directory must be one of the driver's folders, reached without a symlink or a mount crossed. */
static void make_link(const char *spec, char **folders, int n)
{
    char target[MAX_PATH], dir[MAX_PATH];
    const char *sep = strstr(spec, "::");
    if (!sep || sep == spec || (size_t)(sep - spec) >= sizeof target)
        die("--link %s: want TARGET::LINK", spec);
    memcpy(target, spec, (size_t)(sep - spec));
    target[sep - spec] = '\0';
    const char *link = sep + 2, *slash = strrchr(link, '/');
    if (link[0] != '/' || !slash || !slash[1] || strchr(target, '/') || (size_t)(slash - link) >= sizeof dir)
        die("--link %s: the link must be an absolute path and the target a name beside it", spec);
    memcpy(dir, link, (size_t)(slash - link));
    dir[slash - link] = '\0';
    int known = 0;
    for (int i = 0; i < n; i++)
        known |= strcmp(folders[i], dir) == 0;
    if (!known)
        die("--link %s: %s is not one of the --folder directories", spec, dir);
    int fd = open_beneath(dir, O_PATH | O_DIRECTORY, 0);
    if (fd < 0)
        die("opening %s in the container: %s", dir, strerror(errno));
    if (symlinkat(target, fd, slash + 1) != 0 && errno != EEXIST)
        die("creating %s -> %s: %s", link, target, strerror(errno));
    close(fd);
}

static int open_ldconfig(const char *given)
{
    const char *candidates[] = {"/sbin/ldconfig.real", "/sbin/ldconfig", "/usr/sbin/ldconfig", NULL};
    const char *one[] = {given, NULL};
    const char **list = given ? one : candidates;
    for (; *list; list++) {
        int fd = open(*list, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            continue;
        unsigned char magic[4];
        if (pread(fd, magic, sizeof magic, 0) == 4 && !memcmp(magic, "\177ELF", 4))
            return fd;
        close(fd);
        if (given)
            die("%s is not an ELF program", given);
    }
    die("no ldconfig on this host (looked for %s)", given ? given : "/sbin/ldconfig.real, /sbin/ldconfig, /usr/sbin/ldconfig");
}

static void usage(void) __attribute__((noreturn));
static void usage(void)
{
    fprintf(stderr, "usage: tessera-cdi-hook update-ldcache [--folder DIR]... [--link TARGET::LINK]... "
                    "[--ldconfig PATH] < container-state.json\n"
                    "       tessera-cdi-hook print-root < container-state.json\n");
    exit(2);
}

int main(int argc, char **argv)
{
    char root[MAX_PATH];
    char *folders[MAX_ITEMS], *links[MAX_ITEMS];
    const char *ldconfig = NULL;
    int nfolders = 0, nlinks = 0;

    if (argc < 2)
        usage();
    if (!strcmp(argv[1], "print-root") && argc == 2) {
        container_root(root);
        printf("%s\n", root);
        return 0;
    }
    if (strcmp(argv[1], "update-ldcache") != 0)
        usage();
    for (int i = 2; i < argc; i++) {
        const char *opt = argv[i];
        if (i + 1 >= argc)
            usage();
        const char *value = argv[++i];
        if (!strcmp(opt, "--folder")) {
            if (value[0] != '/' || strstr(value, "/..") || nfolders == MAX_ITEMS)
                die("--folder %s: an absolute path without '..' is needed (at most %d)", value, MAX_ITEMS);
            folders[nfolders++] = (char *)value;
        } else if (!strcmp(opt, "--link") && nlinks < MAX_ITEMS) {
            links[nlinks++] = (char *)value;
        } else if (!strcmp(opt, "--ldconfig")) {
            ldconfig = value;
        } else {
            usage();
        }
    }

    container_root(root);
    int ld = open_ldconfig(ldconfig);
    int rootfd = open(root, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (rootfd < 0)
        die("opening the container's root %s: %s", root, strerror(errno));
    if (fchdir(rootfd) != 0 || chroot(".") != 0 || chdir("/") != 0)
        die("entering the container's root %s: %s", root, strerror(errno));
    close(rootfd);

    for (int i = 0; i < nlinks; i++)
        make_link(links[i], folders, nfolders);
    write_conf(folders, nfolders);

    /* ldconfig over the container's own configuration plus the driver's directories: soname links
     * in them and one cache with all of it. */
    char *args[MAX_ITEMS + 2];
    char *env[] = {NULL};
    int n = 0;
    args[n++] = "ldconfig";
    for (int i = 0; i < nfolders; i++)
        args[n++] = folders[i];
    args[n] = NULL;
    fflush(stderr);
    fexecve(ld, args, env);
    die("running ldconfig: %s", strerror(errno));
}
