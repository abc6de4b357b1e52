"""The patch matrix, each case in a fresh interpreter: import then patch, patch then import, patch twice,
unpatch and repatch; every spelling of a wrapped function, and exact restoration."""

from __future__ import annotations

import pytest

from interpreters import REPORT, python

ALL_WRAPPED = "c10d=True funcol=True kernels=True"


def last_line(result) -> str:
    return result.stdout.strip().splitlines()[-1]


def test_import_then_patch():
    out = python("import torch.distributed.tensor\nimport offload_shim", REPORT)
    assert last_line(out) == ALL_WRAPPED


def test_patch_then_import():
    out = python(
        """
        import sys, offload_shim
        assert "torch.distributed._functional_collectives" not in sys.modules
        """,
        REPORT,
        "import torch.distributed.tensor",
        REPORT,
    )
    before, after = out.stdout.strip().splitlines()[-2:]
    assert before == "c10d=True funcol=None kernels=True"
    assert after == ALL_WRAPPED


def test_patch_twice_changes_nothing():
    python(
        """
        import torch.distributed.tensor, offload_shim
        first = offload_shim.wrapped_functions()
        offload_shim.install()
        offload_shim.install()
        second = offload_shim.wrapped_functions()
        assert first.keys() == second.keys() and all(first[k] is second[k] for k in first)
        """
    )


def test_unpatch_and_repatch():
    out = python(
        "import offload_shim\noffload_shim.uninstall()",
        REPORT,
        "import torch.distributed.tensor  # imported while uninstalled: its post-import hook must not wrap",
        REPORT,
        "offload_shim.install()",
        REPORT,
        "offload_shim.uninstall()\noffload_shim.uninstall()",
        REPORT,
    )
    assert out.stdout.strip().splitlines()[-4:] == [
        "c10d=False funcol=None kernels=False",
        "c10d=False funcol=False kernels=False",
        ALL_WRAPPED,
        "c10d=False funcol=False kernels=False",
    ]


def test_every_spelling_wrapped_and_restored():
    python(
        """
        import sys, types
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d
        import torch.distributed._functional_collectives as funcol
        import torch.distributed.tensor._collective_utils as collective_utils
        from torch.distributed.tensor import DTensor

        import offload_shim  # installs; uninstalled at once, so that what follows is bound before the shim
        offload_shim.uninstall()
        from offload_shim import _wrappers
        names = [t.name for t in _wrappers.TARGETS if t.owner is None and t.module == _wrappers.C10D_MODULE]
        originals = {name: getattr(c10d, name) for name in names if hasattr(c10d, name)}
        assert len(originals) >= 19, sorted(originals)  # (2.13 adds all_gather_single and reduce_scatter_single)
        funcol_originals = {name: vars(funcol)[name] for name in ("all_reduce", "all_gather_single", "reduce_scatter_single")
                            if name in vars(funcol)}
        assert collective_utils.broadcast is originals["broadcast"]  # bound by name before the shim

        early = types.ModuleType("user_module_early")
        exec("from torch.distributed import all_reduce", early.__dict__)
        sys.modules[early.__name__] = early

        import wrapt
        offload_shim.install()
        wrappers = offload_shim.wrapped_functions()
        for name in originals:
            wrapper = wrappers["torch.distributed.distributed_c10d." + name]
            assert isinstance(wrapper, wrapt.FunctionWrapper)
            assert getattr(dist, name) is wrapper and getattr(c10d, name) is wrapper  # one object, every name
            assert wrapper.__wrapped__ is originals[name]
        assert collective_utils.broadcast is dist.broadcast
        assert early.all_reduce is dist.all_reduce
        for name in funcol_originals:
            assert vars(funcol)[name] is wrappers["torch.distributed._functional_collectives." + name]
        # DTensor's own methods are torch's: its collectives reach the shim as the functional ops' kernels.
        assert not isinstance(vars(DTensor)["full_tensor"], wrapt.FunctionWrapper)

        late = types.ModuleType("user_module_late")  # imported while installed: binds the wrapper
        exec("from torch.distributed import broadcast", late.__dict__)
        sys.modules[late.__name__] = late
        assert late.broadcast is dist.broadcast

        offload_shim.uninstall()
        assert offload_shim.wrapped_functions() == {}
        for name, original in originals.items():
            assert getattr(dist, name) is original and getattr(c10d, name) is original
        assert collective_utils.broadcast is originals["broadcast"]
        assert early.all_reduce is originals["all_reduce"] and late.broadcast is originals["broadcast"]
        assert all(vars(funcol)[name] is original for name, original in funcol_originals.items())
        """
    )


