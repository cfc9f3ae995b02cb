"""etcd datastore: a key prefix per tenant, guarded by an etcd user and role with auth enabled.

The tenant's control plane talks to etcd as user ``tenant-<t>``, whose role grants read-write on the
key range ``/tessera/<t>/`` only; etcd refuses everything else with "permission denied". Over TLS
(``EtcdCa``: etcd with ``--client-cert-auth``) the tenant's kube-apiserver logs in with a client
certificate whose CN is that user, issued here; kube-apiserver has no flag for a password. The manager
speaks etcd's v3 JSON gateway over HTTP (the same API etcdctl uses, in JSON), so it needs no gRPC
stack; keys and values are base64 on that wire.
"""

from __future__ import annotations

import base64
import secrets
import ssl
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from tessera.controlplane.credentials import DatastoreCredentials
from tessera.controlplane.datastores import (CertificateMismatch, DatastoreAuthFailed, DatastoreFault, DatastoreFull,
                                             DatastoreUnavailable)
from tessera.controlplane.pki import PkiAuthority


def prefix(tenant: str) -> str:
    return f"/tessera/{tenant}/"


def user_name(tenant: str) -> str:
    return f"tenant-{tenant}"


def b64(value: str | bytes) -> str:
    raw = value.encode() if isinstance(value, str) else value
    return base64.b64encode(raw).decode()


def range_end(key_prefix: str) -> str:
    """The exclusive end of the range covering every key that starts with ``key_prefix``."""
    raw = bytearray(key_prefix.encode())
    raw[-1] += 1
    return bytes(raw).decode()


