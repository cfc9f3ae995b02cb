"""The emulator runs stored MutatingWebhookConfigurations as kube-apiserver does: matching (rules,
namespace and object selectors, CEL matchConditions), a verified-TLS AdmissionReview call, the
returned JSONPatch applied and validated, denials and failures reported in the real server's words."""

from __future__ import annotations

import asyncio

import pytest

from apiserver import ApiError
from kube_objects import configmap, namespace, pod
from webhook_server import CertificateAuthority, WebhookServer, allow
from kit import eventually

SERVICE = ("tessera-system", "hook", 443)
GPU_CONDITION = {"name": "asks-for-gpus", "expression":
                 "object.spec.containers.exists(c, has(c.resources) && has(c.resources.limits) && "
                 "'nvidia.com/gpu' in c.resources.limits)"}


def webhook_config(ca: CertificateAuthority, *, name: str = "hook.tessera.dev", failure: str = "Fail",
                   client: dict | None = None, timeout: int = 2, **extra) -> dict:
    hook = {"name": name, "admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": failure,
            "timeoutSeconds": timeout,
            "clientConfig": dict(client or {"service": {"namespace": SERVICE[0], "name": SERVICE[1],
                                                        "port": SERVICE[2], "path": "/mutate"}},
                                 caBundle=ca.bundle),
            "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"],
                       "scope": "Namespaced"}]}
    hook.update(extra)
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": "tessera-test"}, "webhooks": [hook]}


def gpu_pod(name: str, namespace: str = "default") -> dict:
    out = pod(name, namespace, gates=())
    out["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    return out


@pytest.fixture
def ca() -> CertificateAuthority:
    return CertificateAuthority()


@pytest.fixture
async def webhook(tmp_path, ca, apiserver):
    """A webhook serving a certificate for hook.tessera-system.svc, routed from its Service."""
    decisions: list = []

    def decide(request: dict) -> dict:
        return decisions.pop(0)(request) if decisions else allow()

    cert, key = ca.issue(tmp_path / "tls", ["hook.tessera-system.svc"])
    server = await WebhookServer(cert, key, decide).start()
    server.decisions = decisions
    apiserver.route_service(*SERVICE, server.url)
    try:
        yield server
    finally:
        await server.stop()


async def test_a_matching_webhook_mutates_the_pod_before_it_is_stored(apiserver, webhook, ca):
    await apiserver.create(webhook_config(ca))
    webhook.decisions.append(lambda request: allow([
        {"op": "add", "path": "/metadata/labels", "value": {"mutated": "yes"}},
        {"op": "add", "path": "/spec/schedulingGates", "value": [{"name": "gpu.tessera.dev/placement"}]}]))
    generated = dict(pod("", gates=()), metadata={"generateName": "worker-", "namespace": "default"})
    stored = await apiserver.create(generated)
    assert stored["metadata"]["labels"] == {"mutated": "yes"}
    assert stored["spec"]["schedulingGates"] == [{"name": "gpu.tessera.dev/placement"}]
    assert stored["metadata"]["name"].startswith("worker-")
    [request] = webhook.requests
    assert request["operation"] == "CREATE" and request["namespace"] == "default"
    assert request["kind"] == {"group": "", "version": "v1", "kind": "Pod"}
    assert request["resource"] == {"group": "", "version": "v1", "resource": "pods"}
    # admission runs before the registry names the object and gives it a uid, as on a real server
    assert request["name"] == "" and "uid" not in request["object"]["metadata"]
    assert request["oldObject"] is None


async def test_a_denial_is_reported_as_the_real_server_words_it(apiserver, webhook, ca):
    await apiserver.create(webhook_config(ca))
    webhook.decisions.append(lambda r: {"allowed": False, "status": {"code": 403, "message": "no tenant"}})
    with pytest.raises(ApiError) as denied:
        await apiserver.create(pod("p"))
    assert denied.value.code == 403
    assert denied.value.message == 'admission webhook "hook.tessera.dev" denied the request: no tenant'
    webhook.decisions.append(lambda r: {"allowed": False})
    with pytest.raises(ApiError) as denied:
        await apiserver.create(pod("p"))
    assert denied.value.code == 400 and denied.value.message.endswith("denied the request without explanation")
    assert apiserver.objects("v1", "pods") == []


async def test_rules_and_selectors_decide_which_writes_are_sent(apiserver, webhook, ca):
    config = webhook_config(ca, namespaceSelector={"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system"]}]},
        objectSelector={"matchExpressions": [{"key": "skip", "operator": "DoesNotExist"}]})
    await apiserver.create(config)
    await apiserver.create(pod("sent"))
    await apiserver.create(pod("system", "kube-system"))
    await apiserver.create(pod("labelled", labels={"skip": "1"}))
    await apiserver.create(configmap("not-a-pod"))
    await apiserver.patch("v1", "pods", "sent", {"metadata": {"labels": {"a": "b"}}}, "default")  # an UPDATE
    assert [r["object"]["metadata"]["name"] for r in webhook.requests] == ["sent"]


