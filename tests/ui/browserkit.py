"""How the UI tests start Debian's Chromium: headless, as root in a container-like box."""

from __future__ import annotations

import os


def browser_args() -> list[str]:
    # Chromium refuses to run its sandbox as root; /dev/shm is small on this kind of machine.
    args = ["--disable-gpu", "--disable-dev-shm-usage", "--font-render-hinting=none"]
    if os.geteuid() == 0:
        args.append("--no-sandbox")
    return args
