"""The served decision for a CPU tensor on a group with a CPU and an accelerator backend, apart from the collective:
the shim's wrapper function, a wrapper that makes only the reads any decision needs (the tensor's device and size:
the floor) and a pass-through one, each around a function that does nothing, in alternating blocks on one thread.
The group's answer is set to a size threshold, as on a host whose accelerator backend takes host calls above a
size (with no accelerator every size is served, and the size is never read).

    python benchmarks/probe_served_host_decision.py [--blocks 60] [--calls 5000]

Prints each side's minimum over the blocks, in nanoseconds a call, less the floor's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=60)
    parser.add_argument("--calls", type=int, default=5000)
    options = parser.parse_args()

    import torch
    import torch.distributed as dist

    import offload_shim
    from bench_wrapper_cpu import device_and_size, one_rank_groups
    from offload_shim import _devices, _table, _wrappers

    two = one_rank_groups()
    offload_shim.install()
    tensor = torch.ones(1)
    dist.all_reduce(tensor, group=two)  # the group's answer, kept
    _devices.record(two).below = 1 << 20  # as where the accelerator's backend takes host calls from 1 MiB
    function = dist.all_reduce.__wrapped__
    bodies = {
        "shim": _wrappers.c10d_wrapper(_table.C10D["all_reduce"])(function, [True]),
        "floor": device_and_size,
        "pass_through": lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs),
    }
    noop = lambda *a, **k: None  # noqa: E731
    args, kwargs = (tensor,), {"group": two}
    spent = {side: [] for side in bodies}
    for block in range(options.blocks + 1):
        for side in bodies if block % 2 else list(bodies)[::-1]:
            body = bodies[side]
            start = time.thread_time()
            for _ in range(options.calls):
                body(noop, None, args, kwargs)
            if block:  # (the first block warms up)
                spent[side].append((time.thread_time() - start) / options.calls)
    low = {side: min(values) * 1e9 for side, values in spent.items()}
    print({side: round(value - low["floor"], 1) for side, value in low.items()}, "ns beyond the floor;",
          f"the floor {low['floor']:.1f} ns a call")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
