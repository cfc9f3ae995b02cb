"""A GPU pod's objects on the real control plane, made by the identities that make them in a
cluster: the translator's ResourceClaimTemplate (its service account, as its webhook does), the
pod with Tessera's scheduling gate, and the ResourceClaim that Kubernetes' resourceclaim controller
makes from the template. deploy/k8s's admission policies are in force (they refuse any other maker).
`hami_pod` is the other way in: a pod as a user writes it for HAMi, which the real API server sends
through the translator's webhook.
"""

from __future__ import annotations

from tessera.shared.events import ClaimSpec
from tessera.shared.kubeapi import KubeApi, object_path
from tessera.shared.kubeclaims import RESOURCE_API_VERSION, SCHEDULING_GATE

from tessera.translator.dra import resource_claim_template

from kit import eventually
from kit.kubecluster import KubeControlPlane, apply, manifests, service_identity

import probeimage


def hami_pod(name: str, namespace: str, image: str, memory_mib: int, cores: int) -> dict:
    """A pod as a user writes it for HAMi: nvidia.com/gpu and gpumem limits, nothing of DRA. Its
    container runs the probe and holds what it got until its stdin closes (``stdin: true`` keeps
    it open), so the pod stays Running with its memory in use."""
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
            "dnsPolicy": "Default",  # the node has no cluster DNS (the kubelet would warn MissingClusterDNS)
            "containers": [{
                "name": "main", "image": image, "imagePullPolicy": "Never", "stdin": True,
                "command": [probeimage.PROBE, "64", "0", "hold"],
                "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": str(memory_mib),
                                         "nvidia.com/gpucores": str(cores)}},
            }],
        },
    }


class GpuPods:
    def __init__(self, plane: KubeControlPlane) -> None:
        apply(plane, manifests("deviceclass.yaml") + manifests("admission-policies.yaml"))
        self.admin = KubeApi.for_kubeconfig(plane.admin_kubeconfig)
        self.translator = KubeApi.for_kubeconfig(service_identity(plane, "translator.yaml"))

    async def create(self, namespace: str, name: str, spec: ClaimSpec, *, gates: tuple[str, ...] = (),
                     tolerate_all: bool = False, pod_spec: dict | None = None,
                     requests: dict | None = None, timeout: float = 30) -> tuple[dict, dict]:
        """(pod, claim): the pod as the webhook leaves it and its claim once the controller made it
        (``tolerate_all``: a pod that tolerates every taint, for nodes that no kubelet keeps Ready;
        ``pod_spec``: more of the pod's spec, a nodeSelector or tolerations; ``requests``: its
        container's CPU and memory requests; ``timeout``: how long the claim may take to come)."""
        pod = await self.submit(namespace, name, spec, gates=gates, tolerate_all=tolerate_all,
                                pod_spec=pod_spec, requests=requests)
        claim = await eventually(lambda: self.claim_of(pod), timeout=timeout, what=f"the claim of pod {name}")
        return pod, claim

    async def submit(self, namespace: str, name: str, spec: ClaimSpec, *, gates: tuple[str, ...] = (),
                     tolerate_all: bool = False, pod_spec: dict | None = None,
                     requests: dict | None = None) -> dict:
        """The pod as the webhook leaves it, without waiting for its claim (many pods at once)."""
        template = f"tessera-{name}"
        await self.translator.create(object_path(RESOURCE_API_VERSION, "resourceclaimtemplates", namespace=namespace),
                                     resource_claim_template(spec, template, namespace))
        resources: dict = {"claims": [{"name": "gpu"}], **({"requests": requests} if requests else {})}
        pod = await self.admin.create(object_path("v1", "pods", namespace=namespace), {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"schedulingGates": [{"name": SCHEDULING_GATE}, *({"name": g} for g in gates)],
                     "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
                     "containers": [{"name": "main", "image": "registry.example/train:1", "resources": resources}],
                     **({"tolerations": [{"operator": "Exists"}]} if tolerate_all else {}),
                     **(pod_spec or {})}})
        return pod

    async def claim_of(self, pod: dict) -> dict | None:
        meta = pod["metadata"]
        items, _ = await self.admin.list(object_path(RESOURCE_API_VERSION, "resourceclaims", namespace=meta["namespace"]))
        return next((c for c in items if any(o.get("uid") == meta["uid"]
                                             for o in c["metadata"].get("ownerReferences") or [])), None)

    async def close(self) -> None:
        await self.admin.close()
        await self.translator.close()
