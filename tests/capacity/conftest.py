"""The capacity publisher's slice writer is tested against the strict API-server emulator of
tests/kubernetes: its fixture ``apiserver``, shared from there (tests/kubernetes/kubefixtures.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kubernetes"))
from kubefixtures import apiserver  # noqa: E402,F401 - the fixture, registered by being here
