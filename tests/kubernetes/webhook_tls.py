"""Real TLS for the webhook tests: a self-signed CA, serving certificates it issues, written the way
the kubelet projects a Secret volume (files behind a ``..data`` symlink that is swapped at once),
and a client that reads the certificate a server presents."""

from __future__ import annotations

import asyncio
import datetime
import itertools
import json
import os
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

_versions = itertools.count(1)


class Authority:
    """A CA that issues serving certificates for 127.0.0.1 / localhost."""

    def __init__(self) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tessera-test-ca")])
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self) -> tuple[bytes, bytes, int]:
        """(certificate PEM, key PEM, serial) of a new serving certificate with a new key."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        serial = x509.random_serial_number()
        import ipaddress

        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tessera-translator-webhook")]))
            .issuer_name(self.cert.subject).public_key(key.public_key()).serial_number(serial)
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        return cert.public_bytes(serialization.Encoding.PEM), key_pem, serial

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cadata=self.pem.decode())
        return context


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
