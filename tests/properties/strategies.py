"""Inputs an attacker or a broken peer may send: arbitrary bytes, arbitrary JSON, and JSON shaped
almost like the real thing (the right ``kind``, the right field names, wrong or odd values)."""

from __future__ import annotations

from hypothesis import strategies as st

scalars = st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) \
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5)
                           | st.dictionaries(st.text(max_size=12), inner, max_size=6), max_leaves=25)

# Field names the Structs use, so that generated objects get past the first field check.
FIELD_NAMES = ["kind", "claim", "tenant", "node", "spec", "devices", "shares", "entries", "claims", "quota",
               "gpus", "memory_mib", "memory_percent", "cores", "uuid", "index", "reason", "state", "payload",
               "service", "subject", "env", "pids", "record_revision", "kube", "labels", "ts", "seq",
               "last_seen", "filtered", "resources", "annotations", "name", "model", "max_shares"]


def shaped(kinds: list[str]) -> st.SearchStrategy:
    """A JSON object with a real ``kind`` and fields named as the Structs name them."""
    return st.builds(
        lambda kind, fields: {**fields, "kind": kind},
        st.sampled_from(kinds) | st.text(max_size=10),
        st.dictionaries(st.sampled_from(FIELD_NAMES), json_values, max_size=8),
    )
