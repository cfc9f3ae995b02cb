"""Mutating admission as kube-apiserver runs it, for the emulator: stored webhook configurations
decide which writes are sent, over verified TLS, to which webhook, and what comes back is applied.

Tessera's translator is such a webhook, installed with ``failurePolicy: Fail``; a mistake in its
``rules``, ``namespaceSelector``, ``objectSelector`` or ``matchConditions`` either blocks every pod
in a cluster or lets GPU pods through untranslated, and a wrong certificate or slow answer has the
same effect. So the emulator evaluates those selectors itself (CEL with cel-python), calls the
webhook with a real AdmissionReview v1 over HTTPS verified against ``clientConfig.caBundle`` (for
a ``service`` reference, with the server name ``<service>.<namespace>.svc`` a real API server
checks), honours ``timeoutSeconds``, applies the JSONPatch it returns and reports a denial or a
failure in the words a real server uses.

Not modelled: reinvocation (``reinvocationPolicy: IfNeeded``), ``matchPolicy: Equivalent``
conversions, the ``authorizer`` CEL variable, validating webhooks and admission policies, and
webhook calls for DELETE, CONNECT and ``pods/binding``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import ssl
import uuid
import aiohttp
import celpy
import jsonpatch

DEFAULT_TIMEOUT = 10
USER = {"username": "kubernetes-admin", "groups": ["system:masters", "system:authenticated"]}


class Refused(Exception):
    """The write is refused by admission; carried to the client as a Status of ``code``."""

    def __init__(self, code: int, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason


class CallFailed(Exception):
    """The webhook could not be called, or answered something unusable."""


_cel = celpy.Environment()


def compile_errors(webhooks: list[dict]) -> list[tuple[str, str]]:
    """(field, message) for each matchCondition whose CEL does not compile, as the server refuses
    such a configuration when it is written."""
    out = []
    for i, hook in enumerate(webhooks or []):
        for j, condition in enumerate(hook.get("matchConditions") or []):
            try:
                _cel.compile(condition.get("expression", ""))
            except celpy.CELParseError as exc:
                out.append((f"webhooks[{i}].matchConditions[{j}].expression",
                            f"Invalid value: {condition.get('expression')!r}: compilation failed: {exc}"))
    return out


def _label_selector_matches(selector: dict | None, labels: dict) -> bool:
    """A metav1.LabelSelector (matchLabels, matchExpressions); an empty selector matches all."""
    if not selector:
        return True
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def _rule_matches(rule: dict, operation: str, group: str, version: str, resource: str, namespaced: bool) -> bool:
    def has(values: list, value: str) -> bool:
        return "*" in values or value in values

    if not has(rule.get("operations") or [], operation):
        return False
    if not has(rule.get("apiGroups") or [], group) or not has(rule.get("apiVersions") or [], version):
        return False
    main, _, sub = resource.partition("/")
    resources = rule.get("resources") or []
    matched = any(r == resource or r == "*/*" or (r == "*" and not sub) or (r == f"{main}/*" and sub)
                  or (r == f"*/{sub}" and sub) for r in resources)
    if not matched:
        return False
    scope = rule.get("scope", "*")
    return scope == "*" or (scope == "Namespaced") == namespaced


class MutatingAdmission:
    """Runs the MutatingWebhookConfigurations stored in an ApiServer on each create and update."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str, int], str] = {}
        self.calls: list[dict] = []  # the AdmissionReview requests sent, for assertions

    def route_service(self, namespace: str, name: str, port: int, url: str) -> None:
        """Where a ``clientConfig.service`` reference reaches the webhook (the cluster's Service)."""
        self.routes[(namespace, name, port)] = url.rstrip("/")

    async def admit(self, *, configurations: list[dict], operation: str, group: str, version: str, kind: str,
                    resource: str, namespaced: bool, namespace: str, namespace_labels: dict, obj: dict,
                    old: dict | None) -> dict:
        for config in sorted(configurations, key=lambda c: c["metadata"]["name"]):
            for hook in config.get("webhooks") or []:
                if not any(_rule_matches(r, operation, group, version, resource, namespaced)
                           for r in hook.get("rules") or []):
                    continue
                if namespaced or kind == "Namespace":
                    labels = namespace_labels if kind != "Namespace" else (obj["metadata"].get("labels") or {})
                    if not _label_selector_matches(hook.get("namespaceSelector"), labels):
                        continue
                selector = hook.get("objectSelector")
                if not (_label_selector_matches(selector, obj["metadata"].get("labels") or {})
                        or (old is not None and _label_selector_matches(selector,
                                                                        old["metadata"].get("labels") or {}))):
                    continue
                request = self._request(operation, group, version, kind, resource, namespace, obj, old)
                fail_closed = hook.get("failurePolicy", "Fail") == "Fail"
                if not self._conditions_hold(hook, request, fail_closed):
                    continue
                try:
                    obj = await self._call(hook, request, obj)
                except CallFailed as exc:
                    if fail_closed:
                        raise Refused(500, f'Internal error occurred: failed calling webhook "{hook["name"]}": '
                                           f"{exc}", "InternalError") from None
        return obj

    def _request(self, operation, group, version, kind, resource, namespace, obj, old) -> dict:
        main, _, sub = resource.partition("/")
        out = {"uid": str(uuid.uuid4()),
               "kind": {"group": group, "version": version, "kind": kind},
               "resource": {"group": group, "version": version, "resource": main},
               "requestKind": {"group": group, "version": version, "kind": kind},
               "requestResource": {"group": group, "version": version, "resource": main},
               "name": obj["metadata"].get("name", ""), "operation": operation, "userInfo": USER,
               "object": obj, "oldObject": old, "dryRun": False,
               "options": {"apiVersion": "meta.k8s.io/v1",
                           "kind": "CreateOptions" if operation == "CREATE" else "UpdateOptions"}}
        if namespace:
            out["namespace"] = namespace
        if sub:
            out["subResource"] = sub
            out["requestSubResource"] = sub
        return out

    def _conditions_hold(self, hook: dict, request: dict, fail_closed: bool) -> bool:
        """All matchConditions true: call. Any false: skip. Errors (and none false): failurePolicy."""
        conditions = hook.get("matchConditions") or []
        if not conditions:
            return True
        activation = {"object": celpy.json_to_cel(request["object"]),
                      "oldObject": celpy.json_to_cel(request["oldObject"]),
                      "request": celpy.json_to_cel(request)}
        errors = []
        for condition in conditions:
            try:
                result = _cel.program(_cel.compile(condition["expression"])).evaluate(activation)
            except (celpy.CELEvalError, celpy.CELParseError) as exc:
                errors.append(f"{condition['name']}: {exc}")
                continue
            if isinstance(result, celpy.celtypes.BoolType):
                if not bool(result):
                    return False
            elif isinstance(result, celpy.CELEvalError):
                errors.append(f"{condition['name']}: {result.args[0] if result.args else result}")
            else:
                errors.append(f"{condition['name']}: expression evaluated to {type(result).__name__}, not bool")
        if errors and fail_closed:
            raise Refused(500, f'Internal error occurred: failed calling webhook "{hook["name"]}": failed to '
                               f"evaluate match conditions: {'; '.join(errors)}", "InternalError")
        return not errors

    def _target(self, hook: dict) -> tuple[str, str | None]:
        config = hook.get("clientConfig") or {}
        if config.get("url"):
            return config["url"], None
        service = config.get("service") or {}
        key = (service.get("namespace", ""), service.get("name", ""), int(service.get("port", 443)))
        base = self.routes.get(key)
        if base is None:
            raise CallFailed(f'failed to call webhook: service "{key[1]}" in namespace "{key[0]}" port {key[2]} '
                             f"has no route (apiserver.route_service)")
        return base + (service.get("path") or ""), f"{key[1]}.{key[0]}.svc"

    def _tls(self, hook: dict) -> ssl.SSLContext:
        bundle = (hook.get("clientConfig") or {}).get("caBundle")
        if not bundle:
            return ssl.create_default_context()
        try:
            return ssl.create_default_context(cadata=base64.b64decode(bundle).decode())
        except (binascii.Error, UnicodeDecodeError, ssl.SSLError) as exc:
            raise CallFailed(f"failed to call webhook: invalid caBundle: {exc}") from None

    async def _call(self, hook: dict, request: dict, obj: dict) -> dict:
        url, server_name = self._target(hook)
        context = self._tls(hook)
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}
        self.calls.append(request)
        timeout = aiohttp.ClientTimeout(total=hook.get("timeoutSeconds", DEFAULT_TIMEOUT))
        try:
            async with aiohttp.ClientSession(timeout=timeout) as http:
                async with http.post(url, json=review, ssl=context, server_hostname=server_name) as response:
                    if response.status != 200:
                        raise CallFailed(f'failed to call webhook: Post "{url}": the server responded '
                                         f"with status {response.status}")
                    answer = await response.json(content_type=None)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as exc:
            detail = "context deadline exceeded" if isinstance(exc, asyncio.TimeoutError) else str(exc)
            raise CallFailed(f'failed to call webhook: Post "{url}": {detail}') from None
        result = answer.get("response") if isinstance(answer, dict) else None
        if not isinstance(result, dict):
            raise CallFailed("received invalid webhook response: the response is not an AdmissionReview")
        if result.get("uid") != request["uid"]:
            raise CallFailed(f"expected response.uid={request['uid']!r}, got {result.get('uid')!r}")
        if not result.get("allowed"):
            raise self._denied(hook["name"], result.get("status") or {})
        return self._patched(obj, result)

    @staticmethod
    def _denied(name: str, status: dict) -> Refused:
        denied = f'admission webhook "{name}" denied the request'
        code = int(status.get("code") or 0)
        code = code if code >= 400 else 400
        if status.get("message"):
            message = f"{denied}: {status['message']}"
        elif status.get("reason"):
            message = f"{denied}: {status['reason']}"
        else:
            message = f"{denied} without explanation"
        return Refused(code, message, status.get("reason", ""))

    @staticmethod
    def _patched(obj: dict, result: dict) -> dict:
        if not result.get("patch"):
            return obj
        if result.get("patchType") != "JSONPatch":
            raise CallFailed(f"unsupported patch type {result.get('patchType')!r}: only JSONPatch is allowed")
        try:
            operations = json.loads(base64.b64decode(result["patch"]))
            return jsonpatch.apply_patch(obj, operations)
        except (binascii.Error, ValueError, TypeError, jsonpatch.JsonPatchException,
                jsonpatch.JsonPointerException) as exc:
            # not a failure to call: the failurePolicy does not apply, the write fails
            raise Refused(500, f"Internal error occurred: the JSONPatch of webhook could not be applied: {exc}",
                          "InternalError") from None

