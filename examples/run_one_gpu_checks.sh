#!/usr/bin/env bash
# What one accelerator can show (../shared/reference/one-gpu.md), in one command:
#   bash examples/run_one_gpu_checks.sh [OUTDIR]
# 1. installs offload_shim (editable, so its torch.backends entry point is live) and records the versions;
# 2. runs the one-GPU tests (tests/test_one_gpu.py: compiled code on a one-rank NCCL group, and compiled code and
#    asynchronous calls on two ranks sharing the GPU through cuda:gloo);
# 3. runs the CPU tests of torch's semantics, activation, the contracts and the wire on this machine's torch
#    (8 workers; -rfE names each failure).
# Logs go to OUTDIR (default: $OUT, else ./gpu-results).
set -u -o pipefail
out=${1:-${OUT:-gpu-results}}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
{
  date -u
  git rev-parse --short HEAD 2>/dev/null
  python3 -m pip install --no-build-isolation --no-deps -e . 2>&1 | tail -n 2
  python3 -c 'import torch, wrapt; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", ".".join(map(str, torch.cuda.nccl.version())), "wrapt", wrapt.__version__); print([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])'
  python3 -c 'import importlib.metadata as m; print("torch.backends entry points:", [e.value for e in m.entry_points(group="torch.backends")])'
} > "$out/env.log" 2>&1
python3 -m pytest -o addopts="" -m gpu -v -p no:cacheprovider tests/test_one_gpu.py 2>&1 | tee "$out/one_gpu_tests.log"
rc=$?
python3 -m pytest -o addopts="-n 8" -q -rfE -p no:cacheprovider ${CPU_TESTS:-tests/test_torch_semantics_cpu.py tests/test_host_staging_cpu.py tests/test_activation.py tests/test_contracts_cpu.py tests/test_wire_cpu.py tests/test_ranks_choose_cpu.py} > "$out/cpu_tests.log" 2>&1
exit $(( rc | $? ))
