"""Probe, on one accelerator, where a call that needs no staging spends the CPU time the shim adds: a cProfile of
each served case of ``bench_staging.py``'s ``served`` section under the shim (one rank; a NCCL-only group for
accelerator tensors, a ``cpu:gloo`` plus accelerator group and a plain Gloo group for a CPU tensor).

    torchrun --nproc_per_node 1 benchmarks/probe_served_path.py --out DIR

DIR/served_profile.txt: for each case, the functions by their own time over 20,000 calls.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import warnings

import torch
import torch.distributed as dist

import offload_shim


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    mixed = dist.new_group(backend="cpu:gloo,cuda:nccl")
    gloo = dist.new_group(backend="gloo")
    world = dist.get_world_size()
    gpu = torch.ones(world, device=device)
    gathered, scattered = torch.empty(world * world, device=device), torch.empty(1, device=device)
    host = torch.ones(1)
    cases = {
        "all_reduce, accelerator tensor": lambda: dist.all_reduce(gpu),
        "broadcast, accelerator tensor": lambda: dist.broadcast(gpu, 0),
        "all_gather_into_tensor, accelerator tensors": lambda: dist.all_gather_into_tensor(gathered, gpu),
        "reduce_scatter_tensor, accelerator tensors": lambda: dist.reduce_scatter_tensor(scattered, gpu),
        "all_reduce, CPU tensor, cpu:gloo,cuda:nccl group": lambda: dist.all_reduce(host, group=mixed),
        "all_reduce, CPU tensor, Gloo group": lambda: dist.all_reduce(host, group=gloo),
    }
    offload_shim.install()
    text = io.StringIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for name, call in cases.items():
            for _ in range(100):
                call()
            torch.cuda.synchronize()
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.calls):
                call()
            profiler.disable()
            torch.cuda.synchronize()
            text.write(f"\n=== {name}: {args.calls} calls\n")
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "served_profile.txt"), "w") as f:
        f.write(f"torch {torch.__version__}\n" + text.getvalue())
    print(text.getvalue()[:20000])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
