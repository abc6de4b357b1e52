#!/usr/bin/env bash
# The second call: the one-GPU test fixed after the first call (its local name shadowed the state), then the small
# calls and the asynchronous calls alternated in three pairs, with registration on for both sides
# (OFFLOAD_SHIM_REGISTER_BYTES=1GiB: the code before registered by default, this tree only when asked).
#   bash results/gpu/2026-12-07-one-gpu-state-ab/run2.sh OUTDIR
set -u -o pipefail
out=${1:?OUTDIR}
mkdir -p "$out"
cd "$(dirname "$0")/../../.."
export PYTHONUNBUFFERED=1
python3 -m pip install --no-build-isolation --no-deps -e . > "$out/tests.log" 2>&1
timeout 200 python3 -m pytest -o addopts="" -m gpu -v -p no:cacheprovider tests/test_one_gpu.py -k "registered or opt_in" \
  >> "$out/tests.log" 2>&1
echo "tests rc=$?" >> "$out/tests.log"
python3 -m pip uninstall -y offload_shim >> "$out/tests.log" 2>&1
OFFLOAD_SHIM_REGISTER_BYTES=1GiB ROUNDS=3 timeout 300 bash benchmarks/ab_staging.sh .ab/old "$out/ab" small,async
echo "ab rc=$?" >> "$out/ab/ab.log"
find "$out" -name '*.png' -delete
grep -E "passed|failed|rc=" "$out/tests.log" | tail -n 2
grep -E "^imports|^\| (0-dim|1-element|async)|rc=" "$out/ab/ab.log"
