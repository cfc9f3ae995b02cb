"""The translator's only module that talks to Kubernetes: it creates ResourceClaimTemplates.

The admission webhook rewrites a GPU pod to point at a ResourceClaimTemplate named after the
translated claim (``tessera-<container>-<hash of the spec>``); this writer creates that template in
the pod's namespace before the webhook answers. The name is derived from the spec, so an existing
template with that name already says the same thing: a 409 is success, and retries are harmless.
"""

from __future__ import annotations

import logging

from tessera.shared.kubeapi import ApiException, KubeApi, object_path

from tessera.translator.webhook import ContainerClaim

log = logging.getLogger("tessera.translator.kube")


class TemplateWriter:
    def __init__(self, api: KubeApi | None = None) -> None:
        self.kube = api or KubeApi()

    @classmethod
    def for_url(cls, url: str) -> "TemplateWriter":
        return cls(KubeApi.for_url(url))

    async def __call__(self, namespace: str, claims: list[ContainerClaim]) -> None:
        for claim in claims:
            try:
                await self.kube.call("POST", object_path("resource.k8s.io/v1", "resourceclaimtemplates",
                                                         namespace=namespace), claim.template)
                log.info("created ResourceClaimTemplate %s/%s", namespace, claim.template_name)
            except ApiException as exc:
                if exc.status != 409:
                    raise

    async def close(self) -> None:
        await self.kube.close()
