#!/usr/bin/env bash
# Run taskpoint-unsloth's GPU tests (4-bit base, Unsloth gradient checkpointing, bf16, CUDA
# RNG restore) on any CUDA machine, in one command, from anywhere in the checkout:
#
#     integrations/unsloth/scripts/gpu-tests.sh            # GPU tests only
#     integrations/unsloth/scripts/gpu-tests.sh --all      # the CPU tests as well
#
# Needs an NVIDIA driver recent enough for the locked torch (a CUDA 13 build: driver >= 580)
# and uv (installed to ~/.local/bin when missing). Sized to finish in under 10 minutes:
# about 3-5 minutes to install the locked environment, under a minute for the tests.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
project="$(dirname "$here")"              # integrations/unsloth
repo="$(cd "$project/../.." && pwd)"

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi >/dev/null 2>&1; then
    echo "gpu-tests.sh: nvidia-smi is missing or failing: this needs a machine with a CUDA GPU" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

if ! command -v uv >/dev/null 2>&1; then
    curl -LsSf https://astral.sh/uv/install.sh | sh
    export PATH="$HOME/.local/bin:$PATH"
fi

cd "$repo"
export UV_PROJECT_ENVIRONMENT=.venv-unsloth  # the lock's `unsloth` fork, beside .venv
start=$(date +%s)
uv sync --locked --only-group unsloth
echo "gpu-tests.sh: environment ready in $(( $(date +%s) - start ))s"

marker=(-m gpu)
if [[ "${1:-}" == "--all" ]]; then
    marker=()
fi
export TASKPOINT_REQUIRE_GPU=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"  # deterministic cuBLAS
timeout 540 uv run --locked --only-group unsloth \
    pytest "$project/tests" "${marker[@]}" -v -ra --durations=10
