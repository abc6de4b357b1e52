"""Staging benchmark, on two accelerators of one host: one process run, so that ratios hold.

    torchrun --nproc_per_node 2 benchmarks/bench_staging.py --out DIR [--quick]

For all_reduce and broadcast of CPU tensors from 4 KiB to 1 GiB (pinned and pageable, fp32 and bf16) it times
four routes: Gloo (a ``cpu:gloo,cuda:nccl`` group, no shim), naive staging (H2D, collective, D2H one after the
other, fresh buffers each call), offload_shim (NCCL-only group), and the same collective on a GPU-resident tensor
(NCCL); and full_tensor of an FSDP2-offloaded 512 MiB weight by Gloo, naive staging, offload_shim (on the
NCCL-only group, and routed on the Gloo group) and GPU-resident. The floor is the tensor's bytes over the pinned
H2D bandwidth measured in this run. Also: chunk-size sweep, pageable paths, routing crossover, and the peak extra
accelerator memory of a staged call. Timings: host clock around calls that are complete on return (a staged
result is on the host), after a barrier, warm-up first, median of repeats.

Rank 0 prints a table and writes DIR/bench.json and DIR/bench.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import offload_shim
from offload_shim import _pipeline

MiB = 1 << 20


def human(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} B"


class Bench:
    def __init__(self, device, quick):
        self.device = device
        self.quick = quick
        self.rank = dist.get_rank()
        self.records = []

    def sync(self):
        torch.accelerator.synchronize()

    def time(self, fn, nbytes, group=None) -> float:
        """Median seconds of fn() over repeats (after warm-up), each started after a barrier."""
        repeats = 3 if nbytes >= 256 * MiB else 7 if nbytes >= 16 * MiB else 21
        if self.quick:
            repeats = min(repeats, 3)
        times = []
        for i in range(repeats + 1):
            dist.barrier(group=group)
            self.sync()
            start = time.perf_counter()
            fn()
            self.sync()
            if i:  # the first run is warm-up
                times.append(time.perf_counter() - start)
        # every rank reports the slowest rank's median
        median = torch.tensor([statistics.median(times)], device=self.device)
        dist.all_reduce(median, op=dist.ReduceOp.MAX)
        return median.item()

    def record(self, **fields):
        self.records.append(fields)
        if self.rank == 0:
            print(json.dumps(fields), flush=True)


def host_tensor(numel, dtype, pinned, fill):
    t = torch.empty(numel, dtype=dtype, pin_memory=pinned)
    t.fill_(fill)
    return t


def measure_h2d(bench, nbytes=256 * MiB):
    src = host_tensor(nbytes // 4, torch.float32, True, 1.0)
    dst = torch.empty_like(src, device=bench.device)
    seconds = bench.time(lambda: dst.copy_(src, non_blocking=True), nbytes)
    src_pageable = host_tensor(nbytes // 4, torch.float32, False, 1.0)
    seconds_pageable = bench.time(lambda: dst.copy_(src_pageable), nbytes)
    d2h = bench.time(lambda: src.copy_(dst, non_blocking=True), nbytes)
    d2h_pageable = bench.time(lambda: src_pageable.copy_(dst), nbytes)
    bandwidth = {
        "h2d_pinned_GBps": nbytes / seconds / 1e9,
        "h2d_pageable_GBps": nbytes / seconds_pageable / 1e9,
        "d2h_pinned_GBps": nbytes / d2h / 1e9,
        "d2h_pageable_GBps": nbytes / d2h_pageable / 1e9,
    }
    # Both directions at once, on both ranks: what an all_reduce staged through pinned memory must move.
    h2d, d2h_stream = torch.Stream(device=bench.device), torch.Stream(device=bench.device)
    back = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)  # empty_like would not pin it
    dst2 = torch.empty_like(dst)

    def duplex():
        with torch.cuda.stream(h2d):
            dst.copy_(src, non_blocking=True)
        with torch.cuda.stream(d2h_stream):
            back.copy_(dst2, non_blocking=True)

    bandwidth["duplex_seconds"] = bench.time(duplex, nbytes)
    bench.record(kind="copy_bandwidth", bytes=nbytes, **bandwidth)
    return bandwidth["h2d_pinned_GBps"] * 1e9


def collective_routes(bench, op, nbytes, dtype, pinned, nccl_group, gloo_group):
    numel = nbytes // dtype.itemsize
    t = host_tensor(numel, dtype, pinned, 1.0)
    call = (lambda x, g: dist.all_reduce(x, group=g)) if op == "all_reduce" else (lambda x, g: dist.broadcast(x, src=0, group=g))
    results = {}
    offload_shim.uninstall()
    results["gloo"] = bench.time(lambda: call(t, gloo_group), nbytes, nccl_group)

    def naive():
        staged = t.to(bench.device, non_blocking=pinned)
        call(staged, nccl_group)
        t.copy_(staged, non_blocking=pinned)
        torch.accelerator.synchronize()

    results["naive"] = bench.time(naive, nbytes, nccl_group)
    gpu = torch.ones(numel, dtype=dtype, device=bench.device)
    results["gpu_resident"] = bench.time(lambda: call(gpu, nccl_group), nbytes, nccl_group)
    offload_shim.install()
    results["offload_shim"] = bench.time(lambda: call(t, nccl_group), nbytes, nccl_group)
    return results


def peak_extra_memory(bench, fn) -> int:
    _pipeline.release_buffers()
    bench.sync()
    torch.cuda.reset_peak_memory_stats(bench.device)
    before = torch.cuda.memory_allocated(bench.device)
    fn()
    bench.sync()
    return torch.cuda.max_memory_allocated(bench.device) - before


def full_tensor_routes(bench, nccl_group, gloo_group):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    nbytes = 512 * MiB
    results = {}
    weights = {}
    for name, group in (("nccl_only", nccl_group), ("gloo", gloo_group)):
        # distinct dim names: DeviceMesh equality ignores process groups
        mesh = DeviceMesh.from_group(group, bench.device.type, mesh_dim_names=(name,))
        model = torch.nn.Linear(16384, 8192, bias=False)  # 8192 x 16384 fp32 = 512 MiB
        fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
        weights[name] = model.weight
    offload_shim.uninstall()
    results["gloo"] = bench.time(lambda: weights["gloo"].full_tensor(), nbytes)

    def naive():
        w = weights["nccl_only"]
        staged = DTensor.from_local(w.to_local().to(bench.device), w.device_mesh, w.placements, run_check=False)
        staged.full_tensor().cpu()

    results["naive"] = bench.time(naive, nbytes)
    gpu_mesh = DeviceMesh.from_group(nccl_group, bench.device.type, mesh_dim_names=("gpu",))
    gpu_model = torch.nn.Linear(16384, 8192, bias=False)
    fully_shard(gpu_model, mesh=gpu_mesh)
    results["gpu_resident"] = bench.time(lambda: gpu_model.weight.full_tensor(), nbytes)
    offload_shim.install()
    results["offload_shim"] = bench.time(lambda: weights["nccl_only"].full_tensor(), nbytes)
    results["offload_shim_routed_off_gloo"] = bench.time(lambda: weights["gloo"].full_tensor(), nbytes)
    results["peak_extra_bytes_offload_shim"] = peak_extra_memory(bench, lambda: weights["nccl_only"].full_tensor())
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(torch.accelerator.current_accelerator().type, local_rank)
    torch.accelerator.set_device_index(local_rank)
    dist.init_process_group("nccl", device_id=device)
    nccl_group = dist.group.WORLD
    gloo_group = dist.new_group(backend=f"cpu:gloo,{device.type}:nccl")
    bench = Bench(device, args.quick)
    chunk_default = offload_shim.settings().chunk_bytes
    offload_shim.install()
    offload_shim.configure(route_min_bytes=None)  # routing is measured on its own below
    meta = {
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "device": torch.cuda.get_device_name(device),
        "world_size": dist.get_world_size(),
        "chunk_bytes_default": chunk_default,
        "pageable_path_default": _pipeline.PAGEABLE_PATH,
    }
    floor_bandwidth = measure_h2d(bench)

    # 1. chunk size, chunks in flight and pageable path, at 256 MiB fp32
    for chunk in (4 * MiB, 8 * MiB, 16 * MiB, 32 * MiB, 64 * MiB):
        offload_shim.configure(chunk_bytes=chunk)
        for variant in ("pinned", "pinned_3_slots", "driver", "bounce"):
            pinned = variant.startswith("pinned")
            _pipeline.SLOTS = 3 if variant == "pinned_3_slots" else 2
            _pipeline.PAGEABLE_PATH = variant if not pinned else meta["pageable_path_default"]
            t = host_tensor(64 * MiB, torch.float32, pinned, 1.0)
            seconds = bench.time(lambda: dist.all_reduce(t), 256 * MiB)
            bench.record(kind="chunk_sweep", op="all_reduce", bytes=256 * MiB, chunk_bytes=chunk, variant=variant,
                         pinned=pinned, seconds=seconds, over_floor=seconds / (256 * MiB / floor_bandwidth))
    _pipeline.SLOTS = 2
    offload_shim.configure(chunk_bytes=chunk_default)
    _pipeline.PAGEABLE_PATH = meta["pageable_path_default"]

    # 2. peak extra accelerator memory, tensors of 4 and 32 chunks
    for multiple in (4, 32):
        t = host_tensor(multiple * chunk_default // 4, torch.float32, True, 1.0)
        peak = peak_extra_memory(bench, lambda: dist.all_reduce(t))
        bench.record(kind="peak_memory", op="all_reduce", bytes=t.numel() * 4, chunk_bytes=chunk_default,
                     peak_extra_bytes=peak, peak_extra_chunks=peak / chunk_default)

    # 3. routes by size
    sizes = [4 << 10, 64 << 10, 1 * MiB, 16 * MiB, 256 * MiB, 1024 * MiB]
    if args.quick:
        sizes = [4 << 10, 1 * MiB, 256 * MiB]
    for op in ("all_reduce", "broadcast"):
        for dtype in (torch.float32, torch.bfloat16):
            for pinned in (True, False):
                for nbytes in sizes:
                    results = collective_routes(bench, op, nbytes, dtype, pinned, nccl_group, gloo_group)
                    floor = nbytes / floor_bandwidth
                    bench.record(kind="collective", op=op, dtype=str(dtype).replace("torch.", ""), pinned=pinned,
                                 bytes=nbytes, floor_seconds=floor, **{f"{k}_seconds": v for k, v in results.items()})

    # 4. routing crossover on the Gloo group: Gloo against offload_shim's route through NCCL
    for nbytes in (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 * MiB, 4 * MiB):
        t = host_tensor(nbytes // 4, torch.float32, False, 1.0)
        offload_shim.configure(route_min_bytes=None)
        gloo = bench.time(lambda: dist.all_reduce(t, group=gloo_group), nbytes)
        offload_shim.configure(route_min_bytes=0)
        routed = bench.time(lambda: dist.all_reduce(t, group=gloo_group), nbytes)
        bench.record(kind="routing", op="all_reduce", bytes=nbytes, pinned=False, gloo_seconds=gloo, routed_seconds=routed)
    offload_shim.configure(route_min_bytes=None)

    # 5. many small calls: 200 one-element all_reduces
    scalars = [torch.zeros(()) for _ in range(200)]
    offload_shim.uninstall()
    gloo_small = bench.time(lambda: [dist.all_reduce(s, group=gloo_group) for s in scalars], 1)
    offload_shim.install()
    shim_small = bench.time(lambda: [dist.all_reduce(s) for s in scalars], 1)
    bench.record(kind="small_calls", calls=200, gloo_seconds=gloo_small, offload_shim_seconds=shim_small)

    # 6. full_tensor of an FSDP2-offloaded 512 MiB weight
    offload_shim.configure(route_min_bytes=offload_shim._config.DEFAULT_ROUTE_MIN_BYTES)
    results = full_tensor_routes(bench, nccl_group, gloo_group)
    bench.record(kind="full_tensor", bytes=512 * MiB, floor_seconds=512 * MiB / floor_bandwidth,
                 **{f"{k}_seconds" if not k.startswith("peak") else k: v for k, v in results.items()})

    if bench.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump({"meta": meta, "records": bench.records}, f, indent=1)
        from report import plot, table

        print(table(meta, bench.records))
        plot(bench.records, os.path.join(args.out, "bench.png"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
