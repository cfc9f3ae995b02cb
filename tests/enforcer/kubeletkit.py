"""Acting as the kubelet and the control side for the kubelet plugin tests.

`Kubelet` does what the kubelet's plugin watcher and DRA manager do, over the real unix sockets with
a grpc.aio client: find the registration socket in the registry directory, GetInfo, connect to the
endpoint it names, NotifyRegistrationStatus, then NodePrepareResources / NodeUnprepareResources.
`PluginNode` runs one enforcer in Kubernetes mode as a real process (its console script) against
the test's nats-server and the real control plane (``plane``: the enforcer acts as its DaemonSet's
pod on the node, `node_bound_identity`) or the API-server emulator (``apiserver``, for the faults
only it can inject), and writes what placement would have written before the kubelet asks: the
claim's record, its ledger entry (through the real Ledger API) and the ResourceClaim's
``status.allocation`` — on the real plane the claim itself is the resourceclaim controller's, made
for a gated pod from the translator's template (`gpupods`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from tessera.cli.cluster import LocalCluster, ServiceProcess
from tessera.enforcer.kubelet.api import (
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
    pluginregistration_v1_pb2 as reg_pb2,
    pluginregistration_v1_pb2_grpc as reg_grpc,
)
from tessera.shared import subjects
from tessera.shared.bus import Bus
from tessera.shared.claimstore import ClaimStore
from tessera.shared.errors import ConflictError
from tessera.shared.events import ClaimRecord, ClaimSpec, DeviceShare, LedgerEntry
from tessera.shared.kubeapi import KubeApi, object_path
from tessera.shared.kubeclaims import DRIVER, RESOURCE_API_VERSION, KubeClaimRef, claim_id
from tessera.shared.ledger import Ledger
from tessera.shared.profile import gpu_uuid
from tessera.shared.settings import BusSettings

ROOT = Path(__file__).resolve().parents[2]
# The API-server emulator of tests/kubernetes (a directory of modules, not a package).
sys.path.insert(0, str(ROOT / "tests" / "kubernetes"))
from apiserver import ApiServer  # noqa: E402
from gpupods import GpuPods  # noqa: E402
from kit import eventually  # noqa: E402
from kit.kubecluster import KubeControlPlane, node_bound_identity  # noqa: E402
PROFILES = ROOT / "tests" / "profiles"
NODE = "gpu-0"
FAST = {"TESSERA_USAGE_SECONDS": "0.2", "TESSERA_RECLAIM_SECONDS": "2", "TESSERA_LOST_RECLAIM_SECONDS": "60"}


def _cdischema():
    """The CDI JSON-schema validator of tests/cdi (a directory of its own, not a package)."""
    spec = importlib.util.spec_from_file_location("cdischema", ROOT / "tests" / "cdi" / "cdischema.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cdischema = _cdischema()


def write_kubeconfig(path: Path, server: str) -> Path:
    """A kubeconfig for the emulator (plain HTTP; it checks no credentials)."""
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: emulator\n"
        f"clusters:\n- name: emulator\n  cluster: {{server: '{server}'}}\n"
        "users:\n- name: emulator\n  user: {token: test}\n"
        "contexts:\n- name: emulator\n  context: {cluster: emulator, user: emulator}\n")
    return path


def resource_claim(name: str, namespace: str, count: int) -> dict:
    """A ResourceClaim as the resourceclaim controller makes it from the translator's template."""
    return {
        "apiVersion": RESOURCE_API_VERSION, "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": DRIVER, "allocationMode": "ExactCount", "count": count}}]}},
    }


def allocation(uid: str, *, node: str, driver: str, devices: tuple[tuple[int, int, int], ...]) -> dict:
    """The ``status.allocation`` placement writes: results with shareID and consumedCapacity, the node."""
    results = [{"request": "gpu", "driver": driver, "pool": node, "device": f"gpu-{index}",
                "shareID": str(uuid.uuid5(uuid.NAMESPACE_URL, f"{uid}/{index}")),
                "consumedCapacity": {"memory": f"{memory}Mi", "cores": str(cores), "shares": "1"}}
               for index, memory, cores in devices]
    return {"devices": {"results": results},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}


def shares_of(devices: tuple[tuple[int, int, int], ...], node: str = NODE) -> list[DeviceShare]:
    return [DeviceShare(uuid=gpu_uuid(node, index), index=index, memory_mib=memory, cores=cores)
            for index, memory, cores in devices]


