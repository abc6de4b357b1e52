"""Registration of reused pageable storages (``_registration``), its bookkeeping run on CPU with the driver's calls
recorded: registering needs CUDA, so ``torch.cuda.cudart()`` is a recording driver here, and the copy streams are
recording streams whose events say when the host waited for them. The registrations themselves, the copies at pinned
speed and the driver's behaviour are checked on one GPU (``test_one_gpu.py``)."""

from __future__ import annotations

import ast
import dataclasses
import gc
import itertools
import logging
import os
import threading
import types
import weakref

import pytest
import torch

from offload_shim import _config, _groups, _registration
from offload_shim._state import state

MIB = 1 << 20
CUDA = torch.device("cuda")


class Driver:
    """``torch.cuda.cudart()`` and the copy streams, recorded: every call in order, with whether the module's lock
    was held at the time. Like the driver, it holds the ranges registered: it refuses a range that overlaps one
    (712) and answers 713 for a range it does not hold. ``refuse``: error codes for the next unregister calls;
    ``before_register``: called inside each register call."""

    def __init__(self):
        self.calls, self.ranges, self.refuse, self.capturing, self.register_error = [], {}, [], False, 0
        self.before_register = None
        self.freed_registered = []  # pointers of watched storages freed while their range was registered

    def cudaHostRegister(self, pointer, nbytes, flags):
        if self.before_register is not None:
            self.before_register(pointer, nbytes)
        self.calls.append(("register", pointer, nbytes, state.registration_lock.locked()))
        if self.register_error:
            return self.register_error
        if any(start < pointer + nbytes and pointer < start + size for start, size in self.ranges.items()):
            return 712  # cudaErrorHostMemoryAlreadyRegistered
        self.ranges[pointer] = nbytes
        return 0

    def cudaHostUnregister(self, pointer):
        self.calls.append(("unregister", pointer, state.registration_lock.locked()))
        if self.refuse:
            return self.refuse.pop(0)
        return 0 if self.ranges.pop(pointer, None) is not None else _registration._NOT_REGISTERED

    def streams(self):
        driver = self

        class Event:
            def synchronize(self):
                driver.calls.append(("event waited", state.registration_lock.locked()))

        return [types.SimpleNamespace(record_event=Event)]

    def unregistered(self):
        return [call[1] for call in self.calls if call[0] == "unregister"]

    def watch(self, storage):
        """Note if ``storage`` is freed while its range is registered."""
        pointer = storage.data_ptr()
        weakref.finalize(storage, lambda: pointer in self.ranges and self.freed_registered.append(pointer))


def budget(patch, nbytes: int) -> None:
    """Registration's budget at ``nbytes`` (``register_bytes``) until ``patch`` (a pytest monkeypatch) undoes it."""
    patch.setattr(_config, "_settings", dataclasses.replace(_config.settings(), register_bytes=nbytes))


def install(recorded: Driver, patch) -> None:
    """Put ``recorded`` in the driver's place, with ``patch`` (a pytest monkeypatch), and the budget at 64 MiB."""
    patch.setattr(torch.cuda, "cudart", lambda: recorded)
    patch.setattr(torch.cuda, "is_available", lambda: True)
    patch.setattr(torch.cuda, "is_current_stream_capturing", lambda: recorded.capturing)
    patch.setattr(_groups, "copy_streams", recorded.streams)

    def device_wide(*args, **kwargs):
        raise AssertionError("the device synchronized")

    patch.setattr(torch.cuda, "synchronize", device_wide)
    patch.setattr(torch.accelerator, "synchronize", device_wide)
    budget(patch, 64 * MIB)
    state.registration_failure_logged = False


def forget_everything() -> None:
    state.registered.clear()
    state.unregistering.clear()
    state.registering.clear()
    for table in (state.staged_once, state.registration_failed, state.evicted):
        table.clear()


