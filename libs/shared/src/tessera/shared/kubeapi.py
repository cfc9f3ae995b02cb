"""The Kubernetes API as the services use it: JSON calls, apply, list/watch, classified errors.

Every service that talks to an API server (the control-plane manager, the translator, placement,
the capacity publisher) wants the same few things, kept here once: a client configured in-cluster
or from ~/.kube/config (or for a given URL in tests), JSON in and out without generated model
classes, server-side apply, optimistic-concurrency writes, and a watch that survives what watches
suffer in production (410 Gone after etcd compaction, a dropped connection, an API server restart)
by re-listing and resuming, so that a consumer sees every object's latest state exactly as an
informer would.

Errors are classified by what the caller does next (``tessera.shared.errors``), not by status
number: ``Conflict`` (409, re-read and retry now), ``NotFound`` and ``Invalid`` (permanent for
this request), ``Unavailable`` (5xx, 429, no answer: retry later). They remain
``ApiException``s with ``status`` and ``body``, so callers written against kubernetes_asyncio's
exception keep working.

Bodies leave compact and key-sorted (``encode``), the way Go's encoder writes them: the API server
keeps a RawExtension (a ResourceClaim's opaque device parameters) as the bytes it was sent and
re-encodes it compactly on a merge patch, so parameters sent with spaces made every ``kubectl
label`` of the claim look like a change to its immutable spec.

Events (``Events``) are recorded here once for every service, the way client-go's event recorder
does it: one core/v1 Event per object, source, type, reason and message, and a repeat counted on it
(``count`` up, ``lastTimestamp`` now) rather than written as another.

Imported only in Kubernetes mode: kubernetes_asyncio costs start-up time and memory.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import weakref
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from datetime import datetime, timezone
from typing import Any, Literal, Mapping

import aiohttp
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client import rest
from kubernetes_asyncio.client.exceptions import ApiException

from tessera.shared.errors import ConflictError, PermanentError, TemporaryError, retry_cas

__all__ = ["KubeApi", "ApiException", "object_path", "KubeError", "Conflict", "AlreadyExists", "NotFound",
           "Invalid", "Rejected", "Unavailable", "Expired", "classify", "Events", "reference", "timestamp"]

PatchKind = Literal["merge", "json", "strategic"]
PATCH_TYPES = {"merge": "application/merge-patch+json", "json": "application/json-patch+json",
               "strategic": "application/strategic-merge-patch+json"}


def object_path(api_version: str, plural: str, name: str | None = None, namespace: str | None = None) -> str:
    """The REST path of a collection or, with ``name``, of one object."""
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    ns = f"/namespaces/{namespace}" if namespace else ""
    return f"{base}{ns}/{plural}" + (f"/{name}" if name else "")


def timestamp(at: datetime | None = None) -> str:
    """``at`` (default: now) as the API server writes a ``metav1.Time``: UTC, to the second."""
    return (at or datetime.now(timezone.utc)).astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def encode(body: Any) -> str:
    """A request body as the API server's own encoder would write it: no spaces, keys sorted."""
    return json.dumps(body, separators=(",", ":"), sort_keys=True)


class _RestJson:
    """What kubernetes_asyncio's REST client calls ``json``: it encodes every body with a bare
    ``json.dumps`` (", " and ": ") and offers no other hook, so its module is given this one."""

    loads = staticmethod(json.loads)

    @staticmethod
    def dumps(body: Any, **_: Any) -> str:
        return encode(body)


rest.json = _RestJson  # type: ignore[attr-defined]


# ---- errors ------------------------------------------------------------------------------------

class KubeError(ApiException):
    """An API request that did not succeed; ``status`` is 0 when no answer came at all."""

    # The answer's text, decoded once by `classify` (ApiException's is the raw bytes; `classify`
    # takes either, and nothing here reads a KubeError's body as bytes).
    body: str | None  # type: ignore[assignment]

    def __init__(self, status: int, message: str, reason: str = "", body: str | None = None) -> None:
        Exception.__init__(self, message)
        self.status = status
        self.reason = reason
        self.body = body
        self.headers = None
        self.message = message

    def __str__(self) -> str:
        return f"{self.message} ({self.status} {self.reason})" if self.status else self.message


