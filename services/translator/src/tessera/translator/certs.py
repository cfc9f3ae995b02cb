"""The webhook's serving certificate, followed as its files change.

cert-manager renews the certificate (rotating the key) before it expires and the kubelet swaps the
Secret volume's ``..data`` symlink to the new files. A webhook that loaded its certificate once
serves the old one until it expires, and from then on the API server refuses every handshake:
with ``failurePolicy: Fail`` no GPU pod can be created. So the files are polled (their resolved
path, inode, mtime and size), and a change that loads cleanly becomes the certificate of every new
handshake: the listening context's SNI callback hands each new connection the newest context.
Connections already open keep the certificate they were made with. A change that does not load (a
half-written or garbage file, a key that does not match) is logged and the previous certificate
kept, and the next change is tried again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import ssl

log = logging.getLogger("tessera.translator.certs")

Stamp = tuple[tuple[str, int, int, int] | None, ...]


def _stamp(paths: tuple[str, ...]) -> Stamp:
    out: list[tuple[str, int, int, int] | None] = []
    for path in paths:
        try:
            st = os.stat(path)
            out.append((os.path.realpath(path), st.st_ino, st.st_mtime_ns, st.st_size))
        except OSError:
            out.append(None)
    return tuple(out)


_END = "-----END CERTIFICATE-----"


def fingerprint(cert_file: str) -> str:
    """SHA-256 of the first certificate of a PEM chain (what the logs name a certificate by)."""
    with open(cert_file, encoding="ascii", errors="replace") as f:
        text = f.read()
    first = text[: text.index(_END) + len(_END)] if _END in text else text
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(first)).hexdigest()[:16]


def _context(cert_file: str, key_file: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    return context


class ServingCertificate:
    """``context`` serves the newest certificate that loaded; ``follow()`` keeps it current."""

    def __init__(self, cert_file: str, key_file: str, poll_seconds: float = 10.0) -> None:
        self.paths = (cert_file, key_file)
        self.poll_seconds = poll_seconds
        self._stamp = _stamp(self.paths)
        self._current = _context(cert_file, key_file)  # at start a bad file stops the service
        self.fingerprint = fingerprint(cert_file)
        self.context = _context(cert_file, key_file)
        self.context.sni_callback = self._select

    def _select(self, connection, server_name, _context) -> None:
        # Called for every ClientHello, with or without SNI: the connection is served from here on
        # by the context current at its handshake.
        connection.context = self._current

    def check(self) -> bool:
        """Load the files if they changed since the last look; True if a new certificate is served."""
        stamp = _stamp(self.paths)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            context = _context(*self.paths)
            new = fingerprint(self.paths[0])
        except (OSError, ssl.SSLError, ValueError) as exc:
            log.error("webhook certificate files %s changed but do not load (%s); still serving %s",
                      ", ".join(self.paths), exc, self.fingerprint)
            return False
        self._current, old, self.fingerprint = context, self.fingerprint, new
        log.info("webhook certificate reloaded: %s replaces %s for new connections", new, old)
        return True

    async def follow(self) -> None:
        while True:
            await asyncio.sleep(self.poll_seconds)
            self.check()
