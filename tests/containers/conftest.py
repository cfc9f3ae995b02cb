"""Fixtures of the container tests: Podman (runtime.py), the base image, the CUDA probe, a cluster.

The schema validator (tests/cdi) and the local-cluster kit (tests/enforcer/runkit.py) live with the
tests they were written for; this directory uses them rather than a second copy. The real control
plane's fixtures are the shared ones of tests/conftest.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE.parent / "cdi"), str(HERE.parent / "enforcer")]

from runkit import cluster  # noqa: E402,F401 - the fixture, registered by being here
from runtime import Podman, required_tools  # noqa: E402

VGPU = HERE.parent.parent / "native" / "vgpu"


@pytest.fixture(scope="session")
def tools() -> dict[str, str]:
    return required_tools()  # fails (never skips) with the make step that installs what is missing


@pytest.fixture(scope="session")
def base_image(tools, tmp_path_factory) -> str:
    return Podman(cdi_dir=tmp_path_factory.mktemp("no-cdi"), tools=tools).base_image()


@pytest.fixture(scope="session")
def cuda_probe(tmp_path_factory) -> Path:
    """tests/containers/cuda_probe.c built on the host against the simulated driver's API."""
    sim = VGPU / "build" / "sim" / "libcuda.so"
    assert sim.exists(), "native/vgpu is not built: run 'make native' (part of 'make test')"
    out = tmp_path_factory.mktemp("probe") / "cuda_probe"
    subprocess.run(["gcc", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{VGPU / 'include'}", "-o", str(out),
                    str(HERE / "cuda_probe.c"), f"-L{sim.parent}", "-lcuda"], check=True)
    return out
