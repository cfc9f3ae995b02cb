"""The GPU demo: two tenants' PyTorch jobs share one real GPU through `tessera run`.

It starts a local Tessera whose capacity publisher discovers this machine's GPUs through NVML
(TESSERA_DISCOVERY=nvml) and whose enforcer prepares claims for the real driver, creates two tenants,
runs one job per tenant on the same GPU with different memory limits and core shares, listens to the
enforcer's usage events, and prints each job's limit, peak use as the enforcer reported it, and
throughput (alone first, then side by side). Everything it starts, it stops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import msgspec
import pynvml
import yaml

from tessera.shared import api, subjects
from tessera.shared.events import ClaimUsage, GpuQuota, usage_decoder

from tessera.cli.client import Client
from tessera.cli.cluster import LocalCluster

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
NODE = "gpu-demo"
MIB = 1 << 20


def gpu_profile(path: Path) -> tuple[str, int, str]:
    """A profile for this machine's node, from NVML; returns (uuid, memory MiB, model) of GPU 0."""
    pynvml.nvmlInit()
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            gpus.append({"model": name.decode() if isinstance(name, bytes) else name,
                         "memory_mib": int(pynvml.nvmlDeviceGetMemoryInfo(h).total // MIB),
                         "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid})
    finally:
        pynvml.nvmlShutdown()
    if not gpus:
        raise SystemExit("NVML sees no GPU")
    path.write_text(yaml.safe_dump({"nodes": [{"name": NODE, "gpus": gpus}]}))
    return gpus[0]["uuid"], gpus[0]["memory_mib"], gpus[0]["model"]


async def run_job(url: str, python: str, tenant: str, gpumem: int, cores: int, uuid: str, seconds: float, label: str):
    cmd = [str(Path(sys.executable).parent / "tessera"), "run", "--nats", url, "--node", NODE, "--tenant", tenant,
           "--gpumem", str(gpumem), "--gpucores", str(cores), "--use-gpuuuid", uuid, "--timeout", "60",
           "--", python, str(HERE / "job.py"), "--label", label, "--seconds", str(seconds)]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout=seconds + 120)
    claim = next((w for w in err.decode().split() if w.startswith("run-")), "")
    lines = [line for line in out.decode().splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"error": err.decode()[-800:] or f"exit {proc.returncode}"}
    result.update(claim=claim, exit=proc.returncode, tenant=tenant, gpumem=gpumem, cores=cores)
    return result


async def scenario(cluster: LocalCluster, args, uuid: str) -> list[dict]:
    client = await Client.connect(cluster.url)
    peaks: dict[str, int] = {}
    limits: dict[str, int] = {}

    async def on_usage(msg) -> None:
        try:
            event = usage_decoder.decode(msg.data)
        except msgspec.ValidationError:
            return
        if isinstance(event, ClaimUsage):
            used = sum(d.used_bytes for d in event.devices)
            peaks[event.claim] = max(peaks.get(event.claim, 0), used)
            limits[event.claim] = sum(d.limit_bytes for d in event.devices)

    sub = await client.bus.listen(f"{subjects.USAGE}.>", on_usage)
    try:
        for tenant in ("team-a", "team-b"):
            await client.call(f"{subjects.API_TENANTS}.create", api.TenantRequest(name=tenant, quota=GpuQuota(gpus=4)),
                              timeout=60)
        a = dict(tenant="team-a", gpumem=args.mem_a, cores=args.cores_a)
        b = dict(tenant="team-b", gpumem=args.mem_b, cores=args.cores_b)
        results = []
        print(f"• alone: each job by itself for {args.solo_seconds:.0f}s", file=sys.stderr, flush=True)
        for job in (a, b):
            results.append(await run_job(cluster.url, args.job_python, **job, uuid=uuid, seconds=args.solo_seconds,
                                         label="alone"))
        print(f"• together: both jobs on {uuid} for {args.seconds:.0f}s", file=sys.stderr, flush=True)
        results += await asyncio.gather(*(run_job(cluster.url, args.job_python, **job, uuid=uuid,
                                                  seconds=args.seconds, label="together") for job in (a, b)))
        await asyncio.sleep(1)
        for r in results:
            r["peak_mib_enforcer"] = peaks.get(r["claim"], 0) // MIB
            r["limit_mib_enforcer"] = limits.get(r["claim"], 0) // MIB
        return results
    finally:
        await sub.unsubscribe()
        await client.close()


def table(results: list[dict], model: str) -> str:
    head = ("| run | tenant | limit MiB (asked / libvgpu / enforcer) | cores % | peak MiB (enforcer) | "
            "TFLOP/s bf16 | over the limit | exit |")
    rows = [f"GPU: {model}", "", head, "|" + "---|" * 8]
    for r in results:
        if "error" in r:
            rows.append(f"| {r.get('label', '?')} | {r['tenant']} | {r['gpumem']} | {r['cores']} | - | - | "
                        f"ERROR: {r['error'][:120]} | {r['exit']} |")
            continue
        rows.append(f"| {r['label']} | {r['tenant']} | {r['gpumem']} / {r.get('limit_mib_seen', '?')} / "
                    f"{r['limit_mib_enforcer']} | {r['cores']} | {r['peak_mib_enforcer']} | {r['tflops']} | "
                    f"{r['over_limit']} | {r['exit']} |")
    together = [r for r in results if r.get("label") == "together" and "tflops" in r]
    if len(together) == 2 and sum(r["tflops"] for r in together):
        share = [round(100 * r["tflops"] / sum(x["tflops"] for x in together)) for r in together]
        rows += ["", f"throughput split together: {share[0]}/{share[1]} (core shares asked: "
                     f"{together[0]['cores']}/{together[1]['cores']})"]
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job-python", required=True, help="a Python with PyTorch (CUDA) for the jobs")
    p.add_argument("--workdir", default=str(ROOT / ".run" / "gpu-demo"))
    p.add_argument("--seconds", type=float, default=45.0)
    p.add_argument("--solo-seconds", type=float, default=20.0)
    p.add_argument("--mem-a", type=int, default=8192)
    p.add_argument("--cores-a", type=int, default=30)
    p.add_argument("--mem-b", type=int, default=16384)
    p.add_argument("--cores-b", type=int, default=70)
    args = p.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    profile = workdir / "profile.yaml"
    uuid, memory, model = gpu_profile(profile)
    print(f"• {model}, {memory} MiB, {uuid}", file=sys.stderr, flush=True)
    cluster = LocalCluster(
        workdir=workdir, profile=profile, heartbeat_seconds=2, lost_after_seconds=60,
        extra_env={"TESSERA_DISCOVERY": "nvml", "TESSERA_CAPACITY_NODES": NODE, "TESSERA_SIM_DRIVER_DIR": "none",
                   "TESSERA_USAGE_SECONDS": "0.5", "TESSERA_RECLAIM_SECONDS": "10",
                   "TESSERA_PLACEMENT_POLICY": "binpack"},
    )
    started = time.monotonic()
    cluster.start(progress=lambda m: print(f"• {m}", file=sys.stderr, flush=True))
    try:
        cluster.wait_ready(90)
        results = asyncio.run(scenario(cluster, args, uuid))
    finally:
        cluster.stop()
    text = table(results, model)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "enforcer_gpu_demo.md").write_text(text + "\n")
    print(f"\n(demo took {time.monotonic() - started:.0f}s; service logs in {workdir / 'logs'})", file=sys.stderr)
    return 0 if all("error" not in r and r["exit"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
