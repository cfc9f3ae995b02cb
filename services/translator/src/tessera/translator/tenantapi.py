"""The claim API as a tenant sees it: the tenant is the one the server says is asking.

A tenant's NATS account imports the API's subjects with its own name in them (see
`tessera.shared.identities.tenant_account`): its ``tessera.api.claims.submit`` arrives here as
``tessera.api.tenant.<tenant>.claims.submit``. That token is written by the platform's server
config, so it is the tenant's identity; a payload naming another tenant is refused, a claim of
another tenant is "not found". The same module answers the platform's own ``get`` and ``running``
(operators, `tessera run` with platform credentials), which any claim may use.
"""

from __future__ import annotations

import logging
from typing import Mapping

import msgspec

from tessera.shared import api, identities, subjects
from tessera.shared.events import ClaimPrepared, ClaimRecord, ClaimRunning, claim_decoder

log = logging.getLogger("tessera.translator.tenantapi")

_claim_request = msgspec.json.Decoder(api.ClaimRequest)


class TenantApi:
    """Served next to the translator's submit/release handlers, which it calls for the tenant."""

    def __init__(self, translator) -> None:
        self.translator = translator
        self.bus = translator.bus

    def tasks(self) -> dict:
        bus = self.bus
        return {
            "api-claim-get": bus.serve(subjects.API_CLAIM_GET, lambda d, h: self.get(d, None)),
            "api-claim-running": bus.serve(subjects.API_CLAIM_RUNNING, lambda d, h: self.running(d, None)),
            "api-tenant": bus.serve(f"{identities.TENANT_API}.*.claims.*", self.on_tenant_request, with_subject=True),
        }

    async def on_tenant_request(self, subject: str, data: bytes, headers: Mapping[str, str]) -> bytes:
        parts = subject.split(".")
        tenant, op = parts[3], parts[-1]
        if op == "submit":
            return await self.submit(tenant, data, headers)
        if op == "release":
            return await self.release(tenant, data, headers)
        if op == "get":
            return await self.get(data, tenant)
        if op == "running":
            return await self.running(data, tenant)
        return api.error(f"unknown claim operation {op!r}: use one of {', '.join(identities.TENANT_API_OPS)}")

    @staticmethod
    def _as_tenant(tenant: str, data: bytes) -> bytes | dict:
        """The request with its tenant set to the caller's; an error reply if it names another."""
        try:
            body = msgspec.json.decode(data)
        except msgspec.DecodeError as exc:
            return api.error(f"bad request: {exc}")
        if not isinstance(body, dict):
            return api.error("bad request: expected a JSON object")
        named = body.get("tenant")
        if named not in (None, "", tenant):
            return api.error(
                f"you are connected as tenant {tenant!r} but the request names tenant {named!r}; a tenant's"
                " credentials act for that tenant only", field="tenant", code="forbidden",
            )
        body["tenant"] = tenant
        return body

    async def submit(self, tenant: str, data: bytes, headers: Mapping[str, str]) -> bytes:
        body = self._as_tenant(tenant, data)
        if isinstance(body, bytes):
            return body
        return await self.translator.submit(msgspec.json.encode(body), headers)

    async def release(self, tenant: str, data: bytes, headers: Mapping[str, str]) -> bytes:
        body = self._as_tenant(tenant, data)
        if isinstance(body, bytes):
            return body
        if isinstance(body.get("claim"), str):  # another tenant's claim: "does not exist", as for `get`
            owned = await self._own_record(msgspec.json.encode({"claim": body["claim"]}), tenant)
            if isinstance(owned, bytes):
                return owned
        return await self.translator.release(msgspec.json.encode(body), headers)

    async def _own_record(self, data: bytes, tenant: str | None) -> ClaimRecord | bytes:
        try:
            request = _claim_request.decode(data)
            subjects.token(request.claim)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            message, path = api.describe_validation_error(exc)
            return api.error(f"bad claim request: {message}", field=path)
        except ValueError as exc:
            return api.error(str(exc), field="claim")
        record, _ = await self.translator.claims.get(request.claim)
        wanted = tenant or request.tenant
        if record is None or (wanted and record.tenant != wanted):
            # Another tenant's claim looks exactly like a missing one: its id tells nothing.
            scope = f" for tenant {wanted!r}" if wanted else ""
            return api.error(f"claim {request.claim!r} does not exist{scope}", field="claim", code="not-found")
        return record

    async def get(self, data: bytes, tenant: str | None) -> bytes:
        record = await self._own_record(data, tenant)
        if isinstance(record, bytes):
            return record
        result = {"record": msgspec.to_builtins(record), "prepared": None}
        if record.state in ("prepared", "running"):
            prepared = await self._prepared(record)
            result["prepared"] = msgspec.to_builtins(prepared) if prepared else None
        return api.ok(result)

    async def _prepared(self, record: ClaimRecord) -> ClaimPrepared | None:
        subject = subjects.claim(record.tenant, record.claim, "prepared", subjects.ANY_NODE)
        try:
            msg = await self.bus.last_message(subjects.STREAM_CLAIMS, subject)
        except Exception:  # not on the stream (yet): the caller asks again
            return None
        event = claim_decoder.decode(msg.data)
        return event if isinstance(event, ClaimPrepared) else None

    async def running(self, data: bytes, tenant: str | None) -> bytes:
        record = await self._own_record(data, tenant)
        if isinstance(record, bytes):
            return record
        if record.state not in ("prepared", "running") or not record.node:
            return api.error(f"claim {record.claim!r} is {record.state}, not prepared", code="conflict")
        pids = _claim_request.decode(data).pids
        await self.bus.publish(
            subjects.claim(record.tenant, record.claim, "running", record.node),
            ClaimRunning(claim=record.claim, tenant=record.tenant, node=record.node, pids=pids),
            msg_id=f"{record.claim}:running",
        )
        return api.ok({"claim": record.claim, "state": "running"})