class Conflict(KubeError, ConflictError):
    """409: the object changed since it was read (stale resourceVersion); re-read and retry."""


class AlreadyExists(Conflict):
    """409 AlreadyExists: a create found the name taken; read the existing object."""


class Expired(KubeError, ConflictError):
    """410: the resourceVersion is older than the server keeps; list again."""


class NotFound(KubeError, PermanentError):
    """404: no such object (or namespace, or resource type)."""


class Invalid(KubeError, PermanentError):
    """422: the object breaks the API's validation; the message names the field."""


class Rejected(KubeError, PermanentError):
    """Any other 4xx (bad request, forbidden, denied by admission): retrying the same write cannot help."""


class Unavailable(KubeError, TemporaryError):
    """5xx, 429 or no answer: the API server is down, overloaded or restarting; retry later."""

    def __init__(self, status: int, message: str, reason: str = "", body: str | None = None,
                 delay: float = 1.0) -> None:
        super().__init__(status, message, reason, body)
        self.delay = delay


def classify(status: int, body: str | bytes | None, retry_after: str | None = None) -> KubeError:
    """The classified error for an answer of ``status`` carrying (usually) a ``Status`` object."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else (body or "")
    try:
        parsed = json.loads(text) if text else {}
    except ValueError:
        parsed = {}
    parsed = parsed if isinstance(parsed, dict) else {}
    reason = str(parsed.get("reason") or "")
    message = str(parsed.get("message") or text or f"HTTP {status}")
    if status == 409:
        return (AlreadyExists if reason == "AlreadyExists" else Conflict)(status, message, reason, text)
    if status == 410:
        return Expired(status, message, reason, text)
    if status == 404:
        return NotFound(status, message, reason, text)
    if status == 422:
        return Invalid(status, message, reason, text)
    if status == 429 or status >= 500:
        try:
            delay = float(retry_after) if retry_after else 1.0
        except ValueError:
            delay = 1.0
        return Unavailable(status, message, reason, text, delay=delay)
    return Rejected(status, message, reason, text)


def _unreachable(exc: BaseException) -> Unavailable:
    return Unavailable(0, f"API server unreachable: {exc.__class__.__name__}: {exc}", "Unreachable")


# ---- the client --------------------------------------------------------------------------------

class KubeApi:
    def __init__(self, api: client.ApiClient | None = None, *, kubeconfig: str | None = None) -> None:
        self._api = api
        self._kubeconfig = kubeconfig

    @classmethod
    def for_url(cls, url: str) -> "KubeApi":
        return cls(client.ApiClient(client.Configuration(host=url)))

    @classmethod
    def for_kubeconfig(cls, path: str) -> "KubeApi":
        """A client acting as the identity of the kubeconfig at ``path`` (loaded on first use)."""
        return cls(kubeconfig=str(path))

    async def api(self) -> client.ApiClient:
        if self._api is None and self._kubeconfig is not None:
            configuration = client.Configuration()
            await config.load_kube_config(config_file=self._kubeconfig, client_configuration=configuration)
            self._api = client.ApiClient(configuration)
        elif self._api is None:  # in-cluster first, then $KUBECONFIG or ~/.kube/config
            try:
                config.load_incluster_config()
            except config.ConfigException:
                await config.load_kube_config()
            self._api = client.ApiClient()
        return self._api

    async def call(self, method: str, path: str, body: Any = None, *, query=None,
                   content_type: str = "application/json") -> Any:
        """One request; the decoded JSON answer, or a classified ``KubeError``."""
        api = await self.api()
        try:
            return await api.call_api(
                path, method, query_params=query or [], body=body,
                header_params={"Content-Type": content_type, "Accept": "application/json"},
                response_types_map={200: "object", 201: "object", 202: "object"}, auth_settings=["BearerToken"],
                _return_http_data_only=True,
            )
        except KubeError:
            raise
        except ApiException as exc:
            headers: Mapping[str, str] = exc.headers or {}
            raise classify(exc.status or 0, exc.body, headers.get("Retry-After")) from exc
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            raise _unreachable(exc) from exc

    async def get(self, path: str) -> dict | None:
        """The object at ``path``, or None if there is none."""
        try:
            return await self.call("GET", path)
        except NotFound:
            return None

    async def list(self, path: str, label_selector: str | None = None,
                   field_selector: str | None = None) -> tuple[list[dict], str]:
        """The objects of a collection (each with kind and apiVersion) and the list's resourceVersion."""
        query = _selectors(label_selector, field_selector)
        listed = await self.call("GET", path, query=query)
        kind = str(listed.get("kind", "")).removesuffix("List")
        items = []
        for item in listed.get("items") or []:  # built-in lists leave kind/apiVersion off their items
            item.setdefault("kind", kind)
            item.setdefault("apiVersion", listed.get("apiVersion"))
            items.append(item)
        return items, str((listed.get("metadata") or {}).get("resourceVersion", ""))

    async def create(self, path: str, obj: dict, field_manager: str | None = None) -> dict:
        """POST ``obj`` to the collection at ``path``; ``AlreadyExists`` if the name is taken."""
        query = [("fieldManager", field_manager)] if field_manager else None
        return await self.call("POST", path, obj, query=query)

    async def replace(self, path: str, obj: dict) -> dict:
        """PUT: with ``metadata.resourceVersion`` set, a ``Conflict`` if the object changed since."""
        return await self.call("PUT", path, obj)

    async def replace_status(self, path: str, obj: dict) -> dict:
        return await self.replace(f"{path}/status", obj)

    async def patch(self, path: str, body: Any, kind: PatchKind = "merge") -> dict:
        """PATCH (merge, JSON or strategic); a merge patch carrying ``metadata.resourceVersion`` is
        a compare-and-set (``Conflict`` when stale)."""
        return await self.call("PATCH", path, body, content_type=PATCH_TYPES[kind])

    async def patch_status(self, path: str, body: Any, kind: PatchKind = "merge") -> dict:
        return await self.patch(f"{path}/status", body, kind)

    async def delete(self, path: str, preconditions: dict | None = None,
                     propagation: Literal["Background", "Foreground", "Orphan"] = "Background",
                     grace_seconds: int | None = None) -> dict:
        """DELETE, optionally only if ``uid``/``resourceVersion`` still match (else ``Conflict``);
        ``grace_seconds``: the pod's grace period instead of its own (0: gone now, as a kubelet ends it).

        The answer is the object: gone, or still there with a deletionTimestamp while finalizers run.
        """
        options: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": propagation}
        if preconditions:
            options["preconditions"] = preconditions
        if grace_seconds is not None:
            options["gracePeriodSeconds"] = grace_seconds
        return await self.call("DELETE", path, options)

    async def apply(self, path: str, collection: str, obj: dict, field_manager: str) -> dict:
        """Server-side apply of ``obj`` at ``path`` (a create in ``collection`` where apply 404s)."""
        try:
            return await self.call("PATCH", path, obj, query=[("fieldManager", field_manager), ("force", "true")],
                                   content_type="application/apply-patch+yaml")
        except NotFound:  # an API server that does not create on apply (kmock's emulator did not)
            return await self.call("POST", collection, obj, query=[("fieldManager", field_manager)])

    async def watch(self, path: str, resource_version: str | None = None, *, label_selector: str | None = None,
                    field_selector: str | None = None, timeout_seconds: int = 300,
                    max_backoff: float = 5.0, warmup: float = 30.0,
                    listed: Callable[[], None] | None = None) -> AsyncGenerator[tuple[str, dict], None]:
        """(event type, object) for the collection at ``path``, forever, as an informer sees it.

        Without ``resource_version`` it lists first (an ADDED for each object). When the server
        answers 410 Gone, or the connection drops and cannot resume, it lists again and reports the
        difference to what it had seen (ADDED / MODIFIED / DELETED), so nothing is missed and
        nothing repeated. Reconnection backs off exponentially up to ``max_backoff`` seconds.
        Errors that retrying cannot fix (404, 403, a bad selector) are raised — except a 401 or 403
        once the watch has been served: a restarted API server answers so for a moment, while its
        authenticators' and RBAC's caches fill (it serves before it is ready), so those are
        retried for ``warmup`` seconds before they are believed. ``listed`` is called each time
        the events of a list have all been yielded (the consumer holds the whole collection then:
        a readiness gate may open).
        """
        seen: dict[tuple[str, str], dict] = {}  # (namespace, name) -> last object delivered
        rv = resource_version
        backoff = 0.0
        served = False  # the server has answered this watch (so a refusal now may be its warm-up)
        refused_since: float | None = None
        while True:
            try:
                if rv is None:
                    items, rv = await self.list(path, label_selector, field_selector)
                    served, refused_since = True, None
                    for event in _resync(seen, items):
                        yield event
                    if listed is not None:
                        listed()
                async for kind, obj in self._watch_once(path, rv, label_selector, field_selector, timeout_seconds):
                    backoff, served, refused_since = 0.0, True, None
                    rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                    if kind == "BOOKMARK":
                        continue
                    key = _key(obj)
                    if kind == "DELETED":
                        seen.pop(key, None)
                    else:
                        seen[key] = obj
                    yield kind, obj
            except Expired:
                rv = None  # re-list at once: the events in between are gone
            except Rejected as exc:
                now = asyncio.get_running_loop().time()
                refused_since = now if refused_since is None else refused_since
                if not served or exc.status not in (401, 403) or now - refused_since > warmup:
                    raise
                backoff = min(max_backoff, max(0.05, backoff * 2))
                await asyncio.sleep(backoff * (0.5 + random.random() / 2))
            except Unavailable:
                backoff = min(max_backoff, max(0.05, backoff * 2))
                await asyncio.sleep(backoff * (0.5 + random.random() / 2))

    async def _open(self, path: str, query: Sequence[tuple[str, str]], accept: str,
                    timeout: aiohttp.ClientTimeout) -> aiohttp.ClientResponse:
        """A GET whose body the caller reads as it comes (and releases); a classified error unless 200."""
        api = await self.api()
        try:
            response = await api.call_api(path, "GET", query_params=list(query), header_params={"Accept": accept},
                                          auth_settings=["BearerToken"], _preload_content=False,
                                          _request_timeout=timeout)
        except ApiException as exc:
            raise classify(exc.status or 0, exc.body) from exc
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            raise _unreachable(exc) from exc
        if response.status != 200:
            try:
                raise classify(response.status, await response.read(), response.headers.get("Retry-After"))
            finally:
                response.release()
        return response

    async def _watch_once(self, path: str, rv: str, label_selector: str | None, field_selector: str | None,
                          timeout_seconds: int) -> AsyncIterator[tuple[str, dict]]:
        """One watch request, until the server ends it."""
        query = [("watch", "true"), ("resourceVersion", rv), ("allowWatchBookmarks", "true"),
                 ("timeoutSeconds", str(timeout_seconds)), *_selectors(label_selector, field_selector)]
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=timeout_seconds + 30)
        response = await self._open(path, query, "application/json", timeout)
        try:
            while True:
                try:
                    line = await response.content.readline()
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                    raise _unreachable(exc) from exc
                if not line:
                    return
                if not line.strip():
                    continue
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    status = event.get("object") or {}
                    raise classify(int(status.get("code") or 500), json.dumps(status))
                yield event["type"], event["object"]
        finally:
            response.release()

    async def stream(self, path: str, query: Sequence[tuple[str, str]] = ()) -> AsyncIterator[bytes]:
        """The body of a GET as it comes (a pod's log, ``follow=true``), chunk by chunk."""
        response = await self._open(path, query, "*/*", aiohttp.ClientTimeout(total=None, sock_connect=10))
        try:
            async for chunk in response.content.iter_any():
                yield chunk
        finally:
            response.release()

    async def close(self) -> None:
        if self._api is not None:
            await self._api.close()
            self._api = None


