"""The enforcer's one adapter to the Kubernetes API: reading the ResourceClaim the kubelet names.

The kubelet plugin needs a single call — get one ResourceClaim — so that is all this module does
(and all the DaemonSet's RBAC allows). For the caller, a claim that does not exist is None, and
every other failure (API server unreachable or overloaded, forbidden, a server error; classified by
the shared seam) is a TemporaryError saying what the API server answered: the claim's prepare fails
with it and the kubelet asks again. Where the API server is configured is settled at start-up
(``connect``): a node agent without one stops with a ConfigError instead of failing every claim.
"""

from __future__ import annotations

from kubernetes_asyncio.config import ConfigException

from tessera.shared.errors import ConfigError, TemporaryError
from tessera.shared.kubeapi import KubeApi, KubeError, object_path
from tessera.shared.kubeclaims import RESOURCE_API_VERSION


class ClaimReader:
    def __init__(self, api: KubeApi | None = None) -> None:
        self.api = api or KubeApi()

    async def connect(self) -> None:
        try:
            await self.api.api()
        except (ConfigException, OSError) as exc:
            raise ConfigError(f"TESSERA_KUBERNETES=true, but the Kubernetes API cannot be configured: not in a "
                              f"cluster, and no usable kubeconfig (KUBECONFIG or ~/.kube/config): {exc}") from None

    async def get(self, namespace: str, name: str) -> dict | None:
        try:
            return await self.api.get(object_path(RESOURCE_API_VERSION, "resourceclaims", name, namespace))
        except KubeError as exc:
            raise TemporaryError(f"ResourceClaim {namespace}/{name} could not be read: {exc}") from None

    async def close(self) -> None:
        await self.api.close()
