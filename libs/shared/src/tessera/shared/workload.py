"""The contract between `tessera run` and the node enforcer, named once.

`tessera run` launches the workload itself (so the user's terminal, signals and exit code stay with
the user) and proves it is alive by holding a shared lock on the claim's owner-lock file, whose path
the enforcer puts in the prepared environment under OWNER_LOCK_VAR. Claims whose id starts with
RUN_CLAIM_PREFIX are owned that way: the enforcer releases them once that lock is free.
"""

OWNER_LOCK_VAR = "TESSERA_OWNER_LOCK"
RUN_CLAIM_PREFIX = "run-"
