"""`make bench`'s Kubernetes benchmark (kubebench.py) runs end to end at a tiny size, so that it cannot
rot between the runs that measure: what it counts is asserted, never how fast.

- GPU pods on the real kubelet (benchpods.py): three pods through the webhook on the session's
  node all run, none is killed while they are watched, and deleting them gives everything back.
- Simulated nodes (benchfleet.py): five nodes, three pods per allocator: every pod is bound, each
  to a GPU of its own, and each allocator allocated from its own driver only.
"""

from __future__ import annotations

from tessera.shared.kubeclaims import DRIVER

import benchfleet
import benchpods


async def test_gpu_pods_benchmark_runs_them_all_and_gives_them_back(kube_cluster, kube_node, kube_namespace,
                                                                    nats_url, tmp_path):
    run = await benchpods.run_on(kube_cluster, kube_node, nats_url, tmp_path, kube_namespace, 3, hold=3, timeout=120)
    assert run.figures["running"] == 3, run
    assert run.killed == {}, (run.killed, run.log_lines)
    assert run.figures["nodes"] == [kube_node.name]
    assert run.figures["given_back"]
    assert run.figures["admission_p99_s"] > 0 and run.figures["running_p99_s"] > 0


async def test_fleet_benchmark_binds_every_pod_with_each_allocator(tmp_path):
    run = await benchfleet.measure(5, 3, workdir=tmp_path, progress=lambda _msg: None)
    assert {s["allocator"]: (s["bound"], s["pods"]) for s in run.sides} == {"scheduler": (3, 3), "tessera": (3, 3)}
    assert run.distinct_devices == {"scheduler": 3, "tessera": 3}
    assert run.drivers == {"scheduler": {benchfleet.BENCH_DRIVER}, "tessera": {DRIVER}}
