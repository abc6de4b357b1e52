"""Wrappers for ``torch.distributed`` collectives, and the one wrapper shape every c10d family shares.

In place on one tensor, elementwise (this module's :data:`TARGETS`): ``all_reduce(tensor, op, group, async_op)``,
``broadcast(tensor, src, group, async_op, group_src)`` and ``reduce(tensor, dst, op, group, async_op,
group_dst)``. When ``tensor`` is on the CPU and the group serves no CPU backend (or routes it, see ``_devices``),
the tensor is staged, the original collective runs on the staged copy with the caller's other arguments, and the
result is written back into the caller's own tensor object. Synchronous calls on tensors of at least two chunks,
whatever their strides, go through the chunked pipeline (``_pipeline``): their size is the same on every rank
(torch requires it, and the pipeline checks it), so every rank splits them alike. Smaller ones, and every
``async_op=True`` call, are staged whole: a single chunk costs less so (measured:
results/gpu/2026-12-01-two-h200-gpu-tests-and-benchmark/bench.log), and an asynchronous call must not wait for its
peers, as the pipeline's agreement check does. ``reduce`` writes back on ``dst`` only: the other ranks' tensors
stay as they were, as NCCL leaves them (Gloo's own CPU path uses them as scratch).

Every other tensor collective (gathers, scatters, all-to-all, point-to-point: ``_patch_c10d_lists``,
``_patch_p2p``) is wrapped by :func:`staged_arguments_wrapper`, from a table of which parameters the call reads
and writes. Those calls are staged whole, never chunked: their sizes may differ per rank (uneven list gathers,
``all_to_all_single`` splits, ``gather_list`` only on the root), and a rank that split a call into another number
of collectives than its peers would leave them waiting.

With ``async_op=True`` (and for ``isend``/``irecv``) the returned work handle finishes the copy back in
``wait()``. Every call that needs no staging goes to torch untouched.
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping

import torch

from offload_shim import _config, _counters, _devices, _pipeline, _replay, _staging
from offload_shim._patching import Parameters, Target

MODULE = "torch.distributed.distributed_c10d"
ALIASES = ("torch.distributed",)  # where the c10d functions are public under the same names
IN_PLACE_COLLECTIVES = ("all_reduce", "broadcast", "reduce")

_log = logging.getLogger("offload_shim")

# What a staged tensor parameter is to the call: read (copied to the staging device), written (copied back into
# the caller's tensor), or both.
READ, WRITE, READ_WRITE = "read", "write", "read-write"
_HOST = torch.device("cpu")  # where accelerator tensors that a group serves only through the host are staged


def refuse_as_torch(refusal: Callable, tensors) -> None:
    """Raise what ``refusal`` (one of :data:`AUTOGRAD_WRITTEN`, :data:`CONTIGUOUS`, :data:`CONTIGUOUS_P2P`) finds
    torch would raise for one of ``tensors``, if any."""
    for tensor in tensors:
        error = refusal(tensor)
        if error is not None:
            raise error


def _contiguous_only(error: type, message: str):
    def refusal(tensor: torch.Tensor) -> Exception | None:
        return None if tensor.is_contiguous() else error(message)

    return refusal


# What torch refuses of a parameter's tensors on the CPU (where the group serves it, Gloo), refused the same way
# by the staged call before anything is copied: staged, the tensors are contiguous copies, written through
# ``.data``, and nothing would refuse. Measured with torch 2.13 on Gloo; the message is torch's own.
AUTOGRAD_WRITTEN = _staging.inplace_refusal  # results written by an in-place copy that autograd checks
CONTIGUOUS = _contiguous_only(ValueError, "Tensors must be contiguous")  # Gloo's and NCCL's all-to-all
CONTIGUOUS_P2P = _contiguous_only(RuntimeError, "input tensor has to be contiguous")  # Gloo's send and recv


def _is_rank(parameters, args, kwargs, group, name: str) -> bool | None:
    """Whether this rank is the call's ``name`` rank (``"src"`` of a broadcast, ``"dst"`` of a reduce), given as a
    global rank or as ``group_<name>``; ``None`` when the arguments do not say (torch will raise)."""
    group_rank = parameters.get(args, kwargs, f"group_{name}")
    if group_rank is not None:
        return group.rank() == group_rank
    rank = parameters.get(args, kwargs, name)
    return None if rank is None else torch.distributed.get_rank() == rank


def _roles(collective, parameters, args, kwargs, group) -> tuple[bool, bool]:
    """``(reads, writes)``: whether the collective reads and writes this rank's tensor. A broadcast reads only
    on its source and writes elsewhere; a reduce writes only on its destination (NCCL leaves the others' tensors
    as they were, where Gloo's own CPU path uses them as scratch)."""
    if collective == "broadcast":
        source = _is_rank(parameters, args, kwargs, group, "src")
        return source is not False, source is not True
    if collective == "reduce":
        return True, _is_rank(parameters, args, kwargs, group, "dst") is not False
    return True, True


def _in_place_wrapper(collective: str):
    name = f"torch.distributed.{collective}"

    def make(original):
        parameters = Parameters(original)
        missing = [param for param in ("tensor", "group") if param not in parameters]
        if missing:  # a torch whose signature differs: leave the function alone rather than guess
            _log.warning("offload_shim: %s has no parameter(s) %s in this torch; not staged", name, missing)
            return lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs)
        at, group_at = parameters.position("tensor"), parameters.position("group")
        has_roles = collective != "all_reduce"  # an all_reduce reads and writes on every rank

        def wrapper(wrapped, instance, args, kwargs):
            # Every call passes here: the decision for one that needs no staging is kept to a few attribute reads.
            tensor = args[at] if len(args) > at else kwargs.get("tensor")
            if not isinstance(tensor, torch.Tensor):
                return wrapped(*args, **kwargs)
            if not tensor.is_cpu:  # an accelerator's tensor: through the host where the group has no backend for it
                # torch refuses that before any communication (every backend that has one runs this collective)
                result, refused = _devices.torch_first(wrapped, args, kwargs)
                if refused is None:
                    return result
                group = _devices.resolve_c10d_group(args[group_at] if len(args) > group_at else kwargs.get("group"))
                kind = None if group is None else _devices.host_staging_for((tensor,), group, name)
                if kind is None:
                    raise refused
                reads, writes = _roles(collective, parameters, args, kwargs, group) if has_roles else (True, True)
                try:
                    return _staged_whole(wrapped, parameters, args, kwargs, {"tensor": (reads, writes)}, _HOST, kind)
                finally:
                    _counters.count(name, _counters.WHOLE, tensor.numel() * tensor.element_size())
            group = _devices.resolve_c10d_group(args[group_at] if len(args) > group_at else kwargs.get("group"))
            if group is None or _devices.host_calls_served(group):
                return wrapped(*args, **kwargs)
            # A small call captured before, replayed without deciding again while what decided it holds (_replay).
            if _replay._captures and _replay.replayed(tensor, group, name, wrapped, args, kwargs, at):
                return None
            settings = _config.settings()  # read before the decision: what a capture's replay is decided under
            nbytes = tensor.numel() * tensor.element_size()  # the same on every rank (Tensor.nbytes fails if sparse)
            device = _devices.staging_device_for(tensor, group, name, nbytes)
            if device is None:
                return wrapped(*args, **kwargs)
            async_op = bool(parameters.get(args, kwargs, "async_op", False))
            reads, writes = _roles(collective, parameters, args, kwargs, group) if has_roles else (True, True)
            # Chosen from what every rank shares (the size, the settings, async_op), so that every rank splits it
            # alike. Asynchronous calls are staged whole: one collective, launched without waiting for any peer
            # (a pipeline waits for its ranks' agreement before its first chunk), as torch's own call.
            if async_op:
                mode = _counters.WHOLE
            elif nbytes >= _pipeline.MIN_PIPELINED_CHUNKS * settings.chunk_bytes:
                mode = _counters.PIPELINED
            elif nbytes <= _staging.SMALL_CALL_BYTES:
                mode = _counters.SMALL
            else:
                mode = _counters.WHOLE
            try:
                if mode is _counters.PIPELINED:
                    def launch(chunk):
                        chunk_args, chunk_kwargs = parameters.replace(args, kwargs, "tensor", chunk)
                        chunk_args, chunk_kwargs = parameters.replace(chunk_args, chunk_kwargs, "async_op", True)
                        return wrapped(*chunk_args, **chunk_kwargs)

                    return _pipeline.stage_in_place(tensor, device, group, launch, name, reads=reads, writes=writes)
                if mode is _counters.SMALL:
                    def run(staged):
                        call_args, call_kwargs = parameters.replace(args, kwargs, "tensor", staged)
                        return wrapped(*call_args, **call_kwargs)

                    if device.type == "cuda":  # replayed from a CUDA graph where the group and call allow it
                        call = _replay.call_key(wrapped, args, kwargs, at)
                        capture = _replay.capture_for(tensor, device, group, call, run, reads, writes, settings)
                        if capture is not None:
                            mode = _counters.REPLAYED
                            _replay.replay(capture, tensor)
                            return None
                    return _staging.stage_small_in_place(tensor, device, run, reads=reads, writes=writes)
                return _staged_whole(wrapped, parameters, args, kwargs, {"tensor": (reads, writes)}, device, "cpu")
            finally:
                _counters.count(name, mode, nbytes)

        return wrapper

    return make


