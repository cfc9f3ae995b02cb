"""Settings read from the environment once, into frozen objects passed explicitly.

Each service builds one frozen settings object at start-up (``XSettings.from_env()``) and hands it
down; nothing reads os.environ later and nothing lives in globals. A malformed value fails start-up
with the variable's name and what it should look like.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping

from tessera.shared.errors import ConfigError


def env_str(env: Mapping[str, str], name: str, default: str) -> str:
    return env.get(name, default)


def env_int(env: Mapping[str, str], name: str, default: int, *, minimum: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer; set it to a whole number") from None
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={value} is below the minimum {minimum}")
    return value


def env_float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number; set it to e.g. 2.5") from None


def env_choice(env: Mapping[str, str], name: str, default: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (case-insensitive); anything else stops the service naming them."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise ConfigError(f"{name}={raw!r}: use one of {', '.join(choices)}")
    return value


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in _TRUE + _FALSE:
        raise ConfigError(f"{name}={raw!r}: use true or false (or 1 / 0)")
    return value in _TRUE


def _positive(env: Mapping[str, str], name: str, default: float) -> float:
    value = env_float(env, name, default)
    if value <= 0:
        raise ConfigError(f"{name}={value:g} must be more than 0 (seconds)")
    return value


def _non_negative(name: str, value: float) -> float:
    if value < 0:
        raise ConfigError(f"{name}={value:g} must be 0 (never) or more (seconds)")
    return value


def _password(env: Mapping[str, str]) -> str | None:
    """TESSERA_NATS_PASSWORD_FILE (a mounted Secret) before TESSERA_NATS_PASSWORD."""
    path = env.get("TESSERA_NATS_PASSWORD_FILE")
    if path:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError as exc:
            raise ConfigError(f"TESSERA_NATS_PASSWORD_FILE={path}: cannot read it ({exc.strerror})") from None
    return env.get("TESSERA_NATS_PASSWORD") or None


def _port(env: Mapping[str, str], name: str) -> int:
    port = env_int(env, name, 0, minimum=0)
    if port > 65535:
        raise ConfigError(f"{name}={port} is not a TCP port; use 1 to 65535 (0: none)")
    return port


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


@dataclass(frozen=True)
class BusSettings:
    """How to reach NATS and how to shape the streams (production values are the defaults)."""

    url: str = "nats://127.0.0.1:4222"
    creds_file: str | None = None
    # The identity, when not in the URL: a user (and its password) of `tessera.shared.identities`.
    user: str | None = None
    password: str | None = None
    # Never give up reconnecting: a service outlives a NATS restart (the client default stops ~2 min).
    max_reconnect_attempts: int = -1
    reconnect_time_wait: float = 0.5
    replicas: int = 1
    file_storage: bool = True
    duplicate_window: float = 120.0
    max_deliver: int = 5
    ack_wait: float = 30.0
    # Limits of the streams and buckets (tessera.shared.topology explains the sizing).
    stream_max_bytes: int = 1024 * 1024 * 1024
    bucket_max_bytes: int = 1024 * 1024 * 1024
    heartbeat_retention: float = 3600.0
    usage_retention: float = 3600.0
    # Released claims are removed from the claims bucket this long after their last change
    # (tessera.shared.claimpruning); 0 keeps them forever.
    claim_retention: float = 7 * 24 * 3600.0
    claim_prune_interval: float = 600.0

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
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "BusSettings":
        env = os.environ if env is None else env
        return cls(
            url=env_str(env, "TESSERA_NATS_URL", cls.url),
            creds_file=env.get("TESSERA_NATS_CREDS") or None,
            user=env.get("TESSERA_NATS_USER") or None,
            password=_password(env),
            replicas=env_int(env, "TESSERA_STREAM_REPLICAS", 1, minimum=1),
            file_storage=env_choice(env, "TESSERA_STREAM_STORAGE", "file", ("file", "memory")) == "file",
            max_deliver=env_int(env, "TESSERA_MAX_DELIVER", 5, minimum=1),
            ack_wait=env_float(env, "TESSERA_ACK_WAIT", 30.0),
            stream_max_bytes=env_int(env, "TESSERA_STREAM_MAX_BYTES", cls.stream_max_bytes, minimum=1024 * 1024),
            bucket_max_bytes=env_int(env, "TESSERA_BUCKET_MAX_BYTES", cls.bucket_max_bytes, minimum=1024 * 1024),
            heartbeat_retention=_positive(env, "TESSERA_HEARTBEAT_RETENTION", cls.heartbeat_retention),
            usage_retention=_positive(env, "TESSERA_USAGE_RETENTION", cls.usage_retention),
            claim_retention=_non_negative("TESSERA_CLAIM_RETENTION",
                                          env_float(env, "TESSERA_CLAIM_RETENTION", cls.claim_retention)),
            claim_prune_interval=_positive(env, "TESSERA_CLAIM_PRUNE_INTERVAL", cls.claim_prune_interval),
        )


@dataclass(frozen=True)
class ServiceSettings:
    """What every service needs: its name, the bus, the probe server, the metrics listener and tracing."""

    service: str
    bus: BusSettings = field(default_factory=BusSettings)
    http_host: str = "127.0.0.1"
    http_port: int = 0  # 0: no probe server
    # /metrics names tenants and claims: a listener of its own, never the probe port, which the
    # kubelet (and so anything on the pod network) reaches (tessera.shared.metrics). 0: none.
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    metrics_interval: float = 10.0  # seconds between refreshes of lag, dead letters, fragmentation
    # Also emit HAMi's pre-2.9 metric names (GPUDeviceMemoryLimit, vGPU_device_memory_usage_in_bytes, ...).
    metrics_legacy: bool = True
    otlp_endpoint: str | None = None
    log_level: str = "INFO"
    instance: str = ""

    @classmethod
    def from_env(cls, service: str, env: Mapping[str, str] | None = None) -> "ServiceSettings":
        env = os.environ if env is None else env
        http_port = _port(env, "TESSERA_HTTP_PORT")
        metrics_port = _port(env, "TESSERA_METRICS_PORT")
        if metrics_port and metrics_port == http_port:
            raise ConfigError(f"TESSERA_METRICS_PORT={metrics_port} is the probe port (TESSERA_HTTP_PORT): the "
                              "metrics name tenants and claims and need a listener of their own; pick another "
                              "port (deploy/ uses 9394)")
        return cls(
            service=service,
            bus=BusSettings.from_env(env),
            http_host=env_str(env, "TESSERA_HTTP_HOST", "127.0.0.1"),
            http_port=http_port,
            metrics_host=env_str(env, "TESSERA_METRICS_HOST", "127.0.0.1"),
            metrics_port=metrics_port,
            metrics_interval=_positive(env, "TESSERA_METRICS_INTERVAL", 10.0),
            metrics_legacy=env_bool(env, "TESSERA_METRICS_LEGACY", True),
            otlp_endpoint=env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None,
            log_level=env_choice(env, "TESSERA_LOG_LEVEL", "info", ("debug", "info", "warning", "error")).upper(),
            instance=env_str(env, "TESSERA_INSTANCE", ""),
        )
