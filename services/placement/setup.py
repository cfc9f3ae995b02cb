"""The compiled core of the fragmentation-aware policy (src/tessera/placement/_fgdcore.c).

Optional by design: where no C compiler or Python headers are at hand the package installs without
it and the engine runs its Python reference, which makes the same decisions more slowly (the
service logs which one it runs). -ffp-contract=off keeps every product and sum rounded as CPython
rounds it, so both make bit-identical scores.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "tessera.placement._fgdcore", ["src/tessera/placement/_fgdcore.c"],
    extra_compile_args=["-O2", "-ffp-contract=off", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
    optional=True,
)])
