"""A local Tessera for the enforcer tests, with short enforcer intervals, and helpers to drive
`tessera run` as a user would (a separate process) and to listen to the usage subject.

One cluster serves every test that leaves the services alone (starting five services costs seconds on a small box); tests
that kill or restart services start their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import msgspec
import pytest

from tessera.shared import api, subjects
from tessera.shared.events import GpuQuota, NodeLedger, usage_decoder

from tessera.cli.client import Client
from tessera.cli.cluster import LocalCluster
from tessera.cli.run import child_env

import kit

WORKLOAD = str(Path(__file__).parent / "workload.py")
TESSERA = str(Path(sys.executable).parent / "tessera")
# Another user cannot run the virtualenv's interpreter (it links into root's home), so `tessera run`
# as that user is the system's interpreter of the same version given the virtualenv's packages.
OTHER_USERS_PYTHON = "/usr/bin/python3"
_SITE = Path(sys.executable).parent.parent / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
_TESSERA_FROM_SITE = ("import site, sys; site.addsitedir(sys.argv.pop(1)); sys.argv[0] = 'tessera'; "
                      "from tessera.cli.__main__ import main; sys.exit(main())")


def same_python_for_other_users() -> bool:
    """Whether the system's interpreter can load the virtualenv's (compiled) packages."""
    if not os.access(OTHER_USERS_PYTHON, os.X_OK):
        return False
    out = subprocess.run([OTHER_USERS_PYTHON, "-c", "import sys; print(sys.version_info[:2])"],
                         capture_output=True, text=True)
    return out.stdout.strip() == str(sys.version_info[:2])


MIB = 1 << 20

# Short enforcer intervals: the tests assert what happens, these only decide how soon.
FAST = {
    "TESSERA_USAGE_SECONDS": "0.2",
    "TESSERA_USAGE_HEARTBEAT_SECONDS": "2",
    "TESSERA_RECLAIM_SECONDS": "2",
    "TESSERA_RELEASE_GRACE_SECONDS": "2",
    "TESSERA_LOST_RECLAIM_SECONDS": "1",
}


def start_local(workdir: Path, **kwargs) -> LocalCluster:
    """The kit's `start_local` with the short enforcer intervals (``extra_env`` adds to them)."""
    return kit.start_local(workdir, "tiny.yaml", extra_env=dict(FAST, **kwargs.pop("extra_env", {})), **kwargs)


async def create_tenant(url: str, name: str) -> None:
    client = await Client.connect(url)
    try:
        await client.call(f"{subjects.API_TENANTS}.create", api.TenantRequest(name=name, quota=GpuQuota(gpus=8)),
                          timeout=30)
    finally:
        await client.close()


