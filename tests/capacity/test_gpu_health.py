"""A GPU's health is read again at every heartbeat: on simulated hardware an edit of the profile's
``healthy`` (a GPU failing, recovering; a GPU gone from the file is lost), read only when the file
changed, and a half-written file leaves the health last read."""

from __future__ import annotations

from pathlib import Path

import yaml

from tessera.shared import profile

from tessera.capacity.health import HealthSource
from tessera.capacity.settings import CapacitySettings

GPU = {"model": "NVIDIA H100 80GB HBM3", "memory_mib": 81559}


def write(path: Path, *healthy: bool) -> None:
    path.write_text(yaml.safe_dump({"nodes": [{"name": "gpu-0", "gpus": [{**GPU, "healthy": h} for h in healthy]}]}))


def test_an_edit_of_the_profile_is_the_simulated_gpu_failing_and_recovering(tmp_path):
    path = tmp_path / "fleet.yaml"
    write(path, True, True)
    uuids = [d.uuid for d in profile.load(path)[0].devices]
    source = HealthSource(CapacitySettings(profile=str(path)))
    assert source.read(uuids) == {uuids[0]: True, uuids[1]: True}
    write(path, True, False)
    assert source.read(uuids) == {uuids[0]: True, uuids[1]: False}
    path.write_text("nodes: [")  # half-written: what it said last stands
    assert source.read(uuids) == {uuids[0]: True, uuids[1]: False}
    write(path, True)  # gpu-1 gone from the file: lost
    assert source.read(uuids) == {uuids[0]: True, uuids[1]: False}
    write(path, True, True)
    assert source.read(uuids) == {uuids[0]: True, uuids[1]: True}
