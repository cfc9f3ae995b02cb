"""What a tenant is given to reach its own resources: datastore credentials and its PKI material.

These are the manager's secrets. Without Kubernetes they live in the ``controlplane-secrets`` KV
bucket (so a restarted manager finds them instead of minting new ones); in Kubernetes mode they are
also applied as Secrets in the tenant's namespace, which is what the control-plane pods mount.
"""

from __future__ import annotations

from msgspec import Struct


class DatastoreCredentials(Struct, kw_only=True, frozen=True):
    """How the tenant's control plane (and only it) reaches its datastore."""

    driver: str
    endpoint: str  # nats://..., postgresql://host:port/db, http://etcd:2379
    username: str
    password: str
    scope: str  # the bucket, database or key prefix the credentials are confined to
    inbox_prefix: str = ""  # NATS: the only reply subjects this tenant may subscribe to
    replicas: int = 1  # NATS: the replicas of the tenant's bucket (kine creates it)
    # PostgreSQL: the role's CONNECTION LIMIT (0: none). kine's pool is kept to half of it, so that a
    # restarted kine can log in while the backends of the one it replaces are still being reaped.
    connection_limit: int = 0
    # etcd over TLS: the CA of the server, and the client certificate (CN: ``username``) and key etcd
    # maps to the tenant's user; kube-apiserver has no password flag, a certificate is its only login.
    ca_cert: str = ""
    client_cert: str = ""
    client_key: str = ""


class TenantSecrets(Struct, kw_only=True):
    """Everything secret about one tenant; PEM strings keyed by file name (ca.crt, ca.key, ...)."""

    tenant: str
    datastore: DatastoreCredentials | None = None
    pki: dict[str, str] = {}
    not_after: float = 0.0  # earliest expiry among the leaf certificates
    kubeconfig: str = ""
