"""The staging path run for real on CPU ranks: real copies, a real Gloo collective on the staged tensor, the
real copy back. ``configure(staging_device="cpu", always_stage=True)`` is the testing configuration that
makes a Gloo group's CPU tensors take the path an accelerator-only group's take on a GPU machine.

Each check compares the staged call with the same call made without staging, bit for bit."""

from __future__ import annotations

import contextlib

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import offload_shim
from bitwise import same_bits
from observe import configured, counting_calls, recording_staging
from offload_shim import _devices, _execute, _groups, _staging
from offload_shim._state import state
import versions

# ---------------------------------------------------------------- helpers run inside the ranks


@contextlib.contextmanager
def staging_through_cpu(**settings):
    """Install the shim, stage every CPU tensor through the CPU, and record each staging decision's device."""
    offload_shim.install()
    with configured(staging_device="cpu", always_stage=True, **settings), recording_staging() as devices:
        yield devices


def rank_input(shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    return torch.randint(-100, 100, shape, generator=generator).to(dtype)


OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}


def poison_staging_buffers():
    """Poison the staging buffers a later call would take: the idle pools' (an asynchronous call holds its pool
    until it completes) and the small calls' slots."""
    for buffer in (*_groups.pooled_buffers(busy=False), *_staging.small_slot_buffers()):
        buffer.fill_(0xFF)  # NaN for every float dtype, -1 for signed integers


def check_all_reduce(shape, dtype_name, op_name, seed, offset, chunk_bytes=1 << 20, pageable_path="bounce"):
    dtype = getattr(torch, dtype_name)
    base = rank_input(shape, dtype, seed)
    expected = base.clone()
    dist.all_reduce(expected, op=OPS[op_name])
    # The caller's tensor is a view into a larger buffer, at a storage offset.
    buffer = torch.zeros(base.numel() + offset, dtype=dtype)
    tensor = buffer[offset:].view(shape)
    tensor.copy_(base)
    pointer, strides = tensor.data_ptr(), tensor.stride()
    path, _execute.PAGEABLE_PATH = _execute.PAGEABLE_PATH, pageable_path
    try:
        with staging_through_cpu(chunk_bytes=chunk_bytes) as devices:
            poison_staging_buffers()
            returned = dist.all_reduce(tensor, op=OPS[op_name])
            poison_staging_buffers()
    finally:
        _execute.PAGEABLE_PATH = path
    assert returned is None
    assert devices == ["cpu"], devices
    assert (tensor.data_ptr(), tensor.stride(), tensor.dtype, tensor.shape) == (pointer, strides, dtype, shape)
    assert same_bits(tensor, expected)
    assert torch.equal(buffer[:offset], torch.zeros(offset, dtype=dtype)), "wrote outside the caller's view"


def check_broadcast(src, shape, dtype_name):
    dtype = getattr(torch, dtype_name)
    base = rank_input(shape, dtype, seed=7)
    expected = base.clone()
    dist.broadcast(expected, src=src)
    with staging_through_cpu() as copies:
        synchronous = base.clone()
        assert dist.broadcast(synchronous, src=src) is None
        by_wait = base.clone()
        work = dist.broadcast(by_wait, src=src, async_op=True)
        assert isinstance(work, dist.Work)
        assert work.wait() is True
        by_future = base.clone()
        future = dist.broadcast(by_future, src=src, async_op=True).get_future()
        value = future.wait()
        by_group_src = base.clone()
        dist.broadcast(by_group_src, group=dist.group.WORLD, group_src=src)
    assert len(copies) == 4
    for tensor in (synchronous, by_wait, by_future, by_group_src):
        assert same_bits(tensor, expected)
    assert value[0] is by_future


def check_async_handles_out_of_order():
    first, second = rank_input((1000,), torch.float32, 1), rank_input((33,), torch.float32, 2)
    expected_first, expected_second = first.clone(), second.clone()
    dist.all_reduce(expected_first)
    dist.all_reduce(expected_second, op=dist.ReduceOp.MAX)
    with staging_through_cpu():
        work_first = dist.all_reduce(first, async_op=True)
        work_second = dist.all_reduce(second, op=dist.ReduceOp.MAX, async_op=True)
        work_second.wait()
        assert same_bits(second, expected_second)
        while not work_first.is_completed():
            pass
        assert same_bits(first, expected_first)  # is_completed() True means the copy back is done
        assert work_first.wait() is True  # waiting again changes nothing
        assert work_first.result() == [first]
    assert same_bits(first, expected_first)


def check_served_path_untouched():
    offload_shim.install()
    tensor = torch.arange(4.0)
    pointer = tensor.data_ptr()
    with recording_staging() as devices:
        dist.all_reduce(tensor)
        funcol.all_reduce(tensor, "sum", dist.group.WORLD)
    assert devices == [] and tensor.data_ptr() == pointer
    assert torch.equal(tensor, torch.arange(4.0) * 2)


