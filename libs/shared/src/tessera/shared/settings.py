"""Settings that declare themselves: each field names its variable, default, type and limits.

Every service has one frozen settings object, read from the environment once at start-up and
handed down; nothing reads os.environ later and nothing lives in globals. A settings class is a
frozen dataclass deriving from `FromEnv` whose fields are made with `setting()`: the variable, a
line saying what it means (docs/configuration.md is generated from these lines), the default, and
the limits (``choices``, ``minimum``, ``maximum``, ``above``). The type comes from the annotation:
``str``, ``int``, ``float``, ``bool``, ``Path``, ``tuple[str, ...]`` (comma-separated), a
``Literal`` (its values are the choices), or ``X | None`` (blank: None).

`read` parses and checks every field before it returns, and refuses with all that is wrong at once
(`SettingsError`), each line naming the variable, what is wrong and what it takes; then the class's
`FromEnv.check` looks at what spans several variables or the machine (a file that must exist).
The runner does this for the shared `ServiceSettings` and the service's own class before anything
connects (`tessera.shared.runner.main`).

The same settings every service shares live here too: how to reach NATS and shape the streams
(`BusSettings`), the probe and metrics listeners, tracing and logging (`ServiceSettings`).
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Mapping, TypeVar, Union

from tessera.shared import subjects
from tessera.shared.errors import ConfigError

SETTING = "tessera.setting"  # the key of a field's declaration in its dataclass metadata


@dataclass(frozen=True)
class Setting:
    """How one field is read from the environment and how docs/configuration.md describes it."""

    variable: str
    doc: str
    # The default column of the docs when the field's default says too little ("the host name").
    shown: str | None = None
    # Allowed values, case-insensitive: a tuple (the value is the one matched), or a mapping from
    # the word to the value it stands for (``{"file": True, "memory": False}``).
    choices: tuple[str, ...] | Mapping[str, Any] | None = None
    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None  # more than this (an exclusive minimum: "more than 0 seconds")
    # Text -> value, for what the types above do not say; raise ValueError("must be ...") (it is
    # prefixed with VAR='text') or a ConfigError with a whole message.
    parse: Callable[[str], Any] | None = None
    # The text read when the variable is not set, when it depends on other fields (given the values
    # read so far, in field order) or on the machine; it goes through the same parsing.
    unset: str | Callable[[Mapping[str, Any]], str] | None = None
    required: str | None = None  # set: the variable must be set, and this says what to set it to
    group: str | None = None  # a sub-table of the service's section in docs/configuration.md
    # A second variable naming a file that holds the value (a mounted Secret), read first.
    file_variable: str | None = None
    file_doc: str | None = None


def setting(variable: str, doc: str, default: Any = dataclasses.MISSING, *,
            default_factory: Callable[[], Any] | Any = dataclasses.MISSING, repr: bool = True,
            shown: str | None = None, choices: tuple[str, ...] | Mapping[str, Any] | None = None,
            minimum: float | None = None, maximum: float | None = None, above: float | None = None,
            parse: Callable[[str], Any] | None = None,
            unset: str | Callable[[Mapping[str, Any]], str] | None = None, required: str | None = None,
            group: str | None = None, file_variable: str | None = None, file_doc: str | None = None) -> Any:
    """A dataclass field read from ``variable``; without a default the constructor needs it too."""
    declared = Setting(variable, doc, shown, choices, minimum, maximum, above, parse, unset, required, group,
                       file_variable, file_doc)
    return field(default=default, default_factory=default_factory, repr=repr, metadata={SETTING: declared})


class SettingsError(ConfigError):
    """Everything wrong with a service's settings at once, one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        if len(self.problems) == 1:
            text = self.problems[0]
        else:
            text = f"{len(self.problems)} settings are wrong:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(text)


class FromEnv:
    """The base of a settings class: `from_env` reads it (see `read`), `check` relates its fields."""

    @classmethod
    def from_env(cls: type[S], env: Mapping[str, str] | None = None, **given: Any) -> S:
        return read(cls, env, **given)

    def check(self) -> Iterable[str]:
        """What is wrong between this object's fields, or between them and the machine (a file that
        must exist), one message each. It runs also when some variables were bad, with those at
        their defaults (a required one is missing: an AttributeError ends the check)."""
        return ()


S = TypeVar("S", bound=FromEnv)


