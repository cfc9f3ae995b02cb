"""The emulator serves kubernetes_asyncio's generated clients as a real server does: typed models
deserialize, errors carry the Status, a Watch streams events (so raw-client tests can use it too)."""

from __future__ import annotations

import asyncio

import pytest
from kubernetes_asyncio import client, watch

from kube_objects import claim, pod


@pytest.fixture
async def api(apiserver):
    async with client.ApiClient(client.Configuration(host=apiserver.url)) as api:
        yield api


async def test_core_and_resource_apis_round_trip_typed_models(api):
    core, resource = client.CoreV1Api(api), client.ResourceV1Api(api)
    created = await core.create_namespaced_pod("default", pod("p"))
    assert created.metadata.uid and created.spec.scheduling_gates[0].name == "gpu.tessera.dev/placement"
    listed = await core.list_pod_for_all_namespaces(field_selector="metadata.name=p")
    assert [p.metadata.name for p in listed.items] == ["p"] and listed.metadata.resource_version
    await resource.create_namespaced_resource_claim("default", claim("c"))
    got = await resource.read_namespaced_resource_claim("c", "default")
    assert got.spec.devices.requests[0].name == "gpu"
    with pytest.raises(client.ApiException) as missing:
        await core.read_namespaced_pod("nope", "default")
    assert missing.value.status == 404 and '"reason":"NotFound"' in missing.value.body.replace(" ", "")


async def test_custom_objects_api_on_an_installed_crd(api):
    custom = client.CustomObjectsApi(api)
    body = {"apiVersion": "tessera.io/v1alpha1", "kind": "TenantControlPlane", "metadata": {"name": "alpha"},
            "spec": {}}
    await custom.create_namespaced_custom_object("tessera.io", "v1alpha1", "default", "tenantcontrolplanes", body)
    await custom.patch_namespaced_custom_object_status("tessera.io", "v1alpha1", "default", "tenantcontrolplanes",
                                                       "alpha", {"status": {"phase": "Ready"}},
                                                       _content_type="application/merge-patch+json")
    got = await custom.get_namespaced_custom_object("tessera.io", "v1alpha1", "default", "tenantcontrolplanes",
                                                    "alpha")
    assert got["status"]["phase"] == "Ready"


async def test_kubernetes_asyncio_watch_streams_events(api, apiserver):
    core = client.CoreV1Api(api)
    _, rv = (await core.list_namespaced_config_map("default")), apiserver.resource_version
    stream = watch.Watch()
    seen = []

    async def follow():
        async for event in stream.stream(core.list_namespaced_config_map, "default", resource_version=str(rv),
                                         timeout_seconds=5):
            seen.append((event["type"], event["object"].metadata.name))
            if len(seen) == 2:
                stream.stop()

    task = asyncio.create_task(follow())
    await apiserver.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a", "namespace": "default"}})
    await apiserver.delete("v1", "configmaps", "a", "default")
    await asyncio.wait_for(task, 10)
    await stream.close()
    assert seen == [("ADDED", "a"), ("DELETED", "a")]
