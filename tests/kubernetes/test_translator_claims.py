"""ResourceClaims become Tessera claims and their end becomes a release, through the real translator
(watch and reconciler) acting as its deploy/k8s ServiceAccount on the real control plane and a real
nats-server. The claims are the real resourceclaim controller's, made for pods the translator's
webhook admitted (the test makes the API server's admission call and creates what comes back);
the garbage collector deletes a deleted pod's claim.

The translator watches every namespace of the cluster, and the session's control plane is shared:
each test's tenant has a name of its own, so other tests' claims are never this translator's.
deploy/k8s's admission policies are in force: a claim of Tessera's class comes only from the
translator's template, so a claim in a namespace without a tenant is one whose namespace lost its
label between the pod's admission and its creation.
"""

from __future__ import annotations

import asyncio
import uuid

import msgspec
import pytest
import yaml

import kube_rbac
from kube_objects import DEPLOY_K8S
from tessera.shared.errors import TemporaryError
from tessera.shared.events import ClaimSpec
from tessera.shared.kubeapi import KubeApi, object_path
from tessera.shared.kubeclaims import RESOURCE_API_VERSION, SCHEDULING_GATE, TENANT_LABEL, KubeClaimRef, claim_id
from tessera.shared.podconstraints import PodConstraints, Toleration
from translator_harness import kube_translator
from kit import eventually
from kit.kubecluster import KubeControlPlane, apply, manifests, service_identity

TRANSLATOR = "system:serviceaccount:tessera-system:tessera-translator"
HOLD = "example.com/hold"