async def test_update_operations_carry_the_old_object(apiserver, webhook, ca):
    config = webhook_config(ca)
    config["webhooks"][0]["rules"][0]["operations"] = ["UPDATE"]
    await apiserver.create(config)
    await apiserver.create(pod("p"))
    await apiserver.patch("v1", "pods", "p", {"metadata": {"labels": {"a": "b"}}}, "default")
    [request] = webhook.requests
    assert request["operation"] == "UPDATE"
    assert request["oldObject"]["metadata"].get("labels") is None
    assert request["object"]["metadata"]["labels"] == {"a": "b"}


async def test_match_conditions_send_only_gpu_pods(apiserver, webhook, ca):
    await apiserver.create(webhook_config(ca, matchConditions=[GPU_CONDITION]))
    await apiserver.create(pod("plain"))
    await apiserver.create(gpu_pod("gpu"))
    assert [r["object"]["metadata"]["name"] for r in webhook.requests] == ["gpu"]


async def test_a_condition_that_errors_counts_as_the_failure_policy_says(apiserver, webhook, ca):
    broken = {"name": "broken", "expression": "object.spec.nosuchfield == 1"}
    await apiserver.create(webhook_config(ca, matchConditions=[broken]))
    with pytest.raises(ApiError) as refused:
        await apiserver.create(pod("p"))
    assert refused.value.code == 500 and "failed to evaluate match conditions" in refused.value.message
    await apiserver.replace(dict(apiserver.object("admissionregistration.k8s.io/v1",
                                                  "mutatingwebhookconfigurations", "tessera-test"),
                                 webhooks=webhook_config(ca, failure="Ignore", matchConditions=[broken])["webhooks"]))
    await apiserver.create(pod("p"))
    assert webhook.requests == []


async def test_a_condition_that_does_not_compile_is_refused_when_configured(apiserver, ca):
    with pytest.raises(ApiError) as refused:
        await apiserver.create(webhook_config(ca, matchConditions=[{"name": "bad", "expression": "object.("}]))
    assert refused.value.code == 422 and "webhooks[0].matchConditions[0].expression" in refused.value.message


async def test_an_unreachable_webhook_fails_closed_or_open_by_policy(apiserver, ca):
    apiserver.route_service(*SERVICE, "https://127.0.0.1:1")  # nothing listens there
    await apiserver.create(webhook_config(ca))
    with pytest.raises(ApiError) as refused:
        await apiserver.create(pod("p"))
    assert refused.value.code == 500
    assert refused.value.message.startswith('Internal error occurred: failed calling webhook "hook.tessera.dev": '
                                            'failed to call webhook: Post "https://127.0.0.1:1/mutate"')
    config = apiserver.object("admissionregistration.k8s.io/v1", "mutatingwebhookconfigurations", "tessera-test")
    config["webhooks"][0]["failurePolicy"] = "Ignore"
    await apiserver.replace(config)
    assert (await apiserver.create(pod("p")))["metadata"]["name"] == "p"


