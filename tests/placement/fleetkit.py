"""Builders for the placement engine's tests: small fleets described in one line per node."""

from __future__ import annotations

import pytest

from tessera.placement.engine import Placement, Placer, Rejection, ledger_entry
from tessera.placement.fleet import Fleet
from tessera.shared.events import ClaimSpec, GpuDevice, NodeInventory


def inventory(name: str, gpus: int = 4, model: str = "NVIDIA A100-SXM4-80GB", memory_mib: int = 81920,
              cpu_millis: int = 64000, host_memory_mib: int = 262144, max_shares: int = 10,
              unhealthy: tuple[int, ...] = ()) -> NodeInventory:
    return NodeInventory(
        node=name,
        devices=[GpuDevice(uuid=f"GPU-{name}-{i}", index=i, model=model, memory_mib=memory_mib,
                           max_shares=max_shares, healthy=i not in unhealthy) for i in range(gpus)],
        cpu_millis=cpu_millis, host_memory_mib=host_memory_mib,
    )


class Harness:
    """A fleet, a placer over it, and a `claim` that places and commits like the service does."""

    def __init__(self, *nodes: NodeInventory, **placer_kw) -> None:
        self.fleet = Fleet()
        for n in nodes:
            self.fleet.upsert_node(n)
        placer_kw.setdefault("learn", False)
        self.placer = Placer(self.fleet, **placer_kw)
        self._n = 0

    def place(self, exclude_nodes=(), **spec) -> Placement | Rejection:
        self._n += 1
        return self.placer.place(f"c{self._n}", "team-a", ClaimSpec(**spec), exclude_nodes)

    def claim(self, **spec) -> Placement:
        self._n += 1
        cid = f"c{self._n}"
        s = ClaimSpec(**spec)
        r = self.placer.place(cid, "team-a", s)
        assert isinstance(r, Placement), r
        self.fleet.commit(r.node, ledger_entry(cid, "team-a", s, r))
        return r


@pytest.fixture
def harness():
    return Harness
