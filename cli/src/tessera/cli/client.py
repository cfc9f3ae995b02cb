"""The CLI's view of Tessera: a client of the public NATS subjects and KV buckets, nothing more.

It never imports a service. Requests go to the documented request/reply subjects; state is read from
the documented buckets (inventory, ledger, claims, tenants), exactly as an outside tool would, and
never created: a reader that finds no bucket says Tessera is not set up there (exit 4).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import msgspec

from tessera.shared import api, identities, subjects
from tessera.shared.bus import Bus
from tessera.shared.claimstore import ClaimStore
from tessera.shared.errors import ConfigError, TemporaryError
from tessera.shared.events import ClaimPrepared, ClaimRecord, NodeInventory, NodeLedger
from tessera.shared.settings import BusSettings

from tessera.cli import checkout, exitcodes, feed
from tessera.cli.errors import CliError
from tessera.cli.fleetmodel import FleetModel

_encoder = msgspec.json.Encoder()

DEFAULT_URL = "nats://127.0.0.1:4222"
# What a running `make up` leaves in the checkout's .run/: the operator's URL, and the read-only
# identity's beside it (`identities.VIEWER`).
LOCAL_URL_FILE = Path(".run") / "nats-url"
LOCAL_VIEWER_URL_FILE = Path(".run") / "nats-url-viewer"


def nats_url(explicit: str | None = None, *, read_only: bool = False) -> str:
    """--nats, else $TESSERA_NATS_URL, else the URL a running `make up` left in the checkout's
    .run/nats-url (for a command that only reads, ``read_only``: the viewer's, in
    .run/nats-url-viewer), else the default local server."""
    if explicit or os.environ.get("TESSERA_NATS_URL"):
        return explicit or os.environ["TESSERA_NATS_URL"]
    root = checkout.find()
    names = (LOCAL_VIEWER_URL_FILE, LOCAL_URL_FILE) if read_only else (LOCAL_URL_FILE,)
    for file in (root / name for name in names) if root is not None else ():
        try:
            return file.read_text().strip()
        except OSError:
            continue
    return DEFAULT_URL


@dataclass
class FleetState:
    inventories: dict[str, NodeInventory]
    ledgers: dict[str, NodeLedger]
    claims: dict[str, ClaimRecord]
    model: FleetModel | None = None  # the same read as the fleet view's model (snapshot, JSON)


def identity(user: str | None = None, password_file: str | None = None) -> dict:
    """Who the CLI connects as: --user / --password-file, else $TESSERA_NATS_USER and
    $TESSERA_NATS_PASSWORD(_FILE) or $TESSERA_NATS_CREDS; else whoever the URL names."""
    env = dict(os.environ)
    if user:
        env["TESSERA_NATS_USER"] = user
    if password_file:
        env["TESSERA_NATS_PASSWORD_FILE"] = password_file
    try:
        bus = BusSettings.from_env(env)
    except ConfigError as exc:
        raise CliError(str(exc), code=exitcodes.USAGE) from None
    return {"user": bus.user, "password": bus.password, "creds_file": bus.creds_file}


class Client:
    """The one client every command uses: connects (exit 4 when NATS or Tessera is not there),
    sends requests and decodes their replies (a refusal: exit 1, ``unavailable``: exit 4), reads
    the buckets, and watches claims."""

    def __init__(self, bus: Bus, claims_kv=None, *, user: str | None = None) -> None:
        self.bus = bus
        self.user = user  # the NATS user connected as (None: the URL's, or the server's default)
        # A tenant's account has no claims bucket: it asks the translator, which answers for its
        # own claims. A platform identity reads the bucket (given, or bound by `claims_bucket`).
        self.as_tenant = identities.is_tenant_user(user)
        self.claims_kv = claims_kv

    @classmethod
    async def connect(cls, url: str | None = None, *, user: str | None = None,
                      password_file: str | None = None, read_only: bool = False,
                      claims: bool = True) -> "Client":
        """``claims``: bind the claims bucket now (a platform identity's commands read claims); the
        tenant commands, which only ask the control-plane manager, pass False."""
        settings = BusSettings(url=nats_url(url, read_only=read_only), max_reconnect_attempts=3,
                               **identity(user, password_file))
        try:
            bus = await Bus.connect(settings, "cli", connect_timeout=3)
        except TemporaryError as exc:
            raise CliError(f"{exc}\nIs Tessera running? Start it with 'make up', or set TESSERA_NATS_URL.",
                           code=exitcodes.UNAVAILABLE) from None
        user = settings.user or urlsplit(settings.url).username
        client = cls(bus, user=user)
        if claims and not client.as_tenant:
            try:
                await client.claims_bucket()
            except CliError:
                await bus.close()
                raise
        return client

    async def claims_bucket(self):
        """The claims bucket (a platform identity's), bound on first use: a reader never creates it."""
        if self.claims_kv is None:
            try:
                self.claims_kv = await self.bus.kv(subjects.KV_CLAIMS)
            except TemporaryError as exc:  # TopologyMissing (start the services first) or NATS not answering
                raise CliError(f"{exc}; is Tessera running against this server?", code=exitcodes.UNAVAILABLE) from None
            except Exception as exc:
                raise CliError(f"cannot read the claims bucket as NATS user {self.user or '(none)'}: {exc!r}") from None
        return self.claims_kv

    @classmethod
    async def from_args(cls, args, *, read_only: bool = False, claims: bool = True) -> "Client":
        return await cls.connect(args.nats, user=args.user, password_file=args.password_file, read_only=read_only,
                                 claims=claims)

    async def close(self) -> None:
        await self.bus.close()

    async def request(self, subject: str, request: msgspec.Struct, timeout: float = 10.0) -> api.Reply:
        """The decoded reply, refusal or not; no answer (NATS away, no service) is exit 4."""
        try:
            data = await self.bus.request(subject, _encoder.encode(request), timeout=timeout)
        except TemporaryError as exc:
            raise CliError(str(exc), code=exitcodes.UNAVAILABLE) from None
        return api.decode_reply(data)

    async def call(self, subject: str, request: msgspec.Struct, timeout: float = 10.0):
        """The reply's result; a refusal is a CliError (exit 1, or 4 for ``unavailable``)."""
        return self._result(await self.request(subject, request, timeout))

    @staticmethod
    def _result(reply: api.Reply):
        if not reply.ok:
            err = reply.error
            where = f" (field {err.field})" if err and err.field else ""
            code = exitcodes.UNAVAILABLE if err and err.code == "unavailable" else exitcodes.FAILED
            raise CliError(f"{err.message if err else 'request failed'}{where}", code=code)
        return reply.result

    async def submit(self, request: api.SubmitRequest, attempts: int = 3, timeout: float = 10.0) -> dict:
        """Submit, retrying a lost or ``unavailable`` answer under one claim id chosen here before the
        first attempt: a retry then finds the claim the lost attempt recorded instead of making a
        second one, and the error after the last attempt names the id to look for."""
        if request.claim is None:
            request = msgspec.structs.replace(request, claim=api.new_claim_id())
        payload = _encoder.encode(request)
        for attempt in range(1, attempts + 1):
            try:
                reply = api.decode_reply(await self.bus.request(subjects.API_SUBMIT, payload, timeout=timeout))
            except TemporaryError as exc:
                problem = str(exc)
            else:
                if reply.ok or reply.error is None or reply.error.code != "unavailable":
                    return self._result(reply)
                problem = reply.error.message
            if attempt < attempts:
                await asyncio.sleep(0.5 * attempt)
        raise CliError(f"{problem}\nThe claim may have been recorded as {request.claim}: check with "
                       f"'tessera claims', or submit again with --claim {request.claim}", code=exitcodes.UNAVAILABLE)

    async def release(self, claim: str, reason: str = "requested") -> dict:
        return await self.call(subjects.API_RELEASE, api.ReleaseRequest(claim=claim, reason=reason))

    async def fleet(self) -> FleetState:
        """One read of the buckets (never creating one): inventories, ledgers, claims, tenants."""
        if self.as_tenant:
            raise CliError("this NATS identity is a tenant's: the fleet's state needs operator credentials")
        try:
            model = await feed.load(self.bus)
        except TemporaryError as exc:
            raise CliError(f"{exc}; is Tessera running against this server?", code=exitcodes.UNAVAILABLE) from None
        return FleetState(dict(model.inventories), dict(model.ledgers), dict(model.claims), model)

    async def claim(self, claim: str) -> ClaimRecord | None:
        if self.as_tenant:
            try:
                found = await self.call(subjects.API_CLAIM_GET, api.ClaimRequest(claim=claim))
            except CliError as exc:
                if "does not exist" in str(exc):
                    return None
                raise
            return msgspec.convert(found["record"], ClaimRecord)
        record, _ = await ClaimStore(await self.claims_bucket()).get(claim)
        return record

    async def prepared(self, claim: str) -> ClaimPrepared | None:
        """The claim's ``prepared`` event (its environment), through the translator."""
        found = await self.call(subjects.API_CLAIM_GET, api.ClaimRequest(claim=claim))
        return msgspec.convert(found["prepared"], ClaimPrepared) if found.get("prepared") else None

    async def running(self, claim: str, pids: list[int]) -> None:
        await self.call(subjects.API_CLAIM_RUNNING, api.ClaimRequest(claim=claim, pids=pids))

    async def wait_for(self, claim: str, states: set[str], timeout: float = 30.0) -> ClaimRecord:
        """Wait until the claim's record reaches one of ``states``, by watching, not polling: the
        operator watches the claim's key in the claims bucket, a tenant its claim's events (its
        account sees those, not the bucket); each change is re-read, and the first read happens
        after the watch is in place, so no change between the two is missed."""
        changed = asyncio.Event()
        if not self.as_tenant:
            watcher = await (await self.claims_bucket()).watch(subjects.token(claim))

            async def drain() -> None:
                async for _ in watcher:
                    changed.set()

            task = asyncio.create_task(drain())
            stop = watcher.stop
        else:
            async def on_event(_msg) -> None:
                changed.set()

            sub = await self.bus.listen(f"{subjects.CLAIMS}.*.{subjects.token(claim)}.>", on_event)
            task = None
            stop = sub.unsubscribe
        deadline = time.monotonic() + timeout
        record = None
        try:
            while True:
                changed.clear()
                record = await self.claim(claim)
                if record is not None and record.state in states:
                    return record
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(changed.wait(), left)
                except asyncio.TimeoutError:
                    pass
        finally:
            with contextlib.suppress(Exception):
                await stop()
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        state = record.state if record else "unknown"
        raise CliError(f"claim {claim} is still {state} after {timeout:.0f}s (waiting for {', '.join(sorted(states))})",
                       code=exitcodes.TIMEOUT)
