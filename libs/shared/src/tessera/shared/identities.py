"""Who may do what on the bus: one NATS identity per service, and one account per tenant.

A single platform identity let any process holding it (a compromised GPU node's enforcer, say)
read every tenant's CA key in the manager's buckets and rewrite any ledger. This module is the one
place that says, for each service, which subjects it publishes and subscribes to, which streams it
consumes and which KV buckets it reads or writes; from that one table come both the nats-server
permissions of its user and the streams and buckets the service creates at start-up, so a new
subject used by a service without an entry here is refused by the server in the first test that
exercises it.

The mechanism is nats-server's own config-file authorization:
- account ``TESSERA`` holds the platform's streams and buckets; each service connects as its own
  user there with ``permissions`` (publish/subscribe allow lists, ``allow_responses`` for replying
  to requests) and a private inbox prefix ``_INBOX_<user>`` so no service reads another's replies;
- each tenant is its own account (``tenant_account``) with JetStream and connection limits, so a
  flood fills only its own quota. It sees nothing of ``TESSERA`` but what it imports: the tenant
  API as *service imports* whose local subject is the public one (``tessera.api.claims.submit``)
  and whose remote subject carries the tenant's name (``tessera.api.tenant.<t>.claims.submit``).
  The server applies that mapping from the config the platform wrote, so the translator learns the
  tenant from the subject the request arrives on, never from the payload.
Passwords in the config are bcrypt hashes (nats-server compares a hash starting ``$2`` with
bcrypt); clients hold the plain passwords.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bcrypt

from tessera.shared import subjects
from tessera.shared import topology as topology_table

PLATFORM_ACCOUNT = "TESSERA"
OPERATOR = "operator"  # the CLI/admin identity: the whole platform account
# The read-only identity of the fleet view, `tessera top` and outside dashboards: it reads the
# buckets, follows the events and lists dead letters, and can change nothing (no publish but its
# JetStream API reads; no stream or bucket create or update).
VIEWER = "viewer"
SERVICES = ("controlplane", "capacity", "translator", "placement", "enforcer")
JS = "$JS.API"

# The tenant-facing API: what a tenant calls (local subject) -> where it arrives in TESSERA.
TENANT_API_OPS = ("submit", "release", "get", "running")
TENANT_API = f"{subjects.API}.tenant"  # tessera.api.tenant.<tenant>.claims.<op>

# Buckets of the control-plane manager (tenant CA keys, datastore passwords): the manager's alone.
KV_CONTROLPLANES = topology_table.KV_CONTROLPLANES
KV_SECRETS = topology_table.KV_SECRETS


def tenant_api_subject(tenant: str, op: str) -> str:
    return f"{TENANT_API}.{subjects.token(tenant)}.claims.{op}"


def public_api_subject(op: str) -> str:
    return f"{subjects.API}.claims.{op}"


def tenant_account_name(tenant: str) -> str:
    return f"TENANT_{subjects.token(tenant)}"


TENANT_USER_PREFIX = "tenant-"


def tenant_user(tenant: str) -> str:
    return f"{TENANT_USER_PREFIX}{subjects.token(tenant)}"


def is_tenant_user(user: str | None) -> bool:
    """Whether ``user`` is a tenant's (its account holds none of the platform's buckets)."""
    return user is not None and user.startswith(TENANT_USER_PREFIX)


def inbox_prefix(user: str) -> str:
    return f"_INBOX_{subjects.token(user)}"


def user_for(service: str, node: str | None = None) -> str:
    """The NATS user of a service; each enforcer has its own (``enforcer-<node>``)."""
    if service == "enforcer" and node:
        return f"enforcer-{subjects.node_token(node)}"
    return service


@dataclass(frozen=True)
class Uses:
    """What one service does on the bus; everything else is refused by the server."""

    publish: tuple[str, ...] = ()  # core or JetStream publishes (the stream is inferred)
    subscribe: tuple[str, ...] = ()  # core subscriptions
    serves: tuple[str, ...] = ()  # request/reply subjects it answers
    consumes: tuple[str, ...] = ()  # streams it runs pull consumers on
    reads: tuple[str, ...] = ()  # KV buckets it reads (get, keys, watch)
    writes: dict[str, tuple[str, ...]] = field(default_factory=dict)  # bucket -> key patterns
    prunes: tuple[str, ...] = ()  # KV buckets whose ended records it removes (stream purge)

    def buckets(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.reads + tuple(self.writes)))

    def streams(self) -> tuple[str, ...]:
        """The streams this service publishes to or consumes (it creates them if missing)."""
        found = [stream_of(s) for s in self.publish] + list(self.consumes)
        return tuple(dict.fromkeys(s for s in found if s))


def topology(service: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(streams, buckets) a service creates at start-up; all of them for a tool (cli, bench)."""
    try:
        u = uses(service)
    except ValueError:
        return tuple(subjects.STREAMS), tuple(topology_table.declare(topology_table.TopologySettings()).buckets)
    return u.streams(), u.buckets()


