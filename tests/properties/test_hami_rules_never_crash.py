"""HAMi's rules never crash on what a pod may carry: any resources and annotations give a ClaimSpec
that the bus accepts, or a TranslationError that names the field; nothing else escapes."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from tessera.shared.events import ClaimSpec
from tessera.translator import hami

RESOURCE_NAMES = [hami.GPU, hami.GPUMEM, hami.GPUMEM_PERCENTAGE, hami.GPUCORES, hami.PRIORITY,
                  "nvidia.com/gpumen", "nvidia.com/", "cpu", "memory"]
ANNOTATION_NAMES = [hami.USE_GPUTYPE, hami.NOUSE_GPUTYPE, hami.USE_GPUUUID, hami.NOUSE_GPUUUID,
                    hami.NODE_POLICY, hami.GPU_POLICY, "other/annotation"]
quantities = (st.integers(min_value=-(2**40), max_value=2**70)
              | st.from_regex(r"\A[+-]?[0-9]{0,22}(\.[0-9]{0,6})?([eE][+-]?[0-9]{1,3})?(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?\Z")
              | st.text(max_size=20))
resources = st.dictionaries(st.sampled_from(RESOURCE_NAMES) | st.text(max_size=20), quantities, max_size=6)
annotations = st.dictionaries(st.sampled_from(ANNOTATION_NAMES),
                              st.text(max_size=30) | st.sampled_from(["binpack", "spread", "H100,A100", ""]),
                              max_size=4)
_spec = msgspec.json.Decoder(ClaimSpec)


@given(resources=resources, annotations=annotations)
def test_any_request_gives_a_valid_spec_or_an_error_naming_the_field(resources, annotations):
    try:
        spec = hami.translate(resources, annotations, where='container "c"')
    except hami.TranslationError as exc:
        assert exc.field, f"no field named in {exc}"
        assert str(exc).startswith('container "c": ')
        return
    assert isinstance(spec, ClaimSpec)
    # What the translator publishes must pass the events' own constraints.
    _spec.decode(msgspec.json.encode(spec))


@given(resources=resources)
def test_is_gpu_request_never_raises(resources):
    assert hami.is_gpu_request(resources) in (True, False)
