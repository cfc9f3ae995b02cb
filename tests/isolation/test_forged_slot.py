"""Attack: a tenant forges a process slot in its own accounting file naming a process that is not
its own (any pid of the node), so that when its claim is released or reclaimed the enforcer (root,
host pid namespace) SIGKILLs that process. A slot with pid namespace or start time 0 used to pass the
identity check; one with the right values (readable by anyone from /proc) would pass too. The enforcer
must signal only a process it has verified (pidfd, start time, pid namespace, and that it holds the
claim's accounting file open, which libvgpu does for its whole life) and say why it refused."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from isokit import forge, hold_slots, pidns, start_time

from tessera.enforcer import accounting, processes

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "native" / "vgpu" / "build"


@pytest.fixture
def bystander():
    """Another tenant's process (or any process of the node): a sleep."""
    p = subprocess.Popen(["sleep", "300"])
    yield p
    p.kill()
    p.wait()


def forged_slots(cache: Path, slot: tuple[int, int, int]) -> tuple[accounting.ProcessUsage, ...]:
    forge(cache, [slot])
    fd = hold_slots(cache, 1)  # the tenant keeps the forged slot looking alive
    try:
        return accounting.read(cache).live_processes
    finally:
        os.close(fd)


@pytest.mark.parametrize("fields", ["zeros", "copied-from-proc"])
def test_a_forged_slot_naming_a_bystander_is_never_signalled(
    tmp_path: Path, bystander: subprocess.Popen, caplog: pytest.LogCaptureFixture, fields: str
) -> None:
    pid = bystander.pid
    slot = (pid, 0, 0) if fields == "zeros" else (pid, start_time(pid), pidns(pid))
    live = forged_slots(tmp_path / "vgpu.cache", slot)
    assert [p.pid for p in live] == [pid]
    caplog.set_level(logging.WARNING, logger="tessera.enforcer.processes")
    assert processes.kill(live, signal.SIGKILL) == []
    assert bystander.poll() is None, "the enforcer killed a process the tenant named"
    why = " ".join(r.getMessage() for r in caplog.records)
    assert f"not signalling pid {pid}" in why
    if fields == "zeros":
        assert "start time 0" in why or "pid namespace 0" in why
    else:
        assert "does not hold the claim's accounting file" in why


@pytest.fixture(scope="module")
def libvgpu() -> Path:
    subprocess.run(["make", "-s", "-C", str(ROOT / "native" / "vgpu")], check=True, capture_output=True)
    return BUILD


def test_the_claims_own_process_is_still_signalled(tmp_path: Path, libvgpu: Path) -> None:
    """The check must not refuse everything: a real libvgpu process of the claim is verified."""
    cache = tmp_path / "vgpu.cache"
    cache.touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_DEVICE_", "TESSERA_"))}
    env.update(LD_PRELOAD=str(libvgpu / "libvgpu.so"), LD_LIBRARY_PATH=str(libvgpu / "sim"),
               CUDA_DEVICE_MEMORY_LIMIT_0="64m", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache))
    w = subprocess.Popen([sys.executable, str(ROOT / "tests" / "enforcer" / "workload.py"), "--alloc", "16",
                          "--hold-file", str(tmp_path / "never")], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert '"alloc": [[16, 0]]' in w.stdout.readline()
        live = accounting.read(cache).live_processes
        assert [p.pid for p in live] == [w.pid]
        assert processes.kill(live, signal.SIGKILL) == [w.pid]
        assert w.wait(timeout=30) == -signal.SIGKILL
    finally:
        w.kill()
        w.wait()
        w.stdout.close()
