#!/usr/bin/env bash
# Two claims on one simulated GPU, one of high runtime priority (0) and one of low (1), each with its
# own config file and Ledger: the table of each claim's share of device time per 100 ms while the low
# one runs throughout and the high one launches from 0.5 s to 1.0 s (tests/t_priority.c; the README's
# table is its output). Kernels of 500 us device time, launched two at a time and synchronised.
# Usage: tests/priority.sh [build-dir] [show|kill|future]   (make -C native/vgpu priority)
set -eu
B=$(cd "${1:-build}" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/vgpu-priority.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
for v in $(env | sed -n 's/^\(CUDA_[A-Z0-9_]*\|TESSERA_VGPU_[A-Z0-9_]*\|TESSERA_SIM_[A-Z0-9_]*\)=.*/\1/p'); do
    unset "$v"
done
env LD_LIBRARY_PATH="$B/sim${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" LD_PRELOAD="$B/test/libvgpu.so" \
    TESSERA_VGPU_TEST_NODE_CONFIG="$WORK/no-node-config" TESSERA_SIM_KERNEL_US=500 VT_WORK="$WORK" \
    "$B/tests/t_priority" "${2:-show}"