def gpu_pod(name: str, namespace: str, gpumem: str = "8000") -> dict:
    """A GPU pod held by another component's gate too: kube-scheduler never takes it up when a test
    lifts Tessera's (as placement would), and no node of the shared plane is meant for it."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
            "spec": {"schedulingGates": [{"name": HOLD}],
                     "containers": [{"name": "train", "image": "nvcr.io/nvidia/pytorch:25.01-py3",
                                     "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": gpumem,
                                                              "nvidia.com/gpucores": "30"}}}]}}


class Cluster:
    """The test's tenant and namespace on ``plane``, a cluster admin (for what a user or a controller
    does), and the translator's identity."""

    def __init__(self, plane: KubeControlPlane, tmp_path) -> None:
        self.plane, self.tmp = plane, tmp_path
        self.tenant = f"alpha-{uuid.uuid4().hex[:8]}"
        self.ns = self.namespace({TENANT_LABEL: self.tenant})
        self.admin = KubeApi.for_kubeconfig(plane.admin_kubeconfig)
        self.identity = service_identity(plane, "translator.yaml")
        self.made: list[str] = [self.ns]

    def namespace(self, labels: dict | None = None) -> str:
        name = f"t-{uuid.uuid4().hex[:10]}"
        apply(self.plane, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}}])
        self.plane.wait_for_service_account(name, "default")  # a pod is refused until it exists
        if hasattr(self, "made"):
            self.made.append(name)
        return name

    def translator(self, name: str, **kw):
        return kube_translator(self.plane_nats, self.identity, self.tmp / name, **kw)

    async def close(self) -> None:
        await self.admin.close()
        await asyncio.to_thread(self.plane.kubectl, "delete", "namespace", *self.made, "--wait=false", check=False)

    async def create_pod(self, pod: dict) -> dict:
        return await self.admin.create(object_path("v1", "pods", namespace=pod["metadata"]["namespace"]), pod)

    async def claim_of(self, pod: dict) -> dict:
        """The pod's ResourceClaim, once the resourceclaim controller has made it."""
        meta = pod["metadata"]

        async def made():
            items, _ = await self.admin.list(object_path(RESOURCE_API_VERSION, "resourceclaims",
                                                         namespace=meta["namespace"]))
            return next((c for c in items if any(o.get("uid") == meta["uid"]
                                                 for o in c["metadata"].get("ownerReferences") or [])), None)
        return await eventually(made, timeout=30, what=f"the claim of pod {meta['name']}")

    async def gpu_pod_with_claim(self, translator, name: str, gpumem: str = "8000") -> tuple[dict, dict]:
        """Pod admitted through the webhook and stored, and the ResourceClaim made for it."""
        pod = await self.create_pod(await translator.admit(gpu_pod(name, self.ns, gpumem), self.ns))
        return pod, await self.claim_of(pod)

    async def requested_claim(self, translator, name: str, gpumem: str = "8000") -> tuple[dict, dict, str]:
        """A GPU pod with its claim, once the translator has published ``requested`` for it."""
        pod, claim = await self.gpu_pod_with_claim(translator, name, gpumem)
        cid = claim_id(claim["metadata"]["uid"])
        await translator.wait_for("requested", cid)
        return pod, claim, cid

    async def delete_pod(self, pod: dict) -> None:
        """Pod deleted: the garbage collector deletes the claims it owns."""
        meta = pod["metadata"]
        await self.admin.delete(object_path("v1", "pods", meta["name"], meta["namespace"]))

    async def claims(self, namespace: str) -> list[dict]:
        items, _ = await self.admin.list(object_path(RESOURCE_API_VERSION, "resourceclaims", namespace=namespace))
        return items

    async def events_about(self, namespace: str, name: str) -> list[dict]:
        items, _ = await self.admin.list(object_path("v1", "events", namespace=namespace))
        return [e for e in items if e["involvedObject"]["name"] == name
                and (e.get("source") or {}).get("component", "").startswith("tessera")]

    async def write_status(self, claim: dict, status: dict) -> None:
        meta = claim["metadata"]
        await self.admin.patch_status(object_path(RESOURCE_API_VERSION, "resourceclaims", meta["name"], meta["namespace"]),
                                      {"status": status})

    async def pod(self, name: str) -> dict:
        return await self.admin.get(object_path("v1", "pods", name, self.ns))

    async def allocated_by_placement(self, translator, cid: str, claim: dict, node: str = "node-a") -> None:
        """What placement does for the claim: its record allocated on ``node``, the allocation
        written into the ResourceClaim, the pod's Tessera gate lifted (``HOLD`` stays)."""
        record, revision = await translator.service.claims.get(cid)
        await translator.service.claims.replace(msgspec.structs.replace(record, state="allocated", node=node),
                                                revision)
        await self.write_status(claim, {"allocation": allocation_on(node)})
        pod = claim["metadata"]["ownerReferences"][0]["name"]
        gates = [g for g in (await self.pod(pod))["spec"]["schedulingGates"] if g["name"] != SCHEDULING_GATE]
        await self.admin.patch(object_path("v1", "pods", pod, self.ns), {"spec": {"schedulingGates": gates}})

    async def claim_outside_a_tenant(self, translator, name: str, gpumem: str = "1000",
                                     relabel: str | None = None) -> tuple[str, dict, dict]:
        """A namespace that loses its tenant label between a GPU pod's admission and its creation
        (``relabel``: is labelled with that tenant instead): the resourceclaim controller makes a
        claim of Tessera's class there. (namespace, pod, claim)"""
        ns = self.namespace({TENANT_LABEL: self.tenant})
        admitted = await translator.admit(gpu_pod(name, ns, gpumem), ns)
        label = f"{TENANT_LABEL}={relabel}" if relabel else f"{TENANT_LABEL}-"
        await asyncio.to_thread(self.plane.kubectl, "label", "namespace", ns, label, "--overwrite")

        async def unlabelled() -> bool:  # the translator's view of the namespace has caught up
            return not (await translator.review(gpu_pod(f"{name}-probe", ns, gpumem), ns))["allowed"]
        await eventually(unlabelled, timeout=30, what=f"the translator seeing {ns} without a tenant")
        pod = await self.create_pod(admitted)
        return ns, pod, await self.claim_of(pod)


@pytest.fixture
async def cluster(kube_plane, nats_url, tmp_path):
    made = await asyncio.to_thread(Cluster, kube_plane, tmp_path)
    made.plane_nats = nats_url
    try:
        yield made
    finally:
        await made.close()


@pytest.fixture
async def translator(cluster):
    """The translator of a cluster whose namespace belongs to the existing tenant."""
    async with cluster.translator("tls") as running:
        await running.add_tenant(cluster.tenant)
        yield running


