"""Types of the compiled fragmentation-aware core (_fgdcore.c), for mypy: a C extension carries none.

Kept beside the C source; its three functions are the ones `PyMethodDef methods[]` there lists.
"""

from typing import Any

def gvec(placer: Any, G: Any, /) -> Any: ...
def configure(by_bucket: object, no_fit: object, memo_cap: int, class_cache_cap: int, /) -> None: ...
def entries(placer: Any, classes: Any, demand: Any, gpu_policy: Any, out: list[Any], /) -> None: ...
