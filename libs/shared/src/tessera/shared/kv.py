"""One typed layer over JetStream KV buckets: compare-and-set writes, lost races, bad values.

Every store (claims, ledger, inventory, tenants, the control-plane manager's buckets) needs the same
three things, and each had its own copy of them: telling a lost compare-and-set from any other
failure (by the server's error code, never by the wording of its message), re-reading and retrying a
lost race a bounded number of times (`tessera.shared.errors.retry_cas`), and decoding a stored value without letting one malformed value
crash whoever reads the whole bucket. `Bucket[T]` is that, once. A bucket whose values must not
lie in the clear on the servers (the manager's tenant secrets) passes an ``Envelope`` that seals
each encoded value, bound to its key, and opens it on the way back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Generic, Protocol, TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.js.errors import APIError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from tessera.shared.errors import CAS_ATTEMPTS, ConflictError, PermanentError, TemporaryError, retry_cas
from tessera.shared.jspub import WRONG_LAST_SEQUENCE, PublishError
from tessera.shared.kvkeys import live_entries, live_keys

log = logging.getLogger("tessera.kv")

T = TypeVar("T")

# JetStream's codes for a failed expected-last-sequence check (10164: the per-subject variant).
_CAS_CODES = frozenset({WRONG_LAST_SEQUENCE, 10164})

# Values left out because they did not decode, by bucket: a figure for health reports and tests.
SKIPPED: Counter[str] = Counter()


class CasLost(ConflictError):
    """The key moved since the revision the write was based on (or exists, for a create)."""


class BadValue(PermanentError):
    """A stored value does not decode as the bucket's type; the message names the key and the path."""


# What a KV call raises while the server cannot answer for a moment (a cluster electing the bucket's
# new leader, a reconnect): nothing to fix, so a TemporaryError, retried by the caller's usual path
# (a redelivery, the next pass of a loop) instead of ending a root task and with it the service.
_NOT_NOW = (nats.errors.TimeoutError, asyncio.TimeoutError, nats.errors.NoRespondersError,
            nats.errors.ConnectionReconnectingError, nats.js.errors.ServiceUnavailableError,
            nats.js.errors.NoStreamResponseError)


@contextlib.contextmanager
def answering(bucket: str, key: str):
    try:
        yield
    except _NOT_NOW as exc:
        raise TemporaryError(f"{bucket}/{key}: the server did not answer ({exc!r}); retry later") from exc


def cas_lost(exc: BaseException) -> bool:
    """Is ``exc`` a lost compare-and-set, whichever client call raised it?"""
    if isinstance(exc, (KeyWrongLastSequenceError, CasLost)):
        return True
    if isinstance(exc, APIError):
        return exc.err_code in _CAS_CODES
    if isinstance(exc, PublishError):
        return exc.err_code in _CAS_CODES
    return False


@dataclass(frozen=True)
class Stored(Generic[T]):
    value: T
    revision: int


class Envelope(Protocol):
    """A wrapping of each stored value bound to its key (sealing at rest). ``open`` raises a
    BadValue saying why when a value does not open."""

    def seal(self, key: str, data: bytes) -> bytes: ...

    def open(self, key: str, data: bytes) -> bytes: ...


class Codec(Generic[T]):
    """Decoding of one bucket's values, for readers that get them from a watch rather than a get."""

    def __init__(self, kind: type[T], name: str, envelope: Envelope | None = None) -> None:
        self.name = name
        self.envelope = envelope
        self._decoder = msgspec.json.Decoder(kind)
        self._encoder = msgspec.json.Encoder()

    def decode(self, key: str, data: bytes) -> T:
        """The value of ``key``; BadValue (permanent) if it does not open or decode."""
        if self.envelope is not None:
            data = self.envelope.open(key, data)
        try:
            return self._decoder.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise BadValue(f"{self.name}/{key} holds a malformed value: {exc}") from None

    def decode_or_skip(self, key: str, data: bytes) -> T | None:
        """For readers of many values (watchers, scans): a bad value is logged, counted and left out."""
        try:
            return self.decode(key, data)
        except BadValue as exc:
            SKIPPED[self.name] += 1
            log.error("skipping %s (fix or delete the key; it is ignored until then)", exc)
            return None

    def encode(self, value: T, key: str | None = None) -> bytes:
        data = self._encoder.encode(value)
        if self.envelope is not None:
            if key is None:
                raise ValueError(f"{self.name} seals its values: encode them with their key")
            data = self.envelope.seal(key, data)
        return data


