"""`tessera bench kubernetes` (in `make bench`): Tessera measured on the real Kubernetes components,
and bench/kubernetes.md from the run.

Two parts, each measured side by side in one run:

- GPU pods on the real kubelet (benchpods.py): many GPU pods written for HAMi, created at once
  through the API on each pinned version; admission and created → Running, p50/p99, and any pod
  killed after it was Running;
- throughput on simulated nodes (benchfleet.py): Tessera's placement against kube-scheduler's own
  DRA allocator on the same control plane, for the same number of whole-GPU pods, at each fleet size.

The page says what machine it ran on and what else was using it (load, the busiest processes).
Usage: ``python tests/kubernetes/kubebench.py [--out bench/kubernetes.md] [--only pods,fleet]
[--versions v1.36,v1.37] [--pods 100] [--fleet 500,5000] [--fleet-pods 1000] [--label TEXT]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # tests/ (the kit) and this folder, as pytest's rootdir puts them

import benchfleet  # noqa: E402
import benchpods  # noqa: E402
from kit.kubecluster import kube_version  # noqa: E402

ROOT = HERE.parents[1]
ANCHOR = ("kube-scheduler's DRA scheduler_perf at 500 nodes: ~250-320 pods/s on 6 cores "
          "(its CI threshold is 64)")


def _run(*argv: str) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> list[str]:
    """What the box is and what else is using it, now."""
    mem = {line.split(":")[0]: int(line.split()[1]) // 1024 for line in Path("/proc/meminfo").read_text().splitlines()
           if line.split(":")[0] in ("MemTotal", "MemAvailable")}
    busiest = _run("ps", "-eo", "pcpu,rss,comm", "--sort=-pcpu", "--no-headers").splitlines()[:8]
    return [f"{benchfleet.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
            f"{mem.get('MemTotal', 0):,} MiB memory, {mem.get('MemAvailable', 0):,} MiB available; "
            f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
            "busiest processes (%CPU since start, RSS KiB, command): "
            + "; ".join(" ".join(line.split()) for line in busiest)]


def f(x: float, digits: int = 2) -> str:
    return "–" if x != x else f"{x:.{digits}f}"


def pods_table(runs: list[benchpods.PodsRun]) -> list[str]:
    out = ["| version | pods | Running | killed after Running | admission p50 / p99 (s) | "
           "created → Running p50 / p99 (s) | all created (s) | all Running (s) | given back | "
           "kernel OOM kills (whole box) | pods' oom_score_adj |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        x = r.figures
        out.append(f"| {kube_version(r.minor)} | {x['pods']} | {x['running']} | {x['killed']} | "
                   f"{f(x['admission_p50_s'])} / {f(x['admission_p99_s'])} | "
                   f"{f(x['running_p50_s'])} / {f(x['running_p99_s'])} | {f(x['created_s'], 1)} | "
                   f"{f(x['all_running_s'], 1)} | {'yes' if x['given_back'] else 'no'} | {x['oom_kills']} | "
                   f"{', '.join(map(str, x['oom_score_adj'])) or '–'} |")
    return out


def fleet_table(runs: list[benchfleet.FleetRun]) -> list[str]:
    out = ["| nodes | allocator | pods bound | pods/s | created → bound p50 / p99 (s) | p50 of: → claim, → allocated, "
           "→ bound (s) | pods created/s | API requests (writes) per pod | distinct GPUs allocated |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        for side in r.sides:
            per_pod = side["requests_per_pod"]
            out.append(f"| {r.nodes:,} | {side['allocator']} | {side['bound']}/{side['pods']} | "
                       f"{f(side['pods_per_s'], 1)} | {f(side['p50_s'])} / {f(side['p99_s'])} | "
                       f"{f(side['to_claim_p50_s'])}, {f(side['to_allocated_p50_s'])}, {f(side['to_bound_p50_s'])} | "
                       f"{f(side['created_per_s'], 1)} | {f(per_pod.get('all', float('nan')), 1)} "
                       f"({f(per_pod.get('writes', float('nan')), 1)}) | {r.distinct_devices.get(side['allocator'], 0)} |")
    return out


def requests_table(run: benchfleet.FleetRun) -> list[str]:
    """Each allocator's API requests per pod, by verb and resource."""
    names = [side["allocator"] for side in run.sides]
    keys = sorted({k for side in run.sides for k in side["requests_per_pod"] if k not in ("all", "writes")})
    out = ["| request | " + " | ".join(names) + " |", "|---" * (1 + len(names)) + "|"]
    for key in keys:
        out.append(f"| {key} | " + " | ".join(f(side["requests_per_pod"].get(key, 0.0)) for side in run.sides) + " |")
    return out


