"""Benchmark: provision N tenants with the NATS datastore and report time and the manager's memory.

Kamaji's published figure is 100 tenant control planes Ready in about 7.5 minutes, with its operator
near 600 MiB at 100 tenants. This runs the real manager as its own process (so its peak RSS is its
own) against a private nats-server with config-file authorization (so every tenant gets a real
bucket, a real NATS user and a server reload), with PKI and schema-validated manifests rendered to a
temporary directory, and creates tenants over the public request/reply API with ``--concurrency``
requests in flight. Readiness here means the manager's Ready phase: datastore, credentials,
certificates and validated manifests in place (no kube-apiserver pods are started).

    python -m tessera.controlplane.benchmarks.tenants --tenants 100
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from tessera.controlplane.datastores.natskv import UsersFile
from tessera.shared.secretkeys import write_key_file
from tessera.shared import api, identities, subjects
from tessera.shared.bus import Bus
from tessera.shared.natsserver import NatsServer, free_port
from tessera.shared.settings import BusSettings

PLATFORM = ("platform", "bench-platform-secret")


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def wait_ready(bus: Bus, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            await bus.request(f"{subjects.API_TENANTS}.list", b"{}", timeout=2)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


def start_platform(workdir: Path, **settings: str) -> tuple[NatsServer, str, Path, dict[str, str]]:
    """A private nats-server with config-file authorization (tenant accounts in ``tenants.conf``)
    and the environment of a manager process on it, with ``settings`` (TESSERA_CP_...) added:
    (server, its platform URL, the tenants' accounts file, the environment)."""
    users = workdir / "tenants.conf"
    UsersFile(users, None).write({})
    conf = workdir / "nats.conf"
    conf.write_text(identities.operator_only_config(*PLATFORM, "tenants.conf", pid_file=str(workdir / "nats.pid")))
    server = NatsServer(workdir / "store", config_file=conf).start()
    url = f"nats://{PLATFORM[0]}:{PLATFORM[1]}@127.0.0.1:{server.port}"
    write_key_file(workdir / "secret-keys")
    env = dict(
        os.environ, TESSERA_NATS_URL=url, TESSERA_CP_NATS_AUTH_FILE=str(users),
        TESSERA_CP_NATS_PID_FILE=str(workdir / "nats.pid"), TESSERA_HTTP_PORT=str(free_port()),
        TESSERA_LOG_LEVEL="WARNING", TESSERA_CP_SECRET_KEY_FILE=str(workdir / "secret-keys"), **settings,
    )
    return server, url, users, env


async def run(tenants: int, concurrency: int, workdir: Path) -> dict[str, float]:
    server, url, users, env = start_platform(workdir, TESSERA_CP_HOST="render", TESSERA_CP_RESYNC_SECONDS="3600",
                                             TESSERA_CP_MANIFESTS_DIR=str(workdir / "manifests"))
    with open(workdir / "manager.log", "wb") as log:
        manager = subprocess.Popen([sys.executable, "-m", "tessera.controlplane"], env=env, stderr=log)
    bus = await Bus.connect(BusSettings(url=url), "bench")
    try:
        await wait_ready(bus)
        rss_idle = peak_rss_mib(manager.pid)
        latencies: list[float] = []
        gate = asyncio.Semaphore(concurrency)

        async def provision(i: int) -> None:
            body = msgspec.json.encode({"name": f"bench-{i:04d}", "quota": {"gpus": 4}})
            async with gate:
                t0 = time.perf_counter()
                reply = api.decode_reply(await bus.request(f"{subjects.API_TENANTS}.create", body, timeout=120))
                latencies.append(time.perf_counter() - t0)
            if not reply.ok or reply.result["phase"] != "Ready":
                raise RuntimeError(f"tenant bench-{i:04d} not Ready: {reply.error or reply.result['phase']}")

        start = time.perf_counter()
        await asyncio.gather(*(provision(i) for i in range(tenants)))
        total = time.perf_counter() - start
        listed = api.decode_reply(await bus.request(f"{subjects.API_TENANTS}.list", b"{}", timeout=60))
        ready = sum(1 for t in listed.result if t["phase"] == "Ready")
        rss_peak = peak_rss_mib(manager.pid)
        return {
            "tenants": tenants, "ready": ready, "concurrency": concurrency, "total_s": total,
            "p50_s": statistics.median(latencies), "p99_s": percentile(latencies, 0.99),
            "rss_idle_mib": rss_idle, "rss_peak_mib": rss_peak,
            "users_in_file": len(UsersFile(users, None).read()),
        }
    finally:
        await bus.close()
        manager.terminate()
        try:
            manager.wait(15)
        except subprocess.TimeoutExpired:
            manager.kill()
            manager.wait()
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tessera.controlplane.benchmarks.tenants", description=__doc__.split("\n")[0])
    parser.add_argument("--tenants", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=8, help="create requests in flight")
    args = parser.parse_args(argv)
    if args.tenants < 1 or args.concurrency < 1:
        parser.error("--tenants and --concurrency must be at least 1")
    with tempfile.TemporaryDirectory(prefix="tessera-cp-bench-") as tmp:
        r = asyncio.run(run(args.tenants, args.concurrency, Path(tmp)))
    print(f"control-plane manager: {r['ready']}/{r['tenants']} tenants Ready (NATS datastore, per-tenant users,"
          f" PKI, validated manifests; {r['concurrency']} requests in flight)")
    print(f"  total           {r['total_s']:8.2f} s   (Kamaji: ~450 s for 100; ratio {450 / max(r['total_s'], 1e-9):.0f}x)")
    print(f"  per tenant p50  {r['p50_s'] * 1000:8.1f} ms")
    print(f"  per tenant p99  {r['p99_s'] * 1000:8.1f} ms")
    print(f"  manager RSS     {r['rss_idle_mib']:8.1f} MiB idle, {r['rss_peak_mib']:.1f} MiB peak"
          f"   (Kamaji operator ~600 MiB at 100; target <= 60)")
    print(f"  NATS users      {r['users_in_file']}")
    return 0 if r["ready"] == r["tenants"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
