"""The auditor: what must hold after any fault, checked from the public subjects and buckets only.

It reads what an outside tool may read (docs/asyncapi.json, the README's subject table): the
``ledger``, ``claims``, ``tenants`` and ``inventory`` buckets, the ``TESSERA_CLAIMS`` and
``TESSERA_DLQ`` streams and the durable consumers' state. It never imports a service.

Two parts:
- ``StreamTail`` follows a stream from its first message with a pull consumer it re-creates at the
  last sequence it saw whenever the server goes away, so a nats-server restart loses nothing it can
  still read. ``LedgerWatch`` runs one over the ledger bucket's stream from the start and checks
  **every revision** for over-commit (a GPU's memory, cores or share count exceeded, an exclusive
  share not alone, a claim on two nodes at once, a tenant above its quota); a revision that the
  bucket's history dropped before it was read is reported as a gap, never silently skipped.
- ``Auditor.audit`` is one pass over the current state against the claims the load generator
  had accepted: each accepted claim reached a final state; none was allocated twice; ledger = live
  claims = quota usage; each record's devices equal its ledger shares; no durable consumer has
  anything pending or unacknowledged; every dead letter has its reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from dataclasses import dataclass, field

import msgspec
import nats
from nats.js import api as jsapi

from tessera.shared import subjects
from tessera.shared.events import (
    ClaimRecord,
    DeadLetter,
    NodeInventory,
    NodeLedger,
    TenantRecord,
    TenantUsage,
    claim_decoder,
    ClaimAllocated,
)
from tessera.shared.cancelling import cancel_and_wait

log = logging.getLogger("faults.auditor")

_record = msgspec.json.Decoder(ClaimRecord)
_node_ledger = msgspec.json.Decoder(NodeLedger)
_tenant_usage = msgspec.json.Decoder(TenantUsage)
_tenant = msgspec.json.Decoder(TenantRecord)
_inventory = msgspec.json.Decoder(NodeInventory)
_letter = msgspec.json.Decoder(DeadLetter)

LIVE = frozenset({"allocated", "prepared", "running"})
# Where a claim may rest once the system has done its part: placed and prepared, refused, or ended.
RESTING = frozenset({"prepared", "running", "unschedulable", "failed", "released"})
ENDED = frozenset({"released", "failed"})


@dataclass
class Accepted:
    """A claim the translator accepted (its submit was answered ok), as the load generator saw it."""

    claim: str
    tenant: str
    release_requested: bool = False
    priority: int = 0  # its scheduling priority (a claim of lower priority may be preempted by it)


@dataclass
class Findings:
    lost: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # released for a higher-priority claim (not a finding)
    duplicated: list[str] = field(default_factory=list)
    overcommitted: list[str] = field(default_factory=list)
    inconsistent: list[str] = field(default_factory=list)
    unsettled_consumers: list[str] = field(default_factory=list)
    dead_letters_without_reason: list[str] = field(default_factory=list)
    # What some past ledger revision did (it stays a finding for good, however the state is now).
    revision_overcommits: list[str] = field(default_factory=list)
    revision_doubles: list[str] = field(default_factory=list)
    completed: int = 0

    @property
    def settled(self) -> bool:
        """The state now is right (the system has recovered), whatever its history."""
        return not (self.lost or self.duplicated or self.overcommitted or self.inconsistent
                    or self.unsettled_consumers or self.dead_letters_without_reason)

    @property
    def clean(self) -> bool:
        return self.settled and not (self.revision_overcommits or self.revision_doubles)

    @property
    def duplicated_total(self) -> int:
        return len(self.duplicated) + len(self.revision_doubles)

    @property
    def overcommitted_total(self) -> int:
        return len(self.overcommitted) + len(self.revision_overcommits)

    def lines(self) -> list[str]:
        out = []
        for name in ("lost", "duplicated", "revision_doubles", "overcommitted", "revision_overcommits",
                     "inconsistent", "unsettled_consumers", "dead_letters_without_reason"):
            for item in getattr(self, name):
                out.append(f"{name}: {item}")
        return out


class StreamTail:
    """Every message of ``stream`` in order, from sequence 1, across server restarts."""

    def __init__(self, nc, stream: str, subject: str, on_message) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=2.0)
        self.stream = stream
        self.subject = subject
        self.on_message = on_message
        self.last_seq = 0
        self.gaps: list[tuple[int, int]] = []
        self._caught_up = asyncio.Event()

    async def run(self) -> None:
        while True:
            sub = None
            try:
                sub = await self.js.pull_subscribe(
                    self.subject, stream=self.stream,
                    config=jsapi.ConsumerConfig(
                        deliver_policy=jsapi.DeliverPolicy.BY_START_SEQUENCE,
                        opt_start_seq=self.last_seq + 1,
                        ack_policy=jsapi.AckPolicy.NONE,
                        mem_storage=True,
                        inactive_threshold=30.0,
                    ),
                )
                while True:
                    try:
                        msgs = await sub.fetch(256, timeout=0.5)
                    except nats.errors.TimeoutError:
                        self._caught_up.set()
                        continue
                    for msg in msgs:
                        seq = msg.metadata.sequence.stream
                        if seq <= self.last_seq:
                            continue
                        if seq > self.last_seq + 1:
                            self.gaps.append((self.last_seq + 1, seq - 1))
                        self.last_seq = seq
                        self.on_message(msg)
                    if msgs and msgs[-1].metadata.num_pending == 0:
                        self._caught_up.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the server went away or the consumer vanished: start again
                log.debug("tail of %s interrupted (%r); resuming after %d", self.stream, exc, self.last_seq)
                # Soon: the bucket keeps a few revisions per key, and the system writes again as
                # soon as a new leader is elected (0.3 s here lost ledger revisions to history in CI).
                await asyncio.sleep(0.02)
            finally:
                if sub is not None:
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()

    async def caught_up(self, timeout: float = 10.0) -> None:
        """Wait until the tail has read up to the stream's last message as of now."""
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            try:
                info = await self.js.stream_info(self.stream)
                if self.last_seq >= info.state.last_seq:
                    return
            except Exception:
                pass
            await asyncio.sleep(0.1)
        raise TimeoutError(f"the tail of {self.stream} is behind after {timeout}s")


