"""deploy/k8s/webhook.yaml's MutatingWebhookConfiguration installed in the API-server emulator,
which calls the real translator as kube-apiserver does (its rules, namespaceSelector and CEL
matchConditions, AdmissionReview v1 over TLS verified against caBundle for
``tessera-translator-webhook.tessera-system.svc``): pods are created through the API as kubectl
creates them, GPU pods come out translated and gated, and with the translator down only GPU pods
are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tessera.shared.kubeapi import KubeError, object_path
from tessera.shared.kubeclaims import RESOURCE_API_VERSION, SCHEDULING_GATE, TENANT_LABEL
from translator_harness import kube_translator

WEBHOOK_YAML = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "webhook.yaml"
PODS = object_path("v1", "pods", namespace="ml")


def installed_configuration(ca_bundle: str) -> dict:
    """The shipped configuration with the caBundle cert-manager's CA injector fills in."""
    (config,) = [d for d in yaml.safe_load_all(WEBHOOK_YAML.read_text())
                 if d and d["kind"] == "MutatingWebhookConfiguration"]
    for hook in config["webhooks"]:
        hook["clientConfig"]["caBundle"] = ca_bundle
    return config


def pod(name: str, limits: dict | None = None) -> dict:
    container: dict = {"name": "main", "image": "nvcr.io/nvidia/pytorch:25.01-py3"}
    if limits:
        container["resources"] = {"limits": limits}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "ml"},
            "spec": {"containers": [container]}}


GPU = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "8000"}


async def install(apiserver, translator) -> None:
    await apiserver.create(installed_configuration(translator.authority.bundle))
    apiserver.route_service("tessera-system", "tessera-translator-webhook", 443, f"https://127.0.0.1:{translator.port}")


@pytest.fixture
async def namespaces(apiserver):
    await apiserver.create({"apiVersion": "v1", "kind": "Namespace",
                            "metadata": {"name": "ml", "labels": {TENANT_LABEL: "alpha"}}})
    await apiserver.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "scratch"}})


async def test_pods_created_through_the_api_are_translated_only_when_they_ask_for_gpus(
        nats_url, apiserver, kube, namespaces, tmp_path):
    async with kube_translator(nats_url, apiserver, tmp_path / "tls") as translator:
        await translator.add_tenant("alpha")
        await install(apiserver, translator)
        gpu = await kube.create(PODS, pod("trainer", GPU))
        assert gpu["spec"]["schedulingGates"] == [{"name": SCHEDULING_GATE}]
        (entry,) = gpu["spec"]["resourceClaims"]
        assert apiserver.object(RESOURCE_API_VERSION, "resourceclaimtemplates",
                                entry["resourceClaimTemplateName"], "ml") is not None
        assert "nvidia.com/gpu" not in gpu["spec"]["containers"][0]["resources"].get("limits", {})

        plain = await kube.create(PODS, pod("web", {"cpu": "1"}))
        assert "schedulingGates" not in plain["spec"] and "resourceClaims" not in plain["spec"]
        sent = [r["object"]["metadata"]["name"] for r in apiserver.admission.calls]
        assert sent == ["trainer"]  # the CPU pod never reached the webhook

        with pytest.raises(KubeError) as refused:
            await kube.create(object_path("v1", "pods", namespace="scratch"),
                              pod("trainer", GPU) | {"metadata": {"name": "trainer", "namespace": "scratch"}})
        assert refused.value.status == 403
        assert 'admission webhook "pods.translator.gpu.tessera.dev" denied the request' in str(refused.value)
        assert f"{TENANT_LABEL}=<tenant>" in str(refused.value)


async def test_with_the_translator_down_only_gpu_pods_are_refused(nats_url, apiserver, kube, namespaces, tmp_path):
    async with kube_translator(nats_url, apiserver, tmp_path / "tls") as translator:
        await install(apiserver, translator)
    # The translator is gone; its configuration (failurePolicy: Fail) is still installed.
    created = await kube.create(PODS, pod("web", {"cpu": "1", "memory": "1Gi"}))
    assert created["metadata"]["name"] == "web"
    await kube.create(PODS, pod("mig", {"nvidia.com/mig-1g.5gb": "1"}))  # another plugin's GPUs
    with pytest.raises(KubeError) as refused:
        await kube.create(PODS, pod("trainer", GPU))
    assert 'failed calling webhook "pods.translator.gpu.tessera.dev"' in str(refused.value)
    assert apiserver.object("v1", "pods", "trainer", "ml") is None
