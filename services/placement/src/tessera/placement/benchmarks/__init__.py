"""Placement's benchmarks: what measures the engine and the service, kept apart from what runs them.

- `packing`: the FGD paper's method on the openb trace (`tessera bench placement`, `--families`,
  `dynamic`, `speed`), every policy side by side;
- `families`: the paper's workload families made from the default pod list;
- `dynamic`: the trace replayed with arrivals, departures and retries;
- `through_nats`: the placement service end to end through NATS (`tessera bench placement-nats`);
- `trace`: the openb CSV loader they share.

Nothing in the service imports this package; its figures live in bench/*.md.
"""
