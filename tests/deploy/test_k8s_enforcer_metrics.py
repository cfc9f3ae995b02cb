"""deploy/k8s serves the enforcer's metrics to the monitoring namespace only (issue 13).

The per-claim series name every claim of a node and its tenant; the probe port must stay open to the
kubelet (any source), so the metrics have a port of their own that only the monitoring namespace
may reach. What the listener itself serves is tested against a running enforcer in
tests/enforcer/test_metrics.py; this checks the manifests say the same.
"""

from __future__ import annotations

from deploy_sources import manifests, pod_spec


def _enforcer() -> tuple[dict, dict]:
    daemonset = next(m.obj for m in manifests() if m.obj["kind"] == "DaemonSet"
                     and m.obj["metadata"]["name"] == "tessera-enforcer")
    container = next(c for c in pod_spec(daemonset)["containers"] if c["name"] == "enforcer")
    return daemonset, container


def _policies() -> dict[str, dict]:
    return {m.obj["metadata"]["name"]: m.obj for m in manifests() if m.obj["kind"] == "NetworkPolicy"}


def test_the_enforcer_metrics_listen_on_their_own_port_which_the_scrape_annotation_names():
    daemonset, container = _enforcer()
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    port = int(env["TESSERA_METRICS_PORT"])
    assert env["TESSERA_METRICS_HOST"] == "0.0.0.0"  # the pod's address, behind the NetworkPolicy
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == port != ports["probes"]
    annotations = daemonset["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port)


def test_only_the_monitoring_namespace_may_reach_the_metrics_port():
    _, container = _enforcer()
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "metrics")
    policies = _policies()
    admitting = [name for name, pol in policies.items()
                 if pol["spec"]["podSelector"] == {} or "tessera-enforcer" in str(pol["spec"]["podSelector"])]
    for name in admitting:
        for rule in policies[name]["spec"].get("ingress", []):
            rule_ports = {p["port"] for p in rule.get("ports", [])}
            if rule_ports and port not in rule_ports:
                continue
            # A rule that admits the metrics port admits the monitoring namespace and nothing else.
            assert name == "enforcer-metrics", f"NetworkPolicy {name} admits port {port} too"
            assert rule["from"] == [{"namespaceSelector": {"matchLabels":
                                                          {"kubernetes.io/metadata.name": "monitoring"}}}]
    assert "enforcer-metrics" in admitting
    assert policies["default-deny-ingress"]["spec"]["policyTypes"] == ["Ingress"]
