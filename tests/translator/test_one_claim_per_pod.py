"""A pod with several GPU containers is one claim: one template, one request per container.

Placement allocates a claim on one node; so a pod whose containers each had a claim of their own
could have them allocated on two nodes and never run (issue 22, defect 5). The webhook gives the
pod one ResourceClaimTemplate with one request per GPU container, named after it, and each
container's ``resources.claims`` entry names its own request; the ResourceClaim made from that
template gives the translator back the whole claim.
"""

from __future__ import annotations

import base64
import json

import jsonpatch
import kubernetes_validate
import pytest
from aiohttp.test_utils import TestClient, TestServer

from tessera.shared.events import ClaimSpec, RequestSpec, request_specs
from tessera.translator import claimflow, dra
from tessera.translator.webhook import CLAIMS_ANNOTATION, PodClaim, make_app, template_name

K8S = "1.34"
UID = "6f1c2a4e-8b3d-4c5e-9f7a-1b2c3d4e5f60"


def container(name: str, limits: dict) -> dict:
    resources = {"limits": limits, "requests": dict(limits)} if limits else {}
    return {"name": name, "image": "busybox:1.36", "resources": resources}


def pod(containers: list[dict], annotations: dict | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "trainer", "namespace": "team-a", "annotations": annotations or {}},
            "spec": {"containers": containers, "restartPolicy": "Never"}}


async def _admit(obj: dict) -> tuple[dict, list[PodClaim]]:
    """The pod as the webhook patches it, and the claims it hands the template writer."""
    seen: list[list[PodClaim]] = []

    async def hook(namespace, claims):
        seen.append(claims)

    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
              "request": {"uid": "705ab4f5-6393-11e8-b7cc-42010a800002", "kind": {"group": "", "version": "v1",
                          "kind": "Pod"}, "namespace": "team-a", "operation": "CREATE", "object": obj}}
    async with TestClient(TestServer(make_app(hook))) as client:
        resp = await client.post("/mutate", json=review)
        assert resp.status == 200, await resp.text()
        response = (await resp.json())["response"]
    assert response["allowed"] is True, response
    patched = jsonpatch.apply_patch(obj, json.loads(base64.b64decode(response["patch"])))
    (claims,) = seen
    return patched, claims


