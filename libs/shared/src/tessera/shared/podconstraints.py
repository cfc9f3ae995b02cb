"""What kube-scheduler's filters read of a pod, as a claim carries it to placement.

On Kubernetes placement decides a GPU pod's node, and kube-scheduler must then be able to bind the
pod there: otherwise its PostFilter removes the allocation and the pod waits for nothing. So the
translator reads the claim's pod and sends along, in the claim's spec (`ClaimSpec.pod`), what the
scheduler's node filters look at: the pod's ``nodeSelector``, its required node affinity, its
tolerations and its resource requests. Placement holds them against each node
(`tessera.placement.nodefilters`).

The requests are computed here once, for both services, as kube-scheduler computes them
(``k8s.io/component-helpers/resource.PodRequests``, the options NodeResourcesFit uses): the sum over
the containers; each init container's request (a restartable one, a sidecar, also adds to the sum
and to every later init container's) and the largest of those if it is more; pod-level requests
(``spec.resources.requests``) in place of the containers' for the resources they name; then
``spec.overhead``. CPU is counted in millicores and everything else in whole units, both rounded
up, as ``Quantity.MilliValue`` and ``Quantity.Value`` do. For a pod already running, the resources
its status reports (an in-place resize) count where they are more (``UseStatusResources``).

Pure: no client. New fields get defaults; a field's type never changes (the bus's rule).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from msgspec import Struct

from tessera.shared import quantity

CPU = "cpu"
MEMORY = "memory"
EPHEMERAL_STORAGE = "ephemeral-storage"
PODS = "pods"
# Resources a pod may request at pod level (resourcehelper.IsSupportedPodLevelResource).
_POD_LEVEL = (CPU, MEMORY)


class Toleration(Struct, frozen=True, kw_only=True):
    """One of the pod's ``spec.tolerations`` (an empty operator means ``Equal``, an empty key with
    ``Exists`` every taint, an empty effect every effect)."""

    key: str = ""
    operator: str = ""
    value: str = ""
    effect: str = ""


class NodeSelectorRequirement(Struct, frozen=True, kw_only=True):
    """A ``matchExpressions`` (node labels) or ``matchFields`` (``metadata.name``) entry."""

    key: str
    operator: str  # In NotIn Exists DoesNotExist Gt Lt
    values: list[str] = []


class NodeSelectorTerm(Struct, frozen=True, kw_only=True):
    match_expressions: list[NodeSelectorRequirement] = []
    match_fields: list[NodeSelectorRequirement] = []


class PodConstraints(Struct, frozen=True, kw_only=True):
    """The pod a claim is for, as kube-scheduler's node filters see it."""

    # spec.nodeSelector: every label must be on the node with that value.
    node_selector: dict[str, str] = {}
    # spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms
    # (one must match); None when the pod has no required node affinity.
    required_terms: list[NodeSelectorTerm] | None = None
    tolerations: list[Toleration] = []
    # The pod's requests as the scheduler counts them: ``cpu`` in millicores, the rest in units
    # (bytes for memory, ephemeral-storage and hugepages-*; extended resources by count).
    requests: dict[str, int] = {}


def _requirements(items: Any) -> list[NodeSelectorRequirement]:
    out = []
    for item in items or []:
        if isinstance(item, Mapping):
            out.append(NodeSelectorRequirement(key=str(item.get("key") or ""), operator=str(item.get("operator") or ""),
                                               values=[str(v) for v in item.get("values") or []]))
    return out


def constraints_of(pod: Mapping) -> PodConstraints:
    """The constraints of a pod object (as the API server returns it)."""
    spec = pod.get("spec") or {}
    required = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution"))
    terms = None
    if isinstance(required, Mapping):
        terms = [NodeSelectorTerm(match_expressions=_requirements(t.get("matchExpressions")),
                                  match_fields=_requirements(t.get("matchFields")))
                 for t in required.get("nodeSelectorTerms") or [] if isinstance(t, Mapping)]
    tolerations = [Toleration(key=str(t.get("key") or ""), operator=str(t.get("operator") or ""),
                              value=str(t.get("value") or ""), effect=str(t.get("effect") or ""))
                   for t in spec.get("tolerations") or [] if isinstance(t, Mapping)]
    return PodConstraints(node_selector={str(k): str(v) for k, v in (spec.get("nodeSelector") or {}).items()},
                          required_terms=terms, tolerations=tolerations, requests=pod_requests(pod))