def _selectors(label_selector: str | None, field_selector: str | None) -> list[tuple[str, str]]:
    query = []
    if label_selector:
        query.append(("labelSelector", label_selector))
    if field_selector:
        query.append(("fieldSelector", field_selector))
    return query


def _key(obj: dict) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return meta.get("namespace", ""), meta.get("name", "")


def _resync(seen: dict[tuple[str, str], dict], items: list[dict]) -> list[tuple[str, dict]]:
    """The events that turn what was seen into what a fresh list shows."""
    events = []
    current = {_key(item): item for item in items}
    for key, obj in list(seen.items()):
        if key not in current:
            events.append(("DELETED", obj))
            del seen[key]
    for key, item in current.items():
        before = seen.get(key)
        if before is None:
            events.append(("ADDED", item))
        elif (before.get("metadata") or {}).get("resourceVersion") != item["metadata"].get("resourceVersion"):
            events.append(("MODIFIED", item))
        seen[key] = item
    return events


# ---- Events ------------------------------------------------------------------------------------

MAX_MESSAGE = 1024  # an Event's message (the API server's NoteLengthLimit)
MAX_INSTANCE = 128  # its reportingInstance (ReportingInstanceLengthLimit)
EVENTS_KEPT = 4096  # Events whose count this process knows (client-go's recorder keeps as many)


