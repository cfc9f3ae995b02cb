"""A kube-apiserver emulator for the Kubernetes tests: the semantics our services rely on, strictly.

No kube-apiserver binary can run here, and kmock's KubernetesEmulator (0.8) is a store keyed by
path: no resourceVersion, no status subresource, no validation, and its path parser reads
``/api/v1/namespaces`` as a namespace prefix. Subclassing it would mean overriding its routing,
storage and watch all at once, so this is an aiohttp server of our own that keeps the REST
contract of a real one: uid/creationTimestamp/resourceVersion (one global counter)/generation,
optimistic concurrency, status subresources, the four patch types, list and watch with selectors
and a bounded watch history (410 Gone past it), finalizers, owner-reference garbage collection,
the Pod rules around scheduling gates and binding, CRDs that install their custom resources, and
strict schema validation of every object written (``kube_schemas``). Whatever a test plays
(resourceclaim controller, kube-scheduler, kubelet) goes through the same checks via the helpers.

Fidelity accepted here that a real cluster splits across other processes: the garbage collector
and the namespace controller (kube-controller-manager) run synchronously inside the delete.
Known differences are listed in ``NOT_MODELLED``.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import datetime
import json
import random
import re
import uuid
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

import kube_patches
import kube_rules
import kube_schemas
from kube_admission import MutatingAdmission, Refused, compile_errors
from kube_selectors import SelectorError, dotted, field_selector, label_selector

NOT_MODELLED = """
- authentication, authorization (RBAC objects are stored, never enforced), API priority and fairness
- defaulting of built-in kinds (no imagePullPolicy, restartPolicy, ... filled in); CRD defaults are applied
- field ownership in server-side apply (no managedFields, never an apply conflict: force is implied)
- strategic merge patch keyed by field name, not by the Go types' patch tags (see kube_patches)
- unknown fields are 422 Invalid here; a real server with fieldValidation=Strict answers 400
- list pagination (limit/continue), resourceVersionMatch, consistent reads at a resourceVersion
- watch bookmarks, sendInitialEvents, protobuf, Table output, /openapi, aggregated discovery
- pod lifecycle (no kubelet: phase stays Pending unless a test writes status), graceful deletion
- controllers other than the garbage collector and the namespace finalizer
- ValidatingAdmissionPolicy and validating webhooks; CEL x-kubernetes-validations of CRDs
- mutating webhooks: no reinvocation, no calls for DELETE/CONNECT/pods/binding (see kube_admission)
"""

CORE_FIELDS = frozenset({"metadata.name", "metadata.namespace"})


@dataclasses.dataclass(frozen=True)
class CustomKind:
    """What a CRD version defines beyond the names: its schema and its ``kubectl get`` columns."""

    validator: Any
    schema: dict
    columns: tuple[dict, ...]


@dataclasses.dataclass(frozen=True)
class Resource:
    api_version: str
    plural: str
    kind: str
    namespaced: bool
    status: bool = False
    fields: frozenset[str] = CORE_FIELDS
    short_names: tuple[str, ...] = ()
    custom: "CustomKind | None" = dataclasses.field(default=None, compare=False, hash=False)

    @property
    def key(self) -> tuple[str, str]:
        return self.api_version, self.plural

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]

    @property
    def qualified(self) -> str:
        """``pods`` / ``resourceclaims.resource.k8s.io``, as API errors name a resource."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def qualified_kind(self) -> str:
        return f"{self.kind}.{self.group}" if self.group else self.kind


def _r(api_version, plural, kind, namespaced=True, status=False, fields=(), short=()):
    return Resource(api_version, plural, kind, namespaced, status, CORE_FIELDS | frozenset(fields), tuple(short))


_EVENT_FIELDS = ("involvedObject.kind", "involvedObject.namespace", "involvedObject.name", "involvedObject.uid",
                 "involvedObject.apiVersion", "involvedObject.resourceVersion", "involvedObject.fieldPath",
                 "reason", "reportingComponent", "source", "type")
BUILTIN = [
    _r("v1", "namespaces", "Namespace", False, True, ("status.phase",), ("ns",)),
    _r("v1", "pods", "Pod", True, True, ("spec.nodeName", "spec.restartPolicy", "spec.schedulerName",
                                        "spec.serviceAccountName", "status.phase", "status.podIP",
                                        "status.nominatedNodeName"), ("po",)),
    _r("v1", "events", "Event", fields=_EVENT_FIELDS, short=("ev",)),
    _r("v1", "secrets", "Secret", fields=("type",)),
    _r("v1", "configmaps", "ConfigMap", short=("cm",)),
    _r("v1", "services", "Service", True, True, short=("svc",)),
    _r("v1", "serviceaccounts", "ServiceAccount", short=("sa",)),
    _r("v1", "nodes", "Node", False, True, ("spec.unschedulable",), ("no",)),
    _r("events.k8s.io/v1", "events", "Event", fields=("regarding.kind", "regarding.namespace", "regarding.name",
                                                       "regarding.uid", "reason", "reportingController", "type"),
       short=("ev",)),
    _r("resource.k8s.io/v1", "resourceclaims", "ResourceClaim", True, True),
    _r("resource.k8s.io/v1", "resourceclaimtemplates", "ResourceClaimTemplate"),
    _r("resource.k8s.io/v1", "resourceslices", "ResourceSlice", False, False, ("spec.nodeName", "spec.driver")),
    _r("resource.k8s.io/v1", "deviceclasses", "DeviceClass", False),
    _r("apps/v1", "deployments", "Deployment", True, True, short=("deploy",)),
    _r("apps/v1", "statefulsets", "StatefulSet", True, True, short=("sts",)),
    _r("apps/v1", "daemonsets", "DaemonSet", True, True, short=("ds",)),
    _r("apps/v1", "replicasets", "ReplicaSet", True, True, short=("rs",)),
    _r("networking.k8s.io/v1", "networkpolicies", "NetworkPolicy", short=("netpol",)),
    _r("rbac.authorization.k8s.io/v1", "roles", "Role"),
    _r("rbac.authorization.k8s.io/v1", "rolebindings", "RoleBinding"),
    _r("rbac.authorization.k8s.io/v1", "clusterroles", "ClusterRole", False),
    _r("rbac.authorization.k8s.io/v1", "clusterrolebindings", "ClusterRoleBinding", False),
    _r("admissionregistration.k8s.io/v1", "mutatingwebhookconfigurations", "MutatingWebhookConfiguration", False),
    _r("admissionregistration.k8s.io/v1", "validatingwebhookconfigurations", "ValidatingWebhookConfiguration",
       False),
    _r("apiextensions.k8s.io/v1", "customresourcedefinitions", "CustomResourceDefinition", False, True,
       short=("crd", "crds")),
    _r("coordination.k8s.io/v1", "leases", "Lease"),
    _r("policy/v1", "poddisruptionbudgets", "PodDisruptionBudget", True, True, short=("pdb",)),
]
# Kinds whose metadata.generation the real server leaves unset.
NO_GENERATION = {"ConfigMap", "Secret", "Event", "ServiceAccount", "Namespace", "Node", "Service", "Lease",
                 "Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding", "Binding"}
