"""Console entry point: `tessera-enforcer` runs the enforcer service until SIGTERM."""

from __future__ import annotations

import sys

from tessera.shared.runner import main as run_service

from tessera.enforcer.service import build
from tessera.enforcer.settings import EnforcerSettings


def main() -> int:
    return run_service("enforcer", EnforcerSettings, build)


if __name__ == "__main__":
    sys.exit(main())
