"""A local tenant control plane runs within the CPU and memory limits rendered for its containers:
each process in a cgroup of its own, as a kubelet would place it; deleting the tenant removes them."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from controlplane.planes import Planes
from tessera.controlplane.limits import Limits

ROOT = f"tessera-test-{uuid.uuid4().hex[:8]}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("planes", [("nats", {"cgroup_root": ROOT})], indirect=True)
async def test_each_process_runs_in_its_cgroup_with_the_rendered_limits(planes: Planes):
    await planes.create("zeta")
    limits = planes.host.limits
    assert isinstance(limits, Limits), "no writable cgroup hierarchy on this machine"
    assert limits.read("zeta", "kube-apiserver") == (1000, 1024 * 2**20)  # the small size class
    assert limits.read("zeta", "datastore-shim") == (250, 128 * 2**20)
    for name, pid in planes.host.pids("zeta").items():
        for directory in limits.dirs("zeta", name):
            assert str(pid) in (directory / "cgroup.procs").read_text().split(), (name, directory)
    assert limits.paths("zeta")

    assert not (await planes.manager.api.remove("zeta")).pending
    assert limits.paths("zeta") == []
    for top in limits.dirs("zeta"):
        Path(top).parent.rmdir()  # the test's own root (the manager keeps it)
