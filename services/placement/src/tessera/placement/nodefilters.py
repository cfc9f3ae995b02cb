"""kube-scheduler's node filters, as placement must honour them: pure, one function a rule.

On Kubernetes placement chooses a GPU pod's node, writes the claim's allocation pinned there and
lifts the pod's gate; kube-scheduler then binds the pod, but only to a node its filters pass. A node
they refuse leaves the pod unschedulable everywhere (the allocation pins it), and the scheduler's
PostFilter takes the allocation back. So placement rules out, before it scores, every node these
filters would refuse, with the scheduler's own semantics (Kubernetes v1.36,
``pkg/scheduler/framework/plugins`` and ``k8s.io/component-helpers/scheduling/corev1``), in the
scheduler's order (a node is refused by the first that fails):

- ``NodeUnschedulable``: a cordoned node (``spec.unschedulable``) unless the pod tolerates the taint
  ``node.kubernetes.io/unschedulable:NoSchedule``;
- ``TaintToleration``: a taint of effect ``NoSchedule`` or ``NoExecute`` that no toleration of the
  pod tolerates (``PreferNoSchedule`` never refuses). A toleration with an empty effect matches
  every effect, an empty key (with ``Exists``) every key; ``Exists`` matches any value, ``Equal``
  (or no operator) the same value. ``Lt``/``Gt`` tolerate nothing: the comparison operators are
  behind the gate ``TaintTolerationComparisonOperators``, alpha and off in 1.36
  (``comparison_operators=True`` compares as the gate would: both values decimal int64);
- ``NodeAffinity``: the pod's ``nodeSelector`` (every label present with that value) and its
  required node affinity: one of its terms must match, a term matching when all its
  ``matchExpressions`` match the node's labels (``In``, ``NotIn`` — true where the label is absent —,
  ``Exists``, ``DoesNotExist``, ``Gt``/``Lt`` on a label that is a decimal int64) and all its
  ``matchFields`` match (``metadata.name`` ``In``/``NotIn`` one value). A term with neither is
  skipped; a term that is not valid (an unknown operator, ``In`` without values, ``Gt`` without one
  integer...) matches nothing; no term left means no node matches;
- ``NodeResourcesFit``: one more pod than ``allocatable.pods`` allows ("Too many pods"); then, if
  the pod requests anything, each of CPU, memory, ephemeral storage and the scalar resources it
  requests more of than the node's allocatable less what the pods already there request
  ("Insufficient cpu", ...). (The pod's requests are computed by `tessera.shared.podconstraints`.)

Each refusal names its filter and the scheduler's reasons, so an unschedulable claim can say, as the
scheduler's events do, how many nodes each ruled out (`describe`). Not mirrored (placement does not
see what they need; when one of them refuses, the scheduler takes the allocation back and the claim
is placed again, elsewhere): NodePorts, volume binding and limits, InterPodAffinity,
PodTopologySpread.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from tessera.shared.podconstraints import (CPU, EPHEMERAL_STORAGE, MEMORY, PODS, NodeSelectorRequirement,
                                           NodeSelectorTerm, PodConstraints, Toleration)

NODE_UNSCHEDULABLE = "NodeUnschedulable"
TAINT_TOLERATION = "TaintToleration"
NODE_AFFINITY = "NodeAffinity"
NODE_RESOURCES_FIT = "NodeResourcesFit"
# The order kube-scheduler runs them in (its default profile's filter plugins).
FILTERS = (NODE_UNSCHEDULABLE, TAINT_TOLERATION, NODE_AFFINITY, NODE_RESOURCES_FIT)

# The scheduler's own reasons (ErrReason... in each plugin).
UNSCHEDULABLE = "node(s) were unschedulable"
UNTOLERATED = "node(s) had untolerated taint(s)"
AFFINITY = "node(s) didn't match Pod's node affinity/selector"
TOO_MANY_PODS = "Too many pods"

TAINT_UNSCHEDULABLE = "node.kubernetes.io/unschedulable"
NO_SCHEDULE = "NoSchedule"
NO_EXECUTE = "NoExecute"

_INT64 = re.compile(r"^[+-]?[0-9]+$")


@dataclass(frozen=True)
class Taint:
    key: str
    value: str = ""
    effect: str = ""


@dataclass(frozen=True)
class NodeState:
    """What the filters read of a Node object."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    unschedulable: bool = False
    taints: tuple[Taint, ...] = ()
    # status.allocatable, counted as requests are (cpu in millicores, pods as a count).
    allocatable: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Usage:
    """What the pods on a node (bound, or placed there and about to be) already request."""

    requests: Mapping[str, int] = field(default_factory=dict)
    pods: int = 0


