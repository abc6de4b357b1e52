"""Small staged calls replayed from a CUDA graph.

A synchronous ``all_reduce``, ``broadcast`` or ``reduce`` of a few bytes (a gradient norm, a loss, a per-step flag)
recurs every step with the same process group, shape, dtype and arguments. Staged through a slot
(``_staging.stage_small_in_place``) each call pays the launch of an H2D copy, of torch's collective and of a
blocking D2H copy. On a NCCL group the shim captures, at a call's second occurrence in a thread, one CUDA graph
of the staged call: an H2D copy from a pinned input buffer, torch's own collective on a device buffer, a D2H copy
into a pinned output buffer. That call and every later one with the same key copy the caller's bytes into the
pinned input, replay the graph on the current stream (after the work queued there, as the slot path's copies),
wait for it, and copy the pinned output into the caller's tensor: one launch instead of three, and no copy
launched through torch. Results are the collective's bytes, as on the slot path; a call that only reads (a
broadcast's source, a reduce's other ranks) returns once the caller's bytes are copied, without waiting for the
collective.

A key is the thread, the process group, the tensor's type, dtype and size in bytes (an elementwise collective of a
contiguous tensor moves the same bytes whatever its shape), and the call's other arguments as given, with their
types. A later call whose other arguments are the very objects of a replayed call's finds the capture by their
identity, without hashing their values (a ``ReduceOp``'s hash alone costs more than the rest of the lookup). A call
whose key was captured replays before the shim decides anything (:func:`replayed`, the
wrapper's first step after it finds the group does not serve the host): the decision is taken again only where
something it depended on may have changed (the settings, the current device, a staged call around it, a coalescing
manager, a stream capture, INFO logging of first calls), and then the call replays from the same capture if the
decision stands. Measured on one H200 (results/gpu/2026-12-01-one-h200-small-call-parts/): a 0-dim all_reduce
replayed after the whole decision took 29.9 us, against 36.9 us staged by hand; replayed after the lookup, 16.7 us
against 36.6.

Every rank decides alike (keys and counts come from the calls, the same on every rank), and in any case NCCL runs a
replayed collective like a launched one: every rank's calls on the group keep their order. A capture belongs to
its process group: ``destroy_process_group`` of that group (or of every group) drops it first. While the replay
runs, torch's watchdog does not watch it: the wait for it gives up after the group's timeout with
``torch.distributed.DistBackendError``, as torch's watchdog would.

Off with ``OFFLOAD_SHIM_GRAPHS=0``; not used under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (whose checks run per call),
while the current stream is being captured, for PREMUL_SUM (whose factor a key cannot see), for lazily conjugated or
negated views (whose bytes are not their values), or where a capture fails (that key then takes the slot path).
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import threading
import time
from time import perf_counter

import torch
import torch.distributed as dist

from offload_shim import _config, _counters, _devices, _interrupts, _staging
from offload_shim._state import state

MAX_BYTES = 64 << 10  # larger calls take the slot path: copy time, not launches, is what they cost
MAX_CAPTURES = 64  # per process; later keys take the slot path
_CAPTURE_AT = 2  # a key's call that is captured (the first runs eagerly: it makes the communicator)
_SEEN_LIMIT = 4096  # keys counted before the count starts over


class _Capture:
    __slots__ = ("group", "record", "index", "settings", "reads", "writes", "graph", "host_in", "host_out", "slot", "nbytes",
                 "into", "out_of", "caller", "caller_bytes", "done", "pending", "stream", "raw", "counts")

    def __init__(self, group, device, graph, host_in, host_out, slot, reads: bool, writes: bool, settings, counts):
        self.group, self.record, self.index = group, _devices.record(group), _index(device)
        self.settings = settings  # those under which the decision to replay was last made
        self.reads, self.writes = reads, writes
        self.graph = graph
        self.host_in, self.host_out, self.slot = host_in, host_out, slot
        self.nbytes = host_in.numel()
        self.into, self.out_of = bytes_at(host_in.data_ptr(), self.nbytes), bytes_at(host_out.data_ptr(), self.nbytes)
        self.caller, self.caller_bytes = 0, None  # the address of the last caller's tensor, and its bytes_at view
        self.done = torch.cuda.Event()
        self.pending = False  # ``done`` marks a replay that nobody waited for: it may still read host_in
        self.stream, self.raw = None, None  # where it was last replayed, and that stream's raw pointer
        self.counts = counts  # its replays without a decision (_counters.tally): this thread's alone


# state.captures: captures by key (:func:`_key`), None where a key cannot be captured. A key names no device: a
# capture holds the device it was decided for, and replays only while the decision stands. Changed under
# state.replay_lock; lookups are single dict reads. state.captures_by_identity: the captures found by the identity of
# a call's arguments (:func:`replayed`): (capture, the objects whose ids the key holds, kept alive so that no other
# object takes an id); a cache of state.captures, emptied whenever one is dropped.
_world = dist.distributed_c10d._world
# The groups inside torch's _coalescing_manager: the dict that _World makes once and torch only changes in place.
_coalescing = getattr(_world, "pg_coalesce_state", {})
# Asked on every replayed call: torch's own functions under its public ones (which add a Python frame), where
# this torch has them.
_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)
_query = getattr(getattr(torch._C, "_CudaStreamBase", None), "query", None) or torch.cuda.Stream.query
_graph_replay = getattr(getattr(torch._C, "_CUDAGraph", None), "replay", None) or torch.cuda.CUDAGraph.replay
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_query_event = getattr(getattr(torch._C, "_CudaEventBase", None), "query", None) or torch.cuda.Event.query
_get_ident = threading.get_ident
_INFO = logging.INFO
_STRIDED = torch.strided
_log = logging.getLogger("offload_shim")


def call_key(function, args: tuple, kwargs: dict, at: int = 0) -> tuple:
    """What identifies a call of ``function`` (the collective torch runs) but its tensor (positional argument
    ``at`` or keyword ``tensor``): its other arguments as given, and their types (``op=0`` equals ``ReduceOp.SUM``,
    but torch refuses it). The same call spelled otherwise (a keyword given by position) is another key."""
    if len(args) > at:
        rest = args[:at] + args[at + 1 :]
        return function, rest, tuple(kwargs.items()), rest and tuple(map(type, rest)), tuple(map(type, kwargs.values()))
    items = tuple(item for item in kwargs.items() if item[0] != "tensor")
    return function, args, items, args and tuple(map(type, args)), tuple(type(value) for _, value in items)


def _key(tensor: torch.Tensor, group, call: tuple) -> tuple:
    # (The size in bytes, not the shape: an elementwise collective of a contiguous tensor moves the same bytes.)
    return _get_ident(), group, type(tensor), tensor.dtype, tensor.nbytes, call


def replayed(tensor: torch.Tensor, group: dist.ProcessGroup, function, args: tuple, kwargs: dict, at: int = 0) -> bool:
    """Replay the capture of this call of ``function`` (the collective torch runs) with host ``tensor``
    on ``group`` (``args`` and ``kwargs`` as given, the tensor at position ``at`` or keyword ``tensor``), where one
    exists for this thread and every input of the decision that made it still holds: the settings, a dense
    contiguous tensor with memory and no lazy conjugation or negation, the current device, no staged call around
    it, no coalescing manager on the group, no stream capture, no INFO logging of first calls. Returns ``False``,
    having done nothing, otherwise: the caller then decides as for any call. ``True`` once ``tensor`` holds the
    result (for a call that only reads: once its bytes are copied). The first check of every call on a group that
    does not serve the host: a call whose other arguments are the same objects as a replayed call's finds its
    capture by their identity (``state.captures_by_identity``), without hashing their values.

    Raises:
        torch.distributed.DistBackendError: the replay, or the one before it that nobody waited for, did not finish
            within the group's timeout; the caller's tensor is unchanged.
    """
    if tensor.layout is not _STRIDED or tensor.is_nested or tensor.is_conj() or tensor.is_neg():
        return False
    if len(args) > at:
        if len(args) == 1:  # (the tensor alone by position, as most calls give it)
            rest = ()
            identity = (_get_ident(), function, type(tensor), tensor.dtype, tensor.nbytes, *kwargs,
                        *map(id, kwargs.values()))
        else:
            rest = args[1:] if at == 0 else args[:at] + args[at + 1 :]
            identity = (_get_ident(), function, type(tensor), tensor.dtype, tensor.nbytes, *map(id, rest), *kwargs,
                        *map(id, kwargs.values()))
        found = state.captures_by_identity.get(identity)
        if found is not None:
            capture = found[0]
        else:
            call = function, rest, tuple(kwargs.items()), rest and tuple(map(type, rest)), tuple(map(type, kwargs.values()))
            capture = _found(tensor, group, call)
            if capture is not None:
                if len(state.captures_by_identity) >= _SEEN_LIMIT:
                    state.captures_by_identity.clear()
                state.captures_by_identity[identity] = (capture, rest, tuple(kwargs.values()))
    else:
        capture = _found(tensor, group, call_key(function, args, kwargs, at))
    if (
        capture is None
        or capture.group is not group
        or capture.settings is not _config.settings()
        or not capture.record.unchecked.done()  # (run waits for it)
        or not tensor.is_contiguous()
        or state.thread.depth
        or _current_device() != capture.index
        or _capturing()
        or group in _coalescing  # (torch's _coalescing_manager records calls)
        or _log.isEnabledFor(_INFO)
    ):
        return False
    address = tensor.data_ptr()
    if not address:  # no memory (a zero tensor of autograd's): the decision says what torch does
        return False
    start = perf_counter()
    try:
        replay(capture, tensor, address)
    finally:
        counts = capture.counts
        counts[0] += 1
        counts[1] += perf_counter() - start
    return True


def _found(tensor: torch.Tensor, group, call: tuple) -> _Capture | None:
    try:
        return state.captures.get(_key(tensor, group, call))
    except TypeError:  # an argument that cannot be a key
        return None


def _replayable(group: dist.ProcessGroup, device: torch.device) -> bool:
    if device.type != "cuda" or not _config.settings().graphs:
        return False
    return _devices.record(group).nccl and not torch.cuda.is_current_stream_capturing()


def _premul_sum(call: tuple) -> bool:
    """Whether ``call`` (:func:`call_key`) reduces with PREMUL_SUM: its factor is not part of the op's equality,
    and a capture would keep the first call's factor."""
    values = (*call[1], *(value for _, value in call[2]))
    return any(isinstance(value, dist.ReduceOp) and value == dist.ReduceOp.PREMUL_SUM for value in values)


