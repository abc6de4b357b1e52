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
            tables = {"pools": dict(state.idle_pools), "busy": list(state.busy_pools), "records": dict(state.groups), "slots": dict(state.thread.slots),
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


def test_a_fork_waits_for_an_install_under_way_in_another_thread():
    """A thread is part way through ``install()`` (held for half a second after its fifth binding, inside the
    patching lock) when the main thread forks: the fork waits for it, and the child has every wrapper and kernel the
    parent has; likewise for ``uninstall()``, after which the child has none. Unchecked, the child was left with 4
    of 40 wrappers, and ``install()`` there changed nothing."""
    python(
        """
        import os, sys, threading, time
        import torch, torch.distributed._functional_collectives
        import offload_shim
        from offload_shim import _kernels, _patching
        offload_shim.uninstall()
        for step in (offload_shim.install, offload_shim.uninstall):
            paused, count = threading.Event(), [0]
            def tracer(frame, event, arg):
                if event == "call" and frame.f_code in (_patching._apply.__code__, _patching._remove.__code__):
                    count[0] += 1
                    if count[0] == 5:
                        paused.set()
                        time.sleep(0.5)
            def run(step=step):
                sys.settrace(tracer)
                step()
                sys.settrace(None)
            thread = threading.Thread(target=run)
            thread.start()
            assert paused.wait(30)
            pid = os.fork()
            if pid == 0:
                os._exit(10 * offload_shim.is_installed() + (len(offload_shim.wrapped_functions()) > 0)
                         + 2 * _kernels.is_installed())
            thread.join()
            expected = 13 if step is offload_shim.install else 0
            status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            assert status == expected, (step.__name__, status, expected)
        """,
        env={"OMP_NUM_THREADS": "1", "OFFLOAD_SHIM": "0"},
    )


def test_a_child_forked_during_a_hooked_import_imports():
    """A thread is importing a module the shim wraps when imported, inside wrapt's notification with wrapt's lock
    held, when the main thread forks: the fork waits for it, and the child's own first import of a new module returns.
    Unchecked, the child waited for wrapt's lock for ever."""
    python(
        """
        import os, sys, threading, time
        import torch, offload_shim
        import wrapt.importer
        lock, paused = wrapt.importer._post_import_hooks_lock, threading.Event()
        def held(frame, event, arg):  # a line of wrapt's notify_module_loaded run with its lock held
            if event == "line" and lock._is_owned() and not paused.is_set():
                paused.set()
                time.sleep(0.5)
                return None
            return held
        def tracer(frame, event, arg):
            return held if frame.f_code is wrapt.importer.notify_module_loaded.__code__ else None
        def run():
            sys.settrace(tracer)
            import torch.distributed._functional_collectives
            sys.settrace(None)
        thread = threading.Thread(target=run)
        thread.start()
        assert paused.wait(60)
        pid = os.fork()
        if pid == 0:
            import json.tool, fractions  # (not imported before)
            os._exit(0)
        thread.join()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            raise AssertionError("the child's import waited for ever")
        assert os.waitstatus_to_exitcode(status) == 0, status
        """,
        env={"OMP_NUM_THREADS": "1"},
    )


def test_a_forked_child_prints_no_summary_of_its_own():
    """``OFFLOAD_SHIM_SUMMARY`` on rank 0: a child made by ``fork()`` that exits through the interpreter prints no
    table (the rank's table is its parent's, printed once, at the parent's exit)."""
    result = python(
        """
        import os, sys
        import offload_shim
        if os.fork() == 0:
            sys.exit(0)
        os.wait()
        """,
        env={"OMP_NUM_THREADS": "1", "OFFLOAD_SHIM_SUMMARY": "1", "RANK": "0"},
    )
    assert result.stderr.count("offload_shim") == 1, result.stderr
