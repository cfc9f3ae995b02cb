"""The AsyncAPI 3.0 document of Tessera's subjects, generated from the Structs that define them.

External tools subscribe to Tessera's subjects; this document is their contract. It is rendered from
events.py, api.py and subjects.py (never written by hand) into docs/asyncapi.json by
``tessera asyncapi`` (or `make docs`); a test fails when the checked-in document differs from what
the code says. An event added to a family's union in events.py appears here by itself (its message,
its schema, the claim channel's list of kinds); `FAMILIES` changes only with a new subject family.
"""

from __future__ import annotations

import json

import msgspec

from tessera.shared import api, events, subjects

FAMILIES = [
    # (channel id, address, stream, union, description)
    ("inventory", "tessera.inventory.{node}", subjects.STREAM_INVENTORY, events.InventoryEvent,
     "Node GPU inventory snapshots, heartbeats and lost-node notices (capacity publisher)."),
    ("claims", "tessera.claims.{tenant}.{claim}.{event}.{node}", subjects.STREAM_CLAIMS, events.ClaimEvent,
     f"Claim lifecycle: {', '.join(events.CLAIM_EVENT_KINDS)}. "
     "The last token is the node the event concerns ('_' while none: requested, unschedulable, a release "
     "before allocation), so a node's enforcer consumes only its own node's events."),
    ("usage", "tessera.usage.{node}", subjects.STREAM_USAGE, events.UsageEvent,
     "Observed per-claim and per-node GPU usage (node enforcer)."),
    ("tenants", "tessera.tenants.{tenant}.{event}", subjects.STREAM_TENANTS, events.TenantEvent,
     "Tenant lifecycle and quota (control-plane manager)."),
    ("dlq", "tessera.dlq.{service}", subjects.STREAM_DLQ, events.DeadLetter,
     "Messages a service gave up on, with the reason; `tessera dlq list` shows them."),
    ("dlq-replayed", "tessera.dlq.replayed.{seq}", subjects.STREAM_DLQ, events.DeadLetterReplayed,
     "The mark `tessera dlq replay` leaves once it sent the letter at stream sequence {seq} back to its "
     "subject (the republished message carries Nats-Msg-Id 'dlq-replay:{seq}'); a second replay finds it "
     "and sends nothing."),
]

# Where the bus is and how a client proves who it is. Every server runs nats-server's config-file
# authorization (tessera.shared.identities): a user and password per identity; an outside tool
# that only reads uses the `viewer` user, one that submits uses a tenant's user in its own account.
SERVERS = {
    "local": {
        "host": "127.0.0.1:4222", "protocol": "nats",
        "description": "`make up`'s embedded server (its port is in .run/nats-url; the viewer's URL, "
                       "with its password, in .run/nats-url-viewer).",
        "security": [{"$ref": "#/components/securitySchemes/userPassword"}],
    },
    "compose": {
        "host": "nats:4222", "protocol": "nats",
        "description": "The compose set's NATS (deploy/compose); passwords from `tessera nats-auth`.",
        "security": [{"$ref": "#/components/securitySchemes/userPassword"}],
    },
    "kubernetes": {
        "host": "nats.tessera-system.svc:4222", "protocol": "nats",
        "description": "The NATS StatefulSet of deploy/k8s; passwords in the tessera-nats-users Secret.",
        "security": [{"$ref": "#/components/securitySchemes/userPassword"}],
    },
}
SECURITY_SCHEMES = {
    "userPassword": {
        "type": "userPassword",
        "description": "A NATS user of account TESSERA (operator; viewer: read-only: bucket reads and "
                       "watches, the usage and dead-letter streams, subscriptions to the event families; "
                       "one per service) or a tenant's user (tenant-<t>) in its own account, which sees "
                       "the claim API and its own claim and tenant events only. Replies come on the "
                       "user's own inbox prefix _INBOX_<user>.",
    },
}

PARAMETERS = {
    "tenant": "tenant name",
    "claim": "claim id",
    "event": "what happened (the payload's kind)",
    "node": "node name ('.' written as '_'); in claim subjects the node the event concerns, "
            f"'{subjects.NO_NODE}' while none does",
    "service": "the service that gave up on the message",
    "seq": "the dead letter's sequence in stream " + subjects.STREAM_DLQ,
}

