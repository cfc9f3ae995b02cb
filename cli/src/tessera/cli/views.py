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


# --- the fleet document (tessera.cli.fleetmodel), as `tessera status` and `tessera top` show it ---


def _colours_of(snapshot: dict) -> dict[str, str]:
    tenants = [t["tenant"] for t in snapshot["tenants"]]
    return {t: PALETTE[i % len(PALETTE)] for i, t in enumerate(tenants)}


def fleet_table(snapshot: dict, *, title: str = "Tessera fleet") -> Table:
    """One row per GPU: a memory bar coloured by tenant (allocated; a lighter block where the
    slice's workload uses it), used/allocated/total, cores, and the node's fragmentation."""
    colours = _colours_of(snapshot)
    table = Table(title=title, title_justify="left", expand=False)
    for col, kw in (("node", {}), ("frag", {"justify": "right"}), ("gpu", {"justify": "right"}), ("model", {}),
                    ("memory: allocated (█) / used (▓)", {}), ("used/alloc/total MiB", {"justify": "right"}),
                    ("cores", {"justify": "right"}), ("slices", {})):
        table.add_column(col, **kw)
    for node in snapshot["nodes"]:
        first = True
        for gpu in node["gpus"]:
            bar = Text()
            for s in gpu["slices"]:
                width = max(1, round(BAR * s["memory_mib"] / gpu["memory_mib"]))
                used = min(width, round(BAR * s["used_mib"] / gpu["memory_mib"]))
                style = colours.get(s["tenant"], "white")
                bar.append("▓" * used, style=f"bold {style}")
                bar.append("█" * (width - used), style=style)
            bar.append("·" * max(0, BAR - len(bar.plain)), style="dim")
            name = Text(node["node"] + (" (lost)" if node["lost"] else ""), style="red" if node["lost"] else "")
            frag = f"{node['fragmentation']:.2f}" if first else ""
            names = ", ".join(f"{s['tenant']}:{s['claim'][-6:]}" for s in gpu["slices"]) or "-"
            table.add_row(name if first else "", frag, str(gpu["index"]), gpu["model"], bar,
                          f"{gpu['used_mib']:.0f}/{gpu['allocated_mib']}/{gpu['memory_mib']}",
                          f"{gpu['cores_allocated']}%", names)
            first = False
    return table


def tenants_table(snapshot: dict) -> Table:
    colours = _colours_of(snapshot)
    table = Table(title="tenants: quota use", title_justify="left")
    for col in ("tenant", "phase", "GPUs", "memory MiB", "cores", "claims"):
        table.add_column(col)

    def use(t: dict, k: str) -> str:
        q = t["quota"].get(k)
        return f"{t['used'][k]}/{'∞' if q is None else q}"

    for t in snapshot["tenants"]:
        claims = ", ".join(f"{k} {v}" for k, v in sorted(t["claims"].items())) or "-"
        table.add_row(Text(t["tenant"], style=colours.get(t["tenant"], "")), t["phase"] or "-",
                      use(t, "gpus"), use(t, "memory_mib"), use(t, "cores"), claims)
    return table


def snapshot_summary(snapshot: dict) -> str:
    tot = snapshot["totals"]
    states = ", ".join(f"{k} {v}" for k, v in snapshot["claims"]["by_state"].items() if v) or "no claims"
    pct = 100 * tot["allocated_mib"] / tot["memory_mib"] if tot["memory_mib"] else 0
    return (f"{tot['nodes']} nodes, {tot['gpus']} GPUs; memory allocated {tot['allocated_mib']}/{tot['memory_mib']} MiB "
            f"({pct:.1f}%), used {tot['used_mib']:.0f} MiB; fragmentation {tot['fragmentation']:.2f} of "
            f"{tot['free_gpu_units']:.2f} free GPU units ({snapshot['mix']} mix); claims: {states}")
