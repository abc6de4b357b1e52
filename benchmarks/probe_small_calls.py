"""Probe, on one accelerator, where a small staged call replayed from a CUDA graph spends its time (one rank,
NCCL-only group): the whole call through the shim against its parts, and the CPU cost of each Python step.

    torchrun --nproc_per_node 1 benchmarks/probe_small_calls.py --out DIR

Latencies are each variant's minimum per call over alternating rounds; CPU costs are thread CPU time per step
over many repetitions; a cProfile of the shim's calls lists the functions it spends its time in. JSON in
DIR/small_probe.json, the profile in DIR/small_profile.txt.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import io
import json
import os
import pstats
import time

import torch
import torch.distributed as dist

import offload_shim
from offload_shim import _counters, _replay
from probe_host_memory import best  # (benchmarks/, the script's folder, is on sys.path)


def latencies(variants: dict) -> dict:
    """Microseconds per call of each variant: its minimum over 15 alternating rounds of 200 calls."""
    return {name: seconds * 1e6 for name, seconds in best(variants, 15, calls=200, sync=False).items()}


def cpu_cost(fn, repeats: int = 20000, rounds: int = 5) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(repeats):
            fn()
        best = min(best, (time.thread_time() - start) / repeats)
    return best * 1e6  # microseconds


def device_view(host: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over pinned ``host`` memory (uint8, 1-D): pinned memory has one address for host and device."""

    class Interface:
        __cuda_array_interface__ = {"shape": (host.numel(),), "typestr": "|u1", "data": (host.data_ptr(), False),
                                    "version": 3}

    return torch.as_tensor(Interface(), device="cuda")


def graph_launcher():
    """``launch(graph)``: cudaGraphLaunch of the graph's executable on the current stream, through the CUDA runtime
    this process loaded (``None`` where it cannot be found)."""
    try:
        path = next(line.split()[-1] for line in open("/proc/self/maps") if "libcudart.so" in line)
        cudart = ctypes.CDLL(path)
    except (StopIteration, OSError):
        return None
    cudart.cudaGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    raw_stream = torch._C._cuda_getCurrentRawStream
    executables = {}

    def launch(graph):
        executable = executables.get(id(graph))
        if executable is None:
            executable = executables[id(graph)] = graph.raw_cuda_graph_exec()
        if cudart.cudaGraphLaunch(executable, raw_stream(0)):
            raise RuntimeError("cudaGraphLaunch failed")
    return launch


