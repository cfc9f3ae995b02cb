"""The kubelet plugin's two unix sockets: their names, and whether a path can be one.

Without a pod uid the names are the fixed ones (``gpu.tessera.dev-reg.sock`` in the kubelet's plugin
registry, ``dra.sock`` in the plugin's directory). With one (the DaemonSet's ``TESSERA_POD_UID``) each
instance's names carry it, so that a rolling update with a surge runs two instances side by side: the
kubelet (1.33+) keeps one endpoint per registration socket and refuses a second registration of the
same endpoint, and an instance that listened on the other's name would unlink the other's socket.

A unix socket's path is at most 107 bytes (``sun_path`` is 108 with its NUL), on both ends: the
kubelet cannot reach a longer one either. ``/var/lib/kubelet/plugins_registry/`` with a uid's name is
95; a kubelet root directory 12 bytes longer than ``/var/lib/kubelet`` is too long for a surge.
"""

from __future__ import annotations

import os
from pathlib import Path

from tessera.shared.kubeclaims import DRIVER

REGISTRATION_SOCKET = f"{DRIVER}-reg.sock"
DRA_SOCKET = "dra.sock"
MAX_PATH_BYTES = 107


def socket_names(pod_uid: str = "") -> tuple[str, str]:
    """(registration socket, DRA socket) of the instance running in pod ``pod_uid`` ("" for none)."""
    if not pod_uid:
        return REGISTRATION_SOCKET, DRA_SOCKET
    return f"{DRIVER}-{pod_uid}-reg.sock", f"dra-{pod_uid}.sock"


def too_long(path: Path) -> int:
    """How many bytes ``path`` is over what a unix socket's path may be (0: it fits)."""
    return max(0, len(os.fsencode(path)) - MAX_PATH_BYTES)
