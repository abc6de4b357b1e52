#!/usr/bin/env bash
# Forked children after staged calls, on one GPU, in one device call: tests/fork_after_staging.py three ways (staged
# by hand without the shim, the baseline; the code before the change, from .old/, a git archive of it; this tree),
# one rank on NCCL and two ranks sharing the GPU through cuda:gloo, each side's whole output in SIDE.log; then the
# one-GPU tests named by TESTS (a pytest -k expression; "all": every one; default: the fork tests).
#   bash results/gpu/2026-12-07-one-gpu-fork/run.sh OUTDIR
set -u -o pipefail
out=${1:?OUTDIR}
mkdir -p "$out"
cd "$(dirname "$0")/../../.."
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1  # (see tests/fork_after_staging.py)
{
  date -u
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import torch, wrapt, sys; print("torch", torch.__version__, "nccl", ".".join(map(str, torch.cuda.nccl.version())), "wrapt", wrapt.__version__, "python", sys.version.split()[0])'
} > "$out/env.log" 2>&1
for side in by-hand old new; do
  tree=$PWD; extra=
  [ "$side" = old ] && tree=$PWD/.old
  [ "$side" = by-hand ] && extra=--by-hand
  for case in "1 nccl" "2 cuda:gloo"; do
    set -- $case
    echo "== $side: $1 rank(s), $2"
    PYTHONPATH=$tree timeout 240 torchrun --standalone --nproc_per_node "$1" tests/fork_after_staging.py --backend "$2" \
      $extra 2>&1 | grep -v "^W1.*run.py\|^\s*$"
    echo "rc=${PIPESTATUS[0]}"
  done > "$out/$side.log" 2>&1
done
python3 -m pip install --no-build-isolation --no-deps -e . > "$out/install.log" 2>&1
tests=${TESTS:-forked}
[ "$tests" = all ] && tests=
timeout 420 python3 -m pytest -o addopts="" -m gpu -v -p no:cacheprovider tests/test_one_gpu.py ${tests:+-k "$tests"} \
  > "$out/one_gpu_tests.log" 2>&1
echo "tests rc=$?" >> "$out/one_gpu_tests.log"
grep -hE "^== |^OK|^rc=|^\[rank.\]: [A-Za-z]*Error|status -?[0-9]" "$out/by-hand.log" "$out/old.log" "$out/new.log"
grep -E "passed|failed|rc=" "$out/one_gpu_tests.log" | tail -n 3
