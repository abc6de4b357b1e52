"""Probe, on one accelerator, how a replayed small call can wait for its graph (one rank, NCCL-only group): a bare
graph of H2D, all_reduce, D2H waited for by the stream's synchronize(), by polling torch's stream query (the
replay's way today, which gives up at the group's timeout), by polling cudaStreamQuery through ctypes; and a graph
that also writes a sequence number into pinned memory after its D2H, waited for by reading that memory.

    torchrun --nproc_per_node 1 benchmarks/probe_replay_wait.py --out DIR

Each variant's minimum per call over 15 alternating rounds of 200 calls, in microseconds; DIR/replay_wait.json.
"""

from __future__ import annotations

import ctypes
import json
import os
import time

import torch
import torch.distributed as dist

from probe_small_calls import one_rank  # (benchmarks/, the script's folder, is on sys.path)


def main() -> None:
    args, device = one_rank()
    caller = torch.ones(())
    nbytes = caller.nbytes
    slot = torch.zeros((), device=device)
    dist.all_reduce(slot)
    torch.cuda.synchronize()
    host_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    flag = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    sequence = torch.zeros(1, dtype=torch.int64, device=device)
    slot_bytes = slot.view(1).view(torch.uint8)
    graphs = {}
    for name, flagged in (("plain", False), ("flagged", True)):
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            slot_bytes.copy_(host_in, non_blocking=True)
            dist.all_reduce(slot)
            host_out.copy_(slot_bytes, non_blocking=True)
            if flagged:
                sequence.add_(1)
                flag.copy_(sequence, non_blocking=True)
            graph.capture_end()
        graphs[name] = graph
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    query = torch._C._CudaStreamBase.query
    path = next(line.split()[-1] for line in open("/proc/self/maps") if "libcudart.so" in line)
    cudart = ctypes.CDLL(path)
    cudart.cudaStreamQuery.argtypes = [ctypes.c_void_p]
    raw = torch._C._cuda_getCurrentRawStream(0)
    in_address, out_address, flag_address = host_in.data_ptr(), host_out.data_ptr(), flag.data_ptr()
    value = ctypes.c_int64.from_address(flag_address)
    expected = [0]

    def variant(graph, wait):
        def call():
            address = caller.data_ptr()
            ctypes.memmove(in_address, address, nbytes)
            graph.replay()
            wait()
            ctypes.memmove(address, out_address, nbytes)
        return call

    def synchronize():
        stream.synchronize()

    def torch_query():
        start = time.monotonic()
        while not query(stream):
            if time.monotonic() - start > 60:
                raise RuntimeError("timeout")

    def ctypes_query():
        start = time.monotonic()
        while cudart.cudaStreamQuery(raw) != 0:
            if time.monotonic() - start > 60:
                raise RuntimeError("timeout")

    def flag_spin():
        expected[0] += 1
        start, polls = time.monotonic(), 0
        while value.value != expected[0]:
            polls += 1
            if polls & 1023 == 0 and time.monotonic() - start > 60:
                raise RuntimeError("timeout")

    variants = {
        "plain, synchronize()": variant(graphs["plain"], synchronize),
        "plain, torch query polled": variant(graphs["plain"], torch_query),
        "plain, cudaStreamQuery polled": variant(graphs["plain"], ctypes_query),
        "flagged, synchronize()": variant(graphs["flagged"], lambda: (expected.__setitem__(0, expected[0] + 1),
                                                                      stream.synchronize())),
        "flagged, flag read": variant(graphs["flagged"], flag_spin),
    }
    best = {name: float("inf") for name in variants}
    names = list(variants)
    for round_ in range(16):
        for name in names if round_ % 2 else names[::-1]:
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(200):
                variants[name]()
            torch.cuda.synchronize()
            if round_:
                best[name] = min(best[name], (time.perf_counter() - start) / 200 * 1e6)
    # The flag agrees with the data: a value written before the replay reads back summed (one rank: unchanged).
    checks = []
    for i in range(100):
        caller.fill_(float(i))
        variants["flagged, flag read"]()
        checks.append(caller.item() == float(i))
    costs = {}
    for name, fn in (("torch query (idle)", lambda: query(stream)), ("cudaStreamQuery (idle)", lambda: cudart.cudaStreamQuery(raw)),
                     ("flag read", lambda: value.value)):
        start = time.thread_time()
        for _ in range(20000):
            fn()
        costs[name] = (time.thread_time() - start) / 20000 * 1e6
    results = {"torch": torch.__version__, "latency_us": best, "cpu_us": costs, "flag_checks_ok": all(checks)}
    print(json.dumps(results, indent=1))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "replay_wait.json"), "w") as f:
        json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
