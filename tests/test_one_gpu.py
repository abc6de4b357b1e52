"""GPU tests that one accelerator can run (../shared/reference/one-gpu.md): compiled code and asynchronous calls
staged for real through the accelerator.

* One rank on a NCCL-only group (``init_process_group("nccl")``, one process): a CPU tensor on any collective
  fails in torch there, so every compiled family, called first on a fresh group, is staged through the GPU; its
  result must equal torch's own call on a GPU copy, bit for bit.
* Two ranks sharing the one GPU on a ``cuda:gloo`` group (it serves only CUDA, as NCCL does): an asynchronous
  call never waits for its peers, pinned and pageable, at pipelined sizes; the compiled families Gloo serves on
  CUDA (not point-to-point: Gloo's CUDA send ends the job).
* Two ranks sharing the GPU on a plain Gloo group: CUDA tensors on what Gloo has no CUDA path for
  (point-to-point, the functional all_gather) go through the host and equal staging by hand; the rest stays
  untouched.

* One rank on a NCCL-only group: asynchronous pipelined calls, each followed at once by a sync collective on the
  same group.
* One rank on a NCCL-only group: small calls replayed from a captured CUDA graph, and pageable storages registered
  under a cap, equal to torch's call on a GPU copy, bit for bit.
* One rank on a NCCL-only group: CPU outputs autograd would refuse (leaves requiring grad, inference tensors) are
  written, as NCCL writes them; an async handle's result() is NCCL's, the output itself.

Run: ``python -m pytest -o addopts="" -m gpu tests/test_one_gpu.py`` (skipped without an accelerator).
"""

from __future__ import annotations

import datetime
import logging
import time
import weakref

import pytest
import torch
import torch.distributed as dist

import offload_shim
from offload_shim._state import state
from bitwise import same_bits
from conftest import accelerator_rank_pool
from observe import configured, counting_calls, ctrl_c_raising, rss_bytes
from ranks import RankPool
from test_fork_cpu import run_fork_script
from test_torch_semantics_cpu import COMPILED, opposite_orders

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.accelerator.is_available(), reason="needs an accelerator"),
]
POINT_TO_POINT = {"send_recv", "batch_isend_irecv"}
C10D = "torch.distributed."
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
    with configured(chunk_bytes=1 << 16):  # both calls are pipelined: numel * 4 bytes is several chunks
        for group in (a, b):  # the ranks' first staged call on each group, in one order: their agreement
            dist.all_reduce(torch.ones(1), group=group)
        offload_shim.reset_staging_counters()
        opposite_orders(x, y, a, b)
    counts = {key.mode: count.calls for key, count in offload_shim.staging_counters().items()}
    assert counts == {"pipelined": 2}, counts  # asynchronous or not, the same chunks
    assert same_bits(x, expected[0]) and same_bits(y, expected[1])


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_async_call_never_waits_for_peers_one_gpu(shared_gpu_ranks, pinned):
    shared_gpu_ranks.run(check_async_call_never_waits_for_peers, 1 << 20, pinned)


