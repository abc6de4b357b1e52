"""Probe, on one accelerator, the ways to stage pageable memory and small calls faster (one rank, NCCL-only group):
what a host registration of pageable memory costs and gives, how fast host copies run by thread count and piece
size (alone and beside both DMA directions), where a pageable pipelined all_reduce spends its time, and whether a
CUDA graph that captured a small staged all_reduce replays faster than the shim's small-call path.

    torchrun --nproc_per_node 1 benchmarks/probe_host_memory.py --out DIR

Every figure is each variant's minimum over rounds, variants alternating; JSON in DIR/probe.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import json
import os
import time

import torch
import torch.distributed as dist

import offload_shim
from offload_shim import _execute, _staging

MiB = 1 << 20


def best(variants: dict, rounds: int, calls: int = 1, sync=True) -> dict:
    low = {name: float("inf") for name in variants}
    names = list(variants)
    for r in range(rounds + 1):
        for name in names if r % 2 else names[::-1]:
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                variants[name]()
            if sync:
                torch.cuda.synchronize()
            if r:
                low[name] = min(low[name], (time.perf_counter() - start) / calls)
    return low


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only")
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    offload_shim.install()
    results = {}
    wanted = set(args.only.split(",")) if args.only else None

    def say(key, value):
        results[key] = value
        print(key, json.dumps(value), flush=True)

    cudart = torch.cuda.cudart()
    nbytes = 256 * MiB

    if wanted is None or "register" in wanted:
        for size in (1 * MiB, 16 * MiB, 256 * MiB):
            t = torch.ones(size // 4)
            register, unregister = float("inf"), float("inf")
            for _ in range(3):
                start = time.perf_counter()
                rc = int(cudart.cudaHostRegister(t.data_ptr(), size, 0))
                mid = time.perf_counter()
                pinned = t.is_pinned()
                rc2 = int(cudart.cudaHostUnregister(t.data_ptr()))
                end = time.perf_counter()
                register, unregister = min(register, mid - start), min(unregister, end - mid)
            say(f"register {size >> 20} MiB", {"register_s": register, "unregister_s": unregister, "rc": rc, "rc_unregister": rc2,
                                              "is_pinned_while_registered": pinned, "register_GBps": size / register / 1e9})
        # A registered tensor through the pinned path, against pinned memory and the pageable path.
        t = torch.ones(nbytes // 4)
        pinned = torch.ones(nbytes // 4, pin_memory=True)
        plain = torch.ones(nbytes // 4)
        rc = int(cudart.cudaHostRegister(t.data_ptr(), nbytes, 0))
        times = best({"registered": lambda: dist.all_reduce(t), "pinned": lambda: dist.all_reduce(pinned),
                      "pageable": lambda: dist.all_reduce(plain)}, 4)
        say("all_reduce 256 MiB by memory", {"rc": rc, "is_pinned": t.is_pinned(), **times})
        cudart.cudaHostUnregister(t.data_ptr())
        # Registration of a fresh (untouched and touched) allocation, as a first call would
        fresh = {}
        for touched in (False, True):
            u = torch.empty(nbytes // 4)
            if touched:
                u.fill_(1)
            start = time.perf_counter()
            cudart.cudaHostRegister(u.data_ptr(), nbytes, 0)
            fresh[f"touched={touched}"] = time.perf_counter() - start
            cudart.cudaHostUnregister(u.data_ptr())
        say("register 256 MiB fresh", fresh)

    if wanted is None or "copies" in wanted:
        src = torch.ones(nbytes // 4)
        dst = torch.empty(nbytes // 4, pin_memory=True)
        gpu_a, gpu_b = torch.empty(nbytes // 4, device=device), torch.empty(nbytes // 4, device=device)
        pin_a, pin_b = torch.ones(nbytes // 4, pin_memory=True), torch.empty(nbytes // 4, pin_memory=True)
        h2d, d2h = torch.cuda.Stream(), torch.cuda.Stream()
        pools = {n: concurrent.futures.ThreadPoolExecutor(n) for n in (2, 4, 8, 16)}

        def threaded(threads, piece):
            step = piece // 4
            pieces = [(dst[i : i + step], src[i : i + step]) for i in range(0, src.numel(), step)]

            def run():
                if threads == 1:
                    for d, s in pieces:
                        d.copy_(s)
                    return
                list(pools[threads].map(lambda p: p[0].copy_(p[1]), pieces))
            return run

        def dma():
            with torch.cuda.stream(h2d):
                gpu_a.copy_(pin_a, non_blocking=True)
            with torch.cuda.stream(d2h):
                pin_b.copy_(gpu_b, non_blocking=True)

        variants = {f"{n} threads, {p >> 20} MiB pieces": threaded(n, p) for n in (1, 4, 8, 16) for p in (1 * MiB, 4 * MiB, 16 * MiB)}
        times = best(variants, 3)
        say("host copy 256 MiB pageable->pinned GB/s", {k: nbytes / v / 1e9 for k, v in times.items()})
        beside = {k: (lambda f=f: (dma(), f())) for k, f in variants.items() if "16 threads" in k or "8 threads" in k}
        times = best({"dma only": dma, **beside}, 3)
        say("host copy 256 MiB beside duplex DMA, seconds", times)

    if wanted is None or "pipeline" in wanted:
        t = torch.ones(nbytes // 4)
        spent = {"host_copies": 0.0, "copy_out_wait": 0.0}
        original_copies, original_out = _staging.host_copies, _execute._copy_after

        def timed_copies(pairs):
            start = time.perf_counter()
            original_copies(pairs)
            spent["host_copies"] += time.perf_counter() - start

        def timed_out(event, pairs):
            start = time.perf_counter()
            if event is not None:
                event.synchronize()
            spent["copy_out_wait"] += time.perf_counter() - start
            original_out(None, pairs)

        for chunk in (4 * MiB, 16 * MiB, 64 * MiB):
            for piece in (1 * MiB, 4 * MiB):
                offload_shim.configure(chunk_bytes=chunk)
                _staging.MIN_THREADED_COPY_BYTES = piece
                _staging.host_copies, _execute._copy_after = timed_copies, timed_out
                total = float("inf")
                for r in range(4):
                    spent.update(host_copies=0.0, copy_out_wait=0.0)
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    dist.all_reduce(t)
                    elapsed = time.perf_counter() - start
                    if r and elapsed < total:
                        total, parts = elapsed, dict(spent)
                _staging.host_copies, _execute._copy_after = original_copies, original_out
                say(f"pageable all_reduce 256 MiB, chunk {chunk >> 20} MiB, pieces {piece >> 20} MiB", {"total": total, **parts})
        _staging.MIN_THREADED_COPY_BYTES = 4 * MiB
        offload_shim.configure(chunk_bytes=16 * MiB)

    if wanted is None or "small" in wanted:
        group = dist.group.WORLD
        for label, dtype, op in (("0-dim fp32 SUM", torch.float32, dist.ReduceOp.SUM), ("1-element int8 MIN", torch.int8, dist.ReduceOp.MIN)):
            shape = () if dtype is torch.float32 else (1,)
            caller = torch.ones(shape, dtype=dtype)
            host_in = torch.empty(shape, dtype=dtype, pin_memory=True)
            host_out = torch.empty(shape, dtype=dtype, pin_memory=True)
            slot = torch.empty(shape, dtype=dtype, device=device)
            stream = torch.cuda.Stream()
            graph = torch.cuda.CUDAGraph()
            dist.all_reduce(slot, op=op)  # the communicator exists before the capture
            torch.cuda.synchronize()
            offload_shim.uninstall()
            error = None
            try:
                with torch.cuda.stream(stream):
                    graph.capture_begin(capture_error_mode="thread_local")
                    try:
                        slot.copy_(host_in, non_blocking=True)
                        dist.all_reduce(slot, op=op, group=group)
                        host_out.copy_(slot, non_blocking=True)
                    finally:
                        graph.capture_end()
            except Exception as exc:  # noqa: BLE001
                error = repr(exc)
            offload_shim.install()
            nb = caller.nbytes

            def replay():
                ctypes.memmove(host_in.data_ptr(), caller.data_ptr(), nb)
                graph.replay()
                torch.cuda.current_stream().synchronize()
                ctypes.memmove(caller.data_ptr(), host_out.data_ptr(), nb)

            def replay_torch_copies():
                host_in.copy_(caller)
                graph.replay()
                torch.cuda.current_stream().synchronize()
                caller.copy_(host_out)

            bare_all_reduce = dist.all_reduce.__wrapped__  # torch's own function, under the shim's wrapper

            def hand():
                staged = caller.to(device)
                bare_all_reduce(staged, op=op)
                caller.copy_(staged)

            resident = caller.to(device)

            def gpu_resident():
                bare_all_reduce(resident, op=op)
                torch.cuda.current_stream().synchronize()

            variants = {"shim": lambda: dist.all_reduce(caller, op=op), "hand": hand, "gpu_resident+sync": gpu_resident}
            if error is None:
                variants.update({"graph replay, memmove": replay, "graph replay, torch copies": replay_torch_copies})
            caller.fill_(1)
            times = best(variants, 7, calls=200, sync=False)
            check = None
            if error is None:
                caller.fill_(3)
                replay()
                check = caller.item()
            say(f"small {label}", {"capture_error": error, "replay_result_of_3": check, **{k: v * 1e6 for k, v in times.items()}})

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe.json"), "w") as f:
        json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(device), "results": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
