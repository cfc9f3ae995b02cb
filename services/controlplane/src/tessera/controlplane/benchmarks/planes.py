"""Benchmark: tenant control planes that serve, run by the manager as local processes.

Where `tessera.controlplane.benchmarks.tenants` counts a tenant Ready once its datastore, PKI and
manifests are in place, this one starts what they name: the real manager (its own process,
``TESSERA_CP_HOST=local``) on a private nats-server with per-tenant accounts, each tenant's
kube-apiserver, controller manager, scheduler and kine on its own bucket. Tenants are created
concurrently; a tenant counts once its API server answers ``/readyz`` and ``kubectl get ns`` as the
tenant. Then: the RSS of one idle tenant's processes, the manager's peak, waking from sleep
(``tessera tenant wake``'s own figure: until the first answered request), and one tenant's reads
timed while another tenant's API server takes a loop of writes, beside the same reads alone.

    python -m tessera.controlplane.benchmarks.planes --tenants 10,20,max --md bench/tenant_control_planes.md

``max`` keeps adding ``--step`` tenants while the box's available memory holds another step (at the
per-tenant RSS measured so far) and every tenant of the last step served. Progress (each tenant
serving, each step, each wake, with the 1-minute load average) goes to stderr as it happens; the
load average at the start and end of each step is written beside its figures.

Kamaji's anchor: 100 control planes Ready in ~7.5 min on one etcd, ~12 mCPU and ~6 MiB each at rest
(its pods' figures), its manager ~600 MiB.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import msgspec

from tessera.controlplane import processes
from tessera.controlplane.api import WAKE_TIMEOUT as WAKE_TIMEOUT_S
from tessera.controlplane.benchmarks.tenants import peak_rss_mib, percentile, start_platform, wait_ready
from tessera.controlplane.localplanes import default_bin_dirs
from tessera.shared import api, subjects
from tessera.shared.bus import Bus
from tessera.shared.settings import BusSettings

SERVE_TIMEOUT = 900.0
TENANT_RSS_GUESS_MIB = 600.0  # before any is measured: the 4/8-tenant run's max, bench/tenant_control_planes.md
MEMORY_RESERVE_MIB = 2048.0  # left to the box (manager, nats-server, the user's shell) when sizing "max"
_T0 = time.perf_counter()


def _load() -> float:
    return os.getloadavg()[0]


def _progress(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f} s, load {_load():5.1f}] {message}", file=sys.stderr, flush=True)


def _available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


async def _request(bus: Bus, verb: str, body: dict, timeout: float = 120) -> api.Reply:
    """One API call; "unavailable" (NATS busy: the reply says retry) is retried, as a user would."""
    for attempt in range(10):
        reply = api.decode_reply(await bus.request(f"{subjects.API_TENANTS}.{verb}", msgspec.json.encode(body),
                                                   timeout=timeout))
        if reply.ok:
            return reply
        if reply.error is None or reply.error.code != "unavailable":
            break
        await asyncio.sleep(1 + attempt)
    raise RuntimeError(f"{verb} {body}: {reply.error}")


async def _not_serving(bus: Bus, kubectl: Path, workdir: Path, made: int) -> list[str]:
    """The tenants that served once and do not now (not Ready, or kubectl refused), each with why."""
    lost = []
    for i in range(made):
        name = f"t{i:03d}"
        got = api.decode_reply(await bus.request(f"{subjects.API_TENANTS}.get",
                                                 msgspec.json.encode({"name": name}), timeout=30))
        tenant = got.result if got.ok else {"phase": "?", "reason": str(got.error), "message": ""}
        if tenant["phase"] != "Ready":
            lost.append(f"{name}: {tenant['phase']} ({tenant['reason']}: {tenant['message'][:120]})")
        elif not await _kubectl_ok(kubectl, workdir / f"{name}.kubeconfig"):
            lost.append(f"{name}: Ready, but `kubectl get ns` failed")
    for line in lost:
        _progress(f"not serving at rest: {line}")
    return lost


async def _kubectl_ok(kubectl: Path, kubeconfig: Path) -> bool:
    proc = await asyncio.create_subprocess_exec(str(kubectl), f"--kubeconfig={kubeconfig}", "--request-timeout=5s",
                                                "get", "ns", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return await asyncio.wait_for(proc.wait(), 30) == 0
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return False


async def _served(bus: Bus, name: str, kubectl: Path, workdir: Path, started: float) -> float:
    """Seconds from ``started`` until the tenant's API server answers ``kubectl get ns`` as the tenant."""
    deadline = started + SERVE_TIMEOUT
    kubeconfig = workdir / f"{name}.kubeconfig"
    while time.perf_counter() < deadline:
        got = api.decode_reply(await bus.request(f"{subjects.API_TENANTS}.get",
                                                 msgspec.json.encode({"name": name}), timeout=30))
        if got.ok and got.result["phase"] == "Ready":
            if not kubeconfig.exists():
                reply = await _request(bus, "kubeconfig", {"name": name})
                kubeconfig.write_text(reply.result["kubeconfig"])
            if await _kubectl_ok(kubectl, kubeconfig):
                _progress(f"{name} serving")
                return time.perf_counter() - started
        await asyncio.sleep(0.5)
    raise RuntimeError(f"tenant {name} did not serve within {SERVE_TIMEOUT:.0f} s")


