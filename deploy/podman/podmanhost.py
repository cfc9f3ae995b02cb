"""Podman the way this kind of machine needs it, and the Debian base image: written once, used by
`make images` (deploy/podman/images.py), the compose smoke test and the container tests.

This kind of machine is root in a sandbox without systemd, and reaches no container registry, so:

- ``runtime = "runc"`` and ``cgroup_manager = "cgroupfs"`` (no systemd to manage cgroups; crun is
  not installed), and ``default_ulimits = []``: the sandbox cannot raise RLIMIT_NOFILE/NPROC to
  Podman's defaults. They live in a containers.conf under the cache directory, named by
  ``CONTAINERS_CONF``; nothing in /etc is changed;
- storage, run state, networks and Podman's temporary files under ``~/.cache/tessera/containers``
  (``$XDG_CACHE_HOME`` honoured; a storage.conf named by ``CONTAINERS_STORAGE_CONF``), so nothing
  here sees or touches the machine's own images, containers or networks;
- netavark with aardvark-dns as the network backend, so that containers on one compose network find
  each other by service name (the CNI plugins Debian installs with Podman have no DNS);
- the base image is Debian's minimal system (``debootstrap --variant=minbase``, the suite and mirror
  apt uses here), imported with ``podman import`` and tagged with a hash of its recipe: built once
  per machine (35-60 s cold on 2 shared cores) and reused after that; apt's caches are left out.

Every caller runs Podman with ``env()``: any ``podman`` (podman-compose's too) then uses all of it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import IO, Callable, Sequence

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tessera" / "containers"
# Bumped whenever the way the base image is made changes (part of its tag).
RECIPE = "debootstrap --variant=minbase; apt caches dropped; tar | podman import; v2"
NETWORK_TOOLS = ("/usr/lib/podman/netavark", "/usr/lib/podman/aardvark-dns")
# netavark sets up every bridge network's NAT and port forwarding with these (Debian's iptables,
# which Podman only suggests); without them each container start on a network fails with
# "netavark: No such file or directory (os error 2)".
FIREWALL_TOOLS = ("iptables", "ip6tables")
INSTALL_HINT = ("'make container-tools' installs Podman, runc, debootstrap, netavark, aardvark-dns and iptables "
                "from Debian's packages")

CONTAINERS_CONF = """\
# Written by deploy/podman/podmanhost.py; the machine's own config is untouched.
[containers]
# The sandbox cannot raise RLIMIT_NOFILE / RLIMIT_NPROC: keep the limits Podman runs with.
default_ulimits = []
log_driver = "k8s-file"

