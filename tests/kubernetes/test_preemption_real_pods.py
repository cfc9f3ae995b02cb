"""Preemption end to end on the real control plane and the real node: a high-priority GPU pod that
fits only where a low-priority one runs has the low one evicted (its PodDisruptionBudget refusing
first, then allowing), the kubelet stops it with its own grace period, the enforcer releases its
claim once the container is gone, and only then is the high pod's claim allocated and the pod
Running. The auditor reads every ledger revision meanwhile: no GPU is ever over-committed.

Nothing is played: Tessera's services run as in test_real_gpu_pod.py (`realpods.TesseraOnNode`),
with preemption on; the priorities come from PriorityClasses, which the API server's Priority
admission turns into the pods' ``spec.priority`` and the webhook into the claims' priority. The
fleet is the node's two simulated GPUs; the low pod holds both (all their cores), the high pod
wants one of them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tessera.shared.events import GpuQuota
from tessera.shared.kubeclaims import claim_id

from gpupods import hami_pod
from kit import eventually
from kubetessera import ledgers
from realpods import TesseraOnNode, log_has

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
from auditor import Auditor  # noqa: E402  (tests/faults: the ledger auditor, shared)

TENANT = "alpha"
GRACE = 3  # seconds: the low pod's terminationGracePeriodSeconds
PREEMPTION = {"TESSERA_PLACEMENT_PREEMPTION": "true"}


def _pod(name: str, ns: str, image: str, gpus: int, cores: int, priority_class: str) -> dict:
    pod = hami_pod(name, ns, image, 1024, cores)
    pod["metadata"]["labels"] = {"app": name}
    pod["spec"]["priorityClassName"] = priority_class
    pod["spec"]["terminationGracePeriodSeconds"] = GRACE
    pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = str(gpus)
    return pod


async def test_a_high_priority_pod_has_a_low_one_evicted_and_runs_once_it_is_gone(
        kube_cluster, kube_node, kube_namespace, nats_url, tmp_path):
    ns = kube_namespace
    on = TesseraOnNode(kube_cluster, kube_node, ns, nats_url, tmp_path)
    classes = {"low": (f"{ns}-low", 10), "high": (f"{ns}-high", 1000)}
    for name, value in classes.values():
        await on.kubectl("create", "-f", "-", stdin=json.dumps({
            "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": name},
            "value": value, "preemptionPolicy": "PreemptLowerPriority"}))
    try:
        async with on.running(TENANT, GpuQuota(gpus=4), env=PREEMPTION):
            auditor = await Auditor.start(nats_url)
            try:
                await _preempted(on, auditor, classes)
            finally:
                await auditor.close()
    finally:
        for name, _ in classes.values():
            await on.kubectl("delete", "priorityclass", name, "--ignore-not-found", check=False)


async def _claim_of(on: TesseraOnNode, pod: str) -> tuple[str, str]:
    """(claim id, ResourceClaim name) of a pod's one claim, once the controller made it."""
    async def made():
        got = await on.get(f"pod/{pod}")
        statuses = got["status"].get("resourceClaimStatuses") or []
        return statuses[0]["resourceClaimName"] if statuses and statuses[0].get("resourceClaimName") else None

    name = await eventually(made, timeout=60, what=f"the ResourceClaim of {pod}")
    return claim_id((await on.get("resourceclaim", name))["metadata"]["uid"]), name


async def _preempted(on: TesseraOnNode, auditor: Auditor, classes: dict) -> None:
    ns, client = on.namespace, on.client
    low_pod = _pod("low", ns, on.image, 2, 100, classes["low"][0])
    await on.kubectl("create", "-f", "-", stdin=json.dumps(low_pod))
    low_got = await on.ready("low")
    assert low_got["spec"]["priority"] == classes["low"][1]
    low, low_name = await _claim_of(on, "low")
    record = await client.wait_for(low, {"prepared", "running"}, timeout=60)
    assert record.spec.priority == classes["low"][1], record.spec

    # A budget that allows no disruption of the low pod: the high one waits, saying why.
    budget = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "low", "namespace": ns},
              "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "low"}}}}
    await on.kubectl("create", "-f", "-", stdin=json.dumps(budget))

    async def budget_counted():  # the disruption controller's status: no disruption allowed
        status = (await on.get("poddisruptionbudget/low")).get("status") or {}
        return status.get("currentHealthy") == 1 and status.get("disruptionsAllowed") == 0

    await eventually(budget_counted, timeout=60, what="the budget's status")
    high_pod = _pod("high", ns, on.image, 1, 50, classes["high"][0])
    await on.kubectl("create", "-f", "-", stdin=json.dumps(high_pod))
    high, _ = await _claim_of(on, "high")
    waiting = await client.wait_for(high, {"unschedulable"}, timeout=60)
    assert "PodDisruptionBudget" in waiting.reason and "nothing preempted" in waiting.reason, waiting.reason
    assert waiting.spec.priority == classes["high"][1], waiting.spec
    assert "deletionTimestamp" not in (await on.get("pod/low"))["metadata"]
    assert not (await client.claim(low)).release_requested

    # The budget goes: the low pod is evicted with its own grace period, and the high pod runs.
    await on.kubectl("delete", "-n", ns, "poddisruptionbudget/low")
    released = await client.wait_for(low, {"released"}, timeout=120)
    assert f"preempted by {high}" in released.reason, released.reason
    high_got = await on.ready("high")
    assert not high_got["spec"].get("schedulingGates")
    placed = await client.wait_for(high, {"prepared", "running"}, timeout=60)
    assert placed.node == on.kube_node.name

    # The kubelet stopped the low pod's container and unprepared its claim before the enforcer
    # released it: the enforcer's log says so in that order. (It logs the release after the ledger
    # entry is gone, which is what let the high pod in: the line may come after the high pod runs.)
    await eventually(lambda: log_has(on.enforcer_log, f"released {low} on"), timeout=30,
                     what="the enforcer's log of the release")
    log = on.enforcer_log.read_text()
    ref = f"{ns}/{low_name}"
    unprepared = log.find(f"unprepared ResourceClaim {ref} ({low})")
    released_at = log.find(f"released {low} on")
    assert 0 <= unprepared < released_at, log[-4000:]
    events = (await on.get("events"))["items"]
    killing = [e for e in events if e["involvedObject"].get("name") == "low" and e["reason"] == "Killing"]
    assert killing, [(e["reason"], e["message"]) for e in events]

    # Every ledger revision: the low claim's entry gone before the high one's came; never both.
    findings = await auditor.audit({})
    assert not findings.revision_overcommits and not findings.revision_doubles, findings.lines()
    assert auditor.ledger.revisions >= 3  # the low claim's entry, its removal, the high one's
    assert set((await ledgers(client))[on.kube_node.name].entries) == {high}
    gone = await on.kubectl("get", "-n", ns, "pod/low", check=False)
    assert gone.returncode != 0, gone.stdout
