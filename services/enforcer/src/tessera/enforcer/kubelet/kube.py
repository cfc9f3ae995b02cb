"""The enforcer's one adapter to the Kubernetes API: reading the ResourceClaim the kubelet names.

The kubelet plugin needs a single call — get one ResourceClaim — so that is all this module does
(and all the DaemonSet's RBAC allows). Failures are classified for the caller: a claim that does
not exist is None; anything else (API server unreachable, forbidden, a server error) is a
TemporaryError whose message says what the API server answered, since the kubelet asks again.
"""

from __future__ import annotations

import asyncio

import aiohttp

from tessera.shared.errors import TemporaryError
from tessera.shared.kubeapi import ApiException, KubeApi, object_path
from tessera.shared.kubeclaims import RESOURCE_API_VERSION


class ClaimReader:
    def __init__(self, api: KubeApi | None = None) -> None:
        self.api = api or KubeApi()

    async def get(self, namespace: str, name: str) -> dict | None:
        path = object_path(RESOURCE_API_VERSION, "resourceclaims", name, namespace)
        try:
            return await self.api.get(path)
        except ApiException as exc:
            raise TemporaryError(f"the API server answered {exc.status} {exc.reason} for ResourceClaim "
                                 f"{namespace}/{name}") from None
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            raise TemporaryError(f"the API server could not be reached for ResourceClaim {namespace}/{name}: "
                                 f"{exc!r}") from None

    async def close(self) -> None:
        await self.api.close()
