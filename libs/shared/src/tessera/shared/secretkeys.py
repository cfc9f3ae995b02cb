"""The manager's secret-key file: its format, how it is read, and how a new one is made.

The control-plane manager seals tenant secrets with these keys (`tessera.controlplane.sealing`);
`tessera up` and `tessera secret-key` (compose) create the file, a Kubernetes Secret mounts it. It
lives here, not in the manager, because the CLI writes it and services never import each other.

The file is text: one base64 (either alphabet) 32-byte key a line, newest first; blank lines and
``#`` comments are ignored. A missing, unreadable or malformed file stops the manager at start-up,
before it connects to anything, with the line that is wrong and how to make a good one.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from tessera.shared.errors import ConfigError

KEY_FILE_SETTING = "TESSERA_CP_SECRET_KEY_FILE"
KEY_BYTES = 32  # AES-256


def key_id(key: bytes) -> str:
    """A short public name for a key (in every envelope), so a reader knows which key to use."""
    return hashlib.sha256(b"tessera-secret-key-id\0" + key).hexdigest()[:12]


def new_key_line() -> str:
    return base64.b64encode(os.urandom(KEY_BYTES)).decode()


def write_key_file(path: Path) -> bool:
    """Create a key file with one new key, readable by its owner only; leave an existing one as
    it is (it holds the keys the stored values are sealed with). True if one was written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write("# Tessera control-plane secret keys: newest first, one base64 AES-256 key a line.\n")
        f.write(new_key_line() + "\n")
    return True


def rotate_key_file(path: Path) -> None:
    """Put a new key first in an existing file (it seals from the manager's next start; the older
    ones still open what they sealed until the manager has re-sealed it)."""
    SecretKeys.from_file(str(path))  # a broken file is not rotated into a worse one
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    at = next((i for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("#")), len(lines))
    lines.insert(at, new_key_line() + "\n")
    tmp = path.with_name(path.name + ".new")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("".join(lines))
    os.replace(tmp, path)


@dataclass(frozen=True)
class SecretKeys:
    """The keys of one manager, newest first. ``source`` says where they came from (for messages)."""

    keys: tuple[tuple[str, bytes], ...]
    source: str

    def __post_init__(self) -> None:
        if not self.keys:
            raise ConfigError(f"{self.source}: holds no key; add a line with a base64 32-byte key")

    def __repr__(self) -> str:  # never the key bytes, in a log or a traceback
        return f"SecretKeys({', '.join(self.ids)} from {self.source})"

    @property
    def ids(self) -> list[str]:
        return [kid for kid, _ in self.keys]

    @classmethod
    def ephemeral(cls) -> "SecretKeys":
        """One random key in memory: for a manager embedded in a test or a benchmark, whose bucket
        dies with it. The service itself always reads its keys from a file (`from_file`)."""
        key = os.urandom(KEY_BYTES)
        return cls(((key_id(key), key),), "an in-memory key")

    @classmethod
    def from_file(cls, path: str, setting: str = KEY_FILE_SETTING) -> "SecretKeys":
        where = f"{setting}={path}"
        if not path:
            raise ConfigError(
                f"{setting} is not set: the manager seals tenant secrets with the keys in that file "
                f"(create one with `tessera secret-key --out FILE`; on Kubernetes mount it from a Secret)")
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            raise ConfigError(f"{where}: no such file (create it with `tessera secret-key --out {path}`)") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{where}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
        keys: list[tuple[str, bytes]] = []
        for number, line in enumerate(text.splitlines(), start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                standard = line.replace("-", "+").replace("_", "/").rstrip("=")  # either alphabet
                key = base64.b64decode(standard + "=" * (-len(standard) % 4), validate=True)
            except (binascii.Error, ValueError):
                raise ConfigError(f"{where}: line {number} is not base64; each line is one key "
                                  f"(`head -c 32 /dev/urandom | base64`)") from None
            if len(key) != KEY_BYTES:
                raise ConfigError(f"{where}: line {number} is a {len(key)}-byte key; AES-256 needs "
                                  f"{KEY_BYTES} bytes (`head -c 32 /dev/urandom | base64`)")
            keys.append((key_id(key), key))
        if len({kid for kid, _ in keys}) != len(keys):
            raise ConfigError(f"{where}: the same key is listed twice")
        return cls(tuple(keys), where)
