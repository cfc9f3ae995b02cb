"""Fleet profiles: the simulated hardware that `make up` and the tests run on (a shared format:
the capacity publisher announces it, the CLI starts one enforcer per node it names).

A profile is a YAML file describing nodes and their GPUs (model, memory MiB, SM count, UUIDs). It is
user input, so unknown keys are errors and every error names its path (``$.groups[0].memory_mib``).
Groups expand to numbered nodes with stable, deterministic GPU UUIDs, so a restart of the publisher
re-announces exactly the same fleet.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Annotated, TypedDict

import msgspec
from msgspec import Meta, Struct

from tessera.shared.errors import ConfigError
from tessera.shared.events import GpuDevice, NodeInventory

_UUID_NS = uuid.UUID("6f1c0c3e-7a7e-4b8e-9a57-2d0f3b9c1e11")


class ProfileError(ConfigError):
    """The profile file is unreadable or describes an impossible fleet; the message says where."""


# What a simulated GPU may say about itself beyond its size (the attributes DRA users select on);
# left out, the capacity publisher leaves them out of the ResourceSlice, as for a GPU NVML cannot read.
Architecture = Annotated[str, Meta(pattern=r"^[A-Za-z][A-Za-z0-9 _-]{0,31}$")]
ComputeCapability = Annotated[str, Meta(pattern=r"^[0-9]{1,2}\.[0-9]{1,2}$")]
DriverVersion = Annotated[str, Meta(pattern=r"^[0-9]{1,4}(\.[0-9]{1,4}){1,2}$")]
PciBusId = Annotated[str, Meta(pattern=r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")]


class GpuFacts(Struct, forbid_unknown_fields=True, kw_only=True):
    architecture: Architecture | None = None
    compute_capability: ComputeCapability | None = None
    driver_version: DriverVersion | None = None


class GpuSpec(GpuFacts, forbid_unknown_fields=True, kw_only=True):
    model: str
    memory_mib: Annotated[int, Meta(gt=0)]
    sm_count: Annotated[int, Meta(gt=0)] = 132
    uuid: str | None = None
    max_shares: Annotated[int, Meta(ge=1, le=64)] = 10
    pci_bus_id: PciBusId | None = None
    # A simulated GPU that fails (false) or recovers: the capacity publisher reads it again when
    # the file changes.
    healthy: bool = True


class NodeGroup(GpuFacts, forbid_unknown_fields=True, kw_only=True):
    """``nodes`` identical nodes named ``<prefix>-<i>`` with ``gpus`` cards each."""

    prefix: Annotated[str, Meta(pattern=r"^[a-z0-9]([a-z0-9-]{0,40}[a-z0-9])?$")]
    nodes: Annotated[int, Meta(ge=1, le=100000)]
    gpus: Annotated[int, Meta(ge=0, le=16)]
    model: str
    memory_mib: Annotated[int, Meta(gt=0)]
    sm_count: Annotated[int, Meta(gt=0)] = 132
    max_shares: Annotated[int, Meta(ge=1, le=64)] = 10
    cpu_millis: Annotated[int, Meta(ge=0)] = 64000
    host_memory_mib: Annotated[int, Meta(ge=0)] = 262144
    labels: dict[str, str] = {}


class NodeSpec(Struct, forbid_unknown_fields=True, kw_only=True):
    name: Annotated[str, Meta(pattern=r"^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$")]
    gpus: list[GpuSpec]
    cpu_millis: Annotated[int, Meta(ge=0)] = 64000
    host_memory_mib: Annotated[int, Meta(ge=0)] = 262144
    labels: dict[str, str] = {}


class Profile(Struct, forbid_unknown_fields=True, kw_only=True):
    groups: list[NodeGroup] = []
    nodes: list[NodeSpec] = []


def gpu_uuid(node: str, index: int) -> str:
    return f"GPU-{uuid.uuid5(_UUID_NS, f'{node}/{index}')}"


class _Facts(TypedDict):
    """`GpuDevice`'s descriptive fields, as keyword arguments."""
    architecture: str
    compute_capability: str
    driver_version: str


def _facts(gpu: GpuFacts) -> _Facts:
    return {"architecture": gpu.architecture or "", "compute_capability": gpu.compute_capability or "",
            "driver_version": gpu.driver_version or ""}


def expand(profile: Profile) -> list[NodeInventory]:
    out: list[NodeInventory] = []
    for group in profile.groups:
        for i in range(group.nodes):
            name = f"{group.prefix}-{i}"
            devices = [
                GpuDevice(
                    uuid=gpu_uuid(name, g), index=g, model=group.model, memory_mib=group.memory_mib,
                    sm_count=group.sm_count, max_shares=group.max_shares, **_facts(group),
                )
                for g in range(group.gpus)
            ]
            out.append(NodeInventory(node=name, devices=devices, labels=dict(group.labels),
                                     cpu_millis=group.cpu_millis, host_memory_mib=group.host_memory_mib))
    for node in profile.nodes:
        devices = [
            GpuDevice(uuid=g.uuid or gpu_uuid(node.name, i), index=i, model=g.model, memory_mib=g.memory_mib,
                      sm_count=g.sm_count, max_shares=g.max_shares, pci_bus_id=g.pci_bus_id or "", healthy=g.healthy,
                      **_facts(g))
            for i, g in enumerate(node.gpus)
        ]
        out.append(NodeInventory(node=node.name, devices=devices, labels=dict(node.labels),
                                 cpu_millis=node.cpu_millis, host_memory_mib=node.host_memory_mib))
    names = [n.node for n in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ProfileError(f"node names appear twice: {', '.join(dupes)}; give each group its own prefix")
    uuids = [d.uuid for n in out for d in n.devices]
    if len(set(uuids)) != len(uuids):
        raise ProfileError("a GPU UUID appears twice in the profile; UUIDs must be unique across the fleet")
    return out


def parse(text: str | bytes, source: str = "profile") -> list[NodeInventory]:
    try:
        profile = msgspec.yaml.decode(text, type=Profile)
    except msgspec.ValidationError as exc:
        raise ProfileError(f"{source}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProfileError(f"{source}: not valid YAML: {exc}") from None
    nodes = expand(profile)
    if not nodes:
        raise ProfileError(f"{source}: the profile describes no nodes; add a 'groups' or 'nodes' entry")
    return nodes


def load(path: str | Path) -> list[NodeInventory]:
    p = Path(path)
    try:
        text = p.read_bytes()
    except OSError as exc:
        raise ProfileError(f"cannot read profile {p}: {exc.strerror}") from None
    return parse(text, str(p))
