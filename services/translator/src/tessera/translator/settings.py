"""The claim translator's settings, declared field by field (`tessera.shared.settings`).

The admission webhook is served only when a port is set; ``kubernetes`` turns on the Kubernetes
side (templates, the namespace's tenant, the ResourceClaim watcher).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable

from tessera.shared.settings import FromEnv, setting


@dataclass(frozen=True, kw_only=True)
class TranslatorSettings(FromEnv):
    webhook_port: int = setting(
        "TESSERA_WEBHOOK_PORT", "port of the Kubernetes mutating admission webhook; `0`: no webhook", 0, minimum=0)
    webhook_host: str = setting("TESSERA_WEBHOOK_HOST", "its address", "0.0.0.0")
    webhook_cert: str = setting(
        "TESSERA_WEBHOOK_CERT", "its TLS certificate (a PEM file), with `TESSERA_WEBHOOK_KEY`: both or neither (the "
        "Kubernetes API server only calls webhooks over TLS). Re-read when they change (a Secret volume's `..data` "
        "swap at renewal): new connections get the new certificate; files that do not load are logged and the old "
        "certificate kept", "")
    webhook_key: str = setting("TESSERA_WEBHOOK_KEY", "its TLS key (a PEM file), with `TESSERA_WEBHOOK_CERT`", "")
    # How often the certificate files are looked at for a renewal.
    cert_poll_seconds: float = setting(
        "TESSERA_WEBHOOK_CERT_POLL_SECONDS", "how often those files are checked for a change", 10.0, above=0)
    kubernetes: bool = setting(
        "TESSERA_KUBERNETES", "`true`: Kubernetes mode. The webhook reads the pod's Namespace for its tenant (label "
        "or annotation `tessera.io/tenant`) and creates the ResourceClaimTemplates of translated pods; the "
        "ResourceClaims of device class `gpu.tessera.dev` in every namespace are followed: each becomes a claim "
        "`k8s-<uid>` (`requested`, `source` `kubernetes`), its deletion a release", False)
    # Full comparison of the ResourceClaims with the claims bucket: at start and this often.
    reconcile_seconds: float = setting(
        "TESSERA_TRANSLATOR_RECONCILE_SECONDS", "in Kubernetes mode, how often the ResourceClaims are compared with "
        "the `claims` bucket (also at start): a claim without a record is requested, a live Kubernetes claim "
        "without its ResourceClaim released; in every mode, how often `requested` records whose event never "
        "reached the stream are republished", 60.0, above=0)

    def check(self) -> Iterable[str]:
        if bool(self.webhook_cert) != bool(self.webhook_key):
            yield "set both TESSERA_WEBHOOK_CERT and TESSERA_WEBHOOK_KEY (PEM files), or neither"
        for name in ("webhook_cert", "webhook_key"):
            path = getattr(self, name)
            if path and not os.path.exists(path):
                yield f"TESSERA_{name.upper()}={path} does not exist"
