"""The kubelet plugin's checkpoint: which claims it prepared (or was preparing) in this boot.

The kubelet trusts a prepared claim to stay prepared until it asks for the opposite, across plugin
restarts; so the plugin writes down, before it answers, what it did. One JSON file in the plugin
directory, replaced atomically (temporary file, fsync, rename, fsync of the directory), with a
SHA-256 of its body, so a torn or edited file is recognised instead of believed, and the kernel's
boot id, so a checkpoint that survived a reboot (on a persistent disk) is known to describe
containers that no longer exist. A claim is written ``preparing`` before anything is made and
``prepared`` after, so what a crash interrupted can be found and rolled back.

Each claim directory also keeps its own finished entry (``kubelet.json``): what a corrupt
checkpoint is rebuilt from.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Literal

import msgspec

VERSION = 1


class CheckpointDevice(msgspec.Struct, frozen=True, kw_only=True):
    """One device of the NodePrepareResources answer, as it was given to the kubelet."""

    request_names: list[str]
    pool: str
    device: str
    cdi_ids: list[str] = []
    share_id: str | None = None


class CheckpointClaim(msgspec.Struct, kw_only=True):
    uid: str
    namespace: str
    name: str
    claim: str  # the Tessera claim id (k8s-<uid>): its directory and CDI spec
    state: Literal["preparing", "prepared"]
    devices: list[CheckpointDevice] = []
    # The boot it was prepared in: a claim directory's own copy must say, for a rebuild after a reboot.
    boot_id: str = ""


class Body(msgspec.Struct, kw_only=True):
    boot_id: str
    claims: dict[str, CheckpointClaim] = {}  # by ResourceClaim uid


class _File(msgspec.Struct, kw_only=True):
    version: int
    checksum: str
    body: msgspec.Raw


class CorruptCheckpoint(Exception):
    """The checkpoint exists but cannot be believed; the message says why."""


_file = msgspec.json.Decoder(_File)
_body = msgspec.json.Decoder(Body)
claim_decoder = msgspec.json.Decoder(CheckpointClaim)


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def boot_id(path: Path) -> str:
    """The kernel's id of this boot (unknown where the file cannot be read: then every boot is one)."""
    try:
        return path.read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves the old file or the new one, whole."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:  # os.write may write less than it was given
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class Checkpoint:
    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self, current_boot: str) -> Body:
        """The stored body (an empty one for ``current_boot`` if there is none); CorruptCheckpoint
        if the file is unreadable, of another version, or fails its checksum."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return Body(boot_id=current_boot)
        except OSError as exc:
            raise CorruptCheckpoint(f"cannot be read: {exc}") from None
        try:
            stored = _file.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise CorruptCheckpoint(f"is not a checkpoint: {exc}") from None
        if stored.version != VERSION:
            raise CorruptCheckpoint(f"has version {stored.version}, this plugin writes version {VERSION}")
        if _digest(bytes(stored.body)) != stored.checksum:
            raise CorruptCheckpoint("fails its checksum (torn or edited)")
        try:
            return _body.decode(bytes(stored.body))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise CorruptCheckpoint(f"has a body that does not decode: {exc}") from None

    def write(self, body: Body) -> None:
        raw = msgspec.json.encode(body)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(self.path, msgspec.json.encode(_File(version=VERSION, checksum=_digest(raw),
                                                              body=msgspec.Raw(raw))))

    def set_aside(self) -> Path:
        """Move a corrupt checkpoint out of the way, kept for whoever investigates; its new path."""
        aside = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{time.time_ns()}")
        os.replace(self.path, aside)
        return aside