# --- requests ------------------------------------------------------------------------------------

def is_scheduled_resource(name: str) -> bool:
    """Whether NodeResourcesFit counts a resource of this name: cpu, memory, ephemeral-storage and
    the scalar ones (schedutil.IsScalarResourceName: extended resources, hugepages-*, names with a
    domain, attachable-volumes-*)."""
    return (name in (CPU, MEMORY, EPHEMERAL_STORAGE) or name.startswith("hugepages-")
            or name.startswith("attachable-volumes-") or "/" in name)


def amount(name: str, value: Any) -> int:
    """A quantity as the scheduler counts it: CPU in millicores, anything else in units, rounded
    up; QuantityError for text that is not a quantity."""
    parsed = quantity.parse(value)
    return math.ceil(parsed * 1000) if name == CPU else math.ceil(parsed)


def resource_list(resources: Any) -> dict[str, int]:
    """A ResourceList (name -> quantity) as counted; unscheduled names and bad quantities left out
    (the API server refuses a pod with a bad quantity, so none reaches here)."""
    out: dict[str, int] = {}
    for name, value in (resources or {}).items() if isinstance(resources, Mapping) else ():
        if not is_scheduled_resource(str(name)):
            continue
        try:
            out[str(name)] = amount(str(name), value)
        except quantity.QuantityError:
            continue
    return out


def _add(into: dict[str, int], more: Mapping[str, int]) -> None:
    for name, value in more.items():
        into[name] = into.get(name, 0) + value


def _max(into: dict[str, int], other: Mapping[str, int]) -> None:
    for name, value in other.items():
        if value > into.get(name, 0):
            into[name] = value


def _effective(spec: dict[str, int], status: Mapping | None) -> dict[str, int]:
    """A running container's requests: the larger of its spec's and what its status says it was
    given (``resources.requests``, ``allocatedResources``), resource by resource."""
    if not isinstance(status, Mapping):
        return spec
    out = dict(spec)
    _max(out, resource_list((status.get("resources") or {}).get("requests")))
    _max(out, resource_list(status.get("allocatedResources")))
    return out


def pod_requests(pod: Mapping, *, use_status: bool = False) -> dict[str, int]:
    """The pod's requests as kube-scheduler counts them (see the module's docstring). ``use_status``:
    a pod bound to a node, whose containers' reported resources count where they are more."""
    spec = pod.get("spec") or {}
    statuses: dict[str, Mapping] = {}
    if use_status:
        status = pod.get("status") or {}
        for item in (status.get("containerStatuses") or []) + (status.get("initContainerStatuses") or []):
            if isinstance(item, Mapping):
                statuses[str(item.get("name"))] = item
    total: dict[str, int] = {}
    for container in spec.get("containers") or []:
        requests = resource_list((container.get("resources") or {}).get("requests"))
        if use_status:
            requests = _effective(requests, statuses.get(str(container.get("name"))))
        _add(total, requests)
    sidecars: dict[str, int] = {}
    init_peak: dict[str, int] = {}
    for container in spec.get("initContainers") or []:
        requests = resource_list((container.get("resources") or {}).get("requests"))
        if container.get("restartPolicy") == "Always":
            if use_status:
                requests = _effective(requests, statuses.get(str(container.get("name"))))
            _add(total, requests)  # a sidecar runs beside the containers
            _add(sidecars, requests)
            during = dict(sidecars)
        else:
            during = dict(requests)
            _add(during, sidecars)  # the sidecars started before it run while it does
        _max(init_peak, during)
    _max(total, init_peak)
    pod_level = resource_list((spec.get("resources") or {}).get("requests"))
    for name, value in pod_level.items():
        if name in _POD_LEVEL or name.startswith("hugepages-"):
            total[name] = value
    _add(total, resource_list(spec.get("overhead")))
    return {name: value for name, value in total.items() if value}
