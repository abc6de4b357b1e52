"""What the tests observe of offload_shim inside a rank: its staging decisions (logged at DEBUG on logger
``offload_shim``, with the record attributes ``offload_shim_collective`` and ``offload_shim_device``), the calls
it makes of a torch function, and settings changed for one block (the shim's, or Ctrl-C's handler)."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import signal

import offload_shim


class StagingRecorder(logging.Handler):
    """Records each staging decision: its device, or ``(collective, device)`` with ``collectives=True``."""

    def __init__(self, collectives: bool = False):
        super().__init__(logging.DEBUG)
        self.collectives = collectives
        self.records = []

    def emit(self, record):
        device = getattr(record, "offload_shim_device", None)
        if device is not None:
            self.records.append((record.offload_shim_collective, device) if self.collectives else device)


@contextlib.contextmanager
def recording_staging(collectives: bool = False):
    """Yields the list that the staging decisions made inside the block are appended to."""
    logger = logging.getLogger("offload_shim")
    recorder, level = StagingRecorder(collectives), logger.level
    logger.addHandler(recorder)
    logger.setLevel(logging.DEBUG)
    try:
        yield recorder.records
    finally:
        logger.removeHandler(recorder)
        logger.setLevel(level)


@contextlib.contextmanager
def configured(**settings):
    """``offload_shim.configure(**settings)`` for the block; the settings as they were afterwards."""
    previous = offload_shim.configure(**settings)
    try:
        yield
    finally:
        offload_shim.configure(**dataclasses.asdict(previous))


@contextlib.contextmanager
def counting_calls(module, name: str):
    """Yields a list that gets one entry for each call of ``module.name`` made inside the block (the function bound
    there when the block starts, called through); binds that function back afterwards. ``module`` may be a class
    (a method, counted where it is looked up on the class: ``type(group).allreduce(group, ...)``); what its own
    namespace held is put back as it was (a method of a pybind class is bound through that object)."""
    original = getattr(module, name)
    saved = vars(module).get(name, original)
    calls = []

    def counted(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    setattr(module, name, counted)
    try:
        yield calls
    finally:
        setattr(module, name, saved)


@contextlib.contextmanager
def ctrl_c_raising():
    """SIGINT raises ``KeyboardInterrupt`` inside the block (Python's own handler), whatever this process inherited;
    the handler as it was afterwards. Also a decorator, for a test function a rank runs (still importable by name).

    A shell starts a background job (``python -m pytest > log 2>&1 &``, ``nohup``, some CI runners) with SIGINT
    ignored, every process it starts inherits that (the ranks too: a spawned process keeps an ignored signal
    ignored), and Python installs its handler only where SIGINT was not ignored at start: there a test's SIGINT
    would be ignored, and its ``KeyboardInterrupt`` never come."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if previous is not None:  # (None: a handler set outside Python, which Python cannot put back)
            signal.signal(signal.SIGINT, previous)


def rss_bytes() -> int:
    """This process's resident host memory, in bytes (Linux), after the C allocator has handed back what it holds
    freed (glibc's ``malloc_trim``): what the process keeps, not where the allocator's caching stands."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # another C library: RSS as it is
        pass
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
