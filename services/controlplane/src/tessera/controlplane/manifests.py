"""Host-cluster objects for one tenant control plane, rendered as plain dicts.

What Kamaji leaves out is the point of this module: every container carries explicit requests and
limits (from the spec or its size class), and a NetworkPolicy admits to the API server only the
tenant's own nodes (their CIDRs) and the platform namespace; everything else is dropped. Objects
are validated against the real Kubernetes OpenAPI schemas (kubernetes-validate, strict) before
anything is applied or written.
"""

from __future__ import annotations

import base64
import functools
import json
import re
from typing import Any

import jsonschema
import kubernetes_validate
from kubernetes_validate import utils as kv_utils
from referencing import Registry, Resource

from tessera.controlplane.credentials import DatastoreCredentials, TenantSecrets
from tessera.controlplane.sizes import effective_resources
from tessera.controlplane.spec import Resources, TenantControlPlane

DATASTORE_SHIM = "datastore-shim"  # the container that is kine, where the datastore needs it

HOST_SCHEMA_VERSION = "1.33.0"
MANAGER = "tessera-controlplane"
KINE_IMAGE = "docker.io/rancher/kine:v0.17.5"  # the version tools/kube/kine/go.mod pins


def namespace(tenant: str) -> str:
    return f"tenant-{tenant}"


def labels(tenant: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "tenant-control-plane",
        "app.kubernetes.io/instance": tenant,
        "app.kubernetes.io/managed-by": MANAGER,
        "tessera.io/tenant": tenant,
    }


def _resources(res: Resources) -> dict[str, Any]:
    return {
        "requests": {"cpu": f"{res.requests.cpu_millis}m", "memory": f"{res.requests.memory_mib}Mi"},
        "limits": {"cpu": f"{res.limits.cpu_millis}m", "memory": f"{res.limits.memory_mib}Mi"},
    }


# Every control-plane container runs as this uid and gid (the distroless "nonroot" user). The
# kubelet gives mounted Secret files root's uid and, with the pod's fsGroup, this group: so the
# Secrets are mounted group-readable (0440), and nobody else on the node may read them.
USER = 65532
SECRET_MODE = 0o440
DATASTORE_DIR = "/datastore"  # where kine finds the tenant's own NATS context (its credentials)

# The control-plane pod meets Pod Security "restricted" (the security contexts below); the tenant's
# namespace enforces it, so a pod that stops meeting it is refused by the host's admission rather
# than run with more than it needs.
POD_SECURITY = {"pod-security.kubernetes.io/enforce": "restricted"}

_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "runAsUser": USER,
    "runAsGroup": USER,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def _secret(name: str, ns: str, tenant: str, data: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": ns, "labels": labels(tenant)},
        "type": "Opaque",
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in sorted(data.items())},
    }


