"""ResourceClaims become Tessera claims and their end becomes a release, through the real translator
(watch and reconciler) against the API-server emulator and a real nats-server. The test plays the
API server's admission call and Kubernetes' resourceclaim controller."""

from __future__ import annotations


import msgspec
import pytest
import yaml

import kube_rbac
from kube_objects import DEPLOY_K8S
from tessera.shared.errors import TemporaryError
from tessera.shared.events import ClaimSpec
from tessera.shared.kubeclaims import DEVICE_CLASS, RESOURCE_API_VERSION, TENANT_LABEL, KubeClaimRef, claim_id
from tessera.shared.podconstraints import PodConstraints, Toleration
from tessera.translator import dra
from translator_harness import kube_translator, resourceclaim_controller
from kit import eventually

RC = (RESOURCE_API_VERSION, "resourceclaims")


def gpu_pod(name: str, gpumem: str = "8000") -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "ml"},
            "spec": {"containers": [{"name": "train", "image": "nvcr.io/nvidia/pytorch:25.01-py3",
                                     "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": gpumem,
                                                              "nvidia.com/gpucores": "30"}}}]}}


async def tenant_namespace(apiserver) -> None:
    await apiserver.create({"apiVersion": "v1", "kind": "Namespace",
                            "metadata": {"name": "ml", "labels": {TENANT_LABEL: "alpha"}}})


async def gpu_pod_with_claim(apiserver, translator, name: str, gpumem: str = "8000") -> tuple[dict, dict]:
    """Pod admitted through the webhook and stored, and the ResourceClaim made for it."""
    pod = await apiserver.create(await translator.admit(gpu_pod(name, gpumem), "ml"))
    (claim,) = await resourceclaim_controller(apiserver, pod)
    return pod, claim


async def requested_claim(apiserver, translator, name: str, gpumem: str = "8000") -> tuple[dict, dict, str]:
    """A GPU pod with its claim, once the translator has published ``requested`` for it."""
    pod, claim = await gpu_pod_with_claim(apiserver, translator, name, gpumem)
    cid = claim_id(claim["metadata"]["uid"])
    await translator.wait_for("requested", cid)
    return pod, claim, cid


@pytest.fixture
async def translator(nats_url, apiserver, tmp_path):
    """The translator of a cluster whose namespace ``ml`` belongs to the existing tenant ``alpha``."""
    await tenant_namespace(apiserver)
    async with kube_translator(nats_url, apiserver, tmp_path / "tls") as running:
        await running.add_tenant("alpha")
        yield running


async def delete_pod(apiserver, pod: dict) -> None:
    """Pod deleted: the garbage collector deletes the claims it owns."""
    await apiserver.delete("v1", "pods", pod["metadata"]["name"], "ml")


def events_about(apiserver, namespace: str, name: str) -> list[dict]:
    return [e for e in apiserver.objects("v1", "events", namespace) if e["involvedObject"]["name"] == name]


async def test_claim_is_requested_with_its_id_tenant_spec_and_kube_ref(apiserver, translator):
    pod, claim = await gpu_pod_with_claim(apiserver, translator, "trainer")
    cid = claim_id(claim["metadata"]["uid"])
    (event,) = await translator.wait_for("requested", cid)
    assert event.tenant == "alpha"
    # with what kube-scheduler's filters will read of the pod (here: nothing it asks of a node)
    assert event.spec == ClaimSpec(gpus=1, memory_mib=8000, cores=30, pod=PodConstraints())
    assert event.source == "kubernetes"
    ref = KubeClaimRef(namespace="ml", name=claim["metadata"]["name"], uid=claim["metadata"]["uid"],
                       pod="trainer", pod_uid=pod["metadata"]["uid"])
    assert event.kube == ref
    record, revision = await translator.service.claims.get(cid)
    assert record is not None and record.state == "requested" and record.kube == ref
    assert event.record_revision == revision
    subject = next(s for s, e in translator.published if e is event)
    assert subject == f"tessera.claims.alpha.{cid}.requested._"


async def test_pod_deleted_releases_its_claim(apiserver, translator):
    pod, _, cid = await requested_claim(apiserver, translator, "trainer")
    await delete_pod(apiserver, pod)
    assert apiserver.objects(*RC, "ml") == []  # the claim went with its pod
    (release,) = await translator.wait_for("release", cid)
    assert release.tenant == "alpha" and release.reason == "resourceclaim-deleted"
    record, _ = await translator.service.claims.get(cid)
    assert record.release_requested and record.reason == "resourceclaim-deleted"


