"""A real container runtime applies the CDI specs the enforcer writes, and enforcement holds inside.

The enforcer runs as its own process on a simulated fleet (a real nats-server and all five services,
tests/enforcer/runkit.py) and prepares claims submitted through the API; Podman (runtime.py) runs
containers with ``--device gpu.tessera.dev/gpu=<name>`` from the specs it wrote. In each container a
small CUDA-driver client (cuda_probe.c, on the simulated driver the spec mounts) allocates until it
is refused. Every spec the enforcer wrote is validated against the schema written from the CDI
specification before Podman is given it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import pytest

from cdischema import validate_dir
from kit import eventually
from runtime import Podman
from tessera.shared import api

from tessera.cli.client import Client
from tessera.enforcer import cdi

OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY
PROBE = "/usr/local/bin/cuda_probe"
NODE = "gpu-0"
VGPU_BUILD = Path(__file__).parent.parent.parent / "native" / "vgpu" / "build"


@pytest.fixture
async def client(cluster):
    client = await Client.connect(cluster.url)
    yield client
    await client.close()


def cdi_dir(cluster, node: str = NODE) -> Path:
    return cluster.workdir / "state" / f"enforcer-{node}" / "cdi"


@pytest.fixture
def podman(cluster, tools) -> Podman:
    return Podman(cdi_dir=cdi_dir(cluster), tools=tools)


class Claims:
    """The claims one test prepares on gpu-0; whatever it does not release is released after it."""

    def __init__(self, client, cluster) -> None:
        self.client, self.cluster, self.held = client, cluster, []

    async def prepare(self, memory_mib: int, *, claim: str | None = None, gpu: str | None = None,
                      priority: int | None = None):
        """Submit a claim of ``memory_mib`` (on GPU ``gpu`` if given, of runtime ``priority`` if
        given); once it is prepared, its spec (validated, with every other spec in the directory) and
        its device id."""
        resources = {"nvidia.com/gpu": 1, "nvidia.com/gpumem": memory_mib, "nvidia.com/gpucores": 30}
        if priority is not None:
            resources["nvidia.com/priority"] = priority
        result = await self.client.submit(api.SubmitRequest(
            tenant="alpha", node=NODE, claim=claim, annotations={"nvidia.com/use-gpuuuid": gpu} if gpu else {},
            resources=resources))
        record = await self.client.wait_for(result["claim"], {"prepared", "unschedulable", "failed"}, timeout=60)
        assert record.state == "prepared", f"claim {record.claim} is {record.state}: {record.reason}"
        self.held.append(record.claim)
        specs = {tuple(cdi.device_ids(s)): s for s in validate_dir(cdi_dir(self.cluster))}
        spec = json.loads(cdi.spec_path(cdi_dir(self.cluster), record.claim).read_text())
        assert specs[tuple(cdi.device_ids(spec))] == spec
        return spec, cdi.device_ids(spec)[0]

    async def release(self, claim: str) -> None:
        """Release the claim and wait until the enforcer has removed its spec."""
        self.held.remove(claim)
        await self.client.release(claim)
        await self.client.wait_for(claim, {"released"}, timeout=60)
        path = cdi.spec_path(cdi_dir(self.cluster), claim)
        await eventually(lambda: not path.exists(), timeout=30, what=f"{path.name} to be removed")


@pytest.fixture
async def claims(client, cluster):
    kit = Claims(client, cluster)
    yield kit
    for claim in list(kit.held):
        await kit.release(claim)


def env_of(spec: dict) -> dict[str, str]:
    return dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])


def report(result) -> dict:
    assert result.code == 0, f"container failed ({result.code}): {result.stderr[-2000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


async def probe(podman: Podman, base_image, cuda_probe, *devices: str, command=(), mounts=None, run_opts=()):
    """Run cuda_probe (64 MiB steps, no maximum unless the command says) in a fresh container."""
    args = podman.run_args(base_image, *devices, mounts={str(cuda_probe): PROBE, **(mounts or {})}, options=run_opts)
    return await asyncio.to_thread(podman, *args, *(command or (PROBE, "64", "0")))


@contextlib.asynccontextmanager
async def holding(podman: Podman, base_image, cuda_probe, device: str, mib: int):
    """A container whose probe takes ``mib`` and keeps it (yields its report) until the block ends."""
    args = podman.run_args(base_image, device, mounts={str(cuda_probe): PROBE})
    proc = await asyncio.to_thread(podman.popen, *args, PROBE, "64", str(mib), "hold")
    try:
        line = await asyncio.to_thread(proc.stdout.readline)
        assert line, "the holding container ended before it reported"
        yield json.loads(line)
    finally:
        # Closing its stdin lets the probe free its memory and the container end.
        _, err = await asyncio.to_thread(proc.communicate, None, 60)
    assert proc.returncode == 0, err[-2000:]


async def test_a_container_of_a_claim_gets_out_of_memory_at_exactly_its_limit(
        claims, podman, base_image, cuda_probe):
    _, device = await claims.prepare(1024)
    got = report(await probe(podman, base_image, cuda_probe, device))
    assert got["devices"] == 1 and got["total_mib"] == 1024
    assert got["allocated_mib"] == 1024 and got["stopped_by"] == OUT_OF_MEMORY
    assert got["one_more_byte"] == OUT_OF_MEMORY
    # The same container without the claim's device, given the simulated driver by hand, is not
    # limited: the limit comes from what the spec puts in.
    sim = {str(VGPU_BUILD / "sim" / lib): f"/usr/lib/{lib}" for lib in cdi.SIM_DRIVER_LIBS}
    free = report(await probe(podman, base_image, cuda_probe, mounts=sim, command=(PROBE, "64", "2048")))
    assert free["allocated_mib"] == 2048 and free["stopped_by"] == 0


async def test_unset_or_raised_variables_in_the_container_lift_nothing(claims, podman, base_image, cuda_probe):
    _, device = await claims.prepare(1024)
    unset = report(await probe(podman, base_image, cuda_probe, device, command=(
        "env", "-u", "LD_PRELOAD", "-u", "CUDA_DEVICE_MEMORY_LIMIT_0", "-u", "CUDA_DEVICE_MEMORY_SHARED_CACHE",
        PROBE, "64", "0")))
    assert unset["preload_env"] is None and unset["limit_env"] is None and unset["cache_env"] is None
    raised = report(await probe(podman, base_image, cuda_probe, device, command=(
        "sh", "-c", "export CUDA_DEVICE_MEMORY_LIMIT_0=64g CUDA_DEVICE_MEMORY_LIMIT=64g LD_PRELOAD= "
                    "CUDA_DEVICE_MEMORY_SHARED_CACHE=/tmp/own.cache; exec " + PROBE + " 64 0")))
    assert raised["limit_env"] == "64g" and raised["preload_env"] == "" and raised["cache_env"] == "/tmp/own.cache"
    overridden = report(await probe(podman, base_image, cuda_probe, device, run_opts=(
        "--env", "CUDA_DEVICE_MEMORY_LIMIT_0=32g", "--env", "LD_PRELOAD=")))
    # Root in the container cannot take the read-only preload and limits files away either.
    tampered = report(await probe(podman, base_image, cuda_probe, device, command=(
        "sh", "-c", "rm -f /etc/ld.so.preload /etc/tessera/vgpu.conf; echo > /etc/ld.so.preload; "
                    "echo CUDA_DEVICE_MEMORY_LIMIT_0=64g > /etc/tessera/vgpu.conf; mv /etc /etc.moved; "
                    "unset LD_PRELOAD CUDA_DEVICE_MEMORY_LIMIT_0; exec " + PROBE + " 64 0")))
    for got in (unset, raised, overridden, tampered):
        assert (got["allocated_mib"], got["stopped_by"], got["one_more_byte"]) == (1024, OUT_OF_MEMORY,
                                                                                   OUT_OF_MEMORY), got


async def test_a_gpu_outside_the_claim_gets_no_memory_whatever_order_the_container_sees(
        claims, podman, base_image, cuda_probe):
    spec, device = await claims.prepare(1024)
    mine = env_of(spec)["CUDA_VISIBLE_DEVICES"]
    other = "GPU-5e55e7a0-0000-4000-8000-0000000000ff"
    # The simulated driver numbers its GPUs by TESSERA_SIM_GPU_UUIDS: here it stands in for a
    # container that sees one more GPU and has reordered its CUDA_VISIBLE_DEVICES.
    seen = f"export TESSERA_SIM_GPU_COUNT=2 TESSERA_SIM_GPU_UUIDS={other},{mine} CUDA_VISIBLE_DEVICES={other},{mine}"
    foreign, own = [report(await probe(podman, base_image, cuda_probe, device, command=(
        "sh", "-c", f"{seen} CUDA_PROBE_DEVICE={ordinal}; exec {PROBE} 64 0"))) for ordinal in (0, 1)]
    assert foreign["devices"] == 2 and foreign["allocated_mib"] == 0 and foreign["stopped_by"] == OUT_OF_MEMORY
    assert foreign["one_more_byte"] == OUT_OF_MEMORY
    assert own["allocated_mib"] == 1024 and own["stopped_by"] == OUT_OF_MEMORY  # its limit moved with it


async def test_two_containers_of_one_claim_draw_on_one_budget(claims, podman, base_image, cuda_probe):
    _, device = await claims.prepare(1024)
    async with holding(podman, base_image, cuda_probe, device, 384) as first:
        assert first["allocated_mib"] == 384
        second = report(await probe(podman, base_image, cuda_probe, device))
        assert second["allocated_mib"] == 1024 - 384 and second["stopped_by"] == OUT_OF_MEMORY
        # A workload cannot start itself a fresh budget by swapping the accounting file: it is a
        # mount point in the container, so removing or replacing it fails and the budget stays one.
        swapped = report(await probe(podman, base_image, cuda_probe, device, command=(
            "sh", "-c", 'c=$CUDA_DEVICE_MEMORY_SHARED_CACHE; rm -f "$c" 2>/dev/null; : > /tmp/new; '
                        'mv -f /tmp/new "$c" 2>/dev/null; exec ' + PROBE + " 64 0")))
        assert swapped["allocated_mib"] == 1024 - 384 and swapped["stopped_by"] == OUT_OF_MEMORY
    # The first container's memory went back to the claim when it ended.
    assert report(await probe(podman, base_image, cuda_probe, device))["allocated_mib"] == 1024


async def test_two_claims_on_one_gpu_each_get_their_own_budget(claims, podman, base_image, cuda_probe):
    spec_a, device_a = await claims.prepare(1024)
    spec_b, device_b = await claims.prepare(512, gpu=env_of(spec_a)["CUDA_VISIBLE_DEVICES"])
    assert env_of(spec_a)["CUDA_VISIBLE_DEVICES"] == env_of(spec_b)["CUDA_VISIBLE_DEVICES"]
    caches = {m["hostPath"] for s in (spec_a, spec_b) for m in s["devices"][0]["containerEdits"]["mounts"]
              if "rw" in m["options"]}
    assert len(caches) == 2  # one accounting directory per claim
    async with holding(podman, base_image, cuda_probe, device_a, 1024) as first:
        assert first["allocated_mib"] == 1024
        other = report(await probe(podman, base_image, cuda_probe, device_b))
        assert other["allocated_mib"] == 512 and other["stopped_by"] == OUT_OF_MEMORY


async def test_a_low_priority_container_cannot_write_its_gpus_priority_board_a_high_one_can(
        claims, podman, base_image):
    # (so a low-priority workload cannot erase the stamps that hold it back: native/vgpu/README.md)
    spec_low, device_low = await claims.prepare(256, priority=1)
    gpu = env_of(spec_low)["CUDA_VISIBLE_DEVICES"]
    spec_high, device_high = await claims.prepare(256, gpu=gpu, priority=0)
    board = next(m["hostPath"] for m in spec_low["devices"][0]["containerEdits"]["mounts"]
                 if m["hostPath"].endswith(f"{gpu}.board"))
    # opening it to append writes nothing, so the board is left as it was
    check = f'if (true >> {board}) 2>/dev/null; then echo writable; else echo read-only; fi; cat /etc/tessera/vgpu.conf'
    low, high = [await asyncio.to_thread(podman, *podman.run_args(base_image, device), "sh", "-c", check)
                 for device in (device_low, device_high)]
    assert low.code == 0 and high.code == 0, low.stderr + high.stderr
    assert low.stdout.splitlines()[0] == "read-only" and high.stdout.splitlines()[0] == "writable"
    assert "CUDA_TASK_PRIORITY=1" in low.stdout.splitlines() and "CUDA_TASK_PRIORITY=0" in high.stdout.splitlines()
    assert f"TESSERA_VGPU_PRIORITY_BOARD_0={board}" in low.stdout.splitlines()


async def test_a_released_claims_device_no_longer_resolves(claims, podman, base_image, cuda_probe):
    spec, device = await claims.prepare(256)
    assert report(await probe(podman, base_image, cuda_probe, device))["allocated_mib"] == 256
    await claims.release(spec["devices"][0]["name"])  # our claim ids are valid device names
    refused = await probe(podman, base_image, cuda_probe, device)
    assert refused.code != 0 and f"unresolvable CDI devices {device}" in refused.stderr, refused.stderr


async def test_podman_takes_the_spec_at_its_minimum_version_and_refuses_a_newer_declaration(
        claims, podman, base_image, cuda_probe, tmp_path):
    # A claim id starting with a digit is the one thing in our content that needs more than 0.3.0.
    spec, device = await claims.prepare(128, claim="7f3a0c-digit-first")
    assert spec["cdiVersion"] == "0.5.0"
    assert report(await probe(podman, base_image, cuda_probe, device))["allocated_mib"] == 128
    # Debian's Podman 4.3 has a CDI library that knows versions up to 0.5.0: the 1.1.0 the enforcer
    # used to declare for the same content makes the device unresolvable there.
    version = (await asyncio.to_thread(podman, "--version")).stdout.split()[-1]
    newer = Podman(cdi_dir=tmp_path, tools=podman.tools)
    cdi.write_spec(tmp_path, dict(spec, cdiVersion="1.1.0"))
    declared_newer = await probe(newer, base_image, cuda_probe, device)
    if version.startswith("4."):
        assert declared_newer.code != 0 and "unresolvable CDI devices" in declared_newer.stderr, version
    else:  # a Podman with a CDI library of 1.1.0 or later takes both
        assert report(declared_newer)["allocated_mib"] == 128, version


async def test_a_container_of_a_non_root_user_gets_exactly_its_claims_memory(claims, podman, base_image, cuda_probe):
    # runAsUser: 1000 in Kubernetes terms: the claim was prepared without a workload uid (container
    # layout), so its accounting file must be writable by a uid the enforcer never heard of.
    spec, device = await claims.prepare(512)
    got = report(await probe(podman, base_image, cuda_probe, device, run_opts=("--user", "1000:1000")))
    assert (got["allocated_mib"], got["stopped_by"], got["one_more_byte"]) == (512, OUT_OF_MEMORY, OUT_OF_MEMORY)
    # ...and it cannot write the read-only limits and preload files either.
    tampered = await probe(podman, base_image, cuda_probe, device, run_opts=("--user", "1000:1000"), command=(
        "sh", "-c", "echo > /etc/ld.so.preload || echo > /etc/tessera/vgpu.conf || echo refused"))
    assert tampered.stdout.strip().endswith("refused"), tampered.stdout
    # On the host, no user but the enforcer's can get to the claim's accounting file at all.
    cache = next(m["hostPath"] for m in spec["devices"][0]["containerEdits"]["mounts"] if "rw" in m["options"])
    assert oct(Path(cache).parent.stat().st_mode & 0o777) == "0o700"


async def test_the_driver_is_in_the_loader_cache_and_visible_devices_is_void_whatever_the_workload_sets(
        claims, podman, base_image, cuda_probe):
    # The workload asks for every GPU by environment, as NVIDIA's images do; the spec's edits
    # override it with "void", so an NVIDIA runtime on the node would inject nothing by itself.
    spec, device = await claims.prepare(256)
    assert env_of(spec)["NVIDIA_VISIBLE_DEVICES"] == "void"
    got = await probe(podman, base_image, cuda_probe, device, run_opts=("--env", "NVIDIA_VISIBLE_DEVICES=all"),
                      command=("sh", "-c", 'echo "$NVIDIA_VISIBLE_DEVICES"; ls /dev | grep -c nvidia; '
                                           "ldconfig -p | grep -E 'libcuda|libnvidia-ml' | sed 's/^[[:space:]]*//' "
                                           "| sort | tr '\\n' ';'; echo; exec " + PROBE + " 64 0"))
    assert got.code == 0, got.stderr[-2000:]
    visible, nodes, cache, _ = got.stdout.splitlines()
    assert (visible, nodes) == ("void", "0")  # simulated hardware: no device node at all
    # The spec's hook put the simulated driver into the container's loader cache, as ldconfig does
    # for a driver installed in the image (tools that look libcuda up there find it).
    assert cache.split(";")[:-1] == ["libcuda.so (libc6,x86-64) => /usr/lib/libcuda.so",
                                     "libcuda.so.1 (libc6,x86-64) => /usr/lib/libcuda.so.1",
                                     "libnvidia-ml.so.1 (libc6,x86-64) => /usr/lib/libnvidia-ml.so.1"], cache
    assert report(got)["allocated_mib"] == 256
