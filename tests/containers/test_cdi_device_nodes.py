"""The device nodes of a real node's spec, applied by Podman: the container gets exactly the GPUs'
and the driver's nodes with the host's numbers, and a missing one stops the container from starting.

This machine has no NVIDIA devices, so the "host" /dev is a directory of links to /dev/null and
/dev/zero (distinct numbers); the spec is built by the enforcer's own cdi.claim_spec from it.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from cdischema import validate
from runtime import Podman
from tessera.shared.events import DeviceShare

from tessera.enforcer import cdi
from tessera.enforcer.claimdir import ClaimDirs
from tessera.enforcer.limits import vgpu_config, workload_env

LIBVGPU = Path(__file__).parent.parent.parent / "native" / "vgpu" / "build" / "libvgpu.so"
SHARES = [DeviceShare(uuid="GPU-5e55e7a0-0000-4000-8000-000000000002", index=2, memory_mib=512, cores=100)]


def real_node_spec(tmp_path: Path, host_nodes: dict[str, str]) -> dict:
    dev = tmp_path / "dev"
    dev.mkdir()
    for name, target in host_nodes.items():
        (dev / name).symlink_to(target)
    directory = ClaimDirs(tmp_path / "state").of("c-real-node")
    directory.create(workload_env(SHARES, directory.cache), vgpu_config(SHARES, directory.cache))
    spec = cdi.claim_spec("c-real-node", SHARES, directory, cdi.NodeFiles(libvgpu=LIBVGPU, dev_root=dev))
    validate(spec)
    cdi.write_spec(tmp_path / "cdi", spec)
    return spec


def numbers(path: str) -> str:
    rdev = os.stat(path).st_rdev
    return f"{os.major(rdev):x}:{os.minor(rdev):x}"


async def test_the_container_gets_the_gpus_and_drivers_nodes_with_the_hosts_numbers(tools, base_image, tmp_path):
    spec = real_node_spec(tmp_path, {"nvidia2": "/dev/null", "nvidiactl": "/dev/zero", "nvidia-uvm": "/dev/null"})
    podman = Podman(cdi_dir=tmp_path / "cdi", tools=tools)
    args = podman.run_args(base_image, *cdi.device_ids(spec))
    got = await asyncio.to_thread(podman, *args, "sh", "-c",
                                  "stat -c '%n %F %t:%T' /dev/nvidia2 /dev/nvidiactl /dev/nvidia-uvm && "
                                  "echo written > /dev/nvidia2 && ls /dev | grep -c '^nvidia'")
    assert got.code == 0, got.stderr
    lines = got.stdout.splitlines()
    assert lines[:3] == [f"/dev/nvidia2 character special file {numbers('/dev/null')}",
                         f"/dev/nvidiactl character special file {numbers('/dev/zero')}",
                         f"/dev/nvidia-uvm character special file {numbers('/dev/null')}"]
    assert lines[3] == "3"  # nothing else of the driver's, and no other GPU


async def test_a_missing_driver_node_stops_the_container_from_starting(tools, base_image, tmp_path):
    spec = real_node_spec(tmp_path, {"nvidia2": "/dev/null", "nvidiactl": "/dev/zero"})  # no nvidia-uvm
    podman = Podman(cdi_dir=tmp_path / "cdi", tools=tools)
    got = await asyncio.to_thread(podman, *podman.run_args(base_image, *cdi.device_ids(spec)), "true")
    assert got.code != 0 and "nvidia-uvm" in got.stderr, got.stderr