def capture_for(tensor: torch.Tensor, device: torch.device, group: dist.ProcessGroup, call: tuple, run,
                reads: bool, writes: bool, settings, counted: tuple[str, str]) -> _Capture | None:
    """The capture to replay for a small synchronous in-place collective on host ``tensor``, decided under
    ``settings`` to be staged through ``device``; made at the key's second call; ``None`` where the call is not
    replayed (the caller then takes the slot path). ``call``: :func:`call_key` of the call; ``run(staged)`` runs it
    on a device tensor of ``tensor``'s shape and dtype, as for ``_staging.stage_small_in_place``; ``reads`` and
    ``writes``: whether the collective reads and writes this rank's tensor; ``counted``: the op and route its
    replays are counted under. Later calls of the key replay through :func:`replayed` before any decision."""
    if (
        tensor.nbytes > MAX_BYTES
        or not tensor.is_contiguous()
        or tensor.is_conj()
        or tensor.is_neg()
        or not tensor.data_ptr()  # no elements, or no memory
        or not _replayable(group, device)
    ):
        return None
    key = _key(tensor, group, call)
    try:
        capture = state.captures.get(key, False)
    except TypeError:  # an argument that cannot be a key
        return None
    if capture is False:
        with state.replay_lock:
            seen = state.replay_seen.get(key, 0) + 1
            if len(state.captures) >= MAX_CAPTURES:
                _forget_threads_gone()
            if seen < _CAPTURE_AT or len(state.captures) >= MAX_CAPTURES:
                if len(state.replay_seen) >= _SEEN_LIMIT:
                    state.replay_seen.clear()
                state.replay_seen[key] = seen
                return None
            state.replay_seen.pop(key, None)
        capture = None if _premul_sum(call) else _capture(group, tensor, device, run, reads, writes, settings, counted)
        with state.replay_lock:
            state.captures[key] = capture
    if capture is None or capture.index != _index(device):  # (a group used from two devices: the slot path)
        return None
    capture.settings = settings  # decided again under these: replayed() may skip the decision
    return capture