def over_commit(ledger: NodeLedger, inventory: NodeInventory | None) -> list[str]:
    """What this one ledger value over-commits on its node's GPUs (empty when it fits)."""
    if inventory is None:
        return []
    gpus = {d.uuid: d for d in inventory.devices}
    memory: dict[str, int] = defaultdict(int)
    cores: dict[str, int] = defaultdict(int)
    shares: dict[str, int] = defaultdict(int)
    exclusive: dict[str, int] = defaultdict(int)
    for entry in ledger.entries.values():
        for share in entry.shares:
            memory[share.uuid] += share.memory_mib
            cores[share.uuid] += share.cores
            shares[share.uuid] += 1
            exclusive[share.uuid] += share.cores >= 100
    problems = []
    for uuid in shares:
        gpu = gpus.get(uuid)
        if gpu is None:
            problems.append(f"{ledger.node}: share on unknown GPU {uuid}")
            continue
        if memory[uuid] > gpu.memory_mib:
            problems.append(f"{ledger.node}/{uuid}: memory {memory[uuid]} > {gpu.memory_mib} MiB")
        if cores[uuid] > 100:
            problems.append(f"{ledger.node}/{uuid}: cores {cores[uuid]}% > 100%")
        if shares[uuid] > gpu.max_shares:
            problems.append(f"{ledger.node}/{uuid}: {shares[uuid]} shares > {gpu.max_shares}")
        if exclusive[uuid] and shares[uuid] > 1:
            problems.append(f"{ledger.node}/{uuid}: an exclusive share is not alone ({shares[uuid]} shares)")
    return problems


