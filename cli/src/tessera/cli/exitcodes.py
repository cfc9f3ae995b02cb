"""The CLI's exit codes: one table, so a script can tell "refused" from "not reachable" from "gave up".

Documented in README.md ("Exit codes"); every command returns one of these (`tessera run` returns
its workload's own code once the workload ran).
"""

OK = 0  # done
FAILED = 1  # Tessera answered no (a refused request, an unknown tenant or claim), or a step failed
USAGE = 2  # the command line or an input file is wrong: the message says which part and how to fix it
UNSCHEDULABLE = 3  # submit --wait / run: the claim cannot be placed; the reason is printed
UNAVAILABLE = 4  # NATS cannot be reached, no service answers, or Tessera has not created its buckets yet
TIMEOUT = 5  # a --wait ran out before the claim reached the state it waited for
INTERRUPTED = 130  # Ctrl-C or SIGTERM

TABLE = (
    (OK, "success"),
    (FAILED, "refused or failed: Tessera answered no, or a step failed"),
    (USAGE, "bad command line or input file"),
    (UNSCHEDULABLE, "the claim cannot be placed (submit --wait, run)"),
    (UNAVAILABLE, "NATS or the answering service is unreachable, or Tessera is not set up there yet"),
    (TIMEOUT, "a --wait ran out"),
    (INTERRUPTED, "interrupted (Ctrl-C, SIGTERM)"),
)
