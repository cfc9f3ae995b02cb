"""The control-plane manager's benchmarks, kept apart from the service that runs tenants.

- `tenants`: provision N tenants through the real manager and NATS (`tessera bench tenants`).

Nothing in the service imports this package; its figures live in bench/*.md.
"""