REQUESTS = [
    ("submit", subjects.API_SUBMIT, api.SubmitRequest, "Submit a GPU request (translator); reply: Reply."),
    ("release", subjects.API_RELEASE, api.ReleaseRequest, "Release a claim (translator); reply: Reply."),
    ("claim-get", subjects.API_CLAIM_GET, api.ClaimRequest,
     "A claim's record and its 'prepared' event (translator); reply: Reply."),
    ("claim-running", subjects.API_CLAIM_RUNNING, api.ClaimRequest,
     "A prepared claim's workload started, with its pids (translator); reply: Reply."),
    ("tenants", subjects.API_TENANTS + ".{verb}", api.TenantRequest,
     "Tenant API (control-plane manager): verb is create, get, list or delete; reply: Reply."),
]

KV = {
    subjects.KV_INVENTORY: ("NodeInventory", "node -> its inventory"),
    subjects.KV_LEDGER: ("NodeLedger / TenantUsage", "node.<node> -> live allocations; tenant.<t> -> quota use"),
    subjects.KV_CLAIMS: ("ClaimRecord", "claim -> current state"),
    subjects.KV_TENANTS: ("TenantRecord", "tenant -> quota and phase"),
}


def render() -> str:
    types: list[type] = []
    for *_, union, _ in FAMILIES:
        types += events.members(union)
    types += [t for _, _, t, _ in REQUESTS] + [api.Reply, events.ClaimRecord, events.NodeLedger,
                                                events.TenantUsage, events.TenantRecord]
    _, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    channels: dict = {}
    messages: dict = {}
    operations: dict = {}
    for cid, address, stream, union, description in FAMILIES:
        params = {p.strip("{}"): {"description": PARAMETERS.get(p.strip("{}"), p.strip("{}"))}
                  for p in address.split(".") if p.startswith("{")}
        refs = {}
        for member in events.members(union):
            name = member.__name__
            kind = member.__struct_config__.tag
            messages[name] = {
                "name": name,
                "title": f"{cid}: {kind}",
                "contentType": "application/json",
                "payload": {"$ref": f"#/components/schemas/{name}"},
                "headers": {"type": "object", "properties": {
                    "Nats-Msg-Id": {"type": "string", "description": "deduplication id"},
                    "traceparent": {"type": "string", "description": "W3C trace context"}}},
            }
            refs[name] = {"$ref": f"#/components/messages/{name}"}
        channels[cid] = {"address": address, "description": f"{description} JetStream stream {stream}.",
                         "parameters": params, "messages": refs}
        operations[f"receive-{cid}"] = {"action": "receive", "channel": {"$ref": f"#/channels/{cid}"}}
    for cid, address, req, description in REQUESTS:
        name = req.__name__
        messages[name] = {"name": name, "contentType": "application/json",
                          "payload": {"$ref": f"#/components/schemas/{name}"}}
        messages.setdefault("Reply", {"name": "Reply", "contentType": "application/json",
                                      "payload": {"$ref": "#/components/schemas/Reply"}})
        channels[f"api-{cid}"] = {"address": address, "description": description,
                                  "messages": {name: {"$ref": f"#/components/messages/{name}"},
                                               "Reply": {"$ref": "#/components/messages/Reply"}}}
        operations[f"request-{cid}"] = {"action": "send", "channel": {"$ref": f"#/channels/api-{cid}"},
                                        "reply": {"channel": {"$ref": f"#/channels/api-{cid}"}}}
    document = {
        "asyncapi": "3.0.0",
        "info": {
            "title": "Tessera bus",
            "version": "0.1.0",
            "description": "Subjects, payloads and KV buckets of Tessera. Generated by `tessera asyncapi`; "
                           "do not edit. KV buckets: " + "; ".join(f"{b}: {d} ({t})" for b, (t, d) in KV.items()),
        },
        "servers": SERVERS,
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages, "schemas": components, "securitySchemes": SECURITY_SCHEMES},
    }
    return json.dumps(document, indent=2, sort_keys=True) + "\n"
