"""The equality contract (tests/contracts.py), property-based, on 2 and 3 Gloo ranks with the staging path forced
through the CPU: real copies, a real Gloo collective on the staged tensors, the real copy back, compared bit for
bit with the same calls left to Gloo. The number of generated cases is printed at the end of the run."""

from __future__ import annotations

import hypothesis
import pytest

import contracts
from ranks import RankPool

EXAMPLES = {2: 1700, 3: 300}  # per test (a 3-rank case costs about twice a 2-rank one); the run reports the total


@pytest.fixture(scope="module")
def three_gloo_ranks():
    pool = RankPool(world_size=3, backend="gloo")
    yield pool
    pool.close()


def _run(pool, case, record_property):
    case_calls, order = case
    counts = pool.run(contracts.check_case, case_calls, list(order), "cpu")[0]
    record_property("contract_case", (pool.world_size, [c.op for c in case_calls], counts["refused"]))


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
