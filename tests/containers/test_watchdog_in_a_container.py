"""The enforcer's watchdog in a claim's container (Podman, the enforcer's CDI spec): a static binary
that maps the driver library itself and a dlmopen escapee that loads a second driver past libvgpu are
killed and reported as the claim's violation; a process of the same claim with libvgpu in force (the
preload the spec mounts) keeps running. The escapees are tests/enforcer/escapee.c, built on the host
(the base image is Debian, like the host, so the dynamic one runs in it as cuda_probe does).
The bound: the enforcer sweeps every 2 s (its default); a container's escapee is killed within
KILL_BOUND seconds of holding the GPU.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from kit import eventually
from tessera.shared import subjects
from tessera.shared.events import ClaimViolation, claim_decoder

from tessera.enforcer.driver import CONTAINER_SIM_DRIVER_DIR

from test_cdi_enforcement import PROBE, claims, client, holding, podman  # noqa: F401 - fixtures

ESCAPEE = "/usr/local/bin/escapee"
KILL_BOUND = 30.0
SIGKILLED = 137  # what `podman run` answers when the container's process was SIGKILLed


@pytest.fixture(scope="module")
def escapees(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("escapee")
    src = Path(__file__).parent.parent / "enforcer" / "escapee.c"
    flags = ["gcc", "-O2", "-Wall", "-Wextra", "-Werror"]
    subprocess.run([*flags, "-DESCAPEE_STATIC", "-static", "-o", str(out / "static"), str(src)], check=True)
    subprocess.run([*flags, "-o", str(out / "dynamic"), str(src), "-ldl"], check=True)
    return {"static": out / "static", "dynamic": out / "dynamic"}


def violations_of(claim: str, seen: list) -> list[ClaimViolation]:
    return [e for e in seen if e.claim == claim]


@pytest.mark.parametrize("kind", ["static", "dlmopen"])
async def test_an_escapee_in_a_claims_container_is_killed_and_its_neighbour_left_alone(  # noqa: F811
        claims, client, podman, base_image, cuda_probe, escapees, tmp_path, kind):  # noqa: F811 - fixtures
    spec, device = await claims.prepare(512)
    claim = spec["devices"][0]["name"]
    seen: list[ClaimViolation] = []

    async def on_msg(msg) -> None:
        event = claim_decoder.decode(msg.data)
        if isinstance(event, ClaimViolation):
            seen.append(event)

    sub = await client.bus.listen(subjects.claims_of_kind("violation"), on_msg)
    try:
        async with holding(podman, base_image, cuda_probe, device, 128) as neighbour:
            assert neighbour["allocated_mib"] == 128
            if kind == "static":
                command = (ESCAPEE, "static", f"{CONTAINER_SIM_DRIVER_DIR}/libcuda.so.1", "/out/ready")
                binary = escapees["static"]
            else:
                command = (ESCAPEE, "dlmopen", "/out/ready", "1024")
                binary = escapees["dynamic"]
            args = podman.run_args(base_image, device, mounts={str(binary): ESCAPEE, str(cuda_probe): PROBE},
                                   options=("-v", f"{tmp_path}:/out"))
            run = asyncio.create_task(asyncio.to_thread(podman, *args, *command, timeout=KILL_BOUND + 60))
            await eventually(lambda: (tmp_path / "ready").exists() or run.done(), timeout=60,
                             what="the escapee to hold the GPU")
            result = await asyncio.wait_for(run, KILL_BOUND + 60)
            assert result.code == SIGKILLED, (result.code, result.stdout, result.stderr[-2000:])
            events = await eventually(lambda: violations_of(claim, seen), timeout=10,
                                      what=f"a violation event of {claim}")
            assert events[0].node == "gpu-0" and events[0].tenant == "alpha"
            # the neighbour, libvgpu in force in the same claim, still holds its memory (holding()
            # asserts it ends with 0 when the block ends)
    finally:
        await sub.unsubscribe()
