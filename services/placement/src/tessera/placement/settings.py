"""Placement's settings, declared field by field (`tessera.shared.settings`).

The default policy and the scoring core, how claims are batched, the reconciler's periods and, in
Kubernetes mode, how ResourceClaim writes are spread and retried.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from tessera.placement.policies import SERVICE_NAMES
from tessera.shared.settings import FromEnv, setting

POLICIES = SERVICE_NAMES  # (`policies`: those the service offers)
_POLICY_WORDS = ", ".join(f"`{p}`" for p in POLICIES[:-1]) + f" or `{POLICIES[-1]}`"
CORES = ("auto", "compiled", "python")


@dataclass(frozen=True, kw_only=True)
class PlacementSettings(FromEnv):
    default_policy: str = setting(
        "TESSERA_PLACEMENT_POLICY", f"default node and GPU policy: {_POLICY_WORDS} (a claim may choose its own "
        "with HAMi's annotations)", "fragmentation-aware", choices=POLICIES)
    # The host-memory term of the fragmentation model.
    fluid_memory: bool = setting(
        "TESSERA_PLACEMENT_FLUID_MEMORY", "count how host memory strands GPUs in the fragmentation model: better "
        "packing, for more decision time (both measured in `bench/placement_sim.md`)", True)
    # Which fragmentation-aware scoring runs: the compiled core where it is built (auto), the compiled
    # core or refuse to start (compiled), or the Python reference engine (python): same decisions.
    core: str = setting(
        "TESSERA_PLACEMENT_CORE", "which fragmentation-aware scoring runs: `auto` (the compiled core where it was "
        "built, else the Python engine), `compiled` (refuse to start without it), `python` (the reference engine; "
        "same decisions, slower)", "auto", choices=CORES)
    # Work done between decisions rather than inside one (`idlework`); off only to measure what it buys.
    idle_work: bool = setting(
        "TESSERA_PLACEMENT_IDLE_WORK", "between decisions, rebuild the claim shapes' indexes ahead after the "
        "workload mix is republished and run the garbage collector's young passes, instead of inside a claim's "
        "decision (`idlework`); `false` only to measure what that buys "
        "(`tessera bench placement-nats --models default,no-idle-work`)", True)
    # Preemption (`preemption`, `preempting`): on by default, as kube-scheduler's is. It evicts what
    # Kubernetes users expect and no more: a claim whose PriorityClass says `preemptionPolicy: Never`
    # never preempts, victims are chosen only where the pod could be bound, the room they free is held
    # for the preemptor (its nomination), and a retry waits for the victims still stopping instead of
    # choosing more (tests/placement/test_preemption_hold.py). Only claims of priority above 0 ever
    # preempt, so a fleet that sets no priorities sees no change. `false`: priority only orders the
    # waiting queue.
    preemption: bool = setting(
        "TESSERA_PLACEMENT_PREEMPTION", "`true`: a claim that fits nowhere has strictly lower-priority, "
        "preemptible claims on one node released to make room (victims chosen as `tessera.placement.preemption` "
        "states): their processes get SIGTERM, SIGKILL after `TESSERA_RELEASE_GRACE_SECONDS`, and the claim is "
        "placed once they are gone and their ledger entries with them; on Kubernetes the victims' pods are "
        "evicted (all or none; a PodDisruptionBudget can refuse, the pod's grace period applies); `false`: a "
        "claim's priority only orders the waiting queue", True)
    preemption_retry_seconds: float = setting(
        "TESSERA_PLACEMENT_PREEMPTION_RETRY_SECONDS", "how long after an eviction refused (a PodDisruptionBudget "
        "allowing no disruption now, or the API server failing) the waiting claims are tried again: nothing in "
        "Tessera's ledger changes when a budget does, so no other change would wake them", 5.0, above=0)
    batch: int = setting("TESSERA_PLACEMENT_BATCH", "requested claims fetched and decided per batch", 256, minimum=1)
    # The reconciler (tessera.placement.reconcile): how often it checks placement's invariants, and
    # how old a record or ledger entry must be before it is repaired (younger: maybe mid-commit).
    reconcile_seconds: float = setting(
        "TESSERA_PLACEMENT_RECONCILE_SECONDS", "how often placement's reconciler checks its invariants (and once at "
        "start): `allocated` events republished, orphan ledger entries removed, lost entries restored, quota "
        "usage matched to the live claims", 30.0, above=0, group="reconciler")
    reconcile_grace_seconds: float = setting(
        "TESSERA_PLACEMENT_RECONCILE_GRACE_SECONDS", "how old a claim record or ledger entry must be before the "
        "reconciler repairs it (a younger one may be between two writes of a commit)", 30.0, minimum=0,
        group="reconciler")
    # Kubernetes mode: write ResourceClaim allocations, lift pod gates, report on pods.
    kubernetes: bool = setting(
        "TESSERA_KUBERNETES", "`true`: for claims that stand for a ResourceClaim, write its `status.allocation`, lift "
        "the pod's `gpu.tessera.dev/placement` scheduling gate, and report on the pod (Events, condition "
        "`gpu.tessera.dev/Placed`) through the Kubernetes API (in-cluster, or `KUBECONFIG`). Off: nothing is "
        "written to Kubernetes and other claims are unaffected either way", False, group="kubernetes")
    kube_workers: int = setting(
        "TESSERA_PLACEMENT_KUBE_WORKERS", "ResourceClaims updated at once (the updates run after the ledger commit, "
        "off its path)", 8, minimum=1, group="kubernetes")
    # How long a ResourceClaim status write (or gate lift) is retried while the API server is
    # unreachable before the allocation is given back; and the limit on one API call.
    kube_retry_seconds: float = setting(
        "TESSERA_PLACEMENT_KUBE_RETRY_SECONDS", "how long after the allocation its status write and gate lift are "
        "retried while the API server is unreachable; then the allocation is released and the pod gets an "
        "`AllocationFailed` Event", 60.0, minimum=0, group="kubernetes")
    kube_timeout_seconds: float = setting(
        "TESSERA_PLACEMENT_KUBE_TIMEOUT_SECONDS", "the time limit of one Kubernetes API call (a call past it counts "
        "as the API server unreachable)", 10.0, above=0, group="kubernetes")

    def check(self) -> Iterable[str]:
        from tessera.placement.engine import COMPILED_CORE

        if self.core == "compiled" and not COMPILED_CORE:
            yield ("TESSERA_PLACEMENT_CORE=compiled, but the compiled core (tessera.placement._fgdcore) is not built "
                   "here: reinstall services/placement where gcc and the Python headers are present, or set "
                   "TESSERA_PLACEMENT_CORE=auto")
