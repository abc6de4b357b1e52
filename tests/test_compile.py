"""Collectives reached from ``torch.compile``d code on CPU tensors (offload_shim/_kernels.py).

Dynamo turns ``dist.all_reduce`` and the functional collectives into ``torch.ops._c10d_functional.*`` calls, so
the eager wrappers never run there; the ``CPU`` kernels of ``_kernels`` do. On a Gloo group with
``configure(staging_device="cpu", always_stage=True)`` compiled calls are really staged (real copies, the real
Gloo collective on the copy, the copy back) and must equal the uncompiled, unstaged call bit for bit; without
``always_stage`` they must be left alone; on a ``cuda:gloo`` group on this GPU-less machine they must raise
offload_shim's error; after ``uninstall()`` torch's own kernels must be back.

Inductor is tested only with ``OFFLOAD_SHIM_TEST_INDUCTOR=1``: its first compile in a process costs 5 to 13 s on
a 2-core machine, most of this file's CI budget.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import offload_shim
from interpreters import python
from observe import configured, recording_staging
from bitwise import same_bits
from offload_shim import _kernels

F = torch.ops._c10d_functional
INDUCTOR = os.environ.get("OFFLOAD_SHIM_TEST_INDUCTOR") == "1"

# ---------------------------------------------------------------- compiled functions and helpers (run in ranks)


def dist_all_reduce(t):
    dist.all_reduce(t)
    return t


def funcol_all_reduce(t):
    return funcol.all_reduce(t, "sum", dist.group.WORLD)


def funcol_all_gather_tensor(t):
    return funcol.all_gather_tensor(t, 0, dist.group.WORLD)


CALLS = {f.__name__: f for f in (dist_all_reduce, funcol_all_reduce, funcol_all_gather_tensor)}
OP_CALLED = {  # the op Dynamo's graph calls for each
    "dist_all_reduce": "torch.ops._c10d_functional.all_reduce",
    "funcol_all_reduce": "torch.ops._c10d_functional.all_reduce",
    "funcol_all_gather_tensor": "torch.ops._c10d_functional.all_gather_into_tensor",
}


@contextlib.contextmanager
def shim(**settings):
    """Both halves of the shim installed (eager wrappers and compiled kernels), ``settings`` configured, every
    staging decision recorded. After: settings, logger and the compiled kernels as they were (the rank pools are
    shared with other test files), Dynamo's caches emptied; the eager wrappers stay, as other files leave them."""
    kernels_were_installed = _kernels.is_installed()
    offload_shim.install()
    _kernels.install()
    try:
        with configured(**settings), recording_staging(collectives=True) as records:
            yield records
    finally:
        if not kernels_were_installed:
            _kernels.uninstall()
        torch._dynamo.reset()


def compiled(name, backend="eager", fullgraph=False):
    torch._dynamo.reset()
    return torch.compile(CALLS[name], backend=backend, fullgraph=fullgraph)


def rank_input(seed=0, shape=(5, 3)):
    generator = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    return torch.randn(shape, generator=generator)


def unstaged(name, tensor):
    """The uncompiled call with no shim at all: the reference."""
    offload_shim.uninstall()
    _kernels.uninstall()
    tensor = tensor.clone()
    result = CALLS[name](tensor)
    return funcol.wait_tensor(result) if isinstance(result, funcol.AsyncCollectiveTensor) else result


# ---------------------------------------------------------------- checks run inside the ranks


def check_compiled_staged(name, backend, fullgraph):
    expected = unstaged(name, rank_input())
    tensor = rank_input()
    pointer = tensor.data_ptr()
    with shim(staging_device="cpu", always_stage=True) as records:
        result = compiled(name, backend, fullgraph)(tensor)
    assert records == [(OP_CALLED[name], "cpu")], records  # staged once, by the kernel, not by an eager wrapper
    assert type(result) is torch.Tensor and same_bits(result, expected)
    if name == "dist_all_reduce":  # in place: the caller's own tensor holds the result
        assert tensor.data_ptr() == pointer and same_bits(tensor, expected)
    else:
        assert same_bits(tensor, rank_input()), "the input changed"


def check_compiled_untouched(name):
    expected = unstaged(name, rank_input(1))
    tensor = rank_input(1)
    with shim() as records:
        result = compiled(name, fullgraph=True)(tensor)
    assert records == []
    assert same_bits(result, expected)


