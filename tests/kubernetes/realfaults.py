"""Faults produced on the real kube-apiserver, for tests that once asked the emulator to inject them:

- `ConflictingWrites`: the next ``times`` writes of a resource (a subresource) by anyone meet a real
  409 Conflict. A validating webhook of the test's own, called as the write is admitted, changes the
  object meanwhile (as another writer would), so the server's optimistic-concurrency check refuses
  the write with its own "the object has been modified" answer.
- `refuse_writes`: a ValidatingAdmissionPolicy (and its binding) that refuses every write of a
  resource in one namespace with ``reason`` (Invalid: 422), as a policy of a cluster's would.
- `ready_node`: a Node as its kubelet reports it (Ready, room for pods), without a kubelet: the
  scheduler binds pods to it; pods must tolerate every taint (the node lifecycle controller marks
  a node whose kubelet never heartbeats unreachable).

An unreachable server, a cut watch and 410 Gone are `KubeControlPlane.stop_apiserver` /
`start_apiserver` / `compact_etcd` on a control plane of the test's own.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from pathlib import Path

from tessera.shared.kubeapi import KubeApi, object_path

from kit import eventually
from kit.kubecluster import KubeControlPlane, apply
from webhook_server import CertificateAuthority, WebhookServer, allow


class ConflictingWrites:
    """``async with ConflictingWrites(plane, admin, ns, group, resource, subresource, times=2, ...)``:
    the first ``times`` UPDATEs of ``resource``/``subresource`` in ``ns`` are answered 409 by the
    server; ``.conflicts`` counts them. In force once ``probe`` (kubectl arguments of such a write,
    run with ``--dry-run=server``, which the webhook lets through untouched) reaches the webhook."""

    def __init__(self, plane: KubeControlPlane, admin: KubeApi, namespace: str, group: str, resource: str,
                 subresource: str = "", *, times: int, workdir: Path, probe: list[str]) -> None:
        self.plane, self.admin, self.namespace, self.probe = plane, admin, namespace, probe
        self.group, self.resource, self.subresource = group, resource, subresource
        self.left, self.conflicts = times, 0
        self.name = f"conflicts-{uuid.uuid4().hex[:8]}.tests.tessera.dev"
        self.ca = CertificateAuthority()
        self.server = WebhookServer(*self.ca.issue(workdir / self.name, ["localhost"]), self._decide)

    async def _decide(self, request: dict) -> dict:
        if self.left and request.get("subResource", "") == self.subresource and not request.get("dryRun"):
            self.left -= 1
            old = request["oldObject"]["metadata"]
            api_version = f"{self.group}/{request['kind']['version']}" if self.group else request["kind"]["version"]
            path = object_path(api_version, self.resource, old["name"], old.get("namespace"))
            current = await self.admin.get(path)
            current["metadata"].setdefault("annotations", {})["tests.tessera.dev/written-meanwhile"] = str(uuid.uuid4())
            await self.admin.replace(path, current)
            self.conflicts += 1
        return allow()

    async def __aenter__(self) -> "ConflictingWrites":
        await self.server.start()
        resource = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        await asyncio.to_thread(apply, self.plane, [{
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": self.name},
            "webhooks": [{"name": self.name, "admissionReviewVersions": ["v1"], "sideEffects": "NoneOnDryRun",
                          "failurePolicy": "Fail", "timeoutSeconds": 10,
                          "clientConfig": {"url": f"{self.server.url}/", "caBundle": self.ca.bundle},
                          "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": self.namespace}},
                          "rules": [{"apiGroups": [self.group], "apiVersions": ["*"], "operations": ["UPDATE"],
                                     "resources": [resource], "scope": "Namespaced"}]}]}])

        async def called() -> bool:
            await asyncio.to_thread(self.plane.kubectl, *self.probe, "--dry-run=server", check=False)
            return bool(self.server.requests)
        await eventually(called, timeout=30, what=f"the webhook {self.name} called")
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.plane.kubectl, "delete", "validatingwebhookconfiguration", self.name,
                                "--ignore-not-found")
        await self.server.stop()


async def refuse_writes(plane: KubeControlPlane, namespace: str, group: str, resource: str, *,
                        probe: list[str], reason: str = "Invalid", message: str = "refused by the test's policy") -> None:
    """Every UPDATE of ``group``'s ``resource`` in ``namespace`` refused with ``reason``, once the
    API server enforces it: ``probe`` (kubectl arguments of such a write, run with
    ``--dry-run=server``) is refused with ``message``."""
    name = f"refuse-{uuid.uuid4().hex[:8]}.tests.tessera.dev"
    await asyncio.to_thread(apply, plane, [
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
         "metadata": {"name": name},
         "spec": {"failurePolicy": "Fail",
                  "matchConstraints": {"resourceRules": [{"apiGroups": [group], "apiVersions": ["*"],
                                                          "operations": ["UPDATE"], "resources": [resource]}]},
                  "validations": [{"expression": "false", "message": message, "reason": reason}]}},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
         "metadata": {"name": name},
         "spec": {"policyName": name, "validationActions": ["Deny"],
                  "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}}},
    ])

    async def refused() -> bool:
        done = await asyncio.to_thread(plane.kubectl, *probe, "--dry-run=server", check=False)
        return done.returncode != 0 and message in done.stderr
    await eventually(refused, timeout=30, what=f"the policy {name} in force")


async def ready_node(admin: KubeApi, name: str, labels: dict | None = None) -> None:
    """``name`` as its kubelet would register it and report it Ready (the scheduler filters on that)."""
    if await admin.get(object_path("v1", "nodes", name)) is None:
        await admin.create(object_path("v1", "nodes"), {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}}})
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    room = {"cpu": "8", "memory": "32Gi", "pods": "110"}
    await admin.patch_status(object_path("v1", "nodes", name), {"status": {
        "allocatable": room, "capacity": room,
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "lastHeartbeatTime": now,
                        "lastTransitionTime": now}]}})
