"""A NATS JetStream cluster that loses its leaders under load, and the figures bench/nats_cluster.md holds.

Three nats-server processes clustered on loopback with the platform's authorization (the same
per-service users and accounts as the single server: `tessera.shared.natsserver.NatsCluster`),
streams and buckets at R3, the five services (placement in two replicas) given all three URLs.
During a burst of claims (tests/faults/loadgen.py), the member leading the claims stream is
SIGKILLed; once a claim has gone through again it is restarted, then the member leading the
ledger bucket is SIGKILLed and restarted the same way. Then the load stops and the auditor
(tests/faults/auditor.py) checks: every accepted claim reached a final state, none was
allocated twice, no ledger revision over-commits.

Figures per kill: time to a new leader, and time from the kill until a claim submitted right
after it reached a final state (the service's recovery as a tenant sees it); for the run, time
from the end of the load to the auditor's first clean pass.

Usage (long form): ``python tests/faults/clusterfaults.py [--out bench/nats_cluster.md]``.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import nats.js.errors

sys.path.insert(0, str(Path(__file__).parent))

from tessera.cli.cluster import LocalCluster  # noqa: E402
from tessera.shared import api, subjects  # noqa: E402

import scenarios  # noqa: E402
from auditor import Accepted, Auditor, Findings  # noqa: E402
from loadgen import FAULT_SERVICE_ENV, FaultCluster, Load, connect, profile_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
_encoder = msgspec.json.Encoder()
# What is killed, in order: the claims stream's leader, then the ledger bucket's.
TARGETS = (("claims stream", subjects.STREAM_CLAIMS), ("ledger bucket", f"KV_{subjects.KV_LEDGER}"))
FINAL = frozenset({"prepared", "running", "unschedulable", "failed", "released"})


@dataclass
class ClusterFaults(FaultCluster):
    """The fault suite's cluster with three NATS members and no proxy (each client has every URL)."""

    nats_servers: int = 3

    def service_env(self, name: str, instance: str, http_port: int, node: str | None = None) -> dict[str, str]:
        env = LocalCluster.service_env(self, name, instance, http_port, node)
        env.update(FAULT_SERVICE_ENV)
        return env


class Form(scenarios.Form):
    """The fault suite's phases with the cluster's own lengths (a leader election takes longer)."""

    @classmethod
    def short(cls) -> "Form":
        return cls(warmup=3.0, after=2.0, recover_timeout=60.0)

    @classmethod
    def long(cls) -> "Form":
        return cls(warmup=10.0, after=10.0, recover_timeout=120.0)


@dataclass
class Kill:
    target: str
    stream: str
    killed: str
    new_leader: str = ""
    leader_seconds: float | None = None  # kill -> a new leader elected
    claim_seconds: float | None = None  # kill -> a claim submitted after it reached a final state
    claim_state: str = ""


@dataclass
class ClusterRun:
    kills: list[Kill] = field(default_factory=list)
    sent: int = 0
    accepted: int = 0
    completed: int = 0
    lost: int = 0
    duplicated: int = 0
    overcommitted: int = 0
    settle_seconds: float | None = None  # end of load -> the auditor's first clean pass
    revisions: int = 0
    findings: list[str] = field(default_factory=list)


async def leader_of(bus, stream: str, *, other_than: str = "", timeout: float = 30.0) -> tuple[str, float]:
    """The stream's (or bucket's) leader, waiting until there is one other than ``other_than``;
    returns it and the loop time it was first seen."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            info = await bus.stream_info(stream, timeout=2)
            leader = info.cluster.leader if info.cluster else None
            if leader and leader != other_than:
                return leader, loop.time()
        except Exception:  # no leader yet: the request times out or says so
            pass
        if loop.time() > deadline:
            raise TimeoutError(f"{stream} has no leader other than {other_than!r} after {timeout:.0f}s")
        await asyncio.sleep(0.05)


async def probe_claim(load: Load, claim: str, since: float) -> tuple[float, str]:
    """Submit one claim (retrying the same id until answered), wait for a final state, release it;
    the seconds from ``since`` to that final state, and the state."""
    loop = asyncio.get_running_loop()
    request = api.SubmitRequest(tenant="alpha", claim=claim,
                                resources={"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000})
    reply = await load._retry(lambda: load.client.bus.request(subjects.API_SUBMIT, _encoder.encode(request), timeout=5))
    if not reply.ok:
        raise AssertionError(f"the probe claim {claim} was refused: {reply.error}")
    accepted = load.accepted[claim] = Accepted(claim, "alpha")
    while True:
        try:
            record = await load.client.claim(claim)
        except Exception:
            record = None
        if record is not None and record.state in FINAL:
            break
        if loop.time() - since > 60:
            raise TimeoutError(f"the probe claim {claim} did not reach a final state in 60 s")
        await asyncio.sleep(0.05)
    took = loop.time() - since
    release = api.ReleaseRequest(claim=claim, tenant="alpha")
    if (await load._retry(lambda: load.client.bus.request(subjects.API_RELEASE, _encoder.encode(release),
                                                          timeout=5))).ok:
        accepted.release_requested = True
    return took, record.state


async def _through_reloads(call, patience: float = 15.0):
    """Creating a tenant reloads the accounts of the member the manager signals: its JetStream API
    answers 503 for a moment. The services ride it out (tessera.shared.bus); the auditor's plain
    client is given the same patience here."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience
    while True:
        try:
            return await call()
        except nats.js.errors.ServiceUnavailableError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.1)


