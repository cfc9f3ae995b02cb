"""Host CPU and memory stated by a claim must fit on the node."""

from fleetkit import inventory
from tessera.placement.engine import Rejection


def test_cpu_must_fit(harness):
    h = harness(inventory("small", cpu_millis=4000), inventory("big", cpu_millis=64000))
    assert h.claim(memory_mib=1000, cpu_millis=8000).node == "big"


def test_host_memory_must_fit(harness):
    h = harness(inventory("small", host_memory_mib=8192), inventory("big", host_memory_mib=262144))
    assert h.claim(memory_mib=1000, host_memory_mib=16384).node == "big"


def test_host_usage_accumulates_and_rejects(harness):
    h = harness(inventory("a", cpu_millis=10000, host_memory_mib=10000))
    h.claim(memory_mib=1000, cpu_millis=6000, host_memory_mib=1000)
    r = h.place(memory_mib=1000, cpu_millis=6000)
    assert isinstance(r, Rejection) and r.filtered == {"cpu": 1}
    r = h.place(memory_mib=1000, host_memory_mib=9500)
    assert isinstance(r, Rejection) and r.filtered == {"host-memory": 1}
    assert "9,500 MiB host memory" in r.reason


def test_zero_means_not_stated(harness):
    h = harness(inventory("a", cpu_millis=1, host_memory_mib=1))
    assert h.claim(memory_mib=1000).node == "a"
