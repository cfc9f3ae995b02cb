"""The enforcer tests' fixtures; the cluster and the helpers live in `runkit` (a name of its own, so
that importing them never picks up another directory's conftest)."""

from runkit import cluster, fresh_cluster  # noqa: F401 - fixtures, registered by being here
