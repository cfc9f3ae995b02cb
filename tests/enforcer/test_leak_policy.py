"""The leak rules and the lost-node choice as pure decisions (no services, no clocks): what is
released, what is never released, and who releases a lost node's claims."""

from __future__ import annotations

import signal

from tessera.shared.events import ClaimRecord, ClaimSpec, DeviceShare, LedgerEntry, NodeInventory, NodeLedger

from tessera.enforcer import accounting
from tessera.enforcer.claimdir import ClaimDir
from tessera.enforcer.lost import LostNodes, designated
from tessera.enforcer.observe import ClaimView, NodeView
from tessera.enforcer.reclaim import Cleanup, DropLedger, Reclaimer, Release, Signal

GRACE = 10.0
STOP = 4.0  # a released claim's processes: SIGTERM, this long, SIGKILL


def record(claim: str, state: str = "running", node: str = "n1", **kw) -> ClaimRecord:
    return ClaimRecord(claim=claim, tenant="t", state=state, spec=ClaimSpec(), node=node,
                       devices=[DeviceShare(uuid="GPU-1", index=0, memory_mib=100, cores=0)], **kw)


def live_procs(n: int = 1) -> accounting.VgpuSnapshot:
    procs = tuple(accounting.ProcessUsage(k, 1000 + k, 1, 1, True, (1,)) for k in range(n))
    return accounting.VgpuSnapshot(path="x", version=1, devices=(), processes=procs)


def view(*cvs: ClaimView) -> NodeView:
    return NodeView(node="n1", claims={cv.claim: cv for cv in cvs})


def cv(claim: str, rec: ClaimRecord | None, *, owner=False, procs=0, directory=True, in_ledger=True, error="") -> ClaimView:
    return ClaimView(claim=claim, record=rec, directory=ClaimDir(f"/nowhere/{claim}") if directory else None,
                     owner=owner, snapshot=live_procs(procs) if procs else accounting.EMPTY,
                     in_ledger=in_ledger, error=error)


def test_a_run_claim_with_a_live_owner_is_never_released():
    r = Reclaimer(GRACE, STOP)
    v = view(cv("run-a", record("run-a"), owner=True, procs=0))
    assert r.decide(v, 0) == [] and r.decide(v, 1000) == []


def test_a_run_claim_without_owner_is_released_after_the_grace_and_leftovers_killed_first():
    r = Reclaimer(GRACE, STOP)
    v = view(cv("run-a", record("run-a"), owner=False, procs=2))
    assert r.decide(v, 0) == []
    assert r.decide(v, GRACE - 1) == []
    assert r.decide(v, GRACE) == [Signal("run-a", signal.SIGKILL)]  # no owner to forward a SIGTERM
    assert r.decide(v, GRACE + 1) == [Signal("run-a", signal.SIGKILL)]  # released only once they are gone
    gone = view(cv("run-a", record("run-a"), owner=False, procs=0))
    assert r.decide(gone, GRACE + 2) == [Release("run-a", "reclaimed: owner gone")]


def test_a_requested_release_waits_for_sigterm_then_sigkill_and_the_processes_to_go():
    r = Reclaimer(GRACE, STOP)
    asked = record("c-a", state="prepared", release_requested=True, reason="preempted by c-b")
    assert r.decide(view(cv("c-a", asked, procs=2)), 0) == [Signal("c-a", signal.SIGTERM)]
    assert r.decide(view(cv("c-a", asked, procs=2)), STOP - 1) == []  # the grace period
    assert r.decide(view(cv("c-a", asked, procs=1)), STOP) == [Signal("c-a", signal.SIGKILL)]
    assert r.decide(view(cv("c-a", asked, procs=1)), STOP + 1) == [Signal("c-a", signal.SIGKILL)]
    assert r.decide(view(cv("c-a", asked, procs=1, error="lock held")), STOP + 2) == []  # not on a guess
    assert r.decide(view(cv("c-a", asked, procs=0)), STOP + 3) == [Release("c-a", "preempted by c-b")]


def test_a_pods_claim_waits_for_the_kubelet_to_stop_its_containers():
    from tessera.shared.kubeclaims import KubeClaimRef

    r = Reclaimer(GRACE, STOP)
    asked = record("k-a", state="running", release_requested=True, reason="preempted by k-b",
                   kube=KubeClaimRef(namespace="ns", name="c", uid="u", pod="p"))
    assert r.decide(view(cv("k-a", asked, procs=1)), 0) == []
    assert r.decide(view(cv("k-a", asked, procs=1)), 10 * STOP) == []  # never signalled from here
    assert r.decide(view(cv("k-a", asked, procs=0)), 10 * STOP + 1) == [Release("k-a", "preempted by k-b")]


