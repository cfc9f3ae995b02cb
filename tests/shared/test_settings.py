"""Settings that declare themselves: every bad variable is refused at once, naming what it takes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

import pytest

from tessera.shared.errors import ConfigError
from tessera.shared.settings import FromEnv, ServiceSettings, SettingsError, read, setting


@dataclass(frozen=True, kw_only=True)
class Probe(FromEnv):
    storage: bool = setting("X_STORAGE", "where", True, choices={"file": True, "memory": False})
    mode: Literal["fast", "careful"] = setting("X_MODE", "how", "careful")
    legacy: bool = setting("X_LEGACY", "also the old names", True)
    workers: int = setting("X_WORKERS", "how many", 4, minimum=1, maximum=64)
    period: float = setting("X_PERIOD", "seconds", 2.0, above=0)
    nodes: tuple[str, ...] = setting("X_NODES", "which", ("a",), choices=("a", "b", "c"))
    name: str = setting("X_NAME", "who", "")
    endpoint: str | None = setting("X_ENDPOINT", "where to", None)
    home: Path = setting("X_HOME", "dir", unset=lambda read: f"/srv/{read['mode']}", shown="`/srv/<mode>`")
    low: int = setting("X_LOW", "at least", 1)
    high: int = setting("X_HIGH", "more than low", 2)

    def check(self) -> Iterable[str]:
        if self.high <= self.low:
            yield "X_HIGH must be above X_LOW"


def test_unset_variables_give_the_declared_defaults():
    probe = read(Probe, {})
    assert (probe.storage, probe.mode, probe.legacy, probe.workers, probe.period) == (True, "careful", True, 4, 2.0)
    assert (probe.nodes, probe.name, probe.endpoint, probe.home) == (("a",), "", None, Path("/srv/careful"))


def test_each_type_is_read_as_it_says():
    probe = read(Probe, {"X_STORAGE": " Memory ", "X_MODE": "FAST", "X_LEGACY": "off", "X_WORKERS": "64",
                         "X_PERIOD": "0.5", "X_NODES": "b, c,", "X_NAME": "", "X_ENDPOINT": " "})
    assert (probe.storage, probe.mode, probe.legacy, probe.workers, probe.period) == (False, "fast", False, 64, 0.5)
    # blank text is a value where the type is text, and as good as unset elsewhere
    assert (probe.nodes, probe.name, probe.endpoint, probe.home) == (("b", "c"), "", None, Path("/srv/fast"))
    assert read(Probe, {"X_LEGACY": "YES", "X_WORKERS": ""}).legacy is True


def test_every_bad_variable_is_reported_at_once_with_what_it_takes():
    with pytest.raises(SettingsError) as refused:
        read(Probe, {"X_STORAGE": "disk", "X_MODE": "quick", "X_LEGACY": "maybe", "X_WORKERS": "0", "X_PERIOD": "0",
                     "X_NODES": "a,z", "X_LOW": "many", "X_HIGH": "1"})
    assert refused.value.problems == [
        "X_STORAGE='disk': use one of file, memory",
        "X_MODE='quick': use one of fast, careful",
        "X_LEGACY='maybe': use true or false (or 1 / 0)",
        "X_WORKERS=0 is out of range; use 1 to 64",
        "X_PERIOD=0 must be more than 0",
        "X_NODES='a,z': 'z' is not one of a, b, c; list any of them, comma-separated",
        "X_LOW='many' is not an integer; set it to a whole number",
        "X_HIGH must be above X_LOW",  # checked with X_LOW at its default
    ]
    assert str(refused.value).startswith("8 settings are wrong:\n  - X_STORAGE='disk'")
    assert isinstance(refused.value, ConfigError)  # (what the runner turns into exit code 2)


def test_a_service_refuses_an_unknown_log_level_or_storage():
    assert ServiceSettings.from_env({"TESSERA_LOG_LEVEL": "debug"}, service="probe").log_level == "DEBUG"
    with pytest.raises(ConfigError, match="TESSERA_LOG_LEVEL"):
        ServiceSettings.from_env({"TESSERA_LOG_LEVEL": "loud"}, service="probe")
    with pytest.raises(ConfigError, match="TESSERA_STREAM_STORAGE"):
        ServiceSettings.from_env({"TESSERA_STREAM_STORAGE": "disk"}, service="probe")


def test_the_nats_password_file_is_read_before_the_password(tmp_path):
    (tmp_path / "pw").write_text("from-file\n")
    bus = ServiceSettings.from_env({"TESSERA_NATS_PASSWORD": "plain", "TESSERA_NATS_PASSWORD_FILE": str(tmp_path / "pw")},
                                   service="probe").bus
    assert bus.password == "from-file"
    assert ServiceSettings.from_env({"TESSERA_NATS_PASSWORD": "plain"}, service="probe").bus.password == "plain"
    with pytest.raises(ConfigError, match=r"TESSERA_NATS_PASSWORD_FILE=.*absent: cannot read it"):
        ServiceSettings.from_env({"TESSERA_NATS_PASSWORD_FILE": str(tmp_path / "absent")}, service="probe")
