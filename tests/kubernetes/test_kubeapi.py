"""The client seam (tessera.shared.kubeapi) against the real kube-apiserver: verbs, classified
errors, a watch that survives an API server restart and 410 Gone.

The client acts as a service account that may do only what these tests do in their namespace
(`namespace_identity`), on the session's control plane (`kube_plane`). The faults that need the
server to go away run on the session's spare control plane (`breakable_plane`), with a second API
server on the same etcd that changes the cluster while the first is down. Injected 503/429
answers the real server cannot be made to give are test_emulated_faults.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import pytest

from kube_objects import claim as gpu_claim, configmap, pod
from tessera.shared.errors import ConflictError, PermanentError, TemporaryError
from tessera.shared.kubeapi import AlreadyExists, Conflict, Invalid, KubeApi, NotFound, Unavailable, object_path
from tessera.shared.cancelling import cancel_and_wait

from kit.kubecluster import KubeControlPlane, namespace_identity

# What the tests' client may do in its namespace, and nothing else.
RULES = [{"apiGroups": [""], "resources": ["configmaps", "pods"], "verbs": ["*"]},
         {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims", "resourceclaims/status"], "verbs": ["*"]}]
# (an allocation's write is authorized a second time, cluster-wide, as resourceclaims/binding)
CLUSTER_RULES = [{"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/binding"], "verbs": ["update", "patch"]}]


def claim(name: str, namespace: str) -> dict:
    """A ResourceClaim of a class not Tessera's (deploy/k8s's admission policies let only the
    resourceclaim controller make claims of gpu.tessera.dev)."""
    doc = gpu_claim(name, namespace)
    doc["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "other.example.com"
    return doc


APP = {"app": "x"}  # (a namespace has the controllers' kube-root-ca.crt too)


def paths(ns: str) -> tuple[str, str, str]:
    return (object_path("v1", "configmaps", namespace=ns), object_path("v1", "pods", namespace=ns),
            object_path("resource.k8s.io/v1", "resourceclaims", namespace=ns))


async def client(plane: KubeControlPlane, ns: str) -> KubeApi:
    return KubeApi.for_kubeconfig(await asyncio.to_thread(namespace_identity, plane, ns, "kubeapi-test", RULES,
                                                         CLUSTER_RULES))


@pytest.fixture
async def kube(kube_plane, plane_namespace):
    api = await client(kube_plane, plane_namespace)
    try:
        yield api
    finally:
        await api.close()


@pytest.fixture
async def own(breakable_plane):
    """(plane, namespace, client, a cluster-admin client of a second API server on the same etcd)."""
    plane = breakable_plane
    ns = f"t-{uuid.uuid4().hex[:10]}"
    await asyncio.to_thread(plane.kubectl, "create", "namespace", ns)
    second = await asyncio.to_thread(plane.add_apiserver)
    api, meanwhile = await client(plane, ns), KubeApi.for_kubeconfig(second)
    try:
        yield plane, ns, api, meanwhile
    finally:
        await api.close()
        await meanwhile.close()


async def test_create_get_list_with_selectors(kube, plane_namespace):
    configmaps, _, _ = paths(plane_namespace)
    created = await kube.create(configmaps, configmap("a", plane_namespace, data={"k": "v"}, labels={"team": "x"}))
    await kube.create(configmaps, configmap("b", plane_namespace))
    assert (await kube.get(f"{configmaps}/a"))["metadata"]["uid"] == created["metadata"]["uid"]
    assert await kube.get(f"{configmaps}/nope") is None
    items, rv = await kube.list(configmaps, label_selector="team=x")
    assert [i["metadata"]["name"] for i in items] == ["a"]
    assert items[0]["kind"] == "ConfigMap" and items[0]["apiVersion"] == "v1"
    assert int(rv) >= int(created["metadata"]["resourceVersion"])
    items, _ = await kube.list(configmaps, field_selector="metadata.name=b")
    assert [i["metadata"]["name"] for i in items] == ["b"]


async def test_errors_are_classified_by_what_to_do_next(kube, plane_namespace):
    _, _, claims = paths(plane_namespace)
    created = await kube.create(claims, claim("c", plane_namespace))
    with pytest.raises(AlreadyExists) as exists:
        await kube.create(claims, claim("c", plane_namespace))
    assert isinstance(exists.value, ConflictError) and exists.value.status == 409

    await kube.patch(f"{claims}/c", {"metadata": {"labels": {"a": "1"}}})
    with pytest.raises(Conflict) as stale:
        await kube.replace(f"{claims}/c", created)
    assert isinstance(stale.value, ConflictError) and not isinstance(stale.value, AlreadyExists)
    assert "the object has been modified" in str(stale.value)

    with pytest.raises(NotFound) as missing:
        await kube.patch(f"{claims}/gone", {"metadata": {"labels": {"a": "1"}}})
    assert isinstance(missing.value, PermanentError)

    with pytest.raises(Invalid) as invalid:  # a result for a request the claim does not make
        await kube.patch_status(f"{claims}/c", {"status": {"allocation": {"devices": {"results": [
            {"request": "no-such-request", "driver": "gpu.tessera.dev", "pool": "n1", "device": "gpu-0"}]}}}})
    assert isinstance(invalid.value, PermanentError)
    assert "status.allocation.devices.results[0].request" in invalid.value.message


async def test_an_unreachable_api_server_is_a_temporary_error(own):
    plane, ns, kube, _ = own
    _, _, claims = paths(ns)
    await kube.create(claims, claim("c", ns))
    await asyncio.to_thread(plane.stop_apiserver)
    with pytest.raises(Unavailable) as unreachable:
        await kube.get(f"{claims}/c")
    assert unreachable.value.status == 0 and isinstance(unreachable.value, TemporaryError)
    await asyncio.to_thread(plane.start_apiserver)
    assert await kube.get(f"{claims}/c") is not None


async def test_replace_and_status_writes_with_optimistic_concurrency(kube, plane_namespace):
    _, _, claims = paths(plane_namespace)
    created = await kube.create(claims, claim("c", plane_namespace))
    allocation = {"devices": {"results": [{"request": "gpu", "driver": "gpu.tessera.dev", "pool": "n1",
                                           "device": "gpu-0"}]}}
    written = await kube.replace_status(f"{claims}/c", dict(created, status={"allocation": allocation}))
    assert written["status"]["allocation"] == allocation
    with pytest.raises(Conflict):  # created's resourceVersion is stale now
        await kube.replace_status(f"{claims}/c", dict(created, status={}))
    cleared = await kube.patch_status(f"{claims}/c", {"metadata": {"resourceVersion":
                                                                   written["metadata"]["resourceVersion"]},
                                                      "status": {"allocation": None}})
    assert "allocation" not in cleared.get("status", {})


async def test_patch_kinds(kube, plane_namespace):
    _, pods, _ = paths(plane_namespace)
    await kube.create(pods, pod("p", plane_namespace, gates=("example.com/a", "example.com/b")))
    patched = await kube.patch(f"{pods}/p", [{"op": "remove", "path": "/spec/schedulingGates/0"}], kind="json")
    assert patched["spec"]["schedulingGates"] == [{"name": "example.com/b"}]
    patched = await kube.patch(f"{pods}/p", {"spec": {"schedulingGates": [{"name": "example.com/b",
                                                                           "$patch": "delete"}]}},
                               kind="strategic")
    assert not patched["spec"].get("schedulingGates")


async def test_delete_with_preconditions(kube, plane_namespace):
    configmaps, _, _ = paths(plane_namespace)
    created = await kube.create(configmaps, configmap("a", plane_namespace))
    await kube.patch(f"{configmaps}/a", {"data": {"k": "v"}})
    with pytest.raises(Conflict):
        await kube.delete(f"{configmaps}/a", preconditions={"resourceVersion": created["metadata"]["resourceVersion"]})
    gone = await kube.delete(f"{configmaps}/a", preconditions={"uid": created["metadata"]["uid"]})
    # (an object deleted at once is answered with a Status naming it, not with the object)
    assert gone["kind"] == "Status" and gone["details"]["name"] == "a" and gone["details"]["uid"] == created["metadata"]["uid"]
    assert await kube.get(f"{configmaps}/a") is None
    with pytest.raises(NotFound):
        await kube.delete(f"{configmaps}/a")


async def test_apply_creates_then_merges(kube, plane_namespace):
    configmaps, _, _ = paths(plane_namespace)
    path = f"{configmaps}/cfg"
    obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg", "namespace": plane_namespace},
           "data": {"k": "v"}}
    first = await kube.apply(path, configmaps, obj, "tessera-test")
    again = await kube.apply(path, configmaps, obj, "tessera-test")
    assert first["metadata"]["resourceVersion"] == again["metadata"]["resourceVersion"]


class Recorder:
    """Runs kube.watch in a task and hands its events to the test one by one."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.events: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for kind, obj in self.stream:
            self.events.put_nowait((kind, obj["metadata"]["name"]))

    async def next(self, count: int, timeout: float = 10) -> list[tuple[str, str]]:
        return [await asyncio.wait_for(self.events.get(), timeout) for _ in range(count)]

    async def close(self) -> None:
        await cancel_and_wait([self.task])
        if not self.task.cancelled():
            self.task.result()  # it ended before its cancel: raise what ended it
        await self.stream.aclose()
        assert self.events.empty(), [self.events.get_nowait() for _ in range(self.events.qsize())]


