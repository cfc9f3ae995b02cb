"""Settings from the environment: a bad value is refused naming the variable and what it takes."""

from __future__ import annotations

import pytest

from tessera.shared.errors import ConfigError
from tessera.shared.settings import ServiceSettings, env_bool, env_choice


def test_choices_and_booleans_accept_what_they_say_and_refuse_the_rest():
    assert env_choice({"X": " Memory "}, "X", "file", ("file", "memory")) == "memory"
    assert env_choice({}, "X", "file", ("file", "memory")) == "file"
    with pytest.raises(ConfigError, match=r"X='disk': use one of file, memory"):
        env_choice({"X": "disk"}, "X", "file", ("file", "memory"))
    assert env_bool({"B": "off"}, "B", True) is False and env_bool({"B": "YES"}, "B", False) is True
    assert env_bool({"B": ""}, "B", True) is True
    with pytest.raises(ConfigError, match=r"B='maybe': use true or false"):
        env_bool({"B": "maybe"}, "B", True)


def test_a_service_refuses_an_unknown_log_level_or_storage():
    assert ServiceSettings.from_env("probe", {"TESSERA_LOG_LEVEL": "debug"}).log_level == "DEBUG"
    with pytest.raises(ConfigError, match="TESSERA_LOG_LEVEL"):
        ServiceSettings.from_env("probe", {"TESSERA_LOG_LEVEL": "loud"})
    with pytest.raises(ConfigError, match="TESSERA_STREAM_STORAGE"):
        ServiceSettings.from_env("probe", {"TESSERA_STREAM_STORAGE": "disk"})
