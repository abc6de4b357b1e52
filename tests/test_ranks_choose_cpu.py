"""Ranks that choose differently, one choice at a time, on Gloo ranks staging through the CPU: the cases that ended
the job before the one plan (one rank async, the other not; one compiled, the other eager; ``full_tensor`` with and
without ``grad_placements``), a chunk size set on one rank only, a rank that stages beside one that does not; an
asynchronous call followed at once by another collective on its group; two threads on two groups in opposite
orders. Each compares with torch's own call (Gloo, unstaged) and, where it says what went over the wire, with the
collectives a recording backend saw (tests/recording.py)."""

from __future__ import annotations

import datetime
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import offload_shim
from offload_shim import _devices
from offload_shim._state import state
import recording
from bitwise import same_bits
from observe import configured, counting_calls, ctrl_c_raising
from test_staging_cpu import rank_input, staging_through_cpu

MiB = 1 << 20


def _group(timeout_s: float = 60):
    return dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))


def _torch(call, tensor):
    """``call(copy)`` of ``tensor`` by torch alone (Gloo serves the CPU): the copy afterwards."""
    copy = tensor.clone()
    with configured(always_stage=False):
        call(copy)
    return copy


# ---------------------------------------------------------------- the rows of the table (chunks of 16 MiB, the default)


def check_async_beside_sync():
    """Row 1: a 32 MiB all_reduce, asynchronous on rank 0, synchronous on the other ranks."""
    group = _group()
    tensor = rank_input((8 * MiB,), torch.float32, seed=1)  # 32 MiB: two chunks
    want = _torch(lambda t: dist.all_reduce(t, group=group), tensor)
    with staging_through_cpu() as decisions:
        if dist.get_rank() == 0:
            work = dist.all_reduce(tensor, group=group, async_op=True)
            assert work.wait() is True
        else:
            dist.all_reduce(tensor, group=group)
    assert decisions == ["cpu"] and same_bits(tensor, want)


def check_async_op_spelt_otherwise():
    """A 4 MiB all_reduce in 1 MiB chunks with ``async_op=1`` on rank 0 (an int, which torch's options take) and
    ``async_op=True`` on the others: torch's result on every rank, in chunks on every rank."""
    group = _group()
    tensor = rank_input((MiB,), torch.float32, seed=11)
    want = _torch(lambda t: dist.all_reduce(t, group=group), tensor)
    offload_shim.reset_staging_counters()
    with staging_through_cpu(chunk_bytes=MiB) as decisions:
        assert dist.all_reduce(tensor, group=group, async_op=1 if dist.get_rank() == 0 else True).wait() is True
    assert [key.mode for key in offload_shim.staging_counters()] == ["pipelined"]
    assert decisions == ["cpu"] and same_bits(tensor, want)


def test_async_op_spelt_otherwise(gloo_ranks):
    gloo_ranks.run(check_async_op_spelt_otherwise)


def check_compiled_or_functional_beside_eager(other: str):
    """Row 2: a 32 MiB all_reduce, compiled or functional on rank 0, eager ``dist.all_reduce`` on the others."""
    group = _group()
    tensor = rank_input((8 * MiB,), torch.float32, seed=2)
    want = _torch(lambda t: dist.all_reduce(t, group=group), tensor)
    with staging_through_cpu() as decisions:
        if dist.get_rank() != 0:
            dist.all_reduce(tensor, group=group)
            got = tensor
        elif other == "functional":
            got = funcol.wait_tensor(funcol.all_reduce(tensor, "sum", group))
        else:
            compiled = torch.compile(lambda t: funcol.all_reduce(t, "sum", group), backend="eager", fullgraph=True)
            got = funcol.wait_tensor(compiled(tensor))
    assert decisions == ["cpu"] and same_bits(got, want)


