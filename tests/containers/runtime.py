"""Podman the way the container tests need it: the one place they start containers.

The container tests prove that a real runtime applies the CDI specs the enforcer writes. How Podman
runs on this kind of machine (runc, cgroupfs, ``default_ulimits = []``, its own storage under
``~/.cache/tessera/containers``, no /etc changed) and the Debian minbase image they run in are
deploy/podman/podmanhost.py's, shared with `make images` and the compose smoke test. On top of that
these tests need:

- the test's CDI directory. Podman 4.3 reads CDI specs only from ``/etc/cdi`` and ``/var/run/cdi``
  (it has no ``--cdi-spec-dir``, and its containers.conf has no ``cdi_spec_dirs``), so each Podman
  runs in a private mount namespace (``unshare --mount``) in which the test's directory is
  bind-mounted over ``/var/run/cdi`` (and over ``/etc/cdi`` where the machine has one): it sees the
  test's specs and nothing else, and no other process sees them;
- ``--network none``: the tests need no network, so no network set-up is involved.

Nothing is compiled in the base image: test programs are built on the host (same Debian, same
glibc) and bind-mounted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "deploy" / "podman"))
import podmanhost  # noqa: E402
from podmanhost import CACHE  # noqa: E402

RuntimeMissing = podmanhost.PodmanMissing
# In the private mount namespace: the test's CDI directory is the only one Podman sees.
_WITH_CDI_DIR = ('mkdir -p /var/run/cdi && mount --bind "$0" /var/run/cdi && '
                 '{ [ ! -d /etc/cdi ] || mount --bind "$0" /etc/cdi; } && exec "$@"')


def required_tools() -> dict[str, str]:
    """The tools the container tests need, found on PATH; a clear error naming the make step if not."""
    found = podmanhost.find_tools("podman", "runc", "debootstrap", "unshare", "gcc")
    if os.geteuid() != 0:
        raise RuntimeMissing("the container tests run Podman as root (a mount namespace per run): run them as root")
    return found


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str


@dataclass
class Podman:
    """Podman as root with this machine's flags, seeing only ``cdi_dir``'s specs."""

    cdi_dir: Path
    cache: Path = CACHE
    tools: dict[str, str] = field(default_factory=required_tools)

    def __post_init__(self) -> None:
        self._env = podmanhost.configure(self.cache)

    def command(self, *args: str) -> list[str]:
        podman = [self.tools["podman"], "--runtime", self.tools["runc"], "--cgroup-manager", "cgroupfs", *args]
        return [self.tools["unshare"], "--mount", "--propagation", "private", "sh", "-c", _WITH_CDI_DIR,
                str(self.cdi_dir), *podman]

    @property
    def env(self) -> dict[str, str]:
        return self._env

    def __call__(self, *args: str, input: str | None = None, timeout: float = 120) -> Result:
        done = subprocess.run(self.command(*args), env=self.env, input=input, capture_output=True, text=True,
                              timeout=timeout)
        return Result(done.returncode, done.stdout, done.stderr)

    def popen(self, *args: str) -> subprocess.Popen:
        """A Podman left running (its stdin a pipe), for containers that must overlap."""
        return subprocess.Popen(self.command(*args), env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def run_args(self, image: str, *devices: str, mounts: dict[str, str] | None = None,
                 options: tuple[str, ...] = ()) -> list[str]:
        """``run`` arguments for a throw-away container with these CDI devices, read-only mounts and
        further ``run`` options; the command to run follows."""
        args = ["run", "--rm", "-i", "--network", "none", "--pull", "never", *options]
        for device in devices:
            args += ["--device", device]
        for host, target in (mounts or {}).items():
            args += ["-v", f"{host}:{target}:ro"]
        return [*args, image]

    # --- the base image -------------------------------------------------------------------------

    def base_image(self) -> str:
        """The tag of the Debian minbase image, built if this machine has not built it yet."""
        def run(args, stdin, timeout):
            return subprocess.run(self.command(*args), env=self.env, stdin=stdin, capture_output=True, text=True,
                                  timeout=timeout)

        return podmanhost.debian_base(run, self.cache, self.tools["debootstrap"])
