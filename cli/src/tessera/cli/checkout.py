"""The Tessera checkout for the commands that use its files (profiles/, .run/, docs/, deploy/k8s/,
bench/): `tessera.shared.checkout` finds it by its marker files; here, the usage error of a command
that needs it when there is none.
"""

from __future__ import annotations

from pathlib import Path

from tessera.shared.checkout import MARKERS, WORKSPACE_PROJECT, default_starts, find, is_checkout

from tessera.cli import exitcodes
from tessera.cli.errors import CliError

__all__ = ["MARKERS", "WORKSPACE_PROJECT", "default_starts", "find", "is_checkout", "require"]


def require(what: str, starts: tuple[Path, ...] | None = None) -> Path:
    """The checkout's root, or a usage error naming ``what`` needed it and how to do without."""
    starts = starts or default_starts()
    root = find(starts)
    if root is None:
        raise CliError(
            f"{what} needs the Tessera checkout, and none was found: no directory above "
            f"{' or '.join(str(s) for s in starts)} holds {' and '.join(MARKERS)} (project "
            f"{WORKSPACE_PROJECT!r}). Run tessera from inside the repository, or give the path explicitly",
            code=exitcodes.USAGE,
        )
    return root
