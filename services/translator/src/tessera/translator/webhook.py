"""The Kubernetes face of the translator: a mutating admission webhook (AdmissionReview v1).

Pods written for HAMi keep their ``nvidia.com/*`` resources and annotations. At admission the
webhook validates each GPU container with ``hami.translate`` and, instead of leaving extended
resources for a device plugin, rewrites the pod for DRA: the ``nvidia.com/*`` entries leave the
containers, one ``spec.resourceClaims`` entry points at the pod's one ResourceClaimTemplate (named
after its containers and the claim's content), each GPU container claims it, the pod gets the
scheduling gate ``gpu.tessera.dev/placement`` (placement lifts it once it has allocated the claim,
so kube-scheduler never binds the pod before Tessera chose its GPUs), and the translated claims are
recorded in an annotation for people to read. One claim per pod, so that all of a pod's GPUs are
placed together on one node or not at all: a pod with one GPU container gets a claim of one request
(``gpu``), one with several a request per GPU container, named after it, and each container's
``resources.claims`` entry names its own request, so the kubelet gives it that request's GPUs and
limits only. Bad values are denied with the container and field named, which is
the whole point: HAMi admits them and then drops, clamps or strands them. A pod whose namespace
names no tenant is denied saying which label to set.

The templates are created, and the namespace's tenant is checked, by whoever passes
``translate_hook`` and ``tenant_check`` (the service, which holds the Kubernetes client); this
module only speaks HTTP and JSON, so it is tested with real AdmissionReview documents and no cluster.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import msgspec
from aiohttp import web

from tessera.shared.events import MAX_PRIORITY, ClaimSpec, RequestSpec
from tessera.shared.kubeclaims import SCHEDULING_GATE

from . import dra, hami

log = logging.getLogger(__name__)

CLAIMS_ANNOTATION = "gpu.tessera.dev/claims"
TEMPLATE_PREFIX = "tessera-"
MAX_BODY = 4 * 1024 * 1024  # an AdmissionReview of a Pod near etcd's 1.5 MiB object limit, twice over
_NAME_MAX = 63  # DNS-1123 label: PodResourceClaim.name
_REQUEST_FIELDS = tuple(f for f in RequestSpec.__struct_fields__ if f != "name")


@dataclass(frozen=True)
class ContainerRequest:
    """One GPU container's part of the pod's claim."""

    container: str
    index: int
    spec: ClaimSpec  # what the container alone asks for (hami.translate)
    request: str | None  # the request its resources.claims entry names; None: the claim has one


@dataclass(frozen=True)
class PodClaim:
    """The pod's one translated claim, and the template the patched pod points at."""

    namespace: str
    pod: str  # may be empty when the pod uses generateName
    spec: ClaimSpec  # the whole claim: one request per GPU container where there are several
    template_name: str
    template: dict  # the ResourceClaimTemplate document (dra.resource_claim_template)
    containers: tuple[ContainerRequest, ...]

    @property
    def container(self) -> str:
        """The GPU container of a pod that has one (the first, where there are several)."""
        return self.containers[0].container

    @property
    def index(self) -> int:
        return self.containers[0].index


# Called once per admitted pod with GPU containers, with the pod's namespace (the AdmissionReview's
# request.namespace), before the response is sent, unless the request is a dry run. Create the
# ResourceClaimTemplates there; an exception denies the pod.
TranslateHook = Callable[[str, list[PodClaim]], Awaitable[None]]

# Called with the namespace of a pod that asks for GPUs, before the templates are created: None if
# its pods may have Tessera GPUs, else the reason they may not (the denial message). An exception
# (the API server or NATS unreachable) denies the pod as unavailable, to be retried.
TenantCheck = Callable[[str], Awaitable[str | None]]


Present = dict[int, dict[str, set[str]]]  # container index -> "limits"/"requests" -> HAMi names


class Malformed(Exception):
    """The AdmissionReview itself is unusable: answered with HTTP 400."""


def _escape(segment: str) -> str:
    """RFC 6901: '~' becomes '~0' and '/' becomes '~1', in that order."""
    return segment.replace("~", "~0").replace("/", "~1")


