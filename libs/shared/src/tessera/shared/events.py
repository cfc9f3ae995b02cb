"""The messages of the bus, defined once.

Every event that crosses NATS is one of these msgspec Structs, JSON on the wire so that outside tools
can read it. Each subject family has one tagged union (``kind`` is the tag) and one decoder built once
per process. Evolution rule: a new field always has a default, a field's type never changes, readers
skip unknown fields (no ``forbid_unknown_fields`` here; that is for config files and CLI input).

Adding an event to a family is one place, this module: a subclass of its family's base (a claim
event of `ClaimEventBase`, which carries ``claim`` and ``tenant``) with its own ``tag``, written into
the family's union below. The family's decoder, `kinds`, the AsyncAPI document's messages and the
lists the tests draw from all follow from the union; then `make docs` regenerates docs/asyncapi.json
(tests/shared/test_event_registry.py fails when a declared event is in no union, and
tests/shared/test_asyncapi_current.py when the document or the README's subjects table is stale).
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct, field

from tessera.shared.kubeclaims import KubeClaimRef
from tessera.shared.podconstraints import PodConstraints

# --- shared value types -------------------------------------------------------------------------

NodeName = Annotated[str, Meta(pattern=r"^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$", max_length=63)]
TenantName = Annotated[str, Meta(pattern=r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$", max_length=32)]
ClaimId = Annotated[str, Meta(pattern=r"^[a-z0-9]([a-z0-9-]{0,62}[a-z0-9])?$", max_length=64)]
Percent = Annotated[int, Meta(ge=0, le=100)]
# A DRA device request's name (a DNS label): on Kubernetes, the GPU container it is for.
RequestName = Annotated[str, Meta(pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$", max_length=63)]
# A POSIX uid; (uid_t)-1 is "no change" to chown, so never a value.
Uid = Annotated[int, Meta(ge=0, le=2**32 - 2)]
Policy = Literal["binpack", "spread", "fragmentation-aware", "best-fit"]


def now() -> float:
    return time.time()


class Event(Struct, tag_field="kind", kw_only=True):
    """Base of every bus event: the ``kind`` field names the variant within its subject family."""


def members(union: object) -> tuple[type[Event], ...]:
    """The event types of a family's union (a family of one type is that type), in its order."""
    return tuple(getattr(union, "__args__", (union,)))


def kinds(union: object) -> tuple[str, ...]:
    """The ``kind`` of each event of a family's union, in its order: what its subjects' event token,
    its decoder and the AsyncAPI document name."""
    return tuple(str(t.__struct_config__.tag) for t in members(union))


class GpuDevice(Struct, frozen=True, kw_only=True):
    """One physical GPU as the capacity publisher sees it."""

    uuid: str
    index: int
    model: str
    memory_mib: Annotated[int, Meta(gt=0)]
    sm_count: Annotated[int, Meta(gt=0)] = 132
    # How many claims may share this GPU at once (HAMi's deviceSplitCount).
    max_shares: Annotated[int, Meta(ge=1)] = 10
    healthy: bool = True
    # What DRA users select on, where discovery knows it ("" = unknown, left out of the slice):
    # NVML's architecture name ("Hopper"), CUDA compute capability ("9.0"), the kernel driver's
    # version ("580.65.06") and the PCI bus id ("00000000:17:00.0").
    architecture: str = ""
    compute_capability: str = ""
    driver_version: str = ""
    pci_bus_id: str = ""


class DeviceShare(Struct, frozen=True, kw_only=True):
    """The part of one GPU given to one claim: the unit of the ledger."""

    uuid: str
    index: int
    memory_mib: int
    cores: Percent  # SM share in percent; 100 means exclusive use
    # The claim's request this share answers, where the claim has several (`ClaimSpec.requests`:
    # one per GPU container of a pod); "" for a claim of one request. Two requests of one claim may
    # share a GPU, each with its own share.
    request: str = ""


# --- inventory: tessera.inventory.<node> ---------------------------------------------------------


class NodeInventory(Event, tag="inventory"):
    node: NodeName
    devices: list[GpuDevice]
    labels: dict[str, str] = {}
    cpu_millis: int = 0
    host_memory_mib: int = 0
    generation: int = 0
    ts: float = field(default_factory=now)


class NodeHeartbeat(Event, tag="heartbeat"):
    node: NodeName
    seq: int = 0
    ts: float = field(default_factory=now)


