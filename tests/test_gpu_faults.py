"""The fault contracts of tests/test_faults_cpu.py where they touch accelerator memory, on two ranks with one GPU
each and a NCCL-only group: references are the same calls on GPU copies (what a user would write by hand), host
tensors pinned and pageable. Skipped where two accelerators are absent.

Run: ``python -m pytest -o addopts="" -m gpu -s tests/test_gpu_faults.py``."""

from __future__ import annotations

import gc


import pytest
import torch
import torch.distributed as dist

import offload_shim
from bitwise import same_bits
from observe import configured, rss_bytes
from offload_shim import StagingError, _groups

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.accelerator.device_count() < 2, reason="needs two accelerators"),
]

CHUNK = 1 << 20  # a 5 MiB tensor is 5 chunks


def _device():
    return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())


def _host(numel, seed, pinned, inference=False):
    generator = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    values = torch.randn(numel, generator=generator)
    if inference:
        with torch.inference_mode():
            return values.pin_memory() if pinned else values.clone()
    return values.pin_memory() if pinned else values


def _on_device(host, *calls):
    """``host``'s values after ``calls`` made on a GPU copy (the reference), back on the CPU."""
    copy = host.to(_device())
    for call in calls:
        call(copy)
    return copy.cpu()


def check_async_and_inference(pinned):
    """Whole and pipelined, pinned and pageable, inference tensors included: an async call leaves the tensor as it
    was until wait(); two outstanding calls on one tensor give what two calls on one GPU stream give."""
    offload_shim.install()
    report = []
    with configured(chunk_bytes=CHUNK):
        for numel in (1000, 5 * CHUNK // 4):
            for inference in (False, True):
                tensor = _host(numel, 1, pinned, inference)
                original = tensor.clone()
                expected = _on_device(tensor, dist.all_reduce)
                work = dist.all_reduce(tensor, async_op=True)
                assert same_bits(tensor, original), (numel, inference, "written before wait()")
                work.wait()
                assert same_bits(tensor, expected), (numel, inference)
                assert tensor.is_inference() == inference
                both = _on_device(original, dist.all_reduce, lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX))
                tensor = _host(numel, 1, pinned, inference)  # the original values again
                works = [dist.all_reduce(tensor, async_op=True), dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True)]
                works[1].wait()
                works[0].wait()
                assert same_bits(tensor, both), (numel, inference, "two outstanding calls")
                report.append((numel, inference))
    return report


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_async_and_inference(accelerator_ranks, pinned):
    accelerator_ranks.run(check_async_and_inference, pinned)


def check_refused_calls_write_nothing(pinned, asynchronous):
    """A call NCCL refuses (BXOR of floats) and a sparse tensor: refused before anything is written, pipelined or
    whole, sync or async."""
    offload_shim.install()
    with configured(chunk_bytes=CHUNK):
        for numel in (1000, 5 * CHUNK // 4):
            tensor = _host(numel, 2, pinned)
            original = tensor.clone()
            with pytest.raises(Exception) as by_torch:
                dist.all_reduce(tensor.to(_device()), op=dist.ReduceOp.BXOR)
            with pytest.raises(type(by_torch.value)):
                work = dist.all_reduce(tensor, op=dist.ReduceOp.BXOR, async_op=asynchronous)
                if asynchronous:
                    work.wait()
            assert same_bits(tensor, original), numel
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(StagingError, match="sparse_coo"):
        dist.all_reduce(sparse)
    assert same_bits(sparse.to_dense(), torch.eye(3))


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_refused_calls_write_nothing(accelerator_ranks, pinned, asynchronous):
    accelerator_ranks.run(check_refused_calls_write_nothing, pinned, asynchronous)


def check_ranks_disagree():
    offload_shim.install()
    tensor = _host(5 * CHUNK // 4 if dist.get_rank() == 0 else 3 * CHUNK // 4, 3, True)
    original = tensor.clone()
    with configured(chunk_bytes=CHUNK), pytest.raises(StagingError, match="disagree.*sizes from"):
        dist.all_reduce(tensor)
    assert same_bits(tensor, original)


def test_ranks_disagree(accelerator_ranks):
    accelerator_ranks.run(check_ranks_disagree)


def check_groups_made_and_destroyed(rounds):
    """A group per iteration, as RL trainers make one per weight sync: used once with a 40 MiB pinned tensor and
    destroyed. Accelerator and host memory stay flat after the first round."""
    offload_shim.install()
    tensor = torch.ones(10 << 20).pin_memory()  # 40 MiB: 3 chunks of the default 16 MiB
    # Earlier tests in this rank process leave garbage and pools of other chunk sizes; counted in the first round's
    # figure and freed in a later one, they would read as memory the groups gave back (-20 MiB, seen once).
    gc.collect()
    offload_shim.release_buffers()

    def once():
        group = dist.new_group(backend=dist.get_backend())
        dist.all_reduce(tensor, group=group)
        torch.accelerator.synchronize()
        dist.destroy_process_group(group)

    once()
    gc.collect()
    device_bytes, rss, buffers = torch.cuda.memory_allocated(), rss_bytes(), len(_groups.pooled_buffers())
    for _ in range(rounds):
        once()
    gc.collect()
    grown_device = torch.cuda.memory_allocated() - device_bytes
    grown_host = rss_bytes() - rss
    assert len(_groups.pooled_buffers()) == buffers
    assert grown_device == 0, grown_device
    return {"rounds": rounds, "pool buffers": buffers, "device bytes grown": grown_device, "host RSS grown": grown_host,
            "device bytes held": device_bytes}


def test_groups_made_and_destroyed(accelerator_ranks):
    rounds = 21
    for report in accelerator_ranks.run(check_groups_made_and_destroyed, rounds):
        print("groups made and destroyed:", report)
        # Unbounded, 21 pools of two 16 MiB chunks would hold 672 MiB; the host side grows with NCCL communicators
        # (not ours), so allow some.
        assert report["host RSS grown"] < 64 << 20, report
