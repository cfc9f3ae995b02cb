"""`make reliability`: every fault scenario in its long form, and bench/reliability.md from the run.

Each scenario starts a fresh local Tessera (tests/faults/scenarios.py); the table has one row per
scenario, and every finding of the auditor is listed under it, so a non-zero figure says why.
Usage: ``python tests/faults/reliability.py [--out bench/reliability.md] [--only a,b] [--label TEXT]``.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import scenarios  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "log", "--oneline", "-1"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "reliability.md"))
    parser.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    parser.add_argument("--label", default="", help="what this run is (printed above its table)")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(scenarios.SCENARIOS)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tessera-reliability-") as tmp:
        for i, name in enumerate(names):
            row = await scenarios.run(name, Path(tmp) / name, scenarios.Form.long(), seed=100 + i)
            print(scenarios.table([row]).splitlines()[-1], flush=True)
            rows.append(row)
    text = [f"# Reliability: the fault suite, long form{' — ' + args.label if args.label else ''}", "",
            f"Commit: `{_commit()}`. `make reliability` regenerates this page "
            "(tests/faults/reliability.py).", "",
            "Each scenario: a fresh local Tessera (nats-server, the five services as processes, placement "
            "in two replicas behind a fault proxy, tiny.yaml: 2 nodes x 2 H100), two tenants with GPU "
            f"quotas, mixed claims through the public API (one submit every 0.12 s; 20% invalid, "
            "rejected by the API; valid ones released after a short hold, one in eight kept until the end, up to half its tenant's quota)."
            f" Warm-up {scenarios.Form.long().warmup:.0f} s, the fault during the load, then "
            f"{scenarios.Form.long().after:.0f} s more load after recovery.", "",
            "- *completed*: accepted claims that reached a final state the tenant asked for "
            "(prepared, unschedulable, failed, or released once released).",
            "- *lost*: accepted claims that did not; *duplicated*: claims allocated in two ways or on two nodes; "
            "*over-committed*: ledger revisions (every one, read from the bucket's stream from the "
            "start) that over-commit a GPU or a quota.",
            "- *time to recover*: from the fault to the auditor's first clean pass of the state (new "
            "submits stop at the fault; claims in flight must settle, the consumers be drained, the "
            "ledger, records and quota usage agree). A bad past revision stays counted above but does "
            "not stop the clock.", "",
            scenarios.table(rows), ""]
    for row in rows:
        if row.findings:
            text += [f"## {row.scenario}: findings", ""] + [f"- {line}" for line in row.findings[:50]] + [""]
    Path(args.out).write_text("\n".join(text))
    print(f"wrote {args.out}")
    return 0 if all(r.clean for r in rows) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
