"""A claim's life, written down once: its states, who moves it from one to the next, on which subject.

Before this module every service re-decided who ends a claim (the translator which node a release is
addressed to, placement whether a release is its own or the node's, the enforcer what it may skip),
and each guess was a place where two services could both act or neither. Here each transition has
exactly one owner; a service asks `owner_of` / `release_route` instead of reasoning about states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tessera.shared import subjects

State = Literal["requested", "unschedulable", "allocated", "prepared", "running", "released", "failed"]
Service = Literal["translator", "placement", "enforcer"]

TERMINAL: frozenset[str] = frozenset({"released", "failed"})
# Not yet on a node: nothing but the claim record (and, while placement works on it, a tentative
# ledger entry) exists, so placement ends it.
UNPLACED: frozenset[str] = frozenset({"requested", "unschedulable"})
# On a node: the node's ledger holds the entry, the node's enforcer ends it.
ON_NODE: frozenset[str] = frozenset({"allocated", "prepared", "running"})


@dataclass(frozen=True)
class Transition:
    source: str
    target: str
    owner: Service
    event: str  # the claim event published once the record has moved (subjects.claim(..., event, node))


# Every allowed move; a record never moves along an edge that is not here.
TRANSITIONS: tuple[Transition, ...] = (
    Transition("requested", "allocated", "placement", "allocated"),
    Transition("requested", "unschedulable", "placement", "unschedulable"),
    Transition("requested", "released", "placement", "released"),
    Transition("requested", "failed", "placement", "failed"),
    Transition("unschedulable", "allocated", "placement", "allocated"),
    Transition("unschedulable", "unschedulable", "placement", "unschedulable"),
    Transition("unschedulable", "released", "placement", "released"),
    Transition("unschedulable", "failed", "placement", "failed"),
    # Kubernetes mode: kube-scheduler took the allocation back (it could not bind the pod there).
    # Nothing of the claim is on the node but its ledger entry (the kubelet prepares a claim only
    # for a pod bound to the node, so an ``allocated`` one is unprepared): placement, not the node's
    # enforcer (the node may be down, the usual reason), takes the entry back and places it again.
    Transition("allocated", "requested", "placement", "deallocated"),
    Transition("allocated", "prepared", "enforcer", "prepared"),
    Transition("allocated", "running", "enforcer", "running"),
    Transition("allocated", "released", "enforcer", "released"),
    Transition("allocated", "failed", "enforcer", "failed"),
    Transition("prepared", "running", "enforcer", "running"),
    Transition("prepared", "released", "enforcer", "released"),
    Transition("prepared", "failed", "enforcer", "failed"),
    Transition("running", "released", "enforcer", "released"),
    Transition("running", "failed", "enforcer", "failed"),
    Transition("failed", "released", "enforcer", "released"),
)

_BY_EDGE = {(t.source, t.target): t for t in TRANSITIONS}

ALLOWED: dict[str, frozenset[str]] = {
    state: frozenset(t.target for t in TRANSITIONS if t.source == state)
    for state in ("requested", "unschedulable", "allocated", "prepared", "running", "released", "failed")
}


def allowed(source: str, target: str) -> bool:
    """May a record in ``source`` be moved to ``target``? (Staying put is always allowed: a replay.)"""
    return source == target or target in ALLOWED.get(source, frozenset())


def owner_of(source: str, target: str) -> Service | None:
    """The one service that performs ``source`` -> ``target``; None if the move is not allowed."""
    t = _BY_EDGE.get((source, target))
    return t.owner if t is not None else None


@dataclass(frozen=True)
class ReleaseRoute:
    """Where a release of a claim goes: to placement (no node) or to the enforcer of ``node``."""

    owner: Service
    node: str | None

    def subject(self, tenant: str, claim: str) -> str:
        return subjects.claim(tenant, claim, "release", self.node)

    def msg_id(self, claim: str) -> str:
        # One id per destination, so a release forwarded by placement and one sent straight by the
        # translator are one message to the node's stream, not two.
        return f"{claim}:release:{self.node}" if self.node else f"{claim}:release"


def allocated_msg_id(claim: str, withdrawn: int = 0) -> str:
    """The message id of a claim's ``allocated`` event: one per placement of the claim, so that one
    placed again after kube-scheduler took it back (``withdrawn``: how many times) is announced
    again rather than dropped by the stream as a repeat of its first."""
    return f"{claim}:allocated" + (f":{withdrawn}" if withdrawn else "")


def release_route(state: str, node: str | None) -> ReleaseRoute | None:
    """Who ends a claim recorded in ``state`` on ``node``; None when it has already ended."""
    if state in TERMINAL and state != "failed":
        return None
    if state in UNPLACED or not node:
        return ReleaseRoute("placement", None)
    return ReleaseRoute("enforcer", node)


def ends(service: Service, state: str, node: str | None, here: str | None = None) -> bool:
    """Does ``service`` end (release) a claim recorded in ``state`` on ``node``? For the enforcer,
    ``here`` is its own node: it ends only the claims its node holds."""
    route = release_route(state, node)
    if route is None or route.owner != service:
        return False
    return service != "enforcer" or route.node == here


def ended_with_lost_node(state: str) -> bool:
    """Is a claim whose entry sits in a lost node's ledger ended by the peer enforcer that releases
    that node? Every claim not already over is, whatever its state: the node it was (or was about
    to be) on is gone, its enforcer cannot act, and the entry there is what the claim holds (a
    placement that stopped between the ledger write and the record leaves one still ``requested``)."""
    return state not in TERMINAL


# Who removes a record once its claim's life is over: the translator, which created it (submit).
# Only records in a state nothing leads out of are removed (`ENDED`), and only after a retention
# period (tessera.shared.claimpruning).
RECORD_PRUNER: Service = "translator"
ENDED: frozenset[str] = frozenset(state for state, targets in ALLOWED.items() if not targets)
