"""The translator's Events about claims inform; they never stop its claim sync. (Seen on the real
API server: an Event refused in a namespace being deleted broke every sync pass of the cluster.)"""

from __future__ import annotations

import pytest

from tessera.shared.kubeapi import Rejected

from tessera.translator.claimwatch import ClaimWatcher

CLAIM = {"metadata": {"name": "c", "namespace": "going", "uid": "00000000-0000-4000-8000-000000000001",
                      "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "u"}]}}


class RefusingCluster:
    def __init__(self) -> None:
        self.tried: list[str] = []

    async def event(self, obj, reason, message, kind="Warning"):
        self.tried.append(obj["kind"])
        raise Rejected(403, "unable to create new content in namespace going because it is being terminated",
                       "Forbidden")


@pytest.mark.parametrize("times", [1, 2])
async def test_a_refused_event_is_not_fatal_and_is_tried_again(times):
    cluster = RefusingCluster()
    watcher = ClaimWatcher(cluster, sink=None, period=30)  # type: ignore[arg-type]
    for _ in range(times):
        await watcher.report(CLAIM, "NoTenant", "namespace names no tenant")
    assert cluster.tried == ["ResourceClaim", "Pod"] * times  # both targets tried, each pass
    assert watcher.reported == set()