@dataclass(frozen=True)
class Refusal:
    """The first filter that refuses a node, with the scheduler's reasons (NodeResourcesFit may
    give several: one per resource short)."""

    filter: str
    reasons: tuple[str, ...]


# --- taints and tolerations ---------------------------------------------------------------------

def _int64(text: str) -> int | None:
    """``strconv.ParseInt(text, 10, 64)``: a decimal int64 (sign allowed, nothing else), or None."""
    if not _INT64.match(text):
        return None
    value = int(text)
    return value if -(2 ** 63) <= value < 2 ** 63 else None


def tolerates(toleration: Toleration, taint: Taint, *, comparison_operators: bool = False) -> bool:
    """``Toleration.ToleratesTaint``."""
    if toleration.effect and toleration.effect != taint.effect:
        return False
    if toleration.key and toleration.key != taint.key:
        return False
    operator = toleration.operator
    if operator in ("", "Equal"):
        return toleration.value == taint.value
    if operator == "Exists":
        return True
    if operator in ("Lt", "Gt"):
        if not comparison_operators:
            return False
        wanted, have = _int64(toleration.value), _int64(taint.value)
        if wanted is None or have is None:
            return False
        return have < wanted if operator == "Lt" else have > wanted
    return False


def untolerated(taints: Iterable[Taint], tolerations: Iterable[Toleration], *,
                comparison_operators: bool = False) -> Taint | None:
    """The first ``NoSchedule``/``NoExecute`` taint no toleration tolerates, or None."""
    tolerations = list(tolerations)
    for taint in taints:
        if taint.effect not in (NO_SCHEDULE, NO_EXECUTE):
            continue
        if not any(tolerates(t, taint, comparison_operators=comparison_operators) for t in tolerations):
            return taint
    return None


def node_unschedulable(pod: PodConstraints, node: NodeState, *, comparison_operators: bool = False) -> bool:
    """Whether NodeUnschedulable refuses the node."""
    if not node.unschedulable:
        return False
    cordon = Taint(TAINT_UNSCHEDULABLE, "", NO_SCHEDULE)
    return not any(tolerates(t, cordon, comparison_operators=comparison_operators) for t in pod.tolerations)


def taint_toleration(pod: PodConstraints, node: NodeState, *, comparison_operators: bool = False) -> bool:
    """Whether TaintToleration refuses the node."""
    return untolerated(node.taints, pod.tolerations, comparison_operators=comparison_operators) is not None


# --- node affinity ------------------------------------------------------------------------------

class _Invalid(Exception):
    """A requirement that labels.NewRequirement (or the field selector) would refuse."""


def _label_requirement(req: NodeSelectorRequirement, labels: Mapping[str, str]) -> bool:
    op, values = req.operator, req.values
    if op in ("In", "NotIn"):
        if not values:
            raise _Invalid(f"{op} needs values")
        if op == "In":
            return req.key in labels and labels[req.key] in values
        return req.key not in labels or labels[req.key] not in values
    if op in ("Exists", "DoesNotExist"):
        if values:
            raise _Invalid(f"{op} takes no values")
        return (req.key in labels) == (op == "Exists")
    if op in ("Gt", "Lt"):
        if len(values) != 1 or _int64(values[0]) is None:
            raise _Invalid(f"{op} needs one integer value")
        bound = _int64(values[0])
        have = _int64(labels[req.key]) if req.key in labels else None
        if have is None or bound is None:
            return False
        return have > bound if op == "Gt" else have < bound
    raise _Invalid(f"unknown operator {op!r}")