async def test_a_slow_webhook_times_out(apiserver, webhook, ca):
    await apiserver.create(webhook_config(ca, timeout=1))
    release = asyncio.Event()

    async def slow(request):
        await release.wait()
        return allow()

    webhook.decisions.append(slow)
    try:
        with pytest.raises(ApiError) as refused:
            await apiserver.create(pod("p"))
    finally:
        release.set()
    assert refused.value.code == 500 and "context deadline exceeded" in refused.value.message


async def test_the_certificate_is_verified_against_the_ca_bundle_and_service_name(apiserver, webhook, ca,
                                                                                   tmp_path):
    await apiserver.create(webhook_config(CertificateAuthority("another-ca")))
    with pytest.raises(ApiError) as refused:
        await apiserver.create(pod("p"))
    assert refused.value.code == 500 and "certificate verify failed" in refused.value.message
    # right CA, but the certificate is for another Service name than the one configured
    apiserver.route_service("tessera-system", "other", 443, webhook.url)
    config = apiserver.object("admissionregistration.k8s.io/v1", "mutatingwebhookconfigurations", "tessera-test")
    config["webhooks"] = webhook_config(ca, client={"service": {"namespace": "tessera-system", "name": "other",
                                                                "port": 443}})["webhooks"]
    await apiserver.replace(config)
    with pytest.raises(ApiError) as refused:
        await apiserver.create(pod("p"))
    assert "certificate is not valid for 'other.tessera-system.svc'" in refused.value.message
    assert webhook.requests == []


async def test_a_url_client_config_reaches_the_webhook_directly(apiserver, webhook, ca):
    await apiserver.create(webhook_config(ca, client={"url": f"{webhook.url}/mutate"}))
    await apiserver.create(pod("p"))
    assert len(webhook.requests) == 1


async def test_the_mutated_object_is_validated_strictly(apiserver, webhook, ca):
    await apiserver.create(webhook_config(ca))
    webhook.decisions.append(lambda r: allow([{"op": "add", "path": "/spec/schedulingGate", "value": []}]))
    with pytest.raises(ApiError) as refused:
        await apiserver.create(pod("p"))
    assert refused.value.code == 422 and "spec.schedulingGate" in refused.value.message
    assert apiserver.objects("v1", "pods") == []


async def test_a_namespace_selector_on_a_tenant_label(apiserver, webhook, ca):
    await apiserver.create(namespace("team-a", {"tessera.io/tenant": "a"}))
    await apiserver.create(namespace("team-b"))
    await apiserver.create(webhook_config(ca, namespaceSelector={"matchLabels": {"tessera.io/tenant": "a"}}))
    await apiserver.create(pod("p", "team-a"))
    await apiserver.create(pod("p", "team-b"))
    assert [r["namespace"] for r in webhook.requests] == ["team-a"]


async def test_writes_racing_through_a_slow_webhook_lose_nothing(apiserver, webhook, ca):
    config = webhook_config(ca)
    config["webhooks"][0]["rules"][0]["operations"] = ["UPDATE"]
    await apiserver.create(config)
    created = await apiserver.create(pod("p"))
    release = asyncio.Event()

    async def slow(request):
        await release.wait()
        return allow()

    webhook.decisions.append(slow)
    first = asyncio.create_task(apiserver.patch("v1", "pods", "p", {"metadata": {"labels": {"a": "1"}}}, "default"))
    await eventually(lambda: webhook.requests, every=0.01)
    await apiserver.patch("v1", "pods", "p", {"metadata": {"labels": {"b": "2"}}}, "default")
    stale = asyncio.create_task(apiserver.patch("v1", "pods", "p", {"metadata": {
        "labels": {"c": "3"}, "resourceVersion": created["metadata"]["resourceVersion"]}}, "default"))
    release.set()
    await first
    with pytest.raises(ApiError) as lost:
        await stale
    assert lost.value.code == 409
    assert apiserver.object("v1", "pods", "p", "default")["metadata"]["labels"] == {"a": "1", "b": "2"}