def memory_table(runs: list[benchfleet.FleetRun]) -> list[str]:
    names = sorted({name for r in runs for name in r.rss_mib})
    out = ["| nodes | set-up (s) | lowest MemAvailable (MiB) | " + " | ".join(f"{n} RSS / peak (MiB)" for n in names) + " |",
           "|---" * (3 + len(names)) + "|"]
    for r in runs:
        cells = [f"{r.rss_mib[n][0]:,.0f} / {r.rss_mib[n][1]:,.0f}" if n in r.rss_mib else "–" for n in names]
        out.append(f"| {r.nodes:,} | {r.setup_s:.0f} | {r.mem_available_min_mib:,.0f} | " + " | ".join(cells) + " |")
    return out


async def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tessera bench kubernetes", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "kubernetes.md"))
    p.add_argument("--only", default="pods,fleet", help="pods, fleet, or both (default)")
    p.add_argument("--versions", default="v1.36,v1.37", help="pinned versions of the GPU-pod part")
    p.add_argument("--pods", type=int, default=100, help="GPU pods on the real node")
    p.add_argument("--hold", type=float, default=30.0, help="seconds the Running pods are watched for kills")
    p.add_argument("--fleet", default="500,5000", help="simulated node counts")
    p.add_argument("--fleet-pods", type=int, default=1000, help="pods per allocator at each fleet size")
    p.add_argument("--fleet-version", default="v1.36")
    p.add_argument("--tessera-env", action="append", default=[], metavar="NAME=VALUE",
                   help="a setting for Tessera's services in the fleet part (e.g. TESSERA_PLACEMENT_KUBE_WORKERS=16)")
    p.add_argument("--label", default="", help="what this run is (printed above its tables)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    parts = {x.strip() for x in args.only.split(",") if x.strip()}
    if any("=" not in e for e in args.tessera_env):
        print("error: --tessera-env takes NAME=VALUE", file=sys.stderr)
        return 2
    service_env = dict(e.split("=", 1) for e in args.tessera_env)
    if not parts or parts - {"pods", "fleet"}:
        print(f"error: --only takes pods, fleet or both, not {args.only!r}", file=sys.stderr)
        return 2

    def progress(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    before = machine()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    pod_runs: list[benchpods.PodsRun] = []
    fleet_runs: list[benchfleet.FleetRun] = []
    if "pods" in parts:
        for minor in [v.strip() for v in args.versions.split(",") if v.strip()]:
            pod_runs.append(await benchpods.measure(minor, args.pods, hold=args.hold, progress=progress))
            print("\n".join(pods_table(pod_runs)[-1:]), flush=True)
    if "fleet" in parts:
        sizes = [int(n) for n in args.fleet.split(",") if n.strip()]
        for i, nodes in enumerate(sizes):  # which allocator goes first alternates from size to size
            order = ("scheduler", "tessera") if i % 2 == 0 else ("tessera", "scheduler")
            fleet_runs.append(await benchfleet.measure(nodes, args.fleet_pods, minor=args.fleet_version, order=order,
                                                       progress=progress, service_env=service_env))
            print("\n".join(fleet_table(fleet_runs[-1:])[2:]), flush=True)
    after = machine()

    command = "python tests/kubernetes/kubebench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = [f"# Tessera on the real Kubernetes components{' — ' + args.label if args.label else ''}", "",
            f"Commit `{_run('git', 'log', '--oneline', '-1')}`, {started}. `make bench` (`tessera bench kubernetes`) "
            f"regenerates this page; this run: `{command.strip()}`.", "",
            f"- Machine before: {before[0]}.", f"- {before[1]}.", f"- Machine after: {after[0]}.", ""]
    if pod_runs:
        text += ["## GPU pods on the real kubelet", "",
                 f"{args.pods} pods written for HAMi (`nvidia.com/gpu: 1`, `gpumem: {benchpods.MEMORY_MIB}`, "
                 f"`gpucores: {benchpods.CORES}`) on one real node (kubelet + containerd 2.x with CDI; "
                 f"{benchpods.GPUS} simulated H100s of {benchpods.SHARES} shares), created at once through the API "
                 f"({benchpods.CONCURRENCY} requests in flight) into a namespace of a Tessera tenant, through the "
                 "translator's webhook. *Admission*: the create request (admission chain with the webhook, and the "
                 "write). *Created → Running*: from the create's answer until a watch sees phase Running. Then "
                 f"the pods are watched {args.hold:.0f} s more: *killed after Running* counts containers that "
                 "stopped meanwhile.", ""] + pods_table(pod_runs) + [""]
        for r in pod_runs:
            if r.killed:
                text += [f"### {kube_version(r.minor)}: what stopped containers", ""]
                text += [f"- {pod}: {'; '.join(why)}" for pod, why in list(r.killed.items())[:30]]
                text += [f"- log: `{line[:300]}`" for line in r.log_lines[:30]] + [""]
    if fleet_runs:
        text += ["## Throughput on simulated nodes: Tessera's placement against kube-scheduler's DRA allocator", "",
                 f"Node objects and ResourceSlices ({benchfleet.GPUS_PER_NODE} GPUs a node), no kubelets, one fresh "
                 f"control plane ({kube_version(args.fleet_version)}) per size; {args.fleet_pods} pods per allocator, "
                 f"each one whole GPU, created at once ({benchfleet.CONCURRENCY} requests in flight). kube-scheduler "
                 "allocates plain DRA claims of its own DeviceClass; Tessera's pods are what its webhook leaves (its "
                 "template, the placement gate) and placement allocates them. kube-scheduler and the controller "
                 f"manager with `{' '.join(benchfleet.CLIENT_QPS)}` (at the defaults, 50 and 20 requests/s, the "
                 "rate limiter is what both sides would measure), the controller manager without its node lifecycle "
                 "controller (no kubelet renews these nodes' Leases: it would make thousands of them NotReady during "
                 "the measurement; scheduler_perf runs none). *pods/s*: bound pods from the first create to "
                 "the last bind; *created → bound*: each pod's create answer until a watch saw it bound, and the p50 "
                 "of its steps: the resourceclaim controller making the claim, the allocator allocating it, "
                 "kube-scheduler binding the pod. *API requests per pod*: the API server's "
                 "`apiserver_request_total` on pods, claims, claim templates, events and namespaces (watches left "
                 "out) while that side ran, over its pods: every client's, the benchmark's creates included. "
                 f"Published anchor: {ANCHOR}; this box has {benchfleet.cpu_count()} CPUs.", ""]
        text += fleet_table(fleet_runs) + ["", f"API requests per pod at {fleet_runs[-1].nodes:,} nodes, by verb and "
                                           "resource:", ""]
        text += requests_table(fleet_runs[-1]) + ["", "Memory, at the end of each size (VmRSS / VmHWM):", ""]
        text += memory_table(fleet_runs) + [""]
    out = Path(args.out)
    out.write_text("\n".join(text))
    print(f"wrote {out}")
    if args.json:
        args.json.write_text(json.dumps({"pods": [asdict(r) for r in pod_runs],
                                         "fleet": [asdict(r) for r in fleet_runs]}, indent=2, default=sorted))
    clean = all(r.figures["running"] == r.pods and not r.killed and r.figures["given_back"] for r in pod_runs)
    clean &= all(s["bound"] == s["pods"] for r in fleet_runs for s in r.sides)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
