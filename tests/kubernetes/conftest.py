"""Fixtures of the Kubernetes tests (kubefixtures.py): an API-server emulator with Tessera's CRDs,
``apiserver``, and the services' client seam on it, ``kube``."""

from kubefixtures import apiserver, kube  # noqa: F401 - fixtures, registered by being here
