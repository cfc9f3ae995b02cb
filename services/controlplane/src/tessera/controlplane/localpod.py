"""The rendered control-plane pod, read as local processes: what a kubelet would run, without one.

Where no kubelet runs the tenant's Deployment, the manager starts the same containers as processes
from the same pod spec, so that what is tested is what would run: each container's command and
arguments (``$(VAR)`` expanded from its env, Secret keys included), each Secret volume written as
files under the tenant's directory with the mount path rewritten to it, each image's executable
taken from the local binary directories (its repository's last name: ``kube-apiserver``, ``kine``).

A pod has a network namespace of its own; local processes share the host's loopback. So what pods
may take for granted is moved, and only that: the pod-local addresses (``127.0.0.1:<port>`` of a
port the pod serves: the API server's secure port, which its controllers dial, and the datastore
shim's ``127.0.0.1:2379``) become ports of the tenant's own on loopback, the API server binds and
advertises loopback, and the controller manager's and scheduler's health ports (the same number in
every pod) are off. Replicas are not processes here: the pod runs once, or not at all when the
Deployment is scaled to zero (a sleeping tenant).
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SHIM_ADDRESS = "127.0.0.1:2379"  # where the pod's kube-apiserver finds its kine (manifests.render)


@dataclass(frozen=True)
class Ports:
    apiserver: int
    shim: int


@dataclass
class LocalProcess:
    name: str  # the container's name
    executable: str  # the image's executable name, looked up in the binary directories
    argv: list[str]  # argv[1:] of the process
    env: dict[str, str] = field(default_factory=dict)
    listens: int = 0  # the loopback port it serves on (0: none)
    cpu_millis: int = 0  # the container's limits (0: none)
    memory_bytes: int = 0


@dataclass
class LocalPod:
    files: dict[Path, bytes]
    processes: list[LocalProcess]
    # The Deployment's replicas: 0 is scaled to zero (asleep), where a kubelet would see the
    # ReplicaSet's pods deleted and stop their containers; any other number runs the pod once here.
    replicas: int = 1


class PodError(ValueError):
    """The rendered objects cannot be run locally (a bug in rendering, or a volume kind unknown here)."""


def executable(image: str) -> str:
    """``registry.k8s.io/kube-apiserver:v1.36.3`` -> ``kube-apiserver``."""
    name = image.rsplit("/", 1)[-1]
    return name.split("@", 1)[0].split(":", 1)[0]


_UNITS = {"": 1, "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "K": 1000, "M": 1000**2, "G": 1000**3}


def cpu_millis(quantity: str) -> int:
    """A Kubernetes CPU quantity (``500m``, ``2``) in millicores."""
    text = str(quantity)
    return int(text[:-1]) if text.endswith("m") else int(float(text) * 1000)


def memory_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (``256Mi``, ``1Gi``, ``1000``) in bytes."""
    match = re.fullmatch(r"([0-9.]+)([KMG]i?)?", str(quantity))
    if match is None:
        raise PodError(f"memory quantity {quantity!r} is not understood here (use Ki, Mi, Gi, K, M or G)")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def _secrets(objects: list[dict[str, Any]]) -> dict[str, dict[str, bytes]]:
    return {o["metadata"]["name"]: {k: base64.b64decode(v) for k, v in (o.get("data") or {}).items()}
            for o in objects if o.get("kind") == "Secret"}


def _deployment(objects: list[dict[str, Any]]) -> dict[str, Any]:
    for o in objects:
        if o.get("kind") == "Deployment":
            return o
    raise PodError("the rendered objects hold no Deployment")


_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a defined variable is replaced, anything else kept."""
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def _pod_local(pod: dict[str, Any], ports: Ports) -> dict[str, str]:
    """Pod-local address -> the tenant's loopback address: only what a container of this pod serves
    (an etcd outside the pod may sit on 127.0.0.1:2379 too, and stays where it is)."""
    moved = {}
    for container in pod["containers"]:
        words = container.get("command", []) + container.get("args", [])
        if f"--listen-address={SHIM_ADDRESS}" in words:
            moved[SHIM_ADDRESS] = f"127.0.0.1:{ports.shim}"
        if executable(container["image"]) == "kube-apiserver":
            for port in container.get("ports", []):
                moved[f"127.0.0.1:{port['containerPort']}"] = f"127.0.0.1:{ports.apiserver}"
    return moved


def translate(objects: list[dict[str, Any]], root: Path, ports: Ports) -> LocalPod:
    """The pod of ``objects`` as files under ``root`` and processes to start, on ``ports``."""
    secrets = _secrets(objects)
    deployment = _deployment(objects)
    pod = deployment["spec"]["template"]["spec"]
    files: dict[Path, bytes] = {}
    volumes: dict[str, Path] = {}
    for volume in pod.get("volumes", []):
        if "secret" not in volume:
            raise PodError(f"volume {volume['name']}: only Secret volumes can be run locally")
        name = volume["secret"]["secretName"]
        if name not in secrets:
            raise PodError(f"volume {volume['name']} names Secret {name}, which is not rendered")
        directory = root / "volumes" / volume["name"]
        volumes[volume["name"]] = directory
        for key, value in secrets[name].items():
            files[directory / key] = value
    moved = _pod_local(pod, ports)
    processes = []
    for container in pod["containers"]:
        env: dict[str, str] = {}
        for var in container.get("env", []):
            if "value" in var:
                env[var["name"]] = _expand(var["value"], env)
            else:
                ref = var["valueFrom"]["secretKeyRef"]
                env[var["name"]] = secrets[ref["name"]][ref["key"]].decode()
        words = [*container.get("command", [])[1:], *container.get("args", [])]
        mounts = {m["mountPath"].rstrip("/") + "/": str(volumes[m["name"]]) + "/"
                  for m in container.get("volumeMounts", [])}
        argv = []
        for word in words:
            word = _expand(word, env)
            for inside, outside in mounts.items():
                word = word.replace(inside, outside)
            for inside, outside in moved.items():
                word = re.sub(re.escape(inside) + r"(?![0-9])", outside, word)
            argv.append(word)
        exe = executable(container["image"])
        limits = container.get("resources", {}).get("limits", {})
        process = LocalProcess(name=container["name"], executable=exe, argv=argv, env=env,
                               cpu_millis=cpu_millis(limits.get("cpu", "0")),
                               memory_bytes=memory_bytes(limits.get("memory", "0")))
        if exe == "kube-apiserver":
            argv[:] = [w for w in argv if not w.startswith(("--secure-port=", "--advertise-address="))]
            argv += [f"--secure-port={ports.apiserver}", "--bind-address=127.0.0.1",
                     "--advertise-address=127.0.0.1", "--endpoint-reconciler-type=none"]
            process.listens = ports.apiserver
        elif exe in ("kube-controller-manager", "kube-scheduler"):
            argv.append("--secure-port=0")
        elif any(f"127.0.0.1:{ports.shim}" in w for w in argv if w.startswith("--listen-address=")):
            process.listens = ports.shim
        processes.append(process)
    # the shim first: the API server's storage is behind it
    processes.sort(key=lambda p: p.listens != ports.shim)
    return LocalPod(files, processes, deployment["spec"].get("replicas", 1))
