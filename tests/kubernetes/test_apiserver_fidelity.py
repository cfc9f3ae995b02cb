"""The API-server emulator keeps the contract of kube-apiserver that the services rely on.

Spoken to over plain HTTP (aiohttp), so that nothing a client library smooths over hides a
difference: status codes, ``Status`` bodies, resourceVersions, watch streams.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import aiohttp
import pytest

from apiserver import ApiError
from kube_objects import binding, claim, configmap, namespace, pod

PODS = "/api/v1/namespaces/default/pods"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"
MERGE = {"Content-Type": "application/merge-patch+json"}


@pytest.fixture
async def http(apiserver):
    async with aiohttp.ClientSession(base_url=apiserver.url) as session:
        yield session


async def send(http, method: str, path: str, body=None, headers=None, **params) -> tuple[int, dict]:
    data = body if isinstance(body, (str, bytes)) or body is None else json.dumps(body)
    async with http.request(method, path, data=data, params=params or None,
                            headers=headers or {"Content-Type": "application/json"}) as r:
        return r.status, await r.json()


async def test_create_assigns_identity_and_a_global_resource_version(http):
    status, first = await send(http, "POST", PODS, pod("a"))
    assert status == 201
    meta = first["metadata"]
    assert uuid.UUID(meta["uid"]).version == 4
    assert meta["creationTimestamp"].endswith("Z") and meta["generation"] == 1
    status, second = await send(http, "POST", "/api/v1/namespaces/default/configmaps",
                                configmap("", generateName="cfg-"))
    assert status == 201
    assert second["metadata"]["name"].startswith("cfg-") and len(second["metadata"]["name"]) == 9
    assert "generation" not in second["metadata"]
    assert int(second["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])
    status, again = await send(http, "POST", PODS, pod("a"))
    assert status == 409 and again["reason"] == "AlreadyExists" and again["kind"] == "Status"
    status, missing = await send(http, "GET", f"{PODS}/nope")
    assert status == 404 and missing["reason"] == "NotFound" and missing["message"] == 'pods "nope" not found'


async def test_cluster_scoped_namespaces_route_and_unknown_namespaces_refuse_content(http):
    status, _ = await send(http, "POST", "/api/v1/namespaces", namespace("team-a", {"tessera.io/tenant": "a"}))
    assert status == 201
    status, listed = await send(http, "GET", "/api/v1/namespaces", labelSelector="tessera.io/tenant=a")
    assert [n["metadata"]["name"] for n in listed["items"]] == ["team-a"]
    status, refused = await send(http, "POST", "/api/v1/namespaces/ghost/pods", pod("a", "ghost"))
    assert status == 404 and refused["message"] == 'namespaces "ghost" not found'


async def test_stale_resource_version_is_a_conflict_on_put_and_patch(http):
    _, created = await send(http, "POST", CLAIMS, claim("c"))
    stale = created["metadata"]["resourceVersion"]
    labelled = {"metadata": {"labels": {"a": "1"}, "resourceVersion": stale}}
    status, fresh = await send(http, "PATCH", f"{CLAIMS}/c", labelled, MERGE)
    assert status == 200 and int(fresh["metadata"]["resourceVersion"]) > int(stale)
    status, lost = await send(http, "PATCH", f"{CLAIMS}/c", {"metadata": {"labels": {"a": "2"},
                                                                          "resourceVersion": stale}}, MERGE)
    assert status == 409 and lost["reason"] == "Conflict"
    assert "the object has been modified" in lost["message"]
    status, lost = await send(http, "PUT", f"{CLAIMS}/c", created)
    assert status == 409 and lost["reason"] == "Conflict"
    status, kept = await send(http, "GET", f"{CLAIMS}/c")
    assert kept["metadata"]["labels"] == {"a": "1"}


async def test_unknown_field_in_a_claim_status_is_invalid_and_names_the_field(http, apiserver):
    await send(http, "POST", CLAIMS, claim("c"))
    before = len(apiserver.writes)
    status, refused = await send(http, "PATCH", f"{CLAIMS}/c/status", {"status": {"allocation": {
        "devices": {"results": [{"request": "gpu", "driver": "gpu.tessera.dev", "pool": "n1", "device": "gpu-0",
                                 "shareId": "wrong-case"}]}}}}, MERGE)
    assert status == 422 and refused["reason"] == "Invalid"
    field = "status.allocation.devices.results[0].shareId"
    assert field in refused["message"]
    assert [c["field"] for c in refused["details"]["causes"]] == [field]
    assert "status" not in apiserver.object("resource.k8s.io/v1", "resourceclaims", "c", "default")
    assert len(apiserver.writes) == before


async def test_allocation_must_name_a_request_and_cannot_change_once_set(http):
    await send(http, "POST", CLAIMS, claim("c"))
    result = {"request": "other", "driver": "gpu.tessera.dev", "pool": "n1", "device": "gpu-0"}
    status, refused = await send(http, "PATCH", f"{CLAIMS}/c/status",
                                 {"status": {"allocation": {"devices": {"results": [result]}}}}, MERGE)
    assert status == 422 and "status.allocation.devices.results[0].request" in refused["message"]
    result["request"] = "gpu"
    status, _ = await send(http, "PATCH", f"{CLAIMS}/c/status",
                           {"status": {"allocation": {"devices": {"results": [result]}}}}, MERGE)
    assert status == 200
    moved = dict(result, device="gpu-1")
    status, refused = await send(http, "PATCH", f"{CLAIMS}/c/status",
                                 {"status": {"allocation": {"devices": {"results": [moved]}}}}, MERGE)
    assert status == 422 and "status.allocation" in refused["message"]


async def test_status_subresource_separates_spec_and_status_writes(http):
    _, created = await send(http, "POST", CLAIMS, dict(claim("c"), status={"reservedFor": []}))
    assert "status" not in created  # create ignores status of a kind with a status subresource
    allocation = {"devices": {"results": [{"request": "gpu", "driver": "gpu.tessera.dev", "pool": "n1",
                                           "device": "gpu-0"}]}}
    status, through_main = await send(http, "PATCH", f"{CLAIMS}/c",
                                      {"metadata": {"labels": {"x": "1"}}, "status": {"allocation": allocation}},
                                      MERGE)
    assert status == 200 and "status" not in through_main and through_main["metadata"]["labels"] == {"x": "1"}
    status, through_status = await send(http, "PATCH", f"{CLAIMS}/c/status",
                                        {"metadata": {"labels": {"x": "2"}}, "status": {"allocation": allocation}},
                                        MERGE)
    assert status == 200 and through_status["status"]["allocation"] == allocation
    assert through_status["metadata"]["labels"] == {"x": "1"}
    assert int(through_status["metadata"]["resourceVersion"]) > int(through_main["metadata"]["resourceVersion"])
    assert through_status["metadata"]["generation"] == through_main["metadata"]["generation"] == 1


async def test_generation_moves_with_the_spec_only(http, apiserver):
    deployments = "/apis/apps/v1/namespaces/default/deployments"
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
                  "spec": {"selector": {"matchLabels": {"app": "d"}},
                           "template": {"metadata": {"labels": {"app": "d"}},
                                        "spec": {"containers": [{"name": "c", "image": "i:1"}]}}}}
    await send(http, "POST", deployments, deployment)
    _, labelled = await send(http, "PATCH", f"{deployments}/d", {"metadata": {"labels": {"a": "b"}}}, MERGE)
    assert labelled["metadata"]["generation"] == 1
    _, scaled = await send(http, "PATCH", f"{deployments}/d", {"spec": {"replicas": 3}}, MERGE)
    assert scaled["metadata"]["generation"] == 2
    _, reported = await send(http, "PATCH", f"{deployments}/d/status", {"status": {"readyReplicas": 3}}, MERGE)
    assert reported["metadata"]["generation"] == 2 and reported["status"] == {"readyReplicas": 3}


async def test_patch_types_json_and_strategic_merge_by_key(http):
    _, created = await send(http, "POST", PODS, pod("p", gates=("a", "b")))
    status, patched = await send(http, "PATCH", f"{PODS}/p",
                                 [{"op": "test", "path": "/spec/schedulingGates/0/name", "value": "a"},
                                  {"op": "remove", "path": "/spec/schedulingGates/0"}],
                                 {"Content-Type": "application/json-patch+json"})
    assert status == 200 and patched["spec"]["schedulingGates"] == [{"name": "b"}]
    status, failed = await send(http, "PATCH", f"{PODS}/p",
                                [{"op": "test", "path": "/spec/schedulingGates/0/name", "value": "a"}],
                                {"Content-Type": "application/json-patch+json"})
    assert status == 422
    strategic = {"Content-Type": "application/strategic-merge-patch+json"}
    status, patched = await send(http, "PATCH", f"{PODS}/p/status", {"status": {"conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"}]}}, strategic)
    status, patched = await send(http, "PATCH", f"{PODS}/p/status", {"status": {"conditions": [
        {"type": "Ready", "status": "False"}]}}, strategic)
    assert status == 200
    assert [c["type"] for c in patched["status"]["conditions"]] == ["PodScheduled", "Ready"]
    status, patched = await send(http, "PATCH", f"{PODS}/p", {"spec": {"schedulingGates": [
        {"name": "b", "$patch": "delete"}]}}, strategic)
    assert status == 200 and not patched["spec"].get("schedulingGates")
    tcps = "/apis/tessera.io/v1alpha1/namespaces/default/tenantcontrolplanes"
    await send(http, "POST", tcps, {"apiVersion": "tessera.io/v1alpha1", "kind": "TenantControlPlane",
                                    "metadata": {"name": "x"}, "spec": {}})
    status, refused = await send(http, "PATCH", f"{tcps}/x", {"spec": {}}, strategic)
    assert status == 415 and refused["reason"] == "UnsupportedMediaType"


async def test_server_side_apply_creates_merges_and_drops_what_it_no_longer_applies(http):
    apply = {"Content-Type": "application/apply-patch+yaml"}
    path = "/api/v1/namespaces/default/configmaps/cfg"
    first = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: cfg, labels: {a: '1', b: '2'}}\ndata: {k: v}\n"
    status, created = await send(http, "PATCH", path, first, apply, fieldManager="tessera", force="true")
    assert status == 201 and created["data"] == {"k": "v"}
    await send(http, "PATCH", path, {"metadata": {"labels": {"other": "x"}}}, MERGE)
    second = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: cfg, labels: {a: '1'}}\ndata: {k: w}\n"
    status, applied = await send(http, "PATCH", path, second, apply, fieldManager="tessera", force="true")
    assert status == 200 and applied["data"] == {"k": "w"}
    assert applied["metadata"]["labels"] == {"a": "1", "other": "x"}
    status, again = await send(http, "PATCH", path, second, apply, fieldManager="tessera", force="true")
    assert again["metadata"]["resourceVersion"] == applied["metadata"]["resourceVersion"]  # a no-op
    status, refused = await send(http, "PATCH", path, second, apply)
    assert status == 400 and "fieldManager" in refused["message"]


async def test_scheduling_gates_only_come_off_and_a_gated_pod_cannot_be_bound(http, apiserver):
    await send(http, "POST", PODS, pod("p"))
    status, refused = await send(http, "POST", f"{PODS}/p/binding", binding("p", "node-1"))
    assert status == 409
    assert refused["message"] == ('Operation cannot be fulfilled on pods/binding "p": '
                                  'pod p has non-empty .spec.schedulingGates')
    status, refused = await send(http, "PATCH", f"{PODS}/p",
                                 {"spec": {"schedulingGates": [{"name": "gpu.tessera.dev/placement"},
                                                               {"name": "another"}]}}, MERGE)
    assert status == 422 and "only deletion is allowed" in refused["message"]
    status, refused = await send(http, "PATCH", f"{PODS}/p", {"spec": {"nodeName": "node-1"}}, MERGE)
    assert status == 422 and "pod updates may not change fields" in refused["message"]
    status, _ = await send(http, "PATCH", f"{PODS}/p", {"spec": {"schedulingGates": None}}, MERGE)
    assert status == 200
    status, _ = await send(http, "POST", f"{PODS}/p/binding", binding("p", "node-1"))
    assert status == 201
    bound = apiserver.object("v1", "pods", "p", "default")
    assert bound["spec"]["nodeName"] == "node-1"
    assert {"type": "PodScheduled", "status": "True"}.items() <= bound["status"]["conditions"][0].items()
    status, refused = await send(http, "POST", f"{PODS}/p/binding", binding("p", "node-2"))
    assert status == 409 and "already assigned" in refused["message"]
    status, refused = await send(http, "PATCH", f"{PODS}/p", {"spec": {"schedulingGates": [{"name": "late"}]}}, MERGE)
    assert status == 422
    status, refused = await send(http, "POST", PODS, dict(pod("q"), spec=dict(pod("q")["spec"], nodeName="n")))
    assert status == 422 and "spec.nodeName" in refused["message"]


async def read_events(response, count: int) -> list[tuple[str, str]]:
    out = []
    while len(out) < count:
        line = await asyncio.wait_for(response.content.readline(), 5)
        assert line, f"watch ended after {out}"
        event = json.loads(line)
        out.append((event["type"], event["object"]["metadata"].get("name") or event["object"].get("reason")))
    return out


async def test_watch_from_a_resource_version_replays_what_came_after(http, apiserver):
    _, first = await send(http, "POST", PODS, pod("a"))
    await send(http, "POST", PODS, pod("b", labels={"app": "x"}))
    await send(http, "PATCH", f"{PODS}/a", {"metadata": {"labels": {"app": "x"}}}, MERGE)
    params = {"watch": "true", "resourceVersion": first["metadata"]["resourceVersion"]}
    async with http.get(PODS, params=params) as response:
        assert response.status == 200
        assert await read_events(response, 2) == [("ADDED", "b"), ("MODIFIED", "a")]
        await send(http, "DELETE", f"{PODS}/b")
        assert await read_events(response, 1) == [("DELETED", "b")]
    params = {"watch": "true", "resourceVersion": first["metadata"]["resourceVersion"], "labelSelector": "app=x"}
    async with http.get(PODS, params=params) as response:
        # a entered the selector (ADDED, not MODIFIED), b came and went
        assert await read_events(response, 3) == [("ADDED", "b"), ("ADDED", "a"), ("DELETED", "b")]
        await send(http, "PATCH", f"{PODS}/a", {"metadata": {"labels": {"app": "y"}}}, MERGE)
        assert await read_events(response, 1) == [("DELETED", "a")]  # it left the selector


async def test_watch_older_than_the_retained_history_is_gone(http, apiserver):
    _, first = await send(http, "POST", PODS, pod("a"))
    await send(http, "POST", PODS, pod("b"))
    apiserver.compact()  # the creation of b is no longer in the history
    params = {"watch": "true", "resourceVersion": first["metadata"]["resourceVersion"]}
    async with http.get(PODS, params=params) as response:
        line = await asyncio.wait_for(response.content.readline(), 5)
        event = json.loads(line)
        assert event["type"] == "ERROR"
        assert event["object"]["code"] == 410 and event["object"]["kind"] == "Status"
        assert "too old resource version" in event["object"]["message"]
    _, listed = await send(http, "GET", PODS)
    params["resourceVersion"] = listed["metadata"]["resourceVersion"]
    async with http.get(PODS, params=params) as response:
        await send(http, "DELETE", f"{PODS}/a")
        assert await read_events(response, 1) == [("DELETED", "a")]


async def test_bounded_history_forgets_the_oldest_changes(apiserver):
    from apiserver import ApiServer

    small = ApiServer(history=3)
    await small.start()
    try:
        first = await small.create(configmap("c0"))
        for i in range(1, 5):
            await small.create(configmap(f"c{i}"))
        async with aiohttp.ClientSession(base_url=small.url) as http:
            params = {"watch": "true", "resourceVersion": first["metadata"]["resourceVersion"]}
            async with http.get("/api/v1/namespaces/default/configmaps", params=params) as response:
                event = json.loads(await asyncio.wait_for(response.content.readline(), 5))
                assert event["type"] == "ERROR" and event["object"]["code"] == 410
    finally:
        await small.stop()


async def test_finalizers_hold_a_deleted_object_until_they_are_removed(http, apiserver):
    await send(http, "POST", CLAIMS, dict(claim("c"), metadata={"name": "c", "finalizers": ["test/hold"]}))
    status, deleting = await send(http, "DELETE", f"{CLAIMS}/c")
    assert status == 200 and deleting["metadata"]["deletionTimestamp"]
    assert apiserver.object("resource.k8s.io/v1", "resourceclaims", "c", "default") is not None
    status, refused = await send(http, "PATCH", f"{CLAIMS}/c", {"metadata": {"finalizers": ["test/hold", "more"]}},
                                 MERGE)
    assert status == 422 and "no new finalizers" in refused["message"]
    status, _ = await send(http, "PATCH", f"{CLAIMS}/c", {"metadata": {"finalizers": None}}, MERGE)
    assert status == 200
    assert apiserver.object("resource.k8s.io/v1", "resourceclaims", "c", "default") is None


async def test_delete_preconditions_guard_against_a_replaced_object(http):
    _, created = await send(http, "POST", PODS, pod("p"))
    status, refused = await send(http, "DELETE", f"{PODS}/p", {"preconditions": {"uid": str(uuid.uuid4())}})
    assert status == 409 and "Precondition failed" in refused["message"]
    status, _ = await send(http, "DELETE", f"{PODS}/p", {"preconditions": {"uid": created["metadata"]["uid"]}})
    assert status == 200


async def test_deleting_an_owner_collects_its_dependents(http, apiserver):
    _, owner = await send(http, "POST", PODS, pod("owner"))
    _, other = await send(http, "POST", PODS, pod("other"))
    ref = {"apiVersion": "v1", "kind": "Pod", "name": "owner", "uid": owner["metadata"]["uid"]}
    other_ref = {"apiVersion": "v1", "kind": "Pod", "name": "other", "uid": other["metadata"]["uid"]}
    for name, refs in (("only", [ref]), ("shared", [ref, other_ref])):
        await send(http, "POST", CLAIMS, dict(claim(name), metadata={"name": name, "ownerReferences": refs}))
    await send(http, "POST", "/api/v1/namespaces/default/configmaps",
               configmap("orphan", ownerReferences=[other_ref]))
    status, _ = await send(http, "DELETE", f"{PODS}/owner", propagationPolicy="Foreground")
    assert status == 200
    names = [c["metadata"]["name"] for c in apiserver.objects("resource.k8s.io/v1", "resourceclaims", "default")]
    assert names == ["shared"]
    shared = apiserver.object("resource.k8s.io/v1", "resourceclaims", "shared", "default")
    assert shared["metadata"]["ownerReferences"] == [other_ref]
    await send(http, "DELETE", f"{PODS}/other", propagationPolicy="Orphan")
    assert apiserver.object("v1", "configmaps", "orphan", "default")["metadata"].get("ownerReferences") is None
    orphaned = apiserver.objects("resource.k8s.io/v1", "resourceclaims")
    assert [c["metadata"]["name"] for c in orphaned] == ["shared"]
    assert "ownerReferences" not in orphaned[0]["metadata"]


async def test_deleting_a_namespace_deletes_what_it_holds(http, apiserver):
    await send(http, "POST", "/api/v1/namespaces", namespace("team"))
    await send(http, "POST", "/api/v1/namespaces/team/pods", pod("p", "team"))
    status, _ = await send(http, "DELETE", "/api/v1/namespaces/team")
    assert status == 200
    assert apiserver.objects("v1", "pods", "team") == []
    assert apiserver.object("v1", "namespaces", "team") is None


async def test_label_and_field_selectors(http):
    for name, labels in (("a", {"tier": "gpu", "team": "x"}), ("b", {"tier": "cpu"}), ("c", {})):
        await send(http, "POST", PODS, pod(name, labels=labels))

    async def names(**params) -> list[str]:
        status, listed = await send(http, "GET", PODS, **params)
        assert status == 200, listed
        return [p["metadata"]["name"] for p in listed["items"]]

    assert await names(labelSelector="tier=gpu") == ["a"]
    assert await names(labelSelector="tier in (gpu,cpu)") == ["a", "b"]
    assert await names(labelSelector="tier notin (gpu)") == ["b", "c"]
    assert await names(labelSelector="!tier") == ["c"]
    assert await names(labelSelector="tier,team") == ["a"]
    assert await names(labelSelector="tier!=gpu") == ["b", "c"]
    assert await names(fieldSelector="metadata.name=b") == ["b"]
    assert await names(fieldSelector="spec.nodeName=") == ["a", "b", "c"]
    status, refused = await send(http, "GET", PODS, fieldSelector="spec.bogus=1")
    assert status == 400 and "field label not supported" in refused["message"]
    status, listed = await send(http, "GET", PODS)
    assert int(listed["metadata"]["resourceVersion"]) > 0 and listed["kind"] == "PodList"
    assert "kind" not in listed["items"][0]  # built-in list items carry no kind, as from a real server
    await send(http, "POST", "/api/v1/namespaces", namespace("team"))
    await send(http, "POST", "/api/v1/namespaces/team/pods", pod("a", "team", labels={"tier": "gpu"}))
    status, everywhere = await send(http, "GET", "/api/v1/pods", labelSelector="tier=gpu")
    assert [(p["metadata"]["namespace"], p["metadata"]["name"]) for p in everywhere["items"]] == [
        ("default", "a"), ("team", "a")]
    slices = "/apis/resource.k8s.io/v1/resourceslices"
    for node in ("n1", "n2"):
        await send(http, "POST", slices, {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                                          "metadata": {"name": f"{node}-gpu"},
                                          "spec": {"driver": "gpu.tessera.dev", "nodeName": node,
                                                   "pool": {"name": node, "generation": 1,
                                                            "resourceSliceCount": 1}}})
    status, listed = await send(http, "GET", slices, fieldSelector="spec.nodeName=n2,spec.driver=gpu.tessera.dev")
    assert [s["metadata"]["name"] for s in listed["items"]] == ["n2-gpu"]


async def test_injected_faults_answer_with_a_status_then_stop(http, apiserver):
    fault = apiserver.fail("POST", r"/pods$", status=503, times=2)
    for _ in range(2):
        status, body = await send(http, "POST", PODS, pod("p"))
        assert status == 503 and body["kind"] == "Status" and body["reason"] == "ServiceUnavailable"
    status, _ = await send(http, "POST", PODS, pod("p"))
    assert status == 201 and fault.hits == 2
    assert apiserver.objects("v1", "pods", "default")[0]["metadata"]["name"] == "p"


async def test_stop_makes_it_unreachable_and_start_brings_it_back_with_its_state(apiserver):
    await apiserver.create(pod("p"))
    url = apiserver.url
    await apiserver.stop()
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientConnectionError):
            async with http.get(f"{url}{PODS}/p"):
                pass
        await apiserver.start()
        assert apiserver.url == url
        async with http.get(f"{url}{PODS}/p") as response:
            assert response.status == 200


async def test_crd_installs_its_custom_resource_with_schema_defaults_and_status(http, apiserver):
    path = "/apis/tessera.io/v1alpha1/namespaces/default/tenantcontrolplanes"
    tcp = {"apiVersion": "tessera.io/v1alpha1", "kind": "TenantControlPlane", "metadata": {"name": "alpha"},
           "spec": {"kubernetes": {}}}
    status, created = await send(http, "POST", path, tcp)
    assert status == 201, created
    assert created["spec"]["kubernetes"]["version"] == "v1.33.1"  # the CRD's default
    status, refused = await send(http, "POST", path, dict(tcp, metadata={"name": "beta"}, spec={"sizee": "x"}))
    assert status == 422 and "spec.sizee" in refused["message"]
    status, updated = await send(http, "PATCH", f"{path}/alpha/status", {"status": {"phase": "Ready"}}, MERGE)
    assert status == 200 and updated["status"]["phase"] == "Ready"
    status, ignored = await send(http, "PATCH", f"{path}/alpha", {"status": {"phase": "Failed"}}, MERGE)
    assert ignored["status"]["phase"] == "Ready"
    unconditional = dict(ignored, metadata=dict(ignored["metadata"], resourceVersion=None))
    status, refused = await send(http, "PUT", f"{path}/alpha", unconditional)
    assert status == 422 and "metadata.resourceVersion" in refused["message"]
    status, _ = await send(http, "PUT", f"{path}/alpha", ignored)
    assert status == 200
    status, resources = await send(http, "GET", "/apis/tessera.io/v1alpha1")
    assert {r["name"] for r in resources["resources"]} == {"tenantcontrolplanes", "tenantcontrolplanes/status"}


async def test_discovery_lists_groups_and_resources(http):
    status, core = await send(http, "GET", "/api")
    assert core["versions"] == ["v1"]
    status, groups = await send(http, "GET", "/apis")
    names = {g["name"] for g in groups["groups"]}
    assert {"resource.k8s.io", "apps", "tessera.io", "admissionregistration.k8s.io"} <= names
    status, resources = await send(http, "GET", "/api/v1")
    listed = {r["name"]: r for r in resources["resources"]}
    assert listed["namespaces"]["namespaced"] is False and listed["pods"]["namespaced"] is True
    assert {"pods/status", "pods/binding"} <= set(listed)


async def test_helpers_go_through_the_same_validation(apiserver):
    with pytest.raises(ApiError) as refused:
        await apiserver.create(dict(pod("p"), spec={"containers": [{"name": "c", "image": "i", "imagee": "x"}]}))
    assert refused.value.code == 422 and "spec.containers[0].imagee" in refused.value.message
    await apiserver.create(claim("c"))
    with pytest.raises(ApiError) as refused:
        await apiserver.patch("resource.k8s.io/v1", "resourceclaims", "c", {"status": {"bogus": True}},
                              "default", subresource="status")
    assert refused.value.code == 422
    written = [w for w in apiserver.writes if w.path.endswith("/resourceclaims")]
    assert [w.method for w in written] == ["POST"] and written[0].object["metadata"]["name"] == "c"


async def test_wait_for_wakes_on_the_write_that_makes_it_true(apiserver):
    waiting = asyncio.create_task(apiserver.wait_for(lambda: apiserver.object("v1", "pods", "p", "default")))
    await asyncio.sleep(0)
    assert not waiting.done()
    await apiserver.create(pod("p"))
    assert (await waiting)["metadata"]["name"] == "p"
    with pytest.raises(TimeoutError):
        await apiserver.wait_for(lambda: apiserver.object("v1", "pods", "q", "default"), timeout=0.05)


@pytest.mark.parametrize("change, field", [
    (lambda p: p["metadata"].update(name="Upper"), "metadata.name"),
    (lambda p: p["metadata"].update(labels={"tessera.io/tenant": "x" * 64}), "metadata.labels"),
    (lambda p: p["spec"]["containers"][0].update(resources={"claims": [{"name": "gpu"}]}),
     "spec.containers[0].resources.claims[0].name"),
    (lambda p: p["spec"].update(resourceClaims=[{"name": "gpu"}]), "spec.resourceClaims[0]"),
    (lambda p: p["spec"]["containers"][0].update(resources={"requests": {"nvidia.com/gpu": "1"}}),
     "spec.containers[0].resources.limits"),
    (lambda p: p["spec"]["containers"][0].update(resources={"limits": {"nvidia.com/gpumem-percentage": "0.5"}}),
     "spec.containers[0].resources.limits[nvidia.com/gpumem-percentage]"),
])
async def test_go_validation_beyond_the_schema_refuses_pods(apiserver, change, field):
    body = pod("p")
    change(body)
    with pytest.raises(ApiError) as refused:
        await apiserver.create(body)
    assert refused.value.code == 422
    assert field in [c["field"] for c in refused.value.details["causes"]], refused.value.message


async def test_a_pod_may_claim_what_it_lists_and_a_slice_names_one_node_selection(apiserver):
    body = pod("p")
    body["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "t"}]
    body["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    await apiserver.create(body)
    resource_slice = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "s"},
                      "spec": {"driver": "gpu.tessera.dev", "pool": {"name": "n1", "generation": 1,
                                                                     "resourceSliceCount": 1},
                               "devices": [{"name": "gpu-0"}]}}
    with pytest.raises(ApiError) as refused:
        await apiserver.create(resource_slice)
    assert "exactly one of `nodeName`" in refused.value.message
    resource_slice["spec"]["nodeName"] = "n1"
    resource_slice["spec"]["devices"].append({"name": "GPU_1"})
    with pytest.raises(ApiError) as refused:
        await apiserver.create(resource_slice)
    assert [c["field"] for c in refused.value.details["causes"]] == ["spec.devices[1].name"]


async def test_the_bind_helper_plays_kube_scheduler_by_the_same_rules(apiserver):
    await apiserver.create(pod("p"))
    with pytest.raises(ApiError) as refused:
        await apiserver.bind("default", "p", "node-1")
    assert refused.value.code == 409 and "non-empty .spec.schedulingGates" in refused.value.message
    await apiserver.patch("v1", "pods", "p", [{"op": "remove", "path": "/spec/schedulingGates"}], "default",
                          kind="json")
    bound = await apiserver.bind("default", "p", "node-1")
    assert bound["spec"]["nodeName"] == "node-1"
