"""Where the Tessera checkout is, for whatever uses its files (the CLI's profiles/, .run/, docs/;
the benchmarks' trace beside it): found by its marker files, never by counting parent directories.

The checkout is the directory that holds the workspace's ``pyproject.toml`` (project
``tessera-workspace``) next to the ``Makefile``. It is looked for upwards from the caller's module
(an editable install, or a virtual environment inside the checkout) and then from the working
directory (an install elsewhere, run from inside the repository).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

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


def default_starts(module_file: str = __file__) -> tuple[Path, Path]:
    """Where the search begins: the directory of ``module_file``, then the working directory."""
    return Path(module_file).resolve().parent, Path.cwd().resolve()


def find(starts: tuple[Path, ...] | None = None) -> Path | None:
    """The checkout's root: the first directory, going up from each start in turn, that holds the
    markers; None when there is none."""
    for start in starts or default_starts():
        for path in (start, *start.parents):
            if is_checkout(path):
                return path
    return None