class LedgerWatch:
    """Every revision of the ledger bucket, checked as it was written (not only the end state)."""

    def __init__(self, nc, inventories: dict[str, NodeInventory], quotas: dict[str, TenantRecord]) -> None:
        self.inventories = inventories
        self.quotas = quotas
        self.revisions = 0
        self.findings: list[str] = []
        self.doubles: list[str] = []  # a claim in two nodes' ledgers in the same moment
        self.current: dict[str, NodeLedger] = {}
        prefix = f"$KV.{subjects.KV_LEDGER}."
        self._prefix = prefix
        self.tail = StreamTail(nc, f"KV_{subjects.KV_LEDGER}", f"{prefix}>", self._on_revision)

    def _on_revision(self, msg) -> None:
        self.revisions += 1
        key = msg.subject[len(self._prefix):]
        rev = msg.metadata.sequence.stream
        operation = (msg.headers or {}).get("KV-Operation")
        if key.startswith("node."):
            node = key[len("node."):]
            if operation in ("DEL", "PURGE") or not msg.data:
                self.current.pop(node, None)
                return
            try:
                ledger = _node_ledger.decode(msg.data)
            except msgspec.DecodeError as exc:
                self.findings.append(f"revision {rev} of {key} does not decode: {exc}")
                return
            for problem in over_commit(ledger, self.inventories.get(node)):
                self.findings.append(f"revision {rev}: {problem}")
            self.current[node] = ledger
            for other, other_ledger in self.current.items():
                if other == node:
                    continue
                for claim in ledger.entries.keys() & other_ledger.entries.keys():
                    self.doubles.append(f"revision {rev}: claim {claim} is on {node} and {other} at once")
        elif key.startswith("tenant.") and msg.data and operation not in ("DEL", "PURGE"):
            try:
                usage = _tenant_usage.decode(msg.data)
            except msgspec.DecodeError as exc:
                self.findings.append(f"revision {rev} of {key} does not decode: {exc}")
                return
            quota = self.quotas.get(usage.tenant)
            if quota is None:
                return
            for dim in ("gpus", "memory_mib", "cores"):
                limit = getattr(quota.quota, dim)
                # Beyond its guarantee a tenant may borrow up to its borrowing limit (issue 26).
                extra = 0 if quota.borrowing_limit is None else getattr(quota.borrowing_limit, dim)
                used = sum(getattr(q, dim) or 0 for q in usage.claims.values())
                if limit is not None and extra is not None and used > limit + extra:
                    self.findings.append(f"revision {rev}: tenant {usage.tenant} holds {dim}={used} > quota {limit}"
                                         + (f" + borrowing limit {extra}" if extra else ""))

    def gap_findings(self) -> list[str]:
        return [f"ledger revisions {a}-{b} were dropped by the bucket's history before the auditor read them"
                for a, b in self.tail.gaps]


class ClaimEvents:
    """The claims stream, read whole: who was allocated where, and how often."""

    def __init__(self, nc) -> None:
        self.allocations: dict[str, set[tuple[str, tuple[str, ...]]]] = defaultdict(set)
        self.tail = StreamTail(nc, subjects.STREAM_CLAIMS, f"{subjects.CLAIMS}.>", self._on_event)

    def _on_event(self, msg) -> None:
        try:
            event = claim_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return  # a malformed event: the consumers dead-letter it, the DLQ check covers it
        if isinstance(event, ClaimAllocated):
            placement = (event.node, tuple(sorted((d.uuid, d.memory_mib, d.cores) for d in event.devices)))
            self.allocations[event.claim].add(placement)


class DeadLetters:
    def __init__(self, nc) -> None:
        self.letters: list[DeadLetter] = []
        self.undecodable: list[int] = []
        self.tail = StreamTail(nc, subjects.STREAM_DLQ, f"{subjects.DLQ}.>", self._on_letter)

    def _on_letter(self, msg) -> None:
        try:
            self.letters.append(_letter.decode(msg.data))
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.undecodable.append(msg.metadata.sequence.stream)


async def _bucket(js, name: str) -> dict[str, bytes]:
    """The live values of a bucket (deleted keys left out), read through its stream."""
    stream = f"KV_{name}"
    prefix = f"$KV.{name}."
    out: dict[str, bytes] = {}
    try:
        info = await js.stream_info(stream)
    except nats.js.errors.NotFoundError:
        return out
    if info.state.messages == 0:
        return out
    sub = await js.pull_subscribe(f"{prefix}>", stream=stream, config=jsapi.ConsumerConfig(
        deliver_policy=jsapi.DeliverPolicy.LAST_PER_SUBJECT, ack_policy=jsapi.AckPolicy.NONE,
        mem_storage=True, inactive_threshold=30.0))
    try:
        pending = (await sub.consumer_info()).num_pending
        while pending:
            for msg in await sub.fetch(min(pending, 512), timeout=5):
                key = msg.subject[len(prefix):]
                if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE") or not msg.data:
                    out.pop(key, None)
                else:
                    out[key] = msg.data
                pending = msg.metadata.num_pending
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return out