async def test_duplicate_watch_events_and_relists_publish_one_requested(apiserver, translator):
    _, claim, cid = await requested_claim(apiserver, translator, "trainer")
    # MODIFIED events (another writer's label), a watch cut by an API server restart (re-list
    # and a new watch), and a watch resumed past the compacted history (410 Gone, re-list).
    await apiserver.patch(*RC, claim["metadata"]["name"], {"metadata": {"labels": {"seen": "1"}}}, "ml")
    await apiserver.stop()
    await apiserver.start()
    apiserver.compact()
    await apiserver.patch(*RC, claim["metadata"]["name"], {"metadata": {"labels": {"seen": "2"}}}, "ml")
    # A claim made after all that is seen only once everything before it was handled.
    await requested_claim(apiserver, translator, "trainer-2", gpumem="4000")
    assert len(translator.events("requested", cid)) == 1


async def test_two_replicas_publish_one_requested(nats_url, apiserver, tmp_path):
    await tenant_namespace(apiserver)
    async with kube_translator(nats_url, apiserver, tmp_path / "a") as first, \
            kube_translator(nats_url, apiserver, tmp_path / "b") as second:
        await first.add_tenant("alpha")
        pod, _, cid = await requested_claim(apiserver, first, "trainer")
        await delete_pod(apiserver, pod)
        await first.wait_for("release", cid)
        # The second replica's own view has caught up when a later claim shows there.
        _, _, later = await requested_claim(apiserver, second, "trainer-2", gpumem="4000")
        await first.wait_for("requested", later)
        # Both subscriptions see every publish of either replica: one of each.
        assert len(first.events("requested", cid)) == 1
        assert len(first.events("release", cid)) == 1


async def test_reconciler_repairs_what_happened_while_the_translator_was_down(nats_url, apiserver, tmp_path):
    await tenant_namespace(apiserver)
    async with kube_translator(nats_url, apiserver, tmp_path / "tls") as translator:
        await translator.add_tenant("alpha")
        gone_pod, _, gone = await requested_claim(apiserver, translator, "finished")
        # Admitted while the translator was up; its claim is made only after it stopped.
        waiting_pod = await apiserver.create(await translator.admit(gpu_pod("waiting", "4000"), "ml"))
    # Translator down: one pod (and claim) deleted, another claim created.
    await delete_pod(apiserver, gone_pod)
    (new,) = await resourceclaim_controller(apiserver, waiting_pod)
    # Started again with a reconcile period far beyond the test: only the start repairs.
    async with kube_translator(nats_url, apiserver, tmp_path / "tls2", reconcile_seconds=3600) as restarted:
        (release,) = await restarted.wait_for("release", gone)
        assert release.reason == "resourceclaim-missing"
        (requested,) = await restarted.wait_for("requested", claim_id(new["metadata"]["uid"]))
        assert requested.kube.pod == "waiting" and requested.spec.memory_mib == 4000
        record, _ = await restarted.service.claims.get(gone)
        assert record.release_requested


async def _allocated_by_placement(translator, apiserver, cid: str, claim: dict, node: str = "node-a") -> None:
    """What placement does for the claim: its record allocated on ``node``, the allocation written
    into the ResourceClaim, the pod's gate lifted."""
    record, revision = await translator.service.claims.get(cid)
    await translator.service.claims.replace(msgspec.structs.replace(record, state="allocated", node=node), revision)
    allocation = {"devices": {"results": [{"request": "gpu", "driver": "gpu.tessera.dev", "pool": node,
                                           "device": "gpu-0"}]}}
    await apiserver.patch(*RC, claim["metadata"]["name"], {"status": {"allocation": allocation}}, "ml",
                          subresource="status")
    pod = claim["metadata"]["ownerReferences"][0]["name"]
    await apiserver.patch("v1", "pods", pod, {"spec": {"schedulingGates": None}}, "ml")


