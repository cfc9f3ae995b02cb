#!/usr/bin/env bash
# GPU check of libvgpu on a machine with an NVIDIA GPU, PyTorch, CuPy and gcc: builds the library
# against the real driver and prints ONE table (also written to $OUT/vgpu_gpu_table.md when $OUT is
# set): memory limit with PyTorch (plain and expandable segments) and CuPy, two processes sharing a
# limit, SM share for one process at 30% and 50% and two workloads at 30/70, the same 30/70 with
# PyTorch CUDA graphs (torch.cuda.CUDAGraph replays reach the driver as cuGraphLaunch only), 24
# processes of one 8 GiB claim each making a context (their contexts alone would overflow the claim:
# nvidia-smi's per-process figures must add up to no more than 8 GiB), overhead on a bf16 8192^3
# matmul and on cuMemAlloc latency, start-up of 100 concurrent CUDA processes, and runtime priority (a
# low-priority claim's throughput before, while and after a high-priority one launches on the GPU).
# Every section is guarded: one failing still prints the rest. Budget: under 10 minutes; with
# arguments, only the sections named (after the build), e.g. `run.sh graph_share contexts` (~2 minutes).
set -u
ONLY=" $* "
HERE=$(cd "$(dirname "$0")" && pwd)
VGPU=$(cd "$HERE/../.." && pwd)
ROOT=$(cd "$VGPU/../.." && pwd)
PY=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/vgpu-gpu.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
TABLE=$WORK/table.md
LIB=$VGPU/build/libvgpu.so
GiB=$((1024 * 1024 * 1024))
export PYTHONPATH=$ROOT/libs/shared/src${PYTHONPATH:+:$PYTHONPATH}
T_START=$SECONDS

row() { printf '| %s | %s | %s | %s |\n' "$1" "$2" "$3" "$4" >> "$TABLE"; }
printf '| check | result | target | verdict |\n|---|---|---|---|\n' > "$TABLE"

# section NAME TIMEOUT FUNCTION: runs FUNCTION, which appends rows; on failure adds an ERROR row
section() {
    local name=$1 limit=$2 fn=$3 start=$SECONDS
    [[ $fn == build || $ONLY == "  " || $ONLY == *" $fn "* ]] || return 0
    echo "== $name" >&2
    if ! timeout -k 10 "$limit" bash -c "$(declare -f row $fn); $fn" > "$WORK/$fn.log" 2>&1; then
        row "$name" "ERROR (see below)" "-" "FAIL"
        echo "--- $name failed; last lines:" >&2
        tail -n 15 "$WORK/$fn.log" >&2
    fi
    echo "   $((SECONDS - start)) s" >&2
    # (kept as it goes, so that a run cut short by a time limit still leaves what it measured)
    if [[ -n ${OUT:-} ]]; then cp "$TABLE" "$OUT/vgpu_gpu_table.partial.md"; cp "$WORK/$fn.log" "$OUT/vgpu-$fn.log"; fi
}
export HERE VGPU ROOT PY WORK LIB GiB TABLE

build() {
    make -s -C "$VGPU" build/libvgpu.so >&2 &&
    gcc -O2 -I"$VGPU/include" -o "$WORK/alloc_bench" "$HERE/alloc_bench.c" -ldl &&
    gcc -O2 -I"$VGPU/include" -o "$WORK/startup" "$HERE/startup.c" -ldl &&
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1 > "$WORK/gpu.txt"
}

mem_limits() {
    for v in torch torch_expandable cupy; do
        env LD_PRELOAD="$LIB" CUDA_DEVICE_MEMORY_SHARED_CACHE="$WORK/mem-$v.cache" CUDA_DEVICE_MEMORY_LIMIT_0=8g \
            "$PY" "$HERE/gpu_mem.py" limit "$v" "$WORK/mem-$v.cache" > "$WORK/mem-$v.json" || true
        "$PY" - "$WORK/mem-$v.json" "$v" <<'PYEOF' >> "$TABLE"
import json, sys
r = json.load(open(sys.argv[1])) if open(sys.argv[1]).read().strip() else {"error": "no output"}
v = sys.argv[2]; G = 1 << 30
if "error" in r:
    print(f"| 8 GiB limit, {v} | ERROR {r['error']} | OOM at 8 GiB, total 8 GiB | FAIL |")
else:
    ok = r["total"] == 8 * G and r["oom"] and r["ledger_used_max"] <= 8 * G
    print(f"| 8 GiB limit, {v} | total {r['total']/G:.2f} GiB; stopped by {r['oom_type']} after "
          f"{r['allocated']/G:.2f} GiB; ledger peak {r['ledger_used_max']/G:.3f} GiB | "
          f"own OOM error, total = 8 GiB, no byte over | {'PASS' if ok else 'FAIL'} |")
PYEOF
    done
}

