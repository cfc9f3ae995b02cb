#!/usr/bin/env bash
# The enforcer's GPU demo: two tenants' PyTorch jobs on one real GPU through `tessera run`, with
# different memory limits and core shares; prints each job's limit, its peak use as the enforcer
# reported it, and its throughput (alone, then together). Needs an NVIDIA driver and a Python with
# PyTorch (CUDA); everything else is built here. About 3 minutes.
#   services/enforcer/gpu-demo/run.sh [--seconds 45] [--mem-a 8192 --cores-a 30 --mem-b 16384 --cores-b 70]
#   JOB_PYTHON=/path/to/python   the Python that has torch (default: the first of python3 / python with it)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
cd "$ROOT"

die() { echo "gpu-demo: $*" >&2; exit 1; }

command -v nvidia-smi >/dev/null || die "no nvidia-smi: this demo needs an NVIDIA GPU and driver"
nvidia-smi -L >/dev/null 2>&1 || die "nvidia-smi cannot talk to the driver"

if [[ -z ${JOB_PYTHON:-} ]]; then
    for candidate in python3 python "$ROOT/.venv/bin/python"; do
        if command -v "$candidate" >/dev/null && "$candidate" -c "import torch" 2>/dev/null; then
            JOB_PYTHON=$(command -v "$candidate"); break
        fi
    done
fi
[[ -n ${JOB_PYTHON:-} ]] || die "no Python with PyTorch found; set JOB_PYTHON"
"$JOB_PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || die "$JOB_PYTHON has PyTorch but torch.cuda.is_available() is False"

make -s .venv/.installed >/dev/null || die "could not install the Tessera virtualenv (make .venv/.installed)"
make -s -C native/vgpu >/dev/null || die "could not build native/vgpu"

exec timeout --kill-after=10 290 .venv/bin/python services/enforcer/gpu-demo/demo.py --job-python "$JOB_PYTHON" "$@"
