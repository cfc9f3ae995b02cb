"""Pod admission through the real translator (webhook over TLS, template writer, namespace reader)
on the real kube-apiserver, the translator acting as its deploy/k8s ServiceAccount: a GPU pod gets
its ResourceClaimTemplate in its own namespace, its claim and the placement gate, and the stored pod
is valid; a pod of a namespace without a tenant is refused saying which label to set. The test
makes the API server's admission call (an AdmissionReview over TLS) and stores what comes back;
test_webhook_installed.py has the API server make it."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from tessera.shared.kubeapi import KubeApi, object_path
from tessera.shared.kubeclaims import RESOURCE_API_VERSION, SCHEDULING_GATE, TENANT_LABEL
from tessera.translator import dra
from tessera.translator.hami import translate
from tessera.translator.kube import TemplateWriter
from tessera.translator.webhook import ContainerRequest, PodClaim
from translator_harness import kube_translator

from kit.kubecluster import KubeControlPlane, apply, service_identity


def gpu_pod(name: str, namespace: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
            "spec": {"containers": [{"name": "train", "image": "nvcr.io/nvidia/pytorch:25.01-py3",
                                     "resources": {"limits": {"cpu": "2", "nvidia.com/gpu": "1",
                                                              "nvidia.com/gpumem": "8000"}}}]}}


def new_namespace(plane: KubeControlPlane, labels: dict | None = None, annotations: dict | None = None) -> str:
    name = f"t-{uuid.uuid4().hex[:10]}"
    apply(plane, [{"apiVersion": "v1", "kind": "Namespace",
                   "metadata": {"name": name, "labels": labels or {}, "annotations": annotations or {}}}])
    plane.wait_for_service_account(name, "default")  # a pod is refused until it exists
    return name


@pytest.fixture(autouse=True)
def namespaces_removed(kube_plane):
    """The namespaces a test made on the session's plane go when it ends."""
    before = set(kube_plane.kubectl("get", "namespaces", "-o", "name").stdout.split())
    yield
    made = set(kube_plane.kubectl("get", "namespaces", "-o", "name").stdout.split()) - before
    if made:
        kube_plane.kubectl("delete", *sorted(made), "--wait=false", check=False)



@pytest.fixture
async def translator(nats_url, kube_plane, tmp_path):
    identity = await asyncio.to_thread(service_identity, kube_plane, "translator.yaml")
    async with kube_translator(nats_url, identity, tmp_path / "webhook-tls") as t:
        yield t


async def templates(admin: KubeApi, namespace: str) -> list[dict]:
    items, _ = await admin.list(object_path(RESOURCE_API_VERSION, "resourceclaimtemplates", namespace=namespace))
    return items


async def test_gpu_pod_gets_a_template_in_its_namespace_a_claim_and_the_gate(kube_plane, admin, translator):
    ns = new_namespace(kube_plane, {TENANT_LABEL: "alpha"})
    await translator.add_tenant("alpha")
    pod = await translator.admit(gpu_pod("trainer", ns), ns)
    stored = await admin.create(object_path("v1", "pods", namespace=ns), pod)  # validated as a core/v1 Pod

    (entry,) = stored["spec"]["resourceClaims"]
    [template] = await templates(admin, ns)  # in the pod's namespace
    assert template["metadata"]["name"] == entry["resourceClaimTemplateName"]
    container = stored["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"cpu": "2"}
    assert container["resources"]["claims"] == [{"name": entry["name"]}]
    assert stored["spec"]["schedulingGates"] == [{"name": SCHEDULING_GATE}]

    # A second pod of the same shape reuses the template (its name is the claim's hash).
    again = await admin.create(object_path("v1", "pods", namespace=ns),
                               await translator.admit(gpu_pod("trainer-2", ns), ns))
    assert again["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] == entry["resourceClaimTemplateName"]
    assert len(await templates(admin, ns)) == 1


@pytest.mark.parametrize(
    ("labels", "fragment"),
    [
        ({}, 'namespace "{ns}" names no Tessera tenant'),
        ({TENANT_LABEL: "ghost"}, "tenant 'ghost' (tessera.io/tenant), which does not exist"),
    ],
    ids=["no-label", "unknown-tenant"],
)
async def test_pod_of_a_namespace_without_a_tenant_is_refused(kube_plane, admin, translator, labels, fragment):
    ns = new_namespace(kube_plane, labels)
    response = await translator.review(gpu_pod("trainer", ns), ns)
    assert response["allowed"] is False
    assert response["status"]["code"] == 403
    assert fragment.format(ns=ns) in response["status"]["message"]
    assert TENANT_LABEL in response["status"]["message"]
    assert await templates(admin, ns) == []


async def test_tenant_may_be_named_by_an_annotation(kube_plane, translator):
    ns = new_namespace(kube_plane, annotations={TENANT_LABEL: "beta"})
    await translator.add_tenant("beta")
    pod = await translator.admit(gpu_pod("trainer", ns), ns)
    assert pod["spec"]["schedulingGates"] == [{"name": SCHEDULING_GATE}]


async def test_invalid_gpu_request_is_denied_naming_the_field(kube_plane, admin, translator):
    ns = new_namespace(kube_plane, {TENANT_LABEL: "alpha"})
    await translator.add_tenant("alpha")
    bad = gpu_pod("trainer", ns)
    bad["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpucores"] = "150"
    response = await translator.review(bad, ns)
    assert response["allowed"] is False and response["status"]["code"] == 422
    assert 'resources["nvidia.com/gpucores"]' in response["status"]["message"]
    assert await templates(admin, ns) == []


async def test_template_writer_tolerates_the_template_already_there(kube_plane, admin):
    """A retried admission (or a second replica) writes the same template again: success."""
    ns = new_namespace(kube_plane)
    spec = translate({"nvidia.com/gpu": 1, "nvidia.com/gpumem": 8000})
    template = dra.resource_claim_template(spec, "tessera-main-abc", ns)
    claim = PodClaim(namespace=ns, pod="train", spec=spec, template_name="tessera-main-abc", template=template,
                     containers=(ContainerRequest(container="main", index=0, spec=spec, request=None),))
    kube = KubeApi.for_kubeconfig(await asyncio.to_thread(service_identity, kube_plane, "translator.yaml"))
    try:
        writer = TemplateWriter(kube)
        await writer(ns, [claim])
        await writer(ns, [claim])
    finally:
        await kube.close()
    (stored,) = await templates(admin, ns)
    assert (stored["metadata"]["namespace"], stored["metadata"]["name"]) == (ns, "tessera-main-abc")


async def test_api_server_unreachable_denies_the_gpu_pod_as_retryable(nats_url, tmp_path, breakable_plane):
    """On the session's spare control plane, whose API server is stopped and started."""
    plane = breakable_plane
    ns = new_namespace(plane, {TENANT_LABEL: "alpha"})
    identity = await asyncio.to_thread(service_identity, plane, "translator.yaml")
    async with kube_translator(nats_url, identity, tmp_path / "webhook-tls") as translator:
        await translator.add_tenant("alpha")
        await asyncio.to_thread(plane.stop_apiserver)
        response = await translator.review(gpu_pod("trainer", ns), ns)
        assert response["allowed"] is False and response["status"]["code"] == 503
        assert "retry" in response["status"]["message"]
        # Once it answers again, the same pod is admitted.
        await asyncio.to_thread(plane.start_apiserver)
        assert (await translator.admit(gpu_pod("trainer", ns), ns))["spec"]["schedulingGates"]
    plane.kubectl("delete", "namespace", ns, "--wait=false")
