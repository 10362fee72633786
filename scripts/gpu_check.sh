#!/usr/bin/env bash
# One run for a GPU session (docs/gpu.md): the gpu test tier, the multigpu tier (skipped
# below 2 GPUs), then the GPU table. Every step's output is kept under $OUT (default
# out/gpu_check): env.txt, pytest_gpu.log, pytest_multigpu.log, gpu_bench.log and the
# bench's own files in bench/. Unbuffered, so a run cut short still leaves its logs.
# Without CUDA it still runs: the tests skip (the reason is printed) and the bench runs at
# toy size on the CPU (--device cpu --tiny). Exit status: 1 if any step failed.
#
#   bash scripts/gpu_check.sh                 # logs in out/gpu_check/
#   OUT=/somewhere bash scripts/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
status=0

step() {        # step NAME LOGFILE COMMAND...: run, tee the output, remember a failure
    local name=$1 log=$2
    shift 2
    echo "=== $name: $*" | tee "$OUT/$log"
    local t0=$SECONDS
    "$@" 2>&1 | tee -a "$OUT/$log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/$log"
    [ "$rc" -eq 0 ] || status=1
}

python - > "$OUT/env.txt" 2>&1 <<'PY'
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda)
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
for i in range(n):
    p = torch.cuda.get_device_properties(i)
    print(f"gpu {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
print("gpus:", n)
PY
command -v nvidia-smi > /dev/null && nvidia-smi >> "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

step "gpu tier" pytest_gpu.log python -m pytest -m gpu -rA --durations=0
step "multigpu tier" pytest_multigpu.log python -m pytest -m multigpu -rA --durations=0
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    step "gpu bench" gpu_bench.log python -m scripts.gpu_bench --out-dir "$OUT/bench"
else
    step "gpu bench (no CUDA: toy size on the CPU)" gpu_bench.log \
        python -m scripts.gpu_bench --device cpu --tiny --threads 1 --out-dir "$OUT/bench"
fi
echo "logs in $OUT; status $status"
exit $status
