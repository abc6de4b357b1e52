"""The one executor: it runs any plan of ``_plan.decide``, synchronous or not, with the wire the plan says.

Modes (``_counters``), each only a way for this rank to copy:

* small: a synchronous in-place ``torch.distributed`` call of a few bytes, through this thread's reused slot
  (``_staging.stage_small_in_place``), or replayed from a CUDA graph captured from it (``_replay``);
* whole: every tensor the call reads copied to the staging device, torch's call on the staged tensors, what it
  writes copied back (``_staging.StagedArguments``); asynchronous, the handle copies back when waited;
* pipelined: the plan's chunks (:class:`_plan.Chunks`), each a collective of its own, after an agreement: one small
  ``all_reduce`` of what the ranks must share (the collective, the size, a reduction's dtype, the step), checked
  before the first chunk's collective, so that ranks that would split a call differently raise
  :class:`StagingError` instead of sending mismatched collectives.

A pipelined call sends the same collectives, synchronous or not. Synchronous (:func:`_run_sync`): through the
group's pool (``_groups.pool``), chunk ``i`` in slot ``i % 2``: H2D on the pool's H2D stream after the slot's
previous D2H, the collective launched with the H2D stream current (the backend's stream waits on that copy), D2H on
the pool's D2H stream after the collective; so a chunk's collective overlaps the next chunk's H2D and the previous
one's D2H. Asynchronous (:func:`_run_async`): every H2D and every collective is issued before the call returns its
handle, the call keeping its place in the group's order; a task on the group's completion lane ends the handle's
wait. On a backend that orders the device's streams (NCCL): pageable input is issued as the synchronous call issues
it, the lane doing what the sync call does after its last chunk; pinned input gets accelerator memory for every
chunk, so the call returns without waiting for the device, and the lane checks the ranks' agreement and queues each
chunk's D2H behind its collective (into pageable output through a pinned landing). On a backend
whose handles block the host (Gloo), accelerator memory for every chunk, and the lane waits for each chunk and
copies it back. Pageable host memory goes through pinned bounce buffers: host copies into them on the group's
``in`` lane, out of them on its ``out`` lane (or on the completion lane), beside the DMA. A pinned (or registered)
tensor is copied to and from directly. Chunk collectives are the group's own methods of torch's collectives
(``allreduce``, ``broadcast``, ``reduce``, ``all_gather_single``) with torch's options, whatever the entry point:
the same collectives for an eager, functional or compiled call.

Staging memory a call needs is obtained before anything is sent, so a rank that cannot get it raises before the
wire, as a rank that raises in torch does.
"""

from __future__ import annotations

import concurrent.futures
import logging

import torch
import torch.distributed as dist
import torch._C._distributed_c10d as _c10d

from offload_shim import _counters, _devices, _groups, _interrupts, _registration, _replay, _staging
from offload_shim._devices import StagingError, group_label
from offload_shim._plan import C10D, COMMUNICATOR, Chunks, Plan
from offload_shim._state import state
from offload_shim._table import AFTER_THE_WIRE, AUTOGRAD, BATCH, BOTH, ELEMENTWISE, NONE, READ, WRITE, overlapping

_log = logging.getLogger("offload_shim")

# Both chosen by measurement (benchmarks/bench_staging.py,
# results/gpu/2026-12-01-two-h200-gpu-tests-and-benchmark/bench.log): with pageable memory, bounce buffers with
# threaded host copies beat the runtime's own staged copy (49.7 against 55.5 ms for 256 MiB).
PAGEABLE_PATH = "bounce"  # or "driver": the runtime's own (synchronous) staged copy of the pageable chunk
# The process group's method that gathers each rank's part into one tensor, by its current name: torch 2.13's
# ``all_gather_single``; 2.11 has only ``_allgather_base``.
GATHER_METHOD = "all_gather_single" if hasattr(dist.ProcessGroup, "all_gather_single") else "_allgather_base"


class Caller:
    """torch's function (or a communicator's method) with the caller's arguments, for :func:`run`: ``call(replaced)``
    calls it with the tensor arguments of ``replaced`` (parameter name to value) in place of the caller's."""

    __slots__ = ("wrapped", "parameters", "args", "kwargs", "at", "settings")

    def __init__(self, wrapped, parameters, args, kwargs, at=0, settings=None):
        self.wrapped, self.parameters, self.args, self.kwargs, self.at = wrapped, parameters, args, kwargs, at
        self.settings = settings

    def call(self, replaced: dict):
        args, kwargs = self.args, self.kwargs
        for name, value in replaced.items():
            args, kwargs = self.parameters.replace(args, kwargs, name, value)
        return self.wrapped(*args, **kwargs)

    def replay_key(self) -> tuple:
        return _replay.call_key(self.wrapped, self.args, self.kwargs, self.at)


