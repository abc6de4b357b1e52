#!/usr/bin/env bash
# The second call: the one recipe test the first call's time limit cut off, then the benchmark before and after in
# four rounds, the order turned each round, with registration on for both sides (OFFLOAD_SHIM_REGISTER_BYTES=1GiB:
# the code before registered by default, this tree only when asked).
#   bash results/gpu/2026-12-07-one-gpu-record-ab/run2.sh OUTDIR
set -u -o pipefail
out=${1:?OUTDIR}
mkdir -p "$out"
cd "$(dirname "$0")/../../.."
export PYTHONUNBUFFERED=1
python3 -m pip install --no-build-isolation --no-deps -e . > "$out/tests.log" 2>&1
timeout 150 python3 -m pytest -o addopts="" -m gpu -v -p no:cacheprovider tests/test_one_gpu_frameworks.py \
  -k torchmetrics >> "$out/tests.log" 2>&1
echo "tests rc=$?" >> "$out/tests.log"
python3 -m pip uninstall -y offload_shim >> "$out/tests.log" 2>&1
OFFLOAD_SHIM_REGISTER_BYTES=1GiB ROUNDS=4 timeout 380 bash benchmarks/ab_staging.sh .ab/old "$out/ab" \
  copy_limits,small,pageable,duplex,async
echo "ab rc=$?" >> "$out/ab/ab.log"
python3 benchmarks/ab_report.py "$out/ab" > "$out/ab/table.md" 2>&1
find "$out" -name '*.png' -delete
(cd "$out/ab" && tar czf ../runs.tgz other* this* && rm -r other* this*)  # (at most 8 files come back)
grep -E "passed|failed|rc=" "$out/tests.log" | tail -n 2
cat "$out/ab/table.md"