def check_full_tensor_with_and_without_grad_placements():
    """Row 3: an 8 MiB ``full_tensor()`` on rank 0, ``full_tensor(grad_placements=[Replicate()])`` on the others,
    chunks of 1 MiB (8 chunks); and differentiable, as torch's."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = DeviceMesh.from_group(_group(), "cpu", mesh_dim_names=("row3",))
    full = torch.randn(2 * MiB, generator=torch.Generator().manual_seed(3))  # 8 MiB, the same on every rank
    sharded = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
    kwargs = {} if dist.get_rank() == 0 else {"grad_placements": [Replicate()]}
    with staging_through_cpu(chunk_bytes=MiB) as decisions:
        got = sharded.full_tensor(**kwargs)
    assert decisions == ["cpu"] and same_bits(got.detach(), full)
    got.sum().backward()
    assert same_bits(sharded.grad.to_local(), torch.ones_like(sharded.to_local()))


def test_row_1_async_beside_sync(gloo_ranks):
    gloo_ranks.run(check_async_beside_sync)


@pytest.mark.parametrize("other", ["functional", "compiled"])
def test_row_2_compiled_or_functional_beside_eager(gloo_ranks, other):
    gloo_ranks.run(check_compiled_or_functional_beside_eager, other)


def test_row_3_full_tensor_with_and_without_grad_placements(gloo_ranks):
    gloo_ranks.run(check_full_tensor_with_and_without_grad_placements)


def check_two_tensors_by_position_or_by_keyword():
    """``all_gather_into_tensor`` and ``reduce_scatter_tensor`` given their tensors by position on rank 0 (the
    served path's two-tensor pass) and by keyword on the others (the general pass), staged through the CPU, small
    and in 1 MiB chunks: torch's results on every rank."""
    group, world = _group(), dist.get_world_size()
    results = []
    for elements in (4, 2 * MiB):  # 16 bytes a rank; 8 MiB a rank, 8 chunks
        given = rank_input((elements,), torch.float32, seed=7)
        gathered, scattered = torch.empty(world * elements), torch.empty(elements // world or 1)
        parts = rank_input((world * (elements // world or 1),), torch.float32, seed=8)
        want_gathered = _torch(lambda t: dist.all_gather_into_tensor(t, given, group=group), gathered)
        want_scattered = _torch(lambda t: dist.reduce_scatter_tensor(t, parts, group=group), scattered)
        with staging_through_cpu(chunk_bytes=MiB) as decisions:
            if dist.get_rank() == 0:
                dist.all_gather_into_tensor(gathered, given, group)
                dist.reduce_scatter_tensor(scattered, parts, dist.ReduceOp.SUM, group)
            else:
                dist.all_gather_into_tensor(output_tensor=gathered, input_tensor=given, group=group)
                dist.reduce_scatter_tensor(output=scattered, input=parts, group=group)
        results.append((decisions, same_bits(gathered, want_gathered), same_bits(scattered, want_scattered)))
    return results


def test_two_tensors_by_position_or_by_keyword(gloo_ranks):
    for results in gloo_ranks.run(check_two_tensors_by_position_or_by_keyword):
        assert results == [(["cpu", "cpu"], True, True)] * 2, results


def check_gather_input_inside_its_output_on_one_rank():
    """``all_gather_into_tensor`` in 1 MiB chunks whose input lies inside its output on rank 0 (off its own part,
    and as its own part, FSDP's in-place gather), in a tensor of its own on the others: torch's results on every
    rank, where torch reads the input before writing (the chunks read a copy of it there)."""
    group, world, rank = _group(), dist.get_world_size(), dist.get_rank()
    elements = MiB  # 4 MiB a rank, chunks of 1 MiB
    results = []
    for offset in (elements // 2, rank * elements):  # off its part; its own part
        output = rank_input((world * elements,), torch.float32, seed=9)
        given = output[offset : offset + elements] if rank == 0 else rank_input((elements,), torch.float32, seed=10)
        want = torch.cat([t.clone() for t in _torch_gathered(given, group)])
        with staging_through_cpu(chunk_bytes=MiB) as decisions:
            dist.all_gather_into_tensor(output, given, group=group)
        results.append((decisions, same_bits(output, want)))
    return results


def _torch_gathered(given, group) -> list:
    """Every rank's ``given``, gathered by torch alone (a list gather of copies, unstaged)."""
    parts = [torch.empty_like(given) for _ in range(group.size())]
    with configured(always_stage=False):
        dist.all_gather(parts, given.clone(), group=group)
    return parts


def test_gather_input_inside_its_output_on_one_rank(gloo_ranks, three_gloo_ranks):
    for pool in (gloo_ranks, three_gloo_ranks):
        for results in pool.run(check_gather_input_inside_its_output_on_one_rank):
            assert results == [(["cpu"], True)] * 2, results


@ctrl_c_raising()
def check_ctrl_c_inside_a_pipelined_call(first: bool):
    """Rank 0 gets SIGINT while a 4 MiB all_reduce in 1 MiB chunks runs (during its second chunk; or, ``first``,
    while the ranks compare settings before a group's first call): as after torch's one C++ call, the
    ``KeyboardInterrupt`` comes once every chunk is done, the tensor holds torch's result, and the group's next
    collective pairs with the same one on every rank."""
    import signal

    from offload_shim import _execute, _groups

    group, rank = _group(timeout_s=20), dist.get_rank()
    tensor = rank_input((MiB,), torch.float32, seed=12)
    want = _torch(lambda t: dist.all_reduce(t, group=group), tensor)
    launcher, exchange = _execute._launcher, _groups._exchange

    def interrupting_launcher(chunks, call):
        prepare, issue = launcher(chunks, call)
        issued = []

        def interrupting_issue(prepared):
            issued.append(True)
            if len(issued) == 2:
                signal.raise_signal(signal.SIGINT)
            return issue(prepared)

        return prepare, interrupting_issue

    def interrupting_exchange(*args, **kwargs):
        signal.raise_signal(signal.SIGINT)
        return exchange(*args, **kwargs)

    interrupted = False
    if rank == 0:
        if first:
            _groups._exchange = interrupting_exchange
        else:
            _execute._launcher = interrupting_launcher
    try:
        with staging_through_cpu(chunk_bytes=MiB):
            if not first:
                dist.all_reduce(torch.ones(1), group=group)  # (the settings compared: not part of this case)
            try:
                dist.all_reduce(tensor, group=group)
            except KeyboardInterrupt:
                interrupted = True
            after = torch.full((4,), float(rank + 1))
            dist.all_reduce(after, group=group)
    finally:
        _execute._launcher, _groups._exchange = launcher, exchange
    return interrupted, same_bits(tensor, want), after.tolist()


@pytest.mark.parametrize("first", [False, True], ids=["chunks", "agreement"])
def test_ctrl_c_inside_a_pipelined_call(gloo_ranks, first):
    results = gloo_ranks.run(check_ctrl_c_inside_a_pipelined_call, first)
    assert results == [(True, True, [3.0] * 4), (False, True, [3.0] * 4)], results


@ctrl_c_raising()
def check_ctrl_c_inside_a_staged_call(mode: str):
    """Rank 0 gets SIGINT once the collective of a staged all_reduce is done on it and before its result is copied
    back: a small call (64 bytes), one staged whole (2 MiB, the chunks 4 MiB), or an asynchronous one whose
    ``wait()`` copies back. As after torch's call or wait, the ``KeyboardInterrupt`` comes once the tensor holds
    torch's result, and the group's next collective pairs with the same one on every rank."""
    import signal

    from offload_shim import _staging

    group, rank = _group(timeout_s=20), dist.get_rank()
    tensor = rank_input((16,) if mode == "small" else (MiB // 2,), torch.float32, seed=13)
    want = _torch(lambda t: dist.all_reduce(t, group=group), tensor)
    copy_back, small = _staging.StagedArguments.copy_back, _staging.stage_small_in_place

    def interrupting_copy_back(self):
        signal.raise_signal(signal.SIGINT)
        return copy_back(self)

    def interrupting_small(tensor, device, run, **kwargs):
        def interrupted_run(staged):
            result = run(staged)
            signal.raise_signal(signal.SIGINT)
            return result

        return small(tensor, device, interrupted_run, **kwargs)

    interrupted = False
    try:
        with staging_through_cpu(chunk_bytes=4 * MiB, graphs=False) as devices:
            dist.all_reduce(torch.ones(1), group=group)  # (the settings compared: not part of this case)
            if rank == 0 and mode == "small":
                _staging.stage_small_in_place = interrupting_small
            elif rank == 0:
                _staging.StagedArguments.copy_back = interrupting_copy_back
            try:
                if mode == "wait":
                    work = dist.all_reduce(tensor, group=group, async_op=True)
                    work.wait()
                else:
                    dist.all_reduce(tensor, group=group)
            except KeyboardInterrupt:
                interrupted = True
            finally:
                _staging.StagedArguments.copy_back, _staging.stage_small_in_place = copy_back, small
            after = torch.full((4,), float(rank + 1))
            dist.all_reduce(after, group=group)
    finally:
        _staging.StagedArguments.copy_back, _staging.stage_small_in_place = copy_back, small
    return interrupted, same_bits(tensor, want), after.tolist(), len(devices)


@pytest.mark.parametrize("mode", ["small", "whole", "wait"])
def test_ctrl_c_inside_a_staged_call(gloo_ranks, mode):
    results = gloo_ranks.run(check_ctrl_c_inside_a_staged_call, mode)
    assert results == [(True, True, [3.0] * 4, 3), (False, True, [3.0] * 4, 3)], results


def _ctrl_c_raises() -> bool:
    import signal

    try:
        signal.raise_signal(signal.SIGINT)
        time.sleep(0.01)
    except KeyboardInterrupt:
        return True
    return False


@ctrl_c_raising()
def check_ctrl_c_after_first_calls(case: str):
    """A group's first staged call, in which the ranks agree on their settings first: refused after the agreement
    and before anything is staged (an output whose elements share memory; a non-contiguous ``batch_isend_irecv``
    tensor), or a ``batch_isend_irecv`` that runs (on a group with a CPU and an accelerator backend, where the
    ranks agree before point-to-point calls too). Afterwards SIGINT has the handler it had before, and Ctrl-C
    raises at once, as after torch's call."""
    import signal

    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    rank = dist.get_rank()
    group = _group(timeout_s=20) if case == "refused all_reduce" else dist.new_group(
        backend="cpu:gloo,cuda:fake", timeout=datetime.timedelta(seconds=20))
    before = signal.getsignal(signal.SIGINT)
    peer = 1 - rank
    with staging_through_cpu():
        if case == "refused all_reduce":
            with pytest.raises(RuntimeError, match="more than one element"):
                dist.all_reduce(torch.ones(1).expand(4), group=group)
        else:
            tensor = torch.ones(4, 2).t() if case == "refused batch" else torch.full((4,), float(rank))
            received = torch.zeros(4)
            operations = [dist.P2POp(dist.isend, tensor, peer, group), dist.P2POp(dist.irecv, received, peer, group)]
            if case == "refused batch":
                with pytest.raises(RuntimeError, match="contiguous"):
                    dist.batch_isend_irecv(operations)
            else:
                for work in dist.batch_isend_irecv(operations):
                    work.wait()
                assert received.tolist() == [float(peer)] * 4
    return signal.getsignal(signal.SIGINT) is before, _ctrl_c_raises()


@pytest.mark.parametrize("case", ["refused all_reduce", "refused batch", "batch"])
def test_ctrl_c_after_first_calls(gloo_ranks, case):
    assert gloo_ranks.run(check_ctrl_c_after_first_calls, case) == [(True, True)] * 2


@ctrl_c_raising()
def check_ctrl_c_inside_the_wait_of_a_chunked_call():
    """Rank 0 gets SIGINT while it waits for an asynchronous 4 MiB all_reduce in 1 MiB chunks, which rank 1 joins only
    once the signal is sent: the ``KeyboardInterrupt`` comes once the tensor holds torch's result, as after torch's
    wait()."""
    import signal

    group, rank = _group(timeout_s=60), dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    tensor = rank_input((MiB,), torch.float32, seed=14)
    want = _torch(lambda t: dist.all_reduce(t, group=group), tensor)
    interrupted = None
    with staging_through_cpu(chunk_bytes=MiB):
        dist.all_reduce(torch.ones(1), group=group)  # (the settings compared: not part of this case)
        if rank == 1:
            store.wait(["sigint sent"])
        work = dist.all_reduce(tensor, group=group, async_op=True)
        if rank == 0:
            main = threading.main_thread().ident  # (to the main thread, whose wait the signal interrupts)

            def interrupt():
                signal.pthread_kill(main, signal.SIGINT)
                store.set("sigint sent", "1")

            threading.Timer(2.0, interrupt).start()  # (ample for the main thread to be inside wait() by then)
        try:
            work.wait()
        except KeyboardInterrupt:
            interrupted = same_bits(tensor, want)  # (what the caller sees there: the result, written)
        after = torch.full((4,), float(rank + 1))
        dist.all_reduce(after, group=group)
    if rank == 0:
        store.delete_key("sigint sent")
    return interrupted, same_bits(tensor, want), after.tolist()


def test_ctrl_c_inside_the_wait_of_a_chunked_call(gloo_ranks):
    results = gloo_ranks.run(check_ctrl_c_inside_the_wait_of_a_chunked_call)
    assert results == [(True, True, [3.0] * 4), (None, True, [3.0] * 4)], results


@ctrl_c_raising()
def check_sigint_handler_set_inside_a_staged_call():
    """Code that runs inside a staged call (another signal's handler, in torch's call run after it) and sets a SIGINT
    handler keeps it after the call; code that reads the handler there and puts it back after the call keeps
    Ctrl-C working."""
    import signal

    from offload_shim import _staging

    group = _group(timeout_s=20)
    copy_back = _staging.StagedArguments.copy_back
    seen = []

    def mine(signum, frame):
        seen.append(signum)

    def setting_copy_back(self):
        seen.append(signal.getsignal(signal.SIGINT))
        signal.signal(signal.SIGINT, mine)
        return copy_back(self)

    before = signal.getsignal(signal.SIGINT)
    try:
        with staging_through_cpu(chunk_bytes=4 * MiB):
            dist.all_reduce(torch.ones(1), group=group)  # (the settings compared: not part of this case)
            _staging.StagedArguments.copy_back = setting_copy_back
            dist.all_reduce(torch.ones(MiB // 2), group=group)
            _staging.StagedArguments.copy_back = copy_back
        kept = signal.getsignal(signal.SIGINT) is mine
        signal.raise_signal(signal.SIGINT)
        time.sleep(0.01)
        signal.signal(signal.SIGINT, seen[0])  # what the call's code read, put back
        raises = _ctrl_c_raises()
    finally:
        _staging.StagedArguments.copy_back = copy_back
        signal.signal(signal.SIGINT, before)
    return kept, seen[1:], raises


def test_sigint_handler_set_inside_a_staged_call(gloo_ranks):
    assert gloo_ranks.run(check_sigint_handler_set_inside_a_staged_call) == [(True, [2], True)] * 2


def sigint_handler() -> str:
    """This rank's SIGINT handler, by name (``SIG_IGN``, ``SIG_DFL``, or the function's)."""
    import signal

    handler = signal.getsignal(signal.SIGINT)
    return getattr(handler, "name", None) or getattr(handler, "__name__", repr(handler))


def check_ignored_sigint_stays_ignored(ignore: bool):
    """With SIGINT ignored (``ignore``: set here; else as the rank started), a SIGINT at each step of a group's first
    staged call (the agreement), of a pipelined call's second chunk, of a call staged whole (its copy back) and
    of an asynchronous call's ``wait()``: the shim never turns it into a ``KeyboardInterrupt``, never puts a handler
    of its own in (each step sees ``SIG_IGN``), holds nothing back afterwards, and every result is torch's. Returns
    the handlers seen, and afterwards."""
    import signal

    from offload_shim import _execute, _groups, _staging

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if ignore else None
    group, seen = _group(timeout_s=20), []
    tensor = rank_input((MiB,), torch.float32, seed=15)
    want = _torch(lambda t: dist.all_reduce(t, group=group), tensor)
    launcher, exchange, copy_back = _execute._launcher, _groups._exchange, _staging.StagedArguments.copy_back

    def interrupt():
        seen.append(sigint_handler())
        signal.raise_signal(signal.SIGINT)

    def interrupting_exchange(*args, **kwargs):
        interrupt()
        return exchange(*args, **kwargs)

    def interrupting_launcher(chunks, call):
        prepare, issue = launcher(chunks, call)

        def interrupting_issue(prepared):
            interrupt()
            return issue(prepared)

        return prepare, interrupting_issue

    def interrupting_copy_back(self):
        interrupt()
        return copy_back(self)

    _groups._exchange, _execute._launcher = interrupting_exchange, interrupting_launcher
    _staging.StagedArguments.copy_back = interrupting_copy_back
    try:
        with staging_through_cpu(chunk_bytes=MiB, graphs=False):
            results = []
            for how in ("chunked", "whole", "wait"):
                given = tensor.clone() if how != "whole" else tensor[: MiB // 8].clone()
                work = dist.all_reduce(given, group=group, async_op=how == "wait")
                if work is not None:
                    work.wait()
                results.append(same_bits(given, want if how != "whole" else want[: MiB // 8]))
            time.sleep(0.01)  # (a pending handler would run by now)
        held = bool(state.sigint_held or state.sigint_caught)
    finally:
        _groups._exchange, _execute._launcher, _staging.StagedArguments.copy_back = exchange, launcher, copy_back
        after = sigint_handler()
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return sorted(set(seen)), len(seen) > 3, after, held, results


def test_ignored_sigint_stays_ignored(gloo_ranks):
    """A process that ignores SIGINT (a background job's) keeps ignoring it through staged calls."""
    assert gloo_ranks.run(check_ignored_sigint_stays_ignored, True) == [
        (["SIG_IGN"], True, "SIG_IGN", False, [True] * 3)] * 2


def test_ctrl_c_cases_with_sigint_ignored_from_the_start():
    """Ranks started the way a background job starts them (``python -m pytest > log 2>&1 &``, ``nohup``): SIGINT
    ignored in the process that spawns them, so ignored from their start. The Ctrl-C cases still pass (they set
    the handler they need), and the shim keeps the ignored SIGINT ignored."""
    import signal

    from ranks import RankPool

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        pool = RankPool(world_size=2, backend="gloo")
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        assert pool.run(sigint_handler) == ["SIG_IGN"] * 2  # (inherited: else this test tells nothing)
        results = pool.run(check_ctrl_c_inside_a_pipelined_call, False)
        assert results == [(True, True, [3.0] * 4), (False, True, [3.0] * 4)], results
        assert pool.run(check_ctrl_c_inside_a_staged_call, "wait")[0][:2] == (True, True)
        assert pool.run(sigint_handler) == ["SIG_IGN"] * 2  # (put back after each case)
        assert pool.run(check_ignored_sigint_stays_ignored, False) == [
            (["SIG_IGN"], True, "SIG_IGN", False, [True] * 3)] * 2
    finally:
        pool.close()


def check_chunk_size_on_one_rank():
    """Row 4: a chunk size of 1 MiB on rank 0, the default on the others, at their first staged call on a group:
    the same clear error on every rank, before anything is sent; returns the error and how long it took."""
    group = _group(timeout_s=120)
    tensor = rank_input((8 * MiB,), torch.float32, seed=4)
    before = tensor.clone()
    settings = {"chunk_bytes": MiB} if dist.get_rank() == 0 else {}
    start = time.monotonic()
    with staging_through_cpu(**settings), pytest.raises(offload_shim.StagingError) as raised:
        dist.all_reduce(tensor, group=group)
    assert same_bits(tensor, before)
    return str(raised.value), time.monotonic() - start


@pytest.mark.parametrize("world", [2, 3])
def test_row_4_chunk_size_on_one_rank(gloo_ranks, three_gloo_ranks, world):
    results = (gloo_ranks if world == 2 else three_gloo_ranks).run(check_chunk_size_on_one_rank)
    messages = {message for message, _ in results}
    assert len(messages) == 1, messages  # the same error on every rank
    (message,) = messages
    assert "disagree on chunk sizes (OFFLOAD_SHIM_CHUNK_BYTES)" in message and "rank 0: chunk sizes" in message
    # Within seconds: the ranks meet at their agreement, far inside the group's timeout of two minutes.
    assert all(seconds < 60 for _, seconds in results), results


# Row 5: one rank stages, its peer does not. Each rank prints what it ended with; a result only where it is torch's.
ROW_5 = """
import datetime, os, sys, torch, torch.distributed as dist
import offload_shim
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
rank = dist.get_rank()
group = dist.new_group(timeout=datetime.timedelta(seconds=8))
offload_shim.configure(staging_device="cpu", chunk_bytes=1 << 20)
def values():
    return torch.arange(1 << 20, dtype=torch.float32) + rank  # 4 MiB: four chunks where staged
want = sum(torch.arange(1 << 20, dtype=torch.float32) + r for r in range(2))
if sys.argv[1] == "later":  # both stage a first call on the group (their agreement), then rank 0 alone stages
    offload_shim.configure(always_stage=True)
    dist.all_reduce(torch.ones(4), group=group)
offload_shim.configure(always_stage=rank == 0)
tensor = values()
try:
    dist.all_reduce(tensor, group=group)
except Exception as error:
    print(f"rank {rank}: raised {type(error).__name__}: {str(error)[:200]}", flush=True)
    os._exit(0)
print(f"rank {rank}: " + ("torch's result" if torch.equal(tensor, want) else "a WRONG result"), flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("when", ["first", "later"])
def test_row_5_one_rank_stages_beside_one_that_does_not(tmp_path, when):
    """Row 5, outside the contract (docs/reference.md): rank 0 stages its all_reduce in chunks, rank 1 hands the
    same call to torch. No rank ends with a wrong result: at the group's first staged call, rank 0 waits for rank
    1's agreement until the group's timeout and raises; later, Gloo refuses the collectives that do not match."""
    script = tmp_path / "row5.py"
    script.write_text(textwrap.dedent(ROW_5))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script), when],
        capture_output=True, text=True, timeout=240,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("rank ")]
    assert "WRONG" not in done.stdout, done.stdout + done.stderr
    assert not any(line.endswith("torch's result") for line in lines if line.startswith("rank 0")), lines
    if when == "first":
        assert any("rank 0: raised StagingError" in line and "did not compare staging settings" in line for line in lines), lines


# ---------------------------------------------------------------- an async call, then at once another collective


def check_async_then_another_collective():
    """An asynchronous chunked all_reduce, and at once a synchronous broadcast and a small all_reduce on the same
    group, before the first is waited: every rank's collectives reach the backend in the order the program made
    them (recorded below the shim), and every result is torch's."""
    group = recording.new_group()
    rank = group.rank()
    first = rank_input((1000,), torch.int32, seed=5).float()  # small integers: exact sums in any order
    second = rank_input((300,), torch.float64, seed=6)
    third = rank_input((3,), torch.int64, seed=7)
    want = [_torch(lambda t: dist.all_reduce(t, group=group), first),
            _torch(lambda t: dist.broadcast(t, group_src=1, group=group), second),
            _torch(lambda t: dist.all_reduce(t, group=group), third)]
    recording.take(group)
    with staging_through_cpu(chunk_bytes=256):
        work = dist.all_reduce(first, group=group, async_op=True)
        dist.broadcast(second, group_src=1, group=group)
        dist.all_reduce(third, group=group)
        work.wait()
    assert same_bits(first, want[0]) and same_bits(second, want[1]) and same_bits(third, want[2])
    records = recording.take(group)
    # The first call's agreement and 16 chunks of 64 float32, the second's agreement and 10 chunks of 256 bytes
    # (2400 bytes: a broadcast moves bytes), then the third, whole.
    agreement = ("allreduce", (8,), "torch.int64", "RedOpType.MAX")
    expected = [agreement, *[("allreduce", (64,), "torch.float32", "RedOpType.SUM")] * 15,
                ("allreduce", (40,), "torch.float32", "RedOpType.SUM"),
                agreement, *[("broadcast", (256,), 1)] * 9, ("broadcast", (96,), 1),
                ("allreduce", (3,), "torch.int64", "RedOpType.SUM")]
    assert records == expected, records
    dist.destroy_process_group(group)
    return records


@pytest.mark.parametrize("world", [2, 3])
def test_async_call_keeps_its_place_in_the_groups_order(gloo_ranks, three_gloo_ranks, world):
    (gloo_ranks if world == 2 else three_gloo_ranks).run(check_async_then_another_collective)


# ---------------------------------------------------------------- two threads, two groups, opposite orders


def check_two_threads_two_groups_opposite_orders(through_cpu: bool = True):
    """Two threads of each rank pipeline pageable tensors (64 MiB and 4 bytes, in chunks of 32 MiB: host copies on
    the group's copy lanes, each split over the copy threads) on two groups; rank 0 starts on group A and rank 1 on
    group B, the other thread following once the first is under way: both complete. (Through the CPU a copy lane's
    copy never waits for a peer, its events being complete at once: what a lane shared by two groups would block on
    shows on an accelerator, tests/test_one_gpu.py's test of the same through ``cuda:gloo``.)"""
    groups = [_group(), _group()]
    errors, results = [], {}
    chunk = 32 * MiB
    offload_shim.install()
    with staging_through_cpu(chunk_bytes=chunk) if through_cpu else configured(chunk_bytes=chunk):
        for group in groups:  # the ranks' first staged call on each group, in one order: their agreement
            dist.all_reduce(torch.ones(1), group=group)

        def worker(index):
            try:
                for step in range(2):
                    tensor = torch.full((16 * MiB + 1,), float(dist.get_rank() + index + step))
                    dist.all_reduce(tensor, group=groups[index])
                    results[index, step] = bool((tensor == 2 * (index + step) + 1).all())
            except BaseException as error:  # reported below
                errors.append(error)

        order = [0, 1] if dist.get_rank() == 0 else [1, 0]
        threads = [threading.Thread(target=worker, args=(index,)) for index in order]
        threads[0].start()
        time.sleep(0.2)
        threads[1].start()
        for thread in threads:
            thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "the threads blocked each other"
    assert not errors and len(results) == 4 and all(results.values()), (errors, results)
    from offload_shim import _staging

    return _staging.copy_threads(), state.copy_pool is not None


def test_two_threads_on_two_groups_in_opposite_orders(gloo_ranks):
    for threads, split in gloo_ranks.run(check_two_threads_two_groups_opposite_orders):
        assert split == (threads > 1), (threads, split)  # the copy threads were in use wherever there are two CPUs


def check_small_host_calls_on_a_two_backend_group(thresholds):
    """A group with a CPU backend and an accelerator backend (Gloo, and PyTorch's fake backend for CUDA: no CUDA
    here, so nothing can be routed): its first host call is decided (the ranks agree on the settings), later calls
    smaller than the routing threshold go to Gloo without deciding again, until the settings change; ranks whose
    thresholds differ get the agreement's error at the first call, on every rank, as before."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    from offload_shim import _plan

    offload_shim.install()
    rank = dist.get_rank()
    group = dist.new_group(backend="cpu:gloo,cuda:fake")
    answers = {}
    with configured(route_min_bytes=thresholds[rank]):
        with counting_calls(_plan, "decide") as decided:
            try:
                tensor = torch.full((4,), float(rank + 1))
                dist.all_reduce(tensor, group=group)
            except offload_shim.StagingError as error:
                return {"error": str(error).split(" (")[0]}
            answers["first"] = (len(decided), tensor.tolist())
            for _ in range(3):
                tensor = torch.full((4,), float(rank + 1))
                dist.all_reduce(tensor, group=group)
            # Above the threshold, but no rank can route (no CUDA): the agreement says no size is routed.
            large = torch.full((thresholds[rank] // 4 + 1,), float(rank + 1))
            dist.all_reduce(large, group=group)
            answers["later"] = (len(decided), tensor.tolist(), same_bits(large, torch.full_like(large, 3.0)))
        with configured(chunk_bytes="1MiB"), counting_calls(_plan, "decide") as decided:  # other settings: decided
            dist.all_reduce(tensor, group=group)
            dist.all_reduce(tensor, group=group)
            answers["after configure"] = (len(decided), tensor.tolist())
    dist.destroy_process_group(group)
    return answers


def test_small_host_calls_on_a_two_backend_group_decide_once(gloo_ranks):
    for answers in gloo_ranks.run(check_small_host_calls_on_a_two_backend_group, (64, 64)):
        assert answers == {"first": (1, [3.0] * 4), "later": (1, [3.0] * 4, True),
                           "after configure": (1, [12.0] * 4)}, answers


def test_small_host_calls_on_a_two_backend_group_when_ranks_differ(gloo_ranks):
    errors = gloo_ranks.run(check_small_host_calls_on_a_two_backend_group, (64, 128))
    assert errors[0] == errors[1] and "disagree on routing thresholds" in errors[0]["error"], errors


def check_answer_dropped_with_its_agreement():
    """The served path's answer on a group with a CPU and an accelerator backend is found from the ranks' agreement:
    when the ranks agree again (here: on the other answer to whether every rank can route, as a call through another
    path could), the answer goes with the agreement it came from, and the next host call is decided again; an answer
    found from an agreement already replaced is never kept. Where the ranks can route (a machine with an
    accelerator), the answer is the routing threshold; where none can, every size."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    from offload_shim import _config, _groups, _plan

    offload_shim.install()
    group = dist.new_group(backend="cpu:gloo,cuda:fake")
    tensor = torch.ones(4)
    seen = {}
    with counting_calls(_plan, "decide") as decided:
        dist.all_reduce(tensor, group=group)
        dist.all_reduce(tensor, group=group)
        first = _devices.record(group).agreement
        answer = _config.settings().route_min_bytes if first.route else float("inf")
        seen["kept"] = (len(decided), _devices.record(group).below == answer)
        again = _groups.agree(group, _config.settings(), None, "test", can_route=not first.route)  # every rank alike
        seen["replaced"] = (again is not first, _devices.record(group).below is not None)
        _groups.keep_answer(group, _config.settings(), 64, first)  # found from the agreement replaced
        seen["stale kept"] = _devices.record(group).below is not None
        dist.all_reduce(tensor, group=group)  # decided: agrees again (as at first) and keeps its answer
        dist.all_reduce(tensor, group=group)
        seen["again"] = (len(decided), _devices.record(group).below == answer, tensor.tolist())
    dist.destroy_process_group(group)
    seen["destroyed"] = _devices.record(group).below is not None
    return seen


def test_answer_dropped_with_its_agreement(gloo_ranks):
    for seen in gloo_ranks.run(check_answer_dropped_with_its_agreement):
        assert seen == {"kept": (1, True), "replaced": (True, False), "stale kept": False,
                        "again": (2, True, [16.0] * 4), "destroyed": False}, seen


def check_answer_not_kept_past_a_configure():
    """configure() in another thread while a call keeps its group's answer, after the call checked its settings
    were in force: the answer kept under the old settings is dropped with them, never left for later calls (a rank
    that kept it would send to Gloo what its peers, under the new settings, stage)."""
    from offload_shim import _config, _groups

    offload_shim.install()
    group = dist.new_group(backend="gloo")
    torch_groups = _groups._torch_groups
    changed = threading.Event()

    def configure_meanwhile():  # (called by keep_answer once it has checked the settings)
        thread = threading.Thread(target=lambda: (_config.configure(always_stage=True), changed.set()))
        thread.start()
        time.sleep(0.2)  # the other thread changes the settings now, and waits to drop the answers
        return torch_groups()

    seen = {}
    with configured(staging_device="cpu", always_stage=False):
        _groups._torch_groups = configure_meanwhile
        try:
            dist.all_reduce(torch.ones(4), group=group)  # finds and keeps the group's answer: every size
        finally:
            _groups._torch_groups = torch_groups
        assert changed.wait(10)
        seen["kept"] = _devices.record(group).below is not None
        offload_shim.reset_staging_counters()
        tensor = torch.ones(4)
        dist.all_reduce(tensor, group=group)  # under the other thread's settings: staged (forced), as every rank
        seen["after"] = ([(key.route, count.calls) for key, count in offload_shim.staging_counters().items()],
                         tensor.tolist())
    dist.destroy_process_group(group)
    return seen


def test_answer_not_kept_past_a_configure(gloo_ranks):
    for seen in gloo_ranks.run(check_answer_not_kept_past_a_configure):
        assert seen == {"kept": False, "after": ([("forced", 1)], [2.0] * 4)}, seen


def check_answers_of_groups_torch_destroyed():
    """A group destroyed by torch while the shim was not installed, or while a call was keeping its answer, is not
    kept alive by the served path's answers: installing again drops those of groups torch no longer has, and an
    answer found for a group torch has destroyed meanwhile is not kept."""
    import gc
    import weakref

    from offload_shim import _config, _groups

    offload_shim.install()
    group = dist.new_group(backend="gloo")
    dist.all_reduce(torch.ones(4), group=group)
    seen = {"kept": _devices.record(group).below is not None}
    offload_shim.uninstall()
    dist.destroy_process_group(group)  # torch's own, the shim not installed
    offload_shim.install()
    seen["after install"] = _devices.record(group).below is not None
    ref = weakref.ref(group)
    del group
    gc.collect()
    seen["let go"] = ref() is None
    dist.barrier()  # (every rank's old group freed before the next is made: Gloo closes its pairs as it frees them)
    other = dist.new_group(backend="gloo")
    dist.destroy_process_group(other)
    _groups.keep_answer(other, _config.settings(), float("inf"))  # found before the destroy, kept after it
    seen["kept after destroy"] = _devices.record(other).below is not None
    return seen


def test_answers_of_groups_torch_destroyed(gloo_ranks):
    for seen in gloo_ranks.run(check_answers_of_groups_torch_destroyed):
        assert seen == {"kept": True, "after install": False, "let go": True, "kept after destroy": False}, seen


def check_point_to_point_on_a_two_backend_group_waits_for_its_peer_only():
    """A send on a group with a CPU and an accelerator backend waits for its receiver only, as torch's does: never
    routed, it asks no agreement of the group's other ranks (here the receiver is in a barrier first)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    offload_shim.install()
    rank = dist.get_rank()
    group = dist.new_group(backend="cpu:gloo,cuda:fake", timeout=datetime.timedelta(seconds=60))
    start = time.monotonic()
    if rank == 0:
        work = dist.isend(torch.full((4,), 7.0), dst=1, group=group)
        dist.barrier()
        work.wait()
        got = None
    else:
        dist.barrier()
        got = torch.zeros(4)
        dist.recv(got, src=0, group=group)
        got = got.tolist()
    seconds = time.monotonic() - start
    dist.destroy_process_group(group)
    return got, seconds


def test_point_to_point_on_a_two_backend_group_waits_for_its_peer_only(gloo_ranks):
    (_, sent), (got, received) = gloo_ranks.run(check_point_to_point_on_a_two_backend_group_waits_for_its_peer_only)
    assert got == [7.0] * 4 and max(sent, received) < 30, (got, sent, received)


# ---------------------------------------------------------------- forced staging where only some ranks can stage


def check_forced_staging_where_some_ranks_cannot():
    """Staging forced on every rank of a plain Gloo group, a staging device on rank 0 alone: a chunked call's wire
    depends on every rank staging it, so every rank raises the same StagingError at once (not after the group's
    timeout, rank 0 waiting for an agreement its peer never makes), the tensor unchanged; with a device on no rank,
    every rank runs torch's own call."""
    group = _group(timeout_s=30)
    offload_shim.install()
    tensor = torch.ones(1 << 16)
    seen = {}
    with configured(always_stage=True, chunk_bytes="64KiB", staging_device="cpu" if dist.get_rank() == 0 else None):
        start = time.monotonic()
        try:
            dist.all_reduce(tensor, group=group)
        except offload_shim.StagingError as error:
            seen["error"] = ("rank 1 of the group:" in str(error), "rank 0 of the group" not in str(error))
        seen["seconds"] = time.monotonic() - start < 10
        seen["unchanged"] = torch.equal(tensor, torch.ones(1 << 16))
    other = _group(timeout_s=30)  # (a new group: a rank whose own ability changes agrees again alone)
    with configured(always_stage=True, chunk_bytes="64KiB", staging_device=None):
        dist.all_reduce(tensor, group=other)  # no rank can stage: torch's call on every rank
        seen["torch's"] = torch.equal(tensor, torch.full((1 << 16,), float(other.size())))
    dist.destroy_process_group(group)
    dist.destroy_process_group(other)
    return seen


def test_forced_staging_where_some_ranks_cannot(gloo_ranks):
    for seen in gloo_ranks.run(check_forced_staging_where_some_ranks_cannot):
        assert seen == {"error": (True, True), "seconds": True, "unchanged": True, "torch's": True}, seen


class _CountingStore:
    """A client of a real ``TCPStore`` that counts the operations it sends, besides polls of the arrival counter."""

    def __init__(self, store):
        self.store, self.operations = store, 0

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args):
            polled = name == "add" and args[1] == 0 and args[0].endswith("/arrived")
            self.operations += not polled
            return method(*args)

        return counted


def _agree_as_threads(server, size: int, fingerprints: list, prefix: str):
    """``_groups._exchange`` of ``size`` simulated ranks over one store server, a thread and a client each: each
    rank's agreement or error, and the operations it sent besides its polls."""
    from offload_shim import _groups

    stores = [_CountingStore(dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", server.port, is_master=False)))
              for _ in range(size)]
    outcomes = [None] * size

    def rank(each):
        try:
            outcomes[each] = _groups._exchange(stores[each], each, size, datetime.timedelta(seconds=60), "simulated",
                                               fingerprints[each], None, "all_reduce")
        except Exception as error:  # noqa: BLE001
            outcomes[each] = error

    threads = [threading.Thread(target=rank, args=(each,)) for each in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes, [store.operations for store in stores]


def test_the_agreement_sends_as_many_store_operations_at_any_size():
    """The ranks' agreement sends the same store operations a rank (five, besides its polls for the others) at 4
    and at 32 simulated ranks; a group made again over the same store (its second agreement) compares afresh: one
    rank that differs there is found, not hidden by the first agreement's answers. The design before read every
    rank's key at every poll, and a new group's first agreement reused the number of the group it replaced."""
    from offload_shim import StagingError, _groups

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mine = (_groups.WIRE_VERSION, 16 * MiB, False, MiB, True, None, True)
    counts = {}
    for size in (4, 32):
        outcomes, operations = _agree_as_threads(server, size, [mine] * size, f"size{size}/")
        assert all(isinstance(o, _groups._Agreement) and o.route and not o.unable for o in outcomes), outcomes
        counts[size] = set(operations)
    assert counts == {4: {5}, 32: {5}}, counts
    other = (_groups.WIRE_VERSION, 8 * MiB, False, MiB, True, None, True)
    outcomes, _ = _agree_as_threads(server, 4, [mine, mine, other, mine], "size4/")  # the same store again
    messages = {str(o) for o in outcomes}
    assert all(isinstance(o, StagingError) for o in outcomes) and len(messages) == 1, outcomes
    assert "rank 2: chunk sizes (OFFLOAD_SHIM_CHUNK_BYTES) 8388608;" in messages.pop()
