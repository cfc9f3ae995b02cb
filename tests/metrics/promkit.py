"""A real Prometheus (Debian's ``prometheus``, tests/metrics/install.sh) scraping a local Tessera, and
the PromQL helpers the metrics tests ask it with.

The server runs on loopback on a free port with its own data directory and a scrape interval of one
second; every service process of the cluster is a target of its own, in a job named after its
service (the enforcers' jobs are all ``enforcer``, one instance per node), as deploy/ configures it.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tessera.cli.cluster import LocalCluster
from tessera.shared.natsserver import die_with_parent, free_port

SCRAPE_SECONDS = 1


def service_of(instance: str) -> str:
    """The service a LocalCluster process runs (``enforcer-gpu-0`` -> ``enforcer``)."""
    return instance.split("-")[0]


def scrape_config(cluster: LocalCluster) -> dict:
    jobs: dict[str, list[str]] = {}
    for sp in cluster.processes:
        assert sp.metrics_port, f"{sp.name} has no metrics listener"
        jobs.setdefault(service_of(sp.name), []).append(f"127.0.0.1:{sp.metrics_port}")
    return {
        "global": {"scrape_interval": f"{SCRAPE_SECONDS}s", "evaluation_interval": f"{SCRAPE_SECONDS}s"},
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}
                           for job, targets in sorted(jobs.items())],
    }


@dataclass
class Prometheus:
    workdir: Path
    config: dict
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> "Prometheus":
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("prometheus is not installed: run tests/metrics/install.sh (make test does)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        conf = self.workdir / "prometheus.yml"
        conf.write_text(yaml.safe_dump(self.config))
        log = open(self.workdir / "prometheus.log", "ab")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={conf}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}: "
                                   f"{(self.workdir / 'prometheus.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as reply:
                    if reply.status == 200:
                        return self
            except urllib.error.HTTPError as exc:  # not ready yet (close the reply it holds)
                exc.close()
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"prometheus not ready after {timeout:.0f}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    # --- the HTTP API ---------------------------------------------------------------------------

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                body = json.load(reply)
        except urllib.error.HTTPError as exc:  # a bad query answers 400 with the error in the body
            with exc:
                body = json.load(exc)
        assert body["status"] == "success", f"{path} {params}: {body.get('error')}"
        return body["data"]

    def query(self, promql: str) -> dict[tuple, float]:
        """An instant vector as {sorted label items (no __name__): value}."""
        data = self.api("query", query=promql)
        assert data["resultType"] in ("vector", "scalar"), data["resultType"]
        if data["resultType"] == "scalar":
            return {(): float(data["result"][1])}
        return {tuple(sorted((k, v) for k, v in s["metric"].items() if k != "__name__")): float(s["value"][1])
                for s in data["result"]}

    def names(self) -> set[str]:
        return set(self.api("label/__name__/values"))

    def wait(self, promql: str, check, what: str, timeout: float = 60.0) -> dict[tuple, float]:
        """Ask until ``check(result)`` holds (the scrapes and refreshes catch up), else fail with the
        last answer."""
        deadline = time.monotonic() + timeout
        result: dict = {}
        while time.monotonic() < deadline:
            result = self.query(promql)
            if check(result):
                return result
            time.sleep(0.25)
        raise AssertionError(f"{what}: {promql} answered {result} for {timeout:.0f}s")


# --- the metric names a PromQL expression refers to --------------------------------------------

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "inf", "nan"}
_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names in ``expr``: identifiers that are neither functions, keywords, nor inside
    label matchers, grouping clauses, ranges or strings. Grafana's variables are taken out first."""
    text = expr.replace("$__rate_interval", "1m").replace("$__interval", "1m")
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\$\w+", "", text)
    names = set()
    for m in _NAME.finditer(text):
        rest = text[m.end():].lstrip()
        word = m.group(0)
        if rest.startswith("(") or word.lower() in _KEYWORDS:
            continue
        if m.start() > 0 and (text[m.start() - 1].isdigit() or text[m.start() - 1] == "."):
            continue  # the exponent or unit of a number (1e3)
        names.add(word)
    return names
