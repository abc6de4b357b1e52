"""The chunked staging pipeline for elementwise in-place collectives (``all_reduce``, ``broadcast``).

A contiguous host tensor is staged chunk by chunk through two accelerator buffers (slots), one pair per staging
device and process group, that live as long as the process (see :func:`release_buffers`), so that after the
first call no staging call allocates accelerator memory, and the accelerator footprint is two chunks whatever the
tensor's size. Per chunk ``i`` in slot ``i % 2``:

* H2D on the pool's H2D stream, after the slot's previous D2H (event ``slot_free``);
* the collective, launched with the H2D stream current, so the backend's stream waits on that copy;
* D2H on the pool's D2H stream, made to wait on the collective by the work handle's ``wait()``.

So chunk ``i``'s collective overlaps chunk ``i+1``'s H2D and chunk ``i-1``'s D2H, on separate streams ordered by
events, and the H2D and D2H copy engines work at once. Chunking is valid only because these collectives are
elementwise per position; gathers and scatters do not come here.

Host memory: a pinned caller tensor is copied to and from directly. A pageable one takes
:data:`PAGEABLE_PATH`: ``"bounce"`` copies each chunk through two pinned host buffers of the pool, ``"driver"``
hands the pageable chunk to the runtime's own (synchronous) staged copy. A ``broadcast`` copies only what it
needs: the source rank's chunks go H2D only, the other ranks' D2H only.

Staging through ``cpu`` (the testing configuration) runs the same loop with plain host copies and no streams.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Callable

import torch
import torch.distributed as dist

from offload_shim import _config, _staging

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
    """Staging buffers, streams and events of one staging device and process group."""

    def __init__(self, device: torch.device, chunk_bytes: int):
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.lock = threading.Lock()
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


# One pool per staging device and process group: a pool's lock is held while a chunk's collective is launched,
# and a launch can block across ranks (a communicator's first use); two threads using two groups must not
# wait for each other's lock there, in opposite orders on two ranks.
_pools: dict[tuple[str, str], _Pool] = {}
_pools_lock = threading.Lock()


def _pool(device: torch.device, group: dist.ProcessGroup, chunk_bytes: int) -> _Pool:
    key = (str(device), group.group_name)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None or pool.chunk_bytes != chunk_bytes or len(pool.slots) != SLOTS:
            if pool is not None:
                with pool.lock:
                    pool.d2h.synchronize()
            pool = _pools[key] = _Pool(device, chunk_bytes)
        return pool


def release_buffers() -> None:
    """Free the staging buffers (accelerator and pinned host memory) after their last use has finished.
    The next staged call makes new ones."""
    with _pools_lock:
        for pool in _pools.values():
            with pool.lock:
                pool.h2d.synchronize()
                pool.d2h.synchronize()
        _pools.clear()


def pooled_buffers() -> list[torch.Tensor]:
    """Every staging buffer the pools hold now (for tests that poison them between uses)."""
    with _pools_lock:
        return [buffer for pool in _pools.values() for buffer in pool.buffers()]


def stage_in_place(
    tensor: torch.Tensor,
    device: torch.device,
    group: dist.ProcessGroup,
    launch: Callable[[torch.Tensor], dist.Work],
    *,
    reads: bool = True,
    writes: bool = True,
    async_op: bool = False,
):
    """Run an elementwise in-place collective on host ``tensor`` (contiguous, at least one element) staged
    through ``device`` in chunks.

    Args:
        group: the collective's process group (each group has its own buffers).
        launch: runs the collective, asynchronously, on one device chunk and returns its work handle.
        reads: whether the collective reads this rank's data (not on a broadcast's receiving ranks).
        writes: whether it writes this rank's data (not on a broadcast's source rank).
        async_op: return a :class:`~offload_shim._staging.StagedWork` instead of waiting.

    Returns:
        ``None`` once ``tensor`` holds the result, or the work handle.
    """
    pool = _pool(device, group, _config.settings().chunk_bytes)
    flat = tensor.data.view(-1)  # written without bumping the caller's version counter, as torch's C++ writes
    itemsize = flat.element_size()
    per_chunk = max(1, pool.chunk_bytes // itemsize)
    pinned = _staging._is_pinned(tensor)
    bounce = not pinned and PAGEABLE_PATH == "bounce"
    # An async call must not leave results in the pool's bounce buffers until wait(): a later call reuses them.
    private = _host_empty(flat.numel(), flat.dtype, device) if writes and async_op and bounce else None
    works, pending = [], collections.deque()

    def copy_out(entry) -> None:
        _, event, source, destination = entry
        event.synchronize()
        destination.copy_(source)

    # Outside autograd, like the in-place collective it completes (the caller's tensor may require grad); an
    # inference tensor is written in inference mode, as torch's C++ collectives write it.
    with pool.lock, _staging.staged_call(), torch.no_grad(), _staging.writable(tensor):
        pool.h2d.wait_stream(_current_stream(device))
        for index, start in enumerate(range(0, flat.numel(), per_chunk)):
            s = index % len(pool.slots)
            host_chunk = flat[start : start + per_chunk]
            slot = pool.slots[s][: host_chunk.numel() * itemsize].view(flat.dtype)
            if pool.slot_free[s] is not None:
                pool.h2d.wait_event(pool.slot_free[s])
            if reads:
                source = host_chunk
                if bounce:
                    if pool.host_in_free[s] is not None:
                        pool.host_in_free[s].synchronize()
                    source = pool.host("in", s)[: slot.numel() * itemsize].view(flat.dtype)
                    source.copy_(host_chunk)
                with _current(pool.h2d):
                    slot.copy_(source, non_blocking=True)
                if bounce:
                    pool.host_in_free[s] = pool.h2d.record_event()
            with _current(pool.h2d):
                works.append(launch(slot))
            with _current(pool.d2h):
                works[-1].wait()  # the D2H stream waits on the collective
            if writes:
                if private is not None:
                    target = private[start : start + per_chunk]
                elif bounce:
                    while pending and pending[0][0] == s:  # bounce buffer s still holds an older chunk
                        copy_out(pending.popleft())
                    target = pool.host("out", s)[: slot.numel() * itemsize].view(flat.dtype)
                else:
                    target = host_chunk
                with _current(pool.d2h):
                    target.copy_(slot, non_blocking=pinned or private is not None or bounce)
                if bounce and private is None:
                    pending.append((s, pool.d2h.record_event(), target, host_chunk))
            pool.slot_free[s] = pool.d2h.record_event()
            while len(pending) > 1:  # the newest chunk's copy is still in flight; finish the older ones
                copy_out(pending.popleft())
        done = pool.d2h.record_event()
        if not async_op:
            done.synchronize()
            while pending:
                copy_out(pending.popleft())
            return None

    def finish() -> None:
        done.synchronize()
        if private is not None:
            with torch.no_grad(), _staging.writable(tensor):
                flat.copy_(private)

    return _staging.StagedWork(works, finish, [tensor], done)
