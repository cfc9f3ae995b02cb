"""A tenant's own API server runs GPU pods on the shared fleet.

Per tenant, the manager keeps a virtual node in the tenant's cluster (`virtualnode`) and mirrors
the pods bound to it into the tenant's host namespace (`hostpod` says what a host pod may be,
`claims` what a tenant's DRA claim becomes there, `sync` keeps the two API servers in step,
`toleration` sends GPU pods to the node and keeps them there while its Lease lapses,
`deviceclass` puts Tessera's class in the tenant's cluster, `logs` serves `kubectl logs` from the
host). The host side is the ordinary Kubernetes flow: the translator's webhook, the claim,
placement, the enforcer as kubelet plugin, CDI.
"""
