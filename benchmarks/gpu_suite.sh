#!/usr/bin/env bash
# The CUDA backend's GPU run, for one NVIDIA H100 and one 10-minute command:
#   1. tests/test_cuda.py with every GPU family's plans (MLX_FLASH_CUDA_CAPABILITY=80, 86, 120:
#      edge cases D = 1..512, the bounded property suite, block orders, determinism) and natively
#      (sm_90: the wgmma kernels too; the property suite and the N = 16K cases left to the full run);
#   2. compute-sanitizer memcheck and racecheck over benchmarks/sanitize_cases.py, every family;
#   3. the speed table of benchmarks/RESULTS.md: bench.py --preset gpu (its shapes and columns:
#      B=4 H=16 N=4096 D=64 / 128, B=1 H=16 N=16384 D=128, B=1 H=16 N=4096 D=160 / 192 / 256 / 512,
#      causal and not, bf16, forward and forward+backward, implementations interleaved).
#
# Usage, from the repository root (on the device machine, with .whl/ carried):
#     benchmarks/gpu_suite.sh [OUT_DIR]             # all phases
#     PHASES="tests" benchmarks/gpu_suite.sh        # some of them: tests, sanitize, bench, ab
#     AB_AGAINST=.ab/BASE PHASES=ab benchmarks/gpu_suite.sh   # benchmarks/ab_versions.py against BASE
#                                                   # (AB_ARGS: its other arguments; AB_S: its limit)
# OUT_DIR defaults to $OUT, else benchmarks/results/gpu_suite. Every phase and step has a time
# limit (TESTS_S, SANITIZE_S, BENCH_S seconds: 240 + 160 + 150 by default, under 600 s with setup)
# and reports TIMEOUT rather than running past it. For the thorough run, two commands:
#     PHASES=tests TESTS_S=540 benchmarks/gpu_suite.sh
#     PHASES="sanitize bench" SANITIZE_S=300 BENCH_S=240 benchmarks/gpu_suite.sh
# SANITIZE_CAPS (default "80 86 120 native") picks the families the sanitizers run.
# Logs: suite.log (one line per step) and one log per step.
# MLX's CUDA build is installed from .whl/*.whl exactly as benchmarks/run_on_gpu.sh does.
set -uo pipefail

cd "$(dirname "$0")/.."
out_dir="${1:-${OUT:-benchmarks/results/gpu_suite}}"
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
        budget="${TESTS_S:-240}"; each=$(( budget * 2 / 9 ))  # 3 families x 2/9, native the rest
        for cap in 80 86 120; do
            step "tests_sm$cap" "$each" env MLX_FLASH_CUDA_CAPABILITY=$cap MLX_FLASH_CUDA_EXAMPLES=8 \
                python3 -m pytest tests/test_cuda.py -q -x -p no:cacheprovider \
                -k "edge_cases or property_suite or block_orders or bitwise or separately or grid_y"
        done
        step tests_native "$(( budget - 3 * each ))" python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider \
            -k "not property_suite and not large_against and not emulated"
        ;;
    sanitize)
        each=$(( ${SANITIZE_S:-160} / 2 ))
        for tool in memcheck racecheck; do
            step "sanitizer_$tool" "$each" compute-sanitizer --tool "$tool" --error-exitcode 3 \
                python3 benchmarks/sanitize_cases.py ${SANITIZE_CAPS:-80 86 120 native}
        done
        ;;
    bench)
        budget="${BENCH_S:-150}"
        step bench_gpu_preset "$budget" python3 benchmarks/bench.py --preset gpu --backend cuda --no-plots \
            --time-budget-s $(( budget - 30 )) --out "$out_dir" --name bench_gpu_suite
        ;;
    ab)
        # This tree's kernels against AB_AGAINST's (a folder carried with the call: the machine's
        # copy has no .git; benchmarks/ab_versions.py says how to make one), interleaved.
        if [ -z "${AB_AGAINST:-}" ]; then say "ab: set AB_AGAINST to a folder with mlx_flash/ and kernels/"; continue; fi
        step ab_versions "${AB_S:-240}" python3 benchmarks/ab_versions.py --against "$AB_AGAINST" \
            --out "$out_dir/ab_versions.json" ${AB_ARGS:-}
        ;;
    *) say "unknown phase $phase (tests, sanitize, bench, ab)";;
    esac
done
say "done: $out_dir"
