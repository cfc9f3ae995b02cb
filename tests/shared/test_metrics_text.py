"""Series a service writes as Prometheus text itself (`tessera.shared.metrics.Exposition`) parse as
the families prometheus-client would have made, with label values escaped and parts replaced whole."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tessera.shared.metrics import Exposition, ServiceMetrics, labelset, line


def parse(text: bytes) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text.decode())}


def test_parts_render_as_one_family_each_and_are_replaced_whole():
    text = Exposition([("tessera_example_bytes", "an example"), ("tessera_other", "another")])
    text.set("n1", {"tessera_example_bytes": [line("tessera_example_bytes", labelset(["node"], ["n1"]), 3)]})
    text.set("n2", {"tessera_example_bytes": [line("tessera_example_bytes", labelset(["node"], ["n2"]), 0.5)],
                    "tessera_other": [line("tessera_other", labelset(["node"], ["n2"]), float("nan"))]})
    got = parse(text.render())
    assert [(s.labels, s.value) for s in got["tessera_example_bytes"]] == [({"node": "n1"}, 3.0), ({"node": "n2"}, 0.5)]
    assert got["tessera_other"][0].value != got["tessera_other"][0].value  # NaN
    text.set("n1", {"tessera_example_bytes": [line("tessera_example_bytes", labelset(["node"], ["n1"]), 4)]})
    text.keep_only(["n1"])
    got = parse(text.render())
    assert [(s.labels, s.value) for s in got["tessera_example_bytes"]] == [({"node": "n1"}, 4.0)]
    assert got.get("tessera_other", []) == []


def test_label_values_are_escaped():
    awkward = 'a "quoted"\\ value\nwith a newline'
    text = Exposition([("tessera_example", "x")])
    text.set("p", {"tessera_example": [line("tessera_example", labelset(["v"], [awkward]), 1)]})
    [s] = parse(text.render())["tessera_example"]
    assert s.labels == {"v": awkward}


def test_a_service_serves_its_text_after_its_registry():
    metrics = ServiceMetrics("placement", "p-0")
    text = Exposition([("tessera_example", "x")])
    text.set("p", {"tessera_example": [line("tessera_example", labelset(["v"], ["1"]), 1)]})
    metrics.text(text)
    got = parse(metrics.render())
    assert got["tessera_service_info"][0].labels == {"service": "placement", "instance": "p-0"}
    assert got["tessera_example"][0].value == 1
