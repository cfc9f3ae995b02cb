"""The CDI spec of a prepared claim: what a container runtime must do so enforcement holds inside.

A container runtime (Podman, containerd, CRI-O) given ``--device gpu.tessera.dev/gpu=<name>`` (or a
kubelet plugin's answer naming that id) applies the spec's container edits. The spec is the whole of
what the container gets, as NVIDIA's DRA driver and ``nvidia-ctk cdi generate`` make theirs: no
NVIDIA runtime, runtime hook or ``NVIDIA_VISIBLE_DEVICES`` is needed or honoured. Environment
variables alone enforce nothing in a container: the paths they name do not exist there and a
workload can unset them. So each claim's spec carries

- the device nodes of its GPUs (``/dev/nvidia<minor>``, the minor the kernel driver lists for the
  GPU's UUID, its index where the kernel lists none) and of the driver (``nvidiactl`` and
  ``nvidia-uvm``, without which CUDA cannot start; ``nvidia-uvm-tools`` and ``nvidia-modeset``
  where the host has them), no other GPU's; none on simulated hardware. Type and numbers are read
  under ``NodeFiles.dev_root``, which must be the host's ``/dev`` as the enforcer sees it;
- the driver's user-space files (driver.py: the libraries of the installed version, found from the
  driver root's loader cache, and ``nvidia-smi``), each read-only at its path in the driver root;
  on simulated hardware the simulated ``libcuda.so.1`` and ``libnvidia-ml.so.1`` in ``/usr/lib``;
- a createContainer hook, native/vgpu's ``tessera-cdi-hook update-ldcache``, which runs the
  host's ldconfig inside the container over the libraries' directories (soname links, the loader
  cache, a conf file naming them) and links ``libcuda.so`` to ``libcuda.so.1``: what NVIDIA's
  ``update-ldcache`` and ``create-symlinks`` hooks do, so the libraries load in any glibc image;
- mounts: ``libvgpu.so`` read-only at `CONTAINER_LIBVGPU`; the claim's preload file read-only at
  ``/etc/ld.so.preload`` (the dynamic loader honours it whatever the environment says); the claim's
  limits file read-only at libvgpu's node config path ``/etc/tessera/vgpu.conf`` (libvgpu takes the
  lowest limit over its sources and the cache path from that file first, so raised or unset
  variables lift nothing); the accounting file itself, writable, at its host path (which the
  limits file names; a mounted file cannot be deleted or replaced from inside, so a workload cannot
  start itself a fresh budget); for a claim with a runtime priority, each of its GPUs' priority
  boards at its host path, writable for high priority and read-only for low (so a low-priority
  workload cannot erase a high one's stamp);
- the environment: HAMi's limit variables, the cache path, the visible GPUs by UUID
  (``CUDA_VISIBLE_DEVICES``), ``LD_PRELOAD`` (for tools that look at it),
  ``NVIDIA_VISIBLE_DEVICES=void`` (it replaces whatever the image or the pod set, so an NVIDIA
  runtime on the node injects nothing of its own: a pod that asks for ``all`` gets its claim's
  GPUs and no other), and on simulated hardware the simulated driver's own variables.

``cdiVersion`` is the lowest version whose features the content uses, by the rules of the CDI
specification's version table (the reference library's ``MinimumRequiredVersion``): runtimes with an
older CDI library (Debian's Podman 4.3 reads up to 0.5.0) reject a spec that declares more than they
know. Device nodes by path, mounts without ``type`` and hooks are all 0.3.0 features, so our content
needs 0.3.0 unless a claim id starts with a digit (0.5.0).

Public API (the kubelet plugin's prepare and the enforcer's NATS path both use it):

- ``KIND`` = ``gpu.tessera.dev/gpu``;
- ``device_name(claim) -> str``: the CDI device name of a claim (the claim id where valid);
- ``NodeFiles(libvgpu, sim_driver_dir="", dev_root=Path("/dev"), driver=None, cdi_hook="",
  proc_driver=Path("/proc/driver/nvidia"))``: what this node offers containers (``driver``: the
  real driver's files, driver.find; the simulated driver's come from ``sim_driver_dir``);
- ``claim_spec(claim, shares, directory, node, gpus={}, priority=None) -> dict``: the spec
  (``directory`` created; ``priority``: the claim's ``RuntimePriority``, whose boards it mounts);
- ``requests_spec(claim, [(request, shares, directory)], node, gpus={}, priority=None) -> dict``: the spec of a claim
  of several requests (a pod's GPU containers), one device per request (``request_device_name``),
  each with only its request's GPUs, limits and accounting file;
- ``min_version(spec) -> str``: the minimum ``cdiVersion`` of any spec dict;
- ``device_ids(spec) -> list[str]``: the fully qualified ids (``gpu.tessera.dev/gpu=<name>``);
- ``spec_path(cdi_dir, claim) -> Path``; ``write_spec(cdi_dir, spec, claim=None) -> Path`` (atomic: a temporary
  file in ``cdi_dir`` renamed over the spec, so a runtime never reads half a spec);
  ``remove_spec(cdi_dir, claim) -> bool`` (idempotent: False when there was none).
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from tessera.shared.events import DeviceShare, GpuDevice
from tessera.shared.kubeclaims import DRIVER

from tessera.enforcer import driver as nvdriver
from tessera.enforcer.claimdir import CONTAINER_LIBVGPU, ClaimDir
from tessera.enforcer.driver import CONTAINER_SIM_DRIVER_DIR, SIM_DRIVER_LIBS, DriverFiles  # noqa: F401 (re-exported)
from tessera.enforcer.limits import RuntimePriority, simulated_driver_env, workload_env

VENDOR = DRIVER
CLASS = "gpu"
KIND = f"{VENDOR}/{CLASS}"

# libvgpu's node config path (native/vgpu/src/config.c): read first, its limits are ceilings.
CONTAINER_LIMITS = "/etc/tessera/vgpu.conf"
CONTAINER_PRELOAD = "/etc/ld.so.preload"
# The driver's nodes, shared by all GPUs: CUDA needs the first two; the profiler's and the display
# driver's only where present.
CONTROL_NODES = ("nvidiactl", "nvidia-uvm")
OPTIONAL_NODES = ("nvidia-uvm-tools", "nvidia-modeset")
# What a runtime's NVIDIA hook reads: "void" makes it inject nothing (the spec has it all).
NVIDIA_VISIBLE_DEVICES = "void"
HOOK_NAME = "tessera-cdi-hook"

_READ_ONLY = ["ro", "nosuid", "nodev", "bind"]
_WRITABLE = ["rw", "nosuid", "nodev", "bind"]

# The released spec versions, oldest first, and what first needs each (SPEC.md's version table).
VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
_DEVICE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")


@dataclass(frozen=True)
class NodeFiles:
    """What this node puts into every claim's container, as host paths."""

    libvgpu: str | Path
    # Directory with the simulated libcuda.so.1 and libnvidia-ml.so.1; "" = the real driver.
    sim_driver_dir: str = ""
    dev_root: Path = Path("/dev")
    # The real driver's files (driver.find); None: none are mounted (the simulated driver's are).
    driver: DriverFiles | None = None
    # tessera-cdi-hook, as the host's runtime finds it; "": the libraries are mounted, no hook runs.
    cdi_hook: str | Path = ""
    # The kernel driver's per-GPU information (each GPU UUID's device minor).
    proc_driver: Path = Path("/proc/driver/nvidia")

    @property
    def simulated(self) -> bool:
        return bool(self.sim_driver_dir)

    def driver_files(self) -> DriverFiles | None:
        if self.simulated:
            return nvdriver.simulated(self.sim_driver_dir)
        return self.driver


