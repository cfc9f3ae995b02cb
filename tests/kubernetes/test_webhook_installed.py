"""deploy/k8s/webhook.yaml's MutatingWebhookConfiguration installed in the real kube-apiserver, which
calls the real translator (its rules, namespaceSelector and CEL matchConditions, AdmissionReview v1
over TLS verified against caBundle): pods are created through the API as kubectl creates them, GPU
pods come out translated and gated, and with the translator down only GPU pods are refused.

On the session's shared control plane the configuration differs from the shipped one in three
things only: its name (a test's own), ``clientConfig.url`` at the translator's loopback address in
place of ``clientConfig.service`` (no kube-proxy runs and the API server refuses loopback endpoints;
the Service route, with the certificate for ``tessera-translator-webhook.tessera-system.svc``, is
test_real_gpu_pod.py's), and one more namespaceSelector term naming the test's namespaces (so no
other test's pods reach this translator). The pods are created by a user of the namespaces with
the ``edit`` role, not an admin."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
import yaml

from tessera.shared.kubeapi import KubeApi, KubeError, object_path
from tessera.shared.kubeclaims import RESOURCE_API_VERSION, SCHEDULING_GATE, TENANT_LABEL
from translator_harness import kube_translator

from kit.kubecluster import apply, service_identity

WEBHOOK_YAML = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "webhook.yaml"


def installed_configuration(ca_bundle: str, url: str, namespaces: list[str]) -> dict:
    """The shipped configuration with the caBundle cert-manager's CA injector fills in, reached at
    ``url``, for ``namespaces`` only."""
    (config,) = [d for d in yaml.safe_load_all(WEBHOOK_YAML.read_text())
                 if d and d["kind"] == "MutatingWebhookConfiguration"]
    config["metadata"]["name"] = f"tessera-translator-{namespaces[0]}"
    for hook in config["webhooks"]:
        path = hook["clientConfig"].pop("service")["path"]
        hook["clientConfig"] = {"url": f"{url}{path}", "caBundle": ca_bundle}
        hook["namespaceSelector"]["matchExpressions"].append(
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": namespaces})
    return config


def pod(name: str, namespace: str, limits: dict | None = None) -> dict:
    container: dict = {"name": "main", "image": "nvcr.io/nvidia/pytorch:25.01-py3"}
    if limits:
        container["resources"] = {"limits": limits}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
            "spec": {"containers": [container]}}


GPU = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "8000"}


@pytest.fixture
async def cluster(kube_plane, nats_url, tmp_path):
    """(the translator's kubeconfig, a user's client, the tenant's namespace, a namespace of no tenant,
    install(translator))."""
    ml, scratch = (f"t-{uuid.uuid4().hex[:10]}" for _ in range(2))
    apply(kube_plane, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ml, "labels": {TENANT_LABEL: "alpha"}}},
                       {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": scratch}}]
          + [{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
              "metadata": {"name": "alice-edit", "namespace": ns},
              "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
              "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "alice"}]}
             for ns in (ml, scratch)])
    for ns in (ml, scratch):
        kube_plane.wait_for_service_account(ns, "default")  # a pod is refused until it exists
    user = KubeApi.for_kubeconfig(kube_plane.cert_kubeconfig(f"alice-{ml}", "alice"))
    identity = await asyncio.to_thread(service_identity, kube_plane, "translator.yaml")
    installed: list[str] = []

    def install(translator) -> None:
        config = installed_configuration(translator.authority.bundle, f"https://localhost:{translator.port}",
                                         [ml, scratch])
        apply(kube_plane, [config])
        installed.append(config["metadata"]["name"])
    try:
        yield identity, user, ml, scratch, install
    finally:
        await user.close()
        for name in installed:
            kube_plane.kubectl("delete", "mutatingwebhookconfiguration", name, "--ignore-not-found")
        kube_plane.kubectl("delete", "namespace", ml, scratch, "--wait=false", check=False)


async def test_pods_created_through_the_api_are_translated_only_when_they_ask_for_gpus(
        kube_plane, nats_url, cluster, tmp_path):
    identity, user, ml, scratch, install = cluster
    async with kube_translator(nats_url, identity, tmp_path / "tls") as translator:
        await translator.add_tenant("alpha")
        install(translator)
        gpu = await user.create(object_path("v1", "pods", namespace=ml), pod("trainer", ml, GPU))
        assert gpu["spec"]["schedulingGates"] == [{"name": SCHEDULING_GATE}]
        (entry,) = gpu["spec"]["resourceClaims"]
        admin = KubeApi.for_kubeconfig(kube_plane.admin_kubeconfig)
        try:
            assert await admin.get(object_path(RESOURCE_API_VERSION, "resourceclaimtemplates",
                                               entry["resourceClaimTemplateName"], ml)) is not None
        finally:
            await admin.close()
        assert "nvidia.com/gpu" not in gpu["spec"]["containers"][0]["resources"].get("limits", {})

        plain = await user.create(object_path("v1", "pods", namespace=ml), pod("web", ml, {"cpu": "1"}))
        assert "schedulingGates" not in plain["spec"] and "resourceClaims" not in plain["spec"]
        called = f'"configuration":"tessera-translator-{ml}"'
        sent = [e for e in kube_plane.audit() if e["user"]["username"] == "alice" and e["verb"] == "create"
                and any(k.startswith("mutation.webhook.admission.k8s.io/") and called in v
                        for k, v in (e.get("annotations") or {}).items())]
        assert [e["objectRef"]["name"] for e in sent] == ["trainer"]  # the CPU pod never reached the webhook

        with pytest.raises(KubeError) as refused:
            await user.create(object_path("v1", "pods", namespace=scratch), pod("trainer", scratch, GPU))
        assert refused.value.status == 403
        assert 'admission webhook "pods.translator.gpu.tessera.dev" denied the request' in str(refused.value)
        assert f"{TENANT_LABEL}=<tenant>" in str(refused.value)


async def test_with_the_translator_down_only_gpu_pods_are_refused(nats_url, cluster, tmp_path):
    identity, user, ml, _, install = cluster
    pods = object_path("v1", "pods", namespace=ml)
    async with kube_translator(nats_url, identity, tmp_path / "tls") as translator:
        install(translator)
    # The translator is gone; its configuration (failurePolicy: Fail) is still installed.
    created = await user.create(pods, pod("web", ml, {"cpu": "1", "memory": "1Gi"}))
    assert created["metadata"]["name"] == "web"
    await user.create(pods, pod("mig", ml, {"nvidia.com/mig-1g.5gb": "1"}))  # another plugin's GPUs
    with pytest.raises(KubeError) as refused:
        await user.create(pods, pod("trainer", ml, GPU))
    assert 'failed calling webhook "pods.translator.gpu.tessera.dev"' in str(refused.value)
    assert await user.get(f"{pods}/trainer") is None