@pytest.fixture
def driver(monkeypatch):
    recorded = Driver()
    install(recorded, monkeypatch)
    yield recorded
    assert recorded.freed_registered == [], "memory freed while registered"
    forget_everything()


def registered(tensor, calls=2):
    """Stage ``tensor`` ``calls`` times as a pipelined call does; whether it is registered after."""
    answers = [_registration.register_for_staging(tensor, CUDA) for _ in range(calls)]
    return answers[-1]


def while_registering(driver, tensor, then):
    """Stage ``tensor`` in another thread, held inside the driver's register call while this thread runs
    ``then()``; returns what ``then()`` returns, once that thread is done."""
    started, go = threading.Event(), threading.Event()

    def held(pointer, nbytes):
        if threading.current_thread().name == "held":
            started.set()
            go.wait(5)

    driver.before_register = held
    other = threading.Thread(target=_registration.register_for_staging, args=(tensor, CUDA), name="held")
    other.start()
    try:
        assert started.wait(5)
        return then()
    finally:
        go.set()
        other.join()
        driver.before_register = None


def test_registered_at_its_second_staging_and_kept_while_used(driver):
    """A storage is registered at its second staging, not its first, with its own range, off the lock; its later
    stagings find it registered; and the table holds its storage, so its memory outlives its last tensor until the
    safe point has unregistered it."""
    tensor = torch.ones(MIB // 4)
    pointer = tensor.data_ptr()
    assert not _registration.register_for_staging(tensor, CUDA) and driver.calls == []
    assert _registration.register_for_staging(tensor, CUDA)
    assert driver.calls == [("register", pointer, MIB, False)]
    assert _registration.register_for_staging(tensor, CUDA) and len(driver.calls) == 1
    assert _registration.registered_bytes() == MIB


def test_nothing_is_registered_unless_a_budget_is_set(driver, monkeypatch):
    """With the default settings (``register_bytes`` 0) no storage is ever registered, however often it is staged:
    the driver is not called, and the caller's tensor stays pageable."""
    budget(monkeypatch, _config.Settings().register_bytes)
    tensor = torch.ones(MIB // 4)
    assert not any(_registration.register_for_staging(tensor, CUDA) for _ in range(5))
    assert driver.calls == [] and _registration.registered_bytes() == 0


def test_uninstall_unregisters_what_staging_registered(driver):
    """``uninstall()`` unregisters every storage staging registered (after the copy streams' events), the tables
    empty; ``install()`` registers again only at a storage's next second staging."""
    import offload_shim

    tensors = [torch.ones(MIB // 4), torch.ones(MIB // 2)]
    assert all(map(registered, tensors))
    try:
        offload_shim.uninstall()
        assert sorted(driver.unregistered()) == sorted(t.data_ptr() for t in tensors), driver.calls
        assert _registration.registered_bytes() == 0
    finally:
        offload_shim.install()
    assert not _registration.register_for_staging(tensors[0], CUDA)  # seen again from nothing
    assert _registration.register_for_staging(tensors[0], CUDA)


def test_freed_storage_unregistered_at_the_next_safe_point_not_by_a_finalizer(driver):
    """A registered storage whose last tensor goes is neither unregistered nor freed there (no finalizer does
    anything; its memory stays allocated); the next safe point waits for the copy streams' events, off the lock, then
    unregisters it, off the lock, once, and only then lets the storage go. A storage still used by a view is kept."""
    tensor = torch.ones(MIB // 4)
    pointer = tensor.data_ptr()
    assert registered(tensor)
    storage = weakref.ref(tensor.untyped_storage())
    view = tensor[1:]
    del tensor
    gc.collect()
    _registration.drain()
    assert driver.unregistered() == [] and storage() is not None  # a view still uses it
    del view
    gc.collect()
    assert driver.calls[1:] == [] and storage() is not None  # nothing done at the free: memory kept allocated
    assert _registration.registered_bytes() == MIB
    _registration.drain()
    assert driver.calls[1:] == [("event waited", False), ("unregister", pointer, False)], driver.calls
    assert storage() is None and _registration.registered_bytes() == 0  # let go after, and freed
    _registration.drain()
    assert len(driver.calls) == 3  # undone once


def test_no_unregistering_during_a_capture(driver):
    """During this thread's CUDA graph capture the safe point does nothing; the first one after it unregisters."""
    tensor = torch.ones(MIB // 4)
    pointer = tensor.data_ptr()
    assert registered(tensor)
    del tensor
    driver.capturing = True
    _registration.drain()
    _registration.unregister_all()
    assert driver.unregistered() == [] and _registration.registered_bytes() == MIB
    driver.capturing = False
    _registration.drain()
    assert driver.unregistered() == [pointer]


def test_refused_unregistering_kept_for_the_next_safe_point(driver):
    """A range the driver refuses to unregister (another thread's capture in global mode, say) stays registered
    and pending, its storage held, until a later safe point undoes it; one the driver no longer holds (713) is not
    retried."""
    tensor = torch.ones(MIB // 4)
    pointer = tensor.data_ptr()
    assert registered(tensor)
    storage = weakref.ref(tensor.untyped_storage())
    del tensor
    driver.refuse = [900]
    _registration.drain()
    assert driver.unregistered() == [pointer] and storage() is not None and _registration.registered_bytes() == MIB
    _registration.drain()
    assert driver.unregistered() == [pointer] * 2 and storage() is None and _registration.registered_bytes() == 0
    again = torch.ones(MIB // 4)
    assert registered(again)
    del again
    driver.refuse = [_registration._NOT_REGISTERED]
    _registration.drain()
    _registration.drain()
    assert len(driver.unregistered()) == 3 and not state.unregistering


def test_resized_storage_old_range_unregistered(driver):
    """A registered storage resized (its old memory freed by the resize) has its old range unregistered at the next
    safe point, and the storage in its new memory is registered afresh at its own second staging after."""
    tensor = torch.ones(MIB // 4)
    old = tensor.data_ptr()
    assert registered(tensor)
    tensor.resize_(MIB)
    assert tensor.data_ptr() != old
    assert not _registration.register_for_staging(tensor, CUDA)  # its safe point: the old range undone first
    assert driver.unregistered() == [old] and _registration.registered_bytes() == 0
    assert _registration.register_for_staging(tensor, CUDA)
    assert driver.calls[-1] == ("register", tensor.data_ptr(), 4 * MIB, False)


def test_budget_unregisters_the_least_recently_staged(driver, monkeypatch):
    """Registering beyond the budget unregisters the least recently staged storage first (before the new range is
    registered); a storage unregistered for room is registered again only into free room; a lowered budget
    unregisters at the next staging; one larger than the budget never is registered."""
    budget(monkeypatch, 2 * MIB)
    a, b, c = (torch.ones(MIB // 4) for _ in range(3))
    assert registered(a) and registered(b)
    assert registered(a, calls=1)  # a is now the most recently staged
    assert registered(c)
    names = {a.data_ptr(): "a", b.data_ptr(): "b", c.data_ptr(): "c"}
    order = [(call[0], names[call[1]]) for call in driver.calls if call[0] != "event waited"]
    assert order == [("register", "a"), ("register", "b"), ("unregister", "b"), ("register", "c")], order
    assert not registered(b, calls=3)  # evicted once: only into free room
    budget(monkeypatch, 0)
    assert not _registration.register_for_staging(a, CUDA)
    assert sorted(names[p] for p in driver.unregistered()) == ["a", "b", "c"] and _registration.registered_bytes() == 0
    budget(monkeypatch, MIB // 2)
    assert not registered(torch.ones(MIB // 4), calls=3)


def test_failed_registration_logs_once_and_stays_pageable(driver, caplog):
    """A failed cudaHostRegister (a driver's or container's limit) leaves the storage unregistered, is not retried
    for it, and logs one warning for the process, never an error."""
    driver.register_error = 2  # cudaErrorMemoryAllocation
    with caplog.at_level(logging.WARNING, logger="offload_shim"):
        first, second = torch.ones(MIB // 4), torch.ones(MIB // 4)
        assert not registered(first, calls=4) and not registered(second, calls=4)
    assert [call[0] for call in driver.calls] == ["register", "register"]  # once for each storage
    warnings = [r for r in caplog.records if "cudaHostRegister failed" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert _registration.registered_bytes() == 0


def test_bookkeeping_flat_over_many_calls(driver):
    """1,000 stagings of fresh storages register nothing and leave nothing behind; 1,000 of one reused storage keep
    one registration of its size."""
    for _ in range(1000):
        assert not _registration.register_for_staging(torch.ones(1024), CUDA)
    gc.collect()
    assert _registration.registered_bytes() == 0 and len(state.staged_once) == 0 and driver.calls == []
    reused = torch.ones(1024)
    for _ in range(1000):
        _registration.register_for_staging(reused, CUDA)
    assert _registration.registered_bytes() == reused.nbytes and len(driver.calls) == 1


def test_fork_child_neither_uses_nor_undoes_the_parents_registrations(driver):
    """A child made by fork() starts with empty tables: its staging finds nothing registered, and its safe points
    and frees call the driver for none of the parent's registrations; the parent's table is untouched."""
    tensor = torch.ones(MIB // 4)
    assert registered(tensor)
    before = len(driver.calls)
    child = os.fork()
    if child == 0:  # report through the exit status only
        ok = not state.registered and _registration.registered_bytes() == 0
        del tensor
        _registration.drain()
        _registration.unregister_all()
        os._exit(0 if ok and len(driver.calls) == before else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert list(state.registered) == [tensor.data_ptr()] and len(driver.calls) == before


def test_interruptions_lose_no_registration(driver, monkeypatch):
    """An exception (a KeyboardInterrupt) at any step of the safe point or of a registration leaves no range
    registered that the tables do not hold: the storage is not freed while registered, and a later safe point
    undoes the range."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    # In the safe point, before the driver is reached, and after a refusal (in clearing the driver's error).
    for step in ("cudart", "clear error"):
        tensor = torch.ones(MIB // 4)
        assert registered(tensor)
        driver.watch(tensor.untyped_storage())
        del tensor
        with monkeypatch.context() as patch:
            if step == "cudart":
                patch.setattr(torch.cuda, "cudart", interrupted)
            else:
                driver.refuse = [900]
                patch.setattr(_registration, "_clear_error", interrupted)
            with pytest.raises(KeyboardInterrupt):
                _registration.drain()
        gc.collect()
        assert driver.freed_registered == [] and _registration.registered_bytes() == MIB, step
        _registration.drain()
        assert driver.ranges == {} and _registration.registered_bytes() == 0, step
    # Just after the driver registered the range.
    tensor = torch.ones(MIB // 4)
    _registration.register_for_staging(tensor, CUDA)
    driver.watch(tensor.untyped_storage())
    register = driver.cudaHostRegister

    def then_interrupted(pointer, nbytes, flags):  # the driver's call done, the shim interrupted on its return
        register(pointer, nbytes, flags)
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(driver, "cudaHostRegister", then_interrupted)
        with pytest.raises(KeyboardInterrupt):
            _registration.register_for_staging(tensor, CUDA)
    assert driver.ranges == {tensor.data_ptr(): MIB} and _registration.registered_bytes() == MIB
    del tensor
    gc.collect()
    _registration.drain()
    assert driver.ranges == {} and _registration.registered_bytes() == 0
    # While the budget evicts (marking a storage evicted).
    kept = [torch.ones(MIB // 4) for _ in range(2)]
    assert all(registered(t) for t in kept)
    for t in kept:
        driver.watch(t.untyped_storage())

    class Interrupting(weakref.WeakKeyDictionary):
        def __setitem__(self, key, value):
            raise KeyboardInterrupt

    monkeypatch.setattr(state, "evicted", Interrupting())
    budget(monkeypatch, MIB)
    with pytest.raises(KeyboardInterrupt):
        _registration.register_for_staging(kept[1], CUDA)
    del kept
    gc.collect()
    _registration.unregister_all()
    assert driver.ranges == {} and _registration.registered_bytes() == 0


def test_concurrent_registrations_keep_the_budget_and_do_not_race(driver, monkeypatch, caplog):
    """A registration in another thread while one is under way stays within the budget together with it (the one
    under way counts, and cannot be evicted); two threads staging one storage register it once, neither failing nor
    logging."""
    budget(monkeypatch, 2 * MIB)
    tensors = [torch.ones(2 * MIB // 4) for _ in range(2)]  # each fills the budget alone
    for tensor in tensors:
        _registration.register_for_staging(tensor, CUDA)  # (first staging: seen)

    assert not while_registering(driver, tensors[0], lambda: _registration.register_for_staging(tensors[1], CUDA))
    assert driver.ranges == {tensors[0].data_ptr(): 2 * MIB} and _registration.registered_bytes() == 2 * MIB
    budget(monkeypatch, 64 * MIB)
    one = torch.ones(MIB // 4)
    _registration.register_for_staging(one, CUDA)
    with caplog.at_level(logging.WARNING, logger="offload_shim"):
        # (the other thread's registration is under way: its answer stands)
        assert not while_registering(driver, one, lambda: _registration.register_for_staging(one, CUDA))
    registers = [call[1] for call in driver.calls if call[0] == "register"]
    assert registers == [tensors[0].data_ptr(), one.data_ptr()] and one.data_ptr() in driver.ranges, registers
    assert one.untyped_storage() not in state.registration_failed and not caplog.records
    assert _registration.register_for_staging(one, CUDA)


def test_failed_registration_gives_back_the_room_it_took(driver, monkeypatch):
    """A registration that fails after making room leaves the storages it evicted free to come back at their next
    stagings (not held to free room), and the budget is not left idle for long."""
    budget(monkeypatch, 2 * MIB)
    a, b, c = (torch.ones(MIB // 4) for _ in range(3))
    assert registered(a) and registered(b)
    driver.register_error = 1
    assert not registered(c)
    driver.register_error = 0
    assert a.untyped_storage() not in state.evicted and c.untyped_storage() in state.registration_failed
    assert registered(a) and _registration.registered_bytes() == 2 * MIB


def test_stale_answer_of_a_registration_raced_by_eviction(driver, monkeypatch, caplog):
    """A registration under way is not evicted by another thread's registration (which then waits for room), so
    it is neither undone behind its back nor answered by a second registration of the same memory."""
    budget(monkeypatch, 2 * MIB)
    small, large = torch.ones(MIB // 4), torch.ones(2 * MIB // 4)
    _registration.register_for_staging(small, CUDA)
    _registration.register_for_staging(large, CUDA)
    with caplog.at_level(logging.WARNING, logger="offload_shim"):
        answers = while_registering(
            driver, small, lambda: [_registration.register_for_staging(t, CUDA) for t in (large, small, small)])
    assert answers == [False, False, False] and driver.ranges == {small.data_ptr(): MIB}, (answers, driver.ranges)
    assert list(state.registered) == [small.data_ptr()] and not caplog.records
    assert small.untyped_storage() not in state.registration_failed


def test_budget_counts_ranges_not_yet_undone(driver, monkeypatch):
    """Ranges taken off the table but not yet unregistered (the driver refused) still count against the budget: no
    new registration into room they hold."""
    budget(monkeypatch, 2 * MIB)
    old = torch.ones(2 * MIB // 4)
    assert registered(old)
    del old
    driver.refuse = [900] * 3
    new = torch.ones(2 * MIB // 4)
    assert not registered(new)
    assert sum(driver.ranges.values()) == 2 * MIB and _registration.registered_bytes() == 2 * MIB
    _registration.drain()
    assert driver.ranges == {} and registered(new) and _registration.registered_bytes() == 2 * MIB


def test_an_interruption_at_any_line_loses_no_registration(monkeypatch):
    """A KeyboardInterrupt raised at each line the module runs in turn (each scenario run once for each line, until
    it runs through): right after it, every range the driver holds is on the table or pending; once the program goes
    on (its tensors dropped, safe points, unregister_all), nothing stays registered, no storage was freed while
    registered, and the tables are empty."""
    import sys

    source = _registration.__file__
    with open(source) as module:
        tree = ast.parse(module.read())
    # Lines where an injected exception would land where CPython delivers no signal: a with statement's line, which
    # the tracer sees again on the way out, before the context manager's exit; a finally clause's lines (a signal
    # is delivered there only once a call has returned, the cleanup it made done).
    untouched = {node.lineno for node in ast.walk(tree) if isinstance(node, ast.With)} | {
        inner.lineno for node in ast.walk(tree) if isinstance(node, ast.Try)
        for statement in node.finalbody for inner in ast.walk(statement) if hasattr(inner, "lineno")}

    def scenario(name, driver):
        tensor = torch.ones(MIB // 4)
        driver.watch(tensor.untyped_storage())
        if name == "register":
            _registration.register_for_staging(tensor, CUDA)
            return [tensor], lambda: _registration.register_for_staging(tensor, CUDA)
        assert registered(tensor)
        if name == "register, evicting":
            other = torch.ones(MIB // 4)
            driver.watch(other.untyped_storage())
            _registration.register_for_staging(other, CUDA)
            budget(patch, MIB)  # (the loop's patch, undone with the loop's install)
            return [tensor, other], lambda: _registration.register_for_staging(other, CUDA)
        if name == "unregister_all":
            return [tensor], _registration.unregister_all
        del tensor  # the safe point of a freed storage, its unregister accepted or refused
        driver.refuse = [900] if name == "safe point, refused" else []
        return [], _registration.drain

    cases = 0
    for name in ("register", "register, evicting", "unregister_all", "safe point", "safe point, refused"):
        for line in itertools.count(1):
            recorded = Driver()
            with monkeypatch.context() as patch:
                install(recorded, patch)
                keep, call = scenario(name, recorded)
                seen = [0]

                def trace(frame, event, arg):
                    if frame.f_code.co_filename != source:
                        return None

                    def each(frame, event, arg):
                        if event == "line" and frame.f_lineno not in untouched:
                            seen[0] += 1
                            if seen[0] == line:
                                raise KeyboardInterrupt(f"{frame.f_code.co_name}, line {frame.f_lineno}")
                        return each

                    return each

                sys.settrace(trace)
                try:
                    call()
                    interrupted = None
                except KeyboardInterrupt as raised:
                    interrupted = str(raised)
                finally:
                    sys.settrace(None)
                tracked = set(state.registered) | {p for p, _, _ in state.unregistering}
                assert set(recorded.ranges) <= tracked, (name, interrupted, recorded.ranges, tracked)
                keep.clear()
                budget(patch, 64 * MIB)
                _registration.drain()
                _registration.unregister_all()
                assert recorded.freed_registered == [] and recorded.ranges == {}, (name, interrupted)
                assert not (state.registered or state.unregistering or state.registering), (
                    name, interrupted)
                assert not state.registration_lock.locked(), (name, interrupted)
                forget_everything()
            if interrupted is None:
                break
            cases += 1
    print(f"interruptions tried: {cases}")
    assert cases > 50