class NodeLost(Event, tag="lost"):
    node: NodeName
    last_seen: float
    reason: str = "heartbeat stopped"
    ts: float = field(default_factory=now)


InventoryEvent = NodeInventory | NodeHeartbeat | NodeLost


# --- claims: tessera.claims.<tenant>.<claim>.<event>.<node> --------------------------------------


# The largest scheduling priority: Kubernetes' (a PriorityClass value is an int32; user-defined
# classes go up to 1,000,000,000, the system ones to 2,000,001,000).
MAX_PRIORITY = 2**31 - 1


class RequestSpec(Struct, frozen=True, kw_only=True):
    """One request of a claim that has several: the GPUs one container of a pod asks for.

    The GPU part of a `ClaimSpec` under a name; what is the pod's (priority, policies, CPU, host
    memory, a node pin) stays on the claim."""

    name: RequestName
    gpus: Annotated[int, Meta(ge=1, le=16)] = 1
    memory_mib: Annotated[int, Meta(ge=1)] | None = None
    memory_percent: Annotated[int, Meta(ge=1, le=100)] | None = None
    cores: Percent = 0
    use_types: list[str] = []
    nouse_types: list[str] = []
    use_uuids: list[str] = []
    nouse_uuids: list[str] = []


class ClaimSpec(Struct, frozen=True, kw_only=True):
    """What a claim asks for, already validated and normalised by the translator.

    A claim is one request (the GPU fields below) or, with ``requests``, several placed together
    on one node, all or none: a Kubernetes pod with several GPU containers is one claim with one
    request per container. Then ``requests`` is the whole GPU demand and the GPU fields below
    repeat its first request, for readers that predate it (`request_specs` reads both forms)."""

    gpus: Annotated[int, Meta(ge=1, le=16)] = 1
    # Exactly one of memory_mib / memory_percent is set by the translator; neither means "whole card".
    memory_mib: Annotated[int, Meta(ge=1)] | None = None
    memory_percent: Annotated[int, Meta(ge=1, le=100)] | None = None
    cores: Percent = 0  # 0: no SM limit (shares the card); 100: exclusive
    use_types: list[str] = []
    nouse_types: list[str] = []
    use_uuids: list[str] = []
    nouse_uuids: list[str] = []
    node_policy: Policy | None = None  # None: the placement service's default
    gpu_policy: Policy | None = None
    # The scheduling priority. Larger = more important (the Kubernetes convention, on Kubernetes the
    # pod's PriorityClass value, `spec.priority`; a negative one counts as 0). Orders the waiting
    # queue, and a claim that fits nowhere may preempt preemptible claims of strictly lower
    # priority (`preemption`). Not HAMi's ``nvidia.com/priority``: that is ``task_priority``.
    priority: Annotated[int, Meta(ge=0, le=MAX_PRIORITY)] = 0
    # False: never preempted, whatever asks.
    preemptible: bool = True
    # False: never preempts, however high its priority; it waits like a claim of priority 0 would
    # (on Kubernetes a PriorityClass with ``preemptionPolicy: Never``, the pod's
    # ``spec.preemptionPolicy``).
    may_preempt: bool = True
    # HAMi's runtime priority (``nvidia.com/priority``, HAMi-core's ``CUDA_TASK_PRIORITY``): 0 high,
    # 1 low; None unset (HAMi-core then reads 1). It says how the claim's processes share a GPU's
    # SMs with others at run time, never where or before whom the claim is placed.
    task_priority: Annotated[int, Meta(ge=0, le=1)] | None = None
    cpu_millis: Annotated[int, Meta(ge=0)] = 0
    host_memory_mib: Annotated[int, Meta(ge=0)] = 0
    # Pin to one node (tessera run asks for the node it runs on).
    node: NodeName | None = None
    # The host uid a `tessera run` workload runs as: the enforcer makes the claim's accounting file
    # writable by it alone (docs/isolation-host-mode.md). None: a claim for containers.
    workload_uid: Uid | None = None
    # Kubernetes mode: what kube-scheduler's node filters read of the claim's pod (its node selector
    # and required affinity, tolerations, resource requests), read by the translator when the claim
    # is requested: placement places only where the scheduler can then bind the pod. None: not known
    # (no pod, or a claim that is not a ResourceClaim's), and no node is ruled out for it.
    pod: PodConstraints | None = None
    # Several requests placed together (see above); empty: the claim is one request.
    requests: list[RequestSpec] = []


