#!/usr/bin/env bash
# One command for every GPU result this project commits (needs 2 accelerators of one host):
#   bash examples/run_gpu_checks.sh [OUTDIR]
# 1. installs offload_shim (editable, so its torch.backends entry point is live);
# 2. runs the GPU tests (cases 01, 08, 10, 12, the field cases in tests/cases, the equality contract, async work
#    handles, mixed devices, compiled code, communicators);
# 3. runs the example: without the shim on a NCCL-only group (expected to fail with torch's error), with
#    OFFLOAD_SHIM=1, and the two references (offload over cpu:gloo,cuda:nccl without the shim; no offload);
# 4. compares the runs;
# 5. runs the staging benchmark (benchmarks/bench_staging.py: table, JSON, plot).
# Logs and JSON go to OUTDIR (default: $OUT, else ./gpu-results). SKIP_EXAMPLE=1 or SKIP_BENCH=1 leave a part out;
# BENCH_ARGS (e.g. --quick, --only small,served) go to the benchmark, BENCH_COMMIT names the tree in its JSON.
set -u -o pipefail
out=${1:-${OUT:-gpu-results}}
runs=$(mktemp -d)
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
steps=${STEPS:-20}

{
  date -u
  python3 -m pip install --no-build-isolation --no-deps -e . 2>&1 | tail -n 2
  python3 -c 'import torch, wrapt; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", ".".join(map(str, torch.cuda.nccl.version())), "wrapt", wrapt.__version__); print([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])'
  python3 -c 'import importlib.metadata as m; print("torch.backends entry points:", [e.value for e in m.entry_points(group="torch.backends")])'
  nvidia-smi topo -m
  env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)='
} > "$out/env.log" 2>&1

# Every GPU test (cases 01-12, the field cases of tests/cases run by torchrun, the equality contract's GPU part,
# mixed devices, compiled code, communicators); addopts="" drops the CPU suite's xdist workers.
python3 -m pytest -o addopts="" -m gpu -v -s -p no:cacheprovider ${GPU_TESTS:-tests/} 2>&1 | tee "$out/gpu_tests.log"
tests_rc=$?

example() {  # name, env assignments..., -- example arguments...
  local name=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  echo "=== $name: ${envs[*]} torchrun --nproc_per_node 2 examples/train_fsdp2_offload.py $*"
  env "${envs[@]}" torchrun --nproc_per_node 2 examples/train_fsdp2_offload.py --steps "$steps" --out "$runs" --name "$name" "$@" 2>&1
  echo "=== $name: exit $?"
}
[ -n "${SKIP_EXAMPLE:-}" ] || {
  example no-shim-nccl OFFLOAD_SHIM=0 -- --backend nccl
  example shim-nccl OFFLOAD_SHIM=1 -- --backend nccl
  example ref-gloo OFFLOAD_SHIM=0 -- --backend cpu:gloo,cuda:nccl
  example ref-no-offload OFFLOAD_SHIM=0 -- --backend nccl --no-offload
  python3 examples/compare_runs.py "$runs"
} 2>&1 | tee "$out/example.log"
if [ -z "${SKIP_EXAMPLE:-}" ]; then
  cp "$runs/compare.json" "$out/compare.json"
  python3 - "$runs" "$out/runs.json" <<'PY'
import json, sys, glob, os
runs = {os.path.basename(p)[:-5]: json.load(open(p)) for p in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))) if not p.endswith("compare.json")}
json.dump(runs, open(sys.argv[2], "w"), indent=1)
PY
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)} \
    torchrun --nproc_per_node 2 benchmarks/bench_staging.py --out "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log"
fi
exit $tests_rc
