"""deploy/k8s serves every service's /metrics on a port of its own that its scrape annotations name
and only the monitoring namespace may reach (docs/metrics.md): the series name tenants and claims.

The enforcer's case, the first of them, is tests/deploy/test_k8s_enforcer_metrics.py; this checks the
same of every Tessera workload. What the listeners serve is tested against a running system in
tests/metrics.
"""

from __future__ import annotations

import pytest

from deploy_sources import SERVICES, manifests, pod_spec, tessera_service_of_image

METRICS_PORT = 9394


def _workloads() -> dict[str, tuple[dict, dict]]:
    """service -> (workload object, its Tessera container)."""
    found = {}
    for m in manifests():
        spec = pod_spec(m.obj)
        if spec is None:
            continue
        for container in spec["containers"]:
            service = tessera_service_of_image(container["image"])
            if service is not None:
                found[service] = (m.obj, container)
    return found


def _policies() -> list[dict]:
    return [m.obj for m in manifests() if m.obj["kind"] == "NetworkPolicy"]


def _selects(policy: dict, app: str) -> bool:
    selector = policy["spec"]["podSelector"]
    if selector == {}:
        return True
    if selector.get("matchLabels", {}).get("app.kubernetes.io/name") == app:
        return True
    return any(e["key"] == "app.kubernetes.io/name" and e["operator"] == "In" and app in e["values"]
               for e in selector.get("matchExpressions", []))


def test_every_service_has_a_workload():
    assert set(_workloads()) == set(SERVICES)


@pytest.mark.parametrize("service", SERVICES)
def test_metrics_listen_on_their_own_port_which_the_scrape_annotations_name(service):
    workload, container = _workloads()[service]
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    assert env["TESSERA_METRICS_PORT"] == str(METRICS_PORT)
    assert env["TESSERA_METRICS_HOST"] == "0.0.0.0"  # the pod's address, behind the NetworkPolicy
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == METRICS_PORT != ports["probes"]
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(METRICS_PORT)
    assert annotations["prometheus.io/path"] == "/metrics"


@pytest.mark.parametrize("service", SERVICES)
def test_only_the_monitoring_namespace_may_reach_the_metrics_port(service):
    workload, _ = _workloads()[service]
    app = workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
    admitting = []
    for policy in _policies():
        if not _selects(policy, app):
            continue
        for rule in policy["spec"].get("ingress", []):
            rule_ports = {p["port"] for p in rule.get("ports", [])}
            if rule_ports and METRICS_PORT not in rule_ports:
                continue
            admitting.append(policy["metadata"]["name"])
            # A rule that admits the metrics port admits the monitoring namespace and nothing else.
            assert rule.get("from") == [{"namespaceSelector": {"matchLabels":
                                                               {"kubernetes.io/metadata.name": "monitoring"}}}], \
                f"NetworkPolicy {policy['metadata']['name']} admits more than monitoring to {app}:{METRICS_PORT}"
    assert admitting, f"no NetworkPolicy lets the monitoring namespace scrape {app}"
