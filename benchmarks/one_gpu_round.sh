#!/usr/bin/env bash
# One round on one accelerator, in one device call: install, the one-GPU tests, the one-rank staging benchmark, and
# the replayed small call taken apart; everything under OUTDIR.
#   TESTS=EXPR SECTIONS=LIST bash benchmarks/one_gpu_round.sh OUTDIR
# TESTS: a pytest -k expression for tests/test_one_gpu.py (default: every test; "none": no tests);
# CPU_TESTS: a pytest -k expression for the CPU tests to run under this machine's torch too (default: those of the
#   served path's answers, __torch_function__ and overlapping outputs; "none": none);
# SECTIONS: bench_staging.py's --only (default: copy_limits,small,served,pageable); PROBE=none: no probe of the replayed
#   small call; COLD=none: no probe of the served path with the caches evicted (probe_served_cold_cache.py).
set -u -o pipefail
out=${1:?OUTDIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
{
  date -u
  python3 -m pip install --no-build-isolation --no-deps -e . 2>&1 | tail -n 1
  python3 -c 'import torch, wrapt, sys; print("torch", torch.__version__, "nccl", ".".join(map(str, torch.cuda.nccl.version())), "wrapt", wrapt.__version__, "python", sys.version.split()[0]); print(torch.cuda.get_device_name(0))'
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'from offload_shim import _wrappers; print("collectives this torch calls from another:", {n: len(_wrappers._callers(n)) for n in ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor")})'
  python3 -c 'from offload_shim import _wrappers, _table; print("collectives this torch hands to __torch_function__:", sorted(n for n in _table.C10D if _wrappers._handed(n)))'
} > "$out/env.log" 2>&1
rc=0
if [ "${TESTS:-}" != none ]; then
  python3 -m pytest -o addopts="" -m gpu -v -p no:cacheprovider tests/test_one_gpu.py ${TESTS:+-k "$TESTS"} > "$out/tests.log" 2>&1
  rc=$?
  echo "tests rc=$rc" >> "$out/tests.log"
fi
cpu_tests=${CPU_TESTS:-answer or torch_function or overlapping}
if [ "$cpu_tests" != none ]; then
  python3 -m pytest -o addopts="" -q -p no:cacheprovider tests/test_ranks_choose_cpu.py tests/test_torch_semantics_cpu.py \
    -k "$cpu_tests" > "$out/cpu_tests.log" 2>&1
  echo "cpu tests rc=$?" >> "$out/cpu_tests.log"
fi
torchrun --nproc_per_node 1 benchmarks/bench_staging.py --quick --only "${SECTIONS:-copy_limits,small,served,pageable}" \
  --out "$out/bench" > "$out/bench.log" 2>&1
bench=$?
echo "bench rc=$bench" >> "$out/bench.log"
if [ "${PROBE:-}" != none ]; then
  torchrun --nproc_per_node 1 benchmarks/probe_small_calls.py --out "$out/probe" > "$out/probe.log" 2>&1
  echo "probe rc=$?" >> "$out/probe.log"
fi
if [ "${COLD:-}" != none ]; then  # the served path's decision where the wrapped call evicts the host's caches
  timeout 150 python3 benchmarks/probe_served_cold_cache.py --thrash 0,1024,8192 --turns 4000 > "$out/cold_cache.log" 2>&1
fi
# The device returns 8 files at most: the benchmark's plot (of bench.json) and the probe's cProfile stay behind.
rm -f "$out/bench/bench.png" "$out/probe/small_profile.txt"
grep -E "passed|failed|rc=" "$out/tests.log" 2>/dev/null | tail -n 2
grep -E "passed|failed|rc=" "$out/cpu_tests.log" 2>/dev/null | tail -n 2
grep -E "^\| (0-dim|1-element|served|pageable)" "$out/bench.log"
grep -E "latency_us|cpu_us" "$out/probe.log" 2>/dev/null
exit $(( rc | bench ))
