#!/usr/bin/env bash
# Run the benchmark suite on an NVIDIA GPU machine that has no package registry.
#
# Usage, from the repository root:
#     MLX_FLASH_COMMIT=<commit> benchmarks/run_on_gpu.sh [OUT_DIR] [extra bench.py arguments...]
#
# OUT_DIR defaults to $OUT (a folder the caller collects), else /tmp/mlx-flash-bench; results are
# copied into benchmarks/results/ by hand. It runs bench.py's "gpu" preset (the published GPU
# table, a few minutes on an H100). Extra arguments go after the preset, so they override it, e.g.
#     benchmarks/run_on_gpu.sh "$OUT" --head-dims 128 --seq-lens 4096 8192
#     BACKEND=mlx benchmarks/run_on_gpu.sh          # time the blocked MLX-ops backend instead
# Environment: BACKEND (mlx-flash backend, default auto), TIME_BUDGET_S (default 420: no new case
# starts after it, so the run ends inside a 600 s command limit), MLX_FLASH_COMMIT (recorded in
# the JSON where the copied tree has no .git), INSTALL_WHEELS=0 (use the installed mlx; for a
# dry run on a CPU machine).
#
# MLX's CUDA build comes from the wheels in .whl/ (git-ignored: carry it to the machine); without
# them the installed mlx is used. torch's FlashAttention-2 and cuDNN columns are measured when
# torch with CUDA imports, and skipped with the reason otherwise.
#
# Writes at most 5 files into OUT_DIR, no subfolders: bench_gpu.log, bench_gpu.json and one
# bench_gpu_d<D>_bfloat16.png per head dim.
set -uo pipefail

cd "$(dirname "$0")/.."
out_dir="${1:-${OUT:-/tmp/mlx-flash-bench}}"
[ $# -gt 0 ] && shift
mkdir -p "$out_dir"
log="$out_dir/bench_gpu.log"

{
    echo "== benchmarks/run_on_gpu.sh, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(uname -srm)"
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv 2>&1 || echo "(no nvidia-smi)"
    source benchmarks/gpu_env.sh || exit 3
    python3 -c "import mlx.core as mx; print('MLX', mx.__version__, mx.default_device(), mx.device_info())" \
        || { echo "mlx does not import"; exit 3; }
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" 2>&1 \
        || echo "torch does not import: the torch-fa2 and torch-cudnn columns will be skipped"

    python3 benchmarks/bench.py \
        --backend "${BACKEND:-auto}" \
        --preset gpu \
        --time-budget-s "${TIME_BUDGET_S:-420}" \
        --out "$out_dir" --name bench_gpu "$@"
    status=$?
    echo "bench.py exit status $status"
    exit "$status"
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
