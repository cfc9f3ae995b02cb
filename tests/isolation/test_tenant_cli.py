"""A tenant uses `tessera submit --wait` and `tessera run` with only its own NATS credentials.

`tessera up`'s embedded server runs with authorization; the manager gives each tenant its own
account and password. The tenant's CLI reaches the claim API through its account's imports, which
carry its name, so what it asks for another tenant is refused: by the translator ("connected as
tenant ...") or as a claim that does not exist for it.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from tessera.cli.client import Client
from tessera.shared import api, subjects
from tessera.shared.events import GpuQuota

from secretscan import tenant_secrets

TESSERA = str(Path(sys.executable).parent / "tessera")


async def tessera(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(TESSERA, *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode, " ".join(out.decode().split())


async def tenant_password(cluster, client: Client, tenant: str) -> str:
    return (await tenant_secrets(cluster, client.bus, tenant)).datastore.password  # sealed: opened with the manager's key


@pytest.fixture
async def tenants(start_cluster, tmp_path):
    cluster = await start_cluster("tiny.yaml")
    operator = await Client.connect(cluster.url)
    files = {}
    try:
        for name in ("alpha", "beta"):
            await operator.call(f"{subjects.API_TENANTS}.create", api.TenantRequest(name=name, quota=GpuQuota(gpus=4)),
                                timeout=30)
            files[name] = tmp_path / f"{name}.password"
            files[name].write_text(await tenant_password(cluster, operator, name))
        beta_claim = (await operator.submit(api.SubmitRequest(tenant="beta", resources={"nvidia.com/gpumem": 1000})))["claim"]
        await operator.wait_for(beta_claim, {"prepared"})
        yield cluster, files, beta_claim
    finally:
        await operator.close()


def as_tenant(cluster, files, name: str) -> list[str]:
    # The server's address only: no platform credentials anywhere on the command line.
    return ["--nats", cluster.nats.url, "--user", f"tenant-{name}", "--password-file", str(files[name])]


async def test_a_tenant_submits_and_waits_and_runs_with_its_own_credentials(tenants):
    cluster, files, _ = tenants
    alpha = as_tenant(cluster, files, "alpha")
    code, out = await tessera("submit", *alpha, "--tenant", "alpha", "--gpumem", "1000", "--wait")
    assert code == 0, out
    assert " prepared on gpu-" in out
    claim = out.split()[0]
    code, out = await tessera("release", *alpha, claim, "--wait")
    assert (code, out) == (0, f"{claim} released")

    code, out = await tessera("run", *alpha, "--tenant", "alpha", "--gpumem", "1000", "--node", "gpu-0", "-q",
                              "--", sys.executable, "-c", "import os, sys; sys.exit(7 if os.environ.get('LD_PRELOAD') else 1)")
    assert code == 7, out  # the workload ran under the prepared environment; its exit code came back


async def test_what_a_tenant_asks_for_another_tenant_is_refused(tenants):
    cluster, files, beta_claim = tenants
    alpha = as_tenant(cluster, files, "alpha")
    code, out = await tessera("submit", *alpha, "--tenant", "beta", "--gpumem", "1000")
    assert code == 1 and "connected as tenant 'alpha' but the request names tenant 'beta'" in out, out
    code, out = await tessera("release", *alpha, beta_claim)
    assert code == 1 and f"claim '{beta_claim}' does not exist for tenant 'alpha'" in out, out
    # The fleet's state is the operator's to read.
    code, out = await tessera("status", *alpha)
    assert code == 1 and "needs operator credentials" in out, out
    # Beta's claim is untouched.
    operator = await Client.connect(cluster.url)
    try:
        assert (await operator.claim(beta_claim)).state == "prepared"
    finally:
        await operator.close()