def replay(capture: _Capture, tensor: torch.Tensor, address: int | None = None) -> None:
    """Copy ``tensor``'s bytes (at ``address``, its ``data_ptr()``) into the capture's pinned input, replay its
    graph on the current stream (after the work queued there, as the slot path's copies), and, for a call that
    writes, wait for it and copy the pinned output into ``tensor``.

    Raises:
        torch.distributed.DistBackendError: the replay, or the one before it that nobody waited for, did not finish
            within the group's timeout; ``tensor`` is unchanged.
    """
    if state.pending_writes:
        _staging.finish_writes_to((tensor,))
    if capture.pending:  # a replay that only read: it may still be reading the pinned input
        if not _query_event(capture.done):
            _wait(_query_event, capture.done, capture.group)
        capture.pending = False
    if address is None:
        address = tensor.data_ptr()
    if address != capture.caller:  # (a reused tensor, or memory reused at the same address: the same view)
        capture.caller_bytes, capture.caller = bytes_at(address, capture.nbytes), address
    caller = capture.caller_bytes
    if capture.reads:
        capture.into[:] = caller
    try:  # (a KeyboardInterrupt raised in this block comes after the launch: CPython runs handlers after a call)
        _graph_replay(capture.graph)
        raw = _raw_stream(capture.index)
        if raw == capture.raw:
            stream = capture.stream
        else:  # (another current stream than at its last replay)
            stream, capture.raw = _current_stream(capture.index), raw
            capture.stream = stream
        if not capture.writes:
            capture.done.record(stream)
            capture.pending = True
            return
        try:
            if not _query(stream):
                _wait(_query, stream, capture.group)
        except BaseException:
            capture.done.record(stream)  # the next call waits for this replay before reusing the buffers
            capture.pending = True
            raise
        caller[:] = capture.out_of
    except KeyboardInterrupt:
        _finish_interrupted(capture)
        raise