def read(cls: type[S], env: Mapping[str, str] | None = None, **given: Any) -> S:
    """``cls`` read from ``env`` (the process environment if None); ``given`` fields are not read.
    Refuses with a `SettingsError` listing every problem."""
    value, problems = collect(cls, env, **given)
    if problems:
        raise SettingsError(problems)
    assert value is not None
    return value


def collect(cls: type[S], env: Mapping[str, str] | None = None, **given: Any) -> tuple[S | None, list[str]]:
    """``cls`` read from ``env`` and the problems found; the object is None when there are any."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    problems: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in given:
            values[f.name] = given[f.name]
            continue
        kind = hints[f.name]
        declared = f.metadata.get(SETTING)
        if declared is None:
            if isinstance(kind, type) and issubclass(kind, FromEnv):  # nested: the bus of a service
                nested, found = collect(kind, env)
                problems += found
                if nested is not None:
                    values[f.name] = nested
            continue
        try:
            values[f.name] = _read_field(declared, kind, env, values)
        except _Unchanged:  # the default, also for the fields after it that depend on it
            if _has_default(f):
                values[f.name] = _default(f)
        except _NeedsFailed:  # (a field it depends on failed: that one is reported)
            continue
        except ConfigError as exc:
            problems.append(str(exc))
    if not problems:
        value = cls(**values)
        found = list(value.check())
        return (None, found) if found else (value, [])
    # The relations are still checked, with each bad variable at its default; a field without one
    # (a required variable) is missing, and a check that reads it stops there.
    partial = object.__new__(cls)
    missing = set()
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in values or _has_default(f):
            object.__setattr__(partial, f.name, values[f.name] if f.name in values else _default(f))
        else:
            missing.add(f.name)
    found = []
    try:
        for problem in partial.check():
            found.append(problem)
    except AttributeError as exc:
        if exc.name not in missing:  # a mistake in check() itself, not a required variable left unset
            raise
    return None, problems + found


def _has_default(f: dataclasses.Field) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]


class _Unchanged(Exception):
    """The variable is not set: the field keeps its dataclass default."""


class _NeedsFailed(Exception):
    """The text used when a variable is unset depends on a field that failed."""


def variables(cls: type) -> list[tuple[Setting, dataclasses.Field, Any]]:
    """Every declared field of ``cls`` in order, the nested settings' fields in place of their
    field: (declaration, field, type)."""
    found: list[tuple[Setting, dataclasses.Field, Any]] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        declared = f.metadata.get(SETTING)
        kind = hints[f.name]
        if declared is not None:
            found.append((declared, f, kind))
        elif isinstance(kind, type) and issubclass(kind, FromEnv):
            found += variables(kind)
    return found


def _read_field(declared: Setting, kind: Any, env: Mapping[str, str], values: Mapping[str, Any]) -> Any:
    if declared.file_variable:
        path = env.get(declared.file_variable)
        if path:
            try:
                with open(path) as f:
                    return f.read().strip()
            except OSError as exc:
                raise ConfigError(f"{declared.file_variable}={path}: cannot read it ({exc.strerror}); "
                                  "name a file this service can read") from None
    base, optional = _unwrap(kind)
    raw = env.get(declared.variable)
    blank = raw is None or raw.strip() == ""
    if declared.required is not None and blank:
        raise ConfigError(f"{declared.variable} is not set: {declared.required}")
    # A set but blank variable is text like any other where the type is text ("" is a value, an
    # empty list, or what a parser makes of it); elsewhere it is as good as unset.
    keeps_blank = not optional and (declared.parse is not None or _is_list(base)
                                    or (_choices(declared, base) is None and base in (str, Path)))
    if raw is None or (blank and not keeps_blank):
        if declared.unset is None:
            raise _Unchanged
        try:
            raw = declared.unset(values) if callable(declared.unset) else declared.unset
        except KeyError:
            raise _NeedsFailed from None
        if raw is None:
            raise _Unchanged
    if optional and raw.strip() == "":
        return None
    return parse_value(declared, base, raw)


def _unwrap(kind: Any) -> tuple[Any, bool]:
    """(the type, whether None is allowed) of ``X | None``."""
    if typing.get_origin(kind) in (Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return kind, False


def _is_list(kind: Any) -> bool:
    return typing.get_origin(kind) is tuple


def _choices(declared: Setting, kind: Any) -> tuple[str, ...] | Mapping[str, Any] | None:
    if declared.choices is not None:
        return declared.choices
    if typing.get_origin(kind) is Literal:
        return typing.get_args(kind)
    return None


def parse_value(declared: Setting, kind: Any, raw: str) -> Any:
    """The value of one variable's text, as its declaration and type say; a ConfigError naming the
    variable, what is wrong and what it takes otherwise."""
    name = declared.variable
    if declared.parse is not None:
        try:
            return declared.parse(raw)
        except ValueError as exc:
            raise ConfigError(f"{name}={raw!r} {exc}") from None
    choices = _choices(declared, kind)
    if _is_list(kind):
        items = tuple(item.strip() for item in raw.split(",") if item.strip())
        if choices is not None:
            return tuple(_choice(name, raw, item, choices, listing=True) for item in items)
        return items
    if choices is not None:
        return _choice(name, raw, raw, choices)
    if kind is bool:
        return parse_bool(name, raw)
    if kind is int:
        try:
            value: float = int(raw)
        except ValueError:
            raise ConfigError(f"{name}={raw!r} is not an integer; set it to a whole number") from None
        return _within(declared, raw, value)
    if kind is float:
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"{name}={raw!r} is not a number; set it to e.g. 2.5") from None
        return _within(declared, raw, value)
    if kind is Path:
        return Path(raw)
    if kind is str:
        return raw
    raise TypeError(f"{name}: no parser for {kind!r}; give the setting parse=")


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_bool(name: str, raw: str) -> bool:
    """The one reading of a yes/no variable."""
    value = raw.strip().lower()
    if value not in _TRUE + _FALSE:
        raise ConfigError(f"{name}={raw!r}: use true or false (or 1 / 0)")
    return value in _TRUE


def node_name(raw: str) -> str:
    """A node's name (TESSERA_NODE): what the subjects of its events can carry (`subjects.node_token`)."""
    node = raw.strip()
    if node == subjects.ANY_NODE:
        raise ValueError("is the wildcard of every node; name this one node")
    try:
        subjects.node_token(node)
    except ValueError:
        raise ValueError("cannot be a node name: use letters, digits, '.', '-' and '_'") from None
    return node


