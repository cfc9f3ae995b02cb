"""One directory per claim prepared on this node: the enforcer's memory that survives a restart.

The directory is what a restarted enforcer reads to adopt its workloads (reconcile, don't remember),
and what `tessera run` and libvgpu meet in:

  vgpu.cache   the shared accounting file libvgpu.so maps; its processes must write it, no other
               user may. Two layouts, by whether the enforcer is given the workload's uid:
               host layout (``workload_uid`` given: `tessera run`): the directory 0755, the file
               0600 owned by that uid, so only that uid's processes open it;
               container layout (no uid: Kubernetes, Podman through CDI): the directory the
               enforcer's own, 0700, so no host user can traverse to anything in it, and the file
               0666, so a container of any uid (``runAsUser: 1000``) can write it: the runtime
               resolves the bind mount as root, and inside only that claim's container sees it.
               The enforcer reads usage and process slots from it as hostile input (accounting.py);
               a process that cannot open it gets no memory from libvgpu (fail closed). A container
               gets this file alone, bind-mounted writable at the same path: a mount point cannot be
               removed or renamed over, so a workload cannot swap in a fresh file (a fresh budget)
  vgpu.conf    the claim's limits and cache path as a libvgpu config file (TESSERA_VGPU_CONFIG; in a
               container, mounted read-only as the node config /etc/tessera/vgpu.conf): a source
               libvgpu only lets lower limits, so a workload that raises its own environment
               variables gains nothing, and cannot split its budget by pointing at another cache
  ld.so.preload
               one line, the path at which a container sees libvgpu.so (CONTAINER_LIBVGPU); the CDI
               spec mounts it read-only at /etc/ld.so.preload, so unsetting LD_PRELOAD lifts nothing
  requests/<request>/
               a claim of several requests (a pod's GPU containers) has, instead of its own
               vgpu.cache, vgpu.conf and ld.so.preload, one directory of these per request: each
               container gets its own request's files, limits and budget
  env.json     the environment published in ``prepared``
  kubelet.json (Kubernetes mode) the kubelet plugin's finished prepare of the claim: the devices and
               CDI ids it answered; written last, so its absence marks a prepare that did not finish
  owner.lock   held (flock, shared) by the `tessera run` that owns the claim for as long as it lives;
               the kernel drops it however that process ends, which is how the enforcer knows. Mode
               0644: a flock needs only a read-only descriptor, so nobody needs to write it
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from tessera.shared.errors import ConfigError

from tessera.enforcer.limits import node_config

# Where a container of the claim finds libvgpu.so: the CDI spec mounts it there, the preload file
# names it. Fixed, because the host's path (a checkout, /usr/local/vgpu) means nothing in an image.
CONTAINER_LIBVGPU = "/usr/local/lib/tessera/libvgpu.so"
_GPU_UUID = re.compile(r"GPU-[0-9A-Za-z._-]+")


@dataclass(frozen=True)
class ClaimDir:
    path: Path

    @property
    def claim(self) -> str:
        return self.path.name

    @property
    def cache(self) -> Path:
        return self.path / "vgpu.cache"

    @property
    def config(self) -> Path:
        return self.path / "vgpu.conf"

    @property
    def env_file(self) -> Path:
        return self.path / "env.json"

    @property
    def preload(self) -> Path:
        return self.path / "ld.so.preload"

    @property
    def kubelet_record(self) -> Path:
        return self.path / "kubelet.json"

    @property
    def owner_lock(self) -> Path:
        return self.path / "owner.lock"

    def exists(self) -> bool:
        return self.path.is_dir()

    def request(self, name: str) -> ClaimDir:
        """The directory of one request of a claim of several (a pod's GPU container): its own
        accounting, limits and preload files, so that each container is held to its own limits."""
        return ClaimDir(self.path / "requests" / name)

    def requests(self) -> list[ClaimDir]:
        """The request directories of a claim of several; none for a claim of one."""
        root = self.path / "requests"
        return [ClaimDir(p) for p in sorted(root.iterdir()) if p.is_dir()] if root.is_dir() else []

    def create_holder(self, env: Mapping[str, str]) -> None:
        """Create the directory of a claim of several requests (container layout): what is the whole
        claim's (its environment record, the prepare record); each request's files are its own."""
        self.path.mkdir(parents=True, exist_ok=True)
        os.chmod(self.path, 0o700)
        _write(self.env_file, json.dumps(dict(env), indent=1, sort_keys=True), 0o644)

    def create(self, env: Mapping[str, str], config_text: str, *, workload_uid: int | None = None) -> None:
        """Create (or re-create, keeping an existing accounting file's contents) the claim's files.

        ``workload_uid``: the uid the claim's processes run as on the host (`tessera run`), which
        alone may then write the accounting file; None is the container layout (module docstring)."""
        container = workload_uid is None
        self.path.mkdir(parents=True, exist_ok=True)
        os.chmod(self.path, 0o700 if container else 0o755)
        cache_mode = 0o666 if container else 0o600
        for path, mode in ((self.cache, cache_mode), (self.owner_lock, 0o644)):
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
            try:
                if path == self.cache:  # owner first: a re-created claim may change layout
                    os.fchown(fd, os.geteuid() if workload_uid is None else workload_uid, -1)
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
        _write(self.config, config_text, 0o444)
        _write(self.preload, CONTAINER_LIBVGPU + "\n", 0o444)
        _write(self.env_file, json.dumps(dict(env), indent=1, sort_keys=True), 0o644)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _write(path: Path, text: str, mode: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    tmp.write_text(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


class ClaimDirs:
    """The claim directories under ``<state>/claims``, and the GPUs' priority boards under
    ``<state>/priority``."""

    def __init__(self, root: Path) -> None:
        self.root = root / "claims"
        self.boards = root / "priority"

    def priority_board(self, uuid: str) -> Path:
        """The GPU's priority board (native/vgpu/src/priority.c), created empty if absent: where the
        claims with a runtime priority on that GPU meet. Mode 0666 in a directory of 0711: a container
        of any uid gets it through its bind mount (read-write only for a high-priority claim), and a
        `tessera run` workload opens it by its path, which nobody can list."""
        if not _GPU_UUID.fullmatch(uuid):
            raise ValueError(f"GPU uuid {uuid!r} cannot name a priority board (want GPU-<hex and dashes>)")
        self.boards.mkdir(parents=True, exist_ok=True)
        os.chmod(self.boards, 0o711)
        path = self.boards / f"{uuid}.board"
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        try:
            os.fchmod(fd, 0o666)
        finally:
            os.close(fd)
        return path

    def install_node_config(self, path: Path) -> None:
        """Install libvgpu's node file (host mode) making enforcement mandatory for every CUDA process
        of the host: only a root-owned claim file under our claims directory gives memory."""
        if os.geteuid() != 0:
            raise ConfigError(f"TESSERA_VGPU_NODE_CONFIG={path}: the enforcer must run as root to install it "
                              "(libvgpu trusts only root's claim files, and would refuse every allocation)")
        self.root.mkdir(parents=True, exist_ok=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        _write(path, node_config(self.root.resolve()), 0o644)

    def of(self, claim: str) -> ClaimDir:
        return ClaimDir(self.root / claim)

    def all(self) -> list[ClaimDir]:
        if not self.root.is_dir():
            return []
        return [ClaimDir(p) for p in sorted(self.root.iterdir()) if p.is_dir()]
