"""The Python reader of libvgpu's shared accounting file, against the real thing: a small C program
runs under the preloaded library and the simulated driver, and the file is read while it holds
memory, after it exits, and after it is SIGKILLed."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tessera.shared.vgpu_cache import VgpuCacheError, read_vgpu_cache

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "native" / "vgpu"
BUILD = NATIVE / "build"
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def native() -> Path:
    if not shutil.which("make") or not shutil.which(os.environ.get("CC", "gcc")):
        pytest.skip("no make or C compiler to build native/vgpu")
    subprocess.run(["make", "-s", "-C", str(NATIVE), "tests"], check=True, capture_output=True)
    return BUILD


class Holder:
    """t_hold under libvgpu: allocates `mib` on device 0 and holds it until stdin closes."""

    def __init__(self, build: Path, cache: Path, mib: int, limit: str = "256m") -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_DEVICE_", "TESSERA_"))}
        env.update(
            LD_PRELOAD=str(build / "libvgpu.so"),
            LD_LIBRARY_PATH=str(build / "sim"),
            CUDA_DEVICE_MEMORY_LIMIT_0=limit,
            CUDA_DEVICE_SM_LIMIT="40",
            CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache),
            TESSERA_SIM_GPU_UUIDS="GPU-12345678-9abc-def0-1234-56789abcdef0",
        )
        self.proc = subprocess.Popen(
            [str(build / "tests" / "t_hold"), str(mib)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
        )
        line = self.proc.stdout.readline()
        assert line.startswith("ready "), line
        self.pid = int(line.split()[1])

    def release(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0
        self.proc.stdout.close()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.proc.stdin.close()
        self.proc.stdout.close()


def test_reads_usage_limits_and_processes_while_memory_is_held(native: Path, tmp_path: Path) -> None:
    cache = tmp_path / "workload.cache"
    a = Holder(native, cache, 48)
    b = Holder(native, cache, 16)
    try:
        snap = read_vgpu_cache(cache)
        assert snap.version == 1
        dev = snap.device(0)
        assert dev.limit_bytes == 256 * MiB
        assert dev.sm_limit_percent == 40
        assert dev.used_bytes == 64 * MiB
        assert dev.uuid == "GPU-12345678-9abc-def0-1234-56789abcdef0"
        live = {p.pid: p for p in snap.live_processes}
        assert set(live) == {a.pid, b.pid}
        assert live[a.pid].used_bytes[0] == 48 * MiB
        assert live[b.pid].start_time > 0
        assert read_vgpu_cache(cache, lock=True).device(0).used_bytes == 64 * MiB
    finally:
        a.release()
    snap = read_vgpu_cache(cache)
    assert snap.device(0).used_bytes == 16 * MiB
    assert [p.pid for p in snap.live_processes] == [b.pid]
    b.kill()
    # a SIGKILLed process keeps its slot until libvgpu reclaims it, but it is seen as dead at once
    snap = read_vgpu_cache(cache)
    assert snap.device(0).used_bytes == 0
    assert all(not p.alive for p in snap.processes)


def test_missing_short_and_foreign_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(VgpuCacheError, match="no such accounting file"):
        read_vgpu_cache(tmp_path / "absent.cache")
    short = tmp_path / "short.cache"
    short.write_bytes(b"TESSVGPU")
    with pytest.raises(VgpuCacheError, match="too short"):
        read_vgpu_cache(short)
    foreign = tmp_path / "foreign.cache"
    foreign.write_bytes(b"NOTVGPU!" + bytes(200_000))
    with pytest.raises(VgpuCacheError, match="wrong magic"):
        read_vgpu_cache(foreign)


def test_unknown_version_is_refused(native: Path, tmp_path: Path) -> None:
    cache = tmp_path / "workload.cache"
    Holder(native, cache, 1).release()
    data = bytearray(cache.read_bytes())
    data[8:12] = (2).to_bytes(4, "little")
    cache.write_bytes(bytes(data))
    with pytest.raises(VgpuCacheError, match="layout version 2"):
        read_vgpu_cache(cache)
