#!/usr/bin/env bash
# `make gpu-session`: every GPU check and benchmark in one call, sized for a short lease.
#
#   benchmarks/gpu_session.sh OUT [SECONDS]
#
# Runs, in order, each phase under its own time limit, its log written to OUT as it goes
# (a phase cut short keeps what it printed; the benchmark rewrites its JSON and markdown
# after every variant and every round), and never past SECONDS in all (default 570):
#
#   1. gpu-tests.log   the machine (nvidia-smi, versions, devices), then the CUDA comparison
#                      tests (`pytest -m gpu`: GradScaler("cuda") trajectories, the float16
#                      skip, the transformer block against torch.autocast("cuda"));
#   2. exact-tests.log the exactness, numerics, config, transform and retry tests on the GPU
#                      backend (XLA:GPU keeps subnormals, so they check every bit), in
#                      parallel processes (pytest-xdist where installed);
#   3. bench-large.log + bench-gpu-large.{json,md}: GPT-2 small against PyTorch AMP
#                      (benchmarks/bench_large.py; BENCH_ARGS adds arguments, e.g. --tiny);
#   4. retry.log + retry-sync-gpu.md: whether a retry_on_overflow step makes the host wait.
#
# OUT holds at most 8 files, so that all of them come back from a lent machine.
# Uses the installed python3 (no venv, no network): PYTHONPATH=. imports this checkout.
set -u
out=${1:?usage: benchmarks/gpu_session.sh OUT [SECONDS]}
total=${2:-570}
py=${PYTHON:-python3}
mkdir -p "$out"
start=$(date +%s)
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false

left() { echo $((total - ($(date +%s) - start))); }

# phase NAME LIMIT COMMAND...: COMMAND under min(LIMIT, time left), appending to OUT/NAME.log.
phase() {
  local name=$1 limit=$2 l t0 rc
  shift 2
  l=$(left)
  ((limit > l)) && limit=$l
  if ((limit < 20)); then
    echo "== $name: not run, ${l}s left" | tee -a "$out/$name.log"
    return
  fi
  echo "== $name: $* (limit ${limit}s)" | tee -a "$out/$name.log"
  t0=$(date +%s)
  timeout -k 5 "$limit" "$@" >>"$out/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc after $(($(date +%s) - t0))s$( ((rc == 124)) && echo ' (time limit)')" |
    tee -a "$out/$name.log"
}

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1
  "$py" - <<'EOF' 2>&1
import importlib, platform
print("python", platform.python_version())
for m in ("jax", "jaxlib", "optax", "flax", "chex", "equinox", "torch", "triton", "xdist"):
    try:
        print(m, importlib.import_module(m).__version__)
    except Exception as e:
        print(m, "missing:", type(e).__name__)
import jax
print("devices", jax.devices())
try:
    import torch
    print("torch cuda", torch.cuda.is_available(), torch.version.cuda, torch.backends.cudnn.version())
except Exception as e:
    print("torch:", e)
EOF
} >"$out/gpu-tests.log"
cat "$out/gpu-tests.log"

xdist=()
"$py" -c "import xdist" 2>/dev/null && xdist=(-n 8)
exact=(tests/test_skip.py tests/test_numerics.py tests/test_transform_config.py
  tests/test_transform.py tests/test_retry.py)

phase gpu-tests 90 "$py" -m pytest -q -rfEs -m gpu -p no:cacheprovider tests
phase exact-tests 100 "$py" -m pytest -q -rfE "${xdist[@]}" -p no:cacheprovider -p no:benchmark "${exact[@]}"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
phase bench-large 310 "$py" benchmarks/bench_large.py --out "$out" --budget-s 290 \
  --steps 8 ${BENCH_ARGS:-}
phase retry 70 "$py" benchmarks/bench_retry_sync.py --model gpt --out "$out"

echo "== summary ($(($(date +%s) - start))s)"
grep -h "^== \|passed\|failed\|error" "$out"/gpu-tests.log "$out"/exact-tests.log | tail -n 20
[ -f "$out/bench-gpu-large.md" ] && cat "$out/bench-gpu-large.md"
[ -f "$out/retry-sync-gpu.md" ] && cat "$out/retry-sync-gpu.md"
exit 0