def template_name(container: str, spec: ClaimSpec) -> str:
    """Deterministic: same container name(s) and same claim give the same template (retries, replicas)."""
    digest = hashlib.sha256(msgspec.json.encode(spec)).hexdigest()[:10]
    head = f"{TEMPLATE_PREFIX}{container}"[: _NAME_MAX - len(digest) - 1].rstrip("-")
    return f"{head}-{digest}"


def _merged(resources: Mapping, where: str) -> dict[str, object]:
    """HAMi's view of a container: each name from limits, else from requests."""
    limits = resources.get("limits") or {}
    requests = resources.get("requests") or {}
    if not isinstance(limits, dict) or not isinstance(requests, dict):
        raise Malformed(f"{where}: resources.limits and resources.requests must be objects")
    merged = {**requests, **limits}
    for name in hami.RESOURCE_NAMES:
        if name in limits and name in requests and str(limits[name]) != str(requests[name]):
            raise hami.TranslationError(
                f'resources.requests["{name}"]',
                requests[name],
                f"differs from limits ({limits[name]!r}); Kubernetes requires requests and limits of "
                f"an extended resource to be equal. Set only limits",
                where=where,
            )
    return merged


def _patch_for(pod: dict, claims: list[PodClaim], present: Present) -> list:
    ops: list[dict] = []
    containers = pod["spec"]["containers"]
    for claim in claims:
        for part in claim.containers:
            i = part.index
            base = f"/spec/containers/{i}/resources"
            for section, names in present[i].items():
                for name in sorted(names):
                    ops.append({"op": "remove", "path": f"{base}/{section}/{_escape(name)}"})
            entry = {"name": claim.template_name}
            if part.request is not None:
                entry["request"] = part.request
            if containers[i].get("resources", {}).get("claims"):
                ops.append({"op": "add", "path": f"{base}/claims/-", "value": entry})
            else:
                ops.append({"op": "add", "path": f"{base}/claims", "value": [entry]})
    gates = pod["spec"].get("schedulingGates") or []
    if not any(isinstance(g, dict) and g.get("name") == SCHEDULING_GATE for g in gates):
        gate = {"name": SCHEDULING_GATE}
        if gates:
            ops.append({"op": "add", "path": "/spec/schedulingGates/-", "value": gate})
        else:
            ops.append({"op": "add", "path": "/spec/schedulingGates", "value": [gate]})
    pod_claims = [
        {"name": c.template_name, "resourceClaimTemplateName": c.template_name} for c in claims
    ]
    if pod["spec"].get("resourceClaims"):
        ops.extend({"op": "add", "path": "/spec/resourceClaims/-", "value": c} for c in pod_claims)
    else:
        ops.append({"op": "add", "path": "/spec/resourceClaims", "value": pod_claims})
    record = json.dumps(
        {p.container: msgspec.to_builtins(p.spec) for c in claims for p in c.containers},
        sort_keys=True, separators=(",", ":"),
    )
    metadata = pod.get("metadata") or {}
    if "metadata" not in pod:
        value = {"annotations": {CLAIMS_ANNOTATION: record}}
        ops.append({"op": "add", "path": "/metadata", "value": value})
    elif isinstance(metadata.get("annotations"), dict):
        path = f"/metadata/annotations/{_escape(CLAIMS_ANNOTATION)}"
        ops.append({"op": "add", "path": path, "value": record})
    else:
        ops.append({"op": "add", "path": "/metadata/annotations", "value": {CLAIMS_ANNOTATION: record}})
    return ops


