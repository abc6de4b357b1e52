"""What offload_shim reports of the calls it stages (issue 9, item 3), on CPU ranks over Gloo forced to stage
through the CPU (``configure(staging_device="cpu", always_stage=True)``): the counters of
``offload_shim.staging_counters()`` for every family of staged call, the INFO line at the first staged call from each
line of code, and the table ``OFFLOAD_SHIM_SUMMARY`` prints at exit (its printing at exit by rank 0 only, for real,
rides on the torchrun test of tests/test_activation.py)."""

from __future__ import annotations

import contextlib
import logging
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import offload_shim
from observe import configured
from offload_shim import _counters
from offload_shim._state import state
import versions

THIS_MODULE = sys.modules[__name__]
COMPILED = torch.ops._c10d_functional  # the ops compiled code calls, with offload_shim's CPU kernels
FUNCTION_CALLS = []


def local_double(tensor):
    """A module-level function registered as a communicator (on ``cpu``): doubles ``tensor`` in place."""
    FUNCTION_CALLS.append(tensor)
    tensor.mul_(2)


@contextlib.contextmanager
def forced(**settings):
    """The shim installed, every CPU tensor staged through the CPU, chunks of 64 bytes (two chunks: 128 bytes)."""
    offload_shim.install()
    with configured(staging_device="cpu", always_stage=True, chunk_bytes=64, **settings):
        yield


@contextlib.contextmanager
def first_call_lines():
    """Yields the list that the messages of the INFO lines for first staged calls are appended to."""
    logger = logging.getLogger("offload_shim")
    lines, level = [], logger.level

    class Lines(logging.Handler):
        def emit(self, record):
            if record.levelno == logging.INFO and record.getMessage().startswith("offload_shim: first staged call"):
                lines.append(record.getMessage())

    handler = Lines()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


# ---------------------------------------------------------------- checks run inside the ranks


def register_local_double():
    """``local_double`` as a communicator working on the CPU (registering it again replaces its settings)."""
    offload_shim.register_communicator(
        THIS_MODULE, "local_double", device=lambda _: torch.device("cpu"), reads="tensor", writes="tensor"
    )


