import pytest

from ranks import RankPool


@pytest.fixture(scope="session")
def gloo_ranks():
    """Two ranks of a Gloo group (serves CPU)."""
    pool = RankPool(world_size=2, backend="gloo")
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def accelerator_only_ranks():
    """Two ranks of a group whose only backend serves ``cuda``, on a machine without CUDA: torch's own
    reproduction of ``No backend type associated with device type cpu`` (case 06)."""
    import torch

    if torch.accelerator.is_available():
        pytest.skip("needs a machine without an accelerator")
    pool = RankPool(world_size=2, backend="cuda:gloo")
    yield pool
    pool.close()
