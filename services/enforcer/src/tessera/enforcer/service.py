"""The node enforcer: where an allocation on this node becomes an enforced environment, and back.

One enforcer runs per node (``TESSERA_NODE``). For every claim allocated here it prepares what the
workload needs: a claim directory with the shared accounting file that libvgpu.so maps, the
environment with HAMi's limit variables, and a CDI 1.1 spec naming that environment; then it
publishes ``prepared``. On release it removes all of that, returns the capacity to the ledger (and the
tenant's quota) and publishes ``released``. Every step checks the claim's recorded state first, so a
redelivered or late event changes nothing.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import msgspec

from tessera.shared import subjects
from tessera.shared.bus import Delivery
from tessera.shared.claimstore import TERMINAL, ClaimStore
from tessera.shared.errors import ConfigError
from tessera.shared.events import (
    ClaimAllocated,
    ClaimPrepared,
    ClaimRecord,
    ClaimReleased,
    ClaimReleaseRequested,
    claim_decoder,
)
from tessera.shared.ledger import Ledger
from tessera.shared.runner import ServiceContext
from tessera.shared.settings import env_str

from tessera.enforcer.limits import workload_env

log = logging.getLogger("tessera.enforcer")

CDI_KIND = "tessera.dev/gpu"


def _default_libvgpu() -> str:
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "native" / "vgpu" / "build" / "libvgpu.so"
        if candidate.exists():
            return str(candidate)
    return "/usr/local/lib/tessera/libvgpu.so"


@dataclass(frozen=True)
class EnforcerSettings:
    node: str
    state_dir: Path
    cdi_dir: Path
    libvgpu: str

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "EnforcerSettings":
        env = os.environ if env is None else env
        node = env.get("TESSERA_NODE", "")
        if not node:
            raise ConfigError("TESSERA_NODE is not set: name the node this enforcer runs on")
        state = Path(env_str(env, "TESSERA_STATE_DIR", f"var/enforcer/{node}")).resolve()
        return cls(
            node=node,
            state_dir=state,
            cdi_dir=Path(env_str(env, "TESSERA_CDI_DIR", str(state / "cdi"))),
            libvgpu=env_str(env, "TESSERA_LIBVGPU", _default_libvgpu()),
        )


def cdi_spec(claim: str, env: Mapping[str, str]) -> dict:
    """A CDI 1.1 spec with one device per claim; the runtime injects its environment."""
    return {
        "cdiVersion": "1.1.0",
        "kind": CDI_KIND,
        "devices": [
            {
                "name": claim,
                "containerEdits": {"env": [f"{k}={v}" for k, v in sorted(env.items())]},
            }
        ],
    }


class EnforcerService:
    def __init__(self, ctx: ServiceContext, settings: EnforcerSettings) -> None:
        self.ctx = ctx
        self.bus = ctx.bus
        self.settings = settings
        self.node = settings.node

    async def start(self) -> dict:
        self.claims = ClaimStore(await self.bus.kv(subjects.KV_CLAIMS))
        self.ledger = Ledger(await self.bus.kv(subjects.KV_LEDGER))
        self.settings.state_dir.mkdir(parents=True, exist_ok=True)
        self.settings.cdi_dir.mkdir(parents=True, exist_ok=True)
        return {"claims": self._consume()}

    async def _consume(self) -> None:
        await self.reconcile()
        await self.bus.consume(
            stream=subjects.STREAM_CLAIMS,
            durable=f"enforcer-{subjects.token(self.node.replace('.', '_'))}",
            filter_subjects=[subjects.claims_of_kind("allocated"), subjects.claims_of_kind("release")],
            decoder=claim_decoder,
            handler=self.handle,
        )

    async def reconcile(self) -> None:
        """Rebuilt from empty memory: finish what the records say is half done on this node."""
        for record in await self.claims.all():
            if record.node != self.node or record.state in TERMINAL:
                continue
            if record.release_requested:
                await self.release(record, record.reason or "requested")
            elif record.state == "allocated":
                await self.prepare(record)

    def claim_dir(self, claim: str) -> Path:
        return self.settings.state_dir / "claims" / claim

    async def handle(self, event, delivery: Delivery) -> None:
        match event:
            case ClaimAllocated() if event.node == self.node:
                record, _ = await self.claims.get(event.claim)
                if record is not None and record.state == "allocated" and record.node == self.node:
                    await self.prepare(record)
            case ClaimReleaseRequested():
                record, _ = await self.claims.get(event.claim)
                if record is not None and record.node == self.node and record.state not in TERMINAL:
                    await self.release(record, event.reason)
            case _:
                return

    async def prepare(self, record: ClaimRecord) -> None:
        directory = self.claim_dir(record.claim)
        directory.mkdir(parents=True, exist_ok=True)
        cache = directory / "vgpu.cache"
        env = workload_env(record.devices, cache, libvgpu=self.settings.libvgpu)
        (directory / "env.json").write_text(json.dumps(env, indent=1, sort_keys=True))
        cdi_path = self.settings.cdi_dir / f"tessera-{record.claim}.json"
        cdi_path.write_text(json.dumps(cdi_spec(record.claim, env), indent=1))
        done = await self.claims.transition(record.claim, "prepared")
        if done is None:
            return  # released meanwhile: the release handler cleans up
        await self.bus.publish(
            subjects.claim(record.tenant, record.claim, "prepared"),
            ClaimPrepared(
                claim=record.claim, tenant=record.tenant, node=self.node, env=env, cache_path=str(cache),
                cdi_device=f"{CDI_KIND}={record.claim}",
            ),
            msg_id=f"{record.claim}:prepared",
        )
        log.info("prepared %s (%s)", record.claim, ", ".join(f"{s.uuid}:{s.memory_mib}MiB" for s in record.devices))

    async def release(self, record: ClaimRecord, reason: str) -> None:
        shutil.rmtree(self.claim_dir(record.claim), ignore_errors=True)
        (self.settings.cdi_dir / f"tessera-{record.claim}.json").unlink(missing_ok=True)
        await self.ledger.release(self.node, record.claim)
        await self.ledger.return_quota(record.tenant, record.claim)
        done = await self.claims.transition(
            record.claim, "released", lambda r: msgspec.structs.replace(r, reason=reason)
        )
        if done is None:
            return
        await self.bus.publish(
            subjects.claim(record.tenant, record.claim, "released"),
            ClaimReleased(claim=record.claim, tenant=record.tenant, node=self.node, reason=reason),
            msg_id=f"{record.claim}:released",
        )
        log.info("released %s (%s)", record.claim, reason)


async def build(ctx: ServiceContext) -> dict:
    return await EnforcerService(ctx, EnforcerSettings.from_env()).start()
