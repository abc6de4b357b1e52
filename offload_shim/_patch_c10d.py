"""Wrappers for ``torch.distributed`` collectives that work in place on one tensor.

``all_reduce(tensor, op, group, async_op)`` and ``broadcast(tensor, src, group, async_op, group_src)``: when
``tensor`` is on the CPU and the group serves no CPU backend (or routes it, see ``_devices``), the tensor is
staged, the original collective runs on the staged copy with the caller's other arguments, and the result is
written back into the caller's own tensor object. Contiguous tensors of at least two chunks go through the
chunked pipeline (``_pipeline``); smaller or non-contiguous ones as one staged copy (``_staging``), which costs
less for a single chunk (measured: results/gpu/bench.log). With ``async_op=True`` the returned work handle
finishes the copy back in ``wait()``. Every other call goes to torch untouched.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from offload_shim import _config, _devices, _pipeline, _staging
from offload_shim._patching import Parameters, Target

MODULE = "torch.distributed.distributed_c10d"
IN_PLACE_COLLECTIVES = ("all_reduce", "broadcast")


def _broadcast_source(parameters, args, kwargs, group) -> bool | None:
    """Whether this rank is the broadcast's source; ``None`` when the arguments do not say (torch will raise)."""
    group_src = parameters.get(args, kwargs, "group_src")
    if group_src is not None:
        return group.rank() == group_src
    src = parameters.get(args, kwargs, "src")
    return None if src is None else dist.get_rank() == src


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
            nbytes = tensor.numel() * tensor.element_size()  # the same on every rank for these collectives
            device = _devices.staging_device_for(tensor, group, f"torch.distributed.{collective}", nbytes)
            if device is None:
                return wrapped(*args, **kwargs)
            async_op = bool(parameters.get(args, kwargs, "async_op", False))
            if tensor.is_contiguous() and nbytes >= _pipeline.MIN_PIPELINED_CHUNKS * _config.settings().chunk_bytes:
                source = _broadcast_source(parameters, args, kwargs, group) if collective == "broadcast" else None

                def launch(chunk):
                    chunk_args, chunk_kwargs = parameters.replace(args, kwargs, "tensor", chunk)
                    chunk_args, chunk_kwargs = parameters.replace(chunk_args, chunk_kwargs, "async_op", True)
                    return wrapped(*chunk_args, **chunk_kwargs)

                return _pipeline.stage_in_place(
                    tensor, device, group, launch, reads=source is not False, writes=source is not True, async_op=async_op
                )
            staged = _staging.to_staging(tensor, device)
            args, kwargs = parameters.replace(args, kwargs, "tensor", staged)
            with _staging.staged_call():
                work = wrapped(*args, **kwargs)
            if not async_op:  # the current stream is ordered after the collective
                _staging.copy_into(tensor, staged)
                return None
            return _staging.StagedWork([work], lambda: _staging.copy_into(tensor, staged), [tensor])

        return wrapper

    return make


TARGETS = [Target(MODULE, name, _in_place_wrapper(name)) for name in IN_PLACE_COLLECTIVES]
