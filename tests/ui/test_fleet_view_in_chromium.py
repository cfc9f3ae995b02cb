"""The fleet view in a real browser: Debian's Chromium, headless, driven over the DevTools protocol.

A local Tessera (tiny profile) with two tenants and their claims; `tessera ui`'s server under the
read-only viewer identity; the page loads, shows both nodes, their GPUs and the tenants' slices,
updates by itself (server-sent events, no reload) when another claim is allocated, and a screenshot
is saved in the test's directory.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from pathlib import Path

import pytest
from playwright.async_api import async_playwright

from tessera.shared import api, identities, subjects
from tessera.shared.events import GpuQuota

from tessera.cli import top, webui
from tessera.cli.client import Client

from browserkit import browser_args

WORKLOAD = Path(__file__).resolve().parents[1] / "enforcer" / "workload.py"
TESSERA = str(Path(sys.executable).parent / "tessera")
FAST_USAGE = {"TESSERA_USAGE_SECONDS": "0.3", "TESSERA_USAGE_HEARTBEAT_SECONDS": "3"}
TENANTS = {"vision": GpuQuota(gpus=3, memory_mib=200000), "nlp": GpuQuota(gpus=2, memory_mib=150000, cores=150)}


async def submit(client: Client, tenant: str, **resources) -> str:
    result = await client.submit(api.SubmitRequest(tenant=tenant, resources=resources))
    record = await client.wait_for(result["claim"], {"prepared", "unschedulable"}, timeout=60)
    assert record.state == "prepared", record.reason
    return result["claim"]


async def test_the_page_shows_the_fleet_and_follows_a_new_claim(start_cluster, tmp_path):
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("chromium is not installed: 'make browser-tools' installs Debian's package")
    cluster = await start_cluster("tiny.yaml", extra_env=FAST_USAGE)
    operator = await Client.connect(cluster.url)
    viewer = await Client.connect(cluster.url_for(identities.VIEWER))
    try:
        for name, quota in TENANTS.items():
            await operator.call(f"{subjects.API_TENANTS}.create", api.TenantRequest(name=name, quota=quota), timeout=30)
        first = [await submit(operator, "vision", **{"nvidia.com/gpumem": 30000, "nvidia.com/gpucores": 40}),
                 await submit(operator, "nlp", **{"nvidia.com/gpumem": 20000, "nvidia.com/gpucores": 30})]
        async with top.live_model(viewer) as (model, _), webui.serving(model) as url, async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=chromium, args=browser_args())
            try:
                page = await browser.new_page(viewport={"width": 1400, "height": 900})
                await page.goto(url)
                for node in ("gpu-0", "gpu-1"):
                    await page.wait_for_selector(f'[data-node="{node}"]', timeout=30_000)
                assert await page.locator(".gpu").count() == 4
                for claim in first:
                    await page.wait_for_selector(f'[data-claim="{claim}"]', timeout=30_000)
                panel = await page.inner_text("#tenants")
                assert "vision" in panel and "nlp" in panel
                assert "29 GiB / 195 GiB" in panel, panel  # vision's memory: 30000 of 200000 MiB
                assert await page.inner_text("#t-fleet") == "2 nodes · 4 GPUs"
                drawn = int(await page.get_attribute("body", "data-version"))

                # Allocated while the page is open: it appears without a reload.
                later = await submit(operator, "nlp", **{"nvidia.com/gpu": 1, "nvidia.com/gpucores": 100})
                slice_ = await page.wait_for_selector(f'[data-claim="{later}"]', timeout=30_000)
                assert await slice_.get_attribute("data-tenant") == "nlp"
                assert int(await page.get_attribute("body", "data-version")) > drawn
                frag = await page.inner_text('[data-frag="gpu-0"]')
                assert "/" in frag  # "<fragmentation> / <free GPU units>"
                # (its slice comes with the ledger, its state with the claim's record: the page may
                # draw the one before the other)
                await page.wait_for_function(
                    """() => { const b = document.querySelector('[data-state="prepared"] b');
                               return b && b.textContent.trim() === '3'; }""", timeout=30_000)

                # A workload that allocates memory on the simulated driver: its slice shows it used.
                hold = tmp_path / "release-the-workload"
                run = await asyncio.create_subprocess_exec(
                    TESSERA, "run", "--nats", cluster.url, "--node", "gpu-1", "--tenant", "vision", "--gpumem", "8000",
                    "-q", "--", sys.executable, str(WORKLOAD), "--alloc", "6000", "--hold-file", str(hold),
                    env={k: v for k, v in os.environ.items() if k != "TESSERA_NODE"},
                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
                try:
                    used = await page.wait_for_function(
                        """() => { const s = document.querySelector('[data-claim^="run-"] .used');
                                   return s && parseFloat(s.style.width) > 50 ? s.style.width : null; }""",
                        timeout=60_000)
                    assert 70 < float((await used.json_value()).rstrip("%")) <= 100  # 6000 of 8000 MiB (and any context)
                    assert "used" in await page.inner_text('[data-node="gpu-1"]')
                    shot = tmp_path / "fleet-view.png"  # (the test directory keeps it)
                    await page.screenshot(path=str(shot), full_page=True)
                    assert shot.stat().st_size > 10_000
                finally:
                    hold.touch()
                    _, err = await asyncio.wait_for(run.communicate(), 60)
                assert run.returncode == 0, err.decode()
            finally:
                await browser.close()
    finally:
        await viewer.close()
        await operator.close()
