"""The placement tests' fixtures; the fleet builders live in `fleetkit` (a name of its own, so that
importing them never picks up another directory's conftest)."""

from fleetkit import harness  # noqa: F401 - a fixture, registered by being here