def device_name(claim: str) -> str:
    """The claim's CDI device name: the claim id itself where the spec allows it as a name.

    Claim ids are subject tokens (letters, digits, '-', '_'), so only a leading or trailing '-'/'_'
    can break the name rule; such an id gets the trimmed id plus a short hash of the whole id, so
    two ids never share a name. Colons (valid in newer libraries) are never produced."""
    if not claim:
        raise ValueError("a claim id is needed to name its CDI device")
    if re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?", claim):
        return claim
    trimmed = re.sub(r"[^A-Za-z0-9_.-]", "-", claim).strip("-_.")
    digest = hashlib.sha256(claim.encode()).hexdigest()[:10]
    return f"{trimmed}-{digest}" if trimmed else f"claim-{digest}"


def request_device_name(claim: str, request: str) -> str:
    """The CDI device name of one request of a claim of several: ``<claim's name>.<request>``."""
    return f"{device_name(claim)}.{request}"


def claim_spec(
    claim: str,
    shares: Sequence[DeviceShare],
    directory: ClaimDir,
    node: NodeFiles,
    gpus: Mapping[str, GpuDevice] | None = None,
    *,
    priority: RuntimePriority | None = None,
) -> dict[str, Any]:
    """The CDI spec of one prepared claim: one device, named after the claim.

    ``directory`` must have been created (its limits, preload and cache files are mounted);
    ``gpus`` (the node's GPUs by UUID) tell the simulated driver what to show."""
    if not shares:
        raise ValueError(f"claim {claim} has no devices: there is nothing to put into a container")
    return _spec([{"name": device_name(claim), "containerEdits": _edits_of(shares, directory, node, gpus, priority)}])


