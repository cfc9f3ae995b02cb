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
import json
from pathlib import Path

import pytest

from cdischema import validate_dir
from runkit import wait_until
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


async def prepare(client, cluster, memory_mib: int, *, claim: str | None = None, gpu: str | None = None):
    """Submit a claim of ``memory_mib`` on gpu-0 (on GPU ``gpu`` if given); once it is prepared, its
    spec (validated, with every other spec in the directory) and device id."""
    result = await client.submit(api.SubmitRequest(
        tenant="alpha", node=NODE, claim=claim, annotations={"nvidia.com/use-gpuuuid": gpu} if gpu else {},
        resources={"nvidia.com/gpu": 1, "nvidia.com/gpumem": memory_mib, "nvidia.com/gpucores": 30}))
    record = await client.wait_for(result["claim"], {"prepared", "unschedulable", "failed"}, timeout=60)
    assert record.state == "prepared", f"claim {record.claim} is {record.state}: {record.reason}"
    specs = {tuple(cdi.device_ids(s)): s for s in validate_dir(cdi_dir(cluster))}
    spec = json.loads(cdi.spec_path(cdi_dir(cluster), record.claim).read_text())
    assert specs[tuple(cdi.device_ids(spec))] == spec
    return spec, cdi.device_ids(spec)[0]


async def release(client, cluster, claim: str) -> None:
    await client.release(claim)
    await client.wait_for(claim, {"released"}, timeout=60)
    path = cdi.spec_path(cdi_dir(cluster), claim)
    await wait_until(lambda: not path.exists(), timeout=30, what=f"{path.name} to be removed")


def env_of(spec: dict) -> dict[str, str]:
    return dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])


def claim_of(spec: dict) -> str:
    return spec["devices"][0]["name"]  # our claim ids are valid device names, so the name is the id


def report(result) -> dict:
    assert result.code == 0, f"container failed ({result.code}): {result.stderr[-2000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


async def probe(podman: Podman, base_image, cuda_probe, *devices: str, command=(), mounts=None, run_opts=()):
    """Run cuda_probe (64 MiB steps, no maximum unless the command says) in a fresh container."""
    args = podman.run_args(base_image, *devices, mounts={str(cuda_probe): PROBE, **(mounts or {})}, options=run_opts)
    return await asyncio.to_thread(podman, *args, *(command or (PROBE, "64", "0")))


async def test_a_container_of_a_claim_gets_out_of_memory_at_exactly_its_limit(
        client, cluster, podman, base_image, cuda_probe):
    spec, device = await prepare(client, cluster, 1024)
    try:
        got = report(await probe(podman, base_image, cuda_probe, device))
        assert got["devices"] == 1 and got["total_mib"] == 1024
        assert got["allocated_mib"] == 1024 and got["stopped_by"] == OUT_OF_MEMORY
        assert got["one_more_byte"] == OUT_OF_MEMORY
        # The same container without the claim's device, given the simulated driver by hand, is
        # not limited: the limit comes from what the spec puts in.
        sim = {str(VGPU_BUILD / "sim" / lib): f"/usr/lib/{lib}" for lib in cdi.SIM_DRIVER_LIBS}
        free = report(await probe(podman, base_image, cuda_probe, mounts=sim, command=(PROBE, "64", "2048")))
        assert free["allocated_mib"] == 2048 and free["stopped_by"] == 0
    finally:
        await release(client, cluster, claim_of(spec))


async def test_unset_or_raised_variables_in_the_container_lift_nothing(
        client, cluster, podman, base_image, cuda_probe):
    spec, device = await prepare(client, cluster, 1024)
    try:
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
        for got in (unset, raised, overridden):
            assert (got["allocated_mib"], got["stopped_by"], got["one_more_byte"]) == (1024, OUT_OF_MEMORY,
                                                                                       OUT_OF_MEMORY), got
    finally:
        await release(client, cluster, claim_of(spec))


async def hold(podman: Podman, base_image, cuda_probe, device: str, mib: int):
    """A container whose probe takes ``mib`` and keeps it until its stdin is closed."""
    args = podman.run_args(base_image, device, mounts={str(cuda_probe): PROBE})
    proc = await asyncio.to_thread(podman.popen, *args, PROBE, "64", str(mib), "hold")
    line = await asyncio.to_thread(proc.stdout.readline)
    assert line, f"holding container failed: {proc.stderr.read()[-2000:] if proc.poll() is not None else ''}"
    return proc, json.loads(line)