def kine_pool(ds: DatastoreCredentials) -> int:
    """kine's bound on its open connections (0: none). Unbounded, a kube-apiserver starting up (a list
    and a watch per resource) has kine open more connections than the tenant role's CONNECTION LIMIT
    and PostgreSQL refuses the rest ("too many connections for role"); half the limit also leaves
    room for the backends of a kine that was just killed, which PostgreSQL reaps only when it
    notices."""
    return max(1, ds.connection_limit // 2) if ds.connection_limit else 0


def datastore_secret(ds: DatastoreCredentials | None) -> dict[str, str]:
    """What the tenant's datastore Secret holds: its own credentials, never the platform's.

    For NATS, kine (built with an embedded NATS server it would otherwise start: ``noEmbed``) reads a
    NATS context file with the tenant's user, password and inbox prefix (a URL cannot carry the
    prefix, and the tenant may only receive replies under it), and creates the tenant's bucket
    itself, with the replicas the platform's streams have."""
    if ds is None:
        return {}
    data = {"driver": ds.driver, "endpoint": ds.endpoint, "username": ds.username, "password": ds.password,
            "scope": ds.scope, "max-open-connections": str(kine_pool(ds))}
    if ds.driver == "nats":
        context = {"url": ds.endpoint, "user": ds.username, "password": ds.password, "inbox_prefix": ds.inbox_prefix}
        data["context.json"] = json.dumps({k: v for k, v in context.items() if v}, sort_keys=True)
        data["endpoint"] = (f"nats://?contextFile={DATASTORE_DIR}/context.json&bucket={ds.scope}"
                            f"&replicas={ds.replicas}&noEmbed")
    if ds.client_cert:
        data.update({"ca.crt": ds.ca_cert, "client.crt": ds.client_cert, "client.key": ds.client_key})
    return data


def _etcd_tls(ds: DatastoreCredentials | None) -> bool:
    """Whether the API server logs in to etcd itself, with the tenant's client certificate."""
    return ds is not None and ds.driver == "etcd" and bool(ds.client_cert)


def datastore_endpoint(secrets: TenantSecrets) -> str:
    """The --etcd-servers value: etcd directly, or the kine shim in front of NATS / PostgreSQL."""
    ds = secrets.datastore
    if ds is not None and ds.driver == "etcd":
        return ds.endpoint
    return "http://127.0.0.1:2379"


def render(record: TenantControlPlane, secrets: TenantSecrets, platform_namespace: str) -> list[dict[str, Any]]:
    t = record.name
    ns = namespace(t)
    spec = record.spec
    lab = labels(t)
    res = effective_resources(spec)
    version = spec.kubernetes.version
    port = spec.network.port
    ds = secrets.datastore

    apiserver_args = [
        "kube-apiserver",
        f"--secure-port={port}",
        f"--etcd-servers={datastore_endpoint(secrets)}",
        f"--service-cluster-ip-range={spec.network.service_cidr}",
        "--tls-cert-file=/pki/apiserver.crt",
        "--tls-private-key-file=/pki/apiserver.key",
        "--client-ca-file=/pki/ca.crt",
        "--service-account-key-file=/pki/sa.pub",
        "--service-account-signing-key-file=/pki/sa.key",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        "--requestheader-client-ca-file=/pki/front-proxy-ca.crt",
        "--proxy-client-cert-file=/pki/front-proxy-client.crt",
        "--proxy-client-key-file=/pki/front-proxy-client.key",
        "--requestheader-allowed-names=front-proxy-client",
        "--requestheader-username-headers=X-Remote-User",
        "--requestheader-group-headers=X-Remote-Group",
        "--authorization-mode=Node,RBAC",
        "--enable-admission-plugins=NodeRestriction",
        "--allow-privileged=true",
    ]
    if ds is not None and ds.driver == "etcd":
        apiserver_args.append(f"--etcd-prefix={ds.scope.rstrip('/')}")
    if _etcd_tls(ds):
        apiserver_args += [f"--etcd-cafile={DATASTORE_DIR}/ca.crt", f"--etcd-certfile={DATASTORE_DIR}/client.crt",
                           f"--etcd-keyfile={DATASTORE_DIR}/client.key"]
    if spec.network.address:
        apiserver_args.append(f"--advertise-address={spec.network.address}")

    def probe(path: str) -> dict[str, Any]:
        return {"httpGet": {"path": path, "port": port, "scheme": "HTTPS"}, "periodSeconds": 10, "failureThreshold": 3}

    # The controller manager and the scheduler reach the API server of their own pod over the pod's
    # loopback (as kubeadm's static pods and Kamaji's do), not through the Service: no cluster DNS,
    # Service routing or NetworkPolicy between them, and the kubeconfig's address (the Service's
    # name, what the tenant's users are given) stays as it is. The serving certificate has 127.0.0.1.
    in_pod = f"--master=https://127.0.0.1:{port}"
    pki_mount = [{"name": "pki", "mountPath": "/pki", "readOnly": True}]
    kubeconfig_mount = [{"name": "kubeconfig", "mountPath": "/kubeconfig", "readOnly": True}]
    datastore_mount = [{"name": "datastore", "mountPath": DATASTORE_DIR, "readOnly": True}]
    containers = [
        {
            "name": "kube-apiserver",
            "image": f"registry.k8s.io/kube-apiserver:{version}",
            "command": apiserver_args,
            "ports": [{"name": "https", "containerPort": port, "protocol": "TCP"}],
            "resources": _resources(res["api_server"]),
            "livenessProbe": probe("/livez"),
            "readinessProbe": probe("/readyz"),
            "securityContext": _SECURITY,
            "volumeMounts": pki_mount + (datastore_mount if _etcd_tls(ds) else []),
        },
        {
            "name": "kube-controller-manager",
            "image": f"registry.k8s.io/kube-controller-manager:{version}",
            "command": [
                "kube-controller-manager",
                "--kubeconfig=/kubeconfig/admin.conf",
                in_pod,
                "--leader-elect=true",
                "--cluster-signing-cert-file=/pki/ca.crt",
                "--cluster-signing-key-file=/pki/ca.key",
                "--root-ca-file=/pki/ca.crt",
                "--service-account-private-key-file=/pki/sa.key",
                f"--service-cluster-ip-range={spec.network.service_cidr}",
                f"--cluster-cidr={spec.network.pod_cidr}",
                "--use-service-account-credentials=true",
            ],
            "resources": _resources(res["controller_manager"]),
            "securityContext": _SECURITY,
            "volumeMounts": pki_mount + kubeconfig_mount,
        },
        {
            "name": "kube-scheduler",
            "image": f"registry.k8s.io/kube-scheduler:{version}",
            "command": ["kube-scheduler", "--kubeconfig=/kubeconfig/admin.conf", in_pod, "--leader-elect=true"],
            "resources": _resources(res["scheduler"]),
            "securityContext": _SECURITY,
            "volumeMounts": kubeconfig_mount,
        },
    ]
    if ds is None or ds.driver != "etcd":  # NATS and PostgreSQL are reached through kine
        containers.append(
            {
                "name": DATASTORE_SHIM,
                "image": KINE_IMAGE,
                # (kine's metrics port, the same in every pod, is off: nothing scrapes it)
                "args": ["--listen-address=127.0.0.1:2379", "--endpoint=$(DATASTORE_ENDPOINT)",
                         "--metrics-bind-address=0", "--datastore-max-open-connections=$(DATASTORE_MAX_OPEN)"],
                "env": [{"name": "DATASTORE_ENDPOINT", "valueFrom": {"secretKeyRef": {
                    "name": f"{t}-datastore", "key": "endpoint"}}},
                        {"name": "DATASTORE_MAX_OPEN", "valueFrom": {"secretKeyRef": {
                            "name": f"{t}-datastore", "key": "max-open-connections"}}}],
                "resources": _resources(res["datastore_shim"]),
                "securityContext": _SECURITY,
                "volumeMounts": datastore_mount,
            }
        )
    volumes = [
        {"name": "pki", "secret": {"secretName": f"{t}-pki", "defaultMode": SECRET_MODE}},
        {"name": "kubeconfig", "secret": {"secretName": f"{t}-admin-kubeconfig", "defaultMode": SECRET_MODE}},
    ]
    if ds is None or ds.driver != "etcd" or _etcd_tls(ds):
        volumes.append({"name": "datastore", "secret": {"secretName": f"{t}-datastore", "defaultMode": SECRET_MODE}})

    ingress_from: list[dict[str, Any]] = [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": platform_namespace}}},
        {"podSelector": {"matchLabels": lab}},
    ]
    ingress_from += [{"ipBlock": {"cidr": cidr}} for cidr in spec.network.node_cidrs]

    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": {**lab, **POD_SECURITY}}},
        _secret(f"{t}-pki", ns, t, secrets.pki),
        _secret(f"{t}-datastore", ns, t, datastore_secret(ds)),
        _secret(f"{t}-admin-kubeconfig", ns, t, {"admin.conf": secrets.kubeconfig}),
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": f"{t}-control-plane", "namespace": ns, "labels": lab},
            "spec": {
                "replicas": 0 if record.asleep else spec.kubernetes.replicas,  # asleep: scaled to zero
                "selector": {"matchLabels": lab},
                "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                "template": {
                    "metadata": {"labels": lab},
                    "spec": {
                        "automountServiceAccountToken": False,
                        "enableServiceLinks": False,
                        "securityContext": {"runAsNonRoot": True, "runAsUser": USER, "runAsGroup": USER,
                                            "fsGroup": USER, "seccompProfile": {"type": "RuntimeDefault"}},
                        "containers": containers,
                        "volumes": volumes,
                        "topologySpreadConstraints": [{
                            "maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                            "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": {"matchLabels": lab},
                        }],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": f"{t}-apiserver", "namespace": ns, "labels": lab},
            "spec": {
                "type": spec.network.service_type,
                "selector": lab,
                "ports": [{"name": "https", "port": port, "targetPort": port, "protocol": "TCP"}],
            },
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": f"{t}-apiserver-ingress", "namespace": ns, "labels": lab},
            "spec": {
                "podSelector": {"matchLabels": lab},
                "policyTypes": ["Ingress"],
                "ingress": [{"from": ingress_from, "ports": [{"protocol": "TCP", "port": port}]}],
            },
        },
    ]


class InvalidManifest(Exception):
    pass


@functools.lru_cache(maxsize=4)
def _definitions(version: str) -> Resource:
    return Resource.from_contents(
        kv_utils.schema_contents(f"kubernetes-json-schema/v{version}-local-strict/_definitions.json", version)
    )


@functools.lru_cache(maxsize=64)
def _validator(kind: str, api_version: str, version: str) -> jsonschema.protocols.Validator:
    """kubernetes-validate's strict schema for one kind, loaded once (it reloads them per call)."""
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    try:
        schema = kv_utils.schema_contents(
            f"kubernetes-json-schema/v{version}-local-strict/{kind.lower()}-{group}.json", version
        )
    except FileNotFoundError:
        raise kubernetes_validate.SchemaNotFoundError(kind=kind, version=version, api_version=api_version) from None
    registry = _definitions(version) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


def _schema_version(wanted: str) -> str:
    mm = kv_utils.major_minor(wanted.lstrip("v"))
    return [v for v in kv_utils.all_versions() if kv_utils.major_minor(v) <= mm][-1]


def validate(objects: list[dict[str, Any]], version: str = HOST_SCHEMA_VERSION) -> None:
    """Check every object against the Kubernetes schemas of the host's version (strict: no unknown fields)."""
    schema_version = _schema_version(version)
    for obj in objects:
        error = jsonschema.exceptions.best_match(
            _validator(obj["kind"], obj["apiVersion"], schema_version).iter_errors(obj)
        )
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path)
            raise InvalidManifest(f"{obj['kind']} {obj['metadata']['name']}: {error.message} at {where}")


def endpoint(record: TenantControlPlane) -> str:
    """The URL tenants' kubeconfigs point at: the advertised address, else the Service's DNS name."""
    host = record.spec.network.address or f"{record.name}-apiserver.{namespace(record.name)}.svc"
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return f"https://{host}:{record.spec.network.port}"


def object_refs(tenant: str) -> list[tuple[str, str, str, str | None]]:
    """(apiVersion, kind, name, namespace) of everything render() makes, children first."""
    t, ns = tenant, namespace(tenant)
    return [
        ("networking.k8s.io/v1", "NetworkPolicy", f"{t}-apiserver-ingress", ns),
        ("v1", "Service", f"{t}-apiserver", ns),
        ("apps/v1", "Deployment", f"{t}-control-plane", ns),
        ("v1", "Secret", f"{t}-admin-kubeconfig", ns),
        ("v1", "Secret", f"{t}-datastore", ns),
        ("v1", "Secret", f"{t}-pki", ns),
        ("v1", "Namespace", ns, None),
    ]
