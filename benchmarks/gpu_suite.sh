#!/usr/bin/env bash
# The CUDA backend's GPU run, for one NVIDIA H100 / H200 and one 10-minute command:
#   1. tests/test_cuda.py with every GPU family's plans (MLX_FLASH_CUDA_CAPABILITY=80, 86, 120:
#      edge cases D = 1..512, the bounded property suite, block orders, determinism) and natively
#      (sm_90: the wgmma kernels too, and the property suite in PROPERTY_SHARDS = 4 processes of
#      PROPERTY_EXAMPLES = 6 examples, hypothesis seeds 0..3; the N = 16K cases left to the full run);
#   2. compute-sanitizer memcheck and racecheck over benchmarks/sanitize_cases.py, every family
#      in a process of its own (all at once), and natively with the dK/dV kernel's fused dQ
#      forced (--fused-dq);
#   3. the speed table of benchmarks/RESULTS.md: bench.py --preset gpu (its shapes and columns:
#      B=4 H=16 N=4096 D=64 / 128, B=1 H=16 N=16384 D=128, B=1 H=16 N=4096 D=160 / 192 / 256 / 512,
#      causal and not, bf16, forward and forward+backward, implementations interleaved, each sample
#      8 calls back to back as the table's).
#
# Usage, from the repository root (on the device machine, with .whl/ carried):
#     benchmarks/gpu_suite.sh [OUT_DIR]             # all phases
#     PHASES="tests" benchmarks/gpu_suite.sh        # some of them: tests, sanitize, bench, ab
#     AB_AGAINST=.ab/BASE PHASES=ab benchmarks/gpu_suite.sh   # benchmarks/ab_versions.py against BASE
#                                                   # (AB_ARGS: its other arguments; AB_S: its limit)
#     PHASES=profile benchmarks/gpu_suite.sh        # benchmarks/ncu_profile.py (ncu): PROFILE_ARGS,
#                                                   # PROFILE_S (240)
# SANITIZE_ARGS: more arguments of every sanitize_cases.py run (e.g. --layout offset, --head-splits 2).
# OUT_DIR defaults to $OUT, else ${TMPDIR:-/tmp}/gpu_suite (outside the tree). Every step has a time limit and
# reports TIMEOUT rather than running past it: TESTS_S (240) for each test process, which run at
# once (the three families in FAMILY_SHARDS = 2 processes each, the native run in NATIVE_SHARDS =
# 8: NVRTC compiles one kernel at a time per process; in one process on an H200 machine 16 of the
# 141 native tests took 102 s), SANITIZE_S (160) for each sanitizer process (all side by
# side), BENCH_S (150): under 600 s with setup. For the thorough run, two commands:
#     PHASES=tests TESTS_S=540 benchmarks/gpu_suite.sh
#     PHASES="sanitize bench" SANITIZE_S=300 BENCH_S=240 benchmarks/gpu_suite.sh
# SANITIZE_CAPS (default "80 86 120 native") picks the families the sanitizers run, FAMILIES
# (default "80 86 120"; empty: none) the families the tests phase runs beside the native run.
# Logs: suite.log (one line per step) and one log per step, a sharded run's shards in one.
# MLX's CUDA build is installed from .whl/*.whl exactly as benchmarks/run_on_gpu.sh does.
set -uo pipefail

cd "$(dirname "$0")/.."
out_dir="${1:-${OUT:-${TMPDIR:-/tmp}/gpu_suite}}"
mkdir -p "$out_dir"
summary="$out_dir/suite.log"
phases="${PHASES:-tests sanitize bench}"
started=$(date +%s)
say() { echo "[$(( $(date +%s) - started ))s] $*" | tee -a "$summary"; }

# step NAME LIMIT_S COMMAND...: run with a time limit, log to OUT_DIR/NAME.log, one summary line
step() {
    local name="$1" limit="$2"; shift 2
    local t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$out_dir/$name.log" 2>&1
    local code=$?
    local verdict="exit $code"; [ $code -eq 124 ] || [ $code -eq 137 ] && verdict="TIMEOUT after ${limit}s"
    say "$name: $verdict ($(( $(date +%s) - t0 ))s) | $(grep -E 'passed|failed|error|ERROR SUMMARY|RACECHECK SUMMARY|Hazard|done|capability|wrote|skipped' "$out_dir/$name.log" | tail -4 | tr '\n' ' ')"
}

