"""Every workload under deploy/k8s is sized, probed, hardened and configured with variables the code reads.

A container without limits can starve a GPU node's kubelet; one without probes is never restarted
or taken out of its Service; a variable the code does not read is a setting that silently does
nothing. These are the rules a reviewer would otherwise have to re-check on every manifest change.
"""

from __future__ import annotations

import re

import pytest

from deploy_sources import ROOT, manifests, pod_spec, tessera_service_of_image, unread_env

WORKLOADS = [m for m in manifests() if pod_spec(m.obj) is not None]
CONTAINERS = [
    pytest.param(m, kind, c, id=f"{m.id}:{kind}/{c['name']}")
    for m in WORKLOADS
    for kind in ("containers", "initContainers")
    for c in pod_spec(m.obj).get(kind, [])
]
MAIN_CONTAINERS = [p for p in CONTAINERS if p.values[1] == "containers"]
# Containers that run a Tessera service process (not a helper command in a Tessera image).
SERVICE_CONTAINERS = [
    p for p in CONTAINERS if tessera_service_of_image(p.values[2]["image"]) and not p.values[2].get("command")
]

# Containers that may not run as non-root, and why (the manifests say the same in comments).
ROOT_ALLOWED = {
    "tessera-enforcer": "writes root-owned host directories: /var/run/cdi, its state dir, /usr/local/vgpu",
}
# Secrets a workload may reference that the base does not create (the operator provides them).
PROVIDED_BY_OPERATOR = {"tessera-datastores", "tessera-controlplane-secret-keys"}


def _objects(kind: str) -> dict[str, dict]:
    return {m.obj["metadata"]["name"]: m.obj for m in manifests() if m.obj["kind"] == kind}


def test_there_are_workloads_for_every_service():
    images = {tessera_service_of_image(c.values[2]["image"]) for c in SERVICE_CONTAINERS}
    assert {"controlplane", "capacity", "translator", "placement", "enforcer"} <= images


@pytest.mark.parametrize("manifest,kind,container", CONTAINERS)
def test_container_has_cpu_and_memory_requests_and_limits(manifest, kind, container):
    resources = container.get("resources", {})
    for section in ("requests", "limits"):
        for resource in ("cpu", "memory"):
            assert resources.get(section, {}).get(resource), f"no {section}.{resource}"


@pytest.mark.parametrize("manifest,kind,container", MAIN_CONTAINERS)
def test_container_has_liveness_and_readiness_probes(manifest, kind, container):
    assert container.get("livenessProbe"), "no livenessProbe"
    assert container.get("readinessProbe"), "no readinessProbe"
    if tessera_service_of_image(container["image"]):
        # The runner's probe server: /healthz while the process lives, /readyz once NATS and gates are up.
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        port = container["livenessProbe"]["httpGet"]["port"]
        named = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
        assert named.get(port, port) == 8080, "Tessera's images serve probes on 8080 (TESSERA_HTTP_PORT)"


@pytest.mark.parametrize("manifest,kind,container", CONTAINERS)
def test_container_is_hardened(manifest, kind, container):
    sc = container.get("securityContext", {})
    assert sc.get("allowPrivilegeEscalation") is False
    assert sc.get("readOnlyRootFilesystem") is True
    assert "ALL" in sc.get("capabilities", {}).get("drop", [])
    assert not sc.get("privileged"), "privileged containers: give the capability that is needed instead"
    pod_sc = pod_spec(manifest.obj).get("securityContext", {})
    non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
    name = manifest.obj["metadata"]["name"]
    if name in ROOT_ALLOWED:
        return
    assert non_root is True, f"runs as root; if it must, add {name} to ROOT_ALLOWED with the reason"


@pytest.mark.parametrize("manifest,kind,container", SERVICE_CONTAINERS)
def test_tessera_container_sets_only_variables_its_code_reads(manifest, kind, container):
    service = tessera_service_of_image(container["image"])
    names = [e["name"] for e in container.get("env", [])]
    configmaps = _objects("ConfigMap")
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef", {}).get("name")
        if ref:
            assert ref in configmaps, f"envFrom names ConfigMap {ref!r}, which no manifest defines"
            names += list(configmaps[ref].get("data", {}))
    assert not unread_env(service, names), f"tessera-{service} never reads: {unread_env(service, names)}"


