"""What the copy engines allow an all_reduce staged through pinned memory: H2D and D2H of the same size at once,
on every rank, against each alone.

    torchrun --nproc_per_node 2 benchmarks/bench_duplex.py [MiB]
"""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


def main():
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    n = mib * (1 << 20) // 4
    src = torch.ones(n, pin_memory=True)
    back = torch.empty(n, pin_memory=True)
    dst, dst2 = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
    h2d, d2h = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn, repeats=10):
        times = []
        for i in range(repeats + 1):
            dist.barrier()
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - start)
        t = torch.tensor([statistics.median(times)], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item() * 1e3

    def h2d_only():
        with torch.cuda.stream(h2d):
            dst.copy_(src, non_blocking=True)

    def d2h_only():
        with torch.cuda.stream(d2h):
            back.copy_(dst2, non_blocking=True)

    def both():
        h2d_only()
        d2h_only()

    results = {"h2d_ms": timed(h2d_only), "d2h_ms": timed(d2h_only), "h2d_and_d2h_at_once_ms": timed(both)}
    if rank == 0:
        print(f"{mib} MiB pinned, {dist.get_world_size()} ranks at once, medians of 10: " +
              ", ".join(f"{k} {v:.2f}" for k, v in results.items()), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