SYSTEM_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed",
           409: "Conflict", 410: "Expired", 415: "UnsupportedMediaType", 422: "Invalid",
           429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable", 504: "Timeout"}
_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # apimachinery's generateName alphabet
TRUE = ("1", "t", "T", "true", "TRUE", "True")  # what Go's strconv.ParseBool reads as true


class _Raced(Exception):
    """The object changed while a write to it waited for admission."""


class ApiError(Exception):
    """A refusal, carried as the ``Status`` object the real server would answer with."""

    def __init__(self, code: int, message: str, reason: str | None = None, details: dict | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason or REASONS.get(code, "Unknown")
        self.message = message
        self.details = details or {}

    def status(self) -> dict:
        out = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
               "message": self.message, "reason": self.reason, "code": self.code}
        if self.details:
            out["details"] = self.details
        return out


def not_found(res: Resource, name: str) -> ApiError:
    return ApiError(404, f'{res.qualified} "{name}" not found',
                    details={"name": name, "group": res.group, "kind": res.plural})


def conflict(res: Resource, name: str, why: str = "the object has been modified; please apply your changes "
                                                  "to the latest version and try again") -> ApiError:
    return ApiError(409, f'Operation cannot be fulfilled on {res.qualified} "{name}": {why}', "Conflict",
                    {"name": name, "group": res.group, "kind": res.plural})


def invalid(res: Resource, name: str, causes: list[tuple[str, str]]) -> ApiError:
    listed = [f"{path}: {msg}" for path, msg in causes]
    text = listed[0] if len(listed) == 1 else "[" + ", ".join(listed) + "]"
    return ApiError(422, f'{res.qualified_kind} "{name}" is invalid: {text}', "Invalid",
                    {"name": name, "group": res.group, "kind": res.kind,
                     "causes": [{"reason": "FieldValueInvalid", "message": msg, "field": path}
                                for path, msg in causes]})


@dataclasses.dataclass(frozen=True)
class Write:
    """One accepted write, for tests to assert on what a service sent."""

    method: str
    path: str
    object: dict


@dataclasses.dataclass
class Fault:
    method: str
    path: re.Pattern
    status: int
    times: int | None
    hits: int = 0


@dataclasses.dataclass(frozen=True)
class Change:
    rv: int
    res: Resource
    namespace: str
    type: str
    obj: dict
    old: dict | None


@dataclasses.dataclass(eq=False)
class Watcher:
    res: Resource
    namespace: str | None
    matches: Any
    queue: asyncio.Queue


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _without(obj: dict, *keys: str) -> dict:
    return {k: v for k, v in obj.items() if k not in keys}


