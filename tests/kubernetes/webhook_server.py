"""A tiny HTTPS admission webhook for the Kubernetes tests, with its own self-signed CA.

The emulator calls webhooks as kube-apiserver does (AdmissionReview v1 over verified TLS), so the
tests need a webhook that serves a certificate the way a cluster's would: issued by a CA whose
PEM goes into ``clientConfig.caBundle``, for ``<service>.<namespace>.svc`` and 127.0.0.1.
``WebhookServer`` answers each review with what the test's ``decide(request)`` returns (a
``response`` body, ``uid`` filled in) and keeps the requests it received.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import ssl
from collections.abc import Awaitable, Callable
from ipaddress import IPv4Address
from pathlib import Path

from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

Decide = Callable[[dict], Awaitable[dict] | dict]


class CertificateAuthority:
    def __init__(self, name: str = "tessera-test-ca") -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        start = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
        self.cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(start).not_valid_after(start + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                  content_commitment=False, key_encipherment=False,
                                                  data_encipherment=False, key_agreement=False,
                                                  encipher_only=False, decipher_only=False), critical=True)
                     .sign(self.key, hashes.SHA256()))

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def bundle(self) -> str:
        """The ``caBundle`` of a webhook configuration: base64 of the PEM."""
        return base64.b64encode(self.pem).decode()

    def issue(self, directory: Path, dns_names: list[str], ips: tuple[str, ...] = ("127.0.0.1",)) -> tuple[Path, Path]:
        """A serving certificate and key (PEM files in ``directory``) for these names."""
        key = ec.generate_private_key(ec.SECP256R1())
        start = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
        names = [x509.DNSName(n) for n in dns_names] + [x509.IPAddress(IPv4Address(ip)) for ip in ips]
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, (dns_names or ips)[0])]))
                .issuer_name(self.cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(start + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .sign(self.key, hashes.SHA256()))
        directory.mkdir(parents=True, exist_ok=True)
        cert_path, key_path = directory / "tls.crt", directory / "tls.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM) + self.pem)
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        return cert_path, key_path


def allow(patch: list | None = None) -> dict:
    """An allowing response, with a JSONPatch if given."""
    out: dict = {"allowed": True}
    if patch is not None:
        out["patchType"] = "JSONPatch"
        out["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
    return out


class WebhookServer:
    def __init__(self, cert: Path, key: Path, decide: Decide) -> None:
        self.decide = decide
        self.requests: list[dict] = []
        self._context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._context.load_cert_chain(cert, key)
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    async def _review(self, request: web.Request) -> web.Response:
        review = await request.json()
        self.requests.append(review["request"])
        answer = self.decide(review["request"])
        if asyncio.iscoroutine(answer):
            answer = await answer
        answer = dict(answer, uid=review["request"]["uid"])
        return web.json_response({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                                  "response": answer})

    async def start(self) -> "WebhookServer":
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._review)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self._context)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