def stream_of(subject: str) -> str | None:
    for stream, filt in subjects.STREAMS.items():
        if subject.startswith(filt[:-1]):
            return stream
    return None


def _claim_events(event: str) -> str:
    return subjects.claims_of_kind(event)


def uses(service: str, node: str | None = None) -> Uses:
    """The table: derived from `tessera.shared.subjects`, one entry per service."""
    dlq = (subjects.dlq(service),)
    if service == "controlplane":
        # Its answer to `tessera tenant create` comes after the server reloaded the tenants' accounts,
        # and a reload forgets which replies a connection may send (allow_responses): the
        # operator's inbox is allowed outright.
        # Deleting a tenant releases its claims first: it publishes their releases (the lifecycle's
        # route: to placement or to the claim's node) and reads the claims and the ledger until
        # nothing of the tenant is left. It writes neither.
        return Uses(
            publish=(f"{subjects.TENANTS}.>", f"{inbox_prefix(OPERATOR)}.>", _claim_events("release"), *dlq),
            serves=(f"{subjects.API_TENANTS}.*",),
            reads=(subjects.KV_TENANTS, KV_CONTROLPLANES, KV_SECRETS, subjects.KV_CLAIMS, subjects.KV_LEDGER),
            writes={subjects.KV_TENANTS: (">",), KV_CONTROLPLANES: (">",), KV_SECRETS: (">",)},
        )
    if service == "capacity":
        return Uses(
            publish=(f"{subjects.INVENTORY}.>", *dlq),
            subscribe=(f"{subjects.USAGE}.>", f"{subjects.INVENTORY}.>"),
            reads=(subjects.KV_INVENTORY,), writes={subjects.KV_INVENTORY: (">",)},
        )
    if service == "translator":
        return Uses(
            # (deallocated: kube-scheduler took a ResourceClaim's allocation back; placement places it again)
            publish=(_claim_events("requested"), _claim_events("release"), _claim_events("running"),
                     _claim_events("deallocated"), *dlq),
            serves=(subjects.API_SUBMIT, subjects.API_RELEASE, subjects.API_CLAIM_GET,
                    subjects.API_CLAIM_RUNNING, f"{TENANT_API}.*.claims.*"),
            consumes=(subjects.STREAM_CLAIMS,),  # reads a claim's last 'prepared' event for `get`
            reads=(subjects.KV_CLAIMS, subjects.KV_TENANTS), writes={subjects.KV_CLAIMS: (">",)},
            prunes=(subjects.KV_CLAIMS,),  # released claims past their retention (lifecycle.RECORD_PRUNER)
        )
    if service == "placement":
        return Uses(
            publish=(f"{subjects.CLAIMS}.>", *dlq), subscribe=(_claim_events("unschedulable"),),
            consumes=(subjects.STREAM_CLAIMS,),
            reads=(subjects.KV_INVENTORY, subjects.KV_LEDGER, subjects.KV_CLAIMS, subjects.KV_TENANTS),
            writes={subjects.KV_LEDGER: (">",), subjects.KV_CLAIMS: (">",)},
        )
    if service == "enforcer":
        mine = subjects.node_token(node) if node else subjects.ANY_NODE
        # Its own node's ledger key; the tenant usage keys (quota returned on release); and, because
        # a peer releases the claims of a lost node, the other nodes' ledger keys too (see
        # `ledger_keys_of_enforcer`). Never the tenants' or the manager's buckets.
        return Uses(
            # Its own node's events; 'released' of any node (a lost node's claims).
            publish=(f"{subjects.CLAIMS}.*.*.*.{mine}", _claim_events("released"), f"{subjects.USAGE}.{mine}", *dlq),
            consumes=(subjects.STREAM_CLAIMS,),
            reads=(subjects.KV_INVENTORY, subjects.KV_LEDGER, subjects.KV_CLAIMS),
            writes={subjects.KV_LEDGER: ledger_keys_of_enforcer(node), subjects.KV_CLAIMS: (">",)},
        )
    raise ValueError(f"no identity for service {service!r}: use one of {', '.join(SERVICES)}")