def _figures(run: ClusterRun, load: Load, findings: Findings) -> None:
    run.sent, run.accepted, run.completed = load.tally.sent, len(load.accepted), findings.completed
    run.lost = len(findings.lost) + len(load.tally.unconfirmed)
    run.duplicated, run.overcommitted = findings.duplicated_total, findings.overcommitted_total
    run.findings = findings.lines() + [f"lost: {c}: submit never answered" for c in load.tally.unconfirmed] \
        + [f"api: {x}" for x in load.tally.accepted_invalid]


async def run(workdir: Path, form: Form, seed: int = 7) -> ClusterRun:
    cluster = ClusterFaults(workdir=workdir, profile=profile_path())
    result = ClusterRun()
    loop = asyncio.get_running_loop()
    await asyncio.to_thread(cluster.start)
    try:
        await asyncio.to_thread(cluster.wait_ready, 120)
        client = await connect(cluster.url)
        auditor = await Auditor.start(cluster.url)
        bus = client.bus
        try:
            for _, stream in TARGETS:  # R3 everywhere, as the services laid them out
                info = await bus.stream_info(stream, timeout=2)
                assert info.config.num_replicas == 3, f"{stream} is R{info.config.num_replicas}"
            load = Load(client, seed=seed)
            await load.setup()
            await _through_reloads(auditor.refresh_reference)
            load.start()
            await asyncio.sleep(form.warmup)
            for n, (target, stream) in enumerate(TARGETS):
                killed, _ = await leader_of(bus, stream)
                kill = Kill(target, stream, killed)
                result.kills.append(kill)
                at = loop.time()
                cluster.nats.kill(killed)  # SIGKILL, during the burst
                probe = asyncio.create_task(probe_claim(load, f"probe-{n}", at))
                kill.new_leader, elected = await leader_of(bus, stream, other_than=killed)
                kill.leader_seconds = elected - at
                kill.claim_seconds, kill.claim_state = await probe
                await asyncio.sleep(form.after)  # the burst goes on with one member down
                await asyncio.to_thread(cluster.nats.start_member, killed)
            await load.pause()
            stopped = loop.time()
            await load.drain()
            findings, clean_at = await auditor.until_clean(load.accepted, form.recover_timeout)
            result.settle_seconds = None if clean_at is None else clean_at - stopped
            await load.release_kept()
            findings, _ = await auditor.until_clean(load.accepted, form.recover_timeout)
            _figures(result, load, findings)
            result.revisions = auditor.ledger.revisions
            dead = [sp.name for sp in cluster.dead()]
            if dead:
                result.findings.append(f"processes not running at the end: {dead}")
        finally:
            await auditor.close()
            await client.close()
    finally:
        await asyncio.to_thread(cluster.stop)
    return result


def _s(value: float | None) -> str:
    return "never (within the limit)" if value is None else f"{value:.1f} s"


def table(run: ClusterRun) -> str:
    lines = ["| killed | member | new leader | time to a new leader | kill to a claim's final state |",
             "|---|---|---|---|---|"]
    for k in run.kills:
        lines.append(f"| leader of the {k.target} ({k.stream}) | {k.killed} | {k.new_leader} | {_s(k.leader_seconds)}"
                     f" | {_s(k.claim_seconds)} ({k.claim_state}) |")
    lines += ["", "| claims sent | accepted | completed | lost | duplicated | over-committed | "
              "load end to clean audit | ledger revisions checked |", "|---|---|---|---|---|---|---|---|",
              f"| {run.sent} | {run.accepted} | {run.completed} | {run.lost} | {run.duplicated} | {run.overcommitted}"
              f" | {_s(run.settle_seconds)} | {run.revisions} |"]
    return "\n".join(lines)


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "nats_cluster.md"))
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tessera-nats-cluster-"))
    result = await run(tmp, Form.long())
    if result.findings:  # the services' and servers' logs, for whoever reads the findings
        print(f"logs kept in {tmp}", file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    commit = subprocess.run(["git", "-C", str(ROOT), "log", "--oneline", "-1"], capture_output=True, text=True).stdout
    text = ["# A NATS cluster losing its leaders under load", "",
            f"Commit: `{commit.strip()}`. Regenerate with `python tests/faults/clusterfaults.py` "
            "(the short form runs in `make test`: tests/reliability/test_nats_cluster.py).", "",
            "Three nats-server members clustered on loopback (JetStream file storage, `sync_interval: always`, the "
            "platform's per-service users and accounts), every stream and bucket at R3, the five services with "
            "placement in two replicas, each client given the three URLs; tiny.yaml (2 nodes x 2 H100), two "
            "tenants, one submit every 0.12 s (20% invalid). After a "
            f"{Form.long().warmup:.0f} s warm-up the leader of the claims stream is SIGKILLed during the load; a "
            f"claim is submitted at once; {Form.long().after:.0f} s later the member is restarted, then the leader "
            "of the ledger bucket is killed the same way. Then the load stops and the auditor checks every "
            "accepted claim, every ledger revision and every consumer.", "",
            table(result), "",
            "- *time to a new leader*: from the SIGKILL until a client (one of the load's, which may itself be reconnecting) sees another member named as leader "
            "(nats-server's Raft election, an upper bound; a claim may be decided before it is seen).",
            "- *kill to a claim's final state*: a claim submitted right after the kill, until placement has "
            "decided it (prepared, or unschedulable when the load holds the GPUs or the tenant's quota): it "
            "needs the claims stream, the claims and ledger buckets and the consumers to work again.",
            "- *load end to clean audit*: every accepted claim in a final state, none allocated twice, ledger = "
            "live claims = quota usage, no consumer with pending messages.", ""]
    if result.findings:
        text += ["## Findings", ""] + [f"- {line}" for line in result.findings[:50]] + [""]
    Path(args.out).write_text("\n".join(text))
    print("\n".join(text))
    return 0 if not result.findings else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