async def test_an_allocation_taken_back_while_the_pod_waits_is_placed_again_not_released(apiserver, translator):
    _, claim, cid = await requested_claim(apiserver, translator, "trainer")
    name = claim["metadata"]["name"]
    await _allocated_by_placement(translator, apiserver, cid, claim)
    await eventually(lambda: claim["metadata"]["uid"] in translator_watcher_allocated(translator), timeout=10)
    # the pod's constraints were tightened meanwhile (allowed while it is not bound)
    await apiserver.patch("v1", "pods", "trainer", {"spec": {"tolerations": [
        {"key": "maintenance", "operator": "Exists", "effect": "NoSchedule"}]}}, "ml")
    # kube-scheduler's PostFilter: it could not bind the pod on node-a
    await apiserver.patch(*RC, name, {"status": {"allocation": None}}, "ml", subresource="status")
    (dealloc,) = await translator.wait_for("deallocated", cid)
    assert dealloc.node == "node-a" and dealloc.tenant == "alpha" and dealloc.kube.name == name
    assert dealloc.pod.tolerations == [Toleration(key="maintenance", operator="Exists", effect="NoSchedule")]
    subject = next(s for s, e in translator.published if e is dealloc)
    assert subject == f"tessera.claims.alpha.{cid}.deallocated.node-a"
    assert translator.events("release", cid) == []
    record, _ = await translator.service.claims.get(cid)
    assert not record.release_requested
    await eventually(lambda: any(e["reason"] == "Deallocated" for e in events_about(apiserver, "ml", name)))


async def test_a_claim_deallocated_when_its_pods_are_done_is_released_without_a_warning(apiserver, translator):
    """The resourceclaim controller deallocates a claim once its last consumer is done (the
    reservation and the allocation go in one status write, before the claim itself is deleted):
    the ordinary end of every GPU pod on a real cluster (test_real_gpu_pod.py), not something done
    outside Tessera to warn the pod's owner about."""
    pod, claim, cid = await requested_claim(apiserver, translator, "trainer")
    name = claim["metadata"]["name"]
    allocation = {"devices": {"results": [{"request": "gpu", "driver": "gpu.tessera.dev", "pool": "node-a",
                                           "device": "gpu-0"}]}}
    consumer = {"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}
    await apiserver.patch(*RC, name, {"status": {"allocation": allocation}}, "ml", subresource="status")
    await apiserver.patch(*RC, name, {"status": {"reservedFor": [consumer]}}, "ml", subresource="status")
    await apiserver.patch(*RC, name, {"status": {"allocation": None, "reservedFor": None}}, "ml",
                          subresource="status")
    (release,) = await translator.wait_for("release", cid)
    assert release.reason == "resourceclaim-unused"
    assert not events_about(apiserver, "ml", name) and not events_about(apiserver, "ml", "trainer")


async def test_an_allocation_released_by_tessera_is_not_placed_again(apiserver, translator):
    _, claim, cid = await requested_claim(apiserver, translator, "trainer")
    await _allocated_by_placement(translator, apiserver, cid, claim)
    await translator.service.claims.mark_release_requested(cid, "requested")  # (placement withdraws it next)
    await apiserver.patch(*RC, claim["metadata"]["name"], {"status": {"allocation": None}}, "ml", subresource="status")
    await requested_claim(apiserver, translator, "later", gpumem="4000")  # (everything before it handled)
    assert translator.events("deallocated", cid) == []


async def test_a_deallocation_missed_while_the_translator_was_down_is_found_from_the_pod(nats_url, apiserver, tmp_path):
    await tenant_namespace(apiserver)
    async with kube_translator(nats_url, apiserver, tmp_path / "tls") as translator:
        await translator.add_tenant("alpha")
        _, claim, cid = await requested_claim(apiserver, translator, "trainer")
        _, waiting, waiting_cid = await requested_claim(apiserver, translator, "waiting", gpumem="4000")
        await _allocated_by_placement(translator, apiserver, cid, claim)
        # the other is allocated in the record only: placement has not written its status yet, the
        # gate is still on its pod (nothing was taken back)
        record, revision = await translator.service.claims.get(waiting_cid)
        await translator.service.claims.replace(msgspec.structs.replace(record, state="allocated", node="node-b"),
                                                revision)
    await apiserver.patch(*RC, claim["metadata"]["name"], {"status": {"allocation": None}}, "ml", subresource="status")
    async with kube_translator(nats_url, apiserver, tmp_path / "tls2", reconcile_seconds=3600) as restarted:
        (dealloc,) = await restarted.wait_for("deallocated", cid)
        assert dealloc.node == "node-a"
        await requested_claim(apiserver, restarted, "later", gpumem="2000")
        assert restarted.events("deallocated", waiting_cid) == []


def translator_watcher_allocated(translator) -> set[str]:
    """The ResourceClaim uids the translator has seen allocated (``ClaimWatcher.allocated``)."""
    watcher = getattr(translator.service, "watcher", None)
    return watcher.allocated if watcher is not None else set()


def hand_written_claim(name: str, namespace: str, spec: ClaimSpec | None, owner: dict | None = None) -> dict:
    if spec is not None:
        doc = dra.resource_claim(spec, name, namespace)
    else:  # what a user writes by hand: the device class, no Tessera parameters
        doc = {"apiVersion": RESOURCE_API_VERSION, "kind": "ResourceClaim",
               "metadata": {"name": name, "namespace": namespace},
               "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DEVICE_CLASS}}]}}}
    if owner is not None:
        doc["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": owner["metadata"]["name"],
                                               "uid": owner["metadata"]["uid"], "controller": True}]
    return doc


async def test_claim_in_a_namespace_without_tenant_gets_an_event_not_a_claim(nats_url, apiserver, tmp_path):
    await apiserver.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "scratch"}})
    pod = await apiserver.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "scratch"},
                                  "spec": {"containers": [{"name": "main", "image": "busybox"}]}})
    async with kube_translator(nats_url, apiserver, tmp_path / "tls") as translator:
        claim = await apiserver.create(hand_written_claim("p-gpu", "scratch", ClaimSpec(), owner=pod))
        await eventually(lambda: events_about(apiserver, "scratch", "p-gpu") and events_about(apiserver, "scratch", "p"))
        (event,) = events_about(apiserver, "scratch", "p-gpu")
        assert event["type"] == "Warning" and event["reason"] == "NoTenant"
        assert event["involvedObject"]["kind"] == "ResourceClaim"
        assert event["involvedObject"]["uid"] == claim["metadata"]["uid"]
        assert f"{TENANT_LABEL}=<tenant>" in event["message"]
        assert events_about(apiserver, "scratch", "p")[0]["involvedObject"]["kind"] == "Pod"
        assert translator.events("requested") == []
        assert (await translator.service.claims.get(claim_id(claim["metadata"]["uid"])))[0] is None
    # Reported again after a restart: the same Event, counted, not a second one.
    async with kube_translator(nats_url, apiserver, tmp_path / "tls2"):
        await eventually(lambda: events_about(apiserver, "scratch", "p-gpu")[0].get("count") == 2)
    assert len(events_about(apiserver, "scratch", "p-gpu")) == 1


