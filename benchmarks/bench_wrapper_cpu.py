"""CPU time offload_shim's wrappers add to calls that need no staging, on the CPU (the smoke run of the
served-path figure; ``bench_staging.py``'s ``served`` section gives it on two GPUs); and the CPU time the counters of
``offload_shim.staging_counters()`` add to a staged call.

    python benchmarks/bench_wrapper_cpu.py [--calls 2000] [--rounds 30] [--out FILE.json]

One process, a one-rank Gloo group: blocks of ``--calls`` calls alternate between three sides: the shim installed,
uninstalled, and uninstalled with a wrapt ``FunctionWrapper`` that only passes the call on bound in its place (the
wrapping library's own share of the shim's cost); each block's CPU time of the calling thread per call is taken, and
each side's minimum over the rounds is kept (means are too noisy on a shared machine). Cases: ``all_reduce`` and
``all_gather_into_tensor`` of a one-element CPU tensor on that group, which serves CPU (the wrappers decide and pass
the call on). Counting:
what a staged call runs to be counted, the decision's record and the count (``_counters.decided`` and
``_counters.count``, the logger not enabled for INFO), in blocks of ``--calls``, the minimum over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time


def measure(calls: int, rounds: int) -> dict:
    import torch
    import torch.distributed as dist

    import offload_shim

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    tensor, gathered = torch.ones(1), torch.empty(1)
    cases = {
        "all_reduce": lambda: dist.all_reduce(tensor),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(gathered, tensor),
    }
    import wrapt

    def passing_on(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs)

    results = {}
    for name, call in cases.items():
        sides = ("shim", "off", "wrapt")
        best = dict.fromkeys(sides, float("inf"))
        for round_ in range(rounds + 1):
            for side in sides if round_ % 2 else sides[::-1]:
                offload_shim.install() if side == "shim" else offload_shim.uninstall()
                original = getattr(dist, name)
                if side == "wrapt":
                    setattr(dist, name, wrapt.FunctionWrapper(original, passing_on))
                start = time.thread_time()
                for _ in range(calls):
                    call()
                elapsed = time.thread_time() - start
                setattr(dist, name, original)
                if round_:  # round 0 is warm-up
                    best[side] = min(best[side], elapsed / calls)
        results[name] = {
            "shim_on_cpu_us_per_call": best["shim"] * 1e6,
            "shim_off_cpu_us_per_call": best["off"] * 1e6,
            "added_cpu_us_per_call": (best["shim"] - best["off"]) * 1e6,
            "wrapt_alone_added_cpu_us_per_call": (best["wrapt"] - best["off"]) * 1e6,
            "shim_beyond_wrapt_cpu_us_per_call": (best["shim"] - best["wrapt"]) * 1e6,
        }
    offload_shim.install()
    dist.destroy_process_group()
    return results


def counting(calls: int, rounds: int) -> float:
    """CPU time, in us, that counting adds to one staged call (see the module docstring)."""
    import torch

    from offload_shim import _counters

    device, best = torch.device("cpu"), float("inf")
    for round_ in range(rounds + 1):
        start = time.thread_time()
        for _ in range(calls):
            _counters.decided(_counters.FORCED, device)
            _counters.count("torch.distributed.all_reduce", _counters.SMALL, 4)
        if round_:  # round 0 is warm-up
            best = min(best, (time.thread_time() - start) / calls)
    _counters.reset_staging_counters()
    return best * 1e6


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    os.environ.setdefault("OFFLOAD_SHIM", "1")
    results = {"calls_per_round": args.calls, "rounds": args.rounds, "cases": measure(args.calls, args.rounds)}
    results["counting_cpu_us_per_staged_call"] = counting(args.calls, args.rounds)
    for name, r in results["cases"].items():
        print(f"{name}, one element, one-rank Gloo group, minimum of {args.rounds} rounds of {args.calls} calls: "
              f"CPU time per call {r['shim_on_cpu_us_per_call']:.2f} us with the shim, {r['shim_off_cpu_us_per_call']:.2f} us "
              f"without, added {r['added_cpu_us_per_call']:.2f} us, of which a wrapt pass-through wrapper alone "
              f"{r['wrapt_alone_added_cpu_us_per_call']:.2f} us and the shim beyond it "
              f"{r['shim_beyond_wrapt_cpu_us_per_call']:.2f} us")
    print(f"counting a staged call (decision's record and count), minimum of {args.rounds} rounds of {args.calls}: "
          f"CPU time {results['counting_cpu_us_per_staged_call']:.2f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