def ledger_keys_of_enforcer(node: str | None) -> tuple[str, ...]:
    """KV permissions match subjects, so a per-key write scope is expressible (``node.<node>``).
    A peer enforcer releases a lost node's claims from that node's ledger, so every node key is
    writable by every enforcer; tenant usage keys too (quota returned on release)."""
    return ("node.*", "tenant.*")


def _kv_read(bucket: str) -> list[str]:
    stream = f"KV_{bucket}"
    return [
        f"{JS}.STREAM.INFO.{stream}", f"{JS}.STREAM.MSG.GET.{stream}",
        f"{JS}.DIRECT.GET.{stream}", f"{JS}.DIRECT.GET.{stream}.>",
        *_consumer(stream),
    ]


def _consumer(stream: str) -> list[str]:
    return [
        f"{JS}.STREAM.INFO.{stream}",
        f"{JS}.CONSUMER.CREATE.{stream}", f"{JS}.CONSUMER.CREATE.{stream}.>",
        f"{JS}.CONSUMER.DURABLE.CREATE.{stream}.>", f"{JS}.CONSUMER.INFO.{stream}.>",
        f"{JS}.CONSUMER.DELETE.{stream}.>", f"{JS}.CONSUMER.MSG.NEXT.{stream}.>",
        f"{JS}.CONSUMER.LIST.{stream}", f"{JS}.CONSUMER.NAMES.{stream}",
        f"$JS.ACK.{stream}.>", f"$JS.FC.{stream}.>",
    ]


def _manage(stream: str) -> list[str]:
    return [f"{JS}.STREAM.CREATE.{stream}", f"{JS}.STREAM.UPDATE.{stream}", f"{JS}.STREAM.INFO.{stream}"]


def permissions(service: str, node: str | None = None) -> dict:
    """nats-server ``permissions`` of a service's user, from its `uses` entry."""
    u = uses(service, node)
    user = user_for(service, node)
    publish = [*u.publish, f"{JS}.INFO"]
    subscribe = [*u.subscribe, *u.serves, f"{inbox_prefix(user)}.>"]
    for stream in u.streams():
        publish += _manage(stream)
    for stream in u.consumes:
        publish += _consumer(stream)
        # The bus dead-letters what max_deliver gave up on from the server's advisory (bus.watch_exhausted).
        subscribe.append(f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.*")
        if stream == subjects.STREAM_CLAIMS:
            publish += [f"{JS}.STREAM.MSG.GET.{stream}", f"{JS}.DIRECT.GET.{stream}", f"{JS}.DIRECT.GET.{stream}.>"]
    for bucket in u.buckets():
        publish += _kv_read(bucket) + _manage(f"KV_{bucket}")
    for bucket, keys in u.writes.items():
        publish += [f"$KV.{bucket}.{k}" for k in keys]
    for bucket in u.prunes:
        publish.append(f"{JS}.STREAM.PURGE.KV_{bucket}")
    return {
        "publish": {"allow": sorted(set(publish))},
        "subscribe": {"allow": sorted(set(subscribe))},
        "allow_responses": True,
    }


def viewer_permissions() -> dict:
    """nats-server ``permissions`` of `VIEWER`: bucket reads and watches, ordered consumers on the
    streams it follows (usage for the fleet view, the dead letters for `tessera dlq list`), core
    subscriptions to the public event families. No publish to any event subject or KV key, and no
    ``STREAM.CREATE``/``UPDATE``: a reader never creates topology."""
    user = VIEWER
    publish = [f"{JS}.INFO"]
    for bucket in subjects.KV_BUCKETS:
        publish += _kv_read(bucket)
    for stream in (subjects.STREAM_USAGE, subjects.STREAM_DLQ):
        publish += _consumer(stream)
        publish += [f"{JS}.STREAM.MSG.GET.{stream}", f"{JS}.DIRECT.GET.{stream}", f"{JS}.DIRECT.GET.{stream}.>"]
    subscribe = [f"{family}.>" for family in (subjects.INVENTORY, subjects.CLAIMS, subjects.USAGE, subjects.TENANTS)]
    subscribe.append(f"{inbox_prefix(user)}.>")
    return {"publish": {"allow": sorted(set(publish))}, "subscribe": {"allow": sorted(set(subscribe))}}


def hash_password(password: str) -> str:
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=10)).decode()


