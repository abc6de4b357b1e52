"""The collectives beyond all_reduce and broadcast, staged for real on CPU ranks (``configure(staging_device="cpu",
always_stage=True)``): the field cases' calls as their reports spell them, and inputs found by trying to break them.
The property tests of tests/test_contracts_cpu.py cover values over dtypes, shapes and layouts; these cover
spellings, lifetimes and the places where torch defers or reorders work."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

import offload_shim
from bitwise import same_bits
from observe import configured, recording_staging


def staging():
    offload_shim.install()
    return configured(staging_device="cpu", always_stage=True)


def field_cases():
    """Cases 20, 21, 25 and 29 as their reports call them (positional group and dst, a CPU Parameter's .data)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with staging(), recording_staging() as devices:
        inp = torch.tensor(100 + rank)[None]
        out = torch.empty(world, dtype=torch.int64)
        dist.all_gather_into_tensor(out, inp)
        assert out.tolist() == [100 + r for r in range(world)]
        local = torch.arange(3 + 2 * rank, dtype=torch.float32)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor(local.shape))
        assert [int(s) for s in sizes] == [3 + 2 * r for r in range(world)]
        emb = torch.nn.Embedding(4, 6).half()
        if rank == 0:
            dist.send((torch.arange(24.0).view(4, 6) + 1).half(), 1)
        else:
            dist.recv(emb.weight.data, 0)
            assert torch.equal(emb.weight.data, (torch.arange(24.0).view(4, 6) + 1).half())
            assert emb.weight.requires_grad and emb.weight.is_leaf
        dp = dist.new_group(list(range(world)))
        received = [torch.zeros(5) for _ in range(world)] if rank == 0 else None
        dist.gather(torch.full((5,), float(rank)), received, 0, dp)
        if rank == 0:
            assert all(torch.equal(t, torch.full((5,), float(r))) for r, t in enumerate(received))
        back = torch.empty(5)
        dist.scatter(back, [t * 2 for t in received] if rank == 0 else None, 0, dp)
        assert torch.equal(back, torch.full((5,), 2.0 * rank))
    assert devices and set(devices) == {"cpu"}


def coalescing_manager(served: bool):
    """torch's _coalescing_manager only records a collective, to run it at the block's end: on a group that serves
    CPU the call is left to torch (right values); where the group serves no CPU, StagingError, nothing written (on
    this machine for want of an accelerator; tests/test_gpu_collectives.py checks the coalescing refusal)."""
    offload_shim.install()
    rank = dist.get_rank()
    tensor = torch.full((2,), rank + 1.0)
    if served:
        with configured(staging_device="cpu", always_stage=True), recording_staging() as devices:
            with _coalescing_manager(async_ops=True) as cm:
                dist.all_reduce(tensor)
            cm.wait()
        assert devices == [] and tensor.tolist() == [3.0, 3.0]
        return None
    try:
        with pytest.raises(offload_shim.StagingError) as info:
            with _coalescing_manager():
                dist.all_reduce(tensor)
    finally:  # an exception inside the block leaves torch's coalescing state behind; these ranks serve other tests
        dist.distributed_c10d._world.pg_coalesce_state.pop(dist.group.WORLD, None)
    assert tensor.tolist() == [rank + 1.0] * 2
    return str(info.value)


def inference_tensors(chunk_bytes: int):
    """Tensors made under torch.inference_mode(), staged outside it in place, whole and chunked, and as a gather's
    outputs inside it (outside, torch refuses them): written as torch writes them."""
    rank = dist.get_rank()
    with torch.inference_mode():
        reduced = torch.full((33,), rank + 1.0)
        broadcast = torch.full((33,), rank + 1.0)
        gathered = [torch.zeros(3) for _ in range(2)]
    with staging(), configured(chunk_bytes=chunk_bytes):
        dist.all_reduce(reduced)
        dist.broadcast(broadcast, src=0)
        with torch.inference_mode():
            dist.all_gather(gathered, torch.full((3,), float(rank)))
    assert reduced.tolist() == [3.0] * 33 and broadcast.tolist() == [1.0] * 33
    assert [g.tolist() for g in gathered] == [[0.0] * 3, [1.0] * 3]


