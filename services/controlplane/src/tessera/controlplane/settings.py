"""The manager's own settings, read from the environment once into a frozen object.

Everything here is about what the manager provisions (datastore servers, host cluster, PKI
lifetimes); how to reach NATS and the probe port come from the shared ServiceSettings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal, Mapping

from tessera.shared.secretkeys import SecretKeys
from tessera.shared.errors import ConfigError
from tessera.shared.settings import env_choice, env_float, env_int, env_str

DRIVERS = ("nats", "postgres", "etcd")
HostMode = Literal["none", "render", "kubernetes"]
EtcdMode = Literal["shared", "dedicated"]


@dataclass(frozen=True)
class ControlPlaneSettings:
    drivers: tuple[str, ...] = ("nats",)
    # NATS datastore: where tenants connect, and (config-file authorization) the users file the
    # manager owns plus the nats-server pid file to signal a reload. Empty: no per-tenant users.
    nats_tenant_url: str = ""
    nats_auth_file: str = ""
    nats_pid_file: str = ""
    # Kubernetes: the Secret ("namespace/name") holding that users file, mounted by the NATS pods
    # (whose config reloader signals nats-server when it changes); used instead of the file.
    nats_users_secret: str = ""
    postgres_dsn: str = "postgresql://postgres@127.0.0.1:5432/postgres"
    postgres_tenant_host: str = "127.0.0.1:5432"
    postgres_connection_limit: int = 32  # per tenant role (CONNECTION LIMIT)
    etcd_endpoint: str = "http://127.0.0.1:2379"
    etcd_root_password: str = ""
    # etcd: "shared" (one server, a key prefix per tenant, one quota for all) or "dedicated" (an
    # etcd server per tenant, run by the manager, each with its own --quota-backend-bytes).
    etcd_mode: EtcdMode = "shared"
    etcd_quota_bytes: int = 2 * 1024 * 1024 * 1024
    etcd_data_dir: str = ""
    etcd_binary: str = ""
    host_mode: HostMode = "none"
    manifests_dir: str = ""
    platform_namespace: str = "tessera-system"
    host_cpu_millis: int = 0  # 0: unbounded
    host_memory_mib: int = 0
    cert_days: int = 365
    rotate_before_days: int = 30
    resync_seconds: float = 30.0
    # Deleting a tenant first releases its claims: how long one delete waits for them (and its quota
    # usage) to be gone before it answers "pending" and leaves the rest to the resync.
    teardown_wait_seconds: float = 20.0
    # The keys tenant secrets are sealed with (`tessera.controlplane.sealing`). The service reads
    # them from TESSERA_CP_SECRET_KEY_FILE; the default, one random key in memory, is for a manager
    # embedded in a test or benchmark and is never what `from_env` returns.
    secret_keys: SecretKeys = field(default_factory=SecretKeys.ephemeral, repr=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "ControlPlaneSettings":
        env = os.environ if env is None else env
        drivers = tuple(d.strip() for d in env_str(env, "TESSERA_CP_DRIVERS", "nats").split(",") if d.strip())
        for d in drivers:
            if d not in DRIVERS:
                raise ConfigError(f"TESSERA_CP_DRIVERS: unknown driver {d!r}; choose from {', '.join(DRIVERS)}")
        mode = env_str(env, "TESSERA_CP_HOST", "none")
        if mode not in ("none", "render", "kubernetes"):
            raise ConfigError(f"TESSERA_CP_HOST={mode!r}: use none, render or kubernetes")
        manifests_dir = env_str(env, "TESSERA_CP_MANIFESTS_DIR", "")
        if mode == "render" and not manifests_dir:
            raise ConfigError("TESSERA_CP_HOST=render needs TESSERA_CP_MANIFESTS_DIR (where to write)")
        users_secret = env_str(env, "TESSERA_CP_NATS_USERS_SECRET", "")
        if users_secret and len(users_secret.split("/")) != 2:
            raise ConfigError(f"TESSERA_CP_NATS_USERS_SECRET={users_secret!r}: use namespace/name")
        rotate = env_int(env, "TESSERA_CP_ROTATE_BEFORE_DAYS", 30, minimum=0)
        days = env_int(env, "TESSERA_CP_CERT_DAYS", 365, minimum=1)
        if rotate >= days:
            raise ConfigError("TESSERA_CP_ROTATE_BEFORE_DAYS must be below TESSERA_CP_CERT_DAYS")
        teardown_wait = env_float(env, "TESSERA_CP_TEARDOWN_WAIT_SECONDS", 20.0)
        if teardown_wait < 0:
            raise ConfigError(f"TESSERA_CP_TEARDOWN_WAIT_SECONDS={teardown_wait}: use 0 or more seconds")
        etcd_mode = env_choice(env, "TESSERA_CP_ETCD_MODE", "shared", ("shared", "dedicated"))
        etcd_data_dir = env_str(env, "TESSERA_CP_ETCD_DATA_DIR", "")
        if "etcd" in drivers and etcd_mode == "dedicated":
            if mode == "kubernetes":
                raise ConfigError("TESSERA_CP_ETCD_MODE=dedicated runs etcd servers as the manager's own processes,"
                                  " which Kubernetes mode does not support yet: use shared, or another driver")
            if not etcd_data_dir:
                raise ConfigError("TESSERA_CP_ETCD_MODE=dedicated needs TESSERA_CP_ETCD_DATA_DIR"
                                  " (where each tenant's etcd keeps its data)")
        keys = SecretKeys.from_file(env_str(env, "TESSERA_CP_SECRET_KEY_FILE", ""))  # before anything connects
        return cls(
            secret_keys=keys,
            drivers=drivers,
            nats_tenant_url=env_str(env, "TESSERA_CP_NATS_TENANT_URL", ""),
            nats_auth_file=env_str(env, "TESSERA_CP_NATS_AUTH_FILE", ""),
            nats_pid_file=env_str(env, "TESSERA_CP_NATS_PID_FILE", ""),
            nats_users_secret=users_secret,
            postgres_dsn=env_str(env, "TESSERA_CP_POSTGRES_DSN", cls.postgres_dsn),
            postgres_tenant_host=env_str(env, "TESSERA_CP_POSTGRES_TENANT_HOST", cls.postgres_tenant_host),
            etcd_endpoint=env_str(env, "TESSERA_CP_ETCD_ENDPOINT", cls.etcd_endpoint),
            etcd_root_password=env_str(env, "TESSERA_CP_ETCD_ROOT_PASSWORD", ""),
            etcd_mode=etcd_mode,  # type: ignore[arg-type]
            etcd_quota_bytes=env_int(env, "TESSERA_CP_ETCD_QUOTA_BYTES", cls.etcd_quota_bytes, minimum=1024 * 1024),
            etcd_data_dir=etcd_data_dir,
            etcd_binary=env_str(env, "TESSERA_CP_ETCD_BINARY", ""),
            postgres_connection_limit=env_int(env, "TESSERA_CP_POSTGRES_CONNECTION_LIMIT", 32, minimum=1),
            host_mode=mode,  # type: ignore[arg-type]
            manifests_dir=manifests_dir,
            platform_namespace=env_str(env, "TESSERA_CP_PLATFORM_NAMESPACE", "tessera-system"),
            host_cpu_millis=env_int(env, "TESSERA_CP_HOST_CPU_MILLIS", 0, minimum=0),
            host_memory_mib=env_int(env, "TESSERA_CP_HOST_MEMORY_MIB", 0, minimum=0),
            cert_days=days,
            rotate_before_days=rotate,
            resync_seconds=env_float(env, "TESSERA_CP_RESYNC_SECONDS", 30.0),
            teardown_wait_seconds=teardown_wait,
        )
