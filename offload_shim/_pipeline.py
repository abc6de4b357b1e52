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
:data:`PAGEABLE_PATH`: ``"bounce"`` copies each chunk through two pinned host buffers of the pool per direction,
the host copies into them and out of them on two copy lanes (threads) of their own, so that chunk ``i+1``'s copy
in, chunk ``i-1``'s copy out and chunk ``i``'s DMA and collective all run at once; ``"driver"`` hands the pageable
chunk to the runtime's own (synchronous) staged copy. A ``broadcast`` copies only what it needs: the source rank's chunks go H2D only, the
other ranks' D2H only. A non-contiguous tensor goes through a contiguous pinned host copy. Only synchronous
calls are pipelined: an asynchronous one must not wait for its peers, as the agreement check does.

Staging through ``cpu`` (the testing configuration) runs the same loop with plain host copies and no streams.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import zlib
from typing import Callable

import torch
import torch.distributed as dist

from offload_shim import _config, _devices, _registration, _replay, _staging
from offload_shim._devices import StagingError

# Both chosen by measurement (benchmarks/bench_staging.py,
# results/gpu/2026-12-01-two-h200-gpu-tests-and-benchmark/bench.log): with pageable memory, bounce
# buffers with threaded host copies beat the runtime's own staged copy (49.7 against 55.5 ms for 256 MiB; it beat
# them while the copies ran on one thread, as torchrun's OMP_NUM_THREADS=1 leaves torch's own); SLOTS is the
# number of chunks in flight, so the accelerator footprint is SLOTS chunks.
PAGEABLE_PATH = "bounce"  # or "driver"
SLOTS = 2
# Tensors of fewer chunks than this are staged whole (_staging): with one chunk there is nothing to overlap.
MIN_PIPELINED_CHUNKS = 2


# Host copies are split over the copy threads in pieces of at least this size: smaller pieces cost more than they
# gain (one H200 host, 256 MiB pageable to pinned: one thread 12.3 GB/s in 1 MiB pieces, 31.1 in 4 MiB, 37.9 in
# 16 MiB; 8 threads 40.2 in 16 MiB pieces: the host's memory, not the thread count, is the limit;
# results/gpu/2026-12-01-one-h200-host-memory-probe/probe.log).
MIN_THREADED_COPY_BYTES = 16 << 20