# sharded NAME LIMIT SHARDS K_EXPR [VAR=VALUE...]: the tests of tests/test_cuda.py that K_EXPR
# selects (under the VAR=VALUE environment), dealt round-robin to SHARDS pytest processes started
# in the background (the caller waits), each a step NAME_<i> with its own log.
sharded() {
    local name="$1" limit="$2" shards="$3" kexpr="$4"; shift 4
    env "$@" python3 -m pytest tests/test_cuda.py --collect-only -q -p no:cacheprovider -k "$kexpr" \
        2> /dev/null | grep '::' > "$out_dir/$name.ids"
    [ -s "$out_dir/$name.ids" ] || { say "$name: no tests collected"; return; }
    local i ids
    for (( i = 0; i < shards; i++ )); do
        mapfile -t ids < <(awk -v n="$shards" -v i="$i" '(NR - 1) % n == i' "$out_dir/$name.ids")
        [ ${#ids[@]} -gt 0 ] || continue
        step "${name}_$i" "$limit" env "$@" python3 -m pytest -q -p no:cacheprovider "${ids[@]}" &
    done
}

# merge_shards NAME: NAME_<i>.log into NAME.log, each under a "== NAME_<i>" line (a device call
# brings back a few files only).
merge_shards() {
    local name="$1" f
    compgen -G "$out_dir/${name}_*.log" > /dev/null || return 0
    for f in "$out_dir/${name}"_*.log; do
        echo "== $(basename "$f" .log)"; cat "$f"; echo
    done > "$out_dir/$name.log"
    rm -f "$out_dir/${name}"_*.log "$out_dir/$name.ids"
}

{
    echo "== benchmarks/gpu_suite.sh, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(uname -srm), phases: $phases"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "(no nvidia-smi)"
} | tee "$summary"
source benchmarks/gpu_env.sh || exit 3
unset MLX_FLASH_CUDA_CAPABILITY
python3 -c "import mlx.core as mx; print('MLX', mx.__version__, mx.device_info())" 2>&1 | tee -a "$summary" \
    || { say "mlx does not import"; exit 3; }

for phase in $phases; do
    case "$phase" in
    tests)
        # Kernel compilation (NVRTC, one kernel at a time per process) bounds this phase, not the
        # GPU: every family and the native run are split into pytest processes that run at once.
        budget="${TESTS_S:-240}"
        for cap in ${FAMILIES-80 86 120}; do
            sharded "tests_sm$cap" "$budget" "${FAMILY_SHARDS:-2}" \
                "edge_cases or property_suite or block_orders or bitwise or separately or grid_y" \
                MLX_FLASH_CUDA_CAPABILITY=$cap MLX_FLASH_CUDA_EXAMPLES=8
        done
        sharded tests_native "$budget" "${NATIVE_SHARDS:-8}" "not property_suite and not large_against and not emulated"
        # The float64 property suite on this GPU's own plans (the wgmma kernels): PROPERTY_SHARDS
        # processes of PROPERTY_EXAMPLES examples each, each drawing its own (hypothesis seed i).
        for (( i = 0; i < ${PROPERTY_SHARDS:-4}; i++ )); do
            step "property_native_$i" "$budget" env HYPOTHESIS_PROFILE=dev MLX_FLASH_CUDA_EXAMPLES="${PROPERTY_EXAMPLES:-6}" \
                python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider -k property_suite --hypothesis-seed="$i" &
        done
        wait
        for name in tests_sm80 tests_sm86 tests_sm120 tests_native property_native; do merge_shards "$name"; done
        ;;
    sanitize)
        # The cases as the block table plans them, one process per (tool, family) so that each
        # prints its own summary (in one process per tool, a limit cut the last families and the
        # summary line of all), and natively the fused dQ forced over calls of 4 key blocks (the
        # table turns it on only from 1024 queries, past the cases' lengths).
        for tool in memcheck racecheck; do
            for cap in ${SANITIZE_CAPS:-80 86 120 native}; do
                step "sanitizer_${tool}_$cap" "${SANITIZE_S:-160}" compute-sanitizer --tool "$tool" --error-exitcode 3 \
                    python3 benchmarks/sanitize_cases.py "$cap" ${SANITIZE_ARGS:-} &
            done
            step "sanitizer_${tool}_fused_dq" "${SANITIZE_S:-160}" compute-sanitizer --tool "$tool" --error-exitcode 3 \
                python3 benchmarks/sanitize_cases.py native --fused-dq --n 400 --head-dims 48 96 64 ${SANITIZE_ARGS:-} &
        done
        wait
        for tool in memcheck racecheck; do merge_shards "sanitizer_$tool"; done
        ;;
    bench)
        budget="${BENCH_S:-150}"
        step bench_gpu_preset "$budget" python3 benchmarks/bench.py --preset gpu --backend cuda --no-plots \
            --back-to-back 8 --time-budget-s $(( budget - 30 )) --out "$out_dir" --name bench_gpu_suite
        ;;
    ab)
        # This tree's kernels against AB_AGAINST's (a folder carried with the call: the machine's
        # copy of the tree has no usable .git; benchmarks/ab_versions.py says how to make one).
        if [ -z "${AB_AGAINST:-}" ]; then say "ab: set AB_AGAINST to a folder with mlx_flash/ and kernels/"; continue; fi
        step ab_versions "${AB_S:-240}" python3 benchmarks/ab_versions.py --against "$AB_AGAINST" \
            --out "$out_dir/ab_versions.json" ${AB_ARGS:-}
        ;;
    profile)
        step ncu_profile "${PROFILE_S:-240}" python3 benchmarks/ncu_profile.py --out "$out_dir" ${PROFILE_ARGS:-}
        ;;
    *) say "unknown phase $phase (tests, sanitize, bench, ab, profile)";;
    esac
done
say "done: $out_dir"