async def test_claim_is_requested_with_its_id_tenant_spec_and_kube_ref(cluster, translator):
    pod, claim = await cluster.gpu_pod_with_claim(translator, "trainer")
    cid = claim_id(claim["metadata"]["uid"])
    (event,) = await translator.wait_for("requested", cid)
    assert event.tenant == cluster.tenant
    # with what kube-scheduler's filters will read of the pod: the tolerations the API server's
    # DefaultTolerationSeconds gave it, nothing it asks of a node
    defaults = [Toleration(key=t["key"], operator=t["operator"], effect=t["effect"])
                for t in (await cluster.pod("trainer"))["spec"]["tolerations"]]
    assert {t.key for t in defaults} == {"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"}
    assert event.spec == ClaimSpec(gpus=1, memory_mib=8000, cores=30, pod=PodConstraints(tolerations=defaults))
    assert event.source == "kubernetes"
    ref = KubeClaimRef(namespace=cluster.ns, name=claim["metadata"]["name"], uid=claim["metadata"]["uid"],
                       pod="trainer", pod_uid=pod["metadata"]["uid"])
    assert event.kube == ref
    record, revision = await translator.service.claims.get(cid)
    assert record is not None and record.state == "requested" and record.kube == ref
    assert event.record_revision == revision
    subject = next(s for s, e in translator.published if e is event)
    assert subject == f"tessera.claims.{cluster.tenant}.{cid}.requested._"


async def test_pod_deleted_releases_its_claim(cluster, translator):
    pod, _, cid = await cluster.requested_claim(translator, "trainer")
    await cluster.delete_pod(pod)
    (release,) = await translator.wait_for("release", cid)
    assert release.tenant == cluster.tenant and release.reason == "resourceclaim-deleted"
    assert await cluster.claims(cluster.ns) == []  # the claim went with its pod
    record, _ = await translator.service.claims.get(cid)
    assert record.release_requested and record.reason == "resourceclaim-deleted"


async def test_duplicate_watch_events_and_relists_publish_one_requested(breakable_plane, nats_url, tmp_path):
    cluster = await asyncio.to_thread(Cluster, breakable_plane, tmp_path)
    cluster.plane_nats = nats_url
    try:
        async with cluster.translator("tls") as translator:
            await translator.add_tenant(cluster.tenant)
            _, claim, cid = await cluster.requested_claim(translator, "trainer")
            path = object_path(RESOURCE_API_VERSION, "resourceclaims", claim["metadata"]["name"], cluster.ns)
            # MODIFIED events (another writer's label), a watch cut by an API server restart (re-list
            # and a new watch), and a watch resumed past the compacted history (410 Gone, re-list).
            await _label(cluster.admin, path, "1")
            await asyncio.to_thread(breakable_plane.stop_apiserver)
            await asyncio.to_thread(breakable_plane.compact_etcd)
            await asyncio.to_thread(breakable_plane.start_apiserver)
            await _label(cluster.admin, path, "2")
            # A claim made after all that is seen only once everything before it was handled.
            await cluster.requested_claim(translator, "trainer-2", gpumem="4000")
            assert len(translator.events("requested", cid)) == 1
    finally:
        await cluster.close()


async def test_two_replicas_publish_one_requested(cluster):
    async with cluster.translator("a") as first, cluster.translator("b") as second:
        await first.add_tenant(cluster.tenant)
        pod, _, cid = await cluster.requested_claim(first, "trainer")
        await cluster.delete_pod(pod)
        await first.wait_for("release", cid)
        # The second replica's own view has caught up when a later claim shows there.
        _, _, later = await cluster.requested_claim(second, "trainer-2", gpumem="4000")
        await first.wait_for("requested", later)
        # Both subscriptions see every publish of either replica: one of each.
        assert len(first.events("requested", cid)) == 1
        assert len(first.events("release", cid)) == 1


