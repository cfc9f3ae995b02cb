"""The MutatingWebhookConfiguration sends the webhook exactly the pods that ask for GPUs.

``failurePolicy: Fail`` is safe only because of its ``matchConditions``: with the translator down,
a pod the CEL expression selects cannot be created. So the expression is evaluated here (cel-python,
on pods shaped as the API server hands them to it) and compared with the webhook's own test for a
GPU container (``hami.is_gpu_request``): every pod the webhook would translate or deny must be sent
to it, and a pod without HAMi names never.
"""

from __future__ import annotations

import celpy
import pytest

from deploy_sources import manifests
from tessera.translator import hami


def _match_conditions() -> list[str]:
    (config,) = [m.obj for m in manifests() if m.obj["kind"] == "MutatingWebhookConfiguration"]
    (hook,) = config["webhooks"]
    assert hook["failurePolicy"] == "Fail"
    return [c["expression"] for c in hook["matchConditions"]]


def sent_to_webhook(pod: dict) -> bool:
    env = celpy.Environment()
    activation = {"object": celpy.json_to_cel(pod)}
    return all(bool(env.program(env.compile(e)).evaluate(activation)) for e in _match_conditions())


def webhook_concerned(pod: dict) -> bool:
    """Whether the webhook itself would translate or deny the pod (init containers are denied)."""
    spec = pod["spec"]
    for c in spec.get("containers", []) + spec.get("initContainers", []):
        resources = c.get("resources") or {}
        if hami.is_gpu_request({**(resources.get("requests") or {}), **(resources.get("limits") or {})}):
            return True
    return False


def pod(*containers: dict, init: list[dict] | None = None) -> dict:
    spec: dict = {"containers": list(containers)}
    if init is not None:
        spec["initContainers"] = init
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ml"}, "spec": spec}


def c(limits: dict | None = None, requests: dict | None = None) -> dict:
    resources: dict = {}
    if limits is not None:
        resources["limits"] = limits
    if requests is not None:
        resources["requests"] = requests
    out: dict = {"name": "main", "image": "busybox"}
    if resources:
        out["resources"] = resources
    return out


GPU_PODS = {
    "gpu-limit": pod(c({"nvidia.com/gpu": "1"})),
    "gpumem-request-only": pod(c(requests={"nvidia.com/gpumem": "8000"})),
    "percentage": pod(c({"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "50"})),
    "cores-in-second-container": pod(c({"cpu": "1"}), c({"nvidia.com/gpucores": "30"})),
    "priority": pod(c({"nvidia.com/priority": "1"})),
    "misspelt-name": pod(c({"nvidia.com/gpumemory": "8000"})),
    "init-container": pod(c(), init=[c({"nvidia.com/gpu": "1"})]),
}
OTHER_PODS = {
    "no-resources": pod(c()),
    "cpu-memory": pod(c({"cpu": "1", "memory": "1Gi"}, {"cpu": "500m"})),
    "mig-profile": pod(c({"nvidia.com/mig-1g.5gb": "1"})),
    "shared-gpu-of-another-plugin": pod(c({"nvidia.com/gpu.shared": "1"})),
    "other-vendor": pod(c({"amd.com/gpu": "1"})),
    "empty-init-list": pod(c(), init=[]),
}


@pytest.mark.parametrize("name", sorted(GPU_PODS))
def test_gpu_pods_are_sent_to_the_webhook(name):
    assert webhook_concerned(GPU_PODS[name])
    assert sent_to_webhook(GPU_PODS[name])


@pytest.mark.parametrize("name", sorted(OTHER_PODS))
def test_other_pods_are_never_sent(name):
    assert not webhook_concerned(OTHER_PODS[name])
    assert not sent_to_webhook(OTHER_PODS[name])


def test_zero_gpus_is_sent_but_admitted_unchanged():
    """HAMi's ``nvidia.com/gpu: 0`` is no request: sent (the name is there), and let through."""
    zero = pod(c({"nvidia.com/gpu": "0"}))
    assert sent_to_webhook(zero) and not webhook_concerned(zero)
