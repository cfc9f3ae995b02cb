"""The claim translator service: the front door where GPU requests become claims.

It answers ``tessera.api.claims.submit`` (a request in HAMi's vocabulary, or a native ClaimSpec) and
``tessera.api.claims.release`` over NATS request/reply. A request is validated completely before
anything is stored: a bad value is answered with an error naming the field, the allowed range and
the fix, and nothing is published. A good one is recorded in the ``claims`` bucket and published as
``requested``; a retry with the same claim id is answered with the claim already recorded. When the
outcome is unknown (a timeout) the answer is ``unavailable`` with the claim id to retry with, and a
record that stays ``requested`` without its event on the stream is republished from the record.

In Kubernetes mode (``TESSERA_KUBERNETES``) it also serves the pods' admission webhook (which
refuses GPU pods of namespaces without a tenant and creates their ResourceClaimTemplates) and
follows the ResourceClaims made from them (``claimwatch``): each becomes a claim through the same
record-then-publish path as a submit, with ``source="kubernetes"`` and the ResourceClaim it stands
for, and its deletion becomes a release through the same path as a release request; an
allocation kube-scheduler took back becomes ``deallocated``, for placement to place it again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Mapping

import msgspec
from aiohttp import web

from tessera.shared import api, claimpruning, subjects
from tessera.shared.api import ReleaseRequest, SubmitRequest
from tessera.shared.bus import KeyNotFoundError
from tessera.shared.claimstore import ClaimStore
from tessera.shared.errors import TemporaryError
from tessera.shared.events import (
    ClaimDeallocated,
    ClaimRecord,
    ClaimReleaseRequested,
    ClaimRequested,
    ClaimSpec,
    claim_decoder,
    encode,
    now,
)
from tessera.shared.kubeclaims import KubeClaimRef
from tessera.shared.podconstraints import PodConstraints
from tessera.shared.lifecycle import release_route
from tessera.shared.runner import ServiceContext
from tessera.shared.telemetry import claim_attributes, decided, inject

from tessera.translator import claimflow
from tessera.translator.certs import ServingCertificate
from tessera.translator.hami import TranslationError, translate
from tessera.translator.settings import TranslatorSettings
from tessera.translator.tenantapi import TenantApi
from tessera.translator.webhook import make_app

if TYPE_CHECKING:  # (imported where it runs: in Kubernetes mode only)
    from tessera.translator.claimwatch import ClaimWatcher

log = logging.getLogger("tessera.translator")

_submit_decoder = msgspec.json.Decoder(SubmitRequest)
_release_decoder = msgspec.json.Decoder(ReleaseRequest)
_spec_decoder = msgspec.json.Decoder(ClaimSpec)
_encoder = msgspec.json.Encoder()


new_claim_id = api.new_claim_id

# A ``requested`` record this old whose event is not on the stream was left by a translator that
# stopped (or timed out) between the record and the publish; younger ones may still be on their way.
REQUESTED_GRACE_SECONDS = 10.0

DEFAULT_SETTINGS = TranslatorSettings()  # (frozen: one instance serves every default)


class TranslatorService:
    def __init__(self, ctx: ServiceContext, settings: TranslatorSettings = DEFAULT_SETTINGS,
                 kube_api=None) -> None:
        """``kube_api``: a ``tessera.shared.kubeapi.KubeApi`` to use in Kubernetes mode (tests point
        it at an emulator); by default one configured in-cluster or from ~/.kube/config."""
        self.ctx = ctx
        self.bus = ctx.bus
        self.settings = settings
        self.kube_api = kube_api
        self.claims: ClaimStore
        self.watcher: ClaimWatcher | None = None  # Kubernetes mode: the ResourceClaim watcher, once started
        # Kubernetes path: events whose record change is written but which are not on the stream
        # yet, by message id (see ``flush``).
        self.unpublished: dict[str, tuple[str, msgspec.Struct]] = {}
        claims = ctx.metrics.counter(
            "tessera_translator_claims",
            "claim requests by where they came from (api: submit requests; kubernetes: ResourceClaims) and "
            "outcome: translated (recorded and requested), rejected (a bad request, an unknown tenant, a "
            "conflicting claim id: the reply says what is wrong), unavailable (NATS failed; the caller retries)",
            ["source", "outcome"])
        self.counted = {(source, outcome): claims.labels(source, outcome)
                        for source in ("api", "kubernetes") for outcome in ("translated", "rejected", "unavailable")}
        admissions = ctx.metrics.counter(
            "tessera_translator_admissions",
            "GPU pods the admission webhook saw, by outcome: translated (given their claim templates), rejected "
            "(a bad request or tenant: denied with the reason), unavailable (Kubernetes or NATS failed: denied, "
            "the client retries)", ["outcome"])
        self.admitted = {outcome: admissions.labels(outcome) for outcome in ("translated", "rejected", "unavailable")}

    async def open(self) -> None:
        """The buckets every root task uses (tests open without tasks)."""
        self.claims = ClaimStore(await self.bus.kv(subjects.KV_CLAIMS))
        self.tenants = await self.bus.kv(subjects.KV_TENANTS)

    async def start(self) -> dict:
        await self.open()
        tasks = {
            "api-submit": self.bus.serve(subjects.API_SUBMIT, self.submit),
            "api-release": self.bus.serve(subjects.API_RELEASE, self.release),
            **TenantApi(self).tasks(),
            "requested-reconcile": self._republish_loop(),
            # lifecycle.RECORD_PRUNER: released claims leave the bucket after their retention.
            "prune-released": claimpruning.prune_loop(self.bus, self.bus.settings.claim_retention,
                                                      self.bus.settings.claim_prune_interval),
        }
        cluster = None
        if self.settings.kubernetes:
            # kubernetes_asyncio only in Kubernetes mode: it costs start-up time and memory.
            from tessera.translator.kube import Cluster

            cluster = Cluster(self.kube_api, self.ctx.settings.instance or "")
            # Not ready (so no webhook endpoint) until the first comparison with the claims bucket.
            tasks["resourceclaims"] = self._follow_claims(cluster, self.ctx.gate("resourceclaims-synced"))
        if self.settings.webhook_port:
            certificate = None
            if self.settings.webhook_cert:
                certificate = ServingCertificate(self.settings.webhook_cert, self.settings.webhook_key,
                                                 self.settings.cert_poll_seconds)
                tasks["webhook-certificate"] = certificate.follow()
            tasks["admission-webhook"] = self._serve_webhook(cluster, certificate)
        return tasks

    async def _follow_claims(self, cluster, synced) -> None:
        from tessera.translator.claimwatch import ClaimWatcher

        try:
            watcher = self.watcher = ClaimWatcher(cluster, self, self.settings.reconcile_seconds, on_synced=synced)
            await watcher.run()
        finally:
            await cluster.close()

    async def _serve_webhook(self, cluster, certificate: ServingCertificate | None) -> None:
        """AdmissionReview v1 over HTTPS (HTTP when no certificate is configured, for tests)."""
        hook = tenant_check = None
        if cluster is not None:
            from tessera.translator.kube import TemplateWriter

            hook = TemplateWriter(cluster.kube)

            async def tenant_check(namespace: str) -> str | None:
                tenant = claimflow.namespace_tenant(await cluster.namespace(namespace))
                problem = claimflow.tenant_problem(namespace, tenant)
                # (tenant_problem finds none only in a tenant that is named)
                if problem is None and tenant is not None and not await self.tenant_exists(tenant):
                    problem = claimflow.unknown_tenant(namespace, tenant)
                return problem

        ssl_context = certificate.context if certificate is not None else None
        app = make_app(hook, tenant_check, on_outcome=lambda outcome: self.admitted[outcome].inc())
        runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.settings.webhook_host, self.settings.webhook_port, ssl_context=ssl_context)
            await site.start()
            log.info("admission webhook on %s://%s:%d/mutate", "https" if ssl_context else "http",
                     self.settings.webhook_host, self.settings.webhook_port)
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    async def tenant_exists(self, tenant: str) -> bool:
        """Whether the tenant is in the ``tenants`` bucket; NATS errors propagate (not a 'no')."""
        try:
            await self.tenants.get(tenant)
            return True
        except KeyNotFoundError:
            return False

    async def _record(self, event: ClaimRequested) -> tuple[ClaimRequested | None, ClaimRecord | None]:
        """Store the claim's record, create-only: (the event to publish, None) if this created it,
        (None, the existing record) if the claim was recorded already."""
        record = ClaimRecord(
            claim=event.claim, tenant=event.tenant, state="requested", spec=event.spec,
            traceparent=inject({}).get("traceparent", ""), kube=event.kube,
        )
        created = await self.claims.create(record)
        if created is not None:
            return msgspec.structs.replace(event, record_revision=created), None
        existing, _ = await self.claims.get(event.claim)
        return None, existing

    @staticmethod
    def _requested_message(event: ClaimRequested) -> tuple[str, ClaimRequested, str]:
        return subjects.claim(event.tenant, event.claim, "requested"), event, f"{event.claim}:requested"

    async def _publish_requested(self, event: ClaimRequested) -> None:
        subject, message, msg_id = self._requested_message(event)
        await self.bus.publish(subject, message, msg_id=msg_id)

    async def records(self) -> list[ClaimRecord]:
        return await self.claims.all()

    async def flush(self) -> None:
        """Publish the events whose record change was written but whose publish failed.

        A re-seen ResourceClaim finds its record (created, or marked for release) and publishes
        nothing, so an event lost between the record and the stream would leave the claim requested,
        or its GPUs held, forever; it is kept here and sent again (same message id: the stream drops
        it if the first attempt did get through).
        """
        for msg_id, (subject, event) in list(self.unpublished.items()):
            await self.bus.publish(subject, event, msg_id=msg_id)
            del self.unpublished[msg_id]

    async def _deliver(self, subject: str, event: msgspec.Struct, msg_id: str) -> None:
        self.unpublished[msg_id] = (subject, event)
        await self.flush()

    async def request_kube(self, claim: str, tenant: str, spec: ClaimSpec, ref: KubeClaimRef) -> bool:
        """A ResourceClaim's claim: recorded and published once; False if it was recorded already."""
        event = ClaimRequested(claim=claim, tenant=tenant, spec=spec, source="kubernetes", kube=ref)
        try:
            claim_decoder.decode(encode(event))  # the events' own constraints, before anything is stored
        except msgspec.ValidationError:
            self.counted["kubernetes", "rejected"].inc()
            raise
        with self.ctx.telemetry.span("translator resourceclaim", attributes=claim_attributes(event)):
            fresh, _ = await self._record(event)
            if fresh is None:
                decided(event, "unchanged", "the claim was recorded already")
                return False
            await self._deliver(*self._requested_message(fresh))
            decided(event, "requested")
        self.counted["kubernetes", "translated"].inc()
        return True

    async def release_kube(self, claim: str, reason: str) -> bool:
        """Release the claim of a ResourceClaim that is gone; False if there is nothing to release."""
        # Marked by compare-and-set, and published only by the writer that marked it: two replicas
        # that both see the ResourceClaim go publish one release between them.
        while True:
            record, revision = await self.claims.get(claim)
            if record is None or record.kube is None or record.release_requested \
                    or release_route(record.state, record.node) is None:
                return False
            marked = msgspec.structs.replace(record, release_requested=True, reason=reason, updated=now())
            if revision is not None and await self.claims.replace(marked, revision) is not None:
                message = self._release_message(marked, reason)
                if message is not None:
                    with self._release_span(marked):
                        await self._deliver(*message)
                return True

    async def deallocated_kube(self, claim: str, pod: PodConstraints | None, seen: str = "") -> str | None:
        """The allocation of a claim placement allocated was taken away from its ResourceClaim:
        ``deallocated`` on the node it was on (the node, or None when the record says there is
        nothing to redo: released, being released, not allocated by placement). The message id
        names the allocation (the record's revision) and the ResourceClaim's version it was seen
        gone in (``seen``): replicas seeing the same deallocation send one message, and the same
        allocation written again and taken back again (a placement that resumed its status write
        meanwhile) is news again."""
        record, revision = await self.claims.get(claim)
        if record is None or record.kube is None or record.release_requested or record.state != "allocated" \
                or not record.node:
            return None
        event = ClaimDeallocated(claim=claim, tenant=record.tenant, node=record.node, pod=pod, kube=record.kube)
        parent = {"traceparent": record.traceparent} if record.traceparent else None
        with self.ctx.telemetry.span("translator deallocated", parent_headers=parent,
                                     attributes=claim_attributes(record)):
            await self._deliver(subjects.claim(record.tenant, claim, "deallocated", record.node), event,
                                f"{claim}:deallocated:{revision}:{seen}")
            decided(record, "deallocated", f"its allocation on {record.node} was removed")
        return record.node

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
        if request.scheduling_priority is not None:
            if request.spec is not None and request.spec.priority not in (0, request.scheduling_priority):
                raise TranslationError(
                    "scheduling_priority", request.scheduling_priority,
                    f"differs from spec.priority {request.spec.priority}: give the scheduling priority once")
            spec = msgspec.structs.replace(spec, priority=request.scheduling_priority)
        if request.node:
            spec = msgspec.structs.replace(spec, node=request.node)
        if request.workload_uid is not None:
            spec = msgspec.structs.replace(spec, workload_uid=request.workload_uid)
        return spec

    async def submit(self, data: bytes, headers: Mapping[str, str]) -> bytes:
        outcome, reply = await self._submit(data)
        self.counted["api", outcome].inc()
        return reply

    async def _submit(self, data: bytes) -> tuple[str, bytes]:
        """(outcome for the metrics, the reply)."""
        rejected = "rejected"
        try:
            request = _submit_decoder.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            message, path = api.describe_validation_error(exc)
            return rejected, api.error(f"bad submit request: {message}", field=path)
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
            return rejected, api.error(str(exc), field=exc.field)
        except msgspec.ValidationError as exc:
            message, path = api.describe_validation_error(exc)
            return rejected, api.error(message, field=path)
        except ValueError as exc:
            return rejected, api.error(str(exc), field="tenant" if "tenant" in str(exc) else "claim")
        try:
            exists = await self.tenant_exists(event.tenant)
        except Exception as exc:  # the tenants bucket unreadable: say so, not "no such tenant"
            return "unavailable", api.error(f"cannot read the tenants bucket ({exc!r}); retry", code="unavailable")
        if not exists:
            reason = f"tenant {event.tenant!r} does not exist: create it first with 'tessera tenant create {event.tenant}'"
            decided(event, "refused", reason)
            return rejected, api.error(reason, field="tenant", code="not-found")
        refused = await self._record_and_request(event)
        if refused is not None:
            error = api.decode_reply(refused[1]).error
            assert error is not None  # the reply is an api.error's (`_record_and_request`)
            decided(event, "refused", error.message)
            return refused
        decided(event, "requested")
        log.info("claim %s for tenant %s requested: %s", event.claim, event.tenant, spec)
        return "translated", api.ok({"claim": event.claim, "tenant": event.tenant, "spec": msgspec.to_builtins(spec)})

    async def _record_and_request(self, event: ClaimRequested) -> tuple[str, bytes] | None:
        """Record the claim and publish ``requested``; None when done, else (outcome, the error reply).

        Safe to repeat with the same claim id, which is what a caller does with the id an
        ``unavailable`` reply gives it: a claim recorded before is requested again only while it is
        still ``requested``, from its record (never from the new request, so a claim is never
        requested with two contents), under the same message id (the stream drops it if the first
        attempt got through). If the publish fails for good, the republisher finds the record."""
        try:
            fresh, existing = await self._record(event)
            if existing is not None:
                if existing.tenant != event.tenant:
                    return "rejected", api.error(f"claim id {event.claim!r} belongs to another tenant; choose another id",
                                     field="claim", code="conflict")
                if existing.spec != event.spec:
                    return "rejected", api.error(f"claim id {event.claim!r} was already submitted with another request; "
                                     "choose another id (or repeat the first request exactly)",
                                     field="claim", code="conflict")
                if existing.state != "requested":
                    return None  # on its way already: nothing to send
                _, revision = await self.claims.get(event.claim)
                fresh = ClaimRequested(claim=existing.claim, tenant=existing.tenant, spec=existing.spec,
                                       source="api", kube=existing.kube, record_revision=revision or 0)
            assert fresh is not None  # `_record` gives the event when it is not given an existing record
            await self._publish_requested(fresh)
        except Exception as exc:  # a timeout or lost connection of the bucket or the stream: outcome unknown
            return "unavailable", api.error(f"{exc!r}: the claim may or may not be recorded; submit again with claim id "
                             f"{event.claim!r} (safe: it cannot make a second claim)",
                             code="unavailable", claim=event.claim)
        return None

    async def _republish_loop(self) -> None:
        while True:
            try:
                await self.republish_requested()
            except TemporaryError as exc:
                log.warning("requested republish: %s", exc)
            await asyncio.sleep(self.settings.reconcile_seconds)

    async def republish_requested(self, grace: float = REQUESTED_GRACE_SECONDS) -> list[str]:
        """Publish ``requested`` for the records that say so but whose event never reached the
        stream (a submit whose publish failed, a translator killed between record and publish, on
        either path); returns their claim ids. The event is made from the record at its current
        revision, under the claim's one message id, so every replica may run this at once."""
        sent = []
        for record in await self.claims.all():
            if record.state != "requested" or now() - record.updated < grace:
                continue
            subject = subjects.claim(record.tenant, record.claim, "requested")
            if await self.bus.stored(subjects.STREAM_CLAIMS, subject):
                continue
            current, revision = await self.claims.get(record.claim)
            if current is None or current.state != "requested":
                continue
            event = ClaimRequested(claim=current.claim, tenant=current.tenant, spec=current.spec,
                                   source="kubernetes" if current.kube is not None else "api",
                                   kube=current.kube, record_revision=revision or 0)
            await self._publish_requested(event)
            log.warning("republished requested for %s (its event never reached the stream)", record.claim)
            sent.append(record.claim)
        return sent

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
        if release_route(record.state, record.node) is None:  # over already
            return api.ok({"claim": record.claim, "state": record.state})
        await self._release(record, request.reason)
        return api.ok({"claim": record.claim, "state": "releasing"})

    async def _release(self, record: ClaimRecord, reason: str) -> None:
        marked = await self.claims.mark_release_requested(record.claim, reason) or record
        message = self._release_message(marked, reason)
        if message is None:
            return
        with self._release_span(record):
            subject, event, msg_id = message
            await self.bus.publish(subject, event, msg_id=msg_id)
            decided(record, "release", reason)

    async def resend_release(self, record: ClaimRecord) -> None:
        message = self._release_message(record, record.reason)
        if message is not None:
            with self._release_span(record):
                await self._deliver(*message)
                decided(record, "release", f"sent again: {record.reason}")

    def _release_span(self, record: ClaimRecord):
        # The release continues the claim's own trace: one claim, one trace, request to release.
        parent = {"traceparent": record.traceparent} if record.traceparent else None
        return self.ctx.telemetry.span("translator release", parent_headers=parent,
                                       attributes=claim_attributes(record))

    @staticmethod
    def _release_message(record: ClaimRecord, reason: str) -> tuple[str, ClaimReleaseRequested, str] | None:
        """The release of a claim whose record is marked ``release_requested`` (``record``), routed
        by the lifecycle to whoever ends it; None if it is over already."""
        # Addressed to the node that holds the claim, if one does by now: its enforcer releases it.
        # Before allocation it concerns no node: placement ends it, and a placement that allocates
        # it meanwhile finds the request on the record (which is marked first). The message id is
        # the route's, so this release and one placement passes on to the node are one message.
        route = release_route(record.state, record.node)
        if route is None:
            return None
        return (route.subject(record.tenant, record.claim),
                ClaimReleaseRequested(claim=record.claim, tenant=record.tenant, reason=reason),
                route.msg_id(record.claim))


async def build(ctx: ServiceContext, settings: TranslatorSettings) -> dict:
    return await TranslatorService(ctx, settings).start()
