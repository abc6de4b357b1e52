"""Where the time of a staged call goes, on two accelerators: the parts behind bench_staging.py's figures, for
tuning (one run, each route's minimum over rounds).

    torchrun --nproc_per_node 2 benchmarks/bench_parts.py [--only wrapper,small,copies,pageable,full_tensor,pinned]

* ``wrapper``: CPU time per call of a one-element NCCL all_reduce of an accelerator tensor: bare, inside a wrapt
  pass-through wrapper, with the shim.
* ``small``: a 0-dim pageable all_reduce: staged by hand, the fast path's steps by hand, the shim; then a profile of
  the shim's calls.
* ``copies``: a 16 MiB pageable-to-pinned host copy over 1 to 32 threads and piece sizes.
* ``pageable``, ``pinned``: 256 MiB all_reduce by chunk size (and chunks in flight), against the copy limits.
* ``full_tensor``: an FSDP2-offloaded 512 MiB weight by chunk size, with peak extra accelerator memory.
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
import wrapt

import offload_shim
from offload_shim import _config, _execute, _groups, _staging
from offload_shim._state import state

MiB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only")
    parser.add_argument("--out")
    args = parser.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    offload_shim.install()
    wanted = set(args.only.split(",")) if args.only else None
    results = {}

    def say(key, value):
        results[key] = value
        if rank == 0:
            print(key, json.dumps(value), flush=True)

    def profiled(fn, lines: int) -> None:
        """Run ``fn`` under cProfile; rank 0 prints the ``lines`` functions of most internal time."""
        profile = cProfile.Profile()
        profile.enable()
        fn()
        profile.disable()
        if rank == 0:
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(lines)
            print(text.getvalue(), flush=True)

    def best(fn, calls, rounds=10, clock=time.perf_counter, sync=True):
        low = float("inf")
        for r in range(rounds + 1):
            dist.barrier()
            torch.cuda.synchronize()
            start = clock()
            for _ in range(calls):
                fn()
            if sync:
                torch.cuda.synchronize()
            if r:
                low = min(low, (clock() - start) / calls)
        t = torch.tensor([low], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    if wanted is None or "wrapper" in wanted:
        gpu = torch.ones(1, device=device)
        offload_shim.uninstall()
        raw = dist.all_reduce
        passthrough = wrapt.FunctionWrapper(raw, lambda wrapped, instance, a, k: wrapped(*a, **k))
        out = {}
        for _ in range(2):
            for name, fn in (("bare", lambda: raw(gpu)), ("wrapt_pass_through", lambda: passthrough(gpu))):
                out[name] = min(out.get(name, 1), best(fn, 500, 10, time.thread_time))
            offload_shim.install()
            out["shim"] = min(out.get("shim", 1), best(lambda: dist.all_reduce(gpu), 500, 10, time.thread_time))
            offload_shim.uninstall()
        offload_shim.install()
        say("wrapper_cpu_us", {k: v * 1e6 for k, v in out.items()})

    if wanted is None or "small" in wanted:
        t = torch.zeros(())
        host = torch.zeros((), pin_memory=True)
        staged = torch.zeros((), device=device)
        stream = torch.cuda.current_stream()

        def hand():
            s = t.to(device)
            dist.all_reduce(s)
            t.copy_(s)

        def steps():
            host.copy_(t)
            staged.copy_(host, non_blocking=True)
            dist.all_reduce(staged)
            host.copy_(staged, non_blocking=True)
            stream.synchronize()
            t.copy_(host)

        def pageable_steps():
            staged.copy_(t)
            dist.all_reduce(staged)
            t.copy_(staged)

        out = {}
        for name, installed, fn in (("hand", False, hand), ("steps_pinned", False, steps),
                                    ("steps_pageable", False, pageable_steps), ("shim", True, lambda: dist.all_reduce(t)),
                                    ("hand_again", False, hand), ("shim_again", True, lambda: dist.all_reduce(t))):
            offload_shim.install() if installed else offload_shim.uninstall()
            out[name] = best(fn, 200, 10) * 1e6
        offload_shim.install()
        say("small_us_per_call", out)
        profiled(lambda: [dist.all_reduce(t) for _ in range(2000)], 25)

    if wanted is None or "small_steps" in wanted:
        from offload_shim import _devices, _staging

        t = torch.zeros(())
        group = dist.group.WORLD
        slot = _staging._small_slot(device, t.nbytes)
        raw = dist.distributed_c10d.all_reduce
        offload_shim.uninstall()
        raw = dist.all_reduce

        def hand():
            s = t.to(device)
            raw(s)
            t.copy_(s)

        def direct():
            staged = slot.view(t)
            staged.copy_(t, non_blocking=True)
            raw(staged)
            t.data.copy_(staged)

        def direct_blocking_h2d():
            staged = slot.view(t)
            staged.copy_(t)
            raw(staged)
            t.data.copy_(staged)

        def decided():
            _devices.staging_device_for(t, group, "torch.distributed.all_reduce", 4)
            direct()

        def small_path():
            _staging.stage_small_in_place(t, device, raw, reads=True, writes=True)

        out = {}
        for _ in range(2):
            for name, installed, fn in (("hand", False, hand), ("direct", False, direct),
                                        ("direct_blocking_h2d", False, direct_blocking_h2d), ("decided", False, decided),
                                        ("stage_small_in_place", False, small_path),
                                        ("shim", True, lambda: dist.all_reduce(t))):
                offload_shim.install() if installed else offload_shim.uninstall()
                out[name] = min(out.get(name, 1e9), best(fn, 200, 8) * 1e6)
                out[name + "_cpu"] = min(out.get(name + "_cpu", 1e9), best(fn, 200, 8, time.thread_time) * 1e6)
        offload_shim.install()
        say("small_steps_us", out)

    if wanted is None or "pageable_timeline" in wanted:
        spent = {"host_copies": 0.0, "copy_after": 0.0, "agree": 0.0, "calls": 0}
        originals = (_staging.host_copies, _execute._copy_after, _execute._launch_agreement)

        def timed(key, fn):
            def run(*a, **k):
                start = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    spent[key] += time.perf_counter() - start
            return run

        _staging.host_copies = timed("host_copies", originals[0])
        _execute._copy_after = timed("copy_after", originals[1])
        _execute._launch_agreement = timed("agree", originals[2])
        t = torch.ones(64 * MiB)
        dist.all_reduce(t)
        total = float("inf")
        for _ in range(4):
            for key in spent:
                spent[key] = 0
            dist.barrier()
            torch.cuda.synchronize()
            start = time.perf_counter()
            dist.all_reduce(t)
            total = time.perf_counter() - start
        _staging.host_copies, _execute._copy_after, _execute._launch_agreement = originals
        say("pageable_256MiB_last_call_ms", {"total": total * 1e3, **{k: v * 1e3 for k, v in spent.items() if k != "calls"}})

    if wanted is None or "copies" in wanted:
        src = torch.ones(4 * MiB)  # 16 MiB pageable
        dst = torch.empty(4 * MiB, pin_memory=True)
        out = {}
        threads_default, piece_default = _staging.copy_threads, _staging.MIN_THREADED_COPY_BYTES
        for threads in (1, 4, 8, 16, 32):
            for piece in (1 * MiB, 4 * MiB):
                _staging.copy_threads = lambda threads=threads: threads
                _staging.MIN_THREADED_COPY_BYTES = piece
                state.copy_pool = None
                out[f"{threads}_threads_{piece >> 20}MiB_pieces"] = 16 * MiB / best(
                    lambda: _staging.host_copies([(dst, src)]), 20, 10, sync=False) / 1e9
        _staging.copy_threads, _staging.MIN_THREADED_COPY_BYTES = threads_default, piece_default
        state.copy_pool = None
        say("host_copy_16MiB_GBps", out)

    if wanted is None or "pageable" in wanted or "pinned" in wanted:
        default = _config.settings().chunk_bytes
        out = {}
        for pinned in (True, False):
            if wanted is not None and ("pinned" if pinned else "pageable") not in wanted:
                continue
            t = torch.ones(64 * MiB, pin_memory=pinned)  # 256 MiB
            for chunk in (8 * MiB, 16 * MiB, 32 * MiB, 64 * MiB):
                for slots in (2, 3):
                    offload_shim.configure(chunk_bytes=chunk)
                    _groups.SLOTS = slots
                    offload_shim.release_buffers()  # pools are made with the slots of their time
                    out[f"{'pinned' if pinned else 'pageable'}_{chunk >> 20}MiB_{slots}slots_ms"] = best(
                        lambda: dist.all_reduce(t), 1, 4) * 1e3
        _groups.SLOTS = 2
        offload_shim.release_buffers()
        offload_shim.configure(chunk_bytes=default)
        say("all_reduce_256MiB", out)
        if wanted is None or "pageable" in wanted:
            t = torch.ones(64 * MiB)
            dist.all_reduce(t)
            profiled(lambda: dist.all_reduce(t), 15)

    if wanted is None or "full_tensor" in wanted:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda", mesh_dim_names=("parts",))
        model = torch.nn.utils.skip_init(torch.nn.Linear, 16384, 8192, bias=False)
        fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
        default = _config.settings().chunk_bytes
        out = {}
        for chunk in (8 * MiB, 16 * MiB, 32 * MiB, 64 * MiB):
            offload_shim.configure(chunk_bytes=chunk)
            out[f"{chunk >> 20}MiB_ms"] = best(lambda: model.weight.full_tensor(), 1, 5) * 1e3
            offload_shim.release_buffers()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            model.weight.full_tensor()
            torch.cuda.synchronize()
            out[f"{chunk >> 20}MiB_peak_chunks"] = (torch.cuda.max_memory_allocated() - before) / chunk
        offload_shim.configure(chunk_bytes=default)
        say("full_tensor_512MiB", out)

    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