_REQUEST_FIELDS = ("gpus", "memory_mib", "memory_percent", "cores", "use_types", "nouse_types", "use_uuids",
                   "nouse_uuids")


def request_specs(spec: ClaimSpec) -> list[tuple[str, ClaimSpec]]:
    """The claim's requests, each as a claim of one request: ``[("", spec)]`` for a claim of one
    request; for one of several, each request's GPU part with the claim's own fields, the CPU and
    host memory counted once (on the first). ValueError for request names used twice."""
    if not spec.requests:
        return [("", spec)]
    names = [r.name for r in spec.requests]
    if len(set(names)) != len(names):
        raise ValueError(f"the claim's requests must have distinct names, got {names}")
    parts = []
    for i, request in enumerate(spec.requests):
        gpu = {f: getattr(request, f) for f in _REQUEST_FIELDS}
        rest = {} if i == 0 else {"cpu_millis": 0, "host_memory_mib": 0}
        parts.append((request.name, msgspec.structs.replace(spec, requests=[], **gpu, **rest)))
    return parts


class ClaimEventBase(Event):
    """Base of the claim family: every claim event names its claim and the tenant that owns it.

    Inheriting keeps the wire format: msgspec puts a base's fields first, and ``claim`` and
    ``tenant`` were already every claim event's first two fields (and a JSON object's keys are
    matched by name when decoded anyway). Code that holds any claim event reads ``event.claim``."""

    claim: ClaimId
    tenant: TenantName


class ClaimRequested(ClaimEventBase, tag="requested"):
    spec: ClaimSpec
    source: str = "api"
    # Revision of the claim's record in the ``claims`` bucket when this was published (0: unknown).
    # Placement writes the outcome with compare-and-set against it, skipping a read.
    record_revision: int = 0
    # Kubernetes mode: the ResourceClaim this claim stands for (placement writes its status).
    kube: KubeClaimRef | None = None
    ts: float = field(default_factory=now)


class ClaimAllocated(ClaimEventBase, tag="allocated"):
    node: NodeName
    devices: list[DeviceShare]
    spec: ClaimSpec = ClaimSpec()
    ts: float = field(default_factory=now)


class ClaimDeallocated(ClaimEventBase, tag="deallocated"):
    """Kubernetes mode: the allocation placement wrote into the claim's ResourceClaim was removed by
    someone else (kube-scheduler's PostFilter, when it cannot bind the pod there) while the pod is
    still waiting. Published by the translator, which watches the claims, on the node the allocation
    named; placement takes the claim off that node and places it again (the pod is never left with
    no allocation). ``pod``: the pod's constraints as they are now (they may have been tightened)."""

    node: NodeName
    pod: PodConstraints | None = None
    kube: KubeClaimRef | None = None
    ts: float = field(default_factory=now)


class ClaimUnschedulable(ClaimEventBase, tag="unschedulable"):
    reason: str
    # constraint name -> number of nodes it ruled out, e.g. {"memory": 5, "gpu-type": 1}
    filtered: dict[str, int] = {}
    # A preempting claim's nomination (as its record holds it), so that every placement replica
    # holds the room its victims free for it at once.
    nominated: Nomination | None = None
    ts: float = field(default_factory=now)


class ClaimPrepared(ClaimEventBase, tag="prepared"):
    node: NodeName
    env: dict[str, str]
    cache_path: str = ""
    cdi_device: str = ""
    ts: float = field(default_factory=now)


class ClaimRunning(ClaimEventBase, tag="running"):
    node: NodeName
    pids: list[int] = []
    ts: float = field(default_factory=now)


class ClaimReleaseRequested(ClaimEventBase, tag="release"):
    reason: str = "requested"
    ts: float = field(default_factory=now)


class ClaimReleased(ClaimEventBase, tag="released"):
    node: str = ""
    reason: str = "requested"
    ts: float = field(default_factory=now)


class ClaimFailed(ClaimEventBase, tag="failed"):
    reason: str
    node: str = ""
    ts: float = field(default_factory=now)


class ClaimViolation(ClaimEventBase, tag="violation"):
    """A process of the claim had the GPU open without libvgpu in force, and the node's enforcer
    killed it (services/enforcer's watchdog); the claim itself goes on."""

    node: NodeName
    pid: int
    reason: str
    ts: float = field(default_factory=now)