def _finish_interrupted(capture: _Capture) -> None:
    """After a Ctrl-C during a replay: finish it (wait for it, copy its result into the caller's tensor), holding
    further Ctrl-Cs back, so that the ``KeyboardInterrupt`` comes with the result written, as after torch's one C++
    call (``_interrupts``). The replay's path holds nothing back itself: that would cost it two system calls."""
    with _interrupts.held():
        stream = _current_stream(capture.index)
        capture.done.record(stream)  # (the next call of the key waits for it: recorded after the replay)
        capture.pending = True
        if capture.writes:
            if not _query(stream):
                _wait(_query, stream, capture.group)
            capture.caller_bytes[:] = capture.out_of


def bytes_at(address: int, nbytes: int) -> memoryview:
    """The ``nbytes`` bytes at host ``address`` as a writable memoryview that owns nothing: assigning one such view
    to another of the same length copies the bytes, as ``memcpy`` of the two addresses does (a slice assignment of 4
    bytes took a quarter of ``ctypes.memmove``'s foreign call on one H200's host, a tenth on the CPU machine). Use it
    only while the memory is the tensor's whose ``data_ptr()`` gave ``address``."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")


def _index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def _current_stream(index: int) -> torch.cuda.Stream:
    """The current stream of device ``index``: its Stream object made once per stream (``current_stream`` makes a
    new one per call, and costs more than the rest of a replay's bookkeeping)."""
    key = (index, _raw_stream(index))
    stream = state.streams.get(key)
    if stream is None:
        if len(state.streams) >= 64:
            state.streams.clear()
        stream = state.streams[key] = torch.cuda.current_stream(index)
    return stream


def _capture(group, tensor: torch.Tensor, device: torch.device, run, reads: bool, writes: bool, settings,
             counted: tuple[str, str]) -> _Capture | None:
    """The graph of the staged call (H2D from a pinned buffer, ``run``, D2H into a pinned buffer), captured on a
    side stream in this thread's capture mode (other threads' work is not disturbed); ``None`` if it cannot be."""
    with torch.inference_mode(False), torch.no_grad():
        host_in = torch.empty(tensor.nbytes, dtype=torch.uint8, pin_memory=True)
        host_out = torch.empty(tensor.nbytes, dtype=torch.uint8, pin_memory=True)
        slot = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        graph = torch.cuda.CUDAGraph()
        side, current = torch.cuda.Stream(device), torch.cuda.current_stream(device)
        side.wait_stream(current)
        slot_bytes = slot.reshape(-1).view(torch.uint8)
        try:
            with torch.cuda.stream(side), _staging.staged_call():
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    slot_bytes.copy_(host_in, non_blocking=True)
                    result = run(slot)
                    host_out.copy_(slot_bytes, non_blocking=True)
                finally:
                    graph.capture_end()
        except Exception:  # the backend or this torch cannot capture it: the slot path, from now on
            return None
        finally:
            current.wait_stream(side)
    if result is not None:
        return None
    counts = _counters.tally(*counted, _counters.REPLAYED, tensor.nbytes)
    return _Capture(group, device, graph, host_in, host_out, slot, reads, writes, settings, counts)


def _wait(query, work, group) -> None:
    """Wait for ``work`` (a stream or an event, ``query`` its class's own query function, without the Python frame of
    its public one): by polling (a replay of a few bytes finishes in microseconds), sleeping between polls after
    the first millisecond, and giving up after the group's timeout."""
    start = time.monotonic()
    timeout = None
    while not query(work):
        waited = time.monotonic() - start
        if waited > 1e-3:
            if timeout is None:
                timeout = _timeout(group)
            if waited > timeout:
                raise dist.DistBackendError(
                    f"offload_shim: a small staged collective replayed from a CUDA graph on process group "
                    f"{getattr(group, 'group_name', '?')!r} did not finish within the group's timeout ({timeout:g} s); "
                    f"a peer may have stopped. The caller's tensor is unchanged."
                )
            time.sleep(50e-6)


def _timeout(group) -> float:
    try:
        timeout = group._get_backend(torch.device("cuda")).options._timeout
    except Exception:  # a torch without that record: torch's default for NCCL
        timeout = getattr(dist.constants, "default_pg_nccl_timeout", None) or datetime.timedelta(minutes=10)
    return timeout.total_seconds()


def forget(group: dist.ProcessGroup | None = None) -> None:
    """Drop the captures of ``group`` (of every group for ``None``): called before the group is destroyed, while
    its communicator still exists. Never waits: a dropped capture's buffers and graph are kept until its last
    replay has finished (a replay on a stopped peer ends when torch aborts the communicator)."""
    with state.replay_lock:
        keys = [key for key in state.captures if group is None or key[1] is group]
        _retire([state.captures.pop(key) for key in keys])
        for key in [key for key in state.replay_seen if group is None or key[1] is group]:
            del state.replay_seen[key]


def prune() -> None:
    """Drop the captures of groups torch no longer has (destroyed while the shim was not installed)."""
    groups = getattr(_world, "pg_map", None)
    if groups is None:
        return
    with state.replay_lock:
        _retire([state.captures.pop(key) for key in [key for key in state.captures if key[1] not in groups]])


def _forget_threads_gone() -> None:  # under state.replay_lock
    alive = {thread.ident for thread in threading.enumerate()}
    _retire([state.captures.pop(key) for key in [key for key in state.captures if key[0] not in alive]])


def _retire(dropped) -> None:  # under state.replay_lock
    state.captures_by_identity.clear()
    for capture in dropped:
        if capture is None:
            continue
        _counters.fold(capture.counts)
        if capture.stream is not None:
            state.retired_captures.append((capture.stream.record_event(), capture))
    state.retired_captures[:] = [(event, capture) for event, capture in state.retired_captures if not event.query()]


def captures() -> int:
    """How many captured calls this process holds (for tests and the doctor)."""
    return sum(capture is not None for capture in state.captures.values())
