"""Attack: another user of the node (another tenant's `tessera run`, or any local account) opens a
claim's files for writing. They used to be created 0666: anyone could rewrite a claim's accounting
file (fake its usage, forge slots for the enforcer to signal) or its owner lock. Now no claim file is
writable by a user other than the claim's workload, in either layout: host mode (`tessera run`, the
workload's uid given) has the accounting file 0600 owned by that uid; container mode (no uid) has it
0666 inside a directory only the enforcer's uid can traverse (the runtime bind-mounts it as root)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tessera.enforcer.claimdir import ClaimDir

# the other users cannot reach the test's virtualenv; the system's interpreter is enough to try an open
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
NOBODY = 65534
OTHER = 65533  # another tenant


def open_as(uid: int, path: Path) -> str:
    """Try to open ``path`` for writing as ``uid``; returns "ok" or the error's name."""
    code = ("import os,sys\ntry:\n os.close(os.open(sys.argv[1], os.O_RDWR)); print('ok')\n"
            "except OSError as e:\n print(type(e).__name__)")
    return subprocess.run([SYSTEM_PYTHON, "-c", code, str(path)], capture_output=True, text=True, check=True,
                          user=uid, group=uid).stdout.strip()


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")


@pytest.fixture
def state_dir():
    """A state directory every user can traverse, as the enforcer's is (pytest's tmp_path is not)."""
    path = Path(tempfile.mkdtemp(prefix="tessera-claims-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def test_no_claim_file_is_writable_by_group_or_others_in_host_layout(tmp_path: Path) -> None:
    d = ClaimDir(tmp_path / "run-a")
    d.create({"A": "1"}, "CUDA_DEVICE_MEMORY_LIMIT_0=64m\n", workload_uid=os.geteuid())
    for p in [d.path, *d.path.iterdir()]:
        assert not os.stat(p).st_mode & (stat.S_IWGRP | stat.S_IWOTH), f"{p.name} is {oct(os.stat(p).st_mode)}"


def test_in_container_layout_only_the_accounting_file_is_writable_and_the_directory_is_closed(tmp_path: Path) -> None:
    d = ClaimDir(tmp_path / "claim-a")
    d.create({"A": "1"}, "CUDA_DEVICE_MEMORY_LIMIT_0=64m\n")
    assert stat.S_IMODE(os.stat(d.path).st_mode) == 0o700 and os.stat(d.path).st_uid == os.geteuid()
    for p in d.path.iterdir():
        writable = os.stat(p).st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        assert bool(writable) == (p == d.cache), f"{p.name} is {oct(os.stat(p).st_mode)}"


@needs_root
def test_another_host_user_cannot_reach_a_container_claims_accounting_file(state_dir: Path) -> None:
    d = ClaimDir(state_dir / "claim-a")
    d.create({}, "")
    for path in (d.cache, d.owner_lock, d.config):
        assert open_as(OTHER, path) == "PermissionError", path.name
    # a claim re-created in host layout for a workload uid closes the file to everyone else again
    d.create({}, "", workload_uid=NOBODY)
    assert stat.S_IMODE(os.stat(d.cache).st_mode) == 0o600 and os.stat(d.cache).st_uid == NOBODY
    assert open_as(OTHER, d.cache) == "PermissionError" and open_as(NOBODY, d.cache) == "ok"


@needs_root
def test_another_user_cannot_open_the_accounting_file_or_owner_lock_for_writing(state_dir: Path) -> None:
    d = ClaimDir(state_dir / "run-a")
    d.create({}, "", workload_uid=os.geteuid())
    assert open_as(OTHER, d.env_file) == "PermissionError"  # reachable, but read-only for others
    assert open_as(OTHER, d.cache) == "PermissionError"
    assert open_as(OTHER, d.owner_lock) == "PermissionError"


@needs_root
def test_the_workloads_uid_owns_its_accounting_file_and_no_one_else_can_write_it(state_dir: Path) -> None:
    d = ClaimDir(state_dir / "run-a")
    d.create({}, "", workload_uid=NOBODY)
    assert os.stat(d.cache).st_uid == NOBODY
    assert open_as(NOBODY, d.cache) == "ok"
    assert open_as(OTHER, d.cache) == "PermissionError"
    assert open_as(NOBODY, d.config) == "PermissionError"  # its limits stay the enforcer's
