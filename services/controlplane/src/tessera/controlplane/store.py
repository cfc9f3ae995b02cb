"""Desired and observed tenant state, kept in JetStream KV so that the manager remembers nothing.

Two buckets belong to the manager: ``controlplanes`` (tenant -> TenantControlPlane: spec + status)
and ``controlplane-secrets`` (tenant -> the PKI bundle and datastore credentials). The public
``tenants`` bucket (tenant -> TenantRecord, read by placement for quotas) is written from them.
Every write is a compare-and-set on the revision read, so two manager replicas cannot overwrite
each other's decisions; a lost race surfaces as ConflictError (`tessera.shared.kv.CasLost`).
The secrets bucket holds sealed values only (`tessera.controlplane.sealing`).
"""

from __future__ import annotations

import logging

from tessera.controlplane.credentials import TenantSecrets
from tessera.controlplane.sealing import Sealer
from tessera.shared.secretkeys import SecretKeys
from tessera.controlplane.spec import TenantControlPlane
from tessera.shared import subjects
from tessera.shared.bus import Bus
from tessera.shared.events import TenantRecord
from tessera.shared.kv import BadValue, Bucket, CasLost, Stored
from tessera.shared.kvkeys import live_entries

log = logging.getLogger("tessera.controlplane.store")

__all__ = ["Bucket", "Stored", "TenantStore", "KV_CONTROLPLANES", "KV_SECRETS"]

KV_CONTROLPLANES = "controlplanes"
KV_SECRETS = "controlplane-secrets"


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
    async def open(cls, bus: Bus, keys: SecretKeys) -> "TenantStore":
        return cls(
            Bucket(await bus.kv(KV_CONTROLPLANES), TenantControlPlane, KV_CONTROLPLANES),
            Bucket(await bus.kv(KV_SECRETS), TenantSecrets, KV_SECRETS, Sealer(keys, KV_SECRETS)),
            Bucket(await bus.kv(subjects.KV_TENANTS), TenantRecord, subjects.KV_TENANTS),
        )

    async def reseal_secrets(self) -> int:
        """Re-seal with the newest key every secret that is not under it: a value written in
        plaintext before sealing existed, or one sealed with a key since rotated out of first
        place. A value that does not open is logged and left as it is (the key may come back);
        a lost race is left to whoever won it. Returns how many were re-sealed."""
        sealer = self.secrets.codec.envelope
        assert isinstance(sealer, Sealer)
        done = 0
        for key, (data, revision) in sorted((await live_entries(self.secrets.kv)).items()):
            if not data or sealer.is_current(data):
                continue
            was = "sealed with an older key" if sealer.is_sealed(data) else "stored unsealed"
            try:
                value = self.secrets.decode(key, data)
                await self.secrets.put(key, value, revision=revision)
            except BadValue as exc:
                log.error("cannot re-seal: %s", exc)
                continue
            except CasLost:
                continue  # written meanwhile, by a manager that seals it
            log.info("%s/%s was %s: re-sealed with key %s", KV_SECRETS, key, was, sealer.keys.ids[0])
            done += 1
        return done
