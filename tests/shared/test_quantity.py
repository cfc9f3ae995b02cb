"""Quantities by value (tessera.shared.quantity): the forms the API server writes back compare
equal to the forms Tessera wrote; text that is not a quantity is refused with what was expected."""

from __future__ import annotations

from decimal import Decimal

import pytest

from tessera.shared import quantity


@pytest.mark.parametrize("written, read_back", [
    ("20480Mi", "20Gi"), ("1024Ki", "1Mi"), ("1000m", "1"), ("1e3", "1k"), ("1500M", "1.5G"),
    ("0.5", "500m"), ("40960Mi", "40Gi"), (100, "100"),
])
def test_the_server_s_canonical_spelling_is_the_same_value(written, read_back):
    assert quantity.equal(written, read_back)


def test_different_values_differ():
    assert not quantity.equal("20Gi", "20G")
    assert not quantity.equal("1Mi", None)
    assert quantity.equal(None, None)


def test_values():
    assert quantity.parse("20Gi") == 20 << 30
    assert quantity.parse("100m") == Decimal("0.1")
    assert quantity.parse("-2k") == -2000
    assert quantity.parse("1E-2") == Decimal("0.01")
    assert quantity.whole_mib("20Gi") == 20480
    assert quantity.whole_mib("1000") is None  # not a whole MiB
    assert quantity.binary_suffix("8Gi") == "Gi" and quantity.binary_suffix("8G") == ""


@pytest.mark.parametrize("bad", ["lots", "1.2.3", "10 Gi", "Gi", "1gi", ""])
def test_text_that_is_not_a_quantity_is_refused_saying_the_form(bad):
    with pytest.raises(quantity.QuantityError, match="is not a Kubernetes quantity"):
        quantity.parse(bad)
