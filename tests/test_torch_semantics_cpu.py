"""What torch does, the shim does: semantics found broken by adversarial runs and by PyTorch's own distributed
tests, on Gloo ranks with the staging path forced through the CPU (real copies, a real Gloo collective on the
staged tensors). The reference is always the same call left to torch.

* compiled code calling a collective first on a fresh group, shim merely installed or staging forced;
* an ``async_op=True`` call returns without waiting for its peers (two groups used in opposite orders);
* nothing is written from memory no call filled (an input on ``meta``);
* what torch refuses (grad-requiring leaf and inference outputs, non-contiguous tensors) is refused alike, with
  torch's exception and message, before anything moves;
* ``P2POp``s made while installed work after ``uninstall()``; a staged handle answers torch's handle's methods;
* bool reductions are bitwise torch's (Gloo leaves the byte 2 where two ranks sum True).
"""

from __future__ import annotations

import datetime
import os
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import offload_shim
from bitwise import same_bits
from observe import configured
from test_staging_cpu import rank_input, staging_through_cpu

INDUCTOR = os.environ.get("OFFLOAD_SHIM_TEST_INDUCTOR") == "1"


def _group(timeout_s: float = 60):
    """A fresh group of every rank, never used before (its ProcessGroup not seen by the shim yet)."""
    return dist.new_group(list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=timeout_s))


def _unstaged(call, *tensors):
    """``call(*copies)`` left to torch; returns the copies after it."""
    copies = [t.clone() for t in tensors]
    with configured(always_stage=False, staging_device=None):
        call(*copies)
    return copies


# ---------------------------------------------------------------- compiled code on a fresh group

# One function per family, each given (tensor, group) and returning a tensor of what it received, on the tensor's
# device (tests/test_one_gpu.py calls them on accelerator copies for its reference). Dynamo puts some in its graph (all_reduce, the gathers, funcol) and graph-breaks on the others (broadcast, reduce, scatter,
# gather, point-to-point, any async_op=True call), running them as Python.


def _broadcast(t, g):
    dist.broadcast(t, src=0, group=g)
    return t + 1


def _reduce(t, g):
    out = t.clone()
    dist.reduce(out, dst=dist.get_global_rank(g, 0), group=g)
    return (out if g.rank() == 0 else t) + 1  # elsewhere Gloo uses the tensor as scratch; staged, it is unchanged


def _all_reduce(t, g):
    dist.all_reduce(t, group=g)
    return t + 1


def _all_reduce_async(t, g):
    dist.all_reduce(t, group=g, async_op=True).wait()
    return t + 1


def _all_gather_into_tensor(t, g):
    out = t.new_empty(t.numel() * g.size())
    dist.all_gather_into_tensor(out, t, group=g)
    return out + 1


def _all_gather(t, g):
    outs = [torch.empty_like(t) for _ in range(g.size())]
    dist.all_gather(outs, t, group=g)
    return torch.cat(outs) + 1