def reference(obj: Mapping) -> dict:
    """The ObjectReference an Event names ``obj`` by (its apiVersion, kind, namespace, name, uid)."""
    meta = obj.get("metadata") or {}
    ref = {"apiVersion": obj.get("apiVersion", ""), "kind": obj.get("kind", ""), "name": meta.get("name", "")}
    if meta.get("namespace"):
        ref["namespace"] = meta["namespace"]
    if meta.get("uid"):
        ref["uid"] = meta["uid"]
    return ref


class Events:
    """core/v1 Events about objects, from one component (``source.component``), as ``kubectl
    describe`` shows them.

    Keyed as client-go's recorder keys them (its EventCorrelator): the object (by uid, else by kind,
    namespace and name), the component, the type, the reason and the message; one key, one Event,
    named ``<object>.<digest of the key>``. The first report creates it with ``count`` 1; each
    repeat raises ``count`` and moves ``lastTimestamp`` on that one Event. Unlike client-go's names
    (which carry a timestamp, so each recorder process has Events of its own), the name is the
    key's alone: a restarted or second replica counts on the same Event, so the count is a
    compare-and-set (a merge patch carrying the resourceVersion the count was read at; a lost race
    is read again and counted again; within a process one Event's reports take turns, as client-go's
    go through one queue). What this process last wrote is remembered (the last ``EVENTS_KEPT``
    Events), so a repeat costs one patch; an Event deleted meanwhile (their time to
    live is an hour) is made again. Needs ``create`` and ``patch`` on events, and ``get`` for an
    Event this process has not written (another replica's, or its own before a restart).

    An Event lives in its object's namespace (``default`` for an object of none); the API server
    refuses any other, and so does `record`, before anything is sent.

    ``host``: the node the component reports from (``source.host``, as a kubelet's Events say).
    """

    def __init__(self, api: KubeApi, component: str, instance: str = "", *, host: str = "") -> None:
        self.api = api
        self.component = component
        self.instance = (instance or component)[:MAX_INSTANCE]
        self.source = {"component": component, **({"host": host} if host else {})}
        self._known: OrderedDict[tuple[str, str], tuple[int, str]] = OrderedDict()  # -> (count, resourceVersion)
        # an Event's turn, held while one report of it is written (gone with the last report waiting)
        self._turns: weakref.WeakValueDictionary[tuple[str, str], asyncio.Lock] = weakref.WeakValueDictionary()

    async def record(self, about: Mapping, reason: str, message: str, *, warning: bool = False,
                     namespace: str | None = None, count: int | None = None) -> dict:
        """Report ``reason`` and ``message`` on the object ``about`` (an object, or an
        ObjectReference as `reference` makes), in its namespace; the Event as stored. ``count``:
        the count another recorder reached, written as it is (a relay of its Event) rather than
        this report counted."""
        regarding = dict(about) if "metadata" not in about else reference(about)
        own = regarding.get("namespace") or "default"
        if namespace is not None and namespace != own:
            raise Invalid(422, f"an Event about {regarding.get('kind')} {regarding.get('namespace', '')}/"
                               f"{regarding.get('name')} cannot be written in namespace {namespace}: an Event lives "
                               f"in its object's namespace ({own}); record it there", "Invalid")
        kind = "Warning" if warning else "Normal"
        name = self._name(regarding, kind, reason, message)
        key = (own, name)
        turn = self._turns.get(key)
        if turn is None:
            turn = self._turns[key] = asyncio.Lock()
        async with turn:
            return await self._count(key, regarding, kind, reason, message, count)

    async def _count(self, key: tuple[str, str], regarding: dict, kind: str, reason: str, message: str,
                     count: int | None) -> dict:
        """One report of the Event ``key``: made, or counted on, whichever it needs."""
        own, name = key

        async def attempt() -> dict:
            now = timestamp()
            known = self._known.get(key)
            if known is None:
                try:
                    return self._remember(key, await self.api.create(
                        object_path("v1", "events", namespace=own),
                        {**self._event(name, own, regarding, kind, reason, message, now), "count": count or 1}))
                except AlreadyExists:  # another replica's, or this one's before a restart: count on it
                    known = await self._read(key)
                    if known is None:
                        raise Conflict(409, f"Event {own}/{name} went as it was made", "Conflict") from None
            counted, version = known
            try:
                return self._remember(key, await self.api.patch(
                    object_path("v1", "events", name, own),
                    {"metadata": {"resourceVersion": version}, "count": count or counted + 1, "lastTimestamp": now}))
            except NotFound:  # expired (their time to live is an hour) or deleted: made again
                self._known.pop(key, None)
                raise Conflict(409, f"Event {own}/{name} went since it was counted", "Conflict") from None
            except Conflict:  # counted meanwhile by another recorder: count on what it wrote
                await self._read(key)
                raise

        return await retry_cas(attempt, what=f"the count of Event {own}/{name} ({reason} on "
                                             f"{regarding.get('kind')} {regarding.get('name')})")

    def _name(self, regarding: dict, kind: str, reason: str, message: str) -> str:
        subject = regarding.get("uid") or "/".join(
            str(regarding.get(k, "")) for k in ("apiVersion", "kind", "namespace", "name"))
        key = "\n".join((subject, self.component, kind, reason, message))
        return f"{str(regarding.get('name') or 'object')[:200]}.{hashlib.sha256(key.encode()).hexdigest()[:16]}"

    def _event(self, name: str, namespace: str, regarding: dict, kind: str, reason: str, message: str,
               now: str) -> dict:
        return {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": name, "namespace": namespace},
            "involvedObject": regarding,
            "reason": reason, "message": message[:MAX_MESSAGE], "type": kind,
            "source": self.source,
            "reportingComponent": self.component, "reportingInstance": self.instance,
            "firstTimestamp": now, "lastTimestamp": now,
        }

    async def _read(self, key: tuple[str, str]) -> tuple[int, str] | None:
        stored = await self.api.get(object_path("v1", "events", key[1], key[0]))
        if stored is None:
            self._known.pop(key, None)
            return None
        self._remember(key, stored)
        return self._known[key]

    def _remember(self, key: tuple[str, str], stored: dict) -> dict:
        self._known[key] = (int(stored.get("count") or 1), str(stored["metadata"]["resourceVersion"]))
        self._known.move_to_end(key)
        while len(self._known) > EVENTS_KEPT:
            self._known.popitem(last=False)
        return stored