async def test_claim_whose_spec_cannot_be_recovered_gets_an_event(apiserver, translator):
    await apiserver.create(hand_written_claim("by-hand", "ml", None))
    await eventually(lambda: events_about(apiserver, "ml", "by-hand"))
    (event,) = events_about(apiserver, "ml", "by-hand")
    assert event["reason"] == "InvalidClaim" and "GpuClaimParameters" in event["message"]
    # The translator is still at work: a good claim after it is requested.
    await requested_claim(apiserver, translator, "trainer")
    assert len(translator.events("requested")) == 1


@pytest.mark.parametrize("period", [0.2])
async def test_periodic_reconcile_keeps_reporting_nothing_new(nats_url, apiserver, tmp_path, period):
    """Many reconcile periods over a recorded claim: still one requested, no release."""
    await tenant_namespace(apiserver)
    async with kube_translator(nats_url, apiserver, tmp_path / "tls", reconcile_seconds=period) as translator:
        await translator.add_tenant("alpha")
        _, _, cid = await requested_claim(apiserver, translator, "trainer")
        def lists() -> int:
            return sum(1 for m, p, q in apiserver.requests if m == "GET" and p.endswith("/resourceclaims")
                       and "watch" not in q)
        before = lists()
        await eventually(lambda: lists() >= before + 3)
        assert len(translator.events("requested", cid)) == 1 and translator.events("release") == []


