#!/usr/bin/env bash
# After registered communicators went through the one decision and executor, on one GPU: every one-GPU test, the
# one-rank communicator test among them (tree installed; TESTS=0 skips them), then (AB=1) the staging benchmark of
# the code before the restructuring (.ab/old, a git archive of 7823868, carried) and of this tree alternated, the
# order turned each round (benchmarks/ab_staging.sh; nothing installed during it), and its table
# (benchmarks/ab_report.py).
#   [TESTS=1] [AB=0] [ROUNDS=N] [SECTIONS=...] bash results/gpu/2026-12-07-one-gpu-one-path/run.sh OUTDIR
set -u -o pipefail
out=${1:?OUTDIR}
mkdir -p "$out"
cd "$(dirname "$0")/../../.."
export PYTHONUNBUFFERED=1
{
  date -u
  git log -1 --format=%H 2>/dev/null || true
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import torch, wrapt, sys; print("torch", torch.__version__, "nccl", ".".join(map(str, torch.cuda.nccl.version())), "wrapt", wrapt.__version__, "python", sys.version.split()[0])'
} > "$out/env.log" 2>&1
if [ "${TESTS:-1}" = 1 ]; then
  python3 -m pip install --no-build-isolation --no-deps -e . >> "$out/env.log" 2>&1
  timeout "${TEST_SECONDS:-500}" python3 -m pytest -o addopts="" -m gpu -v -p no:cacheprovider tests/test_one_gpu.py tests/test_communicators.py \
    tests/test_one_gpu_frameworks.py > "$out/tests.log" 2>&1
  echo "tests rc=$?" >> "$out/tests.log"
  python3 -m pip uninstall -y offload_shim >> "$out/env.log" 2>&1  # (an editable finder would serve both sides)
  grep -E "passed|failed|rc=" "$out/tests.log" | tail -n 2
fi
if [ "${AB:-0}" = 1 ]; then
  ROUNDS=${ROUNDS:-3} timeout "${AB_SECONDS:-500}" bash benchmarks/ab_staging.sh .ab/old "$out/ab" \
    "${SECTIONS:-copy_limits,small,pageable,duplex,async}"
  echo "ab rc=$?" >> "$out/ab/ab.log"
  python3 benchmarks/ab_report.py "$out/ab" > "$out/ab/table.md" 2>&1
  find "$out" -name '*.png' -delete
  (cd "$out/ab" && tar czf ../runs.tgz other* this* && rm -r other* this*)  # (at most 8 files come back)
  cat "$out/ab/table.md"
fi