def password_matches(password: str, hashed: str) -> bool:
    try:
        return bcrypt.checkpw(password.encode(), hashed.encode())
    except ValueError:
        return False


@dataclass(frozen=True)
class TenantLimits:
    """What one tenant account may consume: its flood stops here, not at the server's disk."""

    max_file: int = 256 * 1024 * 1024
    max_mem: int = 16 * 1024 * 1024
    max_streams: int = 4
    # kine replays each watch that resumes from a past revision (every watch of a kube-apiserver that
    # reconnects) through an ordered consumer of its own, which nats.go leaves to expire after five
    # minutes: one restart of kine makes dozens (31 measured, v1.36), and 32 left a restarted kine
    # unable to make its own watch ("maximum consumers limit reached").
    max_consumers: int = 256
    max_connections: int = 32
    max_payload: int = 256 * 1024


def tenant_account(tenant: str, password_hash: str, limits: TenantLimits = TenantLimits()) -> dict:
    """The account block of one tenant: its user, its limits, and its view of the platform."""
    imports = [
        {"service": {"account": PLATFORM_ACCOUNT, "subject": tenant_api_subject(tenant, op)},
         "to": public_api_subject(op)}
        for op in TENANT_API_OPS
    ]
    imports += [
        {"stream": {"account": PLATFORM_ACCOUNT, "subject": f"{subjects.CLAIMS}.{tenant}.>"}},
        {"stream": {"account": PLATFORM_ACCOUNT, "subject": f"{subjects.TENANTS}.{tenant}.>"}},
    ]
    return {
        "users": [{"user": tenant_user(tenant), "password": password_hash}],
        "jetstream": {"max_file": limits.max_file, "max_mem": limits.max_mem,
                      "max_streams": limits.max_streams, "max_consumers": limits.max_consumers},
        "limits": {"max_connections": limits.max_connections, "max_payload": limits.max_payload},
        "imports": imports,
    }


PLATFORM_EXPORTS = [
    # Public in the account sense, but only the platform writes imports: a tenant's config block
    # imports its own tenant's subjects and nothing else.
    {"service": f"{TENANT_API}.*.claims.*"},
    {"stream": f"{subjects.CLAIMS}.*.>"},
    {"stream": f"{subjects.TENANTS}.*.>"},
]


def platform_users(passwords: dict[str, str], nodes: Sequence[str] = ()) -> list[dict[str, Any]]:
    """User entries of account TESSERA. ``passwords``: user -> bcrypt hash (or plain, for tests);
    the operator gets the whole account; a service one entry per `user_for`."""
    users: list[dict[str, Any]] = [{"user": OPERATOR, "password": passwords[OPERATOR]}]
    if VIEWER in passwords:
        users.append({"user": VIEWER, "password": passwords[VIEWER], "permissions": viewer_permissions()})
    for service in SERVICES:
        if service == "enforcer" and nodes:
            for node in nodes:
                name = user_for(service, node)
                users.append({"user": name, "password": passwords[name], "permissions": permissions(service, node)})
        else:
            users.append({"user": service, "password": passwords[service], "permissions": permissions(service)})
    return users


def platform_user_names(nodes: Sequence[str] = ()) -> list[str]:
    names = [OPERATOR, VIEWER]
    for service in SERVICES:
        names += [user_for(service, n) for n in nodes] if service == "enforcer" and nodes else [service]
    return names


