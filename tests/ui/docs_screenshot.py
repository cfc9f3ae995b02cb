"""Make docs/fleet-view.png: the fleet view of `make up`'s simulated fleet, photographed by Chromium.

    .venv/bin/python tests/ui/docs_screenshot.py [--out docs/fleet-view.png]

It starts the demo fleet (profiles/demo.yaml) with the demo scenario, runs a few workloads under
`tessera run` on the simulated driver that allocate and hold GPU memory (so the page shows used
next to allocated, from the enforcers' usage reports), waits until the view shows them, and takes a
full-page screenshot in headless Chromium. Everything it shows comes from the running system.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
from pathlib import Path

from playwright.async_api import async_playwright

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))

from browserkit import browser_args  # noqa: E402

from tessera.shared import identities  # noqa: E402

from tessera.cli import scenario, top, webui  # noqa: E402
from tessera.cli.client import Client  # noqa: E402
from tessera.cli.cluster import LocalCluster  # noqa: E402

WORKLOAD = ROOT / "tests" / "enforcer" / "workload.py"
TESSERA = str(Path(sys.executable).parent / "tessera")
# (tenant, node, MiB claimed, SM percent, MiB the workload allocates)
RUNS = [("vision", "h100-2", 24000, 40, 17000), ("nlp", "h100-1", 16000, 50, 12500), ("nlp", "h100-3", 30000, 30, 9000)]


async def main(out: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="tessera-shot-"))
    cluster = LocalCluster(workdir=work, profile=ROOT / "profiles" / "demo.yaml",
                           extra_env={"TESSERA_USAGE_SECONDS": "0.5", "TESSERA_USAGE_HEARTBEAT_SECONDS": "5"})
    hold = work / "release-the-workloads"
    runs = []
    cluster.start(progress=print)
    try:
        cluster.wait_ready(180)
        client = await Client.connect(cluster.url)
        viewer = await Client.connect(cluster.url_for(identities.VIEWER))
        try:
            await scenario.create_tenants(client)
            claims = await scenario.submit_workload(client)
            for claim in claims:
                await client.wait_for(claim, {"prepared", "unschedulable"}, timeout=120)
            env = {k: v for k, v in os.environ.items() if k != "TESSERA_NODE"}
            for tenant, node, mib, cores, alloc in RUNS:
                runs.append(await asyncio.create_subprocess_exec(
                    TESSERA, "run", "--nats", cluster.url, "--node", node, "--tenant", tenant, "--gpumem", str(mib),
                    "--gpucores", str(cores), "-q", "--", sys.executable, str(WORKLOAD), "--alloc", str(alloc),
                    "--hold-file", str(hold), "--hold-max", "300", env=env,
                    stdout=asyncio.subprocess.DEVNULL))
            async with top.live_model(viewer) as (model, _), webui.serving(model) as url, async_playwright() as pw:
                for _ in range(600):  # until the three workloads' usage is in the view
                    used = [s for n in model.snapshot()["nodes"] for g in n["gpus"] for s in g["slices"]
                            if s["used_mib"] > 0]
                    if len(used) >= len(RUNS):
                        break
                    await model.changed(model.version, timeout=1)
                else:
                    raise SystemExit("the workloads' usage never showed up")
                browser = await pw.chromium.launch(executable_path=shutil.which("chromium"), args=browser_args())
                page = await browser.new_page(viewport={"width": 1600, "height": 1000}, device_scale_factor=1)
                await page.goto(url)
                await page.wait_for_selector('[data-node="h100-0"]')
                await page.wait_for_timeout(1500)  # (let the last events draw; this is a picture, not a test)
                out.parent.mkdir(parents=True, exist_ok=True)
                await page.screenshot(path=str(out), full_page=True)
                await browser.close()
                print(f"wrote {out}")
        finally:
            hold.touch()
            for proc in runs:
                await asyncio.wait_for(proc.wait(), 60)
            await viewer.close()
            await client.close()
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "fleet-view.png")
    asyncio.run(main(parser.parse_args().out))
