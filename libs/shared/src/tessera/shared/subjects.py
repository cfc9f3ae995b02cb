"""Subject names, stream names and KV bucket names: the public interface of the bus.

External tools subscribe to these; they are documented in docs/asyncapi.json, which is generated
from this module and events.py (`tessera asyncapi`) and checked by a test to be current.
One family per stream.
"""

from __future__ import annotations

import re

PREFIX = "tessera"

# Families (stream name -> subject filter)
INVENTORY = f"{PREFIX}.inventory"
CLAIMS = f"{PREFIX}.claims"
USAGE = f"{PREFIX}.usage"
TENANTS = f"{PREFIX}.tenants"
DLQ = f"{PREFIX}.dlq"

STREAM_INVENTORY = "TESSERA_INVENTORY"
STREAM_CLAIMS = "TESSERA_CLAIMS"
STREAM_USAGE = "TESSERA_USAGE"
STREAM_TENANTS = "TESSERA_TENANTS"
STREAM_DLQ = "TESSERA_DLQ"

STREAMS: dict[str, str] = {
    STREAM_INVENTORY: f"{INVENTORY}.>",
    STREAM_CLAIMS: f"{CLAIMS}.>",
    STREAM_USAGE: f"{USAGE}.>",
    STREAM_TENANTS: f"{TENANTS}.>",
    STREAM_DLQ: f"{DLQ}.>",
}

# KV buckets: current state.
KV_INVENTORY = "inventory"  # node -> NodeInventory
KV_LEDGER = "ledger"  # node.<node> -> NodeLedger, tenant.<tenant> -> TenantUsage
KV_CLAIMS = "claims"  # <claim> -> ClaimRecord
KV_TENANTS = "tenants"  # <tenant> -> TenantRecord
KV_BUCKETS = (KV_INVENTORY, KV_LEDGER, KV_CLAIMS, KV_TENANTS)

# Request/reply APIs (core NATS, not persisted).
API = f"{PREFIX}.api"
API_SUBMIT = f"{API}.claims.submit"  # translator: GPU request -> claim id, or an error
API_RELEASE = f"{API}.claims.release"  # translator: release a claim by id
API_CLAIM_GET = f"{API}.claims.get"  # translator: a claim's record (and its 'prepared' event)
API_CLAIM_RUNNING = f"{API}.claims.running"  # translator: `tessera run` reports its workload's pids
API_TENANTS = f"{API}.tenants"  # control-plane manager: .create .get .list .delete

_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


def token(value: str) -> str:
    """A value used as one subject token must not contain '.', '*', '>' or whitespace."""
    if not _TOKEN.match(value):
        raise ValueError(f"{value!r} cannot be a subject token: use letters, digits, '-' and '_'")
    return value


def inventory(node: str) -> str:
    return f"{INVENTORY}.{token(node.replace('.', '_'))}"


# A claim event's last token is the node it concerns, so that a node enforcer's consumer is filtered
# by the server to its own node's events (one delivery per event, not one per node of the fleet).
NO_NODE = "_"  # a claim event that concerns no node (yet): requested, unschedulable, an early release
ANY_NODE = "*"  # for subscriptions and consumer filters


def node_token(node: str | None) -> str:
    if not node:
        return NO_NODE
    if node == ANY_NODE:
        return ANY_NODE
    return token(node.replace(".", "_"))


def claim(tenant: str, claim_id: str, event: str, node: str | None = None) -> str:
    """``tessera.claims.<tenant>.<claim>.<event>.<node>``; ``node`` None: `NO_NODE`."""
    return f"{CLAIMS}.{token(tenant)}.{token(claim_id)}.{event}.{node_token(node)}"


def claims_of_kind(event: str, node: str | None = ANY_NODE) -> str:
    """Every claim event of one kind, of every node (default) or of one node."""
    return f"{CLAIMS}.*.*.{event}.{node_token(node)}"


def claim_subject_parts(subject: str) -> tuple[str, str, str, str]:
    """(tenant, claim, event, node token) of a claim event's subject; ValueError if it is not one."""
    parts = subject.split(".")
    if len(parts) != 6 or ".".join(parts[:2]) != CLAIMS:
        raise ValueError(f"{subject!r} is not a claim event subject ({CLAIMS}.<tenant>.<claim>.<event>.<node>)")
    return parts[2], parts[3], parts[4], parts[5]


def usage(node: str) -> str:
    return f"{USAGE}.{token(node.replace('.', '_'))}"


def tenant(name: str, event: str) -> str:
    return f"{TENANTS}.{token(name)}.{event}"


def dlq(service: str) -> str:
    return f"{DLQ}.{token(service)}"


DLQ_REPLAYED = f"{DLQ}.replayed"  # .<seq>: the mark `tessera dlq replay` leaves for one letter


def dlq_replayed(seq: int) -> str:
    return f"{DLQ_REPLAYED}.{int(seq)}"


def ledger_node_key(node: str) -> str:
    return f"node.{node}"


def ledger_tenant_key(tenant_name: str) -> str:
    return f"tenant.{tenant_name}"


def event_name(subject: str) -> str:
    """What happened, for span names and logs: a claim event's kind, else the subject's last token."""
    parts = subject.split(".")
    if len(parts) == 6 and parts[1] == "claims":
        return parts[4]
    return parts[-1]
