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

Every rank decides alike (keys and counts come from the calls, the same on every rank), and in any case NCCL runs a
replayed collective like a launched one: every rank's calls on the group keep their order. A capture belongs to
its process group: ``destroy_process_group`` of that group (or of every group) drops it first. While the replay
runs, torch's watchdog does not watch it: the wait for it gives up after the group's timeout with
``torch.distributed.DistBackendError``, as torch's watchdog would.

Off with ``OFFLOAD_SHIM_GRAPHS=0``; not used under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (whose checks run per call),
while the current stream is being captured, or where a capture fails (that key then takes the slot path).
"""

from __future__ import annotations

import ctypes
import datetime
import threading
import time

import torch
import torch.distributed as dist

from offload_shim import _config, _staging

MAX_BYTES = 64 << 10  # larger calls take the slot path: copy time, not launches, is what they cost
MAX_CAPTURES = 64  # per process; later keys take the slot path
_CAPTURE_AT = 2  # a key's call that is captured (the first runs eagerly: it makes the communicator)
_SEEN_LIMIT = 4096  # keys counted before the count starts over


class _Capture:
    __slots__ = ("group", "graph", "host_in", "host_out", "slot", "nbytes", "pending")

    def __init__(self, group, graph, host_in, host_out, slot):
        self.group = group
        self.graph = graph
        self.host_in, self.host_out, self.slot = host_in, host_out, slot
        self.nbytes = host_in.numel()
        self.pending = None  # an event after a replay that nobody waited for: it may still read host_in


_lock = threading.Lock()  # around changes to the two tables; lookups are single dict reads
_captures: dict[tuple, _Capture | None] = globals().get("_captures", {})  # key -> capture (None: not capturable)
_seen: dict[tuple, int] = globals().get("_seen", {})  # key -> calls so far, until captured
_nccl_groups: dict[int, tuple[object, bool]] = globals().get("_nccl_groups", {})  # id(group) -> (group, NCCL?)


def _replayable(group: dist.ProcessGroup, device: torch.device) -> bool:
    if device.type != "cuda" or not _config.settings().graphs:
        return False
    known = _nccl_groups.get(id(group))
    if known is None or known[0] is not group:
        nccl = str(dist.get_backend(group)).lower() == "nccl" and dist.get_debug_level() != dist.DebugLevel.DETAIL
        known = _nccl_groups[id(group)] = (group, nccl)
    return known[1] and not torch.cuda.is_current_stream_capturing()


def stage_small(tensor: torch.Tensor, device: torch.device, group: dist.ProcessGroup, call: tuple, run,
                *, reads: bool, writes: bool) -> bool:
    """Run a small synchronous in-place collective on host ``tensor`` by replaying its captured graph, capturing it
    first at the key's second call. ``call``: the collective's name and its arguments other than the tensor
    (hashable); ``run(staged)`` runs it on a device tensor of ``tensor``'s shape and dtype, as for
    ``_staging.stage_small_in_place``. Returns ``False``, having done nothing, where the call is not replayed (the
    caller then takes the slot path); ``True`` once ``tensor`` holds the result (for a call that only reads: once
    its bytes are copied).

    Raises:
        torch.distributed.DistBackendError: the replay did not finish within the group's timeout.
    """
    if tensor.nbytes > MAX_BYTES or not tensor.is_contiguous() or not _replayable(group, device):
        return False
    key = (threading.get_ident(), group, device, tensor.dtype, tensor.shape, call)
    try:
        capture = _captures.get(key, False)
    except TypeError:  # an argument that cannot be a key (a PREMUL_SUM reduce op)
        return False
    if capture is False:
        with _lock:
            seen = _seen.get(key, 0) + 1
            if seen < _CAPTURE_AT or len(_captures) >= MAX_CAPTURES:
                if len(_seen) >= _SEEN_LIMIT:
                    _seen.clear()
                _seen[key] = seen
                return False
            _seen.pop(key, None)
        capture = _capture(group, tensor, device, run)
        with _lock:
            _captures[key] = capture
    if capture is None:
        return False
    if _staging._pending:
        _staging.finish_writes_to((tensor,))
    if capture.pending is not None:
        capture.pending.synchronize()
        capture.pending = None
    if reads:
        ctypes.memmove(capture.host_in.data_ptr(), tensor.data_ptr(), capture.nbytes)
    stream = torch.cuda.current_stream(device)
    capture.graph.replay()
    if not writes:
        capture.pending = stream.record_event()
        return True
    try:
        _wait(stream, group)
    except BaseException:
        capture.pending = stream.record_event()  # the next call waits for this replay before reusing the buffers
        raise
    ctypes.memmove(tensor.data_ptr(), capture.host_out.data_ptr(), capture.nbytes)
    return True


def _capture(group, tensor: torch.Tensor, device: torch.device, run) -> _Capture | None:
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
    return _Capture(group, graph, host_in, host_out, slot) if result is None else None


def _wait(stream, group) -> None:
    """Wait for ``stream``: by polling (a replay of a few bytes finishes in microseconds), sleeping between polls
    after the first millisecond, and giving up after the group's timeout."""
    if stream.query():
        return
    start = time.monotonic()
    timeout = None
    while not stream.query():
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
    """Drop the captures of ``group`` (of every group for ``None``) once their last replays have finished: called
    before the group is destroyed, while its communicator still exists."""
    with _lock:
        keys = [key for key in _captures if group is None or key[1] is group]
        dropped = [_captures.pop(key) for key in keys]
        for key in [key for key in _seen if group is None or key[1] is group]:
            del _seen[key]
        if group is None:
            _nccl_groups.clear()
        else:
            _nccl_groups.pop(id(group), None)
    devices = {capture.slot.device for capture in dropped if capture is not None}
    for device in devices:
        torch.cuda.synchronize(device)


def captures() -> int:
    """How many captured calls this process holds (for tests and the doctor)."""
    return sum(capture is not None for capture in _captures.values())
