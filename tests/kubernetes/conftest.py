"""Fixtures of the Kubernetes tests (kubefixtures.py): an API-server emulator with Tessera's CRDs,
``apiserver``, and the services' client seam on it, ``kube``; (tesseraworld.py) ``world``: translator
and placement in this process on the real control plane, and Node objects for them to place on;
(tenantpodsync.py) ``tenant_cluster``: a tenant's own real control plane, for a test module, and
``syncing_manager``: the control-plane manager running each Ready tenant's pod syncer; and the
manager's tenant planes (tests/controlplane: ``planes``, with ``binaries`` and ``secured_nats``)."""

from kubefixtures import admin, apiserver, kube  # noqa: F401 - fixtures, registered by being here
from tesseraworld import world  # noqa: F401 - a fixture, registered by being here
from tenantpodsync import syncing_manager, tenant_cluster  # noqa: F401 - fixtures, registered by being here
from controlplane.conftest import secured_nats  # noqa: F401 - a fixture, registered by being here
from controlplane.planes import binaries, kube_mode, planes  # noqa: F401 - fixtures, registered by being here
