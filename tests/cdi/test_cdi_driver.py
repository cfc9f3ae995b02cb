"""The driver edits of a claim's spec: the loader cache read, the driver's files found under a driver
root, and the spec's shape on a real node (device nodes, read-only libraries, the createContainer
hook, ``NVIDIA_VISIBLE_DEVICES=void``) at the minimum cdiVersion.

The files a real driver installs are played by small files with the driver's names; the loader cache
of a driver root is written by this machine's own ldconfig (``ldconfig -r``), and read back against
what ``ldconfig -p`` prints. tests/containers proves a real runtime applies these specs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from cdischema import validate
from tessera.shared.events import DeviceShare, GpuDevice

from tessera.enforcer import cdi, driver
from tessera.enforcer.claimdir import CONTAINER_LIBVGPU, ClaimDirs
from tessera.enforcer.limits import vgpu_config, workload_env

VERSION = "580.65.06"
UUIDS = [f"GPU-5e55e7a0-0000-4000-8000-00000000000{i}" for i in range(4)]
SHARES = [DeviceShare(uuid=UUIDS[3], index=3, memory_mib=2048, cores=50),
          DeviceShare(uuid=UUIDS[1], index=1, memory_mib=1024, cores=50)]
HOOK = "/usr/local/vgpu/tessera-cdi-hook"


def ldconfig_p(cache: Path) -> set[tuple[str, str]]:
    """(name, path) of every 64-bit entry, as ``ldconfig -p`` prints the cache."""
    out = subprocess.run(["ldconfig", "-p", "-C", str(cache)], capture_output=True, text=True, check=True).stdout
    return {(m[1], m[2]) for m in re.finditer(r"^\s+(\S+) \(libc6,x86-64[^)]*\) => (\S+)$", out, re.MULTILINE)}


def entries(cache: Path) -> set[tuple[str, str]]:
    return {(e.name, e.path) for e in driver.read_ldcache(cache) if e.flags == driver.machine_flags()}


def _lib(path: Path, soname: str) -> None:
    src = path.parent / "stand-in.c"
    src.write_text("int stand_in(void) { return 0; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(path), str(src)], check=True)
    src.unlink()


def install_driver(root: Path, lib: str = "usr/lib64", *, cache: bool = True, version: str = VERSION) -> Path:
    """A driver as NVIDIA's installer leaves it under ``root`` (real shared objects, so that
    ldconfig reads their sonames), the loader cache written for that root."""
    d = root / lib
    d.mkdir(parents=True)
    for name in ("libcuda", "libnvidia-ml", "libnvidia-ptxjitcompiler", "libnvidia-nvvm"):
        _lib(d / f"{name}.so.{version}", f"{name}.so.1")
        (d / f"{name}.so.1").symlink_to(f"{name}.so.{version}")
    (d / "libcuda.so").symlink_to("libcuda.so.1")
    (d / "vdpau").mkdir()
    _lib(d / "vdpau" / f"libvdpau_nvidia.so.{version}", "libvdpau_nvidia.so.1")
    _lib(d / "libnotthedriver.so.2", "libnotthedriver.so.2")
    _lib(d / f"libold.so.{version[:-1]}9", "libold.so.1")  # another driver version's leftover
    # the 32-bit driver sits elsewhere and is not a 64-bit container's
    (root / "usr/lib").mkdir(parents=True, exist_ok=True)
    (root / "usr/lib" / f"libcuda.so.{version}").write_bytes(b"\x7fELF 32-bit stand-in")
    (root / "usr/bin").mkdir(parents=True, exist_ok=True)
    for program in ("nvidia-smi", "nvidia-debugdump", "nvidia-cuda-mps-control"):
        (root / "usr/bin" / program).write_text("#!/bin/sh\n")
        (root / "usr/bin" / program).chmod(0o755)
    if cache:
        (root / "etc").mkdir(exist_ok=True)
        (root / "etc/ld.so.conf").write_text(f"/{lib}\n")
        subprocess.run(["ldconfig", "-r", str(root)], check=True)
    return d


# --- the loader cache ------------------------------------------------------------------------


def test_this_machines_loader_cache_reads_as_ldconfig_prints_it():
    found = entries(Path("/etc/ld.so.cache"))
    assert found and found == ldconfig_p(Path("/etc/ld.so.cache"))


def test_a_driver_roots_cache_names_the_driver_at_the_roots_own_paths(tmp_path):
    install_driver(tmp_path)
    cache = tmp_path / "etc/ld.so.cache"
    assert entries(cache) == ldconfig_p(cache)
    assert ("libcuda.so.1", "/usr/lib64/libcuda.so.1") in entries(cache)


@pytest.mark.parametrize("data", [b"", b"not a cache at all", b"glibc-ld.so.cache1.1\x05\x00\x00\x00",
                                  b"ld.so-1.7.0\x00\x00\x00\x00\x00"])
def test_what_is_not_a_loader_cache_is_refused(data):
    with pytest.raises(ValueError):
        driver.parse_ldcache(data)


def test_a_cache_whose_strings_point_outside_it_is_refused(tmp_path):
    install_driver(tmp_path)
    data = bytearray((tmp_path / "etc/ld.so.cache").read_bytes())
    data[48 + 4:48 + 8] = (len(data) + 100).to_bytes(4, "little")  # the first entry's key
    with pytest.raises(ValueError, match="outside"):
        driver.parse_ldcache(bytes(data))


# --- finding the driver ----------------------------------------------------------------------


def test_the_driver_is_every_library_of_its_version_beside_libcuda_and_its_programs(tmp_path):
    install_driver(tmp_path / "root")
    found = driver.find(tmp_path / "root", "/")
    assert found.version == VERSION
    assert [f.container for f in found.libraries] == [
        f"/usr/lib64/{name}.so.{VERSION}" for name in ("libcuda", "libnvidia-ml", "libnvidia-nvvm",
                                                       "libnvidia-ptxjitcompiler")] + [
        f"/usr/lib64/vdpau/libvdpau_nvidia.so.{VERSION}"]
    # mounted from the host's side of the root, at the root's own paths in the container
    assert all(f.host == f.container for f in found.libraries)
    assert [(f.host, f.container) for f in found.binaries] == [
        ("/usr/bin/nvidia-smi", "/usr/bin/nvidia-smi"), ("/usr/bin/nvidia-debugdump", "/usr/bin/nvidia-debugdump")]
    assert found.library_dirs == ["/usr/lib64", "/usr/lib64/vdpau"] and found.libcuda_dir == "/usr/lib64"


def test_the_enforcers_view_of_the_root_and_the_hosts_are_told_apart(tmp_path):
    install_driver(tmp_path / "driver-root")
    found = driver.find(tmp_path / "driver-root", "/run/nvidia/driver")
    cuda = found.libraries[0]
    assert (cuda.host, cuda.container) == (f"/run/nvidia/driver/usr/lib64/libcuda.so.{VERSION}",
                                           f"/usr/lib64/libcuda.so.{VERSION}")
    # one root seen the same by both (a host's enforcer): the paths are the enforcer's own
    same = driver.find(tmp_path / "driver-root")
    assert same.libraries[0].host == str(tmp_path / "driver-root" / "usr/lib64" / f"libcuda.so.{VERSION}")


def test_absolute_links_in_the_root_resolve_inside_it(tmp_path):
    root = tmp_path / "root"
    install_driver(root, "usr/lib/x86_64-linux-gnu")
    (root / "lib").symlink_to("/usr/lib")  # merged /usr, written as an absolute link
    lib = root / "usr/lib/x86_64-linux-gnu"
    (lib / "libcuda.so.1").unlink()
    (lib / "libcuda.so.1").symlink_to(f"/lib/x86_64-linux-gnu/libcuda.so.{VERSION}")
    assert driver.resolve_in(root, "/lib/x86_64-linux-gnu/libcuda.so.1") == \
        f"/usr/lib/x86_64-linux-gnu/libcuda.so.{VERSION}"
    assert driver.resolve_in(root, "/../../../usr/lib") == "/usr/lib"  # '..' stops at the root
    assert driver.find(root, "/").libcuda_dir == "/usr/lib/x86_64-linux-gnu"


def test_a_root_without_a_cache_is_searched_in_the_usual_directories(tmp_path):
    install_driver(tmp_path, "usr/lib/x86_64-linux-gnu", cache=False)
    found = driver.find(tmp_path, "/")
    assert found.libcuda_dir == "/usr/lib/x86_64-linux-gnu" and len(found.libraries) == 5


def test_no_driver_is_refused_with_the_setting_to_look_at(tmp_path):
    with pytest.raises(driver.DriverNotFound, match="TESSERA_DRIVER_ROOT"):
        driver.find(tmp_path)
    lib = tmp_path / "usr/lib64"
    lib.mkdir(parents=True)
    (lib / "libcuda.so.1").write_bytes(b"\x7fELF")  # not a versioned driver library
    with pytest.raises(driver.DriverNotFound, match="versioned"):
        driver.find(tmp_path)


# --- the spec on a real node -----------------------------------------------------------------


@pytest.fixture
def node(tmp_path):
    """A real node: its driver, its /dev (links to /dev/null, /dev/zero), its kernel's GPU list."""
    install_driver(tmp_path / "driver-root")
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in [f"nvidia{i}" for i in range(4)] + ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"]:
        (dev / name).symlink_to("/dev/zero" if name == "nvidiactl" else "/dev/null")
    proc = tmp_path / "proc-driver-nvidia"
    for minor, uuid in enumerate(UUIDS):
        gpu = proc / "gpus" / f"0000:{0x17 + minor:02x}:00.0"
        gpu.mkdir(parents=True)
        gpu.joinpath("information").write_text(f"Model: \t\t NVIDIA H100\nGPU UUID: \t {uuid}\n"
                                               f"Bus Location: \t {gpu.name}\nDevice Minor: \t {minor}\n")
    directory = ClaimDirs(tmp_path / "state").of("c-real")
    directory.create(workload_env(SHARES, directory.cache), vgpu_config(SHARES, directory.cache))
    files = cdi.NodeFiles(libvgpu="/usr/local/vgpu/libvgpu.so", dev_root=dev, cdi_hook=HOOK, proc_driver=proc,
                          driver=driver.find(tmp_path / "driver-root", "/"))
    return directory, files, proc


