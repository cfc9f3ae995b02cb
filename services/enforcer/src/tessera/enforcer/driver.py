"""The NVIDIA driver's user-space files a claim's container needs, found on this node.

A container of a claim gets the driver from its CDI spec alone, the way NVIDIA's DRA driver and
``nvidia-ctk cdi generate`` give it, so that it works with no NVIDIA runtime and no
``NVIDIA_VISIBLE_DEVICES`` honoured anywhere:

- the libraries of the installed driver version: every ``lib*.so.<version>`` in the directory that
  holds ``libcuda.so.<version>`` (and its ``vdpau`` subdirectory) — libcuda, NVML, the PTX JIT
  compiler, NVVM, the GPU compiler, the debugger, OpenCL, graphics and video libraries alike, as NVIDIA's
  generator mounts them. That directory is found from the driver root's loader cache
  (``etc/ld.so.cache``, where ``libcuda.so.1`` resolves to the versioned file; the driver version
  is that file's suffix), or where the cache does not name it, in the usual library directories;
- ``nvidia-smi`` and ``nvidia-debugdump`` where the driver root has them;
- each at the path it has inside the driver root (``/usr/lib64/libcuda.so.580.65.06``), mounted
  read-only from the host's side of that root. The CDI spec's createContainer hook (native/vgpu's
  ``tessera-cdi-hook``) then runs ldconfig over those directories in the container, which makes
  the soname links and the loader cache entries that make the libraries loadable.

The driver root is read at two names: ``root``, where the enforcer sees it (``/driver-root`` in the
DaemonSet, ``/`` on a host), and ``host_root``, where the container runtime does (the host's
``/``, or ``/run/nvidia/driver`` for a driver the GPU operator installs). Every symlink is followed
inside ``root``, never out of it.

On a simulated fleet the simulated driver built from native/vgpu (``libcuda.so.1``,
``libnvidia-ml.so.1``) stands in, at ``/usr/lib`` in the container (``simulated``).

Public API: ``find(root, host_root) -> DriverFiles`` (``DriverNotFound`` if there is no driver),
``simulated(directory) -> DriverFiles``, ``read_ldcache(path) -> list[CacheEntry]``,
``parse_ldcache(data) -> list[CacheEntry]``.
"""

from __future__ import annotations

import os
import platform
import posixpath
import re
import struct
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Iterable, NamedTuple

from tessera.shared.errors import ConfigError

# Where the simulated driver sits in a container: a directory the loader searches by itself too.
CONTAINER_SIM_DRIVER_DIR = "/usr/lib"
SIM_DRIVER_LIBS = ("libcuda.so.1", "libnvidia-ml.so.1")
# The programs of the driver's that a container gets where the root has them.
BINARIES = ("nvidia-smi", "nvidia-debugdump")
# Where a driver root without a cache entry for libcuda keeps its libraries (NVIDIA's DRA driver
# looks in the same places), and its programs.
LIBRARY_DIRS = ("/usr/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/lib64",
                "/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu", "/usr/lib", "/lib")
BINARY_DIRS = ("/usr/bin", "/usr/sbin", "/bin", "/sbin", "/opt/bin")
_VERSION = re.compile(r"^[0-9]+(\.[0-9]+)+$")


class DriverNotFound(ConfigError):
    """No NVIDIA driver under the driver root: a claim's container could not run CUDA."""


@dataclass(frozen=True)
class DriverFile:
    host: str  # the path the container runtime mounts from
    container: str  # the path the container sees it at


@dataclass(frozen=True)
class DriverFiles:
    version: str  # "580.65.06"; "simulated" for the simulated driver
    libraries: tuple[DriverFile, ...]
    binaries: tuple[DriverFile, ...] = ()

    @property
    def library_dirs(self) -> list[str]:
        """The container's directories of the libraries, each once, in the libraries' order."""
        return list(dict.fromkeys(posixpath.dirname(f.container) for f in self.libraries))

    @property
    def libcuda(self) -> DriverFile | None:
        for f in self.libraries:
            if posixpath.basename(f.container).startswith("libcuda.so."):
                return f
        return None

    @property
    def libcuda_dir(self) -> str | None:
        return posixpath.dirname(self.libcuda.container) if self.libcuda else None


# --- the loader cache ------------------------------------------------------------------------


class CacheEntry(NamedTuple):
    flags: int
    name: str  # the soname (or link name) the loader looks up
    path: str  # the file, as an absolute path of the root the cache belongs to


_NEW_MAGIC = b"glibc-ld.so.cache1.1"
_OLD_MAGIC = b"ld.so-1.7.0"
_NEW_HEADER = struct.Struct("<20sIIB3xI12x")  # magic+version, nlibs, len_strings, flags, extension offset
_NEW_ENTRY = struct.Struct("<iIIIQ")  # flags, key, value, osversion, hwcap
_OLD_ENTRY_SIZE = 12
# The cache's flags for this machine's libraries (glibc's ldconfig.h): ELF libc6 plus the ABI.
FLAG_ELF_LIBC6 = 0x0003
_ABI_FLAGS = {"x86_64": 0x0300, "aarch64": 0x0A00}


def machine_flags(machine: str | None = None) -> int:
    return FLAG_ELF_LIBC6 | _ABI_FLAGS.get(machine or platform.machine(), 0)


