"""Wrappers for the functional collectives of ``torch.distributed._functional_collectives``.

DTensor redistribution calls these, not ``torch.distributed.X``: Shard to Replicate calls ``all_gather_single``
(torch 2.13) or ``all_gather_tensor`` (older), Partial to Replicate calls ``all_reduce`` (this is where
``clip_grad_norm_`` reduces the total norm of FSDP2 gradients), Partial to Shard calls ``reduce_scatter_*``.
The others (``all_to_all_single``, ``permute_tensor``, the ``_autograd`` and coalesced forms) are wrapped alike.
They return a new tensor (a list for the coalesced forms) and leave their input alone; staged, they return a
plain tensor on the input's device, complete on return (torch's ``AsyncCollectiveTensor`` would wait lazily; a
staged result has been waited for). In a coalesced call only the host inputs are staged; each result comes back
to its input's device. Autograd passes through the staging copies. Whichever of the functions the running torch
has are wrapped.
"""

from __future__ import annotations

import torch

from offload_shim import _config, _counters, _devices, _staging
from offload_shim._patching import Parameters, Target

MODULE = "torch.distributed._functional_collectives"
# Each functional collective, by the parameter that holds its input: a tensor, or a list of tensors for the
# coalesced forms (one result per input, in order).
FUNCTIONAL_COLLECTIVES = {
    "all_reduce": "self",
    "broadcast": "self",
    "all_gather_single": "self",
    "all_gather_tensor": "self",
    "reduce_scatter_single": "self",
    "reduce_scatter_tensor": "self",
    "all_to_all_single": "self",
    "permute_tensor": "self",
    "all_gather_tensor_autograd": "self",
    "all_gather_single_autograd": "self",
    "reduce_scatter_tensor_autograd": "self",
    "reduce_scatter_single_autograd": "self",
    "all_to_all_single_autograd": "self",
    "all_reduce_coalesced": "self",
    "all_gather_into_tensor_coalesced": "self",
    "all_gather_single_coalesced": "self",
    "reduce_scatter_tensor_coalesced": "inputs",
    "reduce_scatter_single_coalesced": "inputs",
}
# Collectives whose input has the same size on every rank: these may be routed off Gloo by size.
SAME_SIZE_ON_EVERY_RANK = frozenset({"all_reduce", "broadcast"})


def _functional_wrapper(collective: str, input_name: str):
    name = f"{MODULE}.{collective}"

    def make(original):
        parameters = Parameters(original)
        lazy = _devices.refused_for_host(name)  # accelerator inputs go to torch first (see _devices)

        def wrapper(wrapped, instance, args, kwargs):
            value = parameters.get(args, kwargs, input_name)
            coalesced = isinstance(value, (list, tuple))
            inputs = list(value) if coalesced else [value]
            host = any(_staging.needs_staging(t) for t in inputs)
            refused = None
            if not host:
                if lazy:  # accelerator inputs on a collective that needs the host only where torch refuses them
                    result, refused = _devices.torch_first(wrapped, args, kwargs)
                    if refused is None:
                        return result
                elif not _config.settings().host_staging:
                    return wrapped(*args, **kwargs)
            group = _devices.resolve_functional_group(
                parameters.get(args, kwargs, "group"), parameters.get(args, kwargs, "tag", "")
            )
            if group is None:
                if refused is not None:
                    raise refused
                return wrapped(*args, **kwargs)
            source, device = "cpu", None
            if not host:  # accelerator inputs: through the host where the group has no path for them
                source = _devices.host_staging_for(inputs, group, name)
                device = None if source is None else torch.device("cpu")
            elif not _devices.host_calls_served(group):
                if collective in SAME_SIZE_ON_EVERY_RANK:
                    device = _devices.staging_device_for(value, group, name, value.numel() * value.element_size())
                else:
                    device = _devices.staging_device_for_call(inputs, group, name)
            if device is None:
                if refused is not None:
                    raise refused
                return wrapped(*args, **kwargs)
            nbytes = _counters.host_bytes(inputs, source)
            try:
                staged = [_staging.to_staging(t, device) if _staging.needs_staging(t, source) else t for t in inputs]
                args, kwargs = parameters.replace(args, kwargs, input_name, staged if coalesced else staged[0])
                with _staging.staged_call():
                    result = wrapped(*args, **kwargs)
                    results = [_waited(r) for r in (result if coalesced else [result])]
                back = [
                    _staging.to_caller(r, t.device) if _staging.needs_staging(t, source) else r
                    for r, t in zip(results, inputs)
                ]
                return back if coalesced else back[0]
            finally:
                _counters.count(name, _counters.WHOLE, nbytes)

        return wrapper

    return make


def _waited(result):
    """``result`` complete on the current stream: an ``AsyncCollectiveTensor`` waited, else as it is."""
    wait = getattr(result, "wait", None)
    return wait() if callable(wait) else result


TARGETS = [Target(MODULE, name, _functional_wrapper(name, param)) for name, param in FUNCTIONAL_COLLECTIVES.items()]
