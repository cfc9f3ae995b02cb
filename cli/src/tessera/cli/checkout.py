"""Where the Tessera checkout is, for the commands that use its files (profiles/, .run/, docs/,
deploy/k8s/, bench/): found by its marker files, never by counting parent directories.

The checkout is the directory that holds the workspace's ``pyproject.toml`` (project
``tessera-workspace``) next to the ``Makefile``. It is looked for upwards from this module (an
editable install, or a virtual environment inside the checkout) and then from the working
directory (an install elsewhere, run from inside the repository).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from tessera.cli import exitcodes
from tessera.cli.errors import CliError

WORKSPACE_PROJECT = "tessera-workspace"
MARKERS = ("pyproject.toml", "Makefile")


def is_checkout(path: Path) -> bool:
    if not all((path / marker).is_file() for marker in MARKERS):
        return False
    try:
        project = tomllib.loads((path / "pyproject.toml").read_text()).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return False
    return project.get("name") == WORKSPACE_PROJECT


def default_starts() -> tuple[Path, Path]:
    """Where the search begins: this module's directory, then the working directory."""
    return Path(__file__).resolve().parent, Path.cwd().resolve()


def find(starts: tuple[Path, ...] | None = None) -> Path | None:
    """The checkout's root: the first directory, going up from each start in turn, that holds the
    markers; None when there is none."""
    for start in starts or default_starts():
        for path in (start, *start.parents):
            if is_checkout(path):
                return path
    return None


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
