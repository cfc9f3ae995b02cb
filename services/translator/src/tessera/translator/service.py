"""The claim translator service: the front door where GPU requests become claims.

It answers ``tessera.api.claims.submit`` (a request in HAMi's vocabulary, or a native ClaimSpec) and
``tessera.api.claims.release`` over NATS request/reply. A request is validated completely before
anything is stored: a bad value is answered with an error naming the field, the allowed range and
the fix, and nothing is published. A good one is recorded in the ``claims`` bucket and published as
``requested``; a retry with the same claim id is answered with the claim already recorded.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import uuid
from dataclasses import dataclass
from typing import Mapping

import msgspec
from aiohttp import web

from tessera.shared import api, subjects
from tessera.shared.api import ReleaseRequest, SubmitRequest
from tessera.shared.claimstore import TERMINAL, ClaimStore
from tessera.shared.errors import ConfigError, TemporaryError
from tessera.shared.events import (
    ClaimRecord,
    ClaimReleaseRequested,
    ClaimRequested,
    ClaimSpec,
    claim_decoder,
    encode,
)
from tessera.shared.runner import ServiceContext
from tessera.shared.settings import env_bool, env_int, env_str
from tessera.shared.telemetry import inject

from tessera.translator.hami import TranslationError, translate
from tessera.translator.webhook import make_app

log = logging.getLogger("tessera.translator")

_submit_decoder = msgspec.json.Decoder(SubmitRequest)
_release_decoder = msgspec.json.Decoder(ReleaseRequest)
_spec_decoder = msgspec.json.Decoder(ClaimSpec)
_encoder = msgspec.json.Encoder()


def new_claim_id() -> str:
    return "c-" + uuid.uuid4().hex[:16]


@dataclass(frozen=True)
class TranslatorSettings:
    """The admission webhook is served only when a port is set (Kubernetes mode)."""

    webhook_port: int = 0
    webhook_host: str = "0.0.0.0"
    webhook_cert: str = ""
    webhook_key: str = ""
    create_templates: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "TranslatorSettings":
        env = os.environ if env is None else env
        settings = cls(
            webhook_port=env_int(env, "TESSERA_WEBHOOK_PORT", 0, minimum=0),
            webhook_host=env_str(env, "TESSERA_WEBHOOK_HOST", cls.webhook_host),
            webhook_cert=env_str(env, "TESSERA_WEBHOOK_CERT", ""),
            webhook_key=env_str(env, "TESSERA_WEBHOOK_KEY", ""),
            create_templates=env_bool(env, "TESSERA_KUBERNETES", False),
        )
        if bool(settings.webhook_cert) != bool(settings.webhook_key):
            raise ConfigError("set both TESSERA_WEBHOOK_CERT and TESSERA_WEBHOOK_KEY (PEM files), or neither")
        for name in ("webhook_cert", "webhook_key"):
            path = getattr(settings, name)
            if path and not os.path.exists(path):
                raise ConfigError(f"TESSERA_{name.upper()}={path} does not exist")
        return settings


class TranslatorService:
    def __init__(self, ctx: ServiceContext, settings: TranslatorSettings = TranslatorSettings()) -> None:
        self.ctx = ctx
        self.bus = ctx.bus
        self.settings = settings
        self.claims: ClaimStore

    async def start(self) -> dict:
        self.claims = ClaimStore(await self.bus.kv(subjects.KV_CLAIMS))
        self.tenants = await self.bus.kv(subjects.KV_TENANTS)
        tasks = {
            "api-submit": self.bus.serve(subjects.API_SUBMIT, self.submit),
            "api-release": self.bus.serve(subjects.API_RELEASE, self.release),
        }
        if self.settings.webhook_port:
            tasks["admission-webhook"] = self._serve_webhook()
        return tasks

    async def _serve_webhook(self) -> None:
        """AdmissionReview v1 over HTTPS (HTTP when no certificate is configured, for tests)."""
        hook = None
        if self.settings.create_templates:
            from tessera.translator.kube import TemplateWriter

            hook = TemplateWriter()
        ssl_context = None
        if self.settings.webhook_cert:
            ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_context.load_cert_chain(self.settings.webhook_cert, self.settings.webhook_key)
        runner = web.AppRunner(make_app(hook), handle_signals=False, access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.settings.webhook_host, self.settings.webhook_port, ssl_context=ssl_context)
            await site.start()
            log.info("admission webhook on %s://%s:%d/mutate", "https" if ssl_context else "http",
                     self.settings.webhook_host, self.settings.webhook_port)
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()
            if hook is not None:
                await hook.close()

    async def _tenant_exists(self, tenant: str) -> bool:
        try:
            await self.tenants.get(tenant)
            return True
        except Exception:
            return False

    def _spec_from(self, request: SubmitRequest) -> ClaimSpec:
        if request.spec is not None:
            if request.resources:
                raise TranslationError(
                    "spec", request.spec, "give either 'spec' (a native claim) or HAMi 'resources', not both"
                )
            # Re-validate through the same constraints a wire event gets.
            spec = _spec_decoder.decode(_encoder.encode(request.spec))
        else:
            spec = translate(request.resources, request.annotations)
        if request.node:
            spec = msgspec.structs.replace(spec, node=request.node)
        return spec

    async def submit(self, data: bytes, headers: Mapping[str, str]) -> bytes:
        try:
            request = _submit_decoder.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            message, path = api.describe_validation_error(exc)
            return api.error(f"bad submit request: {message}", field=path)
        try:
            subjects.token(request.tenant)
            if request.claim is not None:
                subjects.token(request.claim)
            spec = self._spec_from(request)
            event = ClaimRequested(
                claim=request.claim or new_claim_id(), tenant=request.tenant, spec=spec, source="api"
            )
            # The events' own constraints (name patterns, ranges) apply to what we are about to publish.
            claim_decoder.decode(encode(event))
        except TranslationError as exc:
            return api.error(str(exc), field=exc.field)
        except msgspec.ValidationError as exc:
            message, path = api.describe_validation_error(exc)
            return api.error(message, field=path)
        except ValueError as exc:
            return api.error(str(exc), field="tenant" if "tenant" in str(exc) else "claim")
        if not await self._tenant_exists(event.tenant):
            return api.error(
                f"tenant {event.tenant!r} does not exist: create it first with"
                f" 'tessera tenant create {event.tenant}'",
                field="tenant",
                code="not-found",
            )
        record = ClaimRecord(
            claim=event.claim, tenant=event.tenant, state="requested", spec=spec,
            traceparent=inject({}).get("traceparent", ""),
        )
        try:
            created = await self.claims.create(record)
            if created is not None:
                event = msgspec.structs.replace(event, record_revision=created)
            else:
                existing, _ = await self.claims.get(event.claim)
                if existing is not None and existing.tenant != event.tenant:
                    return api.error(
                        f"claim id {event.claim!r} belongs to another tenant; choose another id",
                        field="claim",
                        code="conflict",
                    )
            await self.bus.publish(
                subjects.claim(event.tenant, event.claim, "requested"),
                event,
                msg_id=f"{event.claim}:requested",
            )
        except TemporaryError as exc:
            return api.error(str(exc), code="unavailable")
        log.info("claim %s for tenant %s requested: %s", event.claim, event.tenant, spec)
        return api.ok({"claim": event.claim, "tenant": event.tenant, "spec": msgspec.to_builtins(spec)})

    async def release(self, data: bytes, headers: Mapping[str, str]) -> bytes:
        try:
            request = _release_decoder.decode(data)
            subjects.token(request.claim)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            message, path = api.describe_validation_error(exc)
            return api.error(f"bad release request: {message}", field=path)
        except ValueError as exc:
            return api.error(str(exc), field="claim")
        record, _ = await self.claims.get(request.claim)
        if record is None:
            return api.error(f"claim {request.claim!r} does not exist", field="claim", code="not-found")
        if request.tenant and request.tenant != record.tenant:
            return api.error(
                f"claim {request.claim!r} does not belong to tenant {request.tenant!r}", field="tenant", code="not-found"
            )
        if record.state in TERMINAL:
            return api.ok({"claim": record.claim, "state": record.state})
        marked = await self.claims.mark_release_requested(record.claim, request.reason) or record
        # Addressed to the node that holds the claim, if one does by now: its enforcer releases it.
        # Before allocation it concerns no node: placement ends it, and a placement that allocates
        # it meanwhile finds the request on the record (which is marked first).
        node = marked.node if marked.state in ("allocated", "prepared", "running") else None
        # The release continues the claim's own trace: one claim, one trace, request to release.
        parent = {"traceparent": record.traceparent} if record.traceparent else None
        with self.ctx.telemetry.span("translator release", parent_headers=parent,
                                     attributes={"tessera.claim": record.claim}):
            await self.bus.publish(
                subjects.claim(record.tenant, record.claim, "release", node),
                ClaimReleaseRequested(claim=record.claim, tenant=record.tenant, reason=request.reason),
                msg_id=f"{record.claim}:release",
            )
        return api.ok({"claim": record.claim, "state": "releasing"})


def configure():
    settings = TranslatorSettings.from_env()

    async def build(ctx: ServiceContext) -> dict:
        return await TranslatorService(ctx, settings).start()

    return build
