"""What an operator sees on a GPU pod about its placement: Events and one pod condition.

A gated pod that never schedules must say why in ``kubectl describe pod``: placement reports every
outcome as a core/v1 Event on the pod (``Allocated``, ``Unschedulable`` with the reason, e.g. the
quota exceeded or no GPU fitting, ``AllocationFailed`` when the claim's status could not be
written and the GPUs were given back) and keeps a condition of its own on the pod.

The condition is ``gpu.tessera.dev/Placed`` (True once the claim is allocated, False with reason
``Unschedulable`` while it waits), not ``PodScheduled``: that one belongs to kube-scheduler, which
sets it to False with reason ``SchedulingGated`` while our gate is on and to True when it binds the
pod; a second writer would make it flap.

Which of a pod's claims its gate waits for is read from the pod here too (`pod_claims`): the gate is
lifted only once all of the pod's Tessera claims are allocated.

Pure: references and patches as plain values; `tessera.placement.kube` sends them.
"""

from __future__ import annotations

from tessera.shared.kubeclaims import KubeClaimRef

CONDITION = "gpu.tessera.dev/Placed"
COMPONENT = "tessera-placement"
MAX_MESSAGE = 1024  # a condition's message, cut at 1 KiB as an Event's is


def subject(ref: KubeClaimRef) -> dict:
    """What placement's Events are about: the claim's pod, or the claim itself when it was made for
    no pod (an ObjectReference; `tessera.shared.kubeapi.Events` keys, counts and writes them)."""
    if ref.pod:
        involved = {"apiVersion": "v1", "kind": "Pod", "name": ref.pod, "namespace": ref.namespace}
        if ref.pod_uid:
            involved["uid"] = ref.pod_uid
        return involved
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "name": ref.name,
            "namespace": ref.namespace, "uid": ref.uid}


def condition_patch(pod: dict, placed: bool, reason: str, message: str, now: str) -> dict | None:
    """A strategic merge patch of the pod's status that sets our condition; None when ``pod``
    already says this. Conditions merge by type, so every other writer's stay as they are and no
    resourceVersion is needed (a JSON patch testing one lost to kube-scheduler's own status writes a
    third of the time, each loss a read and a write more). Of ``pod`` only our own condition is
    read (its lastTransitionTime kept while its status holds), which only placement writes."""
    conditions = list((pod.get("status") or {}).get("conditions") or [])
    value = "True" if placed else "False"
    mine = next((c for c in conditions if c.get("type") == CONDITION), None)
    if mine and mine.get("status") == value and mine.get("reason") == reason and mine.get("message") == message:
        return None
    condition = {
        "type": CONDITION,
        "status": value,
        "reason": reason,
        "message": message[:MAX_MESSAGE],
        "lastTransitionTime": mine["lastTransitionTime"] if mine and mine.get("status") == value
        and mine.get("lastTransitionTime") else now,
    }
    return {"status": {"conditions": [condition]}}


def pod_claims(pod: dict) -> list[tuple[str, str]]:
    """What each of a pod's ``spec.resourceClaims`` stands for: ("claim", name) for a ResourceClaim
    (named in the entry, or made from its template by the resourceclaim controller, which records
    the name in ``status.resourceClaimStatuses``), ("template", name) for a template whose claim is
    not made yet."""
    made = {s.get("name"): s.get("resourceClaimName") for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []}
    out = []
    for entry in (pod.get("spec") or {}).get("resourceClaims") or []:
        if entry.get("resourceClaimName"):
            out.append(("claim", entry["resourceClaimName"]))
        elif made.get(entry.get("name")):
            out.append(("claim", made[entry["name"]]))
        elif entry.get("resourceClaimTemplateName"):
            out.append(("template", entry["resourceClaimTemplateName"]))
    return out