def _tenant_pids(planes: Path, name: str) -> list[int] | None:
    """The pids of the tenant's processes (None: it has no plane)."""
    try:
        return list(json.loads((planes / name / "plane.json").read_text())["pids"].values())
    except FileNotFoundError:
        return None


def _tenant_rss_mib(planes: Path, name: str) -> float:
    pids = _tenant_pids(planes, name)
    return float("nan") if pids is None else sum(processes.rss_bytes(pid) for pid in pids) / 2**20


def _tenant_cpu_seconds(planes: Path, name: str) -> float:
    """CPU time (user + system) its processes have used so far."""
    pids = _tenant_pids(planes, name)
    return float("nan") if pids is None else sum(processes.cpu_seconds(pid) for pid in pids)


def _tls(planes: Path, name: str) -> ssl.SSLContext:
    pki = planes / name / "volumes" / "pki"
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    return ctx


def _port(planes: Path, name: str) -> int:
    return json.loads((planes / name / "plane.json").read_text())["apiserver_port"]


async def _reads(planes: Path, name: str, seconds: float, failed: dict[str, int]) -> list[float]:
    """GET one ConfigMap of ``name``'s, back to back, for ``seconds``; each answered read's latency (the
    others are counted in ``failed``)."""
    url = f"https://127.0.0.1:{_port(planes, name)}/api/v1/namespaces/default/configmaps/bench-read"
    ctx = _tls(planes, name)
    out: list[float] = []
    async with aiohttp.ClientSession() as http:
        body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "bench-read"}, "data": {"k": "v"}}
        async with http.post(url.rsplit("/", 1)[0], json=body, ssl=ctx) as resp:
            await resp.read()
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            try:
                async with http.get(url, ssl=ctx) as resp:
                    await resp.read()
                    ok = resp.status == 200
            except aiohttp.ClientError:
                ok = False
            if ok:
                out.append(time.perf_counter() - t0)
            else:  # an answer that is not the object is not a read time
                failed[name] = failed.get(name, 0) + 1
                await asyncio.sleep(0.1)
    return out


async def _writes(planes: Path, name: str, stop: asyncio.Event, failed: dict[str, int]) -> int:
    """Create ConfigMaps in ``name``'s API server, 4 at a time, until ``stop``; how many were created (the
    refused are counted in ``failed``)."""
    url = f"https://127.0.0.1:{_port(planes, name)}/api/v1/namespaces/default/configmaps"
    ctx = _tls(planes, name)
    count = 0

    async def loop(worker: int) -> None:
        nonlocal count
        async with aiohttp.ClientSession() as http:
            i = 0
            while not stop.is_set():
                body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"w{worker}-{i}"},
                        "data": {"payload": "x" * 1024}}
                i += 1
                try:
                    async with http.post(url, json=body, ssl=ctx) as resp:
                        await resp.read()
                        ok = resp.status == 201
                except aiohttp.ClientError:
                    ok = False
                if ok:
                    count += 1
                else:
                    failed[name] = failed.get(name, 0) + 1
                    await asyncio.sleep(0.1)

    await asyncio.gather(*(loop(w) for w in range(4)))
    return count


def _next_size(sizes: list[int], to_max: bool, step: int, made: int, rss_mib: float) -> int | None:
    """The next cumulative size: the listed ones, then (``to_max``) another ``step`` while memory holds it."""
    later = [s for s in sizes if s > made]
    if later:
        return later[0]
    if not to_max:
        return None
    need = step * rss_mib + MEMORY_RESERVE_MIB
    have = _available_mib()
    if have < need:
        _progress(f"stopping at {made} tenants: {have:.0f} MiB available, another {step} need ~{need:.0f} MiB")
        return None
    return made + step