def test_install_again_binds_the_same_wrappers():
    """install() after uninstall() binds the very wrappers the first install made, where what they wrap is the
    same: compiled code that guards on the function it calls compiles two graphs (installed, and not) however many
    install cycles it sees, not one a cycle until Dynamo's recompile limit."""
    out = python(
        """
        import socket, torch, torch._dynamo, torch.distributed as dist, offload_shim
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        first = dist.all_reduce
        offload_shim.uninstall(); offload_shim.install()
        assert dist.all_reduce is first
        assert offload_shim.wrapped_functions()["torch.distributed.distributed_c10d.all_reduce"] is first

        @torch.compile(backend="eager", fullgraph=True)
        def step(x):
            y = x * 2
            dist.all_reduce(y)
            return y + 1

        results = []
        for cycle in range(12):  # (past Dynamo's default recompile limit of 8)
            (offload_shim.install if cycle % 2 == 0 else offload_shim.uninstall)()
            results.append(step(torch.ones(2)).tolist())
        print(torch._dynamo.utils.counters["stats"]["unique_graphs"], results == [[3.0, 3.0]] * 12)
        dist.destroy_process_group()
        """
    )
    assert out.stdout.split()[-2:] == ["2", "True"], out.stdout


def test_install_and_uninstall_run_one_at_a_time_whole():
    """An uninstall() called while another thread's install() is part way (its kernels not yet registered) waits
    for it, and then removes everything: never the wrappers of one and the kernels of the other."""
    python(
        """
        import threading, warnings, offload_shim
        from offload_shim import _kernels
        original = warnings.warn
        offload_shim.uninstall()
        inside, go = threading.Event(), threading.Event()
        real = _kernels.install
        def slow_install():
            inside.set(); go.wait(5); real()
        _kernels.install = slow_install
        installing = threading.Thread(target=offload_shim.install); installing.start()
        assert inside.wait(5)
        removing = threading.Thread(target=offload_shim.uninstall); removing.start()
        removing.join(0.5)
        assert removing.is_alive()  # waits for the install under way
        go.set(); installing.join(5); removing.join(5)
        state = (offload_shim.is_installed(), _kernels.is_installed(), warnings.warn is original)
        assert state == (False, False, True), state
        """
    )


def test_a_child_forked_while_a_lock_is_held_installs_and_imports():
    """A child forked while other threads of the parent hold the shim's locks (inside install(), a post-import
    hook, the kernels' registration, the counters) neither waits for them at its first import, at install() nor at
    staging_counters(); and it counts its own staged calls, not its parent's."""
    python(
        """
        import os, threading, time, offload_shim
        from offload_shim import _kernels, _patching
        from offload_shim._state import state
        held, release = threading.Event(), threading.Event()
        def hold():
            with state.patching_lock, state.kernels_lock:
                held.set(); release.wait(30)
        threading.Thread(target=hold, daemon=True).start()
        assert held.wait(5)
        from offload_shim import _counters
        held_counters = threading.Thread(target=lambda: state.counters_lock.acquire() and release.wait(30), daemon=True)
        held_counters.start(); time.sleep(0.2)
        state.counters[("torch.distributed.all_reduce", "staged", "whole")] = [3, 12, 0.1]  # the parent's
        pid = os.fork()
        if pid == 0:
            import torch.distributed._functional_collectives  # (its post-import hook takes the patching lock)
            offload_shim.uninstall(); offload_shim.install()
            counted = offload_shim.staging_counters()  # (takes the counters' lock)
            os._exit(0 if offload_shim.is_installed() and not counted else 1)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not os.waitpid(pid, os.WNOHANG)[0]:
            time.sleep(0.05)
        else:
            if time.monotonic() >= deadline:
                os.kill(pid, 9)
                raise AssertionError("the child waited for a lock its parent's thread held")
        release.set()
        """
    )


