"""Wrappers for ``torch.distributed`` collectives that work in place on one tensor.

``all_reduce(tensor, op, group, async_op)`` and ``broadcast(tensor, src, group, async_op, group_src)``: when the
group serves no CPU backend and ``tensor`` is on the CPU, the tensor is staged (see ``_staging``), the original
collective runs on the staged copy with the caller's other arguments unchanged, and the result is written back
into the caller's own tensor object. With ``async_op=True`` the returned work handle finishes that copy in
``wait()``. Every other call goes to torch untouched.
"""

from __future__ import annotations

import torch

from offload_shim import _devices, _staging
from offload_shim._patching import Parameters, Target

MODULE = "torch.distributed.distributed_c10d"
IN_PLACE_COLLECTIVES = ("all_reduce", "broadcast")


def _in_place_wrapper(collective: str):
    def make(original):
        parameters = Parameters(original)

        def wrapper(wrapped, instance, args, kwargs):
            tensor = parameters.get(args, kwargs, "tensor")
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
                return wrapped(*args, **kwargs)
            group = _devices.resolve_c10d_group(parameters.get(args, kwargs, "group"))
            if group is None:
                return wrapped(*args, **kwargs)
            device = _devices.staging_device_for(tensor, group, f"torch.distributed.{collective}")
            if device is None:
                return wrapped(*args, **kwargs)
            staged = _staging.to_staging(tensor, device)
            args, kwargs = parameters.replace(args, kwargs, "tensor", staged)
            with _staging.staged_call():
                work = wrapped(*args, **kwargs)
            if work is None:  # synchronous: the current stream is ordered after the collective
                _staging.copy_into(tensor, staged)
                return None
            return _staging.StagedWork(work, lambda: _staging.copy_into(tensor, staged), [tensor])

        return wrapper

    return make


TARGETS = [Target(MODULE, name, _in_place_wrapper(name)) for name in IN_PLACE_COLLECTIVES]