def run(plan: Plan, caller):
    """Run ``plan``; ``caller`` is the family's way to call torch on staged tensors: ``caller.call(replaced)`` runs
    the call with the tensor arguments of ``replaced`` (parameter name to value) in place of the caller's.

    Returns:
        What torch's call returns: ``None``, a work handle (``async_op=True``), a future, or the op's result.

    Raises:
        What torch raises of the call's tensors (the entry's refusals) where torch raises it: before anything is
        copied, or after the wire (:func:`_refusals`); :class:`StagingError` where the ranks disagree
        on a pipelined call; what the collective raises.
    """
    call = plan.call
    mode = plan.mode
    broken = None
    if call.group is not None:
        record = _devices.record(call.group)
        if not record.unchecked.done():
            concurrent.futures.wait([record.unchecked])  # an asynchronous call's agreement, checked on its lane
        broken = record.out_of_step
    if broken is not None:
        raise StagingError(f"offload_shim: process group {group_label(call.group)} is out of step since {broken}: "
                           f"its ranks' collectives no longer pair alike. Destroy it and make another.")
    _interrupts.hold()  # a Ctrl-C from here (or from the ranks' agreement) is raised once the call is done
    try:
        refused = _refusals(plan)
        try:
            if mode is _counters.SMALL:
                replayed, result = _small(plan, caller)
                if replayed:
                    mode = _counters.REPLAYED
            elif mode is _counters.PIPELINED:
                result = _pipelined(plan)
            else:
                result = _whole(plan, caller)
        finally:
            _counters.count(call.entry.label, mode, plan.nbytes)
    finally:
        _interrupts.release()
    if refused is None:
        return result
    if isinstance(result, dist.Work):  # raised by wait(), once the call has completed, as Gloo's handle does
        return _staging.StagedWork([result], lambda: _raise(refused), [], writes_to=[])
    if isinstance(result, torch._C.Future):  # (all_reduce_coalesced's): completed with the error, unwrapped
        failed = torch.futures.Future()
        result.add_done_callback(lambda _: failed.set_exception(refused))
        return failed
    raise refused


def _refusals(plan: Plan):
    """Check the call's tensors as the backend the call is staged on does (the entry's refusals, ``_table``, and for
    every tensor the call writes on this rank, memory shared between its elements): raise what it raises before
    anything is sent; return what it raises only after the wire (``AFTER_THE_WIRE``), or
    ``None``. Outputs that autograd would refuse (``AUTOGRAD``) are refused only where that backend also serves the
    host (Gloo); one that serves only the accelerator (NCCL) writes them from C++. Where one is refused after the
    wire, the refused arguments are replaced in ``plan.call`` by scratch tensors of their shapes: the call's
    collectives run as on every other rank, the caller's outputs stay unchanged, and the caller raises afterwards."""
    call, after = plan.call, []
    refused = None
    for arg in call.entry.args:
        role = arg.role_on(call.root)
        if role == NONE:
            continue
        for tensor in _tensors(call.values.get(arg.name)):
            error = None if arg.refusal is None else arg.refusal(tensor)  # (torch's own checks first)
            if error is None or arg.refusal in AUTOGRAD and _stream_ordered(call.group, plan.device):
                error = None if role == READ else overlapping(tensor)
                if error is not None:
                    raise error  # (before anything is staged, and not counted)
                continue
            if arg.refusal not in AFTER_THE_WIRE:
                raise error  # (before anything is staged, and not counted)
            refused = refused or error
            after.append(arg.name)
    if refused is None:
        return None
    for name in set(after):
        call.values = {**call.values, name: _scratch(call.values[name])}
    return refused


def _scratch(value):
    """Copies of ``value``'s tensors that are not the caller's (lists kept as lists): what the call reads of them
    is the caller's, what it writes goes nowhere."""
    if isinstance(value, (list, tuple)):
        return type(value)(_scratch(v) for v in value)
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _raise(error: BaseException):
    raise error


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for each in value:
            yield from _tensors(each)


def _reads_writes(plan: Plan, name: str) -> tuple[bool, bool]:
    if plan.call.entry.returns_new:
        return True, True  # a new result: every rank's input in, every rank's result out
    role = plan.call.role(name)
    return role in (READ, BOTH), role in (WRITE, BOTH)


# ---------------------------------------------------------------- small and whole


def _small(plan: Plan, caller) -> tuple[bool, object]:
    """``(replayed, result)`` of a small synchronous in-place call."""
    name = plan.call.entry.args[0].name
    tensor = plan.call.values[name]
    reads, writes = _reads_writes(plan, name)

    def run(staged):
        return caller.call({name: staged})

    if plan.device.type == "cuda":  # replayed from a CUDA graph where the group and the call allow it
        capture = _replay.capture_for(tensor, plan.device, plan.call.group, caller.replay_key(), run, reads, writes,
                                      caller.settings, (plan.call.entry.label, plan.route))
        if capture is not None:
            _replay.replay(capture, tensor)
            return True, None
    return False, _staging.stage_small_in_place(tensor, plan.device, run, reads=reads, writes=writes)


def _whole(plan: Plan, caller):
    """The call on its tensors staged whole (see the module docstring)."""
    call = plan.call
    entry = call.entry
    if entry is BATCH:
        return _batch(plan, caller)
    if call.family == COMMUNICATOR:
        return _registered(plan, caller)
    staged = _staging.StagedArguments(plan.device, plan.source)
    replaced = {}
    for arg in entry.args:
        if arg.name not in call.values:
            continue
        reads, writes = _reads_writes(plan, arg.name)
        if not (reads or writes):  # torch ignores it here (a gather's list on a rank that is not the root)
            continue
        replaced[arg.name] = staged.stage(call.values[arg.name], reads=reads, writes=writes and not entry.returns_new)
    with _staging.staged_call():
        result = caller.call(replaced)
        if call.family != C10D:  # a functional collective or op: its result is complete once waited
            result = _completed(result)
    if entry.returns_new:
        return _back(result, call.values, plan.source)
    if call.family != C10D:  # an in-place or out= op: the caller's own tensor receives the result and is returned
        staged.copy_back()
        return call.values[_written(entry)]
    single = len(entry.args) == 1 and isinstance(call.values.get(entry.args[0].name), torch.Tensor)
    return staged.complete(result, [call.values[entry.args[0].name]] if single else None)


