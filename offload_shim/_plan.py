"""The one decision: what a call that reached a wrapper does.

:func:`decide` turns a bound call (:class:`Call`: its entry of the table, its tensors, its group, and the parameters
torch requires every rank to share) into a :class:`Plan`, or ``None``: torch's own call, untouched. Every family
(the ``torch.distributed`` functions, the ``torch.ops`` collectives of compiled code, the functional collectives and
DTensor, point-to-point calls) comes here, and ``_execute`` runs what it decides.

What a staged call sends (which collectives, their sizes and order, the agreement before a chunked call) depends
only on what torch requires every rank to share for that call: the collective, the group, the sizes torch requires
equal, and for a reduction its dtype; and on settings that every rank must set alike, which the ranks compare
through the group's store before the first call whose wire depends on them (``_groups.agree``), raising the same
:class:`StagingError` on every rank where they differ. Chunked (:class:`Chunks`): an elementwise collective (a
reduction in whole elements, a broadcast in bytes) of at least two chunks, and an ``all_gather_into_tensor`` whose
output is at least two chunks and of the dtype and size torch requires, on host tensors alone; never a call whose
arguments torch refuses (two roots, an ``async_op`` its options do not take), which torch's call judges, whole.
Routed off a group's CPU backend through its accelerator's (``cpu:gloo,cuda:nccl``): a chunkable collective of at
least ``route_min_bytes``, on a group of more than one rank, where every rank can route. What a rank may choose
alone in torch (``async_op``, the entry point, pinned or pageable memory, registration, a replay, contiguity, memory
shared between a gather's input and output, ``requires_grad``) changes only how this rank copies (the mode: small,
replayed, whole or pipelined), never the wire.

A call that mixes host tensors with tensors on a served accelerator is staged whole, its host tensors through that
accelerator, never chunked: every rank must mix alike, as every rank must pass its tensors on the same kind of
device to a collective torch splits.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import zlib

import torch
import torch.distributed as dist

from offload_shim import _config, _counters, _devices, _groups, _interrupts, _staging
from offload_shim._devices import StagingError
from offload_shim._state import state
from offload_shim._table import ELEMENTWISE, GATHER, LIST, NONE, READ, TENSOR, WRITE, Collective

_log = logging.getLogger("offload_shim")

# Families: how an entry is called on staged tensors (the wrapper that binds the call says which). A registered
# communicator's method (``_communicators``) has no process group: it is bound to one device.
C10D, OPS, FUNCTIONAL, COMMUNICATOR = "c10d", "ops", "functional", "communicator"
# Tensors of fewer chunks than this are staged as one collective: with one chunk there is nothing to overlap.
MIN_PIPELINED_CHUNKS = 2
# Synchronous in-place torch.distributed calls of at most this many bytes go through this thread's reused slot.
SMALL_CALL_BYTES = 1 << 20


@dataclasses.dataclass(slots=True)
class Call:
    """One call, bound: what the decision and the executor read of it.

    Attributes:
        entry: its entry of the table.
        family: :data:`C10D`, :data:`OPS`, :data:`FUNCTIONAL` or :data:`COMMUNICATOR`.
        group: its process group (``None`` where there is none: torch then raises or returns; a communicator).
        values: its tensor arguments by parameter name, as the caller gave them.
        async_op: what the caller gave for ``async_op`` (true: it asked for a work handle); torch takes a bool or
            what its options convert to one (an int, ``None``), and refuses others (a string).
        root: whether this rank is the call's root (``None``: the call has none, or its arguments do not say).
        root_rank: the root's rank in the group, where known.
        op: the reduce op of a reduction, as ``torch.distributed`` takes it.
        device: the device a registered communicator works on.
    """

    entry: Collective
    family: str
    group: dist.ProcessGroup | None
    values: dict
    async_op: object = False
    root: bool | None = None
    root_rank: int | None = None
    op: object = None
    device: torch.device | None = None

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the call's tensor arguments, in argument order (lists flattened)."""
        found: list[torch.Tensor] = []
        for value in self.values.values():
            _flatten(value, found)
        return found

    def role(self, name: str) -> str:
        return next(a for a in self.entry.args if a.name == name).role_on(self.root)


