"""Every stream and KV bucket of Tessera, declared once with its production settings.

Before this module each stream got the same hard-coded week and no size limit, each bucket was made
by whoever first asked for it (a read-only `tessera status` against an empty server created the
buckets at R1), and a bucket created at R1 stayed R1 when the deployment moved to three replicas.
Here there is one table (`declare`) built from one set of settings (`TopologySettings`); services
make the server match it at start-up (`ensure`: create what is missing, update the replicas and
limits of what exists, KV buckets included, through a stream update of the bucket's stream);
readers (the CLI, the UI, auditors) only `bind` and are told to start the services when it is absent.

Sizing (defaults; docs/configuration.md names the settings): the claims and tenants streams keep a
week of events and at most ``stream_max_bytes`` each; inventory (heartbeats) and usage are
superseded every few seconds by newer reports, so they keep ``heartbeat_retention`` /
``usage_retention`` (an hour) and a per-node cap of recent messages, which bounds them at
thousands of nodes: 5,000 nodes x 64 messages x ~1 KiB is ~330 MiB at the very most, under the byte
cap. Event streams discard the *oldest* messages when full (a stream that refused new events would
stop releases too); buckets refuse new writes when full (current state is never dropped silently).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace

import nats.errors
import nats.js.errors
from nats.js import api
from nats.js.client import JetStreamContext
from nats.js.kv import KeyValue

from tessera.shared import subjects
from tessera.shared.errors import ConfigError, TemporaryError
from tessera.shared.settings import TopologySettings

log = logging.getLogger("tessera.topology")

# The control-plane manager's buckets (tenant CA keys, datastore passwords); named here so that the
# table is whole, owned and permitted by `tessera.shared.identities`.
KV_CONTROLPLANES = "controlplanes"
KV_SECRETS = "controlplane-secrets"

MIB = 1024 * 1024


class TopologyMissing(TemporaryError):
    """A stream or bucket a reader needs does not exist: the services that create it never ran."""


@dataclass(frozen=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    max_age: float
    max_bytes: int
    max_msgs_per_subject: int = -1
    discard: api.DiscardPolicy = api.DiscardPolicy.OLD


@dataclass(frozen=True)
class BucketSpec:
    name: str
    history: int
    max_bytes: int

    @property
    def stream(self) -> str:
        return f"KV_{self.name}"


@dataclass(frozen=True)
class Topology:
    settings: TopologySettings
    streams: dict[str, StreamSpec]
    buckets: dict[str, BucketSpec]

    def stream_config(self, spec: StreamSpec) -> api.StreamConfig:
        return api.StreamConfig(
            name=spec.name,
            subjects=list(spec.subjects),
            storage=_storage(self.settings),
            num_replicas=self.settings.replicas,
            duplicate_window=self.settings.duplicate_window,
            max_age=spec.max_age,
            max_bytes=spec.max_bytes,
            max_msgs_per_subject=spec.max_msgs_per_subject,
            discard=spec.discard,
            retention=api.RetentionPolicy.LIMITS,
        )


# Recent messages kept per node on the heartbeat and usage subjects (their newest is what counts).
PER_NODE_MESSAGES = 64


def declare(settings: TopologySettings) -> Topology:
    """The table: every stream and bucket with its limits."""
    s = settings
    streams = [
        StreamSpec(subjects.STREAM_CLAIMS, (subjects.STREAMS[subjects.STREAM_CLAIMS],), s.event_retention,
                   s.stream_max_bytes),
        StreamSpec(subjects.STREAM_TENANTS, (subjects.STREAMS[subjects.STREAM_TENANTS],), s.event_retention,
                   s.stream_max_bytes),
        StreamSpec(subjects.STREAM_INVENTORY, (subjects.STREAMS[subjects.STREAM_INVENTORY],),
                   s.heartbeat_retention, s.stream_max_bytes, PER_NODE_MESSAGES),
        StreamSpec(subjects.STREAM_USAGE, (subjects.STREAMS[subjects.STREAM_USAGE],), s.usage_retention,
                   s.stream_max_bytes, PER_NODE_MESSAGES),
        StreamSpec(subjects.STREAM_DLQ, (subjects.STREAMS[subjects.STREAM_DLQ],), s.dlq_retention,
                   s.stream_max_bytes),
    ]
    buckets = [
        BucketSpec(subjects.KV_INVENTORY, 5, s.bucket_max_bytes),
        BucketSpec(subjects.KV_LEDGER, s.ledger_history, s.bucket_max_bytes),
        # Released claims are pruned after TESSERA_CLAIM_RETENTION (tessera.shared.claimpruning).
        BucketSpec(subjects.KV_CLAIMS, 5, s.bucket_max_bytes),
        BucketSpec(subjects.KV_TENANTS, 5, s.bucket_max_bytes),
        BucketSpec(KV_CONTROLPLANES, 5, 64 * MIB),
        BucketSpec(KV_SECRETS, 5, 64 * MIB),
    ]
    assert {x.name for x in streams} == set(subjects.STREAMS), "a stream of subjects.STREAMS is not declared"
    return Topology(settings, {x.name: x for x in streams}, {b.name: b for b in buckets})


def _storage(settings: TopologySettings) -> api.StorageType:
    return api.StorageType.FILE if settings.file_storage else api.StorageType.MEMORY


# --- making the server match the table (services) -------------------------------------------------

_MANAGED = ("num_replicas", "max_bytes", "max_age", "max_msgs_per_subject", "discard", "duplicate_window")


def _differences(current: api.StreamConfig, wanted: api.StreamConfig) -> dict[str, tuple]:
    out = {}
    for name in _MANAGED:
        have, want = getattr(current, name), getattr(wanted, name)
        if name == "max_age" or name == "duplicate_window":
            have, want = round(have or 0.0, 3), round(want or 0.0, 3)
        if have != want:
            out[name] = (have, want)
    return out


async def _apply(js: JetStreamContext, wanted: api.StreamConfig) -> str:
    """Create ``wanted`` or bring an existing stream's managed fields to it; what was done."""
    name = wanted.name
    if name is None:  # both callers name it (`Topology.stream_config`, `bucket_config`)
        raise ValueError("a stream config without a name: give its StreamSpec or BucketSpec one")
    try:
        info = await js.stream_info(name)
    except nats.js.errors.NotFoundError:
        try:
            await js.add_stream(wanted)
            return "created"
        except nats.js.errors.APIError as exc:
            if exc.err_code != 10058:  # 10058: created by a peer meanwhile; compare with theirs below
                raise _refused(wanted, exc) from None
            info = await js.stream_info(name)
    current = info.config
    if current.storage is not None and wanted.storage is not None and current.storage != wanted.storage:
        log.warning("%s is stored in %s, the settings ask for %s: a stream's storage cannot change in place "
                    "(copy it to a new stream, or set TESSERA_STREAM_STORAGE to match)",
                    wanted.name, current.storage.value, wanted.storage.value)
    changes = _differences(current, wanted)
    if not changes:
        return "unchanged"
    updated = replace(current, **{name: getattr(wanted, name) for name in changes})
    try:
        await js.update_stream(updated)
    except nats.js.errors.APIError as exc:
        raise _refused(wanted, exc) from None
    log.info("%s updated: %s", wanted.name,
             ", ".join(f"{k} {have} -> {want}" for k, (have, want) in changes.items()))
    return "updated"


