"""Where rendered tenant manifests go: nowhere, a directory, or a real host cluster.

The reconciler renders and validates the objects itself; a HostCluster only applies them, reports
whether the tenant's control plane is ready, and removes everything it applied for a tenant. Without
Kubernetes, ``RenderedHost`` writes one YAML file per tenant (what `kubectl apply -f` would take)
and counts a tenant ready once its validated manifests are on disk; ``NoHost`` keeps nothing (the
embedded development mode). ``tessera.controlplane.kube`` is the Kubernetes implementation.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Protocol

import yaml


class HostFault(Exception):
    """The host knows why the tenant's control plane is not serving (``reason``: a word for the
    status, such as ``BinaryMissing``, ``PortInUse``, ``ApiServerNotAnswering``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class HostCluster(Protocol):
    async def apply(self, tenant: str, objects: list[dict[str, Any]]) -> None: ...
    async def ready(self, tenant: str) -> tuple[bool, str]: ...
    async def remove(self, tenant: str) -> None: ...
    async def close(self) -> None: ...


class NoHost:
    async def apply(self, tenant: str, objects: list[dict[str, Any]]) -> None:
        return None

    async def ready(self, tenant: str) -> tuple[bool, str]:
        return True, ""

    async def remove(self, tenant: str) -> None:
        return None

    async def close(self) -> None:
        return None


class RenderedHost:
    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)

    def path(self, tenant: str) -> Path:
        return self.directory / f"{tenant}.yaml"

    async def apply(self, tenant: str, objects: list[dict[str, Any]]) -> None:
        text = yaml.safe_dump_all(objects, sort_keys=False)
        path = self.path(tenant)
        try:
            if path.read_text() == text:
                return
        except FileNotFoundError:
            pass
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{tenant}-")
        with os.fdopen(fd, "w") as f:  # 0600: the Secrets in it hold private keys
            f.write(text)
        os.replace(tmp, path)

    async def ready(self, tenant: str) -> tuple[bool, str]:
        if self.path(tenant).exists():
            return True, ""
        return False, f"manifests for {tenant} not written yet"

    async def remove(self, tenant: str) -> None:
        self.path(tenant).unlink(missing_ok=True)

    async def close(self) -> None:
        return None