def _registered(plan: Plan, caller):
    """A registered communicator's method on its tensors staged to its device, synchronously (``_communicators``):
    a tensor given for several parameters is staged once (read if any of them reads it); the staged copies are
    complete before the method runs, on whichever stream of the device; the device is synchronised after it; what
    it wrote, and a staged tensor it returns, are copied back into the caller's tensors, complete on return."""
    call, device = plan.call, plan.device
    callers, roles, copies = {}, {}, {}  # by the id of the caller's tensor
    for name, tensor in call.values.items():
        reads, writes = _reads_writes(plan, name)
        read, written = roles.get(id(tensor), (False, False))
        callers[id(tensor)], roles[id(tensor)] = tensor, (read or reads, written or writes)
    with torch.no_grad():
        for key, tensor in callers.items():
            copies[key] = (_staging.to_staging(tensor, device) if roles[key][0] else
                           torch.empty(tensor.shape, dtype=tensor.dtype, device=device))
    _staging._finish_on(device)
    with _staging.staged_call():
        result = caller.call({name: copies[id(tensor)] for name, tensor in call.values.items()})
    if device.type != "cpu":
        torch.accelerator.synchronize(device)  # the method's work, on any stream of the device, has finished
    back = [key for key in copies if roles[key][1] or result is copies[key]]
    with torch.no_grad():
        for key in back:
            with _staging.writable(callers[key]):
                _staging.bits(callers[key].data).copy_(_staging.bits(copies[key]),
                                                       non_blocking=_staging._is_pinned(callers[key]))
    for each in {device, *(callers[key].device for key in back)}:  # (a copy into another GPU ends on its stream)
        _staging._finish_on(each)
    if not isinstance(result, torch.Tensor):
        return result
    for key, copy in copies.items():
        if result is copy:
            return callers[key]
    if result.device != device:
        return result
    first = next((key for key in callers if roles[key][0]), next(iter(callers)))
    return _staging.to_caller(result, callers[first].device)


def _batch(plan: Plan, caller):
    """``batch_isend_irecv`` with each operation's tensor staged whole: a send's read, a receive's written."""
    operations = caller.operations
    staged = [_staging.StagedArguments(plan.device, plan.source) for _ in operations]
    tensors = [arguments.stage(operation.tensor, reads=sends, writes=not sends)
               for operation, arguments in zip(operations, staged)
               for sends in [operation.op is dist.distributed_c10d.isend]]
    with _staging.staged_call():
        works = caller.call(tensors)
    if len(works) == len(operations):  # one work per operation (Gloo): each handle finishes its own receive
        return [_staging.StagedWork([w], a.copy_back, a.callers(), pairs=a.pairs) for w, a in zip(works, staged)]

    def copy_back():
        for arguments in staged:
            arguments.copy_back()

    if not works:  # nothing to wait for
        copy_back()
        return works
    # One work for the batch (NCCL coalesces it): one handle, at every position, that waits the batch once and
    # copies every receive back.
    return [_staging.StagedWork(works, copy_back, [t for a in staged for t in a.callers()],
                                pairs=[pair for a in staged for pair in a.pairs])] * len(works)


def _written(entry) -> str:
    """The first argument an in-place or ``out=`` entry writes."""
    return next(a.name for a in entry.args if a.role != READ)


def _completed(result):
    """A functional collective's result, complete on the current stream: an ``AsyncCollectiveTensor`` waited, an
    op's tensor (whose collective may still run) passed through ``wait_tensor``; a list, each."""
    if isinstance(result, (list, tuple)):
        return [_completed(each) for each in result]
    if not isinstance(result, torch.Tensor):
        return result
    if type(result) is not torch.Tensor and callable(getattr(result, "wait", None)):
        return result.wait()  # AsyncCollectiveTensor
    return torch.ops._c10d_functional.wait_tensor(result)


def _back(result, values: dict, source: str):
    """New results (functional collectives, ops), complete, on their inputs' devices: each staged one copied back
    (a coalesced call's i-th result to its i-th input's device)."""
    inputs = list(_tensors(list(values.values())))
    results = result if isinstance(result, (list, tuple)) else [result]
    back = []
    for index, each in enumerate(results):
        home = inputs[index if len(results) > 1 and index < len(inputs) else 0]
        if isinstance(each, torch.Tensor) and _staging.needs_staging(home, source):
            each = _staging.to_caller(each, home.device)
        back.append(each)
    return back if isinstance(result, (list, tuple)) else back[0]


# ---------------------------------------------------------------- pipelined


def _pipelined(plan: Plan):
    """Run a chunked call: its host source and destination bytes, the chunk launcher, then the sync or async loop."""
    call, chunks = plan.call, plan.chunks
    entry, group, device = call.entry, call.group, plan.device
    if entry.wire == ELEMENTWISE:
        tensor = call.values[entry.args[0].name]
        reads, writes = _reads_writes(plan, entry.args[0].name)
        result = _new_like(tensor, tensor.shape, device) if entry.returns_new else None
        source, back_in = _host_bytes(tensor, device, reads, register=True)
        dest, back_out = (_host_bytes(result, device, False)[0], None) if result is not None else (source, back_in)
        if result is None and not writes:
            back_out = None
    else:  # gather: each rank's input into the rank-major output
        inputs = next(a.name for a in entry.args if a.role == READ)
        tensor = call.values[inputs]
        outputs = next((a.name for a in entry.args if a.role == WRITE), None)
        reads = writes = True
        if outputs is None:
            result = _new_like(tensor, (group.size() * tensor.shape[0], *tensor.shape[1:]) if tensor.dim() else
                               (group.size(),), device)
            target = result
        else:
            result, target = None, call.values[outputs]
        source, _ = _host_bytes(tensor, device, True, copy=_overlaps_off_its_part(tensor, target, group.rank()))
        dest, back_out = _host_bytes(target, device, False)
    launch = _launcher(chunks, call)
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("offload_shim: %s in %d chunks of %d bytes (%s) through %s", entry.label, chunks.count,
                   chunks.step, chunks.kind, device)
    if call.async_op:
        kept = state.flats.get(tensor)
        cuts = kept[1] if kept is not None and kept[0] is source else None  # the caller's own bytes, cut before
        return _run_async(plan, source, dest, launch, reads, writes, back_out, cuts)
    _run_sync(plan, source, dest, launch, reads, writes)
    if back_out is not None:
        back_out()
    if result is not None:
        return result
    return None if call.family == C10D else call.values[_written(entry)]


