"""What the deployment tests read: the manifests, the compose file, the Dockerfiles, and the code.

The deployment files can drift from the code silently (a renamed variable, a new console script, a
manifest nobody lists), and nothing runs them here: there is no Docker engine and no cluster. So the
tests compare them with the one thing that is here, the source, and with the real Kubernetes schemas.
Kept apart from the tests so that each test file stays about one behaviour.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
COMPOSE = ROOT / "deploy" / "compose" / "compose.yaml"
SERVICES = ("controlplane", "capacity", "translator", "placement", "enforcer")

# The Kubernetes version the manifests are validated against: the first one whose schemas know
# resource.k8s.io/v1 (DeviceClass) and the oldest Tessera supports.
K8S_VERSION = "1.34.0"

WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob", "Pod"}

# Variables set for a Tessera container that the code does not read, because something else does.
READ_ELSEWHERE = {
    "NVIDIA_VISIBLE_DEVICES": "the NVIDIA container runtime (which GPUs to inject)",
    "NVIDIA_DRIVER_CAPABILITIES": "the NVIDIA container runtime (which driver libraries to inject)",
    "PATH": "the shell and exec",
    "PYTHONUNBUFFERED": "the Python interpreter",
    "PYTHONDONTWRITEBYTECODE": "the Python interpreter",
    "PIP_NO_CACHE_DIR": "pip, at image build time",
    "PIP_DISABLE_PIP_VERSION_CHECK": "pip, at image build time",
}


@dataclass(frozen=True)
class Manifest:
    path: Path  # relative to deploy/k8s
    index: int  # document number in the file
    obj: dict

    @property
    def id(self) -> str:
        return f"{self.path}:{self.obj.get('kind')}/{self.obj.get('metadata', {}).get('name')}"


def manifest_files() -> list[Path]:
    """Every YAML file under deploy/k8s that kubectl would apply (not kustomize's own files)."""
    return sorted(
        p.relative_to(K8S)
        for p in K8S.rglob("*.y*ml")
        if p.name not in ("kustomization.yaml", "kustomization.yml", "Kustomization")
    )


@cache
def manifests() -> tuple[Manifest, ...]:
    out = []
    for rel in manifest_files():
        for i, doc in enumerate(yaml.safe_load_all((K8S / rel).read_text())):
            if doc:
                out.append(Manifest(rel, i, doc))
    return tuple(out)


def pod_spec(obj: dict) -> dict | None:
    kind = obj.get("kind")
    if kind == "Pod":
        return obj["spec"]
    if kind == "CronJob":
        return obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    if kind in WORKLOAD_KINDS:
        return obj["spec"]["template"]["spec"]
    return None


def tessera_service_of_image(image: str) -> str | None:
    """tessera/<service>[:tag] -> service; None for images that are not Tessera's."""
    m = re.fullmatch(r"(?:.*/)?tessera/([a-z]+)(?::[\w.-]+)?(?:@sha256:[0-9a-f]+)?", image)
    return m.group(1) if m and m.group(1) in SERVICES else None


@cache
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@cache
def _sources(service: str) -> str:
    """The Python a service's process runs: tessera.shared plus the service's own package."""
    roots = [ROOT / "libs" / "shared" / "src", ROOT / "services" / service / "src"]
    return "\n".join(p.read_text() for root in roots for p in sorted(root.rglob("*.py")))


def reads_env(service: str, name: str) -> bool:
    """Whether the service's code names the variable as a string literal (env.get("X"), env_str(env, "X"))."""
    return re.search(rf"""["']{re.escape(name)}["']""", _sources(service)) is not None


def unread_env(service: str, names) -> list[str]:
    return sorted(n for n in set(names) if n not in READ_ELSEWHERE and not reads_env(service, n))


def console_scripts(project: Path) -> dict[str, str]:
    data = tomllib.loads((project / "pyproject.toml").read_text())
    return data.get("project", {}).get("scripts", {})


@dataclass(frozen=True)
class Dockerfile:
    path: Path
    instructions: tuple[tuple[str, str], ...]  # (INSTRUCTION, arguments), continuations joined

    @classmethod
    def read(cls, path: Path) -> "Dockerfile":
        text = re.sub(r"\\\n", " ", path.read_text())
        out = []
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
        return cls(path, tuple(out))

    def all(self, instruction: str) -> list[str]:
        return [args for word, args in self.instructions if word == instruction]

    def stages(self) -> list[list[tuple[str, str]]]:
        stages: list[list[tuple[str, str]]] = []
        for ins in self.instructions:
            if ins[0] == "FROM":
                stages.append([])
            if stages:
                stages[-1].append(ins)
        return stages

    def env(self) -> dict[str, str]:
        """ENV key=value pairs (the only form used here)."""
        out = {}
        for args in self.all("ENV"):
            for m in re.finditer(r"([A-Za-z_][A-Za-z0-9_]*)=(\"[^\"]*\"|\S+)", args):
                out[m.group(1)] = m.group(2).strip('"')
        return out
