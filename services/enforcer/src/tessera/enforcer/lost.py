"""Releasing the claims of a node that lost its enforcer.

A lost node cannot release anything itself, so its peers do. The capacity publisher marks a node
lost (inventory label ``tessera.dev/lost=true``) when its heartbeats stop. Each claim in the lost
node's ledger gets one designated releaser, chosen by rendezvous hashing over the enforcers' nodes
that are not lost: the designated one releases it ``delay`` seconds after it first saw the mark,
every other one after twice that, in case the designated one is gone too. Releasing twice is
harmless (compare-and-set ledger, state machine, ``Nats-Msg-Id``), so the second wave costs a
few reads, never a double release. A node that comes back before the delay loses nothing.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field

import msgspec

from tessera.shared.events import NodeInventory
from tessera.shared.kvkeys import live_values
from tessera.shared.inventory import LOST_LABEL, is_lost  # noqa: F401 - LOST_LABEL: the enforcer service reads it here

log = logging.getLogger("tessera.enforcer.lost")

_inventory = msgspec.json.Decoder(NodeInventory)


def designated(claim: str, nodes: list[str]) -> str | None:
    """Rendezvous (highest random weight) choice: stable, and spreads claims across peers."""
    if not nodes:
        return None
    return max(nodes, key=lambda n: hashlib.sha256(f"{claim}/{n}".encode()).digest())


async def read_inventory(kv) -> dict[str, NodeInventory]:
    # (one bad record must not stop the others from being checked)
    return await live_values(kv, _inventory,
                             lambda key, exc: log.warning("inventory record %s unreadable: %s", key, exc))


@dataclass
class LostNodes:
    me: str
    delay: float
    since: dict[str, float] = field(default_factory=dict)  # lost node -> when we first saw the mark

    def due(self, inventory: dict[str, NodeInventory], ledgers: dict[str, list[str]], now: float | None = None) -> list[tuple[str, str]]:
        """(node, claim) pairs this enforcer should release now; ``ledgers``: node -> its claims."""
        now = time.monotonic() if now is None else now
        lost = {n for n, inv in inventory.items() if is_lost(inv)}
        for node in list(self.since):
            if node not in lost:
                del self.since[node]
        live = sorted(n for n in inventory if n not in lost)
        out = []
        for node in sorted(lost):
            if node == self.me:
                continue  # our own node marked lost: a peer releases; our janitor fences the workloads
            waited = now - self.since.setdefault(node, now)
            for claim in ledgers.get(node, []):
                wait = self.delay if designated(claim, live) == self.me else 2 * self.delay
                if waited >= wait:
                    out.append((node, claim))
        return out
