"""The one exception a command raises for what the user should read (no traceback)."""

from __future__ import annotations

from tessera.cli import exitcodes


class CliError(Exception):
    """Something the user should read: printed without a traceback, exit code 1 (or .code, one of
    `tessera.cli.exitcodes`)."""

    def __init__(self, message: str, code: int = exitcodes.FAILED) -> None:
        super().__init__(message)
        self.code = code
