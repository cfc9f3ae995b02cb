"""A GPU workload for the enforcer tests: a CUDA driver API client in a few lines of ctypes.

It loads libcuda.so.1 the way any CUDA program does (so LD_PRELOAD'ed libvgpu.so sees every call),
allocates the sizes it is given, reports what happened as one JSON line on stdout, then optionally
holds its memory until a file appears (so a test can look at it while it is in use) and exits.
With ``--on-term``, a SIGTERM is written to ``--term-file`` and then ignored (a workload that needs
killing) or answered by exiting with code 0 (one that stops within its grace period).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
import time


def uuid_of(cuda, dev: int) -> str:
    raw = (ctypes.c_ubyte * 16)()
    if cuda.cuDeviceGetUuid(raw, dev) != 0:
        return ""
    h = bytes(raw).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--alloc", default="", help="MiB sizes to allocate, comma separated")
    p.add_argument("--hold-file", help="after allocating, wait until this file exists")
    p.add_argument("--hold-max", type=float, default=120.0)
    p.add_argument("--raise-limit", help="set CUDA_DEVICE_MEMORY_LIMIT_0 to this in our own environment first")
    p.add_argument("--exit", type=int, default=0)
    p.add_argument("--on-term", choices=("ignore", "exit"), help="on SIGTERM: note it in --term-file, then this")
    p.add_argument("--term-file", help="where a SIGTERM is noted")
    args = p.parse_args()
    if args.on_term:
        def on_term(_sig, _frame) -> None:
            if args.term_file:
                with open(args.term_file, "a") as f:
                    f.write("SIGTERM\n")
            if args.on_term == "exit":
                raise SystemExit(0)

        signal.signal(signal.SIGTERM, on_term)
    if args.raise_limit:
        os.environ["CUDA_DEVICE_MEMORY_LIMIT_0"] = args.raise_limit
        os.environ["CUDA_DEVICE_MEMORY_LIMIT"] = args.raise_limit
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    cuda.cuMemGetInfo_v2.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    assert cuda.cuInit(0) == 0
    count = ctypes.c_int()
    cuda.cuDeviceGetCount(ctypes.byref(count))
    ctx = ctypes.c_void_p()
    assert cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0) == 0
    results = []
    for mib in [int(x) for x in args.alloc.split(",") if x]:
        ptr = ctypes.c_uint64()
        results.append([mib, cuda.cuMemAlloc_v2(ctypes.byref(ptr), mib << 20)])
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
    report = {
        "pid": os.getpid(),
        "alloc": results,
        "count": count.value,
        "uuids": [uuid_of(cuda, d) for d in range(count.value)],
        "total_mib": total.value >> 20,
        "free_mib": free.value >> 20,
    }
    print(json.dumps(report), flush=True)
    if args.hold_file:
        deadline = time.monotonic() + args.hold_max
        while not os.path.exists(args.hold_file) and time.monotonic() < deadline:
            time.sleep(0.05)
    return args.exit


if __name__ == "__main__":
    sys.exit(main())
