"""A real node's claim spec carries the whole driver, applied by Podman with no NVIDIA runtime or hook.

The enforcer's own prepare (Preparation.materialize, what the kubelet plugin and the bus path call),
with settings read from the environment as a DaemonSet gives them, writes the spec of a claim of one
GPU of a four-GPU "host". This machine has no NVIDIA driver, so the host is made of files:

- a driver root laid out the way NVIDIA's installer leaves a RHEL-like host (``/usr/lib64``, which a
  Debian container's loader does not search by itself): the simulated driver built from native/vgpu
  installed as ``libcuda.so.<version>`` and ``libnvidia-ml.so.<version>`` with their soname links, a
  stand-in PTX JIT compiler of the same version, a library that is not the driver's, an
  ``nvidia-smi``, and the ``etc/ld.so.cache`` that the host's ldconfig writes for that root;
- a /dev of links to /dev/null and /dev/zero for the four GPUs and the driver's nodes.

Nothing of NVIDIA's runs: the machine has no nvidia-container-runtime, runtime hook, nvidia-ctk or
nvidia-cdi-hook, so whatever makes CUDA work in the container is in Tessera's spec.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

from cdischema import validate
from runtime import Podman
from tessera.shared.events import DeviceShare, GpuDevice

from tessera.enforcer import cdi
from tessera.enforcer.claimdir import ClaimDirs
from tessera.enforcer.preparation import Preparation
from tessera.enforcer.settings import EnforcerSettings

VGPU_BUILD = Path(__file__).parent.parent.parent / "native" / "vgpu" / "build"
PROBE = "/usr/local/bin/cuda_probe"
OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY
VERSION = "580.65.06"
LIB = "usr/lib64"
UUIDS = [f"GPU-5e55e7a0-0000-4000-8000-00000000000{i}" for i in range(4)]
GPUS = {u: GpuDevice(uuid=u, index=i, model="Sim H100", memory_mib=81920) for i, u in enumerate(UUIDS)}
CLAIM = "c-real-driver"
SHARE = DeviceShare(uuid=UUIDS[2], index=2, memory_mib=512, cores=100)
NVIDIA_TOOLS = ("nvidia-container-runtime", "nvidia-container-runtime-hook", "nvidia-container-cli", "nvidia-ctk",
                "nvidia-cdi-hook")


def _shared_lib(out: Path, soname: str) -> None:
    src = out.with_suffix(".c")
    src.write_text("int tessera_test_stand_in(void) { return 0; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(out), str(src)], check=True)
    src.unlink()


def driver_root(tmp_path: Path) -> Path:
    root = tmp_path / "driver-root"
    lib = root / LIB
    lib.mkdir(parents=True)
    for name in ("libcuda", "libnvidia-ml"):
        shutil.copy(VGPU_BUILD / "sim" / f"{name}.so.1", lib / f"{name}.so.{VERSION}")
        (lib / f"{name}.so.1").symlink_to(f"{name}.so.{VERSION}")
    (lib / "libcuda.so").symlink_to("libcuda.so.1")
    _shared_lib(lib / f"libnvidia-ptxjitcompiler.so.{VERSION}", "libnvidia-ptxjitcompiler.so.1")
    (lib / "libnvidia-ptxjitcompiler.so.1").symlink_to(f"libnvidia-ptxjitcompiler.so.{VERSION}")
    _shared_lib(lib / "libnotthedriver.so.1", "libnotthedriver.so.1")  # same directory, not the driver's
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "usr" / "bin" / "nvidia-smi").write_text("#!/bin/sh\necho 'stand-in nvidia-smi'\n")
    (root / "usr" / "bin" / "nvidia-smi").chmod(0o755)
    (root / "etc").mkdir()
    (root / "etc" / "ld.so.conf").write_text(f"/{LIB}\n")
    subprocess.run(["ldconfig", "-r", str(root)], check=True)
    return root


def dev_root(tmp_path: Path) -> Path:
    dev = tmp_path / "dev"
    dev.mkdir()
    for i in range(4):
        (dev / f"nvidia{i}").symlink_to("/dev/null")
    for name, target in (("nvidiactl", "/dev/zero"), ("nvidia-uvm", "/dev/null"), ("nvidia-uvm-tools", "/dev/zero"),
                         ("nvidia-modeset", "/dev/null")):
        (dev / name).symlink_to(target)
    return dev


def real_node_prepare(tmp_path: Path) -> tuple[dict, str]:
    settings = EnforcerSettings.from_env({
        "TESSERA_NODE": "gpu-real",
        "TESSERA_STATE_DIR": str(tmp_path / "state"),
        "TESSERA_CDI_DIR": str(tmp_path / "cdi"),
        "TESSERA_LIBVGPU": str(VGPU_BUILD / "libvgpu.so"),
        "TESSERA_SIM_DRIVER_DIR": "none",  # the node's "real" driver
        "TESSERA_DRIVER_ROOT": str(driver_root(tmp_path)),
        "TESSERA_DEV_ROOT": str(dev_root(tmp_path)),
        "TESSERA_CDI_HOOK": str(VGPU_BUILD / "tessera-cdi-hook"),
    })
    prepared = Preparation(settings, ClaimDirs(settings.state_dir)).materialize(CLAIM, [SHARE], GPUS)
    spec = json.loads(cdi.spec_path(settings.cdi_dir, CLAIM).read_text())
    validate(spec)
    return spec, prepared.cdi_device


# What the container reports: one labelled line each, then the probe's JSON line.
REPORT = f"""
echo "visible=$NVIDIA_VISIBLE_DEVICES"
echo "nodes=$(ls /dev | grep nvidia | sort | tr '\\n' ' ')"
echo "cache=$(ldconfig -p | grep -E 'lib(cuda|nvidia|notthedriver)' | sed 's/^[[:space:]]*//; s/ *(.*) => / /' | sort | tr '\\n' ';')"
echo "libcuda.so=$(readlink /{LIB}/libcuda.so)"
if (: > /{LIB}/libcuda.so.{VERSION}) 2>/dev/null; then echo "written=yes"; else echo "written=no"; fi
echo "smi=$(nvidia-smi)"
exec {PROBE} 64 0
"""


async def test_the_driver_comes_from_the_spec_and_the_container_sees_only_its_claims_gpu(
        tools, base_image, cuda_probe, tmp_path):
    assert not [t for t in NVIDIA_TOOLS if shutil.which(t)], "this test needs a machine without NVIDIA's runtime"
    spec, device = real_node_prepare(tmp_path)
    podman = Podman(cdi_dir=tmp_path / "cdi", tools=tools)
    # The workload asks for every GPU by environment, as an image of NVIDIA's does; the simulated
    # driver is told which GPU this container's node is (the real one learns it from the kernel).
    args = podman.run_args(base_image, device, mounts={str(cuda_probe): PROBE},
                           options=("--env", "NVIDIA_VISIBLE_DEVICES=all", "--env", f"TESSERA_SIM_GPU_UUIDS={UUIDS[2]}"))
    ran = await asyncio.to_thread(podman, *args, "sh", "-c", REPORT)
    assert ran.code == 0, ran.stderr[-3000:]
    *lines, last = ran.stdout.strip().splitlines()
    seen = dict(line.split("=", 1) for line in lines)
    # The CDI edits override the workload's own variable: the NVIDIA runtime would inject nothing.
    assert seen["visible"] == "void"
    # Its GPU's node and the driver's, no other GPU.
    assert seen["nodes"].split() == ["nvidia-modeset", "nvidia-uvm", "nvidia-uvm-tools", "nvidia2", "nvidiactl"]
    # The driver's libraries are in the container's loader cache at the driver's own directory
    # (the spec's hook ran ldconfig there), the library that is not the driver's is not.
    assert seen["cache"].split(";")[:-1] == [
        f"libcuda.so /{LIB}/libcuda.so", f"libcuda.so.1 /{LIB}/libcuda.so.1",
        f"libnvidia-ml.so.1 /{LIB}/libnvidia-ml.so.1",
        f"libnvidia-ptxjitcompiler.so.1 /{LIB}/libnvidia-ptxjitcompiler.so.1"], seen["cache"]
    assert seen["libcuda.so"] == "libcuda.so.1"  # the development name, beside the soname link ldconfig made
    assert seen["written"] == "no"  # read-only
    assert seen["smi"] == "stand-in nvidia-smi"
    # CUDA works: the one GPU of the claim, at exactly the claim's memory.
    got = json.loads(last)
    assert got["devices"] == 1
    assert (got["allocated_mib"], got["stopped_by"], got["one_more_byte"]) == (512, OUT_OF_MEMORY, OUT_OF_MEMORY), got
    # The only hook in the spec is Tessera's.
    hooks = spec["devices"][0]["containerEdits"]["hooks"]
    assert {h["path"] for h in hooks} == {str(VGPU_BUILD / "tessera-cdi-hook")}


async def test_without_the_claims_device_the_same_image_has_no_driver_and_no_gpu(tools, base_image, cuda_probe,
                                                                                 tmp_path):
    real_node_prepare(tmp_path)
    podman = Podman(cdi_dir=tmp_path / "cdi", tools=tools)
    args = podman.run_args(base_image, mounts={str(cuda_probe): PROBE},
                           options=("--env", "NVIDIA_VISIBLE_DEVICES=all"))
    ran = await asyncio.to_thread(podman, *args, "sh", "-c", "ls /dev | grep -c nvidia; exec " + PROBE + " 64 0")
    # No claim, no driver: the loader cannot even start the probe, and there is no GPU node.
    assert ran.code != 0 and "libcuda.so.1" in ran.stderr, ran.stderr[-2000:]
    assert ran.stdout.strip().splitlines()[0] == "0"