def _choice(name: str, raw: str, word: str, choices: tuple[str, ...] | Mapping[str, Any], listing: bool = False) -> Any:
    """The one reading of a variable that takes one of a few words (case-insensitive)."""
    wanted = word.strip().lower()
    for choice in choices:
        if str(choice).lower() == wanted:
            return choices[choice] if isinstance(choices, Mapping) else choice
    words = ", ".join(str(c) for c in choices)
    if listing:
        raise ConfigError(f"{name}={raw!r}: {word!r} is not one of {words}; list any of them, comma-separated")
    raise ConfigError(f"{name}={raw!r}: use one of {words}")


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _within(declared: Setting, raw: str, value: float) -> float:
    name, low, high = declared.variable, declared.minimum, declared.maximum
    if (low is not None and value < low) or (high is not None and value > high):
        if low is not None and high is not None:
            raise ConfigError(f"{name}={raw.strip()} is out of range; use {_number(low)} to {_number(high)}")
        if low is not None:
            raise ConfigError(f"{name}={raw.strip()} is below the minimum {_number(low)}; use {_number(low)} or more")
        assert high is not None  # (no minimum, so the maximum is what failed)
        raise ConfigError(f"{name}={raw.strip()} is above the maximum {_number(high)}; use {_number(high)} or less")
    if declared.above is not None and value <= declared.above:
        raise ConfigError(f"{name}={raw.strip()} must be more than {_number(declared.above)}")
    return value


MIB = 1024 * 1024


@dataclass(frozen=True)
class TopologySettings:
    """The knobs of the stream and bucket table (`tessera.shared.topology`); BusSettings carries
    them from the environment."""

    replicas: int = 1
    file_storage: bool = True
    duplicate_window: float = 120.0
    stream_max_bytes: int = 1024 * MIB
    bucket_max_bytes: int = 1024 * MIB
    heartbeat_retention: float = 3600.0
    usage_retention: float = 3600.0
    event_retention: float = 7 * 24 * 3600.0
    dlq_retention: float = 30 * 24 * 3600.0
    ledger_history: int = 5