@contextlib.contextmanager
def tenant_cluster(workdir: Path, **extra_env: str) -> Iterator[LocalCluster]:
    """A started cluster with the short enforcer intervals (and ``extra_env``) and the tenant ``alpha``."""
    cluster = start_local(workdir, extra_env=extra_env)
    try:
        asyncio.run(create_tenant(cluster.url, "alpha"))
    except BaseException:
        cluster.stop()
        raise
    try:
        yield cluster
    finally:
        cluster.stop(timeout=2)  # orderly shutdown is tested elsewhere; here it only costs time


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    with tenant_cluster(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


@pytest.fixture
def fresh_cluster(start_cluster):
    """A cluster of the test's own, for tests that kill services: ``await fresh_cluster(...)``; the
    kit's `start_cluster` with the short enforcer intervals and the tenant ``alpha``."""

    async def start(**kwargs) -> LocalCluster:
        extra = dict(FAST, **kwargs.pop("extra_env", {}))
        cluster = await start_cluster("tiny.yaml", extra_env=extra, stop_timeout=2, **kwargs)
        await create_tenant(cluster.url, "alpha")
        return cluster

    return start


@dataclass
class Finished:
    code: int
    stdout: str
    stderr: str

    def report(self) -> dict:
        """The workload's JSON report line."""
        for line in self.stdout.splitlines():
            if line.startswith("{"):
                return json.loads(line)
        raise AssertionError(f"no report from the workload; stdout={self.stdout!r} stderr={self.stderr!r}")


async def start_run(cluster: LocalCluster, *run_args: str, node: str = "gpu-0", tenant: str = "alpha",
                    workload: list[str] | None = None, command: list[str] | None = None,
                    env: dict | None = None, user: int | None = None) -> asyncio.subprocess.Process:
    """Start `tessera run` as a separate process (stdout/stderr piped), as ``user`` if given."""
    python = sys.executable if user is None else OTHER_USERS_PYTHON
    cmd = command if command is not None else [python, WORKLOAD, *(workload or [])]
    full_env = dict(os.environ, **(env or {}))
    full_env.pop("TESSERA_NODE", None)
    tessera = [TESSERA] if user is None else [OTHER_USERS_PYTHON, "-c", _TESSERA_FROM_SITE, str(_SITE)]
    return await asyncio.create_subprocess_exec(
        *tessera, "run", "--nats", cluster.url, "--node", node, "--tenant", tenant, "--timeout", "60", *run_args,
        "--", *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=full_env,
        **({} if user is None else {"user": user, "group": user, "extra_groups": []}),
    )


async def finish(proc: asyncio.subprocess.Process, timeout: float = 90) -> Finished:
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    return Finished(proc.returncode, out.decode(), err.decode())


async def tessera_run(cluster: LocalCluster, *run_args: str, **kw) -> Finished:
    return await finish(await start_run(cluster, *run_args, **kw))


class UsageListener:
    """Every usage event published while it listens (core subscription on tessera.usage.>)."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.events: list = []
        self.sub = None

    async def __aenter__(self) -> "UsageListener":
        async def on_msg(msg) -> None:
            try:
                self.events.append(usage_decoder.decode(msg.data))
            except msgspec.ValidationError:
                pass

        self.sub = await self.client.bus.listen(f"{subjects.USAGE}.>", on_msg)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.sub.unsubscribe()

    def of(self, claim: str) -> list:
        return [e for e in self.events if getattr(e, "claim", None) == claim]


async def live_entries(client: Client) -> dict[str, str]:
    """claim -> node, for every allocation the ledger holds."""
    state = await client.fleet()
    return {claim: node for node, lg in state.ledgers.items() for claim in lg.entries}


async def run_claims(client: Client) -> dict[str, str]:
    """claim -> state, for the claims `tessera run` made."""
    state = await client.fleet()
    return {c: r.state for c, r in state.claims.items() if c.startswith("run-")}


# --- a claim's workload against its node's ledger ----------------------------------------------


def alive(pid: int) -> bool:
    """Running (a zombie holds nothing any more: its files, locks and GPU memory are gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclass
class Workload:
    """A claim's workload started with its prepared environment, as a `tessera submit` user would."""

    claim: str
    proc: asyncio.subprocess.Process
    term_file: Path  # where it notes a SIGTERM

    @property
    def termed(self) -> bool:
        return self.term_file.exists()


async def start_workload(client: Client, claim: str, workdir: Path, on_term: str) -> Workload:
    """The claim's workload (``on_term``: ``ignore`` or ``exit``, see workload.py), returned once
    its CUDA context holds a slot of the claim's accounting file (it has reported)."""
    # (the record says ``prepared`` just before the event is published)
    prepared = await kit.eventually(lambda: client.prepared(claim), what=f"the prepared event of {claim}")
    term_file = workdir / f"{claim}.term"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, WORKLOAD, "--alloc", "100", "--hold-file", str(workdir / "never"),
        "--on-term", on_term, "--term-file", str(term_file),
        env=child_env(dict(os.environ), prepared.env), stdout=asyncio.subprocess.PIPE)
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    assert b'"pid"' in line, line
    return Workload(claim, proc, term_file)


@dataclass(frozen=True)
class Revision:
    """One revision of a node's ledger as it arrived, and the watched workloads then."""

    claims: frozenset[str]  # the claims it holds
    alive: frozenset[str]  # the watched claims whose workload was running when it arrived
    termed: frozenset[str]  # the watched claims whose workload had noted a SIGTERM


class LedgerRevisions:
    """Every revision of ``node``'s ledger key while it listens (a core subscription to the bucket's
    subject, as any outside tool may), each with the liveness of ``workloads``. Liveness is read
    when the revision arrives, after it was written: a workload alive then was alive at it."""

    def __init__(self, client: Client, node: str, workloads: list[Workload]) -> None:
        self.client, self.node, self.workloads = client, node, workloads
        self.seen: list[Revision] = []
        self.sub = None

    async def __aenter__(self) -> "LedgerRevisions":
        decoder = msgspec.json.Decoder(NodeLedger)

        async def on_revision(msg) -> None:
            running = frozenset(w.claim for w in self.workloads if alive(w.proc.pid))  # first, see above
            termed = frozenset(w.claim for w in self.workloads if w.termed)
            entries = decoder.decode(msg.data).entries if msg.data else {}
            self.seen.append(Revision(frozenset(entries), running, termed))

        self.sub = await self.client.bus.listen(f"$KV.{subjects.KV_LEDGER}.{subjects.ledger_node_key(self.node)}",
                                                on_revision)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.sub.unsubscribe()

    async def removal(self, claim: str) -> Revision:
        """The first revision seen without ``claim``'s entry (the entry goes last of a release:
        just after the record says ``released``)."""
        return await kit.eventually(lambda: next((r for r in self.seen if claim not in r.claims), None),
                                    what=f"the removal of {claim}'s ledger entry")
