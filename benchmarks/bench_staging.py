"""Staging benchmark, on one or two accelerators of one host: every figure and its references in one process run,
so that ratios hold.

    torchrun --nproc_per_node 1 benchmarks/bench_staging.py --out DIR [--quick]   # one GPU: a one-rank NCCL group
    torchrun --nproc_per_node 2 benchmarks/bench_staging.py --out DIR [--quick]
    torchrun --nproc_per_node 2 benchmarks/bench_staging.py --out DIR --smoke     # CPU only: Gloo, tiny sizes

Sections (``kind`` of each JSON record):

* ``copy_limits``: pinned H2D and D2H of 256 MiB on both ranks at once (the floor: bytes over that H2D
  bandwidth), both directions at once on both ranks (the duplex limit an all_reduce cannot beat), and the same
  DMA with the host copies that pageable memory needs beside it, on the copy threads (the pageable limit).
* ``small``: per-call latency of a 0-dim fp32 SUM and a 1-element int8 MIN all_reduce, and of the same tensors'
  broadcast from rank 0, of a pageable CPU tensor: offload_shim on a NCCL-only group (replayed from a CUDA graph
  after the first call), staging by hand (``t.to(dev)``, the call, copy back), Gloo (``cpu:gloo,cuda:nccl``, no
  shim), and the GPU-resident call followed by a stream sync.
* ``served``: CPU time the wrappers add to calls that need no staging (all_reduce, broadcast, all_gather_into_tensor,
  reduce_scatter_tensor of accelerator tensors on the NCCL group; all_reduce of a CPU tensor on Gloo): alternating
  blocks with the shim installed, uninstalled, and a wrapt pass-through wrapper of the same function, the calling
  thread's CPU time per call, each side's minimum and median over the blocks; and the shim's wrapper function
  against a pass-through one, each around a function that does nothing (the decision alone, without the
  collective's own variance).
* ``pageable``: all_reduce of 256 MiB pageable fp32 with registration off, as a storage's first call is staged
  (bounce buffers, the runtime's staged copy), pinned, staging by hand, against the floor and the pageable limit; a
  pageable tensor reused with registration on (``register_bytes`` 1 GiB: registered at its second call) against
  pinned in the same blocks; and how soon ``async_op=True`` returns.
* ``async``: a 256 MiB all_reduce with ``async_op=True``, pinned and pageable: when the call returns and when it
  completes, against the synchronous call and the input's staging time (the synchronous call's: when it issues its
  last chunk's collective; and a synchronous broadcast from this rank alone).
* ``full_tensor``: an FSDP2-offloaded 512 MiB weight (and one with uneven shards): Gloo, staging by hand,
  offload_shim, GPU-resident; peak extra accelerator memory in chunks.
* ``weight_sync``: an RL weight sync of a 4 GiB bf16 FSDP2-offloaded model (every parameter: ``full_tensor()``,
  then ``broadcast`` of the full CPU tensor from rank 0), offload_shim against Gloo and against copying the model's
  bytes once each way.
* ``duplex``: pinned all_reduce against the duplex limit and the floor.
* ``collective``: all_reduce and broadcast by size, pinned and pageable, four routes (the earlier table).
* ``peak_memory``, ``routing``, ``chunk_sweep``: staging memory, the Gloo/NCCL crossover, chunk sizes.

Timings: host clock around calls that are complete on return (a staged result is on the host), after a barrier,
routes alternating round by round, each route's minimum over rounds; every rank reports the slowest rank's figure.
Rank 0 prints a table and writes DIR/bench.json and DIR/bench.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist

import offload_shim
from bench_wrapper_cpu import (  # (benchmarks/, the script's folder, is on sys.path)
    device_and_size, device_of_one, devices_of_two, in_turn, median_difference)
from offload_shim import _config, _execute, _staging, _table, _wrappers

MiB = 1 << 20


class Bench:
    def __init__(self, device: torch.device, quick: bool, smoke: bool, groups: dict):
        self.device = device
        self.quick = quick or smoke
        self.smoke = smoke
        self.rank = dist.get_rank()
        self.groups = groups  # "nccl": serves the accelerator only; "gloo": cpu:gloo plus the accelerator's backend
        self.records = []

    def sync(self) -> None:
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)

    def slowest(self, value: float) -> float:
        """The largest of every rank's ``value``."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.groups["nccl"])
        return t.item()

    def compare(self, routes: dict, rounds: int, calls: int = 1) -> dict:
        """Seconds per call of each route: ``routes`` maps a name to ``(shim_installed, fn)``; each round times
        ``calls`` calls of every route (in alternating order, shim installed as asked, after a barrier), and
        each route's minimum over rounds is kept (the first round is warm-up)."""
        best = {name: float("inf") for name in routes}
        names = list(routes)
        for round_ in range(rounds + 1):
            for name in names if round_ % 2 else names[::-1]:
                installed, fn = routes[name]
                offload_shim.install() if installed else offload_shim.uninstall()
                dist.barrier(group=self.groups["nccl"])
                self.sync()
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                self.sync()
                if round_:
                    best[name] = min(best[name], (time.perf_counter() - start) / calls)
        offload_shim.install()
        return {name: self.slowest(seconds) for name, seconds in best.items()}

    def rounds(self, nbytes: int) -> int:
        if self.quick:
            return 2 if nbytes >= 256 * MiB else 3
        return 3 if nbytes >= 1 << 30 else 5 if nbytes >= 256 * MiB else 9

    def record(self, **fields) -> None:
        self.records.append(fields)
        if self.rank == 0:
            print(json.dumps(fields), flush=True)


