"""The real translator service, run in this test's event loop against a real nats-server (and, in
Kubernetes mode, against the API-server emulator), stopped as SIGTERM would stop it; and the parts
of Kubernetes the tests play around it: the API server calling the webhook over TLS (an
AdmissionReview, its JSONPatch applied) and the resourceclaim controller (a pod's ResourceClaim made
from its template, owned by the pod)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import jsonpatch
import nats

from tessera.shared import subjects
from tessera.shared.events import TenantRecord, claim_decoder, encode
from tessera.shared.kubeapi import KubeApi
from tessera.shared.kubeclaims import RESOURCE_API_VERSION
from tessera.shared.natsserver import free_port
from tessera.shared.runner import serve
from tessera.shared.settings import BusSettings, ServiceSettings
from tessera.translator.service import TranslatorService, TranslatorSettings
from webhook_tls import Authority, post_review, project_secret, served_serial
from kit import eventually

__all__ = ["free_port", "running_translator", "KubeTranslator", "kube_translator", "resourceclaim_controller"]


@contextlib.asynccontextmanager
async def running_translator(nats_url: str, settings: TranslatorSettings, kube_api=None):
    """Yields the TranslatorService once it has started (its webhook port accepting, if any)."""
    started: list[TranslatorService] = []

    async def build(ctx):
        service = TranslatorService(ctx, settings, kube_api)
        started.append(service)
        return await service.start()

    stop = asyncio.Event()
    task = asyncio.create_task(serve(ServiceSettings(service="translator", bus=BusSettings(url=nats_url)),
                                     build, stop=stop))
    try:
        async with asyncio.timeout(60):
            while not started or (settings.webhook_port and not await _accepts(settings.webhook_port)):
                if task.done():
                    task.result()
                await asyncio.sleep(0.05)
        yield started[0]
    finally:
        stop.set()
        await task


async def _accepts(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    await writer.wait_closed()
    return True


@dataclass
class KubeTranslator:
    """A translator in Kubernetes mode with its webhook on real TLS, and what it published."""

    service: TranslatorService
    port: int
    authority: Authority
    published: list[tuple[str, object]] = field(default_factory=list)  # (subject, event), every publish

    async def review(self, pod: dict, namespace: str) -> dict:
        """What the API server does at pod creation: an AdmissionReview over TLS; its response."""
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                  "request": {"uid": str(uuid.uuid4()), "kind": {"group": "", "version": "v1", "kind": "Pod"},
                              "resource": {"group": "", "version": "v1", "resource": "pods"},
                              "namespace": namespace, "operation": "CREATE", "object": pod,
                              "userInfo": {"username": "alice"}, "dryRun": False}}
        _, reader, writer = await served_serial(self.port, self.authority)
        try:
            answer = await post_review(reader, writer, review)
        finally:
            writer.close()
            await writer.wait_closed()
        assert answer["response"]["uid"] == review["request"]["uid"]
        return answer["response"]

    async def admit(self, pod: dict, namespace: str) -> dict:
        """The pod as the API server stores it after this webhook: patched, or AssertionError."""
        response = await self.review(pod, namespace)
        assert response["allowed"], response.get("status")
        ops = json.loads(base64.b64decode(response["patch"])) if "patch" in response else []
        return jsonpatch.apply_patch(copy.deepcopy(pod), ops)

    async def add_tenant(self, name: str) -> None:
        await self.service.tenants.put(name, encode(TenantRecord(tenant=name)))

    def events(self, kind: str, claim: str | None = None, *, tenant: str | None = None) -> list:
        """The events of ``kind`` published so far, of one claim or one tenant if named (the control
        plane is the session's: an earlier test's namespace, deleted, releases its own claims)."""
        return [e for _, e in self.published
                if e.__struct_config__.tag == kind and (claim is None or e.claim == claim)
                and (tenant is None or e.tenant == tenant)]

    async def wait_for(self, kind: str, claim: str, count: int = 1) -> list:
        def found() -> list | None:
            events = self.events(kind, claim)
            return events if len(events) >= count else None

        return await eventually(found, timeout=30, every=0.02, what=f"{count} {kind} event(s) of {claim}")


@contextlib.asynccontextmanager
async def kube_translator(nats_url: str, apiserver, secrets: Path, *, reconcile_seconds: float = 60.0):
    """The translator as deploy/k8s runs it, on the emulator (``apiserver``) or on a real API server
    (``apiserver`` a kubeconfig: the translator's identity, `service_identity`); every claim event it
    publishes is recorded from a core NATS subscription (which sees each publish, even one the
    stream drops as a duplicate)."""
    authority = Authority()
    cert, key, _ = authority.serving()
    project_secret(secrets, {"tls.crt": cert, "tls.key": key, "ca.crt": authority.pem})
    port = free_port()
    settings = TranslatorSettings(webhook_port=port, webhook_host="127.0.0.1", webhook_cert=str(secrets / "tls.crt"),
                                  webhook_key=str(secrets / "tls.key"), kubernetes=True,
                                  reconcile_seconds=reconcile_seconds)
    nc = await nats.connect(nats_url)
    published: list[tuple[str, object]] = []

    async def record(msg) -> None:
        published.append((msg.subject, claim_decoder.decode(msg.data)))

    await nc.subscribe(f"{subjects.CLAIMS}.>", cb=record)
    try:
        kube = KubeApi.for_kubeconfig(str(apiserver)) if isinstance(apiserver, Path) else KubeApi.for_url(apiserver.url)
        async with running_translator(nats_url, settings, kube) as service:
            yield KubeTranslator(service, port, authority, published)
    finally:
        await nc.close()


async def resourceclaim_controller(apiserver, pod: dict) -> list[dict]:
    """Kubernetes' resourceclaim controller for one stored pod: a ResourceClaim per template entry
    of ``spec.resourceClaims``, made from the template and owned by the pod; the claims created."""
    meta = pod["metadata"]
    made = []
    for entry in pod["spec"].get("resourceClaims") or []:
        template = apiserver.object(RESOURCE_API_VERSION, "resourceclaimtemplates",
                                    entry["resourceClaimTemplateName"], meta["namespace"])
        assert template is not None, f"no ResourceClaimTemplate {entry['resourceClaimTemplateName']}"
        inner = template["spec"]
        claim_meta = {
            "name": f"{meta['name']}-{entry['name']}-{uuid.uuid4().hex[:5]}"[:253],
            "namespace": meta["namespace"],
            "annotations": {**(inner.get("metadata") or {}).get("annotations", {}),
                            "resource.kubernetes.io/pod-claim-name": entry["name"]},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"],
                                 "controller": True, "blockOwnerDeletion": True}],
        }
        labels = (inner.get("metadata") or {}).get("labels")
        if labels:
            claim_meta["labels"] = dict(labels)
        made.append(await apiserver.create({"apiVersion": RESOURCE_API_VERSION, "kind": "ResourceClaim",
                                            "metadata": claim_meta, "spec": copy.deepcopy(inner["spec"])}))
    return made