class ApiServer:
    """The emulator; ``await ApiServer().start()``, then clients talk to ``url``."""

    def __init__(self, *, history: int = 1000, schema_version: str = kube_schemas.SCHEMA_VERSION) -> None:
        self.schema_version = schema_version
        self.writes: list[Write] = []
        self.requests: list[tuple[str, str, dict]] = []  # (method, path, query) of every request received
        self._resources: dict[tuple[str, str], Resource] = {(r.api_version, r.plural): r for r in BUILTIN}
        self._store: dict[tuple[str, str, str, str], dict] = {}  # (apiVersion, plural, namespace, name)
        self._rv = 0
        self._history: collections.deque[Change] = collections.deque(maxlen=history)
        self._compacted = 0
        self._watchers: set[Watcher] = set()
        self._faults: list[Fault] = []
        self._applied: dict[tuple[str, str], dict] = {}  # (uid, field manager) -> last applied config
        self._port = 0
        self._runner: web.AppRunner | None = None
        self.admission = MutatingAdmission()  # the stored MutatingWebhookConfigurations, run on each write
        self._changed = asyncio.Event()
        for ns in SYSTEM_NAMESPACES:
            self._create_now(self._res("v1", "namespaces"), "", {"apiVersion": "v1", "kind": "Namespace",
                                                                 "metadata": {"name": ns}})

    # ---- life cycle -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    async def start(self) -> "ApiServer":
        """Serve (again) on the same port, with the state kept: a restart of the API server."""
        app = web.Application(middlewares=[self._faults_middleware], client_max_size=16 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self._port, reuse_address=True)
        await site.start()
        self._port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        """Become unreachable (watches are cut, connections refused) until ``start()``."""
        for watcher in list(self._watchers):
            watcher.queue.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- fault injection ------------------------------------------------------------------------

    def fail(self, method: str, path_regex: str, status: int = 503, times: int | None = 1) -> Fault:
        """Answer the next ``times`` requests (None: all) of ``method`` ("*": any) whose path matches
        ``path_regex`` (re.search) with a Status of code ``status``, before anything else happens."""
        fault = Fault(method.upper(), re.compile(path_regex), status, times)
        self._faults.append(fault)
        return fault

    def heal(self) -> None:
        self._faults.clear()

    @web.middleware
    async def _faults_middleware(self, request: web.Request, handler):
        self.requests.append((request.method, request.path, dict(request.query)))
        for fault in self._faults:
            if fault.method in ("*", request.method) and fault.path.search(request.path):
                if fault.times is not None and fault.hits >= fault.times:
                    continue
                fault.hits += 1
                error = ApiError(fault.status, f"injected fault: {fault.status} for {request.method} {request.path}")
                headers = {"Retry-After": "1"} if fault.status == 429 else None
                return web.json_response(error.status(), status=fault.status, headers=headers)
        return await handler(request)

    def route_service(self, namespace: str, name: str, port: int, url: str) -> None:
        """Make webhook ``clientConfig.service`` {namespace, name, port} reach ``url`` (https://host:port);
        the TLS server name checked is still ``<name>.<namespace>.svc``, as in a cluster."""
        self.admission.route_service(namespace, name, port, url)

    # ---- direct access for the parts the tests play ---------------------------------------------

    @property
    def resource_version(self) -> int:
        return self._rv

    def compact(self) -> None:
        """Forget the watch history, as etcd compaction does: a watch from before now gets 410."""
        self._history.clear()
        self._compacted = self._rv

    async def wait_for(self, check, timeout: float = 10.0):
        """The first truthy value of ``check()`` (a function of the stored state, e.g. a lambda over
        ``objects``), re-evaluated after each write; TimeoutError if it stays falsy."""
        async with asyncio.timeout(timeout):
            while not (value := check()):
                await self._changed.wait()
            return value

    def resource(self, api_version: str, plural: str) -> Resource:
        return self._res(api_version, plural)

    def objects(self, api_version: str, plural: str, namespace: str | None = None) -> list[dict]:
        res = self._res(api_version, plural)
        return [copy.deepcopy(o) for (_, _, ns, _), o in self._items(res) if namespace is None or ns == namespace]

    def object(self, api_version: str, plural: str, name: str, namespace: str | None = None) -> dict | None:
        obj = self._store.get((*self._res(api_version, plural).key, namespace or "", name))
        return copy.deepcopy(obj) if obj is not None else None

    def resource_of(self, obj: dict) -> Resource:
        for res in self._resources.values():
            if res.api_version == obj.get("apiVersion") and res.kind == obj.get("kind"):
                return res
        raise ApiError(404, f"the server could not find the requested resource ({obj.get('apiVersion')}, "
                            f"kind {obj.get('kind')})")

    async def create(self, obj: dict) -> dict:
        res = self.resource_of(obj)
        return await self._create(res, (obj.get("metadata") or {}).get("namespace", "") if res.namespaced else "",
                                  copy.deepcopy(obj), "POST", self._path(res, (obj.get("metadata") or {})))

    async def replace(self, obj: dict, subresource: str = "") -> dict:
        res = self.resource_of(obj)
        meta = obj.get("metadata") or {}
        ns = meta.get("namespace", "") if res.namespaced else ""
        return await self._update(res, ns, meta.get("name", ""), copy.deepcopy(obj), subresource,
                                  "PUT", self._path(res, meta, name=True, sub=subresource))

    async def patch(self, api_version: str, plural: str, name: str, patch: Any, namespace: str | None = None,
                    kind: str = "merge", subresource: str = "") -> dict:
        res = self._res(api_version, plural)
        content = {"merge": "application/merge-patch+json", "json": "application/json-patch+json",
                   "strategic": "application/strategic-merge-patch+json"}[kind]
        meta = {"name": name, "namespace": namespace or ""}
        _, obj = await self._patch(res, namespace or "", name, json.dumps(patch).encode(), content,
                                   subresource, {}, self._path(res, meta, name=True, sub=subresource))
        return obj

    async def delete(self, api_version: str, plural: str, name: str, namespace: str | None = None,
                     propagation: str = "Background") -> dict:
        res = self._res(api_version, plural)
        return self._delete_request(res, namespace or "", name, {}, propagation,
                                    self._path(res, {"name": name, "namespace": namespace or ""}, name=True))

    async def bind(self, namespace: str, pod: str, node: str) -> dict:
        """What kube-scheduler does: POST pods/<pod>/binding (refused with 409 while the pod is gated)."""
        path = f"/api/v1/namespaces/{namespace}/pods/{pod}/binding"
        return self._bind(namespace, pod, {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod},
                                           "target": {"apiVersion": "v1", "kind": "Node", "name": node}}, path)

    async def install_crds(self, directory: Path) -> None:
        for path in sorted(Path(directory).glob("*.yaml")):
            for doc in yaml.safe_load_all(path.read_text()):
                if doc:
                    await self.create(doc)

    # ---- the store ------------------------------------------------------------------------------

    def _res(self, api_version: str, plural: str) -> Resource:
        try:
            return self._resources[(api_version, plural)]
        except KeyError:
            raise ApiError(404, f"the server could not find the requested resource ({api_version} {plural})") \
                from None

    def _items(self, res: Resource) -> list[tuple[tuple[str, str, str, str], dict]]:
        """The stored objects of one resource, by namespace and name."""
        return sorted(((k, o) for k, o in self._store.items() if k[:2] == res.key), key=lambda kv: kv[0])

    def _path(self, res: Resource, meta: dict, name: bool = False, sub: str = "") -> str:
        base = f"/api/{res.api_version}" if not res.group else f"/apis/{res.api_version}"
        ns = f"/namespaces/{meta.get('namespace')}" if res.namespaced and meta.get("namespace") else ""
        tail = f"/{meta.get('name')}" if name else ""
        return f"{base}{ns}/{res.plural}{tail}" + (f"/{sub}" if sub else "")

    def _commit(self, res: Resource, ns: str, obj: dict, old: dict | None, kind: str) -> dict:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        key = (*res.key, ns, obj["metadata"]["name"])
        if kind == "DELETED":
            self._store.pop(key, None)
        else:
            self._store[key] = obj
        change = Change(self._rv, res, ns, kind, copy.deepcopy(obj), copy.deepcopy(old) if old else None)
        if len(self._history) == self._history.maxlen:
            self._compacted = self._history[0].rv
        self._history.append(change)
        self._changed.set()
        self._changed = asyncio.Event()
        for watcher in list(self._watchers):
            event = self._event_for(watcher, change)
            if event is not None:
                watcher.queue.put_nowait(event)
        if res.kind == "CustomResourceDefinition":
            self._crd_changed(obj, kind)
        return copy.deepcopy(obj)

    def _event_for(self, watcher: Watcher, change: Change) -> tuple[str, dict] | None:
        if watcher.res.key != change.res.key or (watcher.namespace is not None and watcher.namespace != change.namespace):
            return None
        now_in = change.type != "DELETED" and watcher.matches(change.obj)
        was_in = change.old is not None and watcher.matches(change.old)
        if change.type == "DELETED":
            return ("DELETED", change.obj) if watcher.matches(change.obj) else None
        if now_in and was_in:
            return "MODIFIED", change.obj
        if now_in:
            return "ADDED", change.obj
        if was_in:  # left the selector: the watcher sees it go
            return "DELETED", change.obj
        return None

    def _create_now(self, res: Resource, ns: str, obj: dict) -> dict:
        """Create without admission (system objects made at start)."""
        obj = self._assign_identity(res, self._normalize_create(res, ns, obj))
        self._validate(res, obj, None)
        return self._commit(res, ns, obj, None, "ADDED")

    def _normalize_create(self, res: Resource, ns: str, obj: dict) -> dict:
        """The object as admission sees it: kind and namespace checked, server-owned fields gone."""
        if not isinstance(obj, dict):
            raise ApiError(400, "the body of the request was not a JSON object")
        obj.setdefault("apiVersion", res.api_version)
        obj.setdefault("kind", res.kind)
        if obj["apiVersion"] != res.api_version or obj["kind"] != res.kind:
            raise ApiError(400, f"the API version in the data ({obj['apiVersion']}) or kind ({obj['kind']}) does "
                                f"not match the expected API version ({res.api_version}) and kind ({res.kind})")
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise invalid(res, "", [("metadata", "Invalid value: must be an object")])
        if res.namespaced:
            if meta.get("namespace", ns) != ns:
                raise ApiError(400, "the namespace of the provided object does not match the namespace sent on "
                                    "the request")
            meta["namespace"] = ns
        else:
            meta.pop("namespace", None)
        if not meta.get("name") and not meta.get("generateName"):
            raise invalid(res, "", [("metadata.name", "Required value: name or generateName is required")])
        for server_owned in ("uid", "resourceVersion", "creationTimestamp", "deletionTimestamp", "generation",
                             "deletionGracePeriodSeconds", "managedFields", "selfLink"):
            meta.pop(server_owned, None)
        if res.status:
            obj.pop("status", None)
        if res.kind == "Namespace":  # the label every namespace carries, for namespaceSelectors
            meta.setdefault("labels", {})["kubernetes.io/metadata.name"] = meta["name"]
        return obj

    def _assign_identity(self, res: Resource, obj: dict) -> dict:
        """What the registry fills in after admission: name from generateName, uid, times, status."""
        meta = obj["metadata"]
        if not meta.get("name"):
            meta["name"] = meta["generateName"] + "".join(random.choice(_NAME_CHARS) for _ in range(5))
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now()
        if res.kind not in NO_GENERATION:
            meta["generation"] = 1
        if res.kind == "Pod":
            obj["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
        elif res.kind == "Namespace":
            obj.setdefault("spec", {"finalizers": ["kubernetes"]})
            obj["status"] = {"phase": "Active"}
        elif res.kind == "CustomResourceDefinition":
            obj["status"] = _crd_status(obj)
        self._default(res, obj)
        return obj

    def _default(self, res: Resource, obj: dict) -> None:
        if res.custom is not None:
            kube_schemas.apply_defaults(res.custom.schema, obj)

    def _validate(self, res: Resource, obj: dict, old: dict | None) -> None:
        name = obj.get("metadata", {}).get("name", "")
        if res.custom is not None:
            validator = res.custom.validator
        else:
            validator = kube_schemas.builtin_validator(res.kind, res.api_version, self.schema_version)
        causes = kube_schemas.errors(validator, obj)
        causes += kube_rules.errors(res.kind, obj, old)
        if res.kind == "MutatingWebhookConfiguration":
            causes += compile_errors(obj.get("webhooks") or [])
        if causes:
            raise invalid(res, name, causes)

    def _check_namespace(self, res: Resource, ns: str) -> None:
        if not res.namespaced:
            return
        namespace = self._store.get(("v1", "namespaces", "", ns))
        if namespace is None:
            raise ApiError(404, f'namespaces "{ns}" not found', details={"name": ns, "kind": "namespaces"})
        if namespace["metadata"].get("deletionTimestamp"):
            raise ApiError(403, f"{res.kind.lower()}s \"{namespace['metadata']['name']}\" is forbidden: unable to "
                                f"create new content in namespace {ns} because it is being terminated")

    async def _create(self, res: Resource, ns: str, obj: dict, method: str, path: str) -> dict:
        obj = self._normalize_create(res, ns, obj)
        self._check_namespace(res, ns)
        obj = await self._admit("CREATE", res, ns, obj, None, "")
        obj = self._assign_identity(res, obj)
        if (*res.key, ns, obj["metadata"]["name"]) in self._store:
            name = obj["metadata"]["name"]
            raise ApiError(409, f'{res.qualified} "{name}" already exists', "AlreadyExists",
                           {"name": name, "group": res.group, "kind": res.plural})
        self._validate(res, obj, None)
        stored = self._commit(res, ns, obj, None, "ADDED")
        self.writes.append(Write(method, path, copy.deepcopy(stored)))
        return stored

    def _current(self, res: Resource, ns: str, name: str) -> dict:
        obj = self._store.get((*res.key, ns, name))
        if obj is None:
            raise not_found(res, name)
        return obj

    def _merge_update(self, res: Resource, old: dict, new: dict, subresource: str) -> dict:
        """What an update of the object (or of its /status) keeps of the old one."""
        if not isinstance(new, dict):
            raise ApiError(400, "the body of the request was not a JSON object")
        meta = new.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise invalid(res, old["metadata"]["name"], [("metadata", "Invalid value: must be an object")])
        new.setdefault("apiVersion", res.api_version)
        new.setdefault("kind", res.kind)
        if new["apiVersion"] != res.api_version or new["kind"] != res.kind:
            raise ApiError(400, f"the API version in the data ({new['apiVersion']}) or kind ({new['kind']}) does "
                                f"not match the expected API version ({res.api_version}) and kind ({res.kind})")
        name = old["metadata"]["name"]
        if meta.get("name", name) != name:
            raise ApiError(400, f"the name of the object ({meta.get('name')}) does not match the name on the URL "
                                f"({name})")
        if meta.get("uid") not in (None, old["metadata"]["uid"]):
            raise conflict(res, name, f"Precondition failed: UID in precondition: {meta['uid']}, UID in object "
                                      f"meta: {old['metadata']['uid']}")
        for kept in ("name", "namespace", "uid", "creationTimestamp", "deletionTimestamp", "generation",
                     "deletionGracePeriodSeconds"):
            if kept in old["metadata"]:
                meta[kept] = old["metadata"][kept]
            else:
                meta.pop(kept, None)
        if subresource == "status":
            out = copy.deepcopy(old)
            if "status" in new:
                out["status"] = new["status"]
            else:
                out.pop("status", None)
            return out
        if res.status:
            if "status" in old:
                new["status"] = copy.deepcopy(old["status"])
            else:
                new.pop("status", None)
        if "generation" in old["metadata"] and _without(new, "metadata", "status") != _without(old, "metadata",
                                                                                                 "status"):
            meta["generation"] = old["metadata"]["generation"] + 1
        return new

    def _check_rv(self, res: Resource, old: dict, wanted: str | None) -> None:
        if wanted not in (None, "") and str(wanted) != old["metadata"]["resourceVersion"]:
            raise conflict(res, old["metadata"]["name"])

    async def _retrying(self, res: Resource, name: str, attempt):
        """Run a read-modify-write again when another write landed while admission ran (the real
        server's GuaranteedUpdate does the same); a precondition then fails as a Conflict."""
        for _ in range(8):
            try:
                return await attempt()
            except _Raced:
                continue
        raise conflict(res, name)

    async def _update(self, res: Resource, ns: str, name: str, body: dict, subresource: str, method: str,
                      path: str) -> dict:
        return await self._retrying(res, name, lambda: self._update_once(res, ns, name, copy.deepcopy(body),
                                                                         subresource, method, path))

    async def _update_once(self, res: Resource, ns: str, name: str, body: dict, subresource: str, method: str,
                           path: str) -> dict:
        old = self._current(res, ns, name)
        if not isinstance(body, dict):
            raise ApiError(400, "the body of the request was not a JSON object")
        wanted = (body.get("metadata") or {}).get("resourceVersion")
        if res.custom is not None and not wanted:  # custom resources allow no unconditional update
            raise invalid(res, name, [("metadata.resourceVersion",
                                       "Invalid value: 0x0: must be specified for an update")])
        self._check_rv(res, old, wanted)
        return await self._write_update(res, ns, old, self._merge_update(res, old, body, subresource), method, path,
                                        subresource)

    async def _write_update(self, res: Resource, ns: str, old: dict, new: dict, method: str, path: str,
                            subresource: str) -> dict:
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        self._default(res, new)
        if res.kind == "Namespace":
            new["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = new["metadata"]["name"]
        if old["metadata"].get("deletionTimestamp"):
            added = set(new["metadata"].get("finalizers") or []) - set(old["metadata"].get("finalizers") or [])
            if added:
                raise invalid(res, old["metadata"]["name"], [(
                    "metadata.finalizers", f"Forbidden: no new finalizers can be added if the object is being "
                                           f"deleted, found new finalizers {sorted(added)}")])
        if new != old:
            new = await self._admit("UPDATE", res, ns, new, old, subresource)
            if self._store.get((*res.key, ns, old["metadata"]["name"])) is not old:
                raise _Raced()
        self._validate(res, new, old)
        if new == old:  # a no-op write changes nothing, not even the resourceVersion
            self.writes.append(Write(method, path, copy.deepcopy(old)))
            return copy.deepcopy(old)
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            # the last finalizer gone: the update is the deletion (one DELETED event, as on a real server)
            self._store[(*res.key, ns, new["metadata"]["name"])] = new
            stored = self._remove(res, ns, new["metadata"]["name"], "Background")
        else:
            stored = self._commit(res, ns, new, old, "MODIFIED")
        self.writes.append(Write(method, path, copy.deepcopy(stored)))
        return stored

    async def _patch(self, res: Resource, ns: str, name: str, raw: bytes, content_type: str, subresource: str,
                     query, path: str) -> tuple[int, dict]:
        return await self._retrying(res, name, lambda: self._patch_once(res, ns, name, raw, content_type,
                                                                        subresource, query, path))

    async def _patch_once(self, res: Resource, ns: str, name: str, raw: bytes, content_type: str,
                          subresource: str, query, path: str) -> tuple[int, dict]:
        media = content_type.split(";")[0].strip()
        if media == "application/apply-patch+yaml":
            return await self._apply(res, ns, name, raw, subresource, query, path)
        try:
            patch = json.loads(raw or b"null")
        except ValueError as exc:
            raise ApiError(400, f"error decoding patch: {exc}") from None
        if media == "application/strategic-merge-patch+json" and res.custom is not None:
            raise ApiError(415, f"strategic merge patch is not supported for custom resources "
                                f"({res.qualified}); use a merge patch")
        old = self._current(res, ns, name)
        try:
            if media == "application/merge-patch+json":
                patched = kube_patches.merge_patch(old, patch)
            elif media == "application/json-patch+json":
                patched = kube_patches.json_patch(old, patch)
            elif media == "application/strategic-merge-patch+json":
                patched = kube_patches.strategic_merge(old, patch)
            else:
                raise ApiError(415, "the body of the request was in an unknown format - accepted media types "
                                    "include: application/json-patch+json, application/merge-patch+json, "
                                    "application/apply-patch+yaml, application/strategic-merge-patch+json")
        except kube_patches.PatchError as exc:
            raise ApiError(exc.status, str(exc)) from None
        if isinstance(patch, dict):
            self._check_rv(res, old, (patch.get("metadata") or {}).get("resourceVersion"))
        if not isinstance(patched, dict):
            raise ApiError(400, "the patch does not leave an object")
        merged = self._merge_update(res, old, copy.deepcopy(patched), subresource)
        return 200, await self._write_update(res, ns, old, merged, "PATCH", path, subresource)

    async def _apply(self, res: Resource, ns: str, name: str, raw: bytes, subresource: str, query,
                     path: str) -> tuple[int, dict]:
        manager = query.get("fieldManager")
        if not manager:
            raise ApiError(400, "PATCH /apply requires a non-empty fieldManager query parameter")
        try:
            applied = yaml.safe_load(raw.decode() or "null")
        except yaml.YAMLError as exc:
            raise ApiError(400, f"error decoding YAML: {exc}") from None
        if not isinstance(applied, dict) or not applied.get("apiVersion") or not applied.get("kind"):
            raise ApiError(400, "apply requires an object with apiVersion and kind")
        meta = applied.get("metadata") or {}
        if meta.get("name", name) != name:
            raise ApiError(400, f"the name of the object ({meta.get('name')}) does not match the name on the URL "
                                f"({name})")
        old = self._store.get((*res.key, ns, name))
        if old is None:
            if subresource:
                raise not_found(res, name)
            obj = copy.deepcopy(applied)
            obj.setdefault("metadata", {})["name"] = name
            stored = await self._create(res, ns, obj, "PATCH", path)
            self._applied[(stored["metadata"]["uid"], manager)] = applied
            return 201, stored
        self._check_rv(res, old, meta.get("resourceVersion"))
        key = (old["metadata"]["uid"], manager + "/" + subresource if subresource else manager)
        patched = kube_patches.server_side_apply(old, applied, self._applied.get(key))
        merged = self._merge_update(res, old, patched, subresource)
        stored = await self._write_update(res, ns, old, merged, "PATCH", path, subresource)
        self._applied[key] = applied
        return 200, stored

    def _delete_request(self, res: Resource, ns: str, name: str, options: dict, propagation: str | None,
                        path: str) -> dict:
        old = self._current(res, ns, name)
        pre = options.get("preconditions") or {}
        if pre.get("uid") not in (None, old["metadata"]["uid"]):
            raise conflict(res, name, f"Precondition failed: UID in precondition: {pre['uid']}, UID in object "
                                      f"meta: {old['metadata']['uid']}")
        if pre.get("resourceVersion") not in (None, old["metadata"]["resourceVersion"]):
            raise conflict(res, name, f"Precondition failed: ResourceVersion in precondition: "
                                      f"{pre['resourceVersion']}, ResourceVersion in object meta: "
                                      f"{old['metadata']['resourceVersion']}")
        propagation = propagation or options.get("propagationPolicy") or "Background"
        if propagation not in ("Background", "Foreground", "Orphan"):
            raise ApiError(400, f"unknown propagationPolicy {propagation!r} (Background, Foreground or Orphan)")
        out = self._delete(res, ns, name, propagation)
        self.writes.append(Write("DELETE", path, copy.deepcopy(out)))
        return out

    def _delete(self, res: Resource, ns: str, name: str, propagation: str) -> dict:
        obj = self._store.get((*res.key, ns, name))
        if obj is None:
            return {}
        if res.kind == "Namespace":
            return self._delete_namespace(obj)
        if obj["metadata"].get("finalizers"):
            if obj["metadata"].get("deletionTimestamp"):
                return copy.deepcopy(obj)
            new = copy.deepcopy(obj)
            new["metadata"]["deletionTimestamp"] = now()
            new["metadata"]["deletionGracePeriodSeconds"] = 0
            return self._commit(res, ns, new, obj, "MODIFIED")
        return self._remove(res, ns, name, propagation)

    def _remove(self, res: Resource, ns: str, name: str, propagation: str) -> dict:
        """The object leaves the store; then the garbage collector's and namespace controller's share."""
        obj = self._store[(*res.key, ns, name)]
        uid = obj["metadata"]["uid"]
        if propagation == "Foreground":
            self._collect(uid, "Foreground")
        gone = self._commit(res, ns, copy.deepcopy(obj), obj, "DELETED")
        for key in [k for k in self._applied if k[0] == uid]:
            del self._applied[key]
        if propagation != "Foreground":
            self._collect(uid, propagation)
        if ns:
            self._finish_namespace(ns)
        return gone

    def _collect(self, owner_uid: str, propagation: str) -> None:
        """Dependents of a deleted owner: deleted (or orphaned), unless another owner still exists."""
        live = {o["metadata"]["uid"] for o in self._store.values()}
        for (api_version, plural, ns, name), obj in list(self._store.items()):
            res = self._resources[(api_version, plural)]
            refs = obj["metadata"].get("ownerReferences") or []
            if not any(r.get("uid") == owner_uid for r in refs):
                continue
            others = [r for r in refs if r.get("uid") != owner_uid]
            if propagation == "Orphan" or any(r.get("uid") in live for r in others):
                new = copy.deepcopy(obj)
                new["metadata"]["ownerReferences"] = others
                if not others:
                    del new["metadata"]["ownerReferences"]
                self._commit(res, ns, new, obj, "MODIFIED")
            elif (api_version, plural, ns, name) in self._store:
                self._delete(res, ns, name, "Background" if propagation == "Background" else "Foreground")

    def _delete_namespace(self, obj: dict) -> dict:
        res, name = self._res("v1", "namespaces"), obj["metadata"]["name"]
        if not obj["metadata"].get("deletionTimestamp"):
            new = copy.deepcopy(obj)
            new["metadata"]["deletionTimestamp"] = now()
            new["metadata"]["deletionGracePeriodSeconds"] = 0
            new["status"] = {"phase": "Terminating"}
            obj = self._commit(res, "", new, obj, "MODIFIED")
        for (api_version, plural, ns, n) in [k for k in self._store if k[2] == name]:
            self._delete(self._resources[(api_version, plural)], ns, n, "Background")
        self._finish_namespace(name)
        return copy.deepcopy(self._store.get((*res.key, "", name), obj))

    def _finish_namespace(self, name: str) -> None:
        res = self._res("v1", "namespaces")
        ns = self._store.get((*res.key, "", name))
        if ns is None or not ns["metadata"].get("deletionTimestamp") or ns["metadata"].get("finalizers"):
            return
        if not any(k[2] == name for k in self._store):
            self._commit(res, "", copy.deepcopy(ns), ns, "DELETED")

    # ---- pods/binding ---------------------------------------------------------------------------

    def _bind(self, ns: str, name: str, binding: dict, path: str) -> dict:
        pods = self._res("v1", "pods")
        binding_res = Resource("v1", "pods/binding", "Binding", True)
        if not isinstance(binding, dict):
            raise ApiError(400, "the body of the request was not a JSON object")
        binding.setdefault("apiVersion", "v1")
        binding.setdefault("kind", "Binding")
        causes = kube_schemas.errors(kube_schemas.builtin_validator("Binding", "v1", self.schema_version), binding)
        if not causes and (binding.get("target") or {}).get("kind", "Node") != "Node":
            causes = [("target.kind", "Invalid value: must be empty or Node")]
        if not causes and not (binding.get("target") or {}).get("name"):
            causes = [("target.name", "Required value")]
        if causes:
            raise invalid(binding_res, name, causes)
        old = self._current(pods, ns, name)
        why = None
        if old["metadata"].get("deletionTimestamp"):
            why = f"pod {name} is being deleted, cannot be assigned to a host"
        elif old["spec"].get("nodeName"):
            why = f"pod {name} is already assigned to node \"{old['spec']['nodeName']}\""
        elif old["spec"].get("schedulingGates"):
            why = f"pod {name} has non-empty .spec.schedulingGates"
        if why:
            raise ApiError(409, f'Operation cannot be fulfilled on pods/binding "{name}": {why}', "Conflict",
                           {"name": name, "kind": "pods/binding"})
        new = copy.deepcopy(old)
        new["spec"]["nodeName"] = binding["target"]["name"]
        for field in ("annotations", "labels"):
            if binding["metadata"].get(field):
                new["metadata"].setdefault(field, {}).update(binding["metadata"][field])
        status = new.setdefault("status", {})
        status.pop("nominatedNodeName", None)
        conditions = [c for c in status.get("conditions", []) if c.get("type") != "PodScheduled"]
        status["conditions"] = conditions + [{"type": "PodScheduled", "status": "True",
                                              "lastTransitionTime": now()}]
        self._validate(pods, new, None)
        stored = self._commit(pods, ns, new, old, "MODIFIED")
        self.writes.append(Write("POST", path, copy.deepcopy(binding)))
        return stored

    # ---- admission -------------------------------------------------------------------------------

    async def _admit(self, operation: str, res: Resource, ns: str, obj: dict, old: dict | None,
                     subresource: str) -> dict:
        if res.group == "admissionregistration.k8s.io":
            return obj  # never sent to webhooks, so that a broken webhook can always be removed
        configurations = [o for (_, _, _, _), o in self._items(self._res("admissionregistration.k8s.io/v1",
                                                                          "mutatingwebhookconfigurations"))]
        if not configurations:
            return obj
        namespace = self._store.get(("v1", "namespaces", "", ns)) if ns else None
        try:
            return await self.admission.admit(
                configurations=configurations, operation=operation, group=res.group, version=res.version,
                kind=res.kind, resource=f"{res.plural}/{subresource}" if subresource else res.plural,
                namespaced=res.namespaced, namespace=ns,
                namespace_labels=((namespace or {}).get("metadata") or {}).get("labels") or {},
                obj=copy.deepcopy(obj), old=copy.deepcopy(old) if old is not None else None)
        except Refused as exc:
            raise ApiError(exc.code, exc.message, exc.reason or None) from None

    # ---- custom resources -----------------------------------------------------------------------

    def _crd_changed(self, crd: dict, kind: str) -> None:
        spec = crd["spec"]
        group, names = spec["group"], spec["names"]
        for key in [k for k, r in self._resources.items() if r.custom is not None and r.group == group
                    and r.plural == names["plural"]]:
            if kind == "DELETED":
                res = self._resources[key]
                for k, obj in list(self._items(res)):
                    self._commit(res, k[2], copy.deepcopy(obj), obj, "DELETED")
            del self._resources[key]
        if kind == "DELETED":
            return
        for version in spec["versions"]:
            if not version.get("served", True):
                continue
            schema = (version.get("schema") or {}).get("openAPIV3Schema") or {
                "type": "object", "x-kubernetes-preserve-unknown-fields": True}
            api_version = f"{group}/{version['name']}"
            res = Resource(api_version, names["plural"], names["kind"], spec["scope"] == "Namespaced",
                           "status" in (version.get("subresources") or {}), CORE_FIELDS,
                           tuple(names.get("shortNames") or ()),
                           CustomKind(kube_schemas.custom_validator(schema, self.schema_version), schema,
                                      tuple(version.get("additionalPrinterColumns") or ())))
            self._resources[(api_version, names["plural"])] = res

    # ---- HTTP -----------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._route(request)
        except ApiError as exc:
            return web.json_response(exc.status(), status=exc.code)
        except SelectorError as exc:
            return web.json_response(ApiError(400, str(exc)).status(), status=400)

    @staticmethod
    def _parse(parts: list[str]) -> tuple[str, str | None, str, str]:
        """(plural, namespace, name, subresource) of a path below /api/v1 or /apis/<g>/<v>."""
        if parts[0] == "namespaces" and len(parts) >= 3 and parts[2] not in ("status", "finalize"):
            return parts[2], parts[1], parts[3] if len(parts) > 3 else "", "/".join(parts[4:])
        return parts[0], None, parts[1] if len(parts) > 1 else "", "/".join(parts[2:])

    async def _route(self, request: web.Request) -> web.StreamResponse:
        parts = [p for p in request.path.split("/") if p]
        if request.path in ("/healthz", "/readyz", "/livez"):
            return web.Response(text="ok")
        if parts[:2] == ["openapi", "v3"]:
            return web.json_response(self._openapi_v3("/".join(parts[2:])))
        if request.path == "/version":
            major, minor = self.schema_version.split(".")[:2]
            return web.json_response({"major": major, "minor": minor, "gitVersion": f"v{self.schema_version}",
                                      "platform": "linux/amd64"})
        if parts[:1] == ["api"]:
            if len(parts) == 1:
                return web.json_response({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
                    {"clientCIDR": "0.0.0.0/0", "serverAddress": f"127.0.0.1:{self._port}"}]})
            api_version, rest = parts[1], parts[2:]
        elif parts[:1] == ["apis"]:
            if len(parts) == 1:
                return web.json_response(self._group_list())
            if len(parts) == 2:
                return web.json_response(self._group(parts[1]) or {}, status=200 if self._group(parts[1]) else 404)
            api_version, rest = f"{parts[1]}/{parts[2]}", parts[3:]
        else:
            raise ApiError(404, f"the server could not find the requested resource ({request.path})")
        if not rest:
            return web.json_response(self._resource_list(api_version))
        plural, ns, name, sub = self._parse(rest)
        res = self._res(api_version, plural)
        if res.namespaced and ns is None and name:
            raise ApiError(404, f"the server could not find the requested resource ({request.path})")
        if not res.namespaced and ns is not None:
            raise ApiError(404, f"the server could not find the requested resource ({request.path})")
        ns = ns or ""
        if sub and not (sub == "status" and res.status) and not (sub == "binding" and res.kind == "Pod"):
            raise ApiError(404, f"the server could not find the requested resource ({request.path})")
        method = request.method
        if not name:
            if method == "GET":
                if request.query.get("watch") in TRUE:
                    return await self._watch(request, res, ns if res.namespaced and ns else None)
                listed = self._list(res, ns if ns else None, request.query)
                if _wants_table(request) and res.custom is not None:
                    return web.json_response(_table(res, listed["items"], self._rv))
                return web.json_response(listed)
            if method == "POST":
                body = await self._body(request)
                return web.json_response(await self._create(res, ns, body, "POST", request.path), status=201)
            if method == "DELETE":
                return web.json_response(self._delete_collection(res, ns or None, request))
            raise ApiError(405, f"the server does not allow this method on the requested resource ({method})")
        if ns == "" and res.namespaced:
            raise ApiError(404, f"the server could not find the requested resource ({request.path})")
        if sub == "binding":
            if method != "POST":
                raise ApiError(405, "only POST is allowed on pods/binding")
            self._bind(ns, name, await self._body(request), request.path)
            return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                      "code": 201}, status=201)
        if method == "GET":
            if _wants_table(request) and res.custom is not None:
                return web.json_response(_table(res, [self._current(res, ns, name)], self._rv))
            return web.json_response(copy.deepcopy(self._current(res, ns, name)))
        if method == "PUT":
            return web.json_response(await self._update(res, ns, name, await self._body(request), sub, "PUT",
                                                        request.path))
        if method == "PATCH":
            code, obj = await self._patch(res, ns, name, await request.read(),
                                          request.headers.get("Content-Type", ""), sub, request.query, request.path)
            return web.json_response(obj, status=code)
        if method == "DELETE" and not sub:
            raw = await request.read()
            options = json.loads(raw) if raw.strip() else {}
            return web.json_response(self._delete_request(res, ns, name, options,
                                                          request.query.get("propagationPolicy"), request.path))
        raise ApiError(405, f"the server does not allow this method on the requested resource ({method})")

    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            if request.headers.get("Content-Type", "").startswith("application/yaml"):
                return yaml.safe_load(raw)
            return json.loads(raw)
        except ValueError as exc:
            raise ApiError(400, f"the body of the request could not be decoded: {exc}") from None

    def _matcher(self, res: Resource, query) -> Any:
        labels = label_selector(query.get("labelSelector"))
        fields = field_selector(query.get("fieldSelector"), res.fields, res.qualified)
        return lambda obj: labels(obj) and fields(obj)

    def _list(self, res: Resource, ns: str | None, query) -> dict:
        matches = self._matcher(res, query)
        items = []
        for (_, _, n, _), obj in self._items(res):
            if (ns is None or n == ns) and matches(obj):
                item = copy.deepcopy(obj)
                if res.custom is None:  # built-in lists carry kind and apiVersion once, not per item
                    item.pop("kind", None)
                    item.pop("apiVersion", None)
                items.append(item)
        return {"kind": f"{res.kind}List", "apiVersion": res.api_version,
                "metadata": {"resourceVersion": str(self._rv)}, "items": items}

    def _delete_collection(self, res: Resource, ns: str | None, request: web.Request) -> dict:
        matches = self._matcher(res, request.query)
        listed = self._list(res, ns, request.query)
        for (_, _, n, name), obj in list(self._items(res)):
            if (ns is None or n == ns) and matches(obj):
                self._delete_request(res, n, name, {}, request.query.get("propagationPolicy"), request.path)
        return listed

    async def _watch(self, request: web.Request, res: Resource, ns: str | None) -> web.StreamResponse:
        matches = self._matcher(res, request.query)
        since = request.query.get("resourceVersion", "")
        if since not in ("", "0"):
            try:
                start = int(since)
            except ValueError:
                raise ApiError(400, f"invalid resourceVersion {since!r}") from None
        else:
            start = None
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        if start is not None and start < self._compacted:
            gone = ApiError(410, f"too old resource version: {start} ({self._compacted})", "Expired")
            await response.write(json.dumps({"type": "ERROR", "object": gone.status()}).encode() + b"\n")
            return response
        watcher = Watcher(res, ns, matches, asyncio.Queue())
        if start is None:
            backlog = [("ADDED", copy.deepcopy(o)) for (_, _, n, _), o in self._items(res)
                       if (ns is None or n == ns) and matches(o)]
        else:
            backlog = [e for c in self._history if c.rv > start and (e := self._event_for(watcher, c))]
        self._watchers.add(watcher)
        timeout = float(request.query["timeoutSeconds"]) if request.query.get("timeoutSeconds") else None
        try:
            for event in backlog:
                await response.write(json.dumps({"type": event[0], "object": event[1]}).encode() + b"\n")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout if timeout else None
            while True:
                left = None if deadline is None else deadline - loop.time()
                if left is not None and left <= 0:
                    break
                try:
                    event = await asyncio.wait_for(watcher.queue.get(), left)
                except TimeoutError:
                    break
                if event is None:
                    break
                await response.write(json.dumps({"type": event[0], "object": event[1]}).encode() + b"\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._watchers.discard(watcher)
        return response

    # ---- discovery ------------------------------------------------------------------------------

    def _groups(self) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = {}
        for res in self._resources.values():
            if res.group and res.version not in groups.setdefault(res.group, []):
                groups[res.group].append(res.version)
        return groups

    def _group(self, name: str) -> dict | None:
        versions = self._groups().get(name)
        if not versions:
            return None
        listed = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
        return {"kind": "APIGroup", "apiVersion": "v1", "name": name, "versions": listed,
                "preferredVersion": listed[0]}

    def _group_list(self) -> dict:
        return {"kind": "APIGroupList", "apiVersion": "v1",
                "groups": [self._group(g) for g in sorted(self._groups())]}

    def _openapi_v3(self, group_version: str) -> dict:
        """Just enough OpenAPI v3 for kubectl: the group-version documents exist and their PATCH
        operations take ``fieldValidation``, so kubectl leaves strict validation to this server
        (which does it) instead of validating client-side against schemas served here (which are not)."""
        versions = sorted({r.api_version for r in self._resources.values()})
        if not group_version:
            return {"paths": {(f"api/{v}" if "/" not in v else f"apis/{v}"): {
                "serverRelativeURL": f"/openapi/v3/{'api' if '/' not in v else 'apis'}/{v}?hash={self._rv}"}
                for v in versions}}
        api_version = group_version.split("/", 1)[1] if "/" in group_version else group_version
        paths = {}
        for res in self._resources.values():
            if res.api_version != api_version:
                continue
            gvk = {"group": res.group, "version": res.version, "kind": res.kind}
            item = self._path(res, {"name": "{name}", "namespace": "{namespace}" if res.namespaced else ""},
                              name=True)
            paths[item] = {"patch": {
                "x-kubernetes-group-version-kind": gvk, "x-kubernetes-action": "patch",
                "parameters": [{"name": p, "in": "query", "schema": {"type": "string"}}
                               for p in ("dryRun", "fieldManager", "fieldValidation", "force")],
                "responses": {"200": {"description": "OK"}}}}
        if not paths:
            raise ApiError(404, f"the server could not find the requested resource (openapi {group_version})")
        return {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": f"v{self.schema_version}"},
                "paths": paths, "components": {"schemas": {}}}

    def _resource_list(self, api_version: str) -> dict:
        out = []
        verbs = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
        for res in self._resources.values():
            if res.api_version != api_version:
                continue
            entry = {"name": res.plural, "singularName": res.kind.lower(), "namespaced": res.namespaced,
                     "kind": res.kind, "verbs": verbs}
            if res.short_names:
                entry["shortNames"] = list(res.short_names)
            out.append(entry)
            if res.status:
                out.append({"name": f"{res.plural}/status", "singularName": "", "namespaced": res.namespaced,
                            "kind": res.kind, "verbs": ["get", "patch", "update"]})
            if res.kind == "Pod":
                out.append({"name": "pods/binding", "singularName": "", "namespaced": True, "kind": "Binding",
                            "verbs": ["create"]})
        if not out:
            raise ApiError(404, f"the server could not find the requested resource ({api_version})")
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": api_version, "resources": out}


def _wants_table(request: web.Request) -> bool:
    return "as=Table" in request.headers.get("Accept", "")


def _table(res: Resource, objects: list[dict], rv: int) -> dict:
    """The meta.k8s.io Table kubectl asks for: Name, then the CRD's additionalPrinterColumns (or Age)."""
    columns = list(res.custom.columns) if res.custom and res.custom.columns else [
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
    definitions = [{"name": "Name", "type": "string", "format": "name", "description": "Name", "priority": 0}]
    definitions += [{"name": c["name"], "type": c.get("type", "string"), "format": c.get("format", ""),
                     "description": c.get("description", ""), "priority": c.get("priority", 0)} for c in columns]
    rows = []
    for obj in objects:
        cells = [obj["metadata"]["name"]] + [dotted(obj, c["jsonPath"].lstrip(".")) for c in columns]
        rows.append({"cells": cells, "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                                                "metadata": obj["metadata"]}})
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": str(rv)},
            "columnDefinitions": definitions, "rows": rows}


def _crd_status(crd: dict) -> dict:
    names = (crd.get("spec") or {}).get("names") or {}
    stamp = now()
    return {"acceptedNames": names, "storedVersions": [v["name"] for v in (crd.get("spec") or {}).get(
        "versions", []) if v.get("storage")],
            "conditions": [{"type": t, "status": "True", "reason": r, "message": m, "lastTransitionTime": stamp}
                           for t, r, m in (("NamesAccepted", "NoConflicts", "no conflicts found"),
                                           ("Established", "InitialNamesAccepted",
                                            "the initial names have been accepted"))]}
