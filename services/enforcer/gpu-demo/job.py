"""One tenant's PyTorch job for the GPU demo: hold a working set, run bf16 matmuls, report as JSON.

It runs under `tessera run`, so libvgpu.so is preloaded: ``torch.cuda.mem_get_info()`` reports the
claim's limit as the card's total, and a tensor past the limit raises torch.OutOfMemoryError. The
last line on stdout is one JSON object the demo collects.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--label", required=True)
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--working-set", type=float, default=0.6, help="fraction of the limit to hold")
    p.add_argument("--size", type=int, default=8192)
    args = p.parse_args()
    out = {"label": args.label, "pid": os.getpid()}
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False under libvgpu")
        free, total = torch.cuda.mem_get_info()
        out["limit_mib_seen"] = total >> 20
        n = args.size
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        ballast = int(total * args.working_set) - 3 * n * n * 2
        hold = torch.empty(max(ballast, 0), dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        for _ in range(5):
            c = a @ b
        torch.cuda.synchronize()
        iters, start = 0, time.perf_counter()
        while time.perf_counter() - start < args.seconds:
            for _ in range(10):
                c = a @ b
            torch.cuda.synchronize()
            iters += 10
        elapsed = time.perf_counter() - start
        out["tflops"] = round(2 * n**3 * iters / elapsed / 1e12, 1)
        out["iterations"] = iters
        out["peak_reserved_mib"] = torch.cuda.max_memory_reserved() >> 20
        # Past the limit: libvgpu must refuse and PyTorch must say OutOfMemoryError.
        try:
            extra = torch.empty(total, dtype=torch.uint8, device="cuda")
            out["over_limit"] = "allocated (limit NOT enforced)"
            del extra
        except torch.OutOfMemoryError:
            out["over_limit"] = "OutOfMemoryError"
        del hold, c
    except Exception as exc:  # report, don't traceback: the demo prints one table
        out["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out), flush=True)
    return 0 if "error" not in out else 1


if __name__ == "__main__":
    sys.exit(main())
