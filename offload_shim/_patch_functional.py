"""Wrappers for the functional collectives of ``torch.distributed._functional_collectives``.

DTensor redistribution calls these, not ``torch.distributed.X``: Shard to Replicate calls ``all_gather_single``
(torch 2.13) or ``all_gather_tensor`` (older), Partial to Replicate calls ``all_reduce`` (this is where
``clip_grad_norm_`` reduces the total norm of FSDP2 gradients), Partial to Shard calls ``reduce_scatter_*``.
They return a new tensor and leave their input alone; staged, they return a plain tensor on the input's device,
complete on return (torch's ``AsyncCollectiveTensor`` would wait lazily; a staged result has been waited for).
Autograd passes through the staging copies. Whichever of the functions the running torch has are wrapped.
"""

from __future__ import annotations

import torch

from offload_shim import _devices, _staging
from offload_shim._patching import Parameters, Target

MODULE = "torch.distributed._functional_collectives"
FUNCTIONAL_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather_single",
    "all_gather_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
)
# Collectives whose input has the same size on every rank: these may be routed off Gloo by size.
SAME_SIZE_ON_EVERY_RANK = frozenset({"all_reduce", "broadcast"})


def _functional_wrapper(collective: str):
    def make(original):
        parameters = Parameters(original)

        def wrapper(wrapped, instance, args, kwargs):
            tensor = parameters.get(args, kwargs, "self")
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
                return wrapped(*args, **kwargs)
            group = _devices.resolve_functional_group(
                parameters.get(args, kwargs, "group"), parameters.get(args, kwargs, "tag", "")
            )
            if group is None:
                return wrapped(*args, **kwargs)
            route_bytes = tensor.numel() * tensor.element_size() if collective in SAME_SIZE_ON_EVERY_RANK else None
            device = _devices.staging_device_for(tensor, group, f"{MODULE}.{collective}", route_bytes)
            if device is None:
                return wrapped(*args, **kwargs)
            staged = _staging.to_staging(tensor, device)
            args, kwargs = parameters.replace(args, kwargs, "self", staged)
            with _staging.staged_call():
                result = wrapped(*args, **kwargs)
                wait = getattr(result, "wait", None)  # AsyncCollectiveTensor: the current stream waits on it
                if callable(wait):
                    result = wait()
            return _staging.to_caller(result, tensor.device)

        return wrapper

    return make


TARGETS = [Target(MODULE, name, _functional_wrapper(name)) for name in FUNCTIONAL_COLLECTIVES]
