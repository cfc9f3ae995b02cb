"""What counts as a tenant's secret, how a test gets it from a running Tessera, and a scan for it.

The secrets come from where the manager keeps them (the sealed ``controlplane-secrets`` bucket,
opened with the manager's own key file, as only the manager could) plus the platform's NATS
passwords; the scan looks for them, byte for byte, in whatever it is given (log files, stream
messages, OTLP requests as received).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import msgspec
from nats.js.errors import NotFoundError

from tessera.controlplane.credentials import TenantSecrets
from tessera.controlplane.sealing import Sealer
from tessera.controlplane.store import KV_SECRETS
from tessera.shared.secretkeys import SecretKeys


async def tenant_secrets(cluster, bus, tenant: str) -> TenantSecrets:
    """The tenant's secrets, opened with the manager's key (the test stands in for the manager)."""
    entry = await (await bus.kv(KV_SECRETS)).get(tenant)
    sealer = Sealer(SecretKeys.from_file(str(cluster.secret_key_file)), KV_SECRETS)
    return msgspec.json.decode(sealer.open(tenant, entry.value), type=TenantSecrets)


def needles(secrets: TenantSecrets) -> dict[str, bytes]:
    """Label -> bytes that must appear nowhere: each private key's PEM body lines (64 random
    base64 characters each), the datastore password, the admin kubeconfig's embedded key."""
    found: dict[str, bytes] = {}
    t = secrets.tenant
    for name, pem in secrets.pki.items():
        if not name.endswith(".key"):
            continue
        for i, line in enumerate(pem.splitlines()):
            if len(line) == 64:
                found[f"{t} {name} PEM line {i}"] = line.encode()
    if secrets.datastore and secrets.datastore.password:
        found[f"{t} datastore password"] = secrets.datastore.password.encode()
    if secrets.kubeconfig:
        embedded = base64.b64encode(secrets.pki["admin.key"].encode())
        found[f"{t} kubeconfig client-key-data"] = embedded[len(embedded) // 2:len(embedded) // 2 + 48]
    return found


@dataclass
class Haystack:
    """Named byte blobs: a log file, a stream message, an OTLP request."""

    blobs: dict[str, bytes]

    def findings(self, secrets: dict[str, bytes]) -> list[str]:
        return [f"{label} in {where}" for where, blob in self.blobs.items()
                for label, needle in secrets.items() if needle in blob]


async def stream_messages(bus) -> dict[str, bytes]:
    """Every message still stored on every stream of the platform account (events, the DLQ, the
    KV buckets' streams), headers and data."""
    out: dict[str, bytes] = {}
    for info in await bus.streams_info():
        state = info.state
        if not state.messages:
            continue  # (an empty stream reports first_seq 0, which the server refuses to get)
        for seq in range(max(1, state.first_seq), state.last_seq + 1):
            try:
                msg = await bus.stored_message(info.config.name, seq)
            except NotFoundError:
                continue  # deleted or purged
            headers = b"".join(f"{k}: {v}\n".encode() for k, v in (msg.headers or {}).items())
            out[f"stream {info.config.name} #{seq} ({msg.subject})"] = msg.subject.encode() + b"\n" + headers + (msg.data or b"")
    return out