def test_a_requested_release_of_a_claim_without_processes_is_at_once_and_one_look_starts_one_clock():
    r = Reclaimer(GRACE, STOP)
    asked = record("c-a", state="running", release_requested=True, reason="requested")
    assert r.stopping(cv("c-a", asked, procs=0), "requested", now=0) == [Release("c-a", "requested")]
    assert r.stopping(cv("c-a", asked, procs=1), "requested", now=0) == [Signal("c-a", signal.SIGTERM)]
    assert r.decide(view(cv("c-a", asked, procs=1)), 1) == []  # the handler's look sent SIGTERM already
    assert r.decide(view(cv("c-a", asked, procs=1)), STOP) == [Signal("c-a", signal.SIGKILL)]


def test_an_owner_that_comes_back_resets_the_clock():
    r = Reclaimer(GRACE, STOP)
    assert r.decide(view(cv("run-a", record("run-a"))), 0) == []
    assert r.decide(view(cv("run-a", record("run-a"), owner=True)), 5) == []
    assert r.decide(view(cv("run-a", record("run-a"))), GRACE + 1) == []  # idle again only since now


def test_other_running_claims_are_in_use_while_a_process_lives():
    r = Reclaimer(GRACE, STOP)
    assert r.decide(view(cv("pod-a", record("pod-a"), procs=1)), 0) == []
    assert r.decide(view(cv("pod-a", record("pod-a"), procs=1)), 100) == []
    assert r.decide(view(cv("pod-a", record("pod-a"))), 101) == []
    assert r.decide(view(cv("pod-a", record("pod-a"))), 101 + GRACE) == [Release("pod-a", "reclaimed: workload ended")]


def test_reservations_and_unreadable_accounting_are_never_reclaimed():
    r = Reclaimer(GRACE, STOP)
    v = view(cv("c-res", record("c-res", state="prepared")), cv("run-b", record("run-b"), error="bad file"))
    assert r.decide(v, 0) == [] and r.decide(v, 10 * GRACE) == []


def test_released_claims_lose_their_processes_then_their_directory():
    r = Reclaimer(GRACE, STOP)
    rel = record("run-a", state="released")
    assert r.decide(view(cv("run-a", rel, procs=1, in_ledger=False)), 0) == [Signal("run-a", signal.SIGTERM)]
    assert r.decide(view(cv("run-a", rel, procs=1, in_ledger=False)), 1) == []
    assert r.decide(view(cv("run-a", rel, procs=1, in_ledger=False)), STOP) == [Signal("run-a", signal.SIGKILL)]
    assert r.decide(view(cv("run-a", rel, procs=0, in_ledger=False)), STOP + 1) == [Cleanup("run-a")]


def test_ledger_entries_without_a_live_claim_are_dropped():
    r = Reclaimer(GRACE, STOP)
    terminal = cv("x", record("x", state="failed"), directory=False)
    unknown = cv("y", None, directory=False)
    assert r.decide(view(terminal, unknown), 0) == [DropLedger("x")]
    assert r.decide(view(terminal, unknown), GRACE) == [DropLedger("x"), DropLedger("y")]


def test_lost_node_claims_go_to_one_designated_peer_first_and_to_everyone_later():
    inv = {n: NodeInventory(node=n, devices=[]) for n in ("a", "b", "c")}
    inv["c"] = NodeInventory(node="c", devices=[], labels={"tessera.dev/lost": "true"})
    claims = {"c": [f"claim-{i}" for i in range(20)]}
    chosen = {claim: designated(claim, ["a", "b"]) for claim in claims["c"]}
    assert set(chosen.values()) == {"a", "b"}  # spread, and stable
    a, b = LostNodes("a", delay=5), LostNodes("b", delay=5)
    assert a.due(inv, claims, 0) == [] and b.due(inv, claims, 0) == []
    first_a, first_b = a.due(inv, claims, 5), b.due(inv, claims, 5)
    assert sorted(c for _, c in first_a + first_b) == sorted(claims["c"])  # each exactly once
    assert len(a.due(inv, claims, 10)) == 20  # after twice the delay, anyone releases (idempotently)
    inv["c"] = NodeInventory(node="c", devices=[])
    assert a.due(inv, claims, 11) == []  # the node came back: nothing is released


def test_node_usage_sums_the_ledger_and_fragmentation_counts_stranded_memory():
    from tessera.shared.events import GpuDevice

    from tessera.enforcer.metrics import fragmentation

    devices = {u: GpuDevice(uuid=u, index=i, model="m", memory_mib=1000) for i, u in enumerate(("g0", "g1"))}
    empty = NodeView(node="n1", devices=devices, ledger=NodeLedger(node="n1"))
    assert fragmentation(empty) == 0.0
    share = DeviceShare(uuid="g0", index=0, memory_mib=400, cores=0)
    half = NodeView(node="n1", devices=devices,
                    ledger=NodeLedger(node="n1", entries={"c": LedgerEntry(claim="c", tenant="t", shares=[share])}))
    assert fragmentation(half) == 600 / 1600