def _difference(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """How ``actual`` differs from ``expected``: which elements, how many, the first one's values."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return f"{actual.dtype} {tuple(actual.shape)} against {expected.dtype} {tuple(expected.shape)}"
    wrong = (actual.reshape(-1) != expected.reshape(-1)).nonzero().reshape(-1)
    if not wrong.numel():
        return "same values, other bits"
    first = int(wrong[0])
    return (f"{wrong.numel()} of {actual.numel()} elements differ, indices {first} to {int(wrong[-1])}; "
            f"at {first}: {actual.reshape(-1)[first].item()} against {expected.reshape(-1)[first].item()}")


def check_async_on_a_stream_ordered_backend(pinned, graphs=True):
    """On NCCL (its work handles order the GPU's streams, where Gloo's block the host): asynchronous calls of every
    chunked kind, pinned or pageable, contiguous or not, each followed at once by a sync collective on the same
    group; after ``wait()`` each holds the exact result, bit for bit, written in place."""
    group = _fresh_group()
    world = dist.get_world_size()
    numel = 3 * (1 << 16) + 5  # several chunks of 64 KiB and a short last one

    def host(values):
        values = values.pin_memory() if pinned else values
        return values

    offload_shim.install()
    with configured(chunk_bytes=1 << 16, graphs=graphs):
        dist.all_reduce(torch.ones(1), group=group)  # the group's agreement
        offload_shim.reset_staging_counters()
        contiguous = host(torch.arange(numel, dtype=torch.float32) * 0.5)
        strided = host(torch.arange(2 * numel, dtype=torch.float64)).view(numel, 2)[:, 1]  # not contiguous
        sent = torch.arange(numel, dtype=torch.int32).pin_memory()  # pinned into pageable: D2H through a landing
        gathered = host(torch.full((numel,), -1, dtype=torch.int32))
        # Pre-multiplied sums, so that one rank's result differs from its input; exact in floating point here
        # (small integers and halves times 3 or 2). Not torch's own call on a GPU copy: with NCCL 2.28.9 on one rank
        # that call leaves the last 5 of these 196613 elements unmultiplied (results/gpu/, 2026-12-02, round 1),
        # where each chunk's call, of its own size, multiplies them.
        expected = [contiguous * 3.0 * world, strided * 2.0 * world, sent.repeat(world)]
        flag = torch.ones(1)
        works = [dist.all_reduce(contiguous, op=dist._make_nccl_premul_sum(3.0), async_op=True, group=group)]
        dist.all_reduce(flag, group=group)  # at once, on the same group: after the async call's collectives
        works.append(dist.all_reduce(strided, op=dist._make_nccl_premul_sum(2.0), async_op=True, group=group))
        works.append(dist.all_gather_into_tensor(gathered, sent, async_op=True, group=group))
        dist.broadcast(flag, group_src=0, group=group)
        for work in works:
            work.wait()
        assert [result is contiguous for result in works[0].result()] == [True]
    for name, actual, wanted in (("contiguous", contiguous, expected[0]), ("strided", strided, expected[1]),
                                 ("gathered", gathered, expected[2])):
        assert same_bits(actual, wanted), f"{name}: {_difference(actual, wanted)}"
    assert flag.item() == dist.get_world_size() ** 2
    assert not same_bits(contiguous, torch.arange(numel, dtype=torch.float32) * 0.5)  # written
    assert strided.is_contiguous() is False and contiguous.is_pinned() is pinned
    pipelined = {key.op: count.calls for key, count in offload_shim.staging_counters().items()
                 if key.mode == "pipelined"}
    assert pipelined == {"torch.distributed.all_reduce": 2, "torch.distributed.all_gather_into_tensor": 1}, pipelined


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "no-graphs"])
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_async_on_a_stream_ordered_backend_one_rank(nccl_rank, pinned, graphs):
    nccl_rank.run(check_async_on_a_stream_ordered_backend, pinned, graphs)


def check_dropped_handle_writes_on_a_stream_ordered_backend(pinned):
    """On NCCL: an asynchronous call whose handle is dropped unwaited still writes its exact result, staged whole
    (3 elements) or pipelined (several chunks), as NCCL writes a dropped handle's call: in the background (polled),
    and before a later staged call on the same memory reads it. Pre-multiplied sums, so that one rank's result
    differs from its input (exact: small integers times 3 and 2)."""
    group = _fresh_group()
    world = dist.get_world_size()
    offload_shim.install()
    with configured(chunk_bytes=1 << 16):
        dist.all_reduce(torch.ones(1), group=group)  # the group's agreement
        for numel in (3, 3 * (1 << 14) + 5):
            tensor = torch.arange(numel, dtype=torch.float32) + 1
            tensor = tensor.pin_memory() if pinned else tensor
            expected = tensor * 3.0 * world
            dist.all_reduce(tensor, op=dist._make_nccl_premul_sum(3.0), group=group, async_op=True)  # dropped at once
            deadline = time.monotonic() + 60
            while not same_bits(tensor, expected) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert same_bits(tensor, expected), f"{numel}: {_difference(tensor, expected)}"
            expected = tensor * 6.0 * world * world
            dist.all_reduce(tensor, op=dist._make_nccl_premul_sum(3.0), group=group, async_op=True)
            dist.all_reduce(tensor, op=dist._make_nccl_premul_sum(2.0), group=group)  # reads the dropped call's
            assert same_bits(tensor, expected), f"{numel}: {_difference(tensor, expected)}"


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_dropped_handle_writes_one_rank(nccl_rank, pinned):
    nccl_rank.run(check_dropped_handle_writes_on_a_stream_ordered_backend, pinned)


def test_two_threads_on_two_groups_in_opposite_orders_one_gpu(shared_gpu_ranks):
    """Two threads of each rank pipeline pageable tensors on two groups in opposite orders, through the GPU: the
    copy lanes' copies wait on real events there, which wait on the group's peers; the lanes of one group never
    hold up another's."""
    from test_ranks_choose_cpu import check_two_threads_two_groups_opposite_orders

    shared_gpu_ranks.run(check_two_threads_two_groups_opposite_orders, False)


# ---------------------------------------------------------------- accelerator tensors through the host


@pytest.fixture(scope="module")
def gloo_ranks_on_gpu():
    """Two ranks sharing the accelerator, of a plain Gloo group (serves the host, and CUDA for some collectives)."""
    pool = RankPool(world_size=2, backend="gloo", timeout=300)
    yield pool
    pool.close()


def _by_hand(call, *tensors):
    """``call`` on host copies of accelerator ``tensors``, the results copied back: staging by hand."""
    hosts = [t.cpu() for t in tensors]
    result = call(*hosts)
    for tensor, host in zip(tensors, hosts):
        tensor.copy_(host)
    return result


def check_accelerator_tensors_through_host():
    """On a Gloo group, accelerator tensors on calls Gloo has no path for on them (point-to-point, the functional
    all_gather) go through the host and equal staging by hand; the calls Gloo serves on them stay untouched."""
    import torch.distributed._functional_collectives as funcol

    offload_shim.install()  # host staging is on by default
    device, rank, world = _accelerator(), dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    value = torch.arange(6.0, device=device) + 10 * rank

    def ring(send, receive):
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, receive, left)]):
            work.wait()

    def send_recv(send, receive):
        if rank % 2:
            dist.recv(receive, left), dist.send(send, right)
        else:
            dist.send(send, right), dist.recv(receive, left)

    def isend_irecv(send, receive):
        works = [dist.isend(send, right), dist.irecv(receive, left)]
        for work in works:
            work.wait()

    offload_shim.reset_staging_counters()
    results = {}
    for name, call in (("batch_isend_irecv", ring), ("send_recv", send_recv), ("isend_irecv", isend_irecv)):
        expected, received = value.clone(), torch.zeros(6, device=device)
        _by_hand(call, expected, received)
        staged = torch.zeros(6, device=device)
        call(value, staged)
        torch.accelerator.synchronize()
        assert staged.device == device and same_bits(staged, received), (name, staged, received)
        assert same_bits(received.cpu(), torch.arange(6.0) + 10 * left)
        results[name] = True
    gathered = funcol.all_gather_tensor(value, 0, dist.group.WORLD)
    expected = _by_hand(lambda v: funcol.all_gather_tensor(v, 0, dist.group.WORLD).wait(), value.clone()).to(device)
    assert gathered.device == device and same_bits(gathered, expected)
    routes = {(key.op.rpartition(".")[2], key.route) for key in offload_shim.staging_counters()}
    assert routes == {("batch_isend_irecv", "host"), ("send", "host"), ("recv", "host"), ("isend", "host"),
                      ("irecv", "host"), ("all_gather_tensor", "host")}, routes
    # A group with no backend for CUDA (cpu:gloo, as Gloo is for XPU, NPU, MPS): torch refuses, and the call goes
    # through the host, in place, listed and functional.
    offload_shim.reset_staging_counters()
    host_only = dist.new_group(list(range(world)), backend="cpu:gloo")
    reduced, gathered_in_place = value.clone(), torch.zeros(6 * world, device=device)
    dist.all_reduce(reduced, group=host_only)
    dist.all_gather_into_tensor(gathered_in_place, value, group=host_only)
    functional = funcol.all_reduce(value, "sum", host_only)
    torch.accelerator.synchronize()
    total = sum(torch.arange(6.0) + 10 * r for r in range(world))
    assert reduced.device == device and same_bits(reduced.cpu(), total)
    assert same_bits(functional.cpu(), total) and functional.device == device
    assert same_bits(gathered_in_place.cpu(), torch.cat([torch.arange(6.0) + 10 * r for r in range(world)]))
    routes = {(key.op, key.route) for key in offload_shim.staging_counters()}
    assert routes == {(C10D + "all_reduce", "host"), (C10D + "all_gather_into_tensor", "host"),
                      (C10D + "_functional_collectives.all_reduce", "host")}, routes
    # Served by Gloo on CUDA: untouched.
    offload_shim.reset_staging_counters()
    reduced = value.clone()
    dist.all_reduce(reduced)
    dist.broadcast(reduced, src=0)
    assert same_bits(reduced.cpu(), sum(torch.arange(6.0) + 10 * r for r in range(world)))
    assert offload_shim.staging_counters() == {}, offload_shim.staging_counters()


