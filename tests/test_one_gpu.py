"""GPU tests that one accelerator can run (../shared/reference/one-gpu.md): compiled code and asynchronous calls
staged for real through the accelerator.

* One rank on a NCCL-only group (``init_process_group("nccl")``, one process): a CPU tensor on any collective
  fails in torch there, so every compiled family, called first on a fresh group, is staged through the GPU; its
  result must equal torch's own call on a GPU copy, bit for bit.
* Two ranks sharing the one GPU on a ``cuda:gloo`` group (it serves only CUDA, as NCCL does): an asynchronous
  call never waits for its peers, pinned and pageable, at pipelined sizes; the compiled families Gloo serves on
  CUDA (not point-to-point: Gloo's CUDA send ends the job).

Run: ``python -m pytest -o addopts="" -m gpu tests/test_one_gpu.py`` (skipped without an accelerator).
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

import offload_shim
from bitwise import same_bits
from conftest import accelerator_rank_pool
from observe import configured
from ranks import RankPool
from test_torch_semantics_cpu import COMPILED, opposite_orders

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.accelerator.is_available(), reason="needs an accelerator"),
]
POINT_TO_POINT = {"send_recv", "batch_isend_irecv"}
# What Dynamo turns into functional collectives (its graph), which Gloo runs on CUDA tensors for all_reduce only:
# its functional all_gather of a CUDA tensor crashed the ranks (one-gpu.md). On two ranks of cuda:gloo, the
# families Dynamo graph-breaks on (run eagerly, through the c10d wrappers) and all_reduce.
GLOO_CUDA_FUNCTIONAL = {"all_gather_into_tensor", "all_gather", "reduce_scatter_tensor", "all_to_all_single"}


@pytest.fixture(scope="module")
def nccl_rank():
    """One rank of a group whose only backend is the accelerator's (NCCL on CUDA)."""
    pool = accelerator_rank_pool(1)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def shared_gpu_ranks():
    """Two ranks on the same accelerator, of a ``cuda:gloo`` group (serves the accelerator only)."""
    pool = RankPool(world_size=2, backend=f"{torch.accelerator.current_accelerator().type}:gloo", timeout=300)
    yield pool
    pool.close()


def _accelerator():
    return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())


def _fresh_group():
    backend = dist.get_backend()
    return dist.new_group(list(range(dist.get_world_size())), backend=backend, timeout=datetime.timedelta(seconds=60))


def check_compiled_first_on_fresh_groups(backend, skip):
    """Each family compiled and called first on a fresh group, with CPU tensors: staged through the accelerator
    (counted), equal to torch's uncompiled call on accelerator copies."""
    offload_shim.install()
    device = _accelerator()
    dist.all_reduce(torch.ones(1, device=device))  # the default group used eagerly: the fresh groups are not
    staged = {}
    for name, function in COMPILED.items():
        if name in skip:
            continue
        base = torch.arange(4.0 * dist.get_world_size()) + 10 * dist.get_rank() + len(name)
        expected = function(base.to(device), _fresh_group()).cpu()  # torch's own call on the accelerator
        torch._dynamo.reset()
        offload_shim.reset_staging_counters()
        result = torch.compile(function, backend=backend)(base.clone(), _fresh_group())
        torch.accelerator.synchronize()
        staged[name] = sum(count.calls for count in offload_shim.staging_counters().values())
        assert result.device.type == "cpu" and same_bits(result, expected), (name, result, expected)
    torch._dynamo.reset()
    return staged


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_first_on_fresh_groups_one_rank(nccl_rank, backend):
    (staged,) = nccl_rank.run(check_compiled_first_on_fresh_groups, backend, POINT_TO_POINT)
    assert staged and all(staged.values()), staged


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_first_on_fresh_groups_two_ranks_one_gpu(shared_gpu_ranks, backend):
    for staged in shared_gpu_ranks.run(check_compiled_first_on_fresh_groups, backend, POINT_TO_POINT | GLOO_CUDA_FUNCTIONAL):
        assert staged and all(staged.values()), staged


def check_async_call_never_waits_for_peers(numel, pinned):
    """Rank 0 posts an async all_reduce on group A, then a sync one on group B; rank 1 does B, then A: both
    complete, as in torch, and equal torch's calls on accelerator copies."""
    device = _accelerator()
    a, b = _fresh_group(), _fresh_group()
    x = torch.arange(numel, dtype=torch.float32) + dist.get_rank()
    y = torch.arange(numel, dtype=torch.float32) * 2 + dist.get_rank()
    expected = []
    for tensor, group in ((x, a), (y, b)):
        on_device = tensor.to(device)
        dist.all_reduce(on_device, group=group)
        expected.append(on_device.cpu())
    if pinned:
        x, y = x.pin_memory(), y.pin_memory()
    offload_shim.install()
    offload_shim.reset_staging_counters()
    with configured(chunk_bytes=1 << 16):  # the synchronous call is pipelined: numel * 4 bytes is several chunks
        opposite_orders(x, y, a, b)
    modes = sorted(key.mode for key in offload_shim.staging_counters())
    assert modes == ["pipelined", "whole"], modes
    assert same_bits(x, expected[0]) and same_bits(y, expected[1])


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_async_call_never_waits_for_peers_one_gpu(shared_gpu_ranks, pinned):
    shared_gpu_ranks.run(check_async_call_never_waits_for_peers, 1 << 20, pinned)
