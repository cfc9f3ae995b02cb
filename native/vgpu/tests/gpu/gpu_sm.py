"""SM-share workload for run.sh: a fixed kernel (every block spins for a fixed number of cycles, four
blocks per SM) launched through CuPy (cuLaunchKernel). `calibrate` picks the cycle count for ~1 ms
per kernel on an idle GPU; `window SECONDS CAL` launches for SECONDS and prints kernels per second;
`timeline SECONDS CAL START FIRST LAST` launches from START+FIRST to START+LAST (wall-clock) and prints
kernels per second in each 100 ms of SECONDS from START (a JSON list)."""

import json
import sys
import time

import cupy as cp

SRC = r"""
extern "C" __global__ void spin(long long cycles, int *out) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
    if (threadIdx.x == 0) out[blockIdx.x] = 1;
}
"""


def setup():
    k = cp.RawKernel(SRC, "spin")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    out = cp.zeros(sms * 4, dtype=cp.int32)
    return k, sms, out


def launch(k, sms, out, cycles):
    k((sms * 4,), (128,), (cp.int64(cycles), out))


def calibrate():
    k, sms, out = setup()
    cycles = 1_000_000
    for _ in range(5):
        launch(k, sms, out, cycles)
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            launch(k, sms, out, cycles)
        cp.cuda.Device().synchronize()
        per = (time.perf_counter() - t0) / 20
        cycles = int(cycles * 1e-3 / per)
    print(json.dumps({"cycles": cycles}))


def window(seconds, cal):
    cycles = json.load(open(cal))["cycles"]
    k, sms, out = setup()
    launch(k, sms, out, cycles)
    cp.cuda.Device().synchronize()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            launch(k, sms, out, cycles)
        cp.cuda.Device().synchronize()
        n += 10
    print(f"{n / (time.perf_counter() - t0):.2f}")


def timeline(seconds, cal, start, first, last):
    """From wall-clock time `start` (so that two processes share one clock), launch from `first` to
    `last` seconds and count kernels per 100 ms over `seconds`."""
    cycles = json.load(open(cal))["cycles"]
    k, sms, out = setup()
    launch(k, sms, out, cycles)
    cp.cuda.Device().synchronize()
    time.sleep(max(0.0, start + first - time.time()))
    buckets = [0] * int(seconds * 10)
    while first <= time.time() - start < last:
        for _ in range(2):
            launch(k, sms, out, cycles)
        cp.cuda.Device().synchronize()
        b = int((time.time() - start) * 10)
        if 0 <= b < len(buckets):
            buckets[b] += 2
    print(json.dumps([n * 10 for n in buckets]))


if __name__ == "__main__":
    if sys.argv[1] == "calibrate":
        calibrate()
    elif sys.argv[1] == "timeline":
        timeline(float(sys.argv[2]), sys.argv[3], *map(float, sys.argv[4:7]))
    else:
        window(float(sys.argv[2]), sys.argv[3])
