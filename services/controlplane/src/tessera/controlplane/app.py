"""The manager assembled: store, datastore drivers, PKI, host cluster, reconciler and API (and on
Kubernetes the TenantControlPlane objects, served through that same API).

Kept apart from __main__ so that tests and the benchmark can run a real manager inside their own
event loop against their own servers, with the same wiring as the service.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Coroutine

from tessera.controlplane import manifests
from tessera.controlplane.api import TenantApi
from tessera.controlplane.capacity import HostCapacity
from tessera.controlplane.claimdrain import ClaimDrain
from tessera.controlplane.datastores import DatastoreDriver, ReleasesSessions
from tessera.controlplane.host import HostCluster, NoHost, RenderedHost
from tessera.controlplane.localplanes import LocalControlPlanes, default_bin_dirs
from tessera.controlplane.pki import PkiAuthority
from tessera.controlplane.reconciler import Reconciler
from tessera.controlplane.settings import ControlPlaneSettings
from tessera.controlplane.store import TenantStore
from tessera.shared import subjects
from tessera.shared.bus import Bus
from tessera.shared.cancelling import cancel_and_wait
from tessera.shared.claimstore import ClaimStore
from tessera.shared.errors import TemporaryError
from tessera.shared.ledger import Ledger

log = logging.getLogger("tessera.controlplane")


class Manager:
    def __init__(
        self,
        store: TenantStore,
        reconciler: Reconciler,
        api: TenantApi,
        drivers: dict[str, DatastoreDriver],
        host: HostCluster,
        settings: ControlPlaneSettings,
        resources=None,
    ) -> None:
        self.resources = resources  # TenantResources on Kubernetes, else None
        self.store = store
        self.reconciler = reconciler
        self.api = api
        self.drivers = drivers
        self.host = host
        self.settings = settings
        self._background: set[asyncio.Task] = set()

    @classmethod
    async def start(
        cls,
        bus: Bus,
        settings: ControlPlaneSettings,
        *,
        host: HostCluster | None = None,
        drivers: dict[str, DatastoreDriver] | None = None,
    ) -> "Manager":
        store = await TenantStore.open(bus, settings.secret_keys)
        drivers = drivers if drivers is not None else await make_drivers(bus, settings)
        host = host or make_host(settings)
        pki = PkiAuthority(settings.cert_days, settings.rotate_before_days)

        async def publish(subject, event, msg_id):
            return await bus.publish(subject, event, msg_id=msg_id)

        drain = ClaimDrain(ClaimStore(await bus.kv(subjects.KV_CLAIMS)), Ledger(await bus.kv(subjects.KV_LEDGER)),
                           publish, span=bus.telemetry.span)
        pods = None
        if hasattr(host, "host_api"):  # a Kubernetes host: each Ready tenant's GPU pods run on it
            from tessera.controlplane.tenantpods.running import TenantPods

            pods = TenantPods(store, host.host_api, getattr(host, "reach", manifests.endpoint))
        reconciler = Reconciler(store, publish, drivers, pki, host, settings.platform_namespace, claims=drain,
                                teardown_wait=settings.teardown_wait_seconds, pods=pods)
        capacity = HostCapacity(settings.host_cpu_millis, settings.host_memory_mib)
        tenants = TenantApi(store, reconciler, capacity, ledger=drain.ledger)
        resources = None
        if hasattr(host, "tenant_control_planes"):  # a Kubernetes host: serve its TenantControlPlane objects
            from tessera.controlplane.resources import TenantResources

            resources = TenantResources(tenants, store, host.tenant_control_planes())
        manager = cls(store, reconciler, tenants, drivers, host, settings, resources)
        if pods is not None:  # a change in a syncer's state is a reconcile: the tenant's status shows it
            pods.on_change = manager._pods_changed
        planes = host if isinstance(host, LocalControlPlanes) else getattr(host, "planes", None)
        if isinstance(planes, LocalControlPlanes):  # it sees which tenants are idle: they are put to sleep
            planes.on_idle = manager._idle
            planes.before_start = manager._before_start
        return manager

    async def resync_forever(self, on_first: Callable[[], None] | None = None) -> None:
        try:
            first = True
            while True:
                try:
                    await self.reconciler.resync()
                except TemporaryError as exc:  # NATS electing a leader, a peer down: try again soon
                    log.warning("resync put off: %s", exc)
                    await asyncio.sleep(min(exc.delay, self.settings.resync_seconds))
                    continue
                if self.resources is not None and not first:  # (the objects' own loop lists them first)
                    try:
                        await self.resources.resync()  # statuses current, orphans of lost objects gone
                    except Exception as exc:
                        log.warning("TenantControlPlane resync failed: %s", exc)
                if first and on_first is not None:
                    on_first()
                first = False
                await asyncio.sleep(self.settings.resync_seconds)
        finally:
            await self.close()

    def root_tasks(self, on_first: Callable[[], None] | None = None) -> dict[str, Coroutine]:
        """The manager's own loops: periodic resync, and in Kubernetes mode the readiness watch and
        the TenantControlPlane objects."""
        tasks: dict[str, Coroutine] = {"resync": self.resync_forever(on_first)}
        if hasattr(self.host, "watches"):  # (several loops, each a root task of its own)
            tasks.update(self.host.watches(self._on_host_change))
        elif hasattr(self.host, "watch"):
            tasks["readiness-watch"] = self.follow_host()
        if self.resources is not None:
            tasks["tenantcontrolplanes"] = self.resources.run()
        return tasks

    async def follow_host(self) -> None:
        """Reconcile a tenant whenever the host cluster reports a change to its control plane."""
        await self.host.watch(self._on_host_change)  # type: ignore[attr-defined]

    async def _on_host_change(self, tenant: str) -> None:
        try:
            await self.reconciler.reconcile(tenant)
            if self.resources is not None:
                await self.resources.report(tenant)
        except Exception as exc:  # the next event or resync tries again
            log.warning("reconcile %s after host change failed: %s", tenant, exc)

    async def _idle(self, tenant: str) -> None:
        await self.api.set_asleep(tenant, True)  # (as `tessera tenant sleep`: its Deployment scaled to zero)

    async def _before_start(self, tenant: str, process: str) -> None:
        """A tenant's datastore shim is about to start: free what its dead predecessor left held."""
        if process != manifests.DATASTORE_SHIM:
            return
        stored = await self.store.secrets.get(tenant)
        creds = stored.value.datastore if stored is not None else None
        driver = self.drivers.get(creds.driver) if creds is not None else None
        if creds is None or not isinstance(driver, ReleasesSessions):
            return
        try:
            freed = await driver.release_sessions(tenant, creds)
        except Exception as exc:  # (the shim may still start; its log says why not)
            log.warning("tenant %s: what its last datastore shim held was not freed: %s", tenant, exc)
            return
        if freed:
            log.info("tenant %s: freed %d consumers its last datastore shim left behind", tenant, freed)

    def _pods_changed(self, tenant: str) -> None:
        task = asyncio.get_running_loop().create_task(self._on_host_change(tenant), name=f"pods-changed-{tenant}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        if self.reconciler.pods is not None:
            await self.reconciler.pods.close()
        await cancel_and_wait(list(self._background))
        await self.host.close()
        for driver in self.drivers.values():
            try:
                await driver.close()
            except Exception as exc:
                log.warning("closing %s driver: %s", driver.name, exc)


async def make_drivers(bus: Bus, settings: ControlPlaneSettings) -> dict[str, DatastoreDriver]:
    # Drivers and the Kubernetes adapter are imported only when configured: psycopg and
    # kubernetes_asyncio cost start-up time and resident memory a NATS-only manager does not need.
    drivers: dict[str, DatastoreDriver] = {}
    if "nats" in settings.drivers:
        from tessera.controlplane.datastores.natskv import NatsKvDriver

        drivers["nats"] = NatsKvDriver.from_settings(bus, settings)
    if "postgres" in settings.drivers:
        from tessera.controlplane.datastores.postgres import PostgresDriver

        drivers["postgres"] = PostgresDriver(settings.postgres_dsn, settings.postgres_tenant_host,
                                             settings.postgres_connection_limit)
    if "etcd" in settings.drivers and settings.etcd_mode == "dedicated":
        from tessera.controlplane.datastores.etcd_dedicated import DedicatedEtcdDriver

        drivers["etcd"] = DedicatedEtcdDriver(settings.etcd_data_dir, settings.etcd_quota_bytes, settings.etcd_binary)
    elif "etcd" in settings.drivers:
        from tessera.controlplane.datastores.etcd import EtcdCa, EtcdDriver

        ca = EtcdCa(settings.etcd_ca_file, settings.etcd_ca_key_file) if settings.etcd_ca_file else None
        drivers["etcd"] = EtcdDriver(settings.etcd_endpoint, settings.etcd_root_password, ca)
    return drivers


def make_host(settings: ControlPlaneSettings) -> HostCluster:
    if settings.host_mode == "render":
        return RenderedHost(settings.manifests_dir)
    if settings.host_mode == "local":
        return local_planes(settings)
    if settings.host_mode == "kubernetes":
        from tessera.controlplane.kube import KubeHost

        if settings.kube_pods == "local":
            from tessera.controlplane.localkubelet import LocalKubelet

            return LocalKubelet(KubeHost(), local_planes(settings))
        return KubeHost()
    return NoHost()


def local_planes(settings: ControlPlaneSettings) -> LocalControlPlanes:
    """The tenants' control-plane pods as the manager's own processes (``local``, or Kubernetes
    without a kubelet for them)."""
    from tessera.controlplane.limits import Limits

    kube_bin, kine_bin = default_bin_dirs()
    return LocalControlPlanes(settings.control_planes_dir, settings.kube_bin_dir or kube_bin,
                              settings.kine_bin_dir or kine_bin, idle_seconds=settings.idle_seconds,
                              stop_on_close=settings.stop_planes_on_exit,
                              limits=Limits.find(settings.cgroup_root) if settings.cgroup_root else None)
