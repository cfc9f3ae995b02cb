"""The enforcer's watchdog: a claim's process that has the GPU open without libvgpu in force is killed
and reported (log line with pid and reason, metric, ``violation`` claim event); a process with libvgpu
in force, and any process outside the claim, is left alone.

The escapees are real programs (tests/enforcer/escapee.c) under a real `tessera run` on the simulated
driver: a static binary (LD_PRELOAD means nothing to it) that maps the driver library, and a dynamic one
that loads the driver again into a fresh link-map namespace with dlmopen and allocates past its claim's
limit there. The bound this file states: an escapee is killed within KILL_BOUND seconds of holding the
GPU, with the watchdog sweeping every WATCHDOG_SECONDS (two sweeps at most are needed, plus the
scheduling of a loaded two-core box).
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from pathlib import Path

import pytest

from tessera.shared import subjects
from tessera.shared.events import ClaimViolation, claim_decoder

from tessera.cli.client import Client

from kit import eventually
from runkit import finish, start_run, tenant_cluster
from test_metrics import scrape, value

ROOT = Path(__file__).resolve().parents[2]
SIM_LIBCUDA = ROOT / "native" / "vgpu" / "build" / "sim" / "libcuda.so.1"
WATCHDOG_SECONDS = 0.5
KILL_BOUND = 15.0
SIGKILLED = 128 + signal.SIGKILL  # `tessera run` passes the workload's end through


@pytest.fixture(scope="module")
def escapee(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("escapee")
    src = Path(__file__).parent / "escapee.c"
    flags = ["gcc", "-O2", "-Wall", "-Wextra", "-Werror"]
    subprocess.run([*flags, "-DESCAPEE_STATIC", "-static", "-o", str(out / "static"), str(src)], check=True)
    subprocess.run([*flags, "-o", str(out / "dynamic"), str(src), "-ldl"], check=True)
    assert SIM_LIBCUDA.is_file(), "the simulated driver is missing: run 'make native'"
    return {"static": out / "static", "dynamic": out / "dynamic"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with tenant_cluster(tmp_path_factory.mktemp("watchdog"), TESSERA_WATCHDOG_SECONDS=str(WATCHDOG_SECONDS)) as cluster:
        yield cluster


class Violations:
    """The ``violation`` claim events published while it listens."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.events: list[ClaimViolation] = []

    async def __aenter__(self) -> "Violations":
        async def on_msg(msg) -> None:
            event = claim_decoder.decode(msg.data)
            if isinstance(event, ClaimViolation):
                self.events.append(event)

        self.sub = await self.client.bus.listen(subjects.claims_of_kind("violation"), on_msg)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.sub.unsubscribe()

    def of(self, pid: int) -> list[ClaimViolation]:
        return [e for e in self.events if e.pid == pid]


async def pid_in(ready: Path) -> int:
    text = await eventually(lambda: ready.read_text() if ready.exists() else "", timeout=60,
                            what=f"the escapee's ready file {ready}")
    return int(text)


async def killed_and_reported(cluster, client, proc, ready: Path, kind: str) -> ClaimViolation:
    async with Violations(client) as violations:
        pid = await pid_in(ready)
        done = await finish(proc, timeout=KILL_BOUND)  # killed within the bound, or this times out
        assert done.code == SIGKILLED, (done.code, done.stderr)
        event = (await eventually(lambda: violations.of(pid), timeout=10, what=f"a violation event for pid {pid}"))[0]
    assert event.node == "gpu-0" and event.tenant == "alpha" and event.claim.startswith("run-")
    enforcer = cluster.find("enforcer-gpu-0")
    log_line = f"claim {event.claim}: killed pid {pid}: "
    assert log_line in enforcer.log_path.read_text()
    samples = scrape(enforcer.metrics_port).get("tessera_escapees_killed", [])
    assert (value(samples, kind=kind, node="gpu-0") or 0) >= 1, samples
    return event


async def test_a_static_binary_in_tessera_run_is_killed(cluster, escapee, tmp_path):
    client = await Client.connect(cluster.url)
    ready = tmp_path / "ready"
    try:
        proc = await start_run(cluster, "--gpumem", "256", command=[str(escapee["static"]), "static", str(SIM_LIBCUDA), str(ready)])
        event = await killed_and_reported(cluster, client, proc, ready, "no-libvgpu")
        assert "libvgpu is not loaded" in event.reason
    finally:
        await client.close()


@pytest.mark.parametrize("mode", ["dlmopen", "dlmopen-only"])
async def test_a_dlmopen_escapee_in_tessera_run_is_killed(cluster, escapee, tmp_path, mode):
    """It allocates 1 GiB past a 256 MiB claim in its second namespace before it is killed."""
    client = await Client.connect(cluster.url)
    ready = tmp_path / "ready"
    try:
        proc = await start_run(cluster, "--gpumem", "256", command=[str(escapee["dynamic"]), mode, str(ready), "1024"])
        event = await killed_and_reported(cluster, client, proc, ready, "second-namespace")
        assert "dlmopen" in event.reason
    finally:
        await client.close()


async def test_libvgpu_in_force_and_processes_outside_the_claim_are_left_alone(cluster, escapee, tmp_path):
    """While the watchdog finds and kills an escapee of another claim (so it has swept with all three
    there), a workload with libvgpu in force and an escapee outside any claim keep running."""
    client = await Client.connect(cluster.url)
    hold, outside_ready, ready = tmp_path / "hold", tmp_path / "outside-ready", tmp_path / "ready"
    outside = subprocess.Popen([str(escapee["static"]), "static", str(SIM_LIBCUDA), str(outside_ready)])
    workload = None
    try:
        workload = await start_run(cluster, "--gpumem", "512", workload=["--alloc", "100", "--hold-file", str(hold)])
        line = await asyncio.wait_for(workload.stdout.readline(), 60)  # its report: it holds 100 MiB now
        assert b'"alloc": [[100, 0]]' in line, line
        await pid_in(outside_ready)
        proc = await start_run(cluster, "--gpumem", "256", command=[str(escapee["static"]), "static", str(SIM_LIBCUDA), str(ready)])
        await killed_and_reported(cluster, client, proc, ready, "no-libvgpu")
        assert workload.returncode is None
        assert outside.poll() is None, "a process outside every claim was killed"
        hold.touch()
        done = await finish(workload)
        assert done.code == 0, done.stderr
    finally:
        hold.touch()
        if workload is not None and workload.returncode is None:
            await finish(workload)
        outside.kill()
        outside.wait()
        await client.close()
