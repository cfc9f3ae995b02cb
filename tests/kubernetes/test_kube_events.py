"""Kubernetes Events as every service records them (tessera.shared.kubeapi.Events), on the real
kube-apiserver: a repeat counted on one Event, whoever repeats it; distinct reports distinct Events;
an Event only in its object's namespace; and placement's and the translator's reports, each service
acting as its own identity (deploy/k8s), counted so.

The recorder acts as a service account that may do to events only what the services' manifests
grant (get, create, patch) in the test's namespace; the test reads and deletes as the admin.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from kube_objects import configmap
from tessera.placement.kube import KubeWriter
from tessera.shared.kubeapi import Events, Invalid, KubeApi, object_path
from tessera.shared.kubeclaims import RESOURCE_API_VERSION, KubeClaimRef
from tessera.translator.kube import Cluster

from kit.kubecluster import namespace_identity, service_identity

RULES = [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]},
         {"apiGroups": [""], "resources": ["events"], "verbs": ["get", "create", "patch"]}]
COMPONENT = "tessera-test"



@pytest.fixture
async def sides(kube_plane, plane_namespace, admin):
    """(the recorder's client, the admin's, a ConfigMap of the namespace for Events to be about)."""
    kubeconfig = await asyncio.to_thread(namespace_identity, kube_plane, plane_namespace, "events-test", RULES)
    recorder = KubeApi.for_kubeconfig(kubeconfig)
    try:
        about = await recorder.create(object_path("v1", "configmaps", namespace=plane_namespace),
                                      configmap("subject", plane_namespace))
        yield recorder, admin, {**about, "apiVersion": "v1", "kind": "ConfigMap"}
    finally:
        await recorder.close()


async def events_about(admin: KubeApi, obj: dict) -> list[dict]:
    meta = obj["metadata"]
    items, _ = await admin.list(object_path("v1", "events", namespace=meta["namespace"]),
                                field_selector=f"involvedObject.uid={meta['uid']}")
    return items


async def test_a_repeated_event_is_counted_on_one_event(sides):
    recorder, admin, about = sides
    events = Events(recorder, COMPONENT, "replica-a")
    for _ in range(3):
        await events.record(about, "Refused", "the same thing again", warning=True)
    (event,) = await events_about(admin, about)
    assert event["count"] == 3 and event["type"] == "Warning" and event["reason"] == "Refused"
    assert event["involvedObject"]["uid"] == about["metadata"]["uid"]
    assert event["source"]["component"] == COMPONENT and event["reportingInstance"] == "replica-a"
    assert event["lastTimestamp"] >= event["firstTimestamp"]
    # a recorder that knows nothing of it (a restart, another replica) counts on the same one
    await Events(recorder, COMPONENT, "replica-b").record(about, "Refused", "the same thing again", warning=True)
    (again,) = await events_about(admin, about)
    assert again["metadata"]["name"] == event["metadata"]["name"] and again["count"] == 4


async def test_distinct_reports_are_distinct_events(sides):
    recorder, admin, about = sides
    events = Events(recorder, COMPONENT)
    await events.record(about, "Allocated", "on node a")
    await events.record(about, "Unschedulable", "on node a")
    await events.record(about, "Allocated", "on node b")
    await events.record(about, "Allocated", "on node a", warning=True)
    await Events(recorder, "tessera-other").record(about, "Allocated", "on node a")
    found = await events_about(admin, about)
    assert sorted((e["reason"], e["message"], e["type"], e["source"]["component"]) for e in found) == [
        ("Allocated", "on node a", "Normal", "tessera-other"),
        ("Allocated", "on node a", "Normal", COMPONENT),
        ("Allocated", "on node a", "Warning", COMPONENT),
        ("Allocated", "on node b", "Normal", COMPONENT),
        ("Unschedulable", "on node a", "Normal", COMPONENT),
    ]
    assert {e["count"] for e in found} == {1}


async def test_recorders_counting_at_once_lose_no_repeat(sides):
    # Two replicas report the same thing at the same moments: each count is a compare-and-set, so
    # none overwrites another's.
    recorder, admin, about = sides
    replicas = [Events(recorder, COMPONENT, f"replica-{i}") for i in range(2)]
    await asyncio.gather(*(r.record(about, "Unschedulable", "no GPU fits") for r in replicas for _ in range(5)))
    (event,) = await events_about(admin, about)
    assert event["count"] == 10


async def test_an_event_deleted_meanwhile_is_made_again(sides):
    recorder, admin, about = sides
    events = Events(recorder, COMPONENT)
    first = await events.record(about, "Unschedulable", "no GPU fits")
    await admin.delete(object_path("v1", "events", first["metadata"]["name"], first["metadata"]["namespace"]))
    await events.record(about, "Unschedulable", "no GPU fits")
    (event,) = await events_about(admin, about)
    assert event["count"] == 1 and event["metadata"]["uid"] != first["metadata"]["uid"]


async def test_an_event_for_an_object_in_another_namespace_is_refused_clearly(sides):
    recorder, admin, about = sides
    ns = about["metadata"]["namespace"]
    # the API server's rule: an Event written in one namespace about an object of another is invalid
    elsewhere = {"apiVersion": "v1", "kind": "ConfigMap", "name": "subject", "namespace": "default"}
    with pytest.raises(Invalid, match="does not match event.namespace"):
        await recorder.create(object_path("v1", "events", namespace=ns), {
            "apiVersion": "v1", "kind": "Event", "metadata": {"name": "misplaced", "namespace": ns},
            "involvedObject": elsewhere, "reason": "Refused", "message": "x", "type": "Normal"})
    # the recorder refuses one before it is sent, saying where it belongs
    with pytest.raises(Invalid, match=f"cannot be written in namespace {ns}: .* namespace \\(default\\)"):
        await Events(recorder, COMPONENT).record(elsewhere, "Refused", "x", namespace=ns)
    with pytest.raises(Invalid, match=f"namespace \\({ns}\\); record it there"):
        await Events(recorder, COMPONENT).record(about, "Refused", "x", namespace="default")
    items, _ = await admin.list(object_path("v1", "events", namespace=ns), field_selector="reason=Refused")
    assert items == []


async def test_a_relayed_event_keeps_the_count_its_recorder_reached(sides):
    # The tenant pods syncer tells a host Event to the tenant's cluster with the host's count: a
    # relay said again (its watch listing anew after a restart) does not count twice.
    recorder, admin, about = sides
    relay = Events(recorder, COMPONENT, host="node-a")
    for count in (3, 5, 5):
        await relay.record(about, "FailedScheduling", "0/1 nodes are available", warning=True, count=count)
    (event,) = await events_about(admin, about)
    assert event["count"] == 5 and event["source"] == {"component": COMPONENT, "host": "node-a"}


# --- the services' reports ---------------------------------------------------------------------

async def events_on(admin: KubeApi, namespace: str, name: str) -> list[dict]:
    items, _ = await admin.list(object_path("v1", "events", namespace=namespace),
                                field_selector=f"involvedObject.name={name}")
    return items


async def test_placement_counts_a_repeated_report_on_the_pod(kube_plane, plane_namespace, admin):
    identity = await asyncio.to_thread(service_identity, kube_plane, "placement.yaml")
    ref = KubeClaimRef(namespace=plane_namespace, name="train-gpu", uid=str(uuid.uuid4()), pod="train",
                       pod_uid=str(uuid.uuid4()))
    said = {"reason": "Unschedulable", "message": "ResourceClaim train-gpu: no GPU fits", "warning": True}
    for _ in range(2):  # the first writer repeats it; then a restarted one (it knows nothing of it)
        writer = KubeWriter(KubeApi.for_kubeconfig(identity), instance="placement-0")
        try:
            await writer.report(ref, **said)
            await writer.report(ref, **said)
        finally:
            await writer.close()
    (event,) = await events_on(admin, plane_namespace, "train")
    assert event["count"] == 4 and event["type"] == "Warning" and event["reason"] == "Unschedulable"
    assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "name": "train",
                                       "namespace": plane_namespace, "uid": ref.pod_uid}
    assert event["source"]["component"] == "tessera-placement" and event["reportingInstance"] == "placement-0"


async def test_the_translator_counts_reports_made_at_the_same_moment(kube_plane, plane_namespace, admin):
    identity = await asyncio.to_thread(service_identity, kube_plane, "translator.yaml")
    cluster = Cluster(KubeApi.for_kubeconfig(identity), "translator-0")
    claim = {"apiVersion": RESOURCE_API_VERSION, "kind": "ResourceClaim",
             "metadata": {"name": "c", "namespace": plane_namespace, "uid": str(uuid.uuid4())}}
    try:
        await asyncio.gather(*(cluster.event(claim, "NoTenant", "the namespace names no tenant") for _ in range(3)))
    finally:
        await cluster.close()
    (event,) = await events_on(admin, plane_namespace, "c")
    assert event["count"] == 3 and event["type"] == "Warning"
    assert event["involvedObject"]["uid"] == claim["metadata"]["uid"]