def _preempted_by(reason: str, accepted: dict[str, Accepted], victim: Accepted) -> str | None:
    """The accepted claim of higher priority that this one was released for (placement's reason,
    "preempted by CLAIM of tenant T (priority P > Q)"), or that of another tenant reclaiming its
    guarantee ("preempted by CLAIM of tenant T: reclaimed by tenant T for its guarantee ..."), or
    None: then it was lost."""
    words = reason.split()
    if len(words) < 3 or words[:2] != ["preempted", "by"]:
        return None
    by = accepted.get(words[2])
    if by is None:
        return None
    if f"reclaimed by tenant {by.tenant} for its guarantee" in reason and by.tenant != victim.tenant:
        return by.claim
    return by.claim if by.priority > victim.priority else None


class Auditor:
    """``await Auditor.start(url)``; ``await auditor.audit(accepted)``; ``await auditor.close()``."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=5.0)
        self.inventories: dict[str, NodeInventory] = {}
        self.quotas: dict[str, TenantRecord] = {}
        self.ledger = LedgerWatch(nc, self.inventories, self.quotas)
        self.events = ClaimEvents(nc)
        self.letters = DeadLetters(nc)
        self._tasks: list[asyncio.Task] = []

    @classmethod
    async def start(cls, url: str) -> "Auditor":
        async def quiet(*_args) -> None:  # a scenario kills the server on purpose
            pass

        servers = [u.strip() for u in url.split(",")]  # one server, or every member of a cluster
        nc = await nats.connect(servers, name="fault-auditor", max_reconnect_attempts=-1, reconnect_time_wait=0.2,
                                error_cb=quiet, disconnected_cb=quiet)
        auditor = cls(nc)
        await auditor.refresh_reference()
        auditor._tasks = [asyncio.create_task(t.run(), name=f"tail-{t.stream}")
                          for t in (auditor.ledger.tail, auditor.events.tail, auditor.letters.tail)]
        return auditor

    async def refresh_reference(self) -> None:
        """Inventories and quotas, the yardsticks the ledger revisions are checked against."""
        for key, data in (await _bucket(self.js, subjects.KV_INVENTORY)).items():
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                self.inventories[key] = _inventory.decode(data)
        for key, data in (await _bucket(self.js, subjects.KV_TENANTS)).items():
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                self.quotas[key] = _tenant.decode(data)

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)
        await self.nc.close()

    async def audit(self, accepted: dict[str, Accepted], expected_letters: set[str] = frozenset()) -> Findings:
        """One pass. ``expected_letters``: subjects of malformed events that must have a dead letter."""
        f = Findings()
        for tail in (self.ledger.tail, self.events.tail, self.letters.tail):
            await tail.caught_up()
        f.revision_overcommits += self.ledger.findings + self.ledger.gap_findings()
        f.revision_doubles += self.ledger.doubles

        records: dict[str, ClaimRecord] = {}
        for key, data in (await _bucket(self.js, subjects.KV_CLAIMS)).items():
            try:
                records[key] = _record.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                f.inconsistent.append(f"claim record {key} does not decode: {exc}")
        state = await _bucket(self.js, subjects.KV_LEDGER)
        ledgers = {k[5:]: _node_ledger.decode(v) for k, v in state.items() if k.startswith("node.")}
        usages = {k[7:]: _tenant_usage.decode(v) for k, v in state.items() if k.startswith("tenant.")}

        # Every accepted claim reached a final state, and one its tenant asked for.
        for claim, a in accepted.items():
            record = records.get(claim)
            by = _preempted_by(record.reason, accepted, a) if record is not None and record.state == "released" else None
            if by is not None:
                f.preempted.append(f"{claim}: by {by}")
            if record is None:
                f.lost.append(f"{claim}: accepted but has no record")
            elif record.state not in RESTING:
                f.lost.append(f"{claim}: still {record.state}")
            elif a.release_requested and record.state not in ENDED:
                f.lost.append(f"{claim}: release requested but still {record.state}")
            elif record.state == "released" and not a.release_requested and by is None:
                f.lost.append(f"{claim}: released ({record.reason}) without its tenant asking")
            else:
                f.completed += 1

        # No claim allocated twice: one placement per claim, on one node.
        for claim, placements in self.events.allocations.items():
            if len(placements) > 1:
                f.duplicated.append(f"{claim}: allocated {len(placements)} ways: {sorted(placements)}")
        seen: dict[str, str] = {}
        for node, ledger in ledgers.items():
            for claim in ledger.entries:
                if claim in seen:
                    f.duplicated.append(f"{claim}: in the ledgers of {seen[claim]} and {node}")
                seen[claim] = node

        # Ledger = live claims = quota usage; record devices = ledger shares.
        live = {c: r for c, r in records.items() if r.state in LIVE}
        for claim, r in live.items():
            node = seen.get(claim)
            if node is None:
                f.inconsistent.append(f"{claim}: {r.state} on {r.node} but in no ledger")
                continue
            entry = ledgers[node].entries[claim]
            if node != r.node:
                f.inconsistent.append(f"{claim}: record says {r.node}, ledger says {node}")
            if sorted(r.devices, key=lambda d: d.uuid) != sorted(entry.shares, key=lambda d: d.uuid):
                f.inconsistent.append(f"{claim}: record devices {r.devices} != ledger shares {entry.shares}")
        for claim, node in seen.items():
            if claim not in live:
                what = records[claim].state if claim in records else "no record"
                f.inconsistent.append(f"{claim}: in the ledger of {node} but {what}")
        for tenant, usage in usages.items():
            held = set(usage.claims)
            should = {c for c, r in live.items() if r.tenant == tenant}
            if held != should:
                f.inconsistent.append(
                    f"tenant {tenant}: quota usage holds {sorted(held - should)} extra, {sorted(should - held)} missing")
        for tenant in {r.tenant for r in live.values()} - set(usages):
            f.inconsistent.append(f"tenant {tenant}: live claims but no quota usage")

        # Nothing pending or unacknowledged on the durable consumers.
        for stream in subjects.STREAMS:
            try:
                consumers = await self.js.consumers_info(stream)
            except Exception as exc:
                f.unsettled_consumers.append(f"{stream}: cannot list consumers ({exc!r})")
                continue
            for info in consumers:
                if not info.config.durable_name:
                    continue
                if info.num_pending or info.num_ack_pending:
                    f.unsettled_consumers.append(
                        f"{stream}/{info.name}: {info.num_pending} pending, {info.num_ack_pending} unacknowledged")

        # Every dead letter has its reason; every malformed event we sent has its letter.
        for seq in self.letters.undecodable:
            f.dead_letters_without_reason.append(f"DLQ message {seq} is not a dead letter")
        for letter in self.letters.letters:
            if not letter.reason.strip():
                f.dead_letters_without_reason.append(f"{letter.subject}: empty reason")
        lettered = {letter.subject for letter in self.letters.letters}
        for subject in sorted(set(expected_letters) - lettered):
            f.dead_letters_without_reason.append(f"{subject}: malformed, but no dead letter")
        return f

    async def ledger_claims(self) -> set[str]:
        """The claims every node's ledger holds now (the tenant side's audit compares them with the
        claims of the pods that are live: tests/faults/tenantaudit.py)."""
        state = await _bucket(self.js, subjects.KV_LEDGER)
        return {c for k, v in state.items() if k.startswith("node.") for c in _node_ledger.decode(v).entries}

    async def until_clean(self, accepted: dict[str, Accepted], timeout: float,
                          expected_letters: set[str] = frozenset()) -> tuple[Findings, float | None]:
        """Audit every half second until the state is right (``settled``: what past revisions did
        stays in the findings but cannot be undone); returns the last pass and when it settled
        (loop time), or None when it never did within ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                findings = await self.audit(accepted, expected_letters)
            except Exception as exc:  # the server is still coming back: not a pass
                findings = Findings(inconsistent=[f"audit could not read the state: {exc!r}"])
            if findings.settled:
                return findings, loop.time()
            if loop.time() >= deadline:
                return findings, None
            await asyncio.sleep(0.5)
