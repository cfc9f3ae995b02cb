"""Host manifests: valid against the real Kubernetes schemas, limits everywhere, NetworkPolicy, capacity."""

from __future__ import annotations

import kubernetes_validate
import pytest

from tessera.controlplane import manifests
from tessera.controlplane.capacity import HostCapacity, InsufficientCapacity, check_fits
from tessera.controlplane.credentials import DatastoreCredentials, TenantSecrets
from tessera.controlplane.pki import PkiAuthority
from tessera.controlplane.sizes import total_requests
from tessera.controlplane.spec import TenantControlPlane, parse_spec


def rendered(driver: str = "nats", **spec) -> list[dict]:
    rec = TenantControlPlane(name="alpha", uid="u", spec=parse_spec(spec))
    secrets = TenantSecrets(
        tenant="alpha",
        datastore=DatastoreCredentials(driver=driver, endpoint="nats://10.0.0.5:4222", username="tenant-alpha",
                                       password="pw", scope="tenant-alpha"),
    )
    PkiAuthority().ensure(rec, secrets, manifests.endpoint(rec), "tenant-alpha")
    return manifests.render(rec, secrets, "tessera-system")


@pytest.mark.parametrize("driver", ["nats", "postgres", "etcd"])
@pytest.mark.parametrize("size", ["small", "large"])
def test_every_object_passes_the_kubernetes_schema(driver, size):
    objects = rendered(driver, size=size, network={"nodeCidrs": ["192.168.10.0/24"], "serviceType": "LoadBalancer"})
    manifests.validate(objects)
    for obj in objects:  # and the package's own entry point agrees
        kubernetes_validate.validate(obj, manifests.HOST_SCHEMA_VERSION, strict=True)
    assert {o["kind"] for o in objects} >= {"Deployment", "Service", "Secret", "NetworkPolicy"}


def test_every_container_has_requests_and_limits_from_the_size_class_or_the_spec():
    objects = rendered(resources={"apiServer": {"requests": {"cpuMillis": 300, "memoryMib": 700},
                                                "limits": {"cpuMillis": 600, "memoryMib": 900}}})
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 4
    for c in containers:
        for part in ("requests", "limits"):
            assert set(c["resources"][part]) == {"cpu", "memory"}, c["name"]
    api = next(c for c in containers if c["name"] == "kube-apiserver")
    assert api["resources"] == {"requests": {"cpu": "300m", "memory": "700Mi"}, "limits": {"cpu": "600m", "memory": "900Mi"}}


def test_network_policy_admits_only_the_tenants_nodes_and_the_platform():
    objects = rendered(network={"nodeCidrs": ["192.168.10.0/24", "192.168.11.0/24"]})
    policy = next(o for o in objects if o["kind"] == "NetworkPolicy")
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 6443}]
    sources = rule["from"]
    assert {"ipBlock": {"cidr": "192.168.10.0/24"}} in sources and {"ipBlock": {"cidr": "192.168.11.0/24"}} in sources
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "tessera-system"}}} in sources
    assert all(set(s) <= {"ipBlock", "namespaceSelector", "podSelector"} for s in sources)
    assert not any(s.get("namespaceSelector") == {} for s in sources)  # never "all namespaces"


def test_an_invalid_object_is_caught_with_its_path():
    objects = rendered()
    objects[-1]["spec"]["ingress"][0]["ports"][0]["port"] = {"bad": 1}
    with pytest.raises(manifests.InvalidManifest, match="NetworkPolicy alpha-apiserver-ingress"):
        manifests.validate(objects)


def test_capacity_check_refuses_a_tenant_that_does_not_fit_and_says_why():
    small = parse_spec({})
    per_tenant = total_requests(small)
    capacity = HostCapacity(cpu_millis=per_tenant.cpu_millis * 2, memory_mib=per_tenant.memory_mib * 2)
    admitted = [TenantControlPlane(name=n, uid=n, spec=small) for n in ("a", "b")]
    check_fits(capacity, admitted[:1], "b", small)
    check_fits(capacity, admitted, "a", small)  # re-admitting an existing tenant replaces its share
    with pytest.raises(InsufficientCapacity, match=r"cannot fit tenant 'c'.*cpu: needs \d+m, 0m free"):
        check_fits(capacity, admitted, "c", small)
    with pytest.raises(InsufficientCapacity, match="memory"):
        check_fits(capacity, admitted[:1], "b", parse_spec({"size": "large"}))
