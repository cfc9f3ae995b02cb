"""A claim's runtime priority (HAMi's ``nvidia.com/priority``, ``ClaimSpec.task_priority``) reaches
libvgpu the way its limits do: in the limits file the container gets read-only, with the priority
boards of its GPUs, which the CDI spec mounts writable for a high-priority claim and read-only for a
low one. The last test runs the real libvgpu on the simulated driver with the files the enforcer
wrote, two claims on one GPU: the low one yields while the high one launches (native/vgpu/README.md).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from cdischema import validate
from tessera.enforcer import cdi
from tessera.enforcer.preparation import Preparation
from tessera.shared.events import DeviceShare, GpuDevice

NATIVE = Path(__file__).resolve().parents[2] / "native" / "vgpu"
UUID0 = "GPU-5e55e7a0-0000-4000-8000-000000000000"
UUID1 = "GPU-5e55e7a0-0000-4000-8000-000000000001"
GPUS = {u: GpuDevice(uuid=u, index=i, model="Sim H100", memory_mib=81920) for i, u in enumerate((UUID0, UUID1))}


def share(uuid: str, index: int) -> DeviceShare:
    return DeviceShare(uuid=uuid, index=index, memory_mib=4096, cores=0)


def mounts(preparation: Preparation, claim: str) -> dict[str, dict]:
    spec = json.loads(cdi.spec_path(preparation.settings.cdi_dir, claim).read_text())
    validate(spec)
    return {m["containerPath"]: m for m in spec["devices"][0]["containerEdits"]["mounts"]}


def test_the_priority_and_the_gpus_boards_are_in_the_limits_file_and_mounted_by_priority(preparation):
    boards = preparation.settings.state_dir / "priority"
    board0, board1 = boards / f"{UUID0}.board", boards / f"{UUID1}.board"
    # the low claim has both GPUs, listed out of order: the boards are numbered as the limits are
    low = preparation.materialize("c-low", [share(UUID1, 1), share(UUID0, 0)], GPUS, task_priority=1)
    high = preparation.materialize("c-high", [share(UUID0, 0)], GPUS, task_priority=0)
    none = preparation.materialize("c-none", [share(UUID0, 0)], GPUS)

    lines = low.directory.config.read_text().splitlines()
    assert "CUDA_TASK_PRIORITY=1" in lines
    assert [line for line in lines if line.startswith("TESSERA_VGPU_PRIORITY_BOARD_")] == [
        f"TESSERA_VGPU_PRIORITY_BOARD_0={board0}", f"TESSERA_VGPU_PRIORITY_BOARD_1={board1}"]
    assert "CUDA_TASK_PRIORITY=0" in high.directory.config.read_text().splitlines()
    assert "PRIORITY" not in none.directory.config.read_text()

    # low reads its boards, high writes its one, a claim without a priority has none
    low_mounts, high_mounts, none_mounts = (mounts(preparation, c) for c in ("c-low", "c-high", "c-none"))
    assert low_mounts[str(board0)]["hostPath"] == str(board0) and "ro" in low_mounts[str(board0)]["options"]
    assert "ro" in low_mounts[str(board1)]["options"]
    assert "rw" in high_mounts[str(board0)]["options"] and str(board1) not in high_mounts
    assert not any(path.startswith(str(boards)) for path in none_mounts)

    # one board per GPU, shared by its claims: empty, any container uid may open it, nobody may list
    assert board0.read_bytes() == b"" and sorted(p.name for p in boards.iterdir()) == [board0.name, board1.name]
    assert stat.S_IMODE(board0.stat().st_mode) == 0o666 and stat.S_IMODE(boards.stat().st_mode) == 0o711
    # the environment the workload is given says nothing of it: only the file does
    assert not any("PRIORITY" in k for k in low.env)


def test_a_gpu_uuid_that_is_not_a_file_name_gets_no_board(preparation):
    with pytest.raises(ValueError, match="cannot name a priority board"):
        preparation.dirs.priority_board("GPU-../../etc")


def test_libvgpu_yields_by_the_files_the_enforcer_wrote(preparation, tmp_path):
    subprocess.run(["nice", "-n", "15", "make", "-s", "-C", str(NATIVE), "tests"], check=True, capture_output=True)
    build = NATIVE / "build"
    low = preparation.materialize("c-low", [share(UUID0, 0)], GPUS, task_priority=1)
    high = preparation.materialize("c-high", [share(UUID0, 0)], GPUS, task_priority=0)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "TESSERA_"))}
    # the test build reads the node file from TESSERA_VGPU_TEST_NODE_CONFIG: each claim's process gets
    # its claim's vgpu.conf there, as a container gets it at /etc/tessera/vgpu.conf
    env.update(LD_PRELOAD=str(build / "test" / "libvgpu.so"), LD_LIBRARY_PATH=str(build / "sim"),
               TESSERA_SIM_KERNEL_US="500", TESSERA_SIM_GPU_UUIDS=UUID0, VT_WORK=str(tmp_path))
    done = subprocess.run([str(build / "tests" / "t_priority"), "files", str(low.directory.config),
                           str(high.directory.config)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "low while high launches" in done.stdout
