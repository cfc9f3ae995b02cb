"""A tenant's fair-share settings (issue 26) through the real manager over NATS: `tessera tenant
create --borrow-gpus/--weight` reaches the ``tenants`` record placement reads, `tessera tenant get`
and `list` show what it is guaranteed, what its claims hold in the ledger and how much of that is
borrowed, and a borrowing limit without a quota to borrow beyond is refused saying so."""

from __future__ import annotations

import msgspec

from tessera.shared import subjects
from tessera.shared.events import DeviceShare, GpuQuota, LedgerEntry, NodeLedger, TenantRecord
from tessera.shared.ledger import Ledger

from kit import eventually
from test_cli_tenant import parse, served  # noqa: F401 - a fixture


async def _record(bus, name: str) -> TenantRecord | None:
    try:
        entry = await (await bus.kv(subjects.KV_TENANTS)).get(name)
    except Exception:
        return None
    return msgspec.json.decode(entry.value, type=TenantRecord) if entry and entry.value else None


async def test_borrowing_reaches_placement_and_the_tenant_shows_guaranteed_borrowed_and_in_use(
        served, bus, capsys):  # noqa: F811
    url = served
    args = parse("tenant", "create", "beta", "--gpus", "2", "--borrow-gpus", "2", "--weight", "3", "--nats", url)
    assert await args.func(args) == 0
    capsys.readouterr()

    async def published() -> bool:
        record = await _record(bus, "beta")
        return record is not None and (record.quota, record.borrowing_limit, record.weight) == (
            GpuQuota(gpus=2), GpuQuota(gpus=2), 3)

    await eventually(published, what="beta's borrowing limit and weight in the tenants bucket")

    # Three of its claims in a node's ledger, as placement commits them: one beyond its guarantee.
    entries = {f"c{i}": LedgerEntry(claim=f"c{i}", tenant="beta", borrowing=i == 2,
                                    shares=[DeviceShare(uuid=f"GPU-{i}", index=i, memory_mib=1000, cores=10)])
               for i in range(3)}
    await Ledger(await bus.kv(subjects.KV_LEDGER)).write_node(NodeLedger(node="n1", entries=entries), None)

    args = parse("tenant", "get", "beta", "--nats", url)
    assert await args.func(args) == 0
    shown = capsys.readouterr().out.splitlines()
    assert "GPU quota        gpus=2 memory_mib=- cores=- (guaranteed)" in shown, shown
    assert "Borrowing limit  gpus=2 memory_mib=- cores=- beyond the quota, weight 3" in shown, shown
    assert "In use           gpus=3 memory_mib=3000 cores=30" in shown, shown
    assert "Borrowed         gpus=1 memory_mib=0 cores=0 (beyond the guarantee)" in shown, shown

    args = parse("tenant", "list", "--nats", url)
    assert await args.func(args) == 0
    header, row = capsys.readouterr().out.splitlines()[:2]
    assert header.split()[-3:] == ["IN", "USE", "BORROWED"], header
    assert row.split()[0] == "beta" and row.split()[-2:] == ["3/3000/30", "1/0/0"], row


async def test_a_borrowing_limit_without_a_quota_is_refused_saying_why(served, capsys):  # noqa: F811
    args = parse("tenant", "create", "gamma", "--borrow-gpus", "1", "--nats", served)
    assert await args.func(args) != 0
    err = capsys.readouterr().err
    assert "[spec.quota.borrowingLimit]" in err and "a borrowing limit needs a quota to borrow beyond" in err, err
