"""Probe, on one accelerator, what an asynchronous staged all_reduce of pinned memory spends before it returns
(one rank, NCCL-only group): the whole call against its parts issued by hand, each part's host time per chunk.

    torchrun --nproc_per_node 1 benchmarks/probe_async_issue.py --out DIR

Each figure is the minimum over 7 rounds of the host time to issue (nothing waited for); a cProfile of the
shim's call lists where its host time goes. JSON in DIR/async_probe.json, the profile in DIR/async_profile.txt.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time

import torch
import torch.distributed as dist

import offload_shim


def issue_time(fn, rounds: int = 7) -> float:
    """Seconds from the call to its return, the minimum over ``rounds`` (the device drained before each)."""
    best = float("inf")
    for _ in range(rounds):
        torch.accelerator.synchronize()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        torch.accelerator.synchronize()
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--bytes", type=int, default=256 << 20)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    group = dist.group.WORLD
    chunk = offload_shim.settings().chunk_bytes
    count = args.bytes // chunk
    host = torch.ones(args.bytes // 4, pin_memory=True)
    gpu = torch.empty(args.bytes // 4, device=device)
    views = [(host[i * chunk // 4 : (i + 1) * chunk // 4], gpu[i * chunk // 4 : (i + 1) * chunk // 4]) for i in range(count)]
    h2d, d2h = torch.cuda.Stream(), torch.cuda.Stream()
    opts = dist.AllreduceOptions()
    opts.asyncOp = True
    method = type(group).allreduce

    def copies():
        with torch.cuda.stream(h2d):
            for h, g in views:
                g.copy_(h, non_blocking=True)

    def launches():
        with torch.cuda.stream(h2d):
            for _, g in views:
                method(group, [g], opts)

    def launches_torch():
        for _, g in views:
            dist.all_reduce(g, async_op=True)

    def by_hand():  # what the shim queues: per chunk H2D, collective, D2H behind it
        with torch.cuda.stream(h2d):
            for h, g in views:
                g.copy_(h, non_blocking=True)
                work = method(group, [g], opts)
                with torch.cuda.stream(d2h):
                    work.wait()
                    h.copy_(g, non_blocking=True)

    def events():
        for _ in views:
            h2d.record_event()

    def shim():
        return dist.all_reduce(host, async_op=True)

    for fn in (copies, launches, by_hand, shim):
        fn()
        torch.accelerator.synchronize()
    shim().wait()
    parts = {name: issue_time(fn) for name, fn in [("copies", copies), ("launches", launches),
                                                    ("launches_through_dist", launches_torch), ("by_hand", by_hand),
                                                    ("events", events), ("shim_returned", shim)]}
    # Host time inside the shim's parts, per call (main thread): each part wrapped with a timer.
    from offload_shim import _execute, _groups, _staging

    spent = {}

    def timed_call(fn, key):
        def wrapper(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent[key] = spent.get(key, 0.0) + time.perf_counter() - start

        return wrapper

    def timed(module, name):
        original = getattr(module, name)

        key = f"{module.__name__.rsplit('.', 1)[-1]}.{name}"

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                result = original(*args, **kwargs)
            finally:
                spent[key] = spent.get(key, 0.0) + time.perf_counter() - start
            if name == "_launcher":  # the chunk launches it returns, timed too
                prepare, issue = result
                return prepare, timed_call(issue, "launch")
            return result

        setattr(module, name, wrapper)
        return original

    parts_timed = [(_execute, n) for n in ("_agreement", "_launch_agreement", "_host_bytes", "_launcher", "_run_async",
                                           "_pipelined", "_ins", "_outs")] + [
        (_groups, "host_buffer"), (_groups, "completion_lane"), (_groups, "lane"), (_staging, "new_stream"),
        (_staging, "finish_writes_to")]
    originals = [(m, n, timed(m, n)) for m, n in parts_timed]
    for _ in range(7):
        torch.accelerator.synchronize()
        shim().wait()
    spent.clear()
    for _ in range(7):
        torch.accelerator.synchronize()
        start = time.perf_counter()
        work = shim()
        spent["whole"] = spent.get("whole", 0.0) + time.perf_counter() - start
        work.wait()
    for m, n, original in originals:
        setattr(m, n, original)
    parts["inside_us_per_call"] = {k: v / 7 * 1e6 for k, v in spent.items()}
    profile = cProfile.Profile()
    for _ in range(5):
        torch.accelerator.synchronize()
        profile.enable()
        work = shim()
        profile.disable()
        work.wait()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(40)
    with open(os.path.join(args.out, "async_profile.txt"), "w") as f:
        f.write(text.getvalue())
    result = {"bytes": args.bytes, "chunks": count,
              **{f"{k}_seconds": v for k, v in parts.items() if isinstance(v, float)},
              "inside_us_per_call": parts["inside_us_per_call"],
              **{f"{k}_us_per_chunk": v / count * 1e6 for k, v in parts.items() if isinstance(v, float)}}
    print(json.dumps(result))
    with open(os.path.join(args.out, "async_probe.json"), "a") as f:
        f.write(json.dumps(result) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
