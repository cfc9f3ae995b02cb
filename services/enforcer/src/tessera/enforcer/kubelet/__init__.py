"""The enforcer as the kubelet's DRA plugin of driver gpu.tessera.dev (Kubernetes mode).

The kubelet finds the plugin through a registration socket in its plugin registry directory and
then asks it, over the DRA socket, to prepare each allocated claim before a pod's containers start.
"""