@dataclass(frozen=True)
class BusSettings(FromEnv):
    """How to reach NATS and how to shape the streams (production values are the defaults)."""

    url: str = setting(
        "TESSERA_NATS_URL",
        "the NATS server to connect to, or a cluster's servers comma-separated "
        "(`nats://n1:4222,nats://n2:4222,nats://n3:4222`: the client moves to another when one goes away); "
        "the service reconnects forever. Also read by the `tessera` CLI.",
        "nats://127.0.0.1:4222")
    creds_file: str | None = setting(
        "TESSERA_NATS_CREDS",
        "a NATS credentials file (user JWT + nkey seed) for servers that use decentralised auth", None)
    # The identity, when not in the URL: a user (and its password) of `tessera.shared.identities`.
    user: str | None = setting(
        "TESSERA_NATS_USER",
        "the NATS user to connect as: each service its own (`tessera.shared.identities`: `controlplane`, "
        "`capacity`, `translator`, `placement`, `enforcer-<node>`, `operator` for the CLI), or a tenant's "
        "`tenant-<name>`. Also read by the CLI (`--user`).", None, shown="unset (the URL's user)")
    password: str | None = setting(
        "TESSERA_NATS_PASSWORD", "that user's password (prefer the file below)", None,
        file_variable="TESSERA_NATS_PASSWORD_FILE",
        file_doc="a file holding that user's password (a mounted Secret); read before `TESSERA_NATS_PASSWORD`. "
                 "Also read by the CLI (`--password-file`).")
    # Never give up reconnecting: a service outlives a NATS restart (the client default stops ~2 min).
    max_reconnect_attempts: int = -1
    reconnect_time_wait: float = 0.5
    file_storage: bool = setting(
        "TESSERA_STREAM_STORAGE",
        "`file` or `memory`: storage of the streams and KV buckets the service creates if missing (a stream's "
        "storage cannot change in place: a mismatch is logged)", True, choices={"file": True, "memory": False})
    replicas: int = setting(
        "TESSERA_STREAM_REPLICAS",
        "replicas of every stream *and* KV bucket (3 on a clustered JetStream). At start a service brings the "
        "streams and buckets it uses to this value, so an R1 deployment moved to a cluster becomes R3 on the next "
        "start. More than the cluster has stops the service naming this variable. How often the server syncs to "
        "disk is its own `sync_interval` (see `deploy/compose/nats/` and `deploy/k8s/nats.yaml`)", 1, minimum=1)
    duplicate_window: float = 120.0
    # Limits of the streams and buckets (tessera.shared.topology explains the sizing).
    stream_max_bytes: int = setting(
        "TESSERA_STREAM_MAX_BYTES",
        "the most bytes each event stream keeps; when full the oldest events go (a stream that refused new "
        "events would stop releases too). See \"Streams and buckets\" below", 1024 * MIB, minimum=MIB,
        shown="`1073741824` (1 GiB)")
    bucket_max_bytes: int = setting(
        "TESSERA_BUCKET_MAX_BYTES",
        "the most bytes each platform KV bucket keeps; when full a write is refused (current state is never "
        "dropped)", 1024 * MIB, minimum=MIB, shown="`1073741824` (1 GiB)")
    ledger_history: int = setting(
        "TESSERA_LEDGER_HISTORY",
        "past revisions of each key the `ledger` bucket keeps (every allocation and release writes one): what an "
        "auditor that reads every revision may fall behind by, say through a NATS leader election, without "
        "missing one. The other buckets keep 5", 5, minimum=1, maximum=64)
    heartbeat_retention: float = setting(
        "TESSERA_HEARTBEAT_RETENTION",
        "seconds the inventory stream (inventory events and heartbeats) keeps a message; at most 64 per node are "
        "kept in any case", 3600.0, above=0)
    usage_retention: float = setting(
        "TESSERA_USAGE_RETENTION", "seconds the usage stream keeps a report; at most 64 per node", 3600.0, above=0)
    # Released claims are removed from the claims bucket this long after their last change
    # (tessera.shared.claimpruning); 0 keeps them forever.
    claim_retention: float = setting(
        "TESSERA_CLAIM_RETENTION",
        "seconds a released claim's record stays in the claims bucket after its last change; then the translator "
        "removes it (see \"Released claims\" below). Never less than the claims stream's 7 days; `0` keeps every "
        "record", 7 * 24 * 3600.0, minimum=0, shown="`604800` (7 days)")
    claim_prune_interval: float = setting(
        "TESSERA_CLAIM_PRUNE_INTERVAL", "seconds between the translator's passes over the claims bucket", 600.0,
        above=0)
    max_deliver: int = setting(
        "TESSERA_MAX_DELIVER",
        "deliveries of one event before it goes to the dead-letter subject `tessera.dlq.<service>` with the reason",
        5, minimum=1)
    ack_wait: float = setting(
        "TESSERA_ACK_WAIT", "seconds a consumer may hold an event before the server delivers it again", 30.0)

    @property
    def servers(self) -> list[str]:
        """The server URLs: ``TESSERA_NATS_URL`` may list several, comma-separated (a cluster's
        members; the client moves to another when one goes away)."""
        return [u.strip() for u in self.url.split(",") if u.strip()]

    def topology(self) -> TopologySettings:
        return TopologySettings(
            replicas=self.replicas, file_storage=self.file_storage, duplicate_window=self.duplicate_window,
            stream_max_bytes=self.stream_max_bytes, bucket_max_bytes=self.bucket_max_bytes,
            heartbeat_retention=self.heartbeat_retention, usage_retention=self.usage_retention,
            ledger_history=self.ledger_history,
        )


