#!/usr/bin/env bash
# Every check that needs an NVIDIA GPU, for a machine with the driver, a python3 with PyTorch and
# CuPy, and gcc; results go to $OUT (default ./gpu-results):
#   vgpu   native/vgpu/tests/gpu/run.sh: libvgpu.so against the real driver (memory limits with
#          PyTorch and CuPy, two processes, SM shares of plain launches and of PyTorch CUDA graphs at
#          30/70, a context count that would overflow a claim, overhead, start-up); about 9 minutes
#   isolation  only its CUDA-graph shares and context count sections; about 2 minutes
#   demo   services/enforcer/gpu-demo/run.sh: two tenants' PyTorch jobs on one GPU through
#          `tessera run`, limits vs the enforcer's reported peak use, throughput; about 3 minutes
#   all    both (over 10 minutes: where one command may run 10 minutes, run vgpu and demo apart)
#
# A machine that reaches PyPI installs what Tessera needs with `make`. One that reaches nothing
# (the lent H200s) gets it as wheels: run `make gpu-wheels` where PyPI is reachable, carry `.whl/`
# along, and this script builds .venv from it with --no-index before anything else.
#   tests/gpu/run.sh vgpu|isolation|demo|all
set -u -o pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/gpu-results}
mkdir -p "$OUT"
what=${1:-all}
PROJECTS="libs/shared services/controlplane services/capacity services/translator services/placement services/enforcer cli"

offline_venv() {
    # .venv from the carried wheels; its stamp made newer than every pyproject so make leaves it be
    [[ -x .venv/bin/tessera && -f .venv/.installed ]] && return 0
    echo "== installing Tessera into .venv from .whl/ (no network)" >&2
    python3 -m venv .venv || return 1
    .venv/bin/python -m pip install -q --no-index --no-deps --no-compile .whl/*.whl || return 1
    local p
    for p in $PROJECTS; do
        .venv/bin/python -m pip install -q --no-index --no-deps --no-build-isolation "./$p" || return 1
    done
    touch .venv/.installed
}

if [[ -d .whl ]] && ls .whl/*.whl >/dev/null 2>&1; then
    offline_venv || { echo "could not install from .whl/; was it made by 'make gpu-wheels' for this Python?" >&2; exit 1; }
fi

status=0
if [[ $what == vgpu || $what == all ]]; then
    OUT=$OUT bash native/vgpu/tests/gpu/run.sh 2>&1 | tee "$OUT/vgpu.log" || status=1
fi
if [[ $what == isolation ]]; then
    OUT=$OUT bash native/vgpu/tests/gpu/run.sh graph_share contexts 2>&1 | tee "$OUT/vgpu-isolation.log" || status=1
fi
if [[ $what == demo || $what == all ]]; then
    JOB_PYTHON=${JOB_PYTHON:-$(command -v python3)} bash services/enforcer/gpu-demo/run.sh 2>&1 | tee "$OUT/gpu-demo.txt" \
        || status=1
fi
exit $status