def copy_threads() -> int:
    """Threads for the pipeline's host copies: this process's share of the CPUs it may run on (the CPUs of its
    affinity mask divided by ``LOCAL_WORLD_SIZE``, which torchrun sets), at most 32. Not ``OMP_NUM_THREADS``
    (torchrun sets it to 1) nor torch's intra-op threads, which are the caller's for their own CPU work."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    return max(1, min(32, cpus // ranks))


_copy_pool_lock = globals().get("_copy_pool_lock") or threading.Lock()
_copy_pool: list = globals().get("_copy_pool", [])  # [ThreadPoolExecutor], made on first use; kept across reload


def _host_copies(pairs) -> None:
    """``destination.copy_(source)`` for each ``(destination, source)`` pair of flat contiguous host tensors of
    one dtype, split over the copy threads (torch's copies release the GIL). Complete when this returns."""
    threads = copy_threads()
    pieces = []
    for destination, source in pairs:
        count = max(1, min(threads, destination.numel() * destination.element_size() // MIN_THREADED_COPY_BYTES))
        step = -(-destination.numel() // count)
        pieces += [(destination[i : i + step], source[i : i + step]) for i in range(0, destination.numel(), step)]
    if len(pieces) <= 1 or threads == 1:
        for destination, source in pieces:
            _copy(destination, source)
        return
    with _copy_pool_lock:
        if not _copy_pool:
            _copy_pool.append(concurrent.futures.ThreadPoolExecutor(threads - 1, thread_name_prefix="offload_shim_copy"))
        executor = _copy_pool[0]
    futures = [executor.submit(_copy, destination, source) for destination, source in pieces[1:]]
    error = None
    try:
        _copy(*pieces[0])
    except BaseException as exc:  # the other pieces are still copying: let them end before raising
        error = exc
    for future in futures:
        try:
            future.result()
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error


_lanes: dict = globals().get("_lanes", {})  # direction -> single-thread executor, made on first use


def _lane(direction: str) -> concurrent.futures.ThreadPoolExecutor:
    """The copy lane of ``direction`` (``"in"``: pageable memory into bounce buffers; ``"out"``: back), one thread
    each: the pipeline's host copies run there, in order, beside the thread that queues chunks. A lane's copy may
    fan out over the copy threads (:func:`_host_copies`), an executor of its own, so no copy waits on its own pool."""
    with _copy_pool_lock:
        lane = _lanes.get(direction)
        if lane is None:
            lane = _lanes[direction] = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"offload_shim_{direction}")
    return lane


def _forget_copy_pool() -> None:
    """In a forked child: the parent's copy threads are not there, so its executors would never run a copy."""
    _copy_pool.clear()
    _lanes.clear()


if not globals().get("_fork_hook_registered") and hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_copy_pool)
    _fork_hook_registered = True  # once per process, across importlib.reload


def _copy(destination: torch.Tensor, source: torch.Tensor) -> None:
    # Grad mode and inference mode are per thread: set here as in the calling thread.
    with torch.no_grad(), _staging.writable(destination):
        _staging.bits(destination).copy_(_staging.bits(source))


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
        with torch.inference_mode(False):  # reused by later calls, in inference mode or not
            self.slots = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=device) for _ in range(SLOTS)]
        self.slot_free: list = [None] * SLOTS
        self._host: dict[str, list[torch.Tensor]] = {}
        self.host_in_free: list = [None] * SLOTS

    def host(self, direction: str, index: int) -> torch.Tensor:
        """Pinned bounce buffer ``index`` for ``direction`` ('in' or 'out'), made on first use."""
        if direction not in self._host:
            with torch.inference_mode(False):
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
    """Free the staging buffers (accelerator and pinned host memory, the pools' and the small calls' slots and
    captured graphs) and unregister the host memory staging registered, after their last use has finished; buffers that a call in another thread is using are freed
    when it is done with them. The next staged call makes new ones. ``torch.distributed.destroy_process_group()``
    (of every group) calls this while the shim is installed."""
    global _generation
    _replay.forget()
    _registration.unregister_all()
    _staging.release_small_slots()
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
) -> None:
    """Run a synchronous elementwise in-place collective on host ``tensor`` (any strides, at least one element; the
    same number of elements and dtype on every rank) staged through ``device`` in chunks, in its logical
    (row-major) element order. Asynchronous calls do not come here: they are staged whole (``_patch_c10d``).

    Every rank first checks that the others run the same collective on as many elements of the same dtype, in
    chunks of the same size (:func:`_agree`). A non-contiguous tensor goes through a contiguous host copy.

    Args:
        group: the collective's process group.
        launch: runs the collective, asynchronously, on one device chunk and returns its work handle.
        collective: the collective's name, for the ranks' agreement check and its error.
        reads: whether the collective reads this rank's data (not on a broadcast's receiving ranks).
        writes: whether it writes this rank's data (not on a broadcast's source rank).

    Returns:
        ``None``, once ``tensor`` holds the result.

    Raises:
        StagingError: the ranks disagree (see above), on every rank; the caller's tensor is unchanged.
        Exception: what the collective raises. The caller's tensor is unchanged, except after a failure of a later
            chunk's collective, once earlier chunks were written back.
    """
    _staging.finish_writes_to([tensor])
    chunk_bytes = _config.settings().chunk_bytes
    contiguous = tensor.is_contiguous()
    if contiguous:
        source = tensor.data.view(-1)  # written through .data, as torch's C++ writes: no version counter bump
        _registration.register_for_staging(tensor, device)  # pageable: registered at its second staging, if set
    else:  # through a contiguous pinned host copy, written back at the end
        source = _host_empty(tensor.numel(), tensor.dtype, device)
        with torch.no_grad():
            _staging.bits(source.view(tensor.shape)).copy_(_staging.bits(tensor))
    pool = _acquire(device, chunk_bytes)
    try:
        done = _run_chunks(pool, source, launch, group, collective, reads=reads, writes=writes)
    finally:
        _give_back(pool)
    done.synchronize()
    if not contiguous and writes:  # a call that only reads leaves the caller's tensor as it is
        with torch.no_grad(), _staging.writable(tensor):
            _staging.bits(tensor.data).copy_(_staging.bits(source.view(tensor.shape)))