def _staged_whole(wrapped, parameters, args, kwargs, roles: Mapping[str, tuple[bool, bool]], device, source: str):
    """``wrapped(*args, **kwargs)`` with the tensors of ``source`` among the parameters of ``roles`` (name to
    ``(reads, writes)``) staged whole through ``device``; the result, or for an asynchronous call its handle, as
    :meth:`_staging.StagedArguments.complete` gives it (with the caller's written tensors, the in-place family's
    tensor, as what the handle's ``result()`` returns)."""
    staged = _staging.StagedArguments(device, source)
    callers = []
    for param, (reads, writes) in roles.items():
        value = parameters.get(args, kwargs, param)
        args, kwargs = parameters.replace(args, kwargs, param, staged.stage(value, reads=reads, writes=writes))
        callers.append(value)
    with _staging.staged_call():
        result = wrapped(*args, **kwargs)
    return staged.complete(result, callers if len(callers) == 1 and isinstance(callers[0], torch.Tensor) else None)


def staged_arguments_wrapper(collective: str, roles: Mapping[str, str], refusals: Mapping[str, Callable] = {}):
    """A wrapper factory for a ``torch.distributed`` call whose tensor parameters are ``roles`` (parameter name to
    :data:`READ`, :data:`WRITE` or :data:`READ_WRITE`; a parameter may hold a tensor, a list of tensors, nested
    lists, or ``None``), and ``refusals`` what torch refuses of them (parameter name to a function of one of its
    tensors returning the exception torch raises for it, or ``None``: :data:`AUTOGRAD_WRITTEN`,
    :data:`CONTIGUOUS`, :data:`CONTIGUOUS_P2P`), raised before anything is staged.

    Host tensors among them that the call's group cannot serve (``_devices.staging_device_for_call``) are staged
    whole; tensors already on a device the group serves are passed as they are, so a call with inputs and outputs
    on different devices stages only its host side, and results land in the caller's own tensor objects on their
    own devices.
    """
    name = f"torch.distributed.{collective}"

    def make(original):
        parameters = Parameters(original)
        missing = [param for param in (*roles, "group") if param not in parameters]
        if missing:  # a torch whose signature differs: leave the function alone rather than guess
            _log.warning("offload_shim: %s has no parameter(s) %s in this torch; not staged", name, missing)
            return lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs)

        positions = [(param, parameters.position(param)) for param in roles]
        group_at = parameters.position("group")
        lazy = _devices.refused_for_host(name)  # accelerator tensors go to torch first (see _devices)

        def wrapper(wrapped, instance, args, kwargs):
            # Every call passes here: the decision for one that needs no staging is kept to a few attribute reads.
            host, kind = False, None
            for param, at in positions:  # (a loop, not _devices_of's: on every call)
                value = args[at] if len(args) > at else kwargs.get(param)
                if isinstance(value, torch.Tensor):
                    if value.is_cpu:
                        host = True
                    elif kind is None:
                        kind = value.device.type
                elif isinstance(value, (list, tuple)):
                    found_host, found_kind = _devices_of(value)
                    host, kind = host or found_host, kind or found_kind
            refused = None
            if not host:
                if kind is None:
                    return wrapped(*args, **kwargs)
                if lazy:  # accelerator tensors only, on a collective that needs the host only where torch refuses
                    result, refused = _devices.torch_first(wrapped, args, kwargs)
                    if refused is None:
                        return result
                elif not _config.settings().host_staging:
                    return wrapped(*args, **kwargs)
            elif kind is not None and not _config.settings().host_staging:
                kind = None  # host staging off: accelerator tensors go to torch undecided
            group = _devices.resolve_c10d_group(args[group_at] if len(args) > group_at else kwargs.get("group"))
            # Accelerator tensors through the host, where the group runs this collective on them only so.
            through_host = (
                kind is not None and group is not None and not _devices.accelerator_call_served(group, kind, name)
            )
            served = group is None or host and _devices.host_calls_served(group)
            if (served or not host) and not through_host:
                if refused is not None:
                    raise refused
                return wrapped(*args, **kwargs)
            values = {param: args[at] if len(args) > at else kwargs.get(param) for param, at in positions}
            tensors = list(_tensors(values.values()))
            device, source = None, "cpu"
            if host and not served:
                device = _devices.staging_device_for_call(tensors, group, name)
            if device is None and through_host:
                source = _devices.host_staging_for(tensors, group, name)
                device = None if source is None else _HOST
            if device is None:
                if refused is not None:
                    raise refused
                return wrapped(*args, **kwargs)
            for param, refusal in refusals.items():
                refuse_as_torch(refusal, _tensors([values[param]]))
            nbytes = _counters.host_bytes(tensors, source)
            try:
                staged = _staging.StagedArguments(device, source)
                for param, role in roles.items():
                    value = staged.stage(values[param], reads=role != WRITE, writes=role != READ)
                    args, kwargs = parameters.replace(args, kwargs, param, value)
                with _staging.staged_call():
                    result = wrapped(*args, **kwargs)
                return staged.complete(result)
            finally:
                _counters.count(name, _counters.WHOLE, nbytes)

        return wrapper

    return make


