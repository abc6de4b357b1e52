"""Wrapper for ``DTensor.full_tensor``.

FSDP2 with ``CPUOffloadPolicy`` builds DTensors whose local tensor is a pinned CPU tensor on a ``cuda`` device
mesh. ``full_tensor()`` of such a DTensor, on a mesh whose groups serve no CPU backend, is staged one of two ways.

Chunked (:mod:`offload_shim._pipeline_gather`), where the placements are ``Shard(0)`` (a negative dim counts; not
``_StridedShard``) on exactly one mesh dimension and ``Replicate()`` on every other, ``full_tensor()`` is called
without ``grad_placements``, the full tensor is at least ``MIN_PIPELINED_CHUNKS`` chunks (decided from the global
shape, the same on every rank), and no code is being compiled: the shard goes to the accelerator a few rows at a
time, each step gathered with ``all_gather_into_tensor`` on the sharded dimension's group and copied back into a new
host tensor, the copies overlapping the gathers. Accelerator memory: the pipeline pool's two slots (two chunks, or
two slots of one row per rank where a row is larger than a chunk over the ranks), whatever the tensor's size.
Differentiable, as torch's (the gradient's rows of this rank's shard).

Whole, otherwise (``Shard`` on another dim, several sharded mesh dimensions, ``Partial``, ``_StridedShard``,
``grad_placements`` given, a small tensor): the local shard goes to the staging device once, the original
``full_tensor`` gathers it there (every redistribution hop on the accelerator), and the full tensor comes back
once, to the local tensor's device; the accelerator memory is the shard and the full tensor. Autograd passes
through (``to_local``, ``DTensor.from_local`` and the copies are differentiable). Without this wrapper the
functional-collective wrappers would still stage each hop of the redistribution, copying to and fro per mesh
dimension.

Side effects are safe to repeat: under ``torch.compile`` this wrapper has been seen to run twice for one call.
"""

from __future__ import annotations

from offload_shim import _counters, _devices, _pipeline_gather, _staging
from offload_shim._patching import Target

MODULE = "torch.distributed.tensor._api"
COLLECTIVE = _pipeline_gather.COLLECTIVE  # "DTensor.full_tensor"


def _staging_device_for_mesh(local, mesh, route_bytes):
    """The device to stage ``local`` through for a collective on every dimension of ``mesh``, or ``None``. A
    dimension of one rank is left out: torch's redistribution runs no collective there (the ``num_chunks == 1``
    short cut of ``torch.distributed.tensor._redistribute``), so ``full_tensor`` on a one-rank mesh stays torch's
    own, a no-op, rather than a copy to the accelerator and back."""
    devices = {
        _devices.staging_device_for(local, mesh.get_group(dim), COLLECTIVE, route_bytes)
        for dim in range(mesh.ndim)
        if mesh.size(dim) > 1
    }
    devices.discard(None)
    if not devices:
        return None
    if len(devices) > 1:
        raise _devices.StagingError(
            f"offload_shim: DTensor.full_tensor on mesh {mesh} would stage through several devices "
            f"{sorted(map(str, devices))}; set OFFLOAD_SHIM_STAGING_DEVICE to choose one"
        )
    return devices.pop()


def _make_full_tensor_wrapper(original):
    def wrapper(wrapped, instance, args, kwargs):
        local = instance._local_tensor
        if local.device.type != "cpu":
            return wrapped(*args, **kwargs)
        mesh = instance.device_mesh
        # Routed by the global size, the same on every rank (local shards may differ in size).
        device = _staging_device_for_mesh(local, mesh, instance.numel() * local.element_size())
        if device is None:
            return wrapped(*args, **kwargs)
        chunked = None
        if not args and set(kwargs) <= {"grad_placements"} and kwargs.get("grad_placements") is None:
            chunked = _pipeline_gather.plan(instance, device)
        try:
            if chunked is not None:
                return _pipeline_gather.full_tensor(instance, chunked)
            return _staged_whole(original, instance, device, args, kwargs)
        finally:
            _counters.count(COLLECTIVE, _counters.WHOLE if chunked is None else _counters.PIPELINED, local.nbytes)

    return wrapper


def _staged_whole(original, instance, device, args, kwargs):
    """``instance.full_tensor(*args, **kwargs)`` with the local shard staged through ``device`` once, the full
    tensor back once."""
    from torch.distributed.tensor import DTensor

    staged = DTensor.from_local(
        _staging.to_staging(instance.to_local(), device),
        instance.device_mesh,
        instance.placements,
        run_check=False,
        shape=instance.shape,
        stride=instance.stride(),
    )
    with _staging.staged_call():
        full = original(staged, *args, **kwargs)
    return _staging.to_caller(full, instance._local_tensor.device)


TARGETS = [Target(MODULE, "full_tensor", _make_full_tensor_wrapper, owner="DTensor")]