def check_counters():
    """One or more calls of every family, staged; the counters hold exactly their calls and bytes, per collective,
    route and mode; the served path counts nothing; reset returns what it cleared."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))  # made before anything is staged: its set-up is not counted
    solo = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pair", "solo"))["solo"]  # one rank: no collective
    register_local_double()
    offload_shim.reset_staging_counters()
    with forced():
        for _ in range(2):
            dist.all_reduce(torch.ones(4))  # small: 16 bytes, twice
        dist.all_reduce(torch.ones(4), async_op=True).wait()  # asynchronous: staged whole
        dist.all_reduce(torch.ones(40))  # 160 bytes, two chunks or more: pipelined
        dist.broadcast(torch.ones(3), src=0)
        with pytest.raises(RuntimeError):  # Gloo has no AVG: raised, and counted
            dist.all_reduce(torch.ones(2, dtype=torch.int8), op=dist.ReduceOp.AVG)
        dist.all_gather([torch.zeros(4), torch.zeros(4)], torch.ones(4))  # input and outputs: 48 bytes
        if rank == 0:
            dist.send(torch.ones(5), 1)
        else:
            dist.recv(torch.zeros(5), 0)
        ring = [dist.P2POp(dist.isend, torch.ones(2), peer), dist.P2POp(dist.irecv, torch.zeros(2), peer)]
        for work in dist.batch_isend_irecv(ring):
            work.wait()
        # The functional collectives and DTensor reach the ops' CPU kernels, which count them by the op.
        funcol.all_reduce(torch.ones(6), "sum", dist.group.WORLD)  # the input only: the result is new
        versions.all_gather_single(torch.ones(3), 0, dist.group.WORLD)
        DTensor.from_local(torch.ones(2, 2), mesh, [Shard(0)], run_check=False).full_tensor()  # under 2 chunks
        DTensor.from_local(torch.ones(16, 2), mesh, [Shard(0)], run_check=False).full_tensor()  # output 256 bytes
        # On a one-rank mesh torch's full_tensor communicates nothing, and is left to torch: not counted.
        assert torch.equal(DTensor.from_local(torch.ones(16, 2), solo, [Shard(0)]).full_tensor(), torch.ones(16, 2))
        COMPILED.wait_tensor(COMPILED.all_reduce(torch.ones(2), "sum", dist.group.WORLD.group_name))
        local_double(torch.ones(7))
        with configured(always_stage=False, route_min_bytes=64):
            # Routing pays only through an accelerator on another backend: on a Gloo group with the CPU to stage
            # through, a call above the threshold is served by Gloo, not counted.
            dist.all_reduce(torch.ones(16))
            funcol.all_reduce(torch.ones(16), "sum", dist.group.WORLD)
        with configured(always_stage=False):  # the served path: nothing counted
            dist.all_reduce(torch.ones(4))
            dist.all_gather([torch.zeros(4), torch.zeros(4)], torch.ones(4))
            funcol.wait_tensor(funcol.all_reduce(torch.ones(6), "sum", dist.group.WORLD))
            DTensor.from_local(torch.ones(2, 2), mesh, [Shard(0)], run_check=False).full_tensor()
    counters = offload_shim.staging_counters()
    c10d, ops = "torch.distributed.", "torch.ops._c10d_functional."
    expected = {
        (c10d + "all_reduce", "forced", "small"): (3, 16 + 16 + 2),
        (c10d + "all_reduce", "forced", "whole"): (1, 16),
        (c10d + "all_reduce", "forced", "pipelined"): (1, 160),
        (c10d + "broadcast", "forced", "small"): (1, 12),
        (c10d + "all_gather", "forced", "whole"): (1, 48),
        (c10d + ("send" if rank == 0 else "recv"), "forced", "whole"): (1, 20),
        (c10d + "batch_isend_irecv", "forced", "whole"): (1, 16),
        (ops + "all_reduce", "forced", "whole"): (2, 24 + 8),  # the functional all_reduce, the compiled one
        (ops + "all_gather_into_tensor", "forced", "whole"): (2, 12 + 16),  # all_gather_single, the small DTensor
        (ops + "all_gather_into_tensor", "forced", "pipelined"): (1, 128),  # the DTensor of two chunks
        (f"{__name__}.local_double", "forced", "whole"): (1, 28),
    }
    assert {key: (c.calls, c.bytes) for key, c in counters.items()} == expected
    assert list(counters) == sorted(expected), "sorted by collective, route and mode"
    assert all(c.seconds > 0 for c in counters.values()), counters
    key = next(iter(counters))
    assert (key.op, key.route, key.mode) == key and counters[tuple(key)] is counters[key]
    with pytest.raises(TypeError):
        counters[key] = counters[key]  # a read-only snapshot
    # A snapshot does not move; reset returns what it cleared.
    with forced():
        dist.all_reduce(torch.ones(4))
    small = (c10d + "all_reduce", "forced", "small")
    assert counters[small].calls == 3
    cleared = offload_shim.reset_staging_counters()
    assert cleared[small].calls == 4 and set(cleared) == set(expected)
    assert offload_shim.staging_counters() == {}


def check_first_staged_call_of_each_line_is_logged():
    """One INFO line the first time a line of code stages a collective, naming that line (the caller's, past
    offload_shim, wrapt and torch), the collective, bytes, route, mode, why and the staging device; nothing more for
    later calls of that collective from that line; nothing while the logger is not enabled for INFO."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2,))
    register_local_double()  # whichever check these ranks ran first
    where = f"{check_first_staged_call_of_each_line_is_logged.__code__.co_filename}:"
    group = "group '0' (default_pg) with backend gloo serves cpu, cuda"
    with forced():
        before = sys._getframe().f_lineno
        dist.all_reduce(torch.ones(4))  # not logged: the logger is not enabled for INFO
        with first_call_lines() as lines:
            for _ in range(2):
                dist.all_reduce(torch.ones(4))  # two calls from one line: one log line
            dist.all_reduce(torch.ones(4))  # another line: logged
            dist.all_reduce(torch.ones(40))
            getattr(funcol, "all_gather_single", funcol.all_gather_tensor)(torch.ones(3), 0, dist.group.WORLD)
            COMPILED.wait_tensor(COMPILED.all_reduce(torch.ones(2), "sum", dist.group.WORLD.group_name))
            DTensor.from_local(torch.ones(16, 2), mesh, [Shard(0)], run_check=False).full_tensor()
            with configured(route_min_bytes=64):  # above the threshold, forced: the route says so, not routed
                dist.all_reduce(torch.ones(16))
            dist.all_reduce(torch.ones(4), async_op=True).wait()
            local_double(torch.ones(7))
            [dist.all_reduce(torch.ones(1)), dist.broadcast(torch.ones(1), 0), dist.all_reduce(torch.ones(1))]
    forced_small = f"torch.distributed.all_reduce, 16 B, route forced (always_stage; {group}), mode small, through cpu"
    return lines, [
        f"offload_shim: first staged call at {where}{before + 4}: {forced_small}",
        f"offload_shim: first staged call at {where}{before + 5}: {forced_small}",
        f"offload_shim: first staged call at {where}{before + 6}: torch.distributed.all_reduce, 160 B, "
        f"route forced (always_stage; {group}), mode pipelined, through cpu",
        f"offload_shim: first staged call at {where}{before + 7}: "
        f"torch.ops._c10d_functional.all_gather_into_tensor, 12 B, "
        f"route forced (always_stage; {group}), mode whole, through cpu",
        f"offload_shim: first staged call at {where}{before + 8}: torch.ops._c10d_functional.all_reduce, 8 B, "
        f"route forced (always_stage; {group}), mode whole, through cpu",
        f"offload_shim: first staged call at {where}{before + 9}: torch.ops._c10d_functional.all_gather_into_tensor, 128 B, "
        f"route forced (always_stage; {group}), mode pipelined, through cpu",
        f"offload_shim: first staged call at {where}{before + 11}: torch.distributed.all_reduce, 64 B, "
        f"route forced (always_stage; {group}), mode small, through cpu",
        f"offload_shim: first staged call at {where}{before + 12}: torch.distributed.all_reduce, 16 B, "
        f"route forced (always_stage; {group}), mode whole, through cpu",
        f"offload_shim: first staged call at {where}{before + 13}: {__name__}.local_double, 28 B, "
        f"route forced (always_stage; the communicator works on cpu), mode whole, through cpu",
        f"offload_shim: first staged call at {where}{before + 14}: torch.distributed.all_reduce, 4 B, "
        f"route forced (always_stage; {group}), mode small, through cpu",
        f"offload_shim: first staged call at {where}{before + 14}: torch.distributed.broadcast, 4 B, "
        f"route forced (always_stage; {group}), mode small, through cpu",
    ]