def test_accelerator_tensors_through_host(gloo_ranks_on_gpu):
    gloo_ranks_on_gpu.run(check_accelerator_tensors_through_host)


# ---------------------------------------------------------------- small calls replayed, pageable memory registered


def _modes(op):
    return {key.mode: count.calls for key, count in offload_shim.staging_counters().items() if key.op == C10D + op}


def check_small_calls_replayed():
    """On a one-rank NCCL group: small synchronous calls are staged through the slot once, then captured and
    replayed; every call's result equals torch's call on a GPU copy, bit for bit, with fresh values each call, in
    the caller's own tensor (same storage, version counter untouched); a call that only reads leaves the tensor as
    it was; a captured call is decided again where what decided it may have changed, and calls a key cannot tell
    apart are not replayed; graphs off, a non-contiguous tensor and a destroyed group take the slot path; a replay
    that outlasts the group's timeout raises DistBackendError and leaves the tensor unchanged, as does the call
    after a replay that only read; destroying a group does not wait for its replays; a wrapper kept across
    uninstall() never replays."""
    from offload_shim import _replay

    offload_shim.install()
    device = _accelerator()
    generator = torch.Generator().manual_seed(5)
    cases = {
        "all_reduce fp32 0-dim SUM": ("all_reduce", (), torch.float32, {"op": dist.ReduceOp.SUM}),
        "all_reduce int8 MIN": ("all_reduce", (1,), torch.int8, {"op": dist.ReduceOp.MIN}),
        "all_reduce bool MAX": ("all_reduce", (5,), torch.bool, {"op": dist.ReduceOp.MAX}),
        "broadcast fp32 from 0": ("broadcast", (3,), torch.float32, {"src": 0}),
        "reduce bf16 to 0": ("reduce", (2, 5), torch.bfloat16, {"dst": 0}),
    }
    for label, (op, shape, dtype, kwargs) in cases.items():
        offload_shim.reset_staging_counters()
        tensor = torch.empty(shape, dtype=dtype)
        storage, version = tensor.data_ptr(), tensor._version
        for call in range(5):
            fresh = (torch.rand(shape, generator=generator) * 100).to(dtype)
            tensor.copy_(fresh)
            expected = fresh.to(device)
            getattr(dist, op)(expected, **kwargs)
            getattr(dist, op)(tensor, **kwargs)
            assert same_bits(tensor, expected.cpu()), (label, call, tensor, expected)
        assert tensor.data_ptr() == storage and tensor._version == version + 5, label  # only the five copy_() calls
        assert _modes(op) == {"small": 1, "replayed": 4}, (label, _modes(op))
    # A capture copies at the address of the call's own tensor, whichever it is: fresh tensors, tensors in turn, views
    # at an offset into one buffer (one capture for all: the same dtype and size in bytes). A one-rank reduction
    # returns its input, so each tensor keeps the values it was given, and every byte beside the views stays zero.
    offload_shim.reset_staging_counters()
    buffer = torch.zeros(12)
    turns = [torch.empty(3), torch.empty(3), buffer[3:6], buffer[7:10]]
    given = {}
    for call in range(12):
        tensor = torch.empty(3) if call % 3 == 0 else turns[call % 4]
        tensor.copy_(torch.rand(3, generator=generator) * 100 + 1)
        given[id(tensor)] = (tensor, tensor.clone())
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        for kept, values in given.values():
            assert same_bits(kept, values), (call, kept, values)
    assert buffer[:3].eq(0).all() and buffer[6] == 0 and buffer[10:].eq(0).all(), buffer
    assert _modes("all_reduce") == {"small": 1, "replayed": 11}, _modes("all_reduce")
    # A captured key replays before any decision while what decided it holds, and is decided again where it does
    # not: inside a coalescing manager (refused, as any CPU tensor on this group), with INFO logging (a new call
    # site's first call is logged), under changed settings (decided once, then replayed again).
    _check_replay_decided_again(device)
    # Graphs off, a non-contiguous tensor: the slot path.
    offload_shim.reset_staging_counters()
    with configured(graphs=False):
        for _ in range(3):
            dist.all_reduce(torch.ones(2))
    strided = torch.ones(4, 2)[:, 0]
    for _ in range(3):
        dist.all_reduce(strided)
    assert _modes("all_reduce") == {"small": 6}, _modes("all_reduce")
    # A group's captures go with it; the default group's stay and replay.
    group = _fresh_group()
    before = _replay.captures()
    for _ in range(3):
        dist.all_reduce(torch.ones(()), group=group)
    assert _replay.captures() == before + 1
    dist.destroy_process_group(group)
    assert _replay.captures() == before
    offload_shim.reset_staging_counters()
    value = torch.tensor(7.0)
    dist.all_reduce(value, op=dist.ReduceOp.SUM)  # the key of the first case above
    assert value.item() == 7.0 and _modes("all_reduce") == {"replayed": 1}, _modes("all_reduce")
    # A wrapper kept across uninstall() never replays that capture: torch's own call, which refuses a CPU tensor
    # on this group.
    kept = dist.all_reduce
    offload_shim.uninstall()
    try:
        offload_shim.reset_staging_counters()
        with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
            kept(torch.tensor(7.0), op=dist.ReduceOp.SUM)
        assert _modes("all_reduce") == {}, _modes("all_reduce")
    finally:
        offload_shim.install()
    # A replay that outlasts the group's timeout (the stream held by a 4 s sleep, a 1 s timeout).
    slow = dist.new_group([0], timeout=datetime.timedelta(seconds=1))
    assert _replay._timeout(slow) == 1.0, _replay._timeout(slow)  # else the wait below would last minutes
    flag = torch.tensor([3.0])
    for _ in range(2):
        dist.all_reduce(flag, group=slow)
    flag.fill_(4.0)
    torch.cuda._sleep(int(8e9))  # clock cycles: 4 s at 2 GHz
    with pytest.raises(dist.DistBackendError, match="did not finish within the group's timeout"):
        dist.all_reduce(flag, group=slow)
    assert flag.item() == 4.0  # unchanged
    torch.accelerator.synchronize()
    dist.all_reduce(flag, group=slow)
    assert flag.item() == 4.0
    # A replay that only reads returns at once; the next call of its key waits for it at most the timeout too.
    source = torch.tensor([5.0])
    for _ in range(3):
        dist.broadcast(source, src=0, group=slow)
    torch.cuda._sleep(int(8e9))
    dist.broadcast(source, src=0, group=slow)  # queued behind the sleep, not waited for
    with pytest.raises(dist.DistBackendError, match="did not finish within the group's timeout"):
        dist.broadcast(source, src=0, group=slow)
    torch.accelerator.synchronize()
    dist.broadcast(source, src=0, group=slow)
    assert source.item() == 5.0
    # Dropping a group's captures (as destroy_process_group does first) while a replay is still queued returns
    # without waiting for it; the capture's buffers are kept until the replay is done.
    torch.cuda._sleep(int(2e9))
    dist.broadcast(source, src=0, group=slow)
    start = time.monotonic()
    _replay.forget(slow)
    assert time.monotonic() - start < 0.5 and state.retired_captures, time.monotonic() - start
    torch.accelerator.synchronize()
    dist.destroy_process_group(slow)