ClaimEvent = (
    ClaimRequested
    | ClaimAllocated
    | ClaimUnschedulable
    | ClaimPrepared
    | ClaimRunning
    | ClaimReleaseRequested
    | ClaimReleased
    | ClaimFailed
    | ClaimViolation
    | ClaimDeallocated
)

CLAIM_EVENT_KINDS: tuple[str, ...] = kinds(ClaimEvent)


# --- usage: tessera.usage.<node> -----------------------------------------------------------------


class DeviceUsage(Struct, frozen=True, kw_only=True):
    uuid: str
    index: int
    used_bytes: int
    limit_bytes: int
    sm_limit: Percent = 0


class ClaimUsage(Event, tag="claim-usage"):
    node: NodeName
    claim: ClaimId
    tenant: TenantName
    devices: list[DeviceUsage]
    processes: int = 0
    ts: float = field(default_factory=now)


class NodeUsage(Event, tag="node-usage"):
    node: NodeName
    claims: int
    allocated_memory_mib: int
    used_memory_bytes: int
    ts: float = field(default_factory=now)


class KubeletPluginStatus(Event, tag="kubelet-plugin"):
    """Whether the kubelet has the node's DRA plugin (the enforcer, one ``instance`` of it: a rolling
    update runs two side by side) registered. Said on every change and, while registered, every few
    seconds: the capacity publisher writes a node's ResourceSlices only while a report says so and is
    recent (a plugin that died says nothing), as the kubelet deletes them once the plugin is gone."""

    node: NodeName
    instance: str
    registered: bool
    reason: str = ""  # how the plugin knows (the kubelet's notice, a call), or why it is not registered
    ts: float = field(default_factory=now)


UsageEvent = ClaimUsage | NodeUsage | KubeletPluginStatus


# --- tenants: tessera.tenants.<tenant>.<event> ---------------------------------------------------


class GpuQuota(Struct, frozen=True, kw_only=True):
    """A tenant's ceiling; 0 in a field means no GPUs of that dimension, None means unlimited."""

    gpus: Annotated[int, Meta(ge=0)] | None = None
    memory_mib: Annotated[int, Meta(ge=0)] | None = None
    cores: Annotated[int, Meta(ge=0)] | None = None  # sum of per-GPU core percents


class TenantCreated(Event, tag="created"):
    tenant: TenantName
    quota: GpuQuota = GpuQuota()
    ts: float = field(default_factory=now)


class TenantUpdated(Event, tag="updated"):
    tenant: TenantName
    quota: GpuQuota = GpuQuota()
    phase: str = ""
    reason: str = ""
    ts: float = field(default_factory=now)


class TenantDeleted(Event, tag="deleted"):
    tenant: TenantName
    ts: float = field(default_factory=now)


TenantEvent = TenantCreated | TenantUpdated | TenantDeleted


# --- dead letters: tessera.dlq.<service> ---------------------------------------------------------


class DeadLetter(Event, tag="dead-letter"):
    service: str
    subject: str
    reason: str
    payload: str  # the original bytes, decoded as UTF-8 with replacement
    deliveries: int = 1
    stream: str = ""
    ts: float = field(default_factory=now)


class DeadLetterReplayed(Event, tag="replayed"):
    """`tessera dlq replay` sent the letter at ``seq`` of the dead-letter stream back to its subject
    (on ``tessera.dlq.replayed.<seq>``): a second replay finds this and sends nothing."""

    seq: int
    subject: str
    replayed_seq: int = 0  # where the republished message landed in its own stream
    stream: str = ""
    ts: float = field(default_factory=now)


DlqEvent = DeadLetter | DeadLetterReplayed


# --- KV records (current state, not events) ------------------------------------------------------