class Kubelet:
    """The kubelet's side of plugin registration and of the DRA calls."""

    def __init__(self, registry_dir: Path) -> None:
        self.registry_dir = registry_dir
        self.channels: list[grpc.aio.Channel] = []
        self.info: reg_pb2.PluginInfo | None = None
        self.dra = None
        self.dra_beta = None

    def _channel(self, socket: str | Path) -> grpc.aio.Channel:
        channel = grpc.aio.insecure_channel(f"unix://{socket}")
        self.channels.append(channel)
        return channel

    def sockets(self) -> list[Path]:
        # The plugin watcher ignores names starting with a dot.
        return sorted(p for p in self.registry_dir.iterdir() if p.is_socket() and not p.name.startswith("."))

    async def register(self) -> reg_pb2.PluginInfo:
        (socket,) = self.sockets()
        registration = reg_grpc.RegistrationStub(self._channel(socket))
        self.info = await registration.GetInfo(reg_pb2.InfoRequest(), timeout=10)
        endpoint = self._channel(self.info.endpoint)
        self.dra = dra_v1_pb2_grpc.DRAPluginStub(endpoint)
        self.dra_beta = dra_v1beta1_pb2_grpc.DRAPluginStub(endpoint)
        await registration.NotifyRegistrationStatus(reg_pb2.RegistrationStatus(plugin_registered=True), timeout=10)
        return self.info

    async def prepare(self, *claims: dict, beta: bool = False):
        pb2, stub = (dra_v1beta1_pb2, self.dra_beta) if beta else (dra_v1_pb2, self.dra)
        request = pb2.NodePrepareResourcesRequest(claims=[pb2.Claim(**c) for c in claims])
        return (await stub.NodePrepareResources(request, timeout=30)).claims

    async def unprepare(self, *claims: dict):
        request = dra_v1_pb2.NodeUnprepareResourcesRequest(claims=[dra_v1_pb2.Claim(**c) for c in claims])
        return (await self.dra.NodeUnprepareResources(request, timeout=30)).claims

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()
        self.channels.clear()


