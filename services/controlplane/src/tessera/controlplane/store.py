"""Desired and observed tenant state, kept in JetStream KV so that the manager remembers nothing.

Two buckets belong to the manager: ``controlplanes`` (tenant -> TenantControlPlane: spec + status)
and ``controlplane-secrets`` (tenant -> the PKI bundle and datastore credentials). The public
``tenants`` bucket (tenant -> TenantRecord, read by placement for quotas) is written from them.
Every write is a compare-and-set on the revision read, so two manager replicas cannot overwrite
each other's decisions; a lost race surfaces as ConflictError (`tessera.shared.kv.CasLost`).
"""

from __future__ import annotations

from tessera.controlplane.credentials import TenantSecrets
from tessera.controlplane.spec import TenantControlPlane
from tessera.shared import subjects
from tessera.shared.bus import Bus
from tessera.shared.events import TenantRecord
from tessera.shared.kv import Bucket, Stored

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
    async def open(cls, bus: Bus) -> "TenantStore":
        return cls(
            Bucket(await bus.kv(KV_CONTROLPLANES), TenantControlPlane, KV_CONTROLPLANES),
            Bucket(await bus.kv(KV_SECRETS), TenantSecrets, KV_SECRETS),
            Bucket(await bus.kv(subjects.KV_TENANTS), TenantRecord, subjects.KV_TENANTS),
        )