def _new_like(tensor: torch.Tensor, shape, device) -> torch.Tensor:
    with torch.inference_mode(False):
        return torch.empty(shape, dtype=tensor.dtype, pin_memory=device.type != "cpu")


def _overlaps_off_its_part(tensor: torch.Tensor, output: torch.Tensor, rank: int) -> bool:
    """Whether a gather's input ``tensor`` shares bytes with its ``output`` other than as this rank's own part of it
    (FSDP's in-place gather): a later chunk would then read what an earlier one wrote, where torch's call reads the
    whole input first."""
    def span(t):
        start = t.data_ptr()
        return start, start + (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()

    if tensor.numel() == 0 or output.numel() == 0:
        return False
    (a, b), (c, d) = span(tensor), span(output)
    if b <= c or d <= a:
        return False
    nbytes = tensor.numel() * tensor.element_size()
    return not (tensor.is_contiguous() and output.is_contiguous() and a == c + rank * nbytes)


def _host_bytes(tensor: torch.Tensor, device, reads: bool, register: bool = False, copy: bool = False):
    """``(flat bytes, copy_back)``: ``tensor``'s own memory as bytes where it is contiguous, its bytes are its
    values (written through ``.data``, as torch's C++ writes: no version counter bump) and ``copy`` is false; else a
    contiguous pinned copy (holding its values where ``reads``: a lazily conjugated or negated view's values, as for
    a call staged whole) and the function that writes that copy back into ``tensor``, through the view. Obtained
    before any chunk is sent."""
    _staging.finish_writes_to([tensor])
    if not copy and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg():
        if register:
            _registration.register_for_staging(tensor, device)  # pageable: registered at its reuse, if set
        return _flat(tensor)[0], None
    copy = _groups.host_buffer(tensor.numel() * tensor.element_size(), device)
    typed = copy.view(tensor.dtype).view(tensor.shape) if tensor.dtype is not torch.bool else copy.view(tensor.shape)
    if reads:
        with torch.no_grad():
            _staging.bits(typed).copy_(_staging.bits(tensor))

    def copy_back() -> None:
        with torch.no_grad(), _staging.writable(tensor):
            _staging.bits(tensor.data).copy_(_staging.bits(typed))

    return copy, copy_back


def _flat(tensor: torch.Tensor) -> tuple:
    """``(flat bytes, cuts)`` of a contiguous ``tensor``: its memory as a ``uint8`` view, and a dict for that view's
    cuts into chunks (:func:`_all_ins`), kept while ``tensor`` lives and describes the same memory (a tensor reused
    call after call, as training reuses its buffers, is cut once). A tensor given other memory (``.data =``,
    ``set_``) is cut again at its next call; until then the old views keep its old storage."""
    kept = state.flats.get(tensor)
    nbytes = tensor.numel() * tensor.element_size()
    if kept is not None and kept[0].numel() == nbytes and kept[0].data_ptr() == tensor.data_ptr():
        return kept
    kept = state.flats[tensor] = (_staging.bits(tensor.data.reshape(-1)).view(torch.uint8), {})
    return kept


_REDUCE_OPS = {"sum": "SUM", "avg": "AVG", "product": "PRODUCT", "min": "MIN", "max": "MAX", "band": "BAND",
               "bor": "BOR", "bxor": "BXOR"}


def reduce_op(op):
    """``op`` as ``torch.distributed`` takes it: a ``ReduceOp`` as given, or a functional collective's name of one
    (``"sum"``); ``None`` for a name it does not know."""
    if isinstance(op, str):
        name = _REDUCE_OPS.get(op.lower())
        return None if name is None else getattr(dist.ReduceOp, name)
    return op


def _launcher(chunks: Chunks, call):
    """``(prepare, issue)``: ``prepare(index, slot)`` gives chunk ``index``'s tensors on ``slot`` (the bytes of the
    accelerator memory the chunk uses) as its collective takes them; ``issue(prepared) -> work`` launches that
    collective, asynchronous: the group's own method of the chunks' kind with the options torch's
    ``torch.distributed`` function of that kind gives it (``all_reduce``'s ``AllreduceOptions``, ...), as that
    function calls it once it has checked its arguments: the same collective whatever the entry point, without a
    Python function of torch's around each chunk (they cost tens of microseconds a call). An asynchronous call
    prepares the chunks of its pool's slots once (:func:`_wire_views`)."""
    group, kind = call.group, chunks.kind
    if kind == "all_gather":
        gather, world, rank = getattr(type(group), GATHER_METHOD), chunks.world, group.rank()
        options = _c10d.AllgatherOptions()
        options.asyncOp = True

        def prepare(index: int, slot: torch.Tensor):
            count = _count(chunks, index)
            return slot[: world * count], slot[rank * count : (rank + 1) * count]

        def issue(prepared):
            return gather(group, *prepared, options)

        return prepare, issue
    if kind == "all_reduce":
        method, options = type(group).allreduce, _c10d.AllreduceOptions()
        options.reduceOp = call.op
    elif kind == "broadcast":
        method, options = type(group).broadcast, _c10d.BroadcastOptions()
        options.rootRank, options.rootTensor = call.root_rank, 0
    else:
        method, options = type(group).reduce, _c10d.ReduceOptions()
        options.reduceOp, options.rootRank = call.op, call.root_rank
    options.asyncOp = True
    step, total, dtype = chunks.step, chunks.total, chunks.dtype
    complex_ = dtype.is_complex  # reduced as real pairs, as torch's all_reduce and reduce do
    as_bytes = dtype is torch.uint8

    def prepare(index: int, slot: torch.Tensor):
        count = min(step, total - index * step)
        if slot.numel() != count:
            slot = slot[:count]
        typed = slot if as_bytes else slot.view(dtype)
        return [torch.view_as_real(typed) if complex_ else typed]

    def issue(prepared):  # (per chunk: the fewest operations)
        return method(group, prepared, options)

    return prepare, issue


def _wire_views(pool, chunks: Chunks, rank: int, prepare) -> list:
    """Every chunk's tensors on ``pool``'s slots (one per chunk) as ``prepare`` gives them, made once per pool and
    chunking."""
    key = (chunks.kind, chunks.dtype, chunks.total, chunks.step, chunks.world, rank)
    views = pool.cached.get(key)
    if views is None:
        if len(pool.cached) >= 16:  # chunkings seen once: keep the pool's table small
            pool.cached.clear()
        views = pool.cached[key] = [prepare(index, slot) for index, slot in enumerate(pool.slots[: chunks.count])]
    return views


def _count(chunks: Chunks, index: int) -> int:
    """The bytes chunk ``index`` takes of each rank's ``total``."""
    return min(chunks.step, chunks.total - index * chunks.step)


def _ins(chunks: Chunks, index: int, source: torch.Tensor, rank: int):
    """``(offset in the slot, source bytes)`` that chunk ``index`` copies in."""
    start, count = index * chunks.step, _count(chunks, index)
    return (rank * count if chunks.kind == "all_gather" else 0), source[start : start + count]


def _outs(chunks: Chunks, index: int, dest: torch.Tensor):
    """``[(offset in the slot, destination bytes)]`` that chunk ``index`` copies out."""
    start, count = index * chunks.step, _count(chunks, index)
    if chunks.kind == "all_gather":
        return [(r * count, dest[r * chunks.total + start : r * chunks.total + start + count]) for r in range(chunks.world)]
    return [(0, dest[start : start + count])]


def _all_ins(chunks: Chunks, source: torch.Tensor, rank: int, cuts: dict | None = None) -> list:
    """:func:`_ins` of every chunk (an elementwise call's cut in one call); kept in ``cuts`` (a caller's tensor's,
    :func:`_flat`) where given."""
    key = (chunks.kind, chunks.total, chunks.step, rank)
    if cuts is not None and key in cuts:
        return cuts[key]
    if chunks.kind == "all_gather":
        ins = [_ins(chunks, index, source, rank) for index in range(chunks.count)]
    else:
        ins = [(0, view) for view in source.split(chunks.step)]
    if cuts is not None:
        if len(cuts) >= 4:
            cuts.clear()
        cuts[key] = ins
    return ins


def _all_outs(chunks: Chunks, dest: torch.Tensor) -> list:
    """:func:`_outs` of every chunk (an elementwise call's cut in one call)."""
    if chunks.kind == "all_gather":
        return [_outs(chunks, index, dest) for index in range(chunks.count)]
    return [[(0, view)] for view in dest.split(chunks.step)]


def _part(slot: torch.Tensor, offset: int, view: torch.Tensor) -> torch.Tensor:
    """The bytes of ``slot`` from ``offset`` that ``view`` is copied to or from (the slot itself, where they are all
    of it: no slicing per chunk)."""
    return slot if offset == 0 and view.numel() == slot.numel() else slot[offset : offset + view.numel()]


def _slot_bytes(chunks: Chunks, index: int) -> int:
    return _count(chunks, index) * (chunks.world if chunks.kind == "all_gather" else 1)


def _agreement(chunks: Chunks, device) -> torch.Tensor:
    """This rank's ``[code, -code]`` on ``device`` (int64), a fresh tensor for the agreement's collective to write:
    a copy, queued on the current stream, of a constant kept per device and code (made once, and complete before
    any stream reads it), so that no call waits for the host or for work queued before it."""
    key = (device, *chunks.code())
    constant = state.agreements.get(key)
    if constant is None:
        code = key[1:]
        if len(state.agreements) >= 256:  # sizes seen once: keep the table small
            state.agreements.clear()
        constant = torch.tensor([*code, *(-v for v in code)], dtype=torch.int64, device=device)
        _staging.current_stream(device).synchronize()  # once per code: any stream may read it from now on
        state.agreements[key] = constant
    return constant.clone()


def _launch_agreement(group, tensor: torch.Tensor):
    return type(group).allreduce(group, [tensor], _AGREEMENT_OPTIONS)  # (looked up as the chunks' launches are)


_AGREEMENT_OPTIONS = _c10d.AllreduceOptions()
_AGREEMENT_OPTIONS.reduceOp = dist.ReduceOp.MAX


def _check_agreement(group, values: list[int], chunks: Chunks, collective: str, issued: bool = False) -> None:
    """Raise :class:`StagingError` where the ranks' agreement tensor says they would split the call differently.
    ``issued``: every rank issued its chunks before the check (an asynchronous call, which does not wait for its
    peers), so mismatched collectives went out and the group's later collectives may pair with the wrong ones: the
    group is marked out of step (:func:`_groups.mark_out_of_step`) and its captured small calls dropped."""
    high, low = values[:4], [-v for v in values[4:]]
    if high == low:
        return
    what = []
    if high[0] != low[0]:
        what.append(f"collectives (this rank: {chunks.kind})")
    if high[1] != low[1]:
        what.append(f"sizes from {low[1]} to {high[1]} bytes (this rank: {chunks.total})")
    if high[2] != low[2]:
        what.append(f"dtypes (this rank: {chunks.dtype})")
    if high[3] != low[3]:
        what.append(f"chunk sizes from {low[3]} to {high[3]} bytes (this rank: {chunks.step})")
    label, differences = group_label(group), "; ".join(what)
    if not issued:
        raise StagingError(f"offload_shim: the ranks of process group {label} disagree on this staged {collective}: "
                           f"{differences}. No rank ran its chunks; the caller's tensors are unchanged.")
    _groups.mark_out_of_step(group, f"a staged asynchronous {collective} whose ranks disagreed ({differences})")
    _replay.forget(group)  # (a replay would pass the mark by)
    raise StagingError(
        f"offload_shim: the ranks of process group {label} disagree on this staged asynchronous {collective}: "
        f"{differences}. Each rank issued its chunks before this check (an asynchronous call does not wait for its "
        f"peers): collectives of different sizes or numbers went out, and the group's later collectives may pair "
        f"with the wrong ones, so every later staged call on it raises StagingError; destroy it and make another "
        f"(collectives the shim does not stage are not stopped). The caller's tensors are unchanged."
    )


def _copy_after(event, pairs) -> None:
    """On a copy lane: once ``event`` (if any) has completed, copy each ``(destination, source)`` pair of flat host
    tensors on the copy threads."""
    if event is not None:
        event.synchronize()
    _staging.host_copies(pairs)


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


def _run_sync(plan: Plan, source, dest, launch, reads: bool, writes: bool) -> None:
    """The chunks through the group's pool, two in flight (see the module docstring); the caller's destination
    holds every chunk's result when this returns."""
    _issue_pooled(plan, source, dest, launch, reads, writes)[1]()


def _issue_pooled(plan: Plan, source, dest, launch, reads: bool, writes: bool, defer_last: bool = False):
    """Issue the chunks through the group's pool, two in flight; return ``(works, finish)``: the chunks' work
    handles, and ``finish()``, which waits for the last copies and gives the pool back, after which the caller's
    destination holds every chunk's result. Every collective is issued before this returns; with ``defer_last``,
    the last chunk's D2H and copy out are left to ``finish()`` (this returns once the last collective is issued)."""
    call, chunks, device = plan.call, plan.chunks, plan.device
    group, rank = call.group, call.group.rank()
    prepare, issue = launch
    pool = _groups.pool(device, max(chunks.chunk_bytes, chunks.slot_bytes, 16))
    slots = len(pool.slots)
    pinned_in, pinned_out = _staging._is_pinned(source), _staging._is_pinned(dest)
    bounce_in = PAGEABLE_PATH == "bounce" and reads and not pinned_in
    bounce_out = PAGEABLE_PATH == "bounce" and writes and not pinned_out
    buffers_in = pool.bounce("in") if bounce_in else None  # before the wire, as every buffer
    buffers_out = pool.bounce("out") if bounce_out else None
    agreement = _agreement(chunks, device)
    copies_in = {}  # chunk -> future of its copy into a bounce buffer
    copies_out = [None] * slots  # slot -> future of the copy out of its bounce buffer
    works, done = [], []  # the chunks' work handles; the D2H stream's event after the last chunk
    lane_in = _groups.lane(group, "in") if bounce_in else None
    lane_out = _groups.lane(group, "out") if bounce_out else None

    def copy_in(index: int) -> None:  # after the last H2D copy out of that bounce buffer
        offset, view = _ins(chunks, index, source, rank)
        bounce = buffers_in[index % slots][offset : offset + view.numel()]
        copies_in[index] = lane_in.submit(_copy_after, pool.bounce_free[index % slots], [(bounce, view)])

    def back(index: int) -> None:  # chunk ``index``'s D2H, behind its collective, and its copy out
        s = index % slots
        slot = pool.slots[s]
        with pool.d2h:
            works[index].wait()  # the D2H stream waits on the collective (Gloo: the collective has finished)
        if writes:
            if bounce_out:
                if copies_out[s] is not None:  # that bounce buffer's last copy out has finished
                    copies_out[s].result()
                landing = buffers_out[s]
                used = _slot_bytes(chunks, index)
                with pool.d2h:
                    landing[:used].copy_(slot[:used], non_blocking=True)
                pairs = [(view, landing[offset : offset + view.numel()])
                         for offset, view in _outs(chunks, index, dest)]
                copies_out[s] = lane_out.submit(_copy_after, pool.d2h.record_event(), pairs)
            else:
                with pool.d2h:
                    for offset, view in _outs(chunks, index, dest):
                        view.copy_(slot[offset : offset + view.numel()], non_blocking=pinned_out)
        pool.slot_free[s] = pool.d2h.record_event()

    try:
        with _staging.staged_call(), torch.no_grad(), _staging.writable(dest):
            pool.h2d.wait_stream(_staging.current_stream(device))
            if bounce_in:
                copy_in(0)
            for index in range(chunks.count):
                s = index % slots
                slot = pool.slots[s]
                if pool.slot_free[s] is not None:
                    pool.h2d.wait_event(pool.slot_free[s])
                if reads:
                    offset, view = _ins(chunks, index, source, rank)
                    origin = view
                    if bounce_in:
                        copies_in.pop(index).result()
                        origin = buffers_in[s][offset : offset + view.numel()]
                    with pool.h2d:
                        slot[offset : offset + view.numel()].copy_(origin, non_blocking=True)
                    if bounce_in:
                        pool.bounce_free[s] = pool.h2d.record_event()
                        if index + 1 < chunks.count:
                            copy_in(index + 1)
                if index == 0:  # behind the first chunk's H2D
                    _launch_agreement(group, agreement).wait()
                    _check_agreement(group, agreement.tolist(), chunks, call.entry.label)
                with pool.h2d:
                    works.append(issue(prepare(index, slot)))
                if index + 1 < chunks.count or not defer_last:
                    back(index)
            if not defer_last:
                done.append(pool.d2h.record_event())
    except BaseException:  # every copy this call started ends before the pool is given back
        _settle([*copies_in.values(), *copies_out], quietly=True)
        pool.synchronize()
        _groups.give_back(pool)
        raise

    def finish() -> None:
        try:
            with torch.no_grad(), _staging.writable(dest):
                if defer_last:
                    back(chunks.count - 1)
                    done.append(pool.d2h.record_event())
                _settle(copies_out)
        except BaseException:
            pool.synchronize()
            raise
        finally:
            _groups.give_back(pool)
        done[0].synchronize()

    return works, finish


def _stream_ordered(group, device) -> bool:
    """Whether the backend that runs ``group``'s collectives on ``device`` orders them on the device's streams (a work
    handle's ``wait()`` makes the current stream wait, and returns at once): one that serves that accelerator only
    (NCCL, HCCL, XCCL), as torch records its backends (``Backend.backend_capability``). One that also serves the
    host (Gloo, MPI, UCC) runs them from the host, and its ``wait()`` blocks."""
    return device.type != "cpu" and group is not None and _devices.record(group).ordered.get(device.type, False)


def _run_async(plan: Plan, source, dest, launch, reads: bool, writes: bool, back_out, cuts=None):
    """Issue every chunk of an asynchronous call and return its handle (see the module docstring); every H2D and
    every collective is queued before this returns. Where the backend orders the device's streams
    (:func:`_stream_ordered`, NCCL's): pageable input goes as the synchronous call's does (the caller waits for its
    host copies in either way), the completion lane doing what the sync call does after its last chunk; pinned
    input gets accelerator memory for every chunk, so that nothing waits, and the completion lane checks the ranks'
    agreement, queues each chunk's D2H behind its collective (into the caller's pinned memory or a pinned landing),
    copies landed chunks into pageable memory, and ends the handle's wait. Elsewhere (Gloo,
    staging through the host: ``wait()`` blocks), accelerator memory for every chunk, and the completion lane waits
    for each chunk, copies it back, and ends the handle's wait."""
    call, chunks, device = plan.call, plan.chunks, plan.device
    group, rank = call.group, call.group.rank()
    ordered = _stream_ordered(group, device)
    if ordered and PAGEABLE_PATH == "bounce" and reads and not _staging._is_pinned(source):
        # Pageable input: the caller waits for its host copies in anyway. Issued as the synchronous call issues (two
        # slots, host copies both ways beside the DMA), the call returns when the sync call has its input staged,
        # and its completion lane does what the sync call does after its last chunk.
        works, finish = _issue_pooled(plan, source, dest, launch, reads, writes, defer_last=True)

        def complete_pooled() -> None:
            finish()
            if back_out is not None:
                with torch.no_grad():
                    back_out()

        return _handle(call, works, _groups.completion_lane(group).submit(complete_pooled), writes)
    # Before the wire: pinned host memory for pageable memory, and accelerator memory for every chunk (a pool of one
    # slot per chunk, reused once the call has completed).
    prepare, issue = launch
    sizes = [chunks.slot_bytes] * (chunks.count - 1) + [_slot_bytes(chunks, chunks.count - 1)]
    bounce_in = PAGEABLE_PATH == "bounce" and reads and not _staging._is_pinned(source)
    bounce_out = PAGEABLE_PATH == "bounce" and writes and not _staging._is_pinned(dest)
    buffers_in = [_groups.host_buffer(chunks.step, device) for _ in range(2)] if bounce_in else None
    landing = buffers_out = None  # stream-ordered, every chunk lands at once; otherwise two at a time
    if bounce_out and ordered:
        landing = _groups.host_buffer(sum(sizes), device).split(sizes)
    elif bounce_out:
        buffers_out = [_groups.host_buffer(max(sizes), device) for _ in range(2)]
    pool = _groups.pool(device, max(chunks.chunk_bytes, chunks.slot_bytes, 16), chunks.count)
    try:
        agreed = None
        if ordered:
            agreed = pool.cached.get("agreed")
            if agreed is None:
                with torch.inference_mode(False):
                    agreed = pool.cached["agreed"] = torch.empty(8, dtype=torch.int64, pin_memory=device.type != "cpu")
        agreement = _agreement(chunks, device)
        wire = _wire_views(pool, chunks, rank, prepare)
    except BaseException:
        _groups.give_back(pool)  # (nothing was queued on it)
        raise
    h2d, d2h = pool.h2d, pool.d2h
    slots = pool.slots[: chunks.count]
    ins = _all_ins(chunks, source, rank, cuts) if reads else None
    if writes and reads and dest is source and chunks.kind != "all_gather":  # in place: the same views
        outs = [[pair] for pair in ins]
    else:
        outs = _all_outs(chunks, dest) if writes else None
    works, free, copies_in, copies_out = [], [None, None], {}, []
    lane_in = _groups.lane(group, "in") if bounce_in else None
    lane_out = _groups.lane(group, "out") if landing is not None else None

    def copy_in(index: int) -> None:
        view = ins[index][1]
        copies_in[index] = lane_in.submit(_copy_after, free[index % 2], [(buffers_in[index % 2][: view.numel()], view)])

    def back(index: int, slot) -> None:  # on the D2H stream: chunk ``index``'s D2H, behind its collective
        works[index + 1].wait()
        if landing is None:
            for offset, view in outs[index]:
                view.copy_(_part(slot, offset, view), non_blocking=True)
            return
        land = landing[index]
        land.copy_(slot[: land.numel()], non_blocking=True)
        pairs = [(view, land[offset : offset + view.numel()]) for offset, view in outs[index]]
        copies_out.append(lane_out.submit(_copy_after, d2h.record_event(), pairs))

    h2d.wait_stream(_staging.current_stream(device))
    h2d.wait_stream(d2h)  # a pool a synchronous call gave back: after its last D2H from the slots
    with _staging.staged_call(), torch.no_grad(), _staging.writable(dest):
        try:
            with h2d:  # every H2D and collective queued on the H2D stream
                works.append(_launch_agreement(group, agreement))
            if bounce_in:
                copy_in(0)
            with h2d:
                for index, slot in enumerate(slots):
                    if reads:
                        offset, view = ins[index]
                        origin = view
                        if bounce_in:
                            copies_in.pop(index).result()
                            origin = buffers_in[index % 2][: view.numel()]
                        _part(slot, offset, view).copy_(origin, non_blocking=True)
                        if bounce_in:
                            free[index % 2] = h2d.record_event()
                            if index + 1 < chunks.count:
                                copy_in(index + 1)
                    works.append(issue(wire[index]))
        except BaseException:
            _settle([*copies_in.values(), *copies_out], quietly=True)
            _groups.discard(pool)  # (collectives may still use its memory: never reused)
            raise
    read = h2d.record_event()  # the caller's memory has been read once this has completed
    # The ranks' agreement is checked on the completion lane, after the call has returned: until it is, a later staged
    # call on the group waits for it (run), so that none pairs with chunks of a call its ranks split differently.
    checked = _devices.record(group).unchecked = concurrent.futures.Future()

    def complete_ordered() -> None:
        """On the completion lane, once the call has returned: the agreement's D2H, its check, then each chunk's D2H
        queued behind its collective (none is queued into the caller's memory before the ranks are known to agree),
        and the wait for the copies."""
        try:
            with torch.no_grad(), _staging.writable(dest), d2h:
                try:
                    works[0].wait()
                    agreed.copy_(agreement, non_blocking=True)
                    d2h.record_event().synchronize()
                    _check_agreement(group, agreed.tolist(), chunks, call.entry.label, issued=True)
                finally:
                    checked.set_result(None)
                if writes:
                    for index, slot in enumerate(slots):
                        back(index, slot)
                else:  # the pool is reused once the D2H stream has passed the last collective
                    works[-1].wait()
            _settle(copies_out)
        except BaseException:
            _settle(copies_out, quietly=True)
            _groups.discard(pool)  # (collectives may still use its memory: never reused)
            raise
        d2h.synchronize()  # the staging memory is in use until every queued copy has run
        read.synchronize()
        _groups.give_back(pool)
        if back_out is not None:
            with torch.no_grad():
                back_out()

    def complete() -> None:
        try:
            finish_blocking()
        except BaseException:
            _groups.discard(pool)  # (chunks of the call may still use its memory: never reused)
            raise
        _groups.give_back(pool)

    def finish_blocking() -> None:
        with torch.no_grad(), _staging.writable(dest):
            try:
                with d2h:  # the agreement's result read on the stream that waited for it
                    works[0].wait()
                    values = agreement.tolist()
                _check_agreement(group, values, chunks, call.entry.label, issued=True)
            finally:
                checked.set_result(None)
            pending = None  # (event, pairs) of the previous chunk's copy out of its bounce buffer
            for index, slot in enumerate(slots):
                with d2h:
                    works[index + 1].wait()
                    if writes and bounce_out:
                        bounce = buffers_out[index % 2]
                        bounce[: sizes[index]].copy_(slot[: sizes[index]], non_blocking=True)
                        event = d2h.record_event()
                        if pending is not None:
                            _copy_after(*pending)
                        pending = (event, [(view, bounce[offset : offset + view.numel()])
                                           for offset, view in outs[index]])
                    elif writes:
                        for offset, view in outs[index]:
                            view.copy_(slot[offset : offset + view.numel()], non_blocking=True)
            if pending is not None:
                _copy_after(*pending)
            d2h.synchronize()
            read.synchronize()
            if back_out is not None:
                back_out()

    return _handle(call, works, _groups.completion_lane(group).submit(complete_ordered if ordered else complete),
                   writes)


def _handle(call, works, completion, writes: bool):
    """The work handle of an asynchronous chunked call whose ``completion`` (a future) ends its wait."""
    caller = call.values[call.entry.args[0].name if call.entry.wire == ELEMENTWISE else _written(call.entry)]
    return _staging.BackgroundWork(works, completion, [caller], [caller] if writes else [])


def release_buffers() -> None:
    """Free the staging buffers (accelerator and pinned host memory: the groups' pools, the small calls' slots and
    captured graphs) and unregister the host memory staging registered, after their last use has finished; buffers
    that a call in another thread is using are freed when it is done with them. The next staged call makes new ones.
    ``torch.distributed.destroy_process_group()`` (of every group) calls this while the shim is installed."""
    _replay.forget()
    state.agreements.clear()
    _registration.unregister_all()
    _staging.release_small_slots()
    _groups.release()