def edits_of(spec: dict) -> dict:
    return spec["devices"][0]["containerEdits"]


def test_a_real_nodes_spec_carries_the_whole_driver_at_0_3_0(node):
    directory, files, _ = node
    spec = cdi.claim_spec("c-real", SHARES, directory, files)
    validate(spec)
    assert spec["cdiVersion"] == "0.3.0"  # device nodes by path, untyped mounts and hooks: all 0.3.0
    edits = edits_of(spec)
    assert [n["path"] for n in edits["deviceNodes"]] == [
        "/dev/nvidia1", "/dev/nvidia3", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
        "/dev/nvidia-modeset"]
    mounts = {m["containerPath"]: m for m in edits["mounts"]}
    driver_paths = [f"/usr/lib64/{n}.so.{VERSION}" for n in ("libcuda", "libnvidia-ml", "libnvidia-nvvm",
                                                             "libnvidia-ptxjitcompiler")]
    driver_paths += [f"/usr/lib64/vdpau/libvdpau_nvidia.so.{VERSION}", "/usr/bin/nvidia-smi",
                     "/usr/bin/nvidia-debugdump"]
    assert list(mounts) == driver_paths + [CONTAINER_LIBVGPU, "/etc/ld.so.preload", "/etc/tessera/vgpu.conf",
                                           str(directory.cache)]
    for path in driver_paths:
        assert mounts[path]["hostPath"] == path and mounts[path]["options"] == ["ro", "nosuid", "nodev", "bind"]
    assert [m["containerPath"] for m in edits["mounts"] if "rw" in m["options"]] == [str(directory.cache)]
    assert edits["hooks"] == [{"hookName": "createContainer", "path": HOOK, "args": [
        "tessera-cdi-hook", "update-ldcache", "--folder", "/usr/lib64", "--folder", "/usr/lib64/vdpau",
        "--link", f"libcuda.so.{VERSION}::/usr/lib64/libcuda.so.1", "--link", "libcuda.so.1::/usr/lib64/libcuda.so"]}]
    env = dict(e.split("=", 1) for e in edits["env"])
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert env["CUDA_VISIBLE_DEVICES"] == f"{UUIDS[1]},{UUIDS[3]}"
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1024m" and env["CUDA_DEVICE_SM_LIMIT"] == "50"
    assert not any(k.startswith("TESSERA_SIM_") for k in env)