def p2p_ops_made_before_install():
    """P2POps made while the shim was not installed: torch tells sends from receives by identity with its module's
    isend, which install rebinds. Staged, the caller's P2POps keep their own tensors and ops (the staged call runs
    on copies of them)."""
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    offload_shim.uninstall()
    received = torch.zeros(2)
    ops = [dist.P2POp(dist.isend, torch.full((2,), rank + 1.0), peer), dist.P2POp(dist.irecv, received, peer)]
    held = [(op.op, op.tensor) for op in ops]
    offload_shim.install()
    for stage in (False, True):
        with configured(staging_device="cpu", always_stage=stage):
            received.zero_()
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        assert received.tolist() == [peer + 1.0] * 2, stage
        assert all(op.op is kind and op.tensor is tensor for op, (kind, tensor) in zip(ops, held)), stage


def batch_handles_wait_their_own_operation():
    """Gloo returns one work per operation: waiting the send's handle must not wait for the receive (rank 1 sends
    only after it got a later message)."""
    rank = dist.get_rank()
    a, b, c = torch.full((4,), 1.0), torch.zeros(4), torch.full((4,), 3.0)
    with staging():
        if rank == 0:
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, a, 1), dist.P2POp(dist.irecv, b, 1)])
            works[0].wait()
            dist.send(c, 1)
            assert works[1].wait() is True and works[1].wait() is True  # waited twice: no second receive
            assert b.tolist() == [4.0] * 4
        else:
            dist.recv(a, 0)
            dist.recv(c, 0)
            dist.send(a + c, 0)


def async_list_collectives_waited_late():
    """async_op=True on list collectives: the caller's outputs hold the result once the handle is waited, in any
    order, and a handle waited twice changes nothing."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with staging():
        gathered = [torch.zeros(2) for _ in range(world)]
        first = dist.all_gather(gathered, torch.full((2,), float(rank)), async_op=True)
        out = torch.zeros(2)
        second = dist.reduce_scatter_tensor(out, torch.arange(4.0) + rank, async_op=True)
        assert second.wait() is True and first.wait() is True and first.wait() is True
        assert [g.tolist() for g in gathered] == [[0.0, 0.0], [1.0, 1.0]]
        assert same_bits(out, (torch.arange(4.0) * 2 + 1)[2 * rank : 2 * rank + 2])


def saved_for_backward(chunk_bytes: int):
    """A tensor autograd saved for backward (tanh saves its output), then written by a staged collective: torch's
    C++ collectives do not bump its version counter, so backward still runs; staged, it must too, with the same
    gradient."""
    rank = dist.get_rank()
    grads = []
    for stage in (False, True):
        a = torch.arange(1.0, 12.0).div(10).add(rank).requires_grad_()
        h = torch.tanh(a)
        received = torch.tanh(a * 2)
        with configured(staging_device="cpu", always_stage=stage, chunk_bytes=chunk_bytes):
            offload_shim.install()
            dist.all_reduce(h)
            if rank == 0:
                dist.send(torch.full((11,), 0.5), 1)
            else:
                dist.recv(received, 0)
        (h.sum() + received.sum()).backward()
        grads.append((h.detach().clone(), received.detach().clone(), a.grad))
    assert all(same_bits(x, y) for x, y in zip(*grads))


def test_field_cases(gloo_ranks):
    gloo_ranks.run(field_cases)


def test_coalescing_manager_on_a_group_that_serves_cpu(gloo_ranks):
    gloo_ranks.run(coalescing_manager, True)


def test_coalescing_manager_without_cpu_backend_raises(accelerator_only_ranks):
    for message in accelerator_only_ranks.run(coalescing_manager, False):
        assert message.startswith("offload_shim: torch.distributed.all_reduce got a tensor on cpu")
        assert "The tensor was not modified" in message


@pytest.mark.parametrize("chunk_bytes", [16, 16 << 20], ids=["pipelined", "whole"])
def test_inference_tensors(gloo_ranks, chunk_bytes):
    gloo_ranks.run(inference_tensors, chunk_bytes)


def test_p2p_ops_made_before_install(gloo_ranks):
    gloo_ranks.run(p2p_ops_made_before_install)


def test_batch_handles_wait_their_own_operation(gloo_ranks):
    gloo_ranks.run(batch_handles_wait_their_own_operation)


@pytest.mark.parametrize("chunk_bytes", [16, 16 << 20], ids=["pipelined", "whole"])
def test_tensor_saved_for_backward(gloo_ranks, chunk_bytes):
    gloo_ranks.run(saved_for_backward, chunk_bytes)


def test_async_list_collectives_waited_late(gloo_ranks):
    gloo_ranks.run(async_list_collectives_waited_late)


def check_nested_calls_decide_nothing_again():
    """torch 2.13's all_gather_into_tensor calls all_gather_single, and reduce_scatter_tensor reduce_scatter_single,
    all four wrapped: a call that needs no staging is looked at by the outer wrapper only (the inner one passes the
    call on undecided, one group lookup in all), and its result is torch's; staged, one call is counted, the outer."""
    from unittest import mock

    from offload_shim import _devices

    world, rank = dist.get_world_size(), dist.get_rank()
    calls = {
        "all_gather_into_tensor": lambda: (lambda out: (dist.all_gather_into_tensor(out, torch.ones(2) * rank), out)[1])(
            torch.zeros(2 * world)),
        "reduce_scatter_tensor": lambda: (lambda out: (dist.reduce_scatter_tensor(out, torch.arange(2.0 * world)), out)[1])(
            torch.zeros(2)),
    }
    offload_shim.install()
    looked_up = {}
    for name, call in calls.items():
        with configured(always_stage=False, staging_device=None):
            expected = call()
            with mock.patch.object(_devices, "resolve_c10d_group", wraps=_devices.resolve_c10d_group) as lookup:
                assert torch.equal(call(), expected), name
            looked_up[name] = lookup.call_count
        offload_shim.reset_staging_counters()
        with staging():
            assert torch.equal(call(), expected), name
        assert {key.op for key in offload_shim.staging_counters()} == {f"torch.distributed.{name}"}, name
    nested = hasattr(dist, "all_gather_single")  # (torch 2.13 and newer)
    assert looked_up == dict.fromkeys(calls, 1), (looked_up, nested)


