"""A local Tessera (tiny profile) shared by the CLI tests of one module that only read it or add
their own claims."""

from __future__ import annotations

import pytest

from tessera.cli.cluster import LocalCluster

from clikit import PROFILES


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = LocalCluster(workdir=tmp_path_factory.mktemp("cli-cluster"), profile=PROFILES / "tiny.yaml")
    cl.start()
    try:
        cl.wait_ready(90)
        yield cl
    finally:
        cl.stop()
