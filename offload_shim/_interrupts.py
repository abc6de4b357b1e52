"""Ctrl-C held back while a staged call runs, as torch holds it back while its collective runs.

torch runs a collective as one C++ call: a ``KeyboardInterrupt`` that arrives during it is raised once it returns,
its results written. A staged call runs Python between its steps (copies in, the collective or a pipelined call's
chunks, copies back; before a group's first staged call, the ranks' agreement on their settings): interrupted there,
this rank would stop part way, the caller's tensor without its result or half-written, and where other collectives
were still to come, its peers would go on and the group's next collective would pair with the wrong one (Gloo
aborts the process). From the first step (:func:`hold`) to the end of the call (:func:`release`, by the executor),
Python's SIGINT handler in the main thread is replaced by one that notes the signal; the handler it replaced then
runs: ``KeyboardInterrupt`` is raised there, as after torch's call. Another thread's calls, and a SIGINT that Python
does not handle (``SIG_IGN``, ``SIG_DFL``), are left as they are. Both steps together cost about 0.3 us (on the
2-core CPU machine). An asynchronous call is held until it returns its handle, and the handle's ``wait()``, which
writes the results, until they are written."""

from __future__ import annotations

import _signal  # (signal's own C module: signal.signal and signal.getsignal add enum conversions, 20 times slower)
import contextlib
import signal
import threading

from offload_shim import _fork

SIGINT = int(signal.SIGINT)
_held: list = []  # [the handler replaced] while the main thread holds SIGINT back
_caught: list = []  # [the frame of each SIGINT noted meanwhile]
_main = threading.main_thread


def _note(signum, frame) -> None:
    _caught.append(frame)


def hold() -> None:
    """Hold SIGINT back until :func:`release` (holding already, or outside the main thread: nothing)."""
    if _held or threading.get_ident() != _main().ident:
        return
    previous = _signal.getsignal(SIGINT)
    if callable(previous):
        _signal.signal(SIGINT, _note)
        _held.append(previous)


def release() -> None:
    """Put the SIGINT handler back, and run it for a SIGINT held back meanwhile (Python's raises
    ``KeyboardInterrupt``, here)."""
    if not _held or threading.get_ident() != _main().ident:
        return
    previous = _held.pop()
    _signal.signal(SIGINT, previous)
    if _caught:
        frame = _caught[0]
        _caught.clear()
        previous(SIGINT, frame)


@_fork.after_fork
def _put_back_after_fork() -> None:
    """A child forked while the main thread held SIGINT back (from another thread) would never release it: its
    handler is put back."""
    if _held:
        _signal.signal(SIGINT, _held.pop())
        _caught.clear()


@contextlib.contextmanager
def held():
    """Hold SIGINT back for the block, unless held already (then until that hold's :func:`release`)."""
    outer = bool(_held)
    hold()
    try:
        yield
    finally:
        if not outer:
            release()
