"""Cost of the pipeline's agreement check (``_pipeline._agree``: one small all_reduce whose result the host waits
for), against a pipelined all_reduce of the smallest size that takes the pipeline (two chunks), in one run.

    torchrun --nproc_per_node 2 benchmarks/bench_agreement_check.py [--repeats 50] [--out FILE.json]

Blocks alternate the two measurements; each side's minimum and median are reported (rank 0), with the ratio of the
check's minimum to the all_reduce's: the share of the smallest pipelined call the check adds, when nothing hides
it (in the pipeline it runs behind the first chunk's H2D).
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
from offload_shim import _config, _pipeline


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)  # NCCL only: CPU tensors are staged
    offload_shim.install()
    chunk = _config.settings().chunk_bytes
    tensor = torch.ones(2 * chunk // 4).pin_memory()
    group = dist.group.WORLD
    flat = tensor.view(-1)
    times = {"check": [], "all_reduce": []}
    for _ in range(5):  # warm up: communicators, pools
        dist.all_reduce(tensor)
        _pipeline._agree(group, device, "torch.distributed.all_reduce", flat.numel(), flat.dtype, chunk)
    for index in range(2 * args.repeats):
        side = ("check", "all_reduce")[(index + index // 2) % 2]  # alternate, in blocks that swap order
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        if side == "check":
            _pipeline._agree(group, device, "torch.distributed.all_reduce", flat.numel(), flat.dtype, chunk)
        else:
            dist.all_reduce(tensor)
        times[side].append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        report = {
            "torch": torch.__version__,
            "chunk_bytes": chunk,
            "all_reduce_bytes": tensor.numel() * 4,
            **{f"{side}_min_us": min(t) * 1e6 for side, t in times.items()},
            **{f"{side}_median_us": statistics.median(t) * 1e6 for side, t in times.items()},
        }
        report["check_share_of_smallest_pipelined_call"] = report["check_min_us"] / report["all_reduce_min_us"]
        print(json.dumps(report, indent=1))
        if args.out:
            with open(args.out, "w") as out:
                json.dump(report, out, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
