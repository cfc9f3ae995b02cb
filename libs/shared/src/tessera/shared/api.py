"""Request/reply payloads of the public APIs (core NATS request/reply, JSON).

These are what `tessera submit`, `tessera tenant ...` and any outside tool send to the translator and
the control-plane manager. Unlike bus events, requests are user input: they forbid unknown fields so
a typo ("gpumen") is an error that names the field, not a silently ignored value.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from tessera.shared.events import MAX_PRIORITY, ClaimSpec, GpuQuota, Uid


class SubmitRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """A GPU request in HAMi's vocabulary (resource names and annotations), or a native spec."""

    tenant: str
    resources: dict[str, str | int] = {}
    annotations: dict[str, str] = {}
    spec: ClaimSpec | None = None  # a native claim instead of HAMi resources
    # The scheduling priority (`ClaimSpec.priority`: larger = more important, may preempt lower);
    # HAMi's runtime priority is ``resources["nvidia.com/priority"]``, a different thing.
    scheduling_priority: Annotated[int, Meta(ge=0, le=MAX_PRIORITY)] | None = None
    claim: str | None = None  # the caller's id for idempotent retries; generated if absent
    node: str | None = None  # pin to one node (tessera run)
    workload_uid: Uid | None = None  # the host uid the workload runs as (tessera run); see ClaimSpec


class ReleaseRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    claim: str
    tenant: str | None = None
    reason: str = "requested"


class ClaimRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """A claim's state (``get``) or its workload's start (``running``, with the pids)."""

    claim: str
    tenant: str | None = None
    pids: list[int] = []


class TenantRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """create | get | list | delete; ``spec`` is the control-plane manager's own spec document."""

    name: str = ""
    quota: GpuQuota | None = None
    spec: dict[str, Any] | None = None


class ApiError(Struct, kw_only=True):
    message: str
    field: str = ""
    code: str = "invalid"  # invalid | not-found | conflict | unavailable | internal
    # On ``unavailable`` from a submit: the id the claim was (or would have been) recorded under.
    # The outcome is unknown; the same request again with this id is safe (it is idempotent).
    claim: str = ""


class Reply(Struct, kw_only=True):
    ok: bool
    result: Any = None
    error: ApiError | None = None


_reply_decoder = msgspec.json.Decoder(Reply)
_encoder = msgspec.json.Encoder()


def ok(result: Any) -> bytes:
    return _encoder.encode(Reply(ok=True, result=result))


def error(message: str, *, field: str = "", code: str = "invalid", claim: str = "") -> bytes:
    return _encoder.encode(Reply(ok=False, error=ApiError(message=message, field=field, code=code, claim=claim)))


def new_claim_id() -> str:
    """A fresh claim id. A client that chooses it before its first submit can retry a submit
    whose reply it never got with the same id, and so never makes two claims of one request."""
    return "c-" + uuid.uuid4().hex[:16]


def decode_reply(data: bytes) -> Reply:
    return _reply_decoder.decode(data)


def describe_validation_error(exc: msgspec.ValidationError | msgspec.DecodeError) -> tuple[str, str]:
    """(message, field path) from msgspec's error text, e.g. 'Expected int >= 1 - at `$.spec.gpus`'."""
    text = str(exc)
    path = ""
    if " - at `" in text:
        text, _, rest = text.partition(" - at `")
        path = rest.rstrip("`")
    return text, path