def _translate_pod(pod: dict, namespace: str) -> tuple[list[PodClaim], Present]:
    spec = pod.get("spec")
    if not isinstance(spec, dict) or not isinstance(spec.get("containers"), list):
        raise Malformed("request.object is not a Pod: spec.containers is missing")
    metadata = pod.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise Malformed("request.object.metadata must be an object")
    annotations = metadata.get("annotations") or {}
    if not isinstance(annotations, dict):
        raise Malformed("request.object.metadata.annotations must be an object")
    pod_name = metadata.get("name") or ""

    for j, init in enumerate(spec.get("initContainers") or []):
        if not isinstance(init, dict):
            raise Malformed(f"spec.initContainers[{j}] must be an object")
        resources = init.get("resources") or {}
        merged = _merged(resources, f'init container "{init.get("name", j)}"')
        if hami.is_gpu_request(merged):
            raise hami.TranslationError(
                f"spec.initContainers[{j}].resources",
                None,
                "HAMi GPU resources in init containers are not supported (HAMi ignores them too); "
                "move the GPU work to a regular container",
                where=f'init container "{init.get("name", j)}"',
            )

    parts: list[tuple[str, int, ClaimSpec]] = []
    present: Present = {}
    for i, container in enumerate(spec["containers"]):
        if not isinstance(container, dict):
            raise Malformed(f"spec.containers[{i}] must be an object")
        name = str(container.get("name") or i)
        where = f'container "{name}" (spec.containers[{i}])'
        resources = container.get("resources") or {}
        if not isinstance(resources, dict):
            raise Malformed(f"{where}: resources must be an object")
        merged = _merged(resources, where)
        if not hami.is_gpu_request(merged):
            continue
        parts.append((name, i, hami.translate(merged, annotations, where=where)))
        present[i] = {
            section: {n for n in (resources.get(section) or {}) if n in hami.RESOURCE_NAMES}
            for section in ("limits", "requests")
        }
        present[i] = {k: v for k, v in present[i].items() if v}
    if not parts:
        return [], present
    claim = msgspec.structs.replace(pod_spec(parts), priority=scheduling_priority(spec), may_preempt=may_preempt(spec))
    tname = template_name("-".join(name for name, _, _ in parts), claim)
    several = len(parts) > 1
    pod_claim = PodClaim(
        namespace=namespace,
        pod=pod_name,
        spec=claim,
        template_name=tname,
        template=dra.resource_claim_template(
            claim, tname, namespace or None, labels={"app.kubernetes.io/managed-by": "tessera-translator"}
        ),
        containers=tuple(ContainerRequest(container=name, index=i, spec=part, request=name if several else None)
                         for name, i, part in parts),
    )
    return [pod_claim], present


def pod_spec(parts: list[tuple[str, int, ClaimSpec]]) -> ClaimSpec:
    """The pod's one claim from its GPU containers' (name, index, translated claim): a container's
    claim itself where there is one; else one request per container, named after it (a container
    name is a DNS label, as a request name must be), with the pod's annotations' policies and the
    highest runtime priority (HAMi's, 0 = high) any of its containers sets."""
    if len(parts) == 1:
        return parts[0][2]
    first = parts[0][2]
    requests = [RequestSpec(name=name, **{f: getattr(part, f) for f in _REQUEST_FIELDS}) for name, _, part in parts]
    set_ = [part.task_priority for _, _, part in parts if part.task_priority is not None]
    return msgspec.structs.replace(first, task_priority=min(set_) if set_ else None, requests=requests)


def scheduling_priority(spec: dict) -> int:
    """The claim's scheduling priority: the pod's ``spec.priority``, which the API server's
    Priority admission (before any webhook) fills from ``priorityClassName`` or the global default
    class; a negative one (a class for work that yields to everything) counts as 0, the lowest."""
    priority = spec.get("priority", 0)
    if priority is None:
        return 0
    if isinstance(priority, bool) or not isinstance(priority, int) or not -(2**31) <= priority <= MAX_PRIORITY:
        raise Malformed(f"spec.priority must be a 32-bit integer, got {priority!r}")
    return max(0, priority)


PREEMPTION_POLICIES = {"PreemptLowerPriority": True, "Never": False}


def may_preempt(spec: dict) -> bool:
    """Whether the claim may preempt: the pod's ``spec.preemptionPolicy``, which the Priority
    admission copies from its PriorityClass (``Never``: it waits, whatever its priority)."""
    policy = spec.get("preemptionPolicy")
    if policy is None:
        return True
    if policy not in PREEMPTION_POLICIES:
        raise Malformed(f"spec.preemptionPolicy must be one of {', '.join(PREEMPTION_POLICIES)}, got {policy!r}")
    return PREEMPTION_POLICIES[policy]


def _review(uid: str, response: dict) -> web.Response:
    return web.json_response(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": {"uid": uid, **response},
        }
    )


