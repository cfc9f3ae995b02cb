"""What a service asked of the emulated API server, as RBAC names it, against its ClusterRole: a
ClusterRole that lacks a verb the code uses fails on a cluster, and one that grants more than the
code uses grants it for nothing."""

from __future__ import annotations

from apiserver import ApiServer


def request_rule(method: str, path: str, query: dict) -> tuple[str, str, str] | None:
    """(apiGroup, resource[/subresource], verb) of one request; None for discovery and health."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) > 2:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) > 3:
        group, rest = parts[1], parts[3:]
    else:
        return None
    plural, _, name, sub = ApiServer._parse(rest)
    resource = f"{plural}/{sub}" if sub else plural
    if method == "GET":
        verb = "get" if name else "watch" if query.get("watch") in ("true", "1") else "list"
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}[method]
    return group, resource, verb


def granted(cluster_role: dict) -> set[tuple[str, str, str]]:
    return {(group, resource, verb) for rule in cluster_role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def check(requests: list[tuple[str, str, dict]], cluster_role: dict,
          elsewhere: frozenset[tuple[str, str, str]] = frozenset()) -> None:
    """Every request is granted; every grant was used (``create`` counts as used by a server-side
    apply, which creates the object it does not find), except the grants in ``elsewhere``: those
    a test on the real API server exercises, for a case the emulator cannot produce."""
    used = {r for r in (request_rule(*req) for req in requests) if r is not None}
    applied = {(g, r, "create") for g, r, v in used if v == "patch"}
    rules = granted(cluster_role)
    assert used <= rules, f"called without a grant: {sorted(used - rules)}"
    assert rules <= used | applied | elsewhere, f"granted but never called: {sorted(rules - used - applied - elsewhere)}"


def audited_rules(events: list[dict], username: str) -> list[tuple[str, str, str]]:
    """(apiGroup, resource[/subresource], verb) of each request of ``username`` in an API server's
    audit log (`KubeControlPlane.audit`), the refusals of a warming-up server (401/403) left out."""
    out = []
    for e in events:
        ref = e.get("objectRef") or {}
        if e["user"]["username"] != username or not ref.get("resource") or e["responseStatus"]["code"] in (401, 403):
            continue
        resource = f"{ref['resource']}/{ref['subresource']}" if ref.get("subresource") else ref["resource"]
        out.append((ref.get("apiGroup", ""), resource, e["verb"]))
    return out


def check_audited(events: list[dict], username: str, cluster_role: dict,
                  elsewhere: frozenset[tuple[str, str, str]] = frozenset()) -> None:
    """`check` on what the real API server recorded of ``username``: every grant of ``cluster_role``
    used (the server itself refused anything not granted)."""
    used = set(audited_rules(events, username))
    applied = {(g, r, "create") for g, r, v in used if v == "patch"}
    rules = granted(cluster_role)
    assert used <= rules, f"called without a grant: {sorted(used - rules)}"
    assert rules <= used | applied | elsewhere, f"granted but never called: {sorted(rules - used - applied - elsewhere)}"
