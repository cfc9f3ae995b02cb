"""The cluster's nodes and pods as kube-scheduler's filters need them, and which nodes they rule out.

Kubernetes mode only. `tessera.placement.kube.ClusterWatch` lists and watches the Node objects and
the pods that are not over (``status.phase`` neither Succeeded nor Failed: the pods the scheduler's
cache holds) and hands each change to this table, which keeps, per node, what the filters read
(`nodefilters.NodeState`) and what the pods bound to it request, summed as they come and go.

A pod placement has placed but kube-scheduler has not bound yet counts on its node too, as the
scheduler counts the pods it has assumed: the ledger entry of its claim names the pod
(``LedgerEntry.pod_uid``), so every replica knows where it is headed (`FleetView.pod_nodes`), and
two pods placed at once never overfill a node's CPU, memory or pod slots.

Why placement watches Nodes itself rather than have the capacity publisher carry them in the
inventory: the node's state that matters here is the cluster's, not the node's (a cordon is an
admin's, the taints ``node.kubernetes.io/unreachable`` and ``not-ready`` are the node lifecycle
controller's, written exactly when the node's own processes — its publisher among them — are gone),
and NodeResourcesFit needs every pod on the node, GPU or not, which only a watch of the pods gives;
the one service that decides reads them where they are decided, as kube-scheduler does. The
publisher stays about GPUs, and no service imports another (they share only `tessera.shared`).

Pure: no client, no clock. The table is rebuilt from a fresh list at every (re)start of the watch.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import msgspec

from tessera.shared.podconstraints import PODS, PodConstraints, amount, is_scheduled_resource, pod_requests

from tessera.placement.explain import Rejection
from tessera.placement.nodefilters import (FILTERS, NodeState, Refusal, Taint, Usage, describe, label_refusal,
                                           refusal, resources_refusal)

_key = msgspec.json.Encoder()


def node_state(node: Mapping) -> NodeState:
    """A Node object as the filters see it."""
    meta = node.get("metadata") or {}
    spec = node.get("spec") or {}
    allocatable: dict[str, int] = {}
    for name, value in ((node.get("status") or {}).get("allocatable") or {}).items():
        if name == PODS or is_scheduled_resource(name):
            try:
                allocatable[name] = amount(name, value)
            except ValueError:
                continue
    taints = tuple(Taint(str(t.get("key") or ""), str(t.get("value") or ""), str(t.get("effect") or ""))
                   for t in spec.get("taints") or [] if isinstance(t, Mapping))
    return NodeState(name=str(meta.get("name") or ""), labels=dict(meta.get("labels") or {}),
                     unschedulable=bool(spec.get("unschedulable")), taints=taints, allocatable=allocatable)


@dataclass(frozen=True)
class PodUse:
    node: str  # spec.nodeName ("" until bound)
    requests: Mapping[str, int]


MISSING = Refusal("NodeMissing", ("node(s) not found in the cluster",))


class Exclusions:
    """The nodes kube-scheduler's filters refuse for one pod (``nodes``), and, worked out only when
    asked (a rejection, not every decision), how many each filter refused (``filtered``) and the
    scheduler's reasons with the nodes each was given for (``reasons``)."""

    def __init__(self, nodes: frozenset[str] = frozenset(),
                 why: Callable[[str], Refusal | None] | None = None) -> None:
        self.nodes = nodes
        self._why = why
        self._counted: tuple[dict[str, int], dict[str, int]] | None = None

    def _count(self) -> tuple[dict[str, int], dict[str, int]]:
        if self._counted is None:
            filtered: dict[str, int] = {}
            reasons: dict[str, int] = {}
            for name in self.nodes:
                why = self._why(name) if self._why is not None else None
                if why is None:
                    continue
                filtered[why.filter] = filtered.get(why.filter, 0) + 1
                for reason in why.reasons:
                    reasons[reason] = reasons.get(reason, 0) + 1
            self._counted = (filtered, reasons)
        return self._counted

    @property
    def filtered(self) -> dict[str, int]:
        return self._count()[0]

    @property
    def reasons(self) -> dict[str, int]:
        return self._count()[1]

    def describe(self) -> str:
        """The scheduler's reasons with the nodes each was given for: "1 Insufficient cpu, 1 node(s)
        were unschedulable"."""
        return describe(self.reasons)


