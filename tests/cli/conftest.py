"""A local Tessera (tiny profile) shared by the CLI tests of one module that only read it or add
their own claims."""

from __future__ import annotations

import pytest

from kit import start_local


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = start_local(tmp_path_factory.mktemp("cli-cluster"))
    try:
        yield cl
    finally:
        cl.stop()
