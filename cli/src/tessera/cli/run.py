"""`tessera run`: run one command on this node's GPUs under Tessera's limits, HAMi-style.

    tessera run --tenant T [--gpus N] [--gpumem MiB | --gpumem-percent P] [--gpucores P] -- CMD...

It submits a claim pinned to this node (``--node``, else $TESSERA_NODE, else the hostname), waits
until the node's enforcer has prepared it, runs CMD with the prepared environment (libvgpu.so
preloaded, the limits, the visible GPUs), passes its output, signals and exit code through, and
releases the claim when CMD ends, however it ends.

Who launches: this command, not the enforcer. The workload is the user's process: its terminal,
stdin/stdout/stderr, working directory, user id and exit status belong to whoever typed the command,
and a launch by a root daemon would have to forward every one of those over the bus. The enforcer
still knows the workload without having started it, from kernel locks that die with their holders:
this command holds the claim's ``owner.lock`` (path in the prepared environment) for as long as it
lives, and every CUDA process of the workload holds its slot in the claim's accounting file. The
``running`` event carries the child's pid for observers. If this command is SIGKILLed, its child
gets SIGKILL from the kernel (PR_SET_PDEATHSIG), the owner lock drops, and the enforcer's leak
reclaim releases the claim within TESSERA_RECLAIM_SECONDS (killing any grandchild left behind).

Claim ids start with ``run-``: that is how the enforcer knows the claim has an owner to watch even
before the owner has taken its lock.

Exit codes: CMD's own; 128+N when CMD was killed by signal N; 3 when the claim is unschedulable;
5 when it was not prepared in time (the CLI's table, tessera.cli.exitcodes); 126/127 when CMD cannot be executed / found; 1 for other errors.
CMD runs in its own process group (so a signal forwarded to it reaches its children too); SIGINT and
SIGTERM sent to `tessera run` are forwarded to that group.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import logging
import os
import signal
import socket
import sys
import uuid

from rich.console import Console

from tessera.shared import api, subjects
from tessera.shared.events import ClaimPrepared, ClaimRecord, ClaimRunning, claim_decoder
from tessera.shared.workload import OWNER_LOCK_VAR, RUN_CLAIM_PREFIX

from tessera.cli import exitcodes
from tessera.cli.client import Client
from tessera.cli.errors import CliError
from tessera.cli.gpuflags import add_gpu_flags, annotations_from, resources_from
from tessera.cli.options import add_identity_args

err = Console(stderr=True)

EXIT_UNSCHEDULABLE = exitcodes.UNSCHEDULABLE  # (the CLI's table: tessera.cli.exitcodes)
EXIT_TIMEOUT = exitcodes.TIMEOUT
EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127
PATH_LIKE = ("LD_PRELOAD", "LD_LIBRARY_PATH")  # prepended to the caller's value, not replacing it
RELEASE_WAIT_SECONDS = 15.0


def register(sub) -> None:
    p = sub.add_parser(
        "run",
        help="run a command on this node's GPUs under a Tessera claim",
        description="Submit a claim pinned to this node, run CMD under its limits, release it when CMD ends.",
        epilog="example: tessera run --tenant alpha --gpumem 8000 --gpucores 30 -- python train.py",
    )
    p.add_argument("--tenant", required=True)
    add_gpu_flags(p, offered=("--gpumem", "--gpumem-percent", "--gpucores", "--priority", "--use-gpuuuid", "--gpu-policy"),
                  exclusive_memory=True)
    p.add_argument("--node", help="the node to run on (default: $TESSERA_NODE, else the hostname)")
    add_identity_args(p)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the claim to be prepared")
    p.add_argument("--quiet", "-q", action="store_true", help="no status lines on stderr")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    p.set_defaults(func=cmd_run)


def child_env(base: dict[str, str], prepared: dict[str, str]) -> dict[str, str]:
    env = dict(base)
    for key, value in prepared.items():
        if key == OWNER_LOCK_VAR:
            continue  # the owner is this command, not the workload
        if key in PATH_LIKE and env.get(key):
            env[key] = f"{value}:{env[key]}"
        else:
            env[key] = value
    return env


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL from the kernel if `tessera run` dies, however it dies."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


class Run:
    def __init__(self, client: Client, args, claim: str, node: str, command: list[str]) -> None:
        self.client = client
        self.args = args
        self.claim = claim
        self.node = node
        self.command = command
        self.proc: asyncio.subprocess.Process | None = None
        self.signalled: int | None = None
        self.interrupt = asyncio.Event()
        self.owner_fd: int | None = None

    def say(self, text: str) -> None:
        if not self.args.quiet:
            err.print(f"[dim]tessera run:[/] {text}", highlight=False, soft_wrap=True)

    # --- signals ---------------------------------------------------------------------------

    def _on_signal(self, sig: int) -> None:
        self.signalled = sig
        self.interrupt.set()
        self._forward(sig)

    def _forward(self, sig: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    # --- the steps -------------------------------------------------------------------------

    async def submit(self) -> None:
        await self.client.submit(api.SubmitRequest(
            tenant=self.args.tenant, resources=resources_from(self.args), annotations=annotations_from(self.args),
            claim=self.claim, node=self.node, scheduling_priority=self.args.scheduling_priority,
            # the uid CMD will run as: the enforcer lets it alone write the claim's accounting file
            workload_uid=os.geteuid(),
        ))

    async def wait_prepared(self) -> ClaimRecord | int:
        """The prepared record, or the exit code to leave with. Watches the claim (Client.wait_for)
        rather than polling it, and gives up at once on SIGINT/SIGTERM."""
        final = {"prepared", "running", "unschedulable", "failed", "released"}
        waiting = asyncio.create_task(self.client.wait_for(self.claim, final, timeout=self.args.timeout))
        interrupted = asyncio.create_task(self.interrupt.wait())
        try:
            await asyncio.wait({waiting, interrupted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            interrupted.cancel()
        if not waiting.done():
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            return 128 + (self.signalled or signal.SIGINT)
        try:
            record = waiting.result()
        except CliError as exc:
            if exc.code != exitcodes.TIMEOUT:
                raise
            record = await self.client.claim(self.claim)
            state = record.state if record is not None else "unknown"
            hint = {"requested": "is placement running?",
                    "allocated": f"is the enforcer of {self.node} running?"}.get(state, "")
            err.print(f"[red]tessera run:[/] claim {self.claim} is still {state} after {self.args.timeout:.0f}s"
                      + (f"; {hint}" if hint else ""), highlight=False, soft_wrap=True)
            return EXIT_TIMEOUT
        if record.state == "unschedulable":
            err.print(f"[red]tessera run:[/] claim {self.claim} cannot be placed on node {self.node}: "
                      f"{record.reason}", highlight=False, soft_wrap=True)
            return EXIT_UNSCHEDULABLE
        if record.state in ("failed", "released"):
            err.print(f"[red]tessera run:[/] claim {self.claim} {record.state}: {record.reason}", highlight=False,
                      soft_wrap=True)
            return exitcodes.FAILED
        return record

    async def prepared_event(self, record: ClaimRecord) -> ClaimPrepared:
        """The ``prepared`` event (with the environment); the record may be written just before it."""
        subject = subjects.claim(record.tenant, self.claim, "prepared", subjects.ANY_NODE)
        for _ in range(100):
            try:
                if self.client.as_tenant:
                    event = await self.client.prepared(self.claim)
                else:
                    msg = await self.client.bus.last_message(subjects.STREAM_CLAIMS, subject)
                    event = claim_decoder.decode(msg.data)
                if isinstance(event, ClaimPrepared):
                    return event
            except Exception:  # not in the stream yet
                pass
            await asyncio.sleep(0.1)
        raise CliError(f"claim {self.claim} is prepared but its 'prepared' event is not on {subject}")

    def take_ownership(self, prepared: ClaimPrepared) -> None:
        path = prepared.env.get(OWNER_LOCK_VAR)
        if not path:
            raise CliError(f"the enforcer of {prepared.node} did not name an owner lock; is it older than this CLI?")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise CliError(
                f"claim {self.claim} was prepared on node {prepared.node}, but its files are not reachable here"
                f" ({exc.strerror}: {path}); run on that node, or pass --node with this machine's node name"
            ) from None
        fcntl.flock(fd, fcntl.LOCK_SH)
        self.owner_fd = fd

    async def launch(self, prepared: ClaimPrepared) -> int | None:
        env = child_env(dict(os.environ), prepared.env)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.command, env=env, process_group=0, preexec_fn=_die_with_parent
            )
        except FileNotFoundError:
            err.print(f"[red]tessera run:[/] {self.command[0]}: command not found", highlight=False, soft_wrap=True)
            return EXIT_NOT_FOUND
        except PermissionError:
            err.print(f"[red]tessera run:[/] {self.command[0]}: permission denied", highlight=False, soft_wrap=True)
            return EXIT_CANNOT_EXECUTE
        except OSError as exc:
            err.print(f"[red]tessera run:[/] {self.command[0]}: {exc.strerror}", highlight=False, soft_wrap=True)
            return EXIT_CANNOT_EXECUTE
        if self.signalled is not None:  # a signal that arrived while we were starting it
            self._forward(self.signalled)
        try:
            if self.client.as_tenant:  # a tenant publishes nothing itself: the translator does, for it
                await self.client.running(self.claim, [self.proc.pid])
            else:
                await self.client.bus.publish(
                    subjects.claim(prepared.tenant, self.claim, "running", prepared.node),
                    ClaimRunning(claim=self.claim, tenant=prepared.tenant, node=prepared.node, pids=[self.proc.pid]),
                    msg_id=f"{self.claim}:running",
                )
        except Exception as exc:  # the workload runs regardless; the enforcer watches the owner lock
            self.say(f"could not publish 'running' ({exc})")
        return None

    async def watch_claim(self) -> None:
        """If someone else releases the claim (tessera release, leak reclaim), stop the workload."""
        while True:
            await asyncio.sleep(1.0)
            try:
                record = await self.client.claim(self.claim)
            except Exception:
                continue
            if record is not None and record.state in ("released", "failed"):
                err.print(f"[yellow]tessera run:[/] claim {self.claim} was {record.state} ({record.reason});"
                          " stopping the command", highlight=False, soft_wrap=True)
                self._forward(signal.SIGTERM)
                await asyncio.sleep(10)
                self._forward(signal.SIGKILL)
                return

    async def release(self, reason: str) -> None:
        try:
            await self.client.release(self.claim, reason=reason)
            await self.client.wait_for(self.claim, {"released"}, timeout=RELEASE_WAIT_SECONDS)
        except CliError as exc:
            err.print(f"[yellow]tessera run:[/] could not confirm the release of {self.claim} ({exc}); the"
                      f" node's enforcer reclaims it once this command has exited", highlight=False, soft_wrap=True)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            await self.submit()
            try:
                outcome = await self.wait_prepared()
                if isinstance(outcome, int):
                    return outcome
                prepared = await self.prepared_event(outcome)
                self.take_ownership(prepared)
                devices = ", ".join(f"{d.uuid} {d.memory_mib} MiB" + (f" {d.cores}%" if d.cores else "")
                                    for d in outcome.devices)
                self.say(f"claim {self.claim} on {prepared.node}: {devices}")
                code = await self.launch(prepared)
                if code is not None:
                    return code
                watcher = asyncio.create_task(self.watch_claim())
                try:
                    returncode = await self.proc.wait()
                finally:
                    watcher.cancel()
                    await asyncio.gather(watcher, return_exceptions=True)
                code = exit_code(returncode)
                self.say(f"command exited with {code}")
                return code
            finally:
                reason = "tessera run ended" if self.proc is None else f"workload exited ({exit_code(self.proc.returncode or 0)})"
                await asyncio.shield(self.release(reason))
        finally:
            if self.owner_fd is not None:
                os.close(self.owner_fd)
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)


async def cmd_run(args) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CliError("give the command to run after --, e.g. tessera run --tenant alpha -- python train.py", code=2)
    if args.timeout <= 0:
        raise CliError(f"--timeout {args.timeout} must be positive", code=2)
    node = args.node or os.environ.get("TESSERA_NODE") or socket.gethostname().lower()
    # The bus logs reconnects as warnings; on a terminal shared with the workload's output, only errors.
    logging.getLogger("tessera.bus").setLevel(logging.ERROR)
    client = await Client.from_args(args)
    try:
        return await Run(client, args, f"{RUN_CLAIM_PREFIX}{uuid.uuid4().hex[:16]}", node, command).run()
    finally:
        await client.close()


if __name__ == "__main__":  # pragma: no cover - `tessera run` is the entry point
    sys.exit("use: tessera run --tenant T -- CMD...")
