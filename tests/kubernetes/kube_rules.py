"""The validation kube-apiserver does beyond the OpenAPI schema, for the kinds Tessera writes.

The schema says a field is a string; the API server's Go validation says which strings (names are
DNS subdomains, label values at most 63 characters), which combinations (a container may claim
only a ResourceClaim its pod lists, a ResourceSlice names exactly one node selection) and which
changes (scheduling gates only come off, a claim's spec and allocation never change). These are
the rules a wrong webhook patch, template or status write would break on a real cluster; each
error is (field path, message) in the server's wording.
"""

from __future__ import annotations

import re

Errors = list[tuple[str, str]]

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS_LABEL = re.compile(rf"^{_LABEL}$")
DNS_SUBDOMAIN = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
INTEGER = re.compile(r"^[0-9]+$")
# Kinds whose names must be DNS labels rather than subdomains.
LABEL_NAMED = {"Namespace", "Service"}
POD_MUTABLE = ("activeDeadlineSeconds", "terminationGracePeriodSeconds", "tolerations", "schedulingGates")


def errors(kind: str, obj: dict, old: dict | None) -> Errors:
    out = metadata_errors(kind, obj.get("metadata") or {})
    check = {"Pod": pod_errors, "ResourceClaim": claim_errors, "ResourceSlice": slice_errors,
             "Event": event_errors}.get(kind)
    if check is not None:
        out += check(obj, old)
    return out


def metadata_errors(kind: str, meta: dict) -> Errors:
    out: Errors = []
    name = meta.get("name", "")
    pattern, limit, what = ((DNS_LABEL, 63, "RFC 1123 label") if kind in LABEL_NAMED
                            else (DNS_SUBDOMAIN, 253, "RFC 1123 subdomain"))
    if kind not in ("ClusterRole", "Role", "ClusterRoleBinding", "RoleBinding") and name and (
            len(name) > limit or not pattern.match(name)):
        out.append(("metadata.name", f'Invalid value: "{name}": a lowercase {what} must consist of lower case '
                                     f"alphanumeric characters, '-' or '.', and must start and end with an "
                                     f"alphanumeric character"))
    for key, value in (meta.get("labels") or {}).items():
        if not qualified_name(key):
            out.append(("metadata.labels", f'Invalid value: "{key}": name part must consist of alphanumeric '
                                            f"characters, '-', '_' or '.', and must start and end with an "
                                            f"alphanumeric character (at most 63, with an optional DNS prefix)"))
        if len(str(value)) > 63 or not LABEL_VALUE.match(str(value)):
            out.append(("metadata.labels", f'Invalid value: "{value}": a valid label must be an empty string or '
                                            f"consist of alphanumeric characters, '-', '_' or '.', and must "
                                            f"start and end with an alphanumeric character (at most 63)"))
    for key in (meta.get("annotations") or {}):
        if not qualified_name(key.lower()):
            out.append(("metadata.annotations", f'Invalid value: "{key}": not a qualified name'))
    return out


def qualified_name(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not DNS_SUBDOMAIN.match(prefix)):
        return False
    return 0 < len(name) <= 63 and bool(QUALIFIED_NAME.match(name))


def _extended(resource: str) -> bool:
    """A resource outside the kubernetes.io domain (nvidia.com/gpu, HAMi's nvidia.com/gpumem)."""
    domain = resource.partition("/")[0] if "/" in resource else ""
    return bool(domain) and domain != "kubernetes.io" and not domain.endswith(".kubernetes.io")


def pod_errors(pod: dict, old: dict | None) -> Errors:
    spec = pod.get("spec") or {}
    out = _pod_claims_errors(spec) + _extended_resource_errors(spec)
    gates = [g.get("name") for g in spec.get("schedulingGates") or []]
    if old is None:
        if gates and spec.get("nodeName"):
            out.append(("spec.nodeName", "Forbidden: cannot be set until all schedulingGates have been cleared"))
        return out
    old_spec = old.get("spec") or {}
    old_gates = {g.get("name") for g in old_spec.get("schedulingGates") or []}
    new_gates = [g for g in gates if g not in old_gates]
    if new_gates:
        out.append(("spec.schedulingGates", f"Forbidden: only deletion is allowed, but found new scheduling gate "
                                            f"'{new_gates[0]}'"))
    elif _frozen(spec) != _frozen(old_spec):
        out.append(("spec", "Forbidden: pod updates may not change fields other than `spec.containers[*].image`, "
                            "`spec.initContainers[*].image`, `spec.activeDeadlineSeconds`, `spec.tolerations` "
                            "(only additions to existing tolerations), `spec.terminationGracePeriodSeconds` (allow "
                            "it to be set to 1 if it was previously negative), `spec.schedulingGates` (only "
                            "deletion)"))
    return out


def _frozen(spec: dict) -> dict:
    """The part of a pod spec no update may change."""
    spec = {k: v for k, v in spec.items() if k not in POD_MUTABLE}
    for field in ("containers", "initContainers"):
        if field in spec:
            spec[field] = [{k: v for k, v in c.items() if k != "image"} for c in spec[field]]
    return spec