def one_rank():
    """``(args, device)``: the probe's arguments (``--out``), and cuda:0, the one rank of a NCCL-only default
    group made here."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return args, device


def _count(counts: list) -> None:  # what replayed() does with its capture's tally
    counts[0] += 1
    counts[1] += time.perf_counter() - 0.0


def main() -> None:
    args, device = one_rank()
    group = dist.group.WORLD
    offload_shim.install()
    results = {}

    def say(key, value):
        results[key] = value
        print(key, json.dumps(value), flush=True)

    torch_all_reduce = dist.all_reduce.__wrapped__  # torch's own function, under the shim's wrapper
    op = dist.ReduceOp.SUM
    caller = torch.ones(())
    resident = caller.to(device)
    torch_all_reduce(resident, op=op)  # the communicator exists before any capture
    torch.cuda.synchronize()

    # The bare replay: a graph of the same three steps, captured here; and one whose copies are kernels that read
    # and write the pinned buffers where they are (a CUDA view of pinned memory: one address space).
    host_in = torch.empty(4, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(4, dtype=torch.uint8, pin_memory=True)
    slot = torch.empty((), device=device)
    in_view, out_view = device_view(host_in), device_view(host_out)
    slot_bytes = slot.view(1).view(torch.uint8)
    graphs = {}
    for name, copy_in, copy_out in (
        ("memcpy", lambda: slot_bytes.copy_(host_in, non_blocking=True),
         lambda: host_out.copy_(slot_bytes, non_blocking=True)),
        ("kernels", lambda: torch.bitwise_or(in_view, 0, out=slot_bytes),
         lambda: torch.bitwise_or(slot_bytes, 0, out=out_view)),
    ):
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            copy_in()
            torch_all_reduce(slot, op=op)
            copy_out()
            graph.capture_end()
        graphs[name] = graph
    torch.cuda.synchronize()
    nb = 4
    in_address, out_address = host_in.data_ptr(), host_out.data_ptr()
    launch = graph_launcher()

    def bare(graph):
        def call():
            ctypes.memmove(host_in.data_ptr(), caller.data_ptr(), nb)
            graph.replay()
            torch.cuda.current_stream().synchronize()
            ctypes.memmove(caller.data_ptr(), host_out.data_ptr(), nb)
        return call

    def lean(graph, replay):
        def call():
            address = caller.data_ptr()
            ctypes.memmove(in_address, address, nb)
            replay(graph)
            stream = _replay._current_stream(0)
            while not query(stream):
                pass
            ctypes.memmove(address, out_address, nb)
        return call

    into, out_of = _replay.bytes_at(in_address, nb), _replay.bytes_at(out_address, nb)
    caller_bytes = _replay.bytes_at(caller.data_ptr(), nb)

    def viewed(graph, replay, wait):  # the host copies as the shim makes them (_replay.bytes_at views)
        def call():
            into[:] = caller_bytes
            replay(graph)
            wait()
            caller_bytes[:] = out_of
        return call

    def polled():
        stream = _replay._current_stream(0)
        while not query(stream):
            pass

    query = torch._C._CudaStreamBase.query
    direct = torch._C._CUDAGraph.replay

    def hand():
        staged = caller.to(device)
        torch_all_reduce(staged, op=op)
        caller.copy_(staged)

    def gpu_resident():
        torch_all_reduce(resident, op=op)
        torch.cuda.current_stream().synchronize()

    def shim():
        dist.all_reduce(caller, op=op)

    for _ in range(3):  # captured by now
        shim()
    say("captures", _replay.captures())
    for graph in graphs.values():  # both graphs give the sum
        caller.fill_(3.0)
        lean(graph, direct)()
        assert caller.item() == 3.0, caller
    variants = {"hand": hand, "gpu_resident+sync": gpu_resident, "bare replay": bare(graphs["memcpy"]),
                "bare replay, kernel copies": bare(graphs["kernels"]), "lean replay": lean(graphs["memcpy"], direct),
                "lean replay, kernel copies": lean(graphs["kernels"], direct), "shim": shim,
                "bare replay, view copies": viewed(graphs["memcpy"], torch.cuda.CUDAGraph.replay,
                                                   lambda: torch.cuda.current_stream().synchronize()),
                "lean replay, view copies": viewed(graphs["memcpy"], direct, polled)}
    if launch is not None:
        variants["lean replay, cudaGraphLaunch"] = lean(graphs["memcpy"], launch)
        variants["lean replay, kernel copies, cudaGraphLaunch"] = lean(graphs["kernels"], launch)
    say("latency_us", latencies(variants))

    # CPU time of each Python step of the replayed call.
    stream = torch.cuda.current_stream(device)
    key = (0, group, torch.Tensor, caller.dtype, caller.shape, _replay.call_key(torch_all_reduce, (caller,), {"op": op}))
    table = {key: 1}
    graph = graphs["memcpy"]
    counts = [0, 0.0]
    steps = {
        "torch.cuda.current_stream(device)": lambda: torch.cuda.current_stream(device),
        "_replay._current_stream(0)": lambda: _replay._current_stream(0),
        "torch.cuda.current_device()": torch.cuda.current_device,
        "torch._C._cuda_getDevice()": torch._C._cuda_getDevice,
        "torch.cuda.is_current_stream_capturing()": torch.cuda.is_current_stream_capturing,
        "stream.query() (idle)": stream.query,
        "_CudaStreamBase.query(stream) (idle)": lambda: query(stream),
        "memmove 4 bytes with data_ptr()": lambda: ctypes.memmove(in_address, caller.data_ptr(), nb),
        "view copy 4 bytes (into[:] = caller)": lambda: into.__setitem__(slice(None), caller_bytes),
        "bytes_at(caller.data_ptr(), 4)": lambda: _replay.bytes_at(caller.data_ptr(), nb),
        "key tuple and dict lookup": lambda: table.get(
            (0, group, type(caller), caller.dtype, caller.shape, _replay.call_key(torch_all_reduce, (caller,), {"op": op}))),
        "a replay's count (_counters.tally)": lambda: _count(counts),
    }
    costs = {name: cpu_cost(fn) for name, fn in steps.items()}
    for name, replay in (("graph.replay()", lambda: graph.replay()), ("_CUDAGraph.replay(graph)", lambda: direct(graph)),
                         ("cudaGraphLaunch by ctypes", lambda: launch(graph) if launch else None)):
        costs[name + " (launch only)"] = cpu_cost(replay, repeats=2000)
        torch.cuda.synchronize()
    # The shim's call with the replay itself replaced by a no-op: the wrapper, fast path and count.
    original_replay = _replay.replay
    _replay.replay = lambda capture, tensor, address=None: None
    try:
        costs["shim call, replay stubbed (wrapper, lookup, checks, count)"] = cpu_cost(shim)
    finally:
        _replay.replay = original_replay
    say("cpu_us", costs)

    # Where the shim's call spends its time.
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(5000):
        shim()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    print(text.getvalue())
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "small_profile.txt"), "w") as f:
        f.write(text.getvalue())
    with open(os.path.join(args.out, "small_probe.json"), "w") as f:
        json.dump({"torch": torch.__version__, **results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