def host_tensor(numel: int, dtype: torch.dtype, pinned: bool, fill=1) -> torch.Tensor:
    t = torch.empty(numel, dtype=dtype, pin_memory=pinned)
    t.fill_(fill)  # touched: fresh host memory is slow the first time
    return t


def _streams(bench):
    if bench.device.type == "cpu":
        return None, None
    return torch.Stream(device=bench.device), torch.Stream(device=bench.device)


def _on(stream):
    return stream if stream is not None else _staging.NoStream()  # (a torch.Stream is a context manager)


def copy_routes(bench, nbytes: int) -> dict:
    """The copies that bound a staged call of ``nbytes``, by name: one direction (``h2d``, ``d2h``), both at once
    (``duplex``), the host copies pageable memory adds (``host_copy_in``, ``host_copies``: into and out of pinned
    bounce buffers, on the copy threads), and the DMA of a pipelined all_reduce with those host copies beside it
    (``pageable_limit``)."""
    pinned = bench.device.type != "cpu"
    src = host_tensor(nbytes // 4, torch.float32, pinned)
    back = host_tensor(nbytes // 4, torch.float32, pinned)
    dst, dst2 = torch.empty_like(src, device=bench.device), torch.empty_like(src, device=bench.device)
    pageable_in, pageable_out = host_tensor(nbytes // 4, torch.float32, False), host_tensor(nbytes // 4, torch.float32, False)
    bounce_in, bounce_out = host_tensor(nbytes // 4, torch.float32, pinned), host_tensor(nbytes // 4, torch.float32, pinned)
    h2d, d2h = _streams(bench)

    def only_h2d():
        with _on(h2d):
            dst.copy_(src, non_blocking=True)

    def only_d2h():
        with _on(d2h):
            back.copy_(dst2, non_blocking=True)

    def duplex():
        only_h2d()
        only_d2h()

    def host_copies():
        _staging.host_copies([(bounce_in, pageable_in), (pageable_out, bounce_out)])

    def pageable_limit():
        duplex()
        host_copies()

    def host_copy_in():
        _staging.host_copies([(bounce_in, pageable_in)])

    return {"h2d": only_h2d, "d2h": only_d2h, "duplex": duplex, "host_copy_in": host_copy_in,
            "host_copies": host_copies, "pageable_limit": pageable_limit}


def copy_limits(bench, routes: dict, nbytes: int) -> dict:
    times = bench.compare({name: (False, fn) for name, fn in routes.items()}, 8)
    # Host memory traffic, in bytes read plus bytes written: a DMA reads or writes each byte once; a host copy
    # reads it and writes it.
    result = {"bytes": nbytes, "copy_threads": _staging.copy_threads(),
              "h2d_GBps": nbytes / times["h2d"] / 1e9, "d2h_GBps": nbytes / times["d2h"] / 1e9,
              "host_traffic_duplex_GBps": 2 * nbytes / times["duplex"] / 1e9,
              "host_traffic_copy_GBps": 2 * nbytes / times["host_copy_in"] / 1e9,
              "host_traffic_copies_GBps": 4 * nbytes / times["host_copies"] / 1e9,
              "host_traffic_pageable_limit_GBps": 6 * nbytes / times["pageable_limit"] / 1e9,
              **{f"{k}_seconds": v for k, v in times.items()}}
    bench.record(kind="copy_limits", **result)
    return result


def small_calls(bench) -> None:
    """Per-call latency of small staged all_reduces and broadcasts against Gloo, staging by hand, and GPU-resident
    (each followed by a stream sync, as a staged call's result is on the host); on CUDA also against the bare and
    lean graphs of the same three steps (:func:`bare_graph`)."""
    nccl, gloo = bench.groups["nccl"], bench.groups["gloo"]
    calls = 20 if bench.smoke else 200
    cases = (("all_reduce", "0-dim fp32 SUM", torch.zeros(()), {"op": dist.ReduceOp.SUM}),
             ("all_reduce", "1-element int8 MIN flag", torch.ones(1, dtype=torch.int8), {"op": dist.ReduceOp.MIN}),
             ("broadcast", "0-dim fp32 from rank 0", torch.zeros(()), {"src": 0}),
             ("broadcast", "1-element int8 from rank 0", torch.ones(1, dtype=torch.int8), {"src": 0}))
    for op, name, tensor, kwargs in cases:
        resident = tensor.to(bench.device)

        def call(*args, _name=op, **call_kwargs):  # looked up at each call: the shim binds its wrapper there
            return getattr(dist, _name)(*args, **call_kwargs)

        def hand():
            staged = tensor.to(bench.device)
            call(staged, group=nccl, **kwargs)
            tensor.copy_(staged)

        def gpu_resident():
            call(resident, group=nccl, **kwargs)
            bench.sync()

        routes = {
            "offload_shim": (True, lambda: call(tensor, group=nccl, **kwargs)),
            "hand_staging": (False, hand),
            "gloo": (False, lambda: call(tensor, group=gloo, **kwargs)),
            "gpu_resident": (False, gpu_resident),
        }
        if bench.device.type == "cuda":
            bare, lean = bare_graph(call, tensor, nccl, kwargs, bench.device)
            routes["bare_graph"], routes["lean_graph"] = (False, bare), (False, lean)
        times = bench.compare(routes, rounds=3 if bench.smoke else 15, calls=calls)  # 15 rounds even when quick
        modes = sorted({key.mode for key in offload_shim.staging_counters() if key.op.endswith("." + op)})
        bench.record(kind="small", op=op, case=name, calls_per_round=calls, shim_modes=modes,
                     **{f"{k}_seconds": v for k, v in times.items()})


def bare_graph(call, tensor: torch.Tensor, group, kwargs: dict, device: torch.device):
    """The references of a replayed small call: a CUDA graph of the same three steps (H2D from a pinned buffer, the
    collective, D2H into a pinned buffer), captured here with torch's own function, and two calls of it: ``bare``
    copies the caller's bytes in (``memmove``), replays it, waits for the stream and copies the bytes out; ``lean``
    does the same with the shim's own host copies (``_replay.bytes_at`` views) and wait (polling the stream's
    query), so that what the shim adds beyond it is the Python around the replay."""
    import ctypes

    from offload_shim import _replay

    offload_shim.uninstall()
    host_in = torch.empty(tensor.nbytes, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(tensor.nbytes, dtype=torch.uint8, pin_memory=True)
    slot = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    slot_bytes = slot.view(-1).view(torch.uint8) if slot.dim() else slot.view(1).view(torch.uint8)
    call(slot, group=group, **kwargs)  # the communicator exists before the capture
    torch.cuda.synchronize()
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        slot_bytes.copy_(host_in, non_blocking=True)
        call(slot, group=group, **kwargs)
        host_out.copy_(slot_bytes, non_blocking=True)
        graph.capture_end()
    torch.cuda.synchronize()
    offload_shim.install()
    in_address, out_address, nbytes = host_in.data_ptr(), host_out.data_ptr(), tensor.nbytes

    def bare():
        ctypes.memmove(in_address, tensor.data_ptr(), nbytes)
        graph.replay()
        torch.cuda.current_stream().synchronize()
        ctypes.memmove(tensor.data_ptr(), out_address, nbytes)

    into, out_of = _replay.bytes_at(in_address, nbytes), _replay.bytes_at(out_address, nbytes)
    caller = _replay.bytes_at(tensor.data_ptr(), nbytes)
    replay, query = torch._C._CUDAGraph.replay, torch._C._CudaStreamBase.query
    stream = torch.cuda.current_stream()

    def lean():
        into[:] = caller
        replay(graph)
        while not query(stream):
            pass
        caller[:] = out_of

    return bare, lean


def served_path(bench) -> None:
    """CPU time the wrappers add to calls that need no staging, with the shim installed: the shim's wrapper of each
    function against torch's function itself and a wrapt pass-through wrapper of it (what wrapping alone costs),
    called in turn, one call each, the order rotated every turn; what the shim adds is the median over the turns of
    the difference between its call and the other's in the same turn (the collective's own CPU time varies by
    microseconds from call to call and from block to block, more than the wrapper costs; a turn's calls run back
    to back, so the host's drift cancels). A second pass-through wrapper of its own measured beside the first shows
    what the method itself resolves (two wrappers that do the same differ by the layout of their objects and code).
    Where torch calls one collective from another, the inner call passes through the shim's wrapper on every side
    alike. The floor beside them: a wrapt wrapper that reads what any served decision must read of the call (each
    tensor argument's device, and the size of a host tensor on a group that can route host calls through the
    accelerator) and passes the call on; what the shim adds beyond it is its own. And the shim's wrapper made again
    beside these references, by the same factory: a wrapper's CPU time moves with where its objects and code lie
    (the references, made here, lie near the loop that times them, whose own objects stay in the caches), so this
    one differs from the installed shim by placement alone. Then the wrapper's decision alone: the shim's wrapper
    function and a pass-through one around a function that does nothing."""
    import wrapt

    nccl, gloo = bench.groups["nccl"], bench.groups["gloo"]
    world = dist.get_world_size()
    gpu = torch.ones(world, device=bench.device)
    gathered, scattered = torch.empty(world * world, device=bench.device), torch.empty(1, device=bench.device)
    host = torch.ones(1)
    through = lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs)  # noqa: E731
    through_again = lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs)  # noqa: E731

    cases = {
        "all_reduce, accelerator tensor": ("all_reduce", (gpu,), {"group": nccl}, device_of_one),
        "broadcast, accelerator tensor": ("broadcast", (gpu, 0), {"group": nccl}, device_of_one),
        "all_gather_into_tensor, accelerator tensors": ("all_gather_into_tensor", (gathered, gpu), {"group": nccl},
                                                        devices_of_two),
        "reduce_scatter_tensor, accelerator tensors": ("reduce_scatter_tensor", (scattered, gpu), {"group": nccl},
                                                       devices_of_two),
        "all_reduce, CPU tensor on a group that serves CPU": ("all_reduce", (host,), {"group": gloo}, device_and_size),
    }
    turns = 500 if bench.smoke else 20000
    offload_shim.install()
    for name, (function, args, kwargs, reads) in cases.items():
        shim = getattr(dist, function)  # the shim's FunctionWrapper
        torch_function = shim.__wrapped__
        routes = {"on": shim, "off": torch_function, "wrapt": wrapt.FunctionWrapper(torch_function, through),
                  "wrapt_again": wrapt.FunctionWrapper(torch_function, through_again),  # (the method's own spread)
                  "floor": wrapt.FunctionWrapper(torch_function, reads),
                  "made_here": wrapt.FunctionWrapper(
                      torch_function, _wrappers.c10d_wrapper(_table.C10D[function])(torch_function, [True]))}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch 2.13's deprecation of the *_tensor names
            spent = in_turn(routes, args, kwargs, turns, between=bench.sync)
        bench.sync()
        middle = {route: statistics.median(values) * 1e-9 for route, values in spent.items()}
        paired = {pair: median_difference(spent, *pair)
                  for pair in (("on", "wrapt"), ("on", "off"), ("wrapt", "off"), ("wrapt_again", "wrapt"),
                               ("floor", "wrapt"), ("on", "floor"), ("made_here", "wrapt"),
                               ("made_here", "floor"))}
        # The wrapper's own work, apart from the collective's: the shim's wrapper function and a pass-through one,
        # called around a function that does nothing, with this case's arguments (the group's answers cached by the
        # calls above).
        bodies = {"shim": shim._self_wrapper, "pass_through": through}
        noop = lambda *a, **k: None  # noqa: E731
        alone = {side: [] for side in bodies}
        for round_ in range(41):
            for side in bodies if round_ % 2 else list(bodies)[::-1]:
                body = bodies[side]
                start = time.thread_time()
                for _ in range(2000):
                    body(noop, None, args, kwargs)
                if round_:
                    alone[side].append((time.thread_time() - start) / 2000)
        low = {side: min(values) for side, values in alone.items()}
        bench.record(kind="served", case=name, turns=turns,
                     median_shim_on_cpu_seconds=bench.slowest(middle["on"]),
                     median_shim_off_cpu_seconds=bench.slowest(middle["off"]),
                     median_wrapt_cpu_seconds=bench.slowest(middle["wrapt"]),
                     paired_added_beyond_wrapt_cpu_seconds=bench.slowest(paired["on", "wrapt"]),
                     paired_added_cpu_seconds=bench.slowest(paired["on", "off"]),
                     paired_wrapt_pass_through_added_cpu_seconds=bench.slowest(paired["wrapt", "off"]),
                     paired_second_pass_through_beyond_wrapt_cpu_seconds=bench.slowest(paired["wrapt_again", "wrapt"]),
                     paired_floor_beyond_wrapt_cpu_seconds=bench.slowest(paired["floor", "wrapt"]),
                     paired_added_beyond_floor_cpu_seconds=bench.slowest(paired["on", "floor"]),
                     paired_made_here_beyond_wrapt_cpu_seconds=bench.slowest(paired["made_here", "wrapt"]),
                     paired_made_here_beyond_floor_cpu_seconds=bench.slowest(paired["made_here", "floor"]),
                     decision_beyond_pass_through_cpu_seconds=bench.slowest(low["shim"] - low["pass_through"]),
                     median_decision_beyond_pass_through_cpu_seconds=bench.slowest(
                         statistics.median(alone["shim"]) - statistics.median(alone["pass_through"])))


def pageable(bench, nbytes: int, limits: dict, floor_bandwidth: float, limit) -> None:
    """A pageable all_reduce of ``nbytes`` through each pageable path, against the same call on pinned memory, by
    hand, and the pageable limit (``limit``, :func:`copy_routes`' route) measured in the same blocks (a first figure
    of a round is as noisy as the host)."""
    nccl = bench.groups["nccl"]
    t = host_tensor(nbytes // 4, torch.float32, False)
    pinned = host_tensor(nbytes // 4, torch.float32, bench.device.type != "cpu")

    def with_path(path):
        def run():
            _execute.PAGEABLE_PATH = path
            try:
                dist.all_reduce(t, group=nccl)
            finally:
                _execute.PAGEABLE_PATH = default
        return run

    default = _execute.PAGEABLE_PATH

    def hand():
        staged = t.to(bench.device)
        dist.all_reduce(staged, group=nccl)
        t.copy_(staged)

    # Registration off: every call is staged as a storage's first call is (a storage seen once is not registered).
    previous = offload_shim.configure(register_bytes=0)
    try:
        times = bench.compare({
            "offload_shim_bounce": (True, with_path("bounce")),
            "offload_shim_driver": (True, with_path("driver")),
            "offload_shim_pinned": (True, lambda: dist.all_reduce(pinned, group=nccl)),
            "hand_staging": (False, hand),
            "pageable_limit": (False, limit),
        }, 8)
    finally:
        offload_shim.configure(register_bytes=previous.register_bytes)
    # A pageable tensor staged again and again with registration on (registered at its second call, in the first
    # round, which is warm-up), against pinned memory in the same blocks.
    registered = host_tensor(nbytes // 4, torch.float32, False)
    previous = offload_shim.configure(register_bytes="1GiB")
    try:
        again = bench.compare({
            "offload_shim_registered": (True, lambda: dist.all_reduce(registered, group=nccl)),
            "offload_shim_pinned_beside_registered": (True, lambda: dist.all_reduce(pinned, group=nccl)),
        }, bench.rounds(nbytes))
        registered_pinned = registered.is_pinned() if bench.device.type != "cpu" else None
    finally:
        offload_shim.configure(register_bytes=previous.register_bytes)
    times.update(again)
    returned, done = float("inf"), float("inf")
    for _ in range(bench.rounds(nbytes) + 1):
        dist.barrier(group=nccl)
        bench.sync()
        start = time.perf_counter()
        work = dist.all_reduce(t, group=nccl, async_op=True)
        back = time.perf_counter() - start
        work.wait()
        bench.sync()
        returned, done = min(returned, back), min(done, time.perf_counter() - start)
    floor = nbytes / floor_bandwidth
    bench.record(kind="pageable", op="all_reduce", bytes=nbytes, floor_seconds=floor,
                 pageable_limit_in_copy_limits_seconds=limits["pageable_limit_seconds"], duplex_seconds=limits["duplex_seconds"],
                 async_returned_seconds=bench.slowest(returned), async_done_seconds=bench.slowest(done),
                 registered_is_pinned=registered_pinned, **{f"{k}_seconds": v for k, v in times.items()})


def asynchronous(bench, nbytes: int) -> None:
    """A 256 MiB all_reduce with ``async_op=True``, pinned and pageable: how soon the call returns and how soon its
    ``wait()`` returns when called at once, against the synchronous call, in alternating rounds, each side's minimum.
    The input's staging time is the synchronous call's own: the time at which it issues its last chunk's collective
    (every byte of the input copied, its DMA queued; from the process group's method, timed); beside it, a
    synchronous broadcast of the tensor from this rank on a group of this rank alone (every chunk's H2D, no D2H).
    The same chunks go over the wire, asynchronous or not."""
    nccl = bench.groups["nccl"]
    alone = [dist.new_group([rank]) for rank in range(dist.get_world_size())][bench.rank]  # (every rank makes all)
    original, saved = dist.ProcessGroup.allreduce, vars(dist.ProcessGroup)["allreduce"]  # (restored as it was)
    issued = []

    def timed(group, *args):
        issued.append(time.perf_counter())
        return original(group, *args)

    for pinned in (True, False):
        t = host_tensor(nbytes // 4, torch.float32, pinned and bench.device.type != "cpu")
        best = {name: float("inf") for name in ("sync", "sync_input", "input_staging_broadcast", "async_returned",
                                                 "async_completed")}

        def sync_call():
            issued.clear()
            dist.ProcessGroup.allreduce = timed
            try:
                start = time.perf_counter()
                dist.all_reduce(t, group=nccl)
            finally:
                dist.ProcessGroup.allreduce = saved
            return {"sync_input": issued[-1] - start}

        def broadcast_call():
            dist.broadcast(t, group_src=0, group=alone)
            return {}

        def async_call():
            start = time.perf_counter()
            work = dist.all_reduce(t, group=nccl, async_op=True)
            returned = time.perf_counter() - start
            work.wait()
            return {"async_returned": returned}

        steps = [("sync", sync_call), ("input_staging_broadcast", broadcast_call), ("async_completed", async_call)]
        rounds = max(bench.rounds(nbytes), 5)
        for round_ in range(rounds + 1):
            for name, fn in steps if round_ % 2 else steps[::-1]:
                dist.barrier(group=nccl)
                bench.sync()
                start = time.perf_counter()
                parts = fn()
                bench.sync()
                if round_:
                    parts[name] = time.perf_counter() - start
                    for key, value in parts.items():
                        best[key] = min(best[key], value)
        times = {name: bench.slowest(value) for name, value in best.items()}
        bench.record(kind="async", op="all_reduce", bytes=nbytes, pinned=pinned, rounds=rounds,
                     **{f"{k}_seconds": v for k, v in times.items()},
                     completed_over_sync=times["async_completed"] / times["sync"],
                     returned_over_sync_input=times["async_returned"] / times["sync_input"])


def _offload_policy(mesh):
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")  # no pinned memory without an accelerator


def _offloaded_linear(mesh, rows: int, cols: int, dtype=torch.float32, offload=True):
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.utils.skip_init(torch.nn.Linear, cols, rows, bias=False, dtype=dtype)
    with torch.no_grad():
        model.weight.fill_(0.5)
    if offload:
        fully_shard(model, mesh=mesh, offload_policy=_offload_policy(mesh))
    else:
        model.to(mesh.device_type)
        fully_shard(model, mesh=mesh)
    return model


def peak_extra_memory(bench, fn) -> int:
    if bench.device.type == "cpu":
        fn()
        return 0
    offload_shim.release_buffers()
    bench.sync()
    torch.cuda.reset_peak_memory_stats(bench.device)
    before = torch.cuda.memory_allocated(bench.device)
    fn()
    bench.sync()
    return torch.cuda.max_memory_allocated(bench.device) - before


def full_tensor(bench, floor_bandwidth: float) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    kind = bench.device.type
    rows, cols = (64, 32) if bench.smoke else (8192, 16384)  # 512 MiB fp32
    for label, n in (("even", rows), ("uneven", rows - 1)):
        meshes = {name: DeviceMesh.from_group(bench.groups[name], kind, mesh_dim_names=(f"{name}_{label}",))
                  for name in ("nccl", "gloo")}
        weights = {name: _offloaded_linear(mesh, n, cols).weight for name, mesh in meshes.items()}
        nbytes = n * cols * 4

        def hand():
            w = weights["nccl"]
            staged = DTensor.from_local(w.to_local().to(bench.device), w.device_mesh, w.placements, run_check=False,
                                        shape=w.shape, stride=w.stride())
            staged.full_tensor().cpu()

        routes = {
            "offload_shim": (True, lambda: weights["nccl"].full_tensor()),
            "offload_shim_routed_off_gloo": (True, lambda: weights["gloo"].full_tensor()),
            "hand_staging": (False, hand),
        }
        if label == "even":
            routes["gloo"] = (False, lambda: weights["gloo"].full_tensor())
            if kind != "cpu":
                resident = _offloaded_linear(DeviceMesh.from_group(bench.groups["nccl"], kind, mesh_dim_names=("gpu",)),
                                             n, cols, offload=False).weight
                routes["gpu_resident"] = (False, lambda: resident.full_tensor())
        times = bench.compare(routes, bench.rounds(nbytes))
        peak = peak_extra_memory(bench, lambda: weights["nccl"].full_tensor())
        bench.record(kind="full_tensor", shards=label, shape=[n, cols], bytes=nbytes, floor_seconds=nbytes / floor_bandwidth,
                     chunk_bytes=_config.settings().chunk_bytes, peak_extra_bytes_offload_shim=peak,
                     peak_extra_chunks=peak / _config.settings().chunk_bytes,
                     **{f"{k}_seconds": v for k, v in times.items()})


def weight_sync(bench, limits: dict) -> None:
    """Every parameter of an FSDP2-offloaded bf16 model: full_tensor(), then broadcast of it from rank 0."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    layers, rows, cols = (2, 32, 16) if bench.smoke else (16, 8192, 16384)  # 16 x 256 MiB bf16 = 4 GiB
    models = {}
    for name in ("nccl", "gloo"):
        mesh = DeviceMesh.from_group(bench.groups[name], bench.device.type, mesh_dim_names=(f"sync_{name}",))
        model = torch.nn.Sequential(*(torch.nn.utils.skip_init(torch.nn.Linear, cols, rows, bias=False,
                                                               dtype=torch.bfloat16) for _ in range(layers)))
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.fill_(i + 1)
        for layer in model:
            fully_shard(layer, mesh=mesh, offload_policy=_offload_policy(mesh))
        fully_shard(model, mesh=mesh, offload_policy=_offload_policy(mesh))
        models[name] = model
    nbytes = layers * rows * cols * 2
    received = []

    def sync(name):
        group = bench.groups[name]
        received.clear()
        with torch.no_grad():
            for p in models[name].parameters():
                full = p.full_tensor()
                dist.broadcast(full, src=0, group=group)
                received.append(full[0, 0].item())

    times = bench.compare({"offload_shim": (True, lambda: sync("nccl")), "gloo": (False, lambda: sync("gloo"))},
                          3 if not bench.smoke else 2)
    assert received == [float(i + 1) for i in range(layers)], received
    once_each_way = nbytes / limits["h2d_GBps"] / 1e9 + nbytes / limits["d2h_GBps"] / 1e9
    bench.record(kind="weight_sync", bytes=nbytes, parameters=layers, copy_once_each_way_seconds=once_each_way,
                 **{f"{k}_seconds": v for k, v in times.items()})


def collective_routes(bench, op: str, nbytes: int, pinned: bool) -> dict:
    nccl, gloo = bench.groups["nccl"], bench.groups["gloo"]
    t = host_tensor(nbytes // 4, torch.float32, pinned and bench.device.type != "cpu")
    if op == "all_reduce":
        call = lambda x, g: dist.all_reduce(x, group=g)  # noqa: E731
    else:
        call = lambda x, g: dist.broadcast(x, src=0, group=g)  # noqa: E731
    gpu = torch.ones(nbytes // 4, device=bench.device)

    def hand():
        staged = t.to(bench.device, non_blocking=pinned)
        call(staged, nccl)
        t.copy_(staged, non_blocking=pinned)
        bench.sync()

    return bench.compare({
        "gloo": (False, lambda: call(t, gloo)),
        "hand_staging": (False, hand),
        "gpu_resident": (False, lambda: call(gpu, nccl)),
        "offload_shim": (True, lambda: call(t, nccl)),
    }, bench.rounds(nbytes))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and rounds")
    parser.add_argument("--smoke", action="store_true", help="CPU only (Gloo, staging through the CPU), tiny sizes")
    parser.add_argument("--only", help="comma-separated sections to run (default: all)")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    if args.smoke:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        nccl_group = dist.group.WORLD
        gloo_group = dist.new_group(backend="gloo")
        offload_shim.configure(staging_device="cpu", always_stage=True)
    else:
        device = torch.device(torch.accelerator.current_accelerator().type, local_rank)
        torch.accelerator.set_device_index(local_rank)
        dist.init_process_group("nccl", device_id=device)
        nccl_group = dist.group.WORLD
        gloo_group = dist.new_group(backend=f"cpu:gloo,{device.type}:nccl")
    bench = Bench(device, args.quick, args.smoke, {"nccl": nccl_group, "gloo": gloo_group})
    sections = set(args.only.split(",")) if args.only else None
    wanted = lambda name: sections is None or name in sections  # noqa: E731
    chunk_default = _config.settings().chunk_bytes
    offload_shim.install()
    if not args.smoke:
        offload_shim.configure(route_min_bytes=None)  # routing is measured on its own below
    meta = {
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke run)",
        "world_size": dist.get_world_size(),
        "chunk_bytes_default": chunk_default,
        "pageable_path_default": _execute.PAGEABLE_PATH,
        "copy_threads": _staging.copy_threads(),
        "commit": os.environ.get("BENCH_COMMIT"),
    }
    big = 4 * MiB if args.smoke else 256 * MiB
    routes = copy_routes(bench, big)  # made once: the pageable section times its limit beside it
    limits = copy_limits(bench, routes, big)
    floor_bandwidth = limits["h2d_GBps"] * 1e9

    if wanted("small"):
        small_calls(bench)
    if wanted("served"):
        served_path(bench)
    if wanted("pageable"):
        pageable(bench, big, limits, floor_bandwidth, routes["pageable_limit"])
    if wanted("async"):
        asynchronous(bench, big)
    if wanted("full_tensor"):
        offload_shim.configure(route_min_bytes=_config.DEFAULT_ROUTE_MIN_BYTES)
        full_tensor(bench, floor_bandwidth)
        offload_shim.configure(route_min_bytes=None)
    if wanted("weight_sync"):
        weight_sync(bench, limits)
    if wanted("duplex"):
        for nbytes in (big,) if bench.quick else (big, 4 * big):
            t = host_tensor(nbytes // 4, torch.float32, not args.smoke)
            seconds = bench.compare({"offload_shim": (True, lambda: dist.all_reduce(t))}, bench.rounds(nbytes))["offload_shim"]
            bench.record(kind="duplex", op="all_reduce", bytes=nbytes, offload_shim_seconds=seconds,
                         duplex_seconds=limits["duplex_seconds"] * nbytes / big, floor_seconds=nbytes / floor_bandwidth)
    if wanted("collective"):
        sizes = [4 << 10, 1 * MiB, 16 * MiB, 256 * MiB, 1024 * MiB]
        if bench.quick:
            sizes = [4 << 10, big]
        for op in ("all_reduce", "broadcast"):
            for pinned in (True, False):
                for nbytes in sizes:
                    results = collective_routes(bench, op, nbytes, pinned)
                    bench.record(kind="collective", op=op, dtype="float32", pinned=pinned, bytes=nbytes,
                                 floor_seconds=nbytes / floor_bandwidth, **{f"{k}_seconds": v for k, v in results.items()})
    if wanted("peak_memory"):
        for multiple in (4, 32):
            t = host_tensor(multiple * chunk_default // 4, torch.float32, not args.smoke)
            peak = peak_extra_memory(bench, lambda: dist.all_reduce(t))
            bench.record(kind="peak_memory", op="all_reduce", bytes=t.numel() * 4, chunk_bytes=chunk_default,
                         peak_extra_bytes=peak, peak_extra_chunks=peak / chunk_default)
    if wanted("routing") and not args.smoke:
        gloo = bench.groups["gloo"]
        for nbytes in (4 << 10, 64 << 10, 256 << 10, 1 * MiB, 4 * MiB):
            t = host_tensor(nbytes // 4, torch.float32, False)

            def routed(value):
                def run():
                    offload_shim.configure(route_min_bytes=value)
                    dist.all_reduce(t, group=gloo)
                return run

            times = bench.compare({"gloo": (True, routed(None)), "routed": (True, routed(0))}, bench.rounds(nbytes))
            offload_shim.configure(route_min_bytes=None)
            bench.record(kind="routing", op="all_reduce", bytes=nbytes, pinned=False,
                         **{f"{k}_seconds": v for k, v in times.items()})
    if wanted("chunk_sweep") and not bench.quick:
        for chunk in (8 * MiB, 16 * MiB, 32 * MiB):
            offload_shim.configure(chunk_bytes=chunk)
            tensors = {"pinned": host_tensor(big // 4, torch.float32, True), "pageable": host_tensor(big // 4, torch.float32, False)}
            times = bench.compare({k: (True, lambda t=t: dist.all_reduce(t)) for k, t in tensors.items()}, bench.rounds(big))
            bench.record(kind="chunk_sweep", op="all_reduce", bytes=big, chunk_bytes=chunk,
                         **{f"{k}_over_floor": v / (big / floor_bandwidth) for k, v in times.items()})
        offload_shim.configure(chunk_bytes=chunk_default)

    if bench.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump({"meta": meta, "records": bench.records}, f, indent=1)
        import sys

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from report import plot, table

        print(table(meta, bench.records))
        try:
            plot(bench.records, os.path.join(args.out, "bench.png"))
        except ImportError as exc:  # no matplotlib: the table and JSON are the result
            print(f"no plot: {exc}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