def check_served_ops_make_no_copy():
    """On a group that serves CPU, torch's own kernel runs on the caller's tensors: no staging copy at all."""
    from offload_shim import _staging

    def no_copy(*args):
        raise AssertionError("staged a call the group serves")

    tensor = torch.arange(6.0).reshape(2, 3)
    with shim() as records:
        to_staging, _staging.to_staging = _staging.to_staging, no_copy
        try:
            returned = F.wait_tensor(F.all_reduce_(tensor, "sum", dist.group.WORLD.group_name))
            gathered = F.wait_tensor(F.all_gather_into_tensor(tensor, 2, dist.group.WORLD.group_name))
        finally:
            _staging.to_staging = to_staging
    assert records == [] and returned is tensor
    assert torch.equal(tensor, torch.arange(6.0).reshape(2, 3) * 2)
    assert torch.equal(gathered, torch.cat([tensor, tensor]))


def op_calls(group_name):
    """One call of every collective op of ``_c10d_functional`` this torch has (point-to-point aside), as a
    compiled graph makes it: name -> (call, index of the caller's tensor it writes and returns, or None)."""
    rank = dist.get_rank()
    splits = [1, 3] if rank == 0 else [3, 1]
    calls = {
        "all_reduce": (lambda t: F.all_reduce(t, "avg", group_name), None),
        "all_reduce_": (lambda t: F.all_reduce_(t, "max", group_name), 0),
        "all_reduce_coalesced": (lambda t: F.all_reduce_coalesced([t, t[1:]], "sum", group_name), None),
        "all_reduce_coalesced_": (lambda t: F.all_reduce_coalesced_([t, t[1:].clone()], "sum", group_name), 0),
        "broadcast": (lambda t: F.broadcast(t, 1, group_name), None),
        "broadcast_": (lambda t: F.broadcast_(t, 1, group_name), 0),
        "all_gather_into_tensor": (lambda t: F.all_gather_into_tensor(t, 2, group_name), None),
        "all_gather_into_tensor_out": (
            lambda t: F.all_gather_into_tensor_out(t, 2, group_name, out=torch.zeros(8, 3)), "out"),
        "all_gather_into_tensor_coalesced": (
            lambda t: F.all_gather_into_tensor_coalesced([t, t[:2]], 2, group_name), None),
        "reduce_scatter_tensor": (lambda t: F.reduce_scatter_tensor(t, "sum", 2, group_name), None),
        "reduce_scatter_tensor_out": (
            lambda t: F.reduce_scatter_tensor_out(t, "sum", 2, group_name, out=torch.zeros(2, 3)), "out"),
        "reduce_scatter_tensor_coalesced": (
            lambda t: F.reduce_scatter_tensor_coalesced([t, t * 3], "avg", 2, group_name), None),
        "all_to_all_single": (lambda t: F.all_to_all_single(t, splits, splits, group_name), None),
    }
    # _dtensor's shard_dim_alltoall has a test of its own (below)
    present = {op._opname for op in _kernels._collective_ops() if op._namespace == "_c10d_functional"}
    assert not present - set(calls) - _kernels.POINT_TO_POINT, f"untested ops: {present - set(calls)}"
    return {name: call for name, call in calls.items() if name in present}


def waited(result):
    return F.wait_tensor(result) if isinstance(result, torch.Tensor) else [F.wait_tensor(r) for r in result]


def check_every_op_staged():
    """Every collective op called directly (as a compiled graph calls it), staged through the CPU, against the
    same call unstaged: same bits; in-place and out= ops write and return the caller's own tensor; each call is
    staged once; ``wait_tensor`` on what a staged call returns hands it back unchanged."""
    group_name = dist.group.WORLD.group_name
    for name, (call, writes) in op_calls(group_name).items():
        base = rank_input(2, (4, 3))
        expected = waited(call(base.clone()))
        tensor = base.clone()
        with shim(staging_device="cpu", always_stage=True) as records:
            result = call(tensor)
            again = waited(result)
        assert records == [(f"torch.ops._c10d_functional.{name}", "cpu")], (name, records)
        results, expecteds = (result, expected) if isinstance(result, list) else ([result], [expected])
        assert len(results) == len(expecteds) and all(map(same_bits, results, expecteds)), name
        assert all(a is b for a, b in zip(_as_list(again), results)), f"{name}: wait_tensor changed the result"
        if writes == 0:
            assert (result[0] if isinstance(result, list) else result) is tensor, name
        elif writes is None:
            assert same_bits(tensor, base), f"{name} changed its input"


def _as_list(value):
    return value if isinstance(value, list) else [value]


