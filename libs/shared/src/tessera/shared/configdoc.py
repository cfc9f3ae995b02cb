"""docs/configuration.md's tables, rendered from the settings' own declarations.

A settings field made with `tessera.shared.settings.setting` carries its variable, default and a
line saying what it means; this module turns a settings class (or one group of its fields) into a
Markdown table, and a page of text and tables into the document. Which services' classes appear,
in what order and between what prose, is the page's business (docs/configuration.py), so this
module names no service.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from tessera.shared.settings import Setting, variables


@dataclass(frozen=True)
class Table:
    """The rows of ``settings``'s fields in ``group`` (None: the fields of no group), in field order."""

    settings: type
    group: str | None = None


def shown_default(declared: Setting, f: dataclasses.Field) -> str:
    """The default column: the declaration's own words, else the default value as it would be set."""
    if declared.shown is not None:
        return declared.shown
    if declared.required is not None:
        return "required"
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        raise ValueError(f"{declared.variable}: no default to show; declare shown=")
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]
    if isinstance(declared.choices, Mapping):
        value = next(word for word, meant in declared.choices.items() if meant == value)
    if value is None or value == "":
        return "unset"
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, float):
        text = f"{value:g}"
    elif isinstance(value, tuple):
        text = ",".join(value)
    elif isinstance(value, (str, int, Path)):
        text = str(value)
    else:
        raise ValueError(f"{declared.variable}: cannot show the default {value!r}; declare shown=")
    return f"`{text}`"


def table(settings: type, group: str | None = None) -> str:
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    for declared, f, _ in variables(settings):
        if declared.group != group:
            continue
        lines.append(f"| `{declared.variable}` | {shown_default(declared, f)} | {declared.doc} |")
        if declared.file_variable:
            lines.append(f"| `{declared.file_variable}` | unset | {declared.file_doc} |")
    if len(lines) == 2:
        raise ValueError(f"{settings.__name__} has no setting in group {group!r}")
    return "\n".join(lines)


def render(page: Sequence[str | Table]) -> str:
    """The document: text as it is, tables rendered, one blank line between parts. Every field of
    every class that appears must appear (each of its groups in some table), so a new setting cannot
    be left out of the page."""
    placed = {(part.settings, part.group) for part in page if isinstance(part, Table)}
    for settings in {cls for cls, _ in placed}:
        for declared, _, _ in variables(settings):
            if (settings, declared.group) not in placed:
                raise ValueError(f"{declared.variable} ({settings.__name__}, group {declared.group!r}) is in no "
                                 f"table of the page; add Table({settings.__name__}, {declared.group!r})")
    parts = [table(part.settings, part.group) if isinstance(part, Table) else part.strip("\n") for part in page]
    return "\n\n".join(parts) + "\n"


def documented(page: Sequence[str | Table]) -> set[str]:
    """Every variable the page's tables list."""
    found = set()
    for part in page:
        if isinstance(part, Table):
            for declared, _, _ in variables(part.settings):
                found.add(declared.variable)
                if declared.file_variable:
                    found.add(declared.file_variable)
    return found
