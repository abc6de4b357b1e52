"""GPU tests: cases 01, 08, 10 and 12, async work handles and the chunked full_tensor, on two ranks with one
accelerator each and a process group whose only backend is the accelerator's (NCCL on CUDA). Skipped where two
accelerators are absent.

Run: ``python -m pytest -m gpu tests/test_gpu.py`` (``examples/run_gpu_checks.sh`` runs them with the example)."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import torch.distributed as dist

import offload_shim
from offload_shim import _execute, _groups
from bitwise import same_bits
from observe import configured, counting_calls

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.accelerator.device_count() < 2, reason="needs two accelerators"),
]




# ---------------------------------------------------------------- helpers run inside the ranks


@contextlib.contextmanager
def shim():
    offload_shim.install()
    try:
        yield
    finally:
        offload_shim.uninstall()


def fails_without_shim(call):
    offload_shim.uninstall()
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        call()


def accelerator():
    return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())


def case12_norm_scalar():
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    subgroup = dist.new_group(ranks=[0, 1], backend=dist.get_backend())
    mesh_group = init_device_mesh(accelerator().type, (1, 2), mesh_dim_names=("replicate", "shard")).get_group("shard")
    values = [3.5, 0.0]  # rank 1's bucket is empty: a fresh torch.tensor(0.0)
    fails_without_shim(lambda: dist.all_reduce(torch.tensor(values[rank])))
    results = {}
    with shim():
        for group_name, group in (("world", None), ("subgroup", subgroup), ("mesh_dim", mesh_group)):
            for op, expected in ((dist.ReduceOp.SUM, 3.5), (dist.ReduceOp.MAX, 3.5)):
                local = torch.tensor(values[rank]) if rank == 0 else torch.tensor(0.0)
                identity = id(local)
                returned = dist.all_reduce(local, op=op, group=group)
                assert returned is None and id(local) == identity
                assert local.dtype == torch.float32 and local.shape == () and local.device.type == "cpu"
                assert local.item() == expected, (group_name, op, local)
                results[(group_name, str(op))] = local.item()
        # a p-th power of a norm: the values differ per rank, the sum is exact in fp32 here
        local = torch.tensor([2.0, 0.25][rank]) ** 2
        dist.all_reduce(local)
        assert local.item() == 4.0625
    return results


def async_handles():
    rank = dist.get_rank()
    with shim():
        tensors = [torch.full((n,), float(rank + 1)).pin_memory() for n in (1 << 20, 7, 1 << 22)]
        tensors.append(torch.full((12345,), float(rank + 1)))  # pageable
        works = [dist.all_reduce(t, async_op=True) for t in tensors]
        assert all(isinstance(w, dist.Work) for w in works)
        for w in reversed(works):  # waited late and out of order
            w.wait()
        for t in tensors:
            assert torch.equal(t, torch.full_like(t, 3.0))
        # the future completes after the copy back
        t = torch.full((1 << 20,), float(rank + 1)).pin_memory()
        value = dist.all_reduce(t, async_op=True).get_future().wait()
        assert value[0] is t and torch.equal(t, torch.full_like(t, 3.0))
        # is_completed() polled to True means the caller's tensor holds the result
        t = torch.full((1 << 20,), float(rank + 1))
        work = dist.broadcast(t, src=1, async_op=True)
        while not work.is_completed():
            time.sleep(0.001)
        assert torch.equal(t, torch.full_like(t, 2.0))
        # the caller's buffer is poisoned after the copy back started being possible: nothing writes it later
        t = torch.full((1 << 20,), float(rank + 1)).pin_memory()
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        t.fill_(-1.0)
        torch.accelerator.synchronize()
        assert torch.equal(t, torch.full_like(t, -1.0))


def pipelined_all_reduce(pinned: bool, asynchronous: bool):
    """An all_reduce of several chunks plus a short one (reads and writes on every rank, so each slot's H2D must
    wait for its previous D2H), with the pooled buffers poisoned between calls; equal to the GPU-resident
    all_reduce bit for bit (with two ranks each element is one addition, whatever the chunking)."""
    from offload_shim import _staging

    rank = dist.get_rank()
    chunk = offload_shim.settings().chunk_bytes
    n = 6 * chunk // 4 + 5
    host = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    expected = host.to(accelerator())
    dist.all_reduce(expected)
    expected = expected.cpu()
    with shim():
        for _ in range(2):
            t = host.pin_memory() if pinned else host.clone()
            work = dist.all_reduce(t, async_op=asynchronous)
            if asynchronous:
                work.wait()
            assert same_bits(t, expected)
            for buffer in _groups.pooled_buffers():
                buffer.fill_(0xFF)


def case10_broadcast(pinned: bool, dtype_name: str, asynchronous: bool):
    rank = dist.get_rank()
    dtype = getattr(torch, dtype_name)
    integer = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[dtype]
    n = (1 << 30) // dtype.itemsize  # 1 GiB
    # Every bit pattern, NaNs included: a broadcast copies bytes.
    pattern = torch.arange(n, dtype=integer)
    buffer = (pattern + rank).view(dtype)
    if pinned:
        buffer = buffer.pin_memory()
    expected = pattern.view(dtype)
    fails = []
    with shim():
        dist.barrier()
        start = time.perf_counter()
        work = dist.broadcast(buffer, src=0, async_op=asynchronous)
        if asynchronous:
            work.wait()
        seconds = time.perf_counter() - start
    assert same_bits(buffer, expected), fails
    return seconds


def offloaded_weight(mesh, rows: int, dtype: torch.dtype, seed: int):
    """The weight of a ``Linear(4096, rows)`` sharded by FSDP2 over ``mesh`` with ``CPUOffloadPolicy`` (a DTensor
    whose local tensor is pinned host memory), and the full weight it was made from."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Linear(4096, rows, bias=False).to(dtype)
    full = model.weight.detach().clone()
    fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
    weight = model.weight
    assert weight.to_local().device.type == "cpu" and weight.to_local().is_pinned()
    return weight, full


