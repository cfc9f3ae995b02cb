"""tessera-cdi-hook run for real (as root: it chroots) on a container root made of a few files, as a
runtime runs it at createContainer: what it makes in the root, and what an image cannot make it do.

The host's ldconfig does the work inside the root; Podman runs the same hook in
test_cdi_driver_edits.py and test_cdi_enforcement.py.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

HOOK = Path(__file__).resolve().parents[2] / "native" / "vgpu" / "build" / "tessera-cdi-hook"
VERSION = "580.65.06"
DIR = "/usr/lib64"


@pytest.fixture
def container(tools, tmp_path) -> tuple[Path, str]:
    """A bundle whose root has the driver's libcuda mounted-in (a file in a directory of its own), and
    the state a runtime passes; ``tools`` because this needs root, as the container tests do."""
    assert HOOK.exists(), "native/vgpu is not built: run 'make native' (part of 'make test')"
    bundle = tmp_path / "bundle"
    root = bundle / "rootfs"
    (root / "etc" / "ld.so.conf.d").mkdir(parents=True)
    (root / "etc" / "ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    lib = root / DIR.lstrip("/")
    lib.mkdir(parents=True)
    src = tmp_path / "stand-in.c"
    src.write_text("int stand_in(void) { return 0; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(lib / f"libcuda.so.{VERSION}"),
                    str(src)], check=True)
    (bundle / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "root": {"path": "rootfs"}}))
    return root, json.dumps({"ociVersion": "1.0.2", "id": "c", "status": "creating", "pid": 1,
                             "bundle": str(bundle)})


def hook(state: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(HOOK), "update-ldcache", *args], input=state, capture_output=True, text=True,
                          timeout=60)


def cache(root: Path) -> list[str]:
    out = subprocess.run(["ldconfig", "-p", "-C", str(root / "etc" / "ld.so.cache")], capture_output=True,
                         text=True, check=True).stdout
    return sorted(line.split()[0] + " " + line.split()[-1] for line in out.splitlines()[1:] if "=>" in line)


def test_the_hook_makes_the_libraries_loadable_in_the_root(container):
    root, state = container
    links = ("--link", f"libcuda.so.{VERSION}::{DIR}/libcuda.so.1", "--link", f"libcuda.so.1::{DIR}/libcuda.so")
    got = hook(state, "--folder", DIR, *links)
    assert got.returncode == 0, got.stderr
    lib = root / DIR.lstrip("/")
    assert (lib / "libcuda.so.1").readlink() == Path(f"libcuda.so.{VERSION}")
    assert (lib / "libcuda.so").readlink() == Path("libcuda.so.1")
    # the soname link made before ldconfig ran is what puts the development name into the cache too
    assert cache(root) == [f"libcuda.so {DIR}/libcuda.so", f"libcuda.so.1 {DIR}/libcuda.so.1"]
    conf = root / "etc" / "ld.so.conf.d" / "00-tessera-driver.conf"
    assert conf.read_text().splitlines()[1:] == [DIR] and oct(conf.stat().st_mode & 0o777) == "0o644"
    # Run again (a container restarted in the same root): the same result, no error.
    assert hook(state, "--folder", DIR, *links).returncode == 0
    assert cache(root) == [f"libcuda.so {DIR}/libcuda.so", f"libcuda.so.1 {DIR}/libcuda.so.1"]


def test_an_images_symlinks_cannot_point_the_hooks_write_out_of_the_root(container, tmp_path):
    root, state = container
    # The image makes its ld.so.conf.d a link to a host directory (absolute, as the host sees it):
    # the hook must neither write there nor follow it inside the root.
    victim = tmp_path / "host-dir"
    victim.mkdir()
    conf_d = root / "etc" / "ld.so.conf.d"
    conf_d.rmdir()
    conf_d.symlink_to(victim)
    got = hook(state, "--folder", DIR)
    assert got.returncode == 0, got.stderr
    assert "left out" in got.stderr  # said, and the directories reach the cache all the same
    assert list(victim.iterdir()) == []
    assert cache(root) == [f"libcuda.so.1 {DIR}/libcuda.so.1"]


def test_a_link_outside_the_drivers_folders_is_refused(container):
    _, state = container
    got = hook(state, "--folder", DIR, "--link", "libcuda.so.1::/etc/libcuda.so")
    assert got.returncode == 1 and "not one of the --folder directories" in got.stderr
    got = hook(state, "--folder", DIR, "--link", f"../x::{DIR}/libcuda.so")
    assert got.returncode == 1 and "a name beside it" in got.stderr