# ---------------------------------------------------------------- the tests


def test_counters_of_every_staged_family(gloo_ranks):
    gloo_ranks.run(check_counters)


def test_first_staged_call_of_each_line_is_logged(gloo_ranks):
    for lines, expected in gloo_ranks.run(check_first_staged_call_of_each_line_is_logged):
        assert lines == expected


def test_summary_table():
    C = _counters.StagingCount
    counters = {
        _counters.StagingKey("DTensor.full_tensor", "routed", "pipelined"): C(2, 3 << 30, 1.25),
        _counters.StagingKey("torch.distributed.all_reduce", "staged", "small"): C(1000, 4000, 0.0555),
    }
    assert _counters.summary(counters, rank="0").splitlines()[1:] == [
        "op                            route   mode       calls    bytes   seconds",
        "DTensor.full_tensor           routed  pipelined      2  3.0 GiB  1.250000",
        "torch.distributed.all_reduce  staged  small       1000  3.9 KiB  0.055500",
        "total                                             1002  3.0 GiB  1.305500",
    ]
    assert [_counters.format_bytes(n) for n in (0, 1023, 1024, 1536 << 10, 5 << 40)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 MiB", "5120.0 GiB",
    ]


def test_summary_at_exit_on_rank_0_only(monkeypatch, capsys):
    """What the exit handler prints, by RANK and setting (the handler itself runs at exit in the torchrun test)."""
    import os

    pid = os.getpid()
    counters = {("torch.distributed.all_reduce", "forced", "small"): (2, 32, 0.5)}
    rows = [
        "op                            route   mode   calls  bytes   seconds",
        "torch.distributed.all_reduce  forced  small      2   32 B  0.500000",
        "total                                            2   32 B  0.500000",
    ]
    for rank, table, summary_at_exit, expected in (
        ("0", {}, True, [f"offload_shim: no call was staged on rank 0 (pid {pid})"]),
        ("0", counters, True, [f"offload_shim: staged calls on rank 0 (pid {pid}):", *rows]),
        (None, counters, True, [f"offload_shim: staged calls on pid {pid}:", *rows]),
        (None, {}, True, []),  # no RANK and nothing staged: a launcher (torchrun's), silent
        ("1", counters, True, []),
        ("0", counters, False, []),
    ):
        if rank is None:
            monkeypatch.delenv("RANK", raising=False)
        else:
            monkeypatch.setenv("RANK", rank)
        monkeypatch.setattr(state, "counters", dict(table))
        monkeypatch.setattr(state, "tallies", [])
        with configured(summary_at_exit=summary_at_exit):
            _counters._summary_at_exit()
        assert capsys.readouterr().err == "".join(line + "\n" for line in expected), (rank, table, summary_at_exit)
    # Calls counted only in a replayed capture's tally (the table reset since): staged, so printed.
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(state, "counters", {})
    monkeypatch.setattr(state, "tallies", [(("torch.distributed.all_reduce", "forced", "small"), 16, [2, 0.5],
                                                 [0, 0.0])])
    with configured(summary_at_exit=True):
        _counters._summary_at_exit()
    assert capsys.readouterr().err == "".join(line + "\n" for line in (f"offload_shim: staged calls on pid {pid}:", *rows))


