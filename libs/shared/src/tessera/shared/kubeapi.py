"""The Kubernetes API as the services use it: raw JSON calls and server-side apply.

Three services talk to an API server (the control-plane manager applies tenant objects, the
translator creates ResourceClaimTemplates, the capacity publisher applies ResourceSlices). They all
want the same few things, kept here once: a client configured in-cluster or from ~/.kube/config (or
for a given URL in tests), JSON in and out without generated model classes, and server-side apply
(PATCH ``application/apply-patch+yaml`` with a field manager and ``force``), so that a repeated apply
is a no-op and fields other managers own are left alone. An emulator that answers 404 to an apply
of a missing object (kmock does; real API servers create it) gets a create instead.

Imported only in Kubernetes mode: kubernetes_asyncio costs start-up time and memory.
"""

from __future__ import annotations

from typing import Any

from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

__all__ = ["KubeApi", "ApiException", "object_path"]


def object_path(api_version: str, plural: str, name: str | None = None, namespace: str | None = None) -> str:
    """The REST path of a collection or, with ``name``, of one object."""
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    ns = f"/namespaces/{namespace}" if namespace else ""
    return f"{base}{ns}/{plural}" + (f"/{name}" if name else "")


class KubeApi:
    def __init__(self, api: client.ApiClient | None = None) -> None:
        self._api = api

    @classmethod
    def for_url(cls, url: str) -> "KubeApi":
        return cls(client.ApiClient(client.Configuration(host=url)))

    async def api(self) -> client.ApiClient:
        if self._api is None:  # in-cluster first, then ~/.kube/config
            try:
                config.load_incluster_config()
            except config.ConfigException:
                await config.load_kube_config()
            self._api = client.ApiClient()
        return self._api

    async def call(self, method: str, path: str, body: Any = None, *, query=None,
                   content_type: str = "application/json") -> Any:
        api = await self.api()
        return await api.call_api(
            path, method, query_params=query or [], body=body,
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            response_types_map={200: "object", 201: "object"}, auth_settings=["BearerToken"],
            _return_http_data_only=True,
        )

    async def get(self, path: str) -> dict | None:
        """The object at ``path``, or None if there is none."""
        try:
            return await self.call("GET", path)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def apply(self, path: str, collection: str, obj: dict, field_manager: str) -> None:
        """Server-side apply of ``obj`` at ``path`` (a create in ``collection`` where apply 404s)."""
        try:
            await self.call("PATCH", path, obj, query=[("fieldManager", field_manager), ("force", "true")],
                            content_type="application/apply-patch+yaml")
        except ApiException as exc:
            if exc.status != 404:
                raise
            await self.call("POST", collection, obj, query=[("fieldManager", field_manager)])

    async def close(self) -> None:
        if self._api is not None:
            await self._api.close()
            self._api = None