async def test_two_gpu_containers_get_one_template_with_a_request_each():
    sidecar = container("log", {"cpu": "100m"})
    train = container("train", {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000"})
    evaluate = container("eval", {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000", "nvidia.com/gpucores": "20"})
    obj = pod([train, sidecar, evaluate], {"nvidia.com/use-gputype": "H100"})
    patched, (claim,) = await _admit(obj)

    requests = [RequestSpec(name="train", memory_mib=3000, use_types=["H100"]),
                RequestSpec(name="eval", memory_mib=1000, cores=20, use_types=["H100"])]
    expected = ClaimSpec(memory_mib=3000, use_types=["H100"], requests=requests)
    assert claim.spec == expected
    name = template_name("train-eval", expected)
    assert claim.template_name == name
    # one template in the pod, each GPU container claiming its own request of it
    assert patched["spec"]["resourceClaims"] == [{"name": name, "resourceClaimTemplateName": name}]
    containers = patched["spec"]["containers"]
    assert containers[0]["resources"]["claims"] == [{"name": name, "request": "train"}]
    assert "claims" not in containers[1]["resources"]
    assert containers[2]["resources"]["claims"] == [{"name": name, "request": "eval"}]
    assert patched["spec"]["schedulingGates"] == [{"name": "gpu.tessera.dev/placement"}]
    assert set(json.loads(patched["metadata"]["annotations"][CLAIMS_ANNOTATION])) == {"train", "eval"}
    kubernetes_validate.validate(patched, K8S, strict=True)

    devices = claim.template["spec"]["spec"]["devices"]
    assert [r["name"] for r in devices["requests"]] == ["train", "eval"]
    assert [r["exactly"]["capacity"]["requests"] for r in devices["requests"]] == [
        {"memory": "3000Mi", "cores": "0"}, {"memory": "1000Mi", "cores": "20"}]
    assert [c["requests"] for c in devices["config"]] == [["train", "eval"]]
    kubernetes_validate.validate(claim.template, K8S, strict=True)

    # the ResourceClaim the resourceclaim controller makes of it gives the whole claim back
    doc = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
           "metadata": {"name": "trainer-x", "namespace": "team-a", "uid": UID}, "spec": claim.template["spec"]["spec"]}
    assert claimflow.recover_spec(doc) == expected
    assert [n for n, _ in request_specs(claimflow.recover_spec(doc))] == ["train", "eval"]


async def test_one_gpu_container_keeps_its_claim_of_one_request():
    obj = pod([container("train", {"nvidia.com/gpu": "2", "nvidia.com/gpumem": "4000"}), container("log", {})])
    patched, (claim,) = await _admit(obj)
    assert claim.spec == ClaimSpec(gpus=2, memory_mib=4000)
    assert patched["spec"]["containers"][0]["resources"]["claims"] == [{"name": claim.template_name}]
    assert [r["name"] for r in claim.template["spec"]["spec"]["devices"]["requests"]] == ["gpu"]


async def test_the_pod_claim_has_the_highest_runtime_priority_of_its_containers():
    low = container("a", {"nvidia.com/gpu": "1", "nvidia.com/priority": "1"})
    high = container("b", {"nvidia.com/gpu": "1", "nvidia.com/priority": "0"})
    _, (claim,) = await _admit(pod([low, high]))
    assert claim.spec.task_priority == 0  # HAMi's 0 is high
    assert claim.spec.priority == 0  # ... and no scheduling priority: the pod has no PriorityClass
    assert [r.name for r in claim.spec.requests] == ["a", "b"]


@pytest.mark.parametrize(("priority", "expected"), [(1000000, 1000000), (2000001000, 2000001000), (-10, 0),
                                                    (None, 0)])
async def test_the_pod_claim_takes_the_scheduling_priority_of_the_pods_priority_class(priority, expected):
    obj = pod([container("a", {"nvidia.com/gpu": "1", "nvidia.com/priority": "1"})])
    if priority is not None:  # what the API server's Priority admission wrote from priorityClassName
        obj["spec"]["priorityClassName"] = "training"
        obj["spec"]["priority"] = priority
    _, (claim,) = await _admit(obj)
    assert (claim.spec.priority, claim.spec.task_priority) == (expected, 1)
    params = claim.template["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]
    assert dra.spec_from_parameters(params).priority == expected  # what the ResourceClaim gives back


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda d: d["requests"].pop(), "requests of class gpu.tessera.dev are ['train']"),
        (lambda d: d["requests"][1]["exactly"].update(count=2), "requests['eval'] asks for [2] devices"),
        (lambda d: d["config"][0].update(requests=["train"]), "applies to requests ['train']"),
    ],
)
def test_a_claim_whose_requests_disagree_with_its_parameters_is_refused(change, fragment):
    spec = ClaimSpec(memory_mib=3000, requests=[RequestSpec(name="train", memory_mib=3000),
                                                RequestSpec(name="eval", memory_mib=1000)])
    doc = dra.resource_claim(spec, "trainer-x", "team-a")
    doc["metadata"]["uid"] = UID
    change(doc["spec"]["devices"])
    with pytest.raises(claimflow.Unrecoverable, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        claimflow.recover_spec(doc)


def test_request_names_used_twice_are_refused():
    spec = ClaimSpec(requests=[RequestSpec(name="a"), RequestSpec(name="a")])
    with pytest.raises(ValueError, match="distinct names"):
        request_specs(spec)
    with pytest.raises(ValueError, match="distinct names"):
        dra.spec_from_parameters(dra.parameters(spec))


@pytest.mark.parametrize(("policy", "may_preempt"), [("Never", False), ("PreemptLowerPriority", True), (None, True)])
async def test_the_pod_claim_may_preempt_only_as_its_priority_class_allows(policy, may_preempt):
    obj = pod([container("a", {"nvidia.com/gpu": "1"})])
    obj["spec"]["priorityClassName"] = "batch"
    obj["spec"]["priority"] = 1000
    if policy is not None:  # what the API server's Priority admission copied from the PriorityClass
        obj["spec"]["preemptionPolicy"] = policy
    _, (claim,) = await _admit(obj)
    assert claim.spec.may_preempt is may_preempt
    params = claim.template["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]
    assert dra.spec_from_parameters(params).may_preempt is may_preempt  # what the ResourceClaim gives back


async def test_an_unknown_preemption_policy_is_refused_saying_which_are_known():
    obj = pod([container("a", {"nvidia.com/gpu": "1"})])
    obj["spec"]["preemptionPolicy"] = "Sometimes"
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
              "request": {"uid": "705ab4f5-6393-11e8-b7cc-42010a800003", "kind": {"group": "", "version": "v1",
                          "kind": "Pod"}, "namespace": "team-a", "operation": "CREATE", "object": obj}}

    async def hook(namespace, claims):
        raise AssertionError("a refused pod has no claims written")

    async with TestClient(TestServer(make_app(hook))) as client:
        resp = await client.post("/mutate", json=review)
        status, text = resp.status, await resp.text()
    assert status == 400, text  # (as for any malformed pod: the API server's admission never sends one)
    assert "spec.preemptionPolicy" in text and "PreemptLowerPriority" in text and "Never" in text, text