def case08_full_tensor():
    from torch.distributed.device_mesh import DeviceMesh

    device = accelerator()
    gloo_and_accelerator = dist.new_group(backend=f"cpu:gloo,{device.type}:{dist.get_backend()}")
    timings = {}
    for group_name, group in (("accelerator-only", dist.group.WORLD), ("cpu:gloo+accelerator", gloo_and_accelerator)):
        # Distinct dim names: DeviceMesh equality ignores process groups, and DTensor's sharding-propagation
        # cache would otherwise hand one mesh's specs (and so its group) to the other's tensors.
        mesh = DeviceMesh.from_group(group, device.type, mesh_dim_names=(group_name,))
        for dtype in (torch.float32, torch.bfloat16):
            weight, full = offloaded_weight(mesh, 8192, dtype, seed=8)
            if group_name == "accelerator-only" and dtype == torch.float32:
                fails_without_shim(weight.full_tensor)
            with shim():
                start = time.perf_counter()
                got = weight.full_tensor()
                timings[(group_name, str(dtype))] = time.perf_counter() - start
                with torch.no_grad():
                    got_no_grad = weight.full_tensor()
            assert got.device.type == "cpu" and same_bits(got.detach(), full), (group_name, dtype)
            assert same_bits(got_no_grad, full)
    return timings