async def test_reconciler_repairs_what_happened_while_the_translator_was_down(cluster):
    async with cluster.translator("tls") as translator:
        await translator.add_tenant(cluster.tenant)
        gone_pod, _, gone = await cluster.requested_claim(translator, "finished")
        # Admitted while the translator was up; created (and its claim made) only after it stopped.
        waiting = await translator.admit(gpu_pod("waiting", cluster.ns, "4000"), cluster.ns)
    # Translator down: one pod (and claim) deleted, another pod and claim created.
    await cluster.delete_pod(gone_pod)
    new = await cluster.claim_of(await cluster.create_pod(waiting))
    # Started again with a reconcile period far beyond the test: only the start repairs.
    async with cluster.translator("tls2", reconcile_seconds=3600) as restarted:
        (release,) = await restarted.wait_for("release", gone)
        assert release.reason == "resourceclaim-missing"
        (requested,) = await restarted.wait_for("requested", claim_id(new["metadata"]["uid"]))
        assert requested.kube.pod == "waiting" and requested.spec.memory_mib == 4000
        record, _ = await restarted.service.claims.get(gone)
        assert record.release_requested


def allocation_on(node: str) -> dict:
    return {"devices": {"results": [{"request": "gpu", "driver": "gpu.tessera.dev", "pool": node,
                                     "device": "gpu-0"}]}}


ALLOCATION = allocation_on("node-a")


async def test_an_allocation_taken_back_while_the_pod_waits_is_placed_again_not_released(cluster, translator):
    _, claim, cid = await cluster.requested_claim(translator, "trainer")
    (requested,) = translator.events("requested", cid)
    name = claim["metadata"]["name"]
    await cluster.allocated_by_placement(translator, cid, claim)
    await eventually(lambda: claim["metadata"]["uid"] in translator_watcher_allocated(translator), timeout=30)
    # the pod's constraints were tightened meanwhile (allowed while it is not bound: tolerations
    # may be added)
    maintenance = {"key": "maintenance", "operator": "Exists", "effect": "NoSchedule"}
    tolerations = (await cluster.pod("trainer"))["spec"]["tolerations"] + [maintenance]
    await cluster.admin.patch(object_path("v1", "pods", "trainer", cluster.ns), {"spec": {"tolerations": tolerations}})
    # kube-scheduler's PostFilter: it could not bind the pod on node-a
    await cluster.write_status(claim, {"allocation": None})
    (dealloc,) = await translator.wait_for("deallocated", cid)
    assert dealloc.node == "node-a" and dealloc.tenant == cluster.tenant and dealloc.kube.name == name
    assert dealloc.pod.tolerations == requested.spec.pod.tolerations + [Toleration(**maintenance)]
    subject = next(s for s, e in translator.published if e is dealloc)
    assert subject == f"tessera.claims.{cluster.tenant}.{cid}.deallocated.node-a"
    assert translator.events("release", cid) == []
    record, _ = await translator.service.claims.get(cid)
    assert not record.release_requested
    await eventually(lambda: _any_reason(cluster.events_about(cluster.ns, name), "Deallocated"), timeout=30)