def check_functional(group_kind):
    from torch.distributed.device_mesh import init_device_mesh

    group = {
        "process_group": dist.group.WORLD,
        "ranks": [0, 1],
        "mesh": init_device_mesh("cpu", (2,)),
        "group_name": dist.group.WORLD.group_name,
    }[group_kind]
    x = rank_input((4, 3), torch.float32, seed=3)
    original = x.clone()
    calls = {
        "all_reduce": lambda t: funcol.all_reduce(t, "sum", group),
        "all_reduce_max": lambda t: funcol.all_reduce(t, "max", group),
        "all_gather_single": lambda t: versions.all_gather_single(t, 0, group),
        "all_gather_single_dim1": lambda t: versions.all_gather_single(t, 1, group),
        "reduce_scatter_single": lambda t: versions.reduce_scatter_single(t, "sum", 0, group),
        "broadcast": lambda t: funcol.broadcast(t, 1, group),
    }
    for name, call in calls.items():
        reference = call(x)  # torch's own, on the Gloo group
        expected = funcol.wait_tensor(reference)
        with staging_through_cpu() as copies:
            got = call(x)
        assert copies == ["cpu"], (name, copies)
        assert type(got) is type(reference) and got.device.type == "cpu", (name, type(got), type(reference))
        assert same_bits(funcol.wait_tensor(got), expected), name
        assert same_bits(x, original), f"{name} changed its input"


def check_functional_autograd():
    weights = torch.arange(1.0, 9.0)
    results = []
    for stage in (False, True):
        x = rank_input((4,), torch.float32, seed=5).requires_grad_()
        with staging_through_cpu() if stage else contextlib.nullcontext():
            y = versions.all_gather_single(x, 0, dist.group.WORLD)
            (y * weights).sum().backward()
        results.append((y.detach(), x.grad))
    (y0, g0), (y1, g1) = results
    assert same_bits(y0, y1) and same_bits(g0, g1)


def check_full_tensor():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(35.0).reshape(7, 5)  # 7 rows over 2 ranks: uneven shards
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    partial = DTensor.from_local(rank_input((3, 2), torch.float32, seed=9), mesh, [Partial()])
    expected_partial = partial.full_tensor()
    with staging_through_cpu() as copies:
        got = sharded.full_tensor()
        got_partial = partial.full_tensor()
        with torch.no_grad():
            got_no_grad = sharded.full_tensor()
    assert copies == ["cpu"] * 3, copies
    assert type(got) is torch.Tensor and same_bits(got, full) and same_bits(got_no_grad, full)
    assert same_bits(got_partial, expected_partial)


def check_clip_grad_norm(norm_type):
    """clip_grad_norm_ on DTensor gradients reduces its Partial norm through funcol.all_reduce (case 01)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    norms, grads = [], []
    for stage in (False, True):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(distribute_tensor(torch.randn(6, 3), mesh, [Shard(0)])) for _ in range(2)]
        for p in params:
            p.grad = distribute_tensor(torch.randn(6, 3) * 3, mesh, [Shard(0)])
        with staging_through_cpu() if stage else contextlib.nullcontext() as copies:
            norm = torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type=norm_type, error_if_nonfinite=True)
            norms.append(norm.full_tensor())
        if stage:
            assert copies, "the norm's reduction was not staged"
        grads.append([p.grad.full_tensor() for p in params])
    assert same_bits(norms[0], norms[1])
    assert all(same_bits(a, b) for a, b in zip(*grads))


# ---------------------------------------------------------------- the tests


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float64", "int64", "uint8"])
@pytest.mark.parametrize("op_name", ["sum", "max"])
def test_all_reduce_staged_equals_unstaged(gloo_ranks, dtype_name, op_name):
    gloo_ranks.run(check_all_reduce, (3, 5), dtype_name, op_name, 1, 3)


def test_all_reduce_zero_dim(gloo_ranks):
    gloo_ranks.run(check_all_reduce, (), "float32", "sum", 2, 1)


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(
    shape=st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple),
    dtype_name=st.sampled_from(["float32", "float16", "bfloat16", "int32", "int8"]),
    op_name=st.sampled_from(sorted(OPS)),
    seed=st.integers(0, 2**16),
    offset=st.integers(0, 5),
    chunk_bytes=st.sampled_from([1, 2, 3, 8, 12, 64, 1 << 20]),
    pageable_path=st.sampled_from(["bounce", "driver"]),
)
def test_all_reduce_property(gloo_ranks, shape, dtype_name, op_name, seed, offset, chunk_bytes, pageable_path):
    """Chunk sizes down to one byte, so tensors span many chunks that are not a multiple of the element
    count, with the staging buffers poisoned before and after each call."""
    gloo_ranks.run(check_all_reduce, shape, dtype_name, op_name, seed, offset, chunk_bytes, pageable_path)


@pytest.mark.parametrize("src", [0, 1])
def test_broadcast_sync_and_async(gloo_ranks, src):
    gloo_ranks.run(check_broadcast, src, (17, 3), "bfloat16")


def test_async_handles_waited_out_of_order(gloo_ranks):
    gloo_ranks.run(check_async_handles_out_of_order)


def test_served_path_makes_no_copy(gloo_ranks):
    gloo_ranks.run(check_served_path_untouched)


@pytest.mark.parametrize("group_kind", ["process_group", "ranks", "mesh", "group_name"])
def test_functional_collectives(gloo_ranks, group_kind):
    gloo_ranks.run(check_functional, group_kind)


def test_functional_autograd(gloo_ranks):
    gloo_ranks.run(check_functional_autograd)


def test_dtensor_full_tensor(gloo_ranks):
    gloo_ranks.run(check_full_tensor)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_on_dtensor(gloo_ranks, norm_type):
    gloo_ranks.run(check_clip_grad_norm, norm_type)


# ---------------------------------------------------------------- the chunked pipeline


@contextlib.contextmanager
def stream_ordered(ordered: bool):
    """Run the async executor's stream-ordered path (NCCL's: every copy queued by the caller) where ``ordered``: on
    the CPU each copy and collective completes where it is queued, so its results are the path's own."""
    original = _execute._stream_ordered
    if ordered:
        _execute._stream_ordered = lambda group, device: True
    try:
        yield
    finally:
        _execute._stream_ordered = original