def test_a_forked_child_runs_each_reset_once_on_a_renewed_state():
    """In a forked child the process's state is renewed in place (the same object, every table new) before each
    reset marked with ``after_fork`` runs, once; the parent keeps its own."""
    python(
        """
        import os
        from offload_shim import _state
        from offload_shim._state import state
        runs = []
        def probe():
            runs.append(state.copy_pool)
        _state.after_fork(probe)
        state.copy_pool = "the parent's copy threads"
        pid = os.fork()
        if pid == 0:
            os._exit(10 + len(runs) if runs == [None] and _state.state is state else 1)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        assert status == 11 and state.copy_pool == "the parent's copy threads", status
        state.copy_pool = None
        """
    )

def test_a_forked_child_finishes_its_own_dropped_handles():
    """A child forked after the parent's writer of dropped handles started makes its own (the parent's thread is not
    in the child): a handle the child drops unwaited still writes. Unchecked, the child's call was never finished."""
    python(
        """
        import os, time
        from offload_shim import _staging
        class Done:  # a collective's work that has completed
            def wait(self, timeout=None):
                return True
            def is_completed(self):
                return True
        written = []
        _staging.StagedWork([Done()], lambda: written.append("parent"), [])  # starts the writer; dropped
        deadline = time.monotonic() + 30
        while not written and time.monotonic() < deadline:
            time.sleep(0.01)
        assert written == ["parent"], written
        pid = os.fork()
        if pid == 0:
            _staging.StagedWork([Done()], lambda: written.append("child"), [])  # dropped at once
            deadline = time.monotonic() + 30
            while len(written) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            os._exit(0 if written == ["parent", "child"] else 1)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        assert status == 0, status
        """
    )


def test_warnings_warn_is_the_standard_librarys_while_installed():
    """The shim replaces no function of the standard library: ``warnings.warn`` is the one the process had, while
    installed, after a staged call, and after ``uninstall()``."""
    out = python(
        """
        import datetime, os, warnings
        original = warnings.warn
        import torch, torch.distributed as dist, offload_shim
        assert offload_shim.is_installed() and warnings.warn is original
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(__import__("socket").create_server(("127.0.0.1", 0)).getsockname()[1]))
        dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
        offload_shim.configure(staging_device="cpu", always_stage=True)
        dist.all_reduce(torch.ones(3))
        assert offload_shim.staging_counters() and warnings.warn is original
        offload_shim.uninstall()
        assert warnings.warn is original
        dist.destroy_process_group()
        print("ok")
        """
    )
    assert out.stdout.strip() == "ok"


SINGLE_RANK = """
import logging, torch, torch.distributed as dist, offload_shim
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
copies = []
class Recorder(logging.Handler):
    def emit(self, record):  # the staging decisions (not the first staged call of each line, at INFO)
        if hasattr(record, "offload_shim_device"):
            copies.append(record.offload_shim_device)
logging.getLogger("offload_shim").addHandler(Recorder())
logging.getLogger("offload_shim").setLevel(logging.DEBUG)
offload_shim.configure(staging_device="cpu", always_stage=True)
"""
# A Gloo group left alive at interpreter exit can abort it ("terminate called without an active exception").
TEARDOWN = "dist.destroy_process_group()"


def test_calls_inside_a_staged_call_are_not_staged_again():
    python(
        SINGLE_RANK,
        """
        import torch.distributed._functional_collectives as funcol
        funcol.all_gather_tensor(torch.ones(2), 0, dist.group.WORLD)  # calls all_gather_single by name
        assert copies == ["cpu"], copies
        """,
        TEARDOWN,
    )


