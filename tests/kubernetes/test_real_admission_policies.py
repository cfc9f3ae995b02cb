"""deploy/k8s/admission-policies.yaml on the real kube-apiserver: nobody gets around placement.

Without the policies (the emulator let every one of these through unchecked) a hand-made
ResourceClaimTemplate or ResourceClaim of class gpu.tessera.dev, or a pod that uses a translated
template without the scheduling gate, lets kube-scheduler allocate Tessera's devices itself, and the
ledger and the cluster diverge. The translator's own identity, and Kubernetes' resourceclaim
controller making the claim of a gated pod, still pass.
"""

from __future__ import annotations

import pytest

from tessera.shared.events import ClaimSpec
from tessera.shared.kubeapi import KubeApi, Rejected, object_path
from tessera.shared.kubeclaims import RESOURCE_API_VERSION, SCHEDULING_GATE

from tessera.translator.dra import resource_claim_template

from kit import eventually
from kit.kubecluster import apply, manifests, service_identity

SPEC = ClaimSpec(memory_mib=10240, cores=20)


@pytest.fixture
async def cluster(kube_cluster, kube_namespace):
    apply(kube_cluster, manifests("deviceclass.yaml") + manifests("admission-policies.yaml"))
    admin = KubeApi.for_kubeconfig(kube_cluster.admin_kubeconfig)
    translator = KubeApi.for_kubeconfig(service_identity(kube_cluster, "translator.yaml"))
    # the policies are enforced once the API server's policy informer has them
    probe = resource_claim_template(SPEC, "probe", kube_namespace)
    await eventually(lambda: _refused(admin, probe), timeout=30, what="the policies in force")
    try:
        yield admin, translator, kube_namespace
    finally:
        await admin.close()
        await translator.close()


async def _refused(api: KubeApi, template: dict) -> bool:
    path = object_path(RESOURCE_API_VERSION, "resourceclaimtemplates", namespace=template["metadata"]["namespace"])
    try:
        await api.create(path, template)
    except Rejected:
        return True
    await api.delete(object_path(RESOURCE_API_VERSION, "resourceclaimtemplates", template["metadata"]["name"],
                                 template["metadata"]["namespace"]))
    return False


def pod(name: str, template: str, *, gated: bool) -> dict:
    spec: dict = {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
                  "containers": [{"name": "main", "image": "registry.example/train:1",
                                  "resources": {"claims": [{"name": "gpu"}]}}]}
    if gated:
        spec["schedulingGates"] = [{"name": SCHEDULING_GATE}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


async def test_only_the_translator_makes_templates_of_the_class(cluster):
    admin, translator, ns = cluster
    path = object_path(RESOURCE_API_VERSION, "resourceclaimtemplates", namespace=ns)
    with pytest.raises(Rejected, match="made only by the Tessera translator"):
        await admin.create(path, resource_claim_template(SPEC, "tessera-main-abc", ns))  # cluster-admin too
    assert (await translator.create(path, resource_claim_template(SPEC, "tessera-main-abc", ns)))["metadata"]["uid"]


async def test_a_pod_using_a_translated_template_must_carry_the_gate(cluster):
    admin, translator, ns = cluster
    await translator.create(object_path(RESOURCE_API_VERSION, "resourceclaimtemplates", namespace=ns),
                            resource_claim_template(SPEC, "tessera-main-abc", ns))
    pods = object_path("v1", "pods", namespace=ns)
    with pytest.raises(Rejected, match="lacks the scheduling gate gpu.tessera.dev/placement"):
        await admin.create(pods, pod("ungated", "tessera-main-abc", gated=False))
    created = await admin.create(pods, pod("gated", "tessera-main-abc", gated=True))

    # Kubernetes' resourceclaim controller still makes the gated pod's claim (its identity may)
    async def claims() -> list[dict]:
        items, _ = await admin.list(object_path(RESOURCE_API_VERSION, "resourceclaims", namespace=ns))
        return [c for c in items if any(o.get("uid") == created["metadata"]["uid"]
                                        for o in c["metadata"].get("ownerReferences") or [])]
    [claim] = await eventually(claims, timeout=30, what="the resourceclaim controller's claim")

    # and nobody else can: a copy of it, made by hand, is refused
    copy = {"apiVersion": RESOURCE_API_VERSION, "kind": "ResourceClaim",
            "metadata": {"name": "by-hand", "namespace": ns}, "spec": claim["spec"]}
    with pytest.raises(Rejected, match="made only by the resourceclaim controller"):
        await admin.create(object_path(RESOURCE_API_VERSION, "resourceclaims", namespace=ns), copy)
