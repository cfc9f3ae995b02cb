"""The accounting-file reader turns any file into a snapshot or a VgpuCacheError: never another
exception, never a hang. Files are arbitrary bytes, and headers with the right magic and version
whose sizes, offsets and counts are anything (what a truncated or corrupted file looks like)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import example, given
from hypothesis import strategies as st

from tessera.shared.vgpu_cache import DEVICE, HEADER, MAGIC, PROC_HEAD, VERSION, VgpuCacheError, read_vgpu_cache

u32 = st.integers(min_value=0, max_value=2**32 - 1)
small = st.integers(min_value=0, max_value=64)
u64 = st.integers(min_value=0, max_value=2**64 - 1)


@st.composite
def headers(draw):
    max_devices = draw(small | u32)
    max_procs = draw(small | u32)
    proc_size = draw(st.just(PROC_HEAD.size + 8 * max_devices) | u32)
    devices_offset = draw(st.just(HEADER.size) | u64)
    procs_offset = draw(st.just(HEADER.size + DEVICE.size * max_devices) | u64)
    file_size = draw(st.just(procs_offset + max_procs * proc_size) | u64)
    if file_size >= 2**64:
        file_size = draw(u64)
    head = HEADER.pack(draw(st.just(MAGIC) | st.binary(min_size=8, max_size=8)), draw(st.just(VERSION) | u32),
                       draw(st.just(HEADER.size) | u32), max_devices % 2**32, max_procs % 2**32,
                       draw(small | u32), draw(st.just(DEVICE.size) | u32), proc_size % 2**32, draw(u32),
                       devices_offset % 2**64, procs_offset % 2**64, file_size, draw(small | u32), draw(u32))
    return head + draw(st.binary(max_size=2048))


def _read(data: bytes):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cache"
        path.write_bytes(data)
        try:
            return read_vgpu_cache(path)
        except VgpuCacheError as exc:
            assert str(path) in str(exc), "the error must name the file"
            return None


@given(data=st.binary(max_size=600))
def test_arbitrary_bytes_are_refused_clearly(data):
    _read(data)


# Found by this test: a header whose device table lies past the end of the file (one device at
# offset 128 of a 128-byte file, no processes) passes every size check and the reader then fails
# with struct.error instead of VgpuCacheError. vgpu_cache now bounds the device table by the file's
# size; this input stays pinned so that the check cannot go away unnoticed.
DEVICE_TABLE_PAST_THE_END = HEADER.pack(MAGIC, VERSION, HEADER.size, 1, 0, 0, DEVICE.size, PROC_HEAD.size + 8,
                                        0, HEADER.size, 0, 0, 0, 0)


@given(data=headers())
@example(data=DEVICE_TABLE_PAST_THE_END)
def test_a_corrupted_header_is_refused_clearly(data):
    _read(data)