@ctrl_c_raising()
def check_ctrl_c_during_a_replay():
    """A Ctrl-C while a replayed all_reduce waits for its graph (queued behind a 2 s GPU sleep): the
    ``KeyboardInterrupt`` comes once the caller's tensor holds the result, as after torch's one C++ call. The tensor
    is overwritten after its bytes went in, so only the replay's copy back restores the result; the key replays
    again after."""
    import signal
    import threading

    offload_shim.install()
    group = _fresh_group()
    tensor = torch.tensor([3.0])
    for _ in range(2):  # staged, then captured
        dist.all_reduce(tensor, group=group)
    offload_shim.reset_staging_counters()
    main = threading.main_thread().ident

    def interrupt():
        tensor.fill_(9.0)  # (the replay copied 3.0 in already; its result, 3.0, is to be written back)
        signal.pthread_kill(main, signal.SIGINT)

    torch.cuda._sleep(int(4e9))  # clock cycles: 2 s at 2 GHz
    timer = threading.Timer(0.5, interrupt)
    timer.start()
    interrupted = None
    try:
        dist.all_reduce(tensor, group=group)
        time.sleep(5)  # (if the call returned first, the interrupt lands here, after the 9.0)
    except KeyboardInterrupt:
        interrupted = tensor.item()
    timer.join()
    assert interrupted == 3.0 and _modes("all_reduce") == {"replayed": 1}, (interrupted, _modes("all_reduce"))
    dist.all_reduce(tensor, group=group)
    assert tensor.item() == 3.0 and _modes("all_reduce") == {"replayed": 2}, _modes("all_reduce")
    dist.destroy_process_group(group)


