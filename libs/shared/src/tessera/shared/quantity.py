"""Kubernetes quantities (`resource.Quantity`) read as values, once for every service.

The API server canonicalizes every quantity it stores: `20480Mi` is read back as `20Gi`, `1000m`
as `1`, `1e3` as `1k`. Anything Tessera wrote and reads back (a claim's `consumedCapacity`, a
slice's capacity, a pod's requests) must therefore be compared by value, never as text. The grammar
is the one `k8s.io/apimachinery/pkg/api/resource` accepts: a signed decimal number, then a binary
suffix (Ki Mi Gi Ti Pi Ei), a decimal SI suffix (n u m "" k M G T P E) or an exponent (e3, E-2).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
            "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"),
            "P": Decimal("1e15"), "E": Decimal("1e18")}
_FORM = re.compile(r"^([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?$")
MIB = 1 << 20


class QuantityError(ValueError):
    """Text that is not a Kubernetes quantity; the message quotes it and says the form expected."""


def parse(text: str | int | float) -> Decimal:
    """The value of a quantity (`"20Gi"` -> 21474836480); QuantityError if it is not one."""
    raw = str(text).strip()
    match = _FORM.match(raw)
    if not match:
        raise QuantityError(f"{raw!r} is not a Kubernetes quantity (a number with an optional suffix: "
                            "Ki Mi Gi Ti Pi Ei, n u m k M G T P E, or an exponent such as e3)")
    number, suffix = match.group(1), match.group(2) or ""
    try:
        value = Decimal(number)
    except InvalidOperation as exc:  # pragma: no cover - the pattern admits only numbers
        raise QuantityError(f"{raw!r} is not a Kubernetes quantity") from exc
    if suffix in _BINARY:
        return value * _BINARY[suffix]
    if suffix[:1] in ("e", "E"):
        return value.scaleb(int(suffix[1:]))
    return value * _DECIMAL[suffix]


def binary_suffix(text: str) -> str:
    """The binary suffix a quantity is written with (`"Mi"`), or "" for any other form."""
    match = _FORM.match(str(text).strip())
    suffix = (match.group(2) or "") if match else ""
    return suffix if suffix in _BINARY else ""


def equal(a: str | int | None, b: str | int | None) -> bool:
    """Whether two quantities have the same value (None only equals None; text that is not a
    quantity only equals the same text)."""
    if a is None or b is None:
        return a is b
    try:
        return parse(a) == parse(b)
    except QuantityError:
        return str(a).strip() == str(b).strip()


def whole_mib(text: str | int) -> int | None:
    """A quantity of bytes as a whole number of MiB, or None if it is not one (or not a quantity)."""
    try:
        value = parse(text)
    except QuantityError:
        return None
    if value < 0 or value % MIB:
        return None
    return int(value // MIB)
