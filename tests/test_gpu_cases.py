"""The failing cases from the field (tests/cases/*.py, copied from shared/cases/gpu), each run as its README says:
``OFFLOAD_SHIM=1 torchrun --nproc_per_node 2 FILE`` on two GPUs and a NCCL-only group; each must print OK on both
ranks. Skipped where two accelerators are absent."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.accelerator.device_count() < 2, reason="needs two accelerators"),
]

CASES = sorted((pathlib.Path(__file__).parent / "cases").glob("*.py"))


@pytest.mark.parametrize("case", CASES, ids=[c.stem for c in CASES])
def test_case(case, tmp_path):
    env = {**os.environ, "OFFLOAD_SHIM": "1", "PYTHONUNBUFFERED": "1"}
    # Each rank's output in a file of its own (--redirects 3): two ranks printing at once interleave on one pipe.
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--log-dir", str(tmp_path),
               "--redirects", "3", str(case)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    outputs = {rank: "".join(p.read_text() for p in tmp_path.glob(f"**/{rank}/stdout.log")) for rank in (0, 1)}
    print(f"\n=== {case.name}: exit {result.returncode}")
    for rank, output in outputs.items():
        print(f"rank {rank}: {output.strip()}")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    for rank, output in outputs.items():
        assert any(line.startswith(f"{rank} OK") for line in output.splitlines()), (rank, output)
