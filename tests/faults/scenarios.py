"""The fault scenarios, each run the same way, and the figures one row of bench/reliability.md holds.

One run: a fresh ``FaultCluster``, the auditor watching from before the first claim, ``Load`` for a
warm-up, then the fault *during* the load. New submits stop at the fault (claims in flight go on
to their end), the auditor passes until one is clean: the time from the fault to that pass is the
time to recover. Then load again for a while, to show the system still works after the fault, and
a final audit over every claim of the run, with the kept claims released at the very end.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from tessera.shared import subjects
from tessera.shared.events import ClaimReleaseRequested, ClaimRequested, ClaimSpec

from auditor import Auditor, Findings
from loadgen import ACK_WAIT_SECONDS, TENANTS, FaultCluster, Load, connect, profile_path


@dataclass
class Row:
    scenario: str
    sent: int = 0
    accepted: int = 0
    completed: int = 0
    lost: int = 0
    duplicated: int = 0
    overcommitted: int = 0
    recover_seconds: float | None = None
    revisions: int = 0  # ledger revisions the auditor checked
    dead_letters: int = 0
    preempted: int = 0  # claims released for higher-priority ones (a priority mix, preemption on)
    findings: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.findings


@dataclass(frozen=True)
class Form:
    """How long each phase lasts: the short form runs in `make test`, the long in `make reliability`."""

    warmup: float
    after: float
    recover_timeout: float

    @classmethod
    def short(cls) -> "Form":
        return cls(warmup=3.0, after=2.0, recover_timeout=45.0)

    @classmethod
    def long(cls) -> "Form":
        return cls(warmup=12.0, after=10.0, recover_timeout=90.0)


# --- the faults: each receives the cluster and the auditor's extras, returns after its recovery ---

async def kill_and_restart(cluster: FaultCluster, instance: str) -> None:
    cluster.kill(instance)
    await asyncio.sleep(1.0)
    cluster.restart(instance)


async def kill_nats(cluster: FaultCluster, _ctx) -> None:
    cluster.nats.kill()
    await asyncio.sleep(1.0)
    await asyncio.to_thread(cluster.nats.start)


async def stall_placement(cluster: FaultCluster, _ctx) -> None:
    """SIGSTOP one placement replica for longer than ack_wait: its peer gets its messages."""
    cluster.pause("placement-0")
    await asyncio.sleep(ACK_WAIT_SECONDS + 2.0)
    cluster.resume("placement-0")


async def lose_kv_replies(cluster: FaultCluster, ctx) -> None:
    """Placement's next ledger write reaches the server and commits, but its reply (and everything
    after it) never comes back; two seconds later its connections drop and it reconnects."""
    cluster.proxy.drop_replies_after(b"$KV.ledger.node.")
    if not await asyncio.to_thread(cluster.proxy.triggered.wait, 20):
        raise RuntimeError("placement wrote no ledger entry in 20 s: the load did not reach it")
    ctx["struck"].set()
    await asyncio.sleep(2.0)
    cluster.proxy.cut()
    cluster.proxy.passthrough()


async def bad_events(cluster: FaultCluster, ctx) -> None:
    """Duplicate, reordered and malformed events on every subject a tenant may publish on."""
    bus = ctx["client"].bus
    load: Load = ctx["load"]
    records = [r for r in (await ctx["client"].fleet()).claims.values() if r.claim in load.accepted]

    async def publish(subject: str, payload: bytes) -> None:
        await bus.publish_bytes(subject, payload, headers={"Nats-Msg-Id": uuid.uuid4().hex})

    for record in records[:6]:  # duplicates: the same request again under new message ids
        again = ClaimRequested(claim=record.claim, tenant=record.tenant, spec=record.spec, source="api")
        for _ in range(2):
            await publish(subjects.claim(record.tenant, record.claim, "requested"), msgspec.json.encode(again))
        release = ClaimReleaseRequested(claim=record.claim, tenant=record.tenant, reason="duplicate")
        if load.accepted[record.claim].release_requested:
            await publish(subjects.claim(record.tenant, record.claim, "release"), msgspec.json.encode(release))
    for i, tenant in enumerate(TENANTS):  # reordered: the release before the request, of no claim
        claim = f"reorder-{i}-{uuid.uuid4().hex[:6]}"
        await publish(subjects.claim(tenant, claim, "release"),
                      msgspec.json.encode(ClaimReleaseRequested(claim=claim, tenant=tenant)))
        ctx["unrecorded"].add(claim)
    for tenant in TENANTS:  # a tenant releasing another tenant's claim through its own subject
        other = next((r for r in records if r.tenant != tenant), None)
        if other is not None:
            await publish(subjects.claim(tenant, other.claim, "release"),
                          msgspec.json.encode(ClaimReleaseRequested(claim=other.claim, tenant=other.tenant)))
    malformed = [b"not json", b"{}", b'{"kind":"requested"}', b'{"kind":"nonsense","claim":"x"}',
                 b'{"kind":"requested","claim":"Bad Id","tenant":"alpha","spec":{}}',
                 b'{"kind":"requested","claim":"x","tenant":"alpha","spec":{"gpus":0}}',
                 b'{"kind":"release","claim":7}', b"\xff\xfe\x00"]
    for tenant in TENANTS:
        for n, payload in enumerate(malformed):
            for event in ("requested", "release"):
                subject = subjects.claim(tenant, f"bad-{n}-{uuid.uuid4().hex[:6]}", event)
                await publish(subject, payload)
                ctx["expected_letters"].add(subject)
    spec = ClaimSpec(memory_mib=1000)
    for tenant in TENANTS:  # a request whose payload names another tenant than its subject
        other = next(t for t in TENANTS if t != tenant)
        claim = f"forged-{uuid.uuid4().hex[:6]}"
        await publish(subjects.claim(tenant, claim, "requested"),
                      msgspec.json.encode(ClaimRequested(claim=claim, tenant=other, spec=spec)))
        ctx["unrecorded"].add(claim)


def _killer(instance: str):
    async def fault(cluster: FaultCluster, _ctx) -> None:
        await kill_and_restart(cluster, instance)
    return fault


SCENARIOS = {
    "kill-controlplane": _killer("controlplane"),
    "kill-capacity": _killer("capacity"),
    "kill-translator": _killer("translator"),
    "kill-placement-replica": _killer("placement-0"),
    "kill-enforcer": _killer("enforcer-gpu-0"),
    "kill-nats": kill_nats,
    "placement-past-ack-wait": stall_placement,
    "bad-events": bad_events,
    "lost-kv-reply": lose_kv_replies,
}


# Faults that wait for the right moment under load (and say when it came through ctx["struck"]).
STRIKE_LATER = {"lost-kv-reply"}


def _figures(row: Row, load: Load, findings: Findings) -> None:
    row.sent = load.tally.sent
    row.accepted = len(load.accepted)
    row.completed = findings.completed
    row.preempted = len(findings.preempted)
    row.lost = len(findings.lost) + len(load.tally.unconfirmed)
    row.duplicated = findings.duplicated_total
    row.overcommitted = findings.overcommitted_total
    row.findings = findings.lines() + [f"lost: {c}: submit never answered" for c in load.tally.unconfirmed] \
        + [f"api: {x}" for x in load.tally.accepted_invalid]


async def run(name: str, workdir: Path, form: Form, seed: int = 1, high: float = 0.0) -> Row:
    """One scenario from a fresh cluster to its final audit; ``high``: that share of the load's
    claims has a high scheduling priority, and placement preempts (``TESSERA_PLACEMENT_PREEMPTION``)."""
    cluster = FaultCluster(workdir=workdir, profile=profile_path(),
                           extra_env={"TESSERA_PLACEMENT_PREEMPTION": "true"} if high else {})
    row = Row(name)
    await asyncio.to_thread(cluster.start)
    try:
        await asyncio.to_thread(cluster.wait_ready, 90)
        client = await connect(cluster.url)
        auditor = await Auditor.start(cluster.url)
        try:
            load = Load(client, seed=seed, high=high)
            await load.setup()
            await auditor.refresh_reference()
            ctx = {"client": client, "load": load, "expected_letters": set(), "unrecorded": set(),
                   "struck": asyncio.Event()}
            load.start()
            await asyncio.sleep(form.warmup)
            fault = asyncio.create_task(SCENARIOS[name](cluster, ctx))
            if name not in STRIKE_LATER:
                ctx["struck"].set()
            await asyncio.wait([fault, asyncio.ensure_future(ctx["struck"].wait())],
                               return_when=asyncio.FIRST_COMPLETED)
            loop_fault = asyncio.get_running_loop().time()
            await load.pause()
            await fault
            await load.drain()
            findings, clean_at = await auditor.until_clean(load.accepted, form.recover_timeout, ctx["expected_letters"])
            row.recover_seconds = None if clean_at is None else clean_at - loop_fault
            if clean_at is not None:  # the system still works after the fault
                load.start()
                await asyncio.sleep(form.after)
                await load.pause()
                await load.drain()
                await load.release_kept()
                findings, _ = await auditor.until_clean(load.accepted, form.recover_timeout, ctx["expected_letters"])
            _figures(row, load, findings)
            row.revisions = auditor.ledger.revisions
            row.dead_letters = len(auditor.letters.letters)
            dead = [sp.name for sp in cluster.dead()]
            if dead:
                row.findings.append(f"processes not running at the end: {dead}")
        finally:
            await auditor.close()
            await client.close()
    finally:
        await asyncio.to_thread(cluster.stop)
    return row


def table(rows: list[Row]) -> str:
    lines = ["| scenario | claims sent | accepted | completed | lost | duplicated | over-committed | time to recover | ledger revisions checked | dead letters |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        recover = "never (within the limit)" if r.recover_seconds is None else f"{r.recover_seconds:.1f} s"
        lines.append(f"| {r.scenario} | {r.sent} | {r.accepted} | {r.completed} | {r.lost} | {r.duplicated}"
                     f" | {r.overcommitted} | {recover} | {r.revisions} | {r.dead_letters} |")
    return "\n".join(lines)