def server_config(users: list[dict], tenants_include: str, *, pid_file: str | None = None) -> str:
    """The nats-server config: account TESSERA with its users, and the tenants' accounts included
    from the file the control-plane manager rewrites (``tenants_include``, relative to this file
    or absolute). JSON is valid nats-server config syntax."""
    platform = {"jetstream": "enabled", "users": users, "exports": PLATFORM_EXPORTS}
    head = f'pid_file: "{pid_file}"\n' if pid_file else ""
    return (head + "accounts {\n  " + PLATFORM_ACCOUNT + ": " + json.dumps(platform, indent=1)
            + f'\n  include "{tenants_include}"\n}}\n')


def write_auth_dir(auth: Path, nodes: list[str], *, pid_file: str | None = None) -> dict[str, str]:
    """An authorization directory for one nats-server: ``nats.conf`` (bcrypt hashes), an empty
    ``tenants.conf`` for the manager to fill, and each platform user's password in
    ``passwords/<user>`` (0600; kept across calls). Returns user -> password. `make up` and the
    compose deployment (`tessera nats-auth`) both use it."""
    passwords_dir = auth / "passwords"
    passwords_dir.mkdir(parents=True, exist_ok=True)
    passwords: dict[str, str] = {}
    for name in platform_user_names(nodes) + ["enforcer"]:  # "enforcer": one without a node of its own
        file = passwords_dir / name
        if not file.exists():
            file.write_text(secrets.token_urlsafe(24))
            file.chmod(0o600)
        passwords[name] = file.read_text().strip()
    hashes = {n: hash_password(p) for n, p in passwords.items()}
    users = platform_users(hashes, nodes)
    if nodes:
        users.append({"user": "enforcer", "password": hashes["enforcer"], "permissions": permissions("enforcer")})
    tenants = auth / "tenants.conf"
    if not tenants.exists():  # the manager rewrites it once it has tenants
        tenants.write_text("")
        tenants.chmod(0o600)
    conf = auth / "nats.conf"
    conf.write_text(server_config(users, "tenants.conf", pid_file=pid_file))
    conf.chmod(0o600)
    return passwords


def operator_only_config(user: str, password: str, tenants_include: str, *, pid_file: str | None = None) -> str:
    """A server whose platform account has one unrestricted user (benches, the manager's tests)."""
    return server_config([{"user": user, "password": hash_password(password)}], tenants_include, pid_file=pid_file)


def password_env(user: str) -> str:
    """The environment variable a Kubernetes NATS pod holds ``user``'s password in (from the
    user's Secret), referenced unquoted from the config so the config itself holds no secret."""
    return "NATS_PW_" + user.upper().replace("-", "_")


def k8s_platform_account(operator: str = "tessera") -> str:
    """Account TESSERA as deploy/k8s/nats.yaml includes it: the operator, one user per service
    (one ``enforcer`` for the whole DaemonSet) and the read-only viewer (dashboards, the fleet view),
    passwords as environment references."""
    users: list[dict[str, Any]] = [{"user": operator, "password": f"${password_env(OPERATOR)}"}]
    users += [{"user": s, "password": f"${password_env(s)}", "permissions": permissions(s)} for s in SERVICES]
    users.append({"user": VIEWER, "password": f"${password_env(VIEWER)}", "permissions": viewer_permissions()})
    body = json.dumps({"jetstream": "enabled", "users": users, "exports": PLATFORM_EXPORTS}, indent=1)
    return f"{PLATFORM_ACCOUNT}: " + re.sub(r'"\$(NATS_PW_[A-Z_]+)"', r"$\1", body) + "\n"


def render_tenant_accounts(accounts: dict[str, dict]) -> str:
    """The included file: one ``TENANT_<t>: {...}`` line per tenant (also what `parse` reads)."""
    return "".join(f"{tenant_account_name(t)}: {json.dumps(accounts[t])}\n" for t in sorted(accounts))


def parse_tenant_accounts(text: str) -> dict[str, dict]:
    found: dict[str, dict] = {}
    for line in text.splitlines():
        name, sep, body = line.partition(": ")
        if sep and name.startswith("TENANT_"):
            found[name[len("TENANT_"):]] = json.loads(body)
    return found
