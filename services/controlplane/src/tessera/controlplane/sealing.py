"""Tenant secrets sealed at rest: what lands in the ``controlplane-secrets`` bucket is ciphertext.

The bucket holds every tenant's CA key, datastore password and admin kubeconfig. NATS permissions
keep other identities out of it, but its stream is also on the NATS servers' disks, in their
backups, and readable by anyone holding the operator identity; sealed, those hold nothing usable
without the key, which only the manager has (a file: a mounted Secret on Kubernetes, a 0600 file
in the state directory of `make up`).

Each value is AES-256-GCM with a fresh random nonce. The associated data binds the bucket, the KV
key (the tenant's name) and the key id, so a sealed value copied under another tenant's key, or
relabelled with another key id, does not open. The envelope is one line of ASCII::

    tessera-sealed.1.<key id>.<nonce, base64url>.<ciphertext and tag, base64url>

Rotation: the key file (`tessera.shared.secretkeys`) lists keys, newest first; the newest seals, every one opens, and the
manager re-seals whatever is not under the newest (`TenantStore.reseal_secrets`). A value written
in plaintext by a manager before sealing existed is read as it is and re-sealed the same way.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections import Counter

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tessera.shared.kv import BadValue
from tessera.shared.secretkeys import SecretKeys


MAGIC = b"tessera-sealed"
VERSION = 1
NONCE_BYTES = 12  # GCM's standard nonce; random per value (2^32 values per key stay far below the bound)

# Values found unsealed (written before sealing), by bucket: re-sealed as they are found.
UNSEALED_READ: Counter[str] = Counter()


class Unopenable(BadValue):
    """A sealed value this manager cannot open: the message says which key it needs, or that the
    value was altered or moved from another tenant's key."""


class Sealer:
    """The envelope of one bucket (`tessera.shared.kv.Envelope`): seals with the newest key, opens
    with any, reads legacy plaintext."""

    def __init__(self, keys: SecretKeys, bucket: str) -> None:
        self.keys = keys
        self.bucket = bucket
        self._newest = keys.keys[0][0]
        self._aead = {kid: AESGCM(key) for kid, key in keys.keys}

    def _aad(self, key: str, kid: str) -> bytes:
        return b"\0".join((MAGIC, str(VERSION).encode(), self.bucket.encode(), key.encode(), kid.encode()))

    def seal(self, key: str, data: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        sealed = self._aead[self._newest].encrypt(nonce, data, self._aad(key, self._newest))
        return b".".join((MAGIC, str(VERSION).encode(), self._newest.encode(),
                          base64.urlsafe_b64encode(nonce), base64.urlsafe_b64encode(sealed)))

    @staticmethod
    def is_sealed(data: bytes) -> bool:
        return data.startswith(MAGIC + b".")

    def is_current(self, data: bytes) -> bool:
        """Sealed with the newest key in this envelope version (nothing to re-seal)."""
        return data.startswith(b".".join((MAGIC, str(VERSION).encode(), self._newest.encode())) + b".")

    def open(self, key: str, data: bytes) -> bytes:
        where = f"{self.bucket}/{key}"
        if not self.is_sealed(data):
            # Written by a manager from before sealing: read it; the manager re-seals it.
            UNSEALED_READ[self.bucket] += 1
            return data
        parts = data.split(b".")
        if len(parts) != 5:
            raise Unopenable(f"{where} is not a well-formed sealed value (expected 5 fields, found {len(parts)})")
        _, version, kid_raw, nonce_raw, sealed_raw = parts
        if version != str(VERSION).encode():
            raise Unopenable(f"{where} is sealed in envelope version {version.decode(errors='replace')!r}, "
                             f"which this manager does not read (only {VERSION}): run the Tessera that wrote it")
        kid = kid_raw.decode(errors="replace")
        aead = self._aead.get(kid)
        if aead is None:
            raise Unopenable(f"{where} is sealed with key {kid}, which {self.keys.source} does not hold "
                             f"(it holds {', '.join(self.keys.ids)}): add that key to the file, below the newest")
        try:
            nonce = base64.urlsafe_b64decode(nonce_raw)
            sealed = base64.urlsafe_b64decode(sealed_raw)
            return aead.decrypt(nonce, sealed, self._aad(key, kid))
        except (InvalidTag, binascii.Error, ValueError):
            raise Unopenable(f"{where} does not open with key {kid}: it was altered, or copied from "
                             f"another key of the bucket (another tenant's); restore it from a backup "
                             f"or delete it so the manager issues new credentials") from None