def _run_chunks(pool, source, launch, group, collective, *, reads, writes):
    """Queue the chunks of ``source`` (a flat host tensor) through ``pool``: H2D, the collective, D2H back into
    ``source``. Pageable memory goes through the pool's pinned bounce buffers (:data:`PAGEABLE_PATH` ``"bounce"``):
    chunk ``i + 1``'s copy into a bounce buffer and chunk ``i - 1``'s copy out of one run on the two copy lanes
    (:func:`_lane`) while this thread queues chunk ``i``'s copies and collective. Returns an event completed once
    every D2H copy has (every host copy out of a bounce buffer has finished when this returns)."""
    device = pool.device
    itemsize = source.element_size()
    per_chunk = max(1, pool.chunk_bytes // itemsize)
    starts = range(0, source.numel(), per_chunk)
    pinned = _staging._is_pinned(source)
    bounce_in = PAGEABLE_PATH == "bounce" and reads and not pinned
    bounce_out = PAGEABLE_PATH == "bounce" and writes and not pinned
    copies_in = {}  # chunk index -> future of its copy into a bounce buffer
    copies_out = [None] * len(pool.slots)  # slot -> future of the copy out of its bounce buffer

    def chunk(index: int) -> torch.Tensor:
        return source[starts[index] : starts[index] + per_chunk]

    def bounce(direction: str, index: int) -> torch.Tensor:
        return pool.host(direction, index % len(pool.slots))[: chunk(index).numel() * itemsize].view(source.dtype)

    def copy_in(index: int) -> None:  # after the last H2D copy out of that bounce buffer
        after = pool.host_in_free[index % len(pool.slots)]
        copies_in[index] = _lane("in").submit(_copy_after, after, bounce("in", index), chunk(index))

    # Outside autograd, like the in-place collective it completes (the caller's tensor may require grad); an
    # inference tensor is written in inference mode, as torch's C++ collectives write it.
    with _staging.staged_call(), torch.no_grad(), _staging.writable(source):
        try:
            pool.h2d.wait_stream(_current_stream(device))
            if bounce_in:
                copy_in(0)
            for index in range(len(starts)):
                s = index % len(pool.slots)
                host_chunk = chunk(index)
                slot = pool.slots[s][: host_chunk.numel() * itemsize].view(source.dtype)
                if pool.slot_free[s] is not None:
                    pool.h2d.wait_event(pool.slot_free[s])
                if reads:
                    staged = host_chunk
                    if bounce_in:
                        copies_in.pop(index).result()
                        staged = bounce("in", index)
                    with _current(pool.h2d):
                        _staging.bits(slot).copy_(_staging.bits(staged), non_blocking=True)
                    if bounce_in:
                        pool.host_in_free[s] = pool.h2d.record_event()
                        if index + 1 < len(starts):
                            copy_in(index + 1)
                if index == 0:  # behind the first chunk's H2D
                    _agree(group, device, collective, source.numel(), source.dtype, pool.chunk_bytes)
                with _current(pool.h2d):
                    work = launch(slot)
                with _current(pool.d2h):
                    work.wait()  # the D2H stream waits on the collective (Gloo: the collective has finished)
                if writes:
                    landing = host_chunk
                    if bounce_out:
                        landing = bounce("out", index)
                        if copies_out[s] is not None:  # that bounce buffer's last copy out has finished
                            copies_out[s].result()
                    with _current(pool.d2h):
                        _staging.bits(landing).copy_(_staging.bits(slot), non_blocking=pinned or bounce_out)
                    if bounce_out:
                        copies_out[s] = _lane("out").submit(_copy_after, pool.d2h.record_event(), host_chunk, landing)
                pool.slot_free[s] = pool.d2h.record_event()
            done = pool.d2h.record_event()
        except BaseException:  # every copy this call started ends before the pool is given back
            _settle([*copies_in.values(), *copies_out], quietly=True)
            raise
        _settle(copies_out)
    return done


def _copy_after(event, destination: torch.Tensor, source: torch.Tensor) -> None:
    """On a copy lane: once ``event`` (if any) has completed, copy ``source`` into ``destination`` (flat host
    tensors of one dtype) on the copy threads."""
    if event is not None:
        event.synchronize()
    _host_copies([(destination, source)])


def _settle(futures, quietly: bool = False) -> None:
    """Wait for every future of ``futures`` (``None`` entries skipped); then raise the first one's error, if any,
    unless ``quietly``."""
    error = None
    for future in futures:
        if future is None:
            continue
        try:
            future.result()
        except BaseException as exc:
            error = error or exc
    if error is not None and not quietly:
        raise error
