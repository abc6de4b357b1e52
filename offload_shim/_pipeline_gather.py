"""The chunked staging pipeline for gathers: ``DTensor.full_tensor`` of a shard that lives on the host.

A DTensor sharded ``Shard(0)`` over one mesh dimension of ``W`` ranks (every other mesh dimension ``Replicate()``)
whose local tensor is on the host (FSDP2's ``CPUOffloadPolicy``) is gathered through the two accelerator buffers
(slots) of a :mod:`~offload_shim._pipeline` pool, ``k`` rows of each rank's shard per step, with
``k = max(1, chunk_bytes // (W * row_bytes))`` (``row_bytes``: one row of the global tensor). A slot is viewed as
``W`` parts of ``k`` rows, part ``r`` for rank ``r``. Per step ``j`` in slot ``j % 2``:

* H2D of this rank's rows ``[j*k, j*k+k)`` of its shard into its own part, on the pool's H2D stream, after the
  slot's previous D2H (event ``slot_free``);
* ``all_gather_into_tensor`` of the slot from that part (in place, as FSDP2 gathers: no send buffer), launched with
  the H2D stream current, so the backend's stream waits on that copy;
* D2H on the pool's D2H stream, made to wait on the gather by the work handle's ``wait()``: each rank's rows of the
  step, from its part into their rows of the result.

So step ``j``'s gather overlaps step ``j+1``'s H2D and step ``j-1``'s D2H, as the chunks of
:func:`~offload_shim._pipeline.stage_in_place` do.

Shards follow torch's ``Shard(0)``, which is ``torch.chunk``'s: each full shard has ``b = ceil(N / W)`` rows of the
``N``, rank ``r`` holds rows ``[r*b, min(N, (r+1)*b))``, so later ranks may hold fewer rows, or none. Every rank
runs ``ceil(b / k)`` steps; the rows of a part past its rank's shard are padding, gathered but never copied out.
The slots gather bytes (``uint8``), so every dtype goes through, as in FSDP2's all-gather.

The slots hold ``W * k`` rows: at most ``chunk_bytes``, except where one row is larger than ``chunk_bytes / W``;
then ``k`` is 1 and the pool is taken with slots of ``W`` rows (a pool of another chunk size is freed for it, as for
any change of chunk size). The accelerator footprint is the pool's two slots, whatever the tensor's size.

Before the first gather, behind the first step's H2D, the ranks check that they all gather as many elements of one
dtype in chunks of one size (:func:`~offload_shim._pipeline._agree`, on the global size, which every rank shares).
The result is a new contiguous host tensor of the global shape, pinned where it comes from an accelerator, complete
when returned. The caller's shard is only read.

Staging through ``cpu`` (the testing configuration) runs the same loop with plain host copies and no streams.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist

from offload_shim import _config, _staging
from offload_shim._devices import StagingError
from offload_shim._pipeline import MIN_PIPELINED_CHUNKS, _acquire, _agree, _current, _current_stream, _give_back

_log = logging.getLogger("offload_shim")

COLLECTIVE = "DTensor.full_tensor"
# What a rank whose shard is not laid out as torch.chunk's tells the others in the agreement check: every rank then
# raises, rather than gathering rows that do not line up.
_MISLAID = f"{COLLECTIVE} of a shard not laid out as torch.chunk's"


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one ``full_tensor`` call is gathered in chunks.

    Attributes:
        device: the staging device.
        group: the process group of the sharded mesh dimension.
        world: its size, ``W``.
        index: this rank's coordinate on that mesh dimension (its shard's index).
        shape: the global shape.
        dtype: the dtype.
        block: rows of a full shard, ``ceil(N / W)``.
        rows: rows of each rank's shard per step, ``k``.
        chunk_bytes: the configured chunk size, in bytes.
        laid_out: whether this rank's local shard has the shape torch's ``Shard(0)`` gives it.
    """

    device: torch.device
    group: dist.ProcessGroup
    world: int
    index: int
    shape: torch.Size
    dtype: torch.dtype
    block: int
    rows: int
    chunk_bytes: int
    laid_out: bool

    @property
    def row_bytes(self) -> int:
        return self.shape[1:].numel() * self.dtype.itemsize

    @property
    def steps(self) -> int:
        return -(-self.block // self.rows)

    def shard(self, index: int) -> tuple[int, int]:
        """``(first row, row count)`` in the global tensor of shard ``index`` (``torch.chunk``'s layout, as
        ``Shard.local_shard_size_and_offset``)."""
        start = min(self.shape[0], index * self.block)
        return start, max(0, min(self.shape[0], start + self.block) - start)


def _sharded_mesh_dim(placements, ndim: int) -> int | None:
    """The mesh dimension of ``placements`` that is ``Shard(0)`` (a negative dim normalised), where that is the
    only one and every other is ``Replicate()``; otherwise ``None``. ``_StridedShard`` is not ``Shard(0)``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    sharded = None
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, Shard) or isinstance(placement, _StridedShard) or sharded is not None:
            return None
        if placement.dim % ndim != 0:
            return None
        sharded = mesh_dim
    return sharded


def plan(instance, device: torch.device) -> Plan | None:
    """The chunked plan for ``instance.full_tensor()`` (no arguments) staged through ``device``, or ``None`` where
    it is staged whole: placements other than one ``Shard(0)`` with every other mesh dimension ``Replicate()``, a
    full tensor under :data:`~offload_shim._pipeline.MIN_PIPELINED_CHUNKS` chunks, or code being compiled. Decided
    from the global shape and the placements, the same on every rank, so that every rank takes the same path."""
    if instance.ndim == 0 or torch.compiler.is_compiling():
        return None
    mesh_dim = _sharded_mesh_dim(instance.placements, instance.ndim)
    if mesh_dim is None:
        return None
    chunk_bytes = _config.settings().chunk_bytes
    if instance.numel() * instance.dtype.itemsize < MIN_PIPELINED_CHUNKS * chunk_bytes:
        return None
    mesh, shape = instance.device_mesh, instance.shape
    world = mesh.size(mesh_dim)
    row_bytes = shape[1:].numel() * instance.dtype.itemsize
    result = Plan(
        device=device,
        group=mesh.get_group(mesh_dim),
        world=world,
        index=mesh.get_local_rank(mesh_dim),
        shape=shape,
        dtype=instance.dtype,
        block=-(-shape[0] // world),
        rows=max(1, chunk_bytes // (world * row_bytes)),
        chunk_bytes=chunk_bytes,
        laid_out=True,
    )
    local_shape = instance._local_tensor.shape
    return dataclasses.replace(result, laid_out=local_shape == (result.shard(result.index)[1], *shape[1:]))



# torch's gather of each rank's part into one tensor, by its current name: ``all_gather_single`` (2.13); 2.11 has
# only ``all_gather_into_tensor``, which 2.13 deprecates with a warning torch's own calls never give.
GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def _gather_into(output, input, **kwargs):
    return getattr(dist, GATHER)(output, input, **kwargs)

def full_tensor(instance, plan: Plan) -> torch.Tensor:
    """``instance.full_tensor()`` gathered in chunks (see the module docstring): a new host tensor.

    Differentiable, as torch's: the full tensor's gradient is taken as ``Replicate()`` (torch's default where
    ``grad_placements`` is ``None``), and its ``Shard(0)`` part on this rank, this shard's rows, becomes the local
    tensor's gradient, with no communication (Replicate to Shard is a local narrow in torch).

    Raises:
        StagingError: the ranks disagree on the global size, dtype or chunk size, or a local shard does not have
            the shape torch's ``Shard(0)`` gives it; on every rank, before any gather.
        Exception: what the gather raises. The caller's shard is never written.
    """
    local = instance.to_local()
    if torch.is_grad_enabled() and local.requires_grad:
        return _FullTensor.apply(local, plan)
    return gather(local, plan)


class _FullTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, plan: Plan) -> torch.Tensor:
        ctx.plan = plan
        return gather(local, plan)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start, count = ctx.plan.shard(ctx.plan.index)
        # A copy: a view would keep the whole gradient's memory alive in the shard's .grad.
        return grad.narrow(0, start, count).clone(memory_format=torch.contiguous_format), None


def gather(local: torch.Tensor, plan: Plan) -> torch.Tensor:
    """The full tensor of the shards whose local part on this rank is host tensor ``local`` (any strides), gathered
    in chunks through ``plan.device``: a new contiguous host tensor, pinned where ``plan.device`` is an
    accelerator, complete when this returns. Reads ``local`` after any outstanding staged call that writes it."""
    _staging.finish_writes_to([local])
    result = torch.empty(plan.shape, dtype=plan.dtype, pin_memory=plan.device.type != "cpu")
    pool = _acquire(plan.device, max(plan.chunk_bytes, plan.world * plan.rows * plan.row_bytes))
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug(
            "offload_shim: %s of %s %s in %d steps of %d rows from each of %d ranks",
            COLLECTIVE, tuple(plan.shape), plan.dtype, plan.steps, plan.rows, plan.world,
        )
    try:
        with _staging.staged_call(), torch.no_grad():
            _run_steps(pool, local, result, plan)
    finally:
        _give_back(pool)
    return result


def _rows(part: torch.Tensor, count: int, plan: Plan) -> torch.Tensor:
    """The first ``count`` rows of a slot's ``part`` (bytes), as ``plan``'s dtype and row shape."""
    return part[: count * plan.row_bytes].view(plan.dtype).view(count, *plan.shape[1:])


def _run_steps(pool, local: torch.Tensor, result: torch.Tensor, plan: Plan) -> None:
    device, k = pool.device, plan.rows
    part_bytes = k * plan.row_bytes
    pinned = device.type != "cpu"
    shards = [plan.shard(r) for r in range(plan.world)]
    mine = shards[plan.index][1]
    pool.h2d.wait_stream(_current_stream(device))
    for j in range(plan.steps):
        s = j % len(pool.slots)
        slot = pool.slots[s][: plan.world * part_bytes]
        parts = slot.view(plan.world, part_bytes)
        if pool.slot_free[s] is not None:
            pool.h2d.wait_event(pool.slot_free[s])
        count = min(k, max(0, mine - j * k))
        if count:
            with _current(pool.h2d):
                _staging.bits(_rows(parts[plan.index], count, plan)).copy_(
                    _staging.bits(local[j * k : j * k + count]), non_blocking=True
                )
        if j == 0:  # behind the first step's H2D
            _agree(
                plan.group, device, COLLECTIVE if plan.laid_out else _MISLAID, plan.shape.numel(), plan.dtype,
                plan.chunk_bytes,
            )
            if not plan.laid_out:  # every rank's shard is mislaid alike
                raise StagingError(
                    f"offload_shim: {COLLECTIVE}: this rank's local shard has shape {tuple(local.shape)}, not the "
                    f"{(shards[plan.index][1], *plan.shape[1:])} that torch's Shard(0) of {tuple(plan.shape)} over "
                    f"{plan.world} ranks gives it (torch.chunk's layout). No rank gathered; the shards are unchanged."
                )
        with _current(pool.h2d):
            work = _gather_into(slot, parts[plan.index], group=plan.group, async_op=True)
        with _current(pool.d2h):
            work.wait()  # the D2H stream waits on the gather (Gloo: the gather has finished)
            for r, (start, rows) in enumerate(shards):
                count = min(k, max(0, rows - j * k))
                if count:
                    first = start + j * k
                    _staging.bits(result[first : first + count]).copy_(
                        _staging.bits(_rows(parts[r], count, plan)), non_blocking=pinned
                    )
        pool.slot_free[s] = pool.d2h.record_event()
    pool.d2h.synchronize()
