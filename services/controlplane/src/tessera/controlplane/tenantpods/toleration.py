"""The policy in the tenant's cluster that sends GPU pods to the virtual node.

A MutatingAdmissionPolicy (admissionregistration.k8s.io/v1, served by the tenant's own API server:
no webhook server to run or reach) adds the virtual node's toleration to every pod that asks for
a HAMi resource (`nvidia.com/*`). The tenant's own scheduler then binds those pods to the node,
within its allocatable (the tenant's quota), and leaves every other pod off it. A GPU pod admitted
before the policy was in force gets the same toleration from the syncer (`patch`): a pod may gain
tolerations after it is made.

A pod on the node also tolerates the node being unreachable or not ready (NoExecute) for good.
Those taints mean the syncer stopped renewing the node's Lease (a manager restart, an upgrade), not
that the pod's node is gone: the host's kubelet runs the real pod, and the host's own node
lifecycle decides its fate, which the syncer copies back. With the 300 s that the tenant API
server's DefaultTolerationSeconds admission gives every pod, the tenant's taint-eviction
controller would delete the tenant's pod once the syncer was away that long (unless every node of
the tenant's cluster were down: its "master disruption mode"), and the syncer, back, would then
delete the running host pod. The eviction time is the least tolerationSeconds of the tolerations
that match, so the defaults are replaced, not joined: at admission the policy drops them; after
admission only a toleration's tolerationSeconds may change, so the syncer removes it there.
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
NOT_READY, UNREACHABLE = "node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"
NODE_HEALTH = (NOT_READY, UNREACHABLE)  # the node lifecycle controller's NoExecute taints
_WANTED = [{"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"},
           *({"key": key, "operator": "Exists", "effect": "NoExecute"} for key in NODE_HEALTH)]


def _cel(toleration: dict) -> str:
    return "Object.spec.tolerations{" + ", ".join(f'{k}: "{v}"' for k, v in toleration.items()) + "}"


_HEALTH_KEYS = ", ".join(f'"{key}"' for key in NODE_HEALTH)
_TIMED = f"has(t.key) && t.key in [{_HEALTH_KEYS}] && has(t.tolerationSeconds)"
_ADDED = ", ".join(f'JSONPatch{{op: "add", path: "/spec/tolerations/-", value: {_cel(t)}}}' for t in _WANTED)
# (one list of the pod's own tolerations and literal ones makes the API server panic as it turns
# the value into JSON, v1.36.3: so the pod's kept ones are put back first, then each of ours added)
_PATCH = (f'has(object.spec.tolerations) ? [JSONPatch{{op: "replace", path: "/spec/tolerations", '
          f'value: object.spec.tolerations.filter(t, !({_TIMED}))}}, {_ADDED}] : '
          f'[JSONPatch{{op: "add", path: "/spec/tolerations", value: []}}, {_ADDED}]')


def asks_for_gpus(pod: dict) -> bool:
    """What the policy's match condition says, for a pod the syncer reads (one admitted before the
    policy was in force)."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        if any(k.startswith("nvidia.com/") for part in ("limits", "requests") for k in resources.get(part) or {}):
            return True
    return False


def patch(spec: dict) -> list[dict]:
    """The JSON patch that gives an admitted pod what the policy gives one at admission, as far as a
    pod's update may (tolerations added; an existing one's tolerationSeconds removed). Empty: it
    has them."""
    have = spec.get("tolerations") or []
    ops: list[dict] = [] if have else [{"op": "add", "path": "/spec/tolerations", "value": []}]
    ops += [{"op": "remove", "path": f"/spec/tolerations/{i}/tolerationSeconds"} for i, t in enumerate(have)
            if t.get("key") in NODE_HEALTH and "tolerationSeconds" in t]
    for wanted in _WANTED:
        if not any(t.get("key") == wanted["key"] and t.get("effect", wanted["effect"]) in ("", wanted["effect"])
                   for t in have):
            ops.append({"op": "add", "path": "/spec/tolerations/-", "value": wanted})
    return ops


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
    """A GPU pod created as a dry run comes back with the tolerations (this version's policy)."""
    probe = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "tessera-toleration-probe"},
             "spec": {"automountServiceAccountToken": False, "containers": [{
                 "name": "probe", "image": "tessera.invalid/probe",
                 "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
    try:
        made = await api.call("POST", "/api/v1/namespaces/default/pods", probe, query=[("dryRun", "All")])
    except KubeError:
        return False  # not yet (the namespace's service account may not exist yet either)
    return not patch(made["spec"])


async def remove(api: KubeApi) -> None:
    for path in (f"{BINDINGS}/{NAME}", f"{POLICIES}/{NAME}"):
        if await api.get(path) is not None:
            await api.delete(path)