@pytest.mark.parametrize("manifest,kind,container", CONTAINERS)
def test_referenced_configmaps_and_secrets_exist(manifest, kind, container):
    secrets = set(_objects("Secret"))
    # Secrets that cert-manager creates from a Certificate in this base.
    secrets |= {c["spec"]["secretName"] for c in _objects("Certificate").values()}
    configmaps = set(_objects("ConfigMap"))
    for e in container.get("env", []):
        ref = e.get("valueFrom", {})
        if "secretKeyRef" in ref:
            assert ref["secretKeyRef"]["name"] in secrets | PROVIDED_BY_OPERATOR
        if "configMapKeyRef" in ref:
            assert ref["configMapKeyRef"]["name"] in configmaps
    volumes = {v["name"]: v for v in pod_spec(manifest.obj).get("volumes", [])}
    for claim in manifest.obj["spec"].get("volumeClaimTemplates", []):  # a StatefulSet's own volumes
        volumes[claim["metadata"]["name"]] = {"persistentVolumeClaim": claim}
    for mount in container.get("volumeMounts", []):
        volume = volumes.get(mount["name"])
        assert volume is not None, f"mount {mount['name']!r} has no volume"
        if "secret" in volume:
            assert volume["secret"]["secretName"] in secrets | PROVIDED_BY_OPERATOR
        if "configMap" in volume:
            assert volume["configMap"]["name"] in configmaps


def test_nats_servers_get_the_variables_their_config_names():
    statefulset = _objects("StatefulSet")["nats"]
    config = _objects("ConfigMap")["nats-config"]["data"]["nats.conf"]
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    env = {e["name"] for e in container.get("env", [])}
    named = set(re.findall(r"\$([A-Z_][A-Z0-9_]*)", config))
    assert named and named <= env, f"nats.conf names {named - env} but the container does not set them"
    routes = re.findall(r"nats://(nats-\d+)\.nats-headless\.", config)
    assert len(routes) == statefulset["spec"]["replicas"] == 3


def test_streams_are_replicated_like_the_nats_cluster():
    env = _objects("ConfigMap")["tessera-env"]["data"]
    assert int(env["TESSERA_STREAM_REPLICAS"]) == _objects("StatefulSet")["nats"]["spec"]["replicas"]


def test_node_agents_run_on_gpu_nodes_and_know_their_node():
    for name in ("tessera-capacity", "tessera-enforcer"):
        ds = _objects("DaemonSet")[name]
        spec = ds["spec"]["template"]["spec"]
        assert spec.get("nodeSelector") and spec.get("tolerations"), f"{name} must target GPU nodes"
        (container,) = spec["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env["TESSERA_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    capacity = _objects("DaemonSet")["tessera-capacity"]["spec"]["template"]["spec"]["containers"][0]
    assert {e["name"]: e.get("value") for e in capacity["env"]}["TESSERA_DISCOVERY"] == "nvml"


def test_enforcer_writes_cdi_specs_and_state_to_the_host():
    spec = _objects("DaemonSet")["tessera-enforcer"]["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    host = {v["name"]: v.get("hostPath", {}).get("path") for v in spec["volumes"]}
    assert host[mounts[env["TESSERA_CDI_DIR"]]] == "/var/run/cdi"
    assert host[mounts[env["TESSERA_STATE_DIR"]]] == env["TESSERA_STATE_DIR"]
    # LD_PRELOAD in a workload names this path: it must be the same on the host and in the pod.
    lib_dir = env["TESSERA_LIBVGPU"].rsplit("/", 1)[0]
    assert host[mounts[lib_dir]] == lib_dir


def test_webhook_calls_the_translators_mutate_route_over_443():
    (config,) = _objects("MutatingWebhookConfiguration").values()
    assert config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
        "tessera-system/" + next(iter(_objects("Certificate")))
    )
    route = re.search(
        r"add_post\(\"([^\"]+)\"", (ROOT / "services/translator/src/tessera/translator/webhook.py").read_text()
    ).group(1)
    services = _objects("Service")
    for hook in config["webhooks"]:
        assert hook["admissionReviewVersions"] == ["v1"]
        assert hook["sideEffects"] == "NoneOnDryRun"
        ref = hook["clientConfig"]["service"]
        assert (ref["port"], ref["path"]) == (443, route)
        service = services[ref["name"]]
        (port,) = [p for p in service["spec"]["ports"] if p["port"] == 443]
        excluded = [
            e for e in hook["namespaceSelector"]["matchExpressions"]
            if e["key"] == "kubernetes.io/metadata.name" and e["operator"] == "NotIn"
        ]
        assert excluded and "tessera-system" in excluded[0]["values"]
        translator = _objects("Deployment")["tessera-translator"]["spec"]["template"]["spec"]["containers"][0]
        assert port["targetPort"] in {p["name"] for p in translator["ports"]}


def test_device_class_is_the_one_translated_claims_ask_for():
    from tessera.translator import dra

    (device_class,) = _objects("DeviceClass").values()
    assert device_class["metadata"]["name"] == dra.DEVICE_CLASS
    assert f'device.driver == "{dra.DRIVER}"' in device_class["spec"]["selectors"][0]["cel"]["expression"]
