"""Console entry point: `tessera-capacity` runs the capacity service until SIGTERM."""

from __future__ import annotations

import sys

from tessera.shared.runner import main as run_service

from tessera.capacity.service import build
from tessera.capacity.settings import CapacitySettings


def main() -> int:
    return run_service("capacity", CapacitySettings, build)


if __name__ == "__main__":
    sys.exit(main())