@contextlib.asynccontextmanager
async def watching(kube: KubeApi, path: str, **kwargs):
    recorder = Recorder(kube.watch(path, max_backoff=0.2, **kwargs))
    try:
        yield recorder
    finally:
        await recorder.close()


async def test_watch_lists_then_follows_changes(kube, plane_namespace):
    configmaps, _, _ = paths(plane_namespace)
    await kube.create(configmaps, configmap("a", plane_namespace, labels={"app": "x"}))
    await kube.create(configmaps, configmap("skip", plane_namespace))
    async with watching(kube, configmaps, label_selector="app=x") as watch:
        assert await watch.next(1) == [("ADDED", "a")]
        await kube.create(configmaps, configmap("b", plane_namespace, labels={"app": "x"}))
        await kube.patch(f"{configmaps}/a", {"data": {"k": "v"}})
        await kube.delete(f"{configmaps}/b")
        assert await watch.next(3) == [("ADDED", "b"), ("MODIFIED", "a"), ("DELETED", "b")]


async def test_watch_from_a_resource_version(kube, plane_namespace):
    configmaps, _, _ = paths(plane_namespace)
    created = await kube.create(configmaps, configmap("a", plane_namespace, labels={"app": "x"}))
    await kube.patch(f"{configmaps}/a", {"data": {"k": "v"}})
    async with watching(kube, configmaps, resource_version=created["metadata"]["resourceVersion"],
                        label_selector="app=x") as watch:
        assert await watch.next(1) == [("MODIFIED", "a")]