async def test_events_lost_on_the_way_to_the_stream_are_sent_again(nats_url, apiserver, tmp_path):
    """NATS fails the publish after the record was written (created, marked for release): the next
    reconcile sends it."""
    await tenant_namespace(apiserver)
    async with kube_translator(nats_url, apiserver, tmp_path / "tls", reconcile_seconds=0.5) as translator:
        await translator.add_tenant("alpha")
        publish, failed = translator.service.bus.publish, []

        async def flaky(subject, event, **kwargs):
            kind = subject.split(".")[4]
            if kind not in failed:
                failed.append(kind)
                raise TemporaryError(f"nats: timeout publishing {kind} (injected)")
            return await publish(subject, event, **kwargs)

        translator.service.bus.publish = flaky
        pod, _, cid = await requested_claim(apiserver, translator, "trainer")
        await delete_pod(apiserver, pod)
        await translator.wait_for("release", cid)
        assert failed == ["requested", "release"]
        assert len(translator.events("requested", cid)) == 1 and len(translator.events("release", cid)) == 1


async def test_release_marked_before_a_stop_is_sent_at_start(nats_url, apiserver, tmp_path):
    """A translator stopped between marking a record for release and publishing the release (its
    memory of what to resend is gone): the next one sends it at start."""
    await tenant_namespace(apiserver)
    async with kube_translator(nats_url, apiserver, tmp_path / "tls") as translator:
        await translator.add_tenant("alpha")
        pod, _, cid = await requested_claim(apiserver, translator, "trainer")
        publish = translator.service.bus.publish

        async def no_release(subject, event, **kwargs):
            if subject.split(".")[4] == "release":
                raise TemporaryError("nats: timeout (injected)")
            return await publish(subject, event, **kwargs)

        translator.service.bus.publish = no_release
        await delete_pod(apiserver, pod)
        async def release_requested() -> bool:
            return (await translator.service.claims.get(cid))[0].release_requested

        await eventually(release_requested, timeout=30, every=0.02)
        assert translator.events("release", cid) == []
    async with kube_translator(nats_url, apiserver, tmp_path / "tls2", reconcile_seconds=3600) as restarted:
        (release,) = await restarted.wait_for("release", cid)
        assert release.reason == "resourceclaim-deleted"


async def test_labelling_the_namespace_later_requests_its_claim(nats_url, apiserver, tmp_path):
    """A claim refused for want of a tenant is requested at the next reconcile once the label is set."""
    await apiserver.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "scratch"}})
    async with kube_translator(nats_url, apiserver, tmp_path / "tls", reconcile_seconds=0.3) as translator:
        await translator.add_tenant("alpha")
        claim = await apiserver.create(hand_written_claim("p-gpu", "scratch", ClaimSpec(memory_mib=1000)))
        await eventually(lambda: events_about(apiserver, "scratch", "p-gpu"))
        await apiserver.patch("v1", "namespaces", "scratch", {"metadata": {"labels": {TENANT_LABEL: "alpha"}}})
        (event,) = await translator.wait_for("requested", claim_id(claim["metadata"]["uid"]))
        assert event.tenant == "alpha" and event.kube.pod == ""


async def test_the_translator_calls_exactly_what_its_cluster_role_grants(nats_url, apiserver, tmp_path):
    """Admission (a template in the pod's namespace, the Namespace read), the watcher (list, watch),
    and its Events (created, then counted up after a restart): every request granted by
    deploy/k8s/translator.yaml's ClusterRole, and every grant used."""
    await tenant_namespace(apiserver)
    await apiserver.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "scratch"}})
    pod = await apiserver.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "scratch"},
                                  "spec": {"containers": [{"name": "main", "image": "busybox"}]}})
    async with kube_translator(nats_url, apiserver, tmp_path / "tls") as translator:
        await translator.add_tenant("alpha")
        await requested_claim(apiserver, translator, "train")
        await apiserver.create(hand_written_claim("p-gpu", "scratch", ClaimSpec(), owner=pod))
        await eventually(lambda: events_about(apiserver, "scratch", "p-gpu"))
    async with kube_translator(nats_url, apiserver, tmp_path / "tls2"):
        await eventually(lambda: events_about(apiserver, "scratch", "p-gpu")[0].get("count") == 2)
    role = next(d for d in yaml.safe_load_all((DEPLOY_K8S / "translator.yaml").read_text())
                if d and d["kind"] == "ClusterRole")
    # (delete: a template a server without DRAConsumableCapacity mangled, test_real_consumable_capacity)
    kube_rbac.check(apiserver.requests, role, elsewhere=frozenset({("resource.k8s.io", "resourceclaimtemplates", "delete")}))