[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
runtime = "runc"
tmp_dir = "{cache}/tmp"

[network]
network_backend = "netavark"
network_config_dir = "{cache}/networks"
"""
STORAGE_CONF = """\
# Written by deploy/podman/podmanhost.py: Tessera's images and containers, apart from the machine's.
[storage]
driver = "overlay"
graphroot = "{cache}/storage"
runroot = "{cache}/run"
"""


class PodmanMissing(RuntimeError):
    """Something Podman needs here is not installed or not usable; the message says how to fix it."""


def find_tools(*tools: str) -> dict[str, str]:
    """Each tool's path (PATH, then /usr/sbin); a clear error naming the make step if one is missing."""
    found = {}
    for tool in tools:
        path = shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin")
        if path is None:
            raise PodmanMissing(f"{tool} is not installed: {INSTALL_HINT}")
        found[tool] = path
    return found


def require_network_backend() -> None:
    """netavark, aardvark-dns and the iptables netavark runs: what a container on a network needs."""
    missing = [p for p in NETWORK_TOOLS if not os.access(p, os.X_OK)]
    if missing:
        raise PodmanMissing(f"{', '.join(missing)} missing (Debian's netavark and aardvark-dns): {INSTALL_HINT}")
    path = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"
    missing = [tool for tool in FIREWALL_TOOLS if shutil.which(tool, path=path) is None]
    if missing:
        raise PodmanMissing(f"{', '.join(missing)} not installed (Debian's iptables; netavark needs it for every "
                            f"container on a network): {INSTALL_HINT}")


class Overran(RuntimeError):
    """A command did not finish in its time and was killed, with everything it started."""


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILLs the process group ``proc`` leads (started with ``start_new_session``), then reaps it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # not reaped after SIGKILL: a process stuck in the kernel
        pass


def run_bounded(argv: Sequence[str], timeout: float, *, env: dict[str, str] | None = None,
                stdin: int | IO | None = subprocess.DEVNULL, stdout: int | IO | None = subprocess.PIPE,
                stderr: int | IO | None = subprocess.PIPE, what: str | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run`` that always returns or raises ``Overran`` within about ``timeout`` seconds.

    subprocess.run's own timeout kills only the process it started, then waits for its pipes to
    close, which a child it left behind (podman-compose's ``podman wait``, a ``podman`` under
    ``nice``) holds open for ever. Here the command leads a process group of its own, and the whole
    group is killed; output a process outside the group still holds is given up after 5 s."""
    proc = subprocess.Popen(list(argv), env=env, stdin=stdin, stdout=stdout, stderr=stderr, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        try:
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            out, err = "", ""
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        said = ((out or "") + (err or "")).strip()[-2000:]
        raise Overran(f"{what or ' '.join(argv)}: no answer in {timeout:.0f} s, killed"
                      + (f"; it had said:\n{said}" if said else "")) from None
    except BaseException:  # Ctrl-C or a test's timeout: leave nothing running behind
        kill_group(proc)
        raise
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)


def _write(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)


def configure(cache: Path = CACHE) -> dict[str, str]:
    """Writes the containers.conf and storage.conf above; the environment a Podman must run with."""
    for sub in ("", "tmp", "networks"):
        (cache / sub).mkdir(parents=True, exist_ok=True)
    conf, storage = cache / "containers.conf", cache / "storage.conf"
    _write(conf, CONTAINERS_CONF.format(cache=cache))
    _write(storage, STORAGE_CONF.format(cache=cache))
    return dict(os.environ, CONTAINERS_CONF=str(conf), CONTAINERS_STORAGE_CONF=str(storage))


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
        raise PodmanMissing("cannot tell which Debian suite and mirror apt uses here (/etc/os-release, "
                            "/etc/apt/sources.list*): the base image is built from them")
    return mirrors[0], suite


# How a caller runs Podman: its arguments after "podman", stdin (a file object or None), a timeout;
# it returns the finished process (returncode, stdout, stderr as text).
RunPodman = Callable[[Sequence[str], object, float], subprocess.CompletedProcess]


def debian_base(run_podman: RunPodman, cache: Path = CACHE, debootstrap: str | None = None) -> str:
    """The tag of the Debian minbase image, built if this machine has not built it yet."""
    mirror, suite = apt_source()
    digest = hashlib.sha256(f"{RECIPE}\n{mirror}\n{suite}".encode()).hexdigest()[:16]
    tag = f"localhost/tessera-debian-base:{suite}-{digest}"
    debootstrap = debootstrap or find_tools("debootstrap")["debootstrap"]
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "base-image.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per machine; the others wait and reuse it
        if run_podman(["image", "exists", tag], None, 60).returncode == 0:
            return tag
        work = Path(tempfile.mkdtemp(prefix="rootfs-", dir=cache))
        try:
            built = run_bounded([debootstrap, "--variant=minbase", suite, str(work / "root"), mirror], 900)
            if built.returncode != 0:
                raise PodmanMissing(f"debootstrap {suite} from {mirror} failed: {built.stderr[-2000:]}")
            # The downloaded packages and the package lists (80 MB): an image that installs more runs
            # `apt-get update` first, as with any Debian image.
            for cached in [*(work / "root/var/cache/apt").rglob("*.deb"), *(work / "root/var/cache/apt").glob("*.bin"),
                           *(p for p in (work / "root/var/lib/apt/lists").rglob("*") if p.is_file())]:
                cached.unlink()
            tar = subprocess.Popen(["tar", "-C", str(work / "root"), "--numeric-owner", "-c", "."],
                                   stdout=subprocess.PIPE)
            try:
                imported = run_podman(["import", "-", tag], tar.stdout, 600)
            except BaseException:
                tar.kill()  # the import overran: tar would wait on a pipe nobody reads
                raise
            finally:
                tar.stdout.close()
            if tar.wait(timeout=60) != 0 or imported.returncode != 0:
                raise PodmanMissing(f"podman import of the base image failed: {imported.stderr[-2000:]}")
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return tag
