"""GPU tests of the collectives beyond all_reduce and broadcast: mixed devices in one call, a pipelined reduce,
compiled code reaching a collective on CPU tensors, and the accelerator memory a large gather takes. Two ranks,
one GPU each, a NCCL-only group. Skipped where two accelerators are absent.

Run: ``python -m pytest -o addopts="" -m gpu tests/test_gpu_collectives.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import offload_shim
from bitwise import same_bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.accelerator.device_count() < 2, reason="needs two accelerators"),
]




def accelerator():
    return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())


def mixed_devices():
    """Inputs and outputs of one call on different devices: only the host side is staged; results land in the
    caller's own tensor objects on their own devices."""
    offload_shim.install()
    rank, gpu = dist.get_rank(), accelerator()
    # all_gather_into_tensor: CPU input, GPU output; then GPU input, CPU output
    out = torch.empty(4, dtype=torch.int64, device=gpu)
    dist.all_gather_into_tensor(out, torch.tensor([rank, 10 + rank]))
    assert out.device == gpu and out.tolist() == [0, 10, 1, 11]
    out = torch.empty(4, dtype=torch.int64)
    identity = id(out)
    dist.all_gather_into_tensor(out, torch.tensor([rank, 10 + rank], device=gpu))
    assert id(out) == identity and out.tolist() == [0, 10, 1, 11]
    # gather: GPU input into a CPU gather_list; list entries on different devices
    gathered = [torch.zeros(3), torch.zeros(3, device=gpu)] if rank == 0 else None
    dist.gather(torch.full((3,), float(rank + 1), device=gpu), gathered, 0)
    if rank == 0:
        assert gathered[0].device.type == "cpu" and gathered[1].device == gpu
        assert gathered[0].tolist() == [1.0] * 3 and gathered[1].tolist() == [2.0] * 3
    # all_to_all with a mixed output list, uneven sizes per rank
    outputs = [torch.zeros(1 + rank), torch.zeros(1 + rank, device=gpu)]
    inputs = [torch.full((1 + r,), 10.0 * rank + r) for r in range(2)]
    dist.all_to_all(outputs, inputs)
    assert outputs[0].device.type == "cpu" and outputs[1].device == gpu
    assert outputs[0].tolist() == [float(rank)] * (1 + rank)
    assert outputs[1].tolist() == [10.0 + rank] * (1 + rank)
    # point-to-point: a GPU sender, a CPU receiver, both ways
    if rank == 0:
        dist.send(torch.arange(5.0, device=gpu), 1)
        got = torch.zeros(5)
        dist.recv(got, 1)
        assert got.tolist() == [2.0 * i for i in range(5)]
    else:
        got = torch.zeros(5)
        dist.recv(got, 0)
        assert got.tolist() == [float(i) for i in range(5)]
        dist.send(got.to(gpu) * 2, 0)


def pipelined_reduce(pinned: bool, asynchronous: bool):
    """A reduce of several chunks plus a short one: equal to the GPU-resident reduce bit for bit on the root; the
    other rank's tensor ends as NCCL leaves it (unchanged)."""
    offload_shim.install()
    rank = dist.get_rank()
    n = 6 * offload_shim.settings().chunk_bytes // 4 + 5
    host = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    expected = host.to(accelerator())
    dist.reduce(expected, dst=1)
    tensor = host.pin_memory() if pinned else host.clone()
    work = dist.reduce(tensor, dst=1, async_op=asynchronous)
    if asynchronous:
        work.wait()
    assert same_bits(tensor, expected.cpu())
    assert rank == 1 or same_bits(tensor, host)


def compiled_collectives(backend: str):
    """Compiled code reaching collectives on CPU tensors over a NCCL-only group: staged through the CPU kernels of
    the _c10d_functional ops, equal to the eager staged call."""
    import torch.distributed._functional_collectives as funcol

    offload_shim.install()
    torch._dynamo.reset()
    rank = dist.get_rank()

    def step(x):
        dist.all_reduce(x)
        return funcol.all_gather_tensor(x * 2, 0, dist.group.WORLD) + 1

    x = torch.arange(6.0).reshape(2, 3) + rank
    want_x = x.clone()
    want = step(want_x)  # eager, staged by the wrappers
    got_x = torch.arange(6.0).reshape(2, 3) + rank
    got = torch.compile(step, backend=backend, fullgraph=True)(got_x)
    assert got.device.type == "cpu" and same_bits(got, want) and same_bits(got_x, want_x)