def test_ctrl_c_during_a_replay(nccl_rank):
    nccl_rank.run(check_ctrl_c_during_a_replay)


def _check_replay_decided_again(device):
    import logging

    from torch.distributed.distributed_c10d import _coalescing_manager

    value = torch.tensor([1.5, -2.0])
    for _ in range(3):  # captured
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    offload_shim.reset_staging_counters()
    try:
        with pytest.raises(offload_shim.StagingError, match="inside torch.distributed's _coalescing_manager"):
            with _coalescing_manager():
                dist.all_reduce(value, op=dist.ReduceOp.MAX)
    finally:  # an exception inside the block leaves torch's coalescing state behind
        dist.distributed_c10d._world.pg_coalesce_state.pop(dist.group.WORLD, None)
    assert value.tolist() == [1.5, -2.0] and _modes("all_reduce") == {}, _modes("all_reduce")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("offload_shim")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        dist.all_reduce(value, op=dist.ReduceOp.MAX)  # a call site of its own
    finally:
        logger.setLevel(level)
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records if "first staged call" in r.getMessage()], [r.getMessage() for r in records]
    assert _modes("all_reduce") == {"replayed": 1}, _modes("all_reduce")
    with configured(chunk_bytes="8MiB"):
        for _ in range(2):
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
    assert _modes("all_reduce") == {"replayed": 3}, _modes("all_reduce")
    keyword = torch.tensor([4.0, 5.0])
    for _ in range(3):  # the tensor as a keyword: a key of its own, captured and replayed alike
        dist.all_reduce(tensor=keyword, op=dist.ReduceOp.SUM)
    assert keyword.tolist() == [4.0, 5.0] and _modes("all_reduce") == {"replayed": 5, "small": 1}, _modes("all_reduce")
    # What a key cannot tell apart is never replayed: PREMUL_SUM ops of other factors compare equal (each call takes
    # the slot path, with its own factor); a lazily negated view has the bytes of its base (slot path: the values);
    # an argument equal to the captured one but of another type is refused by torch as without a capture.
    offload_shim.reset_staging_counters()
    for factor in (2.0, 2.0, 2.0, 3.0):
        scaled = torch.tensor([1.5, -2.0])
        dist.all_reduce(scaled, op=dist._make_nccl_premul_sum(factor))
        assert scaled.tolist() == [1.5 * factor, -2.0 * factor], (factor, scaled)
    negated = torch._neg_view(torch.tensor([1.5, -2.0]))
    for _ in range(3):
        dist.all_reduce(negated, op=dist.ReduceOp.MAX)
        assert negated.tolist() == [-1.5, 2.0] and negated.is_neg(), negated
    assert _modes("all_reduce") == {"small": 7}, _modes("all_reduce")
    with pytest.raises(TypeError):
        dist.all_reduce(value, op=0)  # equal to ReduceOp.SUM
    # A call whose other arguments are the very objects of a replayed call's finds its capture by their identity:
    # each reduce op keeps a capture of its own; the group given by position (where the op goes) is another call,
    # refused as torch refuses it; shapes of one size in bytes share a capture (the same bytes move).
    from offload_shim import _replay

    before = _replay.captures()
    offload_shim.reset_staging_counters()
    flags = torch.tensor([2, 7], dtype=torch.int32)
    for _ in range(3):
        for op in (dist.ReduceOp.MIN, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT):
            dist.all_reduce(flags, op=op)
            assert flags.tolist() == [2, 7], (op, flags)
    assert _replay.captures() == before + 3 and _modes("all_reduce") == {"small": 3, "replayed": 6}, (
        _replay.captures() - before, _modes("all_reduce"))
    world = dist.group.WORLD
    for _ in range(3):
        dist.all_reduce(flags, group=world)
    with pytest.raises(Exception) as theirs:
        dist.all_reduce(flags.to(device), world)
    for _ in range(3):
        with pytest.raises(type(theirs.value)):
            dist.all_reduce(flags, world)
    assert flags.tolist() == [2, 7]
    offload_shim.reset_staging_counters()
    before = _replay.captures()
    for shape in ((2, 3), (3, 2), (6,)):
        values = torch.arange(6, dtype=torch.float32).reshape(shape)
        for _ in range(3):
            dist.all_reduce(values)
            assert values.shape == shape and values.flatten().tolist() == list(range(6)), values
    assert _replay.captures() == before + 1 and _modes("all_reduce") == {"small": 1, "replayed": 8}, (
        _replay.captures() - before, _modes("all_reduce"))


