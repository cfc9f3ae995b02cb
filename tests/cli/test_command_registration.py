"""Every `tessera` command is registered one way: its module's ``register(sub)`` adds the parser and
sets ``func``, the handler `main` calls (no second attribute, no command left without one)."""

from __future__ import annotations

import argparse

from tessera.cli.__main__ import COMMAND_MODULES, parser


def _leaves(p: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, p
        return
    for name, child in subs[0].choices.items():
        yield from _leaves(child, (*path, name))


def test_every_command_has_a_handler_set_by_its_module():
    leaves = list(_leaves(parser()))
    assert len(leaves) > 15
    for path, p in leaves:
        handler = p.get_default("func")
        assert callable(handler), f"tessera {' '.join(path)} sets no func"
        assert p.get_default("run") is None, f"tessera {' '.join(path)} sets a second handler attribute"
        assert handler.__module__ in {m.__name__ for m in COMMAND_MODULES}, (path, handler.__module__)
