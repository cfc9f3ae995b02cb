"""The enforcer finishes what a stop left half done, and never acts on a guess (issue 12, windows 4, 7, 8).

The real EnforcerService in this test's event loop against a real nats-server, its buckets filled
the way placement and the translator leave them, and the crash played by a step that fails: the
next pass (reconcile, janitor, lost-node check) must finish the job, or leave what it cannot know.
"""

from __future__ import annotations

import asyncio

import pytest

from tessera.shared import subjects
from tessera.shared.bus import Bus
from tessera.shared.errors import TemporaryError
from tessera.shared.events import (
    ClaimAllocated,
    ClaimRecord,
    ClaimSpec,
    DeviceShare,
    GpuDevice,
    GpuQuota,
    LedgerEntry,
    NodeInventory,
    NodeLedger,
    claim_decoder,
    encode,
)
from tessera.shared.cancelling import cancel_and_wait
from tessera.shared.runner import ServiceContext
from tessera.shared.settings import BusSettings, ServiceSettings
from tessera.shared.telemetry import Telemetry

from tessera.enforcer.service import EnforcerService
from tessera.enforcer.settings import EnforcerSettings

from kit import eventually

GPU = GpuDevice(uuid="GPU-n1-0", index=0, model="sim", memory_mib=16000)
SHARE = DeviceShare(uuid=GPU.uuid, index=0, memory_mib=1000, cores=10)


@pytest.fixture
async def enforcer(nats_url, tmp_path):
    bus = await Bus.connect(BusSettings(url=nats_url), "enforcer")
    await bus.ensure_topology()
    ctx = ServiceContext(settings=ServiceSettings(service="enforcer", bus=BusSettings(url=nats_url)),
                         bus=bus, telemetry=Telemetry("enforcer", None))
    settings = EnforcerSettings(node="n1", state_dir=tmp_path / "state", cdi_dir=tmp_path / "cdi",
                                libvgpu=str(tmp_path / "libvgpu.so"), sim_driver_dir=str(tmp_path),
                                reclaim_seconds=0.05, lost_reclaim_seconds=0.05)
    service = EnforcerService(ctx, settings)
    await service.open()
    for node, labels in (("n1", {}), ("n2", {"tessera.dev/lost": "true"})):
        await (await bus.kv(subjects.KV_INVENTORY)).put(
            node, encode(NodeInventory(node=node, devices=[GPU], labels=labels)))
    yield service
    await bus.close()


def record(claim: str, state: str, node: str = "n1") -> ClaimRecord:
    return ClaimRecord(claim=claim, tenant="alpha", state=state, spec=ClaimSpec(memory_mib=1000),
                       node=node, devices=[SHARE])


async def hold(service: EnforcerService, claim: str, node: str = "n1") -> None:
    """What placement leaves for a placed claim: its ledger entry and the tenant's quota charge."""
    ledger, revision = await service.ledger.read_node(node)
    entries = dict(ledger.entries)
    entries[claim] = LedgerEntry(claim=claim, tenant="alpha", shares=[SHARE])
    await service.ledger.write_node(NodeLedger(node=node, entries=entries), revision)
    usage, revision = await service.ledger.read_tenant("alpha")
    await service.ledger.reserve_quota("alpha", claim, GpuQuota(gpus=1, memory_mib=1000), usage, revision)


async def events(service: EnforcerService, kind: str) -> list:
    info = await service.bus.stream_info(subjects.STREAM_CLAIMS)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1) if info.state.messages else ():
        msg = await service.bus.stored_message(subjects.STREAM_CLAIMS, seq)
        if subjects.event_name(msg.subject) == kind:
            out.append(claim_decoder.decode(msg.data))
    return out


async def test_restart_publishes_prepared_that_the_last_run_never_sent(enforcer):
    """Window 7: the record moved to ``prepared``, the enforcer stopped before publishing it."""
    await hold(enforcer, "c-p")
    await enforcer.claims.create(record("c-p", "allocated"))
    enforcer.preparation.materialize("c-p", [SHARE], {GPU.uuid: GPU})
    await enforcer.claims.transition("c-p", "prepared")  # ... and the process died here

    await enforcer.reconcile()  # the restart
    prepared = await events(enforcer, "prepared")
    assert [e.claim for e in prepared] == ["c-p"]
    await enforcer.reconcile()  # a later periodic pass publishes nothing more
    assert len(await events(enforcer, "prepared")) == 1


async def test_janitor_keeps_the_ledger_entry_of_a_claim_still_being_placed(enforcer):
    """Window 4: placement wrote the ledger, then stopped before the record said ``allocated``."""
    await hold(enforcer, "c-l")
    await enforcer.claims.create(record("c-l", "requested", node=""))
    for _ in range(3):
        await enforcer.observe_once()
        await asyncio.sleep(0.1)  # past reclaim_seconds
    ledger, _ = await enforcer.ledger.read_node("n1")
    assert "c-l" in ledger.entries
    usage, _ = await enforcer.ledger.read_tenant("alpha")
    assert "c-l" in usage.claims