two_procs() {
    local cache=$WORK/two.cache
    env LD_PRELOAD="$LIB" CUDA_DEVICE_MEMORY_SHARED_CACHE="$cache" CUDA_DEVICE_MEMORY_LIMIT_0=8g \
        "$PY" "$HERE/gpu_mem.py" hold 5 "$WORK/hold.stop" > "$WORK/hold.out" &
    local holder=$!
    for _ in $(seq 120); do
        grep -q ready "$WORK/hold.out" 2>/dev/null && break
        kill -0 $holder 2>/dev/null || { echo "holder died" >&2; return 1; }
        sleep 0.5
    done
    env LD_PRELOAD="$LIB" CUDA_DEVICE_MEMORY_SHARED_CACHE="$cache" CUDA_DEVICE_MEMORY_LIMIT_0=8g \
        "$PY" "$HERE/gpu_mem.py" second > "$WORK/second.json"
    touch "$WORK/hold.stop"
    wait $holder
    "$PY" - "$WORK/second.json" <<'PYEOF' >> "$TABLE"
import json, sys
r = json.load(open(sys.argv[1])); G = 1 << 30
ok = abs(r["free_seen"] - 3 * G) < 64 << 20 and r["oom"] and r["allocated"] <= 3 * G
print(f"| two processes, one 8 GiB limit | first holds 5 GiB; second sees {r['free_seen']/G:.2f} GiB free, "
      f"gets {r['allocated']/G:.2f} GiB then {r['oom_type']} | second sees ~3 GiB, gets <= 3 GiB | "
      f"{'PASS' if ok else 'FAIL'} |")
PYEOF
}

sm_share() {
    "$PY" "$HERE/gpu_sm.py" calibrate > "$WORK/sm-cal.json"
    local base
    base=$("$PY" "$HERE/gpu_sm.py" window 8 "$WORK/sm-cal.json")
    for pct in 30 50; do
        local rate
        rate=$(env LD_PRELOAD="$LIB" CUDA_DEVICE_MEMORY_SHARED_CACHE="$WORK/sm$pct.cache" CUDA_DEVICE_SM_LIMIT=$pct \
            "$PY" "$HERE/gpu_sm.py" window 8 "$WORK/sm-cal.json")
        "$PY" -c "
b, r, p = $base, $rate, $pct
s = 100 * r / b
print(f'| SM share, one process at {p}% | {s:.1f}% of unlimited throughput ({r:.0f} vs {b:.0f} kernels/s) | {p} +/- 5 | {\"PASS\" if abs(s - p) <= 5 else \"FAIL\"} |')" >> "$TABLE"
    done
    pair_share "SM share, two workloads at 30/70" gpu_sm.py "$WORK/sm-cal.json" "$base" sm "(HAMi-core: 46/54)"
}

# pair_share LABEL SCRIPT CAL BASE TAG NOTE: two claims (own caches) at 30 % and 70 % run SCRIPT's window
# at once; each one's rate against BASE, the unlimited rate, must be its share +/- 5 points
pair_share() {
    local label=$1 script=$2 cal=$3 base=$4 tag=$5 note=${6:-} a
    env LD_PRELOAD="$LIB" CUDA_DEVICE_MEMORY_SHARED_CACHE="$WORK/${tag}A.cache" CUDA_DEVICE_SM_LIMIT=30 \
        "$PY" "$HERE/$script" window 12 "$cal" > "$WORK/${tag}A.out" &
    a=$!
    env LD_PRELOAD="$LIB" CUDA_DEVICE_MEMORY_SHARED_CACHE="$WORK/${tag}B.cache" CUDA_DEVICE_SM_LIMIT=70 \
        "$PY" "$HERE/$script" window 12 "$cal" > "$WORK/${tag}B.out"
    wait $a
    "$PY" -c "
b, ra, rb = $base, $(cat "$WORK/${tag}A.out"), $(cat "$WORK/${tag}B.out")
sa, sb = 100 * ra / b, 100 * rb / b
ok = abs(sa - 30) <= 5 and abs(sb - 70) <= 5
print(f'| $label | {sa:.1f}% / {sb:.1f}% of {b:.0f}/s $note | 30/70 +/- 5 | {\"PASS\" if ok else \"FAIL\"} |')" >> "$TABLE"
}
export -f pair_share  # (sections run in a bash -c of their own)