def parse_ldcache(data: bytes) -> list[CacheEntry]:
    """The entries of a glibc ``ld.so.cache`` (the new format, alone or after the old one, as every
    glibc since 2.32 writes it and earlier ones could); ``ValueError`` for anything else."""
    if data.startswith(_NEW_MAGIC):
        base = 0
    elif data.startswith(_OLD_MAGIC):
        (old_count,) = struct.unpack_from("<I", data, 12)
        base = (16 + old_count * _OLD_ENTRY_SIZE + 7) & ~7  # the new format follows, 8-aligned
        if data[base:base + len(_NEW_MAGIC)] != _NEW_MAGIC:
            raise ValueError("an old-format ld.so.cache only: not supported")
    else:
        raise ValueError("not an ld.so.cache")
    try:
        _, count, _, _, _ = _NEW_HEADER.unpack_from(data, base)
    except struct.error as e:
        raise ValueError(f"a truncated ld.so.cache: {e}") from None

    def string(offset: int) -> str:
        start = base + offset
        end = data.find(b"\0", start)
        if not 0 <= start < len(data) or end < 0:
            raise ValueError("an ld.so.cache string outside the file")
        return data[start:end].decode("utf-8", "surrogateescape")

    entries = []
    for i in range(count):
        try:
            flags, key, value, _, _ = _NEW_ENTRY.unpack_from(data, base + _NEW_HEADER.size + i * _NEW_ENTRY.size)
        except struct.error as e:
            raise ValueError(f"a truncated ld.so.cache: {e}") from None
        entries.append(CacheEntry(flags, string(key), string(value)))
    return entries


def read_ldcache(path: str | Path) -> list[CacheEntry]:
    return parse_ldcache(Path(path).read_bytes())


# --- paths inside a root ---------------------------------------------------------------------


def resolve_in(root: Path, path: str, *, limit: int = 40) -> str:
    """``path`` (absolute, as the root sees itself) with every symlink followed inside ``root``: an
    absolute link target starts again at ``root``, ``..`` stops at it. Returns the resolved absolute
    path in the root's terms; ``FileNotFoundError`` if a component is missing."""
    parts = [p for p in PurePosixPath("/", path).parts[1:]]
    done: list[str] = []
    hops = 0
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        here = root.joinpath(*done, part)
        if here.is_symlink():
            hops += 1
            if hops > limit:
                raise OSError(f"too many symlinks resolving {path} in {root}")
            target = os.readlink(here)
            if target.startswith("/"):
                done = []
            parts = [p for p in PurePosixPath(target).parts if p != "/"] + parts
            continue
        if not here.exists():
            raise FileNotFoundError(f"{path}: {'/' + '/'.join(done + [part])} does not exist in {root}")
        done.append(part)
    return "/" + "/".join(done)


def _join(root: Path | str, inner: str) -> str:
    return str(PurePosixPath(root, inner.lstrip("/")))


# --- finding the driver ----------------------------------------------------------------------


def _libcuda(root: Path, entries: Iterable[CacheEntry], flags: int) -> str | None:
    """The versioned libcuda file, in the root's terms: from the cache, else the library dirs."""
    candidates = [e.path for e in entries if e.name == "libcuda.so.1" and e.flags == flags]
    candidates += [posixpath.join(d, "libcuda.so.1") for d in LIBRARY_DIRS]
    for candidate in candidates:
        try:
            resolved = resolve_in(root, candidate)
        except OSError:
            continue
        if root.joinpath(resolved.lstrip("/")).is_file():
            return resolved
    return None


def find(root: str | Path = "/", host_root: str | Path | None = None) -> DriverFiles:
    """The driver's files under ``root`` (as the enforcer sees it), mounted from ``host_root`` (as
    the container runtime sees the same directory; ``root`` itself if None)."""
    root = Path(root)
    host = Path(host_root) if host_root is not None else root
    cache = root / "etc" / "ld.so.cache"
    entries: list[CacheEntry] = []
    if cache.is_file():
        try:
            entries = read_ldcache(cache)
        except (OSError, ValueError):
            entries = []  # the directories below are looked at instead
    libcuda = _libcuda(root, entries, machine_flags())
    if libcuda is None:
        where = "its ld.so.cache or " + ", ".join(LIBRARY_DIRS)
        raise DriverNotFound(f"no NVIDIA driver under the driver root {root}: libcuda.so.1 is in neither {where} "
                             "(set TESSERA_DRIVER_ROOT to where the driver is installed)")
    directory, name = posixpath.split(libcuda)
    version = name.removeprefix("libcuda.so.")
    if not _VERSION.match(version):
        raise DriverNotFound(f"libcuda.so.1 under {root} is {libcuda}, not a driver's versioned library "
                             "(libcuda.so.<version>): cannot tell which files are the driver's")
    suffix = f".so.{version}"
    libraries = []
    for folder in (directory, posixpath.join(directory, "vdpau")):
        try:
            names = sorted(os.listdir(root / folder.lstrip("/")))
        except OSError:
            continue
        for lib in names:
            inner = posixpath.join(folder, lib)
            if lib.startswith("lib") and lib.endswith(suffix) and (root / inner.lstrip("/")).is_file() \
                    and not (root / inner.lstrip("/")).is_symlink():
                libraries.append(DriverFile(host=_join(host, inner), container=inner))
    binaries = []
    for program in BINARIES:
        for folder in BINARY_DIRS:
            try:
                inner = resolve_in(root, posixpath.join(folder, program))
            except OSError:
                continue
            if os.access(root / inner.lstrip("/"), os.X_OK):
                binaries.append(DriverFile(host=_join(host, inner), container=f"/usr/bin/{program}"))
                break
    return DriverFiles(version=version, libraries=tuple(libraries), binaries=tuple(binaries))


def simulated(directory: str | Path) -> DriverFiles:
    """The simulated driver of native/vgpu (``TESSERA_SIM_DRIVER_DIR``), at /usr/lib in a container."""
    return DriverFiles(version="simulated", libraries=tuple(
        DriverFile(host=str((Path(directory) / lib).resolve()), container=f"{CONTAINER_SIM_DRIVER_DIR}/{lib}")
        for lib in SIM_DRIVER_LIBS))