def test_small_calls_replayed(nccl_rank):
    nccl_rank.run(check_small_calls_replayed)


def check_pageable_memory_registered():
    """With a registration cap, a pageable tensor is registered at its second pipelined call and staged as pinned
    memory after that, with results equal to torch's call on a GPU copy; a registration that does not fit makes
    room by unregistering the least recently staged; a storage whose last tensor goes is kept, registered, until the
    next pipelined call unregisters it and lets it go; a registration that fails leaves the call on the bounce path
    and no CUDA error behind; nothing is unregistered during a CUDA graph capture, the first safe point after it
    does."""
    from offload_shim import _registration

    offload_shim.install()
    device = _accelerator()
    generator = torch.Generator().manual_seed(6)

    def check(tensor):
        fresh = torch.randn(tensor.shape, generator=generator)
        tensor.copy_(fresh)
        expected = fresh.to(device)
        dist.all_reduce(expected)
        dist.all_reduce(tensor)
        assert same_bits(tensor, expected.cpu())

    with configured(register_bytes="36MiB", chunk_bytes="1MiB"):
        first = torch.empty(8 << 18)  # 8 MiB: pipelined in 1 MiB chunks
        check(first)
        registration = lambda: (first.is_pinned(), _registration.registered_bytes(), dict(state.registered))  # noqa: E731
        assert registration()[:2] == (False, 0), registration()
        check(first)
        assert registration()[:2] == (True, 8 << 20), registration()
        check(first)
        second = torch.empty(8 << 20)  # 32 MiB: fits only once the first is unregistered
        check(second)
        check(second)
        assert second.is_pinned() and not first.is_pinned() and _registration.registered_bytes() == 32 << 20
        check(second)
        storage = weakref.ref(second.untyped_storage())
        del second  # its last tensor gone: kept, registered, until the next pipelined call
        assert storage() is not None and _registration.registered_bytes() == 32 << 20
        # Its last page registered by someone else: the shim's registration fails, the call takes the bounce path.
        third = torch.empty(4 << 18)
        last_page = third.data_ptr() + third.nbytes - 4096
        assert int(torch.cuda.cudart().cudaHostRegister(last_page, 4096, 0)) == 0
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("offload_shim").addHandler(handler)
        try:
            assert not third.is_pinned()
            for _ in range(3):
                check(third)
            assert _registration.registered_bytes() == 0 and storage() is None
            failures = [r.getMessage() for r in records if "cudaHostRegister failed" in r.getMessage()]
            assert len(failures) == 1 and records[0].levelno == logging.WARNING, failures
            torch.ones(4, device=device).add_(1)  # no stale CUDA error reported by torch's launch check
            torch.accelerator.synchronize()
        finally:
            logging.getLogger("offload_shim").removeHandler(handler)
            torch.cuda.cudart().cudaHostUnregister(last_page)
        check(first)
        check(first)
        assert first.is_pinned()
    with configured(register_bytes=0, chunk_bytes="1MiB"):  # the cap lowered: unregistered at the next pipelined call
        check(first)
        assert not first.is_pinned() and _registration.registered_bytes() == 0
    with configured(register_bytes="36MiB", chunk_bytes="1MiB"):  # freed while a graph is captured: unregistered after
        check(first)
        check(first)
        assert first.is_pinned()
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        with torch.cuda.stream(side):
            scratch = torch.zeros(4, device=device)
            with torch.cuda.graph(graph, stream=side):
                scratch.add_(1)
                del first
                _registration.drain()  # a safe point during the capture does nothing (waiting would end it)
                assert _registration.registered_bytes() == 8 << 20, "unregistered during the capture"
        _registration.drain()
        assert _registration.registered_bytes() == 0
        graph.replay()
        torch.accelerator.synchronize()
        assert scratch.tolist() == [1.0] * 4