def _reduce_scatter_tensor(t, g):
    out = t.new_empty(t.numel() // g.size())
    dist.reduce_scatter_tensor(out, t, group=g)
    return out + 1


def _all_to_all_single(t, g):
    out = torch.empty_like(t)
    dist.all_to_all_single(out, t, group=g)
    return out + 1


def _scatter(t, g):
    out = t.new_empty(t.numel() // g.size())
    chunks = list(t.chunk(g.size())) if g.rank() == 0 else None
    dist.scatter(out, chunks, src=dist.get_global_rank(g, 0), group=g)
    return out + 1


def _gather(t, g):
    outs = [torch.empty_like(t) for _ in range(g.size())] if g.rank() == 0 else None
    dist.gather(t, outs, dst=dist.get_global_rank(g, 0), group=g)
    return torch.cat(outs) + 1 if outs else t + 1


def _send_recv(t, g):
    if g.rank() == 0:
        dist.send(t, dst=dist.get_global_rank(g, 1), group=g)
    elif g.rank() == 1:
        dist.recv(t, src=dist.get_global_rank(g, 0), group=g)
    return t + 1


def _batch_isend_irecv(t, g):
    out = torch.empty_like(t)
    right, left = (g.rank() + 1) % g.size(), (g.rank() - 1) % g.size()
    ops = [dist.P2POp(dist.isend, t, group=g, group_peer=right), dist.P2POp(dist.irecv, out, group=g, group_peer=left)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out + 1


def _funcol_all_reduce(t, g):
    return funcol.all_reduce(t, "sum", g) + 1


COMPILED = {f.__name__[1:]: f for f in (
    _broadcast, _reduce, _all_reduce, _all_reduce_async, _all_gather_into_tensor, _all_gather, _reduce_scatter_tensor,
    _all_to_all_single, _scatter, _gather, _send_recv, _batch_isend_irecv, _funcol_all_reduce,
)}
BACKENDS = ["eager", "aot_eager", *(["inductor"] if INDUCTOR else [])]


def check_compiled_first_on_fresh_groups(backend, forced):
    """Each family compiled and called first on a fresh group (another group used eagerly before): the same
    values as torch's own eager call; with staging forced, staged (every call counted by the shim)."""
    offload_shim.install()
    dist.all_reduce(torch.ones(1))  # the default group used eagerly: the fresh groups below are not
    results = {}
    for name, function in COMPILED.items():
        base = rank_input((4 * dist.get_world_size(),), torch.float32, seed=len(name))
        expected = function(base.clone(), _group())  # torch eager, no staging (always_stage is off)
        torch._dynamo.reset()
        compiled = torch.compile(function, backend=backend)
        settings = dict(staging_device="cpu", always_stage=True) if forced else {}
        offload_shim.reset_staging_counters()
        with configured(**settings):
            result = compiled(base.clone(), _group())
        staged = sum(count.calls for count in offload_shim.staging_counters().values())
        assert same_bits(result, expected), (name, result, expected)
        results[name] = staged
    torch._dynamo.reset()
    return results


@pytest.mark.parametrize("forced", [False, True], ids=["installed", "staged"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_first_on_fresh_groups(gloo_ranks, backend, forced):
    for staged in gloo_ranks.run(check_compiled_first_on_fresh_groups, backend, forced):
        if forced:
            assert all(staged.values()), staged  # every family went through the staging path
        else:
            assert not any(staged.values()), staged


# ---------------------------------------------------------------- asynchronous calls never wait for peers


def opposite_orders(x, y, a, b) -> None:
    """Rank 0 posts an async all_reduce of ``x`` on group ``a``, then a sync one of ``y`` on group ``b``; the other
    ranks do ``b``, then ``a``. torch completes both."""
    if dist.get_rank() == 0:
        work = dist.all_reduce(x, group=a, async_op=True)
        dist.all_reduce(y, group=b)
        work.wait()
    else:
        dist.all_reduce(y, group=b)
        dist.all_reduce(x, group=a, async_op=True).wait()


def check_async_call_never_waits_for_peers(numel):
    """Rank 0 posts an async all_reduce on group A, then a sync one on group B; rank 1 does B, then A. torch
    completes both; a staged async call that waited for its peers (its chunks' agreement, a chunk's wait) would
    leave rank 0 inside A while rank 1 waits in B, until the groups' timeout. (The ranks first stage one call on
    each group in the same order: a rank's first staged call on a group waits for its peers' first one there, to
    compare their settings, as NCCL's first call on a group waits for its peers to make the communicator.)"""
    a, b = _group(timeout_s=15), _group(timeout_s=15)
    x, y = rank_input((numel,), torch.float32, seed=21), rank_input((numel,), torch.float32, seed=22)
    expected_x, expected_y = _unstaged(lambda t: dist.all_reduce(t, group=a), x)[0], _unstaged(
        lambda t: dist.all_reduce(t, group=b), y)[0]
    with staging_through_cpu(chunk_bytes=64) as devices:  # 16 float32 a chunk: both calls are pipelined
        for group in (a, b):
            dist.all_reduce(torch.ones(1), group=group)
        devices.clear()
        opposite_orders(x, y, a, b)
    assert devices == ["cpu", "cpu"]
    assert same_bits(x, expected_x) and same_bits(y, expected_y)


@pytest.mark.parametrize("numel", [40, 4096])
def test_async_call_never_waits_for_peers(gloo_ranks, numel):
    gloo_ranks.run(check_async_call_never_waits_for_peers, numel)


# ---------------------------------------------------------------- nothing written that no call filled

META_INPUT_CALLS = {
    "all_gather_into_tensor": lambda out, meta: dist.all_gather_into_tensor(out, meta),
    "reduce_scatter_tensor": lambda out, meta: dist.reduce_scatter_tensor(out[:4], meta),
    "all_to_all_single": lambda out, meta: dist.all_to_all_single(out[:8], meta),
    "all_gather": lambda out, meta: dist.all_gather(list(out.view(2, 8)), meta[:8]),
}


def check_meta_input_writes_nothing():
    """A CPU output with an input on ``meta`` (which holds no data): torch writes nothing; staged, nothing either
    (never the staging buffer's uninitialised memory)."""
    world = dist.get_world_size()
    for name, call in META_INPUT_CALLS.items():
        meta = torch.empty(8 * world, device="meta")
        out = torch.full((16,), 7.0)
        (expected,) = _unstaged(lambda o: call(o, meta), out)
        with staging_through_cpu():
            call(out, meta)
        assert same_bits(out, expected) and torch.equal(out, torch.full((16,), 7.0)), (name, out)


def test_meta_input_writes_nothing(gloo_ranks):
    gloo_ranks.run(check_meta_input_writes_nothing)


# ---------------------------------------------------------------- what torch refuses, refused alike


def _leaf(*shape):
    return torch.zeros(*shape, requires_grad=True)


def _inference(*shape):
    with torch.inference_mode():
        return torch.zeros(*shape)


def _strided(*shape):
    return torch.zeros(*shape, 2)[..., 0]


def _refused_calls(make, group):
    """Calls on ``group`` whose outputs ``make`` builds, and the tensors they write."""
    world, rank = group.size(), group.rank()
    outs = [make(4) for _ in range(world)]
    return {
        "all_gather": (lambda: dist.all_gather(outs, torch.ones(4), group=group), outs),
        "all_gather_into_tensor": (lambda o=make(4 * world): dist.all_gather_into_tensor(o, torch.ones(4), group=group), None),
        "reduce_scatter_tensor": (lambda o=make(4): dist.reduce_scatter_tensor(o, torch.ones(4 * world), group=group), None),
        "reduce_scatter": (lambda o=make(4): dist.reduce_scatter(o, [torch.ones(4)] * world, group=group), None),
        "all_to_all": (lambda: dist.all_to_all(outs, [torch.ones(4)] * world, group=group), outs),
        "all_reduce_coalesced": (lambda: dist.all_reduce_coalesced(outs, group=group), outs),
        "gather": (lambda: dist.gather(torch.ones(4), outs if rank == 0 else None, group_dst=0, group=group), outs),
    }


def _error(call):
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the error is what is compared
        return type(error), str(error)
    return None


def _each_rank_done(key: str) -> None:
    """Wait until every rank has reached ``key``, through the store: a group torch's refusal left half-run (a
    gather's root raised, the others returned) must not carry the next call."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{key}/{dist.get_rank()}", "1")
    store.wait([f"{key}/{r}" for r in range(dist.get_world_size())])


def check_refused_like_torch(kind):
    """Outputs that autograd refuses to write in place (a leaf that requires grad, an inference tensor outside
    inference mode) on every rank: refused by torch's Gloo and by the staged call alike, with torch's exception,
    the outputs unchanged; the staged call refuses when torch's does: after the wire, and for the list
    reduce_scatter before anything is staged (only the gather's root has outputs). Each call on a group of its
    own."""
    make = {"leaf": _leaf, "inference": _inference}[kind]
    refused = {}
    for name in _refused_calls(make, dist.group.WORLD):
        call, _ = _refused_calls(make, _group(timeout_s=10))[name]
        with configured(always_stage=False, staging_device=None):
            refused[name] = _error(call)
        _each_rank_done(f"refused/{kind}/torch/{name}")
    assert refused["all_gather"] is not None and refused["all_gather"][0] is RuntimeError, refused
    for name in refused:
        call, outs = _refused_calls(make, _group(timeout_s=10))[name]
        offload_shim.reset_staging_counters()
        with staging_through_cpu():
            error = _error(call)
        _each_rank_done(f"refused/{kind}/staged/{name}")
        if refused[name] is None:  # (the gather's other ranks: torch wrote nothing there to refuse)
            assert error is None, (name, error)
            continue
        assert bool(offload_shim.staging_counters()) == (name != "reduce_scatter"), name  # staged: the wire ran
        assert error is not None and error[0] is refused[name][0], (name, error, refused[name])
        # Gloo's own copy into a split view words all_gather_into_tensor's differently; torch 2.11's Gloo has
        # no list all_to_all at all ("Backend gloo does not support alltoall"), where the staged call, for a
        # backend that has one, refuses the output as 2.13's Gloo does.
        if name != "all_gather_into_tensor" and "does not support" not in refused[name][1]:
            assert error == refused[name], (name, error, refused[name])
        assert all(torch.equal(o, torch.zeros(4)) for o in outs or []), name


@pytest.mark.parametrize("kind", ["leaf", "inference"])
def test_refused_like_torch(gloo_ranks, kind):
    gloo_ranks.run(check_refused_like_torch, kind)


def _one_rank_refused_calls(make, group, async_op):
    """Calls on ``group`` whose outputs only rank 0 makes with ``make`` (zeros elsewhere): ``name -> (call, the
    tensors it writes)``; each call returns its handle (``async_op``) or ``None``."""
    world, rank = group.size(), group.rank()
    mine = (lambda *shape: make(*shape)) if rank == 0 else (lambda *shape: torch.zeros(*shape))
    outs, flat, one = [mine(4) for _ in range(world)], mine(4 * world), mine(4)
    given = torch.arange(4.0) + rank
    each = [torch.arange(4.0) + 4 * r + rank for r in range(world)]
    kw = {"group": group, "async_op": async_op}
    return {
        "all_gather": (lambda: dist.all_gather(outs, given, **kw), outs),
        "all_gather_into_tensor": (lambda: dist.all_gather_into_tensor(flat, given, **kw), [flat]),
        "reduce_scatter_tensor": (lambda: dist.reduce_scatter_tensor(one, torch.cat(each), **kw), [one]),
        "all_to_all": (lambda: dist.all_to_all(outs, each, **kw), outs),
        "all_reduce_coalesced": (lambda: dist.all_reduce_coalesced(outs, **kw), outs),
        "gather": (lambda: dist.gather(given, outs if rank == 0 else None, group_dst=0, **kw), outs),
    }


def check_refused_after_the_wire_on_one_rank(kind, async_op):
    """Outputs autograd refuses to write on rank 0 only (leaves that require grad, or inference tensors): torch's
    Gloo moves the data, then raises on rank 0 (in wait() for an async call), and the other ranks return with their
    results. Staged through the host, whole and in chunks, the same: every rank takes part
    in the call and returns within seconds, rank 0 raises torch's exception after it with its outputs unchanged, and
    the other ranks' results are torch's (each call on a group of its own, whose 30 s timeout a hang would run into). Not the list
    reduce_scatter: Gloo refuses its output before it sends, and its peers wait, in torch too."""
    make = {"leaf": _leaf, "inference": _inference}[kind]
    answers = {}
    group = _group(timeout_s=30)  # (every call completes on every rank: one group carries them all)
    for staged, chunk_bytes in ((False, None), (True, 1 << 20), (True, 16)):
        for name in _one_rank_refused_calls(make, dist.group.WORLD, async_op):
            call, outs = _one_rank_refused_calls(make, group, async_op)[name]
            settings = ({"staging_device": "cpu", "always_stage": True, "chunk_bytes": chunk_bytes} if staged else
                        {"always_stage": False, "staging_device": None})
            start = time.monotonic()
            with configured(**settings):
                error = _error(lambda: (lambda work: work.wait() if async_op else None)(call()))
            answers[name, chunk_bytes] = (error, [o.tolist() for o in outs], round(time.monotonic() - start))
            _each_rank_done(f"after-wire/{kind}/{async_op}/{chunk_bytes}/{name}")
    differences = []
    for (name, chunk_bytes), (error, outs, seconds) in answers.items():
        expected, expected_outs, _ = answers[name, None]
        if expected is not None and "does not support" in expected[1]:
            continue  # torch 2.11's Gloo has no list all_to_all
        if name == "all_gather_into_tensor" and error is not None and expected is not None:
            error, expected = error[0], expected[0]  # Gloo's copy into its split views words it otherwise
        if error is not None and chunk_bytes:  # staged, the refusing rank's outputs stay as they were (Gloo's own
            # copies may write one of an inference tensor's outputs before refusing the next)
            expected_outs = [[0.0] * len(o) for o in outs]
        if error != expected or outs != expected_outs or seconds > 10:
            differences.append((name, chunk_bytes, error, expected, outs, expected_outs, seconds))
    assert not differences, differences
    if dist.get_rank() == 0:
        assert answers["all_gather", None][0] is not None, answers  # torch raised on rank 0, after the wire
    else:
        assert answers["all_gather", None][0] is None, answers


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kind", ["leaf", "inference"])
def test_refused_after_the_wire_on_one_rank(gloo_ranks, three_gloo_ranks, kind, async_op):
    gloo_ranks.run(check_refused_after_the_wire_on_one_rank, kind, async_op)
    three_gloo_ranks.run(check_refused_after_the_wire_on_one_rank, kind, async_op)


def check_non_contiguous_refused_like_torch():
    """Non-contiguous tensors where torch takes contiguous ones only: all_to_all_single's input, point-to-point
    tensors (send, recv, isend, irecv, batch_isend_irecv)."""
    rank = dist.get_rank()
    calls = {
        "all_to_all_single": lambda: dist.all_to_all_single(torch.zeros(4), _strided(4)),
        "send_recv": lambda: dist.send(_strided(4), 1) if rank == 0 else dist.recv(_strided(4), 0),
        "isend_irecv": lambda: (dist.isend(_strided(4), 1) if rank == 0 else dist.irecv(_strided(4), 0)).wait(),
        "batch_isend_irecv": lambda: dist.batch_isend_irecv([dist.P2POp(
            dist.isend if rank == 0 else dist.irecv, _strided(4), 1 - rank)])[0].wait(),
    }
    for name, call in calls.items():
        with configured(always_stage=False, staging_device=None):
            expected = _error(call)
        assert expected is not None, name
        _each_rank_done(f"non-contiguous/torch/{name}")
        offload_shim.reset_staging_counters()
        with staging_through_cpu():
            assert _error(call) == expected, name
        assert not offload_shim.staging_counters(), name
        _each_rank_done(f"non-contiguous/staged/{name}")


def test_non_contiguous_refused_like_torch(gloo_ranks):
    gloo_ranks.run(check_non_contiguous_refused_like_torch)


def _argued_calls(world: int, rank: int) -> dict:
    """Calls whose arguments torch refuses, or reads in an order only torch's own call keeps, alike on every rank,
    each with the tensors it could write: 40 floats a rank, two chunks or more at ``chunk_bytes=64`` (and a 0-dim
    gather, at 4)."""
    inp = lambda: torch.arange(40.0) + 100 * rank  # noqa: E731
    out = torch.full((world * 40,), 7.0)
    small, wide, doubles, ints = torch.full((30,), 7.0), torch.full((world * 40 + 8,), 7.0), out.double(), out.int()
    rows, t, u, buf = torch.full((world, 40), 7.0), inp(), inp(), torch.arange(40.0 * world) + 1000 * rank
    return {
        "all_gather_into_tensor, output too small": (lambda: dist.all_gather_into_tensor(small, inp()), [small]),
        "all_gather_into_tensor, output too large": (lambda: dist.all_gather_into_tensor(wide, inp()), [wide]),
        "all_gather_into_tensor, float64 output": (lambda: dist.all_gather_into_tensor(doubles, inp()), [doubles]),
        "all_gather_into_tensor, int32 output": (lambda: dist.all_gather_into_tensor(ints, inp()), [ints]),
        "all_gather_into_tensor, one row a rank": (lambda: dist.all_gather_into_tensor(rows, inp()), [rows]),
        "all_gather_into_tensor, no input": (lambda: dist.all_gather_into_tensor(out), [out]),
        "all_gather_into_tensor, a list for the input": (lambda: dist.all_gather_into_tensor(out, [inp()]), [out]),
        "all_gather_into_tensor, a list for the output": (lambda: dist.all_gather_into_tensor([out], inp()), [out]),
        "all_gather_into_tensor, input inside the output off its part": (
            lambda: dist.all_gather_into_tensor(buf, buf[20:60]), [buf]),
        "reduce_scatter_tensor, no input": (lambda: dist.reduce_scatter_tensor(t), [t]),
        "all_to_all_single, no input": (lambda: dist.all_to_all_single(t), [t]),
        "broadcast, src and group_src": (lambda: dist.broadcast(t, src=0, group_src=0), [t]),
        "reduce, dst and group_dst": (lambda: dist.reduce(u, dst=0, group_dst=0), [u]),
        "all_reduce, async_op a string": (lambda: dist.all_reduce(t, async_op="no"), [t]),
        "all_gather, a tensor for the list": (lambda: dist.all_gather(out, inp()), [out]),
        "funcol.all_gather_tensor of a 0-dim tensor": (  # (Gloo refuses it; NCCL gathers it)
            lambda: funcol.wait_tensor(funcol.all_gather_tensor(torch.tensor(1.0 + rank), 0, dist.group.WORLD)), []),
    }


def check_arguments_judged_as_torch_judges(chunk_bytes: int):
    """Each call of :func:`_argued_calls`, staged whole and in chunks: torch's exception and message (objects'
    addresses aside), the same bits written (none, where torch refuses); FSDP's in-place gather still chunked."""
    world, rank = dist.get_world_size(), dist.get_rank()
    outcomes = {}
    for staged in (False, True):
        for name, (call, written) in _argued_calls(world, rank).items():
            if staged:
                with staging_through_cpu(chunk_bytes=chunk_bytes):
                    error = _error(call)
            else:
                with configured(always_stage=False, staging_device=None):
                    error = _error(call)
            error = error and (error[0], re.sub(r" at 0x[0-9a-f]+", "", error[1]))
            outcomes.setdefault(name, []).append((error, [w.view(torch.uint8).tolist() for w in written]))
            _each_rank_done(f"argued/{chunk_bytes}/{staged}/{name}")
    for name, (alone, staged) in outcomes.items():
        assert staged == alone, (name, alone[0], staged[0])
    # (Every call but the overlapping gather refused: a check that the cases test what they say.)
    assert [name for name, (alone, _) in outcomes.items() if alone[0] is None] == [
        "all_gather_into_tensor, input inside the output off its part"]
    # What stays chunked: FSDP's in-place gather, whose input is this rank's own part of the output.
    buf = torch.zeros(40 * world)
    buf[40 * rank : 40 * (rank + 1)] = torch.arange(40.0) + 100 * rank
    offload_shim.reset_staging_counters()
    with staging_through_cpu(chunk_bytes=chunk_bytes):
        dist.all_gather_into_tensor(buf, buf[40 * rank : 40 * (rank + 1)])
    assert torch.equal(buf, torch.cat([torch.arange(40.0) + 100 * r for r in range(world)]))
    assert [key.mode for key in offload_shim.staging_counters()] == ["whole" if chunk_bytes == 16 << 20 else "pipelined"]


@pytest.mark.parametrize("chunk_bytes", [4, 64, 16 << 20], ids=["elements", "chunked", "whole"])
def test_arguments_judged_as_torch_judges(gloo_ranks, chunk_bytes):
    gloo_ranks.run(check_arguments_judged_as_torch_judges, chunk_bytes)


def check_gradients_and_inference_allowed_where_torch_allows():
    """What torch allows stays allowed: an in-place collective on a leaf that requires grad or an inference
    tensor (Gloo writes them in place, unchecked), a gather into leaves under no_grad, into inference outputs
    inside inference mode."""
    tensor = rank_input((4,), torch.float32, seed=31).requires_grad_()
    (expected,) = _unstaged(dist.all_reduce, tensor.detach())
    with staging_through_cpu() as staged:
        dist.all_reduce(tensor)
        outs = [_leaf(4) for _ in range(dist.get_world_size())]
        with torch.no_grad():
            dist.all_gather(outs, tensor.detach())
        inference = [_inference(4) for _ in range(dist.get_world_size())]
        with torch.inference_mode():
            dist.all_gather(inference, tensor.detach())
    assert len(staged) == 3
    assert tensor.is_leaf and tensor.requires_grad and same_bits(tensor.detach(), expected)
    assert all(o.is_leaf and same_bits(o.detach(), i) for o, i in zip(outs, inference))


def test_gradients_and_inference_allowed_where_torch_allows(gloo_ranks):
    gloo_ranks.run(check_gradients_and_inference_allowed_where_torch_allows)


# ---------------------------------------------------------------- objects made while installed, work handles


def check_p2p_ops_made_while_installed_work_after_uninstall():
    """A P2POp holds torch's own isend/irecv, whoever's function it was given: after uninstall() torch's
    batch_isend_irecv still tells its sends from its receives."""
    offload_shim.install()
    rank, world = dist.get_rank(), dist.get_world_size()
    send, recv = torch.full((3,), float(rank)), torch.empty(3)
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
    offload_shim.uninstall()
    try:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    finally:
        offload_shim.install()
    assert torch.equal(recv, torch.full((3,), float((rank - 1) % world)))
    with staging_through_cpu() as staged:  # and made before, used while installed and staged
        recv.zero_()
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    assert staged == ["cpu"] and torch.equal(recv, torch.full((3,), float((rank - 1) % world)))


def test_p2p_ops_made_while_installed_work_after_uninstall(gloo_ranks):
    gloo_ranks.run(check_p2p_ops_made_while_installed_work_after_uninstall)


def _answers(work):
    answers = {}
    for method in ("_source_rank", "source_rank", "_get_op_type", "_get_duration", "is_success", "exception"):
        try:
            answers[method] = getattr(work, method)()
        except Exception as error:  # noqa: BLE001 - torch's error is an answer too
            answers[method] = (type(error), str(error))
    try:
        answers["get_future_result"] = work.get_future_result().wait()
    except Exception as error:  # noqa: BLE001
        answers["get_future_result"] = (type(error), str(error))
    return answers


def check_staged_handle_answers_as_torch():
    """A staged irecv from any source, and its isend, answer torch's handle's methods as torch's own handles do:
    _source_rank() and source_rank() (torch's test_send_recv_any_source), the op type, and the errors Gloo gives."""
    rank = dist.get_rank()
    answers = []
    for staged in (False, True):
        tensor = torch.full((3,), float(rank))
        with configured(staging_device="cpu" if staged else None, always_stage=staged):
            work = dist.isend(tensor, 1) if rank == 0 else dist.irecv(tensor)
            work.wait()
        answers.append(_answers(work))
        if rank == 1:
            assert torch.equal(tensor, torch.zeros(3))
    torch_own, staged = answers
    if isinstance(torch_own["exception"], tuple) and "exception_ptr" in torch_own["exception"][1]:
        # torch 2.11's Work.exception() cannot convert its own return value (a TypeError, whatever happened); a
        # staged handle answers what torch means: no exception.
        torch_own["exception"] = None
    assert torch_own == staged, answers
    return answers[1]["_source_rank"]


def test_staged_handle_answers_as_torch(gloo_ranks):
    sources = gloo_ranks.run(check_staged_handle_answers_as_torch)
    assert sources[1] == 0


def _where(tensor, arguments):
    """Where ``tensor`` lies among the call's ``arguments``: (argument index, byte offset, shape, stride), or its
    shape alone where it is none of them."""
    start = tensor.untyped_storage().data_ptr() + tensor.storage_offset() * tensor.element_size()
    for index, argument in enumerate(arguments):
        base = argument.untyped_storage().data_ptr() + argument.storage_offset() * argument.element_size()
        if base <= start < base + argument.numel() * argument.element_size():
            return index, start - base, tuple(tensor.shape), tensor.stride()
    return "elsewhere", tuple(tensor.shape)


def _handle_answers(call, chunk_bytes, staged):
    """``result()`` and ``get_future().wait()`` of ``call()``'s handle: where each tensor lies and what it holds,
    or the error raised. ``call`` returns its handle and the tensor arguments it was given."""
    answers = {}
    settings = {"staging_device": "cpu", "always_stage": True, "chunk_bytes": chunk_bytes} if staged else {
        "always_stage": False, "staging_device": None}
    for method in ("result", "get_future"):
        with configured(**settings):
            work, arguments = call()
            try:
                tensors = work.get_future().wait() if method == "get_future" else (work.wait(), work.result())[1]
                answers[method] = [(_where(t, arguments), t.tolist()) for t in tensors]
            except Exception as error:  # noqa: BLE001 - torch's error is an answer too
                answers[method] = (type(error), str(error))
            work.wait()
    return answers


def check_handle_results_as_torch():
    """The handle of each asynchronous collective, staged (whole, or in chunks on the pipeline) or not, gives from
    ``result()`` and its future the tensors torch's Gloo handle gives: the same views of the same arguments, the
    same values, or the same error (Gloo's reduce_scatter handles have neither)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n = 64
    mine = lambda: torch.arange(n, dtype=torch.float32) + rank  # noqa: E731

    def args(*tensors):
        return [t for t in tensors if t is not None]

    calls = {
        "all_reduce": lambda: (lambda x: (dist.all_reduce(x, async_op=True), args(x)))(mine()),
        "broadcast": lambda: (lambda x: (dist.broadcast(x, 0, async_op=True), args(x)))(mine()),
        "reduce": lambda: (lambda x: (dist.reduce(x, 0, async_op=True), args(x)))(mine()),
        "all_gather_into_tensor": lambda: (lambda o, x: (dist.all_gather_into_tensor(o, x, async_op=True),
                                                         args(o, x)))(torch.zeros(n * world), mine()),
        "all_gather": lambda: (lambda os, x: (dist.all_gather(os, x, async_op=True), args(*os, x)))(
            [torch.zeros(n) for _ in range(world)], mine()),
        "reduce_scatter_tensor": lambda: (lambda o, x: (dist.reduce_scatter_tensor(o, x, async_op=True),
                                                        args(o, x)))(torch.zeros(n), torch.ones(n * world)),
        "all_to_all_single": lambda: (lambda o, x: (dist.all_to_all_single(o, x, async_op=True), args(o, x)))(
            torch.zeros(n * world), torch.ones(n * world) * rank),
        "gather": lambda: (lambda x, os: (dist.gather(x, os, dst=0, async_op=True), args(x, *(os or []))))(
            mine(), [torch.zeros(n) for _ in range(world)] if rank == 0 else None),
        "scatter": lambda: (lambda o, xs: (dist.scatter(o, xs, src=0, async_op=True), args(o, *(xs or []))))(
            torch.zeros(n), [torch.full((n,), float(r)) for r in range(world)] if rank == 0 else None),
    }
    differences = []  # (asserted once every rank has made every call: a rank that stopped early would hang its peers)
    for name, call in calls.items():
        expected = _handle_answers(call, 1 << 20, staged=False)
        for chunk_bytes in (1 << 20, 64):  # whole, and on the pipeline (chunked where the collective is)
            got = _handle_answers(call, chunk_bytes, staged=True)
            if name == "reduce" and rank != 0:  # Gloo leaves its scratch there; staged, unchanged (as NCCL leaves it)
                got, expected_here = ({m: [w for w, _ in v] for m, v in a.items()} for a in (got, expected))
            else:
                expected_here = expected
            if got != expected_here:
                differences.append((name, chunk_bytes, got, expected_here))
    assert not differences, differences


def test_handle_results_as_torch(gloo_ranks, three_gloo_ranks):
    gloo_ranks.run(check_handle_results_as_torch)
    three_gloo_ranks.run(check_handle_results_as_torch)


def check_functional_results_lazy_as_torch():
    """A functional collective and DTensor's ``redistribute(..., async_op=True)``, staged, return torch's
    ``AsyncCollectiveTensor``, not yet waited (PyTorch's test_dtensor_async_output), and a view of it is one too;
    its values are torch's once waited."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    answers = []
    for staged in (False, True):
        with configured(staging_device="cpu" if staged else None, always_stage=staged):
            reduced = funcol.all_reduce(torch.arange(6.0) + dist.get_rank(), "sum", dist.group.WORLD)
            spread = distribute_tensor(torch.arange(8.0).view(4, 2), mesh, [Shard(0)])
            local = spread.redistribute(mesh, [Replicate()], async_op=True).to_local()
            view = local.view(-1)
            answer = [type(reduced), type(local), local.completed, type(view), local.completed]
            answers.append(answer + [funcol.wait_tensor(reduced).tolist(), funcol.wait_tensor(local).tolist()])
    assert answers[0][:5] == [funcol.AsyncCollectiveTensor, funcol.AsyncCollectiveTensor, False,
                              funcol.AsyncCollectiveTensor, False], answers[0]
    assert answers[1] == answers[0], answers


def test_functional_results_lazy_as_torch(gloo_ranks):
    gloo_ranks.run(check_functional_results_lazy_as_torch)


class _DoneWork(dist.Work):
    def wait(self, timeout=None):
        return True


class _EchoGroup(dist.ProcessGroup):
    """A process group written in Python (as PyTorch's own tests register them) whose all_reduce leaves its tensor
    as it is and records the call."""

    def __init__(self, rank, world, name):
        super().__init__(rank, world)
        self.calls, self._name = [], name

    def allreduce(self, tensors, opts):
        self.calls.append([t.clone() for t in tensors])
        return _DoneWork()

    def getBackendName(self):
        return self._name

    @property
    def group_name(self):
        return self._name

    def _set_group_name(self, name):
        self._name = name


def check_unreadable_backends_passed_through():
    """A group whose backend records no device types (a Python process group registered with ``devices=[]``) goes
    to torch untouched whatever the settings: torch's own error, the tensor unchanged, one log line per group. One
    registered with ``devices=["cpu"]`` is read as serving the host, and its call runs, staged when forced."""
    import logging

    answers, made = {}, {}
    for devices in ([], ["cpu"]):
        name = f"echo_{len(devices)}"

        def create(store, rank, world, timeout, name=name):
            made[name] = _EchoGroup(rank, world, name)
            return made[name]

        dist.Backend.register_backend(name, create, devices=devices)
        group = dist.new_group(list(range(dist.get_world_size())), backend=name)
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("offload_shim").addHandler(handler)
        try:
            for staged in (False, True):
                tensor = torch.arange(3.0)
                with configured(staging_device="cpu" if staged else None, always_stage=staged):
                    for _ in range(2):
                        try:
                            dist.all_reduce(tensor, group=group)
                            answers[name, staged] = ("ran", len(made[name].calls))
                        except RuntimeError as error:
                            answers[name, staged] = (type(error), str(error))
                assert torch.equal(tensor, torch.arange(3.0)), tensor
        finally:
            logging.getLogger("offload_shim").removeHandler(handler)
        passed = [r.getMessage() for r in records if "records no device types" in r.getMessage()]
        assert len(passed) == (0 if devices else 1), passed
    assert answers["echo_0", True] == answers["echo_0", False], answers
    assert answers["echo_0", False][0] is RuntimeError and "No backend type" in answers["echo_0", False][1], answers
    assert answers["echo_1", False] == ("ran", 2) and answers["echo_1", True] == ("ran", 4), answers
    assert torch.equal(made["echo_1"].calls[-1][0], torch.arange(3.0))


def test_unreadable_backends_passed_through(gloo_ranks):
    gloo_ranks.run(check_unreadable_backends_passed_through)


# ---------------------------------------------------------------- bool reductions, bitwise


def check_bool_reductions_bitwise():
    """A bool SUM leaves the backend's byte (2 where two ranks hold True) in place, through every staged path:
    small, whole (async), pipelined, non-contiguous, reduce, coalesced, reduce-scatter, functional. (Gloo's own call
    on a non-contiguous tensor reduces its memory as if it were contiguous: that one's reference is a contiguous
    copy, as in tests/contracts.py.)"""
    world = dist.get_world_size()
    base = torch.ones(64, dtype=torch.bool)
    calls = {
        "small": lambda t: dist.all_reduce(t),
        "async": lambda t: dist.all_reduce(t, async_op=True).wait(),
        "pipelined": lambda t: dist.all_reduce(t),
        "reduce": lambda t: dist.reduce(t, dst=0),
        "coalesced": lambda t: dist.all_reduce_coalesced([t[:32], t[32:]]),
        "reduce_scatter": lambda t: dist.reduce_scatter_tensor(t[: 64 // world], t.clone()),
        "functional": lambda t: t.copy_(funcol.all_reduce(t, "sum", dist.group.WORLD)),
    }
    for name, call in calls.items():
        (expected,) = _unstaged(call, base)
        if name in ("small", "async", "pipelined"):  # (Gloo's coalesced call stores 1: it copies bool to bool)
            assert expected.view(torch.uint8).max() == world, (name, expected.view(torch.uint8))  # not 1
        tensor = base.clone()
        with staging_through_cpu(chunk_bytes=16 if name == "pipelined" else 1 << 20):
            call(tensor)
        if name == "reduce" and dist.get_rank() != 0:  # Gloo's scratch there; staged, unchanged as NCCL leaves it
            expected = base
        assert same_bits(tensor, expected), (name, tensor.view(torch.uint8), expected.view(torch.uint8))
    for chunk_bytes in (16, 1 << 20):  # non-contiguous, pipelined and small: against torch's call on a contiguous copy
        tensor = base.clone()
        (expected,) = _unstaged(dist.all_reduce, tensor[::2].contiguous())
        with staging_through_cpu(chunk_bytes=chunk_bytes):
            dist.all_reduce(tensor[::2])
        assert same_bits(tensor[::2], expected) and same_bits(tensor[1::2], base[1::2]), tensor.view(torch.uint8)


def test_bool_reductions_bitwise(gloo_ranks):
    gloo_ranks.run(check_bool_reductions_bitwise)


FAKE_STORE_GROUP = """
import logging, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import offload_shim
logging.basicConfig(level=logging.WARNING, format="%(message)s")
offload_shim.install()
offload_shim.configure(staging_device="cpu", always_stage=True)
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
tensor = torch.arange(4.0)
for _ in range(2):
    dist.all_reduce(tensor)
print(tensor.tolist(), dict(offload_shim.staging_counters()))
"""


def test_a_group_whose_store_keeps_nothing_goes_to_torch_untouched():
    """PyTorch's tests simulate ranks in one process on a group whose store keeps nothing (FakeStore: "Not
    implemented"): its ranks cannot agree on staging, so even forced staging leaves its calls to torch (the fake
    backend changes nothing), and one log line per group says so."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", FAKE_STORE_GROUP], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "[0.0, 1.0, 2.0, 3.0] {}", run.stdout
    assert run.stderr.count("its store cannot be written (a FakeStore)") == 1, run.stderr[-3000:]


from torch.testing._internal.two_tensor import TwoTensor  # noqa: E402  (torch's own test subclass)


class _CollectivesOnly(torch.Tensor):
    """A tensor whose ``__torch_function__`` handles torch.distributed's collectives (its own answer) and nothing
    else: torch hands it the collective before reading anything of the tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", "").startswith("torch.distributed"):
            return f"{func.__name__} handled by the subclass"
        raise NotImplementedError(f"{func} is not handled")


class _Unwrapping(torch.Tensor):
    """A tensor whose ``__torch_function__`` runs every function on plain tensors (the usual wrapper subclass)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        plain = lambda v: v.as_subclass(torch.Tensor) if isinstance(v, cls) else v  # noqa: E731
        with torch._C.DisableTorchFunctionSubclass():
            return func(*[plain(a) for a in args], **{k: plain(v) for k, v in (kwargs or {}).items()})


class _Recording(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def check_torch_function_overrides():
    """Where torch hands a collective to ``__torch_function__`` (a tensor's type overrides it, or a
    ``TorchFunctionMode`` is active; torch 2.13 does), the shim's wrapper reads nothing of the tensors first and the
    call reaches the override as under torch alone; the override's own call, with plain tensors, is staged as any
    call. Staging forced through the CPU."""
    group = _group()
    rank = dist.get_rank()
    got = {}

    def calls(install):
        offload_shim.install() if install else offload_shim.uninstall()
        only = torch.ones(4).as_subclass(_CollectivesOnly)
        # (only where this torch hands the call on: elsewhere torch itself reads the tensor, which this one refuses)
        answers = {name: call(only) for name, call in {
            "all_reduce": lambda t: dist.all_reduce(t, group=group),
            "broadcast": lambda t: dist.broadcast(t, src=0, group=group),
            "all_gather_into_tensor": lambda t: dist.all_gather_into_tensor(torch.zeros(8), t, group=group),
            "all_gather": lambda t: dist.all_gather([torch.zeros(4), torch.zeros(4)], t, group=group),
            "all_to_all_single": lambda t: dist.all_to_all_single(torch.zeros(4), t, group=group),  # (two tensors)
        }.items() if offload_shim._wrappers._handed(name)}
        unwrapping = torch.full((4,), float(rank + 1)).as_subclass(_Unwrapping)
        dist.all_reduce(unwrapping, group=group)
        answers["unwrapped"] = (type(unwrapping).__name__, unwrapping.as_subclass(torch.Tensor).tolist())
        plain = torch.full((4,), float(rank + 1))
        with _Recording() as mode:
            dist.all_reduce(plain, group=group)
        answers["mode"] = (mode.seen, plain.tolist())
        # Overriding tensors where torch hands nothing on (outputs of gathers: torch looks at the input): decided.
        outs = [torch.zeros(4).as_subclass(_Unwrapping) for _ in range(2)]
        dist.all_gather(outs, torch.full((4,), float(rank + 1)), group=group)
        flat = torch.zeros(8).as_subclass(_Unwrapping)
        dist.all_gather_into_tensor(output_tensor=flat, input_tensor=torch.full((4,), float(rank + 1)), group=group)
        answers["outputs overriding"] = ([o.as_subclass(torch.Tensor).tolist() for o in outs],
                                         flat.as_subclass(torch.Tensor).tolist())
        # A subclass with its own __torch_dispatch__ (its bytes are not its values): never staged, handed to torch
        # (whose dispatch to it runs the collective on each inner tensor; torch waits for the first one only, so
        # only that one's result is compared).
        two = TwoTensor(torch.full((4,), float(rank + 1)), torch.full((4,), 100.0 * (rank + 1)))
        offload_shim.reset_staging_counters()
        dist.all_reduce(two, group=group)
        answers["two tensors"] = (two.a.tolist(), dict(offload_shim.staging_counters()))
        dist.barrier(group=group)
        return answers

    got["torch"] = calls(install=False)
    with staging_through_cpu() as decisions:
        got["shim"] = calls(install=True)
    got["decisions"] = decisions
    return got


def test_torch_function_overrides(gloo_ranks):
    for got in gloo_ranks.run(check_torch_function_overrides):
        if not offload_shim._wrappers._handed("all_reduce"):
            pytest.skip("this torch hands no collective to __torch_function__")
        assert got["shim"] == got["torch"] and got["torch"]["all_reduce"] == "all_reduce handled by the subclass", got
        assert got["torch"]["unwrapped"] == ("_Unwrapping", [3.0] * 4) and got["torch"]["mode"][1] == [3.0] * 4, got
        # Staged: the unwrapped call, the mode's call, the gathers into overriding outputs; never the TwoTensor.
        assert got["decisions"] == ["cpu"] * 4, got
        assert got["torch"]["two tensors"] == ([3.0] * 4, {}), got


def check_overlapping_outputs_refused_before_the_wire():
    """A tensor a staged call writes whose elements share memory (an ``expand``ed view) is refused with torch's
    in-place message before anything is sent, on the ranks that write it (staged, its copy back would raise after
    the collective); read only (a broadcast's source), it is staged. Nothing written, nothing counted."""
    group = _group()
    rank = dist.get_rank()
    got = {}
    with staging_through_cpu(chunk_bytes=16) as decisions:
        for name, call in {
            "all_reduce": lambda t: dist.all_reduce(t, group=group),
            "all_reduce, pipelined": lambda t: dist.all_reduce(t, group=group),
            # (each rank names the other as the source, so each writes: refused on both before any wire)
            "broadcast to it": lambda t: dist.broadcast(t, src=1 - rank, group=group),
            "recv into it": lambda t: dist.recv(t, src=1 - rank, group=group),  # (torch's contiguity check first)
        }.items():
            base = torch.full((1,), float(rank + 1))
            overlapping = base.expand(8 if "pipelined" in name else 3)
            offload_shim.reset_staging_counters()
            got[name] = (_error(lambda: call(overlapping)), base.tolist(), dict(offload_shim.staging_counters()))
        source = torch.full((1,), 5.0).expand(3) if rank == 0 else torch.zeros(3)
        dist.broadcast(source, src=0, group=group)  # rank 0 reads its expanded view; rank 1 writes a plain tensor
        got["broadcast from it"] = source.tolist()
    got["decisions"] = decisions
    return got


def test_overlapping_outputs_refused_before_the_wire(gloo_ranks):
    message = ("unsupported operation: more than one element of the written-to tensor refers to a single memory "
               "location. Please clone() the tensor before performing the operation.")
    for rank, got in enumerate(gloo_ranks.run(check_overlapping_outputs_refused_before_the_wire)):
        for name in ("all_reduce", "all_reduce, pipelined"):
            assert got[name] == ((RuntimeError, message), [float(rank + 1)], {}), (name, got)
        assert got["broadcast to it"] == ((RuntimeError, message), [float(rank + 1)], {}), got
        assert got["recv into it"] == ((RuntimeError, "input tensor has to be contiguous"), [float(rank + 1)], {}), got
        assert got["broadcast from it"] == [5.0] * 3 and got["decisions"] == ["cpu"] * 5, got  # (refused once decided)


def check_dispatch_subclass_refused_where_staging_is_needed():
    """A host tensor of a subclass with its own ``__torch_dispatch__``, on a group that serves only the
    accelerator: refused with StagingError on every rank before anything runs, unchanged."""
    offload_shim.install()
    group = dist.new_group([0, 1], backend="cuda:gloo")
    two = TwoTensor(torch.ones(4), torch.full((4,), 2.0))
    error = _error(lambda: dist.all_reduce(two, group=group))
    return error[0].__name__, "a tensor subclass with a __torch_dispatch__ of its own" in error[1], two.b.tolist()


def test_dispatch_subclass_refused_where_staging_is_needed(gloo_ranks):
    for got in gloo_ranks.run(check_dispatch_subclass_refused_where_staging_is_needed):
        assert got == ("StagingError", True, [2.0] * 4), got
