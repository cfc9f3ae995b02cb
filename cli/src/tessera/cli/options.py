"""The options several commands share, declared once: who to connect as, and how to print.

Every command module registers itself the same way, ``register(sub)``: it adds its parsers to the
``tessera`` subcommands and sets ``func`` to its handler, ``(args) -> int`` or a coroutine of it.
"""

from __future__ import annotations

import argparse


def add_identity_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats", default=None, help="NATS URL (default: $TESSERA_NATS_URL or nats://127.0.0.1:4222)")
    parser.add_argument("--user", default=None,
                        help="NATS user to connect as, e.g. a tenant's (default: $TESSERA_NATS_USER, else the URL's)")
    parser.add_argument("--password-file", default=None,
                        help="file holding that user's password (default: $TESSERA_NATS_PASSWORD_FILE)")


def add_output_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", choices=("table", "json"), default="table",
                        help="table (default) or json: one JSON document on stdout, fields in docs/cli.md")


def client_command(sub: argparse._SubParsersAction, name: str, help_: str) -> argparse.ArgumentParser:
    """A command that talks to Tessera over NATS: its parser, with the identity options."""
    parser = sub.add_parser(name, help=help_, description=help_)
    add_identity_args(parser)
    return parser