def test_nested_calls_decide_nothing_again(gloo_ranks):
    gloo_ranks.run(check_nested_calls_decide_nothing_again)


def test_the_collectives_that_call_others_are_read_from_torchs_code():
    """A wrapper passes a call on undecided where torch's code of another collective of the table makes it (the
    outer wrapper has decided): torch 2.13's all_gather_into_tensor calls all_gather_single, reduce_scatter_tensor
    reduce_scatter_single; point-to-point functions name each other (send names isend, isend a group's method
    send); no other collective's code names one."""
    from offload_shim import _table, _wrappers

    found = {name: {c.co_name for c in _wrappers._callers(name)} for name in _table.C10D}
    found = {name: callers for name, callers in found.items() if callers}
    nested = ({"all_gather_single": {"all_gather_into_tensor"}, "reduce_scatter_single": {"reduce_scatter_tensor"}}
              if hasattr(dist, "all_gather_single") else {})  # (torch 2.13 and newer)
    point_to_point = {"send", "recv", "isend", "irecv"}
    assert {name: found.get(name) for name in nested} == nested, found
    assert all(name in point_to_point and callers <= point_to_point
               for name, callers in found.items() if name not in nested), found

@pytest.mark.parametrize("wrapt_kind", ["C extension", "pure Python"])
def test_the_caller_of_a_wrapped_function_is_found_with_either_wrapt(wrapt_kind):
    """The nested-call check finds the frame of the wrapped function's caller, whether wrapt's C extension calls the
    wrapper (no frame of its own) or its pure-Python implementation does (one frame more)."""
    import subprocess
    import textwrap

    code = textwrap.dedent("""
        import wrapt
        from offload_shim import _wrappers

        def wrapper(wrapped, instance, args, kwargs):
            return _wrappers._called_from(frozenset({outer.__code__}))

        inner = wrapt.FunctionWrapper(lambda: None, wrapper)

        def outer():
            return inner()

        def elsewhere():
            return inner()

        print(_wrappers._CALLER, outer(), elsewhere(), type(inner).__module__)
    """)
    env = dict(os.environ)
    if wrapt_kind == "pure Python":
        env["WRAPT_DISABLE_EXTENSIONS"] = "1"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    depth, from_outer, from_elsewhere, _ = out.stdout.split()
    assert (depth, from_outer, from_elsewhere) == ("2" if wrapt_kind == "C extension" else "3", "True", "False"), out.stdout