# JetStream not (yet) available, no cluster quorum, a peer still catching up: retried by the caller.
_NOT_NOW = frozenset({10008, 10039, 10118})


def _refused(wanted: api.StreamConfig, exc: nats.js.errors.APIError) -> Exception:
    """A refusal is a setting that does not fit this server: stop the service saying which."""
    hint = ""
    if wanted.num_replicas and wanted.num_replicas > 1 and "replicas" in (exc.description or "").lower():
        hint = (f"; TESSERA_STREAM_REPLICAS={wanted.num_replicas} needs a JetStream cluster of at least"
                f" {wanted.num_replicas} servers: set it to 1 for a single server")
    what = f"the NATS server refused stream {wanted.name} (error {exc.err_code}): {exc.description}{hint}"
    if exc.err_code in _NOT_NOW or (exc.code == 503 and not hint):
        return TemporaryError(what)  # a cluster still electing its leaders: ask again
    return ConfigError(what)


def bucket_config(topology: Topology, spec: BucketSpec) -> api.StreamConfig:
    """The stream behind a KV bucket, as nats-py's create_key_value makes it, with our limits."""
    s = topology.settings
    return api.StreamConfig(
        name=spec.stream,
        subjects=[f"$KV.{spec.name}.>"],
        allow_rollup_hdrs=True,
        deny_delete=True,
        # Every get answered by the bucket's leader (STREAM.MSG.GET): with direct gets a follower
        # that is behind answers too, and a key written a moment ago reads as absent (the cluster
        # test saw a submit refused with "tenant does not exist" just after a leader was killed).
        allow_direct=False,
        discard=api.DiscardPolicy.NEW,
        duplicate_window=min(s.duplicate_window, 120.0),
        max_bytes=spec.max_bytes,
        max_consumers=-1,
        max_msgs=-1,
        max_msgs_per_subject=spec.history,
        num_replicas=s.replicas,
        storage=_storage(s),
    )


async def ensure(js: JetStreamContext, topology: Topology, streams: tuple[str, ...] = (),
                 buckets: tuple[str, ...] = (), *, patience: float = 60.0) -> dict[str, str]:
    """Create or update the named streams and buckets (all of the table when both are empty) so the
    server holds what the table says; returns name -> "created" / "updated" / "unchanged"."""
    if not streams and not buckets:
        streams, buckets = tuple(topology.streams), tuple(topology.buckets)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience
    while True:
        try:
            return await _ensure_all(js, topology, streams, buckets)
        except (TemporaryError, nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError) as exc:
            if loop.time() > deadline:
                raise TemporaryError(f"cannot lay out the streams and buckets: {exc}") from exc
            log.warning("streams and buckets not ready yet (%s); retrying", exc)
            await asyncio.sleep(0.5)


async def _ensure_all(js: JetStreamContext, topology: Topology, streams: tuple[str, ...],
                      buckets: tuple[str, ...]) -> dict[str, str]:
    done = {}
    for name in streams:
        done[name] = await _apply(js, topology.stream_config(topology.streams[name]))
    for name in buckets:
        spec = topology.buckets[name]
        done[name] = await _apply(js, bucket_config(topology, spec))
    return done


# --- binding (everyone; readers only ever do this) ---------------------------------------------

async def bind(js: JetStreamContext, bucket: str) -> KeyValue:
    """The bucket, if it exists; TopologyMissing (saying what to do) if it does not. Never creates it."""
    try:
        return await js.key_value(bucket)
    except nats.js.errors.BucketNotFoundError:
        raise TopologyMissing(
            f"the KV bucket {bucket!r} does not exist on this NATS server: start the Tessera services "
            f"first (they create their streams and buckets), or check that this is the right server"
        ) from None
    except (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError) as exc:
        raise TemporaryError(f"cannot look up the KV bucket {bucket!r}: {exc!r}") from exc