graph_share() {
    # two claims at 30/70 replaying PyTorch CUDA graphs at once, against one unlimited replayer
    "$PY" "$HERE/gpu_graph.py" calibrate > "$WORK/gr-cal.json"
    local base
    base=$("$PY" "$HERE/gpu_graph.py" window 8 "$WORK/gr-cal.json")
    pair_share "SM share, PyTorch CUDA graphs at 30/70" gpu_graph.py "$WORK/gr-cal.json" "$base" gr "replays"
}

# nvidia-smi's device memory of one process, MiB (0 when it is not listed)
smi_used() {
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits |
        awk -F', *' -v p="$1" '$1 == p { print $2; found = 1 } END { if (!found) print 0 }'
}
export -f smi_used  # (sections run in a bash -c of their own)

contexts() {
    # what one context costs on this GPU, as the card sees it: the figure the claim declares
    rm -f "$WORK/ov.stop"
    "$PY" "$HERE/gpu_ctx.py" overhead "$WORK/ov.stop" > "$WORK/ov.out" &
    local ov=$! i mib
    for _ in $(seq 120); do grep -q ready "$WORK/ov.out" 2>/dev/null && break; sleep 0.5; done
    mib=$(smi_used $ov)
    touch "$WORK/ov.stop"; wait $ov
    [[ $mib -gt 0 ]] || { echo "nvidia-smi lists no memory for a process with a context" >&2; return 1; }
    # 24 processes of one 8 GiB claim: 24 contexts alone are more than 8 GiB on an H100/H200
    local pids=() n=24
    rm -f "$WORK/ctx.stop"
    for i in $(seq $n); do
        env LD_PRELOAD="$LIB" CUDA_DEVICE_MEMORY_SHARED_CACHE="$WORK/ctx.cache" CUDA_DEVICE_MEMORY_LIMIT_0=8g \
            CUDA_DEVICE_CONTEXT_OVERHEAD="${mib}m" "$PY" "$HERE/gpu_ctx.py" greedy "$WORK/ctx.stop" > "$WORK/ctx-$i.out" &
        pids+=($!)
        # one at a time, so each one's greedy allocation sees the others' (the worst order for the card)
        for _ in $(seq 120); do [[ -s $WORK/ctx-$i.out ]] && break; sleep 0.25; done
    done
    local card=0 refused=0
    for i in $(seq $n); do
        card=$((card + $(smi_used "${pids[$((i - 1))]}")))
        grep -q '"context": 0' "$WORK/ctx-$i.out" || refused=$((refused + 1))
    done
    touch "$WORK/ctx.stop"
    for i in "${pids[@]}"; do wait "$i"; done
    "$PY" -c "
card, ctx, refused, n = $card, $mib, $refused, $n
ok = card <= 8192
print(f'| {n} processes of one 8 GiB claim, a context each ({ctx} MiB) | the card holds {card} MiB for them; {refused} contexts refused (CUDA OOM) | <= 8192 MiB | {\"PASS\" if ok else \"FAIL\"} |')" >> "$TABLE"
}

matmul() {
    local plain with
    plain=$("$PY" "$HERE/gpu_mem.py" matmul)
    with=$(env LD_PRELOAD="$LIB" CUDA_DEVICE_MEMORY_SHARED_CACHE="$WORK/mm.cache" CUDA_DEVICE_MEMORY_LIMIT_0=80g \
        "$PY" "$HERE/gpu_mem.py" matmul)
    "$PY" -c "
p, w = $plain, $with
d = 100 * (p - w) / p
print(f'| bf16 8192^3 matmul | {w:.0f} TFLOP/s with, {p:.0f} without ({d:+.2f}% overhead) | within 1% | {\"PASS\" if d <= 1 else \"FAIL\"} |')" >> "$TABLE"
}

alloc_latency() {
    local plain with
    plain=$("$WORK/alloc_bench" 20000)
    with=$(env LD_PRELOAD="$LIB" CUDA_DEVICE_MEMORY_SHARED_CACHE="$WORK/al.cache" CUDA_DEVICE_MEMORY_LIMIT_0=80g \
        "$WORK/alloc_bench" 20000)
    "$PY" -c "
p, w = $plain, $with
print(f'| cuMemAlloc_v2+cuMemFree_v2 of 1 MiB | {w/1000:.2f} us with, {p/1000:.2f} us without (+{(w-p)/1000:.2f} us) | small | INFO |')" >> "$TABLE"
}

