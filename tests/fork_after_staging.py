"""Staged calls of every mode, then ``fork()``: the children must live as they would without the shim.

One process of a job, on a group whose backend serves only the
accelerator (``nccl``, or ``cuda:gloo`` for several ranks on one GPU), or on CPU ranks of ``gloo`` with every host
tensor staged through the host (``--stage-through cpu``: the CPU machine's form). Each rank:

1. stages calls of every mode, pinned and pageable where there is an accelerator: small (replayed from a CUDA
   graph on NCCL), whole (list gathers, asynchronous calls of one chunk), pipelined (synchronous and asynchronous),
   pageable storages staged again (registered where ``register_bytes`` allows), and a registered communicator;
   each result checked against the sum or gather it must be;
2. forks children that do CPU work only (reading the tensors those calls wrote, and a computation of their own):
   one that ends with ``os._exit``, one that ends through the interpreter's exit (its modules torn down), one forked
   while an asynchronous staged call is outstanding, one that makes a group of its own (Gloo, one rank) and stages a
   call on it, which must start from nothing (no counted calls but its own); then two epochs of a ``DataLoader``
   with two workers made by ``fork`` (not persistent: forked again for the second epoch);
3. stages once more after the children, and prints ``OK rank R``.

A child that dies (``c10::AcceleratorError`` in a forked child is ``std::terminate``, status 6) or hangs (60 s) is
reported with its status, and the process exits 1.

Run with one intra-op thread a rank (``OMP_NUM_THREADS=1``, as torchrun sets where it starts several ranks): a child
forked after torch's own OpenMP ran threaded hangs in its first parallel op, with or without the shim (seen with
torch 2.13 on the CPU machine and 2.11 on one H100).
``torchrun --standalone --nproc_per_node 1 tests/fork_after_staging.py --backend nccl``, ``... --nproc_per_node 2
tests/fork_after_staging.py --backend cuda:gloo``, ``... --nproc_per_node 2 tests/fork_after_staging.py --backend
gloo --stage-through cpu``; ``--by-hand``: the same calls staged by hand without the shim (the baseline).
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
import sys

import torch
import torch.distributed as dist
import torch.utils.data

import offload_shim
from offload_shim import _registration

CHUNK = 1 << 20  # the pipeline's chunk here: 4 MiB calls are 4 chunks
HANG_SECONDS = 60


class Communicator:
    """A communicator bound to one device, asserting it as vLLM's ``PyNcclCommunicator`` does."""

    def __init__(self, device, group):
        self.device, self.group = torch.device(device), group

    def all_reduce(self, tensor):
        assert tensor.device == self.device, f"created to work on {self.device}, but the input tensor is on {tensor.device}"
        dist.all_reduce(tensor, group=self.group)
        return tensor


class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.full((4,), float(index))


class _Waited:
    """What a call staged by hand returns for ``async_op=True``: its copies back are done already."""

    def wait(self):
        return True


def by_hand(device: torch.device):
    """``call(collective, *args, **kwargs)`` staging by hand, without the shim: each host tensor (or list of them)
    copied to ``device`` non-blocking (``Tensor.to``), the collective (waited), each copy written back."""

    def call(collective, *args, **kwargs):
        staged = []

        def to_device(value):
            if isinstance(value, list):
                return [to_device(each) for each in value]
            if isinstance(value, torch.Tensor) and value.device != device:
                copy = value.to(device, non_blocking=True)
                staged.append((value, copy))
                return copy
            return value

        asynchronous = kwargs.get("async_op", False)
        result = collective(*map(to_device, args), **{k: to_device(v) for k, v in kwargs.items()})
        if asynchronous:
            result.wait()
        for original, copy in staged:
            original.copy_(copy)
        return _Waited() if asynchronous else result

    return call


def _shim_call(collective, *args, **kwargs):
    return collective(*args, **kwargs)


call = _shim_call  # how this process calls a collective on host tensors (main() picks; see by_hand)


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


