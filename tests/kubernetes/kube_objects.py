"""Minimal valid objects of the kinds the Kubernetes tests write, so each test states only what matters.

Each passes the emulator's strict validation as it is; tests change what they are about.
"""

from __future__ import annotations

from pathlib import Path

from tessera.shared.kubeclaims import DEVICE_CLASS, REQUEST_NAME, RESOURCE_API_VERSION, SCHEDULING_GATE


# The manifests Tessera ships (the CRDs the fixture installs live in crds/).
DEPLOY_K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


def namespace(name: str, labels: dict | None = None) -> dict:
    meta: dict = {"name": name}
    if labels:
        meta["labels"] = labels
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": meta}


def pod(name: str, namespace: str = "default", *, gates: tuple[str, ...] = (SCHEDULING_GATE,),
        labels: dict | None = None) -> dict:
    meta: dict = {"name": name, "namespace": namespace}
    if labels:
        meta["labels"] = labels
    spec: dict = {"containers": [{"name": "main", "image": "registry.example/app:1"}]}
    if gates:
        spec["schedulingGates"] = [{"name": g} for g in gates]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def claim(name: str, namespace: str = "default") -> dict:
    return {"apiVersion": RESOURCE_API_VERSION, "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"devices": {"requests": [{"name": REQUEST_NAME,
                                               "exactly": {"deviceClassName": DEVICE_CLASS}}]}}}


def configmap(name: str, namespace: str = "default", data: dict | None = None, **meta) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": namespace, **meta},
            "data": data or {}}


def binding(pod_name: str, node: str) -> dict:
    return {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod_name},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
