"""Wrappers for ``torch.distributed`` point-to-point calls: ``send``, ``recv``, ``isend``, ``irecv`` and
``batch_isend_irecv``.

A host tensor is staged whole on each side, independently: a sender copies its tensor to the accelerator, a
receiver receives into fresh accelerator memory and copies the result into its own tensor object (a CPU
``Parameter``'s ``.data`` included). Whether one side stages never changes what the other side does, so a CPU
sender may talk to a GPU receiver. ``isend``, ``irecv`` and ``batch_isend_irecv`` return work handles that finish
the copy back in ``wait()``; the handles of one batch are one handle, which waits for the whole batch before it
copies.
"""

from __future__ import annotations

import torch.distributed as dist

from offload_shim import _devices, _staging
from offload_shim._patch_c10d import MODULE, READ, WRITE, staged_arguments_wrapper
from offload_shim._patching import Target

POINT_TO_POINT = {"send": READ, "isend": READ, "recv": WRITE, "irecv": WRITE}


def _batch_wrapper(original):
    def wrapper(wrapped, instance, args, kwargs):
        operations = args[0] if args else kwargs.get("p2p_op_list")
        if not isinstance(operations, list) or not operations:
            return wrapped(*args, **kwargs)
        tensors = [getattr(operation, "tensor", None) for operation in operations]
        if not any(_staging.needs_staging(t) for t in tensors):
            return wrapped(*args, **kwargs)
        group = _devices.resolve_c10d_group(getattr(operations[0], "group", None))
        if group is None:
            return wrapped(*args, **kwargs)
        device = _devices.staging_device_for_call(tensors, group, "torch.distributed.batch_isend_irecv")
        if device is None:
            return wrapped(*args, **kwargs)
        staged = _staging.StagedArguments(device)
        staged_operations = []
        for operation in operations:
            sends = getattr(operation.op, "__name__", "") == "isend"
            copy = object.__new__(type(operation))
            copy.__dict__.update(vars(operation))
            # torch tells sends from receives by identity with its module's isend: bind the one in force now.
            copy.op = dist.distributed_c10d.isend if sends else dist.distributed_c10d.irecv
            copy.tensor = staged.stage(operation.tensor, reads=sends, writes=not sends)
            staged_operations.append(copy)
        with _staging.staged_call():
            works = wrapped(staged_operations)
        if not works:  # nothing to wait for
            staged.copy_back()
            return works
        # One handle for the whole batch, at every position: waiting any of them waits every operation once
        # and copies every receive back (NCCL's own coalesced batch returns one work).
        return [_staging.StagedWork(works, staged.copy_back, staged.callers())] * len(works)

    return wrapper


TARGETS = [
    *(Target(MODULE, name, staged_arguments_wrapper(name, {"tensor": role})) for name, role in POINT_TO_POINT.items()),
    Target(MODULE, "batch_isend_irecv", _batch_wrapper),
]