async def run(sizes: list[int], wakes: int, workdir: Path, to_max: bool = False, step: int = 10) -> dict:
    planes = workdir / "planes"
    kube_bin, _ = default_bin_dirs()
    server, url, _, env = start_platform(workdir, TESSERA_CP_HOST="local", TESSERA_CP_RESYNC_SECONDS="5",
                                         TESSERA_CP_CONTROL_PLANES_DIR=str(planes),
                                         TESSERA_CP_STOP_PLANES_ON_EXIT="true")
    with open(workdir / "manager.log", "wb") as log:
        manager = subprocess.Popen([sys.executable, "-m", "tessera.controlplane"], env=env, stderr=log)
    bus = await Bus.connect(BusSettings(url=url), "bench")
    result: dict = {"sizes": []}
    try:
        await wait_ready(bus)
        made = 0
        rss_guess = TENANT_RSS_GUESS_MIB
        # cumulative: the next size adds tenants beside those already serving
        while (size := _next_size(sizes, to_max, step, made, rss_guess)) is not None:
            names = [f"t{i:03d}" for i in range(made, size)]
            load_start = _load()
            _progress(f"creating {len(names)} tenants ({made} already serving)")
            started = time.perf_counter()
            await asyncio.gather(*(_request(bus, "create", {"name": n}) for n in names))
            got = await asyncio.gather(*(_served(bus, n, kube_bin / "kubectl", workdir, started) for n in names),
                                       return_exceptions=True)
            failed = [f"{n}: {t}" for n, t in zip(names, got) if isinstance(t, BaseException)]
            if failed and made and to_max and size not in sizes:
                _progress(f"stopping at {made} tenants: of the next {len(names)}, " + "; ".join(failed))
                break
            if failed:
                raise RuntimeError("; ".join(failed))
            times = [t for t in got if not isinstance(t, BaseException)]
            made = size
            measured = [_tenant_rss_mib(planes, n) for n in names]
            rss_guess = max([rss_guess, *(m for m in measured if m == m)])
            result["sizes"].append({"tenants": size, "added": len(names), "total_s": max(times),
                                    "p50_s": statistics.median(times), "p99_s": percentile(times, 0.99),
                                    "load_start": load_start, "load_end": _load()})
            _progress(f"{size} tenants serving after {max(times):.1f} s")
        cpu_before = [_tenant_cpu_seconds(planes, f"t{i:03d}") for i in range(made)]
        rest_started = time.perf_counter()
        await asyncio.sleep(20)  # at rest
        rested = time.perf_counter() - rest_started
        cpu = [(_tenant_cpu_seconds(planes, f"t{i:03d}") - before) / rested * 1000
               for i, before in enumerate(cpu_before)]
        result["cpu_tenant_millis_p50"] = statistics.median(cpu)
        result["cpu_tenant_millis_max"] = max(cpu)
        result["not_serving_at_rest"] = await _not_serving(bus, kube_bin / "kubectl", workdir, made)
        rss = [_tenant_rss_mib(planes, f"t{i:03d}") for i in range(made)]
        result["rss_tenant_mib_p50"] = statistics.median(rss)
        result["rss_tenant_mib_max"] = max(rss)
        woken: list[float] = []
        result["wakes_failed"] = unwoken = []
        for i in range(min(wakes, made)):
            name = f"t{i:03d}"
            await _request(bus, "sleep", {"name": name})
            reply = (await _request(bus, "wake", {"name": name}, timeout=300)).result
            tenant = reply["tenant"]
            if tenant["phase"] != "Ready":  # the wake gave up waiting: not a wake time
                unwoken.append(f"{name}: {tenant['phase']} after {reply['seconds']:.0f} s "
                               f"({tenant['reason']}: {tenant['message'][:120]})")
                _progress(f"{name} did not wake: {unwoken[-1]}")
                continue
            woken.append(reply["seconds"])
            _progress(f"{name} slept and woke: {woken[-1]:.1f} s to the first answered request")
        result["wake_p50_s"] = statistics.median(woken) if woken else float("nan")
        result["wake_p99_s"] = percentile(woken, 0.99) if woken else float("nan")
        result["wakes"] = len(woken)
        if made >= 2:
            _progress("timing t001's reads alone, then beside t000's writes")
            refused: dict[str, int] = {}
            alone = await _reads(planes, "t001", 10, refused)
            stop = asyncio.Event()
            writer = asyncio.create_task(_writes(planes, "t000", stop, refused))
            await asyncio.sleep(2)
            loaded = await _reads(planes, "t001", 10, refused)
            stop.set()
            writes = await writer
            result["reads"] = {"alone_p50_ms": _ms(alone, 0.5), "alone_p99_ms": _ms(alone, 0.99),
                               "loaded_p50_ms": _ms(loaded, 0.5), "loaded_p99_ms": _ms(loaded, 0.99),
                               "writes": writes,
                               "failed": refused}
        result["manager_rss_peak_mib"] = peak_rss_mib(manager.pid)
        return result
    finally:
        await bus.close()
        manager.terminate()  # it stops the control planes (TESSERA_CP_STOP_PLANES_ON_EXIT)
        try:
            manager.wait(120)
        except subprocess.TimeoutExpired:
            manager.kill()
            manager.wait()
        server.stop()


