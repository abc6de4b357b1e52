"""A child made by ``fork()`` after staged calls: it lives, its tables start empty, and what the parent's tables
held stays alive in it, never freed (freed in a child, the parent's pinned buffers, events and graphs reach the
CUDA runtime, which aborts a forked child: that part needs a GPU, ``tests/test_one_gpu.py``).

The staging path runs for real on Gloo ranks, forced through the host (``tests/fork_after_staging.py`` says what
each rank stages and which children it forks)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from interpreters import environment, python

SCRIPT = pathlib.Path(__file__).with_name("fork_after_staging.py")


def run_fork_script(world_size: int, *options: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``tests/fork_after_staging.py`` on ``world_size`` ranks under torchrun, with one intra-op thread a rank (as
    torchrun sets where it starts several: a child forked after torch's own OpenMP ran threaded hangs in its first
    parallel op, with or without the shim), every rank forking its children; returns the finished process, having
    checked that every rank printed ``OK``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world_size),
               str(SCRIPT), *options]
    result = subprocess.run(command, env=environment({"OMP_NUM_THREADS": "1"}), capture_output=True, text=True,
                            timeout=timeout)
    oks = [line for line in result.stdout.splitlines() if line.startswith("OK rank")]
    assert result.returncode == 0 and len(oks) == world_size, (
        f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-6000:]}")
    return result


def test_children_forked_after_staged_calls_of_every_mode_live():
    """Two ranks stage calls of every mode the host form has (small, whole, pipelined, asynchronous, a registered
    communicator), then fork: bare children (one forked while an asynchronous staged call is outstanding, one that
    stages on a group of its own from empty counters) exit 0, and a fork DataLoader with two workers gives two
    epochs; the parents' later staged calls are right."""
    result = run_fork_script(2, "--backend", "gloo", "--stage-through", "cpu")
    assert "modes pipelined, small, whole" in result.stdout, result.stdout


def test_a_forked_child_starts_empty_and_keeps_what_its_parent_held():
    """After staged calls of every mode (with a pool, a small-call slot, a lane, an outstanding asynchronous call, a
    handle dropped unwaited), a forked child finds every table of the shim empty, and every object those tables
    held still alive after a garbage collection, never freed; a parent's handle the child drops is kept, not given
    to the child's writer of dropped handles. The parent's outstanding call completes, as without the fork."""
    python(
        """
        import datetime, gc, os, weakref
        import torch, torch.distributed as dist
        import offload_shim
        from offload_shim import _execute, _groups, _replay, _staging
        from offload_shim._state import state
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(__import__("socket").create_server(("127.0.0.1", 0)).getsockname()[1]))
        dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
        offload_shim.configure(staging_device="cpu", always_stage=True, chunk_bytes="64KiB")
        dist.all_reduce(torch.ones(3))  # small: this thread's slot
        dist.all_reduce(torch.ones(1 << 16))  # pipelined: a pool, the group's lanes
        dist.all_reduce(torch.ones(1 << 16), async_op=True).wait()
        dist.all_reduce(torch.ones(100), async_op=True)  # whole, asynchronous, dropped unwaited
        outstanding = torch.ones(1 << 16)
        work = dist.all_reduce(outstanding, async_op=True)  # pipelined, outstanding at the fork
        held = [torch.ones(1 << 10)]
        kept = dist.all_reduce(held[0], async_op=True)  # a handle the child drops
        parents = [weakref.ref(p) for idle in state.idle_pools.values() for p in idle]
        parents += [weakref.ref(s) for s in state.thread.slots.values()]
        parents += [weakref.ref(s) for s in list(state.groups.values())]
        assert len(parents) >= 3, parents
        assert state.pending_writes, "no outstanding call at the fork"
        pid = os.fork()
        if pid == 0:
            code = 0
            del kept  # a parent's handle dropped in the child
            gc.collect()
            tables = {"pools": dict(state.idle_pools), "busy": list(state.busy_pools), "states": dict(state.groups),
                      "answers": dict(state.host_answers), "slots": dict(state.thread.slots),
                      "pending": dict(state.pending_writes), "captures": dict(state.captures),
                      "agreements": dict(state.agreements), "copy threads": state.copy_pool,
                      "counters": offload_shim.staging_counters()}
            full = [name for name, table in tables.items() if table]
            if full or not state.unwaited.empty():
                print("not empty in the child:", full, state.unwaited.qsize())
                code = 1
            freed = [ref for ref in parents if ref() is None]
            if freed:
                print("freed in the child:", freed)
                code = 2
            os._exit(code)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        assert status == 0, status
        work.wait()
        kept.wait()
        assert torch.equal(outstanding, torch.ones(1 << 16)) and torch.equal(held[0], torch.ones(1 << 10))
        dist.destroy_process_group()
        """,
        env={"OMP_NUM_THREADS": "1"},
    )
