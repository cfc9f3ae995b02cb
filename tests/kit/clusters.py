"""A whole local Tessera (nats-server and the five services as processes) for a test, one way.

`start_local` starts one and waits until every service is ready (stopping it again when that
fails); the `start_cluster` fixture is the async factory a test awaits, and stops every cluster it
started when the test ends. Directory kits (tests/enforcer/runkit.py) add their own defaults on top.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Awaitable, Callable, Iterator

import pytest

from tessera.cli.cluster import LocalCluster

PROFILES = Path(__file__).resolve().parents[1] / "profiles"
READY_SECONDS = 90


def start_local(workdir: Path, profile: str = "tiny.yaml", **kwargs) -> LocalCluster:
    """A started, ready cluster of ``tests/profiles/<profile>`` in ``workdir``; kwargs go to
    `LocalCluster` (``extra_env``, ``nats_url``, ``placement_replicas``, ``otlp_endpoint``, ...)."""
    cluster = LocalCluster(workdir=workdir, profile=PROFILES / profile, **kwargs)
    try:
        cluster.start()
        cluster.wait_ready(READY_SECONDS)
    except BaseException:
        cluster.stop()
        raise
    return cluster


StartCluster = Callable[..., Awaitable[LocalCluster]]


@pytest.fixture
def start_cluster(tmp_path) -> Iterator[StartCluster]:
    """Factory: ``await start_cluster("tiny.yaml", placement_replicas=2, ...)``; ``stop_timeout``
    bounds each service's orderly stop at the end of the test (`LocalCluster.stop`)."""
    clusters: list[tuple[LocalCluster, float]] = []

    async def start(profile: str = "tiny.yaml", *, stop_timeout: float = 10.0, **kwargs) -> LocalCluster:
        cluster = await asyncio.to_thread(start_local, tmp_path / f"cluster{len(clusters)}", profile, **kwargs)
        clusters.append((cluster, stop_timeout))
        return cluster

    try:
        yield start
    finally:
        for cluster, stop_timeout in clusters:
            cluster.stop(timeout=stop_timeout)
