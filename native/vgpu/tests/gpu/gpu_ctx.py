"""Context-count workload for run.sh, through the driver API (ctypes, like any CUDA program).

  overhead STOP            make a context, print a "ready" line and hold it until the file STOP exists
                           (run.sh reads what it costs from nvidia-smi's per-process figure meanwhile)
  greedy STOP              make a context (or report that it was refused), then allocate all that
                           cuMemGetInfo says is free in 64 MiB steps; print one JSON line and hold it
                           until the file STOP exists
"""

import ctypes
import json
import os
import sys
import time

MIB = 1 << 20


def driver():
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    cuda.cuMemGetInfo_v2.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    assert cuda.cuInit(0) == 0
    return cuda


def hold(stop, limit_s=300):
    t0 = time.time()
    while not os.path.exists(stop) and time.time() - t0 < limit_s:
        time.sleep(0.1)


def main():
    cuda = driver()
    ctx = ctypes.c_void_p()
    r = cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0)
    if sys.argv[1] == "overhead":
        assert r == 0, r
        print(json.dumps({"pid": os.getpid(), "ready": True}), flush=True)
        hold(sys.argv[2])
        return
    got = 0
    if r == 0:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        while True:
            cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
            step = min(64 * MIB, free.value // MIB * MIB)
            if step == 0:
                break
            p = ctypes.c_uint64()
            if cuda.cuMemAlloc_v2(ctypes.byref(p), step) != 0:
                break
            got += step
    print(json.dumps({"pid": os.getpid(), "context": r, "allocated": got}), flush=True)
    hold(sys.argv[2])


if __name__ == "__main__":
    main()
