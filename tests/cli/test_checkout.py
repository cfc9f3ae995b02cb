"""The CLI finds the checkout by its marker files (the workspace's pyproject.toml beside the
Makefile), from wherever it starts below it, and says clearly when there is none."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.cli import checkout, exitcodes
from tessera.cli.errors import CliError

REPO = Path(__file__).resolve().parents[2]  # (the test knows its own place; the CLI must not count)


def test_the_checkout_is_found_from_this_module_and_from_deep_inside_it():
    assert checkout.find() == REPO
    assert checkout.find((REPO / "services" / "placement" / "src",)) == REPO


def test_a_directory_with_other_markers_is_not_the_checkout(tmp_path):
    (tmp_path / "Makefile").write_text("all:\n")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "someone-else"\n')
    (tmp_path / "sub").mkdir()
    assert checkout.find((tmp_path / "sub",)) is None
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "tessera-workspace"\n')
    assert checkout.find((tmp_path / "sub",)) == tmp_path


def test_no_checkout_is_a_usage_error_that_says_what_was_looked_for(tmp_path):
    with pytest.raises(CliError) as caught:
        checkout.require("tessera asyncapi without --output", (tmp_path,))
    assert caught.value.code == exitcodes.USAGE
    message = str(caught.value)
    assert "tessera asyncapi without --output" in message and str(tmp_path) in message
    assert "pyproject.toml and Makefile" in message and "tessera-workspace" in message
