"""What preparing a claim on this node makes, and unmaking it: one place for both ways in.

A claim reaches the enforcer either as an ``allocated`` event on the bus (a local fleet, `tessera
run`) or as the kubelet's NodePrepareResources (Kubernetes). Both need exactly the same things on
disk — the claim directory with its accounting file and read-only limits file, the workload's
environment, and one CDI spec naming it — so both call ``materialize``; and both undo it with
``remove``. Neither touches the ledger: what is allocated is placement's and the release path's.

On a node with the real driver the spec carries the driver's files (driver.py), looked up under the
driver root at every prepare (a read of its loader cache and one directory: milliseconds), so a
driver installed or upgraded after the enforcer started (the GPU operator's) is what the next
container gets; where none is found the prepare fails with the reason (``DriverNotFound``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping

from tessera.shared.events import DeviceShare, GpuDevice

from tessera.enforcer import cdi, driver
from tessera.enforcer.claimdir import ClaimDir, ClaimDirs
from tessera.enforcer.limits import OWNER_LOCK_VAR, RuntimePriority, simulated_driver_env, vgpu_config, workload_env
from tessera.enforcer.settings import EnforcerSettings


@dataclass(frozen=True)
class Prepared:
    claim: str
    env: dict[str, str]
    directory: ClaimDir
    # The fully qualified CDI device name (``<kind>=<name>``) a runtime is asked to inject (for a
    # claim of several requests, its first request's).
    cdi_device: str
    # A claim of several requests: each request's CDI device id (a container gets its request's).
    cdi_devices: dict[str, str] = field(default_factory=dict)

    def cdi_device_of(self, request: str) -> str:
        """The CDI device id that gives a container the GPUs of ``request`` ("": the claim's one)."""
        return self.cdi_devices[request] if request else self.cdi_device


class Preparation:
    def __init__(self, settings: EnforcerSettings, dirs: ClaimDirs) -> None:
        self.settings = settings
        self.dirs = dirs

    @property
    def node_files(self) -> cdi.NodeFiles:
        """What this node puts into every claim's container now (the real driver looked up afresh)."""
        found = None if self.settings.simulated else driver.find(self.settings.driver_root,
                                                                 self.settings.driver_root_on_host)
        return cdi.NodeFiles(libvgpu=self.settings.libvgpu, sim_driver_dir=self.settings.sim_driver_dir,
                             dev_root=self.settings.dev_root, driver=found, cdi_hook=self.settings.cdi_hook)

    def materialize(self, claim: str, shares: list[DeviceShare], devices: Mapping[str, GpuDevice],
                    *, workload_uid: int | None = None, task_priority: int | None = None) -> Prepared:
        """Write (or rewrite: it is idempotent) the claim's directory and CDI spec.

        ``workload_uid``: the host uid of a `tessera run` workload (the claim's spec carries it);
        None for a claim meant for containers (the kubelet's, or one submitted without it).
        ``task_priority``: the claim's runtime priority (``ClaimSpec.task_priority``, HAMi's
        ``nvidia.com/priority``), written into its limits file with its GPUs' priority boards."""
        node = self.node_files  # first: without a driver nothing is made (DriverNotFound)
        directory = self.dirs.of(claim)
        priority = None if task_priority is None else RuntimePriority(
            task_priority, {s.uuid: self.dirs.priority_board(s.uuid) for s in shares})
        requests = _by_request(shares)
        if requests is None:
            env = self._env(shares, directory, devices)
            directory.create(env, self._limits(shares, directory, priority), workload_uid=workload_uid)
            spec = cdi.claim_spec(claim, shares, directory, node, devices, priority=priority)
            cdi.write_spec(self.settings.cdi_dir, spec)
            return Prepared(claim=claim, env=env, directory=directory, cdi_device=cdi.device_ids(spec)[0])
        # A claim of several requests (a pod's GPU containers): each request its own files and its
        # own CDI device, so each container is held to its own limits and budget.
        parts = [(request, part, directory.request(request)) for request, part in requests.items()]
        envs = {request: self._env(part, where, devices) for request, part, where in parts}
        directory.create_holder(envs[parts[0][0]])
        for request, part, where in parts:
            where.create(envs[request], self._limits(part, where, priority))
        spec = cdi.requests_spec(claim, parts, node, devices, priority=priority)
        cdi.write_spec(self.settings.cdi_dir, spec, claim)
        ids = dict(zip(requests, cdi.device_ids(spec)))
        return Prepared(claim=claim, env=envs[parts[0][0]], directory=directory, cdi_device=ids[parts[0][0]],
                        cdi_devices=ids)

    def _limits(self, shares: list[DeviceShare], directory: ClaimDir, priority: RuntimePriority | None) -> str:
        return vgpu_config(shares, directory.cache, context_overhead_mib=self.settings.vgpu_context_overhead_mib,
                           priority=priority)

    def _env(self, shares: list[DeviceShare], directory: ClaimDir, devices: Mapping[str, GpuDevice]) -> dict[str, str]:
        env = workload_env(shares, directory.cache, libvgpu=self.settings.libvgpu)
        env["TESSERA_VGPU_CONFIG"] = str(directory.config)
        env[OWNER_LOCK_VAR] = str(directory.owner_lock)
        if self.settings.simulated:
            env.update(simulated_driver_env(shares, devices, self.settings.sim_driver_dir))
        return env

    def remove(self, claim: str) -> None:
        """Remove the claim's CDI spec and directory; idempotent. The spec goes first: from then on
        its device id no longer resolves, so no container can start on a half-removed claim."""
        cdi.remove_spec(self.settings.cdi_dir, claim)
        self.dirs.of(claim).remove()

    def present(self, claim: str) -> bool:
        return self.dirs.of(claim).exists() and cdi.spec_path(self.settings.cdi_dir, claim).exists()


_REQUEST = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


def _by_request(shares: list[DeviceShare]) -> dict[str, list[DeviceShare]] | None:
    """The shares of a claim of several requests by request, in the order they come; None for a
    claim of one (its shares name no request)."""
    if not any(s.request for s in shares):
        return None
    requests: dict[str, list[DeviceShare]] = {}
    for share in shares:
        if not share.request:
            raise ValueError("a claim's shares must all name their request, or none")
        if not _REQUEST.fullmatch(share.request):  # (a directory and a CDI device are named after it)
            raise ValueError(f"request name {share.request!r} is not a DNS label")
        requests.setdefault(share.request, []).append(share)
    return requests