class EtcdError(DatastoreFault):
    """etcd refused a call; the subclasses below say what kind of refusal it is."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"etcd answered {status}: {message}")
        self.status = status
        self.message = message

    @staticmethod
    def of(status: int, message: str) -> "EtcdError":
        if "authentication failed" in message or "invalid auth token" in message:
            return EtcdAuthFailed(status, message)
        if "database space exceeded" in message:
            return EtcdFull(status, message)
        return EtcdError(status, message)


class EtcdAuthFailed(EtcdError, DatastoreAuthFailed):
    """etcd refused a login or a token: the status reads DatastoreAuthFailed."""


class EtcdFull(EtcdError, DatastoreFull):
    """etcd is past its quota (NOSPACE): the status reads DatastoreFull."""


FREE_SPACE = ("compact and defragment it (etcdctl compact <revision>; etcdctl defrag), then etcdctl alarm disarm; "
              "or raise its --quota-backend-bytes (TESSERA_CP_ETCD_QUOTA_BYTES in dedicated mode)")


class EtcdClient:
    """The few v3 gateway calls the manager and the tests need; one aiohttp session (TLS with
    ``tls``: etcd's CA and a client certificate, for a server with ``--client-cert-auth``)."""

    def __init__(self, endpoint: str, session: aiohttp.ClientSession | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.endpoint = endpoint.rstrip("/")
        self._session = session
        self.tls = tls
        self.token: str | None = None
        self._login: tuple[str, str] | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One gateway call with this client's token; a token etcd has dropped (its TTL, 300 s
        unused by default) is renewed with the login it came from, and the call made once more."""
        try:
            return await self._post(path, body, self.token)
        except EtcdAuthFailed as exc:
            if self._login is None or "invalid auth token" not in exc.message:
                raise
        await self.authenticate(*self._login)
        return await self._post(path, body, self.token)

    async def _post(self, path: str, body: dict[str, Any], token: str | None) -> dict[str, Any]:
        headers = {"Authorization": token} if token else {}
        try:
            async with self.session.post(f"{self.endpoint}/v3/{path}", json=body, headers=headers,
                                         ssl=self.tls if self.tls is not None else True) as resp:
                data = await resp.json(content_type=None)
        except aiohttp.ClientConnectorCertificateError as exc:
            raise CertificateMismatch(
                f"etcd at {self.endpoint} presents a certificate the manager does not trust "
                f"({exc.certificate_error}): the CA the manager is given for etcd (TESSERA_CP_ETCD_CA_FILE; a "
                "dedicated etcd's ca.crt in its directory) must be the one that signed etcd's serving "
                "certificate") from exc
        except aiohttp.ClientSSLError as exc:  # (after the above: a handshake that etcd broke off)
            raise CertificateMismatch(
                f"etcd at {self.endpoint} refused the TLS handshake, the manager's client certificate with it "
                f"({exc.os_error}): etcd's "
                "--trusted-ca-file must be the CA the manager issues from (TESSERA_CP_ETCD_CA_FILE and "
                "TESSERA_CP_ETCD_CA_KEY_FILE)") from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise DatastoreUnavailable(f"cannot reach etcd at {self.endpoint}: {exc}") from exc
        if resp.status != 200 or (isinstance(data, dict) and "error" in data and "code" in data):
            raise EtcdError.of(resp.status, (data or {}).get("message") or (data or {}).get("error", ""))
        return data or {}

    async def authenticate(self, user: str, password: str) -> None:
        """Log in; the token in use stays in use until the new one is in hand (calls made meanwhile
        on this client, by other tasks, keep theirs)."""
        answer = await self._post("auth/authenticate", {"name": user, "password": password}, None)
        self.token, self._login = answer["token"], (user, password)

    async def logs_in(self, user: str, password: str) -> bool:
        """Whether ``user`` logs in with ``password``: asked without touching this client's token."""
        try:
            await self._post("auth/authenticate", {"name": user, "password": password}, None)
        except EtcdAuthFailed:
            return False
        return True

    async def user_roles(self, user: str) -> list[str] | None:
        """The roles of ``user``; None where etcd has no such user."""
        return await self._listed("auth/user/get", {"name": user}, "roles")

    async def role_perms(self, role: str) -> list[dict[str, str]] | None:
        """The permissions of ``role`` as the gateway writes them; None where there is no such role."""
        return await self._listed("auth/role/get", {"role": role}, "perm")

    async def _listed(self, path: str, body: dict[str, Any], field: str) -> list[Any] | None:
        try:
            return list((await self.call(path, body)).get(field) or [])
        except EtcdError as exc:
            if "not found" in exc.message:
                return None
            raise

    async def put(self, key: str, value: bytes) -> None:
        await self.call("kv/put", {"key": b64(key), "value": b64(value)})

    async def get(self, key: str) -> bytes | None:
        data = await self.call("kv/range", {"key": b64(key)})
        kvs = data.get("kvs") or []
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None

    async def count_prefix(self, key_prefix: str) -> int:
        data = await self.call(
            "kv/range", {"key": b64(key_prefix), "range_end": b64(range_end(key_prefix)), "count_only": True}
        )
        return int(data.get("count", 0))

    async def delete_prefix(self, key_prefix: str) -> None:
        await self.call("kv/deleterange", {"key": b64(key_prefix), "range_end": b64(range_end(key_prefix))})

    async def enable_auth(self, root_password: str) -> None:
        """Create root and turn auth on, if it is not on yet (what an operator does once)."""
        try:
            await self.call("auth/user/add", {"name": "root", "password": root_password})
        except EtcdError as exc:
            if "already exists" not in exc.message:
                raise
        await self.call("auth/user/grant", {"user": "root", "role": "root"})
        await self.call("auth/enable", {})


def tls_context(ca_cert: str, client_cert: str, client_key: str) -> ssl.SSLContext:
    """A client TLS context from PEM strings (the ssl module reads a key pair only from files: they
    live for the call in a private temporary directory)."""
    ctx = ssl.create_default_context(cadata=ca_cert)
    with tempfile.TemporaryDirectory(prefix="tessera-etcd-") as tmp:
        crt, key = Path(tmp) / "client.crt", Path(tmp) / "client.key"
        crt.write_text(client_cert)
        key.touch(mode=0o600)
        key.write_text(client_key)
        ctx.load_cert_chain(str(crt), str(key))
    return ctx


class EtcdCa:
    """The CA a shared etcd trusts for client certificates (``--trusted-ca-file``), which also
    signed its serving certificate: the manager issues tenants' certificates from it."""

    def __init__(self, cert_file: str, key_file: str, pki: PkiAuthority | None = None) -> None:
        try:
            self.cert = Path(cert_file).read_text()
            self.key = Path(key_file).read_text()
        except OSError as exc:
            raise ValueError(f"cannot read etcd's CA ({exc}): check TESSERA_CP_ETCD_CA_FILE and "
                             "TESSERA_CP_ETCD_CA_KEY_FILE") from None
        self.pki = pki or PkiAuthority()

    def client(self, user: str) -> tuple[str, str]:
        """A certificate that logs in as ``user`` (etcd's gRPC maps its CN to the user)."""
        return self.pki.issue_client(self.cert, self.key, user, "tessera:datastore")

    def gateway_client(self) -> tuple[str, str]:
        """A certificate for the JSON gateway, which refuses one with a CN (it would not be the user
        there): none, so the manager logs in with root's password as before."""
        return self.pki.issue_client(self.cert, self.key, None, "tessera:controlplane")


class EtcdDriver:
    name = "etcd"

    def __init__(self, endpoint: str, root_password: str, ca: EtcdCa | None = None,
                 password_from: str = "TESSERA_CP_ETCD_ROOT_PASSWORD") -> None:
        self.endpoint = endpoint
        self.root_password = root_password
        self.password_from = password_from  # where root's password comes from (what a refusal tells to fix)
        self.ca = ca
        tls = tls_context(ca.cert, *ca.gateway_client()) if ca is not None else None
        self.client = EtcdClient(endpoint, tls=tls)

    async def _as_root(self) -> EtcdClient:
        if self.client.token is not None:
            return self.client
        try:
            await self.client.authenticate("root", self.root_password)
        except EtcdAuthFailed as exc:
            raise DatastoreAuthFailed(f"etcd at {self.endpoint} refuses root's password ({exc.message}): set "
                                      f"{self.password_from} to etcd's root password, or set root's password "
                                      "back (etcdctl user passwd root)") from exc
        return self.client

    async def _has_space(self, etcd: EtcdClient) -> None:
        """etcd past its quota raises the NOSPACE alarm and refuses every write until it is disarmed,
        while logins and reads still work: the tenant's API server could not write."""
        alarms = (await etcd.call("maintenance/alarm", {"action": "GET"})).get("alarms") or []
        if any(a.get("alarm") == "NOSPACE" for a in alarms):
            raise DatastoreFull(f"etcd at {self.endpoint} is out of space (its NOSPACE alarm is raised: \"database "
                                f"space exceeded\"), so the tenant's API server cannot write; {FREE_SPACE}")

    async def ensure(self, tenant: str, current: DatastoreCredentials | None) -> DatastoreCredentials:
        user = role = user_name(tenant)
        password = current.password if current and current.driver == self.name and current.username == user else ""
        password = password or secrets.token_urlsafe(24)
        etcd = await self._as_root()
        await self._has_space(etcd)
        key = prefix(tenant)
        await self._grant(etcd, user, password, role, key)
        ca_cert = crt = private = ""
        if self.ca is not None:  # kube-apiserver logs in with a certificate: etcd takes its CN for the user
            ca_cert = self.ca.cert
            if current and current.client_cert and self.ca.pki.current(current.client_cert, self.ca.cert, user):
                crt, private = current.client_cert, current.client_key
            else:
                crt, private = self.ca.client(user)
        return DatastoreCredentials(
            driver=self.name, endpoint=self.endpoint, username=user, password=password, scope=key,
            ca_cert=ca_cert, client_cert=crt, client_key=private,
        )

    @staticmethod
    async def _grant(etcd: EtcdClient, user: str, password: str, role: str, key: str) -> None:
        """The tenant's user, its password, and a role over its prefix, written only where they
        differ: each write to etcd's users or roles bumps its auth revision, and every other
        tenant's API server then has a request refused ("auth: revision in header is old")."""
        roles = await etcd.user_roles(user)
        if roles is None:
            await etcd.call("auth/user/add", {"name": user, "password": password})
            roles = []
        elif not await etcd.logs_in(user, password):
            await etcd.call("auth/user/changepw", {"name": user, "password": password})
        perm = {"permType": "READWRITE", "key": b64(key), "range_end": b64(range_end(key))}
        perms = await etcd.role_perms(role)
        if perms is None:
            await etcd.call("auth/role/add", {"name": role})
            perms = []
        if perm not in perms:
            await etcd.call("auth/role/grant", {"name": role, "perm": perm})
        if role not in roles:
            await etcd.call("auth/user/grant", {"user": user, "role": role})

    async def remove(self, tenant: str) -> None:
        etcd = await self._as_root()
        await etcd.delete_prefix(prefix(tenant))
        for path, body in (
            ("auth/user/delete", {"name": user_name(tenant)}),
            ("auth/role/delete", {"role": user_name(tenant)}),
        ):
            try:
                await etcd.call(path, body)
            except EtcdError as exc:
                if "not found" not in exc.message:
                    raise

    async def close(self) -> None:
        await self.client.close()
