"""The rendered tenant control plane can start: its user reads its mounted Secrets, its datastore
shim reaches the tenant's NATS datastore as the tenant (never as the platform), and Tessera's own
NetworkPolicies admit exactly that path."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import msgspec
import yaml

from tessera.controlplane import manifests
from tessera.controlplane.datastores.natskv import connect_ok, connect_tenant

DEPLOY = Path(__file__).resolve().parents[2] / "deploy/k8s"


def can_read(pod: dict, container: dict, volume: dict) -> bool:
    """Whether the container's process may read the files of a mounted Secret volume, as the
    kubelet lays them out: owned by root, group the pod's fsGroup (root without one), mode
    ``defaultMode`` (0644 without one)."""
    pod_ctx, ctx = pod.get("securityContext") or {}, container.get("securityContext") or {}
    uid = ctx.get("runAsUser", pod_ctx.get("runAsUser", 0))
    groups = {ctx.get("runAsGroup", pod_ctx.get("runAsGroup", 0)), *pod_ctx.get("supplementalGroups", [])}
    fs_group = pod_ctx.get("fsGroup")
    if fs_group is not None:
        groups.add(fs_group)
    mode = volume["secret"].get("defaultMode", 0o644)
    if uid == 0:
        return True
    if (fs_group if fs_group is not None else 0) in groups:
        return bool(mode & 0o040)
    return bool(mode & 0o004)


async def rendered_objects(manager, name: str) -> list[dict]:
    reply = msgspec.json.decode(await manager.api.create(msgspec.json.encode({"name": name}), {}))
    assert reply["ok"], reply
    return list(yaml.safe_load_all(manager.host.path(name).read_text()))


def secret_data(objects: list[dict], name: str) -> dict[str, str]:
    secret = next(o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == name)
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


async def test_every_container_can_read_every_secret_it_mounts(manager):
    objects = await rendered_objects(manager, "alpha")
    pod = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = [(c, m) for c in pod["containers"] for m in c.get("volumeMounts", [])]
    assert {m["name"] for _, m in mounts} == {"pki", "kubeconfig", "datastore"}
    for container, mount in mounts:
        assert container["securityContext"]["runAsUser"] == manifests.USER
        assert can_read(pod, container, volumes[mount["name"]]), (container["name"], mount["name"])
        assert not volumes[mount["name"]]["secret"]["defaultMode"] & 0o007  # and nobody else on the node
    # the check itself: 0400 without fsGroup (what was rendered before) is unreadable to uid 65532
    assert not can_read({"securityContext": {"runAsUser": 65532}}, {}, {"secret": {"defaultMode": 0o400}})


async def test_the_datastore_secret_holds_the_tenants_own_credentials_and_they_work(manager):
    objects = await rendered_objects(manager, "alpha")
    creds = (await manager.store.secrets.get("alpha")).value.datastore
    data = secret_data(objects, "alpha-datastore")
    context = json.loads(data["context.json"])
    assert context["user"] == "tenant-alpha" == creds.username and context["password"] == creds.password
    assert context["inbox_prefix"] == "_INBOX_alpha"
    # kine: connect to that server with that context, the tenant's bucket, and no embedded server
    endpoint = urlsplit(data["endpoint"])
    query = parse_qs(endpoint.query, keep_blank_values=True)
    assert endpoint.scheme == "nats" and not endpoint.netloc  # (kine refuses a host beside a context file)
    assert query["contextFile"] == [f"{manifests.DATASTORE_DIR}/context.json"]
    assert query["bucket"] == ["tenant-alpha"] and "noEmbed" in query
    # the platform's credentials are nowhere in what the tenant is given
    platform_password = urlsplit(manager.drivers["nats"].bus.settings.url).password
    for secret in (o for o in objects if o["kind"] == "Secret"):
        for value in secret_data(objects, secret["metadata"]["name"]).values():
            assert platform_password not in value
    # and what the context says is accepted by the real server, as the tenant
    assert await connect_ok(context["url"], context["user"], context["password"], context["inbox_prefix"])
    nc = await connect_tenant(creds)
    try:
        kv = await nc.jetstream(timeout=2).create_key_value(bucket="tenant-alpha", history=10)
        await kv.put("registry/a", b"1")
    finally:
        await nc.close()


# --- Tessera's NetworkPolicies, evaluated as the NetworkPolicy API defines them ----------------


def _matches(selector: dict, labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        value, op = labels.get(expr["key"]), expr["operator"]
        if op == "In" and value not in expr["values"] or op == "NotIn" and value in expr["values"]:
            return False
        if op == "Exists" and value is None or op == "DoesNotExist" and value is not None:
            return False
    return True


def _peer_admits(peer: dict, policy_ns: str, src_ns: dict[str, str], src_pod: dict[str, str]) -> bool:
    if "ipBlock" in peer:
        return False  # (pods are named by selectors here)
    ns_ok = _matches(peer["namespaceSelector"], src_ns) if "namespaceSelector" in peer else \
        src_ns.get("kubernetes.io/metadata.name") == policy_ns
    pod_ok = _matches(peer["podSelector"], src_pod) if "podSelector" in peer else True
    return ns_ok and pod_ok


def admitted(policies: list[dict], dst_ns: str, dst_pod: dict[str, str], port: int,
             src_ns: dict[str, str], src_pod: dict[str, str]) -> bool:
    """Whether ingress from the source pod to ``port`` of the destination pod is allowed."""
    selecting = [p for p in policies if p["metadata"]["namespace"] == dst_ns
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and _matches(p["spec"]["podSelector"], dst_pod)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            ports = rule.get("ports")
            if ports and not any(p.get("port") == port for p in ports):
                continue
            peers = rule.get("from")
            if not peers or any(_peer_admits(peer, dst_ns, src_ns, src_pod) for peer in peers):
                return True
    return False


def test_tessera_admits_tenant_control_planes_to_the_nats_client_port_and_nothing_else(tmp_path):
    from tessera.controlplane.credentials import DatastoreCredentials, TenantSecrets
    from tessera.controlplane.spec import TenantControlPlane

    policies = [d for d in yaml.safe_load_all((DEPLOY / "networkpolicies.yaml").read_text()) if d]
    record = TenantControlPlane(name="alpha", uid="u")
    secrets = TenantSecrets(tenant="alpha", datastore=DatastoreCredentials(
        driver="nats", endpoint="nats://nats.tessera-system.svc:4222", username="tenant-alpha", password="pw",
        scope="tenant-alpha"))
    objects = manifests.render(record, secrets, "tessera-system")
    namespace = next(o for o in objects if o["kind"] == "Namespace")["metadata"]
    tenant_ns = dict(namespace["labels"], **{"kubernetes.io/metadata.name": namespace["name"]})
    control_plane = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["metadata"]["labels"]
    nats = {"app.kubernetes.io/name": "nats", "app.kubernetes.io/part-of": "tessera"}
    system = {"kubernetes.io/metadata.name": "tessera-system"}

    assert admitted(policies, "tessera-system", nats, 4222, tenant_ns, control_plane)
    # not the cluster routes or monitoring, not other Tessera pods
    assert not admitted(policies, "tessera-system", nats, 6222, tenant_ns, control_plane)
    assert not admitted(policies, "tessera-system", nats, 8222, tenant_ns, control_plane)
    placement = {"app.kubernetes.io/name": "tessera-placement"}
    assert not admitted(policies, "tessera-system", placement, 4222, tenant_ns, control_plane)
    # not another pod of the tenant's namespace, not a namespace the manager did not make
    assert not admitted(policies, "tessera-system", nats, 4222, tenant_ns, {"app": "something-else"})
    elsewhere = {"kubernetes.io/metadata.name": "default"}
    assert not admitted(policies, "tessera-system", nats, 4222, elsewhere, control_plane)
    # Tessera's own services still reach it
    assert admitted(policies, "tessera-system", nats, 4222, system, placement)


def test_the_nats_deployment_admits_the_users_the_manager_writes():
    docs = [d for d in yaml.safe_load_all((DEPLOY / "nats.yaml").read_text()) if d]
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["nats.conf"]
    assert 'include "../nats-users/users.conf"' in config
    users = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "tessera-nats-users")
    pod = next(d for d in docs if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == users["metadata"]["name"])
    nats = next(c for c in pod["containers"] if c["name"] == "nats")
    assert {"name": volume["name"], "mountPath": "/etc/nats-users", "readOnly": True} in nats["volumeMounts"]
    assert can_read(pod, nats, volume)
    manager = yaml.safe_load_all((DEPLOY / "controlplane/manager.yaml").read_text())
    env = {e["name"]: e.get("value") for d in manager if d and d["kind"] == "Deployment"
           for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["TESSERA_CP_NATS_USERS_SECRET"] == "tessera-system/tessera-nats-users"
    # the platform account admits the operator of the base's NATS URL, its password from that Secret
    config_docs = [d for d in yaml.safe_load_all((DEPLOY / "config.yaml").read_text()) if d]
    secret = next(d for d in config_docs if d["kind"] == "Secret" and d["metadata"]["name"] == "tessera-nats")
    url = urlsplit(secret["stringData"]["url"])
    platform = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["platform.conf"]
    assert f'"user": "{url.username}",\n   "password": $NATS_PW_OPERATOR' in platform
    env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef") for e in nats["env"]}
    assert env["NATS_PW_OPERATOR"] == {"name": "tessera-nats", "key": "password"}
    assert secret["stringData"]["password"] == url.password
