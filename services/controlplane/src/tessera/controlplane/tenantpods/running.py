"""The manager runs each Ready tenant's pod syncer, with a host identity it makes for it.

In Kubernetes mode, for every tenant whose control plane is Ready: a ServiceAccount
``tessera-tenant-pods`` and a RoleBinding to the ClusterRole of that name in the tenant's host
namespace (deploy/k8s/controlplane/tenant-pods.yaml: the grant reaches that namespace only), a
token for it from the TokenRequest API (renewed in place well before it expires), and a `PodSync`
task with that host identity and the tenant's admin credentials. The task stops when the tenant is
no longer Ready (asleep, down, upgrading) and starts again when it is; a crash is logged and the
task restarted with backoff, and what it is doing shows in the tenant's status (``gpuPods``:
``Syncing``, ``Starting``, ``Failed: <why>``). Teardown stops it and clears what it mirrored.

Nothing here is remembered that the next start could not rebuild: the syncer is level-triggered,
and the identity's objects are created idempotently.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from pathlib import Path
from typing import Callable

import yaml

from tessera.shared.cancelling import cancel_and_wait
from tessera.shared.events import GpuQuota
from tessera.shared.kubeapi import AlreadyExists, KubeApi, NotFound

from tessera.controlplane import manifests
from tessera.controlplane.pki import PkiAuthority
from tessera.controlplane.spec import TenantControlPlane
from tessera.controlplane.store import TenantStore

from .logs import LogServer
from .sync import PodSync
from .virtualnode import Share, VirtualNode, node_name

log = logging.getLogger(__name__)

ACCOUNT = ROLE = "tessera-tenant-pods"
TOKEN_SECONDS = 3600
BACKOFF = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)

SYNCING, STARTING = "Syncing", "Starting"


class TenantPods:
    """Every tenant's syncer task, kept running while its tenant is Ready."""

    def __init__(self, store: TenantStore, host_api: KubeApi, address: Callable[[TenantControlPlane], str],
                 on_change: Callable[[str], None] = lambda tenant: None, *, token_seconds: int = TOKEN_SECONDS) -> None:
        self.store, self.host_api, self.address = store, host_api, address
        self.on_change = on_change  # told when a tenant's status here changes (the manager reconciles it)
        self.token_seconds = token_seconds
        self._tasks: dict[str, asyncio.Task] = {}
        self._status: dict[str, str] = {}
        self._generations: dict[str, int] = {}

    def status(self, tenant: str) -> str:
        return self._status.get(tenant, "")

    def _say(self, tenant: str, status: str) -> None:
        if self._status.get(tenant) != status:
            self._status[tenant] = status
            self.on_change(tenant)

    async def start(self, record: TenantControlPlane) -> None:
        """Keep the tenant's syncer running (a no-op while it runs the record's generation; a new
        generation, say a changed quota, restarts it, so that its node says so)."""
        task = self._tasks.get(record.name)
        if task is not None and self._generations.get(record.name) != record.generation:
            await self.stop(record.name)
            task = None
        if task is None or task.done():
            self._generations[record.name] = record.generation
            self._status.setdefault(record.name, STARTING)
            self._tasks[record.name] = asyncio.create_task(self._keep(record), name=f"tenant-pods-{record.name}")

    async def stop(self, tenant: str) -> None:
        """Stop the syncer (its objects stay: a restart adopts them)."""
        task = self._tasks.pop(tenant, None)
        if task is not None:
            await cancel_and_wait([task])
        self._status.pop(tenant, None)

    async def remove(self, record: TenantControlPlane | None, tenant: str) -> None:
        """The tenant goes: stop its syncer, remove its virtual node and every mirrored object, and its
        host identity. Without a record (or a tenant API server) the host side is still cleared."""
        await self.stop(tenant)
        namespace = manifests.namespace(tenant)
        try:
            async with self._apis(record, tenant, identity=True) as (tenant_api, host_api):
                share = Share(record.spec.quota.ceiling() if record else GpuQuota(gpus=0, memory_mib=0, cores=0))
                await PodSync(tenant_api, host_api, tenant, namespace, VirtualNode(tenant_api, tenant, share)).clear()
        except Exception as exc:  # the tenant's API server may be gone already (the host side is cleared first)
            log.warning("tenant %s: clearing its pods: %s", tenant, exc)
        for path in (f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings/{ROLE}",
                     f"/api/v1/namespaces/{namespace}/serviceaccounts/{ACCOUNT}"):
            try:
                await self.host_api.call("DELETE", path)
            except NotFound:
                pass

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        await cancel_and_wait(tasks)

    # --- one tenant's task -----------------------------------------------------------------------

    async def _keep(self, record: TenantControlPlane) -> None:
        failures = 0
        while True:
            try:
                await self._run(record, lambda: self._say(record.name, SYNCING))
                raise RuntimeError("the syncer returned")  # (it runs until cancelled)
            except asyncio.CancelledError:
                raise
            except Exception as group:
                exc = _first(group)
                delay = BACKOFF[min(failures, len(BACKOFF) - 1)]
                failures += 1
                log.warning("tenant %s: the pod syncer failed (%s); restarting in %.0f s", record.name, exc, delay)
                self._say(record.name, f"Failed: {type(exc).__name__}: {exc}"[:300])
                await asyncio.sleep(delay)

    async def _run(self, record: TenantControlPlane, synced: Callable[[], None]) -> None:
        namespace = manifests.namespace(record.name)
        async with self._apis(record, record.name, identity=True) as (tenant_api, host_api):
            secrets = (await self.store.secrets.get(record.name)).value  # type: ignore[union-attr]
            cert, key = PkiAuthority().issue_serving(secrets.pki["ca.crt"], secrets.pki["ca.key"],
                                                     node_name(record.name), [node_name(record.name)], ["127.0.0.1"])
            sync = PodSync(tenant_api, host_api, record.name, namespace,
                           VirtualNode(tenant_api, record.name, Share(record.spec.quota.ceiling())),
                           LogServer(host_api, namespace, cert, key))
            async with asyncio.TaskGroup() as tasks:
                running = tasks.create_task(sync.run(), name=f"pod-sync-{record.name}")
                await sync.ready.wait() if not running.done() else None
                synced()
                tasks.create_task(self._renew(record.name, host_api), name=f"token-{record.name}")

    def _apis(self, record: TenantControlPlane | None, tenant: str, *, identity: bool = False):
        return _Apis(self, record, tenant, identity)

    # --- the host identity -----------------------------------------------------------------------

    async def _identity(self, tenant: str) -> None:
        """The ServiceAccount and its RoleBinding in the tenant's host namespace (made once)."""
        namespace = manifests.namespace(tenant)
        meta = {"name": ACCOUNT, "namespace": namespace, "labels": manifests.labels(tenant)}
        account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta, "automountServiceAccountToken": False}
        binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": ROLE},
                   "subjects": [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": namespace}]}
        for collection, obj in ((f"/api/v1/namespaces/{namespace}/serviceaccounts", account),
                                (f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings", binding)):
            try:
                await self.host_api.create(collection, obj)
            except AlreadyExists:
                pass

    async def _token(self, tenant: str) -> str:
        path = f"/api/v1/namespaces/{manifests.namespace(tenant)}/serviceaccounts/{ACCOUNT}/token"
        made = await self.host_api.create(path, {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                                                 "spec": {"expirationSeconds": self.token_seconds}})
        return made["status"]["token"]

    async def _renew(self, tenant: str, host_api: KubeApi) -> None:
        """A fresh token at two thirds of the old one's life, put in place for the next requests."""
        while True:
            await asyncio.sleep(self.token_seconds * 2 / 3)
            configuration = (await host_api.api()).configuration
            configuration.api_key["BearerToken"] = f"Bearer {await self._token(tenant)}"
            log.info("tenant %s: the pod syncer's host token renewed", tenant)


def _first(exc: BaseException) -> BaseException:
    """The error itself, out of the task groups it came through (what the status should name)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


class _Apis:
    """(tenant API, host API) for one tenant: the tenant's admin kubeconfig, at the address the
    manager reaches it; the host as the tenant's own identity (``identity``) or as the manager."""

    def __init__(self, pods: TenantPods, record: TenantControlPlane | None, tenant: str, identity: bool) -> None:
        self.pods, self.record, self.tenant, self.identity = pods, record, tenant, identity
        self._dir: tempfile.TemporaryDirectory | None = None
        self._made: list[KubeApi] = []

    async def __aenter__(self) -> tuple[KubeApi, KubeApi]:
        try:
            return await self._enter()
        except BaseException:  # cancelled half-way (a stop while it starts) too: nothing left behind
            await self.__aexit__()
            raise

    async def _enter(self) -> tuple[KubeApi, KubeApi]:
        self._dir = tempfile.TemporaryDirectory(prefix="tessera-tenant-pods-")
        stored = await self.pods.store.secrets.get(self.tenant)
        conf = yaml.safe_load(stored.value.kubeconfig) if stored and stored.value.kubeconfig else None
        if conf is not None and self.record is not None:
            conf["clusters"][0]["cluster"]["server"] = self.pods.address(self.record)
        path = Path(self._dir.name) / "tenant.kubeconfig"
        path.write_text(yaml.safe_dump(conf or {"apiVersion": "v1", "kind": "Config", "clusters": [], "users": [],
                                                 "contexts": []}))
        tenant_api = KubeApi.for_kubeconfig(str(path))
        self._made = [tenant_api]
        host_api = self.pods.host_api
        if self.identity:  # a kubeconfig of the tenant's host identity: the manager's server and CA, its token
            await self.pods._identity(self.tenant)
            token = await self.pods._token(self.tenant)
            own = (await self.pods.host_api.api()).configuration
            cluster = {"server": own.host, **({"certificate-authority": own.ssl_ca_cert} if own.ssl_ca_cert else {}),
                       **({} if own.verify_ssl else {"insecure-skip-tls-verify": True})}
            host = Path(self._dir.name) / "host.kubeconfig"
            host.write_text(yaml.safe_dump({
                "apiVersion": "v1", "kind": "Config", "current-context": "host",
                "clusters": [{"name": "host", "cluster": cluster}],
                "users": [{"name": ACCOUNT, "user": {"token": token}}],
                "contexts": [{"name": "host", "context": {"cluster": "host", "user": ACCOUNT}}]}))
            host_api = KubeApi.for_kubeconfig(str(host))
            self._made.append(host_api)
        return tenant_api, host_api

    async def __aexit__(self, *exc: object) -> None:
        if self._dir is not None:  # (first: a second cancellation may cut the awaits below short)
            self._dir.cleanup()
            self._dir = None
        made, self._made = self._made, []
        for api in made:
            await api.close()
