"""Tables that make the state of the fleet visible: GPUs with their slices per tenant, and claims.

Each GPU row shows a bar of its memory, one colour per tenant, so fragmentation and who holds what
are visible at a glance; the summary line gives allocated versus total per model.
"""

from __future__ import annotations

from collections import defaultdict

from rich.table import Table
from rich.text import Text

from tessera.cli.client import FleetState
from tessera.shared.inventory import is_lost

PALETTE = ["cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta"]
BAR = 24


def tenant_colours(state: FleetState) -> dict[str, str]:
    tenants = sorted({c.tenant for c in state.claims.values()})
    return {t: PALETTE[i % len(PALETTE)] for i, t in enumerate(tenants)}


def gpu_table(state: FleetState, *, title: str = "Tessera fleet") -> Table:
    colours = tenant_colours(state)
    table = Table(title=title, title_justify="left", expand=False)
    for col, kw in (("node", {}), ("gpu", {"justify": "right"}), ("model", {}), ("memory (per tenant)", {}),
                    ("used/total MiB", {"justify": "right"}), ("cores", {"justify": "right"}), ("slices", {})):
        table.add_column(col, **kw)
    for node in sorted(state.inventories):
        inv = state.inventories[node]
        lost = is_lost(inv)
        ledger = state.ledgers.get(node)
        per_gpu: dict[str, list] = defaultdict(list)
        if ledger:
            for entry in ledger.entries.values():
                for share in entry.shares:
                    per_gpu[share.uuid].append((entry.tenant, entry.claim, share))
        for dev in inv.devices:
            slices = per_gpu.get(dev.uuid, [])
            bar = Text()
            used = 0
            for tenant, _, share in slices:
                width = max(1, round(BAR * share.memory_mib / dev.memory_mib))
                bar.append("█" * width, style=colours.get(tenant, "white"))
                used += share.memory_mib
            bar.append("·" * max(0, BAR - len(bar.plain)), style="dim")
            cores = sum(s.cores for _, _, s in slices)
            names = ", ".join(f"{t}:{c[-6:]}" for t, c, _ in slices) or "-"
            table.add_row(
                Text(node + (" (lost)" if lost else ""), style="red" if lost else ""),
                str(dev.index), dev.model, bar, f"{used}/{dev.memory_mib}", f"{cores}%", names,
            )
    return table


def summary(state: FleetState) -> str:
    total = sum(d.memory_mib for inv in state.inventories.values() for d in inv.devices)
    used = sum(s.memory_mib for lg in state.ledgers.values() for e in lg.entries.values() for s in e.shares)
    by_state: dict[str, int] = defaultdict(int)
    for c in state.claims.values():
        by_state[c.state] += 1
    gpus = sum(len(inv.devices) for inv in state.inventories.values())
    states = ", ".join(f"{k} {v}" for k, v in sorted(by_state.items())) or "no claims"
    pct = 100 * used / total if total else 0
    return f"{len(state.inventories)} nodes, {gpus} GPUs, memory allocated {used}/{total} MiB ({pct:.1f}%); claims: {states}"


def claims_table(state: FleetState) -> Table:
    colours = tenant_colours(state)
    table = Table(title="claims", title_justify="left")
    for col in ("claim", "tenant", "state", "node", "GPUs", "memory/GPU", "cores", "reason"):
        table.add_column(col)
    for c in sorted(state.claims.values(), key=lambda c: c.updated):
        mem = c.devices[0].memory_mib if c.devices else (c.spec.memory_mib or (f"{c.spec.memory_percent}%" if c.spec.memory_percent else "card"))
        table.add_row(c.claim, Text(c.tenant, style=colours.get(c.tenant, "")), c.state, c.node or "-",
                      str(c.spec.gpus), str(mem), f"{c.spec.cores}%", c.reason[:60])
    return table
