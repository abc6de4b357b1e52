"""The staging engine: host tensors to the staging device and back, with stream ordering kept.

H2D: from pinned host memory (the caller's tensor if pinned, else a pinned copy from torch's caching host
allocator) with a non-blocking copy on the staging device's current stream. Collectives enqueued after it on
that stream (NCCL, HCCL and XCCL make their own stream wait on the current one) see the copied bytes.

D2H: on the staging device's current stream, after the collective's result is ready on it (torch's
``Work.wait()`` and ``wait_tensor`` make the current stream wait on the communication stream), then a wait
on that stream before the result is handed to the caller, so no caller reads a buffer before the copy into
it has finished.

A staging device of type ``cpu`` (a testing configuration, see ``OFFLOAD_SHIM_STAGING_DEVICE``) takes the same
path with plain host copies.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import logging
import os
import queue
import threading
import time
import weakref
from typing import Callable

import torch
import torch.distributed as dist

from offload_shim import _interrupts, _state
from offload_shim._state import state

_log = logging.getLogger("offload_shim")


class staged_call:
    """Context manager marking the original collective running on staged tensors: a collective it calls in turn
    (``full_tensor`` calls the functional collectives; ``all_gather_tensor`` calls ``all_gather_single``) is not
    staged again. (A class, not ``contextlib.contextmanager``: it is on every staged call's path.)"""

    __slots__ = ("_depth",)

    def __enter__(self) -> None:
        thread = state.thread
        self._depth = thread.depth
        thread.depth = self._depth + 1

    def __exit__(self, *exc_info) -> None:
        state.thread.depth = self._depth


def in_staged_call() -> bool:
    return state.thread.depth > 0


def _is_pinned(tensor: torch.Tensor) -> bool:
    try:
        return tensor.is_pinned()
    except RuntimeError:  # no accelerator runtime to ask
        return False


def _finish_on(device: torch.device) -> None:
    """Block the host until work queued so far on ``device``'s current stream has finished."""
    if device.type != "cpu":
        torch.accelerator.current_stream(device).synchronize()


class NoStream:
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

    def __enter__(self):  # ``with stream:`` makes a torch.Stream current on its device for the block (torch's own)
        return self

    def __exit__(self, *exc) -> None:
        pass


def new_stream(device: torch.device):
    """A stream of ``device`` (from torch's pool of streams), or :class:`NoStream` for the CPU."""
    return NoStream() if device.type == "cpu" else torch.Stream(device=device)


def current_stream(device: torch.device):
    return NoStream() if device.type == "cpu" else torch.accelerator.current_stream(device)


# Host copies are split over the copy threads in pieces of at least this size: smaller pieces cost more than they
# gain (one H200 host, 256 MiB pageable to pinned: one thread 12.3 GB/s in 1 MiB pieces, 31.1 in 4 MiB, 37.9 in
# 16 MiB; 8 threads 40.2 in 16 MiB pieces: the host's memory, not the thread count, is the limit;
# results/gpu/2026-12-01-one-h200-host-memory-probe/probe.log).
MIN_THREADED_COPY_BYTES = 16 << 20


def copy_threads() -> int:
    """Threads for staging's host copies: this process's share of the CPUs it may run on (the CPUs of its affinity
    mask divided by ``LOCAL_WORLD_SIZE``, which torchrun sets), at most 32. Not ``OMP_NUM_THREADS`` (torchrun sets it
    to 1) nor torch's intra-op threads, which are the caller's for their own CPU work."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    return max(1, min(32, cpus // ranks))


def host_copies(pairs) -> None:
    """``destination.copy_(source)`` for each ``(destination, source)`` pair of flat contiguous host tensors of
    one dtype, split over the copy threads (torch's copies release the GIL). Complete when this returns. The copy
    threads only copy: no task of theirs waits for anything, so the callers of every group may share them."""
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
    with state.copy_pool_lock:
        if state.copy_pool is None:
            state.copy_pool = concurrent.futures.ThreadPoolExecutor(threads - 1, thread_name_prefix="offload_shim_copy")
        executor = state.copy_pool
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


def _copy(destination: torch.Tensor, source: torch.Tensor) -> None:
    # Grad mode and inference mode are per thread: set here as in the calling thread.
    with torch.no_grad(), writable(destination):
        bits(destination).copy_(bits(source))


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or for a bool tensor its bytes (a ``uint8`` view): a host copy between bool tensors stores
    1 for any nonzero byte, where a collective leaves what the backend computed (2 in a two-rank bool SUM, for
    Gloo and NCCL alike). Every staging copy goes through this, so staged results are the backend's bytes."""
    return tensor.view(torch.uint8) if tensor.dtype is torch.bool else tensor


def to_staging(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A contiguous copy of ``tensor`` on ``device`` (same shape and dtype, new storage): a host tensor's on the
    staging accelerator, or an accelerator tensor's in pinned host memory, complete for the host to read. Backends
    such as NCCL take contiguous tensors only, whatever the caller's strides, and the functional collectives check for
    contiguity themselves. A channels_last tensor is staged contiguous too: its staged call moves data in logical
    order, where torch's call on the tensor itself moves its memory order (they differ only where one call mixes
    layouts). Keeping channels_last would not do: where one rank's tensor is empty (contiguous in every format)
    and another's is not, a check the others fail would leave that rank waiting.

    Differentiable (``Tensor.to``), so functional collectives keep their autograd graph. Reads ``tensor`` after
    any outstanding staged call that writes it has written it (:func:`finish_writes_to`).
    """
    finish_writes_to([tensor])
    if tensor.dtype is torch.bool:
        return to_staging(bits(tensor), device).view(torch.bool)
    if device.type == "cpu":
        if tensor.is_cpu:
            return tensor.clone(memory_format=torch.contiguous_format)
        # An accelerator tensor staged through the host: into pinned memory after the work queued on its current
        # stream (which produced it), and that stream's copy finished, since the host reads it next.
        staged = tensor.to(device, non_blocking=True, memory_format=torch.contiguous_format)
        _finish_on(tensor.device)
        return staged
    # Pinned: an asynchronous DMA. Pageable: the runtime's own staged copy, measured faster than a copy into
    # pinned memory first (see _execute.PAGEABLE_PATH).
    return tensor.to(device, non_blocking=True, memory_format=torch.contiguous_format)


def to_caller(staged: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new tensor on the caller's ``device`` holding ``staged``, complete when this returns (pinned when
    it comes from an accelerator). Differentiable."""
    if staged.dtype is torch.bool:
        return to_caller(bits(staged), device).view(torch.bool)
    if staged.device.type == "cpu":
        return staged if device.type == "cpu" else staged.to(device)
    out = staged.to(device, non_blocking=True)
    _finish_on(staged.device)
    return out


def writable(destination: torch.Tensor):
    """Where an in-place copy into the caller's ``destination`` is allowed: an inference tensor (made under
    ``torch.inference_mode()``, as rollouts and eval metrics are) takes writes only inside inference mode, which
    torch's own collectives bypass in C++."""
    return torch.inference_mode() if destination.is_inference() else contextlib.nullcontext()


class _SmallSlot:
    """A buffer of ``nbytes`` on ``device`` for one thread's small staged calls, with its views by dtype and shape
    (a view costs more than the copy of a few bytes). ``pending``: an event after a collective that reads the slot
    and that no one has waited for (a call that only reads), waited before the slot is written again."""

    VIEWS = 64  # at most this many (dtype, shape) views kept; more, and the oldest go

    def __init__(self, device: torch.device, nbytes: int, generation: int):
        with torch.inference_mode(False):  # a normal tensor, though the call that makes it may be in inference mode
            self.staged = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.generation = generation
        self.pending = None
        self.views: dict[tuple[torch.dtype, torch.Size], torch.Tensor] = {}

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        key = (tensor.dtype, tensor.shape)
        view = self.views.get(key)
        if view is None:
            if len(self.views) >= self.VIEWS:
                del self.views[next(iter(self.views))]
            with torch.inference_mode(False):  # kept for later calls, in inference mode or not
                view = self.views[key] = self.staged[: tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        return view


def release_small_slots() -> None:
    """Let go of every thread's small-call slots: each thread makes new ones at its next small staged call (a
    thread that never makes one keeps its old slots until it ends)."""
    state.slot_generation += 1


def small_slot_buffers() -> list[torch.Tensor]:
    """This thread's small-call slot buffers (for tests that poison them between uses and watch their reuse)."""
    return [slot.staged for slot in state.thread.slots.values()]


def _small_slot(device: torch.device, nbytes: int) -> _SmallSlot:
    slots, generation = state.thread.slots, state.slot_generation
    slot = slots.get(device)
    if slot is None or slot.generation != generation or slot.staged.numel() < nbytes:
        slot = slots[device] = _SmallSlot(device, max(512, 1 << (nbytes - 1).bit_length()), generation)
    elif slot.pending is not None:
        slot.pending.synchronize()
        slot.pending = None
    return slot


def stage_small_in_place(tensor: torch.Tensor, device: torch.device, run: Callable, *, reads: bool, writes: bool):
    """Run a synchronous in-place collective on host ``tensor`` (at most ``_plan.SMALL_CALL_BYTES``, any strides)
    through this thread's reused slot on ``device``, with the fewest steps its semantics allow: one H2D copy from
    the caller's memory, ``run(staged)`` (the collective on a contiguous tensor of ``tensor``'s shape and dtype on
    ``device``), and one blocking D2H copy into the caller's tensor, which is the call's one wait for the device.
    A call that only reads (a broadcast's source, a reduce's other ranks) copies H2D blocking instead, so the
    caller may reuse its tensor on return. No allocation after a thread's first call of a size; no pool, no
    pipeline, no pinned staging copy (measured no faster for a few bytes:
    results/gpu/2026-11-30-two-h200-call-parts).

    Args:
        reads: whether the collective reads this rank's data (not on a broadcast's receiving ranks).
        writes: whether it writes this rank's data (not on a broadcast's source, nor a reduce's other ranks).

    Returns:
        What ``run`` returned, once ``tensor`` holds the result. If ``run`` raises, ``tensor`` is unchanged.
    """
    if state.pending_writes:
        finish_writes_to((tensor,))
    slot = _small_slot(device, tensor.nbytes)
    staged = slot.view(tensor)
    source = tensor.detach() if tensor.requires_grad else tensor  # no graph: a collective is outside autograd
    if reads:
        bits(staged).copy_(bits(source), non_blocking=writes)  # blocking where nothing waits for the device after it
    thread = state.thread
    depth = thread.depth  # as staged_call(), without its object: this path is for calls of a few bytes
    thread.depth = depth + 1
    try:
        result = run(staged)
    except BaseException:
        slot.pending = _record(device)
        raise
    finally:
        thread.depth = depth
    if writes:
        if tensor.is_inference():
            with torch.inference_mode():
                bits(tensor.data).copy_(bits(staged))
        else:
            bits(tensor.data).copy_(bits(staged))  # blocking: the copy, then a wait for the device's current stream
    else:
        slot.pending = _record(device)
    return result


def _record(device: torch.device):
    """An event on ``device``'s current stream (``None`` for the CPU, where copies are complete on return)."""
    return None if device.type == "cpu" else torch.accelerator.current_stream(device).record_event()


# Host memory that asynchronous staged calls write when they are finished, indexed by the storage it lies in
# (state.pending_writes: the storage's address -> {token: (spans, finish)}), so that a staged call looks up only its
# own tensors' storages, whatever the number of outstanding calls. A staged call on memory in a span first finishes
# that call, so that calls on one tensor take effect in the order they were made, as they do on one accelerator
# stream. state.pending_lock (re-entrant: a failed call's cleanup may run from garbage collection in a thread that
# holds it) guards the index, never a finish().
def _span(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The bytes ``[start, end)`` of host memory that ``tensor``'s elements occupy (``None`` if it has none)."""
    if tensor.numel() == 0:
        return None
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))  # strides are >= 0
    start = tensor.data_ptr()
    return start, start + (last + 1) * tensor.element_size()


def _spans(tensors) -> dict[int, list[tuple[int, int]]]:
    """The spans of ``tensors`` (:func:`_span`) by the address of the storage each lies in."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for tensor in tensors:
        span = _span(tensor)
        if span is not None:
            spans.setdefault(tensor.untyped_storage().data_ptr(), []).append(span)
    return spans


def expect_writes(tensors, finish: Callable[[], object]) -> tuple:
    """Record that an asynchronous staged call will write ``tensors`` when ``finish()`` runs; returns the token
    to pass to :func:`written`."""
    number, spans = next(state.tokens), _spans(tensors)
    with state.pending_lock:
        for storage, each in spans.items():
            state.pending_writes.setdefault(storage, {})[number] = (each, finish)
    return number, tuple(spans)


def written(token: tuple | None) -> None:
    """The call recorded under ``token`` by :func:`expect_writes` has written its tensors, or never will."""
    if token is None:
        return
    number, storages = token
    with state.pending_lock:
        for storage in storages:
            calls = state.pending_writes.get(storage)
            if calls is not None:
                calls.pop(number, None)
                if not calls:
                    del state.pending_writes[storage]


def finish_writes_to(tensors) -> None:
    """Finish every asynchronous staged call that will write memory of ``tensors`` (waiting for it), so that a new
    call reads and writes them after it, as a call on the same accelerator stream would."""
    if not state.pending_writes:
        return
    found = []
    with state.pending_lock:
        for storage, spans in _spans(tensors).items():
            for pending, finish in state.pending_writes.get(storage, {}).values():
                if any(start < end_ and start_ < end for start, end in pending for start_, end_ in spans):
                    found.append(finish)
    for finish in found:
        try:
            finish()
        except Exception:  # that call failed: its handle raises it where torch would, and it writes nothing
            pass


def needs_staging(value, source: str = "cpu") -> bool:
    """Whether ``value`` is a tensor that a staged call copies: a strided (dense), non-nested, non-quantized tensor
    on a device of type ``source`` (the host's, or for staging through the host an accelerator's). Sparse, nested
    and quantized tensors are never staged, nor host tensors of a subclass with a ``__torch_dispatch__`` of its own
    (DTensor, a wrapper of two tensors: their bytes are not their values; see ``_devices.unstaged_layout``)."""
    return (
        isinstance(value, torch.Tensor)
        and (value.is_cpu if source == "cpu" else value.device.type == source)
        and value.layout == torch.strided
        and not value.is_nested
        and not value.is_quantized
        and (source != "cpu" or type(value).__torch_dispatch__ is _PLAIN_DISPATCH)
    )


_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__  # (torch's own: disabled)


class StagedArguments:
    """The tensor arguments of one call, staged through ``device``: tensors on ``source`` (:func:`needs_staging`)
    are replaced by tensors on ``device``, others are passed as they are. A tensor the call reads is copied there
    (:func:`to_staging`); one it only writes gets fresh memory there. After the call, :meth:`complete` copies
    what the call wrote back into the caller's own tensor objects.

    Args:
        device: the staging device: an accelerator for host tensors, or the host (``cpu``) for accelerator ones.
        source: the device type of the tensors staged (``"cpu"``, or the accelerator's staged through the host).
    """

    def __init__(self, device: torch.device, source: str = "cpu"):
        self.device = device
        self.source = source
        self._written: list[tuple[torch.Tensor, torch.Tensor]] = []  # (caller's tensor, staged tensor)
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # every (caller's, staged) tensor, read or written
        self._copied = False
        self._lock = threading.Lock()

    def stage(self, value, reads: bool, writes: bool):
        """``value`` (a tensor, ``None``, or a list or tuple of them, nested) with host tensors staged."""
        if isinstance(value, (list, tuple)):
            return type(value)(self.stage(v, reads, writes) for v in value)
        if not needs_staging(value, self.source):
            return value
        with torch.no_grad():
            if reads:
                staged = to_staging(value, self.device)
            else:
                finish_writes_to([value])  # written after what an outstanding call writes there
                # (pinned where it goes back to an accelerator: that copy is asynchronous)
                pinned = self.device.type == "cpu" and not value.is_cpu
                staged = torch.empty(value.shape, dtype=value.dtype, device=self.device, pin_memory=pinned)
        if writes:
            self._written.append((value, staged))
        self.pairs.append((value, staged))
        return staged

    def callers(self) -> list[torch.Tensor]:
        """The caller's tensors the call writes, in argument order."""
        return [caller for caller, _ in self._written]

    def copy_back(self) -> None:
        """Write each staged result into the caller's tensor (same object, strides and storage): a host tensor is
        complete when this returns (all D2H copies are queued, then waited for once); an accelerator tensor staged
        through the host is written by a copy on its device's current stream, which later work there follows, as
        with the accelerator's own collectives. Only the first call copies (several work handles of one
        ``batch_isend_irecv`` share one copy back). Written through ``.data``, so the caller's version counter
        stays as it was: torch's collectives write from C++ without bumping it, and a tensor autograd saved for
        backward stays usable."""
        with self._lock:
            if self._copied:
                return
            with torch.no_grad():
                for caller, staged in self._written:
                    # Asynchronous where pinned memory is on one side: into a pinned host tensor, or out of one.
                    non_blocking = _is_pinned(caller) or (not caller.is_cpu and _is_pinned(staged))
                    with writable(caller):
                        bits(caller.data).copy_(bits(staged), non_blocking=non_blocking)
            _finish_on(self.device)
            self._copied = True

    def complete(self, result, tensors=None):
        """Finish the call that returned ``result``: a work handle (``async_op=True``, ``isend``, ``irecv``)
        becomes a :class:`StagedWork` that copies back when waited; a future (``all_reduce_coalesced`` with
        ``async_op=True`` returns one) becomes one that copies back when it completes and gives the caller's tensors;
        anything else is returned after the copy back. ``tensors``: what the handle's ``result()`` and future give
        (default: the caller's tensors the call writes)."""
        tensors = self.callers() if tensors is None else tensors
        if isinstance(result, dist.Work):
            return StagedWork([result], self.copy_back, tensors, writes_to=self.callers(), pairs=self.pairs)
        if isinstance(result, torch._C.Future):  # torch.futures.Future subclasses it; c10d returns the base
            done = torch.futures.Future()
            token = expect_writes(self.callers(), done.wait)

            def finished(future: torch.futures.Future) -> None:
                try:
                    future.value()  # the collective's error, as torch raised it
                    self.copy_back()
                except Exception as error:
                    done.set_exception(error)
                else:
                    done.set_result(tensors)
                finally:
                    written(token)

            result.add_done_callback(finished)
            return done
        self.copy_back()
        return result


class _Completion:
    """What is left of an asynchronous call staged whole once it is issued: wait for each of its collectives' works
    (once each: a Gloo receive's ``wait()`` blocks if called again), then write the results into the caller's
    tensors (``finish``), once. Shared by its handle (:class:`StagedWork`), a later staged call on the same memory
    (:func:`finish_writes_to`), a future's callback and, once the caller drops the handle unwaited, the writer
    thread: whichever comes first finishes the call."""

    def __init__(self, works, finish: Callable[[], None], done=None, error=None):
        self.works, self.finish, self.done, self.error = works, finish, done, error
        self.process = os.getpid()  # (a forked child's writer never takes its parent's calls: _dropped)
        self.finished = False
        self.waited = 0  # how many of the works have been waited
        self.token = None  # of expect_writes
        self.quiet = None  # (silent)
        self.wait_lock = threading.Lock()  # held while waiting works; never by a future's callback
        self.finish_lock = threading.Lock()  # held while writing the results

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        if self.error is not None:
            raise self.error
        if self.finished and self.waited == len(self.works):
            return True
        with self.wait_lock:  # (after a future's callback finished the call: each work waited once all the same,
            # so that its own handle has completed, as torch's does after wait(), before result() asks it)
            while self.waited < len(self.works):
                if self.error is not None:  # (failed in another thread's wait)
                    raise self.error
                work = self.works[self.waited]
                try:
                    work.wait(timeout) if timeout else work.wait()
                except Exception as error:
                    if not timeout:  # a timeout ends this wait only; the collective goes on, as with torch's
                        self.fail(error)
                    raise
                self.waited += 1
        return self.settle()

    def silent(self) -> bool:
        """Whether a work of the call cannot tell that it completed until it is waited: one without a future
        (Gloo's point-to-point works and its ``reduce_scatter_tensor``: their ``is_completed()`` stays false until
        ``wait()``), which only a wait can finish. Asked once."""
        if self.quiet is None:
            self.quiet = not all(_has_future(work) for work in self.works)
        return self.quiet

    def completed(self) -> bool:
        """Whether :meth:`wait` would return at once: the call finished, failed, or its works all completed."""
        if self.finished or self.error is not None:
            return True
        return all(work.is_completed() for work in self.works[self.waited :]) and (
            self.done is None or self.done.query())

    def fail(self, error: Exception) -> None:
        self.error = error
        written(self.token)

    def settle(self) -> bool:
        """Once, after every work completed: write the results."""
        with self.finish_lock:
            if self.error is not None:
                raise self.error
            if not self.finished:
                try:
                    self.finish()
                except Exception as error:
                    self.fail(error)
                    raise
                written(self.token)
                self.finished = True
        return True


def _has_future(work) -> bool:
    try:
        work.get_future()
    except (RuntimeError, AttributeError):  # "Work::getFuture not implemented"; a stand-in without one
        return False
    return True


# Calls whose handles were dropped unwaited (state.unwaited), finished by one writer thread (state.writer, started
# with the first handle, never from a finalizer). A SimpleQueue: its put() may run in a weakref callback, at any
# point of any thread.
POLL_SECONDS = (1e-4, 1e-2)  # the writer's pause between polls of outstanding calls: first, and at most (doubling)


def _dropped(call: _Completion) -> None:
    if call.process != os.getpid():  # a parent's call, dropped in a forked child: never finished there
        _state.keep(call)
    elif not call.finished and call.error is None:
        state.unwaited.put(call)


def _start_writer() -> None:
    with state.writer_lock:
        if state.writer is None:
            thread = threading.Thread(target=_write_unwaited, args=(state.unwaited,), name="offload_shim_unwaited",
                                      daemon=True)
            thread.start()  # (a daemon: a call its peers never join would keep the process from exiting)
            state.writer = thread


def _write_unwaited(unwaited: queue.SimpleQueue) -> None:
    """The writer thread: finish each dropped handle's call once its collectives have completed, as torch's backends
    write a call whose handle nobody waits for. It polls the calls whose works tell when they completed, and never
    waits in one of them: a call whose peers are late holds up none of those (of its group or another). A call with
    a work that tells nothing until waited (:meth:`_Completion.silent`) is waited, the oldest first, once every call
    that could be finished in a poll has been: it is finished once its collective completes or fails (at the latest
    at its group's timeout), never polled for ever. The process exits with calls outstanding as it would without the
    shim. A failed call writes nothing; its error reaches no caller, as with torch's dropped handle."""
    outstanding: list[_Completion] = []
    pause = POLL_SECONDS[0]
    while True:
        if not outstanding:
            outstanding.append(unwaited.get())
        while not unwaited.empty():
            outstanding.append(unwaited.get())
        waiting, silent = [], None
        for call in outstanding:
            try:
                if not call.completed():
                    waiting.append(call)
                    if silent is None and call.silent():
                        silent = call
                    continue
                call.wait()  # (returns at once: every work completed)
            except Exception as error:  # noqa: BLE001 - the thread goes on for the other calls
                _log.debug("offload_shim: a call whose handle was dropped unwaited failed: %r", error)
        if silent is not None:
            waiting.remove(silent)
            try:
                silent.wait()
            except Exception as error:  # noqa: BLE001
                _log.debug("offload_shim: a call whose handle was dropped unwaited failed: %r", error)
        pause = POLL_SECONDS[0] if len(waiting) < len(outstanding) else min(2 * pause, POLL_SECONDS[1])
        outstanding = waiting
        if outstanding and silent is None:
            time.sleep(pause)


def counterparts(results, pairs) -> list:
    """The caller's side of ``results``, what a backend handle of a staged call gives (``result()``, its future's
    value): a tensor that lies in a staged tensor's memory becomes the same view of the caller's tensor it stands for
    (Gloo's gather into one tensor gives one view of the output per rank); the staged tensor itself, or a view that
    the caller's layout or dtype cannot hold, the caller's tensor; anything else as it is.

    Args:
        results: the backend's answer (a list of tensors).
        pairs: ``(caller's tensor, staged tensor)`` of each staged argument."""
    return [_counterpart(tensor, pairs) for tensor in results]


def _counterpart(tensor, pairs):
    if not isinstance(tensor, torch.Tensor):
        return tensor
    start = tensor.untyped_storage().data_ptr() + tensor.storage_offset() * tensor.element_size()
    for caller, staged in pairs:
        base = staged.untyped_storage().data_ptr() + staged.storage_offset() * staged.element_size()
        if not base <= start < base + max(staged.numel(), 1) * staged.element_size():
            continue
        if tensor.dtype != caller.dtype or staged.dtype != caller.dtype or staged.stride() != caller.stride() or (
            tensor.size() == staged.size() and tensor.stride() == staged.stride() and start == base
        ):
            return caller
        offset = caller.storage_offset() + tensor.storage_offset() - staged.storage_offset()
        return caller.as_strided(tensor.size(), tensor.stride(), offset)
    return tensor


class _StagedHandle(dist.Work):
    """What the work handles of staged calls share: ``synchronize()``, ``block_current_stream()`` and ``result()``
    end as ``wait()`` does (the results are host memory: nothing to order on a stream), and what describes the
    collective rather than the copies is its own handle's answer (its errors included: Gloo's ``sourceRank()`` of a
    send, ``getDuration()``; torch's test_send_recv_any_source asks ``_source_rank()`` of an irecv from any
    source). ``wait()`` writes the results, and a Ctrl-C during it is raised once they are written, as after
    torch's wait() (``_interrupts``). Subclasses set ``_works``, ``_tensors`` and :meth:`_wait`."""

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        with _interrupts.held():
            return self._wait(timeout)

    def _wait(self, timeout: datetime.timedelta) -> bool:
        raise NotImplementedError

    def _described_by(self):
        """The handle that describes the collective: its first."""
        return self._works[0]

    def synchronize(self) -> None:
        self.wait()

    def block_current_stream(self) -> None:
        self.wait()

    def result(self) -> list[torch.Tensor]:
        """What the backend's own handle of the collective gives (its error too: Gloo's ``reduce_scatter_tensor``
        has no ``result()``), in the caller's tensors: see :func:`counterparts`."""
        self.wait()
        return self._counterparts(self._described_by().result())

    def _counterparts(self, results) -> list[torch.Tensor]:
        """``results``, a handle's answer on staged tensors, as the caller's tensors (subclasses: how)."""
        return list(self._tensors)

    def source_rank(self) -> int:
        return self._described_by().source_rank()

    def _source_rank(self) -> int:
        return self._described_by()._source_rank()

    def _get_op_type(self) -> int:
        return self._described_by()._get_op_type()

    def _get_duration(self) -> float:
        return self._described_by()._get_duration()


class StagedWork(_StagedHandle):
    """Work handle of an asynchronous call run on staged tensors.

    Until the call is finished, the caller's tensors it writes hold what they held before the call: results are
    written into them by ``wait()``, ``synchronize()``, ``result()``, ``is_completed()`` once it returns ``True``,
    the future of ``get_future()``, or a later staged call on the same memory (which finishes this one first); a
    handle dropped unwaited, by a writer thread once the collective completes. If the collective failed, those
    raise torch's own exception (``is_completed()`` returns ``True``, as torch's does) and nothing is written.

    Args:
        works: the work handles of the collective(s) run on the staged tensor (one per chunk).
        finish: writes the results into the caller's tensors; called once, after every work succeeded.
        tensors: what ``result()`` and the future return (the caller's tensors).
        done: an event that has completed once ``finish`` can run without blocking, if known.
        writes_to: the caller's tensors ``finish`` writes (default ``tensors``).
        error: an exception the call already met (raised by ``wait()``, as torch raises it there).
        pairs: ``(caller's tensor, staged tensor)`` of every staged argument, through which the backend handle's
            ``result()`` and future values are given as the caller's tensors (:func:`counterparts`); without them,
            ``tensors``.
    """

    def __init__(self, works, finish: Callable[[], None], tensors, done=None, writes_to=None, error=None,
                 pairs=None):
        super().__init__()
        self._works = works
        self._pairs = pairs
        self._tensors = tensors
        self._call = call = _Completion(works, finish, done, error)
        if error is None:
            call.token = expect_writes(tensors if writes_to is None else writes_to, call.wait)
            if state.writer is None:
                _start_writer()
            # Dropped unwaited, the call is finished by the writer thread, as torch's backends finish theirs.
            weakref.finalize(self, _dropped, call).atexit = False

    def _wait(self, timeout: datetime.timedelta) -> bool:
        return self._call.wait(timeout)

    def _counterparts(self, results) -> list[torch.Tensor]:
        return list(self._tensors) if self._pairs is None else counterparts(results, self._pairs)

    def is_completed(self) -> bool:
        if self._call.finished or self._call.error is not None:
            return True
        if not self._call.completed():
            return False
        try:
            self.wait()
        except Exception:
            pass  # completed with an error, as torch's handle: wait() raises it
        return True

    def is_success(self) -> bool:
        return self._call.error is None and all(work.is_success() for work in self._works)

    def exception(self):
        if self._call.error is not None:
            return self._call.error
        for work in self._works:
            try:
                error = work.exception()
            except TypeError:  # torch 2.11's NCCL work returns an exception_ptr pybind cannot convert
                continue
            if error is not None:
                return error
        return None

    def get_future_result(self) -> torch.futures.Future:
        """A future of the collective's ``WorkResult`` (an int), as its own handle's: only where that handle has
        one (NCCL; Gloo raises, as torch's does); completed once the caller's tensors hold the result."""
        results = torch.futures.collect_all([work.get_future_result() for work in self._works])
        done = torch.futures.Future()

        def finished(futures) -> None:
            results = torch._C._distributed_c10d.WorkResult
            codes = [f.value() for f in futures.value()]
            failed = next((code for code in codes if code != int(results.SUCCESS)), None)
            if failed is None:
                try:
                    self._call.settle()
                except Exception:  # the results could not be written
                    failed = int(results.COMM_ERROR)
            done.set_result(int(results.SUCCESS) if failed is None else failed)

        results.add_done_callback(finished)
        return done

    def get_future(self) -> torch.futures.Future:
        """A future of the caller's tensors, completed once they hold the result, or with torch's exception."""
        done = torch.futures.Future()

        def finished(futures: torch.futures.Future) -> None:
            # Runs where torch completes the last future (a backend's thread): it waits on no work, and takes no lock
            # that a thread waiting on a work holds.
            try:
                values = []
                for each in futures.value():
                    try:
                        values.append(each.value())  # the collective's error, as torch raised it
                    except Exception as error:
                        self._call.fail(error)
                        raise
                self._call.settle()
                answer = self._counterparts(values[self._works.index(self._described_by())]) if values else list(
                    self._tensors)
            except Exception as error:
                done.set_exception(error)
            else:
                done.set_result(answer)

        if self._call.error is not None or not self._works:
            finished(torch.futures.collect_all([]))
        else:
            torch.futures.collect_all([work.get_future() for work in self._works]).add_done_callback(finished)
        return done


class BackgroundWork(_StagedHandle):
    """Work handle of an asynchronous chunked call: every collective of the call was issued before the handle was
    returned, and a background task (``completion``, a ``concurrent.futures`` future) waits for them and copies the
    results into the caller's tensors as they complete, as torch's own backends write an asynchronous call's
    results whenever they are done: the caller reads them after ``wait()``, as with torch's handle. If the call
    failed, ``wait()``, ``result()`` and the future raise its error (part of the caller's tensors may then have been
    written, as by a collective that fails midway).

    Args:
        works: the handles of the call's collectives, in the order issued (for what describes the collective).
        completion: the future of the background task.
        tensors: what ``result()`` and the future give (the caller's tensors).
        writes_to: the caller's tensors the task writes (a later staged call on their memory waits for it first).
    """

    def __init__(self, works, completion: concurrent.futures.Future, tensors, writes_to):
        super().__init__()
        self._works = works
        self._completion = completion
        self._tensors = tensors
        token = expect_writes(writes_to, completion.exception)  # (waits, raises nothing)
        completion.add_done_callback(lambda _: written(token))

    def _wait(self, timeout: datetime.timedelta) -> bool:
        if timeout and not concurrent.futures.wait([self._completion], timeout.total_seconds()).done:
            raise RuntimeError(f"offload_shim: a staged asynchronous call did not complete within {timeout}")
        self._completion.result()
        return True

    def _described_by(self):
        return self._works[-1]  # a chunk's (the first is the ranks' agreement)

    def _counterparts(self, results) -> list[torch.Tensor]:
        """A chunk's answer for the whole call: one tensor (every backend's elementwise collective; NCCL's gather),
        the caller's; one per rank (Gloo's gather into one tensor, cut along its first dimension), the caller's
        output cut the same way."""
        if len(results) > 1:
            return list(self._tensors[0].chunk(len(results)))
        return list(self._tensors)

    def is_completed(self) -> bool:
        return self._completion.done()

    def is_success(self) -> bool:
        return self._completion.done() and self._completion.exception() is None

    def exception(self):
        return self._completion.exception() if self._completion.done() else None

    def get_future(self) -> torch.futures.Future:
        """A future of the caller's tensors, completed once they hold the result, or with the call's error."""
        done = torch.futures.Future()

        def finished(completion) -> None:
            error = completion.exception()
            if error is None:
                try:
                    done.set_result(self._counterparts(self._described_by().result()))
                except Exception as error:  # noqa: BLE001 - the backend's own handle has no result()
                    done.set_exception(error)
            else:
                done.set_exception(error)

        self._completion.add_done_callback(finished)
        return done

    def get_future_result(self) -> torch.futures.Future:
        """A future of the call's ``WorkResult`` (an int), completed once the caller's tensors hold the result."""
        results = torch._C._distributed_c10d.WorkResult
        done = torch.futures.Future()
        self._completion.add_done_callback(
            lambda c: done.set_result(int(results.SUCCESS if c.exception() is None else results.COMM_ERROR))
        )
        return done
