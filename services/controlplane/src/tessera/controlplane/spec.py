"""The TenantControlPlane: what a tenant asked for (spec) and what the manager observed (status).

The spec is user input (CLI, request/reply, a Kubernetes custom resource), so it forbids unknown
fields and names the offending field on any error. Field names are camelCase on the wire so that the
same document is valid as the ``spec`` of the TenantControlPlane custom resource
(deploy/k8s/crds/tenantcontrolplanes.yaml mirrors these Structs; a test keeps the two in step).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct, field

from tessera.shared.api import describe_validation_error
from tessera.shared.events import GpuQuota, TenantName, now
from tessera.shared.ledger import ceiling

SizeClass = Literal["small", "medium", "large"]
Phase = Literal["Provisioning", "Ready", "NotReady", "Upgrading", "Deleting"]
Driver = Literal["nats", "postgres", "etcd"]
ServiceType = Literal["ClusterIP", "NodePort", "LoadBalancer"]

KubernetesVersion = Annotated[str, Meta(pattern=r"^v1\.(2[89]|3[0-9])\.[0-9]+$")]
Cidr = Annotated[str, Meta(min_length=1, max_length=43)]
SubjectAltName = Annotated[str, Meta(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9.:*-]+$")]


class SpecError(ValueError):
    """Invalid spec; ``field`` is the dotted path of the offending field (e.g. spec.network.port)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class _Spec(Struct, forbid_unknown_fields=True, kw_only=True, rename="camel", frozen=True):
    """Base of every spec document: camelCase names, unknown fields rejected.
    (Each subclass says ``frozen=True`` again, which msgspec inherits anyway: mypy reads a subclass
    without it as a mutable one.)"""


class Amount(_Spec, frozen=True):
    cpu_millis: Annotated[int, Meta(ge=10, le=64000)]
    memory_mib: Annotated[int, Meta(ge=16, le=262144)]


class Resources(_Spec, frozen=True):
    requests: Amount
    limits: Amount


class ComponentResources(_Spec, frozen=True):
    """Explicit per-component resources; any component left out is filled from the size class."""

    api_server: Resources | None = None
    controller_manager: Resources | None = None
    scheduler: Resources | None = None
    datastore_shim: Resources | None = None


class KubernetesSpec(_Spec, frozen=True):
    version: KubernetesVersion = "v1.33.1"
    replicas: Annotated[int, Meta(ge=1, le=5)] = 2


class NetworkProfile(_Spec, frozen=True):
    service_type: ServiceType = "ClusterIP"
    address: str = ""  # the advertised address; empty: the Service's cluster DNS name
    port: Annotated[int, Meta(ge=1, le=65535)] = 6443
    cert_sans: list[SubjectAltName] = []
    service_cidr: Cidr = "10.96.0.0/16"
    pod_cidr: Cidr = "10.244.0.0/16"
    # Addresses of the tenant's own worker nodes: the only clients besides the platform that the
    # NetworkPolicy admits to the tenant's API server.
    node_cidrs: list[Cidr] = []


class DatastoreRef(_Spec, frozen=True):
    driver: Driver = "nats"


class GpuAmountSpec(_Spec, frozen=True):
    """GPUs, GPU memory and GPU cores; a field left out means unlimited in that dimension."""

    gpus: Annotated[int, Meta(ge=0, le=100000)] | None = None
    memory_mib: Annotated[int, Meta(ge=0)] | None = None
    cores: Annotated[int, Meta(ge=0)] | None = None

    def to_quota(self) -> GpuQuota:
        return GpuQuota(gpus=self.gpus, memory_mib=self.memory_mib, cores=self.cores)


class QuotaSpec(GpuAmountSpec, frozen=True):
    """GPU quota: what the tenant is guaranteed. With ``borrowingLimit`` it may hold that much
    more while the fleet has idle capacity, preemptible by tenants reclaiming their own guarantee
    (left out: no borrowing, the quota is a hard wall); ``weight`` decides which of several
    borrowers goes first (the lowest share borrowed over weight)."""

    borrowing_limit: GpuAmountSpec | None = None
    weight: Annotated[int, Meta(ge=1, le=1000)] = 1

    def borrowing(self) -> GpuQuota | None:
        return None if self.borrowing_limit is None else self.borrowing_limit.to_quota()

    def ceiling(self) -> GpuQuota:
        """The most the tenant may hold at once, as placement admits it (`tessera.shared.ledger.ceiling`)."""
        return ceiling(self.to_quota(), self.borrowing())

    def with_quota(self, quota: GpuQuota) -> "QuotaSpec":
        """This spec with its guarantee replaced by ``quota`` (its borrowing kept)."""
        return msgspec.structs.replace(self, gpus=quota.gpus, memory_mib=quota.memory_mib, cores=quota.cores)


class TenantControlPlaneSpec(_Spec, frozen=True):
    kubernetes: KubernetesSpec = KubernetesSpec()
    size: SizeClass = "small"
    resources: ComponentResources = ComponentResources()
    network: NetworkProfile = NetworkProfile()
    datastore: DatastoreRef = DatastoreRef()
    quota: QuotaSpec = QuotaSpec()


ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(Struct, kw_only=True, rename="camel"):
    """A Kubernetes-style status condition (``Ready``, ``Valid``) of a TenantControlPlane object."""

    type: str
    status: ConditionStatus
    reason: str = ""
    message: str = ""
    observed_generation: int = 0
    last_transition_time: str = ""  # RFC 3339, as kubectl shows it


