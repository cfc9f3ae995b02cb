"""Helpers of the CLI tests: run `tessera` as a user would (a separate process: its stdout, stderr
and exit code), and where the test profiles are."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PROFILES = Path(__file__).parent.parent / "profiles"
TESSERA = str(Path(sys.executable).parent / "tessera")


@dataclass
class Ran:
    code: int
    out: str
    err: str


async def tessera(*argv: str, env: dict | None = None, timeout: float = 120) -> Ran:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_NATS")}
    full_env.update(env or {})
    proc = await asyncio.to_thread(subprocess.run, [TESSERA, *argv], capture_output=True, text=True,
                                   env=full_env, timeout=timeout, stdin=subprocess.DEVNULL)
    return Ran(proc.returncode, proc.stdout, proc.stderr)