def check_broadcast_chunked(pageable_path, asynchronous, ordered=False):
    path, _execute.PAGEABLE_PATH = _execute.PAGEABLE_PATH, pageable_path
    try:
        for src in (0, 1):
            base = rank_input((37,), torch.float64, seed=src)
            expected = base.clone()
            dist.broadcast(expected, src=src)
            tensor = base.clone()
            with staging_through_cpu(chunk_bytes=40), stream_ordered(ordered):  # 5 float64 a chunk, 8 chunks
                poison_staging_buffers()
                work = dist.broadcast(tensor, src=src, async_op=asynchronous)
                poison_staging_buffers()
                if asynchronous:
                    work.wait()
            assert same_bits(tensor, expected)
    finally:
        _execute.PAGEABLE_PATH = path


def check_async_chunked_out_of_order(pageable_path, ordered=False):
    """Three async calls share the pool's buffers; they are waited late, in reverse order, with the buffers
    poisoned in between, and a synchronous call made before any wait (one of them complex, reduced as real pairs)."""
    path, _execute.PAGEABLE_PATH = _execute.PAGEABLE_PATH, pageable_path
    try:
        inputs = [rank_input((n,), torch.float32, seed=n) for n in (50, 7)]
        inputs.append(torch.complex(rank_input((33,), torch.float32, seed=3), rank_input((33,), torch.float32, seed=5)))
        expected = [t.clone() for t in inputs]
        for t in expected:
            dist.all_reduce(t)
        with staging_through_cpu(chunk_bytes=16), stream_ordered(ordered):
            works = [dist.all_reduce(t, async_op=True) for t in inputs]
            poison_staging_buffers()
            middle = rank_input((21,), torch.float32, seed=4)
            expected_middle = middle.clone()
            with configured(always_stage=False):
                dist.all_reduce(expected_middle)
            dist.all_reduce(middle)
            assert same_bits(middle, expected_middle)
            poison_staging_buffers()
            for work in reversed(works):
                assert work.wait() is True
                poison_staging_buffers()
        for got, want in zip(inputs, expected):
            assert same_bits(got, want)
    finally:
        _execute.PAGEABLE_PATH = path


def check_reused_tensor_given_new_memory(asynchronous, ordered):
    """A tensor staged call after call is cut into chunks once (its views kept) and cut again when it is given other
    memory (``.data =``, ``set_``, its storage freed and resized back): each call reduces the tensor's memory then,
    the old memory is left as it was, and an asynchronous call's pool is reused once it has completed."""
    tensor = rank_input((37,), torch.float32, seed=1)
    with staging_through_cpu(chunk_bytes=16), stream_ordered(ordered):
        for change in ("none", "data", "set_", "resize"):
            old = tensor.data
            kept = old.clone()
            if change == "data":
                tensor.data = rank_input((37,), torch.float32, seed=2)
            elif change == "set_":
                tensor.set_(rank_input((37,), torch.float32, seed=3).untyped_storage(), 0, (37,))
            elif change == "resize":
                storage = tensor.untyped_storage()
                storage.resize_(0)
                storage.resize_(37 * 4)
                tensor.copy_(rank_input((37,), torch.float32, seed=4))
            expected = tensor.clone()
            with configured(always_stage=False):
                dist.all_reduce(expected)
            poison_staging_buffers()
            pools = len(_groups.pooled_buffers())
            work = dist.all_reduce(tensor, async_op=asynchronous)
            if asynchronous:
                assert work.wait() is True
            assert same_bits(tensor, expected), change
            if change in ("data", "set_"):
                assert same_bits(old, kept), change  # the memory the tensor had is not written
            if change != "none":  # the pool of the first call, reused
                assert len(_groups.pooled_buffers()) == pools, change


