"""The translator's only module that talks to Kubernetes: it creates ResourceClaimTemplates.

The admission webhook rewrites a GPU pod to point at a ResourceClaimTemplate named after the
translated claim (``tessera-<container>-<hash of the spec>``); this writer creates that template in
the pod's namespace before the webhook answers. The name is derived from the spec, so an existing
template with that name already says the same thing: a 409 is success, and retries are harmless.
"""

from __future__ import annotations

import logging

from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from tessera.translator.webhook import ContainerClaim

log = logging.getLogger("tessera.translator.kube")


class TemplateWriter:
    def __init__(self, api: client.ApiClient | None = None) -> None:
        self._api = api

    @classmethod
    def for_url(cls, url: str) -> "TemplateWriter":
        return cls(client.ApiClient(client.Configuration(host=url)))

    async def api(self) -> client.ApiClient:
        if self._api is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                await config.load_kube_config()
            self._api = client.ApiClient()
        return self._api

    async def __call__(self, namespace: str, claims: list[ContainerClaim]) -> None:
        api = await self.api()
        for claim in claims:
            path = f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaimtemplates"
            try:
                await api.call_api(
                    path, "POST", body=claim.template,
                    header_params={"Content-Type": "application/json", "Accept": "application/json"},
                    response_types_map={200: "object", 201: "object"}, auth_settings=["BearerToken"],
                    _return_http_data_only=True,
                )
                log.info("created ResourceClaimTemplate %s/%s", namespace, claim.template_name)
            except ApiException as exc:
                if exc.status != 409:
                    raise

    async def close(self) -> None:
        if self._api is not None:
            await self._api.close()
