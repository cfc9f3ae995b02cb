"""The mutating webhook turns HAMi pods into DRA pods, denies bad ones, and never crashes."""

from __future__ import annotations

import base64
import copy
import json

import jsonpatch
import kubernetes_validate
import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer

from tessera.shared.events import ClaimSpec
from tessera.translator.webhook import CLAIMS_ANNOTATION, PodClaim, make_app, template_name

K8S = "1.34"


def container(name: str, limits: dict | None = None, **extra) -> dict:
    # Shaped as the API server sends it: defaults filled in, quantities canonical.
    resources = {"limits": limits, "requests": dict(limits)} if limits else {}
    return {
        "name": name,
        "image": "nvcr.io/nvidia/pytorch:25.01-py3",
        "command": ["python", "train.py"],
        "resources": resources,
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File",
        "imagePullPolicy": "IfNotPresent",
        **extra,
    }


def pod(containers: list[dict], annotations: dict | None = None, **spec_extra) -> dict:
    metadata: dict = {"name": "trainer", "namespace": "team-a", "labels": {"app": "trainer"}}
    if annotations is not None:
        metadata["annotations"] = annotations
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {
            "containers": containers,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 30,
            "dnsPolicy": "ClusterFirst",
            "serviceAccountName": "default",
            "schedulerName": "default-scheduler",
            "enableServiceLinks": True,
            "preemptionPolicy": "PreemptLowerPriority",
            "priority": 0,
            **spec_extra,
        },
        "status": {},
    }


def review(obj: dict | None, uid: str = "705ab4f5-6393-11e8-b7cc-42010a800002", **request_extra) -> dict:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": "trainer",
            "namespace": "team-a",
            "operation": "CREATE",
            "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
            "object": obj,
            "oldObject": None,
            "dryRun": False,
            "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"},
            **request_extra,
        },
    }


async def post(body, hook=None):
    async with TestClient(TestServer(make_app(hook))) as client:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        resp = await client.post("/mutate", data=data, headers={"Content-Type": "application/json"})
        if resp.status != 200:
            return resp.status, await resp.text()
        return resp.status, await resp.json()


def apply(obj: dict, response: dict) -> tuple[dict, list]:
    assert response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"]))
    return jsonpatch.apply_patch(copy.deepcopy(obj), ops), ops


