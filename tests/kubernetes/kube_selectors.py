"""Label and field selectors as the API server parses them, for the emulator's list and watch.

Services find their objects by selector (a node's slices by ``spec.nodeName``, a tenant's pods by
label); an emulator that ignored selectors would hand them everything and hide a wrong query. The
grammar is the apimachinery one: comma-separated requirements, ``k=v``/``k==v``/``k!=v``,
``k in (a,b)``, ``k notin (a,b)``, ``k`` and ``!k``; fields take only ``=``, ``==`` and ``!=``
and only the fields each resource supports (others are a 400, as on a real server).
"""

from __future__ import annotations

import re
from collections.abc import Callable

Matcher = Callable[[dict], bool]

_KEY = r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?"


class SelectorError(ValueError):
    """The selector does not parse; the API server answers 400 BadRequest."""


def _split(selector: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in selector:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    if depth:
        raise SelectorError(f"unbalanced parentheses in {selector!r}")
    parts.append(current.strip())
    return [p for p in parts if p]


def label_selector(selector: str | None) -> Matcher:
    """A predicate over an object's ``metadata.labels``."""
    if not selector:
        return lambda obj: True
    requirements = [_label_requirement(part) for part in _split(selector)]
    return lambda obj: all(req((obj.get("metadata") or {}).get("labels") or {}) for req in requirements)


def _label_requirement(text: str) -> Callable[[dict], bool]:
    if m := re.fullmatch(rf"({_KEY})\s+(in|notin)\s+\(([^)]*)\)", text):
        key, op = m.group(1), m.group(3)
        values = {v.strip() for v in m.group(4).split(",") if v.strip()}
        if op == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    if m := re.fullmatch(rf"({_KEY})\s*(==|=|!=)\s*([-A-Za-z0-9_.]*)", text):
        key, op, value = m.group(1), m.group(3), m.group(4)
        if op == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: labels.get(key) == value
    if m := re.fullmatch(rf"!\s*({_KEY})", text):
        key = m.group(1)
        return lambda labels: key not in labels
    if m := re.fullmatch(rf"({_KEY})", text):
        key = m.group(1)
        return lambda labels: key in labels
    raise SelectorError(f"unable to parse requirement: {text!r}")


def dotted(obj: dict, path: str):
    value = obj
    for part in path.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def field_selector(selector: str | None, supported: frozenset[str], resource: str) -> Matcher:
    """A predicate over an object's fields; a field the resource does not index is refused."""
    if not selector:
        return lambda obj: True
    requirements = []
    for part in _split(selector):
        m = re.fullmatch(r"([A-Za-z0-9_.]+)\s*(==|=|!=)\s*(.*)", part)
        if not m:
            raise SelectorError(f"invalid field selector: {part!r}")
        field, op, value = m.group(1), m.group(2), m.group(3).strip()
        if field not in supported:
            raise SelectorError(f'field label not supported: {field} for {resource}')
        requirements.append((field, op == "!=", value))

    def matches(obj: dict) -> bool:
        for field, negate, value in requirements:
            actual = dotted(obj, field)
            actual = "" if actual is None else str(actual)
            if (actual == value) == negate:
                return False
        return True

    return matches
