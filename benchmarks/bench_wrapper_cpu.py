"""Cost of offload_shim's wrappers on calls that need no staging, on the CPU: a one-element all_reduce on a
two-rank Gloo group, with the shim installed against uninstalled, interleaved in one run so the ratio holds.

    python benchmarks/bench_wrapper_cpu.py [--calls 2000] [--rounds 15] [--out FILE.json]

Prints the median time per call of each and their ratio (shim on / shim off), and the same for the fastest round
of each (less disturbed by the other processes of a small machine).
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import statistics
import sys
import time

import torch.multiprocessing as mp


def _rank(rank, port, calls, rounds, queue):
    import torch
    import torch.distributed as dist

    import offload_shim

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    tensor = torch.ones(1)
    per_call = {True: [], False: []}
    for round_ in range(rounds + 1):
        for installed in (True, False) if round_ % 2 else (False, True):
            offload_shim.install() if installed else offload_shim.uninstall()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                dist.all_reduce(tensor)
            elapsed = time.perf_counter() - start
            if round_:  # round 0 is warm-up
                per_call[installed].append(elapsed / calls)
    if rank == 0:
        queue.put({k: (statistics.median(v), min(v)) for k, v in per_call.items()})
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=_rank, args=(r, port, args.calls, args.rounds, queue)) for r in range(2)]
    for p in processes:
        p.start()
    medians = queue.get(timeout=600)
    for p in processes:
        p.join()
    (on, on_best), (off, off_best) = medians[True], medians[False]
    result = {
        "calls_per_round": args.calls,
        "rounds": args.rounds,
        "shim_on_us_per_call": on * 1e6,
        "shim_off_us_per_call": off * 1e6,
        "ratio_on_over_off": on / off,
        "fastest_round_shim_on_us_per_call": on_best * 1e6,
        "fastest_round_shim_off_us_per_call": off_best * 1e6,
        "fastest_round_ratio": on_best / off_best,
    }
    print(f"one-element Gloo all_reduce, 2 ranks, median of {args.rounds} rounds of {args.calls} calls: "
          f"shim on {on * 1e6:.2f} us, shim off {off * 1e6:.2f} us, ratio {on / off:.3f}; "
          f"fastest rounds: {on_best * 1e6:.2f} us, {off_best * 1e6:.2f} us, ratio {on_best / off_best:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