class TenantControlPlaneStatus(Struct, kw_only=True, rename="camel"):
    """Observed state; written only by the manager."""

    phase: Phase = "Provisioning"
    reason: str = ""
    message: str = ""
    observed_generation: int = 0
    endpoint: str = ""
    datastore: str = ""  # the tenant's bucket / database / key prefix
    certificates_not_after: float = 0.0
    last_transition: float = field(default_factory=now)
    gpu_pods: str = ""  # Kubernetes mode: the tenant's pod syncer (Syncing, Starting, Failed: why)
    wake_seconds: float = 0.0  # the last wake: from `tessera tenant wake` until Ready again
    # Only on the TenantControlPlane object (the status subresource): Ready, and Valid naming the
    # field of a spec the manager refused.
    conditions: list[Condition] = []


class ResourceRef(Struct, kw_only=True, frozen=True):
    """The TenantControlPlane object a tenant was created from (Kubernetes mode)."""

    namespace: str
    name: str
    uid: str


class TenantControlPlane(Struct, kw_only=True, rename="camel"):
    """One record of the ``controlplanes`` bucket: the desired spec and the last observed status."""

    name: TenantName
    uid: str
    generation: int = 1
    spec: TenantControlPlaneSpec = TenantControlPlaneSpec()
    status: TenantControlPlaneStatus = field(default_factory=TenantControlPlaneStatus)
    deleting: bool = False
    created: float = field(default_factory=now)
    # Set when a TenantControlPlane object owns the tenant: its deletion deletes the tenant.
    resource: ResourceRef | None = None
    # Put to sleep (`tessera tenant sleep`, the idle timeout): its Deployment is rendered with zero
    # replicas until a wake. Not part of the spec: sleeping changes no generation and is no object's
    # to undo. ``waking_since``: when a wake was asked for, until the tenant is Ready again.
    asleep: bool = False
    waking_since: float = 0.0


class _NameOnly(Struct, forbid_unknown_fields=True):
    name: TenantName


def check_name(name: str) -> str:
    try:
        msgspec.convert({"name": name}, _NameOnly)
    except msgspec.ValidationError:
        raise SpecError(
            f"tenant name {name!r} is invalid: use 1-32 lowercase letters, digits and '-',"
            " starting and ending with a letter or digit",
            "name",
        ) from None
    return name


def parse_spec(document: dict | None, quota: GpuQuota | None = None) -> TenantControlPlaneSpec:
    """Validate a spec document (camelCase); ``quota`` (the request's own field) overrides spec.quota."""
    try:
        spec = msgspec.convert(document or {}, TenantControlPlaneSpec)
    except msgspec.ValidationError as exc:
        message, path = describe_validation_error(exc)
        path = path.removeprefix("$").lstrip(".")
        raise SpecError(message, f"spec.{path}" if path else "spec") from None
    if quota is not None:
        spec = msgspec.structs.replace(spec, quota=spec.quota.with_quota(quota))
    _check_semantics(spec)
    return spec


def _check_semantics(spec: TenantControlPlaneSpec) -> None:
    """What a schema cannot say: CIDRs parse, ranges do not overlap, limits cover requests, a
    borrowing limit has a quota to borrow beyond."""
    quota = spec.quota
    if quota.borrowing_limit is not None and all(v is None for v in (quota.gpus, quota.memory_mib, quota.cores)):
        raise SpecError("a borrowing limit needs a quota to borrow beyond (a tenant without one has no ceiling): "
                        "set quota gpus, memoryMib or cores, or leave borrowingLimit out", "spec.quota.borrowingLimit")
    nets = {}
    for name in ("service_cidr", "pod_cidr"):
        nets[name] = _network(getattr(spec.network, name), f"spec.network.{_camel(name)}")
    if nets["service_cidr"].overlaps(nets["pod_cidr"]):
        raise SpecError("serviceCidr and podCidr overlap; choose disjoint ranges", "spec.network.podCidr")
    for i, cidr in enumerate(spec.network.node_cidrs):
        _network(cidr, f"spec.network.nodeCidrs[{i}]")
    if spec.network.address:
        _host(spec.network.address, "spec.network.address")
    for component in ("api_server", "controller_manager", "scheduler", "datastore_shim"):
        res: Resources | None = getattr(spec.resources, component)
        if res is None:
            continue
        where = f"spec.resources.{_camel(component)}.limits"
        if res.limits.cpu_millis < res.requests.cpu_millis:
            raise SpecError("limits.cpuMillis must be >= requests.cpuMillis", f"{where}.cpuMillis")
        if res.limits.memory_mib < res.requests.memory_mib:
            raise SpecError("limits.memoryMib must be >= requests.memoryMib", f"{where}.memoryMib")


_HOSTNAME = re.compile(r"^(?=.{1,253}$)[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$")


def _host(value: str, where: str) -> None:
    try:
        ipaddress.ip_address(value)
        return
    except ValueError:
        pass
    if not _HOSTNAME.match(value):
        raise SpecError(f"{value!r} is neither an IP address nor a DNS name", where)


def _network(value: str, where: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    try:
        return ipaddress.ip_network(value, strict=True)
    except ValueError as exc:
        raise SpecError(f"{value!r} is not a CIDR block ({exc})", where) from None


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)
