"""Cost of a chunked call's agreement check (``_execute._agreement``, ``_launch_agreement``, ``_check_agreement``: one
small all_reduce whose result the host waits for), against a pipelined all_reduce of the smallest size that
takes the pipeline (two chunks), in one run.

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
from offload_shim import _config, _execute, _plan


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
    chunks = _plan.Chunks("all_reduce", tensor.numel() * 4, chunk, dist.get_world_size(), tensor.dtype, chunk)

    def check() -> None:  # as a synchronous chunked call runs it
        agreement = _execute._agreement(chunks, device)
        _execute._launch_agreement(group, agreement).wait()
        _execute._check_agreement(group, agreement.tolist(), chunks, "torch.distributed.all_reduce")

    times = {"check": [], "all_reduce": []}
    for _ in range(5):  # warm up: communicators, pools
        dist.all_reduce(tensor)
        check()
    for index in range(2 * args.repeats):
        side = ("check", "all_reduce")[(index + index // 2) % 2]  # alternate, in blocks that swap order
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        if side == "check":
            check()
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