def _devices_of(values) -> tuple[bool, str | None]:
    """Whether ``values`` (tensors and lists of them, nested) hold a host tensor, and the device type of the first
    tensor not on the host (``None`` if none)."""
    host, kind = False, None
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.is_cpu:  # sparse ones too: refused clearly by the decision
                host = True
            elif kind is None:
                kind = value.device.type
        elif isinstance(value, (list, tuple)):
            found_host, found_kind = _devices_of(value)
            host, kind = host or found_host, kind or found_kind
    return host, kind


def _tensors(values):
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


def _releasing_buffers(original):
    """``destroy_process_group(group)`` first drops the group's captured small calls (``_replay``); of every group
    (``None``, or the default group, as torch reads it), it also frees the staging buffers
    (``_pipeline.release_buffers``): they belong to no group, and no staged call can follow until a group is made
    again."""

    def wrapper(wrapped, instance, args, kwargs):
        group = args[0] if args else kwargs.get("group")
        every = group is None or group is torch.distributed.group.WORLD  # torch destroys every group for both
        _replay.forget(None if every else group)  # while the group's communicator still exists
        result = wrapped(*args, **kwargs)
        if every:
            _pipeline.release_buffers()
        return result

    return wrapper


TARGETS = [
    *(Target(MODULE, name, _in_place_wrapper(name), aliases=ALIASES) for name in IN_PLACE_COLLECTIVES),
    Target(MODULE, "destroy_process_group", _releasing_buffers, aliases=ALIASES),
]