def test_pageable_memory_registered(nccl_rank):
    nccl_rank.run(check_pageable_memory_registered)


def check_registration_opt_in():
    """Registration is opt-in: with the default settings, no user tensor reports ``is_pinned()`` after staged calls,
    however often its storage is staged. With a budget (``register_bytes``): a reused pageable storage is registered
    at its second call, a fresh one never; host memory flat (VmRSS and registered bytes within 1% after warm-up)
    over 1,000 calls on fresh storages and over 1,000 on one reused storage; storages reused in turn beyond the
    budget are not registered and unregistered call after call; unregistering waits for the staging streams'
    copies, not for the device (a kernel on another stream still runs when it returns); ``uninstall()`` leaves no
    storage registered."""
    from offload_shim import _registration

    offload_shim.install()
    device = _accelerator()
    assert offload_shim.configure().register_bytes == 0
    answers = {}
    with configured(chunk_bytes="1MiB"):  # the default: never
        tensors = [torch.ones(1 << 19), torch.ones(3 << 18)]  # pageable, 2 and 3 MiB: pipelined
        for _ in range(4):
            for tensor in tensors:
                dist.all_reduce(tensor)
        answers["by default"] = ([t.is_pinned() for t in tensors], _registration.registered_bytes())
    with configured(chunk_bytes="1MiB", register_bytes="1GiB"):
        reused = torch.ones(1 << 19)  # 2 MiB: pipelined in 1 MiB chunks
        dist.all_reduce(reused)
        answers["first call registers"] = reused.is_pinned()
        dist.all_reduce(reused)
        answers["second call registers"] = reused.is_pinned()

        def flat(call):
            for _ in range(50):  # warm-up
                call()
            torch.accelerator.synchronize()
            before = rss_bytes(), _registration.registered_bytes()
            for _ in range(1000):
                call()
            torch.accelerator.synchronize()
            return before, (rss_bytes(), _registration.registered_bytes())

        answers["fresh"] = flat(lambda: dist.all_reduce(torch.ones(1 << 19)))
        answers["reused"] = flat(lambda: dist.all_reduce(reused))
        answers["reused values"] = same_bits(reused, torch.ones(1 << 19))  # a one-rank sum: unchanged
    del reused
    with configured(chunk_bytes="1MiB", register_bytes="4MiB"):  # room for two of three storages reused in turn
        cycle = [torch.ones(1 << 19) for _ in range(3)]
        registered = []
        for _ in range(4):
            for tensor in cycle:
                dist.all_reduce(tensor)
            registered.append([t.is_pinned() for t in cycle])
        answers["in turn"] = registered
        # Unregistering waits for events on the staging streams, never for the device (which would wait for a
        # kernel queued on another stream); whether the driver's cudaHostUnregister itself waits is the driver's.
        side = torch.cuda.Stream()
        with counting_calls(torch.cuda, "synchronize") as device_waits, \
                counting_calls(torch.accelerator, "synchronize") as accelerator_waits:
            with torch.cuda.stream(side):
                torch.cuda._sleep(2_000_000_000)  # about a second
            del cycle, tensor
            _registration.drain()
            left = _registration.registered_bytes()
        answers["unregistered"] = (left, len(device_waits) + len(accelerator_waits))
        torch.accelerator.synchronize()
        host = torch.empty(1 << 19).fill_(1.0)  # the driver alone: unregistering while another stream sleeps
        assert int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.nbytes, 1)) == 0
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000_000)
            sleeping = side.record_event()
        start = time.perf_counter()
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
        answers["driver's unregister waits for the device"] = (sleeping.query(), time.perf_counter() - start)
        torch.accelerator.synchronize()
        kept = torch.ones(1 << 19)
        for _ in range(2):
            dist.all_reduce(kept)
        registered = kept.is_pinned()
        offload_shim.uninstall()
        answers["uninstall unregisters"] = (registered, kept.is_pinned(), _registration.registered_bytes())
        offload_shim.install()
    return answers


def test_registration_opt_in(nccl_rank):
    (answers,) = nccl_rank.run(check_registration_opt_in)
    assert answers["by default"] == ([False, False], 0), answers["by default"]
    assert answers["uninstall unregisters"] == (True, False, 0), answers["uninstall unregisters"]
    assert (answers["first call registers"], answers["second call registers"]) == (False, True), answers
    for case in ("fresh", "reused"):  # the reused storage registered throughout; no fresh one ever
        (rss_before, bytes_before), (rss_after, bytes_after) = answers[case]
        assert bytes_before == bytes_after == 2 << 20, (case, answers[case])
        assert abs(rss_after - rss_before) <= 0.01 * rss_before, (case, answers[case])
    assert answers["reused values"]
    # Registered at their second calls; the third evicts the first, which then stays pageable: no churn.
    assert answers["in turn"][1:] == [[False, True, True]] * 3, answers["in turn"]
    assert answers["unregistered"] == (0, 0), answers["unregistered"]
    print("cudaHostUnregister while another stream runs a kernel: (that kernel done when it returned, seconds) =",
          answers["driver's unregister waits for the device"])