def stage_every_mode(device: torch.device, world: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Staged calls of every mode; returns ``(tensor, expected)`` of what they wrote, for the children to read."""
    written = []
    total = world * (world + 1) / 2  # the sum of rank + 1 over the ranks
    memories = ["pageable", "pinned"] if device.type == "cuda" else ["pageable"]
    communicator = Communicator(device, dist.group.WORLD)
    for memory in memories:
        pinned = memory == "pinned"

        def full(numel, value):
            return torch.full((numel,), float(value), pin_memory=pinned)

        small = full(1, rank + 1)
        for _ in range(3):  # the second is captured, the third replayed (NCCL)
            small.fill_(rank + 1)
            call(dist.all_reduce, small)
        written.append((small, torch.full((1,), total)))
        scalar = torch.tensor(float(rank + 1)).pin_memory() if pinned else torch.tensor(float(rank + 1))
        call(dist.all_reduce, scalar)
        written.append((scalar, torch.tensor(total)))
        gathered = [full(3, -1) for _ in range(world)]  # whole: a list gather
        call(dist.all_gather, gathered, full(3, rank))
        written += [(t, torch.full((3,), float(r))) for r, t in enumerate(gathered)]
        one_chunk = full(CHUNK // 8, rank + 1)  # whole: asynchronous, of one chunk
        call(dist.all_reduce, one_chunk, async_op=True).wait()
        written.append((one_chunk, torch.full((CHUNK // 8,), total)))
        reused = full(4 * CHUNK // 4, 0)  # pipelined, the same storage three times (registered at its second)
        for step in range(3):
            reused.fill_(rank + 1 + step)
            call(dist.all_reduce, reused)
        written.append((reused, torch.full((CHUNK,), total + 2 * world)))
        broadcast = full(4 * CHUNK // 4, rank)
        call(dist.broadcast, broadcast, src=0)
        written.append((broadcast, torch.zeros(CHUNK)))
        into = full(world * CHUNK // 4, -1)
        call(dist.all_gather_into_tensor, into, full(CHUNK // 4, rank))
        written.append((into, torch.arange(world).repeat_interleave(CHUNK // 4).float()))
        for _ in range(2):  # pipelined, asynchronous
            asynchronous = full(4 * CHUNK // 4, rank + 1)
            call(dist.all_reduce, asynchronous, async_op=True).wait()
            written.append((asynchronous, torch.full((CHUNK,), total)))
        large = full(64 * CHUNK // 4, rank + 1)  # 64 MiB
        call(dist.all_reduce, large)
        written.append((large, torch.full((16 * CHUNK,), total)))
        through = full(5, rank + 1)  # the registered communicator
        call(communicator.all_reduce, through)
        written.append((through, torch.full((5,), total)))
    for tensor, expected in written:
        _check(torch.equal(tensor, expected), f"a staged call wrote {tensor.flatten()[:4]}, not {expected.flatten()[:4]}")
    return written


def _child_work(written) -> int:
    """CPU work of a child: read what the staged calls wrote, compute something of its own. 0 if all is right."""
    try:
        for tensor, expected in written:
            if not torch.equal(tensor, expected):
                return 3
        return 0 if torch.arange(1000.0).sum().item() == 499500.0 else 4
    except BaseException:  # noqa: BLE001 - a child reports by its status alone
        return 5


def _wait_child(pid: int, what: str) -> None:
    deadline = time.monotonic() + HANG_SECONDS
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            _check(code == 0, f"{what}: the child ended with status {code}")
            return
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError(f"{what}: the child did not end within {HANG_SECONDS} s")


def fork_children(written, device: torch.device, rank: int, world: int) -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(_child_work(written))
    _wait_child(pid, "a child that ends with os._exit")

    outstanding = torch.full((4 * CHUNK // 4,), float(rank + 1), pin_memory=device.type == "cuda")
    work = call(dist.all_reduce, outstanding, async_op=True)
    pid = os.fork()
    if pid == 0:
        os._exit(_child_work(written))
    _wait_child(pid, "a child forked while an asynchronous staged call was outstanding")
    work.wait()
    _check(torch.equal(outstanding, torch.full_like(outstanding, world * (world + 1) / 2)), "the outstanding call")

    pid = os.fork()
    if pid == 0:
        os._exit(_child_with_a_group_of_its_own(call is _shim_call))
    _wait_child(pid, "a child that stages on a group of its own")

    loader = torch.utils.data.DataLoader(Numbers(), batch_size=2, num_workers=2, multiprocessing_context="fork",
                                         persistent_workers=False)
    for epoch in range(2):
        batches = [batch for batch in loader]
        _check(torch.equal(torch.cat(batches)[:, 0], torch.arange(8.0)), f"epoch {epoch} of a forked DataLoader")


def _child_with_a_group_of_its_own(staged: bool) -> int:
    """In a forked child: a Gloo group of one rank, with calls on it staged through the host (``staged``; else
    torch's own). The counters start from nothing, and count the child's calls alone; the calls are right."""
    try:
        # The parent's groups are not the child's to use, nor to destroy (torch's destroy_process_group hangs in a
        # forked child, with or without the shim): a world of the child's own, as torch's threaded tests make one.
        dist.distributed_c10d._world = dist.distributed_c10d._World()
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
        if offload_shim.staging_counters():
            return 6  # the parent's calls counted in the child
        offload_shim.configure(staging_device="cpu", always_stage=True, chunk_bytes=CHUNK)
        for numel in (1, 4 * CHUNK // 4):
            tensor = torch.full((numel,), 3.0)
            dist.all_reduce(tensor)
            if not torch.equal(tensor, torch.full((numel,), 3.0)):
                return 7
        counted = sum(count.calls for count in offload_shim.staging_counters().values())
        return 0 if counted == (2 if staged else 0) else 8
    except BaseException:  # noqa: BLE001 - a child reports by its status alone
        import traceback

        traceback.print_exc()
        return 9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", required=True, help="nccl, cuda:gloo, or gloo (with --stage-through cpu)")
    parser.add_argument("--stage-through", default=None, help="cpu: stage host tensors through the host (CPU form)")
    parser.add_argument("--register-bytes", default="1GiB", help="pageable memory staging may register")
    parser.add_argument("--by-hand", action="store_true", help="without the shim: stage by hand (the baseline)")
    options = parser.parse_args()
    global call
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if options.stage_through is None:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        offload_shim.configure(chunk_bytes=CHUNK, register_bytes=options.register_bytes)
    else:
        device = torch.device(options.stage_through)
        offload_shim.configure(chunk_bytes=CHUNK, staging_device=device, always_stage=True)
    if options.by_hand:
        offload_shim.uninstall()
        call = by_hand(device)
    else:
        offload_shim.register_communicator(Communicator, "all_reduce", device="device", reads="tensor",
                                           writes="tensor")
    kwargs = {"device_id": device} if options.backend == "nccl" else {}
    dist.init_process_group(options.backend, timeout=datetime.timedelta(seconds=120), **kwargs)
    offload_shim.reset_staging_counters()
    written = stage_every_mode(device, world, rank)
    counted = sum(count.calls for count in offload_shim.staging_counters().values())
    _check(counted == 0 if options.by_hand else counted > 0, f"{counted} staged calls")
    fork_children(written, device, rank, world)
    after = torch.full((4 * CHUNK // 4,), float(rank + 1))
    call(dist.all_reduce, after)
    _check(torch.equal(after, torch.full_like(after, world * (world + 1) / 2)), "a staged call after the children")
    modes = sorted({key.mode for key in offload_shim.staging_counters()})
    registered = 0 if options.by_hand else _registration.registered_bytes()
    dist.destroy_process_group()
    how = "staged by hand" if options.by_hand else f"modes {', '.join(modes)}; {registered} bytes registered"
    sys.stdout.write(f"OK rank {rank} ({options.backend}, {how})\n")  # (one write: ranks share the stream)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
