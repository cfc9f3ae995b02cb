"""Podman the way this kind of machine needs it: the one place the container tests start containers.

The container tests prove that a real runtime applies the CDI specs the enforcer writes. On this kind
of machine (root in a sandbox without systemd, no registry reachable) Podman needs:

- ``--runtime runc --cgroup-manager cgroupfs`` (no systemd to manage cgroups; crun is not installed);
- a containers.conf with ``default_ulimits = []``: the sandbox cannot raise RLIMIT_NOFILE/NPROC to
  Podman's defaults. It is written under the cache directory and named by ``CONTAINERS_CONF``;
  nothing in /etc is changed;
- its storage and run state under ``~/.cache/tessera/containers`` (``$XDG_CACHE_HOME`` honoured), so
  the tests never see or touch the machine's own images;
- the test's CDI directory. Podman 4.3 reads CDI specs only from ``/etc/cdi`` and ``/var/run/cdi``
  (it has no ``--cdi-spec-dir``, and its containers.conf has no ``cdi_spec_dirs``), so each Podman
  runs in a private mount namespace (``unshare --mount``) in which the test's directory is
  bind-mounted over ``/var/run/cdi`` (and over ``/etc/cdi`` where the machine has one): it sees the
  test's specs and nothing else, and no other process sees them;
- ``--network none``: the tests need no network, so no CNI set-up is involved.

The base image is Debian's minimal system (``debootstrap --variant=minbase``, the suite and mirror
apt uses here), imported with ``podman import``, tagged with a hash of its recipe: built once per
machine (45-60 s cold on 2 shared cores: debootstrap ~30 s, import ~10 s) and reused (a check of
under 0.1 s) after that. Nothing is compiled in it: test programs
are built on the host (same Debian, same glibc) and bind-mounted.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tessera" / "containers"
# Bumped whenever the way the image is made changes (part of its tag).
RECIPE = "debootstrap --variant=minbase; tar | podman import; v1"
CONTAINERS_CONF = """\
# Written by tests/containers/runtime.py for the container tests; the machine's own config is untouched.
[containers]
# The sandbox cannot raise RLIMIT_NOFILE / RLIMIT_NPROC: keep the limits the tests run with.
default_ulimits = []
log_driver = "k8s-file"

[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
runtime = "runc"
"""
# In the private mount namespace: the test's CDI directory is the only one Podman sees.
_WITH_CDI_DIR = ('mkdir -p /var/run/cdi && mount --bind "$0" /var/run/cdi && '
                 '{ [ ! -d /etc/cdi ] || mount --bind "$0" /etc/cdi; } && exec "$@"')


class RuntimeMissing(RuntimeError):
    pass


def required_tools() -> dict[str, str]:
    """The tools the container tests need, found on PATH; a clear error naming the make step if not."""
    found = {}
    for tool in ("podman", "runc", "debootstrap", "unshare", "gcc"):
        path = shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin")
        if path is None:
            raise RuntimeMissing(
                f"{tool} is not installed: the container tests need podman, runc and debootstrap; "
                "'make container-tools' (part of 'make test') installs them from Debian's packages")
        found[tool] = path
    if os.geteuid() != 0:
        raise RuntimeMissing("the container tests run Podman as root (a mount namespace per run): run them as root")
    return found


def apt_source() -> tuple[str, str]:
    """(mirror, suite) of this machine's main Debian archive, as apt is configured."""
    suite = ""
    for line in Path("/etc/os-release").read_text().splitlines():
        if line.startswith("VERSION_CODENAME="):
            suite = line.split("=", 1)[1].strip().strip('"')
    mirrors = []
    sources = Path("/etc/apt/sources.list.d")
    for path in sorted(sources.glob("*.sources")) if sources.is_dir() else []:
        for stanza in path.read_text().split("\n\n"):
            fields = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", stanza, re.M))
            if "deb" in fields.get("Types", "").split() and suite in fields.get("Suites", "").split():
                mirrors += fields.get("URIs", "").split()
    legacy = Path("/etc/apt/sources.list")
    if legacy.exists():
        for line in legacy.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and parts[2] == suite:
                mirrors.append(parts[1])
    if not suite or not mirrors:
        raise RuntimeMissing("cannot tell which Debian suite and mirror apt uses here (/etc/os-release, "
                             "/etc/apt/sources.list*): the base image is built from them")
    return mirrors[0], suite


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
        self.cache.mkdir(parents=True, exist_ok=True)
        self.conf = self.cache / "containers.conf"
        if not self.conf.exists() or self.conf.read_text() != CONTAINERS_CONF:
            tmp = self.conf.with_suffix(".tmp")
            tmp.write_text(CONTAINERS_CONF)
            os.replace(tmp, self.conf)

    def command(self, *args: str) -> list[str]:
        podman = [self.tools["podman"], "--root", str(self.cache / "storage"), "--runroot", str(self.cache / "run"),
                  "--storage-driver", "overlay", "--runtime", self.tools["runc"], "--cgroup-manager", "cgroupfs",
                  *args]
        return [self.tools["unshare"], "--mount", "--propagation", "private", "sh", "-c", _WITH_CDI_DIR,
                str(self.cdi_dir), *podman]

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, CONTAINERS_CONF=str(self.conf))

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
        mirror, suite = apt_source()
        digest = hashlib.sha256(f"{RECIPE}\n{mirror}\n{suite}".encode()).hexdigest()[:16]
        tag = f"localhost/tessera-test-base:{suite}-{digest}"
        with open(self.cache / "base-image.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per machine; the others wait and reuse it
            if self("image", "exists", tag).code == 0:
                return tag
            work = Path(tempfile.mkdtemp(prefix="rootfs-", dir=self.cache))
            try:
                built = subprocess.run([self.tools["debootstrap"], "--variant=minbase", suite, str(work / "root"),
                                        mirror], capture_output=True, text=True, timeout=900)
                if built.returncode != 0:
                    raise RuntimeMissing(f"debootstrap {suite} from {mirror} failed: {built.stderr[-2000:]}")
                tar = subprocess.Popen(["tar", "-C", str(work / "root"), "--numeric-owner", "-c", "."],
                                       stdout=subprocess.PIPE)
                imported = subprocess.run(self.command("import", "-", tag), env=self.env, stdin=tar.stdout,
                                          capture_output=True, text=True, timeout=600)
                tar.stdout.close()
                if tar.wait() != 0 or imported.returncode != 0:
                    raise RuntimeMissing(f"podman import of the base image failed: {imported.stderr[-2000:]}")
            finally:
                shutil.rmtree(work, ignore_errors=True)
            return tag
