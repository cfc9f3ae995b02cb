"""The translator's only module that talks to Kubernetes (through ``tessera.shared.kubeapi``).

Three conversations with the API server, each small:

- admission: the webhook rewrites a GPU pod to point at a ResourceClaimTemplate named after the
  translated claim (``tessera-<container>-<hash of the spec>``); ``TemplateWriter`` creates that
  template in the pod's namespace before the webhook answers. The name is derived from the spec, so
  an existing template with that name already says the same thing: a 409 is success, and retries
  are harmless. ``Cluster.namespace`` reads the Namespace whose label names the pod's tenant.
- claims: ``Cluster.list_claims`` and ``Cluster.watch_claims`` follow the ResourceClaims of every
  namespace, for the claim watcher (``tessera.translator.claimwatch``) to turn into claims;
  ``Cluster.pod`` reads a claim's pod (its scheduling constraints go with the claim).
- reporting: ``Cluster.event`` records a Kubernetes Event on a claim or pod, so that what Tessera
  refuses shows in ``kubectl describe``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator

from tessera.shared.featuregates import FeatureGateOff, require_consumable_capacity
from tessera.shared.kubeapi import AlreadyExists, Events, KubeApi, object_path
from tessera.shared.kubeclaims import RESOURCE_API_VERSION

from tessera.translator.webhook import PodClaim

log = logging.getLogger("tessera.translator.kube")

COMPONENT = "tessera-translator"
CLAIMS = object_path(RESOURCE_API_VERSION, "resourceclaims")


class TemplateWriter:
    def __init__(self, api: KubeApi | None = None) -> None:
        self.kube = api or KubeApi()

    @classmethod
    def for_url(cls, url: str) -> "TemplateWriter":
        return cls(KubeApi.for_url(url))

    async def __call__(self, namespace: str, claims: list[PodClaim]) -> None:
        for claim in claims:
            collection = object_path(RESOURCE_API_VERSION, "resourceclaimtemplates", namespace=namespace)
            try:
                stored = await self.kube.create(collection, claim.template)
            except AlreadyExists:
                continue
            log.info("created ResourceClaimTemplate %s/%s", namespace, claim.template_name)
            try:  # a server without consumable capacity would have the claim take a whole card
                require_consumable_capacity(f"ResourceClaimTemplate {namespace}/{claim.template_name}",
                                            claim.template, stored)
            except FeatureGateOff:
                await self.kube.delete(object_path(RESOURCE_API_VERSION, "resourceclaimtemplates",
                                                   claim.template_name, namespace))
                raise

    async def close(self) -> None:
        await self.kube.close()


class Cluster:
    """Namespaces, ResourceClaims and Events, as the translator reads and writes them."""

    def __init__(self, api: KubeApi | None = None, instance: str = "") -> None:
        self.kube = api or KubeApi()
        self.events = Events(self.kube, COMPONENT, instance)

    @classmethod
    def for_url(cls, url: str, instance: str = "") -> "Cluster":
        return cls(KubeApi.for_url(url), instance)

    async def namespace(self, name: str) -> dict | None:
        return await self.kube.get(object_path("v1", "namespaces", name))

    async def pod(self, namespace: str, name: str) -> dict | None:
        """A claim's pod (what kube-scheduler's filters will read of it goes with the claim)."""
        return await self.kube.get(object_path("v1", "pods", name, namespace))

    async def list_claims(self) -> tuple[list[dict], str]:
        """Every ResourceClaim of the cluster, and the resourceVersion to watch from."""
        return await self.kube.list(CLAIMS)

    def watch_claims(self, resource_version: str, timeout: float) -> AsyncGenerator[tuple[str, dict], None]:
        """ResourceClaim changes after ``resource_version`` as (ADDED|MODIFIED|DELETED, object),
        resumed across dropped connections and 410s by ``KubeApi.watch`` (which re-lists)."""
        return self.kube.watch(CLAIMS, resource_version, timeout_seconds=max(1, int(timeout)))

    async def event(self, obj: dict, reason: str, message: str, kind: str = "Warning") -> None:
        """A core/v1 Event about ``obj`` (a ResourceClaim or a Pod), shown by ``kubectl describe``;
        repeating the same report counts on that one Event rather than piling up new ones."""
        await self.events.record(obj, reason, message, warning=kind == "Warning")

    async def close(self) -> None:
        await self.kube.close()