def _flatten(value, into: list) -> None:
    if isinstance(value, torch.Tensor):
        into.append(value)
    elif isinstance(value, (list, tuple)):
        for each in value:
            _flatten(each, into)


@dataclasses.dataclass(frozen=True, slots=True)
class Chunks:
    """The wire of a chunked call: its chunks are collectives ``kind`` of ``step`` bytes of the ``total`` bytes
    each rank contributes (the last one shorter), on tensors of ``dtype``, after an agreement (:meth:`code`).

    Attributes:
        kind: the ``torch.distributed`` collective each chunk is: ``all_reduce``, ``broadcast``, ``reduce`` or
            ``all_gather`` (into a tensor).
        total: the bytes each rank contributes: the tensor's; a gather's input.
        step: the bytes of it a chunk takes.
        world: the group's size (a gather's chunk holds ``world`` parts).
        dtype: what the chunks' collectives run on: the tensor's dtype for a reduction, bytes (``uint8``) otherwise.
        chunk_bytes: the chunk size the ranks agreed on.
    """

    kind: str
    total: int
    step: int
    world: int
    dtype: torch.dtype
    chunk_bytes: int

    @property
    def count(self) -> int:
        return -(-self.total // self.step)

    @property
    def slot_bytes(self) -> int:
        """Accelerator bytes one chunk needs."""
        return self.step * (self.world if self.kind == "all_gather" else 1)

    def code(self) -> list[int]:
        """What every rank checks it shares with the others before the first chunk: the collective, the size, the
        dtype (of a reduction) and the step."""
        return [zlib.crc32(self.kind.encode()), self.total, zlib.crc32(str(self.dtype).encode()), self.step]


@dataclasses.dataclass(slots=True)
class Plan:
    """What the executor does with a call.

    Attributes:
        call: the call.
        mode: how this rank copies (``_counters`` modes): ``small``, ``whole`` or ``pipelined`` (``replayed`` is
            decided by the executor, from a capture of the same call).
        route: what took the call off torch's path (``_counters`` routes).
        device: the staging device.
        source: the device type of the tensors staged: ``"cpu"``, or an accelerator's staged through the host.
        nbytes: the caller's bytes the call stages (for the counters).
        chunks: the wire of a pipelined call.
    """

    call: Call
    mode: str
    route: str
    device: torch.device
    source: str
    nbytes: int
    chunks: Chunks | None = None


def decide(call: Call) -> Plan | None:
    """The plan for ``call`` (see the module docstring); ``None``: torch's own call, untouched.

    Raises:
        StagingError: the call's host tensors cannot be staged from this rank (no usable accelerator of a type the
            group serves; a sparse, nested or quantized tensor; inside torch's ``_coalescing_manager``), or the
            ranks of the group disagree on a setting its wire depends on (``_groups.agree``); raised before anything
            is sent, the caller's tensors unchanged.
    """
    group = call.group
    if call.family == COMMUNICATOR and not state.thread.depth:
        return _on_communicator(call)
    if group is None or state.thread.depth:  # (a collective called from inside a staged call: torch's)
        return None
    if not _well_formed(call):
        return None  # torch's own call raises its own error (a missing tensor, a list for a tensor), before any wire
    _interrupts.release()  # (one held back for a decision whose plan was never run: not this call's)
    plan = None
    try:
        plan = _decide(call, group)
    except _groups.Unagreeable:  # (on every rank alike: the same store)
        _devices.passed_through(group, "its store cannot be written (a FakeStore), so its ranks cannot agree on "
                                       "staging")
    finally:
        if plan is None:
            _interrupts.release()  # nothing to run: a Ctrl-C held back since the ranks' agreement, now
    return plan


def _decide(call: Call, group) -> Plan | None:
    tensors = call.tensors()
    host = [t for t in tensors if t.is_cpu]
    settings = _config.settings()
    if not host:
        return _through_host(call, tensors, settings)
    # A group whose host tensors were staged through a device fixed by the group and the settings (its record's
    # ``device``): calls under those settings need not resolve the device again.
    record = _devices.record(group)
    fixed = record.device
    others = len(host) < len(tensors)
    if fixed is not None and fixed[0] is settings and not others and all(map(_staging.needs_staging, host)):
        device = fixed[1]
        if call.entry.chunkable:
            _groups.agree(group, settings, None, call.entry.label)  # agreed before, under these settings
        return _stage(call, device, _counters.STAGED, settings, host, tensors)  # as decided below before
    served = record.served
    if not served and _devices.unreadable(group):
        return None  # what the group serves cannot be read: torch's call, untouched
    for tensor in host:
        if not _staging.needs_staging(tensor):  # sparse, nested, quantized, a dispatch subclass: never staged
            return _devices.unstaged_layout(tensor, group, call.entry.label, served)
    cpu = record.cpu
    if others:
        for tensor in tensors:
            if not tensor.is_cpu and tensor.device.type not in served:
                # On a device the group does not serve (``meta``, which holds no data): torch decides, as without
                # the shim, rather than a staged output filled from memory never written.
                return None
        other = next(t for t in tensors if not t.is_cpu)
        if cpu is not None and cpu == record.backends.get(other.device.type):
            # One backend for both: torch runs it, unless that backend serves the accelerator's tensors for this
            # collective only through the host (Gloo's CUDA all_to_all): those are staged through the host.
            return _through_host(call, tensors, settings)
        route = _counters.STAGED if cpu is None else _counters.MIXED
        return _stage(call, other.device, route, settings, host, tensors, chunked=False)
    if cpu is not None:  # the group serves the host
        return _on_host_group(call, group, record, settings, host, tensors)
    device, fixed = _devices.staging_device(group, served, settings)  # (fixed: why, where there is no device)
    why = None if device is not None else fixed
    if call.entry.chunkable:  # every rank stages the same calls: compare what their wire depends on, first
        unable = _groups.agree(group, settings, why, call.entry.label).unable
        if unable:  # the same error on every rank, for one rank that cannot stage
            why = "; ".join(f"rank {rank} of the group: {reason}" for rank, reason in sorted(unable.items()))
            raise StagingError(_devices.unstageable_message(host[0], group, call.entry.label, served, why))
    if device is None:
        raise StagingError(_devices.unstageable_message(host[0], group, call.entry.label, served, why))
    if fixed:
        record.device = (settings, device)
    return _stage(call, device, _counters.STAGED, settings, host, tensors)


def host_answer(given) -> float:
    """The served path's answer for host tensors on ``given`` (the group argument as the caller gave it: ``None``
    for the default group), found and kept (its record's ``below``) where the wrapper has none: the size in bytes
    below which a host-only chunkable call of one tensor goes to torch untouched under the settings in force.
    ``math.inf`` (every size) where there is no process group (torch raises, or returns without communicating) or
    one backend serves everything the group serves (a plain Gloo group) and nothing forces staging; otherwise 0
    (every call decided), until a decided host call on a group with a CPU and an accelerator backend keeps the size
    its ranks' agreed routing threshold routes from (:func:`_on_host_group`; the ranks agree first, so a rank whose
    settings differ fails at the first call, as every rank does)."""
    group = _devices.resolve_c10d_group(given)
    if group is None:
        return math.inf
    settings = _config.settings()
    below = math.inf if _devices.host_calls_served(group) else 0
    _groups.keep_answer(group, settings, below)
    return below


def _on_host_group(call, group, record, settings, host, tensors) -> Plan | None:
    """A host-only call on a group that serves the host: torch's, unless routed through the group's accelerator
    backend, or staging is forced (``always_stage``)."""
    served, cpu = record.served, record.cpu
    accelerator = next((t for t in sorted(served) if record.backends[t] != cpu), None)
    if accelerator is None and not settings.always_stage:
        return None  # one backend serves everything (a plain Gloo group): nothing to route to, nothing forced
    if call.entry.point_to_point and not settings.always_stage:
        # Never routed, on any rank; and agreeing would wait for every rank of the group, where a send waits for
        # one peer only (that peer may be waiting for this rank elsewhere first).
        return None
    if accelerator is not None:
        # Two backends: the route (and, forced, the backend) of every host call depends on every rank's settings
        # and on every rank being able to route: agreed first.
        candidate, _ = _devices.staging_device(group, frozenset({accelerator}), settings)
        agreement = _groups.agree(group, settings, None, call.entry.label, can_route=candidate is not None)
        threshold = settings.route_min_bytes
        routes = agreement.route and threshold is not None and group.size() > 1
        if call.entry.chunkable and not settings.always_stage:
            _groups.keep_answer(group, settings, threshold if routes else math.inf, agreement)
        if routes and call.entry.chunkable and _shared_bytes(call) >= threshold:
            return _stage(call, candidate, _counters.ROUTED, settings, host, tensors)
    if not settings.always_stage:
        return None
    device, fixed = _devices.staging_device(group, served, settings)
    if accelerator is None and call.entry.chunkable:
        # A forced chunked call's wire depends on every rank staging it: where some ranks can and some cannot (no
        # staging device), the same error on every rank, before anything is sent; where none can, torch's call.
        unable = _groups.agree(group, settings, None if device is not None else fixed, call.entry.label).unable
        if unable and len(unable) < group.size():
            reasons = "; ".join(f"rank {rank} of the group: {why}" for rank, why in sorted(unable.items()))
            raise StagingError(
                f"offload_shim: {call.entry.label} on process group {_devices.group_label(group)}: staging is forced "
                f"({_config.ENV_ALWAYS_STAGE}), and some ranks of the group can stage it while others cannot "
                f"({reasons}). Every rank must stage a chunked call alike: give every rank a staging device (on a "
                f"CPU machine, {_config.ENV_STAGING_DEVICE}=cpu), or force staging on none. No rank ran it; the "
                f"caller's tensors are unchanged.")
    if device is None:
        return None
    return _stage(call, device, _counters.FORCED, settings, host, tensors)


def _on_communicator(call: Call) -> Plan | None:
    """A registered communicator's call: its tensors not on the communicator's device (every one, where staging is
    forced) staged whole through that device; ``None`` where there are none."""
    device, always = call.device, _config.settings().always_stage
    call.values = {name: t for name, t in call.values.items()
                   if isinstance(t, torch.Tensor) and (always or t.device != device)}
    if not call.values:
        return None
    name, tensor = next(iter(call.values.items()))
    if device.type != "cpu" and not _devices._usable(device):
        raise StagingError(
            f"offload_shim: {call.entry.label} got a tensor on {tensor.device} ({tuple(tensor.shape)}, "
            f"{tensor.dtype}) for {name!r}, but the communicator works on {device}, which this process cannot use. "
            f"The tensors were not modified.")
    tensors = call.tensors()
    route = _counters.STAGED if any(t.device != device for t in tensors) else _counters.FORCED
    plan = Plan(call, _counters.WHOLE, route, device, tensor.device.type, sum(t.numel() * t.element_size() for t in tensors))
    _decided(plan, tensor, (None,))
    return plan


def _well_formed(call: Call) -> bool:
    """Whether each tensor argument torch reads or writes on this rank holds what its form says (a tensor, a list
    of tensors, a list of lists of them): torch's own checks of a call that fails them (a missing argument, a list
    for a tensor, no list on the root) raise before any wire, and the shim then leaves the call to torch."""
    for arg in call.entry.args:
        if arg.role_on(call.root) == NONE:
            continue  # ignored by torch on this rank (a gather's list off the root)
        value = call.values.get(arg.name)
        if arg.form == TENSOR:
            if not isinstance(value, torch.Tensor):
                return False
        elif not isinstance(value, (list, tuple)) or not all(
                isinstance(each, torch.Tensor) if arg.form == LIST else
                isinstance(each, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in each) for each in value):
            return False
    return True


def _takes_async_op(value) -> bool:
    """Whether torch's collective options take ``value`` for ``async_op`` (converted as ``bool`` converts it); a
    torch whose options have no ``asyncOp`` reads it as a truth value, whatever it is."""
    options = dist.AllreduceOptions()
    if not hasattr(options, "asyncOp"):
        return True
    try:
        options.asyncOp = value
    except TypeError:
        return False
    return True


def _gathered_in_chunks(call: Call, tensor: torch.Tensor, output: torch.Tensor | None, device) -> bool:
    """Whether a gather's chunks may stand in for torch's call on ``device``: its output (``None``: one the op
    returns) is what torch requires of it on every rank (``tensor``'s dtype, the group's size times its elements)
    and, staged through the host, what the host's backend requires too (Gloo: the inputs, of one dimension or more,
    stacked along the first; NCCL takes any shape of that size, and a 0-dim input). Otherwise the call is staged
    whole, and torch's call on the staged tensors judges it: its error, or its result. Only what torch requires
    decides, so that every rank of a call torch runs decides alike."""
    world = call.group.size()
    if output is not None and (output.dtype != tensor.dtype or output.numel() != world * tensor.numel()):
        return False
    if device.type != "cpu":
        return True
    return tensor.dim() > 0 and (output is None or output.shape == (world * tensor.shape[0], *tensor.shape[1:]))


def _shared_bytes(call: Call) -> int:
    """The size of a chunkable call as every rank sees it: its tensor's; a gather's output."""
    entry = call.entry
    if entry.wire == GATHER:
        tensor = call.values[next(a.name for a in entry.args if a.role == READ)]
        return tensor.numel() * tensor.element_size() * call.group.size()
    tensor = call.values[entry.args[0].name]
    return tensor.numel() * tensor.element_size()


def _stage(call: Call, device, route: str, settings, host, tensors, chunked: bool = True) -> Plan | None:
    """The plan to stage ``call``'s host tensors through ``device`` by ``route``; ``None`` inside torch's
    ``_coalescing_manager`` on a group that serves the host (torch records the call there, to run it later)."""
    group, entry = call.group, call.entry
    if group in getattr(dist.distributed_c10d._world, "pg_coalesce_state", {}):
        _coalescing(call, host[0])
        return None
    chunks = _chunks(call, settings, device) if chunked and entry.chunkable else None
    if chunks is not None:
        mode = _counters.PIPELINED
    elif (
        call.family == C10D and entry.wire == ELEMENTWISE and not call.async_op
        and host[0].numel() * host[0].element_size() <= SMALL_CALL_BYTES
    ):
        mode = _counters.SMALL
    else:
        mode = _counters.WHOLE
    nbytes = sum(t.numel() * t.element_size() for t in host if _staging.needs_staging(t))
    plan = Plan(call, mode, route, device, "cpu", nbytes, chunks)
    _decided(plan, host[0], (settings.route_min_bytes,))
    return plan


def _chunks(call: Call, settings, device) -> Chunks | None:
    """The chunks of ``call`` (host tensors only) staged through ``device``, or ``None`` where it is one
    collective."""
    entry, chunk_bytes, world = call.entry, settings.chunk_bytes, call.group.size()
    if entry.reduces and call.op is None or entry.root is not None and call.root_rank is None:
        return None  # an op or root torch will refuse: its own call, whole, raises
    if type(call.async_op) is not bool and not _takes_async_op(call.async_op):
        return None  # torch refuses it (a string): its own call, whole, raises
    tensor = call.values[entry.args[0].name]
    if entry.reduces and tensor.is_complex() and not dist.distributed_c10d.supports_complex(call.op):
        return None  # torch refuses it: likewise
    if entry.wire == ELEMENTWISE:
        tensor = call.values[entry.args[0].name]
        itemsize = tensor.element_size()
        total = tensor.numel() * itemsize
        if total < MIN_PIPELINED_CHUNKS * chunk_bytes:
            return None
        if entry.reduces:  # whole elements of the dtype every rank shares
            return Chunks(_KIND[entry.name], total, max(1, chunk_bytes // itemsize) * itemsize, world, tensor.dtype,
                          chunk_bytes)
        return Chunks(_KIND[entry.name], total, chunk_bytes, world, torch.uint8, chunk_bytes)  # bytes
    tensor = call.values[next(a.name for a in entry.args if a.role == READ)]
    total = tensor.numel() * tensor.element_size()
    if total * world < MIN_PIPELINED_CHUNKS * chunk_bytes:
        return None
    output = next((call.values[a.name] for a in entry.args if a.role == WRITE), None)
    if not _gathered_in_chunks(call, tensor, output, device):
        return None
    return Chunks("all_gather", total, max(1, chunk_bytes // world), world, torch.uint8, chunk_bytes)


# The torch.distributed collective each chunk of a chunkable entry is.
_KIND = {"all_reduce": "all_reduce", "all_reduce_": "all_reduce", "broadcast": "broadcast", "broadcast_": "broadcast",
         "reduce": "reduce"}


def _through_host(call: Call, tensors, settings) -> Plan | None:
    """The plan for accelerator tensors that the group serves only through the host (a Gloo group: XPU tensors,
    CUDA point-to-point): staged whole through pinned host memory. Its wire is torch's own call, on host copies."""
    if not settings.host_staging:
        return None
    kind = next((t.device.type for t in tensors if t.device.type not in ("cpu", "meta")), None)
    group = call.group
    if kind is None or _devices.accelerator_call_served(group, kind, call.entry.label):
        return None
    staged = [t for t in tensors if t.device.type == kind]
    if not all(_staging.needs_staging(t, kind) for t in staged):
        return None  # sparse, nested or quantized: torch's own error
    if group in getattr(dist.distributed_c10d._world, "pg_coalesce_state", {}):
        _coalescing(call, staged[0])
        return None
    plan = Plan(call, _counters.WHOLE, _counters.HOST, torch.device("cpu"), kind,
                sum(t.numel() * t.element_size() for t in staged))
    _decided(plan, staged[0], (None,))
    return plan


def _coalescing(call: Call, tensor) -> None:
    """Inside torch's ``_coalescing_manager``, torch only records the collective, to run it at the block's end: a
    staged copy would be copied back before it held the result. Nothing to do where the group serves the host
    (torch runs it there); :class:`StagingError` otherwise."""
    group = call.group
    served = _devices.record(group).served
    if "cpu" in served:
        return
    raise StagingError(
        f"offload_shim: {call.entry.label} got a tensor on {tensor.device} ({tuple(tensor.shape)}, {tensor.dtype}) "
        f"inside torch.distributed's _coalescing_manager on process group {_devices.group_label(group)} with backend "
        f"{_devices.backend_description(group)!r} (device types {sorted(served)}); offload_shim cannot stage calls "
        f"that torch defers to the end of the block. Ways out: move the tensors to the accelerator before the block; "
        f"or make the calls outside the coalescing manager; or give the group a CPU backend, e.g. "
        f"init_process_group({_devices.with_cpu_backend(group, served)!r}). The tensor was not modified."
    )


def _decided(plan: Plan, tensor, sizes: tuple) -> None:
    """Report the decision to the counters (``_counters.decided``), with why where first calls are logged, and at
    DEBUG one line."""
    if not _log.isEnabledFor(logging.INFO):  # the one question asked of the logger on a staged call's path
        _counters.decided(plan.route, plan.device)
        return
    call = plan.call
    _counters.decided(plan.route, plan.device, call.entry.label, lambda: _why(plan, sizes))
    if _log.isEnabledFor(logging.DEBUG):
        where = ("the communicator" if call.group is None else
                 f"group {_devices.group_label(call.group)}, backend {_devices.backend_description(call.group)!r}")
        _log.debug(
            "offload_shim: staging %s of a %s tensor %s %s through %s (%s, mode %s)",
            call.entry.label, tensor.device.type, tuple(tensor.shape), tensor.dtype, plan.device, where, plan.mode,
            extra={"offload_shim_collective": call.entry.label, "offload_shim_device": str(plan.device)},
        )


def _why(plan: Plan, sizes: tuple) -> str:
    """Why a call is staged by its route, in a few words, for the log."""
    group, route = plan.call.group, plan.route
    if group is None:
        return f"{'always_stage; ' if route == _counters.FORCED else ''}the communicator works on {plan.device}"
    served = ", ".join(sorted(_devices.record(group).served))
    where = f"group {_devices.group_label(group)} with backend {_devices.backend_description(group)} serves {served}"
    if route == _counters.STAGED:
        return f"{where} only"
    if route == _counters.ROUTED:
        return (f"{_counters.format_bytes(_shared_bytes(plan.call))} >= route_min_bytes "
                f"{_counters.format_bytes(sizes[0])}; {where}")
    if route == _counters.MIXED:
        return f"its other tensors are on {plan.device}; {where}"
    if route == _counters.HOST:
        return f"{where}, not this collective on its accelerator tensors"
    return f"always_stage; {where}"
