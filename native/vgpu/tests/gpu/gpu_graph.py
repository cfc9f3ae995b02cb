"""CUDA-graph SM-share workload for run.sh: PyTorch captures a decode-step-like graph (a chain of
bf16 matmuls) with torch.cuda.CUDAGraph and replays it, which reaches the driver as cuGraphLaunch
only. `calibrate` sizes the chain for ~2 ms per replay on an idle GPU; `window SECONDS CAL` replays for
SECONDS and prints replays per second."""

import json
import sys
import time

import torch


def build(n):
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):  # warm-up outside the capture, as torch.cuda.graphs requires
        for _ in range(3):
            x = a
            for _ in range(n):
                x = x @ b
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        x = a
        for _ in range(n):
            x = x @ b
    return g


def rate(g, seconds):
    g.replay()
    torch.cuda.synchronize()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            g.replay()
        torch.cuda.synchronize()
        n += 10
    return n / (time.perf_counter() - t0)


def calibrate():
    n = 8
    for _ in range(4):
        per = 1 / rate(build(n), 0.5)
        n = max(1, int(n * 2e-3 / per))
    print(json.dumps({"matmuls": n}))


if __name__ == "__main__":
    if sys.argv[1] == "calibrate":
        calibrate()
    else:
        print(f"{rate(build(json.load(open(sys.argv[3]))['matmuls']), float(sys.argv[2])):.2f}")
