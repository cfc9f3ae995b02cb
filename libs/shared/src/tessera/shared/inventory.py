"""The ``inventory`` and ``tenants`` buckets as typed stores: what each node offers, who may claim.

Both are read by several services, and each used to carry its own decoder and its own spelling of
the lost-node marker. Here the marker is one definition (`LOST_LABEL`, `is_lost`, `with_lost`), and
the tenant directory separates "this tenant does not exist" from "the bucket could not be read":
only the first may turn a claim away.
"""

from __future__ import annotations

from tessera.shared.bus import KeyValue
from tessera.shared.errors import TemporaryError
from tessera.shared.events import NodeInventory, TenantRecord
from tessera.shared.kv import Bucket, Stored

# Set to "true" by the capacity publisher when a node's heartbeats stop; placement stops using the
# node and the enforcers release what it held.
LOST_LABEL = "tessera.dev/lost"


def is_lost(inventory: NodeInventory) -> bool:
    return inventory.labels.get(LOST_LABEL) == "true"


def with_lost(labels: dict[str, str], lost: bool) -> dict[str, str]:
    """``labels`` with the lost marker set (``lost``) or removed."""
    kept = {k: v for k, v in labels.items() if k != LOST_LABEL}
    return {**kept, LOST_LABEL: "true"} if lost else kept


class InventoryStore:
    """node -> NodeInventory."""

    def __init__(self, kv: KeyValue) -> None:
        self.bucket: Bucket[NodeInventory] = Bucket(kv, NodeInventory, "inventory")

    async def get(self, node: str) -> Stored[NodeInventory] | None:
        return await self.bucket.get(node)

    async def all(self) -> dict[str, NodeInventory]:
        """Every node's inventory (a malformed record is logged and skipped, not raised)."""
        return {key: s.value for key, s in (await self.bucket.items()).items()}

    def decode_or_skip(self, key: str, data: bytes) -> NodeInventory | None:
        return self.bucket.decode_or_skip(key, data)


class TenantDirectory:
    """tenant -> TenantRecord (the quota the control-plane manager granted)."""

    def __init__(self, kv: KeyValue) -> None:
        self.bucket: Bucket[TenantRecord] = Bucket(kv, TenantRecord, "tenants")

    async def lookup(self, tenant: str) -> TenantRecord | None:
        """The tenant's record; None only if the tenant does not exist. An I/O failure is a
        TemporaryError (retry later), never an answer about the tenant."""
        try:
            stored = await self.bucket.get(tenant)
        except TemporaryError:
            raise
        except (OSError, TimeoutError) as exc:
            raise TemporaryError(f"cannot read tenant {tenant!r} from the tenants bucket: {exc!r}") from exc
        except Exception as exc:
            if type(exc).__module__.startswith("nats"):
                raise TemporaryError(f"cannot read tenant {tenant!r} from the tenants bucket: {exc!r}") from exc
            raise
        return stored.value if stored else None

    async def exists(self, tenant: str) -> bool:
        return await self.lookup(tenant) is not None

    def decode_or_skip(self, key: str, data: bytes) -> TenantRecord | None:
        return self.bucket.decode_or_skip(key, data)
