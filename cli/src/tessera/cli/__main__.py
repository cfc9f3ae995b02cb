"""`tessera`: the command line, a client of Tessera's public interfaces.

  tessera up                 run Tessera locally on a simulated fleet, live GPU table until Ctrl-C
  tessera demo               the same scenario to the end, a summary, exit 0
  tessera submit ...         ask for GPUs in HAMi's vocabulary
  tessera release CLAIM      give a claim back
  tessera status | claims    the fleet table / the claims table (-o json for scripts)
  tessera top | ui           the live fleet, in the terminal / in a browser
  tessera dlq list|replay    dead letters, and sending them back once
  tessera tenant ...         tenant control planes
  tessera bench ...          benchmarks (placement, tenants, kubernetes)
  tessera asyncapi           write (or --check) the AsyncAPI document of the subjects

Each command module registers its commands the same way (`tessera.cli.options`): ``register(sub)``
adds its parsers and sets ``func``; every command that talks to Tessera does so through
`tessera.cli.client.Client`.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from rich.console import Console

from tessera.shared.errors import ConfigError

from tessera.cli import admin, claims, dlq, exitcodes, local, run, tenant, top
from tessera.cli.errors import CliError

err = Console(stderr=True)

# In the order `tessera --help` lists them.
COMMAND_MODULES = (local, claims, top, dlq, admin, tenant, run)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tessera", description="Multi-tenant GPU sharing: the Tessera command line.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(sub)
    return p


def _sigterm_as_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so every `finally` that stops services runs.
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    try:
        result = args.func(args)
        if asyncio.iscoroutine(result):
            result = asyncio.run(result)
        return int(result or 0)
    except CliError as exc:
        err.print(f"[red]error:[/] {exc}")
        return exc.code
    except KeyboardInterrupt:
        return exitcodes.INTERRUPTED
    except (ConfigError, RuntimeError, OSError) as exc:  # a clear line, not a traceback, for what the user can act on
        err.print(f"[red]error:[/] {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
