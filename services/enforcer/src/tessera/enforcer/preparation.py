"""What preparing a claim on this node makes, and unmaking it: one place for both ways in.

A claim reaches the enforcer either as an ``allocated`` event on the bus (a local fleet, `tessera
run`) or as the kubelet's NodePrepareResources (Kubernetes). Both need exactly the same things on
disk — the claim directory with its accounting file and read-only limits file, the workload's
environment, and one CDI spec naming it — so both call ``materialize``; and both undo it with
``remove``. Neither touches the ledger: what is allocated is placement's and the release path's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from tessera.shared.events import DeviceShare, GpuDevice

from tessera.enforcer import cdi
from tessera.enforcer.claimdir import ClaimDir, ClaimDirs
from tessera.enforcer.limits import OWNER_LOCK_VAR, simulated_driver_env, vgpu_config, workload_env
from tessera.enforcer.settings import EnforcerSettings


@dataclass(frozen=True)
class Prepared:
    claim: str
    env: dict[str, str]
    directory: ClaimDir
    # The fully qualified CDI device name (``<kind>=<name>``) a runtime is asked to inject.
    cdi_device: str


class Preparation:
    def __init__(self, settings: EnforcerSettings, dirs: ClaimDirs) -> None:
        self.settings = settings
        self.dirs = dirs
        self.node_files = cdi.NodeFiles(libvgpu=settings.libvgpu, sim_driver_dir=settings.sim_driver_dir)

    def materialize(self, claim: str, shares: list[DeviceShare], devices: Mapping[str, GpuDevice],
                    *, workload_uid: int | None = None) -> Prepared:
        """Write (or rewrite: it is idempotent) the claim's directory and CDI spec.

        ``workload_uid``: the host uid of a `tessera run` workload (the claim's spec carries it);
        None for a claim meant for containers (the kubelet's, or one submitted without it)."""
        directory = self.dirs.of(claim)
        env = workload_env(shares, directory.cache, libvgpu=self.settings.libvgpu)
        env["TESSERA_VGPU_CONFIG"] = str(directory.config)
        env[OWNER_LOCK_VAR] = str(directory.owner_lock)
        if self.settings.simulated:
            env.update(simulated_driver_env(shares, devices, self.settings.sim_driver_dir))
        directory.create(env, vgpu_config(shares, directory.cache), workload_uid=workload_uid)
        spec = cdi.claim_spec(claim, shares, directory, self.node_files, devices)
        cdi.write_spec(self.settings.cdi_dir, spec)
        return Prepared(claim=claim, env=env, directory=directory, cdi_device=cdi.device_ids(spec)[0])

    def remove(self, claim: str) -> None:
        """Remove the claim's CDI spec and directory; idempotent. The spec goes first: from then on
        its device id no longer resolves, so no container can start on a half-removed claim."""
        cdi.remove_spec(self.settings.cdi_dir, claim)
        self.dirs.of(claim).remove()

    def present(self, claim: str) -> bool:
        return self.dirs.of(claim).exists() and cdi.spec_path(self.settings.cdi_dir, claim).exists()
