"""Run the real ``kubectl`` against the emulator, from async tests (the emulator shares their loop,
so a blocking subprocess call would deadlock it).

kubectl exercises what services do not: discovery, OpenAPI v3 field-validation support, client-side
apply with its last-applied annotation, server-side apply, Table output with a CRD's printer columns.
"""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest


# A test that skips here would pass in CI with the feature unproven: a missing kubectl is a failure
# that says how to get one.
MISSING = ("kubectl is not installed: the Kubernetes tests run the real kubectl against the emulator; "
           "install it from Kubernetes' package repository (https://kubernetes.io/docs/tasks/tools/) "
           "and put it on PATH")


def kubectl_binary() -> str:
    binary = shutil.which("kubectl")
    if binary is None:
        pytest.fail(MISSING, pytrace=False)
    return binary


async def kubectl(server_url: str, *args: str, stdin: str | None = None) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``kubectl --server=<url> <args>``; fails the test without kubectl."""
    binary = kubectl_binary()
    env = dict(os.environ, KUBECONFIG=os.devnull)
    process = await asyncio.create_subprocess_exec(
        binary, f"--server={server_url}", "--request-timeout=20s", *args, env=env,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await process.communicate(stdin.encode() if stdin is not None else None)
    return process.returncode, out.decode(), err.decode()
