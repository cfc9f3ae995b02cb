"""Memory checks for run.sh on a real GPU: `limit torch|torch_expandable|cupy CACHE` allocates until the
framework's own out-of-memory error and reports what it saw (and the Ledger's peak), `hold GIB STOPFILE` holds
memory until STOPFILE exists, `second` measures what a second process of the workload may take,
`matmul` prints bf16 8192^3 matmul TFLOP/s. Prints JSON (or one number)."""

import json
import os
import sys
import threading
import time

G = 1 << 30
CHUNK = 256 << 20


def ledger_peak(cache, stop, out):
    from tessera.shared.vgpu_cache import read_vgpu_cache

    peak = 0
    while not stop.is_set():
        try:
            peak = max(peak, read_vgpu_cache(cache).device(0).used_bytes)
        except Exception:
            pass
        time.sleep(0.005)
    out.append(peak)


def fill(alloc, oom, r, step=CHUNK, held=None):
    """Allocate `step` bytes at a time until the framework raises its own out-of-memory error `oom`;
    counts into r["allocated"], notes the first such error, returns the blocks held."""
    held = [] if held is None else held
    try:
        while True:
            held.append(alloc(step))
            r["allocated"] += step
    except oom as e:
        if not r["oom"]:
            r["oom"], r["oom_type"] = True, type(e).__name__
    return held


def torch_bytes(n):
    import torch

    return torch.empty(n, dtype=torch.uint8, device="cuda")


def limit(kind, cache):
    stop, peak = threading.Event(), []
    watcher = threading.Thread(target=ledger_peak, args=(cache, stop, peak))
    r = {"allocated": 0, "oom": False, "oom_type": None}
    if kind.startswith("torch"):
        if kind == "torch_expandable":
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        import torch

        torch.cuda.init()
        free, total = torch.cuda.mem_get_info()
        r["total"], r["free"] = total, free
        watcher.start()
        xs = fill(torch_bytes, torch.OutOfMemoryError, r)
        fill(torch_bytes, torch.OutOfMemoryError, r, step=1 << 20, held=xs)  # the last bytes, a MiB at a time
    else:
        import cupy

        free, total = cupy.cuda.runtime.memGetInfo()
        r["total"], r["free"] = total, free
        watcher.start()
        xs = fill(lambda n: cupy.empty(n, dtype=cupy.uint8), cupy.cuda.memory.OutOfMemoryError, r)
    stop.set()
    watcher.join()
    r["ledger_used_max"] = peak[0] if peak else -1
    print(json.dumps(r))


def hold(gib, stop_file):
    import torch

    x = torch.empty(int(gib * G), dtype=torch.uint8, device="cuda")
    print("ready", flush=True)
    deadline = time.time() + 120
    while not os.path.exists(stop_file) and time.time() < deadline:
        time.sleep(0.1)
    del x


def second():
    import torch

    free, total = torch.cuda.mem_get_info()
    r = {"free_seen": free, "total": total, "allocated": 0, "oom": False, "oom_type": None}
    xs = fill(torch_bytes, torch.OutOfMemoryError, r)
    print(json.dumps(r))
    del xs


def matmul():
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(100):
            a @ b
        end.record()
        end.synchronize()
        best = max(best, 2 * n**3 * 100 / (start.elapsed_time(end) / 1e3) / 1e12)
    print(f"{best:.1f}")


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "limit":
        try:
            limit(sys.argv[2], sys.argv[3])
        except Exception as e:  # one JSON line whatever happens, for the table
            print(json.dumps({"error": f"{type(e).__name__}: {e}"[:200]}))
    elif cmd == "hold":
        hold(float(sys.argv[2]), sys.argv[3])
    elif cmd == "second":
        second()
    elif cmd == "matmul":
        matmul()