def _deny(uid: str, message: str, code: int = 422, reason: str = "Invalid") -> web.Response:
    status = {"code": code, "reason": reason, "message": message}
    return _review(uid, {"allowed": False, "status": status})


def _parse_review(body: bytes) -> dict:
    try:
        review = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Malformed(f"body is not JSON: {exc}") from None
    if not isinstance(review, dict):
        raise Malformed("body must be a JSON object (an AdmissionReview)")
    if review.get("apiVersion") != "admission.k8s.io/v1" or review.get("kind") != "AdmissionReview":
        raise Malformed(
            "expected apiVersion admission.k8s.io/v1 and kind AdmissionReview, got "
            f"{review.get('apiVersion')!r} / {review.get('kind')!r}"
        )
    request = review.get("request")
    if not isinstance(request, dict):
        raise Malformed("AdmissionReview.request is missing")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise Malformed("AdmissionReview.request.uid is missing")
    return request


def make_app(
    translate_hook: TranslateHook | None = None, tenant_check: TenantCheck | None = None,
    on_outcome: Callable[[str], None] = lambda outcome: None,
) -> web.Application:
    """The webhook as an aiohttp application: ``POST /mutate``. ``on_outcome`` hears what became of
    each GPU pod: translated, rejected or unavailable (the metrics count them)."""

    async def mutate(http: web.Request) -> web.Response:
        try:
            request = _parse_review(await http.read())
        except Malformed as exc:
            return web.Response(status=400, text=f"malformed AdmissionReview: {exc}\n")
        try:
            return await admit(request)
        except Exception as exc:  # a bug must answer the review, not surface as an opaque 500
            log.exception("webhook failed on %s", request["uid"])
            message = f"internal error in the Tessera webhook: {exc!r}"
            return _deny(request["uid"], message, 500, "InternalError")

    async def admit(request: dict) -> web.Response:
        uid = request["uid"]
        kind = request.get("kind") or {}
        obj = request.get("object")
        if (
            not isinstance(kind, dict)
            or kind.get("kind") != "Pod"
            or kind.get("group", "") != ""
            or request.get("operation") != "CREATE"
            or request.get("subResource")
        ):
            return _review(uid, {"allowed": True})  # not a pod creation: nothing to translate
        if not isinstance(obj, dict):
            text = "malformed AdmissionReview: request.object must be a Pod\n"
            return web.Response(status=400, text=text)
        # The pod's namespace is the request's: a pod being created may not carry metadata.namespace.
        namespace = request.get("namespace") or (obj.get("metadata") or {}).get("namespace") or ""
        try:
            claims, present = _translate_pod(obj, namespace)
        except Malformed as exc:
            return web.Response(status=400, text=f"malformed AdmissionReview: {exc}\n")
        except hami.TranslationError as exc:
            on_outcome("rejected")
            return _deny(uid, str(exc))
        if not claims:
            return _review(uid, {"allowed": True})
        if not namespace:
            text = "malformed AdmissionReview: request.namespace is missing for a Pod\n"
            return web.Response(status=400, text=text)
        try:
            problem = await tenant_check(namespace) if tenant_check is not None else None
            if problem is None and translate_hook is not None and not request.get("dryRun"):
                await translate_hook(namespace, claims)
        except Exception as exc:  # the hooks talk to Kubernetes and NATS; a failure denies, never 500s
            log.exception("admission of a GPU pod in %s failed (review %s)", namespace, uid)
            on_outcome("unavailable")
            return _deny(
                uid,
                f"could not prepare the GPU claims ({exc.__class__.__name__}: {exc}); retry",
                code=503,
                reason="ServiceUnavailable",
            )
        if problem is not None:
            log.info("GPU pod in %s denied: %s", namespace, problem)
            on_outcome("rejected")
            return _deny(uid, problem, code=403, reason="Forbidden")
        patch = _patch_for(obj, claims, present)
        on_outcome("translated")
        return _review(
            uid,
            {
                "allowed": True,
                "patchType": "JSONPatch",
                "patch": base64.b64encode(json.dumps(patch).encode()).decode(),
            },
        )

    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_post("/mutate", mutate)
    return app
