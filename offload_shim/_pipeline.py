"""The chunked staging pipeline for elementwise in-place collectives (``all_reduce``, ``broadcast``, ``reduce``).

A host tensor is staged chunk by chunk through two accelerator buffers (slots) of a pool (see :func:`_acquire`),
so that after the first call no staging call allocates accelerator memory, and the accelerator footprint is two
chunks whatever the tensor's size. Per chunk ``i`` in slot ``i % 2``:

* H2D on the pool's H2D stream, after the slot's previous D2H (event ``slot_free``);
* the collective, launched with the H2D stream current, so the backend's stream waits on that copy;
* D2H on the pool's D2H stream, made to wait on the collective by the work handle's ``wait()``.

So chunk ``i``'s collective overlaps chunk ``i+1``'s H2D and chunk ``i-1``'s D2H, on separate streams ordered by
events, and the H2D and D2H copy engines work at once. Chunking is valid only because these collectives are
elementwise per position; gathers and scatters do not come here. Before the first chunk's collective, the ranks
check that they all split the call alike (:func:`_agree`), overlapped with that chunk's H2D.

Host memory: a pinned caller tensor is copied to and from directly. A pageable one takes
:data:`PAGEABLE_PATH`: ``"bounce"`` copies each chunk through two pinned host buffers of the pool, ``"driver"``
hands the pageable chunk to the runtime's own (synchronous) staged copy. A ``broadcast`` copies only what it
needs: the source rank's chunks go H2D only, the other ranks' D2H only. An asynchronous call, and a non-contiguous
tensor, land their results in a private pinned host buffer first.

Staging through ``cpu`` (the testing configuration) runs the same loop with plain host copies and no streams.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import zlib
from typing import Callable

import torch
import torch.distributed as dist

from offload_shim import _config, _devices, _staging
from offload_shim._devices import StagingError

# Both chosen by measurement (benchmarks/bench_staging.py, results/gpu/bench.log): with pageable memory the
# runtime's own staged copy beat a single-threaded copy through pinned bounce buffers (torchrun sets
# OMP_NUM_THREADS=1); SLOTS is the number of chunks in flight, so the accelerator footprint is SLOTS chunks.
PAGEABLE_PATH = "driver"  # or "bounce"
SLOTS = 2
# Tensors of fewer chunks than this are staged whole (_staging): with one chunk there is nothing to overlap.
MIN_PIPELINED_CHUNKS = 2


class _NoStream:
    """Stands in for a stream when staging through the CPU: every copy has finished when it returns."""

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self):
        return self

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _current_stream(device: torch.device):
    return _NoStream() if device.type == "cpu" else torch.accelerator.current_stream(device)


@contextlib.contextmanager
def _current(stream):
    """Make ``stream`` the current stream of its device for the block."""
    if isinstance(stream, _NoStream):
        yield
        return
    previous = torch.accelerator.current_stream(stream.device)
    torch.accelerator.set_stream(stream)
    try:
        yield
    finally:
        torch.accelerator.set_stream(previous)


def _host_empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, pin_memory=device.type != "cpu")


class _Pool:
    """Staging buffers and streams for one staged call at a time on one staging device."""

    def __init__(self, device: torch.device, chunk_bytes: int, generation: int):
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.generation = generation
        cpu = device.type == "cpu"
        self.h2d = _NoStream() if cpu else torch.Stream(device=device)
        self.d2h = _NoStream() if cpu else torch.Stream(device=device)
        # A chunk holds at least one element of any dtype (16 bytes: complex128).
        self.slot_bytes = max(chunk_bytes, 16)
        self.slots = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=device) for _ in range(SLOTS)]
        self.slot_free: list = [None] * SLOTS
        self._host: dict[str, list[torch.Tensor]] = {}
        self.host_in_free: list = [None] * SLOTS

    def host(self, direction: str, index: int) -> torch.Tensor:
        """Pinned bounce buffer ``index`` for ``direction`` ('in' or 'out'), made on first use."""
        if direction not in self._host:
            self._host[direction] = [_host_empty(self.slot_bytes, torch.uint8, self.device) for _ in range(SLOTS)]
        return self._host[direction][index]

    def buffers(self) -> list[torch.Tensor]:
        return [*self.slots, *(t for pair in self._host.values() for t in pair)]

    def synchronize(self) -> None:
        """Wait until no copy or collective queued on the buffers is still running."""
        self.h2d.synchronize()
        self.d2h.synchronize()


# Idle pools by staging device. A call takes one (or makes one when every pool of its device is in use by other
# threads) and gives it back when its copies and collectives are queued: later calls' streams wait on the slots'
# events. So pools belong to no process group (making and destroying groups costs no memory), and there are never
# more of them than calls staged at once; a call never waits for another thread's call to let go of one (a launch
# can block across ranks, and two threads on two groups must not wait for each other, in opposite orders on two
# ranks). release_buffers() and destroy_process_group() free them.
# Kept across importlib.reload of this module.
_idle: dict[str, list[_Pool]] = globals().get("_idle", {})
_busy: list[_Pool] = globals().get("_busy", [])
_pools_lock = globals().get("_pools_lock") or threading.Lock()
_generation = globals().get("_generation", 0)


def _acquire(device: torch.device, chunk_bytes: int) -> _Pool:
    stale = []  # made for another chunk size: freed once their last use has finished, outside the lock
    with _pools_lock:
        idle = _idle.setdefault(str(device), [])
        while idle:
            pool = idle.pop()
            if pool.chunk_bytes == chunk_bytes and len(pool.slots) == SLOTS:
                break
            stale.append(pool)
        else:
            pool = _Pool(device, chunk_bytes, _generation)
        _busy.append(pool)
    for old in stale:
        old.synchronize()
    return pool


def _give_back(pool: _Pool) -> None:
    with _pools_lock:
        _busy.remove(pool)
        if pool.generation == _generation:
            _idle.setdefault(str(pool.device), []).append(pool)
            return
    pool.synchronize()  # release_buffers() ran while this call used the pool: free it once its work is done


def release_buffers() -> None:
    """Free the staging buffers (accelerator and pinned host memory) after their last use has finished; buffers
    that a call in another thread is using are freed when it is done with them. The next staged call makes new
    ones. ``torch.distributed.destroy_process_group()`` (of every group) calls this while the shim is installed."""
    global _generation
    with _pools_lock:
        _generation += 1
        pools = [pool for idle in _idle.values() for pool in idle]
        _idle.clear()
    for pool in pools:
        pool.synchronize()


def pooled_buffers() -> list[torch.Tensor]:
    """Every staging buffer the pools hold now (for tests that poison them between uses and count them)."""
    with _pools_lock:
        return [buffer for pool in (*_busy, *(p for idle in _idle.values() for p in idle)) for buffer in pool.buffers()]


def _code(text: str) -> int:
    return zlib.crc32(text.encode())


def _agree(
    group: dist.ProcessGroup, device: torch.device, collective: str, numel: int, dtype: torch.dtype, chunk_bytes: int
):
    """Check that every rank of ``group`` runs ``collective`` on ``numel`` elements (a size every rank shares: the
    tensor's, or a DTensor's global size) of ``dtype`` with the same chunk size, so that all split it into the same
    collectives. Raises :class:`StagingError` on every rank where they differ, before any chunk's collective. Costs
    one small collective and one wait for its result."""
    mine = torch.tensor([numel, chunk_bytes, _code(str(dtype)), _code(collective)], dtype=torch.int64)
    both = torch.cat([mine, -mine]).to(device)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MAX
    group.allreduce([both], options).wait()
    values = both.tolist()  # waits for the result
    high, low = values[:4], [-v for v in values[4:]]
    if high == low:
        return
    what = []
    if high[0] != low[0]:
        what.append(f"sizes from {low[0]} to {high[0]} elements (this rank: {numel})")
    if high[1] != low[1]:
        what.append(f"chunk sizes from {low[1]} to {high[1]} bytes (set {_config.ENV_CHUNK_BYTES} alike on every rank)")
    if high[2] != low[2]:
        what.append(f"dtypes (this rank: {dtype})")
    if high[3] != low[3]:
        what.append(f"collectives (this rank: {collective})")
    raise StagingError(
        f"offload_shim: the ranks of process group {_devices.group_label(group)} disagree on this staged {collective}: "
        f"{'; '.join(what)}. No rank ran it; the caller's tensors are unchanged."
    )


def stage_in_place(
    tensor: torch.Tensor,
    device: torch.device,
    group: dist.ProcessGroup,
    launch: Callable[[torch.Tensor], dist.Work],
    collective: str,
    *,
    reads: bool = True,
    writes: bool = True,
    async_op: bool = False,
):
    """Run an elementwise in-place collective on host ``tensor`` (any strides, at least one element; the same
    number of elements and dtype on every rank) staged through ``device`` in chunks, in its logical (row-major)
    element order.

    Every rank first checks that the others run the same collective on as many elements of the same dtype, in
    chunks of the same size (:func:`_agree`). A non-contiguous tensor goes through a contiguous host copy. With
    ``async_op`` the results go to a private host buffer and reach ``tensor`` when the work handle is finished, so
    ``tensor`` holds what it held until then.

    Args:
        group: the collective's process group.
        launch: runs the collective, asynchronously, on one device chunk and returns its work handle.
        collective: the collective's name, for the ranks' agreement check and its error.
        reads: whether the collective reads this rank's data (not on a broadcast's receiving ranks).
        writes: whether it writes this rank's data (not on a broadcast's source rank).
        async_op: return a :class:`~offload_shim._staging.StagedWork` instead of waiting.

    Returns:
        ``None`` once ``tensor`` holds the result, or the work handle.

    Raises:
        StagingError: the ranks disagree (see above), on every rank; the caller's tensor is unchanged.
        Exception: what the collective raises; at the call, or for ``async_op`` in the handle's ``wait()`` if
            torch raises it there. The caller's tensor is unchanged, except after a failure of a chunk's collective
            in a synchronous call once earlier chunks were written back.
    """
    _staging.finish_writes_to([tensor])
    chunk_bytes = _config.settings().chunk_bytes
    contiguous = tensor.is_contiguous()
    if contiguous:  # written through .data, without bumping the caller's version counter, as torch's C++ writes
        source = tensor.data.view(-1)
    else:
        source = _host_empty(tensor.numel(), tensor.dtype, device)
        with torch.no_grad():
            source.view(tensor.shape).copy_(tensor)
    private = None
    if writes and (async_op or not contiguous):
        private = source if not contiguous else _host_empty(source.numel(), source.dtype, device)
    target = source if private is None else private
    pool = _acquire(device, chunk_bytes)
    try:
        works, error, done = _run_chunks(
            pool, source, target, launch, group, collective, reads=reads, writes=writes, async_op=async_op
        )
    finally:
        _give_back(pool)

    def finish() -> None:
        done.synchronize()
        if private is not None:
            with torch.no_grad(), _staging.writable(tensor):
                tensor.data.copy_(private.view(tensor.shape))

    if not async_op:
        finish()
        return None
    return _staging.StagedWork(works, finish, [tensor], done, writes_to=[tensor] if writes else [], error=error)


def _run_chunks(pool, source, target, launch, group, collective, *, reads, writes, async_op):
    """Queue the chunks of ``source`` through ``pool``: H2D, the collective, D2H into ``target`` (a flat host
    tensor, ``source`` itself or a private buffer). Returns ``(works, error, done)``: ``error`` is the exception a
    chunk's ``wait()`` raised in an asynchronous call (no further chunk is launched; a synchronous call raises it),
    ``done`` an event completed once every D2H copy has."""
    device = pool.device
    itemsize = source.element_size()
    per_chunk = max(1, pool.chunk_bytes // itemsize)
    bounce_in = PAGEABLE_PATH == "bounce" and not _staging._is_pinned(source)
    target_pinned = _staging._is_pinned(target)
    bounce_out = PAGEABLE_PATH == "bounce" and not target_pinned
    works, pending, error = [], collections.deque(), None

    def copy_out(entry) -> None:
        _, event, staged, destination = entry
        event.synchronize()
        destination.copy_(staged)

    # Outside autograd, like the in-place collective it completes (the caller's tensor may require grad); an
    # inference tensor is written in inference mode, as torch's C++ collectives write it.
    with _staging.staged_call(), torch.no_grad(), _staging.writable(target):
        pool.h2d.wait_stream(_current_stream(device))
        for index, start in enumerate(range(0, source.numel(), per_chunk)):
            s = index % len(pool.slots)
            host_chunk = source[start : start + per_chunk]
            slot = pool.slots[s][: host_chunk.numel() * itemsize].view(source.dtype)
            if pool.slot_free[s] is not None:
                pool.h2d.wait_event(pool.slot_free[s])
            if reads:
                staged = host_chunk
                if bounce_in:
                    if pool.host_in_free[s] is not None:
                        pool.host_in_free[s].synchronize()
                    staged = pool.host("in", s)[: slot.numel() * itemsize].view(source.dtype)
                    staged.copy_(host_chunk)
                with _current(pool.h2d):
                    slot.copy_(staged, non_blocking=True)
                if bounce_in:
                    pool.host_in_free[s] = pool.h2d.record_event()
            if index == 0:  # behind the first chunk's H2D
                try:
                    _agree(group, device, collective, source.numel(), source.dtype, pool.chunk_bytes)
                except StagingError:
                    raise
                except Exception as exc:  # the backend failed (a peer gone, a timeout): as in a chunk's wait()
                    if not async_op:
                        raise
                    error = exc
                    break
            with _current(pool.h2d):
                works.append(launch(slot))
            try:
                with _current(pool.d2h):
                    works[-1].wait()  # the D2H stream waits on the collective (Gloo: the collective has finished)
            except Exception as exc:  # raised where torch raises it: at the call, or in the handle's wait()
                if not async_op:
                    raise
                error = exc
                break
            if writes:
                destination = target[start : start + per_chunk]
                if bounce_out:
                    while pending and pending[0][0] == s:  # bounce buffer s still holds an older chunk
                        copy_out(pending.popleft())
                    landing = pool.host("out", s)[: slot.numel() * itemsize].view(source.dtype)
                else:
                    landing = destination
                with _current(pool.d2h):
                    landing.copy_(slot, non_blocking=target_pinned or bounce_out)
                if bounce_out:
                    pending.append((s, pool.d2h.record_event(), landing, destination))
            pool.slot_free[s] = pool.d2h.record_event()
            while len(pending) > 1:  # the newest chunk's copy is still in flight; finish the older ones
                copy_out(pending.popleft())
        done = pool.d2h.record_event()
        if pending:
            done.synchronize()
            while pending:
                copy_out(pending.popleft())
    return works, error, done