startup() {
    local n=100 t0 t1 t2 pids failed=0 pid
    t0=$EPOCHREALTIME
    pids=()
    for _ in $(seq $n); do "$WORK/startup" & pids+=($!); done
    for pid in "${pids[@]}"; do wait "$pid" || failed=$((failed + 1)); done
    t1=$EPOCHREALTIME
    pids=()
    for _ in $(seq $n); do
        env LD_PRELOAD="$LIB" CUDA_DEVICE_MEMORY_SHARED_CACHE="$WORK/start.cache" CUDA_DEVICE_MEMORY_LIMIT_0=8g \
            "$WORK/startup" & pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || failed=$((failed + 1)); done
    t2=$EPOCHREALTIME
    "$PY" -c "
p, w, failed = $t1 - $t0, $t2 - $t1, $failed
ok = w < 5 and not failed
print(f'| start-up, 100 concurrent CUDA processes | {w:.2f} s with, {p:.2f} s without; {failed} of 200 failed | under 5 s, none failed | {\"PASS\" if ok else \"FAIL\"} |')" >> "$TABLE"
}

priority() {
    # two claims on this GPU meet on its priority board: low (1) runs 6 s, high (0) launches from 2 s to 4 s
    "$PY" "$HERE/gpu_sm.py" calibrate > "$WORK/pr-cal.json"
    local base lo_pid
    base=$("$PY" "$HERE/gpu_sm.py" window 4 "$WORK/pr-cal.json")
    for p in 0 1; do
        printf 'CUDA_TASK_PRIORITY=%s\nTESSERA_VGPU_PRIORITY_BOARD_0=%s\nCUDA_DEVICE_MEMORY_SHARED_CACHE=%s\n' \
            $p "$WORK/gpu0.board" "$WORK/prio$p.cache" > "$WORK/prio$p.conf"
    done
    : > "$WORK/gpu0.board"
    local start
    start=$("$PY" -c 'import time; print(time.time() + 15)')  # both started (imports, compile) by then
    env LD_PRELOAD="$LIB" TESSERA_VGPU_CONFIG="$WORK/prio1.conf" \
        "$PY" "$HERE/gpu_sm.py" timeline 6 "$WORK/pr-cal.json" "$start" 0 6 > "$WORK/pr-low.json" &
    lo_pid=$!
    env LD_PRELOAD="$LIB" TESSERA_VGPU_CONFIG="$WORK/prio0.conf" \
        "$PY" "$HERE/gpu_sm.py" timeline 6 "$WORK/pr-cal.json" "$start" 2 4 > "$WORK/pr-high.json"
    wait $lo_pid
    "$PY" - "$WORK/pr-low.json" "$WORK/pr-high.json" "$base" <<'PYEOF' >> "$TABLE"
import json, sys
low, high, base = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), float(sys.argv[3])
mean = lambda r, a, b: 100 * sum(r[a:b]) / (b - a) / base  # % of unlimited, over 100 ms buckets a..b-1
before, during, after, h = mean(low, 5, 20), mean(low, 22, 40), mean(low, 42, 60), mean(high, 22, 40)
ok = before >= 80 and during <= 15 and after >= 80 and h >= 80
print(f"| runtime priority: low (1) before / while / after high (0) launches | {before:.0f}% / {during:.0f}% / "
      f"{after:.0f}% of {base:.0f}/s; high {h:.0f}% | >= 80 / <= 15 / >= 80; high >= 80 | {'PASS' if ok else 'FAIL'} |")
PYEOF
}

section build 240 build || { echo "build failed; nothing else can run" >&2; }
if [[ -f $LIB ]]; then
    section "memory limits" 150 mem_limits
    section "two processes" 90 two_procs
    section "SM share" 120 sm_share
    section "graph SM share" 150 graph_share
    section "contexts" 150 contexts
    section "matmul overhead" 90 matmul
    section "alloc latency" 60 alloc_latency
    section "start-up" 90 startup
    section "runtime priority" 120 priority
fi

{
    echo "### libvgpu on $(cat "$WORK/gpu.txt" 2>/dev/null || echo 'unknown GPU') ($((SECONDS - T_START)) s)"
    echo
    cat "$TABLE"
} > "$WORK/final.md"
cat "$WORK/final.md"
if [[ -n ${OUT:-} ]]; then cp "$WORK/final.md" "$OUT/vgpu_gpu_table.md"; fi
