"""fragmentation-aware (FGD): place where the workload mix loses the least usable GPU capacity."""

from fleetkit import inventory
from tessera.placement.mix import WorkloadMix
from tessera.shared.events import ClaimSpec


def _mix(*specs: tuple[ClaimSpec, int]) -> WorkloadMix:
    m = WorkloadMix()
    m.observe_all([s for s, n in specs for _ in range(n)])
    return m


def test_a_slice_goes_next_to_another_slice_not_onto_a_whole_free_gpu(harness):
    # Whole-GPU jobs dominate the mix: breaking a free GPU would strand most of it.
    mix = _mix((ClaimSpec(cores=100), 50), (ClaimSpec(memory_percent=30, cores=30), 10))
    h = harness(inventory("a", gpus=2), inventory("b", gpus=2), mix=mix)
    first = h.claim(memory_percent=30, cores=30)
    second = h.claim(memory_percent=30, cores=30)
    assert (second.node, second.shares[0].uuid) == (first.node, first.shares[0].uuid)


def test_a_whole_gpu_job_keeps_an_eight_gpu_node_whole_when_it_can(harness):
    mix = _mix((ClaimSpec(gpus=8, cores=100), 10), (ClaimSpec(cores=100), 10))
    h = harness(inventory("big", gpus=8), inventory("small", gpus=2), mix=mix)
    assert h.claim(cores=100).node == "small"
    assert h.claim(gpus=8, cores=100).node == "big"


def test_cpu_heavy_claims_avoid_stranding_free_gpus(harness):
    # On "lean" this claim would leave 6 CPUs next to 3 free GPUs: too few for the typical 8-CPU
    # job, so those GPUs would be stranded. The tighter node loses on fragmentation.
    mix = _mix((ClaimSpec(cores=100, cpu_millis=8000), 20))
    h = harness(inventory("lean", gpus=4, cpu_millis=36000), inventory("fat", gpus=4, cpu_millis=400000),
                mix=mix)
    r = h.place(gpus=1, cores=100, cpu_millis=30000)
    assert r.node == "fat"


def test_default_mix_is_used_before_anything_is_seen(harness):
    h = harness(inventory("a", gpus=2), inventory("b", gpus=2))
    first = h.claim(memory_percent=25, cores=25)
    assert h.claim(memory_percent=25, cores=25).shares[0].uuid == first.shares[0].uuid


def test_mix_learns_from_placed_claims(harness):
    h = harness(inventory("a"), learn=True)
    before = h.placer.mix.version
    for _ in range(40):
        h.place(memory_percent=10, cores=10)
    assert h.placer.mix.version > before
    kinds = {kd.kind: p for kd, p in h.placer.mix.kinds()}
    assert max(kinds, key=kinds.get)[2] == 10


def test_place_does_not_mutate_the_fleet(harness):
    h = harness(inventory("a"), inventory("b"))
    gen = h.fleet.generation
    for _ in range(3):
        h.place(memory_mib=1000)
    assert h.fleet.generation == gen
    assert all(not n.entries for n in h.fleet.nodes.values())


def test_fluid_memory_keeps_host_memory_next_to_free_gpus(harness):
    # Typical job: one GPU, 48 GiB host memory. A 100 GiB claim on "lean" (200 GiB) leaves memory for
    # two of its four GPUs; on "fat" for all of them. The threshold model sees no difference (a
    # typical job still fits on both); the fluid memory bound sees the two stranded GPUs.
    mix = _mix((ClaimSpec(cores=100, host_memory_mib=49152), 20))
    for fluid, where in ((True, "fat"), (False, None)):
        h = harness(inventory("lean", gpus=4, host_memory_mib=204800),
                    inventory("fat", gpus=4, host_memory_mib=1048576), mix=mix, fluid_memory=fluid)
        r = h.place(cores=100, host_memory_mib=102400)
        if where:
            assert r.node == where
        h.placer._new_epoch()
        lean = h.fleet.nodes["lean"].cls
        frag = h.placer._frag(lean.devs, lean.cpu_free, 204800 - 102400)
        assert (frag > 0) == fluid
