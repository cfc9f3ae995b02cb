"""What a tenant's pod becomes in the host cluster, and what it may never become.

The host pod is what the tenant asked for and no more: the containers, their resources (HAMi's
names, which the host's webhook turns into a claim), the tenant's ConfigMap/Secret/emptyDir/
downward-API volumes, its restart policy, with Pod Security "restricted" filled in where the
tenant's security context is silent (the tenant's host namespace enforces it: a second wall). Whatever would reach the host itself is refused, each
with the path of the field that asked for it, so that the tenant's event names it: host network,
PID or IPC, host paths and ports, privileged containers, added capabilities, a service-account
token of the host's (the tenant's own token volume is dropped, and the host pod mounts none),
node selectors or node affinity that pick host nodes. The host pod's name is a function of the
tenant pod's namespace and name alone, so that a restarted syncer finds what it made, and two
tenant namespaces can never map to one host name.
"""

from __future__ import annotations

import hashlib
import re

GROUP = "tenantpods.tessera.dev"
TENANT = f"{GROUP}/tenant"          # label: whose mirrored object this is
NAMESPACE = f"{GROUP}/namespace"    # annotations: the tenant object it stands for
NAME = f"{GROUP}/name"
UID = f"{GROUP}/uid"

# the volume the tenant's ServiceAccount admission adds (a token of the tenant's, useless on the host)
_TENANT_TOKEN_VOLUME = re.compile(r"^kube-api-access-[a-z0-9]+$")
_VOLUME_SOURCES = ("configMap", "secret", "emptyDir", "downwardAPI", "projected")
_PROJECTED_SOURCES = ("configMap", "secret", "downwardAPI")
_CONTAINER_FIELDS = ("name", "image", "imagePullPolicy", "command", "args", "workingDir", "env", "envFrom",
                     "resources", "stdin", "stdinOnce", "tty", "terminationMessagePath",
                     "terminationMessagePolicy", "securityContext", "volumeMounts", "ports",
                     "readinessProbe", "livenessProbe", "startupProbe", "lifecycle")
# Pod Security "restricted" where the tenant said nothing: only ever less than the tenant asked for
# (the host namespace enforces "restricted"; what the tenant did say is kept, and refused there)
_RESTRICTED_POD = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
_RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
_POD_FIELDS = ("restartPolicy", "terminationGracePeriodSeconds", "activeDeadlineSeconds", "dnsPolicy",
               "securityContext", "hostname", "subdomain")


def host_name(namespace: str, name: str) -> str:
    """The host object's name for a tenant object: readable, at most 63 characters, and distinct
    for distinct (namespace, name) pairs (``a-b``/``c`` and ``a``/``b-c`` differ in the digest)."""
    digest = hashlib.sha256(f"{namespace}/{name}".encode()).hexdigest()[:10]
    return f"{f'{namespace}-{name}'[:52].rstrip('-.')}-{digest}"


def refusals(pod: dict, node_labels: dict[str, str]) -> list[str]:
    """The paths of the fields of ``pod`` that would reach the host (empty: the pod may be mirrored)."""
    spec = pod.get("spec") or {}
    refused = [f"spec.{f}" for f in ("hostNetwork", "hostPID", "hostIPC") if spec.get(f)]
    for key, value in (spec.get("nodeSelector") or {}).items():
        if node_labels.get(key) != value:  # only its own node's labels select nothing of the host's
            refused.append(f"spec.nodeSelector[{key}]")
    if (spec.get("affinity") or {}).get("nodeAffinity"):
        refused.append("spec.affinity.nodeAffinity")
    for i, volume in enumerate(spec.get("volumes") or []):
        refused += _volume_refusals(f"spec.volumes[{i}]", volume)
    for kind in ("initContainers", "containers"):
        for i, container in enumerate(spec.get(kind) or []):
            where = f"spec.{kind}[{i}]"
            context = container.get("securityContext") or {}
            if context.get("privileged"):
                refused.append(f"{where}.securityContext.privileged")
            if (context.get("capabilities") or {}).get("add"):
                refused.append(f"{where}.securityContext.capabilities.add")
            refused += [f"{where}.ports[{j}].hostPort" for j, port in enumerate(container.get("ports") or [])
                        if port.get("hostPort")]
    return refused


def _volume_refusals(where: str, volume: dict) -> list[str]:
    if _TENANT_TOKEN_VOLUME.match(volume.get("name", "")):
        return []  # dropped, never mounted on the host (see mirror)
    kinds = [k for k in volume if k != "name"]
    refused = [f"{where}.{k}" for k in kinds if k not in _VOLUME_SOURCES]
    for j, source in enumerate((volume.get("projected") or {}).get("sources") or []):
        refused += [f"{where}.projected.sources[{j}].{k}" for k in source if k not in _PROJECTED_SOURCES]
    return refused


