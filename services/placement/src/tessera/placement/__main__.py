"""Console entry point: `tessera-placement` runs the placement service until SIGTERM."""

from __future__ import annotations

import sys

from tessera.shared.runner import main as run_service

from tessera.placement.service import build
from tessera.placement.settings import PlacementSettings


def main() -> int:
    return run_service("placement", PlacementSettings, build)


if __name__ == "__main__":
    sys.exit(main())