class ClaimRecord(Struct, kw_only=True):
    """The ``claims`` bucket: claim -> its latest known state."""

    claim: ClaimId
    tenant: TenantName
    state: Literal[
        "requested", "allocated", "unschedulable", "prepared", "running", "released", "failed"
    ]
    spec: ClaimSpec
    node: str = ""
    devices: list[DeviceShare] = []
    reason: str = ""
    release_requested: bool = False
    # W3C traceparent of the request that created the claim: later steps that do not start from
    # one of the claim's own messages (a release request, a retry) continue this trace.
    traceparent: str = ""
    # Kubernetes mode: the ResourceClaim this claim stands for.
    kube: KubeClaimRef | None = None
    updated: float = field(default_factory=now)
    # The placement replica deciding this claim on its slow path, and until when: a peer leaves the
    # claim alone meanwhile, so one claim is never written into two nodes' ledgers at once.
    placer: str = ""
    placing_until: float = 0.0
    # Kubernetes mode: the nodes kube-scheduler took this claim's allocation back from (it could not
    # bind the pod there), latest last: placement places it elsewhere while another node fits.
    withdrawn: list[str] = []
    # A waiting claim that preempted: where it goes once its victims are gone (placement holds the
    # room they free for it meanwhile, and chooses no more victims while they are stopping).
    nominated: Nomination | None = None


class TenantRecord(Struct, kw_only=True):
    """The ``tenants`` bucket: tenant -> spec as placement needs it (quota)."""

    tenant: TenantName
    quota: GpuQuota = GpuQuota()
    phase: str = "Ready"
    created: float = field(default_factory=now)
    # Fair share (issue 26): ``quota`` is what the tenant is guaranteed. Idle capacity may be
    # borrowed beyond it up to ``borrowing_limit`` more (None: no borrowing, the quota is a hard
    # wall; a field None in it: no limit in that dimension); a claim so placed is preemptible by
    # another tenant reclaiming its guarantee. ``weight`` decides which borrower goes first
    # (`tessera.placement.fairshare`).
    borrowing_limit: GpuQuota | None = None
    weight: Annotated[int, Meta(ge=1, le=1000)] = 1


class LedgerEntry(Struct, frozen=True, kw_only=True):
    claim: ClaimId
    tenant: TenantName
    shares: list[DeviceShare]
    cpu_millis: int = 0
    host_memory_mib: int = 0
    ts: float = field(default_factory=now)
    # Kubernetes mode: the uid of the claim's pod. Until kube-scheduler binds it, the pod's CPU,
    # memory and pod slot count on this node in placement's view (as the scheduler counts the pods
    # it has assumed), so that two pods placed at once never overfill the node.
    pod_uid: str = ""
    # The claim's `ClaimSpec.priority` and `preemptible`, kept with what it holds: what decides
    # whether it may be preempted is read from the ledger alone (`placement.preemption`).
    priority: int = 0
    preemptible: bool = True
    # Placed beyond its tenant's guarantee (`TenantRecord.borrowing_limit`): preemptible by a
    # tenant reclaiming its own guarantee, whatever the priorities.
    borrowing: bool = False


class Nomination(Struct, frozen=True, kw_only=True):
    """A preempting claim's place to come, like kube-scheduler's nominatedNodeName: the node, the
    victims' ledger entries as they stood when chosen, and the claim's priority. Until the claim is
    placed, what the victims hold stays counted for every claim of no higher priority, in the
    ledger while they stop and in placement's view once they are gone."""

    node: NodeName
    victims: list[LedgerEntry]
    priority: Annotated[int, Meta(ge=0, le=MAX_PRIORITY)] = 0
    # The victims were reclaimed for the claim's tenant's guarantee: their room is held against
    # every other claim, whatever its priority (else the borrower could take it straight back).
    reclaim: bool = False


class NodeLedger(Struct, kw_only=True):
    """The ``ledger`` bucket, key ``node.<node>``: every live allocation on that node.

    The per-device totals are derived from ``entries``; keeping the entries (not only sums) is what
    lets a release be idempotent and lets anyone check that the ledger equals the sum of live claims.
    """

    node: NodeName
    entries: dict[str, LedgerEntry] = {}


class TenantUsage(Struct, kw_only=True):
    """The ``ledger`` bucket, key ``tenant.<tenant>``: what the tenant holds, for quota checks."""

    tenant: TenantName
    claims: dict[str, GpuQuota] = {}  # claim -> (gpus, memory_mib, cores) it holds


# --- decoders, built once per process ------------------------------------------------------------

inventory_decoder = msgspec.json.Decoder(InventoryEvent)
claim_decoder = msgspec.json.Decoder(ClaimEvent)
usage_decoder = msgspec.json.Decoder(UsageEvent)
tenant_decoder = msgspec.json.Decoder(TenantEvent)
dlq_decoder = msgspec.json.Decoder(DlqEvent)
encoder = msgspec.json.Encoder()


def encode(obj: Struct) -> bytes:
    return encoder.encode(obj)