async def test_a_claim_deallocated_when_its_pods_are_done_is_released_without_a_warning(cluster, translator):
    """The resourceclaim controller deallocates a claim once its last consumer is done (the
    reservation and the allocation go in one status write, before the claim itself is deleted):
    the ordinary end of every GPU pod on a real cluster (test_real_gpu_pod.py), not something done
    outside Tessera to warn the pod's owner about."""
    pod, claim, cid = await cluster.requested_claim(translator, "trainer")
    consumer = {"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}
    await cluster.write_status(claim, {"allocation": ALLOCATION})
    await cluster.write_status(claim, {"reservedFor": [consumer]})
    await cluster.write_status(claim, {"allocation": None, "reservedFor": None})
    (release,) = await translator.wait_for("release", cid)
    assert release.reason == "resourceclaim-unused"
    assert not await cluster.events_about(cluster.ns, claim["metadata"]["name"])
    assert not await cluster.events_about(cluster.ns, "trainer")


async def test_an_allocation_released_by_tessera_is_not_placed_again(cluster, translator):
    _, claim, cid = await cluster.requested_claim(translator, "trainer")
    await cluster.allocated_by_placement(translator, cid, claim)
    await translator.service.claims.mark_release_requested(cid, "requested")  # (placement withdraws it next)
    await cluster.write_status(claim, {"allocation": None})
    await cluster.requested_claim(translator, "later", gpumem="4000")  # (everything before it handled)
    assert translator.events("deallocated", cid) == []


async def test_a_deallocation_missed_while_the_translator_was_down_is_found_from_the_pod(cluster):
    async with cluster.translator("tls") as translator:
        await translator.add_tenant(cluster.tenant)
        _, claim, cid = await cluster.requested_claim(translator, "trainer")
        _, _, waiting_cid = await cluster.requested_claim(translator, "waiting", gpumem="4000")
        await cluster.allocated_by_placement(translator, cid, claim)
        # the other is allocated in the record only: placement has not written its status yet, the
        # gate is still on its pod (nothing was taken back)
        record, revision = await translator.service.claims.get(waiting_cid)
        await translator.service.claims.replace(msgspec.structs.replace(record, state="allocated", node="node-b"),
                                                revision)
    await cluster.write_status(claim, {"allocation": None})
    async with cluster.translator("tls2", reconcile_seconds=3600) as restarted:
        (dealloc,) = await restarted.wait_for("deallocated", cid)
        assert dealloc.node == "node-a"
        await cluster.requested_claim(restarted, "later", gpumem="2000")
        assert restarted.events("deallocated", waiting_cid) == []


def translator_watcher_allocated(translator) -> set[str]:
    """The ResourceClaim uids the translator has seen allocated (``ClaimWatcher.allocated``)."""
    watcher = getattr(translator.service, "watcher", None)
    return watcher.allocated if watcher is not None else set()


async def test_claim_in_a_namespace_without_tenant_gets_an_event_not_a_claim(cluster):
    async with cluster.translator("tls") as translator:
        await translator.add_tenant(cluster.tenant)
        scratch, pod, claim = await cluster.claim_outside_a_tenant(translator, "p")
        name = claim["metadata"]["name"]

        async def both_told():
            return await cluster.events_about(scratch, name) and await cluster.events_about(scratch, "p")
        await eventually(both_told, timeout=30)
        (event,) = await cluster.events_about(scratch, name)
        assert event["type"] == "Warning" and event["reason"] == "NoTenant"
        assert event["involvedObject"]["kind"] == "ResourceClaim"
        assert event["involvedObject"]["uid"] == claim["metadata"]["uid"]
        assert f"{TENANT_LABEL}=<tenant>" in event["message"]
        assert (await cluster.events_about(scratch, "p"))[0]["involvedObject"]["kind"] == "Pod"
        assert _in(translator.events("requested"), scratch) == []
        assert (await translator.service.claims.get(claim_id(claim["metadata"]["uid"])))[0] is None
    # Reported again after a restart: the same Event, counted, not a second one.
    async with cluster.translator("tls2"):
        await eventually(lambda: _count(cluster.events_about(scratch, name), 2), timeout=30)
    assert len(await cluster.events_about(scratch, name)) == 1


async def test_claim_in_a_namespace_of_an_unknown_tenant_gets_an_event_naming_it_not_a_claim(cluster):
    # The namespace names a tenant Tessera does not know (relabelled after the pod's admission, or
    # the tenant deleted): nothing is requested, and the pod is told which tenant and what to do.
    ghost = f"ghost-{uuid.uuid4().hex[:8]}"
    async with cluster.translator("tls", reconcile_seconds=0.3) as translator:
        await translator.add_tenant(cluster.tenant)
        scratch, _, claim = await cluster.claim_outside_a_tenant(translator, "p", relabel=ghost)
        cid = claim_id(claim["metadata"]["uid"])
        (event,) = await eventually(lambda: cluster.events_about(scratch, "p"), timeout=30, what="the pod told")
        assert event["type"] == "Warning" and event["reason"] == "UnknownTenant"
        assert event["involvedObject"]["kind"] == "Pod"
        assert f"names the tenant {ghost!r}" in event["message"]
        assert f"'tessera tenant create {ghost}'" in event["message"]
        await asyncio.sleep(1.0)  # (three reconcile passes: none requests it)
        assert translator.events("requested", cid) == []
        assert (await translator.service.claims.get(cid))[0] is None
        # the tenant created: the next reconcile requests the claim
        await translator.add_tenant(ghost)
        (requested,) = await translator.wait_for("requested", cid)
        assert requested.tenant == ghost


async def test_claim_whose_spec_cannot_be_recovered_gets_an_event(breakable_plane, nats_url, tmp_path):
    """A claim of Tessera's class without its parameters: made by hand where deploy/k8s's admission
    policies are not installed (here: the spare plane with the claims policy's binding taken away
    for the test)."""
    cluster = await asyncio.to_thread(Cluster, breakable_plane, tmp_path)
    cluster.plane_nats = nats_url
    [binding] = [d for d in manifests("admission-policies.yaml")
                 if d["kind"] == "ValidatingAdmissionPolicyBinding" and d["metadata"]["name"] == "tessera-claims"]
    await asyncio.to_thread(breakable_plane.kubectl, "delete", "validatingadmissionpolicybinding", "tessera-claims")
    try:
        async with cluster.translator("tls") as translator:
            await translator.add_tenant(cluster.tenant)
            by_hand = {"apiVersion": RESOURCE_API_VERSION, "kind": "ResourceClaim",
                       "metadata": {"name": "by-hand", "namespace": cluster.ns},
                       "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.dev"}}]}}}

            async def made() -> bool:  # (once the API server no longer enforces the binding)
                try:
                    await cluster.admin.create(object_path(RESOURCE_API_VERSION, "resourceclaims", namespace=cluster.ns),
                                               by_hand)
                except Exception:  # noqa: BLE001 - refused while the policy is still in force
                    return False
                return True
            await eventually(made, timeout=30, what="a hand-made claim accepted")
            await eventually(lambda: cluster.events_about(cluster.ns, "by-hand"), timeout=30)
            (event,) = await cluster.events_about(cluster.ns, "by-hand")
            assert event["reason"] == "InvalidClaim" and "GpuClaimParameters" in event["message"]
            # The translator is still at work: a good claim after it is requested.
            await cluster.requested_claim(translator, "trainer")
            assert len(_in(translator.events("requested"), cluster.ns)) == 1
    finally:
        await asyncio.to_thread(apply, breakable_plane, [binding])
        await cluster.close()