def check_freed_registered_memory_reused():
    """A registered storage whose last tensor goes keeps its memory, registered, until the next pipelined call
    unregisters it and lets it go; then a new tensor given its address is moved right by torch's own copies into and
    out of it, and by the shim's staged calls (256 MiB: above glibc's mmap threshold, so the memory is unmapped when
    freed and mapped again for the new tensor; a registration left in place past the free would make the driver copy
    the old pages)."""
    from offload_shim import _registration

    offload_shim.install()
    device = _accelerator()
    size = 64 << 20  # fp32 elements
    answers = {}
    with configured(chunk_bytes="16MiB", register_bytes="2GiB"):
        first = torch.ones(size)
        for _ in range(2):
            dist.all_reduce(first)
        answers["registered"] = first.is_pinned()
        address = first.data_ptr()
        storage = weakref.ref(first.untyped_storage())
        del first
        answers["kept until the safe point"] = storage() is not None
        dist.all_reduce(torch.ones(8 << 20))  # a pipelined call: its safe point unregisters and lets the storage go
        answers["let go"] = storage() is None and _registration.registered_bytes() == 0
        again = [torch.empty(size) for _ in range(3)]
        reused = next((t for t in again if t.data_ptr() == address), None)
        answers["address reused"] = reused is not None
        if reused is not None:
            answers["pinned"] = reused.is_pinned()
            reused.copy_(torch.full((size,), 7.0, device=device))  # D2H by torch
            answers["torch D2H"] = bool(reused.eq(7.0).all())
            answers["torch H2D"] = bool(reused.to(device).eq(7.0).all())
            reused.fill_(3.0)
            dist.all_reduce(reused)  # a one-rank sum: unchanged
            answers["staged"] = bool(reused.eq(3.0).all())
    return answers


def test_freed_registered_memory_reused(nccl_rank):
    (answers,) = nccl_rank.run(check_freed_registered_memory_reused)
    assert answers["registered"], answers
    if not answers["address reused"]:
        pytest.skip(f"the allocator gave the freed address to none of the new tensors: {answers}")
    assert answers == {"registered": True, "kept until the safe point": True, "let go": True, "address reused": True,
                       "pinned": False, "torch D2H": True, "torch H2D": True, "staged": True}, answers


def check_nccl_writes_what_gloo_refuses():
    """On a NCCL-only group, CPU outputs that autograd would refuse to write (a leaf that requires grad, an
    inference tensor) are written, as NCCL writes such accelerator outputs from C++ and raises nothing; and the
    handle's result() is NCCL's: the output itself, one tensor (whole and chunked, async)."""
    offload_shim.install()
    rank = dist.get_rank()
    answers = {}
    for chunk_bytes in (1 << 20, 4):
        with torch.inference_mode():
            inference = torch.zeros(4)
        with configured(chunk_bytes=chunk_bytes):
            for kind, out in (("leaf", torch.zeros(4, requires_grad=True)), ("inference", inference)):
                dist.all_gather_into_tensor(out, torch.arange(4.0) + rank)
                answers[kind, chunk_bytes] = out.detach().tolist()
            flat = torch.zeros(4)
            work = dist.all_gather_into_tensor(flat, torch.arange(4.0), async_op=True)
            work.wait()
            (given,) = work.result()
            answers["result", chunk_bytes] = (given.data_ptr() == flat.data_ptr(), tuple(given.shape))
    return answers


def test_nccl_writes_what_gloo_refuses(nccl_rank):
    (answers,) = nccl_rank.run(check_nccl_writes_what_gloo_refuses)
    for chunk_bytes in (1 << 20, 4):
        assert answers["leaf", chunk_bytes] == answers["inference", chunk_bytes] == [0.0, 1.0, 2.0, 3.0], answers
        assert answers["result", chunk_bytes] == (True, (4,)), answers


# ---------------------------------------------------------------- fork() after staged calls


@pytest.mark.parametrize("world_size, backend", [(1, "nccl"), (2, "cuda:gloo")])
def test_children_forked_after_staged_calls_live(world_size, backend):
    """After staged calls of every mode (small and replayed on NCCL, whole, pipelined, asynchronous, pageable
    storages registered at their reuse, a registered communicator), pinned and pageable, each rank forks: bare
    children exit 0 (one forked while an asynchronous staged call is outstanding, one that stages on a group of its
    own from empty counters), and a fork DataLoader with two workers, not persistent, gives two epochs
    (tests/fork_after_staging.py). Unchecked, the children died of the parent's pinned buffers freed at the fork
    (``c10::AcceleratorError``, status 6)."""
    result = run_fork_script(world_size, "--backend", backend)
    assert "pipelined" in result.stdout and " 0 bytes registered" not in result.stdout, result.stdout
    if backend == "nccl":
        assert "replayed" in result.stdout, result.stdout