@dataclass
class PluginNode:
    nats_url: str
    workdir: Path
    apiserver: ApiServer | None = None
    plane: KubeControlPlane | None = None
    namespace: str = "team-a"
    # Unix socket paths are limited to 107 bytes: the kubelet's directories get a short root.
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kp-", dir="/tmp")))
    process: ServiceProcess | None = None
    bus: Bus | None = None

    def __post_init__(self) -> None:
        if self.plane is not None:
            kubeconfig = node_bound_identity(self.plane, "enforcer.yaml", NODE)
            self.kube = KubeApi.for_kubeconfig(self.plane.admin_kubeconfig)  # what placement and users do
            self.pods = GpuPods(self.plane)
        else:
            kubeconfig = write_kubeconfig(self.workdir / "kubeconfig", self.apiserver.url)
            self.kube = KubeApi.for_url(self.apiserver.url)
        self.kubeconfig = kubeconfig
        self.registry_dir = self.root / "plugins_registry"
        self.plugin_dir = self.root / "plugins" / DRIVER
        self.cdi_dir = self.root / "cdi"
        self.boot_file = self.root / "boot_id"
        self.boot_file.write_text(str(uuid.uuid4()) + "\n")
        self.state_dir = self.workdir / "state"
        self.cluster = LocalCluster(workdir=self.workdir, profile=PROFILES / "tiny.yaml", nats_url=self.nats_url)
        self.env = dict(FAST, TESSERA_NODE=NODE, TESSERA_KUBERNETES="true", KUBECONFIG=str(kubeconfig),
                        TESSERA_STATE_DIR=str(self.state_dir), TESSERA_CDI_DIR=str(self.cdi_dir),
                        TESSERA_KUBELET_REGISTRY_DIR=str(self.registry_dir),
                        TESSERA_KUBELET_PLUGIN_DIR=str(self.plugin_dir), TESSERA_BOOT_ID_FILE=str(self.boot_file))

    # --- the enforcer process -------------------------------------------------------------------

    async def start(self) -> None:
        self.process = self.cluster.spawn("enforcer", instance="enforcer-k8s", env=self.env)
        await asyncio.to_thread(self._wait_ready)
        if self.bus is None:
            self.bus = await Bus.connect(BusSettings(url=self.nats_url), "kubelet-test")
            self.ledger = Ledger(await self.bus.kv(subjects.KV_LEDGER))
            self.claims = ClaimStore(await self.bus.kv(subjects.KV_CLAIMS))

    def _wait_ready(self) -> None:
        self.cluster.processes = [self.process]
        self.cluster.wait_ready(60)

    async def consuming(self) -> None:
        """Wait until the enforcer's claims consumer pulls: its start-up reconcile is done by then."""
        async def pulling() -> bool:
            info = await self.bus.consumer_info(subjects.STREAM_CLAIMS, f"enforcer-{NODE}")
            return info.num_waiting > 0

        await eventually(pulling, timeout=30, every=0.05, what="the enforcer's claims consumer pulling")

    def kill(self) -> None:
        """SIGKILL: no cleanup of any kind runs."""
        self.process.proc.kill()
        self.process.proc.wait()

    def stop(self) -> int:
        return self.cluster.stop_process(self.process)

    def log(self) -> str:
        return self.process.log_path.read_text()

    async def close(self) -> None:
        if self.process is not None and self.process.alive():
            self.stop()
        if self.bus is not None:
            await self.bus.close()
        await self.kube.close()
        if self.plane is not None:
            await self.pods.close()
        shutil.rmtree(self.root, ignore_errors=True)

    # --- what the control side writes before the kubelet asks -----------------------------------

    async def allocate(self, name: str, *, node: str = NODE, devices=((0, 8000, 50),), namespace: str | None = None,
                       driver: str = DRIVER, ledger: bool = True, in_api: bool = True,
                       ledger_devices=None) -> dict:
        """A ResourceClaim allocated by placement: the API object (the API server assigns its uid),
        the claim's record and its ledger entry, then ``status.allocation``. Returns the kubelet's
        name for it (namespace, name, uid)."""
        namespace = namespace or self.namespace
        if in_api and self.plane is not None:  # the controller's claim for the pod ``name``
            _, obj = await self.pods.create(namespace, name, ClaimSpec(gpus=len(devices)))
            name, uid = obj["metadata"]["name"], obj["metadata"]["uid"]
        elif in_api:
            if await self.kube.get(object_path("v1", "namespaces", namespace)) is None:
                await self.kube.create(object_path("v1", "namespaces"),
                                       {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
            collection = object_path(RESOURCE_API_VERSION, "resourceclaims", namespace=namespace)
            obj = await self.kube.create(collection, resource_claim(name, namespace, len(devices)))
            uid = obj["metadata"]["uid"]
        else:
            uid = str(uuid.uuid4())
        claim = claim_id(uid)
        held = shares_of(ledger_devices or devices, node)
        await self.claims.create(ClaimRecord(
            claim=claim, tenant="alpha", state="allocated", spec=ClaimSpec(gpus=len(held)), node=node, devices=held,
            kube=KubeClaimRef(namespace=namespace, name=name, uid=uid)))
        if ledger:
            while True:
                current, revision = await self.ledger.read_node(node)
                try:
                    await self.ledger.commit(node, LedgerEntry(claim=claim, tenant="alpha", shares=held), current, revision)
                    break
                except ConflictError:  # a concurrent write (the enforcer's janitor): read again
                    continue
        if in_api:
            obj["status"] = {"allocation": allocation(uid, node=node, driver=driver, devices=devices)}
            path = object_path(RESOURCE_API_VERSION, "resourceclaims", name, namespace)
            await self.kube.replace_status(path, obj)
        return {"namespace": namespace, "name": name, "uid": uid}

    # --- what is on the node ---------------------------------------------------------------------

    def claim_dir(self, ref: dict) -> Path:
        return self.state_dir / "claims" / claim_id(ref["uid"])

    def spec_file(self, ref: dict) -> Path:
        return self.cdi_dir / f"{DRIVER}-gpu_{claim_id(ref['uid'])}.json"

    def leftovers(self, ref: dict) -> list[Path]:
        return [p for p in (self.claim_dir(ref), self.spec_file(ref)) if p.exists()]

    def spec(self, ref: dict) -> dict:
        spec = json.loads(self.spec_file(ref).read_text())
        cdischema.validate(spec)
        return spec