@pytest.mark.parametrize("period", [0.2])
async def test_periodic_reconcile_keeps_reporting_nothing_new(kube_plane, cluster, period):
    """Many reconcile periods over a recorded claim: still one requested, no release."""
    async with cluster.translator("tls", reconcile_seconds=period) as translator:
        await translator.add_tenant(cluster.tenant)
        _, _, cid = await cluster.requested_claim(translator, "trainer")

        def lists() -> int:  # the translator's lists of claims, as the API server's audit log has them
            return sum(1 for r in kube_rbac.audited_rules(kube_plane.audit(), TRANSLATOR)
                       if r == ("resource.k8s.io", "resourceclaims", "list"))
        before = lists()
        await eventually(lambda: lists() >= before + 3, timeout=30)
        assert len(translator.events("requested", cid)) == 1 and translator.events("release", tenant=cluster.tenant) == []


async def test_events_lost_on_the_way_to_the_stream_are_sent_again(cluster):
    """NATS fails the publish after the record was written (created, marked for release): the next
    reconcile sends it."""
    async with cluster.translator("tls", reconcile_seconds=0.5) as translator:
        await translator.add_tenant(cluster.tenant)
        publish, failed = translator.service.bus.publish, []

        async def flaky(subject, event, **kwargs):
            kind = subject.split(".")[4]
            if kind not in failed:
                failed.append(kind)
                raise TemporaryError(f"nats: timeout publishing {kind} (injected)")
            return await publish(subject, event, **kwargs)

        translator.service.bus.publish = flaky
        pod, _, cid = await cluster.requested_claim(translator, "trainer")
        await cluster.delete_pod(pod)
        await translator.wait_for("release", cid)
        assert failed == ["requested", "release"]
        assert len(translator.events("requested", cid)) == 1 and len(translator.events("release", cid)) == 1


