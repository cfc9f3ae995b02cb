"""kubectl against the emulator: apply (client- and server-side), get with printer columns, an
unknown field refused by the server's strict validation, delete."""

from __future__ import annotations

import json

from kubectl import kubectl

TCP = """apiVersion: tessera.io/v1alpha1
kind: TenantControlPlane
metadata:
  name: alpha
  namespace: default
spec:
  size: {size}
"""


async def test_kubectl_apply_get_and_delete_a_tenant_control_plane(apiserver):
    rc, out, err = await kubectl(apiserver.url, "apply", "-f", "-", stdin=TCP.format(size="small"))
    assert rc == 0, err
    assert out.strip() == "tenantcontrolplane.tessera.io/alpha created"
    await apiserver.patch("tessera.io/v1alpha1", "tenantcontrolplanes", "alpha",
                          {"status": {"phase": "Ready", "endpoint": "https://10.0.0.1:6443"}}, "default",
                          subresource="status")
    rc, out, err = await kubectl(apiserver.url, "get", "tcp", "-n", "default")
    assert rc == 0, err
    header, row = out.splitlines()
    assert header.split() == ["NAME", "PHASE", "READY", "ENDPOINT", "AGE"]
    # Columns by position: READY is empty here (the emulator's table follows plain dotted paths only,
    # not the Ready column's filter expression, which tests/kubernetes/test_tenantcontrolplane*.py checks).
    columns = {name: header.index(name) for name in ("NAME", "PHASE", "ENDPOINT")}
    assert {name: row[at:].split()[0] for name, at in columns.items()} == {
        "NAME": "alpha", "PHASE": "Ready", "ENDPOINT": "https://10.0.0.1:6443"}

    rc, out, err = await kubectl(apiserver.url, "apply", "-f", "-", stdin=TCP.format(size="medium"))
    assert rc == 0 and "configured" in out, err
    rc, out, err = await kubectl(apiserver.url, "apply", "--server-side", "-f", "-", stdin=TCP.format(size="large"))
    assert rc == 0, err
    stored = apiserver.object("tessera.io/v1alpha1", "tenantcontrolplanes", "alpha", "default")
    assert stored["spec"]["size"] == "large" and stored["status"]["phase"] == "Ready"

    rc, out, err = await kubectl(apiserver.url, "apply", "-f", "-",
                                 stdin=TCP.format(size="small").replace("size:", "sise:"))
    assert rc != 0 and 'spec.sise: unknown field "spec.sise"' in err

    rc, out, err = await kubectl(apiserver.url, "get", "tcp", "alpha", "-n", "default", "-o", "json")
    assert json.loads(out)["metadata"]["uid"] == stored["metadata"]["uid"]
    rc, out, err = await kubectl(apiserver.url, "delete", "tcp", "alpha", "-n", "default")
    assert rc == 0, err
    assert apiserver.object("tessera.io/v1alpha1", "tenantcontrolplanes", "alpha", "default") is None
