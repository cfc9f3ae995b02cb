"""Pod admission through the real translator (webhook over TLS, template writer, namespace reader)
against the API-server emulator: a GPU pod gets its ResourceClaimTemplate in its own namespace, its
claim and the placement gate, and the stored pod is valid; a pod of a namespace without a tenant is
refused saying which label to set."""

from __future__ import annotations

import pytest

from tessera.shared.kubeclaims import RESOURCE_API_VERSION, SCHEDULING_GATE, TENANT_LABEL
from tessera.translator import dra
from tessera.translator.hami import translate
from tessera.translator.kube import TemplateWriter
from tessera.translator.webhook import ContainerRequest, PodClaim
from translator_harness import kube_translator


def gpu_pod(name: str, namespace: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
            "spec": {"containers": [{"name": "train", "image": "nvcr.io/nvidia/pytorch:25.01-py3",
                                     "resources": {"limits": {"cpu": "2", "nvidia.com/gpu": "1",
                                                              "nvidia.com/gpumem": "8000"}}}]}}


@pytest.fixture
async def translator(nats_url, apiserver, tmp_path):
    async with kube_translator(nats_url, apiserver, tmp_path / "webhook-tls") as t:
        yield t


async def test_gpu_pod_gets_a_template_in_its_namespace_a_claim_and_the_gate(apiserver, translator):
    await apiserver.create({"apiVersion": "v1", "kind": "Namespace",
                            "metadata": {"name": "ml", "labels": {TENANT_LABEL: "alpha"}}})
    await translator.add_tenant("alpha")
    pod = await translator.admit(gpu_pod("trainer", "ml"), "ml")
    stored = await apiserver.create(pod)  # strictly validated as a core/v1 Pod

    (entry,) = stored["spec"]["resourceClaims"]
    template = apiserver.object(RESOURCE_API_VERSION, "resourceclaimtemplates", entry["resourceClaimTemplateName"], "ml")
    assert template is not None, "the template is not in the pod's namespace"
    assert [t["metadata"]["namespace"] for t in apiserver.objects(RESOURCE_API_VERSION, "resourceclaimtemplates")] == ["ml"]
    container = stored["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"cpu": "2"}
    assert container["resources"]["claims"] == [{"name": entry["name"]}]
    assert stored["spec"]["schedulingGates"] == [{"name": SCHEDULING_GATE}]

    # A second pod of the same shape reuses the template (its name is the claim's hash).
    again = await apiserver.create(await translator.admit(gpu_pod("trainer-2", "ml"), "ml"))
    assert again["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] == entry["resourceClaimTemplateName"]
    assert len(apiserver.objects(RESOURCE_API_VERSION, "resourceclaimtemplates")) == 1


@pytest.mark.parametrize(
    ("metadata", "fragment"),
    [
        ({"name": "scratch"}, 'namespace "scratch" names no Tessera tenant'),
        ({"name": "scratch", "labels": {TENANT_LABEL: "ghost"}}, "tenant 'ghost' (tessera.io/tenant), which does not exist"),
    ],
    ids=["no-label", "unknown-tenant"],
)
async def test_pod_of_a_namespace_without_a_tenant_is_refused(apiserver, translator, metadata, fragment):
    await apiserver.create({"apiVersion": "v1", "kind": "Namespace", "metadata": metadata})
    response = await translator.review(gpu_pod("trainer", "scratch"), "scratch")
    assert response["allowed"] is False
    assert response["status"]["code"] == 403
    assert fragment in response["status"]["message"]
    assert TENANT_LABEL in response["status"]["message"]
    assert apiserver.objects(RESOURCE_API_VERSION, "resourceclaimtemplates") == []


async def test_tenant_may_be_named_by_an_annotation(apiserver, translator):
    await apiserver.create({"apiVersion": "v1", "kind": "Namespace",
                            "metadata": {"name": "vision", "annotations": {TENANT_LABEL: "beta"}}})
    await translator.add_tenant("beta")
    pod = await translator.admit(gpu_pod("trainer", "vision"), "vision")
    assert pod["spec"]["schedulingGates"] == [{"name": SCHEDULING_GATE}]


async def test_invalid_gpu_request_is_denied_naming_the_field(apiserver, translator):
    await apiserver.create({"apiVersion": "v1", "kind": "Namespace",
                            "metadata": {"name": "ml", "labels": {TENANT_LABEL: "alpha"}}})
    await translator.add_tenant("alpha")
    bad = gpu_pod("trainer", "ml")
    bad["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpucores"] = "150"
    response = await translator.review(bad, "ml")
    assert response["allowed"] is False and response["status"]["code"] == 422
    assert 'resources["nvidia.com/gpucores"]' in response["status"]["message"]
    assert apiserver.objects(RESOURCE_API_VERSION, "resourceclaimtemplates") == []


async def test_template_writer_tolerates_the_template_already_there(apiserver, kube):
    """A retried admission (or a second replica) writes the same template again: success."""
    await apiserver.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml"}})
    spec = translate({"nvidia.com/gpu": 1, "nvidia.com/gpumem": 8000})
    template = dra.resource_claim_template(spec, "tessera-main-abc", "ml")
    claim = PodClaim(namespace="ml", pod="train", spec=spec, template_name="tessera-main-abc", template=template,
                     containers=(ContainerRequest(container="main", index=0, spec=spec, request=None),))
    writer = TemplateWriter(kube)
    await writer("ml", [claim])
    await writer("ml", [claim])
    (stored,) = apiserver.objects(RESOURCE_API_VERSION, "resourceclaimtemplates")
    assert (stored["metadata"]["namespace"], stored["metadata"]["name"]) == ("ml", "tessera-main-abc")


async def test_api_server_unreachable_denies_the_gpu_pod_as_retryable(apiserver, translator):
    await apiserver.create({"apiVersion": "v1", "kind": "Namespace",
                            "metadata": {"name": "ml", "labels": {TENANT_LABEL: "alpha"}}})
    await translator.add_tenant("alpha")
    apiserver.fail("GET", r"^/api/v1/namespaces/ml$", status=503)
    response = await translator.review(gpu_pod("trainer", "ml"), "ml")
    assert response["allowed"] is False and response["status"]["code"] == 503
    assert "retry" in response["status"]["message"]
    # Once it answers again, the same pod is admitted.
    assert (await translator.admit(gpu_pod("trainer", "ml"), "ml"))["spec"]["schedulingGates"]