def requests_spec(
    claim: str,
    requests: Sequence[tuple[str, Sequence[DeviceShare], ClaimDir]],
    node: NodeFiles,
    gpus: Mapping[str, GpuDevice] | None = None,
    *,
    priority: RuntimePriority | None = None,
) -> dict[str, Any]:
    """The CDI spec of a prepared claim of several requests: one device per request (its name
    `request_device_name`), each with only its own GPUs, limits and accounting file, so that a
    container given its request's device gets nothing of another's."""
    devices = []
    for request, shares, directory in requests:
        if not shares:
            raise ValueError(f"request {request!r} of claim {claim} has no devices")
        devices.append({"name": request_device_name(claim, request),
                        "containerEdits": _edits_of(shares, directory, node, gpus, priority)})
    if not devices:
        raise ValueError(f"claim {claim} has no requests: there is nothing to put into a container")
    return _spec(devices)


def _spec(devices: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = {"cdiVersion": "", "kind": KIND, "devices": devices}
    spec["cdiVersion"] = min_version(spec)
    return spec


def _edits_of(shares: Sequence[DeviceShare], directory: ClaimDir, node: NodeFiles,
              gpus: Mapping[str, GpuDevice] | None, priority: RuntimePriority | None = None) -> dict[str, Any]:
    """The container edits that give a container these GPU shares, held by ``directory``'s files."""
    env = workload_env(list(shares), directory.cache, libvgpu=CONTAINER_LIBVGPU)
    env["NVIDIA_VISIBLE_DEVICES"] = NVIDIA_VISIBLE_DEVICES
    files = node.driver_files()
    mounts = [_mount(f.host, f.container, _READ_ONLY) for f in (files.libraries + files.binaries)] if files else []
    mounts += [
        _mount(node.libvgpu, CONTAINER_LIBVGPU, _READ_ONLY),
        _mount(directory.preload, CONTAINER_PRELOAD, _READ_ONLY),
        _mount(directory.config, CONTAINER_LIMITS, _READ_ONLY),
        _mount(directory.cache, directory.cache, _WRITABLE),
    ]
    if priority is not None:
        board_options = _WRITABLE if priority.writes_boards else _READ_ONLY
        mounts += [_mount(priority.boards[s.uuid], priority.boards[s.uuid], board_options)
                   for s in sorted(shares, key=lambda s: s.index)]
    nodes: list[dict[str, Any]] = []
    if node.simulated:
        sim = simulated_driver_env(list(shares), gpus or {}, node.sim_driver_dir)
        sim.pop("LD_LIBRARY_PATH")  # a host path; the libraries sit in a default loader directory
        env.update(sim)
    else:
        nodes = gpu_device_nodes(shares, node.dev_root, node.proc_driver)
    edits: dict[str, Any] = {"env": [f"{k}={v}" for k, v in sorted(env.items())]}
    if nodes:
        edits["deviceNodes"] = nodes
    edits["mounts"] = mounts
    if files and files.libraries and node.cdi_hook:
        edits["hooks"] = [ldcache_hook(node.cdi_hook, files)]
    return edits


def ldcache_hook(hook: str | Path, files: DriverFiles) -> dict[str, Any]:
    """The createContainer hook that makes the mounted libraries loadable in the container."""
    args = [HOOK_NAME, "update-ldcache"]
    for folder in files.library_dirs:
        args += ["--folder", folder]
    libcuda = files.libcuda
    if libcuda:
        folder, name = posixpath.split(libcuda.container)
        # The soname link first (ldconfig would make it, but only a link that is there before it
        # runs gets libcuda.so into the cache too), then the development name many programs dlopen:
        # the links NVIDIA's specs create.
        if name != "libcuda.so.1":
            args += ["--link", f"{name}::{folder}/libcuda.so.1"]
        args += ["--link", f"libcuda.so.1::{folder}/libcuda.so"]
    return {"hookName": "createContainer", "path": str(hook), "args": args}


def kernel_minors(proc_driver: Path = Path("/proc/driver/nvidia")) -> dict[str, int]:
    """GPU UUID -> device minor (``/dev/nvidia<minor>``), as the kernel driver lists them in
    ``<proc_driver>/gpus/<PCI address>/information`` (``GPU UUID:`` and ``Device Minor:``); empty
    where there is no driver. The minor is the kernel's numbering, which need not follow NVML's
    index (the claim's), so the node of a GPU is looked up, not computed."""
    minors: dict[str, int] = {}
    try:
        infos = sorted((proc_driver / "gpus").glob("*/information"))
    except OSError:
        return minors
    for path in infos:
        try:
            info = path.read_text()
        except OSError:
            continue
        uuid = re.search(r"^GPU UUID:\s*(\S+)\s*$", info, re.MULTILINE)
        minor = re.search(r"^Device Minor:\s*(\d+)\s*$", info, re.MULTILINE)
        if uuid and minor:
            minors[uuid.group(1)] = int(minor.group(1))
    return minors


def gpu_device_nodes(shares: Sequence[DeviceShare], dev_root: Path = Path("/dev"),
                     proc_driver: Path = Path("/proc/driver/nvidia")) -> list[dict[str, Any]]:
    """Device nodes of the claim's GPUs and the driver's (always named: a missing one must fail the
    container at its start, not leave it running without), then the optional ones the host has.
    Type and numbers are read from the host so that runtimes with an old CDI library need not look
    them up; ``path`` alone keeps the spec at 0.3.0."""
    known = kernel_minors(proc_driver)
    minors = dict.fromkeys(known.get(s.uuid, s.index) for s in sorted(shares, key=lambda s: s.index))
    paths = [dev_root / f"nvidia{minor}" for minor in minors]
    paths += [dev_root / n for n in CONTROL_NODES]
    paths += [p for p in (dev_root / n for n in OPTIONAL_NODES) if p.exists()]
    nodes = []
    for path in paths:
        entry: dict[str, Any] = {"path": f"/dev/{path.name}"}
        try:
            st = path.stat()
        except FileNotFoundError:
            st = None
        if st is not None and (stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)):
            entry.update(type="c" if stat.S_ISCHR(st.st_mode) else "b",
                         major=os.major(st.st_rdev), minor=os.minor(st.st_rdev))
        nodes.append(entry)
    return nodes


