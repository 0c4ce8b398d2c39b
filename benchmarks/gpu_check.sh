#!/usr/bin/env bash
# Everything aiomp's CUDA support must show on a real NVIDIA GPU, in one run:
#
#     bash benchmarks/gpu_check.sh [LOGDIR]
#
# Installs what is missing (cupy, torch's CUDA build, the project's test extras; on a
# machine with no registry, wheels carried in .whl/ are used), prints nvidia-smi, then runs
# each step with its own timeout and keeps its output in LOGDIR (default .gpu-check/):
#   1. the GPU tests (tests/cuda/test_gpu.py and the torch CUDA tensor test, -m gpu);
#   2. examples/cuda_inference.py;
#   3. the CUDA benchmark (python -m benchmarks.run cuda: rewrites its RESULTS.md section);
#   4. the SIGKILL faults with device memory before and after (benchmarks/gpu_faults.py);
#   5. where a handoff's time goes (benchmarks/profile_cuda.py), for the record.
# Exits non-zero if any step failed; a summary line per step is printed at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-.gpu-check}
mkdir -p "$LOG"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

have() { "$PY" -c "import $1" 2>/dev/null; }
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    # No registry here: the wheels carried beside the tree.
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/aiomp-site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/aiomp-site"
else
    have cupy || "$PY" -m pip install -q "cupy-cuda12x>=13"
    "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null \
        || "$PY" -m pip install -q torch
    "$PY" -m pip install -q -e ".[test]" --no-deps
    "$PY" -m pip install -q anyio numpy pytest pytest-asyncio pytest-timeout trio uvloop
fi

{
    nvidia-smi
    "$PY" - <<'PY'
import sys, cupy, torch, numpy, anyio
print("python", sys.version.split()[0], "| cupy", cupy.__version__, "| CUDA runtime",
      cupy.cuda.runtime.runtimeGetVersion(), "| torch", torch.__version__,
      "cuda", torch.cuda.is_available(), "| numpy", numpy.__version__, "| anyio", anyio.__version__)
PY
} 2>&1 | tee "$LOG/0-setup.log"

declare -a SUMMARY
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit} s): $*"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" >"$LOG/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$LOG/$name.log"
    SUMMARY+=("$name: rc=$rc in $((SECONDS - t0)) s")
    return 0
}

# (hypothesis, on a GPU image, warns at the session's end about trio's PRNG: not ours)
step 1-gpu-tests 200 "$PY" -m pytest -m gpu tests/cuda/test_gpu.py tests/arrays/test_torch.py -q -rs \
    -p no:cacheprovider -p no:hypothesispytest -o timeout=200
step 2-example 90 "$PY" examples/cuda_inference.py
step 3-benchmark 150 "$PY" -m benchmarks.run cuda
step 4-faults 120 "$PY" -m benchmarks.gpu_faults
step 5-profile 90 "$PY" -m benchmarks.profile_cuda
cp benchmarks/RESULTS.md "$LOG/RESULTS.md" 2>/dev/null
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >>"$LOG/0-setup.log"

echo "=== summary"
printf '%s\n' "${SUMMARY[@]}" | tee "$LOG/summary.txt"
! grep -q "rc=[1-9]" "$LOG/summary.txt"
