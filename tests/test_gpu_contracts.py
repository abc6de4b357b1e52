"""The equality contract (tests/contracts.py) on two GPUs: NCCL-only group, CPU tensors staged through each rank's
GPU, compared bit for bit with the same calls on GPU copies (what a user would write by hand); cases may keep some
of a call's tensors on the GPU (mixed devices). Skipped where two accelerators are absent.

Run: ``python -m pytest -o addopts="" -m gpu tests/test_gpu_contracts.py -s`` (the count is printed at the end)."""

from __future__ import annotations

import hypothesis
import pytest
import torch

import contracts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.accelerator.device_count() < 2, reason="needs two accelerators"),
]

EXAMPLES = 2000




@hypothesis.seed(20261130)
@hypothesis.settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
)
@hypothesis.given(case=contracts.cases(2))
def test_contract_on_accelerators(accelerator_ranks, record_property, case):
    case_calls, order = case
    counts = accelerator_ranks.run(contracts.check_case, case_calls, list(order), "accelerator")[0]
    ops = [f"{c.op} (pipelined)" if c.chunk else c.op for c in case_calls]
    record_property("contract_case", (2, ops, counts["refused"], counts["bounded"]))
