"""The Kubernetes tests' fixtures, in a module of their own so that tests outside this folder (the
control-plane manager's host, the capacity publisher's slices, the container tests) use the same
strict emulator: their conftest puts this folder on ``sys.path`` and imports the fixtures.

``apiserver`` is the emulator of ``apiserver.py`` started on a free port with every CRD under
deploy/k8s/crds installed (as ``kubectl apply -f deploy/k8s/crds`` would); ``kube`` is the client
seam every service uses, ``tessera.shared.kubeapi.KubeApi``, pointed at it.
"""

from __future__ import annotations

import pytest

from apiserver import ApiServer
from kube_objects import DEPLOY_K8S
from tessera.shared.kubeapi import KubeApi


@pytest.fixture
async def apiserver():
    server = ApiServer()
    await server.install_crds(DEPLOY_K8S / "crds")
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def kube(apiserver):
    api = KubeApi.for_url(apiserver.url)
    try:
        yield api
    finally:
        await api.close()


@pytest.fixture
async def admin(kube_plane):
    """The test's own hands on the real host cluster (a user's kubectl, cluster admin)."""
    api = KubeApi.for_kubeconfig(str(kube_plane.admin_kubeconfig))
    try:
        yield api
    finally:
        await api.close()
