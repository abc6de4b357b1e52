"""The equality contract (tests/contracts.py), property-based, on 2 and 3 Gloo ranks with the staging path forced
through the CPU: real copies, a real Gloo collective on the staged tensors, the real copy back, compared bit for
bit with the same calls left to Gloo. The number of generated cases is printed at the end of the run."""

from __future__ import annotations

import hypothesis
import pytest

import contracts

# Per test (a 3-rank case costs about twice a 2-rank one); the run reports the total, at least 1,500 in every CI
# run (about 45 s of it on two cores); the GPU run draws 2,000 (tests/test_gpu_contracts.py).
EXAMPLES = {2: 1300, 3: 250}


def _run(pool, case, record_property):
    case_calls, order = case
    counts = pool.run(contracts.check_case, case_calls, list(order), "cpu")[0]
    ops = [f"{c.op} (pipelined)" if c.chunk else c.op for c in case_calls]
    record_property("contract_case", (pool.world_size, ops, counts["refused"], counts["bounded"]))


# One pytest test each, many cases: record_property is function-scoped on purpose (it collects every case).
SETTINGS = dict(deadline=None, database=None, suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])


@hypothesis.seed(20261130)
@hypothesis.settings(max_examples=EXAMPLES[2], **SETTINGS)
@hypothesis.given(case=contracts.cases(2))
def test_contract_two_ranks(gloo_ranks, record_property, case):
    _run(gloo_ranks, case, record_property)


@hypothesis.seed(20261130)
@hypothesis.settings(max_examples=EXAMPLES[3], **SETTINGS)
@hypothesis.given(case=contracts.cases(3))
def test_contract_three_ranks(three_gloo_ranks, record_property, case):
    _run(three_gloo_ranks, case, record_property)


def check_pipelined_reduction_bound(op_name, nan):
    """One large pipelined all_reduce against the unchunked call: where the order of the ranks' values can change
    with the chunking, the results stay within the contract's bound (contracts._within_reordering_bound); returns
    how many elements differ bitwise, for the report."""
    import torch
    import torch.distributed as dist

    import offload_shim
    from bitwise import same_bits
    from observe import configured

    call = contracts.Call(op="all_reduce", dtype="float32", shape=(10_000,), layout="contiguous", reduce=op_name,
                          root=0, async_op=False, seed=11, chunk=4096, nan=nan)
    values = contracts._values(call.shape, torch.float32, (call.seed, dist.get_rank(), 0), nan)
    want, got = values.clone(), values.clone()
    op = getattr(dist.ReduceOp, op_name)
    offload_shim.install()
    dist.all_reduce(want, op=op)
    with configured(staging_device="cpu", always_stage=True, chunk_bytes=call.chunk):
        dist.all_reduce(got, op=op)
    assert contracts._within_reordering_bound(call, got, want)
    differ = ~((got == want) | (got.isnan() & want.isnan()))
    if not nan and op_name in ("MIN", "MAX") or dist.get_world_size() == 2 and op_name != "MAX":
        assert same_bits(got, want)  # bitwise where the order cannot change the result
    return int(differ.sum())


@pytest.mark.parametrize("world_size, op_name, nan", [(3, "SUM", False), (3, "PRODUCT", False), (2, "MAX", True), (3, "MIN", True)])
def test_pipelined_reduction_within_bound(three_gloo_ranks, gloo_ranks, world_size, op_name, nan):
    pool = three_gloo_ranks if world_size == 3 else gloo_ranks
    differ = pool.run(check_pipelined_reduction_bound, op_name, nan)
    print(f"{world_size} ranks, {op_name}{' with NaN' if nan else ''}: elements differing bitwise from the unchunked "
          f"call, per rank: {differ} of 10000")
