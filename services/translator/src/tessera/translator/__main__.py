"""Console entry point: `tessera-translator` runs the translator service until SIGTERM."""

from __future__ import annotations

import sys

from tessera.shared.runner import main as run_service

from tessera.translator.service import build
from tessera.translator.settings import TranslatorSettings


def main() -> int:
    return run_service("translator", TranslatorSettings, build)


if __name__ == "__main__":
    sys.exit(main())
