"""`tessera up` (what `make up` runs) prints the fleet view's URL, serves it while it runs, and stops
cleanly on Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from clikit import PROFILES, TESSERA


def test_up_prints_the_url_of_a_live_fleet_view(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_NATS")}
    proc = subprocess.Popen([TESSERA, "up", "--profile", str(PROFILES / "tiny.yaml"), "--workdir", str(tmp_path),
                             "--ui-port", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env, stdin=subprocess.DEVNULL)
    seen = []
    try:
        url = None
        sel = selectors.DefaultSelector()
        sel.register(proc.stderr, selectors.EVENT_READ)
        deadline = time.monotonic() + 180
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            if sel.select(timeout=1):
                line = proc.stderr.readline()
                seen.append(line)
                found = re.search(r"fleet view at (http://127\.0\.0\.1:\d+/)", line)
                url = found.group(1) if found else None
        assert url, "".join(seen)
        sel.close()
        page = get(url).decode()
        assert "Tessera" in page and "api/events" in page
        doc = json.loads(get(url + "api/fleet"))
        assert doc["totals"]["nodes"] == 2 and doc["tenants"], doc["totals"]
        viewer_url = (Path(tmp_path) / "nats-url-viewer").read_text()
        assert viewer_url.startswith("nats://viewer:")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    rest = proc.stderr.read()
    proc.stderr.close()
    assert code == 0, "".join(seen) + rest


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()
