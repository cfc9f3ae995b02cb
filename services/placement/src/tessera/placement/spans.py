"""Placement's part of a claim's span: the policy it placed the claim by and what it decided.

The attribute names are `tessera.shared.telemetry`'s (every service's spans use the same); this
module only knows what placement decides: allocated on a node with its device shares, unschedulable
with the reason, or nothing to do (the claim had moved on). It writes on the span current where the
decision is made (the handler's, or a retry's) and costs nothing when that span records nothing.
"""

from __future__ import annotations

from opentelemetry import trace

from tessera.shared import telemetry as tm
from tessera.shared.events import ClaimSpec

from tessera.placement.engine import Placement, Placer, Rejection


def policy(placer: Placer, spec: ClaimSpec) -> str:
    """``tessera.policy``: "<node policy>/<gpu policy>", the claim's own or the service's defaults."""
    return f"{spec.node_policy or placer.default_node_policy}/{spec.gpu_policy or placer.default_gpu_policy}"


def decided(placer: Placer, event, decision: Placement | Rejection, span: trace.Span | None = None) -> None:
    """The engine's answer for ``event`` (a `ClaimRequested`): allocated on a node, or unschedulable."""
    if isinstance(decision, Placement):
        settled(event, "allocated", placer=placer, node=decision.node, devices=decision.shares, span=span)
    else:
        settled(event, "unschedulable", decision.reason, placer=placer, span=span)


def settled(event, decision: str, reason: str = "", *, placer: Placer | None = None, node: str = "",
            devices=(), span: trace.Span | None = None) -> None:
    """Any outcome of handling ``event``: ``decision`` (allocated, unschedulable, released,
    forwarded, unchanged) and its ``reason``; the node and devices when it holds some."""
    span = span or trace.get_current_span()
    if not span.is_recording():  # no exporter: the hot path pays one call
        return
    spec = getattr(event, "spec", None)
    tm.decided(event, decision, reason, span=span,
               **{tm.POLICY: policy(placer, spec) if placer is not None and spec is not None else None,
                  tm.NODE: node, tm.DEVICES: tm.devices_attribute(devices)})