def check_async_pools_of_other_sizes_freed():
    """Asynchronous calls of other sizes (3 to 9 chunks) keep one idle pool of one slot per chunk, the last call's,
    not one per size; a call of the same size again reuses it. (Gloo's path: on the CPU every tensor is pageable, and
    the stream-ordered path takes a pool of one slot per chunk for pinned memory only.)"""
    with staging_through_cpu(chunk_bytes=16):
        for numel in (12, 20, 36, 36):  # 4 float32 a chunk
            tensor = rank_input((numel,), torch.float32, seed=numel)
            expected = tensor.clone()
            with configured(always_stage=False):
                dist.all_reduce(expected)
            dist.all_reduce(tensor, async_op=True).wait()
            assert same_bits(tensor, expected)
            idle = [p for (_, sync), pools in state.idle_pools.items() if not sync for p in pools]
            assert [len(p.slots) for p in idle] == [numel // 4], numel


def check_lazy_views_chunked_or_not():
    """A lazily conjugated or negated view is staged by its values, chunked or not, and written back through it:
    reading the view gives the reduction (broadcast) of the values read through the views, as the same call on their
    resolved copies does."""
    for chunk_bytes in (16, 1 << 20):  # chunked (tens of chunks), and one collective
        for make in (lambda t: torch.complex(t, -t).conj(), torch._neg_view):
            base = rank_input((37,), torch.float32, seed=9)
            for call in ("all_reduce", "broadcast"):
                view = make(base.clone())
                expected = view.resolve_conj().resolve_neg().clone()
                with configured(always_stage=False):  # torch's own call, on the resolved copy
                    getattr(dist, call)(expected, **({"src": 1} if call == "broadcast" else {}))
                with staging_through_cpu(chunk_bytes=chunk_bytes):
                    getattr(dist, call)(view, **({"src": 1} if call == "broadcast" else {}))
                assert view.is_conj() or view.is_neg()
                assert same_bits(view.resolve_conj().resolve_neg(), expected), (chunk_bytes, call, view.dtype)


def same_input(shape, dtype, seed):
    """The same tensor on every rank."""
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    return torch.randint(-(2**40), 2**40, shape, generator=generator).to(dtype)


def check_full_tensor_chunked():
    """DTensor.full_tensor of Shard(0) host shards, against torch's own full_tensor of the same DTensor on the Gloo
    group: bits, layout, the shard left alone, gradients, and the number of chunk gathers. full_tensor() is torch's
    redistribution, whose gathers of the shards (padded by torch to one size) reach the shim as functional
    collectives: a gather of an output of at least two chunks is chunked, ``chunk_bytes // W`` bytes of each rank's
    padded shard a step, whatever full_tensor's own arguments; a mesh dimension of one rank runs none. Then ranks
    that disagree."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    chunk = 64  # 32 bytes of each of the two ranks' shards a step
    flat = init_device_mesh("cpu", (2,), mesh_dim_names=("ft_flat",))
    # Distinct dim names: DeviceMesh equality ignores process groups (docs/reference.md).
    square = init_device_mesh("cpu", (1, 2), mesh_dim_names=("ft_replicate", "ft_shard"))
    f32, bf16 = torch.float32, torch.bfloat16
    cases = [  # shape, dtype, mesh, placements, full_tensor's arguments, chunk gathers expected (0: one gather)
        ((64,), f32, flat, [Shard(0)], {}, 4),  # even: shards of 128 B
        ((32,), f32, flat, [Shard(0)], {}, 2),  # exactly 2 chunks
        ((1000,), f32, flat, [Shard(0)], {}, 63),  # many chunks, the last one short
        ((101,), bf16, flat, [Shard(-1)], {}, 4),  # uneven (51 and 50 rows, padded to 51: 102 B); a negative dim
        ((7, 5), f32, flat, [Shard(0)], {}, 3),  # uneven (4 and 3 rows, padded to 4 of 20 B)
        ((1, 40), f32, flat, [Shard(0)], {}, 5),  # N < W: rank 1's empty shard padded to a row of 160 B
        ((3, 40), f32, flat, [Shard(0)], {}, 10),  # uneven, rows larger than the chunk: 2 rows of 160 B
        ((11, 3, 4), bf16, flat, [Shard(0)], {}, 5),  # 3-D, uneven: 6 rows of 24 B
        ((13, 3), torch.int64, flat, [Shard(0)], {}, 6),  # 7 rows of 24 B
        ((50, 3), torch.bool, flat, [Shard(0)], {}, 3),  # 25 rows of 3 B
        ((9, 4), f32, square, [Replicate(), Shard(0)], {}, 3),  # 5 rows of 16 B
        ((9, 4), f32, square, [Shard(0), Replicate()], {}, 0),  # sharded over a mesh dim of one rank: nothing sent
        ((9, 4), f32, square, [Shard(0), Shard(0)], {}, 3),  # one gather over the dim of two ranks
        ((6, 40), f32, flat, [Shard(1)], {}, 15),  # gathered as (6, 20) shards of 480 B, moved to dim 1 by torch
        ((9, 4), f32, flat, [Shard(0)], {"grad_placements": [Replicate()]}, 3),  # the same wire as without
        ((15,), f32, flat, [Shard(0)], {}, 0),  # two shards of 32 B: under 2 chunks, one gather
    ]
    for index, (shape, dtype, mesh, placements, kwargs, steps) in enumerate(cases):
        what = (shape, dtype, placements, kwargs)
        full = same_input(shape, dtype, seed=index)
        sharded = distribute_tensor(full, mesh, placements)
        local = sharded.to_local()
        before, pointer = local.clone(), local.data_ptr()
        expected = sharded.full_tensor(**kwargs)  # torch's own: Gloo serves the CPU
        with staging_through_cpu(chunk_bytes=chunk) as devices, counting_calls(dist.ProcessGroup, _execute.GATHER_METHOD) as gathers:
            poison_staging_buffers()
            got = sharded.full_tensor(**kwargs)
            poison_staging_buffers()
        assert len(gathers) == steps, (what, devices, len(gathers))
        sends = mesh is flat or not isinstance(placements[1], Replicate)  # a placement on the mesh dim of two ranks
        assert bool(devices) == sends, (what, devices)
        assert type(got) is type(expected) and got.device.type == "cpu", what
        assert got.shape == shape and got.dtype == dtype, what
        assert same_bits(got, expected) and same_bits(got, full), what
        assert local.data_ptr() == pointer and same_bits(local, before), what
        if not dtype.is_floating_point:
            continue
        # Gradients: torch's own full_tensor backward against the staged one's.
        weights = same_input(shape, torch.float32, seed=100 + index)
        grads = []
        for stage in (False, True):
            leaf = distribute_tensor(full, mesh, placements).requires_grad_()
            with staging_through_cpu(chunk_bytes=chunk) if stage else contextlib.nullcontext():
                with counting_calls(dist.ProcessGroup, _execute.GATHER_METHOD) as gathers:
                    out = leaf.full_tensor(**kwargs)
                    with torch.no_grad():
                        out_no_grad = leaf.full_tensor(**kwargs)
            assert not stage or len(gathers) == 2 * steps, (what, len(gathers))
            assert out.requires_grad and not out_no_grad.requires_grad and same_bits(out_no_grad, full), what
            (out.float() * weights).sum().backward()
            grads.append(leaf.grad)
        reference, staged = grads
        assert staged.placements == reference.placements and staged.shape == reference.shape, what
        assert same_bits(staged.to_local(), reference.to_local()), what

    rank = dist.get_rank()
    sharded = distribute_tensor(same_input((64,), f32, seed=0), flat, [Shard(0)])
    # Ranks that stage on a group for the first time with different chunk sizes: every rank raises before any gather.
    from torch.distributed.device_mesh import DeviceMesh

    fresh = DeviceMesh.from_group(dist.new_group(), "cpu", mesh_dim_names=("ft_fresh",))
    first = distribute_tensor(same_input((64,), f32, seed=0), fresh, [Shard(0)])
    with staging_through_cpu(chunk_bytes=32 if rank == 0 else 64), counting_calls(dist.ProcessGroup, _execute.GATHER_METHOD) as gathers:
        with pytest.raises(offload_shim.StagingError, match="disagree.*chunk sizes"):
            first.full_tensor()
    assert gathers == []
    # Shards not laid out as torch's Shard(0) (from_local with a shape): torch gathers shards of unequal sizes,
    # which the ranks' agreement before the first chunk refuses on every rank.
    for rows in ([2, 3], [1, 3]):
        mislaid = DTensor.from_local(
            torch.zeros(rows[rank], 40), flat, [Shard(0)], run_check=False, shape=(4, 40), stride=(40, 1)
        )
        with staging_through_cpu(chunk_bytes=chunk), counting_calls(dist.ProcessGroup, _execute.GATHER_METHOD) as gathers:
            with pytest.raises(offload_shim.StagingError, match="disagree.*sizes"):
                mislaid.full_tensor()
        assert gathers == []
    with staging_through_cpu(chunk_bytes=chunk):  # the ranks are still in step
        assert same_bits(sharded.full_tensor(), same_input((64,), f32, seed=0))


@pytest.mark.parametrize("pageable_path", ["bounce", "driver"])
@pytest.mark.parametrize("asynchronous", ["sync", "async", "async_stream_ordered"])
def test_broadcast_chunked(gloo_ranks, pageable_path, asynchronous):
    gloo_ranks.run(check_broadcast_chunked, pageable_path, asynchronous != "sync", asynchronous.endswith("ordered"))


@pytest.mark.parametrize("pageable_path", ["bounce", "driver"])
@pytest.mark.parametrize("ordered", [False, True], ids=["host_completing", "stream_ordered"])
def test_async_chunked_waited_late_and_out_of_order(gloo_ranks, pageable_path, ordered):
    gloo_ranks.run(check_async_chunked_out_of_order, pageable_path, ordered)


@pytest.mark.parametrize("mode", ["sync", "async", "async_stream_ordered"])
def test_reused_tensor_given_new_memory(gloo_ranks, mode):
    gloo_ranks.run(check_reused_tensor_given_new_memory, mode != "sync", mode.endswith("ordered"))


def test_async_pools_of_other_sizes_freed(gloo_ranks):
    gloo_ranks.run(check_async_pools_of_other_sizes_freed)


def test_lazy_views_chunked_or_not(gloo_ranks):
    gloo_ranks.run(check_lazy_views_chunked_or_not)


def test_full_tensor_chunked(gloo_ranks):
    gloo_ranks.run(check_full_tensor_chunked)


def test_non_contiguous_tensor_staged_whole(gloo_ranks):
    gloo_ranks.run(check_all_reduce_non_contiguous)


def check_all_reduce_non_contiguous():
    base = rank_input((4, 6), torch.float32, seed=11)
    expected = base.clone()
    dist.all_reduce(expected)
    holder = base.clone()
    view = holder.t()[1:5]  # non-contiguous, at an offset
    with staging_through_cpu(chunk_bytes=8) as devices:
        dist.all_reduce(view)
    assert devices == ["cpu"]
    assert same_bits(holder.t()[1:5], expected.t()[1:5])
    assert same_bits(holder.t()[0], base.t()[0]) and same_bits(holder.t()[5], base.t()[5])


# ---------------------------------------------------------------- routing off a group's CPU backend


def check_routing(threshold):
    """Routing by size is decided from what every rank shares: the decision (``_plan.decide``) sizes every chunkable
    call by what torch requires equal on every rank (an all_reduce's or broadcast's tensor, a gather's output, which
    for a DTensor's uneven shards is torch's padded one), whatever the entry point, and never the calls whose sizes
    may differ per rank (a list gather). Returns, per call, the size its decision saw (``None``: not a size it
    routes by)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from offload_shim import _plan

    offload_shim.install()
    rank = dist.get_rank()
    decisions = {}
    decide = _plan.decide

    def recording(call):
        asked.append(_plan._shared_bytes(call) if call.entry.chunkable else None)
        return decide(call)

    uneven = distribute_tensor(torch.ones(2 * (threshold // 4) - 1), init_device_mesh("cpu", (2,)), [Shard(0)])
    _plan.decide = recording
    try:
        with configured(staging_device="cpu", always_stage=True, route_min_bytes=threshold):
            for name, call in (
                ("small_all_reduce", lambda: dist.all_reduce(torch.ones(threshold // 4 - 1))),
                ("large_all_reduce", lambda: dist.all_reduce(torch.ones(threshold // 4))),
                ("large_broadcast", lambda: dist.broadcast(torch.ones(threshold // 4), src=0)),
                ("functional_all_reduce", lambda: funcol.all_reduce(torch.ones(threshold // 4), "sum", dist.group.WORLD)),
                # Unequal shards per rank: torch gathers them padded to one size, which decides.
                ("uneven_full_tensor", uneven.full_tensor),
                ("all_gather_single", lambda: versions.all_gather_single(torch.ones(threshold), 0, dist.group.WORLD)),
                # A list gather's sizes may differ per rank: never routed by size.
                ("all_gather", lambda: dist.all_gather([torch.ones(3), torch.ones(3)], torch.ones(3))),
            ):
                asked = []
                call()
                decisions[name] = asked[0] if asked else "not asked"
    finally:
        _plan.decide = decide
    return rank, decisions


def test_routing_by_size_takes_the_same_route_on_every_rank(gloo_ranks):
    (_, decisions0), (_, decisions1) = gloo_ranks.run(check_routing, 4096)
    assert decisions0 == decisions1 == {
        "small_all_reduce": 4092,
        "large_all_reduce": 4096,
        "large_broadcast": 4096,
        "functional_all_reduce": 4096,
        "uneven_full_tensor": 8192,  # two padded shards of 4096 B, on both ranks (their shards hold 4096 and 4092 B)
        "all_gather_single": 32768,  # the output: two inputs of 16384 B
        "all_gather": None,
    }


def check_uneven_shard_sizes(threshold):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    sharded = distribute_tensor(torch.ones(2 * (threshold // 4) - 1), init_device_mesh("cpu", (2,)), [Shard(0)])
    return sharded.to_local().numel() * 4


def test_uneven_full_tensor_has_local_sizes_on_both_sides_of_the_threshold(gloo_ranks):
    """Makes the routing test above meaningful: routing by local size would split the ranks."""
    assert sorted(gloo_ranks.run(check_uneven_shard_sizes, 4096)) == [4092, 4096]


# ---------------------------------------------------------------- inputs found by trying to break it


def check_requires_grad(chunk_bytes):
    """A leaf that requires grad (a Parameter), as torch's in-place collectives take it: outside autograd."""
    base = rank_input((10,), torch.float32, seed=21)
    expected = base.clone()
    dist.all_reduce(expected)
    expected_broadcast = base.clone()
    dist.broadcast(expected_broadcast, src=1)
    parameter = torch.nn.Parameter(base.clone())
    intermediate = base.clone().requires_grad_() * 1.0
    with staging_through_cpu(chunk_bytes=chunk_bytes):
        dist.all_reduce(parameter)
        dist.all_reduce(intermediate)
        received = torch.nn.Parameter(base.clone())
        dist.broadcast(received, src=1)
    assert parameter.requires_grad and parameter.is_leaf and same_bits(parameter, expected)
    assert type(intermediate.grad_fn).__name__ == "MulBackward0" and same_bits(intermediate, expected)
    assert same_bits(received, expected_broadcast)


@pytest.mark.parametrize("chunk_bytes", [8, 1 << 20], ids=["pipelined", "whole"])
def test_requires_grad_tensors(gloo_ranks, chunk_bytes):
    gloo_ranks.run(check_requires_grad, chunk_bytes)


def check_non_dense_views():
    """Views that are not dense (stepped slices, a column), whole and pipelined: the staged copy is contiguous,
    which backends need (NCCL refuses other strides; Gloo computes wrong values on non-dense views and writes outside
    them); only the view's elements are written."""
    full = rank_input((6, 7), torch.float32, seed=23)
    expected = full.clone()
    dist.all_reduce(expected)  # a contiguous tensor: right on Gloo
    for chunk_bytes in (1 << 20, 8):  # staged whole; pipelined through a contiguous host copy
        for index in ((slice(None, None, 2), slice(1, None, 3)), (slice(None), 2), (slice(1, 4), slice(2, 5))):
            holder = full.clone()
            with staging_through_cpu(chunk_bytes=chunk_bytes):
                dist.all_reduce(holder[index])
            want = full.clone()
            want[index] = expected[index]
            assert same_bits(holder, want), (chunk_bytes, index)
    # An expanded (stride 0) input is read as its logical values, as from a contiguous copy (torch's own Gloo path
    # reads past its memory).
    expanded = torch.tensor([float(dist.get_rank() + 1)]).expand(5)
    want = [torch.zeros(5) for _ in range(dist.get_world_size())]
    dist.all_gather(want, expanded.contiguous())
    got = [torch.zeros(5) for _ in range(dist.get_world_size())]
    with staging_through_cpu():
        dist.all_gather(got, expanded)
    assert all(same_bits(g, w) for g, w in zip(got, want))


def test_non_dense_views(gloo_ranks):
    gloo_ranks.run(check_non_dense_views)


def check_threads_on_two_groups():
    """Two threads run pipelined collectives on two groups at once; the ranks' threads interleave differently."""
    import threading

    groups = [dist.new_group([0, 1], backend="gloo") for _ in range(2)]
    errors, results = [], {}

    def worker(index):
        try:
            for step in range(20):
                t = torch.full((33,), float(dist.get_rank() + index + step))
                dist.all_reduce(t, group=groups[index])
                results[(index, step)] = t[0].item() == float(2 * (index + step) + 1) and bool((t == t[0]).all())
        except BaseException as exc:
            errors.append(exc)

    with staging_through_cpu(chunk_bytes=16):
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "deadlock"
    assert not errors and all(results.values()) and len(results) == 40


def test_threads_on_two_groups(gloo_ranks):
    gloo_ranks.run(check_threads_on_two_groups)


# ---------------------------------------------------------------- small calls and threaded host copies


def check_small_calls_reuse_one_slot_per_thread():
    """Synchronous calls under two chunks go through this thread's slot: equal to the unstaged call bit for bit,
    whatever the collective, role, dtype and strides, the slot poisoned between calls; no new buffer while sizes
    fit; a larger call grows it; release_buffers() and another thread get new ones."""
    import threading

    rank = dist.get_rank()
    cases = [
        (lambda t: dist.all_reduce(t), rank_input((), torch.float32, seed=1)),
        (lambda t: dist.all_reduce(t, op=dist.ReduceOp.MIN), torch.tensor([rank], dtype=torch.int8)),
        (lambda t: dist.broadcast(t, src=1), rank_input((3, 5), torch.bfloat16, seed=2)),
        (lambda t: dist.broadcast(t, src=0), rank_input((7,), torch.int64, seed=3)),
        (lambda t: dist.reduce(t, dst=0), rank_input((2, 2), torch.float64, seed=4)),
        (lambda t: dist.all_reduce(t), rank_input((6, 4), torch.float32, seed=5).t()[1:3]),  # non-contiguous
    ]
    with staging_through_cpu(chunk_bytes=1 << 20) as devices:
        for index, (call, tensor) in enumerate(cases):  # the first call of a thread makes its slot
            expected = tensor.clone()
            offload_shim.uninstall()
            call(expected)
            offload_shim.install()
            if index == 4 and rank != 0:  # reduce: Gloo's own call uses the others' tensors as scratch; NCCL's not
                expected = tensor.clone()
            poison_staging_buffers()
            call(tensor)
            assert same_bits(tensor, expected)
        slot = [b.data_ptr() for b in _staging.small_slot_buffers()]
        assert len(slot) == 1 and devices == ["cpu"] * len(cases)
        for call, tensor in cases:
            call(tensor)
        assert [b.data_ptr() for b in _staging.small_slot_buffers()] == slot, "a small call allocated"
        big = torch.ones(100_000)
        dist.all_reduce(big)
        assert _staging.small_slot_buffers()[0].numel() >= big.nbytes and same_bits(big, torch.full((100_000,), 2.0))
        offload_shim.release_buffers()
        dist.all_reduce(torch.ones(1))
        released = [b.data_ptr() for b in _staging.small_slot_buffers()]
        other = []

        def in_another_thread():
            with configured(staging_device="cpu", always_stage=True):
                dist.all_reduce(torch.ones(1))
            other.extend(b.data_ptr() for b in _staging.small_slot_buffers())

        thread = threading.Thread(target=in_another_thread)
        thread.start()
        thread.join()
        assert len(other) == 1 and not set(other) & set(released)


def test_small_calls_reuse_one_slot_per_thread(gloo_ranks):
    gloo_ranks.run(check_small_calls_reuse_one_slot_per_thread)


def check_threaded_host_copies():
    """Pageable tensors of several 32 MiB chunks: bounce-buffer copies on the two copy lanes, each split over the
    copy threads (two 16 MiB pieces a chunk), bit for bit equal to the unstaged call."""
    base = rank_input((20 * (1 << 20) + 3,), torch.float32, seed=9)  # 80 MiB and 12 bytes: a short last chunk
    expected = base.clone()
    dist.all_reduce(expected)
    tensor = base.clone()
    with staging_through_cpu(chunk_bytes=32 << 20) as devices:
        dist.all_reduce(tensor)
    assert devices == ["cpu"]
    assert same_bits(tensor, expected)
    return _staging.copy_threads(), state.copy_pool is not None, sorted(_devices.record(dist.group.WORLD).lanes)


def test_threaded_host_copies(gloo_ranks):
    for threads, pool_made, lanes in gloo_ranks.run(check_threaded_host_copies):
        assert pool_made == (threads > 1)  # the copies were split over threads wherever there are two CPUs
        assert {"in", "out"} <= set(lanes), lanes  # the group's copy lanes


def test_replay_host_copies_are_byte_copies_at_the_addresses():
    """A replayed small call copies the caller's bytes through ``_replay.bytes_at`` views (the replay itself needs
    CUDA): assigning one view to another copies exactly the bytes at those addresses, for every dtype and for views
    at an offset into a larger tensor, and touches nothing beside them; views of other lengths are refused."""
    from offload_shim import _replay

    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.float64, torch.complex64):
        source = (torch.rand(7) * 100).to(dtype)
        target = torch.zeros(11, dtype=dtype)
        view = target[2:9]
        _replay.bytes_at(view.data_ptr(), view.nbytes)[:] = _replay.bytes_at(source.data_ptr(), source.nbytes)
        assert same_bits(view, source), dtype
        assert not target[:2].any() and not target[9:].any(), (dtype, target)
    with pytest.raises(ValueError):
        _replay.bytes_at(target.data_ptr(), 4)[:] = _replay.bytes_at(source.data_ptr(), 8)


def check_coalescing_state_kept():
    from torch.distributed.distributed_c10d import _coalescing_manager

    from offload_shim import _replay

    group = dist.new_group(backend="gloo")
    values = torch.full((3,), float(dist.get_rank() + 1))
    with _coalescing_manager(group):
        seen = group in _replay._coalescing
        dist.all_reduce(values, group=group)
    dist.destroy_process_group(group)
    return seen, values.tolist(), _replay._coalescing is dist.distributed_c10d._world.pg_coalesce_state


def test_replay_reads_torchs_coalescing_state(gloo_ranks):
    """The replay's check for a coalescing manager reads torch's own dict of coalescing groups, read once: torch makes
    it once and changes it only in place, through a coalesced call and a group's destruction."""
    for seen, values, same in gloo_ranks.run(check_coalescing_state_kept):
        assert seen and values == [3.0] * 3 and same, (seen, values, same)


def test_registration_is_opt_in():
    """Registration is off unless asked for: unset, empty or ``0``, no budget; a size sets it; ``None`` is no
    size."""
    import offload_shim
    from offload_shim import _config

    variable = "OFFLOAD_SHIM_REGISTER_BYTES"
    for raw, expected in ((None, 0), ("", 0), ("0", 0), ("4GiB", 4 << 30)):
        environ = {} if raw is None else {variable: raw}
        assert _config.settings_from_environment(environ).register_bytes == expected, raw
    assert offload_shim.settings().register_bytes == 0
    with pytest.raises(offload_shim.ConfigError, match="register_bytes=None is not a size"):
        offload_shim.configure(register_bytes=None)


def check_served_answers_follow_configure():
    """The served path keeps one answer per group for host tensors; configure() empties them: a call served under
    one setting is staged at once under the next, and served again after (counted by the staging counters)."""
    offload_shim.install()
    offload_shim.reset_staging_counters()
    rank = dist.get_rank()
    staged = lambda: sum(count.calls for count in offload_shim.staging_counters().values())  # noqa: E731
    counts, values = [], []
    for forced in (False, True, False, True):
        with configured(staging_device="cpu", always_stage=forced):
            for _ in range(2):
                tensor = torch.full((4,), float(rank + 1))
                dist.all_reduce(tensor)
                values.append(tensor.tolist())
            counts.append(staged())
    return counts, values


def test_served_answers_follow_configure(gloo_ranks):
    for counts, values in gloo_ranks.run(check_served_answers_follow_configure):
        assert counts == [0, 2, 2, 4] and values == [[3.0] * 4] * 8, (counts, values)
