"""The cert-manager v1 shapes our manifests use (Issuer, Certificate), for the schema test.

Kubernetes' own OpenAPI has no schema for cert-manager's custom resources, so these are written
from cert-manager's v1 API reference: every field of a Certificate's spec (22 of them; unknown keys
are refused, as strict Kubernetes validation does), the private-key and issuer-reference values
that matter, and an Issuer that names exactly one kind of issuer.
"""

from __future__ import annotations

METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                   "labels": {"type": "object"}, "annotations": {"type": "object"}},
    "additionalProperties": False,
}

ISSUER_KINDS = ("selfSigned", "ca", "acme", "vault", "venafi")


def resource(kind: str, spec: dict) -> dict:
    """A cert-manager v1 object of ``kind``: apiVersion, kind, metadata and this spec, nothing else."""
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"apiVersion": {"const": "cert-manager.io/v1"}, "kind": {"const": kind},
                       "metadata": METADATA, "spec": spec},
        "additionalProperties": False,
    }


ISSUER = resource("Issuer", {
    "type": "object",
    "properties": {k: {"type": "object"} for k in ISSUER_KINDS},
    "additionalProperties": False,
    "minProperties": 1,
    "maxProperties": 1,
})


CERTIFICATE_SPEC_FIELDS = (
    "additionalOutputFormats", "commonName", "dnsNames", "duration", "emailAddresses",
    "encodeUsagesInRequest", "ipAddresses", "isCA", "issuerRef", "keystores", "literalSubject",
    "nameConstraints", "otherNames", "privateKey", "renewBefore", "renewBeforePercentage",
    "revisionHistoryLimit", "secretName", "secretTemplate", "subject", "uris", "usages",
)
DURATION = {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"}

CERTIFICATE = resource("Certificate", {
    "type": "object",
    "required": ["secretName", "issuerRef"],
    "properties": {
        **{f: {} for f in CERTIFICATE_SPEC_FIELDS},
        "secretName": {"type": "string", "minLength": 1},
        "duration": DURATION,
        "renewBefore": DURATION,
        "dnsNames": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "issuerRef": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string"}, "kind": {"enum": ["Issuer", "ClusterIssuer"]},
                           "group": {"type": "string"}},
            "additionalProperties": False,
        },
        "privateKey": {
            "type": "object",
            "properties": {"algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                           "size": {"type": "integer"},
                           "encoding": {"enum": ["PKCS1", "PKCS8"]},
                           "rotationPolicy": {"enum": ["Never", "Always"]}},
            "additionalProperties": False,
        },
    },
    "additionalProperties": False,
})

SCHEMAS = {("cert-manager.io/v1", "Issuer"): ISSUER, ("cert-manager.io/v1", "Certificate"): CERTIFICATE}
