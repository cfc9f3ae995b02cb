"""The client seam (tessera.shared.kubeapi) against the emulator: verbs, classified errors, a watch
that survives 410 Gone and an API server restart."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from kube_objects import claim, configmap, pod
from tessera.shared.errors import ConflictError, PermanentError, TemporaryError
from tessera.shared.kubeapi import (
    AlreadyExists,
    ApiException,
    Conflict,
    Invalid,
    KubeApi,
    NotFound,
    Unavailable,
    object_path,
)
from tessera.shared.cancelling import cancel_and_wait

CONFIGMAPS = object_path("v1", "configmaps", namespace="default")
PODS = object_path("v1", "pods", namespace="default")
CLAIMS = object_path("resource.k8s.io/v1", "resourceclaims", namespace="default")


async def test_create_get_list_with_selectors(kube):
    created = await kube.create(CONFIGMAPS, configmap("a", data={"k": "v"}, labels={"team": "x"}))
    await kube.create(CONFIGMAPS, configmap("b"))
    assert (await kube.get(f"{CONFIGMAPS}/a"))["metadata"]["uid"] == created["metadata"]["uid"]
    assert await kube.get(f"{CONFIGMAPS}/nope") is None
    items, rv = await kube.list(CONFIGMAPS, label_selector="team=x")
    assert [i["metadata"]["name"] for i in items] == ["a"]
    assert items[0]["kind"] == "ConfigMap" and items[0]["apiVersion"] == "v1"
    assert int(rv) >= int(created["metadata"]["resourceVersion"])
    items, _ = await kube.list(CONFIGMAPS, field_selector="metadata.name=b")
    assert [i["metadata"]["name"] for i in items] == ["b"]


async def test_errors_are_classified_by_what_to_do_next(kube, apiserver):
    created = await kube.create(CLAIMS, claim("c"))
    with pytest.raises(AlreadyExists) as exists:
        await kube.create(CLAIMS, claim("c"))
    assert isinstance(exists.value, ConflictError) and exists.value.status == 409

    await kube.patch(f"{CLAIMS}/c", {"metadata": {"labels": {"a": "1"}}})
    with pytest.raises(Conflict) as stale:
        await kube.replace(f"{CLAIMS}/c", created)
    assert isinstance(stale.value, ConflictError) and not isinstance(stale.value, AlreadyExists)
    assert "the object has been modified" in str(stale.value)

    with pytest.raises(NotFound) as missing:
        await kube.patch(f"{CLAIMS}/gone", {"metadata": {"labels": {"a": "1"}}})
    assert isinstance(missing.value, PermanentError)

    with pytest.raises(Invalid) as invalid:
        await kube.patch_status(f"{CLAIMS}/c", {"status": {"allocation": {"devices": {"resultz": []}}}})
    assert isinstance(invalid.value, PermanentError)
    assert "status.allocation.devices.resultz" in invalid.value.message

    apiserver.fail("GET", r"/resourceclaims/c$", status=503)
    with pytest.raises(Unavailable) as down:
        await kube.get(f"{CLAIMS}/c")
    assert isinstance(down.value, TemporaryError) and isinstance(down.value, ApiException)
    apiserver.fail("GET", r"/resourceclaims/c$", status=429)
    with pytest.raises(Unavailable) as throttled:
        await kube.get(f"{CLAIMS}/c")
    assert throttled.value.delay == 1.0

    await apiserver.stop()
    with pytest.raises(Unavailable) as unreachable:
        await kube.get(f"{CLAIMS}/c")
    assert unreachable.value.status == 0 and isinstance(unreachable.value, TemporaryError)
    await apiserver.start()
    assert await kube.get(f"{CLAIMS}/c") is not None


async def test_replace_and_status_writes_with_optimistic_concurrency(kube):
    created = await kube.create(CLAIMS, claim("c"))
    allocation = {"devices": {"results": [{"request": "gpu", "driver": "gpu.tessera.dev", "pool": "n1",
                                           "device": "gpu-0"}]}}
    written = await kube.replace_status(f"{CLAIMS}/c", dict(created, status={"allocation": allocation}))
    assert written["status"]["allocation"] == allocation
    with pytest.raises(Conflict):  # created's resourceVersion is stale now
        await kube.replace_status(f"{CLAIMS}/c", dict(created, status={}))
    cleared = await kube.patch_status(f"{CLAIMS}/c", {"metadata": {"resourceVersion":
                                                                   written["metadata"]["resourceVersion"]},
                                                      "status": {"allocation": None}})
    assert "allocation" not in cleared.get("status", {})


async def test_patch_kinds(kube):
    await kube.create(PODS, pod("p", gates=("a", "b")))
    patched = await kube.patch(f"{PODS}/p", [{"op": "remove", "path": "/spec/schedulingGates/0"}], kind="json")
    assert patched["spec"]["schedulingGates"] == [{"name": "b"}]
    patched = await kube.patch(f"{PODS}/p", {"spec": {"schedulingGates": [{"name": "b", "$patch": "delete"}]}},
                               kind="strategic")
    assert not patched["spec"].get("schedulingGates")


async def test_delete_with_preconditions(kube):
    created = await kube.create(CONFIGMAPS, configmap("a"))
    await kube.patch(f"{CONFIGMAPS}/a", {"data": {"k": "v"}})
    with pytest.raises(Conflict):
        await kube.delete(f"{CONFIGMAPS}/a", preconditions={"resourceVersion": created["metadata"]["resourceVersion"]})
    gone = await kube.delete(f"{CONFIGMAPS}/a", preconditions={"uid": created["metadata"]["uid"]})
    assert gone["metadata"]["name"] == "a"
    assert await kube.get(f"{CONFIGMAPS}/a") is None
    with pytest.raises(NotFound):
        await kube.delete(f"{CONFIGMAPS}/a")


async def test_apply_creates_then_merges(kube):
    path = f"{CONFIGMAPS}/cfg"
    obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg", "namespace": "default"},
           "data": {"k": "v"}}
    first = await kube.apply(path, CONFIGMAPS, obj, "tessera-test")
    again = await kube.apply(path, CONFIGMAPS, obj, "tessera-test")
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

    async def next(self, count: int) -> list[tuple[str, str]]:
        return [await asyncio.wait_for(self.events.get(), 10) for _ in range(count)]

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


async def test_watch_lists_then_follows_changes(kube, apiserver):
    await apiserver.create(configmap("a", labels={"app": "x"}))
    await apiserver.create(configmap("skip"))
    async with watching(kube, CONFIGMAPS, label_selector="app=x") as watch:
        assert await watch.next(1) == [("ADDED", "a")]
        await kube.create(CONFIGMAPS, configmap("b", labels={"app": "x"}))
        await kube.patch(f"{CONFIGMAPS}/a", {"data": {"k": "v"}})
        await kube.delete(f"{CONFIGMAPS}/b")
        assert await watch.next(3) == [("ADDED", "b"), ("MODIFIED", "a"), ("DELETED", "b")]


async def test_watch_from_a_resource_version(kube, apiserver):
    created = await apiserver.create(configmap("a"))
    await apiserver.patch("v1", "configmaps", "a", {"data": {"k": "v"}}, "default")
    async with watching(kube, CONFIGMAPS, resource_version=created["metadata"]["resourceVersion"]) as watch:
        assert await watch.next(1) == [("MODIFIED", "a")]


async def test_watch_resumes_after_the_api_server_restarts(kube, apiserver):
    await apiserver.create(configmap("a"))
    async with watching(kube, CONFIGMAPS) as watch:
        assert await watch.next(1) == [("ADDED", "a")]
        await apiserver.stop()
        await apiserver.patch("v1", "configmaps", "a", {"data": {"k": "v"}}, "default")
        await apiserver.create(configmap("b"))
        await asyncio.sleep(0.3)  # let the watch fail to reconnect at least once
        await apiserver.start()
        assert await watch.next(2) == [("MODIFIED", "a"), ("ADDED", "b")]


async def test_watch_relists_on_410_gone_and_reports_the_difference(kube, apiserver):
    for name in ("a", "b"):
        await apiserver.create(configmap(name))
    async with watching(kube, CONFIGMAPS) as watch:
        assert sorted(await watch.next(2)) == [("ADDED", "a"), ("ADDED", "b")]
        await apiserver.stop()
        await apiserver.delete("v1", "configmaps", "a", "default")
        await apiserver.patch("v1", "configmaps", "b", {"data": {"k": "v"}}, "default")
        await apiserver.create(configmap("c"))
        apiserver.compact()  # what happened while the watch was away is no longer replayable
        seen = len(apiserver.requests)
        await apiserver.start()
        assert await watch.next(3) == [("DELETED", "a"), ("MODIFIED", "b"), ("ADDED", "c")]
    after = [(path, query.get("watch")) for method, path, query in apiserver.requests[seen:]]
    assert after[:2] == [(CONFIGMAPS, "true"), (CONFIGMAPS, None)]  # the watch got 410, then a list


async def test_watch_reconnects_through_injected_server_errors(kube, apiserver):
    await apiserver.create(configmap("a"))
    fault = apiserver.fail("GET", r"/configmaps$", status=503, times=3)
    async with watching(kube, CONFIGMAPS) as watch:
        assert await watch.next(1) == [("ADDED", "a")]
    assert fault.hits == 3


async def test_watch_raises_what_retrying_cannot_fix(kube):
    stream = kube.watch(object_path("v1", "pods", namespace="default"), field_selector="spec.bogus=1")
    with pytest.raises(PermanentError):
        await stream.__anext__()
    await stream.aclose()
