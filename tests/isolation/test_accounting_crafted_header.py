"""Attack: a workload rewrites its accounting file's header. A header claiming 4 M process slots
(and a sparse file to match) made one enforcer read take seconds; other fields out of range pointed
the reader anywhere in the file. Every header field must be layout version 1's exactly, so the
slot count is bounded by the library's maximum (1,024), and a bad header is a clear error."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from isokit import FILE_SIZE, MAX_PROCS, forge

from tessera.enforcer import accounting


def test_four_million_slots_are_refused_not_read(tmp_path: Path) -> None:
    cache = tmp_path / "vgpu.cache"
    n = 4 * 1024 * 1024
    forge(cache, [(1, 1, 1)], max_procs=n, proc_hwm=n)
    with pytest.raises(accounting.VgpuCacheError, match="max_procs is 4194304, layout version 1 has 1024"):
        accounting.read(cache)


def test_a_high_water_mark_past_the_slot_table_is_refused(tmp_path: Path) -> None:
    cache = tmp_path / "vgpu.cache"
    forge(cache, [], proc_hwm=MAX_PROCS + 1)
    with pytest.raises(accounting.VgpuCacheError, match="out of range"):
        accounting.read(cache)


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    cache = tmp_path / "vgpu.cache"
    forge(cache, [], size=FILE_SIZE - 1)
    with pytest.raises(accounting.VgpuCacheError, match="bytes, the header says"):
        accounting.read(cache)


def test_a_fifo_in_place_of_the_file_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "vgpu.cache"
    os.mkfifo(fifo)
    with pytest.raises(accounting.VgpuCacheError, match="not a regular file"):
        accounting.read(fifo)