@dataclass(frozen=True, kw_only=True)
class ServiceSettings(FromEnv):
    """What every service needs: its name, the bus, the probe server, the metrics listener and tracing.
    ``service`` is not read: the runner gives it (``ServiceSettings.from_env(env, service=...)``)."""

    service: str
    bus: BusSettings = field(default_factory=BusSettings)
    http_host: str = setting(
        "TESSERA_HTTP_HOST",
        "address of the probe server (`/healthz`, `/readyz`; nothing else: the metrics have their own listener, "
        "`TESSERA_METRICS_PORT`)", "127.0.0.1")
    http_port: int = setting(
        "TESSERA_HTTP_PORT", "its port; `0` starts no probe server", 0, minimum=0, maximum=65535)
    # /metrics names tenants and claims: a listener of its own, never the probe port, which the
    # kubelet (and so anything on the pod network) reaches (tessera.shared.metrics). 0: none.
    metrics_port: int = setting(
        "TESSERA_METRICS_PORT",
        "port of the service's `/metrics` listener, which serves `/metrics` only (`docs/metrics.md` lists the "
        "series). They name tenants and claims (quota use, HAMi's per-claim series), so they are for the "
        "monitoring system alone: never the probe port (a service refuses to start with both on one port), and "
        "`deploy/k8s` admits only the `monitoring` namespace to it (NetworkPolicies `enforcer-metrics`, "
        "`tessera-metrics`). Without Kubernetes, see `docs/tenants.md` on who can reach it", 0, minimum=0,
        maximum=65535,
        shown="`0` (no metrics listener; `tessera up` gives each service a free port, `deploy/` 9394)")
    metrics_host: str = setting(
        "TESSERA_METRICS_HOST",
        "address of that listener (`0.0.0.0` in `deploy/`, behind the NetworkPolicy or on the compose network)",
        "127.0.0.1")
    metrics_interval: float = setting(
        "TESSERA_METRICS_INTERVAL",
        "seconds between refreshes of what a scrape cannot read from memory: consumer lag and dead letters (a "
        "round trip to NATS), placement's fragmentation and per-GPU series", 10.0, above=0)
    metrics_legacy: bool = setting(
        "TESSERA_METRICS_LEGACY",
        "`1`: also export HAMi's older metric names (the enforcer's `vGPU_device_memory_usage_in_bytes`, ..., "
        "placement's `GPUDeviceMemoryLimit`, `QuotaUsed`, ...)", True, shown="`1`")
    otlp_endpoint: str | None = setting(
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTLP/HTTP collector (Jaeger: `http://jaeger:4318`). Unset: nothing is exported and a message's trace "
        "context is passed on unchanged. The SDK's own `OTEL_*` variables (sampler, headers) apply too.", None)
    log_level: str = setting(
        "TESSERA_LOG_LEVEL", "`DEBUG`, `INFO`, `WARNING` or `ERROR`", "INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    instance: str = setting(
        "TESSERA_INSTANCE", "the instance name in logs and in the trace resource (`service.instance.id`)", "")

    def check(self) -> Iterable[str]:
        if self.metrics_port and self.metrics_port == self.http_port:
            yield (f"TESSERA_METRICS_PORT={self.metrics_port} is the probe port (TESSERA_HTTP_PORT): the metrics "
                   "name tenants and claims and need a listener of their own; pick another port (deploy/ uses 9394)")