def large_gather_memory(shard_mib: int):
    """Peak extra accelerator memory of a staged gather of CPU shards: the call's host bytes on each rank (the
    root's whole gather_list), since gathers are staged whole, not chunked."""
    offload_shim.install()
    rank, gpu = dist.get_rank(), accelerator()
    numel = shard_mib << 18
    shard = torch.full((numel,), float(rank))
    gathered = [torch.empty(numel) for _ in range(2)] if rank == 0 else None
    torch.accelerator.synchronize()
    torch.cuda.reset_peak_memory_stats(gpu)
    base = torch.cuda.memory_allocated(gpu)
    dist.gather(shard, gathered, 0)
    torch.accelerator.synchronize()
    peak = (torch.cuda.max_memory_allocated(gpu) - base) / (numel * 4)
    if rank == 0:
        assert all(torch.equal(g, torch.full((numel,), float(r))) for r, g in enumerate(gathered))
    return peak


def offloaded_dtensor_redistribute():
    """An FSDP2 CPU-offloaded parameter (a DTensor with a pinned CPU local tensor on a GPU mesh) redistributed from
    Shard(0) to Shard(1): DTensor calls torch.ops._dtensor.shard_dim_alltoall, staged by its CPU kernel."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from torch.distributed.tensor import Shard

    offload_shim.install()
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4, bias=False)
    full = model.weight.detach().clone()
    mesh = init_device_mesh(accelerator().type, (2,))
    fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
    weight = model.weight
    assert weight.to_local().device.type == "cpu"
    moved = weight.redistribute(placements=[Shard(1)])
    local = moved.to_local()
    rank = dist.get_rank()
    assert local.device.type == "cpu" and same_bits(local, full[:, rank * 3 : (rank + 1) * 3].contiguous())


def test_offloaded_dtensor_shard_to_shard(accelerator_ranks):
    accelerator_ranks.run(offloaded_dtensor_redistribute)


def coalescing_manager_refused():
    """Inside torch's _coalescing_manager a collective is only recorded, to run at the block's end: a CPU tensor
    on a NCCL-only group is refused with StagingError, nothing written; the same block on GPU tensors runs."""
    from torch.distributed.distributed_c10d import _coalescing_manager

    offload_shim.install()
    rank = dist.get_rank()
    tensor = torch.full((2,), rank + 1.0)
    try:
        with pytest.raises(offload_shim.StagingError, match="inside torch.distributed's _coalescing_manager"):
            with _coalescing_manager():
                dist.all_reduce(tensor)
    finally:  # an exception inside the block leaves torch's coalescing state behind
        dist.distributed_c10d._world.pg_coalesce_state.pop(dist.group.WORLD, None)
    assert tensor.tolist() == [rank + 1.0] * 2
    on_gpu = tensor.to(accelerator())
    with _coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(on_gpu)
    cm.wait()
    assert on_gpu.tolist() == [3.0, 3.0]


def test_coalescing_manager_refused(accelerator_ranks):
    accelerator_ranks.run(coalescing_manager_refused)


def test_mixed_devices(accelerator_ranks):
    accelerator_ranks.run(mixed_devices)


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_pipelined_reduce(accelerator_ranks, pinned, asynchronous):
    accelerator_ranks.run(pipelined_reduce, pinned, asynchronous)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_collectives_on_cpu_tensors(accelerator_ranks, backend):
    accelerator_ranks.run(compiled_collectives, backend)


def test_large_gather_memory(accelerator_ranks):
    peaks = accelerator_ranks.run(large_gather_memory, 256)
    print(f"\npeak extra accelerator memory of a staged gather of 256 MiB shards, in shards: root {peaks[0]:.2f}, "
          f"other {peaks[1]:.2f}")
    assert peaks[0] <= 3.01 and peaks[1] <= 1.01  # whole: the input and the root's list; nothing more
