"""tessera-cdi-hook (native/vgpu/hook): how it finds the container's root from what the runtime
passes it — the container state on stdin, whose ``bundle`` has the ``config.json`` whose
``root.path`` is the root, relative to the bundle unless absolute.

``print-root`` stops there (no chroot, so no root needed); tests/containers runs the whole hook in
a root directory and under Podman.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

HOOK = Path(__file__).resolve().parents[2] / "native" / "vgpu" / "build" / "tessera-cdi-hook"


@pytest.fixture(scope="module")
def hook() -> Path:
    assert HOOK.exists(), "native/vgpu is not built: run 'make native' (part of 'make test')"
    return HOOK


def run(hook: Path, state: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(hook), *(args or ("print-root",))], input=state, capture_output=True, text=True,
                          timeout=30)


def bundle(tmp_path: Path, config: str | dict) -> Path:
    b = tmp_path / "bundle"
    b.mkdir(exist_ok=True)
    (b / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return b


def state(b: Path | str, **extra) -> str:
    return json.dumps({"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": 4242, **extra,
                       "bundle": str(b)})


# What runc and containerd write: the root beside other "path" members (hooks, mounts).
CONFIG = {"ociVersion": "1.0.2", "process": {"cwd": "/", "env": ["PATH=/bin"]},
          "hooks": {"createContainer": [{"path": "/usr/local/vgpu/tessera-cdi-hook", "args": ["x"]}]},
          "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
          "root": {"path": "rootfs", "readonly": False}, "annotations": {"root": "/evil"}}


def test_a_relative_root_is_the_bundles_and_an_absolute_one_is_itself(hook, tmp_path):
    b = bundle(tmp_path, CONFIG)
    got = run(hook, state(b))
    assert (got.returncode, got.stdout) == (0, f"{b}/rootfs\n"), got.stderr
    bundle(tmp_path, dict(CONFIG, root={"path": "/var/lib/containers/storage/overlay/abc/merged"}))
    assert run(hook, state(b)).stdout == "/var/lib/containers/storage/overlay/abc/merged\n"


def test_annotations_that_name_the_same_keys_change_nothing(hook, tmp_path):
    b = bundle(tmp_path, CONFIG)
    got = run(hook, state(b, annotations={"bundle": "/evil", "io.x/y": '"bundle":"/evil"'}))
    assert got.stdout == f"{b}/rootfs\n", got.stderr


def test_escapes_are_decoded(hook, tmp_path):
    b = bundle(tmp_path, '{"root": {"path": "root\\u0066s\\/x"}, "ociVersion": "1.0.2"}')
    raw = '{"bundle": ' + json.dumps(str(b)).replace("/", "\\/") + ', "pid": 1, "status": "creating"}'
    assert run(hook, raw).stdout == f"{b}/rootfs/x\n"


@pytest.mark.parametrize("text, why", [
    ('{"bundle": "/b"', "not valid JSON"),
    ('{"bundle": ["/b"]}', "not valid JSON"),
    ('{"id": "c1"}', "has no bundle"),
    ('{"bundle": "relative/b"}', "not an absolute path"),
    ('{"bundle": "/b\\u0000x"}', "not valid JSON"),
    ('{"bundle": "/b"} trailing', "not valid JSON"),
])
def test_a_state_it_cannot_read_fails_the_container(hook, text, why):
    got = run(hook, text)
    assert got.returncode == 1 and why in got.stderr, got.stderr


@pytest.mark.parametrize("root", ["/", ".", "/./", "//"])
def test_the_runtimes_own_root_is_refused(hook, tmp_path, root):
    b = bundle(tmp_path, dict(CONFIG, root={"path": root}))
    got = run(hook, state(b))
    if root.startswith("/"):
        assert got.returncode == 1 and "the runtime's own root" in got.stderr, got.stderr
    else:  # "." is the bundle itself: refused only if that is "/"
        assert (got.returncode, got.stdout) == (0, f"{b}/.\n")


def test_a_config_without_a_root_or_a_bundle_without_a_config_fails(hook, tmp_path):
    b = bundle(tmp_path, {"ociVersion": "1.0.2"})
    assert "has no root.path" in run(hook, state(b)).stderr
    got = run(hook, state(tmp_path / "nowhere"))
    assert got.returncode == 1 and "config.json" in got.stderr


def test_usage_errors(hook):
    assert run(hook, "{}", "frobnicate").returncode == 2
    got = run(hook, "{}", "update-ldcache", "--folder", "relative")
    assert got.returncode == 1 and "absolute path" in got.stderr
