"""The process's state: every table, lock, pool and thread offload_shim keeps as it stages, in one object
(:data:`state`), and the one at-fork hook that gives a forked child a new one.

A child made by ``fork()`` has none of its parent's threads: a lock one of them held is held for ever, the copy
threads, lanes and writer of dropped handles never run, and the calls in flight never complete. So the child's
:data:`state` starts afresh (:meth:`State.renew`), and its first staged call starts from empty tables. What the
parent's state held (pinned host buffers, accelerator memory, events, CUDA graphs, calls in flight) is kept, never
freed in the child: freeing it would reach the accelerator's runtime, which a forked child cannot use. torch's
pinned memory, freed, records an event on each stream that copied it; CUDA answers ``cudaErrorInitializationError``
in a forked child, and the ``c10::AcceleratorError`` thrown from that deleter ends the child (status 6). A
DataLoader worker is such a child.

What stays module-level, each inherited by a forked child as it is, as the child inherits torch's own functions:
``_config._settings`` (the settings in force, immutable, replaced whole by ``configure()``) and ``_config._forgetting``
(what a change of them empties); ``_patching``'s bindings and ``_kernels._libraries`` (which wrappers are in place);
``_communicators._specs`` (the communicators registered); ``_counters._summary_registered``,
``_kernels._hooked`` and ``_startup._activated`` (steps done once per process), ``_startup._to_warn`` (start-up's
warnings, until said); ``_interrupts._replaced`` (the SIGINT handler the shim's note stands in for); and this
module's own lists: the resets, what children keep, wrapt's lock while held across a fork. Reloading the package's internal modules is not supported (torch's are not reloadable either).
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import os
import queue
import sys
import threading
import weakref
from typing import Callable

from torch.utils.weak import WeakIdKeyDictionary


class _Thread(threading.local):
    """What each thread keeps: its staged calls running (a collective called from inside one is not staged
    again), its small-call slots by device, and its last staging decision (for the counters)."""

    def __init__(self):
        self.depth = 0
        self.slots: dict = {}  # torch.device -> _staging._SmallSlot
        self.decision = None  # (route, device, note, perf_counter()) of _counters.decided


class State:
    """Every table, lock, pool and thread of the process (see the module docstring), by the module that uses it."""

    def __init__(self):
        self.thread = _Thread()
        # Locks around install and uninstall (_patching, one at a time, whole), the kernels, configure().
        self.patching_lock = threading.RLock()
        self.kernels_lock = threading.Lock()
        self.config_lock = threading.Lock()
        # _devices: one record per process group (_devices.Group), by the group's identity; usable devices.
        self.groups: dict = {}  # id(group) -> _devices.Group
        self.groups_lock = threading.Lock()
        self.answers_lock = threading.Lock()  # (_groups: a record's served-path answer kept or dropped)
        self.usable_devices: dict = {}  # torch.device -> bool
        # _groups: the staging pools.
        self.idle_pools: dict = {}  # (device, kind) -> [Pool]
        self.busy_pools: list = []
        self.pools_lock = threading.Lock()
        self.pool_generation = 0  # pools of an older generation are freed, not reused
        # _staging: the host-copy threads, the small-call slots' generation, outstanding writes, dropped handles.
        self.copy_pool = None  # a ThreadPoolExecutor, made at the first threaded host copy
        self.copy_pool_lock = threading.Lock()
        self.slot_generation = 0
        self.pending_writes: dict = {}  # storage address -> {token: (spans of host memory, finish)}
        self.pending_lock = threading.RLock()
        self.tokens = itertools.count()
        self.unwaited = queue.SimpleQueue()  # calls whose handles were dropped unwaited
        self.writer = None  # the thread that finishes them, once started
        self.writer_lock = threading.Lock()
        # _execute: agreement constants by (device, code); caller's tensors' flat views; stream-ordered backends.
        self.agreements: dict = {}
        self.flats = WeakIdKeyDictionary()
        # _replay: captured small calls.
        self.replay_lock = threading.Lock()
        self.captures: dict = {}  # key -> _Capture, or None where a key cannot be captured
        self.replay_seen: dict = {}  # key -> calls so far, until captured
        self.captures_by_identity: dict = {}
        self.retired_captures: list = []  # (event, capture): dropped, kept until their last replay is done
        self.streams: dict = {}  # (device index, raw stream) -> its Stream object
        # _registration: the caller's storages registered with the accelerator.
        self.registration_lock = threading.Lock()
        self.registered = collections.OrderedDict()  # pointer -> (storage, bytes), least recently staged first
        self.unregistering: list = []  # (pointer, bytes, storage) taken off the table, not yet undone
        self.registering: set = set()  # pointers whose registration is under way
        self.staged_once = weakref.WeakKeyDictionary()  # storages staged once, not registered
        self.registration_failed = weakref.WeakKeyDictionary()
        self.evicted = weakref.WeakKeyDictionary()  # unregistered for room: again only into free room
        self.registration_failure_logged = False
        # _counters: staged calls counted, call sites logged, replayed calls' per-thread tallies.
        self.counters_lock = threading.Lock()
        self.counters: dict = {}  # (op, route, mode) -> [calls, bytes, seconds]
        self.logged_sites: set = set()
        self.tallies: list = []
        # _interrupts: SIGINT held back by the main thread, and the frames of those noted meanwhile.
        self.sigint_held: list = []
        self.sigint_caught: list = []

    def renew(self) -> None:
        """In a forked child: keep everything this state holds for the rest of the process (never freed, see the
        module docstring) and start afresh."""
        keep(dict(vars(self)))
        self.__init__()


state = State()
_after_fork: list[Callable[[], None]] = []  # (see after_fork)
_kept: list = []  # what children keep of their parents' state: a reference the interpreter never drops, so that
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_kept))  # it outlives the child's own exit, where modules are torn down


def keep(*objects) -> None:
    """Keep ``objects`` for the rest of the process's life, never freed (a parent's, in a forked child)."""
    _kept.append(objects)


def after_fork(reset: Callable[[], None]) -> Callable[[], None]:
    """Decorator: run ``reset()`` in every forked child, after :data:`state` is renewed (for what a new state does
    not give: a signal handler put back)."""
    _after_fork.append(reset)
    return reset


# Held across fork() by the forking thread, so that no other thread is part way through them at the fork (a child
# would be left half-installed, or with wrapt's lock held for ever, stopping its first import): install() and
# uninstall() (the patching lock), and the import hooks the shim registers with wrapt (wrapt's own lock; a private
# name of wrapt's, where it has one). Taken in the order install() takes them.
_held: list = []  # wrapt's lock while this thread holds it across a fork


def _before() -> None:
    state.patching_lock.acquire()
    lock = getattr(sys.modules.get("wrapt.importer"), "_post_import_hooks_lock", None)
    if lock is not None:
        lock.acquire()
        _held.append(lock)


def _in_parent() -> None:
    while _held:
        _held.pop().release()
    state.patching_lock.release()


def _in_child() -> None:
    while _held:
        _held.pop().release()  # (this thread's, as in the parent: the child runs on the forking thread)
    state.renew()  # (the old patching lock, held by this thread, is kept with the rest; the new one is free)
    for reset in _after_fork:
        reset()


if hasattr(os, "register_at_fork"):  # (not on Windows)
    os.register_at_fork(before=_before, after_in_parent=_in_parent, after_in_child=_in_child)