def check_in_place_into_strided_view():
    """all_reduce_ on a non-contiguous view at a storage offset: staged contiguous, written back into the view
    only."""
    buffer = torch.zeros(7, 4)
    view = buffer[1:6, 1:4]
    view.copy_(rank_input(3))
    expected = view.clone()
    dist.all_reduce(expected)
    outside = buffer.clone()
    with shim(staging_device="cpu", always_stage=True) as records:
        returned = F.wait_tensor(F.all_reduce_(view, "sum", dist.group.WORLD.group_name))
    assert records and returned is view and same_bits(view, expected)
    mask = torch.ones_like(buffer, dtype=torch.bool)
    mask[1:6, 1:4] = False
    assert torch.equal(buffer[mask], outside[mask]), "wrote outside the caller's view"


def check_eager_functional_staged_once():
    """An eager functional collective of a host tensor is staged once, by the CPU kernel of the op it calls (as
    the same call in compiled code is): its Python wrapper leaves host tensors to the op."""
    tensor = rank_input(4)
    expected = funcol.wait_tensor(funcol.all_reduce(tensor, "sum", dist.group.WORLD))
    with shim(staging_device="cpu", always_stage=True) as records:
        result = funcol.all_reduce(tensor, "sum", dist.group.WORLD)
    assert records == [("torch.ops._c10d_functional.all_reduce", "cpu")], records
    assert same_bits(result, expected)


def error_of(function):
    """Call ``function`` on a CPU tensor; return the error's type name, its message, and whether the caller's
    tensor is unchanged."""
    tensor = rank_input(5)
    try:
        function(tensor)
    except RuntimeError as exc:
        return type(exc).__name__, str(exc), same_bits(tensor, rank_input(5))
    raise AssertionError(f"{function} did not raise")


def check_unstageable(name, fullgraph):
    with shim():
        return error_of(compiled(name, fullgraph=fullgraph))


def check_point_to_point_refused():
    tensor = torch.ones(3)
    with shim():
        try:
            F.isend(tensor, 1 - dist.get_rank(), 0, dist.group.WORLD.group_name)
        except offload_shim.StagingError as exc:
            return str(exc)
    raise AssertionError("isend did not raise")


def check_uninstall_and_reinstall():
    """One compiled function, not recompiled: offload_shim's error, torch's after uninstall (the dispatcher's
    CPU entry is torch's kernel again), offload_shim's after install again. Installing twice registers once."""
    name, cpu = "_c10d_functional::all_reduce", torch._C.DispatchKey.CPU
    with shim():
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a second registration would warn of an overridden kernel
            _kernels.install()
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, cpu)
        function = compiled("funcol_all_reduce", fullgraph=True)
        installed = error_of(function)
        _kernels.uninstall()
        _kernels.uninstall()
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, cpu)
        removed = error_of(function)
        _kernels.install()
        reinstalled = error_of(function)
    return installed, removed, reinstalled


def check_inductor(name):
    expected = unstaged(name, rank_input(6))
    tensor = rank_input(6)
    with shim(staging_device="cpu", always_stage=True) as records:
        result = compiled(name, "inductor", fullgraph=True)(tensor)
    assert len(records) == 1 and records[0][1] == "cpu", records  # inductor calls all_reduce_ (in place)
    assert same_bits(result, expected)


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph", "fullgraph"])
@pytest.mark.parametrize("name", sorted(CALLS))
def test_compiled_call_is_staged(gloo_ranks, name, fullgraph):
    gloo_ranks.run(check_compiled_staged, name, "eager", fullgraph)


def test_compiled_call_staged_with_aot_autograd(gloo_ranks):
    """aot_eager functionalizes and runs the graph AOTAutograd made: the same ops reach the same kernels."""
    gloo_ranks.run(check_compiled_staged, "dist_all_reduce", "aot_eager", True)


@pytest.mark.skipif(not INDUCTOR, reason="set OFFLOAD_SHIM_TEST_INDUCTOR=1 (first inductor compile: 5-13 s)")
@pytest.mark.parametrize("name", sorted(CALLS))
def test_compiled_call_is_staged_inductor(gloo_ranks, name):
    gloo_ranks.run(check_inductor, name)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_compiled_call_on_served_group_untouched(gloo_ranks, name):
    gloo_ranks.run(check_compiled_untouched, name)


def test_served_group_ops_make_no_copy(gloo_ranks):
    gloo_ranks.run(check_served_ops_make_no_copy)


def test_every_collective_op_staged(gloo_ranks):
    gloo_ranks.run(check_every_op_staged)


def test_in_place_op_on_strided_view(gloo_ranks):
    gloo_ranks.run(check_in_place_into_strided_view)


