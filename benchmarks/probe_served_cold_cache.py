"""What the served path's decision costs when the call it wraps evicts the CPU's caches, as a collective's launch
does: the shim's wrapper function and a pass-through one (and a second pass-through, the method's own spread), each
through a wrapt ``FunctionWrapper`` around a function that copies ``--thrash`` KiB between two host buffers in place
of the collective, called in turn (one call of each, the order rotated every turn) for ``--turns`` turns; what the
shim adds is the median over the turns of the difference within a turn, in microseconds of the thread's CPU time.
Beside them, the floor: a wrapper that only reads what any served decision reads of the call (the tensors' devices,
and a host tensor's size) before passing it on; and the shim's wrapper function made again here, by the same factory,
which differs from the installed one only by where its objects lie (the others, made here too, lie near the loop that
times them).

    python benchmarks/probe_served_cold_cache.py [--thrash 0,256,1024,4096] [--turns 20000] [--out FILE.json]

Cases: ``all_reduce`` of a one-element CPU tensor on a one-rank group with a CPU and an accelerator backend
(``cpu:gloo`` and the accelerator's, or PyTorch's fake backend for CUDA where there is none), its answer kept; and
``reduce_scatter_tensor`` of ``meta`` tensors (the path an NCCL group's GPU tensors take). Needs no accelerator.
"""

from __future__ import annotations

import argparse
import json
import statistics
import warnings

from bench_wrapper_cpu import (  # (benchmarks/, the script's folder, is on sys.path)
    device_and_size, devices_of_two, in_turn, one_rank_groups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--thrash", default="0,256,1024,4096", help="KiB copied by the wrapped function, a list")
    parser.add_argument("--turns", type=int, default=20000)
    parser.add_argument("--out", help="write the figures to this JSON file")
    options = parser.parse_args()

    import torch
    import torch.distributed as dist
    import wrapt

    import offload_shim
    from offload_shim import _table, _wrappers

    two_backends = one_rank_groups()
    offload_shim.install()
    host, output, source = torch.ones(1), torch.empty(1, device="meta"), torch.empty(1, device="meta")

    def through(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs)

    def through_again(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs)

    cases = {
        "all_reduce, CPU tensor, two-backend group": ("all_reduce", (host,), {"group": two_backends}, device_and_size),
        "reduce_scatter_tensor, meta tensors": ("reduce_scatter_tensor", (output, source), {}, devices_of_two),
    }
    figures = []
    for name, (function, args, kwargs, reads) in cases.items():
        shim = getattr(dist, function)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch 2.13's deprecation of the *_tensor names
            shim(*args, **kwargs)  # the group's answer kept
        made_here = _wrappers.c10d_wrapper(_table.C10D[function])(shim.__wrapped__, [True])  # (placement: docstring)
        for kib in (int(k) for k in options.thrash.split(",")):
            into, out_of = bytearray(kib << 10), bytearray(kib << 10)

            def collective(*args, **kwargs):
                into[:] = out_of

            routes = {side: wrapt.FunctionWrapper(collective, body) for side, body in
                      (("shim", shim._self_wrapper), ("pass_through", through), ("again", through_again),
                       ("floor", reads), ("made_here", made_here))}
            spent = in_turn(routes, args, kwargs, options.turns)
            added = {side: statistics.median(a - b for a, b in zip(spent[side], spent["pass_through"])) / 1000
                     for side in ("shim", "again", "floor", "made_here")}
            figures.append({"case": name, "thrash_kib": kib, "turns": options.turns,
                            "call_us": statistics.median(spent["pass_through"]) / 1000,
                            "shim_beyond_pass_through_us": added["shim"],
                            "second_pass_through_beyond_first_us": added["again"],
                            "floor_beyond_pass_through_us": added["floor"],
                            "made_here_beyond_pass_through_us": added["made_here"]})
            print(f"{name}, {kib} KiB evicted per call ({figures[-1]['call_us']:.1f} us a call): the shim "
                  f"{added['shim']:.3f} us beyond a pass-through (made here {added['made_here']:.3f}); the floor (the "
                  f"reads alone) {added['floor']:.3f}; "
                  f"a second pass-through {added['again']:+.3f} us", flush=True)
    if options.out:
        with open(options.out, "w") as f:
            json.dump({"torch": torch.__version__, "figures": figures}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