def full_tensor_chunked(chunk_mib: int):
    """full_tensor of an FSDP2-offloaded weight with uneven rows (8191 over 2 ranks: 4096 and 4095, which torch pads
    to 4096 for its gather), gathered in chunks of ``chunk_mib`` (the gather plan of _plan and _execute, reached
    through torch's own redistribution): bitwise equal to the weight, the shard left alone, one gather a step,
    and at most 4 chunks of accelerator memory during the call, the pool's slots made inside it (staged whole, it
    took the shard and the full tensor: 24 chunks of 8 MiB in fp32)."""
    from torch.distributed.device_mesh import DeviceMesh

    device, rank = accelerator(), dist.get_rank()
    mesh = DeviceMesh.from_group(dist.group.WORLD, device.type, mesh_dim_names=("chunked_full_tensor",))
    chunk = chunk_mib << 20
    peaks = {}
    for dtype in (torch.float32, torch.bfloat16):
        weight, full = offloaded_weight(mesh, 8191, dtype, seed=9)
        local = weight.to_local()
        assert local.shape == ((4096, 4095)[rank], 4096)
        before = local.detach().clone()
        # Bytes of each rank's padded shard a step: the chunk over both ranks; steps: the shard's bytes over those.
        steps = -(-4096 * 4096 * dtype.itemsize // (chunk // 2))
        dist.barrier()
        with shim(), configured(chunk_bytes=chunk), counting_calls(dist.ProcessGroup, _execute.GATHER_METHOD) as gathers:
            offload_shim.release_buffers()  # the call makes its pool: its slots count
            torch.accelerator.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            got = weight.full_tensor()
            peak = torch.cuda.max_memory_allocated(device) - base
        assert len(gathers) == steps, (dtype, len(gathers), steps)
        assert got.device.type == "cpu" and got.is_pinned() and got.is_contiguous()
        assert same_bits(got.detach(), full), dtype
        assert same_bits(local.detach(), before), dtype
        assert peak <= 4 * chunk, (dtype, peak / chunk)
        peaks[str(dtype)] = peak / chunk
    return peaks


def _train(mesh, offload: bool, steps: int, norm_type: float, seed: int = 1):
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    device = accelerator()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)
    )
    policy = {"offload_policy": CPUOffloadPolicy()} if offload else {}
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(100 + dist.get_rank())
    norms = []
    for _ in range(steps):
        x = torch.randn(32, 64, generator=data).to(device)
        y = torch.randn(32, 8, generator=data).to(device)
        torch.nn.functional.mse_loss(model(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=norm_type, error_if_nonfinite=True)
        optimizer.step()
        optimizer.zero_grad()
        norms.append(norm.full_tensor().cpu())
    params = [p.full_tensor().cpu() for p in model.parameters()]
    return torch.stack(norms), params


def case01_clip_grad_norm(norm_type: float):
    from torch.distributed.device_mesh import DeviceMesh

    device = accelerator()
    # Distinct dim names: DeviceMesh equality ignores process groups (see case08_full_tensor).
    accelerator_only = DeviceMesh.from_group(dist.group.WORLD, device.type, mesh_dim_names=("accelerator_only",))
    with_gloo = DeviceMesh.from_group(
        dist.new_group(backend=f"cpu:gloo,{device.type}:{dist.get_backend()}"), device.type, mesh_dim_names=("with_gloo",)
    )
    fails_without_shim(lambda: _train(accelerator_only, offload=True, steps=1, norm_type=norm_type))
    with shim():
        norms, params = _train(accelerator_only, offload=True, steps=20, norm_type=norm_type)
    # Reference 1: same offloaded run, CPU tensors over Gloo; only the transport differs.
    gloo_norms, gloo_params = _train(with_gloo, offload=True, steps=20, norm_type=norm_type)
    assert same_bits(norms, gloo_norms)
    assert all(same_bits(a, b) for a, b in zip(params, gloo_params))
    # Reference 2: no offload. Norms and optimizer steps run on the GPU instead of the CPU (other kernels,
    # other summation orders), so equality is to rounding, not to the bit.
    gpu_norms, gpu_params = _train(accelerator_only, offload=False, steps=20, norm_type=norm_type)
    norm_diff = (norms.double() - gpu_norms.double()).abs().max().item()
    param_diff = max((a.double() - b.double()).abs().max().item() for a, b in zip(params, gpu_params))
    assert torch.allclose(norms, gpu_norms, rtol=1e-5, atol=0), norm_diff
    assert param_diff < 1e-4, param_diff
    return {"norm_max_abs_diff_vs_no_offload": norm_diff, "param_max_abs_diff_vs_no_offload": param_diff}


# ---------------------------------------------------------------- the tests


def test_case12_norm_scalar_all_reduce(accelerator_ranks):
    accelerator_ranks.run(case12_norm_scalar)


def test_async_work_handles(accelerator_ranks):
    accelerator_ranks.run(async_handles)


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_pipelined_all_reduce(accelerator_ranks, pinned, asynchronous):
    accelerator_ranks.run(pipelined_all_reduce, pinned, asynchronous)


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_case10_broadcast_cpu_state_dict(accelerator_ranks, pinned, dtype_name, asynchronous):
    seconds = accelerator_ranks.run(case10_broadcast, pinned, dtype_name, asynchronous)
    print(f"broadcast 1 GiB {dtype_name} {'pinned' if pinned else 'pageable'}: {max(seconds) * 1e3:.1f} ms")


def test_case08_full_tensor_offloaded_param(accelerator_ranks):
    timings = accelerator_ranks.run(case08_full_tensor)
    print("full_tensor seconds (rank 0):", timings[0])


def test_full_tensor_chunked_offloaded_weight(accelerator_ranks):
    peaks = accelerator_ranks.run(full_tensor_chunked, 8)
    print(f"\npeak extra accelerator memory of a chunked full_tensor, in chunks of 8 MiB: {peaks}")


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_case01_fsdp2_offload_clip_grad_norm(accelerator_ranks, norm_type):
    diffs = accelerator_ranks.run(case01_clip_grad_norm, norm_type)
    print(f"norm_type {norm_type}: {diffs[0]}")