def test_eager_functional_collective_not_staged_twice(gloo_ranks):
    gloo_ranks.run(check_eager_functional_staged_once)


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph", "fullgraph"])
@pytest.mark.parametrize("name", sorted(CALLS))
def test_compiled_call_without_cpu_backend_raises(accelerator_only_ranks, name, fullgraph):
    # Every rank answers (the pool fails on a rank that does not, within its timeout): none blocks.
    for kind, message, unchanged in accelerator_only_ranks.run(check_unstageable, name, fullgraph):
        assert kind == "StagingError" and unchanged, (kind, message)
        assert message.startswith(f"offload_shim: {OP_CALLED[name]} got a tensor on cpu ((5, 3), torch.float32)")
        assert "backend 'cuda:gloo' serves device types ['cuda'] only" in message
        assert "init_process_group('cpu:gloo,cuda:gloo')" in message and "move the tensor to the accelerator" in message


@pytest.mark.skipif(not hasattr(torch.ops._c10d_functional, "isend"), reason="torch 2.12 added the functional isend")
def test_point_to_point_without_cpu_backend_raises(accelerator_only_ranks):
    for message in accelerator_only_ranks.run(check_point_to_point_refused):
        assert message.startswith("offload_shim: torch.ops._c10d_functional.isend got a tensor on cpu")
        assert "does not stage the point-to-point ops" in message and "move the tensor to the accelerator" in message
        assert "init_process_group('cpu:gloo,cuda:gloo')" in message


def test_uninstall_restores_torch_error(accelerator_only_ranks):
    for installed, removed, reinstalled in accelerator_only_ranks.run(check_uninstall_and_reinstall):
        assert installed[0] == reinstalled[0] == "StagingError" and installed[2] and reinstalled[2]
        assert removed[0] == "RuntimeError" and "offload_shim" not in removed[1], removed
        assert removed[1] == "No backend type associated with device type cpu", removed


# ---------------------------------------------------------------- DTensor's Shard to Shard all-to-all


def check_shard_dim_alltoall(stage: bool):
    """``torch.ops._dtensor.shard_dim_alltoall``, as DTensor redistribution calls it on an accelerator mesh with an
    offloaded (CPU) local tensor: staged through the CPU, equal to the unstaged op; on a group without a CPU backend,
    StagingError before anything is sent."""
    import torch.distributed.tensor  # noqa: F401  (registers the op's fake kernel)

    group_name = dist.group.WORLD.group_name
    if not stage:
        with shim():
            return error_of(lambda tensor: torch.ops._dtensor.shard_dim_alltoall(tensor, 0, 1, group_name))
    local = rank_input(3, (4, 6))
    expected = torch.ops._dtensor.shard_dim_alltoall(local.clone(), 0, 1, group_name)
    with shim(staging_device="cpu", always_stage=True) as records:
        got = torch.ops._dtensor.shard_dim_alltoall(local, 0, 1, group_name)
    assert records == [("torch.ops._dtensor.shard_dim_alltoall", "cpu")], records
    assert type(got) is torch.Tensor and got.shape == (8, 3) and same_bits(got, expected)


def test_dtensor_shard_dim_alltoall_staged(gloo_ranks):
    gloo_ranks.run(check_shard_dim_alltoall, True)


def test_dtensor_shard_dim_alltoall_without_cpu_backend_raises(accelerator_only_ranks):
    for kind, message, unchanged in accelerator_only_ranks.run(check_shard_dim_alltoall, False):
        assert kind == "StagingError" and unchanged, (kind, message)
        assert message.startswith("offload_shim: torch.ops._dtensor.shard_dim_alltoall got a tensor on cpu")


def test_dynamo_skip_rule_added_once_per_process():
    """Install and uninstall cycles add the package to Dynamo's skip rules once, whether Dynamo was imported before
    the first install or after it."""
    for dynamo_first in (True, False):
        result = python(
            f"""
            import os, torch
            if {dynamo_first}:
                import torch._dynamo.trace_rules
            import offload_shim
            for _ in range(3):
                offload_shim.uninstall()
                offload_shim.install()
            import torch._dynamo.trace_rules as trace_rules
            folder = os.path.dirname(offload_shim.__file__)
            print(sum(os.path.normpath(entry) == folder for entry in trace_rules.SKIP_DIRS))
            """,
            env={"OFFLOAD_SHIM": "0"},
        )
        assert result.stdout.split() == ["1"], (dynamo_first, result.stdout, result.stderr)