def _ms(seconds: list[float], q: float) -> float:
    return percentile(seconds, q) * 1000 if seconds else float("nan")


def render(r: dict) -> str:
    lines = ["| tenants serving | added at once | all serving after | per tenant p50 | per tenant p99 "
             "| load (1 min) start → end |",
             "|---:|---:|---:|---:|---:|---:|"]
    for s in r["sizes"]:
        lines.append(f"| {s['tenants']} | {s['added']} | {s['total_s']:.1f} s | {s['p50_s']:.1f} s | {s['p99_s']:.1f} s "
                     f"| {s['load_start']:.1f} → {s['load_end']:.1f} |")
    lines += ["", f"- RSS of one idle tenant's processes (kube-apiserver, controller manager, scheduler, kine): "
              f"p50 {r['rss_tenant_mib_p50']:.0f} MiB, max {r['rss_tenant_mib_max']:.0f} MiB (Kamaji: ~6 MiB per "
              f"control plane at rest, its figure)",
              f"- CPU of one idle tenant's processes over 20 s at rest: p50 {r['cpu_tenant_millis_p50']:.0f} mCPU, "
              f"max {r['cpu_tenant_millis_max']:.0f} mCPU (Kamaji: ~12 mCPU)",
              f"- manager peak RSS: {r['manager_rss_peak_mib']:.0f} MiB (Kamaji's operator ~600 MiB at 100)",
              f"- wake from sleep to first answered request ({r['wakes']} tenants): p50 {r['wake_p50_s']:.1f} s, "
              f"p99 {r['wake_p99_s']:.1f} s"]
    lines += [f"- did not wake (the wake's {WAKE_TIMEOUT_S:.0f} s wait ended first): {w}" for w in r["wakes_failed"]]
    lost = r["not_serving_at_rest"]
    lines.append(f"- serving at rest, 20 s after the last step: {r['sizes'][-1]['tenants'] - len(lost)} of "
                 f"{r['sizes'][-1]['tenants']}" + "".join(f"; {x}" for x in lost))
    if "reads" in r:
        rd = r["reads"]
        lines.append(f"- tenant t001's reads (GET one ConfigMap, back to back, 10 s each): alone p50 "
                     f"{rd['alone_p50_ms']:.1f} ms / p99 {rd['alone_p99_ms']:.1f} ms; while t000 took {rd['writes']} "
                     f"writes (4 in flight): p50 {rd['loaded_p50_ms']:.1f} ms / p99 {rd['loaded_p99_ms']:.1f} ms"
                     + "".join(f"; {n} failed {k} requests" for n, k in sorted(rd["failed"].items())))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tessera.controlplane.benchmarks.planes",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--tenants", default="10,20,max",
                        help="comma-separated cumulative sizes; a last 'max' keeps adding --step tenants while they fit")
    parser.add_argument("--step", type=int, default=10, help="tenants added at once past the listed sizes ('max')")
    parser.add_argument("--wakes", type=int, default=5, help="tenants put to sleep and woken, one by one")
    parser.add_argument("--md", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    words = [w.strip() for w in args.tenants.split(",") if w.strip()]
    to_max = "max" in words
    try:
        sizes = sorted(int(w) for w in words if w != "max")
    except ValueError:
        parser.error(f"--tenants {args.tenants!r}: give whole numbers and optionally 'max', e.g. 10,20,max")
    if (sizes and sizes[0] < 1) or args.step < 1 or not (sizes or to_max):
        parser.error("--tenants sizes and --step must be at least 1, e.g. --tenants 10,20,max --step 10")
    with tempfile.TemporaryDirectory(prefix="tessera-planes-bench-") as tmp:
        r = asyncio.run(run(sizes, args.wakes, Path(tmp), to_max, args.step))
    table = render(r)
    print(table)
    if args.md:
        args.md.write_text(args.md.read_text().split("<!-- table -->")[0] + "<!-- table -->\n" + table
                           if args.md.exists() and "<!-- table -->" in args.md.read_text() else table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