GPU_LIMITS = {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1", "nvidia.com/gpumem": "10k", "nvidia.com/gpucores": "30"}


async def test_gpu_pod_is_rewritten_for_dra():
    seen: list[tuple[str, list[PodClaim]]] = []

    async def hook(namespace, claims):
        seen.append((namespace, claims))

    obj = pod([container("train", GPU_LIMITS)], {"nvidia.com/use-gputype": "H100"})
    status, body = await post(review(obj), hook)
    assert status == 200
    assert body["apiVersion"] == "admission.k8s.io/v1" and body["kind"] == "AdmissionReview"
    response = body["response"]
    assert response["uid"] == "705ab4f5-6393-11e8-b7cc-42010a800002"
    assert response["allowed"] is True

    patched, ops = apply(obj, response)
    paths = [op["path"] for op in ops]
    assert "/spec/containers/0/resources/limits/nvidia.com~1gpumem" in paths  # RFC 6901 escaping
    assert "/metadata/annotations/gpu.tessera.dev~1claims" in paths

    expected = ClaimSpec(gpus=1, memory_mib=10000, cores=30, use_types=["H100"])
    name = template_name("train", expected)
    assert name.startswith("tessera-train-")
    resources = patched["spec"]["containers"][0]["resources"]
    assert resources["limits"] == {"cpu": "4", "memory": "16Gi"}
    assert resources["requests"] == {"cpu": "4", "memory": "16Gi"}
    assert resources["claims"] == [{"name": name}]
    assert patched["spec"]["resourceClaims"] == [{"name": name, "resourceClaimTemplateName": name}]
    # kube-scheduler must not bind the pod before placement has allocated its claim.
    assert patched["spec"]["schedulingGates"] == [{"name": "gpu.tessera.dev/placement"}]
    recorded = json.loads(patched["metadata"]["annotations"][CLAIMS_ANNOTATION])
    assert msgspec.convert(recorded["train"], ClaimSpec) == expected
    assert patched["metadata"]["annotations"]["nvidia.com/use-gputype"] == "H100"
    kubernetes_validate.validate(patched, K8S, strict=True)

    ((namespace, (claim,)),) = seen
    assert namespace == "team-a"  # the pod's namespace, never the review's uid
    assert (claim.namespace, claim.pod, claim.container, claim.index) == ("team-a", "trainer", "train", 0)
    assert claim.spec == expected and claim.template_name == name
    assert claim.template["metadata"]["name"] == name
    assert claim.template["metadata"]["namespace"] == "team-a"
    kubernetes_validate.validate(claim.template, K8S, strict=True)


async def test_template_name_is_deterministic():
    obj = pod([container("train", GPU_LIMITS)])
    (_, a), (_, b) = await post(review(obj)), await post(review(obj, uid="other"))
    assert apply(obj, a["response"])[0]["spec"]["resourceClaims"] == apply(obj, b["response"])[0]["spec"]["resourceClaims"]


async def test_only_gpu_containers_change_and_existing_lists_are_appended_to():
    sidecar = container("log", {"cpu": "100m"})
    existing = {"name": "scratch", "resourceClaimTemplateName": "scratch-disk"}
    gpu = container("train", {"nvidia.com/gpu": "2", "nvidia.com/gpumem-percentage": "50"})
    gpu["resources"]["claims"] = [{"name": "scratch"}]
    obj = pod([sidecar, gpu], {"team": "vision"}, resourceClaims=[existing])
    status, body = await post(review(obj))
    assert status == 200
    patched, ops = apply(obj, body["response"])
    assert patched["spec"]["containers"][0] == sidecar
    name = template_name("train", ClaimSpec(gpus=2, memory_percent=50))
    assert patched["spec"]["containers"][1]["resources"]["claims"] == [{"name": "scratch"}, {"name": name}]
    assert patched["spec"]["containers"][1]["resources"]["limits"] == {}
    assert patched["spec"]["resourceClaims"] == [existing, {"name": name, "resourceClaimTemplateName": name}]
    assert patched["metadata"]["annotations"]["team"] == "vision"
    assert "train" in json.loads(patched["metadata"]["annotations"][CLAIMS_ANNOTATION])
    kubernetes_validate.validate(patched, K8S, strict=True)


async def test_existing_scheduling_gates_are_kept_and_ours_is_added_once():
    other = {"name": "example.com/quota"}
    obj = pod([container("train", GPU_LIMITS)], schedulingGates=[other])
    _, body = await post(review(obj))
    patched, _ = apply(obj, body["response"])
    assert patched["spec"]["schedulingGates"] == [other, {"name": "gpu.tessera.dev/placement"}]
    gated = pod([container("train", GPU_LIMITS)], schedulingGates=[{"name": "gpu.tessera.dev/placement"}])
    _, body = await post(review(gated))
    again, _ = apply(gated, body["response"])
    assert again["spec"]["schedulingGates"] == [{"name": "gpu.tessera.dev/placement"}]


async def test_pod_in_a_namespace_without_tenant_is_denied_before_any_template():
    created = []

    async def hook(namespace, claims):
        created.append(namespace)

    async def tenant_check(namespace):
        return f'namespace "{namespace}" names no Tessera tenant: set the label tessera.io/tenant=<tenant>'

    async with TestClient(TestServer(make_app(hook, tenant_check))) as client:
        resp = await client.post("/mutate", json=review(pod([container("train", GPU_LIMITS)])))
        response = (await resp.json())["response"]
    assert response["allowed"] is False
    assert response["status"]["code"] == 403
    assert 'namespace "team-a" names no Tessera tenant' in response["status"]["message"]
    assert "tessera.io/tenant" in response["status"]["message"]
    assert created == []


async def test_namespace_comes_from_the_request_not_the_object():
    seen = []

    async def hook(namespace, claims):
        seen.append((namespace, {c.template["metadata"]["namespace"] for c in claims}))

    obj = pod([container("train", GPU_LIMITS)])
    del obj["metadata"]["namespace"]  # a pod being created need not say where it goes
    _, body = await post(review(obj, namespace="team-b"), hook)
    assert body["response"]["allowed"] is True
    assert seen == [("team-b", {"team-b"})]
    status, text = await post(review(obj, namespace=""), hook)
    assert status == 400 and "request.namespace is missing" in text


async def test_bad_values_are_denied_naming_container_and_field():
    obj = pod([container("sidecar"), container("train", {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "150"})])
    status, body = await post(review(obj))
    assert status == 200
    response = body["response"]
    assert response["uid"] == "705ab4f5-6393-11e8-b7cc-42010a800002"
    assert response["allowed"] is False
    assert "patch" not in response
    message = response["status"]["message"]
    assert message.startswith('container "train" (spec.containers[1]): resources["nvidia.com/gpucores"]')
    assert "0 to 100" in message
    assert response["status"]["code"] == 422


async def test_bad_annotation_is_denied():
    obj = pod([container("train", {"nvidia.com/gpu": "1"})], {"hami.io/gpu-scheduler-policy": "fastest"})
    _, body = await post(review(obj))
    assert body["response"]["allowed"] is False
    assert 'annotations["hami.io/gpu-scheduler-policy"]' in body["response"]["status"]["message"]


async def test_requests_that_differ_from_limits_are_denied():
    c = container("train", {"nvidia.com/gpu": "1"})
    c["resources"]["requests"] = {"nvidia.com/gpu": "2"}
    _, body = await post(review(pod([c])))
    assert body["response"]["allowed"] is False
    assert "differs from limits" in body["response"]["status"]["message"]


async def test_gpu_in_init_container_is_denied():
    obj = pod([container("train")], initContainers=[container("warm", {"nvidia.com/gpu": "1"})])
    _, body = await post(review(obj))
    assert body["response"]["allowed"] is False
    assert 'init container "warm"' in body["response"]["status"]["message"]


@pytest.mark.parametrize(
    "obj",
    [
        pod([container("web", {"cpu": "1", "memory": "1Gi"})]),
        pod([container("web", {"nvidia.com/gpu": "0"})]),
        pod([container("web", {"nvidia.com/mig-1g.5gb": "1"})]),
    ],
    ids=["cpu-only", "zero-gpus", "mig-profile"],
)
async def test_pod_without_hami_request_is_allowed_unchanged(obj):
    called = []

    async def hook(uid, claims):
        called.append(uid)

    status, body = await post(review(obj), hook)
    assert status == 200
    assert body["response"] == {"uid": "705ab4f5-6393-11e8-b7cc-42010a800002", "allowed": True}
    assert called == []


async def test_other_operations_and_kinds_pass_through():
    obj = pod([container("train", GPU_LIMITS)])
    _, update = await post(review(obj, operation="UPDATE", oldObject=obj))
    assert update["response"] == {"uid": "705ab4f5-6393-11e8-b7cc-42010a800002", "allowed": True}
    _, delete = await post(review(None, operation="DELETE", oldObject=obj))
    assert delete["response"]["allowed"] is True
    _, deploy = await post(review({"kind": "Deployment"}, kind={"group": "apps", "version": "v1", "kind": "Deployment"}))
    assert deploy["response"]["allowed"] is True and "patch" not in deploy["response"]


async def test_dry_run_patches_without_side_effects():
    called = []

    async def hook(uid, claims):
        called.append(uid)

    _, body = await post(review(pod([container("train", GPU_LIMITS)]), dryRun=True), hook)
    assert body["response"]["allowed"] is True and "patch" in body["response"]
    assert called == []


async def test_hook_failure_denies_instead_of_erroring():
    async def hook(uid, claims):
        raise ConnectionError("apiserver unreachable")

    status, body = await post(review(pod([container("train", GPU_LIMITS)])), hook)
    assert status == 200
    response = body["response"]
    assert response["allowed"] is False
    assert response["status"]["code"] == 503
    assert "apiserver unreachable" in response["status"]["message"]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"{not json", "not JSON"),
        (b"[]", "JSON object"),
        ({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {}}, "admission.k8s.io/v1"),
        ({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}, "request is missing"),
        ({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"kind": {}}}, "uid is missing"),
        (review({"metadata": {}}), "spec.containers is missing"),
        (review("a pod"), "must be a Pod"),
        (review(pod(["not a container"])), "spec.containers[0] must be an object"),
        (review(pod([container("x", {"nvidia.com/gpu": "1"})], annotations=["a"])), "annotations must be an object"),
    ],
    ids=["not-json", "array", "v1beta1", "no-request", "no-uid", "no-spec", "object-string", "container-string", "annotations-list"],
)
async def test_malformed_review_is_a_400_with_a_reason(body, fragment):
    status, text = await post(body)
    assert status == 400
    assert text.startswith("malformed AdmissionReview")
    assert fragment in text


async def test_each_gpu_pod_outcome_is_heard_once_and_other_pods_are_not():
    heard: list[str] = []

    async def failing_hook(namespace, claims):
        raise RuntimeError("API server away")

    async def ask(obj, hook=None):
        async with TestClient(TestServer(make_app(hook, on_outcome=heard.append))) as client:
            resp = await client.post("/mutate", data=json.dumps(review(obj)), headers={"Content-Type": "application/json"})
            return (await resp.json())["response"]["allowed"]

    assert await ask(pod([container("train", GPU_LIMITS)])) is True
    assert await ask(pod([container("train", dict(GPU_LIMITS, **{"nvidia.com/gpucores": "150"}))])) is False
    assert await ask(pod([container("train", GPU_LIMITS)]), failing_hook) is False
    assert await ask(pod([container("web", {"cpu": "1"})])) is True  # no GPU: nothing to count
    assert heard == ["translated", "rejected", "unavailable"]