def _pod_claims_errors(spec: dict) -> Errors:
    out: Errors = []
    names = []
    for i, ref in enumerate(spec.get("resourceClaims") or []):
        sources = [k for k in ("resourceClaimName", "resourceClaimTemplateName") if ref.get(k)]
        if len(sources) != 1:
            out.append((f"spec.resourceClaims[{i}]", "Invalid value: must specify one of: `resourceClaimName`, "
                                                     "`resourceClaimTemplateName`"))
        if ref.get("name") in names:
            out.append((f"spec.resourceClaims[{i}].name", f'Duplicate value: "{ref.get("name")}"'))
        names.append(ref.get("name"))
    for field in ("initContainers", "containers"):
        for i, container in enumerate(spec.get(field) or []):
            for j, claim in enumerate((container.get("resources") or {}).get("claims") or []):
                if claim.get("name") not in names:
                    out.append((f"spec.{field}[{i}].resources.claims[{j}].name",
                                f'Unsupported value: "{claim.get("name")}": must be one of the names in '
                                f"pod.spec.resourceClaims"))
    return out


def _extended_resource_errors(spec: dict) -> Errors:
    out: Errors = []
    for field in ("initContainers", "containers"):
        for i, container in enumerate(spec.get(field) or []):
            resources = container.get("resources") or {}
            limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
            where = f"spec.{field}[{i}].resources"
            for kind, values in (("limits", limits), ("requests", requests)):
                for name, value in values.items():
                    if _extended(name) and not INTEGER.match(str(value)):
                        out.append((f"{where}.{kind}[{name}]", f'Invalid value: "{value}": must be an integer'))
            for name, value in requests.items():
                if not _extended(name):
                    continue
                if name not in limits:
                    out.append((f"{where}.limits", f'Required value: Limit must be set for non overcommitable '
                                                   f'resources: "{name}"'))
                elif str(limits[name]) != str(value):
                    out.append((f"{where}.requests[{name}]", f'Invalid value: "{value}": must be equal to {name} '
                                                             f"limit of {limits[name]}"))
    return out


def claim_errors(claim: dict, old: dict | None) -> Errors:
    out: Errors = []
    if old is not None and claim.get("spec") != old.get("spec"):
        out.append(("spec", "Invalid value: field is immutable"))
    status = claim.get("status") or {}
    allocation = status.get("allocation")
    old_allocation = ((old or {}).get("status") or {}).get("allocation")
    if allocation is not None and old_allocation is not None and allocation != old_allocation:
        out.append(("status.allocation", "Invalid value: field is immutable"))
    if status.get("reservedFor") and allocation is None:
        out.append(("status.reservedFor", "Forbidden: may not be specified when `allocated` is not set"))
    requests = {r.get("name") for r in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []}
    for i, result in enumerate(((allocation or {}).get("devices") or {}).get("results") or []):
        where = f"status.allocation.devices.results[{i}]"
        if str(result.get("request", "")).split("/")[0] not in requests:
            out.append((f"{where}.request", f"Invalid value: \"{result.get('request')}\": must be the name of a "
                                            f"request in the claim"))
        if not DNS_LABEL.match(str(result.get("device", ""))) or len(str(result.get("device", ""))) > 63:
            out.append((f"{where}.device", f"Invalid value: \"{result.get('device')}\": a lowercase RFC 1123 label "
                                           f"is required"))
    return out


def slice_errors(resource_slice: dict, old: dict | None) -> Errors:
    spec = resource_slice.get("spec") or {}
    out: Errors = []
    if not spec.get("sharedCounters"):
        chosen = [k for k in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection") if spec.get(k)]
        if len(chosen) != 1:
            out.append(("spec", "Invalid value: exactly one of `nodeName`, `nodeSelector`, `allNodes`, "
                                f"`perDeviceNodeSelection` is required, found {chosen or 'none'}"))
    if old is not None and (old.get("spec") or {}).get("nodeName") != spec.get("nodeName"):
        out.append(("spec.nodeName", "Invalid value: field is immutable"))
    seen = set()
    for i, device in enumerate(spec.get("devices") or []):
        name = str(device.get("name", ""))
        if not DNS_LABEL.match(name) or len(name) > 63:
            out.append((f"spec.devices[{i}].name", f'Invalid value: "{name}": a lowercase RFC 1123 label is '
                                                   f"required"))
        if name in seen:
            out.append((f"spec.devices[{i}].name", f'Duplicate value: "{name}"'))
        seen.add(name)
    return out


def event_errors(event: dict, old: dict | None) -> Errors:
    if event.get("apiVersion") != "events.k8s.io/v1":
        if event.get("type") not in (None, "", "Normal", "Warning"):
            return [("type", f'Unsupported value: "{event.get("type")}": supported values: "Normal", "Warning"')]
        return []
    out: Errors = []
    for field in ("reportingController", "reportingInstance", "action", "reason"):
        if not event.get(field):
            out.append((field, "Required value"))
    if event.get("type") not in ("Normal", "Warning"):
        out.append(("type", f'Unsupported value: "{event.get("type")}": supported values: "Normal", "Warning"'))
    return out
