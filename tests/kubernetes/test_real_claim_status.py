"""Placement writes a ResourceClaim's allocation on the real kube-apiserver, as deployed.

Two defects the emulator hid, each shown here against the real server (tests/kit/kubecluster.py):

- RBAC: from 1.36 (DRAResourceClaimGranularStatusAuthorization, beta, on) a status write that
  changes ``status.allocation`` is authorized a second time, against ``resourceclaims/binding``.
  With only ``resourceclaims/status`` (deploy/k8s/placement.yaml before the fix) every write was
  Forbidden, classified permanent, and every GPU given back.
- Quantities: the server canonicalizes what placement wrote (``20480Mi`` is stored as ``20Gi``);
  a placement restarted (or a redelivered job) must recognise its own allocation by value and leave
  the running pod's GPU alone, where comparing text gave it back.

Found here too: ``kubectl label`` / ``kubectl annotate`` (a JSON merge patch of the metadata) of such
a claim was refused, ``spec: Invalid value: ...: field is immutable``. The claim's opaque device
parameters are a RawExtension, kept as the bytes the client sent; kubernetes_asyncio sent them with
json.dumps' spaces, a merge patch re-encodes them compactly, and the spec no longer compared equal to
itself. Every body leaves ``tessera.shared.kubeapi`` compact now (as Go's encoder writes it).

The claim is the resourceclaim controller's, made for a gated pod from the translator's template
(`gpupods`); placement's own `ClaimStatusSync` and `KubeWriter` do the writing, with the token of
its service account.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tessera.shared.events import ClaimSpec, DeviceShare
from tessera.shared.kubeapi import KubeApi, object_path
from tessera.shared.kubeclaims import RESOURCE_API_VERSION, KubeClaimRef, claim_id

from tessera.placement.kube import KubeWriter
from tessera.placement.kubesync import Allocated, ClaimStatusSync

from kit import eventually
from gpupods import GpuPods
from kit.kubecluster import apply, service_identity

SHARE = DeviceShare(uuid="GPU-00000000-0000-4000-8000-000000000000", index=0, memory_mib=20480, cores=30)


@pytest.fixture
async def pods(kube_cluster):
    made = GpuPods(kube_cluster)
    try:
        yield made
    finally:
        await made.close()


class Placement:
    """Placement's Kubernetes writer as the service runs it; what it gives back is recorded."""

    def __init__(self, kubeconfig) -> None:
        self.given_back: list[str] = []
        self.sync = ClaimStatusSync(KubeWriter(KubeApi.for_kubeconfig(kubeconfig)), self._give_back,
                                    retry_seconds=20)

    async def _give_back(self, job: Allocated, reason: str) -> None:
        self.given_back.append(reason)

    async def __aenter__(self) -> "Placement":
        self.task = asyncio.create_task(self.sync.run())
        return self

    async def __aexit__(self, *exc) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.sync.writer.close()


def job_for(claim: dict) -> Allocated:
    meta = claim["metadata"]
    return Allocated(claim=claim_id(meta["uid"]), tenant="alpha", node="gpu-0", shares=[SHARE],
                     kube=KubeClaimRef(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"]),
                     models={0: "NVIDIA H100 80GB HBM3"})


async def test_placement_as_deployed_writes_the_allocation_and_knows_it_again(kube_cluster, kube_namespace, pods):
    identity = service_identity(kube_cluster, "placement.yaml")
    _, claim = await pods.create(kube_namespace, "train", ClaimSpec(memory_mib=20480, cores=30))
    path = object_path(RESOURCE_API_VERSION, "resourceclaims", claim["metadata"]["name"], kube_namespace)
    admin = pods.admin

    async with Placement(identity) as placement:
        placement.sync.submit(job_for(claim))
        await eventually(lambda: placement.sync.counts["written"] + placement.sync.counts["given_back"] == 1,
                         timeout=30, what="the allocation written or given back")
        assert placement.given_back == [], placement.given_back  # Forbidden without resourceclaims/binding
    stored = await admin.get(path)
    [result] = stored["status"]["allocation"]["devices"]["results"]
    assert result["consumedCapacity"]["memory"] == "20Gi"  # the server's spelling of the 20480Mi written
    assert result["shareID"]

    # A restarted placement (or a redelivered job) meets its allocation in the server's spelling.
    async with Placement(identity) as again:
        again.sync.submit(job_for(claim))
        # (a job is in `latest` until a worker takes it, then its claim in `locks` until it is done)
        await eventually(lambda: not again.sync.latest and not again.sync.locks, timeout=30, what="the job done")
        assert again.given_back == [], again.given_back
        assert again.sync.counts["written"] == 0  # nothing to write: the claim already says it
    assert (await admin.get(path))["status"]["allocation"] == stored["status"]["allocation"]


async def test_a_status_write_without_the_binding_permission_is_refused_by_the_server(
        kube_cluster, kube_namespace, pods):
    """The rule the fix answers, shown on the server itself: resourceclaims/status alone is not enough."""
    apply(kube_cluster, [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "status-only", "namespace": kube_namespace}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "status-only", "namespace": kube_namespace},
         "rules": [{"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get", "update"]},
                   {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/status"], "verbs": ["update"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "status-only", "namespace": kube_namespace},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "status-only"},
         "subjects": [{"kind": "ServiceAccount", "name": "status-only", "namespace": kube_namespace}]},
    ])
    token = kube_cluster.service_account_token(kube_namespace, "status-only")
    _, claim = await pods.create(kube_namespace, "train", ClaimSpec(memory_mib=20480, cores=30))
    async with Placement(kube_cluster.token_kubeconfig(f"status-only-{kube_namespace}", token)) as placement:
        placement.sync.submit(job_for(claim))
        await eventually(lambda: placement.given_back, timeout=30, what="the allocation given back")
    assert "resourceclaims/binding" in placement.given_back[0]


async def test_kubectl_labels_and_annotates_a_tessera_claim(kube_cluster, kube_namespace, pods):
    # kubectl as the admin, as a person would (the template only the translator may change:
    # deploy/k8s's tessera-claim-templates policy)
    _, claim = await pods.create(kube_namespace, "train", ClaimSpec(memory_mib=10240, cores=20))
    name = claim["metadata"]["name"]
    labelled = kube_cluster.kubectl("label", "-n", kube_namespace, "resourceclaim", name, "team=vision", check=False)
    assert labelled.returncode == 0, labelled.stderr
    annotated = kube_cluster.kubectl("annotate", "-n", kube_namespace, "resourceclaim", name, "owner=ada", check=False)
    assert annotated.returncode == 0, annotated.stderr
    stored = json.loads(kube_cluster.kubectl("get", "-n", kube_namespace, "resourceclaim", name, "-o", "json").stdout)
    assert stored["metadata"]["labels"]["team"] == "vision" and stored["metadata"]["annotations"]["owner"] == "ada"
    assert stored["spec"] == claim["spec"]  # the translator's parameters, unchanged
