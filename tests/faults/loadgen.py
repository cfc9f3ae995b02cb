"""The fault suite's system under test and its load: the five services under mixed claims.

``FaultCluster`` is the local Tessera every e2e test runs (tessera.cli.cluster.LocalCluster: the
embedded nats-server and each service as its own console-script process), with placement in two
replicas that reach NATS through a ``FaultProxy``, a short ``ack_wait`` (so "held past its ack
wait" takes seconds), and SIGKILL / restart / SIGSTOP of any one process or of nats-server.

``Load`` drives it through the public API only (tessera.api.claims.submit / release), as a
tenant's client would: two tenants with quotas, a steady stream of valid claims (one or two GPUs,
memory and cores that vary) and invalid ones (out-of-range values, a misspelt resource, an unknown
tenant), each valid claim released after a short hold, a few kept (never more than half a
tenant's quota, so claims keep being placed all through a long run); with ``high``, that share of the
valid claims asks for scheduling priority `HIGH` and `HIGH_MEMORY_MIB` on each of two GPUs (placement with preemption on may then release
lower ones: the auditor counts those as preempted, not lost). A submit or release that fails
as unavailable or times out is retried with the same claim id (the API's idempotent retry), so a
fault never makes the client itself lose a claim; what the system loses, the auditor finds.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from tessera.cli.client import Client
from tessera.cli.cluster import LocalCluster, ServiceProcess
from tessera.shared import api, subjects
from tessera.shared.bus import Bus
from tessera.shared.cancelling import cancel_and_wait
from tessera.shared.errors import TemporaryError
from tessera.shared.events import GpuQuota
from tessera.shared.settings import BusSettings

from auditor import Accepted
from proxy import FaultProxy

ACK_WAIT_SECONDS = 4.0
# What every service of a fault run is started with: quick redelivery, state on disk, and room in
# the ledger's history for the auditor (it reads every revision) to fall behind a leader election.
FAULT_SERVICE_ENV = {"TESSERA_ACK_WAIT": str(ACK_WAIT_SECONDS), "TESSERA_MAX_DELIVER": "5",
                     "TESSERA_STREAM_STORAGE": "file", "TESSERA_LEDGER_HISTORY": "64"}
TENANTS = {"alpha": GpuQuota(gpus=6), "beta": GpuQuota(gpus=3)}
HIGH = 100  # the scheduling priority of a priority mix's high share (the others: unset, 0)
HIGH_MEMORY_MIB = 60000  # what each of a high claim's two GPUs asks (of 81,559 MiB in tiny.yaml)
_encoder = msgspec.json.Encoder()


@dataclass
class FaultCluster(LocalCluster):
    placement_replicas: int = 2
    proxy: FaultProxy | None = None
    # A node is never declared lost by a restart that takes a few seconds.
    lost_after_seconds: float = 60.0

    def service_env(self, name: str, instance: str, http_port: int, node: str | None = None) -> dict[str, str]:
        env = super().service_env(name, instance, http_port, node)
        env.update(FAULT_SERVICE_ENV)
        if name == "placement":
            if self.proxy is None:
                self.proxy = FaultProxy(self.nats.port).start()
            env["TESSERA_NATS_URL"] = self.proxy.url_with_credentials(env["TESSERA_NATS_URL"])  # its own user
        return env

    def instances(self) -> list[str]:
        return [sp.name for sp in self.processes if sp.alive()]

    def _take(self, instance: str) -> ServiceProcess:
        live = [sp for sp in self.processes if sp.name == instance]
        if not live:
            raise KeyError(instance)
        return live[-1]

    def kill(self, instance: str) -> None:
        sp = self._take(instance)
        sp.proc.send_signal(signal.SIGKILL)
        sp.proc.wait()

    def restart(self, instance: str) -> ServiceProcess:
        """Start ``instance`` again as it was first started (same name, same settings)."""
        old = self._take(instance)
        self.processes.remove(old)
        service = old.name.split("-")[0]
        env = {}
        if service == "enforcer":
            env["TESSERA_NODE"] = old.name[len("enforcer-"):]
        return self.spawn(service, instance=old.name, env=env)

    def pause(self, instance: str) -> None:
        os.kill(self._take(instance).proc.pid, signal.SIGSTOP)

    def resume(self, instance: str) -> None:
        os.kill(self._take(instance).proc.pid, signal.SIGCONT)

    def stop(self, *, timeout: float = 10.0) -> dict[str, int]:
        for sp in self.processes:  # a paused process would not see SIGTERM
            if sp.alive():
                os.kill(sp.proc.pid, signal.SIGCONT)
        codes = super().stop(timeout=timeout)
        if self.proxy is not None:
            self.proxy.stop()
        return codes


async def connect(url: str) -> Client:
    """A CLI client that never stops reconnecting (the CLI's own gives up after three tries)."""
    bus = await Bus.connect(BusSettings(url=url, max_reconnect_attempts=-1, reconnect_time_wait=0.2),
                            "fault-load", connect_timeout=5)
    return Client(bus, await bus.kv(subjects.KV_CLAIMS))  # the operator's client: it reads the fleet


def _invalid_request(rng: random.Random) -> api.SubmitRequest:
    tenant = rng.choice(list(TENANTS))
    return rng.choice([
        api.SubmitRequest(tenant=tenant, resources={"nvidia.com/gpu": 1, "nvidia.com/gpucores": 150}),
        api.SubmitRequest(tenant=tenant, resources={"nvidia.com/gpu": 1, "nvidia.com/gpumem": -5}),
        api.SubmitRequest(tenant=tenant, resources={"nvidia.com/gpu": 1, "nvidia.com/gpumen": 1000}),
        api.SubmitRequest(tenant=tenant, resources={"nvidia.com/gpu": 99}),
        api.SubmitRequest(tenant="nobody", resources={"nvidia.com/gpu": 1}),
    ])


def _valid_resources(rng: random.Random) -> dict[str, int]:
    resources = {"nvidia.com/gpu": 2 if rng.random() < 0.15 else 1,
                 "nvidia.com/gpumem": rng.choice([1000, 4000, 10000, 20000, 40000])}
    if rng.random() < 0.7:
        resources["nvidia.com/gpucores"] = rng.choice([5, 10, 20, 30, 50])
    return resources


@dataclass
class Tally:
    sent: int = 0
    rejected: int = 0
    accepted_invalid: list[str] = field(default_factory=list)
    unconfirmed: list[str] = field(default_factory=list)  # valid submits never answered ok


class Load:
    """``await load.setup()``; ``load.start()``; ``await load.stop()`` (submits end, claims finish)."""

    def __init__(self, client: Client, *, seed: int, interval: float = 0.12, keep_every: int = 8,
                 hold: tuple[float, float] = (0.2, 1.0), claim_deadline: float = 60.0, high: float = 0.0) -> None:
        self.client = client
        self.high = high  # a priority mix: this share of the valid claims has scheduling priority HIGH
        self.rng = random.Random(seed)
        self.interval = interval
        self.keep_every = keep_every
        self.hold = hold
        self.claim_deadline = claim_deadline
        self.accepted: dict[str, Accepted] = {}
        self.tally = Tally()
        self._submitting = False
        self._runner: asyncio.Task | None = None
        self._claims: set[asyncio.Task] = set()
        self._n = 0
        self._kept_gpus = dict.fromkeys(TENANTS, 0)
        self._prefix = f"f{seed}"

    async def setup(self) -> None:
        for tenant, quota in TENANTS.items():
            await self._retry(lambda t=tenant, q=quota: self.client.bus.request(
                f"{subjects.API_TENANTS}.create", _encoder.encode(api.TenantRequest(name=t, quota=q)), timeout=30))

    async def _retry(self, call, deadline: float = 60.0) -> api.Reply:
        """Call until answered, and answered other than 'unavailable' (then retry, same request)."""
        end = time.monotonic() + deadline
        while True:
            try:
                reply = api.decode_reply(await call())
                if reply.ok or reply.error is None or reply.error.code != "unavailable":
                    return reply
            except (TemporaryError, asyncio.TimeoutError):
                pass
            if time.monotonic() > end:
                raise TimeoutError("no answer from the API")
            await asyncio.sleep(0.3)

    def start(self) -> None:
        self._submitting = True
        self._runner = asyncio.create_task(self._submit_loop(), name="fault-load")

    async def pause(self) -> None:
        """Submit nothing new; claims already sent go on (hold, release) to their end."""
        self._submitting = False
        if self._runner is not None:
            await self._runner
            self._runner = None

    async def drain(self, timeout: float = 90.0) -> None:
        if self._claims:
            await asyncio.wait(set(self._claims), timeout=timeout)
        await cancel_and_wait(list(self._claims))

    async def _submit_loop(self) -> None:
        while self._submitting:
            self.tally.sent += 1
            if self.rng.random() < 0.2:
                task = asyncio.create_task(self._invalid())
            else:
                self._n += 1
                claim = f"{self._prefix}-{self._n}"
                tenant = self.rng.choice(list(TENANTS))
                resources = _valid_resources(self.rng)
                priority = HIGH if self.high and self.rng.random() < self.high else None
                if priority:  # large: room for it is rarely free, so it preempts
                    resources.update({"nvidia.com/gpu": 2, "nvidia.com/gpumem": HIGH_MEMORY_MIB})
                task = asyncio.create_task(self._valid(claim, tenant, resources,
                                                       self._keeps(tenant, resources["nvidia.com/gpu"]), priority))
            self._claims.add(task)
            task.add_done_callback(self._claims.discard)
            await asyncio.sleep(self.interval)

    def _keeps(self, tenant: str, gpus: int) -> bool:
        """Is the ``_n``-th valid claim kept to the end? One in ``keep_every`` is, while the tenant's
        kept claims hold at most half its quota: kept past that, they fill the quota within seconds
        of a long run and every later claim is unschedulable, so placement writes no ledger entry
        and a fault during the load strikes a system that places nothing."""
        if self._n % self.keep_every or self._kept_gpus[tenant] + gpus > TENANTS[tenant].gpus // 2:
            return False
        self._kept_gpus[tenant] += gpus
        return True

    async def _invalid(self) -> None:
        request = _invalid_request(self.rng)
        reply = await self._retry(lambda: self.client.bus.request(
            subjects.API_SUBMIT, _encoder.encode(request), timeout=5))
        if reply.ok:
            self.tally.accepted_invalid.append(f"{request}: {reply.result}")
        else:
            self.tally.rejected += 1

    async def _valid(self, claim: str, tenant: str, resources: dict, keep: bool, priority: int | None = None) -> None:
        request = api.SubmitRequest(tenant=tenant, resources=resources, claim=claim, scheduling_priority=priority)
        try:
            reply = await self._retry(lambda: self.client.bus.request(
                subjects.API_SUBMIT, _encoder.encode(request), timeout=5))
        except TimeoutError:
            self.tally.unconfirmed.append(claim)
            return
        if not reply.ok:
            self.tally.accepted_invalid.append(f"valid {claim} refused: {reply.error}")
            return
        accepted = self.accepted[claim] = Accepted(claim, tenant, priority=priority or 0)
        end = time.monotonic() + self.claim_deadline
        while time.monotonic() < end:  # until placement has decided
            try:
                record = await self.client.claim(claim)
            except Exception:
                record = None
            if record is not None and record.state not in ("requested", "allocated"):
                break
            await asyncio.sleep(0.25)
        if keep:
            return
        await asyncio.sleep(self.rng.uniform(*self.hold))
        release = api.ReleaseRequest(claim=claim, tenant=tenant)
        try:
            reply = await self._retry(lambda: self.client.bus.request(
                subjects.API_RELEASE, _encoder.encode(release), timeout=5))
        except TimeoutError:
            return
        if reply.ok:
            accepted.release_requested = True

    async def release_kept(self) -> None:
        """Release the claims kept so far (the end of a run, so the ledger ends empty)."""
        for a in self.accepted.values():
            if not a.release_requested:
                release = api.ReleaseRequest(claim=a.claim, tenant=a.tenant)
                reply = await self._retry(lambda r=release: self.client.bus.request(
                    subjects.API_RELEASE, _encoder.encode(r), timeout=5))
                if reply.ok:
                    a.release_requested = True


def profile_path() -> Path:
    return Path(__file__).resolve().parents[1] / "profiles" / "tiny.yaml"