async def test_release_marked_before_a_stop_is_sent_at_start(cluster):
    """A translator stopped between marking a record for release and publishing the release (its
    memory of what to resend is gone): the next one sends it at start."""
    async with cluster.translator("tls") as translator:
        await translator.add_tenant(cluster.tenant)
        pod, _, cid = await cluster.requested_claim(translator, "trainer")
        publish = translator.service.bus.publish

        async def no_release(subject, event, **kwargs):
            if subject.split(".")[4] == "release":
                raise TemporaryError("nats: timeout (injected)")
            return await publish(subject, event, **kwargs)

        translator.service.bus.publish = no_release
        await cluster.delete_pod(pod)

        async def release_requested() -> bool:
            return (await translator.service.claims.get(cid))[0].release_requested

        await eventually(release_requested, timeout=30, every=0.02)
        assert translator.events("release", cid) == []
    async with cluster.translator("tls2", reconcile_seconds=3600) as restarted:
        (release,) = await restarted.wait_for("release", cid)
        assert release.reason == "resourceclaim-deleted"


async def test_labelling_the_namespace_later_requests_its_claim(cluster):
    """A claim refused for want of a tenant is requested at the next reconcile once the label is set."""
    async with cluster.translator("tls", reconcile_seconds=0.3) as translator:
        await translator.add_tenant(cluster.tenant)
        scratch, _, claim = await cluster.claim_outside_a_tenant(translator, "p")
        await eventually(lambda: cluster.events_about(scratch, claim["metadata"]["name"]), timeout=30)
        await asyncio.to_thread(cluster.plane.kubectl, "label", "namespace", scratch, f"{TENANT_LABEL}={cluster.tenant}")
        (event,) = await translator.wait_for("requested", claim_id(claim["metadata"]["uid"]))
        assert event.tenant == cluster.tenant and event.kube.pod == "p"


async def test_the_translator_calls_exactly_what_its_cluster_role_grants(kube_plane, cluster):
    """Admission (a template in the pod's namespace, the Namespace read), the watcher (list, watch),
    and its Events (created, then counted up after a restart): every request granted by
    deploy/k8s/translator.yaml's ClusterRole (the server refuses any other), and every grant used."""
    seen = len(kube_plane.audit())
    async with cluster.translator("tls") as translator:
        await translator.add_tenant(cluster.tenant)
        await cluster.requested_claim(translator, "train")
        scratch, _, claim = await cluster.claim_outside_a_tenant(translator, "p")
        name = claim["metadata"]["name"]
        await eventually(lambda: cluster.events_about(scratch, name), timeout=30)
    async with cluster.translator("tls2"):
        await eventually(lambda: _count(cluster.events_about(scratch, name), 2), timeout=30)
    role = next(d for d in yaml.safe_load_all((DEPLOY_K8S / "translator.yaml").read_text())
                if d and d["kind"] == "ClusterRole")
    # (delete: a template a server without DRAConsumableCapacity mangled, test_real_consumable_capacity)
    kube_rbac.check_audited(kube_plane.audit()[seen:], TRANSLATOR, role,
                            elsewhere=frozenset({("resource.k8s.io", "resourceclaimtemplates", "delete")}))


def _in(events: list, namespace: str) -> list:
    """The events of claims in ``namespace`` (the translator watches the whole shared cluster, and
    requests a claim of any namespace that names a tenant, the other tests' too)."""
    return [e for e in events if e.kube is not None and e.kube.namespace == namespace]


async def _label(admin: KubeApi, path: str, value: str) -> None:
    """Another writer's label, by a PUT of the object read: a JSON merge patch of a Tessera claim is
    refused by the server ('spec: field is immutable': the opaque parameters' bytes as written
    differ from what the merge re-encodes; see tests/kubernetes/README.md)."""
    claim = await admin.get(path)
    claim["metadata"].setdefault("labels", {})["seen"] = value
    await admin.replace(path, claim)


async def _any_reason(events, reason: str) -> bool:
    return any(e["reason"] == reason for e in await events)


async def _count(events, count: int) -> bool:
    found = await events
    return bool(found) and found[0].get("count") == count
