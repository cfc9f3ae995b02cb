"""The parts of a cluster no emulator runs, played by the tests: the resourceclaim controller,
kube-scheduler (its binding side) and the kubelet (its status side), each doing what the real one
does with the objects Tessera reads and writes, through the emulator's strict checks.

- `ResourceClaimController.claims_for(pod)`: one ResourceClaim per ``spec.resourceClaims`` entry
  that names a template, made from the template in the pod's namespace, owned by the pod (so the
  garbage collector deletes it with the pod) and annotated ``resource.kubernetes.io/pod-claim-name``;
  the pod's ``status.resourceClaimStatuses`` names it.
- `Scheduler.bind(pod)`: refuses a pod that still has scheduling gates or a claim without an
  allocation; otherwise reserves each claim for the pod (``status.reservedFor``) and binds the pod
  (``pods/binding``) to the node the allocations' node selectors name.
- `Kubelet.start(pod)`: a bound pod whose claims are reserved for it becomes Running.
- `admit(pod, ...)`: the API server's mutating-admission step, for as long as the emulator does not
  call webhooks itself: a real AdmissionReview sent to the translator's webhook over TLS, and its
  JSONPatch applied to the pod.
"""

from __future__ import annotations

import base64
import json
import secrets
import uuid

import kube_patches
from kube_objects import binding
from webhook_tls import Authority, post_review, served_serial

from tessera.shared.kubeapi import KubeApi, object_path
from tessera.shared.kubeclaims import RESOURCE_API_VERSION

POD_CLAIM_NAME = "resource.kubernetes.io/pod-claim-name"


class Refused(Exception):
    """What the real component would decline to do, and why."""


def node(name: str) -> dict:
    """A Node as a kubelet registers it."""
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}}


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


class ResourceClaimController:
    def __init__(self, apiserver) -> None:
        self.apiserver = apiserver

    async def claims_for(self, pod: dict) -> list[dict]:
        meta = pod["metadata"]
        ns = meta["namespace"]
        made, statuses = [], []
        for entry in pod["spec"].get("resourceClaims") or []:
            template_name = entry.get("resourceClaimTemplateName")
            if not template_name:
                continue
            template = self.apiserver.object(RESOURCE_API_VERSION, "resourceclaimtemplates", template_name, ns)
            if template is None:
                raise Refused(f"pod {ns}/{meta['name']}: ResourceClaimTemplate {template_name} not found in {ns}")
            tmeta = template["spec"].get("metadata") or {}
            claim = {
                "apiVersion": RESOURCE_API_VERSION, "kind": "ResourceClaim",
                "metadata": {
                    "name": f"{meta['name']}-{entry['name']}-{secrets.token_hex(3)[:5]}",
                    "namespace": ns,
                    "labels": dict(tmeta.get("labels") or {}),
                    "annotations": {**(tmeta.get("annotations") or {}), POD_CLAIM_NAME: entry["name"]},
                    "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"],
                                         "controller": True, "blockOwnerDeletion": True}],
                },
                "spec": template["spec"]["spec"],
            }
            made.append(await self.apiserver.create(claim))
            statuses.append({"name": entry["name"], "resourceClaimName": claim["metadata"]["name"]})
        if statuses:
            await self.apiserver.patch("v1", "pods", meta["name"], {"status": {"resourceClaimStatuses": statuses}},
                                       ns, kind="merge", subresource="status")
        return made


class Scheduler:
    def __init__(self, apiserver, kube: KubeApi) -> None:
        self.apiserver = apiserver
        self.kube = kube

    async def bind(self, pod: dict) -> str:
        """Bind ``pod`` to its claims' node and return it; `Refused` saying why it may not be."""
        meta = pod["metadata"]
        pod = self.apiserver.object("v1", "pods", meta["name"], meta["namespace"])
        if pod["spec"].get("schedulingGates"):
            raise Refused(f"pod {meta['name']} is gated: {[g['name'] for g in pod['spec']['schedulingGates']]}")
        claims = claims_of(self.apiserver, pod)
        if len(claims) != len(pod["spec"].get("resourceClaims") or []):
            raise Refused(f"pod {meta['name']}: not every claim exists yet")
        nodes = set()
        for claim in claims:
            if not (claim.get("status") or {}).get("allocation"):
                raise Refused(f"claim {claim['metadata']['name']} is not allocated")
            nodes.add(allocated_node(claim))
        if len(nodes) > 1:
            raise Refused(f"pod {meta['name']}: its claims are on different nodes {sorted(nodes)}")
        for claim in claims:
            reserved = list(claim["status"].get("reservedFor") or [])
            me = {"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}
            if me not in reserved:
                claim["status"]["reservedFor"] = reserved + [me]
                await self.apiserver.replace(claim, "status")
        if not nodes:
            raise Refused(f"pod {meta['name']} has no claims: not a Tessera pod")
        target = nodes.pop()
        await self.kube.create(object_path("v1", "pods", meta["name"], meta["namespace"]) + "/binding",
                               binding(meta["name"], target))
        return target


class Kubelet:
    def __init__(self, apiserver) -> None:
        self.apiserver = apiserver

    async def start(self, pod: dict) -> dict:
        meta = pod["metadata"]
        pod = self.apiserver.object("v1", "pods", meta["name"], meta["namespace"])
        if not pod["spec"].get("nodeName"):
            raise Refused(f"pod {meta['name']} is not bound to a node")
        for claim in claims_of(self.apiserver, pod):
            uids = {r.get("uid") for r in claim["status"].get("reservedFor") or []}
            if pod["metadata"]["uid"] not in uids:
                raise Refused(f"claim {claim['metadata']['name']} is not reserved for pod {meta['name']}")
        status = {"phase": "Running", "conditions": [c for c in pod["status"].get("conditions") or []
                                                      if c["type"] not in ("Ready", "ContainersReady")]
                  + [{"type": "Ready", "status": "True"}, {"type": "ContainersReady", "status": "True"}]}
        return await self.apiserver.patch("v1", "pods", meta["name"], {"status": status}, meta["namespace"],
                                          kind="merge", subresource="status")


class Denied(Exception):
    """The webhook refused the pod; the message is what ``kubectl apply`` would print."""


async def admit(pod: dict, port: int, authority: Authority) -> dict:
    """The pod as the mutating webhook at ``port`` leaves it (verified TLS, AdmissionReview v1)."""
    uid = str(uuid.uuid4())
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
              "request": {"uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"},
                          "resource": {"group": "", "version": "v1", "resource": "pods"},
                          "namespace": pod["metadata"]["namespace"], "operation": "CREATE", "object": pod,
                          "userInfo": {"username": "alice"}}}
    _, reader, writer = await served_serial(port, authority)
    try:
        answer = (await post_review(reader, writer, review))["response"]
    finally:
        writer.close()
        await writer.wait_closed()
    assert answer["uid"] == uid
    if not answer["allowed"]:
        raise Denied((answer.get("status") or {}).get("message", "denied"))
    if not answer.get("patch"):
        return pod
    assert answer["patchType"] == "JSONPatch"
    return kube_patches.json_patch(pod, json.loads(base64.b64decode(answer["patch"])))