async def let_go(proc) -> None:
    """Close the holding container's stdin: its probe frees its memory and the container ends."""
    _, err = await asyncio.to_thread(proc.communicate, None, 60)
    assert proc.returncode == 0, err[-2000:]


async def test_two_containers_of_one_claim_draw_on_one_budget(client, cluster, podman, base_image, cuda_probe):
    spec, device = await prepare(client, cluster, 1024)
    try:
        proc, first = await hold(podman, base_image, cuda_probe, device, 384)
        try:
            assert first["allocated_mib"] == 384
            second = report(await probe(podman, base_image, cuda_probe, device))
            assert second["allocated_mib"] == 1024 - 384 and second["stopped_by"] == OUT_OF_MEMORY
        finally:
            await let_go(proc)
        # The first container's memory went back to the claim when it ended.
        assert report(await probe(podman, base_image, cuda_probe, device))["allocated_mib"] == 1024
    finally:
        await release(client, cluster, claim_of(spec))


async def test_two_claims_on_one_gpu_each_get_their_own_budget(client, cluster, podman, base_image, cuda_probe):
    spec_a, device_a = await prepare(client, cluster, 1024)
    spec_b, device_b = await prepare(client, cluster, 512, gpu=env_of(spec_a)["CUDA_VISIBLE_DEVICES"])
    try:
        assert env_of(spec_a)["CUDA_VISIBLE_DEVICES"] == env_of(spec_b)["CUDA_VISIBLE_DEVICES"]
        caches = {m["hostPath"] for s in (spec_a, spec_b) for m in s["devices"][0]["containerEdits"]["mounts"]
                  if "rw" in m["options"]}
        assert len(caches) == 2  # one accounting directory per claim
        proc, first = await hold(podman, base_image, cuda_probe, device_a, 1024)
        try:
            assert first["allocated_mib"] == 1024
            other = report(await probe(podman, base_image, cuda_probe, device_b))
            assert other["allocated_mib"] == 512 and other["stopped_by"] == OUT_OF_MEMORY
        finally:
            await let_go(proc)
    finally:
        await release(client, cluster, claim_of(spec_a))
        await release(client, cluster, claim_of(spec_b))


async def test_a_released_claims_device_no_longer_resolves(client, cluster, podman, base_image, cuda_probe):
    spec, device = await prepare(client, cluster, 256)
    assert report(await probe(podman, base_image, cuda_probe, device))["allocated_mib"] == 256
    await release(client, cluster, claim_of(spec))
    refused = await probe(podman, base_image, cuda_probe, device)
    assert refused.code != 0 and f"unresolvable CDI devices {device}" in refused.stderr, refused.stderr


async def test_podman_takes_the_spec_at_its_minimum_version_and_refuses_a_newer_declaration(
        client, cluster, podman, base_image, cuda_probe, tmp_path):
    # A claim id starting with a digit is the one thing in our content that needs more than 0.3.0.
    spec, device = await prepare(client, cluster, 128, claim="7f3a0c-digit-first")
    try:
        assert spec["cdiVersion"] == "0.5.0"
        assert report(await probe(podman, base_image, cuda_probe, device))["allocated_mib"] == 128
        # Debian's Podman 4.3 has a CDI library that knows versions up to 0.5.0: the 1.1.0 the
        # enforcer used to declare for the same content makes the device unresolvable there.
        version = (await asyncio.to_thread(podman, "--version")).stdout.split()[-1]
        newer = Podman(cdi_dir=tmp_path, tools=podman.tools)
        cdi.write_spec(tmp_path, dict(spec, cdiVersion="1.1.0"))
        declared_newer = await probe(newer, base_image, cuda_probe, device)
        if version.startswith("4."):
            assert declared_newer.code != 0 and "unresolvable CDI devices" in declared_newer.stderr, version
        else:  # a Podman with a CDI library of 1.1.0 or later takes both
            assert report(declared_newer)["allocated_mib"] == 128, version
    finally:
        await release(client, cluster, claim_of(spec))
