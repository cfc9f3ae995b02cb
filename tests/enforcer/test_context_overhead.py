"""A node that declares what a CUDA context costs (TESSERA_VGPU_CONTEXT_OVERHEAD_MIB) has each of a
claim's contexts charged against the claim: `tessera run` on the simulated driver, where the workload
sees its context in cuMemGetInfo and gets the rest of its limit, not all of it."""

from __future__ import annotations


import pytest

from runkit import tenant_cluster, tessera_run


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with tenant_cluster(tmp_path_factory.mktemp("ctx"), TESSERA_VGPU_CONTEXT_OVERHEAD_MIB="64") as cluster:
        yield cluster


async def test_each_context_is_charged_the_overhead_the_node_declares(cluster):
    done = await tessera_run(cluster, "--gpumem", "1000", workload=["--alloc", "900,36,1"])
    assert done.code == 0, done.stderr
    report = done.report()
    # the workload's context takes 64 MiB of its 1000: 936 fit, the next MiB does not
    assert report["alloc"] == [[900, 0], [36, 0], [1, 2]]
    assert report["total_mib"] == 1000 and report["free_mib"] == 0