NO_EXCLUSIONS = Exclusions()


class ClusterNodes:
    """The table. What a decision asks (`exclusions`) costs a few lookups: the label and taint
    filters' answer for a pod's selectors and tolerations is kept until a node changes; the nodes
    too full for a pod's requests are kept and brought up to date node by node as pods come and go;
    only the pods placed and not yet bound (few: they are bound within moments) are added per
    decision."""

    def __init__(self, *, comparison_operators: bool = False) -> None:
        self.comparison_operators = comparison_operators
        self.nodes: dict[str, NodeState] = {}
        self.pods: dict[str, PodUse] = {}  # pod uid -> where it is and what it requests
        self.bound: dict[str, dict[str, int]] = {}  # node -> the summed requests of its pods
        self.counts: dict[str, int] = {}  # node -> how many pods are bound to it
        self.unbound: set[str] = set()  # pods not bound yet
        self.generation = 0  # bumped when a node's state changes
        self._labels: dict[bytes, tuple[tuple, dict[str, Refusal], frozenset[str]]] = {}
        # request shape -> [scope token, position in `_touched`, the candidates too full for it]
        self._short: dict[tuple, list] = {}
        self._touched: list[str] = []  # nodes whose bound pods changed, in order (`_touch`)
        self._touched_base = 0  # how many were dropped off its front
        # (roster token, generation) -> the candidates' Node states, and those with no Node object
        self._scope: tuple[tuple, list[tuple[str, NodeState]], frozenset[str]] = ((None, -1, frozenset()), [], frozenset())

    # --- changes (each returns whether a waiting claim may fit now) ----------------------------

    def set_node(self, obj: Mapping) -> bool:
        state = node_state(obj)
        if not state.name or self.nodes.get(state.name) == state:
            return False  # (a kubelet's heartbeat: nothing the filters read)
        self.nodes[state.name] = state
        self.generation += 1
        return True

    def remove_node(self, obj: Mapping) -> bool:
        name = str((obj.get("metadata") or {}).get("name") or "")
        if self.nodes.pop(name, None) is not None:
            self.generation += 1
        return False  # a node gone makes nothing fit

    def set_pod(self, obj: Mapping) -> bool:
        meta = obj.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        if not uid:
            return False
        phase = (obj.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            return self.remove_pod(obj)
        node = str((obj.get("spec") or {}).get("nodeName") or "")
        use = PodUse(node, pod_requests(obj, use_status=bool(node)))
        before = self.pods.get(uid)
        if before == use:
            return False
        self._forget(uid)
        self.pods[uid] = use
        if node:
            sums = self.bound.setdefault(node, {})
            for name, value in use.requests.items():
                sums[name] = sums.get(name, 0) + value
            self.counts[node] = self.counts.get(node, 0) + 1
            self._touch(node)
        else:
            self.unbound.add(uid)
        # less asked of a node than before (moved, or resized down) may let a waiting pod fit
        return before is not None and bool(before.node) and (before.node != node or any(
            use.requests.get(k, 0) < v for k, v in before.requests.items()))

    def remove_pod(self, obj: Mapping) -> bool:
        uid = str((obj.get("metadata") or {}).get("uid") or "")
        before = self.pods.get(uid)
        self._forget(uid)
        return before is not None and bool(before.node)  # its node has room again

    def retain_nodes(self, names: set[str]) -> None:
        """Keep only these nodes (a fresh list's, after a watch that had to start again)."""
        for name in set(self.nodes) - names:
            del self.nodes[name]
            self.generation += 1

    def retain_pods(self, uids: set[str]) -> None:
        """Keep only these pods (a fresh list's)."""
        for uid in set(self.pods) - uids:
            self._forget(uid)

    def _forget(self, uid: str) -> None:
        use = self.pods.pop(uid, None)
        self.unbound.discard(uid)
        if use is None or not use.node:
            return
        self._touch(use.node)
        sums = self.bound.get(use.node, {})
        for name, value in use.requests.items():
            left = sums.get(name, 0) - value
            if left:
                sums[name] = left
            else:
                sums.pop(name, None)
        left = self.counts.get(use.node, 0) - 1
        if left > 0:
            self.counts[use.node] = left
        else:
            self.counts.pop(use.node, None)
            self.bound.pop(use.node, None)

    # --- what the filters see ----------------------------------------------------------------

    def usage(self, node: str, inflight: Mapping[str, tuple[dict[str, int], int]] | None = None) -> Usage:
        """What the pods on ``node`` request: the bound ones, and ``inflight`` (node -> requests
        and count of the pods placed there and not bound yet)."""
        requests = dict(self.bound.get(node, {}))
        pods = self.counts.get(node, 0)
        if inflight and node in inflight:
            more, n = inflight[node]
            for name, value in more.items():
                requests[name] = requests.get(name, 0) + value
            pods += n
        return Usage(requests, pods)

    def inflight(self, pod_nodes: Mapping[str, str], own_pod: str = "") -> dict[str, tuple[dict[str, int], int]]:
        """node -> (requests, count) of the pods not bound yet whose claim placement placed there
        (``pod_nodes``: pod uid -> the node its claim's ledger entry is on), ``own_pod`` aside."""
        out: dict[str, tuple[dict[str, int], int]] = {}
        for uid in self.unbound:
            node = pod_nodes.get(uid)
            if node is None or uid == own_pod:
                continue
            requests, n = out.get(node, ({}, 0))
            for name, value in self.pods[uid].requests.items():
                requests[name] = requests.get(name, 0) + value
            out[node] = (requests, n + 1)
        return out

    def exclusions(self, pod: PodConstraints, candidates: Collection[str],
                   pod_nodes: Mapping[str, str] | None = None, *, own_pod: str = "",
                   roster: object = None) -> Exclusions:
        """The candidate nodes (placement's live nodes, by name) kube-scheduler would refuse ``pod``
        on. A candidate with no Node object is refused too: the scheduler cannot bind anything to
        it. ``own_pod``: the pod's own uid (never counted against itself). ``roster``: a token that
        changes when the candidates do (the fleet's roster generation), to keep the nodes with no
        Node object between calls; None: worked out each time."""
        scope, missing = self._scope_of(candidates, roster)
        labels, label_out = self._label_answers(pod, scope)
        short = self._short_of(pod.requests, scope)
        inflight = self.inflight(pod_nodes or {}, own_pod)
        extra = []
        for name in inflight:
            node = self.nodes.get(name)
            if node is None or name in label_out or name in short or name not in candidates:
                continue
            if resources_refusal(pod, node, self.usage(name, inflight)) is not None:
                extra.append(name)
        if not (label_out or short or missing or extra):
            return NO_EXCLUSIONS
        out = label_out | short | missing
        if extra:
            out = out | frozenset(extra)

        def why(name: str) -> Refusal | None:
            node = self.nodes.get(name)
            if node is None:
                return MISSING
            return labels.get(name) or resources_refusal(pod, node, self.usage(name, inflight))

        return Exclusions(frozenset(out), why)

    def refusal(self, pod: PodConstraints, node: str, pod_nodes: Mapping[str, str] | None = None, *,
                own_pod: str = "") -> Refusal | None:
        """Why kube-scheduler's filters refuse ``pod`` on the one node ``node`` (what `exclusions`
        rules out, judged afresh, none of its answers kept), or None: for an allocation placement
        did not choose (`tessera.placement.adoption`)."""
        state = self.nodes.get(node)
        if state is None:
            return MISSING
        used = self.usage(node, self.inflight(pod_nodes or {}, own_pod))
        return refusal(pod, state, used, comparison_operators=self.comparison_operators)

    def _scope_of(self, candidates: Collection[str], roster: object) -> tuple[tuple, frozenset[str]]:
        """The candidates with a Node object, as (cache token, [(name, state)]), and those without.
        The token (roster, node generation, the names) keys every answer kept for them."""
        scope = self._scope
        if roster is None or scope[0][:2] != (roster, self.generation):
            states = [(c, self.nodes[c]) for c in candidates if c in self.nodes]
            missing = frozenset(c for c in candidates if c not in self.nodes)
            token = (roster if roster is not None else object(), self.generation, frozenset(n for n, _ in states))
            scope = self._scope = (token, states, missing)
        return (scope[0], scope[1]), scope[2]

    def _label_answers(self, pod: PodConstraints, scope: tuple) -> tuple[dict[str, Refusal], frozenset[str]]:
        """The candidates the label and taint filters refuse this pod's selectors and tolerations
        on, remembered until a node or the candidates change (pods alike in those share one answer)."""
        token, states = scope
        key = _key.encode((pod.node_selector, pod.required_terms, pod.tolerations))
        hit = self._labels.get(key)
        if hit is not None and hit[0] == token:
            return hit[1], hit[2]
        answers = {}
        for name, node in states:
            why = label_refusal(pod, node, comparison_operators=self.comparison_operators)
            if why is not None:
                answers[name] = why
        if len(self._labels) > 256:
            self._labels.clear()
        names = frozenset(answers)
        self._labels[key] = (token, answers, names)
        return answers, names

    def _short_of(self, requests: Mapping[str, int], scope: tuple) -> set[str]:
        """The candidates too full for these requests (and a pod slot), counting the bound pods
        only. Kept per request shape and brought up to date from the log of nodes whose pods
        changed (`_touched`): a decision after a pod started costs one node's check, not a scan."""
        token, states = scope
        wanted = tuple(sorted((k, v) for k, v in requests.items() if v > 0))
        entry = self._short.get(wanted)
        base, end = self._touched_base, self._touched_base + len(self._touched)
        if entry is not None and entry[0] == token and entry[1] >= base:
            if entry[1] < end:
                short = entry[2]
                for name in set(self._touched[entry[1] - base:]):
                    node = self.nodes.get(name)
                    if node is not None and name in token[2] and self._too_full(name, node, wanted):
                        short.add(name)
                    else:
                        short.discard(name)
                entry[1] = end
            return entry[2]
        short = {name for name, node in states if self._too_full(name, node, wanted)}
        if len(self._short) > 256:
            self._short.clear()
        self._short[wanted] = [token, end, short]
        return short

    def _too_full(self, name: str, node: NodeState, wanted: tuple) -> bool:
        have = node.allocatable
        if self.counts.get(name, 0) + 1 > have.get(PODS, 0):
            return True
        taken = self.bound.get(name)
        for resource, want in wanted:
            if want > have.get(resource, 0) - (taken.get(resource, 0) if taken else 0):
                return True
        return False

    def _touch(self, node: str) -> None:
        """What the pods bound to ``node`` request changed."""
        touched = self._touched
        touched.append(node)
        if len(touched) > 4096 + 4 * len(self.nodes):
            drop = len(touched) // 2
            del touched[:drop]
            self._touched_base += drop


__all__ = ["ClusterNodes", "Exclusions", "NO_EXCLUSIONS", "FILTERS", "node_state", "refused"]


def refused(rejection: Rejection, exclusions: Exclusions, candidates: int) -> Rejection:
    """The engine's rejection (made with ``exclusions.nodes`` excluded) with the excluded nodes
    accounted for by the filter that refused each, as the scheduler's events say it: "no node fits:
    kube-scheduler's filters refuse 2 of 3 nodes (1 Insufficient cpu, 1 node(s) were
    unschedulable), 1 node lacks 1 GPU with 20,000 MiB free"."""
    filtered = dict(rejection.filtered)
    out = filtered.pop("excluded", 0)
    reason = rejection.reason
    if out:  # the engine's "N node(s) excluded by the caller": these are the caller's N
        phrase = f"{out:,} node{'s' if out != 1 else ''} excluded by the caller"
        reason = reason.replace(f", {phrase}", "").replace(f"{phrase}, ", "").replace(phrase, "")
    for name, n in exclusions.filtered.items():
        filtered[name] = filtered.get(name, 0) + n
    head = "no node fits: "
    rest = reason[len(head):] if reason.startswith(head) else reason
    ours = (f"kube-scheduler's filters refuse {len(exclusions.nodes):,} of {candidates:,} "
            f"node{'s' if candidates != 1 else ''} ({exclusions.describe()})")
    return Rejection(reason=head + ours + (f", {rest}" if rest.strip() else ""), filtered=filtered)
