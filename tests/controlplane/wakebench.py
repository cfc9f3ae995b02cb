"""`tessera bench tenant-wake-kubernetes`: tenants woken from sleep in Kubernetes mode, and
bench/tenant_wake_kubernetes.md from the run.

The local-mode figure (`tessera.controlplane.benchmarks.planes`) wakes processes the manager owns;
in Kubernetes mode a wake is a Deployment scaled back on the host and its pod run again, which is
what the test ``test_a_sleeping_tenant_is_scaled_to_zero_on_the_host_and_wakes_with_its_data``
shows once. Here the same, N times: a fresh real host control plane (v1.36, as the tests start it),
the control-plane manager in Kubernetes mode on it (`controlplane.planes.kube_manager`: the
deployed manager's ServiceAccount and RBAC, the TenantControlPlane CRD, no kubelet for the tenants'
pods, so the manager runs them from what the host stores), NATS-backed tenants. ``--tenants``
tenants are made one at a time, left at rest, then each is put to sleep (`tessera tenant sleep`:
replicas 0 on the host, its processes stopped) and woken (`tessera tenant wake`), one at a time.

Per wake: *until a request answers*: from the wake asked until a GET of the tenant's namespaces,
as the tenant's admin, with the tenant's CA, polled every 0.1 s from the moment of the wake, is
answered 200 (the first request a user of the tenant would have answered); *wake's own figure*: the
seconds `tessera tenant wake` replies with (until the manager's probe saw ``/readyz`` and a read
through the datastore); *status*: ``wakeSeconds`` in the tenant's status. The 1-minute load
average is taken before each wake.

Usage: ``python tests/controlplane/wakebench.py [--tenants 3] [--out bench/tenant_wake_kubernetes.md]
[--json FILE] [--label TEXT]`` (or ``tessera bench tenant-wake-kubernetes -- --tenants 3``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]  # tests/ (the kit and this folder as a package), as pytest's rootdir puts them

from controlplane.planes import kube_manager, plane_binaries, secured_nats_server  # noqa: E402
from kit.kubecluster import apply, kube_version, manifests, start_control_plane  # noqa: E402
from kit.kubecluster import remove as remove_plane  # noqa: E402
from tessera.controlplane.benchmarks.tenants import percentile  # noqa: E402

ROOT = HERE.parents[1]
MINOR = "v1.36"
AT_REST = 20.0  # seconds the tenants are left alone before the first sleep (as the local-mode bench)
POLL = 0.1


def _load() -> float:
    return os.getloadavg()[0]


def _tls(workdir: Path, name: str, pki: dict[str, str]) -> ssl.SSLContext:
    """The tenant's CA and admin certificate, as its kubeconfig has them."""
    directory = workdir / "clients" / name
    directory.mkdir(parents=True, exist_ok=True)
    for file in ("admin.crt", "admin.key"):
        (directory / file).write_text(pki[file])
    ctx = ssl.create_default_context(cadata=pki["ca.crt"])
    ctx.load_cert_chain(str(directory / "admin.crt"), str(directory / "admin.key"))
    return ctx


