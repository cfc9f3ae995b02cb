"""`tessera run --priority` (HAMi's runtime priority) reaches libvgpu the only way it may: in the
claim's limits file, which names the GPU's priority board, and not in the workload's environment
(libvgpu takes a high priority from the environment never; native/vgpu/README.md rule 6)."""

from __future__ import annotations

import os
from pathlib import Path

from runkit import tessera_run

SHOW = 'cat "$TESSERA_VGPU_CONFIG"; env | grep -c -e TASK_PRIORITY -e PRIORITY_BOARD || true'


async def test_a_runs_priority_is_in_its_limits_file_with_its_gpus_board(cluster):
    for level in ("0", "1"):
        done = await tessera_run(cluster, "--gpumem", "1000", "--priority", level, command=["sh", "-c", SHOW])
        assert done.code == 0, done.stderr
        lines = done.stdout.splitlines()
        assert f"CUDA_TASK_PRIORITY={level}" in lines
        boards = [line.split("=", 1)[1] for line in lines if line.startswith("TESSERA_VGPU_PRIORITY_BOARD_0=")]
        assert len(boards) == 1 and Path(boards[0]).name.startswith("GPU-") and Path(boards[0]).is_file()
        assert os.access(boards[0], os.R_OK | os.W_OK)  # a high-priority run stamps it, by its path
        assert lines[-1] == "0", "the workload's environment names no priority"


async def test_a_run_without_priority_has_none_in_its_limits_file(cluster):
    done = await tessera_run(cluster, "--gpumem", "1000", command=["sh", "-c", SHOW])
    assert done.code == 0, done.stderr
    lines = done.stdout.splitlines()
    assert not [line for line in lines if line.startswith(("CUDA_TASK_PRIORITY", "TESSERA_VGPU_PRIORITY_BOARD"))]
    assert lines[-1] == "0"
