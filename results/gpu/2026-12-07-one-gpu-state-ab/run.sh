#!/usr/bin/env bash
# After the state, registration and warnings changes, on one GPU, in one device call: every one-GPU test (tree
# installed), then the staging benchmark of the code before the session (.ab/old, a git archive of 7823868, carried)
# and of this tree alternated (benchmarks/ab_staging.sh: other, this, other, this; nothing installed during it).
#   bash results/gpu/2026-12-07-one-gpu-state-ab/run.sh OUTDIR
set -u -o pipefail
out=${1:?OUTDIR}
mkdir -p "$out"
cd "$(dirname "$0")/../../.."
export PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import torch, wrapt, sys; print("torch", torch.__version__, "nccl", ".".join(map(str, torch.cuda.nccl.version())), "wrapt", wrapt.__version__, "python", sys.version.split()[0])'
} > "$out/env.log" 2>&1
python3 -m pip install --no-build-isolation --no-deps -e . >> "$out/env.log" 2>&1
timeout 300 python3 -m pytest -o addopts="" -m gpu -v -p no:cacheprovider tests/test_one_gpu.py > "$out/tests.log" 2>&1
echo "tests rc=$?" >> "$out/tests.log"
python3 -m pip uninstall -y offload_shim >> "$out/env.log" 2>&1  # (an editable finder would serve both sides)
timeout 270 bash benchmarks/ab_staging.sh .ab/old "$out/ab" "${SECTIONS:-copy_limits,small,pageable,duplex,async}"
echo "ab rc=$?" >> "$out/ab/ab.log"
find "$out" -name '*.png' -delete
grep -E "passed|failed|rc=" "$out/tests.log" | tail -n 2
grep -E "^imports|^\| (0-dim|1-element|pageable|pinned|async)|rc=" "$out/ab/ab.log"
