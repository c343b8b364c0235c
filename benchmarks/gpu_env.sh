# Sourced by the GPU scripts (run_on_gpu.sh, gpu_suite.sh) from the repository root: installs MLX's
# CUDA build from the carried wheels in .whl/ (the GPU machine has no package registry) and sets
# PYTHONPATH and MLX_FLASH_COMMIT. INSTALL_WHEELS=0 (or no wheels) uses the mlx python3 has.
# Returns 3 when the install fails; messages go through `say` if the caller defines it.
command -v say > /dev/null || say() { echo "$*"; }
if [ "${INSTALL_WHEELS:-1}" != 0 ] && compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { say "wheel install failed"; return 3; }
    export PYTHONPATH="/tmp/site:$PWD" PATH="/tmp/site/bin:$PATH"  # bin: mlx.launch
else
    say "not installing .whl/*.whl (none here, or INSTALL_WHEELS=0): using the mlx python3 has"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
# A copied tree may carry a .git older than its files (the device machine's copy does): HEAD names
# the tree only where the sources match it, else it is recorded as HEAD+modified (pass
# MLX_FLASH_COMMIT=<commit> for the tree's own).
if [ -z "${MLX_FLASH_COMMIT:-}" ]; then
    MLX_FLASH_COMMIT=$(git rev-parse --verify -q HEAD 2> /dev/null || echo unknown)
    if [ "$MLX_FLASH_COMMIT" != unknown ] && ! git diff --quiet HEAD -- mlx_flash kernels benchmarks 2> /dev/null; then
        say "the sources differ from .git's HEAD $MLX_FLASH_COMMIT: recorded as $MLX_FLASH_COMMIT+modified"
        MLX_FLASH_COMMIT="$MLX_FLASH_COMMIT+modified"
    fi
fi
export MLX_FLASH_COMMIT