def _field_requirement(req: NodeSelectorRequirement, fields: Mapping[str, str]) -> bool:
    if req.operator not in ("In", "NotIn"):
        raise _Invalid(f"field operator {req.operator!r}")
    if len(req.values) != 1:
        raise _Invalid("a field requirement takes one value")
    equal = fields.get(req.key, "") == req.values[0]
    return equal if req.operator == "In" else not equal


def term_matches(term: NodeSelectorTerm, node: NodeState) -> bool:
    """One node selector term against the node (an empty or invalid term matches nothing)."""
    if not term.match_expressions and not term.match_fields:
        return False
    try:
        # (all requirements are checked: an invalid one fails the term even after a mismatch)
        labels_ok = all([_label_requirement(r, node.labels) for r in term.match_expressions])
        fields_ok = all([_field_requirement(r, {"metadata.name": node.name}) for r in term.match_fields])
    except _Invalid:
        return False
    return labels_ok and fields_ok


def node_affinity(pod: PodConstraints, node: NodeState) -> bool:
    """Whether NodeAffinity refuses the node (the pod's nodeSelector, then its required terms)."""
    for key, value in pod.node_selector.items():
        if node.labels.get(key) != value:
            return True
    if pod.required_terms is None:
        return False
    return not any(term_matches(term, node) for term in pod.required_terms)


# --- resources ----------------------------------------------------------------------------------

def insufficient(pod: PodConstraints, node: NodeState, used: Usage) -> tuple[str, ...]:
    """NodeResourcesFit's reasons against the node (empty: it fits)."""
    reasons = []
    if used.pods + 1 > node.allocatable.get(PODS, 0):
        reasons.append(TOO_MANY_PODS)
    requests = pod.requests
    if not any(requests.values()):
        return tuple(reasons)
    have, taken = node.allocatable, used.requests
    for name in (CPU, MEMORY, EPHEMERAL_STORAGE):
        want = requests.get(name, 0)
        if want > 0 and want > have.get(name, 0) - taken.get(name, 0):
            reasons.append(f"Insufficient {name}")
    for name in sorted(requests):
        if name in (CPU, MEMORY, EPHEMERAL_STORAGE):
            continue
        want = requests[name]
        if want and want > have.get(name, 0) - taken.get(name, 0):
            reasons.append(f"Insufficient {name}")
    return tuple(reasons)


# --- all of them ----------------------------------------------------------------------------------

def refusal(pod: PodConstraints, node: NodeState, used: Usage, *,
            comparison_operators: bool = False) -> Refusal | None:
    """The first of kube-scheduler's filters that refuses ``node`` for ``pod``, or None."""
    return label_refusal(pod, node, comparison_operators=comparison_operators) or resources_refusal(pod, node, used)


def label_refusal(pod: PodConstraints, node: NodeState, *, comparison_operators: bool = False) -> Refusal | None:
    """The filters that read the node's spec and labels alone (not what runs on it)."""
    if node_unschedulable(pod, node, comparison_operators=comparison_operators):
        return Refusal(NODE_UNSCHEDULABLE, (UNSCHEDULABLE,))
    if taint_toleration(pod, node, comparison_operators=comparison_operators):
        return Refusal(TAINT_TOLERATION, (UNTOLERATED,))
    if node_affinity(pod, node):
        return Refusal(NODE_AFFINITY, (AFFINITY,))
    return None


def resources_refusal(pod: PodConstraints, node: NodeState, used: Usage) -> Refusal | None:
    reasons = insufficient(pod, node, used)
    return Refusal(NODE_RESOURCES_FIT, reasons) if reasons else None


def describe(reasons: Mapping[str, int]) -> str:
    """The scheduler's histogram of reasons: "1 Insufficient cpu, 2 node(s) were unschedulable"
    (each reason with the number of nodes it was given for, sorted as the scheduler sorts them)."""
    return ", ".join(sorted(f"{n} {reason}" for reason, n in reasons.items() if n))
