/* t_hold: a helper for the Python reader's test. Allocates <MiB> on device 0 under the library, says
 * "ready <pid>" on stdout and holds the memory until its stdin closes. */
#include "vt.h"

int main(int argc, char **argv)
{
    CHECK(argc == 2);
    vt_ctx(0);
    CUdeviceptr p;
    OK(cuMemAlloc_v2(&p, strtoull(argv[1], NULL, 10) * MiB));
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    char buf[64];
    while (read(0, buf, sizeof buf) > 0)
        ;
    OK(cuMemFree_v2(p));
    return 0;
}
