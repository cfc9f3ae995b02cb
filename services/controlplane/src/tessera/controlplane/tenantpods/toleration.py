"""The policy in the tenant's cluster that sends GPU pods to the virtual node.

A MutatingAdmissionPolicy (admissionregistration.k8s.io/v1, served by the tenant's own API server:
no webhook server to run or reach) adds the virtual node's toleration to every pod that asks for
a HAMi resource (`nvidia.com/*`). The tenant's own scheduler then binds those pods to the node,
within its allocatable (the tenant's quota), and leaves every other pod off it. A GPU pod admitted
before the policy was in force gets the same toleration from the syncer (`patch`): a pod may gain
tolerations after it is made.
"""

from __future__ import annotations

import asyncio

from tessera.shared.errors import TemporaryError
from tessera.shared.kubeapi import KubeApi, KubeError

from .virtualnode import TAINT_KEY

NAME = "tessera-gpu-pods-tolerate-the-fleet"
POLICIES = "/apis/admissionregistration.k8s.io/v1/mutatingadmissionpolicies"
BINDINGS = "/apis/admissionregistration.k8s.io/v1/mutatingadmissionpolicybindings"

_ASKS_FOR_GPUS = ("object.spec.containers.exists(c, has(c.resources) && ("
                  "(has(c.resources.limits) && c.resources.limits.exists(k, k.startsWith('nvidia.com/'))) || "
                  "(has(c.resources.requests) && c.resources.requests.exists(k, k.startsWith('nvidia.com/')))))")
_TOLERATION = f'Object.spec.tolerations{{key: "{TAINT_KEY}", operator: "Exists", effect: "NoSchedule"}}'
_PATCH = (f'has(object.spec.tolerations) ? '
          f'[JSONPatch{{op: "add", path: "/spec/tolerations/-", value: {_TOLERATION}}}] : '
          f'[JSONPatch{{op: "add", path: "/spec/tolerations", value: [{_TOLERATION}]}}]')


def asks_for_gpus(pod: dict) -> bool:
    """What the policy's match condition says, for a pod the syncer reads (one admitted before the
    policy was in force)."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        if any(k.startswith("nvidia.com/") for part in ("limits", "requests") for k in resources.get(part) or {}):
            return True
    return False


def patch(spec: dict) -> list[dict]:
    """The JSON patch the policy applies, for a pod the syncer reads."""
    value = {"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}
    if spec.get("tolerations"):
        return [{"op": "add", "path": "/spec/tolerations/-", "value": value}]
    return [{"op": "add", "path": "/spec/tolerations", "value": [value]}]


def policy() -> dict:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingAdmissionPolicy",
        "metadata": {"name": NAME},
        "spec": {
            "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                                                    "operations": ["CREATE"], "resources": ["pods"]}]},
            "matchConditions": [{"name": "asks-for-gpus", "expression": _ASKS_FOR_GPUS}],
            "failurePolicy": "Fail", "reinvocationPolicy": "Never",
            "mutations": [{"patchType": "JSONPatch", "jsonPatch": {"expression": _PATCH}}],
        },
    }


def binding() -> dict:
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingAdmissionPolicyBinding",
            "metadata": {"name": NAME}, "spec": {"policyName": NAME}}


async def install(api: KubeApi, timeout: float = 60.0) -> None:
    """Server-side apply of the policy and its binding (the same call on every start), returning
    once the API server applies it: a policy is in force only when the server's informer has it,
    a moment after it is stored, and a GPU pod admitted in between would never be scheduled."""
    await api.apply(f"{POLICIES}/{NAME}", POLICIES, policy(), "tessera-tenant-pods")
    await api.apply(f"{BINDINGS}/{NAME}", BINDINGS, binding(), "tessera-tenant-pods")
    deadline = asyncio.get_running_loop().time() + timeout
    while not await _in_force(api):
        if asyncio.get_running_loop().time() > deadline:
            raise TemporaryError(f"the tenant's API server has not applied {NAME} after {timeout:g} s")
        await asyncio.sleep(0.2)


async def _in_force(api: KubeApi) -> bool:
    """A GPU pod created as a dry run comes back with the toleration."""
    probe = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "tessera-toleration-probe"},
             "spec": {"automountServiceAccountToken": False, "containers": [{
                 "name": "probe", "image": "tessera.invalid/probe",
                 "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
    try:
        made = await api.call("POST", "/api/v1/namespaces/default/pods", probe, query=[("dryRun", "All")])
    except KubeError:
        return False  # not yet (the namespace's service account may not exist yet either)
    return any(t.get("key") == TAINT_KEY for t in made["spec"].get("tolerations") or [])


async def remove(api: KubeApi) -> None:
    for path in (f"{BINDINGS}/{NAME}", f"{POLICIES}/{NAME}"):
        if await api.get(path) is not None:
            await api.delete(path)