def test_a_gpus_node_is_the_kernels_minor_for_its_uuid_not_its_index(node):
    directory, files, proc = node
    # The kernel numbered these two GPUs the other way round from NVML's index.
    for uuid, minor in ((UUIDS[1], 3), (UUIDS[3], 1)):
        info = next(p for p in proc.glob("gpus/*/information") if uuid in p.read_text())
        info.write_text(re.sub(r"Device Minor:.*", f"Device Minor: \t {minor}", info.read_text()))
    assert cdi.kernel_minors(proc) == {UUIDS[0]: 0, UUIDS[1]: 3, UUIDS[2]: 2, UUIDS[3]: 1}
    spec = cdi.claim_spec("c-real", SHARES[1:], directory, files)
    assert [n["path"] for n in edits_of(spec)["deviceNodes"]][0] == "/dev/nvidia3"
    # without the kernel's list (a node the enforcer cannot read it on) the index stands in
    assert cdi.kernel_minors(proc / "missing") == {}


def test_an_optional_driver_node_the_host_lacks_is_left_out_a_required_one_is_named(node, tmp_path):
    directory, files, _ = node
    (tmp_path / "dev" / "nvidia-modeset").unlink()
    (tmp_path / "dev" / "nvidia-uvm").unlink()
    nodes = {n["path"]: n for n in edits_of(cdi.claim_spec("c-real", SHARES, directory, files))["deviceNodes"]}
    assert "/dev/nvidia-modeset" not in nodes
    assert nodes["/dev/nvidia-uvm"] == {"path": "/dev/nvidia-uvm"}  # the runtime fails the container on it
    null = os.stat("/dev/null").st_rdev
    assert (nodes["/dev/nvidia1"]["major"], nodes["/dev/nvidia1"]["minor"]) == (os.major(null), os.minor(null))


