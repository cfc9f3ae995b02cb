"""Sleeping tenant control planes (Kamaji's scale to zero): `tessera tenant sleep` stops the
tenant's processes and keeps its data; `wake` starts them and says how long until the API server
answered; an idle timeout puts an unused control plane to sleep by itself."""

from __future__ import annotations

import pytest

from controlplane.planes import Planes

CONFIGMAP = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: dream, namespace: default}\ndata: {kept: 'yes'}\n"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("planes", ["nats"], indirect=True)
async def test_a_sleeping_tenant_keeps_its_data_and_wakes(planes: Planes, tmp_path):
    await planes.create("delta")
    kubeconfig = await planes.kubeconfig("delta", tmp_path)
    assert (await planes.kubectl(kubeconfig, "apply", "-f", "-", stdin=CONFIGMAP)).returncode == 0

    asleep = await planes.call("sleep", "delta")
    assert asleep.ok, asleep.error
    assert (asleep.result["tenant"]["phase"], asleep.result["tenant"]["reason"]) == ("NotReady", "Sleeping")
    assert planes.host.pids("delta") == {}
    refused = await planes.kubectl(kubeconfig, "get", "ns")
    assert refused.returncode != 0 and "refused" in refused.stderr, refused.stderr

    awake = await planes.call("wake", "delta")
    assert awake.ok, awake.error
    assert awake.result["tenant"]["phase"] == "Ready" and awake.result["seconds"] > 0
    kept = await planes.kubectl(kubeconfig, "get", "configmap", "dream", "-o", "jsonpath={.data.kept}")
    assert kept.stdout == "yes", kept.stderr


@pytest.mark.timeout(600)
@pytest.mark.parametrize("planes", [("nats", {"idle_seconds": 20.0})], indirect=True)
async def test_an_idle_tenant_is_put_to_sleep(planes: Planes):
    await planes.create("epsilon")
    await planes.wait_phase("epsilon", "NotReady", "Sleeping", timeout=300)
    assert planes.host.pids("epsilon") == {}
