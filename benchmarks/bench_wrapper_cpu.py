"""CPU time offload_shim's wrappers add to calls that need no staging, on the CPU (the smoke run of the
served-path figure; ``bench_staging.py``'s ``served`` section gives it on two GPUs); and the CPU time the counters of
``offload_shim.staging_counters()`` add to a staged call.

    python benchmarks/bench_wrapper_cpu.py [--calls 2000] [--rounds 30] [--out FILE.json]

One process, a one-rank Gloo group (and, where there is an accelerator, a one-rank group of its backend with
accelerator tensors): blocks of ``--calls`` calls alternate between four sides: the shim with host staging off too; the shim installed,
uninstalled, and uninstalled with a wrapt ``FunctionWrapper`` that only passes the call on bound in its place (the
wrapping library's own share of the shim's cost); each block's CPU time of the calling thread per call is taken, and
each side's minimum over the rounds is kept (means are too noisy on a shared machine). Cases: ``all_reduce`` and
``broadcast``, ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` of a one-element CPU tensor on that group, which
serves CPU (the wrappers decide and pass the call on), and ``all_reduce`` of it on a one-rank group with a CPU and an
accelerator backend (``cpu:gloo`` and the accelerator's, or PyTorch's fake backend for CUDA where there is none); each side's minimum and median over the rounds. Counting:
what a staged call runs to be counted, the decision's record and the count (``_counters.decided`` and
``_counters.count``, the logger not enabled for INFO), in blocks of ``--calls``, the minimum over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time


def in_turn(routes: dict, args: tuple, kwargs: dict, turns: int, between=None) -> dict:
    """Thread CPU time, in nanoseconds, of each of ``routes`` (name: callable) called with ``args`` and ``kwargs``:
    one call of each in turn, the order rotated every turn, after 200 turns of warm-up; ``between()`` runs untimed
    every 200 turns. Returns {name: [nanoseconds of each turn's call]}: a turn's calls run back to back, so the
    difference between two routes in one turn holds little of the host's drift (see :func:`median_difference`)."""
    named = list(routes.items())
    spent = {name: [] for name in routes}
    clock = time.thread_time_ns
    for turn in range(-200, turns):
        if between is not None and turn % 200 == 0:
            between()
        for name, fn in named[turn % len(named):] + named[: turn % len(named)]:
            start = clock()
            fn(*args, **kwargs)
            elapsed = clock() - start
            if turn >= 0:
                spent[name].append(elapsed)
    return spent


# The floor of a served decision, as wrapt wrapper functions: what any decision must read of the call (each tensor
# argument's device; and the size of a host tensor on a group that can route host calls through the accelerator, whose
# answer depends on it), and nothing else, before passing the call on.
def device_of_one(wrapped, instance, args, kwargs):
    args[0].is_cpu
    return wrapped(*args, **kwargs)


def devices_of_two(wrapped, instance, args, kwargs):
    args[0].is_cpu, args[1].is_cpu
    return wrapped(*args, **kwargs)


def device_and_size(wrapped, instance, args, kwargs):
    args[0].is_cpu, args[0].nbytes
    return wrapped(*args, **kwargs)


def median_difference(spent: dict, one: str, other: str) -> float:
    """The median over the turns of route ``one``'s time less route ``other``'s in the same turn, in seconds."""
    return statistics.median(a - b for a, b in zip(spent[one], spent[other])) * 1e-9


def one_rank_groups():
    """A one-rank Gloo process group made the default, and a one-rank group with a CPU and an accelerator backend
    (``cpu:gloo`` and the accelerator's, or PyTorch's fake backend for CUDA where there is none), returned."""
    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if torch.accelerator.is_available():
        kind = torch.accelerator.current_accelerator().type
        two = f"cpu:gloo,{kind}:{dist.Backend.default_device_backend_map[kind]}"
    else:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

        two = "cpu:gloo,cuda:fake"
    return dist.new_group([0], backend=two)


def measure(calls: int, rounds: int) -> dict:
    import torch
    import torch.distributed as dist

    import offload_shim

    two_backends = one_rank_groups()
    tensor, gathered, scattered = torch.ones(1), torch.empty(1), torch.empty(1)
    cases = {  # name: (the torch.distributed function, a call of it)
        "all_reduce": ("all_reduce", lambda: dist.all_reduce(tensor)),
        "broadcast": ("broadcast", lambda: dist.broadcast(tensor, 0)),
        "all_gather_into_tensor": ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(gathered, tensor)),
        "reduce_scatter_tensor": ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(scattered, tensor)),
    }
    # A CPU tensor on a group with a CPU and an accelerator backend: the answer kept from its first, decided, call
    # serves it.
    cases["all_reduce, CPU tensor, two-backend group"] = (
        "all_reduce", lambda: dist.all_reduce(tensor, group=two_backends))
    if torch.accelerator.is_available():  # and accelerator tensors on a one-rank group of the accelerator's backend
        torch.accelerator.set_device_index(0)
        device = torch.device(torch.accelerator.current_accelerator().type, 0)
        group = dist.new_group([0], backend=dist.Backend.default_device_backend_map[device.type])
        on_device, gathered_on_device = torch.ones(1, device=device), torch.empty(1, device=device)
        cases["all_reduce, accelerator tensor"] = ("all_reduce", lambda: dist.all_reduce(on_device, group=group))
        cases["all_gather_into_tensor, accelerator tensors"] = (
            "all_gather_into_tensor", lambda: dist.all_gather_into_tensor(gathered_on_device, on_device, group=group)
        )
    import wrapt

    def passing_on(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs)

    def passing_on_again(wrapped, instance, args, kwargs):  # a second pass-through: the in-turn method's own spread
        return wrapped(*args, **kwargs)

    def body(call):
        """``call`` made against a function that does nothing: the wrapper's own work, apart from the collective's
        (whose CPU time on Gloo includes its wait, which the Python before it lengthens)."""
        noop = lambda *args, **kwargs: None  # noqa: E731
        arguments = {}

        def capture(wrapped, instance, args, kwargs):
            arguments.update(args=args, kwargs=kwargs)
            return wrapped(*args, **kwargs)

        return noop, capture, arguments

    results = {}
    for name, (function, call) in cases.items():
        # The shim's decision alone: its wrapper against one that only passes the call on, both around a no-op.
        offload_shim.install()
        wrapper = offload_shim.wrapped_functions()[f"torch.distributed.distributed_c10d.{function}"]._self_wrapper
        noop, capture, arguments = body(call)
        original = getattr(dist, function)
        offload_shim.uninstall()
        setattr(dist, function, wrapt.FunctionWrapper(original, capture))
        call()
        setattr(dist, function, original)
        offload_shim.install()
        # The whole call in turn, shim installed: its wrapper, torch's function, a wrapt pass-through of it.
        shim = getattr(dist, function)
        spent = in_turn({"shim": shim, "off": shim.__wrapped__, "wrapt": wrapt.FunctionWrapper(shim.__wrapped__, passing_on),
                         "wrapt_again": wrapt.FunctionWrapper(shim.__wrapped__, passing_on_again)},
                        arguments["args"], arguments["kwargs"], calls * rounds // 3)
        decision = {"shim": float("inf"), "wrapt": float("inf")}
        for round_ in range(rounds + 1):
            for side, function_body in (("shim", wrapper), ("wrapt", passing_on)):
                start = time.thread_time()
                for _ in range(calls):
                    function_body(noop, None, arguments["args"], arguments["kwargs"])
                if round_:
                    decision[side] = min(decision[side], (time.thread_time() - start) / calls)
        sides = ("shim", "off", "wrapt", "shim, host staging off")
        best = dict.fromkeys(sides, float("inf"))
        every = {side: [] for side in sides}
        for round_ in range(rounds + 1):
            for side in sides if round_ % 2 else sides[::-1]:
                offload_shim.uninstall() if side in ("off", "wrapt") else offload_shim.install()
                offload_shim.configure(host_staging=side != "shim, host staging off")
                original = getattr(dist, function)
                if side == "wrapt":
                    setattr(dist, function, wrapt.FunctionWrapper(original, passing_on))
                start = time.thread_time()
                for _ in range(calls):
                    call()
                elapsed = time.thread_time() - start
                setattr(dist, function, original)
                if round_:  # round 0 is warm-up
                    best[side] = min(best[side], elapsed / calls)
                    every[side].append(elapsed / calls)
        median = {side: sorted(times)[len(times) // 2] for side, times in every.items()}
        results[name] = {
            "in_turn_shim_beyond_wrapt_cpu_us_per_call": median_difference(spent, "shim", "wrapt") * 1e6,
            "in_turn_shim_beyond_torch_cpu_us_per_call": median_difference(spent, "shim", "off") * 1e6,
            "in_turn_wrapt_beyond_torch_cpu_us_per_call": median_difference(spent, "wrapt", "off") * 1e6,
            "in_turn_second_pass_through_beyond_wrapt_cpu_us_per_call": median_difference(spent, "wrapt_again", "wrapt") * 1e6,
            "in_turn_calls": len(spent["shim"]),
            "shim_beyond_wrapt_median_cpu_us_per_call": (median["shim"] - median["wrapt"]) * 1e6,
            "shim_beyond_torch_median_cpu_us_per_call": (median["shim"] - median["off"]) * 1e6,
            "shim_on_cpu_us_per_call": best["shim"] * 1e6,
            "shim_off_cpu_us_per_call": best["off"] * 1e6,
            "added_cpu_us_per_call": (best["shim"] - best["off"]) * 1e6,
            "wrapt_alone_added_cpu_us_per_call": (best["wrapt"] - best["off"]) * 1e6,
            "shim_beyond_wrapt_cpu_us_per_call": (best["shim"] - best["wrapt"]) * 1e6,
            "host_staging_cpu_us_per_call": (best["shim"] - best["shim, host staging off"]) * 1e6,
            "decision_beyond_wrapt_cpu_us_per_call": (decision["shim"] - decision["wrapt"]) * 1e6,
        }
    offload_shim.configure(host_staging=True)
    offload_shim.install()
    dist.destroy_process_group()
    return results


def accelerator_decisions(calls: int, rounds: int) -> dict:
    """The decision alone for accelerator tensors, which a CPU machine has none of: ``meta`` tensors (real
    ``torch.Tensor`` objects that are not on the host), on a one-rank Gloo group; the shim's wrapper function against
    a pass-through one, both around a function that does nothing, alternating blocks of ``calls``, each side's
    minimum; in us per call. The wrapper's path is the one an NCCL group's GPU tensors take: handed to torch."""
    import torch
    import torch.distributed as dist

    import offload_shim

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    offload_shim.install()
    one, out = torch.ones(1, device="meta"), torch.empty(1, device="meta")
    cases = {"all_reduce": (one,), "broadcast": (one, 0), "all_gather_into_tensor": (out, one),
             "reduce_scatter_tensor": (out, one)}
    noop = lambda *args, **kwargs: None  # noqa: E731

    def passing_on(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs)

    results = {}
    for function, args in cases.items():
        sides = {"shim": offload_shim.wrapped_functions()[f"torch.distributed.distributed_c10d.{function}"]._self_wrapper,
                 "wrapt": passing_on}
        best = dict.fromkeys(sides, float("inf"))
        for round_ in range(rounds + 1):
            for side, body in sides.items() if round_ % 2 else list(sides.items())[::-1]:
                start = time.thread_time()
                for _ in range(calls):
                    body(noop, None, args, {})
                if round_:  # round 0 is warm-up
                    best[side] = min(best[side], (time.thread_time() - start) / calls)
        results[f"{function}, accelerator tensors (meta)"] = (best["shim"] - best["wrapt"]) * 1e6
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
    results["accelerator_decision_beyond_wrapt_cpu_us_per_call"] = accelerator_decisions(args.calls, args.rounds)
    for name, r in results["cases"].items():
        print(f"{name}, one element, one rank, in turn ({r['in_turn_calls']} calls each; medians of the "
              f"differences): the shim {r['in_turn_shim_beyond_wrapt_cpu_us_per_call']:.2f} us beyond a wrapt "
              f"pass-through, {r['in_turn_shim_beyond_torch_cpu_us_per_call']:.2f} us beyond torch (the pass-through "
              f"{r['in_turn_wrapt_beyond_torch_cpu_us_per_call']:.2f} us; a second pass-through beyond the first, the "
              f"method's own spread: {r['in_turn_second_pass_through_beyond_wrapt_cpu_us_per_call']:.2f} us)")
        print(f"{name}, one element, one rank, minimum of {args.rounds} rounds of {args.calls} calls: "
              f"CPU time per call {r['shim_on_cpu_us_per_call']:.2f} us with the shim, {r['shim_off_cpu_us_per_call']:.2f} us "
              f"without, added {r['added_cpu_us_per_call']:.2f} us, of which a wrapt pass-through wrapper alone "
              f"{r['wrapt_alone_added_cpu_us_per_call']:.2f} us and the shim beyond it "
              f"{r['shim_beyond_wrapt_cpu_us_per_call']:.2f} us (medians: {r['shim_beyond_wrapt_median_cpu_us_per_call']:.2f}"
              f" us beyond wrapt, {r['shim_beyond_torch_median_cpu_us_per_call']:.2f} us beyond torch); host staging's decision "
              f"{r['host_staging_cpu_us_per_call']:.2f} us; the shim's decision alone, beyond a pass-through "
              f"wrapper, around a call that does nothing: {r['decision_beyond_wrapt_cpu_us_per_call']:.2f} us")
    for name, added in results["accelerator_decision_beyond_wrapt_cpu_us_per_call"].items():
        print(f"{name}: the shim's decision alone, beyond a pass-through wrapper, around a call that does nothing: "
              f"{added:.2f} us")
    print(f"counting a staged call (decision's record and count), minimum of {args.rounds} rounds of {args.calls}: "
          f"CPU time {results['counting_cpu_us_per_staged_call']:.2f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