async def test_watch_resumes_after_the_api_server_restarts(own):
    plane, ns, kube, meanwhile = own
    configmaps, _, _ = paths(ns)
    await kube.create(configmaps, configmap("a", ns, labels=APP))
    async with watching(kube, configmaps, label_selector="app=x") as watch:
        assert await watch.next(1) == [("ADDED", "a")]
        await asyncio.to_thread(plane.stop_apiserver)
        await meanwhile.patch(f"{configmaps}/a", {"data": {"k": "v"}})  # through the other API server
        await meanwhile.create(configmaps, configmap("b", ns, labels=APP))
        await asyncio.sleep(0.3)  # let the watch fail to reconnect at least once
        await asyncio.to_thread(plane.start_apiserver)
        assert await watch.next(2, timeout=30) == [("MODIFIED", "a"), ("ADDED", "b")]


async def test_watch_relists_on_410_gone_and_reports_the_difference(own):
    plane, ns, kube, meanwhile = own
    configmaps, _, _ = paths(ns)
    for name in ("a", "b"):
        await kube.create(configmaps, configmap(name, ns, labels=APP))
    async with watching(kube, configmaps, label_selector="app=x") as watch:
        assert sorted(await watch.next(2)) == [("ADDED", "a"), ("ADDED", "b")]
        await asyncio.to_thread(plane.stop_apiserver)
        await meanwhile.delete(f"{configmaps}/a")
        await meanwhile.patch(f"{configmaps}/b", {"data": {"k": "v"}})
        await meanwhile.create(configmaps, configmap("c", ns, labels=APP))
        await asyncio.to_thread(plane.compact_etcd)  # what happened while the watch was away is gone
        seen = len(plane.audit())
        await asyncio.to_thread(plane.start_apiserver)
        assert await watch.next(3, timeout=30) == [("DELETED", "a"), ("MODIFIED", "b"), ("ADDED", "c")]
    # the watch got 410 (an ERROR event in a watch answered 200, as the watch cache answers it), then a
    # list; each request once (a watch is audited when it starts and again when it ends) and not the
    # refusals of the server's warm-up (401/403 before its caches are filled)
    asked = [e for e in plane.audit()[seen:] if e["user"]["username"].endswith(":kubeapi-test")
             and e.get("objectRef", {}).get("namespace") == ns and e["responseStatus"]["code"] not in (401, 403)
             and not (e["verb"] == "watch" and e["stage"] == "ResponseComplete")]
    assert [e["verb"] for e in asked][:3] == ["watch", "list", "watch"], \
        [(e["verb"], e["stage"], e["responseStatus"]["code"], e["requestURI"][-80:]) for e in asked]


async def test_watch_raises_what_retrying_cannot_fix(kube, plane_namespace):
    _, pods, _ = paths(plane_namespace)
    stream = kube.watch(pods, field_selector="spec.bogus=1")
    with pytest.raises(PermanentError):
        await stream.__anext__()
    await stream.aclose()