def _mount(host: str | Path, container: str | Path, options: list[str]) -> dict[str, Any]:
    # No "type": a bind is said by the options, and "type" alone would raise the spec to 0.4.0.
    return {"hostPath": str(host), "containerPath": str(container), "options": list(options)}


# --- the minimum cdiVersion ---------------------------------------------------------------------


def _edits(spec: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    yield spec.get("containerEdits") or {}
    for device in spec.get("devices") or []:
        yield device.get("containerEdits") or {}


def _needs(spec: Mapping[str, Any], version: str) -> bool:
    devices = spec.get("devices") or []
    edits = list(_edits(spec))
    match version:
        case "1.1.0":
            return any(e.get("netDevices") for e in edits) or any(
                isinstance(e.get("intelRdt"), Mapping)
                and (e["intelRdt"].get("schemata") is not None or e["intelRdt"].get("enableMonitoring"))
                for e in edits)
        case "0.7.0":
            return any(e.get("intelRdt") is not None or e.get("additionalGids") for e in edits)
        case "0.6.0":
            _, slash, cls = str(spec.get("kind", "")).partition("/")
            return bool(spec.get("annotations")) or any(d.get("annotations") for d in devices) \
                or (bool(slash) and "." in cls)
        case "0.5.0":
            return any(str(d.get("name", ""))[:1] in tuple("0123456789") for d in devices) or any(
                n.get("hostPath") for e in edits for n in e.get("deviceNodes") or [])
        case "0.4.0":
            return any(m.get("type") for e in edits for m in e.get("mounts") or [])
    return False  # 1.0.0 and 0.8.0 changed the library only; 0.3.0 is the earliest


def min_version(spec: Mapping[str, Any]) -> str:
    """The lowest ``cdiVersion`` a spec's content needs: the newest version one of whose features it
    uses, 0.3.0 (the earliest the reference library supports) if none."""
    for version in reversed(VERSIONS):
        if _needs(spec, version):
            return version
    return VERSIONS[0]


# --- files in the CDI directory -----------------------------------------------------------------


def device_ids(spec: Mapping[str, Any]) -> list[str]:
    """The fully qualified CDI device ids a spec defines, as a runtime's ``--device`` takes them."""
    return [f"{spec['kind']}={d['name']}" for d in spec.get("devices") or []]


def _file_name(name: str) -> str:
    # The reference library's transient spec name: <vendor>-<class>_<id>, one file per claim.
    return f"{VENDOR}-{CLASS}_{name}.json"


def spec_path(cdi_dir: str | Path, claim: str) -> Path:
    return Path(cdi_dir) / _file_name(device_name(claim))


def write_spec(cdi_dir: str | Path, spec: Mapping[str, Any], claim: str | None = None) -> Path:
    """Write a claim's spec into ``cdi_dir`` atomically and return its path (`spec_path` of
    ``claim``; without it, of the spec's one device's name).

    The temporary file is in the same directory (so the rename is atomic) and ends in ``.tmp``,
    which runtimes ignore (they read ``*.json`` and ``*.yaml`` only)."""
    devices = spec.get("devices") or []
    if spec.get("kind") != KIND or not devices or (claim is None and len(devices) != 1):
        raise ValueError(f"not a claim's spec: kind {spec.get('kind')!r} with {len(devices)} devices "
                         f"(want {KIND} with one device, or one per request given the claim; build it with "
                         "claim_spec or requests_spec)")
    for device in devices:
        if not _DEVICE_NAME.match(device["name"]):
            raise ValueError(f"CDI device name {device['name']!r} is not valid: use device_name(claim)")
    directory = Path(cdi_dir)
    directory.mkdir(parents=True, exist_ok=True)
    target = spec_path(directory, claim) if claim is not None else directory / _file_name(devices[0]["name"])
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{target.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(spec, out, indent=1)
            out.write("\n")
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def remove_spec(cdi_dir: str | Path, claim: str) -> bool:
    """Remove a claim's spec; True if there was one. After this its device id no longer resolves."""
    try:
        spec_path(cdi_dir, claim).unlink()
    except FileNotFoundError:
        return False
    return True