def test_lock_free_tallies_lose_no_call():
    """Counters that one thread each adds to without the lock (a replayed small call's, whose capture belongs to
    one thread): with four threads adding while another resets the counters again and again, the resets and the
    last reading count every call once, bytes and seconds included; a folded tally stays counted."""
    import threading

    offload_shim.reset_staging_counters()
    op, calls, threads = "test.tally", 50000, 4
    tallies = [_counters.tally(op, _counters.STAGED, _counters.REPLAYED, 8) for _ in range(threads)]
    done = threading.Event()

    def add(counts):
        for _ in range(calls):
            counts[0] += 1
            counts[1] += 0.5

    def ours(counters):
        return [count for key, count in counters.items() if key.op == op]

    readings = []

    def reset_often():
        while not done.is_set():
            readings.extend(ours(offload_shim.reset_staging_counters()))

    resetter = threading.Thread(target=reset_often)
    workers = [threading.Thread(target=add, args=(counts,)) for counts in tallies]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two bytecodes: a lost update would show
    try:
        resetter.start()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        done.set()
        resetter.join()
        sys.setswitchinterval(interval)
    tallies[0][0] += 3  # three more calls, then dropped (as a retired capture's tally): they stay counted
    tallies[0][1] += 1.5
    _counters.fold(tallies[0])
    tallies[0][0] += 1  # (no longer read)
    readings.extend(ours(offload_shim.staging_counters()))
    total = calls * threads + 3
    assert sum(r.calls for r in readings) == total, readings
    assert sum(r.bytes for r in readings) == 8 * total
    assert sum(r.seconds for r in readings) == 0.5 * total
    assert len(readings) > 1  # (the resets ran beside the adding threads)
    offload_shim.reset_staging_counters()
    for counts in tallies[1:]:
        _counters.fold(counts)
    assert ours(offload_shim.staging_counters()) == []
