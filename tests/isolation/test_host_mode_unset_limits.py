"""Attack (host mode, `tessera run`): the workload unsets TESSERA_VGPU_CONFIG and every
CUDA_DEVICE_MEMORY_LIMIT_* variable, or points TESSERA_VGPU_CONFIG at a file of its own. With no
container there is no read-only mount to fall back on, so this used to remove every limit. With the
node file the enforcer installs (TESSERA_VGPU_NODE_CONFIG), libvgpu gives such a process no memory;
the claim's own file, as the enforcer writes it, still grants exactly the claim's limit.

The node file is read from /etc/tessera/vgpu.conf by the shipped library; the test build of libvgpu
(VGPU_TEST_HOOKS) reads it from TESSERA_VGPU_TEST_NODE_CONFIG instead, so the test can use its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.shared.errors import ConfigError
from tessera.shared.events import DeviceShare

from tessera.enforcer.claimdir import ClaimDirs
from tessera.enforcer.limits import vgpu_config, workload_env

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "native" / "vgpu" / "build"
UUID = "GPU-5e55e7a0-0000-4000-8000-0000000000aa"
SHARES = [DeviceShare(uuid=UUID, index=0, memory_mib=64, cores=0)]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the enforcer installs the node file as root")


@pytest.fixture(scope="module")
def testlib() -> Path:
    subprocess.run(["make", "-s", "-C", str(ROOT / "native" / "vgpu"), "tests"], check=True, capture_output=True)
    return BUILD / "test" / "libvgpu.so"


@pytest.fixture
def host(tmp_path: Path):
    dirs = ClaimDirs(tmp_path / "state")
    node_file = tmp_path / "etc" / "vgpu.conf"
    dirs.install_node_config(node_file)
    claim = dirs.of("run-a")
    claim.create({}, vgpu_config(SHARES, claim.cache))
    return node_file, claim


def run_workload(testlib: Path, node_file: Path, env: dict[str, str], *sizes: int) -> list[list[int]]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "TESSERA_", "LD_PRELOAD"))}
    base.update(LD_PRELOAD=str(testlib), LD_LIBRARY_PATH=str(BUILD / "sim"), TESSERA_SIM_GPU_UUIDS=UUID,
                TESSERA_VGPU_TEST_NODE_CONFIG=str(node_file), **env)
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "enforcer" / "workload.py"),
                          "--alloc", ",".join(map(str, sizes))], env=base, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["alloc"]


def test_the_claims_file_grants_exactly_its_limit(testlib: Path, host) -> None:
    node_file, claim = host
    env = workload_env(SHARES, claim.cache) | {"TESSERA_VGPU_CONFIG": str(claim.config)}
    env["CUDA_DEVICE_MEMORY_LIMIT_0"] = "8g"  # raising its own variable gains nothing
    assert run_workload(testlib, node_file, env, 64, 1) == [[64, 0], [1, 2]]


def test_unsetting_the_config_and_the_limits_gives_no_memory(testlib: Path, host) -> None:
    node_file, claim = host
    assert run_workload(testlib, node_file, {}, 32) == [[32, 2]]


def test_a_config_file_of_the_workloads_own_gives_no_memory(testlib: Path, host, tmp_path: Path) -> None:
    node_file, claim = host
    own = tmp_path / "own.conf"  # root's (the test's) and read-only, but not under the claims directory
    own.write_text(f"CUDA_DEVICE_MEMORY_LIMIT_0=8g\nCUDA_DEVICE_MEMORY_SHARED_CACHE={tmp_path / 'own.cache'}\n")
    own.chmod(0o444)
    assert run_workload(testlib, node_file, {"TESSERA_VGPU_CONFIG": str(own)}, 32) == [[32, 2]]


def test_installing_the_node_file_needs_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError, match="must run as root"):
        ClaimDirs(tmp_path).install_node_config(tmp_path / "vgpu.conf")
