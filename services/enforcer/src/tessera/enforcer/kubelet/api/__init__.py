"""Generated gRPC modules of the kubelet's plugin APIs (registration v1, DRA v1 and v1beta1).

Do not edit: `make protos` writes them from services/enforcer/proto/tessera/enforcer/kubelet/api/*.proto
and a test fails when they are stale relative to those files.
"""
