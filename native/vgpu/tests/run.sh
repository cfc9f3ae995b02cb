#!/usr/bin/env bash
# Runs the C tests of native/vgpu against the simulated driver, each as a separate case with its own
# environment and its own shared cache file, and prints "N passed, M failed" last (exit 1 on failure).
# Usage: tests/run.sh [build-dir] [case-name-filter]
set -u
B=$(cd "${1:-build}" && pwd)
FILTER=${2:-}
T=$B/tests
LIB=$B/libvgpu.so
TESTLIB=$B/test/libvgpu.so
WORK=$(mktemp -d "${TMPDIR:-/tmp}/vgpu-tests.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
passed=0 failed=0 failed_names=()

# Anything in the caller's environment that would change the answers is cleared.
for v in $(env | sed -n 's/^\(CUDA_DEVICE_[A-Z0-9_]*\|TESSERA_VGPU_[A-Z0-9_]*\|TESSERA_SIM_[A-Z0-9_]*\)=.*/\1/p'); do
    unset "$v"
done
export LD_LIBRARY_PATH=$B/sim${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export TESSERA_VGPU_TEST_NODE_CONFIG=$WORK/no-node-config

# run_case NAME [VAR=VALUE ...] -- COMMAND...   (LD_PRELOAD and a fresh cache file are set unless given)
run_case() {
    local name=$1; shift
    [[ -n $FILTER && $name != *$FILTER* ]] && return 0
    local envs=("LD_PRELOAD=$LIB" "CUDA_DEVICE_MEMORY_SHARED_CACHE=$WORK/$name.cache")
    while [[ $1 != -- ]]; do envs+=("$1"); shift; done
    shift
    local log=$WORK/$name.log start=$SECONDS
    if env "${envs[@]}" timeout -k 5 60 "$@" >"$log" 2>&1; then
        passed=$((passed + 1))
        printf 'ok   %-28s %3ss  %s\n' "$name" $((SECONDS - start)) "$(tail -n 1 "$log")"
    else
        failed=$((failed + 1)); failed_names+=("$name")
        printf 'FAIL %-28s %3ss\n' "$name" $((SECONDS - start))
        sed 's/^/     | /' "$log" | tail -n 30
    fi
}

L64="CUDA_DEVICE_MEMORY_LIMIT_0=64m"
SM="TESSERA_SIM_KERNEL_US=500"  # kernels of 500 us device time, for the SM-share cases
run_case limit            "CUDA_DEVICE_MEMORY_LIMIT=128m" "$L64" TESSERA_SIM_GPU_COUNT=2 -- "$T/t_limit"
run_case limit-no-cache   "CUDA_DEVICE_MEMORY_LIMIT=128m" "$L64" TESSERA_SIM_GPU_COUNT=2 \
                          CUDA_DEVICE_MEMORY_SHARED_CACHE= -- "$T/t_limit"
run_case paths            "$L64" -- "$T/t_paths"
run_case meminfo          "$L64" -- "$T/t_meminfo"
run_case shared           "$L64" -- "$T/t_shared"
run_case kill             "$L64" "LD_PRELOAD=$TESTLIB" -- "$T/t_kill"
run_case procaddr         "$L64" -- "$T/t_procaddr"
run_case procaddr-internal "$L64" TESSERA_SIM_PROCADDR_INTERNAL=1 -- "$T/t_procaddr"
run_case null             "$L64" CUDA_DEVICE_SM_LIMIT=50 CUDA_DEVICE_CONTEXT_OVERHEAD=1m -- \
    sh -c 'env -u LD_PRELOAD "$1" record > "$2" && "$1" check "$2"' sh "$T/t_null" "$WORK/null.expected"
run_case dlsym            "$L64" -- "$T/t_dlsym"

# the limit rules: every source can only lower a limit; no value switches enforcement off
printf 'CUDA_DEVICE_MEMORY_LIMIT_0=32m\n' > "$WORK/cfg32.conf"
printf '# node config\nCUDA_DEVICE_MEMORY_LIMIT=48m\nCUDA_DEVICE_MEMORY_SHARED_CACHE=%s\n' "$WORK/node.cache" > "$WORK/node.conf"
run_case config-env-only     "CUDA_DEVICE_MEMORY_LIMIT_0=100m" -- "$T/t_config" 100
run_case config-suffix-g     "CUDA_DEVICE_MEMORY_LIMIT_0=1g" -- "$T/t_config" 1024
run_case config-suffix-k     "CUDA_DEVICE_MEMORY_LIMIT_0=20480k" -- "$T/t_config" 20
run_case config-bytes        "CUDA_DEVICE_MEMORY_LIMIT_0=$((24 * 1048576))" -- "$T/t_config" 24
run_case config-all-devices  "CUDA_DEVICE_MEMORY_LIMIT=40m" -- "$T/t_config" 40
run_case config-no-limit     -- "$T/t_config" 0
run_case config-file-lowers  "TESSERA_VGPU_CONFIG=$WORK/cfg32.conf" "CUDA_DEVICE_MEMORY_LIMIT_0=64m" -- "$T/t_config" 32
run_case config-env-lowers   "TESSERA_VGPU_CONFIG=$WORK/cfg32.conf" "CUDA_DEVICE_MEMORY_LIMIT_0=16m" -- "$T/t_config" 16
run_case config-zero-no-bypass "TESSERA_VGPU_CONFIG=$WORK/cfg32.conf" "CUDA_DEVICE_MEMORY_LIMIT_0=0" -- "$T/t_config" 32
run_case config-node-file    "LD_PRELOAD=$TESTLIB" "TESSERA_VGPU_TEST_NODE_CONFIG=$WORK/node.conf" \
                             "CUDA_DEVICE_MEMORY_LIMIT_0=4g" -- \
    sh -c '"$1" 48 && test -s "$2"' sh "$T/t_config" "$WORK/node.cache"
# The node file is what a container gets read-only at /etc/tessera/vgpu.conf: neither the variables
# nor a TESSERA_VGPU_CONFIG file of the workload's may raise its limits or move its cache.
printf 'CUDA_DEVICE_MEMORY_LIMIT_0=4g\nCUDA_DEVICE_SM_LIMIT=0\nCUDA_DEVICE_MEMORY_SHARED_CACHE=%s\n' \
    "$WORK/workload-own.cache" > "$WORK/workload-high.conf"
printf 'CUDA_DEVICE_MEMORY_LIMIT_0=48m\nCUDA_DEVICE_SM_LIMIT=30\nCUDA_DEVICE_MEMORY_SHARED_CACHE=%s\n' \
    "$WORK/claim.cache" > "$WORK/claim.conf"
run_case config-node-file-wins "LD_PRELOAD=$TESTLIB" "TESSERA_VGPU_TEST_NODE_CONFIG=$WORK/claim.conf" \
                             "TESSERA_VGPU_CONFIG=$WORK/workload-high.conf" "CUDA_DEVICE_MEMORY_LIMIT=0" \
                             "CUDA_DEVICE_MEMORY_LIMIT_0=8g" "CUDA_DEVICE_MEMORY_SHARED_CACHE=$WORK/env-own.cache" -- \
    sh -c '"$1" 48 && test -s "$2" && test ! -e "$3" && test ! -e "$4"' sh "$T/t_config" \
       "$WORK/claim.cache" "$WORK/workload-own.cache" "$WORK/env-own.cache"
run_case config-node-file-sm "$SM" "LD_PRELOAD=$TESTLIB" "TESSERA_VGPU_TEST_NODE_CONFIG=$WORK/claim.conf" \
                             "TESSERA_VGPU_CONFIG=$WORK/workload-high.conf" CUDA_DEVICE_SM_LIMIT=100 \
                             CUDA_DEVICE_SM_LIMIT_0=0 -- "$T/t_sm" one 30 900
# The claim's file names its GPUs: limits and budgets follow the UUID, not the ordinal.
GA=GPU-5e55e7a0-0000-4000-8000-00000000000a GB=GPU-5e55e7a0-0000-4000-8000-00000000000b
GC=GPU-5e55e7a0-0000-4000-8000-00000000000c
printf 'CUDA_VISIBLE_DEVICES=%s,%s\nCUDA_DEVICE_MEMORY_LIMIT_0=32m\nCUDA_DEVICE_MEMORY_LIMIT_1=64m\nCUDA_DEVICE_MEMORY_SHARED_CACHE=%s\n' \
    "$GA" "$GB" "$WORK/ordered.cache" > "$WORK/ordered.conf"
ORDERED=("LD_PRELOAD=$TESTLIB" "TESSERA_VGPU_TEST_NODE_CONFIG=$WORK/ordered.conf" TESSERA_SIM_GPU_COUNT=2)
run_case order-as-listed     "${ORDERED[@]}" "TESSERA_SIM_GPU_UUIDS=$GA,$GB" -- \
    sh -c '"$1" limit 0 32 && "$1" limit 1 64' sh "$T/t_order"
run_case order-reversed      "${ORDERED[@]}" "TESSERA_SIM_GPU_UUIDS=$GB,$GA" -- \
    sh -c '"$1" limit 0 64 && "$1" limit 1 32' sh "$T/t_order"
run_case order-foreign-gpu   "${ORDERED[@]}" "TESSERA_SIM_GPU_UUIDS=$GC,$GA" -- \
    sh -c '"$1" limit 0 0 && "$1" limit 1 32' sh "$T/t_order"
run_case order-one-budget    "${ORDERED[@]}" "TESSERA_SIM_GPU_UUIDS=$GA,$GB" -- "$T/t_order" pair "$GB,$GA"
printf 'CUDA_VISIBLE_DEVICES=0,1\nCUDA_DEVICE_MEMORY_LIMIT=32m\n' > "$WORK/indices.conf"  # not UUIDs: fail closed
run_case order-bad-list-denies "LD_PRELOAD=$TESTLIB" "TESSERA_VGPU_TEST_NODE_CONFIG=$WORK/indices.conf" -- \
    "$T/t_order" limit 0 0
run_case config-cache-min    "$L64" "CUDA_DEVICE_MEMORY_SHARED_CACHE=$WORK/min.cache" -- \
    sh -c '"$1" 64 && CUDA_DEVICE_MEMORY_LIMIT_0=1g "$1" 64 && CUDA_DEVICE_MEMORY_LIMIT_0= "$1" 64' sh "$T/t_config"

# Attacks that used to lift limits (each passed against the old library: the bypass worked).
run_case attack-procaddr-newer "$L64" TESSERA_SIM_PROCADDR_INTERNAL=1 -- "$T/t_procaddr_newer"
run_case attack-ledger-header  "$L64" -- "$T/t_ledger_attack" header
run_case attack-ledger-full    "$L64" -- "$T/t_ledger_attack" full
run_case attack-ledger-unopenable "$L64" -- "$T/t_ledger_attack" unopenable
# Host mode: the node's config (root's, at /etc/tessera/vgpu.conf) makes enforcement mandatory and names
# where trusted claim files live; the workload's environment then cannot remove or replace its limits.
mkdir -p "$WORK/claims/run-a" "$WORK/elsewhere"
printf 'TESSERA_VGPU_ENFORCE=required\nTESSERA_VGPU_CLAIMS_DIR=%s\n' "$WORK/claims" > "$WORK/host-node.conf"
printf 'CUDA_DEVICE_MEMORY_LIMIT_0=64m\nCUDA_DEVICE_MEMORY_SHARED_CACHE=%s\n' "$WORK/claims/run-a/vgpu.cache" \
    > "$WORK/claims/run-a/vgpu.conf"
printf 'CUDA_DEVICE_MEMORY_LIMIT_0=4g\n' > "$WORK/elsewhere/own.conf"
cp "$WORK/elsewhere/own.conf" "$WORK/claims/run-a/forged.conf"; chmod 0666 "$WORK/claims/run-a/forged.conf"
HOST=("LD_PRELOAD=$TESTLIB" "TESSERA_VGPU_TEST_NODE_CONFIG=$WORK/host-node.conf")
run_case attack-host-unset-config "${HOST[@]}" CUDA_DEVICE_MEMORY_SHARED_CACHE= -- "$T/t_failclosed" refused
run_case attack-host-own-config  "${HOST[@]}" "TESSERA_VGPU_CONFIG=$WORK/elsewhere/own.conf" -- "$T/t_failclosed" refused
run_case attack-host-writable-config "${HOST[@]}" "TESSERA_VGPU_CONFIG=$WORK/claims/run-a/forged.conf" -- \
    "$T/t_failclosed" refused
run_case host-claim-config       "${HOST[@]}" "TESSERA_VGPU_CONFIG=$WORK/claims/run-a/vgpu.conf" \
                                 CUDA_DEVICE_MEMORY_LIMIT_0=1g -- "$T/t_failclosed" granted 64
run_case host-claim-env-lowers   "${HOST[@]}" "TESSERA_VGPU_CONFIG=$WORK/claims/run-a/vgpu.conf" \
                                 CUDA_DEVICE_MEMORY_LIMIT_0=16m -- "$T/t_failclosed" granted 16

# SM share: kernels of 500 us device time; the first two take ~1.5 s and ~1 s of wall time
run_case sm-30            "$SM" CUDA_DEVICE_SM_LIMIT=30 -- "$T/t_sm" one 30 900
run_case sm-50            "$SM" CUDA_DEVICE_SM_LIMIT_0=50 -- "$T/t_sm" one 50 1000
run_case sm-50-two-procs  "$SM" CUDA_DEVICE_SM_LIMIT=50 -- "$T/t_sm" pair 50 600
run_case sm-unlimited     "$SM" -- "$T/t_sm" one 100 1000

# CUDA graphs: the SM share holds for graph launches; graph memory counts against the limit
run_case graph-sm-30      "$SM" CUDA_DEVICE_SM_LIMIT=30 -- "$T/t_graph" sm 30 225
run_case graph-split-graphs "$SM" "VT_WORK=$WORK" -- "$T/t_graph" split graph 150
run_case graph-split-plain  "$SM" "VT_WORK=$WORK" -- "$T/t_graph" split plain 150
run_case graph-memory     "$L64" -- "$T/t_graph" mem
# Memory no allocation names: contexts and modules, on a card the processes share
CARD=(TESSERA_SIM_CONTEXT_MIB=64 TESSERA_SIM_MODULE_KIB=8192 CUDA_DEVICE_CONTEXT_OVERHEAD=64m "VT_WORK=$WORK")
run_case ctx-overhead     "${CARD[@]}" "TESSERA_SIM_CARD=$WORK/card-overhead" CUDA_DEVICE_MEMORY_LIMIT_0=512m -- \
    "$T/t_ctx" overhead
run_case ctx-ten-processes "${CARD[@]}" "TESSERA_SIM_CARD=$WORK/card-ten" -- "$T/t_ctx" ten 1024
run_case ctx-pool-keeps   "$L64" "TESSERA_SIM_CARD=$WORK/card-pool" -- "$T/t_ctx" pool
run_case ctx-two-claims-fill-card "${CARD[@]}" "TESSERA_SIM_CARD=$WORK/card-fill" TESSERA_SIM_GPU_MEMORY_MIB=2048 -- \
    "$T/t_ctx" fill 1024

# Runtime priority: a low-priority claim yields to a high-priority one on the same GPU, and recovers
PRIO=("$SM" "LD_PRELOAD=$TESTLIB" "VT_WORK=$WORK")
run_case priority-yields   "${PRIO[@]}" -- "$T/t_priority" show
run_case priority-high-killed "${PRIO[@]}" -- "$T/t_priority" kill
run_case priority-future-stamp "${PRIO[@]}" -- "$T/t_priority" future
# Every process's own environment and config file say "high": the claim's file (the node's) still says
# low for the low claim, and the claim without a priority does not become high (it never stamps a board)
printf 'CUDA_TASK_PRIORITY=0\nTESSERA_VGPU_PRIORITY_BOARD_0=%s\n' "$WORK/own.board" > "$WORK/own-high.conf"
run_case attack-priority-self-high "${PRIO[@]}" CUDA_TASK_PRIORITY=0 "TESSERA_VGPU_CONFIG=$WORK/own-high.conf" -- \
    sh -c '"$1" show && test ! -s "$2"' sh "$T/t_priority" "$WORK/own.board"

run_case many-100         "CUDA_DEVICE_MEMORY_LIMIT_0=1g" -- "$T/t_many" 100

echo
if ((failed)); then echo "failed: ${failed_names[*]}"; fi
echo "$passed passed, $failed failed"
((failed == 0))
