"""Wrappers for ``torch.distributed`` point-to-point calls: ``send``, ``recv``, ``isend``, ``irecv`` and
``batch_isend_irecv``.

A host tensor is staged whole on each side, independently: a sender copies its tensor to the accelerator, a
receiver receives into fresh accelerator memory and copies the result into its own tensor object (a CPU
``Parameter``'s ``.data`` included). Whether one side stages never changes what the other side does, so a CPU
sender may talk to a GPU receiver. ``isend``, ``irecv`` and ``batch_isend_irecv`` return work handles that finish
the copy back in ``wait()``. Where the backend returns one work per operation (Gloo), each handle finishes its own
receive; where it returns one for the batch (NCCL), that one handle waits the batch and copies every receive back.

A ``P2POp`` keeps torch's own ``isend`` or ``irecv``, even when given the shim's wrapper of it: torch's
``batch_isend_irecv`` tells a send from a receive by identity with its module's ``isend``, so an operation holding a
wrapper would be taken for a receive once :func:`offload_shim.uninstall` has bound torch's function back.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from offload_shim import _counters, _devices, _staging
from offload_shim._patch_c10d import (
    ALIASES,
    CONTIGUOUS_P2P,
    MODULE,
    READ,
    WRITE,
    refuse_as_torch,
    staged_arguments_wrapper,
)
from offload_shim._patching import Parameters, Target, unwrap_ours

POINT_TO_POINT = {"send": READ, "isend": READ, "recv": WRITE, "irecv": WRITE}
BATCH = "torch.distributed.batch_isend_irecv"


def _batch_wrapper(original):
    def wrapper(wrapped, instance, args, kwargs):
        operations = args[0] if args else kwargs.get("p2p_op_list")
        if not isinstance(operations, list) or not operations or not all(isinstance(o, dist.P2POp) for o in operations):
            return wrapped(*args, **kwargs)  # torch raises its own error
        operations = [_current(operation) for operation in operations]
        tensors = [getattr(operation, "tensor", None) for operation in operations]
        group = _devices.resolve_c10d_group(getattr(operations[0], "group", None))
        device, source = None, "cpu"
        if group is not None and any(_staging.needs_staging(t) for t in tensors):
            device = _devices.staging_device_for_call(tensors, group, BATCH)
        if device is None and group is not None:
            source = _devices.host_staging_for(tensors, group, BATCH)  # accelerator tensors only the host serves
            device = None if source is None else torch.device("cpu")
        if device is None:
            return wrapped(operations)
        refuse_as_torch(CONTIGUOUS_P2P, tensors)
        nbytes = _counters.host_bytes(tensors, source)
        try:
            return _staged_batch(wrapped, operations, device, source)
        finally:
            _counters.count(BATCH, _counters.WHOLE, nbytes)

    return wrapper


def _staged_batch(wrapped, operations, device, source: str = "cpu"):
    """``batch_isend_irecv(operations)`` with each operation's tensor on ``source`` staged through ``device``."""
    staged = [_staging.StagedArguments(device, source) for _ in operations]
    for operation, arguments in zip(operations, staged):
        sends = operation.op is dist.distributed_c10d.isend
        operation.tensor = arguments.stage(operation.tensor, reads=sends, writes=not sends)
    with _staging.staged_call():
        works = wrapped(operations)
    if len(works) == len(operations):  # one work per operation (Gloo): each handle finishes its own receive
        return [_staging.StagedWork([w], a.copy_back, a.callers()) for w, a in zip(works, staged)]

    def copy_back():
        for arguments in staged:
            arguments.copy_back()

    if not works:  # nothing to wait for
        copy_back()
        return works
    # One work for the batch (NCCL coalesces it): one handle, at every position, that waits the batch once and
    # copies every receive back.
    return [_staging.StagedWork(works, copy_back, [t for a in staged for t in a.callers()])] * len(works)


def _current(operation):
    """A copy of P2POp ``operation`` whose ``op`` is torch's ``isend`` or ``irecv`` as bound now: torch tells sends
    from receives by identity with its module's ``isend``, which install and uninstall rebind, so a P2POp made
    before either would be taken for a receive. ``operation`` itself where its ``op`` is neither (torch decides)."""
    kind = _kind(operation.op)
    if kind is None:
        return operation
    copy = object.__new__(type(operation))
    copy.__dict__.update(vars(operation))
    copy.op = getattr(dist.distributed_c10d, kind)
    return copy


def _kind(op) -> str | None:
    """``"isend"`` or ``"irecv"``: which of the two ``op`` is, whoever wrapped it (torch's decorators, the shim, a
    user's patch with or without ``functools.wraps``): the two share a function on their ``__wrapped__`` chains."""
    ops = _chain(op)
    for kind in ("isend", "irecv"):
        bound = _chain(getattr(dist.distributed_c10d, kind))
        if any(a is b for a in ops for b in bound):
            return kind
    return None


def _chain(function) -> list:
    chain = []
    while function is not None and not any(function is seen for seen in chain):
        chain.append(function)
        function = getattr(function, "__wrapped__", None)
    return chain


def _p2p_op_init_wrapper(original):
    """``P2POp(op, ...)`` with ``op`` stripped of the shim's wrappers (see the module docstring)."""
    parameters = Parameters(functools.partial(original, None))  # wrapt passes the instance apart from args

    def wrapper(wrapped, instance, args, kwargs):
        op = parameters.get(args, kwargs, "op")
        args, kwargs = parameters.replace(args, kwargs, "op", unwrap_ours(op))
        return wrapped(*args, **kwargs)

    return wrapper


TARGETS = [
    *(
        Target(MODULE, name, staged_arguments_wrapper(name, {"tensor": role}, {"tensor": CONTIGUOUS_P2P}),
               aliases=ALIASES)
        for name, role in POINT_TO_POINT.items()
    ),
    Target(MODULE, "batch_isend_irecv", _batch_wrapper, aliases=ALIASES),
    Target(MODULE, "__init__", _p2p_op_init_wrapper, owner="P2POp"),
]