async def _first_answer(url: str, tls: ssl.SSLContext, started: float) -> float:
    """Seconds from ``started`` until a GET of ``url`` is answered 200."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as session:
        while True:
            try:
                async with session.get(url, ssl=tls) as resp:
                    if resp.status == 200:
                        return time.perf_counter() - started
            except (aiohttp.ClientError, TimeoutError, OSError):
                pass
            await asyncio.sleep(POLL)


async def measure(tenants: int, workdir: Path, progress=print) -> dict:
    plane = await asyncio.to_thread(start_control_plane, MINOR)
    secured = None
    try:
        secured = secured_nats_server(workdir / "secured-nats")
        await asyncio.to_thread(apply, plane, manifests("controlplane/tenant-pods.yaml"))  # (the pod syncers' RBAC)
        unused_postgres = SimpleNamespace(admin_url="postgresql://unused@127.0.0.1:1/unused", host="127.0.0.1:1")
        (workdir / "manager").mkdir()
        manager = kube_manager("nats", plane, secured, plane_binaries(), unused_postgres, workdir / "manager")
        try:
            planes = await anext(manager)
            return await _run(planes, tenants, workdir, progress)
        finally:
            await manager.aclose()  # (its tenants' control planes stop with it)
    finally:
        if secured is not None:
            secured[0].stop()
        await asyncio.to_thread(remove_plane, plane)


async def _run(planes, tenants: int, workdir: Path, progress) -> dict:
    names = [f"w{i:02d}" for i in range(tenants)]
    started = time.perf_counter()
    for name in names:  # (one at a time: each start is heavy on a small box)
        await planes.create(name)
        progress(f"{name} Ready ({time.perf_counter() - started:.0f} s in; load {_load():.2f})")
    await asyncio.sleep(AT_REST)
    wakes = []
    for name in names:
        slept = await planes.call("sleep", name)
        assert slept.ok, slept.error
        record = await planes.record(name)
        url = f"{planes.host.endpoint(record)}/api/v1/namespaces"
        tls = _tls(workdir, name, await planes.pki(name))
        load = _load()
        asked = time.perf_counter()
        answered = asyncio.create_task(_first_answer(url, tls, asked))
        woken = await planes.call("wake", name)
        assert woken.ok, woken.error
        first = await asyncio.wait_for(answered, 120)
        status = (await planes.record(name)).status.wake_seconds
        wakes.append({"tenant": name, "answered_s": first, "wake_reply_s": woken.result["seconds"],
                      "status_s": status, "load_1m": load})
        progress(f"{name}: a request answered {first:.2f} s after the wake; the wake's reply "
                 f"{woken.result['seconds']:.2f} s, wakeSeconds {status:.2f} (load before {load:.2f})")
    answered_s = [w["answered_s"] for w in wakes]
    reply_s = [w["wake_reply_s"] for w in wakes]
    return {"version": kube_version(MINOR), "tenants": tenants, "datastore": "nats", "wakes": wakes,
            "answered_p50_s": statistics.median(answered_s), "answered_p99_s": percentile(answered_s, 0.99),
            "reply_p50_s": statistics.median(reply_s), "reply_p99_s": percentile(reply_s, 0.99)}


def page(x: dict, label: str, command: str, load_before: float, load_after: float) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    return "\n".join([
        "# Waking tenants from sleep in Kubernetes mode", "",
        f"Commit `{commit}`{f' ({label})' if label else ''}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{os.cpu_count()} CPUs. `tessera bench tenant-wake-kubernetes -- --tenants N` (tests/controlplane/"
        f"wakebench.py) regenerates this page; this run: `{command}`. 1-minute load average: {load_before:.2f} "
        f"before the run, {load_after:.2f} after.", "",
        f"{x['tenants']} tenants on NATS (kine), their control planes applied to a real host control plane "
        f"({x['version']}) by the manager in Kubernetes mode; no kubelet runs the tenants' pods, so the manager "
        "runs each from the Deployment and Secrets the host stores. Each tenant is put to sleep (`tessera "
        "tenant sleep`: the Deployment scaled to 0, its processes stopped) and woken (`tessera tenant wake`: "
        "the spec's replicas again), one at a time, after the tenants have been at rest for "
        f"{AT_REST:.0f} s. *Until a request answers*: from the wake asked until a GET of the tenant's "
        "namespaces with the tenant's CA and admin certificate, polled every 0.1 s, is answered. *Wake's "
        "reply*: the seconds `tessera tenant wake` reports (until the manager's probe saw `/readyz` and a "
        "read through the datastore).", "",
        "| version | tenants | until a request answers p50 / p99 (s) | wake's reply p50 / p99 (s) |",
        "|---|---|---|---|",
        f"| {x['version']} | {x['tenants']} | {x['answered_p50_s']:.2f} / {x['answered_p99_s']:.2f} | "
        f"{x['reply_p50_s']:.2f} / {x['reply_p99_s']:.2f} |", "",
        "| tenant | until a request answers (s) | wake's reply (s) | `wakeSeconds` (s) | 1-min load before |",
        "|---|---|---|---|---|",
        *[f"| {w['tenant']} | {w['answered_s']:.2f} | {w['wake_reply_s']:.2f} | {w['status_s']:.2f} | "
          f"{w['load_1m']:.2f} |" for w in x["wakes"]], ""])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "bench" / "tenant_wake_kubernetes.md"))
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    if args.tenants < 1:
        parser.error(f"--tenants {args.tenants}: wake at least one tenant")
    before = _load()
    workdir = Path(tempfile.mkdtemp(prefix="tessera-wakebench-"))
    try:
        figures = asyncio.run(measure(args.tenants, workdir, progress=lambda s: print(s, file=sys.stderr, flush=True)))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    command = " ".join(["python", "tests/controlplane/wakebench.py", *sys.argv[1:]])
    figures_json = json.dumps(figures, indent=2)
    for path, text in ((args.out, page(figures, args.label, command, before, _load())), (args.json, figures_json)):
        if path:
            Path(path).write_text(text)
    print(figures_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