@pytest.mark.parametrize("uninitialized_call", ["dist.all_reduce(torch.ones(2))", "dist.broadcast(torch.ones(2), 0)"])
def test_without_a_process_group_torch_raises_its_own_error(uninitialized_call):
    out = python(
        f"""
        import torch, torch.distributed as dist, offload_shim
        try:
            {uninitialized_call}
        except Exception as exc:
            print(type(exc).__name__, exc)
        """
    )
    assert "Default process group has not been initialized" in out.stdout


def _every_op(kept_from_install: bool) -> dict:
    """Each collective of the contracts, called once in this rank with staging forced through the CPU, the shim
    uninstalled: the staging decisions it made and the bits of its tensors, by op. ``kept_from_install``: called
    through the wrappers kept from an install, as code that held them (a variable, a module outside ``sys.modules``)
    calls them; else through torch's own functions. And whether each wrapper stages while installed (the control)."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import contracts
    import offload_shim
    from observe import configured, recording_staging

    offload_shim.install()
    spaces = {"torch.distributed.distributed_c10d.": dist, "torch.distributed._functional_collectives.": funcol}
    kept = {(space, name[len(prefix):]): wrapper for name, wrapper in offload_shim.wrapped_functions().items()
            for prefix, space in spaces.items() if name.startswith(prefix) and "." not in name[len(prefix):]}
    world = dist.get_world_size()

    def run(op: str) -> tuple:
        splits = ()
        if op.endswith(("all_to_all_single", "all_to_all_single_autograd")):
            splits = tuple(tuple((i + j) % 3 for j in range(world)) for i in range(world))
        elif op == "all_gather_uneven":
            splits = (4,) * world  # (Gloo gathers equal sizes only)
        call = contracts.Call(op=op, dtype="float32", shape=(4,), layout="offset", reduce="sum" if "." in op else
                              "SUM", root=world - 1, async_op=False, seed=11, splits=splits)
        make = contracts._Tensors(call, torch.device("cpu"), host=True)
        with configured(staging_device="cpu", always_stage=True), recording_staging() as devices:
            work, results = contracts._launch(call, make, False)
            contracts._wait(work)
            results = contracts._finish(results)
        return list(devices), [t.view(torch.int32).tolist() for t in [*make.tensors(), *results]]

    staged = {op: bool(run(op)[0]) for op in contracts.OPS}
    offload_shim.uninstall()
    try:
        if kept_from_install:
            for (space, name), wrapper in kept.items():
                setattr(space, name, wrapper)
        outcome = {}
        for op in contracts.OPS:
            if op == "batch_isend_irecv" and kept_from_install:  # (its P2POps hold torch's isend, as made now)
                dist.isend, dist.irecv = kept[dist, "isend"].__wrapped__, kept[dist, "irecv"].__wrapped__
            outcome[op] = run(op)
            if op == "batch_isend_irecv" and kept_from_install:
                dist.isend, dist.irecv = kept[dist, "isend"], kept[dist, "irecv"]
    finally:
        for (space, name), wrapper in kept.items():
            setattr(space, name, wrapper.__wrapped__)
        offload_shim.install()
    return staged, outcome


def test_wrappers_kept_after_uninstall_call_torch_alone(gloo_ranks):
    """Every wrapper of the c10d and functional collectives, kept by its caller across ``uninstall()``: torch's call
    alone (nothing decided or staged, with staging forced; the bits of torch's own function), where the same
    wrapper staged the call while installed."""
    torch_alone = gloo_ranks.run(_every_op, False)
    kept = gloo_ranks.run(_every_op, True)
    for (staged, want), (_, got) in zip(torch_alone, kept):
        assert sorted(want) == sorted(got) and len(got) >= 20
        assert all(staged.values()), staged  # (the control: each staged while installed)
        for op, outcome in want.items():
            assert outcome[0] == [] and got[op] == outcome, (op, got[op], outcome)
