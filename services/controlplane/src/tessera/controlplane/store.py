"""Desired and observed tenant state, kept in JetStream KV so that the manager remembers nothing.

Two buckets belong to the manager: ``controlplanes`` (tenant -> TenantControlPlane: spec + status)
and ``controlplane-secrets`` (tenant -> the PKI bundle and datastore credentials). The public
``tenants`` bucket (tenant -> TenantRecord, read by placement for quotas) is written from them.
Every write is a compare-and-set on the revision read, so two manager replicas cannot overwrite
each other's decisions; a lost race surfaces as ConflictError.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import msgspec

from tessera.controlplane.credentials import TenantSecrets
from tessera.controlplane.spec import TenantControlPlane
from tessera.shared import subjects
from tessera.shared.bus import Bus, KeyNotFoundError, KeyValue, KeyWrongLastSequenceError
from tessera.shared.errors import ConflictError
from tessera.shared.events import TenantRecord
from tessera.shared.kvkeys import live_keys

KV_CONTROLPLANES = "controlplanes"
KV_SECRETS = "controlplane-secrets"

T = TypeVar("T")


class Stored(msgspec.Struct, Generic[T]):
    value: T
    revision: int


class Bucket(Generic[T]):
    """A typed view of one KV bucket with compare-and-set writes."""

    def __init__(self, kv: KeyValue, kind: type[T]) -> None:
        self.kv = kv
        self._decoder = msgspec.json.Decoder(kind)
        self._encoder = msgspec.json.Encoder()

    async def get(self, key: str) -> Stored[T] | None:
        try:
            entry = await self.kv.get(key)
        except KeyNotFoundError:  # also raised for a deleted or purged key
            return None
        if entry.value is None or entry.operation is not None:
            return None
        return Stored(self._decoder.decode(entry.value), entry.revision)

    async def put(self, key: str, value: T, *, revision: int | None) -> int:
        """Write ``value`` if the key is still at ``revision`` (None: must not exist yet)."""
        data = self._encoder.encode(value)
        try:
            if revision is None:
                return await self.kv.create(key, data)  # also re-creates a deleted key
            return await self.kv.update(key, data, last=revision)
        except KeyWrongLastSequenceError:
            raise ConflictError(f"{key} changed under us") from None

    async def overwrite(self, key: str, value: T) -> int:
        return await self.kv.put(key, self._encoder.encode(value))

    async def delete(self, key: str) -> None:
        try:
            await self.kv.purge(key)
        except KeyNotFoundError:
            pass

    async def keys(self) -> list[str]:
        return await live_keys(self.kv)


class TenantStore:
    """The manager's three buckets, opened once."""

    def __init__(
        self,
        controlplanes: Bucket[TenantControlPlane],
        secrets: Bucket[TenantSecrets],
        tenants: Bucket[TenantRecord],
    ) -> None:
        self.controlplanes = controlplanes
        self.secrets = secrets
        self.tenants = tenants

    @classmethod
    async def open(cls, bus: Bus) -> "TenantStore":
        return cls(
            Bucket(await bus.kv(KV_CONTROLPLANES), TenantControlPlane),
            Bucket(await bus.kv(KV_SECRETS), TenantSecrets),
            Bucket(await bus.kv(subjects.KV_TENANTS), TenantRecord),
        )
