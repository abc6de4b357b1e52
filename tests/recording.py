"""A recording backend for the tests: a process group implemented in Python (``Backend.register_backend``, as torch's
own threaded test groups are) that wraps a Gloo group, serves ``cpu``, and records every collective that reaches
it, below offload_shim and below torch's Python functions (the functional collectives' C++ ops call it too).

What it records of a collective is what every rank must agree on for that collective (its wire): the operation,
and the sizes, dtypes, reduce op and root torch requires equal on every rank; never what torch lets differ (an
uneven list's sizes, all-to-all splits, which peer a send goes to). Two spellings of one operation are recorded
alike (``all_gather_single`` and ``_allgather_base``; a coalesced gather of one tensor and a plain one). So every
rank of a correct program records the same sequence.
"""

from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist

BACKEND = "recording"
_lock = threading.Lock()
_registered = []


def _bytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _op(options) -> str:
    op = getattr(options, "reduceOp", None)
    return str(getattr(op, "op", op))


class Recording(dist.ProcessGroup):
    """Gloo underneath; ``records``: what reached it, in order (see the module docstring)."""

    def __init__(self, store, rank, size, timeout, name):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._name = name
        self.records: list[tuple] = []

    @property
    def group_name(self):
        return self._name

    def getBackendName(self):
        return BACKEND

    def _get_backend(self, device):
        # Gloo's, for whatever torch asks of the backend (torch 2.14's batch_isend_irecv asks any ProcessGroup
        # whether its backend coalesces; a Python group has no C++ backend to answer).
        return self._gloo

    def _record(self, *what):
        self.records.append(what)

    def allreduce(self, tensors, options=None):
        self._record("allreduce", tuple(t.numel() for t in tensors), str(tensors[0].dtype), _op(options))
        return self._gloo.allreduce(tensors, options)

    def allreduce_coalesced(self, tensors, options=None):
        self._record("allreduce_coalesced", tuple(t.numel() for t in tensors), str(tensors[0].dtype), _op(options))
        return self._gloo.allreduce_coalesced(tensors, options)

    def broadcast(self, tensors, options=None):
        self._record("broadcast", tuple(_bytes(t) for t in tensors), options.rootRank)
        return self._gloo.broadcast(tensors, options)

    def reduce(self, tensors, options=None):
        self._record("reduce", tuple(t.numel() for t in tensors), str(tensors[0].dtype), _op(options), options.rootRank)
        return self._gloo.reduce(tensors, options)

    def allgather(self, outputs, inputs, options=None):
        self._record("allgather", len(outputs[0]))
        return self._gloo.allgather(outputs, inputs, options)

    def _allgather_base(self, output, input, options=None):
        self._record("allgather_base", _bytes(input))
        return self._gloo._allgather_base(output, input, options)

    def all_gather_single(self, output, input, options=None):
        return self._allgather_base(output, input, options)

    def allgather_coalesced(self, outputs, inputs, options=None):
        self._record("allgather_coalesced", len(inputs))
        return self._gloo.allgather_coalesced(outputs, inputs, options)

    def allgather_into_tensor_coalesced(self, outputs, inputs, options=None):
        works = [self._allgather_base(o, i, options) for o, i in zip(outputs, inputs)]
        for work in works[:-1]:
            work.wait()
        return works[-1]

    def reduce_scatter(self, outputs, inputs, options=None):
        self._record("reduce_scatter", len(inputs[0]), _op(options))
        return self._gloo.reduce_scatter(outputs, inputs, options)

    def _reduce_scatter_base(self, output, input, options=None):
        self._record("reduce_scatter_base", output.numel(), str(output.dtype), _op(options))
        return self._gloo._reduce_scatter_base(output, input, options)

    def reduce_scatter_single(self, output, input, options=None):
        return self._reduce_scatter_base(output, input, options)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, options=None):
        works = [self._reduce_scatter_base(o, i, options) for o, i in zip(outputs, inputs)]
        for work in works[:-1]:
            work.wait()
        return works[-1]

    def alltoall_base(self, output, input, output_splits, input_splits, options=None):
        self._record("alltoall_base")
        return self._gloo.alltoall_base(output, input, output_splits, input_splits, options)

    def all_to_all_single(self, output, input, output_splits, input_splits, options=None):
        return self.alltoall_base(output, input, output_splits, input_splits, options)

    def alltoall(self, outputs, inputs, options=None):
        self._record("alltoall", len(inputs))
        return self._gloo.alltoall(outputs, inputs, options)

    def gather(self, outputs, inputs, options=None):
        self._record("gather", _bytes(inputs[0]), options.rootRank)
        return self._gloo.gather(outputs, inputs, options)

    def gather_single(self, output, input, options=None):
        # torch 2.14's one-tensor gather (NCCL has it, Gloo not): Gloo's gather into the root's output, row by row.
        rows = [] if self.rank() != options.rootRank else [
            [row.view(input.shape) for row in output.view(self.size(), input.numel())]]
        return self.gather(rows, [input], options)

    def scatter(self, outputs, inputs, options=None):
        self._record("scatter", _bytes(outputs[0]), options.rootRank)
        return self._gloo.scatter(outputs, inputs, options)

    def send(self, tensors, dst, tag=0):
        self._record("point_to_point", _bytes(tensors[0]))  # a send and its receive: one size, either side
        return self._gloo.send(tensors, dst, tag)

    def recv(self, tensors, src, tag=0):
        self._record("point_to_point", _bytes(tensors[0]))
        return self._gloo.recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag=0):
        self._record("point_to_point", _bytes(tensors[0]))
        return self._gloo.recv_anysource(tensors, tag)

    def barrier(self, options=None):
        self._record("barrier")
        return self._gloo.barrier(options) if options is not None else self._gloo.barrier()


def _create(options, _backend_options):
    return Recording(options.store, options.group_rank, options.group_size, options.timeout, options.group_id)


def register() -> None:
    """Register the backend in this process (once): ``dist.new_group(backend="recording")`` then makes a group."""
    with _lock:
        if not _registered:
            dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
            _registered.append(True)


def new_group(timeout_s: float = 60) -> Recording:
    """A recording group of every rank. Its timeout (default 60 s, within the rank pools' 120 s) bounds how long a
    rank waits for a peer that raised before a collective: an error, not a hang."""
    register()
    return dist.new_group(backend=BACKEND, timeout=datetime.timedelta(seconds=timeout_s))


def take(group: Recording) -> list[tuple]:
    """What ``group`` recorded since the last take."""
    records, group.records = group.records, []
    return records