class Bucket(Generic[T]):
    """A typed view of one KV bucket with compare-and-set writes."""

    def __init__(self, kv: KeyValue, kind: type[T], name: str | None = None,
                 envelope: Envelope | None = None) -> None:
        self.kv = kv
        self.name = name or getattr(kv, "_name", None) or kind.__name__
        self.codec: Codec[T] = Codec(kind, self.name, envelope)
        self.decode = self.codec.decode
        self.decode_or_skip = self.codec.decode_or_skip
        self.encode = self.codec.encode

    # --- reads -----------------------------------------------------------------------------

    async def get(self, key: str) -> Stored[T] | None:
        """The value and revision of ``key``; None if absent or deleted; BadValue if malformed."""
        try:
            with answering(self.name, key):
                entry = await self.kv.get(key)
        except KeyNotFoundError:  # also raised for a deleted or purged key
            return None
        if not entry.value or entry.operation is not None:
            return None
        assert entry.revision is not None  # an entry read back from the bucket always has its sequence
        return Stored(self.decode(key, entry.value), entry.revision)

    async def items(self, prefix: str = "") -> dict[str, Stored[T]]:
        """Every live value (under ``prefix``), by key; a malformed one is skipped, not raised."""
        out: dict[str, Stored[T]] = {}
        for key, (data, revision) in sorted((await live_entries(self.kv)).items()):
            if not key.startswith(prefix) or not data:
                continue
            value = self.decode_or_skip(key, data)
            if value is not None:
                out[key] = Stored(value, revision)
        return out

    async def keys(self) -> list[str]:
        return await live_keys(self.kv)

    # --- writes ----------------------------------------------------------------------------

    async def put(self, key: str, value: T, *, revision: int | None) -> int:
        """Write ``value`` if the key is still at ``revision`` (None: must not exist yet); CasLost if not."""
        data = self.encode(value, key)
        try:
            with answering(self.name, key):
                if revision is None:
                    return await self.kv.create(key, data)  # also re-creates a deleted key
                return await self.kv.update(key, data, last=revision)
        except TemporaryError:
            raise
        except Exception as exc:
            if cas_lost(exc):
                raise CasLost(f"{self.name}/{key} changed since revision {revision}") from None
            raise

    async def create(self, key: str, value: T) -> int | None:
        """Store a new key: its revision, or None if the key already exists."""
        try:
            return await self.put(key, value, revision=None)
        except CasLost:
            return None

    async def replace(self, key: str, value: T, revision: int) -> int | None:
        """``put`` at a known revision: the new revision, or None where the race was lost."""
        try:
            return await self.put(key, value, revision=revision)
        except CasLost:
            return None

    async def modify(self, key: str, change: Callable[[T | None], T | None],
                     attempts: int = CAS_ATTEMPTS) -> tuple[T | None, int | None]:
        """Read ``key``, apply ``change`` to its value (None: absent), write the result by
        compare-and-set, re-reading on a lost race up to ``attempts`` times. ``change`` returning
        the value it was given (or None) writes nothing. Returns what is stored now and its revision."""
        async def once() -> tuple[T | None, int | None]:
            stored = await self.get(key)
            current = stored.value if stored else None
            new = change(current)
            if new is None or new is current:
                return current, stored.revision if stored else None
            return new, await self.put(key, new, revision=stored.revision if stored else None)

        return await retry_cas(once, attempts, f"update of {self.name}/{key}")

    async def delete(self, key: str) -> None:
        try:
            with answering(self.name, key):
                await self.kv.purge(key)
        except KeyNotFoundError:
            pass