async def test_janitor_drops_the_entry_of_a_claim_that_is_over(enforcer):
    await hold(enforcer, "c-f")
    await enforcer.claims.create(record("c-f", "failed"))
    await enforcer.observe_once()
    ledger, _ = await enforcer.ledger.read_node("n1")
    assert "c-f" not in ledger.entries
    assert "c-f" not in (await enforcer.ledger.read_tenant("alpha"))[0].claims


async def test_prepare_refuses_a_claim_the_ledger_does_not_hold(enforcer):
    """Window 4, the other half: an ``allocated`` record written from memory after its ledger
    entry was dropped must not be prepared on GPUs nobody holds for it."""
    await enforcer.claims.create(record("c-x", "allocated"))
    event = ClaimAllocated(claim="c-x", tenant="alpha", node="n1", devices=[SHARE])
    with pytest.raises(TemporaryError, match="holds no entry"):
        await enforcer.handle(event, None)
    assert (await enforcer.claims.get("c-x"))[0].state == "allocated"
    assert not enforcer.preparation.present("c-x")

    await hold(enforcer, "c-x")  # placement's reconciler puts the entry back: now it is prepared
    await enforcer.handle(event, None)
    assert (await enforcer.claims.get("c-x"))[0].state == "prepared"


class Crash(Exception):
    pass


@pytest.mark.parametrize("dies_at", [2, 3, 4])
async def test_lost_node_release_stopped_half_way_is_finished_by_the_next_check(enforcer, monkeypatch, dies_at):
    """Window 8: the releaser of a lost node's claim dies at its ``dies_at``-th write (quota,
    ledger entry, record, event: whatever order it takes them in)."""
    await hold(enforcer, "c-n", node="n2")
    await enforcer.claims.create(record("c-n", "prepared", node="n2"))
    await enforcer.release_lost_once()  # first sight of the mark starts the clock
    await asyncio.sleep(0.1)

    writes = {"n": 0}
    steps = [(enforcer.ledger, "release"), (enforcer.ledger, "return_quota"),
             (enforcer.claims, "transition"), (enforcer.bus, "publish")]

    def dying(real):
        async def step(*args, **kwargs):
            writes["n"] += 1
            if writes["n"] == dies_at:
                raise Crash("killed")
            return await real(*args, **kwargs)
        return step

    for owner, name in steps:
        monkeypatch.setattr(owner, name, dying(getattr(owner, name)))
    with pytest.raises(Crash):
        await enforcer.release_lost_once()
    monkeypatch.undo()

    await enforcer.release_lost_once()  # the restarted (or next) check
    assert (await enforcer.claims.get("c-n"))[0].state == "released"
    assert "c-n" not in (await enforcer.ledger.read_node("n2"))[0].entries
    assert "c-n" not in (await enforcer.ledger.read_tenant("alpha"))[0].claims
    assert [e.claim for e in await events(enforcer, "released")] == ["c-n"]


async def test_reconcile_goes_on_past_a_claim_it_cannot_prepare_yet(enforcer):
    """A claim refused for want of a ledger entry must not stop the pass (nor the consumer that
    runs it first) from preparing the others."""
    await enforcer.claims.create(record("c-a", "allocated"))  # no ledger entry
    await hold(enforcer, "c-b")
    await enforcer.claims.create(record("c-b", "allocated"))
    await enforcer.reconcile()
    assert (await enforcer.claims.get("c-a"))[0].state == "allocated"
    assert (await enforcer.claims.get("c-b"))[0].state == "prepared"


async def test_the_reconcile_pass_runs_periodically_not_only_at_start(enforcer, tmp_path):
    """A ``prepared`` record whose event went missing while the enforcer was up (the publish
    timed out after the record moved) is announced by a later pass, without a restart."""
    import dataclasses

    enforcer.settings = dataclasses.replace(enforcer.settings, reconcile_seconds=0.05)
    loop = asyncio.create_task(enforcer._reconcile_loop())
    try:
        await asyncio.sleep(0.2)  # a few passes with nothing to do
        await hold(enforcer, "c-late")
        enforcer.preparation.materialize("c-late", [SHARE], {GPU.uuid: GPU})
        await enforcer.claims.create(record("c-late", "prepared"))
        await eventually(lambda: events(enforcer, "prepared"), timeout=20, every=0.05)
    finally:
        await cancel_and_wait([loop])
    assert [e.claim for e in await events(enforcer, "prepared")] == ["c-late"]