def mirror(pod: dict, tenant: str, host_namespace: str, names: dict[tuple[str, str], str],
           claimed: dict[str, dict[str, str]] | None = None) -> dict:
    """The host pod for a tenant pod that `refusals` passed. ``names`` maps the (kind, name) of each
    ConfigMap/Secret the pod references to its host copy's name; ``claimed``: container name -> the
    HAMi limits its DRA claims stand for (`claims.container_limits`; the pod's claims are not copied)."""
    meta, spec = pod["metadata"], pod["spec"]
    dropped = {v["name"] for v in spec.get("volumes") or [] if _TENANT_TOKEN_VOLUME.match(v.get("name", ""))}
    host_spec = {k: spec[k] for k in _POD_FIELDS if k in spec}
    host_spec.update(automountServiceAccountToken=False, enableServiceLinks=False)
    host_spec["securityContext"] = {**_RESTRICTED_POD, **(spec.get("securityContext") or {})}
    for kind in ("initContainers", "containers"):
        if spec.get(kind):
            host_spec[kind] = [_container(c, dropped, names, (claimed or {}).get(c["name"])) for c in spec[kind]]
    volumes = [_volume(v, names) for v in spec.get("volumes") or [] if v["name"] not in dropped]
    if volumes:
        host_spec["volumes"] = volumes
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": host_name(meta["namespace"], meta["name"]), "namespace": host_namespace,
            "labels": {TENANT: tenant},
            "annotations": {NAMESPACE: meta["namespace"], NAME: meta["name"], UID: meta["uid"]},
        },
        "spec": host_spec,
    }


def references(pod: dict) -> set[tuple[str, str]]:
    """The (kind, name) of every ConfigMap and Secret the pod reads (volumes, env, envFrom)."""
    found: set[tuple[str, str]] = set()
    spec = pod.get("spec") or {}
    for volume in spec.get("volumes") or []:
        if _TENANT_TOKEN_VOLUME.match(volume.get("name", "")):
            continue
        sources = [volume] + list((volume.get("projected") or {}).get("sources") or [])
        for source in sources:
            if "configMap" in source:
                found.add(("ConfigMap", source["configMap"]["name"]))
            if "secret" in source:
                found.add(("Secret", source["secret"].get("secretName") or source["secret"].get("name")))
    for container in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        for env in container.get("env") or []:
            ref = env.get("valueFrom") or {}
            if "configMapKeyRef" in ref:
                found.add(("ConfigMap", ref["configMapKeyRef"]["name"]))
            if "secretKeyRef" in ref:
                found.add(("Secret", ref["secretKeyRef"]["name"]))
        for source in container.get("envFrom") or []:
            if "configMapRef" in source:
                found.add(("ConfigMap", source["configMapRef"]["name"]))
            if "secretRef" in source:
                found.add(("Secret", source["secretRef"]["name"]))
    return found


def _container(container: dict, dropped: set[str], names: dict[tuple[str, str], str],
               claimed: dict[str, str] | None) -> dict:
    out = {k: container[k] for k in _CONTAINER_FIELDS if k in container}
    if "resources" in out and ("claims" in out["resources"] or claimed):
        resources = {k: v for k, v in out["resources"].items() if k != "claims"}
        resources["limits"] = {**resources.get("limits", {}), **(claimed or {})}
        out["resources"] = resources
    out["securityContext"] = {**_RESTRICTED_CONTAINER, **(container.get("securityContext") or {})}
    if "volumeMounts" in out:
        out["volumeMounts"] = [m for m in out["volumeMounts"] if m["name"] not in dropped]
    if "env" in out:
        out["env"] = [_renamed_env(e, names) for e in out["env"]]
    if "envFrom" in out:
        out["envFrom"] = [_renamed_env_from(e, names) for e in out["envFrom"]]
    return out


def _renamed_env(env: dict, names: dict[tuple[str, str], str]) -> dict:
    ref = env.get("valueFrom") or {}
    for key, kind in (("configMapKeyRef", "ConfigMap"), ("secretKeyRef", "Secret")):
        if key in ref:
            return {**env, "valueFrom": {key: {**ref[key], "name": names[(kind, ref[key]["name"])]}}}
    return env


def _renamed_env_from(source: dict, names: dict[tuple[str, str], str]) -> dict:
    for key, kind in (("configMapRef", "ConfigMap"), ("secretRef", "Secret")):
        if key in source:
            return {**source, key: {**source[key], "name": names[(kind, source[key]["name"])]}}
    return source


def _volume(volume: dict, names: dict[tuple[str, str], str]) -> dict:
    out = dict(volume)
    if "configMap" in out:
        out["configMap"] = {**out["configMap"], "name": names[("ConfigMap", out["configMap"]["name"])]}
    if "secret" in out:
        out["secret"] = {**out["secret"], "secretName": names[("Secret", out["secret"]["secretName"])]}
    if "projected" in out:
        sources = []
        for source in out["projected"].get("sources") or []:
            if "configMap" in source:
                source = {"configMap": {**source["configMap"],
                                        "name": names[("ConfigMap", source["configMap"]["name"])]}}
            elif "secret" in source:
                source = {"secret": {**source["secret"], "name": names[("Secret", source["secret"]["name"])]}}
            sources.append(source)
        out["projected"] = {**out["projected"], "sources": sources}
    return out


def status_for_tenant(host: dict) -> dict:
    """What the tenant's pod status shows of its host pod (not the host's IP: the node is virtual)."""
    status = host.get("status") or {}
    keep = ("phase", "conditions", "podIP", "podIPs", "startTime", "message", "reason")
    out = {k: status[k] for k in keep if k in status}
    for kind in ("containerStatuses", "initContainerStatuses"):
        if kind in status:  # not the claims' health or the host's resources: the tenant's pod has neither
            out[kind] = [{k: c[k] for k in _CONTAINER_STATUS if k in c} for c in status[kind]]
    return out


_CONTAINER_STATUS = ("name", "state", "lastState", "ready", "started", "restartCount", "image", "imageID",
                     "containerID")
