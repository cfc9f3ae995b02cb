"""The parts of a cluster no emulator runs, played by the tests: the resourceclaim controller,
kube-scheduler (its binding side) and the kubelet (its status side), each doing what the real one
does with the objects Tessera reads and writes, through the emulator's strict checks.

- `make_claims(apiserver, pod)`: the translator tests' resourceclaim controller (one ResourceClaim
  per template entry, from the template in the pod's namespace, owned by the pod so the garbage
  collector deletes it with the pod, annotated ``resource.kubernetes.io/pod-claim-name``), plus what
  kube-scheduler and the kubelet read of it: the pod's ``status.resourceClaimStatuses``.
- `schedule(apiserver, pod)`: refuses a pod that still has scheduling gates or a claim without an
  allocation; otherwise reserves each claim for the pod (``status.reservedFor``) and binds the pod
  (``pods/binding``) to the node the allocations' node selectors name.
- `kubelet_start(apiserver, pod)`: a bound pod whose claims are reserved for it becomes Running.
"""

from __future__ import annotations

from translator_harness import resourceclaim_controller

from tessera.shared.kubeclaims import RESOURCE_API_VERSION

POD_CLAIM_NAME = "resource.kubernetes.io/pod-claim-name"


class Refused(Exception):
    """What the real component would decline to do, and why."""


def node(name: str) -> dict:
    """A Node as a kubelet registers it."""
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}}


async def add_node(apiserver, name: str) -> dict:
    """A Node registered, with the room for pods its kubelet reports (``status.allocatable``:
    placement holds a pod's requests against it, as kube-scheduler does)."""
    await apiserver.create(node(name))
    room = {"cpu": "64", "memory": "256Gi", "pods": "110"}
    return await apiserver.patch("v1", "nodes", name, {"status": {"capacity": room, "allocatable": room}},
                                 kind="merge", subresource="status")


def gpu_pod(name: str, ns: str, resources: dict[str, int | str], annotations: dict[str, str] | None = None) -> dict:
    """A pod asking for GPUs with HAMi's resource names, as a user writes it."""
    limits = {k: str(v) for k, v in resources.items()}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "annotations": dict(annotations or {})},
        "spec": {"containers": [{"name": "main", "image": "registry.example/train:1", "resources": {"limits": limits}}]},
    }


def claims_of(apiserver, pod: dict) -> list[dict]:
    """The pod's ResourceClaims, as its status names them."""
    ns = pod["metadata"]["namespace"]
    out = []
    for status in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
        claim = apiserver.object(RESOURCE_API_VERSION, "resourceclaims", status["resourceClaimName"], ns)
        if claim is not None:
            out.append(claim)
    return out


def allocated_node(claim: dict) -> str:
    """The one node a claim's allocation is available on (its node selector's metadata.name)."""
    terms = claim["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"]
    names = {v for t in terms for f in t.get("matchFields") or [] if f["key"] == "metadata.name" for v in f["values"]}
    names |= {v for t in terms for e in t.get("matchExpressions") or [] if e["key"] == "kubernetes.io/hostname"
              for v in e["values"]}
    if len(names) != 1:
        raise Refused(f"claim {claim['metadata']['name']} is not pinned to one node: {sorted(names)}")
    return names.pop()


async def make_claims(apiserver, pod: dict) -> list[dict]:
    """The pod's ResourceClaims as Kubernetes' resourceclaim controller makes them, named in the
    pod's ``status.resourceClaimStatuses``; the claims made."""
    made = await resourceclaim_controller(apiserver, pod)
    statuses = [{"name": c["metadata"]["annotations"][POD_CLAIM_NAME], "resourceClaimName": c["metadata"]["name"]}
                for c in made]
    if statuses:
        meta = pod["metadata"]
        await apiserver.patch("v1", "pods", meta["name"], {"status": {"resourceClaimStatuses": statuses}},
                              meta["namespace"], kind="merge", subresource="status")
    return made


def stored(apiserver, pod: dict) -> dict:
    """The pod as the API server holds it now."""
    meta = pod["metadata"]
    return apiserver.object("v1", "pods", meta["name"], meta["namespace"])


async def schedule(apiserver, pod: dict) -> str:
    """kube-scheduler: bind ``pod`` to its claims' node and return it; `Refused` saying why not."""
    pod = stored(apiserver, pod)
    meta = pod["metadata"]
    if pod["spec"].get("schedulingGates"):
            raise Refused(f"pod {meta['name']} is gated: {[g['name'] for g in pod['spec']['schedulingGates']]}")
    claims = claims_of(apiserver, pod)
    if len(claims) != len(pod["spec"].get("resourceClaims") or []):
        raise Refused(f"pod {meta['name']}: not every claim exists yet")
    nodes = set()
    for claim in claims:
        if not (claim.get("status") or {}).get("allocation"):
            raise Refused(f"claim {claim['metadata']['name']} is not allocated")
        nodes.add(allocated_node(claim))
    if len(nodes) != 1:
        raise Refused(f"pod {meta['name']}: its claims are not on one node ({sorted(nodes)})")
    for claim in claims:
        reserved = list(claim["status"].get("reservedFor") or [])
        me = {"resource": "pods", "name": meta["name"], "uid": meta["uid"]}
        if me not in reserved:
            claim["status"]["reservedFor"] = reserved + [me]
            await apiserver.replace(claim, "status")
    target = nodes.pop()
    await apiserver.bind(meta["namespace"], meta["name"], target)
    return target


async def kubelet_start(apiserver, pod: dict) -> dict:
    """The kubelet: a pod bound here whose claims are reserved for it runs."""
    pod = stored(apiserver, pod)
    meta = pod["metadata"]
    if not pod["spec"].get("nodeName"):
        raise Refused(f"pod {meta['name']} is not bound to a node")
    for claim in claims_of(apiserver, pod):
        if meta["uid"] not in {r.get("uid") for r in claim["status"].get("reservedFor") or []}:
            raise Refused(f"claim {claim['metadata']['name']} is not reserved for pod {meta['name']}")
    status = {"phase": "Running", "conditions": [c for c in pod["status"].get("conditions") or []
                                                  if c["type"] not in ("Ready", "ContainersReady")]
              + [{"type": "Ready", "status": "True"}, {"type": "ContainersReady", "status": "True"}]}
    return await apiserver.patch("v1", "pods", meta["name"], {"status": status}, meta["namespace"],
                                 kind="merge", subresource="status")



DELETE_PROTECTION = "resource.kubernetes.io/delete-protection"


async def claims_released(apiserver, claims: list[dict]) -> None:
    """The resourceclaim controller once the claims' pod is gone: each claim no longer reserved for
    it, its allocation cleared and the delete-protection finalizer removed (which lets a claim the
    garbage collector is deleting go)."""
    for claim in claims:
        meta = claim["metadata"]
        current = apiserver.object(claim["apiVersion"], "resourceclaims", meta["name"], meta["namespace"])
        if current is None:
            continue
        status = dict(current.get("status") or {})
        if status.get("reservedFor") or status.get("allocation"):
            status.pop("reservedFor", None)
            status.pop("allocation", None)
            current = await apiserver.replace({**current, "status": status}, "status")
        finalizers = [f for f in current["metadata"].get("finalizers") or [] if f != DELETE_PROTECTION]
        if finalizers != (current["metadata"].get("finalizers") or []):
            await apiserver.replace({**current, "metadata": {**current["metadata"], "finalizers": finalizers}})
