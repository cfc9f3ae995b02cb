"""etcd datastore: a key prefix per tenant, guarded by an etcd user and role with auth enabled.

The tenant's control plane talks to etcd as user ``tenant-<t>``, whose role grants read-write on the
key range ``/tessera/<t>/`` only; etcd refuses everything else with "permission denied". The manager
speaks etcd's v3 JSON gateway over HTTP (the same API etcdctl uses, in JSON), so it needs no gRPC
stack; keys and values are base64 on that wire.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

import aiohttp

from tessera.controlplane.credentials import DatastoreCredentials
from tessera.controlplane.datastores import DatastoreUnavailable


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


class EtcdError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"etcd answered {status}: {message}")
        self.status = status
        self.message = message


class EtcdClient:
    """The few v3 gateway calls the manager and the tests need; one aiohttp session."""

    def __init__(self, endpoint: str, session: aiohttp.ClientSession | None = None) -> None:
        self.endpoint = endpoint.rstrip("/")
        self._session = session
        self.token: str | None = None

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
        headers = {"Authorization": self.token} if self.token else {}
        try:
            async with self.session.post(f"{self.endpoint}/v3/{path}", json=body, headers=headers) as resp:
                data = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise DatastoreUnavailable(f"cannot reach etcd at {self.endpoint}: {exc}") from exc
        if resp.status != 200 or (isinstance(data, dict) and "error" in data and "code" in data):
            raise EtcdError(resp.status, (data or {}).get("message") or (data or {}).get("error", ""))
        return data or {}

    async def authenticate(self, user: str, password: str) -> None:
        self.token = None
        self.token = (await self.call("auth/authenticate", {"name": user, "password": password}))["token"]

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


class EtcdDriver:
    name = "etcd"

    def __init__(self, endpoint: str, root_password: str) -> None:
        self.endpoint = endpoint
        self.root_password = root_password
        self.client = EtcdClient(endpoint)

    async def _as_root(self) -> EtcdClient:
        await self.client.authenticate("root", self.root_password)
        return self.client

    async def ensure(self, tenant: str, current: DatastoreCredentials | None) -> DatastoreCredentials:
        user = role = user_name(tenant)
        password = current.password if current and current.driver == self.name and current.username == user else ""
        password = password or secrets.token_urlsafe(24)
        etcd = await self._as_root()
        try:
            await etcd.call("auth/user/add", {"name": user, "password": password})
        except EtcdError as exc:
            if "already exists" not in exc.message:
                raise
            await etcd.call("auth/user/changepw", {"name": user, "password": password})
        try:
            await etcd.call("auth/role/add", {"name": role})
        except EtcdError as exc:
            if "already exists" not in exc.message:
                raise
        key = prefix(tenant)
        await etcd.call(
            "auth/role/grant",
            {"name": role, "perm": {"permType": "READWRITE", "key": b64(key), "range_end": b64(range_end(key))}},
        )
        await etcd.call("auth/user/grant", {"user": user, "role": role})
        return DatastoreCredentials(
            driver=self.name, endpoint=self.endpoint, username=user, password=password, scope=key
        )

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