def test_the_simulated_driver_gets_the_same_hook_over_its_directory(tmp_path):
    sim = tmp_path / "sim"
    sim.mkdir()
    for lib in cdi.SIM_DRIVER_LIBS:
        (sim / lib).write_bytes(b"\x7fELF")
    directory = ClaimDirs(tmp_path / "state").of("c-sim")
    directory.create(workload_env(SHARES, directory.cache), vgpu_config(SHARES, directory.cache))
    spec = cdi.claim_spec("c-sim", SHARES, directory, cdi.NodeFiles(libvgpu="/l.so", sim_driver_dir=str(sim),
                                                                    cdi_hook=HOOK))
    validate(spec)
    assert spec["cdiVersion"] == "0.3.0"
    edits = edits_of(spec)
    assert edits["hooks"][0]["args"] == ["tessera-cdi-hook", "update-ldcache", "--folder", "/usr/lib",
                                         "--link", "libcuda.so.1::/usr/lib/libcuda.so"]
    assert "deviceNodes" not in edits
    assert dict(e.split("=", 1) for e in edits["env"])["NVIDIA_VISIBLE_DEVICES"] == "void"


def test_the_enforcers_prepare_finds_the_driver_from_its_settings(tmp_path):
    from tessera.enforcer.preparation import Preparation
    from tessera.enforcer.settings import EnforcerSettings

    env = {"TESSERA_NODE": "n", "TESSERA_STATE_DIR": str(tmp_path / "state"), "TESSERA_SIM_DRIVER_DIR": "none",
           "TESSERA_DRIVER_ROOT": str(tmp_path / "driver-root"), "TESSERA_HOST_DRIVER_ROOT": "/",
           "TESSERA_DEV_ROOT": str(tmp_path / "dev"), "TESSERA_CDI_HOOK": HOOK}
    settings = EnforcerSettings.from_env(env)
    preparation = Preparation(settings, ClaimDirs(settings.state_dir))
    gpus = {u: GpuDevice(uuid=u, index=i, model="H100", memory_mib=81920) for i, u in enumerate(UUIDS)}
    # No driver yet (the GPU operator has not installed it): the prepare fails and says why ...
    with pytest.raises(driver.DriverNotFound, match="driver-root"):
        preparation.materialize("c-1", SHARES, gpus)
    # ... and the next one, once the driver is there, finds it.
    install_driver(tmp_path / "driver-root")
    (tmp_path / "dev").mkdir()
    prepared = preparation.materialize("c-1", SHARES, gpus)
    spec = cdi.spec_path(settings.cdi_dir, "c-1")
    assert prepared.cdi_device == "gpu.tessera.dev/gpu=c-1" and spec.exists()
    text = spec.read_text()
    assert f'"/usr/lib64/libcuda.so.{VERSION}"' in text and HOOK in text
    # The node's driver is upgraded under the running enforcer: the next prepare has the new one.
    shutil.rmtree(tmp_path / "driver-root")
    install_driver(tmp_path / "driver-root", version="590.10.01")
    preparation.materialize("c-2", SHARES, gpus)
    text = cdi.spec_path(settings.cdi_dir, "c-2").read_text()
    assert '"/usr/lib64/libcuda.so.590.10.01"' in text and VERSION not in text
