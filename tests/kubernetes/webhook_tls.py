"""Real TLS for the translator's webhook in tests: serving certificates from the tests' CA
(``webhook_server.CertificateAuthority``), written the way the kubelet projects a Secret volume
(files behind a ``..data`` symlink that is swapped at once), and a client that reads the
certificate a server presents."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import ssl
import tempfile
from pathlib import Path

from cryptography import x509

from webhook_server import CertificateAuthority

_versions = itertools.count(1)


# The name the API server checks on the translator's certificate (its webhook Service), as
# deploy/k8s/webhook.yaml's Certificate issues it; and localhost for the tests' own calls.
SERVING_NAMES = ("tessera-translator-webhook.tessera-system.svc", "localhost")


class Authority(CertificateAuthority):
    """The test CA, issuing serving certificates as cert-manager would at each renewal."""

    def __init__(self) -> None:
        super().__init__()
        self._scratch = Path(tempfile.mkdtemp(prefix="tessera-ca-"))

    def serving(self) -> tuple[bytes, bytes, int]:
        """(certificate chain PEM, key PEM, serial) of a new serving certificate with a new key."""
        cert_path, key_path = self.issue(self._scratch / str(next(_versions)), list(SERVING_NAMES))
        chain = cert_path.read_bytes()
        return chain, key_path.read_bytes(), x509.load_pem_x509_certificate(chain).serial_number

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cadata=self.pem.decode())


def project_secret(directory: Path, files: dict[str, bytes]) -> None:
    """Write ``files`` as the kubelet updates a Secret volume: a new timestamped directory, then one
    atomic swap of the ``..data`` symlink; the visible names point through ``..data``."""
    directory.mkdir(parents=True, exist_ok=True)
    version = directory / f"..{next(_versions)}_{os.getpid()}"
    version.mkdir()
    for name, content in files.items():
        (version / name).write_bytes(content)
    tmp = directory / "..data_tmp"
    os.symlink(version.name, tmp)
    os.replace(tmp, directory / "..data")
    for name in files:
        link = directory / name
        if not link.is_symlink():
            os.symlink(f"..data/{name}", link)


async def served_serial(port: int, authority: Authority) -> tuple[int, asyncio.StreamReader, asyncio.StreamWriter]:
    """Open a TLS connection (verifying against the CA): the served certificate's serial, and the
    connection, left open."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=authority.client_context(),
                                                   server_hostname="localhost")
    der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    return x509.load_der_x509_certificate(der).serial_number, reader, writer


async def post_review(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, review: dict) -> dict:
    """POST /mutate over an open (keep-alive) connection; the AdmissionReview answer."""
    body = json.dumps(review).encode()
    writer.write(b"POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    status = await reader.readline()
    assert status.startswith(b"HTTP/1.1 200"), status
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
    return json.loads(await reader.readexactly(length))
